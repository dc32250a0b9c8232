/*
 * The CPU forward kernel for one compute precision. fa_cpu_forward.c includes this file twice:
 * with FA_REAL float (fp32, fp16, bf16 inputs) and with FA_REAL double (fp64 inputs), so both
 * share one implementation of the masking and softmax rules.
 *
 * Needs: FA_REAL, FA_FN(name) (adds a precision suffix), FA_EXP, FA_TANH, FA_LOG, and
 * fa_cpu_rows.h included before it with the same FA_REAL.
 */

/* One query tile of one head: rows [r0, r0 + m) of sequence seq_index. Scratch is per thread. */
typedef struct FA_FN(fa_tile) {
    FA_REAL *q;  /* [FA_CPU_BM][d], pre-multiplied by the softmax scale */
    FA_REAL *kt; /* [d][FA_CPU_BN], K transposed so the score loop runs along keys */
    FA_REAL *v;  /* [FA_CPU_BN][dv] */
    FA_REAL *s;  /* [FA_CPU_BM][FA_CPU_BN] */
    FA_REAL *o;  /* [FA_CPU_BM][dv] */
    FA_REAL *m;  /* [FA_CPU_BM] running maximum */
    FA_REAL *l;  /* [FA_CPU_BM] running sum of exp(s - m) */
} FA_FN(fa_tile);

/* s[i][0..n) = q[i] . kt[:, 0..n) for the m rows of the tile. */
static inline void FA_FN(fa_tile_scores)(FA_FN(fa_tile) * t, int64_t m, int64_t n, int64_t d)
{
    for (int64_t i = 0; i < m; i++) {
        FA_REAL *restrict s = t->s + i * FA_CPU_BN;
        const FA_REAL *restrict q = t->q + i * d;
        for (int64_t j = 0; j < FA_CPU_BN; j++)
            s[j] = 0;
        for (int64_t c = 0; c < d; c++) {
            const FA_REAL qc = q[c];
            const FA_REAL *restrict kt = t->kt + c * FA_CPU_BN;
            for (int64_t j = 0; j < FA_CPU_BN; j++)
                s[j] += qc * kt[j];
        }
    }
    (void)n;
}

/* o[i] += sum_j p[i][j] * v[j] over the n keys of the block. */
static inline void FA_FN(fa_tile_pv)(FA_FN(fa_tile) * t, int64_t i, int64_t j0, int64_t j1,
                                     int64_t dv)
{
    FA_REAL *restrict o = t->o + i * dv;
    const FA_REAL *restrict p = t->s + i * FA_CPU_BN;
    for (int64_t j = j0; j < j1; j++) {
        const FA_REAL pj = p[j];
        if (pj == 0)
            continue;
        const FA_REAL *restrict v = t->v + j * dv;
        for (int64_t c = 0; c < dv; c++)
            o[c] += pj * v[c];
    }
}

/*
 * Attention for rows [r0, r0+m) of head h in sequence seq_index: loops over the visible key
 * blocks with an online softmax, then writes out and lse.
 */
FA_CPU_CLONES static void FA_FN(fa_cpu_tile)(const fa_params *p, FA_FN(fa_tile) * t, int64_t seq_index,
                               int64_t h, int64_t r0, int64_t m)
{
    const fa_seq seq = fa_params_seq(p, seq_index);
    const int64_t d = p->d, dv = p->dv;
    const int64_t hk = h / (p->h / p->hk);
    const FA_REAL scale = (FA_REAL)p->scale;
    const FA_REAL softcap = (FA_REAL)p->softcap;
    const FA_REAL inv_softcap = p->softcap > 0 ? (FA_REAL)(1.0 / p->softcap) : 0;
    const FA_REAL slope =
        p->alibi_slopes ? (FA_REAL)p->alibi_slopes[seq_index * p->alibi_bstride +
                                                   h * p->alibi_hstride]
                        : 0;
    const int dropout = p->dropout_p > 0.0;
    const uint64_t stream = p->offset + (uint64_t)seq_index * (uint64_t)p->h + (uint64_t)h;

    const int64_t q_base = seq_index * p->q_bstride + seq.q_start * p->q_rstride + h * p->q_hstride;
    const int64_t k_base =
        seq_index * p->k_bstride + seq.k_start * p->k_rstride + hk * p->k_hstride;
    const int64_t v_base =
        seq_index * p->v_bstride + seq.k_start * p->v_rstride + hk * p->v_hstride;

    for (int64_t i = 0; i < m; i++) {
        FA_REAL *q = t->q + i * d;
        FA_FN(fa_load_row)(q, p->q, q_base + (r0 + i) * p->q_rstride, d, p->dtype);
        for (int64_t c = 0; c < d; c++)
            q[c] *= scale;
        t->m[i] = -(FA_REAL)INFINITY;
        t->l[i] = 0;
        for (int64_t c = 0; c < dv; c++)
            t->o[i * dv + c] = 0;
    }

    /* Both window edges grow with the row, so the tile's keys lie between these two. */
    int64_t lo_first, hi_first, lo_last, hi_last;
    fa_params_key_range(p, r0, seq.sq, seq.sk, &lo_first, &hi_first);
    fa_params_key_range(p, r0 + m - 1, seq.sq, seq.sk, &lo_last, &hi_last);
    const int64_t k_lo = lo_first, k_hi = hi_last;

    for (int64_t j0 = k_lo; j0 < k_hi; j0 += FA_CPU_BN) {
        const int64_t n = k_hi - j0 < FA_CPU_BN ? k_hi - j0 : FA_CPU_BN;
        FA_REAL row_buf[FA_MAX_HEAD_DIM];
        for (int64_t j = 0; j < n; j++) {
            FA_FN(fa_load_row)(row_buf, p->k, k_base + (j0 + j) * p->k_rstride, d, p->dtype);
            for (int64_t c = 0; c < d; c++)
                t->kt[c * FA_CPU_BN + j] = row_buf[c];
            FA_FN(fa_load_row)(t->v + j * dv, p->v, v_base + (j0 + j) * p->v_rstride, dv,
                               p->dtype);
        }
        for (int64_t j = n; j < FA_CPU_BN; j++)
            for (int64_t c = 0; c < d; c++)
                t->kt[c * FA_CPU_BN + j] = 0;

        FA_FN(fa_tile_scores)(t, m, n, d);

        for (int64_t i = 0; i < m; i++) {
            const int64_t row = r0 + i;
            int64_t lo, hi;
            fa_params_key_range(p, row, seq.sq, seq.sk, &lo, &hi);
            int64_t a = lo - j0 > 0 ? lo - j0 : 0;
            int64_t b = hi - j0 < n ? hi - j0 : n;
            if (a >= b)
                continue;
            FA_REAL *s = t->s + i * FA_CPU_BN;
            const int64_t diag = row + seq.sk - seq.sq;
            FA_REAL mx = t->m[i];
            for (int64_t j = a; j < b; j++) {
                FA_REAL x = s[j];
                if (softcap > 0)
                    x = softcap * FA_TANH(x * inv_softcap);
                if (slope != 0) {
                    int64_t dist = diag - (j0 + j);
                    x -= slope * (FA_REAL)(dist < 0 ? -dist : dist);
                }
                s[j] = x;
                if (x > mx)
                    mx = x;
            }
            /* Rescale what was accumulated under the old maximum. */
            if (mx > t->m[i]) {
                if (t->l[i] > 0) {
                    FA_REAL alpha = FA_EXP(t->m[i] - mx);
                    t->l[i] *= alpha;
                    for (int64_t c = 0; c < dv; c++)
                        t->o[i * dv + c] *= alpha;
                }
                t->m[i] = mx;
            }
            FA_REAL sum = 0;
            for (int64_t j = a; j < b; j++) {
                FA_REAL e = FA_EXP(s[j] - mx);
                sum += e;
                s[j] = e;
            }
            t->l[i] += sum;
            if (dropout) {
                int64_t col8 = -1;
                fa_philox4 bits = {{0, 0, 0, 0}};
                for (int64_t j = a; j < b; j++) {
                    int64_t col = j0 + j;
                    if ((col >> 3) != col8) {
                        col8 = col >> 3;
                        bits = fa_dropout_block(p->seed, stream, row, col8);
                    }
                    if (fa_dropout_number(&bits, col) >= p->keep_threshold)
                        s[j] = 0;
                }
            }
            FA_FN(fa_tile_pv)(t, i, a, b, dv);
        }
    }

    const FA_REAL sink =
        p->sinks ? (FA_REAL)p->sinks[h * p->sinks_stride] : -(FA_REAL)INFINITY;
    const int64_t o_base = seq_index * p->o_bstride + seq.q_start * p->o_rstride + h * p->o_hstride;
    for (int64_t i = 0; i < m; i++) {
        const int64_t row = r0 + i;
        FA_REAL mx = t->m[i], l = t->l[i];
        FA_REAL big = mx > sink ? mx : sink;
        FA_REAL lse, out_scale;
        if (big == -(FA_REAL)INFINITY) {
            lse = (FA_REAL)INFINITY; /* no visible key and no sink: upstream's empty row */
            out_scale = 0;
        } else {
            FA_REAL lscaled = (l > 0 ? l * FA_EXP(mx - big) : 0);
            FA_REAL total = lscaled + (p->sinks ? FA_EXP(sink - big) : 0);
            lse = big + FA_LOG(total);
            out_scale = l > 0 ? FA_EXP(mx - big) / total * (FA_REAL)p->dropout_scale : 0;
        }
        FA_FN(fa_store_row)(p->out, o_base + row * p->o_rstride, t->o + i * dv, out_scale, dv,
                            p->dtype);
        if (p->lse) {
            int64_t at = seq_index * p->lse_bstride + h * p->lse_hstride +
                         (p->is_varlen ? seq.q_start + row : row) * p->lse_rstride;
            fa_params_lse_store(p, at, (double)lse);
        }
    }
}
