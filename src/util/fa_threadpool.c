/*
 * Workers are created on first use and kept; each call publishes a job under a generation number
 * and the workers it needs join in. The pool is sized up to the largest thread count asked for.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "api/fa_internal.h"
#include "util/fa_threadpool.h"

#define FA_POOL_MAX_THREADS 1024

typedef struct fa_pool {
    pthread_mutex_t call_lock; /* one job at a time */
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_cond_t done;
    pthread_t workers[FA_POOL_MAX_THREADS];
    uint64_t born[FA_POOL_MAX_THREADS]; /* generation when worker i was created */
    int n_workers;
    uint64_t generation;
    /* the current job */
    fa_task_fn fn;
    void *ctx;
    int64_t n_items;
    int n_threads;
    atomic_llong next;
    int pending; /* workers of this job still running */
} fa_pool;

static fa_pool fa_the_pool = {
    .call_lock = PTHREAD_MUTEX_INITIALIZER,
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .done = PTHREAD_COND_INITIALIZER,
};

static void fa_pool_drain(fa_pool *pool, int thread)
{
    for (;;) {
        int64_t item = atomic_fetch_add_explicit(&pool->next, 1, memory_order_relaxed);
        if (item >= pool->n_items)
            break;
        pool->fn(pool->ctx, item, thread);
    }
}

static void *fa_pool_worker(void *arg)
{
    fa_pool *pool = &fa_the_pool;
    int index = (int)(intptr_t)arg; /* worker i is thread i+1 */
    pthread_mutex_lock(&pool->lock);
    /* Created under the lock just before a job was published: that job counts on it. */
    uint64_t seen = pool->born[index];
    for (;;) {
        while (pool->generation == seen)
            pthread_cond_wait(&pool->wake, &pool->lock);
        seen = pool->generation;
        if (index + 1 >= pool->n_threads)
            continue;
        pthread_mutex_unlock(&pool->lock);
        fa_pool_drain(pool, index + 1);
        pthread_mutex_lock(&pool->lock);
        if (--pool->pending == 0)
            pthread_cond_signal(&pool->done);
    }
    return NULL;
}

static int fa_pool_grow(fa_pool *pool, int n_workers)
{
    while (pool->n_workers < n_workers) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pool->born[pool->n_workers] = pool->generation;
        int rc = pthread_create(&pool->workers[pool->n_workers], &attr, fa_pool_worker,
                                (void *)(intptr_t)pool->n_workers);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
        pool->n_workers++;
    }
    return pool->n_workers;
}

fa_status fa_parallel_for(int num_threads, int64_t n_items, fa_task_fn fn, void *ctx)
{
    fa_pool *pool = &fa_the_pool;
    if (n_items <= 0)
        return FA_STATUS_OK;
    if (num_threads > n_items)
        num_threads = (int)n_items;
    if (num_threads > FA_POOL_MAX_THREADS)
        num_threads = FA_POOL_MAX_THREADS;
    if (num_threads <= 1) {
        for (int64_t i = 0; i < n_items; i++)
            fn(ctx, i, 0);
        return FA_STATUS_OK;
    }

    pthread_mutex_lock(&pool->call_lock);
    pthread_mutex_lock(&pool->lock);
    /* With fewer workers than asked (thread creation failed), run with what exists. */
    int workers = fa_pool_grow(pool, num_threads - 1);
    if (num_threads > workers + 1)
        num_threads = workers + 1;
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n_items = n_items;
    pool->n_threads = num_threads;
    atomic_store_explicit(&pool->next, 0, memory_order_relaxed);
    pool->pending = num_threads - 1;
    pool->generation++;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);

    fa_pool_drain(pool, 0);

    pthread_mutex_lock(&pool->lock);
    while (pool->pending > 0)
        pthread_cond_wait(&pool->done, &pool->lock);
    pthread_mutex_unlock(&pool->lock);
    pthread_mutex_unlock(&pool->call_lock);
    return FA_STATUS_OK;
}
