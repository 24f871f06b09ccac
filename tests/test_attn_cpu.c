// test_attn_cpu.c: the float attention kernels (src/ops/attn_cpu.c's fused AVX-512 or AVX2
// kernel where the build has one, ops.c's reference loops otherwise and for large T) against
// plain loops in double written here, on odd shapes and every mask; thread-count independence;
// NaN propagation.
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include "core/core.h"
#include "ops/attn_cpu.h"
#include "ops/ops.h"
#include "test.h"

// Both float paths against double, as max |x - ref| / (1 + |ref|) over every element, for
// inputs drawn N(0, amp^2) as floats. The scores' rounding grows with their size (amp^2), and
// the exp passes it on as a relative error, so the bounds are per amp^2; they hold float
// rounding over sums of up to 200 terms with a few times headroom (the worst measured errors are
// printed at the end; the reference path's are alike).
#define TOL_OUT 4e-6
#define TOL_ATT 1e-6
#define TOL_DQKV 1e-5
static double worst[2][3]; // [fused, reference][out, att, dqkv], relative to the amp^2 bound

static int key_lim(int i, int len, int causal, int prefix) {
    int k = i < prefix ? prefix : i + 1;
    return causal && k < len ? k : len;
}

// Plain loops in double over the segment's tokens: out (Ntok, D), att (nseq, H, T, T); dqkv
// (Ntok, 3D) of the segment written from dout.
static void ref_attention(double *out, double *att, double *dqkv, const double *qkv, const double *dout,
                          const attn_segment *s, int D, int H) {
    const int T = s->seqlen, hd = D / H, ld = 3 * D;
    const double sc = 1 / sqrt((double)hd);
    double *dp = malloc(sizeof(double) * T * T);
    for (int b = 0; b < s->nseq; b++)
        for (int h = 0; h < H; h++) {
            const int len = s->lens ? s->lens[b] : T;
            const size_t t0 = s->tok_off + (size_t)b * T;
            const double *q = qkv + t0 * ld + h * hd, *k = q + D, *v = q + 2 * D, *g = dout + t0 * D + h * hd;
            double *p = att + ((size_t)b * H + h) * T * T, *o = out + t0 * D + h * hd;
            double *dq = dqkv + t0 * ld + h * hd, *dk = dq + D, *dv = dq + 2 * D;
            for (int i = 0; i < T; i++) {
                const int nk = key_lim(i, len, s->causal, s->prefix);
                double mx = -INFINITY, sum = 0;
                for (int j = 0; j < T; j++) {
                    double x = 0;
                    for (int d = 0; d < hd; d++) x += q[(size_t)i * ld + d] * k[(size_t)j * ld + d];
                    p[(size_t)i * T + j] = x * sc;
                    if (j < nk && x * sc > mx) mx = x * sc;
                }
                for (int j = 0; j < T; j++)
                    sum += p[(size_t)i * T + j] = j < nk ? exp(p[(size_t)i * T + j] - mx) : 0;
                for (int j = 0; j < T; j++) p[(size_t)i * T + j] = nk ? p[(size_t)i * T + j] / sum : 0;
                for (int d = 0; d < hd; d++) {
                    double x = 0;
                    for (int j = 0; j < T; j++) x += p[(size_t)i * T + j] * v[(size_t)j * ld + d];
                    o[(size_t)i * D + d] = x;
                }
            }
            for (int i = 0; i < T; i++) {
                double dot = 0;
                for (int j = 0; j < T; j++) {
                    double x = 0;
                    for (int d = 0; d < hd; d++) x += g[(size_t)i * D + d] * v[(size_t)j * ld + d];
                    dp[(size_t)i * T + j] = x;
                    dot += x * p[(size_t)i * T + j];
                }
                for (int j = 0; j < T; j++) dp[(size_t)i * T + j] = p[(size_t)i * T + j] * (dp[(size_t)i * T + j] - dot) * sc;
            }
            for (int i = 0; i < T; i++)
                for (int d = 0; d < hd; d++) {
                    double xq = 0, xk = 0, xv = 0;
                    for (int j = 0; j < T; j++) {
                        xq += dp[(size_t)i * T + j] * k[(size_t)j * ld + d];
                        xk += dp[(size_t)j * T + i] * q[(size_t)j * ld + d];
                        xv += p[(size_t)j * T + i] * g[(size_t)j * D + d];
                    }
                    dq[(size_t)i * ld + d] = xq, dk[(size_t)i * ld + d] = xk, dv[(size_t)i * ld + d] = xv;
                }
        }
    free(dp);
}

static double rel_err(const float *x, const double *ref, size_t n) {
    double e = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)x[i] - ref[i]) / (1 + fabs(ref[i]));
        e = d > e || d != d ? d : e; // a NaN is the worst error
    }
    return e;
}

// One shape and mask: the segment sits after `pad` tokens of other data in the buffers, which
// neither path may touch. Runs fused (attn_fused_*, or attention_*_f32 where they decline) and
// reference (attention_*_ref_f32) at 1 and 3 threads: each bit-identical across thread counts
// and within the bounds of double.
static void run_case(int T, int hd, int H, int nseq, int causal, int prefix, int padded, double amp) {
    const int D = hd * H, ld = 3 * D, pad = 3;
    const size_t ntok = (size_t)nseq * T + 2 * pad, na = (size_t)nseq * H * T * T;
    int32_t *lens = malloc(sizeof(int32_t) * nseq);
    vlmoe_rng rng;
    vlmoe_rng_seed(&rng, 1000 * T + hd + 7 * causal + 13 * padded);
    for (int b = 0; b < nseq; b++) lens[b] = b == 0 ? T : 1 + (int)vlmoe_rng_below(&rng, T); // lens 1..T
    const attn_segment seg = {.tok_off = pad, .nseq = nseq, .seqlen = T, .causal = causal,
                              .lens = padded ? lens : NULL, .prefix = prefix};
    float *qkv = malloc(sizeof(float) * ntok * ld), *g = malloc(sizeof(float) * ntok * D);
    double *dqkv_d = calloc(ntok * ld, sizeof(double)), *qd = malloc(sizeof(double) * ntok * ld);
    double *gd = malloc(sizeof(double) * ntok * D), *out_d = calloc(ntok * D, sizeof(double));
    double *att_d = calloc(na, sizeof(double));
    for (size_t i = 0; i < ntok * ld; i++) qd[i] = qkv[i] = (float)(amp * vlmoe_rng_normal(&rng));
    for (size_t i = 0; i < ntok * D; i++) gd[i] = g[i] = (float)vlmoe_rng_normal(&rng);
    ref_attention(out_d, att_d, dqkv_d, qd, gd, &seg, D, H);
    const size_t s0 = (size_t)pad * D, so = (size_t)nseq * T * D, s0q = (size_t)pad * ld, sq = (size_t)nseq * T * ld;
    float *keep[2][4] = {{0}};
    for (int path = 0; path < 2; path++) {
        for (int th = 0; th < 2; th++) {
            float *out = malloc(sizeof(float) * ntok * D), *att = malloc(sizeof(float) * na);
            float *datt = malloc(sizeof(float) * na), *dqkv = malloc(sizeof(float) * ntok * ld);
            for (size_t i = 0; i < ntok * D; i++) out[i] = 777;
            for (size_t i = 0; i < ntok * ld; i++) dqkv[i] = 12345; // all segment rows are written
            for (size_t i = 0; i < na; i++) att[i] = datt[i] = NAN;  // every probability is written
            omp_set_num_threads(th ? 3 : 1);
            if (path == 0) { // the fused kernels wherever they take the shape (ops.c may not)
                if (!attn_fused_forward(out, att, qkv, &seg, D, H)) attention_forward_f32(out, att, qkv, &seg, D, H);
                if (!attn_fused_backward(dqkv, datt, g, qkv, att, &seg, D, H))
                    attention_backward_f32(dqkv, datt, g, qkv, att, &seg, D, H);
            } else {
                attention_forward_ref_f32(out, att, qkv, &seg, D, H);
                attention_backward_ref_f32(dqkv, datt, g, qkv, att, &seg, D, H);
            }
            int outside = 0;
            for (size_t i = 0; i < ntok * D; i++) outside += (i < s0 || i >= s0 + so) && out[i] != 777;
            for (size_t i = 0; i < ntok * ld; i++) outside += (i < s0q || i >= s0q + sq) && dqkv[i] != 12345;
            const double eo = rel_err(out + s0, out_d + s0, so), ea = rel_err(att, att_d, na);
            const double ed = rel_err(dqkv + s0q, dqkv_d + s0q, sq);
            const double a2 = amp * amp;
            worst[path][0] = fmax(worst[path][0], eo / a2), worst[path][1] = fmax(worst[path][1], ea / a2);
            worst[path][2] = fmax(worst[path][2], ed / a2);
            CHECK(!outside && eo <= TOL_OUT * a2 && ea <= TOL_ATT * a2 && ed <= TOL_DQKV * a2,
                  "%s T %d hd %d H %d causal %d prefix %d lens %d amp %g threads %d: out %.3g att %.3g dqkv %.3g "
                  "(bounds %g %g %g), %d values outside the segment changed", path ? "reference" : "fused", T, hd,
                  H, causal, prefix, padded, amp, th ? 3 : 1, eo, ea, ed, TOL_OUT * a2, TOL_ATT * a2, TOL_DQKV * a2,
                  outside);
            if (th == 0) keep[path][0] = out, keep[path][1] = att, keep[path][2] = dqkv, keep[path][3] = datt;
            else {
                CHECK(!memcmp(out, keep[path][0], sizeof(float) * ntok * D) &&
                          !memcmp(att, keep[path][1], sizeof(float) * na) &&
                          !memcmp(dqkv, keep[path][2], sizeof(float) * ntok * ld),
                      "%s T %d hd %d causal %d prefix %d lens %d: 1 and 3 threads differ", path ? "reference" : "fused",
                      T, hd, causal, prefix, padded);
                free(out), free(att), free(dqkv), free(datt);
            }
        }
    }
    for (int p = 0; p < 2; p++)
        for (int i = 0; i < 4; i++) free(keep[p][i]);
    omp_set_num_threads(2);
    free(lens), free(qkv), free(g), free(dqkv_d), free(qd), free(gd), free(out_d), free(att_d);
}

static void test_shapes(void) {
    static const int Ts[] = {1, 15, 16, 17, 65, 80, 96, 97, 200};
    static const int hds[] = {64, 32, 80, 12};
    for (size_t t = 0; t < sizeof(Ts) / sizeof(Ts[0]); t++)
        for (size_t h = 0; h < sizeof(hds) / sizeof(hds[0]); h++) {
            const int T = Ts[t], hd = hds[h], nseq = T > 96 ? 2 : 3;
            if (T > 96 && hd != 64) continue; // the reference path: one head size is enough
            run_case(T, hd, 2, nseq, 0, 0, 0, 1);      // plain
            run_case(T, hd, 2, nseq, 0, 0, 1, 1);      // padding (lens 1..T)
            run_case(T, hd, 2, nseq, 1, 0, 0, 1);      // causal
            run_case(T, hd, 2, nseq, 1, T / 3, 1, 1);  // VL-MoE's prefix mask with padding
        }
    run_case(65, 64, 4, 2, 0, 0, 0, 4);  // wide scores (|s| ~ 16 sqrt(64) / 8): exp's range
    run_case(16, 64, 4, 2, 1, 0, 1, 4);
}

// Which path ran: on an AVX-512 build, or an AVX2 and FMA one, the fused kernel takes T <=
// ATTN_FUSED_TMAX, the reference the rest, so the cases above covered both.
static void test_dispatch(void) {
    float dummy[1] = {0};
    const attn_segment small = {.nseq = 0, .seqlen = 65}, big = {.nseq = 0, .seqlen = ATTN_FUSED_TMAX + 1};
    const int fs = attn_fused_forward(dummy, dummy, dummy, &small, 256, 4);
    const int fb = attn_fused_forward(dummy, dummy, dummy, &big, 256, 4);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    CHECK(fs == 1 && fb == 0, "fused build: fused for T 65 %d (want 1), T %d %d (want 0)", fs, ATTN_FUSED_TMAX + 1, fb);
#else
    CHECK(fs == 0 && fb == 0, "no AVX-512, no AVX2: the fused kernel claimed a segment (%d %d)", fs, fb);
#endif
    printf("attn_cpu: fused kernel %s\n", !fs ? "not in this build (reference only)"
#if defined(__AVX512F__)
                                                : "(AVX-512) tested"
#else
                                                : "(AVX2) tested"
#endif
    );
}

// A NaN in one query comes out as NaN in that query's row of out (both paths), not hidden by
// the max or the exp's clamp; the other rows stay finite.
static void test_nan(void) {
    const int T = 17, D = 64, H = 1, ld = 3 * D;
    const attn_segment seg = {.nseq = 1, .seqlen = T};
    float *qkv = malloc(sizeof(float) * T * ld), *out = malloc(sizeof(float) * T * D), *att = malloc(sizeof(float) * T * T);
    vlmoe_rng rng;
    vlmoe_rng_seed(&rng, 5);
    for (int path = 0; path < 2; path++) {
        for (int i = 0; i < T * ld; i++) qkv[i] = (float)vlmoe_rng_normal(&rng);
        qkv[5 * ld + 3] = NAN; // query 5
        if (path == 0) attention_forward_f32(out, att, qkv, &seg, D, H);
        else attention_forward_ref_f32(out, att, qkv, &seg, D, H);
        int nan5 = 0, nan_other = 0;
        for (int i = 0; i < T; i++)
            for (int d = 0; d < D; d++) *(i == 5 ? &nan5 : &nan_other) += isnan(out[i * D + d]) != 0;
        CHECK(nan5 == D && nan_other == 0, "%s: NaN query: %d of %d NaN in its row, %d elsewhere",
              path ? "reference" : "fused", nan5, D, nan_other);
    }
    free(qkv), free(out), free(att);
}

int main(void) {
    test_dispatch();
    test_shapes();
    test_nan();
    for (int p = 0; p < 2; p++)
        printf("attn_cpu: %s path, worst error / amp^2: out %.3g att %.3g dqkv %.3g (bounds %g %g %g)\n",
               p ? "reference" : "fused", worst[p][0], worst[p][1], worst[p][2], TOL_OUT, TOL_ATT, TOL_DQKV);
    return test_summary("test_attn_cpu");
}
