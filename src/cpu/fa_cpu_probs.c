/*
 * The debugging probs output (upstream's S_dmask encoding, see flashattn.h). It is O(sq * sk)
 * by nature and only used for testing, so it favours plainness: one row at a time, in double.
 */
#include <math.h>
#include <stdlib.h>

#include "fa_rules.h"
#include "core/fa_kvcache.h"
#include "cpu/fa_cpu.h"
#include "util/fa_half.h"
#include "core/fa_philox.h"
#include "util/fa_threadpool.h"

static double fa_probs_load(const void *base, int64_t at, fa_dtype dtype)
{
    switch (dtype) {
    case FA_DTYPE_F32:
        return ((const float *)base)[at];
    case FA_DTYPE_F16:
        return fa_f16_to_f32(((const uint16_t *)base)[at]);
    case FA_DTYPE_BF16:
        return fa_bf16_to_f32(((const uint16_t *)base)[at]);
    case FA_DTYPE_F64:
        return ((const double *)base)[at];
    default:
        return 0;
    }
}

static void fa_probs_store(void *base, int64_t at, double x, fa_dtype dtype)
{
    switch (dtype) {
    case FA_DTYPE_F32:
        ((float *)base)[at] = (float)x;
        break;
    case FA_DTYPE_F16:
        ((uint16_t *)base)[at] = fa_f32_to_f16((float)x);
        break;
    case FA_DTYPE_BF16:
        ((uint16_t *)base)[at] = fa_f32_to_bf16((float)x);
        break;
    case FA_DTYPE_F64:
        ((double *)base)[at] = x;
        break;
    default:
        break;
    }
}

typedef struct fa_probs_job {
    const fa_params *p;
    double *rows; /* per thread: the scores of one row, [probs_sk] */
} fa_probs_job;

/* Item = (sequence, head): all probs_sq rows of that head, padding included. */
static void fa_probs_task(void *ctx, int64_t item, int thread)
{
    const fa_probs_job *job = ctx;
    const fa_params *p = job->p;
    const int64_t bi = item / p->h, h = item % p->h;
    const fa_seq seq = fa_params_seq(p, bi);
    const int64_t hk = h / (p->h / p->hk);
    const int64_t bn = p->probs_block_n;
    double *s = job->rows + (size_t)thread * (size_t)p->probs_sk;
    const double slope =
        p->alibi_slopes ? p->alibi_slopes[bi * p->alibi_bstride + h * p->alibi_hstride] : 0.0;
    const uint64_t stream = p->offset + (uint64_t)bi * (uint64_t)p->h + (uint64_t)h;
    const int64_t base = bi * p->p_bstride + h * p->p_hstride;

    for (int64_t i = 0; i < p->probs_sq; i++) {
        int64_t lo = 0, hi = 0;
        if (i < seq.sq)
            fa_params_key_range(p, i, seq.sq, seq.sk, &lo, &hi);
        for (int64_t j = lo; j < hi; j++) {
            double dot = 0;
            int64_t qa = bi * p->q_bstride + (seq.q_start + i) * p->q_rstride + h * p->q_hstride;
            int64_t ka, va;
            fa_kv_key_at(p, bi, seq.k_start, j, &ka, &va);
            ka += hk * p->k_hstride;
            for (int64_t c = 0; c < p->d; c++)
                dot += fa_probs_load(p->q, qa + c, p->dtype) * fa_probs_load(p->k, ka + c, p->dtype);
            double x = p->softcap > 0 ? FA_RULE_SOFTCAP(dot, p->scale / p->softcap, p->softcap, tanh)
                                      : dot * p->scale;
            x -= FA_RULE_ALIBI(slope, (double)(i + seq.sk - seq.sq - j));
            s[j] = x;
        }
        /* Blocks from the last to the first; the maximum runs over the blocks seen so far. */
        double mx = -INFINITY;
        int64_t n_blocks = (seq.sk + bn - 1) / bn;
        for (int64_t blk = n_blocks - 1; blk >= 0; blk--) {
            int64_t a = blk * bn > lo ? blk * bn : lo;
            int64_t b = (blk + 1) * bn < hi ? (blk + 1) * bn : hi;
            for (int64_t j = a; j < b; j++)
                mx = s[j] > mx ? s[j] : mx;
            for (int64_t j = a; j < b; j++) {
                double e = exp(s[j] - mx);
                if (p->dropout_p > 0) {
                    fa_philox4 bits = fa_dropout_block(p->seed, stream, i, j);
                    if (fa_dropout_number(&bits, j) >= p->keep_threshold)
                        e = -e;
                }
                s[j] = e;
            }
        }
        for (int64_t j = 0; j < p->probs_sk; j++)
            fa_probs_store(p->probs, base + i * p->p_rstride + j, (j >= lo && j < hi) ? s[j] : 0.0,
                           p->dtype);
    }
}

fa_status fa_cpu_probs(const fa_params *p)
{
    int64_t n_items = p->b * p->h;
    int threads = p->num_threads < n_items ? p->num_threads : (int)n_items;
    fa_probs_job job = {p, malloc((size_t)threads * (size_t)(p->probs_sk + 1) * sizeof(double))};
    if (!job.rows)
        return fa_error_set(FA_STATUS_OUT_OF_MEMORY, "out of memory for the probs output");
    fa_status st = fa_parallel_for(threads, n_items, fa_probs_task, &job);
    free(job.rows);
    return st;
}
