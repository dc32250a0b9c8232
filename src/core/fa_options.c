/* The checks the forward and the KV-cache attention share (fa_options.h). */
#include "core/fa_check.h"
#include "core/fa_options.h"

fa_status fa_check_device(int device)
{
    if (device < FA_DEVICE_CPU)
        return FA_BAD("device: must be FA_DEVICE_CPU (-1) or a CUDA ordinal, got %d", device);
    return FA_STATUS_OK;
}

fa_status fa_check_threads(int num_threads)
{
    if (num_threads < 0)
        return FA_BAD("num_threads: must be >= 0 (0 = default), got %d", num_threads);
    return FA_STATUS_OK;
}

fa_status fa_check_lse_dtype(const fa_tensor *t, fa_dtype q_dtype)
{
    if (t->dtype == FA_DTYPE_F32 || (t->dtype == FA_DTYPE_F64 && q_dtype == FA_DTYPE_F64))
        return FA_STATUS_OK;
    return FA_BAD("lse: dtype must be fp32 (or fp64 when q is fp64), got %s",
                  fa_dtype_name(t->dtype));
}

fa_status fa_check_lse_dense(const fa_tensor *t, fa_dtype q_dtype, int64_t b, int64_t h,
                             int64_t sq)
{
    FA_TRY(fa_check_tensor(t, "lse", 3));
    FA_TRY(fa_check_lse_dtype(t, q_dtype));
    FA_TRY(fa_check_dim(t, "lse", 0, b, "batch"));
    FA_TRY(fa_check_dim(t, "lse", 1, h, "heads"));
    FA_TRY(fa_check_dim(t, "lse", 2, sq, "seqlen_q"));
    return FA_STATUS_OK;
}
