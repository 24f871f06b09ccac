// act_kernels.h: the body of src/ops/act_avx2.c's kernels, written once for two vector widths
// and included there once for each (no include guard): AVX2 with FMA (8 floats) and AVX-512
// (16). The includer defines the vector types V (floats), VI (int32s) and M (a comparison's
// mask), L (floats a vector), TARGET (the target attribute's string), SUF(f) (f's name for this
// width) and the operations below, each one instruction of the width with the same rounding:
// ADD SUB MUL DIV FMA FNMA MIN MAX XOR RND (to the nearest integer, RND_NEAREST) CVTT, the int32
// IADD ISUB IAND ISRA ISLL ISET, ASF (int32 bits as floats), CMP (to an M), SEL(m, a, b) (b where
// m holds, else a), LD ST (unaligned) ZERO F (a float broadcast). The same operations in the same
// order at either width: each element gets the same bits.
// c(x), the sigmoid's argument: GELU tanh 2 sqrt(2/pi) (x + k x^3), quick GELU 1.702 x
__attribute__((target(TARGET), always_inline)) static inline V SUF(arg)(V x, int tanh_form) {
    if (!tanh_form) return MUL(F(1.702f), x);
    const V x3 = MUL(MUL(MUL(F(GELU_K), x), x), x);
    return MUL(F(GELU_C), ADD(x, x3));
}

// n = round(c / ln2) and p = e^(c - n ln2) for two vectors of clamped c: exp_frac's fused steps
// (src/core/real.h), each on both
__attribute__((target(TARGET), always_inline)) static inline void SUF(frac2)(V c0, V c1, V *n0, V *n1, V *p0, V *p1) {
    static const float poly[] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                                 5.0000001201e-1f};
    *n0 = RND(MUL(c0, F(1.44269504088896341f)), RND_NEAREST);
    *n1 = RND(MUL(c1, F(1.44269504088896341f)), RND_NEAREST);
    const V r0 = FMA(*n0, F(2.12194440e-4f), FNMA(*n0, F(0.693359375f), c0));
    const V r1 = FMA(*n1, F(2.12194440e-4f), FNMA(*n1, F(0.693359375f), c1));
    V q0 = F(1.9875691500e-4f), q1 = q0;
    for (int i = 0; i < 5; i++) {
        q0 = FMA(q0, r0, F(poly[i]));
        q1 = FMA(q1, r1, F(poly[i]));
    }
    *p0 = ADD(FMA(q0, MUL(r0, r0), r0), F(1.0f));
    *p1 = ADD(FMA(q1, MUL(r1, r1), r1), F(1.0f));
}

// e^y for two vectors: vexp_fma's steps (src/core/real.h) line by line, each on both. The clamp
// is min then max: the same value as vexp_fma's for every y but NaN, whose result is NaN either way.
__attribute__((target(TARGET), always_inline)) static inline void SUF(exp2v)(V y0, V y1, V *e0, V *e1) {
    const V hi = F(88.7228317f), lo = F(-104.0f);
    const V c0 = MAX(MIN(y0, hi), lo), c1 = MAX(MIN(y1, hi), lo);
    V n0, n1, p0, p1;
    SUF(frac2)(c0, c1, &n0, &n1, &p0, &p1);
    // 2^n as 2^h 2^(n-h), h = floor(n / 2)
    const VI one = ISET(1), bias = ISET(127);
    const VI i0 = CVTT(n0), i1 = CVTT(n1);
    const VI h0 = ISRA(ISUB(i0, IAND(i0, one)), 1);
    const VI h1 = ISRA(ISUB(i1, IAND(i1, one)), 1);
    const V sa0 = ASF(ISLL(IADD(h0, bias), 23));
    const V sa1 = ASF(ISLL(IADD(h1, bias), 23));
    const V sb0 = ASF(ISLL(IADD(ISUB(i0, h0), bias), 23));
    const V sb1 = ASF(ISLL(IADD(ISUB(i1, h1), bias), 23));
    V v0 = MUL(MUL(p0, sa0), sb0), v1 = MUL(MUL(p1, sa1), sb1);
    // NaN in, NaN out; above ln(FLT_MAX), +inf
    v0 = SEL(CMP(y0, y0, _CMP_EQ_OQ), y0, v0);
    v1 = SEL(CMP(y1, y1, _CMP_EQ_OQ), y1, v1);
    *e0 = SEL(CMP(y0, hi, _CMP_GT_OQ), v0, F(__builtin_inff()));
    *e1 = SEL(CMP(y1, hi, _CMP_GT_OQ), v1, F(__builtin_inff()));
}

// e^y for two vectors: vexp_sig's steps (src/core/real.h), exp2v's without its second power of
// two and special values; the clamp, max then min, takes a NaN to the low end as vexp_sig's does.
__attribute__((target(TARGET), always_inline)) static inline void SUF(exps2)(V y0, V y1, V *e0, V *e1) {
    const V lo = F(-87.33f), hi = F(88.37f);
    const V c0 = MIN(MAX(y0, lo), hi), c1 = MIN(MAX(y1, lo), hi);
    V n0, n1, p0, p1;
    SUF(frac2)(c0, c1, &n0, &n1, &p0, &p1);
    const VI bias = ISET(127);
    const V s0 = ASF(ISLL(IADD(CVTT(n0), bias), 23));
    const V s1 = ASF(ISLL(IADD(CVTT(n1), bias), 23));
    *e0 = MUL(p0, s0), *e1 = MUL(p1, s1);
}

// 1 + e^(-c(x)) for two vectors: act_sig1's and act_sig_grad1's denominator
__attribute__((target(TARGET), always_inline)) static inline void SUF(den2)(V x0, V x1, int tanh_form, V *d0, V *d1) {
    const V neg = F(-0.0f);
    V e0, e1;
    SUF(exps2)(XOR(SUF(arg)(x0, tanh_form), neg), XOR(SUF(arg)(x1, tanh_form), neg), &e0, &e1);
    *d0 = ADD(F(1.0f), e0), *d1 = ADD(F(1.0f), e1);
}

// erf(x) for two vectors: verf's steps (src/core/real.h), each on both
__attribute__((target(TARGET), always_inline)) static inline void SUF(erf2v)(V x0, V x1, V *e0, V *e1) {
    const V neg = F(-0.0f), zero = ZERO(), four = F(4.0f), one = F(1.0f);
    const M lt0 = CMP(x0, zero, _CMP_LT_OQ), lt1 = CMP(x1, zero, _CMP_LT_OQ);
    // |x| as verf takes it (x < 0 ? -x : x keeps -0), then at most 4 (NaN -> 4)
    const V a0 = MIN(SEL(lt0, x0, XOR(x0, neg)), four);
    const V a1 = MIN(SEL(lt1, x1, XOR(x1, neg)), four);
    const V t0 = MUL(a0, a0), t1 = MUL(a1, a1);
    static const float P[] = {1.128969961e-04f, -8.486291626e-04f, 5.221094005e-03f, -2.686541341e-02f,
                              1.128378138e-01f, -3.761263788e-01f, 1.283791661e-01f};
    static const float Q[] = {7.987910067e-06f, -7.635998190e-05f, 4.501156800e-04f, -1.869457890e-03f,
                              5.986477714e-03f, -1.591115445e-02f, 3.719371557e-02f, -7.911061496e-02f,
                              1.543525457e-01f, -2.732107639e-01f, 4.275835752e-01f};
    V p0 = F(-9.752990991e-06f), p1 = p0;
    for (int i = 0; i < 7; i++) {
        p0 = FMA(p0, t0, F(P[i]));
        p1 = FMA(p1, t1, F(P[i]));
    }
    const V u0 = SUB(a0, one), u1 = SUB(a1, one);
    V q0 = F(-3.835798736e-07f), q1 = q0;
    for (int i = 0; i < 11; i++) {
        q0 = FMA(q0, u0, F(Q[i]));
        q1 = FMA(q1, u1, F(Q[i]));
    }
    V x0e, x1e; // e^-t, t in [0, 16]: exps2 gives vexp_fma's bits there
    SUF(exps2)(XOR(t0, neg), XOR(t1, neg), &x0e, &x1e);
    const V small0 = FMA(a0, p0, a0), small1 = FMA(a1, p1, a1);
    const V big0 = FNMA(x0e, q0, one), big1 = FNMA(x1e, q1, one);
    V r0 = SEL(CMP(a0, one, _CMP_LT_OQ), big0, small0);
    V r1 = SEL(CMP(a1, one, _CMP_LT_OQ), big1, small1);
    r0 = SEL(lt0, r0, XOR(r0, neg)), r1 = SEL(lt1, r1, XOR(r1, neg));
    *e0 = SEL(CMP(x0, x0, _CMP_EQ_OQ), x0, r0); // NaN in, NaN out
    *e1 = SEL(CMP(x1, x1, _CMP_EQ_OQ), x1, r1);
}

// act(x) for two vectors, any kind: gelu_erf1 or act_sig1
__attribute__((target(TARGET), always_inline)) static inline void SUF(act2)(V x0, V x1, int kind, V *a0, V *a1) {
    if (kind == VLMOE_ACT_GELU) {
        V e0, e1;
        SUF(erf2v)(MUL(x0, F(INV_SQRT_2F)), MUL(x1, F(INV_SQRT_2F)), &e0, &e1);
        *a0 = MUL(MUL(F(0.5f), x0), ADD(F(1.0f), e0));
        *a1 = MUL(MUL(F(0.5f), x1), ADD(F(1.0f), e1));
        return;
    }
    V d0, d1;
    SUF(den2)(x0, x1, kind == VLMOE_ACT_GELU_TANH, &d0, &d1);
    *a0 = DIV(x0, d0), *a1 = DIV(x1, d1);
}

// act'(x) = s + x s (1 - s) c'(x), s = 1 / den, for one vector (after den2 the two chains are
// short and independent, so they need no interleaving by hand)
__attribute__((target(TARGET), always_inline)) static inline V SUF(sig_grad1)(V x, V den, int tanh_form, V *a) {
    const V s = DIV(F(1.0f), den);
    const V dc = tanh_form ? MUL(F(GELU_C), ADD(F(1.0f), MUL(MUL(F(GELU_K3), x), x)))
                           : F(1.702f);
    *a = DIV(x, den);
    return ADD(s, MUL(MUL(MUL(x, s), SUB(F(1.0f), s)), dc));
}

// act(x) and act'(x) for two vectors: gelu_erf_grad1 or act_sig_grad1
__attribute__((target(TARGET), always_inline)) static inline void SUF(grad2)(V x0, V x1, int kind, V *a0, V *a1,
                                                                        V *q0, V *q1) {
    if (kind == VLMOE_ACT_GELU) {
        V e0, e1, g0, g1;
        SUF(erf2v)(MUL(x0, F(INV_SQRT_2F)), MUL(x1, F(INV_SQRT_2F)), &e0, &e1);
        SUF(exp2v)(MUL(MUL(F(-0.5f), x0), x0), MUL(MUL(F(-0.5f), x1), x1), &g0, &g1);
        const V h0 = ADD(F(1.0f), e0), h1 = ADD(F(1.0f), e1);
        *a0 = MUL(MUL(F(0.5f), x0), h0), *a1 = MUL(MUL(F(0.5f), x1), h1);
        *q0 = ADD(MUL(F(0.5f), h0), MUL(MUL(x0, F(INV_SQRT_2PIF)), g0));
        *q1 = ADD(MUL(F(0.5f), h1), MUL(MUL(x1, F(INV_SQRT_2PIF)), g1));
        return;
    }
    const int t = kind == VLMOE_ACT_GELU_TANH;
    V d0, d1;
    SUF(den2)(x0, x1, t, &d0, &d1);
    *q0 = SUF(sig_grad1)(x0, d0, t, a0), *q1 = SUF(sig_grad1)(x1, d1, t, a1);
}

__attribute__((target(TARGET))) int SUF(act_bias)(float *a, float *h, const float *b, int n, int kind) {
    int j = 0;
    for (; j + 2 * L <= n; j += 2 * L) {
        const V x0 = ADD(LD(h + j), LD(b + j));
        const V x1 = ADD(LD(h + j + L), LD(b + j + L));
        ST(h + j, x0), ST(h + j + L, x1);
        V a0, a1;
        SUF(act2)(x0, x1, kind, &a0, &a1);
        ST(a + j, a0), ST(a + j + L, a1);
    }
    return j;
}

__attribute__((target(TARGET))) size_t SUF(act)(float *a, const float *x, size_t n, int kind) {
    size_t j = 0;
    for (; j + 2 * L <= n; j += 2 * L) {
        V a0, a1;
        SUF(act2)(LD(x + j), LD(x + j + L), kind, &a0, &a1);
        ST(a + j, a0), ST(a + j + L, a1);
    }
    return j;
}

__attribute__((target(TARGET))) int SUF(act_grad)(float *g, float *a, const float *h, int n, int kind) {
    int j = 0;
    for (; j + 2 * L <= n; j += 2 * L) {
        V a0, a1, q0, q1;
        SUF(grad2)(LD(h + j), LD(h + j + L), kind, &a0, &a1, &q0, &q1);
        ST(g + j, MUL(LD(g + j), q0));
        ST(g + j + L, MUL(LD(g + j + L), q1));
        ST(a + j, a0), ST(a + j + L, a1);
    }
    return j;
}
