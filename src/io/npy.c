// npy.c: NumPy's .npy writer (format version 1.0 as numpy/lib/format.py documents it: magic
// "\x93NUMPY", version 1 0, a little-endian uint16 header length, a Python-literal dict padded with
// spaces and ended by '\n' so the data starts 64-byte aligned, then the raw data). See npy.h.
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"
#include "io/npy.h"
#include "vlmoe.h"

// Little-endian bytes of one float, whatever the host's byte order ('<f4' is what the header says).
static void put_f32_le(float f, unsigned char *o) {
    uint32_t u;
    memcpy(&u, &f, 4);
    o[0] = (unsigned char)u, o[1] = (unsigned char)(u >> 8), o[2] = (unsigned char)(u >> 16), o[3] = (unsigned char)(u >> 24);
}

int vlmoe_npy_write_f32(const char *path, const float *x, int64_t rows, int64_t cols) {
    if (!path || rows < 0 || cols < 0 || (rows * cols > 0 && !x))
        return vlmoe_fail(VLMOE_ERR_ARG, "npy: %s: bad arguments (rows = %lld, cols = %lld)",
                          path ? path : "(null)", (long long)rows, (long long)cols);
    char head[128];
    int hn = snprintf(head, sizeof(head), "{'descr': '<f4', 'fortran_order': False, 'shape': (%lld, %lld), }",
                      (long long)rows, (long long)cols);
    const int total = (10 + hn + 1 + 63) / 64 * 64; // magic+version+length, dict, '\n', aligned
    while (10 + hn + 1 < total) head[hn++] = ' ';
    head[hn++] = '\n';
    const unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(hn & 0xFF),
                                   (unsigned char)(hn >> 8)};
    char tmp[4096];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof(tmp))
        return vlmoe_fail(VLMOE_ERR_IO, "%s: path too long", path);
    FILE *f = fopen(tmp, "wb");
    if (!f) return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot create %s: %s", path, tmp, strerror(errno));
    int ok = fwrite(pre, 1, 10, f) == 10 && fwrite(head, 1, (size_t)hn, f) == (size_t)hn;
    unsigned char buf[4096];
    const size_t n = (size_t)rows * (size_t)cols;
    for (size_t i = 0; i < n && ok; i += sizeof(buf) / 4) {
        const size_t k = n - i < sizeof(buf) / 4 ? n - i : sizeof(buf) / 4;
        for (size_t j = 0; j < k; j++) put_f32_le(x[i + j], buf + 4 * j);
        ok = fwrite(buf, 4, k, f) == k;
    }
    ok = fflush(f) == 0 && ok;
    const int err = errno;
    if (fclose(f) != 0) ok = 0;
    if (ok && rename(tmp, path) == 0) return VLMOE_OK;
    remove(tmp);
    return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot write (via %s): %s", path, tmp, strerror(ok ? errno : err));
}
