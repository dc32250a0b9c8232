/*
 * test_forward's pieces: the case description, and the case generator (test_forward_cases.c)
 * that feeds the runner (test_forward.c).
 */
#ifndef FA_TEST_FORWARD_H
#define FA_TEST_FORWARD_H

#include <stdint.h>

#include "flashattn.h"
#include "test_util.h"

typedef struct fcase {
    TU_ATTN_FIELDS
    int with_lse, with_probs;
    int threads_a, threads_b;
    int64_t row_step;
    int expect_splits; /* the decode schedule's split count the log must name (0: any) */
} fcase;

/* Builds, runs and checks one case (test_forward.c). */
void tf_run_case(const fcase *c, const char *name, tu_rng *rng);

/* The case generator (test_forward_cases.c): the directed sweep of every feature and
 * combination, and random cases. */
void tf_run_directed(tu_rng *rng);
void tf_run_random(tu_rng *rng, int n);

#endif /* FA_TEST_FORWARD_H */
