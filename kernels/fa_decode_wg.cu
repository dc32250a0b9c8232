/*
 * Decode for MLA's wide heads on sm_90a: fa_decode.cu's schedule (packed GQA rows, the keys
 * split across CTAs and merged by fa_combine.cu, the cache read in place - through block_table
 * at any page size - the append done by the CTAs, every index clamped into the cache) with its
 * products on wgmma, for heads whose v is k's column prefix (MLA's one cache: d 576, v_cache =
 * kv[..., :512]). S = Q K^T runs once per block for all of O, where fa_decode.cu's slices of v's
 * columns each ran it.
 *
 * One CTA: FA_BM = 64 packed rows (row x = query row x / g, head x % g), 256 threads in two
 * warpgroups, key blocks of FA_BN = 64 streaming through FA_STAGES cp.async stages that every
 * thread copies (fa_decode_copy.cuh), per block:
 *   warpgroup 0: S = Q K^T (wgmma SS m64n64k16, FA_DP / 16 k-steps), the online softmax
 *     (fa_decode_softmax.cuh: wgmma's m64 accumulator gives each warp the mma C layout), P and
 *     the rows' rescale factors into shared memory (named barrier 1 tells warpgroup 1), then
 *     O[:, 0:256] = alpha O + P V[:, 0:256] (RS m64n256k16: P from its registers);
 *   warpgroup 1: O[:, 256:512] = alpha O + P V[:, 256:512] (SS: P from shared memory);
 *   V is K's stage (its first dv columns) read MN-major. Each block's __syncthreads (the copy
 *   pipeline's) also keeps P's buffer from being rewritten before warpgroup 1 has read it.
 * At the end warpgroup 0 hands the rows' 1 / l to warpgroup 1; each stores its half of out (or,
 * split, of the fp32 partial), warpgroup 0 the lse.
 *
 * Shared memory (1024-byte aligned; tiles in 64-column blocks of 128-byte rows with the
 * 128-byte swizzle, FA_WG_SWZ, as wgmma's descriptors read them; fa_smem.h's FA_SMEM_DECODE_WG):
 *   stages [FA_STAGES][FA_DP / 64][FA_BN][64], Q [FA_DP / 64][FA_BM][64], P [FA_BM][64],
 *   fac fp32 [FA_BM] (a block's rescale factors, then the rows' 1 / l), and with a paged cache
 *   the stages' key row offsets (int64 [FA_STAGES][FA_BN], fa_decode_copy.cuh's).
 *
 * Defines from the plan (src/plan/fa_plan_decode.c, fa_plan_decode_wg): FA_BF16, FA_DP (512 or
 * 576), FA_DVP (v's padded columns, 320 .. 512; warpgroup wg holds columns 256 wg .. + 255),
 * FA_V_IN_K 1, FA_BN 64, FA_STAGES, FA_PAGED, FA_VEC, FA_VARLEN, FA_ALIBI, FA_SOFTCAP. Entry
 * points as fa_decode.cu's: fa_decode, fa_kv_append, fa_decode_fill.
 */
#include "fa_common.cuh"
#include "fa_dkparams.h"
#include "fa_smem.h"
#include "fa_sm90.cuh"

#define FA_NWARPS 8
#define FA_THREADS 256
#define FA_BM 64
#define FA_DVH 256             /* v's columns a warpgroup holds */
#define FA_NT (FA_BN / 8)      /* 8-key n-tiles of a warp's S */
#define FA_OT (FA_DVH / 8)     /* 8-column n-tiles of a warpgroup's O */
#define FA_KS (FA_DP / 16)     /* k-steps of Q K^T */
#define FA_CPR_K (FA_DP / 8)   /* 16-byte chunks per row of Q and K */
#define FA_KV_FP8 0
#define FA_KV_ESIZE 2
#define FA_DV_SLICES 1
#define FA_DV_ALL FA_DVP
#define FA_SLICE_COLS(dv, vc0) (dv)
#define FA_STAGE_BYTES FA_SMEM_DECODE_WG_STAGE(FA_BN, FA_DP)
#define FA_KV_CPR_K FA_CPR_K
#define FA_KV_CPR_V (FA_DVP / 8)
#define FA_KV_CHUNKS_K ((FA_BN * FA_KV_CPR_K + FA_THREADS - 1) / FA_THREADS)
#define FA_KV_CHUNKS_V ((FA_BN * FA_KV_CPR_V + FA_THREADS - 1) / FA_THREADS)
#define FA_PRESCALE (FA_SOFTCAP || FA_ALIBI)

#if FA_BN != 64 || FA_DP % 64 != 0 || FA_DP < 512 || FA_DP > 576 || FA_DVP <= FA_DVH ||        \
    FA_DVP > 2 * FA_DVH || FA_DVP > FA_DP || !FA_V_IN_K || FA_STAGES < 2
#error "fa_decode_wg.cu: 64-key blocks, d 512 or 576, v k's prefix of 257 .. 512 columns"
#endif

/* wgmma's K-major layout with the 128-byte swizzle, for a tile of `rows` rows: 64-column
 * blocks of 128-byte rows, 16-byte chunk c of row r in block c / 8 at chunk (c % 8) ^ (r % 8).
 * The decode's copies and Q load write the stages and Q so (fa_decode_copy.cuh's hooks). */
#define FA_WG_SWZ(r, c, rows) ((((c) >> 3) * (rows) + (r)) * 128 + ((((c) & 7) ^ ((r) & 7)) << 4))
#define FA_STAGE_SWZ(r, c, cpr) FA_WG_SWZ(r, c, FA_BN)
#define FA_STAGE_KEY(step, cpr) ((step) & 7)
#define FA_STAGE_ROW_BYTES(cpr) 128
#define FA_Q_SWZ(r, c, cpr) FA_WG_SWZ(r, c, FA_BM)
#define FA_DECODE_ROWS_STRIDE FA_BN /* K's row offsets alone (V is read from K's stage) */

/* O's C fragment element (n-tile ot, lane quad position t, element e of a row's pair): its
 * column of the warpgroup's 256. */
#define FA_OCOL(ot, t, e) ((ot) * 8 + 2 * (t) + (e))

#include "fa_decode_cache.cuh"
#include "fa_decode_check.cuh"
#include "fa_decode_append.cuh"
#include "fa_decode_copy.cuh"
#include "fa_decode_softmax.cuh"
#include "fa_decode_store.cuh"

/* S (+)= Q K^T for one k16 step, both operands K-major in shared memory (SS). */
FA_DEF_WGMMA_SS(fa_wgmma_qk, 64, FA_RL32, FA_FL32, "%32", "%33", "%34", "0, 0")
/* O += P V for one k16 step with P from shared memory (K-major) and V MN-major (SS). */
FA_DEF_WGMMA_SS(fa_wgmma_pv_ss, 256, FA_RL128, FA_FL128, "%128", "%129", "%130", "0, 1")

/* The named barrier on which warpgroup 0 tells warpgroup 1 that a block's P and factors are in
 * shared memory (barrier 0 is __syncthreads'). */
#define FA_BAR_P 1

/* Pins n accumulator registers after a wgmma wait, so that the compiler reads them after it. */
FA_DEV void fa_wg_pin(float *a, int n)
{
#pragma unroll
    for (int i = 0; i < n; i++)
        FA_PIN(a[i]);
}

/* o *= the rows' factors (rows g8, g8 + 8 of the warp: f0, f1), skipped where the warp's are all
 * exactly 1. */
FA_DEV void fa_wg_rescale(float o[FA_OT][4], float f0, float f1)
{
    if (__any_sync(0xffffffffu, f0 != 1.f || f1 != 1.f))
#pragma unroll
        for (int ot = 0; ot < FA_OT; ot++) {
            o[ot][0] *= f0;
            o[ot][1] *= f0;
            o[ot][2] *= f1;
            o[ot][3] *= f1;
        }
}

extern "C" __global__ void __launch_bounds__(FA_THREADS, 1) fa_decode(const fa_dkparams dp)
{
    extern __shared__ __align__(128) unsigned char fa_smem_raw[];
    const fa_kparams *kp = &dp.f;
    /* 1024-byte aligned: the swizzle's atoms, as the descriptors assume them */
    const fa_u32 raw_a = fa_smem_addr(fa_smem_raw);
    const fa_u32 base_a = (raw_a + 1023u) & ~1023u;
    char *const base_p = (char *)fa_smem_raw + (base_a - raw_a);
    const fa_u32 q_a = base_a + FA_STAGES * FA_STAGE_BYTES;
    fa_u16 *const q_p = (fa_u16 *)(base_p + FA_STAGES * FA_STAGE_BYTES);
    const fa_u32 p_a = q_a + FA_SMEM_DECODE_WG_Q(FA_BM, FA_DP);
    char *const p_p = (char *)q_p + FA_SMEM_DECODE_WG_Q(FA_BM, FA_DP);
    float *const fac = (float *)(p_p + FA_SMEM_DECODE_WG_P(FA_BM));
    fa_i64 *const rows_p = (fa_i64 *)(fac + FA_BM);

    const int bx = blockIdx.x;
    const int m_block = fa_div_splits(&dp, bx), split = bx - m_block * dp.splits;
    const int kh = blockIdx.y, bi = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wg = warp >> 2, w = warp & 3, g8 = lane >> 2, t = lane & 3;
    const fa_seq qs = fa_seq_get(kp, bi, FA_VARLEN);
    const int g = dp.g, sq = qs.sq, rows = sq * g;
    const int r0 = m_block * FA_BM;
#if FA_VARLEN
    if (r0 >= rows)
        return;
#endif
    const fa_kvseq seq = fa_kvseq_get(&dp, bi);
    const int n = (int)(seq.end - seq.start);

    /* The keys the CTA's rows see, cut into blocks; this split's blocks [nb0, nb1). The
     * capacity check and the fused append (fa_decode_append.cuh) before the first copy. */
    const fa_decode_range kr = fa_decode_range_get(&dp, r0, rows, sq, n, split);
    const int klo = kr.klo, khi = kr.khi, nb0 = kr.nb0, nb1 = kr.nb1;
    fa_decode_start(&dp, &seq, bi, kh, m_block == 0 && split == 0, &kr, warp, lane);

    const int prescale = FA_PRESCALE || !(kp->scale_log2 > 0.f);
    const float sm = prescale ? 1.f : kp->scale_log2;

#if FA_PAGED
#pragma unroll
    for (int s = 0; s < FA_STAGES; s++)
        if (nb0 + s < nb1)
            fa_decode_row_keep(kp, seq.last_block,
                               fa_decode_row_find(&dp, &seq, klo + (fa_i64)(nb0 + s) * FA_BN, khi),
                               rows_p + s * FA_DECODE_ROWS_STRIDE);
    __syncthreads();
#endif
#pragma unroll
    for (int s = 0; s < FA_STAGES - 1; s++) {
        if (nb0 + s < nb1)
            fa_decode_load(&dp, kh, &seq, klo + (fa_i64)(nb0 + s) * FA_BN, khi, base_a, base_p, s,
                           rows_p + s * FA_DECODE_ROWS_STRIDE, 0);
        fa_cp_async_commit();
    }
    fa_decode_load_q(&dp, bi, qs.q_start, kh, &seq, r0, rows, g, q_p);

    /* This thread's two rows of the tile, 16 w + g8 + 8 hf (its lanes' rows in both warpgroups'
     * accumulators): visible keys, query, head, slope. */
    int row_h[2];
    const fa_decode_rows rw =
        fa_decode_rows_get(&dp, r0 + 16 * w + g8, rows, kh, bi, sq, n, row_h);

    float row_max[2] = {-FA_INF, -FA_INF}, row_sum[2] = {0.f, 0.f};
    float o[FA_OT][4];
#pragma unroll
    for (int ot = 0; ot < FA_OT; ot++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            o[ot][e] = 0.f;

    /* Descriptors at k-step 0 (fa_sm90.cuh): Q and K K-major, a k16 step +32 bytes in a 128-byte
     * row and every fourth the next 64-column block; V (K's stage) MN-major from this
     * warpgroup's first column block, LBO between column blocks, a k16 step 16 key rows = 2048
     * bytes; P K-major, one column block. */
    const fa_u64 q_desc = fa_desc(q_a, 16, 1024);
    const fa_u64 k_desc = fa_desc(base_a, 16, 1024);
    const fa_u64 v_desc = fa_desc(base_a + wg * (FA_DVH / 64) * FA_BN * 128, FA_BN * 128, 1024);
    const fa_u64 p_desc = fa_desc(p_a, 16, 1024);
    const int prow0 = 16 * w + g8; /* the thread's first row of the tile */

    for (int nb = nb0; nb < nb1; nb++) {
        const int slot = (nb - nb0) % FA_STAGES;
#if FA_PAGED
        /* block nb + FA_STAGES's rows for this slot, kept after the block's math (fa_decode.cu) */
        fa_paged_key next_row = {0, 0};
        if (nb + FA_STAGES < nb1)
            next_row = fa_decode_row_find(&dp, &seq, klo + (fa_i64)(nb + FA_STAGES) * FA_BN, khi);
#endif
        /* Block nb landed (and Q); every thread is done with block nb - 1 (warpgroup 1 with
         * its P too), whose stage the next copy refills. The copies and stores are the generic
         * proxy's, wgmma reads by the async proxy: each thread's fence before the barrier. */
        fa_decode_turn(&dp, kh, &seq, klo, khi, nb, nb0, nb1, base_a, base_p, rows_p, 0, 1);
        const fa_u32 soff = slot * FA_STAGE_BYTES;

        if (wg == 0) {
            float s[FA_NT][4];
            fa_wg_fence();
#pragma unroll
            for (int ks = 0; ks < FA_KS; ks++)
                fa_wgmma_qk(&s[0][0], fa_desc_at(q_desc, (ks >> 2) * FA_BM * 128 + (ks & 3) * 32),
                            fa_desc_at(k_desc, soff + (ks >> 2) * FA_BN * 128 + (ks & 3) * 32),
                            ks > 0);
            fa_wg_commit();
            fa_wg_wait0();
            fa_wg_pin(&s[0][0], 4 * FA_NT);

            float alpha[2];
            fa_decode_softmax(s, &rw, klo + nb * FA_BN, t, n, sq, prescale, sm, kp->scale_log2,
                              kp->softcap_pre, row_max, row_sum, alpha);

            /* P for warpgroup 1: row r, keys 8 nt + 2t, +1 as one 4-byte store into the
             * swizzled row (p_desc's layout; a warp's 32 stores fall on 32 banks), with the
             * rows' factors. */
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int r = prow0 + 8 * hf;
#pragma unroll
                for (int nt = 0; nt < FA_NT; nt++)
                    *(fa_u32 *)(p_p + r * 128 + ((nt ^ (r & 7)) << 4) + 4 * t) =
                        fa_pack2(s[nt][2 * hf], s[nt][2 * hf + 1]);
                if (t == 0)
                    fac[r] = alpha[hf];
            }
            fa_fence_proxy_async();
            fa_bar_arrive(FA_BAR_P, FA_THREADS);

            /* O[:, 0:256] = alpha O + P V: S's accumulators of n-tiles 2kk, 2kk + 1 are the A
             * fragment of k-step kk (fa_wgmma_pv64's layout). */
            fa_wg_rescale(o, alpha[0], alpha[1]);
            fa_u32 pa[FA_BN / 16][4];
#pragma unroll
            for (int kk = 0; kk < FA_BN / 16; kk++) {
                pa[kk][0] = fa_pack2(s[2 * kk][0], s[2 * kk][1]);
                pa[kk][1] = fa_pack2(s[2 * kk][2], s[2 * kk][3]);
                pa[kk][2] = fa_pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[kk][3] = fa_pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            }
            fa_wg_fence();
#pragma unroll
            for (int kk = 0; kk < FA_BN / 16; kk++)
                fa_wgmma_pv256(&o[0][0], pa[kk], fa_desc_at(v_desc, soff + kk * 2048));
            fa_wg_commit();
            fa_wg_wait0();
        } else {
            fa_bar_sync(FA_BAR_P, FA_THREADS);
            fa_wg_rescale(o, fac[prow0], fac[prow0 + 8]);
            fa_wg_fence();
#pragma unroll
            for (int kk = 0; kk < FA_BN / 16; kk++)
                fa_wgmma_pv_ss(&o[0][0], fa_desc_at(p_desc, kk * 32),
                               fa_desc_at(v_desc, soff + kk * 2048), 1);
            fa_wg_commit();
            fa_wg_wait0();
        }
        fa_wg_pin(&o[0][0], 4 * FA_OT);
#if FA_PAGED
        if (nb + FA_STAGES < nb1)
            fa_decode_row_keep(kp, seq.last_block, next_row,
                               rows_p + slot * FA_DECODE_ROWS_STRIDE);
#endif
    }
    fa_cp_async_wait_all();
    /* The merge behind this kernel may be scheduled once every CTA is here (it waits for the
     * whole grid's end before it reads the partials). */
    fa_grid_dependents_launch();

    /* Warpgroup 0's rows: lse and 1 / l (the sink joining the denominator where unsplit),
     * handed to warpgroup 1 through fac once it has read the last block's factors. */
    float lse_row[2], scale_row[2];
    __syncthreads();
    if (wg == 0) {
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int live = r0 + prow0 + 8 * hf < rows;
            const float sink2 = dp.splits == 1 && kp->sinks && live
                                    ? kp->sinks[row_h[hf] * kp->sinks_stride] * FA_LOG2E
                                    : -FA_INF;
            float l = row_sum[hf];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            /* fa_row_finish sums its argument over the quad: the lanes hold the whole sum now */
            fa_row_finish(t == 0 ? l : 0.f, row_max[hf] * sm, sink2, &lse_row[hf],
                          &scale_row[hf]);
            if (t == 0)
                fac[prow0 + 8 * hf] = scale_row[hf];
        }
    }
    __syncthreads();
    if (wg == 1) {
        scale_row[0] = fac[prow0];
        scale_row[1] = fac[prow0 + 8];
        lse_row[0] = lse_row[1] = 0.f;
    }

    /* One split: out (this warpgroup's columns) and lse (warpgroup 0's). Several: this split's
     * fp32 partial (normalised O, natural lse; +inf for a row that saw no key) for fa_combine. */
    const int vc0 = wg * FA_DVH, dvs = kp->dv - vc0 < FA_DVH ? kp->dv - vc0 : FA_DVH;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int live = r0 + prow0 + 8 * hf < rows;
        const int qi = rw.q[hf], hh = row_h[hf];
        const fa_i64 qrow = qs.q_start + qi; /* its row of q, out and lse */
        fa_decode_store(&dp, o, hf, t, scale_row[hf], lse_row[hf], live, bi, qi, qrow, hh, vc0,
                        dvs, split, wg == 0);
    }
}
