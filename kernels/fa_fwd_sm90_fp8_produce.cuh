/*
 * The fp8 forward's producer warpgroup (kernels/fa_fwd_sm90_fp8.cu includes it after its tile
 * defines, the tensor maps, the shared-memory map and fa_fwd_sm90_fp8_v.cuh): thread 0's TMA
 * copies of Q, K and V (raw V, or V^T from the workspace with FA_TRANSPOSE 2) into the stages,
 * the walk over the CTA's tiles, and with FA_TRANSPOSE 1 the transposing warps' loop.
 */
#ifndef FA_FWD_SM90_FP8_PRODUCE_CUH
#define FA_FWD_SM90_FP8_PRODUCE_CUH

/* Thread 0: K and raw V of the tile's key block `it` into stage kv % FA_STAGES. */
FA_DEV void fa_load_kv8(const fa_smem8 *m, const fa_tmaps8 *tm, const fa_tile *w, int kv, int it)
{
    const int n = w->n_max - 1 - it, s = kv % FA_STAGES, ph = (kv / FA_STAGES) & 1;
    const int row = w->k_start + n * FA_BN, bi = FA_VARLEN ? 0 : w->bi;
    fa_mbar_wait(m->k_empty + 8 * s, ph ^ 1);
    fa_mbar_expect_tx(m->k_full + 8 * s, FA_K_BYTES);
#pragma unroll
    for (int c = 0; c < FA_KB; c++)
        fa_tma_load4(m->k + s * FA_K_BYTES + c * FA_BN * FA_RB, &tm->k, FA_RB * c, row, w->hk, bi,
                     m->k_full + 8 * s);
#if FA_TRANSPOSE == 2
    /* V^T[s] straight from global memory once the consumers' P V of its last block is done: a
     * box of 128 keys by FA_DVP rows per 128-key block (keys past the sequence come as zeros). */
    fa_mbar_wait(m->v_empty + 8 * s, ph ^ 1);
    fa_mbar_expect_tx(m->v_full + 8 * s, FA_VT_BYTES);
#pragma unroll
    for (int c = 0; c < (FA_BN + 127) / 128; c++)
        fa_tma_load4(m->vt + s * FA_VT_BYTES + c * (FA_DVP * 128), &tm->v, row + 128 * c, 0, w->hk,
                     bi, m->v_full + 8 * s);
#else
    /* Vr[s] is free once its previous block was transposed: FA_TRANSPOSE 0, the warpgroup
     * finished it before this thread got here (named barrier 4); 1, its warps said so. */
#if FA_TRANSPOSE == 1
    fa_mbar_wait(m->r_empty + 8 * s, ph ^ 1);
    /* Published with the stage: r_full's arrival below releases it. */
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(m->r_keys + 8 * s), "r"(w->sk - n * FA_BN)
                 : "memory");
#endif
    fa_mbar_expect_tx(m->r_full + 8 * s, FA_V_BYTES);
#pragma unroll
    for (int c = 0; c < FA_DVP / FA_RB; c++)
        fa_tma_load4(m->vr + s * FA_V_BYTES + c * FA_BN * FA_RB, &tm->v, FA_RB * c, row, w->hk, bi,
                     m->r_full + 8 * s);
#endif
}

/* Thread 0: Q of the tile (once every consumer's last S of the previous tile finished). */
FA_DEV void fa_load_q8(const fa_smem8 *m, const fa_tmaps8 *tm, const fa_tile *w, int q_round)
{
    fa_mbar_wait(m->q_empty, (q_round & 1) ^ 1);
    fa_mbar_expect_tx(m->q_full, FA_Q_BYTES);
#pragma unroll
    for (int c = 0; c < FA_KB; c++)
        fa_tma_load4(m->q + c * FA_BM * FA_RB, &tm->q, FA_RB * c, w->q_start + w->m0, w->h,
                     FA_VARLEN ? 0 : w->bi, m->q_full);
}

/* The producer warpgroup's share of a tile (kv: blocks loaded so far, q_round: tiles): thread 0
 * loads, and FA_TRANSPOSE 0 has the whole warpgroup transpose (1, 2: thread 0 alone is here). */
FA_DEV void fa_produce_tile8(const fa_smem8 *m, const fa_tmaps8 *tm, const fa_tile *w, int *kv,
                             int *q_round)
{
#if FA_TRANSPOSE
    fa_load_q8(m, tm, w, *q_round);
    for (int it = 0; it < w->n_blocks; it++, ++*kv)
        fa_load_kv8(m, tm, w, *kv, it);
#else
    if (threadIdx.x == 0) {
        fa_load_q8(m, tm, w, *q_round);
        fa_load_kv8(m, tm, w, *kv, 0);
    }
    for (int it = 0; it < w->n_blocks; it++, ++*kv) {
        /* The next block's copies fly while this one is transposed. */
        if (threadIdx.x == 0 && it + 1 < w->n_blocks)
            fa_load_kv8(m, tm, w, *kv + 1, it + 1);
        fa_transpose_v(m, *kv, w->sk - (w->n_max - 1 - it) * FA_BN);
    }
#endif
    ++*q_round;
}

/* The producer warpgroup (FA_TRANSPOSE 1: its thread 0) over the CTA's tiles. The schedule's
 * numbers are made here, after the setmaxnreg: kept across it, they went to local memory. */
FA_DEV void fa_produce8(const fa_kparams *kp, const fa_tmaps8 *tm, const fa_smem8 *m)
{
    int kv = 0, q_round = 0;
    for (int t = blockIdx.x;;) {
        /* Made again per tile (pinned, so not hoisted), as the consumers do: hoisted, the
         * loading thread (FA_TRANSPOSE 1) spilled them. */
        int m_blocks = (int)((kp->max_sq + FA_BM - 1) / FA_BM);
        const int n_units = fa_units(tm->paired, m_blocks, kp);
        if (t >= n_units)
            break;
        for (int half = 0, hb, mb; half < 2; half++) {
            m_blocks = (int)((kp->max_sq + FA_BM - 1) / FA_BM);
            FA_PINU(m_blocks);
            if ((mb = fa_unit_tile(tm->paired, m_blocks, t, half, &hb)) >= 0) {
                const fa_tile w = fa_tile_get(kp, hb, mb);
                if (w.n_blocks > 0)
                    fa_produce_tile8(m, tm, &w, &kv, &q_round);
            }
        }
        fa_u32 grid; /* read here (volatile): held across the tile, it was spilled */
        asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(grid));
        t += grid;
    }
#if FA_TRANSPOSE == 1
    /* The end, for the transposing warps: a stage of -1 keys, no copy. */
    const int s = kv % FA_STAGES;
    fa_mbar_wait(m->r_empty + 8 * s, ((kv / FA_STAGES) & 1) ^ 1);
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(m->r_keys + 8 * s), "r"(-1) : "memory");
    fa_mbar_arrive(m->r_full + 8 * s);
#endif
}

#if FA_TRANSPOSE == 1
/* Warps 1 .. 3 of the producer warpgroup: every stage the loading thread fills, in order, until
 * one of -1 keys. They hold no schedule: in the producer's 24 registers, a loop over the tiles
 * beside the transpose spilled. */
FA_DEV void fa_transpose8(const fa_smem8 *m)
{
    for (int kv = 0;; kv++) {
        const int s = kv % FA_STAGES;
        fa_mbar_wait(m->r_full + 8 * s, (kv / FA_STAGES) & 1);
        int keys;
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(keys) : "r"(m->r_keys + 8 * s) : "memory");
        if (keys < 0)
            return;
        fa_transpose_v(m, kv, keys);
    }
}
#endif

#endif /* FA_FWD_SM90_FP8_PRODUCE_CUH */
