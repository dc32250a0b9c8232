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
/* Head dims (d and dv): up to FA_MAX_HEAD_DIM on the CPU (MLA's d 576 / dv 512 among them), up
 * to FA_CUDA_MAX_HEAD_DIM on CUDA devices, and up to FA_CUDA_DECODE_MAX_HEAD_DIM there on the
 * decode schedule: fa_attention_kvcache, and forwards without dropout, probs or user-defined
 * scoring (past FA_CUDA_MAX_HEAD_DIM at any row count; MLA's decode). */
#define FA_MAX_HEAD_DIM 576
#define FA_CUDA_MAX_HEAD_DIM 256
#define FA_CUDA_DECODE_MAX_HEAD_DIM 576
#define FA_DEVICE_CPU (-1)

/*
 * Limits every entry point checks, far above any real model; past them a call is refused with an
 * error naming the argument (never an overflow, a wrap or a wrong answer):
 * - FA_MAX_EXTENT elements (2^40) for each dimension of a tensor, its element count, the span its
 *   strides reach over its dimensions longer than 1 (even in an empty tensor), and max_seqlen_q /
 *   max_seqlen_k: every offset then fits int64 with room, and a tensor's bytes must not wrap the
 *   address space. An empty tensor's data pointer is never read and may be NULL.
 * - |softmax_scale| <= FA_MAX_SOFTMAX_SCALE, and softcap, when > 0, in [FA_MIN_SOFTCAP,
 *   FA_MAX_SOFTCAP]: models use scales near d^-0.5 and caps of 30 to 50; inside these bounds the
 *   scaled logits, scale / softcap and scale * log2(e) stay normal fp32 numbers.
 * - num_threads above FA_MAX_THREADS runs FA_MAX_THREADS threads.
 * - out (written) may not share a byte with the inputs (forward: q, k, v; KV cache: q, k_cache,
 *   v_cache, k, v; combine: out_partial, lse_partial): such an alias is refused, naming out.
 *   The backward's gradients (dq, dk, dv, dsinks, mod_aux_grad) may share no element with its
 *   inputs (q, k, v, out, dout, lse, alibi_slopes, sinks, mod_aux) or with one another; views
 *   of one dtype and strides into one buffer are compared element by element, so dq, dk and
 *   dv may interleave in a packed gradient (upstream's dqkv[:, :, i]), other tensors by the
 *   bytes they span.
 * - A tensor the call writes (out, lse, probs, the gradients, the caches an append writes) needs
 *   its elements at distinct addresses: no zero stride, no strides that interleave.
 */
#define FA_MAX_EXTENT ((int64_t)1 << 40)
#define FA_MAX_SOFTMAX_SCALE 1e4
#define FA_MIN_SOFTCAP 1e-4
#define FA_MAX_SOFTCAP 1e4
#define FA_MAX_THREADS 1024

typedef enum fa_dtype {
    FA_DTYPE_F32 = 0,
    FA_DTYPE_F16 = 1,
    FA_DTYPE_BF16 = 2,
    FA_DTYPE_F64 = 3,
    FA_DTYPE_I32 = 4,
    /* fp8 (forward inputs, see fa_fwd_args; KV caches, see fa_kvcache_args):
     * torch.float8_e4m3fn (bias 7, no infinities,
     * NaN S.1111.111, largest 448) and torch.float8_e5m2 (bias 15, IEEE-like with infinities). */
    FA_DTYPE_F8E4M3 = 5,
    FA_DTYPE_F8E5M2 = 6,
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

/* Builds a tensor view; stride NULL means row-major contiguous; shape NULL gives no dimension. */
fa_tensor fa_tensor_make(void *data, fa_dtype dtype, int ndim, const int64_t *shape,
                         const int64_t *stride);

/*
 * User-defined scoring (FlexAttention's score_mod and mask_mod) as a small expression program.
 * Build one with fa_mod_create, add nodes (each call returns the node's id, >= 0, or -1 with
 * fa_last_error() set), then fa_mod_finish it as a score_mod (root: a number, the new score) or
 * a mask_mod (root: a boolean, true keeps the key). Nodes are numbers or booleans; every value
 * is computed in the forward's compute precision (fp32, fp64 for fp64 inputs), so integers are
 * exact up to 2^24 in fp32. Identical nodes are shared (the same id comes back).
 *
 * Variables: score (the scaled score, after softcap and ALiBi when those are given; score_mod
 * only), b (the batch index; the sequence index in the varlen form), h (the query head), q_idx
 * and kv_idx (positions within the sequence, from 0; causal's bottom-right alignment does not
 * change them). Operations (numbers unless said): neg exp log tanh abs sqrt floor; not (bool);
 * add sub mul div min max pow; mod (floor remainder, the sign of the divisor, as Python's %);
 * lt le gt ge eq ne (numbers -> bool; false when either is NaN); and or (bool); where(cond, a,
 * b) (a, b of one type). div is true division (floor(div) divides integers). aux(slot, ndim,
 * index) reads the caller's tensor mod_aux[slot] (int32 or fp32, ndim 1..4 dims) at ndim number
 * nodes, each floored and clamped into its dimension (never out of bounds). A finished program
 * is read-only: calls on any number of threads may share it.
 *
 * fa_mod_text gives the finished program's canonical text, deterministic for a given expression
 * whatever order it was built in, e.g. "mask: kv_idx; q_idx; le $0 $1" (statements in order,
 * $i the result of statement i, the last one the root; constants as integers or as the 16 hex
 * digits of their IEEE bits). fa_mod_parse reads it back into a finished program.
 *
 * In fa_attention_forward (CPU and CUDA: fp16 and bf16 through the sm80 family's kernels, on
 * sm_90 too, compiled at first use with the programs' text in the kernel cache's key) and
 * fa_attention_backward (CPU, and CUDA through the sm80 family's backward on every arch, the
 * programs compiled in likewise; with a block mask, the states of a CTA's key blocks over every
 * query block take shared memory beside its tiles, ((bn - 1) / kv_block + 2) * ceil(sq /
 * q_block) bytes per query head, or for all heads when the mask's index tensors share them,
 * with bn the plan's keys per CTA (32 to 128); a mask that does not fit is refused):
 * score_mod runs after the softmax scale, softcap and ALiBi, on every visible key; a key
 * where mask_mod is false is dropped, as if outside the window (so mask_mod is ANDed with causal
 * and the window). A row whose keys are all masked gets out 0 and lse +inf. Dropout applies to
 * the result as usual; probs cannot be combined with a mod. The backward differentiates
 * score_mod with respect to the score through its program (at a kink, such as abs at 0, the
 * branch the value takes); the aux tensors get no gradient.
 *
 * Block sparsity (fa_block_mask, FlexAttention's BlockMask layout): the (query block, key block)
 * pairs of a dense call that hold any visible key. Query block qb is rows [qb * q_block, (qb +
 * 1) * q_block), key block kb keys [kb * kv_block, (kb + 1) * kv_block). For sequence b, head h
 * and query block qb, kv_indices[b, h, qb, 0 .. kv_num_blocks[b, h, qb]) are its partial blocks
 * (mask_mod decides key by key; every key is kept without a mask_mod) and full_kv_indices[b, h,
 * qb, 0 .. full_kv_num_blocks[b, h, qb]) its full blocks (every key kept, mask_mod not
 * evaluated; a block in both lists is full). Every other block is skipped: its keys are
 * masked, whatever mask_mod says. Causal, the window and the mods' scores apply as without it.
 * int32 tensors, any strides; their b and h dims may be 1 (shared); at least ceil(sq / q_block)
 * query blocks (more are ignored); indices at or past ceil(sk / kv_block) name no keys and are
 * ignored. Dense form only; the CPU's backward takes it. On a CUDA device the index tensors
 * live in device memory and are not read on the host: counts are clamped into [0, n] and
 * indices outside [0, ceil(sk / kv_block)) ignored (the CPU refuses both), and a mask whose
 * key blocks of a tile's query blocks, ((bm - 1) / q_block + 2) * ceil(sk / kv_block) bytes
 * and 4 bytes more per key block, do not fit beside the kernel's shared memory is refused (use
 * larger blocks).
 */
typedef struct fa_block_mask {
    int64_t q_block, kv_block;           /* rows and keys per block, >= 1 */
    const fa_tensor *kv_num_blocks;      /* int32 [b or 1, h or 1, nq] */
    const fa_tensor *kv_indices;         /* int32 [b or 1, h or 1, nq, n] (kv_num_blocks' b, h) */
    const fa_tensor *full_kv_num_blocks; /* optional, int32 [b or 1, h or 1, nq] */
    const fa_tensor *full_kv_indices;    /* int32 [., ., nq, n], with full_kv_num_blocks */
} fa_block_mask;
typedef struct fa_mod fa_mod;

typedef enum fa_mod_variable {
    FA_MOD_SCORE = 0,
    FA_MOD_B = 1,
    FA_MOD_H = 2,
    FA_MOD_Q_IDX = 3,
    FA_MOD_KV_IDX = 4,
} fa_mod_variable;

typedef enum fa_mod_op {
    /* unary (fa_mod_unary) */
    FA_MOD_NEG = 0, FA_MOD_EXP, FA_MOD_LOG, FA_MOD_TANH, FA_MOD_ABS, FA_MOD_SQRT, FA_MOD_FLOOR,
    FA_MOD_NOT,
    /* binary (fa_mod_binary) */
    FA_MOD_ADD, FA_MOD_SUB, FA_MOD_MUL, FA_MOD_DIV, FA_MOD_MIN, FA_MOD_MAX, FA_MOD_POW,
    FA_MOD_MOD, FA_MOD_LT, FA_MOD_LE, FA_MOD_GT, FA_MOD_GE, FA_MOD_EQ, FA_MOD_NE, FA_MOD_AND,
    FA_MOD_OR,
} fa_mod_op;

typedef enum fa_mod_kind {
    FA_MOD_KIND_SCORE = 1, /* root is a number: the new score */
    FA_MOD_KIND_MASK = 2,  /* root is a boolean: false masks the key */
} fa_mod_kind;

#define FA_MOD_MAX_NODES 256
#define FA_MOD_AUX_SLOTS 4

/* A new, empty program (NULL when out of memory); fa_mod_destroy frees it (NULL is ignored). */
fa_mod *fa_mod_create(void);
void fa_mod_destroy(fa_mod *m);
int fa_mod_var(fa_mod *m, fa_mod_variable var);
int fa_mod_const(fa_mod *m, double value);
int fa_mod_unary(fa_mod *m, fa_mod_op op, int a);
int fa_mod_binary(fa_mod *m, fa_mod_op op, int a, int b);
int fa_mod_where(fa_mod *m, int cond, int a, int b);
int fa_mod_aux(fa_mod *m, int slot, int ndim, const int *index); /* index: ndim node ids */
/* Checks the program from root (its type, that a mask does not read score) and freezes it. */
fa_status fa_mod_finish(fa_mod *m, int root, fa_mod_kind kind);
/* The canonical text of a finished program, owned by m; NULL (fa_last_error set) before
 * fa_mod_finish. */
const char *fa_mod_text(const fa_mod *m);
/* A finished program from its text; *out is NULL on failure. */
fa_status fa_mod_parse(const char *text, fa_mod **out);

/*
 * A block mask from a mask program (FlexAttention's create_block_mask): mask_mod evaluated at
 * every (query, key) pair of b sequences, h heads, sq queries and sk keys (in fp32, its aux
 * reads clamped into mod_aux as a call reads them), counted per (query block, key block). A
 * block whose every pair is kept is full, one with some kept partial, the rest skipped; pairs
 * past sq or sk count as not kept, so an edge block is never full. For each b, h and query
 * block qb: kv_num_blocks[b, h, qb] partial blocks, listed first in kv_indices[b, h, qb, .] in
 * ascending order, then the other blocks in ascending order; full_kv_num_blocks /
 * full_kv_indices the same for the full ones. Without full_* (both NULL) every block with a
 * kept pair is listed as partial. The outputs are int32 (written; any strides): [b, h, nq] and
 * [b, h, nq, nk], nq = ceil(sq / q_block), nk = ceil(sk / kv_block), what fa_block_mask takes.
 * The CPU builds it on its threads, as many as the forward's default (host memory). A CUDA
 * device builds it on the stream (device memory; the program compiled into the builder's
 * kernel, evaluated as the GPU forward evaluates it; no host synchronisation or allocation),
 * sq and sk below 2^31 - 1, b and h at most 65535, and a row's key blocks at most the device's
 * shared memory per block (bytes).
 */
typedef struct fa_block_mask_args {
    const fa_mod *mask_mod;                     /* a finished FA_MOD_KIND_MASK program */
    const fa_tensor *mod_aux[FA_MOD_AUX_SLOTS]; /* what it reads: int32 or fp32 */
    int64_t b, h, sq, sk;                       /* >= 1 each */
    int64_t q_block, kv_block;                  /* rows and keys per block, >= 1 */
    const fa_tensor *kv_num_blocks;             /* int32 [b, h, nq], written */
    const fa_tensor *kv_indices;                /* int32 [b, h, nq, nk], written */
    const fa_tensor *full_kv_num_blocks;        /* optional, int32 [b, h, nq], written */
    const fa_tensor *full_kv_indices;           /* int32 [b, h, nq, nk], with the above */
    int device;                                 /* FA_DEVICE_CPU or a CUDA ordinal */
    void *stream;                               /* CUDA stream; ignored on the CPU */
} fa_block_mask_args;

void fa_block_mask_args_init(fa_block_mask_args *args);
fa_status fa_block_mask_build(const fa_block_mask_args *args);

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
 * dtypes: q, k, v, out (and probs) share one of F32, F16, BF16, F64 (fp8: see FP8 below);
 * compute is in fp32 (fp64 for F64). head_dim d and dv: 1 .. FA_MAX_HEAD_DIM on the CPU,
 * 1 .. FA_CUDA_MAX_HEAD_DIM on a CUDA device (the forward to FA_CUDA_DECODE_MAX_HEAD_DIM without
 * dropout, probs or user-defined scoring).
 * h % hk == 0; query head i reads kv head i / (h / hk).
 *
 * For query row i and key j of a sequence with sq queries and sk keys:
 *   s_ij = scale * q_i . k_j                       scale = softmax_scale, default d^-0.5
 *   s_ij = softcap * tanh(s_ij / softcap)          when softcap > 0
 *   s_ij = s_ij - slope_h * |i + sk - sq - j|      when alibi_slopes is given
 *   s_ij = score_mod(s_ij, b, h, i, j)             when score_mod is given (fa_mod above)
 *   key j is visible iff  i + sk - sq - left <= j <= i + sk - sq + right
 *     (window (left, right); -1 is unbounded on that side; causal sets right = 0; causal is
 *      aligned to the bottom-right corner of the score matrix) and mask_mod(b, h, i, j) is true
 *     (when given)
 *   lse_i = log(sum over visible j of exp(s_ij) + exp(sink_h))  (sink term only with sinks)
 *   out_i = sum over visible j of exp(s_ij - lse_i) * keep_ij / (1 - dropout_p) * v_j
 * A row with no visible key and no sink gets out 0 and lse +inf (so does a row whose scores are
 * all -inf, as upstream). NaN and Inf follow the arithmetic: a row whose visible scores include
 * a NaN (from q, k, softcap or ALiBi) or whose largest score is +inf (exp(inf - inf)) gets out
 * NaN in every element and lse NaN (upstream's kernels give such a row lse +inf, the empty-row
 * value); a NaN in v makes NaN the out columns of the rows that see its key. Keys outside a
 * row's mask never reach it, NaN or not. The KV cache and the backward follow the same rule
 * (gradients of a NaN row are NaN).
 *
 * Dropout: keep_ij is a pure function of (seed, offset, batch, head, i, j); see
 * fa_dropout_keep(). Dropout cannot be combined with softcap (as upstream).
 *
 * probs (debugging, optional), dtype of q, [b, h, >= max_sq, >= max_sk]: upstream's S_dmask.
 * Keys are taken in blocks of fa_probs_block_n() columns from the last block to the first; the
 * entry for a visible key is exp(s_ij - m_i), m_i being the running maximum of s over the blocks
 * seen so far in that order; its sign is flipped when dropout drops it. Invisible keys and
 * padding get 0.
 *
 * FP8 (FA3's forward; on a CUDA device e4m3 on Hopper only, and not with FLASHATTN_SM90_FP8=0:
 * other devices and e5m2 refuse fp8 q as unsupported):
 * q, k and v all FA_DTYPE_F8E4M3 or all FA_DTYPE_F8E5M2, out bf16 or fp16, lse fp32; d and dv
 * multiples of 16 (upstream's rule). q_descale, k_descale, v_descale (optional, each fp32 [b, hk],
 * any strides; absent means 1) dequantise per (sequence, kv head); query head i takes the
 * entries of its kv head i / (h / hk), as FA3. The scores are the formula above on q * q_descale
 * and k * k_descale. As FA3's kernels, probabilities enter the P V product rounded to e4m3:
 * with m_i the row's largest score (or the sink, if larger), p_ij = 2^8 exp(s_ij - m_i) is rounded
 * to e4m3 (nearest, ties to even; also for e5m2 inputs; the 2^8 uses e4m3's range: p_ij <= 256 <
 * 448), the row sum l_i takes the unrounded p_ij (and the sink's 2^8 exp(sink - m_i)), and
 * out_i = v_descale * sum_j round(p_ij) v_j / l_i; lse_i = m_i + log(l_i / 2^8), the formula's.
 * No dropout, probs or backward with fp8 (as FA3). Descales with non-fp8 inputs are refused.
 *
 * Paged K/V (block_table given, int32 [b, max_blocks]; varlen form only, upstream's
 * flash_attn_varlen_func with block_table): k [num_blocks, page_size, hk, d] and
 * v [num_blocks, page_size, hk, dv], read in place; key j of sequence i is row j % page_size of
 * block block_table[i, j / page_size]. Any page_size >= 1. cu_seqlens_k then only counts each
 * sequence's keys (its offsets are not rows of k), and seqused_k, when given, replaces that
 * count (at most max_seqlen_k), as upstream. A sequence holds at most max_blocks * page_size
 * keys. The CPU refuses, naming block_table, a sequence with more keys or a block id outside
 * [0, num_blocks) among the blocks its keys use; a CUDA device, which reads no index on the
 * host, clamps block ids into the cache and keys to that capacity (a wrong answer for such a
 * sequence, never a read outside k and v). No backward (as upstream). On sm_90 the calls with
 * many query rows run the sm80 kernels (the sm90 ones read through TMA tensor maps of the dense
 * layout).
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
    void *workspace;        /* CUDA: device memory for split partials or fp8's V^T, or NULL */
    size_t workspace_size;  /* bytes at workspace */
    const fa_tensor *q_descale; /* optional, fp8 only: fp32 [b, hk], any strides */
    const fa_tensor *k_descale; /* optional, fp8 only: fp32 [b, hk] */
    const fa_tensor *v_descale; /* optional, fp8 only: fp32 [b, hk] */
    const fa_mod *score_mod; /* optional, finished as FA_MOD_KIND_SCORE (fa_mod above) */
    const fa_mod *mask_mod;  /* optional, finished as FA_MOD_KIND_MASK */
    const fa_tensor *mod_aux[FA_MOD_AUX_SLOTS]; /* what the mods read: int32 or fp32 */
    const fa_block_mask *block_mask;            /* optional (fa_block_mask above) */
    const fa_tensor *block_table; /* optional int32 [b, max_blocks], varlen only: paged k, v */
} fa_fwd_args;

/* Sets every field to its default: no optional tensors, scale NaN, window (-1, -1), CPU. */
void fa_fwd_args_init(fa_fwd_args *args);

/* Validates every argument, then computes out (and lse, probs when given). */
fa_status fa_attention_forward(const fa_fwd_args *args);

/*
 * Bytes of workspace fa_attention_forward needs for args on args->device: 0 on the CPU, for
 * calls that do not split or merge their splits without one (on sm_90 and later, up to 16
 * splits merge inside a thread block cluster), or for invalid arguments (fa_last_error() says
 * why). Calls with few
 * query rows (at most FA_DECODE_MAX_ROWS per sequence, no dropout or probs; dense or varlen)
 * run the KV-cache call's schedule: the query heads of a kv head packed into one
 * tile, the keys cut into splits merged in the same call. On a device the splits' partials need
 * this much device memory, 256-byte aligned, given as workspace / workspace_size; with less
 * such a call runs as many splits as it holds, unsplit without one (the same result, slower
 * when few (sequence, kv head) pairs cannot fill the device). Dense fp8 calls on sm_90 where many query rows read each key (at least
 * 2048 rows of max_seqlen_q * h / hk, halved when causal; 1024 at head dims above 128) ask for
 * b * hk * dv * round_up(sk, 16) bytes: V is transposed there ahead of the kernel, which is
 * then faster; without it the kernel transposes V itself (the same result).
 */
size_t fa_attention_forward_workspace_size(const fa_fwd_args *args);
#define FA_DECODE_MAX_ROWS 16

/*
 * Backward attention: given the forward's arguments (with its out and lse filled by the forward)
 * and dout, computes dq, dk, dv (and dsinks when the forward used sinks). Tiles of the score
 * matrix are recomputed from q, k and lse; nothing of size sq x sk is stored. Dropout replays the
 * forward's mask from its seed and offset.
 *   dout, dq: as q/out, [b, sq, h, dv] / [b, sq, h, d] (varlen: [total_q, h, ...])
 *   dk, dv:   as k, v:  [b, sk, hk, d] / [b, sk, hk, dv]; with GQA summed over the query heads
 *             that share a kv head
 *   dsinks:   fp32 [h], written (not accumulated)
 * fwd->lse is required and fwd->probs is ignored; fwd->block_table is refused (no paged
 * backward, as upstream). On the CPU the result is bitwise reproducible across runs and thread
 * counts whatever `deterministic` says. On a CUDA device dk, dv and
 * dsinks are always bitwise reproducible, and dq too with deterministic = 1 (otherwise its fp32
 * accumulation uses atomics, whose order varies).
 *
 * Workspace (CUDA only; the CPU allocates its own): the call allocates no device memory. The
 * caller passes device memory of at least fa_attention_backward_workspace_size(args) bytes,
 * 256-byte aligned, on fwd->device, as workspace / workspace_size; its contents on entry do not
 * matter and it must not be used by anything else until the stream has run the backward.
 *
 * mod_aux_grad[slot] (optional): fp32 of fwd->mod_aux[slot]'s shape (which must be fp32), any
 * strides, written with d loss / d mod_aux[slot] through score_mod's reads of it: the program's
 * derivative with respect to each value read, times the gradient of the score it makes, summed
 * per element read (indices are not differentiated). The CPU sums in double per thread and
 * rounds once; a CUDA device adds in fp32 with atomics (the elements a thread and its warp add
 * at one place summed first), whose order varies, so the last places may differ between runs,
 * deterministic or not.
 */
typedef struct fa_bwd_args {
    const fa_fwd_args *fwd;  /* q, k, v, out, lse and every option of the forward call */
    const fa_tensor *dout;   /* [b, sq, h, dv] or [total_q, h, dv] */
    const fa_tensor *dq;     /* [b, sq, h, d] or [total_q, h, d], written */
    const fa_tensor *dk;     /* [b, sk, hk, d] or [total_k, hk, d], written */
    const fa_tensor *dv;     /* [b, sk, hk, dv] or [total_k, hk, dv], written */
    const fa_tensor *dsinks; /* fp32 [h], written; required when fwd->sinks is given */
    int deterministic;
    void *workspace;       /* CUDA: device memory, see fa_attention_backward_workspace_size */
    size_t workspace_size; /* bytes at workspace */
    const fa_tensor *mod_aux_grad[FA_MOD_AUX_SLOTS]; /* optional: above */
} fa_bwd_args;

void fa_bwd_args_init(fa_bwd_args *args);
fa_status fa_attention_backward(const fa_bwd_args *args);

/* Bytes of workspace fa_attention_backward needs for args (every field but workspace and
 * workspace_size is read): 0 on the CPU, and 0 when the arguments are invalid (fa_last_error()
 * then says why; the backward would refuse them too). */
size_t fa_attention_backward_workspace_size(const fa_bwd_args *args);

/*
 * Compiles (or finds in the caches) the kernels fa_attention_backward will run after a forward
 * with these arguments: nothing to do on the CPU; on a CUDA device NVRTC's work, no launch and no
 * device memory. Called from a thread of the caller's beside the forward's first call, it lets
 * a training run's first step compile the backward's kernels while the forward's compile (the
 * backward then finds them built, or waits for the build under way); the Python package does
 * so. Returns FA_STATUS_OK or what the backward would fail with (the forward's argument errors,
 * a case the backward refuses, a failed compile). Planned for dout, dq, dk and dv laid out as
 * q, k and v and a nondeterministic call (a deterministic one may run another kernel).
 */
fa_status fa_attention_backward_prepare(const fa_fwd_args *args);

/*
 * The dropout keep bit of element (batch, head, row, col), as every backend computes it.
 * head counts query heads; batch is the sequence index in the varlen form; row and col are
 * positions inside the sequence. Philox4x32-7 (Random123's philox4x32_R with 7 rounds, as
 * upstream FA2) with key (lo32(seed), hi32(seed)) and counter (col >> 4, row, lo32(c), hi32(c))
 * with c = offset + batch * num_heads + head gives four 32-bit words w0..w3; the element's 8-bit
 * number is r = (w[(col & 7) >> 1] >> (8 * ((col & 1) + 2 * ((col >> 3) & 1)))) & 0xff, and the
 * element is kept iff r < floor((1 - dropout_p) * 256 + 0.5). A dropout_p <= 0 keeps every
 * element; >= 1 or NaN keeps none. Kept elements are scaled by 1 / (1 - dropout_p).
 */
int fa_dropout_keep(uint64_t seed, uint64_t offset, int64_t num_heads, int64_t batch,
                    int64_t head, int64_t row, int64_t col, double dropout_p);

/* Column block width of the probs encoding (upstream's kBlockN for sm80). */
int fa_probs_block_n(int head_dim, int dropout, int causal);

/*
 * Attention against a KV cache (upstream's flash_attn_with_kvcache), for decoding and chunked
 * prefill: optionally appends new keys/values to the cache in place (with rotary embedding),
 * then attends q to the cache.
 *
 *   q        [b, sq, h, d]                      out [b, sq, h, dv]
 *   k_cache  [b_cache, s_cache, hk, d]          v_cache [b_cache, s_cache, hk, dv]  contiguous
 *            [num_blocks, page_size, hk, d]     v_cache [num_blocks, page_size, hk, dv]  paged
 *   lse      fp32 (or fp64 if q is) [b, h, sq]
 *
 * Where sequence i lives: contiguous, in cache row cache_batch_idx[i] (default i; b_cache >= b),
 * position t at [row, t]; paged (block_table given, int32 [b, max_blocks]), position t is row
 * t % page_size of block block_table[i, t / page_size]. Any page_size >= 1. A sequence holds at
 * most s_cache (paged: max_blocks * page_size) positions.
 *
 * Which keys: sequence i attends to the cache positions [start_i, end_i), with
 *   start_i = cache_leftpad[i] (0 without cache_leftpad),
 *   end_i   = cache_seqlens[i] + s_new (without cache_seqlens: every position, s_cache or
 *             max_blocks * page_size; s_new is 0 without k).
 * Then the attention is fa_attention_forward's on q and these n_i = end_i - start_i keys: causal
 * and windows aligned to the bottom-right corner (query row r sees key j iff
 * r + n_i - sq - left <= j <= r + n_i - sq + right), ALiBi, softcap, sinks, GQA/MQA; rows that
 * see no key get out 0 and lse +inf (lse = sink with sinks). No dropout.
 *
 * Append (k and v given; cache_seqlens required): k [b, s_new, hk, d] and v [b, s_new, hk, dv]
 * are written into the caches at positions cache_seqlens[i] .. cache_seqlens[i] + s_new - 1 of
 * each sequence before the attention, which reads them from there. When two sequences write the
 * same cache rows (repeated cache_batch_idx, shared blocks) the later sequence's values stay on
 * the CPU; on a CUDA device which one stays is unspecified (the sequences run in parallel, as
 * upstream's do).
 *
 * Rotary embedding (rotary_cos and rotary_sin, [seqlen_ro, rotary_dim / 2], dtype of q; only
 * with k): the first rotary_dim features of the new keys and of q are rotated by the angles of
 * row `pos` of cos/sin. Interleaved (GPT-J) rotates the pairs (2t, 2t + 1), otherwise (GPT-NeoX)
 * the pairs (t, t + rotary_dim / 2): x' = x cos - y sin, y' = x sin + y cos. New key s of
 * sequence i is at pos cache_seqlens[i] + s. Query row r is at pos cache_seqlens[i] + r when
 * the attention is causal or local (a window side >= 0 and below the capacity), else every row
 * is at pos cache_seqlens[i] (upstream's rules). Keys are stored rotated (rounded to the cache's
 * dtype); q is rotated on the fly in the compute precision, the caller's q is left as it is.
 * seqlen_ro must cover every position rotated.
 *
 * num_splits: each (sequence, kv head) cuts its keys into this many chunks, computed in
 * parallel and merged as fa_attention_combine does; 0 lets the library choose from the problem
 * and the thread count, 1 never splits, at most FA_MAX_SPLITS. Any count gives the same result
 * within rounding; a fixed count gives bitwise the same result for every thread count.
 *
 * Every argument is checked before anything is written (block ids of the blocks a sequence
 * uses, capacity for cache_seqlens + s_new, index ranges, rotary coverage, ...).
 *
 * On a CUDA device (fp16 and bf16) the call is asynchronous on `stream`, allocates nothing and
 * reads no device value on the host, except as follows. The index tensors (cache_seqlens,
 * cache_batch_idx, cache_leftpad, block_table) are device memory the host does not check; the
 * kernels clamp every value into the caches, so a bad one gives a meaningless answer for its
 * sequence but never reads or writes outside the caller's tensors. With a paged cache, as
 * upstream does, the call refuses, naming block_table, a sequence whose cache_seqlens + s_new
 * exceeds its block_table row. The kernels check cache_seqlens themselves and write no cache row
 * when a sequence fails; the first reports into a little pinned host memory the library keeps,
 * and the call waits for that report after launching (on refusal out and lse hold meaningless
 * values, the caches are untouched). The wait lasts until the stream's earlier work is done and
 * the call's first kernel has started, so a host launching steps back to back overlaps its next
 * launch with this step's kernels; it spins on the CPU meanwhile. Set skip_capacity_check to
 * skip it (required inside CUDA graph capture). Splits need workspace:
 * fa_attention_kvcache_workspace_size bytes of device memory, 256-byte aligned; with less a
 * call with num_splits 0 runs as many splits as it holds (unsplit without one) and one with
 * num_splits > 1 is refused.
 * When two sequences write the same cache rows the result on a device is either's values.
 *
 * FP8 caches (vLLM's form): k_cache and v_cache FA_DTYPE_F8E4M3 or FA_DTYPE_F8E5M2 (both the
 * same kind) with q, k, v, out, rotary_cos/sin in fp16 or bf16 (on the CPU fp32 too). The cache
 * holds keys and values divided by their scale and rounded to fp8; k_descale and v_descale
 * (optional, each fp32 [b, hk], any strides; absent means 1) multiply them back. As FA3's
 * flash_attn_with_kvcache, entry [i, kh] belongs to sequence i (the batch index of q, not its
 * cache row cache_batch_idx[i] nor its blocks) and kv head kh; query head hq takes kh =
 * hq / (h / hk). q is not scaled. With K_j = k_cache_j * k_descale and V_j = v_cache_j * v_descale
 * (the fp8 values are exact in fp16 and bf16) the scores and the output are the formulas above
 * on K and V, computed as the GPU computes them: s_ij = (scale * k_descale) * (q_i . k_cache_j)
 * in fp32 (on the GPU over fp16 products: a bf16 q is scaled into fp16 by a power of two per
 * tile, exact but for values 2^-28 of the tile's largest and below); the probabilities
 * p_ij = exp(s_ij - m) (m a running maximum of the row) enter the P V product rounded to fp16
 * (with an fp16 or a bf16 q; not rounded with fp32 q on the CPU) while their row sum l
 * takes them unrounded, and v_descale multiplies the final out_i = v_descale * (sum_j p_ij
 * v_cache_j) / l. The append writes, for each new key row (rotated first when rotary is on, in
 * fp32, not rounded to q's dtype) and value row, round_to_fp8(x / descale) with the division in
 * fp32 and fa_fp8_from_f32's rounding (e4m3 saturates to +-448, e5m2 overflows to +-inf).
 * An fp8 q (FA3's all-fp8 form) is refused, naming q; descales with a cache that is not fp8
 * are refused, naming them.
 */
typedef struct fa_kvcache_args {
    const fa_tensor *q;               /* [b, sq, h, d] */
    const fa_tensor *k_cache;         /* [b_cache, s_cache, hk, d] or [blocks, page_size, hk, d] */
    const fa_tensor *v_cache;         /* [.., .., hk, dv], as k_cache */
    const fa_tensor *k;               /* optional [b, s_new, hk, d]: appended in place */
    const fa_tensor *v;               /* [b, s_new, hk, dv]: appended with k */
    const fa_tensor *rotary_cos;      /* optional [seqlen_ro, rotary_dim / 2], dtype of q */
    const fa_tensor *rotary_sin;      /* [seqlen_ro, rotary_dim / 2], with rotary_cos */
    const fa_tensor *cache_seqlens;   /* optional int32 [b]: positions already in the cache */
    const fa_tensor *cache_batch_idx; /* optional int32 [b]: cache row of each sequence */
    const fa_tensor *cache_leftpad;   /* optional int32 [b]: first position of each sequence */
    const fa_tensor *block_table;     /* optional int32 [b, max_blocks]: selects the paged form */
    const fa_tensor *alibi_slopes;    /* optional fp32 [h] or [b, h] */
    const fa_tensor *sinks;           /* optional fp32 [h] */
    const fa_tensor *out;             /* [b, sq, h, dv], written */
    const fa_tensor *lse;             /* optional fp32 (or fp64 if q is) [b, h, sq], written */
    double softmax_scale;             /* NaN (the default) means d^-0.5 */
    int causal;
    int window_left;        /* -1: unbounded */
    int window_right;       /* -1: unbounded */
    double softcap;         /* <= 0: off */
    int rotary_interleaved; /* default 1, as upstream */
    int num_splits;         /* 0 (default): chosen by the library */
    int device;             /* FA_DEVICE_CPU or a CUDA ordinal */
    void *stream;           /* CUDA stream for device >= 0; ignored on the CPU */
    int num_threads;        /* CPU threads; 0: $FLASHATTN_NUM_THREADS or every available core */
    void *workspace;        /* CUDA: device memory for split partials, or NULL */
    size_t workspace_size;  /* bytes at workspace */
    int skip_capacity_check; /* CUDA, paged: 1 skips the check of cache_seqlens (above) */
    const fa_tensor *k_descale; /* optional fp32 [b, hk], with an fp8 k_cache (FP8 above) */
    const fa_tensor *v_descale; /* optional fp32 [b, hk], with an fp8 v_cache */
} fa_kvcache_args;

/* Defaults: no optional tensors, scale NaN, window (-1, -1), rotary_interleaved 1, CPU. */
void fa_kvcache_args_init(fa_kvcache_args *args);

/* Validates every argument, appends k/v (when given), then computes out (and lse). */
fa_status fa_attention_kvcache(const fa_kvcache_args *args);

/* Bytes of workspace fa_attention_kvcache needs for args to split as it would choose (or as
 * num_splits asks) on args->device: 0 on the CPU, when no split is needed or the splits merge
 * without one (inside a thread block cluster, as fa_attention_forward_workspace_size says), or
 * when the arguments are invalid (fa_last_error() says why). */
size_t fa_attention_kvcache_workspace_size(const fa_kvcache_args *args);

#define FA_MAX_SPLITS 256

/*
 * Merges attention computed over disjoint parts of the keys (split-KV, sequence parallelism,
 * ring attention), in FA3's layout:
 *   out_partial fp32 [splits, b, sq, h, dv]   lse_partial fp32 [splits, b, sq, h]
 *   out         [b, sq, h, dv], fp32, fp16, bf16 or fp64     lse fp32 [b, sq, h] (optional)
 * (out_partial and lse_partial may instead both be fp64, and lse then fp64 too.) Each part s holds its normalised
 * output o_s and log-sum-exp l_s; then lse = log(sum_s exp(l_s)), out = sum_s exp(l_s - lse) o_s.
 * A part with l_s = -inf (or +inf, what fa_attention_forward writes for a row that saw no key)
 * is empty: its o_s is not read. A row whose parts are all empty gets out 0 and lse -inf (as
 * FA3). 1 <= splits <= FA_MAX_SPLITS. out_partial and out need a contiguous last dimension;
 * lse_partial and lse may have any strides (FA3 passes transposed [.., h, sq] buffers).
 * On a CUDA device (asynchronous on `stream`): fp32 partials, dv <= 256, out fp32, fp16 or bf16;
 * other cases are refused with FA_STATUS_UNSUPPORTED.
 */
typedef struct fa_combine_args {
    const fa_tensor *out_partial; /* fp32 [splits, b, sq, h, dv] */
    const fa_tensor *lse_partial; /* fp32 [splits, b, sq, h] */
    const fa_tensor *out;         /* [b, sq, h, dv], written */
    const fa_tensor *lse;         /* optional fp32 [b, sq, h] (fp64 with fp64 parts), written */
    int device;                   /* FA_DEVICE_CPU or a CUDA ordinal */
    void *stream;                 /* CUDA stream for device >= 0; ignored on the CPU */
    int num_threads;              /* CPU threads; 0: the default */
} fa_combine_args;

/* Defaults: no tensors, CPU, default threads. */
void fa_combine_args_init(fa_combine_args *args);

/* Validates every argument, then writes out (and lse). */
fa_status fa_attention_combine(const fa_combine_args *args);

/* Message of the last failed call on this thread ("" if none). */
const char *fa_last_error(void);
const char *fa_status_string(fa_status status);
const char *fa_dtype_name(fa_dtype dtype);
size_t fa_dtype_size(fa_dtype dtype);
const char *fa_version(void);

/*
 * fp8 <-> fp32 as torch converts (bit for bit): fp32 -> fp8 rounds to nearest, ties to even,
 * subnormals kept; e4m3 saturates (finite overflow and +-inf give +-448), e5m2 overflows to
 * +-inf; NaN gives the kind's NaN with the input's sign. dtype is FA_DTYPE_F8E4M3 or
 * FA_DTYPE_F8E5M2 (else FA_STATUS_INVALID_ARGUMENT); n elements, src and dst contiguous.
 */
fa_status fa_fp8_from_f32(fa_dtype dtype, const float *src, uint8_t *dst, size_t n);
fa_status fa_fp8_to_f32(fa_dtype dtype, const uint8_t *src, float *dst, size_t n);

/*
 * CUDA backend. The driver (libcuda.so.1) and NVRTC (libnvrtc.so.13/.12) are found with dlopen at
 * run time; without them the CPU backend still works and these calls say what is missing.
 * A forward call with args->device >= 0 takes device pointers and launches on args->stream (a
 * CUstream; NULL is the legacy default stream) of that device, in the caller's current context
 * when it belongs to the device, else in the device's primary context. It returns as soon as the
 * work is queued: no synchronisation, no device allocation. fp16 and bf16 only.
 * Kernels are compiled at first use and cached: in memory, and on disk under
 * $FLASHATTN_CACHE_DIR (default $XDG_CACHE_HOME/flashattn or ~/.cache/flashattn; "" turns the
 * disk cache off). FLASHATTN_LOG=1 prints each compile (with its time) and cache hit to stderr.
 */
typedef struct fa_cuda_device_info {
    char name[128];
    int arch;               /* compute capability as 10 * major + minor: 80, 86, 89, 90, ... */
    int multiprocessors;
    int max_smem_per_block; /* bytes, the opt-in maximum */
    size_t total_memory;    /* bytes */
} fa_cuda_device_info;

/* CUDA devices the library can use: 0 when the driver, NVRTC or a GPU is missing. */
int fa_cuda_device_count(void);
fa_status fa_cuda_device_info_get(int device, fa_cuda_device_info *info);

/* What the CUDA backend found, as a few lines of text: driver, NVRTC, and whether it is usable
 * (and why not). */
const char *fa_cuda_status(void);

/* Features of a kernel configuration, for fa_cuda_precompile. */
enum {
    FA_FEATURE_VARLEN = 1u << 0,
    FA_FEATURE_ALIBI = 1u << 1,
    FA_FEATURE_SOFTCAP = 1u << 2,
    FA_FEATURE_DROPOUT = 1u << 3,
    FA_FEATURE_UNALIGNED = 1u << 4, /* rows not 16-byte aligned, or d, dv not multiples of 8 */
};

/* Compiles the forward kernels of one configuration into the cache with NVRTC alone (no GPU or
 * driver needed). arch as in fa_cuda_device_info; *cached (may be NULL) is set to 1 when the
 * kernel was already cached. Safe to call from several threads at once. Dropout with softcap is
 * FA_STATUS_INVALID_ARGUMENT, as in a call. FA_STATUS_INTERNAL
 * also where ptxas reported a potential performance loss (wgmma serialised) for a kernel this
 * call compiled: a defect of the library's kernel source. */
fa_status fa_cuda_precompile(int arch, fa_dtype dtype, int head_dim, int head_dim_v,
                             unsigned features, int *cached);

/* Threads the CPU backend uses when num_threads is 0. */
int fa_cpu_default_threads(void);

/* The CPU as the library sees it: model name, the SIMD features it detected, the kernels it
 * picked and the L2 per thread its tiles are sized for. */
const char *fa_cpu_description(void);

#ifdef __cplusplus
}
#endif

#endif /* FLASHATTN_H */
