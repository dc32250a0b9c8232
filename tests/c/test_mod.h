/*
 * test_mod's shared pieces (test_mod.c: errors, text and main; test_mod_forward.c: forward runs
 * against the oracle).
 */
#ifndef TEST_MOD_H
#define TEST_MOD_H

#include "flashattn.h"
#include "test_util.h"

/* Node constructors on the fa_mod *m in scope. */
#define V(x) fa_mod_var(m, FA_MOD_##x)
#define C(x) fa_mod_const(m, (x))
#define B(op, x, y) fa_mod_binary(m, FA_MOD_##op, (x), (y))
#define U(op, x) fa_mod_unary(m, FA_MOD_##op, (x))

/* Forward runs with mods of every kind, dtype and form against the oracle. */
void tm_test_forward(tu_rng *r);
/* The captured tensors' gradients (fa_bwd_args.mod_aux_grad) against an oracle; refusals. */
void tm_test_aux_grad(tu_rng *r);

#endif /* TEST_MOD_H */
