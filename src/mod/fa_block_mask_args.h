/* The check of fa_block_mask_build's arguments (fa_block_mask_args in flashattn.h). */
#ifndef FA_BLOCK_MASK_ARGS_H
#define FA_BLOCK_MASK_ARGS_H

#include "core/fa_params.h"

/* Checks a (the program, its aux tensors, the sizes, the outputs' dtypes, shapes and
 * writability) and fills what the builders read into p: mods.mask_mod and mods.aux, b, h,
 * max_sq, max_sk; the rest zero. */
fa_status fa_block_mask_args_check(const fa_block_mask_args *a, fa_params *p);

#endif /* FA_BLOCK_MASK_ARGS_H */
