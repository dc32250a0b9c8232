/*
 * The fp8 forward on a CUDA device (kernels/fa_fwd_sm90_fp8.cu; FLASHATTN_SM90_FP8=0 refuses
 * it): plan, tensor maps of one-byte elements, the descales, the launch on the caller's stream.
 * Dense calls where the plan wants it (fa_plan_fp8_vt) and the caller gave the workspace first
 * write V^T there (fa_fwd_vt), which the kernel then reads by TMA. No host synchronisation and
 * no device allocation. What the kernel cannot do is refused naming the argument: no other CUDA
 * family computes fp8.
 */
#include <stdint.h>
#include <string.h>

#include "fa_kparams.h"
#include "fa_smem.h"
#include "core/fa_error.h"
#include "core/fa_fp8.h"
#include "cuda/fa_cuda.h"
#include "cuda/fa_cuda_driver.h"
#include "cuda/fa_jit.h"
#include "plan/fa_plan.h"

#define FA_CU_TENSOR_MAP_UINT8 0
#define FA_CU_TENSOR_MAP_SWIZZLE_64B 2

/* The kernel's second parameter (fa_tmaps8 in kernels/fa_fwd_sm90_fp8.cu), the same layout. */
typedef struct fa_cuda_tmaps8 {
    fa_cu_tensor_map q, k, v;
    const float *q_descale, *k_descale, *v_descale;
    int64_t qd_bstride, qd_hstride, kd_bstride, kd_hstride, vd_bstride, vd_hstride;
    int paired;
} fa_cuda_tmaps8;

/* A rank-4 map {cols, rows, heads, batch} of one-byte elements over a [b, rows, heads, cols]
 * view (element strides = bytes), box {box_cols, box_rows, 1, 1}, zero fill out of bounds.
 * Nonzero when the driver refuses it (TMA wants strides that are multiples of 16 bytes). */
static int fa_tmap8(const fa_cuda_driver *d, fa_cu_tensor_map *map, const void *ptr, int64_t cols,
                    int64_t rows, int64_t heads, int64_t batch, int64_t rstride, int64_t hstride,
                    int64_t bstride, int box_cols, int box_rows, int swizzle)
{
    unsigned long long dims[4] = {(unsigned long long)cols, (unsigned long long)rows,
                                  (unsigned long long)heads, (unsigned long long)batch};
    /* A dimension of extent 1 never steps: any legal stride will do for it. */
    const int64_t st[3] = {rows > 1 ? rstride : 16 * ((cols + 15) / 16),
                           heads > 1 ? hstride : 16 * ((cols + 15) / 16),
                           batch > 1 ? bstride : 16 * ((cols + 15) / 16)};
    unsigned long long strides[3];
    for (int i = 0; i < 3; i++) {
        if (st[i] <= 0)
            return 1;
        strides[i] = (unsigned long long)st[i];
    }
    unsigned box[4] = {(unsigned)box_cols, (unsigned)box_rows, 1, 1}, es[4] = {1, 1, 1, 1};
    return d->tensor_map_encode_tiled(map, FA_CU_TENSOR_MAP_UINT8, 4, (void *)ptr, dims, strides,
                                      box, es, 0, swizzle, FA_CU_TENSOR_MAP_L2_PROMOTION_128B,
                                      0) != 0;
}

/* Q, K and V in rows of 128 bytes (64 at d 64) with the swizzle of that width: the kernel's wgmma
 * descriptors read Q and K so, its producer transposes V from it (the swizzle spreads the
 * transpose's reads over the banks). */
static int fa_tmaps8_encode(const fa_cuda_driver *d, const fa_params *p, const fa_plan *plan,
                            fa_cuda_tmaps8 *t)
{
    if (!d || !d->tensor_map_encode_tiled ||
        (p->is_varlen && (p->total_q > INT32_MAX / 2 || p->total_k > INT32_MAX / 2)))
        return 1;
    const int vl = p->is_varlen;
    const int64_t rows_q = vl ? p->total_q : p->max_sq, rows_k = vl ? p->total_k : p->max_sk;
    const int64_t b = vl ? 1 : p->b;
    const int rb = plan->dp < 128 ? plan->dp : 128;
    const int sw = rb == 128 ? FA_CU_TENSOR_MAP_SWIZZLE_128B : FA_CU_TENSOR_MAP_SWIZZLE_64B;
    return fa_tmap8(d, &t->q, p->q, p->d, rows_q, p->h, b, p->q_rstride, p->q_hstride,
                    p->q_bstride, rb, plan->bm, sw) ||
           fa_tmap8(d, &t->k, p->k, p->d, rows_k, p->hk, b, p->k_rstride, p->k_hstride,
                    p->k_bstride, rb, plan->bn, sw) ||
           fa_tmap8(d, &t->v, p->v, p->dv, rows_k, p->hk, b, p->v_rstride, p->v_hstride,
                    p->v_bstride, rb, plan->bn, sw);
}

/* V^T in the workspace: [b][hk][dv][sk16], keys rounded up to 16 (TMA's 16-byte strides). */
static int64_t fa_vt_keys(const fa_params *p)
{
    return (p->max_sk + 15) / 16 * 16;
}

size_t fa_cuda_forward_fp8_workspace_size(const fa_params *p, int arch)
{
    /* Dense, long enough for whole 128-key boxes, rows of V the fa_fwd_vt loads can take 16
     * bytes at a time (else the TMA map of V refuses the call anyway). */
    const int64_t vs[3] = {p->v_rstride, p->v_hstride, p->v_bstride};
    int aligned = (uintptr_t)p->v % 16 == 0;
    for (int i = 0; i < 3; i++)
        aligned = aligned && vs[i] % 16 == 0;
    /* fa_fwd_vt's grid has a z of b * hk (at most 65535). */
    if (arch != 90 || !fa_dtype_is_fp8(p->dtype) || !fa_sm90_fp8_enabled() || p->is_varlen ||
        p->paged || p->max_sk < 128 || p->max_sq < 1 || p->b * p->hk > 65535 || !aligned)
        return 0;
    const int64_t rows = p->max_sq * (p->h / p->hk) / (p->causal ? 2 : 1);
    if (!fa_plan_fp8_vt((int)p->d, rows))
        return 0;
    const int64_t bytes = p->b * p->hk * p->dv * fa_vt_keys(p);
    return (size_t)(bytes + 255) / 256 * 256;
}

fa_status fa_cuda_forward_fp8(const fa_params *p, const fa_fwd_args *args, int arch,
                              int smem_optin)
{
    if (p->sinks)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "sinks: not supported with fp8 inputs on a CUDA device (the CPU "
                            "backend computes them)");
    const size_t vt_bytes = fa_cuda_forward_fp8_workspace_size(p, arch);
    const int vt = vt_bytes > 0 && args->workspace && args->workspace_size >= vt_bytes;
    fa_plan_key key = {arch, p->dtype, (int)p->d, (int)p->dv, 0, 0, 0, 0};
    key.features |= vt ? FA_PLAN_FP8_VT : 0;
    key.features |= p->is_varlen ? FA_FEATURE_VARLEN : 0;
    key.features |= p->alibi_slopes ? FA_FEATURE_ALIBI : 0;
    key.features |= p->softcap > 0 ? FA_FEATURE_SOFTCAP : 0;
    key.features |= p->dropout_p > 0 ? FA_FEATURE_DROPOUT : 0;
    key.features |= p->probs ? FA_PLAN_PROBS : 0;
    key.features |= p->paged ? FA_PLAN_PAGED : 0;
    key.features |= p->mods.score_mod ? FA_PLAN_SCORE_MOD : 0;
    key.features |= p->mods.mask_mod ? FA_PLAN_MASK_MOD : 0;
    key.features |= p->mods.blocks.num.data ? FA_PLAN_BLOCK_MASK : 0;
    key.features |= p->out_dtype == FA_DTYPE_F16 ? FA_PLAN_OUT_F16 : 0;
    fa_plan plan;
    FA_TRY(fa_plan_forward_sm90_fp8(&key, &plan));
    if ((int)plan.smem > smem_optin)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "head_dim %lld: the fp8 kernel needs %u bytes of shared memory, the "
                            "device gives %d",
                            (long long)p->d, plan.smem, smem_optin);
    const unsigned m_blocks = (unsigned)((p->max_sq + plan.bm - 1) / plan.bm);
    if ((int64_t)m_blocks * p->h * p->b > INT32_MAX)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "q: %lld query tiles are more than the fp8 kernel numbers",
                            (long long)m_blocks * p->h * p->b);
    const fa_cuda_driver *d = fa_cuda_driver_get();
    fa_cuda_tmaps8 tm;
    memset(&tm, 0, sizeof tm);
    if (fa_tmaps8_encode(d, p, &plan, &tm) != 0)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "q: the fp8 kernel reads q, k and v by TMA, which needs 16-byte "
                            "aligned data and row, head and batch strides that are multiples of "
                            "16 bytes");
    /* V^T: rows of sk16 keys, boxes of 128 keys by dv padded (the rows past dv read as zeros). */
    const int64_t sk16 = fa_vt_keys(p);
    if (vt && fa_tmap8(d, &tm.v, args->workspace, sk16, p->dv, p->hk, p->b, sk16, p->dv * sk16,
                       p->hk * p->dv * sk16, 128, plan.dvp, FA_CU_TENSOR_MAP_SWIZZLE_128B) != 0)
        return fa_error_set(FA_STATUS_INTERNAL, "workspace: the V^T tensor map was refused");
    tm.q_descale = p->q_descale, tm.k_descale = p->k_descale, tm.v_descale = p->v_descale;
    tm.qd_bstride = p->qd_bstride, tm.qd_hstride = p->qd_hstride;
    tm.kd_bstride = p->kd_bstride, tm.kd_hstride = p->kd_hstride;
    tm.vd_bstride = p->vd_bstride, tm.vd_hstride = p->vd_hstride;

    fa_cu_context ctx;
    int pushed;
    fa_status st = fa_cuda_context_enter(args->device, &ctx, &pushed);
    if (st != FA_STATUS_OK)
        return st;
    fa_cu_stream stream = (fa_cu_stream)args->stream;
    fa_kparams kp;
    fa_kparams_fill(p, &kp);
    fa_cu_function fn;
    if (p->is_varlen && p->total_q > 0) {
        st = fa_jit_function(&plan, ctx, "fa_fwd_fill", &fn);
        const int64_t n = p->total_q * p->h;
        void *params[] = {&kp};
        if (st == FA_STATUS_OK) {
            fa_cu_result r = d->launch_kernel(fn, (unsigned)((n + 255) / 256), 1, 1, 256, 1, 1,
                                              0, stream, params, NULL);
            st = r == 0 ? FA_STATUS_OK : fa_cuda_error(r, "launching fa_fwd_fill (fp8)");
        }
    }
    if (st == FA_STATUS_OK && m_blocks > 0 && vt) {
        st = fa_jit_function(&plan, ctx, "fa_fwd_vt", &fn);
        void *wsp = args->workspace;
        int64_t sk16_arg = sk16;
        void *params[] = {&kp, &wsp, &sk16_arg};
        if (st == FA_STATUS_OK) {
            fa_cu_result r = d->launch_kernel(
                fn, (unsigned)((sk16 + FA_FP8_VT_KEYS - 1) / FA_FP8_VT_KEYS),
                (unsigned)((p->dv + FA_FP8_VT_COLS - 1) / FA_FP8_VT_COLS), (unsigned)(p->b * p->hk),
                FA_FP8_VT_THREADS, 1, 1, FA_SMEM_FWD90_FP8_PREPASS, stream, params, NULL);
            st = r == 0 ? FA_STATUS_OK : fa_cuda_error(r, "launching fa_fwd_vt (fp8)");
        }
    }
    if (st == FA_STATUS_OK && m_blocks > 0)
        st = fa_jit_function(&plan, ctx, "fa_fwd", &fn);
    if (st == FA_STATUS_OK && m_blocks > 0) {
        /* The grid as the bf16 sm90 family's (fa_cuda_forward_planned): persistent CTAs over
         * uniform tiles or causal/windowed mirrored pairs, else one CTA per tile. */
        const int64_t sms = fa_cuda_device_sms(args->device);
        const int uniform = p->window_left < 0 && p->window_right < 0 && !p->is_varlen;
        tm.paired = !uniform && !p->is_varlen && m_blocks <= FA_SM90_PAIRED_MAX_TILES;
        const int persistent = uniform || tm.paired;
        const int64_t units = (tm.paired ? (m_blocks + 1) / 2 : m_blocks) * (int64_t)p->h * p->b;
        const unsigned grid = (unsigned)(persistent && sms > 0 && sms < units ? sms : units);
        void *params[] = {&kp, &tm};
        fa_cu_result r = d->launch_kernel(fn, grid, 1, 1, plan.threads, 1, 1, plan.smem, stream,
                                          params, NULL);
        st = r == 0 ? FA_STATUS_OK : fa_cuda_error(r, "launching fa_fwd (sm90 fp8)");
    }
    fa_cuda_context_leave(pushed);
    return st;
}
