// gemm_int8.c: int8 products for `--precision int8` on the CPU (src/ops/gemm_int8.h).
// Symmetric s8 on both sides. With VNNI, oneDNN's brgemm takes u8 x s8 and adds the +128
// shift's compensation itself (a u8 activation with a zero point per row is something oneDNN
// 2.6's matmul cannot take: its zero points are one per tensor); the weights go into its
// blocked layout once (with the compensation, which the reorder computes), and one primitive,
// kept per shape, serves every expert. Without VNNI, on AVX2, our own kernel (block_u8) shifts
// and compensates, with 7-bit weights packed once into its panels. Either way a product runs
// fixed blocks of rows, each on one thread (int32 sums), its rows quantized right before and
// the weights' and rows' scales, the bias (and for an MLP the activation and the next product)
// right after, while the block is in cache. Covered by tests/test_int8.c.
#include <dnnl.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "ops/gemm_int8.h"
#include "ops/ops.h"

int gemm_int8_native(void) {
    // oneDNN's ISA values are feature masks: AMX's include avx512_core_vnni's bits, every
    // AVX-512 level avx2's
    const unsigned isa = (unsigned)dnnl_get_effective_cpu_isa();
    const unsigned v512 = (unsigned)dnnl_cpu_isa_avx512_core_vnni, v256 = (unsigned)dnnl_cpu_isa_avx2_vnni;
    const unsigned avx2 = (unsigned)dnnl_cpu_isa_avx2;
    if ((isa & v512) == v512 || (isa & v256) == v256) return INT8_VNNI;
    return (isa & avx2) == avx2 ? INT8_AVX2 : 0;
}

int int8_weight_max(void) {
    return gemm_int8_native() == INT8_AVX2 ? 63 : 127;
}

// The largest |r[k]| over K floats into *amax and whether every one is at most 3.4e38 (not
// NaN, not infinite) into *finite, 8 lanes at a time: the floats done (K rounded down to 8).
// max and & do not depend on the order, so the scalar rest finishes the same reduction.
__attribute__((target("avx2"))) static int amax_avx2(const float *r, int K, float *amax, int *finite) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), lim = _mm256_set1_ps(3.4e38f);
    __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(r + k), absm);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, lim, _CMP_NLE_UQ)); // not a <= lim: NaN too
        m = _mm256_max_ps(m, a);
    }
    float v[8];
    _mm256_storeu_ps(v, m);
    for (int i = 0; i < 8; i++) *amax = v[i] > *amax ? v[i] : *amax;
    *finite = _mm256_movemask_ps(bad) == 0;
    return k;
}

// 8 floats' (int)(clamp(r inv, +-fq) +- 0.5): min and max are the clamp for non-NaN values,
// and the rounding adds 0.5 with v's sign (-0 gives 0 either way) and truncates, as the
// scalar form's cast does
__attribute__((target("avx2"), always_inline)) static inline __m256i quant8(const float *r, __m256 inv, __m256 lo,
                                                                            __m256 hi) {
    const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(r), inv), lo), hi);
    const __m256 h = _mm256_or_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(0.5f));
    return _mm256_cvttps_epi32(_mm256_add_ps(v, h));
}

// q[k] = the scalar form's (int8_t)(int)(clamp(r[k] inv, +-fq) +- 0.5) for K rounded down to
// 32 (the count returned)
__attribute__((target("avx2"))) static int quant_avx2(int8_t *q, const float *r, int K, float inv, float fq) {
    const __m256 vi = _mm256_set1_ps(inv), hi = _mm256_set1_ps(fq), lo = _mm256_set1_ps(-fq);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); // packs interleave 128-bit lanes
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        const __m256i n0 = quant8(r + k, vi, lo, hi), n1 = quant8(r + k + 8, vi, lo, hi);
        const __m256i n2 = quant8(r + k + 16, vi, lo, hi), n3 = quant8(r + k + 24, vi, lo, hi);
        const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(n0, n1), _mm256_packs_epi32(n2, n3));
        _mm256_storeu_si256((__m256i *)(q + k), _mm256_permutevar8x32_epi32(w, order));
    }
    return k;
}

// One row of K floats into q (s8 within [-qmax, qmax]) and its scale amax / qmax; a row of
// zeros gets scale 0 (and q 0), one with a NaN or an infinity scale NaN (and q 0). avx2: the
// CPU has AVX2 (the same values either way).
static void quantize_row(int8_t *q, float *scale, const float *r, int K, int qmax, int avx2) {
    float amax = 0;
    int finite = 1, k0 = avx2 ? amax_avx2(r, K, &amax, &finite) : 0;
    for (int k = k0; k < K; k++) {
        const float a = fabsf(r[k]);
        finite &= a <= 3.4e38f; // false for NaN too
        amax = a > amax ? a : amax;
    }
    if (!finite || amax == 0) {
        memset(q, 0, (size_t)K);
        *scale = finite ? 0.0f : NAN;
        return;
    }
    const float inv = (float)qmax / amax, fq = (float)qmax;
    *scale = amax / (float)qmax;
    if (!(inv <= 3.4e38f)) { // amax under qmax / FLT_MAX (subnormal): inv overflows, r / amax does not
        for (int k = 0; k < K; k++) {
            const float v = r[k] / amax * fq;
            q[k] = (int8_t)(int)(v + (v >= 0 ? 0.5f : -0.5f));
        }
        return;
    }
    // clamped before rounding (v is within [-qmax, qmax] up to one rounding), so the
    // conversion's lanes narrow with no integer compare: the rest vectorizes too
    k0 = avx2 ? quant_avx2(q, r, K, inv, fq) : 0;
#pragma omp simd
    for (int k = k0; k < K; k++) {
        float v = r[k] * inv;
        v = v > fq ? fq : v < -fq ? -fq : v;
        q[k] = (int8_t)(int)(v + (v >= 0 ? 0.5f : -0.5f));
    }
}

// int8_quantize_rows with the range [-qmax, qmax] (the weights': int8_weight_max).
static void quantize(int8_t *q, float *scale, const float *x, int rows, int K, int ld, int qmax) {
    if (K <= 0) return;
    const int avx2 = __builtin_cpu_supports("avx2");
#pragma omp parallel for schedule(static) if ((size_t)rows * K >= 65536)
    for (int i = 0; i < rows; i++) quantize_row(q + (size_t)i * K, scale + i, x + (size_t)i * ld, K, qmax, avx2);
}

void int8_quantize_rows(int8_t *q, float *scale, const float *x, int rows, int K, int ld) {
    quantize(q, scale, x, rows, K, ld, 127);
}

// One engine for the process (stateless, safe to share), made by whichever thread asks first.
static dnnl_engine_t the_engine;
static pthread_once_t eng_once = PTHREAD_ONCE_INIT;
static void make_engine(void) {
    if (dnnl_engine_create(&the_engine, dnnl_cpu, 0) != dnnl_success) the_engine = NULL;
}
static dnnl_engine_t engine(void) {
    pthread_once(&eng_once, make_engine);
    return the_engine;
}

// A stream per thread, kept (a stream per block costs more than a small block's product).
static dnnl_stream_t stream(void) {
    static _Thread_local dnnl_stream_t s;
    if (!s && engine() && dnnl_stream_create(&s, engine(), dnnl_stream_default_flags) != dnnl_success) s = NULL;
    return s;
}

// Rows per block: brgemm's int8 kernels run near their rate from some 64 rows at these widths,
// and a block's hidden rows (BS x M fp32 and int8) stay in L2. Results do not depend on it.
enum { BS = 128 };

// The matmul (m,K)x(K,N) -> f32 (m,N) dense (the exact int32 sums), B in layout *wmd (format any when NULL: pd_out then gets the descriptor), the scratchpad the
// caller's (threads run the same primitive at once). Made for one thread, as every block runs.
static int make_matmul(dnnl_primitive_t *prim, dnnl_primitive_desc_t *pd_out, int m, int N, int K,
                       const dnnl_memory_desc_t *wmd) {
    dnnl_memory_desc_t md_a, md_b, md_c;
    const dnnl_dims_t da = {m, K}, sa = {K, 1}, db = {K, N}, dc = {m, N}, sc = {N, 1};
    dnnl_matmul_desc_t desc;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_primitive_desc_t pd = NULL;
    int ok = dnnl_memory_desc_init_by_strides(&md_a, 2, da, dnnl_s8, sa) == dnnl_success &&
             dnnl_memory_desc_init_by_strides(&md_c, 2, dc, dnnl_f32, sc) == dnnl_success &&
             (wmd ? (md_b = *wmd, 1) : dnnl_memory_desc_init_by_tag(&md_b, 2, db, dnnl_s8, dnnl_format_tag_any) == dnnl_success) &&
             dnnl_matmul_desc_init(&desc, &md_a, &md_b, NULL, &md_c) == dnnl_success &&
             dnnl_primitive_attr_create(&attr) == dnnl_success &&
             dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user) == dnnl_success;
    const int nt = omp_get_max_threads();
    omp_set_num_threads(1);
    ok = ok && engine() && dnnl_primitive_desc_create(&pd, &desc, attr, engine(), NULL) == dnnl_success;
    if (ok && pd_out) *pd_out = pd, pd = NULL;
    else ok = ok && dnnl_primitive_create(prim, pd) == dnnl_success;
    omp_set_num_threads(nt);
    dnnl_primitive_desc_destroy(pd);
    dnnl_primitive_attr_destroy(attr);
    return ok ? 0 : -1;
}

// ---- primitives kept per (m, N, K) for the process (a block's row count m varies with the
// experts' loads: at most BS values per shape); past the table's size a block makes and frees
// its own.
typedef struct {
    int used, m, n, k;
    size_t scratch;       // the primitive's scratchpad bytes
    dnnl_primitive_t prim;
} entry;
enum { CACHE_N = 2048 };
static entry cache[CACHE_N];
static int cache_n;
static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;

static unsigned slot_of(int m, int n, int k) {
    uint64_t h = 14695981039346656037u; // FNV-1a over the key
    const int v[3] = {m, n, k};
    for (int i = 0; i < 3; i++) h = (h ^ (uint32_t)v[i]) * 1099511628211u;
    return (unsigned)((h ^ h >> 32) % CACHE_N);
}

static size_t scratch_bytes(dnnl_primitive_t prim) {
    const_dnnl_primitive_desc_t pd = NULL;
    if (dnnl_primitive_get_primitive_desc(prim, &pd) != dnnl_success) return 0;
    const dnnl_memory_desc_t *md = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    return md ? dnnl_memory_desc_get_size(md) : 0;
}

// The block primitive of t's layout for m rows (*owned: made for this block only).
static int block_prim(const int8_tensor *t, int m, entry *out, int *owned) {
    *owned = 0;
    pthread_mutex_lock(&cache_mu);
    for (unsigned i = slot_of(m, t->O, t->K); cache[i].used; i = (i + 1) % CACHE_N)
        if (cache[i].m == m && cache[i].n == t->O && cache[i].k == t->K) {
            *out = cache[i];
            pthread_mutex_unlock(&cache_mu);
            return 0;
        }
    entry e = {.used = 1, .m = m, .n = t->O, .k = t->K};
    int st = make_matmul(&e.prim, NULL, m, t->O, t->K, t->md);
    if (!st) {
        e.scratch = scratch_bytes(e.prim);
        if (cache_n < CACHE_N / 4 * 3) {
            unsigned i = slot_of(m, t->O, t->K);
            while (cache[i].used) i = (i + 1) % CACHE_N;
            cache[i] = e, cache_n++;
        } else {
            *owned = 1;
        }
        *out = e;
    }
    pthread_mutex_unlock(&cache_mu);
    return st;
}

// Per-thread scratch kept between products (the kernels own no workspace; allocating per
// product would page-fault on every call). Only grows. Slots: 0 quantized rows, 1 their scales,
// 2 the fp32 block, 3 the hidden block quantized, 4 its scales, 5 the second fp32 block, 6
// oneDNN's scratchpad, 7 block_u8's u8 rows, 8 and 9 a 1-row block's two rows in and out.
// What a slot held is not kept when it grows. Each starts on a cache line, as gemm_bf16.c's do
// (a tile row across two lines halves the AMX kernels' speed).
static void *scratch(size_t bytes, int slot) {
    static _Thread_local void *buf[10];
    static _Thread_local size_t cap[10];
    return vlmoe_scratch_grow(&buf[slot], &cap[slot], bytes);
}

// The same block without oneDNN (a refused primitive): the same int32 sums, so the same values.
static void matmul_ref(int M, int N, int K, const int8_t *A, const int8_t *B, float *C) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            int32_t s = 0;
            for (int k = 0; k < K; k++) s += (int32_t)A[(size_t)i * K + k] * B[(size_t)j * K + k];
            C[(size_t)i * N + j] = (float)s;
        }
}

// Without VNNI (INT8_AVX2): our own kernel. vpmaddubsw multiplies u8 by s8 and adds pairs into
// 16-bit sums (saturating), vpmaddwd by ones widens those pairs into 32-bit sums of four. With
// the activations shifted to u8 (a + 128 <= 255) and the weights within [-63, 63]
// (int8_weight_max), a pair reaches 2 * 255 * 63 = 32130 < 32767, so the int32 sums are exact;
// the shift comes back off as 128 times each weight row's sum, kept with the weights. The
// weights are packed once into panels of I8_NR rows, four k at a time: panel p, quad j holds
// bytes w[16p + n][4j + i] at 64 j + 4 n + i (zeros past O and K), so one 32-byte load is four
// k of eight outputs. 4 x 16 tiles hold 8 accumulators; a panel (16 KB at K 1024) stays in L1
// while the block's rows pass over it. On a Zen 3 core (best of 40, 128-row blocks, int32
// products alone) oneDNN 2.6's AVX2 u8 x s8 gemm ran K 256 -> 1024 at 142-153 GOP/s and
// K 1024 -> 256 at 117-119, this kernel at 146-149 and 133-138; the step's register-only rate
// there is 177-183 (bench/bench_int8). Its gain is mostly the epilogue it does as it stores.
enum { I8_NR = 16, I8_MR = 4 };

static size_t panels_bytes(int K, int O) { return (size_t)((O + I8_NR - 1) / I8_NR) * (size_t)((K + 3) / 4) * 64; }

static void pack_panels(int8_t *p, const int8_t *q, int O, int K) {
    const int K4 = (K + 3) / 4;
    memset(p, 0, panels_bytes(K, O));
    for (int o = 0; o < O; o++)
        for (int k = 0; k < K; k++)
            p[((size_t)(o / I8_NR) * K4 + k / 4) * 64 + (o % I8_NR) * 4 + k % 4] = q[(size_t)o * K + k];
}

// acc + vpmaddwd(vpmaddubsw(a, b), 1): four u8 x s8 products of each of 8 outputs added in
#define I8_MAC(acc, a, b) acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones))

// Rows r of out (mr <= 4, 16 columns of which nc are kept, leading dimension ldo) from the
// u8 rows A (a0..a3; rows past mr repeat a0) against panel P of K4 quads: the epilogue's
// xs[r] (ws[n] (sum - 128 wsum[n])) + b[n], added to out when beta. ws, wsum, b: 16 values.
__attribute__((target("avx2"))) static void tile_u8(float *out, int ldo, int mr, int nc, const uint8_t *a0,
                                                    const uint8_t *a1, const uint8_t *a2, const uint8_t *a3,
                                                    const int8_t *P, int K4, const int32_t *wsum, const float *ws,
                                                    const float *b, const float *xs, int beta) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
    for (int j = 0; j < K4; j++) {
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)(P + 64 * (size_t)j));
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(P + 64 * (size_t)j + 32));
        int32_t v0, v1, v2, v3; // four k of each row, to every lane
        memcpy(&v0, a0 + 4 * (size_t)j, 4), memcpy(&v1, a1 + 4 * (size_t)j, 4);
        memcpy(&v2, a2 + 4 * (size_t)j, 4), memcpy(&v3, a3 + 4 * (size_t)j, 4);
        const __m256i r0 = _mm256_set1_epi32(v0), r1 = _mm256_set1_epi32(v1);
        const __m256i r2 = _mm256_set1_epi32(v2), r3 = _mm256_set1_epi32(v3);
        I8_MAC(c00, r0, b0), I8_MAC(c01, r0, b1), I8_MAC(c10, r1, b0), I8_MAC(c11, r1, b1);
        I8_MAC(c20, r2, b0), I8_MAC(c21, r2, b1), I8_MAC(c30, r3, b0), I8_MAC(c31, r3, b1);
    }
    const __m256i acc[I8_MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
    __m256i sh[2];
    __m256 w[2], bias[2];
    for (int h = 0; h < 2; h++) {
        sh[h] = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(wsum + 8 * h)), 7);
        w[h] = _mm256_loadu_ps(ws + 8 * h), bias[h] = _mm256_loadu_ps(b + 8 * h);
    }
    for (int r = 0; r < mr; r++) {
        float v[I8_NR], *o = out + (size_t)r * ldo, *d = nc == I8_NR ? o : v; // a narrow panel's tile goes by v
        const __m256 s = _mm256_set1_ps(xs[r]);
        for (int h = 0; h < 2; h++) { // the epilogue's operations, in its order
            const __m256 c = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][h], sh[h]));
            __m256 y = _mm256_add_ps(_mm256_mul_ps(s, _mm256_mul_ps(c, w[h])), bias[h]);
            if (beta && d == o) y = _mm256_add_ps(_mm256_loadu_ps(o + 8 * h), y);
            _mm256_storeu_ps(d + 8 * h, y);
        }
        for (int n = 0; d == v && n < nc; n++) o[n] = beta ? o[n] + v[n] : v[n];
    }
}

// out (m, O), leading dimension O: xs[i] (ws[n] (A . w^T)[i][n]) + b[n] (added to out when
// beta), w the matrix c of t and A the block's s8 rows (m, K), by tile_u8. 0, or -1 when its
// scratch cannot be had.
static int block_u8(const int8_tensor *t, size_t c, int m, const int8_t *A, const float *xs, const float *b,
                    float *out, int beta) {
    const int K = t->K, O = t->O, K4 = (K + 3) / 4, lda = 4 * K4;
    uint8_t *au = scratch((size_t)m * lda, 7);
    if (!au) return -1;
    for (int i = 0; i < m; i++) { // a + 128, each row padded to whole quads (the panels' zeros meet the pad)
        uint8_t *r = au + (size_t)i * lda;
        const int8_t *a = A + (size_t)i * K;
#pragma omp simd
        for (int k = 0; k < K; k++) r[k] = (uint8_t)((uint8_t)a[k] ^ 0x80u);
        for (int k = K; k < lda; k++) r[k] = 0;
    }
    static const float zero[I8_NR];
    const int8_t *P = (const int8_t *)t->packed + c * t->pbytes;
    int32_t tsum[I8_NR]; // the last, narrow panel's 16 values, zeros past O (filled only for it)
    float tws[I8_NR], tb[I8_NR];
    for (int n0 = 0; n0 < O; n0 += I8_NR) {
        const int nc = O - n0 < I8_NR ? O - n0 : I8_NR;
        const int32_t *psum = t->wsum + c * (size_t)O + n0;
        const float *pws = t->scale + c * (size_t)O + n0, *pb = b ? b + n0 : zero;
        if (nc < I8_NR) {
            memset(tsum, 0, sizeof tsum), memset(tws, 0, sizeof tws), memset(tb, 0, sizeof tb);
            memcpy(tsum, psum, sizeof(int32_t) * (size_t)nc), memcpy(tws, pws, sizeof(float) * (size_t)nc);
            memcpy(tb, pb, sizeof(float) * (size_t)nc);
            psum = tsum, pws = tws, pb = tb;
        }
        for (int i = 0; i < m; i += I8_MR) {
            const int mr = m - i < I8_MR ? m - i : I8_MR;
            const uint8_t *a0 = au + (size_t)i * lda, *a1 = mr > 1 ? a0 + lda : a0;
            const uint8_t *a2 = mr > 2 ? a0 + 2 * (size_t)lda : a0, *a3 = mr > 3 ? a0 + 3 * (size_t)lda : a0;
            tile_u8(out + (size_t)i * O + n0, O, mr, nc, a0, a1, a2, a3, P + (size_t)(n0 / I8_NR) * K4 * 64, K4, psum,
                    pws, pb, xs + i, beta);
        }
    }
    return 0;
}

// C (m, O) = A (m,K) . (matrix c of t)^T, the exact int32 sums as floats, on this thread. The
// weights' scales come after, in the epilogue: oneDNN 2.6 takes run-time output scales only
// in its gemm:jit int8 kernel, which ran these shapes at a fifth of brgemm's rate.
static void block_matmul(const int8_tensor *t, size_t c, int m, const int8_t *A, float *C) {
    if (m == 1 && t->packed && t->md) {
        // oneDNN 2.6 runs a 1-row product with B in AMX's layout on its reference kernel
        // (ref_int8: 6 ms for 1 x 256 x 1024, an expert given one token), so the row goes in as
        // two, a copy the second: exact int32 sums, the same values (without packed weights
        // matmul_ref below takes the one row as it is)
        int8_t *a2 = scratch(2 * (size_t)t->K, 8);
        float *c2 = scratch(sizeof(float) * 2 * (size_t)t->O, 9);
        if (a2 && c2) {
            memcpy(a2, A, (size_t)t->K), memcpy(a2 + t->K, A, (size_t)t->K);
            block_matmul(t, c, 2, a2, c2);
            memcpy(C, c2, sizeof(float) * (size_t)t->O);
            return;
        }
    }
    const int8_t *q = t->q + c * (size_t)t->O * t->K;
    entry e = {0};
    int owned = 0, ok = t->packed && t->md && block_prim(t, m, &e, &owned) == 0;
    dnnl_memory_desc_t md_a, md_c, md_p;
    const dnnl_dims_t da = {m, t->K}, sa = {t->K, 1}, dc = {m, t->O}, sc = {t->O, 1};
    dnnl_memory_t ma = NULL, mb = NULL, mc = NULL, mp = NULL;
    void *pad = ok && e.scratch ? scratch(e.scratch, 6) : NULL;
    const dnnl_dims_t dp = {(dnnl_dim_t)(ok ? e.scratch : 0)};
    ok = ok && (!e.scratch || pad) && stream() &&
         dnnl_memory_desc_init_by_strides(&md_a, 2, da, dnnl_s8, sa) == dnnl_success &&
         dnnl_memory_desc_init_by_strides(&md_c, 2, dc, dnnl_f32, sc) == dnnl_success &&
         dnnl_memory_desc_init_by_tag(&md_p, 1, dp, dnnl_u8, dnnl_a) == dnnl_success &&
         dnnl_memory_create(&ma, &md_a, engine(), (void *)A) == dnnl_success &&
         dnnl_memory_create(&mb, t->md, engine(), (char *)t->packed + c * t->pbytes) == dnnl_success &&
         dnnl_memory_create(&mc, &md_c, engine(), C) == dnnl_success &&
         (!e.scratch || dnnl_memory_create(&mp, &md_p, engine(), pad) == dnnl_success);
    if (ok) {
        const dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc},
                                         {DNNL_ARG_SCRATCHPAD, mp}};
        ok = dnnl_primitive_execute(e.prim, stream(), e.scratch ? 4 : 3, args) == dnnl_success &&
             dnnl_stream_wait(stream()) == dnnl_success;
    }
    dnnl_memory_destroy(ma), dnnl_memory_destroy(mb), dnnl_memory_destroy(mc), dnnl_memory_destroy(mp);
    if (owned) dnnl_primitive_destroy(e.prim);
    if (!ok) matmul_ref(m, t->O, t->K, A, q, C);
}

// Whether t holds an (O,K) int8 matrix starting at row.
static int holds(const int8_tensor *t, size_t row, int K, int O) {
    return t && t->kind == INT8_Q8 && t->K == K && t->O == O && row % (size_t)O == 0 && row + (size_t)O <= t->rows &&
           K <= 65536;
}

// VNNI multiplies u8 by s8: oneDNN shifts s8 inputs by 128, so a sum reaches 255 * 127 * K,
// which stays in int32 up to K = 66,000 (the widest MLP input here is a few thousand; AVX2's
// 255 * 63 * K twice that): holds() refuses wider.

// out (m,O) = xs[i] (ws[j] acc[i][j]) + b[j] (beta: added), acc the block's int32 sums as floats
static void epilogue(float *out, const float *acc, const float *xs, const float *ws, const float *b, int m, int O,
                     int beta) {
    for (int i = 0; i < m; i++) {
        float *oi = out + (size_t)i * O;
        const float *ai = acc + (size_t)i * O, s = xs[i];
        if (beta) {
#pragma omp simd
            for (int j = 0; j < O; j++) oi[j] = oi[j] + (s * (ai[j] * ws[j]) + (b ? b[j] : 0.0f));
        } else {
#pragma omp simd
            for (int j = 0; j < O; j++) oi[j] = s * (ai[j] * ws[j]) + (b ? b[j] : 0.0f);
        }
    }
}

// out (m, O) = xs[i] (ws[n] (A . w^T)[i][n]) + b[n] (added to out when beta), w the matrix c of t:
// by block_u8 on AVX2, else block_matmul into tmp (m, O; may be out) and the epilogue.
static void block_product(const int8_tensor *t, size_t c, int m, const int8_t *A, const float *xs, const float *b,
                          float *tmp, float *out, int beta) {
    if (t->wsum && t->packed && block_u8(t, c, m, A, xs, b, out, beta) == 0) return;
    block_matmul(t, c, m, A, tmp);
    epilogue(out, tmp, xs, t->scale + c * (size_t)t->O, b, m, t->O, beta);
}

int linear_forward_int8(float *out, const float *x, const int8_tensor *t, size_t row, const float *b, int N,
                        int K, int O, int beta) {
    if (N <= 0 || O <= 0) return 0;
    if (!holds(t, row, K, O)) return -1;
    const size_t c = row / (size_t)O;
    const int nb = (N + BS - 1) / BS;
    int bad = 0;
#pragma omp parallel
    {
        int8_t *xq = scratch((size_t)BS * K, 0);
        float *xs = scratch(sizeof(float) * BS, 1), *tb = scratch(sizeof(float) * (size_t)BS * O, 2);
        if (!xq || !xs || !tb) {
#pragma omp atomic write
            bad = 1;
        }
#pragma omp barrier
        if (!bad) {
            // blocks handed out as threads free up, as the experts' below: a thread slowed down
            // (a busy machine) leaves the others less to wait for (each row's values are the same
            // whoever computes it)
#pragma omp for schedule(dynamic, 1)
            for (int blk = 0; blk < nb; blk++) {
                const int r0 = blk * BS, m = N - r0 < BS ? N - r0 : BS;
                int8_quantize_rows(xq, xs, x + (size_t)r0 * K, m, K, K);
                block_product(t, c, m, xq, xs, b, tb, out + (size_t)r0 * O, beta);
            }
        }
    }
    return bad ? -1 : 0;
}

int experts_forward_int8(float *y, const float *x, const int8_expert *ex, const int32_t *off, int E, int D,
                         int M, int act, int beta) {
    // the blocks of every expert, in order: (expert, first row)
    int nb = 0;
    for (int e = 0; e < E; e++) {
        const int k = off[e + 1] - off[e];
        if (k <= 0) continue;
        if (!holds(ex[e].t1, ex[e].r1, D, M) || !holds(ex[e].t2, ex[e].r2, M, D)) return -1;
        nb += (k + BS - 1) / BS;
    }
    if (!nb) return 0;
    int32_t *task = malloc(sizeof(int32_t) * 2 * (size_t)nb);
    if (!task) return -1;
    for (int e = 0, i = 0; e < E; e++)
        for (int r = off[e]; r < off[e + 1]; r += BS) task[2 * i] = e, task[2 * i + 1] = r, i++;
    int bad = 0;
#pragma omp parallel
    {
        int8_t *xq = scratch((size_t)BS * D, 0), *aq = scratch((size_t)BS * M, 3);
        float *xs = scratch(sizeof(float) * BS, 1), *h = scratch(sizeof(float) * (size_t)BS * M, 2);
        float *as = scratch(sizeof(float) * BS, 4), *t2 = scratch(sizeof(float) * (size_t)BS * D, 5);
        if (!xq || !aq || !xs || !h || !as || !t2) {
#pragma omp atomic write
            bad = 1;
        }
#pragma omp barrier
        if (!bad) {
            // experts' loads differ: blocks handed out as threads free up (each row's values are
            // the same whoever computes it)
#pragma omp for schedule(dynamic, 1)
            for (int i = 0; i < nb; i++) {
                const int e = task[2 * i], r0 = task[2 * i + 1], m = off[e + 1] - r0 < BS ? off[e + 1] - r0 : BS;
                const int8_expert *w = &ex[e];
                int8_quantize_rows(xq, xs, x + (size_t)r0 * D, m, D, D);
                block_product(w->t1, w->r1 / (size_t)M, m, xq, xs, w->b1, h, h, 0);
                act_forward_f32(h, h, (size_t)m * M, act);
                int8_quantize_rows(aq, as, h, m, M, M);
                block_product(w->t2, w->r2 / (size_t)D, m, aq, as, w->b2, t2, y + (size_t)r0 * D, beta);
            }
        }
    }
    free(task);
    return bad ? -1 : 0;
}

// t's matrices into the layout brgemm picks for a full block (left NULL when oneDNN refuses:
// the blocks then run the reference product on q).
static void pack(int8_tensor *t) {
    dnnl_primitive_desc_t pd = NULL, rpd = NULL;
    dnnl_primitive_t reorder = NULL;
    dnnl_memory_desc_t *wmd = malloc(sizeof(*wmd)), md_s;
    const dnnl_dims_t db = {t->K, t->O}, sb = {1, t->K};
    int ok = wmd && make_matmul(NULL, &pd, BS, t->O, t->K, NULL) == 0;
    const dnnl_memory_desc_t *w = ok ? dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0) : NULL;
    ok = w != NULL;
    if (ok) *wmd = *w;
    // each matrix's packed copy on a cache line (bytes: its size in whole lines)
    const size_t n = t->rows / (size_t)t->O, bytes = ok ? vlmoe_line_bytes(dnnl_memory_desc_get_size(wmd)) : 0;
    size_t all = 0;
    char *buf = ok && bytes && !vlmoe_mul_ok(bytes, n, &all) ? vlmoe_alloc_line(all) : NULL;
    ok = buf && dnnl_memory_desc_init_by_strides(&md_s, 2, db, dnnl_s8, sb) == dnnl_success &&
         dnnl_reorder_primitive_desc_create(&rpd, &md_s, engine(), wmd, engine(), NULL) == dnnl_success &&
         dnnl_primitive_create(&reorder, rpd) == dnnl_success && stream();
    for (size_t c = 0; ok && c < n; c++) {
        dnnl_memory_t src = NULL, dst = NULL;
        ok = dnnl_memory_create(&src, &md_s, engine(), t->q + c * (size_t)t->O * t->K) == dnnl_success &&
             dnnl_memory_create(&dst, wmd, engine(), buf + c * bytes) == dnnl_success;
        const dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, src}, {DNNL_ARG_TO, dst}};
        ok = ok && dnnl_primitive_execute(reorder, stream(), 2, args) == dnnl_success &&
             dnnl_stream_wait(stream()) == dnnl_success;
        dnnl_memory_destroy(src), dnnl_memory_destroy(dst);
    }
    dnnl_primitive_destroy(reorder);
    dnnl_primitive_desc_destroy(rpd);
    dnnl_primitive_desc_destroy(pd);
    if (!ok) {
        free(buf), free(wmd);
        return;
    }
    t->packed = buf, t->pbytes = bytes, t->md = wmd;
}

int int8_weights_add(int8_weights *w, const float *src, size_t rows, int K, int O, int kind) {
    if (O <= 0 || rows % (size_t)O) return vlmoe_fail(VLMOE_ERR_ARG, "int8 weights: %zu rows are not matrices of %d", rows, O);
    if (w->count == w->cap) {
        const int cap = w->cap ? 2 * w->cap : 16;
        int8_tensor *t = realloc(w->t, sizeof(int8_tensor) * (size_t)cap);
        if (!t) return vlmoe_fail(VLMOE_ERR_NOMEM, "int8 weights: the table of %d tensors", cap);
        w->t = t, w->cap = cap;
    }
    int8_tensor *e = &w->t[w->count];
    *e = (int8_tensor){.src = src, .rows = rows, .K = K, .O = O, .kind = kind};
    if (kind == INT8_Q8) {
        e->q = malloc(rows * (size_t)K), e->scale = malloc(sizeof(float) * rows);
        if (!e->q || !e->scale) {
            free(e->q), free(e->scale);
            return vlmoe_fail(VLMOE_ERR_NOMEM, "int8 weights: %zu x %d bytes", rows, K);
        }
        quantize(e->q, e->scale, src, (int)rows, K, K, int8_weight_max());
        if (gemm_int8_native() == INT8_AVX2) { // block_u8's panels, and each row's sum for the shift
            const size_t n = rows / (size_t)O;
            e->pbytes = panels_bytes(K, O);
            // the panels on a cache line (vlmoe_alloc): the kernel's 32-byte loads would straddle
            // two lines at every other panel row from malloc's 16-byte alignment
            e->wsum = malloc(sizeof(int32_t) * rows), e->packed = vlmoe_alloc(e->pbytes * n, "int8 weight panels");
            if (!e->wsum || !e->packed) {
                free(e->q), free(e->scale), free(e->wsum), free(e->packed);
                return vlmoe_fail(VLMOE_ERR_NOMEM, "int8 weights: %zu rows' sums and panels", rows);
            }
            for (size_t i = 0; i < rows; i++) {
                int32_t sum = 0;
                for (int k = 0; k < K; k++) sum += e->q[i * (size_t)K + k];
                e->wsum[i] = sum;
            }
            for (size_t c = 0; c < n; c++)
                pack_panels((int8_t *)e->packed + c * e->pbytes, e->q + c * (size_t)O * K, O, K);
        } else if (K <= 65536) {
            pack(e);
        }
    }
    w->count++;
    return VLMOE_OK;
}

void int8_weights_free(int8_weights *w) {
    if (!w) return;
    for (int i = 0; i < w->count; i++) {
        int8_tensor *t = &w->t[i];
        free(t->q), free(t->scale), free(t->packed), free(t->md), free(t->wsum);
    }
    free(w->t);
    *w = (int8_weights){0};
}

const int8_tensor *int8_weights_find(const int8_weights *w, const float *p, size_t *row) {
    for (int i = 0; w && i < w->count; i++) {
        const int8_tensor *e = &w->t[i];
        // addresses as integers: p may lie outside every entry (another tensor)
        const uintptr_t a = (uintptr_t)p, lo = (uintptr_t)e->src, n = e->rows * (size_t)e->K;
        if (a < lo || a >= lo + n * sizeof(float)) continue;
        const size_t off = (a - lo) / sizeof(float);
        if ((a - lo) % sizeof(float) || off % (size_t)e->K) return NULL;
        *row = off / (size_t)e->K;
        return e;
    }
    return NULL;
}
