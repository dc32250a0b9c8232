/*
 * The CPU backward kernels for one compute precision; fa_cpu_backward.c includes this file with
 * FA_REAL float and with FA_REAL double. Needs FA_REAL, FA_FN(name), FA_EXP, FA_TANH and the
 * load/store helpers of fa_cpu_fwd_body.h (included before this file).
 *
 * Two passes, each owning what it writes, so no two threads ever add into the same element and
 * the result does not depend on the thread count:
 *   key pass:   one item per (sequence, kv head, key block): dK and dV of those keys, summed over
 *               every query head of the group and every query row that sees them;
 *   query pass: one item per (sequence, head, query tile): dQ of those rows.
 * Both recompute the probabilities of a (query tile, key block) pair from q, k and lse.
 */

typedef struct FA_FN(fa_bwd_tile) {
    FA_REAL *q;     /* [FA_CPU_BM][d] */
    FA_REAL *dout;  /* [FA_CPU_BM][dv] */
    FA_REAL *lse;   /* [FA_CPU_BM] */
    FA_REAL *dsum;  /* [FA_CPU_BM] D = rowsum(dout * out) */
    FA_REAL *k;     /* [FA_CPU_BN][d] */
    FA_REAL *kt;    /* [d][FA_CPU_BN] */
    FA_REAL *vt;    /* [dv][FA_CPU_BN] */
    FA_REAL *pz;    /* [FA_CPU_BM][FA_CPU_BN] probabilities after dropout */
    FA_REAL *dx;    /* [FA_CPU_BM][FA_CPU_BN] gradient of the scaled dot product q.k*scale */
    FA_REAL *acc_k; /* [FA_CPU_BN][d] */
    FA_REAL *acc_v; /* [FA_CPU_BN][dv] */
    FA_REAL *acc_q; /* [FA_CPU_BM][d] */
} FA_FN(fa_bwd_tile);

/* c[i][0..BN) = sum_x a[i][x] * bt[x][0..BN) for m rows: the shape of both S and dP. */
static inline void FA_FN(fa_bwd_gemm_nt)(FA_REAL *restrict c, const FA_REAL *restrict a,
                                         const FA_REAL *restrict bt, int64_t m, int64_t kdim)
{
    for (int64_t i = 0; i < m; i++) {
        FA_REAL *restrict ci = c + i * FA_CPU_BN;
        const FA_REAL *restrict ai = a + i * kdim;
        for (int64_t j = 0; j < FA_CPU_BN; j++)
            ci[j] = 0;
        for (int64_t x = 0; x < kdim; x++) {
            const FA_REAL ax = ai[x];
            const FA_REAL *restrict bx = bt + x * FA_CPU_BN;
            for (int64_t j = 0; j < FA_CPU_BN; j++)
                ci[j] += ax * bx[j];
        }
    }
}

/* Loads keys [j0, j0+n) of one kv head: k as rows and transposed, v transposed. */
static inline void FA_FN(fa_bwd_load_kv)(const fa_params *p, FA_FN(fa_bwd_tile) * t,
                                         int64_t k_base, int64_t v_base, int64_t j0, int64_t n)
{
    const int64_t d = p->d, dv = p->dv;
    FA_REAL row[FA_MAX_HEAD_DIM];
    for (int64_t j = 0; j < n; j++) {
        FA_FN(fa_load_row)(t->k + j * d, p->k, k_base + (j0 + j) * p->k_rstride, d, p->dtype);
        for (int64_t c = 0; c < d; c++)
            t->kt[c * FA_CPU_BN + j] = t->k[j * d + c];
        FA_FN(fa_load_row)(row, p->v, v_base + (j0 + j) * p->v_rstride, dv, p->dtype);
        for (int64_t c = 0; c < dv; c++)
            t->vt[c * FA_CPU_BN + j] = row[c];
    }
    for (int64_t j = n; j < FA_CPU_BN; j++) {
        for (int64_t c = 0; c < d; c++)
            t->kt[c * FA_CPU_BN + j] = 0;
        for (int64_t c = 0; c < dv; c++)
            t->vt[c * FA_CPU_BN + j] = 0;
    }
}

/* Loads rows [r0, r0+m) of head h: q, dout, lse and D. */
static inline void FA_FN(fa_bwd_load_rows)(const fa_params *p, FA_FN(fa_bwd_tile) * t,
                                           const FA_REAL *dsum_ws, int64_t seq_index,
                                           const fa_seq *seq, int64_t h, int64_t r0, int64_t m)
{
    const int64_t q_base =
        seq_index * p->q_bstride + seq->q_start * p->q_rstride + h * p->q_hstride;
    const int64_t do_base =
        seq_index * p->do_bstride + seq->q_start * p->do_rstride + h * p->do_hstride;
    for (int64_t i = 0; i < m; i++) {
        const int64_t row = r0 + i;
        const int64_t token = fa_bwd_token(p, seq_index, seq, row);
        FA_FN(fa_load_row)(t->q + i * p->d, p->q, q_base + row * p->q_rstride, p->d, p->dtype);
        FA_FN(fa_load_row)(t->dout + i * p->dv, p->dout_data, do_base + row * p->do_rstride, p->dv,
                           p->dtype);
        t->lse[i] = (FA_REAL)fa_params_lse_load(p, fa_bwd_lse_index(p, seq_index, h, token, row));
        t->dsum[i] = dsum_ws[h * p->total_q + token];
    }
}

/*
 * For a loaded (query tile, key block) pair: pz = P * Z (Z the dropout scale or 0) and
 * dx = dL/d(q.k * scale) * scale, both zero for invisible keys.
 */
static inline void FA_FN(fa_bwd_block)(const fa_params *p, FA_FN(fa_bwd_tile) * t,
                                       int64_t seq_index, const fa_seq *seq, int64_t h,
                                       int64_t r0, int64_t m, int64_t j0, int64_t n)
{
    const FA_REAL scale = (FA_REAL)p->scale;
    const FA_REAL softcap = (FA_REAL)p->softcap;
    const FA_REAL inv_softcap = p->softcap > 0 ? (FA_REAL)(1.0 / p->softcap) : 0;
    const FA_REAL slope =
        p->alibi_slopes
            ? (FA_REAL)p->alibi_slopes[seq_index * p->alibi_bstride + h * p->alibi_hstride]
            : 0;
    const int dropout = p->dropout_p > 0.0;
    const FA_REAL zscale = (FA_REAL)p->dropout_scale;
    const uint64_t stream = p->offset + (uint64_t)seq_index * (uint64_t)p->h + (uint64_t)h;

    FA_FN(fa_bwd_gemm_nt)(t->pz, t->q, t->kt, m, p->d);
    FA_FN(fa_bwd_gemm_nt)(t->dx, t->dout, t->vt, m, p->dv);

    for (int64_t i = 0; i < m; i++) {
        const int64_t row = r0 + i;
        FA_REAL *pz = t->pz + i * FA_CPU_BN;
        FA_REAL *dx = t->dx + i * FA_CPU_BN;
        int64_t lo, hi;
        fa_params_key_range(p, row, seq->sq, seq->sk, &lo, &hi);
        int64_t a = lo - j0 > 0 ? lo - j0 : 0;
        int64_t b = hi - j0 < n ? hi - j0 : n;
        if (b < a)
            b = a;
        const int64_t diag = row + seq->sk - seq->sq;
        const FA_REAL lse = t->lse[i], dsum = t->dsum[i];
        int64_t col8 = -1;
        fa_philox4 bits = {{0, 0, 0, 0}};
        for (int64_t j = 0; j < a; j++)
            pz[j] = dx[j] = 0;
        for (int64_t j = a; j < b; j++) {
            FA_REAL x = pz[j] * scale, deriv = 1;
            if (softcap > 0) {
                FA_REAL th = FA_TANH(x * inv_softcap);
                x = softcap * th;
                deriv = 1 - th * th;
            }
            if (slope != 0) {
                int64_t dist = diag - (j0 + j);
                x -= slope * (FA_REAL)(dist < 0 ? -dist : dist);
            }
            FA_REAL prob = FA_EXP(x - lse);
            FA_REAL z = 1;
            if (dropout) {
                int64_t col = j0 + j;
                if ((col >> 3) != col8) {
                    col8 = col >> 3;
                    bits = fa_dropout_block(p->seed, stream, row, col8);
                }
                z = fa_dropout_number(&bits, col) < p->keep_threshold ? zscale : 0;
            }
            pz[j] = prob * z;
            dx[j] = prob * (dx[j] * z - dsum) * deriv * scale;
        }
        for (int64_t j = b; j < FA_CPU_BN; j++)
            pz[j] = dx[j] = 0;
    }
}

/* Key pass item: dK, dV of keys [j0, j0+n) of kv head hk in sequence seq_index. */
FA_CPU_CLONES static void FA_FN(fa_bwd_keys)(const fa_params *p, FA_FN(fa_bwd_tile) * t,
                                             const FA_REAL *dsum_ws, int64_t seq_index,
                                             int64_t hk, int64_t j0, int64_t n)
{
    const fa_seq seq = fa_params_seq(p, seq_index);
    const int64_t d = p->d, dv = p->dv, group = p->h / p->hk;
    const int64_t k_base =
        seq_index * p->k_bstride + seq.k_start * p->k_rstride + hk * p->k_hstride;
    const int64_t v_base =
        seq_index * p->v_bstride + seq.k_start * p->v_rstride + hk * p->v_hstride;
    for (int64_t x = 0; x < FA_CPU_BN * d; x++)
        t->acc_k[x] = 0;
    for (int64_t x = 0; x < FA_CPU_BN * dv; x++)
        t->acc_v[x] = 0;

    int64_t i_lo, i_hi;
    fa_bwd_row_range(p, &seq, j0, j0 + n, &i_lo, &i_hi);
    if (i_lo < i_hi) {
        FA_FN(fa_bwd_load_kv)(p, t, k_base, v_base, j0, n);
        for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
            for (int64_t r0 = i_lo; r0 < i_hi; r0 += FA_CPU_BM) {
                const int64_t m = i_hi - r0 < FA_CPU_BM ? i_hi - r0 : FA_CPU_BM;
                FA_FN(fa_bwd_load_rows)(p, t, dsum_ws, seq_index, &seq, h, r0, m);
                FA_FN(fa_bwd_block)(p, t, seq_index, &seq, h, r0, m, j0, n);
                for (int64_t i = 0; i < m; i++) {
                    const FA_REAL *restrict dout = t->dout + i * dv;
                    const FA_REAL *restrict q = t->q + i * d;
                    for (int64_t j = 0; j < n; j++) {
                        const FA_REAL pz = t->pz[i * FA_CPU_BN + j];
                        const FA_REAL dx = t->dx[i * FA_CPU_BN + j];
                        FA_REAL *restrict av = t->acc_v + j * dv;
                        FA_REAL *restrict ak = t->acc_k + j * d;
                        if (pz != 0)
                            for (int64_t c = 0; c < dv; c++)
                                av[c] += pz * dout[c];
                        if (dx != 0)
                            for (int64_t c = 0; c < d; c++)
                                ak[c] += dx * q[c];
                    }
                }
            }
        }
    }

    const int64_t dk_base =
        seq_index * p->dk_bstride + seq.k_start * p->dk_rstride + hk * p->dk_hstride;
    const int64_t dv_base =
        seq_index * p->dv_bstride + seq.k_start * p->dv_rstride + hk * p->dv_hstride;
    for (int64_t j = 0; j < n; j++) {
        FA_FN(fa_store_row)(p->dk_data, dk_base + (j0 + j) * p->dk_rstride, t->acc_k + j * d, 1, d,
                            p->dtype);
        FA_FN(fa_store_row)(p->dv_data, dv_base + (j0 + j) * p->dv_rstride, t->acc_v + j * dv, 1, dv,
                            p->dtype);
    }
}

/* Query pass item: dQ of rows [r0, r0+m) of head h in sequence seq_index. */
FA_CPU_CLONES static void FA_FN(fa_bwd_queries)(const fa_params *p, FA_FN(fa_bwd_tile) * t,
                                                const FA_REAL *dsum_ws, int64_t seq_index,
                                                int64_t h, int64_t r0, int64_t m)
{
    const fa_seq seq = fa_params_seq(p, seq_index);
    const int64_t d = p->d, hk = h / (p->h / p->hk);
    const int64_t k_base =
        seq_index * p->k_bstride + seq.k_start * p->k_rstride + hk * p->k_hstride;
    const int64_t v_base =
        seq_index * p->v_bstride + seq.k_start * p->v_rstride + hk * p->v_hstride;
    for (int64_t x = 0; x < FA_CPU_BM * d; x++)
        t->acc_q[x] = 0;
    FA_FN(fa_bwd_load_rows)(p, t, dsum_ws, seq_index, &seq, h, r0, m);

    int64_t lo_first, hi_first, lo_last, hi_last;
    fa_params_key_range(p, r0, seq.sq, seq.sk, &lo_first, &hi_first);
    fa_params_key_range(p, r0 + m - 1, seq.sq, seq.sk, &lo_last, &hi_last);
    for (int64_t j0 = lo_first; j0 < hi_last; j0 += FA_CPU_BN) {
        const int64_t n = hi_last - j0 < FA_CPU_BN ? hi_last - j0 : FA_CPU_BN;
        FA_FN(fa_bwd_load_kv)(p, t, k_base, v_base, j0, n);
        FA_FN(fa_bwd_block)(p, t, seq_index, &seq, h, r0, m, j0, n);
        for (int64_t i = 0; i < m; i++) {
            FA_REAL *restrict aq = t->acc_q + i * d;
            for (int64_t j = 0; j < n; j++) {
                const FA_REAL dx = t->dx[i * FA_CPU_BN + j];
                if (dx == 0)
                    continue;
                const FA_REAL *restrict k = t->k + j * d;
                for (int64_t c = 0; c < d; c++)
                    aq[c] += dx * k[c];
            }
        }
    }

    const int64_t dq_base =
        seq_index * p->dq_bstride + seq.q_start * p->dq_rstride + h * p->dq_hstride;
    for (int64_t i = 0; i < m; i++)
        FA_FN(fa_store_row)(p->dq_data, dq_base + (r0 + i) * p->dq_rstride, t->acc_q + i * d, 1, d,
                            p->dtype);
}

/*
 * D_i = dout_i . out_i for the rows of (sequence, head), into the workspace; returns this
 * item's share of dsinks, -sum_i exp(sink - lse_i) * D_i.
 */
static double FA_FN(fa_bwd_dsum)(const fa_params *p, FA_REAL *dsum_ws, FA_REAL *row_a,
                                 FA_REAL *row_b, int64_t seq_index, int64_t h)
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
        FA_REAL dsum = 0;
        for (int64_t c = 0; c < p->dv; c++)
            dsum += row_a[c] * row_b[c];
        const int64_t token = fa_bwd_token(p, seq_index, &seq, row);
        dsum_ws[h * p->total_q + token] = dsum;
        if (p->sinks) {
            double lse = fa_params_lse_load(p, fa_bwd_lse_index(p, seq_index, h, token, row));
            dsink -= exp((double)p->sinks[h * p->sinks_stride] - lse) * (double)dsum;
        }
    }
    return dsink;
}
