/*
 * The Hopper forward's element-wise step of one key block (kernels/fa_fwd_sm90.cu includes it
 * after its tile defines, fa_mod.cuh and fa_fwd_sm90_mod.cuh): a consumer thread's view of its
 * two rows (fa_rows), the scores' scale, softcap, ALiBi and score_mod, the masks (the rows' key
 * ranges, mask_mod, the block mask's states), the online softmax, and dropout's keep decisions
 * applied after the row sums.
 */
#ifndef FA_FWD_SM90_SOFTMAX_CUH
#define FA_FWD_SM90_SOFTMAX_CUH

/* Whether the scores become base-2 units element by element (softcap and ALiBi transform them
 * anyway, and a scale <= 0 needs it); otherwise scale * log2(e) rides in the FFMA before exp2. */
#define FA_PRESCALE_ALWAYS (FA_SOFTCAP || FA_ALIBI || FA_SCORE_MOD)

/* One consumer thread's view of its two rows (r and r + 8 of its warp's 16). */
typedef struct fa_rows {
    int row0;          /* the first of the two rows (sequence coordinates) */
    int q4;            /* lane % 4: which column pairs of each 8-column group */
    int lo[2], hi[2];  /* visible keys [lo, hi) of each row */
    int lo_max, hi_min;
    float sm;          /* the factor in front of exp2 (1 when prescaled) */
    int prescale;
    float slope_log2;  /* ALiBi slope in base-2 units */
    int diag;          /* sk - sq: key column of a row's diagonal minus the row */
#if FA_DROPOUT
    fa_u32 stream_lo, stream_hi; /* the (sequence, head)'s Philox stream (fa_dropout_stream) */
    const fa_u32 *keys;          /* the Philox round keys (fa_tmaps.philox_keys) */
#endif
#if FA_SCORE_MOD || FA_MOD_MASKS
    int bi, h; /* the mods' b and h */
#endif
#if FA_MOD_MASKS
    int mod_st;                 /* the state of the key block being computed (FA_BM_*) */
    const unsigned char *bm_tab; /* the tile's block-mask table (FA_BM_MIXED blocks) */
    int bm_qb0, bm_nqb;         /* its query blocks */
#endif
} fa_rows;

#if FA_DROPOUT
/* P's element pair (row half hf, columns 16 kk + 8 hi + 2 q4, + 1) into the A fragment, both
 * dropped where m (fa_dropout_mask2) says: a bf16 / fp16 pair is zeroed half by half. */
#define FA_P_PACK_PAIR(sacc, pa, kk, hf, hi, m)                                                 \
    (pa)[kk][(hf) + 2 * (hi)] = fa_pack2((sacc)[8 * (kk) + 2 * ((hf) + 2 * (hi))],               \
                                         (sacc)[8 * (kk) + 2 * ((hf) + 2 * (hi)) + 1]) &          \
                                (m)

/* The chunk's pairs (16-column blocks b0 .. b0 + blocks - 1) into the A fragment, each masked
 * by its word: w[i] is word q4 of row half i / 2, block b0 + i % 2 (fa_keep_chunk's order). */
FA_DEV void fa_p_pack_words(const float *sacc, fa_u32 pa[][4], int b0, int blocks,
                            const fa_u32 w[4], fa_u32 thr2)
{
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int hi = 0; hi < 2; hi++)
            if ((i & 1) < blocks)
                FA_P_PACK_PAIR(sacc, pa, b0 + (i & 1), i >> 1, hi,
                               fa_dropout_mask2(w[i], hi, thr2));
}

/*
 * P's 16-column blocks b0, b0 + 1 (a chunk; one at the end of a key block of FA_BN % 32 == 16)
 * packed into the A fragment with dropout: the element (row, col) is kept iff its 8-bit number is
 * below kp->keep_threshold, the number being byte FA_RULE_DROPOUT_SHIFT(col) / 8 of word
 * FA_RULE_DROPOUT_WORD(col) of Philox block (col / 16, row, stream) under the seed (fa_rules.h:
 * the CPU's and the sm80 family's rule). A thread's two rows hold columns 2 q4, + 1, + 8, + 9 of
 * each block, which are word q4: the chunk's four Philox blocks (two rows, two column blocks) are
 * computed once by the quad, lane q4 row half q4 / 2 and block b0 + q4 % 2, and the lanes trade
 * the words (fa_quad_transpose). A chunk no row of the warp sees needs no mask (its P is 0
 * anyway); the vote's branch also keeps ptxas from interleaving the chunks' Philox runs, which
 * the wide heads' O and three consumers' 160 registers leave no room for; two consumers up to
 * head dim 128 have the room, and there the interleaved schedule issues fewer instructions.
 */
FA_DEV void fa_keep_chunk(const fa_kparams *kp, const fa_rows *r, const float *sacc,
                          fa_u32 pa[][4], int n, int b0)
{
    const int blocks = FA_BN / 16 - b0 < 2 ? 1 : 2;
    const int c0 = n * FA_BN + 16 * b0, c1 = c0 + 16 * blocks;
    const int seen = (c0 < r->hi[0] && c1 > r->lo[0]) || (c0 < r->hi[1] && c1 > r->lo[1]);
    if ((FA_NCW == 3 || FA_DVP > 128) && !__any_sync(0xffffffffu, seen)) {
#pragma unroll
        for (int j = 0; j < blocks; j++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                FA_P_PACK_PAIR(sacc, pa, b0 + j, i & 1, i >> 1, 0xffffffffu);
        return;
    }
    /* from the parameter bank where it is used, not held in a register across the key loop */
    const fa_u32 thr2 = fa_dropout_thr2(kp->keep_threshold);
    fa_u32 w[4];
    fa_philox4_keys((fa_u32)FA_RULE_DROPOUT_BLOCK(c0) + (r->q4 & 1), r->row0 + 8 * (r->q4 >> 1),
                    r->stream_lo, r->stream_hi, r->keys, w);
    fa_quad_transpose(w, r->q4); /* w[i]: word q4 of row half i / 2, block b0 + i % 2 */
    fa_p_pack_words(sacc, pa, b0, blocks, w, thr2);
}

/* P (the softmax's probabilities of key block n) into the A fragment, dropped by the mask. */
FA_DEV void fa_p_pack_keep(const fa_kparams *kp, const fa_rows *r, const float *sacc,
                           fa_u32 pa[][4], int n)
{
#pragma unroll
    for (int b0 = 0; b0 < FA_BN / 16; b0 += 2)
        fa_keep_chunk(kp, r, sacc, pa, n, b0);
}
#endif

/* keep <- whether score j of the block at key kb0 stays: inside its row's visible range and,
 * by mode, kept by the mods: 0 no test, FA_BM_PARTIAL mask_mod, FA_BM_MIXED each key's own
 * block-mask state, then mask_mod; FA_MOD_KEEP_PARTIAL mask_mod where the block is partial (a
 * full block at a range edge passes), so that partial and edge blocks share one copy of the
 * unrolled test. Used with mode a constant, so the keys do not branch (a macro: as a function
 * returning the bool, ptxas laid the plain kernels' tests out anew). */
#define FA_MOD_KEEP_PARTIAL 4
#if FA_MOD_MASKS
#define FA_MOD_KEEP_AND(keep, mode, row, col)                                                    \
    if ((mode) == FA_MOD_KEEP_PARTIAL)                                                           \
        keep &= (r->mod_st != FA_BM_PARTIAL) |                                                   \
                fa_mod_keep(kp, r->bm_tab, FA_BM_PARTIAL, r->bi, r->h, row, col, r->bm_qb0,      \
                            r->bm_nqb);                                                          \
    else if ((mode) != 0)                                                                        \
        keep &= fa_mod_keep(kp, r->bm_tab, mode, r->bi, r->h, row, col, r->bm_qb0, r->bm_nqb)
#else
#define FA_MOD_KEEP_AND(keep, mode, row, col)
#endif
#define FA_SCORE_KEEP(keep, kb0, j, mode)                                                        \
    const int col = (kb0) + 8 * ((j) >> 2) + 2 * r->q4 + ((j) & 1);                              \
    const int hf = ((j) >> 1) & 1;                                                               \
    bool keep = (col >= r->lo[hf]) & (col < r->hi[hf]);                                          \
    FA_MOD_KEEP_AND(keep, mode, r->row0 + 8 * hf, col)

/* Masks the scores of the block at key kb0 to -inf where FA_SCORE_KEEP drops them. */
FA_DEV void fa_mask_scores(const fa_kparams *kp, const fa_rows *r, float *sacc, int kb0, int mode)
{
#pragma unroll
    for (int j = 0; j < FA_SACC; j++) {
        FA_SCORE_KEEP(keep, kb0, j, mode);
        sacc[j] = keep ? sacc[j] : -FA_INF;
    }
}

#if FA_MOD_MASKS
/* Group g's four FA_SCORE_KEEP decisions (scores 4 g .. 4 g + 3) as the low bits. */
FA_DEV fa_u32 fa_keep_group(const fa_kparams *kp, const fa_rows *r, int kb0, int g, int mode)
{
    fa_u32 bits = 0u;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        FA_SCORE_KEEP(k, kb0, 4 * g + e, mode);
        bits |= (fa_u32)k << e;
    }
    return bits;
}

/* FA_SCORE_KEEP's decisions as bits (bit j % 32 of keep[j / 32] for score j). Where a block
 * mask's mode asks the mods, the loop over the 8-column groups stays partly rolled
 * (fa_keep_or_in): the block mask's partial and mixed blocks are few. */
#define FA_KEEP_WORDS ((FA_SACC + 31) / 32)
FA_DEV void fa_mask_bits(const fa_kparams *kp, const fa_rows *r, int kb0, int mode,
                         fa_u32 keep[FA_KEEP_WORDS])
{
#pragma unroll
    for (int w = 0; w < FA_KEEP_WORDS; w++)
        keep[w] = 0u;
    if (FA_BLOCK_MASK && mode != 0) {
#pragma unroll FA_MOD_KEEP_UNROLL
        for (int g = 0; g < FA_SACC / 4; g++)
            fa_keep_or_in(keep, FA_KEEP_WORDS, g, fa_keep_group(kp, r, kb0, g, mode));
    } else {
#pragma unroll
        for (int g = 0; g < FA_SACC / 4; g++)
            fa_keep_or_in(keep, FA_KEEP_WORDS, g, fa_keep_group(kp, r, kb0, g, mode));
    }
}

/* The scores fa_mask_bits' keep drops to -inf. */
FA_DEV void fa_keep_apply(float *sacc, const fa_u32 keep[FA_KEEP_WORDS])
{
#pragma unroll
    for (int j = 0; j < FA_SACC; j++)
        sacc[j] = (keep[j / 32] >> (j % 32)) & 1u ? sacc[j] : -FA_INF;
}

/* fa_mask_scores for the mods' modes: under a block mask through fa_mask_bits' partly rolled
 * loop; without one every block asks mask_mod, and fa_mask_scores' one unrolled copy compiles
 * as fast as the built-in kernel. */
FA_DEV void fa_mask_scores_mods(const fa_kparams *kp, const fa_rows *r, float *sacc, int kb0,
                                int mode)
{
    if (!FA_BLOCK_MASK || mode == 0) {
        fa_mask_scores(kp, r, sacc, kb0, mode);
        return;
    }
    fa_u32 keep[FA_KEEP_WORDS];
    fa_mask_bits(kp, r, kb0, mode, keep);
    fa_keep_apply(sacc, keep);
}
#endif

#ifndef FA_SOFTCAP_FOLD
#define FA_SOFTCAP_FOLD 0
#endif
/* FA_RULE_SOFTCAP(x, pre, post, fa_tanh_fast) with its constants folded (FA_SOFTCAP_FOLD, the
 * plan's default): x pre 2 log2 e in one product and post into the last FFMA, 5 instructions
 * for 7. */
FA_DEV float fa_softcap_fold(float x, float pre, float post)
{
    return fmaf(-2.f * post, fa_rcp_exp2p1(x * (pre * FA_2LOG2E)), post);
}

/* Softcap's tanh, FA_FWD_TANH_GROUP scores at a time, waits for the score FA_FWD_TANH_CHAIN
 * places before (fa_after): left free, ptxas issued every score's exponential and reciprocal at
 * once and spilled (the d 64 three-consumer tile). The folded form spills with groups of four. */
#define FA_FWD_TANH_CHAIN 16
#define FA_FWD_TANH_GROUP (FA_SOFTCAP_FOLD ? 1 : 4)

/* S of key block n (scores in sacc) -> exp2 of the scaled, masked scores relative to the new row
 * maxima, in place; row_max, row_sum updated; alpha[hf] = the factor O must be rescaled by; with
 * dropout, the dropped elements zeroed after the sums (which count them, as upstream's do). */
FA_DEV void fa_softmax_block(const fa_kparams *kp, const fa_rows *r, float *sacc, int n,
                             float row_max[2], float row_sum[2], float alpha[2])
{
    const int kb0 = n * FA_BN;
#if FA_MOD_MASKS && FA_MOD_MASK_FIRST
    /* The mask's decisions first (fa_mask_bits), applied after the scores are final
     * (FLASHATTN_SM90_MASK_FIRST=1, an A/B): fewer registers live beside score_mod's code,
     * slower where measured. */
    const int mode = r->mod_st == FA_BM_MIXED                         ? FA_BM_MIXED
                     : (FA_MASK_MOD && r->mod_st == FA_BM_PARTIAL)    ? FA_BM_PARTIAL
                     : (kb0 < r->lo_max || kb0 + FA_BN > r->hi_min) ? 0
                                                                      : -1;
    fa_u32 keep[FA_KEEP_WORDS];
    if (mode == FA_BM_MIXED)
        fa_mask_bits(kp, r, kb0, FA_BM_MIXED, keep);
    else if (mode == FA_BM_PARTIAL)
        fa_mask_bits(kp, r, kb0, FA_BM_PARTIAL, keep);
    else if (mode == 0)
        fa_mask_bits(kp, r, kb0, 0, keep);
#endif
    if (r->prescale) {
#if FA_SOFTCAP
        float pre = kp->softcap_pre; /* softcap's factor, chained (FA_FWD_TANH_CHAIN) */
#endif
#pragma unroll
        for (int j = 0; j < FA_SACC; j++) {
            float x = sacc[j];
#if FA_SOFTCAP
            if (j % FA_FWD_TANH_GROUP == 0 && j >= FA_FWD_TANH_CHAIN)
                pre = fa_after(kp->softcap_pre, sacc[fa_max(j - FA_FWD_TANH_CHAIN, 0)], kp->zero);
#endif
#if FA_SOFTCAP && FA_SOFTCAP_FOLD
            x = fa_softcap_fold(x, pre, kp->scale_log2);
#elif FA_SOFTCAP
            x = FA_RULE_SOFTCAP(x, pre, kp->scale_log2, fa_tanh_fast);
#else
            x *= kp->scale_log2;
#endif
#if FA_ALIBI
            const int dist = r->row0 + 8 * ((j >> 1) & 1) + r->diag -
                             (kb0 + 8 * (j >> 2) + 2 * r->q4 + (j & 1));
            x -= FA_RULE_ALIBI(r->slope_log2, dist);
#endif
#if FA_SCORE_MOD
            x = fa_score_mod_base2(kp, x, r->bi, r->h, r->row0 + 8 * ((j >> 1) & 1),
                                   kb0 + 8 * (j >> 2) + 2 * r->q4 + (j & 1), NULL);
#endif
            sacc[j] = x;
        }
    }
    /* Mask keys outside each row's visible range (only blocks that cross an edge), and those
     * mask_mod or the block mask drop (blocks where some key needs the test). */
#if FA_MOD_MASKS && FA_MOD_MASK_FIRST
    if (mode >= 0)
        fa_keep_apply(sacc, keep);
#else
    const bool edge = kb0 < r->lo_max || kb0 + FA_BN > r->hi_min;
#if FA_MOD_MASKS
    /* One copy of the element-wise test per call site serves partial and edge blocks: each
     * unrolled copy costs NVRTC's optimiser and ptxas time at a new mod's first call. */
    if (!FA_BM_ALIGNED && r->mod_st == FA_BM_MIXED)
        fa_mask_scores_mods(kp, r, sacc, kb0, FA_BM_MIXED);
    else if (FA_MASK_MOD ? edge || r->mod_st == FA_BM_PARTIAL : edge)
        fa_mask_scores_mods(kp, r, sacc, kb0, FA_MASK_MOD ? FA_MOD_KEEP_PARTIAL : 0);
#else
    if (edge)
        fa_mask_scores(kp, r, sacc, kb0, 0);
#endif
#endif
    fa_softmax_rows(sacc, r->sm, 0.f, row_max, row_sum, alpha);
}

#endif /* FA_FWD_SM90_SOFTMAX_CUH */
