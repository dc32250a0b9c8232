/* The CUDA backend's table (fa_cuda.h). */
#include "cuda/fa_cuda.h"

const fa_backend fa_cuda_backend = {
    .forward = fa_cuda_forward,
    .forward_workspace_size = fa_cuda_forward_workspace_size,
    .backward = fa_cuda_backward,
    .backward_workspace_size = fa_cuda_backward_workspace_size,
    .backward_prepare = fa_cuda_backward_prepare,
    .kvcache = fa_cuda_kvcache,
    .kvcache_workspace_size = fa_cuda_kvcache_workspace_size,
    .combine = fa_cuda_combine,
    .block_mask_build = fa_cuda_block_mask_build,
};
