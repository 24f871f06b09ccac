// ops.c: forward/backward CPU kernels (linear via BLAS, LayerNorm, GELU family, softmax,
// multi-head attention with causal/padding masks, patchify, embeddings, class token, pooling,
// L2 normalisation). Compiled as float and double (src/core/real.h). Threads split work over
// outputs a thread owns, so results are identical for any thread count.
// Covered by tests/test_ops.c (finite differences) and tests/test_parity.c (PyTorch).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <dnnl.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "core/core.h"
#include "core/prof.h"
#include "core/real.h"
#include "ops/act_avx2.h"
#include "ops/attn_cpu.h"
#include "ops/gemm_bf16.h"
#include "ops/gemm_f32.h"
#include "ops/ops.h"

// One single-threaded product C (M,N) = alpha op(A) op(B) + beta C, row-major with leading
// dimensions (strided views are fine). Float goes to oneDNN's sgemm: its AVX-512 kernels run
// vlmoe's shapes 1.6x faster than OpenBLAS's on the same core (bench/speed.py); on a CPU with
// AVX2 but no AVX-512, where oneDNN's and OpenBLAS's reach 55-60% of the FMA peak, to vlmoe's own
// (src/ops/gemm_f32.h). Double (the gradient checks) goes to OpenBLAS. All run sequentially when
// called inside an OpenMP region.
// 1 when gemm1 runs vlmoe's own product: float, on a CPU with AVX2 and no AVX-512
static inline int gemm1_own(void) {
#ifdef VLMOE_REAL_F64
    return 0;
#else
    return gemm_f32_preferred();
#endif
}

static inline void gemm1_run(int ta, int tb, int M, int N, int K, real alpha, const real *A, int lda,
                             const real *B, int ldb, real beta, real *C, int ldc) {
#ifdef VLMOE_REAL_F64
    cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N,
                K, alpha, A, lda, B, ldb, beta, C, ldc);
#else
    // AVX2 without AVX-512: vlmoe's own product (src/ops/gemm_f32.c), which sums a row the same
    // way whatever M is, so a batch of one needs nothing special there. Only if its packing
    // buffers cannot be had does the block go to oneDNN below, whose bits differ in the last place.
    if (gemm1_own() && gemm_f32(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc) == 0) return;
    if (M == 1) {
        // a 1-row product takes oneDNN's gemv path, whose sums differ in the last bit from the
        // same row inside a larger product; as 2 rows, a batch of one gives what a batch of many
        // gives for the same input (if the scratch cannot be had, the direct call still works)
        real *s = malloc(sizeof(real) * 2 * ((size_t)K + (size_t)N));
        if (s) {
            real *a2 = s, *c2 = s + 2 * (size_t)K;
            for (int k = 0; k < K; k++) a2[k] = a2[K + k] = ta ? A[(size_t)k * lda] : A[k];
            for (int j = 0; j < N; j++) c2[j] = c2[N + j] = beta != 0 ? C[j] : 0;
            dnnl_sgemm('N', tb ? 'T' : 'N', 2, N, K, alpha, a2, K, B, ldb, beta, c2, N);
            memcpy(C, c2, sizeof(real) * N);
            free(s);
            return;
        }
    }
    dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#endif
}

// gemm1_run, timed by shape in the profile build (bench_step_prof's table of product shapes)
static inline void gemm1(int ta, int tb, int M, int N, int K, real alpha, const real *A, int lda,
                         const real *B, int ldb, real beta, real *C, int ldc) {
    PROF_GEMM(ta, tb, M, N, K, lda, ldb, gemm1_run(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc));
}

// C (M,N) = op(A) op(B) + beta C, row-major. Threads take fixed blocks of C's rows or columns
// (whichever dimension is larger), each computed by one single-threaded call. The blocks depend
// only on the shapes, never on the thread count, so every output element is computed the same
// way on 1 or 64 threads (a threaded BLAS changes the summation order with the thread count),
// and there is one thread pool (OpenMP's), never two busy-waiting against each other.
//
// With bf16 (float only: `--precision bf16`) the product goes to gemm_bf16 (src/ops/gemm_bf16.c:
// its own fixed blocks, also independent of the thread count); one it refuses runs in fp32.
//
// epi, when given, is run by the thread that computed a block on that block of C right after its
// product, while the block is still in cache (a fused bias and activation, below).
typedef struct gemm_epi gemm_epi;
struct gemm_epi {
    // C's rows [r0, r0+nr) and columns [c0, c0+nc)
    void (*run)(const gemm_epi *e, real *C, int ldc, int r0, int nr, int c0, int nc);
    const real *b, *h;   // bias (forward) or pre-activations (backward), by the run function
    real *a;             // activations out (NULL: with ab or pb, only rounded)
    uint16_t *ab;        // with bf16: the activations rounded instead (the next product's operand)
    const gemm_bf16_bpack *pb; // with bf16: a rounded into the dw product's B layout, or NULL
    int act;
};
// s (C) = the sum of n rows of x (leading dimension ld), row by row in order: one block's partial
static void rowsum(real *s, const real *x, size_t ld, int n, int C) {
    memset(s, 0, sizeof(real) * C);
    for (int r = 0; r < n; r++) {
        const real *xr = x + (size_t)r * ld;
#pragma omp simd
        for (int i = 0; i < C; i++) s[i] += xr[i];
    }
}

// sum[c0, c0+nc) += the column sums of g (N rows, leading dimension ld) there, 64 columns at a
// time, each column's rows added in order: colsums' bits, for one block's share of the columns
static void colsum_slice(real *sum, const real *g, size_t ld, int N, int c0, int nc) {
    for (int j0 = c0; j0 < c0 + nc; j0 += 64) {
        const int m = c0 + nc - j0 < 64 ? c0 + nc - j0 : 64;
        real s[64] = {0};
        for (int r = 0; r < N; r++) {
            const real *gr = g + (size_t)r * ld + j0;
#pragma omp simd
            for (int i = 0; i < m; i++) s[i] += gr[i];
        }
        for (int i = 0; i < m; i++) sum[j0 + i] += s[i];
    }
}

// sum (C) += the nb partials cs (nb, C), added in block order: the blocks are the shape's, so
// the bits do not depend on the thread count
static void colsum_blocks(real *sum, const real *cs, int nb, int C) {
#pragma omp parallel for schedule(static) if ((size_t)nb * C >= 65536)
    for (int j = 0; j < C; j++) {
        real s = 0;
        for (int b = 0; b < nb; b++) s += cs[(size_t)b * C + j];
        sum[j] += s;
    }
}

#ifndef VLMOE_REAL_F64
// gemm_bf16's epilogue hook, for a gemm_epi
static void epi_thunk(const void *e, float *C, int ldc, int r0, int nr, int c0, int nc) {
    ((const gemm_epi *)e)->run(e, C, ldc, r0, nr, c0, nc);
}

// a gemm_epi for gemm_f32_epi, which gives a block's place in the C it was handed: its place in
// the whole C is that plus where gemm_pe's block starts
typedef struct {
    const gemm_epi *e;
    real *C; // the whole C
    int r0, c0;
} epi_at;
static void epi_at_run(const void *ctx, float *C, int ldc, int r0, int nr, int c0, int nc) {
    (void)C;
    const epi_at *p = ctx;
    p->e->run(p->e, p->C, ldc, p->r0 + r0, nr, p->c0 + c0, nc);
}
#endif

// gemm1 on gemm_pe's block at (r0, c0) of C, with epi run on it: inside vlmoe's own product, on
// each small block as soon as it is written (gemm_f32_epi), else on the whole block after. bp,
// when given, is op(B) packed for vlmoe's own product (gemm_f32_pack_b): the same bits.
static void gemm1_epi(int ta, int tb, int M, int N, int K, const real *A, int lda, const real *B, int ldb,
                      const void *bp, real beta, real *C, int ldc, const gemm_epi *epi, int r0, int c0) {
#ifndef VLMOE_REAL_F64
    if ((epi || bp) && gemm1_own()) {
        const epi_at at = {epi, C, r0, c0};
        real *c = C + (size_t)r0 * ldc + c0;
        int r; // timed with its epilogue in the profile build
        PROF_GEMM(ta, tb, M, N, K, lda, ldb,
                  r = bp ? gemm_f32_epi_packed(ta, M, N, K, 1, A, lda, bp, beta, c, ldc, epi ? epi_at_run : NULL, &at)
                         : gemm_f32_epi(ta, tb, M, N, K, 1, A, lda, B, ldb, beta, c, ldc, epi_at_run, &at));
        if (r == 0) return;
    }
#else
    (void)bp;
#endif
    gemm1(ta, tb, M, N, K, 1, A, lda, B, ldb, beta, C + (size_t)r0 * ldc + c0, ldc);
    if (epi) epi->run(epi, C, ldc, r0, M, c0, N);
}

#ifndef VLMOE_REAL_F64
// C (M,N) = A^T op(B) + beta C, A (K,M), as gemm_pe's blocks do it but with the sum over K cut
// in nk chunks of whole KC multiples (1024 at least), one a block: the first chunk written into
// C (with beta), each other into a partial of its own, the partials then added to C in chunk
// order. For a weight gradient (K the tokens, thousands, C a weight matrix) blocks of C's rows
// would each pack all of B, and blocks of its columns all of A; chunks of K read each once.
// Measured with vlmoe's own product (AVX2, bench-s's dw shapes): 3-10% faster than two row
// blocks at 1 and 2 threads, the partials' adds included. nk depends on K only. Returns -1,
// having done nothing, when the partials' memory cannot be had.
static int gemm_ksplit(int tb, int M, int N, int K, const real *A, int lda, const real *B, int ldb, real beta,
                       real *C, int ldc) {
    int nk = K / 2048;
    nk = nk < 2 ? 2 : nk > 16 ? 16 : nk + nk % 2;
    const int ks = ((K + nk - 1) / nk + 255) / 256 * 256;
    nk = (K + ks - 1) / ks;
    const size_t mn = (size_t)M * N;
    real *P = malloc(sizeof(real) * (nk - 1) * mn);
    if (!P) return -1;
    PROF_SCOPE(PROF_MATMUL) {
#pragma omp parallel for schedule(static)
        for (int c = 0; c < nk; c++) {
            const int k0 = c * ks, n = K - k0 < ks ? K - k0 : ks;
            const real *a = A + (size_t)k0 * lda, *b = tb ? B + k0 : B + (size_t)k0 * ldb;
            if (c == 0) gemm1(1, tb, M, N, n, 1, a, lda, b, ldb, beta, C, ldc);
            else gemm1(1, tb, M, N, n, 1, a, lda, b, ldb, 0, P + (c - 1) * mn, N);
        }
#pragma omp parallel for schedule(static)
        for (int i = 0; i < M; i++) {
            real *cr = C + (size_t)i * ldc;
            for (int c = 1; c < nk; c++) {
                const real *pr = P + (c - 1) * mn + (size_t)i * N;
#pragma omp simd
                for (int j = 0; j < N; j++) cr[j] += pr[j];
            }
        }
    }
    free(P);
    return 0;
}
#endif

#ifndef VLMOE_REAL_F64
static int gemm_pe(int bf16, int ta, int tb, int M, int N, int K, const real *A, int lda, const real *B, int ldb,
                   real beta, real *C, int ldc, const gemm_epi *epi, real *asum);

// C (M,N) += A^T B, A (K,M) and B (K,N), M > N, as T = B^T A (N,M) and then C += T^T (a weight gradient's sum).
// A weight gradient's A is dout, whose rows are 4 KB apart where its width is a multiple of 1024
// floats (an MLP's hidden layer), and oneDNN's sgemm reads such an A^T slowly: bench-s's first
// MLP weight gradient (1024 x 256 over 5120 tokens, 1 thread, Xeon with AVX-512) ran at 94-102
// GFLOP/s as one call and at 149 as its transpose product, where the same rows are B. In the
// step its blocks went from 94 to 137 GFLOP/s, and the step 1.024x (1 thread) and 1.029x (2)
// faster (bench/ab_step.sh, 8 pairs). qkv's (768 x 256, rows 3 KB apart) gained alone but not in
// the step (131 against 127), and with M < N the transpose product is the slower one (256 x 1024:
// 94 against 152), hence gemm_pe's conditions. The shapes alone choose it: the same bits on any
// thread count. Returns -1, having done nothing, when T's memory cannot be had.
static int gemm_tn_transposed(int M, int N, int K, const real *A, int lda, const real *B, int ldb, real *C,
                              int ldc) {
    real *T = malloc(sizeof(real) * (size_t)M * N);
    if (!T) return -1;
    gemm_pe(0, 1, 0, N, M, K, B, ldb, A, lda, 0, T, M, NULL, NULL);
    PROF_SCOPE(PROF_MATMUL) {
        // C in 32 x 32 tiles, so the block of T each reads (32 floats of 32 of its rows) stays in cache
#pragma omp parallel for collapse(2) schedule(static)
        for (int i0 = 0; i0 < M; i0 += 32)
            for (int j0 = 0; j0 < N; j0 += 32) {
                const int i1 = M - i0 < 32 ? M : i0 + 32, j1 = N - j0 < 32 ? N : j0 + 32;
                for (int i = i0; i < i1; i++) {
                    real *c = C + (size_t)i * ldc;
                    const real *t = T + i;
                    for (int j = j0; j < j1; j++) c[j] += t[(size_t)j * M];
                }
            }
    }
    free(T);
    return 0;
}
#endif

// Rows of a block of gemm_pe's over op(B) packed once for all its blocks: two of the AVX2
// product's MC blocks. On bench-s at 2 threads on a busy 2-core Zen 3, against six fixed blocks
// of 854 rows: the threads' barrier spin fell from 7.6-8.5% to 5.5-6.3% of the samples and the
// step ratio over alternating pairs was 1.045, 1.020 and 0.999; 144 rows were 3% slower than
// 288, 576 1%.
enum { ROWS_SHARED = 288 };

// asum, when given (A not transposed: (M,K) row-major), accumulates A's column sums (a linear's
// bias gradient, A being dout) while A is in cache. Blocks of rows: the block that multiplied
// rows [o, o+n) of A sums them right after into a partial of its own, and the partials are added
// in block order (colsum_blocks). Blocks of columns (each reads all of A): block b sums its share
// of A's columns over all rows, as colsums would. Either way the bits depend on the shapes only.
// Returns 1 when it did, 0 when the caller must sum them (bf16 took the product, A is
// transposed, or the partials' memory could not be had).
static int gemm_pe(int bf16, int ta, int tb, int M, int N, int K, const real *A, int lda,
                   const real *B, int ldb, real beta, real *C, int ldc, const gemm_epi *epi, real *asum) {
    // vlmoe's own product (AVX2) reads op(A) = A in place and packs op(B): blocks of rows each
    // pack all of B, blocks of columns their share of it. Where A is short (an expert's tokens,
    // a batch of texts) its rows are too few to pay for that, so the columns are split.
    const int split_rows = gemm1_own() && !ta && M <= 1024 && N >= 128 ? 0 : M >= N, dim = split_rows ? M : N;
    // blocks of up to 1024 rows: each call packs the whole other operand, so small blocks repack
    // it often (64-row blocks cost bench-s 8% more time than 512, and 512 some 1-2% more than
    // 1024 at 2 threads: 5120 tokens in 10 blocks against 6), while an expert's 640 rows still
    // make two blocks for two threads (the even rule below)
    int nb = (dim + 1023) / 1024;
    // a large product in one block (the out projection's dw, 256 x 256 over 5120 rows: 0.67
    // GFLOP) or in an odd number of them leaves a thread idle while another works: from 32M
    // multiply-adds on, an even number of blocks of at least 64 rows. The shapes alone decide.
    if ((double)M * N * K >= 32e6 && dim >= 128 && nb % 2) nb++;
    // With vlmoe's own product and op(B) packed once for all blocks (below), a block of rows
    // costs no packing: blocks of ROWS_SHARED rows, handed out as threads free up, so a thread
    // slowed down (a busy machine) leaves the others less to wait for at the end; whole 6-row
    // tiles but in the last. Never fewer blocks than the rules above gave (a product of 128-288
    // rows keeps its two). The shapes alone still decide the blocks (and so the bias
    // gradient's partials, cs), whatever the thread count.
    const int shared = split_rows && nb > 1 && gemm1_own();
    if (shared && (dim + ROWS_SHARED - 1) / ROWS_SHARED > nb) nb = (dim + ROWS_SHARED - 1) / ROWS_SHARED;
    nb = nb > 64 ? 64 : nb;
    const int bs = shared ? ((dim + nb - 1) / nb + 5) / 6 * 6 : (dim + nb - 1) / nb;
#ifndef VLMOE_REAL_F64
    int done = 0;
    if (bf16)
        PROF_SCOPE(PROF_MATMUL) done = gemm_bf16(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc,
                                                 epi ? epi_thunk : NULL, epi) == 0;
    if (done) return 0;
    // a weight gradient (added to, beta 1) with more rows than columns, with oneDNN: as its transpose (above)
    if (ta && !tb && !epi && beta == 1 && !gemm1_own() && M > N && lda % 1024 == 0 &&
        gemm_tn_transposed(M, N, K, A, lda, B, ldb, C, ldc) == 0)
        return 0;
    // a weight gradient's product with vlmoe's own kernel: chunks of the long sum (above)
    if (ta && !epi && gemm1_own() && K >= 2048 && K >= 2 * dim &&
        gemm_ksplit(tb, M, N, K, A, lda, B, ldb, beta, C, ldc) == 0)
        return 0;
#endif
    // Blocks of rows each multiply by all of op(B): with vlmoe's own product it is packed once,
    // here, each thread packing a share of its panels, not once a block (the forward and
    // input-gradient products' weights: with six row blocks at bench-s, packing fell from 5.0%
    // to 3.7% of a 1-thread step's `perf` samples; now ROWS_SHARED blocks share it). If the
    // memory cannot be had, each block packs its own; the same bits either way.
    void *bp = NULL;
#ifndef VLMOE_REAL_F64
    const size_t bpn = shared ? gemm_f32_packed_b_floats(N, K) : 0;
    bp = bpn ? vlmoe_alloc_line(bpn * sizeof(float)) : NULL;
    const int npg = (N + 63) / 64; // groups of four 16-column panels, a thread's share at a time
#endif
    // the partials, nb x K (at most 64 blocks): a few hundred KB, against the MBs of A
    real *cs = asum && split_rows && !ta ? calloc((size_t)nb * K, sizeof(real)) : NULL; // zeros: a block with no rows adds none
    const int csum = asum && !split_rows && !ta, ks = (K + nb - 1) / nb; // ks: each block's columns
    PROF_SCOPE(PROF_MATMUL) {
#pragma omp parallel
        {
#ifndef VLMOE_REAL_F64
            if (bp) {
#pragma omp for schedule(static)
                for (int g = 0; g < npg; g++) gemm_f32_pack_b(bp, tb, B, ldb, N, K, 64 * g, 64 * g + 64);
            }
#endif
#pragma omp for schedule(dynamic, 1)
            for (int b = 0; b < nb; b++) {
                const int o = b * bs, n = dim - o < bs ? dim - o : bs;
                if (csum && b * ks < K) colsum_slice(asum, A, lda, M, b * ks, K - b * ks < ks ? K - b * ks : ks);
                if (n <= 0) continue;
                if (split_rows)
                    gemm1_epi(ta, tb, n, N, K, ta ? A + o : A + (size_t)o * lda, lda, B, ldb, bp, beta, C, ldc, epi, o, 0);
                else
                    gemm1_epi(ta, tb, M, n, K, A, lda, tb ? B + (size_t)o * ldb : B + o, ldb, NULL, beta, C, ldc, epi, 0, o);
                if (cs) rowsum(cs + (size_t)b * K, A + (size_t)o * lda, lda, n, K);
            }
        }
    }
    free(bp);
    if (!cs) return csum;
    colsum_blocks(asum, cs, nb, K);
    free(cs);
    return 1;
}

static void gemm_p(int bf16, int ta, int tb, int M, int N, int K, const real *A, int lda,
                   const real *B, int ldb, real beta, real *C, int ldc) {
    gemm_pe(bf16, ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc, NULL, NULL);
}

// Column sums over N rows of C channels: sg += sum_n g, and when sgx is given (LayerNorm's weight
// gradient) sgx += sum_n g (x - mean_n) rstd_n. Threads own fixed 64-channel slices and walk
// the rows in order: contiguous loads, the same sums for any thread count.
static void colsums(real *sg, real *sgx, const real *g, const real *x, const real *mean,
                    const real *rstd, int N, int C) {
    const int nb = (C + 63) / 64;
#pragma omp parallel for schedule(static)
    for (int blk = 0; blk < nb; blk++) {
        const int c0 = blk * 64, nc = C - c0 < 64 ? C - c0 : 64;
        if (!sgx) {
            colsum_slice(sg, g, (size_t)C, N, c0, nc);
            continue;
        }
        real s[64] = {0}, sx[64] = {0};
        for (int n = 0; n < N; n++) {
            const real *gr = g + (size_t)n * C + c0, *xr = x + (size_t)n * C + c0, m = mean[n], r = rstd[n];
#pragma omp simd
            for (int i = 0; i < nc; i++) s[i] += gr[i];
#pragma omp simd
            for (int i = 0; i < nc; i++) sx[i] += gr[i] * (xr[i] - m) * r;
        }
        for (int i = 0; i < nc; i++) sg[c0 + i] += s[i], sgx[c0 + i] += sx[i];
    }
}

// out += b over a block of out, by the thread that just computed it
static void epi_bias(const gemm_epi *e, real *C, int ldc, int r0, int nr, int c0, int nc) {
    const real *b = e->b + c0;
    for (int r = r0; r < r0 + nr; r++) {
        real *o = C + (size_t)r * ldc + c0;
#pragma omp simd
        for (int j = 0; j < nc; j++) o[j] += b[j];
    }
}

static void linear_fwd(int bf16, real *out, const real *inp, const real *w, const real *b, int N,
                       int K, int O, int beta) {
    // out = inp . w^T: row-major (N,K) x (O,K)^T; the bias added to each block while in cache
    const gemm_epi e = {.run = epi_bias, .b = b};
    gemm_pe(bf16, 0, 1, N, O, K, inp, K, w, K, beta ? 1 : 0, out, O, b ? &e : NULL, NULL);
}

// beta (0 or 1) is dinp's: 0 writes it (linear_backward_write), 1 accumulates
static void linear_bwd(int bf16, real *dinp, real *dw, real *db, const real *dout, const real *inp,
                       const real *w, int N, int K, int O, int beta) {
    int done = 0;
#ifndef VLMOE_REAL_F64
    // with dinp, the bf16 products sum db while they round dout (gemm_bf16.h)
    if (bf16) PROF_SCOPE(PROF_MATMUL) done = gemm_bf16_backward(dinp, dw, db, dout, inp, w, N, K, O, (float)beta) == 0;
#endif
    // db's sums by dinp's product, over the rows of dout it just read (else a pass of their own)
    int summed = done && dinp;
    if (!done && dinp) summed = gemm_pe(bf16, 0, 0, N, K, O, dout, O, w, K, beta, dinp, K, NULL, db);
    // dw (O,K) += dout^T (O,N) . inp (N,K)
    if (!done) gemm_p(bf16, 1, 0, O, K, N, dout, O, inp, K, 1, dw, K);
    if (db && !summed) colsums(db, NULL, dout, NULL, NULL, NULL, N, O);
}

void R(linear_forward)(real *out, const real *inp, const real *w, const real *b, int N, int K,
                       int O, int beta) {
    linear_fwd(0, out, inp, w, b, N, K, O, beta);
}

void R(linear_backward)(real *dinp, real *dw, real *db, const real *dout, const real *inp,
                        const real *w, int N, int K, int O) {
    linear_bwd(0, dinp, dw, db, dout, inp, w, N, K, O, 1);
}

void R(linear_backward_write)(real *dinp, real *dw, real *db, const real *dout, const real *inp,
                              const real *w, int N, int K, int O) {
    linear_bwd(0, dinp, dw, db, dout, inp, w, N, K, O, 0);
}

#ifndef VLMOE_REAL_F64
void linear_forward_bf16(float *out, const float *inp, const float *w, const float *b, int N, int K,
                         int O, int beta) {
    linear_fwd(1, out, inp, w, b, N, K, O, beta);
}

void linear_backward_bf16(float *dinp, float *dw, float *db, const float *dout, const float *inp,
                          const float *w, int N, int K, int O) {
    linear_bwd(1, dinp, dw, db, dout, inp, w, N, K, O, 1);
}

void linear_backward_write_bf16(float *dinp, float *dw, float *db, const float *dout, const float *inp,
                                const float *w, int N, int K, int O) {
    linear_bwd(1, dinp, dw, db, dout, inp, w, N, K, O, 0);
}
#endif

// One normalised row; forward and recompute share it so both give the same bits.
static inline void ln_row(real *o, const real *x, real m, real s, const real *w, const real *b, int C) {
#pragma omp simd
    for (int i = 0; i < C; i++) o[i] = (x[i] - m) * s * w[i] + b[i];
}

void R(layernorm_forward)(real *out, real *mean, real *rstd, const real *inp, const real *w,
                          const real *b, int N, int C, double eps) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real *x = inp + (size_t)n * C;
        real *o = out + (size_t)n * C;
        real m = 0, v = 0;
        // vector sums (lanes, then their total): the same bits on any thread count
#pragma omp simd reduction(+ : m)
        for (int i = 0; i < C; i++) m += x[i];
        m /= C;
#pragma omp simd reduction(+ : v)
        for (int i = 0; i < C; i++) v += (x[i] - m) * (x[i] - m);
        v /= C;
        real s = (real)(1.0 / sqrt((double)v + eps));
        ln_row(o, x, m, s, w, b, C);
        mean[n] = m;
        rstd[n] = s;
    }
}

void R(layernorm_recompute)(real *out, const real *inp, const real *w, const real *b,
                            const real *mean, const real *rstd, int N, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        ln_row(out + (size_t)n * C, inp + (size_t)n * C, mean[n], rstd[n], w, b, C);
}

// dinp += LayerNorm's dx over rows [r0, r0+n); with sg, sgx (C) their dout's column sums too,
// sg = sum g and sgx = sum g xhat (the bias and weight gradients), written, while the rows are in
// cache. dx's expression is the same whichever way it is called.
static void ln_bwd_rows(real *dinp, real *sg, real *sgx, const real *dout, const real *inp, const real *w,
                        const real *mean, const real *rstd, int r0, int n, int C) {
    if (sg) memset(sg, 0, sizeof(real) * C), memset(sgx, 0, sizeof(real) * C);
    for (int row = r0; row < r0 + n; row++) {
        const real *x = inp + (size_t)row * C, *g = dout + (size_t)row * C;
        real *dx = dinp + (size_t)row * C;
        real m = mean[row], s = rstd[row], dnorm_mean = 0, dnorm_norm = 0;
#pragma omp simd reduction(+ : dnorm_mean, dnorm_norm)
        for (int i = 0; i < C; i++) {
            real dn = w[i] * g[i];
            dnorm_mean += dn;
            dnorm_norm += dn * (x[i] - m) * s;
        }
        dnorm_mean /= C;
        dnorm_norm /= C;
        if (sg) {
#pragma omp simd
            for (int i = 0; i < C; i++) {
                const real dn = w[i] * g[i], xh = (x[i] - m) * s;
                dx[i] += (dn - dnorm_mean - xh * dnorm_norm) * s;
                sg[i] += g[i];
                sgx[i] += g[i] * xh;
            }
        } else {
#pragma omp simd
            for (int i = 0; i < C; i++) {
                real dn = w[i] * g[i];
                dx[i] += (dn - dnorm_mean - (x[i] - m) * s * dnorm_norm) * s;
            }
        }
    }
}

// Rows per block of layernorm_backward: each block sums its rows' weight and bias gradients in
// the pass that computes their dx, into partials added in block order afterwards, so dout and x
// are read once and the bits depend on N and C only (a separate column-sum pass read both again)
#define LN_ROWS 128

void R(layernorm_backward)(real *dinp, real *dw, real *db, const real *dout, const real *inp,
                           const real *w, const real *mean, const real *rstd, int N, int C) {
    const int nb = (N + LN_ROWS - 1) / LN_ROWS;
    real *cs = nb > 0 ? malloc(sizeof(real) * 2 * (size_t)nb * C) : NULL;
    if (!cs) { // no room for the partials: rows in parallel, then the sums' own pass
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) ln_bwd_rows(dinp, NULL, NULL, dout, inp, w, mean, rstd, n, 1, C);
        colsums(db, dw, dout, inp, mean, rstd, N, C);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int b = 0; b < nb; b++) {
        const int r0 = b * LN_ROWS, n = N - r0 < LN_ROWS ? N - r0 : LN_ROWS;
        ln_bwd_rows(dinp, cs + (size_t)b * C, cs + (size_t)(nb + b) * C, dout, inp, w, mean, rstd, r0, n, C);
    }
    colsum_blocks(db, cs, nb, C);
    colsum_blocks(dw, cs + (size_t)nb * C, nb, C);
    free(cs);
}

#define SQRT_2_OVER_PI 0.7978845608028654
#define INV_SQRT_2 0.7071067811865476
#define INV_SQRT_2PI 0.3989422804014327

// GELU (tanh) and quick GELU are x * sigmoid(c(x)): 0.5 (1 + tanh(u)) = sigmoid(2u). Written so,
// each costs one vexp_sig and vectorises; GELU (erf) uses verf (src/core/real.h), which does too.
// The unfused ops and the fused ones below share these helpers, so both give the same bits for
// the same pre-activation.
#pragma omp declare simd
static inline real gelu_arg(real x, int kind) {
    return kind == VLMOE_ACT_GELU_TANH ? (real)(2 * SQRT_2_OVER_PI) * (x + (real)0.044715 * x * x * x)
                                       : (real)1.702 * x;
}

// The activations one element at a time: GELU (erf) apart from the sigmoid forms, so each loop
// below holds one of them without a branch and vectorises (`omp simd`; erf is real.h's verf).
static inline real gelu_erf1(real x) { return (real)0.5 * x * (1 + verf(x * (real)INV_SQRT_2)); }

#pragma omp declare simd uniform(kind)
static inline real act_sig1(real x, int kind) { return x / (1 + vexp_sig(-gelu_arg(x, kind))); }

// act'(x), with act(x) itself in *a: the backward needs both, and they share the erf or exp.
// For the sigmoid forms, d/dx [x s(c(x))] = s + x s (1 - s) c'(x).
static inline real gelu_erf_grad1(real x, real *a) {
    const real ef = verf(x * (real)INV_SQRT_2);
    *a = (real)0.5 * x * (1 + ef); // gelu_erf1's expression: the same bits
    return (real)0.5 * (1 + ef) + x * (real)INV_SQRT_2PI * vexp_fma((real)-0.5 * x * x);
}

static inline real act_sig_grad1(real x, int kind, real *a) {
    const real den = 1 + vexp_sig(-gelu_arg(x, kind)), s = 1 / den;
    const real dc = kind == VLMOE_ACT_GELU_TANH ? (real)(2 * SQRT_2_OVER_PI) * (1 + (real)(3 * 0.044715) * x * x)
                                                : (real)1.702;
    *a = x / den; // act_sig1's expression
    return s + x * s * (1 - s) * dc;
}

void R(act_forward)(real *out, const real *inp, size_t n, int kind) {
#ifndef VLMOE_REAL_F64
    if (act_avx2_supported()) { // blocks of 4096 in AVX2 or AVX-512 (the same bits), the tail below
        const size_t nb = n / 4096;
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < nb; i++) act_simd(out + 4096 * i, inp + 4096 * i, 4096, kind);
        const size_t o = 4096 * nb, done = o + act_simd(out + o, inp + o, n - o, kind);
        out += done, inp += done, n -= done;
    }
#endif
    if (kind == VLMOE_ACT_GELU) {
#pragma omp parallel for simd schedule(static)
        for (size_t i = 0; i < n; i++) out[i] = gelu_erf1(inp[i]);
        return;
    }
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = act_sig1(inp[i], kind);
}

void R(act_backward)(real *dinp, const real *inp, const real *dout, size_t n, int kind) {
    if (kind == VLMOE_ACT_GELU) {
#pragma omp parallel for simd schedule(static)
        for (size_t i = 0; i < n; i++) {
            real a;
            dinp[i] += dout[i] * gelu_erf_grad1(inp[i], &a);
        }
        return;
    }
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) {
        real a;
        dinp[i] += dout[i] * act_sig_grad1(inp[i], kind, &a);
    }
}

// ---- the expert MLP's fused passes: bias and activation applied by gemm_pe's epilogue to each
// block of the first product, and the activation's derivative to each block of the backward's
// first product, so h and dh are each walked once, while in cache, in the product's own threads

// h += b; a = act(h) over n values
static inline void bias_act_row(real *a, real *h, const real *b, int n, int kind) {
    int j0 = 0;
#ifndef VLMOE_REAL_F64
    j0 = act_bias_simd(a, h, b, n, kind); // the same bits, faster (0 without AVX2)
#endif
    if (kind == VLMOE_ACT_GELU) {
#pragma omp simd
        for (int j = j0; j < n; j++) a[j] = gelu_erf1(h[j] += b[j]);
    } else {
#pragma omp simd
        for (int j = j0; j < n; j++) a[j] = act_sig1(h[j] += b[j], kind);
    }
}

// g *= act'(h); a = act(h) over n values
static inline void act_grad_row(real *g, real *a, const real *h, int n, int kind) {
    int j0 = 0;
#ifndef VLMOE_REAL_F64
    j0 = act_grad_simd(g, a, h, n, kind);
#endif
    if (kind == VLMOE_ACT_GELU) {
#pragma omp simd
        for (int j = j0; j < n; j++) g[j] *= gelu_erf_grad1(h[j], &a[j]);
    } else {
#pragma omp simd
        for (int j = j0; j < n; j++) g[j] *= act_sig_grad1(h[j], kind, &a[j]);
    }
}

// Where act(h) is only read rounded to bf16 (by the next product), it goes through a chunk of
// this many floats on the stack instead of an fp32 array in memory: 4 bytes a value fewer to
// store, and, in the backward, to read back when dw's B is packed.
enum { EPI_CHUNK = 64 };

// h += b; a = act(h) over a block of h (rows r0.., columns c0..); with ab, act(h) only rounded
// into ab
static void epi_bias_act(const gemm_epi *e, real *C, int ldc, int r0, int nr, int c0, int nc) {
    const int kind = e->act;
    const real *b = e->b + c0;
    for (int r = r0; r < r0 + nr; r++) {
        real *h = C + (size_t)r * ldc + c0;
#ifndef VLMOE_REAL_F64
        if (e->ab) {
            uint16_t *ab = e->ab + (size_t)r * ldc + c0;
            for (int j0 = 0; j0 < nc; j0 += EPI_CHUNK) {
                real a[EPI_CHUNK];
                const int n = nc - j0 < EPI_CHUNK ? nc - j0 : EPI_CHUNK;
                bias_act_row(a, h + j0, b + j0, n, kind);
#pragma omp simd
                for (int j = 0; j < n; j++) ab[j0 + j] = bf16_of(a[j]);
            }
            continue;
        }
#endif
        bias_act_row(e->a + (size_t)r * ldc + c0, h, b, nc, kind);
    }
}

// C (= dy.w, d of the activation's output) becomes dh = C act'(h); a = act(h) on the side, or,
// with pb, act(h) rounded into the layout of the dw product's B, rows in pairs where the block
// holds both rows of a pair
static void epi_act_grad(const gemm_epi *e, real *C, int ldc, int r0, int nr, int c0, int nc) {
    const int kind = e->act;
#ifndef VLMOE_REAL_F64
    for (int r = r0, two; e->pb && r < r0 + nr; r += 1 + two) {
        two = !(r & 1) && r + 1 < r0 + nr;
        for (int j0 = 0; j0 < nc; j0 += EPI_CHUNK) {
            real t[2][EPI_CHUNK];
            const int n = nc - j0 < EPI_CHUNK ? nc - j0 : EPI_CHUNK;
            for (int i = 0; i <= two; i++)
                act_grad_row(C + (size_t)(r + i) * ldc + c0 + j0, t[i], e->h + (size_t)(r + i) * ldc + c0 + j0, n, kind);
            gemm_bf16_bpack_rows(e->pb, r, c0 + j0, n, t[0], two ? t[1] : NULL);
        }
    }
    if (e->pb) return;
#endif
    for (int r = r0; r < r0 + nr; r++)
        act_grad_row(C + (size_t)r * ldc + c0, e->a + (size_t)r * ldc + c0, e->h + (size_t)r * ldc + c0, nc, kind);
}

static void linear_act_fwd(int bf16, real *h, real *a, const real *inp, const real *w, const real *b,
                           int N, int K, int O, int act) {
    const gemm_epi e = {.run = epi_bias_act, .b = b, .a = a, .act = act};
    gemm_pe(bf16, 0, 1, N, O, K, inp, K, w, K, 0, h, O, &e, NULL);
}

static void act_linear_bwd(int bf16, real *dh, real *a, real *dw, real *db, const real *dy, const real *h,
                           const real *w, int N, int M, int O, int act) {
    gemm_epi e = {.run = epi_act_grad, .h = h, .a = a, .act = act};
    int done = 0;
#ifndef VLMOE_REAL_F64
    // bf16: dw's B is act(h), rounded by the epilogue straight into the layout dw's product
    // reads, never stored in fp32 (a is then left as it was, unless that product fails)
    gemm_bf16_bpack pb;
    if (bf16 && gemm_bf16_bpack_begin(&pb, O, M, N) == 0) e.pb = &pb, e.a = NULL;
#endif
    // dh (N,M) = dy (N,O) . w (O,M), then act'; db += colsum(dy) by its blocks where it can
    const int summed = gemm_pe(bf16, 0, 0, N, M, O, dy, O, w, M, 0, dh, M, &e, db);
#ifndef VLMOE_REAL_F64
    if (e.pb) {
        PROF_SCOPE(PROF_MATMUL) done = gemm_bf16_packed_b(O, M, N, dy, O, &pb, 1, dw, M) == 0;
        if (!done) R(act_forward)(a, h, (size_t)N * M, act);
    }
#endif
    if (!done) gemm_p(bf16, 1, 0, O, M, N, dy, O, a, M, 1, dw, M); // dw (O,M) += dy^T . a
    if (db && !summed) colsums(db, NULL, dy, NULL, NULL, NULL, N, O);
}

void R(linear_act_forward)(real *h, real *a, const real *inp, const real *w, const real *b, int N, int K,
                           int O, int act) {
    linear_act_fwd(0, h, a, inp, w, b, N, K, O, act);
}

void R(act_linear_backward)(real *dh, real *a, real *dw, real *db, const real *dy, const real *h,
                            const real *w, int N, int M, int O, int act) {
    act_linear_bwd(0, dh, a, dw, db, dy, h, w, N, M, O, act);
}

#ifndef VLMOE_REAL_F64
void linear_act_forward_bf16(float *h, float *a, const float *inp, const float *w, const float *b, int N,
                             int K, int O, int act) {
    linear_act_fwd(1, h, a, inp, w, b, N, K, O, act);
}

void act_linear_backward_bf16(float *dh, float *a, float *dw, float *db, const float *dy, const float *h,
                              const float *w, int N, int M, int O, int act) {
    act_linear_bwd(1, dh, a, dw, db, dy, h, w, N, M, O, act);
}

// The first product's epilogue rounds act(h) into a bf16 buffer as it writes a, and the second
// product reads that buffer as its A: the bits of the two calls apart (bf16_of is the one
// rounding), without a second pass over a.
void mlp_forward_bf16(float *y, float *h, float *a, const float *x, const float *const w[4], int N, int D, int M,
                      int act, int beta) {
    uint16_t *ab = gemm_bf16_side((size_t)N * M);
    // with ab, act(h) is only rounded (a, scratch, is left as it was unless the second fails)
    const gemm_epi e1 = {.run = epi_bias_act, .b = w[1], .a = ab ? NULL : a, .ab = ab, .act = act},
                   e2 = {.run = epi_bias, .b = w[3]};
    gemm_pe(1, 0, 1, N, M, D, x, D, w[0], D, 0, h, M, &e1, NULL);
    int done = 0;
    if (ab)
        PROF_SCOPE(PROF_MATMUL) done = gemm_bf16_pre(1, N, D, M, ab, NULL, M, w[2], M, beta ? 1.0f : 0.0f, y, D,
                                                     w[3] ? epi_thunk : NULL, w[3] ? &e2 : NULL) == 0;
    if (!done && ab) act_forward_f32(a, h, (size_t)N * M, act);
    if (!done) linear_fwd(1, y, a, w[2], w[3], N, M, D, beta);
}
#endif

void R(softmax_forward)(real *out, const real *inp, int N, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real *x = inp + (size_t)n * C;
        real *o = out + (size_t)n * C, mx = x[0], s = 0;
        for (int i = 1; i < C; i++) mx = x[i] > mx ? x[i] : mx;
        for (int i = 0; i < C; i++) s += (o[i] = REXP(x[i] - mx));
        for (int i = 0; i < C; i++) o[i] /= s;
    }
}

void R(softmax_backward)(real *dinp, const real *out, const real *dout, int N, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real *y = out + (size_t)n * C, *g = dout + (size_t)n * C;
        real dot = 0;
        for (int i = 0; i < C; i++) dot += y[i] * g[i];
        for (int i = 0; i < C; i++) dinp[(size_t)n * C + i] += y[i] * (g[i] - dot);
    }
}

// One head's keys (or values), T rows of hd at stride ld, transposed into kt (hd, T): oneDNN's
// sgemm runs q.kt as a plain product in about 0.8x the time of q.k^T with k read transposed at
// attention's small shapes (T = 65, hd = 64), the copy included. Heads whose copy would not fit
// the stack buffer (T hd > ATT_KT_MAX) keep the transposed read; either way the choice depends
// only on the shapes, never on the thread count.
#define ATT_KT_MAX 16384
static void head_transpose(real *kt, const real *k, int T, int hd, int ld) {
    int j0 = 0;
#if defined(__AVX__) && !defined(VLMOE_REAL_F64)
    const int d8 = hd & ~7;
    for (; j0 + 8 <= T; j0 += 8)
        for (int d = 0; d < d8; d += 8) tile8_transpose(kt + (size_t)d * T + j0, (size_t)T, k + (size_t)j0 * ld + d, (size_t)ld, 8);
    for (int j = 0; j < j0; j++) // the columns past the last whole tile
        for (int d = d8; d < hd; d++) kt[(size_t)d * T + j] = k[(size_t)j * ld + d];
#endif
    for (int j = j0; j < T; j++) // the rows past the last whole tile
        for (int d = 0; d < hd; d++) kt[(size_t)d * T + j] = k[(size_t)j * ld + d];
}

// S (T,T) = alpha x . y^T for one head: x, y (T, hd) at strides ldx, ld
static void head_scores(real *S, const real *x, int ldx, const real *y, int T, int hd, int ld, real alpha) {
    // vlmoe's own product (AVX2 CPUs) packs y^T through the same transposes either way: the copy
    // would be work for nothing, and its bits are the same without it
    if ((size_t)T * hd <= ATT_KT_MAX && !gemm1_own()) {
        real yt[ATT_KT_MAX];
        head_transpose(yt, y, T, hd, ld);
        gemm1(0, 0, T, T, hd, alpha, x, ldx, yt, T, 0, S, T);
    } else {
        gemm1(0, 1, T, T, hd, alpha, x, ldx, y, ld, 0, S, T);
    }
}

// Attention of one (sequence, head) as matrix products on the strided q/k/v columns of the
// qkv buffer: scores = scale q k^T, masked row softmax (masked probabilities are exactly 0, so
// they add nothing below), out = p v. Each (sequence, head) owns its rows of att and its
// columns of out, so threads never write the same float. The reference the fused float kernel
// (attn_cpu.c) is tested against, and the path of the shapes and builds it does not take.
void R(attention_forward_ref)(real *out, real *att, const real *qkv, const attn_segment *seg,
                              int D, int H) {
    const int T = seg->seqlen, hd = D / H, ld = 3 * D;
    const real scale = (real)(1.0 / sqrt((double)hd));
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < seg->nseq; b++) {
        for (int h = 0; h < H; h++) {
            const int len = seg->lens ? seg->lens[b] : T;
            const real *q = qkv + (seg->tok_off + (size_t)b * T) * ld + h * hd;
            real *a = att + (((size_t)b * H + h) * T) * T;
            head_scores(a, q, ld, q + D, T, hd, ld, scale);
            for (int i = 0; i < T; i++) {
                real *row = a + (size_t)i * T, mx = -INFINITY, s = 0;
                const int nk = key_limit(i, len, seg->causal, seg->prefix);
#pragma omp simd reduction(max : mx)
                for (int j = 0; j < nk; j++) mx = row[j] > mx ? row[j] : mx;
#pragma omp simd reduction(+ : s)
                for (int j = 0; j < nk; j++) s += (row[j] = vexp(row[j] - mx));
                const real inv = 1 / s;
#pragma omp simd
                for (int j = 0; j < nk; j++) row[j] *= inv;
                for (int j = nk; j < T; j++) row[j] = 0;
            }
            gemm1(0, 0, T, hd, T, 1, a, T, q + 2 * D, ld, 0, out + (seg->tok_off + (size_t)b * T) * D + h * hd, D);
        }
    }
}

// dp = dout v^T, dv = p^T dout, ds = p (dp - rowsum(p dp)) scale, dq = ds k, dk = ds^T q.
// dqkv is WRITTEN, not accumulated: attention is the only consumer of qkv, and every token of a
// pass belongs to one segment (the forward's out relies on that too), so the caller need not
// zero dqkv first (zeroing it was 16 MB of stores per bench-s block). Each (sequence, head)
// writes all T rows of its columns, masked ones included (as zeros).
void R(attention_backward_ref)(real *dqkv, real *datt, const real *dout, const real *qkv,
                               const real *att, const attn_segment *seg, int D, int H) {
    const int T = seg->seqlen, hd = D / H, ld = 3 * D;
    const real scale = (real)(1.0 / sqrt((double)hd));
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < seg->nseq; b++) {
        for (int h = 0; h < H; h++) {
            const size_t t0 = seg->tok_off + (size_t)b * T;
            const real *q = qkv + t0 * ld + h * hd, *g = dout + t0 * D + h * hd;
            real *dq = dqkv + t0 * ld + h * hd;
            const real *a = att + (((size_t)b * H + h) * T) * T;
            real *da = datt + (((size_t)b * H + h) * T) * T;
            head_scores(da, g, D, q + 2 * D, T, hd, ld, 1);
            gemm1(1, 0, T, hd, T, 1, a, T, g, D, 0, dq + 2 * D, ld);
            for (int i = 0; i < T; i++) {
                const real *p = a + (size_t)i * T;
                real *d = da + (size_t)i * T, dot = 0;
#pragma omp simd reduction(+ : dot)
                for (int j = 0; j < T; j++) dot += p[j] * d[j];
#pragma omp simd
                for (int j = 0; j < T; j++) d[j] = p[j] * (d[j] - dot) * scale;
            }
            gemm1(0, 0, T, hd, T, 1, da, T, q + D, ld, 0, dq, ld);
            gemm1(1, 0, T, hd, T, 1, da, T, q, ld, 0, dq + D, ld);
        }
    }
}

void R(attention_forward)(real *out, real *att, const real *qkv, const attn_segment *seg, int D,
                          int H) {
#ifndef VLMOE_REAL_F64
    if (attn_fused_forward(out, att, qkv, seg, D, H)) return;
#endif
    R(attention_forward_ref)(out, att, qkv, seg, D, H);
}

void R(attention_backward)(real *dqkv, real *datt, const real *dout, const real *qkv,
                           const real *att, const attn_segment *seg, int D, int H) {
#ifndef VLMOE_REAL_F64
    if (seg->seqlen <= ATTN_FUSED_BWD_TMAX && attn_fused_backward(dqkv, datt, dout, qkv, att, seg, D, H))
        return;
#endif
    R(attention_backward_ref)(dqkv, datt, dout, qkv, att, seg, D, H);
}

void R(patchify_forward)(real *patches, const real *images, int B, int C, int HW, int P) {
    const int g = HW / P, np = g * g, pd = C * P * P;
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int p = 0; p < np; p++) {
            int py0 = (p / g) * P, px0 = (p % g) * P;
            real *o = patches + ((size_t)b * np + p) * pd;
            for (int c = 0; c < C; c++)
                for (int y = 0; y < P; y++)
                    for (int x = 0; x < P; x++)
                        *o++ = images[(((size_t)b * C + c) * HW + py0 + y) * HW + px0 + x];
        }
    }
}

void R(patchify_backward)(real *dimages, const real *dpatches, int B, int C, int HW, int P) {
    const int g = HW / P, np = g * g, pd = C * P * P;
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int p = 0; p < np; p++) {
            int py0 = (p / g) * P, px0 = (p % g) * P;
            const real *d = dpatches + ((size_t)b * np + p) * pd;
            for (int c = 0; c < C; c++)
                for (int y = 0; y < P; y++)
                    for (int x = 0; x < P; x++)
                        dimages[(((size_t)b * C + c) * HW + py0 + y) * HW + px0 + x] += *d++;
        }
    }
}

void R(embed_forward)(real *out, const int32_t *ids, const real *wte, int BT, int D) {
#pragma omp parallel for schedule(static)
    for (int t = 0; t < BT; t++) memcpy(out + (size_t)t * D, wte + (size_t)ids[t] * D, sizeof(real) * D);
}

void R(embed_backward)(real *dwte, const real *dout, const int32_t *ids, int BT, int D) {
    // Several tokens may share an id: threads split the columns, each walks all tokens in order.
#pragma omp parallel for schedule(static)
    for (int c = 0; c < D; c++)
        for (int t = 0; t < BT; t++) dwte[(size_t)ids[t] * D + c] += dout[(size_t)t * D + c];
}

void R(posadd_forward)(real *out, const real *pos, int B, int T_, int D) {
#pragma omp parallel for schedule(static)
    for (int b = 0; b < B; b++)
        for (size_t i = 0; i < (size_t)T_ * D; i++) out[(size_t)b * T_ * D + i] += pos[i];
}

void R(posadd_backward)(real *dpos, const real *dout, int B, int T_, int D) {
    // dout as B rows of T*D: each position's sum over b in order, as one sum per element would
    // be (the same bits), 64 positions at a time walking each sample's rows contiguously instead
    // of one float per 64 KB stride
    colsums(dpos, NULL, dout, NULL, NULL, NULL, B, T_ * D);
}

void R(cls_forward)(real *out, const real *cls, const real *x, int B, int N, int D) {
    for (int b = 0; b < B; b++) {
        memcpy(out + (size_t)b * (N + 1) * D, cls, sizeof(real) * D);
        memcpy(out + ((size_t)b * (N + 1) + 1) * D, x + (size_t)b * N * D, sizeof(real) * N * D);
    }
}

void R(cls_backward)(real *dcls, real *dx, const real *dout, int B, int N, int D) {
    for (int b = 0; b < B; b++) {
        const real *g = dout + (size_t)b * (N + 1) * D;
        for (int c = 0; c < D; c++) dcls[c] += g[c];
        if (dx)
            for (size_t i = 0; i < (size_t)N * D; i++) dx[(size_t)b * N * D + i] += g[D + i];
    }
}

void R(pool_forward)(real *out, const real *x, const int32_t *lens, int B, int T_, int D, int kind) {
    for (int b = 0; b < B; b++) {
        const real *xb = x + (size_t)b * T_ * D;
        real *o = out + (size_t)b * D;
        int len = lens ? lens[b] : T_;
        if (kind == VLMOE_POOL_MEAN) {
            for (int c = 0; c < D; c++) o[c] = 0;
            for (int t = 0; t < len; t++)
                for (int c = 0; c < D; c++) o[c] += xb[(size_t)t * D + c];
            for (int c = 0; c < D; c++) o[c] /= len;
        } else {
            int t = kind == VLMOE_POOL_CLS ? 0 : len - 1;
            memcpy(o, xb + (size_t)t * D, sizeof(real) * D);
        }
    }
}

void R(pool_backward)(real *dx, const real *dout, const int32_t *lens, int B, int T_, int D,
                      int kind) {
    for (int b = 0; b < B; b++) {
        real *dxb = dx + (size_t)b * T_ * D;
        const real *g = dout + (size_t)b * D;
        int len = lens ? lens[b] : T_;
        if (kind == VLMOE_POOL_MEAN) {
            for (int t = 0; t < len; t++)
                for (int c = 0; c < D; c++) dxb[(size_t)t * D + c] += g[c] / len;
        } else {
            int t = kind == VLMOE_POOL_CLS ? 0 : len - 1;
            for (int c = 0; c < D; c++) dxb[(size_t)t * D + c] += g[c];
        }
    }
}

void R(l2norm_forward)(real *out, real *norm, const real *x, int N, int C) {
    for (int n = 0; n < N; n++) {
        double s = 0;
        for (int c = 0; c < C; c++) s += (double)x[(size_t)n * C + c] * x[(size_t)n * C + c];
        real nr = (real)sqrt(s);
        if (nr < (real)1e-12) nr = (real)1e-12; // torch.nn.functional.normalize's eps
        norm[n] = nr;
        for (int c = 0; c < C; c++) out[(size_t)n * C + c] = x[(size_t)n * C + c] / nr;
    }
}

void R(l2norm_backward)(real *dx, const real *dout, const real *out, const real *norm, int N, int C) {
    for (int n = 0; n < N; n++) {
        const real *y = out + (size_t)n * C, *g = dout + (size_t)n * C;
        real dot = 0;
        for (int c = 0; c < C; c++) dot += y[c] * g[c];
        for (int c = 0; c < C; c++) dx[(size_t)n * C + c] += (g[c] - y[c] * dot) / norm[n];
    }
}
