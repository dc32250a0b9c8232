/* fp16 and bf16 <-> fp32 conversions in portable C, rounding to nearest even. */
#ifndef FA_HALF_H
#define FA_HALF_H

#include <stdint.h>
#include <string.h>

static inline float fa_bits_to_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t fa_f32_to_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float fa_bf16_to_f32(uint16_t h)
{
    return fa_bits_to_f32((uint32_t)h << 16);
}

static inline uint16_t fa_f32_to_bf16(float f)
{
    uint32_t u = fa_f32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it a quiet NaN */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/*
 * fp16 -> fp32 without branches, for loops over rows: compilers vectorise it (integer shifts,
 * one int-to-float conversion, selects), where neither the portable conversion below nor
 * _Float16's (one vcvtph2ps per element from gcc 12) vectorised. Exact, with F16C's results:
 * normals rebias the exponent, subnormals are man * 2^-24 computed from the integer, inf and
 * NaN keep their mantissa bits (NaN made quiet). The portable fa_f16_to_f32 below is this.
 */
static inline float fa_f16_to_f32_lanes(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu;
    const uint32_t is_nan = 0u - (uint32_t)(em > 0x7c00u);
    const uint32_t norm = (em << 13) + (112u << 23);
    const uint32_t special = (em << 13) | 0x7f800000u | (is_nan & 0x00400000u);
    const uint32_t sub = fa_f32_to_bits((float)(int32_t)em * 5.9604644775390625e-08f);
    /* All-ones masks rather than conditionals, which compilers kept as branches. */
    const uint32_t is_sub = 0u - (uint32_t)(em < 0x400u);
    const uint32_t is_special = 0u - (uint32_t)(em >= 0x7c00u);
    uint32_t bits = (norm & ~is_special) | (special & is_special);
    bits = (bits & ~is_sub) | (sub & is_sub);
    return fa_bits_to_f32(bits | sign);
}

#if defined(__FLT16_MAX__) && defined(__x86_64__)
/*
 * The compiler's own fp16 type: its conversions become F16C instructions in code compiled for
 * AVX2/AVX-512 (one element at a time from gcc 12: row loops use fa_f16_to_f32_lanes) and
 * correctly rounded library code elsewhere, with the same results as the portable version
 * below.
 */
static inline float fa_f16_to_f32(uint16_t h)
{
    _Float16 f;
    memcpy(&f, &h, sizeof f);
    return (float)f;
}

static inline uint16_t fa_f32_to_f16(float x)
{
    _Float16 f = (_Float16)x;
    uint16_t h;
    memcpy(&h, &f, sizeof h);
    return h;
}
#else
static inline float fa_f16_to_f32(uint16_t h)
{
    return fa_f16_to_f32_lanes(h);
}

static inline uint16_t fa_f32_to_f16(float f)
{
    uint32_t u = fa_f32_to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN */
        return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) /* rounds to >= 65520: inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* below the smallest normal 2^-14: subnormal or zero */
        /* Adding 0.5 makes the FPU round the mantissa at 2^-24 granularity, to nearest even. */
        float r = fa_bits_to_f32(a) + 0.5f;
        return (uint16_t)(sign | (uint16_t)(fa_f32_to_bits(r) - 0x3f000000u));
    }
    uint32_t odd = (a >> 13) & 1u;
    a += 0xc8000fffu + odd; /* rebias exponent (-112 << 23) and round to nearest even */
    return (uint16_t)(sign | (uint16_t)(a >> 13));
}
#endif

#endif /* FA_HALF_H */
