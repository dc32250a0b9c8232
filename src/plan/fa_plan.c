/* The plan table (see fa_plan.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/fa_error.h"
#include "core/fa_fp8.h"
#include "core/fa_params.h"
#include "plan/fa_plan.h"
#include "fa_smem.h"

/*
 * sm80 family, one row per padded head dim (the larger of d and dv). Tiles follow
 * FlashAttention-2's sm80 choices: 4 warps with two 16-row m-tiles each where the O and S
 * accumulators fit in 255 registers, fewer keys per block under dropout (its mask costs
 * registers), and 8 warps or 64-row tiles for the widest heads.
 */
typedef struct fa_plan_row {
    int dmax;
    int bm, bn, nwarps;    /* without dropout */
    int bm_d, bn_d, nw_d;  /* with dropout (or user-defined scoring) */
} fa_plan_row;

static const fa_plan_row fa_sm80_rows[] = {
    {32, 128, 128, 4, 128, 128, 4},
    {64, 128, 128, 4, 128, 64, 4},
    {128, 128, 64, 4, 128, 32, 4},
    {192, 128, 64, 8, 64, 64, 4},
    {256, 128, 64, 8, 64, 64, 4},
};

/* d 256 without dropout: 128x64 with 8 warps (128 KB of shared memory) on sm80, FA2's A100
 * choice; 64x64 with 4 warps (96 KB) elsewhere: sm86/89 have 99 KB, and on Hopper two such
 * CTAs per SM ran faster than one of 128x64x8. */
static const fa_plan_row fa_sm8x_row_256 = {256, 64, 64, 4, 64, 64, 4};

/* Compute capability 8.0 or later, the oldest the kernels support. */
static fa_status fa_plan_check_arch(int arch)
{
    if (arch < 80)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "device: compute capability %d.%d is below 8.0, the oldest the CUDA "
                            "kernels support",
                            arch / 10, arch % 10);
    return FA_STATUS_OK;
}

/* What every forward family (and the decode) takes: fp16 or bf16, sm_80 or later, head dims
 * in [1, FA_MAX_HEAD_DIM]. */
static fa_status fa_plan_check_forward_key(const fa_plan_key *key)
{
    if (key->dtype != FA_DTYPE_F16 && key->dtype != FA_DTYPE_BF16)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "q: the CUDA backend computes fp16 and bf16, got %s",
                            fa_dtype_name(key->dtype));
    FA_TRY(fa_plan_check_arch(key->arch));
    if (key->d < 1 || key->d > FA_MAX_HEAD_DIM || key->dv < 1 || key->dv > FA_MAX_HEAD_DIM)
        return fa_error_set(FA_STATUS_UNSUPPORTED, "head_dim: %d / %d outside [1, %d]", key->d,
                            key->dv, FA_MAX_HEAD_DIM);
    return FA_STATUS_OK;
}

/* 32, or a multiple of 64: the granularities the kernel's shared-memory swizzle supports. */
static int fa_plan_pad(int d)
{
    if (d <= 32)
        return 32;
    return (d + 63) / 64 * 64;
}

/* FLASHATTN_TILE=BM,BN,WARPS replaces the table's tile (for tuning with the benchmark); a value
 * the kernel cannot take is ignored. */
static void fa_plan_tile_override(fa_plan *plan)
{
    const char *env = getenv("FLASHATTN_TILE");
    int bm, bn, nw;
    if (!env || sscanf(env, "%d,%d,%d", &bm, &bn, &nw) != 3)
        return;
    /* Warps a power of two: the copies give each thread one column chunk (fa_fwd_sm80.cu). */
    if (nw < 1 || nw > 8 || (nw & (nw - 1)) != 0 || bm < 16 * nw || bm % (16 * nw) != 0 ||
        bm > 256 || bn < 16 || bn % 16 != 0 || bn > 256)
        return;
    plan->bm = bm;
    plan->bn = bn;
    plan->nwarps = nw;
}

/* "-DNAME=value", written by hand: a plan is made on every call, and snprintf was most of its
 * cost. Too long a name is cut (never: the names are this file's). */
static void fa_plan_define(fa_plan *plan, const char *name, int value)
{
    char *out = plan->defines[plan->num_defines++];
    char *const last = out + sizeof plan->defines[0] - 1;
    char digits[12];
    int n = 0;
    unsigned u = value < 0 ? 0u - (unsigned)value : (unsigned)value;
    do
        digits[n++] = (char)('0' + u % 10);
    while ((u /= 10) != 0);
    if (value < 0)
        digits[n++] = '-';
    *out++ = '-';
    *out++ = 'D';
    while (*name && out < last)
        *out++ = *name++;
    if (out < last)
        *out++ = '=';
    while (n > 0 && out < last)
        *out++ = digits[--n];
    *out = '\0';
}

/* Feature bits and the 0/1 #define each becomes in a kernel: the define is `set` when the bit
 * is, !set when not (FA_VEC, the 16-byte vector loads, is on for aligned rows). */
typedef struct fa_plan_feature_define {
    unsigned feature;
    const char *name;
    int set;
} fa_plan_feature_define;

static const fa_plan_feature_define fa_plan_feature_defines[] = {
    {FA_FEATURE_UNALIGNED, "FA_VEC", 0},  {FA_FEATURE_VARLEN, "FA_VARLEN", 1},
    {FA_FEATURE_ALIBI, "FA_ALIBI", 1},    {FA_FEATURE_SOFTCAP, "FA_SOFTCAP", 1},
    {FA_FEATURE_DROPOUT, "FA_DROPOUT", 1},
};

#define FA_PLAN_FEATURES                                                                        \
    (FA_FEATURE_UNALIGNED | FA_FEATURE_VARLEN | FA_FEATURE_ALIBI | FA_FEATURE_SOFTCAP |          \
     FA_FEATURE_DROPOUT)

/* The table's defines for the features a family compiles (`compiled`, FA_FEATURE_* bits): the
 * others it never sees, since the plan routes them to another family. */
static void fa_plan_define_features(fa_plan *plan, unsigned features, unsigned compiled)
{
    const size_t n = sizeof fa_plan_feature_defines / sizeof fa_plan_feature_defines[0];
    for (size_t i = 0; i < n; i++) {
        const fa_plan_feature_define *f = &fa_plan_feature_defines[i];
        if (compiled & f->feature)
            fa_plan_define(plan, f->name, (features & f->feature) ? f->set : !f->set);
    }
}

/* User-defined scoring's defines, only where the call has it (other kernels keep their JIT keys
 * and code); the sm80 families compile the hooks, forward and backward. */
static void fa_plan_define_mods(fa_plan *plan, const fa_plan_key *key)
{
    const unsigned features = key->features;
    if (features & FA_PLAN_SCORE_MOD)
        fa_plan_define(plan, "FA_SCORE_MOD", 1);
    if (features & FA_PLAN_MASK_MOD)
        fa_plan_define(plan, "FA_MASK_MOD", 1);
    if (features & FA_PLAN_BLOCK_MASK)
        fa_plan_define(plan, "FA_BLOCK_MASK", 1);
    /* The aux reads' dtypes and offset width, known to the compiler (fa_mod_aux). */
    if (features & (FA_PLAN_SCORE_MOD | FA_PLAN_MASK_MOD)) {
        fa_plan_define(plan, "FA_MOD_AUX_I32", (int)(key->mod_aux & 15u));
        fa_plan_define(plan, "FA_MOD_AUX_OFF32", (key->mod_aux & FA_PLAN_AUX_OFF32) != 0);
    }
}

/*
 * sm90 family (sm_90a: TMA, wgmma, warp specialisation), one row per head dim rounded up to 64
 * (the larger of d and dv): 128-row query tiles, 1 producer + 2 consumer warpgroups. Key block
 * and stages: as many stages as fit beside Q in the 227 KB of shared memory, and for the wide
 * heads the key block shrunk until two stages fit (FA3's hdim-192/256 tiles). Pingpong between
 * the consumers on or off per row, persistent CTAs over mirrored tile pairs for causal calls, by
 * measurement. Long calls (FA_PLAN_LONG) at head dim 64 take three consumer warpgroups, 192-row
 * tiles: faster from 8k rows on, slower below (fewer, longer tiles leave SMs idle at the end).
 */
typedef struct fa_plan_row90 {
    int dp, bn, stages, pingpong, persistent;
    int consumers; /* consumer warpgroups of 64 query rows each */
} fa_plan_row90;

static const fa_plan_row90 fa_sm90_rows[] = {
    {64, 128, 4, 0, 2, 2},  /* Q 16 KB + 4 x (K 16 + V 16) KB = 144 KB */
    {128, 128, 2, 1, 2, 2}, /* Q 32 KB + 2 x (K 32 + V 32) KB = 160 KB */
    {192, 112, 2, 1, 2, 2}, /* Q 48 KB + 2 x (K 42 + V 42) KB = 216 KB */
    {256, 80, 2, 1, 2, 2},  /* Q 64 KB + 2 x (K 40 + V 40) KB = 224 KB */
};

/*
 * d != dv: the row of the wider head dim holds both (its K, V stages and its O accumulator are at
 * least as wide), and a narrower one leaves room for a longer key block: it grows toward 128 keys
 * (the rows' widest, FA3's 192 / 128 tile) while shared memory at the row's stages and the
 * consumers' registers hold it. A 240-register consumer thread keeps S (bn / 2 fp32), P (bn / 4
 * packed pairs) and O (dvp / 2 fp32) live together; FA_SM90_ACC_REGS is the most of them a row
 * holds without spilling (d 256: 40 + 20 + 128). So d 192 / dv 128 takes 128 keys (214 KB,
 * 160 of those registers against d 192's 112 keys and 180).
 */
#define FA_SM90_ACC_REGS 188
#define FA_SM90_GROW_BN 128

static int fa_plan_sm90_acc_regs(int bn, int dvp) { return bn / 2 + bn / 4 + dvp / 2; }

static void fa_plan_sm90_grow(fa_plan_row90 *row, int dp, int dvp)
{
    while (row->bn + 16 <= FA_SM90_GROW_BN &&
           fa_plan_sm90_acc_regs(row->bn + 16, dvp) <= FA_SM90_ACC_REGS &&
           FA_SMEM_FWD90(64 * row->consumers, row->bn + 16, dp, dvp, row->stages) <=
               FA_SMEM_SM90_MAX)
        row->bn += 16;
}

/* Keys per block with dropout at head dim 256: beside the 128 O registers, the 80-key block's S,
 * P and Philox state overflow a consumer's 240 registers (ptxas spills); the 64-key block's fit. */
#define FA_SM90_BN_DROPOUT_D256 64

#define FA_PLAN_MODS (FA_PLAN_SCORE_MOD | FA_PLAN_MASK_MOD | FA_PLAN_BLOCK_MASK)

/* What the sm90 kernel compiles: everything else goes to the sm80 family. */
#define FA_SM90_UNSUPPORTED                                                                     \
    (FA_FEATURE_UNALIGNED | FA_PLAN_PROBS | FA_PLAN_NO_SM90 | FA_PLAN_PAGED | FA_PLAN_MODS)

/* On unless FLASHATTN_SM90=0 (which keeps every case on the sm80 family, for comparison). */
int fa_plan_sm90_enabled(void)
{
    const char *env = getenv("FLASHATTN_SM90");
    return !(env && strcmp(env, "0") == 0);
}

/* Calls with user-defined scoring take the sm90 family's hooks (FA_SCORE_MOD, FA_MASK_MOD,
 * FA_BLOCK_MASK in fa_fwd_sm90.cu) unless FLASHATTN_SM90_MODS=0 keeps them on the sm80 family
 * (for comparison, and so the GPU tests cover both). */
static int fa_plan_sm90_mods_enabled(void)
{
    const char *env = getenv("FLASHATTN_SM90_MODS");
    return !(env && strcmp(env, "0") == 0);
}

/* FLASHATTN_SM90_TILE=BN,STAGES,PINGPONG[,PERSISTENT[,CONSUMERS]] replaces the row's choice
 * (for tuning with the benchmark); a combination the kernel cannot take or shared memory cannot
 * hold is ignored. PERSISTENT: 0 one CTA per query tile; 1 persistent CTAs for calls without
 * causal, window, varlen or masks; 2 (the rows' choice) also for causal, windowed and masked
 * calls of at most FA_SM90_PAIRED_MAX_TILES query tiles, over mirrored pairs of tiles; 3 over
 * the pairs at any tile count. CONSUMERS: 2, or 3 at head dim 64 without pingpong (192-row
 * tiles). */
static void fa_plan_sm90_override(fa_plan_row90 *row, int dp, int dvp)
{
    const char *env = getenv("FLASHATTN_SM90_TILE");
    int bn, stages, pingpong, persistent = row->persistent, consumers = row->consumers;
    if (!env || sscanf(env, "%d,%d,%d,%d,%d", &bn, &stages, &pingpong, &persistent,
                       &consumers) < 3)
        return;
    if (bn < 64 || bn > 192 || bn % 16 != 0 || stages < 2 || stages > 8 ||
        (pingpong != 0 && pingpong != 1) || persistent < 0 || persistent > 3 ||
        (consumers != 2 && consumers != 3) ||
        (consumers == 3 && (row->dp != 64 || pingpong)) ||
        FA_SMEM_FWD90(64 * consumers, bn, dp, dvp, stages) > FA_SMEM_SM90_MAX)
        return;
    row->bn = bn;
    row->stages = stages;
    row->pingpong = pingpong;
    row->persistent = persistent;
    row->consumers = consumers;
}

fa_status fa_plan_forward_sm90(const fa_plan_key *key, fa_plan *plan)
{
    /* Mods where switched on; the block mask's tables are for dense calls only. */
    const unsigned block_varlen = FA_PLAN_BLOCK_MASK | FA_FEATURE_VARLEN;
    const unsigned unsupported =
        (key->features & FA_PLAN_MODS) && (key->features & block_varlen) != block_varlen &&
                fa_plan_sm90_mods_enabled()
            ? FA_SM90_UNSUPPORTED & ~FA_PLAN_MODS
            : FA_SM90_UNSUPPORTED;
    if (key->arch != 90 || (key->dtype != FA_DTYPE_F16 && key->dtype != FA_DTYPE_BF16) ||
        key->d > 256 || key->dv > 256 || (key->features & unsupported))
        return FA_STATUS_UNSUPPORTED;
    const int dp = (key->d + 63) / 64 * 64, dvp = (key->dv + 63) / 64 * 64;
    const int mods = (key->features & FA_PLAN_MODS) != 0, dmax = dp > dvp ? dp : dvp;
    /* Where the mods' code spills (ptxas, with a softcap score_mod and a document mask_mod): with
     * dropout past head dim 128; a block mask at head dim 256 or beside the built-in softcap,
     * ALiBi or dropout (flex_attention's calls have none of those three). */
    const unsigned bm_beside = FA_FEATURE_SOFTCAP | FA_FEATURE_ALIBI | FA_FEATURE_DROPOUT;
    if (mods && (((key->features & FA_FEATURE_DROPOUT) && dmax > 128) ||
                 ((key->features & FA_PLAN_BLOCK_MASK) &&
                  (dmax > 192 || (key->features & bm_beside)))))
        return FA_STATUS_UNSUPPORTED;
    fa_plan_row90 row = fa_sm90_rows[(dp > dvp ? dp : dvp) / 64 - 1];
    /* Three consumers have 160 registers each: too few for the mods' code (spills). */
    if (row.dp == 64 && (key->features & FA_PLAN_LONG) && !mods)
        row.consumers = 3;
    if (row.dp == 256 && (key->features & FA_FEATURE_DROPOUT))
        row.bn = FA_SM90_BN_DROPOUT_D256;
    else if (dp != dvp)
        fa_plan_sm90_grow(&row, dp, dvp);
    fa_plan_sm90_override(&row, dp, dvp);
    *plan = (fa_plan){0};
    plan->family = "fa_fwd_sm90.cu";
    snprintf(plan->target, sizeof plan->target, "sm_90a");
    plan->bm = 64 * row.consumers;
    plan->bn = row.bn;
    plan->nwarps = 4 * (row.consumers + 1);
    plan->dp = dp;
    plan->dvp = dvp;
    plan->stages = row.stages;
    plan->persistent = row.persistent;
    plan->threads = (unsigned)(128 * (row.consumers + 1));
    plan->smem = (unsigned)FA_SMEM_FWD90(plan->bm, plan->bn, plan->dp, plan->dvp, plan->stages);
    fa_plan_define(plan, "FA_BF16", key->dtype == FA_DTYPE_BF16);
    fa_plan_define(plan, "FA_D", key->d);
    /* Only d != dv kernels carry FA_DV, so the others keep their JIT keys. */
    if (key->dv != key->d)
        fa_plan_define(plan, "FA_DV", key->dv);
    fa_plan_define(plan, "FA_DP", plan->dp);
    fa_plan_define(plan, "FA_DVP", plan->dvp);
    fa_plan_define(plan, "FA_NCW", row.consumers);
    fa_plan_define(plan, "FA_BM", plan->bm);
    fa_plan_define(plan, "FA_BN", plan->bn);
    fa_plan_define(plan, "FA_STAGES", plan->stages);
    fa_plan_define(plan, "FA_PINGPONG", row.pingpong);
    fa_plan_define_features(plan, key->features, FA_PLAN_FEATURES & ~FA_SM90_UNSUPPORTED);
    fa_plan_define_mods(plan, key);
    /* The mask decided before score_mod (fa_fwd_sm90.cu's fa_mask_bits): not yet run on a GPU. */
    const char *first = getenv("FLASHATTN_SM90_MASK_FIRST");
    if ((key->features & FA_PLAN_SCORE_MOD) &&
        (key->features & (FA_PLAN_MASK_MOD | FA_PLAN_BLOCK_MASK)) && first &&
        strcmp(first, "1") == 0)
        fa_plan_define(plan, "FA_MOD_MASK_FIRST", 1);
    return FA_STATUS_OK;
}

/*
 * The sm90 fp8 forward (fa_fwd_sm90_fp8.cu): e4m3 q, k, v, d = dv a multiple of 16 up to 256
 * (padded to 64, 128 or 256), dense or varlen, causal, window, GQA, softcap; 128-row tiles, two
 * stages, pingpong between the consumers, the softmax's order before the P V wait
 * (fa_softmax_order). Dense calls without softcap: 128-key blocks with V transposed by the
 * producer's warps 1 .. 3 (ldmatrix / stmatrix) while thread 0 only loads, by measurement the
 * fastest (fa_sm90_fp8_fast). With varlen or softcap that transpose spills 4-40 bytes of the
 * producer's 24 registers, so those calls take the rows: the whole producer warpgroup's
 * plain-load transpose and the largest key block that compiles without spills (192 at d 64 and
 * 128, 128 at d 256, whose two stages of K, V and V^T fill the 227 KB).
 * FLASHATTN_SM90_FP8_TILE overrides either (the A/B). What the kernel cannot do is refused
 * naming the argument: no other family computes fp8 on a CUDA device.
 */
typedef struct fa_plan_row90_fp8 {
    int dp, bn, stages, pingpong, transpose, order;
} fa_plan_row90_fp8;

static const fa_plan_row90_fp8 fa_sm90_fp8_rows[] = {
    {64, 192, 2, 1, 0, 1},  /* Q 8 KB + 2 x (K 12 + Vr 12 + V^T 16) KB = 88 KB */
    {128, 192, 2, 1, 0, 1}, /* Q 16 KB + 2 x (K 24 + Vr 24 + V^T 32) KB = 176 KB */
    {256, 128, 2, 1, 0, 1}, /* Q 32 KB + 2 x (K 32 + Vr 32 + V^T 32) KB = 224 KB */
};

/* Dense calls without softcap, every head dim (d 256: 224 KB as above). */
static const fa_plan_row90_fp8 fa_sm90_fp8_fast = {0, 128, 2, 1, 1, 1};

/* FLASHATTN_SM90_FP8_TILE=BN,STAGES,PINGPONG[,TRANSPOSE[,ORDER]] replaces the row's choice (for
 * an A/B with the benchmark; 128,2,0,0,0 is the first, untuned kernel); a combination the kernel
 * cannot take or shared memory cannot hold is ignored. */
static void fa_plan_sm90_fp8_override(fa_plan_row90_fp8 *row)
{
    const char *env = getenv("FLASHATTN_SM90_FP8_TILE");
    int bn, stages, pingpong, transpose = row->transpose, order = row->order;
    if (!env || sscanf(env, "%d,%d,%d,%d,%d", &bn, &stages, &pingpong, &transpose, &order) < 3)
        return;
    if (bn < 64 || bn > 256 || bn % 32 != 0 || stages < 2 || stages > 8 ||
        (pingpong != 0 && pingpong != 1) || (transpose != 0 && transpose != 1) ||
        (order != 0 && order != 1) ||
        FA_SMEM_FWD90_FP8(128, bn, row->dp, row->dp, stages) > FA_SMEM_SM90_MAX)
        return;
    row->bn = bn;
    row->stages = stages;
    row->pingpong = pingpong;
    row->transpose = transpose;
    row->order = order;
}

static fa_status fa_plan_fp8_refuse(const char *arg, const char *what)
{
    return fa_error_set(FA_STATUS_UNSUPPORTED,
                        "%s: %s is not supported with fp8 inputs on a CUDA device (the CPU "
                        "backend computes it)",
                        arg, what);
}

fa_status fa_plan_forward_sm90_fp8(const fa_plan_key *key, fa_plan *plan)
{
    if (key->dtype != FA_DTYPE_F8E4M3)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "q: the CUDA fp8 forward computes fp8_e4m3, got %s (the CPU backend "
                            "computes it)",
                            fa_dtype_name(key->dtype));
    if (key->arch != 90)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "q: the CUDA fp8 forward needs compute capability 9.0 (Hopper), got "
                            "%d.%d",
                            key->arch / 10, key->arch % 10);
    if (key->d < 16 || key->d > 256 || key->d % 16 != 0)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "q: the CUDA fp8 forward takes head dims multiples of 16 up to 256, "
                            "got %d",
                            key->d);
    if (key->dv != key->d)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "v: the CUDA fp8 forward takes v's head dim equal to q's (%d), got %d",
                            key->d, key->dv);
    if (key->features & FA_FEATURE_ALIBI)
        return fa_plan_fp8_refuse("alibi_slopes", "ALiBi");
    if (key->features & FA_FEATURE_DROPOUT)
        return fa_plan_fp8_refuse("dropout_p", "dropout");
    if (key->features & FA_PLAN_PROBS)
        return fa_plan_fp8_refuse("probs", "the probs output");
    if (key->features & FA_PLAN_PAGED)
        return fa_plan_fp8_refuse("block_table", "a paged KV layout");
    if (key->features & FA_PLAN_SCORE_MOD)
        return fa_plan_fp8_refuse("score_mod", "user-defined scoring");
    if (key->features & FA_PLAN_MASK_MOD)
        return fa_plan_fp8_refuse("mask_mod", "user-defined scoring");
    if (key->features & FA_PLAN_BLOCK_MASK)
        return fa_plan_fp8_refuse("block_mask", "a block mask");
    *plan = (fa_plan){0};
    plan->family = "fa_fwd_sm90_fp8.cu";
    snprintf(plan->target, sizeof plan->target, "sm_90a");
    plan->dp = plan->dvp = key->d <= 64 ? 64 : key->d <= 128 ? 128 : 256;
    fa_plan_row90_fp8 row = fa_sm90_fp8_rows[plan->dp / 128];
    if (!(key->features & (FA_FEATURE_VARLEN | FA_FEATURE_SOFTCAP))) {
        const int dp = row.dp;
        row = fa_sm90_fp8_fast;
        row.dp = dp;
    }
    fa_plan_sm90_fp8_override(&row);
    plan->bm = 128;
    plan->bn = row.bn;
    plan->nwarps = 12;
    plan->stages = row.stages;
    plan->persistent = 2;
    plan->threads = 384;
    plan->smem =
        (unsigned)FA_SMEM_FWD90_FP8(plan->bm, plan->bn, plan->dp, plan->dvp, plan->stages);
    fa_plan_define(plan, "FA_BF16", key->features & FA_PLAN_OUT_F16 ? 0 : 1);
    fa_plan_define(plan, "FA_D", key->d);
    fa_plan_define(plan, "FA_DP", plan->dp);
    fa_plan_define(plan, "FA_DVP", plan->dvp);
    fa_plan_define(plan, "FA_NCW", 2);
    fa_plan_define(plan, "FA_BM", plan->bm);
    fa_plan_define(plan, "FA_BN", plan->bn);
    fa_plan_define(plan, "FA_STAGES", plan->stages);
    fa_plan_define(plan, "FA_PINGPONG", row.pingpong);
    fa_plan_define(plan, "FA_TRANSPOSE", row.transpose);
    fa_plan_define(plan, "FA_ORDER", row.order);
    fa_plan_define_features(plan, key->features, FA_FEATURE_VARLEN | FA_FEATURE_SOFTCAP);
    return FA_STATUS_OK;
}

fa_status fa_plan_forward(const fa_plan_key *key, fa_plan *plan)
{
    /* fp8 goes to its own family, only behind FLASHATTN_SM90_FP8=1 (else refused below). */
    if (fa_dtype_is_fp8(key->dtype) && fa_sm90_fp8_enabled())
        return fa_plan_forward_sm90_fp8(key, plan);
    FA_TRY(fa_plan_check_forward_key(key));
    if (key->arch == 90 && fa_plan_sm90_enabled() && fa_plan_forward_sm90(key, plan) == FA_STATUS_OK)
        return FA_STATUS_OK;
    *plan = (fa_plan){0};
    plan->family = "fa_fwd_sm80.cu";
    /* sm_90a: the arch-specific target, so later Hopper families share the same cache layout. */
    snprintf(plan->target, sizeof plan->target, key->arch == 90 ? "sm_90a" : "sm_%d", key->arch);
    plan->dp = fa_plan_pad(key->d);
    plan->dvp = fa_plan_pad(key->dv);
    int dmax = plan->dp > plan->dvp ? plan->dp : plan->dvp;
    const fa_plan_row *row = &fa_sm80_rows[0];
    for (size_t i = 0; i < sizeof fa_sm80_rows / sizeof fa_sm80_rows[0]; i++) {
        row = &fa_sm80_rows[i];
        if (dmax <= row->dmax)
            break;
    }
    if (row->dmax == 256 && key->arch != 80)
        row = &fa_sm8x_row_256;
    /* User-defined scoring costs registers as dropout's mask does: it takes the same tiles. */
    int dropout = (key->features & (FA_FEATURE_DROPOUT | FA_PLAN_MODS)) != 0;
    plan->bm = dropout ? row->bm_d : row->bm;
    plan->bn = dropout ? row->bn_d : row->bn;
    plan->nwarps = dropout ? row->nw_d : row->nwarps;
    /* Past d 128 the mods' registers beside the O accumulators want half the keys per block. */
    if ((key->features & FA_PLAN_MODS) && dmax > 128)
        plan->bn = 32;
    fa_plan_tile_override(plan);
    plan->threads = (unsigned)plan->nwarps * 32;
    plan->smem = (unsigned)FA_SMEM_FWD80(plan->bm, plan->bn, plan->dp, plan->dvp) +
                 ((key->features & FA_FEATURE_VARLEN) ? FA_SMEM_FWD80_LENS : 0);

    fa_plan_define(plan, "FA_BF16", key->dtype == FA_DTYPE_BF16);
    fa_plan_define(plan, "FA_DP", plan->dp);
    fa_plan_define(plan, "FA_DVP", plan->dvp);
    fa_plan_define(plan, "FA_BM", plan->bm);
    fa_plan_define(plan, "FA_BN", plan->bn);
    fa_plan_define(plan, "FA_NWARPS", plan->nwarps);
    fa_plan_define_features(plan, key->features, FA_PLAN_FEATURES);
    /* Only paged kernels carry the define, so dense kernels keep their JIT keys and code. */
    if (key->features & FA_PLAN_PAGED)
        fa_plan_define(plan, "FA_PAGED", 1);
    fa_plan_define_mods(plan, key);
    return FA_STATUS_OK;
}

/*
 * Backward (kernels/fa_bwd_sm80.cu), one row per largest padded head dim: warps per CTA (each
 * warp owns 16 keys of the key block, so the block is 16 x warps keys) and shared-memory stages
 * of the query tile (2: the next tile's Q and dO load during this one). Query tiles are
 * FA_BWD_BM rows here but for head dim 256 on the 99 KB parts (the sm90 family's are larger at
 * small head dims): the workspace size is asked for without a device, so fa_cuda_backward.c
 * sizes it for the largest of the layouts.
 */
/* Shared memory per SM of the arch's parts: 228 KB on sm_90 and sm_100, 164 KB on sm_80 and
 * sm_87, 100 KB on the others (sm_86, sm_89, sm_120). */
static int fa_plan_sm_smem(int arch)
{
    return arch == 90 || arch == 100 ? 228 * 1024 : arch == 80 || arch == 87 ? 164 * 1024
                                                                               : 100 * 1024;
}

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

/* Calls with user-defined scoring take fa_bwd_sm90.cu's hooks only with
 * FLASHATTN_BWD_SM90_MODS=1 (not yet measured on a device); the sm80 family otherwise. */
static int fa_plan_bwd_sm90_mods_enabled(void)
{
    const char *env = getenv("FLASHATTN_BWD_SM90_MODS");
    return env && strcmp(env, "1") == 0;
}

/* The mods' combinations fa_bwd_sm90.cu takes: d = dv padded to 128, without a block mask,
 * dropout, softcap or ALiBi (at 64 the 128-query tile's S^T and dP^T beside the programs
 * spilled 140-290 bytes, the block mask's tours 180-760, softcap and ALiBi beside them 148).
 * ptxas still spills 20-40 bytes here (a per-item value, and around score_mod's code; 0 varlen
 * with a relative-bias score_mod): the switch stays off until a device says it pays. */
static int fa_plan_bwd_sm90_mods_ok(const fa_plan_key *key)
{
    const unsigned beside =
        FA_PLAN_BLOCK_MASK | FA_FEATURE_DROPOUT | FA_FEATURE_SOFTCAP | FA_FEATURE_ALIBI;
    return key->d == key->dv && key->d > 64 && key->d <= 128 && !(key->features & beside);
}

/* The wide sm90 backward (kernels/fa_bwd_sm90_wide.cu): 64 x 64 tiles, three query stages where
 * they fit the 227 KB (up to d + dv = 384), else two (230472 bytes at d = dv = 256). */
static void fa_plan_backward_sm90_wide(const fa_plan_key *key, fa_plan *plan)
{
    plan->family = "fa_bwd_sm90_wide.cu";
    plan->dp = fa_plan_pad(key->d);
    plan->dvp = fa_plan_pad(key->dv);
    plan->bm = FA_BWD_BM;
    plan->bn = 64;
    plan->stages =
        FA_SMEM_BWD90W(plan->bm, plan->bn, plan->dp, plan->dvp, 3) <= FA_SMEM_SM90_MAX ? 3 : 2;
    plan->smem = (unsigned)FA_SMEM_BWD90W(plan->bm, plan->bn, plan->dp, plan->dvp, plan->stages);
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
    fa_plan_define(plan, "FA_BF16", key->dtype == FA_DTYPE_BF16);
    fa_plan_define(plan, "FA_DP", plan->dp);
    fa_plan_define(plan, "FA_DVP", plan->dvp);
    fa_plan_define(plan, "FA_BM", plan->bm);
    fa_plan_define(plan, "FA_BN", plan->bn);
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
    /* User-defined scoring: the sm80 family on every arch, or with FLASHATTN_BWD_SM90_MODS=1
     * fa_bwd_sm90.cu's hooks where they compile (fa_plan_bwd_sm90_mods_ok). */
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
    fa_plan_define(plan, "FA_BF16", key->dtype == FA_DTYPE_BF16);
    fa_plan_define(plan, "FA_DP", plan->dp);
    fa_plan_define(plan, "FA_DVP", plan->dvp);
    fa_plan_define(plan, "FA_BM", plan->bm);
    fa_plan_define(plan, "FA_BN", plan->bn);
    fa_plan_define(plan, "FA_NWARPS", plan->nwarps);
    fa_plan_define(plan, "FA_QSTAGES", row.qstages);
    /* Only split kernels carry the define, so the others keep their JIT keys and code. */
    if (row.split > 1)
        fa_plan_define(plan, "FA_DKV_SPLIT", row.split);
    fa_plan_define_features(plan, key->features, FA_PLAN_FEATURES);
    fa_plan_define_mods(plan, key);
    return FA_STATUS_OK;
}

/*
 * Decode (kernels/fa_decode.cu): four warps, split over the rows as far as the packed rows fill
 * them and over each key block otherwise; 64-key blocks, as many stages (2 to 4; to 8 for fp8
 * caches, whose stages are half the bytes) as fit about 96 KB, so two CTAs share an SM up to
 * head dim 128. Wider heads, whose two stages pass that
 * and so run one CTA per SM anyway, take as many stages as fit about 200 KB on the 227 KB parts
 * (sm_90, sm_100): with two, a lone CTA keeps too few bytes in flight to reach the bandwidth.
 * fp8 caches, whose blocks the warps convert as they read them: 128-key blocks where a warp
 * has a single row tile (the per-block work besides the conversion, halved per key), in
 * stages of about 64 KB at most (two at head dim 128, which measured ahead of three).
 */
#define FA_DECODE_BN 64
#define FA_DECODE_STAGE_BUDGET (96 * 1024)
#define FA_DECODE_FP8_BUDGET (64 * 1024)
#define FA_DECODE_ALONE_BUDGET (200 * 1024)
#define FA_DECODE_MAX_AUTO_SPLITS 128
#define FA_DECODE_MAX_CLUSTER 16 /* Hopper's largest (non-portable) thread block cluster */
#define FA_DECODE_BASE_REGS 104   /* registers a thread needs besides its O accumulators */

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

fa_status fa_plan_decode(const fa_plan_key *key, int64_t rows, fa_plan *plan)
{
    FA_TRY(fa_plan_check_forward_key(key));
    *plan = (fa_plan){0};
    plan->family = "fa_decode.cu";
    snprintf(plan->target, sizeof plan->target, key->arch == 90 ? "sm_90a" : "sm_%d", key->arch);
    plan->dp = fa_plan_pad(key->d);
    plan->dvp = fa_plan_pad(key->dv);
    int wm = fa_plan_decode_wm(rows);
    const int kvb = (key->features & (FA_PLAN_KV_E4M3 | FA_PLAN_KV_E5M2)) ? 1 : 2;
    plan->bn = kvb == 1 && wm == 1 && plan->dp + plan->dvp <= 256 ? 2 * FA_DECODE_BN
                                                                   : FA_DECODE_BN;
    plan->nwarps = 4;
    const int stage = kvb * plan->bn * (plan->dp + plan->dvp), most = 8 / kvb;
    const int budget = kvb == 1 ? FA_DECODE_FP8_BUDGET : FA_DECODE_STAGE_BUDGET;
    const int alone = 2 * stage > budget && fa_plan_sm_smem(key->arch) >= 228 * 1024;
    plan->stages = (alone ? FA_DECODE_ALONE_BUDGET : budget) / stage;
    plan->stages = plan->stages < 2 ? 2 : plan->stages > most ? most : plan->stages;
    const int paged = (key->features & FA_PLAN_PAGED) != 0;
    /* A paged plan's row offsets must not cost it the second CTA per SM that the dense plan
     * has: where they would, it takes one stage fewer. */
    const int bm = 16 * wm, sm_bytes = fa_plan_sm_smem(key->arch);
    if (paged && plan->stages > 2 &&
        fa_plan_ctas_per_sm(FA_SMEM_DECODE(bm, plan->bn, plan->dp, plan->dvp, plan->stages,
                                           plan->nwarps, 0, kvb), sm_bytes) >= 2 &&
        fa_plan_ctas_per_sm(FA_SMEM_DECODE(bm, plan->bn, plan->dp, plan->dvp, plan->stages,
                                           plan->nwarps, 1, kvb), sm_bytes) < 2)
        plan->stages--;
    fa_plan_decode_override(plan, &wm, paged);
    plan->bm = 16 * wm;
    plan->threads = (unsigned)(32 * plan->nwarps);
    plan->smem = (unsigned)FA_SMEM_DECODE(plan->bm, plan->bn, plan->dp, plan->dvp, plan->stages,
                                          plan->nwarps, paged, kvb);
    plan->cluster_max = key->arch >= 90 ? FA_DECODE_MAX_CLUSTER : 0;
    /* The CTAs per SM that shared memory allows, told to the compiler (launch bounds) so that
     * it neither takes registers that would cost one of them nor, left to itself, spills to
     * reach an occupancy shared memory rules out; at most as many as leave a thread its O
     * accumulators (dv / 2 registers) and FA_DECODE_BASE_REGS besides. */
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
int fa_plan_few_rows(const fa_params *p)
{
    /* User-defined scoring is evaluated in the forward's tiles only. */
    return p->max_sq <= FA_DECODE_MAX_ROWS && p->dropout_p == 0 && p->probs == NULL &&
           !fa_mod_call_active(&p->mods);
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

/* The combine (kernels/fa_combine.cu): one warp per row, nothing to tile. */
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
