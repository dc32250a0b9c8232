/*
 * The forward kernels' parameter block, passed by value to every entry point of a forward module.
 * The same file is compiled by the host (C11) and by NVRTC (CUDA C), so the two sides cannot
 * disagree on the layout: every field is 8 bytes or packed in pairs of 4.
 */
#ifndef FA_KPARAMS_H
#define FA_KPARAMS_H

#if defined(__CUDACC__)
typedef long long fa_i64;
typedef unsigned long long fa_u64;
typedef unsigned int fa_u32;
#else
#include <stdint.h>
typedef int64_t fa_i64;
typedef uint64_t fa_u64;
typedef uint32_t fa_u32;
#endif

typedef struct fa_kparams {
    const void *q;              /* [b, sq, h, d] or [total_q, h, d] */
    const void *k;              /* [b, sk, hk, d] or [total_k, hk, d] */
    const void *v;              /* [b, sk, hk, dv] or [total_k, hk, dv] */
    void *out;                  /* [b, sq, h, dv] or [total_q, h, dv] */
    float *lse;                 /* NULL or [b, h, sq] / [h, total_q] */
    const int *cu_seqlens_q;    /* varlen: [b+1] */
    const int *cu_seqlens_k;    /* varlen: [b+1] */
    const int *seqused_k;       /* NULL or [b] */
    const float *alibi_slopes;  /* NULL or [h] / [b, h] */
    const float *sinks;         /* NULL or [h] */
    void *probs;                /* NULL or [b, h, probs_sq, probs_sk] */

    fa_i64 q_bstride, q_rstride, q_hstride;
    fa_i64 k_bstride, k_rstride, k_hstride;
    fa_i64 v_bstride, v_rstride, v_hstride;
    fa_i64 o_bstride, o_rstride, o_hstride;
    fa_i64 lse_bstride, lse_hstride, lse_rstride;
    fa_i64 alibi_bstride, alibi_hstride, sinks_stride;
    fa_i64 p_bstride, p_hstride, p_rstride;
    fa_i64 probs_sq, probs_sk;
    fa_i64 total_q, total_k; /* rows of q and of k (varlen bounds checks) */
    fa_i64 max_sq, max_sk;

    fa_u64 seed, offset; /* dropout */

    int b, h;
    int hk, d;
    int dv, window_left; /* window: -1 unbounded, causal already folded in */
    int window_right, probs_block_n;
    fa_u32 keep_threshold; /* keep iff the 8-bit number < keep_threshold (0..256) */
    float dropout_scale;   /* 1 / (1 - p) */
    float scale;           /* softmax scale */
    float scale_log2;      /* scale * log2(e), or softcap * log2(e) with softcap */
    float softcap_pre;     /* scale / softcap (softcap only) */
    float softcap;

    /* Paged varlen forward (kernels built with FA_PAGED): k and v are blocks [num_blocks,
     * page_size, hk, d] (k_bstride, v_bstride step a block) and key j of sequence i is row
     * j % page_size of block block_table[i, j / page_size] (fa_page_row, fa_common.cuh). */
    const int *block_table; /* [b, max_blocks] */
    fa_i64 bt_bstride;
    fa_i64 page_size;
    fa_i64 page_keys;  /* max_blocks * page_size: a sequence's keys are clamped to it */
    fa_u32 page_mul;   /* j / page_size = (umulhi(j, page_mul) + j) >> page_shift */
    fa_u32 page_shift; /* for j below 2^31 (fa_div_magic) */
    int last_block;    /* num_blocks - 1 (at most INT_MAX): block ids are clamped into the cache */
    int zero; /* 0: an operand ptxas cannot fold (fa_after) */

    /* User-defined scoring (kernels built with FA_SCORE_MOD, FA_MASK_MOD or FA_BLOCK_MASK):
     * the aux tensors the generated fa_score_mod / fa_mask_mod read (fa_mod_aux), int32 or
     * fp32 as the plan's FA_MOD_AUX_I32 says; slots a program does not read are NULL. */
    const void *mod_aux[4];
    fa_i64 mod_aux_shape[4][4];
    fa_i64 mod_aux_stride[4][4];
    /* Block mask (FlexAttention's layout; dense calls): for sequence b, head h and query block
     * qb of bm_q_block rows, bm_num[b, h, qb] partial key blocks of bm_kv_block keys listed in
     * bm_idx[b, h, qb, .] and bm_full_num[b, h, qb] full ones in bm_full_idx (bm_full_num NULL
     * without them). Strides are elements, 0 for a shared b or h; counts are clamped into
     * [0, bm_n] / [0, bm_full_n], indices outside [0, bm_nk) ignored. */
    int bm_q_block;
    const int *bm_num, *bm_idx, *bm_full_num, *bm_full_idx;
    fa_i64 bm_num_stride[3], bm_idx_stride[4], bm_full_num_stride[3], bm_full_idx_stride[4];
    int bm_kv_block, bm_nk; /* key blocks of the call: ceil(sk / bm_kv_block) */
    int bm_n, bm_full_n;    /* the index tensors' last dims */
    /* The backward's gradients of the fp32 aux tensors (kernels built with FA_MOD_AUX_GRAD):
     * of mod_aux's shapes, strides in elements; zeroed by fa_bwd_aux_zero, then added into. */
    float *mod_aux_grad[4];
    fa_i64 mod_aux_grad_stride[4][4];
} fa_kparams;

/* Whether every block-mask index tensor is shared across heads (h stride 0). */
#define FA_BM_HEADS_SHARED(kp)                                                                   \
    (((kp)->bm_num_stride[1] | (kp)->bm_idx_stride[1] | (kp)->bm_full_num_stride[1] |            \
      (kp)->bm_full_idx_stride[1]) == 0)

/* The block-mask state tables a backward CTA over a GQA group of g query heads holds
 * (fa_bwd_sm80.cu; the launcher sizes its shared memory by the same rule): one when the index
 * tensors are shared across heads, else one per head. */
#define FA_BM_TABLE_HEADS(kp, g) (FA_BM_HEADS_SHARED(kp) ? 1 : (g))

/* The sm90 backward's work-item tables (fa_bwd_bm_tables): one per key block of each kv head
 * and sequence, or of each sequence when the index tensors are shared across heads. */
#define FA_BM_TABLE_KV_HEADS(kp) (FA_BM_HEADS_SHARED(kp) ? 1 : (kp)->hk)

#if !defined(__CUDACC__)
/* The multiplier and shift of the division by d (1 <= d <= 2^30) for dividends below 2^31 (the
 * round-up method: shift = ceil(log2 d), mul = floor(2^32 (2^shift - d) / d) + 1), which the
 * kernels apply with fa_div_by (fa_common.cuh). */
static inline void fa_div_magic(fa_i64 d, fa_u32 *mul, fa_u32 *shift)
{
    fa_u32 s = 0;
    while (((fa_i64)1 << s) < d)
        s++;
    *shift = s;
    *mul = (fa_u32)((((fa_u64)1 << 32) * (fa_u64)(((fa_i64)1 << s) - d)) / (fa_u64)d + 1);
}
#endif

#endif /* FA_KPARAMS_H */
