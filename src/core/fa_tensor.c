/* Tensor views, dtype facts and the version string. */
#include <string.h>

#include "core/fa_error.h"
#include "core/fa_fp8.h"

#define FA_STR2(x) #x
#define FA_STR(x) FA_STR2(x)

FA_API fa_tensor fa_tensor_make(void *data, fa_dtype dtype, int ndim, const int64_t *shape,
                                const int64_t *stride)
{
    fa_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dtype;
    t.ndim = !shape || ndim < 0 ? 0 : (ndim > FA_MAX_DIMS ? FA_MAX_DIMS : ndim);
    int64_t running = 1;
    for (int i = t.ndim - 1; i >= 0; i--) {
        t.shape[i] = shape[i];
        t.stride[i] = stride ? stride[i] : running;
        /* Past int64 the stride saturates: validation refuses such a shape as too large. */
        if (__builtin_mul_overflow(running, shape[i] > 0 ? shape[i] : 1, &running))
            running = INT64_MAX;
    }
    return t;
}

FA_API const char *fa_dtype_name(fa_dtype dtype)
{
    switch (dtype) {
    case FA_DTYPE_F32:
        return "fp32";
    case FA_DTYPE_F16:
        return "fp16";
    case FA_DTYPE_BF16:
        return "bf16";
    case FA_DTYPE_F64:
        return "fp64";
    case FA_DTYPE_I32:
        return "int32";
    case FA_DTYPE_F8E4M3:
        return "fp8_e4m3";
    case FA_DTYPE_F8E5M2:
        return "fp8_e5m2";
    }
    return "unknown";
}

FA_API size_t fa_dtype_size(fa_dtype dtype)
{
    switch (dtype) {
    case FA_DTYPE_F32:
    case FA_DTYPE_I32:
        return 4;
    case FA_DTYPE_F16:
    case FA_DTYPE_BF16:
        return 2;
    case FA_DTYPE_F64:
        return 8;
    case FA_DTYPE_F8E4M3:
    case FA_DTYPE_F8E5M2:
        return 1;
    }
    return 0;
}

static fa_status fa_fp8_check(fa_dtype dtype, const void *src, const void *dst, size_t n)
{
    if (!fa_dtype_is_fp8(dtype))
        return FA_BAD("dtype: must be fp8_e4m3 or fp8_e5m2, got %s", fa_dtype_name(dtype));
    if (n > 0 && (!src || !dst))
        return FA_BAD("%s: pointer is NULL", src ? "dst" : "src");
    return FA_STATUS_OK;
}

FA_API fa_status fa_fp8_from_f32(fa_dtype dtype, const float *src, uint8_t *dst, size_t n)
{
    FA_TRY(fa_fp8_check(dtype, src, dst, n));
    for (size_t i = 0; i < n; i++)
        dst[i] = dtype == FA_DTYPE_F8E4M3 ? fa_f32_to_e4m3(src[i]) : fa_f32_to_e5m2(src[i]);
    fa_error_clear();
    return FA_STATUS_OK;
}

FA_API fa_status fa_fp8_to_f32(fa_dtype dtype, const uint8_t *src, float *dst, size_t n)
{
    FA_TRY(fa_fp8_check(dtype, src, dst, n));
    for (size_t i = 0; i < n; i++)
        dst[i] = dtype == FA_DTYPE_F8E4M3 ? fa_e4m3_to_f32(src[i]) : fa_e5m2_to_f32(src[i]);
    fa_error_clear();
    return FA_STATUS_OK;
}

FA_API const char *fa_version(void)
{
    return FA_STR(FA_VERSION_MAJOR) "." FA_STR(FA_VERSION_MINOR) "." FA_STR(FA_VERSION_PATCH);
}
