// run.c: the one training loop (src/train/run.h): from the trainer's step to the last, the task
// fills a batch and takes a step; on the cadences the loop writes a train record (docs/METRICS.md)
// and a progress line, a checkpoint with the task's data position, and the task's evaluation.
// Only rank 0 of the process group writes files. Covered by tests/test_cli.c,
// tests/test_checkpoint.c and tests/test_vlmoe_train.c; its failure test hooks by
// tests/test_dist_mpi.sh.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/core.h"
#include "train/run.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// Test hooks of tests/test_dist_mpi.sh, for the failure behaviour of a run on several processes:
// VLMOE_TEST_HANG_RANK=R[@S] makes process R stop answering (sleep an hour) in step S, counted as
// the progress line counts (default: the run's first step), as a rank that hangs;
// VLMOE_TEST_FAIL_RANK=R[@S] makes it fail there as on unreadable input. Read once per run; the
// step at which process `rank` acts, or -1.
static long test_hook(const char *var, int rank, long first) {
    const char *v = getenv(var);
    if (!v) return -1;
    char *end = NULL;
    const long r = strtol(v, &end, 10);
    const long at = *end == '@' ? strtol(end + 1, NULL, 10) : first;
    return r == rank ? at : -1;
}

static void progress(const vlmoe_run_params *p, int what, const char *line) {
    if (p->progress) p->progress(p->progress_user, what, line);
}

static int save(vlmoe_trainer *t, const vlmoe_run_task *task, const vlmoe_run_params *p, const char *ckdir, long done) {
    char w[1100], s[1100], line[1200];
    vlmoe_ckpt_paths(ckdir, done, w, s, sizeof(w));
    vlmoe_data_state ds;
    memset(&ds, 0, sizeof(ds));
    if (task->data_state) task->data_state(task->user, done, &ds);
    int st = vlmoe_trainer_save(t, w, s, &ds);
    if (st) {
        vlmoe_error_prefix("checkpoint");
        return st;
    }
    if (p->keep > 0) vlmoe_ckpt_prune(ckdir, p->keep);
    snprintf(line, sizeof(line), "checkpoint %s", w);
    progress(p, VLMOE_RUN_CHECKPOINT, line);
    return VLMOE_OK;
}

static int evaluate(const vlmoe_run_task *task, const vlmoe_run_params *p, vlmoe_metrics *mx, long done) {
    char line[2048] = "";
    cJSON *rec = vlmoe_metrics_record(done, "eval");
    if (!rec) return vlmoe_fail(VLMOE_ERR_NOMEM, "metrics record");
    int st = task->eval(task->user, done, rec, line, sizeof(line));
    if (st) {
        cJSON_Delete(rec);
        vlmoe_error_prefix("evaluation at step %ld", done);
        return st;
    }
    // the task's parts have cadences of their own: a call with none due adds nothing
    if (cJSON_GetArraySize(rec) <= 2) return cJSON_Delete(rec), VLMOE_OK;
    st = mx ? vlmoe_metrics_write(mx, rec) : (cJSON_Delete(rec), VLMOE_OK);
    if (!st && line[0]) progress(p, VLMOE_RUN_EVAL, line);
    return st;
}

static void fmt_eta(char *buf, size_t n, double s) {
    long t = (long)(s + 0.5);
    snprintf(buf, n, "%ld:%02ld:%02ld", t / 3600, (t / 60) % 60, t % 60);
}

// The train record of step `done` and its progress line.
static int log_step(const vlmoe_run_task *task, const vlmoe_run_params *p, vlmoe_metrics *mx, long done,
                    const vlmoe_step_stats *s, double loss_avg, double per) {
    char line[4096], eta[32];
    size_t at = (size_t)snprintf(line, sizeof(line), "step %ld/%ld  loss %.4f (avg %.4f)", done, p->steps, s->loss, loss_avg);
    cJSON *rec = vlmoe_metrics_record(done, "train");
    if (!rec) return vlmoe_fail(VLMOE_ERR_NOMEM, "metrics record");
    cJSON_AddItemToObject(rec, "loss", vlmoe_metrics_exact(s->loss));
    cJSON_AddItemToObject(rec, "aux_loss", vlmoe_metrics_exact(s->aux));
    cJSON_AddNumberToObject(rec, "lr", s->lr);
    cJSON_AddNumberToObject(rec, "grad_norm", s->grad_norm);
    int st = task->log ? task->log(task->user, done, s, rec, line + at, sizeof(line) - at) : VLMOE_OK;
    if (st) {
        cJSON_Delete(rec);
        return st;
    }
    // wall-clock fields last, in their own object: the only part of a record that differs
    // between a resumed and an uninterrupted run
    cJSON *tm = cJSON_AddObjectToObject(rec, "time");
    cJSON_AddNumberToObject(tm, "s_per_step", per);
    cJSON_AddNumberToObject(tm, "samples_per_s", (double)p->samples_per_step / per);
    st = mx ? vlmoe_metrics_write(mx, rec) : (cJSON_Delete(rec), VLMOE_OK);
    at = strlen(line);
    fmt_eta(eta, sizeof(eta), per * (double)(p->steps - done));
    snprintf(line + at, sizeof(line) - at, "  lr %.2e  %.0f samples/s  ETA %s", s->lr,
             (double)p->samples_per_step / per, eta);
    if (!st) progress(p, VLMOE_RUN_STEP, line);
    return st;
}

int vlmoe_run_train(vlmoe_trainer *t, const vlmoe_run_task *task, const vlmoe_run_params *p) {
    if (!task || !task->step || !p || p->steps < 1 || p->log_every < 1 || p->save_every < 0 ||
        p->eval_every < 0 || p->keep < 0 || p->samples_per_step < 1)
        return vlmoe_fail(VLMOE_ERR_ARG, "run: missing step function, or a non-positive step count, cadence "
                          "or batch");
    vlmoe_dist *dist = p->dist ? p->dist : vlmoe_dist_single();
    // VL-MoE runs data-parallel (src/train/mome_task.c); its MoE layers are not split over processes
    if (p->expert_parallel > 1 && vlmoe_model_get_config(vlmoe_trainer_model(t))->arch == VLMOE_ARCH_MOME)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "run: --expert-parallel %d: VL-MoE (arch mome) models train data-parallel "
                          "only (every process holds every expert); run without --expert-parallel",
                          p->expert_parallel);
    const int lead = dist->rank == 0;             // prints, evaluates and writes
    const int writer = lead && p->dir;            // no folder: a run that keeps nothing but the model
    vlmoe_run_params q = *p;
    if (!lead) q.progress = NULL;
    p = &q;
    // expert parallelism over groups of N consecutive processes: the whole world, or a split
    vlmoe_dist *experts = NULL;
    const int N = p->expert_parallel;
    if (N > 1) {
        if (dist->world % N)
            return vlmoe_fail(VLMOE_ERR_ARG, "--expert-parallel %d does not divide the %d process%s into groups%s", N,
                              dist->world, dist->world == 1 ? "" : "es",
                              dist->world == 1 ? " (start several with mpirun -np N)" : "");
        int e = N == dist->world ? (experts = dist, VLMOE_OK)
                                 : vlmoe_dist_split(dist, dist->rank / N, dist->rank, &experts);
        if (e) return vlmoe_error_prefix("--expert-parallel %d", N), e;
    }
    if (dist->world > 1) { // every process starts from rank 0's parameters and step (whole models yet)
        vlmoe_model *m = vlmoe_trainer_model(t);
        int64_t at = vlmoe_trainer_get_step(t);
        int e = dist->broadcast(dist, vlmoe_model_param_data(m), vlmoe_model_num_floats(m), VLMOE_DIST_F32, 0);
        if (!e) e = dist->allreduce_max(dist, &at, 1, VLMOE_DIST_I64);
        if (!e && at != vlmoe_trainer_get_step(t))
            e = vlmoe_fail(VLMOE_ERR_ARG, "run: process %d resumes at step %ld, another at step %lld: every process "
                           "must load the same checkpoint", dist->rank, vlmoe_trainer_get_step(t), (long long)at);
        if (e) {
            if (experts && experts != dist) vlmoe_dist_close(experts);
            return vlmoe_error_prefix("run on %d processes", dist->world), e;
        }
    }
    // (with experts, each process keeps its shard of them from here: src/train/trainer.c)
    int st = vlmoe_trainer_set_dist(t, dist, experts);
    if (st) {
        if (experts && experts != dist) vlmoe_dist_close(experts);
        return vlmoe_error_prefix("run on %d processes", dist->world), st;
    }
    char ckdir[1100], path[1100];
    snprintf(ckdir, sizeof(ckdir), "%s/checkpoints", p->dir ? p->dir : ".");
    snprintf(path, sizeof(path), "%s/metrics.jsonl", p->dir ? p->dir : ".");
    const long start = vlmoe_trainer_get_step(t);
    vlmoe_metrics *mx = NULL;
    st = writer ? vlmoe_metrics_open(&mx, path, start) : VLMOE_OK;
    double t_last = now(), sum_loss = 0;
    long last = start;
    const long hang_at = test_hook("VLMOE_TEST_HANG_RANK", dist->rank, start + 1);
    const long fail_at = test_hook("VLMOE_TEST_FAIL_RANK", dist->rank, start + 1);
    for (long step = start; step < p->steps && !st; step++) {
        if (step + 1 == hang_at) {
            const struct timespec hour = {3600, 0};
            nanosleep(&hour, NULL);
        }
        if (step + 1 == fail_at) {
            st = vlmoe_fail(VLMOE_ERR_FORMAT, "step %ld: VLMOE_TEST_FAIL_RANK=%d (a test hook): this process fails "
                            "here as on unreadable input", step + 1, dist->rank);
            break;
        }
        if (task->fill && (st = task->fill(task->user, step))) break;
        vlmoe_step_stats s;
        if ((st = task->step(task->user, t, step, &s))) break;
        sum_loss += s.loss;
        const long done = step + 1;
        if (done % p->log_every == 0 || done == p->steps) {
            const double tn = now(), per = (tn - t_last) / (double)(done - last);
            st = log_step(task, p, mx, done, &s, sum_loss / (double)(done - last), per);
            t_last = tn, last = done, sum_loss = 0;
        }
        const int saving = p->dir && ((p->save_every > 0 && done % p->save_every == 0) || done == p->steps);
        // sharded experts: rank 0 becomes whole to write and evaluate, then goes back to its shard
        const int eval_due = task->eval && p->eval_every > 0 && done % p->eval_every == 0 && done != p->steps;
        if (!st && saving && dist->world > 1) st = vlmoe_trainer_check_replicas(t, dist);
        if (!st && (saving || eval_due)) st = vlmoe_trainer_gather_experts(t, 0);
        if (!st && saving && writer) st = save(t, task, p, ckdir, done);
        if (!st && lead && eval_due) st = evaluate(task, p, mx, done);
        if (!st && (saving || eval_due)) st = vlmoe_trainer_drop_experts(t);
    }
    // every process leaves the run with the whole model (a caller may read or save any's)
    if (!st) st = vlmoe_trainer_gather_experts(t, 1);
    if (!st && lead && task->eval && p->eval_at_end && start < p->steps) st = evaluate(task, p, mx, p->steps);
    vlmoe_trainer_set_dist(t, NULL, NULL);
    if (experts && experts != dist) vlmoe_dist_close(experts);
    vlmoe_metrics_close(mx);
    return st;
}
