// ops.c: forward/backward CPU kernels (linear via BLAS, LayerNorm, GELU family, softmax,
// multi-head attention with causal/padding masks, patchify, embeddings, class token, pooling,
// L2 normalisation). Compiled as float and double (src/core/real.h). Threads split work over
// outputs a thread owns, so results are identical for any thread count.
// Covered by tests/test_ops.c (finite differences) and tests/test_parity.c (PyTorch).
#include <math.h>
#include <string.h>

#include "core/real.h"
#include "ops/ops.h"

// C (M,N) = op(A) op(B) + beta C, row-major. Threads take fixed blocks of C's rows or columns
// (whichever dimension is larger), each computed by one single-threaded BLAS call (OpenBLAS runs
// single-threaded inside an OpenMP region). The blocks depend only on the shapes, never on the
// thread count, so every output element is computed the same way on 1 or 64 threads: OpenBLAS's
// own threading changes the summation order with the thread count. One thread pool (OpenMP's)
// also avoids two pools busy-waiting against each other.
static void gemm(int ta, int tb, int M, int N, int K, const real *A, int lda, const real *B,
                 int ldb, real beta, real *C, int ldc) {
    const int split_rows = M >= N, dim = split_rows ? M : N;
    int nb = dim / 64;
    nb = nb < 1 ? 1 : nb > 64 ? 64 : nb;
    const int bs = (dim + nb - 1) / nb;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < nb; b++) {
        const int o = b * bs, n = dim - o < bs ? dim - o : bs;
        if (n <= 0) continue;
        if (split_rows)
            GEMM(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, n, N,
                 K, 1, ta ? A + o : A + (size_t)o * lda, lda, B, ldb, beta, C + (size_t)o * ldc, ldc);
        else
            GEMM(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, n,
                 K, 1, A, lda, tb ? B + (size_t)o * ldb : B + o, ldb, beta, C + o, ldc);
    }
}

void R(linear_forward)(real *out, const real *inp, const real *w, const real *b, int N, int K,
                       int O, int beta) {
    // out = inp . w^T: row-major (N,K) x (O,K)^T
    gemm(0, 1, N, O, K, inp, K, w, K, beta ? 1 : 0, out, O);
    if (b) {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            real *o = out + (size_t)n * O;
            for (int j = 0; j < O; j++) o[j] += b[j];
        }
    }
}

void R(linear_backward)(real *dinp, real *dw, real *db, const real *dout, const real *inp,
                        const real *w, int N, int K, int O) {
    if (dinp) gemm(0, 0, N, K, O, dout, O, w, K, 1, dinp, K);
    // dw (O,K) += dout^T (O,N) . inp (N,K)
    gemm(1, 0, O, K, N, dout, O, inp, K, 1, dw, K);
    if (db) {
        // column sums, each thread owns a slice of columns: no races, fixed order
#pragma omp parallel for schedule(static)
        for (int j = 0; j < O; j++) {
            real s = 0;
            for (int n = 0; n < N; n++) s += dout[(size_t)n * O + j];
            db[j] += s;
        }
    }
}

void R(layernorm_forward)(real *out, real *mean, real *rstd, const real *inp, const real *w,
                          const real *b, int N, int C, double eps) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real *x = inp + (size_t)n * C;
        real *o = out + (size_t)n * C;
        real m = 0, v = 0;
        for (int i = 0; i < C; i++) m += x[i];
        m /= C;
        for (int i = 0; i < C; i++) v += (x[i] - m) * (x[i] - m);
        v /= C;
        real s = (real)(1.0 / sqrt((double)v + eps));
        for (int i = 0; i < C; i++) o[i] = (x[i] - m) * s * w[i] + b[i];
        mean[n] = m;
        rstd[n] = s;
    }
}

void R(layernorm_backward)(real *dinp, real *dw, real *db, const real *dout, const real *inp,
                           const real *w, const real *mean, const real *rstd, int N, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real *x = inp + (size_t)n * C, *g = dout + (size_t)n * C;
        real *dx = dinp + (size_t)n * C;
        real m = mean[n], s = rstd[n], dnorm_mean = 0, dnorm_norm = 0;
        for (int i = 0; i < C; i++) {
            real dn = w[i] * g[i];
            dnorm_mean += dn;
            dnorm_norm += dn * (x[i] - m) * s;
        }
        dnorm_mean /= C;
        dnorm_norm /= C;
        for (int i = 0; i < C; i++) {
            real dn = w[i] * g[i];
            dx[i] += (dn - dnorm_mean - (x[i] - m) * s * dnorm_norm) * s;
        }
    }
    // parameter gradients: each thread owns a slice of channels
#pragma omp parallel for schedule(static)
    for (int i = 0; i < C; i++) {
        real sw = 0, sb = 0;
        for (int n = 0; n < N; n++) {
            real g = dout[(size_t)n * C + i];
            sw += g * (inp[(size_t)n * C + i] - mean[n]) * rstd[n];
            sb += g;
        }
        dw[i] += sw;
        db[i] += sb;
    }
}

#define SQRT_2_OVER_PI 0.7978845608028654
#define INV_SQRT_2 0.7071067811865476
#define INV_SQRT_2PI 0.3989422804014327

void R(act_forward)(real *out, const real *inp, size_t n, int kind) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        real x = inp[i];
        if (kind == VLMOE_ACT_GELU) {
            out[i] = (real)0.5 * x * (1 + RERF(x * (real)INV_SQRT_2));
        } else if (kind == VLMOE_ACT_GELU_TANH) {
            real u = (real)SQRT_2_OVER_PI * (x + (real)0.044715 * x * x * x);
            out[i] = (real)0.5 * x * (1 + RTANH(u));
        } else { // quick_gelu: x * sigmoid(1.702 x) (OpenAI CLIP)
            out[i] = x / (1 + REXP((real)-1.702 * x));
        }
    }
}

void R(act_backward)(real *dinp, const real *inp, const real *dout, size_t n, int kind) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        real x = inp[i], d;
        if (kind == VLMOE_ACT_GELU) {
            real cdf = (real)0.5 * (1 + RERF(x * (real)INV_SQRT_2));
            d = cdf + x * (real)INV_SQRT_2PI * REXP((real)-0.5 * x * x);
        } else if (kind == VLMOE_ACT_GELU_TANH) {
            real x3 = x * x * x;
            real u = (real)SQRT_2_OVER_PI * (x + (real)0.044715 * x3);
            real t = RTANH(u);
            real du = (real)SQRT_2_OVER_PI * (1 + (real)(3 * 0.044715) * x * x);
            d = (real)0.5 * (1 + t) + (real)0.5 * x * (1 - t * t) * du;
        } else {
            real sg = 1 / (1 + REXP((real)-1.702 * x));
            d = sg + x * (real)1.702 * sg * (1 - sg);
        }
        dinp[i] += dout[i] * d;
    }
}

void R(softmax_forward)(real *out, const real *inp, int N, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real *x = inp + (size_t)n * C;
        real *o = out + (size_t)n * C, mx = x[0], s = 0;
        for (int i = 1; i < C; i++) mx = x[i] > mx ? x[i] : mx;
        for (int i = 0; i < C; i++) s += (o[i] = REXP(x[i] - mx));
        for (int i = 0; i < C; i++) o[i] /= s;
    }
}

void R(softmax_backward)(real *dinp, const real *out, const real *dout, int N, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real *y = out + (size_t)n * C, *g = dout + (size_t)n * C;
        real dot = 0;
        for (int i = 0; i < C; i++) dot += y[i] * g[i];
        for (int i = 0; i < C; i++) dinp[(size_t)n * C + i] += y[i] * (g[i] - dot);
    }
}

// Number of keys query i may attend to within a sequence of valid length len.
static inline int key_limit(int i, int len, int causal) {
    return causal && i + 1 < len ? i + 1 : len;
}

void R(attention_forward)(real *out, real *att, const real *qkv, const attn_segment *seg, int D,
                          int H) {
    const int T = seg->seqlen, hd = D / H;
    const real scale = (real)(1.0 / sqrt((double)hd));
    const real *base = qkv + seg->tok_off * 3 * (size_t)D;
    real *obase = out + seg->tok_off * (size_t)D;
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < seg->nseq; b++) {
        for (int h = 0; h < H; h++) {
            const int len = seg->lens ? seg->lens[b] : T;
            real *a = att + (((size_t)b * H + h) * T) * T;
            for (int i = 0; i < T; i++) {
                const real *q = base + ((size_t)b * T + i) * 3 * D + h * hd;
                real *row = a + (size_t)i * T;
                int nk = key_limit(i, len, seg->causal);
                real mx = -INFINITY, s = 0;
                for (int j = 0; j < nk; j++) {
                    const real *k = base + ((size_t)b * T + j) * 3 * D + D + h * hd;
                    real dot = 0;
                    for (int c = 0; c < hd; c++) dot += q[c] * k[c];
                    row[j] = dot * scale;
                    mx = row[j] > mx ? row[j] : mx;
                }
                for (int j = 0; j < nk; j++) s += (row[j] = REXP(row[j] - mx));
                for (int j = 0; j < nk; j++) row[j] /= s;
                for (int j = nk; j < T; j++) row[j] = 0;
                real *o = obase + ((size_t)b * T + i) * D + h * hd;
                for (int c = 0; c < hd; c++) o[c] = 0;
                for (int j = 0; j < nk; j++) {
                    const real *v = base + ((size_t)b * T + j) * 3 * D + 2 * D + h * hd;
                    for (int c = 0; c < hd; c++) o[c] += row[j] * v[c];
                }
            }
        }
    }
}

void R(attention_backward)(real *dqkv, real *datt, const real *dout, const real *qkv,
                           const real *att, const attn_segment *seg, int D, int H) {
    const int T = seg->seqlen, hd = D / H;
    const real scale = (real)(1.0 / sqrt((double)hd));
    const real *base = qkv + seg->tok_off * 3 * (size_t)D;
    real *dbase = dqkv + seg->tok_off * 3 * (size_t)D;
    const real *gbase = dout + seg->tok_off * (size_t)D;
    // each (sequence, head) owns its q/k/v columns of dqkv: no two threads write the same float
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < seg->nseq; b++) {
        for (int h = 0; h < H; h++) {
            const int len = seg->lens ? seg->lens[b] : T;
            const real *a = att + (((size_t)b * H + h) * T) * T;
            real *da = datt + (((size_t)b * H + h) * T) * T;
            for (int i = 0; i < T; i++) {
                const real *g = gbase + ((size_t)b * T + i) * D + h * hd;
                const real *row = a + (size_t)i * T;
                real *drow = da + (size_t)i * T;
                int nk = key_limit(i, len, seg->causal);
                real dot = 0;
                for (int j = 0; j < nk; j++) {
                    const real *v = base + ((size_t)b * T + j) * 3 * D + 2 * D + h * hd;
                    real *dv = dbase + ((size_t)b * T + j) * 3 * D + 2 * D + h * hd;
                    real dp = 0;
                    for (int c = 0; c < hd; c++) {
                        dp += g[c] * v[c];
                        dv[c] += row[j] * g[c];
                    }
                    drow[j] = dp;
                    dot += dp * row[j];
                }
                // softmax backward, then through the scaled dot products
                const real *q = base + ((size_t)b * T + i) * 3 * D + h * hd;
                real *dq = dbase + ((size_t)b * T + i) * 3 * D + h * hd;
                for (int j = 0; j < nk; j++) {
                    real ds = row[j] * (drow[j] - dot) * scale;
                    const real *k = base + ((size_t)b * T + j) * 3 * D + D + h * hd;
                    real *dk = dbase + ((size_t)b * T + j) * 3 * D + D + h * hd;
                    for (int c = 0; c < hd; c++) {
                        dq[c] += ds * k[c];
                        dk[c] += ds * q[c];
                    }
                }
            }
        }
    }
}

void R(patchify_forward)(real *patches, const real *images, int B, int C, int HW, int P) {
    const int g = HW / P, np = g * g, pd = C * P * P;
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int p = 0; p < np; p++) {
            int py0 = (p / g) * P, px0 = (p % g) * P;
            real *o = patches + ((size_t)b * np + p) * pd;
            for (int c = 0; c < C; c++)
                for (int y = 0; y < P; y++)
                    for (int x = 0; x < P; x++)
                        *o++ = images[(((size_t)b * C + c) * HW + py0 + y) * HW + px0 + x];
        }
    }
}

void R(patchify_backward)(real *dimages, const real *dpatches, int B, int C, int HW, int P) {
    const int g = HW / P, np = g * g, pd = C * P * P;
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int p = 0; p < np; p++) {
            int py0 = (p / g) * P, px0 = (p % g) * P;
            const real *d = dpatches + ((size_t)b * np + p) * pd;
            for (int c = 0; c < C; c++)
                for (int y = 0; y < P; y++)
                    for (int x = 0; x < P; x++)
                        dimages[(((size_t)b * C + c) * HW + py0 + y) * HW + px0 + x] += *d++;
        }
    }
}

void R(embed_forward)(real *out, const int32_t *ids, const real *wte, int BT, int D) {
#pragma omp parallel for schedule(static)
    for (int t = 0; t < BT; t++) memcpy(out + (size_t)t * D, wte + (size_t)ids[t] * D, sizeof(real) * D);
}

void R(embed_backward)(real *dwte, const real *dout, const int32_t *ids, int BT, int D) {
    // Several tokens may share an id: threads split the columns, each walks all tokens in order.
#pragma omp parallel for schedule(static)
    for (int c = 0; c < D; c++)
        for (int t = 0; t < BT; t++) dwte[(size_t)ids[t] * D + c] += dout[(size_t)t * D + c];
}

void R(posadd_forward)(real *out, const real *pos, int B, int T_, int D) {
#pragma omp parallel for schedule(static)
    for (int b = 0; b < B; b++)
        for (size_t i = 0; i < (size_t)T_ * D; i++) out[(size_t)b * T_ * D + i] += pos[i];
}

void R(posadd_backward)(real *dpos, const real *dout, int B, int T_, int D) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < (size_t)T_ * D; i++) {
        real s = 0;
        for (int b = 0; b < B; b++) s += dout[(size_t)b * T_ * D + i];
        dpos[i] += s;
    }
}

void R(cls_forward)(real *out, const real *cls, const real *x, int B, int N, int D) {
    for (int b = 0; b < B; b++) {
        memcpy(out + (size_t)b * (N + 1) * D, cls, sizeof(real) * D);
        memcpy(out + ((size_t)b * (N + 1) + 1) * D, x + (size_t)b * N * D, sizeof(real) * N * D);
    }
}

void R(cls_backward)(real *dcls, real *dx, const real *dout, int B, int N, int D) {
    for (int b = 0; b < B; b++) {
        const real *g = dout + (size_t)b * (N + 1) * D;
        for (int c = 0; c < D; c++) dcls[c] += g[c];
        if (dx)
            for (size_t i = 0; i < (size_t)N * D; i++) dx[(size_t)b * N * D + i] += g[D + i];
    }
}

void R(pool_forward)(real *out, const real *x, const int32_t *lens, int B, int T_, int D, int kind) {
    for (int b = 0; b < B; b++) {
        const real *xb = x + (size_t)b * T_ * D;
        real *o = out + (size_t)b * D;
        int len = lens ? lens[b] : T_;
        if (kind == VLMOE_POOL_MEAN) {
            for (int c = 0; c < D; c++) o[c] = 0;
            for (int t = 0; t < len; t++)
                for (int c = 0; c < D; c++) o[c] += xb[(size_t)t * D + c];
            for (int c = 0; c < D; c++) o[c] /= len;
        } else {
            int t = kind == VLMOE_POOL_CLS ? 0 : len - 1;
            memcpy(o, xb + (size_t)t * D, sizeof(real) * D);
        }
    }
}

void R(pool_backward)(real *dx, const real *dout, const int32_t *lens, int B, int T_, int D,
                      int kind) {
    for (int b = 0; b < B; b++) {
        real *dxb = dx + (size_t)b * T_ * D;
        const real *g = dout + (size_t)b * D;
        int len = lens ? lens[b] : T_;
        if (kind == VLMOE_POOL_MEAN) {
            for (int t = 0; t < len; t++)
                for (int c = 0; c < D; c++) dxb[(size_t)t * D + c] += g[c] / len;
        } else {
            int t = kind == VLMOE_POOL_CLS ? 0 : len - 1;
            for (int c = 0; c < D; c++) dxb[(size_t)t * D + c] += g[c];
        }
    }
}

void R(l2norm_forward)(real *out, real *norm, const real *x, int N, int C) {
    for (int n = 0; n < N; n++) {
        double s = 0;
        for (int c = 0; c < C; c++) s += (double)x[(size_t)n * C + c] * x[(size_t)n * C + c];
        real nr = (real)sqrt(s);
        if (nr < (real)1e-12) nr = (real)1e-12; // torch.nn.functional.normalize's eps
        norm[n] = nr;
        for (int c = 0; c < C; c++) out[(size_t)n * C + c] = x[(size_t)n * C + c] / nr;
    }
}

void R(l2norm_backward)(real *dx, const real *dout, const real *out, const real *norm, int N, int C) {
    for (int n = 0; n < N; n++) {
        const real *y = out + (size_t)n * C, *g = dout + (size_t)n * C;
        real dot = 0;
        for (int c = 0; c < C; c++) dot += y[c] * g[c];
        for (int c = 0; c < C; c++) dx[(size_t)n * C + c] += (g[c] - y[c] * dot) / norm[n];
    }
}
