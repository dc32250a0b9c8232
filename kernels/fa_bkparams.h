/*
 * The backward kernels' parameter block (kernels/fa_bwd_sm80.cu): the forward's block (so the
 * shared helpers of fa_common.cuh take &bp->f) followed by the gradients and the workspace.
 * Compiled by the host (C11) and by NVRTC, like fa_kparams.h; every field is 8 bytes or packed
 * in pairs of 4.
 */
#ifndef FA_BKPARAMS_H
#define FA_BKPARAMS_H

#include "fa_kparams.h"

typedef struct fa_bkparams {
    fa_kparams f;          /* q, k, v, out, lse and every option of the forward */
    const void *dout;      /* as out */
    void *dq;              /* as q */
    void *dk;              /* as k */
    void *dv;              /* as v */
    float *dsinks;         /* NULL or [h] */
    float *dq_accum;       /* workspace: fp32 [h][b][m_tiles * bm][dp], in mma C-fragment
                              order (kernels/fa_bwd_sm80.cu) */
    float *dsum;           /* workspace: fp32 [h][b][m_tiles * bm], D = rowsum(dout * out) */
    float *lse2;           /* workspace: fp32 [h][b][m_tiles * bm], lse * log2(e) */
    int *sem;              /* workspace: int32 [b][h][m_tiles], deterministic dQ order */
    int *sched;            /* workspace: int32, the sm90 persistent grid's next work item */
    fa_i64 do_bstride, do_rstride, do_hstride;
    fa_i64 dq_bstride, dq_rstride, dq_hstride;
    fa_i64 dk_bstride, dk_rstride, dk_hstride;
    fa_i64 dv_bstride, dv_rstride, dv_hstride;
    fa_i64 dsinks_stride;
    int m_tiles, n_tiles; /* query tiles of FA_BM rows, key blocks of FA_BN keys */
    int deterministic, persistent; /* persistent: the sm90 kernel's grid claims its items */
    /* The persistent grid's claim order when items differ in length (a right window edge):
     * chunks of lpt_groups (kv head, sequence) pairs, lpt_items = lpt_groups * n_tiles items
     * each, key blocks slowest within a chunk; 0: key blocks fastest throughout. */
    int lpt_groups, lpt_items;
    /* With a block mask on the sm90 kernel: each key block's view and states (the layout of
     * the item's shared copy at FA_BWD90_BM_META), bm_stride bytes apart, built by
     * fa_bwd_bm_tables (fa_bwd90_bm_table finds one). */
    unsigned char *bm_tabs;
    int bm_stride, bm_pad;
} fa_bkparams;

#endif /* FA_BKPARAMS_H */
