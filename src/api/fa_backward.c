/* The backward entry point: validate the forward's arguments and the gradients, then compute. */
#include <string.h>

#include "api/fa_internal.h"

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
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "device: the backward runs on the CPU only in this build (device %d)",
                            args->fwd->device);
    st = fa_cpu_backward(&p);
    if (st == FA_STATUS_OK)
        fa_error_clear();
    return st;
}
