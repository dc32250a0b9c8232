/*
 * Backward attention for sm_90a at head dims past 128 and d != dv (fa_bwd_sm90.cu takes d = dv
 * up to 128): the same workspace, kernels around it (fa_bwd_rows.cuh), work items, tours and
 * producer (fa_bwd_sm90.cuh), with tiles whose dK and dV fit two consumer warpgroups' registers
 * up to head dim 256.
 *
 * fa_bwd: work items of (key block of FA_BN = 64 or 128 keys, kv head, sequence); 384 threads:
 * the producer warpgroup (TMA: K and V of the block once per item, Q and dO of each query tile
 * of FA_BM = 64 rows it meets into FA_QSTAGES stages) and two consumer warpgroups.
 *
 * 64-key blocks (FA_BN 64): both consumer warpgroups hold all 64 keys; per query tile, consumer
 * warpgroup cw:
 *   S^T = K Q_cw^T, dP^T = V dO_cw^T    SS wgmma m64n32 over its 32 queries of the tile (both
 *                                      operands K-major), so fa_bwd_probs makes P^T and dS^T
 *                                      (no softmax scale) in the sm90 family's frame, 32
 *                                      queries a warp (FA_BWD_QW)
 *   P^T, dS^T -> shared memory         its 32 query columns of the tile's [64 keys][64 queries]
 *                                      buffers (two of each, by tile parity), then one barrier
 *                                      of both warpgroups: the tile's P^T and dS^T are whole
 *   dV_cw += P^T dO[:, its columns]    SS wgmma m64nN, N = 64 or 128: P^T and dS^T K-major as
 *   dK_cw += dS^T Q[:, its columns]    A, dO and Q MN-major as B; each warpgroup holds whole
 *                                      64-column blocks of dK and of dV (FA_K0, FA_V0 of them
 *                                      for warpgroup 0, the rest for 1: 2 + 2 at d = dv = 256,
 *                                      64 registers each), so their sum stays within 240
 *   dQ[:, its columns] = dS K          dS^T read back as an MN-major A operand, K as MN-major B;
 *                                      column blocks balance the warpgroups' products (FA_Q0);
 *                                      the fp32 result is added to the workspace accumulator
 *                                      (the sm80 family's fragment order, which the accumulator
 *                                      layout matches) by red.global.add.v4, or in the
 *                                      deterministic mode in the tile's turn. At d = dv
 *                                      = 256 (two blocks of each product a warpgroup) dQ's
 *                                      blocks go one after the other in one block's registers,
 *                                      the first added while dV and dK's products run.
 * Across tiles: once a tile's dV, dK and dQ products are issued, the tour's next tile's S^T and
 * dP^T are issued behind them (its Q / dO stage waited for), and run while this tile's dQ is
 * added; a tile thus starts from its S^T and dP^T in registers (the item's first from a product
 * issued before its loop).
 *
 * 128-key blocks (FA_BN 128, FA_KEY_SPLIT; d + dv padded at most 320): each consumer warpgroup
 * owns 64 of the keys with all their dK and dV columns (160 accumulators at d 192 / dv 128), so
 * a query tile's Q and dO and its dQ additions serve twice the keys of a 64-key block. Per query
 * tile, consumer warpgroup cw, for each half of 32 queries in turn:
 *   S^T, dP^T of its keys              SS wgmma m64n32, as above, then fa_bwd_probs: P^T kept
 *                                      as A fragments in registers (varlen: in its buffer),
 *                                      dS^T into its rows of the [128 keys][64 queries] buffers;
 *                                      the first half behind a barrier of this warpgroup alone,
 *                                      the second behind both (dS^T whole for dQ)
 *   dV_cw += P^T dO, dK_cw += dS^T Q    wgmma over the half's 32 queries, all column blocks, dV's
 *                                      with A from registers (RS: a third less of shared memory
 *                                      read than SS; varlen's kernel spilled with it), dK's SS:
 *                                      the first half's run while the second half's
 *                                      probabilities are made, the second's beside dQ's
 *   dQ[:, its columns] = dS K          over all 128 keys, one 64-column block at a time (FA_Q0
 *                                      blocks for warpgroup 0, the rest for 1), each added as
 *                                      above once its product is done.
 * With FA_BWD_N64 (dense calls without softcap) S^T and dP^T are each one m64n64 product over
 * all 64 queries, so K and V are read once a tile, not once a half; P is kept as its 16-bit A
 * fragments, and dS is made from them; dK's products of both halves run beside dQ's.
 *
 * The barrier per tile also orders the buffers: a buffer is rewritten two tiles later, after
 * both warpgroups waited for the products that read it.
 * dK, dV are written at the item's end (dK times the softmax scale), after K and V are released.
 *
 * Defines from the plan (src/plan/fa_plan_backward.c, fa_plan_backward_sm90): FA_BF16, FA_DP, FA_DVP
 * (multiples of 64 up to 256), FA_BM 64, FA_BN (64, or 128 where the plan's rule takes it),
 * FA_QSTAGES (2 or 3), FA_ALIBI, FA_SOFTCAP, FA_DROPOUT, FA_VARLEN.
 *
 * Shared memory (1024-byte aligned; tiles in 128-byte swizzled rows of 64 columns, column blocks
 * one after another, as TMA writes them): K [FA_DP / 64][FA_BN][64], V [FA_DVP / 64][FA_BN][64];
 * Q [FA_QSTAGES][FA_DP / 64][FA_BM][64], dO [FA_QSTAGES][FA_DVP / 64][FA_BM][64]; P^T [2][FA_BN]
 * [FA_BM], dS^T [2][FA_BN][FA_BM]; mbarriers kv_full, q_full[FA_QSTAGES], q_empty[FA_QSTAGES],
 * kv_empty; the item slots and their lengths (fa_bwd90_produce). FA_SMEM_BWD90W sizes it.
 */
#include "fa_bkparams.h"

#define FA_NCW 2 /* consumer warpgroups */
#define FA_THREADS 384
#define FA_NWARPS 12
#define FA_VEC 1
/* The producer's item bookkeeping (two head dims' loops, its tours) spilled at 24 registers
 * beside 64-key blocks; beside 128-key blocks, whose consumers hold 160 accumulators, it fits
 * there and the consumers take the 240. */
#ifndef FA_REGS_PRODUCER
#if FA_BN == 128
#define FA_REGS_PRODUCER 24
#define FA_REGS_CONSUMER 240
#else
#define FA_REGS_PRODUCER 40
#define FA_REGS_CONSUMER 232
#endif
#endif

#include "fa_sm90.cuh"
#include "fa_smem.h"

#if FA_BM != 64 || (FA_BN != 64 && FA_BN != 128) || FA_DP % 64 != 0 || FA_DVP % 64 != 0 ||    \
    FA_DP > 256 || FA_DVP > 256 || FA_QSTAGES < 2 || FA_QSTAGES > 3
#error "fa_bwd_sm90_wide.cu: 64-query tiles, 64 or 128 keys, d and dv multiples of 64 up to 256"
#endif
/* 128-key blocks: each consumer warpgroup owns 64 of the keys and all their dK and dV columns,
 * (d + dv) / 2 accumulators a thread, so the padded head dims sum to at most 320 (the plan's
 * rule), and dQ has at least two column blocks to share. */
#define FA_KEY_SPLIT (FA_BN == 128)
#if FA_KEY_SPLIT && (FA_DP + FA_DVP > 320 || FA_DP < 128)
#error "fa_bwd_sm90_wide.cu: 128-key blocks take d + dv <= 320 (padded) and d >= 128"
#endif

/* 128-key blocks: S^T and dP^T over all 64 queries of a tile (the head comment; the plan's
 * FLASHATTN_BWD_SM90_N64). Dense calls without softcap, whose dS needs more than P. */
#ifndef FA_BWD_N64
#define FA_BWD_N64 0
#endif
#if FA_BWD_N64 && (!FA_KEY_SPLIT || FA_VARLEN || FA_SOFTCAP || FA_DROPOUT)
#error "fa_bwd_sm90_wide.cu: FA_BWD_N64 takes dense 128-key blocks without softcap or dropout"
#endif

/* fa_bwd_probs over each warpgroup's 32 queries of the tile, their rows of lse and D one per
 * lane, and the dropout keep decisions made during the S^T and dP^T products. */
#define FA_BWD_ROWS_IN_LANES 1
#define FA_BWD_KEEP_BITS 1
#define FA_BWD_QW 32
#define FA_BWD_LANE_ROWS 1
#if FA_BN == 128
#define FA_BWD_INDEX_UNSIGNED
#endif
#include "fa_bwd_common.cuh"

#define FA_K_BYTES FA_SMEM_BWD90_KV(FA_BN, FA_DP)   /* K of the block */
#define FA_V_BYTES FA_SMEM_BWD90_KV(FA_BN, FA_DVP)  /* V of the block */
#define FA_Q_BYTES FA_SMEM_BWD90_QT(FA_BM, FA_DP)   /* one stage of Q */
#define FA_DO_BYTES FA_SMEM_BWD90_QT(FA_BM, FA_DVP) /* one stage of dO */
#define FA_PS_BYTES FA_SMEM_BWD90_DS(FA_BN, FA_BM)  /* one P^T or dS^T buffer */
#include "fa_bwd_sm90.cuh"

/* The item's sequence in the consumers (FA_ITEM_SEQ's), varlen's lengths from their shared
 * address: a generic pointer to them held over the tiles spilled. */
#if FA_VARLEN
#define FA_WIDE_SEQ fa_item_seq_at(lens)
#else
#define FA_WIDE_SEQ seq
#endif

#include "fa_bwd_sm90_wide_layout.cuh"
#include "fa_bwd_sm90_wide_parts.cuh"

/* The running state (fa_consume's run) after a tile of Q / dO stage qs and phase qph: the next
 * stage, its phase flipped where the stages wrap around. */
FA_DEV int fa_run_next_stage(int run, int qs, int qph)
{
    return qs + 1 == FA_QSTAGES ? (run & 3) ^ (qph ^ 1) << 2 : run + 8;
}

/* A consumer warpgroup over the CTA's work items (sm: the layout's base, FA_OFF_*; ct: its
 * thread's index among the consumers' 256), with its column blocks of dK, dV, dQ (first and
 * count, kb0 and nkb, ...) as constants at each call, so that each warpgroup's products are
 * straight-line code (under a branch on the warpgroup ptxas made every wgmma wait for the one
 * before). */
FA_DEV void fa_consume(const fa_bkparams *bp, fa_u32 sm, int mb_first, int cw, int ct, int kb0,
                       int nkb, int vb0, int nvb, int qb0, int nqb)
{
    const fa_kparams *kp = &bp->f;
    /* This warpgroup's first key of a block and first query of a tile (with 128-key blocks
     * it owns 64 keys and meets every query; else all 64 keys and 32 of the queries). */
    const int kw0 = FA_KEY_SPLIT ? 64 * cw : 0;
#if !FA_KEY_SPLIT
    const int qw0 = 32 * cw;
#endif
    const int w = (ct >> 5) & 3, lane = ct & 31, t = lane & 3, g = lane >> 2;
    const fa_u32 kv_full = sm + FA_OFF_KV_FULL, kv_empty = sm + FA_OFF_KV_EMPTY;
    /* This lane's row address for the P^T and dS^T stores: block blk4 of a k-step's four, row
     * (key) st_key of the block's rows. */
    const int blk4 = lane >> 3, st_key = kw0 + 16 * w + (lane & 7) + 8 * (blk4 & 1);
    /* The running state in one register: bit 0 the item's parity (its slot, kv_full's phase),
     * bit 1 the tile's (its P^T and dS^T buffers), bit 2 the next tile's Q/dO stage phase, bits
     * 3 on that stage: the stages and buffers run on over the items, in step with the producer. */
    int run = 0;
    for (;; run ^= 1) {
        const int ip = run & 1;
        fa_mbar_wait(kv_full, ip);
        /* The item from its slot (at kv_empty + 8), read where used: the pointer and the count
         * of items held over the tiles spilled. */
        const int wi = fa_lds32(kv_empty + 8 + 4 * ip);
        if (wi == FA_BWD90_NO_ITEM)
            break;
        const fa_bwd_item im = fa_bwd_item_make(bp, wi);
#if FA_VARLEN
        /* the item's lengths beside its slot (fa_item_seq) */
        const fa_u32 lens = sm + FA_OFF_KV_EMPTY + 16 + 8 * ip;
#else
        const fa_seq seq = im.seq;
#endif
        const int nb = im.nb, hk = im.hk, bi = im.bi, n0 = im.n0;
        const int h_end = im.h_end;
        /* This thread's first key (C layout: rows 16w + g and + 8 of the warpgroup's 64). */
        const int key0 = n0 + kw0 + 16 * w + g;

        /* C layout: dk[nt][e] is key key0 + 8 (e / 2), column 64 kb0 + 8 nt + 2t + (e % 2); the
         * first nkb (nvb) blocks are this warpgroup's, the rest never live. */
        float dk[8 * FA_KB_MAX][4], dv[8 * FA_VB_MAX][4];
#pragma unroll
        for (int nt = 0; nt < 8 * nkb; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                dk[nt][e] = 0.f;
#pragma unroll
        for (int nt = 0; nt < 8 * nvb; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                dv[nt][e] = 0.f;

        int h = im.h0, mb = mb_first;
        const fa_seq sv_first = FA_WIDE_SEQ;
        fa_bwd_tour(bp, &sv_first, nb, h_end, &h, &mb, 0);
        /* Past the tour's end mb is FA_BWD90_REC_END, as in the producer's records. */
        mb = h < h_end ? mb : FA_BWD90_REC_END;
#if !FA_KEY_SPLIT
        /* The tile's S^T and dP^T and its rows, made by the tile before (the first tile's
         * here): each tile issues its successor's products beside its own dQ additions. C
         * layout: st[nt][e] is key key0 + 8 (e / 2), query m0 + qw0 + 8 nt + 2t + (e % 2). */
        float st[4][4], dpt[4][4];
        fa_bwd_tile tl;
        if (mb >= 0) {
            fa_bwd_sdp_issue(bp, sm, &sv_first, bi, h, mb, run, qw0, key0, t, st, dpt, &tl);
            fa_wg_wait0();
            fa_pin_acc(&st[0][0], 16);
            fa_pin_acc(&dpt[0][0], 16);
        }
#endif
#pragma unroll 1
        for (; mb >= 0; run ^= 2) {
            const int s = (run >> 1) & 1, qs = run >> 3, qph = (run >> 2) & 1;
            const int m0 = mb * FA_BM;
            const fa_u32 q_full = sm + FA_OFF_Q_FULL, q_empty = sm + FA_OFF_Q_EMPTY;
            const fa_i64 row0 = fa_bwd_row0(bp, h, bi) + m0;

            const fa_seq sv_tile = FA_WIDE_SEQ;
            /* the window from the parameters in each tile, not held over the items */
            int wlo, whi;
            fa_bwd_window(kp, &wlo, &whi);
#if FA_KEY_SPLIT
            const int full = fa_bwd_tile_full(&sv_tile, m0, n0, wlo, whi);
            /* The warpgroup's 64 keys against the tile's queries in two halves of 32: S^T and
             * dP^T of a half, then its P^T and dS^T into the buffers (the first half's for this
             * warpgroup's products, the second's completing dS^T for both). The first half's
             * dV and dK products run while the second half's probabilities are made, the
             * second's beside dQ's first block. */
            fa_mbar_wait(q_full + 8 * qs, qph);
            /* P^T of each half as its dV product's A fragments (FA_P_RS) */
            fa_u32 pa[2][2][4];
#if FA_BWD_N64
            /* S^T and dP^T of the warpgroup's 64 keys against all 64 queries, one m64n64
             * product each (K and V read once a tile). P of both halves from S^T, packed to 16
             * bits as the dV products' A fragments, which run beside dP^T's; dS = P (dP - D)
             * from the packed P (S^T's fp32 P beside dP^T's accumulators left too few registers
             * to keep the wgmmas asynchronous) into the dS^T buffer; dK's products then run
             * beside dQ's. S^T, dP^T and dQ share one block of registers, sq: each product's
             * accumulators tied to the values before it (in blocks of their own ptxas
             * serialized the wgmmas). C layout: sq[nt][e] is key key0 + 8 (e / 2), query m0 +
             * 8 nt + 2t + e % 2. */
            float sq[8][4];
            {
                const fa_tile_smem a = fa_tile_smem_at(sm, qs, s, kw0);
                fa_pin_acc(&dv[0][0], 32 * FA_VB_MAX);
                fa_pin_acc(&dk[0][0], 32 * FA_KB_MAX);
                fa_wg_fence();
                fa_gemm_t(&sq[0][0], fa_desc(a.k, 16, 1024), fa_desc(a.q, 16, 1024), FA_DP, 64);
                fa_wg_commit();
                const fa_bwd_tile tl1 =
                    fa_bwd_tile_make(kp, &sv_tile, bi, h, m0 + 32, key0, t, wlo, whi,
                                     bp->lse2 + row0 + 32, bp->dsum + row0 + 32);
                const fa_bwd_tile tl0 = fa_bwd_tile_make(kp, &sv_tile, bi, h, m0, key0, t, wlo,
                                                         whi, bp->lse2 + row0, bp->dsum + row0);
                fa_wg_wait0();
                fa_pin_acc(&sq[0][0], 32);
                if (full) {
                    fa_bwd_p(kp, &tl0, t, &sq[0], 0);
                    fa_bwd_p(kp, &tl1, t, &sq[4], 0);
                } else {
                    fa_bwd_p(kp, &tl0, t, &sq[0], 1);
                    fa_bwd_p(kp, &tl1, t, &sq[4], 1);
                }
                fa_frags_pack(&sq[0], pa[0]);
                fa_frags_pack(&sq[4], pa[1]);
                fa_wg_fence();
                fa_gemm_t(&sq[0][0], fa_desc(a.v, 16, 1024), fa_desc(a.dout, 16, 1024), FA_DVP,
                          64);
                fa_wg_commit();
                const fa_u64 dout_cols = fa_desc(a.dout, FA_BM * 128, 1024);
                fa_gemm_kv_rs(&dv[0][0], FA_NVB, pa[0], dout_cols, 0);
                fa_gemm_kv_rs(&dv[0][0], FA_NVB, pa[1], dout_cols, 2);
                fa_wg_commit();
                fa_wg_wait1(); /* dP^T's group; dV's may run on */
                fa_pin_acc(&sq[0][0], 32);
#pragma unroll
                for (int hq = 0; hq < 2; hq++) {
                    float p[4][4];
                    fa_u32 da[2][4];
                    fa_frags_unpack(pa[hq], p);
                    fa_bwd_ds(hq ? &tl1 : &tl0, t, p, &sq[4 * hq]);
                    fa_frags_pack(&sq[4 * hq], da);
#pragma unroll
                    for (int kk = 0; kk < 2; kk++)
                        fa_stmatrix_x4(a.ds - kw0 * 128 + fa_frag_off(st_key, 32 * hq, kk, blk4),
                                       da[kk]);
                }
                fa_fence_proxy_async();
                /* dV's products are done with pa */
                fa_wg_wait0();
                fa_pin_frags(pa[0]);
                fa_pin_frags(pa[1]);
                fa_bar_sync(FA_BAR_PDS, 256);
            }
#else
#pragma unroll
            for (int hq = 0; hq < 2; hq++) {
                const int q0 = 32 * hq;
                fa_bwd_tile tl = fa_bwd_tile_make(kp, &sv_tile, bi, h, m0 + q0, key0, t, wlo,
                                                  whi, bp->lse2 + row0 + q0, bp->dsum + row0 + q0);
                /* C layout: st[nt][e] is key key0 + 8 (e / 2), query m0 + q0 + 8 nt + 2t + e % 2 */
                float st[4][4], dpt[4][4];
                const fa_tile_smem a = fa_tile_smem_at(sm, qs, s, kw0);
                fa_pin_acc(&dv[0][0], 32 * FA_VB_MAX);
                fa_pin_acc(&dk[0][0], 32 * FA_KB_MAX);
                fa_wg_fence();
                fa_gemm_t(&st[0][0], fa_desc(a.k, 16, 1024), fa_desc(a.q + q0 * 128, 16, 1024),
                          FA_DP, 32);
                fa_gemm_t(&dpt[0][0], fa_desc(a.v, 16, 1024),
                          fa_desc(a.dout + q0 * 128, 16, 1024), FA_DVP, 32);
                fa_wg_commit();
                if (hq == 1)
                    fa_gemm_dkdv(dk, dv, &a, 0, pa[0]);
#if FA_DROPOUT
                fa_bwd_keep_bits(kp, key0, m0 + q0, t, fa_dropout_stream(kp, bi, h), tl.keep);
#endif
                if (hq == 0)
                    fa_wg_wait0();
                else
                    fa_wg_wait1(); /* the S^T and dP^T group; dV and dK's may run on */
                fa_pin_acc(&st[0][0], 16);
                fa_pin_acc(&dpt[0][0], 16);
                fa_probs_store(kp, &tl, t, full, st, dpt, pa[hq], !FA_P_RS, a.p - kw0 * 128,
                               a.ds - kw0 * 128, st_key, q0, blk4);
                if (hq == 0) {
                    fa_bar_sync(FA_BAR_OWN + cw, 128);
                } else {
#if FA_P_RS
                    /* the first half's dV product is done with pa[0] */
                    fa_wg_wait0();
                    fa_pin_frags(pa[0]);
#endif
                    fa_bar_sync(FA_BAR_PDS, 256);
                }
            }
#endif
            /* Warp w's 16 rows of the tile's dQ, this warpgroup's columns, in the workspace
             * (blocks of 16 rows x 8 columns). */
            float *acc_w = bp->dq_accum + (row0 + 16 * w) * FA_DP + qb0 * 64 * 16;
            const fa_tile_smem a = fa_tile_smem_at(sm, qs, s, kw0);
            const fa_u64 ds_cols = fa_desc(a.ds - kw0 * 128, FA_BN * 128, 1024);
            const fa_u64 k_cols = fa_desc(a.k - kw0 * 128 + qb0 * FA_BN * 128, FA_BN * 128, 1024);
#if FA_BWD_N64
            float (*dq)[4] = sq;
#else
            float dq[8][4];
#endif
            fa_wg_fence();
            fa_gemm_dq(&dq[0][0], 1, ds_cols, k_cols);
            fa_wg_commit();
#if FA_BWD_N64
            fa_gemm_kv(&dk[0][0], FA_NKB, fa_desc(a.ds, 16, 1024),
                       fa_desc(a.q, FA_BM * 128, 1024), 0, FA_BM / 16);
            fa_wg_commit();
#else
            fa_gemm_dkdv(dk, dv, &a, 2, pa[1]);
#endif
            fa_wg_wait1();
            fa_pin_acc(&dq[0][0], 32);
            if (bp->deterministic) {
                const fa_seq sv_dq = FA_WIDE_SEQ;
                fa_dq_turn_wait(bp, &sv_dq, bi, h, mb, nb, ct);
            }
            fa_dq_add(acc_w, lane, 1, dq);
            if (nqb == 2) {
                /* the adds have read dq before the second block's product writes it */
                fa_wg_fence();
                fa_gemm_dq(&dq[0][0], 1, ds_cols, fa_desc_at(k_cols, FA_BN * 128));
                fa_wg_commit();
            }
            fa_wg_wait0();
            fa_pin_acc(&dq[0][0], 32);
#if FA_P_RS && !FA_BWD_N64
            fa_pin_frags(pa[1]);
#endif
#else
            /* The shared addresses from the base made opaque here, so that they are computed in
             * each tile rather than hoisted and held over the loop. */
            fa_u32 sb = sm;
            FA_PINU(sb);
            const fa_u64 k_cols = fa_desc(sb + qb0 * FA_BN * 128, FA_BN * 128, 1024);
            const fa_u32 q_t = sb + FA_OFF_Q + qs * FA_Q_BYTES;
            const fa_u32 do_t = sb + FA_OFF_DO + qs * FA_DO_BYTES;
            const fa_u32 p_t = sb + FA_OFF_P + s * FA_PS_BYTES;
            const fa_u32 ds_t = sb + FA_OFF_DS + s * FA_PS_BYTES;
            const int full = fa_bwd_tile_full(&sv_tile, m0, n0, wlo, whi);
            fa_u32 pa[2][4];
            fa_probs_store(kp, &tl, t, full, st, dpt, pa, 1, p_t, ds_t, st_key, qw0, blk4);
            fa_bar_sync(FA_BAR_PDS, 256);
            /* Warp w's 16 rows of the tile's dQ, this warpgroup's columns, in the workspace
             * (blocks of 16 rows x 8 columns). */
            float *acc_w = bp->dq_accum + (row0 + 16 * w) * FA_DP + qb0 * 64 * 16;
            const fa_u64 ds_cols = fa_desc(ds_t, FA_BN * 128, 1024);

            /* dV += P^T dO, dK += dS^T Q over this warpgroup's columns, dQ = dS K over its dQ
             * columns, then added: at once, or in the deterministic mode in the tile's turn,
             * both warpgroups' columns together. */
            fa_pin_acc(&dv[0][0], 32 * nvb);
            fa_pin_acc(&dk[0][0], 32 * nkb);
            fa_wg_fence();
#if FA_DQ_HALVES
            /* dQ's first block as a group of its own, added while dV and dK's products run,
             * then its second block in the same registers (added below). */
            float dq[8][4];
            fa_gemm_dq(&dq[0][0], 1, ds_cols, k_cols);
            fa_wg_commit();
            fa_gemm_kv(&dv[0][0], nvb, fa_desc(p_t, 16, 1024),
                       fa_desc(do_t + vb0 * FA_BM * 128, FA_BM * 128, 1024), 0, FA_BM / 16);
            fa_gemm_kv(&dk[0][0], nkb, fa_desc(ds_t, 16, 1024),
                       fa_desc(q_t + kb0 * FA_BM * 128, FA_BM * 128, 1024), 0, FA_BM / 16);
            fa_wg_commit();
            fa_wg_wait1();
            fa_pin_acc(&dq[0][0], 32);
            if (bp->deterministic) {
                const fa_seq sv_dq = FA_WIDE_SEQ;
                fa_dq_turn_wait(bp, &sv_dq, bi, h, mb, nb, ct);
            }
            fa_dq_add(acc_w, lane, 1, dq);
            /* the adds have read dq before the second block's product writes it */
            fa_wg_fence();
            fa_gemm_dq(&dq[0][0], 1, ds_cols, fa_desc_at(k_cols, FA_BN * 128));
            fa_wg_commit();
#define FA_BWD_DQ_ADD_LAST() fa_dq_add(acc_w + 8 * 128, lane, 1, dq)
#else
            float dq[8 * FA_QB_MAX][4];
            fa_gemm_kv(&dv[0][0], nvb, fa_desc(p_t, 16, 1024),
                       fa_desc(do_t + vb0 * FA_BM * 128, FA_BM * 128, 1024), 0, FA_BM / 16);
            fa_gemm_kv(&dk[0][0], nkb, fa_desc(ds_t, 16, 1024),
                       fa_desc(q_t + kb0 * FA_BM * 128, FA_BM * 128, 1024), 0, FA_BM / 16);
            fa_gemm_dq(&dq[0][0], nqb, ds_cols, k_cols);
            fa_wg_commit();
#define FA_BWD_DQ_ADD_LAST()                                                                       \
    do {                                                                                           \
        if (bp->deterministic) {                                                                   \
            const fa_seq sv_dq = FA_WIDE_SEQ;                                                      \
            fa_dq_turn_wait(bp, &sv_dq, bi, h, mb, nb, ct);                                        \
        }                                                                                          \
        fa_dq_add(acc_w, lane, nqb, dq);                                                           \
    } while (0)
#endif
            /* The tour's next tile from the producer's record of this one; its S^T and dP^T
             * run after this tile's products, beside the dQ additions below. */
            const int hn = fa_lds32(FA_BWD90_REC(kv_empty + 8, qs, 0));
            const int mbn = fa_lds32(FA_BWD90_REC(kv_empty + 8, qs, 1));
            run = fa_run_next_stage(run, qs, qph);
            /* Two copies of the rest, the next tile's products and the waits for them inside
             * one (ptxas serialises every wgmma when a group's issue and its wait sit in
             * different branches). The rest: this thread is done with the stage's Q and dO (and
             * the record), and this tile's dQ is added. */
#define FA_BWD_TILE_FINISH()                                                                       \
    do {                                                                                           \
        fa_pin_acc(&dq[0][0], FA_DQ_HALVES ? 32 : 32 * nqb);                                       \
        fa_pin_acc(&dv[0][0], 32 * nvb);                                                           \
        fa_pin_acc(&dk[0][0], 32 * nkb);                                                           \
        fa_mbar_arrive(q_empty + 8 * qs);                                                          \
        FA_BWD_DQ_ADD_LAST();                                                                      \
        if (bp->deterministic)                                                                     \
            fa_dq_turn_pass(bp, bi, h, mb, ct);                                                    \
    } while (0)
            if (mbn >= 0) {
                fa_bwd_sdp_issue(bp, sm, &sv_tile, bi, hn, mbn, run, qw0, key0, t, st, dpt, &tl);
                fa_wg_wait1();
                FA_BWD_TILE_FINISH();
                fa_wg_wait0();
                fa_pin_acc(&st[0][0], 16);
                fa_pin_acc(&dpt[0][0], 16);
            } else {
                fa_wg_wait0();
                FA_BWD_TILE_FINISH();
            }
#undef FA_BWD_TILE_FINISH
#undef FA_BWD_DQ_ADD_LAST
            h = hn;
            mb = mbn;
#endif /* FA_KEY_SPLIT */
#if FA_KEY_SPLIT
            fa_pin_acc(&dv[0][0], 32 * FA_VB_MAX);
            fa_pin_acc(&dk[0][0], 32 * FA_KB_MAX);
            /* The tour's next tile from the producer's record of this one, then this thread
             * is done with the stage's Q and dO (and the record); each thread arrives, as
             * its own reads of the record must precede the producer's rewrite. */
            const int hn = fa_lds32(FA_BWD90_REC(kv_empty + 8, qs, 0));
            const int mbn = fa_lds32(FA_BWD90_REC(kv_empty + 8, qs, 1));
            fa_mbar_arrive(q_empty + 8 * qs);
            run = fa_run_next_stage(run, qs, qph);

            if (nqb == 2)
                fa_dq_add(acc_w + 8 * 128, lane, 1, dq);
            if (bp->deterministic)
                fa_dq_turn_pass(bp, bi, h, mb, ct);

            h = hn;
            mb = mbn;
#endif
        }
        /* The item again from its slot, which the producer refills only after the next item's
         * K and V: its indices for the stores, recomputed rather than held over the tiles. */
        fa_u32 sb = sm;
        FA_PINU(sb);
        const fa_bwd_item ie =
            fa_bwd_item_make(bp, fa_lds32(sb + FA_OFF_KV_EMPTY + 8 + 4 * (run & 1)));
        /* This warp is done with K and V: the next item's load overlaps the stores below. */
        if (lane == 0)
            fa_mbar_arrive(kv_empty);
#if FA_VARLEN
        fa_store_dkdv(bp, ie.bi, ie.hk, key0, t, 0, 64 * kb0, nkb, 64 * vb0, nvb, dk, dv);
        break; /* one item per CTA */
#else
        fa_store_dkdv(bp, ie.bi, ie.hk, key0, t, ie.seq.sk, 64 * kb0, nkb, 64 * vb0, nvb, dk,
                      dv);
#endif
    }
}

extern "C" __global__ void __launch_bounds__(FA_THREADS, 1)
    fa_bwd(const fa_bkparams bp, const __grid_constant__ fa_bwd_tmaps tm)
{
    const fa_kparams *kp = &bp.f;
    extern __shared__ __align__(1024) unsigned char fa_smem[];
    /* The plan adds 1024 bytes so the base can be rounded up to the swizzle atom. */
    const fa_u32 k_s = (fa_smem_addr(fa_smem) + 1023u) & ~1023u;
    const fa_u32 v_s = k_s + FA_OFF_V, q_s = k_s + FA_OFF_Q, do_s = k_s + FA_OFF_DO;
    const fa_u32 kv_full = k_s + FA_OFF_KV_FULL, q_full = k_s + FA_OFF_Q_FULL;
    const fa_u32 q_empty = k_s + FA_OFF_Q_EMPTY, kv_empty = k_s + FA_OFF_KV_EMPTY;
    /* The items in hand (fa_bwd90_produce). */
    volatile int *slot = (volatile int *)(fa_smem + (kv_empty + 8 - fa_smem_addr(fa_smem)));
    /* An item's tour (fa_bwd_tour): its first query tile to try. */
    const int mb_first = bp.deterministic ? 0 : bp.m_tiles - 1;
    /* Work items (key block, kv head, sequence), key blocks fastest, as fa_bwd_sm90.cu. */
    const int n_items = bp.n_tiles * kp->hk * kp->b;
    const int first = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (!fa_bwd90_start(&bp, &tm, k_s, v_s, q_s, do_s, kv_full, kv_empty, q_full, q_empty, slot,
                        first, n_items))
        return;
    const int ct = threadIdx.x - 128;
    /* The base again in the consumers' branch (volatile: not the prologue's value, which both
     * branches then share and the consumers' loops leave no register to hold). */
    fa_u32 sm;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
                 : "=r"(sm)
                 : "l"(fa_smem));
    sm = (sm + 1023u) & ~1023u;
    /* The warpgroup index from a broadcast, so that the compiler knows it warp-uniform. */
    if (__shfl_sync(0xffffffffu, ct >> 7, 0) == 0)
        fa_consume(&bp, sm, mb_first, 0, ct, 0, FA_K0, 0, FA_V0, 0, FA_Q0);
    else if (FA_KEY_SPLIT)
        fa_consume(&bp, sm, mb_first, 1, ct, 0, FA_NKB, 0, FA_NVB, FA_Q0, FA_NKB - FA_Q0);
    else
        fa_consume(&bp, sm, mb_first, 1, ct, FA_K0, FA_NKB - FA_K0, FA_V0, FA_NVB - FA_V0, FA_Q0,
                   FA_NKB - FA_Q0);
}

#include "fa_bwd_rows.cuh"
