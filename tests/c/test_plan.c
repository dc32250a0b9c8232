/*
 * The plan table's choices that no GPU is needed to check (src/plan/fa_plan.c):
 *   - the sm90 forward rows: persistent 2 everywhere, three consumer warpgroups (192-row tiles)
 *     at head dim 64 for long calls only, FLASHATTN_SM90_TILE overriding and refusing;
 *   - the sm90 forward for d != dv on sm_90: every (d, dv) of [1, 256]^2, each padded to 64, the
 *     rows of d = dv unchanged, the wider head dim's row with a key block grown toward 128 while
 *     shared memory and the consumers' accumulator registers hold it (d 192 / dv 128: 128 keys),
 *     FA_DV defined exactly where dv != d;
 *   - dropout on the sm90 forward (64-key blocks at head dim 256), the sm80 family with probs;
 *   - fp8 forward: with FLASHATTN_SM90_FP8=0 refused, naming q and its dtype; without it the
 *     sm90 fp8 family on sm_90 (128-row tiles, head dims padded to 64, 128, 256, shared
 *     memory within the device's; FLASHATTN_SM90_FP8_TILE's tile where it fits), and refusals
 *     naming the argument for what it cannot do;
 *   - user-defined scoring on sm_90: the sm90 family unless FLASHATTN_SM90_MODS=0 keeps it on
 *     the sm80 family (not a varlen call's block mask, nor the combinations whose code
 *     spills, nor where the sm90 family is off or cannot run), with the mods' defines beside the
 *     plain plan's, within FA_PLAN_MAX_DEFINES, and two consumer warpgroups at head dim 64;
 *   - the backward: the sm90 family on sm_90 for the cases it compiles (never with
 *     FLASHATTN_BWD_SM90=0), and, whenever it is taken, the padded head dims of the arch-80 plan
 *     (the two families share the workspace's layout) with its query tile or, at head dim 64,
 *     FA_BWD_BM_SM90_D64 rows, which the workspace size then covers;
 *   - the backward past head dim 128 and for d != dv: the sm80 family on every arch, its
 *     dK/dV columns split over two warps per 16 keys exactly where a padded head dim passes 128
 *     (the d <= 128 plans as before), inside each part's shared memory per block (99 KB on
 *     sm86/89/120), with the arch-80 plan's padded dims and query tile but for the 99 KB parts'
 *     32-query tiles at head dim 256, which the workspace size then covers;
 *   - the defines' text, "-DNAME=value" with the plan's numbers;
 *   - a paged decode plan with as many CTAs per SM as the dense one;
 *   - the decode's split count: a count that shortens the longest split, at most the key blocks
 *     and the device's slots, and a lone tile over a few more blocks than the largest automatic
 *     count still split down to the shortest longest split;
 *   - the persistent backward's claim order under a right window edge (check_backward_lpt).
 */
#define _POSIX_C_SOURCE 200809L

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/fa_params.h"
#include "cuda/fa_cuda.h"
#include "fa_smem.h"
#include "plan/fa_plan.h"
#include "plan/fa_plan_rules.h"
#include "test_util.h"

/* The value of define `name` in plan, or -1. */
static int plan_define(const fa_plan *plan, const char *name)
{
    char prefix[32];
    snprintf(prefix, sizeof prefix, "-D%s=", name);
    for (int i = 0; i < plan->num_defines; i++)
        if (strncmp(plan->defines[i], prefix, strlen(prefix)) == 0)
            return atoi(plan->defines[i] + strlen(prefix));
    return -1;
}

static void check_forward_sm90(void)
{
    for (int d = 64; d <= 256; d += 64) {
        fa_plan_key key = {90, FA_DTYPE_BF16, d, d, FA_FEATURE_VARLEN, 0, 0, 0};
        fa_plan plan;
        TU_CHECK(fa_plan_forward_sm90(&key, &plan) == FA_STATUS_OK, "d %d: no sm90 plan", d);
        TU_CHECK(plan.persistent == 2, "d %d: persistent %d, expected 2", d, plan.persistent);
        TU_CHECK(plan_define(&plan, "FA_NCW") == 2 && plan.bm == 128,
                 "d %d short: %d consumers, bm %d", d, plan_define(&plan, "FA_NCW"), plan.bm);
        key.features |= FA_PLAN_LONG;
        TU_CHECK(fa_plan_forward_sm90(&key, &plan) == FA_STATUS_OK, "d %d long: no plan", d);
        const int ncw = d == 64 ? 3 : 2;
        TU_CHECK(plan_define(&plan, "FA_NCW") == ncw && plan.bm == 64 * ncw &&
                     plan.threads == 128u * (ncw + 1),
                 "d %d long: %d consumers, bm %d, %u threads", d, plan_define(&plan, "FA_NCW"),
                 plan.bm, plan.threads);
        /* Dropout keeps two consumers: three have no room to overlap its Philox runs. */
        key.features |= FA_FEATURE_DROPOUT;
        TU_CHECK(fa_plan_forward_sm90(&key, &plan) == FA_STATUS_OK &&
                     plan_define(&plan, "FA_NCW") == 2,
                 "d %d long dropout: %d consumers", d, plan_define(&plan, "FA_NCW"));
    }
    /* The override: taken when the kernel can, ignored otherwise. */
    fa_plan_key key = {90, FA_DTYPE_F16, 128, 128, 0, 0, 0, 0};
    fa_plan plan;
    setenv("FLASHATTN_SM90_TILE", "64,4,0,1", 1);
    TU_CHECK(fa_plan_forward_sm90(&key, &plan) == FA_STATUS_OK && plan.bn == 64 &&
                 plan.stages == 4 && plan.persistent == 1,
             "override 64,4,0,1: bn %d stages %d persistent %d", plan.bn, plan.stages,
             plan.persistent);
    setenv("FLASHATTN_SM90_TILE", "128,2,1,3", 1); /* pairs at any tile count */
    TU_CHECK(fa_plan_forward_sm90(&key, &plan) == FA_STATUS_OK && plan.persistent == 3,
             "override 128,2,1,3: persistent %d", plan.persistent);
    setenv("FLASHATTN_SM90_TILE", "128,2,1,4", 1);
    TU_CHECK(fa_plan_forward_sm90(&key, &plan) == FA_STATUS_OK && plan.persistent == 2,
             "override persistent 4 taken: %d", plan.persistent);
    setenv("FLASHATTN_SM90_TILE", "128,2,1,2,3", 1); /* 3 consumers need d 64, no pingpong */
    TU_CHECK(fa_plan_forward_sm90(&key, &plan) == FA_STATUS_OK &&
                 plan_define(&plan, "FA_NCW") == 2 && plan.bn == 128,
             "an override the kernel cannot take was not ignored");
    unsetenv("FLASHATTN_SM90_TILE");
}

/* S, P and O registers of a consumer thread: at most the d 256 row's (40 + 20 + 128), which
 * compiles without spills in the consumers' 240 registers. */
static int sm90_acc_regs(const fa_plan *plan)
{
    return plan->bn / 2 + plan->bn / 4 + plan->dvp / 2;
}

static void check_forward_sm90_dv(void)
{
    /* The rows of d = dv (their kernels keep their keys): {dp, bn, stages, pingpong}. */
    static const int rows[4][4] = {{64, 128, 4, 0}, {128, 128, 2, 1}, {192, 112, 2, 1},
                                   {256, 80, 2, 1}};
    for (int d = 1; d <= 256; d += 5)
        for (int dv = 1; dv <= 256; dv += 7) {
            const int dp = (d + 63) / 64 * 64, dvp = (dv + 63) / 64 * 64;
            const int wide = dp > dvp ? dp : dvp;
            const int *row = rows[wide / 64 - 1];
            fa_plan_key key = {90, FA_DTYPE_F16, d, dv, FA_FEATURE_ALIBI, 0, 0, 0};
            fa_plan plan;
            TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                         strcmp(plan.family, "fa_fwd_sm90.cu") == 0,
                     "d %d dv %d: family %s", d, dv, plan.family);
            TU_CHECK(plan.dp == dp && plan.dvp == dvp && plan_define(&plan, "FA_DP") == dp &&
                         plan_define(&plan, "FA_DVP") == dvp && plan_define(&plan, "FA_D") == d &&
                         plan_define(&plan, "FA_DV") == (d == dv ? -1 : dv),
                     "d %d dv %d: dp %d dvp %d FA_DV %d", d, dv, plan.dp, plan.dvp,
                     plan_define(&plan, "FA_DV"));
            const unsigned smem = (unsigned)FA_SMEM_FWD90(plan.bm, plan.bn, dp, dvp, plan.stages);
            TU_CHECK(plan.smem == smem && smem <= FA_SMEM_SM90_MAX && sm90_acc_regs(&plan) <= 188,
                     "d %d dv %d: bn %d stages %d: %u bytes, %d accumulator registers", d, dv,
                     plan.bn, plan.stages, plan.smem, sm90_acc_regs(&plan));
            /* The wider head dim's row; d != dv grows its key block toward 128 while it fits. */
            const int grown = plan.bn + 16;
            fa_plan bigger = plan;
            bigger.bn = grown;
            const int fits = grown <= 128 && sm90_acc_regs(&bigger) <= 188 &&
                             FA_SMEM_FWD90(plan.bm, grown, dp, dvp, plan.stages) <=
                                 FA_SMEM_SM90_MAX;
            TU_CHECK(plan.stages == row[2] && plan_define(&plan, "FA_PINGPONG") == row[3] &&
                         plan.bm == 128 &&
                         (dp == dvp ? plan.bn == row[1] : plan.bn >= row[1] && !fits),
                     "d %d dv %d: bn %d stages %d pingpong %d, the d %d row has bn %d", d, dv,
                     plan.bn, plan.stages, plan_define(&plan, "FA_PINGPONG"), wide, row[1]);
        }
    /* d 128 takes its pingpong off only without varlen, ALiBi, softcap and dropout. */
    for (int d = 65; d <= 128; d += 21) {
        const unsigned feats[] = {0, FA_PLAN_LONG, FA_PLAN_SCORE_MOD, FA_FEATURE_VARLEN,
                                  FA_FEATURE_SOFTCAP, FA_FEATURE_DROPOUT};
        for (int i = 0; i < 6; i++) {
            fa_plan_key k = {90, FA_DTYPE_BF16, d, d, feats[i], 0, 0, 0};
            fa_plan p;
            TU_CHECK(fa_plan_forward_sm90(&k, &p) == FA_STATUS_OK &&
                         plan_define(&p, "FA_PINGPONG") == (i >= 3),
                     "d %d features %#x: pingpong %d", d, feats[i],
                     plan_define(&p, "FA_PINGPONG"));
        }
    }
    /* DeepSeek's MLA prefill: d 192's row with 128 keys (its 112 grown; V's stage is smaller). */
    fa_plan_key key = {90, FA_DTYPE_BF16, 192, 128, FA_FEATURE_VARLEN, 0, 0, 0};
    fa_plan plan;
    TU_CHECK(fa_plan_forward_sm90(&key, &plan) == FA_STATUS_OK && plan.bn == 128 &&
                 plan.stages == 2 && plan.smem == 214104,
             "d 192 dv 128: bn %d stages %d, %u bytes", plan.bn, plan.stages, plan.smem);
    /* Three consumers for long calls only where both pad to 64. */
    const int pairs[3][3] = {{64, 40, 3}, {40, 64, 3}, {64, 128, 2}};
    for (int i = 0; i < 3; i++) {
        fa_plan_key lk = {90, FA_DTYPE_BF16, pairs[i][0], pairs[i][1], FA_PLAN_LONG, 0, 0, 0};
        TU_CHECK(fa_plan_forward_sm90(&lk, &plan) == FA_STATUS_OK &&
                     plan_define(&plan, "FA_NCW") == pairs[i][2],
                 "d %d dv %d long: %d consumers", pairs[i][0], pairs[i][1],
                 plan_define(&plan, "FA_NCW"));
    }
    /* The override counts K and V apart: 128 keys in 2 stages fit d 192 / dv 128, not dv 192. */
    setenv("FLASHATTN_SM90_TILE", "128,2,1", 1);
    TU_CHECK(fa_plan_forward_sm90(&key, &plan) == FA_STATUS_OK && plan.bn == 128,
             "override 128,2,1 at d 192 dv 128: bn %d", plan.bn);
    key.dv = 192;
    TU_CHECK(fa_plan_forward_sm90(&key, &plan) == FA_STATUS_OK && plan.bn == 112,
             "override 128,2,1 at d = dv 192 (over the shared memory) taken: bn %d", plan.bn);
    unsetenv("FLASHATTN_SM90_TILE");
    /* Off sm_90, or with FLASHATTN_SM90=0, the sm80 family. */
    key.dv = 128;
    key.arch = 80;
    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                 strcmp(plan.family, "fa_fwd_sm80.cu") == 0,
             "sm_80 d 192 dv 128: %s", plan.family);
    key.arch = 90;
    setenv("FLASHATTN_SM90", "0", 1);
    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                 strcmp(plan.family, "fa_fwd_sm80.cu") == 0,
             "FLASHATTN_SM90=0 d 192 dv 128: %s", plan.family);
    unsetenv("FLASHATTN_SM90");
}

/* Dropout on sm_90: the sm90 family with FA_DROPOUT=1 (64-key blocks at head dim 256, the
 * row's block below), the sm80 family with probs or FLASHATTN_SM90=0; no FA_DROPOUT=1 without. */
static void check_forward_sm90_dropout(void)
{
    for (int d = 32; d <= 256; d += 32) {
        fa_plan_key key = {90, FA_DTYPE_F16, d, d, FA_FEATURE_DROPOUT | FA_FEATURE_VARLEN, 0, 0, 0};
        fa_plan plan, plain;
        TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                     strcmp(plan.family, "fa_fwd_sm90.cu") == 0,
                 "d %d dropout: family %s", d, plan.family);
        TU_CHECK(plan_define(&plan, "FA_DROPOUT") == 1, "d %d: no FA_DROPOUT=1", d);
        fa_plan_key plain_key = {90, FA_DTYPE_F16, d, d, FA_FEATURE_VARLEN, 0, 0, 0};
        TU_CHECK(fa_plan_forward(&plain_key, &plain) == FA_STATUS_OK &&
                     plan_define(&plain, "FA_DROPOUT") == 0,
                 "d %d without dropout: FA_DROPOUT %d", d, plan_define(&plain, "FA_DROPOUT"));
        TU_CHECK(plan.bn == (plan.dp == 256 ? 64 : plan.dp == 192 ? 96 : plain.bn),
                 "d %d dropout: bn %d (without %d)", d, plan.bn, plain.bn);
        TU_CHECK(plan.smem == (unsigned)FA_SMEM_FWD90(plan.bm, plan.bn, plan.dp, plan.dvp,
                                                      plan.stages),
                 "d %d dropout: smem %u", d, plan.smem);
        key.features |= FA_PLAN_PROBS;
        TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                     strcmp(plan.family, "fa_fwd_sm80.cu") == 0,
                 "d %d dropout probs: family %s", d, plan.family);
    }
    /* The Philox ring (FLASHATTN_SM90_DROP_RING=1 or 2, its form): where it fits beside the
     * stages (every row's dropout tile), its bytes in the plan's shared memory; never without
     * dropout or the variable. */
    for (int i = 0; i < 8; i++) {
        const int form = 1 + i / 4, d = 64 * (1 + i % 4);
        setenv("FLASHATTN_SM90_DROP_RING", form == 1 ? "1" : "2", 1);
        const fa_plan_key key = {90, FA_DTYPE_BF16, d, d, FA_FEATURE_DROPOUT, 0, 0, 0};
        const fa_plan_key plain_key = {90, FA_DTYPE_BF16, d, d, 0, 0, 0, 0};
        fa_plan plan, plain;
        const int ok = fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                       fa_plan_forward(&plain_key, &plain) == FA_STATUS_OK;
        TU_CHECK(ok && plan_define(&plan, "FA_DROP_RING") == form &&
                     plan_define(&plain, "FA_DROP_RING") == -1 &&
                     plan.smem == (unsigned)(FA_SMEM_FWD90(plan.bm, plan.bn, plan.dp, plan.dvp,
                                                           plan.stages) +
                                             FA_SMEM_FWD90_DROP(plan.bm, plan.bn)) &&
                     plan.smem <= FA_SMEM_SM90_MAX,
                 "d %d dropout ring %d: define %d (without dropout %d), smem %u", d, form,
                 plan_define(&plan, "FA_DROP_RING"), plan_define(&plain, "FA_DROP_RING"),
                 plan.smem);
    }
    fa_plan_key key = {90, FA_DTYPE_BF16, 128, 128, FA_FEATURE_DROPOUT, 0, 0, 0};
    fa_plan plan;
    setenv("FLASHATTN_SM90_DROP_RING", "3", 1);
    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                 plan_define(&plan, "FA_DROP_RING") == -1,
             "the ring with FLASHATTN_SM90_DROP_RING=3");
    unsetenv("FLASHATTN_SM90_DROP_RING");
    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                 plan_define(&plan, "FA_DROP_RING") == -1,
             "the ring without FLASHATTN_SM90_DROP_RING");
    /* The fold: with softcap only, and not with FLASHATTN_SM90_SOFTCAP_FOLD=0. */
    for (int i = 0; i < 4; i++) {
        const unsigned f = i & 1 ? FA_FEATURE_SOFTCAP : 0;
        setenv("FLASHATTN_SM90_SOFTCAP_FOLD", i & 2 ? "1" : "0", 1);
        const fa_plan_key kf = {90, FA_DTYPE_BF16, 128, 128, f, 0, 0, 0};
        fa_plan pf;
        TU_CHECK(fa_plan_forward(&kf, &pf) == FA_STATUS_OK &&
                     plan_define(&pf, "FA_SOFTCAP_FOLD") == ((i & 1) && (i & 2) ? 1 : -1),
                 "FLASHATTN_SM90_SOFTCAP_FOLD case %d: %d", i, plan_define(&pf, "FA_SOFTCAP_FOLD"));
    }
    unsetenv("FLASHATTN_SM90_SOFTCAP_FOLD");
    {
        const fa_plan_key kf = {90, FA_DTYPE_BF16, 128, 128, FA_FEATURE_SOFTCAP, 0, 0, 0};
        fa_plan pf;
        TU_CHECK(fa_plan_forward(&kf, &pf) == FA_STATUS_OK &&
                     plan_define(&pf, "FA_SOFTCAP_FOLD") == 1,
                 "the fold by default: %d", plan_define(&pf, "FA_SOFTCAP_FOLD"));
    }
    setenv("FLASHATTN_SM90", "0", 1);
    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                 strcmp(plan.family, "fa_fwd_sm80.cu") == 0,
             "FLASHATTN_SM90=0 dropout: family %s", plan.family);
    unsetenv("FLASHATTN_SM90");
}

/* User-defined scoring on sm_90: with FLASHATTN_SM90_MODS=0 the sm80 family
 * (fa_plan_forward_sm90 refusing), and by default the sm90 family with the plain plan's defines
 * and the mods' after them (the aux reads' two where a score_mod or mask_mod is present),
 * but for a varlen call's block mask, dropout past head dim 128, a block mask at head dim 256
 * or beside softcap, ALiBi or dropout, unaligned rows, FLASHATTN_SM90=0 and other archs; two
 * consumer warpgroups in long calls at head dim 64. */
static void check_forward_sm90_mods(void)
{
    static const int dims[][2] = {{64, 64}, {128, 128}, {256, 256}, {192, 128}, {96, 96}};
    static const unsigned feats[] = {0, FA_FEATURE_VARLEN, FA_FEATURE_SOFTCAP | FA_FEATURE_ALIBI,
                                     FA_FEATURE_VARLEN | FA_FEATURE_ALIBI | FA_FEATURE_SOFTCAP |
                                         FA_FEATURE_DROPOUT};
    for (int on = 0; on < 2; on++) {
        if (on)
            unsetenv("FLASHATTN_SM90_MODS");
        else
            setenv("FLASHATTN_SM90_MODS", "0", 1);
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++)
            for (size_t fi = 0; fi < sizeof feats / sizeof feats[0]; fi++)
                for (unsigned mods = 1; mods < 8; mods++) {
                    const unsigned mbits = (mods & 1 ? FA_PLAN_SCORE_MOD : 0) |
                                           (mods & 2 ? FA_PLAN_MASK_MOD : 0) |
                                           (mods & 4 ? FA_PLAN_BLOCK_MASK : 0);
                    fa_plan_key key = {90, FA_DTYPE_BF16, dims[di][0], dims[di][1],
                                       feats[fi] | mbits, 0, 0, 0};
                    fa_plan_key plain_key = key;
                    plain_key.features = feats[fi];
                    fa_plan plan, plain, p90;
                    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                                 fa_plan_forward(&plain_key, &plain) == FA_STATUS_OK,
                             "d %d features %#x: no plan", key.d, key.features);
                    const int dmax = dims[di][0] > dims[di][1] ? dims[di][0] : dims[di][1];
                    const unsigned beside =
                        FA_FEATURE_SOFTCAP | FA_FEATURE_ALIBI | FA_FEATURE_DROPOUT;
                    const int want90 =
                        on && !((mods & 4) && (feats[fi] & FA_FEATURE_VARLEN)) &&
                        !(dmax > 128 && (feats[fi] & FA_FEATURE_DROPOUT)) &&
                        !((mods & 4) && (dmax > 192 || (feats[fi] & beside)));
                    TU_CHECK(strcmp(plan.family, want90 ? "fa_fwd_sm90.cu" : "fa_fwd_sm80.cu") ==
                                 0,
                             "FLASHATTN_SM90_MODS %d d %d features %#x: %s", on, key.d,
                             key.features, plan.family);
                    TU_CHECK((fa_plan_forward_sm90(&key, &p90) == FA_STATUS_OK) == want90,
                             "fa_plan_forward_sm90 %d d %d features %#x", on, key.d,
                             key.features);
                    TU_CHECK(plan_define(&plan, "FA_SCORE_MOD") == (mods & 1 ? 1 : -1) &&
                                 plan_define(&plan, "FA_MASK_MOD") == (mods & 2 ? 1 : -1) &&
                                 plan_define(&plan, "FA_BLOCK_MASK") == (mods & 4 ? 1 : -1),
                             "d %d features %#x: the mods' defines", key.d, key.features);
                    TU_CHECK(plan.num_defines <= FA_PLAN_MAX_DEFINES,
                             "d %d features %#x: %d defines", key.d, key.features,
                             plan.num_defines);
                    if (!want90)
                        continue;
                    /* The plain plan's tile and defines, then the mods'. */
                    int same = plan.bm == plain.bm && plan.bn == plain.bn &&
                               plan.stages == plain.stages && plan.smem == plain.smem &&
                               plan.num_defines == plain.num_defines + __builtin_popcount(mods) +
                                                       (mods & 3 ? 2 : 0) + (mods & 4 ? 1 : 0);
                    for (int i = 0; same && i < plain.num_defines; i++)
                        same = strcmp(plan.defines[i], plain.defines[i]) == 0;
                    TU_CHECK(same, "d %d features %#x: not the plain sm90 plan plus the mods",
                             key.d, key.features);
                }
        /* Long calls at head dim 64: two consumers with mods (three have too few registers). */
        fa_plan_key key = {90, FA_DTYPE_BF16, 64, 64, FA_PLAN_LONG | FA_PLAN_SCORE_MOD, 0, 0, 0};
        fa_plan plan;
        TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                     (!on || (strcmp(plan.family, "fa_fwd_sm90.cu") == 0 && plan.bm == 128 &&
                              plan_define(&plan, "FA_NCW") == 2)),
                 "long d 64 mods: %s bm %d", plan.family, plan.bm);
        /* Never the sm90 family where it cannot run or is off. */
        key = (fa_plan_key){90, FA_DTYPE_BF16, 128, 128, FA_PLAN_MASK_MOD | FA_FEATURE_UNALIGNED, 0, 0, 0};
        TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                     strcmp(plan.family, "fa_fwd_sm80.cu") == 0,
                 "unaligned mods: %s", plan.family);
        key.features = FA_PLAN_SCORE_MOD;
        key.arch = 80;
        TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                     strcmp(plan.family, "fa_fwd_sm80.cu") == 0,
                 "sm_80 mods: %s", plan.family);
        key.arch = 90;
        setenv("FLASHATTN_SM90", "0", 1);
        TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                     strcmp(plan.family, "fa_fwd_sm80.cu") == 0,
                 "FLASHATTN_SM90=0 mods: %s", plan.family);
        unsetenv("FLASHATTN_SM90");
    }
    /* The aux reads' dtypes and offset width reach the kernel as defines, beside a score_mod or
     * mask_mod only. */
    for (unsigned aux = 0; aux < 32; aux += 5) {
        fa_plan_key k2 = {90, FA_DTYPE_BF16, 128, 128, FA_PLAN_MASK_MOD, aux, 0, 0};
        fa_plan p2;
        TU_CHECK(fa_plan_forward(&k2, &p2) == FA_STATUS_OK &&
                     plan_define(&p2, "FA_MOD_AUX_I32") == (int)(aux & 15u) &&
                     plan_define(&p2, "FA_MOD_AUX_OFF32") == ((aux & FA_PLAN_AUX_OFF32) != 0),
                 "mod_aux %#x: the aux defines", aux);
        k2.features = FA_PLAN_BLOCK_MASK;
        TU_CHECK(fa_plan_forward(&k2, &p2) == FA_STATUS_OK &&
                     plan_define(&p2, "FA_MOD_AUX_I32") == -1,
                 "mod_aux %#x: aux defines without a program", aux);
    }
    /* FA_BM_ALIGNED: the block mask's blocks whole multiples of the tile's rows and keys. */
    const int blocks[][3] = {{128, 128, 1}, {256, 384, 1}, {64, 128, 0}, {128, 64, 0},
                             {128, 192, 0}, {0, 0, 0}};
    for (size_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++) {
        fa_plan_key kb = {90, FA_DTYPE_BF16, 128, 128, FA_PLAN_MASK_MOD | FA_PLAN_BLOCK_MASK, 0,
                          blocks[i][0], blocks[i][1]};
        fa_plan pb;
        TU_CHECK(fa_plan_forward(&kb, &pb) == FA_STATUS_OK && pb.bm == 128 && pb.bn == 128 &&
                     plan_define(&pb, "FA_BM_ALIGNED") == blocks[i][2],
                 "blocks %d x %d: FA_BM_ALIGNED %d", blocks[i][0], blocks[i][1],
                 plan_define(&pb, "FA_BM_ALIGNED"));
        kb.features = FA_PLAN_MASK_MOD;
        TU_CHECK(fa_plan_forward(&kb, &pb) == FA_STATUS_OK &&
                     plan_define(&pb, "FA_BM_ALIGNED") == -1,
                 "no block mask: FA_BM_ALIGNED %d", plan_define(&pb, "FA_BM_ALIGNED"));
    }
    /* FLASHATTN_SM90_MASK_FIRST=1: the define, for a score_mod beside a mask only. */
    setenv("FLASHATTN_SM90_MASK_FIRST", "1", 1);
    for (unsigned m = 1; m < 8; m++) {
        const unsigned f = (m & 1 ? FA_PLAN_SCORE_MOD : 0) | (m & 2 ? FA_PLAN_MASK_MOD : 0) |
                           (m & 4 ? FA_PLAN_BLOCK_MASK : 0);
        fa_plan_key k3 = {90, FA_DTYPE_BF16, 128, 128, f, 0, 0, 0};
        fa_plan p3;
        TU_CHECK(fa_plan_forward(&k3, &p3) == FA_STATUS_OK &&
                     plan_define(&p3, "FA_MOD_MASK_FIRST") == ((m & 1) && (m & 6) ? 1 : -1),
                 "FLASHATTN_SM90_MASK_FIRST mods %u: %d", m,
                 plan_define(&p3, "FA_MOD_MASK_FIRST"));
    }
    unsetenv("FLASHATTN_SM90_MASK_FIRST");
    /* Only "0" switches it off. */
    setenv("FLASHATTN_SM90_MODS", "1", 1);
    fa_plan_key key = {90, FA_DTYPE_BF16, 128, 128, FA_PLAN_SCORE_MOD, 0, 0, 0};
    fa_plan plan;
    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                 strcmp(plan.family, "fa_fwd_sm90.cu") == 0,
             "FLASHATTN_SM90_MODS=1: %s", plan.family);
    unsetenv("FLASHATTN_SM90_MODS");
}

/* The family fa_plan_backward picks for (arch, d, dv, features), "" when it refuses. */
static const char *bwd_family(int arch, int d, int dv, unsigned features, fa_plan *plan)
{
    fa_plan_key key = {arch, FA_DTYPE_BF16, d, dv, features, 0, 0, 0};
    return fa_plan_backward(&key, plan) == FA_STATUS_OK ? plan->family : "";
}

static void check_backward(void)
{
    const unsigned features[] = {0, FA_FEATURE_VARLEN, FA_FEATURE_DROPOUT | FA_FEATURE_ALIBI,
                                 FA_FEATURE_SOFTCAP | FA_FEATURE_VARLEN};
    fa_plan plan, ws_plan;
    for (int pass = 0; pass < 2; pass++) {
        if (!pass)
            setenv("FLASHATTN_BWD_SM90", "0", 1);
        for (size_t f = 0; f < sizeof features / sizeof features[0]; f++)
            for (int d = 1; d <= 128; d++) {
                const unsigned ft = features[f];
                const int want90 = pass && d > 32;
                const char *fam = bwd_family(90, d, d, ft, &plan);
                TU_CHECK(strcmp(fam, want90 ? "fa_bwd_sm90.cu" : "fa_bwd_sm80.cu") == 0,
                         "default %d, d %d, features %#x: %s", pass, d, ft, fam);
                /* The workspace's layout is the arch-80 plan's: the same padded dims, the same
                 * query tile but for the sm90 family's larger one at head dim 64. */
                bwd_family(80, d, d, ft, &ws_plan);
                const int bm_ok = plan.bm == ws_plan.bm ||
                                  (want90 && plan.dp == 64 && plan.bm == FA_BWD_BM_SM90_D64);
                TU_CHECK(bm_ok && plan.dp == ws_plan.dp && plan.dvp == ws_plan.dvp,
                         "d %d features %#x: %s has bm %d dp %d dvp %d, the workspace's plan "
                         "bm %d dp %d dvp %d",
                         d, ft, fam, plan.bm, plan.dp, plan.dvp, ws_plan.bm, ws_plan.dp,
                         ws_plan.dvp);
                /* Never the sm90 family for what it does not compile, or off sm_90. */
                TU_CHECK(strcmp(bwd_family(90, d, d, ft | FA_FEATURE_UNALIGNED, &plan),
                                "fa_bwd_sm80.cu") == 0 &&
                             strcmp(bwd_family(90, d, d, ft | FA_PLAN_NO_SM90, &plan),
                                    "fa_bwd_sm80.cu") == 0 &&
                             strcmp(bwd_family(90, d, d > 8 ? d - 8 : d + 8, ft, &plan),
                                    pass && d > 40 ? "fa_bwd_sm90_wide.cu"
                                                   : "fa_bwd_sm80.cu") == 0 &&
                             strcmp(bwd_family(80, d, d, ft, &plan), "fa_bwd_sm80.cu") == 0,
                         "d %d features %#x: an sm90 plan where the family cannot run", d, ft);
            }
        unsetenv("FLASHATTN_BWD_SM90");
    }
    /* The workspace size covers the larger tile: 64 queries are one 128-row tile there, whose
     * dQ accumulator alone (fp32, padded head dim) is 128 rows per (sequence, head). */
    for (int d = 33; d <= 64; d += 31) {
        fa_params p = {0};
        p.dtype = FA_DTYPE_BF16;
        p.b = 3, p.h = 5, p.hk = 5, p.d = p.dv = d, p.max_sq = p.max_sk = 64;
        const size_t size = fa_cuda_backward_workspace_size(&p);
        TU_CHECK(size >= (size_t)4 * 3 * 5 * FA_BWD_BM_SM90_D64 * 64,
                 "d %d: workspace %zu bytes, below the sm90 tile's accumulator", d, size);
    }
}

/* The backward with user-defined scoring: the sm80 family with FLASHATTN_BWD_SM90_MODS=0,
 * otherwise fa_bwd_sm90.cu (with the mods' defines; three query stages, two with a block mask, whose
 * states sit behind them) for d = dv in 65..128 without dropout, softcap or ALiBi, nor a block
 * mask on varlen calls, the sm80 family for the rest; never the sm90 family off sm_90 or with
 * FLASHATTN_BWD_SM90=0. */
static void check_backward_mods(void)
{
    const unsigned mods[] = {FA_PLAN_SCORE_MOD, FA_PLAN_MASK_MOD,
                             FA_PLAN_SCORE_MOD | FA_PLAN_MASK_MOD, FA_PLAN_BLOCK_MASK,
                             FA_PLAN_MASK_MOD | FA_PLAN_BLOCK_MASK};
    const unsigned features[] = {0, FA_FEATURE_VARLEN, FA_FEATURE_SOFTCAP | FA_FEATURE_ALIBI,
                                 FA_FEATURE_DROPOUT};
    fa_plan plan;
    for (int pass = 0; pass < 3; pass++) {
        if (pass == 0)
            setenv("FLASHATTN_BWD_SM90_MODS", "0", 1);
        if (pass == 2)
            setenv("FLASHATTN_BWD_SM90", "0", 1);
        for (size_t m = 0; m < sizeof mods / sizeof mods[0]; m++)
            for (size_t f = 0; f < sizeof features / sizeof features[0]; f++)
                for (int d = 8; d <= 256; d += 8) {
                    const unsigned ft = mods[m] | features[f];
                    const int bm_varlen = (ft & FA_PLAN_BLOCK_MASK) && (ft & FA_FEATURE_VARLEN);
                    const int want90 = pass == 1 && d > 64 && d <= 128 && !bm_varlen &&
                                       !(ft & (FA_FEATURE_DROPOUT | FA_FEATURE_SOFTCAP |
                                               FA_FEATURE_ALIBI));
                    const char *fam = bwd_family(90, d, d, ft, &plan);
                    TU_CHECK(strcmp(fam, want90 ? "fa_bwd_sm90.cu" : "fa_bwd_sm80.cu") == 0,
                             "pass %d, d %d, features %#x: %s", pass, d, ft, fam);
                    TU_CHECK(plan_define(&plan, "FA_SCORE_MOD") ==
                                     ((ft & FA_PLAN_SCORE_MOD) ? 1 : -1) &&
                                 plan_define(&plan, "FA_MASK_MOD") ==
                                     ((ft & FA_PLAN_MASK_MOD) ? 1 : -1) &&
                                 plan_define(&plan, "FA_BLOCK_MASK") ==
                                     ((ft & FA_PLAN_BLOCK_MASK) ? 1 : -1) &&
                                 (!want90 || plan_define(&plan, "FA_QSTAGES") ==
                                                 ((ft & FA_PLAN_BLOCK_MASK) ? 2 : 3)),
                             "pass %d, d %d, features %#x: the mods' defines", pass, d, ft);
                    TU_CHECK(strcmp(bwd_family(80, d, d, ft, &plan), "fa_bwd_sm80.cu") == 0 &&
                                 strcmp(bwd_family(90, d, d > 8 ? d - 8 : d + 8, ft, &plan),
                                        "fa_bwd_sm80.cu") == 0,
                             "pass %d, d %d, features %#x: an sm90 plan off its cases", pass,
                             d, ft);
                }
        unsetenv("FLASHATTN_BWD_SM90");
        unsetenv("FLASHATTN_BWD_SM90_MODS");
    }
    /* The plain plans do not change with the switch. */
    fa_plan a, b;
    bwd_family(90, 128, 128, FA_FEATURE_SOFTCAP, &a);
    setenv("FLASHATTN_BWD_SM90_MODS", "0", 1);
    bwd_family(90, 128, 128, FA_FEATURE_SOFTCAP, &b);
    unsetenv("FLASHATTN_BWD_SM90_MODS");
    int same = a.num_defines == b.num_defines && strcmp(a.family, b.family) == 0;
    for (int i = 0; same && i < a.num_defines; i++)
        same = strcmp(a.defines[i], b.defines[i]) == 0;
    TU_CHECK(same, "FLASHATTN_BWD_SM90_MODS=0 changed a plain backward plan");
}

/* Head dims past 128 and d != dv: every (d, dv) of a sample over [1, 256]^2 on each arch, in
 * the sm80 family (FLASHATTN_BWD_SM90=0 on sm_90; check_backward_sm90_wide has the other). */

/* The decode past FA_CUDA_MAX_HEAD_DIM (MLA): v's columns in FA_DV_SLICES slices of 256, the
 * stage and Q tile within the part's shared memory at 1 to 64 packed rows, dense and paged, on
 * sm_90 and sm_80; fp8 caches and heads past FA_CUDA_DECODE_MAX_HEAD_DIM refused naming the
 * argument. */
static void check_decode_wide(void)
{
    static const int dims[][2] = {{576, 512}, {576, 576}, {512, 512}, {320, 320}, {576, 64},
                                  {64, 512}};
    static const int archs[] = {90, 80};
    static const int64_t rows[] = {1, 16, 40, 128};
    fa_plan plan;
    for (size_t a = 0; a < sizeof archs / sizeof archs[0]; a++)
        for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
            for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++)
                for (unsigned paged = 0; paged <= FA_PLAN_PAGED; paged += FA_PLAN_PAGED) {
                    const fa_plan_key key = {archs[a], FA_DTYPE_BF16, dims[i][0], dims[i][1],
                                             paged, 0, 0, 0};
                    const int slices = (fa_plan_pad(dims[i][1]) + 255) / 256;
                    const int ok = fa_plan_decode(&key, rows[r], &plan) == FA_STATUS_OK;
                    TU_CHECK(ok && (slices > 1 ? plan.dv_slices == slices &&
                                                     plan_define(&plan, "FA_DV_SLICES") == slices &&
                                                     plan.dvp == 256 && plan.cluster_max == 0
                                               : plan.dv_slices <= 1 &&
                                                     plan_define(&plan, "FA_DV_SLICES") < 0) &&
                                 plan.dp == fa_plan_pad(dims[i][0]) && plan.stages >= 2 &&
                                 (plan.bn / (plan.nwarps / (plan.bm / 16))) % 16 == 0 &&
                                 (int)plan.smem <= fa_plan_sm_smem(archs[a]) - 1024,
                             "decode sm_%d d %d dv %d rows %lld paged %u: %s slices %d dvp %d "
                             "bn %d warps %d stages %d smem %u",
                             archs[a], dims[i][0], dims[i][1], (long long)rows[r], paged,
                             ok ? "ok" : fa_last_error(), plan.dv_slices, plan.dvp, plan.bn,
                             plan.nwarps, plan.stages, plan.smem);
                }
    /* V from K's stages where v is k's column prefix: MLA's (both slices inside K's row),
     * with more stages than the separate V's plan; not where a slice passes K's row (dv 576
     * over d 320) nor for narrow heads. The sliced plan: sm_90 takes wgmma's by default. */
    const fa_plan_key mla = {90, FA_DTYPE_BF16, 576, 512, 0, 0, 0, 0};
    fa_plan sep, vin;
    fa_plan_key mla_vin = mla;
    mla_vin.features |= FA_PLAN_V_IN_K;
    setenv("FLASHATTN_DECODE_WG", "0", 1);
    const int vin_ok = fa_plan_decode(&mla_vin, 64, &vin) == FA_STATUS_OK;
    unsetenv("FLASHATTN_DECODE_WG");
    TU_CHECK(fa_plan_decode(&mla, 64, &sep) == FA_STATUS_OK && vin_ok &&
                 plan_define(&vin, "FA_V_IN_K") == 1 && plan_define(&sep, "FA_V_IN_K") < 0 &&
                 vin.stages > sep.stages && (int)vin.smem <= FA_SMEM_SM90_MAX,
             "MLA V in K: define %d, stages %d against %d, smem %u", plan_define(&vin, "FA_V_IN_K"),
             vin.stages, sep.stages, vin.smem);
    const fa_plan_key past_row = {90, FA_DTYPE_BF16, 320, 576, FA_PLAN_V_IN_K, 0, 0, 0};
    const fa_plan_key narrow = {90, FA_DTYPE_BF16, 128, 128, FA_PLAN_V_IN_K, 0, 0, 0};
    TU_CHECK(fa_plan_decode(&past_row, 1, &plan) == FA_STATUS_OK &&
                 plan_define(&plan, "FA_V_IN_K") < 0 &&
                 fa_plan_decode(&narrow, 1, &plan) == FA_STATUS_OK &&
                 plan_define(&plan, "FA_V_IN_K") < 0,
             "V in K taken where a slice passes K's row or for a narrow head");
    const fa_plan_key fp8 = {90, FA_DTYPE_BF16, 576, 512, FA_PLAN_KV_E4M3, 0, 0, 0};
    TU_CHECK(fa_plan_decode(&fp8, 1, &plan) == FA_STATUS_UNSUPPORTED &&
                 strncmp(fa_last_error(), "k_cache", 7) == 0,
             "fp8 caches at d 576: \"%s\"", fa_last_error());
    const fa_plan_key past = {90, FA_DTYPE_BF16, FA_CUDA_DECODE_MAX_HEAD_DIM + 1, 512, 0, 0, 0, 0};
    TU_CHECK(fa_plan_decode(&past, 1, &plan) == FA_STATUS_UNSUPPORTED &&
                 strncmp(fa_last_error(), "head_dim", 8) == 0,
             "decode d %d: \"%s\"", FA_CUDA_DECODE_MAX_HEAD_DIM + 1, fa_last_error());
}
/* MLA's decode on wgmma (fa_decode_wg.cu) by default: on sm_90 for d 512 / 576 with v k's
 * prefix of 257 .. 512 columns, 64 x 64 tiles in two warpgroups, its shared memory within the
 * CTA's; the sliced plan everywhere else (no V in K, sm_80, fp8 caches, dv <= 256, d 320), and
 * with FLASHATTN_DECODE_WG=0. */
static void check_decode_wg(void)
{
    static const int dims[][2] = {{576, 512}, {576, 320}, {512, 512}, {520, 300}};
    fa_plan plan;
    unsetenv("FLASHATTN_DECODE_WG");
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        for (unsigned paged = 0; paged <= FA_PLAN_PAGED; paged += FA_PLAN_PAGED)
            for (int64_t rows = 1; rows <= 256; rows *= 16) {
                const fa_plan_key key = {90, FA_DTYPE_BF16, dims[i][0], dims[i][1],
                                         paged | FA_PLAN_V_IN_K, 0, 0, 0};
                const int ok = fa_plan_decode(&key, rows, &plan) == FA_STATUS_OK;
                TU_CHECK(ok && strcmp(plan.family, "fa_decode_wg.cu") == 0 && plan.bm == 64 &&
                             plan.bn == 64 && plan.threads == 256 && plan.dv_slices == 1 &&
                             plan.cluster_max == 0 && plan.stages >= 2 &&
                             plan.dvp == fa_plan_pad(dims[i][1]) &&
                             plan_define(&plan, "FA_V_IN_K") == 1 &&
                             plan_define(&plan, "FA_STAGES") == plan.stages &&
                             (int)plan.smem ==
                                 FA_SMEM_DECODE_WG(64, 64, fa_plan_pad(dims[i][0]), plan.stages,
                                                   paged != 0) &&
                             (int)plan.smem <= FA_SMEM_SM90_MAX,
                         "wg decode d %d dv %d paged %u rows %lld: %s family %s stages %d smem %u",
                         dims[i][0], dims[i][1], paged, (long long)rows,
                         ok ? "ok" : fa_last_error(), plan.family, plan.stages, plan.smem);
            }
    static const fa_plan_key others[] = {
        {90, FA_DTYPE_BF16, 576, 512, 0, 0, 0, 0},
        {80, FA_DTYPE_BF16, 576, 512, FA_PLAN_V_IN_K, 0, 0, 0},
        {90, FA_DTYPE_BF16, 576, 256, FA_PLAN_V_IN_K, 0, 0, 0},
        {90, FA_DTYPE_BF16, 320, 320, FA_PLAN_V_IN_K, 0, 0, 0},
        {90, FA_DTYPE_BF16, 128, 128, FA_PLAN_V_IN_K, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof others / sizeof others[0]; i++)
        TU_CHECK(fa_plan_decode(&others[i], 64, &plan) == FA_STATUS_OK &&
                     strcmp(plan.family, "fa_decode.cu") == 0,
                 "sm_%d d %d dv %d features %#x: %s", others[i].arch, others[i].d, others[i].dv,
                 others[i].features, plan.family);
    setenv("FLASHATTN_DECODE_WG", "0", 1);
    const fa_plan_key mla = {90, FA_DTYPE_BF16, 576, 512, FA_PLAN_V_IN_K, 0, 0, 0};
    TU_CHECK(fa_plan_decode(&mla, 64, &plan) == FA_STATUS_OK &&
                 strcmp(plan.family, "fa_decode.cu") == 0,
             "wg decode with FLASHATTN_DECODE_WG=0: %s", plan.family);
    unsetenv("FLASHATTN_DECODE_WG");
}

static void check_backward_wide(void)
{
    setenv("FLASHATTN_BWD_SM90", "0", 1);
    /* The most dynamic shared memory a CTA may have on each arch. */
    static const struct {
        int arch, smem;
    } parts[] = {{80, 163 * 1024}, {86, 99 * 1024}, {89, 99 * 1024}, {90, 227 * 1024},
                 {120, 99 * 1024}};
    static const int dims[] = {1, 8, 32, 33, 64, 96, 128, 129, 136, 160, 192, 200, 224, 256};
    const int ndims = (int)(sizeof dims / sizeof dims[0]);
    const unsigned features[] = {0, FA_FEATURE_VARLEN | FA_FEATURE_DROPOUT,
                                 FA_FEATURE_SOFTCAP | FA_FEATURE_UNALIGNED};
    for (size_t a = 0; a < sizeof parts / sizeof parts[0]; a++)
        for (int i = 0; i < ndims; i++)
            for (int j = 0; j < ndims; j++)
                for (size_t f = 0; f < sizeof features / sizeof features[0]; f++) {
                    const int arch = parts[a].arch, d = dims[i], dv = dims[j];
                    const unsigned ft = features[f];
                    fa_plan plan, ws_plan;
                    const char *fam = bwd_family(arch, d, dv, ft, &plan);
                    const int wide = d > 128 || dv > 128;
                    TU_CHECK(strcmp(fam, "fa_bwd_sm80.cu") == 0 ||
                                 (!wide && strcmp(fam, "fa_bwd_sm90.cu") == 0),
                             "arch %d d %d dv %d features %#x: family \"%s\" (%s)", arch, d,
                             dv, ft, fam, *fam ? "" : fa_last_error());
                    if (strcmp(fam, "fa_bwd_sm80.cu") != 0)
                        continue;
                    const int split = plan_define(&plan, "FA_DKV_SPLIT");
                    const int qstages = plan_define(&plan, "FA_QSTAGES");
                    TU_CHECK(split == (plan.dp > 128 || plan.dvp > 128 ? 2 : -1),
                             "arch %d d %d dv %d: dp %d dvp %d, FA_DKV_SPLIT %d", arch, d, dv,
                             plan.dp, plan.dvp, split);
                    TU_CHECK(plan.bn == 16 * plan.nwarps / (split > 0 ? split : 1) &&
                                 plan.bn == plan_define(&plan, "FA_BN") &&
                                 (qstages == 1 || qstages == 2),
                             "arch %d d %d dv %d: bn %d with %d warps, split %d, stages %d",
                             arch, d, dv, plan.bn, plan.nwarps, split, qstages);
                    const unsigned smem =
                        (unsigned)FA_SMEM_BWD80(plan.bm, plan.bn, plan.dp, plan.dvp, qstages,
                                                split) +
                        ((ft & FA_FEATURE_VARLEN) ? FA_SMEM_BWD80_LENS : 0);
                    TU_CHECK(plan.smem == smem && (int)plan.smem <= parts[a].smem,
                             "arch %d d %d dv %d: %u bytes of shared memory (layout %u), the "
                             "part gives %d",
                             arch, d, dv, plan.smem, smem, parts[a].smem);
                    /* Two stages wherever they fit (d 256 on sm_90, not on sm_80). */
                    if (wide && qstages == 1 && (arch == 80 || arch == 90))
                        TU_CHECK(FA_SMEM_BWD80(plan.bm, plan.bn, plan.dp, plan.dvp, 2, split) +
                                         ((ft & FA_FEATURE_VARLEN) ? FA_SMEM_BWD80_LENS : 0) >
                                     parts[a].smem,
                                 "arch %d d %d dv %d: one query stage where two fit", arch, d,
                                 dv);
                    bwd_family(80, d, dv, ft, &ws_plan);
                    const int small_256 = parts[a].smem < 100 * 1024 &&
                                          (plan.dp > 192 || plan.dvp > 192);
                    TU_CHECK(plan.bm == (small_256 ? 32 : ws_plan.bm) && plan.dp == ws_plan.dp &&
                                 plan.dvp == ws_plan.dvp,
                             "arch %d d %d dv %d: bm %d dp %d dvp %d, the workspace's plan bm %d "
                             "dp %d dvp %d",
                             arch, d, dv, plan.bm, plan.dp, plan.dvp, ws_plan.bm, ws_plan.dp,
                             ws_plan.dvp);
                }
    fa_plan plan;
    TU_CHECK(bwd_family(90, 256, 256, 0, &plan)[0] &&
                 plan_define(&plan, "FA_QSTAGES") == 2 &&
                 bwd_family(80, 256, 256, 0, &plan)[0] && plan_define(&plan, "FA_QSTAGES") == 1,
             "d 256: two query stages on sm_90 and one on sm_80 expected");
    /* Past FA_CUDA_MAX_HEAD_DIM (which the CPU takes): refused, naming the argument, by the
     * backward and the forward; the decode takes up to FA_CUDA_DECODE_MAX_HEAD_DIM (MLA's d 576
     * / dv 512) with v's columns in slices, and refuses past it. */
    TU_CHECK(!*bwd_family(90, 257, 128, 0, &plan) && strstr(fa_last_error(), "head_dim"),
             "d 257: \"%s\"", fa_last_error());
    const fa_plan_key wide = {90, FA_DTYPE_BF16, 576, 512, 0, 0, 0, 0};
    TU_CHECK(fa_plan_forward(&wide, &plan) == FA_STATUS_UNSUPPORTED &&
                 strncmp(fa_last_error(), "head_dim", 8) == 0,
             "forward d 576: \"%s\"", fa_last_error());
    check_decode_wide();
    check_decode_wg();
    /* The workspace covers the d 256 layout with 32-row tiles (the 99 KB parts'): b 4, h 16,
     * 128 queries, each part 256-byte aligned: the fp32 accumulator (8192 rows of 256), D and
     * lse (8192 rows each), 4 x 16 x 4 tile counters, the item counter; with 64-row tiles the
     * counters would take 512 bytes fewer. */
    fa_params p = {0};
    p.dtype = FA_DTYPE_BF16;
    p.b = 4, p.h = 16, p.hk = 16, p.d = 256, p.dv = 192, p.max_sq = p.max_sk = 128;
    const size_t size = fa_cuda_backward_workspace_size(&p);
    const size_t need = (size_t)4 * 8192 * 256 + 2 * 4 * 8192 + 4 * 4 * 16 * 4 + 256;
    TU_CHECK(size >= need, "d 256: workspace %zu bytes, the 32-row layout %zu", size, need);
    unsetenv("FLASHATTN_BWD_SM90");
}

/* sm_90's default plan over the same sample: d and dv in 33..256 with aligned rows go to the
 * sm90 families, d = dv up to 128 to fa_bwd_sm90.cu and the rest to fa_bwd_sm90_wide.cu, whose
 * layout must be the workspace's (the arch-80 plan's padded dims and query tile), on 128-key
 * blocks where the plan's rule takes them, whose shared memory must fit, with three query
 * stages wherever they fit. */
static void check_backward_sm90_wide(void)
{
    static const int dims[] = {1, 8, 32, 33, 64, 96, 128, 129, 136, 160, 192, 200, 224, 256};
    const int ndims = (int)(sizeof dims / sizeof dims[0]);
    const unsigned features[] = {0, FA_FEATURE_VARLEN | FA_FEATURE_DROPOUT,
                                 FA_FEATURE_SOFTCAP | FA_FEATURE_ALIBI,
                                 FA_FEATURE_SOFTCAP | FA_FEATURE_UNALIGNED};
    for (int i = 0; i < ndims; i++)
        for (int j = 0; j < ndims; j++)
            for (size_t f = 0; f < sizeof features / sizeof features[0]; f++) {
                const int d = dims[i], dv = dims[j];
                const unsigned ft = features[f];
                const int sm90 = d > 32 && dv > 32 && !(ft & FA_FEATURE_UNALIGNED);
                const char *want = !sm90                       ? "fa_bwd_sm80.cu"
                                   : d == dv && d <= 128 ? "fa_bwd_sm90.cu"
                                                         : "fa_bwd_sm90_wide.cu";
                fa_plan plan, ws_plan;
                const char *fam = bwd_family(90, d, dv, ft, &plan);
                TU_CHECK(strcmp(fam, want) == 0, "d %d dv %d features %#x: %s, %s expected", d,
                         dv, ft, fam, want);
                if (strcmp(fam, "fa_bwd_sm90_wide.cu") != 0)
                    continue;
                bwd_family(80, d, dv, ft, &ws_plan);
                const int qstages = plan_define(&plan, "FA_QSTAGES");
                /* 128-key blocks for calls without dropout whose padded d is 128 or 192 and
                 * d + dv at most 320 (each consumer warpgroup's dK and dV of 64 keys). */
                const int split = (plan.dp == 128 || plan.dp == 192) &&
                                  plan.dp + plan.dvp <= 320 && !(ft & FA_FEATURE_DROPOUT);
                const int bn = split ? 128 : 64;
                TU_CHECK(plan.bm == ws_plan.bm && plan.dp == ws_plan.dp &&
                             plan.dvp == ws_plan.dvp && plan.bn == bn &&
                             plan_define(&plan, "FA_BN") == bn && plan.dp % 64 == 0 &&
                             plan.dvp % 64 == 0,
                         "d %d dv %d: bm %d bn %d dp %d dvp %d, the workspace's plan bm %d dp %d "
                         "dvp %d",
                         d, dv, plan.bm, plan.bn, plan.dp, plan.dvp, ws_plan.bm, ws_plan.dp,
                         ws_plan.dvp);
                TU_CHECK(plan.smem == (unsigned)FA_SMEM_BWD90W(plan.bm, plan.bn, plan.dp,
                                                               plan.dvp, qstages) &&
                             plan.smem <= FA_SMEM_SM90_MAX &&
                             (qstages == 3 ||
                              (qstages == 2 && FA_SMEM_BWD90W(plan.bm, plan.bn, plan.dp,
                                                              plan.dvp, 3) > FA_SMEM_SM90_MAX)),
                         "d %d dv %d: %u bytes of shared memory, %d query stages", d, dv,
                         plan.smem, qstages);
            }
    /* FLASHATTN_BWD_SM90_WIDE_BN=64 keeps 64-key blocks; FLASHATTN_BWD_SM90=0 hands the wide
     * heads to the sm80 family. */
    fa_plan plan;
    setenv("FLASHATTN_BWD_SM90_WIDE_BN", "64", 1);
    TU_CHECK(strcmp(bwd_family(90, 192, 128, 0, &plan), "fa_bwd_sm90_wide.cu") == 0 &&
                 plan.bn == 64 && plan_define(&plan, "FA_BN") == 64,
             "FLASHATTN_BWD_SM90_WIDE_BN=64: d 192 / dv 128 on %d-key blocks", plan.bn);
    unsetenv("FLASHATTN_BWD_SM90_WIDE_BN");
    setenv("FLASHATTN_BWD_SM90", "0", 1);
    TU_CHECK(strcmp(bwd_family(90, 256, 128, 0, &plan), "fa_bwd_sm80.cu") == 0 &&
                 strcmp(bwd_family(90, 192, 128, 0, &plan), "fa_bwd_sm80.cu") == 0,
             "FLASHATTN_BWD_SM90=0: the wide heads still on the sm90 family");
    unsetenv("FLASHATTN_BWD_SM90");
}

/* Every define of the plans of both families reads "-DNAME=value" with the plan's own numbers
 * where it carries them (the defines are formatted by hand, without snprintf). */
static void check_defines(void)
{
    for (int arch = 80; arch <= 90; arch += 10)
        for (int d = 8; d <= 256; d += 40) {
            fa_plan_key key = {arch, FA_DTYPE_BF16, d, d, FA_FEATURE_SOFTCAP, 0, 0, 0};
            fa_plan plan;
            TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK, "arch %d d %d: no plan", arch,
                     d);
            for (int i = 0; i < plan.num_defines; i++) {
                const char *def = plan.defines[i], *eq = strchr(def, '=');
                TU_CHECK(strncmp(def, "-DFA_", 5) == 0 && eq && eq[1] &&
                             strspn(eq + 1, "0123456789") == strlen(eq + 1),
                         "arch %d d %d: define \"%s\"", arch, d, def);
            }
            TU_CHECK(plan_define(&plan, "FA_BN") == plan.bn &&
                         plan_define(&plan, "FA_DP") == plan.dp &&
                         plan_define(&plan, "FA_SOFTCAP") == 1 &&
                         plan_define(&plan, "FA_BF16") == 1,
                     "arch %d d %d: FA_BN %d (bn %d), FA_DP %d (dp %d)", arch, d,
                     plan_define(&plan, "FA_BN"), plan.bn, plan_define(&plan, "FA_DP"), plan.dp);
        }
}

/* A paged decode plan keeps the dense plan's two CTAs per SM (sm_90: 228 KB, 1 KB kept per CTA)
 * wherever the dense plan has them; up to head dim 128 and 16 packed rows the dense plan has
 * three. */
static void check_decode_paged(void)
{
    for (int d = 64; d <= 256; d += 64)
        for (int rows = 1; rows <= 64; rows *= 4) {
            fa_plan_key key = {90, FA_DTYPE_BF16, d, d, 0, 0, 0, 0}, pkey = key;
            pkey.features |= FA_PLAN_PAGED;
            fa_plan dense, paged;
            TU_CHECK(fa_plan_decode(&key, rows, &dense) == FA_STATUS_OK &&
                         fa_plan_decode(&pkey, rows, &paged) == FA_STATUS_OK,
                     "d %d rows %d: no decode plan", d, rows);
            const int two = 2 * ((int)dense.smem + 1024) <= 228 * 1024;
            TU_CHECK(!two || 2 * ((int)paged.smem + 1024) <= 228 * 1024,
                     "d %d rows %d: dense %u bytes (two per SM), paged %u (one)", d, rows,
                     dense.smem, paged.smem);
            TU_CHECK(d > 128 || rows > 16 || 3 * ((int)dense.smem + 1024) <= 228 * 1024,
                     "d %d rows %d: dense %u bytes, not three CTAs per SM", d, rows, dense.smem);
            TU_CHECK(paged.stages >= 2 && paged.stages >= dense.stages - 1,
                     "d %d rows %d: paged %d stages, dense %d", d, rows, paged.stages,
                     dense.stages);
        }
}

static void check_decode_splits(void)
{
    fa_plan_key key = {90, FA_DTYPE_BF16, 256, 256, 0, 0, 0, 0};
    fa_plan plan;
    TU_CHECK(fa_plan_decode(&key, 32, &plan) == FA_STATUS_OK, "no decode plan");
    const int64_t bn = plan.bn;
    /* One tile over 130 key blocks on 132 slots: 65 splits or more give each split 2 blocks,
     * the fewest any count up to 128 gives. */
    int s = fa_plan_decode_splits(&plan, 1, 130 * bn, 132);
    TU_CHECK(s > 1 && (130 + s - 1) / s == 2, "1 tile, 130 blocks: %d splits", s);
    for (int slots = 132; slots <= 264; slots += 132)
        for (int64_t tiles = 1; tiles <= 48; tiles += 5)
            for (int64_t blocks = 1; blocks <= 600; blocks += 7) {
                s = fa_plan_decode_splits(&plan, tiles, blocks * bn, slots);
                TU_CHECK(s >= 1 && s <= (blocks > 1 ? blocks : 1) && s <= slots,
                         "tiles %lld blocks %lld slots %d: %d splits", (long long)tiles,
                         (long long)blocks, slots, s);
                TU_CHECK(s == 1 || (blocks + s - 1) / s != (blocks + s - 2) / (s - 1),
                         "tiles %lld blocks %lld slots %d: %d splits give the longest split "
                         "of %d - 1", (long long)tiles, (long long)blocks, slots, s, s);
            }
}

/* The persistent backward's claim order under a right window edge: the chunk of pairs whose
 * simulated grid is the shortest (within 1%) among those the L2 bound allows; the simulation
 * within its bounds (the total work spread evenly, the longest item); a chunk of 3 pairs at 8k
 * causal d 192 / dv 128 over 20 pairs (the L2 bound) leaves long items to start near the end. */
static void check_backward_lpt(void)
{
    for (int64_t s = 1024; s <= 16384; s *= 2)
        for (int64_t pairs = 4; pairs <= 64; pairs += 12)
            for (int wl = -1; wl <= 1024; wl += 1025) {
                const int bn = s >= 8192 ? 64 : 128;
                const fa_lpt_shape sh = {s, s + 64, (s + 64 + bn - 1) / bn, pairs, wl, 0, 64,
                                         bn, 1 + (int)(pairs % 3), 192, 128, 132};
                const int64_t pb = sh.sq * (sh.d + sh.dv) * 2 * sh.group;
                int gmax = (int)((16 << 20) / pb);
                gmax = gmax < 1 ? 1 : gmax > 8 ? 8 : gmax > pairs ? (int)pairs : gmax;
                const int g = fa_plan_backward_lpt_groups(&sh);
                TU_CHECK(g >= 1 && g <= gmax, "s %lld pairs %lld: %d groups, bound %d",
                         (long long)s, (long long)pairs, g, gmax);
                TU_CHECK(fa_plan_backward_lpt_groups(&sh) == g, "s %lld: a second answer",
                         (long long)s);
                const int64_t span = fa_plan_backward_lpt_makespan(&sh, g);
                int64_t work = 0, longest = 0;
                for (int64_t nb = 0; nb < sh.n_tiles; nb++) {
                    /* rows [nb * bn - 64, nb * bn + bn - 64 + wl) see the block (sk = sq + 64) */
                    int64_t lo = nb * bn - 64, hi = wl < 0 ? s : nb * bn + bn - 64 + wl;
                    lo = lo < 0 ? 0 : lo;
                    hi = hi > s ? s : hi;
                    const int64_t t = (hi > lo ? (hi - 1) / 64 - lo / 64 + 1 : 0) * sh.group + 1;
                    work += t * pairs;
                    longest = t > longest ? t : longest;
                }
                TU_CHECK(span * 132 >= work && span >= longest,
                         "s %lld pairs %lld: simulated %lld, work %lld, longest %lld",
                         (long long)s, (long long)pairs, (long long)span, (long long)work,
                         (long long)longest);
                for (int o = 1; o <= gmax; o++)
                    TU_CHECK(span * 100 <= fa_plan_backward_lpt_makespan(&sh, o) * 101,
                             "s %lld pairs %lld: %d groups simulate longer than %d",
                             (long long)s, (long long)pairs, g, o);
            }
    const fa_lpt_shape mla = {8192, 8192, 64, 20, -1, 0, 64, 128, 1, 192, 128, 132};
    const int g = fa_plan_backward_lpt_groups(&mla);
    TU_CHECK(g < 3 && fa_plan_backward_lpt_makespan(&mla, 3) * 100 >
                          fa_plan_backward_lpt_makespan(&mla, g) * 105,
             "8k causal d 192 / dv 128, 20 pairs: %d groups", g);
}

/* The fp8 forward: the sm90 fp8 family by default, refused with FLASHATTN_SM90_FP8=0, refusals
 * naming the argument. */
static void check_forward_fp8(void)
{
    fa_plan plan;
    fa_plan_key key = {90, FA_DTYPE_F8E4M3, 128, 128, 0, 0, 0, 0};
    setenv("FLASHATTN_SM90_FP8", "0", 1);
    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_UNSUPPORTED &&
                 strstr(fa_last_error(), "q: the CUDA backend computes fp16 and bf16") != NULL &&
                 strstr(fa_last_error(), "fp8_e4m3") != NULL,
             "fp8 with FLASHATTN_SM90_FP8=0: %s", fa_last_error());
    unsetenv("FLASHATTN_SM90_FP8");
    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                 strcmp(plan.family, "fa_fwd_sm90_fp8.cu") == 0,
             "fp8 by default: %s", fa_last_error());
    const unsigned feats[] = {0, FA_FEATURE_VARLEN, FA_FEATURE_SOFTCAP,
                              FA_FEATURE_VARLEN | FA_FEATURE_SOFTCAP | FA_PLAN_OUT_F16};
    for (int d = 16; d <= 256; d += 16)
        for (size_t f = 0; f < sizeof feats / sizeof feats[0]; f++) {
            key = (fa_plan_key){90, FA_DTYPE_F8E4M3, d, d, feats[f], 0, 0, 0};
            TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                         strcmp(plan.family, "fa_fwd_sm90_fp8.cu") == 0,
                     "fp8 d %d features %x: %s", d, feats[f], fa_last_error());
            const int dp = d <= 64 ? 64 : d <= 128 ? 128 : 256;
            TU_CHECK(plan.dp == dp && plan.dvp == dp && plan.bm == 128 && plan.bn % 32 == 0 &&
                         plan.bn >= 64 && plan.bn <= 256 && plan.threads == 384 &&
                         plan.smem <= FA_SMEM_SM90_MAX && plan_define(&plan, "FA_BN") == plan.bn &&
                         plan.smem == (unsigned)FA_SMEM_FWD90_FP8(128, plan.bn, dp, dp,
                                                                  plan.stages, 1),
                     "fp8 d %d: dp %d bm %d bn %d smem %u", d, plan.dp, plan.bm, plan.bn,
                     plan.smem);
            TU_CHECK(plan_define(&plan, "FA_D") == d && plan_define(&plan, "FA_DP") == dp &&
                         plan_define(&plan, "FA_BF16") == !(feats[f] & FA_PLAN_OUT_F16) &&
                         plan_define(&plan, "FA_VARLEN") == !!(feats[f] & FA_FEATURE_VARLEN) &&
                         plan_define(&plan, "FA_SOFTCAP") == !!(feats[f] & FA_FEATURE_SOFTCAP),
                     "fp8 d %d features %x: defines", d, feats[f]);
            /* The warps-1-3 transpose only where it compiles without spills and is faster:
             * dense calls, with softcap at d 128 only. */
            const int fast = !(feats[f] & FA_FEATURE_VARLEN) &&
                             (!(feats[f] & FA_FEATURE_SOFTCAP) || dp == 128);
            TU_CHECK(plan_define(&plan, "FA_TRANSPOSE") == fast && (!fast || plan.bn == 128),
                     "fp8 d %d features %x: transpose %d bn %d", d, feats[f],
                     plan_define(&plan, "FA_TRANSPOSE"), plan.bn);
        }
    /* FLASHATTN_SM90_FP8_TILE: the first kernel's tile reachable, what cannot fit ignored. */
    key = (fa_plan_key){90, FA_DTYPE_F8E4M3, 128, 128, 0, 0, 0, 0};
    setenv("FLASHATTN_SM90_FP8_TILE", "128,2,0,0,0", 1);
    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK && plan.bn == 128 &&
                 plan.stages == 2 && plan_define(&plan, "FA_PINGPONG") == 0 &&
                 plan_define(&plan, "FA_TRANSPOSE") == 0 && plan_define(&plan, "FA_ORDER") == 0 &&
                 plan.smem == (unsigned)FA_SMEM_FWD90_FP8(128, 128, 128, 128, 2, 1),
             "fp8 tile override: bn %d stages %d", plan.bn, plan.stages);
    TU_CHECK(plan_define(&plan, "FA_EXP2_POLY") == -1, "fp8 tile override without EXP2_POLY: %d",
             plan_define(&plan, "FA_EXP2_POLY"));
    setenv("FLASHATTN_SM90_FP8_TILE", "128,2,1,1,1,4", 1);
    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                 plan_define(&plan, "FA_EXP2_POLY") == 4 && plan_define(&plan, "FA_TRANSPOSE") == 1,
             "fp8 tile override with EXP2_POLY 4: %d", plan_define(&plan, "FA_EXP2_POLY"));
    setenv("FLASHATTN_SM90_FP8_TILE", "160,2,1", 1);
    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK && plan.bn == 160 &&
                 plan.stages == 2 && plan_define(&plan, "FA_PINGPONG") == 1,
             "fp8 tile override 160,2,1: bn %d stages %d", plan.bn, plan.stages);
    key = (fa_plan_key){90, FA_DTYPE_F8E4M3, 256, 256, 0, 0, 0, 0};
    fa_plan def;
    unsetenv("FLASHATTN_SM90_FP8_TILE");
    TU_CHECK(fa_plan_forward(&key, &def) == FA_STATUS_OK, "fp8 d 256: %s", fa_last_error());
    setenv("FLASHATTN_SM90_FP8_TILE", "256,2,1", 1); /* 352 KB: ignored */
    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK && plan.bn == def.bn &&
                 plan.smem == def.smem,
             "fp8 d 256 oversized override taken: bn %d", plan.bn);
    setenv("FLASHATTN_SM90_FP8_TILE", "100,2,1", 1); /* not a multiple of 32: ignored */
    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK && plan.bn == def.bn,
             "fp8 bn 100 taken: %d", plan.bn);
    unsetenv("FLASHATTN_SM90_FP8_TILE");
    /* V^T from the workspace: dense only, key blocks of 128 to 256 (a multiple of 32, the
     * kernel's k-step), no raw V in shared memory (softcap too, at every head dim); a tile
     * override keeps it, its TRANSPOSE field ignored. */
    for (int d = 32; d <= 256; d += 32) {
        const int dp = d <= 64 ? 64 : d <= 128 ? 128 : 256;
        for (unsigned f = 0; f <= FA_FEATURE_SOFTCAP; f += FA_FEATURE_SOFTCAP) {
            key = (fa_plan_key){90, FA_DTYPE_F8E4M3, d, d, f | FA_PLAN_FP8_VT, 0, 0, 0};
            TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                         plan_define(&plan, "FA_TRANSPOSE") == 2 && plan.bn >= 128 &&
                         plan.bn <= 256 && plan.bn % 32 == 0 &&
                         plan_define(&plan, "FA_BN") == plan.bn &&
                         plan.smem <= FA_SMEM_SM90_MAX &&
                         plan.smem == (unsigned)FA_SMEM_FWD90_FP8(128, plan.bn, dp, dp,
                                                                  plan.stages, 0),
                     "fp8 V^T d %d features %x: transpose %d bn %d smem %u (%s)", d, f,
                     plan_define(&plan, "FA_TRANSPOSE"), plan.bn, plan.smem, fa_last_error());
        }
    }
    key = (fa_plan_key){90, FA_DTYPE_F8E4M3, 256, 256, FA_PLAN_FP8_VT, 0, 0, 0};
    setenv("FLASHATTN_SM90_FP8_TILE", "128,3,1,1,1", 1); /* 224 KB without the raw V */
    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK && plan.stages == 3 &&
                 plan_define(&plan, "FA_TRANSPOSE") == 2 &&
                 plan.smem == (unsigned)FA_SMEM_FWD90_FP8(128, 128, 256, 256, 3, 0),
             "fp8 V^T override: stages %d transpose %d", plan.stages,
             plan_define(&plan, "FA_TRANSPOSE"));
    key.features = 0; /* 3 stages with the raw V would not fit: ignored */
    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK && plan.stages == 2 &&
                 plan_define(&plan, "FA_TRANSPOSE") == 1,
             "fp8 override of 3 stages at d 256 taken: %d", plan.stages);
    setenv("FLASHATTN_SM90_FP8_TILE", "128,2,1,2,1", 1); /* TRANSPOSE 2 without V^T: ignored */
    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                 plan_define(&plan, "FA_TRANSPOSE") == 1,
             "fp8 override TRANSPOSE 2 taken: %d", plan_define(&plan, "FA_TRANSPOSE"));
    unsetenv("FLASHATTN_SM90_FP8_TILE");
    /* The rule: 2048 rows a key at d <= 128, 1024 above; the switch both ways. */
    TU_CHECK(!fa_plan_fp8_vt(128, FA_PLAN_FP8_VT_ROWS - 1) &&
                 fa_plan_fp8_vt(128, FA_PLAN_FP8_VT_ROWS) &&
                 !fa_plan_fp8_vt(256, FA_PLAN_FP8_VT_ROWS / 2 - 1) &&
                 fa_plan_fp8_vt(256, FA_PLAN_FP8_VT_ROWS / 2),
             "fa_plan_fp8_vt's thresholds");
    setenv("FLASHATTN_SM90_FP8_VT", "1", 1);
    TU_CHECK(fa_plan_fp8_vt(64, 1), "FLASHATTN_SM90_FP8_VT=1 not taken");
    setenv("FLASHATTN_SM90_FP8_VT", "0", 1);
    TU_CHECK(!fa_plan_fp8_vt(256, 1 << 20), "FLASHATTN_SM90_FP8_VT=0 not taken");
    unsetenv("FLASHATTN_SM90_FP8_VT");
    /* Refused, naming the argument. */
    const struct {
        fa_plan_key key;
        const char *arg;
    } bad[] = {
        {{90, FA_DTYPE_F8E5M2, 128, 128, 0, 0, 0, 0}, "q:"},
        {{80, FA_DTYPE_F8E4M3, 128, 128, 0, 0, 0, 0}, "q:"},
        {{90, FA_DTYPE_F8E4M3, 128, 64, 0, 0, 0, 0}, "v:"},
        {{90, FA_DTYPE_F8E4M3, 24, 24, 0, 0, 0, 0}, "q:"},
        {{90, FA_DTYPE_F8E4M3, 128, 128, FA_FEATURE_ALIBI, 0, 0, 0}, "alibi_slopes:"},
        {{90, FA_DTYPE_F8E4M3, 128, 128, FA_FEATURE_DROPOUT, 0, 0, 0}, "dropout_p:"},
        {{90, FA_DTYPE_F8E4M3, 128, 128, FA_PLAN_PROBS, 0, 0, 0}, "probs:"},
        {{90, FA_DTYPE_F8E4M3, 128, 128, FA_FEATURE_VARLEN | FA_PLAN_PAGED, 0, 0,
          0}, "block_table:"},
        {{90, FA_DTYPE_F8E4M3, 128, 128, FA_PLAN_SCORE_MOD, 0, 0, 0}, "score_mod:"},
        {{90, FA_DTYPE_F8E4M3, 128, 128, FA_PLAN_MASK_MOD, 0, 0, 0}, "mask_mod:"},
        {{90, FA_DTYPE_F8E4M3, 128, 128, FA_PLAN_BLOCK_MASK, 0, 0, 0}, "block_mask:"},
        {{90, FA_DTYPE_F8E4M3, 128, 128, FA_FEATURE_VARLEN | FA_PLAN_FP8_VT, 0, 0, 0},
         "cu_seqlens_k:"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        TU_CHECK(fa_plan_forward(&bad[i].key, &plan) == FA_STATUS_UNSUPPORTED &&
                     strncmp(fa_last_error(), bad[i].arg, strlen(bad[i].arg)) == 0,
                 "fp8 refusal %zu: %s", i, fa_last_error());
    /* The bf16 plans are untouched by the switch. */
    key = (fa_plan_key){90, FA_DTYPE_BF16, 128, 128, 0, 0, 0, 0};
    TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK &&
                 strcmp(plan.family, "fa_fwd_sm90.cu") == 0,
             "bf16 beside the fp8 family: %s", plan.family);
}

int main(void)
{
    tu_master_seed("test_plan");
    check_defines();
    check_forward_sm90();
    check_forward_sm90_dv();
    check_forward_sm90_dropout();
    check_forward_fp8();
    check_forward_sm90_mods();
    check_backward();
    check_backward_mods();
    check_backward_wide();
    check_backward_sm90_wide();
    check_decode_splits();
    check_decode_paged();
    check_backward_lpt();
    return tu_finish("test_plan");
}
