// bench_peak.c: the machine's arithmetic peak, measured rather than taken from a data sheet: an
// fp32 FMA loop (vfmadd231ps on the widest registers the CPU has: 512-bit with AVX-512, else
// 256-bit with AVX2 and FMA3), a bf16 dot-product loop (vdpbf16ps) and, on CPUs with AMX, tile
// loops of tdpbf16ps and tdpbssd, all touching no memory, run on every thread at once.
// bench/speed.py reports the training step's matrix-product FLOP/s as a fraction of these. Prints
// one JSON line naming the fp32 loop's ISA; a peak is 0 on a CPU without the instruction (or, for
// AMX, where the kernel does not hand the process the tile state). Usage: bench_peak [threads] [reps]
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "bench.h"

// Sixteen independent accumulators: more than an FMA's latency (4 cycles) times its ports (2),
// so the loop is limited by throughput, not by the dependency chains. They are named variables,
// not an array: GCC keeps an array of vectors on the stack and the loop would then measure loads
// and stores. The chains start from the argument and the result is stored, so nothing folds.
#define ACCS 16
#define ITERS 5000000L
#define DECL16(T, init) T a0 = init(0), a1 = init(1), a2 = init(2), a3 = init(3), a4 = init(4), \
    a5 = init(5), a6 = init(6), a7 = init(7), a8 = init(8), a9 = init(9), a10 = init(10),     \
    a11 = init(11), a12 = init(12), a13 = init(13), a14 = init(14), a15 = init(15)
#define STEP16(OP) a0 = OP(a0), a1 = OP(a1), a2 = OP(a2), a3 = OP(a3), a4 = OP(a4), a5 = OP(a5), \
    a6 = OP(a6), a7 = OP(a7), a8 = OP(a8), a9 = OP(a9), a10 = OP(a10), a11 = OP(a11),          \
    a12 = OP(a12), a13 = OP(a13), a14 = OP(a14), a15 = OP(a15)
#define SUM16 _mm512_reduce_add_ps(_mm512_add_ps(                                                 \
    _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),                   \
                  _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7))),                  \
    _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)),                 \
                  _mm512_add_ps(_mm512_add_ps(a12, a13), _mm512_add_ps(a14, a15)))))
#define INIT(i) _mm512_set1_ps(seed + (float)(i))

// vfmadd231ps: 16 lanes, 2 FLOP each, 32 FLOP per instruction.
__attribute__((target("avx512f"))) static float fma_loop(float seed, long iters) {
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f * seed);
#define FMA(x) _mm512_fmadd_ps(x, a, b)
    DECL16(__m512, INIT);
    for (long it = 0; it < iters; it++) STEP16(FMA);
    return SUM16;
}

// vdpbf16ps: each 32-bit lane adds two bf16 products, 64 FLOP per 512-bit instruction.
__attribute__((target("avx512f,avx512bf16"))) static float dpbf16_loop(float seed, long iters) {
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3380);
#define DOT(x) _mm512_dpbf16_ps(x, a, b)
    DECL16(__m512, INIT);
    for (long it = 0; it < iters; it++) STEP16(DOT);
    return SUM16;
}

// The same loop on 256-bit registers, 8 lanes, 16 FLOP per instruction. AVX2 has 16 ymm registers,
// two of which hold the operands, so twelve accumulators: still more than latency times ports on
// the CPUs that have it (Zen 3: 3 cycles x 2 ports; Haswell to Alder Lake: 4-5 x 2), and none spills.
#define DECL12(T, init) T a0 = init(0), a1 = init(1), a2 = init(2), a3 = init(3), a4 = init(4), \
    a5 = init(5), a6 = init(6), a7 = init(7), a8 = init(8), a9 = init(9), a10 = init(10),     \
    a11 = init(11)
#define STEP12(OP) a0 = OP(a0), a1 = OP(a1), a2 = OP(a2), a3 = OP(a3), a4 = OP(a4), a5 = OP(a5), \
    a6 = OP(a6), a7 = OP(a7), a8 = OP(a8), a9 = OP(a9), a10 = OP(a10), a11 = OP(a11)
#define INIT8(i) _mm256_set1_ps(seed + (float)(i))
#define ADD8 _mm256_add_ps
__attribute__((target("avx2,fma"))) static float fma_loop_avx2(float seed, long iters) {
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f * seed);
#define FMA8(x) _mm256_fmadd_ps(x, a, b)
    DECL12(__m256, INIT8);
    for (long it = 0; it < iters; it++) STEP12(FMA8);
    __m256 s = ADD8(ADD8(ADD8(ADD8(a0, a1), ADD8(a2, a3)), ADD8(ADD8(a4, a5), ADD8(a6, a7))),
                    ADD8(ADD8(a8, a9), ADD8(a10, a11)));
    float l[8];
    _mm256_storeu_ps(l, s);
    return l[0] + l[1] + l[2] + l[3] + l[4] + l[5] + l[6] + l[7];
}

// AMX: eight tile registers of up to 16 rows of 64 bytes. Four accumulators C[i][j] += A[i] B[j]
// (2 x 2, as the library kernels block), two A and two B tiles loaded once: each tdpbf16ps is a
// 16 x 16 x 32 product (16384 FLOP), each tdpbssd 16 x 16 x 64 in int8 (32768 operations). Four
// chains of one instruction each cover its latency at the TMUL's rate of one per 16 cycles.
struct tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// AMX-TILE, AMX-BF16 and AMX-INT8: CPUID leaf 7's EDX bits 24, 22 and 25 (read directly:
// clang 14's __builtin_cpu_supports knows no AMX names)
static int amx_present(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return (d >> 24 & 1) && (d >> 22 & 1) && (d >> 25 & 1);
}

// Linux gives a process AMX's tile data state only when it asks (ARCH_REQ_XCOMP_PERM, 0x1023,
// for XFEATURE_XTILEDATA, 18); without it the first tile instruction faults. 1 when granted.
static int amx_permitted(void) {
#ifdef __linux__
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return 0;
#endif
}

// int8: tdpbssd (signed x signed to int32); its sums are exact, so the inputs are small enough
// that a lane's 64 x iters products stay inside int32 and the result depends on every step.
#define AMX_LOOP(name, targets, OP, a_fill, b_fill, T)                                                   \
    __attribute__((target(targets))) static float name(float seed, long iters) {                        \
        struct tilecfg cfg;                                                                             \
        memset(&cfg, 0, sizeof cfg);                                                                    \
        cfg.palette = 1;                                                                                \
        for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;                                \
        _tile_loadconfig(&cfg);                                                                         \
        uint32_t a[256], b[256];                                                                        \
        T c[4][256];                                                                                    \
        for (int i = 0; i < 256; i++) a[i] = a_fill, b[i] = b_fill, c[0][i] = (T)seed;                  \
        _tile_loadd(0, c[0], 64);                                                                       \
        _tile_loadd(1, c[0], 64);                                                                       \
        _tile_loadd(2, c[0], 64);                                                                       \
        _tile_loadd(3, c[0], 64);                                                                       \
        _tile_loadd(4, a, 64);                                                                          \
        _tile_loadd(5, a, 64);                                                                          \
        _tile_loadd(6, b, 64);                                                                          \
        _tile_loadd(7, b, 64);                                                                          \
        for (long it = 0; it < iters; it++) {                                                           \
            OP(0, 4, 6);                                                                                \
            OP(1, 4, 7);                                                                                \
            OP(2, 5, 6);                                                                                \
            OP(3, 5, 7);                                                                                \
        }                                                                                               \
        _tile_stored(0, c[0], 64);                                                                      \
        _tile_stored(1, c[1], 64);                                                                      \
        _tile_stored(2, c[2], 64);                                                                      \
        _tile_stored(3, c[3], 64);                                                                      \
        float s = 0;                                                                                    \
        for (int i = 0; i < 4 * 256; i++) s += (float)c[i / 256][i % 256];                              \
        _tile_release();                                                                                \
        return s;                                                                                       \
    }
// bf16 pairs: a = (1, 1), b = (2^-24, 2^-24); int8 quads: a = (1,1,1,1), b = (0,0,0,1)
AMX_LOOP(amx_bf16_loop, "amx-tile,amx-bf16", _tile_dpbf16ps, 0x3f803f80u, 0x33803380u, float)
AMX_LOOP(amx_int8_loop, "amx-tile,amx-int8", _tile_dpbssd, 0x01010101u, 0x01000000u, int32_t)

enum loop { LOOP_FMA512, LOOP_FMA256, LOOP_DPBF16, LOOP_AMX_BF16, LOOP_AMX_INT8 };

// Best GFLOP/s of reps runs of the loop on every thread (flop_per_iter for one thread).
static double peak(enum loop loop, int reps, double flop_per_iter, volatile float *sink) {
    // a round of the four tile instructions takes some 8 times a round of the 16 FMAs (16 cycles
    // each at the TMUL's rate, against 2 FMAs a cycle): a quarter of the rounds runs about twice as long
    const long iters = loop == LOOP_AMX_BF16 || loop == LOOP_AMX_INT8 ? ITERS / 4 : ITERS;
    double best = 0;
    for (int r = 0; r < reps; r++) {
        int threads = 1;
        double t0 = bench_now();
#pragma omp parallel
        {
            const float seed = 1.0f + (float)omp_get_thread_num();
            float s = loop == LOOP_DPBF16     ? dpbf16_loop(seed, iters)
                      : loop == LOOP_FMA512   ? fma_loop(seed, iters)
                      : loop == LOOP_FMA256   ? fma_loop_avx2(seed, iters)
                      : loop == LOOP_AMX_BF16 ? amx_bf16_loop(seed, iters)
                                              : amx_int8_loop(seed, iters);
#pragma omp critical
            *sink += s;
#pragma omp single
            threads = omp_get_num_threads();
        }
        double g = threads * flop_per_iter * (double)iters / (bench_now() - t0) * 1e-9;
        best = g > best ? g : best;
    }
    return best;
}

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 0, reps = argc > 2 ? atoi(argv[2]) : 5;
    if (threads > 0) omp_set_num_threads(threads);
    volatile float sink = 0;
    __builtin_cpu_init();
    const int has512 = !!__builtin_cpu_supports("avx512f");
    const int has256 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int hasbf16 = has512 && !!__builtin_cpu_supports("avx512bf16");
    const double fp32 = has512   ? peak(LOOP_FMA512, reps, ACCS * 32.0, &sink)
                        : has256 ? peak(LOOP_FMA256, reps, 12 * 16.0, &sink)
                                 : 0;
    const double bf16 = hasbf16 ? peak(LOOP_DPBF16, reps, ACCS * 64.0, &sink) : 0;
    // the permission is the process's, asked once before the threads start
    const int amx = amx_present() && amx_permitted();
    const double amx_bf16 = amx ? peak(LOOP_AMX_BF16, reps, 4 * 16 * 16 * 32 * 2.0, &sink) : 0;
    const double amx_int8 = amx ? peak(LOOP_AMX_INT8, reps, 4 * 16 * 16 * 64 * 2.0, &sink) : 0;
    printf("{\"threads\": %d, \"fp32_fma_gflops\": %.1f, \"fp32_fma_isa\": \"%s\", "
           "\"bf16_dot_gflops\": %.1f, \"amx_bf16_gflops\": %.1f, \"amx_int8_gops\": %.1f, "
           "\"avx512f\": %d, \"avx512_bf16\": %d, \"amx\": %d, \"sink\": %g}\n",
           omp_get_max_threads(), fp32, has512 ? "avx512f" : has256 ? "avx2+fma" : "none", bf16, amx_bf16,
           amx_int8, has512, hasbf16, amx, (double)sink);
    return 0;
}
