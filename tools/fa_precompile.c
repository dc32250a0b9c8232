/*
 * `flashattn precompile [--arch LIST] [--hdim LIST] [--dtype LIST] [--features LIST] [--jobs N]`
 * compiles every configuration of the matrix with NVRTC into the disk cache, in parallel. It needs
 * no GPU, so CI runs it to catch a kernel that stops compiling. Without NVRTC it fails under CI
 * (CI=true), where the toolkit is expected, and skips elsewhere. On a terminal a progress line
 * (done/total, failures, elapsed) is rewritten in place on stderr; otherwise (a log) there is
 * none, only the summary, failures and the -v lines.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fa_bench.h"
#include "fa_precompile.h"

#define FA_PC_MAX 16 /* entries per list */

typedef struct fa_pc_job {
    int arch;
    fa_dtype dtype;
    int hdim, hdim_v; /* Q and K's head dim, V's */
    unsigned features;
    fa_status status;
    int cached;
    char error[512];
} fa_pc_job;

/* The jobs, and what the workers report as each finishes (under lock). */
typedef struct fa_pc_queue {
    fa_pc_job *jobs;
    int count;
    int next;
    int done;
    int failed;
    int verbose;
    int progress;    /* 1: a progress line on stderr, rewritten in place (a terminal) */
    int line_width;  /* characters of the progress line now shown, 0 when none */
    struct timespec start;
    pthread_mutex_t lock;
    pthread_cond_t finished; /* signalled as each job finishes */
} fa_pc_queue;

static const struct {
    const char *name;
    unsigned bit;
} fa_pc_feature_names[] = {
    {"varlen", FA_FEATURE_VARLEN},   {"alibi", FA_FEATURE_ALIBI},
    {"softcap", FA_FEATURE_SOFTCAP}, {"dropout", FA_FEATURE_DROPOUT},
    {"unaligned", FA_FEATURE_UNALIGNED},
};

static void fa_pc_usage(FILE *f)
{
    fputs("usage: flashattn precompile [options]\n"
          "  --arch LIST      sm_80,sm_86,sm_89,sm_90a,... (default sm_80,sm_90a)\n"
          "  --hdim LIST      head dims, each D or D:DV where V's differs (default\n"
          "                   32,64,96,128,192,256,192:128); past 256 (MLA's 576:512)\n"
          "                   the decode kernels alone\n"
          "  --dtype LIST     fp16,bf16 (default both), or fp8_e4m3 (the sm_90a fp8 forward\n"
          "                   kernel only, bf16 and fp16 outputs)\n"
          "  --features LIST  feature sets, each none or names joined by '+' from varlen, alibi,\n"
          "                   softcap, dropout, unaligned (default\n"
          "                   none,varlen,varlen+alibi+dropout,dropout,softcap+unaligned)\n"
          "  --jobs N         parallel compiles (default: the number of CPUs)\n"
          "  -v               one line per configuration, as it finishes\n"
          "Compiles into the kernel cache ($FLASHATTN_CACHE_DIR, default\n"
          "$XDG_CACHE_HOME/flashattn or ~/.cache/flashattn). Needs NVRTC, not a GPU.\n",
          f);
}

static int fa_pc_arch(const char *s)
{
    if (strncmp(s, "sm_", 3) == 0)
        s += 3;
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || (*end && strcmp(end, "a") != 0) || v < 10 || v > 200)
        return -1;
    return (int)v;
}

static int fa_pc_features(const char *s, unsigned *out)
{
    *out = 0;
    if (strcmp(s, "none") == 0)
        return 0;
    char buf[128];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *tok = strtok_r(buf, "+", &save); tok; tok = strtok_r(NULL, "+", &save)) {
        size_t i = 0, n = sizeof fa_pc_feature_names / sizeof fa_pc_feature_names[0];
        while (i < n && strcmp(tok, fa_pc_feature_names[i].name) != 0)
            i++;
        if (i == n)
            return -1;
        *out |= fa_pc_feature_names[i].bit;
    }
    return 0;
}

/* A --hdim entry: D, or D:DV where V's head dim differs; -1 when out of
 * [1, FA_CUDA_DECODE_MAX_HEAD_DIM] (past FA_CUDA_MAX_HEAD_DIM: the decode kernels alone). */
static int fa_pc_hdim(const char *s, int *dv)
{
    char *end;
    const long d = strtol(s, &end, 10);
    long v = d;
    if (*end == ':')
        v = strtol(end + 1, &end, 10);
    if (*end || d < 1 || d > FA_CUDA_DECODE_MAX_HEAD_DIM || v < 1 ||
        v > FA_CUDA_DECODE_MAX_HEAD_DIM)
        return -1;
    *dv = (int)v;
    return (int)d;
}

/* Splits a comma list and parses each item (ints2: V's head dims of --hdim); returns the count
 * or -1 after printing why. */
static int fa_pc_list(const char *opt, const char *arg, int *ints, int *ints2, unsigned *bits,
                      fa_dtype *dts)
{
    char buf[256];
    int n = 0;
    snprintf(buf, sizeof buf, "%s", arg);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int ok = n < FA_PC_MAX;
        if (ok && strcmp(opt, "--arch") == 0)
            ok = (ints[n] = fa_pc_arch(tok)) > 0;
        else if (ok && strcmp(opt, "--hdim") == 0)
            ok = (ints[n] = fa_pc_hdim(tok, &ints2[n])) > 0;
        else if (ok && strcmp(opt, "--features") == 0)
            ok = fa_pc_features(tok, &bits[n]) == 0;
        else if (ok && strcmp(opt, "--dtype") == 0) {
            ok = strcmp(tok, "fp16") == 0 || strcmp(tok, "bf16") == 0 ||
                 strcmp(tok, "fp8_e4m3") == 0;
            dts[n] = strcmp(tok, "bf16") == 0       ? FA_DTYPE_BF16
                     : strcmp(tok, "fp8_e4m3") == 0 ? FA_DTYPE_F8E4M3
                                                    : FA_DTYPE_F16;
        }
        if (!ok) {
            fprintf(stderr, "flashattn precompile: bad %s entry '%s'\n", opt, tok);
            return -1;
        }
        n++;
    }
    if (n == 0)
        fprintf(stderr, "flashattn precompile: %s needs a list\n", opt);
    return n > 0 ? n : -1;
}

static void fa_pc_describe(const fa_pc_job *j, char *dst, size_t size)
{
    int n = snprintf(dst, size, "sm_%d%s %s hdim %d", j->arch, j->arch == 90 ? "a" : "",
                     fa_dtype_name(j->dtype), j->hdim);
    if (j->hdim_v != j->hdim && n > 0 && (size_t)n < size)
        n += snprintf(dst + n, size - (size_t)n, ":%d", j->hdim_v);
    for (size_t i = 0; i < sizeof fa_pc_feature_names / sizeof fa_pc_feature_names[0]; i++)
        if (j->features & fa_pc_feature_names[i].bit && n > 0 && (size_t)n < size)
            n += snprintf(dst + n, size - (size_t)n, " %s", fa_pc_feature_names[i].name);
}

static double fa_pc_elapsed(const struct timespec *t0)
{
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0->tv_nsec);
}

/* Blanks the progress line so that other output starts on a clean line (lock held). */
static void fa_pc_clear_progress(fa_pc_queue *q)
{
    if (q->line_width > 0)
        fprintf(stderr, "\r%*s\r", q->line_width, "");
    q->line_width = 0;
}

/* Rewrites the progress line in place (lock held). */
static void fa_pc_show_progress(fa_pc_queue *q)
{
    if (!q->progress)
        return;
    char line[128];
    int n = snprintf(line, sizeof line, "precompile: %d/%d done, %d failed, %.0f s", q->done,
                     q->count, q->failed, fa_pc_elapsed(&q->start));
    fflush(stdout);
    fprintf(stderr, "\r%s%*s", line, q->line_width > n ? q->line_width - n : 0, "");
    fflush(stderr);
    q->line_width = n > q->line_width ? n : q->line_width;
}

/* One finished job: its -v line or its failure, as it happens (lock held). */
static void fa_pc_report(fa_pc_queue *q, const fa_pc_job *j)
{
    q->done++;
    q->failed += j->status != FA_STATUS_OK;
    if (j->status != FA_STATUS_OK || q->verbose) {
        char what[160];
        fa_pc_describe(j, what, sizeof what);
        fa_pc_clear_progress(q);
        if (j->status != FA_STATUS_OK)
            fprintf(stderr, "FAILED %s: %s\n", what, j->error);
        else
            printf("%-8s %s\n", j->cached ? "cached" : "compiled", what);
        fflush(stdout);
    }
    fa_pc_show_progress(q);
    pthread_cond_signal(&q->finished);
}

static void *fa_pc_worker(void *arg)
{
    fa_pc_queue *q = arg;
    for (;;) {
        pthread_mutex_lock(&q->lock);
        int i = q->next++;
        pthread_mutex_unlock(&q->lock);
        if (i >= q->count)
            return NULL;
        fa_pc_job *j = &q->jobs[i];
        j->status = fa_cuda_precompile(j->arch, j->dtype, j->hdim, j->hdim_v, j->features,
                                       &j->cached);
        if (j->status != FA_STATUS_OK)
            snprintf(j->error, sizeof j->error, "%s", fa_last_error());
        pthread_mutex_lock(&q->lock);
        fa_pc_report(q, j);
        pthread_mutex_unlock(&q->lock);
    }
}

/* Until every job has finished: the progress line's clock ticks once a second between them. */
static void fa_pc_wait(fa_pc_queue *q)
{
    pthread_mutex_lock(&q->lock);
    while (q->done < q->count) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 1;
        if (pthread_cond_timedwait(&q->finished, &q->lock, &until) == ETIMEDOUT)
            fa_pc_show_progress(q); /* a finished job has drawn it already */
    }
    fa_pc_clear_progress(q);
    pthread_mutex_unlock(&q->lock);
}

int fa_precompile_main(int argc, char **argv)
{
    /* 192:128: DeepSeek's MLA prefill (the sm90 forward's d != dv kernels). */
    int archs[FA_PC_MAX] = {80, 90}, hdims[FA_PC_MAX] = {32, 64, 96, 128, 192, 256, 192};
    int hdims_v[FA_PC_MAX] = {32, 64, 96, 128, 192, 256, 128};
    fa_dtype dtypes[FA_PC_MAX] = {FA_DTYPE_F16, FA_DTYPE_BF16};
    unsigned feats[FA_PC_MAX] = {0, FA_FEATURE_VARLEN,
                                 FA_FEATURE_VARLEN | FA_FEATURE_ALIBI | FA_FEATURE_DROPOUT,
                                 FA_FEATURE_DROPOUT, FA_FEATURE_SOFTCAP | FA_FEATURE_UNALIGNED};
    int n_arch = 2, n_hdim = 7, n_dtype = 2, n_feat = 5, jobs = (int)sysconf(_SC_NPROCESSORS_ONLN);
    int verbose = 0;
    for (int i = 0; i < argc; i++) {
        const char *o = argv[i];
        if (strcmp(o, "--help") == 0 || strcmp(o, "-h") == 0) {
            fa_pc_usage(stdout);
            return FA_EXIT_OK;
        }
        if (strcmp(o, "-v") == 0) {
            verbose = 1;
            continue;
        }
        int known = strcmp(o, "--arch") == 0 || strcmp(o, "--hdim") == 0 ||
                    strcmp(o, "--dtype") == 0 || strcmp(o, "--features") == 0 ||
                    strcmp(o, "--jobs") == 0;
        if (!known || i + 1 >= argc) {
            fprintf(stderr, "flashattn precompile: %s '%s'\n\n",
                    known ? "missing value for" : "unknown option", o);
            fa_pc_usage(stderr);
            return FA_EXIT_USAGE;
        }
        const char *v = argv[++i];
        int n = 0;
        if (strcmp(o, "--jobs") == 0)
            n = (jobs = atoi(v)) >= 1 ? 1 : -1;
        else if (strcmp(o, "--arch") == 0)
            n = n_arch = fa_pc_list(o, v, archs, NULL, NULL, NULL);
        else if (strcmp(o, "--hdim") == 0)
            n = n_hdim = fa_pc_list(o, v, hdims, hdims_v, NULL, NULL);
        else if (strcmp(o, "--dtype") == 0)
            n = n_dtype = fa_pc_list(o, v, NULL, NULL, NULL, dtypes);
        else
            n = n_feat = fa_pc_list(o, v, NULL, NULL, feats, NULL);
        if (n < 0)
            return FA_EXIT_USAGE;
    }

    const char *status = fa_cuda_status();
    if (strstr(status, "nvrtc:  libnvrtc not found") || strstr(status, "lacks")) {
        const char *ci = getenv("CI");
        int in_ci = ci && (strcmp(ci, "true") == 0 || strcmp(ci, "1") == 0);
        fprintf(stderr, "flashattn precompile: %s: NVRTC is missing\n%s\n",
                in_ci ? "FAILED (CI=true expects the CUDA toolkit)" : "skipped", status);
        return in_ci ? FA_EXIT_FAIL : FA_EXIT_OK;
    }

    int count = n_arch * n_hdim * n_dtype * n_feat;
    /* On a terminal a progress line shows; in a log (CI) only the summary and -v lines. */
    fa_pc_queue q = {.jobs = calloc((size_t)count, sizeof(fa_pc_job)), .count = count,
                     .verbose = verbose, .progress = isatty(STDERR_FILENO),
                     .lock = PTHREAD_MUTEX_INITIALIZER, .finished = PTHREAD_COND_INITIALIZER};
    if (!q.jobs)
        return FA_EXIT_FAIL;
    int at = 0;
    for (int a = 0; a < n_arch; a++)
        for (int h = 0; h < n_hdim; h++)
            for (int t = 0; t < n_dtype; t++)
                for (int f = 0; f < n_feat; f++)
                    q.jobs[at++] = (fa_pc_job){archs[a], dtypes[t], hdims[h], hdims_v[h],
                                               feats[f], FA_STATUS_OK, 0, ""};
    if (jobs > count)
        jobs = count;
    if (jobs > 64)
        jobs = 64;
    clock_gettime(CLOCK_MONOTONIC, &q.start);
    pthread_t threads[64];
    int started = 0;
    pthread_mutex_lock(&q.lock);
    fa_pc_show_progress(&q);
    pthread_mutex_unlock(&q.lock);
    while (started < jobs && pthread_create(&threads[started], NULL, fa_pc_worker, &q) == 0)
        started++;
    if (started == 0)
        fa_pc_worker(&q);
    fa_pc_wait(&q);
    for (int i = 0; i < started; i++)
        pthread_join(threads[i], NULL);
    double elapsed = fa_pc_elapsed(&q.start);

    int compiled = 0, cached = 0;
    for (int i = 0; i < count; i++) {
        const fa_pc_job *j = &q.jobs[i];
        compiled += j->status == FA_STATUS_OK && !j->cached;
        cached += j->status == FA_STATUS_OK && j->cached;
    }
    printf("precompile: %d configurations, %d compiled, %d already cached, %d failed, %.1f s "
           "with %d threads\n",
           count, compiled, cached, q.failed, elapsed, started > 0 ? started : 1);
    free(q.jobs);
    return q.failed ? FA_EXIT_FAIL : FA_EXIT_OK;
}
