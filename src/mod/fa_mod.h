/*
 * User-defined scoring programs (fa_mod in flashattn.h): the program (fa_mod_program.h) and the
 * check of a forward call's mods and aux tensors.
 */
#ifndef FA_MOD_INTERNAL_H
#define FA_MOD_INTERNAL_H /* not FA_MOD_H: that is the variable h */

#include "flashattn.h"
#include "core/fa_error.h"
#include "mod/fa_block_mask.h"
#include "mod/fa_mod_program.h"

/* A forward call's user-defined scoring: finished programs or NULL, the aux tensors they read
 * (copies of the caller's views; unread slots zeroed), and the block mask (blocks.num.data NULL
 * without one). */
typedef struct fa_mod_call {
    const fa_mod *score_mod;
    const fa_mod *mask_mod;
    fa_tensor aux[FA_MOD_AUX_SLOTS];
    fa_mod_blocks blocks;
} fa_mod_call;

/* Whether the call has any user-defined scoring (a mod or a block mask): the rule that sends it
 * to the tiles that evaluate them. */
static inline int fa_mod_call_active(const fa_mod_call *c)
{
    return c->score_mod || c->mask_mod || c->blocks.num.data;
}

/* The name of the first of args' score_mod, mask_mod and block_mask that is given, or NULL: what
 * a path without user-defined scoring names when it refuses one. */
const char *fa_mod_args_user(const fa_fwd_args *args);

/* Checks args' score_mod, mask_mod, mod_aux (kinds, device, the aux tensors' dtypes and dims
 * against what the programs read) and block_mask (against dims) and fills call. */
fa_status fa_mod_check_call(const fa_fwd_args *args, const fa_mod_dims *dims, fa_mod_call *call);

#endif /* FA_MOD_INTERNAL_H */
