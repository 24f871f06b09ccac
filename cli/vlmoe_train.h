// vlmoe_train.h: the VL-MoE commands: `vlmoe vq train` (cli/vq.c, the MIM codebook) and
// `vlmoe train` for arch mome models (cli/vlmoe_train.c: masked data modeling on image, text and
// pair streams instead of the contrastive loss). Covered by tests/test_vlmoe_train.c.
#ifndef VLMOE_CLI_VLMOE_TRAIN_H
#define VLMOE_CLI_VLMOE_TRAIN_H

int cmd_vq(int argc, char **argv);
// Whether `vlmoe train ...` names a mome model (then cmd_train_mome runs it).
int cli_train_is_mome(int argc, char **argv);
int cmd_train_mome(int argc, char **argv);

#endif
