/*
 * fa_block_mask_build on the CPU: for each query block and key block, mask_mod's kept pairs
 * counted by the forward's bounds pass (fa_cpu_mod_bounds_f32, the hoisting evaluator in fp32,
 * as a call evaluates the mask), then each (b, h, query block)'s lists written in
 * FlexAttention's order, a (b, h, query block) row a work item on p->num_threads threads. A
 * program that reads neither b nor h is evaluated once and its lists copied to every sequence
 * and head.
 */
#include <stdlib.h>
#include <string.h>

#include "cpu/fa_cpu.h"
#include "cpu/fa_cpu_mod.h"
#include "util/fa_threadpool.h"
#include "mod/fa_block_mask.h"
#include "mod/fa_mod_program.h"

static int32_t *fa_bm_at(const fa_tensor *t, int64_t b, int64_t h, int64_t qb, int64_t i)
{
    return (int32_t *)t->data + b * t->stride[0] + h * t->stride[1] + qb * t->stride[2] +
           (t->ndim == 4 ? i * t->stride[3] : 0);
}

/* One (b, h, query block)'s count and list for blocks in state `state`: those first, ascending,
 * then the rest, ascending (a stable descending sort of the 0/1 row, as torch's). */
static void fa_bm_write(const fa_tensor *num, const fa_tensor *idx, int64_t b, int64_t h,
                        int64_t qb, const unsigned char *st, int64_t nk, unsigned char state)
{
    int64_t n = 0;
    for (int64_t kb = 0; kb < nk; kb++)
        if (st[kb] == state)
            *fa_bm_at(idx, b, h, qb, n++) = (int32_t)kb;
    *fa_bm_at(num, b, h, qb, 0) = (int32_t)n;
    for (int64_t kb = 0; kb < nk; kb++)
        if (st[kb] != state)
            *fa_bm_at(idx, b, h, qb, n++) = (int32_t)kb;
}

/* The build's shared state: each thread's scratch at mem + thread * per_thread bytes (the
 * evaluator's buffers, then the rows' bounds olo, ohi, lo, hi, cnt, then a row of states). */
typedef struct fa_bm_job {
    const fa_params *p;
    const fa_block_mask_args *a;
    int64_t nq, nk, rb, rh; /* rb, rh: the sequences and heads the program tells apart */
    int full;
    size_t scratch, rows, per_thread;
    char *mem;
} fa_bm_job;

/* Item (b, h, qb), b and h those the program tells apart: the row's states, then its lists
 * for every sequence and head it stands for. */
static void fa_bm_task(void *ctx, int64_t item, int thread)
{
    const fa_bm_job *job = ctx;
    const fa_block_mask_args *a = job->a;
    const int64_t qbs = a->q_block, kbs = a->kv_block;
    const int64_t qb = item % job->nq, h = item / job->nq % job->rh, b = item / job->nq / job->rh;
    char *mem = job->mem + (size_t)thread * job->per_thread;
    float *buf = (float *)mem, *olo = (float *)(mem + job->scratch), *ohi = olo + job->rows / 4;
    float *lo = ohi + job->rows / 4, *hi = lo + job->rows / 4, *cnt = hi + job->rows / 4;
    unsigned char *st = (unsigned char *)(cnt + job->rows / 4);
    const int64_t q0 = qb * qbs, c1 = a->sq - q0 < qbs ? a->sq - q0 : qbs;
    for (int64_t i = 0; i < c1; i++)
        olo[i] = 0.f, ohi[i] = (float)a->sk;
    for (int64_t kb = 0; kb < job->nk; kb++) {
        const int64_t j0 = kb * kbs, n = a->sk - j0 < kbs ? a->sk - j0 : kbs;
        const fa_cpu_mod_at at = {.b = b, .h = h, .q0 = q0, .j0 = j0};
        fa_cpu_mod_bounds_f32(job->p, buf, n, 0, c1, &at, olo, ohi, lo, hi, cnt);
        int64_t kept = 0;
        for (int64_t i = 0; i < c1; i++)
            kept += (int64_t)cnt[i];
        /* Full: a whole block (an edge block is never full), every pair kept. */
        st[kb] = kept == 0 ? FA_BLOCK_SKIP
                 : job->full && c1 == qbs && n == kbs && kept == c1 * n ? FA_BLOCK_FULL
                                                                         : FA_BLOCK_PARTIAL;
    }
    for (int64_t bo = b; bo < a->b; bo += job->rb)
        for (int64_t ho = h; ho < a->h; ho += job->rh) {
            fa_bm_write(a->kv_num_blocks, a->kv_indices, bo, ho, qb, st, job->nk,
                        FA_BLOCK_PARTIAL);
            if (job->full)
                fa_bm_write(a->full_kv_num_blocks, a->full_kv_indices, bo, ho, qb, st, job->nk,
                            FA_BLOCK_FULL);
        }
}

fa_status fa_cpu_block_mask_build(const fa_params *p, const fa_block_mask_args *a)
{
    const fa_mod *m = a->mask_mod;
    fa_bm_job job = {p, a, 0, 0, 0, 0, a->full_kv_num_blocks != NULL, 0, 0, 0, NULL};
    job.nq = (a->sq + a->q_block - 1) / a->q_block;
    job.nk = (a->sk + a->kv_block - 1) / a->kv_block;
    job.rb = m->reads_b ? a->b : 1;
    job.rh = m->reads_h ? a->h : 1;
    /* A block's rows: a q_block past sq (any up to FA_MAX_EXTENT is valid) holds sq. */
    const int64_t rows = a->q_block < a->sq ? a->q_block : a->sq;
    job.scratch = (fa_cpu_mod_scratch_size(p, sizeof(float), rows) + 63) & ~(size_t)63;
    job.rows = ((size_t)rows * sizeof(float) + 63) & ~(size_t)63;
    job.per_thread = job.scratch + 5 * job.rows + (((size_t)job.nk + 63) & ~(size_t)63);
    const int64_t items = job.rb * job.rh * job.nq;
    const int threads = items < p->num_threads ? (int)items : p->num_threads;
    job.mem = aligned_alloc(64, job.per_thread * (size_t)threads);
    if (!job.mem)
        return fa_error_set(FA_STATUS_OUT_OF_MEMORY,
                            "fa_block_mask_build: out of memory for %lld query rows a thread",
                            (long long)rows);
    const fa_status st = fa_parallel_for(threads, items, fa_bm_task, &job);
    free(job.mem);
    return st;
}
