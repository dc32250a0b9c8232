/*
 * Backward attention for sm80 and later (runs on Hopper too), first increment: FlashAttention-2's
 * algorithm on mma.sync m16n8k16 with fp32 accumulation, on a simple 64 x 64 tile (4 warps).
 *
 * Four entry points, launched in this order on the caller's stream (src/cuda/fa_cuda_backward.c):
 *   fa_bwd_pre      D = rowsum(dout * out) in fp32 for every (sequence, head, row) into the
 *                   workspace; zeroes the fp32 dQ accumulator and the dQ ordering counters.
 *   fa_bwd          one CTA per (key block of FA_BN keys, kv head, sequence). dK and dV of the
 *                   block stay in registers over every query tile of every query head of the GQA
 *                   group that sees the block, in a fixed order, so they are summed
 *                   deterministically; dQ of each query tile is added to the fp32 accumulator
 *                   with atomicAdd. With bp.deterministic the adds to one query tile are made in
 *                   key-block order: the CTA of key block n waits until the tile's counter says
 *                   that every earlier key block meeting the tile has added (blocks are dispatched
 *                   in index order, so the wait only ever targets a CTA already running or done).
 *   fa_bwd_dsinks   d_sink[h] = -sum over rows of exp(sink - lse) * D, one CTA per head, a fixed
 *                   reduction tree.
 *   fa_bwd_convert  dQ fp32 -> the dtype, into the caller's dq.
 *
 * The main kernel works in the transposed frame (FA3's): each warp owns 16 keys of the block and
 * computes S^T = K Q^T and dP^T = V dO^T for them, so that P^T and dS^T come out of the mma as
 * C fragments that are directly the A fragments of dV += P^T dO and dK += dS^T Q (no trip through
 * shared memory). dS^T goes to shared memory once, for dQ = dS K, which each warp computes for 16
 * query rows.
 *
 * Shared-memory tiles are row-major with rows padded by 8 elements (16 bytes): a row stride of
 * 16 (mod 128) bytes puts the 8 row addresses of every ldmatrix in 8 different bank groups.
 *
 * Defines from the plan (src/plan/fa_plan.c, fa_plan_backward):
 *   FA_BF16           data type (0: fp16, 1: bf16)
 *   FA_DP, FA_DVP     head dims of q/k and of v, padded to 32 or a multiple of 64 (<= 128)
 *   FA_BM, FA_BN      query rows per tile, keys per CTA (both 16 * FA_NWARPS)
 *   FA_NWARPS         warps per CTA
 *   FA_VEC            1: rows 16-byte aligned, d, dv % 8 == 0: cp.async and paired stores
 *   FA_ALIBI, FA_SOFTCAP, FA_DROPOUT   features compiled in (0/1)
 * Dense layouts only (the plan refuses varlen for now).
 */
#include "fa_bkparams.h"
#include "fa_common.cuh"

#define FA_THREADS (FA_NWARPS * 32)
#define FA_LDK (FA_DP + 8)  /* row stride, in elements, of the Q and K tiles */
#define FA_LDV (FA_DVP + 8) /* of the dO and V tiles */
#define FA_LDS (FA_BM + 8)  /* of the dS^T tile [FA_BN][FA_BM] */
#define FA_QC (FA_DP < 64 ? FA_DP : 64) /* dQ columns computed at a time (bounds registers) */

#if FA_BN != 16 * FA_NWARPS || FA_BM != 16 * FA_NWARPS
#error "each warp owns 16 keys of the block and 16 rows of the query tile"
#endif
#if FA_DP % 16 != 0 || FA_DVP % 16 != 0 || FA_DP % FA_QC != 0 || FA_QC % 16 != 0
#error "head dims must be multiples of the mma shape"
#endif

/* Copies rows [0, rows) x columns [0, ncols) of a global slice (row stride rs) into a shared
 * tile of row stride ld (elements) at `tile`, zero-filling rows >= nrows and columns past ncols
 * up to cols (the padded width). */
FA_DEV void fa_bwd_tile_load(fa_u16 *tile, int ld, const fa_u16 *src, fa_i64 rs, int nrows,
                             int ncols, int rows, int cols)
{
#if FA_VEC
    /* cp.async in 16-byte chunks; a zero-length copy writes a zero chunk and reads nothing. */
    const int cpr = cols / 8;
    const fa_u32 base = fa_smem_addr(tile);
    for (int i = threadIdx.x; i < rows * cpr; i += FA_THREADS) {
        const int r = i / cpr, c = i - r * cpr;
        const int ok = r < nrows && c * 8 < ncols;
        fa_cp_async16(base + (r * ld + c * 8) * 2, ok ? (const void *)(src + r * rs + c * 8) : src,
                      ok ? 16 : 0);
    }
#else
    for (int i = threadIdx.x; i < rows * cols; i += FA_THREADS) {
        const int r = i / cols, c = i - r * cols;
        tile[r * ld + c] = (r < nrows && c < ncols) ? src[r * rs + c] : (fa_u16)0;
    }
#endif
}

/* Whether query tile mb and key block nb of a sequence may share a visible pair: the tile's rows
 * see keys [lo(first row), hi(last row)) at most, both edges growing with the row. The same
 * predicate decides which tiles a CTA visits and, in deterministic mode, how many earlier key
 * blocks add to a tile before this one, so the two always agree. */
FA_DEV int fa_bwd_meets(const fa_kparams *kp, const fa_seq *s, int mb, int nb)
{
    const int m0 = mb * FA_BM;
    if (m0 >= s->sq || nb * FA_BN >= s->sk)
        return 0;
    const int m_last = fa_min(m0 + FA_BM, s->sq) - 1;
    int lo_first, hi_first, lo_last, hi_last;
    fa_key_range(kp, m0, s->sq, s->sk, &lo_first, &hi_first);
    fa_key_range(kp, m_last, s->sq, s->sk, &lo_last, &hi_last);
    const int n0 = nb * FA_BN;
    return lo_first < hi_last && n0 < hi_last && n0 + FA_BN > lo_first;
}

/* ld.acquire.gpu: a load that orders this thread's later accesses after it (the counter read
 * before the dQ adds of deterministic mode). */
FA_DEV int fa_load_acquire(const int *p)
{
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

/* Token index (row of the [h][total_q] workspace arrays) of row `row` of dense sequence bi. */
FA_DEV fa_i64 fa_bwd_token(const fa_kparams *kp, int bi, int row)
{
    return (fa_i64)bi * kp->max_sq + row;
}

/* Grid (m_tiles, h, b), FA_THREADS threads: D for FA_BM rows, one warp per row at a time; zeroes
 * the tile's rows of the dQ accumulator and its ordering counter. */
extern "C" __global__ void __launch_bounds__(FA_THREADS) fa_bwd_pre(const fa_bkparams bp)
{
    const fa_kparams *kp = &bp.f;
    const int mb = blockIdx.x, h = blockIdx.y, bi = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int m0 = mb * FA_BM;
    const int rows = fa_min(FA_BM, (int)kp->max_sq - m0);
    if (threadIdx.x == 0)
        bp.sem[((fa_i64)bi * kp->h + h) * bp.m_tiles + mb] = 0;
    float *acc = bp.dq_accum + ((fa_i64)h * kp->total_q + fa_bwd_token(kp, bi, m0)) * kp->d;
    for (int i = threadIdx.x; i < rows * kp->d; i += FA_THREADS)
        acc[i] = 0.f;
    for (int r = warp; r < rows; r += FA_NWARPS) {
        const int row = m0 + r;
        const fa_u16 *dor = (const fa_u16 *)bp.dout + bi * bp.do_bstride + row * bp.do_rstride +
                            h * bp.do_hstride;
        const fa_u16 *orow = (const fa_u16 *)kp->out + bi * kp->o_bstride + row * kp->o_rstride +
                             h * kp->o_hstride;
        float s = 0.f;
        for (int c = lane; c < kp->dv; c += 32)
            s += fa_to_float(dor[c]) * fa_to_float(orow[c]);
#pragma unroll
        for (int sh = 16; sh > 0; sh >>= 1)
            s += __shfl_xor_sync(0xffffffffu, s, sh);
        if (lane == 0)
            bp.dsum[(fa_i64)h * kp->total_q + fa_bwd_token(kp, bi, row)] = s;
    }
}

/* Grid (n_tiles, hk, b), FA_THREADS threads, dynamic shared memory:
 *   Q [FA_BM][FA_LDK], dO [FA_BM][FA_LDV], K [FA_BN][FA_LDK], V [FA_BN][FA_LDV] (16-bit),
 *   dS^T [FA_BN][FA_LDS] (16-bit), lse * log2(e) [FA_BM], D [FA_BM] (fp32). */
extern "C" __global__ void __launch_bounds__(FA_THREADS, 1) fa_bwd(const fa_bkparams bp)
{
    const fa_kparams *kp = &bp.f;
    extern __shared__ __align__(128) fa_u16 fa_smem[];
    fa_u16 *const s_q = fa_smem;
    fa_u16 *const s_do = s_q + FA_BM * FA_LDK;
    fa_u16 *const s_k = s_do + FA_BM * FA_LDV;
    fa_u16 *const s_v = s_k + FA_BN * FA_LDK;
    fa_u16 *const s_ds = s_v + FA_BN * FA_LDV;
    float *const s_lse = (float *)(s_ds + FA_BN * FA_LDS);
    float *const s_dsum = s_lse + FA_BM;
    const fa_u32 q_a = fa_smem_addr(s_q), do_a = fa_smem_addr(s_do), k_a = fa_smem_addr(s_k);
    const fa_u32 v_a = fa_smem_addr(s_v), ds_a = fa_smem_addr(s_ds);

    const int nb = blockIdx.x, hk = blockIdx.y, bi = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const fa_seq seq = fa_seq_get(kp, bi, 0);
    const int n0 = nb * FA_BN;
    const int group = kp->h / kp->hk;

    const fa_u16 *kg = (const fa_u16 *)kp->k + bi * kp->k_bstride + (fa_i64)n0 * kp->k_rstride +
                       hk * kp->k_hstride;
    const fa_u16 *vg = (const fa_u16 *)kp->v + bi * kp->v_bstride + (fa_i64)n0 * kp->v_rstride +
                       hk * kp->v_hstride;
    fa_bwd_tile_load(s_k, FA_LDK, kg, kp->k_rstride, seq.sk - n0, kp->d, FA_BN, FA_DP);
    fa_bwd_tile_load(s_v, FA_LDV, vg, kp->v_rstride, seq.sk - n0, kp->dv, FA_BN, FA_DVP);
    fa_cp_async_commit();

    /* This thread's ldmatrix row addresses (bytes, shared window) at k-step / n-pair 0.
     * A operand, row-major [m][k] (K and V rows of this warp's 16 keys): matrices (rows 0-7,
     * k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) = a[0..3]; lane l gives row l % 16 at
     * column 8 * (l / 16). */
    const fa_u32 ka_ld = k_a + ((16 * warp + (lane & 15)) * FA_LDK + (lane >> 4) * 8) * 2;
    const fa_u32 va_ld = v_a + ((16 * warp + (lane & 15)) * FA_LDV + (lane >> 4) * 8) * 2;
    /* B operand stored [n][k] (Q and dO rows are the n = query index of S^T and dP^T): matrices
     * (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15) = b0, b1 of n-tile 0,
     * b0, b1 of n-tile 1 (non-transposed: lane receives row g, elements 2t, 2t+1). */
    const int bn_row = (lane & 7) + ((lane >> 4) << 3), bn_col = ((lane >> 3) & 1) * 8;
    const fa_u32 qb_ld = q_a + (bn_row * FA_LDK + bn_col) * 2;
    const fa_u32 dob_ld = do_a + (bn_row * FA_LDV + bn_col) * 2;
    /* B operand stored [k][n] (dO and Q for dV/dK, k = query; K for dQ, k = key), read with
     * .trans: matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15) = b0, b1
     * of n-tile 0, b0, b1 of n-tile 1 (lane receives column g, rows 2t, 2t+1). */
    const int kn_row = (lane & 7) + (((lane >> 3) & 1) << 3), kn_col = (lane >> 4) * 8;
    const fa_u32 dot_ld = do_a + (kn_row * FA_LDV + kn_col) * 2;
    const fa_u32 qt_ld = q_a + (kn_row * FA_LDK + kn_col) * 2;
    const fa_u32 kt_ld = k_a + (kn_row * FA_LDK + kn_col) * 2;
    /* A operand of dQ = dS K from dS^T stored [k = key][m = query], with .trans: matrices
     * (k 0-7, m 0-7) = a[0], (k 0-7, m 8-15) = a[1], (k 8-15, m 0-7) = a[2], (k 8-15, m 8-15) =
     * a[3] (lane receives column g = row g of A, rows 2t, 2t+1 = columns 2t, 2t+1 of A). */
    const fa_u32 dsa_ld = ds_a + (bn_row * FA_LDS + 16 * warp + bn_col) * 2;

    float dk[FA_DP / 8][4], dv[FA_DVP / 8][4];
#pragma unroll
    for (int nt = 0; nt < FA_DP / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            dk[nt][e] = 0.f;
#pragma unroll
    for (int nt = 0; nt < FA_DVP / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            dv[nt][e] = 0.f;

    const fa_i64 diag0 = (fa_i64)seq.sk - seq.sq; /* key j is on row i's diagonal at j = i + diag0 */

#pragma unroll 1
    for (int h = hk * group; h < (hk + 1) * group; h++) {
#if FA_ALIBI
        const float slope_log2 =
            kp->alibi_slopes[bi * kp->alibi_bstride + h * kp->alibi_hstride] * FA_LOG2E;
#endif
#if FA_DROPOUT
        const fa_u64 stream = fa_dropout_stream(kp, bi, h);
#endif
        const fa_u16 *qg = (const fa_u16 *)kp->q + bi * kp->q_bstride + h * kp->q_hstride;
        const fa_u16 *dog = (const fa_u16 *)bp.dout + bi * bp.do_bstride + h * bp.do_hstride;
        const float *lse_g = kp->lse + bi * kp->lse_bstride + h * kp->lse_hstride;
        const float *dsum_g = bp.dsum + (fa_i64)h * kp->total_q + fa_bwd_token(kp, bi, 0);
        float *acc_g = bp.dq_accum + ((fa_i64)h * kp->total_q + fa_bwd_token(kp, bi, 0)) * kp->d;

#pragma unroll 1
        for (int mb = 0; mb < bp.m_tiles; mb++) {
            if (!fa_bwd_meets(kp, &seq, mb, nb))
                continue;
            const int m0 = mb * FA_BM;
            /* Every warp is done with the previous tile's Q, dO, dS^T. */
            __syncthreads();
            fa_bwd_tile_load(s_q, FA_LDK, qg + (fa_i64)m0 * kp->q_rstride, kp->q_rstride,
                             seq.sq - m0, kp->d, FA_BM, FA_DP);
            fa_bwd_tile_load(s_do, FA_LDV, dog + (fa_i64)m0 * bp.do_rstride, bp.do_rstride,
                             seq.sq - m0, kp->dv, FA_BM, FA_DVP);
            fa_cp_async_commit();
            for (int i = threadIdx.x; i < FA_BM; i += FA_THREADS) {
                const int row = m0 + i;
                const int in = row < seq.sq;
                /* Rows past the end: lse +inf makes every P 0 there. */
                s_lse[i] = in ? lse_g[row * kp->lse_rstride] * FA_LOG2E : FA_INF;
                s_dsum[i] = in ? dsum_g[row] : 0.f;
            }
            fa_cp_async_wait_all();
            __syncthreads();

            /* S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys x FA_BM queries. C layout:
             * st[nt][e] is key 16 warp + g + 8 (e / 2), query 8 nt + 2t + (e % 2). */
            float st[FA_BM / 8][4], dpt[FA_BM / 8][4];
#pragma unroll
            for (int nt = 0; nt < FA_BM / 8; nt++)
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
                for (int np = 0; np < FA_BM / 16; np++) {
                    fa_u32 b[4];
                    fa_ldmatrix_x4(b, qb_ld + np * 16 * FA_LDK * 2 + ks * 32);
                    fa_mma16816(st[2 * np], a, b[0], b[1]);
                    fa_mma16816(st[2 * np + 1], a, b[2], b[3]);
                }
            }
#pragma unroll
            for (int ks = 0; ks < FA_DVP / 16; ks++) {
                fa_u32 a[4];
                fa_ldmatrix_x4(a, va_ld + ks * 32);
#pragma unroll
                for (int np = 0; np < FA_BM / 16; np++) {
                    fa_u32 b[4];
                    fa_ldmatrix_x4(b, dob_ld + np * 16 * FA_LDV * 2 + ks * 32);
                    fa_mma16816(dpt[2 * np], a, b[0], b[1]);
                    fa_mma16816(dpt[2 * np + 1], a, b[2], b[3]);
                }
            }

            /* Element by element: P = 2^(s * log2 e - lse * log2 e) (0 where invisible), then
             * st <- P Z (Z: 1 / (1 - p) kept, 0 dropped) and dpt <- dS = P (dP Z - D) s' scale,
             * s' the softcap's derivative 1 - tanh^2 (1 without softcap). */
#pragma unroll
            for (int nt = 0; nt < FA_BM / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int il = nt * 8 + 2 * t + (e & 1);
                    const int i = m0 + il;
                    const int j = n0 + 16 * warp + g + 8 * (e >> 1);
                    float x = st[nt][e], deriv = 1.f;
#if FA_SOFTCAP
                    const float th = tanhf(x * kp->softcap_pre);
                    x = th * kp->scale_log2;
                    deriv = 1.f - th * th;
#else
                    x *= kp->scale_log2;
#endif
                    const fa_i64 dg = (fa_i64)i + diag0 - j; /* i + sk - sq - j */
#if FA_ALIBI
                    x -= slope_log2 * (float)(dg < 0 ? -dg : dg);
#endif
                    /* visible iff i + sk - sq - left <= j <= i + sk - sq + right */
                    const int vis = i < seq.sq && j < seq.sk &&
                                    (kp->window_left < 0 || dg <= kp->window_left) &&
                                    (kp->window_right < 0 || dg >= -(fa_i64)kp->window_right);
                    const float p = vis ? fa_exp2(x - s_lse[il]) : 0.f;
                    float z = 1.f;
#if FA_DROPOUT
                    {
                        /* Philox block (j / 8, i, stream): word (j % 8) / 2, half j % 2. */
                        fa_u32 w[4];
                        fa_philox4((fa_u32)(j >> 3), (fa_u32)i, (fa_u32)stream,
                                   (fa_u32)(stream >> 32), (fa_u32)kp->seed,
                                   (fa_u32)(kp->seed >> 32), w);
                        const fa_u32 word = fa_pick4(w, (j & 7) >> 1);
                        const fa_u32 r16 = (j & 1) ? (word >> 16) : (word & 0xffffu);
                        z = r16 < kp->keep_threshold ? kp->dropout_scale : 0.f;
                    }
#endif
                    dpt[nt][e] = p * (dpt[nt][e] * z - s_dsum[il]) * deriv * kp->scale;
                    st[nt][e] = p * z;
                }

            /* dV += (P Z)^T dO and dK += dS^T Q: the C fragments of n-tiles 2kk, 2kk + 1 (queries
             * 16kk .. 16kk + 15) are the A fragment of k-step kk. */
#pragma unroll
            for (int kk = 0; kk < FA_BM / 16; kk++) {
                fa_u32 pa[4], da[4];
                pa[0] = fa_pack2(st[2 * kk][0], st[2 * kk][1]);
                pa[1] = fa_pack2(st[2 * kk][2], st[2 * kk][3]);
                pa[2] = fa_pack2(st[2 * kk + 1][0], st[2 * kk + 1][1]);
                pa[3] = fa_pack2(st[2 * kk + 1][2], st[2 * kk + 1][3]);
                da[0] = fa_pack2(dpt[2 * kk][0], dpt[2 * kk][1]);
                da[1] = fa_pack2(dpt[2 * kk][2], dpt[2 * kk][3]);
                da[2] = fa_pack2(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
                da[3] = fa_pack2(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
#pragma unroll
                for (int np = 0; np < FA_DVP / 16; np++) {
                    fa_u32 b[4];
                    fa_ldmatrix_x4_trans(b, dot_ld + kk * 16 * FA_LDV * 2 + np * 32);
                    fa_mma16816(dv[2 * np], pa, b[0], b[1]);
                    fa_mma16816(dv[2 * np + 1], pa, b[2], b[3]);
                }
#pragma unroll
                for (int np = 0; np < FA_DP / 16; np++) {
                    fa_u32 b[4];
                    fa_ldmatrix_x4_trans(b, qt_ld + kk * 16 * FA_LDK * 2 + np * 32);
                    fa_mma16816(dk[2 * np], da, b[0], b[1]);
                    fa_mma16816(dk[2 * np + 1], da, b[2], b[3]);
                }
                /* dS^T to shared memory for dQ: row key, pairs of adjacent queries. */
                fa_u32 *d0 = (fa_u32 *)(s_ds + (16 * warp + g) * FA_LDS + kk * 16 + 2 * t);
                d0[0] = da[0];
                d0[4 * FA_LDS] = da[1]; /* 8 rows down: 8 * FA_LDS / 2 words */
                d0[4] = da[2];          /* 8 columns right */
                d0[4 * FA_LDS + 4] = da[3];
            }
            __syncthreads();

            /* dQ of this warp's 16 query rows, FA_QC columns at a time, added to the accumulator.
             * Deterministic mode: wait for the tile's turn (every earlier key block that meets
             * the tile has added), add, then pass the turn on. */
            int *sem = bp.sem + ((fa_i64)bi * kp->h + h) * bp.m_tiles + mb;
            if (bp.deterministic) {
                if (threadIdx.x == 0) {
                    int before = 0;
                    for (int n = 0; n < nb; n++)
                        before += fa_bwd_meets(kp, &seq, mb, n);
                    while (fa_load_acquire(sem) != before)
                        __nanosleep(64);
                }
                __syncthreads();
            }
#pragma unroll 1
            for (int c0 = 0; c0 < FA_DP; c0 += FA_QC) {
                float dq[FA_QC / 8][4];
#pragma unroll
                for (int nt = 0; nt < FA_QC / 8; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        dq[nt][e] = 0.f;
#pragma unroll
                for (int ks = 0; ks < FA_BN / 16; ks++) {
                    fa_u32 a[4];
                    fa_ldmatrix_x4_trans(a, dsa_ld + ks * 16 * FA_LDS * 2);
#pragma unroll
                    for (int np = 0; np < FA_QC / 16; np++) {
                        fa_u32 b[4];
                        fa_ldmatrix_x4_trans(b, kt_ld + ks * 16 * FA_LDK * 2 + (c0 + np * 16) * 2);
                        fa_mma16816(dq[2 * np], a, b[0], b[1]);
                        fa_mma16816(dq[2 * np + 1], a, b[2], b[3]);
                    }
                }
#pragma unroll
                for (int nt = 0; nt < FA_QC / 8; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int row = m0 + 16 * warp + g + 8 * (e >> 1);
                        const int col = c0 + nt * 8 + 2 * t + (e & 1);
                        if (row < seq.sq && col < kp->d)
                            atomicAdd(acc_g + (fa_i64)row * kp->d + col, dq[nt][e]);
                    }
            }
            if (bp.deterministic) {
                __threadfence();
                __syncthreads();
                if (threadIdx.x == 0)
                    atomicAdd(sem, 1);
            }
        }
    }

    /* K and V copies still in flight when no query tile met the block. */
    fa_cp_async_wait_all();
    /* dK, dV of the block's keys (zero for keys no query sees). C layout: dk[nt][e] is key
     * 16 warp + g + 8 (e / 2), column 8 nt + 2t + (e % 2). */
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int key = n0 + 16 * warp + g + 8 * hf;
        if (key >= seq.sk)
            continue;
        fa_u16 *dkr = (fa_u16 *)bp.dk + bi * bp.dk_bstride + (fa_i64)key * bp.dk_rstride +
                      hk * bp.dk_hstride;
        fa_u16 *dvr = (fa_u16 *)bp.dv + bi * bp.dv_bstride + (fa_i64)key * bp.dv_rstride +
                      hk * bp.dv_hstride;
#pragma unroll
        for (int nt = 0; nt < FA_DP / 8; nt++) {
            const int col = nt * 8 + 2 * t;
#if FA_VEC
            if (col < kp->d)
                *(fa_u32 *)(dkr + col) = fa_pack2(dk[nt][2 * hf], dk[nt][2 * hf + 1]);
#else
            if (col < kp->d)
                dkr[col] = fa_from_float(dk[nt][2 * hf]);
            if (col + 1 < kp->d)
                dkr[col + 1] = fa_from_float(dk[nt][2 * hf + 1]);
#endif
        }
#pragma unroll
        for (int nt = 0; nt < FA_DVP / 8; nt++) {
            const int col = nt * 8 + 2 * t;
#if FA_VEC
            if (col < kp->dv)
                *(fa_u32 *)(dvr + col) = fa_pack2(dv[nt][2 * hf], dv[nt][2 * hf + 1]);
#else
            if (col < kp->dv)
                dvr[col] = fa_from_float(dv[nt][2 * hf]);
            if (col + 1 < kp->dv)
                dvr[col + 1] = fa_from_float(dv[nt][2 * hf + 1]);
#endif
        }
    }
}

/* Grid (h), 256 threads: d_sink[h] = -sum over (sequence, row) of exp(sink - lse) * D, each
 * thread a fixed stride of the rows, then a fixed tree: bitwise reproducible. */
extern "C" __global__ void __launch_bounds__(256) fa_bwd_dsinks(const fa_bkparams bp)
{
    const fa_kparams *kp = &bp.f;
    __shared__ float part[256];
    const int h = blockIdx.x;
    const float sink = kp->sinks[h * kp->sinks_stride];
    const fa_i64 n = (fa_i64)kp->b * kp->max_sq;
    float s = 0.f;
    for (fa_i64 x = threadIdx.x; x < n; x += 256) {
        const int bi = (int)(x / kp->max_sq), row = (int)(x - (fa_i64)bi * kp->max_sq);
        const float lse = kp->lse[bi * kp->lse_bstride + h * kp->lse_hstride + row * kp->lse_rstride];
        s -= expf(sink - lse) * bp.dsum[(fa_i64)h * kp->total_q + fa_bwd_token(kp, bi, row)];
    }
    part[threadIdx.x] = s;
    __syncthreads();
    for (int w = 128; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w)
            part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        bp.dsinks[h * bp.dsinks_stride] = part[0];
}

/* dq = dtype(dq_accum), grid-stride over [h][total_q][d]. */
extern "C" __global__ void __launch_bounds__(256) fa_bwd_convert(const fa_bkparams bp)
{
    const fa_kparams *kp = &bp.f;
    const fa_i64 n = (fa_i64)kp->h * kp->total_q * kp->d;
    for (fa_i64 x = (fa_i64)blockIdx.x * blockDim.x + threadIdx.x; x < n;
         x += (fa_i64)gridDim.x * blockDim.x) {
        const fa_i64 r = x / kp->d;
        const int col = (int)(x - r * kp->d);
        const int h = (int)(r / kp->total_q);
        const fa_i64 token = r - (fa_i64)h * kp->total_q;
        const int bi = (int)(token / kp->max_sq), row = (int)(token - (fa_i64)bi * kp->max_sq);
        fa_u16 *dqr = (fa_u16 *)bp.dq + bi * bp.dq_bstride + row * bp.dq_rstride + h * bp.dq_hstride;
        dqr[col] = fa_from_float(bp.dq_accum[x]);
    }
}
