/*
 * Attention for few query rows against many keys (decoding, chunked prefill) on mma.sync
 * (sm80 and later, Hopper included): the KV cache read in place (paged through block_table, or
 * one cache row per sequence), packed GQA and the keys split across CTAs.
 *
 * Packed GQA: the g = h / hk query heads of a kv head, times the query rows, are the rows of one
 * tile (row x = query row x / g, head x % g), so each key and value is read once per kv head.
 * A CTA takes FA_BM = 16 * FA_WM such rows and one chunk (split) of the keys they see; its
 * FA_WM x FA_WN warps split the rows by 16 and each key block of FA_BN keys by FA_WN, every warp
 * keeping its own online softmax, merged through shared memory at the end. Key blocks stream
 * through FA_STAGES cp.async stages; the page of every key row is looked up a block ahead of its
 * copy, so any page size works. Where the first blocks do not depend on cache_seqlens (no left
 * window edge, one split), they are copied before it is read. With one split the CTA writes out and lse; with several it writes fp32
 * partials that fa_combine.cu merges, or (dp.cluster_merge, sm_90) the splits of a row tile are
 * the CTAs of one thread block cluster and merge their partials through distributed shared
 * memory themselves (fa_decode_merge_cluster): no workspace and no second launch.
 *
 * Indices come from device memory the host did not read (cache_seqlens, cache_leftpad,
 * cache_batch_idx, block_table): each is clamped into the cache, so a bad one gives a wrong
 * answer for its sequence, never an access outside the caller's tensors.
 *
 * Defines from the plan (src/plan/fa_plan_decode.c, fa_plan_decode):
 *   FA_BF16          data type (0: fp16, 1: bf16)
 *   FA_DP, FA_DVP    head dims of q/k and v padded to 32 or a multiple of 64; with
 *                    FA_DV_SLICES, FA_DVP is the width of one slice of v's columns
 *   FA_DV_SLICES     v's (and out's) columns cut into slices of FA_DVP, one CTA each, every
 *                    one computing the whole S (heads past 256: MLA's d 576 / dv 512, whose
 *                    O would not fit one thread's registers); default 1
 *   FA_V_IN_K        1: v's rows are the first dv columns of k's (MLA's cache): the stages
 *                    hold K alone and P V reads V from it; default 0
 *   FA_WM, FA_WN     warps over the rows and over each key block
 *   FA_MIN_CTAS      CTAs per SM the shared memory allows (launch bounds)
 *   FA_BN, FA_STAGES keys per block, blocks in flight
 *   FA_PAGED         1: block_table maps positions to blocks
 *   FA_VEC           1: 16-byte aligned rows (q, caches, out) and d, dv % 8 == 0: 16-byte copies
 *   FA_VARLEN, FA_ALIBI, FA_SOFTCAP
 *   FA_KV_FP8        defined only for fp8 caches: 1 e4m3, 2 e5m2 (fa_decode_fp8.cuh); the
 *                    caches of q's dtype compile without it, as before
 * Entry points: fa_kv_append (the new keys and values written into the cache, rotated),
 * fa_decode (the attention; it does the append itself where the host allows, append_fused) and
 * fa_decode_fill (a varlen forward's rows outside every sequence).
 *
 * A varlen forward with few rows per sequence runs here too (FA_VARLEN): cu_seqlens_q/k (and
 * seqused_k) in the forward's block locate each sequence's rows of q, out and lse and its keys
 * in k and v, whose batch strides the host leaves 0; with FA_PAGED too, its keys are positions
 * [0, sk) of its block_table row (fa_seq_get).
 */
#include "fa_common.cuh"
#include "fa_dkparams.h"
#include "fa_smem.h"

#define FA_NWARPS (FA_WM * FA_WN)
#define FA_THREADS (FA_NWARPS * 32)
#define FA_BM (16 * FA_WM)             /* packed rows per CTA */
#define FA_WKEYS (FA_BN / FA_WN)       /* keys of a block per warp */
#define FA_NT (FA_WKEYS / 8)           /* 8-key n-tiles of a warp's S */
#define FA_OT (FA_DVP / 8)             /* 8-column n-tiles of O */
#define FA_KS (FA_DP / 16)             /* k-steps of Q K^T */
/* Q K^T's k-steps unrolled whole up to d 256; past it (d 576: 36 steps) by 4, as ptxas, loading
 * every step's fragments ahead, otherwise spills beside a 256-column O (an enum: #pragma unroll
 * takes a constant but expands no macro) */
enum { fa_ks_unroll = FA_KS > 16 ? 4 : FA_KS };
#define FA_CPR_K (FA_DP / 8)           /* 16-byte chunks per row of Q and K */
#define FA_CPR_V (FA_DVP / 8)

#ifndef FA_KV_FP8
#define FA_KV_FP8 0
#endif
#ifndef FA_DV_SLICES
#define FA_DV_SLICES 1
#endif
/* v's padded columns over every slice: the append writes whole rows */
#define FA_DV_ALL (FA_DVP * FA_DV_SLICES)
/* The columns of v a slice from vc0 holds, of dv */
#define FA_SLICE_COLS(dv, vc0) (FA_DV_SLICES > 1 ? fa_min((dv) - (vc0), FA_DVP) : (dv))
#ifndef FA_V_IN_K
#define FA_V_IN_K 0
#endif
/* A stage: K [FA_BN][FA_DP] then V [FA_BN][FA_DVP] (none with FA_V_IN_K), in q's dtype or fp8. */
#define FA_KV_ESIZE (FA_KV_FP8 ? 1 : 2) /* bytes of a cache element */
#define FA_STAGE_BYTES (FA_BN * (FA_DP + (FA_V_IN_K ? 0 : FA_DVP)) * FA_KV_ESIZE)
/* 16-byte chunks of a stage row of V: its own, or K's */
#define FA_V_ROW_CHUNKS (FA_V_IN_K ? FA_CPR_K : FA_CPR_V)
#define FA_KV_CPR_K (FA_DP * FA_KV_ESIZE / 16) /* 16-byte chunks per row of a K, V stage */
#define FA_KV_CPR_V (FA_DVP * FA_KV_ESIZE / 16)
#define FA_KV_CHUNKS_K ((FA_BN * FA_KV_CPR_K + FA_THREADS - 1) / FA_THREADS)
#define FA_KV_CHUNKS_V ((FA_BN * FA_KV_CPR_V + FA_THREADS - 1) / FA_THREADS)

#if FA_PAGED && FA_BN > FA_THREADS
#error "paged: a thread per key row of a block"
#endif
#if FA_WKEYS % 16 != 0 || FA_DP % 16 != 0 || FA_DVP % 16 != 0 || FA_STAGES < 2
#error "a warp's keys, d and dv must be multiples of the mma shape; two stages at least"
#endif

#define FA_PRESCALE (FA_SOFTCAP || FA_ALIBI)

/* Paged: the first blocks' rows looked up before cache_seqlens lands (fa_decode), where the
 * registers allow it: up to d + dv = 256 (wider heads spilled with it, in the main loop). */
#define FA_EARLY_ROWS (FA_PAGED && !FA_VARLEN && FA_DP + FA_DVP <= 256)
/* The first stages' copies issued before cache_seqlens lands (fa_decode): a contiguous cache,
 * or a paged one where its rows are looked up early; not with fp8 caches, whose Q scale takes
 * stage 0 as scratch before the copies. */
#define FA_EARLY_COPIES (!FA_VARLEN && !FA_KV_FP8 && (FA_EARLY_ROWS || !FA_PAGED))

#include "fa_decode_cache.cuh"
#include "fa_decode_check.cuh"

#if FA_KV_FP8
#include "fa_decode_fp8.cuh"
#else
/* O's C fragment element (n-tile ot, lane quad position t, element e of a row's pair): its
 * column of v. */
#define FA_OCOL(ot, t, e) ((ot) * 8 + 2 * (t) + (e))
#endif

#include "fa_decode_append.cuh"

#include "fa_decode_copy.cuh"

#include "fa_decode_merge.cuh"
#include "fa_decode_softmax.cuh"
#include "fa_decode_store.cuh"

extern "C" __global__ void __launch_bounds__(FA_THREADS, FA_MIN_CTAS) fa_decode(const fa_dkparams dp)
{
    extern __shared__ __align__(128) fa_u16 fa_smem[];
    const fa_kparams *kp = &dp.f;
    const fa_u32 base_a = fa_smem_addr(fa_smem);
    /* Stages of K [FA_BN][FA_DP] then V [FA_BN][FA_DVP]; Q [FA_BM][FA_DP] after them. */
    const fa_u32 q_a = base_a + FA_STAGES * FA_STAGE_BYTES;
    fa_u16 *const q_p = fa_smem + FA_STAGES * FA_STAGE_BYTES / 2;
    /* Paged: each stage's key rows' byte offsets in K and V, int64 [FA_STAGES][2][FA_BN] in
     * fa_row_slot's order (fa_decode_copy.cuh), after Q. */
    fa_i64 *const rows_p = (fa_i64 *)(q_p + FA_BM * FA_DP);
    /* After the loop: the warps' merge (FA_WN > 1), then a cluster merge's partial. */
    float *const fa_smem_f32 = (float *)fa_smem;

    /* x: the slice of v's columns fastest, then the split, then the row tile */
    const int vslice = (int)blockIdx.x % FA_DV_SLICES, bx = (int)blockIdx.x / FA_DV_SLICES;
    const int m_block = fa_div_splits(&dp, bx), split = bx - m_block * dp.splits;
    /* this CTA's columns of v and out: [vc0, vc0 + dvs) */
    const int vc0 = vslice * FA_DVP;
    const int dvs = FA_SLICE_COLS(kp->dv, vc0);
    const int kh = blockIdx.y, bi = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g8 = lane >> 2, t = lane & 3;
    const int wm = warp % FA_WM, wn = warp / FA_WM;
    /* The sequence's query rows: max_sq of its batch row, or a varlen forward's rows
     * [q_start, q_start + sq) of q (cu_seqlens_q). A tile past them has nothing to do. */
    const fa_seq qs = fa_seq_get(kp, bi, FA_VARLEN);
    const int g = dp.g, sq = qs.sq, rows = sq * g;
    const int r0 = m_block * FA_BM;
#if FA_VARLEN
    if (r0 >= rows)
        return;
#endif
#if FA_EARLY_ROWS || FA_EARLY_COPIES
    /* Without a left window edge, splits or leftpad (nor, for a contiguous cache, batch_idx),
     * the first blocks are positions [0, FA_STAGES * FA_BN) of the sequence whatever
     * cache_seqlens says, so they need not wait for it. A paged cache's rows are looked up and
     * kept by every CTA, unconditionally (positions clamped into the table's row), so that the
     * compiler issues the table reads before anything waits on cache_seqlens; the CTAs that do
     * not qualify redo it below. */
    const int early =
        kp->window_left < 0 && dp.splits == 1 && !dp.leftpad && (FA_PAGED || !dp.batch_idx);
#if FA_EARLY_ROWS
    {
        /* every table read issued before the first store, which would otherwise wait; none
         * where the table has no column (a capacity of 0) */
        fa_paged_key pr[FA_STAGES];
#pragma unroll
        for (int s = 0; s < FA_STAGES; s++) {
            const fa_i64 pos = (fa_i64)s * FA_BN + threadIdx.x;
            pr[s].blk = 0, pr[s].row = 0;
            if (kp->max_sk > 0)
                pr[s] = fa_decode_row_at(&dp, dp.block_table + bi * dp.bt_bstride,
                                         (fa_u32)(pos < kp->max_sk ? pos : kp->max_sk - 1));
        }
#pragma unroll
        for (int s = 0; s < FA_STAGES; s++)
            fa_decode_row_keep(kp, fa_kv_last_block(&dp), pr[s],
                               rows_p + s * FA_DECODE_ROWS_STRIDE);
    }
#endif
#if FA_EARLY_COPIES
    /* Without an append here (whose rows they would read), the first FA_STAGES - 1 blocks are
     * copied whole (positions below the capacity) before cache_seqlens is read; the rows past
     * the tile's keys are zeroed once they land (below). */
    const int copied = early && !(dp.append_fused && dp.s_new > 0);
    if (copied) {
        const fa_kvseq whole = {0, kp->max_sk, kp->max_sk, bi, 0, 0};
#if FA_PAGED
        __syncthreads(); /* the rows kept above */
#endif
#pragma unroll
        for (int s = 0; s < FA_STAGES - 1; s++) {
            fa_decode_load(&dp, kh, &whole, (fa_i64)s * FA_BN, kp->max_sk, base_a,
                           (char *)fa_smem, s, rows_p + s * FA_DECODE_ROWS_STRIDE, vc0);
            fa_cp_async_commit();
        }
        /* which the compiler does not move code across: without it, the code that waits for
         * cache_seqlens (below) was scheduled before the copies */
        __syncwarp();
    }
#endif
#elif FA_PAGED
    const int early = 0;
#endif
    const fa_kvseq seq = fa_kvseq_get(&dp, bi);
    const int n = (int)(seq.end - seq.start);

    /* The keys the CTA's rows see, cut into blocks; this split's blocks [nb0, nb1). The
     * capacity check and the fused append (fa_decode_append.cuh) before the first copy. */
    const fa_decode_range kr = fa_decode_range_get(&dp, r0, rows, sq, n, split);
    const int klo = kr.klo, khi = kr.khi, nb0 = kr.nb0, nb1 = kr.nb1;
    fa_decode_start(&dp, &seq, bi, kh, m_block == 0 && split == 0, &kr, warp, lane);

#if FA_KV_FP8
    /* The scratch of the Q tile's scale: stage 0, which no copy writes before this returns. */
    const float q_down =
        fa_decode_load_q8(&dp, bi, qs.q_start, kh, &seq, r0, rows, g, q_p, fa_smem_f32);
    /* fp8 caches: the stages hold fp8 (fa_decode_fp8.cuh); k_descale of the CTA's (sequence,
     * kv head) and the Q tile's scale join the softmax scale (softcap's pre-factor where
     * softcap is on), v_descale the final normalisation. */
    const float kdesc =
        fa_fp8_descale(dp.k_descale, dp.kd_bstride, dp.kd_hstride, bi, kh) * q_down;
    const float vdesc = fa_fp8_descale(dp.v_descale, dp.vd_bstride, dp.vd_hstride, bi, kh);
    const float fp8_pre = kp->softcap_pre * kdesc;
    (void)fp8_pre;
    const float fp8_scale_log2 = FA_SOFTCAP ? kp->scale_log2 : kp->scale_log2 * kdesc;
#define FA_SCALE_LOG2 fp8_scale_log2
#define FA_SOFTCAP_PRE fp8_pre
#else
#define FA_SCALE_LOG2 kp->scale_log2
#define FA_SOFTCAP_PRE kp->softcap_pre
#endif
    const int prescale = FA_PRESCALE || !(FA_SCALE_LOG2 > 0.f);
    const float sm = prescale ? 1.f : FA_SCALE_LOG2;
    float row_max[2] = {-FA_INF, -FA_INF}, row_sum[2] = {0.f, 0.f};
    float o[FA_OT][4];
#pragma unroll
    for (int ot = 0; ot < FA_OT; ot++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            o[ot][e] = 0.f;

    /* ldmatrix addresses at k-step / n-pair / d-pair 0, as in fa_fwd_sm80.cu, offset by the
     * warp's 16 rows (Q) and its FA_WKEYS keys of the block (K, V). */
    const fa_u32 q_ld = q_a + fa_swz(wm * 16 + (lane & 15), lane >> 4, FA_CPR_K);
    const fa_u32 k_ld =
        base_a + fa_swz(wn * FA_WKEYS + (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1, FA_CPR_K);
#if FA_V_IN_K
    /* V: columns [vc0, vc0 + FA_DVP) of K's rows; vc0 * 2 bytes is whole 8-chunk groups, which
     * leaves each row's swizzle as it was */
    const fa_u32 v_ld = base_a + vc0 * 2 +
                        fa_swz(wn * FA_WKEYS + (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4,
                               FA_CPR_K);
#else
    const fa_u32 v_ld = base_a + FA_BN * FA_DP * 2 +
                        fa_swz(wn * FA_WKEYS + (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4,
                               FA_CPR_V);
#endif
#if FA_KV_FP8
    /* The fp8 stages' reads (fa_decode_qk8, fa_decode_pv8). */
    const fa_rd8 k8_rd = fa_rd8_make(base_a, wn * FA_WKEYS + (lane & 7) + (((lane >> 3) & 1) << 3),
                                     lane >> 4, FA_CPR_K8, 0);
    fa_rd8 v8_rd[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
        v8_rd[i] = fa_rd8_make(base_a + FA_BN * FA_DP, wn * FA_WKEYS + 2 * t + (i & 1) + 8 * (i >> 1),
                               g8 >> 2, FA_CPR_V8, 4 * (g8 & 3));
    (void)k_ld, (void)v_ld;
#endif

    /* Paged: the rows of the first FA_STAGES blocks found and kept before any copy (above,
     * where `early`). */
#if FA_PAGED
    if (!early)
#pragma unroll
        for (int s = 0; s < FA_STAGES; s++)
            if (nb0 + s < nb1)
                fa_decode_row_keep(
                    kp, seq.last_block,
                    fa_decode_row_find(&dp, &seq, klo + (fa_i64)(nb0 + s) * FA_BN, khi),
                    rows_p + s * FA_DECODE_ROWS_STRIDE);
    __syncthreads();
#endif
#if FA_EARLY_COPIES
    if (copied) {
        /* Rows of the early stages past the sequence's keys (klo = 0) hold whatever the cache
         * has there: zeroed, as a copy zero-fills them (a dropped key's P is 0, and 0 times a
         * NaN in V would not be). */
        if (khi < (FA_STAGES - 1) * FA_BN) {
            fa_cp_async_wait_all();
            __syncthreads();
            fa_decode_stages_zero((char *)fa_smem, khi);
            __syncthreads();
        }
    } else
#endif
#pragma unroll
        for (int s = 0; s < FA_STAGES - 1; s++) {
            if (nb0 + s < nb1)
                fa_decode_load(&dp, kh, &seq, klo + (fa_i64)(nb0 + s) * FA_BN, khi, base_a,
                               (char *)fa_smem, s, rows_p + s * FA_DECODE_ROWS_STRIDE, vc0);
            fa_cp_async_commit();
        }
#if !FA_KV_FP8
    /* Q after the first copies are issued, so that its loads wait beside theirs, not before. */
    fa_decode_load_q(&dp, bi, qs.q_start, kh, &seq, r0, rows, g, q_p);
#endif

    /* This thread's two rows (g8 and g8 + 8 of its warp's 16): their visible keys, slopes;
     * worked out while the first copies are in flight. */
    int row_h[2];
    const fa_decode_rows rw =
        fa_decode_rows_get(&dp, r0 + wm * 16 + g8, rows, kh, bi, sq, n, row_h);

    for (int nb = nb0; nb < nb1; nb++) {
        const int slot = (nb - nb0) % FA_STAGES;
#if FA_PAGED
        /* Block nb + FA_STAGES's rows, for this slot, whose own rows were last read by the copy
         * of block nb, issued FA_STAGES - 1 iterations ago (kept after this block's math,
         * below); the table read issued before the wait, so that the wait hides it too. */
        fa_paged_key next_row = {0, 0};
        if (nb + FA_STAGES < nb1)
            next_row = fa_decode_row_find(&dp, &seq, klo + (fa_i64)(nb + FA_STAGES) * FA_BN, khi);
#endif
        /* Block nb landed (and Q); every warp is done with block nb - 1, whose stage the next
         * copy refills. */
        fa_decode_turn(&dp, kh, &seq, klo, khi, nb, nb0, nb1, base_a, (char *)fa_smem, rows_p, vc0,
                       0);
        const fa_u32 soff = slot * FA_STAGE_BYTES;
        const int j0 = klo + nb * FA_BN + wn * FA_WKEYS; /* this warp's first key */

        float s[FA_NT][4];
#pragma unroll
        for (int nt = 0; nt < FA_NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                s[nt][e] = 0.f;
#if FA_KV_FP8
        fa_decode_qk8(s, q_ld, k8_rd, soff);
#else
#pragma unroll fa_ks_unroll
        for (int ks = 0; ks < FA_KS; ks++) {
            fa_u32 qa[4];
            fa_ldmatrix_x4(qa, fa_swz_at(q_ld, 2 * ks));
#pragma unroll
            for (int np = 0; np < FA_NT / 2; np++) {
                fa_u32 kb[4];
                fa_ldmatrix_x4(kb, fa_swz_at(k_ld + soff, 2 * ks) + np * 16 * FA_CPR_K * 16);
                fa_mma16816(s[2 * np], qa, kb[0], kb[1]);
                fa_mma16816(s[2 * np + 1], qa, kb[2], kb[3]);
            }
        }
#endif

        /* Base-2 units where the features need it, each row's visible keys, P; O's rescale is
         * skipped where no row's maximum moved (every factor exactly 1). */
        float alpha[2];
        fa_decode_softmax(s, &rw, j0, t, n, sq, prescale, sm, FA_SCALE_LOG2, FA_SOFTCAP_PRE,
                          row_max, row_sum, alpha);
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f))
#pragma unroll
            for (int ot = 0; ot < FA_OT; ot++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    o[ot][e] *= alpha[e >> 1];

        /* O += P V: the S accumulators of n-tiles 2kk, 2kk + 1 are the A fragment of k-step kk. */
#if FA_KV_FP8
        fa_decode_pv8(o, s, v8_rd, soff);
#else
#pragma unroll
        for (int kk = 0; kk < FA_WKEYS / 16; kk++) {
            fa_u32 pa[4];
            pa[0] = fa_pack2(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = fa_pack2(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = fa_pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = fa_pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dp2 = 0; dp2 < FA_OT / 2; dp2++) {
                fa_u32 vb[4];
                fa_ldmatrix_x4_trans(vb, fa_swz_at(v_ld + soff, 2 * dp2) +
                                             kk * 16 * FA_V_ROW_CHUNKS * 16);
                fa_mma16816(o[2 * dp2], pa, vb[0], vb[1]);
                fa_mma16816(o[2 * dp2 + 1], pa, vb[2], vb[3]);
            }
        }
#endif
#if FA_PAGED
        if (nb + FA_STAGES < nb1)
            fa_decode_row_keep(kp, seq.last_block, next_row, rows_p + slot * FA_DECODE_ROWS_STRIDE);
#endif
    }
    fa_cp_async_wait_all();
    /* The merge behind this kernel may be scheduled once every CTA is here (it waits for the
     * whole grid's end before it reads the partials). */
    fa_grid_dependents_launch();

    /* The quad's sum of each row; then the FA_WN warps of the same rows merged into the first. */
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        row_sum[hf] += __shfl_xor_sync(0xffffffffu, row_sum[hf], 1);
        row_sum[hf] += __shfl_xor_sync(0xffffffffu, row_sum[hf], 2);
    }
#if FA_WN > 1
    fa_decode_merge_give(fa_smem_f32, o, row_max, row_sum, warp, wn, g8, t);
    if (wn != 0) {
#if __CUDA_ARCH__ >= 900 && FA_DV_SLICES == 1
        if (dp.cluster_merge)
            fa_decode_merge_cluster(&dp, fa_smem_f32, 0, o, row_max, row_sum, wm, g8, t, bi, kh,
                                    r0, rows, qs.q_start);
#endif
        return;
    }
    fa_decode_merge_take(fa_smem_f32, o, row_max, row_sum, sm, wm, g8, t);
#endif

    /* One split: out and lse, the sink joining the denominator. Several: this split's fp32
     * partial (normalised O, natural lse; +inf for a row that saw no key) for fa_combine, or
     * for the cluster's merge. */
    float lse_row[2], scale_row[2];
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int x = r0 + wm * 16 + g8 + 8 * hf;
        const int live = x < rows;
        const int qi = rw.q[hf], hh = row_h[hf];
        const fa_i64 qrow = qs.q_start + qi; /* its row of q, out and lse */
        const float sink2 = dp.splits == 1 && kp->sinks && live
                                ? kp->sinks[hh * kp->sinks_stride] * FA_LOG2E
                                : -FA_INF;
        float lse, scale;
        /* fa_row_finish sums its argument over the quad: the lanes hold the whole sum now. */
        fa_row_finish(t == 0 ? row_sum[hf] : 0.f, row_max[hf] * sm, sink2, &lse, &scale);
#if FA_KV_FP8
        scale *= vdesc;
#endif
        lse_row[hf] = lse, scale_row[hf] = scale;
        if (!dp.cluster_merge)
            fa_decode_store(&dp, o, hf, t, scale, lse, live, bi, qi, qrow, hh, vc0, dvs, split,
                            vslice == 0);
    }
#if __CUDA_ARCH__ >= 900 && FA_DV_SLICES == 1
    if (dp.cluster_merge)
        fa_decode_merge_cluster(&dp, fa_smem_f32, 1, o, lse_row, scale_row, wm, g8, t, bi, kh, r0,
                                rows, qs.q_start);
#endif
}
