// aux.c: the auxiliary losses of one routing group and their gradients w.r.t. the router logits:
// importance/load/v-loss (V-MoE, LIMoE B.1), z-loss and switch balance (ST-MoE, CLIP-UP eq. 5),
// local/global entropy (LIMoE eq. 2), mutual information (B.1), target/merged entropy (E.1).
// Covered by tests/test_moe_route.c (hand-worked values, finite differences, PyTorch fixture).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "core/real.h"
#include "core/core.h"
#include "moe/aux.h"

// Entropies use the natural log with 0 log 0 = 0. Per-token entropies take log p from the
// log-softmax (l - logsumexp), which is exact and finite even where p underflows to 0, so
// p log p -> 0 and its gradient -p (log p + H) stays finite. Entropies of mean distributions
// (global, mutual information, merged) use p log max(p, 1e-30): identical above 1e-30, and below
// it the term is < 1e-28 in value and its gradient is finite (the torch reference does the same).
#define AUX_TINY 1e-30

// Doubles of scratch: P and G (S,E), three (S) vectors, eight (E) vectors, then Z (S,E), the load
// loss's per-token terms (after the rest, so P and lse survive a load call and the CUDA table's
// view of the first part is unchanged).
#define AUX_DOUBLES(S, E) (3 * (size_t)(S) * (size_t)(E) + 3 * (size_t)(S) + 8 * (size_t)(E))

#ifndef VLMOE_REAL_F64
// Plain (not suffixed): compiled once, in the float pass. Counted in floats, two per double, plus
// one so a 4-byte-aligned float buffer can be aligned up to 8 bytes.
size_t aux_scratch_floats(int S, int E) { return 2 * AUX_DOUBLES(S, E) + 1; }
#endif

typedef struct {
    int S, E, K;
    const real *l;          // (S,E) clean logits
    const uint8_t *mod;     // (S) or NULL (all image)
    int n[2];               // tokens per modality
    double *P;              // (S,E) clean softmax
    double *G;              // (S,E) accumulates d(loss)/d(P), taken through the softmax at the end;
                            // NULL in a forward (no dlogits): the losses then skip their gradients
    double *Z;              // (S,E) the load loss's per-token terms
    int load_kept;          // Z, thr and e* hold them already (AUX_KEPT_LOAD)
    double *lse;            // (S) logsumexp of each token's logits
    double *tS1, *tS2;      // (S) per-token temporaries
    double *v[8];           // (E) per-expert temporaries
} aux_ctx;

static int mod_of(const aux_ctx *c, int s) { return c->mod ? c->mod[s] : VLMOE_MOD_IMAGE; }
static double xlogx(double p) { return p * log(p > AUX_TINY ? p : AUX_TINY); }
static double logt(double p) { return log(p > AUX_TINY ? p : AUX_TINY); }

// Squared coefficient of variation (population std / mean)^2 of x (E); dx (E) receives its
// gradient. d/dx_e [var/m^2] = 2 (x_e - m)/(E m^2) - 2 var/(E m^3). A zero mean (impossible for
// importance, whose mean is S/E, and for load, whose top-K terms are >= 1/2) gives 0.
static double cv2(const double *x, int E, double *dx) {
    double m = 0, var = 0;
    for (int e = 0; e < E; e++) m += x[e];
    m /= E;
    for (int e = 0; e < E; e++) var += (x[e] - m) * (x[e] - m);
    var /= E;
    for (int e = 0; e < E; e++) dx[e] = m != 0 ? 2.0 / (E * m * m) * ((x[e] - m) - var / m) : 0;
    return m != 0 ? var / (m * m) : 0;
}

// Index of the k-th (0-based) largest of x (E) in the order (value descending, index ascending):
// the same tie rule as the routing's top-K.
static int kth_largest(const real *x, int E, int k) {
    int prev = -1;
    for (int r = 0; r <= k; r++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            if (prev >= 0 && !(x[e] < x[prev] || (x[e] == x[prev] && e > prev))) continue;
            if (best < 0 || x[e] > x[best]) best = e;
        }
        prev = best;
    }
    return prev;
}

// importance: imp_e = sum_s P[s,e]; loss = cv2(imp). G += f dL/dP.
static double loss_importance(aux_ctx *c, double f) {
    double *imp = c->v[0], *dimp = c->v[1];
    for (int e = 0; e < c->E; e++) imp[e] = 0;
    for (int s = 0; s < c->S; s++)
        for (int e = 0; e < c->E; e++) imp[e] += c->P[(size_t)s * c->E + e];
    double L = cv2(imp, c->E, dimp);
    for (int s = 0; c->G && s < c->S; s++)
        for (int e = 0; e < c->E; e++) c->G[(size_t)s * c->E + e] += f * dimp[e];
    return L;
}

// load (V-MoE; LIMoE B.1): thr_s = K-th largest noisy logit of token s, P[s,e] = 1 -
// Phi((thr_s - l[s,e])/sigma), sigma = noise_std/E; load_e = mean_s P[s,e]; loss = cv2(load).
// The gradient reaches l[s,e] and, like the V-MoE reference (which does not stop gradients), the
// threshold's own logit: thr_s = l[s,e*] + fixed noise, so d thr_s / d l[s,e*] = 1. wf = weight*f
// (this loss adds straight into dlogits; it does not go through the softmax).
static double loss_load(aux_ctx *c, const real *nl, double noise_std, double wf, real *dl) {
    const int S = c->S, E = c->E;
    const double sigma = noise_std / E;
    if (!nl || !(sigma > 0) || !isfinite(sigma)) return 0; // no noise: the loss does not apply
    double *thr = c->tS1, *estar = c->tS2, *load = c->v[2], *dload = c->v[3], *Z = c->Z;
    // Tokens are independent: threads fill Z's rows (an erfc per logit, most of this loss's
    // time), then one thread sums them in token order, so the bits do not depend on the threads.
#pragma omp parallel for schedule(static) if ((size_t)S * E >= 8192)
    for (int s = 0; s < (c->load_kept ? 0 : S); s++) {
        int k = kth_largest(nl + (size_t)s * E, E, c->K - 1);
        estar[s] = k, thr[s] = nl[(size_t)s * E + k];
        for (int e = 0; e < E; e++) {
            double z = (thr[s] - (double)c->l[(size_t)s * E + e]) / sigma;
            Z[(size_t)s * E + e] = 0.5 * erfc(z / sqrt(2.0)); // 1 - Phi(z) without cancellation
        }
    }
    for (int e = 0; e < E; e++) load[e] = 0;
    for (int s = 0; s < S; s++)
        for (int e = 0; e < E; e++) load[e] += Z[(size_t)s * E + e];
    for (int e = 0; e < E; e++) load[e] /= S;
    double L = cv2(load, E, dload);
    if (dl) {
        const double inv = 0.39894228040143267794; // 1/sqrt(2 pi)
        // rows are independent (each token writes its own; Z's row, summed above, is its temp)
#pragma omp parallel for schedule(static) if ((size_t)S * E >= 8192)
        for (int s = 0; s < S; s++) {
            double *row = Z + (size_t)s * E;
            // The direct and the threshold terms of l[s,e*] nearly cancel: sum them in double
            // and round to the caller's type once.
            double dthr = 0;
            for (int e = 0; e < E; e++) {
                double z = (thr[s] - (double)c->l[(size_t)s * E + e]) / sigma;
                // dP/dz = -phi(z); dz/dl = -1/sigma; dz/dthr = +1/sigma.
                row[e] = dload[e] / S * inv * exp(-0.5 * z * z) / sigma;
                dthr -= row[e];
            }
            row[(int)estar[s]] += dthr;
            for (int e = 0; e < E; e++) dl[(size_t)s * E + e] += (real)(wf * row[e]);
        }
    }
    return L;
}

// z-loss (ST-MoE; LIMoE B.1) per modality, like CLIP-UP's per tower: sum over the modalities m
// present of mean_{s in m} logsumexp(l_s)^2; d/dl[s,e] = 2/n_m lse_s P[s,e]. A group of one
// modality gives the plain mean over the group.
static double loss_z(aux_ctx *c, double wf, real *dl) {
    double L[2] = {0, 0};
    for (int s = 0; s < c->S; s++) L[mod_of(c, s)] += c->lse[s] * c->lse[s];
    if (dl)
        for (int s = 0; s < c->S; s++)
            for (int e = 0; e < c->E; e++)
                dl[(size_t)s * c->E + e] +=
                    (real)(wf * 2.0 / c->n[mod_of(c, s)] * c->lse[s] * c->P[(size_t)s * c->E + e]);
    return (c->n[0] ? L[0] / c->n[0] : 0) + (c->n[1] ? L[1] / c->n[1] : 0);
}

// switch balance (ST-MoE, CLIP-UP eq. 5) over the tokens of modality m (m < 0: all of the
// group's): sum_e R_e P_e, R_e = E/(K n) wanted[e] (a constant: counts are piecewise constant),
// P_e = mean_s P[s,e] over those n tokens.
static double loss_switch(aux_ctx *c, int m, const int32_t *wanted, double f) {
    const int S = c->S, E = c->E, n = m < 0 ? S : c->n[m];
    double *pm = c->v[0], L = 0;
    if (!n) return 0;
    for (int e = 0; e < E; e++) pm[e] = 0;
    for (int s = 0; s < S; s++)
        if (m < 0 || mod_of(c, s) == m)
            for (int e = 0; e < E; e++) pm[e] += c->P[(size_t)s * E + e];
    for (int e = 0; e < E; e++) {
        double R = (double)E / ((double)c->K * n) * wanted[e];
        L += R * pm[e] / n;
        for (int s = 0; c->G && s < S; s++)
            if (m < 0 || mod_of(c, s) == m) c->G[(size_t)s * E + e] += f * R / n;
    }
    return L;
}

// log p[s,e] from the log-softmax (exact, finite).
static double logp(const aux_ctx *c, int s, int e) {
    return (double)c->l[(size_t)s * c->E + e] - c->lse[s];
}

// Mean over the tokens of modality m (m < 0: all tokens) of H(p_s); 0 when there are none.
static double mean_token_entropy(aux_ctx *c, int m) {
    double H = 0;
    int n = 0;
    for (int s = 0; s < c->S; s++) {
        if (m >= 0 && mod_of(c, s) != m) continue;
        n++;
        for (int e = 0; e < c->E; e++) H -= c->P[(size_t)s * c->E + e] * logp(c, s, e);
    }
    return n ? H / n : 0;
}
// G += fg * d(mean_token_entropy)/dP, fg being the outer derivative; dH/dp_e = -(log p_e + 1).
static void mean_token_entropy_grad(aux_ctx *c, int m, double fg) {
    int n = m < 0 ? c->S : c->n[m];
    if (!n || fg == 0 || !c->G) return;
    for (int s = 0; s < c->S; s++) {
        if (m >= 0 && mod_of(c, s) != m) continue;
        for (int e = 0; e < c->E; e++) c->G[(size_t)s * c->E + e] -= fg * (logp(c, s, e) + 1) / n;
    }
}

// pbar (E) = mean of P over the tokens of modality m (n_m > 0).
static void mean_gate(const aux_ctx *c, int m, double *pbar) {
    for (int e = 0; e < c->E; e++) pbar[e] = 0;
    for (int s = 0; s < c->S; s++)
        if (mod_of(c, s) == m)
            for (int e = 0; e < c->E; e++) pbar[e] += c->P[(size_t)s * c->E + e];
    for (int e = 0; e < c->E; e++) pbar[e] /= c->n[m];
}

static double entropy(const double *p, int E) {
    double H = 0;
    for (int e = 0; e < E; e++) H -= xlogx(p[e]);
    return H;
}

// global entropy (LIMoE sec. 2.2.2, "thresholded"): max(0, tau_m - H(pbar_m)), tau_m = log(S_m)
// with S_m the soft minimum number of experts (so tau = 0 = log 1 is a legal threshold the paper
// uses, Table 5; it switches the loss off since H >= 0). At exactly tau_m = H the loss is
// inactive and its gradient 0 (relu).
static double loss_global_entropy(aux_ctx *c, int m, double tau, double f) {
    if (!c->n[m]) return 0;
    double *pbar = c->v[0];
    mean_gate(c, m, pbar);
    double L = tau - entropy(pbar, c->E);
    if (!(L > 0)) return 0;
    // dL/dpbar_e = log pbar_e + 1; dpbar_e/dP[s,e] = 1/S_m for tokens of m.
    for (int s = 0; c->G && s < c->S; s++)
        if (mod_of(c, s) == m)
            for (int e = 0; e < c->E; e++)
                c->G[(size_t)s * c->E + e] += f * (logt(pbar[e]) + 1) / c->n[m];
    return L;
}

// mutual information (LIMoE B.1): (1/M) sum_m H(pbar_m) - H((1/M) sum_m pbar_m) over the M
// modalities present in the group (M = 1 gives 0). dL/dpbar_m,e = (log mix_e - log pbar_m,e)/M.
static double loss_mi(aux_ctx *c, double f) {
    double *pb[2] = {c->v[0], c->v[1]}, *mix = c->v[2];
    int M = 0;
    for (int e = 0; e < c->E; e++) mix[e] = 0;
    for (int m = 0; m < 2; m++) {
        if (!c->n[m]) continue;
        M++;
        mean_gate(c, m, pb[m]);
        for (int e = 0; e < c->E; e++) mix[e] += pb[m][e];
    }
    double L = 0;
    for (int e = 0; e < c->E; e++) mix[e] /= M;
    for (int m = 0; m < 2; m++)
        if (c->n[m]) L += entropy(pb[m], c->E) / M;
    L -= entropy(mix, c->E);
    for (int s = 0; c->G && s < c->S; s++) {
        int m = mod_of(c, s);
        for (int e = 0; e < c->E; e++)
            c->G[(size_t)s * c->E + e] +=
                f * (logt(mix[e]) - logt(pb[m][e])) / ((double)M * c->n[m]);
    }
    return L;
}

// merged entropy (LIMoE E.1): per token of modality m the two-outcome distribution (q = sum of the
// top-K gates, r = sum of the rest), mean over those tokens of H(q, r); 0 when the group has none.
// r is summed directly, not 1 - q, so it keeps its digits.
static double loss_merged(aux_ctx *c, int m, double f) {
    const int S = c->S, E = c->E, K = c->K, n = c->n[m];
    double *top = c->v[0], L = 0;
    if (!n) return 0;
    for (int s = 0; s < S; s++) {
        if (mod_of(c, s) != m) continue;
        const real *ls = c->l + (size_t)s * E;
        const double *p = c->P + (size_t)s * E;
        for (int e = 0; e < E; e++) top[e] = 0;
        // Top-K by logit (same order as by gate, without ties created by underflow).
        for (int k = 0; k < K; k++) top[kth_largest(ls, E, k)] = 1;
        double q = 0, r = 0;
        for (int e = 0; e < E; e++) {
            if (top[e] != 0) q += p[e];
            else r += p[e];
        }
        L -= xlogx(q) + xlogx(r);
        if (!c->G) continue;
        double gq = -(logt(q) + 1) / n, gr = -(logt(r) + 1) / n;
        for (int e = 0; e < E; e++) c->G[(size_t)s * E + e] += f * (top[e] != 0 ? gq : gr);
    }
    return L / n;
}

double R(aux_loss)(vlmoe_aux_kind kind, const R(aux_input) *in, double weight, real *dlogits,
                   real *scratch) {
    if (!in || !in->logits || !scratch) {
        vlmoe_fail(VLMOE_ERR_ARG, "aux loss: input, logits and scratch must be given");
        return NAN;
    }
    const int S = in->S, E = in->E, K = in->K;
    if (S < 1 || E < 1 || K < 1 || K > E || (int)kind < 0 || (int)kind >= VLMOE_AUX_COUNT) {
        vlmoe_fail(VLMOE_ERR_ARG, "aux loss %d: need S >= 1, E >= 1, 1 <= K <= E (got S=%d E=%d K=%d)",
                   (int)kind, S, E, K);
        return NAN;
    }
    aux_ctx c = {.S = S, .E = E, .K = K, .l = in->logits, .mod = in->modality};
    for (int s = 0; s < S; s++) {
        int m = mod_of(&c, s);
        if (m != VLMOE_MOD_IMAGE && m != VLMOE_MOD_TEXT) {
            vlmoe_fail(VLMOE_ERR_ARG, "aux loss %s: modality[%d] = %d is not image (0) or text (1)",
                       vlmoe_aux_name(kind), s, m);
            return NAN;
        }
        c.n[m]++;
    }
    if (kind == VLMOE_AUX_SWITCH && (c.n[0] && c.n[1] ? !in->wanted_mod : !in->wanted)) {
        vlmoe_fail(VLMOE_ERR_ARG, "aux loss switch: the per-expert counts `%s` must be given",
                   c.n[0] && c.n[1] ? "wanted_mod" : "wanted");
        return NAN;
    }
    // Double intermediates in the caller's buffer, aligned up to double (see aux.h).
    uintptr_t a = ((uintptr_t)scratch + (sizeof(double) - 1)) & ~(uintptr_t)(sizeof(double) - 1);
    double *d = (double *)a;
    const size_t SE = (size_t)S * E;
    c.P = d, c.G = d + SE, c.lse = d + 2 * SE, c.tS1 = c.lse + S, c.tS2 = c.tS1 + S;
    for (int i = 0; i < 8; i++) c.v[i] = c.tS2 + S + (size_t)i * E;
    c.Z = c.v[7] + E;
    // a forward: the value only; the load loss adds into dlogits itself and collects no G
    if (!dlogits || kind == VLMOE_AUX_LOAD) c.G = NULL;

    // Clean gates in double: P = exp(l - max) / sum, lse = max + log(sum). One exp per logit (the
    // libm calls were most of the losses' time in a bench-s step: every loss of every group
    // computes them, forward and backward), and rows are independent, so threads split them
    // without changing a bit; a small group stays on one thread. The load loss reads none of
    // them, and the caller says when the previous loss of the group left them here (kept).
    const int need_P = kind != VLMOE_AUX_LOAD && !(in->kept & AUX_KEPT_P);
    c.load_kept = (in->kept & AUX_KEPT_LOAD) != 0;
#pragma omp parallel for schedule(static) if (need_P && S >= 1024)
    for (int s = 0; s < (need_P ? S : 0); s++) {
        const real *ls = in->logits + (size_t)s * E;
        double *p = c.P + (size_t)s * E, mx = ls[0], sum = 0;
        for (int e = 1; e < E; e++) mx = ls[e] > mx ? ls[e] : mx;
        for (int e = 0; e < E; e++) sum += (p[e] = exp((double)ls[e] - mx));
        c.lse[s] = mx + log(sum);
        const double inv = 1 / sum;
        for (int e = 0; e < E; e++) p[e] *= inv;
    }
    if (c.G) memset(c.G, 0, SE * sizeof(double));

    double L = 0;
    switch (kind) {
    case VLMOE_AUX_IMPORTANCE: L = loss_importance(&c, 1); break;
    case VLMOE_AUX_LOAD: L = loss_load(&c, in->noisy_logits, in->noise_std, weight, dlogits); break;
    case VLMOE_AUX_VLOSS: // V-MoE / VL-MoE: the mean of the two classic losses
        L = 0.5 * loss_importance(&c, 0.5) +
            0.5 * loss_load(&c, in->noisy_logits, in->noise_std, 0.5 * weight, dlogits);
        break;
    case VLMOE_AUX_ZLOSS: L = loss_z(&c, weight, dlogits); break;
    case VLMOE_AUX_SWITCH:
        // CLIP-UP computes it per tower; with a shared backbone, per modality: the sum of each
        // modality's own balance over its own assignments (MOE.md)
        if (c.n[0] && c.n[1])
            L = loss_switch(&c, VLMOE_MOD_IMAGE, in->wanted_mod, 1) + loss_switch(&c, VLMOE_MOD_TEXT, in->wanted_mod + E, 1);
        else
            L = loss_switch(&c, -1, in->wanted, 1);
        break;
    case VLMOE_AUX_LOCAL_ENT_IMAGE:
    case VLMOE_AUX_LOCAL_ENT_TEXT: {
        int m = kind == VLMOE_AUX_LOCAL_ENT_TEXT ? VLMOE_MOD_TEXT : VLMOE_MOD_IMAGE;
        L = mean_token_entropy(&c, m); // 0 when the group has no token of m
        mean_token_entropy_grad(&c, m, 1);
        break;
    }
    case VLMOE_AUX_GLOBAL_ENT_IMAGE:
        L = loss_global_entropy(&c, VLMOE_MOD_IMAGE, in->global_tau[VLMOE_MOD_IMAGE], 1);
        break;
    case VLMOE_AUX_GLOBAL_ENT_TEXT:
        L = loss_global_entropy(&c, VLMOE_MOD_TEXT, in->global_tau[VLMOE_MOD_TEXT], 1);
        break;
    case VLMOE_AUX_MI: L = loss_mi(&c, 1); break;
    case VLMOE_AUX_TARGET_ENT: {
        // LIMoE E.1: (log K - Omega_local(G_m))^2 replaces the text local entropy, so the local
        // entropy is that of the group's text tokens only (0 loss when the group has none)
        if (!c.n[VLMOE_MOD_TEXT]) break;
        double local = mean_token_entropy(&c, VLMOE_MOD_TEXT), t = log((double)K) - local;
        L = t * t;
        mean_token_entropy_grad(&c, VLMOE_MOD_TEXT, -2 * t); // dL/dlocal = -2 (log K - local)
        break;
    }
    case VLMOE_AUX_MERGED_ENT: L = loss_merged(&c, VLMOE_MOD_TEXT, 1); break;
    default: break;
    }

    // Gradients collected w.r.t. P go through the softmax: dl_j = P_j (G_j - sum_e G_e P_e).
    if (c.G) {
#pragma omp parallel for schedule(static) if (S >= 1024)
        for (int s = 0; s < S; s++) {
            const double *p = c.P + (size_t)s * E, *g = c.G + (size_t)s * E;
            double dot = 0;
            for (int e = 0; e < E; e++) dot += g[e] * p[e];
            for (int e = 0; e < E; e++) dlogits[(size_t)s * E + e] += (real)(weight * p[e] * (g[e] - dot));
        }
    }
    return L;
}
