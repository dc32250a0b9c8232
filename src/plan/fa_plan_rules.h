/* What the plan files share (fa_plan.c, fa_plan_backward.c, fa_plan_decode.c): the checks,
 * the head-dim padding, the defines and the feature bits the families compile. Internal to
 * src/plan; the plan's types come from fa_plan.h, which the files include first. */
#ifndef FA_PLAN_RULES_H
#define FA_PLAN_RULES_H

#include "core/fa_error.h"

struct fa_plan;
struct fa_plan_key;

/* The features the sm80 families compile as 0/1 defines (fa_plan_define_features). */
#define FA_PLAN_FEATURES                                                                        \
    (FA_FEATURE_UNALIGNED | FA_FEATURE_VARLEN | FA_FEATURE_ALIBI | FA_FEATURE_SOFTCAP |          \
     FA_FEATURE_DROPOUT)

/* User-defined scoring's plan bits. */
#define FA_PLAN_MODS (FA_PLAN_SCORE_MOD | FA_PLAN_MASK_MOD | FA_PLAN_BLOCK_MASK)

/* Compute capability 8.0 or later. */
fa_status fa_plan_check_arch(int arch);

/* fp16 or bf16, sm_80 or later, head dims in [1, FA_CUDA_MAX_HEAD_DIM]: every forward family;
 * the decode's, in [1, FA_CUDA_DECODE_MAX_HEAD_DIM]. */
fa_status fa_plan_check_forward_key(const struct fa_plan_key *key);
fa_status fa_plan_check_decode_key(const struct fa_plan_key *key);

/* 32, or a multiple of 64: the granularities of the kernels' shared-memory swizzle. */
int fa_plan_pad(int d);

/* "-DNAME=value" appended to the plan's defines. */
void fa_plan_define(struct fa_plan *plan, const char *name, int value);

/* FA_BF16, FA_DP, FA_DVP, FA_BM, FA_BN from the key and the plan's tile. */
void fa_plan_define_tile(struct fa_plan *plan, const struct fa_plan_key *key);

/* The 0/1 defines of the features a family compiles (`compiled`, FA_FEATURE_* bits). */
void fa_plan_define_features(struct fa_plan *plan, unsigned features, unsigned compiled);

/* User-defined scoring's defines, only where the call has it. */
void fa_plan_define_mods(struct fa_plan *plan, const struct fa_plan_key *key);

/* Shared memory per SM of the arch's parts, bytes. */
int fa_plan_sm_smem(int arch);

#endif /* FA_PLAN_RULES_H */
