/* The FLASHATTN_LOG record of CPU calls (fa_cpu_log.h). */
#include "cpu/fa_cpu_log.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int g_log_on;
static pthread_once_t g_log_once = PTHREAD_ONCE_INIT;

static void log_read(void)
{
    const char *v = getenv("FLASHATTN_LOG");
    g_log_on = v && *v && strcmp(v, "0") != 0;
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

void fa_cpu_log_begin(fa_cpu_log *log)
{
    pthread_once(&g_log_once, log_read);
    memset(log, 0, sizeof *log);
    log->on = g_log_on;
}

/* The phase's task, timed item by item. */
typedef struct {
    fa_task_fn fn;
    void *ctx;
    _Atomic int64_t busy_ns;
} log_task;

static void log_task_run(void *ctx, int64_t item, int thread)
{
    log_task *t = ctx;
    const int64_t t0 = now_ns();
    t->fn(t->ctx, item, thread);
    atomic_fetch_add_explicit(&t->busy_ns, now_ns() - t0, memory_order_relaxed);
}

fa_status fa_cpu_log_phase(fa_cpu_log *log, const char *name, int threads, int64_t n_items,
                           fa_task_fn fn, void *ctx)
{
    if (!log->on)
        return fa_parallel_for(threads, n_items, fn, ctx);
    log_task t = {fn, ctx, 0};
    const int64_t t0 = now_ns();
    const fa_status st = fa_parallel_for(threads, n_items, log_task_run, &t);
    const double ms = (double)(now_ns() - t0) * 1e-6;
    int i = 0;
    while (i < log->n && strcmp(log->phase[i].name, name) != 0)
        i++;
    if (i == FA_CPU_LOG_PHASES)
        return st;
    if (i == log->n)
        log->phase[log->n++].name = name;
    log->phase[i].items += n_items;
    log->phase[i].ms += ms;
    log->phase[i].busy_ms += (double)atomic_load(&t.busy_ns) * 1e-6;
    log->phase[i].thread_ms += ms * (threads < n_items ? threads : (double)n_items);
    return st;
}

void fa_cpu_log_end(const fa_cpu_log *log, const fa_params *p, const char *what,
                    const char *plan)
{
    if (!log->on)
        return;
    char head[256];
    snprintf(head, sizeof head,
             "%s %s b %lld h %lld/%lld sq %lld sk %lld d %lld/%lld, %d threads, %s", what,
             fa_dtype_name(p->dtype), (long long)p->b, (long long)p->h, (long long)p->hk,
             (long long)p->max_sq, (long long)p->max_sk, (long long)p->d, (long long)p->dv,
             p->num_threads, plan);
    fa_cpu_log_print(log, head);
}

void fa_cpu_log_print(const fa_cpu_log *log, const char *head)
{
    if (!log->on)
        return;
    char line[512];
    size_t len = (size_t)snprintf(line, sizeof line, "flashattn: cpu %s:", head);
    for (int i = 0; i < log->n && len < sizeof line; i++)
        len += (size_t)snprintf(line + len, sizeof line - len,
                                "%s %s %lld items %.2f ms %.0f%% busy", i ? ";" : "",
                                log->phase[i].name, (long long)log->phase[i].items,
                                log->phase[i].ms,
                                log->phase[i].thread_ms > 0
                                    ? 100.0 * log->phase[i].busy_ms / log->phase[i].thread_ms
                                    : 100.0);
    fprintf(stderr, "%s\n", line);
}
