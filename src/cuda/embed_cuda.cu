// embed_cuda.cu: token embeddings on the device (src/ops/ops.h embed_forward / embed_backward).
// The backward must add the rows of tokens that share an id in token order, as the CPU does,
// without float atomics: a stable radix sort (CUB) groups the tokens by id keeping their order,
// then one block per id walks its tokens. Kept apart from nn_cuda.cu because CUB is slow to
// compile. Covered by tests/test_backend_ops.c (the embed case repeats an id on purpose).
#include <cub/cub.cuh>

#include "cuda/cuda_internal.cuh"

// out (BT,D) = wte[ids]
__global__ static void k_embed_fwd(float *out, const int32_t *ids, const float *wte, size_t n, int D) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = wte[(size_t)ids[i / D] * D + i % D];
}
static void cuda_embed_forward(const backend *be, float *out, const int32_t *ids, const float *wte, int BT, int D) {
    const size_t n = (size_t)BT * D;
    if (!n) return;
    k_embed_fwd<<<cu_blocks(n, 256), 256, 0, stream_of(be)>>>(out, ids, wte, n, D);
    LAUNCHED("embed");
}

__global__ static void k_iota(int32_t *v, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) v[i] = i;
}

// One block per run of equal ids in the sorted order (the block at its first position): the
// run's tokens in their original order add into the id's row.
__global__ static void k_embed_bwd(float *dwte, const float *dout, const int32_t *key, const int32_t *tok, int BT,
                                   int D) {
    const int i = blockIdx.x;
    if (i >= BT || (i > 0 && key[i] == key[i - 1])) return;
    const int32_t id = key[i];
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float v = dwte[(size_t)id * D + c];
        for (int j = i; j < BT && key[j] == id; j++) v = __fadd_rn(v, dout[(size_t)tok[j] * D + c]);
        dwte[(size_t)id * D + c] = v;
    }
}

// dwte (V,D) accumulates
static void cuda_embed_backward(const backend *be, float *dwte, const float *dout, const int32_t *ids, int BT, int D) {
    if (BT <= 0 || D <= 0) return;
    cudaStream_t st = stream_of(be);
    size_t temp = 0;
    if (CK("embed", cub::DeviceRadixSort::SortPairs(NULL, temp, ids, (int32_t *)NULL, (const int32_t *)NULL,
                                                    (int32_t *)NULL, BT, 0, 32, st)))
        return;
    const size_t arr = ((sizeof(int32_t) * (size_t)BT) + 255) & ~(size_t)255;
    char *ws = (char *)cu_workspace(be, 3 * arr + temp, "embed");
    if (!ws) return;
    int32_t *tok_in = (int32_t *)ws, *key = (int32_t *)(ws + arr), *tok = (int32_t *)(ws + 2 * arr);
    k_iota<<<cu_blocks((size_t)BT, 256), 256, 0, st>>>(tok_in, BT);
    if (LAUNCHED("embed")) return;
    if (CK("embed", cub::DeviceRadixSort::SortPairs(ws + 3 * arr, temp, ids, key, tok_in, tok, BT, 0, 32, st)))
        return;
    k_embed_bwd<<<BT, 128, 0, st>>>(dwte, dout, key, tok, BT, D);
    LAUNCHED("embed");
}

void cuda_fill_embed(backend *be) {
    be->embed_forward = cuda_embed_forward;
    be->embed_backward = cuda_embed_backward;
}
