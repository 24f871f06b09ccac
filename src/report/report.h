// report.h: what `vlmoe report`, `vlmoe routes` and `vlmoe train --report-every/--report-to` build
// on: metrics.jsonl read into named series (series.c), routing maps as PNG (routemap.c), the
// self-contained HTML page (html.c) and TensorBoard event files (tfevents.c). Internal to vlmoe.
#ifndef VLMOE_REPORT_H
#define VLMOE_REPORT_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "vlmoe.h"

// ---- metrics.jsonl as series (series.c; docs/METRICS.md). Every numeric leaf of a record is a
// series, found by key pattern so that keys added to the schema appear without code here:
//   train:KEY / eval:KEY      a top-level number, nested objects joined by '.' (time.s_per_step)
//   moe:KEY:LAYER:MOD         a number of one MoE layer's modality object (MOD image/text), or of
//                             the layer itself (MOD empty); aux losses as KEY "aux.NAME"
// LAYER is "e<encoder>.b<block>" plus ".<stream>" for VL-MoE. Arrays of numbers inside a layer's
// modality object (routed, accepted, ...) are vector series of the same names.
typedef struct {
    char *name;
    long n, cap;
    long *step;
    double *v;      // n values; vectors: n x dim
    int dim;        // 0 for a scalar series, else the array length (experts)
} report_series;

typedef struct {
    report_series *s;
    int ns, cap, hint;
    long records, bad_lines;
    long last_step;
} report_metrics;

// Adds the records of `text` (whole lines; a last line without '\n' is left for later) and returns
// the bytes consumed in *used. what names the file in messages. Lines that are not JSON objects
// with "step" and "kind" count as bad_lines (a writer killed mid-line leaves one).
int report_metrics_add(report_metrics *m, const char *text, size_t n, size_t *used, const char *what);
int report_metrics_read(report_metrics *m, const char *path);
void report_metrics_free(report_metrics *m);
const report_series *report_metrics_find(const report_metrics *m, const char *name);

// The numeric leaves of one record as (tag, value) pairs, in the order of the record, tags as the
// series names above with ':' turned into '/' (TensorBoard's grouping) and vectors expanded to
// ".../expert_K". Calls fn for each; returns the record's step or -1 if the line is no record.
typedef void (*report_leaf_fn)(void *user, const char *tag, double v);
long report_record_leaves(const char *line, report_leaf_fn fn, void *user);

// ---- routing maps (routemap.c)
// One example's routing: per MoE layer, the expert that took each image patch and each text
// token (-1: dropped by every assignment).
typedef struct {
    int layers;             // MoE layers
    char (*layer_name)[32]; // (layers) "e0.b1"
    int grid;               // patches per side
    int npatch, ntext;
    int32_t *patch_expert;  // (layers, npatch)
    int32_t *text_expert;   // (layers, ntext): text positions, SOT first
    int num_experts;
} report_routes;

// The expert colour palette (k-th expert), and the grey of a dropped token.
void report_expert_rgb(int expert, uint8_t rgb[3]);
#define REPORT_DROPPED_RGB 128

// Routes of example `ex` of the model's last forward (B examples in it, one_tower or the image
// tower of two_tower): every MoE layer that saw it. Text tokens are left at -1 when absent.
int report_routes_from_model(const vlmoe_model *m, int ex, report_routes *out);
void report_routes_free(report_routes *r);

// The routing map image: the input image (3,S,S) de-normalised with mean/std, then one panel per
// MoE layer with each patch filled with its expert's colour (grey: dropped). `cell` pixels per
// patch side; panels are separated by `gap` white pixels. rgb is malloc'd (h, w, 3).
typedef struct {
    int cell, gap;
} report_map_params;
int report_map_render(const report_routes *r, const float *image, int S, const float mean[3], const float std[3],
                      report_map_params p, uint8_t **rgb, int *w, int *h);
// PNG of rgb (h, w, 3): into a file, or into memory (*png malloc'd, *n bytes).
int report_png_write(const char *path, const uint8_t *rgb, int w, int h);
int report_png_encode(const uint8_t *rgb, int w, int h, uint8_t **png, size_t *n);

// ---- the HTML page (html.c)
typedef struct {
    char *png_b64;          // the routing map (report_map_render) as base64 PNG
    char *caption;          // its caption (may be NULL)
    int nwords;
    int32_t *word_expert;   // (layers, nwords): the expert of each word's first token, -1 dropped
    char **words;           // (nwords)
} report_example;

typedef struct {
    const char *run_dir;        // LOGS/NAME
    const char *title;
    const report_metrics *metrics;
    const char *params_json;    // params.json's text (NULL: none)
    const char *checkpoint;     // the checkpoint the model card and maps come from (NULL: none)
    const vlmoe_model *model;   // its model (NULL: none)
    const report_example *examples;
    int nexamples, layers, num_experts;
    char (*layer_name)[32];
    const char *examples_from;  // where the examples came from, for the page
    const char *chart_js;       // Chart.js's text, inlined
    int max_points;             // display downsampling (per series)
} report_page;
int report_html_write(const char *path, const report_page *p);
// Chart.js from Debian's libjs-chart.js (or $VLMOE_CHARTJS): malloc'd text.
int report_chart_js(char **out);
char *report_base64(const uint8_t *data, size_t n);

// ---- TensorBoard event files (tfevents.c): TFRecord framing + Event protobufs, by hand
typedef struct report_tb report_tb;
// Opens DIR/events.out.tfevents.<time>.<host>.vlmoe (a new file; DIR is created).
int report_tb_open(report_tb **out, const char *dir);
int report_tb_scalar(report_tb *t, long step, double wall, const char *tag, float v);
int report_tb_image(report_tb *t, long step, double wall, const char *tag, const uint8_t *png, size_t n, int w,
                    int h);
// Converts the whole records of metrics.jsonl from *offset on (updated), one event per record.
int report_tb_sync(report_tb *t, const char *metrics_path, long *offset);
int report_tb_flush(report_tb *t);
const char *report_tb_path(const report_tb *t);
void report_tb_close(report_tb *t);
uint32_t report_crc32c(const uint8_t *p, size_t n);
uint32_t report_masked_crc(const uint8_t *p, size_t n);
#endif
