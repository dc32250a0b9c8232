/*
 * The decode kernels' stores of a CTA's result (fa_decode.cu, fa_decode_wg.cu): a row of O with
 * one split, or a split's fp32 partial for fa_combine.cu.
 *
 * Needs the kernel's FA_OT, FA_VEC, FA_KV_FP8 (and fa_decode_fp8.cuh with it), FA_OCOL and
 * fa_dkparams.
 */
#ifndef FA_DECODE_STORE_CUH
#define FA_DECODE_STORE_CUH

/* Row half hf of this thread's O (FA_OT C fragments of 8 columns: columns vc0 .. of v, dvs of
 * them live) times scale, for query row qi (qrow in q, out and lse) and head hh of sequence bi:
 * with one split into out and, where lse_writer, lse; with several into this split's partial
 * (normalised O, natural lse) in the workspace. Every lane of the warp calls it (the 16-byte
 * stores trade columns in the quad); live gates the stores. */
FA_DEV void fa_decode_store(const fa_dkparams *dp, const float o[FA_OT][4], int hf, int t,
                            float scale, float lse, int live, int bi, int qi, fa_i64 qrow, int hh,
                            int vc0, int dvs, int split, int lse_writer)
{
    const fa_kparams *kp = &dp->f;
    if (dp->splits == 1) {
        fa_u16 *og = (fa_u16 *)kp->out + bi * kp->o_bstride + qrow * kp->o_rstride +
                     hh * kp->o_hstride + vc0;
#if FA_KV_FP8
        fa_decode_store_row8(og, dvs, o, hf, t, scale, live);
#elif FA_VEC
        fa_store_row16(og, dvs, o, 8 * FA_OT, hf, t, scale, live);
#else
        if (live)
#pragma unroll
            for (int ot = 0; ot < FA_OT; ot++)
                fa_store_pair(og, ot * 8 + 2 * t, dvs, o[ot][2 * hf] * scale,
                              o[ot][2 * hf + 1] * scale);
#endif
        if (live && kp->lse && t == 0 && lse_writer)
            kp->lse[bi * kp->lse_bstride + hh * kp->lse_hstride + qrow * kp->lse_rstride] = lse;
    } else if (live) {
        float *oa = dp->oaccum + split * dp->oaccum_sstride + bi * dp->oaccum_bstride +
                    qi * dp->oaccum_rstride + hh * dp->oaccum_hstride + vc0;
#pragma unroll
        for (int ot = 0; ot < FA_OT; ot++)
#pragma unroll
            for (int e = 0; e < 2; e++)
                if (FA_OCOL(ot, t, e) < dvs)
                    oa[FA_OCOL(ot, t, e)] = o[ot][2 * hf + e] * scale;
        if (t == 0 && lse_writer)
            dp->lseaccum[split * dp->lseaccum_sstride + bi * dp->lseaccum_bstride +
                         qi * dp->lseaccum_rstride + hh * dp->lseaccum_hstride] = lse;
    }
}

#endif /* FA_DECODE_STORE_CUH */
