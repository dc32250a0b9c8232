/*
 * `flashattn bench --bwd`: times fa_attention_backward on the problem the forward just ran (its
 * out and lse), and checks dq, dk, dv (and dsinks) against the oracle's analytic gradients.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fa_bench.h"
#include "fa_ref.h"
#include "fa_ref_bwd.h"

#define LABEL "  %-10s"
/* The oracle's loops cost a few times h * (every query-key pair) * (d + dv) multiply-adds (the
 * gradients and their magnitudes; for fp16/bf16 also the naive baseline and the gradients with
 * the stored out's D): a few seconds at this budget.
 * Unlike the forward's out, dk and dv need every query row, so bigger problems are not checked
 * on a sample but skipped. */
#define BWD_ORACLE_BUDGET 1e8

/* The backward's tensors: contiguous, shaped like q, k, v, out (and sinks). */
typedef struct bwd_tensors {
    fa_tensor dout, dq, dk, dv, dsinks;
    fa_bwd_args args;
    void *buffers[5];
    int num_buffers;
} bwd_tensors;

static double seconds_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void bwd_tensors_free(bwd_tensors *b)
{
    for (int i = 0; i < b->num_buffers; i++)
        free(b->buffers[i]);
    b->num_buffers = 0;
}

/* A contiguous tensor shaped like `like`, 64-byte aligned as the forward's are. */
static int like_alloc(bwd_tensors *b, fa_tensor *t, const fa_tensor *like)
{
    size_t bytes = (size_t)fa_bench_numel(like) * fa_dtype_size(like->dtype);
    void *data = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (!data) {
        fprintf(stderr, "flashattn bench: out of memory for the backward's tensors\n");
        return FA_EXIT_FAIL;
    }
    b->buffers[b->num_buffers++] = data;
    *t = fa_tensor_make(data, like->dtype, like->ndim, like->shape, NULL);
    return FA_EXIT_OK;
}

/* Element e of a contiguous tensor, whatever its dtype. */
static double flat_load(const fa_tensor *t, int64_t e)
{
    fa_tensor flat = fa_tensor_make(t->data, t->dtype, 1, &e, NULL);
    int64_t idx[1] = {e};
    return fa_ref_load(&flat, idx);
}

static void flat_store(const fa_tensor *t, int64_t e, double x)
{
    fa_tensor flat = fa_tensor_make(t->data, t->dtype, 1, &e, NULL);
    int64_t idx[1] = {e};
    fa_ref_store(&flat, idx, x);
}

/* dout: standard normal values (Box-Muller on splitmix64), seeded apart from the inputs. */
static void dout_fill(const fa_tensor *t, uint64_t seed)
{
    uint64_t state = seed ^ 0x6a09e667f3bcc909ull;
    const int64_t n = fa_bench_numel(t);
    for (int64_t e = 0; e < n; e++) {
        double u[2];
        for (int k = 0; k < 2; k++) {
            uint64_t z = (state += 0x9e3779b97f4a7c15ull);
            z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
            z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
            u[k] = (double)(((z ^ (z >> 31)) >> 11) + 1) * 0x1p-53; /* (0, 1] */
        }
        flat_store(t, e, sqrt(-2.0 * log(u[0])) * cos(6.283185307179586 * u[1]));
    }
}

static int bwd_tensors_init(bwd_tensors *b, const fa_bench_problem *p, const fa_bench_config *cfg)
{
    memset(b, 0, sizeof *b);
    int rc;
    if ((rc = like_alloc(b, &b->dout, &p->out)) != FA_EXIT_OK ||
        (rc = like_alloc(b, &b->dq, &p->q)) != FA_EXIT_OK ||
        (rc = like_alloc(b, &b->dk, &p->k)) != FA_EXIT_OK ||
        (rc = like_alloc(b, &b->dv, &p->v)) != FA_EXIT_OK ||
        (cfg->sinks && (rc = like_alloc(b, &b->dsinks, &p->sinks)) != FA_EXIT_OK)) {
        bwd_tensors_free(b);
        return rc;
    }
    dout_fill(&b->dout, cfg->seed);
    fa_bwd_args_init(&b->args);
    b->args.fwd = &p->args;
    b->args.dout = &b->dout;
    b->args.dq = &b->dq;
    b->args.dk = &b->dk;
    b->args.dv = &b->dv;
    b->args.dsinks = cfg->sinks ? &b->dsinks : NULL;
    return FA_EXIT_OK;
}

/* NaN everywhere, so that an element the backward never writes fails the check. */
static void grads_poison(const bwd_tensors *b)
{
    const fa_tensor *g[4] = {&b->dq, &b->dk, &b->dv, &b->dsinks};
    for (int i = 0; i < (b->args.dsinks ? 4 : 3); i++)
        for (int64_t e = 0; e < fa_bench_numel(g[i]); e++)
            flat_store(g[i], e, NAN);
}

static int calls_time(const bwd_tensors *b, const fa_bench_config *cfg, fa_bench_bwd_result *r)
{
    r->min_s = INFINITY;
    double total = 0.0;
    for (int64_t i = 0; i < cfg->warmup + cfg->iters; i++) {
        double t0 = seconds_now();
        fa_status st = fa_attention_backward(&b->args);
        double dt = seconds_now() - t0;
        if (st != FA_STATUS_OK) {
            fprintf(stderr, "flashattn bench: fa_attention_backward: %s: %s\n",
                    fa_status_string(st), fa_last_error());
            return st == FA_STATUS_INVALID_ARGUMENT ? FA_EXIT_USAGE : FA_EXIT_FAIL;
        }
        if (i < cfg->warmup)
            continue;
        total += dt;
        r->min_s = fmin(r->min_s, dt);
    }
    r->mean_s = total / (double)cfg->iters;
    return FA_EXIT_OK;
}

/* Every (query, key) pair of every sequence, visible or not: what the oracle's loops visit. */
static double all_pairs(const fa_fwd_args *a)
{
    if (!a->cu_seqlens_q)
        return (double)a->q->shape[0] * (double)a->q->shape[1] * (double)a->k->shape[1];
    const int32_t *cu_q = a->cu_seqlens_q->data, *cu_k = a->cu_seqlens_k->data;
    double pairs = 0.0;
    for (int64_t s = 0; s + 1 < a->cu_seqlens_q->shape[0]; s++)
        pairs += (double)(cu_q[s + 1] - cu_q[s]) * (double)(cu_k[s + 1] - cu_k[s]);
    return pairs;
}

/*
 * One gradient against the oracle's: G the gradient, M its magnitude (sum of |terms|), and for
 * fp16/bf16 N the naive same-dtype baseline and S the gradient with D from out as stored in the
 * dtype. The criteria are test_backward's: with m = max|G| and mm = max|M|, fp64 (fp64 lse)
 * 1e-10 m + 1e-13 mm, fp32 1e-4 m + 1e-6 mm (fp64 with the bench's fp32 lse too), fp16/bf16
 * 3 max|N - G| + 3 max|S - G| + 2 u m + 1e-6 mm with u the dtype's half ulp; plus
 * extra_rel * mm (the lse's and ALiBi's magnitudes, dsinks' fp32 rounding).
 */
static int grad_check(const char *name, const fa_tensor *t, int64_t n, const double *g,
                      const double *m, const double *naive, const double *stored,
                      const fa_bench_problem *p, double extra_rel)
{
    double err = 0.0, maxg = 0.0, maxm = 0.0, naive_err = 0.0, stored_err = 0.0;
    int64_t unwritten = 0;
    for (int64_t e = 0; e < n; e++) {
        double got = flat_load(t, e);
        unwritten += !isfinite(got);
        err = fmax(err, isnan(got) ? INFINITY : fabs(got - g[e]));
        maxg = fmax(maxg, fabs(g[e]));
        maxm = fmax(maxm, m[e]);
        if (naive) {
            naive_err = fmax(naive_err, fabs(naive[e] - g[e]));
            stored_err = fmax(stored_err, fabs(stored[e] - g[e]));
        }
    }
    const fa_dtype dt = p->q.dtype;
    double tol;
    char crit[128];
    if (dt == FA_DTYPE_F64 && p->lse.dtype == FA_DTYPE_F64) {
        tol = 1e-10 * maxg + 1e-13 * maxm;
        snprintf(crit, sizeof crit, "1e-10 max|ref| + 1e-13 max|terms|");
    } else if (dt == FA_DTYPE_F32 || dt == FA_DTYPE_F64) {
        tol = 1e-4 * maxg + 1e-6 * maxm;
        snprintf(crit, sizeof crit, "1e-4 max|ref| + 1e-6 max|terms|");
    } else {
        const double u = dt == FA_DTYPE_F16 ? 0x1p-11 : 0x1p-8;
        tol = 3.0 * naive_err + 3.0 * stored_err + 2.0 * u * maxg + 1e-6 * maxm;
        snprintf(crit, sizeof crit,
                 "3 (naive %s err %.3g + stored-out err %.3g) + 2 u max|ref| + 1e-6 max|terms|",
                 fa_dtype_name(dt), naive_err, stored_err);
    }
    tol += extra_rel * maxm;
    const int pass = err <= tol && unwritten == 0;
    printf(LABEL "%-6s max |err| %.3g, tolerance %.3g = %s%s\n", "", name, err, tol, crit,
           unwritten ? " (unwritten or non-finite elements)" : "");
    return pass;
}

/* FA_EXIT_OK and *pass, or FA_EXIT_FAIL when the oracle could not run. */
static int grads_check(const bwd_tensors *b, const fa_bench_problem *p, const fa_bench_config *cfg,
                       int *pass)
{
    const int64_t n[4] = {fa_bench_numel(&b->dq), fa_bench_numel(&b->dk), fa_bench_numel(&b->dv),
                          cfg->sinks ? cfg->heads : 1};
    const int lowp = cfg->dtype == FA_DTYPE_F16 || cfg->dtype == FA_DTYPE_BF16;
    double *g[4], *m[4], *naive[4] = {NULL, NULL, NULL, NULL}, *st[4] = {NULL, NULL, NULL, NULL};
    int ok = 1, rc = FA_EXIT_FAIL;
    for (int i = 0; i < 4; i++) {
        const size_t bytes = sizeof(double) * (size_t)(n[i] + 1);
        g[i] = malloc(bytes);
        m[i] = malloc(bytes);
        naive[i] = lowp ? malloc(bytes) : NULL;
        st[i] = lowp ? malloc(bytes) : NULL;
        ok = ok && g[i] && m[i] && (!lowp || (naive[i] && st[i]));
    }
    if (!ok || fa_ref_backward_mag(&b->args, g[0], g[1], g[2], g[3], m[0], m[1], m[2], m[3]) ||
        (lowp && fa_ref_backward_lowp(&b->args, naive[0], naive[1], naive[2], naive[3])) ||
        (lowp && fa_ref_backward_stored_out(&b->args, st[0], st[1], st[2], st[3]))) {
        fprintf(stderr, "flashattn bench: the gradient oracle failed (memory or arguments)\n");
        goto done;
    }
    /* P = exp(s - lse) from the stored lse: errors ~eps |lse| (and ~eps |s|, up to slope *
     * distance with ALiBi, slopes <= 1 here) in the exponent move every term by that much. */
    const double eps = p->lse.dtype == FA_DTYPE_F64 ? 0x1p-53 : 0x1p-24;
    double lse_max = 0.0;
    for (int64_t e = 0; e < fa_bench_numel(&p->lse); e++) {
        const double x = fabs(flat_load(&p->lse, e));
        lse_max = isfinite(x) ? fmax(lse_max, x) : lse_max;
    }
    double extra_rel = 4.0 * eps * lse_max;
    if (cfg->alibi) {
        const int64_t longest = p->args.cu_seqlens_q
                                    ? p->args.max_seqlen_q + p->args.max_seqlen_k
                                    : cfg->seqlen_q + cfg->seqlen_k;
        extra_rel += 4.0 * eps * (double)longest;
    }
    const char *names[4] = {"dq", "dk", "dv", "dsinks"};
    const fa_tensor *views[4] = {&b->dq, &b->dk, &b->dv, &b->dsinks};
    *pass = 1;
    for (int i = 0; i < (cfg->sinks ? 4 : 3); i++)
        *pass &= grad_check(names[i], views[i], n[i], g[i], m[i], naive[i], st[i], p,
                            extra_rel + (i == 3 ? 0x1p-23 : 0.0));
    rc = FA_EXIT_OK;
done:
    for (int i = 0; i < 4; i++) {
        free(g[i]);
        free(m[i]);
        free(naive[i]);
        free(st[i]);
    }
    return rc;
}

int fa_bench_bwd_run(const fa_bench_problem *p, const fa_bench_config *cfg,
                     fa_bench_bwd_result *r, double fwd_flop)
{
    memset(r, 0, sizeof *r); /* verdict NULL until the backward has been timed */
    bwd_tensors b;
    int rc = bwd_tensors_init(&b, p, cfg);
    if (rc != FA_EXIT_OK)
        return rc;
    grads_poison(&b);
    if ((rc = calls_time(&b, cfg, r)) != FA_EXIT_OK) {
        bwd_tensors_free(&b);
        return rc;
    }
    r->verdict = "skipped";
    const double flop = 2.5 * fwd_flop;
    printf(LABEL "%.3f ms mean, %.3f ms min over %lld calls (%lld warmup)\n", "bwd time",
           r->mean_s * 1e3, r->min_s * 1e3, (long long)cfg->iters, (long long)cfg->warmup);
    printf(LABEL "%.4g GFLOP = 2.5 x the forward's (FlashAttention's convention)\n", "bwd work",
           flop * 1e-9);
    printf(LABEL "%.3f TFLOP/s mean, %.3f TFLOP/s best\n", "bwd speed",
           r->mean_s > 0 ? flop / r->mean_s * 1e-12 : 0.0,
           r->min_s > 0 ? flop / r->min_s * 1e-12 : 0.0);
    fflush(stdout);

    const double cost = (double)cfg->heads * all_pairs(&p->args) *
                        (double)(cfg->head_dim + cfg->head_dim_v);
    if (!cfg->check) {
        printf(LABEL "skipped (--no-check)\n", "bwd check");
    } else if (cost > BWD_ORACLE_BUDGET) {
        printf(LABEL "skipped: h * pairs * (d + dv) = %.3g is above the oracle's budget %.3g "
               "(dk and dv need every row); smaller shapes are checked\n",
               "bwd check", cost, BWD_ORACLE_BUDGET);
    } else {
        printf(LABEL "gradients against the fp64 oracle (fa_ref_backward)\n", "bwd check");
        int pass = 0;
        if ((rc = grads_check(&b, p, cfg, &pass)) == FA_EXIT_OK) {
            r->verdict = pass ? "PASS" : "FAIL";
            printf(LABEL "%s\n", "", r->verdict);
            rc = pass ? FA_EXIT_OK : FA_EXIT_FAIL;
        }
    }
    fflush(stdout);
    bwd_tensors_free(&b);
    return rc;
}

void fa_bench_bwd_summary(const fa_bench_config *cfg, const char *shape, const char *features,
                          double fwd_s, double fwd_flop, const fa_bench_bwd_result *r)
{
    const double bwd_flop = 2.5 * fwd_flop, both_s = fwd_s + r->mean_s;
    printf("bwd %s %s [%s]: %.3f ms, %.3f TFLOP/s, check %s\n", fa_dtype_name(cfg->dtype), shape,
           features, r->mean_s * 1e3, r->mean_s > 0 ? bwd_flop / r->mean_s * 1e-12 : 0.0,
           r->verdict);
    printf("fwd+bwd %s %s [%s]: %.3f ms, %.3f TFLOP/s\n", fa_dtype_name(cfg->dtype), shape,
           features, both_s * 1e3, both_s > 0 ? (fwd_flop + bwd_flop) / both_s * 1e-12 : 0.0);
}
