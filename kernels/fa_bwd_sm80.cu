/*
 * Backward attention for sm80 and later (runs on Hopper too): FlashAttention-2's algorithm on
 * mma.sync m16n8k16 with fp32 accumulation.
 *
 * Entry points, launched in this order on the caller's stream (src/cuda/fa_cuda_backward.c);
 * all but fa_bwd live in fa_bwd_rows.cuh, included at the end:
 *   fa_bwd_fill     varlen: zero dq, dk, dv on the rows outside every sequence (as the CPU
 *                   backward writes them); the other kernels never touch those rows.
 *   fa_bwd_pre      per query tile: D = rowsum(dout * out) and lse * log2(e) in fp32 into the
 *                   workspace; zeroes the tile's fp32 dQ accumulator and its dQ ordering counter.
 *   fa_bwd          one CTA per (key block of FA_BN keys, kv head, sequence). dK and dV of the
 *                   block stay in registers over every query tile of every query head of the GQA
 *                   group that sees the block, in a fixed order, so they are summed
 *                   deterministically; dQ of each query tile is added to the fp32 accumulator
 *                   with atomic reductions. With bp.deterministic the adds to one query tile are
 *                   made in decreasing key-block order: the CTA of key block n waits until the
 *                   tile's counter says that every later key block meeting the tile has added.
 *                   CTAs are then dispatched in decreasing key-block order, so the wait only
 *                   ever targets a CTA already running or done; and since each CTA visits its
 *                   tiles in increasing order from its first visible one, the CTA of a later
 *                   key block (whose first visible tile is no earlier) reaches every shared tile
 *                   first: under a causal mask the key blocks of a column do not serialise.
 *   fa_bwd_dsinks   d_sink[h] = -sum over rows of exp(sink - lse) * D, one CTA per head, a fixed
 *                   reduction tree.
 *   fa_bwd_convert  dQ = softmax scale * the fp32 accumulator, in the dtype, into the caller's dq.
 *
 * The main kernel works in the transposed frame (FA3's): each warp owns 16 keys of the block and
 * computes S^T = K Q^T and dP^T = V dO^T for them, so that P^T and dS^T come out of the mma as
 * C fragments that are directly the A fragments of dV += P^T dO and dK += dS^T Q (no trip through
 * shared memory). dS^T goes to shared memory once, for dQ = dS K, which the warps split into
 * FA_QRW x FA_QCOLS pieces. dS here lacks the softmax scale: dK gets it once at the end, dQ in
 * fa_bwd_convert (one multiply per element of the tile saved).
 *
 * Heads wider than 128 (FA_DKV_SPLIT 2): dK and dV over all d + dv columns would take
 * (d + dv) / 2 registers per thread. There the warps pair up on each 16 keys, warp (kw, cw)
 * holding columns [cw, cw + 1) * d / 2 of dK (dv / 2 of dV): it computes S^T and dP^T for its
 * 16 keys and half cw of the query tile, puts P^T and dS^T into shared memory, and after a
 * barrier reads back the A fragments of its keys over the whole tile (FA2's d 256 tile, 64 x 64
 * with 8 warps, splits dK and dV over warps alike).
 *
 * Pipeline: with FA_QSTAGES 2 the Q, dO, lse and D of the next query tile are copied (cp.async)
 * into the other stage while this one is computed; with 1 they are copied once the tile's last
 * reader of them is done (before dQ), overlapping only the dQ step.
 *
 * dQ accumulator layout (workspace, fp32): per (head, sequence) m_tiles * FA_BM rows (the last
 * tile padded; m_tiles from max_sq, so a varlen sequence shorter than that uses fewer) of FA_DP
 * columns, cut into blocks of 16 rows x 8 columns stored in the order of
 * the mma C fragment, block (r16, c8) at (r16 * FA_DP / 8 + c8) * 128 floats: on sm_90 lane l's
 * four values at 4 l .. 4 l + 3 (one red.global.add.v4.f32 per lane, a warp covers 512 contiguous
 * bytes), on sm_80 value e of lane l at 32 e + l (a warp's scalar reduction covers 128 contiguous
 * bytes). Padded rows and columns receive zeros (their dS and K are zero) and are never read
 * back into dq, so the adds need no bounds checks.
 *
 * Shared-memory tiles are row-major with rows padded by 8 elements (16 bytes): a row stride of
 * 16 (mod 128) bytes puts the 8 row addresses of every ldmatrix in 8 different bank groups.
 *
 * Defines from the plan (src/plan/fa_plan_backward.c, fa_plan_backward):
 *   FA_BF16           data type (0: fp16, 1: bf16)
 *   FA_DP, FA_DVP     head dims of q/k and of v, padded to 32 or a multiple of 64 (<= 256)
 *   FA_BM             query rows per tile (a multiple of 16)
 *   FA_BN, FA_NWARPS  keys per CTA = 16 * warps per CTA / FA_DKV_SPLIT
 *   FA_DKV_SPLIT      2: each warp holds half the columns of dK and dV (absent: all of them)
 *   FA_QSTAGES        1 or 2 shared-memory stages of the query tile (Q, dO, lse, D)
 *   FA_VEC            1: rows 16-byte aligned, d, dv % 8 == 0: cp.async and paired stores
 *   FA_VARLEN         1: packed [total, heads, dim] rows with cu_seqlens_q/k and optional
 *                     seqused_k (fa_seq_get), lse [h, total_q]; 0 compiles the dense form's
 *                     arithmetic unchanged
 *   FA_ALIBI, FA_SOFTCAP, FA_DROPOUT   features compiled in (0/1)
 *   FA_SCORE_MOD, FA_MASK_MOD, FA_BLOCK_MASK   defined (1) only for calls with user-defined
 *                     scoring, as in fa_fwd_sm80.cu: fa_bwd_probs replays the forward's scores
 *                     and masks on S^T and multiplies score_mod's derivative into dS
 *                     (fa_bwd_mod.cuh); with a block mask (dense calls) the CTA loads the states
 *                     of its key blocks over every query block into shared memory behind the
 *                     tiles (fa_bm_load; the launcher adds their bytes) and, but in
 *                     deterministic mode, does not visit the tiles it skips
 *
 * Varlen: every index is sequence-relative (masks, dropout counters, the workspace's rows) except
 * the row of a global tensor, which adds q_start / k_start. Grids are sized from max_sq / max_sk;
 * tiles and key blocks past a shorter sequence do nothing but what the CPU backward's semantics
 * need: dK and dV cover every key of the sequence in k, zero past seqused_k.
 */
#include "fa_bkparams.h"
#include "fa_common.cuh"
#include "fa_smem.h"

#include "fa_mod_flags.h"

#define FA_THREADS (FA_NWARPS * 32)
#ifndef FA_DKV_SPLIT
#define FA_DKV_SPLIT 1
#endif
#define FA_KW (FA_NWARPS / FA_DKV_SPLIT)     /* warps along the keys of the block */
#define FA_BWD_QW (FA_BM / FA_DKV_SPLIT)     /* queries of S^T and dP^T per warp */
#define FA_BWD_DKC (FA_DP / FA_DKV_SPLIT)    /* columns of dK per warp */
#define FA_BWD_DVC (FA_DVP / FA_DKV_SPLIT)   /* of dV */
#define FA_LDK FA_SMEM_BWD80_LD(FA_DP)  /* row stride, in elements, of the Q and K tiles */
#define FA_LDV FA_SMEM_BWD80_LD(FA_DVP) /* of the dO and V tiles */
#define FA_LDS FA_SMEM_BWD80_LD(FA_BM)  /* of the dS^T (and P^T) tiles [FA_BN][FA_BM] */

/* dQ = dS K: each warp computes FA_QRW rows x FA_QCOLS columns of the FA_BM x FA_DP tile, FA_QC
 * columns at a time (at most 32 accumulators per thread: the dQ step runs beside dK and dV's
 * 128 at d 128). 32 rows (two m-tiles sharing every K fragment) read less shared memory than 16
 * where the columns still split evenly into 16-column pieces. */
#if FA_BM % 32 == 0 && FA_NWARPS % (FA_BM / 32) == 0 &&                                        \
    FA_DP % (16 * (FA_NWARPS / (FA_BM / 32))) == 0
#define FA_QRW 32
#else
#define FA_QRW 16
#endif
#define FA_QWM (FA_BM / FA_QRW) /* warps along the rows of dQ */
#define FA_QCOLS (FA_DP / (FA_NWARPS / FA_QWM))
#if FA_DKV_SPLIT > 1
/* dK and dV take half the registers: up to 48 columns, a divisor of FA_QCOLS (48 at d 192). */
#define FA_QC (FA_QCOLS % 48 == 0 ? 48 : FA_QCOLS % 32 == 0 ? 32 : 16)
#else
#define FA_QC (FA_QCOLS < 1024 / FA_QRW ? FA_QCOLS : 1024 / FA_QRW)
#endif

#if FA_BN != 16 * FA_KW || FA_KW * FA_DKV_SPLIT != FA_NWARPS || FA_BWD_QW % 16 != 0 ||        \
    FA_NWARPS % FA_QWM != 0
#error "each warp owns 16 keys of the block; the query tile is a multiple of 16 rows per warp"
#endif
#if FA_DKV_SPLIT != 1 && FA_DKV_SPLIT != 2
#error "FA_DKV_SPLIT is 1 or 2"
#endif
#if FA_BWD_DKC % 16 != 0 || FA_BWD_DVC % 16 != 0 || FA_QCOLS % FA_QC != 0 || FA_QC % 16 != 0
#error "head dims must be multiples of the mma shape"
#endif
#if FA_QSTAGES != 1 && FA_QSTAGES != 2
#error "FA_QSTAGES is 1 or 2"
#endif
#if FA_BM / 2 > FA_THREADS
#error "the lse and D copies take one thread per 4 rows each"
#endif

/* fa_bwd_probs takes the dropout keep decisions made before S^T and dP^T (fa_bwd_common.cuh). */
#define FA_BWD_KEEP_BITS 1
#if FA_SCORE_MOD || FA_MOD_MASKS
#include "fa_mod.cuh"
#include "fa_bwd_mod.cuh"
#endif
#include "fa_bwd_common.cuh"

#if FA_BLOCK_MASK
#define FA_BWD_NEXT(s, h, mb) fa_bwd_next_bm(&bp, s, nb, h_end, h, mb, bm_meta)
#else
#define FA_BWD_NEXT(s, h, mb) fa_bwd_next(&bp, s, nb, h_end, h, mb)
#endif

#include "fa_bwd_sm80_copy.cuh"

#if FA_VARLEN
/* The sequence as the main loop uses it, from its copy in shared memory (fa_bwd): q_start's
 * low and high words, sq, sk (k_start is not used there). */
FA_DEV fa_seq fa_bwd_lens_seq(const volatile int *l)
{
    fa_seq s;
    s.q_start = (fa_i64)((fa_u64)(fa_u32)l[0] | (fa_u64)(fa_u32)l[1] << 32);
    s.k_start = 0;
    s.sq = l[2];
    s.sk = l[3];
    return s;
}
#endif
/* A C-fragment pair (n-tiles 2kk, 2kk + 1 of a warp's 16 keys, packed as an A fragment: x[0],
 * x[2] rows g, x[1], x[3] rows g + 8) into a [key][query] tile of 16-bit elements, at p = row g,
 * column 16 kk + 2t of the warp's keys: pairs of adjacent queries. */
FA_DEV void fa_bwd_frag_put(fa_u16 *p, const fa_u32 x[4])
{
    fa_u32 *d0 = (fa_u32 *)p;
    d0[0] = x[0];
    d0[4 * FA_LDS] = x[1]; /* 8 rows down: 8 * FA_LDS / 2 words */
    d0[4] = x[2];          /* 8 columns right */
    d0[4 * FA_LDS + 4] = x[3];
}

/* The C fragments of n-tiles 2kk, 2kk + 1 of P Z (st) and dS (dpt), queries 16kk .. 16kk + 15 of
 * the warp's part, packed as A fragments of the k-step over those queries. */
FA_DEV void fa_bwd_frag_pack(const float st[][4], const float dpt[][4], int kk, fa_u32 pa[4],
                             fa_u32 da[4])
{
    pa[0] = fa_pack2(st[2 * kk][0], st[2 * kk][1]);
    pa[1] = fa_pack2(st[2 * kk][2], st[2 * kk][3]);
    pa[2] = fa_pack2(st[2 * kk + 1][0], st[2 * kk + 1][1]);
    pa[3] = fa_pack2(st[2 * kk + 1][2], st[2 * kk + 1][3]);
    da[0] = fa_pack2(dpt[2 * kk][0], dpt[2 * kk][1]);
    da[1] = fa_pack2(dpt[2 * kk][2], dpt[2 * kk][3]);
    da[2] = fa_pack2(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
    da[3] = fa_pack2(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
}

/* One k-step (16 queries) of dV += (P Z)^T dO and dK += dS^T Q over this warp's columns: pa, da
 * the A fragments of its 16 keys; dot, qt the ldmatrix .trans addresses of the step's dO and Q
 * rows at the warp's first column. */
FA_DEV void fa_bwd_dkdv_step(const fa_u32 pa[4], const fa_u32 da[4], fa_u32 dot, fa_u32 qt,
                             float dv[][4], float dk[][4])
{
#pragma unroll
    for (int np = 0; np < FA_BWD_DVC / 16; np++) {
        fa_u32 b[4];
        fa_ldmatrix_x4_trans(b, dot + np * 32);
        fa_mma16816(dv[2 * np], pa, b[0], b[1]);
        fa_mma16816(dv[2 * np + 1], pa, b[2], b[3]);
    }
#pragma unroll
    for (int np = 0; np < FA_BWD_DKC / 16; np++) {
        fa_u32 b[4];
        fa_ldmatrix_x4_trans(b, qt + np * 32);
        fa_mma16816(dk[2 * np], da, b[0], b[1]);
        fa_mma16816(dk[2 * np + 1], da, b[2], b[3]);
    }
}

/* Grid (n_tiles, hk, b), FA_THREADS threads, dynamic shared memory:
 *   Q [FA_QSTAGES][FA_BM][FA_LDK], dO [FA_QSTAGES][FA_BM][FA_LDV], K [FA_BN][FA_LDK],
 *   V [FA_BN][FA_LDV], dS^T [FA_BN][FA_LDS], with FA_DKV_SPLIT P^T [FA_BN][FA_LDS] (16-bit),
 *   lse * log2(e) [FA_QSTAGES][FA_BM], D [FA_QSTAGES][FA_BM] (fp32). */
extern "C" __global__ void __launch_bounds__(FA_THREADS, 1) fa_bwd(const fa_bkparams bp)
{
    const fa_kparams *kp = &bp.f;
    extern __shared__ __align__(128) fa_u16 fa_smem[];
    fa_u16 *const s_q = fa_smem;
    fa_u16 *const s_do = s_q + FA_QSTAGES * FA_BM * FA_LDK;
    fa_u16 *const s_k = s_do + FA_QSTAGES * FA_BM * FA_LDV;
    fa_u16 *const s_v = s_k + FA_BN * FA_LDK;
    fa_u16 *const s_ds = s_v + FA_BN * FA_LDV;
#if FA_DKV_SPLIT > 1
    fa_u16 *const s_pt = s_ds + FA_BN * FA_LDS;
    float *const s_lse = (float *)(s_pt + FA_BN * FA_LDS);
#else
    float *const s_lse = (float *)(s_ds + FA_BN * FA_LDS);
#endif
    float *const s_dsum = s_lse + FA_QSTAGES * FA_BM;
    const fa_u32 q_a = fa_smem_addr(s_q), do_a = fa_smem_addr(s_do), k_a = fa_smem_addr(s_k);
    const fa_u32 v_a = fa_smem_addr(s_v), ds_a = fa_smem_addr(s_ds);

    /* Deterministic mode dispatches the key blocks last to first (see the top of the file);
     * otherwise first to last, so that under a causal mask the longest CTAs start first. */
    const int nb = bp.deterministic ? bp.n_tiles - 1 - (int)blockIdx.x : (int)blockIdx.x;
    const int hk = blockIdx.y, bi = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    /* This warp's 16 keys, and its part of the query tile (S^T, dP^T) and of the columns of dK
     * and dV. */
#if FA_DKV_SPLIT > 1
    const int kw = warp % FA_KW, cw = warp / FA_KW;
#else
    const int kw = warp, cw = 0;
#endif
    const fa_seq seq = fa_bwd_seq(kp, bi);
    const int n0 = nb * FA_BN;
    const int group = kp->h / kp->hk;
#if FA_VARLEN
    if (n0 >= seq.sk) {
        fa_bwd_block_zero(&bp, &seq, bi, hk, n0);
        return;
    }
#endif

    const fa_u16 *kg = (const fa_u16 *)kp->k + bi * kp->k_bstride +
                       (seq.k_start + n0) * kp->k_rstride + hk * kp->k_hstride;
    const fa_u16 *vg = (const fa_u16 *)kp->v + bi * kp->v_bstride +
                       (seq.k_start + n0) * kp->v_rstride + hk * kp->v_hstride;
    fa_bwd_tile_load(s_k, FA_LDK, kg, kp->k_rstride, seq.sk - n0, kp->d, FA_BN, FA_DP);
    fa_bwd_tile_load(s_v, FA_LDV, vg, kp->v_rstride, seq.sk - n0, kp->dv, FA_BN, FA_DVP);

    /* The first query tile goes into stage 0 in the same copy group as K and V. */
    const int h_end = (hk + 1) * group;
    int h = hk * group, mb = 0, stage = 0;
#if FA_BLOCK_MASK
    /* The block mask's states of this CTA's key blocks (dense calls: n0 < sk), behind the
     * tiles, their view's numbers ahead of them; fa_bm_load's barriers publish both. */
    volatile int *const bm_meta = (volatile int *)(s_dsum + FA_QSTAGES * FA_BM);
    fa_bwd_bm_fill(kp, bm_meta, bi, &seq, h, group, n0);
#endif
    FA_BWD_NEXT(&seq, &h, &mb);
    if (h < h_end)
        fa_bwd_load_q(&bp, &seq, bi, h, mb, s_q, s_do, s_lse, s_dsum);
    fa_cp_async_commit();

    /* This thread's ldmatrix row addresses (bytes, shared window) at k-step / n-pair 0, stage 0.
     * A operand, row-major [m][k] (K and V rows of this warp's 16 keys): matrices (rows 0-7,
     * k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) = a[0..3]; lane l gives row l % 16 at
     * column 8 * (l / 16). */
    const fa_u32 ka_ld = k_a + ((16 * kw + (lane & 15)) * FA_LDK + (lane >> 4) * 8) * 2;
    const fa_u32 va_ld = v_a + ((16 * kw + (lane & 15)) * FA_LDV + (lane >> 4) * 8) * 2;
    /* B operand stored [n][k] (Q and dO rows are the n = query index of S^T and dP^T): matrices
     * (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15) = b0, b1 of n-tile 0,
     * b0, b1 of n-tile 1 (non-transposed: lane receives row g, elements 2t, 2t+1). */
    const int bn_row = (lane & 7) + ((lane >> 4) << 3), bn_col = ((lane >> 3) & 1) * 8;
    const fa_u32 qb_ld = q_a + ((cw * FA_BWD_QW + bn_row) * FA_LDK + bn_col) * 2;
    const fa_u32 dob_ld = do_a + ((cw * FA_BWD_QW + bn_row) * FA_LDV + bn_col) * 2;
    /* B operand stored [k][n] (dO and Q for dV/dK, k = query; K for dQ, k = key), read with
     * .trans: matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15) = b0, b1
     * of n-tile 0, b0, b1 of n-tile 1 (lane receives column g, rows 2t, 2t+1). */
    const int kn_row = (lane & 7) + (((lane >> 3) & 1) << 3), kn_col = (lane >> 4) * 8;
    const fa_u32 dot_ld = do_a + (kn_row * FA_LDV + kn_col + cw * FA_BWD_DVC) * 2;
    const fa_u32 qt_ld = q_a + (kn_row * FA_LDK + kn_col + cw * FA_BWD_DKC) * 2;
    /* dQ: this warp's FA_QRW rows and FA_QCOLS columns. */
    const int qwm = warp % FA_QWM, qwn = warp / FA_QWM;
    const fa_u32 kt_ld = k_a + (kn_row * FA_LDK + kn_col + qwn * FA_QCOLS) * 2;
    /* A operand of dQ = dS K from dS^T stored [k = key][m = query], with .trans: matrices
     * (k 0-7, m 0-7) = a[0], (k 0-7, m 8-15) = a[1], (k 8-15, m 0-7) = a[2], (k 8-15, m 8-15) =
     * a[3] (lane receives column g = row g of A, rows 2t, 2t+1 = columns 2t, 2t+1 of A). */
    const fa_u32 dsa_ld = ds_a + (bn_row * FA_LDS + FA_QRW * qwm + bn_col) * 2;
#if FA_DKV_SPLIT > 1
    /* A operand of dV and dK from P^T and dS^T stored [m = key][k = query], as ka_ld. */
    const fa_u32 pa_ld =
        fa_smem_addr(s_pt) + ((16 * kw + (lane & 15)) * FA_LDS + (lane >> 4) * 8) * 2;
    const fa_u32 dska_ld = ds_a + ((16 * kw + (lane & 15)) * FA_LDS + (lane >> 4) * 8) * 2;
#endif

    float dk[FA_BWD_DKC / 8][4], dv[FA_BWD_DVC / 8][4];
#pragma unroll
    for (int nt = 0; nt < FA_BWD_DKC / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            dk[nt][e] = 0.f;
#pragma unroll
    for (int nt = 0; nt < FA_BWD_DVC / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            dv[nt][e] = 0.f;

    /* Masking constants of this lane: its first key, and the window as bounds on i - j + sk - sq. */
    const int key0 = n0 + 16 * kw + g;
    int wlo, whi;
    fa_bwd_window(kp, &wlo, &whi);

    /* Varlen: the loop reads the sequence's first row and lengths from shared memory where it
     * uses them, since held in registers over the loop (or read again from its offsets each
     * tile) they made ptxas spill: fa_bwd runs at the register limit. Dense: they are kernel
     * parameters, used as they always were. */
#if FA_VARLEN
    volatile int *const lens = (volatile int *)(s_dsum + FA_QSTAGES * FA_BM);
    if (threadIdx.x == 0) {
        lens[0] = (int)seq.q_start, lens[1] = (int)(seq.q_start >> 32);
        lens[2] = seq.sq, lens[3] = seq.sk;
    }
    __syncthreads();
#define FA_CUR fa_bwd_lens_seq(lens)
#else
#define FA_CUR seq
#endif
#pragma unroll 1
    while (h < h_end) {
        int hn = h, mbn = mb + 1;
        {
            const fa_seq cur = FA_CUR;
            FA_BWD_NEXT(&cur, &hn, &mbn);
        }
        const int m0 = mb * FA_BM;
        /* This tile's copies have landed, every thread's (wait, then barrier), and every warp is
         * done with the previous tile: its dS^T and, with two stages, the other stage. */
        fa_cp_async_wait_all();
        __syncthreads();
#if FA_QSTAGES == 2
        if (hn < h_end) {
            const fa_seq cur = FA_CUR;
            fa_bwd_load_q(&bp, &cur, bi, hn, mbn, s_q + (stage ^ 1) * FA_BM * FA_LDK,
                          s_do + (stage ^ 1) * FA_BM * FA_LDV, s_lse + (stage ^ 1) * FA_BM,
                          s_dsum + (stage ^ 1) * FA_BM);
        }
        fa_cp_async_commit();
#endif
        const fa_u32 qoff = stage * (FA_BM * FA_LDK * 2), dooff = stage * (FA_BM * FA_LDV * 2);

        /* S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys x FA_BWD_QW queries. C layout:
         * st[nt][e] is key 16 kw + g + 8 (e / 2), query cw FA_BWD_QW + 8 nt + 2t + (e % 2). */
#if FA_DROPOUT
        fa_u32 keep[(FA_BWD_QW + 63) / 64];
        fa_bwd_keep_bits(kp, key0, m0 + cw * FA_BWD_QW, t, fa_dropout_stream(kp, bi, h), keep);
#endif
        float st[FA_BWD_QW / 8][4], dpt[FA_BWD_QW / 8][4];
#pragma unroll
        for (int nt = 0; nt < FA_BWD_QW / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                st[nt][e] = 0.f;
                dpt[nt][e] = 0.f;
            }
#pragma unroll
        for (int ks = 0; ks < FA_DP / 16; ks++) {
            fa_u32 a[4];
            fa_ldmatrix_x4(a, ka_ld + ks * 32);
#pragma unroll
            for (int np = 0; np < FA_BWD_QW / 16; np++) {
                fa_u32 b[4];
                fa_ldmatrix_x4(b, qb_ld + qoff + np * 16 * FA_LDK * 2 + ks * 32);
                fa_mma16816(st[2 * np], a, b[0], b[1]);
                fa_mma16816(st[2 * np + 1], a, b[2], b[3]);
            }
        }
#pragma unroll
        for (int ks = 0; ks < FA_DVP / 16; ks++) {
            fa_u32 a[4];
            fa_ldmatrix_x4(a, va_ld + ks * 32);
#pragma unroll
            for (int np = 0; np < FA_BWD_QW / 16; np++) {
                fa_u32 b[4];
                fa_ldmatrix_x4(b, dob_ld + dooff + np * 16 * FA_LDV * 2 + ks * 32);
                fa_mma16816(dpt[2 * np], a, b[0], b[1]);
                fa_mma16816(dpt[2 * np + 1], a, b[2], b[3]);
            }
        }

        const fa_seq cur = FA_CUR;
        const int mw = cw * FA_BWD_QW; /* this warp's first query in the tile */
        fa_bwd_tile tl =
            fa_bwd_tile_make(kp, &cur, bi, h, m0 + mw, key0, t, wlo, whi,
                             s_lse + stage * FA_BM + mw, s_dsum + stage * FA_BM + mw);
#if FA_DROPOUT
#pragma unroll
        for (int i = 0; i < (FA_BWD_QW + 63) / 64; i++)
            tl.keep[i] = keep[i];
#endif
#if FA_BWD_MODS
        tl.mod.bi = bi;
        tl.mod.h = h;
#if FA_BLOCK_MASK
        const fa_bwd_bm bmv = fa_bwd_bm_get(bm_meta);
        tl.mod.tab = fa_bwd_bm_head(&bmv, h);
        tl.mod.nq = bmv.nq;
        tl.mod.nkb = bmv.nkb;
        tl.mod.kb0 = bmv.kb0;
        tl.mod.st = fa_bwd_bm_state(kp, &bmv, h, mb, cur.sq);
#elif FA_MASK_MOD
        tl.mod.st = FA_BM_PARTIAL; /* no block mask: mask_mod asked everywhere */
#endif
#if FA_MOD_MASKS
        tl.mod.on = fa_bwd_mod_on(tl.mod.st);
        const int full = !tl.mod.on && fa_bwd_tile_full(&cur, m0, n0, wlo, whi);
#else
        const int full = fa_bwd_tile_full(&cur, m0, n0, wlo, whi);
#endif
#else
        const int full = fa_bwd_tile_full(&cur, m0, n0, wlo, whi);
#endif
        if (full)
            fa_bwd_probs(kp, &tl, t, st, dpt, 0);
        else
            fa_bwd_probs(kp, &tl, t, st, dpt, 1);

#if FA_DKV_SPLIT > 1
        /* P Z and dS, transposed, of this warp's keys and queries to shared memory; once every
         * warp's are there, dV += (P Z)^T dO and dK += dS^T Q over the whole tile for this
         * warp's keys and columns. */
#pragma unroll
        for (int kk = 0; kk < FA_BWD_QW / 16; kk++) {
            fa_u32 pa[4], da[4];
            fa_bwd_frag_pack(st, dpt, kk, pa, da);
            const int at = (16 * kw + g) * FA_LDS + mw + kk * 16 + 2 * t;
            fa_bwd_frag_put(s_pt + at, pa);
            fa_bwd_frag_put(s_ds + at, da);
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < FA_BM / 16; kk++) {
            fa_u32 pa[4], da[4];
            fa_ldmatrix_x4(pa, pa_ld + kk * 32);
            fa_ldmatrix_x4(da, dska_ld + kk * 32);
            fa_bwd_dkdv_step(pa, da, dot_ld + dooff + kk * 16 * FA_LDV * 2,
                             qt_ld + qoff + kk * 16 * FA_LDK * 2, dv, dk);
        }
#else
        /* dV += (P Z)^T dO and dK += dS^T Q: the C fragments of n-tiles 2kk, 2kk + 1 (queries
         * 16kk .. 16kk + 15) are the A fragment of k-step kk. */
#pragma unroll
        for (int kk = 0; kk < FA_BM / 16; kk++) {
            fa_u32 pa[4], da[4];
            fa_bwd_frag_pack(st, dpt, kk, pa, da);
            fa_bwd_dkdv_step(pa, da, dot_ld + dooff + kk * 16 * FA_LDV * 2,
                             qt_ld + qoff + kk * 16 * FA_LDK * 2, dv, dk);
            /* dS^T to shared memory for dQ. */
            fa_bwd_frag_put(s_ds + (16 * kw + g) * FA_LDS + kk * 16 + 2 * t, da);
        }
#endif
        /* dS^T complete; every read of this stage's Q, dO, lse and D is done. */
        __syncthreads();
#if FA_QSTAGES == 1
        if (hn < h_end)
            fa_bwd_load_q(&bp, &cur, bi, hn, mbn, s_q, s_do, s_lse, s_dsum);
        fa_cp_async_commit();
#endif

        /* dQ of this warp's FA_QRW rows x FA_QCOLS columns, FA_QC columns at a time, added to
         * the accumulator. Deterministic mode: wait for the tile's turn (every later key block
         * that meets the tile has added), add, then pass the turn on. */
        int *sem = fa_bwd_sem(&bp, bi, h, mb);
        if (bp.deterministic) {
            if (threadIdx.x == 0)
                fa_bwd_turn_wait(kp, &cur, mb, nb, sem);
            __syncthreads();
        }
        /* Block (r16, c8) of this warp's first rows and columns, this lane's place in it. */
        float *acc = bp.dq_accum + (fa_bwd_row0(&bp, h, bi) + m0 + FA_QRW * qwm) * FA_DP +
                     qwn * FA_QCOLS * 16 + (FA_RED_V4 ? 4 * lane : lane);
#pragma unroll 1
        for (int c0 = 0; c0 < FA_QCOLS; c0 += FA_QC) {
            float dq[FA_QRW / 16][FA_QC / 8][4];
#pragma unroll
            for (int mi = 0; mi < FA_QRW / 16; mi++)
#pragma unroll
                for (int nt = 0; nt < FA_QC / 8; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        dq[mi][nt][e] = 0.f;
#pragma unroll
            for (int ks = 0; ks < FA_BN / 16; ks++) {
                fa_u32 a[FA_QRW / 16][4];
#pragma unroll
                for (int mi = 0; mi < FA_QRW / 16; mi++)
                    fa_ldmatrix_x4_trans(a[mi], dsa_ld + ks * 16 * FA_LDS * 2 + mi * 32);
#pragma unroll
                for (int np = 0; np < FA_QC / 16; np++) {
                    fa_u32 b[4];
                    fa_ldmatrix_x4_trans(b, kt_ld + ks * 16 * FA_LDK * 2 + (c0 + np * 16) * 2);
#pragma unroll
                    for (int mi = 0; mi < FA_QRW / 16; mi++) {
                        fa_mma16816(dq[mi][2 * np], a[mi], b[0], b[1]);
                        fa_mma16816(dq[mi][2 * np + 1], a[mi], b[2], b[3]);
                    }
                }
            }
#pragma unroll
            for (int mi = 0; mi < FA_QRW / 16; mi++)
#pragma unroll
                for (int nt = 0; nt < FA_QC / 8; nt++) {
                    float *p = acc + mi * 16 * FA_DP + (c0 + nt * 8) * 16;
#if FA_RED_V4
                    fa_red_add_v4(p, dq[mi][nt][0], dq[mi][nt][1], dq[mi][nt][2], dq[mi][nt][3]);
#else
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        fa_red_add(p + 32 * e, dq[mi][nt][e]);
#endif
                }
        }
        if (bp.deterministic) {
            __threadfence();
            __syncthreads();
            if (threadIdx.x == 0)
                atomicAdd(sem, 1);
        }
        h = hn;
        mb = mbn;
#if FA_QSTAGES == 2
        stage ^= 1;
#endif
    }

#undef FA_CUR
#undef FA_BWD_NEXT
    /* K and V copies still in flight when no query tile met the block. */
    fa_cp_async_wait_all();
    fa_bwd_store_dkdv(&bp, bi, hk, key0, t, seq.sk, cw, dk, dv);
}

#include "fa_bwd_rows.cuh"
