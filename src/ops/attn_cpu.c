// attn_cpu.c: multi-head attention in float as one fused AVX-512 kernel per (sequence, head):
// scores, mask, softmax and normalisation in registers, then the products with V (forward) or
// dout, q, k (backward) as broadcast tiles, in place of 2 + 4 sgemm calls a head with softmax
// passes and transposes between them (bench/bench_attention.c times both). Same maths as ops.c's
// reference loops (Vaswani et al. 2017, eq. 1; masks: ops.h's attn_segment). Covered by
// tests/test_attn_cpu.c and ops.c's tests.
#include "ops/attn_cpu.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#include <math.h>
#include <stddef.h>

#define AI static inline __attribute__((always_inline))
// Floats of the transposed K (forward) or V (backward) tile kept on the stack: 64 KB, the budget
// ops.c's reference path already uses for its copy.
#define ATT_TILE 16384

typedef struct {
    int T, TP, NV, hd, len, causal, prefix; // TP = 16 NV: T rounded up to whole vectors
    float scale;
} head_dims;

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
#pragma GCC unroll 6
            for (int v = 0; v < NT; v++) {
                acc[r][v] = _mm512_maskz_mov_ps(lanes(nk - 16 * v), exp16(_mm512_sub_ps(acc[r][v], m)));
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

// The first query that may see key j: past the prefix a causal key is seen from itself on.
static inline int first_query(const head_dims *s, int j) {
    return s->causal && j >= s->prefix ? j : 0;
}

static int fused_dims(head_dims *s, const attn_segment *seg, int D, int H) {
    const int T = seg->seqlen, hd = D / H, NV = (T + 15) / 16;
    *s = (head_dims){.T = T, .TP = 16 * NV, .NV = NV, .hd = hd, .causal = seg->causal,
                     .prefix = seg->prefix, .scale = (float)(1.0 / sqrt((double)hd))};
    return T >= 1 && T <= ATTN_FUSED_TMAX && (size_t)hd * 16 * NV <= ATT_TILE;
}

// Sequence b's dims (s0 with its length) in *s; returns its first token's row.
static size_t head_of(head_dims *s, const head_dims *s0, const attn_segment *seg, int b) {
    *s = *s0;
    s->len = seg->lens ? seg->lens[b] : s0->T;
    return seg->tok_off + (size_t)b * s0->T;
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
            for (int i0 = 0; i0 < T; i0 += 6) { // rows past key_limit hold zeros: stop at the last row's
                const int nr = T - i0 < 6 ? T - i0 : 6;
                bcast_tile(o + (size_t)i0 * D, D, a + (size_t)i0 * T, T, 1, nr, 0,
                           key_limit(i0 + nr - 1, s.len, s.causal, s.prefix), q + 2 * D, ld, hd);
            }
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
            for (int j0 = 0; j0 < T; j0 += 6) {
                const int nr = T - j0 < 6 ? T - j0 : 6;
                bcast_tile(dq + 2 * D + (size_t)j0 * ld, ld, a + j0, 1, T, nr, first_query(&s, j0), T, g, D, hd);
            }
            for (int j0 = 0; j0 < T; j0 += 6) {
                const int nr = T - j0 < 6 ? T - j0 : 6;
                bcast_tile(dq + D + (size_t)j0 * ld, ld, ds + j0, 1, T, nr, first_query(&s, j0), T, q, ld, hd);
            }
            for (int i0 = 0; i0 < T; i0 += 6) { // dq = ds k
                const int nr = T - i0 < 6 ? T - i0 : 6;
                bcast_tile(dq + (size_t)i0 * ld, ld, ds + (size_t)i0 * T, T, 1, nr, 0,
                           key_limit(i0 + nr - 1, s.len, s.causal, s.prefix), q + D, ld, hd);
            }
        }
    }
    return 1;
}

#else
// Without AVX-512 (the x86-64-v3 builds of CI's GPU jobs, other CPUs) ops.c's reference loops run.
int attn_fused_forward(float *out, float *att, const float *qkv, const attn_segment *seg, int D,
                       int H) {
    return 0;
}
int attn_fused_backward(float *dqkv, float *datt, const float *dout, const float *qkv,
                        const float *att, const attn_segment *seg, int D, int H) {
    return 0;
}
#endif
