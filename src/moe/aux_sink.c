// aux_sink.c: the auxiliary losses' forward values of a device step, added up after the step's
// one download (moe_aux_sink in src/moe/layer.h; the values are written by src/moe/layer.c).
// Covered by tests/test_graphprep.c (bit for bit against the CPU table's step).
#include "core/core.h"
#include "moe/layer.h"

double moe_aux_sink_take(moe_aux_sink *k, const double *slots) {
    // moe_aux's own sums in its order: per loss the group values in slot order, the mean over
    // the groups, the weighted total; then the totals in call order, as block_forward adds
    // them into the graph's aux (from 0)
    double aux = 0;
    for (int i = 0; i < k->nrec; i++) {
        const moe_aux_rec *r = &k->rec[i];
        double total = 0;
        for (int a = 0; a < VLMOE_AUX_COUNT; a++) {
            if (r->w[a] == 0) continue;
            double v = 0;
            if (r->at[a] < 0) {
                v = r->host[a];
            } else {
                for (int j = 0; j < r->n[a]; j++) v += slots[r->at[a] + j];
            }
            if (r->s) r->s->aux[a] = v / r->G;
            total += r->w[a] * (v / r->G);
        }
        aux += total;
    }
    k->nrec = k->used = 0;
    return aux;
}

void moe_aux_sink_free(moe_aux_sink *k) {
    if (!k) return;
    vlmoe_free_mem(k->rec);
    k->rec = NULL, k->nrec = k->rec_cap = 0;
}
