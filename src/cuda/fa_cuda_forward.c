/*
 * The forward on a CUDA device: plan the kernel, fetch it from the JIT, fill the kernel's
 * parameter block from the validated fa_params, launch on the caller's stream.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fa_kparams.h"
#include "fa_rules.h"
#include "fa_smem.h"
#include "core/fa_fp8.h"
#include "cuda/fa_cuda.h"
#include "cuda/fa_jit.h"
#include "core/fa_philox.h"

#define FA_PROBS_WARPS 4

/* The sm90 kernel's second parameter (fa_tmaps in kernels/fa_fwd_sm90.cu): Q, K, V maps,
 * whether the grid's work units are mirrored pairs of query tiles, dropout's round keys. */
typedef struct fa_cuda_tmaps {
    fa_cu_tensor_map q, k, v;
    int paired;
    uint32_t philox_keys[2 * FA_RULE_PHILOX_ROUNDS];
} fa_cuda_tmaps;

/* The driver's encoding of fa_cuda_tmap's map (below). */
static int fa_cuda_tmap_encode(const fa_cuda_driver *d, fa_cu_tensor_map *map, fa_dtype dt,
                               const void *ptr, int64_t dim, int64_t rows, int64_t heads,
                               int64_t batch, int64_t rstride, int64_t hstride, int64_t bstride,
                               int box_rows)
{
    unsigned long long dims[4] = {(unsigned long long)dim, (unsigned long long)rows,
                                  (unsigned long long)heads, (unsigned long long)batch};
    /* A dimension of extent 1 never steps: any legal stride will do for it. */
    int64_t st[3] = {rows > 1 ? rstride : dim, heads > 1 ? hstride : dim,
                     batch > 1 ? bstride : dim};
    unsigned long long strides[3];
    for (int i = 0; i < 3; i++) {
        if (st[i] <= 0)
            return 1;
        strides[i] = (unsigned long long)st[i] * 2;
    }
    unsigned box[4] = {64, (unsigned)box_rows, 1, 1}, es[4] = {1, 1, 1, 1};
    return d->tensor_map_encode_tiled(map,
                                      dt == FA_DTYPE_BF16 ? FA_CU_TENSOR_MAP_BFLOAT16
                                                          : FA_CU_TENSOR_MAP_FLOAT16,
                                      4, (void *)ptr, dims, strides, box, es, 0,
                                      FA_CU_TENSOR_MAP_SWIZZLE_128B,
                                      FA_CU_TENSOR_MAP_L2_PROMOTION_128B, 0) != 0;
}

/* Everything a tensor map of fa_cuda_tmap is made of. The driver's encoding is a pure function
 * of it, and a call of the library needs three or four maps (host work in the driver each
 * time), so each thread keeps its last few: a repeated call (same tensors, as in a training or
 * decoding loop that reuses its buffers) encodes none. */
typedef struct fa_tmap_key {
    const void *ptr;
    int64_t dim, rows, heads, batch, rstride, hstride, bstride;
    int64_t box_rows, dtype;
} fa_tmap_key;

#define FA_TMAP_CACHE 8
static _Thread_local struct {
    fa_tmap_key key[FA_TMAP_CACHE];
    fa_cu_tensor_map map[FA_TMAP_CACHE];
    int used, next;
} fa_tmap_cache;

/* A rank-4 tensor map {d, rows, heads, batch} over a [b, rows, heads, d] view with element
 * strides (bstride, rstride, hstride): 128B swizzle, box {64, box_rows, 1, 1}, zero fill out of
 * bounds. Nonzero when the driver refuses it (strides TMA cannot take). */
static int fa_cuda_tmap(const fa_cuda_driver *d, fa_cu_tensor_map *map, fa_dtype dt,
                        const void *ptr, int64_t dim, int64_t rows, int64_t heads, int64_t batch,
                        int64_t rstride, int64_t hstride, int64_t bstride, int box_rows)
{
    /* Every field set (no padding: eight-byte members only), so memcmp compares keys. */
    const fa_tmap_key key = {ptr,     dim,     rows,    heads,    batch,
                             rstride, hstride, bstride, box_rows, (int64_t)dt};
    for (int i = 0; i < fa_tmap_cache.used; i++)
        if (memcmp(&fa_tmap_cache.key[i], &key, sizeof key) == 0) {
            *map = fa_tmap_cache.map[i];
            return 0;
        }
    if (fa_cuda_tmap_encode(d, map, dt, ptr, dim, rows, heads, batch, rstride, hstride, bstride,
                            box_rows) != 0)
        return 1;
    const int slot = fa_tmap_cache.next;
    fa_tmap_cache.next = (slot + 1) % FA_TMAP_CACHE;
    fa_tmap_cache.used += fa_tmap_cache.used < FA_TMAP_CACHE;
    fa_tmap_cache.key[slot] = key;
    fa_tmap_cache.map[slot] = *map;
    return 0;
}

int fa_cuda_tmaps_encode(const fa_cuda_driver *d, const fa_params *p, int bm, int bn,
                         fa_cu_tensor_map *q, fa_cu_tensor_map *k, fa_cu_tensor_map *v,
                         fa_cu_tensor_map *dout)
{
    /* TMA coordinates are ints: packed varlen rows past them are not described. */
    if (!d || !d->tensor_map_encode_tiled ||
        (p->is_varlen && (p->total_q > INT32_MAX / 2 || p->total_k > INT32_MAX / 2)))
        return 1;
    /* Varlen: one "sequence" of all the packed rows; tiles add their sequence's offset. */
    const int vl = p->is_varlen;
    const int64_t rows_q = vl ? p->total_q : p->max_sq, rows_k = vl ? p->total_k : p->max_sk;
    const int64_t b = vl ? 1 : p->b;
    return fa_cuda_tmap(d, q, p->dtype, p->q, p->d, rows_q, p->h, b, p->q_rstride, p->q_hstride,
                        p->q_bstride, bm) ||
           fa_cuda_tmap(d, k, p->dtype, p->k, p->d, rows_k, p->hk, b, p->k_rstride,
                        p->k_hstride, p->k_bstride, bn) ||
           fa_cuda_tmap(d, v, p->dtype, p->v, p->dv, rows_k, p->hk, b, p->v_rstride,
                        p->v_hstride, p->v_bstride, bn) ||
           (dout && fa_cuda_tmap(d, dout, p->dtype, p->dout_data, p->dv, rows_q, p->h, b,
                                 p->do_rstride, p->do_hstride, p->do_bstride, bm));
}

/* The family the calling thread's last forward launched ("" before any). */
static _Thread_local const char *fa_cuda_family_used = "";

const char *fa_cuda_last_family(void) { return fa_cuda_family_used; }

static fa_status fa_cuda_launch(const fa_cuda_driver *d, fa_cu_function fn, unsigned gx,
                                unsigned gy, unsigned gz, unsigned threads, unsigned smem,
                                fa_cu_stream stream, fa_kparams *kp, const char *what)
{
    void *params[] = {kp};
    fa_cu_result r = d->launch_kernel(fn, gx, gy, gz, threads, 1, 1, smem, stream, params, NULL);
    return r == 0 ? FA_STATUS_OK : fa_cuda_error(r, what);
}

static fa_status fa_cuda_forward_planned(const fa_params *p, const fa_fwd_args *args,
                                         const fa_plan *planp, fa_cuda_tmaps *tmaps,
                                         int smem_optin);

/* The shared memory a block mask adds to plan's (0 without one): in the sm80 family the states
 * of a tile's query blocks behind the tiles and their live-block lookup (FA_SMEM_BM_FWD), in the
 * sm90 family two buffers of states with the lists of the key blocks to visit and their
 * mbarriers (FA_SMEM_FWD90_BM). */
static int64_t fa_cuda_forward_bm_bytes(const fa_params *p, const fa_plan *plan)
{
    const fa_mod_blocks *b = &p->mods.blocks;
    if (!b->num.data)
        return 0;
    if (strcmp(plan->family, "fa_fwd_sm90.cu") == 0)
        return FA_SMEM_FWD90_BM((int64_t)plan->bm, plan->bn, b->q_block, b->nk, p->max_sk);
    return FA_SMEM_BM_FWD((int64_t)plan->bm, b->q_block, b->nk);
}

/* Whether every element the block mask's tensors hold for the call's sequences and heads lies
 * within 2^30 elements of the tensor's start (one past a list's end too): the sm90 family's
 * list builder (fa_fwd_sm90_mod.cuh) indexes them with ints, its warp having few registers. */
static int fa_cuda_forward_bm_int(const fa_params *p)
{
    const fa_mod_blocks *b = &p->mods.blocks;
    const fa_tensor *t[4] = {&b->num, &b->idx, &b->full_num, &b->full_idx};
    for (int i = 0; i < 4; i++) {
        if (!t[i]->data)
            continue;
        int64_t span = 0;
        for (int d = 0; d < t[i]->ndim; d++) {
            const int64_t last = d == 0 ? p->b - 1 : d == 1 ? p->h - 1 : t[i]->shape[d] + 32;
            const int64_t st = t[i]->stride[d] < 0 ? -t[i]->stride[d] : t[i]->stride[d];
            span += (last > 0 ? last : 0) * st;
        }
        if (span >= (int64_t)1 << 30)
            return 0;
    }
    return 1;
}

/* Dense: one length for every sequence, no block mask. */
static int fa_cuda_forward_dense(const fa_params *p)
{
    return !p->is_varlen && !p->mods.blocks.num.data;
}

/* Every row of every sequence sees every key (dense; no causal or window): the query tiles are
 * of equal work. */
static int fa_cuda_forward_uniform(const fa_params *p)
{
    return p->window_left < 0 && p->window_right < 0 && fa_cuda_forward_dense(p);
}

/* A long call (FA_PLAN_LONG, src/plan/fa_plan.h): many query rows, or fewer where the tiles are
 * of equal work or dense causal. */
static int fa_cuda_forward_long(const fa_params *p)
{
    const int dense_causal = p->causal && p->window_left < 0 && fa_cuda_forward_dense(p);
    return p->max_sq >= FA_PLAN_LONG_ROWS ||
           (fa_cuda_forward_uniform(p) && p->max_sq >= FA_PLAN_LONG_ROWS_UNMASKED) ||
           (dense_causal && p->max_sq >= FA_PLAN_LONG_ROWS_CAUSAL);
}

fa_status fa_cuda_forward(const fa_params *p, const fa_fwd_args *args)
{
    int arch = 0, smem_optin = 0;
    fa_status st = fa_cuda_device_arch(args->device, &arch, &smem_optin);
    if (st != FA_STATUS_OK)
        return st;
    if (p->b > 65535 || p->h > 65535 || p->max_sq > INT32_MAX / 2 || p->max_sk > INT32_MAX / 2 ||
        p->probs_sq > INT32_MAX / 2)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "q: the CUDA backend takes at most 65535 sequences and heads and "
                            "2^30 rows per sequence");
    if (p->paged && p->page_size > INT32_MAX / 2)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "k: the CUDA backend takes pages of at most 2^30 keys, got %lld",
                            (long long)p->page_size);
    if (p->probs && p->probs_block_n > 128)
        return fa_error_set(FA_STATUS_INTERNAL, "probs block width %d over 128",
                            p->probs_block_n);
    /* fp8 reaches a device unless FLASHATTN_SM90_FP8=0 (fa_params refuses it then). */
    if (fa_dtype_is_fp8(p->dtype)) {
        st = fa_cuda_forward_fp8(p, args, arch, smem_optin);
        if (st == FA_STATUS_OK)
            fa_cuda_family_used = "fa_fwd_sm90_fp8.cu";
        return st;
    }
    if (fa_cuda_forward_decodes(p)) {
        st = fa_cuda_forward_decode(p, args);
        if (st == FA_STATUS_OK)
            fa_cuda_family_used = fa_cuda_decode_last_family();
        return st;
    }

    fa_plan_key key = {arch, p->dtype, (int)p->d, (int)p->dv, 0, 0, 0, 0};
    key.features |= p->is_varlen ? FA_FEATURE_VARLEN : 0;
    key.features |= p->alibi_slopes ? FA_FEATURE_ALIBI : 0;
    key.features |= p->softcap > 0 ? FA_FEATURE_SOFTCAP : 0;
    key.features |= p->dropout_p > 0 ? FA_FEATURE_DROPOUT : 0;
    key.features |= fa_cuda_rows_aligned(p) ? 0 : FA_FEATURE_UNALIGNED;
    key.features |= p->probs ? FA_PLAN_PROBS : 0;
    key.features |= fa_cuda_forward_long(p) ? FA_PLAN_LONG : 0;
    /* Paged k and v: the sm80 family's loads look each row's page up (FA_PAGED); on sm_90 it
     * takes them for now, the sm90 family's TMA maps describing a dense layout only. */
    key.features |= p->paged ? FA_PLAN_PAGED : 0;
    /* User-defined scoring: the sm80 family compiles the programs in (the plan's defines; their
     * text travels in the plan, fa_cuda_forward_planned). */
    fa_kparams_key_mods(p, &key);
    fa_plan plan;
    st = fa_plan_forward(&key, &plan);
    if (st != FA_STATUS_OK)
        return st;
    /* The sm90 family reads through TMA tensor maps and numbers its tiles with an int; tensors
     * the driver cannot describe, or more tiles, go to the sm80 family (never a wrong answer), as
     * do block masks whose buffers do not fit beside its tiles or whose tensors are huge. */
    const int sm90 = strcmp(plan.family, "fa_fwd_sm90.cu") == 0;
    fa_cuda_tmaps tmaps;
    if (sm90 && ((p->max_sq + plan.bm - 1) / plan.bm * p->h * p->b > INT32_MAX ||
                 plan.smem + fa_cuda_forward_bm_bytes(p, &plan) > (int64_t)smem_optin ||
                 !fa_cuda_forward_bm_int(p) ||
                 fa_cuda_tmaps_encode(fa_cuda_driver_get(), p, plan.bm, plan.bn, &tmaps.q,
                                      &tmaps.k, &tmaps.v, NULL) != 0)) {
        key.features |= FA_PLAN_NO_SM90;
        st = fa_plan_forward(&key, &plan);
        if (st != FA_STATUS_OK)
            return st;
        return fa_cuda_forward_planned(p, args, &plan, NULL, smem_optin);
    }
    return fa_cuda_forward_planned(p, args, &plan, sm90 ? &tmaps : NULL, smem_optin);
}

/* Launches plan (tmaps: the sm90 family's tensor maps, else NULL). */
static fa_status fa_cuda_forward_planned(const fa_params *p, const fa_fwd_args *args,
                                         const fa_plan *planp, fa_cuda_tmaps *tmaps,
                                         int smem_optin)
{
    fa_status st = FA_STATUS_OK;
    fa_plan plan = *planp;
    if ((int)plan.smem > smem_optin)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "head_dim %lld: the kernel needs %u bytes of shared memory, the device "
                            "gives %d",
                            (long long)p->d, plan.smem, smem_optin);
    plan.score_mod = p->mods.score_mod ? p->mods.score_mod->cuda : NULL;
    plan.mask_mod = p->mods.mask_mod ? p->mods.mask_mod->cuda : NULL;
    /* The block mask's states of a tile's query blocks (fa_bm_load) sit behind the tiles: their
     * bytes depend on the call, so the kernel is loaded allowing the device's most. */
    unsigned smem = plan.smem;
    if (p->mods.blocks.num.data) {
        const fa_mod_blocks *b = &p->mods.blocks;
        const int64_t bytes = fa_cuda_forward_bm_bytes(p, &plan);
        if (bytes > smem_optin - (int64_t)plan.smem)
            return fa_error_set(FA_STATUS_UNSUPPORTED,
                                "block_mask: %lld key blocks of %lld keys need %lld bytes of "
                                "shared memory beside the kernel's %u, the device gives %d; use "
                                "larger blocks",
                                (long long)b->nk, (long long)b->kv_block, (long long)bytes,
                                plan.smem, smem_optin);
        smem += (unsigned)bytes;
        plan.smem = (unsigned)smem_optin;
    }

    fa_cu_context ctx;
    int pushed;
    st = fa_cuda_context_enter(args->device, &ctx, &pushed);
    if (st != FA_STATUS_OK)
        return st;
    const fa_cuda_driver *d = fa_cuda_driver_get();
    fa_cu_stream stream = (fa_cu_stream)args->stream;
    fa_kparams kp;
    fa_kparams_fill(p, &kp);
    fa_cu_function fn;

    if (p->is_varlen && p->total_q > 0) {
        st = fa_jit_function(&plan, ctx, "fa_fwd_fill", &fn);
        int64_t n = p->total_q * p->h;
        if (st == FA_STATUS_OK)
            st = fa_cuda_launch(d, fn, (unsigned)((n + 255) / 256), 1, 1, 256, 0, stream, &kp,
                                "launching fa_fwd_fill");
    }
    unsigned m_blocks = (unsigned)((p->max_sq + plan.bm - 1) / plan.bm);
    if (st == FA_STATUS_OK && m_blocks > 0) {
        st = fa_jit_function(&plan, ctx, "fa_fwd", &fn);
        if (st == FA_STATUS_OK && tmaps) {
            /* A 1-D grid over the work units (fa_cuda_forward checked the tiles fit an int).
             * Persistent CTAs stride over the units statically, which balances only units of
             * equal work: tiles without causal, window, varlen or a block mask (plan.persistent
             * 1; mask_mod alone visits every block), or, with plan.persistent 2, the mirrored
             * tile pairs of causal, windowed and block-masked calls (a mask's kept blocks mostly
             * grow or shrink with the row, as causal's), whose
             * work adds up to about the same, up to FA_SM90_PAIRED_MAX_TILES tiles for causal
             * calls (beyond, the static stride's last round costs more than the pairs save), at
             * any count for block-masked calls and windows bounded on the left, whose few blocks
             * a tile leave its fixed cost to hide behind the previous tile's work. Otherwise one
             * CTA per tile and the hardware's own dispatch, which balances unequal tiles far
             * better than a static stride. */
            const int64_t sms = fa_cuda_device_sms(args->device);
            const int uniform = fa_cuda_forward_uniform(p);
            const int any_count =
                plan.persistent == 3 || p->window_left >= 0 || p->mods.blocks.num.data;
            tmaps->paired = plan.persistent >= 2 && !uniform && !p->is_varlen &&
                            (m_blocks <= FA_SM90_PAIRED_MAX_TILES || any_count);
            const int persistent = uniform ? plan.persistent >= 1 : tmaps->paired;
            fa_philox_keys(p->seed, tmaps->philox_keys);
            const int64_t units =
                (tmaps->paired ? (m_blocks + 1) / 2 : m_blocks) * (int64_t)p->h * p->b;
            unsigned grid = (unsigned)(persistent && sms > 0 && sms < units ? sms : units);
            void *params[] = {&kp, tmaps};
            fa_cu_result r = d->launch_kernel(fn, grid, 1, 1, plan.threads, 1, 1, smem, stream,
                                              params, NULL);
            st = r == 0 ? FA_STATUS_OK : fa_cuda_error(r, "launching fa_fwd (sm90)");
        } else if (st == FA_STATUS_OK) {
            st = fa_cuda_launch(d, fn, m_blocks, (unsigned)p->h, (unsigned)p->b, plan.threads,
                                smem, stream, &kp, "launching fa_fwd");
        }
        if (st == FA_STATUS_OK)
            fa_cuda_family_used = plan.family;
    }
    if (st == FA_STATUS_OK && p->probs && p->probs_sq > 0) {
        st = fa_jit_function(&plan, ctx, "fa_fwd_probs", &fn);
        unsigned rows = (unsigned)((p->probs_sq + FA_PROBS_WARPS - 1) / FA_PROBS_WARPS);
        if (st == FA_STATUS_OK)
            st = fa_cuda_launch(d, fn, rows, (unsigned)p->h, (unsigned)p->b, 32 * FA_PROBS_WARPS,
                                0, stream, &kp, "launching fa_fwd_probs");
    }
    fa_cuda_context_leave(pushed);
    return st;
}

/* The decode kernels of a precompile configuration (a one-row tile, contiguous and paged caches;
 * a varlen configuration's few-row forward), wide heads (wide) also with v k's column prefix
 * (MLA's cache), and the combine for the dtype; *cached (where given) stays 1 only if each was
 * found cached. */
static fa_status fa_cuda_precompile_decode(const fa_plan_key *key, int wide, int *cached)
{
    fa_status st = FA_STATUS_OK;
    const int npaged = key->features & FA_FEATURE_VARLEN ? 1 : 2;
    const int layouts = npaged * (wide ? 2 : 1);
    for (int i = 0; i < layouts && st == FA_STATUS_OK; i++) {
        fa_plan_key kd = *key;
        kd.features |= i % npaged ? FA_PLAN_PAGED : 0;
        kd.features |= i >= npaged ? FA_PLAN_V_IN_K : 0;
        fa_plan pd;
        fa_jit_origin origin = FA_JIT_COMPILED;
        st = fa_plan_decode(&kd, 1, &pd);
        if (st == FA_STATUS_OK)
            st = fa_jit_precompile(&pd, &origin);
        if (st == FA_STATUS_OK && i == layouts - 1) {
            st = fa_plan_combine(key, &pd);
            if (st == FA_STATUS_OK)
                st = fa_jit_precompile(&pd, &origin);
        }
        if (cached)
            *cached = *cached && st == FA_STATUS_OK && origin != FA_JIT_COMPILED;
    }
    return st;
}

FA_API fa_status fa_cuda_precompile(int arch, fa_dtype dtype, int head_dim, int head_dim_v,
                                    unsigned features, int *cached)
{
    fa_plan_key key = {arch, dtype, head_dim, head_dim_v, features, 0, 0, 0};
    fa_plan plan;
    fa_status st;
    /* No call runs such a kernel (fa_params.c refuses dropout beside softcap). */
    if ((features & FA_FEATURE_DROPOUT) && (features & FA_FEATURE_SOFTCAP))
        return fa_error_set(FA_STATUS_INVALID_ARGUMENT,
                            "features: dropout cannot be combined with softcap (no call takes "
                            "both)");
    /* fp8: the sm90 fp8 kernel only (FLASHATTN_SM90_FP8 or not), bf16 and fp16 outputs, dense
     * ones also with V^T from the workspace. */
    if (fa_dtype_is_fp8(dtype)) {
        fa_jit_origin origin = FA_JIT_COMPILED;
        int done = 1;
        st = FA_STATUS_OK;
        const int variants = features & FA_FEATURE_VARLEN ? 2 : 4;
        for (int i = 0; i < variants && st == FA_STATUS_OK; i++) {
            key.features = features | (i & 1 ? FA_PLAN_OUT_F16 : 0) | (i & 2 ? FA_PLAN_FP8_VT : 0);
            st = fa_plan_forward_sm90_fp8(&key, &plan);
            if (st == FA_STATUS_OK)
                st = fa_jit_precompile(&plan, &origin);
            done = done && st == FA_STATUS_OK && origin != FA_JIT_COMPILED;
        }
        if (cached)
            *cached = done;
        if (st == FA_STATUS_OK)
            fa_error_clear();
        return st;
    }
    /* Features the decode kernels compile (the others run on the tiled families alone). */
    const unsigned decode_features =
        FA_FEATURE_VARLEN | FA_FEATURE_ALIBI | FA_FEATURE_SOFTCAP | FA_FEATURE_UNALIGNED;
    /* Heads past FA_CUDA_MAX_HEAD_DIM run the decode kernels alone (fa_plan_cuda_decodes). */
    if (head_dim > FA_CUDA_MAX_HEAD_DIM || head_dim_v > FA_CUDA_MAX_HEAD_DIM) {
        if (features & ~decode_features)
            return fa_error_set(FA_STATUS_UNSUPPORTED,
                                "head_dim %d / %d: CUDA devices take heads past %d on the decode "
                                "schedule alone, without dropout",
                                head_dim, head_dim_v, FA_CUDA_MAX_HEAD_DIM);
        if (cached)
            *cached = 1;
        st = fa_cuda_precompile_decode(&key, 1, cached);
        if (st == FA_STATUS_OK)
            fa_error_clear();
        return st;
    }
    st = fa_plan_forward(&key, &plan);
    if (st != FA_STATUS_OK)
        return st;
    fa_jit_origin origin;
    st = fa_jit_precompile(&plan, &origin);
    if (cached)
        *cached = st == FA_STATUS_OK && origin != FA_JIT_COMPILED;
    /* On sm_90 also the sm90 family's kernel for the cases it supports (FLASHATTN_SM90=0 or not),
     * so CI compiles it. */
    fa_plan plan90;
    if (st == FA_STATUS_OK && fa_plan_forward_sm90(&key, &plan90) == FA_STATUS_OK &&
        strcmp(plan.family, plan90.family) != 0) {
        st = fa_jit_precompile(&plan90, &origin);
        if (cached)
            *cached = *cached && st == FA_STATUS_OK && origin != FA_JIT_COMPILED;
    }
    /* and its plan for long calls where that differs (fa_jit_precompile finds it cached if not). */
    fa_plan_key long_key = key;
    long_key.features |= FA_PLAN_LONG;
    if (st == FA_STATUS_OK && fa_plan_forward_sm90(&long_key, &plan90) == FA_STATUS_OK) {
        st = fa_jit_precompile(&plan90, &origin);
        if (cached)
            *cached = *cached && st == FA_STATUS_OK && origin != FA_JIT_COMPILED;
    }
    /* The backward's kernels of the same configuration where the backward families take it:
     * the sm80 one (deterministic calls run it on sm_90 too), then the sm90 one. */
    fa_plan planb;
    fa_plan_key key80 = key;
    key80.features |= FA_PLAN_NO_SM90;
    if (st == FA_STATUS_OK && key.d <= FA_BWD_MAX_HEAD_DIM && key.dv <= FA_BWD_MAX_HEAD_DIM &&
        fa_plan_backward(&key80, &planb) == FA_STATUS_OK) {
        st = fa_jit_precompile(&planb, &origin);
        if (cached)
            *cached = *cached && st == FA_STATUS_OK && origin != FA_JIT_COMPILED;
    }
    if (st == FA_STATUS_OK && fa_plan_backward_sm90(&key, &planb) == FA_STATUS_OK) {
        st = fa_jit_precompile(&planb, &origin);
        if (cached)
            *cached = *cached && st == FA_STATUS_OK && origin != FA_JIT_COMPILED;
    }
    if (st == FA_STATUS_OK && !(features & ~decode_features))
        st = fa_cuda_precompile_decode(&key, 0, cached);
    if (st == FA_STATUS_OK)
        fa_error_clear();
    return st;
}
