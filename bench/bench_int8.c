// bench_int8.c: the int8 inference products on this CPU, against what bounds them. Prints one
// JSON line with, at an encoder MLP's shapes (tokens x width x mlp; fc1 then fc2):
//   peak_gops      the register-only rate of the AVX2 kernel's inner step (vpmaddubsw,
//                  vpmaddwd by ones, vpaddd: 32 multiply-adds, 4 x 2 of them), every thread;
//   onednn_gops    oneDNN's u8 x s8 gemm (dnnl_gemm_u8s8s32, int32 out) on blocks of 128 rows,
//                  one single-threaded call per block as vlmoe runs its blocks: the products
//                  alone, no quantizing, no scales;
//   vlmoe_gops     vlmoe's linear_forward_int8, the whole operation: each block's rows
//                  quantized, multiplied, scaled, with the bias;
//   vlmoe_mlp_gops experts_forward_int8 on one expert: both products, GELU (tanh) between.
// Medians of reps runs. On a VNNI CPU vlmoe runs oneDNN's brgemm instead, and the peak printed
// is still the AVX2 sequence's. Usage: bench_int8 [tokens width mlp threads reps]
#include <dnnl.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench.h"
#include "core/core.h"
#include "ops/gemm_int8.h"
#include "ops/ops.h"
#include "vlmoe.h"

// Operations a second of `loops` rounds of the AVX2 kernel's inner step without its loads, on
// every thread: 4 x 2 accumulators acc += vpmaddwd(vpmaddubsw(a_i, b_j), 1), all in registers
// (in assembly: compiled from intrinsics, the accumulators went to the stack).
#define MAC(a, b, c) "vpmaddubsw %%ymm" b ", %%ymm" a ", %%ymm15\n\tvpmaddwd %%ymm14, %%ymm15, %%ymm15\n\t" \
                     "vpaddd %%ymm15, %%ymm" c ", %%ymm" c "\n\t"
__attribute__((target("avx2"))) static double peak(long loops) {
    const double t0 = bench_now();
#pragma omp parallel
    {
        long n = loops;
        __asm__ volatile("vpcmpeqw %%ymm14, %%ymm14, %%ymm14\n\tvpsrlw $15, %%ymm14, %%ymm14\n\t" // ones
                         "vpxor %%ymm8, %%ymm8, %%ymm8\n\tvpxor %%ymm9, %%ymm9, %%ymm9\n\t"
                         "vpxor %%ymm10, %%ymm10, %%ymm10\n\tvpxor %%ymm11, %%ymm11, %%ymm11\n\t"
                         "vpxor %%ymm12, %%ymm12, %%ymm12\n\tvpxor %%ymm13, %%ymm13, %%ymm13\n"
                         "1:\n\t" MAC("8", "12", "0") MAC("8", "13", "1") MAC("9", "12", "2") MAC("9", "13", "3")
                         MAC("10", "12", "4") MAC("10", "13", "5") MAC("11", "12", "6") MAC("11", "13", "7")
                         "dec %0\n\tjnz 1b\n\tvzeroupper"
                         : "+r"(n)
                         :
                         : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                           "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
    }
    return omp_get_max_threads() * (double)loops * 8 * 64 / (bench_now() - t0) / 1e9;
}

static double median(double *t, int n) {
    qsort(t, (size_t)n, sizeof(double), bench_cmp);
    return t[n / 2];
}

int main(int argc, char **argv) {
    const int N = argc > 1 ? atoi(argv[1]) : 4096, D = argc > 2 ? atoi(argv[2]) : 256;
    const int M = argc > 3 ? atoi(argv[3]) : 1024, threads = argc > 4 ? atoi(argv[4]) : 2;
    const int reps = argc > 5 && atoi(argv[5]) > 0 ? atoi(argv[5]) : 7;
    if (N < 1 || D < 1 || M < 1 || threads < 1) {
        fprintf(stderr, "usage: bench_int8 [tokens width mlp threads reps], all positive\n");
        return 1;
    }
    if (!__builtin_cpu_supports("avx2") || !gemm_int8_native()) { // nothing to measure: not a failure
        printf("{\"bench\": \"int8\", \"skipped\": \"no AVX2: --precision int8 runs in fp32 on this CPU\"}\n");
        return 0;
    }
    omp_set_num_threads(threads);
    const size_t big = (size_t)N * (M > D ? M : D);
    float *x = malloc(sizeof(float) * big), *y = malloc(sizeof(float) * big), *w1 = malloc(sizeof(float) * (size_t)M * D);
    float *w2 = malloc(sizeof(float) * (size_t)M * D), *b1 = calloc((size_t)M, sizeof(float)), *b2 = calloc((size_t)D, sizeof(float));
    uint8_t *au = malloc(big);
    int8_t *wq = malloc((size_t)M * D);
    int32_t *ci = malloc(sizeof(int32_t) * big);
    double *t = malloc(sizeof(double) * (size_t)reps);
    int8_weights W = {0};
    if (!x || !y || !w1 || !w2 || !b1 || !b2 || !au || !wq || !ci || !t) {
        fprintf(stderr, "bench_int8: out of memory\n");
        return 1;
    }
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 1);
    for (size_t i = 0; i < big; i++) x[i] = (float)vlmoe_rng_normal(&r), au[i] = (uint8_t)(i * 37 % 251);
    for (size_t i = 0; i < (size_t)M * D; i++)
        w1[i] = 0.05f * (float)vlmoe_rng_normal(&r), w2[i] = 0.05f * (float)vlmoe_rng_normal(&r), wq[i] = (int8_t)(i * 13 % 127 - 63);
    if (int8_weights_add(&W, w1, (size_t)M, D, M, INT8_Q8) || int8_weights_add(&W, w2, (size_t)D, M, D, INT8_Q8)) {
        fprintf(stderr, "bench_int8: %s\n", vlmoe_last_error());
        return 1;
    }
    const double ops = 2.0 * N * M * D; // one product's
    const double pk = peak(20000000);
    // oneDNN: fc1 (N, M) = (N, D) . (M, D)^T, then fc2 (N, D) = (N, M) . (D, M)^T, blocks of 128 rows
    const int nb = (N + 127) / 128;
    for (int i = 0; i < reps; i++) {
        const double t0 = bench_now();
        for (int p = 0; p < 2; p++) {
            const int K = p ? M : D, O = p ? D : M;
#pragma omp parallel for schedule(dynamic, 1)
            for (int b = 0; b < nb; b++) {
                const int m = N - 128 * b < 128 ? N - 128 * b : 128;
                const int32_t co = 0;
                dnnl_gemm_u8s8s32('N', 'T', 'F', m, O, K, 1.0f, au + (size_t)128 * b * K, K, 0, wq, K, 0, 0.0f,
                                  ci + (size_t)128 * b * O, O, &co);
            }
        }
        t[i] = bench_now() - t0;
    }
    const double dn = 2 * ops / median(t, reps) / 1e9;
    for (int i = 0; i < reps; i++) {
        const double t0 = bench_now();
        linear_forward_int8(y, x, &W.t[0], 0, b1, N, D, M, 0);
        linear_forward_int8(x, y, &W.t[1], 0, b2, N, M, D, 0);
        t[i] = bench_now() - t0;
    }
    const double lin = 2 * ops / median(t, reps) / 1e9;
    const int8_expert ex = {&W.t[0], &W.t[1], 0, 0, b1, b2};
    const int32_t off[2] = {0, N};
    for (int i = 0; i < reps; i++) {
        const double t0 = bench_now();
        experts_forward_int8(y, x, &ex, off, 1, D, M, VLMOE_ACT_GELU_TANH, 0);
        t[i] = bench_now() - t0;
    }
    const double mlp = 2 * ops / median(t, reps) / 1e9;
    printf("{\"bench\": \"int8\", \"path\": \"%s\", \"tokens\": %d, \"width\": %d, \"mlp\": %d, \"threads\": %d, "
           "\"reps\": %d, \"peak_gops\": %.1f, \"onednn_gops\": %.1f, \"vlmoe_gops\": %.1f, \"vlmoe_mlp_gops\": %.1f}\n",
           gemm_int8_native() == INT8_VNNI ? "vnni" : "avx2", N, D, M, threads, reps, pk, dn, lin, mlp);
    int8_weights_free(&W);
    free(x), free(y), free(w1), free(w2), free(b1), free(b2), free(au), free(wq), free(ci), free(t);
    return 0;
}
