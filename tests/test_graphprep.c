// test_graphprep.c: a device training step that waits once (issue 16, docs/GPU.md "Host
// synchronisations left in a CUDA training step"): the auxiliary losses' values (aux_loss_dev into
// the step's scalar buffer, src/moe/layer.c + src/moe/aux_sink.c) and the logit scale
// (contrastive_forward_dsc / _backward_dsc) stay on the device until the step's one download.
// On tests/sep_mem.h's separate-memory table, resident AdamW steps of limoe-tiny, clipup-tiny,
// limoe-tiny with disjoint pools and with gradient checkpointing equal the CPU table's bit for
// bit (step statistics, every MoE layer's logged aux values, parameters) with exactly one
// download, no sync and no op's value waited for in each step. The table here makes the values
// the device ops leave in its memory visible only at the next download or sync, as a GPU's
// stream would: NaN until then, so any read before the download changes the results (control).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "nn/model.h"
#include "sep_mem.h"
#include "train/run.h"
#include "test.h"

// ---- late values: what aux_loss_dev and contrastive_forward_dsc write shows at the next wait
enum { LATE_MAX = 4096 };
static struct { double *at, v; } late[LATE_MAX];
static int nlate, late_lost;
static long late_bytes; // download_bytes calls (the packed layout's expert offsets)
static void late_put(double *at, double v) {
    if (nlate == LATE_MAX) {
        late_lost++;
        *at = v;
        return;
    }
    late[nlate].at = at, late[nlate++].v = v, *at = NAN;
}
static int late_never; // control: the values never show (a download that brought stale memory)
static void late_flush(void) {
    if (late_never) return;
    for (int i = 0; i < nlate; i++) *late[i].at = late[i].v;
    nlate = 0;
}
static void late_aux_dev(const sep_be *be, vlmoe_aux_kind kind, const aux_input_f32 *in, float *scratch, double *out) {
    sep_aux_dev(be, kind, in, scratch, out);
    late_put(out, *out);
}
static void late_con_dsc(const sep_be *be, float *logits, float *prow, float *pcol, const float *img,
                         const float *txt, const float *scale, int B, int E, double *out) {
    (void)be, SEP(logits, "contrastive_forward_dsc", "logits"), SEP(scale, "contrastive_forward_dsc", "scale");
    SEP(img, "contrastive_forward_dsc", "img"), SEP(txt, "contrastive_forward_dsc", "txt");
    SEP(out, "contrastive_forward_dsc", "out");
    sep_cpu->contrastive_forward_dsc(sep_cpu, logits, prow, pcol, img, txt, scale, B, E, out);
    for (int i = 0; i < 4; i++) late_put(out + i, out[i]);
}
static void late_download(const sep_be *be, float *host, const float *src, size_t n) {
    late_flush();
    sep_download(be, host, src, n);
}
static void late_download_bytes(const sep_be *be, void *host, const void *src, size_t n) {
    late_flush();
    sep_traffic.downloads++, late_bytes++; // a wait like any other
    sep_download_bytes(be, host, src, n);
}
static int late_sync(const sep_be *be) {
    late_flush();
    return sep_sync(be);
}

static int late_fixed; // the fixed-capacity layout in training, as the CUDA table wants
static vlmoe_backend_f32 late_table(void) {
    vlmoe_backend_f32 t = sep_table();
    t.aux_loss_dev = late_aux_dev, t.contrastive_forward_dsc = late_con_dsc;
    t.download = late_download, t.download_bytes = late_download_bytes, t.sync = late_sync;
    t.name = "cpu-separate-late";
    nlate = late_lost = 0;
    sep_fixed = late_fixed;
    return t;
}

enum { B = 6, STEPS = 4 };

typedef struct {
    const char *name;
    int pools, ckpt, tiny_cap; // disjoint pools; gradient checkpointing; 1 aux slot at first
} variant;

// The largest |a - b| over the largest |a| (0 when equal).
static double rel_gap(const float *a, const float *b, size_t n) {
    double d = 0, m = 0;
    for (size_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - b[i])), m = fmax(m, fabs((double)a[i]));
    return m > 0 ? d / m : d;
}

// fixed 0: the packed layout, which the CPU table's step computes bit for bit, and which
// downloads each MoE layer's E+1 expert offsets besides; fixed 1: the fixed-capacity layout the
// CUDA table routes into: nothing but the step's one download, results within 2e-6 of the CPU's
// (padding rows change the row count of the CPU's sgemm: tests/test_route_op.c)
static void check(const variant *v, int fixed) {
    vlmoe_model_config c;
    vlmoe_config_named(v->name, &c);
    if (v->pools) c.moe.order = VLMOE_ORDER_FIFO, c.moe.text_experts = 2, c.moe.router_per_modality = 1;
    late_fixed = fixed;
    vlmoe_backend_f32 dev = late_table();
    vlmoe_synth *s = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c.image_size;
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.grad_clip_norm = 0.05;
    const int T = c.context_length;
    const size_t isz = (size_t)3 * c.image_size * c.image_size;
    float *img = malloc(sizeof(float) * isz * B * STEPS);
    int32_t *tok = malloc(sizeof(int32_t) * B * T * STEPS), *len = malloc(sizeof(int32_t) * B * STEPS);
    vlmoe_model *m[2] = {NULL};
    vlmoe_trainer *t[2] = {NULL};
    int st = vlmoe_synth_init(&s, &sp);
    for (int i = 0; i < STEPS && !st; i++)
        st = vlmoe_synth_batch(s, VLMOE_SPLIT_TRAIN, (uint64_t)i * B, B, T, img + isz * B * i, tok + (size_t)B * T * i,
                               len + B * i);
    for (int k = 0; k < 2 && !st; k++) {
        st = vlmoe_model_init(&m[k], &c, 11);
        if (!st && v->ckpt) st = vlmoe_model_set_grad_checkpointing(m[k], 1);
        if (!st && k) st = model_set_backend(m[k], &dev, NULL);
        if (!st) st = vlmoe_trainer_init(&t[k], m[k], &tp);
    }
    CHECK(st == VLMOE_OK, "%s: %s", v->name, vlmoe_last_error());
    if (st) goto done;
    // a smaller buffer than the step wants: the values that do not fit are waited for (the same
    // bits) and the next step plans room for all of them
    if (v->tiny_cap) m[1]->aux_cap = 1;
    const size_t total = m[0]->L.total;
    int nmoe = 0, stats_same = 0, aux_same = 0, aux_active = 0;
    long downs[STEPS] = {0}, waits[STEPS] = {0}, slots[STEPS] = {0}, offs[STEPS] = {0}, pageable[STEPS] = {0};
    long fixed_up[STEPS] = {0};
    double gap = 0;
    for (int i = 0; i < STEPS && !st; i++) {
        const vlmoe_batch b = {B, img + isz * B * i, tok + (size_t)B * T * i, len + B * i};
        vlmoe_step_stats ss[2];
        for (int k = 0; k < 2 && !st; k++) {
            if (k) memset(&sep_traffic, 0, sizeof(sep_traffic)), late_bytes = 0;
            st = vlmoe_trainer_step(t[k], &b, &ss[k]);
        }
        if (st) break;
        downs[i] = sep_traffic.downloads - late_bytes, offs[i] = late_bytes;
        waits[i] = sep_traffic.scalar_ops + sep_traffic.syncs;
        slots[i] = sep_traffic.aux_dev;
        pageable[i] = sep_traffic.pageable_uploads, fixed_up[i] = sep_traffic.fixed_uploads;
        stats_same += !memcmp(&ss[0], &ss[1], sizeof(ss[0]));
        const float l0 = (float)ss[0].loss, l1 = (float)ss[1].loss, a0 = (float)ss[0].aux, a1 = (float)ss[1].aux;
        gap = fmax(gap, fmax(rel_gap(&l0, &l1, 1), rel_gap(&a0, &a1, 1)));
        // every MoE layer's logged auxiliary values (the stats read on a logging step)
        const vlmoe_moe_stats *a = vlmoe_model_moe_stats(m[0], &nmoe), *d = vlmoe_model_moe_stats(m[1], NULL);
        int same = a && d;
        for (int l = 0; same && l < nmoe; l++) {
            same &= !memcmp(a[l].aux, d[l].aux, sizeof(a[l].aux));
            for (int q = 0; q < VLMOE_AUX_COUNT; q++) aux_active += a[l].aux[q] != 0;
        }
        aux_same += same;
        if (i == 0 && !fixed)
            printf("%s%s%s%s step 1: loss %.17g (aux %.17g), temperature %.9g, on separate memory %.17g (aux %.17g)\n",
                   v->name, v->pools ? " (pools)" : "", v->ckpt ? " (checkpointing)" : "", v->tiny_cap ? " (1 slot)" : "",
                   ss[0].loss, ss[0].aux, ss[0].temperature, ss[1].loss, ss[1].aux);
    }
    CHECK(st == VLMOE_OK, "%s steps: %s", v->name, vlmoe_last_error());
    CHECK(m[1]->resident, "%s: the separate-memory model is not resident (AdamW on the device expected)", v->name);
    CHECK(aux_active > 0, "%s: no auxiliary loss is active (the test must exercise them)", v->name);
    if (!fixed) {
        CHECK(stats_same == STEPS, "%s: step statistics equal the CPU table's in %d of %d steps", v->name, stats_same,
              STEPS);
        CHECK(aux_same == STEPS, "%s: the MoE layers' logged aux values equal the CPU table's in %d of %d steps",
              v->name, aux_same, STEPS);
        CHECK(!st && !memcmp(vlmoe_model_param_data(m[1]), m[0]->params, sizeof(float) * total),
              "%s: parameters after %d steps differ from the CPU table's", v->name, STEPS);
    } else if (!st) {
        gap = fmax(gap, rel_gap(m[0]->params, vlmoe_model_param_data(m[1]), total));
        CHECK(gap <= 2e-6, "%s, fixed layout: losses, aux and parameters within %.3g of the CPU's (bound 2e-6)",
              v->name, gap);
    }
    for (int i = 0; i < STEPS; i++) {
        const int first_waits = v->tiny_cap && i == 0; // the values past the one slot
        CHECK(downs[i] == 1 && offs[i] == (fixed ? 0 : nmoe) && (first_waits ? waits[i] > 0 : waits[i] == 0),
              "%s step %d: %ld downloads, %ld of expert offsets, %ld waits (op values or syncs), expected 1, %d and %s",
              v->name, i + 1, downs[i], offs[i], waits[i], fixed ? 0 : nmoe, first_waits ? "some" : "0");
        // from pageable memory only the batch (src/nn/graph.c: the images as floats, the token ids,
        // the lengths) and, on the first step, the parameters and moments; the MoE layer's from the
        // table's fixed buffers
        CHECK((i ? pageable[i] == 3 : pageable[i] >= 3) && fixed_up[i] > 0,
              "%s step %d: %ld uploads from pageable memory (expected %s3: images, tokens, lengths), %ld from the "
              "table's host memory", v->name, i + 1, pageable[i], i ? "" : ">= ", fixed_up[i]);
        CHECK(slots[i] > (first_waits ? 0 : 1), "%s step %d: %ld auxiliary values left on the device", v->name, i + 1,
              slots[i]);
    }
    printf("  %s layout, per step: %ld download + %ld of expert offsets, %ld waits, %ld auxiliary values on the "
           "device (%d MoE layers), uploads %ld pageable + %ld from fixed buffers; first step: %ld waits; largest gap "
           "to the CPU %.3g\n", fixed ? "fixed" : "packed", downs[STEPS - 1], offs[STEPS - 1], waits[STEPS - 1],
           slots[STEPS - 1], nmoe, pageable[STEPS - 1], fixed_up[STEPS - 1], waits[0], gap);
    CHECK(sep_stray == 0, "%s: %d host pointers handed to separate memory; first: %s", v->name, sep_stray, sep_first);
    CHECK(late_lost == 0, "%s: %d late values overflowed the test's queue", v->name, late_lost);
done:
    for (int k = 0; k < 2; k++) vlmoe_trainer_free(t[k]), vlmoe_model_free(m[k]);
    vlmoe_synth_free(s);
    free(img), free(tok), free(len);
}

// Control: between the forward and the download the values are not there (NaN on the host's
// view of the buffer, the layers' aux[] still empty); after it they are the CPU's. A read before
// the download would see these NaNs.
static void early_read_control(void) {
    vlmoe_model_config c;
    vlmoe_config_named("limoe-tiny", &c);
    late_fixed = 0;
    vlmoe_backend_f32 dev = late_table();
    vlmoe_synth *s = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c.image_size;
    const int T = c.context_length;
    float *img = malloc(sizeof(float) * 3 * c.image_size * c.image_size * B);
    int32_t *tok = malloc(sizeof(int32_t) * B * T), *len = malloc(sizeof(int32_t) * B);
    vlmoe_model *m[2] = {NULL};
    int st = vlmoe_synth_init(&s, &sp);
    if (!st) st = vlmoe_synth_batch(s, VLMOE_SPLIT_TRAIN, 0, B, T, img, tok, len);
    for (int k = 0; k < 2 && !st; k++) {
        st = vlmoe_model_init(&m[k], &c, 5);
        if (!st && k) st = model_set_backend(m[k], &dev, NULL);
    }
    const vlmoe_batch b = {B, img, tok, len};
    vlmoe_step_stats ss[2];
    memset(ss, 0, sizeof(ss));
    if (!st) st = vlmoe_model_forward(m[0], &b, &ss[0]);
    if (!st) st = vlmoe_model_backward(m[0]);
    if (!st) {
        model_defer_scalars(m[1]);
        st = vlmoe_model_forward(m[1], &b, &ss[1]);
    }
    CHECK(st == VLMOE_OK, "early-read control: %s", vlmoe_last_error());
    if (st) goto done;
    int nmoe = 0, pending = 0, filled = 0;
    const double *slot = m[1]->d_scalars + MODEL_SCALARS;
    const int used = graph_aux_slots_f32(m[1]->g, NULL);
    for (int i = 0; i < used; i++) pending += isnan(slot[i]);
    const int loss_pending = isnan(m[1]->d_scalars[0]);
    // the statistics accessor (it downloads the routing's) leaves aux[] to the step's take
    const vlmoe_moe_stats *a = m[1]->g ? vlmoe_model_moe_stats(m[1], &nmoe) : NULL;
    for (int l = 0; a && l < nmoe; l++)
        for (int q = 0; q < VLMOE_AUX_COUNT; q++) filled += a[l].aux[q] != 0;
    CHECK(used > 0 && pending == used && filled == 0 && isnan(ss[1].loss) && loss_pending,
          "early-read control: before the download %d of %d auxiliary slots pending, %d aux values already filled, "
          "loss %g (expected all pending, none filled, NaN)", pending, used, filled, ss[1].loss);
    st = vlmoe_model_backward(m[1]);
    double sumsq = 0;
    int nonfinite = 0;
    const int took = !st && model_take_scalars(m[1], &ss[1], &sumsq, &nonfinite);
    ss[0].temperature = exp(m[0]->params[m[0]->L.logit_scale]);
    CHECK(took && ss[1].loss == ss[0].loss && ss[1].aux == ss[0].aux && ss[1].contrastive == ss[0].contrastive &&
          ss[1].temperature == ss[0].temperature && !nonfinite,
          "early-read control: after the download loss %.17g aux %.17g temperature %.9g, CPU %.17g %.17g %.9g (%s)",
          ss[1].loss, ss[1].aux, ss[1].temperature, ss[0].loss, ss[0].aux, ss[0].temperature,
          st ? vlmoe_last_error() : "");
    const vlmoe_moe_stats *x = vlmoe_model_moe_stats(m[0], NULL), *y = vlmoe_model_moe_stats(m[1], NULL);
    int same = x && y;
    for (int l = 0; same && l < nmoe; l++) same &= !memcmp(x[l].aux, y[l].aux, sizeof(x[l].aux));
    CHECK(same, "early-read control: the layers' aux values after the download differ from the CPU's");
    // the values the step uses are the download's: where it brings nothing, the step stops on
    // the non-finite loss before any parameter changes
    vlmoe_trainer *t = NULL;
    vlmoe_train_params tp = vlmoe_train_default_params();
    late_never = 1;
    st = vlmoe_trainer_init(&t, m[1], &tp);
    const int bad = st ? st : vlmoe_trainer_step(t, &b, &ss[1]);
    late_never = 0;
    CHECK(bad == VLMOE_ERR_NUMERIC, "control without the values coming down: status %d (%s), expected the "
          "non-finite loss's %d", bad, vlmoe_last_error(), VLMOE_ERR_NUMERIC);
    vlmoe_trainer_free(t);
done:
    for (int k = 0; k < 2; k++) vlmoe_model_free(m[k]);
    vlmoe_synth_free(s);
    free(img), free(tok), free(len);
}

int main(void) {
    const variant v[] = {
        {.name = "limoe-tiny"},
        {.name = "clipup-tiny"},
        {.name = "limoe-tiny", .pools = 1},
        {.name = "limoe-tiny", .ckpt = 1},
        {.name = "limoe-tiny", .tiny_cap = 1},
    };
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) check(&v[i], 0), check(&v[i], 1);
    early_read_control();
    return test_summary("test_graphprep");
}
