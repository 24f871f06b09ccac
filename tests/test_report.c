// test_report.c: `vlmoe report` and `vlmoe train --report-every` (cli/report.c, src/report/): the
// page of a short run rendered in headless Chromium (Debian's chromium; skipped with the reason
// where it is absent): every section present, every plot with data points, no console error, a
// screenshot; a page whose script fails is caught the same way; statistics added to the metrics
// schema are plotted by key pattern; a 500k-step file is downsampled for display with its ends
// exact; a file of the user's is never overwritten; errors name the folder or flag.
#include <cjson/cJSON.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test.h"

static const char *bin;
static char dir[64], out[16384];

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *t = malloc((size_t)n + 1);
    if (t && fread(t, 1, (size_t)n, f) != (size_t)n) free(t), t = NULL;
    if (t) t[n] = 0;
    fclose(f);
    return t;
}

// The page's data object (the JSON of <script id="data">).
static cJSON *page_data(const char *html) {
    const char *a = html ? strstr(html, "<script id=\"data\" type=\"application/json\">") : NULL;
    const char *b = a ? strstr(a, "</script>") : NULL;
    if (!b) return NULL;
    a = strchr(a, '>') + 1;
    char *j = strndup(a, (size_t)(b - a));
    cJSON *d = cJSON_Parse(j);
    free(j);
    return d;
}

static const cJSON *chart_named(const cJSON *d, const char *title) {
    const cJSON *c;
    cJSON_ArrayForEach(c, cJSON_GetObjectItem(d, "charts")) if (!strcmp(cJSON_GetObjectItem(c, "title")->valuestring, title))
        return c;
    return NULL;
}

// Copies src's lines into dst with `extra` added to every layer's image object and `layer` to the layer.
static void add_keys(const char *src, const char *dst) {
    FILE *i = fopen(src, "r"), *o = fopen(dst, "w");
    CHECK(i && o, "copy %s", src);
    char line[1 << 16];
    while (i && o && fgets(line, sizeof line, i)) {
        cJSON *r = cJSON_Parse(line);
        const cJSON *L;
        int k = 0;
        cJSON_ArrayForEach(L, cJSON_GetObjectItem(r, "moe")) {
            cJSON_AddNumberToObject(cJSON_GetObjectItem(L, "image"), "entropy_global", 0.5 + 0.01 * k++);
            cJSON_AddNumberToObject((cJSON *)L, "capacity", 12);
        }
        char *s = cJSON_PrintUnformatted(r);
        fprintf(o, "%s\n", s);
        free(s), cJSON_Delete(r);
    }
    if (i) fclose(i);
    if (o) fclose(o);
}

// Renders page in headless Chromium: the DOM after its script and the console, then a screenshot.
// Returns 0 when chromium ran; *dom and *log malloc'd.
static int chromium(const char *chrome, const char *page, const char *shot, char **dom, char **log) {
    char cmd[4096];
    const char *flags = "--headless --no-sandbox --disable-gpu --no-first-run --disable-extensions "
                        "--disable-background-networking --virtual-time-budget=10000";
    snprintf(cmd, sizeof cmd, "cd %s && rm -rf profile && timeout 180 %s %s --user-data-dir=profile --enable-logging=stderr "
             "--v=0 --dump-dom file://%s >dom.html 2>console.txt", dir, chrome, flags, page);
    const int st = system(cmd);
    CHECK(st == 0, "chromium --dump-dom %s: status %d", page, st);
    snprintf(cmd, sizeof cmd, "cd %s && rm -rf profile2 && timeout 180 %s %s --user-data-dir=profile2 --hide-scrollbars "
             "--window-size=1400,2400 --screenshot=%s file://%s >/dev/null 2>&1", dir, chrome, flags, shot, page);
    CHECK(system(cmd) == 0, "chromium --screenshot %s", page);
    *dom = slurp(test_path(dir, "dom.html"));
    *log = slurp(test_path(dir, "console.txt"));
    return st;
}

// The checks on a rendered page: sections, plots with points, the error box empty, no console
// error. Returns the number of failures it found (reported as checks by the caller).
static int page_faults(const char *dom, const char *log, int *plots, int *maps, char *why, size_t n) {
    int faults = 0;
    *plots = 0, *maps = 0;
    why[0] = 0;
    if (!dom) return snprintf(why, n, "no DOM"), 1;
    const char *ids[] = {"training", "evaluation", "routing", "experts", "maps", "pruning", "config"};
    for (int i = 0; i < 7; i++) {
        char s[64];
        snprintf(s, sizeof s, "<section id=\"%s\"", ids[i]);
        if (!strstr(dom, s)) faults++, snprintf(why + strlen(why), n - strlen(why), "no section %s; ", ids[i]);
    }
    if (!strstr(dom, "data-ready=\"1\"")) faults++, snprintf(why + strlen(why), n - strlen(why), "script did not finish; ");
    const char *e = strstr(dom, "<pre id=\"errors\">");
    if (!e || strncmp(e + 17, "</pre>", 6)) faults++, snprintf(why + strlen(why), n - strlen(why), "errors shown: %.200s; ", e ? e + 17 : "(no box)");
    for (const char *p = dom; (p = strstr(p, "<div class=\"")); p++) {
        const int plot = !strncmp(p + 12, "plot\"", 5), heat = !strncmp(p + 12, "heat\"", 5);
        if (!plot && !heat) continue;
        const char *end = strchr(p, '>'), *dp = strstr(p, "data-points=\"");
        const long pts = dp && dp < end ? atol(dp + 13) : 0;
        (*plots)++;
        if (pts <= 0) {
            faults++;
            const char *t = strstr(p, "data-title=\"");
            snprintf(why + strlen(why), n - strlen(why), "plot without points: %.60s; ", t && t < end ? t + 12 : "?");
        }
    }
    for (const char *p = dom; (p = strstr(p, "src=\"data:image/png;base64,")); p++) (*maps)++;
    if (log && (strstr(log, "Uncaught") || strstr(log, ":CONSOLE"))) {
        faults++;
        const char *c = strstr(log, "Uncaught") ? strstr(log, "Uncaught") : strstr(log, ":CONSOLE");
        snprintf(why + strlen(why), n - strlen(why), "console: %.200s", c);
    }
    return faults;
}

int main(int argc, char **argv) {
    static char abs_bin[4096];
    if (!(bin = test_vlmoe_bin(argv[0], abs_bin))) return test_summary("test_report");
    snprintf(dir, sizeof dir, "/tmp/vlmoe_report_XXXXXX");
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    test_expect_in(dir, bin, "train --model limoe-tiny --steps 20 --batch-size 8 --log-every-n-steps 2 --eval-samples 24 "
                   "--zeroshot-every-n-steps 10 --save-every-n-steps 10 --report-every 10 --logs runs --name r",
                   0, "report: runs/r/report.html", out, sizeof out);
    char *html = slurp(test_path(dir, "runs/r/report.html"));
    CHECK(html && !strncmp(html, "<!doctype html>", 15), "the run's report.html");
    CHECK(html && !strstr(html, "src=\"http") && !strstr(html, "href=\"http"), "the page loads nothing from the network");
    free(html);
    test_expect_in(dir, bin, "report runs/r -o page.html", 0, "wrote page.html (12 records to step 20, routing maps", out,
                   sizeof out);
    // examples of the user's: an OpenCLIP CSV (images and captions) and a folder (images alone)
    test_expect_in(dir, bin, "synth export --out ex --n 3 --image-size 32 --split val", 0, "", out, sizeof out);
    test_expect_in(dir, bin, "report runs/r --examples ex/captions.csv -o csv.html", 0,
                   "routing maps of the first 3 readable rows of ex/captions.csv", out, sizeof out);
    html = slurp(test_path(dir, "csv.html"));
    int nmaps = 0, nwords = 0;
    for (const char *q = html; q && (q = strstr(q, "src=\"data:image/png;base64,")); q++) nmaps++;
    for (const char *q = html; q && (q = strstr(q, "<span class=\"w\"")); q++) nwords++;
    CHECK(nmaps == 3 && nwords >= 3 * 4, "CSV examples: %d maps, %d coloured words", nmaps, nwords);
    free(html);
    test_expect_in(dir, bin, "report runs/r --examples ex/classes -o dir.html --num-examples 2", 0,
                   "routing maps of 2 image files of ex/classes", out, sizeof out);
    test_expect_in(dir, bin, "report runs/r --examples nosuch.csv -o x.html", 1, "nosuch.csv: cannot open", out, sizeof out);
    // errors: each names what is wrong; a file of the user's stays as it was
    test_write_file(test_path(dir, "mine.html"), "my notes\n", 9);
    test_expect_in(dir, bin, "report runs/r -o mine.html", 1, "mine.html: the file exists and is not a vlmoe report", out,
                   sizeof out);
    char *mine = slurp(test_path(dir, "mine.html"));
    CHECK(mine && !strcmp(mine, "my notes\n"), "mine.html was changed");
    free(mine);
    test_expect_in(dir, bin, "report runs/none", 1, "runs/none: not a run folder", out, sizeof out);
    test_expect_in(dir, bin, "report", 1, "give the run folder", out, sizeof out);
    test_expect_in(dir, bin, "report runs/r --max-points 1", 1, "--max-points: 1 not in", out, sizeof out);
    test_expect_in(dir, bin, "report runs/r --num-examples 0", 1, "--num-examples: 0 not in", out, sizeof out);
    test_expect_in(dir, bin, "report runs/r --examples nosuchdir", 1, "nosuchdir", out, sizeof out);
    test_expect_in(dir, bin, "train --steps 1 --report-every -1 --logs runs", 1, "--report-every: -1 is negative", out,
                   sizeof out);
    mkdir(test_path(dir, "runs/empty"), 0755);
    test_write_file(test_path(dir, "runs/empty/metrics.jsonl"), "", 0);
    test_expect_in(dir, bin, "report runs/empty", 1, "runs/empty/metrics.jsonl: no records", out, sizeof out);

    // keys the schema does not have yet are plotted by their pattern
    mkdir(test_path(dir, "runs/g"), 0755);
    add_keys(test_path(dir, "runs/r/metrics.jsonl"), test_path(dir, "runs/g/metrics.jsonl"));
    test_expect_in(dir, bin, "report runs/g", 0, "wrote ", out, sizeof out);
    html = slurp(test_path(dir, "runs/g/report.html"));
    cJSON *d = page_data(html);
    const cJSON *eg = chart_named(d, "entropy_global per MoE layer and modality"),
                *cap = chart_named(d, "capacity per MoE layer and modality");
    CHECK(eg && cJSON_GetArraySize(cJSON_GetObjectItem(eg, "series")) == 1, "a chart of the new key entropy_global");
    CHECK(cap && cJSON_GetArraySize(cJSON_GetObjectItem(cap, "series")) == 1, "a chart of the new layer key capacity");
    if (eg) {
        const cJSON *s = cJSON_GetArrayItem(cJSON_GetObjectItem(eg, "series"), 0);
        CHECK(!strcmp(cJSON_GetObjectItem(s, "label")->valuestring, "e0.b1 image") &&
              cJSON_GetArraySize(cJSON_GetObjectItem(s, "y")) == 10 &&
              cJSON_GetArrayItem(cJSON_GetObjectItem(s, "y"), 0)->valuedouble == 0.5, "entropy_global's series");
    }
    cJSON_Delete(d), free(html);

    // 500k steps logged every 10: 50000 records, shown as 600 points; the ends exact, means between
    mkdir(test_path(dir, "runs/long"), 0755);
    FILE *f = fopen(test_path(dir, "runs/long/metrics.jsonl"), "w");
    for (long s = 10; f && s <= 500000; s += 10)
        fprintf(f, "{\"step\":%ld,\"kind\":\"train\",\"loss\":%g,\"lr\":0.001,\"time\":{\"s_per_step\":0.1,\"samples_per_s\":640}}\n",
                s, s == 500000 ? 0.125 : 3.0 - s * 1e-6);
    if (f) fclose(f);
    test_expect_in(dir, bin, "report runs/long", 0, "50000 records to step 500000", out, sizeof out);
    html = slurp(test_path(dir, "runs/long/report.html"));
    d = page_data(html);
    const cJSON *loss = chart_named(d, "Losses");
    const cJSON *ls = loss ? cJSON_GetArrayItem(cJSON_GetObjectItem(loss, "series"), 0) : NULL;
    const cJSON *x = ls ? cJSON_GetObjectItem(ls, "x") : NULL, *y = ls ? cJSON_GetObjectItem(ls, "y") : NULL;
    const int nx = x ? cJSON_GetArraySize(x) : 0;
    CHECK(nx == 600 && cJSON_GetArraySize(y) == 600, "the loss is shown as %d points", nx);
    CHECK(nx && cJSON_GetArrayItem(x, 0)->valuedouble == 10 && cJSON_GetArrayItem(x, nx - 1)->valuedouble == 500000 &&
          cJSON_GetArrayItem(y, nx - 1)->valuedouble == 0.125 && cJSON_GetObjectItem(ls, "records")->valuedouble == 50000,
          "the first and last records are kept exactly");
    for (int i = 1; nx && i < nx; i++)
        if (cJSON_GetArrayItem(x, i)->valuedouble <= cJSON_GetArrayItem(x, i - 1)->valuedouble) {
            CHECK(0, "steps not increasing at point %d", i);
            break;
        }
    cJSON_Delete(d), free(html);
    CHECK(!strstr(out, "routing maps"), "a run without checkpoint has no routing maps: %s", out);

    // the page in a browser
    char chrome[512] = "";
    FILE *p = popen("command -v chromium || command -v chromium-browser", "r");
    if (p && fgets(chrome, sizeof chrome, p)) chrome[strcspn(chrome, "\n")] = 0;
    if (p) pclose(p);
    if (!chrome[0]) {
        printf("test_report: skipped the browser checks: no chromium on PATH (Debian's chromium package; "
               "scripts/deps.sh test installs it)\n");
    } else {
        char *dom = NULL, *log = NULL, why[4096];
        int plots = 0, maps = 0;
        char page[256], shot[256];
        snprintf(page, sizeof page, "%s/page.html", dir);
        snprintf(shot, sizeof shot, "%s/shot.png", dir);
        chromium(chrome, page, shot, &dom, &log);
        const int faults = page_faults(dom, log, &plots, &maps, why, sizeof why);
        CHECK(faults == 0, "the page in Chromium: %s", why);
        CHECK(plots >= 25, "only %d plots on the page", plots);
        CHECK(maps == 4, "%d routing maps, want 4", maps);
        CHECK(dom && strstr(dom, "data-title=\"Losses\"") && strstr(dom, "data-title=\"success per MoE layer and modality\"") &&
              strstr(dom, "accepted per expert") && strstr(dom, "tokens per expert at step 20") &&
              strstr(dom, "share of text tokens per expert") && strstr(dom, "Evaluation: eval_zeroshot") &&
              strstr(dom, "<table id=\"card\">") && strstr(dom, "<table id=\"params\">") && strstr(dom, "class=\"w\""),
              "a plot or table is missing from the page");
        char *png = slurp(shot);
        CHECK(png && !memcmp(png, "\x89PNG", 4), "the screenshot %s", shot);
        free(png), free(dom), free(log);
        // the checks catch a page whose script fails: a broken "Chart.js"
        test_write_file(test_path(dir, "broken.js"), "throw new Error('boom');\n", 25);
        char args[600];
        snprintf(args, sizeof args, "report runs/r -o broken.html");
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "cd %s && VLMOE_CHARTJS=broken.js %s %s >/dev/null 2>&1", dir, bin, args);
        CHECK(system(cmd) == 0, "report with a broken script");
        snprintf(page, sizeof page, "%s/broken.html", dir);
        chromium(chrome, page, shot, &dom, &log);
        CHECK(page_faults(dom, log, &plots, &maps, why, sizeof why) > 0 && strstr(why, "boom"),
              "a page whose script fails passed the checks: %s", why);
        free(dom), free(log);
    }
    test_expect_in(dir, bin, "report runs/r -o x.html", 0, "wrote", out, sizeof out);
    {
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "cd %s && VLMOE_CHARTJS=/nonexistent/chart.js %s report runs/r -o y.html 2>&1", dir, bin);
        FILE *q = popen(cmd, "r");
        size_t k = q ? fread(out, 1, sizeof out - 1, q) : 0;
        out[k] = 0;
        const int st = q ? pclose(q) : -1;
        CHECK(st != 0 && strstr(out, "/nonexistent/chart.js") && strstr(out, "libjs-chart.js"), "no Chart.js: %s", out);
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "cleanup");
    return test_summary("test_report");
}
