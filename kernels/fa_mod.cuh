/*
 * User-defined scoring in the sm80 family's tiles (kernels/fa_fwd_sm80.cu and fa_bwd_sm80.cu
 * include it after their tile defines): the operations and aux reads of the generated programs
 * (fa_mod_gen.cuh, written by src/mod/fa_mod_cuda.c), and the block mask's states of a tile:
 * per query tile over the keys (forward) or per key block over the queries (backward).
 * Compiled only for kernels whose plan defines FA_SCORE_MOD, FA_MASK_MOD or FA_BLOCK_MASK;
 * needs FA_THREADS and FA_BN.
 */
#ifndef FA_MOD_CUH
#define FA_MOD_CUH

#if FA_SCORE_MOD || FA_MASK_MOD
/* The operations of the generated programs that are more than an operator, as the CPU
 * evaluator has them (fa_cpu_mod_body.h): min / max propagate a NaN of either operand, mod is
 * the floor remainder (the divisor's sign). Division is within 2 ulp of it (x times the
 * approximate reciprocal; 0 for |y| above 2^126): the exact quotient branches to a slow path,
 * which keeps ptxas from interleaving a tile's scores. */
FA_DEV float fa_mod_div(float x, float y) { return __fdividef(x, y); }
FA_DEV float fa_mod_min(float x, float y) { return (x < y || x != x) ? x : y; }
FA_DEV float fa_mod_max(float x, float y) { return (x > y || x != x) ? x : y; }
FA_DEV float fa_mod_rem(float x, float y)
{
    const float r = fmodf(x, y);
    return (r != 0.f && ((r < 0.f) != (y < 0.f))) ? r + y : r;
}

/* The int forms (src/mod/fa_mod_cuda.c's fa_mod_cuda_ints): the floor remainder and the floor
 * quotient by a positive constant y. */
FA_DEV int fa_mod_rem_i(int x, int y)
{
    const int r = x % y;
    return r < 0 ? r + y : r;
}
FA_DEV int fa_mod_floordiv_i(int x, int y) { return x >= 0 ? x / y : -((y - 1 - x) / y); }

/* Which aux slots are int32 (the rest fp32): the plan's FA_MOD_AUX_I32, one bit a slot, so
 * each read takes one path. */
#ifndef FA_MOD_AUX_I32
#error "fa_mod.cuh: the plan defines FA_MOD_AUX_I32 beside FA_SCORE_MOD / FA_MASK_MOD"
#endif

/* Offsets into the aux tensors: int where the plan says every element's offset fits one
 * (FA_MOD_AUX_OFF32), which saves the registers and instructions of 64-bit index math. */
#if FA_MOD_AUX_OFF32
typedef int fa_mod_off;
#else
typedef fa_i64 fa_mod_off;
#endif

/* The last index of dimension d of aux tensor `slot`, as an offset (at most INT_MAX where
 * offsets are int: a broadcast dimension's stride is 0, so its length is not bounded). */
FA_DEV fa_mod_off fa_mod_last(const fa_kparams *kp, int slot, int d)
{
    const fa_i64 last = kp->mod_aux_shape[slot][d] - 1;
    return (fa_mod_off)(sizeof(fa_mod_off) < 8 && last > 0x7fffffff ? 0x7fffffff : last);
}

/* Index v in dimension d of aux tensor `slot`: v floored and clamped into the dimension as the
 * CPU does (below 1, NaN included, 0; at or past its length the last), then clamped as an
 * integer too (fp32 cannot hold every last index above 2^24). */
FA_DEV fa_mod_off fa_mod_index_f(const fa_kparams *kp, int slot, int d, float v)
{
    const fa_mod_off last = fa_mod_last(kp, slot, d);
    float m = v > 0.f ? v : 0.f;
    m = m < (float)last ? m : (float)last;
    const fa_mod_off i = (fa_mod_off)m;
    return i < last ? i : last;
}

/* The same for an int index (the generated code's index arithmetic). */
FA_DEV fa_mod_off fa_mod_index_i(const fa_kparams *kp, int slot, int d, int v)
{
    const fa_mod_off last = fa_mod_last(kp, slot, d);
    return v > 0 ? ((fa_mod_off)v < last ? (fa_mod_off)v : last) : 0;
}

/* The offsets of those indices in the tensor (off) and in its gradient (goff, FA_MOD_AUX_GRAD). */
FA_DEV fa_mod_off fa_mod_off_f(const fa_kparams *kp, int slot, int d, float v)
{
    return fa_mod_index_f(kp, slot, d, v) * (fa_mod_off)kp->mod_aux_stride[slot][d];
}
FA_DEV fa_mod_off fa_mod_off_i(const fa_kparams *kp, int slot, int d, int v)
{
    return fa_mod_index_i(kp, slot, d, v) * (fa_mod_off)kp->mod_aux_stride[slot][d];
}
FA_DEV fa_mod_off fa_mod_goff_f(const fa_kparams *kp, int slot, int d, float v)
{
    return fa_mod_index_f(kp, slot, d, v) * (fa_mod_off)kp->mod_aux_grad_stride[slot][d];
}
FA_DEV fa_mod_off fa_mod_goff_i(const fa_kparams *kp, int slot, int d, int v)
{
    return fa_mod_index_i(kp, slot, d, v) * (fa_mod_off)kp->mod_aux_grad_stride[slot][d];
}

/* The backward's captured-tensor gradients (the plan's FA_MOD_AUX_GRAD, a bit per slot): v
 * added to the gradient of aux tensor `slot` at offset off, by an fp32 atomic (their order
 * varies, so the sum's last bits may). uniform (a constant): every lane of the warp, all
 * present, adds at the same offset, so the warp sums first and one lane adds. */
#ifndef FA_MOD_AUX_GRAD
#define FA_MOD_AUX_GRAD 0
#endif
FA_DEV void fa_mod_aux_grad_add(const fa_kparams *kp, int slot, fa_mod_off off, float v,
                                int uniform)
{
    float *g = kp->mod_aux_grad[slot] + off;
    if (uniform) {
#pragma unroll
        for (int s = 16; s > 0; s >>= 1)
            v += __shfl_xor_sync(0xffffffffu, v, s);
        if ((threadIdx.x & 31) == 0 && v != 0.f)
            atomicAdd(g, v);
    } else if (v != 0.f) {
        atomicAdd(g, v);
    }
}

/* fa_mod_aux_grad_add of each lane's own v at its own off, joined across the warp: a lane whose
 * offset equals that of the lane 9 above ((g + 2, t + 1) in the C layout: the same kv - q)
 * takes that lane's value, and the first of such a chain (at most 4 lanes) adds their sum in
 * one atomic. Every lane of the warp calls it. */
FA_DEV void fa_mod_aux_grad_join(const fa_kparams *kp, int slot, fa_mod_off off, float v)
{
    const unsigned all = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    const fa_mod_off up9 = __shfl_up_sync(all, off, 9), down9 = __shfl_down_sync(all, off, 9),
                     down18 = __shfl_down_sync(all, off, 18);
    const int next = lane < 23 && down9 == off, next2 = next && lane < 14 && down18 == off;
    const float v9 = __shfl_down_sync(all, v, 9);
    v = next ? v + v9 : v; /* this lane's and the next one's */
    const float v18 = __shfl_down_sync(all, v, 18);
    v = next2 ? v + v18 : v; /* and the two after those */
    if ((lane < 9 || up9 != off) && v != 0.f)
        atomicAdd(kp->mod_aux_grad[slot] + off, v);
}

/* A lane's gradient element held back to be added with a later one at the same offset. */
typedef struct fa_mod_aux_held {
    fa_mod_off off;
    float v;
} fa_mod_aux_held;

/* fa_mod_aux_grad_add of a lane's own element (offsets that vary across the warp), paired: the
 * backward's C layout gives a thread elements (nt, e) and (nt - 1, e - 2) at the same kv - q, so
 * a read indexed by kv - q (a relative-position table) adds two elements in one atomic, joined
 * with the warp's lanes at the same offset (fa_mod_aux_grad_join: every lane calls it). from
 * (NULL: none) is the element held for this one: added with it at an equal offset, alone at
 * another. to (NULL: none) keeps this one for a later element instead of adding it. Both are
 * constants of the unrolled element loop. */
FA_DEV void fa_mod_aux_grad_pair(const fa_kparams *kp, int slot, fa_mod_off off, float v,
                                 const fa_mod_aux_held *from, fa_mod_aux_held *to)
{
    if (from) {
        if (from->off == off)
            v += from->v;
        else
            fa_mod_aux_grad_add(kp, slot, from->off, from->v, 0);
    }
    if (to) {
        to->off = off;
        to->v = v;
    } else {
        fa_mod_aux_grad_join(kp, slot, off, v);
    }
}

/* fa_mod_aux_grad_add of a warp-uniform read (indices of b and h only, so one offset for every
 * element of the call): summed in sum across the call's elements from the first and added,
 * over the warp, at the last. Every lane of the warp calls it. */
FA_DEV void fa_mod_aux_grad_sum(const fa_kparams *kp, int slot, fa_mod_off off, float v,
                                fa_mod_aux_held *sum, int first, int last)
{
    sum->v = first ? v : sum->v + v;
    if (last)
        fa_mod_aux_grad_add(kp, slot, off, sum->v, 1);
}

/* Aux tensor `slot`'s element at offset off (the sum of its indices' fa_mod_off_*), as fp32. */
FA_DEV float fa_mod_aux_at(const fa_kparams *kp, int slot, fa_mod_off off)
{
    if ((FA_MOD_AUX_I32 >> slot) & 1)
        return (float)__ldg((const int *)kp->mod_aux[slot] + off);
    return __ldg((const float *)kp->mod_aux[slot] + off);
}

/* The functions of the derivative rules (src/mod/fa_mod_grad.h) that fa_score_mod_grad calls,
 * the value's functions above. */
FA_DEV float fa_mod_sq(float x) { return x * x; }
#define FA_MOD_D_EXP expf
#define FA_MOD_D_LOG logf
#define FA_MOD_D_TANH fa_tanh_fast
#define FA_MOD_D_SQRT sqrtf
#define FA_MOD_D_FLOOR floorf
#define FA_MOD_D_POW powf
#define FA_MOD_D_SQ fa_mod_sq

#include "fa_mod_gen.cuh"
#endif

#if FA_SCORE_MOD
/* score_mod on a score in base 2 (y: the natural score times log2 e), its result in base 2;
 * deriv, when not NULL, takes its derivative with respect to the score. In the score's natural
 * units, as the CPU evaluates it, and back; a program of form score + term or score - term
 * (the emitter's FA_SCORE_MOD_ADDITIVE, fa_score_mod_term the signed term) adds its term in
 * base 2 instead, one fmaf, derivative 1. */
FA_DEV float fa_score_mod_base2(const fa_kparams *kp, float y, int b, int h, int q_idx,
                                int kv_idx, float *deriv)
{
#if FA_SCORE_MOD_ADDITIVE
    if (deriv)
        *deriv = 1.f;
    return fmaf(fa_score_mod_term(kp, b, h, q_idx, kv_idx), FA_LOG2E, y);
#else
    if (deriv)
        return fa_score_mod_grad(kp, y * FA_LN2, b, h, q_idx, kv_idx, deriv) * FA_LOG2E;
    return fa_score_mod(kp, y * FA_LN2, b, h, q_idx, kv_idx) * FA_LOG2E;
#endif
}
#endif

#if FA_MOD_MASKS
/* A key block's state for the tile's rows (the CPU's FA_BLOCK_* values): every key dropped,
 * mask_mod consulted, every key kept; or, with the block mask's blocks finer than the tile or
 * the key block, FA_BM_MIXED: the state looked up key by key. */
#define FA_BM_SKIP 0
#define FA_BM_PARTIAL 1
#define FA_BM_FULL 2
#define FA_BM_MIXED 3
#endif

#if FA_BLOCK_MASK
/* The (head, query block) rows of the table one warp of fa_bm_load reads at once. */
#define FA_BM_LOAD_ROWS 4

/* The block mask's states for heads h0 .. h0 + nh - 1, query blocks qb0 .. qb0 + nq - 1 and key
 * blocks kb0 .. kb0 + nkb - 1 into tab (shared), tab[(hh * nq + q) * nkb + kb - kb0]: listed
 * partial blocks, then listed full ones over them (a block in both lists is full), the rest
 * skipped. Counts past the lists and indices outside the key blocks are ignored. The forward
 * takes one head's tile of query blocks over every key block, the backward a key tile's blocks
 * over every query block of its heads. */
FA_DEV void fa_bm_load(const fa_kparams *kp, unsigned char *tab, int bi, int h0, int nh,
                       int qb0, int nq, int kb0, int nkb)
{
    for (int i = threadIdx.x; i < nh * nq * nkb; i += FA_THREADS)
        tab[i] = FA_BM_SKIP;
    __syncthreads();
    /* A warp takes FA_BM_LOAD_ROWS (head, query block) rows at a time, a lane per list entry:
     * their counts, then their entries, each batch of loads in flight together (a thread per
     * entry walking every list's full length waited on one load after another). */
    const int lane = threadIdx.x & 31, rows = nh * nq;
    for (int r0 = (threadIdx.x >> 5) * FA_BM_LOAD_ROWS; r0 < rows;
         r0 += FA_THREADS / 32 * FA_BM_LOAD_ROWS) {
        int c[2][FA_BM_LOAD_ROWS], most[2] = {0, 0};
#pragma unroll
        for (int pass = 0; pass < 2; pass++) {
            const int *num = pass ? kp->bm_full_num : kp->bm_num;
            const fa_i64 *ns = pass ? kp->bm_full_num_stride : kp->bm_num_stride;
            const int n = pass ? kp->bm_full_n : kp->bm_n;
#pragma unroll
            for (int r = 0; r < FA_BM_LOAD_ROWS; r++) {
                const int hq = r0 + r, qb = qb0 + hq % nq, h = h0 + hq / nq;
                c[pass][r] = num && hq < rows ? fa_min(num[bi * ns[0] + h * ns[1] + qb * ns[2]], n)
                                              : 0;
                most[pass] = fa_max(most[pass], c[pass][r]);
            }
        }
        /* listed partial blocks, then listed full ones over them */
#pragma unroll
        for (int pass = 0; pass < 2; pass++) {
            const int *idx = pass ? kp->bm_full_idx : kp->bm_idx;
            const fa_i64 *is = pass ? kp->bm_full_idx_stride : kp->bm_idx_stride;
            for (int j0 = 0; j0 < most[pass]; j0 += 32) {
                const int j = j0 + lane;
                int kb[FA_BM_LOAD_ROWS];
#pragma unroll
                for (int r = 0; r < FA_BM_LOAD_ROWS; r++) {
                    const int hq = r0 + r, qb = qb0 + hq % nq, h = h0 + hq / nq;
                    kb[r] = j < c[pass][r] ? idx[bi * is[0] + h * is[1] + qb * is[2] + j * is[3]]
                                           : -1;
                }
#pragma unroll
                for (int r = 0; r < FA_BM_LOAD_ROWS; r++)
                    if (kb[r] >= kb0 && kb[r] < kb0 + nkb)
                        tab[(r0 + r) * nkb + kb[r] - kb0] = pass ? FA_BM_FULL : FA_BM_PARTIAL;
            }
            __syncwarp();
        }
    }
    __syncthreads();
}

/* The state of keys [n0, min(n0 + FA_BN, sk)) for the tile's query blocks (tab: fa_bm_load). */
FA_DEV int fa_bm_state(const fa_kparams *kp, const unsigned char *tab, int nqb, int n0, int sk)
{
    const int kb0 = n0 / kp->bm_kv_block, kb1 = (fa_min(n0 + FA_BN, sk) - 1) / kp->bm_kv_block;
    const int first = tab[kb0];
    for (int q = 0; q < nqb; q++)
        for (int kb = kb0; kb <= kb1; kb++)
            if (tab[q * kp->bm_nk + kb] != first)
                return FA_BM_MIXED;
    return first;
}

/* The forward tile's live key blocks, from its states (tab: fa_bm_load): lab[kb] is the last
 * key block at or below kb that some query block of the tile does not skip, -1 if none. Warp 0
 * makes it once per tile (32 key blocks a ballot), so that each step to the next block visited
 * is a lookup (fa_bm_below), not a walk over every block skipped. */
FA_DEV void fa_bm_live(const fa_kparams *kp, const unsigned char *tab, int nqb, int *lab)
{
    if (threadIdx.x < 32) {
        const int lane = (int)threadIdx.x, nk = kp->bm_nk;
        int carry = -1;
        for (int c = 0; c < nk; c += 32) {
            const int kb = c + lane;
            bool live = false;
            for (int q = 0; q < nqb && kb < nk; q++)
                live |= tab[q * nk + kb] != FA_BM_SKIP;
            const unsigned mask = __ballot_sync(0xffffffffu, live);
            const unsigned upto = mask & (0xffffffffu >> (31 - lane)); /* lanes 0 .. lane */
            if (kb < nk)
                lab[kb] = upto ? c + 31 - __clz(upto) : carry;
            if (mask)
                carry = c + 31 - __clz(mask);
        }
    }
    __syncthreads();
}

/* The next key block below nb that the block mask does not skip, or n_min - 1, by lookup
 * (lab: fa_bm_live). */
FA_DEV int fa_bm_below(const fa_kparams *kp, const int *lab, int nb, int n_min, int sk)
{
    const int c = nb - 1;
    if (c < n_min)
        return c;
    const int kv = kp->bm_kv_block;
    const int lo = c * FA_BN / kv, hi = (fa_min((c + 1) * FA_BN, sk) - 1) / kv;
    const int l = lab[hi];
    if (l >= lo) /* some key block of c's keys is live */
        return c;
    const int b = l < 0 ? -1 : ((l + 1) * kv - 1) / FA_BN; /* the block of l's last key */
    return b >= n_min ? b : n_min - 1;
}

/* The state of query blocks qb0 .. qb1 over all nkb key blocks of a head's part of
 * the backward's fa_bm_load table: FA_BM_MIXED unless one state. */
FA_DEV int fa_bm_keys_state(const unsigned char *tab, int nkb, int qb0, int qb1)
{
    const int first = tab[qb0 * nkb];
    for (int i = qb0 * nkb; i < (qb1 + 1) * nkb; i++)
        if (tab[i] != first)
            return FA_BM_MIXED;
    return first;
}
#endif

#if FA_MOD_MASKS
/* Group g's four keep bits into the n-word number words at bits 4 g .. 4 g + 3, g a loop
 * variable: a loop over the groups need not be unrolled, so the mods' code is copied
 * FA_MOD_KEEP_UNROLL times instead of once per element, a fifth of a new mod's compile time
 * where a block mask asks for two copies (partial and mixed blocks). Four groups an iteration
 * keep the loop from being latency-bound. */
#define FA_MOD_KEEP_UNROLL 4
FA_DEV void fa_keep_or_in(fa_u32 *words, int n, int g, fa_u32 bits)
{
#pragma unroll
    for (int w = 0; w < n; w++)
        words[w] |= (g >> 3) == w ? bits << (4 * (g & 7)) : 0u;
}

/* Whether key col stays for row (both in the sequence's range, the window already checked),
 * the key block's state being st: the block mask's entry for (row, col) where the blocks are
 * finer than the tile (FA_BM_MIXED), then mask_mod where it is partial. The Hopper forward
 * calls it with st a constant (fa_mask_bits): a block's state tested per key made every key a
 * branch there. */
FA_DEV bool fa_mod_keep(const fa_kparams *kp, const unsigned char *tab, int st, int bi, int h,
                        int row, int col, int qb0, int nqb)
{
#if FA_BLOCK_MASK
    if (st == FA_BM_MIXED)
        st = tab[fa_min(row / kp->bm_q_block - qb0, nqb - 1) * kp->bm_nk +
                 col / kp->bm_kv_block];
    if (st != FA_BM_PARTIAL)
        return st == FA_BM_FULL;
#endif
#if FA_MASK_MOD
    return fa_mask_mod(kp, bi, h, row, col);
#else
    return true;
#endif
}
#endif

#endif /* FA_MOD_CUH */
