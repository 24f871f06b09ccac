// test_gemm_f32.c: vlmoe's own AVX2 fp32 product (src/ops/gemm_f32.c), run wherever the CPU
// has AVX2 and FMA3 (the library itself prefers it only without AVX-512, but the kernel is the
// same). 1. Every transpose, alpha and beta, shapes at and across every block edge (the 6x16
// tile, KC 256, MC 144, NC 3072, the 2 MB of op(B) packed whole), K 0, leading dimensions wider than the matrices: C equals the
// double product to fp32 summation error, and nothing outside C's window is written. 2. beta 0
// never reads C, and alpha 0 neither A nor B (NaN there stays out of the result). 3. A row's bits do not depend on M or on
// its position, and a column's not on N or its position: what the header promises and what makes
// a batch of one equal the same row in a batch of many. 4. gemm_f32_epi runs its epilogue once on
// every element, after the element's last product, in blocks within the promised size. 5. op(B)
// packed once (gemm_f32_pack_b, gemm_f32_epi_packed) gives the same bits and epilogue.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ops/gemm_f32.h"
#include "test.h"

static unsigned lcg = 12345;
static float frand(void) {
    lcg = lcg * 1664525u + 1013904223u;
    return (float)((lcg >> 8) & 0xffff) / 32768.0f - 1.0f;
}

// op(X)[i][k] of a row-major X with leading dimension ld
static float at(const float *X, int trans, int ld, int i, int k) {
    return trans ? X[(size_t)k * ld + i] : X[(size_t)i * ld + k];
}

// one product against double: the error bound is K+2 roundings of the magnitudes involved
static void check_product(int ta, int tb, int M, int N, int K, float alpha, float beta) {
    const int lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 2, ldc = N + 5;
    const size_t na = (size_t)(ta ? K : M) * lda + 1, nb = (size_t)(tb ? N : K) * ldb + 1, nc = (size_t)M * ldc;
    float *A = malloc(sizeof(float) * na), *B = malloc(sizeof(float) * nb), *C = malloc(sizeof(float) * nc);
    float *C0 = malloc(sizeof(float) * nc);
    for (size_t i = 0; i < na; i++) A[i] = frand();
    for (size_t i = 0; i < nb; i++) B[i] = frand();
    for (size_t i = 0; i < nc; i++) C0[i] = C[i] = frand();
    const int rc = gemm_f32(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    CHECK(rc == 0, "gemm_f32 returned %d", rc);
    double worst = 0;
    int bad = 0, outside = 0;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < ldc; j++) {
            const size_t o = (size_t)i * ldc + j;
            if (j >= N) {
                outside += memcmp(&C[o], &C0[o], sizeof(float)) != 0;
                continue;
            }
            double s = 0, mag = 0;
            for (int k = 0; k < K; k++) {
                const double p = (double)at(A, ta, lda, i, k) * at(B, !tb, ldb, j, k);
                s += p, mag += fabs(p);
            }
            const double ref = alpha * s + (beta != 0 ? beta * (double)C0[o] : 0);
            const double tol = (K + 3) * 6.0e-8 * (fabs(alpha) * mag + fabs(beta * C0[o])) + 1e-30;
            const double err = fabs(C[o] - ref) / tol;
            worst = err > worst ? err : worst;
            bad += err > 1;
        }
    CHECK(bad == 0 && outside == 0,
          "ta %d tb %d M %d N %d K %d alpha %g beta %g: %d elements beyond the bound (worst %.2fx), %d written outside C",
          ta, tb, M, N, K, alpha, beta, bad, worst, outside);
    free(A), free(B), free(C), free(C0);
}

// beta 0: C's old values are never read, NaN included, whatever the transposes and K (0, one
// chunk, two); alpha 0: neither are A's and B's (NaN there), C = beta C
static void check_nan_unread(void) {
    const int M = 13, N = 21, Ks[] = {0, 40, 300};
    for (int t = 0; t < 4; t++)
        for (int ki = 0; ki < 3; ki++) {
            const int ta = t >> 1, tb = t & 1, K = Ks[ki], lda = ta ? M : K, ldb = tb ? K : N;
            float *A = malloc(sizeof(float) * (M * K + 1)), *B = malloc(sizeof(float) * (K * N + 1));
            float *C = malloc(sizeof(float) * M * N);
            for (int i = 0; i < M * K; i++) A[i] = frand();
            for (int i = 0; i < K * N; i++) B[i] = frand();
            for (int i = 0; i < M * N; i++) C[i] = NAN;
            CHECK(gemm_f32(ta, tb, M, N, K, 1, A, lda, B, ldb, 0, C, N) == 0, "gemm_f32 failed");
            int nans = 0;
            for (int i = 0; i < M * N; i++) nans += isnan(C[i]);
            CHECK(nans == 0, "ta %d tb %d K %d: beta 0 read C: %d NaN in the result", ta, tb, K, nans);
            for (int i = 0; i < M * K; i++) A[i] = NAN;
            for (int i = 0; i < M * N; i++) C[i] = (float)i;
            CHECK(gemm_f32(ta, tb, M, N, K, 0, A, lda, B, ldb, 0.5f, C, N) == 0, "gemm_f32 failed");
            int wrong = 0;
            for (int i = 0; i < M * N; i++) wrong += C[i] != 0.5f * (float)i;
            CHECK(wrong == 0, "ta %d tb %d K %d: alpha 0 read A (NaN) or missed C = beta C in %d elements", ta, tb, K, wrong);
            free(A), free(B), free(C);
        }
}

// rows and columns alone or at any offset give the bits they give inside the whole product. M, N
// no multiple of the tile; K across a KC chunk. With op(A) = A and N 1800, the whole product takes
// the block order that packs each chunk of op(B) alone (K x N over 2 MB) and the column blocks the
// one that packs op(B) whole: both must sum every element alike. With op(A) = A^T and M over MC,
// the whole product packs each chunk of A^T for all rows at once, the row blocks an MC at a time.
static void check_position(int ta, int tb, int M, int N, int K) {
    const int lda = ta ? M : K, ldb = tb ? K : N;
    float *A = malloc(sizeof(float) * M * K), *B = malloc(sizeof(float) * K * N);
    float *C = malloc(sizeof(float) * M * N), *P = malloc(sizeof(float) * M * N);
    for (int i = 0; i < M * K; i++) A[i] = frand();
    for (int i = 0; i < K * N; i++) B[i] = frand();
    CHECK(gemm_f32(ta, tb, M, N, K, 1, A, lda, B, ldb, 0, C, N) == 0, "gemm_f32 failed");
    int diff = 0;
    for (int r0 = 0; r0 < M; r0 += 4) { // rows [r0, r0 + m) alone: the first lands mid-tile
        const int m = r0 % 3 + 1 < M - r0 ? r0 % 3 + 1 : M - r0;
        CHECK(gemm_f32(ta, tb, m, N, K, 1, ta ? A + r0 : A + (size_t)r0 * lda, lda, B, ldb, 0, P, N) == 0, "gemm_f32 failed");
        diff += memcmp(P, C + (size_t)r0 * N, sizeof(float) * m * N) != 0;
    }
    for (int c0 = 0; c0 < N; c0 += 7) { // columns [c0, c0 + n) alone
        const int n = c0 % 5 + 1 < N - c0 ? c0 % 5 + 1 : N - c0;
        CHECK(gemm_f32(ta, tb, M, n, K, 1, A, lda, tb ? B + (size_t)c0 * ldb : B + c0, ldb, 0, P, n) == 0, "gemm_f32 failed");
        for (int i = 0; i < M; i++) diff += memcmp(P + (size_t)i * n, C + (size_t)i * N + c0, sizeof(float) * n) != 0;
    }
    CHECK(diff == 0, "ta %d tb %d M %d N %d K %d: %d row or column blocks differ in bits from the same place in the whole product",
          ta, tb, M, N, K, diff);
    free(A), free(B), free(C), free(P);
}

// what the epilogue saw: C at the moment each element was handed to it, and how many times
typedef struct {
    float *seen;
    int *count, ldc, M, N, bad_block;
} epi_log;

static void epi_record(const void *ctx, float *C, int ldc, int r0, int nr, int c0, int nc) {
    const epi_log *l = ctx;
    if (ldc != l->ldc || r0 < 0 || c0 < 0 || nr <= 0 || nc <= 0 || r0 + nr > l->M || c0 + nc > l->N ||
        nr > 144 || nc > 64) {
        ((epi_log *)l)->bad_block++;
        return;
    }
    for (int i = r0; i < r0 + nr; i++)
        for (int j = c0; j < c0 + nc; j++) {
            l->seen[(size_t)i * l->N + j] = C[(size_t)i * ldc + j];
            l->count[(size_t)i * l->N + j]++;
            C[(size_t)i * ldc + j] += 1; // what an epilogue does: change C in place
        }
}

// gemm_f32_epi (packed: gemm_f32_epi_packed, op(B) packed first) hands every element of C to the
// epilogue once, in blocks of at most 144 x 64, when its value is final (the bits gemm_f32
// gives), and what the epilogue writes stays
static void check_epilogue(int ta, int tb, int M, int N, int K, float beta, int packed) {
    const int lda = ta ? M : K, ldb = tb ? K : N, ldc = N + 3;
    const size_t nc = (size_t)M * ldc;
    float *A = malloc(sizeof(float) * ((size_t)M * K + 1)), *B = malloc(sizeof(float) * ((size_t)K * N + 1));
    float *C = malloc(sizeof(float) * nc), *R = malloc(sizeof(float) * nc), *seen = calloc((size_t)M * N, sizeof(float));
    int *count = calloc((size_t)M * N, sizeof(int));
    for (size_t i = 0; i < (size_t)M * K; i++) A[i] = frand();
    for (size_t i = 0; i < (size_t)K * N; i++) B[i] = frand();
    for (size_t i = 0; i < nc; i++) C[i] = R[i] = frand();
    epi_log l = {seen, count, ldc, M, N, 0};
    CHECK(gemm_f32(ta, tb, M, N, K, 1, A, lda, B, ldb, beta, R, ldc) == 0, "gemm_f32 failed");
    float *bp = packed ? malloc(sizeof(float) * (gemm_f32_packed_b_floats(N, K) + 1)) : NULL;
    if (bp) gemm_f32_pack_b(bp, tb, B, ldb, N, K, 0, N);
    CHECK((bp ? gemm_f32_epi_packed(ta, M, N, K, 1, A, lda, bp, beta, C, ldc, epi_record, &l)
              : gemm_f32_epi(ta, tb, M, N, K, 1, A, lda, B, ldb, beta, C, ldc, epi_record, &l)) == 0,
          "gemm_f32_epi%s failed", bp ? "_packed" : "");
    int once = 0, final = 0, kept = 0;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            const size_t o = (size_t)i * N + j, oc = (size_t)i * ldc + j;
            once += count[o] == 1;
            final += memcmp(&seen[o], &R[oc], sizeof(float)) == 0;
            kept += C[oc] == R[oc] + 1;
        }
    CHECK(l.bad_block == 0 && once == M * N && final == M * N && kept == M * N,
          "ta %d tb %d M %d N %d K %d beta %g%s: %d blocks out of bounds; of %d elements %d seen once, %d with "
          "their final value, %d keep the epilogue's write",
          ta, tb, M, N, K, beta, bp ? " (op(B) packed)" : "", l.bad_block, M * N, once, final, kept);
    free(A), free(B), free(C), free(R), free(seen), free(count), free(bp);
}

// op(B) packed once (gemm_f32_pack_b, in 64-column ranges packed last to first, as threads may)
// and then multiplied (gemm_f32_epi_packed) gives gemm_f32's bits, and with an epilogue
// gemm_f32_epi's: the shapes cover the small op(B) = B that gemm_f32 reads in place, K across KC,
// N across NC, and op(B) over the 2 MB that changes the block order
static void check_packed(int ta, int tb, int M, int N, int K, float beta) {
    const int lda = ta ? M : K, ldb = tb ? K : N, ldc = N + 1;
    const size_t nc = (size_t)M * ldc, nbp = gemm_f32_packed_b_floats(N, K);
    float *A = malloc(sizeof(float) * ((size_t)M * K + 1)), *B = malloc(sizeof(float) * ((size_t)K * N + 1));
    float *R = malloc(sizeof(float) * nc), *P = malloc(sizeof(float) * nc), *bp = malloc(sizeof(float) * (nbp + 1));
    for (size_t i = 0; i < (size_t)M * K; i++) A[i] = frand();
    for (size_t i = 0; i < (size_t)K * N; i++) B[i] = frand();
    for (size_t i = 0; i < nc; i++) R[i] = P[i] = frand();
    CHECK(nbp >= (size_t)K * N && nbp < (size_t)K * (N + 16), "N %d K %d: %zu floats for the packed op(B)", N, K, nbp);
    for (int j0 = (N - 1) / 64 * 64; j0 >= 0; j0 -= 64) gemm_f32_pack_b(bp, tb, B, ldb, N, K, j0, j0 + 64);
    CHECK(gemm_f32(ta, tb, M, N, K, 1, A, lda, B, ldb, beta, R, ldc) == 0, "gemm_f32 failed");
    CHECK(gemm_f32_epi_packed(ta, M, N, K, 1, A, lda, bp, beta, P, ldc, NULL, NULL) == 0, "gemm_f32_epi_packed failed");
    int diff = 0;
    for (size_t i = 0; i < nc; i++) diff += memcmp(&R[i], &P[i], sizeof(float)) != 0;
    CHECK(diff == 0, "ta %d tb %d M %d N %d K %d beta %g: %d elements differ in bits from gemm_f32", ta, tb, M, N, K, beta, diff);
    free(A), free(B), free(R), free(P), free(bp);
    check_epilogue(ta, tb, M, N, K, beta, 1); // with an epilogue: each element once, with its final value
}

int main(void) {
    if (!gemm_f32_supported()) {
        printf("test_gemm_f32: skipped: this CPU lacks AVX2 or FMA3, so the library never runs gemm_f32\n");
        return test_summary("test_gemm_f32");
    }
    printf("test_gemm_f32: the library %s it on this CPU\n", gemm_f32_preferred() ? "prefers" : "does not prefer (AVX-512: oneDNN)");
    static const int shapes[][3] = {
        {1, 1, 1},   {1, 17, 5},   {5, 16, 256}, {6, 16, 257}, {7, 33, 300}, {13, 15, 513},
        {150, 40, 70}, {289, 50, 20}, {3, 3100, 9}, {20, 20, 0}, {64, 64, 64},
        {65, 64, 65}, {150, 32, 7}, // op(B) = B read in place (N whole panels up to 64, K up to 256)
        {150, 700, 520}, {7, 3100, 300}, // K over KC, op(B) packed whole (K x N up to 2 MB) or not
    };
    const float ab[][2] = {{1, 0}, {1, 1}, {0.5f, -0.25f}};
    for (int t = 0; t < 4; t++)
        for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
            for (size_t v = 0; v < sizeof(ab) / sizeof(ab[0]); v++)
                check_product(t >> 1, t & 1, shapes[s][0], shapes[s][1], shapes[s][2], ab[v][0], ab[v][1]);
    check_nan_unread();
    for (int t = 0; t < 4; t++) check_position(t >> 1, t & 1, 29, 45, 300), check_position(t >> 1, t & 1, 29, 1800, 300);
    // op(A) = A^T over MC rows: each KC chunk packed for all 301 rows at once (a partial last
    // panel), the rows alone a block at a time
    for (int tb = 0; tb < 2; tb++) check_position(1, tb, 301, 45, 300);
    // shapes across MC (144 rows), the 64-column epilogue blocks, NC (3072) and KC (256); K 0
    static const int eshapes[][3] = {{1, 1, 1}, {150, 70, 300}, {145, 65, 256}, {7, 3100, 20}, {20, 130, 0}, {150, 64, 65}};
    for (int t = 0; t < 4; t++)
        for (size_t s = 0; s < sizeof(eshapes) / sizeof(eshapes[0]); s++)
            for (int b = 0; b < 2; b++) check_epilogue(t >> 1, t & 1, eshapes[s][0], eshapes[s][1], eshapes[s][2], (float)b, 0);
    static const int pshapes[][3] = {{1, 1, 1}, {7, 33, 300}, {150, 64, 65}, {65, 48, 200}, {150, 700, 520}, {9, 3100, 270}, {5, 2100, 300}};
    for (int t = 0; t < 4; t++)
        for (size_t s = 0; s < sizeof(pshapes) / sizeof(pshapes[0]); s++)
            for (int b = 0; b < 2; b++) check_packed(t >> 1, t & 1, pshapes[s][0], pshapes[s][1], pshapes[s][2], (float)b);
    return test_summary("test_gemm_f32");
}
