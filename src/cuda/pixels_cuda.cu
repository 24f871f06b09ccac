// pixels_cuda.cu: images cross the bus as bytes (issue 16: a quarter of the float images' bytes)
// and are normalised on the device (backend.h pixels_stage / pixels_normalize). Staging is planned
// once for the batch (the graph asks for its room when it is planned): two pinned host buffers
// and two device buffers used in turn, copied on a stream of their own, so the copy of batch i+1
// does not queue behind step i's kernels; events order the compute stream after the copy and the
// next copy into a slot after the kernel that read it. The normalisation is the host's float
// expression with IEEE division and no contraction (the build has -fmad=false): the same bits.
// Covered by tests/test_backend_ops.c (the pixels row, CPU against CUDA exactly) on a device.
#include <string.h>

#include "cuda/cuda_internal.cuh"

// out (B,C,H,W) = ((float)v / 255 - mean[c]) / std[c]; pix (B,H,W,C) when hwc, else (B,C,H,W)
__global__ static void k_pixels(float *out, const uint8_t *pix, be_pixels p, size_t n) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const size_t plane = (size_t)p.H * p.W, img = plane * p.C;
    const size_t b = i / img, r = i % img, c = r / plane, at = r % plane;
    const uint8_t v = p.hwc ? pix[b * img + at * p.C + c] : pix[i];
    out[i] = __fdiv_rn(__fsub_rn(__fdiv_rn((float)v, 255.0f), p.mean[c]), p.std[c]);
}

void cuda_pixels_release(cuda_ctx *c) {
    if (c->copy) cudaStreamSynchronize(c->copy);
    for (int k = 0; k < 2; k++) {
        if (c->pin[k]) cudaFreeHost(c->pin[k]);
        if (c->pix[k]) cudaFree(c->pix[k]);
        if (c->copied[k]) cudaEventDestroy(c->copied[k]);
        if (c->consumed[k]) cudaEventDestroy(c->consumed[k]);
        c->pin[k] = c->pix[k] = NULL, c->copied[k] = c->consumed[k] = NULL, c->pix_used[k] = 0;
    }
    if (c->copy) cudaStreamDestroy(c->copy);
    c->copy = NULL, c->pix_cap = 0, c->pix_next = 0;
}

// Room for n bytes in each slot: made when the graph is planned (a larger batch plans again),
// never inside a step. Waits for both streams first: queued copies and kernels may use the old
// buffers.
static int plan(cuda_ctx *c, size_t n) {
    if (n <= c->pix_cap) return 0;
    if (CK("pixels", cudaStreamSynchronize(c->stream))) return 1;
    if (c->copy && CK("pixels", cudaStreamSynchronize(c->copy))) return 1;
    cuda_pixels_release(c);
    if (CK("pixels", cudaStreamCreateWithFlags(&c->copy, cudaStreamNonBlocking))) return 1;
    for (int k = 0; k < 2; k++) {
        if (CK("pixels", cudaEventCreateWithFlags(&c->copied[k], cudaEventDisableTiming)) ||
            CK("pixels", cudaEventCreateWithFlags(&c->consumed[k], cudaEventDisableTiming)))
            return cuda_pixels_release(c), 1;
        cudaError_t e = cudaHostAlloc((void **)&c->pin[k], n, cudaHostAllocDefault);
        if (e == cudaSuccess) e = cudaMalloc((void **)&c->pix[k], n);
        if (e != cudaSuccess) {
            vlmoe_fail(VLMOE_ERR_NOMEM, "CUDA backend, op pixels: cannot allocate 2 x %zu bytes of image staging "
                       "(pinned host and device) (%s)", n, cudaGetErrorString(e));
            cuda_pixels_release(c);
            return 1;
        }
    }
    c->pix_cap = n;
    return 0;
}

static const uint8_t *cuda_pixels_stage(const backend *be, const uint8_t *host, size_t n) {
    cuda_ctx *c = ctx_of(be);
    if (plan(c, n ? n : 1)) return NULL;
    if (!host) return c->pix[0];
    const int k = c->pix_next;
    c->pix_next ^= 1;
    // the pinned slot is free once its last copy has left it (two stages ago: done long since)
    if (c->pix_used[k] && CK("pixels", cudaEventSynchronize(c->copied[k]))) return NULL;
    memcpy(c->pin[k], host, n);
    // the device slot is free once the kernel that read it has run
    if (c->pix_used[k] && CK("pixels", cudaStreamWaitEvent(c->copy, c->consumed[k], 0))) return NULL;
    if (n && CK("pixels", cudaMemcpyAsync(c->pix[k], c->pin[k], n, cudaMemcpyHostToDevice, c->copy))) return NULL;
    if (CK("pixels", cudaEventRecord(c->copied[k], c->copy))) return NULL;
    // until the normalisation records its own event, a copy into this slot waits for nothing more
    if (CK("pixels", cudaEventRecord(c->consumed[k], c->copy))) return NULL;
    c->pix_used[k] = 1;
    return c->pix[k];
}

static void cuda_pixels_normalize(const backend *be, float *out, const uint8_t *pix, const be_pixels *p) {
    cuda_ctx *c = ctx_of(be);
    const size_t n = (size_t)p->B * p->C * p->H * p->W;
    if (!n) return;
    int k = -1; // staged bytes: wait for their copy; other device bytes are ordered by the stream
    for (int j = 0; j < 2; j++)
        if (c->pix_used[j] && pix >= c->pix[j] && pix < c->pix[j] + c->pix_cap) k = j;
    if (k >= 0 && CK("pixels", cudaStreamWaitEvent(c->stream, c->copied[k], 0))) return;
    k_pixels<<<cu_blocks(n, 256), 256, 0, c->stream>>>(out, pix, *p, n);
    if (LAUNCHED("pixels")) return;
    if (k >= 0) CK("pixels", cudaEventRecord(c->consumed[k], c->stream));
}

void cuda_fill_pixels(backend *be) {
    be->pixels_stage = cuda_pixels_stage;
    be->pixels_normalize = cuda_pixels_normalize;
}
