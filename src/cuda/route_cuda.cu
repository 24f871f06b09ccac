// route_cuda.cu: the route entry of the CUDA table (be_route, src/ops/backend.h): the routing
// decision of every group and the packed row layout made on the device, bit for bit route.c's
// (src/moe/route.c, run by the CPU tables through src/moe/route_op.c), so a training step's MoE
// layer downloads no gates, only the experts' row offsets. Every order route.c makes by a stable
// sort or an arrival count is made here by CUB's DeviceRadixSort, which is documented stable,
// on integer keys built so that ascending key order is route.c's order:
//   top-K       one thread per token, route.c's loop (gate descending, ties to the lower index);
//   BPR         the tokens by descending max or summed gate (the sum in double, in rank order),
//               -0.0 keyed as +0.0 (route.c compares them equal: ties keep token order); a
//               second stable sort by group keeps that order inside each group;
//   capacity    the assignments in dispatch order (k = 0 of every token before any k = 1),
//               stably sorted by (group, expert): an assignment's rank in its expert's run is
//               its arrival count there, the prefix sum route.c keeps in count[e]; slots < C
//               are accepted. Sorting the n K assignments needs n K keys where a scan over the
//               one-hot (n K, E) assignment matrix would need E times that, for the same ranks;
//   experts     per (group, expert) the tokens by descending gate, ties to the lower token;
//   layout      per-expert offsets by a scan in one block, rows by (expert, group, slot), each
//               token's rows in row order by a stable sort of the rows by token. The fixed
//               layout (be_route.fixed) keeps every slot, empty ones as padding rows keyed
//               past the last token, and its offsets e G C need no scan and no download.
// Integer counts use atomicAdd (exact, order-free); no float is ever summed out of order. A
// non-finite gate, route.c's error, cannot be reported without waiting for the device: here a
// NaN gate ranks as -inf and the step's finite check on the loss and gradients stops it.
// Random dispatch order is not here (`supports` says no; the layer routes on the host).
// Compiled only so far: not yet run on a GPU (docs/GPU.md). Covered by tests/test_backend_ops.c.
#include <cub/cub.cuh>

#include "cuda/cuda_internal.cuh"

#define RT_THREADS 256

// route.c's view of gate (p, e): -1 for a pruned expert or one outside the position's pool
__device__ static inline float gate_at(const be_route &r, const float *gates, int p, int e) {
    if ((e < 64 && (r.pruned >> e & 1)) ||
        (r.pools && (e < r.pool[r.mod[p] ? 1 : 0][0] || e >= r.pool[r.mod[p] ? 1 : 0][0] + r.pool[r.mod[p] ? 1 : 0][1])))
        return -1.0f;
    const int row = r.pos_row ? r.pos_row[p] : p;
    const float g = gates[(size_t)row * r.E + e];
    return isnan(g) ? -INFINITY : g;
}

// A key whose ascending order is d's descending order; -0.0 and +0.0 get the same key.
__device__ static inline unsigned long long desc_key(double d) {
    if (d == 0) d = 0.0;
    unsigned long long u = (unsigned long long)__double_as_longlong(d);
    u = (u >> 63) ? ~u : (u | 0x8000000000000000ull); // ascending in d
    return ~u;
}

// ---- tokens choice

// Top-K of each position (route.c step 1) and its BPR key; vals: the position itself.
__global__ static void k_topk(be_route r, const float *gates, int32_t *expert, unsigned long long *key,
                              int32_t *val) {
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= r.n) return;
    int prev = -1;
    float gprev = 0;
    for (int k = 0; k < r.K; k++) {
        int best = -1;
        float gbest = 0;
        for (int e = 0; e < r.E; e++) {
            const float g = gate_at(r, gates, p, e);
            if (prev >= 0 && !(g < gprev || (g == gprev && e > prev))) continue;
            if (best < 0 || g > gbest) best = e, gbest = g;
        }
        // with no NaN the order is total, so K <= E distinct experts are always found
        expert[(size_t)p * r.K + k] = best < 0 ? 0 : best;
        prev = best, gprev = gbest;
    }
    double s = 0;
    if (r.bpr_score == VLMOE_BPR_SUM)
        for (int k = 0; k < r.K; k++) s += (double)gate_at(r, gates, p, expert[(size_t)p * r.K + k]);
    else
        s = (double)gate_at(r, gates, p, expert[(size_t)p * r.K]);
    key[p] = desc_key(s);
    val[p] = p;
}

// key[q] = the group of the position val[q] (for the stable regrouping after the BPR sort)
__global__ static void k_group_of(unsigned long long *key, const int32_t *val, int n, int S) {
    const int q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q < n) key[q] = (unsigned long long)(val[q] / S);
}

__global__ static void k_iota(int32_t *v, int n) {
    const int q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q < n) v[q] = q;
}

// Assignment a = (g, k, i) in dispatch order (index g S K + k S + i): its (group, expert) key and
// the counts before capacity, all and per modality. ord (n): group g's dispatch order at g S.
__global__ static void k_assign(be_route r, const int32_t *ord, const int32_t *expert, unsigned long long *key,
                                int32_t *val, int32_t *cnt, int32_t *wanted) {
    const long a = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const long SK = (long)r.S * r.K;
    if (a >= SK * r.G) return;
    const int g = (int)(a / SK), k = (int)(a % SK / r.S), i = (int)(a % r.S);
    const int p = ord[g * r.S + i], e = expert[(size_t)p * r.K + k];
    key[a] = (unsigned long long)g * r.E + e;
    val[a] = (int32_t)a;
    atomicAdd(&cnt[g * r.E + e], 1);
    atomicAdd(&wanted[((size_t)g * 3 + 1 + (r.mod && r.mod[p] ? 1 : 0)) * r.E + e], 1);
}

// wanted (all) and count per (group, expert)
__global__ static void k_counts(be_route r, const int32_t *cnt, int32_t *count, int32_t *wanted) {
    const int x = blockIdx.x * blockDim.x + threadIdx.x;
    if (x >= r.G * r.E) return;
    const int g = x / r.E, e = x % r.E;
    wanted[(size_t)g * 3 * r.E + e] = cnt[x];
    count[x] = cnt[x] < r.C ? cnt[x] : r.C;
}

// Sorted assignment q: its rank in its (group, expert) run is its arrival there (route.c 3-4).
__global__ static void k_slots(be_route r, const float *gates, const int32_t *ord, const int32_t *expert,
                               const unsigned long long *key, const int32_t *val, const int32_t *seg,
                               int32_t *slot, int32_t *token, float *weight) {
    const long q = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const long SK = (long)r.S * r.K;
    if (q >= SK * r.G) return;
    const int ge = (int)key[q], a = val[q];
    const int rank = (int)(q - seg[ge]);
    const int g = (int)(a / SK), k = (int)(a % SK / r.S), i = (int)(a % r.S);
    const int p = ord[g * r.S + i], e = expert[(size_t)p * r.K + k];
    if (rank < r.C) {
        slot[(size_t)p * r.K + k] = rank;
        token[(size_t)ge * r.C + rank] = p - g * r.S;
        weight[(size_t)ge * r.C + rank] = gate_at(r, gates, p, e);
    } else {
        slot[(size_t)p * r.K + k] = -1;
    }
}

// route.c step 5: dropped tokens and the renormalisation over accepted gates, one thread a token
__global__ static void k_renorm(be_route r, const int32_t *expert, const int32_t *slot, float *weight,
                                uint8_t *dropped) {
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= r.n) return;
    const int g = p / r.S;
    double sum = 0;
    int kept = 0;
    for (int k = 0; k < r.K; k++) {
        const int sl = slot[(size_t)p * r.K + k];
        if (sl < 0) continue;
        kept++;
        sum += (double)weight[((size_t)g * r.E + expert[(size_t)p * r.K + k]) * r.C + sl];
    }
    dropped[p] = kept == 0;
    if (r.gate_renorm == VLMOE_RENORM_AFTER_ROUTING && kept && sum > 0)
        for (int k = 0; k < r.K; k++) {
            const int sl = slot[(size_t)p * r.K + k];
            if (sl < 0) continue;
            float *w = &weight[((size_t)g * r.E + expert[(size_t)p * r.K + k]) * r.C + sl];
            *w = (float)((double)*w / sum);
        }
}

// ---- experts choice: item x = ((g E + e) S + i), keyed by the gate of (g S + i, e)

__global__ static void k_ec_keys(be_route r, const float *gates, unsigned long long *key, int32_t *val) {
    const long x = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (x >= (long)r.n * r.E) return;
    const int ge = (int)(x / r.S), i = (int)(x % r.S), g = ge / r.E, e = ge % r.E;
    key[x] = desc_key((double)gate_at(r, gates, g * r.S + i, e));
    val[x] = (int32_t)x;
}
__global__ static void k_seg_of(unsigned long long *key, const int32_t *val, long m, int S) {
    const long q = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (q < m) key[q] = (unsigned long long)(val[q] / S);
}
// sorted item q: rank q mod S in its (group, expert) run; the first min(C, S) are taken
__global__ static void k_ec_take(be_route r, const float *gates, const int32_t *val, int32_t *token, float *weight,
                                 int32_t *count, int32_t *wanted, uint8_t *dropped) {
    const long q = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= (long)r.n * r.E) return;
    const int take = r.C < r.S ? r.C : r.S;
    const int ge = (int)(q / r.S), c = (int)(q % r.S), g = ge / r.E, e = ge % r.E;
    if (c == 0) count[ge] = take, wanted[(size_t)g * 3 * r.E + e] = take;
    if (c >= take) return;
    const int i = val[q] % r.S;
    token[(size_t)ge * r.C + c] = i;
    weight[(size_t)ge * r.C + c] = gate_at(r, gates, g * r.S + i, e);
    dropped[g * r.S + i] = 0; // every writer writes 0
}

// ---- the packed layout

// expert_off (E+1) and base (G,E): the first row of (group g, expert e). One block. The fixed
// layout's are e G C and e G C + g C, whatever the counts.
__global__ static void k_offsets(be_route r, const int32_t *count, int32_t *expert_off, int32_t *base) {
    if (r.fixed) {
        for (int x = threadIdx.x; x <= r.G * r.E; x += blockDim.x) {
            if (x <= r.E) expert_off[x] = x * r.G * r.C;
            if (x < r.G * r.E) base[x] = (x % r.E) * r.G * r.C + (x / r.E) * r.C;
        }
        return;
    }
    for (int e = threadIdx.x; e < r.E; e += blockDim.x) {
        int c = 0;
        for (int g = 0; g < r.G; g++) c += count[g * r.E + e];
        base[e] = c; // per-expert total, for the scan below
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int at = 0;
        for (int e = 0; e < r.E; e++) {
            const int c = base[e];
            expert_off[e] = at;
            at += c;
        }
        expert_off[r.E] = at;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < r.E; e += blockDim.x) {
        int at = expert_off[e];
        for (int g = 0; g < r.G; g++) {
            base[g * r.E + e] = at; // row g = 0 overwrites the total read above, by its own thread
            at += count[g * r.E + e];
        }
    }
}

// Slot c of (g, e): row base + c (the fixed layout: an empty slot is a padding row, token -1).
// Rows past rows_max are never written (the host refuses them when it reads expert_off; the
// fixed layout's G E C rows are checked before any launch).
__global__ static void k_rows(be_route r, const int32_t *count, const int32_t *base, const int32_t *token,
                              int32_t *row_token, int32_t *row_expert, int rows_max) {
    const long x = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (x >= (long)r.G * r.E * r.C) return;
    const int ge = (int)(x / r.C), c = (int)(x % r.C);
    if (c >= count[ge] && !r.fixed) return;
    const int row = base[ge] + c, g = ge / r.E;
    if (row >= rows_max) return;
    if (c >= count[ge]) {
        row_token[row] = -1, row_expert[row] = ge % r.E;
        return;
    }
    const int p = g * r.S + token[x];
    row_token[row] = r.pos_row ? r.pos_row[p] : p;
    row_expert[row] = ge % r.E;
}

// Rows keyed by token (rows past the decision's last and padding rows keyed n: they sort last,
// so tok_rows lists the filled rows only) and counted.
__global__ static void k_tok_keys(const int32_t *row_token, const int32_t *expert_off, int E, int n, int rows_max,
                                  unsigned long long *key, int32_t *val, int32_t *tcnt) {
    const int q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= rows_max) return;
    const int rows = expert_off[E] < rows_max ? expert_off[E] : rows_max;
    const int t = q < rows && row_token[q] >= 0 ? row_token[q] : n;
    key[q] = (unsigned long long)t;
    val[q] = q;
    if (t < n) atomicAdd(&tcnt[t], 1);
}

// ---- the op

static int bits_for(unsigned long long maxval) {
    int b = 1;
    while (b < 64 && (1ull << b) <= maxval) b++;
    return b;
}

static size_t align256(size_t b) { return (b + 255) & ~(size_t)255; }

#define FAILED(call) CK("route", (call))
#define LAUNCH_OK() (!LAUNCHED("route"))

static int cuda_route(const backend *be, const float *gates, const be_route *rp, const be_route_out *o) {
    const be_route r = *rp;
    if (r.S < 1 || r.G < 1 || (long)r.S * r.G != r.n || r.E < 1 || r.K < 1 || r.C < 1 || (!r.experts_choice && r.K > r.E))
        return vlmoe_fail(VLMOE_ERR_ARG, "CUDA backend, op route: need n = G*S tokens and S, G, E, C >= 1, "
                          "1 <= K <= E (got n=%d S=%d G=%d E=%d K=%d C=%d)", r.n, r.S, r.G, r.E, r.K, r.C);
    if (!r.experts_choice && r.order != VLMOE_ORDER_FIFO && r.order != VLMOE_ORDER_BPR)
        return vlmoe_fail(VLMOE_ERR_ARG, "CUDA backend, op route: dispatch order %d is routed on the host "
                          "(supports says no)", r.order);
    if (r.pools && !r.mod)
        return vlmoe_fail(VLMOE_ERR_ARG, "CUDA backend, op route: disjoint pools route by modality, and none was given");
    if ((long)r.n * (r.experts_choice ? r.E : r.K) > 0x7fffffffL || (long)r.G * r.E * r.C > 0x7fffffffL)
        return vlmoe_fail(VLMOE_ERR_ARG, "CUDA backend, op route: %d tokens x %d experts is past the int32 "
                          "indices of the layout", r.n, r.E);
    if (r.fixed && (long)r.G * r.E * r.C > o->rows_max)
        return vlmoe_fail(VLMOE_ERR_ARG, "CUDA backend, op route: %ld fixed-capacity rows exceed the %d the layer "
                          "planned", (long)r.G * r.E * r.C, o->rows_max);
    cudaStream_t st = stream_of(be);
    const int n = r.n, E = r.E, K = r.K, G = r.G, GE = G * E, rows_max = o->rows_max;
    const long na = r.experts_choice ? (long)n * E : (long)n * K; // sorted items of the decision
    const long nk = na > rows_max ? (na > n ? na : n) : (rows_max > n ? rows_max : n);
    // CUB's temp storage: the most any sort or scan of this call asks for (host-side queries,
    // each with the call's own item count and key bits)
    const int bG = bits_for((unsigned long long)G), bGE = bits_for((unsigned long long)GE);
    const int bN = bits_for((unsigned long long)n);
    const struct { long items; int bits; } sorts[] = {{n, 64}, {n, bG}, {na, bGE}, {na, 64}, {rows_max, bN}};
    size_t temp_b = 0;
    for (size_t i = 0; i < sizeof(sorts) / sizeof(sorts[0]); i++) {
        size_t b = 0;
        if (sorts[i].items > 0 &&
            FAILED(cub::DeviceRadixSort::SortPairs(NULL, b, (unsigned long long *)NULL, (unsigned long long *)NULL,
                                                   (int32_t *)NULL, (int32_t *)NULL, (int)sorts[i].items, 0,
                                                   sorts[i].bits, st)))
            return VLMOE_ERR_ARG;
        temp_b = b > temp_b ? b : temp_b;
    }
    const int scans[] = {GE, n + 1};
    for (int i = 0; i < 2; i++) {
        size_t b = 0;
        if (FAILED(cub::DeviceScan::ExclusiveSum(NULL, b, (int32_t *)NULL, (int32_t *)NULL, scans[i], st)))
            return VLMOE_ERR_ARG;
        temp_b = b > temp_b ? b : temp_b;
    }
    const size_t bk = align256(sizeof(unsigned long long) * nk), bv = align256(sizeof(int32_t) * nk);
    const size_t bn = align256(sizeof(int32_t) * ((size_t)n + 1)), bge = align256(sizeof(int32_t) * (GE + 1));
    const size_t need = 2 * bk + 2 * bv + 2 * bn + 3 * bge + align256(temp_b);
    cuda_ctx *c = ctx_of(be);
    char *ws = (char *)cu_grow(be, &c->route_ws, &c->route_ws_bytes, need, "route", "routing keys and CUB storage");
    if (!ws) return VLMOE_ERR_NOMEM;
    unsigned long long *k0 = (unsigned long long *)ws, *k1 = (unsigned long long *)(ws + bk);
    int32_t *v0 = (int32_t *)(ws + 2 * bk), *v1 = (int32_t *)(ws + 2 * bk + bv);
    int32_t *ord = (int32_t *)(ws + 2 * bk + 2 * bv), *tcnt = (int32_t *)(ws + 2 * bk + 2 * bv + bn);
    int32_t *cnt = (int32_t *)(ws + 2 * bk + 2 * bv + 2 * bn), *seg = cnt + bge / sizeof(int32_t);
    int32_t *base = seg + bge / sizeof(int32_t);
    void *temp = ws + 2 * bk + 2 * bv + 2 * bn + 3 * bge;
    size_t tb = temp_b;
    const unsigned T = RT_THREADS;

    // empty slots, no counts yet
    if (FAILED(cudaMemsetAsync(o->token, 0xff, sizeof(int32_t) * (size_t)GE * r.C, st)) ||
        FAILED(cudaMemsetAsync(o->weight, 0, sizeof(float) * (size_t)GE * r.C, st)) ||
        FAILED(cudaMemsetAsync(o->wanted, 0, sizeof(int32_t) * 3 * (size_t)GE, st)) ||
        FAILED(cudaMemsetAsync(cnt, 0, sizeof(int32_t) * (size_t)GE, st)))
        return VLMOE_ERR_ARG;
    if (!r.experts_choice) {
        k_topk<<<cu_blocks((size_t)n, T), T, 0, st>>>(r, gates, o->expert, k0, v0);
        if (!LAUNCH_OK()) return VLMOE_ERR_ARG;
        if (r.order == VLMOE_ORDER_BPR) {
            // descending key, ties in position order; then by group, each group's order kept
            tb = temp_b;
            if (FAILED(cub::DeviceRadixSort::SortPairs(temp, tb, k0, k1, v0, v1, n, 0, 64, st))) return VLMOE_ERR_ARG;
            k_group_of<<<cu_blocks((size_t)n, T), T, 0, st>>>(k0, v1, n, r.S);
            if (!LAUNCH_OK()) return VLMOE_ERR_ARG;
            tb = temp_b;
            if (FAILED(cub::DeviceRadixSort::SortPairs(temp, tb, k0, k1, v1, ord, n, 0, bG, st)))
                return VLMOE_ERR_ARG;
        } else {
            k_iota<<<cu_blocks((size_t)n, T), T, 0, st>>>(ord, n);
            if (!LAUNCH_OK()) return VLMOE_ERR_ARG;
        }
        k_assign<<<cu_blocks((size_t)na, T), T, 0, st>>>(r, ord, o->expert, k0, v0, cnt, o->wanted);
        if (!LAUNCH_OK()) return VLMOE_ERR_ARG;
        k_counts<<<cu_blocks((size_t)GE, T), T, 0, st>>>(r, cnt, o->count, o->wanted);
        if (!LAUNCH_OK()) return VLMOE_ERR_ARG;
        tb = temp_b;
        if (FAILED(cub::DeviceRadixSort::SortPairs(temp, tb, k0, k1, v0, v1, (int)na, 0, bGE, st)))
            return VLMOE_ERR_ARG;
        tb = temp_b;
        if (FAILED(cub::DeviceScan::ExclusiveSum(temp, tb, cnt, seg, GE, st))) return VLMOE_ERR_ARG;
        k_slots<<<cu_blocks((size_t)na, T), T, 0, st>>>(r, gates, ord, o->expert, k1, v1, seg, o->slot, o->token,
                                                       o->weight);
        if (!LAUNCH_OK()) return VLMOE_ERR_ARG;
        k_renorm<<<cu_blocks((size_t)n, T), T, 0, st>>>(r, o->expert, o->slot, o->weight, o->dropped);
        if (!LAUNCH_OK()) return VLMOE_ERR_ARG;
    } else {
        // per-token choice arrays mean nothing here: -1, as route.c marks them
        if (FAILED(cudaMemsetAsync(o->expert, 0xff, sizeof(int32_t) * (size_t)n * K, st)) ||
            FAILED(cudaMemsetAsync(o->slot, 0xff, sizeof(int32_t) * (size_t)n * K, st)) ||
            FAILED(cudaMemsetAsync(o->dropped, 1, (size_t)n, st)))
            return VLMOE_ERR_ARG;
        k_ec_keys<<<cu_blocks((size_t)na, T), T, 0, st>>>(r, gates, k0, v0);
        if (!LAUNCH_OK()) return VLMOE_ERR_ARG;
        tb = temp_b;
        if (FAILED(cub::DeviceRadixSort::SortPairs(temp, tb, k0, k1, v0, v1, (int)na, 0, 64, st))) return VLMOE_ERR_ARG;
        k_seg_of<<<cu_blocks((size_t)na, T), T, 0, st>>>(k0, v1, na, r.S);
        if (!LAUNCH_OK()) return VLMOE_ERR_ARG;
        tb = temp_b;
        if (FAILED(cub::DeviceRadixSort::SortPairs(temp, tb, k0, k1, v1, v0, (int)na, 0, bGE, st)))
            return VLMOE_ERR_ARG;
        k_ec_take<<<cu_blocks((size_t)na, T), T, 0, st>>>(r, gates, v0, o->token, o->weight, o->count, o->wanted,
                                                         o->dropped);
        if (!LAUNCH_OK()) return VLMOE_ERR_ARG;
    }
    // the layout: offsets, rows, then each token's rows in row order
    k_offsets<<<1, T, 0, st>>>(r, o->count, o->expert_off, base);
    if (!LAUNCH_OK()) return VLMOE_ERR_ARG;
    k_rows<<<cu_blocks((size_t)GE * r.C, T), T, 0, st>>>(r, o->count, base, o->token, o->row_token, o->row_expert,
                                                        rows_max);
    if (!LAUNCH_OK()) return VLMOE_ERR_ARG;
    if (FAILED(cudaMemsetAsync(tcnt, 0, sizeof(int32_t) * ((size_t)n + 1), st))) return VLMOE_ERR_ARG;
    if (rows_max > 0) {
        k_tok_keys<<<cu_blocks((size_t)rows_max, T), T, 0, st>>>(o->row_token, o->expert_off, E, n, rows_max, k0, v0,
                                                                 tcnt);
        if (!LAUNCH_OK()) return VLMOE_ERR_ARG;
        tb = temp_b;
        if (FAILED(cub::DeviceRadixSort::SortPairs(temp, tb, k0, k1, v0, o->tok_rows, rows_max, 0, bN, st)))
            return VLMOE_ERR_ARG;
    }
    tb = temp_b;
    if (FAILED(cub::DeviceScan::ExclusiveSum(temp, tb, tcnt, o->tok_off, n + 1, st))) return VLMOE_ERR_ARG;
    return VLMOE_OK;
}

void cuda_fill_route(backend *be) { be->route = cuda_route; }
