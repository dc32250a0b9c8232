/*
 * CPU backward, in parallel phases over the thread pool:
 *   1. D = rowsum(dout * out) per (row, head) into a workspace of b*sq*h reals, and dsinks;
 *   2. fused (enough (sequence, kv head) pairs, fa_plan_cpu_bwd_stripes): one item per pair and stripe of
 *      its key chunks computes dK, dV and the stripe's share of dQ in a copy of its own (the
 *      last stripes as two items of half the query rows, below FA_CPU_BWD_HALVES_BELOW items);
 *      then the copies are summed in stripe order;
 *   2'. otherwise two passes: the key pass (dK, dV) per (sequence, kv head, key chunk), then the
 *      query pass (dQ) per (sequence, head, query tile).
 * Every output element is summed in a fixed order whatever thread computes it, so the result is
 * the same bits for any thread count; parallelism comes from key chunks and query tiles, not
 * only from batch x heads.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_rules.h"
#include "cpu/fa_cpu.h"
#include "cpu/fa_cpu_bf16.h"
#include "cpu/fa_cpu_info.h"
#include "cpu/fa_cpu_kernel.h"
#include "cpu/fa_cpu_log.h"
#include "cpu/fa_cpu_mod.h"
#include "util/fa_threadpool.h"

/* Index of a query row among all q rows (the workspace's and lse's varlen column). */
static inline int64_t fa_bwd_token(const fa_params *p, int64_t seq_index, const fa_seq *seq,
                                   int64_t row)
{
    return p->is_varlen ? seq->q_start + row : seq_index * p->max_sq + row;
}

static inline int64_t fa_bwd_lse_index(const fa_params *p, int64_t seq_index, int64_t h,
                                       int64_t token, int64_t row)
{
    return seq_index * p->lse_bstride + h * p->lse_hstride +
           (p->is_varlen ? token : row) * p->lse_rstride;
}

/* Key rows of a sequence that get gradients: all of them, the unused ones (seqused_k) too. */
static inline int64_t fa_bwd_key_count(const fa_params *p, int64_t seq_index)
{
    return p->is_varlen ? p->cu_seqlens_k[seq_index + 1] - p->cu_seqlens_k[seq_index]
                        : p->max_sk;
}

/* Query rows [*lo, *hi) that can see any key of [j0, j1). */
static inline void fa_bwd_row_range(const fa_params *p, const fa_seq *seq, int64_t j0, int64_t j1,
                                    int64_t *lo, int64_t *hi)
{
    FA_RULE_ROW_RANGE(j0, j1, seq->sq, seq->sk, p->window_left, p->window_right, *lo, *hi);
}

/*
 * Query rows [*lo, *hi) that see a key of stripe `stripe` of a sequence's klen keys (its chunks
 * stripe, stripe + stripes, ... of `chunk` keys), as one range: the fused items write their dQ
 * slot on these rows only, and the sum adds a slot only there. Under a causal mask the first
 * stripes' keys are seen by every row and the last ones' by the last rows alone, so the slots
 * are written and read over fewer rows than the sequence's.
 */
static void fa_bwd_stripe_rows(const fa_params *p, const fa_seq *seq, int64_t klen,
                               int64_t stripe, int64_t stripes, int64_t chunk, int64_t *lo,
                               int64_t *hi)
{
    *lo = seq->sq;
    *hi = 0;
    for (int64_t j0 = stripe * chunk; j0 < klen; j0 += stripes * chunk) {
        int64_t a, b;
        fa_bwd_row_range(p, seq, j0, j0 + chunk < klen ? j0 + chunk : klen, &a, &b);
        if (a < b) {
            *lo = a < *lo ? a : *lo;
            *hi = b > *hi ? b : *hi;
        }
    }
    if (*hi < *lo)
        *hi = *lo;
}

/* The split row of a fused item's halves falls on a multiple of this from the first row it
 * covers: whole query tiles of both the fp32 (64 rows) and the bf16 (128 rows) kernels. */
#define FA_BWD_HALF_ROWS 128

/*
 * One half of a fused item split by query rows (the last stripe of each (sequence, kv head), so
 * that the items the threads finish on are half as long): rows [r_lo, r_hi) of the sequence.
 * The halves write disjoint rows of dQ, and meet on each of the stripe's key chunks to add up
 * dK and dV (fa_bwd_half_meet).
 */
typedef struct fa_bwd_half {
    int64_t r_lo, r_hi;
    int part;           /* 0: the rows before the split, 1: the rows from it */
    int64_t slot;       /* reals of a slot: keys per chunk x (pad(d) + pad(dv)) */
    void *kv_ws;        /* reals [stripe's chunks][2 halves][slot] */
    atomic_int *done;   /* [stripe's chunks]: halves that have put their sums in their slot */
} fa_bwd_half;

/* Narrows query rows [*lo, *hi) to a half's (half NULL: unchanged). */
static inline void fa_bwd_half_rows(const fa_bwd_half *half, int64_t *lo, int64_t *hi)
{
    if (!half)
        return;
    if (*lo < half->r_lo)
        *lo = half->r_lo;
    if (*hi > half->r_hi)
        *hi = half->r_hi;
    if (*hi < *lo)
        *hi = *lo;
}

#define FA_REAL float
#define FA_FN(name) name##_f32
#define FA_NATIVE FA_DTYPE_F32
#define FA_GEMM fa_cpu_gemm_f32
#define FA_EXPV fa_expf
#define FA_TANHV fa_tanhf
#include "cpu/fa_cpu_rows.h"
#include "cpu/fa_cpu_edge.h"
#include "cpu/fa_cpu_bwd_body.h"
#include "cpu/fa_cpu_bwd_bf16.h"
#undef FA_REAL
#undef FA_FN
#undef FA_NATIVE
#undef FA_GEMM
#undef FA_EXPV
#undef FA_TANHV

#define FA_REAL double
#define FA_FN(name) name##_f64
#define FA_NATIVE FA_DTYPE_F64
#define FA_GEMM fa_cpu_gemm_f64
#define FA_EXPV exp
#define FA_TANHV tanh
#include "cpu/fa_cpu_rows.h"
#include "cpu/fa_cpu_edge.h"
#include "cpu/fa_cpu_bwd_body.h"
#undef FA_REAL
#undef FA_FN
#undef FA_NATIVE
#undef FA_GEMM
#undef FA_EXPV
#undef FA_TANHV

/* A block of rows (query pass) or keys (key pass) of one sequence. */
typedef struct fa_bwd_chunk {
    int64_t seq, start, len;
} fa_bwd_chunk;

typedef struct fa_bwd_job {
    const fa_params *p;
    void *dsum;            /* reals [h][total_q] */
    void *dq_ws;           /* fused schedule: reals [stripes][total_q][h][pad(d)] */
    int64_t stripes;       /* fused schedule: key-chunk stripes per (sequence, kv head) */
    int64_t chunk;         /* fused schedule: keys per chunk */
    size_t real_size;      /* bytes of the accumulators' type */
    int64_t last_chunks;   /* fused schedule: key chunks of the last stripe (split in halves) */
    int64_t half_slot;     /* reals of one half's dK/dV slot: chunk x (pad(d) + pad(dv)) */
    void *half_ws;         /* reals [b * hk][last_chunks][2][half_slot] */
    atomic_int *half_done; /* [b * hk][last_chunks] */
    double *dsink_partial; /* [b][h] */
    fa_bwd_chunk *chunks;
    const fa_cpu_bf16_kernel *bf16; /* bf16 inputs on bf16 products; NULL: the fp32 path */
    char *scratch;
    size_t scratch_size; /* bytes per thread */
    size_t mod_offset;   /* where in a thread's region the mods' scratch starts */
    size_t aux_offset;   /* and the captured gradients' (fa_cpu_aux_grad_scratch_size) */
    fa_cpu_aux_grads_plan aux; /* the captured tensors' gradients asked for */
    double *aux_acc;           /* [threads][aux.total]: their per-thread sums */
} fa_bwd_job;

/* A tile's mods' scratch and, where the pass adds them (add), the thread's gradient sums. */
#define FA_BWD_MODS(t, job, base, thread, add)                                                   \
    do {                                                                                         \
        (t).mod_scratch = (base) + (job)->mod_offset;                                            \
        (t).aux_plan = &(job)->aux;                                                              \
        (t).aux_scratch = (base) + (job)->aux_offset;                                            \
        (t).aux_acc = (add) && (job)->aux_acc                                                    \
                          ? (job)->aux_acc + (size_t)(thread) * (size_t)(job)->aux.total         \
                          : NULL;                                                                \
    } while (0)

static size_t fa_bwd_scratch_size(const fa_params *p, size_t real_size)
{
    const size_t bm = FA_CPU_BM, bn = FA_CPU_BN, d = (size_t)p->d, dv = (size_t)p->dv;
    const size_t dp = (size_t)fa_cpu_gemm_pad(p->d), dvp = (size_t)fa_cpu_gemm_pad(p->dv);
    const size_t nk = FA_CPU_BWD_NK;
    size_t n = d * bm + bm * dp + dv * bm + bm * dvp + 5 * bm + nk * dp + nk * dv + 3 * bn * bm +
               nk * dp + nk * dvp + bm * dp;
    return (n * real_size + 63) & ~(size_t)63;
}

#define FA_BWD_CARVE(REAL, t, base, p)                                                           \
    do {                                                                                         \
        REAL *cur_ = (REAL *)(base);                                                             \
        const int64_t bm_ = FA_CPU_BM, bn_ = FA_CPU_BN, nk_ = FA_CPU_BWD_NK;                      \
        const int64_t d_ = (p)->d, dv_ = (p)->dv;                                                \
        const int64_t dp_ = fa_cpu_gemm_pad(d_), dvp_ = fa_cpu_gemm_pad(dv_);                    \
        (t).qt = cur_, cur_ += d_ * bm_;                                                         \
        (t).qr = cur_, cur_ += bm_ * dp_;                                                        \
        (t).dot = cur_, cur_ += dv_ * bm_;                                                       \
        (t).dor = cur_, cur_ += bm_ * dvp_;                                                      \
        (t).lse = cur_, cur_ += bm_;                                                             \
        (t).dsum = cur_, cur_ += bm_;                                                            \
        (t).lo = cur_, cur_ += bm_;                                                              \
        (t).hi = cur_, cur_ += bm_;                                                              \
        (t).diag = cur_, cur_ += bm_;                                                            \
        (t).kbuf = cur_, cur_ += nk_ * dp_;                                                      \
        (t).vbuf = cur_, cur_ += nk_ * dv_;                                                      \
        (t).pt = cur_, cur_ += bn_ * bm_;                                                        \
        (t).dxt = cur_, cur_ += bn_ * bm_;                                                       \
        (t).zt = cur_, cur_ += bn_ * bm_;                                                        \
        (t).acc_k = cur_, cur_ += nk_ * dp_;                                                     \
        (t).acc_v = cur_, cur_ += nk_ * dvp_;                                                    \
        (t).acc_q = cur_;                                                                        \
    } while (0)

static void fa_bwd_dsum_task(void *ctx, int64_t item, int thread)
{
    const fa_bwd_job *job = ctx;
    const fa_params *p = job->p;
    const int64_t bi = item / p->h, h = item % p->h;
    char *base = job->scratch + (size_t)thread * job->scratch_size;
    if (p->dtype == FA_DTYPE_F64) {
        double *rows = (double *)base;
        job->dsink_partial[item] =
            fa_bwd_dsum_f64(p, job->dsum, rows, rows + p->dv, bi, h);
    } else {
        float *rows = (float *)base;
        job->dsink_partial[item] =
            fa_bwd_dsum_f32(p, job->dsum, rows, rows + p->dv, bi, h);
    }
}

static void fa_bwd_keys_task(void *ctx, int64_t item, int thread)
{
    const fa_bwd_job *job = ctx;
    const fa_params *p = job->p;
    const fa_bwd_chunk *c = &job->chunks[item / p->hk];
    const int64_t hk = item % p->hk;
    char *base = job->scratch + (size_t)thread * job->scratch_size;
    if (p->dtype == FA_DTYPE_F64) {
        fa_bwd_tile_f64 t;
        FA_BWD_CARVE(double, t, base, p);
        FA_BWD_MODS(t, job, base, thread, 1);
        fa_bwd_keys_f64(p, &t, job->dsum, NULL, c->seq, hk, c->start, c->len, NULL, 0);
#if defined(FA_CPU_HAS_BF16)
    } else if (job->bf16) {
        fa_bwd_tile_bf16 t;
        fa_bwd_bf16_carve(p, base, &t);
        fa_bwd_keys_bf16(p, job->bf16, &t, job->dsum, NULL, c->seq, hk, c->start, c->len,
                         NULL, 0);
#endif
    } else {
        fa_bwd_tile_f32 t;
        FA_BWD_CARVE(float, t, base, p);
        FA_BWD_MODS(t, job, base, thread, 1);
        fa_bwd_keys_f32(p, &t, job->dsum, NULL, c->seq, hk, c->start, c->len, NULL, 0);
    }
}

/* Row where the last stripe of a sequence's kv head splits in halves: the middle of the rows
 * its chunks see, on a multiple of FA_BWD_HALF_ROWS from the first (whole tiles of either path). */
static int64_t fa_bwd_half_split(const fa_params *p, const fa_bwd_job *job, int64_t seq_index)
{
    const fa_seq seq = fa_params_seq(p, seq_index);
    int64_t lo, hi;
    fa_bwd_stripe_rows(p, &seq, fa_bwd_key_count(p, seq_index), job->stripes - 1, job->stripes,
                       job->chunk, &lo, &hi);
    if (hi <= lo)
        return seq.sq;
    const int64_t tiles = (hi - lo + FA_BWD_HALF_ROWS - 1) / FA_BWD_HALF_ROWS;
    const int64_t split = lo + (tiles + 1) / 2 * FA_BWD_HALF_ROWS;
    return split < seq.sq ? split : seq.sq;
}

/* Half `part` of the last stripe of (sequence, kv head) pair `pair`. */
static fa_bwd_half fa_bwd_half_make(const fa_bwd_job *job, int64_t pair, int part)
{
    const fa_params *p = job->p;
    const int64_t seq_index = pair / p->hk, split = fa_bwd_half_split(p, job, seq_index);
    const size_t offset = (size_t)(pair * job->last_chunks * 2 * job->half_slot) * job->real_size;
    return (fa_bwd_half){.r_lo = part ? split : 0,
                         .r_hi = part ? fa_params_seq(p, seq_index).sq : split,
                         .part = part,
                         .slot = job->half_slot,
                         .kv_ws = (char *)job->half_ws + offset,
                         .done = job->half_done + pair * job->last_chunks};
}

/*
 * Items: every (sequence, kv head)'s stripes, in that order; with job->half_ws, all but the last,
 * then the last stripes in halves, so that the items the threads finish on are half as long
 * (pairs x (stripes + 1) items).
 */
static void fa_bwd_fused_task(void *ctx, int64_t item, int thread)
{
    const fa_bwd_job *job = ctx;
    const fa_params *p = job->p;
    const int64_t stripes = job->stripes, chunk = job->chunk;
    const int64_t halved = job->half_ws != NULL, whole = p->b * p->hk * (stripes - halved);
    int64_t pair, stripe;
    fa_bwd_half half_store, *half = NULL;
    if (item < whole) {
        pair = item / (stripes - halved);
        stripe = item % (stripes - halved);
    } else {
        pair = (item - whole) / 2;
        stripe = stripes - 1;
        half_store = fa_bwd_half_make(job, pair, (int)((item - whole) % 2));
        half = &half_store;
    }
    const int64_t bi = pair / p->hk, hk = pair % p->hk;
    const size_t slot = (size_t)(stripe * p->total_q * p->h * fa_cpu_gemm_pad(p->d));
    char *base = job->scratch + (size_t)thread * job->scratch_size;
    if (p->dtype == FA_DTYPE_F64) {
        fa_bwd_tile_f64 t;
        FA_BWD_CARVE(double, t, base, p);
        FA_BWD_MODS(t, job, base, thread, 1);
        fa_bwd_fused_f64(p, &t, job->dsum, (double *)job->dq_ws + slot, bi, hk, stripe, stripes,
                         chunk, half);
#if defined(FA_CPU_HAS_BF16)
    } else if (job->bf16) {
        fa_bwd_tile_bf16 t;
        fa_bwd_bf16_carve(p, base, &t);
        fa_bwd_fused_bf16(p, job->bf16, &t, job->dsum, (float *)job->dq_ws + slot, bi, hk, stripe,
                          stripes, chunk, half);
#endif
    } else {
        fa_bwd_tile_f32 t;
        FA_BWD_CARVE(float, t, base, p);
        FA_BWD_MODS(t, job, base, thread, 1);
        fa_bwd_fused_f32(p, &t, job->dsum, (float *)job->dq_ws + slot, bi, hk, stripe, stripes,
                         chunk, half);
    }
}

static void fa_bwd_dq_reduce_task(void *ctx, int64_t item, int thread)
{
    const fa_bwd_job *job = ctx;
    const fa_params *p = job->p;
    char *base = job->scratch + (size_t)thread * job->scratch_size;
    const int64_t seq_index = item / p->h, sq = fa_params_seq(p, seq_index).sq;
    if (p->dtype == FA_DTYPE_F64)
        fa_bwd_dq_reduce_f64(p, job->dq_ws, job->stripes, job->chunk, seq_index, item % p->h, 0,
                             sq, (double *)base);
    else
        fa_bwd_dq_reduce_f32(p, job->dq_ws, job->stripes, job->chunk, seq_index, item % p->h, 0,
                             sq, (float *)base);
}

static void fa_bwd_queries_task(void *ctx, int64_t item, int thread)
{
    const fa_bwd_job *job = ctx;
    const fa_params *p = job->p;
    const fa_bwd_chunk *c = &job->chunks[item / p->h];
    const int64_t h = item % p->h;
    char *base = job->scratch + (size_t)thread * job->scratch_size;
    if (p->dtype == FA_DTYPE_F64) {
        fa_bwd_tile_f64 t;
        FA_BWD_CARVE(double, t, base, p);
        FA_BWD_MODS(t, job, base, thread, 0);
        fa_bwd_queries_f64(p, &t, job->dsum, c->seq, h, c->start, c->len);
#if defined(FA_CPU_HAS_BF16)
    } else if (job->bf16) {
        fa_bwd_tile_bf16 t;
        fa_bwd_bf16_carve(p, base, &t);
        fa_bwd_queries_bf16(p, job->bf16, &t, job->dsum, c->seq, h, c->start, c->len);
#endif
    } else {
        fa_bwd_tile_f32 t;
        FA_BWD_CARVE(float, t, base, p);
        FA_BWD_MODS(t, job, base, thread, 0);
        fa_bwd_queries_f32(p, &t, job->dsum, c->seq, h, c->start, c->len);
    }
}

/* Cuts every sequence's rows (or keys, by_keys) into blocks of `block`. */
static int64_t fa_bwd_chunks_make(const fa_params *p, int by_keys, int64_t block,
                                  fa_bwd_chunk *out)
{
    int64_t n = 0;
    for (int64_t i = 0; i < p->b; i++) {
        fa_seq s = fa_params_seq(p, i);
        const int64_t len = by_keys ? fa_bwd_key_count(p, i) : s.sq;
        for (int64_t start = 0; start < len; start += block) {
            if (out)
                out[n] = (fa_bwd_chunk){i, start, len - start < block ? len - start : block};
            n++;
        }
    }
    return n;
}

/* Rows of q / k that belong to no varlen sequence get zero gradients. */
static void fa_bwd_zero_uncovered(const fa_params *p)
{
    if (!p->is_varlen)
        return;
    const size_t es = fa_dtype_size(p->dtype);
    const int32_t *cus[2] = {p->cu_seqlens_q, p->cu_seqlens_k};
    for (int which = 0; which < 2; which++) {
        const int32_t *cu = cus[which];
        char *data = which ? (char *)p->dk_data : (char *)p->dq_data;
        int64_t rs = which ? p->dk_rstride : p->dq_rstride;
        int64_t hs = which ? p->dk_hstride : p->dq_hstride;
        int64_t heads = which ? p->hk : p->h;
        int64_t rows = which ? p->total_k : p->total_q;
        for (int64_t r = 0; r < rows; r++) {
            if (r >= cu[0] && r < cu[p->b])
                continue;
            for (int64_t h = 0; h < heads; h++) {
                char *row = data + (ptrdiff_t)(r * rs + h * hs) * (ptrdiff_t)es;
                for (size_t c = 0; c < (size_t)p->d * es; c++)
                    row[c] = 0;
                if (which) {
                    char *vrow = (char *)p->dv_data +
                                 (ptrdiff_t)(r * p->dv_rstride + h * p->dv_hstride) * (ptrdiff_t)es;
                    for (size_t c = 0; c < (size_t)p->dv * es; c++)
                        vrow[c] = 0;
                }
            }
        }
    }
}

/* mod_aux_grad[slot] <- the threads' sums, added in thread order (0 where nothing was read;
 * job->aux_acc holds them whenever a given gradient has elements). */
static void fa_bwd_aux_grads_write(const fa_params *p, const fa_bwd_job *job, int threads)
{
    for (int s = 0; s < FA_MOD_AUX_SLOTS; s++) {
        const fa_tensor *g = &p->mod_aux_grad[s];
        if (!g->data)
            continue;
        const int64_t off = job->aux.offset[s];
        int64_t n = 1;
        for (int d = 0; d < g->ndim; d++)
            n *= g->shape[d];
        for (int64_t i = 0; i < n; i++) {
            double sum = 0;
            for (int t = 0; t < threads; t++)
                sum += job->aux_acc[(size_t)t * (size_t)job->aux.total + (size_t)(off + i)];
            int64_t at = 0, rest = i;
            for (int d = g->ndim - 1; d >= 0; d--) {
                at += (rest % g->shape[d]) * g->stride[d];
                rest /= g->shape[d];
            }
            ((float *)g->data)[at] = (float)sum;
        }
    }
}

fa_status fa_cpu_backward(const fa_params *p)
{
    const size_t real_size = p->dtype == FA_DTYPE_F64 ? sizeof(double) : sizeof(float);
    fa_cpu_hint_rows(p->dq_data, p, p->max_sq, p->total_q, p->h, p->d, p->dq_bstride,
                     p->dq_rstride, p->dq_hstride);
    fa_cpu_hint_rows(p->dk_data, p, p->max_sk, p->total_k, p->hk, p->d, p->dk_bstride,
                     p->dk_rstride, p->dk_hstride);
    fa_cpu_hint_rows(p->dv_data, p, p->max_sk, p->total_k, p->hk, p->dv, p->dv_bstride,
                     p->dv_rstride, p->dv_hstride);
    fa_bwd_zero_uncovered(p);

    int64_t chunk;
    const int64_t stripes =
        fa_plan_cpu_bwd_stripes(p, (size_t)fa_cpu_l2_share(), real_size, fa_cpu_gemm_pad(p->d),
                                fa_cpu_gemm_pad(p->dv), &chunk);
    int64_t n_q = fa_bwd_chunks_make(p, 0, FA_CPU_BM, NULL);
    int64_t n_k = fa_bwd_chunks_make(p, 1, chunk, NULL);
    int64_t n_max = n_q > n_k ? n_q : n_k;
    int threads = p->num_threads > 0 ? p->num_threads : 1;

    const int fused = stripes > 0;
    fa_bwd_job job = {.p = p,
                      .real_size = real_size,
                      .stripes = stripes,
                      .chunk = chunk,
                      .scratch_size = fa_bwd_scratch_size(p, real_size)};
#if defined(FA_CPU_HAS_BF16)
    /* bf16 calls with user-defined scoring take the fp32 tile, which evaluates it. */
    if (p->dtype == FA_DTYPE_BF16 && !fa_mod_call_active(&p->mods) &&
        (job.bf16 = fa_cpu_bf16_kernel_get()) != NULL)
        job.scratch_size = fa_bwd_bf16_scratch_size(p);
#endif
    job.mod_offset = job.scratch_size;
    job.scratch_size += fa_cpu_mod_grad_scratch_size(p, real_size, FA_CPU_BM, FA_CPU_BN);
    FA_TRY(fa_cpu_aux_grads(p, &job.aux));
    job.aux_offset = job.scratch_size;
    job.scratch_size += fa_cpu_aux_grad_scratch_size(&job.aux);
    if (job.aux.total) {
        job.aux_acc = calloc((size_t)job.aux.total * (size_t)threads, sizeof(double));
        if (!job.aux_acc)
            return fa_error_set(FA_STATUS_OUT_OF_MEMORY,
                                "out of memory for mod_aux_grad's per-thread sums");
    }
    job.dsum = malloc((size_t)(p->total_q * p->h + 1) * real_size);
    job.dsink_partial = malloc((size_t)(p->b * p->h) * sizeof(double));
    job.chunks = malloc((size_t)(n_max + 1) * sizeof *job.chunks);
    job.scratch = aligned_alloc(64, job.scratch_size * (size_t)threads);
    /* The dQ copies, then the split items' dK / dV slots, in the one kept workspace. */
    const int64_t pairs = p->b * p->hk;
    size_t half_bytes = 0;
    if (fused) {
        const size_t dq_bytes =
            ((size_t)(stripes * p->total_q * p->h * fa_cpu_gemm_pad(p->d)) * real_size + 63) &
            ~(size_t)63;
        const int64_t first = (stripes - 1) * chunk, step = stripes * chunk;
        job.last_chunks = (p->max_sk - first + step - 1) / step;
        job.half_slot = chunk * (fa_cpu_gemm_pad(p->d) + fa_cpu_gemm_pad(p->dv));
        const double bytes =
            (double)(pairs * job.last_chunks * 2 * job.half_slot) * (double)real_size;
        /* Halves only where their slots fit in the kept workspace beside the copies: a fresh
         * buffer each call would cost its page faults on every call. */
        if (pairs * stripes < FA_CPU_BWD_HALVES_BELOW &&
            (double)dq_bytes + bytes <= (double)FA_MEMORY_KEEP_MAX)
            half_bytes = (size_t)bytes;
        job.dq_ws = fa_memory_take(dq_bytes + half_bytes + real_size);
        if (job.dq_ws && half_bytes) {
            job.half_ws = (char *)job.dq_ws + dq_bytes;
            job.half_done = calloc((size_t)(pairs * job.last_chunks), sizeof *job.half_done);
        }
    }
    fa_status st = FA_STATUS_OK;
    if (!job.dsum || !job.dsink_partial || !job.chunks || !job.scratch || (fused && !job.dq_ws) ||
        (half_bytes && !job.half_done)) {
        st = fa_error_set(FA_STATUS_OUT_OF_MEMORY, "out of memory for the backward workspace");
        goto done;
    }

    fa_cpu_log log;
    fa_cpu_log_begin(&log);
    st = fa_cpu_log_phase(&log, "dsum", threads, p->b * p->h, fa_bwd_dsum_task, &job);
    if (st != FA_STATUS_OK)
        goto done;
    if (p->dsinks) {
        for (int64_t h = 0; h < p->h; h++) {
            double sum = 0;
            for (int64_t bi = 0; bi < p->b; bi++)
                sum += job.dsink_partial[bi * p->h + h];
            p->dsinks[h * p->dsinks_stride] = (float)sum;
        }
    }

    if (fused) {
        st = fa_cpu_log_phase(&log, "fused", threads,
                              pairs * (stripes + (job.half_ws != NULL)), fa_bwd_fused_task, &job);
        if (st == FA_STATUS_OK && stripes > 1)
            st = fa_cpu_log_phase(&log, "dq sum", threads, p->b * p->h, fa_bwd_dq_reduce_task,
                                  &job);
    } else {
        fa_bwd_chunks_make(p, 1, chunk, job.chunks);
        st = fa_cpu_log_phase(&log, "keys", threads, n_k * p->hk, fa_bwd_keys_task, &job);
        fa_bwd_chunks_make(p, 0, FA_CPU_BM, job.chunks);
        if (st == FA_STATUS_OK)
            st = fa_cpu_log_phase(&log, "queries", threads, n_q * p->h, fa_bwd_queries_task,
                                  &job);
    }
    if (st == FA_STATUS_OK)
        fa_bwd_aux_grads_write(p, &job, threads);
    if (st == FA_STATUS_OK && log.on) {
        char plan[96];
        if (fused)
            snprintf(plan, sizeof plan, "fused, %lld stripes of %lld-key chunks%s",
                     (long long)stripes, (long long)chunk,
                     job.half_ws ? ", the last in halves" : "");
        else
            snprintf(plan, sizeof plan, "two passes, %lld-key chunks", (long long)chunk);
        fa_cpu_log_end(&log, p, "backward", plan);
    }

done:
    free(job.aux_acc);
    free(job.dsum);
    fa_memory_give(job.dq_ws);
    free(job.half_done);
    free(job.dsink_partial);
    free(job.chunks);
    free(job.scratch);
    return st;
}
