/* The backward entry point: validate the forward's arguments and the gradients, then compute. */
#include <string.h>

#include "api/fa_internal.h"
#include "cuda/fa_cuda.h"

FA_API void fa_bwd_args_init(fa_bwd_args *args)
{
    memset(args, 0, sizeof *args);
}

FA_API fa_status fa_attention_backward(const fa_bwd_args *args)
{
    fa_params p;
    fa_status st = fa_params_from_bwd_args(args, &p);
    if (st != FA_STATUS_OK)
        return st;
    if (args->fwd->device != FA_DEVICE_CPU)
        st = fa_cuda_backward(&p, args);
    else
        st = fa_cpu_backward(&p);
    if (st == FA_STATUS_OK)
        fa_error_clear();
    return st;
}

FA_API size_t fa_attention_backward_workspace_size(const fa_bwd_args *args)
{
    fa_params p;
    if (fa_params_from_bwd_args(args, &p) != FA_STATUS_OK)
        return 0;
    fa_error_clear();
    return args->fwd->device == FA_DEVICE_CPU ? 0 : fa_cuda_backward_workspace_size(&p);
}
