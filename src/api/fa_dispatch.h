/* How an entry point picks its backend after validation. */
#ifndef FA_DISPATCH_H
#define FA_DISPATCH_H

#include "core/fa_backend.h"
#include "cpu/fa_cpu.h"
#include "cuda/fa_cuda.h"

/* The backend of a validated device: the CPU's for FA_DEVICE_CPU, else CUDA's. */
static inline const fa_backend *fa_backend_of(int device)
{
    return device == FA_DEVICE_CPU ? &fa_cpu_backend : &fa_cuda_backend;
}

/* A backend's status, with the thread's error message cleared on success. */
static inline fa_status fa_dispatch_result(fa_status st)
{
    if (st == FA_STATUS_OK)
        fa_error_clear();
    return st;
}

#endif /* FA_DISPATCH_H */
