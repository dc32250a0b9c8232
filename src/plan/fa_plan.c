/* The plan table (see fa_plan.h): the forward families and what every plan shares
 * (fa_plan_rules.h); the backward in fa_plan_backward.c, the decode in fa_plan_decode.c. */
#include <math.h>
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
fa_status fa_plan_check_arch(int arch)
{
    if (arch < 80)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "device: compute capability %d.%d is below 8.0, the oldest the CUDA "
                            "kernels support",
                            arch / 10, arch % 10);
    return FA_STATUS_OK;
}

/* fp16 or bf16, sm_80 or later, head dims in [1, max]. */
static fa_status fa_plan_check_key_dims(const fa_plan_key *key, int max)
{
    if (key->dtype != FA_DTYPE_F16 && key->dtype != FA_DTYPE_BF16)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "q: the CUDA backend computes fp16 and bf16, got %s",
                            fa_dtype_name(key->dtype));
    FA_TRY(fa_plan_check_arch(key->arch));
    if (key->d < 1 || key->d > max || key->dv < 1 || key->dv > max)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "head_dim: %d / %d outside [1, %d], this CUDA kernel's (the CUDA "
                            "decode schedule, KV-cache calls and forwards without dropout, "
                            "probs or mods, takes up to %d; the CPU backend up to %d)",
                            key->d, key->dv, max, FA_CUDA_DECODE_MAX_HEAD_DIM, FA_MAX_HEAD_DIM);
    return FA_STATUS_OK;
}

fa_status fa_plan_check_forward_key(const fa_plan_key *key)
{
    return fa_plan_check_key_dims(key, FA_CUDA_MAX_HEAD_DIM);
}

fa_status fa_plan_check_decode_key(const fa_plan_key *key)
{
    return fa_plan_check_key_dims(key, FA_CUDA_DECODE_MAX_HEAD_DIM);
}

/* 32, or a multiple of 64: the granularities the kernel's shared-memory swizzle supports. */
int fa_plan_pad(int d)
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
void fa_plan_define(fa_plan *plan, const char *name, int value)
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

/* The sm80 families' and the sm90 backward's first defines: the dtype, the padded head dims and
 * the tile (plan->dp, dvp, bm, bn set). */
void fa_plan_define_tile(fa_plan *plan, const fa_plan_key *key)
{
    fa_plan_define(plan, "FA_BF16", key->dtype == FA_DTYPE_BF16);
    fa_plan_define(plan, "FA_DP", plan->dp);
    fa_plan_define(plan, "FA_DVP", plan->dvp);
    fa_plan_define(plan, "FA_BM", plan->bm);
    fa_plan_define(plan, "FA_BN", plan->bn);
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

/* The table's defines for the features a family compiles (`compiled`, FA_FEATURE_* bits): the
 * others it never sees, since the plan routes them to another family. */
void fa_plan_define_features(fa_plan *plan, unsigned features, unsigned compiled)
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
void fa_plan_define_mods(fa_plan *plan, const fa_plan_key *key)
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
        /* only where asked: the other kernels keep their JIT keys */
        if (FA_PLAN_AUX_GRADS(key->mod_aux))
            fa_plan_define(plan, "FA_MOD_AUX_GRAD", (int)FA_PLAN_AUX_GRADS(key->mod_aux));
    }
}

/*
 * sm90 family (sm_90a: TMA, wgmma, warp specialisation), one row per head dim rounded up to 64
 * (the larger of d and dv): 128-row query tiles, 1 producer + 2 consumer warpgroups. Key block
 * and stages: as many stages as fit beside Q in the 227 KB of shared memory, and for the wide
 * heads the key block shrunk until two stages fit (FA3's hdim-192/256 tiles). Pingpong between
 * the consumers on or off per row, persistent CTAs over mirrored tile pairs for causal calls, by
 * measurement. Long calls (FA_PLAN_LONG) at head dim 64 take three consumer warpgroups, 192-row
 * tiles: faster from 8k rows on, from 4k for dense causal calls and from 2k where every row sees
 * every key; slower for shorter calls (the causal ones' tiles cover more masked keys) and for
 * windowed ones under 8k (fewer, longer tiles leave SMs idle at the end).
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
 * P and Philox state overflow a consumer's 240 registers (ptxas spills); the 64-key block's fit.
 * At 192 the 112-key block spilled beside ALiBi; 96 keys do not, and measured 0-7% faster with
 * and without ALiBi. */
#define FA_SM90_BN_DROPOUT_D256 64
#define FA_SM90_BN_DROPOUT_D192 96

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
 * causal, window, varlen or a block mask; 2 (the rows' choice) also for causal, windowed and
 * block-masked calls over mirrored pairs of tiles (causal ones of at most
 * FA_SM90_PAIRED_MAX_TILES query tiles); 3 over the pairs at any tile count. CONSUMERS: 2, or 3 at head dim 64 without pingpong (192-row
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
    /* Three consumers have 160 registers each: too few for the mods' code (spills), and with
     * dropout too few to overlap the Philox runs (two consumers measured 12-18% faster). */
    if (row.dp == 64 && (key->features & FA_PLAN_LONG) && !mods &&
        !(key->features & FA_FEATURE_DROPOUT))
        row.consumers = 3;
    /* Head dim 128 without varlen, ALiBi, softcap or dropout (those were tuned with the row's
     * pingpong; mods keep the plain call's tile): the consumers free-running measured 0-3%
     * faster on 9 of 10 rows of 1k-16k, causal or not, timed in turn with pingpong on. */
    if (row.dp == 128 && dp == dvp &&
        !(key->features &
          (FA_FEATURE_VARLEN | FA_FEATURE_ALIBI | FA_FEATURE_SOFTCAP | FA_FEATURE_DROPOUT)))
        row.pingpong = 0;
    if (row.dp == 256 && (key->features & FA_FEATURE_DROPOUT))
        row.bn = FA_SM90_BN_DROPOUT_D256;
    else if (dp == 192 && dvp == 192 && (key->features & FA_FEATURE_DROPOUT))
        row.bn = FA_SM90_BN_DROPOUT_D192;
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
    /* Softcap's constants folded into its products (FA_SOFTCAP_FOLD; 0-6% faster at d 64 and
     * 128, the same at 256); FLASHATTN_SM90_SOFTCAP_FOLD=0 keeps the unfolded form for A/Bs. */
    const char *fold = getenv("FLASHATTN_SM90_SOFTCAP_FOLD");
    if ((key->features & FA_FEATURE_SOFTCAP) && !(fold && strcmp(fold, "0") == 0))
        fa_plan_define(plan, "FA_SOFTCAP_FOLD", 1);
    fa_plan_define_mods(plan, key);
    /* Every tile (plan->bm rows, plan->bn keys) inside one block of the block mask: the kernel
     * leaves out the per-key lookup of tiles whose blocks differ (FA_BM_MIXED), whose unrolled
     * copies cost NVRTC time at a new mod's first call. (The backward's copy stays: without it
     * ptxas spills more there.) */
    if (key->features & FA_PLAN_BLOCK_MASK)
        fa_plan_define(plan, "FA_BM_ALIGNED",
                       key->bm_q_block > 0 && key->bm_q_block % plan->bm == 0 &&
                           key->bm_kv_block > 0 && key->bm_kv_block % plan->bn == 0);
    /* The mask decided before score_mod (fa_fwd_sm90.cu's fa_mask_bits) only with
     * FLASHATTN_SM90_MASK_FIRST=1: measured slower beside arithmetic score_mods and, since
     * index arithmetic is int, beside a gather too. */
    const char *first = getenv("FLASHATTN_SM90_MASK_FIRST");
    if ((key->features & FA_PLAN_SCORE_MOD) &&
        (key->features & (FA_PLAN_MASK_MOD | FA_PLAN_BLOCK_MASK)) && first &&
        strcmp(first, "1") == 0)
        fa_plan_define(plan, "FA_MOD_MASK_FIRST", 1);
    /* Dropout's Philox runs in the producer warpgroup, its words through a ring in shared memory
     * (fa_fwd_sm90_drop.cuh), only with FLASHATTN_SM90_DROP_RING=1 (or 2: the wait for the
     * previous P V after the softmax, as without dropout), since both forms ran slower than the
     * consumers' own Philox at d 64 and 128: two consumers, no mods, where the ring fits beside
     * the stages. */
    const char *ring = getenv("FLASHATTN_SM90_DROP_RING");
    const int ring_form = ring && ring[0] >= '1' && ring[0] <= '2' && !ring[1] ? ring[0] - '0' : 0;
    if ((key->features & FA_FEATURE_DROPOUT) && !mods && row.consumers == 2 && ring_form &&
        plan->smem + FA_SMEM_FWD90_DROP(plan->bm, plan->bn) <= FA_SMEM_SM90_MAX) {
        plan->smem += FA_SMEM_FWD90_DROP(plan->bm, plan->bn);
        fa_plan_define(plan, "FA_DROP_RING", ring_form);
    }
    return FA_STATUS_OK;
}

/*
 * The sm90 fp8 forward (fa_fwd_sm90_fp8.cu): e4m3 q, k, v, d = dv a multiple of 16 up to 256
 * (padded to 64, 128 or 256), dense or varlen, causal, window, GQA, softcap; 128-row tiles, two
 * stages, pingpong between the consumers, the softmax's order before the P V wait
 * (fa_softmax_order). Dense calls without softcap: 128-key blocks with V transposed by the
 * producer's warps 1 .. 3 (ldmatrix / stmatrix) while thread 0 only loads, by measurement the
 * fastest (fa_sm90_fp8_fast); softcap at d 128 too (by measurement; at d 64 the row below is
 * faster). With varlen, or softcap at d 256, that transpose spills 4-40 bytes of the
 * producer's 24 registers, so those calls take the rows: the whole producer warpgroup's
 * plain-load transpose and the largest key block that compiles without spills (192 at d 64 and
 * 128, 128 at d 256, whose two stages of K, V and V^T fill the 227 KB).
 * Dense calls given the workspace (FA_PLAN_FP8_VT, fa_plan_fp8_vt) have V^T copied in by TMA
 * instead, written ahead of the kernel by fa_fwd_vt: no transpose in the kernel and no raw V
 * in shared memory. FLASHATTN_SM90_FP8_TILE overrides any of these (the A/B). What the kernel
 * cannot do is refused naming the argument: no other family computes fp8 on a CUDA device.
 */
typedef struct fa_plan_row90_fp8 {
    int dp, bn, stages, pingpong, transpose, order;
    int exp2_poly; /* FA_EXP2_POLY: one exponential in n off the MUFU pipe (0: none) */
} fa_plan_row90_fp8;

static const fa_plan_row90_fp8 fa_sm90_fp8_rows[] = {
    {64, 192, 2, 1, 0, 1, 0},  /* Q 8 KB + 2 x (K 12 + Vr 12 + V^T 16) KB = 88 KB */
    {128, 192, 2, 1, 0, 1, 0}, /* Q 16 KB + 2 x (K 24 + Vr 24 + V^T 32) KB = 176 KB */
    {256, 128, 2, 1, 0, 1, 0}, /* Q 32 KB + 2 x (K 32 + Vr 32 + V^T 32) KB = 224 KB */
};

/* Dense calls without softcap at every head dim, with softcap at d 128 (d 256: 224 KB as above). */
static const fa_plan_row90_fp8 fa_sm90_fp8_fast = {0, 128, 2, 1, 1, 1, 0};
/* Dense calls with V^T from the workspace: the longest key block each head dim compiles without
 * spills at, where the per-block costs of the loop (the waits, the row maxima's shuffles, O's
 * rescale) weigh least; by measurement 256 keys at d 64 (+13-22% over 128) and 192 at d 128
 * (+4-6%; 224 within the spread of 128). d 256 fills its registers at 128. */
static const fa_plan_row90_fp8 fa_sm90_fp8_vt_rows[] = {
    {64, 256, 2, 1, 2, 1, 0},  /* Q 8 KB + 2 x (K 16 + V^T 2 x 8) KB = 72 KB */
    {128, 192, 2, 1, 2, 1, 0}, /* Q 16 KB + 2 x (K 24 + V^T 2 x 16) KB = 128 KB */
    {256, 128, 2, 1, 2, 1, 0}, /* Q 32 KB + 2 x (K 32 + V^T 32) KB = 160 KB */
};

/* FLASHATTN_SM90_FP8_TILE=BN,STAGES,PINGPONG[,TRANSPOSE[,ORDER[,EXP2_POLY]]] replaces the row's
 * choice (for an A/B with the benchmark; 128,2,0,0,0 is the first, untuned kernel); a
 * combination the kernel cannot take or shared memory cannot hold is ignored, and so is
 * TRANSPOSE where V^T comes from the workspace (2: it is what the call's arguments decide). */
static void fa_plan_sm90_fp8_override(fa_plan_row90_fp8 *row)
{
    const char *env = getenv("FLASHATTN_SM90_FP8_TILE");
    int bn, stages, pingpong, transpose = row->transpose, order = row->order, poly = 0;
    if (!env || sscanf(env, "%d,%d,%d,%d,%d,%d", &bn, &stages, &pingpong, &transpose, &order,
                       &poly) < 3)
        return;
    if (row->transpose == 2)
        transpose = 2;
    if (bn < 64 || bn > 256 || bn % 32 != 0 || stages < 2 || stages > 8 ||
        (pingpong != 0 && pingpong != 1) ||
        (transpose != 0 && transpose != 1 && row->transpose != 2) ||
        (order != 0 && order != 1) || poly < 0 || poly > 64 ||
        FA_SMEM_FWD90_FP8(128, bn, row->dp, row->dp, stages, transpose != 2) > FA_SMEM_SM90_MAX)
        return;
    row->bn = bn;
    row->stages = stages;
    row->pingpong = pingpong;
    row->transpose = transpose;
    row->order = order;
    row->exp2_poly = poly;
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
    if ((key->features & FA_PLAN_FP8_VT) && (key->features & FA_FEATURE_VARLEN))
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "cu_seqlens_k: the fp8 forward takes V^T from the workspace for "
                            "dense calls only");
    *plan = (fa_plan){0};
    plan->family = "fa_fwd_sm90_fp8.cu";
    snprintf(plan->target, sizeof plan->target, "sm_90a");
    plan->dp = plan->dvp = key->d <= 64 ? 64 : key->d <= 128 ? 128 : 256;
    fa_plan_row90_fp8 row = fa_sm90_fp8_rows[plan->dp / 128];
    const int softcap_fast = (key->features & FA_FEATURE_SOFTCAP) && plan->dp == 128;
    if (!(key->features & FA_FEATURE_VARLEN) &&
        (!(key->features & FA_FEATURE_SOFTCAP) || softcap_fast)) {
        const int dp = row.dp;
        row = fa_sm90_fp8_fast;
        row.dp = dp;
    }
    if (key->features & FA_PLAN_FP8_VT)
        row = fa_sm90_fp8_vt_rows[plan->dp / 128];
    fa_plan_sm90_fp8_override(&row);
    plan->bm = 128;
    plan->bn = row.bn;
    plan->nwarps = 12;
    plan->stages = row.stages;
    plan->persistent = 2;
    plan->threads = 384;
    plan->smem = (unsigned)FA_SMEM_FWD90_FP8(plan->bm, plan->bn, plan->dp, plan->dvp,
                                             plan->stages, row.transpose != 2);
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
    if (row.exp2_poly > 0) /* only then: the other kernels keep their keys */
        fa_plan_define(plan, "FA_EXP2_POLY", row.exp2_poly);
    fa_plan_define_features(plan, key->features, FA_FEATURE_VARLEN | FA_FEATURE_SOFTCAP);
    return FA_STATUS_OK;
}

int fa_plan_fp8_vt(int d, int64_t rows)
{
    const char *env = getenv("FLASHATTN_SM90_FP8_VT");
    if (env && (env[0] == '0' || env[0] == '1'))
        return env[0] == '1';
    return rows >= (d > 128 ? FA_PLAN_FP8_VT_ROWS / 2 : FA_PLAN_FP8_VT_ROWS);
}

fa_status fa_plan_forward(const fa_plan_key *key, fa_plan *plan)
{
    /* fp8 goes to its own family (FLASHATTN_SM90_FP8=0: refused below). */
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

    fa_plan_define_tile(plan, key);
    fa_plan_define(plan, "FA_NWARPS", plan->nwarps);
    fa_plan_define_features(plan, key->features, FA_PLAN_FEATURES);
    /* Only paged kernels carry the define, so dense kernels keep their JIT keys and code. */
    if (key->features & FA_PLAN_PAGED)
        fa_plan_define(plan, "FA_PAGED", 1);
    fa_plan_define_mods(plan, key);
    return FA_STATUS_OK;
}

/* Shared memory per SM of the arch's parts: 228 KB on sm_90 and sm_100, 164 KB on sm_80 and
 * sm_87, 100 KB on the others (sm_86, sm_89, sm_120). */
int fa_plan_sm_smem(int arch)
{
    return arch == 90 || arch == 100 ? 228 * 1024 : arch == 80 || arch == 87 ? 164 * 1024
                                                                               : 100 * 1024;
}
