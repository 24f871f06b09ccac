// loss_cuda.cu: the losses of the backend table on the device: the symmetric image-text
// contrastive loss (src/loss/contrastive.c; logits on cuBLAS), the masked-modeling
// cross-entropy (src/loss/masked.c) and the auxiliary MoE losses of one routing group
// (src/moe/aux.c, ported line by line, in double: the per-token softmax and chain rule on many
// blocks, the rest of each loss on one). Each scalar the CPU returns
// is reduced on the device in a fixed order and downloaded, so a run repeats the previous one's
// bits. Covered by tests/test_backend_ops.c against the CPU table in double.
#include <math.h>

#include "cuda/cuda_internal.cuh"

#define ROW_THREADS 128

// Block argmax of (v, i) pairs: the larger value, on a tie the lower index (the CPU's strict `>`
// scan from index 0).
__device__ static inline int block_argmax(float v, int i, float *shv, int *shi) {
    shv[threadIdx.x] = v, shi[threadIdx.x] = i;
    __syncthreads();
    for (unsigned k = blockDim.x / 2; k > 0; k /= 2) {
        if (threadIdx.x < k) {
            const float v2 = shv[threadIdx.x + k];
            const int i2 = shi[threadIdx.x + k];
            if (i2 >= 0 && (shi[threadIdx.x] < 0 || v2 > shv[threadIdx.x] || (v2 == shv[threadIdx.x] && i2 < shi[threadIdx.x])))
                shv[threadIdx.x] = v2, shi[threadIdx.x] = i2;
        }
        __syncthreads();
    }
    const int r = shi[0];
    __syncthreads();
    return r;
}

// *loss = the sum of part (n doubles), *count = the sum of cnt (n ints), both in a fixed order
__global__ static void k_sum_parts(double *loss, int *count, const double *part, const int *cnt, int n) {
    __shared__ double sh[256];
    __shared__ int shc[256];
    double s = 0;
    int c = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += part[i], c += cnt[i];
    s = block_sum(s, sh);
    c = block_sum(c, shc);
    if (threadIdx.x == 0) *loss = s, *count = c;
}

// Downloads the scalar and count the last k_sum_parts left in the context. 1 on failure.
static int fetch_scalar(const backend *be, const char *op, double *v, int *count) {
    cuda_ctx *c = ctx_of(be);
    return CK(op, cudaMemcpyAsync(v, c->partial, sizeof(double), cudaMemcpyDeviceToHost, c->stream)) ||
           CK(op, cudaMemcpyAsync(count, c->flag, sizeof(int), cudaMemcpyDeviceToHost, c->stream)) ||
           CK(op, cudaStreamSynchronize(c->stream));
}

// ---- contrastive: logits (B,B) = exp(scale) img.txt^T; row (image->text) and column
// (text->image) softmaxes prow, pcol (B,B); returns the mean of the two cross-entropies

// One block per row (cols 0) or column (cols 1) of the logits: its softmax, its loss term
// -(l_ii - max - log sum) and whether its argmax is the diagonal.
__global__ static void k_contrastive_line(float *p, double *part, int *right, const float *logits, int B, int cols) {
    __shared__ float shv[ROW_THREADS];
    __shared__ int shi[ROW_THREADS];
    __shared__ double shd[ROW_THREADS];
    const int i = blockIdx.x;
    const size_t step = cols ? (size_t)B : 1, base = cols ? (size_t)i : (size_t)i * B;
    float mx = -INFINITY;
    int arg = -1;
    for (int j = threadIdx.x; j < B; j += blockDim.x) {
        const float v = logits[base + j * step];
        if (arg < 0 || v > mx) mx = v, arg = j;
    }
    arg = block_argmax(mx, arg, shv, shi);
    mx = logits[base + (size_t)arg * step];
    double s = 0;
    for (int j = threadIdx.x; j < B; j += blockDim.x) {
        const float e = expf(__fsub_rn(logits[base + j * step], mx));
        p[base + j * step] = e;
        s += e;
    }
    s = block_sum(s, shd);
    for (int j = threadIdx.x; j < B; j += blockDim.x) p[base + j * step] = (float)(p[base + j * step] / s);
    if (threadIdx.x == 0) {
        part[i] = -((double)__fsub_rn(logits[base + (size_t)i * step], mx) - log(s));
        right[i] = arg == i;
    }
}

// The kernels of the forward, leaving in the context the loss's sum (partial[0]) and the right
// answers of both directions (flag[0]) and of image->text (flag[1]). 1 on failure.
static int contrastive_launch(const backend *be, float *logits, float *prow, float *pcol, const float *img,
                              const float *txt, float scale, int B, int E) {
    cudaStream_t st = stream_of(be);
    const float t = expf(scale);
    if (cu_gemm(be, "contrastive", 0, 1, B, B, E, t, img, E, txt, E, 0.0f, logits, B)) return 1;
    char *ws = (char *)cu_workspace(be, (sizeof(double) + sizeof(int)) * 2 * (size_t)B, "contrastive");
    if (!ws) return 1;
    double *part = (double *)ws;
    int *right = (int *)(part + 2 * (size_t)B);
    k_contrastive_line<<<B, ROW_THREADS, 0, st>>>(prow, part, right, logits, B, 0);
    k_contrastive_line<<<B, ROW_THREADS, 0, st>>>(pcol, part + B, right + B, logits, B, 1);
    if (LAUNCHED("contrastive")) return 1;
    // the accuracy counts both directions together; split them: two sums
    k_sum_parts<<<1, 256, 0, st>>>(ctx_of(be)->partial, ctx_of(be)->flag, part, right, 2 * B);
    k_sum_parts<<<1, 256, 0, st>>>(ctx_of(be)->partial + 1, ctx_of(be)->flag + 1, part, right, B);
    return LAUNCHED("contrastive");
}

static double cuda_contrastive_forward(const backend *be, float *logits, float *prow, float *pcol, const float *img,
                                       const float *txt, float scale, int B, int E, double *acc) {
    if (B <= 0) return NAN;
    cudaStream_t st = stream_of(be);
    if (contrastive_launch(be, logits, prow, pcol, img, txt, scale, B, E)) return NAN;
    double loss = 0;
    int both = 0, i2t = 0;
    if (fetch_scalar(be, "contrastive", &loss, &both) ||
        CK("contrastive", cudaMemcpyAsync(&i2t, ctx_of(be)->flag + 1, sizeof(int), cudaMemcpyDeviceToHost, st)) ||
        CK("contrastive", cudaStreamSynchronize(st)))
        return NAN;
    if (acc) {
        acc[0] = (double)i2t / B;
        acc[1] = (double)(both - i2t) / B;
    }
    return loss / (2.0 * B);
}

// the host's last lines of cuda_contrastive_forward, in double on the device: the same bits
__global__ static void k_contrastive_out(double *out, const double *sum, const int *right, int B) {
    out[0] = sum[0] / (2.0 * B);
    out[1] = (double)right[1] / B;
    out[2] = (double)(right[0] - right[1]) / B;
}
static void cuda_contrastive_forward_dev(const backend *be, float *logits, float *prow, float *pcol, const float *img,
                                         const float *txt, float scale, int B, int E, double *out) {
    if (B <= 0 || contrastive_launch(be, logits, prow, pcol, img, txt, scale, B, E)) return;
    k_contrastive_out<<<1, 1, 0, stream_of(be)>>>(out, ctx_of(be)->partial, ctx_of(be)->flag, B);
    LAUNCHED("contrastive");
}

// The _dsc entries: the scale in device memory. exp in double rounded to float (the host's expf
// is the by-value entries'; the two may differ in the last bit, within the table's tolerance).
__device__ static float dev_exp_scale(const float *scale) { return (float)exp((double)*scale); }
__global__ static void k_times_exp(float *x, const float *scale, size_t n) {
    const float t = dev_exp_scale(scale);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = __fmul_rn(t, x[i]);
}
__global__ static void k_put_scale(double *out, const float *scale) { *out = *scale; }
static unsigned grid_of(size_t n) { return (unsigned)(n / 256 + 1 < 1024 ? n / 256 + 1 : 1024); }

static void cuda_contrastive_forward_dsc(const backend *be, float *logits, float *prow, float *pcol, const float *img,
                                         const float *txt, const float *scale, int B, int E, double *out) {
    if (B <= 0) return;
    cudaStream_t st = stream_of(be);
    // logits = exp(scale) (img.txt^T): the product, then the factor read where it lives
    if (cu_gemm(be, "contrastive", 0, 1, B, B, E, 1.0f, img, E, txt, E, 0.0f, logits, B)) return;
    const size_t bb = (size_t)B * B;
    k_times_exp<<<grid_of(bb), 256, 0, st>>>(logits, scale, bb);
    if (LAUNCHED("contrastive")) return;
    char *ws = (char *)cu_workspace(be, (sizeof(double) + sizeof(int)) * 2 * (size_t)B, "contrastive");
    if (!ws) return;
    double *part = (double *)ws;
    int *right = (int *)(part + 2 * (size_t)B);
    k_contrastive_line<<<B, ROW_THREADS, 0, st>>>(prow, part, right, logits, B, 0);
    k_contrastive_line<<<B, ROW_THREADS, 0, st>>>(pcol, part + B, right + B, logits, B, 1);
    k_sum_parts<<<1, 256, 0, st>>>(ctx_of(be)->partial, ctx_of(be)->flag, part, right, 2 * B);
    k_sum_parts<<<1, 256, 0, st>>>(ctx_of(be)->partial + 1, ctx_of(be)->flag + 1, part, right, B);
    k_contrastive_out<<<1, 1, 0, st>>>(out, ctx_of(be)->partial, ctx_of(be)->flag, B);
    k_put_scale<<<1, 1, 0, st>>>(out + 3, scale);
    LAUNCHED("contrastive");
}

// G (B,B) = k (prow + pcol - 2 [i == j]), the gradient of the loss w.r.t. the logits; part[i] =
// row i's share of d/dscale = sum_j G_ij logits_ij (logits = exp(scale) dot)
__global__ static void k_contrastive_grad(float *G, double *part, const float *logits, const float *prow,
                                          const float *pcol, float k, int B) {
    __shared__ double sh[ROW_THREADS];
    const int i = blockIdx.x;
    double ds = 0;
    for (int j = threadIdx.x; j < B; j += blockDim.x) {
        const size_t ij = (size_t)i * B + j;
        const float g = __fmul_rn(k, __fsub_rn(__fadd_rn(prow[ij], pcol[ij]), i == j ? 2.0f : 0.0f));
        G[ij] = g;
        ds += (double)g * logits[ij];
    }
    ds = block_sum(ds, sh);
    if (threadIdx.x == 0) part[i] = ds;
}
__global__ static void k_add_scalar(float *dst, const double *v) { *dst = __fadd_rn(*dst, (float)*v); }

// dimg, dtxt (B,E) and *dscale accumulate the gradient of loss * dloss. The temperature
// t = exp(scale) is either the host's t (scale_dev NULL) or read on the device from scale_dev.
static void contrastive_backward(const backend *be, float *dimg, float *dtxt, float *dscale, const float *logits,
                                 const float *prow, const float *pcol, const float *img, const float *txt, float t,
                                 const float *scale_dev, int B, int E, double dloss) {
    if (B <= 0) return;
    cudaStream_t st = stream_of(be);
    const float k = (float)(dloss * 0.5 / B);
    const size_t gb = (sizeof(float) * (size_t)B * B + 255) & ~(size_t)255;
    char *ws = (char *)cu_workspace(be, gb + sizeof(double) * (size_t)B, "contrastive");
    if (!ws) return;
    float *G = (float *)ws;
    double *part = (double *)(ws + gb);
    k_contrastive_grad<<<B, ROW_THREADS, 0, st>>>(G, part, logits, prow, pcol, k, B);
    // with the scale on the device, G becomes t G there (its d/dscale share is summed above,
    // before the factor) and the products take alpha 1
    if (scale_dev) k_times_exp<<<grid_of((size_t)B * B), 256, 0, st>>>(G, scale_dev, (size_t)B * B), t = 1.0f;
    if (LAUNCHED("contrastive")) return;
    // dimg += t G txt; dtxt += t G^T img
    if (cu_gemm(be, "contrastive", 0, 0, B, E, B, t, G, B, txt, E, 1.0f, dimg, E) ||
        cu_gemm(be, "contrastive", 1, 0, B, E, B, t, G, B, img, E, 1.0f, dtxt, E))
        return;
    cu_sum_doubles(be, "contrastive", ctx_of(be)->partial, part, (size_t)B);
    k_add_scalar<<<1, 1, 0, st>>>(dscale, ctx_of(be)->partial);
    LAUNCHED("contrastive");
}

static void cuda_contrastive_backward(const backend *be, float *dimg, float *dtxt, float *dscale, const float *logits,
                                      const float *prow, const float *pcol, const float *img, const float *txt,
                                      float scale, int B, int E, double dloss) {
    contrastive_backward(be, dimg, dtxt, dscale, logits, prow, pcol, img, txt, expf(scale), NULL, B, E, dloss);
}

static void cuda_contrastive_backward_dsc(const backend *be, float *dimg, float *dtxt, float *dscale,
                                          const float *logits, const float *prow, const float *pcol, const float *img,
                                          const float *txt, const float *scale, int B, int E, double dloss) {
    contrastive_backward(be, dimg, dtxt, dscale, logits, prow, pcol, img, txt, 1.0f, scale, B, E, dloss);
}

// ---- masked cross-entropy: probs (n,C) = softmax(logits) (may alias logits); returns the sum of
// -log probs[label]; *correct counts rows whose argmax (ties: lower index) is the label

__global__ static void k_xent_row(float *probs, double *part, int *right, const float *logits, const int32_t *labels,
                                  int C) {
    __shared__ float shv[ROW_THREADS];
    __shared__ int shi[ROW_THREADS];
    __shared__ double shd[ROW_THREADS];
    const size_t i = blockIdx.x;
    const float *l = logits + i * C;
    const int label = labels[i];
    const double target = l[label];
    float mx = -INFINITY;
    int arg = -1;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        if (arg < 0 || l[c] > mx) mx = l[c], arg = c;
    arg = block_argmax(mx, arg, shv, shi);
    const double m = l[arg];
    double s = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += exp((double)l[c] - m);
    s = block_sum(s, shd); // every read of the row is done: probs may now overwrite it
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const double e = exp((double)l[c] - m);
        probs[i * C + c] = (float)(e / s);
    }
    if (threadIdx.x == 0) {
        part[i] = log(s) + m - target;
        right[i] = arg == label;
    }
}

static double cuda_xent_forward(const backend *be, float *probs, const float *logits, const int32_t *labels, int n,
                                int C, int *correct) {
    if (n <= 0) {
        if (correct) *correct = 0;
        return 0;
    }
    cudaStream_t st = stream_of(be);
    char *ws = (char *)cu_workspace(be, (sizeof(double) + sizeof(int)) * (size_t)n, "xent");
    if (!ws) return NAN;
    double *part = (double *)ws;
    int *right = (int *)(part + n);
    k_xent_row<<<n, ROW_THREADS, 0, st>>>(probs, part, right, logits, labels, C);
    k_sum_parts<<<1, 256, 0, st>>>(ctx_of(be)->partial, ctx_of(be)->flag, part, right, n);
    if (LAUNCHED("xent")) return NAN;
    double loss = 0;
    int right_n = 0;
    if (fetch_scalar(be, "xent", &loss, &right_n)) return NAN;
    if (correct) *correct = right_n;
    return loss;
}

// dlogits (n,C) += scale (probs - onehot(label)), in the CPU's two steps
__global__ static void k_xent_bwd(float *dlogits, const float *probs, const int32_t *labels, size_t total, int C,
                                  float k) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= total) return;
    float d = __fadd_rn(dlogits[i], __fmul_rn(k, probs[i]));
    if ((int)(i % C) == labels[i / C]) d = __fsub_rn(d, k);
    dlogits[i] = d;
}
static void cuda_xent_backward(const backend *be, float *dlogits, const float *probs, const int32_t *labels, int n,
                               int C, double scale) {
    const size_t total = (size_t)n * C;
    if (!total) return;
    k_xent_bwd<<<cu_blocks(total, 256), 256, 0, stream_of(be)>>>(dlogits, probs, labels, total, C, (float)scale);
    LAUNCHED("xent");
}

// ---- auxiliary losses of one group: src/moe/aux.c in three kernels (aux_launch): the clean
// softmax per token (k_aux_gates), the loss on one block (k_aux), the gradient through the
// softmax per token (k_aux_dl). In k_aux, loops over tokens give each thread whole tokens (rows
// of P, G, dlogits); sums over the tokens (per expert, or of a scalar) take each thread's tokens
// in order and then fold the threads' partial sums in a fixed tree (block_sum, block_sums), so
// every run gives the same bits; scalars over the experts are folded by thread 0.
// All in double, as on the CPU. (The first version walked the tokens with one thread per expert
// and folded scalars over the tokens on thread 0: 2.6 ms a launch at B/16 on an H200.)

#define AUX_THREADS 256
#define AUX_TINY 1e-30

typedef struct {
    int S, E, K;
    const float *l, *nl;   // (S,E) clean and noisy logits (nl may be NULL)
    double noise_std;
    const uint8_t *mod;    // (S) or NULL
    const int32_t *wanted; // (E) or NULL
    const int32_t *wanted_mod; // (2,E) or NULL: the switch loss per modality
    double tau[2];
    double *P, *G, *lse, *tS1, *tS2, *v[8];
    int n[2];
} aux_dev;

__device__ static inline int aux_mod(const aux_dev *c, int s) { return c->mod ? c->mod[s] : VLMOE_MOD_IMAGE; }
__device__ static inline double xlogx(double p) { return p * log(p > AUX_TINY ? p : AUX_TINY); }
__device__ static inline double logt(double p) { return log(p > AUX_TINY ? p : AUX_TINY); }
__device__ static inline double logp(const aux_dev *c, int s, int e) {
    return (double)c->l[(size_t)s * c->E + e] - c->lse[s];
}

// v from thread 0, to every thread
__device__ static double bcast(double v) {
    __shared__ double slot;
    if (threadIdx.x == 0) slot = v;
    __syncthreads();
    const double r = slot;
    __syncthreads();
    return r;
}

// The sum over the block's threads of each one's v, folded in a fixed tree order; every thread
// gets it. Every thread of the block must call it (blockDim.x == AUX_THREADS, a power of two).
__device__ static double block_sum(double v) {
    __shared__ double buf[AUX_THREADS];
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int w = AUX_THREADS / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) buf[threadIdx.x] += buf[threadIdx.x + w];
        __syncthreads();
    }
    const double r = buf[0];
    __syncthreads();
    return r;
}

// Each thread's AUX_SUM_E partial sums a[j] (each taken over its tokens in order) folded in
// block_sum's tree, all at once; thread 0 gets out[j] = sum / div for j < ne. The same bits as
// ne calls of block_sum, with one pass over the tokens instead of ne.
#define AUX_SUM_E 8
__device__ static void block_sums(const double *a, int ne, double div, double *out) {
    __shared__ double buf[AUX_SUM_E][AUX_THREADS];
    for (int j = 0; j < AUX_SUM_E; j++) buf[j][threadIdx.x] = a[j];
    __syncthreads();
    for (int w = AUX_THREADS / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w)
            for (int j = 0; j < ne; j++) buf[j][threadIdx.x] += buf[j][threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        for (int j = 0; j < ne; j++) out[j] = buf[j][0] / div;
    __syncthreads();
}

// out[e] = the sum of P[s][e] over the tokens of modality m (m < 0: all), divided by div, for
// every expert; written by thread 0 and visible to the block on return
__device__ static void aux_sum_p(const aux_dev *c, int m, double div, double *out) {
    for (int e0 = 0; e0 < c->E; e0 += AUX_SUM_E) {
        const int ne = c->E - e0 < AUX_SUM_E ? c->E - e0 : AUX_SUM_E;
        double a[AUX_SUM_E] = {0};
        for (int s = threadIdx.x; s < c->S; s += blockDim.x)
            if (m < 0 || aux_mod(c, s) == m) {
                const double *p = c->P + (size_t)s * c->E + e0;
#pragma unroll
                for (int j = 0; j < AUX_SUM_E; j++)
                    if (j < ne) a[j] += p[j];
            }
        block_sums(a, ne, div, out + e0);
    }
}

// cv2 of src/moe/aux.c (thread 0 only)
__device__ static double cv2(const double *x, int E, double *dx) {
    double m = 0, var = 0;
    for (int e = 0; e < E; e++) m += x[e];
    m /= E;
    for (int e = 0; e < E; e++) var += (x[e] - m) * (x[e] - m);
    var /= E;
    for (int e = 0; e < E; e++) dx[e] = m != 0 ? 2.0 / (E * m * m) * ((x[e] - m) - var / m) : 0;
    return m != 0 ? var / (m * m) : 0;
}

// The expert of rank k in the order (value descending, index ascending): kth_largest of aux.c.
__device__ static int kth_largest(const float *x, int E, int k) {
    for (int e = 0; e < E; e++) {
        int rank = 0;
        for (int e2 = 0; e2 < E; e2++) rank += x[e2] > x[e] || (x[e2] == x[e] && e2 < e);
        if (rank == k) return e;
    }
    return 0;
}
__device__ static int in_top(const float *x, int E, int K, int e) {
    int rank = 0;
    for (int e2 = 0; e2 < E; e2++) rank += x[e2] > x[e] || (x[e2] == x[e] && e2 < e);
    return rank < K;
}

__device__ static double aux_importance(aux_dev *c, double f) {
    double *imp = c->v[0], *dimp = c->v[1];
    aux_sum_p(c, -1, 1.0, imp);
    const double L = bcast(threadIdx.x == 0 ? cv2(imp, c->E, dimp) : 0);
    for (int s = threadIdx.x; s < c->S; s += blockDim.x)
        for (int e = 0; e < c->E; e++) c->G[(size_t)s * c->E + e] += f * dimp[e];
    __syncthreads();
    return L;
}

__device__ static double aux_load(aux_dev *c, double wf, float *dl) {
    const int S = c->S, E = c->E;
    const double sigma = c->noise_std / E;
    if (!c->nl || !(sigma > 0) || !isfinite(sigma)) return 0;
    double *thr = c->tS1, *estar = c->tS2, *load = c->v[2], *dload = c->v[3];
    for (int s = threadIdx.x; s < S; s += blockDim.x) {
        const int k = kth_largest(c->nl + (size_t)s * E, E, c->K - 1);
        estar[s] = k, thr[s] = c->nl[(size_t)s * E + k];
    }
    __syncthreads();
    for (int e0 = 0; e0 < E; e0 += AUX_SUM_E) {
        const int ne = E - e0 < AUX_SUM_E ? E - e0 : AUX_SUM_E;
        double a[AUX_SUM_E] = {0};
        for (int s = threadIdx.x; s < S; s += blockDim.x)
#pragma unroll
            for (int j = 0; j < AUX_SUM_E; j++)
                if (j < ne) {
                    const double z = (thr[s] - (double)c->l[(size_t)s * E + e0 + j]) / sigma;
                    a[j] += 0.5 * erfc(z / sqrt(2.0));
                }
        block_sums(a, ne, S, load + e0);
    }
    const double L = bcast(threadIdx.x == 0 ? cv2(load, E, dload) : 0);
    if (dl) {
        const double inv = 0.39894228040143267794; // 1/sqrt(2 pi)
        for (int s = threadIdx.x; s < S; s += blockDim.x) {
            double dthr = 0;
            for (int e = 0; e < E; e++) {
                const double z = (thr[s] - (double)c->l[(size_t)s * E + e]) / sigma;
                dthr -= dload[e] / S * inv * exp(-0.5 * z * z) / sigma;
            }
            for (int e = 0; e < E; e++) {
                const double z = (thr[s] - (double)c->l[(size_t)s * E + e]) / sigma;
                double row = dload[e] / S * inv * exp(-0.5 * z * z) / sigma;
                if (e == (int)estar[s]) row += dthr;
                dl[(size_t)s * E + e] += (float)(wf * row);
            }
        }
    }
    __syncthreads();
    return L;
}

// per modality: the sum over the modalities present of each one's mean (aux.c)
__device__ static double aux_z(aux_dev *c, double wf, float *dl) {
    double a[2] = {0, 0};
    for (int s = threadIdx.x; s < c->S; s += blockDim.x) a[aux_mod(c, s)] += c->lse[s] * c->lse[s];
    a[0] = block_sum(a[0]), a[1] = block_sum(a[1]);
    const double L = (c->n[0] ? a[0] / c->n[0] : 0) + (c->n[1] ? a[1] / c->n[1] : 0);
    if (dl)
        for (int s = threadIdx.x; s < c->S; s += blockDim.x)
            for (int e = 0; e < c->E; e++)
                dl[(size_t)s * c->E + e] +=
                    (float)(wf * 2.0 / c->n[aux_mod(c, s)] * c->lse[s] * c->P[(size_t)s * c->E + e]);
    __syncthreads();
    return L;
}

// over the tokens of modality m (m < 0: all) with counts w (E)
__device__ static double aux_switch(aux_dev *c, int m, const int32_t *w, double f) {
    const int S = c->S, E = c->E, n = m < 0 ? S : c->n[m];
    double *pm = c->v[0];
    if (!n) return 0;
    aux_sum_p(c, m, 1.0, pm);
    double L = 0;
    if (threadIdx.x == 0)
        for (int e = 0; e < E; e++) L += (double)E / ((double)c->K * n) * w[e] * pm[e] / n;
    L = bcast(L);
    for (int s = threadIdx.x; s < S; s += blockDim.x)
        if (m < 0 || aux_mod(c, s) == m)
            for (int e = 0; e < E; e++) {
                const double R = (double)E / ((double)c->K * n) * w[e];
                c->G[(size_t)s * E + e] += f * R / n;
            }
    __syncthreads();
    return L;
}

// mean over the tokens of modality m (m < 0: all) of H(p_s); 0 when there are none
__device__ static double aux_mean_token_entropy(aux_dev *c, int m) {
    double H = 0;
    for (int s = threadIdx.x; s < c->S; s += blockDim.x)
        if (m < 0 || aux_mod(c, s) == m)
            for (int e = 0; e < c->E; e++) H -= c->P[(size_t)s * c->E + e] * logp(c, s, e);
    H = block_sum(H);
    const int n = m < 0 ? c->S : c->n[m];
    return n ? H / n : 0;
}
__device__ static void aux_mean_token_entropy_grad(aux_dev *c, int m, double fg) {
    const int n = m < 0 ? c->S : c->n[m];
    if (!n || fg == 0) return;
    for (int s = threadIdx.x; s < c->S; s += blockDim.x) {
        if (m >= 0 && aux_mod(c, s) != m) continue;
        for (int e = 0; e < c->E; e++) c->G[(size_t)s * c->E + e] -= fg * (logp(c, s, e) + 1) / n;
    }
    __syncthreads();
}


__device__ static double entropy(const double *p, int E) {
    double H = 0;
    for (int e = 0; e < E; e++) H -= xlogx(p[e]);
    return H;
}

__device__ static double aux_global_entropy(aux_dev *c, int m, double tau, double f) {
    if (!c->n[m]) return 0;
    double *pbar = c->v[0]; // the mean gate over the modality's tokens
    aux_sum_p(c, m, c->n[m], pbar);
    const double L = bcast(threadIdx.x == 0 ? tau - entropy(pbar, c->E) : 0);
    if (!(L > 0)) return 0;
    double *ge = c->v[1]; // each expert's term, its logarithm taken once, not once a token
    for (int e = threadIdx.x; e < c->E; e += blockDim.x) ge[e] = f * (logt(pbar[e]) + 1) / c->n[m];
    __syncthreads();
    for (int s = threadIdx.x; s < c->S; s += blockDim.x)
        if (aux_mod(c, s) == m)
            for (int e = 0; e < c->E; e++) c->G[(size_t)s * c->E + e] += ge[e];
    __syncthreads();
    return L;
}

__device__ static double aux_mi(aux_dev *c, double f) {
    double *pb[2] = {c->v[0], c->v[1]}, *mix = c->v[2];
    const int M = (c->n[0] > 0) + (c->n[1] > 0);
    for (int m = 0; m < 2; m++)
        if (c->n[m]) aux_sum_p(c, m, c->n[m], pb[m]);
    for (int e = threadIdx.x; e < c->E; e += blockDim.x) {
        mix[e] = 0;
        for (int m = 0; m < 2; m++)
            if (c->n[m]) mix[e] += pb[m][e];
        mix[e] /= M;
    }
    __syncthreads();
    double L = 0;
    if (threadIdx.x == 0) {
        for (int m = 0; m < 2; m++)
            if (c->n[m]) L += entropy(pb[m], c->E) / M;
        L -= entropy(mix, c->E);
    }
    L = bcast(L);
    double *ge[2] = {c->v[3], c->v[4]}; // each (modality, expert)'s term, computed once
    for (int e = threadIdx.x; e < c->E; e += blockDim.x)
        for (int m = 0; m < 2; m++)
            if (c->n[m]) ge[m][e] = f * (logt(mix[e]) - logt(pb[m][e])) / ((double)M * c->n[m]);
    __syncthreads();
    for (int s = threadIdx.x; s < c->S; s += blockDim.x) {
        const int m = aux_mod(c, s);
        for (int e = 0; e < c->E; e++)
            c->G[(size_t)s * c->E + e] += ge[m][e];
    }
    __syncthreads();
    return L;
}

// over the tokens of modality m
__device__ static double aux_merged(aux_dev *c, int m, double f) {
    const int S = c->S, E = c->E, K = c->K, n = c->n[m];
    if (!n) return 0;
    double H = 0; // this thread's tokens' sum of q log q + r log r
    for (int s = threadIdx.x; s < S; s += blockDim.x) {
        if (aux_mod(c, s) != m) continue;
        const float *ls = c->l + (size_t)s * E;
        const double *p = c->P + (size_t)s * E;
        double q = 0, r = 0;
        for (int e = 0; e < E; e++) {
            if (in_top(ls, E, K, e)) q += p[e];
            else r += p[e];
        }
        H += xlogx(q) + xlogx(r);
        const double gq = -(logt(q) + 1) / n, gr = -(logt(r) + 1) / n;
        for (int e = 0; e < E; e++) c->G[(size_t)s * E + e] += f * (in_top(ls, E, K, e) ? gq : gr);
    }
    return -block_sum(H) / n; // its syncs also order the writes to G above
}

// *loss = the loss of `kind`; dl ACCUMULATES weight d(loss)/d(logits) when given. A modality
// other than 0/1 leaves everything untouched and stores 1 + the first such token in *bad.
__global__ static void k_aux(int kind, aux_dev c, double weight, float *dl, double *loss, int *bad) {
    __shared__ int n[2], first_bad;
    const int S = c.S, E = c.E;
    if (threadIdx.x == 0) n[0] = n[1] = 0, first_bad = S;
    __syncthreads();
    for (int s = threadIdx.x; s < S; s += blockDim.x) {
        const int m = aux_mod(&c, s);
        if (m != VLMOE_MOD_IMAGE && m != VLMOE_MOD_TEXT) atomicMin(&first_bad, s);
        else atomicAdd(&n[m], 1); // integer counts: the same whatever the order
    }
    __syncthreads();
    if (first_bad < S) {
        if (threadIdx.x == 0) *bad = 1 + first_bad, *loss = NAN;
        return;
    }
    c.n[0] = n[0], c.n[1] = n[1];
    double L = 0;
    switch (kind) {
    case VLMOE_AUX_IMPORTANCE: L = aux_importance(&c, 1); break;
    case VLMOE_AUX_LOAD: L = aux_load(&c, weight, dl); break;
    case VLMOE_AUX_VLOSS: {
        const double li = aux_importance(&c, 0.5);
        L = 0.5 * li + 0.5 * aux_load(&c, 0.5 * weight, dl);
        break;
    }
    case VLMOE_AUX_ZLOSS: L = aux_z(&c, weight, dl); break;
    case VLMOE_AUX_SWITCH:
        if (c.n[0] && c.n[1]) L = aux_switch(&c, VLMOE_MOD_IMAGE, c.wanted_mod, 1) + aux_switch(&c, VLMOE_MOD_TEXT, c.wanted_mod + E, 1);
        else L = aux_switch(&c, -1, c.wanted, 1);
        break;
    case VLMOE_AUX_LOCAL_ENT_IMAGE:
    case VLMOE_AUX_LOCAL_ENT_TEXT: {
        const int m = kind == VLMOE_AUX_LOCAL_ENT_TEXT ? VLMOE_MOD_TEXT : VLMOE_MOD_IMAGE;
        L = aux_mean_token_entropy(&c, m);
        aux_mean_token_entropy_grad(&c, m, 1);
        break;
    }
    case VLMOE_AUX_GLOBAL_ENT_IMAGE: L = aux_global_entropy(&c, VLMOE_MOD_IMAGE, c.tau[VLMOE_MOD_IMAGE], 1); break;
    case VLMOE_AUX_GLOBAL_ENT_TEXT: L = aux_global_entropy(&c, VLMOE_MOD_TEXT, c.tau[VLMOE_MOD_TEXT], 1); break;
    case VLMOE_AUX_MI: L = aux_mi(&c, 1); break;
    case VLMOE_AUX_TARGET_ENT: { // over the text tokens (LIMoE E.1, aux.c)
        if (!c.n[VLMOE_MOD_TEXT]) break;
        const double local = aux_mean_token_entropy(&c, VLMOE_MOD_TEXT), t = log((double)c.K) - local;
        L = t * t;
        aux_mean_token_entropy_grad(&c, VLMOE_MOD_TEXT, -2 * t);
        break;
    }
    case VLMOE_AUX_MERGED_ENT: L = aux_merged(&c, VLMOE_MOD_TEXT, 1); break;
    default: break;
    }
    if (threadIdx.x == 0) *loss = L, *bad = 0;
}

// Before k_aux, on as many blocks as the tokens need (each token's row alone): the clean gates in
// double, P = exp(l - logsumexp(l)), unless the scratch holds them (AUX_KEPT_P); G zeroed.
__global__ static void k_aux_gates(aux_dev c, int kept) {
    const int S = c.S, E = c.E;
    for (int s = blockIdx.x * blockDim.x + threadIdx.x; s < S; s += gridDim.x * blockDim.x) {
        const float *ls = c.l + (size_t)s * E;
        if (!kept) {
            double mx = ls[0], sum = 0;
            for (int e = 1; e < E; e++) mx = ls[e] > mx ? ls[e] : mx;
            for (int e = 0; e < E; e++) sum += exp((double)ls[e] - mx);
            c.lse[s] = mx + log(sum);
            for (int e = 0; e < E; e++) c.P[(size_t)s * E + e] = exp((double)ls[e] - c.lse[s]);
        }
        for (int e = 0; e < E; e++) c.G[(size_t)s * E + e] = 0;
    }
}

// After k_aux, likewise per token: the gradients k_aux collected w.r.t. P go through the
// softmax, dl_j += weight P_j (G_j - sum_e G_e P_e); nothing when k_aux found a bad modality.
__global__ static void k_aux_dl(aux_dev c, double weight, float *dl, const int *bad) {
    const int S = c.S, E = c.E;
    if (*bad) return;
    for (int s = blockIdx.x * blockDim.x + threadIdx.x; s < S; s += gridDim.x * blockDim.x) {
        const double *p = c.P + (size_t)s * E, *g = c.G + (size_t)s * E;
        double dot = 0;
        for (int e = 0; e < E; e++) dot += g[e] * p[e];
        for (int e = 0; e < E; e++) dl[(size_t)s * E + e] += (float)(weight * p[e] * (g[e] - dot));
    }
}

// The arguments are checked as aux_loss_f32 checks them (same messages), and k_aux's view of
// them is planned: the pointers in `in` and scratch are device memory (scratch:
// aux_scratch_floats(S,E) floats, aux.c's doubles aligned up to double). 0 on success.
static int aux_plan(vlmoe_aux_kind kind, const aux_input_f32 *in, float *scratch, aux_dev *c) {
    if (!in || !in->logits || !scratch) {
        vlmoe_fail(VLMOE_ERR_ARG, "aux loss: input, logits and scratch must be given");
        return 1;
    }
    const int S = in->S, E = in->E, K = in->K;
    if (S < 1 || E < 1 || K < 1 || K > E || (int)kind < 0 || (int)kind >= VLMOE_AUX_COUNT) {
        vlmoe_fail(VLMOE_ERR_ARG, "aux loss %d: need S >= 1, E >= 1, 1 <= K <= E (got S=%d E=%d K=%d)", (int)kind, S,
                   E, K);
        return 1;
    }
    if (kind == VLMOE_AUX_SWITCH && (!in->wanted || (in->modality && !in->wanted_mod))) {
        vlmoe_fail(VLMOE_ERR_ARG, "aux loss switch: the per-expert counts `wanted` (and `wanted_mod` with "
                   "modalities) must be given");
        return 1;
    }
    *c = aux_dev{};
    c->S = S, c->E = E, c->K = K, c->l = in->logits, c->nl = in->noisy_logits, c->noise_std = in->noise_std;
    c->mod = in->modality, c->wanted = in->wanted, c->wanted_mod = in->wanted_mod;
    c->tau[0] = in->global_tau[0], c->tau[1] = in->global_tau[1];
    const uintptr_t a = ((uintptr_t)scratch + (sizeof(double) - 1)) & ~(uintptr_t)(sizeof(double) - 1);
    double *d = (double *)a;
    const size_t SE = (size_t)S * E;
    c->P = d, c->G = d + SE, c->lse = d + 2 * SE, c->tS1 = c->lse + S, c->tS2 = c->tS1 + S;
    for (int i = 0; i < 8; i++) c->v[i] = c->tS2 + S + (size_t)i * E;
    return 0;
}

// The three kernels of one loss on one group: the per-token gates, the loss on one block, the
// per-token gradient; the value into *loss, a bad modality into x->flag. 0 when launched.
static int aux_launch(cuda_ctx *x, vlmoe_aux_kind kind, const aux_dev *c, int kept, double weight, float *dl,
                      double *loss) {
    const unsigned nb = cu_blocks((size_t)c->S, 256);
    k_aux_gates<<<nb, 256, 0, x->stream>>>(*c, (kept & AUX_KEPT_P) != 0);
    if (LAUNCHED("aux_loss")) return 1;
    k_aux<<<1, AUX_THREADS, 0, x->stream>>>((int)kind, *c, weight, dl, loss, x->flag);
    if (LAUNCHED("aux_loss")) return 1;
    if (!dl) return 0;
    k_aux_dl<<<nb, 256, 0, x->stream>>>(*c, weight, dl, x->flag);
    return LAUNCHED("aux_loss");
}

static double cuda_aux_loss(const backend *be, vlmoe_aux_kind kind, const aux_input_f32 *in, double weight,
                            float *dlogits, float *scratch) {
    aux_dev c;
    if (aux_plan(kind, in, scratch, &c)) return NAN;
    cuda_ctx *x = ctx_of(be);
    if (aux_launch(x, kind, &c, in->kept, weight, dlogits, x->partial)) return NAN;
    // the backward's value goes unused (src/ops/backend.h): no wait for the device, one host sync
    // less per group and loss
    if (dlogits) return 0;
    double L = NAN;
    int bad = 0;
    if (fetch_scalar(be, "aux_loss", &L, &bad)) return NAN;
    if (bad) {
        vlmoe_fail(VLMOE_ERR_ARG, "aux loss %s: modality[%d] is not image (0) or text (1)", vlmoe_aux_name(kind),
                   bad - 1);
        return NAN;
    }
    return L;
}

// aux_loss_dev: k_aux writes the value straight into out; a bad modality leaves NaN there (no
// wait to report it: the step's finite check stops the step).
static void cuda_aux_loss_dev(const backend *be, vlmoe_aux_kind kind, const aux_input_f32 *in, float *scratch,
                              double *out) {
    aux_dev c;
    if (!out) {
        vlmoe_fail(VLMOE_ERR_ARG, "aux loss: out must be given");
        return;
    }
    if (aux_plan(kind, in, scratch, &c)) return;
    aux_launch(ctx_of(be), kind, &c, in->kept, 1.0, NULL, out);
}

void cuda_fill_loss(backend *be) {
    be->contrastive_forward = cuda_contrastive_forward;
    be->contrastive_forward_dev = cuda_contrastive_forward_dev;
    be->contrastive_backward = cuda_contrastive_backward;
    be->xent_forward = cuda_xent_forward;
    be->xent_backward = cuda_xent_backward;
    be->aux_loss = cuda_aux_loss;
    be->aux_loss_dev = cuda_aux_loss_dev;
    be->contrastive_forward_dsc = cuda_contrastive_forward_dsc;
    be->contrastive_backward_dsc = cuda_contrastive_backward_dsc;
}
