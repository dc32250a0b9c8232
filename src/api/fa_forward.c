/* The forward entry point: validate once, then hand the parameters to a backend. */
#include <math.h>
#include <string.h>

#include "api/fa_dispatch.h"

FA_API void fa_fwd_args_init(fa_fwd_args *args)
{
    memset(args, 0, sizeof *args);
    args->softmax_scale = NAN;
    args->window_left = -1;
    args->window_right = -1;
    args->device = FA_DEVICE_CPU;
}

FA_API fa_status fa_attention_forward(const fa_fwd_args *args)
{
    fa_params p;
    FA_TRY(fa_params_from_fwd_args(args, &p));
    const fa_backend *be = fa_backend_of(args->device);
    if (!be->forward)
        return fa_backend_missing(args->device, "fa_attention_forward");
    return fa_dispatch_result(be->forward(&p, args));
}

FA_API size_t fa_attention_forward_workspace_size(const fa_fwd_args *args)
{
    fa_params p;
    if (fa_params_from_fwd_args(args, &p) != FA_STATUS_OK)
        return 0;
    fa_error_clear();
    const fa_backend *be = fa_backend_of(args->device);
    return be->forward_workspace_size ? be->forward_workspace_size(&p, args) : 0;
}
