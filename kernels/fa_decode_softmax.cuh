/*
 * The decode kernels' online softmax over one warp's keys of a block (fa_decode.cu,
 * fa_decode_wg.cu): S in the mma C layout - s[nt][e] is row g8 + 8 (e >> 1) of the warp's 16,
 * key j0 + 8 nt + 2t + (e & 1), FA_NT n-tiles of 8 keys (wgmma's m64 accumulator gives each
 * warp of a warpgroup the same layout) - scaled to base 2 where the features need it, masked to
 * each row's visible keys and turned into P in place.
 *
 * Needs FA_NT, FA_SOFTCAP, FA_ALIBI, fa_common.cuh and fa_decode_cache.cuh.
 */
#ifndef FA_DECODE_SOFTMAX_CUH
#define FA_DECODE_SOFTMAX_CUH

/* A thread's two rows (g8 and g8 + 8 of its warp's 16): their visible keys [lo, hi), query
 * index within the sequence (ALiBi's distance) and slope in base 2. */
typedef struct fa_decode_rows {
    int lo[2], hi[2], q[2];
    float slope_log2[2];
} fa_decode_rows;

/* Rows x0 and x0 + 8 of kv head kh's packed rows (x0 the thread's first; of `rows`, sequence
 * bi of sq query rows and n keys): visible keys, query row and slope; head[hf] the row's query
 * head. A row past the tile's sees every key: its values are never stored, and the unmasked
 * blocks of the live rows then skip the mask. */
FA_DEV fa_decode_rows fa_decode_rows_get(const fa_dkparams *dp, int x0, int rows, int kh, int bi,
                                         int sq, int n, int head[2])
{
    const fa_kparams *kp = &dp->f;
    fa_decode_rows rw;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int x = x0 + 8 * hf;
        rw.q[hf] = fa_div_g(dp, x);
        head[hf] = kh * dp->g + x - rw.q[hf] * dp->g;
        if (x < rows) {
            fa_key_range(kp, rw.q[hf], sq, n, &rw.lo[hf], &rw.hi[hf]);
        } else {
            rw.lo[hf] = 0;
            rw.hi[hf] = n;
        }
        rw.slope_log2[hf] = 0.f;
#if FA_ALIBI
        if (x < rows)
            rw.slope_log2[hf] =
                kp->alibi_slopes[bi * kp->alibi_bstride + head[hf] * kp->alibi_hstride] *
                FA_LOG2E;
#endif
    }
    (void)bi;
    return rw;
}

/* s (the scores of keys j0 .. of a block) -> P = 2^(s sm - m) against the rows' new maxima m,
 * with prescale the scores first in base 2 (scale_log2, softcap's pre-factor, ALiBi's bias;
 * sm is then 1); the mask only where some row of the warp does not see every key of the warp's
 * FA_NT * 8. row_max, row_sum updated, alpha the factor of the rows' earlier O and sums (exactly
 * 1 where a row's maximum did not move). n, sq: the sequence's keys and query rows. */
FA_DEV void fa_decode_softmax(float s[FA_NT][4], const fa_decode_rows *rw, int j0, int t, int n,
                              int sq, int prescale, float sm, float scale_log2, float softcap_pre,
                              float row_max[2], float row_sum[2], float alpha[2])
{
    const int seen_all = j0 >= rw->lo[0] && j0 >= rw->lo[1] && j0 + 8 * FA_NT <= rw->hi[0] &&
                         j0 + 8 * FA_NT <= rw->hi[1];
    const int masked = !__all_sync(0xffffffffu, seen_all);
#pragma unroll
    for (int nt = 0; nt < FA_NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int hf = e >> 1, j = j0 + nt * 8 + 2 * t + (e & 1);
            float x = s[nt][e];
            if (prescale) {
#if FA_SOFTCAP
                x = FA_RULE_SOFTCAP(x, softcap_pre, scale_log2, fa_tanh_fast);
#else
                x *= scale_log2;
#endif
#if FA_ALIBI
                x -= FA_RULE_ALIBI(rw->slope_log2[hf], rw->q[hf] + n - sq - j);
#endif
            }
            s[nt][e] = masked && (j < rw->lo[hf] || j >= rw->hi[hf]) ? -FA_INF : x;
        }
    (void)softcap_pre, (void)n, (void)sq;

    /* A row's values sit in the 4 lanes of a quad. */
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float mx = row_max[hf];
#pragma unroll
        for (int nt = 0; nt < FA_NT; nt++)
            mx = fmaxf(mx, fmaxf(s[nt][2 * hf], s[nt][2 * hf + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float base = mx == -FA_INF ? 0.f : mx * sm;
        alpha[hf] = fa_exp2(row_max[hf] * sm - base);
        row_max[hf] = mx;
        row_sum[hf] *= alpha[hf];
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < FA_NT; nt++) {
            const float p0 = fa_exp2(fmaf(s[nt][2 * hf], sm, -base));
            const float p1 = fa_exp2(fmaf(s[nt][2 * hf + 1], sm, -base));
            sum += p0 + p1;
            s[nt][2 * hf] = p0;
            s[nt][2 * hf + 1] = p1;
        }
        row_sum[hf] += sum;
    }
}

#endif /* FA_DECODE_SOFTMAX_CUH */
