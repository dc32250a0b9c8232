/* The CUDA backend's table (fa_cuda.h): the forward and the backward; the KV-cache attention and
 * the combine run on the CPU only so far. */
#include "cuda/fa_cuda.h"

const fa_backend fa_cuda_backend = {
    .forward = fa_cuda_forward,
    .backward = fa_cuda_backward,
    .backward_workspace_size = fa_cuda_backward_workspace_size,
    .kvcache = NULL,
    .combine = NULL,
};
