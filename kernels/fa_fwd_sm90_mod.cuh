/*
 * User-defined scoring in the Hopper forward (kernels/fa_fwd_sm90.cu includes it after its tile
 * defines and fa_mod.cuh): the mask test of one key, and the block mask's per-tile list of the
 * key blocks to visit.
 *
 * Block mask: the producer and the consumers must walk the same key blocks, and the producer
 * runs a tile ahead of the consumers. So the producer warpgroup's second warp (the list builder)
 * builds each tile's block-state table and the list of the key blocks it does not skip, last
 * first, each with its state, in one of two shared buffers (tiles alternate), and arrives on the
 * buffer's "full" mbarrier; the loading thread (the producer's thread 0) and the consumers wait
 * on it, walk the list (the consumers also read the table for FA_BM_MIXED keys) and release the
 * buffer on its "empty" mbarrier after the tile. Builder and loader are different warps so that
 * neither holds the other's state in the producer's 24 registers.
 * A buffer (FA_SMEM_FWD90_BM_BUF, fa_smem.h): the count (int), the list (int, block << 2 |
 * state, up to ceil(max_sk / FA_BN) entries), the table (bytes, FA_SMEM_FWD90_BM_QB query blocks
 * by bm_nk key blocks, as fa_bm_load lays out one head's).
 */
#ifndef FA_FWD_SM90_MOD_CUH
#define FA_FWD_SM90_MOD_CUH

#if FA_BLOCK_MASK
#if FA_VARLEN
#error "fa_fwd_sm90.cu: block masks are for dense calls (the plan routes varlen ones elsewhere)"
#endif

/* A tile's block-mask buffer: where its count, list and table are. */
typedef struct fa_bm_buf {
    int *count;
    int *list;
    unsigned char *tab;
} fa_bm_buf;

/* The bytes of a buffer and the most entries of its list. */
FA_DEV int fa_bm_buf_bytes(const fa_kparams *kp)
{
    return FA_SMEM_FWD90_BM_BUF(FA_BM, FA_BN, kp->bm_q_block, kp->bm_nk, kp->max_sk);
}
FA_DEV int fa_bm_list_max(const fa_kparams *kp) { return (int)((kp->max_sk + FA_BN - 1) / FA_BN); }

/* Buffer i (0, 1) of the two at `base` (a generic pointer to shared), from fa_bm_buf_bytes and
 * fa_bm_list_max. */
FA_DEV fa_bm_buf fa_bm_buf_at(unsigned char *base, int i, int bytes, int list_max)
{
    fa_bm_buf b;
    b.count = (int *)(base + i * bytes);
    b.list = b.count + 1;
    b.tab = (unsigned char *)(b.list + list_max);
    return b;
}

/* The block mask's query blocks [qb0, qb0 + nqb) of the tile of rows [m0, m_last]. */
FA_DEV void fa_bm_tile_qbs(const fa_kparams *kp, int m0, int m_last, int *qb0, int *nqb)
{
    *qb0 = m0 / kp->bm_q_block;
    *nqb = m_last / kp->bm_q_block - *qb0 + 1;
}

/* One list's blocks (partial or full: st) into the table, query block by query block: num and
 * idx at the first query block's count and list, tab at its row. Int offsets (the launcher
 * keeps the tensors within 2^30 elements, fa_cuda_forward_bm_int): the list builder has few
 * registers. */
FA_DEV void fa_bm_load_list(const int *num, const int *idx, int num_qs, int idx_qs, int idx_js,
                            int n, int nq, unsigned char *tab, int nkb, unsigned char st,
                            int lane)
{
#pragma unroll 1
    for (int q = 0; q < nq; q++) {
        const int c = fa_min(num[q * num_qs], n);
#pragma unroll 1
        for (int j = lane; j < c; j += 32) {
            const int kb = idx[q * idx_qs + j * idx_js];
            if ((unsigned)kb < (unsigned)nkb)
                tab[q * nkb + kb] = st;
        }
    }
}

/* fa_bm_load for one warp (the list builder): the states of head h's query blocks
 * [qb0, qb0 + nq) over every key block into tab, [q * bm_nk + kb]: skipped, then the partial
 * list's blocks, then the full list's over them. */
FA_DEV void fa_bm_load_warp(const fa_kparams *kp, unsigned char *tab, int bi, int h, int qb0,
                            int nq, int lane)
{
    const int nkb = kp->bm_nk;
#pragma unroll 1
    for (int i = lane; i < nq * nkb; i += 32)
        tab[i] = FA_BM_SKIP;
    __syncwarp();
    const fa_i64 *ns = kp->bm_num_stride, *is = kp->bm_idx_stride;
    fa_bm_load_list(kp->bm_num + (bi * (int)ns[0] + h * (int)ns[1] + qb0 * (int)ns[2]),
                    kp->bm_idx + (bi * (int)is[0] + h * (int)is[1] + qb0 * (int)is[2]),
                    (int)ns[2], (int)is[2], (int)is[3], kp->bm_n, nq, tab, nkb, FA_BM_PARTIAL,
                    lane);
    __syncwarp();
    if (kp->bm_full_num) {
        ns = kp->bm_full_num_stride;
        is = kp->bm_full_idx_stride;
        fa_bm_load_list(kp->bm_full_num + (bi * (int)ns[0] + h * (int)ns[1] + qb0 * (int)ns[2]),
                        kp->bm_full_idx + (bi * (int)is[0] + h * (int)is[1] + qb0 * (int)is[2]),
                        (int)ns[2], (int)is[2], (int)is[3], kp->bm_full_n, nq, tab, nkb,
                        FA_BM_FULL, lane);
        __syncwarp();
    }
}

/* fa_bm_state (fa_mod.cuh) with its loops kept rolled, for the list builder's few registers. */
FA_DEV int fa_bm_state90(const fa_kparams *kp, const unsigned char *tab, int nqb, int n0, int sk)
{
    const int kb0 = n0 / kp->bm_kv_block, kb1 = (fa_min(n0 + FA_BN, sk) - 1) / kp->bm_kv_block;
    const int first = tab[kb0];
#pragma unroll 1
    for (int q = 0; q < nqb; q++)
#pragma unroll 1
        for (int kb = kb0; kb <= kb1; kb++)
            if (tab[q * kp->bm_nk + kb] != first)
                return FA_BM_MIXED;
    return first;
}

/*
 * The list builder's part of a tile with key blocks [n_max - n_blocks, n_max): waits until the
 * consumers and the loading thread released buffer b (its use two tiles back: round), fills it
 * (table, then the list of the blocks the mask keeps, last first) and returns the count, which
 * fa_bm_publish then publishes. Every lane of the warp calls both.
 */
FA_DEV int fa_bm_fill(const fa_kparams *kp, fa_bm_buf b, fa_u32 empty, int round, int bi, int h,
                      int m0, int m_last, int n_max, int n_blocks, int sk, int lane)
{
    fa_mbar_wait(empty, ((round >> 1) & 1) ^ 1);
    int qb0, nqb;
    fa_bm_tile_qbs(kp, m0, m_last, &qb0, &nqb);
    fa_bm_load_warp(kp, b.tab, bi, h, qb0, nqb, lane);
    int count = 0;
#pragma unroll 1
    for (int base = 0; base < n_blocks; base += 32) {
        const int it = base + lane, n = n_max - 1 - it;
        const int st = it < n_blocks ? fa_bm_state90(kp, b.tab, nqb, n * FA_BN, sk) : FA_BM_SKIP;
        const fa_u32 keep = __ballot_sync(0xffffffffu, st != FA_BM_SKIP);
        if (st != FA_BM_SKIP)
            b.list[count + __popc(keep & ((1u << lane) - 1u))] = (n << 2) | st;
        count += __popc(keep);
    }
    return count;
}

/* The count into buffer b, then every lane arrives on its "full" mbarrier. */
FA_DEV void fa_bm_publish(fa_bm_buf b, fa_u32 full, int count, int lane)
{
    if (lane == 0)
        *b.count = count;
    __syncwarp();
    fa_mbar_arrive(full);
}
#endif

#endif /* FA_FWD_SM90_MOD_CUH */
