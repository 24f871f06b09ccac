// npy.h: writes NumPy's .npy format (version 1.0, '<f4', C order) for `vlmoe embed` (people
// without a safetensors reader load it with numpy.load). Implemented in src/io/npy.c; tested by
// tests/test_classify_embed.c, which loads the file with numpy.
#ifndef VLMOE_IO_NPY_H
#define VLMOE_IO_NPY_H

#include <stdint.h>

// x: (rows, cols) row-major floats -> path, written to path.tmp.PID and renamed, so a failed
// write never leaves a partial file under path. rows, cols >= 0. VLMOE_ERR_IO names the path.
int vlmoe_npy_write_f32(const char *path, const float *x, int64_t rows, int64_t cols);

#endif
