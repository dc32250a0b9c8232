/*
 * User-defined scoring in the sm80 backward (kernels/fa_bwd_sm80.cu, for plans that define
 * FA_SCORE_MOD, FA_MASK_MOD or FA_BLOCK_MASK): the transposed frame's view of the mods, read by
 * fa_bwd_probs (fa_bwd_common.cuh) element by element. The forward's rules, replayed on S^T:
 * the score in base 2 as fa_fwd_sm80.cu makes it (scale, softcap, ALiBi, then score_mod by
 * fa_score_mod_base2), a key that mask_mod or the block mask drops invisible, and score_mod's
 * derivative with respect to the score (fa_score_mod_grad, emitted from the program by the rules
 * the CPU uses) multiplied into dS. The block mask's states of the CTA's key blocks over every
 * query block come from fa_bm_load (fa_mod.cuh).
 */
#ifndef FA_BWD_MOD_CUH
#define FA_BWD_MOD_CUH

#define FA_BWD_MODS 1

/* A family that defines FA_BWD_MASK_BITS (its tiles FA_BM queries by 16 keys a warp) has the
 * mods' keep decisions of a tile made at once, before fa_bwd_probs (fa_bwd_mod_keep_bits). */
#ifndef FA_BWD_MASK_BITS
#define FA_BWD_MASK_BITS 0
#endif
#define FA_BWD_MASK_WORDS ((FA_BM / 2 + 31) / 32)

/* The mods' view of one query tile, for fa_bwd_probs. */
typedef struct fa_bwd_mod_tile {
    int bi, h; /* the programs' b and h */
#if FA_MOD_MASKS
    int on; /* some key of the tile needs fa_bwd_mod_keep */
    int st; /* the tile's state over its query and key blocks (FA_BM_*) */
#endif
#if FA_BLOCK_MASK
    const unsigned char *tab; /* this head's states [nq][nkb] of fa_bm_load */
    int nq, nkb, kb0;
#endif
#if FA_MOD_MASKS && FA_BWD_MASK_BITS
    fa_u32 kept[FA_BWD_MASK_WORDS]; /* fa_bwd_mod_keep_bits' */
#endif
} fa_bwd_mod_tile;

#if FA_MOD_MASKS
/* Whether the mods keep key col for query row (window aside), by the block mask's entry where
 * the tile's blocks differ (FA_BM_MIXED), then mask_mod where the block is partial. Rows and keys
 * past the sequence (invisible anyway) read the table's last entries. */
FA_DEV bool fa_bwd_mod_keep(const fa_kparams *kp, const fa_bwd_mod_tile *md, int row, int col)
{
    int st = md->st;
#if FA_BLOCK_MASK
    if (st == FA_BM_MIXED)
        st = md->tab[fa_min(row / kp->bm_q_block, md->nq - 1) * md->nkb +
                     fa_min(col / kp->bm_kv_block - md->kb0, md->nkb - 1)];
    if (st != FA_BM_PARTIAL)
        return st == FA_BM_FULL;
#endif
#if FA_MASK_MOD
    return fa_mask_mod(kp, md->bi, md->h, row, col);
#else
    return true;
#endif
}

/* Whether a tile of state st needs the key-by-key test: skipped (in deterministic mode, whose
 * dQ order visits it), mixed, or partial with a mask_mod to ask. */
FA_DEV int fa_bwd_mod_on(int st)
{
    return st == FA_BM_SKIP || st == FA_BM_MIXED || (FA_MASK_MOD && st == FA_BM_PARTIAL);
}
#endif

#if FA_MOD_MASKS && FA_BWD_MASK_BITS
/* fa_bwd_mod_keep for each of lane (g, t)'s elements of query tile m0 (C layout of S^T: element
 * e of n-tile nt is query m0 + 8 nt + 2t + (e % 2), key key0 + 8 (e / 2)): bit 4 (nt % 8) + e
 * of md->kept[nt / 8], as fa_bwd_keep_bits lays out dropout's. The family makes them while the
 * tensor cores compute S^T and dP^T: asked beside the scores in fa_bwd_probs, a mask_mod's aux
 * reads (hoisted for every element at once) made ptxas spill in the whole loop. The words leave
 * pinned. */
FA_DEV void fa_bwd_mod_keep_bits(const fa_kparams *kp, fa_bwd_mod_tile *md, int m0, int key0,
                                 int t)
{
#pragma unroll
    for (int w = 0; w < FA_BWD_MASK_WORDS; w++)
        md->kept[w] = 0;
    /* As the forward's fa_mask_scores_mods: partly rolled under a block mask (two copies, mixed
     * and partial tiles, few of each); without one, rolled spilled. */
#pragma unroll(FA_BLOCK_MASK ? FA_MOD_KEEP_UNROLL : FA_BM / 8)
    for (int nt = 0; nt < FA_BM / 8; nt++) {
        fa_u32 bits = 0u;
#pragma unroll
        for (int e = 0; e < 4; e++)
            bits |= (fa_u32)fa_bwd_mod_keep(kp, md, m0 + 8 * nt + 2 * t + (e & 1),
                                            key0 + 8 * (e >> 1))
                    << e;
        fa_keep_or_in(md->kept, FA_BWD_MASK_WORDS, nt, bits);
    }
#pragma unroll
    for (int w = 0; w < FA_BWD_MASK_WORDS; w++)
        asm volatile("" : "+r"(md->kept[w])::"memory");
}
#endif

/* The score score_mod is given, in base 2, from x and alibi (fa_bwd_mod_score's). */
FA_DEV float fa_bwd_mod_base2(const fa_kparams *kp, float x, float alibi)
{
    return x * kp->scale_log2 - alibi;
}

#if FA_SCORE_MOD && FA_MOD_AUX_GRAD
/* The captured tensors' gradients from one element (query row, key col; x and alibi as
 * fa_bwd_mod_score's): g, the gradient of score_mod's result (P (dP Z - D), 0 where invisible),
 * times the program's derivative with respect to each value it reads, added at the element
 * read (fa_score_mod_aux_grad; from / to: the held elements of fa_mod_aux_grad_pair, sum the
 * sums of fa_mod_aux_grad_sum, one per read; first / last: the tile's first and last element).
 * Every lane of the warp calls it (its sums may be warp-wide). */
FA_DEV void fa_bwd_mod_aux_grad(const fa_kparams *kp, const fa_bwd_mod_tile *md, float x,
                                float alibi, int row, int col, float g,
                                const fa_mod_aux_held *from, fa_mod_aux_held *to,
                                fa_mod_aux_held *sum, int first, int last)
{
    fa_score_mod_aux_grad(kp, fa_bwd_mod_base2(kp, x, alibi) * FA_LN2, md->bi, md->h, row, col,
                          g, from, to, sum, first, last);
}
#endif

/* The forward's score of query row, key col in base 2 from x (S^T's value, softcapped to
 * tanh when softcap is on: fa_bwd_probs' x), alibi the ALiBi term in base 2 (0 without), or
 * -inf where the mods drop the key (when md->on); deriv takes score_mod's derivative. The
 * element is n-tile nt's e (for fa_bwd_mod_keep_bits' words). */
FA_DEV float fa_bwd_mod_score(const fa_kparams *kp, const fa_bwd_mod_tile *md, float x,
                              float alibi, int row, int col, int nt, int e, float *deriv)
{
    float y = fa_bwd_mod_base2(kp, x, alibi);
#if FA_SCORE_MOD
    /* As the forward (fa_score_mod_base2). For dropped keys too (aux reads are clamped into
     * their tensors): evaluated under no condition, a value the tile's elements share (an aux
     * read indexed by the head) is read once, not once per element. */
    float dmod;
    y = fa_score_mod_base2(kp, y, md->bi, md->h, row, col, &dmod);
#endif
#if FA_MOD_MASKS && FA_BWD_MASK_BITS
    if (md->on && !((md->kept[nt >> 3] >> (4 * (nt & 7) + e)) & 1))
        return -FA_INF;
#elif FA_MOD_MASKS
    if (md->on && !fa_bwd_mod_keep(kp, md, row, col))
        return -FA_INF;
#endif
#if FA_SCORE_MOD
    *deriv *= dmod;
#endif
    (void)row, (void)col, (void)nt, (void)e, (void)deriv;
    return y;
}

#if FA_BLOCK_MASK
FA_DEV void fa_bwd_next(const fa_bkparams *bp, const fa_seq *s, int nb, int h_end, int *h,
                        int *mb); /* fa_bwd_common.cuh */

/* The block mask's view of a CTA: the states of its key blocks kb0 .. kb0 + nkb - 1 over query
 * blocks 0 .. nq - 1 (fa_bm_load), for heads h0 .. h0 + nh - 1 or, nh 1, shared by the
 * group's heads. */
typedef struct fa_bwd_bm {
    const unsigned char *tab;
    int h0, nh, nq, nkb, kb0;
} fa_bwd_bm;

/* The view's numbers live in shared memory ahead of the table (FA_SMEM_BWD80_BM_META bytes), read
 * where used: held in registers over the main loop they made ptxas spill at head dim 256. */
FA_DEV void fa_bwd_bm_put(volatile int *meta, const fa_bwd_bm *bm)
{
    meta[0] = bm->h0, meta[1] = bm->nh, meta[2] = bm->nq, meta[3] = bm->nkb, meta[4] = bm->kb0;
}

FA_DEV fa_bwd_bm fa_bwd_bm_get(const volatile int *meta)
{
    fa_bwd_bm bm;
    bm.tab = (const unsigned char *)meta + FA_SMEM_BWD80_BM_META;
    bm.h0 = meta[0], bm.nh = meta[1], bm.nq = meta[2], bm.nkb = meta[3], bm.kb0 = meta[4];
    return bm;
}

FA_DEV const unsigned char *fa_bwd_bm_head(const fa_bwd_bm *bm, int h)
{
    return bm->tab + (bm->nh > 1 ? h - bm->h0 : 0) * bm->nq * bm->nkb;
}

/* Head h's bits of the (head, query block) rows whose states are not all skipped (bit q % 32
 * of word q / 32), behind the states (FA_SMEM_BWD_BM_LIVE). */
FA_DEV unsigned *fa_bwd_bm_live(const fa_bwd_bm *bm, int h)
{
    unsigned *bits = (unsigned *)(bm->tab + FA_SMEM_BWD_BM_LIVE(bm->nh, bm->nq, bm->nkb));
    return bits + (bm->nh > 1 ? h - bm->h0 : 0) * ((bm->nq + 31) / 32);
}

/* The view of key tile n0 (FA_BN keys) of sequence bi (seq) for query heads h0 .. h0 + g - 1
 * (one table where the mask is shared over heads), its states at meta + FA_SMEM_BWD80_BM_META:
 * its numbers written ahead of them by thread 0, the states loaded by every thread
 * (fa_bm_load, whose barriers publish both). */
FA_DEV fa_bwd_bm fa_bwd_bm_fill(const fa_kparams *kp, volatile int *meta, int bi,
                                const fa_seq *seq, int h0, int g, int n0)
{
    fa_bwd_bm bm;
    bm.tab = (const unsigned char *)meta + FA_SMEM_BWD80_BM_META;
    bm.h0 = h0;
    bm.nh = FA_BM_TABLE_HEADS(kp, g);
    bm.nq = (seq->sq + kp->bm_q_block - 1) / kp->bm_q_block;
    bm.kb0 = n0 / kp->bm_kv_block;
    bm.nkb = (fa_min(n0 + FA_BN, seq->sk) - 1) / kp->bm_kv_block - bm.kb0 + 1;
    if (threadIdx.x == 0)
        fa_bwd_bm_put(meta, &bm);
    fa_bm_load(kp, (unsigned char *)bm.tab, bi, bm.h0, bm.nh, 0, bm.nq, bm.kb0, bm.nkb);
    return bm;
}

/* The live bits from the states (fa_bm_load's), a warp per 32 rows; every thread calls it. */
FA_DEV void fa_bwd_bm_live_make(const fa_bwd_bm *bm)
{
    const int words = (bm->nq + 31) / 32, lane = threadIdx.x & 31;
    unsigned *bits = fa_bwd_bm_live(bm, bm->h0);
    for (int w = threadIdx.x >> 5; w < bm->nh * words; w += FA_THREADS / 32) {
        const int hh = w / words, q = (w - hh * words) * 32 + lane;
        bool live = false;
        for (int k = 0; q < bm->nq && k < bm->nkb; k++)
            live |= bm->tab[(hh * bm->nq + q) * bm->nkb + k] != FA_BM_SKIP;
        const unsigned m = __ballot_sync(0xffffffffu, live);
        if (lane == 0)
            bits[w] = m;
    }
    __syncthreads();
}

/* The highest live query block at or below q, -1 if none (bits: fa_bwd_bm_live). */
FA_DEV int fa_bwd_bm_live_below(const unsigned *bits, int q)
{
    int w = q >> 5;
    unsigned m = bits[w] & (0xffffffffu >> (31 - (q & 31))); /* blocks 32 w .. q */
    while (!m && w > 0)
        m = bits[--w];
    return m ? 32 * w + 31 - __clz(m) : -1;
}

/* The state of query tile mb of head h (sq rows in the sequence) over the CTA's keys. */
FA_DEV int fa_bwd_bm_state(const fa_kparams *kp, const fa_bwd_bm *bm, int h, int mb, int sq)
{
    const int m0 = mb * FA_BM;
    return fa_bm_keys_state(fa_bwd_bm_head(bm, h), bm->nkb, m0 / kp->bm_q_block,
                            (fa_min(m0 + FA_BM, sq) - 1) / kp->bm_q_block);
}

/* fa_bwd_next past the tiles the block mask skips whole; not in deterministic mode, whose dQ
 * order (fa_bwd_later) counts every tile that meets the key block: there they are visited,
 * every key masked. */
FA_DEV void fa_bwd_next_bm(const fa_bkparams *bp, const fa_seq *s, int nb, int h_end, int *h,
                           int *mb, const volatile int *meta)
{
    const fa_bwd_bm view = fa_bwd_bm_get(meta), *bm = &view;
    for (;;) {
        fa_bwd_next(bp, s, nb, h_end, h, mb);
        if (*h >= h_end || bp->deterministic ||
            fa_bwd_bm_state(&bp->f, bm, *h, *mb, s->sq) != FA_BM_SKIP)
            return;
        (*mb)++;
    }
}
#endif

#endif /* FA_BWD_MOD_CUH */
