// bench_sgemm.c: the machine's SGEMM rate at a training step's shapes, the "peak" bench/speed.py
// compares whole steps against. Runs OpenBLAS's threaded cblas_sgemm and oneDNN's threaded
// dnnl_sgemm (what vlmoe calls, one block per thread) in their best case (one call, all
// threads) on the forward and backward products of one transformer block (tokens x width x
// mlp) and prints each library's FLOP-weighted rate as one JSON line, with the rate of vlmoe's
// own AVX2 product (src/ops/gemm_f32.c, single-threaded calls on one block of C's rows or
// columns per thread, as vlmoe runs it) where the CPU has AVX2 and FMA3, and then OpenBLAS's
// and oneDNN's rates on one 2048 x 2048 x 2048 product, the libraries' best case.
// Usage: bench_sgemm [tokens width mlp threads reps]
#include <cblas.h>
#include <dnnl.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench.h"
#include "ops/gemm_f32.h"

typedef struct { int ta, tb, M, N, K; } shape;

// The instruction set oneDNN dispatches its kernels for on this CPU.
static const char *onednn_isa(void) {
    switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
    case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core: return "avx512_core";
    case dnnl_cpu_isa_avx2_vnni: return "avx2_vnni";
    case dnnl_cpu_isa_avx2: return "avx2";
    default: return "other";
    }
}

// Each library's best time (over reps rounds after one that warms caches and thread pools) for
// the products S[0..ns) run one after another on all threads: 0 OpenBLAS's threaded
// cblas_sgemm, 1 oneDNN's dnnl_sgemm, and, where libs is 3, 2 vlmoe's AVX2 product in one
// block of the larger dimension per thread. lda and ldb are the operands' own widths.
static void time_libs(const shape *S, int ns, int libs, int threads, int reps, const float *A, const float *B,
                      float *C, double *best) {
    for (int r = 0; r < reps + 1; r++) {
        for (int lib = 0; lib < libs; lib++) {
            double t0 = bench_now();
            for (int i = 0; i < ns; i++) {
                const shape *s = &S[i];
                const int lda = s->ta ? s->M : s->K, ldb = s->tb ? s->K : s->N;
                if (lib == 0)
                    cblas_sgemm(CblasRowMajor, s->ta ? CblasTrans : CblasNoTrans,
                                s->tb ? CblasTrans : CblasNoTrans, s->M, s->N, s->K, 1.0f, A, lda, B,
                                ldb, 0.0f, C, s->N);
                else if (lib == 2) {
                    // one block of the larger dimension per thread
                    const int rows = s->M >= s->N, dim = rows ? s->M : s->N, bs = (dim + threads - 1) / threads;
#pragma omp parallel for schedule(static)
                    for (int b = 0; b < threads; b++) {
                        const int o = b * bs, m = dim - o < bs ? dim - o : bs;
                        if (m <= 0) continue;
                        if (rows)
                            gemm_f32(s->ta, s->tb, m, s->N, s->K, 1.0f, s->ta ? A + o : A + (size_t)o * lda,
                                     lda, B, ldb, 0.0f, C + (size_t)o * s->N, s->N);
                        else
                            gemm_f32(s->ta, s->tb, s->M, m, s->K, 1.0f, A, lda,
                                     s->tb ? B + (size_t)o * ldb : B + o, ldb, 0.0f, C + o, s->N);
                    }
                } else
                    dnnl_sgemm(s->ta ? 'T' : 'N', s->tb ? 'T' : 'N', s->M, s->N, s->K, 1.0f, A, lda, B,
                               ldb, 0.0f, C, s->N);
            }
            double t = bench_now() - t0;
            if (r > 0 && t < best[lib]) best[lib] = t;
        }
    }
}

int main(int argc, char **argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 5120, D = argc > 2 ? atoi(argv[2]) : 256;
    const int Mh = argc > 3 ? atoi(argv[3]) : 1024, threads = argc > 4 ? atoi(argv[4]) : 2;
    const int reps = argc > 5 ? atoi(argv[5]) : 5;
    omp_set_num_threads(threads);
    openblas_set_num_threads(threads);
    // forward x.W^T, backward dY.W and dY^T.X, for qkv (3D), out (D), fc1 (M), fc2 (D from M)
    const shape S[] = {
        {0, 1, n, 3 * D, D}, {0, 0, n, D, 3 * D}, {1, 0, 3 * D, D, n},
        {0, 1, n, D, D},     {0, 0, n, D, D},     {1, 0, D, D, n},
        {0, 1, n, Mh, D},    {0, 0, n, D, Mh},    {1, 0, Mh, D, n},
        {0, 1, n, D, Mh},    {0, 0, n, Mh, D},    {1, 0, D, Mh, n},
    };
    const int ns = sizeof(S) / sizeof(S[0]);
    size_t big = (size_t)n * (Mh > 3 * D ? Mh : 3 * D);
    float *A = malloc(4 * big), *B = malloc(4 * big), *C = malloc(4 * big);
    for (size_t i = 0; i < big; i++) A[i] = (float)(i % 7) * 0.1f, B[i] = (float)(i % 5) * 0.1f;
    double flops = 0, best[3] = {1e30, 1e30, 1e30};
    const int libs = gemm_f32_supported() ? 3 : 2;
    for (int i = 0; i < ns; i++) flops += 2.0 * S[i].M * S[i].N * S[i].K;
    time_libs(S, ns, libs, threads, reps, A, B, C, best);
    // Each library's ceiling: one large square product (2048^3, 17 GFLOP), the shape BLAS
    // libraries are tuned for, on all threads. What a whole step's products could reach at best.
    const int Q = 2048;
    float *QA = malloc(4 * (size_t)Q * Q), *QB = malloc(4 * (size_t)Q * Q), *QC = malloc(4 * (size_t)Q * Q);
    double qbest[2] = {1e30, 1e30};
    if (!QA || !QB || !QC) {
        fprintf(stderr, "bench_sgemm: out of memory for the %d^3 product\n", Q);
        free(A), free(B), free(C), free(QA), free(QB), free(QC);
        return 1;
    }
    for (size_t i = 0; i < (size_t)Q * Q; i++) QA[i] = (float)(i % 7) * 0.1f, QB[i] = (float)(i % 5) * 0.1f;
    const shape sq = {0, 0, Q, Q, Q};
    time_libs(&sq, 1, 2, threads, reps, QA, QB, QC, qbest);
    const double qflops = 2.0 * Q * Q * Q;
    printf("{\"threads\": %d, \"openblas_core\": \"%s\", \"openblas_gflops\": %.1f, "
           "\"onednn_gflops\": %.1f, \"onednn_isa\": \"%s\", \"vlmoe_avx2_gflops\": %.1f, "
           "\"openblas_square_gflops\": %.1f, \"onednn_square_gflops\": %.1f}\n", threads,
           openblas_get_corename(), flops / best[0] * 1e-9, flops / best[1] * 1e-9, onednn_isa(),
           libs > 2 ? flops / best[2] * 1e-9 : 0.0, qflops / qbest[0] * 1e-9, qflops / qbest[1] * 1e-9);
    free(A), free(B), free(C), free(QA), free(QB), free(QC);
    return 0;
}
