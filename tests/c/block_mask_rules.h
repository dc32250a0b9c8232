/*
 * The mask programs the block-mask builder's tests use (tests/c/test_block_mask_build.c against
 * an oracle, tests/gpu/test_gpu_block_mask.c the device against the CPU): documents read from
 * an int32 aux tensor [b, len] in slot 0 (the program reads b), per-head windows from an fp32
 * aux tensor [h] in slot 1 (it reads h), and causal (it reads neither); each ANDed with causal.
 */
#ifndef BLOCK_MASK_RULES_H
#define BLOCK_MASK_RULES_H

#include <stdio.h>
#include <stdlib.h>

#include "flashattn.h"

enum { R_DOC, R_WINDOW, R_CAUSAL, R_KINDS };
static const char *const rule_names[R_KINDS] = {"documents", "head windows", "causal"};

static inline fa_mod *rule_program(int rule)
{
    fa_mod *m = fa_mod_create();
    const int q = fa_mod_var(m, FA_MOD_Q_IDX), kv = fa_mod_var(m, FA_MOD_KV_IDX);
    const int causal = fa_mod_binary(m, FA_MOD_LE, kv, q);
    int root = causal;
    if (rule == R_DOC) {
        const int b = fa_mod_var(m, FA_MOD_B);
        const int iq[2] = {b, q}, ik[2] = {b, kv};
        root = fa_mod_binary(m, FA_MOD_AND,
                             fa_mod_binary(m, FA_MOD_EQ, fa_mod_aux(m, 0, 2, iq),
                                           fa_mod_aux(m, 0, 2, ik)),
                             causal);
    } else if (rule == R_WINDOW) {
        const int ih[1] = {fa_mod_var(m, FA_MOD_H)};
        root = fa_mod_binary(m, FA_MOD_AND, causal,
                             fa_mod_binary(m, FA_MOD_LT, fa_mod_binary(m, FA_MOD_SUB, q, kv),
                                           fa_mod_aux(m, 1, 1, ih)));
    }
    if (fa_mod_finish(m, root, FA_MOD_KIND_MASK) != FA_STATUS_OK) {
        fprintf(stderr, "FATAL: %s\n", fa_last_error());
        exit(1);
    }
    return m;
}

#endif /* BLOCK_MASK_RULES_H */
