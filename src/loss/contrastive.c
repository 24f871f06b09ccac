// contrastive.c: the symmetric image-text contrastive loss (LIMoE eq. 1, CLIP-UP eqs. 1-3):
// logits = exp(scale) * img . txt^T over a batch of B L2-normalised pairs, loss = mean of the
// row-wise (image->text) and column-wise (text->image) cross-entropies with targets on the
// diagonal. `scale` is the log-parameterised temperature (CLIP's logit_scale). Covered by
// tests/test_ops.c (finite differences, golden value) and tests/test_parity.c (PyTorch).
#include <math.h>

#include "core/real.h"
#include "ops/ops.h"

double R(contrastive_forward)(real *logits, real *prow, real *pcol, const real *img,
                              const real *txt, real scale, int B, int E, double *acc) {
    const real t = REXP(scale);
    // B x B x E is small next to the encoders: plain loops keep the sums in a fixed order
    for (int i = 0; i < B; i++)
        for (int j = 0; j < B; j++) {
            real d = 0;
            for (int c = 0; c < E; c++) d += img[(size_t)i * E + c] * txt[(size_t)j * E + c];
            logits[(size_t)i * B + j] = t * d;
        }
    double loss = 0;
    int right_i2t = 0, right_t2i = 0;
    for (int i = 0; i < B; i++) { // rows: image i against every text
        const real *l = logits + (size_t)i * B;
        real mx = l[0];
        int arg = 0;
        for (int j = 1; j < B; j++)
            if (l[j] > mx) mx = l[j], arg = j;
        double s = 0;
        for (int j = 0; j < B; j++) s += (prow[(size_t)i * B + j] = REXP(l[j] - mx));
        for (int j = 0; j < B; j++) prow[(size_t)i * B + j] = (real)(prow[(size_t)i * B + j] / s);
        loss += -(l[i] - mx - log(s));
        right_i2t += arg == i;
    }
    for (int j = 0; j < B; j++) { // columns: text j against every image
        real mx = logits[j];
        int arg = 0;
        for (int i = 1; i < B; i++)
            if (logits[(size_t)i * B + j] > mx) mx = logits[(size_t)i * B + j], arg = i;
        double s = 0;
        for (int i = 0; i < B; i++) s += (pcol[(size_t)i * B + j] = REXP(logits[(size_t)i * B + j] - mx));
        for (int i = 0; i < B; i++) pcol[(size_t)i * B + j] = (real)(pcol[(size_t)i * B + j] / s);
        loss += -(logits[(size_t)j * B + j] - mx - log(s));
        right_t2i += arg == j;
    }
    if (acc) {
        acc[0] = (double)right_i2t / B;
        acc[1] = (double)right_t2i / B;
    }
    return loss / (2.0 * B);
}

void R(contrastive_backward)(real *dimg, real *dtxt, real *dscale, const real *logits,
                             const real *prow, const real *pcol, const real *img, const real *txt,
                             real scale, int B, int E, double dloss) {
    const real t = REXP(scale);
    const real k = (real)(dloss * 0.5 / B);
    real ds = 0;
    for (int i = 0; i < B; i++) {
        for (int j = 0; j < B; j++) {
            size_t ij = (size_t)i * B + j;
            real g = k * (prow[ij] + pcol[ij] - (i == j ? 2 : 0)); // d loss / d logits[i][j]
            ds += g * logits[ij]; // logits = exp(scale) * dot, so d/dscale = logits
            const real *ti = txt + (size_t)j * E, *ii = img + (size_t)i * E;
            real *di = dimg + (size_t)i * E, *dt = dtxt + (size_t)j * E;
            for (int c = 0; c < E; c++) {
                di[c] += g * t * ti[c];
                dt[c] += g * t * ii[c];
            }
        }
    }
    *dscale += ds;
}
