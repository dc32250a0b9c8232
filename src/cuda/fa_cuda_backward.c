/*
 * The backward on a CUDA device (kernels/fa_bwd_sm80.cu, or fa_bwd_sm90.cu / fa_bwd_sm90_wide.cu
 * where the plan takes it, with the tensor maps of Q, K, V and dO): plan, check the caller's workspace, fill the
 * parameter block, launch the kernels on the caller's stream (four, fa_bwd_fill first in the
 * varlen form and fa_bwd_aux_zero where the mods' captured tensors get gradients). Both families share the workspace layout below. fa_cuda_backward_prepare builds
 * the same plan's module ahead of the first backward.
 *
 * Workspace layout (each part 256-byte aligned; rows = m_tiles * bm, whole query tiles, m_tiles
 * from max_sq in the dense and the varlen form alike: b is the number of sequences):
 *   dq_accum fp32 [h][b][rows][dp]   dQ accumulated over the key blocks, in the kernel's
 *                                    mma-fragment order (kernels/fa_bwd_sm80.cu)
 *   dsum     fp32 [h][b][rows]       D = rowsum(dout * out)
 *   lse2     fp32 [h][b][rows]       lse * log2(e)
 *   sem      int32 [b][h][m_tiles]   deterministic mode: key blocks added so far per query tile
 *   sched    int32 [1]               the sm90 persistent grid's count of claimed work items
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_bkparams.h"
#include "fa_smem.h"
#include "core/fa_check.h"
#include "cuda/fa_cuda.h"
#include "cuda/fa_cuda_driver.h"
#include "cuda/fa_jit.h"

#define FA_WS_ALIGN 256

static size_t fa_ws_round(size_t x) { return (x + FA_WS_ALIGN - 1) / FA_WS_ALIGN * FA_WS_ALIGN; }

typedef struct fa_bwd_ws {
    size_t accum, dsum, lse2, sem, sched, bm, total; /* byte offsets, and the size */
    size_t bm_stride, bm_tables; /* a block mask's tables (fa_bwd_bm_bytes): bytes, count */
} fa_bwd_ws;

/* The bytes of a key block's block-mask view and states over every query block of its heads
 * (FA_SMEM_BWD_BM with the most key blocks a block of plan's meets), rounded up to 16: the
 * sm80 kernel keeps them behind its tiles, the sm90 kernel too, copied there from the
 * workspace, where fa_bwd_bm_tables builds them; *tables: how many (FA_BM_TABLE_KV_HEADS). */
static int64_t fa_bwd_bm_bytes(const fa_params *p, const fa_plan *plan, int64_t *tables)
{
    const fa_mod_blocks *mb = &p->mods.blocks;
    *tables = 0;
    if (!mb->num.data)
        return 0;
    fa_kparams kp;
    fa_kparams_fill(p, &kp);
    const int64_t nq = (p->max_sq + mb->q_block - 1) / mb->q_block;
    const int64_t heads = FA_BM_TABLE_HEADS(&kp, p->h / p->hk);
    *tables = (p->max_sk + plan->bn - 1) / plan->bn * FA_BM_TABLE_KV_HEADS(&kp) * p->b;
    return (FA_SMEM_BWD_BM(heads, nq, (plan->bn - 1) / mb->kv_block + 2) + 15) / 16 * 16;
}

/* The layout for plan's query tile (bm rows), padded head dim (dp) and key block (bn). */
static fa_bwd_ws fa_bwd_ws_layout(const fa_params *p, const fa_plan *plan)
{
    fa_bwd_ws w;
    const size_t m_tiles = (size_t)((p->max_sq + plan->bm - 1) / plan->bm);
    const size_t rows = (size_t)p->h * (size_t)p->b * m_tiles * (size_t)plan->bm;
    w.accum = 0;
    w.dsum = fa_ws_round(w.accum + 4 * rows * (size_t)plan->dp);
    w.lse2 = fa_ws_round(w.dsum + 4 * rows);
    w.sem = fa_ws_round(w.lse2 + 4 * rows);
    w.sched = fa_ws_round(w.sem + 4 * (size_t)p->b * (size_t)p->h * m_tiles);
    w.bm = fa_ws_round(w.sched + 4);
    int64_t tables;
    w.bm_stride = (size_t)fa_bwd_bm_bytes(p, plan, &tables);
    w.bm_tables = (size_t)tables;
    w.total = fa_ws_round(w.bm + w.bm_stride * w.bm_tables);
    return w;
}

/* Asked for without a device: the largest of the layouts of the plans (with the call's mods)
 * at arch 80 (the padded head dims of every arch, FA_BWD_BM-row query tiles) and 86 (the 99 KB
 * parts, whose query tiles may be smaller: more of them, more ordering counters) and of the
 * sm90 family's plan, whose query tiles may be larger. 0 where the backward cannot run the case, with the plan's reason in
 * fa_last_error() (the backward refuses it the same way). */
size_t fa_cuda_backward_workspace_size(const fa_params *p)
{
    fa_plan_key key = {80, p->dtype, (int)p->d, (int)p->dv, 0, 0, 0, 0};
    key.features |= p->is_varlen ? FA_FEATURE_VARLEN : 0;
    /* Calls with user-defined scoring take the mods' tiles (smaller query tiles at some head
     * dims): planned as such. */
    fa_kparams_key_mods(p, &key);
    fa_plan plan;
    if (fa_plan_backward(&key, &plan) != FA_STATUS_OK)
        return 0;
    size_t total = fa_bwd_ws_layout(p, &plan).total;
    key.arch = 86;
    if (fa_plan_backward(&key, &plan) == FA_STATUS_OK) {
        const size_t small = fa_bwd_ws_layout(p, &plan).total;
        total = small > total ? small : total;
    }
    key.arch = 90;
    if (fa_plan_backward_sm90(&key, &plan) == FA_STATUS_OK) {
        const size_t sm90 = fa_bwd_ws_layout(p, &plan).total;
        total = sm90 > total ? sm90 : total;
    }
    return total;
}

/* cp.async and paired stores need 16-byte aligned rows and d, dv multiples of 8, in every
 * tensor the kernels read with cp.async or write in pairs. */
static int fa_bwd_aligned(const fa_params *p)
{
    const int64_t strides[] = {p->q_bstride,  p->q_rstride,  p->q_hstride,  p->k_bstride,
                               p->k_rstride,  p->k_hstride,  p->v_bstride,  p->v_rstride,
                               p->v_hstride,  p->do_bstride, p->do_rstride, p->do_hstride,
                               p->dk_bstride, p->dk_rstride, p->dk_hstride, p->dv_bstride,
                               p->dv_rstride, p->dv_hstride, p->dq_bstride, p->dq_rstride,
                               p->dq_hstride};
    const void *const ptrs[] = {p->q,       p->k,       p->v,      p->dout_data,
                                p->dq_data, p->dk_data, p->dv_data};
    return p->d % 8 == 0 && p->dv % 8 == 0 &&
           fa_cuda_all_aligned(strides, sizeof strides / sizeof strides[0], ptrs,
                               sizeof ptrs / sizeof ptrs[0]);
}

/* CTAs of fa_bwd_aux_zero (256 threads, a grid-stride loop) for the captured tensors'
 * gradients asked for: the largest one's elements over 256, at most 1024; 0 without any. */
static int64_t fa_bwd_aux_ctas(const fa_params *p)
{
    int64_t most = 0;
    for (int i = 0; i < FA_MOD_AUX_SLOTS; i++) {
        const int64_t n = p->mod_aux_grad[i].data ? fa_tensor_numel(&p->mod_aux_grad[i]) : 0;
        most = n > most ? n : most;
    }
    const int64_t ctas = (most + 255) / 256;
    return ctas < 1024 ? ctas : 1024;
}

/* The mods' CUDA C into a plan of p's (which the plan compiles in). */
static void fa_bwd_plan_mods(const fa_params *p, fa_plan *plan)
{
    plan->score_mod = p->mods.score_mod ? p->mods.score_mod->cuda : NULL;
    plan->mask_mod = p->mods.mask_mod ? p->mods.mask_mod->cuda : NULL;
}

/* The backward's plan (and its key) for p on a device of arch, the mods' CUDA C in it. */
static fa_status fa_bwd_plan(const fa_params *p, int arch, fa_plan_key *key, fa_plan *plan)
{
    *key = (fa_plan_key){arch, p->dtype, (int)p->d, (int)p->dv, 0, 0, 0, 0};
    key->features |= p->is_varlen ? FA_FEATURE_VARLEN : 0;
    key->features |= p->alibi_slopes ? FA_FEATURE_ALIBI : 0;
    key->features |= p->softcap > 0 ? FA_FEATURE_SOFTCAP : 0;
    key->features |= p->dropout_p > 0 ? FA_FEATURE_DROPOUT : 0;
    key->features |= fa_bwd_aligned(p) ? 0 : FA_FEATURE_UNALIGNED;
    /* User-defined scoring: fa_bwd_sm90.cu's hooks or the sm80 family compile the programs in
     * (fa_plan_backward). */
    fa_kparams_key_mods(p, key);
    FA_TRY(fa_plan_backward(key, plan));
    fa_bwd_plan_mods(p, plan);
    return FA_STATUS_OK;
}

fa_status fa_cuda_backward_prepare(const fa_params *p, const fa_fwd_args *args)
{
    int arch = 0, smem_optin = 0;
    FA_TRY(fa_cuda_device_arch(args->device, &arch, &smem_optin));
    fa_plan_key key;
    fa_plan plan;
    FA_TRY(fa_bwd_plan(p, arch, &key, &plan));
    fa_jit_origin origin;
    return fa_jit_build(&plan, &origin);
}

/* The sm90 kernels' second parameter (fa_bwd_tmaps in kernels/fa_bwd_sm90.cuh). */
typedef struct fa_bwd_tmaps {
    fa_cu_tensor_map q, k, v, dout;
} fa_bwd_tmaps;

/* The persistent grid's chunk of (kv head, sequence) pairs claimed longest first under a right
 * window edge: fa_plan_backward_lpt_groups, or FLASHATTN_BWD_LPT=G (0..64; 0 claims key blocks
 * fastest, without the longest-first order), for tuning with the benchmark. */
static int fa_bwd_lpt_groups(const fa_params *p, const fa_plan *plan, int64_t n_tiles, int sms)
{
    const char *env = getenv("FLASHATTN_BWD_LPT");
    char *end;
    const long g = env ? strtol(env, &end, 10) : -1;
    if (env && end != env && *end == '\0' && g >= 0 && g <= 64)
        return (int)g;
    const fa_lpt_shape s = {p->max_sq, p->max_sk, n_tiles, p->hk * p->b, (int)p->window_left,
                            (int)p->window_right, plan->bm, plan->bn, (int)(p->h / p->hk),
                            (int)p->d, (int)p->dv, sms};
    return fa_plan_backward_lpt_groups(&s);
}

/* Launches `entry` of plan's module with the parameter block (and, when tm is not NULL, the
 * tensor maps after it). */
static fa_status fa_bwd_launch(const fa_cuda_driver *d, const fa_plan *plan, fa_cu_context ctx,
                               const char *entry, unsigned gx, unsigned gy, unsigned gz,
                               unsigned threads, unsigned smem, fa_cu_stream stream,
                               fa_bkparams *bp, fa_bwd_tmaps *tm)
{
    fa_cu_function fn;
    fa_status st = fa_jit_function(plan, ctx, entry, &fn);
    if (st != FA_STATUS_OK)
        return st;
    void *params[] = {bp, tm};
    fa_cu_result r = d->launch_kernel(fn, gx, gy, gz, threads, 1, 1, smem, stream, params, NULL);
    if (r != 0) {
        char what[64];
        snprintf(what, sizeof what, "launching %s", entry);
        return fa_cuda_error(r, what);
    }
    return FA_STATUS_OK;
}

/* The family the calling thread's last backward launched ("" before any). */
static _Thread_local const char *fa_cuda_bwd_family_used = "";

const char *fa_cuda_last_backward_family(void) { return fa_cuda_bwd_family_used; }

fa_status fa_cuda_backward(const fa_params *p, const fa_bwd_args *args)
{
    const fa_fwd_args *fwd = args->fwd;
    int arch = 0, smem_optin = 0;
    fa_status st = fa_cuda_device_arch(fwd->device, &arch, &smem_optin);
    if (st != FA_STATUS_OK)
        return st;
    if (p->b > 65535 || p->h > 65535 || p->max_sq > INT32_MAX / 2 || p->max_sk > INT32_MAX / 2)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "q: the CUDA backend takes at most 65535 sequences and heads and "
                            "2^30 rows per sequence");
    if (p->lse_dtype != FA_DTYPE_F32)
        return fa_error_set(FA_STATUS_UNSUPPORTED, "lse: the CUDA backward reads fp32 lse");

    fa_plan_key key;
    fa_plan plan;
    st = fa_bwd_plan(p, arch, &key, &plan);
    if (st != FA_STATUS_OK)
        return st;
    fa_bwd_tmaps tmaps, *tm = NULL;
    /* Both sm90 families (fa_bwd_sm90.cu, fa_bwd_sm90_wide.cu) read their tiles by TMA. */
    if (strncmp(plan.family, "fa_bwd_sm90", 11) == 0) {
        tm = &tmaps;
        if (fa_cuda_tmaps_encode(fa_cuda_driver_get(), p, plan.bm, plan.bn, &tm->q, &tm->k,
                                 &tm->v, &tm->dout) != 0) {
            tm = NULL;
            key.features |= FA_PLAN_NO_SM90;
            st = fa_plan_backward(&key, &plan);
            if (st != FA_STATUS_OK)
                return st;
            fa_bwd_plan_mods(p, &plan);
        }
    }
    if ((int)plan.smem > smem_optin)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "head_dim %lld: the backward needs %u bytes of shared memory, the "
                            "device gives %d",
                            (long long)p->d, plan.smem, smem_optin);
    /* The block mask's states of a CTA's key blocks over every query block (fa_bm_load) sit
     * behind the tiles: their bytes depend on the call, so the kernel is loaded allowing the
     * device's most, as the forward's. The sm90 kernel's copy of them follows its slots
     * (FA_BWD90_BM_META), which the plan's bytes count. */
    unsigned main_smem = plan.smem;
    if (p->mods.blocks.num.data) {
        const fa_mod_blocks *mb = &p->mods.blocks;
        const int64_t nq = (p->max_sq + mb->q_block - 1) / mb->q_block;
        int64_t tables;
        const int64_t bytes = fa_bwd_bm_bytes(p, &plan, &tables);
        if (bytes > smem_optin - (int64_t)plan.smem)
            return fa_error_set(FA_STATUS_UNSUPPORTED,
                                "block_mask: %lld query blocks of %lld rows need %lld bytes of "
                                "shared memory beside the backward's %u, the device gives %d; "
                                "use larger blocks",
                                (long long)nq, (long long)mb->q_block, (long long)bytes,
                                plan.smem, smem_optin);
        main_smem += (unsigned)bytes;
        plan.smem = (unsigned)smem_optin;
    }

    const fa_bwd_ws ws = fa_bwd_ws_layout(p, &plan);
    if (args->workspace_size < ws.total || (ws.total > 0 && !args->workspace))
        return fa_error_set(FA_STATUS_INVALID_ARGUMENT,
                            "workspace: the CUDA backward needs %zu bytes of device memory "
                            "(fa_attention_backward_workspace_size), got %zu at %p",
                            ws.total, args->workspace_size, args->workspace);
    if ((uintptr_t)args->workspace % FA_WS_ALIGN != 0)
        return fa_error_set(FA_STATUS_INVALID_ARGUMENT,
                            "workspace: must be %d-byte aligned, got %p", FA_WS_ALIGN,
                            args->workspace);

    fa_bkparams bp;
    memset(&bp, 0, sizeof bp);
    fa_kparams_fill(p, &bp.f);
    bp.dout = p->dout_data;
    bp.dq = p->dq_data;
    bp.dk = p->dk_data;
    bp.dv = p->dv_data;
    bp.dsinks = p->dsinks;
    char *base = (char *)args->workspace;
    bp.dq_accum = (float *)(base + ws.accum);
    bp.dsum = (float *)(base + ws.dsum);
    bp.lse2 = (float *)(base + ws.lse2);
    bp.sem = (int *)(base + ws.sem);
    bp.sched = (int *)(base + ws.sched);
    bp.bm_tabs = (unsigned char *)(base + ws.bm);
    bp.bm_stride = (int)ws.bm_stride;
    bp.do_bstride = p->do_bstride, bp.do_rstride = p->do_rstride, bp.do_hstride = p->do_hstride;
    bp.dq_bstride = p->dq_bstride, bp.dq_rstride = p->dq_rstride, bp.dq_hstride = p->dq_hstride;
    bp.dk_bstride = p->dk_bstride, bp.dk_rstride = p->dk_rstride, bp.dk_hstride = p->dk_hstride;
    bp.dv_bstride = p->dv_bstride, bp.dv_rstride = p->dv_rstride, bp.dv_hstride = p->dv_hstride;
    bp.dsinks_stride = p->dsinks_stride;
    bp.m_tiles = (int)((p->max_sq + plan.bm - 1) / plan.bm);
    bp.n_tiles = (int)((p->max_sk + plan.bn - 1) / plan.bn);
    bp.deterministic = args->deterministic != 0;
    /* The sm90 kernel takes its work items one per CTA in blockIdx order, or, on a grid of one
     * CTA per multiprocessor, claims them in the same order from a counter (fa_bwd_pre zeroes
     * it): a CTA's dK/dV stores then overlap its next item's K/V load. Not in deterministic
     * mode (its ordered adds wait on other CTAs, which must all be running or done) nor varlen
     * (its items past a sequence take another path). With a block mask, fa_bwd_bm_tables
     * builds every item's states first, and the producer copies an item's with its K and V. */
    const int64_t items = (int64_t)bp.n_tiles * p->hk * p->b;
    const int64_t sms = tm ? fa_cuda_device_sms(fwd->device) : 0;
    bp.persistent = tm && !bp.deterministic && !p->is_varlen && bp.m_tiles > 0 && sms > 0 &&
                    sms < items;
    /* With a right window edge (causal) a pair's key block 0 has the most query tiles and the
     * last block the fewest: claimed key blocks fastest, the last pairs' long items start when
     * the grid is nearly drained and run on alone. Longest first over chunks of pairs instead
     * (fa_bwd_lpt_groups). */
    bp.lpt_groups = bp.lpt_items = 0;
    if (bp.persistent && p->window_right >= 0) {
        bp.lpt_groups = fa_bwd_lpt_groups(p, &plan, bp.n_tiles, (int)sms);
        bp.lpt_items = bp.lpt_groups * bp.n_tiles;
    }

    fa_cu_context ctx;
    int pushed;
    st = fa_cuda_context_enter(fwd->device, &ctx, &pushed);
    if (st != FA_STATUS_OK)
        return st;
    const fa_cuda_driver *d = fa_cuda_driver_get();
    fa_cu_stream stream = (fa_cu_stream)fwd->stream;
    const unsigned b = (unsigned)p->b, h = (unsigned)p->h, hk = (unsigned)p->hk;
    /* fa_bwd_fill: one thread per (row, head) of q and of k, a grid-stride loop past 2^20 CTAs. */
    const int64_t pairs_q = p->total_q * p->h, pairs_k = p->total_k * p->hk;
    const int64_t fill_ctas = ((pairs_q > pairs_k ? pairs_q : pairs_k) + 255) / 256;
    if (p->is_varlen && fill_ctas > 0)
        st = fa_bwd_launch(d, &plan, ctx, "fa_bwd_fill",
                           (unsigned)(fill_ctas < (1 << 20) ? fill_ctas : 1 << 20), 1, 1, 256, 0,
                           stream, &bp, NULL);
    if (st == FA_STATUS_OK && bp.m_tiles > 0)
        st = fa_bwd_launch(d, &plan, ctx, "fa_bwd_pre", (unsigned)bp.m_tiles, h, b, plan.threads,
                           0, stream, &bp, NULL);
    const int64_t aux_ctas = fa_bwd_aux_ctas(p);
    if (st == FA_STATUS_OK && aux_ctas > 0)
        st = fa_bwd_launch(d, &plan, ctx, "fa_bwd_aux_zero", (unsigned)aux_ctas, 1, 1, 256, 0,
                           stream, &bp, NULL);
    if (st == FA_STATUS_OK && tm && ws.bm_tables > 0)
        st = fa_bwd_launch(d, &plan, ctx, "fa_bwd_bm_tables", (unsigned)ws.bm_tables, 1, 1,
                           plan.threads, 0, stream, &bp, NULL);
    if (st == FA_STATUS_OK && bp.n_tiles > 0)
        st = bp.persistent ? fa_bwd_launch(d, &plan, ctx, "fa_bwd", (unsigned)sms, 1, 1,
                                           plan.threads, main_smem, stream, &bp, tm)
                           : fa_bwd_launch(d, &plan, ctx, "fa_bwd", (unsigned)bp.n_tiles, hk, b,
                                           plan.threads, main_smem, stream, &bp, tm);
    if (st == FA_STATUS_OK && p->dsinks)
        st = fa_bwd_launch(d, &plan, ctx, "fa_bwd_dsinks", h, 1, 1, 256, 0, stream, &bp, NULL);
    /* fa_bwd_convert: per (head, sequence), 8 warps per CTA, one 16 x 32 stripe of the
     * accumulator per warp at a time. */
    const int64_t stripes = (int64_t)bp.m_tiles * (plan.bm / 16) * (plan.dp / 32);
    if (st == FA_STATUS_OK && stripes > 0) {
        const int64_t gx = (stripes + 7) / 8;
        st = fa_bwd_launch(d, &plan, ctx, "fa_bwd_convert", (unsigned)(gx > 65535 ? 65535 : gx),
                           h, b, 256, 0, stream, &bp, NULL);
    }
    if (st == FA_STATUS_OK)
        fa_cuda_bwd_family_used = plan.family;
    fa_cuda_context_leave(pushed);
    return st;
}
