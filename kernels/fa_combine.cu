/*
 * The merge of split partials (fa_attention_combine on a device, and the second step of a split
 * KV-cache call): row x of split s holds a normalised output o_s and its log-sum-exp l_s; the
 * merged row is sum_s exp(l_s - L) o_s with L = log(sum_s exp(l_s) + exp(sink)). A partial with
 * l_s = +-inf is empty and its o_s never used; a NaN l_s makes the row NaN. Parts summed in a
 * fixed order, so a fixed split count gives bitwise the same result on every run.
 *
 * Its time is latency, not bandwidth (a few MB of partials, just written, in L2): a warp takes
 * FA_COMBINE_COLS columns of a row (a unit) over its share of the parts, with no CTA-wide
 * barrier, and keeps 4 FA_COMBINE_UNROLL loads in flight a thread, the first batch issued
 * before the weights are known. Where parts are many, FA_COMBINE_PART_WARPS warps share a
 * unit's parts and add their sums in warp order.
 *
 * Defines: FA_BF16 (16-bit out: 0 fp16, 1 bf16), FA_OUT_F32 (1: out is fp32), FA_MAX_SPLITS
 * (flashattn.h's bound on the parts).
 * Entry point: fa_combine, FA_COMBINE_THREADS threads a CTA, FA_COMBINE_UNITS_PER_CTA(splits)
 * units a CTA, ceil(dv / FA_COMBINE_COLS) units per row of the b * sq * h (fa_dkparams.h).
 */
#include "fa_common.cuh"
#include "fa_dkparams.h"

#define FA_COMBINE_WARPS (FA_COMBINE_THREADS / 32)
#define FA_COMBINE_CPL (FA_COMBINE_COLS / 32) /* columns a lane: lane + 32 i */
#define FA_COMBINE_UNROLL 4                   /* parts a thread loads at once */

FA_DEV int fa_lse_empty(float x) { return FA_RULE_PART_EMPTY(x, FA_INF); }

/* Parts s0, s0 + stride, ... (FA_COMBINE_UNROLL of them) of this lane's columns; 0 past the
 * parts and the columns. */
FA_DEV void fa_combine_load(float o[FA_COMBINE_UNROLL][FA_COMBINE_CPL], const float *op,
                            fa_i64 sstride, int s0, int stride, int splits, int lane, int ncols)
{
#pragma unroll
    for (int u = 0; u < FA_COMBINE_UNROLL; u++) {
        const int s = s0 + u * stride;
#pragma unroll
        for (int i = 0; i < FA_COMBINE_CPL; i++) {
            const int c = lane + 32 * i;
            o[u][i] = s < splits && c < ncols ? op[s * sstride + c] : 0.f;
        }
    }
}

/* Unit (row x, columns c0 on) of warp w: its pw-th of W part warps sums parts pw, pw + W, ...
 * after every warp of the unit has weighed all the parts itself (cheaper than sharing them). */
extern "C" __global__ void __launch_bounds__(FA_COMBINE_THREADS) fa_combine(const fa_dkparams dp)
{
    __shared__ float weight[FA_COMBINE_WARPS][FA_MAX_SPLITS];
    __shared__ float part[FA_COMBINE_WARPS][FA_COMBINE_COLS];
    const fa_kparams *kp = &dp.f;
    const int splits = dp.splits, W = FA_COMBINE_PART_WARPS(splits);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, pw = warp % W;
    const int ncb = (kp->dv + FA_COMBINE_COLS - 1) / FA_COMBINE_COLS;
    const fa_i64 unit = (fa_i64)blockIdx.x * FA_COMBINE_UNITS_PER_CTA(splits) + warp / W;
    const fa_i64 x = unit / ncb;
    const fa_i64 per_b = kp->max_sq * kp->h;
    if (x >= kp->b * per_b)
        return;
    const int c0 = (int)(unit - x * ncb) * FA_COMBINE_COLS;
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
    const int ncols = kp->dv - c0 < FA_COMBINE_COLS ? kp->dv - c0 : FA_COMBINE_COLS;
    const float sink = kp->sinks ? kp->sinks[hh * kp->sinks_stride] : -FA_INF;
    float *const w = weight[warp];
    fa_grid_dependency_wait(); /* the attention ahead of this merge wrote the partials */

    const int stride = W * FA_COMBINE_UNROLL; /* parts between a thread's batches */
    float o[FA_COMBINE_UNROLL][FA_COMBINE_CPL];
    fa_combine_load(o, op, dp.oaccum_sstride, pw, W, splits, lane, ncols);

    float mx = sink, nan = 0.f;
    for (int s = lane; s < splits; s += 32) {
        const float l = lp[s * dp.lseaccum_sstride];
        w[s] = l;
        nan = l != l ? 1.f : nan;
        if (l != FA_INF && l > mx)
            mx = l;
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, m));
        nan = fmaxf(nan, __shfl_xor_sync(0xffffffffu, nan, m));
    }
    const int has_nan = nan != 0.f;
    float lse;
    if (has_nan) {
        lse = __int_as_float(0x7fc00000);
    } else if (mx == -FA_INF) {
        lse = dp.empty_lse;
    } else {
        float sum = 0.f;
        for (int s = lane; s < splits; s += 32)
            sum += fa_lse_empty(w[s]) ? 0.f : expf(w[s] - mx);
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1)
            sum += __shfl_xor_sync(0xffffffffu, sum, m);
        sum += FA_RULE_SINK_TERM(kp->sinks != 0, sink, mx, expf);
        lse = mx + logf(sum);
    }
    /* Each part's weight (0 for an empty one, whose slot is read but multiplied by nothing). */
    for (int s = lane; s < splits; s += 32) {
        const float l = w[s];
        w[s] = has_nan || mx == -FA_INF || fa_lse_empty(l) ? 0.f : expf(l - lse);
    }
    __syncwarp();

    float acc[FA_COMBINE_CPL];
#pragma unroll
    for (int i = 0; i < FA_COMBINE_CPL; i++)
        acc[i] = 0.f;
    for (int s0 = pw;; s0 += stride) {
#pragma unroll
        for (int u = 0; u < FA_COMBINE_UNROLL; u++) {
            const int s = s0 + u * W;
            const float ws = s < splits ? w[s] : 0.f;
#pragma unroll
            for (int i = 0; i < FA_COMBINE_CPL; i++)
                acc[i] += ws != 0.f ? ws * o[u][i] : 0.f;
        }
        if (s0 + stride >= splits)
            break;
        fa_combine_load(o, op, dp.oaccum_sstride, s0 + stride, W, splits, lane, ncols);
    }
    if (W > 1) {
        /* The unit's part warps' sums, added by its first in warp order. */
#pragma unroll
        for (int i = 0; i < FA_COMBINE_CPL; i++)
            part[warp][lane + 32 * i] = acc[i];
        fa_bar_sync(1 + warp / W, 32 * W); /* the unit's own barrier: 1 + its place */
        if (pw != 0)
            return;
#pragma unroll
        for (int i = 0; i < FA_COMBINE_CPL; i++) {
            acc[i] = part[warp][lane + 32 * i];
            for (int k = 1; k < W; k++)
                acc[i] += part[warp + k][lane + 32 * i];
        }
    }
    const fa_i64 at = bi * kp->o_bstride + qrow * kp->o_rstride + hh * kp->o_hstride + c0;
#pragma unroll
    for (int i = 0; i < FA_COMBINE_CPL; i++) {
        const int c = lane + 32 * i;
        if (c >= ncols)
            continue;
        const float v = has_nan ? lse : acc[i];
#if FA_OUT_F32
        ((float *)kp->out)[at + c] = v;
#else
        ((fa_u16 *)kp->out)[at + c] = fa_from_float(v);
#endif
    }
    if (kp->lse && lane == 0 && c0 == 0)
        kp->lse[bi * kp->lse_bstride + hh * kp->lse_hstride + qrow * kp->lse_rstride] = lse;
}
