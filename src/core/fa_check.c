/*
 * The structural checks every entry point makes on its tensor arguments, each failing with a
 * message that names the argument.
 */
#include "core/fa_check.h"

int64_t fa_tensor_numel(const fa_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}

int fa_dtype_is_float(fa_dtype dt)
{
    return dt == FA_DTYPE_F32 || dt == FA_DTYPE_F16 || dt == FA_DTYPE_BF16 || dt == FA_DTYPE_F64;
}

/* Present, known dtype, rank, sizes, data; contiguous: the last dimension has stride 1. */
static fa_status fa_check_view(const fa_tensor *t, const char *name, int ndim, int contiguous)
{
    if (!t)
        return FA_BAD("%s: tensor is NULL", name);
    if (t->ndim != ndim)
        return FA_BAD("%s: expected %d dimensions, got %d", name, ndim, (int)t->ndim);
    if (!fa_dtype_is_float(t->dtype) && t->dtype != FA_DTYPE_I32)
        return FA_BAD("%s: unknown dtype %d", name, (int)t->dtype);
    for (int i = 0; i < ndim; i++) {
        if (t->shape[i] < 0)
            return FA_BAD("%s: dimension %d has negative size %lld", name, i,
                          (long long)t->shape[i]);
        if (t->shape[i] > ((int64_t)1 << 40))
            return FA_BAD("%s: dimension %d size %lld is too large", name, i,
                          (long long)t->shape[i]);
    }
    if (contiguous && t->shape[ndim - 1] > 1 && t->stride[ndim - 1] != 1 &&
        fa_tensor_numel(t) > 0)
        return FA_BAD("%s: last dimension must be contiguous (stride 1), got stride %lld", name,
                      (long long)t->stride[ndim - 1]);
    if (!t->data && fa_tensor_numel(t) > 0)
        return FA_BAD("%s: data pointer is NULL", name);
    return FA_STATUS_OK;
}

fa_status fa_check_tensor(const fa_tensor *t, const char *name, int ndim)
{
    return fa_check_view(t, name, ndim, 1);
}

fa_status fa_check_strided(const fa_tensor *t, const char *name, int ndim)
{
    return fa_check_view(t, name, ndim, 0);
}

fa_status fa_check_dtype(const fa_tensor *t, const char *name, fa_dtype want, const char *why)
{
    if (t->dtype != want)
        return FA_BAD("%s: dtype must be %s (%s), got %s", name, fa_dtype_name(want), why,
                      fa_dtype_name(t->dtype));
    return FA_STATUS_OK;
}

fa_status fa_check_dim(const fa_tensor *t, const char *name, int dim, int64_t want,
                       const char *what)
{
    if (t->shape[dim] != want)
        return FA_BAD("%s: dimension %d (%s) must be %lld, got %lld", name, dim, what,
                      (long long)want, (long long)t->shape[dim]);
    return FA_STATUS_OK;
}

fa_status fa_check_alibi(const fa_tensor *t, int64_t b, int64_t h, const float **data,
                         int64_t *bstride, int64_t *hstride)
{
    if (t->ndim != 1 && t->ndim != 2)
        return FA_BAD("alibi_slopes: must have shape [h] or [b, h], got %d dimensions",
                      (int)t->ndim);
    FA_TRY(fa_check_tensor(t, "alibi_slopes", t->ndim));
    FA_TRY(fa_check_dtype(t, "alibi_slopes", FA_DTYPE_F32, "one slope per head"));
    if (t->ndim == 1) {
        FA_TRY(fa_check_dim(t, "alibi_slopes", 0, h, "heads"));
        *bstride = 0;
        *hstride = t->stride[0];
    } else {
        FA_TRY(fa_check_dim(t, "alibi_slopes", 0, b, "batch"));
        FA_TRY(fa_check_dim(t, "alibi_slopes", 1, h, "heads"));
        *bstride = t->stride[0];
        *hstride = t->stride[1];
    }
    *data = (const float *)t->data;
    return FA_STATUS_OK;
}

fa_status fa_check_sinks(const fa_tensor *t, int64_t h, const float **data, int64_t *stride)
{
    FA_TRY(fa_check_tensor(t, "sinks", 1));
    FA_TRY(fa_check_dtype(t, "sinks", FA_DTYPE_F32, "one logit per head"));
    FA_TRY(fa_check_dim(t, "sinks", 0, h, "heads"));
    *data = (const float *)t->data;
    *stride = t->stride[0];
    return FA_STATUS_OK;
}
