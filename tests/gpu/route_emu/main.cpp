// main.cpp: route_cuda.cu's kernels, run on the host through route_emu.h, against the CPU
// table's route (route.c) on random shapes: tied gates and BPR keys, -0.0 beside +0.0, K = 1 and
// 2, overflow, BPR max/sum/off, renormalisation, experts choice, pools, pruning, permuted
// groups, each in the packed and the fixed-capacity layout (be_route.fixed: padding rows, offsets
// e G C). Every output compared byte for byte. Built and run by tests/gpu/route_emu/run.sh.
#include <cstdio>

#include "route_cuda_emu.cpp"
extern "C" const vlmoe_backend_f32 *backend_cpu_f32(void);

struct shape { int G, S, E, K, C, ec, order, score, renorm, perm, pools; uint64_t pruned; int negzero, kind; };
enum { FLAT, COARSE, SPARSE, UNIFORM };

struct outs {
    std::vector<int32_t> expert, slot, token, count, wanted, row_token, row_expert, tok_rows, tok_off, expert_off;
    std::vector<float> weight;
    std::vector<uint8_t> dropped;
    std::vector<char> work;
    be_route_out o;
    outs(const be_route &r, int rows_max) {
        const size_t nk = (size_t)r.n * r.K, gec = (size_t)r.G * r.E * r.C, ge = (size_t)r.G * r.E;
        expert.assign(nk, 77), slot.assign(nk, 77), token.assign(gec, 77), weight.assign(gec, 7.f);
        count.assign(ge, 77), wanted.assign(3 * ge, 77), dropped.assign(r.n, 7), row_token.assign(rows_max, 77);
        row_expert.assign(rows_max, 77), tok_rows.assign(rows_max, 77), tok_off.assign(r.n + 1, 77);
        expert_off.assign(r.E + 1, 77), work.assign(be_route_work_bytes(r.S, r.E), 0);
        o = be_route_out{expert.data(), slot.data(), token.data(), weight.data(), count.data(), wanted.data(),
                         dropped.data(), row_token.data(), row_expert.data(), tok_rows.data(), tok_off.data(),
                         expert_off.data(), rows_max, work.data()};
    }
};

template <typename T>
static int differs(const char *what, int sh, const std::vector<T> &a, const std::vector<T> &b, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(T))) return printf("shape %d: %s differs at %zu\n", sh, what, i), 1;
    return 0;
}

int main() {
    const std::vector<shape> shapes = {
        {1, 64, 8, 1, 4, 0, 1, 0, 0, 0, 0, 0, 0, COARSE},     {3, 40, 8, 2, 6, 0, 1, 1, 1, 1, 0, 0, 0, COARSE},
        {4, 32, 8, 2, 16, 0, 0, 0, 0, 0, 0, 0, 0, COARSE},    {2, 50, 6, 2, 5, 0, 1, 0, 0, 1, 1, 0, 0, COARSE},
        {3, 24, 8, 1, 4, 1, 0, 0, 0, 1, 0, 0, 0, COARSE},     {1, 10, 4, 1, 16, 1, 0, 0, 0, 0, 0, 0, 0, COARSE},
        {2, 33, 16, 2, 3, 0, 1, 0, 0, 0, 0, 0x8001, 1, COARSE}, {8, 16, 4, 1, 2, 0, 1, 1, 0, 0, 0, 0, 0, FLAT},
        {2, 300, 32, 2, 20, 0, 1, 0, 1, 1, 0, 0, 0, COARSE},  {5, 200, 16, 2, 30, 0, 1, 1, 1, 1, 0, 0, 0, UNIFORM},
        {4, 100, 8, 1, 13, 1, 0, 0, 0, 1, 0, 0, 0, UNIFORM},  {3, 64, 8, 2, 8, 0, 1, 0, 0, 1, 1, 0x4, 0, UNIFORM},
        {2, 40, 4, 1, 12, 0, 1, 0, 0, 0, 0, 0, 1, SPARSE},    {2, 40, 4, 2, 5, 0, 1, 1, 0, 1, 0, 0, 1, SPARSE},
        {2, 40, 4, 1, 30, 1, 0, 0, 0, 1, 0, 0, 1, SPARSE},
    };
    const vlmoe_backend_f32 *cpu = backend_cpu_f32();
    vlmoe_rng rng;
    vlmoe_rng_seed(&rng, 3);
    int bad = 0, runs = 0, nfixed = 0, npad = 0;
    for (int rep = 0; rep < 40; rep++)
        for (size_t sh = 0; sh < shapes.size(); sh++, runs++) {
            const int fixed = rep % 2; // every other round in the fixed-capacity layout
            const shape &x = shapes[sh];
            const int n = x.G * x.S, E = x.E;
            std::vector<float> gates((size_t)n * E);
            std::vector<int32_t> perm(n);
            std::vector<uint8_t> mod(n);
            for (float &g : gates) {
                g = x.kind == FLAT     ? 0.25f
                    : x.kind == SPARSE ? (vlmoe_rng_below(&rng, 4) == 0 ? 0.125f : 0.0f)
                    : x.kind == COARSE ? (float)vlmoe_rng_below(&rng, 4) / 8
                                       : (float)vlmoe_rng_uniform(&rng);
                if (x.negzero && g == 0 && vlmoe_rng_below(&rng, 2)) g = -0.0f;
            }
            for (int i = 0; i < n; i++) perm[i] = i, mod[i] = (uint8_t)(i % x.S >= x.S / 2);
            for (int i = n - 1; x.perm && i > 0; i--) std::swap(perm[i], perm[vlmoe_rng_below(&rng, i + 1)]);
            be_route r = {};
            r.n = n, r.S = x.S, r.G = x.G, r.E = E, r.K = x.K, r.C = x.C, r.experts_choice = x.ec;
            r.order = x.order, r.bpr_score = x.score, r.gate_renorm = x.renorm, r.pruned = x.pruned;
            r.pools = x.pools, r.pool[0][0] = 0, r.pool[0][1] = E - 2, r.pool[1][0] = E - 2, r.pool[1][1] = 2;
            r.pos_row = x.perm ? perm.data() : nullptr, r.mod = mod.data(), r.fixed = fixed;
            const long cap = (long)x.G * E * x.C;
            const long rows_max = fixed || x.ec || (long)n * x.K > cap ? cap : (long)n * x.K;
            outs a(r, (int)rows_max), b(r, (int)rows_max);
            if (cpu->route(cpu, gates.data(), &r, &a.o) || cuda_route(nullptr, gates.data(), &r, &b.o))
                return printf("shape %zu: %s\n", sh, vlmoe_last_error()), 1;
            const size_t nk = (size_t)n * x.K, gec = (size_t)x.G * E * x.C, ge = (size_t)x.G * E;
            // tok_rows lists the filled rows only (past tok_off[n]: unspecified, the fixed layout's
            // padding rows on the device)
            const size_t rows = (size_t)a.expert_off[E];
            const int d = differs("expert", sh, a.expert, b.expert, nk) + differs("slot", sh, a.slot, b.slot, nk) +
                          differs("token", sh, a.token, b.token, gec) + differs("weight", sh, a.weight, b.weight, gec) +
                          differs("count", sh, a.count, b.count, ge) + differs("wanted", sh, a.wanted, b.wanted, 3 * ge) +
                          differs("dropped", sh, a.dropped, b.dropped, n) +
                          differs("expert_off", sh, a.expert_off, b.expert_off, E + 1) +
                          differs("row_token", sh, a.row_token, b.row_token, rows) +
                          differs("row_expert", sh, a.row_expert, b.row_expert, rows) +
                          differs("tok_rows", sh, a.tok_rows, b.tok_rows, (size_t)a.tok_off[n]) +
                          differs("tok_off", sh, a.tok_off, b.tok_off, n + 1);
            int pad = 0; // the fixed layout: offsets e G C, and some padding row where a slot is empty
            for (int e = 0; fixed && e <= E; e++) pad += a.expert_off[e] != e * x.G * x.C;
            if (pad) printf("shape %zu: fixed-layout offsets are not e G C\n", sh);
            bad += d != 0 || pad != 0;
            nfixed += fixed, npad += fixed && std::count(b.row_token.begin(), b.row_token.begin() + rows, -1) > 0;
        }
    printf("route_cuda.cu's kernels on the host against route.c: %d of %d shape runs differ (%d in the fixed "
           "layout, %d of them with padding rows)\n", bad, runs, nfixed, npad);
    return bad != 0 || npad == 0;
}
