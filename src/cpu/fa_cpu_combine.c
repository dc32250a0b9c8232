/*
 * CPU merge of partial attention results (split-KV, sequence parallelism). Rows are
 * independent; each is merged in double precision in split order, so the result does not
 * depend on the thread count. The merge is memory bound: it reads every partial once.
 */
#include <math.h>
#include <stdlib.h>

#include "fa_rules.h"
#include "cpu/fa_cpu.h"
#include "cpu/fa_cpu_log.h"
#include "util/fa_half.h"
#include "util/fa_threadpool.h"

#define FA_COMBINE_ROWS 64 /* most rows (batch, seq, head) per work item */

static double fa_combine_part_lse(const fa_params *c, int64_t s, int64_t at)
{
    int64_t off = s * c->lseaccum_sstride + at;
    return c->accum_dtype == FA_DTYPE_F64 ? ((const double *)c->lseaccum)[off]
                                         : (double)((const float *)c->lseaccum)[off];
}

static void fa_combine_out_store(const fa_params *c, int64_t off, const double *acc)
{
    if (c->dv == 0)
        return; /* out is empty, its data pointer perhaps NULL */
    switch (c->dtype) {
    case FA_DTYPE_F32: {
        float *o = (float *)c->out + off;
        for (int64_t k = 0; k < c->dv; k++)
            o[k] = (float)acc[k];
        break;
    }
    case FA_DTYPE_F16: {
        uint16_t *o = (uint16_t *)c->out + off;
        for (int64_t k = 0; k < c->dv; k++)
            o[k] = fa_f32_to_f16((float)acc[k]);
        break;
    }
    case FA_DTYPE_BF16: {
        uint16_t *o = (uint16_t *)c->out + off;
        for (int64_t k = 0; k < c->dv; k++)
            o[k] = fa_f32_to_bf16((float)acc[k]);
        break;
    }
    case FA_DTYPE_F64: {
        double *o = (double *)c->out + off;
        for (int64_t k = 0; k < c->dv; k++)
            o[k] = acc[k];
        break;
    }
    default:
        break;
    }
}

/* One row (batch bi, position r, head hh); acc is dv doubles of scratch. */
static void fa_combine_row(const fa_params *c, int64_t bi, int64_t r, int64_t hh,
                           double *acc)
{
    const int64_t lp_at = bi * c->lseaccum_bstride + r * c->lseaccum_rstride + hh * c->lseaccum_hstride;
    const int64_t op_at = bi * c->oaccum_bstride + r * c->oaccum_rstride + hh * c->oaccum_hstride;
    const double sink = c->sinks ? (double)c->sinks[hh * c->sinks_stride] : -INFINITY;

    /* A NaN lse is not an empty part: it makes the whole row NaN, as a sum with it would. */
    double mx = sink;
    int has_nan = 0;
    for (int64_t s = 0; s < c->num_splits; s++) {
        double x = fa_combine_part_lse(c, s, lp_at);
        has_nan |= isnan(x);
        if (x != INFINITY && x > mx)
            mx = x;
    }
    for (int64_t k = 0; k < c->dv; k++)
        acc[k] = 0.0;
    double lse;
    if (has_nan) {
        lse = NAN;
        for (int64_t k = 0; k < c->dv; k++)
            acc[k] = NAN;
    } else if (mx == -INFINITY) {
        lse = c->empty_lse;
    } else {
        double sum = FA_RULE_SINK_TERM(c->sinks, sink, mx, exp);
        for (int64_t s = 0; s < c->num_splits; s++) {
            double x = fa_combine_part_lse(c, s, lp_at);
            if (!FA_RULE_PART_EMPTY(x, INFINITY))
                sum += exp(x - mx);
        }
        lse = mx + log(sum);
        for (int64_t s = 0; s < c->num_splits; s++) {
            double x = fa_combine_part_lse(c, s, lp_at);
            if (FA_RULE_PART_EMPTY(x, INFINITY) || c->dv == 0) /* dv 0: o_part may be NULL */
                continue;
            double w = exp(x - lse);
            int64_t off = s * c->oaccum_sstride + op_at;
            if (c->accum_dtype == FA_DTYPE_F64) {
                const double *o = (const double *)c->oaccum + off;
                for (int64_t k = 0; k < c->dv; k++)
                    acc[k] += w * o[k];
            } else {
                const float *o = (const float *)c->oaccum + off;
                for (int64_t k = 0; k < c->dv; k++)
                    acc[k] += w * (double)o[k];
            }
        }
    }
    fa_combine_out_store(c, bi * c->o_bstride + r * c->o_rstride + hh * c->o_hstride, acc);
    if (c->lse) {
        int64_t at = bi * c->lse_bstride + r * c->lse_rstride + hh * c->lse_hstride;
        if (c->lse_dtype == FA_DTYPE_F64)
            ((double *)c->lse)[at] = lse;
        else
            ((float *)c->lse)[at] = (float)lse;
    }
}

typedef struct fa_combine_job {
    const fa_params *c;
    int64_t rows_per_item;
    double *scratch; /* dv doubles per thread */
} fa_combine_job;

static void fa_combine_task(void *ctx, int64_t item, int thread)
{
    const fa_combine_job *job = ctx;
    const fa_params *c = job->c;
    double *acc = job->scratch + (size_t)thread * (size_t)c->dv;
    const int64_t rows = c->b * c->max_sq * c->h;
    const int64_t per = job->rows_per_item;
    const int64_t end = (item + 1) * per < rows ? (item + 1) * per : rows;
    for (int64_t x = item * per; x < end; x++) {
        int64_t hh = x % c->h;
        int64_t r = (x / c->h) % c->max_sq;
        int64_t bi = x / (c->h * c->max_sq);
        fa_combine_row(c, bi, r, hh, acc);
    }
}

fa_status fa_cpu_combine(const fa_params *c)
{
    const int64_t rows = c->b * c->max_sq * c->h;
    if (rows == 0)
        return FA_STATUS_OK;
    /* Items small enough that every thread takes one: a decode has few rows but many splits,
     * too much merging for one thread. */
    const int64_t want = c->num_threads > 1 ? c->num_threads : 1;
    int64_t per = (rows + want - 1) / want;
    per = per < FA_COMBINE_ROWS ? per : FA_COMBINE_ROWS;
    const int64_t items = (rows + per - 1) / per;
    int threads = c->num_threads < items ? c->num_threads : (int)items;
    if (threads < 1)
        threads = 1;
    fa_combine_job job = {c, per, malloc(sizeof(double) * (size_t)(c->dv + 1) * (size_t)threads)};
    if (!job.scratch)
        return fa_error_set(FA_STATUS_OUT_OF_MEMORY, "out of memory for the combine's buffers");
    fa_status st = c->log
                       ? fa_cpu_log_phase(c->log, "combine", threads, items, fa_combine_task, &job)
                       : fa_parallel_for(threads, items, fa_combine_task, &job);
    free(job.scratch);
    return st;
}
