// gemm_bf16.c: bf16 matrix products for `--precision bf16` on the CPU (src/ops/gemm_bf16.h).
// Operands are rounded to bf16 once per product (bf16_pack), and each fixed block of the result
// is one single-threaded oneDNN matmul (bf16 src and weights, fp32 dst, a sum post-op when the
// product accumulates), so, as in fp32, the result does not depend on the thread count.
// oneDNN caches the primitives of shapes it has seen, so a training step's repeated shapes cost
// a lookup, not a kernel generation. Covered by tests/test_bf16.c.
#include <dnnl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "ops/gemm_bf16.h"

int gemm_bf16_native(void) {
    // avx512_core_bf16's bits are a subset of AMX's (oneDNN's ISA values are feature masks)
    const unsigned isa = (unsigned)dnnl_get_effective_cpu_isa(), bf16 = (unsigned)dnnl_cpu_isa_avx512_core_bf16;
    return (isa & bf16) == bf16;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); // quiet NaN
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

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
// whichever thread's block asks first (pthread_once: no symbol a named OpenMP critical would
// export from libvlmoe.so).
static dnnl_engine_t the_engine;
static pthread_once_t eng_once = PTHREAD_ONCE_INIT;
static void make_engine(void) {
    if (dnnl_engine_create(&the_engine, dnnl_cpu, 0) != dnnl_success) the_engine = NULL;
}
static dnnl_engine_t engine(void) {
    pthread_once(&eng_once, make_engine);
    return the_engine;
}

int bf16_matmul(int M, int N, int K, const uint16_t *A, const uint16_t *B, long bs_k, long bs_n,
                float beta, float *C, int ldc) {
    dnnl_engine_t eng = engine();
    if (!eng || M <= 0 || N <= 0 || K <= 0) return -1;
    dnnl_memory_desc_t md_a, md_b, md_c;
    const dnnl_dims_t da = {M, K}, sa = {K, 1}, db = {K, N}, sb = {bs_k, bs_n}, dc = {M, N}, sc = {ldc, 1};
    dnnl_matmul_desc_t desc;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_primitive_t prim = NULL;
    dnnl_stream_t stream = NULL;
    dnnl_memory_t ma = NULL, mb = NULL, mc = NULL;
    int ok = dnnl_memory_desc_init_by_strides(&md_a, 2, da, dnnl_bf16, sa) == dnnl_success &&
             dnnl_memory_desc_init_by_strides(&md_b, 2, db, dnnl_bf16, sb) == dnnl_success &&
             dnnl_memory_desc_init_by_strides(&md_c, 2, dc, dnnl_f32, sc) == dnnl_success &&
             dnnl_matmul_desc_init(&desc, &md_a, &md_b, NULL, &md_c) == dnnl_success &&
             dnnl_primitive_attr_create(&attr) == dnnl_success;
    if (ok && beta != 0)
        ok = dnnl_post_ops_create(&po) == dnnl_success && dnnl_post_ops_append_sum(po, beta) == dnnl_success &&
             dnnl_primitive_attr_set_post_ops(attr, po) == dnnl_success;
    ok = ok && dnnl_primitive_desc_create(&pd, &desc, attr, eng, NULL) == dnnl_success &&
         dnnl_primitive_create(&prim, pd) == dnnl_success &&
         dnnl_stream_create(&stream, eng, dnnl_stream_default_flags) == dnnl_success &&
         dnnl_memory_create(&ma, &md_a, eng, (void *)A) == dnnl_success &&
         dnnl_memory_create(&mb, &md_b, eng, (void *)B) == dnnl_success &&
         dnnl_memory_create(&mc, &md_c, eng, C) == dnnl_success;
    if (ok) {
        const dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}};
        ok = dnnl_primitive_execute(prim, stream, 3, args) == dnnl_success && dnnl_stream_wait(stream) == dnnl_success;
    }
    dnnl_memory_destroy(ma), dnnl_memory_destroy(mb), dnnl_memory_destroy(mc);
    dnnl_stream_destroy(stream);
    dnnl_primitive_destroy(prim);
    dnnl_primitive_desc_destroy(pd);
    dnnl_post_ops_destroy(po);
    dnnl_primitive_attr_destroy(attr);
    return ok ? 0 : -1;
}

// The packed operands of one product, per thread and slot (A and B), kept between products:
// the kernels own no workspace (they are pure functions of their arguments), and allocating
// megabytes per product would cost page faults on every call. The buffers only grow.
uint16_t *bf16_scratch(size_t n, int slot) {
    static _Thread_local uint16_t *buf[2];
    static _Thread_local size_t cap[2];
    if (n > cap[slot]) {
        uint16_t *p = realloc(buf[slot], n * sizeof(uint16_t));
        if (!p) return NULL;
        buf[slot] = p, cap[slot] = n;
    }
    return buf[slot];
}
