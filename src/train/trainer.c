// trainer.c: one optimisation step of a contrastive model (over one batch, or accumulated over
// micro-batches: src/nn/towers_accum.c), or of a VL-MoE model over several
// masked-modeling batches whose gradients add up: forward, backward, the divergence guard (a
// non-finite loss or gradient stops the step before any parameter changes), global-norm
// clipping, the learning-rate schedule, the optimizer update and CLIP's temperature clamp. With
// data parallelism, the gradient's sum over the processes in buckets (src/train/buckets.c).
// Covered by tests/test_train.c, tests/test_mome.c, tests/test_accum.c and, against PyTorch,
// tests/test_parity.c.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "dist/dist.h"
#include "nn/model.h"
#include "ops/gemm_bf16.h"
#include "optim/optim.h"
#include "train/buckets.h"
#include "train/run.h"
#include "vlmoe.h"

struct vlmoe_trainer {
    vlmoe_model *m;
    vlmoe_optim *opt;
    vlmoe_train_params p;
    vlmoe_param_info *frozen;   // freeze_moe, lock_*: tensors left out of the optimizer
    int nfrozen;
    vlmoe_dist *dist;           // data parallelism: the processes whose gradients are averaged
    struct shard *shard;        // expert parallelism: who reduces and updates what (below)
    train_buckets *bk;          // and the buckets their sum goes in (made at the first step)
    char run_id[VLMOE_RUN_ID_LEN]; // the run's id in its checkpoints ("" until the first save or load)
    int shadows;                // this step keeps bf16 shadows of the weights (shadows_begin)
};

char *vlmoe_trainer_run_id(vlmoe_trainer *t) { return t->run_id; }

// Expert parallelism shards the experts (issue 15; docs/DISTRIBUTED.md "Sharding the expert
// parameters"): a process of an expert group of N holds the parameters, gradients and optimizer
// state of its E/N experts of every bank only: the model's layout becomes its shard
// (model_reshard: every split bank (E/N, ...), the offsets after it shifted) and the optimizer
// follows it (optim_relayout), so the flat loops (clipping, AdamW, the sums) stay flat. Dense
// tensors are all-reduced over the whole world as in plain data parallelism, a process's banks
// only over its `replicas`, the processes at the same place of every group (world / N of them).
// A bank whose Adafactor state does not split (factored over the expert dim) stays whole,
// replicated, a dense tensor (its gradient, each expert's written by its owner and zero
// elsewhere, summed over the world). Rank 0 becomes whole to write or evaluate (the others send
// it their experts) and goes back to its shard after; at the end of a run every process becomes
// whole (vlmoe_trainer_gather_experts). Covered by tests/test_train_dist.c and
// tests/test_dist_mpi.sh.
typedef struct { size_t off, n; } span; // floats [off, off + n) of the flat buffer

struct shard {
    vlmoe_dist *experts, *replicas; // replicas: NULL when groups span the world (one copy each)
    int q, N;                       // this process's place in its group, the group's size
    int root_group;                 // the group holds world rank 0
    model_shard layout;             // this process's experts (the model's layout between gathers)
    model_bank *banks;              // (nbanks) the split banks, in the shard's layout
    size_t *whole_off;              // (nbanks) their offsets in the whole model's
    int nbanks;
    span *dense;                    // the shard's buffer outside every split bank, in order
    int ndense;
    int whole;                      // the model is whole now (gathered), not the shard
    float *buf;                     // packing scratch for the all-reduces: nbuf floats
    size_t nbuf;
    size_t *cnt;                    // (4N) all-to-all counts and displacements of the gather
};

// Frozen tensors (freeze_moe, locks) are not the optimizer's: a bank of them splits whatever it
// uses. Otherwise a bank splits where the optimizer's state does (optim_splits).
static int keep_whole(void *user, const vlmoe_param_info *bank) {
    const vlmoe_trainer *t = user;
    for (int i = 0; i < t->nfrozen; i++)
        if (!strcmp(t->frozen[i].name, bank->name)) return 0;
    return !optim_splits(&t->p.optim, bank);
}

// The optimizer to the layout of shard sh (NULL: whole): its table is that layout's less the
// frozen tensors, a split bank with its local shape. keep 0: its state becomes zero instead of
// moving (a process whose state nobody reads again: the end of a run).
static int optim_to(vlmoe_trainer *t, const model_shard *sh, int keep) {
    model_layout L;
    int st = model_layout_build_shard(&L, vlmoe_model_get_config(t->m), sh);
    vlmoe_param_info *train = st ? NULL : malloc(sizeof(*train) * (size_t)L.nparams);
    if (!st && !train) st = vlmoe_fail(VLMOE_ERR_NOMEM, "expert parallelism");
    int nt = 0;
    for (int i = 0; !st && i < L.nparams; i++) {
        int frozen = 0;
        for (int k = 0; k < t->nfrozen && !frozen; k++) frozen = !strcmp(t->frozen[k].name, L.table[i].name);
        if (frozen) continue;
        train[nt] = L.table[i];
        if (L.table[i].experts_local) train[nt].shape[0] = L.table[i].experts_local;
        nt++;
    }
    if (!st) st = optim_relayout(t->opt, train, nt, L.total, keep);
    free(train);
    model_layout_free(&L);
    return st;
}

// The model to the layout of shard sh (NULL: whole), the frozen list with it.
static int model_to(vlmoe_trainer *t, const model_shard *sh) {
    int st = model_reshard(t->m, sh), n;
    if (st) return st;
    buckets_free(t->bk); // they point into the old gradients
    t->bk = NULL;
    const vlmoe_param_info *tab = vlmoe_model_params(t->m, &n);
    for (int k = 0; k < t->nfrozen; k++)
        for (int i = 0; i < n; i++)
            if (!strcmp(t->frozen[k].name, tab[i].name)) t->frozen[k] = tab[i];
    return VLMOE_OK;
}

// Both, the model first (its whole parameters go before the whole state comes, and back).
static int relayout(vlmoe_trainer *t, const model_shard *sh) {
    int st = model_to(t, sh);
    return st ? st : optim_to(t, sh, 1);
}

static void shard_free(vlmoe_trainer *t) {
    struct shard *sh = t->shard;
    if (!sh) return;
    // a run that stopped between gathers: the model becomes whole again for whoever holds it, with
    // this process's experts current and the others' zero (out of memory, it keeps its shard,
    // which no model file takes: model_writer refuses it)
    if (t->m->L.nsplit) (void)relayout(t, NULL);
    if (sh->replicas) vlmoe_dist_close(sh->replicas);
    free(sh->banks), free(sh->whole_off), free(sh->dense), free(sh->cnt);
    vlmoe_free_mem(sh->buf);
    free(sh);
    t->shard = NULL;
}

static int cmp_span(const void *a, const void *b) {
    const size_t x = ((const span *)a)->off, y = ((const span *)b)->off;
    return x < y ? -1 : x > y;
}

// This process's share of bank b in the shard's layout: floats [off, off + n).
static span own_span(const model_bank *b) { return (span){b->offset, (size_t)b->El * b->per}; }

// Sets up t->shard for expert groups `ex` of world d and splits the model (collective over d: the
// replicas' split).
static int shard_init(vlmoe_trainer *t, vlmoe_dist *d, vlmoe_dist *ex) {
    struct shard *sh = t->shard = calloc(1, sizeof(*sh));
    if (!sh) return vlmoe_fail(VLMOE_ERR_NOMEM, "expert parallelism");
    sh->experts = ex, sh->q = ex->rank, sh->N = ex->world;
    sh->layout = (model_shard){.rank = ex->rank, .size = ex->world, .keep_whole = keep_whole, .user = t};
    const int nb = model_expert_banks(t->m, NULL, 0);
    model_bank *whole = malloc(sizeof(model_bank) * (size_t)(nb + 1));
    sh->banks = malloc(sizeof(model_bank) * (size_t)(nb + 1));
    sh->whole_off = malloc(sizeof(size_t) * (size_t)(nb + 1));
    sh->dense = malloc(sizeof(span) * (size_t)(nb + 1));
    sh->cnt = malloc(sizeof(size_t) * 4 * (size_t)sh->N);
    if (!whole || !sh->banks || !sh->whole_off || !sh->dense || !sh->cnt)
        return free(whole), vlmoe_fail(VLMOE_ERR_NOMEM, "expert parallelism");
    model_expert_banks(t->m, whole, nb);
    for (int i = 0; i < nb; i++)
        if (whole[i].E % sh->N) {
            const int E = whole[i].E;
            free(whole);
            return vlmoe_fail(VLMOE_ERR_CONFIG, "expert parallelism: %d experts do not split over %d processes (the "
                              "process count must divide num_experts)", E, sh->N);
        }
    int st = relayout(t, &sh->layout);
    if (st) return free(whole), st;
    model_bank *local = malloc(sizeof(model_bank) * (size_t)(nb + 1));
    if (!local) return free(whole), vlmoe_fail(VLMOE_ERR_NOMEM, "expert parallelism");
    model_expert_banks(t->m, local, nb); // the same banks in the same order, in the shard's layout
    for (int i = 0; i < nb; i++)
        if (local[i].El < local[i].E) sh->whole_off[sh->nbanks] = whole[i].offset, sh->banks[sh->nbanks++] = local[i];
    free(whole), free(local);
    // the dense runs between the split banks (the banks come in no particular order of offsets)
    const size_t total = vlmoe_model_num_floats(t->m);
    span *own = malloc(sizeof(span) * (size_t)(sh->nbanks + 1));
    if (!own) return vlmoe_fail(VLMOE_ERR_NOMEM, "expert parallelism");
    for (int i = 0; i < sh->nbanks; i++) own[i] = own_span(&sh->banks[i]);
    qsort(own, (size_t)sh->nbanks, sizeof(span), cmp_span);
    size_t at = 0;
    for (int i = 0; i < sh->nbanks; i++) {
        if (own[i].off > at) sh->dense[sh->ndense++] = (span){at, own[i].off - at};
        at = own[i].off + own[i].n;
    }
    if (total > at) sh->dense[sh->ndense++] = (span){at, total - at};
    free(own);
    // 16 MiB buckets (or the whole buffer, when smaller): few all-reduces, little scratch
    // (VLMOE_TEST_BUCKET_FLOATS, a test hook of tests/test_train_dist.c: smaller buckets, so that
    // spans split across them in a small model)
    const char *tb = getenv("VLMOE_TEST_BUCKET_FLOATS");
    const size_t cap = tb && atol(tb) > 0 ? (size_t)atol(tb) : (size_t)4 << 20;
    sh->nbuf = total < cap ? total : cap;
    if (!(sh->buf = vlmoe_alloc(sizeof(float) * (sh->nbuf + 1), "expert parallelism: packing buffer")))
        return VLMOE_ERR_NOMEM;
    int32_t r0 = d->rank; // which group holds world rank 0 (its checkpoints' gathers)
    if ((st = ex->broadcast(ex, &r0, 1, VLMOE_DIST_I32, 0))) return st;
    sh->root_group = r0 == 0;
    // the replicas: the same place q in every group
    if (ex->world < d->world && (st = vlmoe_dist_split(d, sh->q, d->rank, &sh->replicas))) return st;
    return VLMOE_OK;
}

// One process's AdamW steps on a table without host memory keep the parameters, gradients and
// both moments resident there (model_go_resident, optim_to_device): no upload before a forward,
// no gradient download after a backward; the host's copies are mirrors synced when read. Any
// other step (data parallelism, accumulation, VL-MoE, Adafactor) takes the host's path, so
// to_host makes the host's copies the masters again first.
static void to_host(vlmoe_trainer *t) {
    model_leave_resident(t->m);
    optim_leave_device(t->opt);
}

static int to_device(vlmoe_trainer *t, int *on) {
    *on = 0;
    if (t->dist || !model_go_resident(t->m)) return to_host(t), VLMOE_OK;
    int st = optim_to_device(t->opt, t->m->be, on);
    if (st || !*on) to_host(t);
    return st;
}

int vlmoe_trainer_set_dist(vlmoe_trainer *t, vlmoe_dist *d, vlmoe_dist *experts) {
    to_host(t);
    shard_free(t);
    t->dist = d && d->world > 1 ? d : NULL;
    model_set_dist(t->m, t->dist, experts);
    model_set_grad_ready(t->m, NULL, NULL);
    // VLMOE_TEST_REPLICATE_EXPERTS (a test hook of tests/test_train_dist.c and test_dist_mpi.sh):
    // every process holds every expert, whose gradients are summed over the world as dense
    // tensors, the path sharding must reproduce
    const char *rep = getenv("VLMOE_TEST_REPLICATE_EXPERTS");
    if (!t->dist || !experts || experts->world < 2 || (rep && *rep && strcmp(rep, "0"))) return VLMOE_OK;
    int st = shard_init(t, t->dist, experts);
    if (st) {
        vlmoe_error_prefix("expert parallelism over %d processes", experts->world);
        shard_free(t);
        return st;
    }
    return VLMOE_OK;
}

// Sums the spans of g over d in place, packed into buckets of at most sh->nbuf floats (DDP's
// buckets: one all-reduce per bucket, a bounded scratch buffer instead of a second copy of the
// gradients). Element-wise sums, so the bucketing changes no bit of the result.
static int reduce_spans(struct shard *sh, vlmoe_dist *d, float *g, const span *s, int n) {
    int i = 0;
    size_t at = 0; // floats of span i already reduced
    while (i < n) {
        const int i0 = i;
        const size_t at0 = at;
        size_t used = 0;
        for (; i < n && used < sh->nbuf; at = 0, i++) { // pack
            const size_t k = s[i].n - at < sh->nbuf - used ? s[i].n - at : sh->nbuf - used;
            memcpy(sh->buf + used, g + s[i].off + at, sizeof(float) * k);
            used += k;
            if (at + k < s[i].n) { at += k; break; }
        }
        if (!used) break;
        int e = d->allreduce_sum(d, sh->buf, used, VLMOE_DIST_F32);
        if (e) return e;
        size_t got = 0;
        for (int j = i0; got < used; j++) { // unpack the same pieces
            const size_t from = j == i0 ? at0 : 0;
            const size_t k = s[j].n - from < used - got ? s[j].n - from : used - got;
            memcpy(g + s[j].off + from, sh->buf + got, sizeof(float) * k);
            got += k;
        }
    }
    return VLMOE_OK;
}

// The sharded gradient reduction: dense runs summed over the world, this process's experts over
// its replicas.
static int reduce_sharded(vlmoe_trainer *t, float *g) {
    struct shard *sh = t->shard;
    int e = reduce_spans(sh, t->dist, g, sh->dense, sh->ndense);
    if (e || !sh->replicas || sh->replicas->world < 2) return e;
    for (int i = 0; i < sh->nbanks && !e; i++) {
        const span o = own_span(&sh->banks[i]);
        e = reduce_spans(sh, sh->replicas, g, &o, 1);
    }
    return e;
}

// Global-norm clipping over the sharded gradient: every expert's gradient counted once (its
// owner's, summed over the group) and the dense ones once. The one-process norm to double
// rounding.
static int clip_sharded(vlmoe_trainer *t, float *g, double *norm) {
    struct shard *sh = t->shard;
    const vlmoe_backend_f32 *hb = model_host_backend(t->m);
    double dense = 0, own = 0;
    for (int i = 0; i < sh->ndense; i++) dense += hb->sumsq(hb, g + sh->dense[i].off, sh->dense[i].n, NULL);
    for (int i = 0; i < sh->nbanks; i++) {
        const span o = own_span(&sh->banks[i]);
        own += hb->sumsq(hb, g + o.off, o.n, NULL);
    }
    int e = sh->experts->allreduce_sum(sh->experts, &own, 1, VLMOE_DIST_F64);
    if (e) return e;
    *norm = optim_clip_grad_norm_given(hb, g, vlmoe_model_num_floats(t->m), t->p.grad_clip_norm, dense + own);
    return VLMOE_OK;
}

// Sends each split bank's buffer k (0: the parameters, 1.. the optimizer's state buffers) from
// the processes of the expert group to its first process (every 0) or to every process (every 1,
// the parameters only): a process that is whole sends its slice of the whole bank and receives
// the others', one that holds its shard sends that. state: 0 the parameters, 1 the optimizer's
// state; whole: that is whole on this process.
static int exchange(vlmoe_trainer *t, int state, int every, int whole) {
    struct shard *sh = t->shard;
    vlmoe_dist *ex = sh->experts;
    size_t *sc = sh->cnt, *sd = sc + sh->N, *rc = sd + sh->N, *rd = rc + sh->N;
    const vlmoe_optim *o = vlmoe_trainer_optim(t);
    int e = VLMOE_OK;
    for (int i = 0; i < sh->nbanks && !e; i++) {
        const model_bank *b = &sh->banks[i];
        const size_t off = whole ? sh->whole_off[i] : b->offset, El = (size_t)b->El;
        // each buffer holds the experts held one after the other, per[k] floats each
        float *bufs[4] = {vlmoe_model_param_data(t->m) + off};
        size_t per[4] = {b->per};
        const int nb = state ? optim_expert_states(o, off, whole ? b->E : b->El, b->per, bufs, per) : 1;
        for (int k = 0; k < nb && !e; k++) {
            float *bank = bufs[k], *own = bank + (whole ? (size_t)sh->q * El * per[k] : 0);
            const size_t n = El * per[k];
            if (every) {
                e = ex->allgather(ex, bank, own, n, VLMOE_DIST_F32); // in place
                continue;
            }
            for (int j = 0; j < sh->N; j++) { // each sends the first its slice, which places them
                sc[j] = sh->q && !j ? n : 0, sd[j] = 0;
                rc[j] = !sh->q && j ? n : 0, rd[j] = (size_t)j * n;
            }
            e = sh->q ? ex->alltoallv(ex, sh->buf, rc, rd, own, sc, sd, VLMOE_DIST_F32)
                      : ex->alltoallv(ex, bank, rc, rd, sh->buf, sc, sd, VLMOE_DIST_F32);
        }
    }
    return e;
}

// Makes the model whole on rank 0 (every 0: before it writes a checkpoint or evaluates; the
// others of its group send it their experts' parameters and optimizer state and keep their
// shards) or on every process (every 1: the end of a run; the parameters to every process, the
// state to rank 0 only, the one writer: elsewhere it becomes zero, dropped before the whole
// parameters come, so that no process but rank 0 ever holds more than its shard's state and the
// whole parameters). Collective over the world; nothing to do without sharding.
// (Out of memory in a relayout, the others wait in the exchanges until the run's watchdog stops
// them.)
int vlmoe_trainer_gather_experts(vlmoe_trainer *t, int every) {
    struct shard *sh = t->shard;
    if (!sh || sh->whole || (!every && !sh->root_group)) return VLMOE_OK;
    const int rank0 = sh->root_group && sh->q == 0;
    int e = VLMOE_OK;
    if (sh->root_group) { // the state to rank 0
        if (rank0 && (e = optim_to(t, NULL, 1))) return vlmoe_error_prefix("gathering the experts"), e;
        if ((e = exchange(t, 1, 0, rank0))) return vlmoe_error_prefix("gathering the experts' optimizer state"), e;
    }
    if (every && !rank0 && (e = optim_to(t, NULL, 0))) return vlmoe_error_prefix("gathering the experts"), e;
    const int grow = every || rank0;
    if (grow && (e = model_to(t, NULL))) return vlmoe_error_prefix("gathering the experts"), e;
    sh->whole = grow;
    if ((e = exchange(t, 0, every, grow))) return vlmoe_error_prefix("gathering the experts from their processes"), e;
    return VLMOE_OK;
}

// Sharded experts: rank 0, made whole by vlmoe_trainer_gather_experts(t, 0) to write or evaluate,
// goes back to its shard of the experts. Not collective.
int vlmoe_trainer_drop_experts(vlmoe_trainer *t) {
    struct shard *sh = t->shard;
    if (!sh || !sh->whole) return VLMOE_OK;
    int st = relayout(t, &sh->layout);
    if (st) return vlmoe_error_prefix("expert parallelism: back to this process's experts"), st;
    sh->whole = 0;
    return VLMOE_OK;
}

// Before a checkpoint of a run on several processes: every process must hold the same step and
// the same parameters (a checksum of their bits), or the file would not be the run's state. With
// sharded experts a process answers for the dense parameters, compared over the world, and its
// own experts, compared over its replicas; the other experts' slices are no process's copy.
static uint64_t fnv(uint64_t h, const float *x, size_t n) {
    const uint32_t *w = (const uint32_t *)x;
    for (size_t i = 0; i < n; i++) h = (h ^ w[i]) * 1099511628211ull;
    return h;
}

static int agree(vlmoe_dist *d, uint64_t h, int64_t step, const char *what, int rank) {
    const int64_t c = (int64_t)(h >> 2);
    int64_t v[4] = {c, -c, step, -step};
    int st = d->allreduce_max(d, v, 4, VLMOE_DIST_I64);
    if (st) return vlmoe_error_prefix("checkpoint"), st;
    if (v[0] != -v[1] || v[2] != -v[3])
        return vlmoe_fail(VLMOE_ERR_NUMERIC, "checkpoint at step %lld: the processes hold different %s (process %d: "
                          "step %lld, checksum %016llx); nothing was written", (long long)step,
                          v[2] != -v[3] ? "steps" : what, rank, (long long)step, (unsigned long long)c);
    return VLMOE_OK;
}

int vlmoe_trainer_check_replicas(vlmoe_trainer *t, vlmoe_dist *d) {
    const float *w = vlmoe_model_param_data(t->m);
    const int64_t step = vlmoe_trainer_get_step(t);
    const struct shard *sh = t->shard;
    uint64_t h = 1469598103934665603ull;
    if (sh && sh->whole)
        return vlmoe_fail(VLMOE_ERR_ARG, "checkpoint: the replicas are compared between gathers (this process holds "
                          "the whole model now)");
    if (!sh) return agree(d, fnv(h, w, vlmoe_model_num_floats(t->m)), step, "parameters", d->rank);
    for (int i = 0; i < sh->ndense; i++) h = fnv(h, w + sh->dense[i].off, sh->dense[i].n);
    int st = agree(d, h, step, "parameters", d->rank);
    if (st || !sh->replicas) return st;
    h = 1469598103934665603ull;
    for (int i = 0; i < sh->nbanks; i++) {
        const span o = own_span(&sh->banks[i]);
        h = fnv(h, w + o.off, o.n);
    }
    return agree(sh->replicas, h, step, "experts' parameters", d->rank);
}

// Data parallelism: a step starts with no bucket of the gradient final; the towers' backward
// reports each parameter it finishes (model_set_grad_ready), other backwards none.
static int begin_step(vlmoe_trainer *t) {
    if (!t->dist || t->shard) return VLMOE_OK; // sharded experts: reduce_sharded after the backward
    if (!t->bk) {
        int n, st;
        const vlmoe_param_info *tab = vlmoe_model_params(t->m, &n);
        if ((st = buckets_init(&t->bk, tab, n, vlmoe_model_num_floats(t->m), vlmoe_model_grad_data(t->m),
                               t->p.bucket_cap_mb)))
            return st;
    }
    buckets_begin(t->bk, t->dist);
    model_set_grad_ready(t->m, buckets_ready, t->bk);
    return VLMOE_OK;
}

// Data parallelism: the gradient becomes its mean over the processes, as in DDP: its buckets'
// sums, started during the backward (src/train/buckets.c), are finished (summed in rank order,
// so every process holds the same bits and takes the same update, whatever the buckets); then
// every process agrees whether the step diverged (one flag, its maximum). The finite check reads
// the summed gradient (a non-finite gradient on any process makes the sum non-finite on all), as
// the buffer is MPI's until the sums finish. The step's statistics become their means too.
static int reduce_step(vlmoe_trainer *t, int st, long step, vlmoe_step_stats *s) {
    vlmoe_dist *d = t->dist;
    int e = t->shard ? VLMOE_OK : buckets_finish(t->bk);
    model_set_grad_ready(t->m, NULL, NULL);
    if (e) return vlmoe_error_prefix("step %ld: gradient all-reduce", step), e;
    // (with sharded experts this is the local gradient: reduce_sharded sums it below)
    if (!st && (st = vlmoe_model_check_finite(t->m, 1))) vlmoe_error_prefix("step %ld", step);
    int32_t bad = st != VLMOE_OK;
    if ((e = d->allreduce_max(d, &bad, 1, VLMOE_DIST_I32))) return vlmoe_error_prefix("step %ld", step), e;
    if (st) return st;
    if (bad) return vlmoe_fail(VLMOE_ERR_NUMERIC, "step %ld: the loss or a gradient of another process is not finite", step);
    float *g = vlmoe_model_grad_data(t->m);
    const size_t n = vlmoe_model_num_floats(t->m);
    double v[5] = {s->loss, s->contrastive, s->aux, s->acc_i2t, s->acc_t2i};
    if ((t->shard && (e = reduce_sharded(t, g))) || (e = d->allreduce_sum(d, v, 5, VLMOE_DIST_F64)))
        return vlmoe_error_prefix("step %ld: gradient all-reduce", step), e;
    const vlmoe_backend_f32 *hb = model_host_backend(t->m); // the gradients' master copy
    hb->scale(hb, g, n, (float)(1.0 / d->world));
    s->loss = v[0] / d->world, s->contrastive = v[1] / d->world, s->aux = v[2] / d->world;
    s->acc_i2t = v[3] / d->world, s->acc_t2i = v[4] / d->world;
    return VLMOE_OK;
}

// VL-MoE freezes routers and experts when fine-tuning: with freeze_moe every tensor of an MoE
// layer ("<block>.moe.*": router, experts, Soft MoE's phi and scale) is kept out of the optimizer's
// table, so neither AdamW's decay nor moments left from earlier steps can move it, and its
// gradient is zeroed before clipping so the global norm is that of the trained tensors.
static int is_moe_param(const vlmoe_param_info *p) { return strstr(p->name, ".moe.") != NULL; }

// LiT locks a tower the same way (OpenCLIP's lock_image_tower / lock_text_tower): every tensor of
// the tower is frozen but those of its last `unlocked` groups. The group of a tensor of tower
// "<prefix>." with L blocks, counted from the end: the projection 1, the final LayerNorm and the
// last block 2, block l < L-1 L+1-l, the stem L+2 (OpenCLIP's VisionTransformer.lock groups).
static int tower_group(const char *name, int L) {
    int l;
    if (!strcmp(name, "proj")) return 1;
    if (!strncmp(name, "ln_final.", 9)) return 2;
    if (sscanf(name, "blocks.%d.", &l) == 1) return l >= L - 1 ? 2 : L + 1 - l;
    return L + 2;
}

static int is_locked(const vlmoe_train_params *p, const vlmoe_model_config *c, const vlmoe_param_info *q) {
    if (p->lock_image && !strncmp(q->name, "image.", 6))
        return tower_group(q->name + 6, c->encoder.layers) > p->lock_image_unlocked_groups;
    if (p->lock_text && !strncmp(q->name, "text.", 5))
        return tower_group(q->name + 5, c->text_encoder.layers) > p->lock_text_unlocked_layers;
    return 0;
}

static int check_locks(const vlmoe_train_params *p, const vlmoe_model_config *c) {
    if (p->lock_image_unlocked_groups < 0 || p->lock_text_unlocked_layers < 0)
        return vlmoe_fail(VLMOE_ERR_ARG, "lock: --lock-image-unlocked-groups %d / --lock-text-unlocked-layers %d must "
                          "be >= 0", p->lock_image_unlocked_groups, p->lock_text_unlocked_layers);
    if (p->lock_image_unlocked_groups && !p->lock_image)
        return vlmoe_fail(VLMOE_ERR_ARG, "lock: --lock-image-unlocked-groups %d needs --lock-image (it says how much of "
                          "the locked image tower stays trainable)", p->lock_image_unlocked_groups);
    if (p->lock_text_unlocked_layers && !p->lock_text)
        return vlmoe_fail(VLMOE_ERR_ARG, "lock: --lock-text-unlocked-layers %d needs --lock-text (it says how much of "
                          "the locked text tower stays trainable)", p->lock_text_unlocked_layers);
    const char *tower = p->lock_image ? "image" : "text";
    if ((p->lock_image || p->lock_text) && c->arch != VLMOE_ARCH_TWO_TOWER)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "model '%s': --lock-%s locks one of two towers, but this model is %s: one "
                          "encoder runs both images and texts, so there is no separate %s tower to lock (LiT needs a "
                          "two_tower model such as tiny-clip, ViT-B-32 or ViT-B-16)", c->name, tower,
                          c->arch == VLMOE_ARCH_ONE_TOWER ? "one_tower (LIMoE)" : "VL-MoE (arch mome)", tower);
    return VLMOE_OK;
}

vlmoe_train_params vlmoe_train_default_params(void) {
    vlmoe_train_params p;
    p.optim = vlmoe_optim_default_params(VLMOE_OPT_ADAMW);
    p.optim.beta2 = 0.98f; // OpenCLIP's ViT default
    p.optim.eps = 1e-6f;
    p.optim.weight_decay = 0.2f;
    p.schedule = (vlmoe_schedule){VLMOE_SCHED_COSINE, 5e-4, 100, 1000, 0.0, 0, 0};
    p.grad_clip_norm = 1.0;
    p.freeze_moe = 0;
    p.lock_image = p.lock_image_unlocked_groups = 0;
    p.lock_text = p.lock_text_unlocked_layers = 0;
    p.bucket_cap_mb = 25; // DDP's
    return p;
}

int vlmoe_trainer_init(vlmoe_trainer **out, vlmoe_model *m, const vlmoe_train_params *p) {
    *out = NULL;
    vlmoe_trainer *t = calloc(1, sizeof(*t));
    if (!t) return vlmoe_fail(VLMOE_ERR_NOMEM, "trainer");
    t->m = m;
    t->p = *p;
    int n;
    const vlmoe_param_info *tab = vlmoe_model_params(m, &n);
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    vlmoe_param_info *train = NULL;
    int st = check_locks(p, c);
    if (st) return vlmoe_trainer_free(t), st;
    if (p->freeze_moe || p->lock_image || p->lock_text) {
        train = malloc(sizeof(*train) * (size_t)n);
        t->frozen = malloc(sizeof(*train) * (size_t)n);
        if (!train || !t->frozen) return free(train), vlmoe_trainer_free(t), vlmoe_fail(VLMOE_ERR_NOMEM, "trainer");
        int nt = 0;
        for (int i = 0; i < n; i++) {
            if ((p->freeze_moe && is_moe_param(&tab[i])) || is_locked(p, c, &tab[i])) t->frozen[t->nfrozen++] = tab[i];
            else train[nt++] = tab[i];
        }
        tab = train;
        n = nt;
    }
    st = optim_init_backend(&t->opt, &p->optim, tab, n, vlmoe_model_num_floats(m), model_host_backend(m));
    free(train);
    // a tower locked whole needs no backward at all: its gradients would be zeroed anyway
    if (!st && (p->lock_image || p->lock_text))
        st = model_set_frozen_towers(m, p->lock_image && !p->lock_image_unlocked_groups,
                                     p->lock_text && !p->lock_text_unlocked_layers);
    if (st) return vlmoe_trainer_free(t), st;
    *out = t;
    return VLMOE_OK;
}

void vlmoe_trainer_free(vlmoe_trainer *t) {
    if (!t) return;
    if (t->p.lock_image || t->p.lock_text) model_set_frozen_towers(t->m, 0, 0); // the model trains whole again
    to_host(t); // the model outlives the trainer: its host copy is the master again
    shard_free(t);
    vlmoe_optim_free(t->opt);
    buckets_free(t->bk);
    free(t->frozen);
    free(t);
}

buckets_info trainer_buckets_info(const vlmoe_trainer *t) { return buckets_get_info(t->bk); }
long vlmoe_trainer_get_step(const vlmoe_trainer *t) { return vlmoe_optim_get_step(t->opt); }
vlmoe_optim *vlmoe_trainer_optim(vlmoe_trainer *t) { return t->opt; }
vlmoe_model *vlmoe_trainer_model(vlmoe_trainer *t) { return t->m; }
const vlmoe_train_params *vlmoe_trainer_params(const vlmoe_trainer *t) { return &t->p; }

// A device step's scalars (model_take_scalars): the gradient's sum of squares and non-finite flag
// as the device computed them before the step's one small download.
typedef struct { double sumsq; int nonfinite; } dev_scalars;

// apply's resident twin: the same guard, clipping and update on the device's buffers (the
// table's scale, zero and adamw ops), bit for bit the host's on a CPU-backed table.
static int apply_device(vlmoe_trainer *t, long step, vlmoe_step_stats *s, const dev_scalars *dev) {
    vlmoe_model *m = t->m;
    const vlmoe_backend_f32 *be = m->be;
    const size_t n = vlmoe_model_num_floats(m);
    // the host searches a flagged gradient for the tensor to name (the gradient comes down)
    int st = dev->nonfinite ? vlmoe_model_check_finite(m, 1) : VLMOE_OK;
    if (st) return vlmoe_error_prefix("step %ld", step), st;
    float *dp = (float *)model_params_for_graph(m), *dg = m->d_grads; // dp: uploaded if written since
    for (int i = 0; i < t->nfrozen; i++) be->zero(be, dg + t->frozen[i].offset, t->frozen[i].numel);
    s->grad_norm = t->nfrozen ? optim_clip_grad_norm(be, dg, n, t->p.grad_clip_norm) // frozen in the device's sum
                              : optim_clip_grad_norm_given(be, dg, n, t->p.grad_clip_norm, dev->sumsq);
    s->lr = vlmoe_schedule_lr(&t->p.schedule, step);
    optim_step_device(t->opt, dp, dg, (float)s->lr);
    model_params_changed(m);
    vlmoe_model_clamp(m);
    return VLMOE_OK;
}

// The rest of a step once the gradients are in the model's buffer: the divergence guard,
// clipping, the schedule, the update and the temperature clamp. dev (may be NULL): the device
// looked already (a flagged gradient is still searched on the host, for the message naming it).
static int apply(vlmoe_trainer *t, long step, vlmoe_step_stats *s, const dev_scalars *dev) {
    // one process on the host with nothing frozen: the finite check comes from clipping's sum of
    // squares (below), and the clip's factor goes into the update: two passes over the gradient
    // fewer. (Frozen gradients are zeroed before the sum, but a non-finite one still fails the
    // step: those steps check every tensor first.)
    const int plain = !t->dist && !t->shard && !dev && !t->nfrozen;
    int st = t->dist ? reduce_step(t, VLMOE_OK, step, s)
                     : plain || (dev && !dev->nonfinite) ? VLMOE_OK : vlmoe_model_check_finite(t->m, 1);
    if (st && !t->dist) vlmoe_error_prefix("step %ld", step);
    if (st) return st;
    float *g = vlmoe_model_grad_data(t->m);
    const size_t n = vlmoe_model_num_floats(t->m);
    for (int i = 0; i < t->nfrozen; i++) memset(g + t->frozen[i].offset, 0, sizeof(float) * t->frozen[i].numel);
    float gscale = 1.0f;
    if (plain) {
        const vlmoe_backend_f32 *hb = model_host_backend(t->m);
        int bad = 0;
        const double sumsq = hb->sumsq(hb, g, n, &bad);
        // squares of floats summed in double cannot overflow: a non-finite sum means a non-finite
        // gradient, which the search names as the check above would have
        if (bad && !(st = vlmoe_model_check_finite(t->m, 1)))
            st = vlmoe_fail(VLMOE_ERR_NUMERIC, "the gradient's sum of squares is %g", sumsq);
        if (st) return vlmoe_error_prefix("step %ld", step), st;
        s->grad_norm = sqrt(sumsq);
        gscale = optim_clip_factor(s->grad_norm, t->p.grad_clip_norm);
    } else if (t->shard) {
        if ((st = clip_sharded(t, g, &s->grad_norm))) return vlmoe_error_prefix("step %ld: gradient norm", step), st;
    } else if (dev && !t->nfrozen) { // frozen gradients were in the device's sum: zeroed since
        s->grad_norm = optim_clip_grad_norm_given(model_host_backend(t->m), g, n, t->p.grad_clip_norm, dev->sumsq);
    } else {
        s->grad_norm = optim_clip_grad_norm(model_host_backend(t->m), g, n, t->p.grad_clip_norm);
    }
    s->lr = vlmoe_schedule_lr(&t->p.schedule, step);
    float *w = vlmoe_model_param_data(t->m); // (a new weights version)
    optim_set_shadow(t->opt, t->shadows ? model_weights_version(t->m) : 0);
    optim_step_clipped(t->opt, w, g, (float)s->lr, gscale);
    optim_set_shadow(t->opt, 0);
    vlmoe_model_clamp(t->m);
    return VLMOE_OK;
}

// A step that failed before its update: with data parallelism the other processes still learn
// that it did (they wait in the divergence flag's all-reduce), so none is left hanging.
static int failed(vlmoe_trainer *t, int st, long step, vlmoe_step_stats *s) {
    return t->dist ? reduce_step(t, st, step, s) : st;
}

static int step_one(vlmoe_trainer *t, const vlmoe_batch *b, vlmoe_step_stats *stats) {
    vlmoe_step_stats s;
    memset(&s, 0, sizeof(s));
    const long step = vlmoe_optim_get_step(t->opt);
    int on = 0, bst = begin_step(t);
    if (!bst) bst = to_device(t, &on);
    if (bst) return vlmoe_error_prefix("step %ld", step), bst;
    // on a device (one process): the loss, accuracies, gradient norm and non-finite flag come
    // back in one download after the backward, not each as its op finishes
    if (!t->dist) model_defer_scalars(t->m);
    int st = vlmoe_model_forward(t->m, b, &s);
    if (st) {
        vlmoe_error_prefix("step %ld", step);
        return failed(t, st, step, &s);
    }
    if ((st = vlmoe_model_backward(t->m))) return failed(t, st, step, &s);
    dev_scalars dev;
    const int on_dev = model_take_scalars(t->m, &s, &dev.sumsq, &dev.nonfinite);
    if (on_dev && !isfinite(s.loss)) // the forward's check, later: no parameter has changed
        return vlmoe_fail(VLMOE_ERR_NUMERIC, "step %ld: the contrastive loss is %g", step, s.loss);
    if (on && !on_dev) return vlmoe_fail(VLMOE_ERR_ARG, "step %ld: a resident step without its device scalars", step);
    if ((st = on ? apply_device(t, step, &s, &dev) : apply(t, step, &s, on_dev ? &dev : NULL))) return st;
    if (stats) *stats = s;
    return VLMOE_OK;
}

static int step_accum(vlmoe_trainer *t, const vlmoe_batch *micro, int n, vlmoe_step_stats *stats) {
    vlmoe_step_stats s;
    memset(&s, 0, sizeof(s));
    const long step = vlmoe_optim_get_step(t->opt);
    to_host(t);
    int bst = begin_step(t);
    if (bst) return vlmoe_error_prefix("step %ld", step), bst;
    int st = model_accumulate(t->m, micro, n, &s);
    if (st) {
        vlmoe_error_prefix("step %ld", step);
        return failed(t, st, step, &s);
    }
    if ((st = apply(t, step, &s, NULL))) return st;
    if (stats) *stats = s;
    return VLMOE_OK;
}

// --precision bf16 on the CPU, when a step reads each weight more than once per layout (several
// micro-batches, or gradient checkpointing's second forward): its products keep packed bf16
// copies of the weights, and its update packs each tensor's again right after updating it
// (src/ops/gemm_bf16.h), so the forwards and backwards read them instead of packing every weight
// in every product. A plain step reads each once: there the copies would only move the packing
// into the update and cost memory (bench-s: the same CPU time per step, 63 MB more peak RSS).
// The model's weights version vouches for them: every write of the weights the model knows of,
// and every vlmoe_model_param_data, changes it, and copies of another version are packed again.
static void shadows_begin(vlmoe_trainer *t, int micro) {
    t->shadows = t->m->be == backend_cpu_bf16() && (micro > 1 || t->m->grad_ckpt);
    if (t->shadows) gemm_bf16_shadow_use(t->m->params, vlmoe_model_num_floats(t->m), model_weights_version(t->m));
}
static int shadows_end(vlmoe_trainer *t, int st) {
    if (t->shadows) gemm_bf16_shadow_use(NULL, 0, 0);
    t->shadows = 0;
    return st;
}

int vlmoe_trainer_step(vlmoe_trainer *t, const vlmoe_batch *b, vlmoe_step_stats *stats) {
    shadows_begin(t, 1);
    return shadows_end(t, step_one(t, b, stats));
}

int vlmoe_trainer_step_accum(vlmoe_trainer *t, const vlmoe_batch *micro, int n, vlmoe_step_stats *stats) {
    shadows_begin(t, n);
    return shadows_end(t, step_accum(t, micro, n, stats));
}

// The rest of a retrieval step after its forward (st: the forward's status, r its statistics):
// the backward, the update and the caller's statistics.
static int retrieval_finish(vlmoe_trainer *t, int st, long step, const vlmoe_mome_stats *r, vlmoe_mome_stats *ms,
                            vlmoe_step_stats *stats) {
    vlmoe_step_stats s;
    memset(&s, 0, sizeof(s));
    if (!st) st = vlmoe_mome_backward_retrieval(t->m, 0);
    if (st) {
        vlmoe_error_prefix("step %ld", step);
        return failed(t, st, step, &s);
    }
    s.loss = r->loss;
    s.aux = r->aux;
    if ((st = apply(t, step, &s, NULL))) return st;
    if (ms) *ms = *r;
    if (stats) *stats = s;
    return VLMOE_OK;
}

int vlmoe_trainer_step_mome_retrieval(vlmoe_trainer *t, const float *images, const int32_t *tokens,
                                      const int32_t *lengths, int B, vlmoe_mome_stats *ms, vlmoe_step_stats *stats) {
    const long step = vlmoe_optim_get_step(t->opt);
    to_host(t);
    int bst = begin_step(t);
    if (bst) return vlmoe_error_prefix("step %ld", step), bst;
    vlmoe_mome_stats r;
    const int st = vlmoe_mome_forward_retrieval(t->m, images, tokens, lengths, B, 1, &r);
    return retrieval_finish(t, st, step, &r, ms, stats);
}

int vlmoe_trainer_step_mome_itm(vlmoe_trainer *t, const vlmoe_mome_batch *b, uint64_t seed, vlmoe_mome_stats *ms,
                                vlmoe_step_stats *stats) {
    const long step = vlmoe_optim_get_step(t->opt);
    to_host(t);
    int bst = begin_step(t);
    if (bst) return vlmoe_error_prefix("step %ld", step), bst;
    vlmoe_mome_stats r;
    const int st = vlmoe_mome_forward_retrieval_itm(t->m, b, vlmoe_itm_key(seed, step), 1, &r);
    return retrieval_finish(t, st, step, &r, ms, stats);
}

// Data parallelism: each part's statistics over every process's share of it (the one-process
// part): the losses, whose per-process values are shares scaled by W (src/nn/mome_model.c), and
// the auxiliary losses average; the accuracies weigh by the labelled positions, which add up.
static int reduce_parts(vlmoe_dist *d, vlmoe_mome_stats *ps, int n, long step) {
    enum { K = 8 };
    double *v = malloc(sizeof(double) * K * (size_t)n);
    if (!v) return vlmoe_fail(VLMOE_ERR_NOMEM, "step %ld: statistics of %d forwards", step, n);
    for (int i = 0; i < n; i++) {
        const vlmoe_mome_stats *p = &ps[i];
        const double x[K] = {p->loss, p->text, p->image, p->aux, p->text_acc * p->text_count,
                             p->image_acc * p->image_count, p->text_count, p->image_count};
        memcpy(v + (size_t)K * i, x, sizeof(x));
    }
    int st = d->allreduce_sum(d, v, (size_t)K * n, VLMOE_DIST_F64);
    for (int i = 0; i < n && !st; i++) {
        const double *x = v + (size_t)K * i;
        vlmoe_mome_stats *p = &ps[i];
        p->loss = x[0] / d->world, p->text = x[1] / d->world, p->image = x[2] / d->world, p->aux = x[3] / d->world;
        p->text_acc = x[6] > 0 ? x[4] / x[6] : 0, p->image_acc = x[7] > 0 ? x[5] / x[7] : 0;
        p->text_count = (int)x[6], p->image_count = (int)x[7];
    }
    free(v);
    return st ? (vlmoe_error_prefix("step %ld: statistics all-reduce", step), st) : VLMOE_OK;
}

int vlmoe_trainer_step_mome(vlmoe_trainer *t, const vlmoe_mome_batch *parts, int nparts,
                            vlmoe_mome_stats *part_stats, vlmoe_step_stats *stats) {
    vlmoe_step_stats s;
    memset(&s, 0, sizeof(s));
    const long step = vlmoe_optim_get_step(t->opt);
    to_host(t);
    int bst = begin_step(t);
    if (bst) return vlmoe_error_prefix("step %ld", step), bst;
    if (nparts < 1) return failed(t, vlmoe_fail(VLMOE_ERR_ARG, "step %ld: no batches", step), step, &s);
    // Data parallelism: every forward all-reduces its label counts (src/nn/mome_model.c), so a
    // process whose forward failed (a non-finite loss, bad labels) still runs the others' forwards
    // to keep the collectives in step, and the first failure stops every process after the last.
    int bad = VLMOE_OK;
    char why[512] = "";
    for (int i = 0; i < nparts; i++) {
        vlmoe_mome_stats ps;
        int st = vlmoe_mome_forward(t->m, &parts[i], 1, &ps);
        if (!st && !bad) st = vlmoe_mome_backward(t->m, i > 0); // the objectives' gradients add up
        if (st && !bad) {
            vlmoe_error_prefix("step %ld, batch %d", step, i);
            if (!t->dist) return st;
            bad = st;
            snprintf(why, sizeof(why), "%s", vlmoe_last_error());
        }
        if (bad) continue;
        if (part_stats) part_stats[i] = ps;
        s.loss += ps.loss;
        s.aux += ps.aux;
    }
    if (bad) return failed(t, vlmoe_fail(bad, "%s", why), step, &s);
    int st = apply(t, step, &s, NULL);
    if (!st && t->dist && part_stats) st = reduce_parts(t->dist, part_stats, nparts, step);
    if (st) return st;
    if (stats) *stats = s;
    return VLMOE_OK;
}
