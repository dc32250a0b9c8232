/*
 * The backward's visits (fa_bwd_common.cuh includes it, both families use it): which query tiles
 * meet a CTA's key block and in which order it tours them, the deterministic mode's turns on a
 * tile's dQ, and the workspace's row index of a (head, sequence).
 */
#ifndef FA_BWD_TOUR_CUH
#define FA_BWD_TOUR_CUH

/* Whether query tile mb and key block nb of a sequence may share a visible pair: the tile's rows
 * see keys [lo(first row), hi(last row)) at most, both edges growing with the row (the rule of
 * FA_RULE_TILE_KEYS). The same
 * predicate decides which tiles a CTA visits and, in deterministic mode, how many other key
 * blocks add to a tile before this one (fa_bwd_later), so the two always agree. */
FA_DEV int fa_bwd_meets(const fa_kparams *kp, const fa_seq *s, int mb, int nb)
{
    const int m0 = mb * FA_BM;
    if (m0 >= s->sq || nb * FA_BN >= s->sk)
        return 0;
    const int m_last = fa_min(m0 + FA_BM, s->sq) - 1;
    int lo_first, hi_first, lo_last, hi_last;
    fa_key_range(kp, m0, s->sq, s->sk, &lo_first, &hi_first);
    fa_key_range(kp, m_last, s->sq, s->sk, &lo_last, &hi_last);
    const int n0 = nb * FA_BN;
    return lo_first < hi_last && n0 < hi_last && n0 + FA_BN > lo_first;
}

/* The number of key blocks after nb that meet query tile mb, which nb meets. By fa_bwd_meets, n
 * meets the tile iff n0 < hi_last and n0 + FA_BN > lo_first (the tile being nonempty): for n > nb
 * the second holds since it holds for nb, so they are nb + 1 .. (hi_last - 1) / FA_BN (hi_last
 * <= sk keeps them inside the sequence). */
FA_DEV int fa_bwd_later(const fa_kparams *kp, const fa_seq *s, int mb, int nb)
{
    int lo, hi;
    fa_key_range(kp, fa_min(mb * FA_BM + FA_BM, s->sq) - 1, s->sq, s->sk, &lo, &hi);
    return (hi - 1) / FA_BN - nb;
}

/* Moves (h, mb) to the first query tile at or after it, in visiting order (the heads of the
 * group in turn, each head's tiles in increasing order), that meets key block nb; h becomes
 * h_end when none is left. Whether a tile meets the block does not depend on the head, so a head
 * scanned from tile 0 without a meeting tile ends the search. */
FA_DEV void fa_bwd_next(const fa_bkparams *bp, const fa_seq *s, int nb, int h_end, int *h,
                        int *mb)
{
    while (*h < h_end) {
        const int from = *mb;
        while (*mb < bp->m_tiles && !fa_bwd_meets(&bp->f, s, *mb, nb))
            (*mb)++;
        if (*mb < bp->m_tiles)
            return;
        *h = from == 0 ? h_end : *h + 1;
        *mb = 0;
    }
}

/* fa_bwd_next's mirror: (h, mb) to the first query tile at or before it, each head's tiles in
 * decreasing order, that meets key block nb; h becomes h_end when none is left. in_run: the
 * tile above (h, mb) met the block. The tiles that meet a block are one run (both edges of a
 * row's keys grow with the row), so a step out of the run's low end ends the head at once
 * rather than walking on down to tile 0, ~2nb tests of fa_bwd_meets for a causal item. */
FA_DEV void fa_bwd_prev(const fa_bkparams *bp, const fa_seq *s, int nb, int h_end, int *h,
                        int *mb, int in_run)
{
    while (*h < h_end) {
        const int from = *mb;
        while (*mb >= 0 && !fa_bwd_meets(&bp->f, s, *mb, nb))
            *mb = in_run ? -1 : *mb - 1;
        if (*mb >= 0)
            return;
        *h = from == bp->m_tiles - 1 ? h_end : *h + 1;
        *mb = bp->m_tiles - 1;
        in_run = 0;
    }
}

/* ld.acquire.gpu: a load that orders this thread's later accesses after it (the counter read
 * before the dQ adds of deterministic mode). */
FA_DEV int fa_load_acquire(const int *p)
{
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

/* Deterministic mode's counter of query tile mb of (head h, sequence bi): the key blocks that
 * have added their dQ to the tile (fa_bwd_pre zeroes it). */
FA_DEV int *fa_bwd_sem(const fa_bkparams *bp, int bi, int h, int mb)
{
#ifdef FA_BWD_INDEX_UNSIGNED
    /* in 32 bits (a count of query tiles, far below 2^32): see fa_bwd_row0 */
    return bp->sem + (fa_u32)((bi * bp->f.h + h) * bp->m_tiles + mb);
#else
    return bp->sem + ((fa_i64)bi * bp->f.h + h) * bp->m_tiles + mb;
#endif
}

/* Deterministic mode, one thread of the CTA of key block nb: waits for query tile mb's turn,
 * until every later key block that meets the tile has added its dQ (the counter at sem). */
FA_DEV void fa_bwd_turn_wait(const fa_kparams *kp, const fa_seq *s, int mb, int nb,
                             const int *sem)
{
    const int later = fa_bwd_later(kp, s, mb, nb);
    while (fa_load_acquire(sem) != later)
        __nanosleep(64);
}

/* First row of (head h, sequence bi) in the workspace's per-row arrays (lse * log2 e, D) and,
 * times FA_DP, its first element of the dQ accumulator: m_tiles * FA_BM rows per sequence. */
FA_DEV fa_i64 fa_bwd_row0(const fa_bkparams *bp, int h, int bi)
{
#ifdef FA_BWD_INDEX_UNSIGNED
    /* For a family whose loops leave no register to hold a product of parameters or their sign
     * words: mul.wide.u32, the 64-bit product of two unsigned 32-bit factors (all are
     * non-negative), in asm so that the compiler cannot regroup m_tiles * FA_BM out of the loop
     * and hold it there. */
    unsigned long long r;
    asm("mul.wide.u32 %0, %1, %2;"
        : "=l"(r)
        : "r"((fa_u32)(h * bp->f.b + bi)), "r"((fa_u32)bp->m_tiles));
    return (fa_i64)(r * FA_BM);
#else
    return ((fa_i64)h * bp->f.b + bi) * bp->m_tiles * FA_BM;
#endif
}

#endif
