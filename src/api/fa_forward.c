/* The forward entry point: validate once, then hand the parameters to a backend. */
#include <math.h>
#include <string.h>

#include "api/fa_internal.h"
#include "cuda/fa_cuda.h"

FA_API void fa_fwd_args_init(fa_fwd_args *args)
{
    memset(args, 0, sizeof *args);
    args->softmax_scale = NAN;
    args->window_left = -1;
    args->window_right = -1;
    args->device = FA_DEVICE_CPU;
}

/* Upstream's kBlockN of its sm80 forward kernels, which fixes how S_dmask is blocked. */
FA_API int fa_probs_block_n(int head_dim, int dropout, int causal)
{
    (void)causal;
    if (head_dim <= 32)
        return 128;
    if (head_dim <= 64)
        return dropout ? 64 : 128;
    if (head_dim <= 96)
        return 64;
    if (head_dim <= 128)
        return dropout ? 32 : 64;
    return 64;
}

FA_API fa_status fa_attention_forward(const fa_fwd_args *args)
{
    fa_params p;
    fa_status st = fa_params_from_fwd_args(args, &p);
    if (st != FA_STATUS_OK)
        return st;
    if (args->device != FA_DEVICE_CPU) {
        st = fa_cuda_forward(&p, args);
        if (st == FA_STATUS_OK)
            fa_error_clear();
        return st;
    }
    st = fa_cpu_forward(&p);
    if (st == FA_STATUS_OK && p.probs)
        st = fa_cpu_probs(&p);
    if (st == FA_STATUS_OK)
        fa_error_clear();
    return st;
}
