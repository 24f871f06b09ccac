// readers.c: OpenCLIP CSV/TSV, webdataset tar shards (libarchive) and image-folder readers, brace
// expansion of shard lists, bad-sample accounting. Spec: ../shared/spec/MODEL.md ("Data").
// API and semantics in src/data/readers.h; covered by tests/test_readers.c.
#include "data/readers.h"

#include <archive.h>
#include <archive_entry.h>
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/core.h"

#define IMAGE_FILE_MAX ((size_t)1 << 30)   // same limit as vlmoe_image_load
#define MEMBER_MAX ((size_t)1 << 30)

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    else vlmoe_fail(VLMOE_ERR_NOMEM, "cannot allocate %zu bytes for a string", n);
    return d;
}

void vlmoe_free_strings(char **s, int n) {
    if (!s) return;
    for (int i = 0; i < n; i++) free(s[i]);
    free(s);
}

// ---- growable string list -------------------------------------------------------------------
typedef struct { char **v; int n, cap; } strlist;

static int sl_push_own(strlist *l, char *s) {   // takes ownership of s (even on failure)
    if (!s) return VLMOE_ERR_NOMEM;
    if (l->n == l->cap) {
        int nc = l->cap ? l->cap * 2 : 8;
        char **nv = realloc(l->v, (size_t)nc * sizeof *nv);
        if (!nv) { free(s); return vlmoe_fail(VLMOE_ERR_NOMEM, "cannot grow a string list"); }
        l->v = nv; l->cap = nc;
    }
    l->v[l->n++] = s;
    return VLMOE_OK;
}

static void sl_free(strlist *l) { vlmoe_free_strings(l->v, l->n); l->v = NULL; l->n = l->cap = 0; }

static char *concat3(const char *a, size_t na, const char *b, size_t nb, const char *c, size_t nc) {
    char *r = malloc(na + nb + nc + 1);
    if (!r) { vlmoe_fail(VLMOE_ERR_NOMEM, "cannot allocate an expanded pattern"); return NULL; }
    memcpy(r, a, na); memcpy(r + na, b, nb); memcpy(r + na + nb, c, nc);
    r[na + nb + nc] = 0;
    return r;
}

// ---- brace expansion --------------------------------------------------------------------------
// `whole` is the user's pattern (for messages); `s`, `len` the piece being expanded.
static int expand_piece(const char *whole, const char *s, size_t len, strlist *out);

static int parse_uint(const char *s, size_t n, long long *v) {
    if (n == 0 || n > 18) return 0;
    long long x = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isdigit((unsigned char)s[i])) return 0;
        x = x * 10 + (s[i] - '0');
    }
    *v = x;
    return 1;
}

// Alternatives of one group body (between the braces): a list or a numeric range.
static int group_alternatives(const char *whole, const char *b, size_t n, size_t at, strlist *alts) {
    int depth = 0, has_comma = 0;
    for (size_t i = 0; i < n; i++) {
        if (b[i] == '{') depth++;
        else if (b[i] == '}') depth--;
        else if (b[i] == ',' && depth == 0) has_comma = 1;
    }
    if (has_comma) {
        size_t start = 0;
        depth = 0;
        for (size_t i = 0; i <= n; i++) {
            if (i < n && b[i] == '{') depth++;
            else if (i < n && b[i] == '}') depth--;
            if (i == n || (b[i] == ',' && depth == 0)) {
                int st = expand_piece(whole, b + start, i - start, alts);
                if (st) return st;
                start = i + 1;
            }
        }
        return VLMOE_OK;
    }
    const char *dots = NULL;
    for (size_t i = 0; i + 1 < n; i++)
        if (b[i] == '.' && b[i + 1] == '.') { dots = b + i; break; }
    long long lo, hi;
    if (!dots || !parse_uint(b, (size_t)(dots - b), &lo) ||
        !parse_uint(dots + 2, n - (size_t)(dots - b) - 2, &hi))
        return vlmoe_fail(VLMOE_ERR_ARG, "shard pattern '%s': brace group '{%.*s}' at position %zu is "
                          "neither a list {a,b} nor a numeric range {N..M}", whole, (int)n, b, at);
    size_t wlo = (size_t)(dots - b), whi = n - wlo - 2;
    int pad = (wlo > 1 && b[0] == '0') || (whi > 1 && dots[2] == '0');
    int width = pad ? (int)(wlo > whi ? wlo : whi) : 0;
    long long count = (hi >= lo ? hi - lo : lo - hi) + 1;
    if (count > VLMOE_BRACE_MAX)
        return vlmoe_fail(VLMOE_ERR_ARG, "shard pattern '%s': range '{%.*s}' has %lld values, more "
                          "than the limit %d", whole, (int)n, b, count, VLMOE_BRACE_MAX);
    long long step = hi >= lo ? 1 : -1;
    for (long long v = lo;; v += step) {
        char buf[32];
        snprintf(buf, sizeof buf, "%0*lld", width, v);
        int st = sl_push_own(alts, dup_str(buf));
        if (st) return st;
        if (v == hi) break;
    }
    return VLMOE_OK;
}

static int expand_piece(const char *whole, const char *s, size_t len, strlist *out) {
    size_t at = (size_t)(s - whole);
    size_t open = len;
    for (size_t i = 0; i < len; i++) {
        if (s[i] == '}')
            return vlmoe_fail(VLMOE_ERR_ARG, "shard pattern '%s': unmatched '}' at position %zu",
                              whole, at + i);
        if (s[i] == '{') { open = i; break; }
    }
    if (open == len) return sl_push_own(out, concat3(s, len, "", 0, "", 0));
    int depth = 0;
    size_t close = len;
    for (size_t i = open; i < len; i++) {
        if (s[i] == '{') depth++;
        else if (s[i] == '}' && --depth == 0) { close = i; break; }
    }
    if (close == len)
        return vlmoe_fail(VLMOE_ERR_ARG, "shard pattern '%s': unmatched '{' at position %zu",
                          whole, at + open);
    if (close == open + 1)
        return vlmoe_fail(VLMOE_ERR_ARG, "shard pattern '%s': empty brace group '{}' at position %zu",
                          whole, at + open);
    strlist alts = {0}, rest = {0};
    int st = group_alternatives(whole, s + open + 1, close - open - 1, at + open, &alts);
    if (!st) st = expand_piece(whole, s + close + 1, len - close - 1, &rest);
    if (!st && (long long)alts.n * rest.n + out->n > VLMOE_BRACE_MAX)
        st = vlmoe_fail(VLMOE_ERR_ARG, "shard pattern '%s' expands to more than %d names", whole,
                        VLMOE_BRACE_MAX);
    for (int a = 0; !st && a < alts.n; a++)
        for (int r = 0; !st && r < rest.n; r++)
            st = sl_push_own(out, concat3(s, open, alts.v[a], strlen(alts.v[a]), rest.v[r],
                                          strlen(rest.v[r])));
    sl_free(&alts);
    sl_free(&rest);
    return st;
}

int vlmoe_expand_braces(const char *pattern, char ***out, int *n) {
    if (!pattern || !out || !n) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_expand_braces: NULL argument");
    *out = NULL; *n = 0;
    strlist l = {0};
    const char *p = pattern;
    int st = VLMOE_OK;
    for (;;) {
        const char *sep = strstr(p, "::");
        size_t len = sep ? (size_t)(sep - p) : strlen(p);
        if (len == 0) {
            st = vlmoe_fail(VLMOE_ERR_ARG, "shard pattern '%s': empty pattern at position %zu "
                            "(patterns are separated by '::')", pattern, (size_t)(p - pattern));
            break;
        }
        st = expand_piece(pattern, p, len, &l);
        if (st || !sep) break;
        p = sep + 2;
    }
    if (st) { sl_free(&l); return st; }
    *out = l.v; *n = l.n;
    return VLMOE_OK;
}

// ---- bad-sample accounting ------------------------------------------------------------------
static const char *bad_names[VLMOE_BAD_N] = {
    "missing_column", "empty_caption", "unreadable_image", "no_partner", "truncated_shard",
    "malformed_row", "undecodable_image", "failed_command",
};

const char *vlmoe_bad_reason_name(int r) {
    return r >= 0 && r < VLMOE_BAD_N ? bad_names[r] : "unknown";
}

int64_t vlmoe_dataset_stats_bad(const vlmoe_dataset_stats *s) {
    int64_t b = 0;
    for (int i = 0; i < VLMOE_BAD_N; i++) b += s->bad[i];
    return b;
}

void vlmoe_dataset_stats_add_bad(vlmoe_dataset_stats *s, int reason, const char *fmt, ...) {
    s->total++;
    s->bad[reason]++;
    if (s->n_msgs < VLMOE_BAD_MSGS) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(s->msgs[s->n_msgs++], VLMOE_BAD_MSG_LEN, fmt, ap);
        va_end(ap);
    }
}

void vlmoe_dataset_stats_merge(vlmoe_dataset_stats *dst, const vlmoe_dataset_stats *src) {
    dst->total += src->total;
    for (int i = 0; i < VLMOE_BAD_N; i++) dst->bad[i] += src->bad[i];
    for (int i = 0; i < src->n_msgs && dst->n_msgs < VLMOE_BAD_MSGS; i++)
        memcpy(dst->msgs[dst->n_msgs++], src->msgs[i], VLMOE_BAD_MSG_LEN);
}

// snprintf-append that never overruns and keeps counting the wanted length.
static void app(char *buf, size_t cap, size_t *len, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
static void app(char *buf, size_t cap, size_t *len, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(*len < cap ? buf + *len : NULL, *len < cap ? cap - *len : 0, fmt, ap);
    va_end(ap);
    if (k > 0) *len += (size_t)k;
}

int vlmoe_dataset_stats_format(const vlmoe_dataset_stats *s, char *buf, size_t cap) {
    size_t len = 0;
    if (cap) buf[0] = 0;
    int64_t bad = vlmoe_dataset_stats_bad(s);
    app(buf, cap, &len, "bad samples: %lld of %lld (%.1f%%)", (long long)bad, (long long)s->total,
        s->total ? 100.0 * (double)bad / (double)s->total : 0.0);
    const char *sep = ": ";
    for (int i = 0; i < VLMOE_BAD_N; i++) {
        if (!s->bad[i]) continue;
        app(buf, cap, &len, "%s%s %lld", sep, bad_names[i], (long long)s->bad[i]);
        sep = ", ";
    }
    for (int i = 0; i < s->n_msgs; i++)
        app(buf, cap, &len, "%s%s", i ? "; " : "; first: ", s->msgs[i]);
    return (int)len;
}

int vlmoe_dataset_check_bad(const vlmoe_dataset_stats *s, double max_fraction) {
    if (!s) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_dataset_check_bad: NULL stats");
    int64_t bad = vlmoe_dataset_stats_bad(s);
    if (s->total == 0 || (double)bad <= max_fraction * (double)s->total) return VLMOE_OK;
    char summary[1024 + VLMOE_BAD_MSGS * VLMOE_BAD_MSG_LEN];
    vlmoe_dataset_stats_format(s, summary, sizeof summary);
    return vlmoe_fail(VLMOE_ERR_FORMAT, "too many bad samples (limit %.2f%% of samples): %s",
                      100.0 * max_fraction, summary);
}

// ---- dataset --------------------------------------------------------------------------------
struct vlmoe_dataset {
    vlmoe_dataset_type type;
    vlmoe_dataset_stats stats;
    uint8_t *img; size_t img_len, img_cap;     // current sample's image bytes
    char *cap; size_t cap_len, cap_cap;        // current caption
    char *key; size_t key_cap;
    char ext[16];
    // CSV
    char *csv_path, *csv_dir;   // csv_dir NULL: the CSV is in the working directory
    vlmoe_note_fn note;
    void *note_user;
    int noted;                  // the note on CSV-folder paths was given
    char sep;
    FILE *f;
    long data_off;              // file offset of the first data row
    int64_t data_line, line;    // line of the first data row; line being read
    int defer;                  // defer_images: paths only, image files are not opened
    int64_t row;                // index of the next data row
    int img_col, cap_col;
    char *rec; size_t rec_len, rec_cap;        // fields of the current row, NUL-separated
    size_t *fld; int nfld, fld_cap;
    int rec_unterminated;
    char *pathbuf; size_t pathbuf_cap;
    // webdataset
    char **shards; int n_shards;
    int shard;                  // current shard
    struct archive *a;          // open archive of `shard`, or NULL
    int64_t member;             // headers read from `a`
    int pending;                // a header was read but belongs to the next sample
    char *pname; size_t pname_cap;             // pending member's path
    FILE *pipe;                 // "pipe:" shard: the command's stdout, which `a` reads
    FILE *shard_f;              // the shard file (opened as a regular file only), or NULL
};

static int grow(void *pp, size_t *cap, size_t need, size_t elem, const char *what) {
    if (need <= *cap) return VLMOE_OK;
    size_t nc = *cap ? *cap : 64;
    while (nc < need) {
        if (nc > SIZE_MAX / 2) return vlmoe_fail(VLMOE_ERR_NOMEM, "%s too large", what);
        nc *= 2;
    }
    size_t bytes;
    if (vlmoe_mul_ok(nc, elem, &bytes)) return vlmoe_fail(VLMOE_ERR_NOMEM, "%s too large", what);
    void *np = realloc(*(void **)pp, bytes);
    if (!np) return vlmoe_fail(VLMOE_ERR_NOMEM, "cannot allocate %zu bytes for %s", bytes, what);
    *(void **)pp = np;
    *cap = nc;
    return VLMOE_OK;
}

static int set_str(char **buf, size_t *cap, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static int set_str(char **buf, size_t *cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (k < 0) return vlmoe_fail(VLMOE_ERR_ARG, "bad format");
    int st = grow(buf, cap, (size_t)k + 1, 1, "a string");
    if (st) return st;
    va_start(ap, fmt);
    vsnprintf(*buf, *cap, fmt, ap);
    va_end(ap);
    return VLMOE_OK;
}

static int ends_with(const char *s, const char *suf) {
    size_t n = strlen(s), k = strlen(suf);
    if (k > n) return 0;
    for (size_t i = 0; i < k; i++)
        if (tolower((unsigned char)s[n - k + i]) != suf[i]) return 0;
    return 1;
}

vlmoe_dataset_params vlmoe_dataset_default_params(void) {
    vlmoe_dataset_params p = {VLMOE_DATASET_AUTO, NULL, '\t', "filepath", "title", 0, NULL, NULL};
    return p;
}

// Trims ASCII whitespace in place; returns the new start.
static char *trim(char *s, size_t *len) {
    size_t b = 0, e = *len;
    while (b < e && isspace((unsigned char)s[b])) b++;
    while (e > b && isspace((unsigned char)s[e - 1])) e--;
    s[e] = 0;
    *len = e - b;
    return s + b;
}

static int set_caption(vlmoe_dataset *ds, const char *src, size_t n) {
    int st = grow(&ds->cap, &ds->cap_cap, n + 1, 1, "a caption");
    if (st) return st;
    memcpy(ds->cap, src, n);
    ds->cap[n] = 0;
    size_t len = n;
    char *t = trim(ds->cap, &len);
    memmove(ds->cap, t, len + 1);
    ds->cap_len = len;
    return VLMOE_OK;
}

// ---- CSV ------------------------------------------------------------------------------------
static int rec_putc(vlmoe_dataset *ds, char c) {
    if (ds->rec_len + 1 > ds->rec_cap) {
        int st = grow(&ds->rec, &ds->rec_cap, ds->rec_len + 1, 1, "a CSV row");
        if (st) return st;
    }
    ds->rec[ds->rec_len++] = c;
    return VLMOE_OK;
}

static int rec_field(vlmoe_dataset *ds) {
    if (ds->nfld == ds->fld_cap) {
        size_t cap = (size_t)ds->fld_cap;
        int st = grow(&ds->fld, &cap, cap + 1, sizeof(size_t), "CSV fields");
        if (st) return st;
        ds->fld_cap = (int)cap;
    }
    ds->fld[ds->nfld++] = ds->rec_len;
    return VLMOE_OK;
}

// Reads one RFC 4180 record: fields NUL-terminated in ds->rec at ds->fld[i]. Quoted fields may
// hold separators, newlines and doubled quotes; characters after a closing quote are kept
// (lenient, like Python's csv). "\r\n" line ends are accepted. Blank lines are skipped (as
// pandas does). Returns 1 record, 0 end of file, or minus a status (read error, no memory; message
// set): a positive status would read as "1 record". *start_line gets its line.
static int csv_read_record(vlmoe_dataset *ds, int64_t *start_line) {
    FILE *f = ds->f;
    for (;;) {
        ds->rec_len = 0;
        ds->nfld = 0;
        ds->rec_unterminated = 0;
        *start_line = ds->line;
        int c = getc(f), st, any_quoted = 0;
        if (c == EOF) break;
        for (;;) {   // one field per iteration; c is its first character
            if ((st = rec_field(ds))) return -st;
            if (c == '"') {
                any_quoted = 1;
                for (;;) {
                    c = getc(f);
                    if (c == EOF) { ds->rec_unterminated = 1; break; }
                    if (c == '"') {
                        c = getc(f);
                        if (c != '"') break;
                    } else if (c == '\n') {
                        ds->line++;
                    }
                    if ((st = rec_putc(ds, (char)c))) return -st;
                }
            }
            while (c != EOF && c != '\n' && c != ds->sep) {
                if (c != '\r' && (st = rec_putc(ds, (char)c))) return -st;
                c = getc(f);
            }
            if ((st = rec_putc(ds, 0))) return -st;
            if (c == ds->sep) { c = getc(f); continue; }
            break;
        }
        if (c == '\n') ds->line++;
        if (ds->nfld == 1 && ds->rec[0] == 0 && !any_quoted) {
            if (c == EOF) break;
            continue;   // blank line
        }
        return 1;
    }
    if (ferror(f)) return -vlmoe_fail(VLMOE_ERR_IO, "%s: read error: %s", ds->csv_path, strerror(errno));
    return 0;
}

// Reads a whole file into ds->img. 0 ok; else a message in why.
static int read_image_file(vlmoe_dataset *ds, const char *path, char *why, size_t why_cap) {
    const char *no;
    FILE *f = vlmoe_fopen_regular(path, &no);
    if (!f) { snprintf(why, why_cap, "%s", no); return 1; }
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        snprintf(why, why_cap, "not a regular file");
        fclose(f);
        return 1;
    }
    if (sb.st_size == 0 || (size_t)sb.st_size > IMAGE_FILE_MAX) {
        snprintf(why, why_cap, "size %lld bytes (expected 1 .. %zu)", (long long)sb.st_size,
                 IMAGE_FILE_MAX);
        fclose(f);
        return 1;
    }
    size_t n = (size_t)sb.st_size;
    if (grow(&ds->img, &ds->img_cap, n, 1, "an image file")) {
        snprintf(why, why_cap, "%s", vlmoe_last_error());
        fclose(f);
        return 1;
    }
    size_t got = fread(ds->img, 1, n, f);
    int err = ferror(f);
    fclose(f);
    if (got != n || err) { snprintf(why, why_cap, "short read (%zu of %zu bytes)", got, n); return 1; }
    ds->img_len = n;
    return 0;
}

static void path_ext(const char *path, char *ext, size_t cap) {
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    const char *dot = strrchr(base, '.');
    size_t i = 0;
    if (dot)
        for (dot++; *dot && i + 1 < cap; dot++) ext[i++] = (char)tolower((unsigned char)*dot);
    ext[i] = 0;
}

int vlmoe_csv_dir(const char *csv_path, char **dir) {
    *dir = NULL;
    const char *slash = strrchr(csv_path, '/');
    if (!slash || (slash - csv_path == 1 && csv_path[0] == '.')) return VLMOE_OK;   // "x.csv", "./x.csv"
    *dir = concat3(csv_path, slash == csv_path ? 1 : (size_t)(slash - csv_path), "", 0, "", 0);
    return *dir ? VLMOE_OK : VLMOE_ERR_NOMEM;
}

int vlmoe_csv_image_path(const char *csv_dir, const char *image, char *buf, size_t cap) {
    int n = snprintf(buf, cap, "%s", image);
    if (n < 0 || (size_t)n >= cap) return vlmoe_fail(VLMOE_ERR_ARG, "image path %.200s...: longer than %zu bytes", image, cap), -1;
    // one failed open more per image in the CSV-folder case, none in OpenCLIP's
    if (!csv_dir || image[0] == '/' || access(image, F_OK) == 0) return 0;
    const char *sep = strcmp(csv_dir, "/") ? "/" : "";
    n = snprintf(buf, cap, "%s%s%s", csv_dir, sep, image);
    if (n < 0 || (size_t)n >= cap) return vlmoe_fail(VLMOE_ERR_ARG, "image path %s/%.200s...: longer than %zu bytes", csv_dir, image, cap), -1;
    if (access(buf, F_OK) == 0) return 1;
    snprintf(buf, cap, "%s", image);
    return 0;
}

// The note given once when a CSV's image paths are read relative to its folder.
static void csv_dir_note(char *msg, size_t cap, const char *csv, const char *csv_dir, const char *image) {
    snprintf(msg, cap, "%s: note: image paths are read relative to the CSV file's folder %s/: %s is not "
             "in the working directory (where OpenCLIP looks) but %s/%s is; so is every path found only there",
             csv, csv_dir, image, csv_dir, image);
}

static int csv_next(vlmoe_dataset *ds, vlmoe_sample *s) {
    for (;;) {
        int64_t line;
        int r = csv_read_record(ds, &line);
        if (r <= 0) return r;
        ds->row++;
        if (ds->rec_unterminated) {
            vlmoe_dataset_stats_add_bad(&ds->stats, VLMOE_BAD_MALFORMED_ROW,
                    "%s:%lld: quoted field never closed", ds->csv_path, (long long)line);
            continue;
        }
        int need = (ds->img_col > ds->cap_col ? ds->img_col : ds->cap_col) + 1;
        if (ds->nfld < need) {
            vlmoe_dataset_stats_add_bad(&ds->stats, VLMOE_BAD_MISSING_COLUMN,
                    "%s:%lld: row has %d field%s, the %s column needs %d", ds->csv_path,
                    (long long)line, ds->nfld, ds->nfld == 1 ? "" : "s",
                    ds->img_col >= ds->nfld ? "image" : "caption", need);
            continue;
        }
        const char *capf = ds->rec + ds->fld[ds->cap_col];
        int st = set_caption(ds, capf, strlen(capf));
        if (st) return -st;
        if (ds->cap_len == 0) {
            vlmoe_dataset_stats_add_bad(&ds->stats, VLMOE_BAD_EMPTY_CAPTION, "%s:%lld: empty caption",
                    ds->csv_path, (long long)line);
            continue;
        }
        const char *ip = ds->rec + ds->fld[ds->img_col];
        char why[200];
        if (!*ip) {
            vlmoe_dataset_stats_add_bad(&ds->stats, VLMOE_BAD_UNREADABLE_IMAGE,
                    "%s:%lld: empty image path", ds->csv_path, (long long)line);
            continue;
        }
        // as written when deferred (the caller resolves it), else the file vlmoe_csv_image_path picks
        size_t plen = strlen(ip) + (ds->csv_dir ? strlen(ds->csv_dir) : 0) + 2;
        if ((st = grow(&ds->pathbuf, &ds->pathbuf_cap, plen, 1, "an image path"))) return -st;
        const int alt = ds->defer ? (snprintf(ds->pathbuf, plen, "%s", ip), 0)
                                  : vlmoe_csv_image_path(ds->csv_dir, ip, ds->pathbuf, plen);
        if (alt < 0) return -VLMOE_ERR_ARG;
        if (!ds->defer && read_image_file(ds, ds->pathbuf, why, sizeof why)) {
            const int both = !alt && ds->csv_dir && ip[0] != '/';   // looked in the CSV's folder too
            vlmoe_dataset_stats_add_bad(&ds->stats, VLMOE_BAD_UNREADABLE_IMAGE, "%s:%lld: image %s: %s%s%s%s",
                    ds->csv_path, (long long)line, ds->pathbuf, why, both ? " (nor in the CSV's folder: " : "",
                    both ? ds->csv_dir : "", both ? "/)" : "");
            continue;
        }
        if (alt == 1 && !ds->noted++ && ds->note) {
            char msg[1024];
            csv_dir_note(msg, sizeof msg, ds->csv_path, ds->csv_dir, ip);
            ds->note(ds->note_user, msg);
        }
        if ((st = set_str(&ds->key, &ds->key_cap, "%s:%lld", ds->csv_path, (long long)line))) return -st;
        path_ext(ds->pathbuf, ds->ext, sizeof ds->ext);
        ds->stats.total++;
        s->image = ds->defer ? NULL : ds->img; s->image_len = ds->defer ? 0 : ds->img_len;
        s->image_path = ds->pathbuf; s->image_ext = ds->ext;
        s->caption = ds->cap; s->key = ds->key;
        return 1;
    }
}

static int csv_open(vlmoe_dataset *ds, const vlmoe_dataset_params *p) {
    ds->sep = p->separator;
    ds->defer = p->defer_images;
    if (ds->sep == '"' || ds->sep == '\n' || ds->sep == '\r' || ds->sep == 0)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: CSV separator must be one character other than a "
                          "quote or a line end", p->path);
    if (!(ds->csv_path = dup_str(p->path))) return VLMOE_ERR_NOMEM;
    ds->note = p->note, ds->note_user = p->note_user;
    if (vlmoe_csv_dir(p->path, &ds->csv_dir)) return VLMOE_ERR_NOMEM;
    const char *why;
    ds->f = vlmoe_fopen_regular(p->path, &why);
    if (!ds->f) return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot open CSV file: %s", p->path, why);
    ds->line = 1;
    int64_t line;
    int r = csv_read_record(ds, &line);
    if (r < 0) return -r;
    if (r == 0) return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: empty CSV file (no header row)", p->path);
    // A UTF-8 byte-order mark before the first column name is not part of it.
    if ((unsigned char)ds->rec[0] == 0xEF && (unsigned char)ds->rec[1] == 0xBB &&
        (unsigned char)ds->rec[2] == 0xBF)
        ds->fld[0] += 3;
    ds->img_col = ds->cap_col = -1;
    for (int i = 0; i < ds->nfld; i++) {
        const char *name = ds->rec + ds->fld[i];
        if (ds->img_col < 0 && strcmp(name, p->img_key) == 0) ds->img_col = i;
        if (ds->cap_col < 0 && strcmp(name, p->caption_key) == 0) ds->cap_col = i;
    }
    if (ds->img_col < 0 || ds->cap_col < 0) {
        char cols[512];
        size_t len = 0;
        cols[0] = 0;
        for (int i = 0; i < ds->nfld; i++)
            app(cols, sizeof cols, &len, "%s'%s'", i ? ", " : "", ds->rec + ds->fld[i]);
        int miss_img = ds->img_col < 0;
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: no column '%s' (%s) in the header; its columns "
                          "(separator '%s%c'): %s", p->path, miss_img ? p->img_key : p->caption_key,
                          miss_img ? "--csv-img-key" : "--csv-caption-key",
                          ds->sep == '\t' ? "\\" : "", ds->sep == '\t' ? 't' : ds->sep, cols);
    }
    ds->data_off = ftell(ds->f);
    if (ds->data_off < 0) return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot tell position: %s", p->path,
                                            strerror(errno));
    ds->data_line = ds->line;
    ds->row = 0;
    return VLMOE_OK;
}

static int csv_seek(vlmoe_dataset *ds, int64_t item) {
    if (fseek(ds->f, ds->data_off, SEEK_SET) != 0)
        return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot seek: %s", ds->csv_path, strerror(errno));
    clearerr(ds->f);
    ds->line = ds->data_line;
    ds->row = 0;
    while (ds->row < item) {
        int64_t line;
        int r = csv_read_record(ds, &line);
        if (r < 0) return -r;
        if (r == 0)
            return vlmoe_fail(VLMOE_ERR_ARG, "%s: cannot seek to row %lld: the file has %lld data rows",
                              ds->csv_path, (long long)item, (long long)ds->row);
        ds->row++;
    }
    return VLMOE_OK;
}

// ---- webdataset -----------------------------------------------------------------------------
static int is_pipe(const char *shard) { return !strncmp(shard, "pipe:", 5); }

// Closes a "pipe:" shard's command and returns its wait status. drain: read its output to the
// end first, so that a command that is done is not killed by SIGPIPE while writing what follows
// the tar's end (padding); without it, a command still running is stopped.
static int pipe_close(vlmoe_dataset *ds, int drain) {
    char buf[1 << 14];
    while (drain && fread(buf, 1, sizeof buf, ds->pipe) > 0) {}
    const int w = pclose(ds->pipe);
    ds->pipe = NULL;
    return w;
}

// "exited with status 2", "was killed by signal 9" (of a wait status that is not a success).
static void wait_text(int w, char *buf, size_t cap) {
    if (w == -1) snprintf(buf, cap, "could not be waited for: %s", strerror(errno));
    else if (WIFEXITED(w) && WEXITSTATUS(w) == 127) snprintf(buf, cap, "exited with status 127 (/bin/sh could not run it: not found?)");
    else if (WIFEXITED(w)) snprintf(buf, cap, "exited with status %d", WEXITSTATUS(w));
    else if (WIFSIGNALED(w)) snprintf(buf, cap, "was killed by signal %d", WTERMSIG(w));
    else snprintf(buf, cap, "ended with wait status %d", w);
}

// Closes the shard's archive (and its command, stopped if still running).
static void wds_close(vlmoe_dataset *ds) {
    if (ds->a) archive_read_free(ds->a);
    if (ds->pipe) pipe_close(ds, 0);
    if (ds->shard_f) fclose(ds->shard_f);
    ds->shard_f = NULL;
    ds->a = NULL;
    ds->member = 0;
    ds->pending = 0;
}

static int wds_open_shard(vlmoe_dataset *ds) {
    wds_close(ds);
    const char *name = ds->shards[ds->shard];
    ds->a = archive_read_new();
    if (!ds->a) return vlmoe_fail(VLMOE_ERR_NOMEM, "cannot allocate a libarchive reader");
    archive_read_support_filter_all(ds->a);
    archive_read_support_format_tar(ds->a);
    if (is_pipe(name)) {
        // webdataset's pipe: URL: the command's stdout is the tar stream, read once front to back
        if (!(ds->pipe = popen(name + 5, "r")))
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: the command could not be started: %s", name, strerror(errno));
        if (archive_read_open_FILE(ds->a, ds->pipe) != ARCHIVE_OK)
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: %s", name,
                              archive_error_string(ds->a) ? archive_error_string(ds->a) : "cannot read its output");
        return VLMOE_OK;
    }
    const char *why;
    if (!(ds->shard_f = vlmoe_fopen_regular(name, &why)))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: cannot open shard: %s", name, why);
    if (archive_read_open_FILE(ds->a, ds->shard_f) != ARCHIVE_OK)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: %s", name,
                          archive_error_string(ds->a) ? archive_error_string(ds->a) : "cannot open");
    return VLMOE_OK;
}

// The shard is read to its end: a "pipe:" command that failed counts as a bad sample, the
// samples it gave are kept. Moves to the next shard.
static void wds_end_shard(vlmoe_dataset *ds) {
    if (ds->pipe) {
        const int w = pipe_close(ds, 1);
        char why[96];
        wait_text(w, why, sizeof why);
        if (w) vlmoe_dataset_stats_add_bad(&ds->stats, VLMOE_BAD_FAILED_COMMAND, "%s: the command %s",
                                           ds->shards[ds->shard], why);
    }
    wds_close(ds);
    ds->shard++;
}

// The next header into ds->pname. 1 header, 0 end of archive, or minus a status (libarchive error,
// no memory; message set).
static int wds_header(vlmoe_dataset *ds) {
    struct archive_entry *e;
    int r = archive_read_next_header(ds->a, &e);
    // libarchive ends a tar stream that stops exactly after a member as if it were complete; only
    // the end-of-archive blocks tell them apart: they were read when the stream's position is past
    // the end of the last member (libarchive reads them without counting them as a member).
    if (r == ARCHIVE_EOF && archive_filter_bytes(ds->a, 0) <= archive_read_header_position(ds->a))
        return -vlmoe_fail(VLMOE_ERR_FORMAT, "%s: truncated: the shard ends after member %lld without the tar "
                           "end-of-archive blocks (a copy or download cut short?)", ds->shards[ds->shard],
                           (long long)ds->member);
    if (r == ARCHIVE_EOF) return 0;
    if (r != ARCHIVE_OK && r != ARCHIVE_WARN)   // ARCHIVE_RETRY too: no valid entry (damaged header)
        return -vlmoe_fail(VLMOE_ERR_FORMAT, "%s: after member %lld: %s", ds->shards[ds->shard],
                          (long long)ds->member, archive_error_string(ds->a) ?
                          archive_error_string(ds->a) : "libarchive error");
    ds->member++;
    const char *name = archive_entry_pathname(e);
    int st = set_str(&ds->pname, &ds->pname_cap, "%s", name ? name : "");
    if (st) return -st;
    // Directories and special files take part in no sample: an empty name marks them.
    if (archive_entry_filetype(e) != AE_IFREG) ds->pname[0] = 0;
    return 1;
}

// webdataset's key/suffix split: key = path up to the first '.' of the final component.
static size_t key_len(const char *name, const char **suffix) {
    const char *slash = strrchr(name, '/');
    const char *base = slash ? slash + 1 : name;
    const char *dot = strchr(base, '.');
    *suffix = dot ? dot + 1 : NULL;
    return dot ? (size_t)(dot - name) : strlen(name);
}

static int is_image_ext(const char *e) {
    return !strcmp(e, "jpg") || !strcmp(e, "jpeg") || !strcmp(e, "png") || !strcmp(e, "webp");
}

// Reads the current member's data into *buf. 0 ok, else a status (message set).
static int wds_read_data(vlmoe_dataset *ds, uint8_t **buf, size_t *cap, size_t *len) {
    *len = 0;
    for (;;) {
        if (*len == *cap) {
            int st = grow(buf, cap, *len + 65536, 1, "a shard member");
            if (st) return st;
        }
        la_ssize_t k = archive_read_data(ds->a, *buf + *len, *cap - *len);
        if (k < 0)
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: member %lld (%s): %s", ds->shards[ds->shard],
                              (long long)ds->member - 1, ds->pname, archive_error_string(ds->a) ?
                              archive_error_string(ds->a) : "read error");
        if (k == 0) return VLMOE_OK;
        *len += (size_t)k;
        if (*len > MEMBER_MAX)
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: member %s larger than %zu bytes",
                              ds->shards[ds->shard], ds->pname, MEMBER_MAX);
    }
}

// A shard that cannot be read on (its last error is the thread's message): one bad sample; the
// rest of the shard is skipped. A "pipe:" command that failed is named as the cause (it is not
// drained: a stream that is not a tar could be long; one stopped here dies of SIGPIPE, no failure).
static void wds_bad_shard(vlmoe_dataset *ds) {
    int w = 0;
    if (ds->pipe) {
        if (ds->a) archive_read_free(ds->a);
        ds->a = NULL;
        w = pipe_close(ds, 0);
        if (w != -1 && WIFSIGNALED(w) && WTERMSIG(w) == SIGPIPE) w = 0;
    }
    if (w) {
        char why[96];
        wait_text(w, why, sizeof why);
        vlmoe_dataset_stats_add_bad(&ds->stats, VLMOE_BAD_FAILED_COMMAND, "%s: the command %s (%s)",
                                    ds->shards[ds->shard], why, vlmoe_last_error());
    } else {
        vlmoe_dataset_stats_add_bad(&ds->stats, VLMOE_BAD_TRUNCATED_SHARD, "%s (rest of shard skipped)", vlmoe_last_error());
    }
    wds_close(ds);
    ds->shard++;
}

static int wds_next(vlmoe_dataset *ds, vlmoe_sample *s) {
    for (;;) {
        if (!ds->a) {
            if (ds->shard >= ds->n_shards) return 0;
            int st = wds_open_shard(ds);
            if (st == VLMOE_ERR_NOMEM) return -st;
            if (st) { wds_bad_shard(ds); continue; }
        }
        if (!ds->pending) {
            int r = wds_header(ds);
            if (r == -VLMOE_ERR_NOMEM) return r;
            if (r < 0) { wds_bad_shard(ds); continue; }
            if (r == 0) { wds_end_shard(ds); continue; }
        }
        ds->pending = 0;
        if (!ds->pname[0]) continue;   // not a regular file
        const char *suf;
        size_t kl = key_len(ds->pname, &suf);
        int st = set_str(&ds->key, &ds->key_cap, "%s:%.*s", ds->shards[ds->shard], (int)kl, ds->pname);
        if (st) return -st;
        size_t kstart = strlen(ds->shards[ds->shard]) + 1;   // the key inside ds->key
        int have_img = 0, have_txt = 0, eof = 0, failed = 0;
        for (;;) {   // members of this key; ds->pname is the current one
            char ext[16];
            path_ext(ds->pname, ext, sizeof ext);
            // Only the final suffix decides (webdataset's "a.b.jpg" has suffix "b.jpg"; we
            // accept any suffix ending in an image/text extension, as decoders do).
            if (suf && !have_img && is_image_ext(ext)) {
                st = wds_read_data(ds, &ds->img, &ds->img_cap, &ds->img_len);
                if (st == VLMOE_ERR_NOMEM) return -st;
                if (st) { failed = 1; break; }
                memcpy(ds->ext, ext, sizeof ext);
                have_img = 1;
            } else if (suf && !have_txt && !strcmp(ext, "txt")) {
                uint8_t *tb = (uint8_t *)ds->cap;
                size_t tl = 0;
                st = wds_read_data(ds, &tb, &ds->cap_cap, &tl);
                ds->cap = (char *)tb;
                if (st == VLMOE_ERR_NOMEM) return -st;
                if (st) { failed = 1; break; }
                if ((st = grow(&ds->cap, &ds->cap_cap, tl + 1, 1, "a caption"))) return -st;
                ds->cap[tl] = 0;
                size_t len = strlen(ds->cap);   // a NUL byte ends the caption, as in a CSV field
                char *t = trim(ds->cap, &len);
                memmove(ds->cap, t, len + 1);
                ds->cap_len = len;
                have_txt = 1;
            }
            int r = wds_header(ds);
            if (r == -VLMOE_ERR_NOMEM) return r;
            if (r < 0) { failed = 1; break; }
            if (r == 0) { eof = 1; break; }
            const char *suf2;
            size_t kl2 = key_len(ds->pname, &suf2);
            if (!ds->pname[0] || kl2 != kl || memcmp(ds->pname, ds->key + kstart, kl) != 0) {
                ds->pending = 1;
                break;
            }
            suf = suf2;
        }
        if (failed) { wds_bad_shard(ds); continue; }
        if (eof) wds_end_shard(ds);
        if (!have_img && !have_txt) continue;   // e.g. only .json/.cls members: not a sample
        if (!have_img || !have_txt) {
            vlmoe_dataset_stats_add_bad(&ds->stats, VLMOE_BAD_NO_PARTNER, "%s: %s without %s", ds->key,
                    have_img ? "image" : "caption", have_img ? "a .txt caption" : "an image");
            continue;
        }
        if (ds->cap_len == 0) {
            vlmoe_dataset_stats_add_bad(&ds->stats, VLMOE_BAD_EMPTY_CAPTION, "%s: empty caption", ds->key);
            continue;
        }
        if (ds->img_len == 0) {   // samples promise image_len > 0, as for CSV
            vlmoe_dataset_stats_add_bad(&ds->stats, VLMOE_BAD_UNREADABLE_IMAGE, "%s: empty .%s member", ds->key, ds->ext);
            continue;
        }
        ds->stats.total++;
        s->image = ds->img; s->image_len = ds->img_len; s->image_path = NULL; s->image_ext = ds->ext;
        s->caption = ds->cap; s->key = ds->key;
        return 1;
    }
}

static int wds_seek(vlmoe_dataset *ds, vlmoe_dataset_pos pos) {
    wds_close(ds);
    if (pos.shard < 0 || pos.shard > ds->n_shards || pos.item < 0 ||
        (pos.shard == ds->n_shards && pos.item != 0))
        return vlmoe_fail(VLMOE_ERR_ARG, "cannot seek to shard %lld member %lld: %d shards",
                          (long long)pos.shard, (long long)pos.item, ds->n_shards);
    ds->shard = (int)pos.shard;
    if (pos.item == 0) return VLMOE_OK;
    int st = wds_open_shard(ds);
    while (!st && ds->member < pos.item) {
        int r = wds_header(ds);
        if (r < 0) st = -r;
        else if (r == 0)
            st = vlmoe_fail(VLMOE_ERR_ARG, "%s: cannot seek to member %lld: the shard has %lld",
                            ds->shards[ds->shard], (long long)pos.item, (long long)ds->member);
    }
    if (st) { wds_close(ds); ds->shard = 0; }
    return st;
}

// ---- dataset API ----------------------------------------------------------------------------
int vlmoe_dataset_open(const vlmoe_dataset_params *p, vlmoe_dataset **out) {
    if (!p || !out || !p->path || !p->img_key || !p->caption_key)
        return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_dataset_open: NULL argument");
    *out = NULL;
    vlmoe_dataset_type t = p->type;
    if (t == VLMOE_DATASET_AUTO) {
        if (ends_with(p->path, ".csv") || ends_with(p->path, ".tsv")) t = VLMOE_DATASET_CSV;
        else if (ends_with(p->path, ".tar") || ends_with(p->path, ".tar.gz") ||
                 ends_with(p->path, ".tgz") || strchr(p->path, '{') || strstr(p->path, "::") ||
                 is_pipe(p->path))
            t = VLMOE_DATASET_WEBDATASET;
        else
            return vlmoe_fail(VLMOE_ERR_ARG, "%s: cannot tell the dataset type from the name "
                              "(.csv/.tsv or .tar/.tar.gz/shard pattern); give --dataset-type "
                              "csv or webdataset", p->path);
    }
    if (t != VLMOE_DATASET_CSV && t != VLMOE_DATASET_WEBDATASET)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: unknown dataset type %d", p->path, (int)t);
    vlmoe_dataset *ds = calloc(1, sizeof *ds);
    if (!ds) return vlmoe_fail(VLMOE_ERR_NOMEM, "cannot allocate a dataset");
    ds->type = t;
    int st;
    if (t == VLMOE_DATASET_CSV) {
        st = csv_open(ds, p);
    } else {
        st = vlmoe_expand_braces(p->path, &ds->shards, &ds->n_shards);
        int missing = 0;
        const char *first = NULL;
        char why[128] = "";
        for (int i = 0; !st && i < ds->n_shards; i++) {
            struct stat sb;
            if (is_pipe(ds->shards[i])) continue;   // its command finds out when the shard is read
            int bad = stat(ds->shards[i], &sb) != 0;
            const char *no = bad ? strerror(errno) : S_ISDIR(sb.st_mode) ? strerror(EISDIR)
                           : S_ISFIFO(sb.st_mode) ? "not a regular file (a FIFO)" : "not a regular file";
            bad |= !S_ISREG(sb.st_mode);
            if (bad && !missing++) { first = ds->shards[i]; snprintf(why, sizeof why, "%s", no); }
        }
        if (!st && missing)
            st = vlmoe_fail(VLMOE_ERR_IO, "%s: shard missing (%s); %d of %d shards of '%s' are missing",
                            first, why, missing, ds->n_shards, p->path);
    }
    if (st) { vlmoe_dataset_free(ds); return st; }
    *out = ds;
    return VLMOE_OK;
}

int vlmoe_dataset_next(vlmoe_dataset *ds, vlmoe_sample *s) {
    if (!ds || !s) return -vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_dataset_next: NULL argument");
    return ds->type == VLMOE_DATASET_CSV ? csv_next(ds, s) : wds_next(ds, s);
}

vlmoe_dataset_pos vlmoe_dataset_position(const vlmoe_dataset *ds) {
    vlmoe_dataset_pos p = {0, 0};
    if (!ds) return p;
    if (ds->type == VLMOE_DATASET_CSV) {
        p.item = ds->row;
    } else {
        p.shard = ds->shard;
        // An open shard: the next sample starts at the pending header (already read) or at
        // the next header to read.
        p.item = ds->a ? (ds->pending ? ds->member - 1 : ds->member) : 0;
    }
    return p;
}

int vlmoe_dataset_seek(vlmoe_dataset *ds, vlmoe_dataset_pos pos) {
    if (!ds) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_dataset_seek: NULL dataset");
    if (ds->type == VLMOE_DATASET_CSV) {
        if (pos.shard != 0 || pos.item < 0)
            return vlmoe_fail(VLMOE_ERR_ARG, "%s: invalid CSV position (%lld, %lld)", ds->csv_path,
                              (long long)pos.shard, (long long)pos.item);
        return csv_seek(ds, pos.item);
    }
    return wds_seek(ds, pos);
}

int vlmoe_dataset_rewind(vlmoe_dataset *ds) {
    vlmoe_dataset_pos p = {0, 0};
    return vlmoe_dataset_seek(ds, p);
}

const vlmoe_dataset_stats *vlmoe_dataset_get_stats(const vlmoe_dataset *ds) {
    return ds ? &ds->stats : NULL;
}

void vlmoe_dataset_reset_stats(vlmoe_dataset *ds) {
    if (ds) memset(&ds->stats, 0, sizeof ds->stats);
}

vlmoe_dataset_type vlmoe_dataset_get_type(const vlmoe_dataset *ds) {
    return ds ? ds->type : VLMOE_DATASET_AUTO;
}

int vlmoe_dataset_n_shards(const vlmoe_dataset *ds) {
    return !ds ? 0 : ds->type == VLMOE_DATASET_CSV ? 1 : ds->n_shards;
}

void vlmoe_dataset_free(vlmoe_dataset *ds) {
    if (!ds) return;
    if (ds->f) fclose(ds->f);
    wds_close(ds);
    vlmoe_free_strings(ds->shards, ds->n_shards);
    free(ds->img); free(ds->cap); free(ds->key); free(ds->csv_path); free(ds->csv_dir);
    free(ds->rec); free(ds->fld); free(ds->pathbuf); free(ds->pname);
    free(ds);
}

// ---- image folder ---------------------------------------------------------------------------
static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

// Sorted names of the entries of dir that are folders (want_dirs) or image files.
static int list_dir(const char *dir, int want_dirs, strlist *out) {
    DIR *d = opendir(dir);
    if (!d) return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot open folder: %s", dir, strerror(errno));
    struct dirent *e;
    int st = VLMOE_OK;
    while (!st && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char *full = concat3(dir, strlen(dir), "/", 1, e->d_name, strlen(e->d_name));
        if (!full) { st = VLMOE_ERR_NOMEM; break; }
        struct stat sb;
        int ok = stat(full, &sb) == 0;
        free(full);
        if (!ok) continue;
        if (want_dirs ? !S_ISDIR(sb.st_mode) : !S_ISREG(sb.st_mode)) continue;
        if (!want_dirs) {
            char ext[16];
            path_ext(e->d_name, ext, sizeof ext);
            if (!strchr(e->d_name, '.') || !is_image_ext(ext)) continue;
        }
        st = sl_push_own(out, dup_str(e->d_name));
    }
    closedir(d);
    if (!st && out->n > 1) qsort(out->v, (size_t)out->n, sizeof *out->v, cmp_str);
    return st;
}

int vlmoe_image_folder_load(const char *root, vlmoe_image_folder *out) {
    if (!root || !out) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_image_folder_load: NULL argument");
    memset(out, 0, sizeof *out);
    struct stat sb;
    if (stat(root, &sb) != 0)
        return vlmoe_fail(VLMOE_ERR_IO, "%s: image folder root: %s", root, strerror(errno));
    if (!S_ISDIR(sb.st_mode)) return vlmoe_fail(VLMOE_ERR_IO, "%s: image folder root is not a folder", root);
    strlist classes = {0}, paths = {0};
    int *labels = NULL;
    size_t lab_cap = 0;
    int st = list_dir(root, 1, &classes);
    if (!st && classes.n == 0)
        st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: no class folders (expected root/<class_name>/*.jpg)", root);
    for (int c = 0; !st && c < classes.n; c++) {
        char *cdir = concat3(root, strlen(root), "/", 1, classes.v[c], strlen(classes.v[c]));
        if (!cdir) { st = VLMOE_ERR_NOMEM; break; }
        strlist files = {0};
        st = list_dir(cdir, 0, &files);
        if (!st && files.n == 0)
            st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: class folder has no .jpg/.jpeg/.png/.webp images", cdir);
        for (int i = 0; !st && i < files.n; i++) {
            st = sl_push_own(&paths, concat3(cdir, strlen(cdir), "/", 1, files.v[i], strlen(files.v[i])));
            if (!st) st = grow(&labels, &lab_cap, (size_t)paths.n, sizeof *labels, "image labels");
            if (!st) labels[paths.n - 1] = c;
        }
        sl_free(&files);
        free(cdir);
        for (char *q = classes.v[c]; *q; q++)
            if (*q == '_') *q = ' ';
    }
    if (st) { sl_free(&classes); sl_free(&paths); free(labels); return st; }
    out->n_classes = classes.n;
    out->class_names = classes.v;
    out->n = paths.n;
    out->paths = paths.v;
    out->labels = labels;
    return VLMOE_OK;
}

void vlmoe_image_folder_free(vlmoe_image_folder *f) {
    if (!f) return;
    vlmoe_free_strings(f->class_names, f->n_classes);
    vlmoe_free_strings(f->paths, (int)f->n);
    free(f->labels);
    memset(f, 0, sizeof *f);
}
