/*
 * Forward attention for sm_90a (Hopper): FlashAttention-3's building blocks in CUDA C with inline
 * PTX: warp-specialised, TMA-fed, wgmma-computed, softmax overlapped with the GEMMs.
 *
 * One CTA computes FA_BM = 64 FA_NCW query rows of one (sequence, head) with FA_NCW + 1 warpgroups
 * (FA_NCW = 2, or 3 at head dim 64, FA3's 192-row tile there):
 *   warpgroup 0, the producer: gives its registers back (setmaxnreg.dec 24); one thread issues
 *     every TMA copy (cp.async.bulk.tensor) - Q once, then K and V of each key block into a ring
 *     of FA_STAGES shared-memory stages - each completing on an mbarrier with a byte count;
 *   warpgroups 1 .. FA_NCW, the consumers (setmaxnreg.inc 240 for two, 160 for three): 64 query
 *     rows each. Per key block:
 *     S = Q K^T with wgmma.mma_async (both operands in shared memory, by descriptor), mask, online
 *     softmax in base 2 with scale * log2(e) folded into the FFMA in front of each exp2, dropout
 *     (FA_DROPOUT: P's elements zeroed by the Philox mask after the row sums), P converted in
 *     registers to the A fragment (with dropout, the mask applied there), O += P V with the
 *     register-A form of wgmma (V by descriptor, MN-major). K and V of a stage are released to
 *     the producer separately, each on its own "empty" mbarrier as soon as the GEMM reading it
 *     has finished: K right after S, so the next K can land while this block's P V still runs.
 *     The softmax of block i runs while the tensor cores compute P_(i-1) V_(i-1) (intra-warpgroup
 *     pipelining), and with FA_PINGPONG the two consumers take turns issuing GEMMs (named
 *     barriers), so one's softmax also hides under the other's GEMMs.
 * Keys are visited from the last visible block to the first (masked blocks first), as in sm80.
 * Epilogue: O / l (times 1 / (1 - p) with dropout) and lse straight from the accumulator
 * registers; rows with no visible key and no sink give 0 and lse +inf (the sm80 family's rule).
 *
 * Shared memory (from a 1024-byte aligned base, as the 128-byte swizzle requires):
 *   Q [FA_DP/64 column blocks][FA_BM rows][128 B]
 *   K [FA_STAGES][FA_DP/64][FA_BN rows][128 B]
 *   V [FA_STAGES][FA_DVP/64][FA_BN rows][128 B]
 *   mbarriers: q_full, q_empty, k_full[S], v_full[S], k_empty[S], v_empty[S]; 8 bytes of scratch
 * Each [rows][128 B] block is the canonical 128B-swizzled layout: 16-byte chunk c of row r sits at
 * chunk c ^ (r % 8). TMA with CU_TENSOR_MAP_SWIZZLE_128B and a 64-element inner box writes exactly
 * that, and the wgmma descriptors with layout type 1 (128B swizzle) read exactly that.
 *
 * Tensor maps (built on the host by cuTensorMapEncodeTiled, src/cuda/fa_cuda_forward.c): rank 4,
 * dims {d (dv for V), rows, heads, batch} innermost first, box {64, FA_BM or FA_BN, 1, 1},
 * bf16/fp16, 128B swizzle, out-of-bounds elements zero-filled (so a partial last block reads zeros,
 * never the next head, and a head dim short of a multiple of 64 is padded with zero columns);
 * passed by value as a __grid_constant__ parameter.
 *
 * Defines from the plan (src/plan/fa_plan.c): FA_BF16, FA_D (Q and K's head dim), FA_DV (V's,
 * only where it differs from FA_D), FA_DP and FA_DVP (each rounded up to 64: 64, 128, 192 or 256;
 * V's stages and the P V product are FA_DVP wide, O holds FA_DVP / 2 registers a thread), FA_NCW,
 * FA_BM (64 FA_NCW), FA_BN (16 k 64..192), FA_STAGES, FA_SOFTCAP, FA_ALIBI, FA_DROPOUT,
 * FA_VARLEN, FA_PINGPONG; FA_SCORE_MOD, FA_MASK_MOD, FA_BLOCK_MASK only for calls with
 * user-defined scoring (the generated fa_mod_gen.cuh included; the sm80 family's semantics:
 * score_mod on every score after softcap and ALiBi, in natural-log units, mask_mod and the block
 * mask dropping keys where the window would; key blocks the block mask skips are neither loaded
 * nor computed: a producer warp publishes each tile's walk, fa_fwd_sm90_mod.cuh).
 * Varlen maps span the packed rows ({d, total, heads, 1}) and tiles take their sequence's offsets
 * from cu_seqlens. Features not compiled here (probs, unaligned rows) are routed to the
 * sm80 family by the plan.
 * Entry points: fa_fwd(kp, tensor maps) and fa_fwd_fill (varlen rows outside every sequence).
 * Its parts: fa_fwd_sm90_mainloop.cuh (the producer's loads and a consumer warpgroup's tile),
 * fa_fwd_sm90_softmax.cuh (a key block's element-wise step), fa_fwd_sm90_tile.cuh (the work
 * tiles and the pieces the fp8 kernel shares), fa_fwd_sm90_mod.cuh (the block mask's per-tile
 * lists), fa_fwd_sm90_drop.cuh (dropout's Philox ring).
 */
#include "fa_mod_flags.h"

/* Dropout's Philox runs in the producer warpgroup (fa_fwd_sm90_drop.cuh), which then keeps more
 * registers: 40 + 2 x 232 of a thread's 512 over the three warpgroups. */
#ifndef FA_DROP_RING
#define FA_DROP_RING 0
#endif
#if FA_DROP_RING
#define FA_REGS_PRODUCER 40
#define FA_REGS_CONSUMER 232
#endif

#include "fa_common.cuh"
#include "fa_sm90.cuh"
#include "fa_smem.h"

#define FA_WG_THREADS 128
#define FA_THREADS ((FA_NCW + 1) * FA_WG_THREADS)
#define FA_CONSUMER_WARPS (4 * FA_NCW) /* arrivals on each "empty" mbarrier */
#define FA_KB (FA_DP / 64)  /* 64-column (128-byte) blocks of a Q or K row */
#define FA_VB (FA_DVP / 64) /* of a V row */
#define FA_Q_BYTES FA_SMEM_FWD90_Q(FA_BM, FA_DP)
#define FA_K_BYTES FA_SMEM_FWD90_K(FA_BN, FA_DP)
#define FA_V_BYTES FA_SMEM_FWD90_V(FA_BN, FA_DVP)
#define FA_SACC (FA_BN / 2)  /* S accumulator registers per thread (m64 x FA_BN fp32) */
/* The mods' kernels take the key loop with one call site of the softmax (the first block
 * inside the loop, fa_fwd_sm90_mainloop.cuh): each site inlines the element-wise code with
 * score_mod's and the masks', which is a new mod's compile time at its first call. */
#define FA_ONE_SOFTMAX ((FA_SCORE_MOD || FA_MOD_MASKS) && !FA_DROPOUT)
#define FA_OACC (FA_DVP / 2) /* O accumulator registers per thread */
/* O leaves in 16-byte stores (fa_store_row16) except in the three-consumer tile: there they
 * worsen the compiler's schedule of the softmax, which costs more than the short epilogue saves. */
#define FA_O16 (FA_NCW != 3)

#ifndef FA_DV
#define FA_DV FA_D /* V's head dim: the plan defines it only where it differs from Q's */
#endif

#include "fa_mod.cuh"
#include "fa_fwd_sm90_mod.cuh"

/* The key block of step `it` of tile w's walk (last first), and its block-mask state. */
#if FA_BLOCK_MASK
#define FA_TILE_BLOCK(w, it) ((w)->bm_list[it] >> 2)
#define FA_TILE_STATE(w, it) ((w)->bm_list[it] & 3)
#else
#define FA_TILE_BLOCK(w, it) ((w)->n_max - 1 - (it))
#define FA_TILE_STATE(w, it) FA_BM_PARTIAL /* mask_mod alone: every block consults it */
#endif

#if FA_BM != 64 * FA_NCW || FA_DP % 64 != 0 || FA_DP > 256 || FA_DVP % 64 != 0 ||                \
    FA_DVP > 256 || FA_STAGES < 2
#error "fa_fwd_sm90.cu: BM = 64 x consumers, d and dv padded to 64, 128, 192 or 256, >= 2 stages"
#endif
#if (FA_NCW != 2 && FA_NCW != 3) || (FA_NCW == 3 && (FA_PINGPONG || FA_DP != 64 || FA_DVP != 64))
#error "fa_fwd_sm90.cu: 2 consumer warpgroups, or 3 (d, dv 64, no pingpong: 160 registers each)"
#endif
#if FA_DROP_RING && (!FA_DROPOUT || FA_NCW != 2 || FA_SCORE_MOD || FA_MOD_MASKS)
#error "fa_fwd_sm90.cu: the Philox ring is for dropout with two consumers and no mods"
#endif

/* The kernel's second parameter: the Q, K, V tensor maps (fa_tmap, fa_sm90.cuh), the schedule
 * and dropout's Philox round keys; the same layout as fa_cuda_tmaps on the host. */
typedef struct fa_tmaps {
    fa_tmap q, k, v;
    int paired; /* the grid's work units are mirrored pairs of query tiles (fa_unit_tile) */
    /* fa_philox_keys of the seed, read from the parameter bank: computed in the kernel, they
     * would sit in registers across the key loop, which head dim 256 cannot spare */
    fa_u32 philox_keys[2 * FA_RULE_PHILOX_ROUNDS];
} fa_tmaps;

/* S (+)= Q K^T for one k-step, both operands K-major in shared memory, N = FA_BN. */
#if FA_BN == 64
FA_DEF_WGMMA_SS(fa_wgmma_s, 64, FA_RL32, FA_FL32, "%32", "%33", "%34", "0, 0")
#elif FA_BN == 80
FA_DEF_WGMMA_SS(fa_wgmma_s, 80, FA_RL40, FA_FL40, "%40", "%41", "%42", "0, 0")
#elif FA_BN == 96
FA_DEF_WGMMA_SS(fa_wgmma_s, 96, FA_RL48, FA_FL48, "%48", "%49", "%50", "0, 0")
#elif FA_BN == 112
FA_DEF_WGMMA_SS(fa_wgmma_s, 112, FA_RL56, FA_FL56, "%56", "%57", "%58", "0, 0")
#elif FA_BN == 128
FA_DEF_WGMMA_SS(fa_wgmma_s, 128, FA_RL64, FA_FL64, "%64", "%65", "%66", "0, 0")
#elif FA_BN == 144
FA_DEF_WGMMA_SS(fa_wgmma_s, 144, FA_RL72, FA_FL72, "%72", "%73", "%74", "0, 0")
#elif FA_BN == 160
FA_DEF_WGMMA_SS(fa_wgmma_s, 160, FA_RL80, FA_FL80, "%80", "%81", "%82", "0, 0")
#elif FA_BN == 176
FA_DEF_WGMMA_SS(fa_wgmma_s, 176, FA_RL88, FA_FL88, "%88", "%89", "%90", "0, 0")
#elif FA_BN == 192
FA_DEF_WGMMA_SS(fa_wgmma_s, 192, FA_RL96, FA_FL96, "%96", "%97", "%98", "0, 0")
#else
#error "fa_fwd_sm90.cu: FA_BN must be a multiple of 16 from 64 to 192"
#endif

#include "fa_fwd_sm90_tile.cuh"
#include "fa_fwd_sm90_softmax.cuh"

/* Issues S = Q K^T for one key block (FA_DP / 16 k-steps) as one wgmma group, from the
 * descriptors of the warpgroup's Q rows and of the block's K (both K-major). */
FA_DEV void fa_gemm_s(float *sacc, fa_u64 q_rows, fa_u64 k_rows)
{
#pragma unroll
    for (int kk = 0; kk < FA_DP / 16; kk++) {
        const fa_u32 koff = (kk & 3) * 32;
        fa_wgmma_s(sacc, fa_desc_at(q_rows, (kk >> 2) * FA_BM * 128 + koff),
                   fa_desc_at(k_rows, (kk >> 2) * FA_BN * 128 + koff), kk > 0);
    }
    fa_wg_commit();
}

/* Issues O += P V for one key block as one wgmma group: FA_BN / 16 k-slices, each over the
 * 64-column blocks of V in n128 (then n64) steps; v_tile is the block's V descriptor
 * (MN-major). */
FA_DEV void fa_gemm_pv(float *o, fa_u32 pa[][4], fa_u64 v_tile)
{
#pragma unroll
    for (int kk = 0; kk < FA_BN / 16; kk++) {
#pragma unroll
        for (int c = 0; c + 1 < FA_VB; c += 2)
            fa_wgmma_pv128(o + 32 * c, pa[kk], fa_desc_at(v_tile, c * FA_BN * 128 + kk * 2048));
#if FA_VB % 2
        fa_wgmma_pv64(o + 32 * (FA_VB - 1), pa[kk],
                      fa_desc_at(v_tile, (FA_VB - 1) * FA_BN * 128 + kk * 2048));
#endif
    }
    fa_wg_commit();
}

/* P (probabilities in sacc) as the A fragments of FA_BN / 16 k-slices: slice kk is sacc[8kk ..]. */
FA_DEV void fa_p_pack(const float *sacc, fa_u32 pa[][4])
{
#pragma unroll
    for (int kk = 0; kk < FA_BN / 16; kk++)
#pragma unroll
        for (int r = 0; r < 4; r++)
            pa[kk][r] = fa_pack2(sacc[8 * kk + 2 * r], sacc[8 * kk + 2 * r + 1]);
}

/* Shared-memory addresses of the tiles and barriers. */
typedef struct fa_smem_map {
    fa_u32 q, k, v;      /* Q, K[stage], V[stage] */
    fa_u32 q_full, q_empty;
    fa_u32 k_full, v_full, k_empty, v_empty; /* + 8 * stage */
    fa_u32 scratch; /* 8 bytes that fa_softmax_order writes and nothing reads */
#if FA_DROP_RING
    fa_u32 drop, drop_full, drop_empty; /* + slot * FA_DROP_SLOT_BYTES, + 8 * slot */
#endif
#if FA_BLOCK_MASK
    fa_u32 bm_full, bm_empty; /* + 8 * buffer (fa_fwd_sm90_mod.cuh) */
    volatile int *bm_walk;    /* the list builder's loop bounds (fa_fwd_sm90_mod.cuh) */
    unsigned char *bm;        /* the two buffers */
#endif
} fa_smem_map;

#include "fa_fwd_sm90_mainloop.cuh"

/* ---- the kernel ----------------------------------------------------------------------------- */

/* The grid is 1-D: one CTA per work unit, or (persistent) fewer CTAs that stride over the units,
 * the producer loading the next tile's Q, K and V while the consumers finish the current one. */
extern "C" __global__ void __launch_bounds__(FA_THREADS, 1)
    fa_fwd(const fa_kparams kp, const __grid_constant__ fa_tmaps tm)
{
    extern __shared__ __align__(1024) unsigned char fa_smem[];
    /* The plan adds 1024 bytes so the base can be rounded up to the swizzle atom. */
    fa_smem_map m;
    /* With varlen, ALiBi and dropout the consumers' loop runs out of registers: there the
     * intrinsic, which the compiler sees through (the map is the window's base plus constants,
     * rematerialised rather than spilled); elsewhere fa_smem_addr's opaque form, with which
     * the other feature sets compile to faster code. */
#if FA_VARLEN && FA_ALIBI && FA_DROPOUT
    const fa_u32 base = (fa_u32)__cvta_generic_to_shared(fa_smem);
#else
    const fa_u32 base = fa_smem_addr(fa_smem);
#endif
    m.q = (base + 1023u) & ~1023u;
    m.k = m.q + FA_Q_BYTES;
    m.v = m.k + FA_STAGES * FA_K_BYTES;
#if FA_DROP_RING
    m.drop = m.v + FA_STAGES * FA_V_BYTES;
    m.q_full = m.drop + FA_DROP_SLOTS * FA_DROP_SLOT_BYTES;
#else
    m.q_full = m.v + FA_STAGES * FA_V_BYTES;
#endif
    m.q_empty = m.q_full + 8;          /* FA_CONSUMER_WARPS arrivals: lane 0 of each */
    m.k_full = m.q_empty + 8;
    m.v_full = m.k_full + 8 * FA_STAGES;
    m.k_empty = m.v_full + 8 * FA_STAGES; /* FA_CONSUMER_WARPS arrivals each */
    m.v_empty = m.k_empty + 8 * FA_STAGES;
    m.scratch = m.v_empty + 8 * FA_STAGES;
#if FA_DROP_RING
    m.drop_full = m.scratch + 8;
    m.drop_empty = m.drop_full + 8 * FA_DROP_SLOTS;
#endif
#if FA_BLOCK_MASK
    m.bm_full = m.scratch + 8;
    m.bm_empty = m.bm_full + 16;
    m.bm_walk = (volatile int *)(fa_smem + (m.bm_empty + 16 - base));
    m.bm = (unsigned char *)(m.bm_walk + 16);
#endif

    if (threadIdx.x == 0) {
        fa_mbar_init(m.q_full, 1);
        fa_mbar_init(m.q_empty, FA_CONSUMER_WARPS);
        for (int s = 0; s < FA_STAGES; s++) {
            fa_mbar_init(m.k_full + 8 * s, 1);
            fa_mbar_init(m.v_full + 8 * s, 1);
            fa_mbar_init(m.k_empty + 8 * s, FA_CONSUMER_WARPS);
            fa_mbar_init(m.v_empty + 8 * s, FA_CONSUMER_WARPS);
        }
#if FA_DROP_RING
        for (int s = 0; s < FA_DROP_SLOTS; s++) {
            fa_mbar_init(m.drop_full + 8 * s, FA_DROP_THREADS);
            fa_mbar_init(m.drop_empty + 8 * s, FA_CONSUMER_WARPS);
        }
#endif
#if FA_BLOCK_MASK
        for (int i = 0; i < 2; i++) {
            fa_mbar_init(m.bm_full + 8 * i, 32); /* every lane of the list's warp */
            fa_mbar_init(m.bm_empty + 8 * i, FA_CONSUMER_WARPS + 1); /* and the loading thread */
        }
#endif
        fa_mbar_init_fence();
    }
    __syncthreads();

    const int m_blocks = (int)((kp.max_sq + FA_BM - 1) / FA_BM);
    const int n_units = fa_units(tm.paired, m_blocks, &kp);
    int kv = 0, q_round = 0;
    /* Broadcast, so that the compiler knows it warp-uniform and keeps what derives from it (the
     * consumers' Q descriptor) in uniform registers, where wgmma takes descriptors. */
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / FA_WG_THREADS, 0);
#if FA_BLOCK_MASK
    /* The same loops with the block mask's walk: the producer's second warp builds each tile's
     * list, its first thread loads the blocks listed, the consumers compute them; the first
     * thread and the consumers release the list's buffer (fa_fwd_sm90_mod.cuh). Two warps, so
     * that neither holds the other's state in the producer's few registers. */
    int bm_round = 0;
    if (wg == 0) {
        fa_regs_producer();
        if (threadIdx.x >= 32 && threadIdx.x < 64) {
            /* The loop's state in shared memory, read where used: held in registers across the
             * list's build, ptxas spilled it (24 registers). Lane 0 steps the counters. */
            volatile int *const walk = m.bm_walk;
            const int lane = threadIdx.x & 31;
            if (lane == 0) {
                walk[0] = n_units;
                walk[1] = m_blocks;
                walk[2] = gridDim.x;
                walk[3] = (int)kp.max_sq; /* dense: every sequence's lengths */
                walk[4] = (int)kp.max_sk;
                walk[5] = kp.window_left;
                walk[6] = kp.window_right;
                walk[7] = 0; /* the step: unit blockIdx.x + (step / 2) gridDim.x, half step % 2 */
                walk[8] = 0; /* the tiles with key blocks so far (bm_round) */
                walk[9] = fa_bm_buf_bytes(&kp);
                walk[10] = fa_bm_list_max(&kp);
            }
            for (;;) {
                __syncwarp();
                const int k = walk[7];
                __syncwarp();
                if (lane == 0)
                    walk[7] = k + 1;
                const int t = blockIdx.x + (k >> 1) * walk[2];
                if (t >= walk[0])
                    break;
                int hb;
                const int mb = fa_unit_tile(tm.paired, walk[1], t, k & 1, &hb);
                if (mb < 0)
                    continue;
                /* fa_tile_get's key blocks (fa_tile_keys), from the values read here. */
                const int m0 = mb * FA_BM, sq = walk[3], sk = walk[4];
                fa_i64 lo, hi;
                FA_RULE_TILE_KEYS(m0, fa_min(m0 + FA_BM, sq) - m0, sq, sk, walk[5], walk[6], lo,
                                  hi);
                const int k_lo = (int)lo, k_hi = (int)hi;
                if (m0 >= sq || k_hi <= k_lo)
                    continue;
                const int round = walk[8], n_max = (k_hi + FA_BN - 1) / FA_BN;
                __syncwarp();
                if (lane == 0)
                    walk[8] = round + 1;
                const int count =
                    fa_bm_fill(&kp, fa_bm_buf_at(m.bm, round & 1, walk[9], walk[10]),
                               m.bm_empty + 8 * (round & 1), round, hb / kp.h, hb % kp.h, m0,
                               fa_min(m0 + FA_BM, sq) - 1, n_max, n_max - k_lo / FA_BN, sk, lane);
                /* The buffer again (round + 1 now), rather than held over the fill. */
                const int i = (walk[8] - 1) & 1;
                fa_bm_publish(fa_bm_buf_at(m.bm, i, walk[9], walk[10]), m.bm_full + 8 * i, count,
                              lane);
            }
            return;
        }
        if (threadIdx.x != 0)
            return;
        fa_tma_prefetch(&tm.q);
        fa_tma_prefetch(&tm.k);
        fa_tma_prefetch(&tm.v);
        for (int t = blockIdx.x; t < n_units; t += gridDim.x)
            for (int half = 0, hb, mb; half < 2; half++)
                if ((mb = fa_unit_tile(tm.paired, m_blocks, t, half, &hb)) >= 0) {
                    fa_tile w = fa_tile_get(&kp, hb, mb);
                    if (w.n_blocks == 0)
                        continue;
                    const int i = bm_round & 1;
                    const fa_bm_buf b = fa_bm_buf_at(m.bm, i, fa_bm_buf_bytes(&kp), fa_bm_list_max(&kp));
                    fa_mbar_wait(m.bm_full + 8 * i, (bm_round >> 1) & 1);
                    bm_round++;
                    w.n_blocks = *(volatile int *)b.count;
                    w.bm_list = b.list;
                    if (w.n_blocks > 0)
                        fa_produce_tile(&m, &tm, &w, &kv, &q_round);
                    fa_mbar_arrive(m.bm_empty + 8 * i);
                }
        return;
    }
    fa_regs_consumer();
    for (int t = blockIdx.x; t < n_units; t += gridDim.x)
        for (int half = 0, hb, mb; half < 2; half++)
            if ((mb = fa_unit_tile(tm.paired, m_blocks, t, half, &hb)) >= 0) {
                fa_tile w = fa_tile_get(&kp, hb, mb);
                if (w.n_blocks == 0) { /* no table: the epilogue only */
                    fa_consume_tile(&kp, &tm, &m, &w, wg - 1, &kv, &q_round);
                    continue;
                }
                const int i = bm_round & 1;
                const fa_bm_buf b = fa_bm_buf_at(m.bm, i, fa_bm_buf_bytes(&kp), fa_bm_list_max(&kp));
                fa_mbar_wait(m.bm_full + 8 * i, (bm_round >> 1) & 1);
                bm_round++;
                /* Broadcast from lane 0: the compiler then knows the count warp-uniform, and
                 * so the stage counters derived from it, which keeps the wgmma descriptors in
                 * uniform registers (else moved there before every wgmma). */
                w.n_blocks = __shfl_sync(0xffffffffu, *(volatile int *)b.count, 0);
                w.bm_list = b.list;
                w.bm_tab = b.tab;
                fa_consume_tile(&kp, &tm, &m, &w, wg - 1, &kv, &q_round);
                fa_stage_release(m.bm_empty + 8 * i, threadIdx.x & 31);
            }
#else
    if (wg == 0) {
        fa_regs_producer();
#if FA_DROP_RING
        if (threadIdx.x >= 32) {
            fa_drop_produce(&kp, &tm, &m, m_blocks, n_units);
            return;
        }
#endif
        if (threadIdx.x != 0)
            return;
        fa_tma_prefetch(&tm.q);
        fa_tma_prefetch(&tm.k);
        fa_tma_prefetch(&tm.v);
        for (int t = blockIdx.x; t < n_units; t += gridDim.x)
            for (int half = 0, hb, mb; half < 2; half++)
                if ((mb = fa_unit_tile(tm.paired, m_blocks, t, half, &hb)) >= 0) {
                    const fa_tile w = fa_tile_get(&kp, hb, mb);
                    if (w.n_blocks > 0)
                        fa_produce_tile(&m, &tm, &w, &kv, &q_round);
                }
        return;
    }
    fa_regs_consumer();
    for (int t = blockIdx.x; t < n_units; t += gridDim.x)
        for (int half = 0, hb, mb; half < 2; half++)
            if ((mb = fa_unit_tile(tm.paired, m_blocks, t, half, &hb)) >= 0) {
                const fa_tile w = fa_tile_get(&kp, hb, mb);
                fa_consume_tile(&kp, &tm, &m, &w, wg - 1, &kv, &q_round);
            }
#endif
}

extern "C" __global__ void fa_fwd_fill(const fa_kparams kp) { fa_fill_outside(&kp); }
