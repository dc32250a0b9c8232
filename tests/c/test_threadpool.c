/*
 * The thread pool (src/util/fa_threadpool.c): every item runs exactly once, on a thread index
 * below the count asked for, whether the workers are spinning (back-to-back jobs) or asleep
 * (a pause longer than their spin before the job), with thread counts that grow and shrink,
 * and with several callers at once (their jobs are serialised). A lost wake-up shows as a hang,
 * which ctest's timeout turns into a failure. No item of a job runs after its call returned
 * (a worker still waking when the caller closes the job must leave it alone): the jobs are
 * kept to the end and checked then.
 */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "test_util.h"
#include "util/fa_threadpool.h"

#define MAX_ITEMS 4096

#define MAX_JOBS 512

typedef struct job {
    atomic_int runs[MAX_ITEMS];
    atomic_int bad_thread;
    atomic_int returned; /* set when fa_parallel_for returned */
    atomic_int late;     /* an item ran after that */
    int threads;
} job;

static job *g_jobs[MAX_JOBS];
static atomic_int g_n_jobs;

static void task(void *ctx, int64_t item, int thread)
{
    job *j = ctx;
    if (atomic_load(&j->returned))
        atomic_store(&j->late, 1);
    atomic_fetch_add(&j->runs[item], 1);
    if (thread < 0 || thread >= j->threads)
        atomic_store(&j->bad_thread, 1);
}

static void pause_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

/* Runs one job of n items on threads; returns the number of items not run exactly once. */
static int run_once(int threads, int64_t n)
{
    job *j = calloc(1, sizeof *j);
    if (!j)
        return 1;
    j->threads = threads;
    int wrong = fa_parallel_for(threads, n, task, j) != FA_STATUS_OK;
    atomic_store(&j->returned, 1);
    for (int64_t i = 0; i < n; i++)
        wrong += atomic_load(&j->runs[i]) != 1;
    wrong += atomic_load(&j->bad_thread);
    int at = atomic_fetch_add(&g_n_jobs, 1);
    if (at < MAX_JOBS)
        g_jobs[at] = j;
    else
        free(j);
    return wrong;
}

static void *caller(void *arg)
{
    tu_rng *rng = arg;
    long wrong = 0;
    for (int r = 0; r < 60; r++) {
        int threads = (int)tu_rng_int(rng, 1, 8);
        wrong += run_once(threads, tu_rng_int(rng, 1, MAX_ITEMS));
        if (r % 10 == 0)
            pause_us(300);
    }
    return (void *)wrong;
}

int main(void)
{
    tu_rng rng = {tu_master_seed("test_threadpool")};

    /* Back to back, then after pauses past the workers' spin (100 us), so that they sleep. */
    for (int r = 0; r < 200; r++) {
        int threads = (int)tu_rng_int(&rng, 1, 16);
        int64_t n = tu_rng_int(&rng, 1, MAX_ITEMS);
        if (r >= 100)
            pause_us(r % 2 ? 150 : 2000);
        int wrong = run_once(threads, n);
        TU_CHECK(wrong == 0, "round %d: %d threads, %lld items: %d items wrong", r, threads,
                 (long long)n, wrong);
    }

    /* Four callers at once. */
    pthread_t t[4];
    tu_rng rngs[4];
    for (int i = 0; i < 4; i++) {
        rngs[i].state = tu_rng_u64(&rng);
        TU_CHECK(pthread_create(&t[i], NULL, caller, &rngs[i]) == 0, "pthread_create %d", i);
    }
    for (int i = 0; i < 4; i++) {
        void *wrong = NULL;
        pthread_join(t[i], &wrong);
        TU_CHECK(wrong == NULL, "caller %d: %ld items wrong", i, (long)wrong);
    }

    /* Past the workers' spin, so that any worker still holding a job has run it by now. */
    pause_us(5000);
    const int kept = atomic_load(&g_n_jobs) < MAX_JOBS ? atomic_load(&g_n_jobs) : MAX_JOBS;
    int late = 0;
    for (int i = 0; i < kept; i++) {
        late += atomic_load(&g_jobs[i]->late);
        free(g_jobs[i]);
    }
    TU_CHECK(late == 0, "%d of %d jobs ran an item after their call returned", late, kept);
    return tu_finish("test_threadpool");
}
