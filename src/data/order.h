// order.h: the one data order of every training run (src/data/order.c): item i of a stream of n
// items, epoch by epoch, each epoch a Fisher-Yates permutation drawn from (seed, stream, epoch),
// and the share of one process of a run on `world` processes. The loader (src/data/loader.c), the
// VL-MoE file streams (src/train/mome_task.c) and fine-tuning (src/train/finetune_task.c) draw their
// orders from it. Covered by tests/test_core.c and tests/test_loader.c.
//
// Processes. Each global batch is cut into contiguous blocks, one per process in rank order:
// sample j of process r in global batch `step` is global sample step*G + r*B + j, with B the
// per-process batch and G = B*W the global one. A run on W processes at batch B therefore
// consumes exactly the global batches one process consumes at batch G, and gathering the
// processes' rows in rank order gives back the one process's batch row for row (so a loss over
// gathered embeddings sees the same matrix).
#ifndef VLMOE_DATA_ORDER_H
#define VLMOE_DATA_ORDER_H
#include <stddef.h>
#include <stdint.h>

// splitmix64's finaliser of a combined with b: the key derivation of every data stream
uint64_t vlmoe_order_mix(uint64_t a, uint64_t b);
// perm = 0..n-1 shuffled by Fisher-Yates (from the last position down) with the generator seeded
// by `key`; the same permutation on every machine.
void vlmoe_order_shuffle(uint32_t *perm, uint32_t n, uint64_t key);

typedef struct {
    uint32_t *perm, n;       // the current epoch's permutation of the n items
    int64_t epoch;           // whose permutation perm holds (-1: none yet)
    uint64_t seed;           // of the stream: vlmoe_order_mix(run seed, stream tag)
    int shuffle;             // 0: items in file order every epoch
    int rank, world;         // this process's share of each global batch (see above)
} vlmoe_order;

// n >= 1 items; rank in [0, world). Returns VLMOE_OK or VLMOE_ERR_NOMEM / VLMOE_ERR_ARG.
int vlmoe_order_init(vlmoe_order *o, size_t n, uint64_t seed, uint64_t stream, int rank, int world);
void vlmoe_order_free(vlmoe_order *o);
// The item of global sample i (epoch i / n, position i mod n).
uint32_t vlmoe_order_at(vlmoe_order *o, uint64_t i);
// The item of this process's sample j of global batch `step`, whose global size is
// local_batch * world.
uint32_t vlmoe_order_local(vlmoe_order *o, uint64_t step, int local_batch, int j);

#endif
