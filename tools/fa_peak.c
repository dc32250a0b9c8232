/*
 * `flashattn peak`: the fp32 fused multiply-add rate of this machine's cores, with the widest
 * vectors the CPU has, so that CPU attention figures can be quoted as a fraction of it. Each
 * thread runs 12 independent FMA chains (enough to cover latency x ports on current x86 cores).
 */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fa_bench.h"
#include "flashattn.h"

#define FA_PEAK_CHAINS 12
#define FA_PEAK_ITERS 20000000L

typedef float fa_v16 __attribute__((vector_size(64)));
typedef float fa_v8 __attribute__((vector_size(32)));

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f"))) static float fa_peak_avx512(long iters)
{
    fa_v16 acc[FA_PEAK_CHAINS];
    const fa_v16 x = (fa_v16){0} + 0.999999f, y = (fa_v16){0} + 1e-7f;
    for (int i = 0; i < FA_PEAK_CHAINS; i++)
        acc[i] = (fa_v16){0} + (float)i;
    for (long k = 0; k < iters; k++)
        for (int i = 0; i < FA_PEAK_CHAINS; i++)
            acc[i] = acc[i] * x + y;
    fa_v16 s = acc[0];
    for (int i = 1; i < FA_PEAK_CHAINS; i++)
        s += acc[i];
    return s[0];
}

__attribute__((target("avx2,fma"))) static float fa_peak_avx2(long iters)
{
    fa_v8 acc[FA_PEAK_CHAINS];
    const fa_v8 x = (fa_v8){0} + 0.999999f, y = (fa_v8){0} + 1e-7f;
    for (int i = 0; i < FA_PEAK_CHAINS; i++)
        acc[i] = (fa_v8){0} + (float)i;
    for (long k = 0; k < iters; k++)
        for (int i = 0; i < FA_PEAK_CHAINS; i++)
            acc[i] = acc[i] * x + y;
    fa_v8 s = acc[0];
    for (int i = 1; i < FA_PEAK_CHAINS; i++)
        s += acc[i];
    return s[0];
}
#endif

typedef struct fa_peak_job {
    int lanes;
    long iters;
    float sink;
} fa_peak_job;

static void *fa_peak_thread(void *arg)
{
    fa_peak_job *job = arg;
#if defined(__x86_64__) && defined(__GNUC__)
    job->sink = job->lanes == 16 ? fa_peak_avx512(job->iters) : fa_peak_avx2(job->iters);
#else
    job->sink = 0;
#endif
    return NULL;
}

static double fa_peak_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double fa_peak_gflops(int threads, int lanes)
{
    fa_peak_job *jobs = calloc((size_t)threads, sizeof *jobs);
    pthread_t *tids = calloc((size_t)threads, sizeof *tids);
    if (!jobs || !tids) {
        free(jobs);
        free(tids);
        return 0.0;
    }
    for (int t = 0; t < threads; t++)
        jobs[t] = (fa_peak_job){lanes, FA_PEAK_ITERS / 4, 0};
    double t0 = fa_peak_seconds();
    for (int t = 0; t < threads; t++)
        pthread_create(&tids[t], NULL, fa_peak_thread, &jobs[t]);
    for (int t = 0; t < threads; t++)
        pthread_join(tids[t], NULL);
    double sec = fa_peak_seconds() - t0;
    free(jobs);
    free(tids);
    return 2.0 * FA_PEAK_CHAINS * lanes * (double)(FA_PEAK_ITERS / 4) * threads / sec * 1e-9;
}

int fa_peak_lanes(void)
{
    const char *desc = fa_cpu_description();
    return strstr(desc, "avx512f") ? 16 : (strstr(desc, "avx2") ? 8 : 0);
}

int fa_peak_main(int argc, char **argv)
{
    int threads = fa_cpu_default_threads();
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
            threads = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: flashattn peak [--threads N]\n");
            return FA_EXIT_USAGE;
        }
    }
    if (threads < 1) {
        fprintf(stderr, "flashattn peak: --threads must be >= 1\n");
        return FA_EXIT_USAGE;
    }
    const int lanes = fa_peak_lanes();
    if (lanes == 0) {
        fprintf(stderr, "flashattn peak: needs AVX2 or AVX-512 (%s)\n", fa_cpu_description());
        return FA_EXIT_FAIL;
    }
    const double gflops = fa_peak_gflops(threads, lanes);
    if (gflops == 0.0)
        return FA_EXIT_FAIL;
    printf("peak fp32 FMA: %.1f GFLOP/s with %d threads (%d-lane vectors), %.1f per thread\n",
           gflops, threads, lanes, gflops / threads);
    return FA_EXIT_OK;
}
