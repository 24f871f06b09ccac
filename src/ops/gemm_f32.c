// gemm_f32.c: vlmoe's own fp32 matrix product for AVX2+FMA3 CPUs without AVX-512, in the
// layout of Goto and van de Geijn ("Anatomy of high-performance matrix multiplication", 2008) as
// BLIS runs it: op(B) packed in KC x NC blocks of 16-column panels, op(A) taken MC x KC at a
// time, and a kernel that keeps a 6x16 tile of C in 12 ymm registers while it walks K. op(A) = A
// is read in place (its rows run along K, six streams the prefetchers follow: packing them cost
// more than it saved); op(A) = A^T is packed into 6-row panels.
// Covered by tests/test_gemm_f32.c (against a double-precision product, every transpose, edges).
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "ops/gemm_f32.h"
#include "ops/tile8.h"

// MR x NR: the register tile (12 accumulators, 2 B vectors and one broadcast A value are 15 of
// the 16 ymm registers). KC: one B panel (KC x NR floats, 16 KB) stays in L1 while the kernel runs
// down the A block; MC x KC of A (144 KB) stays in L2; the KC x NC block of B in L3 (3 MB at most).
enum { MR = 6, NR = 16, KC = 256, MC = 144, NC = 3072 };

// op(B) packed whole, for the block order that keeps C's rows in cache (drive): at most
// this many floats (2 MB)
enum { B_WHOLE = 1 << 19 };
// op(A) = A^T's KC chunk packed for all of M at once (drive), when it is at most this many
// floats (1 MB)
enum { A_WHOLE = 1 << 18 };

int gemm_f32_supported(void) { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

int gemm_f32_preferred(void) { return gemm_f32_supported() && !__builtin_cpu_supports("avx512f"); }

// rows [i0, i0+mc) and columns [p0, p0+kc) of op(A) = A^T into panels of MR rows: panel q
// holds element (row q*MR+r, column k) at q*MR*kc + k*MR + r; rows past mc are zeros. A's rows
// (running across the panels) are read in order, each copied into every panel. (op(A) = A is
// not packed: the kernel reads its rows where they are.)
static void pack_a(float *dst, const float *A, int lda, int i0, int mc, int p0, int kc) {
    const int full = mc / MR * MR; // rows in whole panels
    for (int k = 0; k < kc; k++) {
        const float *s = A + (size_t)(p0 + k) * lda + i0;
        for (int q = 0; q < full; q += MR) memcpy(dst + (size_t)q * kc + (size_t)k * MR, s + q, sizeof(float) * MR);
        if (full < mc) // the last, partial panel
            for (int r = 0; r < MR; r++) dst[(size_t)full * kc + (size_t)k * MR + r] = full + r < mc ? s[full + r] : 0;
    }
}

// rows [p0, p0+kc) and columns [j0, j0+nc) of op(B) into panels of NR columns: panel q holds
// element (row k, column q*NR+c) at q*NR*kc + k*NR + c; columns past nc are zeros. As for A,
// memory is read along its rows: B's (a row of op(B)) sixteen values into each panel, B^T's
// through two 8x8 transposes a panel.
__attribute__((target("avx2,fma"))) static void pack_b(float *dst, int tb, const float *B, int ldb, int j0, int nc,
                                                        int p0, int kc) {
    const int full = nc / NR * NR;
    if (!tb) {
        for (int k = 0; k < kc; k++) {
            const float *s = B + (size_t)(p0 + k) * ldb + j0;
            for (int q = 0; q < full; q += NR) memcpy(dst + (size_t)q * kc + (size_t)k * NR, s + q, sizeof(float) * NR);
        }
    } else {
        const int k8 = kc & ~7;
        for (int q = 0; q < full; q += NR) {
            const float *s = B + (size_t)(j0 + q) * ldb + p0;
            float *d = dst + (size_t)q * kc;
            for (int k0 = 0; k0 < k8; k0 += 8) {
                tile8_transpose(d + (size_t)k0 * NR, NR, s + k0, (size_t)ldb, 8);
                tile8_transpose(d + (size_t)k0 * NR + 8, NR, s + (size_t)8 * ldb + k0, (size_t)ldb, 8);
            }
            for (int k = k8; k < kc; k++)
                for (int c = 0; c < NR; c++) d[(size_t)k * NR + c] = s[(size_t)c * ldb + k];
        }
    }
    if (full < nc) { // the last, partial panel
        float *d = dst + (size_t)full * kc;
        for (int k = 0; k < kc; k++)
            for (int c = 0; c < NR; c++)
                d[(size_t)k * NR + c] = full + c >= nc ? 0
                                        : tb       ? B[(size_t)(j0 + full + c) * ldb + p0 + k]
                                                   : B[(size_t)(p0 + k) * ldb + j0 + full + c];
    }
}

// c (mr x nr of a 6x16 tile, leading dimension ldc) = alpha a.b + beta c over kc products, b
// being a packed panel; beta 0 never reads c. A partial tile goes through a full one on the
// stack, with the same vector operations, so an element's bits do not depend on its position.
// Row r of the tile reads a[r ars + k acs]: a packed panel (ars 1, acs MR) or, for op(A) = A,
// A's rows in place (ars lda, acs 1), which they can be read from as they are; rows past mr
// repeat the last valid one and are not stored.
__attribute__((target("avx2,fma"), always_inline)) static inline void
kernel_body(const int acs, int kc, const float *a, size_t ars, const float *b, size_t bs, float *c, int ldc, int mr, int nr,
            float alpha, float beta) {
    const float *a0 = a, *a1 = a + (size_t)(mr > 1 ? 1 : 0) * ars, *a2 = a + (size_t)(mr > 2 ? 2 : mr - 1) * ars;
    const float *a3 = a + (size_t)(mr > 3 ? 3 : mr - 1) * ars, *a4 = a + (size_t)(mr > 4 ? 4 : mr - 1) * ars;
    const float *a5 = a + (size_t)(mr > 5 ? 5 : mr - 1) * ars;
    // c's lines asked for now, to be in L1 when the tile is stored at the end: after the first K
    // chunk, c is read back from memory or L3, one miss per line a tile otherwise waits on
    for (int r = 0; r < mr; r++) {
        __builtin_prefetch(c + (size_t)r * ldc, 1);
        __builtin_prefetch(c + (size_t)r * ldc + nr - 1, 1);
    }
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#pragma GCC unroll 4
    for (int k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        const size_t o = (size_t)k * acs;
        __m256 x = _mm256_broadcast_ss(a0 + o);
        c00 = _mm256_fmadd_ps(x, b0, c00), c01 = _mm256_fmadd_ps(x, b1, c01);
        x = _mm256_broadcast_ss(a1 + o);
        c10 = _mm256_fmadd_ps(x, b0, c10), c11 = _mm256_fmadd_ps(x, b1, c11);
        x = _mm256_broadcast_ss(a2 + o);
        c20 = _mm256_fmadd_ps(x, b0, c20), c21 = _mm256_fmadd_ps(x, b1, c21);
        x = _mm256_broadcast_ss(a3 + o);
        c30 = _mm256_fmadd_ps(x, b0, c30), c31 = _mm256_fmadd_ps(x, b1, c31);
        x = _mm256_broadcast_ss(a4 + o);
        c40 = _mm256_fmadd_ps(x, b0, c40), c41 = _mm256_fmadd_ps(x, b1, c41);
        x = _mm256_broadcast_ss(a5 + o);
        c50 = _mm256_fmadd_ps(x, b0, c50), c51 = _mm256_fmadd_ps(x, b1, c51);
        b += bs;
    }
    const __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
    const int full = mr == MR && nr == NR;
    float tile[MR * NR];
    float *t = full ? c : tile;
    const int ldt = full ? ldc : NR;
    if (!full && beta != 0) { // the lanes outside c's window are zeros, not stack garbage
        memset(tile, 0, sizeof(tile));
        for (int r = 0; r < mr; r++) memcpy(tile + r * NR, c + (size_t)r * ldc, sizeof(float) * nr);
    }
    for (int r = 0; r < MR; r++)
        for (int h = 0; h < 2; h++) {
            float *p = t + (size_t)r * ldt + 8 * h;
            __m256 v = _mm256_mul_ps(va, acc[r][h]);
            if (beta != 0) v = _mm256_add_ps(v, _mm256_mul_ps(vb, _mm256_loadu_ps(p)));
            _mm256_storeu_ps(p, v);
        }
    if (!full)
        for (int r = 0; r < mr; r++) memcpy(c + (size_t)r * ldc, tile + r * NR, sizeof(float) * nr);
}

__attribute__((target("avx2,fma"))) static void kernel_packed(int kc, const float *a, const float *b, float *c, int ldc,
                                                               int mr, int nr, float alpha, float beta) {
    kernel_body(MR, kc, a, 1, b, NR, c, ldc, mr, nr, alpha, beta);
}

__attribute__((target("avx2,fma"))) static void kernel_rows(int kc, const float *a, size_t lda, const float *b, float *c,
                                                             int ldc, int mr, int nr, float alpha, float beta) {
    kernel_body(1, kc, a, lda, b, NR, c, ldc, mr, nr, alpha, beta);
}

// kernel_rows with op(B) = B read in place, row k of the panel at b + k ldb (see gemm_f32_epi)
__attribute__((target("avx2,fma"))) static void kernel_inplace(int kc, const float *a, size_t lda, const float *b,
                                                                size_t ldb, float *c, int ldc, int mr, float alpha,
                                                                float beta) {
    kernel_body(1, kc, a, lda, b, ldb, c, ldc, mr, NR, alpha, beta);
}

static size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

int gemm_f32(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
             const float *B, int ldb, float beta, float *C, int ldc) {
    return gemm_f32_epi(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, NULL, NULL);
}

// columns of C an epilogue call covers: four panels, 36 KB of C at MC rows, in L1 with the panel
// of B the kernel reads
enum { EPI_NC = 4 * NR };

// epi over rows [i0, i0+mc) of C's first N columns, EPI_NC columns a call
static void epi_rows(gemm_f32_epi_fn epi, const void *ctx, float *C, int ldc, int i0, int mc, int N) {
    for (int j = 0; j < N; j += EPI_NC) epi(ctx, C, ldc, i0, mc, j, N - j < EPI_NC ? N - j : EPI_NC);
}

// the operands of one gemm_f32_epi call, for run_block
typedef struct {
    int ta, M, K;
    float alpha, beta;
    const float *A;
    int lda;
    float *ap;   // op(A)'s packed MC x KC block when op(A) = A^T, or all M rows of the chunk
    int a_whole; // ap holds all M rows of the KC chunk, packed by drive
    float *C;
    int ldc;
    gemm_f32_epi_fn epi;
    const void *ctx;
} blocks;

// C's rows [ic, ic+MC) and columns [jc, jc+nc) += their products over K's chunk [pc, pc+KC),
// bp holding that chunk of op(B) packed; the first chunk applies beta, the last the epilogue
static void run_block(const blocks *g, const float *bp, int jc, int nc, int ic, int pc) {
    const int mc = g->M - ic < MC ? g->M - ic : MC, kc = g->K - pc < KC ? g->K - pc : KC;
    const float bet = pc == 0 ? g->beta : 1; // later chunks add to what the first wrote
    const int last = pc + kc >= g->K;
    if (g->ta && !g->a_whole) pack_a(g->ap, g->A, g->lda, ic, mc, pc, kc);
    const float *ap = g->ta && g->a_whole ? g->ap + (size_t)ic * kc : g->ap;
    for (int jr = 0; jr < nc; jr += NR) {
        for (int ir = 0; ir < mc; ir += MR) {
            float *ct = g->C + (size_t)(ic + ir) * g->ldc + jc + jr;
            const int mr = mc - ir < MR ? mc - ir : MR, nr = nc - jr < NR ? nc - jr : NR;
            if (g->ta) kernel_packed(kc, ap + (size_t)ir * kc, bp + (size_t)jr * kc, ct, g->ldc, mr, nr, g->alpha, bet);
            else kernel_rows(kc, g->A + (size_t)(ic + ir) * g->lda + pc, (size_t)g->lda, bp + (size_t)jr * kc, ct, g->ldc,
                             mr, nr, g->alpha, bet);
        }
        if (g->epi && last && (jr + NR >= nc || (jr + NR) % EPI_NC == 0)) {
            const int j0 = jr / EPI_NC * EPI_NC;
            g->epi(g->ctx, g->C, g->ldc, ic, mc, jc + j0, (jr + NR < nc ? jr + NR : nc) - j0);
        }
    }
}

// The blocks of a product with K > 0 and alpha != 0, op(B) packed here from B (pre NULL) or
// packed already (pre, gemm_f32_pack_b's layout). Two orders of the blocks, the same sums in the
// same order for every element of C, so the same bits. By default each KC chunk of op(B) is
// packed once and every MC block of op(A) runs against it, C passing through the cache once per
// chunk. With K over KC and op(A) = A (the forward products and the input gradients, 4160 x 256 x
// 1024 at bench-s), all of op(B)'s KC chunks for the NC columns are packed up front (2 MB at
// most) and each MC block of C stays in L2 while its sums run over all of K: 8% faster on a Zen 3
// there. The weight gradients (op(A) = A^T, K the tokens) keep the first order, their C being a
// few rows and their op(B) long: there, packing B whole and reading it again for every row block
// of C was 10-15% slower. Their op(A) = A^T chunk is packed for all M rows at once where it fits
// A_WHOLE: A's KC rows then stream through whole, where packing MC columns of them at a time read
// 576 bytes of each 4 KB row (dy's at bench-s's fc1). Packing went from 13.8% to 10.8% of
// `perf`'s samples in those products on a Zen 3 (1 thread; best of 6 alternating runs, 1024 x
// 256 x 4160: 76.7 to 77.3 GFLOP/s, 768 x 256 x 4160: 76.2 to 78.3).
static int drive(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb,
                 const float *pre, float beta, float *C, int ldc, gemm_f32_epi_fn epi, const void *ctx) {
    const size_t kcm = (size_t)(K < KC ? K : KC), ncm = round_up((size_t)(N < NC ? N : NC), NR);
    const int whole = !ta && K > KC && (size_t)K * ncm <= B_WHOLE;
    const int a_whole = ta && M > MC && kcm * round_up((size_t)M, MR) <= A_WHOLE;
    const size_t nb = round_up((whole ? (size_t)K : kcm) * ncm * sizeof(float), 64);
    const size_t na = round_up(kcm * round_up((size_t)(a_whole || M < MC ? M : MC), MR) * sizeof(float), 64);
    float *bp = pre ? NULL : aligned_alloc(64, nb), *ap = ta ? aligned_alloc(64, na) : NULL;
    if ((!pre && !bp) || (ta && !ap)) {
        free(bp), free(ap);
        return -1;
    }
    const blocks g = {ta, M, K, alpha, beta, A, lda, ap, a_whole, C, ldc, epi, ctx};
    for (int jc = 0; jc < N; jc += NC) {
        const int nc = N - jc < NC ? N - jc : NC;
        const size_t ncr = round_up((size_t)nc, NR);
        const float *bj = pre ? pre + (size_t)jc * K : bp; // this block's chunks, whole-order layout
        if (whole) {
            for (int pc = 0; !pre && pc < K; pc += KC) pack_b(bp + (size_t)pc * ncr, tb, B, ldb, jc, nc, pc, K - pc < KC ? K - pc : KC);
            for (int ic = 0; ic < M; ic += MC)
                for (int pc = 0; pc < K; pc += KC) run_block(&g, bj + (size_t)pc * ncr, jc, nc, ic, pc);
        } else {
            for (int pc = 0; pc < K; pc += KC) {
                if (!pre) pack_b(bp, tb, B, ldb, jc, nc, pc, K - pc < KC ? K - pc : KC);
                if (a_whole) pack_a(ap, A, lda, 0, M, pc, K - pc < KC ? K - pc : KC);
                for (int ic = 0; ic < M; ic += MC) run_block(&g, pre ? bj + (size_t)pc * ncr : bp, jc, nc, ic, pc);
            }
        }
    }
    free(bp), free(ap);
    return 0;
}

int gemm_f32_epi(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc, gemm_f32_epi_fn epi,
                 const void *ctx) {
    if (M <= 0 || N <= 0) return 0;
    if (!gemm_f32_supported()) return -1;
    if (K <= 0 || alpha == 0) { // no products (as in BLAS, alpha 0 reads neither A nor B): C = beta C
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) C[(size_t)i * ldc + j] = beta != 0 ? beta * C[(size_t)i * ldc + j] : 0;
        for (int i = 0; epi && i < M; i += MC) epi_rows(epi, ctx, C, ldc, i, M - i < MC ? M - i : MC, N);
        return 0;
    }
    // a small op(B) = B of whole panels (attention's products with V, K, Q and dout, 65 x 64 at
    // bench-s): read where it is, its rows' 16-float runs being what packing would copy; packing
    // it cost as much as the products at that size. Same arithmetic, so the same bits.
    if (!ta && !tb && K <= KC && N <= 4 * NR && N % NR == 0) {
        for (int ic = 0; ic < M; ic += MC) {
            const int mc = M - ic < MC ? M - ic : MC;
            for (int jr = 0; jr < N; jr += NR)
                for (int ir = 0; ir < mc; ir += MR)
                    kernel_inplace(K, A + (size_t)(ic + ir) * lda, (size_t)lda, B + jr, (size_t)ldb,
                                   C + (size_t)(ic + ir) * ldc + jr, ldc, mc - ir < MR ? mc - ir : MR, alpha, beta);
            if (epi) epi_rows(epi, ctx, C, ldc, ic, mc, N);
        }
        return 0;
    }
    return drive(ta, tb, M, N, K, alpha, A, lda, B, ldb, NULL, beta, C, ldc, epi, ctx);
}

size_t gemm_f32_packed_b_floats(int N, int K) { return N > 0 && K > 0 ? (size_t)K * round_up((size_t)N, NR) : 0; }

// The packed op(B): for each NC block of columns jc, for each KC chunk pc of K, the chunk's
// panels (pack_b's layout) at jc K + pc round_up(nc, NR), nc being the block's width
void gemm_f32_pack_b(float *bp, int tb, const float *B, int ldb, int N, int K, int j0, int j1) {
    if (j0 % NR || j1 <= j0 || K <= 0 || !gemm_f32_supported()) return;
    j1 = j1 < N ? j1 : N;
    for (int jc = j0 / NC * NC; jc < j1; jc += NC) {
        const int nc = N - jc < NC ? N - jc : NC, a = j0 > jc ? j0 : jc, b = j1 < jc + nc ? j1 : jc + nc;
        const size_t ncr = round_up((size_t)nc, NR);
        for (int pc = 0; pc < K; pc += KC) {
            const int kc = K - pc < KC ? K - pc : KC;
            pack_b(bp + (size_t)jc * K + (size_t)pc * ncr + (size_t)(a - jc) * kc, tb, B, ldb, a, b - a, pc, kc);
        }
    }
}

int gemm_f32_epi_packed(int ta, int M, int N, int K, float alpha, const float *A, int lda, const float *bp,
                        float beta, float *C, int ldc, gemm_f32_epi_fn epi, const void *ctx) {
    if (M <= 0 || N <= 0) return 0;
    if (!gemm_f32_supported()) return -1;
    if (K <= 0 || alpha == 0) return gemm_f32_epi(ta, 0, M, N, K, alpha, A, lda, NULL, N, beta, C, ldc, epi, ctx);
    return drive(ta, 0, M, N, K, alpha, A, lda, NULL, 0, bp, beta, C, ldc, epi, ctx);
}
