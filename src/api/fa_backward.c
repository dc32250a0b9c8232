/* The backward entry point: validate the forward's arguments and the gradients, then compute. */
#include <string.h>

#include "api/fa_dispatch.h"

FA_API void fa_bwd_args_init(fa_bwd_args *args)
{
    memset(args, 0, sizeof *args);
}

FA_API fa_status fa_attention_backward(const fa_bwd_args *args)
{
    fa_params p;
    FA_TRY(fa_params_from_bwd_args(args, &p));
    const fa_backend *be = fa_backend_of(args->fwd->device);
    if (!be->backward)
        return fa_backend_missing(args->fwd->device, "fa_attention_backward");
    return fa_dispatch_result(be->backward(&p, args));
}

FA_API size_t fa_attention_backward_workspace_size(const fa_bwd_args *args)
{
    fa_params p;
    if (fa_params_from_bwd_args(args, &p) != FA_STATUS_OK)
        return 0;
    fa_error_clear();
    const fa_backend *be = fa_backend_of(args->fwd->device);
    return be->backward_workspace_size ? be->backward_workspace_size(&p) : 0;
}

FA_API fa_status fa_attention_backward_prepare(const fa_fwd_args *args)
{
    fa_params p;
    FA_TRY(fa_params_from_fwd_args(args, &p));
    const fa_backend *be = fa_backend_of(args->device);
    return be->backward_prepare ? be->backward_prepare(&p, args) : FA_STATUS_OK;
}
