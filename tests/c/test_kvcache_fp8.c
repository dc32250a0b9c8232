/*
 * test_kvcache_fp8: fa_attention_kvcache with fp8 caches (include/flashattn.h, "FP8 caches").
 *
 * Each case draws fresh random inputs: q, new keys and values, rotary cos/sin in q's dtype,
 * fp8 caches holding random finite codes, descales in [0.05, 2] (or none), cache_seqlens,
 * leftpad, a shuffled block table (pages of 1, 3, 16) or cache_batch_idx; out and lse are
 * poisoned with NaN. The call must
 *   - leave every cache byte outside the appended rows as it was, and write in those rows
 *     round_to_fp8(x / descale) of the new row x (rotated in double here: the stored code must
 *     be a nearest code of that quotient, exactly fa_fp8_from_f32's with no rotary);
 *   - match the library's fp32 path run on the caches dequantised here (code * descale, after
 *     the append) with q rotated here: out within twice the rounding of out and of P to q's
 *     dtype (2^-8 bf16, 2^-11 fp16, relative, of |out| and of the largest |value|), lse within
 *     1e-4; for num_splits 1, 3 and 0;
 *   - give bitwise the same result for a fixed split count under 1 and 3 threads.
 * Then the refusals: each names its argument.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flashattn.h"
#include "test_util.h"
#include "core/fa_fp8.h"
#include "util/fa_half.h"

typedef struct fcase {
    fa_dtype qdt, kvdt;
    int64_t b, sq, h, hk, d, dv;
    int64_t page;     /* 0: contiguous */
    int64_t capacity; /* positions a sequence can hold */
    int64_t s_new;
    int rotary; /* 0 none, 1 interleaved, 2 not */
    int64_t rotary_dim;
    int causal, leftpad, batch_idx, descales, lse;
} fcase;

static void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size);
    if (!p)
        exit(2);
    return p;
}

/* x rounded to dt (fp32, fp16 or bf16), as stored; *bits the stored element. */
static float round_to(fa_dtype dt, float x, void *dst, int64_t at)
{
    if (dt == FA_DTYPE_F32) {
        ((float *)dst)[at] = x;
        return x;
    }
    uint16_t h = dt == FA_DTYPE_BF16 ? fa_f32_to_bf16(x) : fa_f32_to_f16(x);
    ((uint16_t *)dst)[at] = h;
    return dt == FA_DTYPE_BF16 ? fa_bf16_to_f32(h) : fa_f16_to_f32(h);
}

static float fp8_value(fa_dtype kind, uint8_t c)
{
    return kind == FA_DTYPE_F8E4M3 ? fa_e4m3_to_f32(c) : fa_e5m2_to_f32(c);
}

static uint8_t fp8_code(fa_dtype kind, float x)
{
    return kind == FA_DTYPE_F8E4M3 ? fa_f32_to_e4m3(x) : fa_f32_to_e5m2(x);
}

/* n values of dt, uniform in [-amp, amp], into buf; their values (after rounding) into val. */
static void *fill(fa_dtype dt, int64_t n, double amp, tu_rng *r, float *val)
{
    void *buf = xcalloc((size_t)n, fa_dtype_size(dt));
    for (int64_t i = 0; i < n; i++)
        val[i] = round_to(dt, (float)tu_rng_uniform(r, -amp, amp), buf, i);
    return buf;
}

static int64_t pos_blk(const fcase *c, const int32_t *table, int64_t maxb, const int32_t *bidx,
                       int64_t i, int64_t pos, int64_t *row)
{
    if (c->page) {
        *row = pos % c->page;
        return table[i * maxb + pos / c->page];
    }
    *row = pos;
    return c->batch_idx ? bidx[i] : i;
}

/* The rotation of x (d elements) at pos, in double, by cos/sin values cv/sv [.., rd / 2]. */
static void rotate(double *x, const float *cv, const float *sv, int64_t pos, int64_t rd,
                   int interleaved)
{
    for (int64_t t = 0; t < rd / 2; t++) {
        const int64_t i0 = interleaved ? 2 * t : t, i1 = interleaved ? 2 * t + 1 : t + rd / 2;
        const double cs = cv[pos * (rd / 2) + t], sn = sv[pos * (rd / 2) + t];
        const double x0 = x[i0], x1 = x[i1];
        x[i0] = x0 * cs - x1 * sn;
        x[i1] = x0 * sn + x1 * cs;
    }
}

/* Whether code is a nearest fp8 code of y (within y's own rounding slack). */
static int nearest_code(fa_dtype kind, uint8_t code, double y)
{
    const uint8_t best = fp8_code(kind, (float)y);
    if (code == best)
        return 1;
    const double e1 = fabs(fp8_value(kind, code) - y), e0 = fabs(fp8_value(kind, best) - y);
    return e1 <= e0 + 1e-5 * fabs(y);
}

static void run_case(const fcase *c, tu_rng *r, int index)
{
    char where[256];
    snprintf(where, sizeof where,
             "case %d: q %s cache %s b %lld sq %lld h %lld/%lld d %lld/%lld page %lld cap %lld "
             "new %lld rotary %d/%lld causal %d leftpad %d bidx %d descales %d",
             index, fa_dtype_name(c->qdt), fa_dtype_name(c->kvdt), (long long)c->b,
             (long long)c->sq, (long long)c->h, (long long)c->hk, (long long)c->d,
             (long long)c->dv, (long long)c->page, (long long)c->capacity, (long long)c->s_new,
             c->rotary, (long long)c->rotary_dim, c->causal, c->leftpad, c->batch_idx,
             c->descales);
    tu_where = where;
    const int64_t b = c->b, sq = c->sq, h = c->h, hk = c->hk, d = c->d, dv = c->dv;
    const int64_t cap = c->capacity, maxb = c->page ? cap / c->page : 0;
    const int64_t nblocks = c->page ? b * maxb + 2 : (c->batch_idx ? b + 2 : b);
    const int64_t prow = c->page ? c->page : cap;

    /* Lengths, leftpad, the block table (each sequence's own blocks, shuffled) or rows. */
    int32_t *seqlens = xcalloc((size_t)b, 4), *lp = xcalloc((size_t)b, 4);
    int32_t *bidx = xcalloc((size_t)b, 4), *table = xcalloc((size_t)(b * maxb + 1), 4);
    int32_t *seqlens_after = xcalloc((size_t)b, 4);
    for (int64_t i = 0; i < b; i++) {
        seqlens[i] = (int32_t)tu_rng_int(r, 0, cap - c->s_new);
        seqlens_after[i] = seqlens[i] + (int32_t)c->s_new;
        lp[i] = c->leftpad ? (int32_t)tu_rng_int(r, 0, seqlens[i]) : 0;
    }
    int64_t *perm = xcalloc((size_t)nblocks, sizeof(int64_t));
    for (int64_t k = 0; k < nblocks; k++)
        perm[k] = k;
    for (int64_t k = nblocks - 1; k > 0; k--) {
        const int64_t j = tu_rng_int(r, 0, k), t = perm[k];
        perm[k] = perm[j];
        perm[j] = t;
    }
    for (int64_t k = 0; k < b * maxb; k++)
        table[k] = (int32_t)perm[k];
    for (int64_t i = 0; i < b; i++)
        bidx[i] = (int32_t)perm[i];
    free(perm);

    /* Tensors, contiguous; values kept as floats. */
    const int64_t nq = b * sq * h * d, no = b * sq * h * dv;
    const int64_t nk = nblocks * prow * hk * d, nv = nblocks * prow * hk * dv;
    const int64_t nkn = b * c->s_new * hk * d, nvn = b * c->s_new * hk * dv;
    const int64_t half = c->rotary_dim / 2, nro_rows = cap + sq;
    const int64_t nro = nro_rows * (half > 0 ? half : 1);
    float *qv = xcalloc((size_t)nq, 4), *knv = xcalloc((size_t)(nkn + 1), 4);
    float *vnv = xcalloc((size_t)(nvn + 1), 4), *cv = xcalloc((size_t)nro, 4);
    float *sv = xcalloc((size_t)nro, 4), *kdv = xcalloc((size_t)(b * hk), 4);
    float *vdv = xcalloc((size_t)(b * hk), 4);
    void *q = fill(c->qdt, nq, 1.0, r, qv);
    void *kn = fill(c->qdt, nkn + 1, 1.0, r, knv);
    void *vn = fill(c->qdt, nvn + 1, 1.0, r, vnv);
    void *cs = xcalloc((size_t)nro, fa_dtype_size(c->qdt));
    void *sn = xcalloc((size_t)nro, fa_dtype_size(c->qdt));
    for (int64_t k = 0; k < nro; k++) {
        const double ang = tu_rng_uniform(r, -3.1, 3.1);
        cv[k] = round_to(c->qdt, (float)cos(ang), cs, k);
        sv[k] = round_to(c->qdt, (float)sin(ang), sn, k);
    }
    for (int64_t k = 0; k < b * hk; k++) {
        kdv[k] = c->descales ? (float)tu_rng_uniform(r, 0.05, 2.0) : 1.0f;
        vdv[k] = c->descales ? (float)tu_rng_uniform(r, 0.05, 2.0) : 1.0f;
    }
    /* The caches: codes of values up to 3 (a range that spans e4m3's subnormals too). */
    uint8_t *kc = xcalloc((size_t)nk, 1), *vc = xcalloc((size_t)nv, 1);
    for (int64_t k = 0; k < nk; k++)
        kc[k] = fp8_code(c->kvdt, (float)(tu_rng_uniform(r, -3, 3) * pow(2, -tu_rng_int(r, 0, 8))));
    for (int64_t k = 0; k < nv; k++)
        vc[k] = fp8_code(c->kvdt, (float)(tu_rng_uniform(r, -3, 3) * pow(2, -tu_rng_int(r, 0, 8))));
    uint8_t *kc0 = xcalloc((size_t)nk, 1), *vc0 = xcalloc((size_t)nv, 1);
    uint8_t *korig = xcalloc((size_t)nk, 1), *vorig = xcalloc((size_t)nv, 1);
    memcpy(kc0, kc, (size_t)nk);
    memcpy(vc0, vc, (size_t)nv);
    memcpy(korig, kc, (size_t)nk);
    memcpy(vorig, vc, (size_t)nv);

    const int64_t sq_shape[4] = {b, sq, h, d}, o_shape[4] = {b, sq, h, dv};
    const int64_t kc_shape[4] = {nblocks, prow, hk, d}, vc_shape[4] = {nblocks, prow, hk, dv};
    const int64_t kn_shape[4] = {b, c->s_new, hk, d}, vn_shape[4] = {b, c->s_new, hk, dv};
    const int64_t ro_shape[2] = {nro_rows, half}, bt_shape[2] = {b, maxb}, bh[2] = {b, hk};
    const int64_t lse_shape[3] = {b, h, sq}, bs[1] = {b};
    fa_tensor tq = fa_tensor_make(q, c->qdt, 4, sq_shape, NULL);
    fa_tensor tkc = fa_tensor_make(kc, c->kvdt, 4, kc_shape, NULL);
    fa_tensor tvc = fa_tensor_make(vc, c->kvdt, 4, vc_shape, NULL);
    fa_tensor tkn = fa_tensor_make(kn, c->qdt, 4, kn_shape, NULL);
    fa_tensor tvn = fa_tensor_make(vn, c->qdt, 4, vn_shape, NULL);
    fa_tensor tcos = fa_tensor_make(cs, c->qdt, 2, ro_shape, NULL);
    fa_tensor tsin = fa_tensor_make(sn, c->qdt, 2, ro_shape, NULL);
    fa_tensor tkd = fa_tensor_make(kdv, FA_DTYPE_F32, 2, bh, NULL);
    fa_tensor tvd = fa_tensor_make(vdv, FA_DTYPE_F32, 2, bh, NULL);
    fa_tensor tseq = fa_tensor_make(seqlens, FA_DTYPE_I32, 1, bs, NULL);
    fa_tensor tlp = fa_tensor_make(lp, FA_DTYPE_I32, 1, bs, NULL);
    fa_tensor tbidx = fa_tensor_make(bidx, FA_DTYPE_I32, 1, bs, NULL);
    fa_tensor ttable = fa_tensor_make(table, FA_DTYPE_I32, 2, bt_shape, NULL);
    void *out = xcalloc((size_t)no, fa_dtype_size(c->qdt));
    float *lse = xcalloc((size_t)(b * h * sq), 4);
    fa_tensor tout = fa_tensor_make(out, c->qdt, 4, o_shape, NULL);
    fa_tensor tlse = fa_tensor_make(lse, FA_DTYPE_F32, 3, lse_shape, NULL);

    fa_kvcache_args a;
    fa_kvcache_args_init(&a);
    a.q = &tq, a.k_cache = &tkc, a.v_cache = &tvc, a.out = &tout;
    a.lse = c->lse ? &tlse : NULL;
    a.cache_seqlens = &tseq;
    a.cache_leftpad = c->leftpad ? &tlp : NULL;
    a.block_table = c->page ? &ttable : NULL;
    a.cache_batch_idx = !c->page && c->batch_idx ? &tbidx : NULL;
    if (c->s_new > 0)
        a.k = &tkn, a.v = &tvn;
    if (c->rotary)
        a.rotary_cos = &tcos, a.rotary_sin = &tsin, a.rotary_interleaved = c->rotary == 1;
    a.k_descale = c->descales || tu_rng_chance(r, 0.5) ? &tkd : NULL;
    a.v_descale = c->descales || tu_rng_chance(r, 0.5) ? &tvd : NULL;
    a.causal = c->causal;
    a.num_splits = 1;
    a.num_threads = 3;
    memset(out, 0xff, (size_t)no * fa_dtype_size(c->qdt));
    for (int64_t k = 0; k < b * h * sq; k++)
        lse[k] = NAN;
    fa_status st = fa_attention_kvcache(&a);
    TU_CHECK(st == FA_STATUS_OK, "fp8 call: %s", fa_last_error());
    if (st != FA_STATUS_OK)
        goto done;

    /* The caches: the appended rows hold the rounded quotients, every other byte is as it was. */
    int64_t bad = 0;
    for (int64_t i = 0; i < b; i++)
        for (int64_t t = 0; t < c->s_new; t++) {
            const int64_t pos = seqlens[i] + t;
            int64_t row;
            const int64_t blk = pos_blk(c, table, maxb, bidx, i, pos, &row);
            for (int64_t e = 0; e < hk; e++) {
                double x[FA_MAX_HEAD_DIM];
                const int64_t kat = ((blk * prow + row) * hk + e) * d;
                const int64_t vat = ((blk * prow + row) * hk + e) * dv;
                for (int64_t x0 = 0; x0 < d; x0++)
                    x[x0] = knv[((i * c->s_new + t) * hk + e) * d + x0];
                if (c->rotary)
                    rotate(x, cv, sv, pos, c->rotary_dim, c->rotary == 1);
                for (int64_t x0 = 0; x0 < d; x0++) {
                    const float kd = kdv[i * hk + e];
                    const int ok = c->rotary
                                       ? nearest_code(c->kvdt, kc[kat + x0], x[x0] / kd)
                                       : kc[kat + x0] == fp8_code(c->kvdt, (float)x[x0] / kd);
                    bad += !ok;
                    kc0[kat + x0] = kc[kat + x0]; /* checked: excluded from the comparison */
                }
                for (int64_t x0 = 0; x0 < dv; x0++) {
                    const float y = vnv[((i * c->s_new + t) * hk + e) * dv + x0] / vdv[i * hk + e];
                    bad += vc[vat + x0] != fp8_code(c->kvdt, y);
                    vc0[vat + x0] = vc[vat + x0];
                }
            }
        }
    TU_CHECK(bad == 0, "%lld appended fp8 elements are not the rounded quotient", (long long)bad);
    TU_CHECK(memcmp(kc, kc0, (size_t)nk) == 0 && memcmp(vc, vc0, (size_t)nv) == 0,
             "the append changed cache bytes outside its rows");

    /* The reference: the fp32 path on the dequantised caches and q rotated here. */
    {
        float *qr = xcalloc((size_t)nq, 4), *kr = xcalloc((size_t)nk, 4);
        float *vr = xcalloc((size_t)nv, 4);
        float *oref = xcalloc((size_t)no, 4), *lref = xcalloc((size_t)(b * h * sq), 4);
        const int per_row = c->causal; /* the rotary rule for q (no window here) */
        for (int64_t i = 0; i < b; i++)
            for (int64_t s = 0; s < sq; s++)
                for (int64_t hh = 0; hh < h; hh++) {
                    double x[FA_MAX_HEAD_DIM];
                    const int64_t at = ((i * sq + s) * h + hh) * d;
                    for (int64_t x0 = 0; x0 < d; x0++)
                        x[x0] = qv[at + x0];
                    if (c->rotary)
                        rotate(x, cv, sv, seqlens[i] + (per_row ? s : 0), c->rotary_dim,
                               c->rotary == 1);
                    for (int64_t x0 = 0; x0 < d; x0++)
                        qr[at + x0] = (float)x[x0];
                }
        /* Each cache position's descale is its sequence's: fill per sequence's blocks/row. */
        for (int64_t k = 0; k < nk; k++)
            kr[k] = fp8_value(c->kvdt, kc[k]);
        for (int64_t k = 0; k < nv; k++)
            vr[k] = fp8_value(c->kvdt, vc[k]);
        for (int64_t i = 0; i < b; i++)
            for (int64_t pos = 0; pos < seqlens_after[i]; pos++) {
                int64_t row;
                const int64_t blk = pos_blk(c, table, maxb, bidx, i, pos, &row);
                for (int64_t e = 0; e < hk; e++) {
                    const float kd = a.k_descale ? kdv[i * hk + e] : 1.0f;
                    const float vd = a.v_descale ? vdv[i * hk + e] : 1.0f;
                    for (int64_t x0 = 0; x0 < d; x0++)
                        kr[((blk * prow + row) * hk + e) * d + x0] =
                            fp8_value(c->kvdt, kc[((blk * prow + row) * hk + e) * d + x0]) * kd;
                    for (int64_t x0 = 0; x0 < dv; x0++)
                        vr[((blk * prow + row) * hk + e) * dv + x0] =
                            fp8_value(c->kvdt, vc[((blk * prow + row) * hk + e) * dv + x0]) * vd;
                }
            }
        fa_tensor rq = fa_tensor_make(qr, FA_DTYPE_F32, 4, sq_shape, NULL);
        fa_tensor rk = fa_tensor_make(kr, FA_DTYPE_F32, 4, kc_shape, NULL);
        fa_tensor rv = fa_tensor_make(vr, FA_DTYPE_F32, 4, vc_shape, NULL);
        fa_tensor ro = fa_tensor_make(oref, FA_DTYPE_F32, 4, o_shape, NULL);
        fa_tensor rl = fa_tensor_make(lref, FA_DTYPE_F32, 3, lse_shape, NULL);
        fa_tensor rseq = fa_tensor_make(seqlens_after, FA_DTYPE_I32, 1, bs, NULL);
        fa_kvcache_args ra = a;
        ra.q = &rq, ra.k_cache = &rk, ra.v_cache = &rv, ra.out = &ro, ra.lse = &rl;
        ra.cache_seqlens = &rseq;
        ra.k = ra.v = NULL;
        ra.rotary_cos = ra.rotary_sin = NULL;
        ra.k_descale = ra.v_descale = NULL;
        TU_CHECK(fa_attention_kvcache(&ra) == FA_STATUS_OK, "reference: %s", fa_last_error());

        /* Half an ulp of q's dtype is at most 2^-8 (bf16) or 2^-11 (fp16) of the value: out's
         * rounding, and P's (at most that of sum_j p_j |v_j| / l <= 3 v_descale); twice both. */
        const double ulp = c->qdt == FA_DTYPE_BF16 ? ldexp(1, -7)
                           : c->qdt == FA_DTYPE_F16 ? ldexp(1, -10)
                                                     : 1e-5;
        const double pr = c->qdt == FA_DTYPE_F32 ? 2e-5 : ulp;
        /* Every split count, the first call's result included, against the reference; a fixed
         * split count gives the same bits under another thread count. */
            const int splits[4] = {1, 3, 0, 3};
        const int threads[4] = {3, 3, 2, 1};
        void *prev = xcalloc((size_t)no, fa_dtype_size(c->qdt));
        for (int run = 0; run < 4; run++) {
            if (run > 0) { /* the same call again on the caches as they were */
                memcpy(kc, korig, (size_t)nk);
                memcpy(vc, vorig, (size_t)nv);
                a.num_splits = splits[run];
                a.num_threads = threads[run];
                memset(out, 0xff, (size_t)no * fa_dtype_size(c->qdt));
                for (int64_t k = 0; k < b * h * sq; k++)
                    lse[k] = NAN;
                TU_CHECK(fa_attention_kvcache(&a) == FA_STATUS_OK, "run %d: %s", run,
                         fa_last_error());
                TU_CHECK(memcmp(kc, kc0, (size_t)nk) == 0 && memcmp(vc, vc0, (size_t)nv) == 0,
                         "run %d: the caches differ from the first run's", run);
            }
            int64_t nbad = 0;
            double worst = 0;
            for (int64_t i = 0; i < b; i++)
                for (int64_t s = 0; s < sq; s++)
                    for (int64_t hh = 0; hh < h; hh++) {
                        const int64_t at = ((i * sq + s) * h + hh) * dv;
                        /* the largest |V| the row could see bounds P's rounding error */
                        const float vd = a.v_descale ? vdv[i * hk + hh / (h / hk)] : 1.0f;
                        const double vbound = 3 * vd;
                        for (int64_t x0 = 0; x0 < dv; x0++) {
                            float got;
                            if (c->qdt == FA_DTYPE_F32)
                                got = ((float *)out)[at + x0];
                            else if (c->qdt == FA_DTYPE_BF16)
                                got = fa_bf16_to_f32(((uint16_t *)out)[at + x0]);
                            else
                                got = fa_f16_to_f32(((uint16_t *)out)[at + x0]);
                            const double ref = oref[at + x0];
                            const double tol = ulp * fabs(ref) + pr * vbound + 1e-6;
                            const double err = fabs(got - ref);
                            if (!(err <= tol))
                                nbad++;
                            worst = fmax(worst, err / tol);
                        }
                        if (c->lse) {
                            const float gl = lse[(i * h + hh) * sq + s];
                            const float want = lref[(i * h + hh) * sq + s];
                            const double ltol = 1e-4 * (1 + fabs(want));
                            if (!(gl == want || fabs(gl - want) <= ltol))
                                nbad++;
                        }
                    }
            TU_CHECK(nbad == 0, "run %d (splits %d, threads %d): %lld elements off the fp32 "
                                "reference (worst %.3g x tolerance)",
                     run, splits[run], threads[run], (long long)nbad, worst);
            if (run == 1)
                memcpy(prev, out, (size_t)no * fa_dtype_size(c->qdt));
            if (run == 3)
                TU_CHECK(memcmp(prev, out, (size_t)no * fa_dtype_size(c->qdt)) == 0,
                         "3 splits differ between 3 threads and 1");
        }
        free(prev);
        free(qr), free(kr), free(vr), free(oref), free(lref);
    }
done:
    free(seqlens), free(lp), free(bidx), free(table), free(seqlens_after);
    free(qv), free(knv), free(vnv), free(cv), free(sv), free(kdv), free(vdv);
    free(q), free(kn), free(vn), free(cs), free(sn), free(kc), free(vc), free(kc0), free(vc0);
    free(korig), free(vorig);
    free(out), free(lse);
    tu_where = "";
}

static void random_case(tu_rng *r, fcase *c)
{
    static const fa_dtype qdts[3] = {FA_DTYPE_BF16, FA_DTYPE_F16, FA_DTYPE_F32};
    static const int64_t pages[4] = {0, 1, 3, 16};
    static const int64_t dims[6] = {16, 32, 64, 80, 128, 256};
    static const int64_t ratios[4] = {1, 2, 4, 8};
    memset(c, 0, sizeof *c);
    c->qdt = qdts[tu_rng_int(r, 0, 2)];
    c->kvdt = tu_rng_chance(r, 0.7) ? FA_DTYPE_F8E4M3 : FA_DTYPE_F8E5M2;
    c->b = tu_rng_int(r, 1, 4);
    c->sq = tu_rng_chance(r, 0.6) ? 1 : tu_rng_int(r, 2, 5);
    c->hk = tu_rng_int(r, 1, 3);
    c->h = c->hk * ratios[tu_rng_int(r, 0, 3)];
    c->d = dims[tu_rng_int(r, 0, 5)];
    c->dv = tu_rng_chance(r, 0.8) ? c->d : dims[tu_rng_int(r, 0, 5)];
    c->page = pages[tu_rng_int(r, 0, 3)];
    const int64_t np = c->page ? tu_rng_int(r, 1, 48 / c->page + 3) : 0;
    c->capacity = c->page ? np * c->page : tu_rng_int(r, 1, 300);
    c->s_new = tu_rng_chance(r, 0.6) ? tu_rng_int(r, 0, c->capacity < 4 ? c->capacity : 4) : 0;
    if (c->s_new > 0 && tu_rng_chance(r, 0.5)) {
        c->rotary = (int)tu_rng_int(r, 1, 2);
        c->rotary_dim = 2 * tu_rng_int(r, 1, c->d / 2);
    }
    c->causal = tu_rng_chance(r, 0.5);
    c->leftpad = tu_rng_chance(r, 0.3);
    c->batch_idx = !c->page && tu_rng_chance(r, 0.5);
    c->descales = tu_rng_chance(r, 0.8);
    c->lse = tu_rng_chance(r, 0.7);
}

/* Each refusal names its argument. */
static void test_refusals(void)
{
    const int64_t qs[4] = {2, 1, 4, 16}, cs[4] = {2, 8, 2, 16}, bh[2] = {2, 2}, bad[2] = {2, 3};
    uint16_t q[2 * 4 * 16] = {0}, o[2 * 4 * 16] = {0};
    uint8_t kc[2 * 8 * 2 * 16] = {0}, vc[2 * 8 * 2 * 16] = {0};
    uint16_t vc16[2 * 8 * 2 * 16] = {0};
    float kd[6] = {1, 1, 1, 1, 1, 1};
    fa_tensor tq = fa_tensor_make(q, FA_DTYPE_BF16, 4, qs, NULL);
    fa_tensor to = fa_tensor_make(o, FA_DTYPE_BF16, 4, qs, NULL);
    fa_tensor tkc = fa_tensor_make(kc, FA_DTYPE_F8E4M3, 4, cs, NULL);
    fa_tensor tvc = fa_tensor_make(vc, FA_DTYPE_F8E4M3, 4, cs, NULL);
    fa_tensor tkd = fa_tensor_make(kd, FA_DTYPE_F32, 2, bh, NULL);
    struct {
        const char *what, *name;
        fa_tensor q, kc, vc, kd;
        int use_kd, kd_on_v;
    } cases[] = {
        {"ok", NULL, tq, tkc, tvc, tkd, 1, 0},
        {"cache kinds differ", "v_cache", tq, tkc, fa_tensor_make(vc, FA_DTYPE_F8E5M2, 4, cs, NULL), tkd, 0, 0},
        {"fp8 k, bf16 v", "v_cache", tq, tkc, fa_tensor_make(vc16, FA_DTYPE_BF16, 4, cs, NULL), tkd, 0, 0},
        {"fp8 q", "q", fa_tensor_make(q, FA_DTYPE_F8E4M3, 4, qs, NULL), tkc, tvc, tkd, 0, 0},
        {"descale without fp8", "k_descale", tq, fa_tensor_make(vc16, FA_DTYPE_BF16, 4, cs, NULL),
         fa_tensor_make(vc16, FA_DTYPE_BF16, 4, cs, NULL), tkd, 1, 0},
        {"descale shape", "k_descale", tq, tkc, tvc, fa_tensor_make(kd, FA_DTYPE_F32, 2, bad, NULL), 1, 0},
        {"descale dtype", "v_descale", tq, tkc, tvc, fa_tensor_make(kd, FA_DTYPE_F16, 2, bh, NULL), 1, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fa_kvcache_args a;
        fa_kvcache_args_init(&a);
        a.q = &cases[i].q, a.k_cache = &cases[i].kc, a.v_cache = &cases[i].vc, a.out = &to;
        if (cases[i].use_kd) {
            if (cases[i].kd_on_v)
                a.v_descale = &cases[i].kd;
            else
                a.k_descale = &cases[i].kd;
        }
        const fa_status st = fa_attention_kvcache(&a);
        if (!cases[i].name) {
            TU_CHECK(st == FA_STATUS_OK, "%s: %s", cases[i].what, fa_last_error());
            continue;
        }
        TU_CHECK(st == FA_STATUS_INVALID_ARGUMENT &&
                     strncmp(fa_last_error(), cases[i].name, strlen(cases[i].name)) == 0,
                 "%s: status %d, message \"%s\" (should name %s)", cases[i].what, (int)st,
                 fa_last_error(), cases[i].name);
    }
    /* fp64 q with an fp8 cache. */
    double q64[2 * 4 * 16] = {0}, o64[2 * 4 * 16] = {0};
    fa_tensor tq64 = fa_tensor_make(q64, FA_DTYPE_F64, 4, qs, NULL);
    fa_tensor to64 = fa_tensor_make(o64, FA_DTYPE_F64, 4, qs, NULL);
    fa_kvcache_args a;
    fa_kvcache_args_init(&a);
    a.q = &tq64, a.k_cache = &tkc, a.v_cache = &tvc, a.out = &to64;
    TU_CHECK(fa_attention_kvcache(&a) == FA_STATUS_INVALID_ARGUMENT &&
                 strncmp(fa_last_error(), "q:", 2) == 0,
             "fp64 q with an fp8 cache: \"%s\"", fa_last_error());
}

int main(void)
{
    uint64_t seed = tu_master_seed("test_kvcache_fp8");
    tu_rng r = {seed};
    const char *n = getenv("FA_TEST_RANDOM_CASES");
    const int cases = n ? atoi(n) : 150;
    /* Fixed corners first: every page size, e5m2, rotary both ways, GQA 8, splits. */
    const fcase fixed[] = {
        {FA_DTYPE_BF16, FA_DTYPE_F8E4M3, 2, 1, 8, 1, 128, 128, 0, 200, 1, 1, 64, 1, 0, 1, 1, 1},
        {FA_DTYPE_F16, FA_DTYPE_F8E4M3, 3, 1, 4, 2, 64, 64, 1, 40, 2, 2, 32, 1, 1, 0, 1, 1},
        {FA_DTYPE_BF16, FA_DTYPE_F8E5M2, 2, 3, 4, 2, 64, 64, 3, 60, 3, 0, 0, 1, 0, 0, 1, 1},
        {FA_DTYPE_F16, FA_DTYPE_F8E5M2, 2, 2, 16, 2, 128, 128, 16, 256, 1, 1, 128, 0, 1, 0, 1, 0},
        {FA_DTYPE_BF16, FA_DTYPE_F8E4M3, 1, 1, 2, 2, 256, 256, 16, 512, 0, 0, 0, 0, 0, 0, 0, 1},
    };
    int index = 0;
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++)
        run_case(&fixed[i], &r, index++);
    for (int i = 0; i < cases; i++) {
        fcase c;
        random_case(&r, &c);
        run_case(&c, &r, index++);
    }
    test_refusals();
    return tu_finish("test_kvcache_fp8");
}
