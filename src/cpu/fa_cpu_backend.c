/* The CPU backend's table (fa_cpu.h) and its description for fa_cpu_description(). */
#include <pthread.h>
#include <stdio.h>

#include "core/fa_fp8.h"
#include "cpu/fa_cpu.h"
#include "cpu/fa_cpu_bf16.h"
#include "cpu/fa_cpu_gemm.h"
#include "cpu/fa_cpu_info.h"

/* num_threads after the default (the caller's count, or fa_cpu_default_threads() for 0),
 * clamped once, here, to the pool's [1, FA_MAX_THREADS]. */
static int fa_cpu_threads(int num_threads)
{
    const int n = num_threads > 0 ? num_threads : fa_cpu_default_threads();
    return n < 1 ? 1 : n > FA_MAX_THREADS ? FA_MAX_THREADS : n;
}

static fa_status fa_cpu_backend_forward(const fa_params *p, const fa_fwd_args *args)
{
    (void)args;
    fa_params q = *p;
    q.num_threads = fa_cpu_threads(p->num_threads);
    fa_status st = fa_dtype_is_fp8(p->dtype) ? fa_cpu_forward_fp8(&q) : fa_cpu_forward(&q);
    if (st == FA_STATUS_OK && q.probs)
        st = fa_cpu_probs(&q);
    return st;
}

static fa_status fa_cpu_backend_backward(const fa_params *p, const fa_bwd_args *args)
{
    (void)args;
    fa_params q = *p;
    q.num_threads = fa_cpu_threads(p->num_threads);
    return fa_cpu_backward(&q);
}

static fa_status fa_cpu_backend_kvcache(const fa_params *p, const fa_kvcache_args *args)
{
    (void)args;
    fa_params q = *p;
    q.num_threads = fa_cpu_threads(p->num_threads);
    return fa_cpu_kvcache(&q);
}

static fa_status fa_cpu_backend_combine(const fa_params *p, const fa_combine_args *args)
{
    (void)args;
    fa_params q = *p;
    q.num_threads = fa_cpu_threads(p->num_threads);
    return fa_cpu_combine(&q);
}

static fa_status fa_cpu_backend_block_mask(const fa_params *p, const fa_block_mask_args *args)
{
    fa_params q = *p;
    q.num_threads = fa_cpu_threads(0);
    return fa_cpu_block_mask_build(&q, args);
}

const fa_backend fa_cpu_backend = {
    .forward = fa_cpu_backend_forward,
    .backward = fa_cpu_backend_backward,
    .backward_workspace_size = NULL, /* the CPU backward takes no workspace from the caller */
    .kvcache = fa_cpu_backend_kvcache,
    .combine = fa_cpu_backend_combine,
    .block_mask_build = fa_cpu_backend_block_mask,
};

static char g_report[384]; /* the CPU's description, the kernels picked from it, the L2 share */
static pthread_once_t g_report_once = PTHREAD_ONCE_INIT;

/* Built once, after fa_cpu_info_get()'s detection, from which the kernels are picked. */
static void report_build(void)
{
    const fa_cpu_bf16_kernel *bf16 = fa_cpu_bf16_kernel_get();
    const long l2 = fa_cpu_info_get()->l2_share_bytes;
    char cache[48];
    if (l2 > 0)
        snprintf(cache, sizeof cache, "L2 %ld KB a thread", l2 >> 10);
    else
        snprintf(cache, sizeof cache, "L2 unknown (tiles sized for %ld KB)",
                 FA_CPU_L2_SHARE_DEFAULT >> 10);
    snprintf(g_report, sizeof g_report, "%s; kernels: fp32 %s, bf16 %s; %s",
             fa_cpu_info_description(), fa_cpu_gemm_name(), bf16 ? bf16->name : "as fp32", cache);
}

FA_API const char *fa_cpu_description(void)
{
    pthread_once(&g_report_once, report_build);
    return g_report;
}

