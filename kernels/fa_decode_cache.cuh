/*
 * The decode kernel's view of a sequence's keys (fa_decode.cu): where they lie in the cache
 * (contiguous rows, pages through block_table, or a varlen forward's rows), the rotary
 * rotation of new keys and of q. Every index that comes from device memory is clamped into
 * the cache.
 *
 * Needs fa_decode.cu's FA_BN, FA_BM, FA_DP, FA_DV_ALL, FA_PAGED, FA_VARLEN and fa_dkparams.
 */
#ifndef FA_DECODE_CACHE_CUH
#define FA_DECODE_CACHE_CUH

/* Rotary: element c (< rotary_dim) of the row x rotated by the angles in the cos/sin rows:
 * pairs (2t, 2t + 1) interleaved (GPT-J), (t, t + rotary_dim / 2) otherwise (GPT-NeoX). */
FA_DEV float fa_rotary_elem(const fa_u16 *x, int c, int rd, int interleaved, const fa_u16 *cr,
                            const fa_u16 *sr)
{
    const int half = rd >> 1;
    int i0, i1, t;
    if (interleaved) {
        t = c >> 1;
        i0 = 2 * t;
        i1 = 2 * t + 1;
    } else {
        t = c < half ? c : c - half;
        i0 = t;
        i1 = t + half;
    }
    const float x0 = fa_to_float(x[i0]), x1 = fa_to_float(x[i1]);
    const float cs = fa_to_float(cr[t]), sn = fa_to_float(sr[t]);
    return c == i0 ? x0 * cs - x1 * sn : x0 * sn + x1 * cs;
}

/* One warp's store of an appended row read into registers (kv, vv: element j of lane `lane` is
 * column j * 32 + lane) into the cache's key row kc and value row vc, of the same element type;
 * after the whole row was read, as k may view the cache rows it fills. */
#define FA_KV_ROW_STORE(dp, lane, kc, vc, kv, vv)                                                \
    do {                                                                                         \
        _Pragma("unroll") for (int j_ = 0; j_ < FA_DP / 32; j_++) {                             \
            const int c_ = j_ * 32 + (lane);                                                     \
            if (c_ < (dp)->f.d)                                                                  \
                (kc)[c_] = (kv)[j_];                                                             \
        }                                                                                        \
        _Pragma("unroll") for (int j_ = 0; j_ < FA_DV_ALL / 32; j_++) {                         \
            const int c_ = j_ * 32 + (lane);                                                     \
            if (c_ < (dp)->f.dv)                                                                 \
                (vc)[c_] = (vv)[j_];                                                             \
        }                                                                                        \
    } while (0)

FA_DEV fa_i64 fa_clamp64(fa_i64 x, fa_i64 lo, fa_i64 hi) { return x < lo ? lo : x > hi ? hi : x; }

/* Sequence bi's cache: positions [start, end) are its keys, len0 of them there before the
 * append; blk the cache row of a contiguous cache. Every value clamped into the cache. A varlen
 * forward's keys are rows [k_start, k_start + sk) of k (fa_seq_get), whose batch stride the
 * host leaves 0. */
typedef struct fa_kvseq {
    fa_i64 start, end, len0, blk;
    const int *bt;  /* paged: the sequence's row of block_table */
    int last_block; /* paged: the last block id of the cache, and at most INT_MAX */
} fa_kvseq;

/* A KV-cache call's last block id of the cache, at most INT_MAX. */
FA_DEV int fa_kv_last_block(const fa_dkparams *dp)
{
    return (int)(dp->num_blocks - 1 < 0x7fffffff ? dp->num_blocks - 1 : 0x7fffffff);
}

FA_DEV fa_kvseq fa_kvseq_get(const fa_dkparams *dp, int bi)
{
    const fa_i64 cap = dp->f.max_sk;
    fa_kvseq s;
#if FA_VARLEN
    const fa_seq v = fa_seq_get(&dp->f, bi, 1);
    s.start = v.k_start;
    s.end = s.len0 = v.k_start + v.sk;
    s.blk = 0;
#if FA_PAGED /* a paged varlen forward: positions [0, sk) of its block_table row */
    s.bt = dp->block_table + bi * dp->bt_bstride;
    s.last_block = dp->f.last_block;
#else
    s.bt = 0;
    s.last_block = 0;
#endif
    (void)cap;
    return s;
#endif
    if (dp->cache_seqlens) {
        s.len0 = fa_clamp64(dp->cache_seqlens[bi], 0, cap);
        s.end = s.len0 + dp->s_new < cap ? s.len0 + dp->s_new : cap;
    } else {
        s.len0 = cap;
        s.end = cap;
    }
    s.start = dp->leftpad ? fa_clamp64(dp->leftpad[bi], 0, s.end) : 0;
    s.blk = dp->batch_idx ? fa_clamp64(dp->batch_idx[bi], 0, dp->num_blocks - 1) : bi;
    s.bt = dp->block_table ? dp->block_table + bi * dp->bt_bstride : 0;
    s.last_block = fa_kv_last_block(dp);
    return s;
}

/* The page of position pos (< 2^31). */
FA_DEV fa_u32 fa_kv_page(const fa_dkparams *dp, fa_u32 pos)
{
    return fa_div_by(pos, dp->page_mul, dp->page_shift);
}

/* x / g (g = h / hk, the query heads of a kv head) and x / splits, for 0 <= x < 2^31. */
FA_DEV int fa_div_g(const fa_dkparams *dp, int x)
{
    return (int)fa_div_by((fa_u32)x, dp->g_mul, dp->g_shift);
}

FA_DEV int fa_div_splits(const fa_dkparams *dp, int x)
{
    return (int)fa_div_by((fa_u32)x, dp->splits_mul, dp->splits_shift);
}

/* The keys a CTA's packed rows [r0, min(r0 + FA_BM, rows)) see, [klo, khi) of the sequence's n
 * (sq query rows), cut into FA_BN-key blocks, and split `split`'s blocks [nb0, nb1). */
typedef struct fa_decode_range {
    int klo, khi, nb0, nb1;
} fa_decode_range;

FA_DEV fa_decode_range fa_decode_range_get(const fa_dkparams *dp, int r0, int rows, int sq, int n,
                                           int split)
{
    fa_decode_range kr;
    const int q_first = fa_div_g(dp, r0), q_last = (r0 + FA_BM < rows ? r0 + FA_BM : rows) - 1;
    fa_tile_keys(&dp->f, q_first, fa_div_g(dp, q_last) - q_first + 1, sq, n, &kr.klo, &kr.khi);
    const int nblocks = (kr.khi - kr.klo + FA_BN - 1) / FA_BN;
    const int per = fa_div_splits(dp, nblocks + dp->splits - 1);
    kr.nb0 = fa_min(split * per, nblocks);
    kr.nb1 = fa_min(kr.nb0 + per, nblocks);
    return kr;
}

/* The row of position pos (< 2^31) within its page. */
FA_DEV fa_u32 fa_kv_page_row(const fa_dkparams *dp, fa_u32 pos)
{
    return pos - fa_kv_page(dp, pos) * (fa_u32)dp->page_size;
}

/* The cache block of page `page` of a sequence (paged), clamped into the cache. */
FA_DEV int fa_kv_page_block(const fa_kvseq *s, fa_u32 page)
{
    return fa_page_block(s->bt, page, s->last_block);
}

/* The cache block and row of position pos (< 2^31) of sequence s. */
FA_DEV void fa_kv_locate(const fa_dkparams *dp, const fa_kvseq *s, fa_i64 pos, fa_i64 *blk,
                         fa_i64 *row)
{
#if FA_PAGED
    *blk = fa_kv_page_block(s, fa_kv_page(dp, (fa_u32)pos));
    *row = fa_kv_page_row(dp, (fa_u32)pos);
#else
    (void)dp;
    *blk = s->blk;
    *row = pos;
#endif
}

/* Element c (< d) of packed row x (< the rows) of kv head kh's Q tile, rotated where rotary is
 * on; qb is the sequence's first row of q. */
FA_DEV float fa_decode_q_value(const fa_dkparams *dp, const fa_u16 *qb, const fa_kvseq *seq,
                               int x, int c, int g, int kh)
{
    const fa_kparams *kp = &dp->f;
    const int qi = fa_div_g(dp, x), hh = kh * g + x - qi * g;
    const fa_u16 *qrow = qb + qi * kp->q_rstride + hh * kp->q_hstride;
    if (dp->rot_cos && c < dp->rotary_dim) {
        fa_i64 pos = seq->len0 + (dp->rotary_per_row ? qi : 0);
        pos = pos < dp->seqlen_ro ? pos : dp->seqlen_ro - 1;
        return fa_rotary_elem(qrow, c, dp->rotary_dim, dp->rotary_interleaved,
                              (const fa_u16 *)dp->rot_cos + pos * dp->cos_rstride,
                              (const fa_u16 *)dp->rot_sin + pos * dp->sin_rstride);
    }
    return fa_to_float(qrow[c]);
}

#endif /* FA_DECODE_CACHE_CUH */
