/*
 * The Hopper forward's main loop (kernels/fa_fwd_sm90.cu includes it after its tile defines, the
 * tensor maps and the shared-memory map): the producer thread's loads of a tile (Q, then K and V
 * of each key block into the stages), and a consumer warpgroup's share of a tile - S, the
 * element-wise step (fa_fwd_sm90_softmax.cuh), P V, pingpong between the consumers - and its
 * epilogue. Dropout's words come from the producer's ring where FA_DROP_RING
 * (fa_fwd_sm90_drop.cuh).
 */
#ifndef FA_FWD_SM90_MAINLOOP_CUH
#define FA_FWD_SM90_MAINLOOP_CUH

/* The producer's thread: Q of the tile, then K and V of each key block into the ring (kv counts
 * the blocks this CTA has loaded so far, q_round the tiles). */
FA_DEV void fa_produce_tile(const fa_smem_map *m, const fa_tmaps *tm, const fa_tile *w, int *kv,
                            int *q_round)
{
    /* Q is overwritten only once every consumer's last S = Q K^T of the previous tile finished. */
    fa_mbar_wait(m->q_empty, (*q_round & 1) ^ 1);
    fa_mbar_expect_tx(m->q_full, FA_Q_BYTES);
#pragma unroll
    for (int c = 0; c < FA_KB; c++)
        fa_tma_load4(m->q + c * FA_BM * 128, &tm->q, 64 * c, w->q_start + w->m0, w->h,
                     FA_VARLEN ? 0 : w->bi, m->q_full);
    ++*q_round;
    for (int it = 0; it < w->n_blocks; it++, ++*kv) {
        const int n = FA_TILE_BLOCK(w, it), s = *kv % FA_STAGES, ph = (*kv / FA_STAGES) & 1;
        /* Each of K and V waits until every consumer released the stage's previous use. */
        fa_mbar_wait(m->k_empty + 8 * s, ph ^ 1);
        fa_mbar_expect_tx(m->k_full + 8 * s, FA_K_BYTES);
#pragma unroll
        for (int c = 0; c < FA_KB; c++)
            fa_tma_load4(m->k + s * FA_K_BYTES + c * FA_BN * 128, &tm->k, 64 * c,
                         w->k_start + n * FA_BN, w->hk, FA_VARLEN ? 0 : w->bi, m->k_full + 8 * s);
        fa_mbar_wait(m->v_empty + 8 * s, ph ^ 1);
        fa_mbar_expect_tx(m->v_full + 8 * s, FA_V_BYTES);
#pragma unroll
        for (int c = 0; c < FA_VB; c++)
            fa_tma_load4(m->v + s * FA_V_BYTES + c * FA_BN * 128, &tm->v, 64 * c,
                         w->k_start + n * FA_BN, w->hk, FA_VARLEN ? 0 : w->bi, m->v_full + 8 * s);
    }
}

#if FA_DROP_RING
#include "fa_fwd_sm90_drop.cuh"
/* A block's P packed with dropout: the words from the producer's ring, or the consumer's own
 * Philox runs. */
#define FA_P_PACK_DROP(blk, n) fa_p_pack_ring(kp, m, sacc, pa, blk, cw)
#else
#define FA_P_PACK_DROP(blk, n) fa_p_pack_keep(kp, &r, sacc, pa, n)
#endif

#if FA_VARLEN
/* Varlen: the tensor maps span all sequences, so the rows of the first visited key block past
 * the sequence's end are the next sequence's (out-of-bounds zero fill happens only at the end of
 * the packed tensor). Their scores are masked, but P V would still multiply 0 by those V rows, and
 * 0 * inf is NaN: the consumer threads zero them (whole 128-byte rows, so the swizzle does not
 * matter) before the first P V, then meet at named barrier 3. Called by every consumer warpgroup
 * between their first and second GEMM units, where pingpong cannot hold either of them. */
FA_DEV void fa_v_tail_zero(const fa_smem_map *m, const fa_tile *w, int kv0)
{
    const int valid = w->sk - (w->n_max - 1) * FA_BN;
    if (valid >= FA_BN)
        return;
    const int s = kv0 % FA_STAGES;
    fa_mbar_wait(m->v_full + 8 * s, (kv0 / FA_STAGES) & 1);
    const int chunks = (FA_BN - valid) * 8; /* 16-byte chunks per 64-column block */
    for (int i = threadIdx.x - FA_WG_THREADS; i < FA_VB * chunks; i += FA_NCW * FA_WG_THREADS) {
        const int c = i / chunks, rest = i - c * chunks;
        const fa_u32 a = m->v + s * FA_V_BYTES + c * FA_BN * 128 + valid * 128 + rest * 16;
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(a), "r"(0) : "memory");
    }
    fa_fence_proxy_async();
    asm volatile("bar.sync 3, %0;" ::"n"(FA_NCW * FA_WG_THREADS) : "memory");
}
#endif

/*
 * A consumer warpgroup's share of a tile (rows 64 cw .. 64 cw + 63): the main loop, then the
 * epilogue. Software pipeline within the warpgroup: while the tensor cores run
 * O += P_(i-1) V_(i-1), this warpgroup's softmax turns S_i into P_i. Per step i >= 1: issue
 * S_i = Q K_i^T and O += P_(i-1) V_(i-1) as two groups, wait for the first (wait_group 1), release
 * K_i, softmax S_i, wait for the second, release V_(i-1), rescale O by alpha_i, pack P_i.
 * With FA_PINGPONG the two consumer warpgroups also take turns issuing their GEMMs (named barriers
 * 1 and 2, each "unit" of GEMMs between a sync on its own and an arrive on the other's), so one's
 * softmax runs under the other's GEMMs; per tile each side syncs and is arrived at n_blocks + 1
 * times, so nothing is left pending between tiles.
 */
FA_DEV void fa_consume_tile(const fa_kparams *kp, const fa_tmaps *tm, const fa_smem_map *m,
                            const fa_tile *w, int cw, int *kv, int *q_round)
{
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const int sq = w->sq, sk = w->sk;
    fa_rows r;
    r.q4 = lane & 3;
    r.row0 = w->m0 + 64 * cw + 16 * warp + (lane >> 2);
    FA_ROWS_EDGES(kp, r, sq, sk);
    r.prescale = FA_PRESCALE_ALWAYS || !(kp->scale_log2 > 0.f);
    r.sm = r.prescale ? 1.f : kp->scale_log2;
    r.diag = sk - sq;
#if FA_SCORE_MOD || FA_MOD_MASKS
    r.bi = w->bi;
    r.h = w->h;
#endif
#if FA_BLOCK_MASK
    r.bm_tab = w->bm_tab;
    fa_bm_tile_qbs(kp, w->m0, fa_min(w->m0 + FA_BM, sq) - 1, &r.bm_qb0, &r.bm_nqb);
#elif FA_MOD_MASKS
    r.bm_tab = 0; /* no block mask: every block partial */
    r.bm_qb0 = 0;
    r.bm_nqb = 1;
#endif
#if FA_ALIBI
    r.slope_log2 = kp->alibi_slopes[w->bi * kp->alibi_bstride + w->h * kp->alibi_hstride] * FA_LOG2E;
#else
    r.slope_log2 = 0.f;
#endif
#if FA_DROPOUT
    const fa_u64 stream = fa_dropout_stream(kp, w->bi, w->h);
    r.stream_lo = (fa_u32)stream;
    r.stream_hi = (fa_u32)(stream >> 32);
    r.keys = tm->philox_keys;
#endif

    float o[FA_OACC];
    float row_max[2] = {-FA_INF, -FA_INF}, row_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < FA_OACC; j++)
        o[j] = 0.f;

    const int nb = w->n_blocks;
    if (nb > 0) {
        const fa_u64 q_rows = fa_desc(m->q + cw * 64 * 128, 16, 1024);
        const int kv0 = *kv;
        float sacc[FA_SACC], alpha[2];
        fa_u32 pa[FA_BN / 16][4];
#if FA_PINGPONG
        const int bar_mine = 1 + cw, bar_other = 2 - cw;
        fa_pingpong_start(cw);
#endif
#if !FA_ONE_SOFTMAX
        fa_mbar_wait(m->q_full, *q_round & 1);
        fa_mbar_wait(m->k_full + 8 * (kv0 % FA_STAGES), (kv0 / FA_STAGES) & 1);
        fa_wg_fence();
        fa_gemm_s(sacc, q_rows, fa_desc(m->k + (kv0 % FA_STAGES) * FA_K_BYTES, 16, 1024));
#if FA_PINGPONG
        fa_named_arrive(bar_other);
#endif
        fa_wg_wait0();
#pragma unroll
        for (int j = 0; j < FA_SACC; j++)
            FA_PIN(sacc[j]);
        fa_stage_release(m->k_empty + 8 * (kv0 % FA_STAGES), lane);
        if (nb == 1)
            fa_stage_release(m->q_empty, lane);
#if FA_MOD_MASKS
        r.mod_st = FA_TILE_STATE(w, 0);
#endif
        fa_softmax_block(kp, &r, sacc, FA_TILE_BLOCK(w, 0), row_max, row_sum, alpha);
#if FA_DROPOUT
        FA_P_PACK_DROP(kv0, FA_TILE_BLOCK(w, 0));
#else
        fa_p_pack(sacc, pa);
#endif
#if FA_VARLEN
        fa_v_tail_zero(m, w, kv0);
#endif
#endif

        /* With FA_ONE_SOFTMAX the first block's iteration is the loop's too: it issues S alone,
         * in a branch around whole wgmma groups (a branch around the PV GEMM alone had ptxas
         * serialise every wgmma). */
        for (int it = FA_ONE_SOFTMAX ? 0 : 1; it < nb; it++) {
            const int sp = (kv0 + it - 1) % FA_STAGES, php = ((kv0 + it - 1) / FA_STAGES) & 1;
            const int s = (kv0 + it) % FA_STAGES, ph = ((kv0 + it) / FA_STAGES) & 1;
            if (FA_ONE_SOFTMAX && it == 0) {
                fa_mbar_wait(m->q_full, *q_round & 1);
                fa_mbar_wait(m->k_full + 8 * s, ph);
                fa_wg_fence();
                fa_gemm_s(sacc, q_rows, fa_desc(m->k + s * FA_K_BYTES, 16, 1024));
#if FA_PINGPONG
                fa_named_arrive(bar_other);
#endif
                fa_wg_wait0();
            } else {
#if FA_PINGPONG
                fa_named_sync(bar_mine);
#endif
                fa_mbar_wait(m->k_full + 8 * s, ph);
                fa_mbar_wait(m->v_full + 8 * sp, php);
                fa_operands_pin(o, pa, FA_BN / 16);
                fa_wg_fence();
                fa_gemm_s(sacc, q_rows, fa_desc(m->k + s * FA_K_BYTES, 16, 1024));
                fa_gemm_pv(o, pa, fa_desc(m->v + sp * FA_V_BYTES, FA_BN * 128, 1024));
#if FA_PINGPONG
                fa_named_arrive(bar_other);
#endif
                asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            }
#pragma unroll
            for (int j = 0; j < FA_SACC; j++)
                FA_PIN(sacc[j]);
            fa_stage_release(m->k_empty + 8 * s, lane);
            if (it == nb - 1)
                fa_stage_release(m->q_empty, lane);
#if FA_DROPOUT && FA_DROP_RING != 2
            /* With dropout, P_(i-1) V_(i-1) is waited for before the softmax: its Philox runs
             * are in fa_p_pack_keep, after the wait, either way, and the causal calls measured
             * faster with the wait here than after the softmax. The ring's second form (words
             * read, not computed, in the pack) waits after it, as without dropout. (No
             * FA_ONE_SOFTMAX with dropout.) */
            fa_wg_wait0();
            fa_operands_pin(o, pa, FA_BN / 16);
#endif
#if FA_MOD_MASKS
            r.mod_st = FA_TILE_STATE(w, it);
#endif
            fa_softmax_block(kp, &r, sacc, FA_TILE_BLOCK(w, it), row_max, row_sum, alpha);
            if (!FA_ONE_SOFTMAX || it > 0) {
#if !FA_DROPOUT || FA_DROP_RING == 2
#if FA_NCW == 2 /* three consumers (160 registers) measured faster with the hoisted wait */
                fa_softmax_order(m->scratch, row_sum);
#endif
                fa_wg_wait0();
                fa_operands_pin(o, pa, FA_BN / 16);
#endif
                fa_stage_release(m->v_empty + 8 * sp, lane);
                fa_o_rescale(o, alpha);
            }
#if FA_DROPOUT
            FA_P_PACK_DROP(kv0 + it, FA_TILE_BLOCK(w, it));
#else
            fa_p_pack(sacc, pa);
#endif
#if FA_VARLEN
            if (FA_ONE_SOFTMAX && it == 0)
                fa_v_tail_zero(m, w, kv0);
#endif
        }

        /* The last block's O += P V. */
        const int sp = (kv0 + nb - 1) % FA_STAGES, php = ((kv0 + nb - 1) / FA_STAGES) & 1;
#if FA_PINGPONG
        fa_named_sync(bar_mine);
#endif
        fa_mbar_wait(m->v_full + 8 * sp, php);
        fa_operands_pin(o, pa, FA_BN / 16);
        fa_wg_fence();
        fa_gemm_pv(o, pa, fa_desc(m->v + sp * FA_V_BYTES, FA_BN * 128, 1024));
#if FA_PINGPONG
        /* Only the first warpgroup still has a partner waiting for its turn in this tile. */
        if (cw == 0)
            fa_named_arrive(bar_other);
#endif
        fa_wg_wait0();
        fa_operands_pin(o, pa, FA_BN / 16);
        fa_stage_release(m->v_empty + 8 * sp, lane);
        *kv = kv0 + nb;
        ++*q_round;
    }

    /* Epilogue: the sink joins the denominator; empty rows give 0 and lse +inf. */
    const float sink2 = kp->sinks ? kp->sinks[w->h * kp->sinks_stride] * FA_LOG2E : -FA_INF;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int row = r.row0 + 8 * hf;
        float lse, scale;
        fa_row_finish(row_sum[hf], row_max[hf] * r.sm, sink2, &lse, &scale);
#if FA_DROPOUT
        scale *= kp->dropout_scale;
#endif
        fa_u16 *og = (fa_u16 *)kp->out + w->bi * kp->o_bstride +
                     (fa_i64)(w->q_start + row) * kp->o_rstride + w->h * kp->o_hstride;
#if FA_O16
        /* The quad trades its columns so each lane stores 16 bytes of the row (fa_store_row16,
         * which every lane calls); columns past dv are the zero padding of a head dim rounded up
         * to 64, rows past sq only skip their stores. */
        fa_store_row16(og, kp->dv, (const float(*)[4])o, FA_DVP, hf, r.q4, scale, row < sq);
#endif
        if (row >= sq)
            continue;
#if !FA_O16
#pragma unroll
        for (int j = 0; j < FA_OACC; j += 2) {
            const int col = 8 * (j >> 2) + 2 * r.q4;
            /* Columns past dv are the zero padding of a head dim rounded up to 64. */
            if (((j >> 1) & 1) == hf && (FA_DVP == FA_DV || col < kp->dv))
                *(fa_u32 *)(og + col) = fa_pack2(o[j] * scale, o[j + 1] * scale);
        }
#endif
        if (kp->lse && r.q4 == 0)
            kp->lse[w->bi * kp->lse_bstride + w->h * kp->lse_hstride +
                    (fa_i64)(w->q_start + row) * kp->lse_rstride] = lse;
    }
}

#endif /* FA_FWD_SM90_MAINLOOP_CUH */
