/* The CUDA backend's entry points for the API layer. */
#ifndef FA_CUDA_H
#define FA_CUDA_H

#include "core/fa_backend.h"

/* The table the API layer dispatches calls on a CUDA ordinal through (fa_cuda_backend.c). */
extern const fa_backend fa_cuda_backend;

/* Launches the forward on args->stream of CUDA device args->device: asynchronous, no
 * allocation, no synchronisation. p is the validated problem (its pointers are device pointers). */
fa_status fa_cuda_forward(const fa_params *p, const fa_fwd_args *args);

/* The fp8 (e4m3) forward through the sm90 kernel (fa_cuda_forward_fp8.c; FLASHATTN_SM90_FP8=0
 * turns it off), on a device of compute capability arch giving smem_optin bytes of shared
 * memory a block. */
fa_status fa_cuda_forward_fp8(const fa_params *p, const fa_fwd_args *args, int arch,
                              int smem_optin);
/* Bytes of workspace it wants on a device of arch for p: V^T for the dense calls the plan says
 * pay for the copy (fa_plan_fp8_vt); 0 otherwise. */
size_t fa_cuda_forward_fp8_workspace_size(const fa_params *p, int arch);

/* The kernel family ("fa_fwd_sm80.cu", "fa_fwd_sm90.cu") the calling thread's last forward
 * launched, "" before any: lets the GPU tests check which path ran. */
const char *fa_cuda_last_family(void);
/* The decode family ("fa_decode.cu", "fa_decode_wg.cu") the calling thread's last decode (a
 * KV-cache call or a forward on the decode schedule) planned, "" before any. */
const char *fa_cuda_decode_last_family(void);
/* The key splits that decode ran (1: unsplit), 0 before any. */
int fa_cuda_decode_last_splits(void);

/* The kernels' parameter block (kernels/fa_kparams.h) for the validated problem p. */
struct fa_kparams;
void fa_kparams_fill(const fa_params *p, struct fa_kparams *kp);

/* The plan key's fields (fa_plan.h) for p's user-defined scoring: the FA_PLAN_SCORE_MOD,
 * _MASK_MOD and _BLOCK_MASK bits, mod_aux (the aux tensors' dtypes and offset width) and the
 * block mask's block sizes. */
struct fa_plan_key;
void fa_kparams_key_mods(const fa_params *p, struct fa_plan_key *key);

/* Whether every stride is a multiple of 8 elements and every pointer 16-byte aligned: what
 * cp.async and 16-byte stores need of a 16-bit tensor's rows. */
int fa_cuda_all_aligned(const int64_t *strides, size_t n, const void *const *ptrs, size_t m);

/* The same of q, k, v and out, with d and dv whole 16-byte chunks: the forward's and the
 * decode's condition for FA_VEC. */
int fa_cuda_rows_aligned(const fa_params *p);

/* The sm90 families' tensor maps of p's q, k, v (and dout when not NULL): 128B swizzle, boxes of
 * 64 columns by bm query rows (q, dout) or bn keys (k, v), zero fill out of bounds; varlen maps
 * span all the packed rows. Nonzero when one cannot be made (strides TMA cannot take, or varlen
 * rows past TMA's int coordinates): the sm80 families take the call then. */
struct fa_cuda_driver;
struct fa_cu_tensor_map;
int fa_cuda_tmaps_encode(const struct fa_cuda_driver *d, const fa_params *p, int bm, int bn,
                         struct fa_cu_tensor_map *q, struct fa_cu_tensor_map *k,
                         struct fa_cu_tensor_map *v, struct fa_cu_tensor_map *dout);

/* The backward on args->fwd->device (kernels/fa_bwd_sm80.cu, or fa_bwd_sm90.cu where the plan
 * takes it): asynchronous on the caller's stream, no allocation (the workspace comes from args),
 * no synchronisation. */
fa_status fa_cuda_backward(const fa_params *p, const fa_bwd_args *args);

/* The backward's family ("fa_bwd_sm80.cu", "fa_bwd_sm90.cu") the calling thread's last backward
 * launched, "" before any. */
const char *fa_cuda_last_backward_family(void);

/* Bytes of workspace the CUDA backward needs for p. */
size_t fa_cuda_backward_workspace_size(const fa_params *p);

/* Builds (NVRTC, or the caches) the module the backward of p, a forward's problem, will run on
 * args->device. */
fa_status fa_cuda_backward_prepare(const fa_params *p, const fa_fwd_args *args);

/* fa_attention_kvcache on args->device (fa_cuda_decode.c): the append, the attention over the
 * cache read in place, and the merge of its splits; asynchronous, no allocation (split partials
 * in args->workspace). */
fa_status fa_cuda_kvcache(const fa_params *p, const fa_kvcache_args *args);

/* fa_block_mask_build on a device (fa_cuda_block_mask.c); p from fa_block_mask_args_check. */
fa_status fa_cuda_block_mask_build(const fa_params *p, const fa_block_mask_args *a);

/* Bytes of workspace fa_cuda_kvcache needs for p on args->device (0: it will not split). */
size_t fa_cuda_kvcache_workspace_size(const fa_params *p, const fa_kvcache_args *args);

/* Whether the forward of p takes the decode schedule (fa_plan_cuda_decodes, dense or varlen),
 * which fa_cuda_forward_decode runs; its split workspace in bytes (0: it will not split). */
int fa_cuda_forward_decodes(const fa_params *p);
fa_status fa_cuda_forward_decode(const fa_params *p, const fa_fwd_args *args);
size_t fa_cuda_forward_workspace_size(const fa_params *p, const fa_fwd_args *args);

/* fa_attention_combine on args->device (fp32 partials). */
fa_status fa_cuda_combine(const fa_params *p, const fa_combine_args *args);

#endif /* FA_CUDA_H */
