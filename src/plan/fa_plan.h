/*
 * The plan: the single table that turns (arch, head_dim, dtype, features) into a kernel family,
 * its tile sizes, the #defines NVRTC compiles it with, and the launch geometry. Nothing else in
 * the library knows a tile size.
 */
#ifndef FA_PLAN_H
#define FA_PLAN_H

#include <stddef.h>

#include "flashattn.h"

#define FA_PLAN_MAX_DEFINES 12

typedef struct fa_plan_key {
    int arch; /* compute capability, 10 * major + minor */
    fa_dtype dtype;
    int d, dv;         /* head dims as the caller has them */
    unsigned features; /* FA_FEATURE_* bits */
} fa_plan_key;

typedef struct fa_plan {
    const char *family; /* kernel source, e.g. "fa_fwd_sm80.cu" */
    char target[16];    /* NVRTC --gpu-architecture, e.g. "sm_90a" */
    int bm, bn, nwarps; /* query rows per CTA, keys per block, warps */
    int dp, dvp;        /* head dims padded to the kernel's granularity */
    unsigned threads;
    unsigned smem; /* dynamic shared memory per CTA, bytes */
    int num_defines;
    char defines[FA_PLAN_MAX_DEFINES][24]; /* "-DFA_BN=64", ... */
} fa_plan;

/* The forward plan for key; FA_STATUS_UNSUPPORTED (with a message) when no family fits. */
fa_status fa_plan_forward(const fa_plan_key *key, fa_plan *plan);

#endif /* FA_PLAN_H */
