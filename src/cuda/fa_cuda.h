/* The CUDA backend's entry points for the API layer. */
#ifndef FA_CUDA_H
#define FA_CUDA_H

#include "api/fa_internal.h"

/* Launches the forward on args->stream of CUDA device args->device: asynchronous, no
 * allocation, no synchronisation. p is the validated problem (its pointers are device pointers). */
fa_status fa_cuda_forward(const fa_params *p, const fa_fwd_args *args);

#endif /* FA_CUDA_H */
