/* The checks the forward and the KV-cache attention share (fa_options.h). */
#include <math.h>

#include "fa_rules.h"
#include "core/fa_check.h"
#include "core/fa_options.h"

fa_status fa_check_device(int device)
{
    if (device < FA_DEVICE_CPU)
        return FA_BAD("device: must be FA_DEVICE_CPU (-1) or a CUDA ordinal, got %d", device);
    return FA_STATUS_OK;
}

fa_status fa_options_check(double softmax_scale, double softcap, int causal, int window_left,
                           int window_right, int64_t d, fa_options *o)
{
    if (isnan(softmax_scale))
        o->scale = fa_rule_default_scale(d);
    else if (!isfinite(softmax_scale))
        return FA_BAD("softmax_scale: must be finite (or NaN for the default d^-0.5)");
    else if (fabs(softmax_scale) > FA_MAX_SOFTMAX_SCALE)
        return FA_BAD("softmax_scale: must be within [-%g, %g], got %g", FA_MAX_SOFTMAX_SCALE,
                      FA_MAX_SOFTMAX_SCALE, softmax_scale);
    else
        o->scale = softmax_scale;

    if (!isfinite(softcap))
        return FA_BAD("softcap: must be a finite number (<= 0 disables it)");
    if (softcap > 0 && (softcap < FA_MIN_SOFTCAP || softcap > FA_MAX_SOFTCAP))
        return FA_BAD("softcap: must be <= 0 (off) or within [%g, %g], got %g", FA_MIN_SOFTCAP,
                      FA_MAX_SOFTCAP, softcap);
    o->softcap = softcap > 0 ? softcap : 0.0;

    if (window_left < -1)
        return FA_BAD("window_left: must be -1 (unbounded) or >= 0, got %d", window_left);
    if (window_right < -1)
        return FA_BAD("window_right: must be -1 (unbounded) or >= 0, got %d", window_right);
    o->causal = causal != 0;
    o->window_left = window_left;
    o->window_right = o->causal ? 0 : window_right;
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
