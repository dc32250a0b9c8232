/*
 * The decode kernel's merges (fa_decode.cu): of the warps that share a tile's rows, and of the
 * splits of a row tile inside a thread block cluster (dp.cluster_merge, sm_90), which merge
 * their partials through distributed shared memory, by fa_combine.cu's rule, with no
 * workspace and no second launch.
 *
 * Needs fa_decode.cu's FA_DVP, FA_OT, FA_WM, FA_WN, FA_NWARPS, FA_OCOL, fa_smem.h's
 * FA_DECODE_MERGE_STRIDE and fa_common.cuh's cluster helpers.
 */
#ifndef FA_DECODE_MERGE_CUH
#define FA_DECODE_MERGE_CUH

#if FA_WN > 1
/* The FA_WN warps that share a tile's rows (each had its share of every key block) merge into
 * the first of them (wn 0) through the stages' memory at part: the others' O, fp32 [16][FA_MS]
 * each in the C fragments' order (read back by the lanes that hold the same positions), then
 * every warp's max and sum per row [16][2]. FA_MERGE_OB(w, r): warp w's row r. */
#define FA_MERGE_MS FA_DECODE_MERGE_STRIDE(FA_DVP)
#define FA_MERGE_OB(part, w, r) ((part) + (((w) - FA_WM) * 16 + (r)) * FA_MERGE_MS)
#define FA_MERGE_ML(part) ((part) + (FA_NWARPS - FA_WM) * 16 * FA_MERGE_MS)

/* Each warp gives its part (every thread calls it; the parts are complete on return). */
FA_DEV void fa_decode_merge_give(float *part, const float (*o)[4], const float *row_max,
                                 const float *row_sum, int warp, int wn, int g8, int t)
{
    float *ml = FA_MERGE_ML(part);
    __syncthreads(); /* every warp is done with the stages */
    if (wn != 0)
#pragma unroll
        for (int ot = 0; ot < FA_OT; ot++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++)
                *(float2 *)(FA_MERGE_OB(part, warp, g8 + 8 * hf) + ot * 8 + 2 * t) =
                    make_float2(o[ot][2 * hf], o[ot][2 * hf + 1]);
    if (t == 0)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            ml[(warp * 16 + g8 + 8 * hf) * 2] = row_max[hf];
            ml[(warp * 16 + g8 + 8 * hf) * 2 + 1] = row_sum[hf];
        }
    __syncthreads();
}

/* The first warp of the rows (wn 0) weighs every part, its own from its registers, into o,
 * row_max and row_sum (sm: the factor of the maxima's units). */
FA_DEV void fa_decode_merge_take(const float *part, float (*o)[4], float *row_max,
                                 float *row_sum, float sm, int wm, int g8, int t)
{
    const float *ml = FA_MERGE_ML(part);
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float m = -FA_INF;
#pragma unroll
        for (int k = 0; k < FA_WN; k++)
            m = fmaxf(m, ml[((wm + k * FA_WM) * 16 + g8 + 8 * hf) * 2]);
        float l = 0.f, f[FA_WN];
#pragma unroll
        for (int k = 0; k < FA_WN; k++) {
            const int at = ((wm + k * FA_WM) * 16 + g8 + 8 * hf) * 2;
            f[k] = m == -FA_INF ? 0.f : fa_exp2((ml[at] - m) * sm);
            l += f[k] * ml[at + 1];
        }
        row_max[hf] = m;
        row_sum[hf] = l;
#pragma unroll
        for (int ot = 0; ot < FA_OT; ot++) {
            float acc0 = f[0] * o[ot][2 * hf], acc1 = f[0] * o[ot][2 * hf + 1];
#pragma unroll
            for (int k = 1; k < FA_WN; k++) {
                const float2 x = *(const float2 *)(FA_MERGE_OB(part, wm + k * FA_WM, g8 + 8 * hf) +
                                                   ot * 8 + 2 * t);
                acc0 += f[k] * x.x;
                acc1 += f[k] * x.y;
            }
            o[ot][2 * hf] = acc0;
            o[ot][2 * hf + 1] = acc1;
        }
    }
}
#endif

#if __CUDA_ARCH__ >= 900
#define FA_CLUSTER_MAX 16 /* the host's bound on dp->splits under cluster_merge */

/* The split merge inside a cluster (rank = split, dp->splits CTAs): each CTA leaves its partial
 * in its shared memory at part (row r of the tile at r * (FA_DVP + 2): the normalised O of its
 * dv columns, then the natural lse, as fa_combine takes them; holds: this warp has rows r0 +
 * wm * 16 + g8 (+ 8) with o, lse and scale), then after a cluster barrier warp w of rank k
 * merges rows k * FA_NWARPS + w, stepping by the cluster's warps, by fa_combine's rule: lane j
 * reads part j's lse, the warp reduces them, and each lane sums its columns over the parts
 * through the cluster's shared window. The last barrier keeps each CTA's memory until every
 * read of it is done. Every thread of the CTA calls it. */
FA_DEV void fa_decode_merge_cluster(const fa_dkparams *dp, float *part, int holds,
                                    const float (*o)[4], const float *lse_row,
                                    const float *scale_row, int wm, int g8, int t, int bi, int kh,
                                    int r0, int rows, fa_i64 q_start)
{
    const fa_kparams *kp = &dp->f;
    const int stride = FA_DVP + 2, dv = kp->dv, g = dp->g;
    __syncthreads(); /* every warp is done with the shared memory reused here */
    if (holds)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            float *pr = part + (wm * 16 + g8 + 8 * hf) * stride;
#pragma unroll
            for (int ot = 0; ot < FA_OT; ot++)
#pragma unroll
                for (int e = 0; e < 2; e++)
                    if (FA_OCOL(ot, t, e) < dv)
                        pr[FA_OCOL(ot, t, e)] = o[ot][2 * hf + e] * scale_row[hf];
            if (t == 0)
                pr[FA_DVP] = lse_row[hf];
        }
    fa_cluster_sync();

    const int nparts = dp->splits, live = fa_min(FA_BM, rows - r0), lane = threadIdx.x & 31;
    const fa_u32 base = fa_smem_addr(part);
    for (int r = (int)fa_cluster_rank() * FA_NWARPS + (threadIdx.x >> 5); r < live;
         r += nparts * FA_NWARPS) {
        const int x = r0 + r, qi = fa_div_g(dp, x), hh = kh * g + x - qi * g;
        const fa_u32 row_a = base + (fa_u32)(r * stride) * 4;
        /* Lanes past the parts hold an empty one. */
        const float l =
            lane < nparts ? fa_cluster_ld(fa_cluster_map(row_a, lane) + FA_DVP * 4) : -FA_INF;
        const float sink = kp->sinks ? kp->sinks[hh * kp->sinks_stride] : -FA_INF;
        const int has_nan = __any_sync(0xffffffffu, l != l);
        float mx = l != FA_INF && l > sink ? l : sink;
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1)
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, m));
        const int empty = FA_RULE_PART_EMPTY(l, FA_INF);
        float lse, w = 0.f;
        if (has_nan) {
            lse = __int_as_float(0x7fc00000);
        } else if (mx == -FA_INF) {
            lse = dp->empty_lse;
        } else {
            float sum = empty ? 0.f : expf(l - mx);
#pragma unroll
            for (int m = 16; m >= 1; m >>= 1)
                sum += __shfl_xor_sync(0xffffffffu, sum, m);
            lse = mx + logf(sum + FA_RULE_SINK_TERM(kp->sinks != 0, sink, mx, expf));
            w = empty ? 0.f : expf(l - lse);
        }
        /* Every part's weight in every lane (0: empty, or nothing to merge), before the lanes
         * part over the columns. */
        float wk[FA_CLUSTER_MAX];
#pragma unroll
        for (int k = 0; k < FA_CLUSTER_MAX; k++)
            wk[k] = __shfl_sync(0xffffffffu, has_nan ? 0.f : w, k);
        const fa_i64 qrow = q_start + qi;
        fa_u16 *og = (fa_u16 *)kp->out + bi * kp->o_bstride + qrow * kp->o_rstride +
                     hh * kp->o_hstride;
        for (int c = lane; c < dv; c += 32) {
            float acc = has_nan ? lse : 0.f;
#pragma unroll
            for (int k = 0; k < FA_CLUSTER_MAX; k++)
                if (k < nparts) {
                    const float ov = fa_cluster_ld(fa_cluster_map(row_a, k) + c * 4);
                    acc += wk[k] != 0.f ? wk[k] * ov : 0.f;
                }
            og[c] = fa_from_float(acc);
        }
        if (lane == 0 && kp->lse)
            kp->lse[bi * kp->lse_bstride + hh * kp->lse_hstride + qrow * kp->lse_rstride] = lse;
    }
    fa_cluster_sync();
}
#endif

#endif /* FA_DECODE_MERGE_CUH */
