/*
 * The structural checks every entry point makes on its tensor arguments, each failing with a
 * message that names the argument.
 */
#include <math.h>

#include "core/fa_check.h"
#include "core/fa_fp8.h"

int64_t fa_tensor_numel(const fa_tensor *t)
{
    /* A zero or negative dimension empties the tensor whatever the others are; past int64 the
     * count saturates, which every check refuses as too large. */
    for (int i = 0; i < t->ndim; i++)
        if (t->shape[i] <= 0)
            return 0;
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        if (__builtin_mul_overflow(n, t->shape[i], &n))
            return INT64_MAX;
    return n;
}

int fa_dtype_is_float(fa_dtype dt)
{
    return dt == FA_DTYPE_F32 || dt == FA_DTYPE_F16 || dt == FA_DTYPE_BF16 || dt == FA_DTYPE_F64;
}

static int fa_tensor_offsets(const fa_tensor *t, int64_t *lo, int64_t *hi);
static fa_status fa_check_address(const fa_tensor *t, const char *name, int64_t lo, int64_t hi);

/* Present, known dtype, rank, sizes and strides within FA_MAX_EXTENT, data; contiguous: the
 * last dimension has stride 1. A tensor with no element may have any data pointer. */
static fa_status fa_check_view(const fa_tensor *t, const char *name, int ndim, int contiguous)
{
    if (!t)
        return FA_BAD("%s: tensor is NULL", name);
    if (t->ndim != ndim)
        return FA_BAD("%s: expected %d dimensions, got %d", name, ndim, (int)t->ndim);
    if (!fa_dtype_is_float(t->dtype) && t->dtype != FA_DTYPE_I32 && !fa_dtype_is_fp8(t->dtype))
        return FA_BAD("%s: unknown dtype %d", name, (int)t->dtype);
    for (int i = 0; i < ndim; i++) {
        if (t->shape[i] < 0)
            return FA_BAD("%s: dimension %d has negative size %lld", name, i,
                          (long long)t->shape[i]);
        if (t->shape[i] > FA_MAX_EXTENT)
            return FA_BAD("%s: dimension %d size %lld is too large (at most FA_MAX_EXTENT = "
                          "2^40)",
                          name, i, (long long)t->shape[i]);
    }
    const int64_t numel = fa_tensor_numel(t);
    if (numel > FA_MAX_EXTENT)
        return FA_BAD("%s: %lld elements in all is too many (at most FA_MAX_EXTENT = 2^40)",
                      name, (long long)numel);
    /* Bounded even without elements: backends compute base offsets from every stride. */
    int64_t lo, hi;
    if (!fa_tensor_offsets(t, &lo, &hi) || lo < -FA_MAX_EXTENT || hi > FA_MAX_EXTENT ||
        hi - lo >= FA_MAX_EXTENT)
        return FA_BAD("%s: its strides reach more than FA_MAX_EXTENT = 2^40 elements", name);
    if (numel == 0)
        return FA_STATUS_OK; /* nothing is read or written: data is never used */
    if (contiguous && t->shape[ndim - 1] > 1 && t->stride[ndim - 1] != 1)
        return FA_BAD("%s: last dimension must be contiguous (stride 1), got stride %lld", name,
                      (long long)t->stride[ndim - 1]);
    if (!t->data)
        return FA_BAD("%s: data pointer is NULL", name);
    return fa_check_address(t, name, lo, hi);
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


/* ---- Extents, aliasing, scalars and thread counts (overflow-proof validation) ---- */

/* The element offsets [*lo, *hi] (lo <= 0 <= hi) that a tensor reaches from its data pointer
 * through its dimensions longer than 1; 0 when the reach does not fit int64. */
static int fa_tensor_offsets(const fa_tensor *t, int64_t *lo, int64_t *hi)
{
    int64_t l = 0, h = 0;
    for (int i = 0; i < t->ndim; i++) {
        int64_t reach;
        if (t->shape[i] <= 1)
            continue;
        if (__builtin_mul_overflow(t->shape[i] - 1, t->stride[i], &reach))
            return 0;
        if (reach < 0 ? __builtin_add_overflow(l, reach, &l) : __builtin_add_overflow(h, reach, &h))
            return 0;
    }
    *lo = l;
    *hi = h;
    return 1;
}

/* The bytes a non-empty tensor reaches (element offsets [lo, hi], bounded by FA_MAX_EXTENT) do
 * not wrap the address space. */
static fa_status fa_check_address(const fa_tensor *t, const char *name, int64_t lo, int64_t hi)
{
    const uintptr_t at = (uintptr_t)t->data, es = (uintptr_t)fa_dtype_size(t->dtype);
    if (at < (uintptr_t)(-lo) * es || UINTPTR_MAX - at < (uintptr_t)(hi + 1) * es)
        return FA_BAD("%s: its strides reach outside the address space from data %p", name,
                      t->data);
    return FA_STATUS_OK;
}

int fa_tensor_bytes(const fa_tensor *t, uintptr_t *first, uintptr_t *end)
{
    int64_t lo, hi;
    if (fa_tensor_numel(t) == 0 || !fa_tensor_offsets(t, &lo, &hi))
        return 0;
    const uintptr_t at = (uintptr_t)t->data, es = (uintptr_t)fa_dtype_size(t->dtype);
    *first = at - (uintptr_t)(-lo) * es;
    *end = at + (uintptr_t)(hi + 1) * es;
    return 1;
}

int fa_tensors_overlap(const fa_tensor *a, const fa_tensor *b)
{
    uintptr_t a0, a1, b0, b1;
    return a && b && fa_tensor_bytes(a, &a0, &a1) && fa_tensor_bytes(b, &b0, &b1) && a0 < b1 &&
           b0 < a1;
}

/* Whether delta = sum over dims k <= top of d_k s[k] for some integers d_k in [lo[k], hi[k]];
 * reach[k]: the most |sum| of the dims below k. s ascending and positive. *budget bounds the
 * search: past it the answer is yes. */
static int fa_offsets_reach(int64_t delta, const int64_t *s, const int64_t *lo, const int64_t *hi,
                            const int64_t *reach, int top, int *budget)
{
    if (top < 0)
        return delta == 0;
    if (--*budget < 0)
        return 1;
    /* d with |delta - d s| <= reach[top], as floor / ceil divisions */
    const int64_t a = delta - reach[top], b = delta + reach[top], st = s[top];
    int64_t d0 = a >= 0 ? (a + st - 1) / st : -((-a) / st);
    int64_t d1 = b >= 0 ? b / st : -((-b + st - 1) / st);
    d0 = d0 > lo[top] ? d0 : lo[top];
    d1 = d1 < hi[top] ? d1 : hi[top];
    for (int64_t d = d0; d <= d1; d++)
        if (fa_offsets_reach(delta - d * st, s, lo, hi, reach, top - 1, budget))
            return 1;
    return 0;
}

/* Whether two valid tensors share an element's bytes. Exact for tensors of one dtype and rank
 * with equal strides (views into one buffer, as dq, dk and dv of a packed gradient are); else
 * whether their byte ranges overlap. */
static int fa_tensors_share(const fa_tensor *a, const fa_tensor *b)
{
    if (!fa_tensors_overlap(a, b))
        return 0;
    const int64_t es = (int64_t)fa_dtype_size(a->dtype);
    const intptr_t bytes = (intptr_t)((uintptr_t)a->data - (uintptr_t)b->data);
    if (a->dtype != b->dtype || a->ndim != b->ndim || es == 0 || bytes % es != 0)
        return 1;
    /* a's element i and b's element j coincide where sum_k (j_k - i_k) stride_k = delta */
    int64_t s[FA_MAX_DIMS], lo[FA_MAX_DIMS], hi[FA_MAX_DIMS], reach[FA_MAX_DIMS];
    int n = 0;
    for (int k = 0; k < a->ndim; k++) {
        if (a->stride[k] != b->stride[k])
            return 1;
        if (a->shape[k] <= 1 && b->shape[k] <= 1)
            continue;
        const int neg = a->stride[k] < 0;
        const int64_t st = neg ? -a->stride[k] : a->stride[k];
        if (st == 0)
            return 1;
        int at = n++; /* insertion by stride, ascending */
        while (at > 0 && s[at - 1] > st) {
            s[at] = s[at - 1], lo[at] = lo[at - 1], hi[at] = hi[at - 1];
            at--;
        }
        s[at] = st;
        lo[at] = neg ? 1 - b->shape[k] : 1 - a->shape[k];
        hi[at] = neg ? a->shape[k] - 1 : b->shape[k] - 1;
    }
    for (int k = 0; k < n; k++) /* the most |sum| of the dims below k */
        reach[k] = k ? reach[k - 1] + (-lo[k - 1] > hi[k - 1] ? -lo[k - 1] : hi[k - 1]) * s[k - 1]
                     : 0;
    int budget = 4096;
    return fa_offsets_reach((int64_t)(bytes / es), s, lo, hi, reach, n - 1, &budget);
}

fa_status fa_check_disjoint(const fa_tensor *out, const char *out_name, const fa_tensor *in,
                            const char *in_name)
{
    if (fa_tensors_share(out, in))
        return FA_BAD("%s: overlaps %s in memory (an output may not alias an input)", out_name,
                      in_name);
    return FA_STATUS_OK;
}



fa_status fa_check_count(int64_t value, const char *name)
{
    if (value < 0)
        return FA_BAD("%s: must be non-negative, got %lld", name, (long long)value);
    if (value > FA_MAX_EXTENT)
        return FA_BAD("%s: must be at most FA_MAX_EXTENT = 2^40, got %lld", name,
                      (long long)value);
    return FA_STATUS_OK;
}

fa_status fa_check_writable(const fa_tensor *t, const char *name)
{
    if (!t || fa_tensor_numel(t) == 0)
        return FA_STATUS_OK;
    /* Dimensions longer than 1 by increasing |stride|: each stride must step past everything
     * the inner ones reach (what every layout of sliced, transposed or padded memory does). */
    int64_t n[FA_MAX_DIMS], s[FA_MAX_DIMS];
    int k = 0;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] <= 1)
            continue;
        int64_t abs_stride = t->stride[i] < 0 ? -t->stride[i] : t->stride[i];
        int j = k++;
        for (; j > 0 && s[j - 1] > abs_stride; j--) {
            s[j] = s[j - 1];
            n[j] = n[j - 1];
        }
        s[j] = abs_stride;
        n[j] = t->shape[i];
    }
    int64_t reach = 0; /* bounded by FA_MAX_EXTENT: fa_check_tensor passed */
    for (int j = 0; j < k; j++) {
        if (s[j] <= reach)
            return FA_BAD("%s: two of its elements share an address (stride %lld); a written "
                          "tensor needs distinct elements",
                          name, (long long)s[j]);
        reach += (n[j] - 1) * s[j];
    }
    return FA_STATUS_OK;
}

fa_status fa_check_block_ids(const int32_t *row, int64_t i, int64_t page_size, int64_t num_blocks,
                             int64_t start, int64_t end)
{
    if (end <= start)
        return FA_STATUS_OK;
    for (int64_t j = start / page_size; j < (end + page_size - 1) / page_size; j++) {
        if (row[j] < 0 || row[j] >= num_blocks)
            return FA_BAD("block_table: entry [%lld, %lld] is %d, outside [0, %lld) (the blocks "
                          "of the cache); sequence %lld uses positions [%lld, %lld)",
                          (long long)i, (long long)j, row[j], (long long)num_blocks,
                          (long long)i, (long long)start, (long long)end);
    }
    return FA_STATUS_OK;
}
