/*
 * The append of a KV-cache call's new keys and values (fa_decode.cu): a row written into the
 * cache where the sequence's cache_seqlens puts it (paged or contiguous, fp8 or q's dtype), its
 * key rotated when rotary is on. Used by fa_kv_append and by fa_decode's fused append. The
 * decode kernels' small entry points (fa_kv_append, fa_decode_fill) live here too.
 *
 * Needs the decode kernel's FA_DP, FA_DVP, FA_DV_ALL, FA_KV_FP8, FA_NWARPS, fa_decode_cache.cuh,
 * fa_decode_check.cuh and, for fp8 caches, fa_decode_fp8.cuh.
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

/* The append done by a decode CTA itself (dp.append_fused), before its first copy reads the
 * rows: it writes the new keys and values of its kv head that it will read (keys [k0, k1) of
 * the sequence), and the kv head's first CTA (`every`: row tile 0, split 0) every one of them,
 * so that a row no query sees lands too. A row two CTAs write gets the same bytes from both (the
 * host fuses only where nothing is rotated or k and v do not share bytes with the caches). By
 * every thread (FA_NWARPS warps; warp, lane its own). */
FA_DEV void fa_decode_append_fused(const fa_dkparams *dp, const fa_kvseq *seq, int bi, int kh,
                                   int every, fa_i64 k0, fa_i64 k1, int warp, int lane)
{
    const fa_i64 new0 = seq->len0 - seq->start; /* key index of new row 0 */
    int s_lo = 0, s_hi = dp->s_new;
    if (!every) {
        s_lo = (int)fa_clamp64(k0 - new0, 0, dp->s_new);
        s_hi = (int)fa_clamp64(k1 - new0, s_lo, dp->s_new);
    }
    for (int s = s_lo + warp; s < s_hi; s += FA_NWARPS)
        fa_kv_append_row(dp, seq, bi, kh, s, lane);
    __threadfence_block();
    __syncthreads();
}

/* A decode CTA's start (every thread): the paged capacity check (fa_decode_check.cuh: the first
 * CTA reports; appending CTAs write nothing where a sequence fails it), then the fused append
 * of the keys kr covers; `every` for the kv head's first CTA. */
FA_DEV void fa_decode_start(const fa_dkparams *dp, const fa_kvseq *seq, int bi, int kh, int every,
                            const fa_decode_range *kr, int warp, int lane)
{
#if FA_PAGED && !FA_VARLEN
    const int refused = fa_decode_check_cta(dp, warp, lane);
#else
    const int refused = 0;
#endif
    if (dp->append_fused && dp->s_new > 0 && !refused) {
        const fa_i64 k1 = kr->klo + (fa_i64)kr->nb1 * FA_BN;
        fa_decode_append_fused(dp, seq, bi, kh, every, kr->klo + (fa_i64)kr->nb0 * FA_BN,
                               k1 < kr->khi ? k1 : kr->khi, warp, lane);
    }
}

/* The append as a kernel of its own (where fa_decode does not do it, dp.append_fused 0): a warp
 * per (new row blockIdx.x, kv head blockIdx.y, sequence blockIdx.z). */
extern "C" __global__ void fa_kv_append(const fa_dkparams dp)
{
#if FA_PAGED && !FA_VARLEN
    if (dp.check_ticket) {
        const int first = blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0;
        if (fa_kv_check(&dp, first ? dp.check_report : 0, threadIdx.x))
            return;
    }
#endif
    const fa_kvseq seq = fa_kvseq_get(&dp, blockIdx.z);
    fa_kv_append_row(&dp, &seq, blockIdx.z, blockIdx.y, blockIdx.x, threadIdx.x);
}

#if FA_VARLEN
/* A varlen forward's rows of out and lse outside every sequence: 0 and +inf (fa_fill_outside,
 * one thread per row and head, as the tiled forward's fa_fwd_fill). */
extern "C" __global__ void fa_decode_fill(const fa_dkparams dp) { fa_fill_outside(&dp.f); }
#endif

#endif /* FA_DECODE_APPEND_CUH */
