/*
 * What both backward families (fa_bwd_sm80.cu, fa_bwd_sm90.cu) share, included after the plan's
 * defines: the dQ accumulator's atomic adds, the sequence and tile bookkeeping of a CTA's visits
 * (fa_bwd_tour.cuh: which query tiles meet its key block, in which order; the workspace's row
 * index), the element-wise step of the transposed frame (P and dS from S^T and dP^T,
 * fa_bwd_probs, and the tile view it reads), whose C-fragment layout mma.sync m16n8 and wgmma
 * m64nN share per warp, and the end of a CTA: dK and dV stored, or zeroed for a key block past a
 * sequence.
 */
#ifndef FA_BWD_COMMON_CUH
#define FA_BWD_COMMON_CUH

/* sm_90 has vector reductions (red.global.add.v4.f32): the accumulator layout follows. */
#if __CUDA_ARCH__ >= 900
#define FA_RED_V4 1
#else
#define FA_RED_V4 0
#endif

#if FA_RED_V4
/* red.global.add.v4.f32 (sm_90): adds four consecutive floats at the 16-byte aligned p, each
 * element atomically, returning nothing (the L2 performs the adds). */
FA_DEV void fa_red_add_v4(float *p, float a, float b, float c, float d)
{
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b),
                 "f"(c), "f"(d)
                 : "memory");
}
#else
/* red.global.add.f32: one atomic add to global memory, returning nothing. */
FA_DEV void fa_red_add(float *p, float a)
{
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(a) : "memory");
}
#endif


/* Sequence bi as the backward sees it: fa_seq_get's, with the keys in use also clamped to max_sk
 * in the varlen form. Valid offsets never exceed it; bad ones must not make a key block beyond the
 * grid (n_tiles from max_sk) one that a query tile waits for in deterministic mode. */
FA_DEV fa_seq fa_bwd_seq(const fa_kparams *kp, int bi)
{
    fa_seq s = fa_seq_get(kp, bi, FA_VARLEN);
#if FA_VARLEN
    s.sk = fa_min(s.sk, (int)kp->max_sk);
#endif
    return s;
}

#if FA_VARLEN
/* The keys of sequence bi in k, which dK and dV cover (past seqused_k with zeros, as the CPU
 * backward writes them): cu_seqlens_k's length, clamped as fa_seq_get clamps and to max_sk as
 * fa_bwd_seq, so that k_start + klen stays inside the tensor and inside the grid. */
FA_DEV int fa_bwd_klen(const fa_kparams *kp, int bi)
{
    fa_i64 ka = kp->cu_seqlens_k[bi], kb = kp->cu_seqlens_k[bi + 1];
    ka = ka < 0 ? 0 : ka > kp->total_k ? kp->total_k : ka;
    kb = kb < ka ? ka : kb > kp->total_k ? kp->total_k : kb;
    return (int)(kb - ka < kp->max_sk ? kb - ka : kp->max_sk);
}

#endif

/* The rows of sequence bi's keys that dK and dV cover: from *k_start in k (0 dense) to *key_end
 * (sk dense; fa_bwd_klen varlen). */
FA_DEV void fa_bwd_key_span(const fa_kparams *kp, int bi, int sk, fa_i64 *k_start, int *key_end)
{
#if FA_VARLEN
    *k_start = fa_bwd_seq(kp, bi).k_start;
    *key_end = fa_bwd_klen(kp, bi);
    (void)sk;
#else
    (void)kp, (void)bi;
    *k_start = 0;
    *key_end = sk;
#endif
}

#if FA_VARLEN
/* Zeroes columns [0, cols) of rows [0, rows) (row stride rs, elements) at p, element i of the
 * rows x cols by the thread whose index is i modulo nthreads (tid of nthreads). */
FA_DEV void fa_bwd_zero(fa_u16 *p, fa_i64 rs, int rows, int cols, int tid, int nthreads)
{
    for (int i = tid; i < rows * cols; i += nthreads) {
        const int r = i / cols;
        p[r * rs + (i - r * cols)] = 0;
    }
}
#endif

#include "fa_bwd_tour.cuh"

/* Queries per warp of the transposed frame's S^T and dP^T (fa_bwd_probs): the whole query tile,
 * unless the family gives each warp a part of it (fa_bwd_sm80.cu's FA_DKV_SPLIT); and the columns
 * of dK and dV a warp holds (fa_bwd_store_dkdv), all of them unless split the same way. */
#ifndef FA_BWD_QW
#define FA_BWD_QW FA_BM
#endif
#ifndef FA_BWD_DKC
#define FA_BWD_DKC FA_DP
#define FA_BWD_DVC FA_DVP
#endif

#if FA_BWD_ROWS_IN_LANES && !defined(FA_BWD_LANE_ROWS)
#define FA_BWD_LANE_ROWS (FA_BM / 32) /* tile rows per lane: 2 or 4 (1: a warp's FA_BWD_QW = 32) */
#endif

/* Whether fa_bwd_probs orders its n-tiles one after another (pinned between them). */
#ifndef FA_BWD_PROBS_SERIAL
#define FA_BWD_PROBS_SERIAL 0
#endif

/* fa_bwd_probs' n-tile nt waits for n-tile nt - FA_BWD_CHAIN's dS (fa_after on its first
 * factor: softcap's, else the scale): left free, ptxas issued every score's exponentials at once
 * and spilled. 0: free (a family chains where that spills). */
#ifndef FA_BWD_CHAIN
#define FA_BWD_CHAIN 0
#endif

/* Dropout in fa_bwd_probs: 1 selects the dropped values away where each is used; 0 multiplies
 * by a factor per element (1 / (1 - p) or 0), which ptxas computes for every element up front
 * (a family picks the form that spills less). */
#ifndef FA_BWD_DROP_SELECT
#define FA_BWD_DROP_SELECT 0
#endif

/* User-defined scoring: a family that compiles it includes fa_bwd_mod.cuh first. */
#ifndef FA_BWD_MODS
#define FA_BWD_MODS 0
#endif

typedef struct fa_bwd_tile {
#if FA_BWD_ROWS_IN_LANES
    /* lse * log2(e) and D of the tile's rows 2 lane + x for 64-row tiles, lane + 32 x for 128:
     * wherever fa_bwd_probs asks, x is a constant, so they stay in registers */
    float lse2[FA_BWD_LANE_ROWS], dsum[FA_BWD_LANE_ROWS];
#else
    const float *lse2, *dsum; /* this stage's rows: lse * log2(e), D */
#endif
    int dg0;                  /* i - j + sk - sq for query m0 + 2t and this lane's first key */
    int rows, keys;           /* queries m0 + 2t + x exist for x < rows, keys key0 + y for y < keys */
    int wlo, whi;             /* visible iff whi <= i - j + sk - sq <= wlo */
    int m0, key0;
#if FA_ALIBI
    float slope_log2;
#endif
#if FA_DROPOUT && FA_BWD_KEEP_BITS
    fa_u32 keep[(FA_BWD_QW + 63) / 64]; /* fa_bwd_keep_bits' */
#elif FA_DROPOUT
    fa_u64 stream;
#endif
#if FA_BWD_MODS
    fa_bwd_mod_tile mod; /* set by the family after fa_bwd_tile_make */
#endif
} fa_bwd_tile;

#if FA_DROPOUT
#if FA_BWD_QW % 16 != 0
#error "fa_bwd_common.cuh: dropout takes the queries' n-tiles in pairs (FA_BWD_QW % 16 == 0)"
#endif
/* The dropout words of n-tiles nt0 and nt0 + 1 for lane (g, t) of the transposed frame, which
 * holds keys key0, key0 + 8 (key0 % 16 = g: both in Philox block kb = key0 / 16, word g / 2) for
 * queries i0, i0 + 1 of n-tile nt0 and i0 + 8, i0 + 9 of nt0 + 1: it needs word k = g / 2 of the
 * four blocks (kb, i0 + b % 2 + 8 (b / 2)), and so do the other 7 lanes with this t. Instead of
 * 4 Philox runs per lane, the two lanes of pair k run block b = k and the pairs transpose the
 * 4x4 words with 3 shuffles: in round r lane ^ 8r (pair k ^ r) sends word k of its block k ^ r.
 * out[b] = word k of block b, which holds C-fragment element e of n-tile nt0 + b / 2 for
 * e % 2 = b % 2 (fa_bwd_drop_number). Every lane of the warp must call this together. */
FA_DEV void fa_bwd_dropout_words(fa_u32 kb, fa_u32 i0, fa_u64 stream, fa_u64 seed, int k,
                                 fa_u32 out[4])
{
    fa_u32 w[4], got[4];
    fa_philox4(kb, i0 + (fa_u32)((k & 1) + 8 * (k >> 1)), (fa_u32)stream, (fa_u32)(stream >> 32),
               (fa_u32)seed, (fa_u32)(seed >> 32), w);
    got[0] = fa_pick4(w, k);
#pragma unroll
    for (int r = 1; r < 4; r++)
        got[r] = __shfl_xor_sync(0xffffffffu, fa_pick4(w, k ^ r), 8 * r);
    /* got[r] is word k of block k ^ r, so block b arrived in round k ^ b. */
#pragma unroll
    for (int b = 0; b < 4; b++)
        out[b] = fa_pick4(got, k ^ b);
}

/* The 8-bit number of element e of n-tile nt (key key0 + 8 (e / 2), query 8 nt + 2t + e % 2)
 * from the words fa_bwd_dropout_words gave for nt's pair: key column key0 + 8 (e / 2) is byte
 * g % 2 + 2 (e / 2) of its word (FA_RULE_DROPOUT_SHIFT). */
FA_DEV fa_u32 fa_bwd_drop_number(const fa_u32 drop[4], int nt, int e, int g)
{
    const fa_u32 w = drop[2 * (nt & 1) + (e & 1)];
    return (w >> (8 * ((g & 1) + 2 * (e >> 1)))) & 0xffu;
}

#if FA_BWD_KEEP_BITS
/* The keep decisions of lane (g, t)'s elements of a tile of FA_BWD_QW queries from m0 and keys
 * from key0 (key0 % 16 = g): bit 4 (nt % 8) + e of keep[nt / 8] is element e of n-tile nt. A
 * family defines FA_BWD_KEEP_BITS to make them before S^T and dP^T are in registers (the Philox
 * runs beside them in fa_bwd_probs made ptxas spill). The words leave pinned: unpacked into
 * per-element predicates, they took more registers than the Philox runs. */
FA_DEV void fa_bwd_keep_bits(const fa_kparams *kp, int key0, int m0, int t, fa_u64 stream,
                             fa_u32 keep[(FA_BWD_QW + 63) / 64])
{
    const int g = key0 & 15;
#pragma unroll
    for (int w = 0; w < (FA_BWD_QW + 63) / 64; w++)
        keep[w] = 0;
    fa_u32 drop[4];
#pragma unroll
    for (int nt = 0; nt < FA_BWD_QW / 8; nt++) {
        if ((nt & 1) == 0)
            fa_bwd_dropout_words((fa_u32)FA_RULE_DROPOUT_BLOCK(key0),
                                 (fa_u32)(m0 + nt * 8 + 2 * t), stream, kp->seed, g >> 1, drop);
        /* fa_bwd_probs' rule: kept below keep_threshold */
#pragma unroll
        for (int e = 0; e < 4; e++)
            keep[nt >> 3] |= (fa_u32)(fa_bwd_drop_number(drop, nt, e, g) < kp->keep_threshold)
                             << (4 * (nt & 7) + e);
    }
#pragma unroll
    for (int w = 0; w < (FA_BWD_QW + 63) / 64; w++)
        asm volatile("" : "+r"(keep[w])::"memory");
}
#endif
#endif

/* Row il of the tile's lse * log2(e) or D: from the lane that holds it or from the stage's rows
 * in shared memory. Every lane of the warp calls it together, never under a condition that
 * splits the warp (a shuffle there waits for lanes that never come). */
#if FA_BWD_ROWS_IN_LANES
FA_DEV float fa_bwd_row(const float v[FA_BWD_LANE_ROWS], int il)
{
#if FA_BWD_LANE_ROWS == 2
    return __shfl_sync(0xffffffffu, v[il & 1], il >> 1);
#elif FA_BWD_LANE_ROWS == 1
    /* Row il = 8 nt + 2t + e (the reader's t = lane % 4) sits in lane 8 nt + 4e + t
     * (fa_bwd_tile_make). shfl.sync.idx with segment mask 3 (c = 0x31f) takes the source lane's
     * low two bits from the reader's lane and the rest from b = 8 nt + 4e, a constant at each
     * call: no lane index held in a register per row. */
    float r;
    asm volatile("shfl.sync.idx.b32 %0, %1, %2, 0x31f, 0xffffffff;"
                 : "=f"(r)
                 : "f"(v[0]), "r"((il & ~7) | (il & 1) << 2));
    return r;
#else
    return __shfl_sync(0xffffffffu, v[il >> 5], il & 31);
#endif
}
#else
FA_DEV float fa_bwd_row(const float *v, int il) { return v[il]; }
#endif

#if FA_BWD_PROBS_SERIAL
/* An n-tile's four scores and four dP values pinned in their registers. */
#define FA_BWD_PIN_NT(s4, d4)                                                                    \
    do {                                                                                         \
        _Pragma("unroll") for (int e_ = 0; e_ < 4; e_++) {                                       \
            FA_PIN((s4)[e_]);                                                                    \
            FA_PIN((d4)[e_]);                                                                    \
        }                                                                                        \
    } while (0)
#endif

/* P = 2^(x f - bias - ALiBi) into p for the element at x_off, y_off from the warp's first query
 * and key (dg: its i - j + sk - sq), without the mods: x the score (softcapped where the family
 * has softcap), f its factor into log2 units, bias the row's lse * log2(e) (ALiBi added to it);
 * where `masked` (a constant at each call), vis <- whether the element is visible and p 0 where
 * not. A statement, so that fa_bwd_probs_as and fa_bwd_p share the rule in the form
 * fa_bwd_probs_as has always compiled to. */
#if FA_ALIBI
#define FA_BWD_ALIBI_ADD(tl, bias, dg)                                                           \
    (bias) = fmaf((tl)->slope_log2, (float)FA_RULE_ABS_DIST(dg), (bias)) /* + ALiBi */
#else
#define FA_BWD_ALIBI_ADD(tl, bias, dg) (void)0
#endif
#define FA_BWD_P_PLAIN(tl, p, vis, x, f, bias, x_off, y_off, dg, masked)                         \
    {                                                                                            \
        FA_BWD_ALIBI_ADD(tl, bias, dg);                                                          \
        (p) = fa_exp2(fmaf((x), (f), -(bias)));                                                  \
        if (masked) {                                                                            \
            (vis) = (x_off) < (tl)->rows && (y_off) < (tl)->keys && (dg) <= (tl)->wlo &&         \
                    (dg) >= (tl)->whi;                                                           \
            (p) = (vis) ? (p) : 0.f;                                                             \
        }                                                                                        \
    }

/* Element by element on this warp's 16 keys x FA_BWD_QW queries: P = 2^(s scale log2 e - lse log2 e)
 * (0 where invisible when masked), then st <- P Z (Z: 1 / (1 - p) kept, 0 dropped) and
 * dpt <- dS / scale = P (dP Z - D) s', s' the softcap's derivative 1 - tanh^2 (1 without
 * softcap). C layout: st[nt][e] is key key0 + 8 (e / 2), query m0 + 8 nt + 2t + (e % 2).
 * `masked` is a constant at each call: the unmasked form, for tiles whose every pair is visible,
 * skips the predicate. So is `mods`: 0 leaves the mods (fa_bwd_mod.cuh) out, for tiles where
 * they change nothing (every key kept, no score_mod). Invisible scores are selected away, never
 * multiplied, so an infinite or NaN exponent there does no harm. */
FA_DEV void fa_bwd_probs_as(const fa_kparams *kp, const fa_bwd_tile *tl, int t,
                            float st[FA_BWD_QW / 8][4], float dpt[FA_BWD_QW / 8][4], int masked,
                            int mods)
{
#if FA_DROPOUT && !FA_BWD_KEEP_BITS
    const int g = tl->key0 & 15; /* key0 = n0 + 16 warp + g */
    fa_u32 drop[4];
#endif
#if FA_SCORE_MOD && FA_MOD_AUX_GRAD
    /* Gradient elements of key key0 (e < 2) held for the next n-tile's element e + 2 (key
     * key0 + 8, query 8 later: the same kv - q): [nt parity][e % 2][aux read]
     * (fa_mod_aux_grad_pair); and the warp-uniform reads' sums (fa_mod_aux_grad_sum). */
    fa_mod_aux_held held[2][2][FA_MOD_AUX_READS], sums[FA_MOD_AUX_READS];
#endif
#pragma unroll
    for (int nt = 0; nt < FA_BWD_QW / 8; nt++) {
        float f0 = FA_SOFTCAP ? kp->softcap_pre : kp->scale_log2; /* the first factor */
        if (FA_BWD_CHAIN && nt >= FA_BWD_CHAIN)
            f0 = fa_after(f0, dpt[fa_max(nt - FA_BWD_CHAIN, 0)][3], kp->zero);
#if FA_BWD_PROBS_SERIAL
        /* n-tile nt's inputs released only after n-tile nt - 1's results (fa_bwd_sm90.cu's
         * mods: the programs' registers for every element at once spilled). */
        if (mods)
            FA_BWD_PIN_NT(st[nt], dpt[nt]);
#endif
#if FA_DROPOUT && !FA_BWD_KEEP_BITS
        if ((nt & 1) == 0)
            fa_bwd_dropout_words((fa_u32)FA_RULE_DROPOUT_BLOCK(tl->key0),
                                 (fa_u32)(tl->m0 + nt * 8 + 2 * t), tl->stream, kp->seed, g >> 1,
                                 drop);
#endif
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int il = nt * 8 + 2 * t + (e & 1); /* query within the tile */
            const int x_off = nt * 8 + (e & 1), y_off = 8 * (e >> 1);
            const int dg = tl->dg0 + x_off - y_off;
            float x = st[nt][e], deriv = 1.f, bias = fa_bwd_row(tl->lse2, il);
#if FA_SOFTCAP
            x = FA_RULE_SOFTCAP_TANH(x, f0, fa_tanh_fast);
            deriv = FA_RULE_SOFTCAP_GRAD(x);
#endif
            float p;
            int vis = 1;
#if FA_BWD_MODS
#if FA_ALIBI
            const float alibi = FA_RULE_ALIBI(tl->slope_log2, dg);
#else
            const float alibi = 0.f;
#endif
            (void)alibi;
            if (mods) {
                /* The mods' score (fa_bwd_mod.cuh) with ALiBi as the forward subtracts it, -inf
                 * where they drop the key. */
                const float y = fa_bwd_mod_score(kp, &tl->mod, x, alibi, tl->m0 + il,
                                                 tl->key0 + y_off, nt, e, &deriv);
                vis = y != -FA_INF && (!masked || (x_off < tl->rows && y_off < tl->keys &&
                                                   dg <= tl->wlo && dg >= tl->whi));
                p = vis ? fa_exp2(y - bias) : 0.f;
            } else
#endif
                FA_BWD_P_PLAIN(tl, p, vis, x, FA_SOFTCAP || !FA_BWD_CHAIN ? kp->scale_log2 : f0,
                               bias, x_off, y_off, dg, masked)
            int kept = 1;
#if FA_DROPOUT && FA_BWD_KEEP_BITS
            kept = (tl->keep[nt >> 3] >> (4 * (nt & 7) + e)) & 1;
#elif FA_DROPOUT
            /* Query i, key j: Philox block (j / 16, i, stream), word (j % 8) / 2 = g / 2. */
            kept = fa_bwd_drop_number(drop, nt, e, g) < kp->keep_threshold;
#endif
            /* dP Z (Z: 1 / (1 - p) kept, 0 dropped) as z dk, and P Z */
            const float z = !FA_DROPOUT                    ? 1.f
                            : FA_BWD_DROP_SELECT || kept ? kp->dropout_scale
                                                         : 0.f;
            const float dk = FA_BWD_DROP_SELECT && !kept ? 0.f : dpt[nt][e];
            /* With the mods selected, not multiplied: score_mod's derivative is anything where
             * dropped. D's row read by every lane, outside the select: fa_bwd_row may be a warp
             * shuffle, which under it only the lanes with vis would reach (the warp then hangs). */
            const float dsum = fa_bwd_row(tl->dsum, il);
#if FA_SCORE_MOD && FA_MOD_AUX_GRAD
            if (mods) {
                const float g = vis ? p * (dk * z - dsum) : 0.f;
                fa_bwd_mod_aux_grad(kp, &tl->mod, x, alibi, tl->m0 + il, tl->key0 + y_off, g,
                                    e >= 2 && nt > 0 ? held[(nt - 1) & 1][e & 1] : 0,
                                    e < 2 && nt + 1 < FA_BWD_QW / 8 ? held[nt & 1][e & 1] : 0,
                                    sums, nt == 0 && e == 0, nt + 1 == FA_BWD_QW / 8 && e == 3);
                dpt[nt][e] = g * deriv;
            } else
#endif
            if (FA_BWD_MODS && mods)
                dpt[nt][e] = vis ? p * (dk * z - dsum) * deriv : 0.f;
            else
                dpt[nt][e] = p * ((dk * z - dsum) * deriv); /* deriv consumed before p is made */
            (void)vis;
            st[nt][e] = FA_BWD_DROP_SELECT && !kept ? 0.f : p * z;
        }
#if FA_BWD_PROBS_SERIAL
        if (mods)
            FA_BWD_PIN_NT(st[nt], dpt[nt]);
#endif
    }
}

#if !FA_SOFTCAP && !FA_DROPOUT && !FA_BWD_MODS
/* fa_bwd_probs in two steps, for a family that makes P of more queries than it has dP for at
 * once (no softcap, dropout or mods, whose dS needs more than P): st <- P ... */
FA_DEV void fa_bwd_p(const fa_kparams *kp, const fa_bwd_tile *tl, int t,
                     float st[FA_BWD_QW / 8][4], int masked)
{
#pragma unroll
    for (int nt = 0; nt < FA_BWD_QW / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int x_off = nt * 8 + (e & 1), y_off = 8 * (e >> 1);
            const int dg = tl->dg0 + x_off - y_off;
            float bias = fa_bwd_row(tl->lse2, nt * 8 + 2 * t + (e & 1)), p;
            int vis = 1;
            FA_BWD_P_PLAIN(tl, p, vis, st[nt][e], kp->scale_log2, bias, x_off, y_off, dg, masked)
            (void)vis;
            st[nt][e] = p;
        }
}

/* ... then dpt <- dS / scale = P (dP - D). */
FA_DEV void fa_bwd_ds(const fa_bwd_tile *tl, int t, const float p[FA_BWD_QW / 8][4],
                      float dpt[FA_BWD_QW / 8][4])
{
#pragma unroll
    for (int nt = 0; nt < FA_BWD_QW / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            dpt[nt][e] = p[nt][e] * (dpt[nt][e] - fa_bwd_row(tl->dsum, nt * 8 + 2 * t + (e & 1)));
}
#endif

/* fa_bwd_probs_as with the mods wherever the family compiles them. */
FA_DEV void fa_bwd_probs(const fa_kparams *kp, const fa_bwd_tile *tl, int t,
                         float st[FA_BWD_QW / 8][4], float dpt[FA_BWD_QW / 8][4], int masked)
{
    fa_bwd_probs_as(kp, tl, t, st, dpt, masked, FA_BWD_MODS);
}

/* The window as bounds on i - j + sk - sq (query i, key j): visible iff whi <= . <= wlo. */
FA_DEV void fa_bwd_window(const fa_kparams *kp, int *wlo, int *whi)
{
    *wlo = FA_RULE_DG_MAX(kp->window_left);
    *whi = FA_RULE_DG_MIN(kp->window_right);
}

/* fa_bwd_probs' view of query tile m0 of head h, sequence s (index bi), for the thread whose
 * first key is key0 and whose lane % 4 is t; lse2 and dsum point to the tile's rows (with
 * FA_BWD_ROWS_IN_LANES each lane loads its two of them). */
FA_DEV fa_bwd_tile fa_bwd_tile_make(const fa_kparams *kp, const fa_seq *s, int bi, int h,
                                    int m0, int key0, int t, int wlo, int whi,
                                    const float *lse2, const float *dsum)
{
    fa_bwd_tile tl;
#if FA_BWD_ROWS_IN_LANES
    const int lane = threadIdx.x & 31;
#if FA_BWD_LANE_ROWS == 2
    const float2 l = *(const float2 *)(lse2 + 2 * lane), d = *(const float2 *)(dsum + 2 * lane);
    tl.lse2[0] = l.x, tl.lse2[1] = l.y;
    tl.dsum[0] = d.x, tl.dsum[1] = d.y;
#elif FA_BWD_LANE_ROWS == 1
    /* lane 8 nt + 4e + t holds row 8 nt + 2t + e (fa_bwd_row) */
    const int row = (lane & ~7) + 2 * (lane & 3) + (lane >> 2 & 1);
    tl.lse2[0] = lse2[row];
    tl.dsum[0] = dsum[row];
#else
#pragma unroll
    for (int x = 0; x < FA_BWD_LANE_ROWS; x++) {
        tl.lse2[x] = lse2[lane + 32 * x];
        tl.dsum[x] = dsum[lane + 32 * x];
    }
#endif
#else
    tl.lse2 = lse2;
    tl.dsum = dsum;
#endif
    tl.dg0 = m0 + 2 * t + (s->sk - s->sq) - key0;
    tl.rows = s->sq - m0 - 2 * t;
    tl.keys = s->sk - key0;
    tl.wlo = wlo;
    tl.whi = whi;
    tl.m0 = m0;
    tl.key0 = key0;
#if FA_ALIBI
    tl.slope_log2 = kp->alibi_slopes[bi * kp->alibi_bstride + h * kp->alibi_hstride] * FA_LOG2E;
#endif
#if FA_DROPOUT && !FA_BWD_KEEP_BITS
    tl.stream = fa_dropout_stream(kp, bi, h);
#endif
    (void)kp, (void)bi, (void)h;
    return tl;
}

/* Every pair of query tile m0 x key block n0 visible: the tile lies inside both sequences and
 * inside the window, whose edges i - j + sk - sq are extreme at the tile's corners (the unmasked
 * form of fa_bwd_probs may run). */
FA_DEV int fa_bwd_tile_full(const fa_seq *s, int m0, int n0, int wlo, int whi)
{
    return m0 + FA_BM <= s->sq && n0 + FA_BN <= s->sk &&
           m0 + FA_BM - 1 + (s->sk - s->sq) - n0 <= wlo &&
           m0 + (s->sk - s->sq) - (n0 + FA_BN - 1) >= whi;
}

#if FA_VARLEN
/* A key block at or past the sequence's keys in use meets no query tile (nor does any tile wait
 * for it): its keys of the sequence get zero dK and dV, from all FA_THREADS threads, and nothing
 * is loaded (its first row may lie past the tensor). */
FA_DEV void fa_bwd_block_zero(const fa_bkparams *bp, const fa_seq *s, int bi, int hk, int n0)
{
    const fa_kparams *kp = &bp->f;
    const int keys = fa_min(fa_bwd_klen(kp, bi) - n0, FA_BN);
    fa_bwd_zero((fa_u16 *)bp->dk + (s->k_start + n0) * bp->dk_rstride + hk * bp->dk_hstride,
                bp->dk_rstride, keys, kp->d, threadIdx.x, FA_THREADS);
    fa_bwd_zero((fa_u16 *)bp->dv + (s->k_start + n0) * bp->dv_rstride + hk * bp->dv_hstride,
                bp->dv_rstride, keys, kp->dv, threadIdx.x, FA_THREADS);
}
#endif

/* Columns [0, cols) of row g + 8 hf of C fragments acc[nt][e] (column 8 nt + 2t + (e % 2)),
 * times scale, to the global row r of n columns, with FA_VEC: 16-byte stores per 32 columns,
 * 4-byte ones for a last 16 (a 32-wide head split over two warps). */
#if FA_VEC
FA_DEV void fa_bwd_store_row(fa_u16 *r, int n, const float acc[][4], int cols, int hf, int t,
                             float scale, int live)
{
    fa_store_row16(r, n, acc, cols, hf, t, scale, live);
#pragma unroll
    for (int nt = cols / 32 * 4; nt < cols / 8; nt++)
        if (live)
            fa_store_pair(r, nt * 8 + 2 * t, n, acc[nt][2 * hf] * scale,
                          acc[nt][2 * hf + 1] * scale);
}
#endif

/* dK (times the softmax scale dS lacked) and dV of this thread's keys key0 and key0 + 8 of kv
 * head hk, sequence bi, from the C fragments dk[nt][e] (key key0 + 8 (e / 2), column
 * cw FA_BWD_DKC + 8 nt + 2t + (e % 2); dv alike with FA_BWD_DVC), columns below d / dv; keys up
 * to sk (dense) or, varlen, up to the sequence's end in k (zero past seqused_k, whose K and V
 * rows were masked), its offsets read again rather than held over the main loop. cw: the part
 * of the columns this warp holds (0 when it holds them all). With FA_VEC in 16-byte stores
 * (every lane of the warp calls it then). */
FA_DEV void fa_bwd_store_dkdv(const fa_bkparams *bp, int bi, int hk, int key0, int t, int sk,
                              int cw, const float dk[][4], const float dv[][4])
{
    const fa_kparams *kp = &bp->f;
    const int ck = cw * FA_BWD_DKC, cv = cw * FA_BWD_DVC;
    fa_i64 k_start;
    int key_end;
    fa_bwd_key_span(kp, bi, sk, &k_start, &key_end);
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int key = key0 + 8 * hf;
#if !FA_VEC
        if (key >= key_end)
            continue;
#endif
        fa_u16 *dkr = (fa_u16 *)bp->dk + bi * bp->dk_bstride + (k_start + key) * bp->dk_rstride +
                      hk * bp->dk_hstride;
        fa_u16 *dvr = (fa_u16 *)bp->dv + bi * bp->dv_bstride + (k_start + key) * bp->dv_rstride +
                      hk * bp->dv_hstride;
#if FA_VEC
        fa_bwd_store_row(dkr + ck, kp->d - ck, dk, FA_BWD_DKC, hf, t, kp->scale, key < key_end);
        fa_bwd_store_row(dvr + cv, kp->dv - cv, dv, FA_BWD_DVC, hf, t, 1.f, key < key_end);
#else
#pragma unroll
        for (int nt = 0; nt < FA_BWD_DKC / 8; nt++)
            fa_store_pair(dkr, ck + nt * 8 + 2 * t, kp->d, dk[nt][2 * hf] * kp->scale,
                          dk[nt][2 * hf + 1] * kp->scale);
#pragma unroll
        for (int nt = 0; nt < FA_BWD_DVC / 8; nt++)
            fa_store_pair(dvr, cv + nt * 8 + 2 * t, kp->dv, dv[nt][2 * hf], dv[nt][2 * hf + 1]);
#endif
    }
}

#endif /* FA_BWD_COMMON_CUH */
