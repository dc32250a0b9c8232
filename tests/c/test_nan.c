/*
 * test_nan: NaN and Inf in q, k or v reach exactly the rows whose arithmetic they enter, in every
 * dtype and path (dense and varlen forwards, the KV cache unsplit and split through the combine,
 * the backward; few-row forwards, which take the decode schedule, split). The expectation is written out here in double precision from the rounded inputs:
 *   a row whose visible scores include a NaN, or whose maximum score is +inf (exp(inf - inf)),
 *   gets out NaN in every element and lse NaN; otherwise lse = log sum exp, out = P V, which is
 *   NaN in column c exactly when a visible key's v has a NaN in column c; a row whose scores are
 *   all -inf is an empty row (out 0, lse +inf), as one without visible keys.
 * A NaN key outside a row's causal mask leaves that row alone.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_ref.h"
#include "flashattn.h"
#include "test_util.h"

/* S_FEW: keys of the few-row forwards, enough for the decode schedule to split them. */
enum { B = 2, S = 70, D = 64, AT = 37, SQ_DECODE = 2, S_FEW = 600 };

typedef enum nan_case { NAN_Q, NAN_K, INF_K, NAN_V, INF_Q, NAN_CASES } nan_case;
static const char *const case_names[NAN_CASES] = {"q NaN row", "k NaN row", "k +Inf element",
                                                  "v NaN element", "q +Inf, every score -inf"};

static double tolerance(fa_dtype dt)
{
    return dt == FA_DTYPE_F64 ? 1e-10 : dt == FA_DTYPE_F32 ? 1e-4 : dt == FA_DTYPE_F16 ? 4e-3
                                                                                       : 3e-2;
}

/* Puts the case's NaN or Inf into sequence 1: q row `row`, or key `key` of k or v (with +Inf, q
 * row `row` gets a positive factor for it). */
static void plant(nan_case c, tu_tensor *q, tu_tensor *k, tu_tensor *v, int64_t row, int64_t key)
{
    for (int64_t e = 0; e < D; e++) {
        int64_t qi[4] = {1, row, 0, e}, ki[4] = {1, key, 0, e};
        if (c == NAN_Q)
            fa_ref_store(&q->t, qi, NAN);
        else if (c == NAN_K)
            fa_ref_store(&k->t, ki, NAN);
        else if (c == INF_K && e == 3) {
            fa_ref_store(&k->t, ki, INFINITY);
            fa_ref_store(&q->t, qi, 0.5); /* so that row's score is +inf, not -inf */
        }
        else if (c == NAN_V && e == 5)
            fa_ref_store(&v->t, ki, NAN);
        else if (c == INF_Q && e == 3)
            fa_ref_store(&q->t, qi, INFINITY);
    }
    for (int64_t j = 0; c == INF_Q && j < k->t.shape[1]; j++) { /* so every score is -inf */
        int64_t ki[4] = {1, j, 0, 3};
        fa_ref_store(&k->t, ki, -fabs(fa_ref_load(&k->t, ki)));
    }
}

/* out [B, sq, 1, D] and lse [B, sq] of q [B, sq, 1, D] against k, v [B, sk, 1, D] in double
 * (sk <= S_FEW). */
static void expect(const tu_tensor *q, const tu_tensor *k, const tu_tensor *v, int64_t sq,
                   int causal, double *out, double *lse)
{
    const double scale = 1.0 / sqrt((double)D);
    const int64_t sk = k->t.shape[1];
    double s[S_FEW > S ? S_FEW : S];
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < sq; i++) {
            const int64_t last = causal ? i + sk - sq : sk - 1; /* bottom-right causal */
            double mx = -INFINITY;
            int nan = 0;
            for (int64_t j = 0; j <= last; j++) {
                double dot = 0;
                for (int64_t e = 0; e < D; e++) {
                    int64_t qi[4] = {b, i, 0, e}, ki[4] = {b, j, 0, e};
                    dot += fa_ref_load(&q->t, qi) * fa_ref_load(&k->t, ki);
                }
                s[j] = dot * scale;
                nan |= isnan(s[j]);
                mx = s[j] > mx ? s[j] : mx;
            }
            double *o = out + (b * sq + i) * D;
            if (!nan && mx == -INFINITY) { /* every score -inf: the empty row */
                lse[b * sq + i] = INFINITY;
                for (int64_t e = 0; e < D; e++)
                    o[e] = 0;
                continue;
            }
            if (nan || mx == INFINITY) {
                lse[b * sq + i] = NAN;
                for (int64_t e = 0; e < D; e++)
                    o[e] = NAN;
                continue;
            }
            double l = 0;
            for (int64_t j = 0; j <= last; j++)
                l += exp(s[j] - mx);
            lse[b * sq + i] = mx + log(l);
            for (int64_t e = 0; e < D; e++) {
                double acc = 0;
                for (int64_t j = 0; j <= last; j++) {
                    int64_t vi[4] = {b, j, 0, e};
                    acc += exp(s[j] - mx) / l * fa_ref_load(&v->t, vi);
                }
                o[e] = acc;
            }
        }
}

/* got NaN exactly where want is, equal or within tolerance elsewhere; returns the NaN count. */
static int64_t compare(const char *what, double got, double want, fa_dtype dt)
{
    TU_CHECK(isnan(got) == isnan(want), "%s: got %g, want %g", what, got, want);
    if (!isnan(want))
        TU_CHECK(got == want || fabs(got - want) <= tolerance(dt) * (1 + fabs(want)),
                 "%s: got %g, want %g", what, got, want);
    return isnan(want);
}

/* out viewed as [B * sq rows][D] (dense, varlen or decode layout alike: h = 1, contiguous). */
static void check_out(const tu_tensor *out, const tu_tensor *lse, const double *want_o,
                      const double *want_l, int64_t sq, fa_dtype dt)
{
    int64_t nans = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < sq; i++) {
            for (int64_t e = 0; e < D; e++) {
                int64_t oi[4] = {b, i, 0, e}, fi[3] = {b * sq + i, 0, e};
                double got = fa_ref_load(&out->t, out->t.ndim == 4 ? oi : fi);
                nans += compare("out", got, want_o[(b * sq + i) * D + e], dt);
            }
            int64_t li[3] = {b, 0, i}, fl[2] = {0, b * sq + i};
            double got = fa_ref_load(&lse->t, lse->t.ndim == 3 ? li : fl);
            compare("lse", got, want_l[b * sq + i], dt);
            nans += want_l[b * sq + i] == INFINITY;
        }
    TU_CHECK(nans > 0, "neither NaN nor an empty row expected: the case plants nothing");
}

static tu_tensor tensor4(fa_dtype dt, int64_t b, int64_t s, tu_rng *r)
{
    int64_t shape[4] = {b, s, 1, D};
    tu_tensor t = tu_tensor_new(dt, 4, shape, TU_CONTIGUOUS, r);
    tu_fill_uniform(&t, r, -1.0, 1.0);
    return t;
}

/* A [n, 1, D] view of a contiguous [B, n / B, 1, D] tensor (the varlen form). */
static fa_tensor flat(const tu_tensor *t)
{
    int64_t shape[3] = {t->t.shape[0] * t->t.shape[1], 1, D};
    return fa_tensor_make(t->t.data, t->t.dtype, 3, shape, NULL);
}

/* sq query rows against sk keys a sequence: S and S, or SQ_DECODE and S_FEW (the decode
 * schedule). */
static void forward_case(tu_rng *r, fa_dtype dt, nan_case c, int causal, int varlen, int64_t sq,
                         int64_t sk)
{
    char where[160];
    snprintf(where, sizeof where, "forward %s dtype=%s %s causal=%d sq=%lld sk=%lld",
             varlen ? "varlen" : "dense", fa_dtype_name(dt), case_names[c], causal,
             (long long)sq, (long long)sk);
    tu_where = where;
    tu_tensor q = tensor4(dt, B, sq, r), k = tensor4(dt, B, sk, r), v = tensor4(dt, B, sk, r);
    tu_tensor out = tensor4(dt, B, sq, r);
    const fa_dtype lse_dt = dt == FA_DTYPE_F64 ? FA_DTYPE_F64 : FA_DTYPE_F32;
    int64_t ls[3] = {B, 1, sq}, lf[2] = {1, B * sq}, cu_shape[1] = {B + 1};
    tu_tensor lse = tu_tensor_new(lse_dt, varlen ? 2 : 3, varlen ? lf : ls, TU_CONTIGUOUS, r);
    /* Few rows, causal: the last key, which only the last row sees (in the last chunk). */
    plant(c, &q, &k, &v, sq < AT ? sq - 1 : AT, causal && sq < sk ? sk - 1 : AT);
    double *want_o = malloc(sizeof(double) * (size_t)(B * sq * D));
    double *want_l = malloc(sizeof(double) * (size_t)(B * sq));
    expect(&q, &k, &v, sq, causal, want_o, want_l);

    int32_t cu_q[B + 1] = {0, (int32_t)sq, 2 * (int32_t)sq};
    int32_t cu_k[B + 1] = {0, (int32_t)sk, 2 * (int32_t)sk};
    fa_tensor qf = flat(&q), kf = flat(&k), vf = flat(&v), of = flat(&out);
    fa_tensor cu_qt = fa_tensor_make(cu_q, FA_DTYPE_I32, 1, cu_shape, NULL);
    fa_tensor cu_kt = fa_tensor_make(cu_k, FA_DTYPE_I32, 1, cu_shape, NULL);
    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.q = varlen ? &qf : &q.t;
    a.k = varlen ? &kf : &k.t;
    a.v = varlen ? &vf : &v.t;
    a.out = varlen ? &of : &out.t;
    a.lse = &lse.t;
    if (varlen) {
        a.cu_seqlens_q = &cu_qt;
        a.cu_seqlens_k = &cu_kt;
        a.max_seqlen_q = sq;
        a.max_seqlen_k = sk;
    }
    a.causal = causal;
    a.num_threads = 2;
    tu_poison(&out);
    tu_poison(&lse);
    fa_status st = fa_attention_forward(&a);
    TU_CHECK(st == FA_STATUS_OK, "status %d: %s", (int)st, fa_last_error());
    check_out(&out, &lse, want_o, want_l, sq, dt);
    if (causal && c == NAN_K && sq == sk)
        for (int64_t e = 0; e < D; e++) { /* the row before the NaN key does not see it */
            int64_t oi[4] = {1, AT - 1, 0, e};
            TU_CHECK(isfinite(fa_ref_load(&out.t, oi)), "masked NaN key reached row %d", AT - 1);
        }
    free(want_o);
    free(want_l);
    tu_tensor_free(&q);
    tu_tensor_free(&k);
    tu_tensor_free(&v);
    tu_tensor_free(&out);
    tu_tensor_free(&lse);
}

/* Decode: SQ_DECODE query rows against a full cache; causal puts the NaN key last, which only
 * the last query row sees. */
static void kvcache_case(tu_rng *r, fa_dtype dt, nan_case c, int causal, int splits)
{
    char where[160];
    snprintf(where, sizeof where, "kvcache dtype=%s %s causal=%d splits=%d", fa_dtype_name(dt),
             case_names[c], causal, splits);
    tu_where = where;
    tu_tensor q = tensor4(dt, B, SQ_DECODE, r), k = tensor4(dt, B, S, r), v = tensor4(dt, B, S, r);
    tu_tensor out = tensor4(dt, B, SQ_DECODE, r);
    int64_t ls[3] = {B, 1, SQ_DECODE};
    tu_tensor lse = tu_tensor_new(dt == FA_DTYPE_F64 ? FA_DTYPE_F64 : FA_DTYPE_F32, 3, ls,
                                  TU_CONTIGUOUS, r);
    plant(c, &q, &k, &v, SQ_DECODE - 1, causal ? S - 1 : AT);
    double *want_o = malloc(sizeof(double) * B * SQ_DECODE * D);
    double want_l[B * SQ_DECODE];
    expect(&q, &k, &v, SQ_DECODE, causal, want_o, want_l);

    fa_kvcache_args a;
    fa_kvcache_args_init(&a);
    a.q = &q.t;
    a.k_cache = &k.t;
    a.v_cache = &v.t;
    a.out = &out.t;
    a.lse = &lse.t;
    a.causal = causal;
    a.num_splits = splits;
    a.num_threads = 2;
    tu_poison(&out);
    tu_poison(&lse);
    fa_status st = fa_attention_kvcache(&a);
    TU_CHECK(st == FA_STATUS_OK, "status %d: %s", (int)st, fa_last_error());
    check_out(&out, &lse, want_o, want_l, SQ_DECODE, dt);
    free(want_o);
    tu_tensor_free(&q);
    tu_tensor_free(&k);
    tu_tensor_free(&v);
    tu_tensor_free(&out);
    tu_tensor_free(&lse);
}

/* NaN in every element of rows [0, n) of t [B, n, 1, D] where rows says so, finite elsewhere. */
static void check_rows(const char *what, const tu_tensor *t, int64_t n, const int *nan_rows)
{
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < n; i++)
            for (int64_t e = 0; e < D; e++) {
                int64_t x[4] = {b, i, 0, e};
                double g = fa_ref_load(&t->t, x);
                const int want = nan_rows[b * n + i];
                TU_CHECK(want ? isnan(g) : isfinite(g), "%s[%lld, %lld, 0, %lld] = %g, want %s",
                         what, (long long)b, (long long)i, (long long)e, g,
                         want ? "NaN" : "finite");
            }
}

/* Non-causal backward: a NaN q row makes its dq row NaN and, through its probabilities, every
 * dk and dv row of its sequence; a NaN key makes every row of its sequence NaN, so all three. */
static void backward_case(tu_rng *r, fa_dtype dt, nan_case c)
{
    char where[160];
    snprintf(where, sizeof where, "backward dtype=%s %s", fa_dtype_name(dt), case_names[c]);
    tu_where = where;
    tu_tensor q = tensor4(dt, B, S, r), k = tensor4(dt, B, S, r), v = tensor4(dt, B, S, r);
    tu_tensor out = tensor4(dt, B, S, r), dout = tensor4(dt, B, S, r);
    tu_tensor dq = tensor4(dt, B, S, r), dk = tensor4(dt, B, S, r), dv = tensor4(dt, B, S, r);
    int64_t ls[3] = {B, 1, S};
    tu_tensor lse = tu_tensor_new(dt == FA_DTYPE_F64 ? FA_DTYPE_F64 : FA_DTYPE_F32, 3, ls,
                                  TU_CONTIGUOUS, r);
    plant(c, &q, &k, &v, AT, AT);
    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.q = &q.t;
    a.k = &k.t;
    a.v = &v.t;
    a.out = &out.t;
    a.lse = &lse.t;
    a.num_threads = 2;
    fa_status st = fa_attention_forward(&a);
    TU_CHECK(st == FA_STATUS_OK, "forward status %d: %s", (int)st, fa_last_error());
    fa_bwd_args g;
    fa_bwd_args_init(&g);
    g.fwd = &a;
    g.dout = &dout.t;
    g.dq = &dq.t;
    g.dk = &dk.t;
    g.dv = &dv.t;
    tu_poison(&dq);
    tu_poison(&dk);
    tu_poison(&dv);
    st = fa_attention_backward(&g);
    TU_CHECK(st == FA_STATUS_OK, "backward status %d: %s", (int)st, fa_last_error());
    int nan_q[B * S] = {0}, nan_kv[B * S] = {0};
    for (int64_t i = 0; i < S; i++) {
        nan_q[S + i] = c != NAN_Q || i == AT; /* sequence 1 */
        nan_kv[S + i] = 1;
    }
    check_rows("dq", &dq, S, nan_q);
    check_rows("dk", &dk, S, nan_kv);
    check_rows("dv", &dv, S, nan_kv);
    tu_tensor_free(&q);
    tu_tensor_free(&k);
    tu_tensor_free(&v);
    tu_tensor_free(&out);
    tu_tensor_free(&dout);
    tu_tensor_free(&dq);
    tu_tensor_free(&dk);
    tu_tensor_free(&dv);
    tu_tensor_free(&lse);
}

int main(void)
{
    tu_rng rng = {tu_master_seed("test_nan")};
    const fa_dtype dts[4] = {FA_DTYPE_F32, FA_DTYPE_F64, FA_DTYPE_F16, FA_DTYPE_BF16};
    for (int di = 0; di < 4; di++)
        for (int c = 0; c < NAN_CASES; c++) {
            for (int causal = 0; causal < 2; causal++) {
                if (c == NAN_V && causal)
                    continue; /* a masked key's P is 0 and 0 * NaN is NaN: no rule to test */
                for (int varlen = 0; varlen < 2; varlen++) {
                    forward_case(&rng, dts[di], (nan_case)c, causal, varlen, S, S);
                    forward_case(&rng, dts[di], (nan_case)c, causal, varlen, SQ_DECODE, S_FEW);
                }
                kvcache_case(&rng, dts[di], (nan_case)c, causal, 1);
                kvcache_case(&rng, dts[di], (nan_case)c, causal, 3);
            }
            if (c == NAN_Q || c == NAN_K)
                backward_case(&rng, dts[di], (nan_case)c);
        }
    return tu_finish("test_nan");
}
