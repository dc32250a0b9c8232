/*
 * Pieces of the Hopper forward shared by its bf16/fp16 kernel (fa_fwd_sm90.cu) and its fp8 one
 * (fa_fwd_sm90_fp8.cu): stage releases, O's rescale and the work tiles. Included after
 * fa_sm90.cuh by a kernel that defines FA_BM, FA_BN, FA_OACC and FA_VARLEN.
 */
#ifndef FA_FWD_SM90_TILE_CUH
#define FA_FWD_SM90_TILE_CUH

#include "fa_mod_flags.h"
#include "fa_sm90.cuh"

/* This warp is done with a stage's K or V (the wgmma reading it finished): one arrival per warp. */
FA_DEV void fa_stage_release(fa_u32 bar, int lane)
{
    __syncwarp();
    if (lane == 0)
        fa_mbar_arrive(bar);
}

FA_DEV void fa_o_rescale(float *o, const float alpha[2])
{
#pragma unroll
    for (int j = 0; j < FA_OACC; j++)
        o[j] *= alpha[(j >> 1) & 1];
}

/* ---- tiles ---------------------------------------------------------------------------------- */

/* One work tile: FA_BM query rows of one (sequence, head) and the key blocks they see. */
typedef struct fa_tile {
    int m0, h, bi, hk;
    int n_max, n_blocks; /* key blocks n_max - n_blocks .. n_max - 1, visited last first */
    int sq, sk;          /* the sequence's queries and keys */
    int q_start, k_start; /* its first rows in q and k (varlen; 0 otherwise) */
#if FA_BLOCK_MASK
    /* The block mask (fa_fwd_sm90_mod.cuh): n_blocks then counts the blocks it keeps, listed
     * in bm_list, last first; bm_tab holds their states key block by key block. */
    const int *bm_list;
    const unsigned char *bm_tab;
#endif
} fa_tile;

/*
 * The work units of the grid, head-major (the CTAs running at once share a head's K and V in L2):
 *   unpaired: unit t is query tile m_blocks - 1 - t % m_blocks of (head, sequence) t / m_blocks,
 *     the heavy (late, under causal) tiles of a head first;
 *   paired: unit t is the mirrored pair of tiles m_blocks - 1 - j and j, j = t % ceil(m_blocks /
 *     2), of (head, sequence) t / ceil(m_blocks / 2): under causal or a window their work adds to
 *     about the same for every pair, so persistent CTAs striding over the units stay balanced.
 * fa_unit_tile gives part `half` (0, 1) of unit t: its (head, sequence) and query tile, or -1 when
 * the unit has no such part (unpaired units have one; the middle of an odd m_blocks is alone).
 */
FA_DEV int fa_units(int paired, int m_blocks, const fa_kparams *kp)
{
    return (paired ? (m_blocks + 1) / 2 : m_blocks) * kp->h * kp->b;
}

FA_DEV int fa_unit_tile(int paired, int m_blocks, int t, int half, int *hb)
{
    const int per = paired ? (m_blocks + 1) / 2 : m_blocks;
    *hb = t / per;
    const int j = t - *hb * per;
    if (half == 0)
        return m_blocks - 1 - j;
    return paired && j != m_blocks - 1 - j ? j : -1;
}

/* Query tile m_block of (head, sequence) hb. */
FA_DEV fa_tile fa_tile_get(const fa_kparams *kp, int hb, int m_block)
{
    fa_tile w;
    w.m0 = m_block * FA_BM;
    w.h = hb % kp->h;
    w.bi = hb / kp->h;
    w.hk = w.h / (kp->h / kp->hk);
    /* The host checked that total_q and total_k fit TMA's int coordinates. */
    const fa_seq seq = fa_seq_get(kp, w.bi, FA_VARLEN);
    w.sq = seq.sq;
    w.sk = seq.sk;
    w.q_start = (int)seq.q_start;
    w.k_start = (int)seq.k_start;
    w.n_max = w.n_blocks = 0;
    if (w.m0 >= w.sq)
        return w; /* past this sequence's queries (varlen): nothing to compute or write */
    /* The key blocks any row of the tile sees. */
    int k_lo, k_hi;
    fa_tile_keys(kp, w.m0, fa_min(w.m0 + FA_BM, w.sq) - w.m0, w.sq, w.sk, &k_lo, &k_hi);
    const int n_min = k_lo / FA_BN;
    w.n_max = k_hi > k_lo ? (k_hi + FA_BN - 1) / FA_BN : n_min;
    w.n_blocks = w.n_max - n_min;
    return w;
}

#endif /* FA_FWD_SM90_TILE_CUH */
