// series.c: metrics.jsonl (docs/METRICS.md) read into named series by key pattern, for the report
// page and the TensorBoard converter: any number a record holds becomes a series, so statistics
// added to the schema later show up without changes here. Covered by tests/test_report.c.
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "report/report.h"

const report_series *report_metrics_find(const report_metrics *m, const char *name) {
    for (int i = 0; i < m->ns; i++)
        if (!strcmp(m->s[i].name, name)) return &m->s[i];
    return NULL;
}

// *out: the series of that name, NULL when it exists with another array length.
static int series_get(report_metrics *m, const char *name, int dim, report_series **out) {
    *out = NULL;
    // records repeat their keys in the same order: the series after the last one is likely next
    const int h = m->hint < m->ns ? m->hint : 0;
    if (h < m->ns && !strcmp(m->s[h].name, name) && m->s[h].dim == dim) {
        m->hint = h + 1, *out = &m->s[h];
        return VLMOE_OK;
    }
    for (int i = m->ns - 1; i >= 0; i--) // the newest first: records repeat their keys in order
        if (!strcmp(m->s[i].name, name)) {
            if (m->s[i].dim == dim) *out = &m->s[i];
            m->hint = i + 1;
            return VLMOE_OK;
        }
    if (m->ns == m->cap) {
        const int cap = m->cap ? 2 * m->cap : 64;
        report_series *s = realloc(m->s, sizeof(*s) * (size_t)cap);
        if (!s) return VLMOE_ERR_NOMEM;
        m->s = s, m->cap = cap;
    }
    report_series *s = &m->s[m->ns];
    memset(s, 0, sizeof(*s));
    if (!(s->name = strdup(name))) return VLMOE_ERR_NOMEM;
    s->dim = dim;
    m->ns++;
    m->hint = m->ns;
    *out = s;
    return VLMOE_OK;
}

// Appends one point (dim values); a series whose array length changed keeps its first length and
// the point is skipped (a pruned model's fewer experts would start another run of the file).
static int series_add(report_metrics *m, const char *name, long step, const double *v, int dim) {
    report_series *s;
    if (series_get(m, name, dim, &s)) return VLMOE_ERR_NOMEM;
    if (!s) return VLMOE_OK;
    if (s->n == s->cap) {
        const long cap = s->cap ? 2 * s->cap : 64;
        long *st = realloc(s->step, sizeof(long) * (size_t)cap);
        if (!st) return VLMOE_ERR_NOMEM;
        s->step = st;
        double *nv = realloc(s->v, sizeof(double) * (size_t)cap * (size_t)(dim ? dim : 1));
        if (!nv) return VLMOE_ERR_NOMEM;
        s->v = nv, s->cap = cap;
    }
    s->step[s->n] = step;
    memcpy(s->v + (size_t)s->n * (dim ? dim : 1), v, sizeof(double) * (size_t)(dim ? dim : 1));
    s->n++;
    return VLMOE_OK;
}

// One leaf: a number, or an array of numbers (a vector series); other arrays are skipped.
typedef struct {
    report_metrics *m;      // NULL: leaves go to fn
    report_leaf_fn fn;
    void *user;
    long step;
    int st;
} walk;

static void leaf(walk *w, const char *name, const cJSON *x) {
    if (w->st) return;
    if (cJSON_IsNumber(x)) {
        const double v = x->valuedouble;
        if (w->m) w->st = series_add(w->m, name, w->step, &v, 0);
        else {
            char tag[256];
            snprintf(tag, sizeof tag, "%s", name);
            for (char *p = tag; *p; p++)
                if (*p == ':') *p = '/';
            const size_t L = strlen(tag);
            if (L && tag[L - 1] == '/') tag[L - 1] = 0; // a layer-level moe key has no modality
            w->fn(w->user, tag, v);
        }
        return;
    }
    if (!cJSON_IsArray(x)) return;
    const int dim = cJSON_GetArraySize(x);
    if (dim < 1 || dim > 4096) return;
    double *v = malloc(sizeof(double) * (size_t)dim);
    if (!v) { w->st = VLMOE_ERR_NOMEM; return; }
    int i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, x) {
        if (!cJSON_IsNumber(e)) break;
        v[i++] = e->valuedouble;
    }
    if (i == dim) {
        if (w->m) w->st = series_add(w->m, name, w->step, v, dim);
        else
            for (int k = 0; k < dim; k++) {
                char n2[300];
                snprintf(n2, sizeof n2, "%s/expert_%d", name, k);
                walk w2 = *w;
                const cJSON num = {.type = cJSON_Number, .valuedouble = v[k]};
                leaf(&w2, n2, &num);
            }
    }
    free(v);
}

// prefix "train:" / "eval:"; nested objects joined by '.'
static void walk_obj(walk *w, const char *prefix, const cJSON *o) {
    const cJSON *x;
    cJSON_ArrayForEach(x, o) {
        if (!x->string || !strcmp(x->string, "moe") || !strcmp(x->string, "step")) continue;
        char name[256];
        snprintf(name, sizeof name, "%s%s", prefix, x->string);
        if (cJSON_IsObject(x)) {
            char p2[260];
            snprintf(p2, sizeof p2, "%s.", name);
            walk_obj(w, p2, x);
        } else leaf(w, name, x);
    }
}

static void walk_moe(walk *w, const cJSON *arr) {
    const cJSON *L;
    cJSON_ArrayForEach(L, arr) {
        const cJSON *enc = cJSON_GetObjectItemCaseSensitive(L, "encoder");
        const cJSON *blk = cJSON_GetObjectItemCaseSensitive(L, "block");
        const cJSON *stream = cJSON_GetObjectItemCaseSensitive(L, "stream");
        if (!cJSON_IsNumber(enc) || !cJSON_IsNumber(blk)) continue;
        char layer[48];
        snprintf(layer, sizeof layer, "e%d.b%d%s%s", enc->valueint, blk->valueint,
                 cJSON_IsString(stream) ? "." : "", cJSON_IsString(stream) ? stream->valuestring : "");
        const cJSON *x;
        cJSON_ArrayForEach(x, L) {
            if (!x->string || x == enc || x == blk || x == stream) continue;
            const int modality = !strcmp(x->string, "image") || !strcmp(x->string, "text");
            if (cJSON_IsObject(x)) {
                const cJSON *y;
                cJSON_ArrayForEach(y, x) {
                    if (!y->string) continue;
                    char name[256];
                    if (modality) snprintf(name, sizeof name, "moe:%s:%s:%s", y->string, layer, x->string);
                    else snprintf(name, sizeof name, "moe:%s.%s:%s:", x->string, y->string, layer);
                    leaf(w, name, y);
                }
            } else {
                char name[256];
                snprintf(name, sizeof name, "moe:%s:%s:", x->string, layer);
                leaf(w, name, x);
            }
        }
    }
}

static long walk_record(walk *w, const cJSON *r) {
    const cJSON *step = cJSON_GetObjectItemCaseSensitive(r, "step");
    const cJSON *kind = cJSON_GetObjectItemCaseSensitive(r, "kind");
    if (!cJSON_IsObject(r) || !cJSON_IsNumber(step) || !cJSON_IsString(kind)) return -1;
    w->step = (long)step->valuedouble;
    char prefix[64];
    snprintf(prefix, sizeof prefix, "%.40s:", kind->valuestring);
    walk_obj(w, prefix, r);
    const cJSON *moe = cJSON_GetObjectItemCaseSensitive(r, "moe");
    if (cJSON_IsArray(moe)) walk_moe(w, moe);
    return w->step;
}

long report_record_leaves(const char *line, report_leaf_fn fn, void *user) {
    cJSON *r = cJSON_Parse(line);
    if (!r) return -1;
    walk w = {.fn = fn, .user = user};
    const long step = walk_record(&w, r);
    cJSON_Delete(r);
    return step;
}

int report_metrics_add(report_metrics *m, const char *text, size_t n, size_t *used, const char *what) {
    size_t at = 0;
    char *line = NULL;
    size_t lcap = 0;
    int st = VLMOE_OK;
    while (at < n && !st) {
        const char *nl = memchr(text + at, '\n', n - at);
        if (!nl) break; // an unfinished last line: the writer is still on it
        const size_t len = (size_t)(nl - (text + at));
        if (len + 1 > lcap) {
            char *l2 = realloc(line, len + 1);
            if (!l2) { st = vlmoe_fail(VLMOE_ERR_NOMEM, "%s: a line of %zu bytes", what, len); break; }
            line = l2, lcap = len + 1;
        }
        memcpy(line, text + at, len);
        line[len] = 0;
        at += len + 1;
        if (!len) continue;
        cJSON *r = cJSON_Parse(line);
        walk w = {.m = m};
        const long s = r ? walk_record(&w, r) : -1;
        cJSON_Delete(r);
        if (w.st) st = vlmoe_fail(VLMOE_ERR_NOMEM, "%s: out of memory reading record of step %ld", what, s);
        else if (s < 0) m->bad_lines++;
        else {
            m->records++;
            if (s > m->last_step) m->last_step = s;
        }
    }
    free(line);
    *used = at;
    return st;
}

int report_metrics_read(report_metrics *m, const char *path) {
    memset(m, 0, sizeof(*m));
    FILE *f = fopen(path, "rb");
    if (!f) return vlmoe_fail(VLMOE_ERR_IO, "cannot read %s: %s", path, strerror(errno));
    char buf[1 << 16];
    char *text = NULL;
    size_t n = 0, cap = 0, k;
    int st = VLMOE_OK;
    while (!st && (k = fread(buf, 1, sizeof buf, f)) > 0) {
        if (n + k > cap) {
            cap = 2 * (n + k);
            char *t = realloc(text, cap);
            if (!t) { st = vlmoe_fail(VLMOE_ERR_NOMEM, "%s: %zu bytes", path, cap); break; }
            text = t;
        }
        memcpy(text + n, buf, k), n += k;
    }
    if (!st && ferror(f)) st = vlmoe_fail(VLMOE_ERR_IO, "cannot read %s: %s", path, strerror(errno));
    fclose(f);
    size_t used = 0;
    if (!st) st = report_metrics_add(m, text ? text : "", n, &used, path);
    free(text);
    if (!st && m->records == 0)
        st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: no records (a metrics.jsonl of `vlmoe train` has one JSON object "
                        "per line with \"step\" and \"kind\")", path);
    if (st) report_metrics_free(m);
    return st;
}

void report_metrics_free(report_metrics *m) {
    if (!m) return;
    for (int i = 0; i < m->ns; i++) free(m->s[i].name), free(m->s[i].step), free(m->s[i].v);
    free(m->s);
    memset(m, 0, sizeof(*m));
}
