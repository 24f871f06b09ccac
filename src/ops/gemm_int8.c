// gemm_int8.c: int8 products for `--precision int8` on the CPU (src/ops/gemm_int8.h).
// Symmetric s8 on both sides: oneDNN's VNNI kernels take u8 x s8 and add the +128 shift's
// compensation themselves, while a u8 activation with a zero point per row is something
// oneDNN 2.6's matmul cannot take (its zero points are one per tensor). Each fixed block of the
// result is one single-threaded matmul (int32 sums, fp32 output times the weights' scales, given
// at run time so one cached primitive serves every expert of a shape); the rows' scales, the bias
// and the accumulation follow in one pass. Covered by tests/test_int8.c.
#include <dnnl.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "ops/gemm_int8.h"

int gemm_int8_native(void) {
    // oneDNN's ISA values are feature masks: AMX's include avx512_core_vnni's bits
    const unsigned isa = (unsigned)dnnl_get_effective_cpu_isa();
    const unsigned v512 = (unsigned)dnnl_cpu_isa_avx512_core_vnni, v256 = (unsigned)dnnl_cpu_isa_avx2_vnni;
    return (isa & v512) == v512 || (isa & v256) == v256;
}

void int8_quantize_rows(int8_t *q, float *scale, const float *x, int rows, int K, int ld) {
    if (K <= 0) return;
#pragma omp parallel for schedule(static) if ((size_t)rows * K >= 65536)
    for (int i = 0; i < rows; i++) {
        const float *r = x + (size_t)i * ld;
        int8_t *qi = q + (size_t)i * K;
        float amax = 0;
        int finite = 1;
        for (int k = 0; k < K; k++) {
            const float a = fabsf(r[k]);
            finite &= a <= 3.4e38f; // false for NaN too
            amax = a > amax ? a : amax;
        }
        if (!finite || amax == 0) {
            for (int k = 0; k < K; k++) qi[k] = 0;
            scale[i] = finite ? 0.0f : NAN;
            continue;
        }
        const float inv = 127.0f / amax;
#pragma omp simd
        for (int k = 0; k < K; k++) {
            const float v = r[k] * inv; // within [-127, 127] up to one rounding
            const int n = (int)(v + (v >= 0 ? 0.5f : -0.5f));
            qi[k] = (int8_t)(n > 127 ? 127 : n < -127 ? -127 : n);
        }
        scale[i] = amax / 127.0f;
    }
}

// One engine for the process (stateless, safe to share), made by whichever thread asks first.
static dnnl_engine_t the_engine;
static pthread_once_t eng_once = PTHREAD_ONCE_INIT;
static void make_engine(void) {
    if (dnnl_engine_create(&the_engine, dnnl_cpu, 0) != dnnl_success) the_engine = NULL;
}

// C (M,N) = (A (M,K) . B) * bscale[n] on one thread: A row-major s8, B s8 given by its strides
// (bs_k, bs_n), C fp32 with leading dimension ldc. 0, or -1 when oneDNN refuses.
static int int8_matmul(int M, int N, int K, const int8_t *A, const int8_t *B, long bs_k, long bs_n,
                       const float *bscale, float *C, int ldc) {
    pthread_once(&eng_once, make_engine);
    dnnl_engine_t eng = the_engine;
    if (!eng) return -1;
    dnnl_memory_desc_t md_a, md_b, md_c, md_s;
    const dnnl_dims_t da = {M, K}, sa = {K, 1}, db = {K, N}, sb = {bs_k, bs_n}, dc = {M, N}, sc = {ldc, 1};
    const dnnl_dims_t ds = {N}, ss = {1};
    const float runtime = DNNL_RUNTIME_F32_VAL;
    dnnl_matmul_desc_t desc;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_primitive_t prim = NULL;
    dnnl_stream_t stream = NULL;
    dnnl_memory_t ma = NULL, mb = NULL, mc = NULL, ms = NULL;
    int ok = dnnl_memory_desc_init_by_strides(&md_a, 2, da, dnnl_s8, sa) == dnnl_success &&
             dnnl_memory_desc_init_by_strides(&md_b, 2, db, dnnl_s8, sb) == dnnl_success &&
             dnnl_memory_desc_init_by_strides(&md_c, 2, dc, dnnl_f32, sc) == dnnl_success &&
             dnnl_memory_desc_init_by_strides(&md_s, 1, ds, dnnl_f32, ss) == dnnl_success &&
             dnnl_matmul_desc_init(&desc, &md_a, &md_b, NULL, &md_c) == dnnl_success &&
             dnnl_primitive_attr_create(&attr) == dnnl_success &&
             // one scale per column of C (dimension 1)
             dnnl_primitive_attr_set_output_scales(attr, 1, 1 << 1, &runtime) == dnnl_success &&
             dnnl_primitive_desc_create(&pd, &desc, attr, eng, NULL) == dnnl_success &&
             dnnl_primitive_create(&prim, pd) == dnnl_success &&
             dnnl_stream_create(&stream, eng, dnnl_stream_default_flags) == dnnl_success &&
             dnnl_memory_create(&ma, &md_a, eng, (void *)A) == dnnl_success &&
             dnnl_memory_create(&mb, &md_b, eng, (void *)B) == dnnl_success &&
             dnnl_memory_create(&mc, &md_c, eng, C) == dnnl_success &&
             dnnl_memory_create(&ms, &md_s, eng, (void *)bscale) == dnnl_success;
    if (ok) {
        const dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc},
                                         {DNNL_ARG_ATTR_OUTPUT_SCALES, ms}};
        ok = dnnl_primitive_execute(prim, stream, 4, args) == dnnl_success && dnnl_stream_wait(stream) == dnnl_success;
    }
    dnnl_memory_destroy(ma), dnnl_memory_destroy(mb), dnnl_memory_destroy(mc), dnnl_memory_destroy(ms);
    dnnl_stream_destroy(stream);
    dnnl_primitive_destroy(prim);
    dnnl_primitive_desc_destroy(pd);
    dnnl_primitive_attr_destroy(attr);
    return ok ? 0 : -1;
}

// The same block without oneDNN (a refused primitive): the same int32 sums, so the same values.
static void int8_matmul_ref(int M, int N, int K, const int8_t *A, const int8_t *B, long bs_k, long bs_n,
                            const float *bscale, float *C, int ldc) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            int32_t s = 0;
            for (int k = 0; k < K; k++) s += (int32_t)A[(size_t)i * K + k] * B[k * bs_k + j * bs_n];
            C[(size_t)i * ldc + j] = (float)s * bscale[j];
        }
}

// Per-thread scratch kept between products (the kernels own no workspace; allocating per
// product would page-fault on every call). Only grows.
static void *scratch(size_t bytes, int slot) {
    static _Thread_local void *buf[2];
    static _Thread_local size_t cap[2];
    if (bytes > cap[slot]) {
        void *p = realloc(buf[slot], bytes);
        if (!p) return NULL;
        buf[slot] = p, cap[slot] = bytes;
    }
    return buf[slot];
}

int linear_forward_int8(float *out, const float *x, const int8_t *wq, const float *ws, const float *b,
                        int N, int K, int O, int beta) {
    if (N <= 0 || O <= 0) return 0;
    // VNNI multiplies u8 by s8: oneDNN shifts s8 inputs by 128, so a sum reaches 255 * 127 * K,
    // which stays in int32 up to K = 66,000 (the widest MLP input here is a few thousand)
    if (K > 65536) return -1;
    int8_t *xq = scratch((size_t)N * K, 0);
    float *xs = scratch(sizeof(float) * ((size_t)N + (size_t)N * O), 1), *t = xs ? xs + N : NULL;
    if (!xq || !xs) return -1;
    int8_quantize_rows(xq, xs, x, N, K, K);
    // the blocks of src/ops/ops.c's gemm_p: up to 512 rows (or columns), at most 64 blocks
    const int split_rows = N >= O, dim = split_rows ? N : O;
    int nb = (dim + 511) / 512;
    nb = nb > 64 ? 64 : nb;
    const int bs = (dim + nb - 1) / nb;
#pragma omp parallel for schedule(static)
    for (int blk = 0; blk < nb; blk++) {
        const int o = blk * bs, n = dim - o < bs ? dim - o : bs;
        if (n <= 0) continue;
        const int r0 = split_rows ? o : 0, nr = split_rows ? n : N, c0 = split_rows ? 0 : o, nc = split_rows ? O : n;
        const int8_t *A = xq + (size_t)r0 * K, *B = wq + (size_t)c0 * K;
        float *C = t + (size_t)r0 * O + c0;
        // B: the (K, nc) view of wq's rows c0.. (stored (O,K)): strides (1, K)
        if (int8_matmul(nr, nc, K, A, B, 1, K, ws + c0, C, O))
            int8_matmul_ref(nr, nc, K, A, B, 1, K, ws + c0, C, O);
        for (int i = r0; i < r0 + nr; i++) {
            float *oi = out + (size_t)i * O;
            const float *ti = t + (size_t)i * O, s = xs[i];
            for (int j = c0; j < c0 + nc; j++) {
                const float v = s * ti[j] + (b ? b[j] : 0.0f);
                oi[j] = beta ? oi[j] + v : v;
            }
        }
    }
    return 0;
}

int int8_weights_add(int8_weights *w, const float *src, size_t rows, int K) {
    if (w->count == w->cap) {
        const int cap = w->cap ? 2 * w->cap : 16;
        int8_tensor *t = realloc(w->t, sizeof(int8_tensor) * (size_t)cap);
        if (!t) return vlmoe_fail(VLMOE_ERR_NOMEM, "int8 weights: the table of %d tensors", cap);
        w->t = t, w->cap = cap;
    }
    int8_tensor *e = &w->t[w->count];
    *e = (int8_tensor){.src = src, .rows = rows, .K = K, .q = malloc(rows * (size_t)K), .scale = malloc(sizeof(float) * rows)};
    if (!e->q || !e->scale) {
        free(e->q), free(e->scale);
        return vlmoe_fail(VLMOE_ERR_NOMEM, "int8 weights: %zu x %d bytes", rows, K);
    }
    int8_quantize_rows(e->q, e->scale, src, (int)rows, K, K);
    w->count++;
    return VLMOE_OK;
}

void int8_weights_free(int8_weights *w) {
    if (!w) return;
    for (int i = 0; i < w->count; i++) free(w->t[i].q), free(w->t[i].scale);
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
