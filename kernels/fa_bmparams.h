/*
 * The block-mask builder's parameter block (kernels/fa_block_mask.cu): the forward's block for
 * the mask program's aux tensors, then the four int32 outputs and the sizes. Compiled by the
 * host (C11) and by NVRTC, like fa_kparams.h.
 */
#ifndef FA_BMPARAMS_H
#define FA_BMPARAMS_H

#include "fa_kparams.h"

typedef struct fa_bmparams {
    fa_kparams f;             /* mod_aux and its shapes and strides */
    int *num, *idx;           /* kv_num_blocks [b, h, nq], kv_indices [b, h, nq, nk] */
    int *full_num, *full_idx; /* the full ones, or NULL */
    fa_i64 num_stride[3], idx_stride[4], full_num_stride[3], full_idx_stride[4];
    int b, h;                 /* the outputs' sequences and heads */
    int rb, rh;               /* those the program tells apart (1 where it reads no b / h) */
    int sq, sk, q_block, kv_block, nq, nk;
} fa_bmparams;

#endif /* FA_BMPARAMS_H */
