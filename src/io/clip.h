// clip.h: the parts of CLIP import/export shared by src/io/clip_import.c (tensor names, one
// safetensors file), src/io/clip_folder.c (HF and OpenCLIP folders, their configs) and
// src/io/clip_export.c (folders others load). Tests: tests/test_clip_import.c, test_import_export.c.
#ifndef VLMOE_IO_CLIP_H
#define VLMOE_IO_CLIP_H

#include "vlmoe.h"

typedef struct {
    int strict_heads; // heads not given are not width / 64: one candidate head count, or an error
    double ln_eps;    // the config's LayerNorm eps; 0 = CLIP's 1e-5
} clip_file_opts;

// vlmoe_clip_import with the options a folder's config gives.
int clip_import_file(vlmoe_model **out, const char *path, const vlmoe_clip_import_params *p, const clip_file_opts *o);
// VLMOE_ERR_FORMAT naming what the file is when it is a PyTorch pickle (torch.save's zip with
// data.pkl, or a legacy pickle stream), with the command that converts it; VLMOE_OK otherwise
// (also when it cannot be read: the safetensors reader says why).
int clip_refuse_pickle(const char *path);

// Whether c computes exactly what the CLIP names describe (dense two_tower, OpenAI's layout);
// VLMOE_ERR_CONFIG naming what differs, and `path`, the file or folder it would go to.
int clip_check_exportable(const vlmoe_model_config *c, const char *path);

#endif
