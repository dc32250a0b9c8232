/*
 * Backward attention for sm_90a at head dims past 128 and d != dv (fa_bwd_sm90.cu takes d = dv
 * up to 128): the same workspace, kernels around it (fa_bwd_rows.cuh), work items, tours and
 * producer (fa_bwd_sm90.cuh), with a tile whose dK and dV fit two consumer warpgroups' registers
 * at head dim 256.
 *
 * fa_bwd: work items of (key block of FA_BN = 64 keys, kv head, sequence); 384 threads: the
 * producer warpgroup (TMA: K and V of the block once per item, Q and dO of each query tile of
 * FA_BM = 64 rows it meets into FA_QSTAGES stages) and two consumer warpgroups. Both hold all
 * 64 keys; per query tile, consumer warpgroup cw:
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
 * The barrier per tile also orders the buffers: a buffer is rewritten two tiles later, after
 * both warpgroups waited for the products that read it.
 * dK, dV are written at the item's end (dK times the softmax scale), after K and V are released.
 *
 * Defines from the plan (src/plan/fa_plan_backward.c, fa_plan_backward_sm90): FA_BF16, FA_DP, FA_DVP
 * (multiples of 64 up to 256), FA_BM 64, FA_BN 64, FA_QSTAGES (2 or 3), FA_ALIBI, FA_SOFTCAP,
 * FA_DROPOUT, FA_VARLEN.
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
/* The producer's item bookkeeping (two head dims' loops, its tours) spilled at 24 registers. */
#define FA_REGS_PRODUCER 40
#define FA_REGS_CONSUMER 232

#include "fa_sm90.cuh"
#include "fa_smem.h"

#if FA_BM != 64 || FA_BN != 64 || FA_DP % 64 != 0 || FA_DVP % 64 != 0 || FA_DP > 256 ||         \
    FA_DVP > 256 || FA_QSTAGES < 2 || FA_QSTAGES > 3
#error "fa_bwd_sm90_wide.cu: 64 x 64 tiles, d and dv multiples of 64 up to 256 (padded)"
#endif

/* fa_bwd_probs over each warpgroup's 32 queries of the tile, their rows of lse and D one per
 * lane, and the dropout keep decisions made during the S^T and dP^T products. */
#define FA_BWD_ROWS_IN_LANES 1
#define FA_BWD_KEEP_BITS 1
#define FA_BWD_QW 32
#define FA_BWD_LANE_ROWS 1
#include "fa_bwd_common.cuh"

#define FA_K_BYTES FA_SMEM_BWD90_KV(FA_BN, FA_DP)   /* K of the block */
#define FA_V_BYTES FA_SMEM_BWD90_KV(FA_BN, FA_DVP)  /* V of the block */
#define FA_Q_BYTES FA_SMEM_BWD90_QT(FA_BM, FA_DP)   /* one stage of Q */
#define FA_DO_BYTES FA_SMEM_BWD90_QT(FA_BM, FA_DVP) /* one stage of dO */
#define FA_PS_BYTES FA_SMEM_BWD90_DS(FA_BN, FA_BM)  /* one P^T or dS^T buffer */
#include "fa_bwd_sm90.cuh"

/* Byte offsets from the 1024-aligned base of the head comment's layout: K, V, the Q and dO
 * stages, the P^T and dS^T buffers, the mbarriers ([FA_QSTAGES] each, 8 bytes apart), the item
 * slots. */
#define FA_OFF_V FA_K_BYTES
#define FA_OFF_Q (FA_OFF_V + FA_V_BYTES)
#define FA_OFF_DO (FA_OFF_Q + FA_QSTAGES * FA_Q_BYTES)
#define FA_OFF_P (FA_OFF_DO + FA_QSTAGES * FA_DO_BYTES)
#define FA_OFF_DS (FA_OFF_P + 2 * FA_PS_BYTES)
#define FA_OFF_KV_FULL (FA_OFF_DS + 2 * FA_PS_BYTES)
#define FA_OFF_Q_FULL (FA_OFF_KV_FULL + 8)
#define FA_OFF_Q_EMPTY (FA_OFF_Q_FULL + 8 * FA_QSTAGES)
#define FA_OFF_KV_EMPTY (FA_OFF_Q_EMPTY + 8 * FA_QSTAGES)

/* 64-column blocks of dK (and dQ) and of dV, and warpgroup 0's share of each (warpgroup 1 has
 * the rest): dK and dV halved (warpgroup 0 the larger dK half, the smaller dV half), then dQ's
 * blocks so that both warpgroups' products are as even as whole blocks allow. At most two of a
 * kind per warpgroup, so every product is m64n64 or m64n128. */
#define FA_NKB (FA_DP / 64)
#define FA_NVB (FA_DVP / 64)
#define FA_K0 ((FA_NKB + 1) / 2)
#define FA_V0 (FA_NVB / 2)
#define FA_Q0_EVEN ((2 * FA_NKB + FA_NVB) / 2 - FA_K0 - FA_V0)
#define FA_Q0 (FA_Q0_EVEN < 0 ? 0 : FA_Q0_EVEN > FA_NKB ? FA_NKB : FA_Q0_EVEN)
#define FA_MAX2(a, b) ((a) > (b) ? (a) : (b))
#define FA_KB_MAX FA_MAX2(FA_K0, FA_NKB - FA_K0) /* a warpgroup's blocks of dK at most */
#define FA_VB_MAX FA_MAX2(FA_V0, FA_NVB - FA_V0)
#define FA_QB_MAX FA_MAX2(FA_Q0, FA_NKB - FA_Q0)
/* At d = dv = 256 each warpgroup holds two blocks of each (192 accumulators): dQ's two blocks
 * then take turns in one block's registers (fa_consume). */
#define FA_DQ_HALVES (FA_NKB + FA_NVB == 8)
#if FA_DQ_HALVES && (FA_Q0 != 2 || FA_NKB - FA_Q0 != 2)
#error "fa_bwd_sm90_wide.cu: dQ in halves takes two blocks a warpgroup"
#endif
#if FA_KB_MAX > 2 || FA_VB_MAX > 2 || FA_QB_MAX > 2
#error "fa_bwd_sm90_wide.cu: a warpgroup holds at most two column blocks of each product"
#endif

/* Named barriers (0 is __syncthreads'): both consumer warpgroups, the tile's P^T and dS^T
 * written; both, the deterministic mode's turns. */
#define FA_BAR_PDS 1
#define FA_BAR_DET 2

#define FA_RL16 FA_RC0 ", " FA_RC1
#define FA_FL16(a) FA_F8(a, 0), FA_F8(a, 8)
/* S^T = K Q^T, dP^T = V dO^T over 32 queries: rows of keys and of queries, head dim contiguous
 * (both K-major). */
FA_DEF_WGMMA_SS(fa_wgmma_kk32, 32, FA_RL16, FA_FL16, "%16", "%17", "%18", "0, 0")
/* dV += P^T dO, dK += dS^T Q: P^T, dS^T rows of keys (queries contiguous, K-major), dO and Q
 * rows of queries (columns contiguous, MN-major). */
FA_DEF_WGMMA_SS(fa_wgmma_kt64, 64, FA_RL32, FA_FL32, "%32", "%33", "%34", "0, 1")
FA_DEF_WGMMA_SS(fa_wgmma_kt128, 128, FA_RL64, FA_FL64, "%64", "%65", "%66", "0, 1")
/* dQ = dS K: dS^T rows of keys (queries contiguous) and K rows of keys (columns contiguous),
 * both MN-major. */
FA_DEF_WGMMA_SS(fa_wgmma_tt64, 64, FA_RL32, FA_FL32, "%32", "%33", "%34", "1, 1")
FA_DEF_WGMMA_SS(fa_wgmma_tt128, 128, FA_RL64, FA_FL64, "%64", "%65", "%66", "1, 1")

/* Issues S^T (or dP^T) of the block's 64 keys x a warpgroup's 32 queries over `cols` of the
 * head dim: 16-column k-steps, 32 bytes apart inside a 128-byte row, the next 64-column block
 * of the key rows (FA_BN rows) and of the query rows (FA_BM rows) after four. */
FA_DEV void fa_gemm_t(float *acc, fa_u64 kv_rows, fa_u64 q_rows, int cols)
{
#pragma unroll
    for (int kk = 0; kk < cols / 16; kk++)
        fa_wgmma_kk32(acc, fa_desc_at(kv_rows, (kk >> 2) * FA_BN * 128 + (kk & 3) * 32),
                      fa_desc_at(q_rows, (kk >> 2) * FA_BM * 128 + (kk & 3) * 32), kk > 0);
}

/* Issues acc += P^T B (or dS^T B) over the tile's 64 queries, four k-steps: A the buffer's rows
 * of keys (K-major, +32 bytes a step), B `nblk` 64-column blocks of the stage's dO or Q (MN-major,
 * +16 rows a step); nblk is 0, 1 or 2, the same over the warpgroup. */
FA_DEV void fa_gemm_kv(float *acc, int nblk, fa_u64 a_rows, fa_u64 b_cols)
{
#pragma unroll
    for (int kk = 0; kk < FA_BM / 16; kk++) {
        if (nblk == 2)
            fa_wgmma_kt128(acc, fa_desc_at(a_rows, kk * 32), fa_desc_at(b_cols, kk * 2048), 1);
        else if (nblk == 1)
            fa_wgmma_kt64(acc, fa_desc_at(a_rows, kk * 32), fa_desc_at(b_cols, kk * 2048), 1);
    }
}

/* Issues dQ = dS K over the block's 64 keys, four k-steps of 16 rows of keys (2048 bytes) in both
 * operands: A the dS^T buffer (MN-major), B nblk 64-column blocks of K (MN-major). */
FA_DEV void fa_gemm_dq(float *acc, int nblk, fa_u64 ds_rows, fa_u64 k_cols)
{
#pragma unroll
    for (int kk = 0; kk < FA_BN / 16; kk++) {
        if (nblk == 2)
            fa_wgmma_tt128(acc, fa_desc_at(ds_rows, kk * 2048), fa_desc_at(k_cols, kk * 2048),
                           kk > 0);
        else if (nblk == 1)
            fa_wgmma_tt64(acc, fa_desc_at(ds_rows, kk * 2048), fa_desc_at(k_cols, kk * 2048),
                          kk > 0);
    }
}

/* Adds this warp's dQ rows (16 of the tile at acc_w, 16 x 8 blocks of the accumulator, this
 * lane's four values at 4 lane, dq[c][0..3]: block c of the warpgroup's columns) for nblk
 * 64-column blocks. */
FA_DEV void fa_dq_add(float *acc_w, int lane, int nblk, float dq[][4])
{
#pragma unroll
    for (int c = 0; c < 8 * FA_QB_MAX; c++)
        if (c < 8 * nblk)
            fa_red_add_v4(acc_w + c * 128 + 4 * lane, dq[c][0], dq[c][1], dq[c][2], dq[c][3]);
}

/* Deterministic mode, both consumer warpgroups (ct: the thread's index among them): waits for
 * query tile mb's turn (every later key block that meets it has added: the sm80 family's
 * counter, in the same workspace) before this block's dQ adds ... */
FA_DEV void fa_dq_turn_wait(const fa_bkparams *bp, const fa_seq *s, int bi, int h, int mb,
                            int nb, int ct)
{
    if (ct == 0)
        fa_bwd_turn_wait(&bp->f, s, mb, nb, fa_bwd_sem(bp, bi, h, mb));
    fa_bar_sync(FA_BAR_DET, 256);
}

/* ... and after them, once every consumer thread's adds are visible, passes the turn on. */
FA_DEV void fa_dq_turn_pass(const fa_bkparams *bp, int bi, int h, int mb, int ct)
{
    __threadfence();
    fa_bar_sync(FA_BAR_DET, 256);
    if (ct == 0)
        atomicAdd(fa_bwd_sem(bp, bi, h, mb), 1);
}

/* Row g + 8 hf of this thread's C fragments acc (nblk 64-column blocks from column c0) to the
 * global row r of n columns, times scale; live: the key exists. */
FA_DEV void fa_store_blocks(fa_u16 *r, int n, const float acc[][4], int c0, int nblk, int hf,
                            int t, float scale, int live)
{
    if (nblk == 2)
        fa_bwd_store_row(r + c0, n - c0, acc, 128, hf, t, scale, live);
    else if (nblk == 1)
        fa_bwd_store_row(r + c0, n - c0, acc, 64, hf, t, scale, live);
}

/* dK (times the softmax scale dS lacked) and dV of this thread's keys key0 and key0 + 8 of kv
 * head hk, sequence bi: the warpgroup's blocks (nkb of dK from column kc0, nvb of dV from vc0);
 * keys up to sk (dense) or, varlen, up to the sequence's end in k, as fa_bwd_store_dkdv. */
FA_DEV void fa_store_dkdv(const fa_bkparams *bp, int bi, int hk, int key0, int t, int sk,
                          int kc0, int nkb, int vc0, int nvb, const float dk[][4],
                          const float dv[][4])
{
    const fa_kparams *kp = &bp->f;
    fa_i64 k_start;
    int key_end;
    fa_bwd_key_span(kp, bi, sk, &k_start, &key_end);
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int key = key0 + 8 * hf;
        fa_u16 *dkr = (fa_u16 *)bp->dk + bi * bp->dk_bstride + (k_start + key) * bp->dk_rstride +
                      hk * bp->dk_hstride;
        fa_u16 *dvr = (fa_u16 *)bp->dv + bi * bp->dv_bstride + (k_start + key) * bp->dv_rstride +
                      hk * bp->dv_hstride;
        fa_store_blocks(dkr, kp->d, dk, kc0, nkb, hf, t, kp->scale, key < key_end);
        fa_store_blocks(dvr, kp->dv, dv, vc0, nvb, hf, t, 1.f, key < key_end);
    }
}

/* A consumer warpgroup over the CTA's work items (sm: the layout's base, FA_OFF_*; ct: its
 * thread's index among the consumers' 256), with its column blocks of dK, dV, dQ (first and
 * count, kb0 and nkb, ...) as constants at each call, so that each warpgroup's products are
 * straight-line code (under a branch on the warpgroup ptxas made every wgmma wait for the one
 * before). */
FA_DEV void fa_consume(const fa_bkparams *bp, fa_u32 sm, const volatile int *slot, int n_items,
                       int mb_first, int cw, int ct, int kb0, int nkb, int vb0,
                       int nvb, int qb0, int nqb)
{
    const fa_kparams *kp = &bp->f;
    int wlo, whi;
    fa_bwd_window(kp, &wlo, &whi);
    const int qw0 = 32 * cw; /* this warpgroup's first query of a tile */
    const int w = (ct >> 5) & 3, lane = ct & 31, t = lane & 3, g = lane >> 2;
    const fa_u32 kv_full = sm + FA_OFF_KV_FULL, kv_empty = sm + FA_OFF_KV_EMPTY;
    /* This lane's row address for the P^T and dS^T stores: block blk4 of a k-step's four, row
     * (key) st_key of the block's rows. */
    const int blk4 = lane >> 3, st_key = 16 * w + (lane & 7) + 8 * (blk4 & 1);
    /* Query tiles so far, and the next tile's Q/dO stage and its phase: the stages and the
     * P^T/dS^T buffers (it % 2) run on over the items, in step with the producer. */
    int it = 0, qs = 0, qph = 0;
    for (int ii = 0;; ii++) {
        fa_mbar_wait(kv_full, ii & 1);
        const int wi = slot[ii & 1];
        if (wi >= n_items)
            break;
        const fa_bwd_item im = fa_bwd_item_make(bp, wi);
#if FA_VARLEN
        const volatile int *lens = slot + 2 + 2 * (ii & 1);
#else
        const fa_seq seq = im.seq;
#endif
        const int nb = im.nb, hk = im.hk, bi = im.bi, n0 = im.n0;
        const int h_end = im.h_end;
        /* This thread's first key (C layout: rows 16w + g and + 8 of the block's 64). */
        const int key0 = n0 + 16 * w + g;

        /* C layout: dk[nt][e] is key key0 + 8 (e / 2), column 64 kb0 + 8 nt + 2t + (e % 2). */
        float dk[8 * FA_KB_MAX][4], dv[8 * FA_VB_MAX][4];
#pragma unroll
        for (int nt = 0; nt < 8 * FA_KB_MAX; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                dk[nt][e] = 0.f;
#pragma unroll
        for (int nt = 0; nt < 8 * FA_VB_MAX; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                dv[nt][e] = 0.f;

        int h = im.h0, mb = mb_first;
        const fa_seq sv_first = FA_ITEM_SEQ;
        fa_bwd_tour(bp, &sv_first, nb, h_end, &h, &mb, 0);
        /* Past the tour's end mb is FA_BWD90_REC_END, as in the producer's records. */
        mb = h < h_end ? mb : FA_BWD90_REC_END;
#pragma unroll 1
        for (; mb >= 0; it++) {
            const int s = it & 1;
            const int m0 = mb * FA_BM;
            /* Every shared address and descriptor from the base made opaque here, so that they
             * are computed in each tile rather than hoisted and held over the loop (K and V's
             * k-step descriptors alone would hold over 40 registers). */
            fa_u32 sb = sm;
            FA_PINU(sb);
            const fa_u32 k_s = sb, q_full = sb + FA_OFF_Q_FULL, q_empty = sb + FA_OFF_Q_EMPTY;
            /* K and V rows (K-major, S^T and dP^T), K's dQ columns (MN-major). */
            const fa_u64 k_rows = fa_desc(k_s, 16, 1024);
            const fa_u64 v_rows = fa_desc(sb + FA_OFF_V, 16, 1024);
            const fa_u64 k_cols = fa_desc(k_s + qb0 * FA_BN * 128, FA_BN * 128, 1024);
            const fa_u32 q_s = sb + FA_OFF_Q, do_s = sb + FA_OFF_DO;
            const fa_u32 p_s = sb + FA_OFF_P, ds_s = sb + FA_OFF_DS;
            const fa_u32 q_t = q_s + qs * FA_Q_BYTES, do_t = do_s + qs * FA_DO_BYTES;
            const fa_u32 p_t = p_s + s * FA_PS_BYTES, ds_t = ds_s + s * FA_PS_BYTES;
            const fa_i64 row0 = fa_bwd_row0(bp, h, bi) + m0;

            /* The warpgroup's view for fa_bwd_probs, its rows of lse and D loaded while the
             * products below run. */
            const fa_seq sv_tile = FA_ITEM_SEQ;
            fa_bwd_tile tl = fa_bwd_tile_make(kp, &sv_tile, bi, h, m0 + qw0, key0, t, wlo, whi,
                                              bp->lse2 + row0 + qw0, bp->dsum + row0 + qw0);

            /* S^T and dP^T of the 64 keys x this warpgroup's 32 queries. C layout: st[nt][e] is
             * key key0 + 8 (e / 2), query m0 + qw0 + 8 nt + 2t + (e % 2). */
            float st[4][4], dpt[4][4];
            fa_mbar_wait(q_full + 8 * qs, qph);
            fa_wg_fence();
            fa_gemm_t(&st[0][0], k_rows, fa_desc(q_t + qw0 * 128, 16, 1024), FA_DP);
            fa_gemm_t(&dpt[0][0], v_rows, fa_desc(do_t + qw0 * 128, 16, 1024), FA_DVP);
            fa_wg_commit();
#if FA_DROPOUT
            /* the keep decisions while the tensor cores run */
            fa_bwd_keep_bits(kp, key0, m0 + qw0, t, fa_dropout_stream(kp, bi, h), tl.keep);
#endif
            fa_wg_wait0();
            fa_pin_acc(&st[0][0], 16);
            fa_pin_acc(&dpt[0][0], 16);

            const int full = fa_bwd_tile_full(&sv_tile, m0, n0, wlo, whi);
            if (full)
                fa_bwd_probs(kp, &tl, t, st, dpt, 0);
            else
                fa_bwd_probs(kp, &tl, t, st, dpt, 1);

            /* P^T and dS^T into this tile's buffers, row = key, queries contiguous: per k-step
             * of 16 queries one stmatrix of each, fragment r the 8 x 8 block of keys + 8 (r % 2),
             * queries + 8 (r / 2), this lane giving row st_key of block blk4. */
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {
                fa_u32 pa[4], da[4];
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    pa[r] = fa_pack2(st[2 * kk + (r >> 1)][2 * (r & 1)],
                                     st[2 * kk + (r >> 1)][2 * (r & 1) + 1]);
                    da[r] = fa_pack2(dpt[2 * kk + (r >> 1)][2 * (r & 1)],
                                     dpt[2 * kk + (r >> 1)][2 * (r & 1) + 1]);
                }
                const fa_u32 off = fa_swz128(st_key, qw0 + 16 * kk + 8 * (blk4 >> 1));
                fa_stmatrix_x4(p_t + off, pa);
                fa_stmatrix_x4(ds_t + off, da);
            }
            fa_fence_proxy_async();
            fa_bar_sync(FA_BAR_PDS, 256);

            /* dV += P^T dO, dK += dS^T Q over this warpgroup's columns, dQ = dS K over its dQ
             * columns. Then warp w's 16 rows of the tile's dQ, those columns, into the workspace
             * (blocks of 16 rows x 8 columns): at once, or in the deterministic mode in the
             * tile's turn, both warpgroups' columns together. */
            float *acc_w = bp->dq_accum + (row0 + 16 * w) * FA_DP + qb0 * 64 * 16;
            const fa_u64 ds_cols = fa_desc(ds_t, FA_BN * 128, 1024);
            fa_pin_acc(&dv[0][0], 32 * FA_VB_MAX);
            fa_pin_acc(&dk[0][0], 32 * FA_KB_MAX);
            fa_wg_fence();
#if FA_DQ_HALVES
            /* dQ's first block as a group of its own, added while dV and dK's products run,
             * then its second block in the same registers. */
            float dq[8][4];
            fa_gemm_dq(&dq[0][0], 1, ds_cols, k_cols);
            fa_wg_commit();
            fa_gemm_kv(&dv[0][0], nvb, fa_desc(p_t, 16, 1024),
                       fa_desc(do_t + vb0 * FA_BM * 128, FA_BM * 128, 1024));
            fa_gemm_kv(&dk[0][0], nkb, fa_desc(ds_t, 16, 1024),
                       fa_desc(q_t + kb0 * FA_BM * 128, FA_BM * 128, 1024));
            fa_wg_commit();
            fa_wg_wait1();
            fa_pin_acc(&dq[0][0], 32);
            if (bp->deterministic) {
                const fa_seq sv_dq = FA_ITEM_SEQ;
                fa_dq_turn_wait(bp, &sv_dq, bi, h, mb, nb, ct);
            }
            fa_dq_add(acc_w, lane, 1, dq);
            /* the adds have read dq before the second block's product writes it */
            fa_wg_fence();
            fa_gemm_dq(&dq[0][0], 1, ds_cols, fa_desc_at(k_cols, FA_BN * 128));
            fa_wg_commit();
            fa_wg_wait0();
            fa_pin_acc(&dq[0][0], 32);
#else
            float dq[8 * FA_QB_MAX][4];
            fa_gemm_kv(&dv[0][0], nvb, fa_desc(p_t, 16, 1024),
                       fa_desc(do_t + vb0 * FA_BM * 128, FA_BM * 128, 1024));
            fa_gemm_kv(&dk[0][0], nkb, fa_desc(ds_t, 16, 1024),
                       fa_desc(q_t + kb0 * FA_BM * 128, FA_BM * 128, 1024));
            fa_gemm_dq(&dq[0][0], nqb, ds_cols, k_cols);
            fa_wg_commit();
            fa_wg_wait0();
            fa_pin_acc(&dq[0][0], 32 * FA_QB_MAX);
#endif
            fa_pin_acc(&dv[0][0], 32 * FA_VB_MAX);
            fa_pin_acc(&dk[0][0], 32 * FA_KB_MAX);
            /* The tour's next tile from the producer's record of this one, then this warp is
             * done with the stage's Q and dO (and the record). */
            const int hn = fa_lds32(FA_BWD90_REC(kv_empty + 8, qs, 0));
            const int mbn = fa_lds32(FA_BWD90_REC(kv_empty + 8, qs, 1));
            if (lane == 0)
                fa_mbar_arrive(q_empty + 8 * qs);
            if (++qs == FA_QSTAGES)
                qs = 0, qph ^= 1;

#if FA_DQ_HALVES
            fa_dq_add(acc_w + 8 * 128, lane, 1, dq);
#else
            if (bp->deterministic) {
                const fa_seq sv_dq = FA_ITEM_SEQ;
                fa_dq_turn_wait(bp, &sv_dq, bi, h, mb, nb, ct);
            }
            fa_dq_add(acc_w, lane, nqb, dq);
#endif
            if (bp->deterministic)
                fa_dq_turn_pass(bp, bi, h, mb, ct);

            h = hn;
            mb = mbn;
        }
        /* This warp is done with K and V: the next item's load overlaps the stores below. */
        if (lane == 0)
            fa_mbar_arrive(kv_empty);
#if FA_VARLEN
        fa_store_dkdv(bp, bi, hk, key0, t, 0, 64 * kb0, nkb, 64 * vb0, nvb, dk, dv);
        break; /* one item per CTA */
#else
        fa_store_dkdv(bp, bi, hk, key0, t, seq.sk, 64 * kb0, nkb, 64 * vb0, nvb, dk, dv);
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
    /* The warpgroup index from a broadcast, so that the compiler knows it warp-uniform. */
    if (__shfl_sync(0xffffffffu, ct >> 7, 0) == 0)
        fa_consume(&bp, k_s, slot, n_items, mb_first, 0, ct, 0, FA_K0, 0, FA_V0, 0,
                   FA_Q0);
    else
        fa_consume(&bp, k_s, slot, n_items, mb_first, 1, ct, FA_K0, FA_NKB - FA_K0,
                   FA_V0, FA_NVB - FA_V0, FA_Q0, FA_NKB - FA_Q0);
}

#include "fa_bwd_rows.cuh"
