// route_emu.h: what src/cuda/route_cuda.cu needs from CUDA and CUB, provided on the host so its
// kernels' logic can be checked without a GPU (tests/gpu/route_emu/run.sh): a launch runs every
// thread of the grid in turn, atomics are plain adds, CUB's stable radix sort is std::stable_sort
// on the same key bits, its exclusive scan a loop. It checks the decision and layout the kernels
// compute, not CUDA itself (races, launch limits, CUB): test_backend_ops' route row does that on
// a GPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
extern "C" {
#include "core/core.h"
#include "ops/backend.h"
}
using std::isnan;
typedef vlmoe_backend_f32 backend;
typedef int cudaError_t;
typedef void *cudaStream_t;
#define __global__
#define __device__
struct emu_dim { unsigned x; };
static emu_dim blockIdx, threadIdx, blockDim;
static unsigned emu_nb, emu_nt, emu_i;
static void emu_init(unsigned nb, unsigned nt) { emu_nb = nb, emu_nt = nt, emu_i = 0, blockDim.x = nt; }
static bool emu_next() {
    if (emu_i >= emu_nb * emu_nt) return false;
    blockIdx.x = emu_i / emu_nt, threadIdx.x = emu_i % emu_nt, emu_i++;
    return true;
}
// k<<<blocks, threads, 0, st>>>(args); becomes emu_for(blocks, threads) k(args); (run.sh); a
// one-block kernel with __syncthreads runs as one thread, its loops striding by blockDim.x = 1
#define emu_for(B, T) for (emu_init((B), (T)); emu_next();)
static void __syncthreads() {}
static int atomicAdd(int *p, int v) { int o = *p; *p += v; return o; }
static long long __double_as_longlong(double d) { long long u; memcpy(&u, &d, 8); return u; }
struct cuda_ctx { void *route_ws; size_t route_ws_bytes; };
static cuda_ctx emu_ctx;
static inline cuda_ctx *ctx_of(const backend *) { return &emu_ctx; }
static inline cudaStream_t stream_of(const backend *) { return nullptr; }
static inline unsigned cu_blocks(size_t n, unsigned t) { return (unsigned)((n + t - 1) / t); }
#define CK(op, call) ((call) != 0)
#define LAUNCHED(op) 0
static void *cu_grow(const backend *, void **buf, size_t *cap, size_t bytes, const char *, const char *) {
    if (bytes <= *cap) return *buf;
    free(*buf);
    *buf = malloc(bytes), *cap = bytes;
    memset(*buf, 0xcd, bytes); // garbage, as cudaMalloc gives
    return *buf;
}
static cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t) { return memset(p, v, n), 0; }
namespace cub {
struct DeviceRadixSort {
    template <typename K, typename V>
    static cudaError_t SortPairs(void *temp, size_t &bytes, const K *kin, K *kout, const V *vin, V *vout, int n,
                                 int b0, int b1, cudaStream_t) {
        if (!temp) return bytes = 64, 0;
        const K mask = b1 - b0 >= 64 ? ~(K)0 : (((K)1 << (b1 - b0)) - 1);
        std::vector<std::pair<K, V>> v(n);
        for (int i = 0; i < n; i++) v[i] = {kin[i], vin[i]};
        std::stable_sort(v.begin(), v.end(), [&](const std::pair<K, V> &a, const std::pair<K, V> &b) {
            return (a.first >> b0 & mask) < (b.first >> b0 & mask);
        });
        for (int i = 0; i < n; i++) kout[i] = v[i].first, vout[i] = v[i].second;
        return 0;
    }
};
struct DeviceScan {
    template <typename T>
    static cudaError_t ExclusiveSum(void *temp, size_t &bytes, const T *in, T *out, int n, cudaStream_t) {
        if (!temp) return bytes = 64, 0;
        T s = 0;
        for (int i = 0; i < n; i++) { const T x = in[i]; out[i] = s, s += x; }
        return 0;
    }
};
} // namespace cub
