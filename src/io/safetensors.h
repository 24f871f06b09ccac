// safetensors.h: internal half/bfloat16 conversions shared by the safetensors reader/writer,
// checkpoints and weight import (the file API itself is in include/vlmoe.h). All four round to
// nearest even and keep NaN, Inf and subnormals. Covered by tests/test_safetensors.c.
#ifndef VLMOE_IO_SAFETENSORS_H
#define VLMOE_IO_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "vlmoe.h"

float vlmoe_f16_to_f32(uint16_t h);
float vlmoe_bf16_to_f32(uint16_t h);
uint16_t vlmoe_f32_to_f16(float f);
uint16_t vlmoe_f32_to_bf16(float f);

// 1 when st's tensors were verified against the CRC-32s the writer records (a file written by
// vlmoe since checksums exist); 0 for a file without them, which loads unverified.
int vlmoe_st_checksummed(const vlmoe_st *st);
// The writer's first half: the whole file written and fsynced under a temporary name beside path
// (returned in tmp, cap bytes), for a caller that orders several renames itself (checkpoints:
// src/train/checkpoint.c). On failure nothing is left behind.
int vlmoe_st_writer_write_tmp(vlmoe_st_writer *w, const char *path, char *tmp, size_t cap);
// fsync of the directory holding path, which makes a rename into it durable.
int vlmoe_sync_dir(const char *path);

#endif
