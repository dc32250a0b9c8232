/*
 * The KV-cache attention of one work item for one compute precision (the append before it is
 * fa_cpu_decode_append.h's). fa_cpu_decode.c includes this file twice, with FA_REAL float (fp32,
 * fp16, bf16, fp8 caches) and double (fp64).
 *
 * Needs: FA_REAL, FA_FN(name), FA_NATIVE (the fa_dtype that is FA_REAL), FA_GEMM
 * (fa_cpu_gemm_f32's signature for FA_REAL), FA_EXP, FA_EXP_LOOP (an exp the compiler
 * vectorises in a loop, for x <= 0), FA_TANH, FA_LOG, FA_LANES (8 or 16 partial sums of a dot
 * product, a multiple of the SIMD width, so that the dot loop vectorises without reassociating
 * a sum), FA_KV_BM, FA_KV_BN, FA_KV_PREFETCH, fa_kv_item, fa_kv_seq_get, fa_kv_block_keys,
 * fa_kv_form (FA_KV_FORM_*), fa_cpu_rows.h and fa_cpu_decode_append.h (fa_kv_descale) included
 * for this precision.
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

typedef FA_REAL FA_FN(fa_kv_vec) __attribute__((vector_size(FA_LANES * sizeof(FA_REAL))));
typedef FA_REAL FA_FN(fa_kv_half) __attribute__((vector_size(FA_LANES / 2 * sizeof(FA_REAL))));
typedef FA_REAL FA_FN(fa_kv_quarter) __attribute__((vector_size(FA_LANES / 4 * sizeof(FA_REAL))));

/* The lanes of acc folded to one sum by halving: lane l + w onto lane l for w = FA_LANES / 2,
 * ..., 1. Every score is folded in this order, whichever path computed it. */
FA_CPU_INLINE FA_REAL FA_FN(fa_kv_fold)(const FA_FN(fa_kv_vec) * acc)
{
    FA_FN(fa_kv_half) h0, h1;
    memcpy(&h0, acc, sizeof h0);
    memcpy(&h1, (const char *)acc + sizeof h0, sizeof h1);
    h0 += h1;
    FA_FN(fa_kv_quarter) q0, q1;
    memcpy(&q0, &h0, sizeof q0);
    memcpy(&q1, (const char *)&h0 + sizeof q0, sizeof q1);
    q0 += q1;
    FA_REAL r[FA_LANES / 4];
    memcpy(r, &q0, sizeof r);
    for (int w = FA_LANES / 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++)
            r[l] += r[l + w];
    return r[0];
}

#if FA_LANES == 16
/* fa_kv_fold of 16 accumulators at once: lane i of the result is v[i]'s sum, in the same
 * order. Each level pairs two vectors and adds their lanes l and l + w with two two-source
 * shuffles and one add, so 16 sums cost 45 vector operations where 16 single folds cost ~130. */
FA_CPU_INLINE void FA_FN(fa_kv_fold16)(const FA_FN(fa_kv_vec) * v, FA_FN(fa_kv_vec) * out)
{
    FA_FN(fa_kv_vec) w[8], z[4], y[2];
    for (int k = 0; k < 8; k++) /* w[k] = [v[2k] halved | v[2k+1] halved] */
        w[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * k], v[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int k = 0; k < 4; k++) /* z[k]: v[4k .. 4k+3] in 4 lanes each */
        z[k] = __builtin_shufflevector(w[2 * k], w[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(w[2 * k], w[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                       22, 23, 28, 29, 30, 31);
    for (int k = 0; k < 2; k++) /* y[k]: v[8k .. 8k+7] in 2 lanes each */
        y[k] = __builtin_shufflevector(z[2 * k], z[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(z[2 * k], z[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                       22, 23, 26, 27, 30, 31);
    *out = __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                   28, 30) +
           __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                   29, 31);
}
#endif

/* Elements [at, at + FA_LANES) of the rows k into x, stored as form (fa_kv_form): FA_REAL, or
 * bf16 or fp8 (fp32 builds only) widened in registers, which is exact, so a result does not
 * depend on where its rows came from. */
FA_CPU_INLINE void FA_FN(fa_kv_load_chunk)(FA_FN(fa_kv_vec) * x, const void *k, int64_t at,
                                           int form)
{
    if (form == FA_KV_FORM_BF16) {
        const uint16_t *src = (const uint16_t *)k + at;
        for (int l = 0; l < FA_LANES; l++)
            (*x)[l] = (FA_REAL)fa_bf16_to_f32(src[l]);
#if FA_LANES == 16
    } else if (form == FA_KV_FORM_E4M3 || form == FA_KV_FORM_E5M2) {
        fa_fp8_widen16(x, (const uint8_t *)k + at, form == FA_KV_FORM_E4M3);
#endif
    } else {
        memcpy(x, (const FA_REAL *)k + at, sizeof *x);
    }
}

/*
 * q . (the key row at element k0 of k) over dp features (a multiple of FA_LANES, 8 or 16),
 * summed in a fixed order. The lanes are folded in halves as vectors: written as array loops,
 * compilers reduced them one scalar at a time, which cost more than the products.
 */
FA_CPU_INLINE FA_REAL FA_FN(fa_kv_dot)(const FA_REAL *restrict q, const void *k, int64_t k0,
                                       int64_t dp, int form)
{
    FA_FN(fa_kv_vec) acc, x, y;
    memcpy(&y, q, sizeof y);
    FA_FN(fa_kv_load_chunk)(&x, k, k0, form);
    acc = x * y;
    for (int64_t c = FA_LANES; c < dp; c += FA_LANES) {
        memcpy(&y, q + c, sizeof y);
        FA_FN(fa_kv_load_chunk)(&x, k, k0 + c, form);
        acc += x * y;
    }
    return FA_FN(fa_kv_fold)(&acc);
}

/*
 * Scores of 4 query heads that share a kv head (q: 4 rows of dp, row stride dp) against keys
 * [a, b) (key j at element k0 + j * k_js of k, stored as form), into s (row stride
 * FA_KV_BN): each key row is read once for the 4 heads, four or two keys at a time, instead of
 * once per head. Per (key, head) the products are summed lane-wise in feature order and folded
 * as fa_kv_dot does.
 */
FA_CPU_INLINE void FA_FN(fa_kv_dots4)(const FA_REAL *restrict q, const void *k, int64_t k0,
                                      int64_t k_js, int64_t a, int64_t b, int64_t dp,
                                      FA_REAL *restrict s, int form)
{
    int64_t j = a;
#if FA_LANES == 16
    /* Four keys at a time: each K and q chunk loaded feeds 4 products (2 with two keys), and
     * the 16 sums fold together. */
    for (; j + 3 < b; j += 4) {
        FA_FN(fa_kv_vec) acc[16], x[4], y; /* acc[4 h + t]: head h, key j + t */
        for (int u = 0; u < 16; u++)
            acc[u] = (FA_FN(fa_kv_vec)){0};
        for (int64_t c = 0; c < dp; c += FA_LANES) {
            for (int t = 0; t < 4; t++)
                FA_FN(fa_kv_load_chunk)(&x[t], k, k0 + (j + t) * k_js + c, form);
            for (int h = 0; h < 4; h++) {
                memcpy(&y, q + h * dp + c, sizeof y);
                for (int t = 0; t < 4; t++)
                    acc[4 * h + t] += x[t] * y;
            }
        }
        FA_FN(fa_kv_vec) sums;
        FA_FN(fa_kv_fold16)(acc, &sums);
        for (int h = 0; h < 4; h++)
            memcpy(s + h * FA_KV_BN + j, (const FA_REAL *)&sums + 4 * h, 4 * sizeof(FA_REAL));
    }
#endif
    for (; j + 1 < b; j += 2) {
        FA_FN(fa_kv_vec) acc[2][4], x0, x1, y;
        for (int h = 0; h < 4; h++)
            for (int t = 0; t < 2; t++)
                acc[t][h] = (FA_FN(fa_kv_vec)){0};
        for (int64_t c = 0; c < dp; c += FA_LANES) {
            FA_FN(fa_kv_load_chunk)(&x0, k, k0 + j * k_js + c, form);
            FA_FN(fa_kv_load_chunk)(&x1, k, k0 + (j + 1) * k_js + c, form);
            for (int h = 0; h < 4; h++) {
                memcpy(&y, q + h * dp + c, sizeof y);
                acc[0][h] += x0 * y;
                acc[1][h] += x1 * y;
            }
        }
        for (int h = 0; h < 4; h++) {
            s[h * FA_KV_BN + j] = FA_FN(fa_kv_fold)(&acc[0][h]);
            s[h * FA_KV_BN + j + 1] = FA_FN(fa_kv_fold)(&acc[1][h]);
        }
    }
    for (; j < b; j++)
        for (int h = 0; h < 4; h++)
            s[h * FA_KV_BN + j] = FA_FN(fa_kv_dot)(q + h * dp, k, k0 + j * k_js, dp, form);
}

/* The scores of packed rows [i, i1), which share kv head e and keys [a, b) of the block, as
 * fa_kv_dots4 computes them (form a constant at each call, so that each variant is compiled
 * without the test). */
FA_CPU_INLINE void FA_FN(fa_kv_run_scores)(FA_FN(fa_kv_tile) * t, int64_t i, int64_t i1,
                                           const void *k, int64_t k0, int64_t k_js, int64_t a,
                                           int64_t b, int64_t dp, int form)
{
    int64_t x = i;
    for (; x + 4 <= i1; x += 4)
        FA_FN(fa_kv_dots4)(t->q + x * dp, k, k0, k_js, a, b, dp, t->s + x * FA_KV_BN, form);
    for (; x < i1; x++)
        for (int64_t j = a; j < b; j++)
            t->s[x * FA_KV_BN + j] = FA_FN(fa_kv_dot)(t->q + x * dp, k, k0 + j * k_js, dp, form);
}

/*
 * O += P V for 4 packed rows (o, pr: row strides ldo, ldp) over keys [a, b) of value rows read
 * in place (key j at element v0 + j * v_js of v, stored as form), dvp a multiple of
 * 4 * FA_LANES: each stripe of 4 vectors of the 4 rows stays in 16 registers across the keys,
 * key by key as the P V micro-kernel goes. Inlined, it beats a call to the micro-kernel on
 * these short products (4 rows, 16 keys), and bf16 or fp8 values are widened in registers
 * instead of converted into the tile first.
 */
FA_CPU_INLINE void FA_FN(fa_kv_pv4)(FA_REAL *o, int64_t ldo, const FA_REAL *pr, int64_t ldp,
                                    const void *v, int64_t v0, int64_t v_js, int64_t a, int64_t b,
                                    int64_t dvp, int form)
{
    for (int64_t c0 = 0; c0 < dvp; c0 += 4 * FA_LANES) {
        FA_FN(fa_kv_vec) acc[4][4], x[4];
        for (int r = 0; r < 4; r++)
            for (int u = 0; u < 4; u++)
                memcpy(&acc[r][u], o + r * ldo + c0 + u * FA_LANES, sizeof acc[r][u]);
        for (int64_t j = a; j < b; j++) {
            for (int u = 0; u < 4; u++)
                FA_FN(fa_kv_load_chunk)(&x[u], v, v0 + j * v_js + c0 + u * FA_LANES, form);
            for (int r = 0; r < 4; r++) {
                const FA_REAL pj = pr[r * ldp + j];
                for (int u = 0; u < 4; u++)
                    acc[r][u] += pj * x[u];
            }
        }
        for (int r = 0; r < 4; r++)
            for (int u = 0; u < 4; u++)
                memcpy(o + r * ldo + c0 + u * FA_LANES, &acc[r][u], sizeof acc[r][u]);
    }
}

/* fa_kv_run_scores and fa_kv_pv4 for rows stored as form, a constant in each call below, so
 * that each variant is compiled without the tests of the form. */
FA_CPU_INLINE void FA_FN(fa_kv_run_scores_as)(FA_FN(fa_kv_tile) * t, int64_t i, int64_t i1,
                                              const void *k, int64_t k0, int64_t k_js, int64_t a,
                                              int64_t b, int64_t dp, int form)
{
    if (form == FA_KV_FORM_BF16)
        FA_FN(fa_kv_run_scores)(t, i, i1, k, k0, k_js, a, b, dp, FA_KV_FORM_BF16);
    else if (form == FA_KV_FORM_E4M3)
        FA_FN(fa_kv_run_scores)(t, i, i1, k, k0, k_js, a, b, dp, FA_KV_FORM_E4M3);
    else if (form == FA_KV_FORM_E5M2)
        FA_FN(fa_kv_run_scores)(t, i, i1, k, k0, k_js, a, b, dp, FA_KV_FORM_E5M2);
    else
        FA_FN(fa_kv_run_scores)(t, i, i1, k, k0, k_js, a, b, dp, FA_KV_FORM_REAL);
}

FA_CPU_INLINE void FA_FN(fa_kv_pv4_as)(FA_REAL *o, int64_t ldo, const FA_REAL *pr, int64_t ldp,
                                       const void *v, int64_t v0, int64_t v_js, int64_t a,
                                       int64_t b, int64_t dvp, int form)
{
    if (form == FA_KV_FORM_BF16)
        FA_FN(fa_kv_pv4)(o, ldo, pr, ldp, v, v0, v_js, a, b, dvp, FA_KV_FORM_BF16);
    else if (form == FA_KV_FORM_E4M3)
        FA_FN(fa_kv_pv4)(o, ldo, pr, ldp, v, v0, v_js, a, b, dvp, FA_KV_FORM_E4M3);
    else if (form == FA_KV_FORM_E5M2)
        FA_FN(fa_kv_pv4)(o, ldo, pr, ldp, v, v0, v_js, a, b, dvp, FA_KV_FORM_E5M2);
    else
        FA_FN(fa_kv_pv4)(o, ldo, pr, ldp, v, v0, v_js, a, b, dvp, FA_KV_FORM_REAL);
}

/* Asks for the cache lines of the key and value rows of heads [kh0, kh0 + nkh) at pos. */
FA_CPU_INLINE void FA_FN(fa_kv_prefetch)(const fa_params *p, int64_t seq, int64_t kh0,
                                         int64_t nkh, int64_t pos)
{
#if defined(__GNUC__)
    const int64_t blk = fa_kv_block(p, seq, pos / p->page_size), row = pos % p->page_size;
    const size_t es = fa_dtype_size(p->kv_dtype);
    for (int64_t kh = kh0; kh < kh0 + nkh; kh++) {
        const int64_t ko = fa_kv_k_at(p, blk, row, kh);
        const int64_t vo = fa_kv_v_at(p, blk, row, kh);
        const char *k = (const char *)p->k + (ptrdiff_t)ko * (ptrdiff_t)es;
        const char *v = (const char *)p->v + (ptrdiff_t)vo * (ptrdiff_t)es;
        for (size_t off = 0; off < (size_t)p->d * es; off += 64)
            __builtin_prefetch(k + off);
        for (size_t off = 0; off < (size_t)p->dv * es; off += 64)
            __builtin_prefetch(v + off);
    }
#else
    (void)p, (void)seq, (void)kh0, (void)nkh, (void)pos;
#endif
}

/* Probabilities x[0 .. n) rounded to dtype (fp16 or bf16) and back. */
FA_CPU_INLINE void FA_FN(fa_kv_round_row)(FA_REAL *x, int64_t n, fa_dtype dtype)
{
    if (dtype == FA_DTYPE_BF16)
        for (int64_t j = 0; j < n; j++)
            x[j] = (FA_REAL)fa_bf16_to_f32(fa_f32_to_bf16((float)x[j]));
    else
        for (int64_t j = 0; j < n; j++)
            x[j] = (FA_REAL)fa_f16_to_f32(fa_f32_to_f16((float)x[j]));
}

/*
 * Asks for the key and value rows of kv head kh at rows [row, row + n) of cache block blk,
 * into L2 (prefetcht1), a line at a time. Each run of a block calls it for its own head, some
 * blocks ahead, so the requests spread over the block's work rather than coming in one burst
 * at its start; L2 is the level that paid (L1 and non-temporal requests did not).
 */
FA_CPU_INLINE void FA_FN(fa_kv_prefetch_run)(const fa_params *p, int64_t blk, int64_t row,
                                             int64_t kh, int64_t n)
{
#if defined(__GNUC__)
    const size_t es = fa_dtype_size(p->kv_dtype);
    const char *k = (const char *)p->k + (ptrdiff_t)fa_kv_k_at(p, blk, row, kh) * (ptrdiff_t)es;
    const char *v = (const char *)p->v + (ptrdiff_t)fa_kv_v_at(p, blk, row, kh) * (ptrdiff_t)es;
    const size_t k_span = (size_t)p->d * es, v_span = (size_t)p->dv * es;
    const size_t k_step = (size_t)p->k_rstride * es, v_step = (size_t)p->v_rstride * es;
    for (int64_t j = 0; j < n; j++, k += k_step, v += v_step) {
        for (size_t off = 0; off < k_span; off += 64)
            __builtin_prefetch(k + off, 0, 1);
        for (size_t off = 0; off < v_span; off += 64)
            __builtin_prefetch(v + off, 0, 1);
    }
#else
    (void)p, (void)blk, (void)row, (void)kh, (void)n;
#endif
}

/*
 * Loads the key and value rows of heads [kh0, kh0 + nkh) at positions [pos0, pos0 + n) of
 * sequence `seq`: key j of head kh0 + e goes to row j * nkh + e of the buffers. Within a page
 * the rows are contiguous and the hardware prefetchers follow them; the next page can be
 * anywhere, so the rows FA_KV_PREFETCH positions ahead are requested early when they lie in
 * another page (and below pos_end).
 */
FA_CPU_INLINE void FA_FN(fa_kv_block_load)(const fa_params *p, FA_FN(fa_kv_tile) * t,
                                           int64_t seq, int64_t kh0, int64_t nkh, int64_t pos0,
                                           int64_t n, int64_t pos_end, int64_t dp, int64_t dvp,
                                           int load_k, int load_v)
{
    int64_t page = pos0 / p->page_size, row = pos0 % p->page_size;
    int64_t blk = fa_kv_block(p, seq, page);
    for (int64_t j = 0; j < n; j++) {
        const int64_t ahead = pos0 + j + FA_KV_PREFETCH;
        if (ahead < pos_end && ahead / p->page_size != (pos0 + j) / p->page_size)
            FA_FN(fa_kv_prefetch)(p, seq, kh0, nkh, ahead);
        for (int64_t e = 0; e < nkh; e++) {
            const int64_t kh = kh0 + e;
            const int64_t ko = fa_kv_k_at(p, blk, row, kh);
            const int64_t vo = fa_kv_v_at(p, blk, row, kh);
            if (load_k)
                FA_FN(fa_load_row)(t->k + (j * nkh + e) * dp, p->k, ko, p->d, p->kv_dtype);
            if (load_v)
                FA_FN(fa_load_row)(t->v + (j * nkh + e) * dvp, p->v, vo, p->dv, p->kv_dtype);
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
 * partial output and its lse into the split workspace of ws_rows query rows a split.
 */
FA_CPU_CLONES static void FA_FN(fa_kv_attend)(const fa_params *p, FA_FN(fa_kv_tile) * t,
                                              const fa_kv_item *it, FA_REAL *ws_o,
                                              FA_REAL *ws_lse, int64_t ws_rows, int stream)
{
    const fa_kv_seq sg = fa_kv_seq_get(p, it->seq);
    const int64_t g = p->h / p->hk, d = p->d, dv = p->dv, sq = sg.sq;
    const int64_t dp = (d + FA_LANES - 1) / FA_LANES * FA_LANES;
    const int64_t dvp = (dv + FA_LANES - 1) / FA_LANES * FA_LANES;
    const int64_t seq = it->seq, kh0 = it->kh0, nkh = it->nkh, p0 = it->p0, m = it->m;
    const int64_t per_row = nkh * g; /* packed rows per query row */
    const int64_t bn = fa_kv_block_keys(p, nkh);
    const int64_t start = sg.k0, n = sg.n;
    const FA_REAL softcap = (FA_REAL)p->softcap;
    const FA_REAL inv_softcap = p->softcap > 0 ? (FA_REAL)(1.0 / p->softcap) : 0;

    for (int64_t i = 0; i < m; i++) {
        const int64_t r = (p0 + i) / per_row, hq = kh0 * g + (p0 + i) % per_row;
        /* An fp8 cache's k_descale joins the softmax scale, as the GPU folds it. */
        const float kd =
            FA_FN(fa_kv_descale)(p->k_descale, p->kd_bstride, p->kd_hstride, seq, hq / g);
        const FA_REAL scale = (FA_REAL)(p->scale * kd);
        FA_REAL *q = t->q + i * dp;
        FA_FN(fa_load_row)(q, p->q,
                           seq * p->q_bstride + (sg.q0 + r) * p->q_rstride + hq * p->q_hstride,
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
    fa_params_key_range(p, p0 / per_row, sq, n, &lo, &unused);
    fa_params_key_range(p, (p0 + m - 1) / per_row, sq, n, &unused, &hi);
    lo = lo > it->j0 ? lo : it->j0;
    hi = hi < it->j1 ? hi : it->j1;

    /* Cache rows already in FA_REAL without padding are read in place when a block lies in one
     * page: key j of kv head kh0 + e is at element j * k_js + e * k_es of kb, likewise for
     * values. So are bf16 and fp8 key rows in fp32 builds, widened in registers where the
     * scores read them: a conversion into the tile first would cost more than the products. */
    const int native = p->kv_dtype == FA_NATIVE;
    const int form = FA_LANES == 16 ? fa_kv_form(p->kv_dtype) : FA_KV_FORM_REAL;
    const int k_native = native && d == dp, v_native = native && dv == dvp;
    /* fp8 rows cost more to widen than bf16 rows: in place only where each is widened once a
     * block (one query row and g = 4: one fa_kv_dots4 and one fa_kv_pv4 per kv head), else
     * into the tile once for all the runs that read them. */
    const int fp8_once = g == 4 && sq == 1;
    const int k_wide = form != FA_KV_FORM_REAL && d == dp &&
                       (form == FA_KV_FORM_BF16 || fp8_once);
    const size_t es = fa_dtype_size(p->kv_dtype);
    /* With an fp8 cache and an fp16 / bf16 q, P enters P V rounded to fp16, as the GPU's fp16
     * mma takes it whatever q's dtype (the row sums take it unrounded). */
    const int p_round = p->kv_dtype != p->dtype &&
                        (p->dtype == FA_DTYPE_F16 || p->dtype == FA_DTYPE_BF16);
    /* Values read in place take fa_kv_pv4 where it applies: runs of packed rows are g long (or
     * cut at the item's end, a multiple of FA_KV_BM), so g % 4 == 0 makes them fours. bf16 and
     * fp8 values are read in place only there. */
    const int pv4 = dvp % (4 * FA_LANES) == 0 && g % 4 == 0;
    const int v_wide = k_wide && dv == dvp && pv4;
    for (int64_t j0 = lo; j0 < hi; j0 += bn) {
        const int64_t nb = hi - j0 < bn ? hi - j0 : bn;
        const int64_t pos0 = start + j0, page = pos0 / p->page_size;
        const int one_page = page == (pos0 + nb - 1) / p->page_size;
        const int64_t blk = fa_kv_block(p, seq, page), row = pos0 % p->page_size;
        const void *kb = t->k, *vb = t->v;
        int64_t k_js = nkh * dp, k_es = dp, v_js = nkh * dvp, v_es = dvp;
        const int k_in_place = (k_native || k_wide) && one_page;
        const int v_in_place = (v_native || v_wide) && one_page;
        /* How the rows the scores and fa_kv_pv4 read are stored: the tile is FA_REAL. */
        const int k_form = k_wide && one_page ? form : FA_KV_FORM_REAL;
        const int v_form = v_wide && one_page ? form : FA_KV_FORM_REAL;
        const int v_pv4 = v_in_place && pv4;
        if (k_in_place) {
            kb = (const char *)p->k + (ptrdiff_t)fa_kv_k_at(p, blk, row, kh0) * (ptrdiff_t)es;
            k_js = p->k_rstride;
            k_es = p->k_hstride;
        }
        if (v_in_place) {
            vb = (const char *)p->v + (ptrdiff_t)fa_kv_v_at(p, blk, row, kh0) * (ptrdiff_t)es;
            v_js = p->v_rstride;
            v_es = p->v_hstride;
        }
        if (!k_in_place || !v_in_place)
            FA_FN(fa_kv_block_load)(p, t, seq, kh0, nkh, pos0, nb, start + hi, dp, dvp,
                                    !k_in_place, !v_in_place);
        /* Raw scores, per run of packed rows that share a query row and a kv head (the same
         * keys): 4 heads at a time read each key row once. */
        for (int64_t i = 0, i1; i < m; i = i1) {
            int64_t e, a, b; /* kv head kh0 + e, keys [a, b) of the block */
            i1 = fa_kv_run(p, p0, per_row, g, m, i, sq, n, j0, nb, &e, &a, &b);
            if (stream && row + (FA_KV_PREFETCH_BLOCKS + 1) * bn <= p->page_size &&
                j0 + (FA_KV_PREFETCH_BLOCKS + 1) * bn <= hi)
                FA_FN(fa_kv_prefetch_run)(p, blk, row + FA_KV_PREFETCH_BLOCKS * bn, kh0 + e, bn);
            FA_FN(fa_kv_run_scores_as)(t, i, i1, kb, e * k_es, k_js, a, b, dp, k_form);
        }
        for (int64_t i = 0; i < m; i++) {
            const int64_t r = (p0 + i) / per_row;
            int64_t a, b;
            fa_params_key_range(p, r, sq, n, &a, &b);
            a = a - j0 > 0 ? a - j0 : 0;
            b = b - j0 < nb ? b - j0 : nb;
            if (a >= b)
                continue;
            FA_REAL *s = t->s + i * FA_KV_BN;
            const int64_t diag = r + n - sq;
            const FA_REAL slope = t->slope[i];
            FA_REAL mx = t->m[i];
            for (int64_t j = a; j < b; j++) {
                FA_REAL x = s[j];
                if (softcap > 0)
                    x = FA_RULE_SOFTCAP(x, inv_softcap, softcap, FA_TANH);
                if (slope != 0) {
                    int64_t dist = diag - (j0 + j);
                    x -= slope * (FA_REAL)FA_RULE_ABS_DIST(dist); /* ALiBi */
                }
                s[j] = x;
                if (x > mx)
                    mx = x;
            }
            if (mx > t->m[i]) {
                FA_REAL *o = t->o + i * dvp;
                if (t->l[i] > 0) {
                    FA_REAL alpha = FA_EXP(t->m[i] - mx);
                    t->l[i] *= alpha;
                    for (int64_t c = 0; c < dvp; c++)
                        o[c] *= alpha;
                }
                t->m[i] = mx;
            }
            /* Scores all -inf so far (a +-inf in q or k): subtract 0, exp(-inf) = 0, an empty row
             * as the forward makes it, not exp(-inf - -inf) = NaN. */
            const FA_REAL base = mx == -(FA_REAL)INFINITY ? 0 : mx;
            for (int64_t j = a; j < b; j++)
                s[j] = FA_EXP_LOOP(s[j] - base);
            /* Summed in FA_LANES partial sums, not as one serial chain of adds per row and
             * block, whose latency would dominate this short loop. */
            FA_FN(fa_kv_vec) part = {0}, chunk;
            int64_t j = a;
            for (; j + FA_LANES <= b; j += FA_LANES) {
                memcpy(&chunk, s + j, sizeof chunk);
                part += chunk;
            }
            FA_REAL sum = FA_FN(fa_kv_fold)(&part);
            for (; j < b; j++)
                sum += s[j];
            t->l[i] += sum;
            if (p_round)
                FA_FN(fa_kv_round_row)(s + a, b - a, FA_DTYPE_F16);
        }
        /* O += P V for each run of packed rows that share a query row and a kv head (the g
         * heads of one kv head: the same keys, the same V rows): fa_kv_pv4 on values read in
         * place, else the micro-kernels. */
        for (int64_t i = 0, i1; i < m; i = i1) {
            int64_t e, a, b;
            i1 = fa_kv_run(p, p0, per_row, g, m, i, sq, n, j0, nb, &e, &a, &b);
            if (a >= b)
                continue;
            for (int64_t x = i; v_pv4 && x < i1; x += 4)
                FA_FN(fa_kv_pv4_as)(t->o + x * dvp, dvp, t->s + x * FA_KV_BN, FA_KV_BN, vb,
                                    e * v_es, v_js, a, b, dvp, v_form);
            if (!v_pv4)
                FA_GEMM(t->o + i * dvp, dvp, t->s + i * FA_KV_BN + a, FA_KV_BN, 1,
                        (const FA_REAL *)vb + a * v_js + e * v_es, v_js, i1 - i, dvp, b - a, 1);
        }
    }

    for (int64_t i = 0; i < m; i++) {
        const int64_t r = (p0 + i) / per_row, hq = kh0 * g + (p0 + i) % per_row;
        const FA_REAL mx = t->m[i], l = t->l[i];
        /* An fp8 cache's v_descale joins the final normalisation. */
        const FA_REAL vd = (FA_REAL)FA_FN(fa_kv_descale)(p->v_descale, p->vd_bstride,
                                                         p->vd_hstride, seq, hq / g);
        if (ws_o) {
            /* A chunk without visible keys is an empty part (lse -inf) for the combine. */
            const int64_t at = (it->split * ws_rows + sg.ws + r) * p->h + hq;
            FA_REAL inv = l > 0 || l != l ? vd / l : 0; /* NaN: a NaN part, NaN lse below */
            for (int64_t c = 0; c < dv; c++)
                ws_o[at * dv + c] = t->o[i * dvp + c] * inv;
            ws_lse[at] = l > 0 || l != l ? mx + FA_LOG(l) : -(FA_REAL)INFINITY;
            continue;
        }
        const FA_REAL sink = p->sinks ? (FA_REAL)p->sinks[hq * p->sinks_stride]
                                      : -(FA_REAL)INFINITY;
        const FA_REAL big = mx > sink ? mx : sink;
        FA_REAL lse, out_scale;
        if (l != l) {
            lse = out_scale = l; /* a NaN score reached the sum: the whole row is NaN */
        } else if (big == -(FA_REAL)INFINITY) {
            lse = (FA_REAL)INFINITY; /* no visible key and no sink: upstream's empty row */
            out_scale = 0;
        } else {
            FA_REAL lscaled = l > 0 ? l * FA_EXP(mx - big) : 0;
            FA_REAL total = FA_RULE_SINK_TOTAL(lscaled, p->sinks, sink, big, FA_EXP);
            lse = big + FA_LOG(total);
            out_scale = l > 0 ? vd * FA_EXP(mx - big) / total : 0;
        }
        FA_FN(fa_store_row)(p->out,
                            seq * p->o_bstride + (sg.q0 + r) * p->o_rstride + hq * p->o_hstride,
                            t->o + i * dvp, out_scale, dv, p->dtype);
        if (p->lse)
            fa_params_lse_store(p,
                                seq * p->lse_bstride + hq * p->lse_hstride +
                                    (sg.q0 + r) * p->lse_rstride,
                                (double)lse);
    }
}
