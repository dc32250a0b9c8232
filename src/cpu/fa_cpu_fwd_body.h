/*
 * The CPU forward kernel for one compute precision. fa_cpu_forward.c includes this file twice:
 * with FA_REAL float (fp32, fp16, bf16 inputs) and with FA_REAL double (fp64 inputs), so both
 * share one implementation of the masking and softmax rules; bf16 inputs on CPUs with bf16
 * products take fa_cpu_fwd_bf16.h's tile, which reuses the float instance's softmax.
 *
 * Needs: FA_REAL, FA_FN(name) (adds a precision suffix), FA_NATIVE (the fa_dtype that is
 * FA_REAL), FA_GEMM (fa_cpu_gemm_f32's signature for FA_REAL), FA_EXPV / FA_TANHV (elementwise,
 * vectorisable), FA_EXP / FA_LOG (scalar), and fa_cpu_rows.h included before it; optionally
 * FA_EXP_ROWS (fa_cpu_exp_rows_f32's signature), tried before FA_EXPV on a block's rows.
 *
 * The tile works on transposed scores: S^T = K Q^T puts keys on rows and queries on columns, so
 *  - Q^T is packed once per tile and K is read in place (no per-block transpose);
 *  - the online softmax runs down the key rows with the query index as the vector lane;
 *  - O += P V reads P^T through swapped strides and V in place when its rows fit the kernel.
 * Inputs already in FA_REAL are read in place, except K/V rows a multiple of 4 KB apart
 * (fa_cpu_rows_alias); fp16/bf16 K/V blocks are converted once per tile.
 */

/* One query tile of one head: rows [r0, r0 + m) of sequence seq_index, m <= bm (the call's tile
 * height, fa_cpu_forward_tile_rows). Scratch is per thread. */
typedef struct FA_FN(fa_tile) {
    FA_REAL *qt;   /* [d][ld], Q^T times the softmax scale, ld = fa_cpu_tile_ld(pad(m)) */
    FA_REAL *kbuf; /* [FA_CPU_BN][d], converted K rows when K is not FA_REAL */
    FA_REAL *vbuf; /* [FA_CPU_BN][dvp], converted/padded V rows when V cannot be read in place */
    FA_REAL *st;   /* [FA_CPU_BN][ld], S^T, then P^T */
    FA_REAL *o;    /* [bm][dvp], unnormalised output */
    FA_REAL *m;    /* [bm] running maximum */
    FA_REAL *l;    /* [bm] running sum of exp(s - m) */
    FA_REAL *lo;   /* [bm] first visible key of each row */
    FA_REAL *hi;   /* [bm] one past the last visible key */
    FA_REAL *diag; /* [bm] the key on each row's diagonal, i + sk - sq */
    FA_REAL *bmax; /* [bm] block maximum, then the maximum used for exp */
    FA_REAL *mlo;  /* [bm] lo and hi narrowed to the keys a block's mask keeps (mods only) */
    FA_REAL *mhi;  /* [bm] */
    FA_REAL *mcnt; /* [bm] how many keys of the block each row keeps */
    void *mcache;  /* the thread's fa_cpu_mod_cache, or NULL */
    int64_t scratch_rows; /* rows the scratch above holds */
    /* User-defined scoring only (fa_mod_call_active): the evaluator's scratch
     * (fa_cpu_mod_scratch_size) and the tile's sequence, head, first query row and block
     * states. */
    FA_REAL *mod_buf;
    fa_cpu_mod_at mod_at;
} FA_FN(fa_tile);

/*
 * The two products of key block [j0, j0 + n) on columns (queries) [c0, c0 + mr) of the tile,
 * mr of them real rows. Where every such row sees every key (an interior block), one product
 * each; on a mask's edge, panels (fa_cpu_edge.h): S^T by panels of keys over the columns that
 * see them, P V by panels of rows over the keys they see (its P is exactly 0 elsewhere), so
 * a window's edge blocks skip most of the products its mask would zero.
 */
FA_CPU_INLINE void FA_FN(fa_tile_scores)(FA_FN(fa_tile) * t, int64_t m, int64_t ld, int64_t c0,
                                         int64_t c1, int64_t mr, int64_t j0, int64_t n,
                                         const FA_REAL *kp, int64_t k_ld, int64_t d)
{
    if (FA_FN(fa_edge_full)(t->lo, t->hi, c0, mr, j0, n)) {
        FA_GEMM(t->st + c0, ld, kp, k_ld, 1, t->qt + c0, ld, n, c1 - c0, d, 0);
        return;
    }
    for (int64_t a = 0; a < n; a += FA_CPU_EDGE_PANEL) {
        const int64_t np = n - a < FA_CPU_EDGE_PANEL ? n - a : FA_CPU_EDGE_PANEL;
        int64_t p0, p1;
        FA_FN(fa_edge_cols)(t->lo, t->hi, m, j0 + a, np, &p0, &p1);
        p0 = p0 > c0 ? p0 : c0;
        p1 = p1 < c1 ? p1 : c1;
        if (p1 > p0)
            FA_GEMM(t->st + a * ld + p0, ld, kp + a * k_ld, k_ld, 1, t->qt + p0, ld, np, p1 - p0,
                    d, 0);
    }
}

FA_CPU_INLINE void FA_FN(fa_tile_pv)(FA_FN(fa_tile) * t, int64_t ld, int64_t dvp, int64_t c0,
                                     int64_t mr, int64_t j0, int64_t n, const FA_REAL *vp,
                                     int64_t v_ld)
{
    if (FA_FN(fa_edge_full)(t->lo, t->hi, c0, mr, j0, n)) {
        FA_GEMM(t->o + c0 * dvp, dvp, t->st + c0, 1, ld, vp, v_ld, mr, dvp, n, 1);
        return;
    }
    for (int64_t r = c0; r < c0 + mr; r += FA_CPU_EDGE_PANEL) {
        const int64_t rn = c0 + mr - r < FA_CPU_EDGE_PANEL ? c0 + mr - r : FA_CPU_EDGE_PANEL;
        int64_t a, b;
        FA_FN(fa_edge_keys)(t->lo, t->hi, r, rn, j0, n, &a, &b);
        if (b > a)
            FA_GEMM(t->o + r * dvp, dvp, t->st + a * ld + r, 1, ld, vp + a * v_ld, v_ld, rn, dvp,
                    b - a, 1);
    }
}

/*
 * One key block of the online softmax, first half, on columns [c0, c1) of st = S^T [n][ld]
 * times sscale: softcap, ALiBi and the mask, the running maximum, the rescale of O and of the
 * running sum. Columns (queries) are the vector lanes; keys and positions are FA_REAL (exact
 * below 2^24) so every lane has one type. sscale is 1 where Q^T came pre-scaled (a constant,
 * so it folds away) and the softmax scale where it could not be (bf16 products take Q exactly
 * as given). With alpha NULL, rows of O ([m][dvp]) are rescaled here; otherwise alpha[i]
 * receives each query's factor (1 when its maximum stayed) and the caller rescales its own
 * layout of O. slack lets the running maximum lag behind by that much before a row is rescaled
 * (exponentials up to e^slack), for layouts where rescaling costs more than the rows that
 * changed. Leaves in bmax what the exponentials subtract, and returns what st must still be
 * multiplied by before they are taken.
 */
FA_CPU_INLINE FA_REAL FA_FN(fa_tile_softmax_max)(const fa_params *p, FA_FN(fa_tile) * t,
                                                 int64_t m, int64_t c0, int64_t c1, int64_t n,
                                                 int64_t ld, int64_t dvp, int64_t j0,
                                                 FA_REAL slope, FA_REAL sscale, FA_REAL *alpha,
                                                 FA_REAL slack)
{
    FA_REAL *restrict st = t->st;
    FA_REAL *restrict bmax = t->bmax;
    const FA_REAL *restrict lo = t->lo;
    const FA_REAL *restrict hi = t->hi;
    const FA_REAL *restrict diag = t->diag;
    FA_REAL mul = sscale; /* what st still has to be multiplied by */
    if (p->softcap > 0) {
        const FA_REAL cap = (FA_REAL)p->softcap, inv = sscale * (FA_REAL)(1.0 / p->softcap);
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = c0; i < c1; i++)
                st[j * ld + i] = FA_RULE_SOFTCAP(st[j * ld + i], inv, cap, FA_TANHV);
        mul = 1;
    }
    if (fa_mod_call_active(&p->mods) && !fa_cpu_mod_blocks_full(p, &t->mod_at, j0, n) &&
        !(t->mod_at.exact && !p->mods.score_mod)) {
        /* The mods see the final scaled score (after softcap and ALiBi) of every key. */
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = c0; i < c1; i++)
                st[j * ld + i] = st[j * ld + i] * mul -
                                 FA_RULE_ALIBI(slope, diag[i] - (FA_REAL)(j0 + j));
        t->mod_at.j0 = j0;
        FA_FN(fa_cpu_mod_apply)(p, t->mod_buf, st, ld, n, c0, c1, &t->mod_at);
        mul = 1;
        slope = 0;
    }
    for (int64_t i = c0; i < c1; i++)
        bmax[i] = -(FA_REAL)INFINITY;
    /* Interior blocks without ALiBi (every row sees every key, padding rows excepted) only need
     * the maxima, of the unscaled scores when the scale is positive (it then keeps the order);
     * padding rows hold zeros, harmless since their output is never stored. */
    int plain = slope == 0 && mul > 0;
    for (int64_t i = c0; plain && i < c1 && i < m; i++)
        plain = lo[i] <= (FA_REAL)j0 && hi[i] >= (FA_REAL)(j0 + n);
    /* 64 columns at a time down all the rows keep their maxima in registers (max is exact, so
     * the order does not matter). */
    for (int64_t i0 = c0; plain && i0 < c1; i0 += 64) {
        const int64_t w = c1 - i0 < 64 ? c1 - i0 : 64;
        FA_REAL acc[64];
        for (int64_t i = 0; i < 64; i++)
            acc[i] = -(FA_REAL)INFINITY;
        for (int64_t j = 0; j < n; j++) {
            const FA_REAL *restrict row = st + j * ld + i0;
            if (w == 64) {
                FA_CPU_UNROLL
                for (int64_t i = 0; i < 64; i++)
                    acc[i] = row[i] > acc[i] ? row[i] : acc[i];
            } else {
                for (int64_t i = 0; i < w; i++)
                    acc[i] = row[i] > acc[i] ? row[i] : acc[i];
            }
        }
        for (int64_t i = 0; i < w; i++)
            bmax[i0 + i] = acc[i];
    }
    for (int64_t j = 0; j < n && !plain; j++) {
        FA_REAL *restrict row = st + j * ld;
        const FA_REAL key = (FA_REAL)(j0 + j);
        for (int64_t i = c0; i < c1; i++) {
            const FA_REAL dist = diag[i] - key;
            FA_REAL v = row[i] * mul - FA_RULE_ALIBI(slope, dist);
            v = (key >= lo[i] && key < hi[i]) ? v : -(FA_REAL)INFINITY;
            row[i] = v;
            bmax[i] = v > bmax[i] ? v : bmax[i];
        }
    }
    const FA_REAL emul = plain ? mul : 1; /* the masked pass stored scaled scores */
    /* New maxima; rows whose maximum grew rescale what they accumulated. */
    for (int64_t i = c0; i < c1; i++) {
        if (plain)
            bmax[i] *= mul;
        if (alpha)
            alpha[i] = 1;
        if (bmax[i] > t->m[i] + slack) {
            if (t->l[i] > 0) {
                const FA_REAL a = FA_EXP(t->m[i] - bmax[i]);
                t->l[i] *= a;
                if (alpha) {
                    alpha[i] = a;
                } else {
                    FA_REAL *restrict o = t->o + i * dvp;
                    for (int64_t c = 0; c < dvp; c++)
                        o[c] *= a;
                }
            }
            t->m[i] = bmax[i];
        }
        /* A row with nothing visible yet subtracts 0, so exp(-inf - 0) = 0 and not NaN. */
        bmax[i] = t->m[i] == -(FA_REAL)INFINITY ? 0 : t->m[i];
    }
    return emul;
}

/* Second half, on columns [c0, c1): st = P^T = exp(st * emul - bmax), summed into l. */
FA_CPU_INLINE void FA_FN(fa_tile_softmax_exp)(FA_FN(fa_tile) * t, int64_t c0, int64_t c1,
                                              int64_t n, int64_t ld, FA_REAL emul)
{
    const FA_REAL *restrict bmax = t->bmax;
#ifdef FA_EXP_ROWS
    if (FA_EXP_ROWS(t->st, ld, n, c0, c1, emul, bmax, t->l))
        return;
#endif
    for (int64_t j = 0; j < n; j++) {
        FA_REAL *restrict row = t->st + j * ld;
        FA_REAL *restrict l = t->l;
        for (int64_t i = c0; i < c1; i++) {
            const FA_REAL e = FA_EXPV(row[i] * emul - bmax[i]);
            row[i] = e;
            l[i] += e;
        }
    }
}

/* Zeroes the dropped entries of P^T for rows [r0 + c0, r0 + c1) of head h. */
FA_CPU_INLINE void FA_FN(fa_tile_dropout)(const fa_params *p, FA_FN(fa_tile) * t, int64_t seq_index,
                                          int64_t h, int64_t r0, int64_t c0, int64_t c1,
                                          int64_t ld, int64_t j0, int64_t n)
{
    const uint64_t stream = p->offset + (uint64_t)seq_index * (uint64_t)p->h + (uint64_t)h;
    for (int64_t i = c0; i < c1; i++) {
        fa_philox4 bits = {{0, 0, 0, 0}};
        for (int64_t j = 0; j < n; j++) {
            const int64_t col = j0 + j;
            if (j == 0 || !fa_dropout_same_block(col, col - 1))
                bits = fa_dropout_block(p->seed, stream, r0 + i, col);
            if (fa_dropout_number(&bits, col) >= p->keep_threshold)
                t->st[j * ld + i] = 0;
        }
    }
}

/* Writes out (and lse) for rows [r0, r0+m) of head h from their running maxima mx[i], sums l[i]
 * and unnormalised outputs o + i * ldo. */
FA_CPU_INLINE void FA_FN(fa_tile_store)(const fa_params *p, const FA_REAL *mx, const FA_REAL *l,
                                        const FA_REAL *o, int64_t ldo, int64_t seq_index,
                                        int64_t h, int64_t r0, int64_t m)
{
    const fa_seq seq = fa_params_seq(p, seq_index);
    const FA_REAL sink =
        p->sinks ? (FA_REAL)p->sinks[h * p->sinks_stride] : -(FA_REAL)INFINITY;
    const int64_t o_base = seq_index * p->o_bstride + seq.q_start * p->o_rstride + h * p->o_hstride;
    for (int64_t i = 0; i < m; i++) {
        const int64_t row = r0 + i;
        const FA_REAL big = mx[i] > sink ? mx[i] : sink;
        FA_REAL lse, out_scale;
        if (l[i] != l[i]) {
            lse = out_scale = l[i]; /* a NaN score reached the sum: the whole row is NaN */
        } else if (big == -(FA_REAL)INFINITY) {
            lse = (FA_REAL)INFINITY; /* no visible key and no sink: upstream's empty row */
            out_scale = 0;
        } else {
            FA_REAL lscaled = (l[i] > 0 ? l[i] * FA_EXP(mx[i] - big) : 0);
            FA_REAL total = FA_RULE_SINK_TOTAL(lscaled, p->sinks, sink, big, FA_EXP);
            lse = big + FA_LOG(total);
            out_scale = l[i] > 0 ? FA_EXP(mx[i] - big) / total * (FA_REAL)p->dropout_scale : 0;
        }
        FA_FN(fa_store_row)(p->out, o_base + row * p->o_rstride, o + i * ldo, out_scale, p->dv,
                            p->dtype);
        if (p->lse) {
            int64_t at = seq_index * p->lse_bstride + h * p->lse_hstride +
                         (p->is_varlen ? seq.q_start + row : row) * p->lse_rstride;
            fa_params_lse_store(p, at, (double)lse);
        }
    }
}

/*
 * Attention for rows [r0, r0+m) of head h in sequence seq_index: loops over the visible key
 * blocks with an online softmax, then writes out and lse.
 */
FA_CPU_CLONES static void FA_FN(fa_cpu_tile)(const fa_params *p, FA_FN(fa_tile) * t,
                                             int64_t seq_index, int64_t h, int64_t r0, int64_t m)
{
    const fa_seq seq = fa_params_seq(p, seq_index);
    const int64_t d = p->d, dv = p->dv, dvp = fa_cpu_gemm_pad(p->dv), mp = fa_cpu_gemm_pad(m);
    const int64_t ld = fa_cpu_tile_ld(mp); /* of qt and st */
    const int64_t hk = h / (p->h / p->hk);
    const FA_REAL scale = (FA_REAL)p->scale;
    const FA_REAL slope =
        p->alibi_slopes ? (FA_REAL)p->alibi_slopes[seq_index * p->alibi_bstride +
                                                   h * p->alibi_hstride]
                        : 0;
    const int k_in_place =
        p->dtype == FA_NATIVE && !fa_cpu_rows_alias(p->k_rstride, sizeof(FA_REAL));
    const int v_in_place = p->dtype == FA_NATIVE && dvp == dv &&
                           !fa_cpu_rows_alias(p->v_rstride, sizeof(FA_REAL));

    const int64_t q_base = seq_index * p->q_bstride + seq.q_start * p->q_rstride + h * p->q_hstride;
    const int64_t k_head = hk * p->k_hstride, v_head = hk * p->v_hstride;

    /* fp32 Q is transposed straight from its rows (fa_cpu_transpose_f32, 16x16 blocks); other
     * inputs row by row through row_buf, as are the padding rows. */
    const int q_direct = sizeof(FA_REAL) == sizeof(float) && p->dtype == FA_DTYPE_F32;
    if (q_direct)
        fa_cpu_transpose_f32((float *)t->qt, ld, (const float *)p->q + q_base + r0 * p->q_rstride,
                             p->q_rstride, m, d, (float)scale);
    FA_REAL row_buf[FA_MAX_HEAD_DIM];
    for (int64_t i = 0; i < mp; i++) {
        if (i < m) {
            if (!q_direct)
                FA_FN(fa_load_row)(row_buf, p->q, q_base + (r0 + i) * p->q_rstride, d, p->dtype);
            int64_t lo, hi;
            fa_params_key_range(p, r0 + i, seq.sq, seq.sk, &lo, &hi);
            t->lo[i] = (FA_REAL)lo;
            t->hi[i] = (FA_REAL)hi;
        } else {
            for (int64_t c = 0; c < d; c++)
                row_buf[c] = 0;
            t->lo[i] = t->hi[i] = 0; /* padding rows see nothing */
        }
        if (!q_direct || i >= m)
            for (int64_t c = 0; c < d; c++)
                t->qt[c * ld + i] = row_buf[c] * scale;
        t->diag[i] = (FA_REAL)(r0 + i + seq.sk - seq.sq);
        t->m[i] = -(FA_REAL)INFINITY;
        t->l[i] = 0;
        for (int64_t c = 0; c < dvp; c++)
            t->o[i * dvp + c] = 0;
    }
    if (!v_in_place)
        for (int64_t j = 0; j < FA_CPU_BN; j++)
            for (int64_t c = dv; c < dvp; c++)
                t->vbuf[j * dvp + c] = 0;

    int64_t k_lo, k_hi;
    fa_params_tile_keys(p, r0, m, seq.sq, seq.sk, &k_lo, &k_hi);

    FA_REAL *const lo_call = t->lo, *const hi_call = t->hi;
    /* The bounds cache holds this tile's rows when another head's tile of them ran last. */
    fa_cpu_mod_cache *cache = t->mcache;
    unsigned char *cstate = cache ? (unsigned char *)cache + FA_CPU_MOD_CACHE_HEAD : NULL;
    FA_REAL *cbounds = NULL;
    if (cache) {
        const int64_t nkb = (p->max_sk + FA_CPU_BN - 1) / FA_CPU_BN;
        cbounds = (FA_REAL *)(cstate + ((nkb + 63) & ~(int64_t)63));
        if (!(cache->valid && cache->seq == seq_index && cache->r0 == r0 && cache->m == m &&
              cache->k_lo == k_lo)) {
            *cache = (fa_cpu_mod_cache){seq_index, r0, m, k_lo, 1};
            memset(cstate, 0, (size_t)nkb);
        }
    }
    for (int64_t j0 = k_lo; j0 < k_hi; j0 += FA_CPU_BN) {
        const int64_t n = k_hi - j0 < FA_CPU_BN ? k_hi - j0 : FA_CPU_BN;
        if (fa_cpu_mod_blocks_skip(p, &t->mod_at, j0, n))
            continue; /* a block mask skips every key of it for every row */
        /* Where the mods mask part of the block, the keys each row keeps bound its products as
         * a causal or window edge does (the mask, which cannot read the scores, taken first). */
        t->lo = lo_call, t->hi = hi_call;
        t->mod_at.exact = 0;
        t->mod_at.j0 = j0;
        const int64_t kbi = (j0 - k_lo) / FA_CPU_BN;
        FA_REAL *mlo = cache ? cbounds + 2 * kbi * t->scratch_rows : t->mlo;
        FA_REAL *mhi = cache ? mlo + t->scratch_rows : t->mhi;
        if (cache && cstate[kbi]) {
            if (cstate[kbi] >= 2)
                t->lo = mlo, t->hi = mhi, t->mod_at.exact = cstate[kbi] == 3;
        } else if (fa_mod_call_active(&p->mods)) {
            int state = 1;
            if (FA_FN(fa_cpu_mod_bounds)(p, t->mod_buf, n, 0, m, &t->mod_at, lo_call, hi_call,
                                         mlo, mhi, t->mcnt) &&
                FA_FN(fa_edge_narrow)(mlo, mhi, lo_call, hi_call, m, mp, j0)) {
                t->lo = mlo, t->hi = mhi;
                /* Rows that keep every key between their bounds need no mask after the
                 * products: the softmax masks by the bounds (mcnt counts only keys inside the
                 * call's bounds, as mlo and mhi are narrowed to them). */
                int exact = 1;
                for (int64_t i = 0; i < m; i++)
                    exact &= mhi[i] - mlo[i] == t->mcnt[i];
                t->mod_at.exact = exact;
                state = 2 + exact;
            }
            if (cache)
                cstate[kbi] = (unsigned char)state;
        }
        int64_t c0, c1;
        /* The rows that see none of the block are left alone, which is what computing them fully
         * masked would do (an unchanged maximum, exponentials 0). */
        FA_FN(fa_edge_cols)(t->lo, t->hi, m, j0, n, &c0, &c1);
        const int64_t mr = (c1 < m ? c1 : m) - c0; /* real rows among the columns */
        if (mr <= 0)
            continue;
        /* Rows of one page (or of a dense layout) are read where they are; others are copied. */
        const int adjacent = fa_kv_keys_adjacent(p, j0, n);
        int64_t k_at, v_at;
        fa_kv_key_at(p, seq_index, seq.k_start, j0, &k_at, &v_at);
        const FA_REAL *kp = (const FA_REAL *)p->k + k_at + k_head;
        const FA_REAL *vp = (const FA_REAL *)p->v + v_at + v_head;
        int64_t k_ld = p->k_rstride, v_ld = p->v_rstride;
        for (int64_t j = 0; j < n && !(k_in_place && v_in_place && adjacent); j++) {
            fa_kv_key_at(p, seq_index, seq.k_start, j0 + j, &k_at, &v_at);
            if (!k_in_place || !adjacent)
                FA_FN(fa_load_row)(t->kbuf + j * d, p->k, k_at + k_head, d, p->dtype);
            if (!v_in_place || !adjacent)
                FA_FN(fa_load_row)(t->vbuf + j * dvp, p->v, v_at + v_head, dv, p->dtype);
        }
        if (!k_in_place || !adjacent)
            kp = t->kbuf, k_ld = d;
        if (!v_in_place || !adjacent)
            vp = t->vbuf, v_ld = dvp;

        FA_FN(fa_tile_scores)(t, m, ld, c0, c1, mr, j0, n, kp, k_ld, d);
        const FA_REAL emul =
            FA_FN(fa_tile_softmax_max)(p, t, m, c0, c1, n, ld, dvp, j0, slope, 1, NULL, 0);
        FA_FN(fa_tile_softmax_exp)(t, c0, c1, n, ld, emul);
        if (p->dropout_p > 0)
            FA_FN(fa_tile_dropout)(p, t, seq_index, h, r0, c0, c0 + mr, ld, j0, n);
        FA_FN(fa_tile_pv)(t, ld, dvp, c0, mr, j0, n, vp, v_ld);
    }
    t->lo = lo_call, t->hi = hi_call;
    t->mod_at.exact = 0;
    FA_FN(fa_tile_store)(p, t->m, t->l, t->o, dvp, seq_index, h, r0, m);
}
