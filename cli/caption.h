// caption.h: `vlmoe caption` (cli/caption.c) and the captioning report `vlmoe eval --caption-data`
// shares with it.
#ifndef VLMOE_CLI_CAPTION_H
#define VLMOE_CLI_CAPTION_H
#include "common.h"

int cmd_caption(int argc, char **argv);
// Captions the distinct images of the pairs dp names and scores them by CIDEr-D (max_len 0: the
// context); prints errors and warnings as `vlmoe CMD` and returns the exit status. r is filled
// (vlmoe_eval_captions_free it) even on failure.
int cli_caption_eval(const char *cmd, vlmoe_model *m, const vlmoe_dataset_params *dp, const vlmoe_eval_params *p,
                     cli_text *text, int max_len, vlmoe_eval_captions *r);

#endif
