/*
 * Dynamic shared memory of each kernel family, in bytes, from its tile: the plan
 * (src/plan/fa_plan.c) sizes launches with these totals and the kernels lay their buffers out with
 * the same parts. Plain integer macros, compiled by the host (C11) and by NVRTC; 16-bit elements.
 */
#ifndef FA_SMEM_H
#define FA_SMEM_H

/* The most dynamic shared memory an sm_90 CTA may have. */
#define FA_SMEM_SM90_MAX 232448

/* sm80 forward (fa_fwd_sm80.cu): Q [bm][dp], K [bn][dp], V [bn][dvp]. */
#define FA_SMEM_FWD80(bm, bn, dp, dvp) (2 * ((bm) * (dp) + (bn) * ((dp) + (dvp))))
#define FA_SMEM_FWD80_LENS 8 /* varlen: the sequence's sq, sk (int) after the tiles */

/* sm90 forward (fa_fwd_sm90.cu), from a 1024-byte aligned base: Q [bm][dp]; per stage K [bn][dp]
 * and V [bn][dvp]; the mbarriers (8 bytes each) q_full, q_empty, and k_full, v_full, k_empty,
 * v_empty per stage, then 8 bytes of scratch; 1 KB more so the kernel can round its base up to the
 * swizzle atom. */
#define FA_SMEM_FWD90_Q(bm, dp) ((bm) * (dp) * 2)
#define FA_SMEM_FWD90_K(bn, dp) ((bn) * (dp) * 2)
#define FA_SMEM_FWD90_V(bn, dvp) ((bn) * (dvp) * 2)
#define FA_SMEM_FWD90(bm, bn, dp, dvp, stages)                                                    \
    (FA_SMEM_FWD90_Q(bm, dp) + (stages) * (FA_SMEM_FWD90_K(bn, dp) + FA_SMEM_FWD90_V(bn, dvp)) + \
     8 * (3 + 4 * (stages)) + 1024)
/* With dropout's Philox ring (FA_DROP_RING, fa_fwd_sm90_drop.cuh), between V's stages and the
 * mbarriers: two slots of 16 bytes per consumer lane and 32-column chunk of a block, and after
 * the scratch two mbarriers per slot. */
#define FA_SMEM_FWD90_DROP_SLOT(bm, bn) ((bm) * (((bn) + 31) / 32) * 32)
#define FA_SMEM_FWD90_DROP(bm, bn) (2 * (FA_SMEM_FWD90_DROP_SLOT(bm, bn) + 16))
/* With a block mask (fa_fwd_sm90_mod.cuh), after those: the mbarriers full[2] and empty[2], 16
 * ints of the list builder's loop state, then two buffers of a count, the list of the key blocks to visit (ints) and the state table: the
 * query blocks a tile of bm rows can touch by nk key blocks (bytes); the launcher adds them. */
#define FA_SMEM_FWD90_BM_QB(bm, q_block) (((bm) - 1) / (q_block) + 2)
#define FA_SMEM_FWD90_BM_BUF(bm, bn, q_block, nk, max_sk)                                        \
    ((4 + 4 * (int)(((max_sk) + (bn) - 1) / (bn)) + FA_SMEM_FWD90_BM_QB(bm, q_block) * (nk) +    \
      3) / 4 * 4)
#define FA_SMEM_FWD90_BM(bm, bn, q_block, nk, max_sk)                                            \
    (96 + 2 * FA_SMEM_FWD90_BM_BUF(bm, bn, q_block, nk, max_sk))

/* sm90 fp8 forward (fa_fwd_sm90_fp8.cu), from a 1024-byte aligned base, one byte an element:
 * Q [bm][dp]; per stage K [bn][dp], V^T and (raw 1) the raw V [bn][dvp] it is transposed from;
 * V^T in blocks of 128 keys (rows of 128 bytes, the 128B swizzle's: a last partial block padded),
 * [ceil(bn / 128)][dvp][128]; the mbarriers q_full, q_empty, 8 bytes of scratch, and k_full,
 * k_empty, r_full, r_empty, v_full, v_empty per stage, then 8 bytes a stage of its raw V's key
 * count; 1 KB more to round the base up to the swizzle atom. raw 0: V^T is copied in from
 * global memory (FA_TRANSPOSE 2). */
#define FA_SMEM_FWD90_FP8_VT(bn, dvp) (((bn) + 127) / 128 * 128 * (dvp))
/* Its V^T pre-pass (fa_fwd_vt), dynamic (the module's limit is the forward's): a tile of
 * FA_FP8_VT_KEYS keys by FA_FP8_VT_COLS columns of V, [columns][keys + 4] bytes, for a CTA of
 * FA_FP8_VT_THREADS threads. */
#define FA_FP8_VT_KEYS 128
#define FA_FP8_VT_COLS 64
#define FA_FP8_VT_THREADS 256
#define FA_SMEM_FWD90_FP8_PREPASS (FA_FP8_VT_COLS * (FA_FP8_VT_KEYS + 4))
#define FA_SMEM_FWD90_FP8(bm, bn, dp, dvp, stages, raw)                                           \
    ((bm) * (dp) +                                                                                 \
     (stages) * ((bn) * ((dp) + (raw) * (dvp)) + FA_SMEM_FWD90_FP8_VT(bn, dvp)) +                 \
     8 * (3 + 7 * (stages)) + 1024)

/* sm80 backward (fa_bwd_sm80.cu): rows padded by 8 elements (bank conflicts); Q [qstages][bm]
 * [dp+8], dO [qstages][bm][dvp+8], K [bn][dp+8], V [bn][dvp+8], dS^T [bn][bm+8] and, with the
 * columns of dK and dV split over warps (split > 1), P^T [bn][bm+8]; then fp32 lse * log2(e) and
 * D [qstages][bm] each. */
#define FA_SMEM_BWD80_LD(cols) ((cols) + 8)
#define FA_SMEM_BWD80(bm, bn, dp, dvp, qstages, split)                                            \
    (2 * ((qstages) * (bm) * (FA_SMEM_BWD80_LD(dp) + FA_SMEM_BWD80_LD(dvp)) +                     \
          (bn) * (FA_SMEM_BWD80_LD(dp) + FA_SMEM_BWD80_LD(dvp)) +                                 \
          ((split) > 1 ? 2 : 1) * (bn) * FA_SMEM_BWD80_LD(bm)) +                                  \
     4 * 2 * (qstages) * (bm))
#define FA_SMEM_BWD80_LENS 16 /* varlen: the sequence's q_start (two ints), sq, sk after them */
/* Block mask (dense only, so in the lengths' place): the CTA's view of its states (fa_bwd_bm),
 * then the states of heads x query blocks x key blocks, then from a 4-byte boundary a bit per
 * (head, query block) whose states are not all skipped (fa_bwd_bm_live): the launcher adds
 * FA_SMEM_BWD_BM with the most key blocks a CTA meets. */
#define FA_SMEM_BWD80_BM_META 32
#define FA_SMEM_BWD_BM_LIVE(heads, nq, nkb) (((heads) * (nq) * (nkb) + 3) / 4 * 4)
#define FA_SMEM_BWD_BM(heads, nq, nkb)                                                            \
    (FA_SMEM_BWD80_BM_META + FA_SMEM_BWD_BM_LIVE(heads, nq, nkb) + 4 * (heads) * (((nq) + 31) / 32))

/* sm90 backward (fa_bwd_sm90.cu, d = dv), from a 1024-byte aligned base: K and V [bn][dp]; Q and
 * dO [stages][bm][dp]; two dS^T buffers [bn][bm]; each consumer warp's fp32 dQ piece (16 x 64);
 * the mbarriers kv_full, q_full[stages], q_empty[stages], kv_empty; the work-item slots, their
 * sequences' lengths and each stage's tile record (FA_SMEM_BWD90_SLOTS); 1 KB more to round the
 * base up to the swizzle atom. */
/* The slots: 8 ints of items and lengths, then 4 ints a stage (fa_bwd_sm90.cuh's FA_BWD90_REC,
 * whose stage qs starts FA_SMEM_BWD90_SLOTS(qs) bytes in). */
#define FA_SMEM_BWD90_SLOTS(stages) ((8 + 4 * (stages)) * 4)
#define FA_SMEM_BWD90_KV(bn, dp) ((bn) * (dp) * 2)
#define FA_SMEM_BWD90_QT(bm, dp) ((bm) * (dp) * 2)
#define FA_SMEM_BWD90_DS(bn, bm) ((bn) * (bm) * 2)
#define FA_SMEM_BWD90_DQW 4096
#define FA_SMEM_BWD90(bm, bn, dp, stages, dq_warps)                                               \
    (2 * FA_SMEM_BWD90_KV(bn, dp) + 2 * (stages) * FA_SMEM_BWD90_QT(bm, dp) +                     \
     2 * FA_SMEM_BWD90_DS(bn, bm) + (dq_warps) * FA_SMEM_BWD90_DQW + (2 + 2 * (stages)) * 8 +      \
     FA_SMEM_BWD90_SLOTS(stages) + 1024)

/* sm90 wide backward (fa_bwd_sm90_wide.cu), from a 1024-byte aligned base: K [bn][dp], V
 * [bn][dvp]; Q [stages][bm][dp], dO [stages][bm][dvp]; two P^T and two dS^T buffers [bn][bm]; the
 * mbarriers kv_full, q_full[stages], q_empty[stages], kv_empty; the work-item slots, lengths and
 * tile records (FA_SMEM_BWD90_SLOTS); 1 KB more to round the base up to the swizzle atom. */
#define FA_SMEM_BWD90W(bm, bn, dp, dvp, stages)                                                   \
    ((bn) * ((dp) + (dvp)) * 2 + (stages) * (bm) * ((dp) + (dvp)) * 2 + 4 * (bn) * (bm) * 2 +    \
     (2 + 2 * (stages)) * 8 + FA_SMEM_BWD90_SLOTS(stages) + 1024)

/* The sm80 forward's block-mask tables behind its tiles (fa_mod.cuh): the states of a tile's
 * query blocks (fa_bm_load, at most (bm - 1) / q_block + 2 of them) over nk key blocks, rounded
 * up to 4 bytes, then the live-block lookup (fa_bm_live), an int per key block. Bytes depend on
 * the call: the launcher adds them to the plan's. */
#define FA_SMEM_BM_STATES(bm, q_block, nk) (((((bm) - 1) / (q_block) + 2) * (nk) + 3) / 4 * 4)
#define FA_SMEM_BM_FWD(bm, q_block, nk) (FA_SMEM_BM_STATES(bm, q_block, nk) + 4 * (nk))

/* Decode (fa_decode.cu): stages of K [bn][dp] and V [bn][dvp] (kvb bytes an element: 2, or 1
 * for fp8 caches; no V where vin, v being K's first dvp columns, FA_V_IN_K), then Q [bm][dp]
 * (16-bit), then, paged, each stage's key rows' offsets in K and V (int64 [stages][2][bn]);
 * after the key loop the stages hold each warp's fp32 O [16][FA_DECODE_MERGE_STRIDE(dvp)] and
 * its rows' max and sum, so the total is the larger of the two layouts. */
#define FA_SMEM_DECODE_ROWS(bn, stages, paged) ((paged) ? (stages) * 2 * (bn) * 8 : 0)
#define FA_SMEM_DECODE_LOOP(bm, bn, dp, dvp, stages, paged, kvb, vin)                            \
    ((kvb) * (stages) * (bn) * ((dp) + ((vin) ? 0 : (dvp))) + 2 * (bm) * (dp) +                  \
     FA_SMEM_DECODE_ROWS(bn, stages, paged))
/* The merge's row of O: dvp + 8 floats, so that the 8-byte stores and loads of a warp's C
 * fragments (4 rows of 4 lanes per 16 lanes) fall on distinct banks. */
#define FA_DECODE_MERGE_STRIDE(dvp) ((dvp) + 8)
#define FA_SMEM_DECODE_MERGE(nwarps, dvp) (4 * (nwarps) * 16 * (FA_DECODE_MERGE_STRIDE(dvp) + 2))
#define FA_SMEM_DECODE(bm, bn, dp, dvp, stages, nwarps, paged, kvb, vin)                          \
    (FA_SMEM_DECODE_LOOP(bm, bn, dp, dvp, stages, paged, kvb, vin) >                             \
             FA_SMEM_DECODE_MERGE(nwarps, dvp)                                                   \
         ? FA_SMEM_DECODE_LOOP(bm, bn, dp, dvp, stages, paged, kvb, vin)                         \
         : FA_SMEM_DECODE_MERGE(nwarps, dvp))

/* The decode on wgmma (fa_decode_wg.cu), V read from K's stages: 1024 bytes of alignment, then
 * the stages, the Q tile, P [bm][64] and the rows' factors (fp32 [bm]), then with a paged cache
 * the stages' key row offsets (int64 [stages][bn]). */
#define FA_SMEM_DECODE_WG_STAGE(bn, dp) (2 * (bn) * (dp))
#define FA_SMEM_DECODE_WG_Q(bm, dp) (2 * (bm) * (dp))
#define FA_SMEM_DECODE_WG_P(bm) (2 * (bm) * 64)
#define FA_SMEM_DECODE_WG(bm, bn, dp, stages, paged)                                               \
    (1024 + (stages) * FA_SMEM_DECODE_WG_STAGE(bn, dp) + FA_SMEM_DECODE_WG_Q(bm, dp) +            \
     FA_SMEM_DECODE_WG_P(bm) + 4 * (bm) + ((paged) ? (stages) * (bn) * 8 : 0))

#endif /* FA_SMEM_H */
