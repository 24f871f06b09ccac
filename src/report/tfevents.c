// tfevents.c: TensorBoard event files written by hand: TFRecord framing (uint64 length, masked
// CRC32C of the length, the data, masked CRC32C of the data) around tensorflow.Event protobufs
// (wall_time, step, file_version, summary with simple_value scalars and PNG Summary.Image).
// Field numbers from tensorflow/core/util/event.proto and framework/summary.proto. Covered by
// tests/test_tfevents.c, which parses the files back (and loads them with TensorBoard's reader).
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/core.h"
#include "report/report.h"
#include "train/run.h"

struct report_tb {
    FILE *f;
    char path[1200];
    int st;                 // the first failed allocation, reported at the next write
};

static uint32_t crc_table[256];
static void crc_init(uint32_t *t) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1; // Castagnoli, reflected
        t[i] = c;
    }
}

uint32_t report_crc32c(const uint8_t *p, size_t n) {
    // the table is a pure function of the polynomial: filling it twice from two threads writes the
    // same values
    if (!crc_table[1]) crc_init(crc_table);
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) c = crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

// TFRecord's mask: a CRC of data that holds CRCs is weak, so the stored CRC is rotated and offset
uint32_t report_masked_crc(const uint8_t *p, size_t n) {
    const uint32_t c = report_crc32c(p, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// ---- protobuf encoding into a growable buffer
static void put(report_tb *t, uint8_t **b, size_t *n, size_t *cap, const void *p, size_t k) {
    if (t->st) return;
    if (*n + k > *cap) {
        size_t c = *cap ? *cap : 256;
        while (c < *n + k) c *= 2;
        uint8_t *nb = realloc(*b, c);
        if (!nb) { t->st = vlmoe_fail(VLMOE_ERR_NOMEM, "%s: event of %zu bytes", t->path, c); return; }
        *b = nb, *cap = c;
    }
    memcpy(*b + *n, p, k);
    *n += k;
}
static size_t varint(uint8_t *o, uint64_t v) {
    size_t k = 0;
    do {
        o[k++] = (uint8_t)((v & 0x7F) | (v > 0x7F ? 0x80 : 0));
        v >>= 7;
    } while (v);
    return k;
}

typedef struct {
    uint8_t *b;
    size_t n, cap;
} pbuf;
static void pb_bytes(report_tb *t, pbuf *b, const void *p, size_t k) { put(t, &b->b, &b->n, &b->cap, p, k); }
static void pb_varint(report_tb *t, pbuf *b, int field, uint64_t v) {
    uint8_t o[20];
    size_t k = varint(o, (uint64_t)field << 3);
    k += varint(o + k, v);
    pb_bytes(t, b, o, k);
}
static void pb_len(report_tb *t, pbuf *b, int field, const void *p, size_t n) {
    uint8_t o[20];
    size_t k = varint(o, (uint64_t)field << 3 | 2);
    k += varint(o + k, n);
    pb_bytes(t, b, o, k);
    pb_bytes(t, b, p, n);
}
static void pb_fixed(report_tb *t, pbuf *b, int field, const void *le, int bytes) {
    uint8_t o[12];
    size_t k = varint(o, (uint64_t)field << 3 | (bytes == 8 ? 1 : 5));
    for (int i = 0; i < bytes; i++) o[k++] = ((const uint8_t *)le)[i]; // x86-64 and arm64: little-endian
    pb_bytes(t, b, o, k);
}

static int write_record(report_tb *t, const uint8_t *data, size_t n) {
    uint8_t head[12];
    const uint64_t len = n;
    memcpy(head, &len, 8);
    const uint32_t c1 = report_masked_crc(head, 8), c2 = report_masked_crc(data, n);
    memcpy(head + 8, &c1, 4);
    if (fwrite(head, 1, 12, t->f) != 12 || fwrite(data, 1, n, t->f) != n || fwrite(&c2, 1, 4, t->f) != 4)
        return vlmoe_fail(VLMOE_ERR_IO, "cannot write %s: %s", t->path, strerror(errno));
    return VLMOE_OK;
}

// An Event of (wall, step) holding the summary built in *sum (NULL: file_version instead).
static int write_event(report_tb *t, double wall, long step, const pbuf *sum, const char *version) {
    pbuf e = {0};
    pb_fixed(t, &e, 1, &wall, 8);
    if (step) pb_varint(t, &e, 2, (uint64_t)step);
    if (version) pb_len(t, &e, 3, version, strlen(version));
    if (sum) pb_len(t, &e, 5, sum->b, sum->n);
    int st = t->st ? t->st : write_record(t, e.b, e.n);
    free(e.b);
    return st;
}

static void value_scalar(report_tb *t, pbuf *sum, const char *tag, float v) {
    pbuf val = {0};
    pb_len(t, &val, 1, tag, strlen(tag));
    pb_fixed(t, &val, 2, &v, 4);
    pb_len(t, sum, 1, val.b, val.n);
    free(val.b);
}

int report_tb_open(report_tb **out, const char *dir) {
    *out = NULL;
    const int mk = vlmoe_mkdir_p(dir);
    if (mk) return mk;
    report_tb *t = calloc(1, sizeof(*t));
    if (!t) return vlmoe_fail(VLMOE_ERR_NOMEM, "TensorBoard writer");
    char host[64] = "localhost";
    gethostname(host, sizeof host - 1);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    // a new file per writer (TensorBoard reads every events file of the folder); pid and
    // nanoseconds keep two writers of the same second apart
    snprintf(t->path, sizeof t->path, "%s/events.out.tfevents.%lld.%s.%d.%ld.vlmoe", dir, (long long)ts.tv_sec, host,
             (int)getpid(), ts.tv_nsec);
    if (!(t->f = fopen(t->path, "wbx"))) {
        const int st = vlmoe_fail(VLMOE_ERR_IO, "cannot create %s: %s", t->path, strerror(errno));
        free(t);
        return st;
    }
    const int st = write_event(t, (double)ts.tv_sec + ts.tv_nsec * 1e-9, 0, NULL, "brain.Event:2");
    if (st) return report_tb_close(t), st;
    *out = t;
    return VLMOE_OK;
}

int report_tb_scalar(report_tb *t, long step, double wall, const char *tag, float v) {
    pbuf sum = {0};
    value_scalar(t, &sum, tag, v);
    const int st = write_event(t, wall, step, &sum, NULL);
    free(sum.b);
    return st;
}

int report_tb_image(report_tb *t, long step, double wall, const char *tag, const uint8_t *png, size_t n, int w,
                    int h) {
    pbuf img = {0}, val = {0}, sum = {0};
    pb_varint(t, &img, 1, (uint64_t)h);
    pb_varint(t, &img, 2, (uint64_t)w);
    pb_varint(t, &img, 3, 3); // RGB
    pb_len(t, &img, 4, png, n);
    pb_len(t, &val, 1, tag, strlen(tag));
    pb_len(t, &val, 4, img.b, img.n);
    pb_len(t, &sum, 1, val.b, val.n);
    const int st = write_event(t, wall, step, &sum, NULL);
    free(img.b), free(val.b), free(sum.b);
    return st;
}

typedef struct {
    report_tb *t;
    pbuf sum;
} leaves;
static void on_leaf(void *u, const char *tag, double v) {
    leaves *l = u;
    value_scalar(l->t, &l->sum, tag, (float)v);
}

int report_tb_sync(report_tb *t, const char *metrics_path, long *offset) {
    FILE *f = fopen(metrics_path, "rb");
    if (!f) return vlmoe_fail(VLMOE_ERR_IO, "cannot read %s: %s", metrics_path, strerror(errno));
    if (fseek(f, *offset, SEEK_SET)) {
        fclose(f);
        return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot seek to byte %ld: %s", metrics_path, *offset, strerror(errno));
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int st = VLMOE_OK;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    const double wall = (double)ts.tv_sec + ts.tv_nsec * 1e-9;
    while (!st && (len = getline(&line, &cap, f)) > 0) {
        if (line[len - 1] != '\n') break; // the writer is still on this line: the next sync takes it
        *offset += len;
        leaves l = {.t = t};
        const long step = report_record_leaves(line, on_leaf, &l);
        if (step >= 0 && l.sum.n) st = t->st ? t->st : write_event(t, wall, step, &l.sum, NULL);
        free(l.sum.b);
    }
    free(line);
    fclose(f);
    return st ? st : report_tb_flush(t);
}

int report_tb_flush(report_tb *t) {
    if (fflush(t->f)) return vlmoe_fail(VLMOE_ERR_IO, "cannot write %s: %s", t->path, strerror(errno));
    return VLMOE_OK;
}

const char *report_tb_path(const report_tb *t) { return t->path; }

void report_tb_close(report_tb *t) {
    if (!t) return;
    if (t->f) fclose(t->f);
    free(t);
}
