/* A persistent pool of worker threads handing out work items through an atomic counter. */
#ifndef FA_THREADPOOL_H
#define FA_THREADPOOL_H

#include <stdint.h>

#include "flashattn.h"

/* item: 0 .. n_items-1; thread: 0 .. num_threads-1, stable for the duration of one call. */
typedef void (*fa_task_fn)(void *ctx, int64_t item, int thread);

/*
 * Runs fn on every item with num_threads threads (the caller is thread 0) and returns when all
 * are done. Items are taken in increasing order, so callers that want balance list the longest
 * items first. Calls from several caller threads are serialised; fn must not call it again.
 */
fa_status fa_parallel_for(int num_threads, int64_t n_items, fa_task_fn fn, void *ctx);

#endif /* FA_THREADPOOL_H */
