// test_accum.c: gradient accumulation (--accum-freq, src/nn/towers_accum.c) against one step at
// the whole batch. For tiny, limoe-tiny, clipup-tiny, ec-tiny and soft-tiny (MoE layers routing
// groups of whole examples, which split every micro-batch): the loss and every gradient of 4
// micro-batches of 16 must match one batch of 64 within 1e-5, the routing counts exactly and the
// merged routing statistics to rounding; then 6 AdamW steps through the contrastive task (its data
// order) must track the batch-64 run. The command line: --accum-freq 2 at --batch-size 8 against
// --batch-size 16 on the synthetic data and on a CSV, params.json, a resumed run bit for bit, and
// the errors (--accum-freq 0, a VL-MoE model, groups that do not split a micro-batch), and a NaN
// in one micro-batch stopping the step with the parameters untouched.
#include <stdint.h>

#include "nn/model.h"
#include "test.h"
#include "train/run.h"
#include "train/tasks.h"

enum { GLOBAL = 64, MICRO = 16, NACC = GLOBAL / MICRO, STEPS = 6, NCOUNT = 512 };

// MoE layers routing groups of two whole examples (LIMoE E.5), as tests/test_train_dist.c: groups
// that divide the micro-batch are the groups of the whole batch, in the same order.
static int config(const char *name, vlmoe_model_config *c) {
    int st = vlmoe_config_named(name, c);
    const int np = (c->image_size / c->patch_size) * (c->image_size / c->patch_size) + c->image_class_token;
    const int two = c->arch == VLMOE_ARCH_TWO_TOWER;
    if (c->moe.router != VLMOE_ROUTER_NONE) c->moe.group_size = 2 * (two ? np : np + c->context_length);
    if (two && c->text_moe.router != VLMOE_ROUTER_NONE) c->text_moe.group_size = 2 * c->context_length;
    return st;
}

// Each MoE layer's routing as counts (tokens, tokens with an accepted assignment, tokens per expert).
static int routing_counts(const vlmoe_model *m, int64_t *out) {
    int n, k = 0;
    const vlmoe_moe_stats *ms = vlmoe_model_moe_stats(m, &n);
    memset(out, 0, sizeof(int64_t) * NCOUNT);
    for (int i = 0; i < n; i++)
        for (int mod = 0; mod < 2; mod++) {
            const double tok = ms[i].tokens[mod];
            if (k < NCOUNT) out[k++] = (int64_t)tok;
            if (k < NCOUNT) out[k++] = llround(ms[i].success[mod] * tok);
            for (int e = 0; e < ms[i].num_experts && ms[i].accepted[mod]; e++)
                if (k < NCOUNT) out[k++] = llround(ms[i].accepted[mod][e] * tok);
        }
    return k;
}

// The largest difference between two models' routing statistics (the fractions and entropies).
static double stats_diff(const vlmoe_model *a, const vlmoe_model *b) {
    int na, nb;
    const vlmoe_moe_stats *x = vlmoe_model_moe_stats(a, &na), *y = vlmoe_model_moe_stats(b, &nb);
    if (na != nb) return INFINITY;
    double w = 0;
    for (int i = 0; i < na; i++)
        for (int k = 0; k < 2; k++) {
            const double v[][2] = {{x[i].success[k], y[i].success[k]}, {x[i].dropped[k], y[i].dropped[k]},
                                   {x[i].mean_max_gate[k], y[i].mean_max_gate[k]},
                                   {x[i].entropy_pre[k], y[i].entropy_pre[k]},
                                   {x[i].entropy_post[k], y[i].entropy_post[k]},
                                   {x[i].experts_used[k], y[i].experts_used[k]}, {x[i].aux[k], y[i].aux[k]}};
            for (size_t j = 0; j < sizeof(v) / sizeof(v[0]); j++) w = fmax(w, fabs(v[j][0] - v[j][1]));
            if (!x[i].routed[k] != !y[i].routed[k]) return INFINITY;
            for (int e = 0; e < x[i].num_experts && x[i].routed[k]; e++)
                w = fmax(w, fmax(fabs(x[i].routed[k][e] - y[i].routed[k][e]), fabs(x[i].accepted[k][e] - y[i].accepted[k][e])));
        }
    return w;
}

// One gradient: model_accumulate over NACC micro-batches of MICRO against forward + backward at GLOBAL.
static void gradient(const char *name) {
    vlmoe_model_config c;
    vlmoe_model *one = NULL, *acc = NULL;
    vlmoe_synth *s = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    int st = config(name, &c);
    sp.image_size = c.image_size;
    const int T = c.context_length;
    const size_t isz = (size_t)3 * c.image_size * c.image_size;
    float *img = malloc(sizeof(float) * isz * GLOBAL), *g1 = NULL;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)GLOBAL * T), *len = malloc(sizeof(int32_t) * GLOBAL);
    if (!st) st = vlmoe_synth_init(&s, &sp);
    if (!st) st = vlmoe_synth_batch(s, VLMOE_SPLIT_TRAIN, 0, GLOBAL, T, img, tok, len);
    if (!st) st = vlmoe_model_init(&one, &c, 7);
    if (!st) st = vlmoe_model_init(&acc, &c, 7);
    if (!st) st = vlmoe_model_plan(one, GLOBAL);
    if (!st) st = vlmoe_model_plan(acc, MICRO);
    CHECK(st == VLMOE_OK, "%s: set-up: %s", name, vlmoe_last_error());
    vlmoe_step_stats s1, sa;
    const vlmoe_batch whole = {GLOBAL, img, tok, len};
    vlmoe_batch micro[NACC];
    for (int j = 0; j < NACC; j++)
        micro[j] = (vlmoe_batch){MICRO, img + (size_t)j * MICRO * isz, tok + (size_t)j * MICRO * T, len + j * MICRO};
    if (!st) st = vlmoe_model_forward(one, &whole, &s1);
    if (!st) st = vlmoe_model_backward(one);
    static int64_t c1[NCOUNT], ca[NCOUNT];
    const int nc = st ? 0 : routing_counts(one, c1);
    if (!st) st = model_accumulate(acc, micro, NACC, &sa);
    CHECK(st == VLMOE_OK, "%s: %s", name, vlmoe_last_error());
    if (st) goto done;
    const int nca = routing_counts(acc, ca);
    const size_t n = vlmoe_model_num_floats(one);
    g1 = vlmoe_model_grad_data(one);
    const float *ga = vlmoe_model_grad_data(acc);
    double dg = 0, gmax = 0;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)ga[i] - (double)g1[i]);
        if (e > dg) dg = e, at = i;
        gmax = fmax(gmax, fabs((double)g1[i]));
    }
    const double dl = fabs(sa.loss - s1.loss), sd = stats_diff(one, acc);
    printf("%s: --accum-freq %d x %d vs batch %d: loss %.7f vs %.7f, max |dloss| %.2e (aux %.2e), max |dgrad| %.2e "
           "(largest gradient %.2e); routing statistics within %.1e\n", name, NACC, MICRO, GLOBAL, sa.loss, s1.loss, dl,
           fabs(sa.aux - s1.aux), dg, gmax, sd);
    CHECK(dl <= 1e-5, "%s: loss %.9g accumulated vs %.9g at batch %d", name, sa.loss, s1.loss, GLOBAL);
    CHECK(fabs(sa.contrastive - s1.contrastive) <= 1e-5 && fabs(sa.aux - s1.aux) <= 1e-6,
          "%s: contrastive %.9g vs %.9g, aux %.9g vs %.9g", name, sa.contrastive, s1.contrastive, sa.aux, s1.aux);
    CHECK(sa.acc_i2t == s1.acc_i2t && sa.acc_t2i == s1.acc_t2i, "%s: accuracy %g/%g vs %g/%g", name, sa.acc_i2t,
          sa.acc_t2i, s1.acc_i2t, s1.acc_t2i);
    int np;
    const vlmoe_param_info *pi = vlmoe_model_params(one, &np);
    const char *where = "?";
    for (int i = 0; i < np; i++)
        if (at >= pi[i].offset && at < pi[i].offset + pi[i].numel) where = pi[i].name;
    CHECK(dg <= 1e-5, "%s: the gradient of %s differs by %.3e (%.9g vs %.9g)", name, where, dg, ga[at], g1[at]);
    CHECK(gmax > 1e-3, "%s: the gradient is all but zero (%.3e): the comparison would prove nothing", name, gmax);
    CHECK(nc == nca && !memcmp(c1, ca, sizeof(c1)), "%s: routing counts of the accumulated batch differ", name);
    CHECK(strcmp(name, "tiny") ? nc > 0 : nc == 0, "%s: %d routing counts", name, nc);
    CHECK(sd <= 1e-9, "%s: merged routing statistics differ by %.3e", name, sd);
    // the activations stay those of one micro-batch; the loss is the whole batch's, not a micro-batch's
    CHECK(acc->planned_B == MICRO, "%s: accumulation planned the graph for %d", name, acc->planned_B);
    vlmoe_step_stats m0;
    CHECK(vlmoe_model_forward(acc, &micro[0], &m0) == VLMOE_OK && fabs(m0.contrastive - sa.contrastive) > 0.1,
          "%s: a micro-batch's loss %.4f is the accumulated one %.4f", name, m0.contrastive, sa.contrastive);
done:
    free(img), free(tok), free(len);
    vlmoe_model_free(one), vlmoe_model_free(acc), vlmoe_synth_free(s);
}

// STEPS AdamW steps through the contrastive task at `batch` x `accum`; each step's loss and
// gradient norm, and the final parameters.
static int train(const char *name, int batch, int accum, double *loss, double *norm, float **params) {
    vlmoe_model_config c;
    vlmoe_model *m = NULL;
    vlmoe_trainer *t = NULL;
    vlmoe_synth *s = NULL;
    vlmoe_contrastive *task = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.schedule = (vlmoe_schedule){VLMOE_SCHED_COSINE, 1e-3, 2, STEPS, 0.0, 0, 0};
    int st = config(name, &c);
    sp.image_size = c.image_size;
    if (!st) st = vlmoe_model_init(&m, &c, 11);
    if (!st) st = vlmoe_model_plan(m, batch);
    if (!st) st = vlmoe_trainer_init(&t, m, &tp);
    if (!st) st = vlmoe_synth_init(&s, &sp);
    const vlmoe_contrastive_params cp = {.model = m, .batch_size = batch, .synth = s, .world = 1, .accum_freq = accum};
    if (!st) st = vlmoe_contrastive_init(&task, &cp);
    const vlmoe_run_task rt = task ? vlmoe_contrastive_task(task) : (vlmoe_run_task){0};
    for (long step = 0; !st && step < STEPS; step++) {
        vlmoe_step_stats ss;
        if (!(st = rt.fill(rt.user, step)) && !(st = rt.step(rt.user, t, step, &ss))) loss[step] = ss.loss, norm[step] = ss.grad_norm;
    }
    if (!st) {
        *params = malloc(sizeof(float) * vlmoe_model_num_floats(m));
        memcpy(*params, vlmoe_model_param_data(m), sizeof(float) * vlmoe_model_num_floats(m));
        CHECK(vlmoe_trainer_get_step(t) == STEPS, "%s: %ld optimizer steps, not %d", name, vlmoe_trainer_get_step(t), STEPS);
    }
    if (st) fprintf(stderr, "train %s at %d x %d: %s\n", name, batch, accum, vlmoe_last_error());
    vlmoe_contrastive_free(task), vlmoe_synth_free(s), vlmoe_trainer_free(t), vlmoe_model_free(m);
    return st;
}

static void training(const char *name) {
    double l1[STEPS], la[STEPS], n1[STEPS], na[STEPS];
    float *p1 = NULL, *pa = NULL;
    vlmoe_model_config c;
    config(name, &c);
    vlmoe_model *probe = NULL;
    vlmoe_model_init(&probe, &c, 1);
    const size_t n = probe ? vlmoe_model_num_floats(probe) : 0;
    vlmoe_model_free(probe);
    const int ok = train(name, GLOBAL, 1, l1, n1, &p1) == VLMOE_OK && train(name, MICRO, NACC, la, na, &pa) == VLMOE_OK;
    CHECK(ok, "%s: training runs", name);
    if (ok) {
        double wl = 0, wn = 0, wp = 0;
        for (int s = 0; s < STEPS; s++) {
            wl = fmax(wl, fabs(la[s] - l1[s]) / fabs(l1[s]));
            wn = fmax(wn, fabs(na[s] - n1[s]) / fabs(n1[s]));
        }
        for (size_t i = 0; i < n; i++) wp = fmax(wp, fabs((double)pa[i] - (double)p1[i]));
        printf("%s: %d steps at %d x %d vs %d: losses %.5f..%.5f, max relative difference of the losses %.2e, of the "
               "gradient norms %.2e; max parameter difference %.2e\n", name, STEPS, NACC, MICRO, GLOBAL, l1[0],
               l1[STEPS - 1], wl, wn, wp);
        CHECK(wl <= 1e-5 && wn <= 1e-5 && wp <= 1e-5, "%s: accumulated training drifts from batch %d (loss %.2e, norm "
              "%.2e, parameters %.2e)", name, GLOBAL, wl, wn, wp);
        CHECK(fabs(l1[STEPS - 1] - l1[0]) > 1e-3, "%s: the loss did not move (%.6f)", name, l1[0]);
    }
    free(p1), free(pa);
}

// A VL-MoE model, micro-batches of unequal size and routing groups that do not split a micro-batch.
static void errors(void) {
    vlmoe_model_config c;
    vlmoe_model *m = NULL;
    vlmoe_config_named("vlmoe-tiny", &c);
    CHECK(vlmoe_model_init(&m, &c, 1) == VLMOE_OK, "vlmoe-tiny: %s", vlmoe_last_error());
    float img[1];
    int32_t tok[1], len[1];
    vlmoe_batch b[2] = {{2, img, tok, len}, {2, img, tok, len}};
    CHECK(m && model_accumulate(m, b, 2, NULL) == VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), "VL-MoE"),
          "VL-MoE: %s", vlmoe_last_error());
    vlmoe_model_free(m), m = NULL;
    config("limoe-tiny", &c); // groups of 2 examples: a micro-batch of 3 does not split
    vlmoe_synth *s = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c.image_size;
    const int T = c.context_length;
    const size_t isz = (size_t)3 * c.image_size * c.image_size;
    float *im = malloc(sizeof(float) * isz * 6);
    int32_t *tk = malloc(sizeof(int32_t) * 6 * (size_t)T), *ln = malloc(sizeof(int32_t) * 6);
    int st = vlmoe_synth_init(&s, &sp);
    if (!st) st = vlmoe_synth_batch(s, VLMOE_SPLIT_TRAIN, 0, 6, T, im, tk, ln);
    if (!st) st = vlmoe_model_init(&m, &c, 1);
    CHECK(st == VLMOE_OK, "set-up: %s", vlmoe_last_error());
    vlmoe_batch odd[2] = {{3, im, tk, ln}, {3, im + 3 * isz, tk + 3 * T, ln + 3}};
    vlmoe_batch mixed[2] = {{4, im, tk, ln}, {2, im + 4 * isz, tk + 4 * T, ln + 4}};
    if (m) {
        st = model_accumulate(m, odd, 2, NULL);
        CHECK(st == VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), "micro-batch 1 of 2") &&
                  strstr(vlmoe_last_error(), "group_size"), "groups across micro-batches: %d %s", st, vlmoe_last_error());
        st = model_accumulate(m, mixed, 2, NULL);
        CHECK(st == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "micro-batch 2 has 2 pairs"), "unequal micro-batches: %s",
              vlmoe_last_error());
        CHECK(model_accumulate(m, odd, 0, NULL) == VLMOE_ERR_ARG, "no micro-batches");
    }
    // a NaN in the second micro-batch: the step fails before any parameter changes
    vlmoe_model_free(m), m = NULL;
    config("tiny", &c);
    vlmoe_trainer *t = NULL;
    const vlmoe_train_params tp = vlmoe_train_default_params();
    st = vlmoe_model_init(&m, &c, 1);
    if (!st) st = vlmoe_trainer_init(&t, m, &tp);
    CHECK(st == VLMOE_OK, "set-up of the NaN check: %s", vlmoe_last_error());
    if (!st) {
        const size_t np = vlmoe_model_num_floats(m);
        float *before = malloc(sizeof(float) * np);
        vlmoe_batch two[2] = {{2, im, tk, ln}, {2, im + 2 * isz, tk + 2 * T, ln + 2}};
        vlmoe_step_stats ss;
        CHECK(vlmoe_trainer_step_accum(t, two, 2, &ss) == VLMOE_OK, "a clean step: %s", vlmoe_last_error());
        memcpy(before, vlmoe_model_param_data(m), sizeof(float) * np);
        im[2 * isz + 7] = NAN;
        st = vlmoe_trainer_step_accum(t, two, 2, &ss);
        CHECK(st == VLMOE_ERR_NUMERIC && strstr(vlmoe_last_error(), "step 1") &&
                  strstr(vlmoe_last_error(), "accumulated batch is nan"), "NaN: %d %s", st, vlmoe_last_error());
        CHECK(!memcmp(before, vlmoe_model_param_data(m), sizeof(float) * np) && vlmoe_trainer_get_step(t) == 1,
              "the diverged step changed the parameters or the step");
        free(before);
    }
    vlmoe_trainer_free(t);
    free(im), free(tk), free(ln);
    vlmoe_model_free(m), vlmoe_synth_free(s);
}

// ---- the command line

static const char *bin;
static char dir[64], out[16384];

static void expect(const char *args, int status, const char *needle) {
    test_expect_in(dir, bin, args, status, needle, out, sizeof(out));
}

// The "loss" of every train record of a run's metrics.jsonl, as written (n of at most cap).
static int losses(const char *run, char (*got)[40], int cap) {
    char path[256], line[8192];
    snprintf(path, sizeof(path), "%s/runs/%s/metrics.jsonl", dir, run);
    FILE *f = fopen(path, "r");
    int n = 0;
    while (f && n < cap && fgets(line, sizeof(line), f)) {
        const char *l = strstr(line, "\"loss\":");
        if (!l || !strstr(line, "\"train\"")) continue;
        snprintf(got[n], 40, "%.*s", (int)strcspn(l + 7, ",}"), l + 7);
        n++;
    }
    if (f) fclose(f);
    return n;
}

// Runs a and b must log the same losses step for step (within rel; 0: the same digits).
static void same_losses(const char *a, const char *b, double rel) {
    char la[16][40], lb[16][40];
    const int na = losses(a, la, 16), nb = losses(b, lb, 16);
    CHECK(na > 1 && na == nb, "runs %s and %s logged %d and %d steps", a, b, na, nb);
    double w = 0;
    for (int i = 0; i < na && i < nb; i++) {
        const double x = atof(la[i]), y = atof(lb[i]);
        w = fmax(w, fabs(x - y) / fabs(y));
        if (rel == 0) CHECK(!strcmp(la[i], lb[i]), "runs %s, %s: record %d: loss %s vs %s", a, b, i + 1, la[i], lb[i]);
    }
    if (rel > 0) CHECK(w <= rel, "runs %s, %s: losses differ by %.3e (relative)", a, b, w);
    printf("vlmoe train: runs %s and %s: %d steps, losses within %.2e (relative)\n", a, b, na, w);
}

static void cli(void) {
    expect("train --help", 0, "--accum-freq N");
    expect("train --accum-freq 0 --steps 1 --logs runs", 2, "--accum-freq must be >= 1");
    expect("train --accum-freq -2 --steps 1 --logs runs", 2, "--accum-freq must be >= 1");
    expect("train --model vlmoe-tiny --accum-freq 2 --steps 1 --logs runs", 1, "--accum-freq is for contrastive models");
    expect("train --model vlmoe-tiny --accum-freq=2 --steps 1 --logs runs", 1, "--accum-freq is for contrastive models");
    // limoe-tiny routes the whole batch as one group: said, not hidden
    expect("train --model limoe-tiny --accum-freq 2 --batch-size 4 --steps 1 --eval-samples 0 --logs runs --name g", 0,
           "route each micro-batch of 4 as one group");
    // the held-out evaluation scores pairs among the accumulated batch, as a run at that batch does
    expect("train --model tiny --batch-size 4 --accum-freq 2 --steps 1 --eval-samples 40 --logs runs --name ev", 0,
           "(in chunks of 8,");
    // the synthetic data: the global batch's samples, in order
    expect("train --model tiny --batch-size 8 --accum-freq 2 --steps 6 --log-every-n-steps 1 --eval-samples 0 "
           "--logs runs --name acc", 0, "steps 0..6 of 16 pairs (2 micro-batches x 8)");
    expect("train --model tiny --batch-size 16 --steps 6 --log-every-n-steps 1 --eval-samples 0 --logs runs --name one", 0,
           "trained to step 6");
    same_losses("acc", "one", 1e-5);
    char path[256];
    snprintf(path, sizeof(path), "%s/runs/acc/params.json", dir);
    char *pj = test_read_file(path, NULL);
    CHECK(pj && strstr(pj, "\"accum_freq\":\t2") && strstr(pj, "\"global_batch_size\":\t16"), "params.json: %s",
          pj ? pj : "(missing)");
    free(pj);
    // a resumed run continues the accumulated steps bit for bit
    expect("train --model tiny --batch-size 8 --accum-freq 2 --steps 3 --save-frequency 3 --log-every-n-steps 1 "
           "--eval-samples 0 --logs runs --name res", 0, "trained to step 3");
    expect("train --model tiny --batch-size 8 --accum-freq 2 --steps 6 --log-every-n-steps 1 --eval-samples 0 "
           "--logs runs --name res --resume latest", 0, "resuming from");
    same_losses("res", "acc", 0);
    // a CSV through the loader: each step's rows are the batch-16 run's
    expect("synth export --out data --n 96", 0, "");
    expect("train --model tiny --train-data data/captions.csv --batch-size 8 --accum-freq 2 --steps 4 --workers 1 "
           "--log-every-n-steps 1 --image-mean 0.5 --image-std 0.5 --logs runs --name csva", 0, "of 16 pairs");
    expect("train --model tiny --train-data data/captions.csv --batch-size 16 --steps 4 --workers 1 "
           "--log-every-n-steps 1 --image-mean 0.5 --image-std 0.5 --logs runs --name csv1", 0, "trained");
    same_losses("csva", "csv1", 1e-5);
}

int main(int argc, char **argv) {
    static const char *const models[] = {"tiny", "limoe-tiny", "clipup-tiny", "ec-tiny", "soft-tiny"};
    for (int i = 0; i < 5; i++) gradient(models[i]);
    for (int i = 0; i < 3; i++) training(models[i]);
    errors();
    static char abs[4096];
    if ((bin = test_vlmoe_bin(argv[0], abs))) {
        snprintf(dir, sizeof(dir), "/tmp/vlmoe_accum_XXXXXX");
        CHECK(mkdtemp(dir) != NULL, "mkdtemp");
        cli();
        char cmd[128];
        snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
        if (system(cmd)) fprintf(stderr, "could not remove %s\n", dir);
    }
    return test_summary("test_accum");
}
