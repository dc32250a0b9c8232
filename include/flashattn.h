/*
 * flashattn: exact attention, tiled with an online softmax, as a C library.
 *
 * The whole public API is in this header (C11, usable from C++). Semantics are those of
 * upstream FlashAttention (flash_attn 2.x); where the library goes further (any head_dim on the
 * CPU, fp32/fp64, attention sinks) the README says so.
 *
 * Tensors are described by fa_tensor: a data pointer, a dtype, and shape and strides counted in
 * elements. Every tensor argument needs a contiguous last dimension (stride 1); other strides are
 * free, so slices of packed qkv buffers are used without copies.
 *
 * Errors: every call returns an fa_status. On failure, fa_last_error() returns a message naming
 * the argument and the rule it broke. The message is per thread.
 */
#ifndef FLASHATTN_H
#define FLASHATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FA_VERSION_MAJOR 0
#define FA_VERSION_MINOR 1
#define FA_VERSION_PATCH 0

#define FA_MAX_DIMS 6
#define FA_MAX_HEAD_DIM 256
#define FA_DEVICE_CPU (-1)

typedef enum fa_dtype {
    FA_DTYPE_F32 = 0,
    FA_DTYPE_F16 = 1,
    FA_DTYPE_BF16 = 2,
    FA_DTYPE_F64 = 3,
    FA_DTYPE_I32 = 4,
} fa_dtype;

typedef enum fa_status {
    FA_STATUS_OK = 0,
    FA_STATUS_INVALID_ARGUMENT = 1, /* the caller broke a documented rule */
    FA_STATUS_UNSUPPORTED = 2,      /* valid, but not available here (e.g. no such device) */
    FA_STATUS_OUT_OF_MEMORY = 3,
    FA_STATUS_INTERNAL = 4,
} fa_status;

/* A strided view of caller-owned memory. shape/stride beyond ndim are ignored. */
typedef struct fa_tensor {
    void *data;
    fa_dtype dtype;
    int32_t ndim;
    int64_t shape[FA_MAX_DIMS];
    int64_t stride[FA_MAX_DIMS]; /* in elements, not bytes */
} fa_tensor;

/* Builds a tensor view; stride NULL means row-major contiguous. */
fa_tensor fa_tensor_make(void *data, fa_dtype dtype, int ndim, const int64_t *shape,
                         const int64_t *stride);

/*
 * Forward attention.
 *
 * Dense form (cu_seqlens_q and cu_seqlens_k NULL):
 *   q   [b, sq, h, d]      k [b, sk, hk, d]      v [b, sk, hk, dv]
 *   out [b, sq, h, dv]     lse fp32 [b, h, sq]
 * Varlen form (cu_seqlens_q and cu_seqlens_k given, int32 [b+1], non-decreasing):
 *   q   [total_q, h, d]    k [total_k, hk, d]    v [total_k, hk, dv]
 *   out [total_q, h, dv]   lse fp32 [h, total_q]
 *   sequence i holds q rows cu_seqlens_q[i] .. cu_seqlens_q[i+1]-1 and the same for k; its key
 *   count is seqused_k[i] when seqused_k (int32 [b]) is given. No sequence may be longer than
 *   max_seqlen_q / max_seqlen_k. Rows of out/lse outside every sequence get 0 / +inf.
 *
 * dtypes: q, k, v, out (and probs) share one of F32, F16, BF16, F64; compute is in fp32 (fp64
 * for F64). head_dim d and dv: 1 .. FA_MAX_HEAD_DIM on the CPU. h % hk == 0; query head i reads
 * kv head i / (h / hk).
 *
 * For query row i and key j of a sequence with sq queries and sk keys:
 *   s_ij = scale * q_i . k_j                       scale = softmax_scale, default d^-0.5
 *   s_ij = softcap * tanh(s_ij / softcap)          when softcap > 0
 *   s_ij = s_ij - slope_h * |i + sk - sq - j|      when alibi_slopes is given
 *   key j is visible iff  i + sk - sq - left <= j <= i + sk - sq + right
 *     (window (left, right); -1 is unbounded on that side; causal sets right = 0; causal is
 *      aligned to the bottom-right corner of the score matrix)
 *   lse_i = log(sum over visible j of exp(s_ij) + exp(sink_h))  (sink term only with sinks)
 *   out_i = sum over visible j of exp(s_ij - lse_i) * keep_ij / (1 - dropout_p) * v_j
 * A row with no visible key and no sink gets out 0 and lse +inf.
 *
 * Dropout: keep_ij is a pure function of (seed, offset, batch, head, i, j); see
 * fa_dropout_keep(). Dropout cannot be combined with softcap (as upstream).
 *
 * probs (debugging, optional), dtype of q, [b, h, >= max_sq, >= max_sk]: upstream's S_dmask.
 * Keys are taken in blocks of fa_probs_block_n() columns from the last block to the first; the
 * entry for a visible key is exp(s_ij - m_i), m_i being the running maximum of s over the blocks
 * seen so far in that order; its sign is flipped when dropout drops it. Invisible keys and
 * padding get 0.
 */
typedef struct fa_fwd_args {
    const fa_tensor *q;            /* [b, sq, h, d] or [total_q, h, d] */
    const fa_tensor *k;            /* [b, sk, hk, d] or [total_k, hk, d] */
    const fa_tensor *v;            /* [b, sk, hk, dv] or [total_k, hk, dv] */
    const fa_tensor *out;          /* [b, sq, h, dv] or [total_q, h, dv], written */
    const fa_tensor *lse;          /* optional, fp32 (or fp64 if q is) [b, h, sq] / [h, total_q] */
    const fa_tensor *cu_seqlens_q; /* optional, int32 [b+1]: selects the varlen form */
    const fa_tensor *cu_seqlens_k; /* int32 [b+1], with cu_seqlens_q */
    const fa_tensor *seqused_k;    /* optional, int32 [b], varlen only */
    int64_t max_seqlen_q;          /* varlen only */
    int64_t max_seqlen_k;          /* varlen only */
    const fa_tensor *alibi_slopes; /* optional, fp32 [h] or [b, h] */
    const fa_tensor *sinks;        /* optional, fp32 [h]: learnable per-head sink logit */
    const fa_tensor *probs;        /* optional, [b, h, >= sq, >= sk], written */
    double softmax_scale;          /* NaN (the default) means d^-0.5 */
    int causal;
    int window_left;  /* -1: unbounded */
    int window_right; /* -1: unbounded */
    double softcap;   /* <= 0: off */
    double dropout_p; /* probability of dropping, in [0, 1) */
    uint64_t seed;    /* dropout RNG key */
    uint64_t offset;  /* dropout RNG counter base; advance by b * h between calls */
    int device;       /* FA_DEVICE_CPU or a CUDA ordinal */
    void *stream;     /* CUDA stream for device >= 0; ignored on the CPU */
    int num_threads;  /* CPU threads; 0: $FLASHATTN_NUM_THREADS or every available core */
} fa_fwd_args;

/* Sets every field to its default: no optional tensors, scale NaN, window (-1, -1), CPU. */
void fa_fwd_args_init(fa_fwd_args *args);

/* Validates every argument, then computes out (and lse, probs when given). */
fa_status fa_attention_forward(const fa_fwd_args *args);

/*
 * Backward attention: given the forward's arguments (with its out and lse filled by the forward)
 * and dout, computes dq, dk, dv (and dsinks when the forward used sinks). Tiles of the score
 * matrix are recomputed from q, k and lse; nothing of size sq x sk is stored. Dropout replays the
 * forward's mask from its seed and offset.
 *   dout, dq: as q/out, [b, sq, h, dv] / [b, sq, h, d] (varlen: [total_q, h, ...])
 *   dk, dv:   as k, v:  [b, sk, hk, d] / [b, sk, hk, dv]; with GQA summed over the query heads
 *             that share a kv head
 *   dsinks:   fp32 [h], written (not accumulated)
 * fwd->lse is required and fwd->probs is ignored. On the CPU the result is bitwise reproducible
 * across runs and thread counts whatever `deterministic` says; the flag exists for the GPU.
 */
typedef struct fa_bwd_args {
    const fa_fwd_args *fwd;  /* q, k, v, out, lse and every option of the forward call */
    const fa_tensor *dout;   /* [b, sq, h, dv] or [total_q, h, dv] */
    const fa_tensor *dq;     /* [b, sq, h, d] or [total_q, h, d], written */
    const fa_tensor *dk;     /* [b, sk, hk, d] or [total_k, hk, d], written */
    const fa_tensor *dv;     /* [b, sk, hk, dv] or [total_k, hk, dv], written */
    const fa_tensor *dsinks; /* fp32 [h], written; required when fwd->sinks is given */
    int deterministic;
} fa_bwd_args;

void fa_bwd_args_init(fa_bwd_args *args);
fa_status fa_attention_backward(const fa_bwd_args *args);

/*
 * The dropout keep bit of element (batch, head, row, col), as every backend computes it.
 * head counts query heads; batch is the sequence index in the varlen form; row and col are
 * positions inside the sequence. Philox4x32-10 with key (lo32(seed), hi32(seed)) and counter
 * (col >> 3, row, lo32(c), hi32(c)) with c = offset + batch * num_heads + head gives four
 * 32-bit words w0..w3; the element's 16-bit number is r = (w[(col & 7) >> 1] >> (16 * (col & 1)))
 * & 0xffff, and the element is kept iff r < floor((1 - dropout_p) * 65536).
 */
int fa_dropout_keep(uint64_t seed, uint64_t offset, int64_t num_heads, int64_t batch,
                    int64_t head, int64_t row, int64_t col, double dropout_p);

/* Column block width of the probs encoding (upstream's kBlockN for sm80). */
int fa_probs_block_n(int head_dim, int dropout, int causal);

/* Message of the last failed call on this thread ("" if none). */
const char *fa_last_error(void);
const char *fa_status_string(fa_status status);
const char *fa_dtype_name(fa_dtype dtype);
size_t fa_dtype_size(fa_dtype dtype);
const char *fa_version(void);

/* Threads the CPU backend uses when num_threads is 0. */
int fa_cpu_default_threads(void);

/* The CPU as the library sees it: model name and the SIMD features it detected. */
const char *fa_cpu_description(void);

#ifdef __cplusplus
}
#endif

#endif /* FLASHATTN_H */
