// bench_act.c: the activations' kernels (src/ops/act_avx2.c), in AVX2 and, where the CPU has
// it, AVX-512, nanoseconds an element, for each kind: act_bias_simd (the forward epilogue:
// h += b, a = act(h)) and act_grad_simd (the backward's: g *= act'(h), a = act(h)), two ways:
//   l1    one row of 1024 floats, over and over: the kernels' own rate, data in L1;
//   step  as a training step's product epilogue meets them at bench-s's shapes: 5184 x 1024
//         (tokens x mlp), blocks of 144 rows by 64 columns of h at leading dimension 1024, a
//         written to an array of the same size, every value once a pass (memory as well).
// g is set back to ones before each pass (and in l1 before each repetition of the row, 1-2% of
// the time): multiplied in place pass after pass it would drift through the subnormals to 0 or
// +inf, values a step's gradients never hold. Medians of reps passes. Without AVX2 and FMA it
// prints one line saying so and exits 0 (the scalar forms in src/ops/ops.c run there).
// Usage: bench_act [reps]
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "ops/act_avx2.h"
#include "vlmoe.h"

enum { ROW = 1024, ROW_REPS = 2000, N = 5184, M = 1024, MB = 144, NB = 64 };

static double median(double *t, int n) {
    qsort(t, (size_t)n, sizeof(double), bench_cmp);
    return t[n / 2];
}

// one pass, in seconds: the kernel (grad 0: act_bias_simd, 1: act_grad_simd) over rows of n at
// leading dimension ld, in blocks of mb rows by nb columns (the whole row when nb is n), reps
// times; for the gradient, g (rows x ld) is set to ones first, and again before each
// repetition, copied from the ones set after it, when reps > 1 (g then holds twice rows x ld)
static double pass(int grad, int kind, float *h, float *a, float *g, const float *b, int rows, int n, int ld,
                   int mb, int nb, int reps) {
    for (size_t i = 0; grad && i < (size_t)rows * ld * (reps > 1 ? 2 : 1); i++) g[i] = 1;
    const double t0 = bench_now();
    for (int r = 0; r < reps; r++) {
        if (grad && r) memcpy(g, g + (size_t)rows * ld, sizeof(float) * (size_t)rows * ld);
        for (int i0 = 0; i0 < rows; i0 += mb)
            for (int c0 = 0; c0 < n; c0 += nb)
                for (int i = i0; i < i0 + mb && i < rows; i++) {
                    const size_t o = (size_t)i * ld + c0;
                    if (grad) act_grad_simd(g + o, a + o, h + o, nb, kind);
                    else act_bias_simd(a + o, h + o, b + c0, nb, kind);
                }
    }
    return bench_now() - t0;
}

int main(int argc, char **argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 5;
    if (reps < 1) {
        fprintf(stderr, "usage: bench_act [reps], reps positive\n");
        return 2;
    }
    if (!act_avx2_supported()) {
        printf("bench_act: skipped: this CPU lacks AVX2 or FMA (the activations run their scalar form)\n");
        return 0;
    }
    const size_t big = (size_t)N * M;
    float *h = aligned_alloc(64, sizeof(float) * big), *a = aligned_alloc(64, sizeof(float) * big);
    float *g = aligned_alloc(64, sizeof(float) * big), *b = aligned_alloc(64, sizeof(float) * M);
    if (!h || !a || !g || !b) {
        fprintf(stderr, "bench_act: out of memory (4 x %zu MB)\n", sizeof(float) * big >> 20);
        free(h), free(a), free(g), free(b);
        return 1;
    }
    // pre-activations spread over [-2.9, 2.9], where GELU's curve bends, and a bias of zeros (h
    // keeps its values pass after pass); pass() sets the gradients to ones
    for (size_t i = 0; i < big; i++) h[i] = (float)((int)(i % 97) - 48) * 0.06f, a[i] = 0;
    for (int j = 0; j < M; j++) b[j] = 0;
    static const char *names[3] = {"gelu", "gelu_tanh", "quick_gelu"};
    static const char *isa[2] = {"avx2", "avx512"};
    printf("ns an element (medians of %d passes)             forward   gradient\n", reps);
    for (int wide = 0; wide < 2; wide++) {
        if (act_simd_avx512(wide) == 0 && wide) break;
        for (int kind = 0; kind < 3; kind++) {
            double t[2][2][64];
            for (int r = 0; r < reps && r < 64; r++)
                for (int grad = 0; grad < 2; grad++) {
                    t[0][grad][r] =
                        pass(grad, kind, h, a, g, b, 1, ROW, ROW, 1, ROW, ROW_REPS) / ((double)ROW * ROW_REPS);
                    t[1][grad][r] = pass(grad, kind, h, a, g, b, N, M, M, MB, NB, 1) / (double)big;
                }
            const int n = reps < 64 ? reps : 64;
            printf("%-10s %-6s l1   (a row of %d)            %6.2f     %6.2f\n", names[kind], isa[wide], ROW,
                   1e9 * median(t[0][0], n), 1e9 * median(t[0][1], n));
            printf("%-10s %-6s step (%d x %d, %dx%d blocks) %6.2f     %6.2f\n", names[kind], isa[wide], N, M, MB, NB,
                   1e9 * median(t[1][0], n), 1e9 * median(t[1][1], n));
        }
    }
    act_simd_avx512(1);
    free(h), free(a), free(g), free(b);
    return 0;
}
