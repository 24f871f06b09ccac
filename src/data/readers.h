// readers.h: dataset readers that yield raw (image bytes, caption, key) samples: OpenCLIP CSV/TSV,
// webdataset tar shards (brace-expanded lists, "pipe:COMMAND" streams), image folders for zero-shot
// classification.
// Spec: ../shared/spec/MODEL.md ("Data"). Implemented in src/data/readers.c; tests/test_readers.c.
//
// Everything here is meant for include/vlmoe.h (the lead moves it). Readers never decode images
// nor tokenise captions: that is the loader's job.
#ifndef VLMOE_DATA_READERS_H
#define VLMOE_DATA_READERS_H

#include <stddef.h>
#include <stdint.h>
#include "vlmoe.h"

// ---- brace expansion (webdataset / OpenCLIP shard lists) ------------------------------------
// Expands "train-{000000..000099}.tar", lists "{a,b}", several and nested groups, and several
// patterns joined by "::" (results concatenated in order). Numeric ranges may descend; when
// either end has a leading zero the results are zero-padded to the wider end's width ("{08..10}"
// -> 08 09 10), else they are not ("{8..10}" -> 8 9 10). Unmatched '{' or '}', an empty group
// "{}", a group that is neither a list nor a range ("{5}", "{1..x}"), an empty pattern between
// "::", or more than VLMOE_BRACE_MAX results are VLMOE_ERR_ARG naming the pattern and position.
// On success *out is a malloc'd array of *n malloc'd strings; free with vlmoe_free_strings.
#define VLMOE_BRACE_MAX 1000000
int vlmoe_expand_braces(const char *pattern, char ***out, int *n);
void vlmoe_free_strings(char **s, int n);   // NULL is safe

// ---- bad-sample accounting ------------------------------------------------------------------
typedef enum {
    VLMOE_BAD_MISSING_COLUMN = 0,   // CSV row with fewer fields than the key columns need
    VLMOE_BAD_EMPTY_CAPTION = 1,    // caption empty after trimming whitespace
    VLMOE_BAD_UNREADABLE_IMAGE = 2, // CSV image path empty, missing, unreadable or an empty file;
                                    // webdataset image member of 0 bytes
    VLMOE_BAD_NO_PARTNER = 3,       // webdataset key with an image but no .txt, or the reverse
    VLMOE_BAD_TRUNCATED_SHARD = 4,  // libarchive error (shard cut mid-member, corrupt, not a tar):
                                    // the partial sample is dropped, the rest of the shard skipped
    VLMOE_BAD_MALFORMED_ROW = 5,    // CSV quote never closed before end of file
    VLMOE_BAD_UNDECODABLE_IMAGE = 6,// image bytes that do not decode (counted by the loader, which
                                    // decodes; the readers never look inside an image)
    VLMOE_BAD_FAILED_COMMAND = 7,   // "pipe:" shard whose command could not start or exited non-zero
                                    // (the samples it gave before are kept, as webdataset does)
    VLMOE_BAD_N = 8
} vlmoe_bad_reason;
const char *vlmoe_bad_reason_name(int reason);   // "missing_column", ...

#define VLMOE_BAD_MSGS 5
#define VLMOE_BAD_MSG_LEN 320
typedef struct {
    int64_t total;              // samples looked at: good + bad
    int64_t bad[VLMOE_BAD_N];   // per reason
    int n_msgs;                 // first VLMOE_BAD_MSGS messages, "file:line: ..." or "shard: member ..."
    char msgs[VLMOE_BAD_MSGS][VLMOE_BAD_MSG_LEN];
} vlmoe_dataset_stats;
int64_t vlmoe_dataset_stats_bad(const vlmoe_dataset_stats *s);   // sum over reasons
// Counts one bad sample of `reason` (total and bad[reason]) and keeps its message while fewer than
// VLMOE_BAD_MSGS are kept.
void vlmoe_dataset_stats_add_bad(vlmoe_dataset_stats *s, int reason, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
// dst += src: counts added, src's messages appended while dst has room.
void vlmoe_dataset_stats_merge(vlmoe_dataset_stats *dst, const vlmoe_dataset_stats *src);
// Writes a one-paragraph summary ("bad samples: 3 of 10 (30.0%): empty_caption 2, ...; first:
// ...") into buf (always NUL-terminated when cap > 0); returns the length it wanted, as snprintf.
int vlmoe_dataset_stats_format(const vlmoe_dataset_stats *s, char *buf, size_t cap);
// VLMOE_OK if bad <= max_fraction * total (or total == 0), else VLMOE_ERR_FORMAT with the summary.
int vlmoe_dataset_check_bad(const vlmoe_dataset_stats *s, double max_fraction);

// ---- image-caption datasets -----------------------------------------------------------------
typedef enum {
    VLMOE_DATASET_AUTO = 0,       // by name: .csv/.tsv -> csv; .tar/.tar.gz/.tgz, '{', "::" or "pipe:" -> webdataset
    VLMOE_DATASET_CSV = 1,
    VLMOE_DATASET_WEBDATASET = 2,
} vlmoe_dataset_type;

// Says something the user should know that is not an error (e.g. how CSV image paths were
// resolved); called at most once per dataset or loader, from the thread that reads the samples.
typedef void (*vlmoe_note_fn)(void *user, const char *message);

typedef struct {
    vlmoe_dataset_type type;
    const char *path;         // CSV/TSV file, or shard pattern (brace expansion, "::" lists).
                              // A shard "pipe:COMMAND" is the stdout of COMMAND run by /bin/sh -c
                              // (webdataset's pipe: URLs; braces expand inside the command too)
    char separator;           // CSV field separator: OpenCLIP's --csv-separator, default '\t'
    const char *img_key;      // --csv-img-key, default "filepath"
    const char *caption_key;  // --csv-caption-key, default "title"
    int defer_images;         // CSV: do not open image files (default 0): samples carry image_path
                              // only (image NULL, image_len 0) and a missing or unreadable image is
                              // the caller's to find and count. Ignored by webdataset.
    vlmoe_note_fn note;       // may be NULL: told once when CSV image paths are read relative to
    void *note_user;          // the CSV's folder (see vlmoe_csv_image_path)
} vlmoe_dataset_params;
vlmoe_dataset_params vlmoe_dataset_default_params(void);

// One sample. Every pointer is owned by the dataset and valid until the next call on it.
typedef struct {
    const uint8_t *image;   // encoded bytes (JPEG/PNG/WebP; not checked here); NULL if deferred
    size_t image_len;       // > 0 (0 if deferred)
    const char *image_path; // CSV: the image file opened (vlmoe_csv_image_path); deferred: the
                            // path as written in the file; webdataset: NULL
    const char *image_ext;  // lower-case extension without '.' ("jpg"; CSV: from the path, may be "")
    const char *caption;    // trimmed, non-empty, NUL-terminated
    const char *key;        // for messages: CSV "file.csv:LINE" (line where the row starts,
                            // header = line 1); webdataset "shard.tar:KEY" (KEY = member path
                            // up to the first '.' of its final component)
} vlmoe_sample;

// CSV image paths follow OpenCLIP: a relative path is relative to the working directory. When it
// does not exist there but does relative to the CSV file's folder (csv_dir; NULL or "." for none),
// that file is used instead (vlmoe's older convention, and the layout of `vlmoe synth export`).
// Writes the path to open into buf (cap bytes) and returns 1 if it is the CSV-folder one, 0 if it
// is `image` as written (also when neither exists: the caller's error names that path), or -1
// when cap is too small (message set).
int vlmoe_csv_image_path(const char *csv_dir, const char *image, char *buf, size_t cap);
// The folder of a CSV file path, as vlmoe_csv_image_path wants it: *dir malloc'd, or NULL for the
// working directory. VLMOE_OK or VLMOE_ERR_NOMEM.
int vlmoe_csv_dir(const char *csv_path, char **dir);

// Where the next sample comes from, so a resumed run continues at the next sample.
//   CSV: shard = 0, item = index of the next data row (0-based, header and blank lines not
//        counted, bad rows counted).
//   webdataset: shard = index into the expanded shard list, item = index of the archive member
//        (every tar entry counts, directories too) that starts the next sample.
typedef struct { int64_t shard, item; } vlmoe_dataset_pos;

typedef struct vlmoe_dataset vlmoe_dataset;

// Opens a dataset. Hard errors, before any sample: unknown type (auto on a name it cannot
// classify), a missing/unreadable CSV (VLMOE_ERR_IO, names the file), a header lacking the
// image or caption column (VLMOE_ERR_CONFIG, names file and column, lists the header's columns),
// a malformed shard pattern (VLMOE_ERR_ARG), any expanded shard missing (VLMOE_ERR_IO, names the
// first missing shard and how many are missing). Shard contents are not opened here.
int vlmoe_dataset_open(const vlmoe_dataset_params *p, vlmoe_dataset **out);
// 1: *s holds a sample; 0: end of epoch (call rewind to start another); < 0: an I/O error
// (message set). Bad samples are skipped and counted in the stats, never returned.
int vlmoe_dataset_next(vlmoe_dataset *ds, vlmoe_sample *s);
int vlmoe_dataset_rewind(vlmoe_dataset *ds);   // back to the first sample; stats are kept
vlmoe_dataset_pos vlmoe_dataset_position(const vlmoe_dataset *ds);
// Continues at pos (from vlmoe_dataset_position, also of an earlier process). Rows or members
// skipped on the way are not counted in the stats. A position past the end is VLMOE_ERR_ARG;
// CSV seeks re-read the rows before pos (linear), webdataset seeks re-read that shard's headers.
int vlmoe_dataset_seek(vlmoe_dataset *ds, vlmoe_dataset_pos pos);
const vlmoe_dataset_stats *vlmoe_dataset_get_stats(const vlmoe_dataset *ds);
void vlmoe_dataset_reset_stats(vlmoe_dataset *ds);
int vlmoe_dataset_n_shards(const vlmoe_dataset *ds);   // 1 for CSV
vlmoe_dataset_type vlmoe_dataset_get_type(const vlmoe_dataset *ds);   // CSV or WEBDATASET (AUTO resolved)
void vlmoe_dataset_free(vlmoe_dataset *ds);           // NULL is safe

// ---- image folder (zero-shot classification) ------------------------------------------------
// root/<class_dir>/<image>.{jpg,jpeg,png,webp} (extension case-insensitive). Class folders are
// sorted by name (strcmp, like torchvision's ImageFolder); hidden entries ('.'-prefixed) are
// skipped; files inside a class are sorted by name. class_names[c] is the folder name with '_'
// turned into ' '. Hard errors: root missing or not a folder (VLMOE_ERR_IO), no class folders
// or a class folder with no images (VLMOE_ERR_FORMAT, names the folder).
typedef struct {
    int n_classes;
    char **class_names;   // (n_classes) display names, '_' -> ' '
    int64_t n;            // images
    char **paths;         // (n) root/class_dir/file
    int *labels;          // (n) class index
} vlmoe_image_folder;
int vlmoe_image_folder_load(const char *root, vlmoe_image_folder *out);
void vlmoe_image_folder_free(vlmoe_image_folder *f);   // zeroes it; NULL is safe

#endif
