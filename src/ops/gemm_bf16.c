// gemm_bf16.c: bf16 matrix products for `--precision bf16` on the CPU (src/ops/gemm_bf16.h).
// A product is cut into fixed blocks of C's rows whose size depends only on the shape, and each
// block is one single-threaded oneDNN matmul (bf16 operands, fp32 accumulation and output, a sum
// post-op when the product accumulates), so, as in fp32, the result does not depend on the
// thread count. Each operand is converted once per product: op(A) to row-major bf16, B straight
// into the blocked bf16 layout oneDNN's brgemm kernel reads (so no block repacks it), and C's
// blocks stay dense, which that kernel needs (a strided C sends it to the slower gemm:jit).
// The primitives are kept per shape. Covered by tests/test_bf16.c.
#include <dnnl.h>
#if defined(__AVX512BW__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "ops/gemm_bf16.h"

int gemm_bf16_native(void) {
    // avx512_core_bf16's bits are a subset of AMX's (oneDNN's ISA values are feature masks)
    const unsigned isa = (unsigned)dnnl_get_effective_cpu_isa(), bf16 = (unsigned)dnnl_cpu_isa_avx512_core_bf16;
    return (isa & bf16) == bf16;
}

static inline uint16_t to_bf16(float f) { return bf16_of(f); }

void bf16_pack(uint16_t *dst, const float *src, int rows, int cols, int ld, int trans) {
    if (!trans) {
#pragma omp parallel for schedule(static) if ((size_t)rows * cols >= 65536)
        for (int i = 0; i < rows; i++) {
            const float *s = src + (size_t)i * ld;
            uint16_t *d = dst + (size_t)i * cols;
#pragma omp simd
            for (int j = 0; j < cols; j++) d[j] = to_bf16(s[j]);
        }
        return;
    }
    // dst[i][j] = src[j][i]: 32x32 tiles, so both sides are read and written in cache lines
#pragma omp parallel for schedule(static) if ((size_t)rows * cols >= 65536)
    for (int i0 = 0; i0 < rows; i0 += 32)
        for (int j0 = 0; j0 < cols; j0 += 32) {
            const int i1 = i0 + 32 < rows ? i0 + 32 : rows, j1 = j0 + 32 < cols ? j0 + 32 : cols;
            for (int i = i0; i < i1; i++)
                for (int j = j0; j < j1; j++) dst[(size_t)i * cols + j] = to_bf16(src[(size_t)j * ld + i]);
        }
}

// One engine for the process (oneDNN's CPU engine is stateless and safe to share), made once by
// whichever thread asks first (pthread_once: no symbol a named OpenMP critical would export
// from libvlmoe.so).
static dnnl_engine_t the_engine;
static pthread_once_t eng_once = PTHREAD_ONCE_INIT;
static void make_engine(void) {
    if (dnnl_engine_create(&the_engine, dnnl_cpu, 0) != dnnl_success) the_engine = NULL;
}
static dnnl_engine_t engine(void) {
    pthread_once(&eng_once, make_engine);
    return the_engine;
}

// A stream per thread, kept: creating one per block costs more than some small blocks.
static dnnl_stream_t stream(void) {
    static _Thread_local dnnl_stream_t s;
    if (!s && dnnl_stream_create(&s, engine(), dnnl_stream_default_flags) != dnnl_success) s = NULL;
    return s;
}

// The row blocks of a product: nb blocks of whole 32-row units (brgemm's row tile), the first
// `extra` of them one unit taller, then, when M is no multiple of 32, a block of the `tail` rows
// left. nb gives about 64 MFLOP (2 rows N K) a block, at most 512 rows, and is even when above
// 1, all a function of the shape only, never of the thread count. Larger blocks read B from L2
// fewer times: brgemm ran bench-s's products at 194 GFLOP/s per thread in 16 MFLOP blocks and
// 210 in 64-128 MFLOP ones (oneDNN's verbose times); the even count keeps two threads balanced
// where a few large blocks would not (an expert's 640 rows make 4 blocks of 160, not 256 + 256
// + 128). The heights are multiples of 32 from a few values, and tails: an expert's row count
// changes every step, and each new height is a primitive to make and keep (its jit code is
// memory), so a tail of its own keeps them as few as one fixed height did.
typedef struct { int nb, q, extra, tail; } row_split;
static row_split split_rows(int M, int N, int K) {
    const double r = 32.0e6 / ((double)N * K);
    const int rows = r >= 512 ? 512 : r < 32 ? 32 : (int)r, units = M / 32;
    int nb = (M + rows - 1) / rows;
    if (nb > 1) nb += nb & 1;
    if (nb > units) nb = units;
    return (row_split){.nb = nb, .q = nb ? units / nb : 0, .extra = nb ? units % nb : 0, .tail = M % 32};
}
static int blocks_of(const row_split *s) { return s->nb + (s->tail > 0); }
// block b's first row and height
static int block_start(const row_split *s, int b) { return 32 * (b * s->q + (b < s->extra ? b : s->extra)); }
static int block_height(const row_split *s, int b) { return b < s->nb ? 32 * (s->q + (b < s->extra)) : s->tail; }

// ---- primitives kept per shape: a product looks up its B layout and its three primitives once,
// under one lock, and its blocks share them (with oneDNN's own cache a descriptor and a
// primitive still cost a microsecond or two each, some 1200 products a bench-s step). The
// shapes are few (the experts' row counts vary, their remainder blocks with them: at most
// block_rows values per shape). Entries are never freed while the process runs; past the
// table's size a product makes and frees its own. An open-addressing hash table: a training
// run adds remainder shapes for a while, and a product looks up three or four entries.
enum { K_LAYOUT, K_MATMUL, K_REORDER, K_TRANSPOSE };
typedef struct {
    int used, kind, m, n, k, sum, ld, tb; // ld: C's leading dimension (matmul), B's (reorder) or A's (transpose)
    dnnl_memory_desc_t md;          // K_LAYOUT: the blocked bf16 layout of a (K,N) B
    dnnl_primitive_t prim;
} entry;
enum { CACHE_N = 4096 }; // slots, filled to 3/4 at most
static entry cache[CACHE_N];
static int cache_n;
static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;

static unsigned slot_of(int kind, int m, int n, int k, int sum, int ld, int tb) {
    const int v[7] = {kind, m, n, k, sum, ld, tb};
    uint64_t h = 14695981039346656037u; // FNV-1a over the key's ints
    for (int i = 0; i < 7; i++) h = (h ^ (uint32_t)v[i]) * 1099511628211u;
    return (unsigned)((h ^ h >> 32) % CACHE_N);
}

static entry *find(int kind, int m, int n, int k, int sum, int ld, int tb) {
    for (unsigned i = slot_of(kind, m, n, k, sum, ld, tb); cache[i].used; i = (i + 1) % CACHE_N) {
        const entry *e = &cache[i];
        if (e->kind == kind && e->m == m && e->n == n && e->k == k && e->sum == sum && e->ld == ld && e->tb == tb)
            return &cache[i];
    }
    return NULL;
}

// stores e; 0 when the table is full (the caller then owns e's primitive)
static int keep(entry e) {
    if (cache_n >= CACHE_N / 4 * 3) return 0;
    unsigned i = slot_of(e.kind, e.m, e.n, e.k, e.sum, e.ld, e.tb);
    while (cache[i].used) i = (i + 1) % CACHE_N;
    e.used = 1, cache[i] = e, cache_n++;
    return 1;
}

// the matmul primitive of a (m,K)x(K,N) block with B in layout *wmd (format any when NULL);
// with pd_out, its descriptor is returned instead of a primitive. The scratchpad is the
// caller's (per thread, at each run): a primitive keeps one of its own otherwise, and the
// threads running the same primitive's blocks at once would share it.
static int make_matmul(dnnl_primitive_t *prim, dnnl_primitive_desc_t *pd_out, int m, int N, int K, int sum,
                       int ldc, const dnnl_memory_desc_t *wmd) {
    dnnl_memory_desc_t md_a, md_b, md_c;
    const dnnl_dims_t da = {m, K}, sa = {K, 1}, db = {K, N}, dc = {m, N}, sc = {ldc, 1};
    dnnl_matmul_desc_t desc;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    dnnl_primitive_desc_t pd = NULL;
    int ok = dnnl_memory_desc_init_by_strides(&md_a, 2, da, dnnl_bf16, sa) == dnnl_success &&
             dnnl_memory_desc_init_by_strides(&md_c, 2, dc, dnnl_f32, sc) == dnnl_success &&
             (wmd ? (md_b = *wmd, 1) : dnnl_memory_desc_init_by_tag(&md_b, 2, db, dnnl_bf16, dnnl_format_tag_any) == dnnl_success) &&
             dnnl_matmul_desc_init(&desc, &md_a, &md_b, NULL, &md_c) == dnnl_success &&
             dnnl_primitive_attr_create(&attr) == dnnl_success &&
             dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user) == dnnl_success;
    if (ok && sum)
        ok = dnnl_post_ops_create(&po) == dnnl_success && dnnl_post_ops_append_sum(po, 1.0f) == dnnl_success &&
             dnnl_primitive_attr_set_post_ops(attr, po) == dnnl_success;
    // made for one thread, as every block runs (oneDNN runs sequentially inside a parallel
    // region, but would choose its blocking, a split of the sum included, for the thread count
    // it sees here)
    const int nt = omp_get_max_threads();
    omp_set_num_threads(1);
    ok = ok && dnnl_primitive_desc_create(&pd, &desc, attr, engine(), NULL) == dnnl_success;
    if (ok && pd_out) *pd_out = pd, pd = NULL;
    else ok = ok && dnnl_primitive_create(prim, pd) == dnnl_success;
    omp_set_num_threads(nt);
    dnnl_primitive_desc_destroy(pd);
    dnnl_post_ops_destroy(po);
    dnnl_primitive_attr_destroy(attr);
    return ok ? 0 : -1;
}

// the reorder of B (K,N), fp32 as stored (tb: read transposed from (N,K) rows), into *wmd
static int make_reorder(dnnl_primitive_t *prim, int N, int K, int ldb, int tb, const dnnl_memory_desc_t *wmd) {
    dnnl_memory_desc_t md_s;
    const dnnl_dims_t db = {K, N}, sb = {tb ? 1 : ldb, tb ? ldb : 1};
    dnnl_primitive_desc_t pd = NULL;
    dnnl_primitive_attr_t attr = NULL;
    int ok = dnnl_memory_desc_init_by_strides(&md_s, 2, db, dnnl_f32, sb) == dnnl_success &&
             dnnl_primitive_attr_create(&attr) == dnnl_success &&
             dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user) == dnnl_success &&
             dnnl_reorder_primitive_desc_create(&pd, &md_s, engine(), wmd, engine(), attr) == dnnl_success &&
             dnnl_primitive_create(prim, pd) == dnnl_success;
    dnnl_primitive_desc_destroy(pd);
    dnnl_primitive_attr_destroy(attr);
    return ok ? 0 : -1;
}

// One product C (M,N) = op(A) op(B) + beta C with op(A) already in bf16 (ah: row-major (M,K)),
// and its primitives, looked up or made (and
// kept while the table has room; owned[i]: made for this product only, freed after it).
typedef struct {
    int M, N, K, sum, ldc, ldb, tb;
    int kr;             // op(A)'s columns and B's rows that hold values: K, or fewer (product_of)
    row_split rs;
    uint16_t *ah;
    int pack_a;         // 1: each block rounds its own rows of A (row-major fp32) into ah first
    float *cs;          // with pack_a, or NULL: block b's column sums of its rows of A, at cs + b K
    gemm_bf16_epi epi;  // run on each block after its product (NULL: none)
    const void *ctx;
    const float *A, *B; // fp32 operands, for a block that has to fall back to fp32
    int lda, ta;
    float *C;
    dnnl_memory_desc_t wmd;
    int bw, kp;         // bw > 0: wmd is BA16a<bw>b2a with K padded to kp, and pack_b_block writes it
    struct shadow *sh;  // B's kept packed copy (a weight's), or NULL: B is packed into scratch
    uint32_t *bpre;     // B packed by its producer (gemm_bf16_bpack), or NULL; then B is NULL
    uint64_t sh_ver;    // the version sh must hold to be read as it is
    dnnl_primitive_t reorder, mm[3]; // the matmuls of the block heights mh (0: none)
    int mh[3];
    int owned[4];
} product;

// brgemm's bf16 B layouts BA16a<w>b2a (w 64 for every bench-s product, 16-48 for narrow ones):
// B (K,N) cut into blocks of w columns, each block all of K (padded to 32) in chunks of 32 rows
// stored as 16 row pairs of w columns, a pair's two rows side by side. p->bw is w when wmd is
// one of them (compared with oneDNN's own descriptor, padding included), else 0 and oneDNN's
// reorder packs B.
static void blocked_width(product *p) {
    static const struct { int w; dnnl_format_tag_t tag; } fmt[] = {
        {64, dnnl_BA16a64b2a}, {48, dnnl_BA16a48b2a}, {32, dnnl_BA16a32b2a}, {16, dnnl_BA16a16b2a}};
    const dnnl_dims_t d = {p->K, p->N};
    p->bw = 0;
    for (size_t i = 0; i < sizeof(fmt) / sizeof(fmt[0]); i++) {
        dnnl_memory_desc_t md;
        const int kp = (p->K + 31) / 32 * 32, np = (p->N + fmt[i].w - 1) / fmt[i].w * fmt[i].w;
        if (dnnl_memory_desc_init_by_tag(&md, 2, d, dnnl_bf16, fmt[i].tag) == dnnl_success &&
            dnnl_memory_desc_equal(&md, &p->wmd) && dnnl_memory_desc_get_size(&md) == (size_t)kp * np * 2) {
            p->bw = fmt[i].w, p->kp = kp;
            return;
        }
    }
}

static inline uint32_t bf16_pair(float lo, float hi) { return to_bf16(lo) | (uint32_t)to_bf16(hi) << 16; }

#if defined(__AVX512BW__)
// bf16_of on 16 lanes, in integer arithmetic as bf16_of does (vcvtneps2bf16 would flush
// subnormals to zero: other bits than the scalar rounding's); the bf16 in each lane's low half
static inline __m512i bf16_of16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x), hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
}

// The tb layout through registers: 16 stored rows (B's columns n1..n1+15) of 32 floats from k0
// (masked past K, zero rows past nn) become 16 lanes of pairs each, and a 16x16 transpose of
// those pairs gives 16 of the layout's rows, each 16 columns wide. The scalar loop read one
// strided float at a time (a third of pack_b_block's time in a 1-thread bench-s step).
static void pack_tb_tile(uint32_t *o, int w, const float *s, int ldb, int rows, __mmask16 m0, __mmask16 m1) {
    // word m of the pair vector: the bf16 of k0+m (words 0..15 from the first 16 floats)
    static const uint16_t even[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                      32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
    const __m512i idx = _mm512_loadu_si512(even);
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) {
        if (i >= rows) {
            r[i] = _mm512_setzero_si512();
            continue;
        }
        const float *x = s + (size_t)i * ldb;
        r[i] = _mm512_permutex2var_epi16(bf16_of16(_mm512_maskz_loadu_ps(m0, x)), idx,
                                         bf16_of16(_mm512_maskz_loadu_ps(m1, x + 16)));
    }
    // 16x16 transpose of 32-bit lanes: pairs of rows, then of pairs, then 128-bit quarters
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // r[4q+c] holds, in 128-bit quarter g, lane c of the pairs 4g..4g+3 of rows 4q..4q+3
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        const __m512i a = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88), b = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        const __m512i c = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88), d = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
        _mm512_storeu_si512(o + (size_t)i * w, a);
        _mm512_storeu_si512(o + (size_t)(i + 8) * w, b);
        _mm512_storeu_si512(o + (size_t)(i + 4) * w, c);
        _mm512_storeu_si512(o + (size_t)(i + 12) * w, d);
    }
}
#endif

// One row pair k, k+1 of B not transposed (or of the padding past K), columns n0..n0+nn, into
// the w values at o, the columns past nn zero
static void pack_pair(uint32_t *o, const product *p, int k, int n0, int nn) {
    const int K = p->kr, w = p->bw;
    if (k >= K) {
        memset(o, 0, sizeof(uint32_t) * w);
        return;
    }
    const int k1 = k + 1 < K; // 0: row k+1 is padding
    const float *r0 = p->B + (size_t)k * p->ldb + n0, *r1 = k1 ? r0 + p->ldb : r0;
    if (k1) {
#pragma omp simd
        for (int n = 0; n < nn; n++) o[n] = bf16_pair(r0[n], r1[n]);
    } else {
        for (int n = 0; n < nn; n++) o[n] = bf16_pair(r0[n], 0.0f);
    }
    for (int n = nn; n < w; n++) o[n] = 0;
}

// Column block j of B into the layout of blocked_width (padding zero, as oneDNN's reorder
// leaves it), rounding as bf16_pack does. A pair is one uint32_t: dst is only written as such.
static void pack_b_block(uint32_t *dst, const product *p, int j) {
    const int w = p->bw, K = p->kr, n0 = j * w, nn = p->N - n0 < w ? p->N - n0 : w, ldb = p->ldb;
    uint32_t *d = dst + (size_t)j * (p->kp / 2) * w;  // the block's kp/2 rows of w pairs
#if defined(__AVX512BW__)
    if (p->tb) {
        // 32 rows k0.. (16 pairs) by 16 columns a tile; w is a multiple of 16, K's padding masked
        for (int k0 = 0; k0 < p->kp; k0 += 32) {
            const int left = K - k0;
            const __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            const __mmask16 m1 = left >= 32 ? 0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            for (int n1 = 0; n1 < w; n1 += 16) {
                const float *s = n1 < nn ? p->B + (size_t)(n0 + n1) * ldb + k0 : p->B;
                pack_tb_tile(d + (size_t)(k0 / 2) * w + n1, w, s, ldb, nn - n1, m0, m1);
            }
        }
        return;
    }
#endif
    for (int k = 0; k < p->kp; k += 2) {
        uint32_t *o = d + (size_t)(k / 2) * w;
        if (k >= K || !p->tb) {
            pack_pair(o, p, k, n0, nn);
            continue;
        }
        // B[n*ldb + k]: each pair is two neighbours of one row of the stored (N,K) matrix
        const int k1 = k + 1 < K; // 0: row k+1 is padding
        const float *s = p->B + (size_t)n0 * ldb + k;
        for (int n = 0; n < nn; n++) o[n] = bf16_pair(s[(size_t)n * ldb], k1 ? s[(size_t)n * ldb + 1] : 0.0f);
        for (int n = nn; n < w; n++) o[n] = 0;
    }
}

// B not transposed, the row pairs [r0, r1) of every column block: B's rows read in order, each
// once, where pack_b_block reads a block's w columns of every row (a stride of ldb floats)
static void pack_b_rows(uint32_t *dst, const product *p, int r0, int r1) {
    const int w = p->bw, ncb = (p->N + w - 1) / w;
    for (int r = r0; r < r1; r++)
        for (int j = 0; j < ncb; j++) {
            const int n0 = j * w, nn = p->N - n0 < w ? p->N - n0 : w;
            pack_pair(dst + ((size_t)j * (p->kp / 2) + (size_t)r) * w, p, 2 * r, n0, nn);
        }
}

// ---- weight shadows (gemm_bf16.h): a table like the primitives', under the same lock, of
// B's packed copies keyed by B's address and how the product reads it. Only layouts that
// pack_b_block writes are kept. The declared range is the calling thread's (two threads may
// run two models). Declaring another range than the kept shadows' drops them all when no other
// thread has one declared (another model's weights: a shadow whose address meets new weights
// is never read, as its version is not theirs, but it would hold memory); while another thread
// does, they stay, as that thread may be reading one.
typedef struct shadow {
    int used, tb, N, K, ldb, bw, kp;
    const float *B;
    uint64_t ver;       // packed at this version; 0: not yet
    uint32_t *buf;      // (the layout's bytes)
} shadow;
enum { SHADOW_N = 8192 }; // slots, filled to 3/4 at most
static shadow shadows[SHADOW_N];
static int shadow_n, users;   // users: threads with a range declared
static uint64_t last_ver;
static const float *kept_lo;  // the range the kept shadows were made in
static size_t kept_n;
static gemm_bf16_counts counts;
static _Thread_local const float *act_lo; // this thread's declared range and version
static _Thread_local size_t act_n;
static _Thread_local uint64_t act_ver;

uint64_t gemm_bf16_new_version(void) {
    pthread_mutex_lock(&cache_mu);
    const uint64_t v = ++last_ver;
    pthread_mutex_unlock(&cache_mu);
    return v;
}

static void shadows_drop(void) {
    for (int i = 0; i < SHADOW_N; i++)
        if (shadows[i].used) free(shadows[i].buf);
    memset(shadows, 0, sizeof(shadows));
    shadow_n = 0, counts.shadow_bytes = 0;
}

void gemm_bf16_shadow_use(const float *lo, size_t n, uint64_t version) {
    pthread_mutex_lock(&cache_mu);
    users -= act_n != 0;
    if (n && (lo != kept_lo || n != kept_n) && users == 0) shadows_drop(), kept_lo = lo, kept_n = n;
    users += n != 0;
    act_lo = n ? lo : NULL, act_n = n, act_ver = n ? version : 0;
    pthread_mutex_unlock(&cache_mu);
}

// whether B as p reads it lies inside [lo, lo+n)
static int inside(const product *p, const float *lo, size_t n) {
    const size_t rows = p->tb ? (size_t)p->N : (size_t)p->kr, cols = p->tb ? (size_t)p->kr : (size_t)p->N;
    const uintptr_t b = (uintptr_t)p->B, l = (uintptr_t)lo;
    return n && b >= l && (b - l) / sizeof(float) + (rows - 1) * (size_t)p->ldb + cols <= n;
}

static unsigned shadow_slot(const float *B, int tb, int N, int K, int ldb) {
    uint64_t h = 14695981039346656037u ^ (uint64_t)(uintptr_t)B;
    const int v[4] = {tb, N, K, ldb};
    for (int i = 0; i < 4; i++) h = (h ^ (uint32_t)v[i]) * 1099511628211u;
    return (unsigned)((h ^ h >> 32) % SHADOW_N);
}

// p's shadow, made (not yet packed) when missing; NULL when the table is full or memory short.
// Under cache_mu.
static shadow *shadow_of(const product *p) {
    unsigned i = shadow_slot(p->B, p->tb, p->N, p->K, p->ldb);
    for (; shadows[i].used; i = (i + 1) % SHADOW_N) {
        shadow *e = &shadows[i];
        if (e->B == p->B && e->tb == p->tb && e->N == p->N && e->K == p->K && e->ldb == p->ldb)
            return e->bw == p->bw && e->kp == p->kp ? e : NULL;
    }
    if (shadow_n >= SHADOW_N / 4 * 3) return NULL;
    const size_t bytes = dnnl_memory_desc_get_size(&p->wmd);
    uint32_t *buf = vlmoe_alloc_line(bytes); // on a cache line, as scratch's
    if (!buf) return NULL;
    shadows[i] = (shadow){.used = 1, .tb = p->tb, .N = p->N, .K = p->K, .ldb = p->ldb, .bw = p->bw, .kp = p->kp,
                          .B = p->B, .buf = buf};
    shadow_n++, counts.shadow_bytes += bytes;
    return &shadows[i];
}

// p->wmd (and bw, kp): the B layout of a (K,N) B, kept per (N,K), so that every product of
// that N and K reads B in one layout. Under cache_mu.
static int layout_of(product *p) {
    const int N = p->N, K = p->K;
    const row_split *rs = &p->rs;
    int ok = 1;
    entry *lay = find(K_LAYOUT, 0, N, K, 0, 0, 0);
    if (!lay) {
        // the layout brgemm picks for a full block; every block then reads B in it
        dnnl_primitive_desc_t pd = NULL;
        ok = make_matmul(NULL, &pd, block_height(rs, 0), N, K, 1, N, NULL) == 0;
        if (ok) {
            const dnnl_memory_desc_t *w = dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
            ok = w != NULL;
            if (ok) keep((entry){.kind = K_LAYOUT, .n = N, .k = K, .md = *w});
            if (ok) p->wmd = *w;
        }
        dnnl_primitive_desc_destroy(pd);
    } else {
        p->wmd = lay->md;
    }
    if (ok) blocked_width(p);
    return ok ? 0 : -1;
}

static int plan(product *p) {
    pthread_mutex_lock(&cache_mu);
    int ok = layout_of(p) == 0;
    if (ok && !p->bw && p->K != p->kr) {
        // a B layout oneDNN's reorder writes would read B's padding rows from B: unpadded
        p->K = p->kr, p->rs = split_rows(p->M, p->N, p->K);
        ok = layout_of(p) == 0;
    }
    const int N = p->N, K = p->K;
    const row_split *rs = &p->rs;
    // the heights: the taller blocks', the others', the tail's
    p->mh[0] = rs->extra ? block_height(rs, 0) : 0;
    p->mh[1] = rs->nb > rs->extra ? block_height(rs, rs->extra) : 0;
    p->mh[2] = rs->tail;
    counts.products++;
    if (ok && p->bw && p->B && p->K == p->kr && act_n && inside(p, act_lo, act_n) && (p->sh = shadow_of(p))) {
        p->sh_ver = act_ver;
        if (p->sh->ver == act_ver) counts.shadow_reused++;
        else counts.shadow_packed++;
    }
    if (ok) {
        if (p->bw) counts.b_packed += !p->bpre && (!p->sh || p->sh->ver != p->sh_ver);
        else counts.b_reordered++;
    }
    struct { int kind, m, ld, tb, sum; dnnl_primitive_t *dst; } want[4] = {
        {K_REORDER, 0, p->ldb, p->tb, 0, &p->reorder},
        {K_MATMUL, p->mh[0], p->ldc, 0, p->sum, &p->mm[0]},
        {K_MATMUL, p->mh[1], p->ldc, 0, p->sum, &p->mm[1]},
        {K_MATMUL, p->mh[2], p->ldc, 0, p->sum, &p->mm[2]}};
    for (int i = 0; ok && i < 4; i++) {
        if ((want[i].kind == K_MATMUL && want[i].m == 0) || (want[i].kind == K_REORDER && p->bw)) continue;
        entry *e = find(want[i].kind, want[i].m, N, K, want[i].sum, want[i].ld, want[i].tb);
        if (e) {
            *want[i].dst = e->prim;
            counts.prim_hits++;
            continue;
        }
        counts.prim_misses++;
        dnnl_primitive_t pr = NULL;
        ok = (want[i].kind == K_REORDER ? make_reorder(&pr, N, K, p->ldb, p->tb, &p->wmd)
                                        : make_matmul(&pr, NULL, want[i].m, N, K, p->sum, p->ldc, &p->wmd)) == 0;
        if (!ok) break;
        *want[i].dst = pr;
        p->owned[i] = !keep((entry){.kind = want[i].kind, .m = want[i].m, .n = N, .k = K, .sum = want[i].sum,
                                    .ld = want[i].ld, .tb = want[i].tb, .prim = pr});
    }
    pthread_mutex_unlock(&cache_mu);
    return ok ? 0 : -1;
}

static void unplan(product *p) {
    dnnl_primitive_t *pr[4] = {&p->reorder, &p->mm[0], &p->mm[1], &p->mm[2]};
    for (int i = 0; i < 4; i++)
        if (p->owned[i]) dnnl_primitive_destroy(*pr[i]), p->owned[i] = 0;
}

// A product's fields. With ta (the weight gradients, whose K is the tokens: an expert's count
// changes every step) K is padded to a multiple of 32 with zero columns of op(A) and zero rows
// of B, which B's blocked layout holds anyway: the products of each 32 counts then share
// their primitives (bench-s made some 50 a step otherwise, ~0.4 ms each), and brgemm gives the
// bits of the unpadded product (adding zero products; tests/test_bf16.c checks it). kr keeps
// the real K. plan undoes it where B is not in such a layout.
static product product_of(int ta, int tb, int M, int N, int K, const float *A, int lda, const float *B, int ldb,
                          float beta, float *C, int ldc) {
    const int kp = ta ? (K + 31) / 32 * 32 : K;
    return (product){.M = M, .N = N, .K = kp, .kr = K, .sum = beta != 0, .ldc = ldc, .ldb = ldb, .tb = tb,
                     .rs = split_rows(M, N, kp), .A = A, .B = B, .lda = lda, .ta = ta, .C = C};
}

// The packed operands and the primitives' scratchpad, per thread and slot (0: op(A), 1: B,
// 2: scratchpad, 3: the backward's transposed dout, 4: its blocks' column sums, 5: the caller's
// pre-rounded operand, gemm_bf16_side, 6: a B packed by its producer), kept between products: the kernels own no
// workspace (they are pure functions of their arguments), and allocating megabytes per product
// would cost page faults on every call. The buffers only grow, and what they held is not kept
// when they do. They start on a cache line: with 16-byte aligned ones (realloc's) every row of
// brgemm's AMX tiles straddled two lines, and its products ran at 240-340 GFLOP/s a thread in
// place of 340-940 (bench-s's shapes, Xeon with AMX, 1 thread).
static void *scratch(size_t bytes, int slot) {
    static _Thread_local void *buf[7];
    static _Thread_local size_t cap[7];
    return vlmoe_scratch_grow(&buf[slot], &cap[slot], bytes);
}

// runs prim on this thread's stream with this thread's scratchpad; args has room for one more
static int run(dnnl_primitive_t prim, int n, dnnl_exec_arg_t *args) {
    dnnl_stream_t s = stream();
    const_dnnl_primitive_desc_t pd = NULL;
    if (!s || dnnl_primitive_get_primitive_desc(prim, &pd) != dnnl_success) return -1;
    const dnnl_memory_desc_t *smd = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    const size_t bytes = smd ? dnnl_memory_desc_get_size(smd) : 0;
    dnnl_memory_t ms = NULL;
    if (bytes) {
        void *buf = scratch(bytes, 2);
        if (!buf || dnnl_memory_create(&ms, smd, engine(), buf) != dnnl_success) return -1;
        args[n++] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD, ms};
    }
    const int ok = dnnl_primitive_execute(prim, s, n, args) == dnnl_success && dnnl_stream_wait(s) == dnnl_success;
    dnnl_memory_destroy(ms);
    return ok ? 0 : -1;
}

// one block: rows o..o+m of C, from the same rows of op(A) and all of B (bh, in p->wmd)
static int block(const product *p, int o, int m, const void *bh) {
    dnnl_memory_desc_t md_a, md_c;
    const dnnl_dims_t dc = {m, p->N}, sc = {p->ldc, 1};
    const dnnl_dims_t da = {m, p->K}, sa = {p->K, 1};
    dnnl_memory_t ma = NULL, mb = NULL, mc = NULL;
    int ok = dnnl_memory_desc_init_by_strides(&md_a, 2, da, dnnl_bf16, sa) == dnnl_success &&
             dnnl_memory_desc_init_by_strides(&md_c, 2, dc, dnnl_f32, sc) == dnnl_success &&
             dnnl_memory_create(&ma, &md_a, engine(), (void *)(p->ah + (size_t)o * p->K)) == dnnl_success &&
             dnnl_memory_create(&mb, &p->wmd, engine(), (void *)bh) == dnnl_success &&
             dnnl_memory_create(&mc, &md_c, engine(), p->C + (size_t)o * p->ldc) == dnnl_success;
    if (ok) {
        dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}};
        const dnnl_primitive_t pr = m == p->mh[0] ? p->mm[0] : m == p->mh[1] ? p->mm[1] : p->mm[2];
        ok = run(pr, 3, args) == 0;
    }
    dnnl_memory_destroy(ma), dnnl_memory_destroy(mb), dnnl_memory_destroy(mc);
    return ok ? 0 : -1;
}

// value (k, n) of a B in the layout of blocked_width
static float packed_value(const product *p, const uint32_t *bh, int k, int n) {
    const uint32_t pair = bh[((size_t)(n / p->bw) * (p->kp / 2) + k / 2) * p->bw + n % p->bw];
    const uint32_t u = (k & 1 ? pair >> 16 : pair & 0xffff) << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

// A block that brgemm failed to run, in fp32 (dnnl_sgemm) from the fp32 operands, or, where the
// caller gave none (gemm_bf16_pre's A, a producer-packed B), from the bf16 values it gave. If
// memory runs out even for that, the block's C is NaN, which the trainer's finite check reports.
static void fallback(const product *p, int o, int m, const void *bh) {
    const int K = p->kr, N = p->N;
    float *fa = p->A ? NULL : malloc(sizeof(float) * (size_t)m * K), *fb = p->B ? NULL : malloc(sizeof(float) * (size_t)K * N);
    if ((!p->A && !fa) || (!p->B && !fb)) {
        for (int i = 0; i < m; i++)
            for (int j = 0; j < N; j++) p->C[(size_t)(o + i) * p->ldc + j] = NAN;
        free(fa), free(fb);
        return;
    }
    for (size_t i = 0; fa && i < (size_t)m * K; i++) {
        const uint32_t u = (uint32_t)p->ah[(size_t)o * K + i] << 16; // (unpadded: ta 0)
        memcpy(fa + i, &u, sizeof(float));
    }
    for (int k = 0; fb && k < K; k++)
        for (int n = 0; n < N; n++) fb[(size_t)k * N + n] = packed_value(p, bh, k, n);
    const float *A = fa ? fa : p->ta ? p->A + o : p->A + (size_t)o * p->lda;
    dnnl_sgemm(fa || !p->ta ? 'N' : 'T', fb || !p->tb ? 'N' : 'T', m, N, K, 1, A, fa ? K : p->lda, fb ? fb : p->B,
               fb ? N : p->ldb, p->sum ? 1.0f : 0.0f, p->C + (size_t)o * p->ldc, p->ldc);
    free(fa), free(fb);
}

// bf16_pack's rows (not transposed) and, in the same pass, their column sums in fp32, row by
// row in order: sum (cols) = the sum of the rows of src. One thread, inside a block.
static void pack_sum(uint16_t *dst, float *sum, const float *src, int rows, int cols, int ld) {
    memset(sum, 0, sizeof(float) * cols);
    for (int i = 0; i < rows; i++) {
        const float *s = src + (size_t)i * ld;
        uint16_t *d = dst + (size_t)i * cols;
#pragma omp simd
        for (int j = 0; j < cols; j++) d[j] = to_bf16(s[j]), sum[j] += s[j];
    }
}

// Runs a planned product whose op(A) is packed or packed by the blocks (pack_a): B into the
// blocked layout, then the blocks, in one parallel region (with OMP_WAIT_POLICY=PASSIVE, as the
// vlmoe command and bench/speed.py run, each region wakes the sleeping threads): B's column
// blocks by pack_b_block, split over the threads, or, for a layout it does not know, first by
// oneDNN's reorder (on the OpenMP threads, a region of its own). Both round to nearest even as
// bf16_pack does. What fails to run from here on (B's buffer, the reorder, a block) is computed
// in fp32 instead, so a product that was planned always completes (the backward's two products
// are all or nothing).
static void execute(const product *p) {
    void *bh = p->bpre ? (void *)p->bpre : p->sh ? (void *)p->sh->buf : scratch(dnnl_memory_desc_get_size(&p->wmd), 1);
    const int pack = p->bw && !p->bpre && (!p->sh || p->sh->ver != p->sh_ver);
    int ok = bh != NULL;
    if (ok && !p->bw) {
        dnnl_memory_desc_t md_s;
        const dnnl_dims_t db = {p->K, p->N}, sb = {p->tb ? 1 : p->ldb, p->tb ? p->ldb : 1};
        dnnl_memory_t ms = NULL, md = NULL;
        ok = dnnl_memory_desc_init_by_strides(&md_s, 2, db, dnnl_f32, sb) == dnnl_success &&
             dnnl_memory_create(&ms, &md_s, engine(), (void *)p->B) == dnnl_success &&
             dnnl_memory_create(&md, &p->wmd, engine(), bh) == dnnl_success;
        if (ok) {
            dnnl_exec_arg_t args[3] = {{DNNL_ARG_FROM, ms}, {DNNL_ARG_TO, md}};
            ok = run(p->reorder, 2, args) == 0;
        }
        dnnl_memory_destroy(ms), dnnl_memory_destroy(md);
    }
    const int nb = blocks_of(&p->rs), ncb = pack && ok ? (p->N + p->bw - 1) / p->bw : 0;
    // B not transposed (an activation, in a weight-gradient product) by runs of 16 row pairs,
    // each run's rows read once and in order; transposed (a weight) by column blocks
    const int nrun = ncb && !p->tb ? (p->kp / 2 + 15) / 16 : 0;
    // one parallel region for B's packing and the blocks (each region wakes the threads)
#pragma omp parallel if (nb > 1 || (size_t)ncb * p->bw * p->K >= 65536)
    {
#pragma omp for schedule(static)
        for (int j = 0; j < (nrun ? 0 : ncb); j++) pack_b_block(bh, p, j);
#pragma omp for schedule(static)
        for (int r = 0; r < nrun; r++) pack_b_rows(bh, p, 16 * r, 16 * r + 16 < p->kp / 2 ? 16 * r + 16 : p->kp / 2);
#pragma omp for schedule(dynamic)
        for (int b = 0; b < nb; b++) {
            const int o = block_start(&p->rs, b), m = block_height(&p->rs, b);
            if (p->pack_a && p->cs) pack_sum(p->ah + (size_t)o * p->K, p->cs + (size_t)b * p->K, p->A + (size_t)o * p->lda, m, p->K, p->lda);
            else if (p->pack_a) bf16_pack(p->ah + (size_t)o * p->K, p->A + (size_t)o * p->lda, m, p->K, p->lda, 0);
            if (!ok || block(p, o, m, bh)) fallback(p, o, m, bh);
            if (p->epi) p->epi(p->ctx, p->C, p->ldc, o, m, 0, p->N);
        }
    }
    if (ok && pack && p->sh) {
        pthread_mutex_lock(&cache_mu);
        p->sh->ver = p->sh_ver;
        pthread_mutex_unlock(&cache_mu);
    }
}

void gemm_bf16_shadow_refresh(const float *lo, size_t n, uint64_t version) {
    pthread_mutex_lock(&cache_mu);
    // the shadows inside the range, and their column blocks counted, so that one parallel
    // region packs them all (an expert bank's tensor holds a shadow per expert and layout)
    int m = 0, *at = malloc(sizeof(int) * (shadow_n + 1)), *first = malloc(sizeof(int) * (shadow_n + 1));
    product *q = malloc(sizeof(product) * (shadow_n + 1));
    if (at && first && q) {
        first[0] = 0;
        for (int i = 0; i < SHADOW_N; i++) {
            shadow *e = &shadows[i];
            q[m] = (product){.B = e->B, .tb = e->tb, .N = e->N, .K = e->K, .kr = e->K, .ldb = e->ldb, .bw = e->bw,
                             .kp = e->kp};
            if (!e->used || !inside(&q[m], lo, n)) continue;
            at[m] = i, first[m + 1] = first[m] + (e->N + e->bw - 1) / e->bw, m++;
        }
        const int total = first[m];
#pragma omp parallel for schedule(static) if (m > 0)
        for (int t = 0; t < total; t++) {
            int k = 0;
            while (first[k + 1] <= t) k++;
            pack_b_block(shadows[at[k]].buf, &q[k], t - first[k]);
        }
        for (int k = 0; k < m; k++) shadows[at[k]].ver = version;
    } else {
        // no room to list them: they are packed again at their next product
        for (int i = 0; i < SHADOW_N; i++) shadows[i].ver = 0;
    }
    free(at), free(first), free(q);
    pthread_mutex_unlock(&cache_mu);
}

gemm_bf16_counts gemm_bf16_get_counts(void) {
    pthread_mutex_lock(&cache_mu);
    const gemm_bf16_counts c = counts;
    pthread_mutex_unlock(&cache_mu);
    return c;
}

// dst (rows, cols) bf16 row-major with leading dimension ldd = the transpose of src (cols,
// rows), row-major with leading dimension ld, fp32 or (bf) bf16: a oneDNN reorder, whose jit transpose runs some ten times
// faster than bf16_pack's scalar tiles (and on the OpenMP threads outside a parallel region).
// Returns -1 when the reorder cannot be made or run.
static int transpose(uint16_t *dst, int ldd, const void *src, int bf, int rows, int cols, int ld) {
    dnnl_memory_desc_t md_s, md_d;
    const dnnl_dims_t d = {rows, cols}, ss = {1, ld}, sd = {ldd, 1};
    if (dnnl_memory_desc_init_by_strides(&md_s, 2, d, bf ? dnnl_bf16 : dnnl_f32, ss) != dnnl_success ||
        dnnl_memory_desc_init_by_strides(&md_d, 2, d, dnnl_bf16, sd) != dnnl_success)
        return -1;
    dnnl_primitive_t prim = NULL;
    int owned = 0;
    pthread_mutex_lock(&cache_mu);
    entry *e = find(K_TRANSPOSE, rows, cols, ldd, 0, ld, bf);
    if (e) {
        prim = e->prim;
    } else {
        dnnl_primitive_desc_t pd = NULL;
        dnnl_primitive_attr_t attr = NULL;
        if (dnnl_primitive_attr_create(&attr) == dnnl_success &&
            dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user) == dnnl_success &&
            dnnl_reorder_primitive_desc_create(&pd, &md_s, engine(), &md_d, engine(), attr) == dnnl_success &&
            dnnl_primitive_create(&prim, pd) != dnnl_success)
            prim = NULL;
        dnnl_primitive_desc_destroy(pd);
        dnnl_primitive_attr_destroy(attr);
        owned = prim && !keep((entry){.kind = K_TRANSPOSE, .m = rows, .n = cols, .k = ldd, .ld = ld, .tb = bf, .prim = prim});
    }
    pthread_mutex_unlock(&cache_mu);
    dnnl_memory_t ms = NULL, md = NULL;
    int ok = prim && dnnl_memory_create(&ms, &md_s, engine(), (void *)src) == dnnl_success &&
             dnnl_memory_create(&md, &md_d, engine(), dst) == dnnl_success;
    if (ok) {
        dnnl_exec_arg_t args[3] = {{DNNL_ARG_FROM, ms}, {DNNL_ARG_TO, md}};
        ok = run(prim, 2, args) == 0;
    }
    dnnl_memory_destroy(ms), dnnl_memory_destroy(md);
    if (owned) dnnl_primitive_destroy(prim);
    return ok ? 0 : -1;
}

// op(A) = A^T of a ta product into ah (M,K) row-major, its columns from kr on zero: from a16
// (bf16, when given) or a32 (fp32), both (kr,M) with leading dimension lda. oneDNN's reorder
// transposes whole 32s of A's rows, so that its primitives are shared as the padded K's are
// (one per token count cost ~0.3 ms to make); the rest of the rows, or all of them where the
// reorder cannot run, go one element at a time.
static void a_transposed(uint16_t *ah, const uint16_t *a16, const float *a32, int lda, const product *p) {
    const int M = p->M, K = p->K, kr = p->kr;
    int k0 = kr / 32 * 32;
    if (k0 && transpose(ah, K, a16 ? (const void *)a16 : a32, a16 != NULL, M, k0, lda)) k0 = 0;
    for (int i = 0; i < M; i++) {
        uint16_t *d = ah + (size_t)i * K;
        for (int k = k0; k < kr; k++) d[k] = a16 ? a16[(size_t)k * lda + i] : to_bf16(a32[(size_t)k * lda + i]);
        memset(d + kr, 0, sizeof(uint16_t) * (K - kr));
    }
}

// plans and runs p with op(A) rounded here (with pb, B packed by its producer in that layout)
static int product_run(product *p, const gemm_bf16_bpack *pb) {
    if (pb) p->bpre = pb->buf;
    const int ok = plan(p) == 0 && (!pb || (p->bw == pb->w && p->kp == pb->kp));
    uint16_t *ah = ok ? scratch(sizeof(uint16_t) * (size_t)p->M * p->K, 0) : NULL;
    if (ah) {
        // op(A), row-major (M,K): rounded by the blocks, or transposed here
        p->ah = ah, p->pack_a = !p->ta;
        if (p->ta) a_transposed(ah, NULL, p->A, p->lda, p);
        execute(p);
    }
    unplan(p);
    return ah ? 0 : -1;
}

int gemm_bf16(int ta, int tb, int M, int N, int K, const float *A, int lda, const float *B, int ldb,
              float beta, float *C, int ldc, gemm_bf16_epi epi, const void *ctx) {
    if (!engine() || M <= 0 || N <= 0 || K <= 0) return -1;
    product p = product_of(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
    p.epi = epi, p.ctx = ctx;
    return product_run(&p, NULL);
}

uint16_t *gemm_bf16_side(size_t n) { return scratch(sizeof(uint16_t) * n, 5); }

int gemm_bf16_pre(int tb, int M, int N, int K, const uint16_t *ah, const float *A, int lda, const float *B, int ldb,
                  float beta, float *C, int ldc, gemm_bf16_epi epi, const void *ctx) {
    if (!engine() || M <= 0 || N <= 0 || K <= 0) return -1;
    product p = product_of(0, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
    p.epi = epi, p.ctx = ctx;
    const int ok = plan(&p) == 0;
    if (ok) {
        p.ah = (uint16_t *)ah, p.pack_a = 0; // read only: the blocks never write ah without pack_a
        execute(&p);
    }
    unplan(&p);
    return ok ? 0 : -1;
}

int gemm_bf16_bpack_begin(gemm_bf16_bpack *pb, int M, int N, int K) {
    if (!engine() || M <= 0 || N <= 0 || K <= 0) return -1;
    product p = product_of(1, 0, M, N, K, NULL, M, NULL, N, 0, NULL, N); // gemm_bf16_packed_b's (K padded)
    pthread_mutex_lock(&cache_mu);
    const int ok = layout_of(&p) == 0 && p.bw;
    pthread_mutex_unlock(&cache_mu);
    uint32_t *buf = ok ? scratch(dnnl_memory_desc_get_size(&p.wmd), 6) : NULL;
    if (!buf) return -1;
    *pb = (gemm_bf16_bpack){.buf = buf, .w = p.bw, .kp = p.kp, .K = K, .N = N};
    // the zeros brgemm reads past B: the pair rows from K/2 on (an odd K's last pair gets its
    // row K-1 from the producer) and the last column block's columns past N
    const int nb = (N + p.bw - 1) / p.bw, rows = p.kp / 2, w = p.bw, np = nb * w;
    for (int j = 0; j < nb; j++) memset(buf + ((size_t)j * rows + K / 2) * w, 0, sizeof(uint32_t) * (size_t)(rows - K / 2) * w);
    if (np > N)
        for (int i = 0; i < K / 2; i++) memset(buf + ((size_t)(nb - 1) * rows + i) * w + N % w, 0, sizeof(uint32_t) * (size_t)(np - N));
    return 0;
}

void gemm_bf16_bpack_rows(const gemm_bf16_bpack *pb, int k, int c, int n, const float *r0, const float *r1) {
    const int w = pb->w, rows = pb->kp / 2;
    for (int j = 0; j < n;) {
        const int col = c + j, off = col % w, len = n - j < w - off ? n - j : w - off;
        const size_t at = ((size_t)(col / w) * rows + k / 2) * w + off;
        if (r1) {
            uint32_t *o = pb->buf + at;
#pragma omp simd
            for (int i = 0; i < len; i++) o[i] = bf16_pair(r0[j + i], r1[j + i]);
        } else {
            // one half of each pair: the other row's half is another block's (or padding)
            uint16_t *o = (uint16_t *)(pb->buf + at) + (k & 1);
            for (int i = 0; i < len; i++) o[2 * i] = to_bf16(r0[j + i]);
        }
        j += len;
    }
}

int gemm_bf16_packed_b(int M, int N, int K, const float *A, int lda, const gemm_bf16_bpack *pb, float beta, float *C,
                       int ldc) {
    if (!engine() || M <= 0 || N != pb->N || K != pb->K) return -1;
    product p = product_of(1, 0, M, N, K, A, lda, NULL, N, beta, C, ldc);
    return product_run(&p, pb);
}

int gemm_bf16_backward(float *dinp, float *dw, float *db, const float *dout, const float *inp, const float *w,
                       int N, int K, int O, float beta) {
    if (!engine() || N <= 0 || K <= 0 || O <= 0) return -1;
    // dinp (N,K) = dout (N,O) . w (O,K) + beta dinp; dw (O,K) += dout^T (O,N) . inp (N,K): dout
    // is rounded once, and its transpose made from the bf16 copy (half the bytes to read). With
    // beta 0 dinp's matmul has no sum post-op, so neither brgemm nor the sgemm fallback reads it.
    product pi = product_of(0, 0, N, K, O, dout, O, w, K, beta, dinp, K);
    product pw = product_of(1, 0, O, K, N, dout, O, inp, K, 1, dw, K);
    // db's sums: each of dinp's blocks sums its rows of dout while rounding them (dout is read
    // once, not again by a column-sum pass), then the blocks' sums are added in block order: the
    // blocks are the shape's, so the bits do not depend on the thread count
    const int nb = blocks_of(&pi.rs);
    float *cs = db && dinp ? scratch(sizeof(float) * (size_t)nb * O, 4) : NULL;
    const int ok = (!db || !dinp || cs) && (!dinp || plan(&pi) == 0) && plan(&pw) == 0;
    uint16_t *gh = ok ? scratch(sizeof(uint16_t) * (size_t)N * O, 0) : NULL;
    uint16_t *gt = gh ? scratch(sizeof(uint16_t) * (size_t)O * pw.K, 3) : NULL;
    if (gt) {
        // dinp's blocks round dout as they go (without dinp, one pass does)
        pi.ah = gh, pi.pack_a = 1, pi.cs = cs, pw.ah = gt;
        if (dinp) execute(&pi);
        else bf16_pack(gh, dout, N, O, O, 0);
        if (cs) {
#pragma omp parallel for schedule(static) if ((size_t)nb * O >= 65536)
            for (int j = 0; j < O; j++) {
                float s = 0;
                for (int b = 0; b < nb; b++) s += cs[(size_t)b * O + j];
                db[j] += s;
            }
        }
        a_transposed(gt, gh, dout, O, &pw);
        execute(&pw);
    }
    unplan(&pi), unplan(&pw);
    return gt ? 0 : -1;
}
