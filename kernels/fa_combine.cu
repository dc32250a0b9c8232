/*
 * The merge of split partials (fa_attention_combine on a device, and the second step of a split
 * KV-cache call): row x of split s holds a normalised output o_s and its log-sum-exp l_s; the
 * merged row is sum_s exp(l_s - L) o_s with L = log(sum_s exp(l_s) + exp(sink)). A partial with
 * l_s = +-inf is empty and its o_s never used; a NaN l_s makes the row NaN. Parts summed in a
 * fixed order, so a fixed split count gives bitwise the same result on every run.
 *
 * Its time is latency, not bandwidth (a few MB of partials at most): each CTA takes
 * FA_COMBINE_COLS columns of a row (more CTAs where rows are few), and a thread keeps
 * 4 FA_COMBINE_UNROLL partial loads in flight instead of one.
 *
 * Defines: FA_BF16 (16-bit out: 0 fp16, 1 bf16), FA_OUT_F32 (1: out is fp32), FA_MAX_SPLITS
 * (flashattn.h's bound on the parts).
 * Entry point: fa_combine, ceil(dv / FA_COMBINE_COLS) CTAs of FA_COMBINE_THREADS threads (both
 * in fa_dkparams.h) per row of the b * sq * h.
 */
#include "fa_common.cuh"
#include "fa_dkparams.h"

#define FA_COMBINE_GROUPS (FA_COMBINE_THREADS / 32) /* warps, for the reductions */
#define FA_COMBINE_CG 16                             /* column groups: 4 columns each */
#define FA_COMBINE_SL (FA_COMBINE_THREADS / FA_COMBINE_CG) /* split lanes: every 8th part */
#define FA_COMBINE_UNROLL 4                          /* parts a thread loads at once */

#if FA_COMBINE_CG * 4 != FA_COMBINE_COLS
#error "fa_combine.cu: 16 column groups of 4 make FA_COMBINE_COLS"
#endif

FA_DEV int fa_lse_empty(float x) { return FA_RULE_PART_EMPTY(x, FA_INF); }

/* The CTA's maximum (op 0) or sum (op 1) of one float per thread, through shared memory red. */
FA_DEV float fa_cta_reduce(float x, int op, float *red)
{
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) {
        const float y = __shfl_xor_sync(0xffffffffu, x, m);
        x = op ? x + y : fmaxf(x, y);
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x >> 5] = x;
    __syncthreads();
    x = red[0];
#pragma unroll
    for (int i = 1; i < FA_COMBINE_GROUPS; i++)
        x = op ? x + red[i] : fmaxf(x, red[i]);
    return x;
}

/* CTA x: row x / ncb (sequence, query row, head), columns FA_COMBINE_COLS (x % ncb) on. Its
 * threads share the parts' weights; then thread (split lane sl, column group cg) sums parts sl,
 * sl + FA_COMBINE_SL, ... of columns cg + 16 i (i < 4), FA_COMBINE_UNROLL parts at a time, and
 * the split lanes' sums are added in shared memory in lane order. */
extern "C" __global__ void __launch_bounds__(FA_COMBINE_THREADS) fa_combine(const fa_dkparams dp)
{
    __shared__ float weight[FA_MAX_SPLITS];
    __shared__ float red[FA_COMBINE_GROUPS];
    __shared__ float part[FA_COMBINE_SL][FA_COMBINE_COLS];
    const fa_kparams *kp = &dp.f;
    const int ncb = (kp->dv + FA_COMBINE_COLS - 1) / FA_COMBINE_COLS;
    const fa_i64 x = blockIdx.x / ncb;
    const int c0 = (int)(blockIdx.x - x * ncb) * FA_COMBINE_COLS;
    const int tid = threadIdx.x, cg = tid % FA_COMBINE_CG, sl = tid / FA_COMBINE_CG;
    const fa_i64 per_b = kp->max_sq * kp->h;
    const fa_i64 bi = x / per_b, qi = (x - bi * per_b) / kp->h, hh = x - bi * per_b - qi * kp->h;
    /* A varlen forward's sequence has its own rows, from row q_start of out and lse. */
    const fa_seq qs = fa_seq_get(kp, (int)bi, kp->cu_seqlens_q != 0);
    if (qi >= qs.sq)
        return;
    const fa_i64 qrow = qs.q_start + qi;
    const float *lp = dp.lseaccum + bi * dp.lseaccum_bstride + qi * dp.lseaccum_rstride +
                      hh * dp.lseaccum_hstride;
    const float *op = dp.oaccum + bi * dp.oaccum_bstride + qi * dp.oaccum_rstride +
                      hh * dp.oaccum_hstride + c0;
    const float sink = kp->sinks ? kp->sinks[hh * kp->sinks_stride] : -FA_INF;
    fa_grid_dependency_wait(); /* the attention ahead of this merge wrote the partials */

    float mx = sink, nan = 0.f;
    for (int s = tid; s < dp.splits; s += FA_COMBINE_THREADS) {
        const float l = lp[s * dp.lseaccum_sstride];
        weight[s] = l;
        nan = l != l ? 1.f : nan;
        if (l != FA_INF && l > mx)
            mx = l;
    }
    mx = fa_cta_reduce(mx, 0, red);
    const int has_nan = fa_cta_reduce(nan, 0, red) != 0.f;
    float lse;
    if (has_nan) {
        lse = __int_as_float(0x7fc00000);
    } else if (mx == -FA_INF) {
        lse = dp.empty_lse;
    } else {
        float sum = 0.f;
        for (int s = tid; s < dp.splits; s += FA_COMBINE_THREADS)
            sum += fa_lse_empty(weight[s]) ? 0.f : expf(weight[s] - mx);
        sum = fa_cta_reduce(sum, 1, red);
        sum += FA_RULE_SINK_TERM(kp->sinks != 0, sink, mx, expf);
        lse = mx + logf(sum);
    }
    /* Each part's weight (0 for an empty one, whose slot is read but multiplied by nothing). */
    for (int s = tid; s < dp.splits; s += FA_COMBINE_THREADS) {
        const float l = weight[s];
        weight[s] = has_nan || mx == -FA_INF || fa_lse_empty(l) ? 0.f : expf(l - lse);
    }
    __syncthreads();
    const int ncols = kp->dv - c0 < FA_COMBINE_COLS ? kp->dv - c0 : FA_COMBINE_COLS;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s0 = sl; s0 < dp.splits; s0 += FA_COMBINE_SL * FA_COMBINE_UNROLL) {
        float o[FA_COMBINE_UNROLL][4];
#pragma unroll
        for (int u = 0; u < FA_COMBINE_UNROLL; u++) {
            const int s = s0 + u * FA_COMBINE_SL;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int c = cg + FA_COMBINE_CG * i;
                o[u][i] = s < dp.splits && c < ncols ? op[s * dp.oaccum_sstride + c] : 0.f;
            }
        }
#pragma unroll
        for (int u = 0; u < FA_COMBINE_UNROLL; u++) {
            const int s = s0 + u * FA_COMBINE_SL;
            const float ws = s < dp.splits ? weight[s] : 0.f;
#pragma unroll
            for (int i = 0; i < 4; i++)
                acc[i] += ws != 0.f ? ws * o[u][i] : 0.f;
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
        part[sl][cg + FA_COMBINE_CG * i] = acc[i];
    __syncthreads();
    for (int c = tid; c < ncols; c += FA_COMBINE_THREADS) {
        float sum = has_nan ? lse : 0.f;
#pragma unroll
        for (int g = 0; g < FA_COMBINE_SL; g++)
            sum += part[g][c];
        const fa_i64 at =
            bi * kp->o_bstride + qrow * kp->o_rstride + hh * kp->o_hstride + c0 + c;
#if FA_OUT_F32
        ((float *)kp->out)[at] = sum;
#else
        ((fa_u16 *)kp->out)[at] = fa_from_float(sum);
#endif
    }
    if (kp->lse && tid == 0 && c0 == 0)
        kp->lse[bi * kp->lse_bstride + hh * kp->lse_hstride + qrow * kp->lse_rstride] = lse;
}
