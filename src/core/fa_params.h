/*
 * The validated parameter record of every call (forward, backward, KV cache, combine): core
 * builds it once from the public arguments and every backend reads it.
 */
#ifndef FA_PARAMS_H
#define FA_PARAMS_H

#include <stdint.h>

#include "core/fa_error.h"
#include "mod/fa_mod.h"
#include "fa_rules.h"

/*
 * A call after validation. Strides are in elements. In the dense form every sequence has max_sq
 * queries and max_sk keys; in the varlen form the batch stride is unused and rows are token
 * indices offset by cu_seqlens.
 *
 * The KV cache (fa_attention_kvcache) is the call's k and v, as in FA3: k_bstride steps from
 * one cache block (or cache row) to the next, and max_sk is the positions a sequence can hold.
 * Reused rather than given kc_* fields because a cache block plays the forward's batch row: a
 * key is still at block * k_bstride + row * k_rstride + head * k_hstride. Its own fields (the
 * append, the layout, rotary, the split count) follow the forward's. The combine
 * (fa_attention_combine) fills only dtype, b, max_sq, h, dv, out, lse, sinks, num_splits,
 * num_threads and its own fields (the partials, empty_lse, log).
 */
typedef struct fa_params {
    fa_dtype dtype;     /* of q, k, v and out; the combine: of out */
    fa_dtype out_dtype; /* forward: of out, which is bf16 or fp16 when dtype is fp8 */
    int is_varlen;
    int64_t b, h, hk, d, dv;
    int64_t max_sq;  /* queries per sequence (dense, KV cache, combine); the longest (varlen) */
    int64_t max_sk;  /* keys per sequence (dense); the longest (varlen); KV cache: capacity */
    /* Forward and backward only: */
    int64_t total_q; /* rows of q: b * max_sq (dense) or q->shape[0] (varlen) */
    int64_t total_k; /* rows of k: b * max_sk (dense) or k->shape[0] (varlen); paged varlen:
                        INT32_MAX (cu_seqlens_k counts keys there, not rows) */

    /* q: [b, sq, h, d] or [total_q, h, d] */
    const void *q;
    int64_t q_bstride, q_rstride, q_hstride;
    /* k: [b, sk, hk, d] or [total_k, hk, d]; KV cache: [blocks, page_size, hk, d] (paged) or
     * [b_cache, s_cache, hk, d], which the append writes (hence not const) */
    void *k;
    int64_t k_bstride, k_rstride, k_hstride;
    /* v: [b, sk, hk, dv] or [total_k, hk, dv]; KV cache: as k, with dv */
    void *v;
    int64_t v_bstride, v_rstride, v_hstride;
    /* out: [b, sq, h, dv] or [total_q, h, dv] */
    void *out;
    int64_t o_bstride, o_rstride, o_hstride;
    /* lse (optional): fp32 (or fp64 with fp64 inputs) [b, h, sq] or [h, total_q]; the
     * combine: [b, sq, h], fp64 only with fp64 partials */
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
    uint32_t keep_threshold; /* keep iff the 8-bit number < keep_threshold (0..256) */
    double dropout_scale;    /* 1 / (1 - p) */
    uint64_t seed, offset;

    int num_threads; /* 0: the backend's default */

    /* fp8 forward and fp8 KV caches: dequantisation scales, fp32 [b, hk] (NULL: 1) */
    const float *q_descale, *k_descale, *v_descale;
    int64_t qd_bstride, qd_hstride, kd_bstride, kd_hstride, vd_bstride, vd_hstride;

    /*
     * KV cache only, but for the paging fields (paged .. bt_cols), which a paged varlen forward
     * fills too (k and v its blocks, key j of sequence i its position j). Position t of
     * sequence i is row t % page_size of block fa_kv_block(p, i, t / page_size) (fa_kvcache.h).
     * A contiguous cache is the special case of one block per sequence (page_size = max_sk =
     * s_cache), the block being the cache's batch row.
     */
    fa_dtype kv_dtype; /* of k and v (the caches): dtype, or fp8 with an fp16/bf16/fp32 q */
    int64_t s_new;     /* keys appended per sequence (0: no append) */
    /* knew: [b, s_new, hk, d]; vnew: [b, s_new, hk, dv]: written into k/v at cache_seqlens */
    const void *knew;
    int64_t knew_bstride, knew_rstride, knew_hstride;
    const void *vnew;
    int64_t vnew_bstride, vnew_rstride, vnew_hstride;
    int new_in_cache; /* knew or vnew shares bytes with the cache it is written into */
    int paged;
    int64_t page_size;          /* paged: rows per block; contiguous: s_cache */
    int64_t num_blocks;         /* paged: blocks in the cache; contiguous: b_cache */
    const int32_t *block_table; /* paged: [b, max_blocks] */
    int64_t bt_bstride;
    int64_t bt_cols; /* paged: max_blocks, so a sequence holds bt_cols * page_size positions */
    const int32_t *batch_idx;     /* contiguous, optional: [b] */
    const int32_t *cache_seqlens; /* [b]; NULL: every sequence fills the capacity */
    const int32_t *leftpad;       /* [b], optional */
    /* rotary (optional): cos, sin [seqlen_ro, rotary_dim / 2], dtype of q */
    const void *rot_cos, *rot_sin;
    int64_t cos_rstride, sin_rstride;
    int64_t seqlen_ro; /* rows of cos and sin */
    int64_t rotary_dim;
    int rotary_interleaved;
    int rotary_per_row; /* q row r at cache_seqlens + r (else every row at cache_seqlens) */
    /* KV cache: 0 = the backend chooses, else 1 .. FA_MAX_SPLITS; combine: the partials */
    int64_t num_splits;

    /*
     * Combine only. Row x of split s holds a normalised output o_s and its log-sum-exp l_s;
     * the merged row is sum_s exp(l_s - L) o_s with L = log(sum_s exp(l_s)). A partial with
     * l_s = -inf or +inf is empty and its o_s is never read.
     */
    fa_dtype accum_dtype; /* F32 or F64, for both partial tensors */
    /* oaccum: [num_splits, b, sq, h, dv]; lseaccum: [num_splits, b, sq, h] */
    const void *oaccum;
    int64_t oaccum_sstride, oaccum_bstride, oaccum_rstride, oaccum_hstride;
    const void *lseaccum;
    int64_t lseaccum_sstride, lseaccum_bstride, lseaccum_rstride, lseaccum_hstride;
    double empty_lse; /* lse of a row with nothing to merge: -inf (FA3), +inf (the forward) */
    struct fa_cpu_log *log; /* optional: the calling decode's FLASHATTN_LOG record */

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
    /* backward: d loss / d mod_aux[slot], fp32 of mod_aux[slot]'s shape; data NULL: none */
    fa_tensor mod_aux_grad[FA_MOD_AUX_SLOTS];

    fa_mod_call mods; /* forward: user-defined scoring (mod/fa_mod.h) */
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

/* softmax_scale (NaN: the default for p->d), softcap (<= 0: off), causal and the window, checked
 * and stored in p's scale, softcap, causal (folded into window_right) and window fields. */
fa_status fa_options_check(double softmax_scale, double softcap, int causal, int window_left,
                           int window_right, fa_params *p);

/* One fp8 dequantisation scale t (NULL: none): fp32 [b, hk], any strides, given only when
 * `owner` (the tensor it scales, of dtype dt) is fp8. */
fa_status fa_check_descale(const fa_tensor *t, const char *name, const char *owner, fa_dtype dt,
                           int64_t b, int64_t hk, const float **data, int64_t *bstride,
                           int64_t *hstride);

/* Validates args (naming the argument in the error) and fills p. */
fa_status fa_params_from_fwd_args(const fa_fwd_args *args, fa_params *p);

/* Validates the forward's arguments (lse required) and the gradient tensors. */
fa_status fa_params_from_bwd_args(const fa_bwd_args *args, fa_params *p);

/* The KV cache's arguments (fa_kvcache.c). Writes nothing. */
fa_status fa_params_from_kvcache_args(const fa_kvcache_args *args, fa_params *p);

/* The combine's arguments (fa_combine.c). Writes nothing. */
fa_status fa_params_from_combine_args(const fa_combine_args *args, fa_params *p);

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
        s.k_start = p->paged ? 0 : p->cu_seqlens_k[i]; /* paged: positions in its blocks */
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
