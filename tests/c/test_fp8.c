/*
 * fp8 inputs: the conversions (every code decoded, a sweep of fp32 values encoded, against the
 * oracle's rounding from the formats' definitions), the CPU forward against the double oracle
 * (fa_ref_forward, fa_ref_forward_fp8, fa_ref_forward_lowp), and the refusals.
 *
 * The forward's error bound against the exact oracle (P not rounded): out_i = vd sum_j p8_j v_j
 * / l_i where the exact result has p_j for p8_j, p_j = 2^8 exp(s_ij - m_i) and l_i >= 2^8 (the
 * largest term, or the sink's). Rounding to e4m3 moves a normal p_j (>= 2^-6) by at most 2^-4 p_j
 * and a subnormal one by at most 2^-10, so |out_i - exact_i| <= vmax (2^-4 + n 2^-18) for n keys
 * and vmax = max |vd v_j|, plus the output's rounding (half an ulp of bf16 / fp16) and the fp32
 * sums' (far smaller: a slack of 1e-4 vmax).
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_ref.h"
#include "test_util.h"
#include "core/fa_fp8.h"

/* ---- conversions --------------------------------------------------------------------------- */

static const fa_dtype kinds[2] = {FA_DTYPE_F8E4M3, FA_DTYPE_F8E5M2};

static void test_decode(void)
{
    for (int k = 0; k < 2; k++) {
        uint8_t codes[256];
        float got[256];
        for (int c = 0; c < 256; c++)
            codes[c] = (uint8_t)c;
        TU_CHECK(fa_fp8_to_f32(kinds[k], codes, got, 256) == FA_STATUS_OK, "decode: %s",
                 fa_last_error());
        int nans = 0;
        for (int c = 0; c < 256; c++) {
            const double want = fa_ref_fp8_value((uint8_t)c, kinds[k]);
            nans += isnan(got[c]);
            TU_CHECK(isnan(want) ? isnan(got[c])
                                 : (double)got[c] == want && !signbit(got[c]) == !signbit(want),
                     "%s code 0x%02x: got %.9g, want %.9g", fa_dtype_name(kinds[k]), c,
                     (double)got[c], want);
        }
        /* e4m3fn: only S.1111.111; e5m2: S.11111.{01,10,11} */
        TU_CHECK(nans == (k == 0 ? 2 : 6), "%s: %d NaN codes", fa_dtype_name(kinds[k]), nans);
    }
    TU_CHECK(fa_e4m3_to_f32(0x7e) == 448.0f && fa_e5m2_to_f32(0x7b) == 57344.0f &&
                 isinf(fa_e5m2_to_f32(0xfc)) && fa_e4m3_to_f32(0x01) == 1.0f / 512,
             "decode: the kinds' extremes");
}

/* Every fp32 whose upper 16 bits take every value and whose lower 16 bits are 0, 1, 0x7fff,
 * 0x8000 or 0xffff: every exponent, both signs, exact ties of both kinds' mantissas (and of their
 * subnormals) with the values either side, NaNs and infinities. */
static void test_encode(void)
{
    static const uint32_t lows[5] = {0, 1, 0x7fff, 0x8000, 0xffff};
    for (int k = 0; k < 2; k++) {
        for (uint32_t hi = 0; hi < 65536; hi++) {
            float x[5];
            uint8_t got[5];
            for (int i = 0; i < 5; i++)
                x[i] = fa_bits_to_f32(hi << 16 | lows[i]);
            TU_CHECK(fa_fp8_from_f32(kinds[k], x, got, 5) == FA_STATUS_OK, "encode: %s",
                     fa_last_error());
            for (int i = 0; i < 5; i++) {
                const double want = fa_ref_round((double)x[i], kinds[k]);
                const double val = fa_ref_fp8_value(got[i], kinds[k]);
                int ok = isnan(want) ? got[i] == (signbit(x[i]) ? 0xff : 0x7f)
                                     : val == want && !signbit(val) == !signbit(x[i]);
                if (!ok) {
                    TU_CHECK(0, "%s: 0x%08x (%.9g) gave 0x%02x (%.9g), want %.9g",
                             fa_dtype_name(kinds[k]), (unsigned)(hi << 16 | lows[i]),
                             (double)x[i], got[i], val, want);
                    return;
                }
            }
        }
    }
    uint8_t b;
    float f = 1.0f;
    TU_CHECK(fa_fp8_from_f32(FA_DTYPE_BF16, &f, &b, 1) == FA_STATUS_INVALID_ARGUMENT &&
                 tu_names(fa_last_error(), "dtype"),
             "encode to bf16: %s", fa_last_error());
    TU_CHECK(fa_fp8_to_f32(FA_DTYPE_F8E4M3, NULL, &f, 1) == FA_STATUS_INVALID_ARGUMENT &&
                 tu_names(fa_last_error(), "src"),
             "decode from NULL: %s", fa_last_error());
}

/* ---- the forward ----------------------------------------------------------------------------- */

typedef struct f8case {
    fa_dtype dt, out_dt;
    int varlen;
    int64_t b, sq, sk, h, hk, d, dv; /* varlen: the longest lengths drawn */
    int causal, wl, wr;
    double softcap, scale;
    int alibi, sinks, descales, layout;
} f8case;

/* Across every case: squared errors against the exact oracle and against the oracle that rounds
 * P as the header says. Rounding P as specified must take most of the error away. */
static double g_sq_exact, g_sq_rounded;

static void run_case(const f8case *c, tu_rng *r)
{
    char where[256];
    snprintf(where, sizeof where,
             "%s->%s %s b=%lld sq=%lld sk=%lld h=%lld hk=%lld d=%lld dv=%lld causal=%d "
             "window=(%d,%d) softcap=%g alibi=%d sinks=%d descales=%d layout=%d",
             fa_dtype_name(c->dt), fa_dtype_name(c->out_dt), c->varlen ? "varlen" : "dense",
             (long long)c->b, (long long)c->sq, (long long)c->sk, (long long)c->h,
             (long long)c->hk, (long long)c->d, (long long)c->dv, c->causal, c->wl, c->wr,
             c->softcap, c->alibi, c->sinks, c->descales, c->layout);
    tu_where = where;

    int64_t total_q = c->b * c->sq, total_k = c->b * c->sk;
    tu_tensor cuq = {0}, cuk = {0};
    if (c->varlen) {
        const int64_t s1[1] = {c->b + 1};
        cuq = tu_tensor_new(FA_DTYPE_I32, 1, s1, TU_CONTIGUOUS, r);
        cuk = tu_tensor_new(FA_DTYPE_I32, 1, s1, TU_CONTIGUOUS, r);
        int32_t *a = cuq.t.data, *bk = cuk.t.data;
        a[0] = (int32_t)tu_rng_int(r, 0, 2); /* rows before the first sequence stay uncovered */
        bk[0] = 0;
        for (int64_t i = 0; i < c->b; i++) {
            a[i + 1] = a[i] + (int32_t)tu_rng_int(r, 0, c->sq);
            bk[i + 1] = bk[i] + (int32_t)tu_rng_int(r, 0, c->sk);
        }
        total_q = a[c->b] + tu_rng_int(r, 0, 2);
        total_k = bk[c->b];
    }
    const int nd = c->varlen ? 3 : 4;
    int64_t shq[4], shk[4], shv[4], sho[4], shl[3];
    if (c->varlen) {
        int64_t q3[3] = {total_q, c->h, c->d}, k3[3] = {total_k, c->hk, c->d};
        int64_t v3[3] = {total_k, c->hk, c->dv}, o3[3] = {total_q, c->h, c->dv};
        memcpy(shq, q3, sizeof q3), memcpy(shk, k3, sizeof k3);
        memcpy(shv, v3, sizeof v3), memcpy(sho, o3, sizeof o3);
        shl[0] = c->h, shl[1] = total_q;
    } else {
        int64_t q4[4] = {c->b, c->sq, c->h, c->d}, k4[4] = {c->b, c->sk, c->hk, c->d};
        int64_t v4[4] = {c->b, c->sk, c->hk, c->dv}, o4[4] = {c->b, c->sq, c->h, c->dv};
        memcpy(shq, q4, sizeof q4), memcpy(shk, k4, sizeof k4);
        memcpy(shv, v4, sizeof v4), memcpy(sho, o4, sizeof o4);
        shl[0] = c->b, shl[1] = c->h, shl[2] = c->sq;
    }
    tu_tensor tq = tu_tensor_new(c->dt, nd, shq, c->layout, r);
    tu_tensor tk = tu_tensor_new(c->dt, nd, shk, c->layout, r);
    tu_tensor tv = tu_tensor_new(c->dt, nd, shv, c->layout, r);
    tu_tensor to = tu_tensor_new(c->out_dt, nd, sho, c->layout, r);
    tu_tensor tl = tu_tensor_new(FA_DTYPE_F32, nd - 1, shl, c->layout, r);
    /* Scores of a few units, as attention's are: q and k within +-2.5 at d^-0.5. */
    tu_fill_uniform(&tq, r, -2.5, 2.5);
    tu_fill_uniform(&tk, r, -2.5, 2.5);
    tu_fill_uniform(&tv, r, -3.0, 3.0);
    tu_tensor td[3];
    memset(td, 0, sizeof td);
    const int64_t shd[2] = {c->b, c->hk};
    fa_fwd_args a;
    fa_fwd_args_init(&a);
    for (int i = 0; i < 3 && c->descales; i++) {
        td[i] = tu_tensor_new(FA_DTYPE_F32, 2, shd, c->layout ? TU_PERMUTED : TU_CONTIGUOUS, r);
        tu_fill_uniform(&td[i], r, 0.05, 2.0); /* FA3's tests draw U(0, 2) */
    }
    if (c->descales) {
        a.q_descale = &td[0].t;
        a.k_descale = &td[1].t;
        a.v_descale = &td[2].t;
    }
    tu_tensor talibi = {0}, tsinks = {0};
    if (c->alibi) {
        const int64_t sa[2] = {c->alibi == 2 ? c->b : c->h, c->h};
        talibi = tu_tensor_new(FA_DTYPE_F32, c->alibi, c->alibi == 2 ? sa : sa + 1,
                               TU_CONTIGUOUS, r);
        tu_fill_uniform(&talibi, r, 0.01, 0.5);
        a.alibi_slopes = &talibi.t;
    }
    if (c->sinks) {
        const int64_t ss[1] = {c->h};
        tsinks = tu_tensor_new(FA_DTYPE_F32, 1, ss, TU_CONTIGUOUS, r);
        tu_fill_uniform(&tsinks, r, -3.0, 3.0);
        a.sinks = &tsinks.t;
    }
    a.q = &tq.t, a.k = &tk.t, a.v = &tv.t, a.out = &to.t, a.lse = &tl.t;
    if (c->varlen) {
        a.cu_seqlens_q = &cuq.t;
        a.cu_seqlens_k = &cuk.t;
        a.max_seqlen_q = c->sq;
        a.max_seqlen_k = c->sk;
    }
    a.causal = c->causal;
    a.window_left = c->wl;
    a.window_right = c->wr;
    a.softcap = c->softcap;
    a.softmax_scale = c->scale;

    /* The same bytes from 1 and 4 threads. */
    tu_poison(&to);
    tu_poison(&tl);
    a.num_threads = 1;
    fa_status st = fa_attention_forward(&a);
    TU_CHECK(st == FA_STATUS_OK, "forward: %s", fa_last_error());
    void *first = malloc(to.nbytes);
    memcpy(first, to.base, to.nbytes);
    tu_poison(&to);
    a.num_threads = 4;
    st = fa_attention_forward(&a);
    TU_CHECK(st == FA_STATUS_OK, "forward (4 threads): %s", fa_last_error());
    TU_CHECK(memcmp(first, to.base, to.nbytes) == 0, "1 and 4 threads differ");
    free(first);
    TU_CHECK(tu_count_poisoned_in_view(&to) == 0, "out left unwritten");
    TU_CHECK(tu_count_clobbered(&to) == 0 && tu_count_clobbered(&tl) == 0,
             "written outside out / lse");

    const int64_t n_out = total_q * c->h * c->dv, n_lse = total_q * c->h;
    double *ref = malloc(sizeof(double) * (size_t)(n_out + 1));
    double *refp = malloc(sizeof(double) * (size_t)(n_out + 1));
    double *lowp = malloc(sizeof(double) * (size_t)(n_out + 1));
    double *ref_lse = malloc(sizeof(double) * (size_t)(n_lse + 1));
    TU_CHECK(fa_ref_forward(&a, 1, ref, ref_lse) == 0, "oracle refused the case");
    TU_CHECK(fa_ref_forward_fp8(&a, refp, NULL) == 0, "fp8 oracle refused the case");
    TU_CHECK(fa_ref_forward_lowp(&a, lowp) == 0, "lowp oracle refused the case");

    double vmax = 0; /* max |vd v| */
    int64_t idx[FA_MAX_DIMS] = {0};
    if (tu_numel(&tv.t) > 0) {
        do {
            double x = fabs(fa_ref_load(&tv.t, idx));
            const int64_t kh = idx[nd - 2];
            if (c->descales) {
                int64_t bi = 0;
                if (c->varlen) {
                    const int32_t *bk = cuk.t.data;
                    while (bi < c->b && idx[0] >= bk[bi + 1])
                        bi++;
                    if (bi == c->b)
                        bi = 0;
                } else {
                    bi = idx[0];
                }
                const int64_t di[2] = {bi, kh};
                x *= fa_ref_load(&td[2].t, di);
            }
            vmax = x > vmax ? x : vmax;
        } while (tu_next_index(&tv.t, idx));
    }
    const double out_rel = c->out_dt == FA_DTYPE_BF16 ? 1.0 / 256 : 1.0 / 1024;
    const double bound_abs = vmax * (1.0 / 16 + (double)c->sk / 262144.0 + 1e-4);
    double err = 0, err_lowp = 0, err_rule = 0, atol = 0, worst = 0;
    int64_t at = 0, bad = 0;
    memset(idx, 0, sizeof idx);
    if (n_out > 0) {
        do {
            const double got = fa_ref_load(&to.t, idx), want = ref[at];
            const double e = fabs(got - want);
            if (!(e <= bound_abs + out_rel * fabs(want)) && bad++ < 3)
                TU_CHECK(0, "out[%lld]: %.6g, exact %.6g (bound %.3g)", (long long)at, got,
                         want, bound_abs + out_rel * fabs(want));
            err = e > err ? e : err;
            err_lowp = fabs(lowp[at] - want) > err_lowp ? fabs(lowp[at] - want) : err_lowp;
            /* the P-rounding oracle (the header's rule, in doubles) rounded to out's dtype */
            const double rule = fabs(fa_ref_round(refp[at], c->out_dt) - want);
            err_rule = rule > err_rule ? rule : err_rule;
            const double u = fabs(fa_ref_round(want + 0.3, c->out_dt) - 0.3 - want);
            atol = u > atol ? u : atol;
            g_sq_exact += e * e;
            g_sq_rounded += (got - refp[at]) * (got - refp[at]);
            worst = fabs(got - refp[at]) > worst ? fabs(got - refp[at]) : worst;
            at++;
        } while (tu_next_index(&to.t, idx));
    }
    /* Upstream's criterion (hopper/test_flash_attn.py): at most twice the error of a
     * same-precision baseline, plus twice the output dtype's rounding near the values. Two
     * baselines: upstream's (the normalised p rounded to e4m3) and the header's rule (2^8 exp(s
     * - m) rounded, m the sink where it is larger). Their roundings differ element by element, so
     * with few keys a row (one, beside a sink) either can be the luckier by a factor past 2. */
    const double base = err_lowp > err_rule ? err_lowp : err_rule;
    TU_CHECK(err <= 2 * base + 2 * atol, "error %.4g > 2 x baseline's %.4g (%.4g, %.4g) + 2 x %.3g",
             err, base, err_lowp, err_rule, atol);
    TU_CHECK(worst <= bound_abs + out_rel * vmax, "against the P-rounding oracle: %.4g", worst);

    at = 0;
    memset(idx, 0, sizeof idx);
    if (n_lse > 0) {
        do {
            /* ref_lse is [token, h]; lse is [b, h, sq] or [h, total_q] */
            const int64_t h = c->varlen ? idx[0] : idx[1];
            const int64_t tok = c->varlen ? idx[1] : idx[0] * c->sq + idx[2];
            const double got = fa_ref_load(&tl.t, idx), want = ref_lse[tok * c->h + h];
            const int ok = isinf(want) ? got == want
                                       : fabs(got - want) <= 2e-6 * (1 + fabs(want));
            if (!ok && bad++ < 3)
                TU_CHECK(0, "lse[%lld]: %.9g, want %.9g", (long long)at, got, want);
            at++;
        } while (tu_next_index(&tl.t, idx));
    }

    free(ref), free(refp), free(lowp), free(ref_lse);
    tu_tensor *all[] = {&tq, &tk, &tv, &to, &tl, &td[0], &td[1], &td[2], &talibi, &tsinks,
                        &cuq, &cuk};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (all[i]->base)
            tu_tensor_free(all[i]);
    tu_where = "";
}

static int64_t rand_dim16(tu_rng *r)
{
    return 16 * tu_rng_int(r, 1, 8);
}

static void test_forward(tu_rng *r, int n)
{
    for (int i = 0; i < n; i++) {
        f8case c = {0};
        c.dt = tu_rng_chance(r, 0.75) ? FA_DTYPE_F8E4M3 : FA_DTYPE_F8E5M2;
        c.out_dt = tu_rng_chance(r, 0.7) ? FA_DTYPE_BF16 : FA_DTYPE_F16;
        c.varlen = tu_rng_chance(r, 0.35);
        c.b = tu_rng_int(r, 1, 3);
        c.hk = tu_rng_int(r, 1, 3);
        c.h = c.hk * tu_rng_int(r, 1, 3);
        c.d = rand_dim16(r);
        c.dv = tu_rng_chance(r, 0.7) ? c.d : rand_dim16(r);
        c.sq = tu_rng_chance(r, 0.1) ? tu_rng_int(r, 0, 1) : tu_rng_int(r, 1, 70);
        c.sk = tu_rng_chance(r, 0.1) ? tu_rng_int(r, 0, 1) : tu_rng_int(r, 1, 160);
        c.causal = tu_rng_chance(r, 0.3);
        c.wl = c.wr = -1;
        if (tu_rng_chance(r, 0.3)) {
            c.wl = tu_rand_window_side(r, c.sk);
            c.wr = tu_rand_window_side(r, c.sk);
        }
        c.softcap = tu_rng_chance(r, 0.25) ? tu_rng_uniform(r, 0.5, 20.0) : 0.0;
        c.alibi = tu_rng_chance(r, 0.2) ? (int)tu_rng_int(r, 1, 2) : 0;
        c.sinks = tu_rng_chance(r, 0.25);
        c.descales = tu_rng_chance(r, 0.75);
        c.scale = tu_rng_chance(r, 0.3) ? tu_rng_uniform(r, 0.3, 3.0) / sqrt((double)c.d) : NAN;
        c.layout = (int)tu_rng_int(r, 0, TU_NUM_LAYOUTS - 1);
        run_case(&c, r);
    }
    TU_CHECK(g_sq_rounded <= 0.25 * g_sq_exact,
             "rounding P as specified leaves %.4g of the squared error %.4g: P is not rounded "
             "as the header says",
             g_sq_rounded, g_sq_exact);
}

/* ---- refusals ---------------------------------------------------------------------------- */

typedef struct f8bad {
    tu_tensor q, k, v, out, lse, qd;
    fa_fwd_args a;
} f8bad;

static void bad_setup(f8bad *s, tu_rng *r, fa_dtype dt, int64_t d, int64_t dv, fa_dtype out_dt)
{
    const int64_t shq[4] = {2, 5, 4, d}, shk[4] = {2, 7, 2, d}, shv[4] = {2, 7, 2, dv};
    const int64_t sho[4] = {2, 5, 4, dv}, shd[2] = {2, 2};
    s->q = tu_tensor_new(dt, 4, shq, TU_CONTIGUOUS, r);
    s->k = tu_tensor_new(dt, 4, shk, TU_CONTIGUOUS, r);
    s->v = tu_tensor_new(dt, 4, shv, TU_CONTIGUOUS, r);
    s->out = tu_tensor_new(out_dt, 4, sho, TU_CONTIGUOUS, r);
    s->qd = tu_tensor_new(FA_DTYPE_F32, 2, shd, TU_CONTIGUOUS, r);
    tu_fill_uniform(&s->q, r, -1, 1);
    tu_fill_uniform(&s->k, r, -1, 1);
    tu_fill_uniform(&s->v, r, -1, 1);
    tu_fill_uniform(&s->qd, r, 0.1, 2);
    fa_fwd_args_init(&s->a);
    s->a.q = &s->q.t, s->a.k = &s->k.t, s->a.v = &s->v.t, s->a.out = &s->out.t;
}

static void bad_free(f8bad *s)
{
    tu_tensor_free(&s->q), tu_tensor_free(&s->k), tu_tensor_free(&s->v);
    tu_tensor_free(&s->out), tu_tensor_free(&s->qd);
}

static void expect(fa_status got, fa_status want, const char *name, const char *what)
{
    TU_CHECK(got == want && tu_names(fa_last_error(), name),
             "%s: status %d (want %d), message \"%s\" should name %s", what, (int)got, (int)want,
             fa_last_error(), name);
}

static void test_refusals(tu_rng *r)
{
    f8bad s;
    bad_setup(&s, r, FA_DTYPE_F8E4M3, 32, 32, FA_DTYPE_BF16);
    TU_CHECK(fa_attention_forward(&s.a) == FA_STATUS_OK, "valid fp8 call: %s", fa_last_error());

    s.k.t.dtype = FA_DTYPE_F8E5M2;
    expect(fa_attention_forward(&s.a), FA_STATUS_INVALID_ARGUMENT, "k", "k of the other kind");
    s.k.t.dtype = FA_DTYPE_F8E4M3;
    s.v.t.dtype = FA_DTYPE_BF16;
    expect(fa_attention_forward(&s.a), FA_STATUS_INVALID_ARGUMENT, "v", "v bf16");
    s.v.t.dtype = FA_DTYPE_F8E4M3;
    const fa_dtype outs[3] = {FA_DTYPE_F32, FA_DTYPE_F8E4M3, FA_DTYPE_F64};
    for (int i = 0; i < 3; i++) {
        s.out.t.dtype = outs[i];
        expect(fa_attention_forward(&s.a), FA_STATUS_INVALID_ARGUMENT, "out", "out not 16-bit");
    }
    s.out.t.dtype = FA_DTYPE_BF16;

    /* descales: dtype, shape, rank */
    s.a.q_descale = &s.qd.t;
    TU_CHECK(fa_attention_forward(&s.a) == FA_STATUS_OK, "q_descale: %s", fa_last_error());
    s.qd.t.dtype = FA_DTYPE_F16;
    expect(fa_attention_forward(&s.a), FA_STATUS_INVALID_ARGUMENT, "q_descale", "fp16 descale");
    s.qd.t.dtype = FA_DTYPE_F32;
    s.a.q_descale = NULL;
    s.a.k_descale = &s.qd.t;
    s.qd.t.shape[1] = 4; /* [b, h] instead of [b, hk] */
    s.qd.t.stride[0] = 4;
    expect(fa_attention_forward(&s.a), FA_STATUS_INVALID_ARGUMENT, "k_descale", "[b, h] descale");
    s.qd.t.shape[1] = 2;
    s.qd.t.stride[0] = 2;
    s.a.k_descale = NULL;
    s.a.v_descale = &s.qd.t;
    s.qd.t.ndim = 1;
    expect(fa_attention_forward(&s.a), FA_STATUS_INVALID_ARGUMENT, "v_descale", "1-d descale");
    s.qd.t.ndim = 2;
    s.a.v_descale = NULL;

    /* FA3 has no fp8 dropout, probs or backward */
    s.a.dropout_p = 0.1;
    expect(fa_attention_forward(&s.a), FA_STATUS_INVALID_ARGUMENT, "dropout_p", "dropout");
    s.a.dropout_p = 0;

    /* no user-defined scoring with fp8 yet: refused, not ignored */
    fa_mod *m = fa_mod_create();
    const int root = fa_mod_binary(m, FA_MOD_GE, fa_mod_var(m, FA_MOD_Q_IDX),
                                   fa_mod_var(m, FA_MOD_KV_IDX));
    TU_CHECK(m && fa_mod_finish(m, root, FA_MOD_KIND_MASK) == FA_STATUS_OK, "mask_mod: %s",
             fa_last_error());
    s.a.mask_mod = m;
    expect(fa_attention_forward(&s.a), FA_STATUS_INVALID_ARGUMENT, "mask_mod", "fp8 mask_mod");
    s.a.mask_mod = NULL;
    fa_mod_destroy(m);
    const int64_t shp[4] = {2, 4, 128, 128};
    tu_tensor probs = tu_tensor_new(FA_DTYPE_F8E4M3, 4, shp, TU_CONTIGUOUS, r);
    s.a.probs = &probs.t;
    expect(fa_attention_forward(&s.a), FA_STATUS_INVALID_ARGUMENT, "probs", "probs");
    s.a.probs = NULL;
    tu_tensor_free(&probs);
    {
        const int64_t shl[3] = {2, 4, 5};
        tu_tensor lse = tu_tensor_new(FA_DTYPE_F32, 3, shl, TU_CONTIGUOUS, r);
        s.a.lse = &lse.t;
        TU_CHECK(fa_attention_forward(&s.a) == FA_STATUS_OK, "with lse: %s", fa_last_error());
        fa_bwd_args b;
        fa_bwd_args_init(&b);
        b.fwd = &s.a;
        b.dout = &s.out.t, b.dq = &s.q.t, b.dk = &s.k.t, b.dv = &s.v.t;
        expect(fa_attention_backward(&b), FA_STATUS_UNSUPPORTED, "q", "backward");
        TU_CHECK(strstr(fa_last_error(), "no backward") != NULL, "backward: %s",
                 fa_last_error());
        s.a.lse = NULL;
        tu_tensor_free(&lse);
    }

    /* FLASHATTN_SM90_FP8=0: a CUDA device refuses fp8 as unsupported, naming q's dtype. */
    s.a.device = 0;
    setenv("FLASHATTN_SM90_FP8", "0", 1);
    expect(fa_attention_forward(&s.a), FA_STATUS_UNSUPPORTED, "q", "CUDA device");
    TU_CHECK(strstr(fa_last_error(), "fp8_e4m3") != NULL, "CUDA: %s", fa_last_error());
    unsetenv("FLASHATTN_SM90_FP8");
    s.a.device = FA_DEVICE_CPU;

    /* descales only with fp8 inputs */
    bad_free(&s);
    bad_setup(&s, r, FA_DTYPE_BF16, 32, 32, FA_DTYPE_BF16);
    s.a.q_descale = &s.qd.t;
    expect(fa_attention_forward(&s.a), FA_STATUS_INVALID_ARGUMENT, "q_descale", "bf16 descale");
    s.a.q_descale = NULL;
    s.a.v_descale = &s.qd.t;
    expect(fa_attention_forward(&s.a), FA_STATUS_INVALID_ARGUMENT, "v_descale", "bf16 descale");
    bad_free(&s);

    /* head dims: multiples of 16 */
    bad_setup(&s, r, FA_DTYPE_F8E5M2, 24, 32, FA_DTYPE_F16);
    expect(fa_attention_forward(&s.a), FA_STATUS_INVALID_ARGUMENT, "q", "d 24");
    bad_free(&s);
    bad_setup(&s, r, FA_DTYPE_F8E4M3, 32, 8, FA_DTYPE_F16);
    expect(fa_attention_forward(&s.a), FA_STATUS_INVALID_ARGUMENT, "v", "dv 8");
    bad_free(&s);

    /* The KV cache and the combine take no fp8. */
    bad_setup(&s, r, FA_DTYPE_F8E4M3, 32, 32, FA_DTYPE_BF16);
    fa_kvcache_args kv;
    fa_kvcache_args_init(&kv);
    kv.q = &s.q.t, kv.k_cache = &s.k.t, kv.v_cache = &s.v.t, kv.out = &s.out.t;
    expect(fa_attention_kvcache(&kv), FA_STATUS_INVALID_ARGUMENT, "q", "fp8 KV cache");
    {
        const int64_t shp5[5] = {2, 2, 5, 4, 32}, shl4[4] = {2, 2, 5, 4};
        tu_tensor op = tu_tensor_new(FA_DTYPE_F32, 5, shp5, TU_CONTIGUOUS, r);
        tu_tensor lp = tu_tensor_new(FA_DTYPE_F32, 4, shl4, TU_CONTIGUOUS, r);
        fa_combine_args cb;
        fa_combine_args_init(&cb);
        cb.out_partial = &op.t, cb.lse_partial = &lp.t, cb.out = &s.q.t;
        expect(fa_attention_combine(&cb), FA_STATUS_INVALID_ARGUMENT, "out", "fp8 combine");
        tu_tensor_free(&op), tu_tensor_free(&lp);
    }
    bad_free(&s);
}

/* NaN follows the arithmetic as for the other dtypes: a NaN code in q makes its row NaN (out
 * and lse), a NaN in v the out columns of the rows that see its key; other rows stay finite. */
static void test_nan(tu_rng *r)
{
    f8bad s;
    bad_setup(&s, r, FA_DTYPE_F8E4M3, 32, 32, FA_DTYPE_BF16);
    const int64_t shl[3] = {2, 4, 5};
    tu_tensor lse = tu_tensor_new(FA_DTYPE_F32, 3, shl, TU_CONTIGUOUS, r);
    s.a.lse = &lse.t;
    s.a.causal = 1; /* row i sees keys 0 .. i + 2 */
    const int64_t qi[4] = {1, 3, 2, 5}, vi[4] = {0, 6, 1, 9};
    fa_ref_store(&s.q.t, qi, NAN);
    fa_ref_store(&s.v.t, vi, NAN);
    TU_CHECK(fa_attention_forward(&s.a) == FA_STATUS_OK, "NaN inputs: %s", fa_last_error());
    int64_t idx[4] = {0};
    do {
        const double o = fa_ref_load(&s.out.t, idx);
        const int q_row = idx[0] == 1 && idx[1] == 3 && idx[2] == 2;
        /* key 6 of sequence 0, kv head 1 (query heads 2, 3): rows 4 on see it */
        const int v_col = idx[0] == 0 && idx[2] >= 2 && idx[1] >= 4 && idx[3] == 9;
        TU_CHECK(!isnan(o) == !(q_row || v_col), "out[%lld, %lld, %lld, %lld] = %g",
                 (long long)idx[0], (long long)idx[1], (long long)idx[2], (long long)idx[3], o);
    } while (tu_next_index(&s.out.t, idx));
    const int64_t li[3] = {1, 2, 3}, lj[3] = {0, 2, 4};
    TU_CHECK(isnan(fa_ref_load(&lse.t, li)) && isfinite(fa_ref_load(&lse.t, lj)),
             "lse of the NaN row / a v-NaN row");
    tu_tensor_free(&lse);
    bad_free(&s);
}

/* Descales of 1 are the absent ones, bit for bit; the kinds' names and sizes. */
static void test_descale_one(tu_rng *r)
{
    f8bad s;
    bad_setup(&s, r, FA_DTYPE_F8E4M3, 48, 32, FA_DTYPE_F16);
    tu_poison(&s.out);
    TU_CHECK(fa_attention_forward(&s.a) == FA_STATUS_OK, "plain: %s", fa_last_error());
    void *plain = malloc(s.out.nbytes);
    memcpy(plain, s.out.base, s.out.nbytes);
    float *qd = s.qd.t.data;
    for (int i = 0; i < 4; i++)
        qd[i] = 1.0f;
    s.a.q_descale = s.a.k_descale = s.a.v_descale = &s.qd.t;
    tu_poison(&s.out);
    TU_CHECK(fa_attention_forward(&s.a) == FA_STATUS_OK, "ones: %s", fa_last_error());
    TU_CHECK(memcmp(plain, s.out.base, s.out.nbytes) == 0, "descales of 1 change the result");
    free(plain);
    bad_free(&s);
    TU_CHECK(strcmp(fa_dtype_name(FA_DTYPE_F8E4M3), "fp8_e4m3") == 0 &&
                 strcmp(fa_dtype_name(FA_DTYPE_F8E5M2), "fp8_e5m2") == 0 &&
                 fa_dtype_size(FA_DTYPE_F8E4M3) == 1 && fa_dtype_size(FA_DTYPE_F8E5M2) == 1,
             "fp8 dtype names and sizes");
}

int main(void)
{
    uint64_t seed = tu_master_seed("test_fp8");
    tu_rng r = {seed};
    test_decode();
    test_encode();
    const char *n = getenv("FA_TEST_RANDOM_CASES");
    test_forward(&r, n ? atoi(n) : 120);
    test_refusals(&r);
    test_nan(&r);
    test_descale_one(&r);
    return tu_finish("test_fp8");
}
