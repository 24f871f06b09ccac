// backend_cuda.cu: the CUDA backend table (src/ops/backend.h), built by `make CUDA=1` in place of
// src/cuda/cuda_stub.c. Today it holds device memory (cudaMalloc, copies on one stream), the
// elementwise trainer ops (scale, clamp, AdamW), the sum of squares with its finite check, and
// the MoE row gather, combine and their backward (combine's weights still come from the CPU); `supports` refuses every other op with an error naming it, so
// a model asks for what is missing before it runs. Every CUDA status is checked and turned into
// a vlmoe error naming the call (the library never exits). Covered by tests/test_backend_ops.c,
// whose CUDA rows run only on a machine with a device.
#include <cuda_runtime.h>

#include <math.h>
#include <stdlib.h>

extern "C" {
#include "core/core.h"
#include "ops/backend.h"
}

typedef vlmoe_backend_f32 backend;

struct cuda_ctx {
    int device;
    cudaStream_t stream;
    double *partial;  // (NCHUNK) sum-of-squares partials on the device
    int *flag;        // (1) non-finite flag on the device
};

#define NCHUNK 64

static cuda_ctx *ctx_of(const backend *be) { return (cuda_ctx *)be->ctx; }

// Records a failed CUDA call as the thread's error; returns 1 when it failed.
static int cuda_failed(cudaError_t e, const char *call) {
    if (e == cudaSuccess) return 0;
    vlmoe_fail(VLMOE_ERR_ARG, "CUDA %s: %s (%s)", call, cudaGetErrorString(e), cudaGetErrorName(e));
    return 1;
}
#define CK(call) cuda_failed((call), #call)

static int cuda_supports(const backend *be, be_op op, const void *cfg) {
    switch (op) {
    case BE_OP_GATHER_ROWS: case BE_OP_SUMSQ: case BE_OP_SCALE: case BE_OP_ADAMW:
    case BE_OP_CLAMP:
        return 1;
    default:
        return 0; // the model kernels arrive with the CUDA backend issue
    }
}

static void *cuda_alloc(const backend *be, size_t bytes, const char *what) {
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        vlmoe_fail(VLMOE_ERR_NOMEM, "CUDA out of memory for %s: asked %zu bytes, %zu of %zu free (%s)", what,
                   bytes, free_b, total_b, cudaGetErrorString(e));
        return NULL;
    }
    if (CK(cudaMemsetAsync(p, 0, bytes, ctx_of(be)->stream))) return cudaFree(p), (void *)NULL;
    return p;
}
static void cuda_free(const backend *be, void *p) {
    if (p) CK(cudaFree(p));
}
static void cuda_upload(const backend *be, float *dst, const float *src, size_t n) {
    CK(cudaMemcpyAsync(dst, src, sizeof(float) * n, cudaMemcpyHostToDevice, ctx_of(be)->stream));
}
static void cuda_download(const backend *be, float *dst, const float *src, size_t n) {
    CK(cudaMemcpyAsync(dst, src, sizeof(float) * n, cudaMemcpyDeviceToHost, ctx_of(be)->stream));
    CK(cudaStreamSynchronize(ctx_of(be)->stream));
}
static void cuda_upload_bytes(const backend *be, void *dst, const void *src, size_t n) {
    CK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, ctx_of(be)->stream));
}
static void cuda_zero(const backend *be, float *p, size_t n) {
    CK(cudaMemsetAsync(p, 0, sizeof(float) * n, ctx_of(be)->stream));
}
static void cuda_copy(const backend *be, float *dst, const float *src, size_t n) {
    CK(cudaMemcpyAsync(dst, src, sizeof(float) * n, cudaMemcpyDeviceToDevice, ctx_of(be)->stream));
}
static int cuda_sync(const backend *be) {
    return CK(cudaStreamSynchronize(ctx_of(be)->stream)) ? VLMOE_ERR_ARG : VLMOE_OK;
}

static unsigned blocks_for(size_t n, unsigned threads) { return (unsigned)((n + threads - 1) / threads); }

__global__ static void k_add(float *dst, const float *src, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) dst[i] += src[i];
}
static void cuda_add(const backend *be, float *dst, const float *src, size_t n) {
    if (n) k_add<<<blocks_for(n, 256), 256, 0, ctx_of(be)->stream>>>(dst, src, n);
}

__global__ static void k_scale(float *x, size_t n, float s) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}
static void cuda_scale(const backend *be, float *x, size_t n, float s) {
    if (n) k_scale<<<blocks_for(n, 256), 256, 0, ctx_of(be)->stream>>>(x, n, s);
}

__global__ static void k_clamp(float *x, size_t n, float lo, float hi) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] < lo ? lo : x[i] > hi ? hi : x[i];
}
static void cuda_clamp(const backend *be, float *x, size_t n, double lo, double hi) {
    if (n) k_clamp<<<blocks_for(n, 256), 256, 0, ctx_of(be)->stream>>>(x, n, (float)lo, (float)hi);
}

// the same expression order as src/ops/backend_cpu.c (no fused multiply-adds: -fmad=false)
__global__ static void k_adamw(float *p, float *m, float *v, const float *g, size_t n, be_adamw a) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float pi = p[i];
    if (a.decay) pi = __fmul_rn(pi, a.shrink);
    const float gi = g[i];
    const float mi = __fadd_rn(__fmul_rn(a.b1, m[i]), __fmul_rn(a.ab1, gi));
    const float vi = __fadd_rn(__fmul_rn(a.b2, v[i]), __fmul_rn(__fmul_rn(a.ab2, gi), gi));
    m[i] = mi;
    v[i] = vi;
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), a.bc2_sqrt), a.eps);
    p[i] = __fadd_rn(pi, __fdiv_rn(__fmul_rn(a.neg_step, mi), denom));
}
static void cuda_adamw(const backend *be, float *p, float *m, float *v, const float *g, size_t n,
                       const be_adamw *a) {
    if (n) k_adamw<<<blocks_for(n, 256), 256, 0, ctx_of(be)->stream>>>(p, m, v, g, n, *a);
}

// One block per chunk of the CPU's chunking, summed in double in a fixed tree order: the bits do
// not depend on scheduling (they may differ from the CPU's sequential sum in the last places).
__global__ static void k_sumsq(double *partial, int *flag, const float *x, size_t n, size_t per) {
    __shared__ double s[256];
    const size_t a = blockIdx.x * per < n ? blockIdx.x * per : n, b = a + per < n ? a + per : n;
    double acc = 0;
    for (size_t i = a + threadIdx.x; i < b; i += blockDim.x) acc += (double)x[i] * x[i];
    s[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned k = blockDim.x / 2; k > 0; k /= 2) {
        if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        partial[blockIdx.x] = s[0];
        if (!isfinite(s[0])) *flag = 1;
    }
}
static double cuda_sumsq(const backend *be, const float *x, size_t n, int *nonfinite) {
    cuda_ctx *c = ctx_of(be);
    double part[NCHUNK];
    int flag = 0;
    const size_t per = (n + NCHUNK - 1) / NCHUNK;
    if (CK(cudaMemsetAsync(c->flag, 0, sizeof(int), c->stream))) return NAN;
    if (n) k_sumsq<<<NCHUNK, 256, 0, c->stream>>>(c->partial, c->flag, x, n, per ? per : 1);
    if (CK(cudaMemcpyAsync(part, c->partial, sizeof(part), cudaMemcpyDeviceToHost, c->stream)) ||
        CK(cudaMemcpyAsync(&flag, c->flag, sizeof(int), cudaMemcpyDeviceToHost, c->stream)) ||
        CK(cudaStreamSynchronize(c->stream)))
        return NAN;
    double sum = 0;
    for (int k = 0; k < NCHUNK && n; k++) sum += part[k];
    if (nonfinite) *nonfinite = flag;
    return sum;
}

__global__ static void k_gather_rows(float *dst, const float *src, const int32_t *idx, int rows, int D) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    for (int k = threadIdx.x; k < D; k += blockDim.x) dst[(size_t)r * D + k] = src[(size_t)idx[r] * D + k];
}
static void cuda_gather_rows(const backend *be, float *dst, const float *src, const int32_t *idx, int rows, int D) {
    if (rows > 0) k_gather_rows<<<rows, 128, 0, ctx_of(be)->stream>>>(dst, src, idx, rows, D);
}

// one block per token: its rows in row order, so no atomics and the same sum every run
__global__ static void k_combine(float *out, const float *y, const float *w, be_dispatch d, int D) {
    const int t = blockIdx.x;
    if (t >= d.n) return;
    for (int k = threadIdx.x; k < D; k += blockDim.x) {
        float o = out[(size_t)t * D + k];
        for (int j = d.tok_off[t]; j < d.tok_off[t + 1]; j++) {
            const int r = d.tok_rows[j];
            o = __fadd_rn(o, __fmul_rn(w[r], y[(size_t)r * D + k]));
        }
        out[(size_t)t * D + k] = o;
    }
}
static void cuda_combine_forward(const backend *be, float *out, const float *y, const float *w,
                                 const be_dispatch *d, int D) {
    if (d->n > 0) k_combine<<<d->n, 128, 0, ctx_of(be)->stream>>>(out, y, w, *d, D);
}

__global__ static void k_gather_back(float *dx, const float *dxp, be_dispatch d, int D) {
    const int t = blockIdx.x;
    if (t >= d.n) return;
    for (int k = threadIdx.x; k < D; k += blockDim.x) {
        float o = dx[(size_t)t * D + k];
        for (int j = d.tok_off[t]; j < d.tok_off[t + 1]; j++) o = __fadd_rn(o, dxp[(size_t)d.tok_rows[j] * D + k]);
        dx[(size_t)t * D + k] = o;
    }
}
static void cuda_gather_rows_backward(const backend *be, float *dx, const float *dxp, const be_dispatch *d, int D) {
    if (d->n > 0) k_gather_back<<<d->n, 128, 0, ctx_of(be)->stream>>>(dx, dxp, *d, D);
}

__global__ static void k_combine_back(float *dy, float *dw, const float *dout, const float *y, const float *w,
                                      be_dispatch d, int D) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= d.rows) return; // one thread per row: the dot product in CPU order
    const float *g = dout + (size_t)d.row_token[r] * D, *yr = y + (size_t)r * D;
    float dot = 0;
    for (int k = 0; k < D; k++) {
        dy[(size_t)r * D + k] = __fmul_rn(w[r], g[k]);
        dot = __fadd_rn(dot, __fmul_rn(g[k], yr[k]));
    }
    dw[r] = dot;
}
static void cuda_combine_backward(const backend *be, float *dy, float *dw, const float *dout, const float *y,
                                  const float *w, const be_dispatch *d, int D) {
    if (d->rows > 0) k_combine_back<<<blocks_for((size_t)d->rows, 128), 128, 0, ctx_of(be)->stream>>>(dy, dw, dout, y, w, *d, D);
}

extern "C" int backend_cuda_init(vlmoe_backend_f32 **out, int device) {
    *out = NULL;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess)
        return vlmoe_fail(VLMOE_ERR_ARG, "device cuda:%d: no usable CUDA device (%s)", device, cudaGetErrorString(e));
    if (device < 0 || device >= count)
        return vlmoe_fail(VLMOE_ERR_ARG, "device cuda:%d: this machine has %d CUDA device(s)", device, count);
    if (CK(cudaSetDevice(device))) return VLMOE_ERR_ARG;
    backend *be = (backend *)vlmoe_calloc(sizeof(backend), "CUDA backend");
    cuda_ctx *c = (cuda_ctx *)vlmoe_calloc(sizeof(cuda_ctx), "CUDA backend");
    if (!be || !c) return vlmoe_free_mem(be), vlmoe_free_mem(c), VLMOE_ERR_NOMEM;
    c->device = device;
    if (CK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) ||
        CK(cudaMalloc((void **)&c->partial, sizeof(double) * NCHUNK)) || CK(cudaMalloc((void **)&c->flag, sizeof(int)))) {
        vlmoe_free_mem(be);
        vlmoe_free_mem(c);
        return VLMOE_ERR_ARG;
    }
    be->name = "cuda";
    be->host_memory = 0; // device memory: host arrays are uploaded
    be->ctx = c;
    be->supports = cuda_supports;
    be->alloc = cuda_alloc;
    be->free = cuda_free;
    be->upload = cuda_upload;
    be->download = cuda_download;
    be->upload_bytes = cuda_upload_bytes;
    be->zero = cuda_zero;
    be->copy = cuda_copy;
    be->add = cuda_add;
    be->sync = cuda_sync;
    be->gather_rows = cuda_gather_rows;
    be->combine_forward = cuda_combine_forward;
    be->combine_backward = cuda_combine_backward;
    be->gather_rows_backward = cuda_gather_rows_backward;
    be->sumsq = cuda_sumsq;
    be->scale = cuda_scale;
    be->adamw = cuda_adamw;
    be->clamp = cuda_clamp;
    *out = be;
    return VLMOE_OK;
}

extern "C" void backend_cuda_free(vlmoe_backend_f32 *be) {
    if (!be) return;
    cuda_ctx *c = ctx_of(be);
    if (c) {
        cudaFree(c->partial);
        cudaFree(c->flag);
        cudaStreamDestroy(c->stream);
    }
    vlmoe_free_mem(c);
    vlmoe_free_mem(be);
}
