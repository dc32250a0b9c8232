/*
 * The CPU backward kernels for one compute precision; fa_cpu_backward.c includes this file with
 * FA_REAL float and with FA_REAL double. Needs FA_REAL, FA_FN(name), FA_NATIVE, FA_GEMM,
 * FA_EXPV, FA_TANHV and the row helpers of fa_cpu_rows.h (included before this file).
 *
 * Two passes, each owning what it writes, so no two threads ever add into the same element and
 * the result does not depend on the thread count:
 *   key pass:   one item per (sequence, kv head, key block): dK and dV of those keys, summed over
 *               every query head of the group and every query row that sees them;
 *   query pass: one item per (sequence, head, query tile): dQ of those rows.
 * Both recompute a (query tile, key block) pair transposed, keys on rows and queries on columns
 * as the forward does: S^T = K Q^T and dP^T = V dO^T with K and V read in place when they are
 * FA_REAL, then P^T and dS^T elementwise with the query index as the vector lane, then
 * dV += P^T dO, dK += dS^T Q (key pass) or dQ += dS K (query pass) on the same micro-kernels.
 */

typedef struct FA_FN(fa_bwd_tile) {
    FA_REAL *qt;    /* [d][FA_CPU_BM], Q^T times the softmax scale */
    FA_REAL *qr;    /* [FA_CPU_BM][dp], Q rows, zero-padded */
    FA_REAL *dot;   /* [dv][FA_CPU_BM], dO^T */
    FA_REAL *dor;   /* [FA_CPU_BM][dvp], dO rows, zero-padded */
    FA_REAL *lse;   /* [FA_CPU_BM] */
    FA_REAL *dsum;  /* [FA_CPU_BM] D = rowsum(dout * out) */
    FA_REAL *lo;    /* [FA_CPU_BM] first visible key of each row */
    FA_REAL *hi;    /* [FA_CPU_BM] one past the last visible key */
    FA_REAL *diag;  /* [FA_CPU_BM] i + sk - sq */
    FA_REAL *kbuf;  /* [FA_CPU_BWD_NK][dp], K rows converted/padded when not usable in place */
    FA_REAL *vbuf;  /* [FA_CPU_BWD_NK][dv], V rows converted when not FA_REAL */
    FA_REAL *pt;    /* [FA_CPU_BN][FA_CPU_BM], S^T then P^T after dropout */
    FA_REAL *dxt;   /* [FA_CPU_BN][FA_CPU_BM], dP^T then dS^T (gradient of q.k) */
    FA_REAL *zt;    /* [FA_CPU_BN][FA_CPU_BM], dropout scale Z^T: 1/(1-p) kept, 0 dropped */
    FA_REAL *acc_k; /* [FA_CPU_BWD_NK][dp] */
    FA_REAL *acc_v; /* [FA_CPU_BWD_NK][dvp] */
    FA_REAL *acc_q; /* [FA_CPU_BM][dp] */
    void *mod_scratch; /* user-defined scoring (fa_mod_call_active): fa_cpu_mod_grad_scratch_size */
    /* The thread's sums of the captured tensors' gradients (aux_plan->total doubles), NULL where
     * none is asked or the pass does not add them (the two-pass path's query pass). */
    double *aux_acc;
    const fa_cpu_aux_grads_plan *aux_plan;
    char *aux_scratch; /* fa_cpu_aux_grad_scratch_size bytes, where aux_acc is set */
} FA_FN(fa_bwd_tile);

/* The per-row data of rows [r0, r0+m) of head h: lse, D, visible keys, diagonal. Padding rows
 * up to mp see no key (lo = hi = 0, lse = +inf), so every quantity derived from them is 0. */
FA_CPU_INLINE void FA_FN(fa_bwd_row_info)(const fa_params *p, FA_FN(fa_bwd_tile) * t,
                                          const FA_REAL *dsum_ws, int64_t seq_index,
                                          const fa_seq *seq, int64_t h, int64_t r0, int64_t m,
                                          int64_t mp)
{
    for (int64_t i = 0; i < mp; i++) {
        t->lo[i] = t->hi[i] = 0;
        t->lse[i] = (FA_REAL)INFINITY;
        t->dsum[i] = 0;
        t->diag[i] = (FA_REAL)(r0 + i + seq->sk - seq->sq);
        if (i < m) {
            const int64_t row = r0 + i;
            const int64_t token = fa_bwd_token(p, seq_index, seq, row);
            t->lse[i] =
                (FA_REAL)fa_params_lse_load(p, fa_bwd_lse_index(p, seq_index, h, token, row));
            t->dsum[i] = dsum_ws[h * p->total_q + token];
            int64_t lo, hi;
            fa_params_key_range(p, row, seq->sq, seq->sk, &lo, &hi);
            t->lo[i] = (FA_REAL)lo;
            t->hi[i] = (FA_REAL)hi;
        }
    }
}

/* Packs rows [r0, r0+m) of head h (padding rows up to mp are zero and see no key). */
FA_CPU_CLONES static void FA_FN(fa_bwd_pack_rows)(const fa_params *p, FA_FN(fa_bwd_tile) * t,
                                           const FA_REAL *dsum_ws, int64_t seq_index,
                                           const fa_seq *seq, int64_t h, int64_t r0, int64_t m,
                                           int64_t mp)
{
    const int64_t d = p->d, dv = p->dv, dp = fa_cpu_gemm_pad(d), dvp = fa_cpu_gemm_pad(dv);
    const FA_REAL scale = (FA_REAL)p->scale;
    const int64_t q_base =
        seq_index * p->q_bstride + seq->q_start * p->q_rstride + h * p->q_hstride;
    const int64_t do_base =
        seq_index * p->do_bstride + seq->q_start * p->do_rstride + h * p->do_hstride;
    FA_FN(fa_bwd_row_info)(p, t, dsum_ws, seq_index, seq, h, r0, m, mp);
    for (int64_t i = 0; i < mp; i++) {
        FA_REAL *q = t->qr + i * dp, *dout = t->dor + i * dvp;
        for (int64_t c = 0; c < dp; c++)
            q[c] = 0;
        for (int64_t c = 0; c < dvp; c++)
            dout[c] = 0;
        if (i < m) {
            const int64_t row = r0 + i;
            FA_FN(fa_load_row)(q, p->q, q_base + row * p->q_rstride, d, p->dtype);
            FA_FN(fa_load_row)(dout, p->dout_data, do_base + row * p->do_rstride, dv, p->dtype);
        }
    }
    if (sizeof(FA_REAL) == sizeof(float)) {
        fa_cpu_transpose_f32((float *)t->qt, mp, (const float *)t->qr, dp, mp, d, (float)scale);
        fa_cpu_transpose_f32((float *)t->dot, mp, (const float *)t->dor, dvp, mp, dv, 1.0f);
        return;
    }
    for (int64_t i = 0; i < mp; i++) {
        for (int64_t c = 0; c < d; c++)
            t->qt[c * mp + i] = t->qr[i * dp + c] * scale;
        for (int64_t c = 0; c < dv; c++)
            t->dot[c * mp + i] = t->dor[i * dvp + c];
    }
}

/* K and V rows [j0, j0+n) of one kv head as micro-kernel operands: in place where their dtype,
 * padding and stride allow (fa_cpu_rows_alias), else copied into the tile's buffers. */
typedef struct FA_FN(fa_bwd_kv) {
    const FA_REAL *k; /* [n][d] rows, stride k_ld (also the dQ operand when k_padded) */
    const FA_REAL *v; /* [n][dv] rows, stride v_ld */
    int64_t k_ld, v_ld;
} FA_FN(fa_bwd_kv);

static inline FA_FN(fa_bwd_kv) FA_FN(fa_bwd_load_kv)(const fa_params *p, FA_FN(fa_bwd_tile) * t,
                                                     int64_t k_base, int64_t v_base, int64_t j0,
                                                     int64_t n)
{
    const int64_t d = p->d, dv = p->dv, dp = fa_cpu_gemm_pad(d);
    FA_FN(fa_bwd_kv) kv;
    /* dQ += dS K reads K as the B operand, whose rows must hold dp columns. */
    if (p->dtype == FA_NATIVE && dp == d && !fa_cpu_rows_alias(p->k_rstride, sizeof(FA_REAL))) {
        kv.k = (const FA_REAL *)p->k + k_base + j0 * p->k_rstride;
        kv.k_ld = p->k_rstride;
    } else {
        for (int64_t j = 0; j < n; j++) {
            FA_FN(fa_load_row)(t->kbuf + j * dp, p->k, k_base + (j0 + j) * p->k_rstride, d,
                               p->dtype);
            for (int64_t c = d; c < dp; c++)
                t->kbuf[j * dp + c] = 0;
        }
        kv.k = t->kbuf;
        kv.k_ld = dp;
    }
    if (p->dtype == FA_NATIVE && !fa_cpu_rows_alias(p->v_rstride, sizeof(FA_REAL))) {
        kv.v = (const FA_REAL *)p->v + v_base + j0 * p->v_rstride;
        kv.v_ld = p->v_rstride;
    } else {
        for (int64_t j = 0; j < n; j++)
            FA_FN(fa_load_row)(t->vbuf + j * dv, p->v, v_base + (j0 + j) * p->v_rstride, dv,
                               p->dtype);
        kv.v = t->vbuf;
        kv.v_ld = dv;
    }
    return kv;
}

/*
 * pt = P^T * Z and dxt = dS^T * scale (the gradient of q.k) from S^T * sscale and dP^T, element
 * by element with the query index as the vector lane (sscale: 1 where Q was scaled before the
 * product, the softmax scale where it was not). Always inlined with constant flags, so each
 * combination compiles to its own branch-free, vectorised loop. Masked entries are selected to
 * 0, not multiplied by it: on an edge block the products skip them, so they hold stale values.
 */
__attribute__((always_inline)) static inline void FA_FN(fa_bwd_elementwise)(
    const fa_params *p, FA_FN(fa_bwd_tile) * t, int64_t mp, int64_t j0, int64_t n, FA_REAL slope,
    FA_REAL sscale, const int softcap, const int dropout, const int masked)
{
    const FA_REAL scale = (FA_REAL)p->scale;
    const FA_REAL cap = (FA_REAL)p->softcap, inv_cap = softcap ? (FA_REAL)(1.0 / p->softcap) : 0;
    const FA_REAL *restrict lo = t->lo, *restrict hi = t->hi, *restrict diag = t->diag;
    const FA_REAL *restrict lse = t->lse, *restrict dsum = t->dsum;
    for (int64_t j = 0; j < n; j++) {
        FA_REAL *restrict pt = t->pt + j * mp;
        FA_REAL *restrict dxt = t->dxt + j * mp;
        const FA_REAL *restrict zt = t->zt + j * mp;
        const FA_REAL key = (FA_REAL)(j0 + j);
        for (int64_t i = 0; i < mp; i++) {
            FA_REAL x = pt[i] * sscale, deriv = 1;
            if (softcap) {
                const FA_REAL th = FA_RULE_SOFTCAP_TANH(x, inv_cap, FA_TANHV);
                x = cap * th;
                deriv = FA_RULE_SOFTCAP_GRAD(th);
            }
            if (masked) {
                const FA_REAL dist = diag[i] - key;
                x -= FA_RULE_ALIBI(slope, dist);
            }
            const FA_REAL prob = FA_EXPV(x - lse[i]);
            const int seen = !masked || (key >= lo[i] && key < hi[i]);
            const FA_REAL z = dropout ? zt[i] : 1;
            pt[i] = seen ? prob * z : 0;
            dxt[i] = seen ? prob * (dxt[i] * z - dsum[i]) * deriv * scale : 0;
        }
    }
}

#include "cpu/fa_cpu_bwd_mods.h"

/*
 * From S^T (times 1 / sscale) in pt and dP^T in dxt, for rows [r0, r0+m) of head h and keys
 * [j0, j0+n): pt = P^T * Z (Z the dropout scale or 0) and dxt = dL/d(q.k) transposed, both zero
 * for invisible keys and padding rows up to mp. full: every real row sees every key.
 */
FA_CPU_INLINE void FA_FN(fa_bwd_probs)(const fa_params *p, FA_FN(fa_bwd_tile) * t,
                                       int64_t seq_index, int64_t h, int64_t r0, int64_t m,
                                       int64_t mp, int64_t j0, int64_t n, int full,
                                       FA_REAL sscale)
{
    const FA_REAL slope =
        p->alibi_slopes
            ? (FA_REAL)p->alibi_slopes[seq_index * p->alibi_bstride + h * p->alibi_hstride]
            : 0;
    const int dropout = p->dropout_p > 0;
    if (dropout) {
        /* The forward's mask, replayed: Z scales both P (for dV) and dP (for dS). */
        const uint64_t stream = p->offset + (uint64_t)seq_index * (uint64_t)p->h + (uint64_t)h;
        const FA_REAL zscale = (FA_REAL)p->dropout_scale;
        for (int64_t x = 0; x < n * mp; x++)
            t->zt[x] = 0;
        for (int64_t i = 0; i < m; i++) {
            fa_philox4 bits = {{0, 0, 0, 0}};
            for (int64_t j = 0; j < n; j++) {
                const int64_t col = j0 + j;
                if (j == 0 || !fa_dropout_same_block(col, col - 1))
                    bits = fa_dropout_block(p->seed, stream, r0 + i, col);
                if (fa_dropout_number(&bits, col) < p->keep_threshold)
                    t->zt[j * mp + i] = zscale;
            }
        }
    }

    /* User-defined scoring, where the block mask does not keep every key as it is. */
    if (fa_mod_call_active(&p->mods)) {
        fa_cpu_mod_at at = {seq_index, h, r0, j0, NULL, 0, 0, 0};
        fa_cpu_mod_blocks_load(p, &at, t->mod_scratch, sizeof(FA_REAL), r0, m);
        if (!fa_cpu_mod_blocks_full(p, &at, j0, n)) {
            FA_FN(fa_bwd_probs_mods)(p, t, &at, m, mp, j0, n, slope, sscale);
            return;
        }
    }
    /* Interior blocks of plain attention skip the mask and bias arithmetic entirely. */
    const int plain = full && p->softcap <= 0 && slope == 0;
    if (plain && !dropout)
        FA_FN(fa_bwd_elementwise)(p, t, mp, j0, n, slope, sscale, 0, 0, 0);
    else if (plain)
        FA_FN(fa_bwd_elementwise)(p, t, mp, j0, n, slope, sscale, 0, 1, 0);
    else if (p->softcap > 0)
        FA_FN(fa_bwd_elementwise)(p, t, mp, j0, n, slope, sscale, 1, dropout, 1);
    else
        FA_FN(fa_bwd_elementwise)(p, t, mp, j0, n, slope, sscale, 0, dropout, 1);
}

/*
 * For packed rows and a loaded key block: pt = P^T * Z and dxt = dL/d(q.k) transposed
 * (fa_bwd_probs). Returns whether every real row sees every key (a full block); otherwise S^T
 * and dP^T were computed in panels of keys over the rows that see them (fa_cpu_edge.h), and
 * fa_bwd_grads goes in panels too.
 */
FA_CPU_CLONES static int FA_FN(fa_bwd_block)(const fa_params *p, FA_FN(fa_bwd_tile) * t,
                                       const FA_FN(fa_bwd_kv) * kv, int64_t seq_index, int64_t h,
                                       int64_t r0, int64_t m, int64_t mp, int64_t j0, int64_t n)
{
    const int full = FA_FN(fa_edge_full)(t->lo, t->hi, 0, m, j0, n);
    if (full) {
        FA_GEMM(t->pt, mp, kv->k, kv->k_ld, 1, t->qt, mp, n, mp, p->d, 0);
        FA_GEMM(t->dxt, mp, kv->v, kv->v_ld, 1, t->dot, mp, n, mp, p->dv, 0);
    } else {
        for (int64_t a = 0; a < n; a += FA_CPU_EDGE_PANEL) {
            const int64_t np = n - a < FA_CPU_EDGE_PANEL ? n - a : FA_CPU_EDGE_PANEL;
            int64_t c0, c1;
            FA_FN(fa_edge_cols)(t->lo, t->hi, m, j0 + a, np, &c0, &c1);
            if (c1 <= c0)
                continue;
            FA_GEMM(t->pt + a * mp + c0, mp, kv->k + a * kv->k_ld, kv->k_ld, 1, t->qt + c0, mp,
                    np, c1 - c0, p->d, 0);
            FA_GEMM(t->dxt + a * mp + c0, mp, kv->v + a * kv->v_ld, kv->v_ld, 1, t->dot + c0, mp,
                    np, c1 - c0, p->dv, 0);
        }
    }
    FA_FN(fa_bwd_probs)(p, t, seq_index, h, r0, m, mp, j0, n, full, 1);
    return full;
}

/*
 * The block's gradient products from pt and dxt: dV += P^T dO and dK += dS^T Q into acc_v and
 * acc_k (the block's key rows; NULL: not wanted), dQ += dS K into dq (the tile's real rows, row
 * stride ldq; NULL: not wanted). A full block (fa_bwd_block's answer) in one product each; on
 * an edge in panels of keys over the rows that see them and of rows over the keys they see:
 * pt and dxt are exactly 0 elsewhere, so the sums are the same bits.
 */
FA_CPU_INLINE void FA_FN(fa_bwd_grads)(const fa_params *p, const FA_FN(fa_bwd_tile) * t,
                                       const FA_FN(fa_bwd_kv) * kv, int64_t m, int64_t mp,
                                       int64_t j0, int64_t n, int full, FA_REAL *acc_v,
                                       FA_REAL *acc_k, FA_REAL *dq, int64_t ldq)
{
    const int64_t dp = fa_cpu_gemm_pad(p->d), dvp = fa_cpu_gemm_pad(p->dv);
    if (full) {
        if (acc_v)
            FA_GEMM(acc_v, dvp, t->pt, mp, 1, t->dor, dvp, n, dvp, mp, 1);
        if (acc_k)
            FA_GEMM(acc_k, dp, t->dxt, mp, 1, t->qr, dp, n, dp, mp, 1);
        if (dq)
            FA_GEMM(dq, ldq, t->dxt, 1, mp, kv->k, kv->k_ld, m, dp, n, 1);
        return;
    }
    for (int64_t a = 0; (acc_v || acc_k) && a < n; a += FA_CPU_EDGE_PANEL) {
        const int64_t np = n - a < FA_CPU_EDGE_PANEL ? n - a : FA_CPU_EDGE_PANEL;
        int64_t c0, c1;
        FA_FN(fa_edge_cols)(t->lo, t->hi, m, j0 + a, np, &c0, &c1);
        if (c1 <= c0)
            continue;
        if (acc_v)
            FA_GEMM(acc_v + a * dvp, dvp, t->pt + a * mp + c0, mp, 1, t->dor + c0 * dvp, dvp, np,
                    dvp, c1 - c0, 1);
        if (acc_k)
            FA_GEMM(acc_k + a * dp, dp, t->dxt + a * mp + c0, mp, 1, t->qr + c0 * dp, dp, np, dp,
                    c1 - c0, 1);
    }
    for (int64_t r = 0; dq && r < m; r += FA_CPU_EDGE_PANEL) {
        const int64_t rn = m - r < FA_CPU_EDGE_PANEL ? m - r : FA_CPU_EDGE_PANEL;
        int64_t a, b;
        FA_FN(fa_edge_keys)(t->lo, t->hi, r, rn, j0, n, &a, &b);
        if (b > a)
            FA_GEMM(dq + r * ldq, ldq, t->dxt + a * mp + r, 1, mp, kv->k + a * kv->k_ld, kv->k_ld,
                    rn, dp, b - a, 1);
    }
}

/* dK and dV of keys [j0, j0+n) of kv head hk in a sequence, from accumulators of rows pad(d) and
 * pad(dv) apart, stored in the gradients' dtype. */
static void FA_FN(fa_bwd_store_kv)(const fa_params *p, int64_t seq_index, const fa_seq *seq,
                                   int64_t hk, int64_t j0, int64_t n, const FA_REAL *acc_k,
                                   const FA_REAL *acc_v)
{
    const int64_t dp = fa_cpu_gemm_pad(p->d), dvp = fa_cpu_gemm_pad(p->dv);
    const int64_t dk_base =
        seq_index * p->dk_bstride + seq->k_start * p->dk_rstride + hk * p->dk_hstride;
    const int64_t dv_base =
        seq_index * p->dv_bstride + seq->k_start * p->dv_rstride + hk * p->dv_hstride;
    for (int64_t j = 0; j < n; j++) {
        FA_FN(fa_store_row)(p->dk_data, dk_base + (j0 + j) * p->dk_rstride, acc_k + j * dp, 1,
                            p->d, p->dtype);
        FA_FN(fa_store_row)(p->dv_data, dv_base + (j0 + j) * p->dv_rstride, acc_v + j * dvp, 1,
                            p->dv, p->dtype);
    }
}

/*
 * Where the two halves of a split fused item meet on key chunk ci of their stripe: each puts its
 * dK and dV sums (n rows of acc_k, acc_v) in its own slot, and the second to finish adds the
 * other's into its accumulators and returns 1 to store them. a + b and b + a are the same bits,
 * so the result does not depend on which half finishes first.
 */
static int FA_FN(fa_bwd_half_meet)(const fa_params *p, const fa_bwd_half *half, int64_t ci,
                                   int64_t n, FA_REAL *acc_k, FA_REAL *acc_v)
{
    const int64_t dp = fa_cpu_gemm_pad(p->d), dvp = fa_cpu_gemm_pad(p->dv);
    FA_REAL *mine = (FA_REAL *)half->kv_ws + (ci * 2 + half->part) * half->slot;
    const FA_REAL *other = (const FA_REAL *)half->kv_ws + (ci * 2 + 1 - half->part) * half->slot;
    memcpy(mine, acc_k, (size_t)(n * dp) * sizeof(FA_REAL));
    memcpy(mine + n * dp, acc_v, (size_t)(n * dvp) * sizeof(FA_REAL));
    if (atomic_fetch_add_explicit(&half->done[ci], 1, memory_order_acq_rel) == 0)
        return 0;
    for (int64_t x = 0; x < n * dp; x++)
        acc_k[x] += other[x];
    for (int64_t x = 0; x < n * dvp; x++)
        acc_v[x] += other[n * dp + x];
    return 1;
}

/*
 * Key pass item: dK, dV of keys [j0, j0+n) (n <= FA_CPU_BWD_NK) of kv head hk in sequence
 * seq_index. Each query tile is packed once and used for every FA_CPU_BN block of the item's keys
 * that it sees, which is why the item is several blocks long. With dq_ws (the fused schedule,
 * one thread owning these keys' stripe of the (sequence, kv head)) it also adds dS K into the dQ
 * workspace slot [total_q][h][dp], so no query pass is needed. With half, only the half's query
 * rows, and dK, dV meet the other half's on chunk ci of the stripe before they are stored.
 */
FA_CPU_CLONES static void FA_FN(fa_bwd_keys)(const fa_params *p, FA_FN(fa_bwd_tile) * t,
                                             const FA_REAL *dsum_ws, FA_REAL *dq_ws,
                                             int64_t seq_index, int64_t hk, int64_t j0,
                                             int64_t n, const fa_bwd_half *half, int64_t ci)
{
    const fa_seq seq = fa_params_seq(p, seq_index);
    const int64_t dp = fa_cpu_gemm_pad(p->d), dvp = fa_cpu_gemm_pad(p->dv);
    const int64_t group = p->h / p->hk;
    const int64_t k_base =
        seq_index * p->k_bstride + seq.k_start * p->k_rstride + hk * p->k_hstride;
    const int64_t v_base =
        seq_index * p->v_bstride + seq.k_start * p->v_rstride + hk * p->v_hstride;
    for (int64_t x = 0; x < n * dp; x++)
        t->acc_k[x] = 0;
    for (int64_t x = 0; x < n * dvp; x++)
        t->acc_v[x] = 0;

    int64_t i_lo, i_hi;
    fa_bwd_row_range(p, &seq, j0, j0 + n, &i_lo, &i_hi);
    fa_bwd_half_rows(half, &i_lo, &i_hi);
    if (i_lo < i_hi) {
        const FA_FN(fa_bwd_kv) kv = FA_FN(fa_bwd_load_kv)(p, t, k_base, v_base, j0, n);
        for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
            for (int64_t r0 = i_lo; r0 < i_hi; r0 += FA_CPU_BM) {
                const int64_t m = i_hi - r0 < FA_CPU_BM ? i_hi - r0 : FA_CPU_BM;
                const int64_t mp = fa_cpu_gemm_pad(m);
                FA_FN(fa_bwd_pack_rows)(p, t, dsum_ws, seq_index, &seq, h, r0, m, mp);
                for (int64_t b0 = 0; b0 < n; b0 += FA_CPU_BN) {
                    const int64_t nb = n - b0 < FA_CPU_BN ? n - b0 : FA_CPU_BN;
                    int64_t s_lo, s_hi;
                    fa_bwd_row_range(p, &seq, j0 + b0, j0 + b0 + nb, &s_lo, &s_hi);
                    if (s_hi <= r0 || s_lo >= r0 + m ||
                        FA_FN(fa_bwd_mod_skip)(p, t, seq_index, h, r0, m, j0 + b0, nb))
                        continue;
                    const FA_FN(fa_bwd_kv) sub = {kv.k + b0 * kv.k_ld, kv.v + b0 * kv.v_ld,
                                                  kv.k_ld, kv.v_ld};
                    const int full =
                        FA_FN(fa_bwd_block)(p, t, &sub, seq_index, h, r0, m, mp, j0 + b0, nb);
                    const int64_t dq_row = fa_bwd_token(p, seq_index, &seq, r0) * p->h + h;
                    FA_REAL *dq = dq_ws ? dq_ws + dq_row * dp : NULL;
                    FA_FN(fa_bwd_grads)(p, t, &sub, m, mp, j0 + b0, nb, full,
                                        t->acc_v + b0 * dvp, t->acc_k + b0 * dp, dq, p->h * dp);
                }
            }
        }
    }

    if (half && !FA_FN(fa_bwd_half_meet)(p, half, ci, n, t->acc_k, t->acc_v))
        return;
    FA_FN(fa_bwd_store_kv)(p, seq_index, &seq, hk, j0, n, t->acc_k, t->acc_v);
}

/* Zeroes stripe `stripe`'s dQ workspace slot on the rows of [r_lo, r_hi) that see its keys
 * (fa_bwd_stripe_rows), for every query head of kv head hk in a sequence. */
static void FA_FN(fa_bwd_dq_ws_zero)(const fa_params *p, FA_REAL *dq_ws, int64_t seq_index,
                                     const fa_seq *seq, int64_t hk, int64_t r_lo, int64_t r_hi,
                                     int64_t stripe, int64_t stripes, int64_t chunk)
{
    const int64_t dp = fa_cpu_gemm_pad(p->d), group = p->h / p->hk;
    const int64_t row0 = fa_bwd_token(p, seq_index, seq, 0);
    int64_t lo, hi;
    fa_bwd_stripe_rows(p, seq, fa_bwd_key_count(p, seq_index), stripe, stripes, chunk, &lo, &hi);
    r_lo = lo > r_lo ? lo : r_lo;
    r_hi = hi < r_hi ? hi : r_hi;
    for (int64_t r = r_lo; r < r_hi; r++)
        for (int64_t h = hk * group; h < (hk + 1) * group; h++)
            for (int64_t c = 0; c < dp; c++)
                dq_ws[((row0 + r) * p->h + h) * dp + c] = 0;
}

/*
 * dQ of rows [r_lo, r_hi) of head h in sequence seq_index from the fused schedule's workspace:
 * the partial sums ([stripes][total_q][h][dp]) of the stripes whose keys each row sees
 * (fa_bwd_stripe_rows; the others hold nothing for it) added in stripe order, then stored.
 * row: dp reals of scratch.
 */
static void FA_FN(fa_bwd_dq_reduce)(const fa_params *p, const FA_REAL *dq_ws, int64_t stripes,
                                    int64_t chunk, int64_t seq_index, int64_t h, int64_t r_lo,
                                    int64_t r_hi, FA_REAL *row)
{
    const fa_seq seq = fa_params_seq(p, seq_index);
    const int64_t dp = fa_cpu_gemm_pad(p->d), slot = p->total_q * p->h * dp;
    const int64_t row0 = fa_bwd_token(p, seq_index, &seq, 0);
    const int64_t dq_base =
        seq_index * p->dq_bstride + seq.q_start * p->dq_rstride + h * p->dq_hstride;
    const int64_t klen = fa_bwd_key_count(p, seq_index);
    int64_t lo[FA_CPU_BWD_STRIPE_ITEMS], hi[FA_CPU_BWD_STRIPE_ITEMS]; /* fa_plan_cpu_bwd_stripes' bound */
    for (int64_t s = 0; s < stripes; s++)
        fa_bwd_stripe_rows(p, &seq, klen, s, stripes, chunk, &lo[s], &hi[s]);
    for (int64_t r = r_lo; r < r_hi; r++) {
        const FA_REAL *x = dq_ws + ((row0 + r) * p->h + h) * dp;
        int none = 1;
        for (int64_t s = 0; s < stripes; s++) {
            if (r < lo[s] || r >= hi[s])
                continue;
            if (none)
                for (int64_t c = 0; c < dp; c++)
                    row[c] = x[s * slot + c];
            else
                for (int64_t c = 0; c < dp; c++)
                    row[c] += x[s * slot + c];
            none = 0;
        }
        for (int64_t c = 0; none && c < dp; c++)
            row[c] = 0;
        FA_FN(fa_store_row)(p->dq_data, dq_base + r * p->dq_rstride, row, 1, p->d, p->dtype);
    }
}

/*
 * Fused item: kv head hk in sequence seq_index, one stripe of its chunks of `chunk` keys
 * (chunks stripe, stripe + stripes, ...), serially in a fixed order: dK and dV chunk by chunk,
 * and the stripe's share of dQ for every query head of the group, summed in its slot of the
 * workspace (zeroed here; fa_bwd_dq_reduce adds the slots up afterwards, or stores dQ here, while
 * the rows are still in this core's caches, when there is one stripe). Used when there are
 * enough (sequence, kv head, stripe) items to keep the threads busy: five products per (query
 * tile, key block) instead of the two passes' seven. half: the item covers only its query rows,
 * and meets the other half on each chunk's dK and dV (NULL: every row).
 */
static void FA_FN(fa_bwd_fused)(const fa_params *p, FA_FN(fa_bwd_tile) * t,
                                const FA_REAL *dsum_ws, FA_REAL *dq_slot, int64_t seq_index,
                                int64_t hk, int64_t stripe, int64_t stripes, int64_t chunk,
                                const fa_bwd_half *half)
{
    const fa_seq seq = fa_params_seq(p, seq_index);
    const int64_t r_lo = half ? half->r_lo : 0, r_hi = half ? half->r_hi : seq.sq;
    FA_FN(fa_bwd_dq_ws_zero)(p, dq_slot, seq_index, &seq, hk, r_lo, r_hi, stripe, stripes, chunk);
    const int64_t klen = fa_bwd_key_count(p, seq_index);
    int64_t ci = 0;
    for (int64_t j0 = stripe * chunk; j0 < klen; j0 += stripes * chunk, ci++)
        FA_FN(fa_bwd_keys)(p, t, dsum_ws, dq_slot, seq_index, hk, j0,
                           klen - j0 < chunk ? klen - j0 : chunk, half, ci);
    const int64_t group = p->h / p->hk;
    for (int64_t h = hk * group; stripes == 1 && h < (hk + 1) * group; h++)
        FA_FN(fa_bwd_dq_reduce)(p, dq_slot, 1, chunk, seq_index, h, r_lo, r_hi, t->acc_q);
}

/* Query pass item: dQ of rows [r0, r0+m) of head h in sequence seq_index. */
FA_CPU_CLONES static void FA_FN(fa_bwd_queries)(const fa_params *p, FA_FN(fa_bwd_tile) * t,
                                                const FA_REAL *dsum_ws, int64_t seq_index,
                                                int64_t h, int64_t r0, int64_t m)
{
    const fa_seq seq = fa_params_seq(p, seq_index);
    const int64_t d = p->d, dp = fa_cpu_gemm_pad(d), mp = fa_cpu_gemm_pad(m);
    const int64_t hk = h / (p->h / p->hk);
    const int64_t k_base =
        seq_index * p->k_bstride + seq.k_start * p->k_rstride + hk * p->k_hstride;
    const int64_t v_base =
        seq_index * p->v_bstride + seq.k_start * p->v_rstride + hk * p->v_hstride;
    for (int64_t x = 0; x < FA_CPU_BM * dp; x++)
        t->acc_q[x] = 0;
    FA_FN(fa_bwd_pack_rows)(p, t, dsum_ws, seq_index, &seq, h, r0, m, mp);

    int64_t k_lo, k_hi;
    fa_params_tile_keys(p, r0, m, seq.sq, seq.sk, &k_lo, &k_hi);
    for (int64_t j0 = k_lo; j0 < k_hi; j0 += FA_CPU_BN) {
        const int64_t n = k_hi - j0 < FA_CPU_BN ? k_hi - j0 : FA_CPU_BN;
        if (FA_FN(fa_bwd_mod_skip)(p, t, seq_index, h, r0, m, j0, n))
            continue;
        const FA_FN(fa_bwd_kv) kv = FA_FN(fa_bwd_load_kv)(p, t, k_base, v_base, j0, n);
        const int full = FA_FN(fa_bwd_block)(p, t, &kv, seq_index, h, r0, m, mp, j0, n);
        FA_FN(fa_bwd_grads)(p, t, &kv, m, mp, j0, n, full, NULL, NULL, t->acc_q, dp);
    }

    const int64_t dq_base =
        seq_index * p->dq_bstride + seq.q_start * p->dq_rstride + h * p->dq_hstride;
    for (int64_t i = 0; i < m; i++)
        FA_FN(fa_store_row)(p->dq_data, dq_base + (r0 + i) * p->dq_rstride, t->acc_q + i * dp, 1,
                            d, p->dtype);
}

/*
 * D_i = dout_i . out_i for the rows of (sequence, head), into the workspace; returns this
 * item's share of dsinks, -sum_i exp(sink - lse_i) * D_i. Each row's products are summed in
 * FA_CPU_LANES running sums (column c into sum c % FA_CPU_LANES), then the sums in order: one
 * running sum would make each row a chain of dv dependent adds, bound by their latency.
 */
FA_CPU_CLONES static double FA_FN(fa_bwd_dsum)(const fa_params *p, FA_REAL *dsum_ws,
                                               FA_REAL *row_a, FA_REAL *row_b,
                                               int64_t seq_index, int64_t h)
{
    const fa_seq seq = fa_params_seq(p, seq_index);
    const int64_t do_base =
        seq_index * p->do_bstride + seq.q_start * p->do_rstride + h * p->do_hstride;
    const int64_t o_base =
        seq_index * p->o_bstride + seq.q_start * p->o_rstride + h * p->o_hstride;
    double dsink = 0;
    for (int64_t row = 0; row < seq.sq; row++) {
        FA_FN(fa_load_row)(row_a, p->dout_data, do_base + row * p->do_rstride, p->dv, p->dtype);
        FA_FN(fa_load_row)(row_b, p->out, o_base + row * p->o_rstride, p->dv, p->dtype);
        FA_REAL lane[FA_CPU_LANES] = {0};
        int64_t c = 0;
        for (; c + FA_CPU_LANES <= p->dv; c += FA_CPU_LANES)
            FA_CPU_UNROLL for (int l = 0; l < FA_CPU_LANES; l++)
                lane[l] += row_a[c + l] * row_b[c + l];
        for (int l = 0; c < p->dv; c++, l++)
            lane[l] += row_a[c] * row_b[c];
        FA_REAL dsum = 0;
        for (int l = 0; l < FA_CPU_LANES; l++)
            dsum += lane[l];
        const int64_t token = fa_bwd_token(p, seq_index, &seq, row);
        dsum_ws[h * p->total_q + token] = dsum;
        if (p->sinks) {
            double lse = fa_params_lse_load(p, fa_bwd_lse_index(p, seq_index, h, token, row));
            dsink -= FA_RULE_SINK_GRAD((double)p->sinks[h * p->sinks_stride], lse, (double)dsum, exp);
        }
    }
    return dsink;
}
