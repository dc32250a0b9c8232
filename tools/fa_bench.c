/* `flashattn bench`: time fa_attention_forward, report TFLOP/s, check against the oracle. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */

#include <math.h>
#include <string.h>
#include <time.h>

#include "fa_bench.h"

#define LABEL "  %-10s"

static double seconds_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Arguments the library rejects are usage errors of this command; anything else is a failure. */
static int library_failure(fa_status st)
{
    fprintf(stderr, "flashattn bench: fa_attention_forward: %s: %s\n", fa_status_string(st),
            fa_last_error());
    return st == FA_STATUS_INVALID_ARGUMENT ? FA_EXIT_USAGE : FA_EXIT_FAIL;
}

typedef struct bench_timing {
    double mean_s, min_s;
} bench_timing;

static int calls_time(const fa_bench_problem *p, const fa_bench_config *cfg, bench_timing *t)
{
    fa_status st;
    for (int64_t i = 0; i < cfg->warmup; i++) {
        if ((st = fa_attention_forward(&p->args)) != FA_STATUS_OK)
            return library_failure(st);
    }
    double total = 0.0;
    t->min_s = INFINITY;
    for (int64_t i = 0; i < cfg->iters; i++) {
        double t0 = seconds_now();
        st = fa_attention_forward(&p->args);
        double dt = seconds_now() - t0;
        if (st != FA_STATUS_OK)
            return library_failure(st);
        total += dt;
        t->min_s = fmin(t->min_s, dt);
    }
    t->mean_s = total / (double)cfg->iters;
    return FA_EXIT_OK;
}

static void shape_format(const fa_bench_config *cfg, char *dst, size_t size)
{
    snprintf(dst, size, "b=%lld h=%lld hk=%lld sq=%lld sk=%lld d=%lld dv=%lld",
             (long long)cfg->batch, (long long)cfg->heads, (long long)cfg->kv_heads,
             (long long)cfg->seqlen_q, (long long)cfg->seqlen_k, (long long)cfg->head_dim,
             (long long)cfg->head_dim_v);
}

static void header_print(const fa_bench_problem *p, const fa_bench_config *cfg,
                         const char *features)
{
    char shape[160];
    shape_format(cfg, shape, sizeof shape);
    printf("flashattn %s bench\n", fa_version());
    printf(LABEL "%s\n", "shape", shape);
    if (cfg->varlen)
        printf(LABEL "varlen: %lld sequences, %lld query tokens (longest %lld), %lld key tokens "
               "(longest %lld)\n",
               "", (long long)cfg->batch, (long long)p->tokens_q,
               (long long)p->args.max_seqlen_q, (long long)p->k.shape[0],
               (long long)p->args.max_seqlen_k);
    printf(LABEL "%s\n", "dtype", fa_dtype_name(cfg->dtype));
    printf(LABEL "%s\n", "features", features);
    if (cfg->device == FA_DEVICE_CPU) {
        long long threads = cfg->threads ? cfg->threads : fa_cpu_default_threads();
        printf(LABEL "cpu, %lld thread%s\n", "device", threads, threads == 1 ? "" : "s");
    }
    else
        printf(LABEL "cuda:%d\n", "device", cfg->device);
    fflush(stdout);
}

static void check_print(const fa_bench_check_result *r, int64_t tokens)
{
    printf(LABEL "%s: %lld of %lld query tokens against the fp64 oracle\n", "check",
           r->pass ? "PASS" : "FAIL", (long long)r->tokens_checked, (long long)tokens);
    printf(LABEL "out max |err| %.3g, tolerance %.3g = %s\n", "", r->out_err, r->out_tol,
           r->criterion);
    printf(LABEL "lse max |err| %.3g, tolerance %.3g\n", "", r->lse_err, r->lse_tol);
    if (r->unwritten)
        printf(LABEL "%lld elements of out/lse unwritten or not finite\n", "",
               (long long)r->unwritten);
}

int fa_bench_main(int argc, char **argv)
{
    for (int i = 0; i < argc; i++)
        if (strcmp(argv[i], "--decode") == 0)
            return fa_bench_decode_main(argc, argv);
    fa_bench_config cfg;
    int rc = fa_bench_config_parse(argc, argv, &cfg);
    if (rc < 0) {
        fa_bench_usage(stdout);
        return FA_EXIT_OK;
    }
    if (rc != FA_EXIT_OK)
        return rc;

    fa_bench_problem prob;
    if ((rc = fa_bench_problem_init(&prob, &cfg)) != FA_EXIT_OK)
        return rc;
    char features[160];
    fa_bench_features_format(&cfg, features, sizeof features);
    header_print(&prob, &cfg, features);

    fa_bench_outputs_poison(&prob);
    bench_timing timing;
    if ((rc = calls_time(&prob, &cfg, &timing)) != FA_EXIT_OK) {
        fa_bench_problem_free(&prob);
        return rc;
    }
    const double pairs = fa_bench_visible_pairs(&prob.args);
    const double flop = 2.0 * (double)cfg.heads * pairs * (double)(cfg.head_dim + cfg.head_dim_v);
    const double tflops_mean = timing.mean_s > 0 ? flop / timing.mean_s * 1e-12 : 0.0;
    const double tflops_best = timing.min_s > 0 ? flop / timing.min_s * 1e-12 : 0.0;
    printf(LABEL "%.3f ms mean, %.3f ms min over %lld calls (%lld warmup)\n", "time",
           timing.mean_s * 1e3, timing.min_s * 1e3, (long long)cfg.iters,
           (long long)cfg.warmup);
    printf(LABEL "%.4g GFLOP = 2 * h * (d + dv) * %.0f visible pairs (%.1f keys per query)\n",
           "work", flop * 1e-9, pairs, prob.tokens_q ? pairs / (double)prob.tokens_q : 0.0);
    printf(LABEL "%.3f TFLOP/s mean, %.3f TFLOP/s best\n", "speed", tflops_mean, tflops_best);
    fflush(stdout);

    const char *verdict = "skipped";
    if (cfg.check) {
        fa_bench_check_result check;
        if ((rc = fa_bench_check(&prob, &cfg, &check)) != FA_EXIT_OK) {
            fa_bench_problem_free(&prob);
            return rc;
        }
        check_print(&check, prob.tokens_q);
        verdict = check.pass ? "PASS" : "FAIL";
        rc = check.pass ? FA_EXIT_OK : FA_EXIT_FAIL;
    }

    fa_bench_bwd_result bwd;
    int rc_bwd = FA_EXIT_OK;
    if (cfg.bwd)
        rc_bwd = fa_bench_bwd_run(&prob, &cfg, &bwd, flop);

    char shape[160];
    shape_format(&cfg, shape, sizeof shape);
    printf("fwd %s %s [%s]: %.3f ms, %.3f TFLOP/s, check %s\n", fa_dtype_name(cfg.dtype), shape,
           features, timing.mean_s * 1e3, tflops_mean, verdict);
    if (cfg.bwd && bwd.verdict) /* NULL when the backward could not run */
        fa_bench_bwd_summary(&cfg, shape, features, timing.mean_s, flop, &bwd);
    fa_bench_problem_free(&prob);
    return rc_bwd > rc ? rc_bwd : rc;
}
