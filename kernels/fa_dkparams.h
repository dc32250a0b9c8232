/*
 * The decode kernels' parameter block (kernels/fa_decode.cu): the forward's block (the cache is
 * its k and v, capacity its max_sk) followed by the KV cache's own fields, the split partials and
 * the combine's. Compiled by the host (C11) and by NVRTC, like fa_kparams.h; every field is 8
 * bytes or packed in pairs of 4.
 */
#ifndef FA_DKPARAMS_H
#define FA_DKPARAMS_H

#include "fa_kparams.h"

typedef struct fa_dkparams {
    fa_kparams f; /* q, the caches as k and v ([blocks, page, hk, d]), out, lse, every option */
    const void *knew;         /* NULL or [b, s_new, hk, d]: appended at cache_seqlens */
    const void *vnew;         /* [b, s_new, hk, dv] */
    const int *block_table;   /* paged: [b, max_blocks] */
    const int *batch_idx;     /* contiguous, NULL or [b]: cache row of each sequence */
    const int *cache_seqlens; /* NULL or [b]: positions in the cache before the append */
    const int *leftpad;       /* NULL or [b]: first position of each sequence */
    const void *rot_cos;      /* NULL or [seqlen_ro, rotary_dim / 2], dtype of q */
    const void *rot_sin;
    float *oaccum;   /* split partials: fp32 [splits, b, sq, h, dv] (the combine's input) */
    float *lseaccum; /* fp32 [splits, b, sq, h] */
    fa_i64 knew_bstride, knew_rstride, knew_hstride;
    fa_i64 vnew_bstride, vnew_rstride, vnew_hstride;
    fa_i64 bt_bstride;
    fa_i64 cos_rstride, sin_rstride;
    fa_i64 oaccum_sstride, oaccum_bstride, oaccum_rstride, oaccum_hstride;
    fa_i64 lseaccum_sstride, lseaccum_bstride, lseaccum_rstride, lseaccum_hstride;
    fa_i64 num_blocks, page_size; /* contiguous: cache rows and their length (the capacity) */
    fa_i64 seqlen_ro;
    int s_new, splits;          /* new keys per sequence; key chunks per (tile, kv head) */
    int rotary_dim, rotary_interleaved;
    int rotary_per_row, m_blocks; /* q row r rotated at cache_seqlens + r; row tiles per kv head */
    float empty_lse;              /* the combine's lse of a row with nothing to merge */
    fa_u32 page_mul;              /* pos / page_size = (umulhi(pos, page_mul) + pos) >> page_shift */
    fa_u32 page_shift;            /* for positions below 2^31 (fa_div_magic) */
    int g;                        /* h / hk: the query heads of a kv head */
    fa_u32 g_mul, g_shift;        /* x / g and x / splits (x below 2^31) as page_mul does */
    fa_u32 splits_mul, splits_shift;
    int append_fused;             /* 1: fa_decode writes knew / vnew (no fa_kv_append launch) */
    int cluster_merge;            /* 1: the splits of a row tile are one cluster and merge there */
    /* The paged capacity check (FA_RULE_KV_FITS on cache_seqlens; kernels/fa_decode_check.cuh):
     * check_ticket 0 is off; otherwise no cache row is written where a sequence fails it, and
     * the launch given check_report (host memory, 2 words) reports the first that fails. */
    fa_u64 *check_report;
    int check_ticket, check_pad;
    const float *k_descale;       /* fp8 caches: NULL or fp32 [b, hk] (NULL: 1) */
    const float *v_descale;
    fa_i64 kd_bstride, kd_hstride, vd_bstride, vd_hstride;
} fa_dkparams;

/* fa_combine.cu's launch: a unit is FA_COMBINE_COLS columns of one row, so a row of dv columns
 * takes ceil(dv / FA_COMBINE_COLS) units; FA_COMBINE_PART_WARPS(splits) warps share a unit's
 * parts (more where parts are many, so that no thread loads many in a row), and a CTA of
 * FA_COMBINE_THREADS threads holds FA_COMBINE_UNITS_PER_CTA(splits) units. */
#define FA_COMBINE_THREADS 128
#define FA_COMBINE_COLS 128
#define FA_COMBINE_PART_WARPS(splits) ((splits) > 16 ? 4 : (splits) > 8 ? 2 : 1)
#define FA_COMBINE_UNITS_PER_CTA(splits) (FA_COMBINE_THREADS / 32 / FA_COMBINE_PART_WARPS(splits))

#endif /* FA_DKPARAMS_H */
