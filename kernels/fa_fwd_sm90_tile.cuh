/*
 * Pieces of the Hopper forward shared by its bf16/fp16 kernel (fa_fwd_sm90.cu) and its fp8 one
 * (fa_fwd_sm90_fp8.cu): stage releases, O's rescale, the GEMM operands' pins, the pingpong
 * barriers, the softmax's order, the rows' key ranges and the work tiles. Included after
 * fa_sm90.cuh by a kernel that defines FA_BM, FA_BN, FA_SACC, FA_OACC and FA_VARLEN.
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

/* O's rescale where some row of the warp moved its max: elsewhere alpha is exp2(0) = 1 and the
 * multiplies change nothing, so a warp whose rows all kept theirs skips them (one vote). */
FA_DEV void fa_o_rescale_moved(float *o, const float alpha[2])
{
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f))
        fa_o_rescale(o, alpha);
}

/* Pins O and the A fragments of P (`slices` k-steps of 4 registers): before a GEMM group is
 * issued, so that the rescale and the packing are finished before the wgmma.fence (else ptxas
 * inserts its own fence between the wgmma and serialises them); after its wait, so that nothing
 * reads O or reuses P's registers while the wgmma may still be running. */
FA_DEV void fa_operands_pin(float *o, fa_u32 pa[][4], int slices)
{
#pragma unroll
    for (int j = 0; j < FA_OACC; j++)
        FA_PIN(o[j]);
#pragma unroll
    for (int kk = 0; kk < slices; kk++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            FA_PINU(pa[kk][e]);
}

/* Named barriers 1 and 2 order the two consumer warpgroups' GEMMs (pingpong):
 * bar.sync id, 256 waits for the other warpgroup's bar.arrive id, 256 (128 threads each). */
FA_DEV void fa_named_sync(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }
FA_DEV void fa_named_arrive(int id) { asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory"); }

/* A consumer warpgroup's first turn of a tile: the second (cw 1) lets the first go, then each
 * waits for its own barrier (1 + cw; the other's is 2 - cw). */
FA_DEV void fa_pingpong_start(int cw)
{
    if (cw == 1)
        fa_named_arrive(2 - cw);
    fa_named_sync(1 + cw);
}

/* Keeps the softmax ahead of the wait for P_(i-1) V_(i-1). The exp2s touch no register of that
 * GEMM, so ptxas would hoist the wait above them and the softmax would no longer overlap the
 * tensor cores' work; a shared store of the row sums (which every exp2 feeds) is a side effect the
 * wait cannot pass. Every thread writes the same 8 bytes at `scratch`, which nothing reads. */
FA_DEV void fa_softmax_order(fa_u32 scratch, const float row_sum[2])
{
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(scratch), "f"(row_sum[0]),
                 "f"(row_sum[1])
                 : "memory");
}

/* The online softmax's step over a key block's scores (sacc, FA_SACC of them, C layout: score j
 * is in row half (j / 2) % 2), masked ones -inf, in place: each row's new max (over its quad),
 * alpha[hf] the factor its O and sum are rescaled by, sacc <- 2^(s sm - max sm + offset), and
 * row_sum updated. A row with nothing visible yet keeps max -inf and exponentiates against 0.
 * offset is a constant at each call: 0, or the fp8 kernel's 8 (P times 2^8, into e4m3's
 * range). With FA_EXP2_POLY = n > 0, one element in n of each row takes fa_rule_exp2_poly instead of
 * the MUFU's ex2 (an A/B for the fp8 kernel, whose exponentials per tensor-core cycle are twice
 * bf16's). */
#ifndef FA_EXP2_POLY
#define FA_EXP2_POLY 0
#endif
/* Whether a row's element k takes fa_exp2_poly. */
#define FA_EXP2_POLY_AT(k) (FA_EXP2_POLY > 0 && (k) % (FA_EXP2_POLY > 0 ? FA_EXP2_POLY : 1) == 0)
FA_DEV void fa_softmax_rows(float *sacc, float sm, float offset, float row_max[2],
                            float row_sum[2], float alpha[2])
{
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float mx = row_max[hf];
#pragma unroll
        for (int j = 0; j < FA_SACC; j++)
            if (((j >> 1) & 1) == hf)
                mx = fmaxf(mx, sacc[j]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_use = mx == -FA_INF ? 0.f : mx;
        alpha[hf] = fa_exp2((row_max[hf] - m_use) * sm);
        row_max[hf] = mx;
        const float neg = offset != 0.f ? offset - m_use * sm : -m_use * sm;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < FA_SACC; j++)
            if (((j >> 1) & 1) == hf) {
                /* sacc[j] is the row's element (j / 4) * 2 + j % 2 */
                const float x = fmaf(sacc[j], sm, neg);
                sacc[j] = FA_EXP2_POLY_AT((j >> 2) * 2 + (j & 1)) ? fa_rule_exp2_poly(x)
                                                                  : fa_exp2(x);
                sum += sacc[j];
            }
        row_sum[hf] = row_sum[hf] * alpha[hf] + sum;
    }
}

/* A consumer thread's rows r.row0 and r.row0 + 8 (r: its rows' struct): their visible keys
 * r.lo, r.hi, and the bounds of the key blocks that need no mask (from r.lo_max up to r.hi_min).
 * A macro: as a function writing through pointers, it changed the bf16 kernel's schedule. */
#define FA_ROWS_EDGES(kp, r, sq, sk)                                                             \
    do {                                                                                         \
        fa_key_range(kp, (r).row0, sq, sk, &(r).lo[0], &(r).hi[0]);                              \
        fa_key_range(kp, (r).row0 + 8, sq, sk, &(r).lo[1], &(r).hi[1]);                          \
        (r).lo_max = fa_max((r).lo[0], (r).lo[1]);                                               \
        (r).hi_min = fa_min((r).hi[0], (r).hi[1]);                                               \
    } while (0)

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
