/*
 * The KV-cache attention and the combine after validation: what core (fa_kvcache.c,
 * fa_combine.c) hands to a backend (fa_cpu_decode.c, fa_cpu_combine.c). Strides are in
 * elements. Kept apart from fa_params because the forward's backends never need any of it.
 */
#ifndef FA_KVCACHE_H
#define FA_KVCACHE_H

#include <stdint.h>

#include "core/fa_error.h"
#include "fa_rules.h"

typedef struct fa_kv_params {
    fa_dtype dtype;
    int64_t b, sq, h, hk, d, dv;
    int64_t s_new; /* keys appended per sequence (0: no append) */

    /*
     * Cache addressing. Position t of sequence i is row t % page_size of block
     * fa_kv_block(p, i, t / page_size). A contiguous cache is the special case of one block
     * per sequence (page_size = s_cache), the block being the cache's batch row.
     */
    int paged;
    int64_t page_size;  /* paged: rows per block; contiguous: s_cache */
    int64_t num_blocks; /* paged: blocks in the cache; contiguous: b_cache */
    int64_t capacity;   /* positions a sequence can hold */
    const int32_t *block_table; /* paged: [b, max_blocks] */
    int64_t bt_bstride;
    const int32_t *batch_idx; /* contiguous, optional: [b] */

    /* k_cache: [blocks, page_size, hk, d]; v_cache: [blocks, page_size, hk, dv] */
    void *k_cache;
    int64_t kc_bstride, kc_rstride, kc_hstride;
    void *v_cache;
    int64_t vc_bstride, vc_rstride, vc_hstride;
    /* k_new: [b, s_new, hk, d]; v_new: [b, s_new, hk, dv] */
    const void *k_new;
    int64_t kn_bstride, kn_rstride, kn_hstride;
    const void *v_new;
    int64_t vn_bstride, vn_rstride, vn_hstride;

    const int32_t *cache_seqlens; /* [b]; NULL: every sequence fills the capacity */
    const int32_t *leftpad;       /* [b], optional */

    /* q: [b, sq, h, d] */
    const void *q;
    int64_t q_bstride, q_rstride, q_hstride;
    /* out: [b, sq, h, dv] */
    void *out;
    int64_t o_bstride, o_rstride, o_hstride;
    /* lse (optional): fp32 (or fp64 with fp64 inputs) [b, h, sq] */
    void *lse;
    fa_dtype lse_dtype;
    int64_t lse_bstride, lse_hstride, lse_rstride;

    /* rotary (optional): cos, sin [seqlen_ro, rotary_dim / 2], dtype of q */
    const void *rot_cos, *rot_sin;
    int64_t cos_rstride, sin_rstride;
    int64_t rotary_dim;
    int rotary_interleaved;
    int rotary_per_row; /* q row r at cache_seqlens + r (else every row at cache_seqlens) */

    const float *alibi_slopes; /* [h] or [b, h] */
    int64_t alibi_bstride, alibi_hstride;
    const float *sinks; /* [h] */
    int64_t sinks_stride;

    double scale;
    double softcap;   /* 0: off */
    int window_left;  /* -1 unbounded; causal already folded into window_right */
    int window_right; /* -1 unbounded */

    int num_splits; /* 0: the backend chooses; else 1 .. FA_MAX_SPLITS */
    int num_threads; /* 0: the backend's default */
} fa_kv_params;

/* Validates args (naming the argument in the error) and fills p. Writes nothing. */
fa_status fa_kv_params_from_args(const fa_kvcache_args *args, fa_kv_params *p);

/* First cache position sequence i attends to. */
static inline int64_t fa_kv_seq_start(const fa_kv_params *p, int64_t i)
{
    return p->leftpad ? p->leftpad[i] : 0;
}

/* One past the last cache position of sequence i, the new keys included. */
static inline int64_t fa_kv_seq_end(const fa_kv_params *p, int64_t i)
{
    return p->cache_seqlens ? (int64_t)p->cache_seqlens[i] + p->s_new : p->capacity;
}

/* Element offsets of kv head kh's key and value rows at row `row` of cache block blk. */
static inline int64_t fa_kv_k_at(const fa_kv_params *p, int64_t blk, int64_t row, int64_t kh)
{
    return blk * p->kc_bstride + row * p->kc_rstride + kh * p->kc_hstride;
}

static inline int64_t fa_kv_v_at(const fa_kv_params *p, int64_t blk, int64_t row, int64_t kh)
{
    return blk * p->vc_bstride + row * p->vc_rstride + kh * p->vc_hstride;
}

/* The block (paged) or cache row (contiguous) holding page `page` of sequence i. */
static inline int64_t fa_kv_block(const fa_kv_params *p, int64_t i, int64_t page)
{
    if (p->paged)
        return p->block_table[i * p->bt_bstride + page];
    return p->batch_idx ? p->batch_idx[i] : i;
}

/* The visible keys [*lo, *hi) of query row r among sq queries and n keys (as the forward). */
static inline void fa_kv_key_range(const fa_kv_params *p, int64_t r, int64_t sq, int64_t n,
                                   int64_t *lo, int64_t *hi)
{
    FA_RULE_KEY_RANGE(r, sq, n, p->window_left, p->window_right, *lo, *hi);
}

/*
 * Merging partial results: row x of split s holds a normalised output o_s and its
 * log-sum-exp l_s; the merged row is sum_s exp(l_s - L) o_s with L = log(sum_s exp(l_s)).
 * A partial with l_s = -inf or +inf is empty and its o_s is never read.
 */
typedef struct fa_combine_params {
    int64_t splits, b, sq, h, dv;
    fa_dtype part_dtype; /* F32 or F64, for both partial tensors */
    /* o_part: [splits, b, sq, h, dv]; lse_part: [splits, b, sq, h] */
    const void *o_part;
    int64_t op_sstride, op_bstride, op_rstride, op_hstride;
    const void *lse_part;
    int64_t lp_sstride, lp_bstride, lp_rstride, lp_hstride;
    /* out: [b, sq, h, dv] */
    fa_dtype out_dtype;
    void *out;
    int64_t o_bstride, o_rstride, o_hstride;
    /* lse (optional): fp32 or fp64, indexed (batch, row, head) */
    void *lse;
    fa_dtype lse_dtype;
    int64_t lse_bstride, lse_rstride, lse_hstride;
    const float *sinks; /* optional [h]: one more term exp(sink) in every row's sum */
    int64_t sinks_stride;
    double empty_lse; /* lse of a row with nothing to merge: -inf (FA3), +inf (the forward) */
    int num_threads; /* 0: the backend's default */
    struct fa_cpu_log *log; /* optional: the calling decode's FLASHATTN_LOG record */
} fa_combine_params;

/* Validates args (naming the argument in the error) and fills c. Writes nothing. */
fa_status fa_combine_params_from_args(const fa_combine_args *args, fa_combine_params *c);

#endif /* FA_KVCACHE_H */
