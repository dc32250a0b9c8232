/*
 * The merge of split partials (fa_attention_combine on a device, and the second step of a split
 * KV-cache call): row x of split s holds a normalised output o_s and its log-sum-exp l_s; the
 * merged row is sum_s exp(l_s - L) o_s with L = log(sum_s exp(l_s) + exp(sink)). A partial with
 * l_s = +-inf is empty and never read; a NaN l_s makes the row NaN. One warp per row, splits
 * visited in order, so a fixed split count gives bitwise the same result on every run.
 *
 * Defines: FA_BF16 (16-bit out: 0 fp16, 1 bf16), FA_OUT_F32 (1: out is fp32).
 * Entry point: fa_combine, over b * sq * h rows (4 per CTA of 128 threads).
 */
#include "fa_common.cuh"
#include "fa_dkparams.h"

#define FA_COMBINE_ROWS 4

FA_DEV int fa_lse_empty(float x) { return x == FA_INF || x == -FA_INF; }

extern "C" __global__ void __launch_bounds__(32 * FA_COMBINE_ROWS) fa_combine(const fa_dkparams dp)
{
    const fa_kparams *kp = &dp.f;
    const fa_i64 x = (fa_i64)blockIdx.x * FA_COMBINE_ROWS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const fa_i64 per_b = kp->max_sq * kp->h;
    if (x >= kp->b * per_b)
        return;
    const fa_i64 bi = x / per_b, qi = (x - bi * per_b) / kp->h, hh = x - bi * per_b - qi * kp->h;
    const float *lp = dp.lseaccum + bi * dp.lseaccum_bstride + qi * dp.lseaccum_rstride +
                      hh * dp.lseaccum_hstride;
    const float *op = dp.oaccum + bi * dp.oaccum_bstride + qi * dp.oaccum_rstride +
                      hh * dp.oaccum_hstride;
    const float sink = kp->sinks ? kp->sinks[hh * kp->sinks_stride] : -FA_INF;

    float mx = sink;
    int nan = 0;
    for (int s = lane; s < dp.splits; s += 32) {
        const float l = lp[s * dp.lseaccum_sstride];
        nan |= l != l;
        if (l != FA_INF && l > mx)
            mx = l;
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, m));
        nan |= __shfl_xor_sync(0xffffffffu, nan, m);
    }
    float lse;
    if (nan) {
        lse = __int_as_float(0x7fc00000);
    } else if (mx == -FA_INF) {
        lse = dp.empty_lse;
    } else {
        float sum = 0.f;
        for (int s = lane; s < dp.splits; s += 32) {
            const float l = lp[s * dp.lseaccum_sstride];
            if (!fa_lse_empty(l))
                sum += expf(l - mx);
        }
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1)
            sum += __shfl_xor_sync(0xffffffffu, sum, m);
        sum += FA_RULE_SINK_TERM(kp->sinks != 0, sink, mx, expf);
        lse = mx + logf(sum);
    }
    for (int c = lane; c < kp->dv; c += 32) {
        float acc = 0.f;
        if (nan) {
            acc = lse;
        } else if (mx != -FA_INF) {
            for (int s = 0; s < dp.splits; s++) {
                const float l = lp[s * dp.lseaccum_sstride];
                if (!fa_lse_empty(l))
                    acc += expf(l - lse) * op[s * dp.oaccum_sstride + c];
            }
        }
        const fa_i64 at = bi * kp->o_bstride + qi * kp->o_rstride + hh * kp->o_hstride + c;
#if FA_OUT_F32
        ((float *)kp->out)[at] = acc;
#else
        ((fa_u16 *)kp->out)[at] = fa_from_float(acc);
#endif
    }
    if (kp->lse && lane == 0)
        kp->lse[bi * kp->lse_bstride + hh * kp->lse_hstride + qi * kp->lse_rstride] = lse;
}
