// html.c: the self-contained report page of a training run (`vlmoe report`, `--report-every`):
// the series of metrics.jsonl (series.c) downsampled for display into one JSON object, Chart.js
// (Debian's libjs-chart.js) and the page's script inlined, routing maps as data: PNGs. The page
// needs no network. Its script writes any error into #errors. Covered by tests/test_report.c
// (headless Chromium: sections, points of every plot, no console error).
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "report/report.h"

#define CHART_JS_PATH "/usr/share/javascript/chart.js/chart.min.js"

int report_chart_js(char **out) {
    *out = NULL;
    const char *path = getenv("VLMOE_CHARTJS");
    if (!path || !*path) path = CHART_JS_PATH;
    FILE *f = fopen(path, "rb");
    if (!f)
        return vlmoe_fail(VLMOE_ERR_IO, "cannot read %s (Chart.js, inlined into the report): %s; install Debian's "
                          "libjs-chart.js (scripts/deps.sh does) or set VLMOE_CHARTJS to chart.min.js", path,
                          strerror(errno));
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *t = n > 0 && n < (1L << 26) ? malloc((size_t)n + 1) : NULL;
    if (!t || fread(t, 1, (size_t)n, f) != (size_t)n) {
        fclose(f), free(t);
        return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot read %ld bytes of Chart.js", path, n);
    }
    fclose(f);
    t[n] = 0;
    if (strstr(t, "</script") || strstr(t, "</SCRIPT")) { // it would end the inline <script> early
        free(t);
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: holds \"</script\", which cannot be inlined into a page", path);
    }
    *out = t;
    return VLMOE_OK;
}

char *report_base64(const uint8_t *d, size_t n) {
    static const char A[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    char *o = malloc((n + 2) / 3 * 4 + 1), *p = o;
    if (!o) return NULL;
    for (size_t i = 0; i < n; i += 3) {
        const uint32_t v = (uint32_t)d[i] << 16 | (i + 1 < n ? (uint32_t)d[i + 1] << 8 : 0) | (i + 2 < n ? d[i + 2] : 0);
        *p++ = A[v >> 18 & 63], *p++ = A[v >> 12 & 63];
        *p++ = i + 1 < n ? A[v >> 6 & 63] : '=';
        *p++ = i + 2 < n ? A[v & 63] : '=';
    }
    *p = 0;
    return o;
}

static void html_text(FILE *f, const char *s) {
    for (; s && *s; s++) {
        if (*s == '<') fputs("&lt;", f);
        else if (*s == '>') fputs("&gt;", f);
        else if (*s == '&') fputs("&amp;", f);
        else if (*s == '"') fputs("&quot;", f);
        else fputc(*s, f);
    }
}

// ---- display downsampling: a run of 500k steps logged every 10 is 50k points per series; a plot
// shows at most max_points, each the mean of a run of consecutive records at the run's last step
// (the first and last records are kept as they are). metrics.jsonl keeps every value.
static cJSON *numbers(const double *v, long n, long stride) {
    cJSON *a = cJSON_CreateArray();
    for (long i = 0; i < n; i++) {
        const double x = v[i * stride];
        cJSON_AddItemToArray(a, isfinite(x) ? cJSON_CreateNumber(x) : cJSON_CreateNull());
    }
    return a;
}

// Downsampled x and (dim values per point) y of s into two arrays.
static void downsample(const report_series *s, int max_points, cJSON **xs, cJSON **ys) {
    const int dim = s->dim ? s->dim : 1;
    const long n = s->n, m = n <= max_points ? n : max_points;
    double *x = malloc(sizeof(double) * (size_t)(m ? m : 1)), *y = malloc(sizeof(double) * (size_t)(m ? m : 1) * dim);
    long k = 0;
    for (long b = 0; b < m && x && y; b++) {
        long lo = n * b / m, hi = n * (b + 1) / m;
        if (n > m && (b == 0 || b == m - 1)) lo = b == 0 ? 0 : n - 1, hi = lo + 1; // exact ends
        if (n > m && b == 1) lo = 1;
        if (n > m && b == m - 2) hi = n - 1;
        if (hi <= lo) continue;
        x[k] = (double)s->step[hi - 1];
        for (int d = 0; d < dim; d++) {
            double sum = 0;
            long c = 0;
            for (long i = lo; i < hi; i++) {
                const double v = s->v[(size_t)i * dim + d];
                if (isfinite(v)) sum += v, c++;
            }
            y[(size_t)k * dim + d] = c ? sum / c : NAN;
        }
        k++;
    }
    *xs = x ? numbers(x, k, 1) : cJSON_CreateArray();
    if (!y) *ys = cJSON_CreateArray();
    else if (s->dim == 0) *ys = numbers(y, k, 1);
    else {
        *ys = cJSON_CreateArray();
        for (long i = 0; i < k; i++) cJSON_AddItemToArray(*ys, numbers(y + (size_t)i * dim, dim, 1));
    }
    free(x), free(y);
}

static cJSON *chart(cJSON *charts, const char *section, const char *title, const char *ylabel) {
    cJSON *c = cJSON_CreateObject();
    cJSON_AddStringToObject(c, "section", section);
    cJSON_AddStringToObject(c, "title", title);
    cJSON_AddStringToObject(c, "ylabel", ylabel);
    cJSON_AddItemToObject(c, "series", cJSON_CreateArray());
    cJSON_AddItemToArray(charts, c);
    return c;
}

static void chart_add(cJSON *c, const char *label, const report_series *s, int max_points) {
    cJSON *o = cJSON_CreateObject(), *x, *y;
    downsample(s, max_points, &x, &y);
    cJSON_AddStringToObject(o, "label", label);
    cJSON_AddItemToObject(o, "x", x);
    cJSON_AddItemToObject(o, "y", y);
    cJSON_AddNumberToObject(o, "records", (double)s->n);
    cJSON_AddItemToArray(cJSON_GetObjectItem(c, "series"), o);
}

static cJSON *find_chart(cJSON *charts, const char *title) {
    cJSON *c;
    cJSON_ArrayForEach(c, charts) if (!strcmp(cJSON_GetObjectItem(c, "title")->valuestring, title)) return c;
    return NULL;
}

// ---- pruning sweeps (vlmoe prune --sweep): one chart per modality pruned and data evaluated on,
// zero-shot top-1 against experts kept, a series per mode; a point measured again (a sweep run
// twice) shows its last value. Returns the points found.
typedef struct {
    char chart[400], mode[32];
    double kept, top1;
} sweep_point;

static int cmp_point(const void *a, const void *b) {
    const sweep_point *x = a, *y = b;
    const int c = strcmp(x->chart, y->chart) ? strcmp(x->chart, y->chart) : strcmp(x->mode, y->mode);
    return c ? c : (x->kept > y->kept) - (x->kept < y->kept);
}

static int sweep_charts(cJSON *charts, const char *text) {
    int n = 0, cap = 0;
    sweep_point *pt = NULL;
    for (const char *l = text; l && *l;) {
        const char *e = strchr(l, '\n');
        const size_t k = e ? (size_t)(e - l) : strlen(l);
        cJSON *o = cJSON_ParseWithLength(l, k);
        l = e ? e + 1 : l + k;
        const cJSON *mod = cJSON_GetObjectItem(o, "modality"), *mode = cJSON_GetObjectItem(o, "mode");
        const cJSON *kept = cJSON_GetObjectItem(o, "kept"), *zs = cJSON_GetObjectItem(o, "zeroshot");
        const cJSON *top1 = cJSON_GetObjectItem(zs, "top1"), *data = cJSON_GetObjectItem(zs, "data");
        if (cJSON_IsString(mod) && cJSON_IsString(mode) && cJSON_IsNumber(kept) && cJSON_IsNumber(top1)) {
            if (n == cap) {
                sweep_point *q = realloc(pt, sizeof(*pt) * (size_t)(cap = cap ? 2 * cap : 16));
                if (!q) break;
                pt = q;
            }
            sweep_point *p = &pt[n];
            snprintf(p->chart, sizeof p->chart, "Zero-shot top-1 against experts kept (pruned for %s, %s)",
                     mod->valuestring, cJSON_IsString(data) ? data->valuestring : "synthetic held-out");
            snprintf(p->mode, sizeof p->mode, "%s", mode->valuestring);
            p->kept = kept->valuedouble, p->top1 = top1->valuedouble;
            int same = -1; // the same point again: its newer value
            for (int i = 0; i < n && same < 0; i++)
                if (!cmp_point(&pt[i], p)) same = i;
            if (same >= 0) pt[same].top1 = p->top1;
            else n++;
        }
        cJSON_Delete(o);
    }
    qsort(pt, (size_t)n, sizeof(*pt), cmp_point);
    for (int i = 0; i < n;) {
        cJSON *c = find_chart(charts, pt[i].chart);
        if (!c) {
            c = chart(charts, "pruning", pt[i].chart, "zero-shot top-1 accuracy (share of images)");
            cJSON_AddStringToObject(c, "xlabel", "experts kept per MoE layer");
        }
        cJSON *o = cJSON_CreateObject(), *x = cJSON_AddArrayToObject(o, "x"), *y = cJSON_AddArrayToObject(o, "y");
        int j = i;
        for (; j < n && !strcmp(pt[j].chart, pt[i].chart) && !strcmp(pt[j].mode, pt[i].mode); j++)
            cJSON_AddItemToArray(x, cJSON_CreateNumber(pt[j].kept)), cJSON_AddItemToArray(y, cJSON_CreateNumber(pt[j].top1));
        cJSON_AddStringToObject(o, "label", pt[i].mode);
        cJSON_AddNumberToObject(o, "records", j - i);
        cJSON_AddItemToArray(cJSON_GetObjectItem(c, "series"), o);
        i = j;
    }
    free(pt);
    return n;
}

// Units and titles of the known training keys; any other key gets a chart titled by its name.
static const char *train_group(const char *k, const char **unit) {
    *unit = "";
    if (strstr(k, "loss") || !strcmp(k, "mim") || !strcmp(k, "mlm") || !strncmp(k, "vlm_", 4)) {
        if (!strstr(k, "acc")) return *unit = "loss (nats)", "Losses";
    }
    if (strstr(k, "acc")) return *unit = "accuracy (fraction)", "Accuracy";
    if (!strcmp(k, "lr")) return *unit = "learning rate", "Learning rate";
    if (!strcmp(k, "temperature")) return *unit = "exp(logit_scale)", "Temperature";
    if (!strcmp(k, "grad_norm")) return *unit = "L2 norm, before clipping", "Gradient norm";
    if (!strcmp(k, "time.samples_per_s")) return *unit = "pairs / s", "Throughput";
    if (!strcmp(k, "time.s_per_step")) return *unit = "s / step", "Time per step";
    return NULL;
}

static const char *moe_unit(const char *k) {
    if (!strcmp(k, "success")) return "fraction of tokens with an expert";
    if (!strcmp(k, "dropped")) return "fraction of assignments dropped";
    if (!strncmp(k, "entropy", 7)) return "entropy (nats)";
    if (!strcmp(k, "experts_used")) return "experts, exp(H(mean p))";
    if (!strcmp(k, "mean_max_gate") || strstr(k, "weight")) return "gate / weight";
    if (!strcmp(k, "tokens")) return "tokens per step";
    if (!strncmp(k, "aux.", 4)) return "auxiliary loss (unweighted)";
    return "value";
}

// "moe:KEY:LAYER:MOD" into its parts (buffers of 128)
static int moe_parts(const char *name, char *key, char *layer, char *mod) {
    if (strncmp(name, "moe:", 4)) return 0;
    const char *a = name + 4, *b = strchr(a, ':'), *c = b ? strchr(b + 1, ':') : NULL;
    if (!c) return 0;
    snprintf(key, 128, "%.*s", (int)(b - a), a);
    snprintf(layer, 128, "%.*s", (int)(c - b - 1), b + 1);
    snprintf(mod, 128, "%s", c + 1);
    return 1;
}

// The data object the page's script draws.
static cJSON *page_data(const report_page *p) {
    const report_metrics *m = p->metrics;
    const int M = p->max_points > 8 ? p->max_points : 600;
    cJSON *d = cJSON_CreateObject(), *charts = cJSON_AddArrayToObject(d, "charts");
    cJSON *heat = cJSON_AddArrayToObject(d, "heatmaps"), *bars = cJSON_AddArrayToObject(d, "bars");
    char title[512];
    // training and evaluation
    for (int i = 0; i < m->ns; i++) {
        const report_series *s = &m->s[i];
        if (s->dim) continue;
        const char *unit, *g;
        if (!strncmp(s->name, "train:", 6)) {
            const char *k = s->name + 6;
            if (!(g = train_group(k, &unit))) snprintf(title, sizeof title, "%s", k), g = title, unit = k;
            cJSON *c = find_chart(charts, g);
            chart_add(c ? c : chart(charts, "training", g, unit), k, s, M);
        } else if (!strncmp(s->name, "eval:", 5)) {
            const char *k = s->name + 5, *dot = strchr(k, '.');
            if (dot) snprintf(title, sizeof title, "Evaluation: %.*s", (int)(dot - k), k);
            else { // eval_zeroshot_top1 -> eval_zeroshot
                const char *us = strrchr(k, '_');
                snprintf(title, sizeof title, "Evaluation: %.*s", (int)(us && us != k ? us - k : (long)strlen(k)), k);
            }
            cJSON *c = find_chart(charts, title);
            chart_add(c ? c : chart(charts, "evaluation", title, "metric value"), k, s, M);
        }
    }
    // per MoE layer and modality, one chart per key
    char key[128], layer[128], mod[128];
    for (int i = 0; i < m->ns; i++) {
        const report_series *s = &m->s[i];
        if (!moe_parts(s->name, key, layer, mod)) continue;
        char label[300];
        snprintf(label, sizeof label, "%s%s%s", layer, *mod ? " " : "", mod);
        if (s->dim == 0) {
            snprintf(title, sizeof title, "%s per MoE layer and modality", key);
            cJSON *c = find_chart(charts, title);
            chart_add(c ? c : chart(charts, "routing", title, moe_unit(key)), label, s, M);
            continue;
        }
        // a vector per expert: the heatmap over steps
        cJSON *h = cJSON_CreateObject(), *x, *y;
        downsample(s, M < 300 ? M : 300, &x, &y);
        snprintf(title, sizeof title, "%s: %s tokens, %s per expert", layer, *mod ? mod : "all", key);
        cJSON_AddStringToObject(h, "title", title);
        cJSON_AddStringToObject(h, "key", key);
        cJSON_AddNumberToObject(h, "experts", s->dim);
        cJSON_AddItemToObject(h, "x", x);
        cJSON_AddItemToObject(h, "y", y);
        cJSON_AddItemToArray(heat, h);
    }
    // the last step of each layer: tokens per expert of both modalities against the capacity, and
    // the text share per expert
    for (int i = 0; i < m->ns; i++) {
        const report_series *s = &m->s[i];
        if (!moe_parts(s->name, key, layer, mod) || strcmp(key, "accepted") || strcmp(mod, "image") || !s->dim)
            continue;
        char nm[300];
        snprintf(nm, sizeof nm, "moe:accepted:%s:text", layer);
        const report_series *t = report_metrics_find(m, nm);
        snprintf(nm, sizeof nm, "moe:tokens:%s:image", layer);
        const report_series *ti = report_metrics_find(m, nm);
        snprintf(nm, sizeof nm, "moe:tokens:%s:text", layer);
        const report_series *tt = report_metrics_find(m, nm);
        if (!ti || !ti->n || !s->n) continue;
        const int E = s->dim;
        const double *ai = s->v + (size_t)(s->n - 1) * E, *at = t && t->n && t->dim == E ? t->v + (size_t)(t->n - 1) * E : NULL;
        const double ni = ti->v[ti->n - 1], nt = at && tt && tt->n ? tt->v[tt->n - 1] : 0;
        cJSON *b = cJSON_CreateObject(), *ser = cJSON_CreateArray();
        snprintf(title, sizeof title, "%s: tokens per expert at step %ld", layer, s->step[s->n - 1]);
        cJSON_AddStringToObject(b, "title", title);
        cJSON_AddStringToObject(b, "ylabel", "tokens processed (one training step)");
        cJSON_AddNumberToObject(b, "experts", E);
        cJSON *img = cJSON_CreateObject(), *txt = cJSON_CreateObject(), *yi = cJSON_CreateArray(), *yt = cJSON_CreateArray();
        for (int e = 0; e < E; e++) {
            cJSON_AddItemToArray(yi, cJSON_CreateNumber(ai[e] * ni));
            cJSON_AddItemToArray(yt, cJSON_CreateNumber(at ? at[e] * nt : 0));
        }
        cJSON_AddStringToObject(img, "label", "image tokens"), cJSON_AddItemToObject(img, "y", yi);
        cJSON_AddStringToObject(txt, "label", "text tokens"), cJSON_AddItemToObject(txt, "y", yt);
        cJSON_AddItemToArray(ser, img), cJSON_AddItemToArray(ser, txt);
        cJSON_AddItemToObject(b, "series", ser);
        cJSON_AddTrueToObject(b, "stacked");
        // the training capacity: C = cf * K * S / E tokens per expert and group, summed over the
        // step's groups: cf * K * (tokens of the step) / E
        const vlmoe_model_config *c = p->model ? vlmoe_model_get_config(p->model) : NULL;
        const int enc = layer[1] - '0';
        const vlmoe_moe_config *mc = c ? (enc == 1 ? &c->text_moe : &c->moe) : NULL;
        if (mc && mc->router != VLMOE_ROUTER_SOFT && mc->router != VLMOE_ROUTER_NONE && mc->num_experts == E) {
            const double K = mc->router == VLMOE_ROUTER_TOKENS ? mc->top_k : 1;
            cJSON_AddNumberToObject(b, "capacity", mc->capacity_factor * K * (ni + nt) / E);
        }
        cJSON_AddItemToArray(bars, b);
        if (!at) continue;
        cJSON *sh = cJSON_CreateObject(), *ss = cJSON_CreateArray(), *so = cJSON_CreateObject(), *sy = cJSON_CreateArray();
        snprintf(title, sizeof title, "%s: share of text tokens per expert at step %ld", layer, s->step[s->n - 1]);
        cJSON_AddStringToObject(sh, "title", title);
        cJSON_AddStringToObject(sh, "ylabel", "text tokens / all tokens of the expert");
        cJSON_AddNumberToObject(sh, "experts", E);
        for (int e = 0; e < E; e++) {
            const double a = ai[e] * ni, bt = at[e] * nt;
            cJSON_AddItemToArray(sy, a + bt > 0 ? cJSON_CreateNumber(bt / (a + bt)) : cJSON_CreateNumber(0));
        }
        cJSON_AddStringToObject(so, "label", "text share");
        cJSON_AddItemToObject(so, "y", sy);
        cJSON_AddItemToArray(ss, so);
        cJSON_AddItemToObject(sh, "series", ss);
        cJSON_AddNumberToObject(sh, "ymax", 1);
        cJSON_AddItemToArray(bars, sh);
    }
    if (p->prune_sweep) sweep_charts(charts, p->prune_sweep);
    return d;
}

// ---- the model card
typedef struct {
    double total, experts, active, flops;
} card;

static card model_card(const vlmoe_model *m) {
    card k = {0};
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    int np = 0;
    const vlmoe_param_info *pi = vlmoe_model_params(m, &np);
    double enc_active[2] = {0, 0};
    for (int i = 0; i < np; i++) {
        const double n = (double)pi[i].numel;
        k.total += n;
        const int text = !strncmp(pi[i].name, "text", 4);
        const vlmoe_moe_config *mc = text && c->arch == VLMOE_ARCH_TWO_TOWER ? &c->text_moe : &c->moe;
        double frac = 1;
        if (strstr(pi[i].name, ".moe.experts.")) {
            k.experts += n;
            const int E = mc->num_experts > 0 ? mc->num_experts : 1;
            // experts a token reaches on average: K (tokens choice), cf (experts choice: E*C/S),
            // E * slots / S (Soft MoE, one expert's worth with the default slots)
            const double reach = mc->router == VLMOE_ROUTER_TOKENS    ? mc->top_k
                                 : mc->router == VLMOE_ROUTER_EXPERTS ? mc->capacity_factor
                                 : mc->slots_per_expert && mc->group_size ? (double)E * mc->slots_per_expert / mc->group_size
                                                                        : 1;
            frac = reach / E < 1 ? reach / E : 1;
        }
        k.active += n * frac;
        if (strstr(pi[i].name, "blocks.") && pi[i].ndim == 2) enc_active[text && c->arch == VLMOE_ARCH_TWO_TOWER] += n * frac;
    }
    // forward FLOPs of one image-text pair: 2 per multiply-add of every block matrix a token meets,
    // plus attention's QK^T and AV (4 * T^2 * width per block)
    const double Ti = (double)(c->image_size / c->patch_size) * (c->image_size / c->patch_size) + (c->image_class_token ? 1 : 0);
    const double Tt = c->context_length;
    if (c->arch == VLMOE_ARCH_TWO_TOWER)
        k.flops = 2 * enc_active[0] * Ti + 2 * enc_active[1] * Tt + 4.0 * c->encoder.layers * Ti * Ti * c->encoder.width +
                  4.0 * c->text_encoder.layers * Tt * Tt * c->text_encoder.width;
    else
        k.flops = 2 * enc_active[0] * (Ti + Tt) + 4.0 * c->encoder.layers * (Ti * Ti + Tt * Tt) * c->encoder.width;
    return k;
}

static void human(char *o, size_t n, double v) {
    if (v >= 1e9) snprintf(o, n, "%.2f G", v / 1e9);
    else if (v >= 1e6) snprintf(o, n, "%.2f M", v / 1e6);
    else if (v >= 1e3) snprintf(o, n, "%.1f k", v / 1e3);
    else snprintf(o, n, "%.0f", v);
}

static const char CSS[] =
    "body{font:14px/1.4 system-ui,sans-serif;margin:0 auto;max-width:1400px;padding:0 16px;color:#222}"
    "h1{font-size:22px}h2{border-bottom:1px solid #ccc;padding-top:12px}nav a{margin-right:12px}"
    ".grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:12px}"
    ".plot{border:1px solid #ddd;border-radius:4px;padding:6px;height:300px;position:relative}"
    ".heat{border:1px solid #ddd;border-radius:4px;padding:6px}.heat canvas{width:100%;height:220px}"
    ".note{color:#666}#errors{color:#b00;white-space:pre-wrap}#errors:empty{display:none}"
    "table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:2px 8px;text-align:left;vertical-align:top}"
    ".map img{image-rendering:pixelated;max-width:100%}.cap{margin:2px 0}.cap .ln{display:inline-block;width:90px;color:#666}"
    ".w{padding:1px 3px;margin:1px;border-radius:3px;color:#000}.sw{display:inline-block;width:14px;height:14px;"
    "vertical-align:middle;margin:0 3px 0 10px;border:1px solid #999}";

// The page's script. Every plot's container gets data-points (points drawn), the test's check.
static const char SCRIPT[] =
    "(function(){\n"
    "var err=document.getElementById('errors');\n"
    "function fail(m){err.textContent+=m+'\\n';}\n"
    "window.addEventListener('error',function(e){fail('error: '+e.message);});\n"
    "try{\n"
    "var D=JSON.parse(document.getElementById('data').textContent);\n"
    "var pal=['#1f77b4','#ff7f0e','#2ca02c','#d62728','#9467bd','#8c564b','#e377c2','#bcbd22','#17becf','#393b79',"
    "'#aec7e8','#ffbb78','#98df8a','#ff9896','#c5b0d5','#c49c94','#f7b6d2','#dbdb8d','#9edae5','#637939'];\n"
    "Chart.defaults.animation=false;Chart.defaults.font.size=11;\n"
    "function box(sec,cls,title){var g=document.querySelector('#'+sec+' .grid');var d=document.createElement('div');"
    "d.className=cls;d.setAttribute('data-title',title);g.appendChild(d);return d;}\n"
    "function axis(t){return {display:true,text:t};}\n"
    "D.charts.forEach(function(c){var d=box(c.section,'plot',c.title),cv=document.createElement('canvas');d.appendChild(cv);"
    "var n=0,ds=c.series.map(function(s,i){var pts=[];for(var k=0;k<s.x.length;k++){if(s.y[k]!==null)n++;"
    "pts.push({x:s.x[k],y:s.y[k]});}return {label:s.label+(s.records>s.x.length?' ('+s.records+' records, shown as '+s.x.length+')':''),"
    "data:pts,borderColor:pal[i%pal.length],backgroundColor:pal[i%pal.length],pointRadius:s.x.length<40?2:0,borderWidth:1.5,"
    "spanGaps:true};});\n"
    "new Chart(cv,{type:'line',data:{datasets:ds},options:{maintainAspectRatio:false,parsing:false,normalized:true,"
    "plugins:{title:{display:true,text:c.title},legend:{labels:{boxWidth:10}}},"
    "scales:{x:{type:'linear',title:axis(c.xlabel||'step (optimizer steps)')},y:{title:axis(c.ylabel)}}}});\n"
    "d.setAttribute('data-points',n);});\n"
    "D.bars.forEach(function(b){var d=box('experts','plot',b.title),cv=document.createElement('canvas');d.appendChild(cv);"
    "var lab=[],n=0;for(var e=0;e<b.experts;e++)lab.push('expert '+e);"
    "var ds=b.series.map(function(s,i){n+=s.y.length;return {label:s.label,data:s.y,backgroundColor:pal[i%pal.length]};});\n"
    "if(b.capacity!==undefined)ds.push({type:'line',label:'capacity (train cf)',data:lab.map(function(){return b.capacity;}),"
    "borderColor:'#000',borderDash:[6,4],pointRadius:0,borderWidth:1.5});\n"
    "var y={title:axis(b.ylabel),stacked:!!b.stacked,beginAtZero:true};if(b.ymax)y.max=b.ymax;\n"
    "new Chart(cv,{type:'bar',data:{labels:lab,datasets:ds},options:{maintainAspectRatio:false,plugins:{title:{display:true,"
    "text:b.title}},scales:{x:{stacked:!!b.stacked,title:axis('expert')},y:y}}});d.setAttribute('data-points',n);});\n"
    // heatmaps: experts (rows) over steps (columns), white to dark blue by the value, with a scale
    "D.heatmaps.forEach(function(h){var d=box('experts','heat',h.title),t=document.createElement('div');"
    "var mx=0,n=0;h.y.forEach(function(r){r.forEach(function(v){if(v!==null){n++;if(v>mx)mx=v;}});});"
    "t.textContent=h.title+' (colour: 0 to '+mx.toPrecision(3)+' of the modality\\'s tokens; x: step '+h.x[0]+' to '+h.x[h.x.length-1]+')';"
    "d.appendChild(t);var cv=document.createElement('canvas');cv.width=600;cv.height=220;d.appendChild(cv);"
    "var g=cv.getContext('2d'),L=60,B=30,W=cv.width-L-10,H=cv.height-B-8,E=h.experts,C=h.x.length;"
    "for(var i=0;i<C;i++)for(var e=0;e<E;e++){var v=h.y[i][e];var a=v===null||mx<=0?0:v/mx;"
    "g.fillStyle='rgb('+Math.round(255-222*a)+','+Math.round(255-175*a)+','+Math.round(255-75*a)+')';"
    "g.fillRect(L+W*i/C,8+H*e/E,Math.ceil(W/C),Math.ceil(H/E));}\n"
    "g.fillStyle='#222';g.font='11px sans-serif';g.textAlign='right';var st=Math.max(1,Math.ceil(E/8));"
    "for(var e=0;e<E;e+=st)g.fillText('expert '+e,L-4,8+H*(e+0.5)/E+4);g.textAlign='center';"
    "for(var k=0;k<=4;k++){var i=Math.min(C-1,Math.round((C-1)*k/4));g.fillText(h.x[i],L+W*(i+0.5)/C,cv.height-14);}"
    "g.fillText('step',L+W/2,cv.height-2);d.setAttribute('data-points',n);});\n"
    "document.querySelectorAll('section').forEach(function(s){var g=s.querySelector('.grid');if(g&&!g.children.length&&"
    "!s.querySelector('.empty')){var p=document.createElement('p');p.className='note empty';p.textContent='Nothing of this "
    "kind in the metrics file.';s.appendChild(p);}});\n"
    "document.body.setAttribute('data-ready','1');\n"
    "}catch(e){fail('error: '+e.message);}\n"
    "})();\n";

static void swatch_legend(FILE *f, int E) {
    fputs("<p>", f);
    for (int e = 0; e < E; e++) {
        uint8_t c[3];
        report_expert_rgb(e, c);
        fprintf(f, "<span class=\"sw\" style=\"background:#%02x%02x%02x\"></span>expert %d", c[0], c[1], c[2], e);
    }
    fprintf(f, "<span class=\"sw\" style=\"background:#%02x%02x%02x\"></span>dropped</p>\n", REPORT_DROPPED_RGB,
            REPORT_DROPPED_RGB, REPORT_DROPPED_RGB);
}

static void write_maps(FILE *f, const report_page *p) {
    fputs("<section id=\"maps\"><h2>Routing maps</h2>\n", f);
    if (!p->nexamples) {
        fputs("<p class=\"note empty\">No routing maps: ", f);
        html_text(f, p->examples_from ? p->examples_from : "no checkpoint");
        fputs("</p></section>\n", f);
        return;
    }
    fputs("<p class=\"note\">Each held-out image, then one panel per MoE layer: every patch in the colour of the expert "
          "that took it (its largest accepted combine weight; grey: dropped by capacity). Below, the caption's words "
          "in the colour of the expert of their first token, per layer (LIMoE Fig. 2). Examples: ", f);
    html_text(f, p->examples_from);
    if (p->checkpoint) fputs("; model ", f), html_text(f, p->checkpoint);
    fputs(" (evaluation mode: no routing noise, the eval capacity factor).</p>\n", f);
    swatch_legend(f, p->num_experts);
    for (int i = 0; i < p->nexamples; i++) {
        const report_example *x = &p->examples[i];
        fprintf(f, "<div class=\"map\" data-example=\"%d\"><p><b>example %d</b>: panels input", i, i);
        for (int l = 0; l < p->layers; l++) fprintf(f, ", %s", p->layer_name[l]);
        fputs("</p><img alt=\"routing map\" src=\"data:image/png;base64,", f);
        fputs(x->png_b64, f);
        fputs("\">\n", f);
        for (int l = 0; l < p->layers && x->nwords; l++) {
            fprintf(f, "<div class=\"cap\"><span class=\"ln\">%s</span>", p->layer_name[l]);
            for (int w = 0; w < x->nwords; w++) {
                uint8_t c[3];
                report_expert_rgb(x->word_expert[(size_t)l * x->nwords + w], c);
                fprintf(f, "<span class=\"w\" style=\"background:#%02x%02x%02x\">", c[0], c[1], c[2]);
                html_text(f, x->words[w]);
                fputs("</span>", f);
            }
            fputs("</div>\n", f);
        }
        fputs("</div>\n", f);
    }
    fputs("</section>\n", f);
}

static void write_config(FILE *f, const report_page *p) {
    fputs("<section id=\"config\"><h2>Configuration and model card</h2>\n", f);
    if (p->model) {
        const card k = model_card(p->model);
        const vlmoe_model_config *c = vlmoe_model_get_config(p->model);
        char a[32], b[32], e[32], fl[32];
        human(a, sizeof a, k.total), human(b, sizeof b, k.active), human(e, sizeof e, k.experts), human(fl, sizeof fl, k.flops);
        fputs("<table id=\"card\"><tr><th>model</th><td>", f);
        html_text(f, c->name);
        fprintf(f, " (%s)</td></tr><tr><th>parameters</th><td>%s (%.0f)</td></tr>"
                "<tr><th>of them in experts</th><td>%s</td></tr>"
                "<tr><th>active parameters per token</th><td>%s (experts weighted by the share of them a token reaches)</td></tr>"
                "<tr><th>forward FLOPs per image-text pair</th><td>%sFLOP (2 per multiply-add of the active block "
                "matrices, plus attention)</td></tr>",
                c->arch == VLMOE_ARCH_ONE_TOWER ? "one_tower" : c->arch == VLMOE_ARCH_TWO_TOWER ? "two_tower" : "mome",
                a, k.total, e, b, fl);
        fputs("<tr><th>checkpoint</th><td>", f);
        html_text(f, p->checkpoint);
        fputs("</td></tr></table>\n", f);
    } else fputs("<p class=\"note\">No checkpoint: no model card.</p>\n", f);
    cJSON *pj = p->params_json ? cJSON_Parse(p->params_json) : NULL;
    if (cJSON_IsObject(pj)) {
        fputs("<h3>params.json</h3><table id=\"params\">", f);
        const cJSON *x;
        cJSON_ArrayForEach(x, pj) {
            char *v = cJSON_PrintUnformatted(x);
            fputs("<tr><th>", f), html_text(f, x->string), fputs("</th><td>", f), html_text(f, v), fputs("</td></tr>", f);
            free(v);
        }
        fputs("</table>\n", f);
    } else fputs("<p class=\"note\">No params.json in the run folder.</p>\n", f);
    cJSON_Delete(pj);
    fputs("</section>\n", f);
}

static void write_pruning(FILE *f, const report_page *p) {
    fputs("<section id=\"pruning\"><h2>Pruning</h2>\n", f);
    const vlmoe_model_config *c = p->model ? vlmoe_model_get_config(p->model) : NULL;
    int any = 0;
    for (int enc = 0; c && enc < 2; enc++) {
        const vlmoe_moe_config *mc = enc ? &c->text_moe : &c->moe;
        for (int l = 0; l < 64; l++) {
            if (!(mc->layers >> l & 1) || !mc->pruned[l]) continue;
            int kept = 0;
            for (int e = 0; e < mc->num_experts && e < 64; e++) kept += !(mc->pruned[l] >> e & 1);
            if (!any) fputs("<p>router_pred pruning (LIMoE E.4): experts the router may pick, per layer.</p><table>", f);
            fprintf(f, "<tr><th>encoder %d block %d</th><td>%d of %d kept</td></tr>", enc, l, kept, mc->num_experts);
            any = 1;
        }
    }
    if (any) fputs("</table>\n", f);
    else fputs("<p class=\"note\">The checkpoint is not router_pred-pruned (a router_drop model has fewer experts in its "
               "config; see the model card).</p>\n", f);
    if (p->prune_sweep) fputs("<p class=\"note\">Zero-shot against experts kept per MoE layer, from prune_sweep.jsonl "
                              "(vlmoe prune --sweep): router_pred masks the pruned experts out of the top-K, router_drop "
                              "removes them; the unpruned model is the point at all experts.</p>\n", f);
    else fputs("<p class=\"note empty\">No pruning sweep in the run folder: vlmoe prune --model RUN/checkpoints/step_N."
               "safetensors --modality text --sweep 1,2,4 writes RUN/prune_sweep.jsonl, plotted here.</p>\n", f);
    fputs("<div class=\"grid\"></div></section>\n", f);
}

int report_html_write(const char *path, const report_page *p) {
    char tmp[1200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    cJSON *d = page_data(p);
    char *json = d ? cJSON_PrintUnformatted(d) : NULL;
    cJSON_Delete(d);
    if (!json) return vlmoe_fail(VLMOE_ERR_NOMEM, "%s: the report's data", path);
    FILE *f = fopen(tmp, "w");
    if (!f) {
        free(json);
        return vlmoe_fail(VLMOE_ERR_IO, "cannot write %s: %s", tmp, strerror(errno));
    }
    fputs("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>vlmoe report: ", f);
    html_text(f, p->title);
    fprintf(f, "</title><style>%s</style></head><body>\n<h1>vlmoe report: ", CSS);
    html_text(f, p->title);
    fputs("</h1>\n<p class=\"note\">Run folder ", f);
    html_text(f, p->run_dir);
    fprintf(f, ": %ld records up to step %ld", p->metrics->records, p->metrics->last_step);
    if (p->metrics->bad_lines) fprintf(f, " (%ld unreadable lines skipped)", p->metrics->bad_lines);
    fprintf(f, ". Plots show at most %d points per series (means of consecutive records); metrics.jsonl keeps every "
            "value.</p>\n<nav><a href=\"#training\">training</a><a href=\"#evaluation\">evaluation</a><a href=\"#routing\">"
            "routing</a><a href=\"#experts\">tokens per expert</a><a href=\"#maps\">routing maps</a><a href=\"#pruning\">"
            "pruning</a><a href=\"#config\">configuration</a></nav>\n<pre id=\"errors\"></pre>\n",
            p->max_points > 8 ? p->max_points : 600);
    fputs("<section id=\"training\"><h2>Training</h2><p class=\"note\">Losses (task, auxiliary, total), accuracy, learning "
          "rate, temperature, gradient norm, throughput.</p><div class=\"grid\"></div></section>\n"
          "<section id=\"evaluation\"><h2>Evaluation</h2><p class=\"note\">Validation and zero-shot records.</p><div "
          "class=\"grid\"></div></section>\n"
          "<section id=\"routing\"><h2>Routing per MoE layer and modality</h2><p class=\"note\">Layers as e&lt;encoder&gt;"
          ".b&lt;block&gt;. Success: tokens with an expert; dropped: assignments over capacity; entropy_pre: global router entropy "
          "H(mean p) (LIMoE Fig. 9); entropy_token: mean per-token entropy; experts_cover: experts holding 50/80/90% of the "
          "assignments; entropy_post: spread of the accepted assignments; experts_used: exp(H(mean p)); every other "
          "statistic of the metrics file is plotted the same way.</p><div class=\"grid\"></div></section>\n"
          "<section id=\"experts\"><h2>Tokens per expert</h2><p class=\"note\">Heatmaps: each expert's share of the "
          "modality's tokens over steps. Bars: the last step's tokens per expert against the capacity, and the share of "
          "text tokens per expert (specialisation).</p><div class=\"grid\"></div></section>\n", f);
    write_maps(f, p);
    write_pruning(f, p);
    write_config(f, p);
    fputs("<script id=\"data\" type=\"application/json\">", f);
    for (const char *q = json; *q; q++) { // "</" inside a string would end the element: JSON allows "<\/"
        if (q[0] == '<' && q[1] == '/') fputs("<\\", f);
        else fputc(*q, f);
    }
    fputs("</script>\n<script>", f);
    fputs(p->chart_js, f);
    fputs("</script>\n<script>", f);
    fputs(SCRIPT, f);
    fputs("</script>\n</body></html>\n", f);
    free(json);
    int st = ferror(f) ? VLMOE_ERR_IO : VLMOE_OK;
    if (fclose(f)) st = VLMOE_ERR_IO;
    if (st || rename(tmp, path)) { // a browser reloading the page during training sees the old or the new one
        remove(tmp);
        return vlmoe_fail(VLMOE_ERR_IO, "cannot write %s: %s", path, strerror(errno));
    }
    return VLMOE_OK;
}
