/* The backward's plans (see fa_plan.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/fa_error.h"
#include "core/fa_fp8.h"
#include "core/fa_params.h"
#include "plan/fa_plan.h"
#include "plan/fa_plan_rules.h"
#include "fa_smem.h"

/*
 * Backward (kernels/fa_bwd_sm80.cu), one row per largest padded head dim: warps per CTA (each
 * warp owns 16 keys of the key block, so the block is 16 x warps keys) and shared-memory stages
 * of the query tile (2: the next tile's Q and dO load during this one). Query tiles are
 * FA_BWD_BM rows here but for head dim 256 on the 99 KB parts (the sm90 family's are larger at
 * small head dims): the workspace size is asked for without a device, so fa_cuda_backward.c
 * sizes it for the largest of the layouts.
 */

int fa_plan_ctas_per_sm(unsigned smem, int sm_bytes) { return sm_bytes / ((int)smem + 1024); }

typedef struct fa_bwd_row {
    int dmax, nwarps, qstages;
    int split; /* FA_DKV_SPLIT: warps sharing each 16 keys, each with a part of dK/dV's columns */
    int bm;    /* query rows per tile */
} fa_bwd_row;

/* sm80, sm87, sm90, sm100 (>= 163 KB of shared memory per block): 128-key blocks with 8 warps
 * (FA2's hdim-128 choice on these parts), two query stages; d 128 takes 155 KB. The first
 * increment's configuration, should this one need to be backed out, is {128, 4, 1, 1, 64}.
 * Wider heads: 64 x 64 tiles with 8 warps, two per 16 keys (FA2's d 256 tile); two query stages
 * where they fit (217 KB at d 256 on sm_90), one on sm_80 (151 KB at d 256). */
static const fa_bwd_row fa_bwd_rows_big[] = {{128, 8, 2, 1, FA_BWD_BM},
                                             {256, 8, 2, 2, FA_BWD_BM}};

/* The 99 KB parts (sm86, sm89, sm120): d <= 64 as above (91 KB); up to 128 the 64-key block
 * with 4 warps and one stage (78 KB); wider heads a 32-key block of 4 warps, two per 16 keys,
 * one stage: 64-query tiles up to 192 (85 KB), 32-query ones at 256 (71 KB; with 64 queries a
 * 16-key block of 2 warps fit, but spilled registers). */
static const fa_bwd_row fa_bwd_rows_small[] = {{64, 8, 2, 1, FA_BWD_BM},
                                               {128, 4, 1, 1, FA_BWD_BM},
                                               {192, 4, 1, 2, FA_BWD_BM},
                                               {256, 4, 1, 2, 32}};

/* FLASHATTN_BWD_TILE=WARPS,STAGES[,BM] replaces the row's choice (for tuning with the
 * benchmark, and for the tests to run another part's tile; BM 32 only where dK/dV are split);
 * values the kernel cannot take are ignored, shared memory the device lacks is refused at
 * launch, and a workspace sized for another query tile by fa_attention_backward_workspace_size
 * is refused as too small. */
static fa_bwd_row fa_plan_bwd_override(fa_bwd_row row)
{
    const char *env = getenv("FLASHATTN_BWD_TILE");
    int nwarps, qstages, bm = row.bm;
    if (!env || sscanf(env, "%d,%d,%d", &nwarps, &qstages, &bm) < 2)
        return row;
    if ((nwarps != 2 && nwarps != 4 && nwarps != 8) || (qstages != 1 && qstages != 2) ||
        nwarps % row.split != 0 || (bm != FA_BWD_BM && (bm != 32 || row.split == 1)))
        return row;
    row.nwarps = nwarps;
    row.qstages = qstages;
    row.bm = bm;
    return row;
}

/* User-defined scoring: the programs run element by element on S^T beside dK and dV's
 * accumulators, which past head dim 64 then take more than a thread's 255 registers (ptxas
 * spilled at d 128 with 8 warps): there the warps pair up on each 16 keys, each holding half
 * the columns (FA_DKV_SPLIT 2, the wide heads' scheme), so the key block halves; past 192 the
 * query tile halves too (spills at d 256 with one query stage), and past 128 on the 99 KB parts
 * (spills at d 192 with 4 warps). fa_cuda_backward_workspace_size plans with the call's mods,
 * so the workspace covers the smaller tiles' layout. */
static fa_bwd_row fa_plan_bwd_mods_row(fa_bwd_row row, int dmax, int big)
{
    if (dmax > 64)
        row.split = 2;
    if (dmax > 192 || (dmax > 128 && !big))
        row.bm = 32;
    return row;
}

/* On sm_90 unless FLASHATTN_BWD_SM90=0 (the sm80 family then takes every case: for benchmarks
 * and for the tests that hold one family against the other). */
static int fa_plan_bwd_sm90_enabled(void)
{
    const char *env = getenv("FLASHATTN_BWD_SM90");
    return !env || strcmp(env, "0") != 0;
}

/* Calls with user-defined scoring take fa_bwd_sm90.cu's hooks where they can, unless
 * FLASHATTN_BWD_SM90_MODS=0 keeps them on the sm80 family (for comparison, and so the GPU test
 * covers both). */
static int fa_plan_bwd_sm90_mods_enabled(void)
{
    const char *env = getenv("FLASHATTN_BWD_SM90_MODS");
    return !(env && strcmp(env, "0") == 0);
}

/* The mods' combinations fa_bwd_sm90.cu takes: d = dv padded to 128, without dropout, softcap
 * or ALiBi (at 64 the 128-query tile's S^T and dP^T beside the programs spilled 140-290 bytes,
 * softcap and ALiBi beside them 148); a block mask on dense calls only (its CTA loads the states
 * of its one item's key block: varlen items take another path). ptxas spills around a
 * score_mod's aux gather and, with a block mask, around the tours (32-200 bytes), which still
 * ran 1.7-2.3x faster than the sm80 family's backward on the H200. */
static int fa_plan_bwd_sm90_mods_ok(const fa_plan_key *key)
{
    const unsigned beside = FA_FEATURE_DROPOUT | FA_FEATURE_SOFTCAP | FA_FEATURE_ALIBI;
    if ((key->features & FA_PLAN_BLOCK_MASK) && (key->features & FA_FEATURE_VARLEN))
        return 0;
    return key->d == key->dv && key->d > 64 && key->d <= 128 && !(key->features & beside);
}

/* The wide sm90 backward (kernels/fa_bwd_sm90_wide.cu): 64-query tiles against 128-key blocks
 * where each consumer warpgroup's dK and dV of 64 keys fit its registers without spilling
 * (padded d 128 or 192, d + dv <= 320; without dropout, whose mask spilled there): half the
 * query tiles' traffic per key of 64-key blocks. Else 64 x 64 tiles, which
 * FLASHATTN_BWD_SM90_WIDE_BN=64 asks for everywhere. Three query stages where they fit the
 * 227 KB, else two (230512 bytes at d 192 / dv 128 with 128 keys, 230472 at d = dv = 256). */
static void fa_plan_backward_sm90_wide(const fa_plan_key *key, fa_plan *plan)
{
    plan->family = "fa_bwd_sm90_wide.cu";
    plan->dp = fa_plan_pad(key->d);
    plan->dvp = fa_plan_pad(key->dv);
    plan->bm = FA_BWD_BM;
    const char *env = getenv("FLASHATTN_BWD_SM90_WIDE_BN");
    const int split_ok = plan->dp >= 128 && plan->dp <= 192 && plan->dp + plan->dvp <= 320 &&
                         !(key->features & FA_FEATURE_DROPOUT);
    plan->bn = split_ok && !(env && atoi(env) == 64) ? 128 : 64;
    plan->stages =
        FA_SMEM_BWD90W(plan->bm, plan->bn, plan->dp, plan->dvp, 3) <= FA_SMEM_SM90_MAX ? 3 : 2;
    plan->smem = (unsigned)FA_SMEM_BWD90W(plan->bm, plan->bn, plan->dp, plan->dvp, plan->stages);
    /* S^T and dP^T over a tile's 64 queries at once (FA_BWD_N64: K and V read once a tile)
     * where the kernel takes it, dense 128-key blocks without softcap, unless
     * FLASHATTN_BWD_SM90_N64=0 (for A/Bs); bf16 only, as fp16's kernel at d 192 / dv 128
     * spilled (5-9 local loads and stores). */
    const char *n64 = getenv("FLASHATTN_BWD_SM90_N64");
    if (plan->bn == 128 && key->dtype == FA_DTYPE_BF16 &&
        !(key->features & (FA_FEATURE_VARLEN | FA_FEATURE_SOFTCAP)) &&
        !(n64 && strcmp(n64, "0") == 0))
        fa_plan_define(plan, "FA_BWD_N64", 1);
}

/* What the sm90 backward compiles: dense or varlen, aligned, d and dv in 33..256; d = dv up to
 * 128 in fa_bwd_sm90.cu (padding to 64 or 128), wider heads and d != dv in fa_bwd_sm90_wide.cu
 * (padding to multiples of 64); the workspace's padded head dim and query tile are the arch-80
 * plan's but for the 128-query tile at d = dv <= 64. Never with FA_PLAN_NO_SM90 (the caller's
 * choice of the sm80 family). */
fa_status fa_plan_backward_sm90(const fa_plan_key *key, fa_plan *plan)
{
    if (key->arch != 90 || (key->dtype != FA_DTYPE_F16 && key->dtype != FA_DTYPE_BF16) ||
        key->d <= 32 || key->dv <= 32 || key->d > 256 || key->dv > 256 ||
        (key->features & (FA_FEATURE_UNALIGNED | FA_PLAN_NO_SM90)))
        return FA_STATUS_UNSUPPORTED;
    if ((key->features & FA_PLAN_MODS) && !fa_plan_bwd_sm90_mods_ok(key))
        return FA_STATUS_UNSUPPORTED;
    *plan = (fa_plan){0};
    snprintf(plan->target, sizeof plan->target, "sm_90a");
    plan->nwarps = 12;
    plan->threads = 384;
    if (key->d != key->dv || key->d > 128) {
        fa_plan_backward_sm90_wide(key, plan);
    } else {
        plan->family = "fa_bwd_sm90.cu";
        plan->dp = plan->dvp = fa_plan_pad(key->d);
        /* At head dim 64 a 64-query tile made every product m64n64 and every step short; 128
         * queries (FA3's choice there) still fit the consumers' registers. */
        plan->bm = plan->dp == 64 ? FA_BWD_BM_SM90_D64 : FA_BWD_BM;
        plan->bn = 128;
        /* A block mask's states sit behind the tiles (the launcher adds their bytes): two
         * stages leave them 32 KB. */
        plan->stages = (key->features & FA_PLAN_BLOCK_MASK) ? 2 : 3;
        /* The 8 consumer warps each add a dQ piece; 230488 bytes at either head dim, of the
         * FA_SMEM_SM90_MAX an sm_90 CTA may have. */
        plan->smem = (unsigned)FA_SMEM_BWD90(plan->bm, plan->bn, plan->dp, plan->stages, 8);
    }
    fa_plan_define_tile(plan, key);
    fa_plan_define(plan, "FA_QSTAGES", plan->stages);
    fa_plan_define_features(plan, key->features, FA_PLAN_FEATURES & ~FA_FEATURE_UNALIGNED);
    fa_plan_define_mods(plan, key); /* nothing for calls without mods */
    return FA_STATUS_OK;
}

fa_status fa_plan_backward(const fa_plan_key *key, fa_plan *plan)
{
    if (key->dtype != FA_DTYPE_F16 && key->dtype != FA_DTYPE_BF16)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "q: the CUDA backward computes fp16 and bf16, got %s",
                            fa_dtype_name(key->dtype));
    FA_TRY(fa_plan_check_arch(key->arch));
    if (key->d < 1 || key->d > FA_BWD_MAX_HEAD_DIM || key->dv < 1 ||
        key->dv > FA_BWD_MAX_HEAD_DIM)
        return fa_error_set(FA_STATUS_UNSUPPORTED, "head_dim: %d / %d outside [1, %d]", key->d,
                            key->dv, FA_BWD_MAX_HEAD_DIM);
    /* User-defined scoring: fa_bwd_sm90.cu's hooks where they compile (fa_plan_bwd_sm90_mods_ok)
     * unless FLASHATTN_BWD_SM90_MODS=0, the sm80 family otherwise. */
    const int mods = (key->features & FA_PLAN_MODS) != 0;
    if ((!mods || fa_plan_bwd_sm90_mods_enabled()) && fa_plan_bwd_sm90_enabled() &&
        fa_plan_backward_sm90(key, plan) == FA_STATUS_OK)
        return FA_STATUS_OK;
    *plan = (fa_plan){0};
    plan->family = "fa_bwd_sm80.cu";
    snprintf(plan->target, sizeof plan->target, key->arch == 90 ? "sm_90a" : "sm_%d", key->arch);
    plan->dp = fa_plan_pad(key->d);
    plan->dvp = fa_plan_pad(key->dv);
    const int big = fa_plan_sm_smem(key->arch) >= 164 * 1024;
    const fa_bwd_row *rows = big ? fa_bwd_rows_big : fa_bwd_rows_small;
    const size_t nrows = big ? sizeof fa_bwd_rows_big / sizeof fa_bwd_rows_big[0]
                             : sizeof fa_bwd_rows_small / sizeof fa_bwd_rows_small[0];
    const int dmax = plan->dp > plan->dvp ? plan->dp : plan->dvp;
    size_t ri = 0;
    while (ri + 1 < nrows && dmax > rows[ri].dmax)
        ri++;
    fa_bwd_row row = rows[ri];
    if (mods)
        row = fa_plan_bwd_mods_row(row, dmax, big);
    const unsigned lens = (key->features & FA_FEATURE_VARLEN) ? FA_SMEM_BWD80_LENS : 0;
    /* One query stage where two do not fit the part's shared memory. */
    if (row.qstages == 2 &&
        fa_plan_ctas_per_sm((unsigned)FA_SMEM_BWD80(row.bm, 16 * row.nwarps / row.split,
                                                    plan->dp, plan->dvp, 2, row.split) +
                                lens,
                            fa_plan_sm_smem(key->arch)) < 1)
        row.qstages = 1;
    row = fa_plan_bwd_override(row);
    plan->bm = row.bm;
    plan->nwarps = row.nwarps;
    plan->bn = 16 * row.nwarps / row.split;
    plan->threads = (unsigned)(32 * row.nwarps);
    plan->smem = (unsigned)FA_SMEM_BWD80(plan->bm, plan->bn, plan->dp, plan->dvp, row.qstages,
                                         row.split) +
                 lens;
    fa_plan_define_tile(plan, key);
    fa_plan_define(plan, "FA_NWARPS", plan->nwarps);
    fa_plan_define(plan, "FA_QSTAGES", row.qstages);
    /* Only split kernels carry the define, so the others keep their JIT keys and code. */
    if (row.split > 1)
        fa_plan_define(plan, "FA_DKV_SPLIT", row.split);
    fa_plan_define_features(plan, key->features, FA_PLAN_FEATURES);
    fa_plan_define_mods(plan, key);
    return FA_STATUS_OK;
}
