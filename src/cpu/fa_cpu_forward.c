/*
 * CPU forward: the problem is cut into (sequence, head, query tile) items handed to the thread
 * pool, longest first. Each item is computed start to finish by one thread in a fixed order, so
 * results are bitwise identical for any thread count.
 */
#include <math.h>
#include <stdlib.h>

#include "api/fa_internal.h"
#include "cpu/fa_cpu_kernel.h"
#include "util/fa_threadpool.h"

#define FA_REAL float
#define FA_FN(name) name##_f32
#define FA_EXP expf
#define FA_TANH tanhf
#define FA_LOG logf
#include "cpu/fa_cpu_rows.h"
#include "cpu/fa_cpu_fwd_body.h"
#undef FA_REAL
#undef FA_FN
#undef FA_EXP
#undef FA_TANH
#undef FA_LOG

#define FA_REAL double
#define FA_FN(name) name##_f64
#define FA_EXP exp
#define FA_TANH tanh
#define FA_LOG log
#include "cpu/fa_cpu_rows.h"
#include "cpu/fa_cpu_fwd_body.h"
#undef FA_REAL
#undef FA_FN
#undef FA_EXP
#undef FA_TANH
#undef FA_LOG

/* A query tile of one sequence; every head of it is a separate work item. */
typedef struct fa_cpu_chunk {
    int64_t seq, r0, m;
    int64_t cost; /* keys visited, to order items longest first */
} fa_cpu_chunk;

typedef struct fa_cpu_job {
    const fa_params *p;
    fa_cpu_chunk *chunks;
    char *scratch;       /* one region per thread */
    size_t scratch_size; /* bytes per thread */
} fa_cpu_job;

static int fa_cpu_chunk_cmp(const void *a, const void *b)
{
    const fa_cpu_chunk *x = a, *y = b;
    if (x->cost != y->cost)
        return x->cost > y->cost ? -1 : 1;
    if (x->seq != y->seq)
        return x->seq < y->seq ? -1 : 1;
    return x->r0 < y->r0 ? -1 : (x->r0 > y->r0);
}

static size_t fa_cpu_scratch_size(const fa_params *p, size_t real_size)
{
    size_t n = (size_t)(FA_CPU_BM * p->d + p->d * FA_CPU_BN + FA_CPU_BN * p->dv +
                        FA_CPU_BM * FA_CPU_BN + FA_CPU_BM * p->dv + 2 * FA_CPU_BM);
    return (n * real_size + 63) & ~(size_t)63;
}

#define FA_TILE_CARVE(REAL, t, base, p)                                                          \
    do {                                                                                         \
        REAL *cur_ = (REAL *)(base);                                                             \
        (t).q = cur_;                                                                            \
        cur_ += FA_CPU_BM * (p)->d;                                                              \
        (t).kt = cur_;                                                                           \
        cur_ += (p)->d * FA_CPU_BN;                                                              \
        (t).v = cur_;                                                                            \
        cur_ += FA_CPU_BN * (p)->dv;                                                             \
        (t).s = cur_;                                                                            \
        cur_ += FA_CPU_BM * FA_CPU_BN;                                                           \
        (t).o = cur_;                                                                            \
        cur_ += FA_CPU_BM * (p)->dv;                                                             \
        (t).m = cur_;                                                                            \
        cur_ += FA_CPU_BM;                                                                       \
        (t).l = cur_;                                                                            \
    } while (0)

static void fa_cpu_forward_task(void *ctx, int64_t item, int thread)
{
    const fa_cpu_job *job = ctx;
    const fa_params *p = job->p;
    const fa_cpu_chunk *c = &job->chunks[item / p->h];
    const int64_t h = item % p->h;
    char *base = job->scratch + (size_t)thread * job->scratch_size;
    if (p->dtype == FA_DTYPE_F64) {
        fa_tile_f64 t;
        FA_TILE_CARVE(double, t, base, p);
        fa_cpu_tile_f64(p, &t, c->seq, h, c->r0, c->m);
    } else {
        fa_tile_f32 t;
        FA_TILE_CARVE(float, t, base, p);
        fa_cpu_tile_f32(p, &t, c->seq, h, c->r0, c->m);
    }
}

/* Varlen rows that belong to no sequence still get defined values: out 0, lse +inf. */
static void fa_cpu_fill_uncovered(const fa_params *p)
{
    if (!p->is_varlen)
        return;
    size_t esize = fa_dtype_size(p->dtype);
    int64_t first = p->cu_seqlens_q[0], last = p->cu_seqlens_q[p->b];
    for (int64_t r = 0; r < p->total_q; r++) {
        if (r >= first && r < last)
            continue;
        for (int64_t h = 0; h < p->h; h++) {
            char *o = (char *)p->out + (size_t)(r * p->o_rstride + h * p->o_hstride) * esize;
            for (int64_t c = 0; c < p->dv * (int64_t)esize; c++)
                o[c] = 0;
            if (p->lse)
                fa_params_lse_store(p, h * p->lse_hstride + r * p->lse_rstride, INFINITY);
        }
    }
}

fa_status fa_cpu_forward(const fa_params *p)
{
    fa_cpu_fill_uncovered(p);

    int64_t n_chunks = 0;
    for (int64_t i = 0; i < p->b; i++) {
        fa_seq s = fa_params_seq(p, i);
        n_chunks += (s.sq + FA_CPU_BM - 1) / FA_CPU_BM;
    }
    if (n_chunks == 0)
        return FA_STATUS_OK;

    fa_cpu_chunk *chunks = malloc((size_t)n_chunks * sizeof *chunks);
    if (!chunks)
        return fa_error_set(FA_STATUS_OUT_OF_MEMORY, "out of memory for %lld work items",
                            (long long)n_chunks);
    int64_t at = 0;
    for (int64_t i = 0; i < p->b; i++) {
        fa_seq s = fa_params_seq(p, i);
        for (int64_t r0 = 0; r0 < s.sq; r0 += FA_CPU_BM) {
            int64_t m = s.sq - r0 < FA_CPU_BM ? s.sq - r0 : FA_CPU_BM;
            int64_t lo, hi, lo2, hi2;
            fa_params_key_range(p, r0, s.sq, s.sk, &lo, &hi);
            fa_params_key_range(p, r0 + m - 1, s.sq, s.sk, &lo2, &hi2);
            chunks[at++] = (fa_cpu_chunk){i, r0, m, (hi2 - lo + 1) * m};
        }
    }
    qsort(chunks, (size_t)n_chunks, sizeof *chunks, fa_cpu_chunk_cmp);

    int64_t n_items = n_chunks * p->h;
    int threads = p->num_threads < n_items ? p->num_threads : (int)n_items;
    size_t real_size = p->dtype == FA_DTYPE_F64 ? sizeof(double) : sizeof(float);
    fa_cpu_job job = {p, chunks, NULL, fa_cpu_scratch_size(p, real_size)};
    job.scratch = aligned_alloc(64, job.scratch_size * (size_t)threads);
    if (!job.scratch) {
        free(chunks);
        return fa_error_set(FA_STATUS_OUT_OF_MEMORY, "out of memory for %d thread buffers",
                            threads);
    }
    fa_status st = fa_parallel_for(threads, n_items, fa_cpu_forward_task, &job);
    free(job.scratch);
    free(chunks);
    return st;
}
