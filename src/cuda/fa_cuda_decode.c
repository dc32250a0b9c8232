/*
 * Decoding on a CUDA device: fa_attention_kvcache (the append, kernels/fa_decode.cu's attention
 * over the cache read in place, and, when the keys are split, kernels/fa_combine.cu's merge),
 * the forward's few-row calls on the same schedule (dense and varlen), and fa_attention_combine.
 * Asynchronous on the caller's stream, no allocation; the one wait is the paged capacity check's
 * for the kernels' report in pinned host memory (fa_kvcache_args.skip_capacity_check).
 *
 * Workspace layout of a split call (each part 256-byte aligned):
 *   oaccum   fp32 [splits][b][sq][h][dv]   each split's normalised output
 *   lseaccum fp32 [splits][b][sq][h]       and its log-sum-exp (+inf: the split saw no key)
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>

#include "fa_dkparams.h"
#include "core/fa_fp8.h"
#include "core/fa_kvcache.h"
#include "cuda/fa_cuda.h"
#include "cuda/fa_cuda_driver.h"
#include "cuda/fa_jit.h"
#include "plan/fa_plan.h"

#define FA_WS_ALIGN 256
#define FA_COMBINE_MAX_DV 256  /* and its widest row */

static size_t fa_decode_round(size_t x) { return (x + FA_WS_ALIGN - 1) / FA_WS_ALIGN * FA_WS_ALIGN; }

/* Bytes of the partials of `splits` splits; *lse_at the offset of lseaccum. */
static size_t fa_decode_ws_bytes(const fa_params *p, int splits, size_t *lse_at)
{
    const size_t rows = (size_t)splits * (size_t)p->b * (size_t)p->max_sq * (size_t)p->h;
    *lse_at = fa_decode_round(rows * (size_t)p->dv * 4);
    return fa_decode_round(*lse_at + rows * 4);
}

/* The call's plan, row tiles per kv head and split count (num_splits, or the plan's choice for
 * the device). */
typedef struct fa_decode_setup {
    fa_plan plan;
    int arch, smem_optin;
    int64_t row_tiles;
    int slices; /* CTAs over v's columns (plan.dv_slices, at least 1) */
    int splits;
    int cluster; /* 1: the splits merge inside their cluster (no workspace, no fa_combine) */
} fa_decode_setup;

/* CTAs of the plan the device runs at once: as many per SM as shared memory holds (an SM has
 * about 1 KB more than a CTA may take, and reserves 1 KB per CTA), counted at most two of 128
 * threads: kernels that fit three (FA_MIN_CTAS) ran slower when the split rule counted the
 * third, since full grids then split. */
static int fa_decode_slots(const fa_plan *plan, const struct fa_decode_setup *s, int device)
{
    int per_sm = fa_plan_ctas_per_sm(plan->smem, s->smem_optin + 1024);
    const int by_regs = (int)(256 / plan->threads);
    per_sm = per_sm < by_regs ? per_sm : by_regs;
    return fa_cuda_device_sms(device) * (per_sm > 1 ? per_sm : 1);
}

/* Whether s's splits merge inside one thread block cluster: 2 to plan->cluster_max of them, the
 * grid's CTAs no more than the device's SMs and two of them fitting on an SM (fuller grids, and
 * CTAs that take an SM's shared memory alone, ran slower in clusters than with fa_combine), with
 * cuLaunchKernelEx there; FLASHATTN_DECODE_CLUSTER=0 keeps the workspace and fa_combine, =1
 * takes clusters whatever the grid (at most 8 CTAs where one takes an SM alone: a larger cluster
 * might not fit in one GPC). */
static int fa_decode_cluster(const fa_plan *plan, const struct fa_decode_setup *s, int64_t ctas,
                             int sms)
{
    static int mode = -2; /* -1 default, 0 off, 1 any grid */
    if (mode == -2) {
        const char *env = getenv("FLASHATTN_DECODE_CLUSTER");
        mode = env && env[0] == '0' ? 0 : env && env[0] == '1' ? 1 : -1;
    }
    const int alone = fa_plan_ctas_per_sm(plan->smem, s->smem_optin + 1024) < 2;
    const int most = alone && plan->cluster_max > 8 ? 8 : plan->cluster_max;
    return mode != 0 && (mode == 1 || (ctas <= sms && !alone)) && s->splits > 1 &&
           s->splits <= most && fa_cuda_driver_get()->launch_kernel_ex;
}

/* fp8 caches copied in 16-byte chunks of 16 values: rows of d and dv multiples of 16 at strides
 * of whole chunks (the pointers are checked with q's). */
static int fa_decode_fp8_aligned(const fa_params *p)
{
    const int64_t strides[] = {p->k_bstride, p->k_rstride, p->k_hstride,
                               p->v_bstride, p->v_rstride, p->v_hstride};
    for (size_t i = 0; i < sizeof strides / sizeof strides[0]; i++)
        if (strides[i] % 16 != 0)
            return 0;
    return p->d % 16 == 0 && p->dv % 16 == 0;
}

/* v's rows the first dv columns of k's (MLA passes one cache twice, v_cache = kv[..., :dv]):
 * the wide plans then read V from K's stages (FA_PLAN_V_IN_K). */
static int fa_decode_v_in_k(const fa_params *p)
{
    return p->v == p->k && p->dv <= p->d && p->v_bstride == p->k_bstride &&
           p->v_rstride == p->k_rstride && p->v_hstride == p->k_hstride;
}

static fa_status fa_decode_setup_make(const fa_params *p, int device, fa_decode_setup *s)
{
    FA_TRY(fa_cuda_device_arch(device, &s->arch, &s->smem_optin));
    if (p->b > 65535 || p->hk > 65535 || p->max_sk > INT32_MAX / 2 ||
        p->max_sq * (p->h / p->hk) > INT32_MAX / 2)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "q: the CUDA decode kernel takes at most 65535 sequences and kv heads, "
                            "2^30 cache positions and 2^30 query rows times heads per kv head");
    const int fp8 = fa_dtype_is_fp8(p->kv_dtype);
    if (fp8 && p->dtype != FA_DTYPE_F16 && p->dtype != FA_DTYPE_BF16)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "q: fp8 caches on a CUDA device take a q in fp16 or bf16, got %s",
                            fa_dtype_name(p->dtype));
    fa_plan_key key = {s->arch, p->dtype, (int)p->d, (int)p->dv, 0, 0, 0, 0};
    key.features |= p->paged ? FA_PLAN_PAGED : 0;
    key.features |= p->kv_dtype == FA_DTYPE_F8E4M3   ? FA_PLAN_KV_E4M3
                    : p->kv_dtype == FA_DTYPE_F8E5M2 ? FA_PLAN_KV_E5M2
                                                     : 0;
    key.features |= p->is_varlen ? FA_FEATURE_VARLEN : 0;
    key.features |= fa_decode_v_in_k(p) ? FA_PLAN_V_IN_K : 0;
    key.features |= p->alibi_slopes ? FA_FEATURE_ALIBI : 0;
    key.features |= p->softcap > 0 ? FA_FEATURE_SOFTCAP : 0;
    key.features |= fa_cuda_rows_aligned(p) && (!fp8 || fa_decode_fp8_aligned(p))
                        ? 0
                        : FA_FEATURE_UNALIGNED;
    const int64_t rows = p->max_sq * (p->h / p->hk);
    FA_TRY(fa_plan_decode(&key, rows, &s->plan));
    if ((int)s->plan.smem > s->smem_optin)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "head_dim %lld: the kernel needs %u bytes of shared memory, the device "
                            "gives %d",
                            (long long)p->d, s->plan.smem, s->smem_optin);
    s->row_tiles = fa_plan_decode_row_tiles(&s->plan, rows);
    s->slices = s->plan.dv_slices > 1 ? s->plan.dv_slices : 1;
    const int64_t tiles = s->row_tiles * s->slices * p->b * p->hk;
    const int sms = fa_cuda_device_sms(device);
    s->splits = p->num_splits > 0 ? (int)p->num_splits
                                  : fa_plan_decode_splits(&s->plan, tiles, p->max_sk,
                                                          fa_decode_slots(&s->plan, s, device));
    /* A few more splits than a cluster holds: the cluster's count instead where that lengthens
     * the longest split by at most one key block (cheaper than fa_combine's launch). */
    if (p->num_splits <= 0 && s->splits > s->plan.cluster_max && s->plan.cluster_max > 1) {
        fa_decode_setup c = *s;
        c.splits = s->plan.cluster_max;
        const int64_t blocks = (p->max_sk + s->plan.bn - 1) / s->plan.bn;
        if (fa_decode_cluster(&c.plan, &c, tiles * c.splits, sms) &&
            (blocks + c.splits - 1) / c.splits <= (blocks + s->splits - 1) / s->splits + 1)
            s->splits = c.splits;
    }
    if (s->row_tiles * s->splits * s->slices > INT32_MAX)
        return fa_error_set(FA_STATUS_UNSUPPORTED, "q: too many row tiles for one launch");
    s->cluster = fa_decode_cluster(&s->plan, s, tiles * s->splits, sms);
    return FA_STATUS_OK;
}

/* Bytes of workspace a decode of p on device needs: 0 where it will not split (or cannot run). */
static size_t fa_decode_ws_need(const fa_params *p, int device)
{
    fa_decode_setup s;
    size_t lse_at;
    if (fa_decode_setup_make(p, device, &s) != FA_STATUS_OK || s.splits <= 1 || s.cluster)
        return 0;
    return fa_decode_ws_bytes(p, s.splits, &lse_at);
}

size_t fa_cuda_kvcache_workspace_size(const fa_params *p, const fa_kvcache_args *args)
{
    return fa_decode_ws_need(p, args->device);
}

/* Whether a merge may start while the attention ahead of it finishes (programmatic dependent
 * launch, sm_90 and later): FLASHATTN_PDL=0 turns it off. */
static int fa_decode_pdl(int arch)
{
    static int off = -1;
    if (off < 0) {
        const char *env = getenv("FLASHATTN_PDL");
        off = env && env[0] == '0';
    }
    return arch >= 90 && !off && fa_cuda_driver_get()->launch_kernel_ex;
}

/* One launch of fn with dk; with pdl, allowed to start before the kernel ahead of it in the
 * stream ends (fn then waits for it with griddepcontrol.wait before reading its results). */
static fa_status fa_decode_launch(fa_cu_function fn, unsigned gx, unsigned gy, unsigned gz,
                                  unsigned threads, unsigned smem, fa_cu_stream stream,
                                  fa_dkparams *dk, int pdl, int cluster, const char *what)
{
    const fa_cuda_driver *d = fa_cuda_driver_get();
    void *params[] = {dk};
    fa_cu_result r;
    fa_cu_launch_attr attrs[2] = {{0}, {0}};
    unsigned n = 0;
    if (pdl) {
        attrs[n].id = FA_CU_LAUNCH_ATTR_PROGRAMMATIC_SERIALIZATION;
        attrs[n++].value.value = 1;
    }
    /* cluster CTAs adjacent in x (the splits of one row tile) form a thread block cluster. */
    if (cluster > 1) {
        attrs[n].id = FA_CU_LAUNCH_ATTR_CLUSTER_DIMENSION;
        attrs[n].value.cluster[0] = (unsigned)cluster;
        attrs[n].value.cluster[1] = attrs[n].value.cluster[2] = 1;
        n++;
    }
    if (n > 0) {
        const fa_cu_launch_config config = {gx, gy, gz, threads, 1, 1, smem, stream, attrs, n};
        r = d->launch_kernel_ex(&config, fn, params, NULL);
    } else {
        r = d->launch_kernel(fn, gx, gy, gz, threads, 1, 1, smem, stream, params, NULL);
    }
    return r == 0 ? FA_STATUS_OK : fa_cuda_error(r, what);
}

/* The paged capacity check's report (kernels/fa_decode_check.cuh): two words of pinned host
 * memory the kernels write and the host reads, one pair per call in flight, kept for reuse (a
 * pinned allocation costs far more than a decode step). */
typedef struct fa_decode_check {
    uint64_t *host;      /* [2] */
    fa_cu_deviceptr dev; /* host's address in ctx */
    fa_cu_context ctx;
    unsigned ticket; /* the call's, in the report's high halves; never 0 (0: no check) */
    struct fa_decode_check *next;
} fa_decode_check;

static pthread_mutex_t fa_check_lock = PTHREAD_MUTEX_INITIALIZER;
static fa_decode_check *fa_check_free;

#define FA_CU_MEMHOSTALLOC_PORTABLE 1
#define FA_CU_ERROR_NOT_READY 600

static void fa_decode_check_give(fa_decode_check *c)
{
    pthread_mutex_lock(&fa_check_lock);
    c->next = fa_check_free;
    fa_check_free = c;
    pthread_mutex_unlock(&fa_check_lock);
}

/* A report for a call in context ctx: a free one, or a new one; its ticket the next. */
static fa_status fa_decode_check_take(fa_cu_context ctx, fa_decode_check **out)
{
    const fa_cuda_driver *d = fa_cuda_driver_get();
    pthread_mutex_lock(&fa_check_lock);
    fa_decode_check *c = fa_check_free;
    if (c)
        fa_check_free = c->next;
    pthread_mutex_unlock(&fa_check_lock);
    if (!c && !(c = calloc(1, sizeof *c)))
        return fa_error_set(FA_STATUS_OUT_OF_MEMORY, "block_table: no host memory for the "
                                                     "capacity check");
    fa_cu_result r = 0;
    if (!c->host) {
        void *h = NULL;
        r = d->mem_host_alloc(&h, 2 * sizeof *c->host, FA_CU_MEMHOSTALLOC_PORTABLE);
        if (r == 0)
            c->host = h, c->host[0] = c->host[1] = 0, c->ctx = NULL;
    }
    if (r == 0 && c->ctx != ctx) {
        r = d->mem_host_get_device_pointer(&c->dev, c->host, 0);
        c->ctx = r == 0 ? ctx : NULL;
    }
    c->ticket = c->ticket + 1 ? c->ticket + 1 : 1;
    *out = c;
    if (r == 0)
        return FA_STATUS_OK;
    fa_decode_check_give(c);
    *out = NULL;
    return fa_cuda_error(r, "allocating the capacity check's report");
}

/* The check ended: waits until the report carries the call's ticket (the reporting kernel's
 * first warp has run: the stream's earlier work is done, the rest of this call's need not be),
 * checks the entry it names, gives the report back. A stream that drains without the report
 * (a kernel failed) gives the stream's error. */
static fa_status fa_decode_check_end(const fa_params *p, fa_decode_check *c, fa_cu_stream stream)
{
    const fa_cuda_driver *d = fa_cuda_driver_get();
    fa_status st = FA_STATUS_OK;
    int drained = 0; /* the stream was idle at the last query: the report read once more */
    for (unsigned spin = 0;; spin++) {
        const uint64_t w0 = __atomic_load_n(&c->host[0], __ATOMIC_ACQUIRE);
        const uint64_t w1 = __atomic_load_n(&c->host[1], __ATOMIC_ACQUIRE);
        if ((w0 >> 32) == c->ticket && (w1 >> 32) == c->ticket) {
            const int64_t i = (uint32_t)w0, len = (int32_t)(uint32_t)w1;
            st = i < p->b ? fa_kvcache_check_seqlen(p, i, len) : FA_STATUS_OK;
            break;
        }
        if (drained) {
            st = fa_error_set(FA_STATUS_INTERNAL,
                              "block_table: the kernels ended without the capacity check's report");
            break;
        }
        if (spin % 64 == 63) {
            const fa_cu_result r = d->stream_query(stream);
            if (r != 0 && r != FA_CU_ERROR_NOT_READY) {
                st = fa_cuda_error(r, "waiting for the capacity check");
                break;
            }
            drained = r == 0;
            if (spin >= 4096)
                sched_yield();
        }
    }
    fa_decode_check_give(c);
    return st;
}

/* The kernels' block for p, the partials at ws (NULL: one split). */
static void fa_dkparams_fill(const fa_params *p, int splits, void *ws, fa_dkparams *dk)
{
    *dk = (fa_dkparams){0};
    fa_kparams_fill(p, &dk->f);
    dk->knew = p->knew, dk->vnew = p->vnew;
    dk->knew_bstride = p->knew_bstride, dk->knew_rstride = p->knew_rstride;
    dk->knew_hstride = p->knew_hstride;
    dk->vnew_bstride = p->vnew_bstride, dk->vnew_rstride = p->vnew_rstride;
    dk->vnew_hstride = p->vnew_hstride;
    dk->block_table = p->block_table, dk->bt_bstride = p->bt_bstride;
    dk->batch_idx = p->batch_idx;
    dk->cache_seqlens = p->cache_seqlens;
    dk->leftpad = p->leftpad;
    dk->rot_cos = p->rot_cos, dk->rot_sin = p->rot_sin;
    dk->cos_rstride = p->cos_rstride, dk->sin_rstride = p->sin_rstride;
    dk->seqlen_ro = p->seqlen_ro;
    dk->rotary_dim = (int)p->rotary_dim;
    dk->rotary_interleaved = p->rotary_interleaved;
    dk->rotary_per_row = p->rotary_per_row;
    dk->num_blocks = p->num_blocks, dk->page_size = p->page_size;
    if (p->paged)
        fa_div_magic(p->page_size, &dk->page_mul, &dk->page_shift);
    dk->s_new = (int)p->s_new;
    dk->k_descale = p->k_descale, dk->v_descale = p->v_descale;
    dk->kd_bstride = p->kd_bstride, dk->kd_hstride = p->kd_hstride;
    dk->vd_bstride = p->vd_bstride, dk->vd_hstride = p->vd_hstride;
    dk->splits = splits;
    fa_div_magic(splits > 1 ? splits : 1, &dk->splits_mul, &dk->splits_shift);
    dk->g = (int)(p->h / p->hk);
    fa_div_magic(dk->g, &dk->g_mul, &dk->g_shift);
    dk->empty_lse = INFINITY;
    if (splits > 1 && ws) {
        size_t lse_at;
        fa_decode_ws_bytes(p, splits, &lse_at);
        const int64_t hs = 1, rs = p->h, bs = p->max_sq * rs, ss = p->b * bs;
        dk->oaccum = ws;
        dk->oaccum_hstride = hs * p->dv, dk->oaccum_rstride = rs * p->dv;
        dk->oaccum_bstride = bs * p->dv, dk->oaccum_sstride = ss * p->dv;
        dk->lseaccum = (float *)((char *)ws + lse_at);
        dk->lseaccum_hstride = hs, dk->lseaccum_rstride = rs;
        dk->lseaccum_bstride = bs, dk->lseaccum_sstride = ss;
    }
}

/* Launches fa_combine over every row of dk (its partials, out and lse). */
static fa_status fa_decode_combine(const fa_dkparams *dkc, fa_dtype out_dtype, int arch,
                                   fa_cu_context ctx, fa_cu_stream stream)
{
    fa_plan_key key = {arch, out_dtype, 0, 0, 0, 0, 0, 0};
    fa_plan plan;
    fa_cu_function fn;
    fa_dkparams dk = *dkc;
    FA_TRY(fa_plan_combine(&key, &plan));
    FA_TRY(fa_jit_function(&plan, ctx, "fa_combine", &fn));
    const int64_t rows = dk.f.b * dk.f.max_sq * dk.f.h;
    const int64_t units = rows * ((dk.f.dv + FA_COMBINE_COLS - 1) / FA_COMBINE_COLS);
    const int64_t per_cta = FA_COMBINE_UNITS_PER_CTA(dk.splits);
    const int64_t ctas = (units + per_cta - 1) / per_cta;
    if (ctas == 0)
        return FA_STATUS_OK;
    if (ctas > INT32_MAX)
        return fa_error_set(FA_STATUS_UNSUPPORTED, "out: too many rows for one launch");
    return fa_decode_launch(fn, (unsigned)ctas, 1, 1, FA_COMBINE_THREADS, 0, stream, &dk,
                            fa_decode_pdl(arch), 0, "launching fa_combine");
}

/* A decode on device: p a KV-cache call, or a dense forward seen as one (its k and v a
 * contiguous cache, every sequence full); ws and ws_size the caller's workspace; check_capacity
 * whether a paged call checks cache_seqlens against block_table (FA_RULE_KV_FITS). */
static _Thread_local const char *fa_decode_family_used = "";

static _Thread_local int fa_decode_splits_used;

const char *fa_cuda_decode_last_family(void) { return fa_decode_family_used; }

int fa_cuda_decode_last_splits(void) { return fa_decode_splits_used; }

static fa_status fa_decode_run(const fa_params *p, int device, void *stream_arg, void *ws,
                               size_t ws_size, int check_capacity)
{
    fa_decode_setup s;
    FA_TRY(fa_decode_setup_make(p, device, &s));
    fa_decode_family_used = s.plan.family;
    if (s.splits > 1 && !s.cluster) {
        size_t lse_at;
        const size_t need = fa_decode_ws_bytes(p, s.splits, &lse_at);
        if ((!ws || ws_size < need) && p->num_splits > 1)
            return fa_error_set(FA_STATUS_INVALID_ARGUMENT,
                                "workspace: num_splits %d needs %zu bytes "
                                "(fa_attention_kvcache_workspace_size), got %zu",
                                s.splits, need, ws ? ws_size : 0);
        /* The library's count, lowered to what the caller's workspace holds (one sized for
         * another plan, or none). */
        while (s.splits > 1 && (!ws || fa_decode_ws_bytes(p, s.splits, &lse_at) > ws_size))
            s.splits--;
        if (s.splits > 1 && (uintptr_t)ws % FA_WS_ALIGN != 0)
            return fa_error_set(FA_STATUS_INVALID_ARGUMENT,
                                "workspace: must be %d-byte aligned", FA_WS_ALIGN);
    }
    fa_decode_splits_used = s.splits;

    fa_cu_context ctx;
    int pushed;
    FA_TRY(fa_cuda_context_enter(device, &ctx, &pushed));
    fa_cu_stream stream = (fa_cu_stream)stream_arg;
    fa_status st = FA_STATUS_OK;
    fa_dkparams dk;
    fa_dkparams_fill(p, s.splits, s.cluster ? NULL : ws, &dk);
    dk.cluster_merge = s.cluster;
    /* The attention's CTAs append the new rows themselves (one launch fewer) unless a rotated
     * k or v shares bytes with its cache: rotating such a row twice would be wrong. */
    dk.append_fused = p->s_new > 0 && s.row_tiles > 0 && !(p->rot_cos && p->new_in_cache);
    /* The capacity check, in the kernels (kernels/fa_decode_check.cuh): the first launch reports
     * and the host waits for the report after launching, so that its next call overlaps this
     * one's kernels. A call that launches nothing reads and writes nothing, and checks nothing. */
    const int append_alone = p->s_new > 0 && !dk.append_fused;
    fa_decode_check *check = NULL;
    int reported = 0; /* the reporting launch was made */
    if (p->paged && p->cache_seqlens && check_capacity && p->b > 0 &&
        (append_alone || s.row_tiles > 0)) {
        st = fa_decode_check_take(ctx, &check);
        if (check) {
            dk.check_ticket = (int)check->ticket;
            dk.check_report = (fa_u64 *)(uintptr_t)check->dev;
        }
    }
    fa_cu_function fn;
    if (st == FA_STATUS_OK && p->is_varlen && p->total_q > 0) {
        const int64_t n = p->total_q * p->h;
        st = fa_jit_function(&s.plan, ctx, "fa_decode_fill", &fn);
        if (st == FA_STATUS_OK)
            st = fa_decode_launch(fn, (unsigned)((n + 255) / 256), 1, 1, 256, 0, stream, &dk, 0,
                                  0, "launching fa_decode_fill");
    }
    if (st == FA_STATUS_OK && p->s_new > 0 && !dk.append_fused) {
        st = fa_jit_function(&s.plan, ctx, "fa_kv_append", &fn);
        if (st == FA_STATUS_OK)
            st = fa_decode_launch(fn, (unsigned)p->s_new, (unsigned)p->hk, (unsigned)p->b, 32, 0,
                                  stream, &dk, 0, 0, "launching fa_kv_append");
        reported = st == FA_STATUS_OK && check;
        dk.check_report = NULL;
    }
    if (st == FA_STATUS_OK && s.row_tiles > 0) {
        st = fa_jit_function(&s.plan, ctx, "fa_decode", &fn);
        if (st == FA_STATUS_OK)
            st = fa_decode_launch(fn, (unsigned)(s.row_tiles * s.splits * s.slices),
                                  (unsigned)p->hk, (unsigned)p->b, s.plan.threads, s.plan.smem,
                                  stream, &dk, 0, s.cluster ? s.splits : 0,
                                  "launching fa_decode");
        reported = reported || (st == FA_STATUS_OK && check);
        if (st == FA_STATUS_OK && s.splits > 1 && !s.cluster)
            st = fa_decode_combine(&dk, p->dtype, s.arch, ctx, stream);
    }
    if (check && reported) {
        const fa_status checked = fa_decode_check_end(p, check, stream);
        st = st == FA_STATUS_OK ? checked : st;
    } else if (check) {
        fa_decode_check_give(check);
    }
    fa_cuda_context_leave(pushed);
    return st;
}

fa_status fa_cuda_kvcache(const fa_params *p, const fa_kvcache_args *args)
{
    return fa_decode_run(p, args->device, args->stream, args->workspace, args->workspace_size,
                         !args->skip_capacity_check);
}

/* A forward as a KV-cache call: a dense one's k and v a contiguous cache of max_sk positions
 * per sequence, each full; a varlen one's sequences located by the kernels from cu_seqlens
 * (its batch strides are 0), k and v one cache row of total_k positions; a paged varlen one
 * keeps its blocks, read in place through block_table. */
static fa_params fa_decode_of_forward(const fa_params *p)
{
    fa_params d = *p;
    d.kv_dtype = p->dtype;
    if (p->paged)
        return d;
    d.num_blocks = p->is_varlen ? 1 : p->b;
    d.page_size = p->is_varlen ? p->total_k : p->max_sk;
    return d;
}

int fa_cuda_forward_decodes(const fa_params *p)
{
    /* fp8 q, k, v run the fp8 forward kernel at any row count. */
    return !fa_dtype_is_fp8(p->dtype) && fa_plan_cuda_decodes(p);
}

fa_status fa_cuda_forward_decode(const fa_params *p, const fa_fwd_args *args)
{
    const fa_params d = fa_decode_of_forward(p);
    return fa_decode_run(&d, args->device, args->stream, args->workspace, args->workspace_size,
                         0);
}

size_t fa_cuda_forward_workspace_size(const fa_params *p, const fa_fwd_args *args)
{
    if (fa_dtype_is_fp8(p->dtype)) {
        int arch = 0, smem_optin = 0;
        if (fa_cuda_device_arch(args->device, &arch, &smem_optin) != FA_STATUS_OK)
            return 0;
        return fa_cuda_forward_fp8_workspace_size(p, arch);
    }
    if (!fa_cuda_forward_decodes(p))
        return 0;
    const fa_params d = fa_decode_of_forward(p);
    return fa_decode_ws_need(&d, args->device);
}

fa_status fa_cuda_combine(const fa_params *p, const fa_combine_args *args)
{
    if (p->accum_dtype != FA_DTYPE_F32)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "out_partial: the CUDA combine reads fp32 partials, got %s",
                            fa_dtype_name(p->accum_dtype));
    if (p->dv > FA_COMBINE_MAX_DV)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "out_partial: the CUDA combine takes head dims up to %d, got %lld",
                            FA_COMBINE_MAX_DV, (long long)p->dv);
    int arch = 0, smem_optin = 0;
    FA_TRY(fa_cuda_device_arch(args->device, &arch, &smem_optin));
    fa_dkparams dk = {0};
    fa_kparams_fill(p, &dk.f);
    dk.oaccum = (float *)p->oaccum;
    dk.oaccum_sstride = p->oaccum_sstride, dk.oaccum_bstride = p->oaccum_bstride;
    dk.oaccum_rstride = p->oaccum_rstride, dk.oaccum_hstride = p->oaccum_hstride;
    dk.lseaccum = (float *)p->lseaccum;
    dk.lseaccum_sstride = p->lseaccum_sstride, dk.lseaccum_bstride = p->lseaccum_bstride;
    dk.lseaccum_rstride = p->lseaccum_rstride, dk.lseaccum_hstride = p->lseaccum_hstride;
    dk.splits = (int)p->num_splits;
    dk.empty_lse = (float)p->empty_lse;
    fa_cu_context ctx;
    int pushed;
    FA_TRY(fa_cuda_context_enter(args->device, &ctx, &pushed));
    fa_status st = fa_decode_combine(&dk, p->dtype, arch, ctx, (fa_cu_stream)args->stream);
    fa_cuda_context_leave(pushed);
    return st;
}
