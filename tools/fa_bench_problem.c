/* The tensors of one benchmark call, filled with seeded random values. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fa_bench.h"
#include "fa_ref.h"
#include "fa_rules.h"

/* splitmix64: tiny, seedable with any value (0 included), good enough for test inputs. */
typedef struct bench_rng {
    uint64_t state;
} bench_rng;

static uint64_t rng_next(bench_rng *r)
{
    uint64_t z = (r->state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in (0, 1]: never 0, so log() below is finite. */
static double rng_uniform(bench_rng *r)
{
    return (double)((rng_next(r) >> 11) + 1) * 0x1p-53;
}

/* Standard normal (Box-Muller): scores then have unit spread at the default d^-0.5 scale, as
 * in trained models, so the softmax is neither flat nor one-hot. */
static double rng_normal(bench_rng *r)
{
    const double two_pi = 6.283185307179586;
    return sqrt(-2.0 * log(rng_uniform(r))) * cos(two_pi * rng_uniform(r));
}

int64_t fa_bench_numel(const fa_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}

void fa_bench_index_next(const fa_tensor *t, int64_t *idx)
{
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (++idx[i] < t->shape[i])
            return;
        idx[i] = 0;
    }
}

/* Returns max |element| after rounding to the tensor's dtype. */
static double tensor_fill_normal(const fa_tensor *t, bench_rng *r)
{
    int64_t idx[FA_MAX_DIMS] = {0};
    int64_t n = fa_bench_numel(t);
    double max_abs = 0.0;
    for (int64_t e = 0; e < n; e++, fa_bench_index_next(t, idx)) {
        double x = fa_ref_round(rng_normal(r), t->dtype);
        fa_ref_store(t, idx, x);
        max_abs = fmax(max_abs, fabs(x));
    }
    return max_abs;
}

static void tensor_fill_value(const fa_tensor *t, double value)
{
    int64_t idx[FA_MAX_DIMS] = {0};
    int64_t n = fa_bench_numel(t);
    for (int64_t e = 0; e < n; e++, fa_bench_index_next(t, idx))
        fa_ref_store(t, idx, value);
}

void fa_bench_outputs_poison(const fa_bench_problem *p)
{
    tensor_fill_value(&p->out, NAN);
    tensor_fill_value(&p->lse, NAN);
}

/* A contiguous tensor on a fresh 64-byte aligned buffer, so that timings do not depend on
 * where malloc happened to put the data. */
static int tensor_alloc(fa_bench_problem *p, fa_tensor *t, fa_dtype dtype, int ndim,
                        const int64_t *shape)
{
    double bytes = (double)fa_dtype_size(dtype);
    for (int i = 0; i < ndim; i++)
        bytes *= (double)shape[i];
    if (bytes > 0x1p46) {
        fprintf(stderr, "flashattn bench: a %.3g GiB tensor is more than this tool allocates\n",
                bytes / 0x1p30);
        return FA_EXIT_USAGE;
    }
    size_t size = ((size_t)bytes + 63) / 64 * 64;
    void *data = aligned_alloc(64, size ? size : 64);
    if (!data) {
        fprintf(stderr, "flashattn bench: out of memory allocating %.3g GiB\n", bytes / 0x1p30);
        return FA_EXIT_FAIL;
    }
    p->buffers[p->num_buffers++] = data;
    *t = fa_tensor_make(data, dtype, ndim, shape, NULL);
    return FA_EXIT_OK;
}

/* Cuts total tokens into b sequences: cut i sits at i * mean, jittered by up to half a mean
 * either way, so lengths vary between 0 and twice the mean (a realistic packed batch, with the
 * occasional empty sequence the varlen path must handle). Returns the longest. */
static int64_t seqlens_split(bench_rng *r, int64_t total, int64_t b, int32_t *cu)
{
    const double mean = (double)total / (double)b;
    int64_t longest = 0;
    cu[0] = 0;
    for (int64_t i = 1; i <= b; i++) {
        double cut = i == b ? (double)total : ((double)i + rng_uniform(r) - 0.5) * mean;
        int64_t c = (int64_t)floor(cut);
        c = c < cu[i - 1] ? cu[i - 1] : c > total ? total : c;
        cu[i] = (int32_t)c;
        longest = c - cu[i - 1] > longest ? c - cu[i - 1] : longest;
    }
    return longest;
}

static int varlen_setup(fa_bench_problem *p, const fa_bench_config *cfg, bench_rng *r)
{
    const int64_t b = cfg->batch;
    const int64_t total_q = b * cfg->seqlen_q, total_k = b * cfg->seqlen_k;
    if (total_q > INT32_MAX || total_k > INT32_MAX) {
        fprintf(stderr, "flashattn bench: --varlen needs batch * seqlen <= %d (int32 offsets)\n",
                INT32_MAX);
        return FA_EXIT_USAGE;
    }
    const int64_t cu_shape[1] = {b + 1};
    int rc = tensor_alloc(p, &p->cu_seqlens_q, FA_DTYPE_I32, 1, cu_shape);
    if (rc != FA_EXIT_OK)
        return rc;
    p->args.max_seqlen_q = seqlens_split(r, total_q, b, p->cu_seqlens_q.data);
    if (cfg->seqlen_q == cfg->seqlen_k) {
        /* Self-attention: each sequence has as many keys as queries. */
        p->cu_seqlens_k = p->cu_seqlens_q;
        p->args.max_seqlen_k = p->args.max_seqlen_q;
    } else {
        rc = tensor_alloc(p, &p->cu_seqlens_k, FA_DTYPE_I32, 1, cu_shape);
        if (rc != FA_EXIT_OK)
            return rc;
        p->args.max_seqlen_k = seqlens_split(r, total_k, b, p->cu_seqlens_k.data);
    }
    p->args.cu_seqlens_q = &p->cu_seqlens_q;
    p->args.cu_seqlens_k = &p->cu_seqlens_k;
    return FA_EXIT_OK;
}

static int tensors_alloc(fa_bench_problem *p, const fa_bench_config *cfg)
{
    const int64_t b = cfg->batch, h = cfg->heads, hk = cfg->kv_heads;
    const int64_t sq = cfg->seqlen_q, sk = cfg->seqlen_k, d = cfg->head_dim;
    const int64_t dv = cfg->head_dim_v;
    const fa_dtype dt = cfg->dtype;
    int rc;
    if (cfg->varlen) {
        const int64_t tq = b * sq, tk = b * sk;
        const int64_t q_shape[3] = {tq, h, d}, k_shape[3] = {tk, hk, d};
        const int64_t v_shape[3] = {tk, hk, dv}, o_shape[3] = {tq, h, dv};
        const int64_t lse_shape[2] = {h, tq};
        if ((rc = tensor_alloc(p, &p->q, dt, 3, q_shape)) != FA_EXIT_OK ||
            (rc = tensor_alloc(p, &p->k, dt, 3, k_shape)) != FA_EXIT_OK ||
            (rc = tensor_alloc(p, &p->v, dt, 3, v_shape)) != FA_EXIT_OK ||
            (rc = tensor_alloc(p, &p->out, dt, 3, o_shape)) != FA_EXIT_OK ||
            (rc = tensor_alloc(p, &p->lse, FA_DTYPE_F32, 2, lse_shape)) != FA_EXIT_OK)
            return rc;
        p->tokens_q = tq;
    } else {
        const int64_t q_shape[4] = {b, sq, h, d}, k_shape[4] = {b, sk, hk, d};
        const int64_t v_shape[4] = {b, sk, hk, dv}, o_shape[4] = {b, sq, h, dv};
        const int64_t lse_shape[3] = {b, h, sq};
        if ((rc = tensor_alloc(p, &p->q, dt, 4, q_shape)) != FA_EXIT_OK ||
            (rc = tensor_alloc(p, &p->k, dt, 4, k_shape)) != FA_EXIT_OK ||
            (rc = tensor_alloc(p, &p->v, dt, 4, v_shape)) != FA_EXIT_OK ||
            (rc = tensor_alloc(p, &p->out, dt, 4, o_shape)) != FA_EXIT_OK ||
            (rc = tensor_alloc(p, &p->lse, FA_DTYPE_F32, 3, lse_shape)) != FA_EXIT_OK)
            return rc;
        p->tokens_q = b * sq;
    }
    return FA_EXIT_OK;
}

int fa_bench_problem_init(fa_bench_problem *p, const fa_bench_config *cfg)
{
    memset(p, 0, sizeof *p);
    bench_rng r = {cfg->seed};
    fa_fwd_args_init(&p->args);
    int rc = tensors_alloc(p, cfg);
    if (rc == FA_EXIT_OK && cfg->varlen)
        rc = varlen_setup(p, cfg, &r);
    if (rc != FA_EXIT_OK) {
        fa_bench_problem_free(p);
        return rc;
    }
    tensor_fill_normal(&p->q, &r);
    tensor_fill_normal(&p->k, &r);
    p->max_abs_v = tensor_fill_normal(&p->v, &r);

    const int64_t h = cfg->heads;
    if (cfg->alibi) {
        if ((rc = tensor_alloc(p, &p->alibi_slopes, FA_DTYPE_F32, 1, &h)) != FA_EXIT_OK) {
            fa_bench_problem_free(p);
            return rc;
        }
        /* The geometric slopes of the ALiBi paper (exact for a power-of-two head count). */
        float *slopes = p->alibi_slopes.data;
        for (int64_t i = 0; i < h; i++)
            slopes[i] = (float)exp2(-8.0 * (double)(i + 1) / (double)h);
        p->args.alibi_slopes = &p->alibi_slopes;
    }
    if (cfg->sinks) {
        if ((rc = tensor_alloc(p, &p->sinks, FA_DTYPE_F32, 1, &h)) != FA_EXIT_OK) {
            fa_bench_problem_free(p);
            return rc;
        }
        tensor_fill_normal(&p->sinks, &r);
        p->args.sinks = &p->sinks;
    }

    fa_fwd_args *a = &p->args;
    a->q = &p->q;
    a->k = &p->k;
    a->v = &p->v;
    a->out = &p->out;
    a->lse = &p->lse;
    a->causal = cfg->causal;
    a->window_left = (int)cfg->window_left;
    a->window_right = (int)cfg->window_right;
    a->softcap = cfg->softcap;
    a->dropout_p = cfg->dropout_p;
    a->seed = cfg->seed;
    a->offset = 0;
    /* Host buffers: the CUDA backend, once there, will want device copies; until then the
     * library answers device >= 0 with its own error, which the bench reports. */
    a->device = cfg->device;
    a->num_threads = (int)cfg->threads;
    return FA_EXIT_OK;
}

void fa_bench_problem_free(fa_bench_problem *p)
{
    for (int i = 0; i < p->num_buffers; i++)
        free(p->buffers[i]);
    p->num_buffers = 0;
}

double fa_bench_visible_pairs(const fa_fwd_args *a)
{
    const int varlen = a->cu_seqlens_q != NULL;
    const int64_t b = varlen ? a->cu_seqlens_q->shape[0] - 1 : a->q->shape[0];
    /* As the header defines the mask; causal is the window (left, 0). */
    const int64_t left = a->window_left, right = a->causal ? 0 : a->window_right;
    double pairs = 0.0;
    for (int64_t s = 0; s < b; s++) {
        int64_t sq, sk;
        if (varlen) {
            const int32_t *cu_q = a->cu_seqlens_q->data, *cu_k = a->cu_seqlens_k->data;
            sq = cu_q[s + 1] - cu_q[s];
            sk = a->seqused_k ? ((const int32_t *)a->seqused_k->data)[s] : cu_k[s + 1] - cu_k[s];
        } else {
            sq = a->q->shape[1];
            sk = a->k->shape[1];
        }
        for (int64_t i = 0; i < sq; i++) {
            int64_t lo, hi;
            FA_RULE_KEY_RANGE(i, sq, sk, left, right, lo, hi);
            pairs += (double)(hi - lo);
        }
    }
    return pairs;
}
