/* The CUDA backend's entry points for the API layer. */
#ifndef FA_CUDA_H
#define FA_CUDA_H

#include "api/fa_internal.h"

/* Launches the forward on args->stream of CUDA device args->device: asynchronous, no
 * allocation, no synchronisation. p is the validated problem (its pointers are device pointers). */
fa_status fa_cuda_forward(const fa_params *p, const fa_fwd_args *args);

/* The kernel family ("fa_fwd_sm80.cu", "fa_fwd_sm90.cu") the calling thread's last forward
 * launched, "" before any: lets the GPU tests check which path ran. */
const char *fa_cuda_last_family(void);

#endif /* FA_CUDA_H */
