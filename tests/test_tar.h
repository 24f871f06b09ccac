// test_tar.h: webdataset shards made at test time (libarchive's ustar writer, optionally gzipped).
// Used by tests/test_readers.c and tests/test_loader.c.
#ifndef VLMOE_TEST_TAR_H
#define VLMOE_TEST_TAR_H
#include <archive.h>
#include <archive_entry.h>

#include "test.h"

typedef struct { const char *name; const char *data; size_t len; } member;
#define M(name, str) {name, str, sizeof(str) - 1}

static inline void write_tar(const char *path, int gzip, const member *m, int n) {
    struct archive *a = archive_write_new();
    archive_write_set_format_ustar(a);
    if (gzip) archive_write_add_filter_gzip(a);
    CHECK(archive_write_open_filename(a, path) == ARCHIVE_OK, "open %s for writing", path);
    for (int i = 0; i < n; i++) {
        struct archive_entry *e = archive_entry_new();
        archive_entry_set_pathname(e, m[i].name);
        archive_entry_set_size(e, (la_int64_t)m[i].len);
        archive_entry_set_filetype(e, AE_IFREG);
        archive_entry_set_perm(e, 0644);
        CHECK(archive_write_header(a, e) == ARCHIVE_OK, "tar header %s", m[i].name);
        if (m[i].len) CHECK(archive_write_data(a, m[i].data, m[i].len) == (la_ssize_t)m[i].len, "data");
        archive_entry_free(e);
    }
    archive_write_close(a);
    archive_write_free(a);
}
#endif
