/*
 * fa_ref: double-precision reference attention, written as plain loops from the semantics in
 * include/flashattn.h. Deliberately simple and slow; nothing here is shared with src/.
 */
#include "fa_ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------ */
/* Philox4x32-R and the dropout keep bit                                                       */

static void mulhilo32(uint32_t a, uint32_t b, uint32_t *hi, uint32_t *lo)
{
    uint64_t prod = (uint64_t)a * (uint64_t)b;
    *hi = (uint32_t)(prod >> 32);
    *lo = (uint32_t)prod;
}

void fa_ref_philox4x32(const uint32_t ctr[4], const uint32_t key[2], int rounds, uint32_t out[4])
{
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int round = 0; round < rounds; round++) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        uint32_t hi0, lo0, hi1, lo1;
        mulhilo32(0xD2511F53u, c0, &hi0, &lo0);
        mulhilo32(0xCD9E8D57u, c2, &hi1, &lo1);
        uint32_t n0 = hi1 ^ c1 ^ k0;
        uint32_t n1 = lo1;
        uint32_t n2 = hi0 ^ c3 ^ k1;
        uint32_t n3 = lo0;
        c0 = n0;
        c1 = n1;
        c2 = n2;
        c3 = n3;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

int fa_ref_dropout_keep(uint64_t seed, uint64_t offset, int64_t num_heads, int64_t batch,
                        int64_t head, int64_t row, int64_t col, double dropout_p)
{
    uint64_t c = offset + (uint64_t)batch * (uint64_t)num_heads + (uint64_t)head;
    uint32_t ctr[4] = {(uint32_t)((uint64_t)col / 16), (uint32_t)(uint64_t)row, (uint32_t)c,
                       (uint32_t)(c >> 32)};
    uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    uint32_t w[4];
    fa_ref_philox4x32(ctr, key, 7, w);
    /* column c of the block's 16: word (c % 8) / 2, byte c % 2 + 2 (c / 8) */
    int64_t cb = col % 16;
    uint32_t byte = (uint32_t)(cb % 2 + 2 * (cb / 8));
    uint32_t r = (w[(cb % 8) / 2] >> (8 * byte)) & 0xffu;
    if (!(dropout_p < 1.0))
        return 0;
    if (dropout_p <= 0.0)
        return 1;
    double threshold = floor((1.0 - dropout_p) * 256.0 + 0.5);
    return (double)r < threshold;
}

int fa_ref_probs_block_n(int head_dim, int dropout, int causal)
{
    (void)causal; /* only matters on sm86/89 */
    if (head_dim <= 32) {
        return 128;
    }
    if (head_dim <= 64) {
        return dropout ? 64 : 128;
    }
    if (head_dim <= 96) {
        return 64;
    }
    if (head_dim <= 128) {
        return dropout ? 32 : 64;
    }
    return 64;
}

/* ------------------------------------------------------------------------------------------ */
/* Problem layout                                                                              */

typedef struct ref_problem {
    const fa_fwd_args *a;
    int varlen;
    int64_t b, h, hk, d, dv;
    int64_t sq, sk; /* dense only */
    int64_t tokens_q;
    int64_t max_sq, max_sk;
    double scale;
    int wl, wr;
    int fp8;          /* fp8 inputs: loads are dequantised by the descales */
    int round_inputs; /* lowp fp8: dequantised inputs rounded to the output's dtype */
} ref_problem;

typedef struct ref_seq {
    int64_t bi;
    int64_t q0; /* first query token */
    int64_t sq;
    int64_t k0; /* first key token (varlen) */
    int64_t sk;
} ref_seq;

static int64_t load_i(const fa_tensor *t, int64_t i)
{
    int64_t idx[1] = {i};
    return (int64_t)fa_ref_load(t, idx);
}

static int setup(const fa_fwd_args *a, ref_problem *P)
{
    memset(P, 0, sizeof *P);
    if (!a || !a->q || !a->k || !a->v) {
        return -1;
    }
    P->a = a;
    P->varlen = a->cu_seqlens_q != NULL;
    if (P->varlen) {
        if (!a->cu_seqlens_k || a->q->ndim != 3 || a->k->ndim != 3 || a->v->ndim != 3 ||
            a->cu_seqlens_q->ndim != 1 || a->cu_seqlens_q->shape[0] < 1) {
            return -1;
        }
        P->b = a->cu_seqlens_q->shape[0] - 1;
        P->tokens_q = a->q->shape[0];
        P->h = a->q->shape[1];
        P->d = a->q->shape[2];
        P->hk = a->k->shape[1];
        P->dv = a->v->shape[2];
        P->max_sq = a->max_seqlen_q;
        P->max_sk = a->max_seqlen_k;
        /* the score buffer must hold every sequence's keys, whatever max_seqlen_k says */
        for (int64_t bi = 0; bi < P->b; bi++) {
            int64_t n = load_i(a->cu_seqlens_k, bi + 1) - load_i(a->cu_seqlens_k, bi);
            if (n > P->max_sk) {
                P->max_sk = n;
            }
            int64_t m = load_i(a->cu_seqlens_q, bi + 1) - load_i(a->cu_seqlens_q, bi);
            if (m > P->max_sq) {
                P->max_sq = m;
            }
        }
    } else {
        if (a->q->ndim != 4 || a->k->ndim != 4 || a->v->ndim != 4) {
            return -1;
        }
        P->b = a->q->shape[0];
        P->sq = a->q->shape[1];
        P->h = a->q->shape[2];
        P->d = a->q->shape[3];
        P->sk = a->k->shape[1];
        P->hk = a->k->shape[2];
        P->dv = a->v->shape[3];
        P->tokens_q = P->b * P->sq;
        P->max_sq = P->sq;
        P->max_sk = P->sk;
    }
    if (P->h <= 0 || P->hk <= 0 || P->h % P->hk != 0 || P->d <= 0 || P->dv < 0) {
        return -1;
    }
    switch (a->q->dtype) {
    case FA_DTYPE_F32:
    case FA_DTYPE_F16:
    case FA_DTYPE_BF16:
    case FA_DTYPE_F64:
        break;
    case FA_DTYPE_F8E4M3:
    case FA_DTYPE_F8E5M2:
        P->fp8 = 1;
        break;
    default:
        return -1;
    }
    P->scale = isnan(a->softmax_scale) ? 1.0 / sqrt((double)P->d) : a->softmax_scale;
    P->wl = a->window_left;
    P->wr = a->causal ? 0 : a->window_right;
    return 0;
}

static void get_seq(const ref_problem *P, int64_t bi, ref_seq *S)
{
    S->bi = bi;
    if (P->varlen) {
        const fa_fwd_args *a = P->a;
        S->q0 = load_i(a->cu_seqlens_q, bi);
        S->sq = load_i(a->cu_seqlens_q, bi + 1) - S->q0;
        S->k0 = load_i(a->cu_seqlens_k, bi);
        S->sk = a->seqused_k ? load_i(a->seqused_k, bi) : load_i(a->cu_seqlens_k, bi + 1) - S->k0;
    } else {
        S->q0 = bi * P->sq;
        S->sq = P->sq;
        S->k0 = 0;
        S->sk = P->sk;
    }
}

/* fp8: the dequantisation scale of sequence bi and kv head kh (1 without the tensor); loads
   multiply by it and, for the lowp baseline, round the product to the output's dtype as
   upstream's reference does. */
static double dequant(const ref_problem *P, const fa_tensor *descale, int64_t bi, int64_t kh,
                      double x)
{
    if (!P->fp8) {
        return x;
    }
    if (descale) {
        int64_t idx[2] = {bi, kh};
        x *= fa_ref_load(descale, idx);
    }
    return P->round_inputs ? fa_ref_round(x, P->a->out->dtype) : x;
}

/* element x of query row i / key j of head hh in sequence S */
static double ld_q_raw(const ref_problem *P, const ref_seq *S, int64_t i, int64_t hh, int64_t x)
{
    if (P->varlen) {
        int64_t idx[3] = {S->q0 + i, hh, x};
        return fa_ref_load(P->a->q, idx);
    }
    int64_t idx[4] = {S->bi, i, hh, x};
    return fa_ref_load(P->a->q, idx);
}

static double ld_q(const ref_problem *P, const ref_seq *S, int64_t i, int64_t hh, int64_t x)
{
    return dequant(P, P->a->q_descale, S->bi, hh / (P->h / P->hk), ld_q_raw(P, S, i, hh, x));
}

static double ld_kv_raw(const ref_problem *P, const fa_tensor *t, const ref_seq *S, int64_t j,
                        int64_t hh, int64_t x)
{
    if (P->varlen) {
        int64_t idx[3] = {S->k0 + j, hh, x};
        return fa_ref_load(t, idx);
    }
    int64_t idx[4] = {S->bi, j, hh, x};
    return fa_ref_load(t, idx);
}

static double ld_kv(const ref_problem *P, const fa_tensor *t, const ref_seq *S, int64_t j,
                    int64_t hh, int64_t x)
{
    const fa_tensor *descale = t == P->a->k ? P->a->k_descale : P->a->v_descale;
    return dequant(P, descale, S->bi, hh, ld_kv_raw(P, t, S, j, hh, x));
}

static double alibi_slope(const ref_problem *P, int64_t bi, int64_t hh)
{
    const fa_tensor *t = P->a->alibi_slopes;
    if (t->ndim == 1) {
        int64_t idx[1] = {hh};
        return fa_ref_load(t, idx);
    }
    int64_t idx[2] = {bi, hh};
    return fa_ref_load(t, idx);
}

static double sink_logit(const ref_problem *P, int64_t hh)
{
    int64_t idx[1] = {hh};
    return fa_ref_load(P->a->sinks, idx);
}

static int visible(const ref_problem *P, const ref_seq *S, int64_t i, int64_t j)
{
    int64_t diag = i + S->sk - S->sq;
    if (P->wl >= 0 && j < diag - P->wl) {
        return 0;
    }
    if (P->wr >= 0 && j > diag + P->wr) {
        return 0;
    }
    return 1;
}

/* Scores of query row i (head hh) against every key of the sequence. With lowp an F32/F16/BF16
   dtype, each stage is rounded to it (upstream's same-dtype baseline); otherwise exact doubles.
   vis[j] says whether key j is visible; s[j] is meaningful only there. Returns the count. */
static int64_t row_scores(const ref_problem *P, const ref_seq *S, int64_t hh, int64_t i,
                          int lowp, fa_dtype dt, double *qbuf, double *s, unsigned char *vis)
{
    const fa_fwd_args *a = P->a;
    int64_t kh = hh / (P->h / P->hk);
    int64_t nvis = 0;
    for (int64_t x = 0; x < P->d; x++) {
        double qv = ld_q(P, S, i, hh, x);
        qbuf[x] = lowp ? fa_ref_round(qv * P->scale, dt) : qv;
    }
    double slope = a->alibi_slopes ? alibi_slope(P, S->bi, hh) : 0.0;
    for (int64_t j = 0; j < S->sk; j++) {
        vis[j] = (unsigned char)visible(P, S, i, j);
        if (!vis[j]) {
            s[j] = -INFINITY;
            continue;
        }
        nvis++;
        double acc = 0.0;
        for (int64_t x = 0; x < P->d; x++) {
            acc += qbuf[x] * ld_kv(P, a->k, S, j, kh, x);
        }
        double sc;
        if (lowp) {
            sc = fa_ref_round(acc, dt);
            if (a->softcap > 0) {
                sc = fa_ref_round(sc / a->softcap, dt);
                sc = fa_ref_round(tanh(sc), dt);
                sc = fa_ref_round(sc * a->softcap, dt);
            }
        } else {
            sc = acc * P->scale;
            if (a->softcap > 0) {
                sc = a->softcap * tanh(sc / a->softcap);
            }
        }
        if (a->alibi_slopes) {
            double dist = (double)llabs(i + S->sk - S->sq - j);
            sc -= slope * dist;
            if (lowp) {
                sc = fa_ref_round(sc, dt);
            }
        }
        s[j] = sc;
    }
    return nvis;
}

typedef struct ref_buffers {
    double *q;
    double *s;
    unsigned char *vis;
} ref_buffers;

static int alloc_buffers(const ref_problem *P, ref_buffers *B)
{
    size_t nk = (size_t)(P->max_sk > 0 ? P->max_sk : 1);
    B->q = malloc(sizeof(double) * (size_t)P->d);
    B->s = malloc(sizeof(double) * nk);
    B->vis = malloc(nk);
    if (!B->q || !B->s || !B->vis) {
        free(B->q);
        free(B->s);
        free(B->vis);
        return -1;
    }
    return 0;
}

static void free_buffers(ref_buffers *B)
{
    free(B->q);
    free(B->s);
    free(B->vis);
}

/* ------------------------------------------------------------------------------------------ */
/* Forward                                                                                     */

/* lowp: upstream's same-dtype baseline (fp8: in the output's dtype, P rounded to e4m3 after
   normalisation, as upstream's intermediate_dtype). round_p (fp8 only): P rounded as the
   library's fp8 forward, 2^8 exp(s - m) to e4m3 with m = max(scores, sink), everything else
   exact. */
static int forward_impl(const fa_fwd_args *args, int64_t row_step, int lowp, int round_p,
                        double *out, double *lse)
{
    ref_problem P;
    if (setup(args, &P) != 0 || row_step < 1 || !out || (round_p && !P.fp8)) {
        return -1;
    }
    fa_dtype dt = P.fp8 ? args->out->dtype : args->q->dtype;
    P.round_inputs = P.fp8 && lowp;
    ref_buffers B;
    if (alloc_buffers(&P, &B) != 0) {
        return -1;
    }
    const int64_t h = P.h, dv = P.dv;
    const double p = args->dropout_p;
    const double rp = 1.0 / (1.0 - p);

    /* every computed token starts as "outside every sequence" */
    for (int64_t t = 0; t < P.tokens_q; t += row_step) {
        for (int64_t hh = 0; hh < h; hh++) {
            for (int64_t x = 0; x < dv; x++) {
                out[(t * h + hh) * dv + x] = 0.0;
            }
            if (lse) {
                lse[t * h + hh] = INFINITY;
            }
        }
    }

    for (int64_t bi = 0; bi < P.b; bi++) {
        ref_seq S;
        get_seq(&P, bi, &S);
        for (int64_t i = 0; i < S.sq; i++) {
            int64_t tok = S.q0 + i;
            if (tok % row_step != 0) {
                continue;
            }
            for (int64_t hh = 0; hh < h; hh++) {
                int64_t kh = hh / (h / P.hk);
                double *o = out + (tok * h + hh) * dv;
                int64_t nvis = row_scores(&P, &S, hh, i, lowp, dt, B.q, B.s, B.vis);
                int has_sink = args->sinks != NULL;
                double sink = has_sink ? sink_logit(&P, hh) : -INFINITY;
                if (nvis == 0) {
                    /* out stays 0; lse is the sink alone, or +inf */
                    if (lse) {
                        lse[tok * h + hh] = has_sink ? sink : INFINITY;
                    }
                    continue;
                }
                double m = sink;
                for (int64_t j = 0; j < S.sk; j++) {
                    if (B.vis[j] && B.s[j] > m) {
                        m = B.s[j];
                    }
                }
                double sum = has_sink ? exp(sink - m) : 0.0;
                for (int64_t j = 0; j < S.sk; j++) {
                    if (B.vis[j]) {
                        sum += exp(B.s[j] - m);
                    }
                }
                double l = m + log(sum);
                if (lse) {
                    lse[tok * h + hh] = l;
                }
                for (int64_t j = 0; j < S.sk; j++) {
                    if (!B.vis[j]) {
                        continue;
                    }
                    double pr;
                    if (lowp && P.fp8) {
                        pr = fa_ref_round(exp(B.s[j] - m) / sum, FA_DTYPE_F8E4M3);
                    } else if (lowp) {
                        pr = fa_ref_round(exp(B.s[j] - m) / sum, dt);
                    } else if (round_p) {
                        pr = fa_ref_round(256.0 * exp(B.s[j] - m), FA_DTYPE_F8E4M3) /
                             (256.0 * sum);
                    } else {
                        pr = exp(B.s[j] - l);
                    }
                    if (p > 0.0) {
                        int keep = fa_ref_dropout_keep(args->seed, args->offset, h, bi, hh, i, j, p);
                        if (!keep) {
                            continue;
                        }
                    }
                    for (int64_t x = 0; x < dv; x++) {
                        double vv = ld_kv(&P, args->v, &S, j, kh, x);
                        if (p > 0.0) {
                            vv = lowp ? fa_ref_round(vv * rp, dt) : vv * rp;
                        }
                        o[x] += pr * vv;
                    }
                }
                if (lowp) {
                    for (int64_t x = 0; x < dv; x++) {
                        o[x] = fa_ref_round(o[x], dt);
                    }
                }
            }
        }
    }
    free_buffers(&B);
    return 0;
}

int fa_ref_forward(const fa_fwd_args *args, int64_t row_step, double *out, double *lse)
{
    return forward_impl(args, row_step, 0, 0, out, lse);
}

int fa_ref_forward_lowp(const fa_fwd_args *args, double *out)
{
    if (!args || !args->q) {
        return -1;
    }
    if (args->q->dtype == FA_DTYPE_F64) {
        return forward_impl(args, 1, 0, 0, out, NULL);
    }
    return forward_impl(args, 1, 1, 0, out, NULL);
}

int fa_ref_forward_fp8(const fa_fwd_args *args, double *out, double *lse)
{
    return forward_impl(args, 1, 0, 1, out, lse);
}

/* ------------------------------------------------------------------------------------------ */
/* probs (S_dmask)                                                                             */

int fa_ref_probs(const fa_fwd_args *args, double *probs)
{
    ref_problem P;
    if (setup(args, &P) != 0 || !probs) {
        return -1;
    }
    /* the output is [b, h, max_sq, max_sk] with the caller's max_seqlen (dense: sq, sk) */
    int64_t msq = P.varlen ? args->max_seqlen_q : P.sq;
    int64_t msk = P.varlen ? args->max_seqlen_k : P.sk;
    ref_buffers B;
    if (alloc_buffers(&P, &B) != 0) {
        return -1;
    }
    const double p = args->dropout_p;
    const int64_t bn = fa_ref_probs_block_n((int)P.d, p > 0.0, args->causal);
    size_t total = (size_t)(P.b * P.h * msq * msk);
    for (size_t e = 0; e < total; e++) {
        probs[e] = 0.0;
    }
    for (int64_t bi = 0; bi < P.b; bi++) {
        ref_seq S;
        get_seq(&P, bi, &S);
        for (int64_t hh = 0; hh < P.h; hh++) {
            for (int64_t i = 0; i < S.sq && i < msq; i++) {
                double *row = probs + ((bi * P.h + hh) * msq + i) * msk;
                row_scores(&P, &S, hh, i, 0, args->q->dtype, B.q, B.s, B.vis);
                int64_t nblocks = (S.sk + bn - 1) / bn;
                double m = -INFINITY;
                for (int64_t nb = nblocks - 1; nb >= 0; nb--) {
                    int64_t j0 = nb * bn;
                    int64_t j1 = j0 + bn < S.sk ? j0 + bn : S.sk;
                    for (int64_t j = j0; j < j1; j++) {
                        if (B.vis[j] && B.s[j] > m) {
                            m = B.s[j];
                        }
                    }
                    for (int64_t j = j0; j < j1 && j < msk; j++) {
                        if (!B.vis[j]) {
                            continue;
                        }
                        double val = exp(B.s[j] - m);
                        if (p > 0.0 &&
                            !fa_ref_dropout_keep(args->seed, args->offset, P.h, bi, hh, i, j, p)) {
                            val = -val;
                        }
                        row[j] = val;
                    }
                }
            }
        }
    }
    free_buffers(&B);
    return 0;
}
