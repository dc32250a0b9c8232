/*
 * `flashattn bench --decode`: times fa_attention_kvcache on a decoding step (a few new query
 * tokens against a long cache, contiguous or paged), reports the effective bandwidth
 * (bytes of K and V the call must read / time: decoding is bound by memory, not FLOPs), and
 * checks the output against the double-precision oracle on the gathered dense problem.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */

#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fa_bench.h"
#include "fa_ref.h"

#define LABEL "  %-10s"

typedef struct decode_config {
    int64_t batch, heads, kv_heads, seqlen_q, context, new_keys, head_dim, head_dim_v;
    int64_t page_size; /* 0: contiguous cache */
    int64_t num_splits, threads, warmup, iters;
    fa_dtype dtype;
    uint64_t seed;
    int check;
} decode_config;

static void decode_usage(FILE *f)
{
    fputs("usage: flashattn bench --decode [options]\n"
          "\n"
          "Times fa_attention_kvcache on one decoding step, reports the effective bandwidth\n"
          "(bytes of K and V read / time) and checks the result against the fp64 oracle.\n"
          "\n"
          "  -b, --batch N         sequences (default 1)\n"
          "  --heads N             query heads (default 32)\n"
          "  --kv-heads N          key/value heads, dividing --heads (default 8)\n"
          "  --context N           positions already in each sequence's cache (default 8192)\n"
          "  --new N               keys appended by each call (default 0)\n"
          "  --seqlen-q N          query tokens per sequence (default 1)\n"
          "  --head-dim N          q/k head dimension (default 128)\n"
          "  --head-dim-v N        v/out head dimension (default: --head-dim)\n"
          "  --dtype T             fp32 | fp16 | bf16 | fp64 (default bf16)\n"
          "  --page-size N         paged cache with N positions per block; 0: contiguous\n"
          "                        (default 0)\n"
          "  --num-splits N        split-KV chunks, 0 for the library's choice (default 0)\n"
          "  --threads N           CPU threads, 0 for the library's default (default 0)\n"
          "  --warmup N            untimed calls first (default 2)\n"
          "  --iters N             timed calls (default 10)\n"
          "  --seed N              seed of the inputs (default 0)\n"
          "  --no-check            skip the comparison with the oracle\n"
          "  -h, --help            this text\n",
          f);
}

static double seconds_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int value_parse(const char *name, const char *s, int64_t lo, int64_t hi, int64_t *dst)
{
    char *end;
    errno = 0;
    long long v = s ? strtoll(s, &end, 0) : 0;
    if (!s || errno != 0 || end == s || *end != '\0') {
        fprintf(stderr, "flashattn bench --decode: %s: '%s' is not an integer\n", name,
                s ? s : "(missing)");
        return FA_EXIT_USAGE;
    }
    if (v < lo || v > hi) {
        fprintf(stderr, "flashattn bench --decode: %s: %lld is outside [%lld, %lld]\n", name, v,
                (long long)lo, (long long)hi);
        return FA_EXIT_USAGE;
    }
    *dst = (int64_t)v;
    return FA_EXIT_OK;
}

/* Fills cfg; FA_EXIT_OK, FA_EXIT_USAGE (said why), or -1 for --help. */
static int decode_parse(int argc, char **argv, decode_config *cfg)
{
    *cfg = (decode_config){.batch = 1, .heads = 32, .kv_heads = 8, .seqlen_q = 1,
                           .context = 8192, .head_dim = 128, .warmup = 2, .iters = 10,
                           .dtype = FA_DTYPE_BF16, .check = 1};
    const int64_t big = (int64_t)1 << 31;
    static const struct {
        const char *name, *alias;
        size_t field;
        int64_t lo, hi;
    } ints[] = {
        {"--batch", "-b", offsetof(decode_config, batch), 1, 1 << 16},
        {"--heads", NULL, offsetof(decode_config, heads), 1, 1 << 16},
        {"--kv-heads", NULL, offsetof(decode_config, kv_heads), 1, 1 << 16},
        {"--context", NULL, offsetof(decode_config, context), 0, 1 << 30},
        {"--new", NULL, offsetof(decode_config, new_keys), 0, 1 << 20},
        {"--seqlen-q", NULL, offsetof(decode_config, seqlen_q), 0, 1 << 20},
        {"--head-dim", NULL, offsetof(decode_config, head_dim), 1, 1 << 16},
        {"--head-dim-v", NULL, offsetof(decode_config, head_dim_v), 1, 1 << 16},
        {"--page-size", NULL, offsetof(decode_config, page_size), 0, 1 << 30},
        {"--num-splits", NULL, offsetof(decode_config, num_splits), 0, 1 << 16},
        {"--threads", NULL, offsetof(decode_config, threads), 0, 1 << 16},
        {"--warmup", NULL, offsetof(decode_config, warmup), 0, big},
        {"--iters", NULL, offsetof(decode_config, iters), 1, big},
    };
    for (int i = 0; i < argc; i++) {
        const char *arg = argv[i];
        const char *eq = strchr(arg, '=');
        size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
        const char *value = eq ? eq + 1 : (i + 1 < argc ? argv[i + 1] : NULL);
        int takes = 0, matched = 0;
        if (strcmp(arg, "--decode") == 0)
            continue;
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0)
            return -1;
        if (strcmp(arg, "--no-check") == 0) {
            cfg->check = 0;
            continue;
        }
        for (size_t k = 0; k < sizeof ints / sizeof ints[0] && !matched; k++) {
            if ((strlen(ints[k].name) == len && strncmp(arg, ints[k].name, len) == 0) ||
                (ints[k].alias && strcmp(arg, ints[k].alias) == 0)) {
                matched = takes = 1;
                if (value_parse(ints[k].name, value, ints[k].lo, ints[k].hi,
                                (int64_t *)((char *)cfg + ints[k].field)) != FA_EXIT_OK)
                    return FA_EXIT_USAGE;
            }
        }
        if (!matched && len == 6 && strncmp(arg, "--seed", 6) == 0) {
            int64_t seed;
            if (value_parse("--seed", value, 0, INT64_MAX, &seed) != FA_EXIT_OK)
                return FA_EXIT_USAGE;
            cfg->seed = (uint64_t)seed;
            matched = takes = 1;
        }
        if (!matched && len == 7 && strncmp(arg, "--dtype", 7) == 0) {
            static const char *names[] = {"fp32", "fp16", "bf16", "fp64"};
            static const fa_dtype dts[] = {FA_DTYPE_F32, FA_DTYPE_F16, FA_DTYPE_BF16,
                                           FA_DTYPE_F64};
            for (int k = 0; k < 4 && !matched; k++)
                if (value && strcmp(value, names[k]) == 0) {
                    cfg->dtype = dts[k];
                    matched = takes = 1;
                }
            if (!matched) {
                fprintf(stderr, "flashattn bench --decode: --dtype: '%s' is not one of fp32, "
                                "fp16, bf16, fp64\n",
                        value ? value : "(missing)");
                return FA_EXIT_USAGE;
            }
        }
        if (!matched) {
            fprintf(stderr, "flashattn bench --decode: unknown option '%s' (flashattn bench "
                            "--decode --help lists them)\n",
                    arg);
            return FA_EXIT_USAGE;
        }
        if (takes && !eq)
            i++;
    }
    if (cfg->head_dim_v == 0)
        cfg->head_dim_v = cfg->head_dim;
    if (cfg->context + cfg->new_keys < 1) {
        fprintf(stderr, "flashattn bench --decode: --context + --new must be at least 1\n");
        return FA_EXIT_USAGE;
    }
    return FA_EXIT_OK;
}

/* splitmix64: inputs in [-1, 1), never exactly 0 */
static double rand_uniform(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    double u = ((double)(z >> 11) + 0.5) * ldexp(1.0, -53);
    return 2.0 * u - 1.0;
}

static void tensor_fill(const fa_tensor *t, uint64_t *s)
{
    int64_t idx[FA_MAX_DIMS] = {0};
    if (fa_bench_numel(t) == 0)
        return;
    for (int64_t k = 0, n = fa_bench_numel(t); k < n; k++) {
        fa_ref_store(t, idx, fa_ref_round(rand_uniform(s), t->dtype));
        fa_bench_index_next(t, idx);
    }
}

typedef struct decode_problem {
    fa_tensor q, kc, vc, kn, vn, out, seqlens, table;
    fa_kvcache_args args;
    int32_t *lens, *blocks;
    void *buf[6];
    int64_t positions, max_blocks;
} decode_problem;

static void *zalloc(size_t n)
{
    return calloc(n ? n : 1, 1);
}

static int problem_init(decode_problem *P, const decode_config *c)
{
    memset(P, 0, sizeof *P);
    const size_t es = fa_dtype_size(c->dtype);
    const int64_t b = c->batch, hk = c->kv_heads, n = c->context + c->new_keys;
    int64_t rows_per_seq = n, nblocks = b;
    if (c->page_size) {
        P->max_blocks = (n + c->page_size - 1) / c->page_size;
        rows_per_seq = c->page_size;
        nblocks = b * P->max_blocks;
    }
    P->positions = n;
    int64_t sq[4] = {b, c->seqlen_q, c->heads, c->head_dim};
    int64_t so[4] = {b, c->seqlen_q, c->heads, c->head_dim_v};
    int64_t sk[4] = {nblocks, rows_per_seq, hk, c->head_dim};
    int64_t sv[4] = {nblocks, rows_per_seq, hk, c->head_dim_v};
    int64_t skn[4] = {b, c->new_keys, hk, c->head_dim};
    int64_t svn[4] = {b, c->new_keys, hk, c->head_dim_v};
    int64_t *shapes[6] = {sq, sk, sv, skn, svn, so};
    fa_tensor *ts[6] = {&P->q, &P->kc, &P->vc, &P->kn, &P->vn, &P->out};
    for (int k = 0; k < 6; k++) {
        int64_t cnt = shapes[k][0] * shapes[k][1] * shapes[k][2] * shapes[k][3];
        P->buf[k] = zalloc((size_t)cnt * es);
        if (!P->buf[k])
            return FA_EXIT_FAIL;
        *ts[k] = fa_tensor_make(P->buf[k], c->dtype, 4, shapes[k], NULL);
    }
    uint64_t s = c->seed;
    for (int k = 0; k < 5; k++)
        tensor_fill(ts[k], &s);
    P->lens = zalloc(sizeof(int32_t) * (size_t)b);
    for (int64_t i = 0; i < b; i++)
        P->lens[i] = (int32_t)c->context;
    int64_t sb[1] = {b};
    P->seqlens = fa_tensor_make(P->lens, FA_DTYPE_I32, 1, sb, NULL);

    fa_kvcache_args *a = &P->args;
    fa_kvcache_args_init(a);
    a->q = &P->q;
    a->k_cache = &P->kc;
    a->v_cache = &P->vc;
    a->out = &P->out;
    a->cache_seqlens = &P->seqlens;
    if (c->new_keys) {
        a->k = &P->kn;
        a->v = &P->vn;
    }
    if (c->page_size) {
        /* Blocks in a scrambled order, as an allocator hands them out over time (7919 is
           prime: k * 7919 mod N permutes 0..N-1 unless N is a multiple of it). */
        P->blocks = zalloc(sizeof(int32_t) * (size_t)(b * P->max_blocks));
        for (int64_t k = 0; k < b * P->max_blocks; k++)
            P->blocks[k] = (int32_t)((k * 7919) % (b * P->max_blocks));
        int64_t st[2] = {b, P->max_blocks};
        if (((b * P->max_blocks) % 7919) == 0)
            for (int64_t k = 0; k < b * P->max_blocks; k++)
                P->blocks[k] = (int32_t)k;
        P->table = fa_tensor_make(P->blocks, FA_DTYPE_I32, 2, st, NULL);
        a->block_table = &P->table;
    }
    a->num_splits = (int)c->num_splits;
    a->num_threads = (int)c->threads;
    return FA_EXIT_OK;
}

static void problem_free(decode_problem *P)
{
    for (int k = 0; k < 6; k++)
        free(P->buf[k]);
    free(P->lens);
    free(P->blocks);
}

/* The oracle on the keys gathered from the cache (after the append), all rows compared. */
static int problem_check(const decode_problem *P, const decode_config *c, double *err,
                         double *tol)
{
    const size_t es = fa_dtype_size(c->dtype);
    const int64_t b = c->batch, hk = c->kv_heads, n = P->positions;
    const int64_t tq = b * c->seqlen_q;
    int64_t sk[3] = {b * n, hk, c->head_dim}, sv[3] = {b * n, hk, c->head_dim_v};
    int64_t sq[3] = {tq, c->heads, c->head_dim}, so[3] = {tq, c->heads, c->head_dim_v};
    int64_t s1[1] = {b + 1};
    char *kd = zalloc((size_t)(b * n * hk * c->head_dim) * es);
    char *vd = zalloc((size_t)(b * n * hk * c->head_dim_v) * es);
    int32_t *cuq = zalloc(sizeof(int32_t) * (size_t)(b + 1));
    int32_t *cuk = zalloc(sizeof(int32_t) * (size_t)(b + 1));
    double *ref = zalloc(sizeof(double) * (size_t)(tq * c->heads * c->head_dim_v));
    double *low = zalloc(sizeof(double) * (size_t)(tq * c->heads * c->head_dim_v));
    const size_t krow = (size_t)(hk * c->head_dim) * es, vrow = (size_t)(hk * c->head_dim_v) * es;
    for (int64_t i = 0; i < b; i++) {
        cuq[i + 1] = (int32_t)((i + 1) * c->seqlen_q);
        cuk[i + 1] = (int32_t)((i + 1) * n);
        for (int64_t j = 0; j < n; j++) {
            int64_t blk = c->page_size ? P->blocks[i * P->max_blocks + j / c->page_size] : i;
            int64_t row = c->page_size ? j % c->page_size : j;
            int64_t at = blk * P->kc.shape[1] + row;
            memcpy(kd + (size_t)(i * n + j) * krow, (char *)P->kc.data + (size_t)at * krow, krow);
            memcpy(vd + (size_t)(i * n + j) * vrow, (char *)P->vc.data + (size_t)at * vrow, vrow);
        }
    }
    fa_tensor tk = fa_tensor_make(kd, c->dtype, 3, sk, NULL);
    fa_tensor tv = fa_tensor_make(vd, c->dtype, 3, sv, NULL);
    fa_tensor tqv = fa_tensor_make(P->q.data, c->dtype, 3, sq, NULL);
    fa_tensor tout = fa_tensor_make(P->out.data, c->dtype, 3, so, NULL);
    fa_tensor tcuq = fa_tensor_make(cuq, FA_DTYPE_I32, 1, s1, NULL);
    fa_tensor tcuk = fa_tensor_make(cuk, FA_DTYPE_I32, 1, s1, NULL);
    fa_fwd_args f;
    fa_fwd_args_init(&f);
    f.q = &tqv;
    f.k = &tk;
    f.v = &tv;
    f.out = &tout;
    f.cu_seqlens_q = &tcuq;
    f.cu_seqlens_k = &tcuk;
    f.max_seqlen_q = c->seqlen_q;
    f.max_seqlen_k = n;
    int rc = fa_ref_forward(&f, 1, ref, NULL) == 0 ? FA_EXIT_OK : FA_EXIT_FAIL;
    double vmax = 1.0, low_err = 0.0;
    *err = 0.0;
    if (rc == FA_EXIT_OK && (c->dtype == FA_DTYPE_F16 || c->dtype == FA_DTYPE_BF16))
        rc = fa_ref_forward_lowp(&f, low) == 0 ? FA_EXIT_OK : FA_EXIT_FAIL;
    for (int64_t x = 0; rc == FA_EXIT_OK && x < tq * c->heads * c->head_dim_v; x++) {
        int64_t idx[3] = {x / (c->heads * c->head_dim_v), (x / c->head_dim_v) % c->heads,
                          x % c->head_dim_v};
        double got = fa_ref_load(&tout, idx);
        double e = fabs(got - ref[x]);
        *err = isnan(got) || e > *err ? (isnan(got) ? INFINITY : e) : *err;
        vmax = fmax(vmax, fabs(ref[x]));
        low_err = fmax(low_err, fabs(low[x] - ref[x]));
    }
    if (c->dtype == FA_DTYPE_F64)
        *tol = 1e-12 * vmax;
    else if (c->dtype == FA_DTYPE_F32)
        *tol = 1e-5 * vmax;
    else
        *tol = 2.0 * low_err + (c->dtype == FA_DTYPE_F16 ? ldexp(1.0, -11) : ldexp(1.0, -8)) * vmax;
    free(kd);
    free(vd);
    free(cuq);
    free(cuk);
    free(ref);
    free(low);
    return rc;
}

int fa_bench_decode_main(int argc, char **argv)
{
    decode_config c;
    int rc = decode_parse(argc, argv, &c);
    if (rc < 0) {
        decode_usage(stdout);
        return FA_EXIT_OK;
    }
    if (rc != FA_EXIT_OK)
        return rc;
    decode_problem P;
    if (problem_init(&P, &c) != FA_EXIT_OK) {
        fprintf(stderr, "flashattn bench --decode: out of memory\n");
        problem_free(&P);
        return FA_EXIT_FAIL;
    }
    const long long threads = c.threads ? c.threads : fa_cpu_default_threads();
    char shape[200], cache[120], splits[64];
    snprintf(shape, sizeof shape,
             "b=%lld h=%lld hk=%lld sq=%lld context=%lld new=%lld d=%lld dv=%lld",
             (long long)c.batch, (long long)c.heads, (long long)c.kv_heads, (long long)c.seqlen_q,
             (long long)c.context, (long long)c.new_keys, (long long)c.head_dim,
             (long long)c.head_dim_v);
    if (c.page_size)
        snprintf(cache, sizeof cache, "paged, %lld positions per block, %lld blocks",
                 (long long)c.page_size, (long long)P.kc.shape[0]);
    else
        snprintf(cache, sizeof cache, "contiguous");
    if (c.num_splits)
        snprintf(splits, sizeof splits, "%lld", (long long)c.num_splits);
    else
        snprintf(splits, sizeof splits, "0 (the library's choice)");
    printf("flashattn %s bench --decode\n", fa_version());
    printf(LABEL "%s\n", "shape", shape);
    printf(LABEL "%s\n", "cache", cache);
    printf(LABEL "%s\n", "dtype", fa_dtype_name(c.dtype));
    printf(LABEL "%s\n", "num_splits", splits);
    printf(LABEL "cpu, %lld thread%s\n", "device", threads, threads == 1 ? "" : "s");
    fflush(stdout);

    double total = 0.0, best = INFINITY;
    for (int64_t k = 0; k < c.warmup + c.iters; k++) {
        /* Poisoned before every call, so that the check sees what the timed call wrote. */
        memset(P.out.data, 0xff, (size_t)fa_bench_numel(&P.out) * fa_dtype_size(c.dtype));
        double t0 = seconds_now();
        fa_status st = fa_attention_kvcache(&P.args);
        double dt = seconds_now() - t0;
        if (st != FA_STATUS_OK) {
            fprintf(stderr, "flashattn bench --decode: fa_attention_kvcache: %s: %s\n",
                    fa_status_string(st), fa_last_error());
            problem_free(&P);
            return st == FA_STATUS_INVALID_ARGUMENT ? FA_EXIT_USAGE : FA_EXIT_FAIL;
        }
        if (k >= c.warmup) {
            total += dt;
            best = fmin(best, dt);
        }
    }
    const double mean = total / (double)c.iters;
    const double bytes = (double)(c.batch * c.kv_heads * P.positions) *
                         (double)(c.head_dim + c.head_dim_v) * (double)fa_dtype_size(c.dtype);
    printf(LABEL "%.3f ms mean, %.3f ms min over %lld calls (%lld warmup)\n", "time", mean * 1e3,
           best * 1e3, (long long)c.iters, (long long)c.warmup);
    printf(LABEL "%.2f MiB of K and V per call (%lld keys x %lld kv heads x %lld sequences)\n",
           "traffic", bytes / 1048576.0, (long long)P.positions, (long long)c.kv_heads,
           (long long)c.batch);
    printf(LABEL "%.2f GB/s mean, %.2f GB/s best\n", "bandwidth", bytes / mean * 1e-9,
           bytes / best * 1e-9);
    const char *verdict = "skipped";
    rc = FA_EXIT_OK;
    if (c.check) {
        double err = 0.0, tol = 0.0;
        if (problem_check(&P, &c, &err, &tol) != FA_EXIT_OK) {
            fprintf(stderr, "flashattn bench --decode: the oracle failed\n");
            problem_free(&P);
            return FA_EXIT_FAIL;
        }
        verdict = err <= tol ? "PASS" : "FAIL";
        rc = err <= tol ? FA_EXIT_OK : FA_EXIT_FAIL;
        printf(LABEL "%s: every output row against the fp64 oracle, max |err| %.3g, tolerance "
               "%.3g\n",
               "check", verdict, err, tol);
    }
    printf("decode %s %s page=%lld splits=%s threads=%lld: %.3f ms, %.2f GB/s, check %s\n",
           fa_dtype_name(c.dtype), shape, (long long)c.page_size, splits, threads, mean * 1e3,
           bytes / mean * 1e-9, verdict);
    problem_free(&P);
    return rc;
}
