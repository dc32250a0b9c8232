/*
 * Workers are created on first use and kept; each call publishes a job under a generation number
 * and the workers it needs join in. The pool is sized up to the largest thread count asked for.
 *
 * Between jobs a worker spins for FA_POOL_SPIN_NS before it sleeps, and so does the caller while
 * it waits for the workers: waking a sleeping thread takes tens of microseconds (more in a VM),
 * which is the whole cost of a decoding step, and back-to-back calls (decoding, the passes of
 * the backward) find the workers awake. OpenMP runtimes spin the same way.
 *
 * Sleeping workers wait on a 32-bit word the caller bumps with each job, on Linux with a futex:
 * one system call wakes all of them and each runs at once (through a condition variable each
 * woken worker had to take the mutex in turn).
 *
 * A worker joins a job before it takes items, and the caller closes the job once it finds no
 * item left: it then waits only for the workers that joined. A worker still waking finds the
 * job closed and touches nothing of it, so a short job after the workers fell asleep does not
 * wait for them to wake.
 */
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "util/fa_export.h"
#include "util/fa_threadpool.h"

#define FA_POOL_MAX_THREADS FA_MAX_THREADS
#define FA_POOL_SPIN_NS 100000
#define FA_POOL_CLOSED (UINT64_C(1) << 31) /* in entry: the caller takes no more workers */
#define FA_POOL_JOINED 0x7fffffffu           /* in entry: the workers that joined */

typedef struct fa_pool {
    pthread_mutex_t call_lock; /* one job at a time */
    pthread_mutex_t lock;      /* guards worker creation and the waits on the conditions */
    pthread_cond_t wake;       /* without futexes: signals a change of word */
    pthread_cond_t done;
    pthread_t workers[FA_POOL_MAX_THREADS];
    uint64_t born[FA_POOL_MAX_THREADS]; /* the job word when worker i was created */
    int n_workers;
    atomic_int sleepers; /* workers asleep on word, or about to be */
    atomic_uint word;    /* bumped after each job is published; sleepers wait on its change */
    /* The job word: generation << 16 | thread count, published (release) after the fields
     * below. A worker the job does not need reads nothing else, so it never races with the
     * next call rewriting them; the workers it needs finish before that call can start. */
    atomic_uint_fast64_t job;
    fa_task_fn fn;
    void *ctx;
    int64_t n_items;
    atomic_llong next;
    /* The job's generation (low 32 bits) << 32 | FA_POOL_CLOSED | workers joined. */
    atomic_uint_fast64_t entry;
    atomic_int finished; /* joined workers done with the job */
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

static int64_t fa_pool_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Yielding rather than pausing: where other threads wait for the core (more threads than
 * cores, other processes), the spin gives way to them at once. */
static void fa_pool_relax(void)
{
    sched_yield();
}

/* Spins until *x != value or FA_POOL_SPIN_NS pass; returns the last value read. */
static uint64_t fa_pool_spin_job(atomic_uint_fast64_t *x, uint64_t value)
{
    const int64_t until = fa_pool_now_ns() + FA_POOL_SPIN_NS;
    for (unsigned i = 1;; i++) {
        uint64_t now = atomic_load_explicit(x, memory_order_acquire);
        if (now != value || (i % 8 == 0 && fa_pool_now_ns() > until))
            return now;
        fa_pool_relax();
    }
}

/* Spins until *x reaches target or FA_POOL_SPIN_NS pass; returns the last value read. */
static int fa_pool_spin_finished(atomic_int *x, int target)
{
    const int64_t until = fa_pool_now_ns() + FA_POOL_SPIN_NS;
    for (unsigned i = 1;; i++) {
        int now = atomic_load_explicit(x, memory_order_acquire);
        if (now >= target || (i % 8 == 0 && fa_pool_now_ns() > until))
            return now;
        fa_pool_relax();
    }
}

/* 1 if the worker joined job generation gen, 0 if that job is closed or already past. */
static int fa_pool_join(fa_pool *pool, uint64_t gen)
{
    uint64_t e = atomic_load(&pool->entry);
    do {
        if ((e >> 32) != (gen & 0xffffffffu) || (e & FA_POOL_CLOSED))
            return 0;
    } while (!atomic_compare_exchange_weak(&pool->entry, &e, e + 1));
    return 1;
}

/* Sequentially consistent, against the caller's close-then-count: either the caller counts
 * this worker finished, or this worker sees the job closed and signals (under the lock the
 * caller's wait holds). A signal that reaches the next job's caller only wakes it to
 * re-check. */
static void fa_pool_leave(fa_pool *pool)
{
    atomic_fetch_add(&pool->finished, 1);
    if (atomic_load(&pool->entry) & FA_POOL_CLOSED) {
        pthread_mutex_lock(&pool->lock);
        pthread_cond_signal(&pool->done);
        pthread_mutex_unlock(&pool->lock);
    }
}

/* Sleeps while pool->word == seen (returns at once if it already differs; may return early). */
static void fa_pool_sleep(fa_pool *pool, unsigned seen)
{
#if defined(__linux__)
    syscall(SYS_futex, &pool->word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
    pthread_mutex_lock(&pool->lock);
    while (atomic_load(&pool->word) == seen)
        pthread_cond_wait(&pool->wake, &pool->lock);
    pthread_mutex_unlock(&pool->lock);
#endif
}

static void fa_pool_wake_all(fa_pool *pool)
{
#if defined(__linux__)
    syscall(SYS_futex, &pool->word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#else
    pthread_mutex_lock(&pool->lock);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
#endif
}

static void *fa_pool_worker(void *arg)
{
    fa_pool *pool = &fa_the_pool;
    int index = (int)(intptr_t)arg; /* worker i is thread i+1 */
    pthread_mutex_lock(&pool->lock);
    /* Created under the lock just before a job was published: that job counts on it. */
    uint64_t seen = pool->born[index];
    pthread_mutex_unlock(&pool->lock);
    for (;;) {
        uint64_t job = fa_pool_spin_job(&pool->job, seen);
        if (job == seen) {
            /* Sequentially consistent, against the caller's publish-bump-count (there): either
             * the caller counts this sleeper and wakes it, or the job is seen here, or the word
             * has moved and the futex returns at once. */
            atomic_fetch_add(&pool->sleepers, 1);
            for (;;) {
                const unsigned w = atomic_load(&pool->word);
                if ((job = atomic_load(&pool->job)) != seen)
                    break;
                fa_pool_sleep(pool, w);
            }
            atomic_fetch_sub(&pool->sleepers, 1);
        }
        seen = job;
        if (index + 1 >= (int)(job & 0xffff) || !fa_pool_join(pool, job >> 16))
            continue;
        fa_pool_drain(pool, index + 1);
        fa_pool_leave(pool);
    }
    return NULL;
}

static int fa_pool_grow(fa_pool *pool, int n_workers)
{
    while (pool->n_workers < n_workers) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pool->born[pool->n_workers] = atomic_load_explicit(&pool->job, memory_order_relaxed);
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
    atomic_store_explicit(&pool->next, 0, memory_order_relaxed);
    atomic_store_explicit(&pool->finished, 0, memory_order_relaxed);
    const uint64_t gen = (atomic_load_explicit(&pool->job, memory_order_relaxed) >> 16) + 1;
    atomic_store_explicit(&pool->entry, (gen & 0xffffffffu) << 32, memory_order_relaxed);
    pthread_mutex_unlock(&pool->lock);
    atomic_store(&pool->job, gen << 16 | (uint64_t)num_threads);
    atomic_fetch_add(&pool->word, 1);
    if (atomic_load(&pool->sleepers) > 0)
        fa_pool_wake_all(pool);

    fa_pool_drain(pool, 0);

    const int joined = (int)(atomic_fetch_or(&pool->entry, FA_POOL_CLOSED) & FA_POOL_JOINED);
    if (fa_pool_spin_finished(&pool->finished, joined) < joined) {
        pthread_mutex_lock(&pool->lock);
        while (atomic_load(&pool->finished) < joined)
            pthread_cond_wait(&pool->done, &pool->lock);
        pthread_mutex_unlock(&pool->lock);
    }
    pthread_mutex_unlock(&pool->call_lock);
    return FA_STATUS_OK;
}
