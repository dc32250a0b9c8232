/*
 * test_backward's pieces: the case description, the tensors of a case, and the case generator
 * (test_backward_cases.c) that feeds the runner (test_backward.c).
 */
#ifndef FA_TEST_BACKWARD_H
#define FA_TEST_BACKWARD_H

#include <stdint.h>

#include "flashattn.h"
#include "test_util.h"

typedef struct bcase {
    TU_ATTN_FIELDS
    int lse64; /* F64: an fp64 lse (else fp32) */
    int threads[3];
} bcase;

/* The tensors of one case. */
typedef struct bprob {
    int64_t tokens_q, tokens_k, max_sq, max_sk;
    tu_tensor cuq, cuk, used, q, k, v, out, lse, dout, dq, dk, dv, alibi, sinks, dsinks;
    fa_fwd_args fa;
    fa_bwd_args ba;
} bprob;


/* Builds, runs and checks one case (test_backward.c). */
void tb_run_case(const bcase *c, const char *name, tu_rng *rng);

/* The case generator (test_backward_cases.c): a small default case, the directed sweep of every
   feature and combination, and random cases. */
void tb_base_case(bcase *c, fa_dtype dt, tu_rng *r);
void tb_run_directed(tu_rng *rng);
void tb_run_random(tu_rng *rng, int n);

#endif /* FA_TEST_BACKWARD_H */
