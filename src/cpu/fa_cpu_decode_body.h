/*
 * The KV-cache kernels for one compute precision: the in-place append (with rotary) and the
 * attention of one work item. fa_cpu_decode.c includes this file twice, with FA_REAL float
 * (fp32, fp16, bf16 caches) and double (fp64).
 *
 * Needs: FA_REAL, FA_FN(name), FA_EXP, FA_EXP_LOOP (an exp the compiler vectorises in a loop,
 * for x <= 0), FA_TANH, FA_LOG, FA_LANES (8 or 16 partial sums of a dot product, a multiple of
 * the SIMD width, so that the dot loop vectorises without reassociating a sum), FA_KV_BM,
 * FA_KV_BN, FA_KV_PREFETCH, fa_kv_item, and fa_cpu_rows.h included for this precision.
 */

/* One thread's buffers. dp and dvp are d and dv rounded up to FA_LANES; padding stays zero. */
typedef struct FA_FN(fa_kv_tile) {
    FA_REAL *q;     /* [FA_KV_BM][dp]: scale * rotary(q) of each packed row */
    FA_REAL *k;     /* [FA_KV_BN][dp]: the block's key rows */
    FA_REAL *v;     /* [FA_KV_BN][dvp]: the block's value rows */
    FA_REAL *s;     /* [FA_KV_BM][FA_KV_BN]: scores, then probabilities */
    FA_REAL *o;     /* [FA_KV_BM][dvp]: unnormalised output */
    FA_REAL *m;     /* [FA_KV_BM]: running maximum */
    FA_REAL *l;     /* [FA_KV_BM]: running sum of exp(s - m) */
    FA_REAL *slope; /* [FA_KV_BM]: ALiBi slope of each packed row's head */
} FA_FN(fa_kv_tile);

/*
 * Rotates the first rotary_dim features of x by the angles of row pos of cos/sin: pairs
 * (2t, 2t+1) interleaved (GPT-J), (t, t + rotary_dim/2) otherwise (GPT-NeoX).
 */
static inline void FA_FN(fa_kv_rotate)(const fa_kv_params *p, FA_REAL *x, int64_t pos)
{
    FA_REAL c[FA_MAX_HEAD_DIM / 2], s[FA_MAX_HEAD_DIM / 2];
    const int64_t half = p->rotary_dim / 2;
    FA_FN(fa_load_row)(c, p->rot_cos, pos * p->cos_rstride, half, p->dtype);
    FA_FN(fa_load_row)(s, p->rot_sin, pos * p->sin_rstride, half, p->dtype);
    if (p->rotary_interleaved) {
        for (int64_t t = 0; t < half; t++) {
            FA_REAL x0 = x[2 * t], x1 = x[2 * t + 1];
            x[2 * t] = x0 * c[t] - x1 * s[t];
            x[2 * t + 1] = x0 * s[t] + x1 * c[t];
        }
    } else {
        for (int64_t t = 0; t < half; t++) {
            FA_REAL x0 = x[t], x1 = x[t + half];
            x[t] = x0 * c[t] - x1 * s[t];
            x[t + half] = x0 * s[t] + x1 * c[t];
        }
    }
}

/*
 * Appends the new keys and values of kv head kh for every sequence, in batch order, so that
 * when two sequences share cache rows the later one's values stay whatever the thread count.
 */
static void FA_FN(fa_kv_append_head)(const fa_kv_params *p, int64_t kh)
{
    const size_t esize = fa_dtype_size(p->dtype);
    for (int64_t i = 0; i < p->b; i++) {
        for (int64_t t = 0; t < p->s_new; t++) {
            const int64_t pos = (int64_t)p->cache_seqlens[i] + t;
            const int64_t blk = fa_kv_block(p, i, pos / p->page_size);
            const int64_t row = pos % p->page_size;
            const int64_t kc = blk * p->kc_bstride + row * p->kc_rstride + kh * p->kc_hstride;
            const int64_t kn = i * p->kn_bstride + t * p->kn_rstride + kh * p->kn_hstride;
            if (p->rot_cos) {
                FA_REAL x[FA_MAX_HEAD_DIM];
                FA_FN(fa_load_row)(x, p->k_new, kn, p->d, p->dtype);
                FA_FN(fa_kv_rotate)(p, x, pos);
                FA_FN(fa_store_row)(p->k_cache, kc, x, (FA_REAL)1, p->d, p->dtype);
            } else {
                /* memmove: a caller may pass k as a view into the cache itself. */
                memmove((char *)p->k_cache + (size_t)kc * esize,
                        (const char *)p->k_new + (size_t)kn * esize, (size_t)p->d * esize);
            }
            const int64_t vc = blk * p->vc_bstride + row * p->vc_rstride + kh * p->vc_hstride;
            const int64_t vn = i * p->vn_bstride + t * p->vn_rstride + kh * p->vn_hstride;
            memmove((char *)p->v_cache + (size_t)vc * esize,
                    (const char *)p->v_new + (size_t)vn * esize, (size_t)p->dv * esize);
        }
    }
}

/* a . b over dp features (a multiple of FA_LANES, 8 or 16), summed in a fixed order. */
static inline FA_REAL FA_FN(fa_kv_dot)(const FA_REAL *restrict a, const FA_REAL *restrict b,
                                       int64_t dp)
{
    FA_REAL acc[FA_LANES];
    for (int l = 0; l < FA_LANES; l++)
        acc[l] = a[l] * b[l];
    for (int64_t c = FA_LANES; c < dp; c += FA_LANES)
        for (int l = 0; l < FA_LANES; l++)
            acc[l] += a[c + l] * b[c + l];
    /* Halving steps with constant bounds, which compilers turn into a few vector adds. */
#if FA_LANES >= 16
    for (int l = 0; l < 8; l++)
        acc[l] += acc[l + 8];
#endif
    for (int l = 0; l < 4; l++)
        acc[l] += acc[l + 4];
    for (int l = 0; l < 2; l++)
        acc[l] += acc[l + 2];
    return acc[0] + acc[1];
}

/* Asks for the cache lines of the key and value rows of heads [kh0, kh0 + nkh) at pos. */
static inline void FA_FN(fa_kv_prefetch)(const fa_kv_params *p, int64_t seq, int64_t kh0,
                                         int64_t nkh, int64_t pos)
{
#if defined(__GNUC__)
    const int64_t blk = fa_kv_block(p, seq, pos / p->page_size), row = pos % p->page_size;
    const size_t es = fa_dtype_size(p->dtype);
    for (int64_t kh = kh0; kh < kh0 + nkh; kh++) {
        const int64_t ko = blk * p->kc_bstride + row * p->kc_rstride + kh * p->kc_hstride;
        const int64_t vo = blk * p->vc_bstride + row * p->vc_rstride + kh * p->vc_hstride;
        const char *k = (const char *)p->k_cache + (size_t)ko * es;
        const char *v = (const char *)p->v_cache + (size_t)vo * es;
        for (size_t off = 0; off < (size_t)p->d * es; off += 64)
            __builtin_prefetch(k + off);
        for (size_t off = 0; off < (size_t)p->dv * es; off += 64)
            __builtin_prefetch(v + off);
    }
#else
    (void)p, (void)seq, (void)kh0, (void)nkh, (void)pos;
#endif
}

/*
 * Loads the key and value rows of heads [kh0, kh0 + nkh) at positions [pos0, pos0 + n) of
 * sequence `seq`: key j of head kh0 + e goes to row j * nkh + e of the buffers. Within a page
 * the rows are contiguous and the hardware prefetchers follow them; the next page can be
 * anywhere, so the rows FA_KV_PREFETCH positions ahead are requested early when they lie in
 * another page (and below pos_end).
 */
static inline void FA_FN(fa_kv_block_load)(const fa_kv_params *p, FA_FN(fa_kv_tile) * t,
                                           int64_t seq, int64_t kh0, int64_t nkh, int64_t pos0,
                                           int64_t n, int64_t pos_end, int64_t dp, int64_t dvp)
{
    int64_t page = pos0 / p->page_size, row = pos0 % p->page_size;
    int64_t blk = fa_kv_block(p, seq, page);
    for (int64_t j = 0; j < n; j++) {
        const int64_t ahead = pos0 + j + FA_KV_PREFETCH;
        if (ahead < pos_end && ahead / p->page_size != (pos0 + j) / p->page_size)
            FA_FN(fa_kv_prefetch)(p, seq, kh0, nkh, ahead);
        for (int64_t e = 0; e < nkh; e++) {
            const int64_t kh = kh0 + e;
            const int64_t ko = blk * p->kc_bstride + row * p->kc_rstride + kh * p->kc_hstride;
            const int64_t vo = blk * p->vc_bstride + row * p->vc_rstride + kh * p->vc_hstride;
            FA_FN(fa_load_row)(t->k + (j * nkh + e) * dp, p->k_cache, ko, p->d, p->dtype);
            FA_FN(fa_load_row)(t->v + (j * nkh + e) * dvp, p->v_cache, vo, p->dv, p->dtype);
        }
        if (++row == p->page_size && j + 1 < n) {
            row = 0;
            blk = fa_kv_block(p, seq, ++page);
        }
    }
}

/*
 * One work item: packed rows [p0, p0 + m) of (sequence, kv heads [kh0, kh0 + nkh)) against the
 * item's chunk of keys, with an online softmax. Packed row x is query row x / (nkh * g) of head
 * kh0 * g + x % (nkh * g): each key row is loaded once for all the query heads that share it,
 * and the rows of a group of kv heads sit side by side in the cache, so a thread streams
 * through contiguous memory. Writes the final out/lse when ws_o is NULL, else the normalised
 * partial output and its lse into the split workspace.
 */
FA_CPU_CLONES static void FA_FN(fa_kv_attend)(const fa_kv_params *p, FA_FN(fa_kv_tile) * t,
                                              const fa_kv_item *it, FA_REAL *ws_o,
                                              FA_REAL *ws_lse)
{
    const int64_t g = p->h / p->hk, d = p->d, dv = p->dv, sq = p->sq;
    const int64_t dp = (d + FA_LANES - 1) / FA_LANES * FA_LANES;
    const int64_t dvp = (dv + FA_LANES - 1) / FA_LANES * FA_LANES;
    const int64_t seq = it->seq, kh0 = it->kh0, nkh = it->nkh, p0 = it->p0, m = it->m;
    const int64_t per_row = nkh * g; /* packed rows per query row */
    const int64_t bn = FA_KV_BN / nkh > 0 ? FA_KV_BN / nkh : 1; /* keys per block */
    const int64_t start = fa_kv_seq_start(p, seq);
    const int64_t n = fa_kv_seq_end(p, seq) - start;
    const FA_REAL scale = (FA_REAL)p->scale;
    const FA_REAL softcap = (FA_REAL)p->softcap;
    const FA_REAL inv_softcap = p->softcap > 0 ? (FA_REAL)(1.0 / p->softcap) : 0;

    for (int64_t i = 0; i < m; i++) {
        const int64_t r = (p0 + i) / per_row, hq = kh0 * g + (p0 + i) % per_row;
        FA_REAL *q = t->q + i * dp;
        FA_FN(fa_load_row)(q, p->q, seq * p->q_bstride + r * p->q_rstride + hq * p->q_hstride,
                           d, p->dtype);
        if (p->rot_cos)
            FA_FN(fa_kv_rotate)(p, q, p->cache_seqlens[seq] + (p->rotary_per_row ? r : 0));
        for (int64_t c = 0; c < d; c++)
            q[c] *= scale;
        for (int64_t c = d; c < dp; c++)
            q[c] = 0;
        t->m[i] = -(FA_REAL)INFINITY;
        t->l[i] = 0;
        for (int64_t c = 0; c < dvp; c++)
            t->o[i * dvp + c] = 0;
        t->slope[i] = p->alibi_slopes ? (FA_REAL)p->alibi_slopes[seq * p->alibi_bstride +
                                                                 hq * p->alibi_hstride]
                                      : 0;
    }
    /* The padding of the rows stays zero: the loads below only write the first d / dv. */
    for (int64_t j = 0; j < bn * nkh; j++) {
        for (int64_t c = d; c < dp; c++)
            t->k[j * dp + c] = 0;
        for (int64_t c = dv; c < dvp; c++)
            t->v[j * dvp + c] = 0;
    }

    /* Both window edges grow with the row, so the item's keys lie between these two. */
    int64_t lo, hi, unused;
    fa_kv_key_range(p, p0 / per_row, sq, n, &lo, &unused);
    fa_kv_key_range(p, (p0 + m - 1) / per_row, sq, n, &unused, &hi);
    lo = lo > it->j0 ? lo : it->j0;
    hi = hi < it->j1 ? hi : it->j1;

    for (int64_t j0 = lo; j0 < hi; j0 += bn) {
        const int64_t nb = hi - j0 < bn ? hi - j0 : bn;
        FA_FN(fa_kv_block_load)(p, t, seq, kh0, nkh, start + j0, nb, start + hi, dp, dvp);
        for (int64_t i = 0; i < m; i++) {
            const int64_t r = (p0 + i) / per_row;
            const int64_t e = ((p0 + i) % per_row) / g; /* kv head kh0 + e */
            int64_t a, b;
            fa_kv_key_range(p, r, sq, n, &a, &b);
            a = a - j0 > 0 ? a - j0 : 0;
            b = b - j0 < nb ? b - j0 : nb;
            if (a >= b)
                continue;
            FA_REAL *s = t->s + i * FA_KV_BN;
            const FA_REAL *q = t->q + i * dp;
            const int64_t diag = r + n - sq;
            const FA_REAL slope = t->slope[i];
            FA_REAL mx = t->m[i];
            for (int64_t j = a; j < b; j++) {
                FA_REAL x = FA_FN(fa_kv_dot)(q, t->k + (j * nkh + e) * dp, dp);
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
            FA_REAL *o = t->o + i * dvp;
            if (mx > t->m[i]) {
                if (t->l[i] > 0) {
                    FA_REAL alpha = FA_EXP(t->m[i] - mx);
                    t->l[i] *= alpha;
                    for (int64_t c = 0; c < dvp; c++)
                        o[c] *= alpha;
                }
                t->m[i] = mx;
            }
            for (int64_t j = a; j < b; j++)
                s[j] = FA_EXP_LOOP(s[j] - mx);
            FA_REAL sum = 0;
            for (int64_t j = a; j < b; j++)
                sum += s[j];
            /* Four keys per pass over o: a quarter of its loads and stores, same order. */
            const int64_t vstep = nkh * dvp;
            int64_t j = a;
            for (; j + 4 <= b; j += 4) {
                const FA_REAL w0 = s[j], w1 = s[j + 1], w2 = s[j + 2], w3 = s[j + 3];
                const FA_REAL *restrict v0 = t->v + (j * nkh + e) * dvp;
                const FA_REAL *restrict v1 = v0 + vstep;
                const FA_REAL *restrict v2 = v1 + vstep;
                const FA_REAL *restrict v3 = v2 + vstep;
                for (int64_t c = 0; c < dvp; c++)
                    o[c] = o[c] + w0 * v0[c] + w1 * v1[c] + w2 * v2[c] + w3 * v3[c];
            }
            for (; j < b; j++) {
                const FA_REAL pj = s[j];
                const FA_REAL *restrict vj = t->v + (j * nkh + e) * dvp;
                for (int64_t c = 0; c < dvp; c++)
                    o[c] += pj * vj[c];
            }
            t->l[i] += sum;
        }
    }

    for (int64_t i = 0; i < m; i++) {
        const int64_t r = (p0 + i) / per_row, hq = kh0 * g + (p0 + i) % per_row;
        const FA_REAL mx = t->m[i], l = t->l[i];
        if (ws_o) {
            /* A chunk without visible keys is an empty part (lse -inf) for the combine. */
            const int64_t at = ((it->split * p->b + seq) * sq + r) * p->h + hq;
            FA_REAL inv = l > 0 ? 1 / l : 0;
            for (int64_t c = 0; c < dv; c++)
                ws_o[at * dv + c] = t->o[i * dvp + c] * inv;
            ws_lse[at] = l > 0 ? mx + FA_LOG(l) : -(FA_REAL)INFINITY;
            continue;
        }
        const FA_REAL sink = p->sinks ? (FA_REAL)p->sinks[hq * p->sinks_stride]
                                      : -(FA_REAL)INFINITY;
        const FA_REAL big = mx > sink ? mx : sink;
        FA_REAL lse, out_scale;
        if (big == -(FA_REAL)INFINITY) {
            lse = (FA_REAL)INFINITY; /* no visible key and no sink: upstream's empty row */
            out_scale = 0;
        } else {
            FA_REAL lscaled = l > 0 ? l * FA_EXP(mx - big) : 0;
            FA_REAL total = lscaled + (p->sinks ? FA_EXP(sink - big) : 0);
            lse = big + FA_LOG(total);
            out_scale = l > 0 ? FA_EXP(mx - big) / total : 0;
        }
        FA_FN(fa_store_row)(p->out, seq * p->o_bstride + r * p->o_rstride + hq * p->o_hstride,
                            t->o + i * dvp, out_scale, dv, p->dtype);
        if (p->lse) {
            int64_t at = seq * p->lse_bstride + hq * p->lse_hstride + r * p->lse_rstride;
            if (p->lse_dtype == FA_DTYPE_F64)
                ((double *)p->lse)[at] = (double)lse;
            else
                ((float *)p->lse)[at] = (float)lse;
        }
    }
}
