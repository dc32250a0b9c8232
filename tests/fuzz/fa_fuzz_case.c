/* The fuzzer's generator and contract checks (fa_fuzz_gen.h). */
#include "fa_fuzz_gen.h"

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_ref.h"
#include "flashattn.h"

/* ---- random choices ---------------------------------------------------------------------- */

void fz_src_from_seed(fz_src *s, uint64_t seed)
{
    memset(s, 0, sizeof *s);
    s->state = seed;
}

void fz_src_from_bytes(fz_src *s, const uint8_t *bytes, size_t size)
{
    memset(s, 0, sizeof *s);
    s->bytes = bytes;
    s->size = size;
}

/* A number below n (n >= 1): one byte of the input per 8 bits that n needs. */
uint64_t fz_below(fz_src *s, uint64_t n)
{
    if (n <= 1)
        return 0;
    uint64_t x;
    if (s->bytes) {
        x = 0;
        for (uint64_t span = n - 1; span; span >>= 8)
            x = x << 8 | (s->pos < s->size ? s->bytes[s->pos++] : 0);
    } else {
        uint64_t z = (s->state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        x = z ^ (z >> 31);
    }
    return x % n;
}

int fz_chance(fz_src *s, int percent)
{
    return (int)fz_below(s, 100) < percent;
}

int64_t fz_range(fz_src *s, int64_t lo, int64_t hi) /* [lo, hi] */
{
    return lo + (int64_t)fz_below(s, (uint64_t)(hi - lo) + 1);
}

double fz_uniform(fz_src *s, double lo, double hi)
{
    return lo + (hi - lo) * (double)fz_below(s, 1u << 16) / 65536.0;
}


/* ---- one case ---------------------------------------------------------------------------- */


void fz_note(fz_case *c, const char *fmt, ...)
{
    if (c->log_len >= sizeof c->log - 1)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(c->log + c->log_len, sizeof c->log - c->log_len, fmt, ap);
    va_end(ap);
    if (n > 0)
        c->log_len += (size_t)n;
    if (c->log_len > sizeof c->log - 1)
        c->log_len = sizeof c->log - 1;
}

void fz_fail(const fz_case *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fa_fuzz: %s: ", c->entry);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n  case: %s\n", c->log);
    abort();
}


int64_t fz_numel(const fa_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] <= 0)
            return 0;
        if (__builtin_mul_overflow(n, t->shape[i], &n))
            return INT64_MAX;
    }
    return n;
}

/* Element offsets [lo, hi] a view reaches through its dimensions longer than 1; 0 past int64. */
static int fz_reach(const fa_tensor *t, int64_t *lo, int64_t *hi)
{
    *lo = *hi = 0;
    for (int i = 0; i < t->ndim; i++) {
        int64_t r;
        if (t->shape[i] <= 1)
            continue;
        if (__builtin_mul_overflow(t->shape[i] - 1, t->stride[i], &r) ||
            __builtin_add_overflow(r < 0 ? *lo : *hi, r, r < 0 ? lo : hi))
            return 0;
    }
    return 1;
}

int fz_next(const fa_tensor *t, int64_t *idx)
{
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (++idx[i] < t->shape[i])
            return 1;
        idx[i] = 0;
    }
    return 0;
}

/* Strides of shape: contiguous, padded, permuted, or with a zero, negative, huge, non-unit last
 * or random stride. */
static void fz_strides(fz_case *c, fa_tensor *t, const char *name)
{
    fz_src *s = c->src;
    const int nd = t->ndim;
    int order[FA_MAX_DIMS];
    for (int i = 0; i < nd; i++)
        order[i] = i;
    const int mode = (int)fz_below(s, c->chaos ? 100 : 90);
    if (mode >= 70 && mode < 80 && nd > 2) { /* outer dimensions permuted */
        for (int i = nd - 2; i > 0; i--) {
            int j = (int)fz_below(s, (uint64_t)i + 1), tmp = order[i];
            order[i] = order[j];
            order[j] = tmp;
        }
    }
    int64_t running = 1;
    for (int k = nd - 1; k >= 0; k--) {
        const int i = order[k];
        t->stride[i] = running;
        int64_t pad = mode >= 60 && mode < 70 && k < nd - 1 ? fz_range(s, 0, 3) : 0;
        if (__builtin_mul_overflow(running, t->shape[i] > 0 ? t->shape[i] : 1, &running) ||
            __builtin_add_overflow(running, pad, &running))
            running = INT64_MAX / 4;
    }
    if (nd == 0)
        return;
    const int at = (int)fz_below(s, (uint64_t)(nd > 1 ? nd - 1 : 1));
    static const int64_t huge[] = {(int64_t)1 << 31, (int64_t)1 << 41, INT64_MAX / 2,
                                   -((int64_t)1 << 45), INT64_MIN, (int64_t)1 << 39};
    static const int64_t last[] = {0, 2, -1, 7};
    if (mode >= 80 && mode < 85)
        t->stride[at] = 0;
    else if (mode >= 85 && mode < 90)
        t->stride[at] = -t->stride[at];
    else if (mode >= 90 && mode < 93)
        t->stride[at] = FZ_PICK(s, huge);
    else if (mode >= 93 && mode < 96)
        t->stride[nd - 1] = FZ_PICK(s, last);
    else if (mode >= 96)
        for (int i = 0; i < nd; i++)
            t->stride[i] = fz_range(s, -40, 40);
    if (mode >= 80)
        fz_note(c, "(%s strides mode %d at %d)", name, mode, at);
}

/* Writes value at element idx of t (any dtype of the library). */
void fz_store(const fa_tensor *t, const int64_t *idx, double value)
{
    if (t->dtype == FA_DTYPE_I32) {
        int64_t off = 0;
        for (int i = 0; i < t->ndim; i++)
            off += idx[i] * t->stride[i];
        ((int32_t *)t->data)[off] = value > INT32_MIN && value < INT32_MAX ? (int32_t)value : 0;
    } else {
        fa_ref_store(t, idx, value);
    }
}

/* See fa_fuzz_gen.h. */
fa_tensor *fz_tensor(fz_case *c, const char *name, fa_dtype dt, int nd,
                            const int64_t *shape, int role)
{
    fz_src *s = c->src;
    if (c->n_tensors == FZ_MAX_TENSORS)
        fz_fail(c, "too many tensors");
    fa_tensor *t = &c->tensors[c->n_tensors];
    int *backed = &c->backed[c->n_tensors];
    void **alloc = &c->allocs[c->n_tensors++];
    memset(t, 0, sizeof *t);
    t->dtype = dt;
    t->ndim = nd;
    memcpy(t->shape, shape, (size_t)nd * sizeof *shape);
    if (c->chaos && fz_chance(s, 3)) {
        static const int64_t odd[] = {0, -1, 1, 2, (int64_t)1 << 20, (int64_t)1 << 32,
                                      FA_MAX_EXTENT, FA_MAX_EXTENT + 1, INT64_MAX, INT64_MIN};
        const int i = (int)fz_below(s, (uint64_t)(nd > 0 ? nd : 1));
        const int64_t x = t->shape[i];
        t->shape[i] = fz_chance(s, 50) && x > INT64_MIN + 1 && x < INT64_MAX - 1
                          ? x + fz_range(s, -1, 1)
                          : FZ_PICK(s, odd);
        fz_note(c, "(%s shape[%d] = %lld)", name, i, (long long)t->shape[i]);
    }
    if (c->chaos && fz_chance(s, 1)) {
        t->ndim = (int)fz_range(s, -1, FA_MAX_DIMS + 1);
        if (t->ndim < 0 || t->ndim > FA_MAX_DIMS)
            t->ndim = t->ndim < 0 ? 0 : FA_MAX_DIMS;
        fz_note(c, "(%s ndim %d)", name, t->ndim);
    }
    if (c->chaos && fz_chance(s, 1)) {
        t->dtype = (fa_dtype)fz_range(s, 0, 6);
        fz_note(c, "(%s dtype %d)", name, (int)t->dtype);
    }
    fz_strides(c, t, name);

    int over = 0;
    for (int i = 0; i < t->ndim; i++)
        over |= t->shape[i] > FA_MAX_EXTENT;
    const int64_t n = fz_numel(t);
    int64_t lo, hi;
    const int reach = fz_reach(t, &lo, &hi);
    over |= n > FA_MAX_EXTENT || !reach || lo < -FA_MAX_EXTENT || hi > FA_MAX_EXTENT ||
            hi - lo >= FA_MAX_EXTENT;
    size_t es = fa_dtype_size(t->dtype);
    if (es == 0)
        es = 1;
    if (over) {
        /* The library must refuse before it reads anything of it. */
        c->must_fail = 1;
        *alloc = fz_chance(s, 70) ? calloc(1, FZ_TINY) : NULL;
        t->data = *alloc;
        fz_note(c, "(%s: claim past the limits over %s)", name, t->data ? "64 bytes" : "NULL");
    } else if (n == 0) {
        *alloc = fz_chance(s, 50) ? calloc(1, 16) : NULL;
        t->data = *alloc;
    } else if (n <= FZ_CAP && hi - lo + 1 <= FZ_CAP && !(c->chaos && fz_chance(s, 3))) {
        const size_t bytes = (size_t)(hi - lo + 1) * es;
        *alloc = malloc(bytes);
        if (!*alloc)
            fz_fail(c, "out of memory for %zu bytes", bytes);
        memset(*alloc, role == FZ_IDX ? 0 : 0xff, bytes); /* 0xff..: NaN in every float dtype */
        t->data = (char *)*alloc + (size_t)(-lo) * es;
        *backed = fa_dtype_size(t->dtype) != 0;
        if (role == FZ_IN && *backed) {
            int64_t idx[FA_MAX_DIMS] = {0};
            do
                fz_store(t, idx, fz_uniform(s, -2.0, 2.0));
            while (fz_next(t, idx));
            if (c->chaos && fz_chance(s, 3)) {
                memset(idx, 0, sizeof idx);
                fz_store(t, idx, fz_chance(s, 50) ? NAN : INFINITY);
                c->nonfinite = 1;
                fz_note(c, "(%s holds a non-finite value)", name);
            }
        }
    } else {
        /* A real claim too large to back (or a NULL by choice): must be refused. */
        c->must_fail = 1;
        t->data = NULL;
        fz_note(c, "(%s: NULL data under %lld elements)", name, (long long)n);
    }
    return t;
}

/* Whether t (made by fz_tensor) has a real buffer under every element it claims. */
int fz_backed(const fz_case *c, const fa_tensor *t)
{
    for (int i = 0; t && i < c->n_tensors; i++)
        if (t == &c->tensors[i])
            return c->backed[i];
    return 0;
}

/* Element i of an int32 vector / [row, col] of an int32 matrix, when its buffer is real. */
void fz_set_i32(const fz_case *c, const fa_tensor *t, int64_t row, int64_t col,
                       int64_t value)
{
    if (!fz_backed(c, t) || t->dtype != FA_DTYPE_I32 || t->ndim < 1 || t->ndim > 2)
        return;
    if (row >= t->shape[0] || (t->ndim == 2 && col >= t->shape[1]))
        return;
    const int64_t idx[2] = {row, col};
    fz_store(t, idx, (double)(int32_t)value);
}

/* Output elements must be finite (lse: not NaN, and -inf/+inf only where allowed). */
void fz_check_finite(const fz_case *c, const fa_tensor *t, const char *name, int allow_inf)
{
    if (!t || !fz_backed(c, t) || fz_numel(t) == 0)
        return;
    int64_t idx[FA_MAX_DIMS] = {0};
    do {
        const double x = fa_ref_load(t, idx);
        if (isnan(x) || (!allow_inf && isinf(x)))
            fz_fail(c, "returned OK with %s[%lld, %lld, %lld, ...] = %g on finite inputs", name,
                    (long long)idx[0], (long long)idx[1], (long long)idx[2], x);
    } while (fz_next(t, idx));
}

/* The status contract of one call. Returns whether the outputs should be checked. */
int fz_check_status(fz_case *c, fa_status st)
{
    if (st != FA_STATUS_OK && st != FA_STATUS_INVALID_ARGUMENT && st != FA_STATUS_UNSUPPORTED &&
        st != FA_STATUS_OUT_OF_MEMORY && st != FA_STATUS_INTERNAL)
        fz_fail(c, "returned status %d, which is no fa_status", (int)st);
    const char *msg = fa_last_error();
    if (st != FA_STATUS_OK && (!msg || !*msg))
        fz_fail(c, "returned %s with an empty fa_last_error()", fa_status_string(st));
    if (st == FA_STATUS_OK && c->must_fail)
        fz_fail(c, "returned OK on arguments it must refuse");
    if (st == FA_STATUS_INTERNAL)
        fz_fail(c, "returned an internal error: %s", msg);
    c->calls++;
    c->accepted += st == FA_STATUS_OK;
    if (getenv("FA_FUZZ_VERBOSE"))
        fprintf(stderr, "  %s: %s%s\n", c->entry, st == FA_STATUS_OK ? "ok" : msg,
                c->must_fail ? " (must fail)" : "");
    return st == FA_STATUS_OK && !c->nonfinite;
}

/* ---- scalars ----------------------------------------------------------------------------- */

double fz_scale(fz_case *c)
{
    static const double odd[] = {0.0, -0.5, 1.0, 3.0, FA_MAX_SOFTMAX_SCALE,
                                 -FA_MAX_SOFTMAX_SCALE, 1e-40, 1e-300};
    static const double bad[] = {FA_MAX_SOFTMAX_SCALE * 1.5, 1e11, 1e39, -1e39, INFINITY,
                                 -INFINITY};
    fz_src *s = c->src;
    const int k = (int)fz_below(s, c->chaos ? 20 : 19);
    double x = k < 10 ? NAN : k < 16 ? fz_uniform(s, 0.05, 1.0) : k < 19 ? FZ_PICK(s, odd)
                                                                          : FZ_PICK(s, bad);
    if (k == 19)
        c->must_fail = 1;
    fz_note(c, " scale %g", x);
    return x;
}

double fz_softcap(fz_case *c)
{
    static const double odd[] = {-3.0, FA_MIN_SOFTCAP, FA_MAX_SOFTCAP, 30.0, 0.5};
    static const double bad[] = {1e-5, FA_MAX_SOFTCAP * 2, 1e38, INFINITY, NAN, -INFINITY};
    fz_src *s = c->src;
    const int k = (int)fz_below(s, c->chaos ? 20 : 19);
    double x = k < 13 ? 0.0 : k < 16 ? fz_uniform(s, 1.0, 20.0) : k < 19 ? FZ_PICK(s, odd)
                                                                         : FZ_PICK(s, bad);
    if (k == 19)
        c->must_fail = 1;
    fz_note(c, " softcap %g", x);
    return x;
}

int fz_window(fz_case *c, const char *name)
{
    static const int odd[] = {-2, INT_MIN, INT_MAX, 0, 1};
    fz_src *s = c->src;
    const int k = (int)fz_below(s, 10);
    int w = k < 6 ? -1 : k < 9 || !c->chaos ? (int)fz_range(s, 0, 8) : FZ_PICK(s, odd);
    if (w < -1)
        c->must_fail = 1;
    fz_note(c, " %s %d", name, w);
    return w;
}

int fz_threads(fz_case *c)
{
    static const int odd[] = {-1, 1 << 20, INT_MAX, 1024, 1025, INT_MIN};
    fz_src *s = c->src;
    int n = !c->chaos || fz_chance(s, 85) ? (int)fz_range(s, 0, 3) : FZ_PICK(s, odd);
    if (n < 0)
        c->must_fail = 1;
    fz_note(c, " threads %d", n);
    return n;
}

int fz_device(fz_case *c)
{
    fz_src *s = c->src;
    const int k = c->chaos ? (int)fz_below(s, 40) : 40;
    /* Host buffers never go to a real GPU. */
    int dev = k == 0 ? -2 : k == 1 && fa_cuda_device_count() == 0 ? 0 : FA_DEVICE_CPU;
    if (dev < FA_DEVICE_CPU)
        c->must_fail = 1;
    if (dev != FA_DEVICE_CPU)
        fz_note(c, " device %d", dev);
    return dev;
}

fa_dtype fz_float_dtype(fz_src *s)
{
    static const fa_dtype dts[] = {FA_DTYPE_F32,  FA_DTYPE_F32, FA_DTYPE_F16,
                                   FA_DTYPE_BF16, FA_DTYPE_BF16, FA_DTYPE_F64,
                                   FA_DTYPE_F32,  FA_DTYPE_BF16, FA_DTYPE_F8E4M3,
                                   FA_DTYPE_F8E5M2};
    return FZ_PICK(s, dts);
}

/* A sequence length: 0 and 1 often, up to 40. */
int64_t fz_len(fz_src *s)
{
    const int k = (int)fz_below(s, 10);
    return k == 0 ? 0 : k == 1 ? 1 : k < 8 ? fz_range(s, 2, 12) : fz_range(s, 13, 40);
}

int64_t fz_head_dim(const fz_case *c)
{
    static const int64_t odd[] = {FA_MAX_HEAD_DIM, 64, 128, 0, -1, FA_MAX_HEAD_DIM + 1};
    fz_src *s = c->src;
    return fz_chance(s, 90) ? fz_range(s, 1, 24) : odd[fz_below(s, c->chaos ? 6 : 3)];
}


fz_dims fz_problem(fz_case *c)
{
    fz_src *s = c->src;
    fz_dims p;
    p.dt = fz_float_dtype(s);
    p.b = fz_chance(s, 95) ? fz_range(s, 1, 3) : 0;
    p.sq = fz_len(s);
    p.sk = fz_len(s);
    p.hk = fz_range(s, 1, 2);
    p.h = p.hk * fz_range(s, 1, 2) + (fz_chance(s, 3) ? 1 : 0);
    p.d = fz_head_dim(c);
    p.dv = fz_chance(s, 70) ? p.d : fz_head_dim(c);
    fz_note(c, "%s b %lld sq %lld sk %lld h %lld hk %lld d %lld dv %lld;", fa_dtype_name(p.dt),
            (long long)p.b, (long long)p.sq, (long long)p.sk, (long long)p.h, (long long)p.hk,
            (long long)p.d, (long long)p.dv);
    return p;
}

/* An lse tensor's dtype: fp32, or fp64 with fp64 inputs. */
fa_dtype fz_lse_dtype(fz_src *s, fa_dtype dt)
{
    return dt == FA_DTYPE_F64 && fz_chance(s, 50) ? FA_DTYPE_F64 : FA_DTYPE_F32;
}

/* Makes out share q's buffer now and then: the library must refuse it. */
void fz_maybe_alias(fz_case *c, fa_tensor *out, const fa_tensor *in, const char *in_name)
{
    if (!c->chaos || !fz_chance(c->src, 5) || !in->data || !out->data || fz_numel(in) == 0 ||
        fz_numel(out) == 0)
        return;
    out->data = in->data;
    c->backed[out - c->tensors] = 0;
    c->must_fail = 1;
    fz_note(c, " (out aliases %s)", in_name);
}
