#define _POSIX_C_SOURCE 200809L
#include "test_util.h"

#include <ctype.h>
#include <signal.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fa_ref.h"

int tu_failures = 0;
uint64_t tu_seed = 0;
const char *tu_where = "";

/* ---- RNG --------------------------------------------------------------------------------- */

uint64_t tu_rng_u64(tu_rng *r)
{
    uint64_t z = (r->state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double tu_rng_uniform(tu_rng *r, double lo, double hi)
{
    double u = (double)(tu_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0);
    return lo + (hi - lo) * u;
}

int64_t tu_rng_int(tu_rng *r, int64_t lo, int64_t hi)
{
    if (hi <= lo) {
        return lo;
    }
    uint64_t span = (uint64_t)(hi - lo) + 1;
    return lo + (int64_t)(tu_rng_u64(r) % span);
}

int tu_rng_chance(tu_rng *r, double p)
{
    return tu_rng_uniform(r, 0.0, 1.0) < p;
}

uint64_t tu_master_seed(const char *test_name)
{
    setvbuf(stdout, NULL, _IOLBF, 0); /* failures show up in order, even through a pipe */
    const char *env = getenv("FA_TEST_SEED");
    uint64_t seed;
    if (env && *env) {
        seed = strtoull(env, NULL, 0);
    } else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        seed = ((uint64_t)ts.tv_sec * 1000000007ull) ^ (uint64_t)ts.tv_nsec ^
               ((uint64_t)getpid() << 32);
    }
    tu_seed = seed;
    printf("%s: seed %llu (rerun with FA_TEST_SEED=%llu)\n", test_name, (unsigned long long)seed,
           (unsigned long long)seed);
    fflush(stdout);
    return seed;
}

/* ---- failures ---------------------------------------------------------------------------- */

void tu_fail(const char *file, int line, const char *fmt, ...)
{
    tu_failures++;
    if (tu_failures > 200) {
        return; /* enough said */
    }
    fprintf(stdout, "FAIL %s:%d [seed %llu] [%s]: ", file, line, (unsigned long long)tu_seed,
            tu_where);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stdout, fmt, ap);
    va_end(ap);
    fputc('\n', stdout);
    fflush(stdout);
}

int tu_finish(const char *test_name)
{
    if (tu_failures) {
        printf("%s: %d failure(s), seed %llu (rerun with FA_TEST_SEED=%llu)\n", test_name,
               tu_failures, (unsigned long long)tu_seed, (unsigned long long)tu_seed);
        return 1;
    }
    printf("%s: all checks passed\n", test_name);
    return 0;
}

double tu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- tensors ----------------------------------------------------------------------------- */

static size_t dtype_bytes(fa_dtype dt)
{
    switch (dt) {
    case FA_DTYPE_F8E4M3:
    case FA_DTYPE_F8E5M2:
        return 1;
    case FA_DTYPE_F16:
    case FA_DTYPE_BF16:
        return 2;
    case FA_DTYPE_F64:
        return 8;
    case FA_DTYPE_F32:
    case FA_DTYPE_I32:
    default:
        return 4;
    }
}

int64_t tu_numel(const fa_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) {
        n *= t->shape[i] > 0 ? t->shape[i] : 0;
    }
    return n;
}

/* largest offset reached by the view, or -1 when it has no element */
static int64_t view_span(const fa_tensor *t)
{
    if (tu_numel(t) == 0) {
        return -1;
    }
    int64_t off = 0;
    for (int i = 0; i < t->ndim; i++) {
        off += (t->shape[i] - 1) * t->stride[i];
    }
    return off;
}

/* strides of a layout; returns the element count the view's span needs */
static int64_t make_strides(int ndim, const int64_t *shape, int layout, tu_rng *r, int64_t *stride)
{
    int order[FA_MAX_DIMS + 1]; /* memory order of the leading dims, outermost first */
    for (int i = 0; i < ndim - 1; i++) {
        order[i] = i;
    }
    if (layout == TU_PERMUTED) {
        for (int i = ndim - 2; i > 0; i--) {
            int j = (int)tu_rng_int(r, 0, i);
            int tmp = order[i];
            order[i] = order[j];
            order[j] = tmp;
        }
    }
    stride[ndim - 1] = 1;
    int64_t extent = shape[ndim - 1] > 0 ? shape[ndim - 1] : 1;
    if (layout != TU_CONTIGUOUS) {
        extent += tu_rng_int(r, 0, 3);
    }
    for (int k = ndim - 2; k >= 0; k--) {
        int dim = order[k];
        stride[dim] = extent > 0 ? extent : 1;
        extent = stride[dim] * (shape[dim] > 0 ? shape[dim] : 1);
        if (layout != TU_CONTIGUOUS) {
            extent += tu_rng_int(r, 0, 2) * tu_rng_int(r, 1, 5);
        }
    }
    return extent;
}

static tu_tensor alloc_view(fa_dtype dtype, int ndim, const int64_t *shape, const int64_t *stride)
{
    tu_tensor T;
    memset(&T, 0, sizeof T);
    T.t.dtype = dtype;
    T.t.ndim = ndim;
    for (int i = 0; i < ndim; i++) {
        T.t.shape[i] = shape[i];
        T.t.stride[i] = stride[i];
    }
    T.elem_size = dtype_bytes(dtype);
    int64_t span = view_span(&T.t);
    size_t nelem = (size_t)(span + 1) + 2 * TU_GUARD;
    T.nbytes = nelem * T.elem_size;
    T.base = malloc(T.nbytes);
    if (!T.base) {
        fprintf(stderr, "out of memory (%zu bytes)\n", T.nbytes);
        exit(2);
    }
    memset(T.base, 0x5a, T.nbytes);
    T.t.data = (char *)T.base + TU_GUARD * T.elem_size;
    T.owner = 1;
    return T;
}

tu_tensor tu_tensor_new(fa_dtype dtype, int ndim, const int64_t *shape, int layout, tu_rng *r)
{
    int64_t stride[FA_MAX_DIMS] = {0};
    make_strides(ndim, shape, layout, r, stride);
    return alloc_view(dtype, ndim, shape, stride);
}

void tu_tensor_packed(fa_dtype dtype, int ndim, const int64_t *shape, int nparts, int layout,
                      tu_rng *r, tu_tensor *views)
{
    int64_t full_shape[FA_MAX_DIMS + 1] = {0}, full_stride[FA_MAX_DIMS + 1] = {0};
    int pos = ndim - 2; /* the parts dim goes before the head dim */
    for (int i = 0, k = 0; i < ndim + 1; i++) {
        full_shape[i] = (i == pos) ? nparts : shape[k++];
    }
    make_strides(ndim + 1, full_shape, layout, r, full_stride);
    int64_t span = 0;
    for (int i = 0; i < ndim + 1; i++) {
        span += (full_shape[i] > 0 ? full_shape[i] - 1 : 0) * full_stride[i];
    }
    size_t esz = dtype_bytes(dtype);
    size_t nbytes = ((size_t)span + 1 + 2 * TU_GUARD) * esz;
    void *base = malloc(nbytes);
    if (!base) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    memset(base, 0x5a, nbytes);
    for (int p = 0; p < nparts; p++) {
        tu_tensor *T = &views[p];
        memset(T, 0, sizeof *T);
        T->t.dtype = dtype;
        T->t.ndim = ndim;
        for (int i = 0, k = 0; i < ndim + 1; i++) {
            if (i == pos) {
                continue;
            }
            T->t.shape[k] = full_shape[i];
            T->t.stride[k] = full_stride[i];
            k++;
        }
        T->t.data = (char *)base + (TU_GUARD + (size_t)p * (size_t)full_stride[pos]) * esz;
        T->base = base;
        T->nbytes = nbytes;
        T->elem_size = esz;
        T->owner = (p == 0);
    }
}

void tu_tensor_free(tu_tensor *t)
{
    if (t->owner) {
        free(t->base);
    }
    memset(t, 0, sizeof *t);
}

int tu_next_index(const fa_tensor *t, int64_t *idx)
{
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (++idx[i] < t->shape[i]) {
            return 1;
        }
        idx[i] = 0;
    }
    return 0;
}

void tu_fill_uniform(tu_tensor *T, tu_rng *r, double lo, double hi)
{
    if (tu_numel(&T->t) == 0) {
        return;
    }
    int64_t idx[FA_MAX_DIMS] = {0};
    do {
        double x;
        do {
            x = fa_ref_round(tu_rng_uniform(r, lo, hi), T->t.dtype);
        } while (x == 0.0);
        fa_ref_store(&T->t, idx, x);
    } while (tu_next_index(&T->t, idx));
}

static void poison_bytes(fa_dtype dt, unsigned char *out)
{
    uint64_t v;
    switch (dt) {
    case FA_DTYPE_F16:
        v = 0x7e5a; /* quiet NaN, payload */
        break;
    case FA_DTYPE_BF16:
        v = 0x7fe5;
        break;
    case FA_DTYPE_F64:
        v = 0x7ff8a5a5a5a5a5a5ull;
        break;
    case FA_DTYPE_I32:
        v = 0x5a5a5a5a;
        break;
    case FA_DTYPE_F8E4M3:
    case FA_DTYPE_F8E5M2:
        v = 0x7f; /* NaN in both kinds */
        break;
    case FA_DTYPE_F32:
    default:
        v = 0x7fc5a5a5;
        break;
    }
    memcpy(out, &v, dtype_bytes(dt)); /* little endian */
}

void tu_poison(tu_tensor *T)
{
    unsigned char pat[8];
    poison_bytes(T->t.dtype, pat);
    size_t n = T->nbytes / T->elem_size;
    unsigned char *p = T->base;
    for (size_t i = 0; i < n; i++) {
        memcpy(p + i * T->elem_size, pat, T->elem_size);
    }
}

static unsigned char *view_mask(const tu_tensor *T, size_t *nelem)
{
    size_t n = T->nbytes / T->elem_size;
    unsigned char *mask = calloc(n ? n : 1, 1);
    if (!mask) {
        exit(2);
    }
    *nelem = n;
    if (tu_numel(&T->t) == 0) {
        return mask;
    }
    size_t first = (size_t)((const char *)T->t.data - (const char *)T->base) / T->elem_size;
    int64_t idx[FA_MAX_DIMS] = {0};
    do {
        int64_t off = 0;
        for (int i = 0; i < T->t.ndim; i++) {
            off += idx[i] * T->t.stride[i];
        }
        mask[first + (size_t)off] = 1;
    } while (tu_next_index(&T->t, idx));
    return mask;
}

int64_t tu_count_clobbered(const tu_tensor *T)
{
    size_t n;
    unsigned char *mask = view_mask(T, &n);
    unsigned char pat[8];
    poison_bytes(T->t.dtype, pat);
    const unsigned char *p = T->base;
    int64_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        if (!mask[i] && memcmp(p + i * T->elem_size, pat, T->elem_size) != 0) {
            bad++;
        }
    }
    free(mask);
    return bad;
}

int64_t tu_count_poisoned_in_view(const tu_tensor *T)
{
    size_t n;
    unsigned char *mask = view_mask(T, &n);
    unsigned char pat[8];
    poison_bytes(T->t.dtype, pat);
    const unsigned char *p = T->base;
    int64_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        if (mask[i] && memcmp(p + i * T->elem_size, pat, T->elem_size) == 0) {
            bad++;
        }
    }
    free(mask);
    return bad;
}

int tu_names(const char *msg, const char *name)
{
    size_t len = strlen(name);
    if (!msg || len == 0) {
        return 0;
    }
    for (const char *p = strstr(msg, name); p; p = strstr(p + 1, name)) {
        int before_ok = (p == msg) || !(isalnum((unsigned char)p[-1]) || p[-1] == '_');
        char after = p[len];
        int after_ok = !(isalnum((unsigned char)after) || after == '_');
        if (before_ok && after_ok) {
            return 1;
        }
    }
    return 0;
}

/* Random problem sizes for the sweeps: the edge values (0, 1, wider than the sequence) often. */
int64_t tu_rand_len(tu_rng *r)
{
    double u = tu_rng_uniform(r, 0.0, 1.0);
    if (u < 0.05) {
        return 0;
    }
    if (u < 0.15) {
        return 1;
    }
    if (u < 0.55) {
        return tu_rng_int(r, 2, 24);
    }
    if (u < 0.9) {
        return tu_rng_int(r, 25, 160);
    }
    return tu_rng_int(r, 161, 400);
}

int64_t tu_rand_head_dim(tu_rng *r)
{
    static const int64_t dims[] = {1, 7, 8, 16, 33, 64, 80, 96, 128, 160, 192, 256};
    if (tu_rng_chance(r, 0.2)) {
        return tu_rng_int(r, 1, 256);
    }
    return dims[tu_rng_int(r, 0, (int64_t)(sizeof dims / sizeof dims[0]) - 1)];
}

void tu_softmax_args(tu_rng *r, float *st, int64_t ld, int64_t rows, int64_t cols, float emul,
                     float *bmax, float *l)
{
    for (int64_t i = 0; i < cols; i++) {
        bmax[i] = (float)tu_rng_uniform(r, -20, 20);
        l[i] = (float)tu_rng_uniform(r, 0, 50);
    }
    for (int64_t j = 0; j < rows; j++)
        for (int64_t i = 0; i < ld; i++) {
            const double u = tu_rng_uniform(r, 0, 1);
            const double x = u < 0.05 ? -INFINITY : tu_rng_uniform(r, u < 0.5 ? -100 : -3, 5.5);
            st[j * ld + i] = (float)((x + bmax[i % cols]) / emul);
        }
}

int tu_exp_ok(float got, float s, float emul, float bmax)
{
    const float x = fmaf(s, emul, -bmax);
    if (isnan(x))
        return isnan(got); /* a NaN score must reach the row's sum */
    const double ref = x < -87.34f ? 0 : exp((double)x);
    /* 2^-126 = e^-87.3365 */
    return fabs((double)got - ref) <= ref * 1.2e-7 || (x < -87.33f && got == 0);
}

int tu_rand_window_side(tu_rng *r, int64_t sk)
{
    double u = tu_rng_uniform(r, 0.0, 1.0);
    if (u < 0.25) {
        return -1;
    }
    if (u < 0.4) {
        return 0;
    }
    if (u < 0.85) {
        return (int)tu_rng_int(r, 1, sk + 4);
    }
    return (int)tu_rng_int(r, sk + 5, 100000); /* wider than the sequence */
}

static const char *tu_watchdog_where = "";

/* Async-signal-safe: write(2) of a buffer the test keeps up to date, then _exit. */
static void tu_watchdog_fire(int sig)
{
    (void)sig;
    static const char head[] = "\nFAIL: TIMEOUT (no progress for 60 s) in ";
    ssize_t rc = write(STDOUT_FILENO, head, sizeof head - 1);
    rc = write(STDOUT_FILENO, tu_watchdog_where, strlen(tu_watchdog_where));
    rc = write(STDOUT_FILENO, "\n", 1);
    (void)rc;
    _exit(3);
}

void tu_watchdog_install(const char *where)
{
    tu_watchdog_where = where;
    signal(SIGALRM, tu_watchdog_fire);
}
