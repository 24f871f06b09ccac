// test_jpeg.h: the image encoders the tests use to make fixtures at test time (libjpeg-turbo
// into memory, libpng's simplified API to a file).
#ifndef VLMOE_TEST_JPEG_H
#define VLMOE_TEST_JPEG_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <png.h>

// JPEG of comps = 1 (grey), 3 (RGB) or 4 (CMYK) components; returns malloc'd bytes.
static inline uint8_t *enc_jpeg(const uint8_t *px, int w, int h, int comps, int quality,
                                int progressive, size_t *n) {
    struct jpeg_compress_struct c;
    struct jpeg_error_mgr err;
    unsigned char *mem = NULL;
    unsigned long size = 0;
    c.err = jpeg_std_error(&err);
    jpeg_create_compress(&c);
    jpeg_mem_dest(&c, &mem, &size);
    c.image_width = (JDIMENSION)w;
    c.image_height = (JDIMENSION)h;
    c.input_components = comps;
    c.in_color_space = comps == 1 ? JCS_GRAYSCALE : comps == 3 ? JCS_RGB : JCS_CMYK;
    jpeg_set_defaults(&c);
    jpeg_set_quality(&c, quality, TRUE);
    if (progressive) jpeg_simple_progression(&c);
    jpeg_start_compress(&c, TRUE);
    while (c.next_scanline < c.image_height) {
        JSAMPROW row = (JSAMPROW)(px + (size_t)c.next_scanline * w * comps);
        jpeg_write_scanlines(&c, &row, 1);
    }
    jpeg_finish_compress(&c);
    jpeg_destroy_compress(&c);
    uint8_t *out = malloc(size);
    memcpy(out, mem, size);
    free(mem);
    *n = size;
    return out;
}

// Writes an RGB image (w x h x 3 bytes) as a JPEG of quality 95 or a PNG; 1 on success.
static inline int test_write_rgb(const char *path, const uint8_t *px, int w, int h, int jpeg) {
    if (!jpeg) {
        png_image im;
        memset(&im, 0, sizeof(im));
        im.version = PNG_IMAGE_VERSION, im.width = (png_uint_32)w, im.height = (png_uint_32)h;
        im.format = PNG_FORMAT_RGB;
        return png_image_write_to_file(&im, path, 0, px, 0, NULL) != 0;
    }
    size_t n;
    uint8_t *b = enc_jpeg(px, w, h, 3, 95, 0, &n);
    FILE *f = b ? fopen(path, "wb") : NULL;
    int ok = f && fwrite(b, 1, n, f) == n;
    if (f) ok &= fclose(f) == 0;
    free(b);
    return ok;
}

#endif
