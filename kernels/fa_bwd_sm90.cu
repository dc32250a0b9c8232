/*
 * Backward attention for sm_90a: the sm80 family's algorithm (FA3's transposed frame, the same
 * workspace, the same kernels around the main one, kernels/fa_bwd_rows.cuh) with the main
 * kernel's five products on wgmma and its query tiles brought in by TMA.
 *
 * fa_bwd: work items of (key block of FA_BN = 128 keys, kv head, sequence), one per CTA or, on a
 * persistent grid, claimed in turn from a counter (bp.persistent, src/cuda/fa_cuda_backward.c);
 * 384 threads: a producer warpgroup (one thread issues TMA: K and V of the block once per item,
 * once the consumers released the previous item's, then Q and dO of each query tile the block
 * meets, in its tour's order (fa_bwd_tour), FA_BM = 64 rows (128 at head dim 64), into
 * FA_QSTAGES stages, each with a record of the tour's next tile and the tile's block-mask state,
 * FA_BWD90_REC, so that the consumers find an item's first tile alone) and two consumer
 * warpgroups, each owning 64 of the block's keys. Per query tile, consumer warpgroup cw:
 *   S^T = K_cw Q^T, dP^T = V_cw dO^T      SS wgmma m64nFA_BM (both operands K-major, as TMA wrote
 *                                        them); the accumulators are the sm80 family's C
 *                                        fragments, so fa_bwd_probs makes P^T and dS^T (no
 *                                        softmax scale) from them unchanged
 *   dV_cw += P^T dO, dK_cw += dS^T Q     RS wgmma: P^T and dS^T from registers (the forward's P
 *                                        packing), dO and Q as MN-major B operands
 *   dQ += dS K                           dS^T goes to shared memory (swizzled rows of keys) and is
 *                                        read back as an MN-major A operand, K as MN-major B; each
 *                                        warpgroup computes its share of dQ over all 128 keys (64
 *                                        columns at head dim 128, 64 rows at 64), one tile later,
 *                                        beside the next tile's dK and dV products, so the two
 *                                        warpgroups never wait on each other in step (the named
 *                                        barriers at FA_BAR_OWN); the fp32 result is
 *                                        added to the workspace accumulator, whose order (the sm80
 *                                        family's fragment order) wgmma's accumulator layout
 *                                        matches, and fa_bwd_convert finishes. Each warp's piece
 *                                        is 4 KB contiguous there: the warp writes it to its own
 *                                        shared buffer and one lane adds it with one bulk
 *                                        reduce-add (the registers free at once; per-fragment
 *                                        red.global held the next tile's start until they drained).
 *                                        The deterministic mode adds by red.global in turn.
 * dK, dV stay in registers over every query tile of every query head of the GQA group and are
 * written at the item's end (dK times the softmax scale), after its K and V are released.
 *
 * Defines from the plan (src/plan/fa_plan_backward.c, fa_plan_backward_sm90): FA_BF16, FA_DP = FA_DVP
 * (64 or 128), FA_BM (64; 128 at FA_DP 64), FA_BN 128, FA_ALIBI, FA_SOFTCAP, FA_DROPOUT,
 * FA_VARLEN; FA_SCORE_MOD, FA_MASK_MOD, FA_BLOCK_MASK (and the aux defines) only for calls with
 * user-defined scoring (FLASHATTN_BWD_SM90_MODS=0 keeps those on the sm80 family), with the sm80
 * family's semantics (fa_bwd_mod.cuh: fa_bwd_probs replays the forward's mod'ed scores and multiplies score_mod's
 * derivative into dS), the tile's block-mask state chosen once per tile and passed to
 * fa_bwd_probs as a constant (fa_bwd90_probs_mods), so the per-key test does not branch on it
 * (with score_mod, on the few tiles that are not full it does).
 * A block mask (dense calls): fa_bwd_bm_tables, a kernel before this one, writes each key
 * block's states over every query block of its heads to the workspace; the producer copies the
 * item's behind the item slots with its K and V (on a persistent grid too: the copy is of the
 * item in hand, as K and V are), and the tours pass over the query tiles it skips whole
 * (fa_bwd_tour_bm), but in deterministic mode,
 * whose dQ order visits them, every key masked.
 * bp.deterministic orders each query tile's dQ adds by key block, as the sm80 family does.
 *
 * Varlen: the tensor maps span all the packed rows (batch extent 1) and tiles add their
 * sequence's offset, so a tile's rows or a block's keys past the sequence are the next
 * sequence's: the masks (fa_bwd_probs' rows and keys) give them P = dS = 0. A key block at or
 * past the sequence's keys in use only zeroes its keys' dK and dV, as the sm80 family's.
 *
 * Shared memory (1024-byte aligned; every tile in 128-byte swizzled rows of 64 columns, column
 * blocks one after another, as TMA writes them): K, V [FA_DP / 64][FA_BN][64]; Q, dO
 * [FA_QSTAGES][FA_DP / 64][FA_BM][64]; dS^T [2][FA_BM / 64][FA_BN][64]; dQ pieces, fp32
 * [8 warps][1024] in the accumulator's order; mbarriers kv_full, q_full[FA_QSTAGES],
 * q_empty[FA_QSTAGES], kv_empty; the item slots, int [2], then their sequences' lengths, int
 * [2][2]; with a block mask, the item's states (FA_BWD90_BM_META). Three stages of Q and dO
 * (the plan's FA_QSTAGES) fill the 227 KB to within 2 KB, so the consumers rarely wait for them.
 */
#include "fa_bkparams.h"

#define FA_NCW 2 /* consumer warpgroups */
#define FA_THREADS 384
#define FA_NWARPS 12
#define FA_VEC 1

#include "fa_sm90.cuh"
#include "fa_smem.h"

#include "fa_mod_flags.h"

#if FA_BN != 128 || FA_DP != FA_DVP || (FA_DP != 64 && FA_DP != 128) ||                      \
    FA_BM != (FA_DP == 64 ? 128 : 64) || FA_QSTAGES < 2 || FA_QSTAGES > 3
#error "fa_bwd_sm90.cu: 64 x 128 tiles (128 x 128 at d 64), d = dv of 64 or 128 (padded)"
#endif

/* fa_bwd_probs takes the rows of lse and D from the lanes' registers, and the dropout keep
 * decisions made during the S^T and dP^T products (fa_bwd_common.cuh). */
#define FA_BWD_ROWS_IN_LANES 1
#define FA_BWD_KEEP_BITS 1
#define FA_BWD_MASK_BITS 1
/* At d 64 with dropout alone (or with varlen) the dropout factors held for every element
 * spilled 64 bytes; selecting at each use spills nothing (but more with ALiBi or softcap). */
#define FA_BWD_DROP_SELECT (FA_DP == 64 && FA_DROPOUT && !FA_ALIBI && !FA_SOFTCAP)
#define FA_BWD_CHAIN (FA_SOFTCAP || (FA_DP == 64 && FA_DROPOUT && (FA_ALIBI || FA_VARLEN)) ? 2 : 0)
#if FA_SCORE_MOD || FA_MOD_MASKS
#if FA_BLOCK_MASK && FA_VARLEN
#error "fa_bwd_sm90.cu: block masks are for dense calls (the plan routes varlen ones elsewhere)"
#endif
#include "fa_mod.cuh"
#include "fa_bwd_mod.cuh"
#define FA_BWD_PROBS_SERIAL 1
#endif
#include "fa_bwd_common.cuh"

#define FA_KV_BYTES FA_SMEM_BWD90_KV(FA_BN, FA_DP) /* one of K, V */
#define FA_QT_BYTES FA_SMEM_BWD90_QT(FA_BM, FA_DP) /* one stage of Q or dO */
#define FA_DS_BYTES FA_SMEM_BWD90_DS(FA_BN, FA_BM) /* one dS^T buffer */
#define FA_DQW_BYTES FA_SMEM_BWD90_DQW /* one warp's dQ piece: 16 rows x 64 columns, fp32 */
#define FA_K_BYTES FA_KV_BYTES
#define FA_V_BYTES FA_KV_BYTES
#define FA_Q_BYTES FA_QT_BYTES
#define FA_DO_BYTES FA_QT_BYTES
#include "fa_bwd_sm90.cuh"

#if FA_BWD_MODS
/* fa_bwd_probs with whether its keys need the mods' test (fa_bwd_mod_on of `state`, FA_BM_*) a
 * constant at each call: read per key, it made every key a branch. */
FA_DEV void fa_bwd90_probs_st(const fa_kparams *kp, fa_bwd_tile *tl, int t, float st[][4],
                              float dpt[][4], int state, int masked)
{
#if FA_MOD_MASKS
    tl->mod.on = fa_bwd_mod_on(state);
#endif
    (void)state;
    fa_bwd_probs(kp, tl, t, st, dpt, masked);
}

/* The mods' view of a query tile of head h, sequence bi, in state `state` (the block mask's,
 * from the producer's record; FA_BM_PARTIAL with mask_mod alone), made while the tensor cores
 * compute its S^T and dP^T: the per-key lookup's table where its blocks differ, and the keep
 * decisions (fa_bwd_mod_keep_bits) where some key needs the test. */
FA_DEV void fa_bwd90_mods_view(const fa_kparams *kp, fa_bwd_tile *tl, int t, int bi, int h,
                               int state, const volatile int *slot)
{
    tl->mod.bi = bi;
    tl->mod.h = h;
#if FA_MOD_MASKS
#if FA_BLOCK_MASK
    if (state == FA_BM_MIXED) {
        const fa_bwd_bm bm = fa_bwd_bm_get(FA_BWD90_BM_META(slot));
        tl->mod.tab = fa_bwd_bm_head(&bm, h);
        tl->mod.nq = bm.nq;
        tl->mod.nkb = bm.nkb;
        tl->mod.kb0 = bm.kb0;
    }
#endif
    /* A copy of the test for each state that needs it, the state a constant in each. (The
     * store of the state first, which the copies overwrite, is kept: without it ptxas laid out
     * the loop's registers otherwise and spilled there.) */
    tl->mod.st = state;
    if (FA_BLOCK_MASK && state == FA_BM_MIXED) {
        tl->mod.st = FA_BM_MIXED;
        fa_bwd_mod_keep_bits(kp, &tl->mod, tl->m0, tl->key0, t);
    } else if (FA_MASK_MOD && state == FA_BM_PARTIAL) {
        tl->mod.st = FA_BM_PARTIAL;
        fa_bwd_mod_keep_bits(kp, &tl->mod, tl->m0, tl->key0, t);
    } else {
        /* skipped (deterministic mode): none; full, or partial without mask_mod: every key */
#pragma unroll
        for (int w = 0; w < FA_BWD_MASK_WORDS; w++)
            tl->mod.kept[w] = state == FA_BM_SKIP ? 0u : 0xffffffffu;
    }
#endif
    (void)kp, (void)t, (void)state, (void)slot;
}

/* fa_bwd_probs with the mods for a query tile in state `state` (fa_bwd90_mods_view's): a skipped
 * tile only in deterministic mode (every key masked), partial everywhere with mask_mod alone,
 * full with score_mod alone. With score_mod two copies of its code: one without the bounds and
 * window tests for the tiles that are full both in the block mask and in the lengths and window
 * (`full`), one for the rest (few: the block mask's edges, the sequences' ends), which reads the
 * keep decisions. Full tiles without score_mod take the forms without the mods. */
FA_DEV void fa_bwd90_probs_mods(const fa_kparams *kp, fa_bwd_tile *tl, int t, float st[][4],
                                float dpt[][4], int state, int full)
{
#if FA_BLOCK_MASK
#if FA_SCORE_MOD
    if (state != FA_BM_FULL || !full)
        fa_bwd90_probs_st(kp, tl, t, st, dpt, FA_BM_MIXED, 1);
    else
        fa_bwd90_probs_st(kp, tl, t, st, dpt, FA_BM_FULL, 0);
#else
    /* Two copies: a full tile's keys all kept (the built-in form), and the rest, which reads
     * the keep decisions (every key kept in a full block at an edge; few tiles). A third copy
     * for those edges cost a new mod's first call compile time. */
    if (fa_bwd_mod_on(state) || !full)
        fa_bwd90_probs_st(kp, tl, t, st, dpt, FA_BM_MIXED, 1);
    else
        fa_bwd_probs_as(kp, tl, t, st, dpt, 0, 0);
#endif
#elif FA_MASK_MOD
    fa_bwd90_probs_st(kp, tl, t, st, dpt, FA_BM_PARTIAL, 1);
    (void)state, (void)full;
#else
    /* One form (the masked one) for every tile: a second copy of score_mod's code beside it
     * spilled. */
    fa_bwd90_probs_st(kp, tl, t, st, dpt, 0, 1);
    (void)state, (void)full;
#endif
}
#endif

/* S^T = K Q^T, dP^T = V dO^T: rows of keys and of queries, both with the head dim contiguous
 * (K-major); m64n128 for 128-query tiles. */
FA_DEF_WGMMA_SS(fa_wgmma_kk, 64, FA_RL32, FA_FL32, "%32", "%33", "%34", "0, 0")
FA_DEF_WGMMA_SS(fa_wgmma_kk128, 128, FA_RL64, FA_FL64, "%64", "%65", "%66", "0, 0")
/* dQ = dS K: dS^T rows of keys (queries contiguous) and K rows of keys (columns contiguous),
 * both MN-major. */
FA_DEF_WGMMA_SS(fa_wgmma_tt, 64, FA_RL32, FA_FL32, "%32", "%33", "%34", "1, 1")

/* Named barriers (0 is __syncthreads'). Each warpgroup's dQ product reads both warpgroups' dS^T
 * rows, one tile after they were written; the two meet only through the buffers, so neither
 * waits for the other while it has work of its own (a barrier of both per tile kept them in
 * step, both element-wise at once with the tensor cores idle):
 *   FA_BAR_OWN + cw           warpgroup cw's four warps have written their dS^T rows
 *   FA_BAR_DET                both warpgroups, the deterministic mode's turns
 *   FA_BAR_WRITTEN + 2cw + p  warpgroup cw has written its rows of dS^T buffer p (it arrives,
 *                             the other syncs before its dQ product reads them)
 *   FA_BAR_READ + 2cw + p     warpgroup cw's dQ product has read buffer p (it arrives, the other
 *                             syncs before writing its rows there again)
 * Each arrival is consumed before the same barrier is arrived at again: a buffer is rewritten
 * only after both products read it, and read only after both wrote it. */
#define FA_BAR_OWN 1
#define FA_BAR_DET 3
#define FA_BAR_WRITTEN 4
#define FA_BAR_READ 8

/* Issues S^T = K_cw Q^T (or dP^T = V_cw dO^T) for one query tile: FA_DP / 16 k-steps over the
 * head dim, 32 bytes apart inside a 128-byte row, the next 64-column block after four. */
FA_DEV void fa_gemm_t(float *acc, fa_u64 kv_rows, fa_u64 q_tile)
{
#pragma unroll
    for (int kk = 0; kk < FA_DP / 16; kk++) {
        const fa_u64 da = fa_desc_at(kv_rows, (kk >> 2) * FA_BN * 128 + (kk & 3) * 32);
        const fa_u64 db = fa_desc_at(q_tile, (kk >> 2) * FA_BM * 128 + (kk & 3) * 32);
        if (FA_BM == 128)
            fa_wgmma_kk128(acc, da, db, kk > 0);
        else
            fa_wgmma_kk(acc, da, db, kk > 0);
    }
}

/* Issues acc += A B for A the register fragments a[FA_BM / 16][4] (keys x queries) and B the
 * stage's Q or dO tile as MN-major (query rows, head dim contiguous): FA_BM / 16 k-steps of 16
 * rows (2048 bytes); the n128 form spans both 64-column blocks (LBO: one block). */
FA_DEV void fa_gemm_kv(float *acc, fa_u32 a[][4], fa_u64 tile)
{
#pragma unroll
    for (int kk = 0; kk < FA_BM / 16; kk++)
#if FA_DP == 128
        fa_wgmma_pv128(acc, a[kk], fa_desc_at(tile, kk * 2048));
#else
        fa_wgmma_pv64(acc, a[kk], fa_desc_at(tile, kk * 2048));
#endif
}

/* Adds a warp's dQ piece (the wgmma accumulator dq[8][4], 16 rows x 64 columns) to the fp32
 * accumulator at acc (this lane's first element), whose blocks of 16 rows x 8 columns the
 * accumulator's layout matches. */
FA_DEV void fa_dq_add(float *acc, float dq[8][4])
{
#pragma unroll
    for (int c = 0; c < 8; c++)
        fa_red_add_v4(acc + c * 128, dq[c][0], dq[c][1], dq[c][2], dq[c][3]);
}


/* The same piece added through the warp's shared buffer buf (FA_DQW_BYTES) by one bulk
 * reduce-add to acc_w (the piece's first element): each lane writes its 16-byte runs where the
 * accumulator has them. The wait is for lane 0's previous add to have read the buffer (the
 * other lanes have none to wait for; a branch around it made ptxas spill). */
FA_DEV void fa_dq_add_bulk(float *acc_w, fa_u32 buf, int lane, float dq[8][4])
{
    fa_bulk_wait_read();
    __syncwarp();
#pragma unroll
    for (int c = 0; c < 8; c++)
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(buf + c * 512 + lane * 16),
                     "f"(dq[c][0]), "f"(dq[c][1]), "f"(dq[c][2]), "f"(dq[c][3])
                     : "memory");
    /* The writes, made by the generic proxy, become visible to the bulk copy's async proxy. */
    fa_fence_proxy_async();
    __syncwarp();
    if (lane == 0) {
        fa_bulk_add_f32(acc_w, buf, FA_DQW_BYTES);
        fa_bulk_commit();
    }
}

/* Issues dQ = dS K for this warpgroup's share of a tile (dq[8][4]: 64 rows x 64 columns) from
 * the descriptors of its block of 64 queries of a dS^T buffer (rows of keys) and of K's 64
 * columns (both MN-major), over the block's 128 keys, as one group. */
FA_DEV void fa_dq_issue(float *dq, fa_u64 ds_rows, fa_u64 k_cols)
{
    fa_wg_fence();
#pragma unroll
    for (int kk = 0; kk < FA_BN / 16; kk++)
        fa_wgmma_tt(dq, fa_desc_at(ds_rows, kk * 16 * 128), fa_desc_at(k_cols, kk * 16 * 128),
                    kk > 0);
    fa_wg_commit();
}

/* Adds warp w's piece of a tile's dQ (rows 64 dq_qblk + 16w .. + 15 of the tile at workspace
 * row row0, columns dq_col0 .. + 63: 16 x 8 blocks of the accumulator, this lane's four values
 * at 4 lane, in dq[c][0..3]'s order) to the workspace: by one bulk reduce-add, or in the
 * deterministic mode in the tile's turn (every later key block that meets it has added: the
 * sm80 family's counter, in the same workspace), both warpgroups' pieces, which are apart, at
 * once. */
FA_DEV void fa_dq_store(const fa_bkparams *bp, int bi, int h, int mb, int nb, const fa_seq *seq,
                        fa_i64 row0, int dq_qblk, int dq_col0, int w, int ct, fa_u32 dq_s,
                        float dq[8][4])
{
    const int lane = ct & 31;
    float *acc_w = bp->dq_accum + row0 * FA_DP + (fa_i64)(64 * dq_qblk + 16 * w) * FA_DP +
                   dq_col0 * 16;
    if (!bp->deterministic) {
        fa_dq_add_bulk(acc_w, dq_s + (ct >> 5) * FA_DQW_BYTES, lane, dq);
        return;
    }
    int *sem = fa_bwd_sem(bp, bi, h, mb);
    if (ct == 0)
        fa_bwd_turn_wait(&bp->f, seq, mb, nb, sem);
    fa_bar_sync(FA_BAR_DET, 256);
    fa_dq_add(acc_w + 4 * lane, dq);
    __threadfence();
    fa_bar_sync(FA_BAR_DET, 256);
    if (ct == 0)
        atomicAdd(sem, 1);
}


extern "C" __global__ void __launch_bounds__(FA_THREADS, 1)
    fa_bwd(const fa_bkparams bp, const __grid_constant__ fa_bwd_tmaps tm)
{
    const fa_kparams *kp = &bp.f;
    extern __shared__ __align__(1024) unsigned char fa_smem[];
    /* The plan adds 1024 bytes so the base can be rounded up to the swizzle atom. */
    const fa_u32 k_s = (fa_smem_addr(fa_smem) + 1023u) & ~1023u;
    const fa_u32 v_s = k_s + FA_KV_BYTES, q_s = v_s + FA_KV_BYTES;
    const fa_u32 do_s = q_s + FA_QSTAGES * FA_QT_BYTES, ds_s = do_s + FA_QSTAGES * FA_QT_BYTES;
    const fa_u32 dq_s = ds_s + 2 * FA_DS_BYTES, kv_full = dq_s + 4 * FA_NCW * FA_DQW_BYTES;
    /* [FA_QSTAGES] each, 8 bytes apart */
    const fa_u32 q_full = kv_full + 8, q_empty = q_full + 8 * FA_QSTAGES;
    const fa_u32 kv_empty = q_empty + 8 * FA_QSTAGES;
    /* The items in hand, [2] ints: the producer writes item ii's index into slot ii % 2 (and,
     * varlen, its sequence's sq and sk into [2 + 2 (ii % 2)], [3 + 2 (ii % 2)]) before kv_full's
     * phase ii completes, the consumers read them after. */
    volatile int *slot = (volatile int *)(fa_smem + (kv_empty + 8 - fa_smem_addr(fa_smem)));
    /* An item's tour (fa_bwd_tour): its first query tile to try, and the step. */
    const int mb_first = bp.deterministic ? 0 : bp.m_tiles - 1;
    /* Work items (key block, kv head, sequence), key blocks fastest: one per CTA in blockIdx
     * order, or claimed in that order by a persistent grid (bp.persistent: the first is the
     * CTA's own, then the next unclaimed after the grid's). An int counts them: each item's K
     * rows alone are 16 KB, so 2^31 of them would not fit in any device's memory. */
    const int n_items = bp.n_tiles * kp->hk * kp->b;
    const int first = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (!fa_bwd90_start(&bp, &tm, k_s, v_s, q_s, do_s, kv_full, kv_empty, q_full, q_empty, slot,
                        first, n_items))
        return;
    const int ct = threadIdx.x - 128, cw = ct >> 7;
    const int w = (ct >> 5) & 3, lane = ct & 31, t = lane & 3, g = lane >> 2;
    int wlo, whi;
    fa_bwd_window(kp, &wlo, &whi);
    /* dQ: each warpgroup's share of the tile, over all 128 keys: at head dim 128, 64 of the
     * columns (from dq_col0); with 128-query tiles, 64 of the rows (block dq_qblk of dS^T). */
    const int dq_col0 = FA_DP == 128 ? 64 * cw : 0, dq_qblk = FA_BM == 128 ? cw : 0;
    /* The operands' descriptors that stay for the whole block: this warpgroup's K and V rows
     * (K-major, for S^T and dP^T), K's dQ columns (MN-major). The warpgroup index comes from a
     * broadcast so that the compiler knows it warp-uniform and keeps these in uniform registers
     * (wgmma takes its descriptors from there). */
    const int cwu = __shfl_sync(0xffffffffu, cw, 0);
    const fa_u64 k_rows = fa_desc(k_s + 64 * cwu * 128, 16, 1024);
    const fa_u64 v_rows = fa_desc(v_s + 64 * cwu * 128, 16, 1024);
    const fa_u64 k_cols =
        fa_desc(k_s + (FA_DP == 128 ? cwu : 0) * FA_BN * 128, FA_BN * 128, 1024);
    const fa_u32 ds_blk = (FA_BM == 128 ? cwu : 0) * FA_BN * 128;
    /* This lane's row address for the dS^T stores: block ds_blk4 of a k-step's four, row
     * (key) ds_key of the block's rows. */
    const int ds_blk4 = lane >> 3, ds_key = 64 * cw + 16 * w + (lane & 7) + 8 * (ds_blk4 & 1);
    /* Query tiles so far, and the next tile's Q/dO stage and its phase: the stages, the dS^T
     * buffers (it % 2) and their barriers run on over the items, in step with the producer. */
    int it = 0, qs = 0, qph = 0;
    for (int ii = 0;; ii++) {
        fa_mbar_wait(kv_full, ii & 1);
        const int wi = slot[ii & 1];
        if (wi == FA_BWD90_NO_ITEM)
            break;
        const fa_bwd_item im = fa_bwd_item_make(&bp, wi);
#if FA_VARLEN
        const volatile int *lens = slot + 2 + 2 * (ii & 1);
#else
        const fa_seq seq = im.seq;
#endif
        const int nb = im.nb, hk = im.hk, bi = im.bi, n0 = im.n0;
        const int h_end = im.h_end;
        /* This thread's first key (C layout: rows 16w + g and + 8 of the warpgroup's 64). */
        const int key0 = n0 + 64 * cw + 16 * w + g;

        /* C layout: dk[nt][e] is key key0 + 8 (e / 2), column 8 nt + 2t + (e % 2). */
        float dk[FA_DP / 8][4], dv[FA_DP / 8][4];
#pragma unroll
        for (int nt = 0; nt < FA_DP / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                dk[nt][e] = 0.f;
                dv[nt][e] = 0.f;
            }

        /* The previous tile of this item, whose dQ this iteration computes: its head, tile
         * and first row in the workspace; tiles, this item's tiles so far. */
        int hp = 0, mbp = 0, tiles = 0;
        fa_i64 row0p = 0;
        float dq[8][4];
        int h = im.h0, mb = mb_first;
        const fa_seq sv_first = FA_ITEM_SEQ;
        FA_BWD_TOUR(&bp, &sv_first, nb, h_end, &h, &mb, 0);
        /* Past the tour's end mb is FA_BWD90_REC_END, as in the producer's records. */
        mb = h < h_end ? mb : FA_BWD90_REC_END;
#pragma unroll 1
        for (; mb >= 0; it++, tiles++) {
            const int s = it & 1;
            const int m0 = mb * FA_BM;
            const fa_u32 q_t = q_s + qs * FA_QT_BYTES, do_t = do_s + qs * FA_QT_BYTES;
            const fa_u32 ds_t = ds_s + s * FA_DS_BYTES;
            const fa_i64 row0 = fa_bwd_row0(&bp, h, bi) + m0;

            /* The tile's view for fa_bwd_probs, with its rows of lse and D, made here so that the
             * products below hide their loads' latency (read where fa_bwd_probs needs them, they
             * stalled it). */
            const fa_seq sv_tile = FA_ITEM_SEQ;
            fa_bwd_tile tl = fa_bwd_tile_make(kp, &sv_tile, bi, h, m0, key0, t, wlo, whi,
                                              bp.lse2 + row0, bp.dsum + row0);

            /* S^T and dP^T of this warpgroup's 64 keys x the tile's queries. C layout: st[nt][e] is
             * key key0 + 8 (e / 2), query m0 + 8 nt + 2t + (e % 2) (fa_bwd_probs'). */
            float st[FA_BM / 8][4], dpt[FA_BM / 8][4];
            fa_mbar_wait(q_full + 8 * qs, qph);
            fa_wg_fence();
            fa_gemm_t(&st[0][0], k_rows, fa_desc(q_t, 16, 1024));
            fa_gemm_t(&dpt[0][0], v_rows, fa_desc(do_t, 16, 1024));
            fa_wg_commit();
#if FA_DROPOUT
            /* the keep decisions while the tensor cores run */
            fa_bwd_keep_bits(kp, key0, m0, t, fa_dropout_stream(kp, bi, h), tl.keep);
#endif
#if FA_BWD_MODS
            /* the tile's block-mask state from the producer's record (FA_BWD90_REC) */
#if FA_BLOCK_MASK
            const int state = fa_lds32(FA_BWD90_REC(kv_empty + 8, qs, 2));
#elif FA_MOD_MASKS
            const int state = FA_BM_PARTIAL;
#else
            const int state = 0;
#endif
            fa_bwd90_mods_view(kp, &tl, t, bi, h, state, slot);
#endif
            fa_wg_wait0();
            fa_pin_acc(&st[0][0], FA_BM / 2);
            fa_pin_acc(&dpt[0][0], FA_BM / 2);

            const int full = fa_bwd_tile_full(&sv_tile, m0, n0, wlo, whi);
#if FA_BWD_MODS
            fa_bwd90_probs_mods(kp, &tl, t, st, dpt, state, full);
#else
            if (full)
                fa_bwd_probs(kp, &tl, t, st, dpt, 0);
            else
                fa_bwd_probs(kp, &tl, t, st, dpt, 1);
#endif

            /* P^T and dS^T as A fragments (queries 16 kk .. 16 kk + 15 are k-step kk; fragment
             * r is the 8 x 8 block of keys + 8 (r % 2), queries + 8 (r / 2)), and dS^T into
             * shared memory, row = key of the block, queries contiguous, once the other
             * warpgroup's product has read what this buffer held two tiles ago: one stmatrix
             * per k-step, this lane giving row ds_key of block ds_blk4 (16 stores a tile at
             * head dim 128 were 4). */
            if (it >= 2)
                fa_bar_sync(FA_BAR_READ + 2 * (1 - cw) + s, 256);
            fa_u32 pa[FA_BM / 16][4], da[FA_BM / 16][4];
#pragma unroll
            for (int kk = 0; kk < FA_BM / 16; kk++) {
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    pa[kk][r] = fa_pack2(st[2 * kk + (r >> 1)][2 * (r & 1)],
                                         st[2 * kk + (r >> 1)][2 * (r & 1) + 1]);
                    da[kk][r] = fa_pack2(dpt[2 * kk + (r >> 1)][2 * (r & 1)],
                                         dpt[2 * kk + (r >> 1)][2 * (r & 1) + 1]);
                }
                const int q0 = 16 * kk + 8 * (ds_blk4 >> 1);
                fa_stmatrix_x4(ds_t + (q0 >> 6) * FA_BN * 128 + fa_swz128(ds_key, q0 & 63),
                               da[kk]);
            }
            fa_fence_proxy_async();
            fa_bar_sync(FA_BAR_OWN + cw, 128);
            fa_bar_arrive(FA_BAR_WRITTEN + 2 * cw + s, 256);

            /* The previous tile's dQ (both warpgroups wrote its dS^T an iteration ago, so this
             * rarely waits), then dV += P^T dO and dK += dS^T Q, in flight while that dQ is added.
             * An item's first tile has no previous one: its product reads the K and V tiles
             * (read-only, so no race) and is discarded; issuing it anyway keeps the wgmma groups
             * the same on every iteration, which ptxas needs to keep them asynchronous. */
            if (tiles > 0)
                fa_bar_sync(FA_BAR_WRITTEN + 2 * (1 - cw) + (s ^ 1), 256);
            fa_dq_issue(&dq[0][0],
                        fa_desc((tiles > 0 ? ds_s + (s ^ 1) * FA_DS_BYTES : k_s) + ds_blk,
                                FA_BN * 128, 1024),
                        k_cols);
            fa_pin_acc(&dv[0][0], FA_DP / 2);
            fa_pin_acc(&dk[0][0], FA_DP / 2);
            fa_wg_fence();
            fa_gemm_kv(&dv[0][0], pa, fa_desc(do_t, FA_BM * 128, 1024));
            fa_gemm_kv(&dk[0][0], da, fa_desc(q_t, FA_BM * 128, 1024));
            fa_wg_commit();
            fa_wg_wait1();
            fa_pin_acc(&dq[0][0], 32);
            if (tiles > 0) {
                fa_bar_arrive(FA_BAR_READ + 2 * cw + (s ^ 1), 256);
                const fa_seq sv_dq = FA_ITEM_SEQ;
                fa_dq_store(&bp, bi, hp, mbp, nb, &sv_dq, row0p, dq_qblk, dq_col0, w, ct, dq_s,
                            dq);
            }
            fa_wg_wait0();
            fa_pin_acc(&dv[0][0], FA_DP / 2);
            fa_pin_acc(&dk[0][0], FA_DP / 2);
#pragma unroll
            for (int kk = 0; kk < FA_BM / 16; kk++)
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    FA_PINU(pa[kk][r]);
                    FA_PINU(da[kk][r]);
                }
            hp = h;
            mbp = mb;
            row0p = row0;
            /* The tour's next tile from the producer's record of this one, read where used:
             * held over the tile, it made ptxas spill. */
            h = fa_lds32(FA_BWD90_REC(kv_empty + 8, qs, 0));
            mb = fa_lds32(FA_BWD90_REC(kv_empty + 8, qs, 1));
            /* This thread is done with the stage's Q and dO (and its record): each thread
             * arrives, as its own reads of the record must precede the producer's rewrite. */
            fa_mbar_arrive(q_empty + 8 * qs);
            if (++qs == FA_QSTAGES)
                qs = 0, qph ^= 1;
        }
        /* The item's last tile's dQ. */
        if (tiles > 0) {
            const int s = (it - 1) & 1;
            fa_bar_sync(FA_BAR_WRITTEN + 2 * (1 - cw) + s, 256);
            fa_dq_issue(&dq[0][0], fa_desc(ds_s + s * FA_DS_BYTES + ds_blk, FA_BN * 128, 1024),
                        k_cols);
            fa_wg_wait0();
            fa_pin_acc(&dq[0][0], 32);
            fa_bar_arrive(FA_BAR_READ + 2 * cw + s, 256);
            const fa_seq sv_dq = FA_ITEM_SEQ;
            fa_dq_store(&bp, bi, hp, mbp, nb, &sv_dq, row0p, dq_qblk, dq_col0, w, ct, dq_s, dq);
        }
        /* This warp is done with K and V: the next item's load overlaps the stores below. */
        if (lane == 0)
            fa_mbar_arrive(kv_empty);
#if FA_VARLEN
        fa_bwd_store_dkdv(&bp, bi, hk, key0, t, 0, 0, dk, dv); /* it reads the sequence's keys */
        /* One item per CTA: no state carried to a next item that never comes (ptxas kept the
         * item loop's counters in local memory). */
        break;
#else
        fa_bwd_store_dkdv(&bp, bi, hk, key0, t, seq.sk, 0, dk, dv);
#endif
    }
    /* The other warpgroup's last two read barriers, which no later write consumed. */
    for (int j = it > 1 ? it - 2 : 0; j < it; j++)
        fa_bar_sync(FA_BAR_READ + 2 * (1 - cw) + (j & 1), 256);
    /* The last bulk add has read its buffer before the CTA's shared memory goes. */
    fa_bulk_wait_read();
}

#include "fa_bwd_rows.cuh"
