/*
 * What every part of the library shares: the export macro, error reporting, and the validated
 * parameter record that the API layer builds once and every backend reads.
 */
#ifndef FA_INTERNAL_H
#define FA_INTERNAL_H

#include <stdint.h>

#include "flashattn.h"

#define FA_API __attribute__((visibility("default")))

#if defined(__GNUC__)
#define FA_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define FA_PRINTF(a, b)
#endif

/* Records the message for fa_last_error() on this thread and returns status. */
fa_status fa_error_set(fa_status status, const char *fmt, ...) FA_PRINTF(2, 3);
void fa_error_clear(void);

#define FA_BAD(...) fa_error_set(FA_STATUS_INVALID_ARGUMENT, __VA_ARGS__)

#define FA_TRY(expr)                                                                             \
    do {                                                                                         \
        fa_status fa_try_status_ = (expr);                                                       \
        if (fa_try_status_ != FA_STATUS_OK)                                                      \
            return fa_try_status_;                                                               \
    } while (0)

/* Tensor argument checks (fa_check.c); each names the argument in its error. */
int64_t fa_tensor_numel(const fa_tensor *t);
int fa_dtype_is_float(fa_dtype dt);
fa_status fa_check_tensor(const fa_tensor *t, const char *name, int ndim); /* last dim stride 1 */
fa_status fa_check_strided(const fa_tensor *t, const char *name, int ndim);
fa_status fa_check_dtype(const fa_tensor *t, const char *name, fa_dtype want, const char *why);
fa_status fa_check_dim(const fa_tensor *t, const char *name, int dim, int64_t want,
                       const char *what);
/* alibi_slopes, fp32 [h] or [b, h]; sinks, fp32 [h]: data and strides of valid tensors. */
fa_status fa_check_alibi(const fa_tensor *t, int64_t b, int64_t h, const float **data,
                         int64_t *bstride, int64_t *hstride);
fa_status fa_check_sinks(const fa_tensor *t, int64_t h, const float **data, int64_t *stride);
/* Entry points with a CPU implementation only: FA_STATUS_UNSUPPORTED, naming the entry point,
 * for a CUDA ordinal (whether or not the build has the CUDA backend). */
fa_status fa_check_cpu_only(int device, const char *entry);

/* ---- Overflow-proof validation (fa_check.c) ---- */
/* Refuses (naming out_name) an output whose bytes overlap those of the input in_name; either
 * may be NULL or empty. Both must have passed fa_check_tensor/fa_check_strided. */
fa_status fa_check_disjoint(const fa_tensor *out, const char *out_name, const fa_tensor *in,
                            const char *in_name);
/* Refuses (naming it) a tensor the call writes whose elements are not all at distinct
 * addresses (a zero stride, or strides that interleave). NULL or empty: OK. */
fa_status fa_check_writable(const fa_tensor *t, const char *name);
/* softmax_scale (NaN: head_dim^-0.5) and softcap (<= 0: off, stored as 0) within the limits of
 * flashattn.h. */
fa_status fa_check_scalars(double softmax_scale, double softcap, int64_t head_dim,
                           double *scale, double *cap);
/* num_threads as given by the caller (0: the default), clamped once to [1, FA_MAX_THREADS]. */
fa_status fa_threads_resolve(int requested, int *threads);
/* A count that sizes work (max_seqlen_q/k) but backs no tensor: [0, FA_MAX_EXTENT]. */
fa_status fa_check_count(int64_t value, const char *name);
/* ---- end of overflow-proof validation ---- */

/*
 * The forward problem after validation. Strides are in elements. In the dense form every
 * sequence has max_sq queries and max_sk keys; in the varlen form the batch stride is unused
 * and rows are token indices offset by cu_seqlens.
 */
typedef struct fa_params {
    fa_dtype dtype;
    int is_varlen;
    int64_t b, h, hk, d, dv;
    int64_t max_sq, max_sk;
    int64_t total_q; /* rows of q: b * max_sq (dense) or q->shape[0] (varlen) */
    int64_t total_k; /* rows of k: b * max_sk (dense) or k->shape[0] (varlen) */

    /* q: [b, sq, h, d] or [total_q, h, d] */
    const void *q;
    int64_t q_bstride, q_rstride, q_hstride;
    /* k: [b, sk, hk, d] or [total_k, hk, d] */
    const void *k;
    int64_t k_bstride, k_rstride, k_hstride;
    /* v: [b, sk, hk, dv] or [total_k, hk, dv] */
    const void *v;
    int64_t v_bstride, v_rstride, v_hstride;
    /* out: [b, sq, h, dv] or [total_q, h, dv] */
    void *out;
    int64_t o_bstride, o_rstride, o_hstride;
    /* lse (optional): fp32 (or fp64 with fp64 inputs) [b, h, sq] or [h, total_q] */
    void *lse;
    fa_dtype lse_dtype;
    int64_t lse_bstride, lse_hstride, lse_rstride;

    const int32_t *cu_seqlens_q; /* [b+1] */
    const int32_t *cu_seqlens_k; /* [b+1] */
    const int32_t *seqused_k;    /* [b] */

    const float *alibi_slopes; /* [h] or [b, h] */
    int64_t alibi_bstride;     /* 0 for [h] */
    int64_t alibi_hstride;
    const float *sinks; /* [h] */
    int64_t sinks_stride;

    /* probs (optional): [b, h, probs_sq, probs_sk] */
    void *probs;
    int64_t p_bstride, p_hstride, p_rstride;
    int64_t probs_sq, probs_sk;
    int probs_block_n;

    double scale;
    double softcap; /* 0: off */
    int causal;
    int window_left;  /* -1 unbounded, after folding causal in */
    int window_right; /* -1 unbounded */

    double dropout_p;
    uint32_t keep_threshold; /* keep iff the 16-bit number < keep_threshold */
    double dropout_scale;    /* 1 / (1 - p) */
    uint64_t seed, offset;

    int num_threads;

    /* Backward only. dout: as out; dq: as q; dk: as k; dv: as v (strides in elements). */
    const void *dout_data;
    int64_t do_bstride, do_rstride, do_hstride;
    void *dq_data;
    int64_t dq_bstride, dq_rstride, dq_hstride;
    void *dk_data;
    int64_t dk_bstride, dk_rstride, dk_hstride;
    void *dv_data;
    int64_t dv_bstride, dv_rstride, dv_hstride;
    float *dsinks; /* [h] */
    int64_t dsinks_stride;
} fa_params;

static inline void fa_params_lse_store(const fa_params *p, int64_t at, double value)
{
    if (p->lse_dtype == FA_DTYPE_F64)
        ((double *)p->lse)[at] = value;
    else
        ((float *)p->lse)[at] = (float)value;
}

static inline double fa_params_lse_load(const fa_params *p, int64_t at)
{
    return p->lse_dtype == FA_DTYPE_F64 ? ((const double *)p->lse)[at]
                                        : (double)((const float *)p->lse)[at];
}

/* Validates args (naming the argument in the error) and fills p. */
fa_status fa_params_from_fwd_args(const fa_fwd_args *args, fa_params *p);

/* Validates the forward's arguments (lse required) and the gradient tensors. */
fa_status fa_params_from_bwd_args(const fa_bwd_args *args, fa_params *p);

/* The rows and keys of sequence i. */
typedef struct fa_seq {
    int64_t q_start, k_start; /* first row of q / k */
    int64_t sq, sk;           /* queries, and keys in use */
} fa_seq;

static inline fa_seq fa_params_seq(const fa_params *p, int64_t i)
{
    fa_seq s;
    if (p->is_varlen) {
        s.q_start = p->cu_seqlens_q[i];
        s.k_start = p->cu_seqlens_k[i];
        s.sq = p->cu_seqlens_q[i + 1] - p->cu_seqlens_q[i];
        s.sk = p->seqused_k ? p->seqused_k[i] : p->cu_seqlens_k[i + 1] - p->cu_seqlens_k[i];
    } else {
        s.q_start = 0;
        s.k_start = 0;
        s.sq = p->max_sq;
        s.sk = p->max_sk;
    }
    return s;
}

/* The visible keys [*lo, *hi) of query row i in a sequence of sq queries and sk keys. */
static inline void fa_params_key_range(const fa_params *p, int64_t i, int64_t sq, int64_t sk,
                                       int64_t *lo, int64_t *hi)
{
    int64_t diag = i + sk - sq;
    int64_t l = p->window_left >= 0 ? diag - p->window_left : 0;
    int64_t r = p->window_right >= 0 ? diag + p->window_right + 1 : sk;
    if (l < 0)
        l = 0;
    if (r > sk)
        r = sk;
    if (r < l)
        r = l;
    *lo = l;
    *hi = r;
}

/* The keys [*lo, *hi) that any of the rows [r0, r0+m) sees: both window edges grow with the row,
   so they lie between the first row's first key and the last row's last one. */
static inline void fa_params_tile_keys(const fa_params *p, int64_t r0, int64_t m, int64_t sq,
                                       int64_t sk, int64_t *lo, int64_t *hi)
{
    int64_t unused_hi, unused_lo;
    fa_params_key_range(p, r0, sq, sk, lo, &unused_hi);
    fa_params_key_range(p, r0 + m - 1, sq, sk, &unused_lo, hi);
}

/* CPU backend entry points. */
fa_status fa_cpu_forward(const fa_params *p);
/* For the tests: the most bytes of packed K/V one pass of the bf16 forward holds, so that small
 * problems take several passes (0: the default). Not thread-safe against running forwards. */
void fa_cpu_forward_set_pack_limit(size_t bytes);
/* For the tests: the L2 bytes per thread that the CPU tiles are sized for (0: the machine's). Not
 * thread-safe against running calls. */
void fa_cpu_set_l2_share(size_t bytes);
/* Query rows per forward work item (fa_cpu_forward.c), exposed for the tests of its rule. */
int64_t fa_cpu_forward_tile_rows(const fa_params *p);
fa_status fa_cpu_probs(const fa_params *p);
fa_status fa_cpu_backward(const fa_params *p);

#endif /* FA_INTERNAL_H */
