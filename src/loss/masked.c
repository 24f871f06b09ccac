// masked.c: softmax cross-entropy over the masked positions of MLM / MIM / VLM (VL-MoE sec. 3.1).
// The log-sum-exp is taken in double around the row maximum so large vocabularies stay exact.
// Covered by tests/test_mome.c (golden values, finite differences) and tests/test_parity.c.
#include <math.h>

#include "core/real.h"
#include "loss/masked.h"

double R(xent_forward)(real *probs, const real *logits, const int32_t *labels, int n, int C,
                       int *correct) {
    double loss = 0;
    int right = 0;
    for (int i = 0; i < n; i++) {
        const real *l = logits + (size_t)i * C;
        real *p = probs + (size_t)i * C;
        int arg = 0;
        for (int c = 1; c < C; c++)
            if (l[c] > l[arg]) arg = c;
        const double mx = l[arg], target = l[labels[i]];
        double s = 0;
        for (int c = 0; c < C; c++) s += exp((double)l[c] - mx);
        loss += log(s) + mx - target;
        for (int c = 0; c < C; c++) p[c] = (real)(exp((double)l[c] - mx) / s);
        right += arg == labels[i];
    }
    if (correct) *correct = right;
    return loss;
}

void R(xent_backward)(real *dlogits, const real *probs, const int32_t *labels, int n, int C,
                      double scale) {
    const real k = (real)scale;
    for (int i = 0; i < n; i++) {
        real *d = dlogits + (size_t)i * C;
        const real *p = probs + (size_t)i * C;
        for (int c = 0; c < C; c++) d[c] += k * p[c];
        d[labels[i]] -= k;
    }
}
