/*
 * Block sparsity (fa_block_mask in flashattn.h): the check of a call's block mask, and the
 * states of the key blocks a tile's query blocks see, which the CPU forward reads to skip key
 * blocks and to decide where mask_mod is evaluated.
 */
#ifndef FA_BLOCK_MASK_H
#define FA_BLOCK_MASK_H

#include "flashattn.h"
#include "core/fa_error.h"

/* A checked fa_block_mask (fa_block_mask.c): the index tensors as views with the b and h strides
 * 0 where the caller's dims are 1; full_num.data NULL without full blocks. */
typedef struct fa_mod_blocks {
    int64_t q_block, kv_block;
    int64_t nk; /* key blocks of the call: ceil(sk / kv_block) */
    fa_tensor num, idx, full_num, full_idx;
} fa_mod_blocks;

/* A block's state for a query block (fa_mod_blocks_fill). */
enum { FA_BLOCK_SKIP = 0, FA_BLOCK_PARTIAL = 1, FA_BLOCK_FULL = 2 };

/* The call's checked shapes that a block mask is checked against. */
typedef struct fa_mod_dims {
    int is_varlen;
    int64_t b, h, sq, sk; /* dense: per sequence */
} fa_mod_dims;

/* Checks args->block_mask for a dense call of dims (fa_block_mask.c) into *blocks. */
fa_status fa_mod_blocks_check(const fa_fwd_args *args, const fa_mod_dims *dims,
                              fa_mod_blocks *blocks);

/* The states of key blocks 0 .. blocks->nk - 1 for query blocks qb0 .. qb0 + nqb - 1 of
 * sequence b, head h: states[(qb - qb0) * nk + kb], FA_BLOCK_*. */
void fa_mod_blocks_fill(const fa_mod_blocks *blocks, int64_t b, int64_t h, int64_t qb0,
                        int64_t nqb, unsigned char *states);

#endif /* FA_BLOCK_MASK_H */
