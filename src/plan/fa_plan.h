/*
 * The plan: the single table that turns (arch, head_dim, dtype, features) into a kernel family,
 * its tile sizes, the #defines NVRTC compiles it with, and the launch geometry. Nothing else in
 * the library knows a tile size.
 */
#ifndef FA_PLAN_H
#define FA_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "flashattn.h"

#define FA_PLAN_MAX_DEFINES 20 /* the sm90 forward with every feature and mod: 19 */
/* Long calls (FA_PLAN_LONG): this many query rows, or FA_PLAN_LONG_ROWS_UNMASKED where every
 * row sees every key (dense, no causal or window, no block mask), whose equal tiles leave no SM
 * idle at the end under the head dim 64 row's 192-row tiles, or FA_PLAN_LONG_ROWS_CAUSAL for
 * dense causal calls (below it the 192-row tiles' masked keys cost more than they gain). */
#define FA_PLAN_LONG_ROWS 8192
#define FA_PLAN_LONG_ROWS_UNMASKED 2048
#define FA_PLAN_LONG_ROWS_CAUSAL 4096
/* The sm90 family pairs causal tiles on persistent CTAs up to this many query tiles per
 * (sequence, head); above it one CTA per tile balances better. Block-masked calls and windows
 * bounded on the left pair at any count (src/cuda/fa_cuda_forward.c). */
#define FA_SM90_PAIRED_MAX_TILES 64

/* Plan-internal feature bits, above the public FA_FEATURE_* ones. */
#define FA_PLAN_PROBS (1u << 24)   /* the probs output is asked for */
#define FA_PLAN_LONG (1u << 25)    /* a long call (FA_PLAN_LONG_ROWS, max_seqlen_q) */
#define FA_PLAN_NO_SM90 (1u << 26) /* sm80 family: tensors TMA cannot describe */
#define FA_PLAN_PAGED (1u << 27)   /* k and v are paged through a block table */
#define FA_PLAN_KV_E4M3 (1u << 28) /* decode: the caches are fp8 e4m3 (q fp16 or bf16) */
#define FA_PLAN_KV_E5M2 (1u << 29) /* decode: the caches are fp8 e5m2 */
#define FA_PLAN_OUT_F16 (1u << 30) /* fp8 forward: out is fp16 (bf16 otherwise) */
#define FA_PLAN_FP8_VT (1u << 20)  /* fp8 forward, dense: V^T comes from the workspace */
#define FA_PLAN_V_IN_K (1u << 19)  /* decode: v's rows are the first dv columns of k's (MLA) */
/* User-defined scoring (forward): the call has a score_mod, a mask_mod, a block mask. On sm_90
 * the sm90 family compiles them where it can (dense calls for a block mask; not with
 * FLASHATTN_SM90_MODS=0), the sm80 family elsewhere; the plan's score_mod / mask_mod then carry
 * the programs' generated CUDA C. */
#define FA_PLAN_SCORE_MOD (1u << 21)
#define FA_PLAN_MASK_MOD (1u << 22)
#define FA_PLAN_BLOCK_MASK (1u << 23)

typedef struct fa_plan_key {
    int arch; /* compute capability, 10 * major + minor */
    fa_dtype dtype;
    int d, dv;         /* head dims as the caller has them */
    unsigned features; /* FA_FEATURE_* bits */
    /* With a score_mod or mask_mod: bit i set where aux tensor i is int32 (else fp32),
     * FA_PLAN_AUX_OFF32 where every aux element's offset fits an int (fa_mod.cuh), and in the
     * backward FA_PLAN_AUX_GRAD(i) where aux tensor i is given a gradient. */
    unsigned mod_aux;
    /* With a block mask (FA_PLAN_BLOCK_MASK): its blocks' query rows and keys. */
    int bm_q_block, bm_kv_block;
} fa_plan_key;

#define FA_PLAN_AUX_OFF32 (1u << 4)
#define FA_PLAN_AUX_GRAD(slot) (1u << (5 + (slot)))
#define FA_PLAN_AUX_GRADS(mod_aux) (((mod_aux) >> 5) & 15u) /* the slots' bits */

typedef struct fa_plan {
    const char *family; /* kernel source, e.g. "fa_fwd_sm80.cu" */
    char target[16];    /* NVRTC --gpu-architecture, e.g. "sm_90a" */
    int bm, bn, nwarps; /* query rows per CTA, keys per block, warps */
    int dp, dvp;        /* head dims padded to the kernel's granularity */
    unsigned threads;
    unsigned smem; /* dynamic shared memory per CTA, bytes */
    int stages;    /* sm90 family: K/V shared-memory stages (0 for sm80) */
    int cluster_max; /* decode: most splits merged inside a thread block cluster (0: none; above
                        8 the kernel is loaded with non-portable cluster sizes allowed) */
    int dv_slices;   /* decode: v's columns cut into slices of dvp, a CTA each (0 or 1: none) */
    int persistent; /* sm90 family: 0 one CTA per tile; 1 one per SM striding over the tiles of
                       calls without causal/window/varlen/block mask; 2 also over causal,
                       windowed and block-masked calls' mirrored tile pairs (causal: up to
                       FA_SM90_PAIRED_MAX_TILES);
                       3 (an override) over the pairs at any tile count */
    int num_defines;
    char defines[FA_PLAN_MAX_DEFINES][24]; /* "-DFA_BN=64", ... */
    /* The call's mods as CUDA C (fa_mod_emit_cuda), NULL without: set by the launcher after
     * planning, compiled in as the header fa_mod_gen.cuh and part of the JIT's keys. */
    const char *score_mod, *mask_mod;
} fa_plan;

/* The forward plan for key; FA_STATUS_UNSUPPORTED (with a message) when no family fits.
 * On sm_90 devices the sm90 family (fa_fwd_sm90.cu) takes the cases it supports (unless
 * FLASHATTN_SM90=0); every other case gets the sm80 family, paged k and v (FA_PLAN_PAGED)
 * among them for now: the sm90 family reads K and V through TMA maps of a dense layout; so do
 * the calls with user-defined scoring (FA_PLAN_SCORE_MOD, _MASK_MOD, _BLOCK_MASK) that the sm90
 * family's hooks cannot take, or all of them with FLASHATTN_SM90_MODS=0 (fa_plan_forward_sm90
 * says which it takes). */
fa_status fa_plan_forward(const fa_plan_key *key, fa_plan *plan);

/* The sm90 family's plan for key, whatever FLASHATTN_SM90 says (precompile, tests); returns
 * FA_STATUS_UNSUPPORTED, without setting an error, when the family cannot do the case. */
fa_status fa_plan_forward_sm90(const fa_plan_key *key, fa_plan *plan);

/* The sm90 fp8 forward's plan for key (fa_fwd_sm90_fp8.cu), whatever FLASHATTN_SM90_FP8 says
 * (precompile, tests); FA_STATUS_UNSUPPORTED with a message naming the argument when it cannot
 * do the case. fa_plan_forward takes it for fp8 keys unless FLASHATTN_SM90_FP8=0. */
fa_status fa_plan_forward_sm90_fp8(const fa_plan_key *key, fa_plan *plan);

/*
 * Whether a dense fp8 forward of head dim d on sm_90 has V transposed into the workspace ahead of
 * its kernel (FA_PLAN_FP8_VT) instead of by the producer's warps in shared memory. The copy
 * reads and writes V once against a kernel faster by the transpose's share (larger at d 256
 * than at d 128), so it pays where many query rows read each key. rows: max_seqlen_q * h / hk,
 * halved when causal.
 * FLASHATTN_SM90_FP8_VT=0 never, =1 always (tests, the A/B).
 */
#define FA_PLAN_FP8_VT_ROWS 2048 /* at d <= 128; half that at d 256 */
int fa_plan_fp8_vt(int d, int64_t rows);

/* Nonzero when the plan routes supported cases to the sm90 family (not FLASHATTN_SM90=0). */
int fa_plan_sm90_enabled(void);

/* The backward's query rows per tile (kernels/fa_bwd_sm80.cu; keys per CTA come from the plan;
 * 32 at head dim 256 on the 99 KB parts); the sm90 family takes FA_BWD_BM_SM90_D64 at head dims
 * up to 64. The workspace size (fa_attention_backward_workspace_size) depends on them. */
#define FA_BWD_BM 64
#define FA_BWD_BM_SM90_D64 128
#define FA_BWD_MAX_HEAD_DIM FA_CUDA_MAX_HEAD_DIM

/* The backward plan for key (fa_bwd_sm80.cu, sm_80 and later, fp16/bf16, d and dv up to
 * FA_BWD_MAX_HEAD_DIM, dense and varlen layouts); FA_STATUS_UNSUPPORTED with a message for
 * anything else. */
fa_status fa_plan_backward(const fa_plan_key *key, fa_plan *plan);

/* The sm90 backward's plan for key (fa_bwd_sm90.cu), whatever FLASHATTN_BWD_SM90 says
 * (precompile, tests); FA_STATUS_UNSUPPORTED, without setting an error, when the family cannot
 * do the case. fa_plan_backward takes it on sm_90 unless FLASHATTN_BWD_SM90=0. */
fa_status fa_plan_backward_sm90(const fa_plan_key *key, fa_plan *plan);

/* A persistent sm90 backward's work under a right window edge, for its claim order: sequences
 * of sq queries and sk keys (the dense maxima), the window, bm-row query tiles, n_tiles key
 * blocks of bn keys, pairs (kv head, sequence) of `group` query heads each, head dims d and dv,
 * and the CTAs (one per multiprocessor). No padding (fa_plan_bwd_order.c compares by memcmp). */
typedef struct fa_lpt_shape {
    int64_t sq, sk, n_tiles, pairs;
    int window_left, window_right, bm, bn, group, d, dv, sms;
} fa_lpt_shape;

/* The (kv head, sequence) pairs per chunk of the longest-first claim order (fa_plan_bwd_order.c):
 * as many as keep their Q and dO within 16 MiB of L2 (up to 8), or fewer where a simulation of
 * the claims finishes the grid over 1% sooner. */
int fa_plan_backward_lpt_groups(const fa_lpt_shape *s);
/* The simulated grid's length for chunks of `groups` pairs, in query tiles' time (an item's
 * tour and a tile for its start and end), or -1 past the simulation's limits. */
int64_t fa_plan_backward_lpt_makespan(const fa_lpt_shape *s, int groups);

/*
 * Decoding (kernels/fa_decode.cu): few query rows against a KV cache, read in place, with the g
 * query heads of a kv head packed as the rows of one tile. rows is the packed rows of a kv head
 * (query rows times g): it sets how the CTA's four warps split the rows and the keys.
 * FA_STATUS_UNSUPPORTED with a message when the family cannot take the case.
 */
fa_status fa_plan_decode(const fa_plan_key *key, int64_t rows, fa_plan *plan);

/* Whether the forward of p takes the decode schedule (both backends, dense and varlen): at most
 * FA_DECODE_MAX_ROWS query rows, no dropout, no probs output and no user-defined scoring (those
 * exist on the tiled path only). */
struct fa_params;
int fa_plan_few_rows(const struct fa_params *p);
/* Whether a CUDA forward of p takes the decode schedule: few rows as above, or head dims past
 * FA_CUDA_MAX_HEAD_DIM at any row count, on the same conditions. */
int fa_plan_cuda_decodes(const struct fa_params *p);

/* CTAs of `smem` bytes of shared memory an SM of sm_bytes holds (it keeps 1 KB per CTA). */
int fa_plan_ctas_per_sm(unsigned smem, int sm_bytes);

/* The decode's row tiles per kv head, for plan and rows packed rows. */
int64_t fa_plan_decode_row_tiles(const fa_plan *plan, int64_t rows);

/* The split count of a decode: `tiles` row tiles of (sequence, kv head) pairs over at most
 * max_keys keys each, on a device that runs `slots` CTAs of the plan at once. */
int fa_plan_decode_splits(const fa_plan *plan, int64_t tiles, int64_t max_keys, int slots);

/* The merge of split partials (kernels/fa_combine.cu) into an output of key->dtype (fp16, bf16
 * or fp32). */
fa_status fa_plan_combine(const fa_plan_key *key, fa_plan *plan);

/* The block-mask builder (kernels/fa_block_mask.cu) for a mask program with key's mods bits
 * (FA_PLAN_MASK_MOD, mod_aux); the caller puts the program's CUDA C in plan->mask_mod. */
fa_status fa_plan_block_mask(const fa_plan_key *key, fa_plan *plan);

#endif /* FA_PLAN_H */
