/*
 * The KV-cache append for one compute precision: each new key row rotated (rotary, interleaved
 * or not) and written into the cache in place, fp8 caches rounded by their descale.
 * fa_cpu_decode.c includes this file twice, before fa_cpu_decode_body.h, with FA_REAL float and
 * double.
 *
 * Needs: FA_REAL, FA_FN(name), fa_kv_block, fa_kv_k_at, fa_kv_v_at, and fa_cpu_rows.h included
 * for this precision.
 */

/*
 * Rotates the first rotary_dim features of x by the angles of row pos of cos/sin: pairs
 * (2t, 2t+1) interleaved (GPT-J), (t, t + rotary_dim/2) otherwise (GPT-NeoX).
 */
FA_CPU_INLINE void FA_FN(fa_kv_rotate)(const fa_params *p, FA_REAL *x, int64_t pos)
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

/* The fp8 descale d[i, kh] of a KV cache (FP8 in include/flashattn.h), 1 without one. */
FA_CPU_INLINE float FA_FN(fa_kv_descale)(const float *d, int64_t bstride, int64_t hstride,
                                         int64_t i, int64_t kh)
{
    return d ? d[i * bstride + kh * hstride] : 1.0f;
}

/* A new row of n elements at element `at` of an fp8 cache: x / descale in fp32, rounded as
 * fa_fp8_from_f32 rounds. */
FA_CPU_INLINE void FA_FN(fa_kv_store_fp8)(const fa_params *p, void *cache, int64_t at,
                                          const FA_REAL *x, int64_t n, float descale)
{
    uint8_t *dst = (uint8_t *)cache + at;
    for (int64_t c = 0; c < n; c++) {
        const float y = (float)x[c] / descale;
        dst[c] = p->kv_dtype == FA_DTYPE_F8E4M3 ? fa_f32_to_e4m3(y) : fa_f32_to_e5m2(y);
    }
}

/* Appends new row t of sequence i, kv head kh, to fp8 caches (rotating the key in FA_REAL). */
static void FA_FN(fa_kv_append_fp8)(const fa_params *p, int64_t i, int64_t t, int64_t kh,
                                    int64_t blk, int64_t row, int64_t pos)
{
    FA_REAL x[FA_MAX_HEAD_DIM];
    const int64_t kn = i * p->knew_bstride + t * p->knew_rstride + kh * p->knew_hstride;
    FA_FN(fa_load_row)(x, p->knew, kn, p->d, p->dtype);
    if (p->rot_cos)
        FA_FN(fa_kv_rotate)(p, x, pos);
    FA_FN(fa_kv_store_fp8)(p, p->k, fa_kv_k_at(p, blk, row, kh), x, p->d,
                           FA_FN(fa_kv_descale)(p->k_descale, p->kd_bstride, p->kd_hstride, i, kh));
    const int64_t vn = i * p->vnew_bstride + t * p->vnew_rstride + kh * p->vnew_hstride;
    FA_FN(fa_load_row)(x, p->vnew, vn, p->dv, p->dtype);
    FA_FN(fa_kv_store_fp8)(p, p->v, fa_kv_v_at(p, blk, row, kh), x, p->dv,
                           FA_FN(fa_kv_descale)(p->v_descale, p->vd_bstride, p->vd_hstride, i, kh));
}

/*
 * Appends the new keys and values of kv head kh for every sequence, in batch order, so that
 * when two sequences share cache rows the later one's values stay whatever the thread count.
 */
static void FA_FN(fa_kv_append_head)(const fa_params *p, int64_t kh)
{
    const size_t esize = fa_dtype_size(p->dtype);
    const int fp8 = p->kv_dtype != p->dtype;
    for (int64_t i = 0; i < p->b; i++) {
        for (int64_t t = 0; t < p->s_new; t++) {
            const int64_t pos = (int64_t)p->cache_seqlens[i] + t;
            const int64_t blk = fa_kv_block(p, i, pos / p->page_size);
            const int64_t row = pos % p->page_size;
            if (fp8) {
                FA_FN(fa_kv_append_fp8)(p, i, t, kh, blk, row, pos);
                continue;
            }
            const int64_t kc = fa_kv_k_at(p, blk, row, kh);
            const int64_t kn = i * p->knew_bstride + t * p->knew_rstride + kh * p->knew_hstride;
            if (p->rot_cos) {
                FA_REAL x[FA_MAX_HEAD_DIM];
                FA_FN(fa_load_row)(x, p->knew, kn, p->d, p->dtype);
                FA_FN(fa_kv_rotate)(p, x, pos);
                FA_FN(fa_store_row)(p->k, kc, x, (FA_REAL)1, p->d, p->dtype);
            } else {
                /* memmove: a caller may pass k as a view into the cache itself. */
                memmove((char *)p->k + (ptrdiff_t)kc * (ptrdiff_t)esize,
                        (const char *)p->knew + (ptrdiff_t)kn * (ptrdiff_t)esize, (size_t)p->d * esize);
            }
            const int64_t vc = fa_kv_v_at(p, blk, row, kh);
            const int64_t vn = i * p->vnew_bstride + t * p->vnew_rstride + kh * p->vnew_hstride;
            memmove((char *)p->v + (ptrdiff_t)vc * (ptrdiff_t)esize,
                    (const char *)p->vnew + (ptrdiff_t)vn * (ptrdiff_t)esize, (size_t)p->dv * esize);
        }
    }
}
