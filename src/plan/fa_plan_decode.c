/* The decode's, the combine's and the block-mask builder's plans (see fa_plan.h). */
#include <stdint.h>
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
 * Decode (kernels/fa_decode.cu): four warps, split over the rows as far as the packed rows fill
 * them and over each key block otherwise; 64-key blocks, as many stages (2 to 4; to 8 for fp8
 * caches, whose stages are half the bytes) as fit about 64 KB, so three CTAs share an SM up to
 * head dim 128 (at head dim 128, two stages in three CTAs read faster than three in two); paged
 * caches, whose row lookups want the deeper pipeline, about 96 KB (two CTAs per SM). Wider
 * heads, whose two stages pass 96 KB and so run one CTA per SM anyway, take as many stages as
 * fit about 200 KB on the 227 KB parts (sm_90, sm_100): with two, a lone CTA keeps too few
 * bytes in flight to reach the bandwidth.
 * fp8 caches, whose blocks the warps convert as they read them: 128-key blocks where a warp
 * has a single row tile (the per-block work besides the conversion, halved per key), in
 * stages of about 64 KB at most (two at head dim 128, which measured ahead of three).
 */
#define FA_DECODE_BN 64
#define FA_DECODE_STAGE_BUDGET (64 * 1024)
#define FA_DECODE_PAIR_BUDGET (96 * 1024) /* two stages past this: a CTA takes an SM alone */
#define FA_DECODE_PAGED_BUDGET (96 * 1024)
#define FA_DECODE_FP8_BUDGET (64 * 1024)
#define FA_DECODE_ALONE_BUDGET (200 * 1024)
#define FA_DECODE_MAX_AUTO_SPLITS 128
#define FA_DECODE_MAX_CLUSTER 16 /* Hopper's largest (non-portable) thread block cluster */
#define FA_DECODE_BASE_REGS 104   /* registers a thread needs besides its O accumulators */
#define FA_DECODE_SLICE 256       /* v's columns a CTA takes at most (fa_plan_decode_wide) */
#define FA_DECODE_WIDE_BN 32

static int fa_plan_decode_wm(int64_t rows) { return rows <= 16 ? 1 : rows <= 32 ? 2 : 4; }



/* FLASHATTN_DECODE_TILE=BN,STAGES,WM,WARPS replaces the plan's choice (for tuning with the
 * benchmark); a combination the kernel cannot take is ignored. */
static void fa_plan_decode_override(fa_plan *plan, int *wm, int paged)
{
    const char *env = getenv("FLASHATTN_DECODE_TILE");
    int bn, stages, w, nw;
    if (!env || sscanf(env, "%d,%d,%d,%d", &bn, &stages, &w, &nw) != 4)
        return;
    if ((nw != 2 && nw != 4 && nw != 8) || w < 1 || nw % w != 0 || stages < 2 || stages > 8 ||
        bn < 16 || bn > 256 || bn % (16 * (nw / w)) != 0 || (paged && bn > 32 * nw))
        return;
    plan->bn = bn;
    plan->stages = stages;
    plan->nwarps = nw;
    *wm = w;
}

/* The tile of heads up to FA_CUDA_MAX_HEAD_DIM (the rule in this file's first comment). */
static void fa_plan_decode_narrow(const fa_plan_key *key, int wm, int paged, int kvb,
                                  fa_plan *plan)
{
    plan->bn = kvb == 1 && wm == 1 && plan->dp + plan->dvp <= 256 ? 2 * FA_DECODE_BN
                                                                   : FA_DECODE_BN;
    plan->nwarps = 4;
    const int stage = kvb * plan->bn * (plan->dp + plan->dvp), most = 8 / kvb;
    const int budget = kvb == 1 ? FA_DECODE_FP8_BUDGET
                       : paged  ? FA_DECODE_PAGED_BUDGET
                                : FA_DECODE_STAGE_BUDGET;
    const int alone = 2 * stage > (kvb == 1 ? FA_DECODE_FP8_BUDGET : FA_DECODE_PAIR_BUDGET) &&
                      fa_plan_sm_smem(key->arch) >= 228 * 1024;
    plan->stages = (alone ? FA_DECODE_ALONE_BUDGET : budget) / stage;
    plan->stages = plan->stages < 2 ? 2 : plan->stages > most ? most : plan->stages;
    /* A paged plan's row offsets must not cost it the second CTA per SM that the dense plan
     * has: where they would, it takes one stage fewer. */
    const int bm = 16 * wm, sm_bytes = fa_plan_sm_smem(key->arch);
    if (paged && plan->stages > 2 &&
        fa_plan_ctas_per_sm(FA_SMEM_DECODE(bm, plan->bn, plan->dp, plan->dvp, plan->stages,
                                           plan->nwarps, 0, kvb, 0), sm_bytes) >= 2 &&
        fa_plan_ctas_per_sm(FA_SMEM_DECODE(bm, plan->bn, plan->dp, plan->dvp, plan->stages,
                                           plan->nwarps, 1, kvb, 0), sm_bytes) < 2)
        plan->stages--;
}

/*
 * Heads past FA_CUDA_MAX_HEAD_DIM (MLA's d 576 / dv 512): v's columns in slices of
 * FA_DECODE_SLICE, a CTA each (FA_DV_SLICES; each computes the whole S, so that its O fits a
 * thread's registers), 32-key blocks (16 where two stages of 32 would not fit beside the Q
 * tile), as many stages as fit, one CTA per SM; two warps over each block's keys where the rows
 * fill one warp, a warp per 16 rows otherwise. Where v's rows are k's first columns (vin, MLA's
 * cache) the stages hold K alone and V is read from it.
 */
static void fa_plan_decode_wide(const fa_plan_key *key, int wm, int paged, int vin,
                                fa_plan *plan)
{
    /* a CTA may take all but 1 KB of the SM's shared memory */
    const int bm = 16 * wm, sm_bytes = fa_plan_sm_smem(key->arch) - 1024;
    plan->bn = FA_DECODE_WIDE_BN;
    plan->nwarps = wm > 2 ? wm : 2;
    for (;;) {
        plan->stages = 8;
        while (plan->stages > 2 &&
               FA_SMEM_DECODE(bm, plan->bn, plan->dp, plan->dvp, plan->stages, plan->nwarps,
                              paged, 2, vin) > sm_bytes)
            plan->stages--;
        if (plan->bn == 16 || FA_SMEM_DECODE(bm, plan->bn, plan->dp, plan->dvp, plan->stages,
                                             plan->nwarps, paged, 2, vin) <= sm_bytes)
            return;
        plan->bn = 16;
        plan->nwarps = wm;
    }
}

/*
 * MLA's decode on wgmma (kernels/fa_decode_wg.cu), sm_90: d 512 or 576 (padded), v k's column
 * prefix of 257 .. 512 columns (FA_PLAN_V_IN_K), q's dtype in the cache; 64-row tiles, 64-key
 * blocks, two warpgroups (S once per block, O's columns halved between them), as many stages
 * as fit (two at d 576). It computes S once where the sliced plan computes it per 256-column
 * slice, and was no slower (within noise) at any batch and context measured;
 * FLASHATTN_DECODE_WG=0 takes the sliced plan. Returns 0 (plan untouched) where it does not
 * apply.
 */
static int fa_plan_decode_wg(const fa_plan_key *key, int kvb, int paged, fa_plan *plan)
{
    const char *env = getenv("FLASHATTN_DECODE_WG");
    const int dp = fa_plan_pad(key->d), dvp = fa_plan_pad(key->dv);
    if ((env && strcmp(env, "0") == 0) || key->arch != 90 || kvb != 2 ||
        !(key->features & FA_PLAN_V_IN_K) || (dp != 512 && dp != 576) || dvp <= 256 ||
        dvp > 512 || dvp > dp)
        return 0;
    plan->family = "fa_decode_wg.cu";
    plan->dp = dp;
    plan->dvp = dvp;
    plan->dv_slices = 1;
    plan->bm = 64;
    plan->bn = 64;
    plan->nwarps = 8;
    plan->threads = 256;
    const int sm_bytes = fa_plan_sm_smem(key->arch) - 1024;
    plan->stages = 2;
    while (plan->stages < 4 &&
           FA_SMEM_DECODE_WG(plan->bm, plan->bn, dp, plan->stages + 1, paged) <= sm_bytes)
        plan->stages++;
    plan->smem = (unsigned)FA_SMEM_DECODE_WG(plan->bm, plan->bn, dp, plan->stages, paged);
    plan->cluster_max = 0;
    fa_plan_define(plan, "FA_BF16", key->dtype == FA_DTYPE_BF16);
    fa_plan_define(plan, "FA_DP", dp);
    fa_plan_define(plan, "FA_DVP", dvp);
    fa_plan_define(plan, "FA_V_IN_K", 1);
    fa_plan_define(plan, "FA_BN", plan->bn);
    fa_plan_define(plan, "FA_STAGES", plan->stages);
    fa_plan_define(plan, "FA_PAGED", paged);
    fa_plan_define_features(plan, key->features,
                            FA_FEATURE_VARLEN | FA_FEATURE_UNALIGNED | FA_FEATURE_ALIBI |
                                FA_FEATURE_SOFTCAP);
    return 1;
}

fa_status fa_plan_decode(const fa_plan_key *key, int64_t rows, fa_plan *plan)
{
    FA_TRY(fa_plan_check_decode_key(key));
    const int kvb = (key->features & (FA_PLAN_KV_E4M3 | FA_PLAN_KV_E5M2)) ? 1 : 2;
    if (kvb == 1 && (key->d > FA_CUDA_MAX_HEAD_DIM || key->dv > FA_CUDA_MAX_HEAD_DIM))
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "k_cache: fp8 caches on a CUDA device take head dims up to %d, got "
                            "%d / %d",
                            FA_CUDA_MAX_HEAD_DIM, key->d, key->dv);
    *plan = (fa_plan){0};
    plan->family = "fa_decode.cu";
    snprintf(plan->target, sizeof plan->target, key->arch == 90 ? "sm_90a" : "sm_%d", key->arch);
    if (fa_plan_decode_wg(key, kvb, (key->features & FA_PLAN_PAGED) != 0, plan))
        return FA_STATUS_OK;
    plan->dp = fa_plan_pad(key->d);
    plan->dvp = fa_plan_pad(key->dv);
    plan->dv_slices = 1;
    if (plan->dvp > FA_DECODE_SLICE) {
        plan->dv_slices = (plan->dvp + FA_DECODE_SLICE - 1) / FA_DECODE_SLICE;
        plan->dvp = FA_DECODE_SLICE;
    }
    const int wide = plan->dp > FA_CUDA_MAX_HEAD_DIM || plan->dv_slices > 1;
    /* V from K's stage: wide heads whose every slice lies inside K's padded row */
    const int vin = wide && (key->features & FA_PLAN_V_IN_K) &&
                    plan->dv_slices * plan->dvp <= plan->dp;
    int wm = fa_plan_decode_wm(rows);
    const int paged = (key->features & FA_PLAN_PAGED) != 0;
    if (wide)
        fa_plan_decode_wide(key, wm, paged, vin, plan);
    else
        fa_plan_decode_narrow(key, wm, paged, kvb, plan);
    fa_plan_decode_override(plan, &wm, paged);
    plan->bm = 16 * wm;
    plan->threads = (unsigned)(32 * plan->nwarps);
    plan->smem = (unsigned)FA_SMEM_DECODE(plan->bm, plan->bn, plan->dp, plan->dvp, plan->stages,
                                          plan->nwarps, paged, kvb, vin);
    /* a cluster is the splits of one row tile, adjacent in x: not with v's slices between them */
    plan->cluster_max = key->arch >= 90 && plan->dv_slices == 1 ? FA_DECODE_MAX_CLUSTER : 0;
    /* The CTAs per SM that shared memory allows, told to the compiler (launch bounds) so that
     * it neither takes registers that would cost one of them nor, left to itself, spills to
     * reach an occupancy shared memory rules out; at most as many as leave a thread its O
     * accumulators (dv / 2 registers) and FA_DECODE_BASE_REGS besides. */
    const int sm_bytes = fa_plan_sm_smem(key->arch);
    int min_ctas = fa_plan_ctas_per_sm(plan->smem, sm_bytes);
    const int reg_ctas = 65536 / (int)(plan->threads * (FA_DECODE_BASE_REGS + plan->dvp / 2));
    min_ctas = min_ctas > reg_ctas ? reg_ctas : min_ctas;
    fa_plan_define(plan, "FA_BF16", key->dtype == FA_DTYPE_BF16);
    fa_plan_define(plan, "FA_DP", plan->dp);
    fa_plan_define(plan, "FA_DVP", plan->dvp);
    fa_plan_define(plan, "FA_MIN_CTAS", min_ctas < 1 ? 1 : min_ctas);
    fa_plan_define(plan, "FA_WM", wm);
    fa_plan_define(plan, "FA_WN", plan->nwarps / wm);
    fa_plan_define(plan, "FA_BN", plan->bn);
    fa_plan_define(plan, "FA_STAGES", plan->stages);
    fa_plan_define(plan, "FA_PAGED", paged);
    if (plan->dv_slices > 1) /* only then: the other kernels keep their keys */
        fa_plan_define(plan, "FA_DV_SLICES", plan->dv_slices);
    if (vin)
        fa_plan_define(plan, "FA_V_IN_K", 1);
    fa_plan_define_features(plan, key->features,
                            FA_FEATURE_VARLEN | FA_FEATURE_UNALIGNED | FA_FEATURE_ALIBI |
                                FA_FEATURE_SOFTCAP);
    /* Only fp8 caches get the define: the other kernels keep their key and their code. */
    if (key->features & (FA_PLAN_KV_E4M3 | FA_PLAN_KV_E5M2))
        fa_plan_define(plan, "FA_KV_FP8", (key->features & FA_PLAN_KV_E4M3) ? 1 : 2);
    return FA_STATUS_OK;
}

/*
 * Few query rows: a tile then holds at most FA_DECODE_MAX_ROWS rows of one head, so its products
 * are short and every head reads its kv head's K/V again. The decode schedule packs the g query
 * heads of a kv head into one tile, reading each K/V row once for all of them, and splits the
 * keys so that a few sequences still fill the threads (CPU) or the device (CUDA).
 */
/* What the decode schedule computes: no dropout, no probs, and no user-defined scoring (which
 * the forward's tiles evaluate). */
static int fa_plan_decode_takes(const fa_params *p)
{
    return p->dropout_p == 0 && p->probs == NULL && !fa_mod_call_active(&p->mods);
}

int fa_plan_few_rows(const fa_params *p)
{
    return p->max_sq <= FA_DECODE_MAX_ROWS && fa_plan_decode_takes(p);
}

/* Heads past FA_CUDA_MAX_HEAD_DIM (MLA's d 576 / dv 512) have no forward family on CUDA devices;
 * the decode schedule takes them at any row count, its tiles 64 packed rows each. */
int fa_plan_cuda_decodes(const fa_params *p)
{
    const int wide = p->d > FA_CUDA_MAX_HEAD_DIM || p->dv > FA_CUDA_MAX_HEAD_DIM;
    return fa_plan_few_rows(p) || (wide && fa_plan_decode_takes(p));
}

int64_t fa_plan_decode_row_tiles(const fa_plan *plan, int64_t rows)
{
    return (rows + plan->bm - 1) / plan->bm;
}

/* Whether s splits of `blocks` key blocks give each split fewer blocks than s - 1 splits do: a
 * count that does not leaves the longest split as long and only adds partials to merge. */
static int fa_plan_split_useful(int64_t blocks, int64_t s)
{
    return s == 1 || (blocks + s - 1) / s != (blocks + s - 2) / (s - 1);
}

int fa_plan_decode_splits(const fa_plan *plan, int64_t tiles, int64_t max_keys, int slots)
{
    /* Upstream's rule (FA2's num_splits_heuristic): a grid that fills most of the device stays
     * whole; otherwise, of the counts that shorten the longest split, the smallest whose last
     * wave is at least 85% as full as the best such count's. (The best is taken over those
     * counts only: over every count, a key range a little past `most` blocks would find no
     * useful count near it and run unsplit.) */
    const int64_t blocks = (max_keys + plan->bn - 1) / plan->bn;
    if (slots < 1 || tiles < 1 || tiles * 5 >= (int64_t)slots * 4 || blocks <= 1)
        return 1;
    int64_t most = blocks < slots ? blocks : slots;
    most = most < FA_DECODE_MAX_AUTO_SPLITS ? most : FA_DECODE_MAX_AUTO_SPLITS;
    double eff[FA_DECODE_MAX_AUTO_SPLITS + 1] = {0}, best = 0;
    for (int64_t s = 1; s <= most; s++) {
        const double waves = (double)(tiles * s) / slots;
        eff[s] = waves / ceil(waves);
        if (fa_plan_split_useful(blocks, s))
            best = eff[s] > best ? eff[s] : best;
    }
    for (int64_t s = 1; s <= most; s++)
        if (fa_plan_split_useful(blocks, s) && eff[s] >= 0.85 * best)
            return (int)s;
    return 1;
}

/* The block-mask builder (kernels/fa_block_mask.cu): 256 threads, the mods' defines. */
fa_status fa_plan_block_mask(const fa_plan_key *key, fa_plan *plan)
{
    FA_TRY(fa_plan_check_arch(key->arch));
    *plan = (fa_plan){0};
    plan->family = "fa_block_mask.cu";
    snprintf(plan->target, sizeof plan->target, key->arch == 90 ? "sm_90a" : "sm_%d", key->arch);
    plan->threads = 256;
    fa_plan_define(plan, "FA_THREADS", 256);
    fa_plan_define_mods(plan, key);
    return FA_STATUS_OK;
}

/* The combine (kernels/fa_combine.cu): a warp per 128 columns of a row, nothing to tile. */
fa_status fa_plan_combine(const fa_plan_key *key, fa_plan *plan)
{
    if (key->dtype != FA_DTYPE_F16 && key->dtype != FA_DTYPE_BF16 && key->dtype != FA_DTYPE_F32)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "out: the CUDA combine writes fp32, fp16 or bf16, got %s",
                            fa_dtype_name(key->dtype));
    FA_TRY(fa_plan_check_arch(key->arch));
    *plan = (fa_plan){0};
    plan->family = "fa_combine.cu";
    snprintf(plan->target, sizeof plan->target, key->arch == 90 ? "sm_90a" : "sm_%d", key->arch);
    plan->threads = 128;
    fa_plan_define(plan, "FA_BF16", key->dtype == FA_DTYPE_BF16);
    fa_plan_define(plan, "FA_OUT_F32", key->dtype == FA_DTYPE_F32);
    fa_plan_define(plan, "FA_MAX_SPLITS", FA_MAX_SPLITS);
    return FA_STATUS_OK;
}
