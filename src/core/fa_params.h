/*
 * The validated parameter record of the forward and the backward: core builds it once from the
 * public arguments and every backend reads it.
 */
#ifndef FA_PARAMS_H
#define FA_PARAMS_H

#include <stdint.h>

#include "core/fa_error.h"
#include "fa_rules.h"

/*
 * The forward problem after validation. Strides are in elements. In the dense form every
 * sequence has max_sq queries and max_sk keys; in the varlen form the batch stride is unused
 * and rows are token indices offset by cu_seqlens.
 */
typedef struct fa_params {
    fa_dtype dtype;
    int is_varlen;
    int64_t b, h, hk, d, dv;
    int64_t max_sq, max_sk;
    int64_t total_q; /* rows of q: b * max_sq (dense) or q->shape[0] (varlen) */
    int64_t total_k; /* rows of k: b * max_sk (dense) or k->shape[0] (varlen) */

    /* q: [b, sq, h, d] or [total_q, h, d] */
    const void *q;
    int64_t q_bstride, q_rstride, q_hstride;
    /* k: [b, sk, hk, d] or [total_k, hk, d] */
    const void *k;
    int64_t k_bstride, k_rstride, k_hstride;
    /* v: [b, sk, hk, dv] or [total_k, hk, dv] */
    const void *v;
    int64_t v_bstride, v_rstride, v_hstride;
    /* out: [b, sq, h, dv] or [total_q, h, dv] */
    void *out;
    int64_t o_bstride, o_rstride, o_hstride;
    /* lse (optional): fp32 (or fp64 with fp64 inputs) [b, h, sq] or [h, total_q] */
    void *lse;
    fa_dtype lse_dtype;
    int64_t lse_bstride, lse_hstride, lse_rstride;

    const int32_t *cu_seqlens_q; /* [b+1] */
    const int32_t *cu_seqlens_k; /* [b+1] */
    const int32_t *seqused_k;    /* [b] */

    const float *alibi_slopes; /* [h] or [b, h] */
    int64_t alibi_bstride;     /* 0 for [h] */
    int64_t alibi_hstride;
    const float *sinks; /* [h] */
    int64_t sinks_stride;

    /* probs (optional): [b, h, probs_sq, probs_sk] */
    void *probs;
    int64_t p_bstride, p_hstride, p_rstride;
    int64_t probs_sq, probs_sk;
    int probs_block_n;

    double scale;
    double softcap; /* 0: off */
    int causal;
    int window_left;  /* -1 unbounded, after folding causal in */
    int window_right; /* -1 unbounded */

    double dropout_p;
    uint32_t keep_threshold; /* keep iff the 16-bit number < keep_threshold */
    double dropout_scale;    /* 1 / (1 - p) */
    uint64_t seed, offset;

    int num_threads; /* 0: the backend's default */

    /* Backward only. dout: as out; dq: as q; dk: as k; dv: as v (strides in elements). */
    const void *dout_data;
    int64_t do_bstride, do_rstride, do_hstride;
    void *dq_data;
    int64_t dq_bstride, dq_rstride, dq_hstride;
    void *dk_data;
    int64_t dk_bstride, dk_rstride, dk_hstride;
    void *dv_data;
    int64_t dv_bstride, dv_rstride, dv_hstride;
    float *dsinks; /* [h] */
    int64_t dsinks_stride;
} fa_params;

static inline void fa_params_lse_store(const fa_params *p, int64_t at, double value)
{
    if (p->lse_dtype == FA_DTYPE_F64)
        ((double *)p->lse)[at] = value;
    else
        ((float *)p->lse)[at] = (float)value;
}

static inline double fa_params_lse_load(const fa_params *p, int64_t at)
{
    return p->lse_dtype == FA_DTYPE_F64 ? ((const double *)p->lse)[at]
                                        : (double)((const float *)p->lse)[at];
}

/* Validates args (naming the argument in the error) and fills p. */
fa_status fa_params_from_fwd_args(const fa_fwd_args *args, fa_params *p);

/* Validates the forward's arguments (lse required) and the gradient tensors. */
fa_status fa_params_from_bwd_args(const fa_bwd_args *args, fa_params *p);

/* The rows and keys of sequence i. */
typedef struct fa_seq {
    int64_t q_start, k_start; /* first row of q / k */
    int64_t sq, sk;           /* queries, and keys in use */
} fa_seq;

static inline fa_seq fa_params_seq(const fa_params *p, int64_t i)
{
    fa_seq s;
    if (p->is_varlen) {
        s.q_start = p->cu_seqlens_q[i];
        s.k_start = p->cu_seqlens_k[i];
        s.sq = p->cu_seqlens_q[i + 1] - p->cu_seqlens_q[i];
        s.sk = p->seqused_k ? p->seqused_k[i] : p->cu_seqlens_k[i + 1] - p->cu_seqlens_k[i];
    } else {
        s.q_start = 0;
        s.k_start = 0;
        s.sq = p->max_sq;
        s.sk = p->max_sk;
    }
    return s;
}

/* The visible keys [*lo, *hi) of query row i in a sequence of sq queries and sk keys. */
static inline void fa_params_key_range(const fa_params *p, int64_t i, int64_t sq, int64_t sk,
                                       int64_t *lo, int64_t *hi)
{
    FA_RULE_KEY_RANGE(i, sq, sk, p->window_left, p->window_right, *lo, *hi);
}

/* The keys [*lo, *hi) that any of the rows [r0, r0+m) sees. */
static inline void fa_params_tile_keys(const fa_params *p, int64_t r0, int64_t m, int64_t sq,
                                       int64_t sk, int64_t *lo, int64_t *hi)
{
    FA_RULE_TILE_KEYS(r0, m, sq, sk, p->window_left, p->window_right, *lo, *hi);
}

#endif /* FA_PARAMS_H */
