/*
 * The CPU backward for bf16 inputs on bf16 products (fa_cpu_bf16.h: AMX or AVX512-BF16).
 * fa_cpu_backward.c includes this after the fp32 instance of fa_cpu_bwd_body.h, whose row data,
 * dropout replay and element-wise pass it shares, so masks, ALiBi, softcap and dropout follow one
 * code; the schedule (key pass and query pass, or fused) is the fp32 path's.
 *
 * The five products of a (query tile, key block), keys on rows and queries on columns:
 *   S^T  = K Q^T    A: K rows, copied per item  B: Q^T as VNNI pairs, packed once per tile
 *   dP^T = V dO^T   A: V rows, copied per item  B: dO^T as pairs, once per tile
 *   dV  += P^T dO   A: P^T rounded to bf16      B: pairs of dO rows, once per tile
 *   dK  += dS^T Q   A: dS^T rounded             B: pairs of Q rows, once per tile
 *   dQ  += dS K     A: dS rounded, transposed   B: pairs of K rows, once per key block
 * S, dP, the softmax and every accumulator are fp32; only P and dS are rounded, to bf16, for the
 * last three products, as GPU FlashAttention does. Q is not pre-scaled, so the first product is
 * exact; the element-wise pass applies the scale. A query tile's columns are padded to mq, a
 * multiple of 32, since the tile is the depth of the dV and dK products.
 */

#if defined(FA_CPU_HAS_BF16)

/* Keys per block and query rows per tile of the key pass (the query pass's: FA_CPU_BM). They are
 * the depths of the gradient products, whose fp32 C an AMX kernel loads and stores once per
 * call, so deeper products amortise that traffic. */
#define FA_BWD_BF16_BN 128
#define FA_BWD_BF16_BM 128
_Static_assert(FA_BWD_BF16_BM >= FA_CPU_BM && FA_BWD_BF16_BM % 32 == 0,
               "the scratch holds the query pass's tiles too; tiles are whole steps of depth");

typedef struct fa_bwd_tile_bf16 {
    fa_bwd_tile_f32 f; /* lse, dsum, lo, hi, diag [BM]; pt, dxt, zt [BN][mq]; acc_k, acc_v, acc_q */
    uint32_t *qv;      /* [dk/2][BM] Q^T in VNNI pairs, dk = d rounded up to the kernels' depth */
    uint32_t *dov;     /* [dvk/2][BM] dO^T in VNNI pairs */
    uint32_t *qpair;   /* [BM/2][dp] pairs of Q rows */
    uint32_t *dopair;  /* [BM/2][dvp] pairs of dO rows */
    uint32_t *kpair;   /* [NK/2][dp] pairs of K rows */
    uint16_t *kbuf;    /* [NK][dk] the item's K rows, zero-padded */
    uint16_t *vbuf;    /* [NK][dvk] its V rows likewise */
    uint16_t *pb;      /* [BN][BM] P^T in bf16 */
    uint16_t *dsb;     /* [BN][BM] dS^T in bf16 */
    uint16_t *ds;      /* [BM][BN] dS in bf16 */
} fa_bwd_tile_bf16;

enum { FA_BWD_BF16_ROWS, FA_BWD_BF16_PT, FA_BWD_BF16_DXT, FA_BWD_BF16_ZT, FA_BWD_BF16_ACCK,
       FA_BWD_BF16_ACCV, FA_BWD_BF16_ACCQ, FA_BWD_BF16_QV, FA_BWD_BF16_DOV, FA_BWD_BF16_QPAIR,
       FA_BWD_BF16_DOPAIR, FA_BWD_BF16_KPAIR, FA_BWD_BF16_KBUF, FA_BWD_BF16_VBUF, FA_BWD_BF16_PB,
       FA_BWD_BF16_DSB, FA_BWD_BF16_DS, FA_BWD_BF16_PARTS };

/* Bytes of each scratch region (fa_cpu_scratch_layout places them). */
static void fa_bwd_bf16_part_sizes(const fa_params *p, size_t s[FA_BWD_BF16_PARTS])
{
    const size_t bm = FA_BWD_BF16_BM, bn = FA_BWD_BF16_BN, nk = FA_CPU_BWD_NK;
    const size_t dk = (size_t)fa_cpu_round_up(p->d, FA_CPU_BF16_KALIGN);
    const size_t dvk = (size_t)fa_cpu_round_up(p->dv, FA_CPU_BF16_KALIGN);
    const size_t dp = (size_t)fa_cpu_gemm_pad(p->d), dvp = (size_t)fa_cpu_gemm_pad(p->dv);
    s[FA_BWD_BF16_ROWS] = 5 * bm * 4;
    s[FA_BWD_BF16_PT] = s[FA_BWD_BF16_DXT] = s[FA_BWD_BF16_ZT] = bn * bm * 4;
    s[FA_BWD_BF16_ACCK] = nk * dp * 4;
    s[FA_BWD_BF16_ACCV] = nk * dvp * 4;
    s[FA_BWD_BF16_ACCQ] = bm * dp * 4;
    s[FA_BWD_BF16_QV] = dk / 2 * bm * 4;
    s[FA_BWD_BF16_DOV] = dvk / 2 * bm * 4;
    s[FA_BWD_BF16_QPAIR] = bm / 2 * dp * 4;
    s[FA_BWD_BF16_DOPAIR] = bm / 2 * dvp * 4;
    s[FA_BWD_BF16_KPAIR] = nk / 2 * dp * 4;
    s[FA_BWD_BF16_KBUF] = nk * dk * 2;
    s[FA_BWD_BF16_VBUF] = nk * dvk * 2;
    s[FA_BWD_BF16_PB] = s[FA_BWD_BF16_DSB] = s[FA_BWD_BF16_DS] = bn * bm * 2;
}

static size_t fa_bwd_bf16_scratch_size(const fa_params *p)
{
    size_t s[FA_BWD_BF16_PARTS];
    fa_bwd_bf16_part_sizes(p, s);
    return fa_cpu_scratch_layout(s, FA_BWD_BF16_PARTS, NULL, NULL);
}

static void fa_bwd_bf16_carve(const fa_params *p, char *base, fa_bwd_tile_bf16 *t)
{
    size_t s[FA_BWD_BF16_PARTS];
    char *at[FA_BWD_BF16_PARTS];
    fa_bwd_bf16_part_sizes(p, s);
    fa_cpu_scratch_layout(s, FA_BWD_BF16_PARTS, base, at);
    fa_bwd_tile_f32 *f = &t->f;
    float *rows = (float *)at[FA_BWD_BF16_ROWS];
    float **parts[5] = {&f->lse, &f->dsum, &f->lo, &f->hi, &f->diag};
    for (int i = 0; i < 5; i++)
        *parts[i] = rows + i * FA_BWD_BF16_BM;
    f->qt = f->qr = f->dot = f->dor = f->kbuf = f->vbuf = NULL;
    f->pt = (float *)at[FA_BWD_BF16_PT];
    f->dxt = (float *)at[FA_BWD_BF16_DXT];
    f->zt = (float *)at[FA_BWD_BF16_ZT];
    f->acc_k = (float *)at[FA_BWD_BF16_ACCK];
    f->acc_v = (float *)at[FA_BWD_BF16_ACCV];
    f->acc_q = (float *)at[FA_BWD_BF16_ACCQ];
    t->qv = (uint32_t *)at[FA_BWD_BF16_QV];
    t->dov = (uint32_t *)at[FA_BWD_BF16_DOV];
    t->qpair = (uint32_t *)at[FA_BWD_BF16_QPAIR];
    t->dopair = (uint32_t *)at[FA_BWD_BF16_DOPAIR];
    t->kpair = (uint32_t *)at[FA_BWD_BF16_KPAIR];
    t->kbuf = (uint16_t *)at[FA_BWD_BF16_KBUF];
    t->vbuf = (uint16_t *)at[FA_BWD_BF16_VBUF];
    t->pb = (uint16_t *)at[FA_BWD_BF16_PB];
    t->dsb = (uint16_t *)at[FA_BWD_BF16_DSB];
    t->ds = (uint16_t *)at[FA_BWD_BF16_DS];
}

/* Rows copied to buf, zero-padded to whole tiles (the kernels' row count and depth). Never read
 * in place: a head's rows are h * d elements apart, 8 KB at h 32, d 128, so the 16 rows of an
 * AMX tile load would all fall in one L1 set. */
static inline void fa_bwd_bf16_rows(const uint16_t *x, int64_t ld, int64_t n, int64_t cols,
                                    int64_t colsk, uint16_t *buf)
{
    const int64_t nm = fa_cpu_round_up(n, FA_CPU_BF16_MALIGN);
    for (int64_t j = 0; j < nm; j++) {
        if (j < n && cols == colsk) {
            memcpy(buf + j * colsk, x + j * ld, (size_t)cols * sizeof *buf);
            continue;
        }
        for (int64_t c = 0; c < colsk; c++)
            buf[j * colsk + c] = j < n && c < cols ? x[j * ld + c] : 0;
    }
}

/* K and V rows [j0, j0+n) of kv head hk in a sequence into kbuf and vbuf (the A operands of S^T
 * and dP^T), with pairs K's pairs into kpair too (the B operand of dQ). */
static inline void fa_bwd_bf16_load_kv(const fa_params *p, fa_bwd_tile_bf16 *t, int64_t seq_index,
                                       const fa_seq *seq, int64_t hk, int64_t j0, int64_t n,
                                       int pairs)
{
    const int64_t d = p->d, dv = p->dv;
    const uint16_t *k = (const uint16_t *)p->k + seq_index * p->k_bstride +
                        seq->k_start * p->k_rstride + hk * p->k_hstride;
    const uint16_t *v = (const uint16_t *)p->v + seq_index * p->v_bstride +
                        seq->k_start * p->v_rstride + hk * p->v_hstride;
    const int64_t dk = fa_cpu_round_up(d, FA_CPU_BF16_KALIGN);
    const int64_t dvk = fa_cpu_round_up(dv, FA_CPU_BF16_KALIGN);
    fa_bwd_bf16_rows(k + j0 * p->k_rstride, p->k_rstride, n, d, dk, t->kbuf);
    fa_bwd_bf16_rows(v + j0 * p->v_rstride, p->v_rstride, n, dv, dvk, t->vbuf);
    if (pairs)
        fa_cpu_bf16_pack_pairs(t->kpair, fa_cpu_gemm_pad(d), k + j0 * p->k_rstride, p->k_rstride,
                               n, fa_cpu_round_up(n, FA_CPU_BF16_KALIGN), d,
                               fa_cpu_gemm_pad(d));
}

/* Row data and the four packed operands of rows [r0, r0+m) of head h (mq columns). */
static void fa_bwd_bf16_pack_tile(const fa_params *p, fa_bwd_tile_bf16 *t, const float *dsum_ws,
                                  int64_t seq_index, const fa_seq *seq, int64_t h, int64_t r0,
                                  int64_t m, int64_t mq)
{
    const int64_t d = p->d, dv = p->dv, dp = fa_cpu_gemm_pad(d), dvp = fa_cpu_gemm_pad(dv);
    const uint16_t *q = (const uint16_t *)p->q + seq_index * p->q_bstride +
                        (seq->q_start + r0) * p->q_rstride + h * p->q_hstride;
    const uint16_t *dout = (const uint16_t *)p->dout_data + seq_index * p->do_bstride +
                           (seq->q_start + r0) * p->do_rstride + h * p->do_hstride;
    fa_bwd_row_info_f32(p, &t->f, dsum_ws, seq_index, seq, h, r0, m, mq);
    fa_cpu_bf16_pack_q(t->qv, mq, q, p->q_rstride, m, mq, d,
                       fa_cpu_round_up(d, FA_CPU_BF16_KALIGN));
    fa_cpu_bf16_pack_q(t->dov, mq, dout, p->do_rstride, m, mq, dv,
                       fa_cpu_round_up(dv, FA_CPU_BF16_KALIGN));
    fa_cpu_bf16_pack_pairs(t->qpair, dp, q, p->q_rstride, m, mq, d, dp);
    fa_cpu_bf16_pack_pairs(t->dopair, dvp, dout, p->do_rstride, m, mq, dv, dvp);
}

/*
 * One (query tile, key block): the block is keys [j0, j0+nb), b0 keys into kbuf's rows. Adds
 * into acc_v and acc_k (the block's key rows; NULL: not wanted) and dq ([mq][dp], the tile's rows
 * and its padding rows; NULL: not wanted).
 */
FA_CPU_AVX512 static void fa_bwd_bf16_block(const fa_params *p, const fa_cpu_bf16_kernel *kern,
                                            fa_bwd_tile_bf16 *t, int64_t seq_index, int64_t h,
                                            int64_t r0, int64_t m, int64_t mq, int64_t j0,
                                            int64_t b0, int64_t nb, float *acc_v, float *acc_k,
                                            float *dq)
{
    fa_bwd_tile_f32 *f = &t->f;
    const int64_t d = p->d, dp = fa_cpu_gemm_pad(d), dvp = fa_cpu_gemm_pad(p->dv);
    const int64_t nbm = fa_cpu_round_up(nb, FA_CPU_BF16_MALIGN);
    const int64_t nbk = fa_cpu_round_up(nb, FA_CPU_BF16_KALIGN);
    /* A full block computes every column: padding columns of the operands are zero, so they
     * come out 0 with no mask. An edge block computes the columns that see one of its keys; the
     * element-wise pass selects 0 for the rest. */
    const int full = fa_edge_full_f32(f->lo, f->hi, 0, m, j0, nb);
    int64_t c0 = 0, c1 = mq;
    if (!full) {
        fa_edge_cols_f32(f->lo, f->hi, m, j0, nb, &c0, &c1);
        if (c1 <= c0)
            return;
    }
    const int64_t dk = fa_cpu_round_up(d, FA_CPU_BF16_KALIGN);
    const int64_t dvk = fa_cpu_round_up(p->dv, FA_CPU_BF16_KALIGN);
    kern->gemm(f->pt + c0, mq, t->kbuf + b0 * dk, dk, t->qv + c0, mq, nbm, c1 - c0, dk, 0);
    kern->gemm(f->dxt + c0, mq, t->vbuf + b0 * dvk, dvk, t->dov + c0, mq, nbm, c1 - c0, dvk, 0);
    /* dV and dK over the queries, in whole steps of the kernels' depth around [c0, c1). */
    const int64_t k0 = c0 / FA_CPU_BF16_KALIGN * FA_CPU_BF16_KALIGN;
    const int64_t k1 = fa_cpu_round_up(c1, FA_CPU_BF16_KALIGN) < mq
                           ? fa_cpu_round_up(c1, FA_CPU_BF16_KALIGN)
                           : mq;
    /* P^T and dS^T, then their bf16 operands, 32 keys at a time: each slice of pt and dxt is
     * rounded while it is still in L1, where whole-block passes read it back from L2. */
    for (int64_t jb = 0; jb < nb; jb += FA_CPU_BF16_KALIGN) {
        const int64_t ns = nb - jb < FA_CPU_BF16_KALIGN ? nb - jb : FA_CPU_BF16_KALIGN;
        const int64_t nsm = nbm - jb < FA_CPU_BF16_KALIGN ? nbm - jb : FA_CPU_BF16_KALIGN;
        fa_bwd_tile_f32 slice = *f;
        slice.pt += jb * mq;
        slice.dxt += jb * mq;
        slice.zt += jb * mq;
        fa_bwd_probs_f32(p, &slice, seq_index, h, r0, m, mq, j0 + jb, ns, full,
                         (float)p->scale);
        if (acc_v)
            fa_cpu_bf16_round_rows(t->pb + jb * mq + k0, mq, slice.pt + k0, mq, ns, nsm,
                                   k1 - k0);
        if (acc_k)
            fa_cpu_bf16_round_rows(t->dsb + jb * mq + k0, mq, slice.dxt + k0, mq, ns, nsm,
                                   k1 - k0);
        if (dq)
            fa_cpu_bf16_round_t(t->ds + jb, nbk, slice.dxt + c0, mq, ns, FA_CPU_BF16_KALIGN,
                                c1 - c0);
    }
    if (acc_v)
        kern->gemm(acc_v, dvp, t->pb + k0, mq, t->dopair + k0 / 2 * dvp, dvp, nbm, dvp, k1 - k0,
                   1);
    if (acc_k)
        kern->gemm(acc_k, dp, t->dsb + k0, mq, t->qpair + k0 / 2 * dp, dp, nbm, dp, k1 - k0, 1);
    if (dq)
        kern->gemm(dq + c0 * dp, dp, t->ds, nbk, t->kpair + b0 / 2 * dp, dp, c1 - c0, dp, nbk, 1);
}

/* Key pass item (fa_bwd_keys_f32's, on bf16 products); dq_ws as there. */
FA_CPU_AVX512 static void fa_bwd_keys_bf16(const fa_params *p, const fa_cpu_bf16_kernel *kern,
                                           fa_bwd_tile_bf16 *t, const float *dsum_ws,
                                           float *dq_ws, int64_t seq_index, int64_t hk,
                                           int64_t j0, int64_t n, const fa_bwd_half *half,
                                           int64_t ci)
{
    fa_bwd_tile_f32 *f = &t->f;
    const fa_seq seq = fa_params_seq(p, seq_index);
    const int64_t dp = fa_cpu_gemm_pad(p->d), dvp = fa_cpu_gemm_pad(p->dv);
    const int64_t group = p->h / p->hk;
    for (int64_t x = 0; x < n * dp; x++)
        f->acc_k[x] = 0;
    for (int64_t x = 0; x < n * dvp; x++)
        f->acc_v[x] = 0;

    int64_t i_lo, i_hi;
    fa_bwd_row_range(p, &seq, j0, j0 + n, &i_lo, &i_hi);
    fa_bwd_half_rows(half, &i_lo, &i_hi);
    if (i_lo < i_hi) {
        kern->begin();
        fa_bwd_bf16_load_kv(p, t, seq_index, &seq, hk, j0, n, dq_ws != NULL);
        for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
            for (int64_t r0 = i_lo; r0 < i_hi; r0 += FA_BWD_BF16_BM) {
                const int64_t m = i_hi - r0 < FA_BWD_BF16_BM ? i_hi - r0 : FA_BWD_BF16_BM;
                const int64_t mq = fa_cpu_round_up(m, FA_CPU_BF16_KALIGN);
                fa_bwd_bf16_pack_tile(p, t, dsum_ws, seq_index, &seq, h, r0, m, mq);
                /* dQ of the item's blocks, summed here and then added to the workspace, whose
                 * rows are h * dp floats apart */
                float *dq = dq_ws ? f->acc_q : NULL;
                for (int64_t x = 0; dq && x < mq * dp; x++)
                    dq[x] = 0;
                for (int64_t b0 = 0; b0 < n; b0 += FA_BWD_BF16_BN) {
                    const int64_t nb = n - b0 < FA_BWD_BF16_BN ? n - b0 : FA_BWD_BF16_BN;
                    int64_t s_lo, s_hi;
                    fa_bwd_row_range(p, &seq, j0 + b0, j0 + b0 + nb, &s_lo, &s_hi);
                    if (s_hi <= r0 || s_lo >= r0 + m)
                        continue;
                    fa_bwd_bf16_block(p, kern, t, seq_index, h, r0, m, mq, j0 + b0, b0, nb,
                                      f->acc_v + b0 * dvp, f->acc_k + b0 * dp, dq);
                }
                float *ws = dq ? dq_ws + (fa_bwd_token(p, seq_index, &seq, r0) * p->h + h) * dp
                               : NULL;
                for (int64_t i = 0; dq && i < m; i++)
                    for (int64_t c = 0; c < dp; c++)
                        ws[i * p->h * dp + c] += dq[i * dp + c];
            }
        }
        kern->end();
    }

    if (half && !fa_bwd_half_meet_f32(p, half, ci, n, f->acc_k, f->acc_v))
        return;
    fa_bwd_store_kv_f32(p, seq_index, &seq, hk, j0, n, f->acc_k, f->acc_v);
}

/* Fused item (fa_bwd_fused_f32's, on bf16 products). */
static void fa_bwd_fused_bf16(const fa_params *p, const fa_cpu_bf16_kernel *kern,
                              fa_bwd_tile_bf16 *t, const float *dsum_ws, float *dq_slot,
                              int64_t seq_index, int64_t hk, int64_t stripe, int64_t stripes,
                              int64_t chunk, const fa_bwd_half *half)
{
    const fa_seq seq = fa_params_seq(p, seq_index);
    const int64_t r_lo = half ? half->r_lo : 0, r_hi = half ? half->r_hi : seq.sq;
    fa_bwd_dq_ws_zero_f32(p, dq_slot, seq_index, &seq, hk, r_lo, r_hi, stripe, stripes, chunk);
    const int64_t klen = fa_bwd_key_count(p, seq_index);
    int64_t ci = 0;
    for (int64_t j0 = stripe * chunk; j0 < klen; j0 += stripes * chunk, ci++)
        fa_bwd_keys_bf16(p, kern, t, dsum_ws, dq_slot, seq_index, hk, j0,
                         klen - j0 < chunk ? klen - j0 : chunk, half, ci);
    const int64_t group = p->h / p->hk;
    for (int64_t h = hk * group; stripes == 1 && h < (hk + 1) * group; h++)
        fa_bwd_dq_reduce_f32(p, dq_slot, 1, chunk, seq_index, h, r_lo, r_hi, t->f.acc_q);
}

/* Query pass item (fa_bwd_queries_f32's, on bf16 products). */
FA_CPU_AVX512 static void fa_bwd_queries_bf16(const fa_params *p, const fa_cpu_bf16_kernel *kern,
                                              fa_bwd_tile_bf16 *t, const float *dsum_ws,
                                              int64_t seq_index, int64_t h, int64_t r0,
                                              int64_t m)
{
    fa_bwd_tile_f32 *f = &t->f;
    const fa_seq seq = fa_params_seq(p, seq_index);
    const int64_t d = p->d, dp = fa_cpu_gemm_pad(d);
    const int64_t mq = fa_cpu_round_up(m, FA_CPU_BF16_KALIGN);
    const int64_t hk = h / (p->h / p->hk);
    for (int64_t x = 0; x < FA_CPU_BM * dp; x++)
        f->acc_q[x] = 0;
    kern->begin();
    fa_bwd_bf16_pack_tile(p, t, dsum_ws, seq_index, &seq, h, r0, m, mq);
    int64_t k_lo, k_hi;
    fa_params_tile_keys(p, r0, m, seq.sq, seq.sk, &k_lo, &k_hi);
    for (int64_t j0 = k_lo; j0 < k_hi; j0 += FA_BWD_BF16_BN) {
        const int64_t n = k_hi - j0 < FA_BWD_BF16_BN ? k_hi - j0 : FA_BWD_BF16_BN;
        fa_bwd_bf16_load_kv(p, t, seq_index, &seq, hk, j0, n, 1);
        fa_bwd_bf16_block(p, kern, t, seq_index, h, r0, m, mq, j0, 0, n, NULL, NULL,
                          f->acc_q);
    }
    kern->end();

    const int64_t dq_base =
        seq_index * p->dq_bstride + seq.q_start * p->dq_rstride + h * p->dq_hstride;
    for (int64_t i = 0; i < m; i++)
        fa_store_row_f32(p->dq_data, dq_base + (r0 + i) * p->dq_rstride, f->acc_q + i * dp, 1, d,
                         p->dtype);
}

#endif /* FA_CPU_HAS_BF16 */
