/*
 * CPU forward for fp8 inputs, with FA3's fp8 semantics (include/flashattn.h, "FP8"): the
 * reference the fp8 GPU kernels are tested against, written for clarity rather than speed.
 *
 * Work items are (sequence, head, tile of query rows), computed start to finish by one thread in
 * a fixed order, so results are bitwise identical for any thread count. Each row takes two passes
 * over its visible keys: the scores (kept in the thread's scratch), then, with the row's final
 * maximum m, p = 2^8 exp(s - m) summed unrounded into l and rounded to e4m3 for the P V product.
 * FA3's kernels offset by the running maximum of the key blocks seen so far, so their rounding
 * depends on their block sizes and order; the final maximum keeps this reference free of any
 * blocking (every p <= 256 either way, and both lie within e4m3's range).
 */
#include <math.h>
#include <stdlib.h>

#include "core/fa_fp8.h"
#include "core/fa_kvcache.h"
#include "cpu/fa_cpu.h"
#include "util/fa_half.h"
#include "util/fa_threadpool.h"

#define FA_FP8_TILE_ROWS 16 /* query rows per work item */
#define FA_FP8_P_OFFSET 8.0f /* log2 of FA3's factor on p: its Max_offset for fp8 */

typedef struct fa_fp8_chunk {
    int64_t seq, r0, m;
} fa_fp8_chunk;

typedef struct fa_fp8_job {
    const fa_params *p;
    const fa_fp8_chunk *chunks;
    float table[256];    /* every fp8 code's value */
    float *scratch;      /* per thread: scores [keys], q row [d], accumulator [dv] */
    size_t scratch_size; /* floats per thread */
    int64_t keys;        /* the most keys a row sees (at least 1) */
} fa_fp8_job;

static float fa_fp8_descale(const float *t, int64_t bstride, int64_t hstride, int64_t b,
                            int64_t hk)
{
    return t ? t[b * bstride + hk * hstride] : 1.0f;
}

/* Row `row` of head h in sequence seq_index: out (and lse). s, q, acc: the thread's scratch. */
static void fa_fp8_row(const fa_fp8_job *job, int64_t seq_index, const fa_seq *seq, int64_t h,
                       int64_t row, float *s, float *qf, float *acc)
{
    const fa_params *p = job->p;
    const float *tab = job->table;
    const int64_t hk = h / (p->h / p->hk), d = p->d, dv = p->dv;
    const uint8_t *q = (const uint8_t *)p->q + seq_index * p->q_bstride +
                       (seq->q_start + row) * p->q_rstride + h * p->q_hstride;
    /* Without keys k and v may be empty, their data NULL: no address is formed from them. */
    const uint8_t *k = seq->sk == 0 ? NULL : (const uint8_t *)p->k + hk * p->k_hstride;
    const uint8_t *v = seq->sk == 0 ? NULL : (const uint8_t *)p->v + hk * p->v_hstride;
    int64_t k_at, v_at;
    /* FA3 folds q_descale * k_descale into the softmax scale (or softcap's pre-factor) and
     * v_descale into the final 1 / l. */
    const double qk_descale =
        (double)fa_fp8_descale(p->q_descale, p->qd_bstride, p->qd_hstride, seq_index, hk) *
        fa_fp8_descale(p->k_descale, p->kd_bstride, p->kd_hstride, seq_index, hk);
    const float v_descale =
        fa_fp8_descale(p->v_descale, p->vd_bstride, p->vd_hstride, seq_index, hk);
    const float scale = (float)(p->scale * qk_descale);
    const float pre = p->softcap > 0 ? (float)(p->scale * qk_descale / p->softcap) : 0.0f;
    const float cap = (float)p->softcap;
    const float slope =
        p->alibi_slopes ? p->alibi_slopes[seq_index * p->alibi_bstride + h * p->alibi_hstride]
                        : 0.0f;
    const float sink = p->sinks ? p->sinks[h * p->sinks_stride] : -INFINITY;

    int64_t lo, hi;
    fa_params_key_range(p, row, seq->sq, seq->sk, &lo, &hi);
    for (int64_t x = 0; x < d; x++)
        qf[x] = tab[q[x]];
    float mx = -INFINITY;
    int nan = 0; /* a NaN score makes the whole row NaN, even when every score is NaN */
    for (int64_t j = lo; j < hi; j++) {
        fa_kv_key_at(p, seq_index, seq->k_start, j, &k_at, &v_at);
        const uint8_t *kj = k + k_at;
        float dot = 0.0f;
        for (int64_t x = 0; x < d; x++)
            dot += qf[x] * tab[kj[x]];
        float sc = p->softcap > 0 ? cap * tanhf(dot * pre) : dot * scale;
        if (p->alibi_slopes) {
            const int64_t dist = row + seq->sk - seq->sq - j;
            sc -= slope * (float)(dist < 0 ? -dist : dist);
        }
        s[j - lo] = sc;
        mx = sc > mx ? sc : mx;
        nan |= sc != sc;
    }

    const float big = mx > sink ? mx : sink;
    for (int64_t x = 0; x < dv; x++)
        acc[x] = 0.0f;
    float l = 0.0f, lse, out_scale;
    if (nan) {
        lse = out_scale = NAN;
    } else if (big == -INFINITY) {
        lse = INFINITY; /* no visible key and no sink: upstream's empty row */
        out_scale = 0.0f;
    } else {
        const float log2e = 1.4426950408889634f;
        for (int64_t j = lo; j < hi; j++) {
            const float pj = exp2f((s[j - lo] - big) * log2e + FA_FP8_P_OFFSET);
            const float p8 = fa_e4m3_round(pj);
            fa_kv_key_at(p, seq_index, seq->k_start, j, &k_at, &v_at);
            const uint8_t *vj = v + v_at;
            l += pj;
            for (int64_t x = 0; x < dv; x++)
                acc[x] += p8 * tab[vj[x]];
        }
        if (p->sinks)
            l += exp2f((sink - big) * log2e + FA_FP8_P_OFFSET);
        if (l != l) {
            lse = out_scale = l; /* a NaN score reached the sum: the whole row is NaN */
        } else {
            lse = (float)((double)big + log((double)l) - FA_FP8_P_OFFSET * M_LN2);
            out_scale = v_descale / l;
        }
    }

    const int64_t o_at = seq_index * p->o_bstride + (seq->q_start + row) * p->o_rstride +
                         h * p->o_hstride;
    uint16_t *o = (uint16_t *)p->out + o_at;
    for (int64_t x = 0; x < dv; x++)
        o[x] = p->out_dtype == FA_DTYPE_BF16 ? fa_f32_to_bf16(acc[x] * out_scale)
                                             : fa_f32_to_f16(acc[x] * out_scale);
    if (p->lse)
        fa_params_lse_store(p,
                            seq_index * p->lse_bstride + h * p->lse_hstride +
                                (p->is_varlen ? seq->q_start + row : row) * p->lse_rstride,
                            (double)lse);
}

/* Item: (chunk, head), heads innermost. */
static void fa_fp8_task(void *ctx, int64_t item, int thread)
{
    const fa_fp8_job *job = ctx;
    const fa_params *p = job->p;
    const fa_fp8_chunk *c = &job->chunks[item / p->h];
    const int64_t h = item % p->h;
    const fa_seq seq = fa_params_seq(p, c->seq);
    float *s = job->scratch + (size_t)thread * job->scratch_size;
    float *qf = s + job->keys;
    float *acc = qf + p->d;
    for (int64_t r = c->r0; r < c->r0 + c->m; r++)
        fa_fp8_row(job, c->seq, &seq, h, r, s, qf, acc);
}

/* Varlen rows that belong to no sequence: out 0, lse +inf, as the other dtypes. */
static void fa_fp8_fill_uncovered(const fa_params *p)
{
    if (!p->is_varlen)
        return;
    const int64_t first = p->cu_seqlens_q[0], last = p->cu_seqlens_q[p->b];
    for (int64_t r = 0; r < p->total_q; r++) {
        if (r >= first && r < last)
            continue;
        for (int64_t h = 0; h < p->h; h++) {
            uint16_t *o = (uint16_t *)p->out + r * p->o_rstride + h * p->o_hstride;
            for (int64_t x = 0; x < p->dv; x++)
                o[x] = 0;
            if (p->lse)
                fa_params_lse_store(p, h * p->lse_hstride + r * p->lse_rstride, INFINITY);
        }
    }
}

fa_status fa_cpu_forward_fp8(const fa_params *p)
{
    fa_fp8_fill_uncovered(p);
    int64_t n_chunks = 0;
    for (int64_t i = 0; i < p->b; i++)
        n_chunks += (fa_params_seq(p, i).sq + FA_FP8_TILE_ROWS - 1) / FA_FP8_TILE_ROWS;
    if (n_chunks == 0)
        return FA_STATUS_OK;
    const int64_t n_items = n_chunks * p->h;
    const int threads = p->num_threads < n_items ? p->num_threads : (int)n_items;
    fa_fp8_job job = {.p = p};
    /* A row's scores: at most max_sk keys, and a varlen sequence's keys lie within k's rows
     * (max_seqlen_k may claim far more than k holds). */
    const int64_t keys = p->is_varlen && p->total_k < p->max_sk ? p->total_k : p->max_sk;
    job.keys = keys > 0 ? keys : 1;
    job.scratch_size = (size_t)(job.keys + p->d + p->dv);
    fa_fp8_chunk *chunks = malloc((size_t)n_chunks * sizeof *chunks);
    job.scratch = malloc(job.scratch_size * (size_t)threads * sizeof(float));
    fa_status st = FA_STATUS_OK;
    if (!chunks || !job.scratch) {
        st = fa_error_set(FA_STATUS_OUT_OF_MEMORY,
                          "out of memory for the fp8 forward's %lld work items",
                          (long long)n_items);
    } else {
        int64_t at = 0;
        for (int64_t i = 0; i < p->b; i++) {
            const int64_t sq = fa_params_seq(p, i).sq;
            for (int64_t r0 = 0; r0 < sq; r0 += FA_FP8_TILE_ROWS)
                chunks[at++] = (fa_fp8_chunk){i, r0, sq - r0 < FA_FP8_TILE_ROWS
                                                         ? sq - r0
                                                         : FA_FP8_TILE_ROWS};
        }
        job.chunks = chunks;
        fa_fp8_table(p->dtype, job.table);
        st = fa_parallel_for(threads, n_items, fa_fp8_task, &job);
    }
    free(job.scratch);
    free(chunks);
    return st;
}
