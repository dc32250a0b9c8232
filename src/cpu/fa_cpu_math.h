/*
 * Elementwise math for the CPU kernels' softmax epilogues, written as branch-free arithmetic so
 * that loops over a row of scores vectorise (libm's expf and tanhf are calls).
 */
#ifndef FA_CPU_MATH_H
#define FA_CPU_MATH_H

#include <stdint.h>
#include <string.h>

static inline uint32_t fa_math_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float fa_math_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/*
 * exp(x) within ~2 ulp for x <= 88; 0 below -87.3 (so exp(-inf) = 0, as masked scores need);
 * NaN for NaN (a NaN score must reach the row's sum and output).
 * x = n ln2 + r with n = round(x log2 e) taken from the low mantissa bits of x log2 e + 1.5*2^23,
 * ln2 split in two so r is exact, exp(r) by its degree-6 Taylor polynomial on |r| <= ln2/2
 * (truncation 1.2e-7 relative), then times 2^n built in an exponent field: a product (exact,
 * the result is normal) rather than an integer add to p's bits, so that a NaN p stays NaN.
 */
static inline float fa_expf(float x)
{
    const float shift = 12582912.0f; /* 1.5 * 2^23 */
    float xc = x < -87.3f ? -87.3f : x;
    xc = xc > 88.0f ? 88.0f : xc;
    const float t = xc * 1.44269504088896341f + shift;
    const float n = t - shift;
    const uint32_t ni = fa_math_bits(t) - (fa_math_bits(shift) - 127); /* n + 127 */
    float r = xc - n * 0.693145751953125f;
    r = r - n * 1.42860682030941723e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const float y = p * fa_math_float(ni << 23);
    return x < -87.3f ? 0.0f : y;
}

/* tanh(x) = 1 - 2 / (exp(2x) + 1): absolute error ~1e-7, exact limits +-1. */
static inline float fa_tanhf(float x)
{
    return 1.0f - 2.0f / (fa_expf(2.0f * x) + 1.0f);
}

#endif /* FA_CPU_MATH_H */
