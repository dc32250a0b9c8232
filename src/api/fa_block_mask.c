/* The block-mask builder's entry point: validate, then build on the device's backend. */
#include <string.h>

#include "api/fa_dispatch.h"
#include "mod/fa_block_mask_args.h"

FA_API void fa_block_mask_args_init(fa_block_mask_args *args)
{
    memset(args, 0, sizeof *args);
    args->device = FA_DEVICE_CPU;
}

FA_API fa_status fa_block_mask_build(const fa_block_mask_args *args)
{
    fa_params p;
    FA_TRY(fa_block_mask_args_check(args, &p));
    const fa_backend *be = fa_backend_of(args->device);
    if (!be->block_mask_build)
        return fa_backend_missing(args->device, "fa_block_mask_build");
    return fa_dispatch_result(be->block_mask_build(&p, args));
}
