// groups.c: how the tokens of a forward pass split into one MoE layer's routing groups (MOE.md
// "Notation" and "Grouped routing"; LIMoE appendix E.5): groups of group_size consecutive rows,
// or, in a one-tower encoder, groups of whole examples (the image and text tokens of the same
// image-text pairs, image tokens first unless text_first) with the row order that visits them;
// and that the capacity per group is at least one. Covered by tests/test_moe_layer.c.
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/core.h"
#include "moe/layer.h"

// "a, b, c" for k*unit over the divisors k of count, the last ones when there are many.
static void valid_sizes(char *buf, size_t cap, int unit, int count) {
    int list[12], nl = 0, skipped = 0;
    for (int k = 1; k <= count; k++) {
        if (count % k) continue;
        if (nl == 12) memmove(list, list + 1, sizeof(int) * 11), nl--, skipped = 1;
        list[nl++] = k * unit;
    }
    size_t u = (size_t)snprintf(buf, cap, "%s", skipped ? "..., " : "");
    for (int i = 0; i < nl && u < cap; i++) u += (size_t)snprintf(buf + u, cap - u, "%s%d", i ? ", " : "", list[i]);
}

int moe_capacity(const vlmoe_moe_config *c, int S, int training, int *C) {
    // CLIP-UP writes B_e = (B_t/E) x C for its top-2 routing: no K (MOE.md, CLIP-UP sec. 3)
    const int K = c->router == VLMOE_ROUTER_TOKENS && !c->capacity_per_token ? c->top_k : 1;
    int st = vlmoe_capacity(S, c->num_experts, K, training ? c->capacity_factor : c->eval_capacity_factor,
                            c->capacity_multiple > 0 ? c->capacity_multiple : 1, C);
    if (st) return vlmoe_error_prefix("moe (%d tokens per group, %d experts)", S, c->num_experts), st;
    if (*C > S) *C = S; // an expert never holds more than every token of its group
    return VLMOE_OK;
}

static int check_capacity(const moe_spec *sp, int S, int training) {
    int C;
    return sp->cfg->router == VLMOE_ROUTER_SOFT ? VLMOE_OK : moe_capacity(sp->cfg, S, training, &C);
}

// Groups of whole examples. Rows: example b's image tokens at b*ti + i, its text tokens at
// B*ti + b*tt + j (ti, tt: the tokens of each modality present in this pass, 0 if absent).
static int plan_examples(const moe_spec *sp, int n, int training, const moe_examples *ex,
                         const uint8_t *modality, int *S, int32_t *order, int *ordered) {
    const vlmoe_moe_config *c = sp->cfg;
    const int B = ex->B, full = ex->tokens[0] + ex->tokens[1];
    const int has_i = modality[0] == VLMOE_MOD_IMAGE, has_t = modality[n - 1] == VLMOE_MOD_TEXT;
    const int ti = has_i ? ex->tokens[0] : 0, tt = has_t ? ex->tokens[1] : 0;
    if (B < 1 || (long)B * (ti + tt) != n)
        return vlmoe_fail(VLMOE_ERR_ARG, "moe: %d tokens are not %d examples of %d image and %d text "
                          "tokens", n, B, ti, tt);
    int k = B; // examples per group
    if (c->group_size > 0) {
        k = c->group_size / full;
        if (c->group_size % full || k > B || B % k) {
            char ok[160];
            valid_sizes(ok, sizeof(ok), full, B);
            return vlmoe_fail(VLMOE_ERR_CONFIG, "moe: group_size %d does not split this batch of %d "
                              "examples into routing groups of whole examples (one_tower: a group "
                              "holds the %d image + %d text tokens of each of its examples, LIMoE "
                              "E.5): group_size must be a multiple of %d that divides %d (valid: %s; "
                              "0 = one group)", c->group_size, B, ex->tokens[0], ex->tokens[1], full,
                              B * full, ok);
        }
    }
    *S = k * (ti + tt);
    *ordered = has_i && has_t && (c->text_first || k < B);
    if (order) {
        int32_t *o = order;
        for (int g = 0; g < B / k; g++)
            for (int half = 0; half < 2; half++) {
                const int text = (half == 0) == (c->text_first != 0);
                const int per = text ? tt : ti, base = text ? B * ti : 0;
                for (int b = g * k; b < (g + 1) * k; b++)
                    for (int i = 0; i < per; i++) *o++ = base + b * per + i;
            }
    }
    return check_capacity(sp, *S, training);
}

int moe_plan_groups(const moe_spec *sp, int n, int training, const moe_examples *ex,
                    const uint8_t *modality, int *S, int32_t *order, int *ordered) {
    const vlmoe_moe_config *c = sp->cfg;
    *S = n;
    *ordered = 0;
    if (n < 1) return VLMOE_OK;
    if (ex && modality) return plan_examples(sp, n, training, ex, modality, S, order, ordered);
    const int gs = c->group_size > 0 ? c->group_size : n;
    if (gs > n || n % gs) {
        char ok[160];
        valid_sizes(ok, sizeof(ok), 1, n);
        return vlmoe_fail(VLMOE_ERR_CONFIG, "moe: the %d tokens of this pass do not split into routing "
                          "groups of group_size %d (it must divide the token count; valid: %s; 0 = one "
                          "group)", n, gs, ok);
    }
    *S = gs;
    if (order)
        for (int i = 0; i < n; i++) order[i] = i;
    return check_capacity(sp, gs, training);
}

int moe_check_examples(const moe_spec *sp, int n, int training, const moe_examples *ex,
                       const uint8_t *modality) {
    int S, ordered;
    return moe_plan_groups(sp, n, training, ex, modality, &S, NULL, &ordered);
}

int moe_check_groups(const moe_spec *sp, int n, int training) {
    return moe_check_examples(sp, n, training, NULL, NULL);
}

int moe_slots_per_expert(const vlmoe_moe_config *c) {
    return c->slots_per_expert ? c->slots_per_expert : (int)rint((double)c->group_size / c->num_experts);
}
