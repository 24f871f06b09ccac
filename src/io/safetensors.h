// safetensors.h: internal half/bfloat16 conversions shared by the safetensors reader/writer,
// checkpoints and weight import (the file API itself is in include/vlmoe.h). All four round to
// nearest even and keep NaN, Inf and subnormals. Covered by tests/test_safetensors.c.
#ifndef VLMOE_IO_SAFETENSORS_H
#define VLMOE_IO_SAFETENSORS_H

#include <stdint.h>

float vlmoe_f16_to_f32(uint16_t h);
float vlmoe_bf16_to_f32(uint16_t h);
uint16_t vlmoe_f32_to_f16(float f);
uint16_t vlmoe_f32_to_bf16(float f);

#endif
