/*
 * A fa_mod program's representation (flashattn.h's fa_mod): the builder's nodes and the finished
 * steps the backends evaluate or emit. Shared by the builder (fa_mod.c) and the CUDA C emitter
 * (fa_mod_cuda.c).
 */
#ifndef FA_MOD_PROGRAM_H
#define FA_MOD_PROGRAM_H

#include "flashattn.h"

/* The type of a node's value. Booleans are evaluated as 0 / 1 numbers. */
enum { FA_MOD_NUM = 0, FA_MOD_BOOL = 1 };

/* Which indices a step's value varies with (fa_mod.vary): b and h are fixed within a call's
 * tile, so a step that reads neither q_idx, kv_idx nor score is one number for the tile. */
enum { FA_MOD_VARY_Q = 1, FA_MOD_VARY_KV = 2, FA_MOD_VARY_QKV = 3 };

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
     * args renumbered to steps. */
    fa_mod_node steps[FA_MOD_MAX_NODES];
    int n_steps;
    int aux_ndim[FA_MOD_AUX_SLOTS]; /* indices the program reads slot i with; 0: unread */
    /* For evaluators that hoist what does not vary (the CPU's, cpu/fa_cpu_mod_eval.h): vary[i]
     * is step i's FA_MOD_VARY_* bits (score varies with both), slot[i] its place among the
     * steps of its vary (class): class 0, Q and KV steps each have their own slot, the QKV
     * steps share n_slots[FA_MOD_VARY_QKV] buffers (one is reused after its value's last
     * reader has run). */
    unsigned char vary[FA_MOD_MAX_NODES];
    int slot[FA_MOD_MAX_NODES];
    int n_slots[4];
    int reads_h; /* whether a step reads h (else the values are the same for every head) */
    int reads_b; /* the same for b and every sequence (the block-mask builders) */
    char *text;                     /* canonical text */
    char *cuda; /* the program as a CUDA C device function (fa_mod_emit_cuda) */
};

/* Fills vary, slot, n_slots, reads_h and reads_b of m, whose steps are set (fa_mod_layout.c). */
void fa_mod_layout(fa_mod *m);

#endif /* FA_MOD_PROGRAM_H */
