/*
 * test_kvcache_fp8_codes: the CPU decode's fp8 rows, widened in vector registers
 * (cpu/fa_cpu_fp8_vec.h) or converted into its tile, give the values of core/fa_fp8.h.
 *   - fa_fp8_widen16 gives every code of both kinds bit for bit as fa_e4m3_to_f32 /
 *     fa_e5m2_to_f32 (NaN signs, infinities, subnormals included);
 *   - fa_attention_kvcache with fp32 q and fp8 caches holding every finite code (without
 *     descales, P not rounded) is bitwise the call on fp32 caches holding the codes' values
 *     where both take the same kernels: the same products in the same order, the fp8 rows
 *     read in place (g = 4, one query row) or through the tile (head dims not a multiple of
 *     16, g = 2); blocks within a page or across pages. Where the fp32 rows take fa_kv_pv4
 *     and the fp8 rows the P V micro-kernel (g = 8, several query rows), within 1e-5 of the
 *     largest |out| (bitwise too with gcc, whose two kernels sum alike).
 * Fresh random inputs each case; outputs poisoned with NaN first.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flashattn.h"
#include "test_util.h"
#include "core/fa_fp8.h"
#include "cpu/fa_cpu_fp8_vec.h"

static const fa_dtype kinds[2] = {FA_DTYPE_F8E4M3, FA_DTYPE_F8E5M2};

static float code_value(fa_dtype kind, uint8_t c)
{
    return kind == FA_DTYPE_F8E4M3 ? fa_e4m3_to_f32(c) : fa_e5m2_to_f32(c);
}

static int code_finite(fa_dtype kind, uint8_t c)
{
    return kind == FA_DTYPE_F8E4M3 ? (c & 0x7f) != 0x7f : (c & 0x7c) != 0x7c;
}

static void test_widen(void)
{
    for (int k = 0; k < 2; k++) {
        uint8_t codes[256];
        for (int c = 0; c < 256; c++)
            codes[c] = (uint8_t)(c * 37 + 11); /* every code, not in order */
        int bad = 0;
        for (int at = 0; at < 256; at += 16) {
            fa_f32x16 got;
            fa_fp8_widen16(&got, codes + at, kinds[k] == FA_DTYPE_F8E4M3);
            for (int l = 0; l < 16; l++) {
                const float want = code_value(kinds[k], codes[at + l]), g = got[l];
                bad += memcmp(&want, &g, sizeof g) != 0;
            }
        }
        TU_CHECK(bad == 0, "%s: %d codes widened differently", fa_dtype_name(kinds[k]), bad);
    }
}

typedef struct ccase {
    fa_dtype kind;
    int64_t b, sq, h, hk, d, page, cap;
    int same; /* both caches take the same kernels */
} ccase;

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p)
        exit(2);
    return p;
}

static void run_case(const ccase *c, tu_rng *r)
{
    char where[160];
    snprintf(where, sizeof where, "%s b %lld sq %lld h %lld/%lld d %lld page %lld cap %lld",
             fa_dtype_name(c->kind), (long long)c->b, (long long)c->sq, (long long)c->h,
             (long long)c->hk, (long long)c->d, (long long)c->page, (long long)c->cap);
    tu_where = where;
    const int64_t b = c->b, maxb = c->page ? c->cap / c->page : 0;
    const int64_t blocks = c->page ? b * maxb : b, prow = c->page ? c->page : c->cap;
    const int64_t nq = b * c->sq * c->h * c->d, nkv = blocks * prow * c->hk * c->d;
    const int64_t no = b * c->sq * c->h * c->d, nl = b * c->h * c->sq;
    float *q = xmalloc((size_t)nq * 4), *kf = xmalloc((size_t)nkv * 4);
    float *vf = xmalloc((size_t)nkv * 4), *out8 = xmalloc((size_t)no * 4);
    float *out32 = xmalloc((size_t)no * 4), *lse8 = xmalloc((size_t)nl * 4);
    float *lse32 = xmalloc((size_t)nl * 4);
    uint8_t *k8 = xmalloc((size_t)nkv), *v8 = xmalloc((size_t)nkv);
    int32_t *seqlens = xmalloc((size_t)b * 4), *table = xmalloc((size_t)(b * maxb + 1) * 4);
    for (int64_t i = 0; i < nq; i++)
        q[i] = (float)tu_rng_uniform(r, -1, 1);
    /* Every finite code (the subnormals and zeros of both signs among them), drawn uniformly;
     * q small enough that no score overflows against e5m2's largest values. */
    for (int64_t i = 0; i < nkv; i++) {
        do
            k8[i] = (uint8_t)tu_rng_int(r, 0, 255);
        while (!code_finite(c->kind, k8[i]));
        do
            v8[i] = (uint8_t)tu_rng_int(r, 0, 255);
        while (!code_finite(c->kind, v8[i]));
        kf[i] = code_value(c->kind, k8[i]);
        vf[i] = code_value(c->kind, v8[i]);
    }
    if (c->kind == FA_DTYPE_F8E5M2)
        for (int64_t i = 0; i < nq; i++)
            q[i] *= 1e-4f;
    for (int64_t i = 0; i < b; i++)
        seqlens[i] = (int32_t)tu_rng_int(r, 1, c->cap);
    for (int64_t k = 0; k < b * maxb; k++) /* each sequence's pages in reverse order */
        table[k] = (int32_t)(b * maxb - 1 - k);

    const int64_t qs[4] = {b, c->sq, c->h, c->d}, ks[4] = {blocks, prow, c->hk, c->d};
    const int64_t ls[3] = {b, c->h, c->sq}, bs[1] = {b}, ts[2] = {b, maxb};
    fa_tensor tq = fa_tensor_make(q, FA_DTYPE_F32, 4, qs, NULL);
    fa_tensor tk8 = fa_tensor_make(k8, c->kind, 4, ks, NULL);
    fa_tensor tv8 = fa_tensor_make(v8, c->kind, 4, ks, NULL);
    fa_tensor tkf = fa_tensor_make(kf, FA_DTYPE_F32, 4, ks, NULL);
    fa_tensor tvf = fa_tensor_make(vf, FA_DTYPE_F32, 4, ks, NULL);
    fa_tensor to8 = fa_tensor_make(out8, FA_DTYPE_F32, 4, qs, NULL);
    fa_tensor to32 = fa_tensor_make(out32, FA_DTYPE_F32, 4, qs, NULL);
    fa_tensor tl8 = fa_tensor_make(lse8, FA_DTYPE_F32, 3, ls, NULL);
    fa_tensor tl32 = fa_tensor_make(lse32, FA_DTYPE_F32, 3, ls, NULL);
    fa_tensor tseq = fa_tensor_make(seqlens, FA_DTYPE_I32, 1, bs, NULL);
    fa_tensor ttab = fa_tensor_make(table, FA_DTYPE_I32, 2, ts, NULL);
    fa_kvcache_args a;
    fa_kvcache_args_init(&a);
    a.q = &tq, a.k_cache = &tk8, a.v_cache = &tv8, a.out = &to8, a.lse = &tl8;
    a.cache_seqlens = &tseq;
    a.block_table = c->page ? &ttab : NULL;
    a.causal = c->sq > 1;
    a.num_threads = 2;
    for (int64_t i = 0; i < no; i++)
        out8[i] = out32[i] = NAN;
    for (int64_t i = 0; i < nl; i++)
        lse8[i] = lse32[i] = NAN;
    TU_CHECK(fa_attention_kvcache(&a) == FA_STATUS_OK, "fp8 call: %s", fa_last_error());
    fa_kvcache_args f = a;
    f.k_cache = &tkf, f.v_cache = &tvf, f.out = &to32, f.lse = &tl32;
    TU_CHECK(fa_attention_kvcache(&f) == FA_STATUS_OK, "fp32 call: %s", fa_last_error());
    int64_t bad = 0, nans = 0;
    double big = 0;
    for (int64_t i = 0; i < no; i++)
        big = fabs(out32[i]) > big ? fabs(out32[i]) : big;
    for (int64_t i = 0; i < no; i++) {
        bad += c->same ? memcmp(&out8[i], &out32[i], 4) != 0
                       : !(fabs((double)out8[i] - out32[i]) <= 1e-5 * big);
        nans += isnan(out8[i]);
    }
    for (int64_t i = 0; i < nl; i++)
        bad += c->same ? memcmp(&lse8[i], &lse32[i], 4) != 0
                       : !(lse8[i] == lse32[i] || /* +inf: a row that sees no key */
                           fabs((double)lse8[i] - lse32[i]) <= 1e-5 * fabs(lse32[i]));
    TU_CHECK(bad == 0 && nans == 0, "%lld of %lld values differ from the fp32 caches' (%lld NaN)",
             (long long)bad, (long long)(no + nl), (long long)nans);
    free(q), free(kf), free(vf), free(out8), free(out32), free(lse8), free(lse32);
    free(k8), free(v8), free(seqlens), free(table);
}

int main(void)
{
    tu_rng r = {tu_master_seed("test_kvcache_fp8_codes")};
    test_widen();
    /* In place (g = 4, one query row, d a multiple of 16, blocks within a page) and through
     * the tile (g 2 and 8, several query rows, d 40 and 72, pages of 16 and 3). Each shape has
     * d <= 64 * (its kv heads, up to 16 / g, an item takes), so that the key blocks are the
     * same for both caches: the decode caps a block's bytes, which the fp32 rows reach first. */
    static const int64_t shapes[][8] = {
        /* b, sq, h, hk, d, page, cap, same kernels */
        {1, 1, 8, 2, 64, 0, 700, 1},    {2, 1, 8, 2, 128, 256, 768, 1},
        {1, 1, 16, 4, 256, 0, 300, 1},  {2, 1, 8, 2, 128, 16, 320, 1},
        {1, 1, 4, 2, 64, 0, 500, 1},    {1, 1, 8, 2, 40, 0, 333, 1},
        {2, 1, 8, 2, 72, 3, 99, 1},     {3, 1, 32, 8, 128, 64, 640, 1},
        {1, 1, 16, 2, 64, 0, 400, 0},   {2, 3, 8, 2, 64, 0, 200, 0},
    };
    for (int k = 0; k < 2; k++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            const int64_t *x = shapes[s];
            const ccase c = {kinds[k], x[0], x[1], x[2], x[3], x[4], x[5], x[6], (int)x[7]};
            run_case(&c, &r);
        }
    return tu_finish("test_kvcache_fp8_codes");
}
