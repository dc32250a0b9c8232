/*
 * test_mod, forward runs: each kind of mask or score written twice, as an fa_mod program and as
 * plain C in the double-precision oracle here (independent of the library's evaluator), run on
 * fp32, bf16, fp16 and fp64, dense and varlen, with GQA, and compared; where a built-in option
 * means the same (causal, window, softcap, ALiBi) it is run and compared too.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_ref.h"
#include "flashattn.h"
#include "test_mod.h"
#include "test_util.h"

#define MAXB 4
#define RELR 160 /* the relative-position table covers offsets -relr .. relr, relr <= RELR */

enum kind {
    K_CAUSAL,   /* mask: kv_idx <= q_idx + off[b]                 = causal */
    K_WINDOW,   /* mask: q_idx + off - L <= kv_idx <= q_idx + off + R  = window (L, R) */
    K_DOCUMENT, /* mask: doc[b, q_idx] == doc[b, kv_idx], with causal = 1 */
    K_PREFIX,   /* mask: kv_idx <= q_idx or kv_idx < prefix[b] */
    K_DILATED,  /* mask: kv_idx mod 2 == 0 and (kv_idx - q_idx) mod 3 != 1 */
    K_SOFTCAP,  /* score: cap * tanh(score / cap)                 = softcap */
    K_ALIBI,    /* score: score - slope[h] * |q_idx + off - kv_idx| = alibi_slopes */
    K_RELBIAS,  /* score: score + bias[h, rsign (kv_idx - q_idx) + relr] (index clamped) */
    K_COMBO,    /* softcap and ALiBi built in, then score: score / 2 + (q_idx > kv_idx) */
    K_EMPTY,    /* mask: q_idx mod 2 == 1 (even rows see nothing) */
    K_HEADWIN,  /* mask: causal, and a window of 7 (h + 1) keys: each head its own */
    K_COUNT,
};
static const char *const kind_names[K_COUNT] = {"causal", "window", "document", "prefix",
                                                "dilated", "softcap", "alibi", "relbias",
                                                "combo", "empty", "head window"};

/* One problem: shapes, per-sequence lengths, and the kind's parameters and aux data. */
typedef struct mcase {
    fa_dtype dt;
    int varlen, kind;
    int64_t b, h, hk, d, dv, sq[MAXB], sk[MAXB], max_sq, max_sk, tq, tk;
    int wl, wr, relr, rsign; /* relr 5 clamps most offsets, 160 none */
    int bwin, bwl, bwr; /* a built-in window ANDed with the mods (bwin; -1 unbounded) */
    double cap;
    int32_t off[MAXB], prefix[MAXB], doc[MAXB][160];
    float slopes[16], bias[16][2 * RELR + 1];
} mcase;

/* ---- the oracle's rules, in plain C --------------------------------------------------------- */

static int oracle_visible(const mcase *c, int64_t bi, int64_t hh, int64_t i, int64_t j)
{
    const int64_t off = c->off[bi];
    switch (c->kind) {
    case K_CAUSAL:
        return j <= i + off;
    case K_WINDOW:
        return j >= i + off - c->wl && j <= i + off + c->wr;
    case K_DOCUMENT:
        return j <= i + off && c->doc[bi][i] == c->doc[bi][j];
    case K_PREFIX:
        return j <= i || j < c->prefix[bi];
    case K_DILATED:
        return j % 2 == 0 && ((j - i) % 3 + 3) % 3 != 1;
    case K_EMPTY:
        return i % 2 == 1;
    case K_HEADWIN:
        return j <= i + c->off[bi] && j >= i + c->off[bi] - 7 * (hh + 1);
    default:
        return 1;
    }
}

/* The built-in window a case adds on top of its mods (bottom-right aligned, as causal). */
static int oracle_in_window(const mcase *c, int64_t bi, int64_t i, int64_t j)
{
    const int64_t at = i + c->sk[bi] - c->sq[bi];
    return !c->bwin || ((c->bwl < 0 || j >= at - c->bwl) && (c->bwr < 0 || j <= at + c->bwr));
}

static double oracle_score(const mcase *c, int64_t bi, int64_t hh, int64_t i, int64_t j, double s)
{
    const int64_t off = c->off[bi];
    switch (c->kind) {
    case K_SOFTCAP:
        return c->cap * tanh(s / c->cap);
    case K_ALIBI:
        return s - c->slopes[hh] * fabs((double)(i + off - j));
    case K_RELBIAS: {
        int64_t x = c->rsign * (j - i) + c->relr;
        x = x < 0 ? 0 : x > 2 * c->relr ? 2 * c->relr : x;
        return s + c->bias[hh][x];
    }
    case K_COMBO:
        s = c->cap * tanh(s / c->cap) - c->slopes[hh] * fabs((double)(i + off - j));
        return s / 2 + (i > j ? 1.0 : 0.0);
    default:
        return s;
    }
}

/* out [tq, h, dv], lse [tq, h] in double from the rounded inputs. */
static void oracle(const mcase *c, const fa_fwd_args *a, double *out, double *lse)
{
    const double scale = 1.0 / sqrt((double)c->d);
    double *s = malloc(sizeof(double) * (size_t)(c->max_sk + 1));
    int64_t q0 = 0, k0 = 0;
    for (int64_t bi = 0; bi < c->b; bi++) {
        for (int64_t hh = 0; hh < c->h; hh++) {
            const int64_t kh = hh / (c->h / c->hk);
            for (int64_t i = 0; i < c->sq[bi]; i++) {
                double mx = -INFINITY;
                for (int64_t j = 0; j < c->sk[bi]; j++) {
                    double dot = 0;
                    for (int64_t e = 0; e < c->d; e++) {
                        int64_t qi[4] = {bi, i, hh, e}, ki[4] = {bi, j, kh, e};
                        int64_t qv[3] = {q0 + i, hh, e}, kv[3] = {k0 + j, kh, e};
                        dot += fa_ref_load(a->q, c->varlen ? qv : qi) *
                               fa_ref_load(a->k, c->varlen ? kv : ki);
                    }
                    s[j] = oracle_visible(c, bi, hh, i, j) && oracle_in_window(c, bi, i, j)
                               ? oracle_score(c, bi, hh, i, j, dot * scale)
                               : -INFINITY;
                    mx = s[j] > mx ? s[j] : mx;
                }
                const int64_t row = c->varlen ? q0 + i : bi * c->max_sq + i;
                double *o = out + (row * c->h + hh) * c->dv, sum = 0;
                for (int64_t e = 0; e < c->dv; e++)
                    o[e] = 0;
                if (mx == -INFINITY) {
                    lse[row * c->h + hh] = INFINITY;
                    continue;
                }
                for (int64_t j = 0; j < c->sk[bi]; j++) {
                    const double p = exp(s[j] - mx);
                    sum += p;
                    for (int64_t e = 0; e < c->dv; e++) {
                        int64_t vi[4] = {bi, j, kh, e}, vv[3] = {k0 + j, kh, e};
                        o[e] += p * fa_ref_load(a->v, c->varlen ? vv : vi);
                    }
                }
                for (int64_t e = 0; e < c->dv; e++)
                    o[e] /= sum;
                lse[row * c->h + hh] = mx + log(sum);
            }
        }
        q0 += c->sq[bi];
        k0 += c->sk[bi];
    }
    free(s);
}

/* ---- the programs, through the builder ------------------------------------------------------ */


/* aux slots: 0 int32 off[b] or prefix[b]; 1 int32 doc[b, s]; 2 fp32 slopes[h];
 * 3 fp32 bias[h, 2 relr + 1] (rows 2 RELR + 1 apart). */
static fa_mod *build(const mcase *c, int *is_mask)
{
    fa_mod *m = fa_mod_create();
    const int bvar = V(B);
    const int off = fa_mod_aux(m, 0, 1, &bvar);
    const int qo = B(ADD, V(Q_IDX), off); /* the row's diagonal key */
    int root = -1;
    *is_mask = 1;
    switch (c->kind) {
    case K_CAUSAL:
        root = B(LE, V(KV_IDX), qo);
        break;
    case K_WINDOW:
        root = B(AND, B(GE, V(KV_IDX), B(SUB, qo, C(c->wl))),
                 B(LE, V(KV_IDX), B(ADD, qo, C(c->wr))));
        break;
    case K_DOCUMENT: {
        const int iq[2] = {bvar, V(Q_IDX)}, ik[2] = {bvar, V(KV_IDX)};
        root = B(EQ, fa_mod_aux(m, 1, 2, iq), fa_mod_aux(m, 1, 2, ik));
        break;
    }
    case K_PREFIX:
        root = B(OR, B(LE, V(KV_IDX), V(Q_IDX)), B(LT, V(KV_IDX), off));
        break;
    case K_DILATED:
        root = B(AND, B(EQ, B(MOD, V(KV_IDX), C(2)), C(0)),
                 U(NOT, B(EQ, B(MOD, B(SUB, V(KV_IDX), V(Q_IDX)), C(3)), C(1))));
        break;
    case K_EMPTY:
        root = B(EQ, B(MOD, V(Q_IDX), C(2)), C(1));
        break;
    case K_HEADWIN:
        root = B(AND, B(LE, V(KV_IDX), qo),
                 B(GE, V(KV_IDX), B(SUB, qo, B(MUL, C(7), B(ADD, V(H), C(1))))));
        break;
    default: {
        *is_mask = 0;
        const int hvar = V(H), s = V(SCORE);
        const int slope = fa_mod_aux(m, 2, 1, &hvar);
        if (c->kind == K_SOFTCAP) {
            root = B(MUL, C(c->cap), U(TANH, B(DIV, s, C(c->cap))));
        } else if (c->kind == K_ALIBI) {
            root = B(SUB, s, B(MUL, slope, U(ABS, B(SUB, qo, V(KV_IDX)))));
        } else if (c->kind == K_RELBIAS) {
            const int rel = c->rsign > 0 ? B(SUB, V(KV_IDX), V(Q_IDX)) : B(SUB, V(Q_IDX), V(KV_IDX));
            const int ix[2] = {hvar, B(ADD, rel, C(c->relr))};
            root = B(ADD, s, fa_mod_aux(m, 3, 2, ix));
        } else {
            root = B(ADD, B(MUL, s, C(0.5)),
                     fa_mod_where(m, B(GT, V(Q_IDX), V(KV_IDX)), C(1), C(0)));
        }
    }
    }
    TU_CHECK(root >= 0, "%s: building failed: %s", kind_names[c->kind], fa_last_error());
    fa_status st = fa_mod_finish(m, root, *is_mask ? FA_MOD_KIND_MASK : FA_MOD_KIND_SCORE);
    TU_CHECK(st == FA_STATUS_OK, "%s: finish failed: %s", kind_names[c->kind], fa_last_error());
    return m;
}

/* ---- one forward run ------------------------------------------------------------------------ */

static double tolerance(fa_dtype dt)
{
    return dt == FA_DTYPE_F64   ? 1e-10
           : dt == FA_DTYPE_F32 ? 2e-5
           : dt == FA_DTYPE_F16 ? 2e-3
                                : 8e-3;
}

/* Runs args (poisoned out and lse first) and compares with want / want_lse. */
static void check_run(const mcase *c, fa_fwd_args *a, tu_tensor *out, tu_tensor *lse,
                      const double *want, const double *want_lse, const char *what)
{
    tu_poison(out);
    tu_poison(lse);
    fa_status st = fa_attention_forward(a);
    TU_CHECK(st == FA_STATUS_OK, "%s: forward failed: %s", what, fa_last_error());
    if (st != FA_STATUS_OK)
        return;
    TU_CHECK(tu_count_poisoned_in_view(out) == 0 && tu_count_poisoned_in_view(lse) == 0,
             "%s: outputs left unwritten", what);
    TU_CHECK(tu_count_clobbered(out) == 0 && tu_count_clobbered(lse) == 0,
             "%s: wrote outside out/lse", what);
    const double tol = tolerance(c->dt);
    int bad = 0;
    for (int64_t r = 0; r < c->tq && bad < 3; r++)
        for (int64_t hh = 0; hh < c->h && bad < 3; hh++) {
            int64_t li[3] = {r / c->max_sq, hh, r % c->max_sq}, lv[2] = {hh, r};
            const double gl = fa_ref_load(&lse->t, c->varlen ? lv : li);
            const double wl = want_lse[r * c->h + hh];
            const double ltol = c->dt == FA_DTYPE_F64 ? 1e-10 : 5e-5;
            if (!(gl == wl || fabs(gl - wl) <= ltol * (1 + fabs(wl)))) {
                bad++;
                TU_CHECK(0, "%s: lse row %lld head %lld: got %.9g, want %.9g", what,
                         (long long)r, (long long)hh, gl, wl);
            }
            for (int64_t e = 0; e < c->dv; e++) {
                int64_t oi[4] = {r / c->max_sq, r % c->max_sq, hh, e}, ov[3] = {r, hh, e};
                const double g = fa_ref_load(&out->t, c->varlen ? ov : oi);
                const double w = want[(r * c->h + hh) * c->dv + e];
                if (!(fabs(g - w) <= tol * (1 + fabs(w)))) {
                    bad++;
                    TU_CHECK(0, "%s: out row %lld head %lld col %lld: got %.9g, want %.9g", what,
                             (long long)r, (long long)hh, (long long)e, g, w);
                    break;
                }
            }
        }
}

static void run_case(mcase *c, tu_rng *r, int use_parsed)
{
    char what[200], win[40] = "";
    if (c->bwin)
        snprintf(win, sizeof win, " window (%d, %d)", c->bwl, c->bwr);
    snprintf(what, sizeof what, "%s %s %s b=%lld h=%lld/%lld d=%lld sq0=%lld sk0=%lld%s%s",
             kind_names[c->kind], fa_dtype_name(c->dt), c->varlen ? "varlen" : "dense",
             (long long)c->b, (long long)c->h, (long long)c->hk, (long long)c->d,
             (long long)c->sq[0], (long long)c->sk[0], win, use_parsed ? " (parsed)" : "");
    tu_where = what;
    c->tq = c->tk = 0;
    c->max_sq = c->max_sk = 0;
    int32_t cuq[MAXB + 1] = {0}, cuk[MAXB + 1] = {0};
    for (int64_t i = 0; i < c->b; i++) {
        c->max_sq = c->sq[i] > c->max_sq ? c->sq[i] : c->max_sq;
        c->max_sk = c->sk[i] > c->max_sk ? c->sk[i] : c->max_sk;
        cuq[i + 1] = cuq[i] + (int32_t)c->sq[i];
        cuk[i + 1] = cuk[i] + (int32_t)c->sk[i];
        c->off[i] = (int32_t)(c->sk[i] - c->sq[i]);
        c->prefix[i] = (int32_t)tu_rng_int(r, 0, c->sk[i]);
        int32_t doc = 0;
        for (int64_t j = 0; j < 160; j++) {
            doc += tu_rng_chance(r, 0.08);
            c->doc[i][j] = doc;
        }
    }
    if (c->kind == K_PREFIX)
        memcpy(c->off, c->prefix, sizeof c->off); /* aux 0 holds the prefix lengths */
    c->max_sq = c->max_sq ? c->max_sq : 1; /* varlen with every sequence empty */
    c->max_sk = c->max_sk ? c->max_sk : 1;
    c->tq = c->varlen ? cuq[c->b] : c->b * c->max_sq;
    c->tk = c->varlen ? cuk[c->b] : c->b * c->max_sk;
    for (int64_t hh = 0; hh < c->h; hh++) {
        c->slopes[hh] = (float)tu_rng_uniform(r, 0.01, 0.5);
        for (int x = 0; x <= 2 * RELR; x++)
            c->bias[hh][x] = (float)tu_rng_uniform(r, -2, 2);
    }
    const int layout = (int)tu_rng_int(r, 0, TU_NUM_LAYOUTS - 1);
    int64_t qs[4] = {c->b, c->max_sq, c->h, c->d}, ks[4] = {c->b, c->max_sk, c->hk, c->d};
    int64_t vs[4] = {c->b, c->max_sk, c->hk, c->dv}, os[4] = {c->b, c->max_sq, c->h, c->dv};
    int64_t qv[3] = {c->tq, c->h, c->d}, kv[3] = {c->tk, c->hk, c->d};
    int64_t vv[3] = {c->tk, c->hk, c->dv}, ov[3] = {c->tq, c->h, c->dv};
    int64_t ls[3] = {c->b, c->h, c->max_sq}, lv[2] = {c->h, c->tq};
    const int nd = c->varlen ? 3 : 4;
    const fa_dtype ldt = c->dt == FA_DTYPE_F64 ? FA_DTYPE_F64 : FA_DTYPE_F32;
    tu_tensor q = tu_tensor_new(c->dt, nd, c->varlen ? qv : qs, layout, r);
    tu_tensor k = tu_tensor_new(c->dt, nd, c->varlen ? kv : ks, layout, r);
    tu_tensor v = tu_tensor_new(c->dt, nd, c->varlen ? vv : vs, layout, r);
    tu_tensor out = tu_tensor_new(c->dt, nd, c->varlen ? ov : os, layout, r);
    tu_tensor lse = tu_tensor_new(ldt, c->varlen ? 2 : 3, c->varlen ? lv : ls, TU_CONTIGUOUS, r);
    tu_fill_uniform(&q, r, -1.5, 1.5);
    tu_fill_uniform(&k, r, -1.5, 1.5);
    tu_fill_uniform(&v, r, -1, 1);
    int64_t nb[1] = {c->b}, nb1[1] = {c->b + 1}, nh[1] = {c->h}, dshape[2] = {c->b, 160};
    int64_t bshape[2] = {c->h, 2 * c->relr + 1}, bstride[2] = {2 * RELR + 1, 1};
    fa_tensor tcuq = fa_tensor_make(cuq, FA_DTYPE_I32, 1, nb1, NULL);
    fa_tensor tcuk = fa_tensor_make(cuk, FA_DTYPE_I32, 1, nb1, NULL);
    fa_tensor aux0 = fa_tensor_make(c->off, FA_DTYPE_I32, 1, nb, NULL);
    fa_tensor aux1 = fa_tensor_make(c->doc, FA_DTYPE_I32, 2, dshape, NULL);
    fa_tensor aux2 = fa_tensor_make(c->slopes, FA_DTYPE_F32, 1, nh, NULL);
    fa_tensor aux3 = fa_tensor_make(c->bias, FA_DTYPE_F32, 2, bshape, bstride);

    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.q = &q.t, a.k = &k.t, a.v = &v.t, a.out = &out.t, a.lse = &lse.t;
    a.num_threads = (int)tu_rng_int(r, 1, 3);
    if (c->varlen) {
        a.cu_seqlens_q = &tcuq, a.cu_seqlens_k = &tcuk;
        a.max_seqlen_q = c->max_sq, a.max_seqlen_k = c->max_sk;
    }
    if (c->bwin)
        a.window_left = c->bwl, a.window_right = c->bwr;
    double *want = calloc((size_t)(c->tq * c->h * c->dv + 1), sizeof(double));
    double *want_lse = calloc((size_t)(c->tq * c->h + 1), sizeof(double));
    oracle(c, &a, want, want_lse);

    /* The built-in path where one means the same (the oracle checks it too). */
    fa_fwd_args builtin = a;
    int has_builtin = 1;
    switch (c->kind) {
    case K_CAUSAL:
        builtin.causal = 1;
        break;
    case K_WINDOW:
        builtin.window_left = c->wl, builtin.window_right = c->wr;
        break;
    case K_SOFTCAP:
        builtin.softcap = c->cap;
        break;
    case K_ALIBI:
        builtin.alibi_slopes = &aux2;
        break;
    default:
        has_builtin = 0;
    }
    if (has_builtin) {
        char w2[220];
        snprintf(w2, sizeof w2, "%s [built-in]", what);
        check_run(c, &builtin, &out, &lse, want, want_lse, w2);
    }

    int is_mask;
    fa_mod *built = build(c, &is_mask), *parsed = NULL;
    fa_status st = fa_mod_parse(fa_mod_text(built), &parsed);
    TU_CHECK(st == FA_STATUS_OK, "%s: parse of '%s' failed: %s", what, fa_mod_text(built),
             fa_last_error());
    if (st == FA_STATUS_OK)
        TU_CHECK(strcmp(fa_mod_text(parsed), fa_mod_text(built)) == 0,
                 "%s: text round trip '%s' -> '%s'", what, fa_mod_text(built),
                 fa_mod_text(parsed));
    const fa_mod *m = use_parsed && parsed ? parsed : built;
    if (is_mask)
        a.mask_mod = m;
    else
        a.score_mod = m;
    if (c->kind == K_DOCUMENT)
        a.causal = 1; /* ANDed with the mask */
    if (c->kind == K_COMBO) {
        a.softcap = c->cap;
        a.alibi_slopes = &aux2;
    }
    /* The aux tensors the program reads (fa_mod_finish knows; a tensor nobody reads is refused). */
    const char *text = fa_mod_text(m);
    if (strstr(text, "aux0"))
        a.mod_aux[0] = &aux0;
    if (strstr(text, "aux1"))
        a.mod_aux[1] = &aux1;
    if (strstr(text, "aux2"))
        a.mod_aux[2] = &aux2;
    if (strstr(text, "aux3"))
        a.mod_aux[3] = &aux3;
    check_run(c, &a, &out, &lse, want, want_lse, what);
    if (has_builtin && (c->kind == K_CAUSAL || c->kind == K_WINDOW) && c->tq > 0) {
        /* Dropout with a mask_mod drops the keys the built-in mask's call drops. */
        char w2[220];
        snprintf(w2, sizeof w2, "%s [dropout]", what);
        builtin.dropout_p = a.dropout_p = tu_rng_uniform(r, 0.1, 0.6);
        builtin.seed = a.seed = tu_rng_u64(r);
        TU_CHECK(fa_attention_forward(&builtin) == FA_STATUS_OK, "%s: %s", w2, fa_last_error());
        const int64_t n_out = c->tq * c->h * c->dv;
        double *drop = malloc(sizeof(double) * (size_t)n_out);
        int64_t idx[4] = {0, 0, 0, 0}, at = 0;
        do
            drop[at++] = fa_ref_load(&out.t, idx);
        while (tu_next_index(&out.t, idx) && at < n_out);
        double *drop_lse = calloc((size_t)(c->tq * c->h), sizeof(double));
        for (int64_t x = 0; x < c->tq * c->h; x++) {
            const int64_t row = x / c->h, hh = x % c->h;
            int64_t dli[3] = {row / c->max_sq, hh, row % c->max_sq}, dlv[2] = {hh, row};
            drop_lse[x] = fa_ref_load(&lse.t, c->varlen ? dlv : dli);
        }
        check_run(c, &a, &out, &lse, drop, drop_lse, w2);
        free(drop);
        free(drop_lse);
    }

    fa_mod_destroy(built);
    fa_mod_destroy(parsed);
    free(want);
    free(want_lse);
    tu_tensor_free(&q);
    tu_tensor_free(&k);
    tu_tensor_free(&v);
    tu_tensor_free(&out);
    tu_tensor_free(&lse);
}

void tm_test_forward(tu_rng *r)
{
    static const fa_dtype dts[4] = {FA_DTYPE_F32, FA_DTYPE_BF16, FA_DTYPE_F16, FA_DTYPE_F64};
    int n = 0;
    for (int kind = 0; kind < K_COUNT; kind++)
        for (int di = 0; di < 4; di++)
            for (int varlen = 0; varlen < 2; varlen++) {
                mcase c = {0};
                c.dt = dts[di];
                c.varlen = varlen;
                c.kind = kind;
                c.b = tu_rng_int(r, 1, varlen ? MAXB : 2);
                c.hk = tu_rng_int(r, 1, 2);
                c.h = c.hk * tu_rng_int(r, 1, 3); /* GQA often */
                c.d = tu_rng_int(r, 1, 5) * 16 + (tu_rng_chance(r, 0.3) ? 3 : 0);
                c.dv = tu_rng_chance(r, 0.7) ? c.d : tu_rng_int(r, 8, 80);
                c.wl = (int)tu_rng_int(r, 0, 40);
                c.wr = (int)tu_rng_int(r, 0, 40);
                c.cap = tu_rng_uniform(r, 1.0, 8.0);
                c.relr = tu_rng_chance(r, 0.5) ? 5 : RELR;
                c.rsign = tu_rng_chance(r, 0.5) ? 1 : -1;
                /* A built-in window or causal edge on top of the kinds without a built-in
                 * twin: the mods' kept keys cut by the call's own bounds. */
                c.bwin = kind != K_CAUSAL && kind != K_WINDOW && kind != K_SOFTCAP &&
                         kind != K_ALIBI && kind != K_DOCUMENT && tu_rng_chance(r, 0.5);
                c.bwl = (int)tu_rng_int(r, -1, 30);
                c.bwr = tu_rng_chance(r, 0.4) ? 0 : (int)tu_rng_int(r, -1, 30);
                const int same = kind == K_DOCUMENT || kind == K_PREFIX;
                for (int64_t i = 0; i < c.b; i++) {
                    /* Few rows now and then: mods never take the decode schedule. */
                    const int64_t top = tu_rng_chance(r, 0.2) ? 12 : 150;
                    /* dense: one length for every sequence; varlen: empty ones too */
                    c.sq[i] = varlen ? tu_rng_int(r, 0, top)
                                     : i ? c.sq[0] : tu_rng_int(r, 1, top);
                    c.sk[i] = same     ? c.sq[i]
                              : varlen ? tu_rng_int(r, 0, 150)
                              : i      ? c.sk[0]
                                       : tu_rng_int(r, 1, 150);
                }
                run_case(&c, r, n++ % 2);
            }
}
