/*
 * fa_block_mask_build on a CUDA device (kernels/fa_block_mask.cu): the mask program compiled
 * into the builder, a CTA per (query block, head, sequence) the program tells apart, launched
 * on the caller's stream; no host synchronisation, no allocation.
 */
#include <limits.h>
#include <string.h>

#include "fa_bmparams.h"
#include "cuda/fa_cuda.h"
#include "cuda/fa_cuda_driver.h"
#include "cuda/fa_jit.h"
#include "mod/fa_mod_program.h"

static void fa_cuda_bm_strides(const fa_tensor *t, fa_i64 *stride)
{
    for (int d = 0; d < t->ndim; d++)
        stride[d] = t->stride[d];
}

fa_status fa_cuda_block_mask_build(const fa_params *p, const fa_block_mask_args *a)
{
    int arch = 0, smem_optin = 0;
    FA_TRY(fa_cuda_device_arch(a->device, &arch, &smem_optin));
    const int64_t nq = (a->sq + a->q_block - 1) / a->q_block;
    const int64_t nk = (a->sk + a->kv_block - 1) / a->kv_block;
    /* The kernel's indices are ints, the grid's y and z dims at most 65535, and a row's states
     * (a byte a key block) sit in shared memory. */
    if (a->sq >= INT_MAX || a->sk >= INT_MAX)
        return fa_error_set(FA_STATUS_UNSUPPORTED, "%s: below 2^31 - 1 on a CUDA device, got "
                            "%lld", a->sq >= INT_MAX ? "sq" : "sk",
                            (long long)(a->sq >= INT_MAX ? a->sq : a->sk));
    if (a->b > 65535 || a->h > 65535)
        return fa_error_set(FA_STATUS_UNSUPPORTED, "%s: at most 65535 on a CUDA device, got %lld",
                            a->b > 65535 ? "b" : "h", (long long)(a->b > 65535 ? a->b : a->h));
    if (nk > smem_optin)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "kv_block: %lld key blocks a row, the device's shared memory holds "
                            "the states of %d; use larger blocks",
                            (long long)nk, smem_optin);
    const fa_mod *m = a->mask_mod;
    fa_plan_key key = {arch, FA_DTYPE_F32, 0, 0, 0, 0, 0, 0};
    fa_kparams_key_mods(p, &key);
    fa_plan plan;
    FA_TRY(fa_plan_block_mask(&key, &plan));
    plan.mask_mod = m->cuda;
    plan.smem = (unsigned)nk;

    fa_bmparams bp;
    memset(&bp, 0, sizeof bp);
    fa_kparams_fill(p, &bp.f);
    bp.num = a->kv_num_blocks->data, bp.idx = a->kv_indices->data;
    fa_cuda_bm_strides(a->kv_num_blocks, bp.num_stride);
    fa_cuda_bm_strides(a->kv_indices, bp.idx_stride);
    if (a->full_kv_num_blocks) {
        bp.full_num = a->full_kv_num_blocks->data, bp.full_idx = a->full_kv_indices->data;
        fa_cuda_bm_strides(a->full_kv_num_blocks, bp.full_num_stride);
        fa_cuda_bm_strides(a->full_kv_indices, bp.full_idx_stride);
    }
    bp.b = (int)a->b, bp.h = (int)a->h;
    bp.rb = m->reads_b ? bp.b : 1;
    bp.rh = m->reads_h ? bp.h : 1;
    bp.sq = (int)a->sq, bp.sk = (int)a->sk, bp.nq = (int)nq, bp.nk = (int)nk;
    /* A block longer than the call (never full: its pairs past sq or sk are not kept) as one
     * past it, which an int holds. */
    bp.q_block = (int)(a->q_block <= a->sq ? a->q_block : a->sq + 1);
    bp.kv_block = (int)(a->kv_block <= a->sk ? a->kv_block : a->sk + 1);

    fa_cu_context ctx;
    int pushed;
    FA_TRY(fa_cuda_context_enter(a->device, &ctx, &pushed));
    fa_cu_function fn;
    fa_status st = fa_jit_function(&plan, ctx, "fa_block_mask_build", &fn);
    if (st == FA_STATUS_OK) {
        void *params[] = {&bp};
        const fa_cu_result r = fa_cuda_driver_get()->launch_kernel(
            fn, (unsigned)nq, (unsigned)bp.rh, (unsigned)bp.rb, plan.threads, 1, 1, plan.smem,
            (fa_cu_stream)a->stream, params, NULL);
        if (r != 0)
            st = fa_cuda_error(r, "launching fa_block_mask_build");
    }
    fa_cuda_context_leave(pushed);
    return st;
}
