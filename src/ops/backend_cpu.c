// backend_cpu.c: the CPU backend table (src/ops/backend.h). Each op forwards to the kernel of
// src/ops, src/loss, src/moe; memory is host memory, so upload, download and copy are memcpy.
// The MoE dispatch loops, the router noise and the trainer's flat-buffer ops live here. Compiled
// for float (the library's path) and double (the reference tests/test_backend_ops.c compares
// against), see src/core/real.h.
#include <math.h>
#include <omp.h>
#include <string.h>

#include "core/real.h"
#include "core/core.h"
#include "core/prof.h"
#include "loss/masked.h"
#include "ops/backend.h"
#include "ops/gemm_bf16.h"
#include "ops/gemm_int8.h"
#include "moe/route_op.h"

typedef struct R(vlmoe_backend) backend;

// Parallel loops only where the work pays for waking the threads (src/optim/optim.c's value).
#define PAR_MIN 32768
// Fixed chunks of a reduction: the sum's bits do not depend on the thread count.
#define NCHUNK 64

static int cpu_supports(const backend *be, be_op op, const void *cfg) {
    // the fixed-capacity layout (be_route.fixed) is written when asked, never wanted: its padding
    // rows would cost the expert bank CPU time for nothing
    if (op == BE_OP_ROUTE && cfg && ((const be_route *)cfg)->fixed) return 0;
    return op >= 0 && op < BE_OP_COUNT;
}

static void *cpu_alloc(const backend *be, size_t bytes, const char *what) {
    return vlmoe_calloc(bytes + 64, what);
}
static void cpu_free(const backend *be, void *p) { vlmoe_free_mem(p); }
// Passes over large arrays are split across the threads, each a contiguous share of whole
// 64-byte lines: a 5.3 MB copy (bench-s's residual stream) took 505 us on one Zen 3 thread and
// 158-182 on two. Below MEM_PAR elements, or inside a parallel region, one thread; else at most
// one thread per MEM_PAR / 4 elements (many threads' start-up would cost a small array more
// than they save). Each element is written as alone, so the values do not depend on the split.
enum { MEM_PAR = 1 << 16 };
static int mem_threads(size_t n) {
    if (n < MEM_PAR || omp_in_parallel()) return 1;
    const size_t most = n / (MEM_PAR / 4), nt = (size_t)omp_get_max_threads();
    return (int)(nt < most ? nt : most);
}
// thread t's share [*o, *e) of n elements out of nt shares, in 16-float steps
static void mem_share(size_t n, int t, int nt, size_t *o, size_t *e) {
    const size_t lines = (n + 15) / 16;
    *o = lines * t / nt * 16, *e = lines * (t + 1) / nt * 16;
    *o = *o < n ? *o : n, *e = *e < n ? *e : n;
}
// one pass's work on elements [o, e)
typedef void (*mem_range)(real *dst, const real *src, size_t o, size_t e);
static void copy_range(real *dst, const real *src, size_t o, size_t e) { memcpy(dst + o, src + o, sizeof(real) * (e - o)); }
static void zero_range(real *dst, const real *src, size_t o, size_t e) { memset(dst + o, 0, sizeof(real) * (e - o)); }
// `omp simd`: GCC's -O2 cost model leaves a loop of unknown length scalar; elementwise, so the
// vector loop gives the scalar loop's bits (likewise scale and clamp below)
static void add_range(real *dst, const real *src, size_t o, size_t e) {
#pragma omp simd
    for (size_t i = o; i < e; i++) dst[i] += src[i];
}
static void mem_pass(real *dst, const real *src, size_t n, mem_range fn) {
    const int nt = mem_threads(n);
    PROF_SCOPE(PROF_MEMORY) {
        if (nt == 1) fn(dst, src, 0, n);
        else {
#pragma omp parallel for schedule(static) num_threads(nt)
            for (int t = 0; t < nt; t++) {
                size_t o, e;
                mem_share(n, t, nt, &o, &e);
                if (e > o) fn(dst, src, o, e);
            }
        }
    }
}
// upload, download and copy alike: the table's memory is the host's
static void cpu_memcpy(const backend *be, real *dst, const real *src, size_t n) {
    if (n && dst != src) mem_pass(dst, src, n, copy_range);
}
static void cpu_upload_bytes(const backend *be, void *dst, const void *src, size_t n) {
    if (n && dst != src) PROF_SCOPE(PROF_MEMORY) memcpy(dst, src, n);
}
static void cpu_zero(const backend *be, real *p, size_t n) {
    if (n) mem_pass(p, NULL, n, zero_range);
}
static void cpu_add(const backend *be, real *dst, const real *src, size_t n) {
    if (n) mem_pass(dst, src, n, add_range);
}
static int cpu_sync(const backend *be) { return VLMOE_OK; }

// ---- the kernels of src/ops/ops.h
static void cpu_linear_forward(const backend *be, real *out, const real *inp, const real *w,
                               const real *b, int N, int K, int O, int beta) {
    PROF_SCOPE(PROF_OTHER) R(linear_forward)(out, inp, w, b, N, K, O, beta);
}
static void cpu_linear_backward(const backend *be, real *dinp, real *dw, real *db, const real *dout,
                                const real *inp, const real *w, int N, int K, int O) {
    PROF_SCOPE(PROF_OTHER) R(linear_backward)(dinp, dw, db, dout, inp, w, N, K, O);
}
static void cpu_linear_backward_write(const backend *be, real *dinp, real *dw, real *db, const real *dout,
                                      const real *inp, const real *w, int N, int K, int O) {
    PROF_SCOPE(PROF_OTHER) R(linear_backward_write)(dinp, dw, db, dout, inp, w, N, K, O);
}
static void cpu_layernorm_forward(const backend *be, real *out, real *mean, real *rstd,
                                  const real *inp, const real *w, const real *b, int N, int C,
                                  double eps) {
    PROF_SCOPE(PROF_LAYERNORM) R(layernorm_forward)(out, mean, rstd, inp, w, b, N, C, eps);
}
static void cpu_layernorm_recompute(const backend *be, real *out, const real *inp, const real *w,
                                    const real *b, const real *mean, const real *rstd, int N, int C) {
    PROF_SCOPE(PROF_LAYERNORM) R(layernorm_recompute)(out, inp, w, b, mean, rstd, N, C);
}
static void cpu_layernorm_backward(const backend *be, real *dinp, real *dw, real *db,
                                   const real *dout, const real *inp, const real *w,
                                   const real *mean, const real *rstd, int N, int C) {
    PROF_SCOPE(PROF_LAYERNORM) R(layernorm_backward)(dinp, dw, db, dout, inp, w, mean, rstd, N, C);
}
static void cpu_act_forward(const backend *be, real *out, const real *inp, size_t n, int kind) {
    PROF_SCOPE(PROF_GELU) R(act_forward)(out, inp, n, kind);
}
static void cpu_act_backward(const backend *be, real *dinp, const real *inp, const real *dout,
                             size_t n, int kind) {
    PROF_SCOPE(PROF_GELU) R(act_backward)(dinp, inp, dout, n, kind);
}
static void cpu_softmax_forward(const backend *be, real *out, const real *inp, int N, int C) {
    PROF_SCOPE(PROF_ROUTING) R(softmax_forward)(out, inp, N, C);
}
static void cpu_softmax_backward(const backend *be, real *dinp, const real *out, const real *dout,
                                 int N, int C) {
    PROF_SCOPE(PROF_ROUTING) R(softmax_backward)(dinp, out, dout, N, C);
}
static void cpu_attention_forward(const backend *be, real *out, real *att, const real *qkv,
                                  const attn_segment *seg, int D, int H) {
    PROF_SCOPE(PROF_ATTENTION) R(attention_forward)(out, att, qkv, seg, D, H);
}
static void cpu_attention_backward(const backend *be, real *dqkv, real *datt, const real *dout,
                                   const real *qkv, const real *att, const attn_segment *seg, int D,
                                   int H) {
    PROF_SCOPE(PROF_ATTENTION) R(attention_backward)(dqkv, datt, dout, qkv, att, seg, D, H);
}
static void cpu_patchify_forward(const backend *be, real *patches, const real *images, int B, int C,
                                 int HW, int P) {
    PROF_SCOPE(PROF_DATA) R(patchify_forward)(patches, images, B, C, HW, P);
}
static void cpu_patchify_backward(const backend *be, real *dimages, const real *dpatches, int B,
                                  int C, int HW, int P) {
    PROF_SCOPE(PROF_DATA) R(patchify_backward)(dimages, dpatches, B, C, HW, P);
}
static void cpu_embed_forward(const backend *be, real *out, const int32_t *ids, const real *wte,
                              int BT, int D) {
    PROF_SCOPE(PROF_DATA) R(embed_forward)(out, ids, wte, BT, D);
}
static void cpu_embed_backward(const backend *be, real *dwte, const real *dout, const int32_t *ids,
                               int BT, int D) {
    PROF_SCOPE(PROF_DATA) R(embed_backward)(dwte, dout, ids, BT, D);
}
static void cpu_posadd_forward(const backend *be, real *out, const real *pos, int B, int T_, int D) {
    PROF_SCOPE(PROF_DATA) R(posadd_forward)(out, pos, B, T_, D);
}
static void cpu_posadd_backward(const backend *be, real *dpos, const real *dout, int B, int T_,
                                int D) {
    PROF_SCOPE(PROF_DATA) R(posadd_backward)(dpos, dout, B, T_, D);
}
static void cpu_cls_forward(const backend *be, real *out, const real *cls, const real *x, int B,
                            int N, int D) {
    PROF_SCOPE(PROF_DATA) R(cls_forward)(out, cls, x, B, N, D);
}
static void cpu_cls_backward(const backend *be, real *dcls, real *dx, const real *dout, int B,
                             int N, int D) {
    PROF_SCOPE(PROF_DATA) R(cls_backward)(dcls, dx, dout, B, N, D);
}
static void cpu_pool_forward(const backend *be, real *out, const real *x, const int32_t *lens,
                             int B, int T_, int D, int kind) {
    PROF_SCOPE(PROF_DATA) R(pool_forward)(out, x, lens, B, T_, D, kind);
}
static void cpu_pool_backward(const backend *be, real *dx, const real *dout, const int32_t *lens,
                              int B, int T_, int D, int kind) {
    PROF_SCOPE(PROF_DATA) R(pool_backward)(dx, dout, lens, B, T_, D, kind);
}
static void cpu_l2norm_forward(const backend *be, real *out, real *norm, const real *x, int N, int C) {
    PROF_SCOPE(PROF_LOSS) R(l2norm_forward)(out, norm, x, N, C);
}
static void cpu_l2norm_backward(const backend *be, real *dx, const real *dout, const real *out,
                                const real *norm, int N, int C) {
    PROF_SCOPE(PROF_LOSS) R(l2norm_backward)(dx, dout, out, norm, N, C);
}
static double cpu_contrastive_forward(const backend *be, real *logits, real *prow, real *pcol,
                                      const real *img, const real *txt, real scale, int B, int E,
                                      double *acc) {
    double r;
    PROF_SCOPE(PROF_LOSS) r = R(contrastive_forward)(logits, prow, pcol, img, txt, scale, B, E, acc);
    return r;
}
static void cpu_contrastive_backward(const backend *be, real *dimg, real *dtxt, real *dscale,
                                     const real *logits, const real *prow, const real *pcol,
                                     const real *img, const real *txt, real scale, int B, int E,
                                     double dloss) {
    PROF_SCOPE(PROF_LOSS) R(contrastive_backward)(dimg, dtxt, dscale, logits, prow, pcol, img, txt, scale, B, E, dloss);
}
static double cpu_xent_forward(const backend *be, real *probs, const real *logits,
                               const int32_t *labels, int n, int C, int *correct) {
    double r;
    PROF_SCOPE(PROF_LOSS) r = R(xent_forward)(probs, logits, labels, n, C, correct);
    return r;
}
static void cpu_xent_backward(const backend *be, real *dlogits, const real *probs,
                              const int32_t *labels, int n, int C, double scale) {
    PROF_SCOPE(PROF_LOSS) R(xent_backward)(dlogits, probs, labels, n, C, scale);
}

// ---- MoE dispatch: one thread per output row or token, so no atomics and the same bits for any
// thread count
static void cpu_gather_rows(const backend *be, real *dst, const real *src, const int32_t *idx,
                            int rows, int D) {
    PROF_SCOPE(PROF_DISPATCH) {
#pragma omp parallel for schedule(static) if ((size_t)rows * D >= PAR_MIN)
        for (int r = 0; r < rows; r++) // -1: a padding row of the fixed layout
            if (idx[r] < 0)
                memset(dst + (size_t)r * D, 0, sizeof(real) * D);
            else
                memcpy(dst + (size_t)r * D, src + (size_t)idx[r] * D, sizeof(real) * D);
    }
}

static void cpu_combine_forward(const backend *be, real *out, const real *y, const real *w,
                                const be_dispatch *d, int D) {
    PROF_SCOPE(PROF_DISPATCH) {
#pragma omp parallel for schedule(static) if ((size_t)d->n * D >= PAR_MIN)
        for (int t = 0; t < d->n; t++) {
            real *o = out + (size_t)t * D;
            for (int j = d->tok_off[t]; j < d->tok_off[t + 1]; j++) {
                const int r = d->tok_rows[j];
                const real wr = w[r], *yr = y + (size_t)r * D;
#pragma omp simd
                for (int k = 0; k < D; k++) o[k] += wr * yr[k];
            }
        }
    }
}

static void cpu_combine_backward(const backend *be, real *dy, real *dw, const real *dout,
                                 const real *y, const real *w, const be_dispatch *d, int D) {
    PROF_SCOPE(PROF_DISPATCH) {
#pragma omp parallel for schedule(static) if ((size_t)d->rows * D >= PAR_MIN)
        for (int r = 0; r < d->rows; r++) {
            real *dyr = dy + (size_t)r * D, dot = 0;
            if (d->row_token[r] < 0) { // a padding row: no token, so no gradient into its expert
                memset(dyr, 0, sizeof(real) * D);
                dw[r] = 0;
                continue;
            }
            const real *g = dout + (size_t)d->row_token[r] * D, *yr = y + (size_t)r * D;
#pragma omp simd
            for (int k = 0; k < D; k++) dyr[k] = w[r] * g[k];
            // in the vector lanes, then their total: a fixed order (the binary's), whatever the
            // thread count; one chain of D dependent adds was most of this op's time
#pragma omp simd reduction(+ : dot)
            for (int k = 0; k < D; k++) dot += g[k] * yr[k];
            dw[r] = dot;
        }
    }
}

static void cpu_gather_rows_backward(const backend *be, real *dx, const real *dxp,
                                     const be_dispatch *d, int D) {
    PROF_SCOPE(PROF_DISPATCH) {
#pragma omp parallel for schedule(static) if ((size_t)d->n * D >= PAR_MIN)
        for (int t = 0; t < d->n; t++) {
            real *o = dx + (size_t)t * D;
            for (int j = d->tok_off[t]; j < d->tok_off[t + 1]; j++) {
                const real *g = dxp + (size_t)d->tok_rows[j] * D;
#pragma omp simd
                for (int k = 0; k < D; k++) o[k] += g[k];
            }
        }
    }
}

static void cpu_combine_weights(const backend *be, real *w, real *zsum, const real *gates,
                                const be_dispatch *d, int renorm) {
    PROF_SCOPE(PROF_ROUTING) {
        const int E = d->E;
        if (renorm)
            for (int t = 0; t < d->n; t++) {
                real z = 0;
                for (int j = d->tok_off[t]; j < d->tok_off[t + 1]; j++)
                    z += gates[(size_t)t * E + d->row_expert[d->tok_rows[j]]];
                zsum[t] = z;
            }
        for (int r = 0; r < d->rows; r++) {
            const int t = d->row_token[r];
            if (t < 0) { // a padding row
                w[r] = 0;
                continue;
            }
            const real g = gates[(size_t)t * E + d->row_expert[r]];
            w[r] = renorm ? g / zsum[t] : g;
        }
    }
}

// With renorm, w_r = g_e / Z where Z sums the token's accepted gates: dw_r reaches every
// accepted gate e2 of the token as dw_r (delta(e2,e)/Z - g_e/Z^2). Rows of a token are visited
// in row order, so each dgates element sums its terms in one fixed order.
static void cpu_combine_weights_backward(const backend *be, real *dgates, const real *dw,
                                         const real *gates, const real *zsum, const be_dispatch *d,
                                         int renorm) {
    PROF_SCOPE(PROF_ROUTING) {
        const int E = d->E;
        for (int t = 0; t < d->n; t++)
            for (int j = d->tok_off[t]; j < d->tok_off[t + 1]; j++) {
                const int r = d->tok_rows[j], e = d->row_expert[r];
                if (!renorm) {
                    dgates[(size_t)t * E + e] += dw[r];
                    continue;
                }
                const real z = zsum[t], ge = gates[(size_t)t * E + e];
                for (int j2 = d->tok_off[t]; j2 < d->tok_off[t + 1]; j2++) {
                    const int e2 = d->row_expert[d->tok_rows[j2]];
                    dgates[(size_t)t * E + e2] += dw[r] * ((e2 == e ? 1 / z : 0) - ge / (z * z));
                }
            }
    }
}

static void cpu_router_noise(const backend *be, real *noisy, const real *logits, int n, int E,
                             const be_noise *nz) {
    PROF_SCOPE(PROF_ROUTING) {
        const uint64_t base = vlmoe_mix64(nz->seed);
#pragma omp parallel for schedule(static) if ((size_t)n * E >= PAR_MIN)
        for (int t = 0; t < n; t++) {
            const uint64_t h = vlmoe_mix64(base ^ nz->key[t]);
            for (int e = 0; e < E; e++) {
                const size_t i = (size_t)t * E + e;
                noisy[i] = logits[i] + (real)(nz->sigma * vlmoe_normal_at(h, (uint64_t)e));
            }
        }
    }
}

static double cpu_aux_loss(const backend *be, vlmoe_aux_kind kind, const R(aux_input) *in,
                           double weight, real *dlogits, real *scratch) {
    double r;
    PROF_SCOPE(PROF_LOSS) r = R(aux_loss)(kind, in, weight, dlogits, scratch);
    return r;
}
static void cpu_soft_moe_forward(const backend *be, real *out, real *acts, const real *x,
                                 const R(soft_params) *p, const soft_dims *d) {
    PROF_SCOPE(PROF_DISPATCH) R(soft_moe_forward)(out, acts, x, p, d);
}
static void cpu_soft_moe_backward(const backend *be, real *dx, const R(soft_grads) *g,
                                  const real *dout, const real *acts, const real *x,
                                  const R(soft_params) *p, const soft_dims *d, real *scratch) {
    PROF_SCOPE(PROF_DISPATCH) R(soft_moe_backward)(dx, g, dout, acts, x, p, d, scratch);
}

// The products of a table: fp32 ones (R(linear_*)) or, for the cpu-bf16 table, bf16 ones;
// fwd_act and bwd_act are an MLP's first layer and its activation fused (src/ops/ops.h).
typedef struct {
    void (*fwd)(real *out, const real *inp, const real *w, const real *b, int N, int K, int O, int beta);
    void (*bwd)(real *dinp, real *dw, real *db, const real *dout, const real *inp, const real *w, int N,
                int K, int O);
    void (*fwd_act)(real *h, real *a, const real *inp, const real *w, const real *b, int N, int K, int O,
                    int act);
    void (*bwd_act)(real *dh, real *a, real *dw, real *db, const real *dy, const real *h, const real *w,
                    int N, int M, int O, int act);
    void (*bwd_write)(real *dinp, real *dw, real *db, const real *dout, const real *inp, const real *w, int N,
                      int K, int O); // bwd writing dinp (linear_backward_write)
    // fwd_act then fwd in one (mlp_forward_bf16: the second reads the first's rounded output), or NULL
    void (*mlp_fwd)(real *y, real *h, real *a, const real *x, const real *const w[4], int N, int D, int M, int act,
                    int beta);
} products;
static const products full = {.fwd = R(linear_forward), .bwd = R(linear_backward), .fwd_act = R(linear_act_forward),
                              .bwd_act = R(act_linear_backward), .bwd_write = R(linear_backward_write)};

// Experts side_by_side orders (a stack array): past this many, one at a time
enum { SIDE_MAX = 256 };

// The experts with rows, largest first (ties in expert order), into order (SIDE_MAX); their
// count, or 0 when they are better run one at a time with all threads in each product: fewer
// than two experts a thread, one thread, a parallel region already open, nested regions allowed
// (each product would start a team of its own), a table other than fp32's (`full`), or more
// than SIDE_MAX experts.
static int side_by_side(const products *pr, const be_experts *ex, int *order) {
    const int T = omp_get_max_threads();
    if (pr != &full || T < 2 || ex->E > SIDE_MAX || omp_in_parallel() || omp_get_max_active_levels() > 1) return 0;
    int n = 0;
    for (int e = 0; e < ex->E; e++) {
        const int k = ex->off[e + 1] - ex->off[e];
        if (k <= 0) continue;
        int i = n++;
        for (; i > 0 && ex->off[order[i - 1] + 1] - ex->off[order[i - 1]] < k; i--) order[i] = order[i - 1];
        order[i] = e;
    }
    return n >= 2 * T ? n : 0;
}

// One expert's MLP forward over its k rows at offset o
static void expert_forward(const products *pr, real *y, real *h, real *a, const real *x, const real *const w[4],
                           const be_experts *ex, int e, int beta) {
    const int D = ex->D, M = ex->M;
    const size_t o = (size_t)ex->off[e];
    const int k = ex->off[e + 1] - ex->off[e];
    if (k <= 0) return;
    const real *const we[4] = {w[0] + (size_t)e * M * D, w[1] + (size_t)e * M, w[2] + (size_t)e * D * M,
                               w[3] + (size_t)e * D};
    if (pr->mlp_fwd) {
        pr->mlp_fwd(y + o * D, h + o * M, a + o * M, x + o * D, we, k, D, M, ex->act, beta);
        return;
    }
    pr->fwd_act(h + o * M, a + o * M, x + o * D, we[0], we[1], k, D, M, ex->act);
    pr->fwd(y + o * D, a + o * M, we[2], we[3], k, M, D, beta);
}

// One expert's MLP backward: dh written whole by the fused product, da the recomputed
// activations; dx's rows accumulated into or, with write, written
static void expert_backward(const products *pr, real *dx, real *const dw[4], const real *dy, const real *x,
                            const real *h, const real *const w[4], real *da, real *dh, const be_experts *ex, int e,
                            int write) {
    const int D = ex->D, M = ex->M;
    const size_t o = (size_t)ex->off[e];
    const int k = ex->off[e + 1] - ex->off[e];
    if (k <= 0) return;
    real *dhe = dh + o * M;
    pr->bwd_act(dhe, da + o * M, dw[2] + (size_t)e * D * M, dw[3] + (size_t)e * D, dy + o * D, h + o * M,
                w[2] + (size_t)e * D * M, k, M, D, ex->act);
    (write ? pr->bwd_write : pr->bwd)(dx + o * D, dw[0] + (size_t)e * M * D, dw[1] + (size_t)e * M, dhe, x + o * D,
                                      w[0] + (size_t)e * M * D, k, D, M);
}

// The experts' MLPs: where side_by_side says so, whole experts handed to threads as they free
// up, largest first, each expert's products on its thread alone (their regions nested, so one
// thread each); else one expert at a time in expert order, all threads in each product, the
// same kernel calls a dense MLP makes. An element's value does not depend on the thread count
// (src/ops/ops.c), so both give the same bits. Experts' rows and weights are disjoint, so
// threads write apart. On bench-s (8 experts of some 520 image or 128 text rows, 2 threads) each
// expert's products had been split in two and ended at a barrier, with half the threads idle at
// the small ones. The bias and activation run inside the first product (the GELU's time counts
// as the products').
static void experts_forward(const products *pr, real *y, real *h, real *a, const real *x,
                            const real *const w[4], const be_experts *ex, int beta) {
    int order[SIDE_MAX];
    const int n = side_by_side(pr, ex, order);
    if (n) {
        PROF_SCOPE(PROF_MATMUL) {
#pragma omp parallel for schedule(dynamic, 1)
            for (int i = 0; i < n; i++) expert_forward(pr, y, h, a, x, w, ex, order[i], beta);
        }
    } else {
        PROF_SCOPE(PROF_OTHER) {
            for (int e = 0; e < ex->E; e++) expert_forward(pr, y, h, a, x, w, ex, e, beta);
        }
    }
}

static void experts_backward(const products *pr, real *dx, real *const dw[4], const real *dy,
                             const real *x, const real *h, const real *const w[4], real *da,
                             real *dh, const be_experts *ex, int write) {
    int order[SIDE_MAX];
    const int n = side_by_side(pr, ex, order);
    if (n) {
        PROF_SCOPE(PROF_MATMUL) {
#pragma omp parallel for schedule(dynamic, 1)
            for (int i = 0; i < n; i++) expert_backward(pr, dx, dw, dy, x, h, w, da, dh, ex, order[i], write);
        }
    } else {
        PROF_SCOPE(PROF_OTHER) {
            for (int e = 0; e < ex->E; e++) expert_backward(pr, dx, dw, dy, x, h, w, da, dh, ex, e, write);
        }
    }
}

static void cpu_experts_forward(const backend *be, real *y, real *h, real *a, const real *x,
                                const real *const w[4], const be_experts *ex, int beta) {
    experts_forward(&full, y, h, a, x, w, ex, beta);
}
static void cpu_experts_backward(const backend *be, real *dx, real *const dw[4], const real *dy,
                                 const real *x, const real *h, const real *const w[4], real *da,
                                 real *dh, const be_experts *ex) {
    experts_backward(&full, dx, dw, dy, x, h, w, da, dh, ex, 0);
}
static void cpu_experts_backward_write(const backend *be, real *dx, real *const dw[4], const real *dy,
                                       const real *x, const real *h, const real *const w[4], real *da,
                                       real *dh, const be_experts *ex) {
    experts_backward(&full, dx, dw, dy, x, h, w, da, dh, ex, 1);
}

#ifndef VLMOE_REAL_F64
// ---- the cpu-bf16 table (`--precision bf16`): every product of a linear layer or an expert in
// bf16 with fp32 accumulation (src/ops/gemm_bf16.c); the rest is the fp32 table's, and so is
// the router (the table's fp32 field), as in PyTorch's CPU autocast and the CUDA backend's
// fp32-everywhere default.
static const products half = {.fwd = linear_forward_bf16, .bwd = linear_backward_bf16,
                              .fwd_act = linear_act_forward_bf16, .bwd_act = act_linear_backward_bf16,
                              .bwd_write = linear_backward_write_bf16, .mlp_fwd = mlp_forward_bf16};
static void bf16_linear_forward(const backend *be, real *out, const real *inp, const real *w,
                                const real *b, int N, int K, int O, int beta) {
    PROF_SCOPE(PROF_OTHER) linear_forward_bf16(out, inp, w, b, N, K, O, beta);
}
static void bf16_linear_backward(const backend *be, real *dinp, real *dw, real *db, const real *dout,
                                 const real *inp, const real *w, int N, int K, int O) {
    PROF_SCOPE(PROF_OTHER) linear_backward_bf16(dinp, dw, db, dout, inp, w, N, K, O);
}
static void bf16_linear_backward_write(const backend *be, real *dinp, real *dw, real *db, const real *dout,
                                       const real *inp, const real *w, int N, int K, int O) {
    PROF_SCOPE(PROF_OTHER) linear_backward_write_bf16(dinp, dw, db, dout, inp, w, N, K, O);
}
static void bf16_experts_forward(const backend *be, real *y, real *h, real *a, const real *x,
                                 const real *const w[4], const be_experts *ex, int beta) {
    experts_forward(&half, y, h, a, x, w, ex, beta);
}
static void bf16_experts_backward(const backend *be, real *dx, real *const dw[4], const real *dy,
                                  const real *x, const real *h, const real *const w[4], real *da,
                                  real *dh, const be_experts *ex) {
    experts_backward(&half, dx, dw, dy, x, h, w, da, dh, ex, 0);
}
static void bf16_experts_backward_write(const backend *be, real *dx, real *const dw[4], const real *dy,
                                        const real *x, const real *h, const real *const w[4], real *da,
                                        real *dh, const be_experts *ex) {
    experts_backward(&half, dx, dw, dy, x, h, w, da, dh, ex, 1);
}

// ---- the cpu-int8 tables (`--precision int8`, inference only): the expert banks (a dense MLP
// is the bank of one expert) run src/ops/gemm_int8.c's fused inference forward on the int8
// copies of w1 and w2 that the table's ctx holds (src/ops/gemm_int8.h), found by the fp32
// weights' address; a linear layer whose weights have an int8 copy (the attention's, with
// --precision int8-attn) runs in int8, one marked bf16 (the attention's under int8) in bf16,
// every other (the router's through the fp32 table, the stems', the heads') in fp32. A bank
// with no int8 copy (a model changed under the table) or a product whose scratch cannot be had
// runs in fp32. Soft MoE's experts run in the same fused forward (int8_soft_experts). Nothing is
// kept for a backward: h and a (Soft MoE: its experts' hidden activations) are left as they were.
static void int8_linear_forward(const backend *be, real *out, const real *inp, const real *w, const real *b, int N,
                                int K, int O, int beta) {
    PROF_SCOPE(PROF_MATMUL) {
        size_t row;
        const int8_tensor *t = int8_weights_find(be->ctx, w, &row);
        if (t && t->kind == INT8_BF16) linear_forward_bf16(out, inp, w, b, N, K, O, beta);
        else if (!t || linear_forward_int8(out, inp, t, row, b, N, K, O, beta)) R(linear_forward)(out, inp, w, b, N, K, O, beta);
    }
}

// The int8 forward of a bank of E experts with fp32 weights w (w1 (E,M,D), b1, w2 (E,D,M), b2)
// over rows packed by expert (off, E+1 entries): experts_forward_int8 on the int8 copies q holds,
// found by the fp32 weights' address. Nonzero, y as it was, where an expert has no int8 copy or
// the scratch cannot be had.
static int int8_bank_forward(const int8_weights *q, real *y, const real *x, const real *const w[4],
                             const int32_t *off, int E, int D, int M, int act, int beta) {
    int8_expert one[16] = {{0}};
    int8_expert *all = E <= 16 ? one : vlmoe_alloc(sizeof(int8_expert) * (size_t)E, "int8 experts");
    if (!all) return -1;
    for (int e = 0; e < E; e++) {
        int8_expert *x8 = &all[e];
        x8->t1 = int8_weights_find(q, w[0] + (size_t)e * M * D, &x8->r1);
        x8->t2 = int8_weights_find(q, w[2] + (size_t)e * D * M, &x8->r2);
        x8->b1 = w[1] + (size_t)e * M, x8->b2 = w[3] + (size_t)e * D;
    }
    const int st = experts_forward_int8(y, x, all, off, E, D, M, act, beta);
    if (all != one) vlmoe_free_mem(all);
    return st;
}

static void int8_experts_forward(const backend *be, real *y, real *h, real *a, const real *x,
                                 const real *const w[4], const be_experts *ex, int beta) {
    PROF_SCOPE(PROF_MATMUL) {
        if (int8_bank_forward(be->ctx, y, x, w, ex->off, ex->E, ex->D, ex->M, ex->act, beta))
            experts_forward(&full, y, h, a, x, w, ex, beta);
    }
}

// Soft MoE's experts (src/moe/soft.c) as a bank of E experts of P slots each, expert e on rows
// e P .. e P + P - 1 of Xs; nonzero (the layer's fp32 products then) as int8_bank_forward.
static int int8_soft_experts(void *ctx, real *ys, const real *xs, const R(soft_params) *p, const soft_dims *d) {
    const int E = d->E;
    int32_t off1[17];
    int32_t *off = E <= 16 ? off1 : vlmoe_alloc(sizeof(int32_t) * ((size_t)E + 1), "int8 experts");
    if (!off) return -1;
    for (int e = 0; e <= E; e++) off[e] = e * d->P;
    const real *const w[4] = {p->w1, p->b1, p->w2, p->b2};
    const int st = int8_bank_forward(ctx, ys, xs, w, off, E, d->D, d->M, d->act, 0);
    if (off != off1) vlmoe_free_mem(off);
    return st;
}

static void int8_soft_moe_forward(const backend *be, real *out, real *acts, const real *x, const R(soft_params) *p,
                                  const soft_dims *d) {
    PROF_SCOPE(PROF_DISPATCH) R(soft_moe_forward_with)(out, acts, x, p, d, int8_soft_experts, (void *)be->ctx);
}

// Training is refused before it gets here (vlmoe_model_forward); should a backward come anyway,
// it is the fp32 one, the gradient of the fp32 model.
static void int8_experts_backward(const backend *be, real *dx, real *const dw[4], const real *dy,
                                  const real *x, const real *h, const real *const w[4], real *da,
                                  real *dh, const be_experts *ex) {
    experts_backward(&full, dx, dw, dy, x, h, w, da, dh, ex, 0);
}
#endif

// ---- trainer ops over flat buffers
static double cpu_sumsq(const backend *be, const real *x, size_t n, int *nonfinite) {
    double part[NCHUNK];
    int bad[NCHUNK];
    const size_t per = (n + NCHUNK - 1) / NCHUNK;
    PROF_SCOPE(PROF_OPTIMIZER) {
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
        for (int k = 0; k < NCHUNK; k++) {
            const size_t a = (size_t)k * per < n ? (size_t)k * per : n;
            const size_t b = a + per < n ? a + per : n;
            double acc = 0;
            // vector lanes, then their total: a fixed order still, whatever the thread count
#pragma omp simd reduction(+ : acc)
            for (size_t i = a; i < b; i++) acc += (double)x[i] * x[i];
            part[k] = acc;
            bad[k] = !isfinite(acc);
        }
    }
    double sum = 0;
    int any = 0;
    for (int k = 0; k < NCHUNK; k++) sum += part[k], any |= bad[k];
    if (nonfinite) *nonfinite = any;
    return sum;
}

static void cpu_scale(const backend *be, real *x, size_t n, float s) {
    PROF_SCOPE(PROF_OPTIMIZER) {
#pragma omp parallel for simd schedule(static) if (n >= PAR_MIN)
        for (size_t i = 0; i < n; i++) x[i] *= s;
    }
}

// torch.optim.AdamW's order of operations; see src/optim/optim.c for the derivation. Elementwise,
// so the vectorised loop gives the scalar loop's bits (C11 mode: no contraction into FMAs).
static void cpu_adamw(const backend *be, real *p, real *m, real *v, const real *g, size_t n,
                      const be_adamw *a) {
    const real b1 = a->b1, b2 = a->b2, ab1 = a->ab1, ab2 = a->ab2, bc2 = a->bc2_sqrt, eps = a->eps;
    const real step = a->neg_step, shrink = a->decay ? a->shrink : 1;
    const float gs = a->gscale; // the scale op's multiply, done here: x * 1 is x, bit for bit
    PROF_SCOPE(PROF_OPTIMIZER) {
#pragma omp parallel for simd schedule(static) if (n >= PAR_MIN)
        for (size_t i = 0; i < n; i++) {
            const real pi = p[i] * shrink; // times 1 when there is no decay: the same bits
            const real gi = g[i] * gs;
            const real mi = b1 * m[i] + ab1 * gi;
            const real vi = b2 * v[i] + (ab2 * gi) * gi;
            m[i] = mi;
            v[i] = vi;
            const real denom = RSQRT(vi) / bc2 + eps;
            p[i] = pi + (step * mi) / denom;
        }
    }
}

static void cpu_clamp(const backend *be, real *x, size_t n, double lo, double hi) {
    PROF_SCOPE(PROF_OPTIMIZER) {
        const real l = (real)lo, h = (real)hi;
#pragma omp simd
        for (size_t i = 0; i < n; i++) x[i] = x[i] < l ? l : x[i] > h ? h : x[i];
    }
}

// Images as bytes: the table's memory is the host's, so the batch's bytes are read where they are
// and nothing is copied (the float images the host path made cost as much to write).
static const uint8_t *cpu_pixels_stage(const backend *be, const uint8_t *host, size_t n) {
    (void)be, (void)n;
    return host ? host : (const uint8_t *)"";
}
// One table per channel of torchvision's ToTensor + Normalize in float32, the expression of
// src/data/image.c's tensor_from_u8 (tests/test_pixels.c holds the two bit for bit); the double
// table widens the same floats, since the op's result is defined in float32.
static void cpu_pixels_normalize(const backend *be, real *out, const uint8_t *pix, const be_pixels *p) {
    (void)be;
    PROF_SCOPE(PROF_DATA) {
        float lut[BE_PIXELS_MAX_C][256];
        for (int c = 0; c < p->C; c++)
            for (int v = 0; v < 256; v++) lut[c][v] = ((float)v / 255.0f - p->mean[c]) / p->std[c];
        const size_t plane = (size_t)p->H * p->W, img = plane * p->C;
        for (int b = 0; b < p->B; b++) {
            const uint8_t *in = pix + (size_t)b * img;
            real *o = out + (size_t)b * img;
            for (int c = 0; c < p->C; c++)
                for (size_t i = 0; i < plane; i++)
                    o[c * plane + i] = (real)lut[c][p->hwc ? in[i * p->C + c] : in[c * plane + i]];
        }
    }
}

// The step's scalars in memory: the host's here, so the values the returning ops give.
static void cpu_contrastive_forward_dev(const backend *be, real *logits, real *prow, real *pcol, const real *img,
                                        const real *txt, real scale, int B, int E, double *out) {
    out[0] = cpu_contrastive_forward(be, logits, prow, pcol, img, txt, scale, B, E, out + 1);
}
static void cpu_contrastive_forward_dsc(const backend *be, real *logits, real *prow, real *pcol, const real *img,
                                        const real *txt, const real *scale, int B, int E, double *out) {
    out[0] = cpu_contrastive_forward(be, logits, prow, pcol, img, txt, *scale, B, E, out + 1);
    out[3] = *scale;
}
static void cpu_contrastive_backward_dsc(const backend *be, real *dimg, real *dtxt, real *dscale, const real *logits,
                                         const real *prow, const real *pcol, const real *img, const real *txt,
                                         const real *scale, int B, int E, double dloss) {
    cpu_contrastive_backward(be, dimg, dtxt, dscale, logits, prow, pcol, img, txt, *scale, B, E, dloss);
}
static void *cpu_host_alloc(const backend *be, size_t bytes, const char *what) { return vlmoe_calloc(bytes, what); }
static void cpu_host_free(const backend *be, void *p) { vlmoe_free_mem(p); }
static void cpu_aux_loss_dev(const backend *be, vlmoe_aux_kind kind, const R(aux_input) *in, real *scratch,
                             double *out) {
    out[0] = cpu_aux_loss(be, kind, in, 1.0, NULL, scratch);
}
static void cpu_sumsq_dev(const backend *be, const real *x, size_t n, double *out) {
    int bad = 0;
    out[0] = cpu_sumsq(be, x, n, &bad);
    out[1] = bad;
}

// the routing decision is route.c itself, on host memory (src/moe/route_op.c)
static int cpu_route(const backend *be, const real *gates, const be_route *r, const be_route_out *o) {
    return R(route_host)(gates, r, o);
}

// Every entry but the name, the products and the fp32 twin: the same in both tables.
#define CPU_COMMON_ENTRIES \
    .host_memory = 1, \
    .supports = cpu_supports, \
    .alloc = cpu_alloc, \
    .free = cpu_free, \
    .upload = cpu_memcpy, \
    .download = cpu_memcpy, \
    .upload_bytes = cpu_upload_bytes, \
    .zero = cpu_zero, \
    .copy = cpu_memcpy, \
    .add = cpu_add, \
    .sync = cpu_sync, \
    .layernorm_forward = cpu_layernorm_forward, \
    .layernorm_recompute = cpu_layernorm_recompute, \
    .layernorm_backward = cpu_layernorm_backward, \
    .act_forward = cpu_act_forward, \
    .act_backward = cpu_act_backward, \
    .softmax_forward = cpu_softmax_forward, \
    .softmax_backward = cpu_softmax_backward, \
    .attention_forward = cpu_attention_forward, \
    .attention_backward = cpu_attention_backward, \
    .patchify_forward = cpu_patchify_forward, \
    .patchify_backward = cpu_patchify_backward, \
    .embed_forward = cpu_embed_forward, \
    .embed_backward = cpu_embed_backward, \
    .posadd_forward = cpu_posadd_forward, \
    .posadd_backward = cpu_posadd_backward, \
    .cls_forward = cpu_cls_forward, \
    .cls_backward = cpu_cls_backward, \
    .pool_forward = cpu_pool_forward, \
    .pool_backward = cpu_pool_backward, \
    .l2norm_forward = cpu_l2norm_forward, \
    .l2norm_backward = cpu_l2norm_backward, \
    .contrastive_forward = cpu_contrastive_forward, \
    .contrastive_backward = cpu_contrastive_backward, \
    .xent_forward = cpu_xent_forward, \
    .xent_backward = cpu_xent_backward, \
    .gather_rows = cpu_gather_rows, \
    .combine_forward = cpu_combine_forward, \
    .combine_backward = cpu_combine_backward, \
    .gather_rows_backward = cpu_gather_rows_backward, \
    .combine_weights = cpu_combine_weights, \
    .combine_weights_backward = cpu_combine_weights_backward, \
    .router_noise = cpu_router_noise, \
    .aux_loss = cpu_aux_loss, \
    .soft_moe_forward = cpu_soft_moe_forward, \
    .soft_moe_backward = cpu_soft_moe_backward, \
    .sumsq = cpu_sumsq, \
    .scale = cpu_scale, \
    .adamw = cpu_adamw, \
    .clamp = cpu_clamp, \
    .pixels_stage = cpu_pixels_stage, \
    .pixels_normalize = cpu_pixels_normalize, \
    .contrastive_forward_dev = cpu_contrastive_forward_dev, \
    .sumsq_dev = cpu_sumsq_dev, \
    .download_bytes = cpu_upload_bytes, \
    .route = cpu_route, \
    .aux_loss_dev = cpu_aux_loss_dev, \
    .contrastive_forward_dsc = cpu_contrastive_forward_dsc, \
    .contrastive_backward_dsc = cpu_contrastive_backward_dsc, \
    .host_alloc = cpu_host_alloc, \
    .host_free = cpu_host_free

static const backend cpu_table = {
    .name = "cpu",
    CPU_COMMON_ENTRIES,
    .linear_forward = cpu_linear_forward,
    .linear_backward = cpu_linear_backward,
    .linear_backward_write = cpu_linear_backward_write,
    .experts_forward = cpu_experts_forward,
    .experts_backward = cpu_experts_backward,
    .experts_backward_write = cpu_experts_backward_write,
};

const backend *R(backend_cpu)(void) { return &cpu_table; }

#ifndef VLMOE_REAL_F64
static const backend cpu_bf16_table = {
    .name = "cpu-bf16",
    CPU_COMMON_ENTRIES,
    .fp32 = &cpu_table,
    .linear_forward = bf16_linear_forward,
    .linear_backward = bf16_linear_backward,
    .linear_backward_write = bf16_linear_backward_write,
    .experts_forward = bf16_experts_forward,
    .experts_backward = bf16_experts_backward,
    .experts_backward_write = bf16_experts_backward_write,
};

const backend *backend_cpu_bf16(void) { return &cpu_bf16_table; }

static const backend cpu_int8_table = {
    .name = "cpu-int8",
    CPU_COMMON_ENTRIES,
    .fp32 = &cpu_table,
    .linear_forward = int8_linear_forward,
    .linear_backward = cpu_linear_backward,
    .linear_backward_write = cpu_linear_backward_write,
    .experts_forward = int8_experts_forward,
    .experts_backward = int8_experts_backward,
    .experts_backward_write = cpu_experts_backward_write,
};

void backend_cpu_int8(backend *table, const int8_weights *w) {
    *table = cpu_int8_table;
    table->soft_moe_forward = int8_soft_moe_forward; // here: the table's initializer has the fp32 one
    table->ctx = (void *)w;
}
#endif

int R(backend_require)(const backend *be, be_op op, const void *cfg) {
    if (be->supports(be, op, cfg)) return VLMOE_OK;
    return vlmoe_fail(VLMOE_ERR_ARG, "the %s backend does not support the op '%s'%s", be->name,
                      be_op_name(op), cfg ? " with this configuration" : "");
}
