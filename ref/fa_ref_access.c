/*
 * fa_ref: rounding to the library's formats and element access, in plain C from the formats'
 * definitions (nothing shared with src/).
 */
#include "fa_ref.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------ */
/* Rounding and element access                                                                 */

/* Round x to a binary format with p significand bits (including the implicit one), minimum
   normal exponent emin and largest finite value maxv; ties to even, overflow to infinity. */
static double round_format(double x, int p, int emin, double maxv)
{
    if (!isfinite(x) || x == 0.0) {
        return x;
    }
    int e;
    (void)frexp(x, &e); /* |x| = m * 2^e, m in [0.5, 1): leading bit has exponent e - 1 */
    int lead = e - 1;
    if (lead < emin) {
        lead = emin; /* subnormal range: fixed quantum */
    }
    int quantum = lead - (p - 1);
    double y = ldexp(nearbyint(ldexp(x, -quantum)), quantum);
    if (fabs(y) > maxv) {
        return copysign(INFINITY, x);
    }
    return y;
}

double fa_ref_round(double x, fa_dtype dtype)
{
    switch (dtype) {
    case FA_DTYPE_F16:
        return round_format(x, 11, -14, 65504.0);
    case FA_DTYPE_BF16:
        return round_format(x, 8, -126, ldexp(255.0, 120)); /* (2 - 2^-7) * 2^127 */
    case FA_DTYPE_F32:
        return round_format(x, 24, -126, ldexp(16777215.0, 104)); /* (2 - 2^-23) * 2^127 */
    case FA_DTYPE_F8E4M3: { /* no infinities: torch saturates overflow (and inf) to 448 */
        if (isnan(x)) {
            return x;
        }
        double y = round_format(x, 4, -6, INFINITY);
        return fabs(y) > 448.0 ? copysign(448.0, x) : y;
    }
    case FA_DTYPE_F8E5M2:
        return round_format(x, 3, -14, 57344.0);
    case FA_DTYPE_I32:
        return nearbyint(x);
    case FA_DTYPE_F64:
    default:
        return x;
    }
}

/* fp8 code -> value from the format's fields: bias, mantissa bits, and which top codes are
   special (e4m3fn: only S.1111.111 is NaN; e5m2: exponent 31 is inf/NaN as IEEE). */
static double fp8_to_double(uint8_t b, fa_dtype dt)
{
    const int e4m3 = dt == FA_DTYPE_F8E4M3;
    const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, emax = e4m3 ? 15 : 31;
    const int ex = (b & 0x7f) >> mbits, mant = b & ((1 << mbits) - 1);
    double v;
    if (e4m3 && ex == emax && mant == (1 << mbits) - 1) {
        v = NAN;
    } else if (!e4m3 && ex == emax) {
        v = mant ? NAN : INFINITY;
    } else if (ex == 0) {
        v = ldexp((double)mant, 1 - bias - mbits);
    } else {
        v = ldexp((double)(mant + (1 << mbits)), ex - bias - mbits);
    }
    return (b & 0x80) ? -v : v;
}

/* value -> fp8 code: the code whose value equals the rounded value (a search over the 128
   magnitudes keeps this independent of any bit trick). */
static uint8_t double_to_fp8(double x, fa_dtype dt)
{
    uint8_t sign = signbit(x) ? 0x80 : 0;
    if (isnan(x)) {
        return (uint8_t)(sign | 0x7f);
    }
    double y = fabs(fa_ref_round(x, dt));
    for (int c = 0; c < 128; c++) {
        if (fp8_to_double((uint8_t)c, dt) == y) {
            return (uint8_t)(sign | c);
        }
    }
    return (uint8_t)(sign | 0x7f);
}

double fa_ref_fp8_value(uint8_t code, fa_dtype dtype)
{
    return fp8_to_double(code, dtype);
}

static double half_to_double(uint16_t h)
{
    int sign = (h >> 15) & 1;
    int ex = (h >> 10) & 0x1f;
    int mant = h & 0x3ff;
    double v;
    if (ex == 0) {
        v = ldexp((double)mant, -24);
    } else if (ex == 31) {
        v = mant ? NAN : INFINITY;
    } else {
        v = ldexp((double)(mant + 1024), ex - 25);
    }
    return sign ? -v : v;
}

static uint16_t double_to_half(double x)
{
    double y = fa_ref_round(x, FA_DTYPE_F16);
    uint16_t sign = signbit(y) ? 0x8000 : 0;
    if (isnan(y)) {
        return (uint16_t)(sign | 0x7e00);
    }
    y = fabs(y);
    if (isinf(y)) {
        return (uint16_t)(sign | 0x7c00);
    }
    if (y < ldexp(1.0, -14)) { /* subnormal or zero: multiple of 2^-24 */
        return (uint16_t)(sign | (uint16_t)ldexp(y, 24));
    }
    int e;
    (void)frexp(y, &e);
    int lead = e - 1;                                    /* -14 .. 15 */
    uint32_t mant = (uint32_t)ldexp(y, 10 - lead) - 1024; /* 10 fraction bits */
    return (uint16_t)(sign | (uint16_t)((lead + 15) << 10) | (uint16_t)mant);
}

static double bf16_to_double(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return (double)f;
}

static uint16_t double_to_bf16(double x)
{
    if (isnan(x)) {
        return (uint16_t)(signbit(x) ? 0xffc0 : 0x7fc0);
    }
    float f = (float)fa_ref_round(x, FA_DTYPE_BF16); /* exact: a bf16 value is a float */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)(bits >> 16);
}

static int64_t tensor_offset(const fa_tensor *t, const int64_t *idx)
{
    int64_t off = 0;
    for (int i = 0; i < t->ndim; i++) {
        off += idx[i] * t->stride[i];
    }
    return off;
}

double fa_ref_load(const fa_tensor *t, const int64_t *idx)
{
    int64_t off = tensor_offset(t, idx);
    switch (t->dtype) {
    case FA_DTYPE_F32:
        return (double)((const float *)t->data)[off];
    case FA_DTYPE_F16:
        return half_to_double(((const uint16_t *)t->data)[off]);
    case FA_DTYPE_BF16:
        return bf16_to_double(((const uint16_t *)t->data)[off]);
    case FA_DTYPE_F64:
        return ((const double *)t->data)[off];
    case FA_DTYPE_I32:
        return (double)((const int32_t *)t->data)[off];
    case FA_DTYPE_F8E4M3:
    case FA_DTYPE_F8E5M2:
        return fp8_to_double(((const uint8_t *)t->data)[off], t->dtype);
    }
    return NAN;
}

void fa_ref_store(const fa_tensor *t, const int64_t *idx, double value)
{
    int64_t off = tensor_offset(t, idx);
    switch (t->dtype) {
    case FA_DTYPE_F32:
        ((float *)t->data)[off] = (float)fa_ref_round(value, FA_DTYPE_F32);
        break;
    case FA_DTYPE_F16:
        ((uint16_t *)t->data)[off] = double_to_half(value);
        break;
    case FA_DTYPE_BF16:
        ((uint16_t *)t->data)[off] = double_to_bf16(value);
        break;
    case FA_DTYPE_F64:
        ((double *)t->data)[off] = value;
        break;
    case FA_DTYPE_I32:
        ((int32_t *)t->data)[off] = (int32_t)nearbyint(value);
        break;
    case FA_DTYPE_F8E4M3:
    case FA_DTYPE_F8E5M2:
        ((uint8_t *)t->data)[off] = double_to_fp8(value, t->dtype);
        break;
    }
}

