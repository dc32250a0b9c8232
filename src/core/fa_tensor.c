/* Tensor views, dtype facts and the version string. */
#include <string.h>

#include "core/fa_error.h"

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
    }
    return 0;
}

FA_API const char *fa_version(void)
{
    return FA_STR(FA_VERSION_MAJOR) "." FA_STR(FA_VERSION_MINOR) "." FA_STR(FA_VERSION_PATCH);
}
