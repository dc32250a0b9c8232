/*
 * Forward attention for sm80 and later (runs on Hopper too): FlashAttention-2's algorithm on
 * mma.sync m16n8k16 tensor-core instructions with fp32 accumulation.
 *
 * One CTA computes a tile of FA_BM query rows of one (sequence, head). Its warps split the rows
 * (FA_MT m-tiles of 16 rows each); keys are visited in blocks of FA_BN from the last visible block
 * to the first, with an online softmax in base 2 (the softmax scale and log2(e) are folded into
 * the one FFMA in front of each exp2). Q, K and V live in shared memory in 16-byte chunks whose
 * column is XOR-swizzled by the row, so that the 8 row addresses of every ldmatrix hit 8
 * different bank groups; each thread computes its shared and global addresses once and steps
 * them by constants.
 * Copies are cp.async: V of block n loads while S = Q K^T runs, K of block n-1 while the softmax
 * and O += P V run, so a copy is always in flight behind the tensor cores.
 *
 * Defines from the plan (src/plan/fa_plan.c):
 *   FA_BF16           data type (0: fp16, 1: bf16)
 *   FA_DP, FA_DVP     head dims of q/k and of v, padded to 32 or a multiple of 64
 *   FA_BM, FA_BN      query rows per CTA, keys per block
 *   FA_NWARPS         warps per CTA, a power of two (FA_BM = 16 * FA_NWARPS * m-tiles per warp)
 *   FA_VEC            1: every row is 16-byte aligned with d, dv % 8 == 0, so cp.async is used
 *   FA_VARLEN, FA_ALIBI, FA_SOFTCAP, FA_DROPOUT   features compiled in (0/1)
 *   FA_PAGED          defined (1) only for a paged varlen call: each K/V row's address is looked
 *                     up through block_table as it is copied (fa_page_row), so any page size
 *                     works; dense kernels compile without it
 *   FA_SCORE_MOD, FA_MASK_MOD, FA_BLOCK_MASK   defined (1) only for calls with user-defined
 *                     scoring: the generated fa_mod_gen.cuh (the programs as fa_score_mod /
 *                     fa_mask_mod) is included, score_mod applied after softcap and ALiBi,
 *                     mask_mod and the block mask where the mask is (see fa_mod_keep)
 * Entry points: fa_fwd (the attention), fa_fwd_fill (varlen rows outside every sequence) and
 * fa_fwd_probs (the debugging probs output).
 */
#ifndef FA_PAGED
#define FA_PAGED 0
#endif
#include "fa_mod_flags.h"
#include "fa_smem.h"

#include "fa_common.cuh"

#define FA_THREADS (FA_NWARPS * 32)
#define FA_MT (FA_BM / (16 * FA_NWARPS)) /* 16-row m-tiles per warp */
#define FA_NT (FA_BN / 8)                /* 8-key n-tiles of S */
#define FA_OT (FA_DVP / 8)               /* 8-column n-tiles of O */
#define FA_KS (FA_DP / 16)               /* k-steps of Q K^T */
#define FA_CPR_K (FA_DP / 8)             /* 16-byte chunks per row of Q and K */
#define FA_CPR_V (FA_DVP / 8)

#if FA_BM % (16 * FA_NWARPS) != 0 || FA_BN % 16 != 0 || FA_DP % 16 != 0 || FA_DVP % 16 != 0
#error "tile sizes must be multiples of the mma shape"
#endif

/* The copies give each thread one fixed column chunk when the thread count is a multiple of the
 * chunks per row (all but the 24 chunks of d 192): chunk c of rows r0, r0 + rpp, r0 + 2 rpp, ...
 * with rpp = FA_THREADS / cpr. Both are powers of two, so r0 < rpp shares no bit with j * rpp
 * and the key of row r0 + j * rpp is key(r0) ^ key(j * rpp): one address per thread, stepped
 * by constants. Otherwise chunk i of the tile goes to thread i % FA_THREADS, its row and column
 * computed per chunk. */
#define FA_FIXED_CHUNK(cpr) (FA_THREADS % (cpr) == 0)

#if FA_THREADS & (FA_THREADS - 1)
#error "the copy scheme needs a power-of-two thread count"
#endif

#include "fa_mod.cuh"

/* The key loop's walk over the blocks: from the last to the first, or, with a block mask, over
 * the blocks it keeps (nb_next, from fa_bm_below). The macros give the plain kernels their
 * code unchanged. */
#if FA_BLOCK_MASK
#define FA_NB_FIRST nb_first
#define FA_NB_ANY nb_first >= n_min
#define FA_NB_STEP(nb) nb = nb_next
#define FA_NB_MORE nb_next >= n_min
#define FA_NB_N1 nb_next * FA_BN
#define FA_NB_GAP (nb - nb_next) *
#else
#define FA_NB_FIRST n_max - 1
#define FA_NB_ANY n_max > n_min
#define FA_NB_STEP(nb) nb--
#define FA_NB_MORE nb > n_min
#define FA_NB_N1 n0 - FA_BN
#define FA_NB_GAP
#endif

#if FA_MOD_MASKS
/* Whether a key the window keeps is dropped by the mods (in the key loop: its block's state
 * mod_st, mod_on when some key of the block needs the test). */
#define FA_MOD_DROP(row, col)                                                                    \
    (mod_on && !fa_mod_keep(&kp, bm_tab, mod_st, bi, h, row, col, bm_qb0, bm_nqb))
#else
#define FA_MOD_DROP(row, col) false
#endif

#include "fa_fwd_sm80_copy.cuh"

/* Whether the scores are turned into base-2 units element by element before the softmax
 * (softcap and ALiBi transform them anyway); otherwise scale * log2(e) is folded into the one
 * FFMA in front of each exp2: p = 2^(s * c - m * c). */
#define FA_PRESCALE (FA_SOFTCAP || FA_ALIBI || FA_SCORE_MOD)

extern "C" __global__ void __launch_bounds__(FA_THREADS) fa_fwd(const fa_kparams kp)
{
    extern __shared__ __align__(128) fa_u16 fa_smem[];
    /* Shared addresses of the tiles Q [FA_BM][FA_DP], K [FA_BN][FA_DP], V [FA_BN][FA_DVP]. */
    const fa_u32 sq_a = fa_smem_addr(fa_smem);
    const fa_u32 sk_a = sq_a + FA_BM * FA_DP * 2;
    const fa_u32 sv_a = sk_a + FA_BN * FA_DP * 2;

    /* Heavy (late, under causal) query tiles first, so they do not end the launch alone. */
    const int m_block = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, bi = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const fa_seq seq = fa_seq_get(&kp, bi, FA_VARLEN);
    const int m0 = m_block * FA_BM;
    if (m0 >= seq.sq)
        return;
    const int hk = h / (kp.h / kp.hk);
    const int wrow = warp * FA_MT * 16; /* this warp's first row in the tile */

    const fa_u16 *qg = (const fa_u16 *)kp.q + bi * kp.q_bstride + (seq.q_start + m0) * kp.q_rstride +
                       h * kp.q_hstride;
#if !FA_PAGED /* paged rows are found at each copy (fa_pages_row) */
    const fa_u16 *kg = (const fa_u16 *)kp.k + bi * kp.k_bstride + seq.k_start * kp.k_rstride +
                       hk * kp.k_hstride;
    const fa_u16 *vg = (const fa_u16 *)kp.v + bi * kp.v_bstride + seq.k_start * kp.v_rstride +
                       hk * kp.v_hstride;
#endif
#if FA_VEC
    const fa_copy cq = fa_copy_make(sq_a, kp.q_rstride, kp.d, FA_CPR_K);
    const fa_copy ck = fa_copy_make(sk_a, kp.k_rstride, kp.d, FA_CPR_K);
    const fa_copy cv = fa_copy_make(sv_a, kp.v_rstride, kp.dv, FA_CPR_V);
#else
    fa_u16 *const sq_p = fa_smem, *const sk_p = sq_p + FA_BM * FA_DP;
    fa_u16 *const sv_p = sk_p + FA_BN * FA_DP;
#endif

    /* This thread's ldmatrix addresses at k-step / n-pair / d-pair 0 (see fa_swz_at):
     * Q (A operand): lanes 0-15 rows 0-15 at chunk 0, lanes 16-31 the same rows at chunk 1;
     * K (B operand, two n-tiles): matrices (keys 0-7, chunk 0), (0-7, 1), (8-15, 0), (8-15, 1);
     * V (B operand by .trans, two d-tiles): (keys 0-7, chunk 0), (8-15, 0), (0-7, 1), (8-15, 1). */
    const fa_u32 q_ld = sq_a + fa_swz(wrow + (lane & 15), lane >> 4, FA_CPR_K);
    const fa_u32 k_ld = sk_a + fa_swz((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1, FA_CPR_K);
    const fa_u32 v_ld = sv_a + fa_swz((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4, FA_CPR_V);

    /* The keys any row of the tile sees: both window edges grow with the row (fa_tile_keys; the
     * first row's hi and the last row's lo also tell the blocks every row sees whole). */
    const int m_last = fa_min(m0 + FA_BM, seq.sq) - 1;
    int lo_first, hi_first, lo_last, hi_last;
    fa_key_range(&kp, m0, seq.sq, seq.sk, &lo_first, &hi_first);
    fa_key_range(&kp, m_last, seq.sq, seq.sk, &lo_last, &hi_last);
    const int n_min = lo_first / FA_BN;
    const int n_max = hi_last > lo_first ? (hi_last + FA_BN - 1) / FA_BN : n_min;
#if FA_BLOCK_MASK
    /* The block mask's states for the tile's query blocks, behind the tiles (the launcher adds
     * their bytes to the shared memory). */
    unsigned char *const bm_tab =
        (unsigned char *)(fa_smem + FA_BM * FA_DP + FA_BN * (FA_DP + FA_DVP));
    const int bm_qb0 = m0 / kp.bm_q_block, bm_nqb = m_last / kp.bm_q_block - bm_qb0 + 1;
    fa_bm_load(&kp, bm_tab, bi, h, 1, bm_qb0, bm_nqb, 0, kp.bm_nk);
    int *const bm_lab = (int *)(bm_tab + FA_SMEM_BM_STATES(FA_BM, kp.bm_q_block, kp.bm_nk));
    fa_bm_live(&kp, bm_tab, bm_nqb, bm_lab);
#define FA_BM_BELOW(nb) fa_bm_below(&kp, bm_lab, nb, n_min, seq.sk)
    /* The first key block visited: the last one the block mask keeps. */
    const int nb_first = FA_BM_BELOW(n_max);
    int nb_next;
#elif FA_MASK_MOD
    const unsigned char *const bm_tab = 0; /* no block mask: one state, partial */
    const int bm_qb0 = 0, bm_nqb = 1;
#endif

    /* The factor in front of exp2. A scale <= 0 would turn the running max into a min and the
     * masked -inf into +inf or NaN, so then (never in practice) the scores are prescaled too. */
    const int prescale = FA_PRESCALE || !(kp.scale_log2 > 0.f);
    const float sm = prescale ? 1.f : kp.scale_log2;

    /* Per row this thread owns (rows g and g+8 of each m-tile): running max of the scores (in
     * units of 1/sm) and this thread's share of the running sum. */
    float row_max[FA_MT][2], row_sum[FA_MT][2];
    float o[FA_MT][FA_OT][4];
#pragma unroll
    for (int mt = 0; mt < FA_MT; mt++) {
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            row_max[mt][hf] = -FA_INF;
            row_sum[mt][hf] = 0.f;
        }
#pragma unroll
        for (int ot = 0; ot < FA_OT; ot++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                o[mt][ot][e] = 0.f;
    }
#if FA_ALIBI
    const float slope_log2 = kp.alibi_slopes[bi * kp.alibi_bstride + h * kp.alibi_hstride] * FA_LOG2E;
#endif
#if FA_DROPOUT
    const fa_u64 stream = fa_dropout_stream(&kp, bi, h);
    const fa_u32 thr2 = fa_dropout_thr2(kp.keep_threshold);
#endif

#if FA_VEC && !FA_PAGED
    /* This thread's first chunk of the next K and V blocks to load (the last block first). */
    const fa_u16 *k_src = kg + ck.src + (fa_i64)(FA_NB_FIRST) * FA_BN * kp.k_rstride;
    const fa_u16 *v_src = vg + cv.src + (fa_i64)(FA_NB_FIRST) * FA_BN * kp.v_rstride;
#endif
    if (FA_NB_ANY) {
#if FA_VEC
        fa_tile_load(&cq, qg + cq.src, kp.q_rstride, seq.sq - m0, FA_BM, FA_CPR_K, kp.q);
#if FA_PAGED
        fa_tile_load_paged(&ck, &kp, bi, hk, 0, (FA_NB_FIRST) * FA_BN,
                           seq.sk - (FA_NB_FIRST) * FA_BN, FA_BN, FA_CPR_K, kp.k);
#else
        fa_tile_load(&ck, k_src, kp.k_rstride, seq.sk - (FA_NB_FIRST) * FA_BN, FA_BN, FA_CPR_K,
                     kp.k);
#endif
#else
        fa_tile_load_scalar(sq_p, qg, kp.q_rstride, seq.sq - m0, kp.d, FA_BM, FA_CPR_K);
#if FA_PAGED
        fa_tile_load_scalar_paged(sk_p, &kp, bi, hk, 0, (FA_NB_FIRST) * FA_BN,
                                  seq.sk - (FA_NB_FIRST) * FA_BN, kp.d, FA_BN, FA_CPR_K);
#else
        fa_tile_load_scalar(sk_p, kg + (fa_i64)(FA_NB_FIRST) * FA_BN * kp.k_rstride,
                            kp.k_rstride, seq.sk - (FA_NB_FIRST) * FA_BN, kp.d, FA_BN, FA_CPR_K);
#endif
#endif
        fa_cp_async_commit();
    }

#if FA_VARLEN
    /* The key loop reads the sequence's lengths from shared memory where it uses them: held in
     * registers over the loop, they made ptxas spill (the dense lengths are kernel parameters,
     * read where used). Thread 0 writes them; the loop's first barrier publishes them. */
    volatile int *const lens =
        (volatile int *)(fa_smem + FA_BM * FA_DP + FA_BN * (FA_DP + FA_DVP));
    if (threadIdx.x == 0)
        lens[0] = seq.sq, lens[1] = seq.sk;
#define FA_LSQ lens[0]
#define FA_LSK lens[1]
#else
#define FA_LSQ seq.sq
#define FA_LSK seq.sk
#endif
    for (int nb = FA_NB_FIRST; nb >= n_min; FA_NB_STEP(nb)) {
        const int n0 = nb * FA_BN;
#if FA_BLOCK_MASK
        nb_next = FA_BM_BELOW(nb);
#endif
        /* K of this block (and Q) landed; every warp is done with the previous V. */
        fa_cp_async_wait_all();
        __syncthreads();
#if FA_PAGED && FA_VEC
        fa_tile_load_paged(&cv, &kp, bi, hk, 1, n0, FA_LSK - n0, FA_BN, FA_CPR_V, kp.v);
#elif FA_PAGED
        fa_tile_load_scalar_paged(sv_p, &kp, bi, hk, 1, n0, FA_LSK - n0, kp.dv, FA_BN, FA_CPR_V);
#elif FA_VEC
        fa_tile_load(&cv, v_src, kp.v_rstride, FA_LSK - n0, FA_BN, FA_CPR_V, kp.v);
        v_src -= FA_NB_GAP FA_BN * kp.v_rstride;
#else
        fa_tile_load_scalar(sv_p, vg + (fa_i64)n0 * kp.v_rstride, kp.v_rstride, FA_LSK - n0,
                            kp.dv, FA_BN, FA_CPR_V);
#endif
        fa_cp_async_commit();

        /* S = Q K^T: Q fragments by ldmatrix per m-tile, K fragments for two n-tiles at a time. */
        float s[FA_MT][FA_NT][4];
#pragma unroll
        for (int mt = 0; mt < FA_MT; mt++)
#pragma unroll
            for (int nt = 0; nt < FA_NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    s[mt][nt][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < FA_KS; ks++) {
            fa_u32 qa[FA_MT][4];
#pragma unroll
            for (int mt = 0; mt < FA_MT; mt++)
                fa_ldmatrix_x4(qa[mt], fa_swz_at(q_ld, 2 * ks) + mt * 16 * FA_CPR_K * 16);
#pragma unroll
            for (int np = 0; np < FA_NT / 2; np++) {
                fa_u32 kb[4];
                fa_ldmatrix_x4(kb, fa_swz_at(k_ld, 2 * ks) + np * 16 * FA_CPR_K * 16);
#pragma unroll
                for (int mt = 0; mt < FA_MT; mt++) {
                    fa_mma16816(s[mt][2 * np], qa[mt], kb[0], kb[1]);
                    fa_mma16816(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
                }
            }
        }

        /* Scores in base-2 units where the features need it (or the scale is not positive). */
        if (prescale) {
#if FA_ALIBI
            const int skq = FA_LSK - FA_LSQ;
#endif
#pragma unroll
            for (int mt = 0; mt < FA_MT; mt++)
#pragma unroll
                for (int nt = 0; nt < FA_NT; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        float x = s[mt][nt][e];
#if FA_SOFTCAP
                        x = FA_RULE_SOFTCAP(x, kp.softcap_pre, kp.scale_log2, fa_tanh_fast);
#else
                        x *= kp.scale_log2;
#endif
#if FA_ALIBI
                        int dist = m0 + wrow + mt * 16 + g + 8 * (e >> 1) + skq -
                                   (n0 + nt * 8 + 2 * t + (e & 1));
                        x -= FA_RULE_ALIBI(slope_log2, dist);
#endif
#if FA_SCORE_MOD
                        x = fa_score_mod_base2(&kp, x, bi, h,
                                               m0 + wrow + mt * 16 + g + 8 * (e >> 1),
                                               n0 + nt * 8 + 2 * t + (e & 1), NULL);
#endif
                        s[mt][nt][e] = x;
                    }
        }
        /* The mask, only where the block is not wholly visible to every row of the tile (window
         * edges, the end of the keys) or mask_mod or the block mask decide some of its keys. */
#if FA_MOD_MASKS
#if FA_BLOCK_MASK
        const int mod_st = fa_bm_state(&kp, bm_tab, bm_nqb, n0, seq.sk);
#else
        const int mod_st = FA_BM_PARTIAL;
#endif
        const bool mod_on = FA_MASK_MOD ? mod_st != FA_BM_FULL : mod_st == FA_BM_MIXED;
        if (mod_on || !(lo_last <= n0 && hi_first >= n0 + FA_BN)) {
#else
        if (!(lo_last <= n0 && hi_first >= n0 + FA_BN)) {
#endif
#pragma unroll
            for (int mt = 0; mt < FA_MT; mt++)
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    int lo, hi;
                    fa_key_range(&kp, m0 + wrow + mt * 16 + g + 8 * hf, FA_LSQ, FA_LSK, &lo, &hi);
                    lo -= n0 + 2 * t;
                    hi -= n0 + 2 * t;
#pragma unroll
                    for (int nt = 0; nt < FA_NT; nt++)
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            const int col = nt * 8 + e; /* minus the thread's 2t */
                            if (col < lo || col >= hi ||
                                FA_MOD_DROP(m0 + wrow + mt * 16 + g + 8 * hf, n0 + 2 * t + col))
                                s[mt][nt][2 * hf + e] = -FA_INF;
                        }
                }
        }

        /* V landed; every warp is done with K, so the next K may overwrite it. */
        fa_cp_async_wait_all();
        __syncthreads();
        if (FA_NB_MORE) {
            /* Only the last block can be partial, and it is the first one visited. */
#if FA_PAGED && FA_VEC
            fa_tile_load_paged(&ck, &kp, bi, hk, 0, FA_NB_N1, FA_BN, FA_BN, FA_CPR_K, kp.k);
#elif FA_PAGED
            fa_tile_load_scalar_paged(sk_p, &kp, bi, hk, 0, FA_NB_N1, FA_LSK - (FA_NB_N1),
                                      kp.d, FA_BN, FA_CPR_K);
#elif FA_VEC
            k_src -= FA_NB_GAP FA_BN * kp.k_rstride;
            fa_tile_load(&ck, k_src, kp.k_rstride, FA_BN, FA_BN, FA_CPR_K, kp.k);
#else
            fa_tile_load_scalar(sk_p, kg + (fa_i64)(FA_NB_N1) * kp.k_rstride, kp.k_rstride,
                                FA_LSK - (FA_NB_N1), kp.d, FA_BN, FA_CPR_K);
#endif
            fa_cp_async_commit();
        }

        /* Online softmax: a row's values sit in the 4 lanes of a quad, hence the two shuffles. */
#pragma unroll
        for (int mt = 0; mt < FA_MT; mt++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                float mx = row_max[mt][hf];
#pragma unroll
                for (int nt = 0; nt < FA_NT; nt++)
                    mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                /* A row with nothing visible yet keeps max -inf; subtract 0 then, not -inf. */
                const float base = mx == -FA_INF ? 0.f : mx * sm;
                const float alpha = fa_exp2(row_max[mt][hf] * sm - base);
                row_max[mt][hf] = mx;
                row_sum[mt][hf] *= alpha;
#pragma unroll
                for (int ot = 0; ot < FA_OT; ot++) {
                    o[mt][ot][2 * hf] *= alpha;
                    o[mt][ot][2 * hf + 1] *= alpha;
                }
#if FA_DROPOUT
                /* Dropout words for this row: Philox once per 8 n-tiles per lane, shared across
                 * the quad (n-tiles 2j and 2j + 1 are the columns of the row's block j, counter
                 * (col / 16, row, stream)): n-tile nt's numbers are in dw[nt / 2]. */
                fa_u32 dw[(FA_NT + 7) / 8 * 4];
                const int row = m0 + wrow + mt * 16 + g + 8 * hf;
#pragma unroll
                for (int q8 = 0; q8 < (FA_NT + 7) / 8; q8++)
                    fa_dropout_quad((fa_u32)FA_RULE_DROPOUT_BLOCK(n0) + 4 * q8, (fa_u32)row,
                                    stream, kp.seed, t, dw + 4 * q8);
#endif
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < FA_NT; nt++) {
                    /* One FFMA and one MUFU per probability. */
                    float p0 = fa_exp2(fmaf(s[mt][nt][2 * hf], sm, -base));
                    float p1 = fa_exp2(fmaf(s[mt][nt][2 * hf + 1], sm, -base));
                    sum += p0 + p1;
#if FA_DROPOUT
                    /* The sum counts dropped keys too: dropout acts after the softmax. */
                    fa_dropout_apply2(&p0, &p1, dw[nt >> 1], nt & 1, thr2);
#endif
                    s[mt][nt][2 * hf] = p0;
                    s[mt][nt][2 * hf + 1] = p1;
                }
                row_sum[mt][hf] += sum;
            }

        /* O += P V. The S accumulators of n-tiles 2kk and 2kk+1 are exactly the A fragment of
         * k-step kk, so P never leaves registers; V fragments come from ldmatrix.trans. */
#pragma unroll
        for (int kk = 0; kk < FA_BN / 16; kk++) {
            fa_u32 pa[FA_MT][4];
#pragma unroll
            for (int mt = 0; mt < FA_MT; mt++) {
                pa[mt][0] = fa_pack2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[mt][1] = fa_pack2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[mt][2] = fa_pack2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[mt][3] = fa_pack2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < FA_OT / 2; dp++) {
                fa_u32 vb[4];
                fa_ldmatrix_x4_trans(vb, fa_swz_at(v_ld, 2 * dp) + kk * 16 * FA_CPR_V * 16);
#pragma unroll
                for (int mt = 0; mt < FA_MT; mt++) {
                    fa_mma16816(o[mt][2 * dp], pa[mt], vb[0], vb[1]);
                    fa_mma16816(o[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
                }
            }
        }
    }

#undef FA_LSQ
#undef FA_LSK

    /* Epilogue: the sink joins the denominator; rows with no visible key and no sink give 0 and
     * lse +inf. */
    const float sink2 = kp.sinks ? kp.sinks[h * kp.sinks_stride] * FA_LOG2E : -FA_INF;
    /* Varlen: the sequence read again, since its first row and length held in registers over
     * the key loop made ptxas spill there. */
#if FA_VARLEN
    const fa_seq fin = fa_seq_get(&kp, bi, 1);
#else
    const fa_seq fin = seq;
#endif
#pragma unroll
    for (int mt = 0; mt < FA_MT; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int row = m0 + wrow + mt * 16 + g + 8 * hf;
            float lse, scale;
            fa_row_finish(row_sum[mt][hf], row_max[mt][hf] * sm, sink2, &lse, &scale);
            scale *= kp.dropout_scale;
            fa_u16 *og = (fa_u16 *)kp.out + bi * kp.o_bstride + (fin.q_start + row) * kp.o_rstride +
                         h * kp.o_hstride;
#if FA_VEC
            /* 16 bytes a lane through the quad's shuffles, which every lane takes part in. */
            fa_store_row16(og, kp.dv, o[mt], FA_DVP, hf, t, scale, row < fin.sq);
#endif
            if (row >= fin.sq)
                continue;
#if !FA_VEC
#pragma unroll
            for (int ot = 0; ot < FA_OT; ot++) {
                const int col = ot * 8 + 2 * t;
                fa_store_pair(og, col, kp.dv, o[mt][ot][2 * hf] * scale,
                              o[mt][ot][2 * hf + 1] * scale);
            }
#endif
            if (kp.lse && t == 0)
                kp.lse[bi * kp.lse_bstride + h * kp.lse_hstride +
                       (FA_VARLEN ? fin.q_start + row : row) * kp.lse_rstride] = lse;
        }
}

/* Varlen only: rows of out/lse before the first sequence or after the last get 0 / +inf. One
 * thread per (row, head). */
extern "C" __global__ void fa_fwd_fill(const fa_kparams kp) { fa_fill_outside(&kp); }

/* The probs (S_dmask) encoding: one warp per (sequence, head, row); key blocks of
 * kp.probs_block_n (<= 128, so 4 keys per lane) from the last to the first, each entry
 * exp(s - running max), negated when dropout drops it. For testing only: plain fp32 loads. */
extern "C" __global__ void fa_fwd_probs(const fa_kparams kp)
{
    const int lane = threadIdx.x & 31;
    const fa_i64 row = (fa_i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int h = blockIdx.y, bi = blockIdx.z;
    if (row >= kp.probs_sq)
        return;
    const fa_seq seq = fa_seq_get(&kp, bi, FA_VARLEN);
    const int hk = h / (kp.h / kp.hk);
    fa_u16 *pr = (fa_u16 *)kp.probs + bi * kp.p_bstride + h * kp.p_hstride + row * kp.p_rstride;
    int lo = 0, hi = 0;
    if (row < seq.sq)
        fa_key_range(&kp, (int)row, seq.sq, seq.sk, &lo, &hi);
    for (fa_i64 j = lane; j < kp.probs_sk; j += 32)
        if (j < lo || j >= hi)
            pr[j] = 0;
    if (lo >= hi)
        return;
    const fa_u16 *qr = (const fa_u16 *)kp.q + bi * kp.q_bstride + (seq.q_start + row) * kp.q_rstride +
                       h * kp.q_hstride;
#if FA_PAGED
    const fa_u16 *kr = (const fa_u16 *)kp.k + hk * kp.k_hstride; /* rows by fa_page_row */
#else
    const fa_u16 *kr = (const fa_u16 *)kp.k + bi * kp.k_bstride + seq.k_start * kp.k_rstride +
                       hk * kp.k_hstride;
#endif
    const float slope =
        kp.alibi_slopes ? kp.alibi_slopes[bi * kp.alibi_bstride + h * kp.alibi_hstride] : 0.f;
    const int bn = kp.probs_block_n;
    float mx = -FA_INF;
    for (int blk = (seq.sk + bn - 1) / bn - 1; blk >= 0; blk--) {
        const int a = fa_max(blk * bn, lo), b = fa_min((blk + 1) * bn, hi);
        if (a >= b)
            continue;
        float x[4];
        float bmax = -FA_INF;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int j = a + lane + 32 * u;
            x[u] = -FA_INF;
            if (j >= b)
                continue;
            float dot = 0.f;
#if FA_PAGED
            const fa_u16 *kj = kr + fa_page_row(&kp, kp.block_table + bi * kp.bt_bstride, j,
                                                kp.k_bstride, kp.k_rstride);
            for (int c = 0; c < kp.d; c++)
                dot += fa_to_float(qr[c]) * fa_to_float(kj[c]);
#else
            for (int c = 0; c < kp.d; c++)
                dot += fa_to_float(qr[c]) * fa_to_float(kr[(fa_i64)j * kp.k_rstride + c]);
#endif
            float y = kp.softcap > 0.f
                          ? FA_RULE_SOFTCAP(dot, kp.softcap_pre, kp.softcap, fa_tanh_fast)
                          : dot * kp.scale;
            y -= FA_RULE_ALIBI(slope, (float)(row + seq.sk - seq.sq - j));
            x[u] = y;
            bmax = fmaxf(bmax, y);
        }
#pragma unroll
        for (int sh = 16; sh > 0; sh >>= 1)
            bmax = fmaxf(bmax, __shfl_xor_sync(0xffffffffu, bmax, sh));
        mx = fmaxf(mx, bmax);
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int j = a + lane + 32 * u;
            if (j >= b)
                continue;
            float e = expf(x[u] - mx);
            if (kp.keep_threshold < 256u) {
                const fa_u32 w = fa_dropout_word(&kp, bi, h, (int)row, j);
                if (((w >> FA_RULE_DROPOUT_SHIFT(j)) & 0xffu) >= kp.keep_threshold)
                    e = -e;
            }
            pr[j] = fa_from_float(e);
        }
    }
}
