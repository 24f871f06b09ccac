// order.c: the one data order of training runs: per-epoch Fisher-Yates permutations drawn from
// (seed, stream, epoch), and each process's contiguous block of a global batch (src/data/order.h).
// Covered by tests/test_core.c.
#include <stdlib.h>

#include "core/core.h"
#include "data/order.h"

uint64_t vlmoe_order_mix(uint64_t a, uint64_t b) {
    uint64_t z = a ^ (b + 0x9E3779B97F4A7C15ull + (a << 6) + (a >> 2));
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void vlmoe_order_shuffle(uint32_t *perm, uint32_t n, uint64_t key) {
    vlmoe_rng r;
    vlmoe_rng_seed(&r, key);
    for (uint32_t i = 0; i < n; i++) perm[i] = i;
    for (uint32_t i = n; i > 1; i--) {
        const uint32_t j = vlmoe_rng_below(&r, i), t = perm[i - 1];
        perm[i - 1] = perm[j], perm[j] = t;
    }
}

int vlmoe_order_init(vlmoe_order *o, size_t n, uint64_t seed, uint64_t stream, int rank, int world) {
    o->perm = NULL;
    if (n < 1 || n > UINT32_MAX) return vlmoe_fail(VLMOE_ERR_ARG, "data order: %zu items (1 to 2^32-1)", n);
    if (world < 1 || rank < 0 || rank >= world)
        return vlmoe_fail(VLMOE_ERR_ARG, "data order: rank %d of a world of %d", rank, world);
    o->n = (uint32_t)n, o->epoch = -1, o->seed = vlmoe_order_mix(seed, stream), o->shuffle = 1;
    o->rank = rank, o->world = world;
    o->perm = malloc(sizeof(uint32_t) * n);
    return o->perm ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "data order of %zu items", n);
}

void vlmoe_order_free(vlmoe_order *o) {
    if (!o) return;
    free(o->perm);
    o->perm = NULL;
}

uint32_t vlmoe_order_at(vlmoe_order *o, uint64_t i) {
    if (!o->shuffle) return (uint32_t)(i % o->n);
    const int64_t e = (int64_t)(i / o->n);
    if (e != o->epoch) {
        vlmoe_order_shuffle(o->perm, o->n, vlmoe_order_mix(o->seed, (uint64_t)e));
        o->epoch = e;
    }
    return o->perm[i % o->n];
}

uint32_t vlmoe_order_local(vlmoe_order *o, uint64_t step, int local_batch, int j) {
    const uint64_t B = (uint64_t)local_batch;
    return vlmoe_order_at(o, (step * (uint64_t)o->world + (uint64_t)o->rank) * B + (uint64_t)j);
}
