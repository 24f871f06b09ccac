// metrics_log.c: the metrics sink and reader of a training run: metrics.jsonl, one JSON object per
// line in the schema of docs/METRICS.md ("step" first, then "kind"), written by the loop of
// src/train/run.c and read by `vlmoe prune --stats` (cli/prune.c). Covered by tests/test_cli.c,
// tests/test_checkpoint.c and tests/test_vlmoe_train.c.
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"
#include "train/run.h"

struct vlmoe_metrics {
    FILE *f;
    off_t good;     // the file's size after the last whole record
    char path[1024];
};

// The "step" of a line that starts a record, or -1.
static long line_step(const char *line) {
    long s;
    return sscanf(line, "{\"step\":%ld", &s) == 1 ? s : -1;
}

// Appends the lines in[0..n) to the dropped-records file beside path (metrics.jsonl ->
// metrics.dropped.jsonl): records of steps a resumed run trains again are moved there, not lost.
static int keep_dropped(const char *path, const char *text, size_t n) {
    char out[1100];
    const size_t k = strlen(path);
    if (k > 6 && !strcmp(path + k - 6, ".jsonl")) snprintf(out, sizeof(out), "%.*s.dropped.jsonl", (int)(k - 6), path);
    else snprintf(out, sizeof(out), "%s.dropped", path);
    FILE *f = fopen(out, "a");
    const int ok = f && fwrite(text, 1, n, f) == n && fflush(f) == 0;
    const int e = errno;
    if (f && fclose(f) && ok) return vlmoe_fail(VLMOE_ERR_IO, "cannot write %s: %s", out, strerror(errno));
    return ok ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_IO, "cannot write %s: %s", out, strerror(e));
}

int vlmoe_metrics_open(vlmoe_metrics **out, const char *path, long start) {
    *out = NULL;
    vlmoe_metrics *m = calloc(1, sizeof(*m));
    if (!m) return vlmoe_fail(VLMOE_ERR_NOMEM, "metrics sink");
    snprintf(m->path, sizeof(m->path), "%s", path);
    FILE *in = fopen(path, "r");
    if (in) { // keep the records of the steps up to start, through a renamed copy; the others
              // (a run that stopped after its last checkpoint, or an earlier run of a reused
              // folder) move to the dropped-records file, so every step appears once
        char tmp[1100];
        snprintf(tmp, sizeof(tmp), "%s.tmp", path);
        FILE *o = fopen(tmp, "w");
        char *line = NULL, *drop = NULL;
        size_t cap = 0, ndrop = 0, dcap = 0;
        int ok = o != NULL;
        ssize_t len;
        while (ok && (len = getline(&line, &cap, in)) > 0) {
            const long s = line_step(line);
            if (s >= 0 && s <= start && line[len - 1] == '\n') {
                ok = fputs(line, o) >= 0;
                continue;
            }
            if (ndrop + (size_t)len + 1 > dcap) { // a line cut short by a killed writer is kept too, ended
                char *d = realloc(drop, dcap = 2 * (ndrop + (size_t)len + 1));
                if (!(ok = d != NULL)) break;
                drop = d;
            }
            memcpy(drop + ndrop, line, (size_t)len), ndrop += (size_t)len;
            if (line[len - 1] != '\n') drop[ndrop++] = '\n';
        }
        const int e = errno;
        free(line);
        fclose(in);
        if (o && (fflush(o) || fsync(fileno(o)))) ok = 0;
        if (o && fclose(o)) ok = 0;
        int st = ok ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_IO, "cannot rewrite %s: %s", path, strerror(errno ? errno : e));
        if (!st && ndrop) st = keep_dropped(path, drop, ndrop); // before the rename: a failure loses nothing
        if (!st && rename(tmp, path)) st = vlmoe_fail(VLMOE_ERR_IO, "cannot rewrite %s: %s", path, strerror(errno));
        free(drop);
        if (st) {
            remove(tmp);
            free(m);
            return st;
        }
    }
    if (!(m->f = fopen(path, "a"))) {
        const int e = errno;
        free(m);
        return vlmoe_fail(VLMOE_ERR_IO, "cannot write %s: %s", path, strerror(e));
    }
    fseeko(m->f, 0, SEEK_END);
    m->good = ftello(m->f);
    *out = m;
    return VLMOE_OK;
}

void vlmoe_metrics_close(vlmoe_metrics *m) {
    if (!m) return;
    if (m->f) fclose(m->f);
    free(m);
}

cJSON *vlmoe_metrics_record(long step, const char *kind) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON_AddNumberToObject(o, "step", (double)step);
    cJSON_AddStringToObject(o, "kind", kind);
    return o;
}

int vlmoe_metrics_write(vlmoe_metrics *m, cJSON *rec) {
    char *line = rec ? cJSON_PrintUnformatted(rec) : NULL;
    cJSON_Delete(rec);
    if (!line) return vlmoe_fail(VLMOE_ERR_NOMEM, "cannot write %s: out of memory", m->path);
    if (!m->f) return free(line), vlmoe_fail(VLMOE_ERR_IO, "cannot write %s: an earlier write failed", m->path);
    const int ok = fprintf(m->f, "%s\n", line) >= 0 && fflush(m->f) == 0;
    const int e = errno;
    free(line);
    if (ok) {
        m->good = ftello(m->f);
        return VLMOE_OK;
    }
    // a full disk may have taken part of the line: cut it off, so that the file holds whole records
    // only (the run stops here; every earlier record is kept). fclose may write the buffered bytes
    // once more; the truncation comes after it.
    fclose(m->f);
    m->f = NULL;
    const int cut = truncate(m->path, m->good) == 0;
    return vlmoe_fail(VLMOE_ERR_IO, "cannot write %s: %s%s", m->path, strerror(e),
                      cut ? "" : " (and a partial last line could not be cut off)");
}

cJSON *vlmoe_metrics_exact(double v) {
    char b[40];
    for (int digits = 15; digits <= 17; digits++) {
        snprintf(b, sizeof(b), "%.*g", digits, v);
        if (strtod(b, NULL) == v) break;
    }
    return isfinite(v) ? cJSON_CreateRaw(b) : cJSON_CreateNull();
}

cJSON *vlmoe_metrics_moe(const vlmoe_moe_stats *ms, int n, const char *stream, double succ[2]) {
    static const char *mod[2] = {"image", "text"};
    cJSON *arr = cJSON_CreateArray();
    for (int i = 0; arr && i < n; i++) {
        const vlmoe_moe_stats *x = &ms[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "encoder", x->encoder);
        cJSON_AddNumberToObject(o, "block", x->block);
        if (stream) cJSON_AddStringToObject(o, "stream", stream);
        for (int k = 0; k < 2; k++) {
            if (!x->tokens[k]) continue;
            cJSON *t = cJSON_CreateObject();
            cJSON_AddNumberToObject(t, "tokens", x->tokens[k]);
            cJSON_AddNumberToObject(t, "success", x->success[k]);
            cJSON_AddNumberToObject(t, "dropped", x->dropped[k]);
            cJSON_AddNumberToObject(t, "mean_max_gate", x->mean_max_gate[k]);
            cJSON_AddNumberToObject(t, "entropy_pre", x->entropy_pre[k]);
            cJSON_AddNumberToObject(t, "entropy_token", x->entropy_token[k]);
            cJSON_AddNumberToObject(t, "entropy_post", x->entropy_post[k]);
            cJSON_AddNumberToObject(t, "experts_used", x->experts_used[k]);
            if (x->routed[k]) {
                cJSON_AddItemToObject(t, "experts_cover", cJSON_CreateDoubleArray(x->experts_cover[k], 3));
                cJSON_AddItemToObject(t, "routed", cJSON_CreateDoubleArray(x->routed[k], x->num_experts));
                cJSON_AddItemToObject(t, "accepted", cJSON_CreateDoubleArray(x->accepted[k], x->num_experts));
            }
            cJSON_AddItemToObject(o, mod[k], t);
            if (succ && x->success[k] < succ[k]) succ[k] = x->success[k];
        }
        if (x->capacity > 0) cJSON_AddNumberToObject(o, "capacity", x->capacity);
        if (!x->routed[0] && !x->routed[1] && (x->tokens[0] || x->tokens[1])) { // Soft MoE: no assignments
            cJSON *sm = cJSON_CreateObject();
            cJSON_AddNumberToObject(sm, "mean_max_dispatch", x->soft_mean_max[0]);
            cJSON_AddNumberToObject(sm, "mean_max_combine", x->soft_mean_max[1]);
            cJSON_AddItemToObject(sm, "minmax", cJSON_CreateDoubleArray(x->soft_minmax, 4));
            cJSON_AddItemToObject(o, "soft", sm);
        }
        cJSON *aux = cJSON_CreateObject();
        for (int k = 0; k < VLMOE_AUX_COUNT; k++)
            if (x->aux[k] != 0) cJSON_AddNumberToObject(aux, vlmoe_aux_name((vlmoe_aux_kind)k), x->aux[k]);
        cJSON_AddItemToObject(o, "aux", aux);
        cJSON_AddItemToArray(arr, o);
    }
    return arr;
}

int vlmoe_metrics_read(const char *path, int (*each)(void *user, const cJSON *rec, long line), void *user) {
    FILE *f = fopen(path, "r");
    if (!f) return vlmoe_fail(VLMOE_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    long lineno = 0;
    int st = VLMOE_OK;
    ssize_t len;
    while (!st && (len = getline(&line, &cap, f)) >= 0) {
        lineno++;
        if (len <= 1 && (len == 0 || line[0] == '\n')) continue; // a blank line
        cJSON *o = cJSON_Parse(line);
        const cJSON *s = o ? cJSON_GetObjectItemCaseSensitive(o, "step") : NULL;
        if (!cJSON_IsObject(o) || !cJSON_IsNumber(s))
            st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s:%ld: not a metrics record (a JSON object with a \"step\")", path, lineno);
        else
            st = each(user, o, lineno);
        cJSON_Delete(o);
    }
    free(line);
    fclose(f);
    return st;
}

// ---- expert shares for pruning: the mean "accepted" shares of the last records
typedef struct {
    int enc, nl, E, last, seen;
    const char *mod, *path;
    double *ring;            // (last, nl, E): the shares of the last `last` train records
} shares_reader;

static int shares_each(void *u, const cJSON *rec, long line) {
    shares_reader *r = u;
    const cJSON *moe = cJSON_GetObjectItemCaseSensitive(rec, "moe");
    if (!cJSON_IsArray(moe)) return VLMOE_OK; // evaluation records and the like
    double *slot = r->ring + (size_t)(r->seen % r->last) * r->nl * r->E;
    int l = 0;
    for (const cJSON *it = moe->child; it; it = it->next) {
        const cJSON *e = cJSON_GetObjectItemCaseSensitive(it, "encoder");
        const cJSON *acc = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(it, r->mod), "accepted");
        if (!cJSON_IsNumber(e) || (int)e->valuedouble != r->enc || !acc) continue;
        if (l >= r->nl || cJSON_GetArraySize(acc) != r->E)
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s:%ld: routing statistics do not match this model (%d MoE layers of %d "
                              "experts)", r->path, line, r->nl, r->E);
        int k = 0;
        for (const cJSON *x = acc->child; x; x = x->next) slot[(size_t)l * r->E + k++] = x->valuedouble;
        l++;
    }
    if (l != r->nl)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s:%ld: %d MoE layers logged for the %s tokens of encoder %d, the model has "
                          "%d", r->path, line, l, r->mod, r->enc, r->nl);
    r->seen++;
    return VLMOE_OK;
}

int vlmoe_metrics_expert_shares(const char *path, int encoder, int modality, int last, int nl, int E, double *u,
                                int *seen) {
    if (last < 1 || nl < 1 || E < 1) return vlmoe_fail(VLMOE_ERR_ARG, "expert shares: last %d, %d layers of %d experts", last, nl, E);
    shares_reader r = {encoder, nl, E, last, 0, modality == VLMOE_MOD_TEXT ? "text" : "image", path, NULL};
    if (!(r.ring = calloc((size_t)last * nl * E, sizeof(double)))) return vlmoe_fail(VLMOE_ERR_NOMEM, "expert shares");
    int st = vlmoe_metrics_read(path, shares_each, &r);
    if (!st && !r.seen) st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: no routing statistics of the %s tokens (no \"moe\" entries)", path, r.mod);
    const int n = r.seen < last ? r.seen : last;
    for (size_t i = 0; !st && i < (size_t)nl * E; i++) {
        u[i] = 0;
        for (int k = 0; k < n; k++) u[i] += r.ring[(size_t)k * nl * E + i] / n;
    }
    free(r.ring);
    if (seen) *seen = r.seen;
    return st;
}
