/*
 * kv_fp8_cpu: the CPU decode (fa_attention_kvcache) with fp8 caches beside a bf16 cache of the
 * same shape, arguments prepared once, best of several calls.
 *
 *   cc -O2 -Iinclude bench/kv_fp8_cpu.c -Lbuild -lflashattn -lm -o build/kv_fp8_cpu
 *   build/kv_fp8_cpu time B H HK D CONTEXT PAGE [ROUNDS [QDTYPE]]   (PAGE 0: contiguous)
 *       prints us per call and per key (us per call / CONTEXT) for bf16, e4m3, e5m2 caches
 *   build/kv_fp8_cpu hash
 *       prints a hash of out and lse for a battery of fp8 shapes and features, to compare
 *       two builds of the library bit for bit (LD_LIBRARY_PATH picks the library)
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "flashattn.h"

typedef struct kv_case {
    fa_dtype qdt, kvdt;
    int64_t b, sq, h, hk, d, dv, ctx, page;
    int causal, descales, splits, softcap, alibi, threads;
} kv_case;

static uint64_t rng_state = 88172645463325252ull;

static uint32_t rng_next(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

static float rng_unit(void) /* [-1, 1) */
{
    return (float)rng_next() / 2147483648.0f - 1.0f;
}

static uint16_t to_half(fa_dtype dt, float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    if (dt == FA_DTYPE_BF16)
        return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    /* fp16 for |x| < 2: truncation suffices for random inputs */
    const uint32_t s = (u >> 16) & 0x8000u;
    const int e = (int)((u >> 23) & 255u) - 127 + 15;
    if (e <= 0)
        return (uint16_t)s;
    return (uint16_t)(s | ((uint32_t)e << 10) | ((u >> 13) & 0x3ffu));
}

static void *fill(fa_dtype dt, int64_t n)
{
    void *buf = malloc((size_t)(n > 0 ? n : 1) * fa_dtype_size(dt));
    for (int64_t i = 0; i < n; i++) {
        const float x = rng_unit();
        if (dt == FA_DTYPE_F32)
            ((float *)buf)[i] = x;
        else if (dt == FA_DTYPE_F16 || dt == FA_DTYPE_BF16)
            ((uint16_t *)buf)[i] = to_half(dt, x);
        else /* fp8: any finite code (e4m3 0x7f/0xff NaN, e5m2 0x7c.. inf/NaN skipped) */
            for (;;) {
                const uint8_t c = (uint8_t)rng_next();
                if (dt == FA_DTYPE_F8E4M3 ? (c & 0x7f) != 0x7f : (c & 0x7c) != 0x7c) {
                    ((uint8_t *)buf)[i] = c;
                    break;
                }
            }
    }
    return buf;
}

typedef struct kv_call {
    fa_tensor q, kc, vc, out, lse, seq, table, kd, vd, alibi;
    fa_kvcache_args a;
    void *bufs[10];
    size_t out_bytes, lse_bytes;
} kv_call;

static void call_make(kv_call *c, const kv_case *k)
{
    memset(c, 0, sizeof *c);
    const int64_t b = k->b, maxb = k->page ? (k->ctx + k->page - 1) / k->page : 0;
    const int64_t nblocks = k->page ? b * maxb : b, prow = k->page ? k->page : k->ctx;
    const int64_t qs[4] = {b, k->sq, k->h, k->d}, os[4] = {b, k->sq, k->h, k->dv};
    const int64_t ks[4] = {nblocks, prow, k->hk, k->d}, vs[4] = {nblocks, prow, k->hk, k->dv};
    const int64_t ls[3] = {b, k->h, k->sq}, bs[1] = {b}, ts[2] = {b, maxb}, ds[2] = {b, k->hk};
    const int64_t hs[1] = {k->h};
    c->bufs[0] = fill(k->qdt, b * k->sq * k->h * k->d);
    c->bufs[1] = fill(k->kvdt, nblocks * prow * k->hk * k->d);
    c->bufs[2] = fill(k->kvdt, nblocks * prow * k->hk * k->dv);
    c->out_bytes = (size_t)(b * k->sq * k->h * k->dv) * fa_dtype_size(k->qdt);
    c->lse_bytes = (size_t)(b * k->h * k->sq) * 4;
    c->bufs[3] = malloc(c->out_bytes);
    c->bufs[4] = malloc(c->lse_bytes);
    int32_t *seq = malloc((size_t)b * 4), *table = malloc((size_t)(b * maxb + 1) * 4);
    for (int64_t i = 0; i < b; i++) /* lengths in (ctx / 2, ctx], the first one ctx */
        seq[i] = (int32_t)(i == 0 ? k->ctx : k->ctx / 2 + 1 + rng_next() % (k->ctx / 2));
    for (int64_t i = 0; i < b * maxb; i++) /* blocks reversed: pages not in order */
        table[i] = (int32_t)(b * maxb - 1 - i);
    c->bufs[5] = seq, c->bufs[6] = table;
    float *kd = malloc((size_t)(b * k->hk) * 4), *vd = malloc((size_t)(b * k->hk) * 4);
    for (int64_t i = 0; i < b * k->hk; i++)
        kd[i] = 0.5f + 0.7f * (rng_unit() + 1), vd[i] = 0.5f + 0.7f * (rng_unit() + 1);
    float *al = malloc((size_t)k->h * 4);
    for (int64_t i = 0; i < k->h; i++)
        al[i] = 0.01f * (float)(i + 1);
    c->bufs[7] = kd, c->bufs[8] = vd, c->bufs[9] = al;
    c->q = fa_tensor_make(c->bufs[0], k->qdt, 4, qs, NULL);
    c->kc = fa_tensor_make(c->bufs[1], k->kvdt, 4, ks, NULL);
    c->vc = fa_tensor_make(c->bufs[2], k->kvdt, 4, vs, NULL);
    c->out = fa_tensor_make(c->bufs[3], k->qdt, 4, os, NULL);
    c->lse = fa_tensor_make(c->bufs[4], FA_DTYPE_F32, 3, ls, NULL);
    c->seq = fa_tensor_make(seq, FA_DTYPE_I32, 1, bs, NULL);
    c->table = fa_tensor_make(table, FA_DTYPE_I32, 2, ts, NULL);
    c->kd = fa_tensor_make(kd, FA_DTYPE_F32, 2, ds, NULL);
    c->vd = fa_tensor_make(vd, FA_DTYPE_F32, 2, ds, NULL);
    c->alibi = fa_tensor_make(al, FA_DTYPE_F32, 1, hs, NULL);
    fa_kvcache_args_init(&c->a);
    c->a.q = &c->q, c->a.k_cache = &c->kc, c->a.v_cache = &c->vc, c->a.out = &c->out;
    c->a.lse = &c->lse, c->a.cache_seqlens = &c->seq;
    c->a.block_table = k->page ? &c->table : NULL;
    const int fp8 = k->kvdt == FA_DTYPE_F8E4M3 || k->kvdt == FA_DTYPE_F8E5M2;
    c->a.k_descale = fp8 && k->descales ? &c->kd : NULL;
    c->a.v_descale = fp8 && k->descales ? &c->vd : NULL;
    c->a.alibi_slopes = k->alibi ? &c->alibi : NULL;
    c->a.softcap = k->softcap ? 5.0 : 0.0;
    c->a.causal = k->causal;
    c->a.num_splits = k->splits;
    c->a.num_threads = k->threads;
}

static void call_free(kv_call *c)
{
    for (int i = 0; i < 10; i++)
        free(c->bufs[i]);
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static uint64_t fnv(const void *p, size_t n, uint64_t h)
{
    const uint8_t *s = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ s[i]) * 1099511628211ull;
    return h;
}

static int run_time(int argc, char **argv)
{
    if (argc < 8)
        return 2;
    kv_case k = {FA_DTYPE_BF16, FA_DTYPE_BF16, atoll(argv[2]), 1, atoll(argv[3]), atoll(argv[4]),
                 atoll(argv[5]), atoll(argv[5]), atoll(argv[6]), atoll(argv[7]),
                 0, 1, 0, 0, 0, 0};
    const int rounds = argc > 8 ? atoi(argv[8]) : 5;
    if (argc > 9) /* q's dtype: bf16 (default), fp16 or fp32 */
        k.qdt = strcmp(argv[9], "fp16") == 0 ? FA_DTYPE_F16
                : strcmp(argv[9], "fp32") == 0 ? FA_DTYPE_F32 : FA_DTYPE_BF16;
    const fa_dtype kinds[3] = {FA_DTYPE_BF16, FA_DTYPE_F8E4M3, FA_DTYPE_F8E5M2};
    kv_call calls[3];
    double best[3] = {1e30, 1e30, 1e30};
    for (int t = 0; t < 3; t++) {
        k.kvdt = kinds[t];
        call_make(&calls[t], &k);
        if (fa_attention_kvcache(&calls[t].a) != FA_STATUS_OK) {
            fprintf(stderr, "%s\n", fa_last_error());
            return 1;
        }
    }
    const int reps = (int)(2e6 / (double)(k.b * k.ctx * k.h * k.d)) + 2;
    for (int r = 0; r < rounds; r++)
        for (int t = 0; t < 3; t++)
            for (int i = 0; i < reps; i++) {
                const double t0 = now_us();
                fa_attention_kvcache(&calls[t].a);
                const double dt = now_us() - t0;
                best[t] = dt < best[t] ? dt : best[t];
            }
    printf("b %lld h %lld/%lld d %lld ctx %lld page %lld:", (long long)k.b, (long long)k.h,
           (long long)k.hk, (long long)k.d, (long long)k.ctx, (long long)k.page);
    for (int t = 0; t < 3; t++) {
        printf("  %s %.1f us (%.4f us/key)", fa_dtype_name(kinds[t]), best[t],
               best[t] / (double)k.ctx);
        call_free(&calls[t]);
    }
    printf("\n");
    return 0;
}

static int run_hash(void)
{
    const fa_dtype qdts[3] = {FA_DTYPE_BF16, FA_DTYPE_F16, FA_DTYPE_F32};
    const int64_t ds[4] = {64, 128, 256, 40}, pages[4] = {0, 16, 256, 3};
    const int64_t gs[4][2] = {{8, 2}, {4, 2}, {4, 4}, {16, 2}};
    uint64_t all = 1469598103934665603ull;
    int n = 0;
    for (int kv = 0; kv < 2; kv++)
        for (int qi = 0; qi < 3; qi++)
            for (int di = 0; di < 4; di++)
                for (int pi = 0; pi < 4; pi++)
                    for (int gi = 0; gi < 4; gi++) {
                        const int v = n;
                        kv_case k = {qdts[qi], kv ? FA_DTYPE_F8E5M2 : FA_DTYPE_F8E4M3,
                                     1 + v % 3, 1 + (v / 7) % 3 * ((v / 7) % 3), gs[gi][0],
                                     gs[gi][1], ds[di], di == 3 ? 72 : ds[di],
                                     200 + (v * 37) % 700, pages[pi], v % 2, (v / 3) % 4 != 0,
                                     (v / 5) % 3, v % 11 == 0, v % 13 == 0, 1 + v % 2};
                        kv_call c;
                        call_make(&c, &k);
                        memset(c.bufs[3], 0xff, c.out_bytes);
                        memset(c.bufs[4], 0xff, c.lse_bytes);
                        if (fa_attention_kvcache(&c.a) != FA_STATUS_OK) {
                            fprintf(stderr, "case %d: %s\n", n, fa_last_error());
                            return 1;
                        }
                        uint64_t h = fnv(c.bufs[3], c.out_bytes, 1469598103934665603ull);
                        h = fnv(c.bufs[4], c.lse_bytes, h);
                        printf("%d %016llx\n", n, (unsigned long long)h);
                        all = fnv(&h, sizeof h, all);
                        call_free(&c);
                        n++;
                    }
    printf("all %d %016llx\n", n, (unsigned long long)all);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "time") == 0)
        return run_time(argc, argv);
    if (argc > 1 && strcmp(argv[1], "hash") == 0)
        return run_hash();
    fprintf(stderr,
            "usage: kv_fp8_cpu time B H HK D CONTEXT PAGE [ROUNDS [bf16|fp16|fp32]] | hash\n");
    return 2;
}
