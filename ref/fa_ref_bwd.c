/*
 * fa_ref_bwd: gradients of attention in double, as plain loops from the semantics in
 * include/flashattn.h. Nothing here is shared with src/ (nor with fa_ref.c beyond its public
 * element access and dropout functions), so that it is an independent check.
 *
 * For one query row i of head h, with s_j its scores over the visible keys j:
 *   lse = log(sum_j exp(s_j) + exp(sink)),  P_j = exp(s_j - lse),  Z_j = keep_j / (1 - p)
 *   out = sum_j P_j Z_j v_j,  D = dout . out,  dP_j = Z_j dout . v_j,  dS_j = P_j (dP_j - D)
 *   dx_j = dS_j * ds_j/dx_j   (x_j = scale * q . k_j; softcap: ds/dx = 1 - tanh^2)
 *   dq += scale * dx_j k_j,  dk_j += scale * dx_j q,  dv_j += P_j Z_j dout,  dsink -= p_sink D
 * with p_sink = exp(sink - lse). ALiBi and the masks do not depend on q, k or v, so they only
 * shape s and the visible set. dk/dv sum over the query heads of a GQA group.
 */
#include "fa_ref_bwd.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fa_ref.h"

typedef enum rb_mode {
    RB_EXACT,      /* the analytic gradients */
    RB_LOWP,       /* the naive same-dtype baseline */
    RB_STORED_OUT, /* exact, but D from out as stored in the dtype */
} rb_mode;

typedef struct rb_problem {
    const fa_fwd_args *a;
    const fa_tensor *dout;
    int varlen;
    int lowp;       /* round every stage to dt (the naive same-dtype baseline) */
    int mag;        /* also the sums of |terms| */
    int stored_out; /* D from the out the arguments carry (what the forward stored) */
    fa_dtype dt;
    int64_t b, h, hk, d, dv;
    int64_t sq, sk; /* dense only */
    int64_t tokens_q, tokens_k;
    int64_t max_keys; /* most key rows of one sequence */
    double scale, p, rp;
    int wl, wr;
} rb_problem;

typedef struct rb_seq {
    int64_t bi;
    int64_t q0;     /* first query token */
    int64_t sq;
    int64_t k0;     /* first key token of dk/dv (dense: bi * sk) */
    int64_t sk;     /* keys the queries see (seqused_k) */
    int64_t rows_k; /* key rows the sequence owns in dk/dv (>= sk) */
} rb_seq;

/* Where the gradients go (see the header for the layouts). */
typedef struct rb_grads {
    double *dq, *dk, *dv, *dsinks;
} rb_grads;

/* Work buffers, sized for the longest sequence. */
typedef struct rb_work {
    double *k, *v;       /* [max_keys][d], [max_keys][dv]: one kv head of the sequence */
    double *gk, *gv;     /* dk, dv of that kv head summed over its query heads */
    double *hk_, *hv;    /* dk, dv of one query head */
    double *q, *qs, *g;  /* the row's q, q as the scores use it, dout */
    double *out, *dq;    /* [dv], [d] */
    double *s, *t, *pr, *dp;
    unsigned char *vis, *keep;
    /* magnitudes (sums of |terms|), when asked for */
    double *mgk, *mgv, *mhk, *mhv, *mdq, *kabs, *vabs, *qabs, *gabs, *dpabs;
} rb_work;

static int64_t rb_load_i(const fa_tensor *t, int64_t i)
{
    int64_t idx[1] = {i};
    return (int64_t)fa_ref_load(t, idx);
}

static double rb_round(const rb_problem *P, double x)
{
    return P->lowp ? fa_ref_round(x, P->dt) : x;
}

static int rb_setup(const fa_bwd_args *args, rb_mode mode, rb_problem *P)
{
    memset(P, 0, sizeof *P);
    if (!args || !args->fwd || !args->dout) {
        return -1;
    }
    const fa_fwd_args *a = args->fwd;
    if (!a->q || !a->k || !a->v) {
        return -1;
    }
    P->a = a;
    P->dout = args->dout;
    P->varlen = a->cu_seqlens_q != NULL;
    P->dt = a->q->dtype;
    P->lowp = mode == RB_LOWP;
    P->stored_out = mode == RB_STORED_OUT;
    if (P->varlen) {
        if (!a->cu_seqlens_k || a->q->ndim != 3 || a->k->ndim != 3 || a->v->ndim != 3 ||
            a->cu_seqlens_q->ndim != 1 || a->cu_seqlens_q->shape[0] < 1 ||
            P->dout->ndim != 3) {
            return -1;
        }
        P->b = a->cu_seqlens_q->shape[0] - 1;
        P->tokens_q = a->q->shape[0];
        P->tokens_k = a->k->shape[0];
        P->h = a->q->shape[1];
        P->d = a->q->shape[2];
        P->hk = a->k->shape[1];
        P->dv = a->v->shape[2];
        for (int64_t bi = 0; bi < P->b; bi++) {
            int64_t n = rb_load_i(a->cu_seqlens_k, bi + 1) - rb_load_i(a->cu_seqlens_k, bi);
            if (n > P->max_keys) {
                P->max_keys = n;
            }
        }
    } else {
        if (a->q->ndim != 4 || a->k->ndim != 4 || a->v->ndim != 4 || P->dout->ndim != 4) {
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
        P->tokens_k = P->b * P->sk;
        P->max_keys = P->sk;
    }
    if (P->h <= 0 || P->hk <= 0 || P->h % P->hk != 0 || P->d <= 0 || P->dv <= 0) {
        return -1;
    }
    if (P->dt != FA_DTYPE_F32 && P->dt != FA_DTYPE_F16 && P->dt != FA_DTYPE_BF16 &&
        P->dt != FA_DTYPE_F64) {
        return -1;
    }
    P->scale = isnan(a->softmax_scale) ? 1.0 / sqrt((double)P->d) : a->softmax_scale;
    P->p = a->dropout_p;
    P->rp = 1.0 / (1.0 - a->dropout_p);
    P->wl = a->window_left;
    P->wr = a->causal ? 0 : a->window_right;
    return 0;
}

static void rb_get_seq(const rb_problem *P, int64_t bi, rb_seq *S)
{
    S->bi = bi;
    if (P->varlen) {
        const fa_fwd_args *a = P->a;
        S->q0 = rb_load_i(a->cu_seqlens_q, bi);
        S->sq = rb_load_i(a->cu_seqlens_q, bi + 1) - S->q0;
        S->k0 = rb_load_i(a->cu_seqlens_k, bi);
        S->rows_k = rb_load_i(a->cu_seqlens_k, bi + 1) - S->k0;
        S->sk = a->seqused_k ? rb_load_i(a->seqused_k, bi) : S->rows_k;
    } else {
        S->q0 = bi * P->sq;
        S->sq = P->sq;
        S->k0 = bi * P->sk;
        S->sk = P->sk;
        S->rows_k = P->sk;
    }
}

/* Element x of row `row` (query row or key) of head hh of a [b, s, h, x] / [tokens, h, x] view. */
static double rb_load(const rb_problem *P, const fa_tensor *t, const rb_seq *S, int64_t first,
                      int64_t row, int64_t hh, int64_t x)
{
    if (P->varlen) {
        int64_t idx[3] = {first + row, hh, x};
        return fa_ref_load(t, idx);
    }
    int64_t idx[4] = {S->bi, row, hh, x};
    return fa_ref_load(t, idx);
}

static double rb_slope(const rb_problem *P, int64_t bi, int64_t hh)
{
    const fa_tensor *t = P->a->alibi_slopes;
    if (!t) {
        return 0.0;
    }
    if (t->ndim == 1) {
        int64_t idx[1] = {hh};
        return fa_ref_load(t, idx);
    }
    int64_t idx[2] = {bi, hh};
    return fa_ref_load(t, idx);
}

static int rb_visible(const rb_problem *P, const rb_seq *S, int64_t i, int64_t j)
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

static double rb_dot(const double *x, const double *y, int64_t n)
{
    double acc = 0.0;
    for (int64_t c = 0; c < n; c++) {
        acc += x[c] * y[c];
    }
    return acc;
}

/*
 * Query row i of head hh: writes its dq into W->dq, adds to W->hk_/W->hv (this head's dk/dv)
 * and to *dsink; with magnitudes, the same into W->mdq, W->mhk, W->mhv and *msink. K and V of
 * the row's kv head are in W->k / W->v.
 */
static void rb_row(const rb_problem *P, const rb_seq *S, int64_t hh, int64_t i, rb_work *W,
                   double *dsink, double *msink)
{
    const fa_fwd_args *a = P->a;
    const int64_t d = P->d, dv = P->dv;
    const int has_sink = a->sinks != NULL, mag = P->mag;
    const double cap = a->softcap;
    double sink = -INFINITY;
    if (has_sink) {
        int64_t idx[1] = {hh};
        sink = fa_ref_load(a->sinks, idx);
    }
    for (int64_t x = 0; x < d; x++) {
        W->q[x] = rb_load(P, a->q, S, S->q0, i, hh, x);
        /* the lowp baseline scales q first, as upstream's naive attention does */
        W->qs[x] = P->lowp ? rb_round(P, W->q[x] * P->scale) : W->q[x];
        W->dq[x] = 0.0;
        if (mag) {
            W->qabs[x] = fabs(W->q[x]);
            W->mdq[x] = 0.0;
        }
    }
    for (int64_t x = 0; x < dv; x++) {
        W->g[x] = rb_load(P, P->dout, S, S->q0, i, hh, x);
        if (mag) {
            W->gabs[x] = fabs(W->g[x]);
        }
    }

    /* scores */
    const double slope = rb_slope(P, S->bi, hh);
    double m = sink;
    int64_t nvis = 0;
    for (int64_t j = 0; j < S->sk; j++) {
        W->vis[j] = (unsigned char)rb_visible(P, S, i, j);
        if (!W->vis[j]) {
            continue;
        }
        nvis++;
        double acc = rb_dot(W->qs, W->k + j * d, d), s, t = 0.0;
        if (P->lowp) {
            s = rb_round(P, acc);
            if (cap > 0) {
                t = rb_round(P, tanh(rb_round(P, s / cap)));
                s = rb_round(P, t * cap);
            }
        } else {
            s = acc * P->scale;
            if (cap > 0) {
                t = tanh(s / cap);
                s = cap * t;
            }
        }
        if (a->alibi_slopes) {
            s = rb_round(P, s - slope * (double)llabs(i + S->sk - S->sq - j));
        }
        W->s[j] = s;
        W->t[j] = t;
        if (s > m) {
            m = s;
        }
    }
    if (nvis == 0) {
        return; /* out 0, D 0: no gradient flows, not even to the sink */
    }

    /* probabilities from the row's own lse, and the dropout mask */
    double sum = has_sink ? exp(sink - m) : 0.0;
    for (int64_t j = 0; j < S->sk; j++) {
        if (W->vis[j]) {
            sum += exp(W->s[j] - m);
        }
    }
    const double lse = m + log(sum);
    for (int64_t j = 0; j < S->sk; j++) {
        if (!W->vis[j]) {
            continue;
        }
        W->pr[j] = P->lowp ? rb_round(P, exp(W->s[j] - m) / sum) : exp(W->s[j] - lse);
        W->keep[j] = 1;
        if (P->p > 0.0) {
            W->keep[j] = (unsigned char)fa_ref_dropout_keep(a->seed, a->offset, P->h, S->bi, hh,
                                                            i, j, P->p);
        }
    }

    /* D = dout . out and dP; the lowp baseline takes D as rowsum(P * dP) (softmax backward) */
    double dsum = 0.0, dsum_abs = 0.0;
    const double z_kept = P->p > 0.0 ? P->rp : 1.0;
    if (P->lowp) {
        for (int64_t j = 0; j < S->sk; j++) {
            if (W->vis[j]) {
                W->dp[j] = W->keep[j] ? rb_round(P, rb_dot(W->g, W->v + j * dv, dv)) : 0.0;
                dsum += W->pr[j] * W->dp[j];
            }
        }
    } else {
        for (int64_t x = 0; x < dv; x++) {
            W->out[x] = 0.0;
        }
        for (int64_t j = 0; j < S->sk; j++) {
            if (!W->vis[j]) {
                continue;
            }
            W->dp[j] = W->keep[j] ? z_kept * rb_dot(W->g, W->v + j * dv, dv) : 0.0;
            if (W->keep[j]) {
                for (int64_t x = 0; x < dv; x++) {
                    W->out[x] += W->pr[j] * z_kept * W->v[j * dv + x];
                }
            }
            if (mag) {
                /* |terms| of dP_j, and of D = sum_j P_j dP_j = sum_j,x P_j Z_j g_x v_jx */
                W->dpabs[j] = W->keep[j] ? z_kept * rb_dot(W->gabs, W->vabs + j * dv, dv) : 0.0;
                dsum_abs += W->pr[j] * W->dpabs[j];
            }
        }
        if (P->stored_out) {
            for (int64_t x = 0; x < dv; x++) {
                W->out[x] = rb_load(P, a->out, S, S->q0, i, hh, x);
            }
        }
        dsum = rb_dot(W->g, W->out, dv);
    }
    if (has_sink) {
        double p_sink = P->lowp ? rb_round(P, exp(sink - m) / sum) : exp(sink - lse);
        *dsink -= p_sink * dsum;
        if (mag) {
            *msink += p_sink * dsum_abs;
        }
    }

    /* gradients of the scores, then of q, k, v */
    for (int64_t j = 0; j < S->sk; j++) {
        if (!W->vis[j]) {
            continue;
        }
        double ds = rb_round(P, W->pr[j] * (W->dp[j] - dsum)), dx = ds, deriv = 1.0;
        if (cap > 0) {
            const double t = W->t[j];
            deriv = 1.0 - t * t;
            if (P->lowp) {
                double dt = rb_round(P, ds * cap);
                double du = rb_round(P, dt * deriv);
                dx = rb_round(P, du / cap);
            } else {
                dx = ds * deriv;
            }
        }
        /* exact: x = scale * q.k; lowp: a = (q*scale).k, the scale is applied to dq later */
        const double coef = P->lowp ? dx : dx * P->scale;
        const double *kj = W->k + j * d;
        double *hkj = W->hk_ + j * d;
        for (int64_t x = 0; x < d; x++) {
            W->dq[x] += coef * kj[x];
            hkj[x] += coef * W->qs[x];
        }
        /* lowp: d(v / (1 - p)) here, times 1 / (1 - p) once summed */
        const double pz = W->keep[j] ? (P->lowp ? W->pr[j] : W->pr[j] * z_kept) : 0.0;
        double *hvj = W->hv + j * dv;
        for (int64_t x = 0; x < dv; x++) {
            hvj[x] += pz * W->g[x];
        }
        if (mag) {
            /* softcap: the derivative 1 - t^2 is a difference, its |terms| are 1 + t^2 (a t
               rounded near 1 moves it by ~2 eps however small it is) */
            const double dabs = cap > 0 ? 1.0 + W->t[j] * W->t[j] : 1.0;
            const double cabs = W->pr[j] * (W->dpabs[j] + dsum_abs) * dabs * P->scale;
            const double *kaj = W->kabs + j * d;
            double *mkj = W->mhk + j * d, *mvj = W->mhv + j * dv;
            for (int64_t x = 0; x < d; x++) {
                W->mdq[x] += cabs * kaj[x];
                mkj[x] += cabs * W->qabs[x];
            }
            for (int64_t x = 0; x < dv; x++) {
                mvj[x] += pz * W->gabs[x];
            }
        }
    }
    if (P->lowp) {
        for (int64_t x = 0; x < d; x++) {
            W->dq[x] = rb_round(P, rb_round(P, W->dq[x]) * P->scale);
        }
    }
}

static void rb_work_free(rb_work *W)
{
    double **bufs[] = {&W->k,   &W->v,   &W->gk,  &W->gv,   &W->hk_,  &W->hv,   &W->q,
                       &W->qs,  &W->g,   &W->out, &W->dq,   &W->s,    &W->t,    &W->pr,
                       &W->dp,  &W->mgk, &W->mgv, &W->mhk,  &W->mhv,  &W->mdq,  &W->kabs,
                       &W->vabs, &W->qabs, &W->gabs, &W->dpabs};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        free(*bufs[i]);
        *bufs[i] = NULL;
    }
    free(W->vis);
    free(W->keep);
    W->vis = W->keep = NULL;
}

static int rb_work_alloc(const rb_problem *P, rb_work *W)
{
    memset(W, 0, sizeof *W);
    const size_t nk = (size_t)(P->max_keys > 0 ? P->max_keys : 1);
    const size_t d = (size_t)P->d, dv = (size_t)P->dv, nm = P->mag ? 1 : 0;
    const struct {
        double **buf;
        size_t n;
    } plan[] = {
        {&W->k, nk * d},      {&W->v, nk * dv},      {&W->gk, nk * d},      {&W->gv, nk * dv},
        {&W->hk_, nk * d},    {&W->hv, nk * dv},     {&W->q, d},            {&W->qs, d},
        {&W->g, dv},          {&W->out, dv},         {&W->dq, d},           {&W->s, nk},
        {&W->t, nk},          {&W->pr, nk},          {&W->dp, nk},          {&W->mgk, nm * nk * d},
        {&W->mgv, nm * nk * dv}, {&W->mhk, nm * nk * d}, {&W->mhv, nm * nk * dv},
        {&W->mdq, nm * d},    {&W->kabs, nm * nk * d}, {&W->vabs, nm * nk * dv},
        {&W->qabs, nm * d},   {&W->gabs, nm * dv},   {&W->dpabs, nm * nk},
    };
    int ok = 1;
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++) {
        if (plan[i].n > 0) {
            *plan[i].buf = malloc(sizeof(double) * plan[i].n);
            ok = ok && *plan[i].buf;
        }
    }
    W->vis = malloc(nk);
    W->keep = malloc(nk);
    if (!ok || !W->vis || !W->keep) {
        rb_work_free(W);
        return -1;
    }
    return 0;
}

/* Adds one query head's dk/dv (src) into its group's (dst); lowp rounds each as a tensor of its
   own, as the gradient of GQA's repeat sums per-head tensors. */
static void rb_head_add(const rb_problem *P, double *dst, const double *src, int64_t n, int is_v)
{
    for (int64_t e = 0; e < n; e++) {
        double g = src[e];
        if (is_v && P->lowp && P->p > 0.0) {
            g = rb_round(P, g) * P->rp;
        }
        dst[e] += rb_round(P, g);
    }
}

/* One kv head of one sequence: dq of its query heads' rows, its dk/dv, their dsinks shares. */
static void rb_kv_head(const rb_problem *P, const rb_seq *S, int64_t kh, rb_work *W,
                       const rb_grads *G, const rb_grads *M)
{
    const int64_t d = P->d, dvd = P->dv, group = P->h / P->hk;
    const size_t nkd = (size_t)(S->sk * d), nkv = (size_t)(S->sk * dvd);
    for (int64_t j = 0; j < S->sk; j++) {
        for (int64_t x = 0; x < d; x++) {
            W->k[j * d + x] = rb_load(P, P->a->k, S, S->k0, j, kh, x);
            if (P->mag) {
                W->kabs[j * d + x] = fabs(W->k[j * d + x]);
            }
        }
        for (int64_t x = 0; x < dvd; x++) {
            double v = rb_load(P, P->a->v, S, S->k0, j, kh, x);
            /* upstream's naive attention multiplies v by 1 / (1 - p), in the dtype */
            W->v[j * dvd + x] = (P->lowp && P->p > 0.0) ? rb_round(P, v * P->rp) : v;
            if (P->mag) {
                W->vabs[j * dvd + x] = fabs(v);
            }
        }
    }
    memset(W->gk, 0, sizeof(double) * nkd);
    memset(W->gv, 0, sizeof(double) * nkv);
    if (P->mag) {
        memset(W->mgk, 0, sizeof(double) * nkd);
        memset(W->mgv, 0, sizeof(double) * nkv);
    }
    for (int64_t hh = kh * group; hh < (kh + 1) * group; hh++) {
        memset(W->hk_, 0, sizeof(double) * nkd);
        memset(W->hv, 0, sizeof(double) * nkv);
        if (P->mag) {
            memset(W->mhk, 0, sizeof(double) * nkd);
            memset(W->mhv, 0, sizeof(double) * nkv);
        }
        double dsink = 0.0, msink = 0.0;
        for (int64_t i = 0; i < S->sq; i++) {
            rb_row(P, S, hh, i, W, &dsink, &msink);
            const int64_t off = ((S->q0 + i) * P->h + hh) * d;
            memcpy(G->dq + off, W->dq, sizeof(double) * (size_t)d);
            if (P->mag) {
                memcpy(M->dq + off, W->mdq, sizeof(double) * (size_t)d);
            }
        }
        if (G->dsinks) {
            G->dsinks[hh] += dsink;
            if (P->mag) {
                M->dsinks[hh] += msink;
            }
        }
        rb_head_add(P, W->gk, W->hk_, (int64_t)nkd, 0);
        rb_head_add(P, W->gv, W->hv, (int64_t)nkv, 1);
        if (P->mag) {
            rb_head_add(P, W->mgk, W->mhk, (int64_t)nkd, 0);
            rb_head_add(P, W->mgv, W->mhv, (int64_t)nkv, 0);
        }
    }
    for (int64_t j = 0; j < S->sk; j++) {
        const int64_t ok = ((S->k0 + j) * P->hk + kh) * d, ov = ((S->k0 + j) * P->hk + kh) * dvd;
        for (int64_t x = 0; x < d; x++) {
            G->dk[ok + x] = rb_round(P, W->gk[j * d + x]);
        }
        for (int64_t x = 0; x < dvd; x++) {
            G->dv[ov + x] = rb_round(P, W->gv[j * dvd + x]);
        }
        if (P->mag) {
            memcpy(M->dk + ok, W->mgk + j * d, sizeof(double) * (size_t)d);
            memcpy(M->dv + ov, W->mgv + j * dvd, sizeof(double) * (size_t)dvd);
        }
    }
}

static void rb_grads_zero(const rb_problem *P, const rb_grads *G)
{
    memset(G->dq, 0, sizeof(double) * (size_t)(P->tokens_q * P->h * P->d));
    memset(G->dk, 0, sizeof(double) * (size_t)(P->tokens_k * P->hk * P->d));
    memset(G->dv, 0, sizeof(double) * (size_t)(P->tokens_k * P->hk * P->dv));
    if (G->dsinks) {
        memset(G->dsinks, 0, sizeof(double) * (size_t)P->h);
    }
}

static int rb_backward(const fa_bwd_args *args, rb_mode mode, const rb_grads *G,
                       const rb_grads *M)
{
    rb_problem P;
    if (rb_setup(args, mode, &P) != 0 || !G->dq || !G->dk || !G->dv) {
        return -1;
    }
    P.mag = M != NULL;
    const int has_sinks = P.a->sinks != NULL;
    if (has_sinks && (!G->dsinks || (M && !M->dsinks))) {
        return -1;
    }
    if (M && (!M->dq || !M->dk || !M->dv)) {
        return -1;
    }
    rb_grads g = *G, mg = M ? *M : *G;
    if (!has_sinks) {
        g.dsinks = mg.dsinks = NULL;
    }
    rb_work W;
    if (rb_work_alloc(&P, &W) != 0) {
        return -1;
    }
    /* rows outside every sequence, keys past seqused_k and unseen keys stay 0 */
    rb_grads_zero(&P, &g);
    if (M) {
        rb_grads_zero(&P, &mg);
    }
    for (int64_t bi = 0; bi < P.b; bi++) {
        rb_seq S;
        rb_get_seq(&P, bi, &S);
        if (S.sk > S.rows_k || S.sk < 0) {
            rb_work_free(&W);
            return -1; /* seqused_k beyond the sequence: the library rejects it */
        }
        for (int64_t kh = 0; kh < P.hk; kh++) {
            rb_kv_head(&P, &S, kh, &W, &g, M ? &mg : NULL);
        }
    }
    if (has_sinks) {
        for (int64_t hh = 0; hh < P.h; hh++) {
            g.dsinks[hh] = rb_round(&P, g.dsinks[hh]);
        }
    }
    rb_work_free(&W);
    return 0;
}

int fa_ref_backward(const fa_bwd_args *args, double *dq, double *dk, double *dv, double *dsinks)
{
    const rb_grads g = {dq, dk, dv, dsinks};
    return rb_backward(args, RB_EXACT, &g, NULL);
}

int fa_ref_backward_mag(const fa_bwd_args *args, double *dq, double *dk, double *dv,
                        double *dsinks, double *mq, double *mk, double *mv, double *msinks)
{
    const rb_grads g = {dq, dk, dv, dsinks}, m = {mq, mk, mv, msinks};
    return rb_backward(args, RB_EXACT, &g, &m);
}

int fa_ref_backward_stored_out(const fa_bwd_args *args, double *dq, double *dk, double *dv,
                               double *dsinks)
{
    const rb_grads g = {dq, dk, dv, dsinks};
    return rb_backward(args, RB_STORED_OUT, &g, NULL);
}

int fa_ref_backward_lowp(const fa_bwd_args *args, double *dq, double *dk, double *dv,
                         double *dsinks)
{
    const rb_grads g = {dq, dk, dv, dsinks};
    return rb_backward(args, RB_LOWP, &g, NULL);
}
