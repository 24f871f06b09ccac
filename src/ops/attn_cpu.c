// attn_cpu.c: multi-head attention in float as one fused kernel per (sequence, head), in AVX-512
// or in AVX2 with FMA: scores, mask, softmax and normalisation, then the products with V
// (forward) or dout, q, k (backward) as broadcast tiles, in place of 2 + 4 sgemm calls a head
// with softmax passes and transposes between them (bench/bench_attention.c times both). Same
// maths as ops.c's reference loops (Vaswani et al. 2017, eq. 1; masks: ops.h's attn_segment).
// Covered by tests/test_attn_cpu.c and ops.c's tests.
#include "ops/attn_cpu.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))
// Floats of the transposed K (forward) or V (backward) tile kept on the stack: 64 KB, the budget
// ops.c's reference path already uses for its copy.
#define ATT_TILE 16384
#if defined(__AVX512F__)
#define VW 16 // floats a vector
#else
#define VW 8
#endif

typedef struct {
    int T, TP, NV, hd, len, causal, prefix; // TP = VW NV: T rounded up to whole vectors
    float scale;
} head_dims;

// k (T rows of hd at stride ld) into kt (hd, TP), columns T..TP zero, so the score tiles load
// whole aligned vectors. 8x8 blocks go through registers (a column at a time would be 4160
// strided stores per head); hd's last hd % 8 columns element by element.
static void transpose_pad(float *kt, const float *k, int T, int TP, int hd, int ld) {
    const int d8 = hd & ~7;
    for (int j0 = 0; j0 < TP; j0 += 8) {
        for (int d = 0; d < d8; d += 8)
            tile8_transpose(kt + (size_t)d * TP + j0, (size_t)TP, k + (size_t)j0 * ld + d, (size_t)ld, T - j0);
        for (int d = d8; d < hd; d++)
            for (int i = 0; i < 8; i++) kt[(size_t)d * TP + j0 + i] = j0 + i < T ? k[(size_t)(j0 + i) * ld + d] : 0;
    }
}

// The first query that may see key j: past the prefix a causal key is seen from itself on.
static inline int first_query(const head_dims *s, int j) {
    return s->causal && j >= s->prefix ? j : 0;
}

static int fused_dims(head_dims *s, const attn_segment *seg, int D, int H) {
    const int T = seg->seqlen, hd = D / H, NV = (T + VW - 1) / VW;
    *s = (head_dims){.T = T, .TP = VW * NV, .NV = NV, .hd = hd, .causal = seg->causal,
                     .prefix = seg->prefix, .scale = (float)(1.0 / sqrt((double)hd))};
    return T >= 1 && T <= ATTN_FUSED_TMAX && (size_t)hd * VW * NV <= ATT_TILE;
}

// Sequence b's dims (s0 with its length) in *s; returns its first token's row.
static size_t head_of(head_dims *s, const head_dims *s0, const attn_segment *seg, int b) {
    *s = *s0;
    s->len = seg->lens ? seg->lens[b] : s0->T;
    return seg->tok_off + (size_t)b * s0->T;
}

// c (nr <= 6 rows at ldc, hd columns) = sum over k in [k0, k1) of a's rows times b's: one per
// instruction set, below (b: rows at ldb in place, or AVX2's rows_pack chunks with ldb T).
static void bcast_tile(float *c, int ldc, const float *a, int ars, int acs, int nr, int k0, int k1,
                       const float *b, int ldb, int hd);

// c's T rows, 6 at a time at ldc, = a b over the keys each block of rows needs. Query rows
// (keys 0: p v, ds k) sum k up to the block's last row's key_limit, past which their a holds
// zeros; key rows (keys 1: p^T dout, ds^T q) from the first query that sees the block's first
// key. a's row r at r ars, its k-th element at k acs; b as bcast_tile takes it.
static void tile_rows(float *c, int ldc, const float *a, int ars, int acs, int keys, const head_dims *s,
                      const float *b, int ldb) {
    for (int i0 = 0; i0 < s->T; i0 += 6) {
        const int nr = s->T - i0 < 6 ? s->T - i0 : 6;
        const int k0 = keys ? first_query(s, i0) : 0;
        const int k1 = keys ? s->T : key_limit(i0 + nr - 1, s->len, s->causal, s->prefix);
        bcast_tile(c + (size_t)i0 * ldc, ldc, a + (size_t)i0 * ars, ars, acs, nr, k0, k1, b, ldb, s->hd);
    }
}

#if defined(__AVX512F__)
// The first n lanes of a vector (n clamped to [0, 16]).
static inline __mmask16 lanes(int n) {
    n = n < 0 ? 0 : n > 16 ? 16 : n;
    return (__mmask16)((1u << n) - 1);
}

// e^x on 16 lanes by src/core/real.h's vexp recipe (the same reduction and Cephes polynomial,
// here with fused multiply-adds, and 2^n applied by scalef, which rounds denormals once), so the
// same accuracy: +inf above ln(FLT_MAX), NaN in, NaN out, 0 far below.
static inline __m512 exp16(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.7228317f);
    const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), hi); // NaN -> -104
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512 y = _mm512_scalef_ps(p, n);
    y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), _mm512_set1_ps(INFINITY));
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

// RT query rows from i0 (rows past T repeat the last and are not stored) times kt, held in RT x NV
// registers, then per row: forward (bwd 0): scale, mask, softmax, and the probabilities stored
// to o (T, T); backward: with the forward's p (T, T), ds = p (dp - rowsum(p dp)) scale stored to
// o. NV and RT are constants at every call, so the loops unroll and acc lives in registers.
// TAIL 1: the last T - 16 NV keys (1 or 2: T 65 is 64 + the class token) are not in the tiles'
// vectors but dot products with their rows of k (kr, at stride ldk), which would otherwise cost
// a whole vector of mostly padding for every d: a fifth of the scores' work at T 65.
AI void score_tile(const int NV, const int RT, const int TAIL, int bwd, const head_dims *s, int i0,
                   const float *x, int ldx, const float *kt, const float *kr, int ldk, const float *p,
                   float *o) {
    __m512 acc[8][6];
    const float *xr[8];
#pragma GCC unroll 8
    for (int r = 0; r < RT; r++) xr[r] = x + (size_t)(i0 + r < s->T ? i0 + r : s->T - 1) * ldx;
#pragma GCC unroll 8
    for (int r = 0; r < RT; r++)
#pragma GCC unroll 6
        for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
    for (int d = 0; d < s->hd; d++) {
        const float *kd = kt + (size_t)d * s->TP;
        __m512 kv[6];
#pragma GCC unroll 6
        for (int v = 0; v < NV; v++) {
            kv[v] = _mm512_load_ps(kd + 16 * v);
            // held in a register: GCC would fold the load into each of the RT multiply-adds,
            // RT times the loads, and the load ports, not the FMAs, would set the pace
            __asm__("" : "+v"(kv[v]));
        }
#pragma GCC unroll 8
        for (int r = 0; r < RT; r++) {
            const __m512 b = _mm512_set1_ps(xr[r][d]);
#pragma GCC unroll 6
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(b, kv[v], acc[r][v]);
        }
    }
    const __m512 scale = _mm512_set1_ps(s->scale), ninf = _mm512_set1_ps(-INFINITY);
#pragma GCC unroll 8
    for (int r = 0; r < RT; r++) {
        const int i = i0 + r;
        if (i >= s->T) break;
        float *orow = o + (size_t)i * s->T;
        if (TAIL) {
            __m512 tl = _mm512_setzero_ps();
            for (int j = 16 * NV; j < s->T; j++) {
                __m512 dt = _mm512_setzero_ps();
                for (int d0 = 0; d0 < s->hd; d0 += 16) {
                    const __mmask16 m = lanes(s->hd - d0);
                    dt = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, xr[r] + d0),
                                         _mm512_maskz_loadu_ps(m, kr + (size_t)j * ldk + d0), dt);
                }
                tl = _mm512_mask_mov_ps(tl, (__mmask16)(1u << (j - 16 * NV)), _mm512_set1_ps(_mm512_reduce_add_ps(dt)));
            }
            acc[r][NV] = tl;
        }
        const int NT = NV + TAIL; // vectors of the row from here on
        if (!bwd) {
            const int nk = key_limit(i, s->len, s->causal, s->prefix);
            __m512 mx = ninf, sum = _mm512_setzero_ps();
#pragma GCC unroll 6
            for (int v = 0; v < NT; v++) {
                acc[r][v] = _mm512_mask_mul_ps(ninf, lanes(nk - 16 * v), acc[r][v], scale);
                mx = _mm512_max_ps(mx, acc[r][v]);
            }
            const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            // masked keys take e^0, then 0: e^-inf would come out of exp16's clamp as e^-104, a
            // subnormal, which cost a microcode assist a vector (18 ns an exp16 at T 65, where the
            // last vector holds 1 key and 15 masked lanes, against 2 without)
#pragma GCC unroll 6
            for (int v = 0; v < NT; v++) {
                const __mmask16 keep = lanes(nk - 16 * v);
                acc[r][v] = _mm512_maskz_mov_ps(keep, exp16(_mm512_maskz_sub_ps(keep, acc[r][v], m)));
                sum = _mm512_add_ps(sum, acc[r][v]);
            }
            // a row that sees no key (valid length 0) stays all zeros, as in the reference
            const __m512 inv = _mm512_set1_ps(nk > 0 ? 1 / _mm512_reduce_add_ps(sum) : 0);
#pragma GCC unroll 6
            for (int v = 0; v < NT; v++)
                _mm512_mask_storeu_ps(orow + 16 * v, lanes(s->T - 16 * v), _mm512_mul_ps(acc[r][v], inv));
        } else {
            const float *prow = p + (size_t)i * s->T;
            __m512 pv[6], dot = _mm512_setzero_ps();
#pragma GCC unroll 6
            for (int v = 0; v < NT; v++) {
                pv[v] = _mm512_maskz_loadu_ps(lanes(s->T - 16 * v), prow + 16 * v);
                dot = _mm512_fmadd_ps(pv[v], acc[r][v], dot);
            }
            const __m512 dt = _mm512_set1_ps(_mm512_reduce_add_ps(dot));
#pragma GCC unroll 6
            for (int v = 0; v < NT; v++)
                _mm512_mask_storeu_ps(orow + 16 * v, lanes(s->T - 16 * v),
                                      _mm512_mul_ps(_mm512_mul_ps(pv[v], _mm512_sub_ps(acc[r][v], dt)), scale));
        }
    }
}

// All T rows of one head's score tiles. Rows per tile keep RT x NV accumulators plus NV loaded
// keys and a broadcast within the 32 registers, with at least 8 independent sums in flight.
static void score_rows(int bwd, const head_dims *s, const float *x, int ldx, const float *kt,
                       const float *kr, int ldk, const float *p, float *o) {
#define ROWS(NV, RT, TAIL) \
    for (int i0 = 0; i0 < s->T; i0 += RT) score_tile(NV, RT, TAIL, bwd, s, i0, x, ldx, kt, kr, ldk, p, o); \
    break;
    if (s->T > 16 && s->T % 16 <= 2 && s->T % 16) {
        switch (s->T / 16) {
        case 1: ROWS(1, 8, 1)
        case 2: ROWS(2, 8, 1)
        case 3: ROWS(3, 6, 1)
        case 4: ROWS(4, 6, 1)
        default: ROWS(5, 4, 1)
        }
        return;
    }
    switch (s->NV) {
    case 1: ROWS(1, 8, 0)
    case 2: ROWS(2, 8, 0)
    case 3: ROWS(3, 6, 0)
    case 4: ROWS(4, 5, 0)
    case 5: ROWS(5, 4, 0)
    default: ROWS(6, 4, 0)
    }
#undef ROWS
}

AI void bcast_chunk(const int full, float *c, int ldc, const float *const ar[6], int acs, int nr, int k0,
                    int k1, const float *b, int ldb, int nc) {
    __mmask16 m[4];
    __m512 acc[6][4];
#pragma GCC unroll 4
    for (int u = 0; u < 4; u++) m[u] = lanes(nc - 16 * u);
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++)
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) acc[r][u] = _mm512_setzero_ps();
    for (int k = k0; k < k1; k++) {
        const float *bk = b + (size_t)k * ldb;
        __m512 bv[4];
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) bv[u] = full ? _mm512_loadu_ps(bk + 16 * u) : _mm512_maskz_loadu_ps(m[u], bk + 16 * u);
#pragma GCC unroll 6
        for (int r = 0; r < 6; r++) {
            const __m512 bc = _mm512_set1_ps(ar[r][(size_t)k * acs]);
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++) acc[r][u] = _mm512_fmadd_ps(bc, bv[u], acc[r][u]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++) // a constant bound keeps acc's indices constant
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) {
            if (r < nr && full) _mm512_storeu_ps(c + (size_t)r * ldc + 16 * u, acc[r][u]);
            else if (r < nr) _mm512_mask_storeu_ps(c + (size_t)r * ldc + 16 * u, m[u], acc[r][u]);
        }
}

// c (nr <= 6 rows at ldc, hd columns) = sum over k in [k0, k1) of a[r ars + k acs] b[k ldb ..]:
// p v and ds k with (ars, acs) = (T, 1), p^T dout and ds^T q with (1, T). The rest of a's rows
// past nr repeat its last and are not stored; hd runs in chunks of 4 vectors, a partial last
// one masked (whole chunks take plain loads and stores).
static void bcast_tile(float *c, int ldc, const float *a, int ars, int acs, int nr, int k0, int k1,
                       const float *b, int ldb, int hd) {
    const float *ar[6];
    for (int r = 0; r < 6; r++) ar[r] = a + (size_t)(r < nr ? r : nr - 1) * ars;
    for (int c0 = 0; c0 < hd; c0 += 64) {
        if (c0 + 64 <= hd) bcast_chunk(1, c + c0, ldc, ar, acs, nr, k0, k1, b + c0, ldb, 64);
        else bcast_chunk(0, c + c0, ldc, ar, acs, nr, k0, k1, b + c0, ldb, hd - c0);
    }
}

int attn_fused_forward(float *out, float *att, const float *qkv, const attn_segment *seg, int D,
                       int H) {
    head_dims s0;
    if (!fused_dims(&s0, seg, D, H)) return 0;
    const int T = s0.T, hd = s0.hd, ld = 3 * D;
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < seg->nseq; b++) {
        for (int h = 0; h < H; h++) {
            head_dims s;
            const size_t t0 = head_of(&s, &s0, seg, b);
            const float *q = qkv + t0 * ld + h * hd;
            float *a = att + (((size_t)b * H + h) * T) * T, *o = out + t0 * D + h * hd;
            _Alignas(64) float kt[ATT_TILE];
            transpose_pad(kt, q + D, T, s.TP, hd, ld);
            score_rows(0, &s, q, ld, kt, q + D, ld, NULL, a);
            tile_rows(o, D, a, T, 1, 0, &s, q + 2 * D, ld); // out = p v
        }
    }
    return 1;
}

int attn_fused_backward(float *dqkv, float *datt, const float *dout, const float *qkv,
                        const float *att, const attn_segment *seg, int D, int H) {
    (void)datt; // ds stays on the stack (below)
    head_dims s0;
    if (!fused_dims(&s0, seg, D, H)) return 0;
    const int T = s0.T, hd = s0.hd, ld = 3 * D;
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < seg->nseq; b++) {
        for (int h = 0; h < H; h++) {
            head_dims s;
            const size_t t0 = head_of(&s, &s0, seg, b);
            const float *q = qkv + t0 * ld + h * hd, *g = dout + t0 * D + h * hd;
            const float *a = att + (((size_t)b * H + h) * T) * T;
            float *dq = dqkv + t0 * ld + h * hd;
            // ds (T, T) stays in this thread's L1/L2: written to datt it went out to memory and
            // back (17 KB a head at T 65)
            _Alignas(64) float vt[ATT_TILE], ds[ATTN_FUSED_TMAX * ATTN_FUSED_TMAX];
            transpose_pad(vt, q + 2 * D, T, s.TP, hd, ld);
            score_rows(1, &s, g, D, vt, q + 2 * D, ld, a, ds);
            // key rows: dv = p^T dout, then dk = ds^T q, each pass's two operands (34 KB at T 65)
            // near L1's size where together they were twice it
            tile_rows(dq + 2 * D, ld, a, 1, T, 1, &s, g, D); // dv = p^T dout
            tile_rows(dq + D, ld, ds, 1, T, 1, &s, q, ld);  // dk = ds^T q
            tile_rows(dq, ld, ds, T, 1, 0, &s, q + D, ld);  // dq = ds k
        }
    }
    return 1;
}

#else
// AVX2 and FMA: 8 floats a vector and 16 registers, too few to hold a row of scores (9 vectors
// at T 65) beside its keys, so the scores go through a stack tile S (T rows of TP): 6 query
// rows by 16 keys at a time in 12 accumulators, then each row's softmax (or the backward's ds)
// in vectors, then the products with V (forward) or dout, q, k (backward) as broadcast tiles of
// 6 rows by 16 columns. On a Zen 3 at bench-s's shapes (best of 5 alternating runs), against
// ops.c's 2 + 4 calls of vlmoe's own product a head: T 65 forward 5.6 against 7.7 ms, backward
// 9.6 against 11.4 at 1 thread; T 16 (texts) 1.6-2.9x forward, 2.0-4.3x backward.

// The first n lanes (n clamped to [0, 8]) as maskload and maskstore take them.
static inline __m256i lanes(int n) {
    static const int tab[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    n = n < 0 ? 0 : n > 8 ? 8 : n;
    return _mm256_loadu_si256((const __m256i *)(tab + 8 - n));
}

static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

static inline float hmax(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

// e^x on 8 lanes by src/core/real.h's vexp_fma, step for step: its bits for every float (all
// 2^32 but those past +-200, where both clamp, were compared), so the same accuracy: +inf
// above ln(FLT_MAX), NaN in, NaN out, 0 far below. 2^n is applied as 2^h 2^(n-h),
// h = floor(n / 2), as n runs from -150 to 128, past one exponent field's range.
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.7228317f);
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), hi); // NaN -> -104
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i i = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(i, 1), bias = _mm256_set1_epi32(127);
    const __m256 sa = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
    const __m256 sb = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(i, h), bias), 23));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, sa), sb);
    y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// a . b over n floats
static inline float dotv(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= n; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    if (d < n) {
        const __m256i m = lanes(n - d);
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + d, m), _mm256_maskload_ps(b + d, m), acc);
    }
    return hsum(acc);
}

// The rows xr[0 .. nr) (the rest repeat the last and are not stored) times NB vectors of kt's
// columns (kt at stride TP), into S's rows at lds: 6 x NB accumulators, NB keys and a broadcast.
AI void score_blk(const int NB, const float *const xr[6], int nr, int hd, const float *kt, int TP, float *S,
                  int lds) {
    __m256 acc[6][2];
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++)
#pragma GCC unroll 2
        for (int v = 0; v < NB; v++) acc[r][v] = _mm256_setzero_ps();
    for (int d = 0; d < hd; d++) {
        __m256 kv[2];
#pragma GCC unroll 2
        for (int v = 0; v < NB; v++) {
            kv[v] = _mm256_load_ps(kt + (size_t)d * TP + 8 * v);
            // held in a register: GCC would fold the load into each of the 6 multiply-adds, and
            // the load ports, not the FMAs, would set the pace
            __asm__("" : "+x"(kv[v]));
        }
#pragma GCC unroll 6
        for (int r = 0; r < 6; r++) {
            const __m256 b = _mm256_broadcast_ss(xr[r] + d);
#pragma GCC unroll 2
            for (int v = 0; v < NB; v++) acc[r][v] = _mm256_fmadd_ps(b, kv[v], acc[r][v]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++)
#pragma GCC unroll 2
        for (int v = 0; v < NB; v++)
            if (r < nr) _mm256_store_ps(S + (size_t)r * lds + 8 * v, acc[r][v]);
}

// S (T rows of TP) = x k^T for one head, unscaled: x's rows at stride ldx, k transposed in kt
// (hd, TP) and as rows kr at stride ldk. The last T - 8 NM keys (1 or 2: T 65 is 64 + the class
// token) are dot products with their rows of kr, where a vector of mostly padding for every d
// would cost a ninth of the scores' work at T 65.
static void score_rows(const head_dims *s, const float *x, int ldx, const float *kt, const float *kr, int ldk,
                       float *S) {
    const int T = s->T, NM = T > 8 && T % 8 <= 2 && T % 8 ? T / 8 : s->NV;
    for (int i0 = 0; i0 < T; i0 += 6) {
        const int nr = T - i0 < 6 ? T - i0 : 6;
        const float *xr[6];
        for (int r = 0; r < 6; r++) xr[r] = x + (size_t)(i0 + (r < nr ? r : nr - 1)) * ldx;
        float *Si = S + (size_t)i0 * s->TP;
        int v = 0;
        for (; v + 2 <= NM; v += 2) score_blk(2, xr, nr, s->hd, kt + 8 * v, s->TP, Si + 8 * v, s->TP);
        if (v < NM) score_blk(1, xr, nr, s->hd, kt + 8 * v, s->TP, Si + 8 * v, s->TP);
        for (int r = 0; r < nr; r++)
            for (int j = 8 * NM; j < T; j++) Si[(size_t)r * s->TP + j] = dotv(xr[r], kr + (size_t)j * ldk, s->hd);
    }
}

// One row of scores (TP floats, in place) to probabilities in arow (T floats): scale, mask the
// keys from nk on, softmax. Masked keys take e^0, then 0: e^-inf would come out of exp8's clamp
// as e^-104, a subnormal, and on a Zen 3 exp8 took 9.7 ns a vector with subnormal results
// against 4.3 (7 of T 65's 72 lanes are padding). A row that sees no key (valid length 0) is
// all zeros, as in the reference.
static void softmax_row(float *srow, float *arow, const head_dims *s, int nk) {
    const __m256 scale = _mm256_set1_ps(s->scale), ninf = _mm256_set1_ps(-INFINITY);
    __m256 mx = ninf, sum = _mm256_setzero_ps();
    for (int v = 0; v < s->NV; v++) {
        const __m256 x = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_load_ps(srow + 8 * v), scale),
                                          _mm256_castsi256_ps(lanes(nk - 8 * v)));
        _mm256_store_ps(srow + 8 * v, x);
        mx = _mm256_max_ps(mx, x);
    }
    const __m256 m = _mm256_set1_ps(hmax(mx));
    for (int v = 0; v < s->NV; v++) {
        const __m256 keep = _mm256_castsi256_ps(lanes(nk - 8 * v));
        const __m256 x = _mm256_and_ps(_mm256_sub_ps(_mm256_load_ps(srow + 8 * v), m), keep);
        const __m256 e = _mm256_and_ps(exp8(x), keep);
        _mm256_store_ps(srow + 8 * v, e);
        sum = _mm256_add_ps(sum, e);
    }
    const __m256 inv = _mm256_set1_ps(nk > 0 ? 1 / hsum(sum) : 0);
    for (int v = 0; v < s->NV; v++) {
        const __m256 y = _mm256_mul_ps(_mm256_load_ps(srow + 8 * v), inv);
        if (8 * v + 8 <= s->T) _mm256_storeu_ps(arow + 8 * v, y);
        else _mm256_maskstore_ps(arow + 8 * v, lanes(s->T - 8 * v), y);
    }
}

// The forward's probabilities p (T floats) and dp (TP floats, in place) to ds = p (dp -
// rowsum(p dp)) scale.
static void ds_row(float *drow, const float *prow, const head_dims *s) {
    __m256 dot = _mm256_setzero_ps();
    for (int v = 0; v < s->NV; v++) {
        const __m256 p = _mm256_maskload_ps(prow + 8 * v, lanes(s->T - 8 * v));
        dot = _mm256_fmadd_ps(p, _mm256_load_ps(drow + 8 * v), dot);
    }
    const __m256 dt = _mm256_set1_ps(hsum(dot)), scale = _mm256_set1_ps(s->scale);
    for (int v = 0; v < s->NV; v++) {
        const __m256 p = _mm256_maskload_ps(prow + 8 * v, lanes(s->T - 8 * v));
        _mm256_store_ps(drow + 8 * v, _mm256_mul_ps(_mm256_mul_ps(p, _mm256_sub_ps(_mm256_load_ps(drow + 8 * v), dt)), scale));
    }
}

// Head (b, h)'s successor's first row in qkv (or dout, with ld D), or NULL after the last: the
// next iteration of the (sequence, head) loop's static schedule on this thread, unless this one
// ends the thread's share.
static const float *next_head(const float *x, const attn_segment *seg, int b, int h, int H, int hd, int ld) {
    if (h + 1 == H && b + 1 == seg->nseq) return NULL;
    if (h + 1 == H) b++, h = 0;
    else h++;
    return x + (seg->tok_off + (size_t)b * seg->seqlen) * ld + (size_t)h * hd;
}

// Into L2, hd floats at each of n places gap floats apart (a row's q, k and v): while one head's
// softmax runs, the next head's rows, which the strided reads of its transpose and copies would
// otherwise wait for one line at a time (qkv, 12.8 MB at bench-s, is out of L2).
static inline void prefetch_rows(const float *x, int hd, int gap, int n) {
    for (int c = 0; c < n; c++)
        for (int d = 0; d < hd; d += 16) _mm_prefetch((const char *)(x + (size_t)c * gap + d), _MM_HINT_T1);
}

// T rows of hd floats at stride ld into c as chunks of 16 columns: chunk u, at c + 16 u T, holds
// T rows of columns 16u .. 16u + 16 (zeros past hd), 16 T floats, so a broadcast tile's sweep
// over T rows of one chunk reads one contiguous stream. Read in place, at qkv's stride (3 KB, or
// 1 KB for dout), a chunk's rows fell into 4 of L1's 64 sets, which hold 32 lines, so every sweep
// of a head's 65 rows missed L1: in `perf`, the instruction after that load took 30% of the
// broadcast tiles' samples.
static void rows_pack(float *c, const float *x, int T, int hd, int ld) {
    for (int c0 = 0; c0 < hd; c0 += 16) {
        const __m256i m0 = lanes(hd - c0), m1 = lanes(hd - c0 - 8);
        float *cc = c + (size_t)c0 * T;
        for (int j = 0; j < T; j++) {
            const float *xr = x + (size_t)j * ld + c0;
            _mm256_store_ps(cc + 16 * j, _mm256_maskload_ps(xr, m0));
            _mm256_store_ps(cc + 16 * j + 8, _mm256_maskload_ps(xr + 8, m1));
        }
    }
}

// The packed rows' floats for T rows of hd: what the stack tile must hold.
static inline size_t packed_size(int T, int hd) { return (size_t)(hd + 15) / 16 * 16 * T; }

AI void bcast_chunk(const int full, float *c, int ldc, const float *const ar[6], int acs, int nr, int k0,
                    int k1, const float *b, int nc) {
    __m256 acc[6][2];
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int k = k0; k < k1; k++) {
        __m256 bv[2];
#pragma GCC unroll 2
        for (int u = 0; u < 2; u++) {
            bv[u] = _mm256_load_ps(b + 16 * k + 8 * u);
            __asm__("" : "+x"(bv[u])); // in a register, as score_blk's keys
        }
#pragma GCC unroll 6
        for (int r = 0; r < 6; r++) {
            const __m256 bc = _mm256_broadcast_ss(ar[r] + (size_t)k * acs);
            acc[r][0] = _mm256_fmadd_ps(bc, bv[0], acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(bc, bv[1], acc[r][1]);
        }
    }
    const __m256i m[2] = {lanes(nc), lanes(nc - 8)};
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++) // a constant bound keeps acc's indices constant
#pragma GCC unroll 2
        for (int u = 0; u < 2; u++) {
            if (r < nr && full) _mm256_storeu_ps(c + (size_t)r * ldc + 8 * u, acc[r][u]);
            else if (r < nr) _mm256_maskstore_ps(c + (size_t)r * ldc + 8 * u, m[u], acc[r][u]);
        }
}

// c (nr <= 6 rows at ldc, hd columns) = sum over k in [k0, k1) of a[r ars + k acs] b[k][..],
// b packed by rows_pack (T rows): p v and ds k with (ars, acs) = (lda, 1), p^T dout and ds^T q
// with (1, lda). The rest of a's rows past nr repeat its last and are not stored; a partial
// last chunk of hd is stored masked.
static void bcast_tile(float *c, int ldc, const float *a, int ars, int acs, int nr, int k0, int k1,
                       const float *b, int T, int hd) {
    const float *ar[6];
    for (int r = 0; r < 6; r++) ar[r] = a + (size_t)(r < nr ? r : nr - 1) * ars;
    for (int c0 = 0; c0 < hd; c0 += 16) {
        if (c0 + 16 <= hd) bcast_chunk(1, c + c0, ldc, ar, acs, nr, k0, k1, b + (size_t)c0 * T, 16);
        else bcast_chunk(0, c + c0, ldc, ar, acs, nr, k0, k1, b + (size_t)c0 * T, hd - c0);
    }
}

int attn_fused_forward(float *out, float *att, const float *qkv, const attn_segment *seg, int D,
                       int H) {
    head_dims s0;
    if (!fused_dims(&s0, seg, D, H) || packed_size(s0.T, s0.hd) > ATT_TILE) return 0;
    const int T = s0.T, hd = s0.hd, ld = 3 * D;
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < seg->nseq; b++) {
        for (int h = 0; h < H; h++) {
            head_dims s;
            const size_t t0 = head_of(&s, &s0, seg, b);
            const float *q = qkv + t0 * ld + h * hd;
            float *a = att + (((size_t)b * H + h) * T) * T, *o = out + t0 * D + h * hd;
            _Alignas(32) float kt[ATT_TILE], S[ATTN_FUSED_TMAX * ATTN_FUSED_TMAX];
            transpose_pad(kt, q + D, T, s.TP, hd, ld);
            score_rows(&s, q, ld, kt, q + D, ld, S);
            const float *nq = next_head(qkv, seg, b, h, H, hd, ld);
            for (int i = 0; i < T; i++) {
                softmax_row(S + (size_t)i * s.TP, a + (size_t)i * T, &s, key_limit(i, s.len, s.causal, s.prefix));
                if (nq) prefetch_rows(nq + (size_t)i * ld, hd, D, 3);
            }
            float *vc = kt; // kt's work is done
            rows_pack(vc, q + 2 * D, T, hd, ld);
            tile_rows(o, D, a, T, 1, 0, &s, vc, T); // out = p v
        }
    }
    return 1;
}

int attn_fused_backward(float *dqkv, float *datt, const float *dout, const float *qkv,
                        const float *att, const attn_segment *seg, int D, int H) {
    (void)datt; // ds stays on the stack (below)
    head_dims s0;
    if (!fused_dims(&s0, seg, D, H) || packed_size(s0.T, s0.hd) > ATT_TILE) return 0;
    const int T = s0.T, hd = s0.hd, ld = 3 * D, TP = s0.TP;
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < seg->nseq; b++) {
        for (int h = 0; h < H; h++) {
            head_dims s;
            const size_t t0 = head_of(&s, &s0, seg, b);
            const float *q = qkv + t0 * ld + h * hd, *g = dout + t0 * D + h * hd;
            const float *a = att + (((size_t)b * H + h) * T) * T;
            float *dq = dqkv + t0 * ld + h * hd;
            // one tile for v^T, then for each product's contiguous copy of its rows in turn
            _Alignas(32) float t[ATT_TILE], ds[ATTN_FUSED_TMAX * ATTN_FUSED_TMAX];
            transpose_pad(t, q + 2 * D, T, TP, hd, ld);
            score_rows(&s, g, D, t, q + 2 * D, ld, ds); // dp = dout v^T
            const float *nq = next_head(qkv, seg, b, h, H, hd, ld), *ng = next_head(dout, seg, b, h, H, hd, D);
            for (int i = 0; i < T; i++) {
                ds_row(ds + (size_t)i * TP, a + (size_t)i * T, &s);
                if (nq) { // and the next head's probabilities (its rows of att follow this head's)
                    prefetch_rows(nq + (size_t)i * ld, hd, D, 3), prefetch_rows(ng + (size_t)i * D, hd, 0, 1);
                    prefetch_rows(a + (size_t)(T + i) * T, T, 0, 1);
                }
            }
            rows_pack(t, g, T, hd, D);
            tile_rows(dq + 2 * D, ld, a, 1, T, 1, &s, t, T); // dv = p^T dout
            rows_pack(t, q, T, hd, ld);
            tile_rows(dq + D, ld, ds, 1, TP, 1, &s, t, T); // dk = ds^T q
            rows_pack(t, q + D, T, hd, ld);
            tile_rows(dq, ld, ds, TP, 1, 0, &s, t, T); // dq = ds k
        }
    }
    return 1;
}
#endif

#else
// Without AVX2 and FMA (NATIVE=0 builds, other CPUs) ops.c's reference loops run.
int attn_fused_forward(float *out, float *att, const float *qkv, const attn_segment *seg, int D,
                       int H) {
    return 0;
}
int attn_fused_backward(float *dqkv, float *datt, const float *dout, const float *qkv,
                        const float *att, const attn_segment *seg, int D, int H) {
    return 0;
}
#endif
