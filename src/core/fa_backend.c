/* The error of an entry point a backend lacks. */
#include "core/fa_backend.h"

fa_status fa_backend_missing(int device, const char *entry)
{
    return fa_error_set(FA_STATUS_UNSUPPORTED,
                        "device: %s runs on the CPU only so far, got CUDA device %d (pass "
                        "FA_DEVICE_CPU with host pointers)",
                        entry, device);
}
