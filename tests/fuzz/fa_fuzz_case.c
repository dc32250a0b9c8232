/* The case generator and the contract checks of the fuzzer (fa_fuzz_case.h). */
#include "fa_fuzz_case.h"

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_ref.h"
#include "flashattn.h"

#define FZ_MAX_TENSORS 32
#define FZ_CAP ((int64_t)1 << 18) /* the most elements a claim gets a real buffer for */
#define FZ_TINY 64                /* bytes under a claim past the limits */

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
static uint64_t fz_below(fz_src *s, uint64_t n)
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

static int fz_chance(fz_src *s, int percent)
{
    return (int)fz_below(s, 100) < percent;
}

static int64_t fz_range(fz_src *s, int64_t lo, int64_t hi) /* [lo, hi] */
{
    return lo + (int64_t)fz_below(s, (uint64_t)(hi - lo) + 1);
}

static double fz_uniform(fz_src *s, double lo, double hi)
{
    return lo + (hi - lo) * (double)fz_below(s, 1u << 16) / 65536.0;
}

#define FZ_PICK(s, table) ((table)[fz_below((s), sizeof(table) / sizeof((table)[0]))])

/* ---- one case ---------------------------------------------------------------------------- */

typedef struct fz_case {
    fz_src *src;
    const char *entry;
    fa_tensor tensors[FZ_MAX_TENSORS];
    void *allocs[FZ_MAX_TENSORS];
    int backed[FZ_MAX_TENSORS]; /* a real buffer covers every element the view claims */
    int n_tensors;
    int must_fail; /* an argument the library must refuse */
    int nonfinite; /* an input holds NaN or Inf: outputs may too */
    int calls, accepted;
    int chaos; /* 0: every draw valid but the scalars' and indices' edges; 1: anything */
    char log[2048]; /* what was drawn, printed when the contract breaks */
    size_t log_len;
} fz_case;

static void fz_note(fz_case *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fz_note(fz_case *c, const char *fmt, ...)
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

static void fz_fail(const fz_case *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fz_fail(const fz_case *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fa_fuzz: %s: ", c->entry);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n  case: %s\n", c->log);
    abort();
}

enum { FZ_IN, FZ_OUT, FZ_IDX };

static int64_t fz_numel(const fa_tensor *t)
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

static int fz_next(const fa_tensor *t, int64_t *idx)
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
static void fz_store(const fa_tensor *t, const int64_t *idx, double value)
{
    if (t->dtype == FA_DTYPE_I32) {
        int64_t off = 0;
        for (int i = 0; i < t->ndim; i++)
            off += idx[i] * t->stride[i];
        ((int32_t *)t->data)[off] = (int32_t)value;
    } else {
        fa_ref_store(t, idx, value);
    }
}

/*
 * A tensor of the given shape, perhaps mutated, with adversarial strides; a real buffer exactly
 * as large as its reach where that is small (gaps NaN; inputs random in [-2, 2], outputs NaN,
 * indices 0), a small buffer or NULL under a claim past the library's limits (which must then
 * refuse the call), NULL under any other large claim (refused too: NULL data).
 */
static fa_tensor *fz_tensor(fz_case *c, const char *name, fa_dtype dt, int nd,
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
        t->shape[i] = fz_chance(s, 50) ? t->shape[i] + fz_range(s, -1, 1) : FZ_PICK(s, odd);
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
static int fz_backed(const fz_case *c, const fa_tensor *t)
{
    for (int i = 0; t && i < c->n_tensors; i++)
        if (t == &c->tensors[i])
            return c->backed[i];
    return 0;
}

/* Element i of an int32 vector / [row, col] of an int32 matrix, when its buffer is real. */
static void fz_set_i32(const fz_case *c, const fa_tensor *t, int64_t row, int64_t col,
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
static void fz_check_finite(const fz_case *c, const fa_tensor *t, const char *name, int allow_inf)
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
static int fz_check_status(fz_case *c, fa_status st)
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

static double fz_scale(fz_case *c)
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

static double fz_softcap(fz_case *c)
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

static int fz_window(fz_case *c, const char *name)
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

static int fz_threads(fz_case *c)
{
    static const int odd[] = {-1, 1 << 20, INT_MAX, 1024, 1025, INT_MIN};
    fz_src *s = c->src;
    int n = !c->chaos || fz_chance(s, 85) ? (int)fz_range(s, 0, 3) : FZ_PICK(s, odd);
    if (n < 0)
        c->must_fail = 1;
    fz_note(c, " threads %d", n);
    return n;
}

static int fz_device(fz_case *c)
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

static fa_dtype fz_float_dtype(fz_src *s)
{
    static const fa_dtype dts[] = {FA_DTYPE_F32, FA_DTYPE_F32, FA_DTYPE_F16, FA_DTYPE_BF16,
                                   FA_DTYPE_BF16, FA_DTYPE_F64};
    return FZ_PICK(s, dts);
}

/* A sequence length: 0 and 1 often, up to 40. */
static int64_t fz_len(fz_src *s)
{
    const int k = (int)fz_below(s, 10);
    return k == 0 ? 0 : k == 1 ? 1 : k < 8 ? fz_range(s, 2, 12) : fz_range(s, 13, 40);
}

static int64_t fz_head_dim(const fz_case *c)
{
    static const int64_t odd[] = {FA_MAX_HEAD_DIM, 64, 128, 0, -1, FA_MAX_HEAD_DIM + 1};
    fz_src *s = c->src;
    return fz_chance(s, 90) ? fz_range(s, 1, 24) : odd[fz_below(s, c->chaos ? 6 : 3)];
}

typedef struct fz_dims {
    fa_dtype dt;
    int64_t b, sq, sk, h, hk, d, dv;
} fz_dims;

static fz_dims fz_problem(fz_case *c)
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
static fa_dtype fz_lse_dtype(fz_src *s, fa_dtype dt)
{
    return dt == FA_DTYPE_F64 && fz_chance(s, 50) ? FA_DTYPE_F64 : FA_DTYPE_F32;
}

/* Makes out share q's buffer now and then: the library must refuse it. */
static void fz_maybe_alias(fz_case *c, fa_tensor *out, const fa_tensor *in, const char *in_name)
{
    if (!c->chaos || !fz_chance(c->src, 5) || !in->data || !out->data || fz_numel(in) == 0 ||
        fz_numel(out) == 0)
        return;
    out->data = in->data;
    c->backed[out - c->tensors] = 0;
    c->must_fail = 1;
    fz_note(c, " (out aliases %s)", in_name);
}

/* ---- entry points ------------------------------------------------------------------------ */

/* Dense or varlen forward arguments over fresh tensors; lse always (the backward needs it). */
static void fz_fwd_args(fz_case *c, fa_fwd_args *a, int varlen, int for_backward)
{
    fz_src *s = c->src;
    fz_dims p = fz_problem(c);
    fa_fwd_args_init(a);
    if (!varlen) {
        const int64_t qs[4] = {p.b, p.sq, p.h, p.d}, ks[4] = {p.b, p.sk, p.hk, p.d},
                      vs[4] = {p.b, p.sk, p.hk, p.dv}, os[4] = {p.b, p.sq, p.h, p.dv},
                      ls[3] = {p.b, p.h, p.sq};
        a->q = fz_tensor(c, "q", p.dt, 4, qs, FZ_IN);
        a->k = fz_tensor(c, "k", p.dt, 4, ks, FZ_IN);
        a->v = fz_tensor(c, "v", p.dt, 4, vs, FZ_IN);
        a->out = fz_tensor(c, "out", p.dt, 4, os, FZ_OUT);
        if (for_backward || fz_chance(s, 80))
            a->lse = fz_tensor(c, "lse", fz_lse_dtype(s, p.dt), 3, ls, FZ_OUT);
    } else {
        /* Sequence lengths, then offsets that leave rows outside every sequence now and then. */
        int64_t lq[4], lk[4], tq = 0, tk = 0, mq = 0, mk = 0;
        const int64_t b = p.b > 3 ? 3 : p.b;
        for (int64_t i = 0; i < b; i++) {
            lq[i] = fz_len(s);
            lk[i] = fz_len(s);
            tq += lq[i];
            tk += lk[i];
            mq = lq[i] > mq ? lq[i] : mq;
            mk = lk[i] > mk ? lk[i] : mk;
        }
        const int64_t q0 = fz_chance(s, 20) ? fz_range(s, 1, 3) : 0;
        const int64_t k0 = fz_chance(s, 20) ? fz_range(s, 1, 3) : 0;
        const int64_t total_q = tq + q0 + (fz_chance(s, 20) ? 2 : 0);
        const int64_t total_k = tk + k0 + (fz_chance(s, 20) ? 2 : 0);
        const int64_t qs[3] = {total_q, p.h, p.d}, ks[3] = {total_k, p.hk, p.d},
                      vs[3] = {total_k, p.hk, p.dv}, os[3] = {total_q, p.h, p.dv},
                      ls[2] = {p.h, total_q}, cs[1] = {b + 1}, us[1] = {b};
        a->q = fz_tensor(c, "q", p.dt, 3, qs, FZ_IN);
        a->k = fz_tensor(c, "k", p.dt, 3, ks, FZ_IN);
        a->v = fz_tensor(c, "v", p.dt, 3, vs, FZ_IN);
        a->out = fz_tensor(c, "out", p.dt, 3, os, FZ_OUT);
        if (for_backward || fz_chance(s, 80))
            a->lse = fz_tensor(c, "lse", fz_lse_dtype(s, p.dt), 2, ls, FZ_OUT);
        const fa_tensor *cq = fz_tensor(c, "cu_seqlens_q", FA_DTYPE_I32, 1, cs, FZ_IDX);
        const fa_tensor *ck = fz_tensor(c, "cu_seqlens_k", FA_DTYPE_I32, 1, cs, FZ_IDX);
        int64_t oq = q0, ok = k0;
        for (int64_t i = 0; i <= b; i++) {
            fz_set_i32(c, cq, i, 0, oq);
            fz_set_i32(c, ck, i, 0, ok);
            if (i < b) {
                oq += lq[i];
                ok += lk[i];
            }
        }
        if (fz_chance(s, 10)) { /* a bad offset: non-monotone, negative, past the end */
            static const int64_t odd[] = {-1, -5, INT32_MAX, INT32_MIN, 1000};
            const int64_t i = fz_range(s, 0, b);
            const int64_t x = fz_chance(s, 50) ? FZ_PICK(s, odd) : fz_range(s, 0, total_q + 2);
            fz_set_i32(c, fz_chance(s, 50) ? cq : ck, i, 0, x);
            fz_note(c, " (cu_seqlens[%lld] = %lld)", (long long)i, (long long)x);
        }
        a->cu_seqlens_q = cq;
        a->cu_seqlens_k = ck;
        static const int64_t odd_max[] = {-1, INT64_MAX, FA_MAX_EXTENT, FA_MAX_EXTENT + 1, 0};
        a->max_seqlen_q = fz_chance(s, 90) ? mq + (fz_chance(s, 20) ? 3 : 0) : FZ_PICK(s, odd_max);
        a->max_seqlen_k = fz_chance(s, 90) ? mk + (fz_chance(s, 20) ? 3 : 0) : FZ_PICK(s, odd_max);
        if (a->max_seqlen_q < 0 || a->max_seqlen_q > FA_MAX_EXTENT || a->max_seqlen_k < 0 ||
            a->max_seqlen_k > FA_MAX_EXTENT)
            c->must_fail = 1;
        fz_note(c, " max_seqlen %lld/%lld", (long long)a->max_seqlen_q,
                (long long)a->max_seqlen_k);
        if (fz_chance(s, 25)) {
            const fa_tensor *u = fz_tensor(c, "seqused_k", FA_DTYPE_I32, 1, us, FZ_IDX);
            for (int64_t i = 0; i < b; i++)
                fz_set_i32(c, u, i, 0, fz_chance(s, 95) ? fz_range(s, 0, lk[i]) : lk[i] + 1);
            a->seqused_k = u;
        }
    }
    fz_maybe_alias(c, (fa_tensor *)a->out, a->q, "q");
    if (fz_chance(s, 15)) {
        const int64_t as1[1] = {p.h}, as2[2] = {p.b, p.h};
        const int two = fz_chance(s, 50);
        fa_tensor *t = fz_tensor(c, "alibi_slopes", FA_DTYPE_F32, two ? 2 : 1, two ? as2 : as1,
                                 FZ_IN);
        a->alibi_slopes = t;
    }
    if (fz_chance(s, 15)) {
        const int64_t hs[1] = {p.h};
        a->sinks = fz_tensor(c, "sinks", FA_DTYPE_F32, 1, hs, FZ_IN);
    }
    if (!for_backward && !varlen && fz_chance(s, 10)) {
        const int64_t ps[4] = {p.b, p.h, p.sq + fz_range(s, 0, 2), p.sk + fz_range(s, 0, 2)};
        a->probs = fz_tensor(c, "probs", p.dt, 4, ps, FZ_OUT);
    }
    a->softmax_scale = fz_scale(c);
    a->softcap = fz_softcap(c);
    a->causal = fz_chance(s, 30);
    a->window_left = fz_window(c, "left");
    a->window_right = fz_window(c, "right");
    if (fz_chance(s, 20)) {
        static const double odd[] = {0.5, 0.99, -0.1, 1.0, NAN, INFINITY};
        a->dropout_p = fz_chance(s, 60) ? fz_uniform(s, 0.0, 0.9) : odd[fz_below(s, c->chaos ? 6 : 2)];
        if (!(a->dropout_p >= 0.0 && a->dropout_p < 1.0) ||
            (a->dropout_p > 0.0 && a->softcap > 0.0))
            c->must_fail = 1;
        fz_note(c, " dropout %g", a->dropout_p);
    }
    a->seed = fz_below(s, UINT64_MAX);
    a->offset = fz_chance(s, 90) ? fz_below(s, 1000) : UINT64_MAX - fz_below(s, 4);
    a->device = fz_device(c);
    a->num_threads = fz_threads(c);
}

static void fz_forward(fz_case *c, int varlen)
{
    c->entry = varlen ? "fa_attention_forward (varlen)" : "fa_attention_forward";
    fa_fwd_args a;
    fz_fwd_args(c, &a, varlen, 0);
    if (c->chaos && fz_chance(c->src, 2)) {
        a.q = NULL;
        c->must_fail = 1;
    }
    if (fz_check_status(c, fa_attention_forward(&a))) {
        fz_check_finite(c, a.out, "out", 0);
        fz_check_finite(c, a.lse, "lse", 1);
        fz_check_finite(c, a.probs, "probs", 0);
    }
}

/* A gradient shaped as `like`, perhaps mutated. */
static const fa_tensor *fz_like(fz_case *c, const char *name, const fa_tensor *like, int role)
{
    return fz_tensor(c, name, like->dtype, like->ndim, like->shape, role);
}

static void fz_backward(fz_case *c, int varlen)
{
    c->entry = "fa_attention_forward (before the backward)";
    fa_fwd_args a;
    fz_fwd_args(c, &a, varlen, 1);
    const int fwd_must_fail = c->must_fail;
    const fa_status fst = fa_attention_forward(&a);
    const int fwd_ok = fz_check_status(c, fst);
    c->entry = varlen ? "fa_attention_backward (varlen)" : "fa_attention_backward";
    fz_note(c, " | backward:");
    if (!fwd_ok && a.lse && fz_backed(c, a.lse) && fz_numel(a.lse) > 0) {
        /* The forward refused: the backward still gets an lse, of garbage. */
        int64_t idx[FA_MAX_DIMS] = {0};
        do
            fz_store(a.lse, idx, fz_uniform(c->src, -3.0, 3.0));
        while (fz_next(a.lse, idx));
    }
    if (fst != FA_STATUS_OK && fz_backed(c, a.out) && fz_numel(a.out) > 0) {
        int64_t idx[FA_MAX_DIMS] = {0};
        do
            fz_store(a.out, idx, fz_uniform(c->src, -1.0, 1.0));
        while (fz_next(a.out, idx));
    }
    fa_bwd_args g;
    fa_bwd_args_init(&g);
    g.fwd = &a;
    g.dout = fz_like(c, "dout", a.out, FZ_IN);
    g.dq = fz_like(c, "dq", a.q, FZ_OUT);
    g.dk = fz_like(c, "dk", a.k, FZ_OUT);
    g.dv = fz_like(c, "dv", a.v, FZ_OUT);
    if (a.sinks && fz_chance(c->src, 95)) {
        const int64_t hs[1] = {a.sinks->shape[0]};
        g.dsinks = fz_tensor(c, "dsinks", FA_DTYPE_F32, 1, hs, FZ_OUT);
    } else if (a.sinks) {
        c->must_fail = 1;
    }
    g.deterministic = fz_chance(c->src, 50);
    if (c->chaos && fz_chance(c->src, 3)) {
        a.lse = NULL;
        c->must_fail = 1;
    }
    (void)fa_attention_backward_workspace_size(&g);
    if (fz_check_status(c, fa_attention_backward(&g)) && fwd_ok && !fwd_must_fail) {
        fz_check_finite(c, g.dq, "dq", 0);
        fz_check_finite(c, g.dk, "dk", 0);
        fz_check_finite(c, g.dv, "dv", 0);
        fz_check_finite(c, g.dsinks, "dsinks", 0);
    }
}

static void fz_kvcache(fz_case *c)
{
    c->entry = "fa_attention_kvcache";
    fz_src *s = c->src;
    fz_dims p = fz_problem(c);
    fa_kvcache_args a;
    fa_kvcache_args_init(&a);
    const int paged = fz_chance(s, 40);
    const int64_t s_new = fz_chance(s, 50) ? fz_range(s, 0, 4) : -1; /* -1: no append */
    const int64_t page = paged ? fz_range(s, 1, 5) : 0;
    const int64_t max_blocks = paged ? fz_range(s, 1, 5) : 0;
    const int64_t n_blocks = paged ? fz_range(s, 1, p.b * max_blocks + 1) : 0;
    const int64_t b_cache = paged ? n_blocks : p.b + fz_range(s, 0, 2);
    const int64_t s_cache = paged ? page : fz_range(s, 0, 16);
    const int64_t capacity = paged ? page * max_blocks : s_cache;
    fz_note(c, " paged %d page %lld blocks %lld/%lld s_cache %lld s_new %lld;", paged,
            (long long)page, (long long)max_blocks, (long long)n_blocks, (long long)s_cache,
            (long long)s_new);
    const int64_t qs[4] = {p.b, p.sq, p.h, p.d}, os[4] = {p.b, p.sq, p.h, p.dv},
                  kc[4] = {b_cache, s_cache, p.hk, p.d}, vc[4] = {b_cache, s_cache, p.hk, p.dv},
                  bs[1] = {p.b}, ls[3] = {p.b, p.h, p.sq};
    a.q = fz_tensor(c, "q", p.dt, 4, qs, FZ_IN);
    a.k_cache = fz_tensor(c, "k_cache", p.dt, 4, kc, FZ_IN);
    a.v_cache = fz_tensor(c, "v_cache", p.dt, 4, vc, FZ_IN);
    a.out = fz_tensor(c, "out", p.dt, 4, os, FZ_OUT);
    if (fz_chance(s, 60))
        a.lse = fz_tensor(c, "lse", fz_lse_dtype(s, p.dt), 3, ls, FZ_OUT);
    if (s_new >= 0) {
        const int64_t ks[4] = {p.b, s_new, p.hk, p.d}, vs[4] = {p.b, s_new, p.hk, p.dv};
        a.k = fz_tensor(c, "k", p.dt, 4, ks, FZ_IN);
        a.v = fz_tensor(c, "v", p.dt, 4, vs, FZ_IN);
    }
    const int64_t room = capacity - (s_new > 0 ? s_new : 0);
    int32_t lens[4] = {0, 0, 0, 0};
    if (s_new >= 0 || fz_chance(s, 60)) {
        const fa_tensor *t = fz_tensor(c, "cache_seqlens", FA_DTYPE_I32, 1, bs, FZ_IDX);
        for (int64_t i = 0; i < p.b && i < 4; i++) {
            static const int64_t odd[] = {-1, INT32_MAX, INT32_MIN};
            int64_t x = room < 0 || fz_chance(s, 5) ? (fz_chance(s, 50) ? room + 1 : FZ_PICK(s, odd))
                                                    : fz_range(s, 0, room);
            lens[i] = (int32_t)x;
            fz_set_i32(c, t, i, 0, x);
        }
        a.cache_seqlens = t;
    }
    if (fz_chance(s, 15)) {
        const fa_tensor *t = fz_tensor(c, "cache_leftpad", FA_DTYPE_I32, 1, bs, FZ_IDX);
        for (int64_t i = 0; i < p.b && i < 4; i++)
            fz_set_i32(c, t, i, 0, fz_chance(s, 95) ? fz_range(s, 0, lens[i] > 0 ? lens[i] : 0) : -1);
        a.cache_leftpad = t;
    }
    if (paged) {
        const int64_t bt[2] = {p.b, max_blocks};
        const fa_tensor *t = fz_tensor(c, "block_table", FA_DTYPE_I32, 2, bt, FZ_IDX);
        for (int64_t i = 0; i < p.b; i++)
            for (int64_t j = 0; j < max_blocks; j++) {
                static const int64_t odd[] = {-1, INT32_MAX, INT32_MIN};
                int64_t x = fz_chance(s, 97) ? fz_range(s, 0, n_blocks - 1)
                                             : fz_chance(s, 50) ? n_blocks : FZ_PICK(s, odd);
                fz_set_i32(c, t, i, j, x);
            }
        a.block_table = t;
    } else if (fz_chance(s, 25)) {
        const fa_tensor *t = fz_tensor(c, "cache_batch_idx", FA_DTYPE_I32, 1, bs, FZ_IDX);
        for (int64_t i = 0; i < p.b; i++)
            fz_set_i32(c, t, i, 0, fz_chance(s, 95) ? fz_range(s, 0, b_cache - 1) : b_cache);
        a.cache_batch_idx = t;
    }
    if (s_new >= 0 && fz_chance(s, 30) && p.d >= 2) {
        const int64_t half = fz_range(s, 1, p.d / 2);
        const int64_t ro[2] = {capacity + p.sq + fz_range(s, -2, 2), half};
        fa_tensor *cs = fz_tensor(c, "rotary_cos", p.dt, 2, ro, FZ_OUT);
        fa_tensor *sn = fz_tensor(c, "rotary_sin", p.dt, 2, ro, FZ_OUT);
        /* Angles of a unit circle: cos and sin stay in [-1, 1]. */
        for (int which = 0; which < 2; which++) {
            fa_tensor *t = which ? sn : cs;
            if (!fz_backed(c, t) || fz_numel(t) == 0)
                continue;
            int64_t idx[FA_MAX_DIMS] = {0};
            do {
                const double ang = 0.1 * (double)idx[0] * (double)(idx[1] + 1);
                fz_store(t, idx, which ? sin(ang) : cos(ang));
            } while (fz_next(t, idx));
        }
        a.rotary_cos = cs;
        a.rotary_sin = sn;
        a.rotary_interleaved = fz_chance(s, 50);
    }
    if (fz_chance(s, 10)) {
        const int64_t hs[1] = {p.h};
        a.alibi_slopes = fz_tensor(c, "alibi_slopes", FA_DTYPE_F32, 1, hs, FZ_IN);
    }
    if (fz_chance(s, 10)) {
        const int64_t hs[1] = {p.h};
        a.sinks = fz_tensor(c, "sinks", FA_DTYPE_F32, 1, hs, FZ_IN);
    }
    fz_maybe_alias(c, (fa_tensor *)a.out, fz_chance(s, 50) ? a.q : a.k_cache, "an input");
    a.softmax_scale = fz_scale(c);
    a.softcap = fz_softcap(c);
    a.causal = fz_chance(s, 30);
    a.window_left = fz_window(c, "left");
    a.window_right = fz_window(c, "right");
    static const int odd_splits[] = {-1, FA_MAX_SPLITS, FA_MAX_SPLITS + 1, INT_MAX, 1, 2, 3};
    a.num_splits = fz_chance(s, 70) ? 0 : FZ_PICK(s, odd_splits);
    if (a.num_splits < 0 || a.num_splits > FA_MAX_SPLITS)
        c->must_fail = 1;
    a.device = fz_device(c);
    a.num_threads = fz_threads(c);
    if (fz_check_status(c, fa_attention_kvcache(&a))) {
        fz_check_finite(c, a.out, "out", 0);
        fz_check_finite(c, a.lse, "lse", 1);
    }
}

static void fz_combine(fz_case *c)
{
    c->entry = "fa_attention_combine";
    fz_src *s = c->src;
    const fa_dtype pd = fz_chance(s, 80) ? FA_DTYPE_F32 : FA_DTYPE_F64;
    static const int64_t odd_splits[] = {0, FA_MAX_SPLITS, FA_MAX_SPLITS + 1};
    const int64_t splits = fz_chance(s, 95) ? fz_range(s, 1, 5) : FZ_PICK(s, odd_splits);
    const int64_t b = fz_range(s, 1, 3), sq = fz_len(s), h = fz_range(s, 1, 3);
    const int64_t dv = fz_head_dim(c);
    if (splits < 1 || splits > FA_MAX_SPLITS)
        c->must_fail = 1;
    fz_note(c, "splits %lld b %lld sq %lld h %lld dv %lld;", (long long)splits, (long long)b,
            (long long)sq, (long long)h, (long long)dv);
    const int64_t ops[5] = {splits, b, sq, h, dv}, lps[4] = {splits, b, sq, h},
                  os[4] = {b, sq, h, dv}, ls[3] = {b, sq, h};
    fa_combine_args a;
    fa_combine_args_init(&a);
    a.out_partial = fz_tensor(c, "out_partial", pd, 5, ops, FZ_IN);
    fa_tensor *lp = fz_tensor(c, "lse_partial", pd, 4, lps, FZ_IN);
    if (fz_backed(c, lp) && fz_numel(lp) > 0) {
        /* Log-sum-exps, with empty parts (-inf, or +inf as the forward writes) now and then. */
        int64_t idx[FA_MAX_DIMS] = {0};
        do {
            const int k = (int)fz_below(s, 10);
            fz_store(lp, idx, k == 0 ? -INFINITY : k == 1 ? INFINITY : fz_uniform(s, -30, 30));
        } while (fz_next(lp, idx));
    }
    a.lse_partial = lp;
    a.out = fz_tensor(c, "out", fz_float_dtype(s), 4, os, FZ_OUT);
    if (fz_chance(s, 60))
        a.lse = fz_tensor(c, "lse", pd == FA_DTYPE_F64 && fz_chance(s, 50) ? pd : FA_DTYPE_F32,
                          3, ls, FZ_OUT);
    fz_maybe_alias(c, (fa_tensor *)a.out, a.out_partial, "out_partial");
    a.device = fz_device(c);
    a.num_threads = fz_threads(c);
    if (fz_check_status(c, fa_attention_combine(&a))) {
        fz_check_finite(c, a.out, "out", 0);
        fz_check_finite(c, a.lse, "lse", 1);
    }
}

/* Precompile with at least one argument the plan refuses (a valid one would run NVRTC for
 * seconds), and the small queries. */
static void fz_misc(fz_case *c)
{
    fz_src *s = c->src;
    c->entry = "fa_cuda_precompile";
    static const int archs[] = {0, -1, 79, 75, INT_MIN, 80, 90};
    static const int dims[] = {0, -1, FA_MAX_HEAD_DIM + 1, INT_MAX, INT_MIN, 64, 128};
    static const fa_dtype dts[] = {FA_DTYPE_F32, FA_DTYPE_F64, FA_DTYPE_I32, (fa_dtype)77,
                                   (fa_dtype)-1, FA_DTYPE_F16, FA_DTYPE_BF16};
    int arch = FZ_PICK(s, archs), d = FZ_PICK(s, dims), dv = FZ_PICK(s, dims);
    fa_dtype dt = FZ_PICK(s, dts);
    if (arch >= 80 && (dt == FA_DTYPE_F16 || dt == FA_DTYPE_BF16) && d >= 1 &&
        d <= FA_MAX_HEAD_DIM && dv >= 1 && dv <= FA_MAX_HEAD_DIM)
        d = 0;
    c->must_fail = 1;
    fz_note(c, "arch %d dtype %d d %d dv %d", arch, (int)dt, d, dv);
    int cached = -1;
    fz_check_status(c, fa_cuda_precompile(arch, dt, d, dv, (unsigned)fz_below(s, 1u << 8),
                                          fz_chance(s, 50) ? &cached : NULL));
    c->must_fail = 0;

    c->entry = "fa_cuda_device_info_get";
    fa_cuda_device_info info;
    const int dev = (int)fz_range(s, -3, 3);
    if (dev >= fa_cuda_device_count() || dev < 0)
        c->must_fail = 1;
    fz_check_status(c, fa_cuda_device_info_get(dev, fz_chance(s, 80) ? &info : NULL));
    c->must_fail = 0;

    static const int64_t odd[] = {0, -1, 1, INT64_MAX, INT64_MIN, 7};
    (void)fa_dropout_keep(fz_below(s, UINT64_MAX), fz_below(s, UINT64_MAX), FZ_PICK(s, odd),
                          FZ_PICK(s, odd), FZ_PICK(s, odd), FZ_PICK(s, odd), FZ_PICK(s, odd),
                          fz_chance(s, 50) ? NAN : fz_uniform(s, -1.0, 2.0));
    (void)fa_probs_block_n((int)FZ_PICK(s, odd), (int)fz_below(s, 3), (int)fz_below(s, 3));
    const int64_t shape[FA_MAX_DIMS] = {FZ_PICK(s, odd), FZ_PICK(s, odd), FZ_PICK(s, odd),
                                        FZ_PICK(s, odd), FZ_PICK(s, odd), FZ_PICK(s, odd)};
    fa_tensor t = fa_tensor_make(NULL, (fa_dtype)fz_range(s, -1, 6), (int)fz_range(s, -2, 8),
                                 fz_chance(s, 90) ? shape : NULL, NULL);
    (void)t;
    if (!fa_dtype_name((fa_dtype)fz_range(s, -5, 10)) ||
        !fa_status_string((fa_status)fz_range(s, -5, 10)) || !fa_version() ||
        !fa_cpu_description() || !fa_cuda_status())
        fz_fail(c, "a query returned NULL");
    (void)fa_dtype_size((fa_dtype)fz_range(s, -5, 10));
}

int fz_run_case(fz_src *s)
{
    fz_case *c = calloc(1, sizeof *c);
    if (!c)
        abort();
    c->src = s;
    c->chaos = fz_chance(s, 50);
    const int kind = (int)fz_below(s, 100);
    if (kind < 25)
        fz_forward(c, 0);
    else if (kind < 42)
        fz_forward(c, 1);
    else if (kind < 55)
        fz_backward(c, 0);
    else if (kind < 64)
        fz_backward(c, 1);
    else if (kind < 84)
        fz_kvcache(c);
    else if (kind < 96)
        fz_combine(c);
    else
        fz_misc(c);
    for (int i = 0; i < c->n_tensors; i++)
        free(c->allocs[i]);
    const int accepted = c->accepted;
    free(c);
    return accepted;
}
