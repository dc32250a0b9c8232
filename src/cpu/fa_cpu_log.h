/*
 * FLASHATTN_LOG=1 (the variable that also logs the GPU's kernel compiles): each CPU forward,
 * backward and KV-cache call prints one line to stderr saying how it cut the work and, for each
 * parallel phase, its items, wall time and the share of the threads' time spent inside items. A
 * share well below 100% means threads waited for the last items (too few or uneven items, or a
 * slow core). Off, a phase is a plain fa_parallel_for.
 */
#ifndef FA_CPU_LOG_H
#define FA_CPU_LOG_H

#include <stdint.h>

#include "core/fa_params.h"
#include "util/fa_threadpool.h"

#define FA_CPU_LOG_PHASES 4

typedef struct fa_cpu_log {
    int on;
    int n; /* phases recorded; a phase run again under the same name adds to the first */
    struct {
        const char *name;
        int64_t items;
        double ms, busy_ms, thread_ms; /* wall, inside items, threads x wall */
    } phase[FA_CPU_LOG_PHASES];
} fa_cpu_log;

/* Starts a record for one call; off unless FLASHATTN_LOG is set and not "0". */
void fa_cpu_log_begin(fa_cpu_log *log);

/* fa_parallel_for(threads, n_items, fn, ctx), timed into the record when it is on. */
fa_status fa_cpu_log_phase(fa_cpu_log *log, const char *name, int threads, int64_t n_items,
                           fa_task_fn fn, void *ctx);

/* Prints the record's line: what ("forward"), the problem, how it was cut (plan), the phases. */
void fa_cpu_log_end(const fa_cpu_log *log, const fa_params *p, const char *what,
                    const char *plan);

/* Prints the record's line after head (the call and how it was cut), for callers that describe
 * their problem themselves. */
void fa_cpu_log_print(const fa_cpu_log *log, const char *head);

#endif /* FA_CPU_LOG_H */
