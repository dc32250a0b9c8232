/*
 * User-defined scoring programs (fa_mod in flashattn.h): the builder's node store, the finished
 * program the backends evaluate, and the check of a forward call's mods and aux tensors.
 */
#ifndef FA_MOD_INTERNAL_H
#define FA_MOD_INTERNAL_H /* not FA_MOD_H: that is the variable h */

#include "flashattn.h"
#include "core/fa_error.h"
#include "mod/fa_block_mask.h"

/* The type of a node's value. Booleans are evaluated as 0 / 1 numbers. */
enum { FA_MOD_NUM = 0, FA_MOD_BOOL = 1 };

/* Operations past the public fa_mod_op codes. */
enum {
    FA_MOD_OP_VAR = 64, /* what: an fa_mod_variable */
    FA_MOD_OP_CONST,    /* value */
    FA_MOD_OP_WHERE,    /* args: cond, a, b */
    FA_MOD_OP_AUX,      /* what: the slot; args: the n_args indices */
};

#define FA_MOD_MAX_ARGS 4

typedef struct fa_mod_node {
    int op;   /* an fa_mod_op or FA_MOD_OP_* */
    int type; /* FA_MOD_NUM or FA_MOD_BOOL */
    int n_args;
    int args[FA_MOD_MAX_ARGS]; /* node ids; in a finished program, step numbers */
    int what;
    double value;
} fa_mod_node;

struct fa_mod {
    fa_mod_node nodes[FA_MOD_MAX_NODES]; /* as built, in creation order */
    int n;
    fa_mod_kind kind; /* 0 until finished */
    /* Finished: the nodes the root reaches, operands before their users, the root last; their
     * args renumbered to steps. Step i writes its values into evaluation buffer buf[i], of
     * n_bufs (a buffer is reused once every reader of its value has run). */
    fa_mod_node steps[FA_MOD_MAX_NODES];
    int buf[FA_MOD_MAX_NODES];
    int n_steps, n_bufs;
    int aux_ndim[FA_MOD_AUX_SLOTS]; /* indices the program reads slot i with; 0: unread */
    char *text;                     /* canonical text */
    char *cuda; /* the program as a CUDA C device function (fa_mod_emit_cuda) */
};

/* Writes m's CUDA C into m->cuda (fa_mod_cuda.c): `FA_DEV float fa_score_mod(kp, score, b, h,
 * q_idx, kv_idx)` or `FA_DEV bool fa_mask_mod(...)`, headed by the canonical text. Called by
 * fa_mod_finish, so a call on the GPU only reads it. */
fa_status fa_mod_emit_cuda(fa_mod *m);

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
