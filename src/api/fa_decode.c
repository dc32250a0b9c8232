/* The entry points of decoding: the KV-cache attention and the merge of its split results. */
#include <math.h>
#include <string.h>

#include "api/fa_dispatch.h"

FA_API void fa_kvcache_args_init(fa_kvcache_args *args)
{
    memset(args, 0, sizeof *args);
    args->softmax_scale = NAN;
    args->window_left = -1;
    args->window_right = -1;
    args->rotary_interleaved = 1;
    args->device = FA_DEVICE_CPU;
}

FA_API fa_status fa_attention_kvcache(const fa_kvcache_args *args)
{
    fa_params p;
    FA_TRY(fa_params_from_kvcache_args(args, &p));
    const fa_backend *be = fa_backend_of(args->device);
    if (!be->kvcache)
        return fa_backend_missing(args->device, "fa_attention_kvcache");
    return fa_dispatch_result(be->kvcache(&p, args));
}

FA_API size_t fa_attention_kvcache_workspace_size(const fa_kvcache_args *args)
{
    fa_params p;
    if (fa_params_from_kvcache_args(args, &p) != FA_STATUS_OK)
        return 0;
    fa_error_clear();
    const fa_backend *be = fa_backend_of(args->device);
    return be->kvcache_workspace_size ? be->kvcache_workspace_size(&p, args) : 0;
}

FA_API void fa_combine_args_init(fa_combine_args *args)
{
    memset(args, 0, sizeof *args);
    args->device = FA_DEVICE_CPU;
}

FA_API fa_status fa_attention_combine(const fa_combine_args *args)
{
    fa_params p;
    FA_TRY(fa_params_from_combine_args(args, &p));
    const fa_backend *be = fa_backend_of(args->device);
    if (!be->combine)
        return fa_backend_missing(args->device, "fa_attention_combine");
    return fa_dispatch_result(be->combine(&p, args));
}
