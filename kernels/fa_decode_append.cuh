/*
 * The append of a KV-cache call's new keys and values (fa_decode.cu): a row written into the
 * cache where the sequence's cache_seqlens puts it (paged or contiguous, fp8 or q's dtype), its
 * key rotated when rotary is on. Used by fa_kv_append and by fa_decode's fused append.
 *
 * Needs fa_decode.cu's FA_DP, FA_DVP, FA_DV_ALL, FA_KV_FP8, fa_decode_cache.cuh and, for fp8
 * caches, fa_decode_fp8.cuh.
 */
#ifndef FA_DECODE_APPEND_CUH
#define FA_DECODE_APPEND_CUH

/* New row s of sequence bi, kv head kh, written by one warp (lane its lane) at cache position
 * cache_seqlens + s, the key rotated when rot_cos is given. */
FA_DEV void fa_kv_append_row(const fa_dkparams *dp, const fa_kvseq *seq, int bi, int kh, int s,
                             int lane)
{
    const fa_i64 pos = seq->len0 + s;
    if (pos >= dp->f.max_sk)
        return;
    fa_i64 blk, row;
    fa_kv_locate(dp, seq, pos, &blk, &row);
    const fa_u16 *kn = (const fa_u16 *)dp->knew + bi * dp->knew_bstride + s * dp->knew_rstride +
                       kh * dp->knew_hstride;
    const fa_u16 *vn = (const fa_u16 *)dp->vnew + bi * dp->vnew_bstride + s * dp->vnew_rstride +
                       kh * dp->vnew_hstride;
    fa_u16 *kc = (fa_u16 *)dp->f.k + blk * dp->f.k_bstride + row * dp->f.k_rstride +
                 kh * dp->f.k_hstride;
    fa_u16 *vc = (fa_u16 *)dp->f.v + blk * dp->f.v_bstride + row * dp->f.v_rstride +
                 kh * dp->f.v_hstride;
    const fa_i64 ro = pos < dp->seqlen_ro ? pos : dp->seqlen_ro - 1;
    const fa_u16 *cr = (const fa_u16 *)dp->rot_cos + ro * dp->cos_rstride;
    const fa_u16 *sr = (const fa_u16 *)dp->rot_sin + ro * dp->sin_rstride;
#if FA_KV_FP8
    (void)kc, (void)vc;
    fa_kv_append_row8(dp, bi, kh, lane, blk, row, kn, vn, cr, sr);
#else
    /* Read the whole row before writing: k may be a view of the cache rows it fills. */
    fa_u16 kv[FA_DP / 32 > 0 ? FA_DP / 32 : 1], vv[FA_DV_ALL / 32 > 0 ? FA_DV_ALL / 32 : 1];
#pragma unroll
    for (int j = 0; j < FA_DP / 32; j++) {
        const int c = j * 32 + lane;
        if (c < dp->f.d)
            kv[j] = dp->rot_cos && c < dp->rotary_dim
                        ? fa_from_float(fa_rotary_elem(kn, c, dp->rotary_dim,
                                                       dp->rotary_interleaved, cr, sr))
                        : kn[c];
    }
#pragma unroll
    for (int j = 0; j < FA_DV_ALL / 32; j++) {
        const int c = j * 32 + lane;
        if (c < dp->f.dv)
            vv[j] = vn[c];
    }
    __syncwarp();
    FA_KV_ROW_STORE(dp, lane, kc, vc, kv, vv);
#endif
}

#endif /* FA_DECODE_APPEND_CUH */
