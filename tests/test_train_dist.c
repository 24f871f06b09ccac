// test_train_dist.c: data-parallel training against the one-process path, step by step. Every
// process trains limoe-tiny (and a VL-MoE model) from the same seed on its block of each global
// batch (src/data/order.h) with the gradients averaged over the processes (src/train/trainer.c)
// and the contrastive loss over the embeddings gathered from every process; rank 0 then trains
// the same model alone at the global batch, and the losses, gradient norms and parameters of the
// two runs must agree to float rounding (the gradient sums run in another order), and the routing
// counts of every step (tokens, routed tokens, tokens per expert), summed over the processes,
// exactly; the same with --accum-freq on every process (src/nn/towers_accum.c). Alone (a world of
// one, without accumulation), the
// data-parallel path must equal the plain one bit for bit. With the experts split over processes,
// each process must hold its own experts' parameters and optimizer state only (check_sharded), with AdamW and
// with LIMoE's Adafactor, and the sharded run must equal the replicated one bit for bit, rank 0's
// gathered optimizer state included (compare_replicated). tests/test_dist_mpi.sh runs it under
// mpirun on 2, 3 and 4 processes.
#include <stdint.h>

#include "dist/dist.h"
#include "nn/model.h"
#include "optim/optim.h"
#include "test.h"
#include "test_mpi.h"
#include "train/buckets.h"
#include "train/run.h"
#include "train/tasks.h"

enum { STEPS = 10, GLOBAL = 24, NCOUNT = 256 }; // 10 AdamW steps at a global batch of 24 (12, 8, 6 per process)
// the gradient buckets' cap of train() (--bucket-cap-mb), and what the last run's buckets did
static double g_cap_mb = 25;
static buckets_info g_info;

// Trains `model` (MoE layers routing groups of two examples) for STEPS steps as process `rank` of `world` at `batch` pairs per process (the
// synthetic data); losses[s] gets each step's loss, params (may be NULL) the final parameters.
// Each step's routing as counts (tokens, tokens with an accepted assignment, and tokens per expert,
// by layer and modality), which add up over the processes to the one-process counts when every
// process holds whole groups.
static void routing_counts(vlmoe_model *m, int64_t *out) {
    int n;
    const vlmoe_moe_stats *ms = vlmoe_model_moe_stats(m, &n);
    int k = 0;
    for (int i = 0; i < n; i++)
        for (int mod = 0; mod < 2; mod++) {
            const double tok = ms[i].tokens[mod];
            if (k < NCOUNT) out[k++] = (int64_t)tok;
            if (k < NCOUNT) out[k++] = llround(ms[i].success[mod] * tok);
            for (int e = 0; e < ms[i].num_experts && ms[i].accepted[mod]; e++)
                if (k < NCOUNT) out[k++] = llround(ms[i].accepted[mod][e] * tok);
        }
}

// The optimizer of train() (AdamW, or Adafactor as LIMoE: momentum in bfloat16, decay by the
// schedule) and the experts per MoE layer (0: the model's)
static vlmoe_opt_kind g_opt = VLMOE_OPT_ADAMW;
static int g_experts = 0;
// the last run's whole optimizer state (every buffer in order, after the gather), when asked
static int g_want_state;
static float *g_state;
static size_t g_nstate;
// the last run's attention key biases (the middle third of every attn.qkv.bias), whose gradient is
// zero but for rounding (softmax does not change when a key bias adds q.b to every score):
// Adafactor's update, g / sqrt(mean g^2), moves them by about lr whatever that noise's size, so
// a sum in another order moves them elsewhere; compare() leaves them out with Adafactor
static unsigned char *g_keyb;

// Expert parallelism shards the experts (src/train/trainer.c): after the steps and before the
// gather, this process's model holds experts [rank E/N, (rank+1) E/N) of every split bank only
// (the flat buffer shorter by the others' floats), its optimizer state is as long and non-zero
// there; a bank whose state does not split (Adafactor factored over the expert dim) is held
// whole and moves.
static void check_sharded(vlmoe_model *m, vlmoe_trainer *t, const float *init, size_t ninit, vlmoe_dist *ep) {
    model_bank b[64];
    const int nb = model_expert_banks(m, b, 64);
    const vlmoe_optim *o = vlmoe_trainer_optim(t);
    const float *w = vlmoe_model_param_data(m);
    CHECK(nb > 0 && nb <= 64, "expert banks: %d", nb);
    long split = 0, rep = 0, wrong = 0, own_nz = 0, rep_moved = 0;
    size_t dropped = 0;
    for (int i = 0; i < nb && nb <= 64; i++) {
        if (b[i].El == b[i].E) { // held whole: compare with the initial values at its offset in the whole model
            rep++;
            continue;
        }
        split++;
        wrong += b[i].El != b[i].E / ep->world || b[i].e0 != ep->rank * b[i].El;
        dropped += (size_t)(b[i].E - b[i].El) * b[i].per;
        float *bufs[4];
        size_t per[4];
        const int n = optim_expert_states(o, b[i].offset, b[i].El, b[i].per, bufs, per);
        for (int k = 0; k < n; k++)
            for (size_t j = 0; j < (size_t)b[i].El * per[k]; j++) own_nz += bufs[k][j] != 0;
    }
    // a bank held whole moved (the optimizer updated every expert of it): some of its floats differ
    // from every initial float at the same place of the whole model (the offsets shift, so compare
    // the bank's floats as a set of changed values: any float not bit-equal to its initial one)
    int np;
    const vlmoe_param_info *tab = vlmoe_model_params(m, &np);
    for (int i = 0; i < np; i++) {
        if (!strstr(tab[i].name, ".moe.experts.") || tab[i].experts_local) continue;
        size_t at = 0; // its offset in the whole model: the floats of the tensors before it, whole
        for (int j = 0; j < i; j++)
            at += tab[j].experts_local ? tab[j].numel / (size_t)tab[j].experts_local * (size_t)tab[j].shape[0] : tab[j].numel;
        for (size_t k = 0; k < tab[i].numel && at + k < ninit; k++) rep_moved += w[tab[i].offset + k] != init[at + k];
    }
    CHECK(split > 0 && !wrong && own_nz > 0 && vlmoe_model_num_floats(m) + dropped == ninit && (rep == 0 || rep_moved > 0),
          "sharded experts, process %d of its group: %ld banks split (%ld holding the wrong experts), %ld non-zero state "
          "floats in them; %zu floats held of %zu, %zu dropped; %ld banks held whole, %ld of their floats moved", ep->rank,
          split, wrong, own_nz, vlmoe_model_num_floats(m), ninit, dropped, rep, rep_moved);
}

// The one-process run at the global batch is the reference of several comparisons (the same
// model, optimizer and expert count: plain, accumulated, expert-parallel), and rank 0 trains it
// alone while the other processes wait: train() keeps each reference's results and hands them out
// again instead of training the same run twice (the run is deterministic: test_train's "same seed,
// same bits").
typedef struct {
    char model[32];
    int opt, experts;
    double losses[STEPS], norms[STEPS];
    int64_t counts[STEPS][NCOUNT];
    float *params;
    unsigned char *keyb;
    size_t n;
} ref_run;
static ref_run g_refs[8];
static int g_nref;

static ref_run *ref_find(const char *model) {
    for (int i = 0; i < g_nref; i++)
        if (!strcmp(g_refs[i].model, model) && g_refs[i].opt == (int)g_opt && g_refs[i].experts == g_experts)
            return &g_refs[i];
    return NULL;
}

static void *dup_bytes(const void *p, size_t n) {
    void *q = malloc(n ? n : 1);
    if (q) memcpy(q, p, n);
    return q;
}

static void ref_free(void) {
    for (int i = 0; i < g_nref; i++) free(g_refs[i].params), free(g_refs[i].keyb);
    g_nref = 0;
}

static int train(const char *model, vlmoe_dist *d, vlmoe_dist *ep, int batch, int accum, double *losses, double *norms,
                 float **params, size_t *n, int64_t (*counts)[NCOUNT]) {
    const int reference = !d && !ep && batch == GLOBAL && accum == 1 && !g_want_state && strlen(model) < 32;
    const ref_run *r = reference ? ref_find(model) : NULL;
    if (r) {
        memcpy(losses, r->losses, sizeof(r->losses)), memcpy(norms, r->norms, sizeof(r->norms));
        if (counts) memcpy(counts, r->counts, sizeof(r->counts));
        if (params) *n = r->n, *params = dup_bytes(r->params, sizeof(float) * r->n);
        free(g_keyb);
        g_keyb = dup_bytes(r->keyb, r->n);
        return VLMOE_OK;
    }
    vlmoe_model_config c;
    vlmoe_model *m = NULL;
    vlmoe_trainer *t = NULL;
    vlmoe_synth *s = NULL;
    vlmoe_contrastive *task = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    int st = vlmoe_config_named(model, &c);
    // routing groups of two whole examples (LIMoE E.5): a process's batch holds whole groups, so
    // the groups, their capacity and their order are those of the one-process batch (group_size
    // 0, one group of the whole batch, would make the groups depend on the process count)
    const int np = (c.image_size / c.patch_size) * (c.image_size / c.patch_size) + c.image_class_token;
    const int two = c.arch == VLMOE_ARCH_TWO_TOWER; // each tower routes its own modality
    if (c.moe.router != VLMOE_ROUTER_NONE) c.moe.group_size = 2 * (two ? np : np + c.context_length);
    if (two && c.text_moe.router != VLMOE_ROUTER_NONE) c.text_moe.group_size = 2 * c.context_length;
    sp.image_size = c.image_size;
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.schedule = (vlmoe_schedule){VLMOE_SCHED_COSINE, 1e-3, 2, STEPS, 0.0, 0, 0};
    tp.bucket_cap_mb = g_cap_mb;
    if (g_opt == VLMOE_OPT_ADAFACTOR) { // LIMoE's (app. A) as `vlmoe train --preset limoe` sets it
        tp.optim = vlmoe_optim_default_params(VLMOE_OPT_ADAFACTOR);
        tp.optim.momentum_bf16 = 1, tp.optim.weight_decay = 1e-5f, tp.optim.wd_lr_base = 1e-3f;
    }
    if (g_experts) c.moe.num_experts = g_experts;
    if (!st) st = vlmoe_model_init(&m, &c, 7);
    if (!st) st = vlmoe_model_plan(m, batch);
    if (!st) st = vlmoe_trainer_init(&t, m, &tp);
    if (!st) st = vlmoe_synth_init(&s, &sp);
    const vlmoe_contrastive_params cp = {.model = m, .batch_size = batch, .synth = s, .rank = d ? d->rank : 0,
                                         .world = d ? d->world : 1, .accum_freq = accum};
    if (!st) st = vlmoe_contrastive_init(&task, &cp);
    const vlmoe_run_task rt = task ? vlmoe_contrastive_task(task) : (vlmoe_run_task){0};
    float *init = NULL;
    size_t ninit = 0;
    if (!st) {
        ninit = vlmoe_model_num_floats(m);
        init = malloc(sizeof(float) * ninit);
        memcpy(init, vlmoe_model_param_data(m), sizeof(float) * ninit);
    }
    vlmoe_trainer_set_dist(t, d, ep);
    for (long step = 0; !st && step < STEPS; step++) {
        vlmoe_step_stats ss;
        st = rt.fill(rt.user, step);
        if (!st) st = rt.step(rt.user, t, step, &ss);
        if (!st) losses[step] = ss.loss, norms[step] = ss.grad_norm;
        if (!st && counts) routing_counts(m, counts[step]);
    }
    if (!st && ep && ep->world > 1 && !getenv("VLMOE_TEST_REPLICATE_EXPERTS"))
        check_sharded(m, t, init, ninit, ep);
    if (!st) st = vlmoe_trainer_gather_experts(t, 1); // the others' experts, to compare whole models
    free(init);
    if (!st && g_want_state && (!d || d->rank == 0)) { // (rank 0 holds every expert's state after the gather)
        vlmoe_optim *o = vlmoe_trainer_optim(t);
        g_nstate = 0;
        for (int i = 0; i < vlmoe_optim_state_count(o); i++) {
            size_t k;
            vlmoe_optim_state_get(o, i, NULL, NULL, &k);
            g_nstate += k;
        }
        free(g_state);
        g_state = malloc(sizeof(float) * (g_nstate + 1));
        size_t at = 0;
        for (int i = 0; i < vlmoe_optim_state_count(o); i++) {
            size_t k;
            float *x;
            vlmoe_optim_state_get(o, i, NULL, &x, &k);
            memcpy(g_state + at, x, sizeof(float) * k), at += k;
        }
    }
    if (!st && params) {
        int ntab;
        const vlmoe_param_info *tab = vlmoe_model_params(m, &ntab);
        free(g_keyb);
        g_keyb = calloc(vlmoe_model_num_floats(m), 1);
        for (int i = 0; i < ntab; i++)
            if (strstr(tab[i].name, "attn.qkv.bias"))
                memset(g_keyb + tab[i].offset + tab[i].numel / 3, 1, tab[i].numel / 3);
        *n = vlmoe_model_num_floats(m);
        *params = malloc(sizeof(float) * *n);
        memcpy(*params, vlmoe_model_param_data(m), sizeof(float) * *n);
    }
    if (st) fprintf(stderr, "train %s: %s\n", model, vlmoe_last_error());
    if (!st && reference && params && counts && g_nref < (int)(sizeof g_refs / sizeof g_refs[0])) {
        ref_run *k = &g_refs[g_nref++];
        snprintf(k->model, sizeof k->model, "%s", model);
        k->opt = (int)g_opt, k->experts = g_experts, k->n = *n;
        memcpy(k->losses, losses, sizeof(k->losses)), memcpy(k->norms, norms, sizeof(k->norms));
        memcpy(k->counts, counts, sizeof(k->counts));
        k->params = dup_bytes(*params, sizeof(float) * *n), k->keyb = dup_bytes(g_keyb, *n);
    }
    if (t) g_info = trainer_buckets_info(t);
    vlmoe_trainer_set_dist(t, NULL, NULL);
    vlmoe_contrastive_free(task);
    vlmoe_synth_free(s);
    vlmoe_trainer_free(t);
    vlmoe_model_free(m);
    return st;
}

// ep: the size of the groups the experts are split over (0: not split); accum: micro-batches per
// step and process (--accum-freq; 1: none)
static void compare(const char *model, vlmoe_dist *d, int ep, int accum) {
    const int batch = GLOBAL / d->world / accum;
    vlmoe_dist *experts = NULL;
    if (ep > 1 && ep < d->world) CHECK(vlmoe_dist_split(d, d->rank / ep, d->rank, &experts) == VLMOE_OK, "split");
    if (ep > 1 && ep == d->world) experts = d;
    double dp[STEPS] = {0}, one[STEPS] = {0}, gdp[STEPS] = {0}, gone[STEPS] = {0};
    static int64_t cdp[STEPS][NCOUNT], cone[STEPS][NCOUNT];
    memset(cdp, 0, sizeof(cdp)), memset(cone, 0, sizeof(cone));
    float *pd = NULL, *p1 = NULL;
    size_t n = 0, n1 = 0;
    CHECK(train(model, d, experts, batch, accum, dp, gdp, &pd, &n, cdp) == VLMOE_OK, "%s: data-parallel run on %d processes",
          model, d->world);
    d->allreduce_sum(d, cdp, (size_t)STEPS * NCOUNT, VLMOE_DIST_I64);
    // every process holds the same parameters after the same updates
    if (pd && d->world > 1) {
        float *r0 = malloc(sizeof(float) * n);
        memcpy(r0, pd, sizeof(float) * n);
        d->broadcast(d, r0, n, VLMOE_DIST_F32, 0);
        CHECK(!memcmp(r0, pd, sizeof(float) * n), "%s: process %d's parameters differ from process 0's", model, d->rank);
        free(r0);
    }
    if (d->rank == 0) {
        CHECK(train(model, NULL, NULL, GLOBAL, 1, one, gone, &p1, &n1, cone) == VLMOE_OK && n1 == n, "%s: one process", model);
        int differ = -1;
        for (int s = 0; s < STEPS && differ < 0; s++)
            if (memcmp(cdp[s], cone[s], sizeof(cone[s]))) differ = s;
        CHECK(differ < 0, "%s: routing counts of step %d summed over %d processes differ from one process's", model,
              differ + 1, d->world);
        int64_t routed = 0;
        for (int k = 0; k < NCOUNT; k++) routed += cone[STEPS - 1][k];
        CHECK(strcmp(model, "tiny") ? routed > 0 : routed == 0, "%s: %lld routing counts in the last step", model,
              (long long)routed);
        double worst = 0, pworst = 0, gworst = 0;
        for (int s = 0; s < STEPS; s++) {
            const double rel = fabs(dp[s] - one[s]) / fabs(one[s]), grel = fabs(gdp[s] - gone[s]) / fabs(gone[s]);
            worst = rel > worst ? rel : worst;
            gworst = grel > gworst ? grel : gworst;
            if (d->world == 1 && accum == 1) CHECK(dp[s] == one[s], "%s step %d: %.17g vs %.17g in a world of one", model, s + 1, dp[s], one[s]);
        }
        size_t nkey = 0; // Adafactor: the key biases left out (g_keyb), and how many of them moved apart
        double kworst = 0;
        for (size_t i = 0; p1 && pd && i < n; i++) {
            const double e = fabs((double)pd[i] - (double)p1[i]);
            if (g_opt == VLMOE_OPT_ADAFACTOR && g_keyb[i]) {
                kworst = e > kworst ? e : kworst, nkey += e > 1e-5;
                continue;
            }
            pworst = e > pworst ? e : pworst;
        }
        char how[48] = "";
        if (accum > 1) snprintf(how, sizeof(how), " x %d micro-batches", accum);
        printf("%s%s%s: %d processes%s x %d pairs vs 1 x %d, %d steps: losses %.6f..%.6f, max relative difference of the "
               "losses %.2e, of the gradient norms %.2e; max parameter difference %.2e\n", model,
               g_opt == VLMOE_OPT_ADAFACTOR ? " (Adafactor)" : "",
               ep ? (ep == d->world ? " (experts split over every process)" : " (experts split over pairs of processes)") : "",
               d->world, how, batch, GLOBAL, STEPS, one[0], one[STEPS - 1],
               worst, gworst, pworst);
        if (g_opt == VLMOE_OPT_ADAFACTOR)
            printf("    (the attention key biases left out: %zu of them further apart than 1e-5, up to %.2e)\n", nkey, kworst);
        CHECK(gworst <= 1e-5, "%s: gradient norms differ by %.3e (relative) from the one-process run", model, gworst);
        CHECK(worst <= 1e-5, "%s: losses differ by %.3e (relative) from the one-process run", model, worst);
        // Adafactor's momentum in bfloat16: where the gradient sum of another order makes it round
        // the other way, the step moves by about lr x 2^-8 x |m| (|m| ~ 1: the update is normalised),
        // 4e-6 at lr 1e-3, up to 4e-5 over the 10 steps (measured: 1.0e-5)
        const double pbound = g_opt == VLMOE_OPT_ADAFACTOR ? 1e-4 : 1e-5;
        CHECK(pworst <= pbound, "%s: parameters differ by %.3e from the one-process run", model, pworst);
        if (d->world == 1 && accum == 1)
            CHECK(p1 && pd && !memcmp(p1, pd, sizeof(float) * n), "%s: parameters in a world of one", model);
    }
    free(pd), free(p1);
    free(g_keyb), g_keyb = NULL;
    if (experts && experts != d) vlmoe_dist_close(experts);
}

// Sharding changes only where the experts' state lives: the sharded run and the replicated one
// (VLMOE_TEST_REPLICATE_EXPERTS, the path before sharding) on the same processes and expert groups
// of ep give the same losses and parameters at every process, and rank 0 (after the gather) the
// same optimizer state, bit for bit: what a checkpoint holds. The gradient norms agree to double
// rounding (the sharded norm adds the experts' squares per group, then the dense ones).
static void compare_replicated(const char *model, vlmoe_dist *d, int ep) {
    const int batch = GLOBAL / d->world;
    vlmoe_dist *experts = d;
    if (ep < d->world) CHECK(vlmoe_dist_split(d, d->rank / ep, d->rank, &experts) == VLMOE_OK, "split");
    double ls[STEPS] = {0}, gs[STEPS] = {0}, lr[STEPS] = {0}, gr[STEPS] = {0};
    float *ps = NULL, *pr = NULL, *ss = NULL, *sr = NULL;
    size_t ns = 0, nr = 0, nss = 0, nsr = 0;
    g_want_state = 1;
    int st = train(model, d, experts, batch, 1, ls, gs, &ps, &ns, NULL);
    ss = g_state, nss = g_nstate, g_state = NULL;
    setenv("VLMOE_TEST_REPLICATE_EXPERTS", "1", 1);
    if (!st) st = train(model, d, experts, batch, 1, lr, gr, &pr, &nr, NULL);
    unsetenv("VLMOE_TEST_REPLICATE_EXPERTS");
    sr = g_state, nsr = g_nstate, g_state = NULL, g_want_state = 0;
    CHECK(st == VLMOE_OK && ns == nr, "%s: sharded and replicated runs on %d processes", model, d->world);
    if (!st) {
        int same = !memcmp(ps, pr, sizeof(float) * ns);
        double gworst = 0;
        for (int s = 0; s < STEPS; s++) {
            same &= ls[s] == lr[s];
            const double e = fabs(gs[s] - gr[s]) / gr[s];
            gworst = e > gworst ? e : gworst;
        }
        CHECK(same, "%s (%d experts, groups of %d): the sharded run's losses or parameters differ from the replicated "
              "run's (process %d)", model, g_experts, ep, d->rank);
        CHECK(gworst <= 1e-12, "%s: gradient norms differ by %.3e from the replicated run's", model, gworst);
        if (d->rank == 0) {
            const int sst = ss && sr && nss == nsr && nss > 0 && !memcmp(ss, sr, sizeof(float) * nss);
            CHECK(sst, "%s: rank 0's optimizer state (%zu floats) differs from the replicated run's (%zu)", model, nss,
                  nsr);
            printf("%s%s (%s experts, groups of %d): %d processes, sharded vs replicated, %d steps: losses and "
                   "parameters %s, rank 0's optimizer state (%zu floats) %s, gradient norms within %.1e\n", model,
                   g_opt == VLMOE_OPT_ADAFACTOR ? " (Adafactor)" : "", g_experts ? "32" : "its", ep, d->world, STEPS,
                   same ? "bit-identical" : "DIFFER", nss, sst ? "bit-identical" : "DIFFERS", gworst);
        }
    }
    free(ps), free(pr), free(ss), free(sr);
    if (experts != d) vlmoe_dist_close(experts);
}

// Gradient buckets (src/train/buckets.c): the same data-parallel run with the gradient summed
// once after the backward (--bucket-cap-mb 0) and in buckets of at most 1 kB (about one per
// parameter, most started during the backward) gives the same losses, gradient norms and
// parameters bit for bit: the sums are elementwise in rank order, so cutting the buffer changes
// no bit. Without accumulation the backward must start most buckets itself (overlap); with it,
// none (the gradient is final only after the last micro-batch). With the experts split (and
// sharded: AdamW) the trainer sums after the backward by ownership (reduce_sharded) instead.
static void compare_buckets(const char *model, vlmoe_dist *d, int ep, int accum) {
    const int batch = GLOBAL / d->world / accum;
    double l0[STEPS] = {0}, g0[STEPS] = {0}, lb[STEPS] = {0}, gb[STEPS] = {0};
    float *p0 = NULL, *pb = NULL;
    size_t n0 = 0, nb = 0;
    g_cap_mb = 0;
    int st = train(model, d, ep ? d : NULL, batch, accum, l0, g0, &p0, &n0, NULL);
    const buckets_info one = g_info;
    g_cap_mb = 0.001;
    if (!st) st = train(model, d, ep ? d : NULL, batch, accum, lb, gb, &pb, &nb, NULL);
    const buckets_info many = g_info;
    g_cap_mb = 25;
    CHECK(st == VLMOE_OK && n0 == nb, "%s: bucketed runs on %d processes", model, d->world);
    if (st) {
        free(p0), free(pb);
        return;
    }
    int same = !memcmp(p0, pb, sizeof(float) * n0);
    for (int s = 0; s < STEPS; s++) same &= l0[s] == lb[s] && g0[s] == gb[s];
    CHECK(same, "%s: %d buckets changed the losses, gradient norms or parameters (process %d)", model, many.count, d->rank);
    if (d->world == 1) { // no data parallelism, no buckets
        CHECK(one.count == 0 && many.count == 0, "%s: %d and %d buckets in a world of one", model, one.count, many.count);
    } else if (ep) { // sharded experts (AdamW): their own reduction after the backward, not these buckets
        CHECK(one.count == 0 && many.count == 0, "%s: %d and %d buckets with sharded experts (want none)", model,
              one.count, many.count);
    } else {
        CHECK(one.count == 1 && many.count > 20, "%s: %d and %d buckets (want 1 and > 20)", model, one.count, many.count);
        if (accum == 1)
            CHECK(many.started_early >= many.count - 8, "%s: the backward started %d of %d buckets (want all but the "
                  "stems')", model, many.started_early, many.count);
        else
            CHECK(many.started_early == 0, "%s: %d buckets started before the last micro-batch's end", model,
                  many.started_early);
    }
    if (d->rank == 0)
        printf("%s%s%s: %d processes, 1 bucket vs %d (largest %zu floats, %d started during the backward): losses, "
               "gradient norms and parameters %s\n", model, ep ? " (experts split over every process)" : "",
               accum > 1 ? " (accumulated)" : "", d->world, many.count, many.largest, many.started_early,
               same ? "bit-identical" : "DIFFER");
    free(p0), free(pb);
}

// ---- VL-MoE pre-training (src/train/mome_task.c): three streams, masks and per-stream losses

enum { MOME_GLOBAL = 48 }; // --mix 2,1,1: 24 images (2 forwards), 12 texts, 12 pairs a step

// The statistics the train record reports of a step, per stream (src/train/mome_task.c's m_log).
static const char *const MOME_KEYS[] = {"mim", "mim_acc", "mlm", "mlm_acc", "vlm_text", "vlm_image"};
enum { NKEYS = 6 };

// Trains vlmoe-tiny (V-MoE and T-MoE layers routing groups of one sequence, so that a process holds
// whole groups) as process `rank` of d (NULL: alone) at `batch` samples per process, STEPS AdamW
// steps on the synthetic streams; the same outputs as train(), and keys[s] the per-stream record.
static int train_mome(vlmoe_dist *d, int batch, double *losses, double *norms, float **params, size_t *n,
                      int64_t (*counts)[NCOUNT], double (*keys)[NKEYS]) {
    vlmoe_model_config c;
    vlmoe_model *m = NULL;
    vlmoe_trainer *t = NULL;
    vlmoe_mome_run *task = NULL;
    int st = vlmoe_config_named("vlmoe-tiny", &c);
    const int g = c.image_size / c.patch_size, pd = 3 * c.patch_size * c.patch_size;
    c.moe.group_size = 1 + g * g;          // the image tokens of one sequence ([I_CLS] and the patches)
    c.text_moe.group_size = c.context_length;
    float *cb = malloc(sizeof(float) * (size_t)c.mim_vocab * pd); // a codebook: any fixed centroids
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 11);
    for (size_t i = 0; i < (size_t)c.mim_vocab * pd; i++) cb[i] = (float)(2 * vlmoe_rng_uniform(&r) - 1);
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.schedule = (vlmoe_schedule){VLMOE_SCHED_COSINE, 1e-3, 2, STEPS, 0.0, 0, 0};
    const vlmoe_mome_params mp = {.config = &c, .batch_size = batch, .mix = {2, 1, 1}, .seed = 5,
                                  .rank = d ? d->rank : 0, .world = d ? d->world : 1};
    if (!st) st = vlmoe_mome_init(&task, &mp);
    if (!st) st = vlmoe_model_init(&m, &c, 7);
    // stochastic depth as VL-MoE pre-trains: each sample's draw keyed by its global index, so
    // the processes drop the paths one process drops
    if (!st) st = vlmoe_model_set_drop_path(m, 0.1);
    if (!st) st = vlmoe_trainer_init(&t, m, &tp);
    if (!st) st = vlmoe_mome_start(task, m, cb, NULL, NULL);
    const vlmoe_run_task rt = task ? vlmoe_mome_task(task) : (vlmoe_run_task){0};
    vlmoe_trainer_set_dist(t, d, NULL);
    for (long step = 0; !st && step < STEPS; step++) {
        vlmoe_step_stats ss;
        st = rt.fill(rt.user, step);
        if (!st) st = rt.step(rt.user, t, step, &ss);
        if (!st) losses[step] = ss.loss, norms[step] = ss.grad_norm;
        if (!st) routing_counts(m, counts[step]); // the step's last forward: the pairs, V-MoE and T-MoE
        cJSON *rec = st ? NULL : vlmoe_metrics_record(step + 1, "train");
        char line[1024];
        if (rec) st = rt.log(rt.user, step + 1, &ss, rec, line, sizeof(line));
        for (int k = 0; rec && !st && k < NKEYS; k++) {
            const cJSON *v = cJSON_GetObjectItemCaseSensitive(rec, MOME_KEYS[k]);
            keys[step][k] = cJSON_IsNumber(v) ? v->valuedouble : NAN;
        }
        cJSON_Delete(rec);
    }
    if (!st && g_want_state && (!d || d->rank == 0)) { // (rank 0 holds every expert's state after the gather)
        vlmoe_optim *o = vlmoe_trainer_optim(t);
        g_nstate = 0;
        for (int i = 0; i < vlmoe_optim_state_count(o); i++) {
            size_t k;
            vlmoe_optim_state_get(o, i, NULL, NULL, &k);
            g_nstate += k;
        }
        free(g_state);
        g_state = malloc(sizeof(float) * (g_nstate + 1));
        size_t at = 0;
        for (int i = 0; i < vlmoe_optim_state_count(o); i++) {
            size_t k;
            float *x;
            vlmoe_optim_state_get(o, i, NULL, &x, &k);
            memcpy(g_state + at, x, sizeof(float) * k), at += k;
        }
    }
    if (!st && params) {
        int ntab;
        const vlmoe_param_info *tab = vlmoe_model_params(m, &ntab);
        free(g_keyb);
        g_keyb = calloc(vlmoe_model_num_floats(m), 1);
        for (int i = 0; i < ntab; i++)
            if (strstr(tab[i].name, "attn.qkv.bias"))
                memset(g_keyb + tab[i].offset + tab[i].numel / 3, 1, tab[i].numel / 3);
        *n = vlmoe_model_num_floats(m);
        *params = malloc(sizeof(float) * *n);
        memcpy(*params, vlmoe_model_param_data(m), sizeof(float) * *n);
    }
    if (st) fprintf(stderr, "train vlmoe-tiny: %s\n", vlmoe_last_error());
    vlmoe_trainer_set_dist(t, NULL, NULL);
    vlmoe_mome_free(task);
    vlmoe_trainer_free(t);
    vlmoe_model_free(m);
    free(cb);
    return st;
}

// W processes at MOME_GLOBAL/W against one at MOME_GLOBAL: the same losses, gradient norms,
// per-stream losses and accuracies, final parameters, and routing counts summed over the processes.
static void compare_mome(vlmoe_dist *d) {
    const int batch = MOME_GLOBAL / d->world;
    double dp[STEPS] = {0}, one[STEPS] = {0}, gdp[STEPS] = {0}, gone[STEPS] = {0};
    static int64_t cdp[STEPS][NCOUNT], cone[STEPS][NCOUNT];
    static double kdp[STEPS][NKEYS], kone[STEPS][NKEYS];
    memset(cdp, 0, sizeof(cdp)), memset(cone, 0, sizeof(cone));
    float *pd = NULL, *p1 = NULL;
    size_t n = 0, n1 = 0;
    CHECK(train_mome(d, batch, dp, gdp, &pd, &n, cdp, kdp) == VLMOE_OK, "vlmoe-tiny: data-parallel run on %d processes",
          d->world);
    d->allreduce_sum(d, cdp, (size_t)STEPS * NCOUNT, VLMOE_DIST_I64);
    if (pd && d->world > 1) {
        float *r0 = malloc(sizeof(float) * n);
        memcpy(r0, pd, sizeof(float) * n);
        d->broadcast(d, r0, n, VLMOE_DIST_F32, 0);
        CHECK(!memcmp(r0, pd, sizeof(float) * n), "vlmoe-tiny: process %d's parameters differ from process 0's", d->rank);
        free(r0);
    }
    if (d->rank == 0) {
        CHECK(train_mome(NULL, MOME_GLOBAL, one, gone, &p1, &n1, cone, kone) == VLMOE_OK && n1 == n,
              "vlmoe-tiny: one process");
        int differ = -1;
        for (int s = 0; s < STEPS && differ < 0; s++)
            if (memcmp(cdp[s], cone[s], sizeof(cone[s]))) differ = s;
        CHECK(differ < 0, "vlmoe-tiny: routing counts of step %d summed over %d processes differ from one process's",
              differ + 1, d->world);
        int64_t routed = 0;
        for (int k = 0; k < NCOUNT; k++) routed += cone[STEPS - 1][k];
        CHECK(routed > 0, "vlmoe-tiny: %lld routing counts in the last step", (long long)routed);
        double worst = 0, gworst = 0, kworst = 0, pworst = 0;
        for (int s = 0; s < STEPS; s++) {
            const double rel = fabs(dp[s] - one[s]) / fabs(one[s]), grel = fabs(gdp[s] - gone[s]) / fabs(gone[s]);
            worst = rel > worst ? rel : worst;
            gworst = grel > gworst ? grel : gworst;
            for (int k = 0; k < NKEYS; k++) {
                const double e = fabs(kdp[s][k] - kone[s][k]) / fmax(fabs(kone[s][k]), 1e-3);
                kworst = e > kworst || e != e ? e : kworst;
            }
            if (d->world == 1) CHECK(dp[s] == one[s], "vlmoe-tiny step %d: %.17g vs %.17g in a world of one", s + 1, dp[s], one[s]);
        }
        for (size_t i = 0; p1 && pd && i < n; i++) {
            const double e = fabs((double)pd[i] - (double)p1[i]);
            pworst = e > pworst ? e : pworst;
        }
        printf("vlmoe-tiny: %d processes x %d samples vs 1 x %d (--mix 2,1,1), %d steps: losses %.6f..%.6f, max relative "
               "difference of the losses %.2e, of the gradient norms %.2e, of the per-stream losses and accuracies "
               "%.2e; max parameter difference %.2e\n", d->world, batch, MOME_GLOBAL, STEPS, one[0], one[STEPS - 1],
               worst, gworst, kworst, pworst);
        CHECK(gworst <= 1e-5, "vlmoe-tiny: gradient norms differ by %.3e (relative) from the one-process run", gworst);
        CHECK(worst <= 1e-5, "vlmoe-tiny: losses differ by %.3e (relative) from the one-process run", worst);
        CHECK(kworst <= 1e-5, "vlmoe-tiny: per-stream losses / accuracies differ by %.3e from the one-process run", kworst);
        CHECK(pworst <= 1e-5, "vlmoe-tiny: parameters differ by %.3e from the one-process run", pworst);
        if (d->world == 1) CHECK(p1 && pd && !memcmp(p1, pd, sizeof(float) * n), "vlmoe-tiny: parameters in a world of one");
    }
    free(pd), free(p1);
}

// A NaN in the batch of the last process only, at step 2: every process stops at that step with
// VLMOE_ERR_NUMERIC (none is left waiting in a collective) and the parameters of step 1 unchanged.
static void test_divergence(vlmoe_dist *d) {
    vlmoe_model_config c;
    vlmoe_model *m = NULL;
    vlmoe_trainer *t = NULL;
    vlmoe_synth *s = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    vlmoe_train_params tp = vlmoe_train_default_params();
    vlmoe_config_named("tiny", &c);
    sp.image_size = c.image_size;
    const int B = 4, T = c.context_length;
    const size_t isz = (size_t)3 * c.image_size * c.image_size;
    float *img = malloc(sizeof(float) * isz * B), *before = NULL;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)B * T), *len = malloc(sizeof(int32_t) * B);
    int st = vlmoe_model_init(&m, &c, 3);
    if (!st) st = vlmoe_model_plan(m, B);
    if (!st) st = vlmoe_trainer_init(&t, m, &tp);
    if (!st) st = vlmoe_synth_init(&s, &sp);
    CHECK(st == VLMOE_OK, "divergence set-up: %s", vlmoe_last_error());
    if (st) return;
    vlmoe_trainer_set_dist(t, d, NULL);
    int got[2] = {0, 0};
    for (int step = 0; step < 2; step++) {
        vlmoe_synth_batch(s, VLMOE_SPLIT_TRAIN, (uint64_t)(step * d->world + d->rank) * B, B, T, img, tok, len);
        if (step == 1 && d->rank == d->world - 1) img[5] = NAN;
        if (step == 1) {
            before = malloc(sizeof(float) * vlmoe_model_num_floats(m));
            memcpy(before, vlmoe_model_param_data(m), sizeof(float) * vlmoe_model_num_floats(m));
        }
        const vlmoe_batch b = {B, img, tok, len};
        vlmoe_step_stats ss;
        got[step] = vlmoe_trainer_step(t, &b, &ss);
    }
    CHECK(got[0] == VLMOE_OK && got[1] == VLMOE_ERR_NUMERIC, "process %d: step 1 %d, step 2 %d (want 0, %d): %s",
          d->rank, got[0], got[1], VLMOE_ERR_NUMERIC, vlmoe_last_error());
    CHECK(before && !memcmp(before, vlmoe_model_param_data(m), sizeof(float) * vlmoe_model_num_floats(m)) &&
              vlmoe_trainer_get_step(t) == 1, "process %d: the diverged step changed the parameters", d->rank);
    vlmoe_trainer_set_dist(t, NULL, NULL);
    free(img), free(tok), free(len), free(before);
    vlmoe_synth_free(s), vlmoe_trainer_free(t), vlmoe_model_free(m);
}

// The same for VL-MoE: a NaN image in the first forward (MIM) of the last process at step 2 makes
// its loss non-finite; it still runs the second forward (MLM), whose label counts every process
// all-reduces, and then every process stops at that step with the parameters of step 1.
static void test_mome_divergence(vlmoe_dist *d) {
    vlmoe_model_config c;
    vlmoe_config_named("vlmoe-tiny", &c);
    c.moe.group_size = 1 + (c.image_size / c.patch_size) * (c.image_size / c.patch_size);
    c.text_moe.group_size = c.context_length;
    const int B = 2, T = c.context_length, np = c.moe.group_size - 1, pd = 3 * c.patch_size * c.patch_size;
    const size_t isz = (size_t)3 * c.image_size * c.image_size;
    float *img = malloc(sizeof(float) * isz * B), *cb = malloc(sizeof(float) * (size_t)c.mim_vocab * pd), *before = NULL;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)B * T), *len = malloc(sizeof(int32_t) * B);
    int32_t *tin = malloc(sizeof(int32_t) * (size_t)B * T), *tl = malloc(sizeof(int32_t) * (size_t)B * T);
    int32_t *pl = malloc(sizeof(int32_t) * (size_t)B * np);
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 3);
    for (size_t i = 0; i < (size_t)c.mim_vocab * pd; i++) cb[i] = (float)(2 * vlmoe_rng_uniform(&r) - 1);
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c.image_size;
    vlmoe_synth *s = NULL;
    vlmoe_model *m = NULL;
    vlmoe_trainer *t = NULL;
    vlmoe_train_params tp = vlmoe_train_default_params();
    const vlmoe_mlm_params mlm = vlmoe_mlm_default_params(&c);
    int st = vlmoe_model_init(&m, &c, 3);
    if (!st) st = vlmoe_trainer_init(&t, m, &tp);
    if (!st) st = vlmoe_synth_init(&s, &sp);
    CHECK(st == VLMOE_OK, "VL-MoE divergence set-up: %s", vlmoe_last_error());
    if (st) return;
    vlmoe_trainer_set_dist(t, d, NULL);
    int got[2] = {0, 0};
    for (int step = 0; step < 2; step++) {
        vlmoe_synth_batch(s, VLMOE_SPLIT_TRAIN, (uint64_t)(step * d->world + d->rank) * B, B, T, img, tok, len);
        vlmoe_mim_labels(&c, cb, c.mim_vocab, img, B, 0.4, (uint64_t)step, pl);
        vlmoe_mlm_mask(&mlm, (uint64_t)step, tok, len, B, T, tin, tl);
        if (step == 1 && d->rank == d->world - 1) img[5] = NAN;
        if (step == 1) {
            before = malloc(sizeof(float) * vlmoe_model_num_floats(m));
            memcpy(before, vlmoe_model_param_data(m), sizeof(float) * vlmoe_model_num_floats(m));
        }
        const vlmoe_mome_batch parts[2] = {{.encoding = VLMOE_ENC_IMAGE, .batch_size = B, .images = img, .patch_labels = pl},
                                           {.encoding = VLMOE_ENC_TEXT, .batch_size = B, .tokens = tin, .lengths = len,
                                            .text_labels = tl}};
        vlmoe_mome_stats ps[2];
        vlmoe_step_stats ss;
        got[step] = vlmoe_trainer_step_mome(t, parts, 2, ps, &ss);
    }
    CHECK(got[0] == VLMOE_OK && got[1] == VLMOE_ERR_NUMERIC, "VL-MoE process %d: step 1 %d, step 2 %d (want 0, %d): %s",
          d->rank, got[0], got[1], VLMOE_ERR_NUMERIC, vlmoe_last_error());
    CHECK(before && !memcmp(before, vlmoe_model_param_data(m), sizeof(float) * vlmoe_model_num_floats(m)) &&
              vlmoe_trainer_get_step(t) == 1, "VL-MoE process %d: the diverged step changed the parameters", d->rank);
    vlmoe_trainer_set_dist(t, NULL, NULL);
    free(img), free(cb), free(before), free(tok), free(len), free(tin), free(tl), free(pl);
    vlmoe_synth_free(s), vlmoe_trainer_free(t), vlmoe_model_free(m);
}

int main(void) {
    vlmoe_dist *d = NULL;
    if (vlmoe_dist_open(&d, "auto")) {
        fprintf(stderr, "test_train_dist: %s\n", vlmoe_last_error());
        return 1;
    }
    test_divergence(d);
    test_mome_divergence(d);
    compare_buckets("limoe-tiny", d, 0, 1);
    compare_buckets("clipup-tiny", d, 0, 1);
    compare_buckets("limoe-tiny", d, 0, (GLOBAL / d->world) % 4 == 0 ? 2 : 3);
    if (d->world > 1 && 4 % d->world == 0) compare_buckets("limoe-tiny", d, d->world, 1);
    compare("tiny", d, 0, 1);         // dense one_tower
    compare("limoe-tiny", d, 0, 1);   // LIMoE: MoE layers, routing noise and groups of whole examples
    compare("clipup-tiny", d, 0, 1);  // CLIP-UP: two towers, top-2 MoE in each
    compare_mome(d);                  // VL-MoE: masked modeling on three streams
    // --accum-freq on every process: the global batch is processes x micro-batches x pairs, each
    // micro-batch of whole routing groups (of 2 examples: 12, 6, 4 or 2 pairs)
    const int accum = (GLOBAL / d->world) % 4 == 0 ? 2 : 3;
    compare("limoe-tiny", d, 0, accum);
    compare("clipup-tiny", d, 0, accum);
    // expert parallelism: each process computes its share of the experts for every process's
    // tokens (the all-to-all dispatch of src/moe/layer.c), when the process count divides them
    static const char *const moe[2] = {"limoe-tiny", "clipup-tiny"};
    for (int k = 0; k < 2; k++) {
        vlmoe_model_config c;
        vlmoe_config_named(moe[k], &c);
        if (c.moe.num_experts % d->world == 0) {
            compare(moe[k], d, d->world, 1);
            if (d->world == 4) { // 2 groups of 2, data parallel between them
                // the sharded reduction in buckets of 1000 floats (src/train/trainer.c), which
                // split the dense runs and expert slices: the same model as one process
                setenv("VLMOE_TEST_BUCKET_FLOATS", "1000", 1);
                compare(moe[k], d, 2, 1);
                unsetenv("VLMOE_TEST_BUCKET_FLOATS");
            }
            if (k == 0) compare(moe[k], d, d->world, accum);
        } else {
            double l[STEPS], g[STEPS];
            const int st = train(moe[k], d, d, GLOBAL / d->world, 1, l, g, NULL, NULL, NULL);
            CHECK(st == VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), "do not split over"),
                  "%d experts over %d processes: %s", c.moe.num_experts, d->world, vlmoe_last_error());
        }
    }
    // LIMoE's own recipe, Adafactor (momentum in bfloat16): its factored moments and momentum are
    // per expert matrix, so they shard with the experts as AdamW's moments do
    g_opt = VLMOE_OPT_ADAFACTOR;
    compare("limoe-tiny", d, 0, 1); // data parallel only
    if (d->world > 1 && 8 % d->world == 0) { // limoe-tiny's 8 experts
        compare("limoe-tiny", d, d->world, 1);
        compare_replicated("limoe-tiny", d, d->world);
        if (d->world == 4) {
            setenv("VLMOE_TEST_BUCKET_FLOATS", "1000", 1);
            compare("limoe-tiny", d, 2, 1);
            compare_replicated("limoe-tiny", d, 2);
            unsetenv("VLMOE_TEST_BUCKET_FLOATS");
        }
        // 32 experts: the bias banks (32, 256) are factored over the experts and stay replicated,
        // the weight banks (32, 256, 64) are sharded
        g_experts = 32;
        compare_replicated("limoe-tiny", d, d->world);
        g_experts = 0;
    }
    g_opt = VLMOE_OPT_ADAMW;
    vlmoe_dist_close(d);
    ref_free();
    return test_summary("test_train_dist");
}
