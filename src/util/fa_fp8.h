/*
 * fp8 <-> fp32, bit for bit as torch converts: e4m3 is torch.float8_e4m3fn (bias 7, no
 * infinities, NaN S.1111.111, largest 448; fp32 -> e4m3 saturates finite overflow and infinities
 * to +-448), e5m2 is torch.float8_e5m2 (bias 15, infinities; overflow rounds to +-inf). Both round
 * to nearest, ties to even, in integer arithmetic (no dependence on the FP rounding mode), keep
 * subnormals, and give NaN the input's sign.
 */
#ifndef FA_FP8_H
#define FA_FP8_H

#include <stdint.h>

#include "flashattn.h"
#include "util/fa_half.h"

static inline int fa_dtype_is_fp8(fa_dtype dt)
{
    return dt == FA_DTYPE_F8E4M3 || dt == FA_DTYPE_F8E5M2;
}

static inline float fa_e4m3_to_f32(uint8_t b)
{
    const uint32_t e = (b >> 3) & 15u, m = b & 7u;
    float v;
    if (e == 15 && m == 7)
        v = fa_bits_to_f32(0x7fc00000u);
    else if (e == 0)
        v = (float)m * (1.0f / 512.0f); /* subnormal: m * 2^-9 */
    else
        v = fa_bits_to_f32(((e + 120u) << 23) | (m << 20)); /* rebias 7 -> 127 */
    return (b & 0x80u) ? -v : v;
}

static inline float fa_e5m2_to_f32(uint8_t b)
{
    const uint32_t e = (b >> 2) & 31u, m = b & 3u;
    float v;
    if (e == 31)
        v = fa_bits_to_f32(m ? 0x7fc00000u : 0x7f800000u);
    else if (e == 0)
        v = (float)m * (1.0f / 65536.0f); /* subnormal: m * 2^-16 */
    else
        v = fa_bits_to_f32(((e + 112u) << 23) | (m << 21)); /* rebias 15 -> 127 */
    return (b & 0x80u) ? -v : v;
}

/* |x| (fp32 bits a, normal or subnormal, below the smallest normal of the fp8 kind) as a
 * multiple of 2^qexp, rounded to nearest even: the fp8 subnormal's mantissa (which may carry
 * into the smallest normal, whose code follows the subnormals). */
static inline uint32_t fa_fp8_subnormal(uint32_t a, int qexp)
{
    if (a < 0x00800000u)
        return 0; /* an fp32 subnormal is far below half of any fp8 quantum */
    const int e = (int)(a >> 23) - 127;
    const uint32_t mant = (a & 0x7fffffu) | 0x800000u; /* |x| = mant * 2^(e - 23) */
    const int shift = qexp - (e - 23);                 /* |x| / 2^qexp = mant >> shift */
    if (shift > 24)
        return 0; /* below half a quantum */
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u)))
        q++;
    return q;
}

static inline uint8_t fa_f32_to_e4m3(float f)
{
    const uint32_t u = fa_f32_to_bits(f), a = u & 0x7fffffffu;
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    if (a > 0x7f800000u)
        return sign | 0x7fu; /* NaN */
    if (a >= 0x43e00000u)
        return sign | 0x7eu; /* >= 448, infinities included: saturate to 448 */
    if (a < 0x3c800000u)     /* below 2^-6: subnormal, quantum 2^-9 */
        return sign | (uint8_t)fa_fp8_subnormal(a, -9);
    const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u); /* 3 mantissa bits, ties to even */
    return sign | (uint8_t)((((r >> 23) - 120u) << 3) | ((r >> 20) & 7u));
}

static inline uint8_t fa_f32_to_e5m2(float f)
{
    const uint32_t u = fa_f32_to_bits(f), a = u & 0x7fffffffu;
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    if (a > 0x7f800000u)
        return sign | 0x7fu; /* NaN */
    if (a >= 0x47700000u)
        return sign | 0x7cu; /* >= 61440 rounds past 57344: infinity */
    if (a < 0x38800000u)     /* below 2^-14: subnormal, quantum 2^-16 */
        return sign | (uint8_t)fa_fp8_subnormal(a, -16);
    const uint32_t r = a + 0xfffffu + ((a >> 21) & 1u); /* 2 mantissa bits, ties to even */
    return sign | (uint8_t)((((r >> 23) - 112u) << 2) | ((r >> 21) & 3u));
}

/* x rounded to e4m3 and back: what an fp8 P V product sees of a probability. */
static inline float fa_e4m3_round(float x)
{
    return fa_e4m3_to_f32(fa_f32_to_e4m3(x));
}

/* The 256 values of an fp8 kind, for loops that decode many elements. */
static inline void fa_fp8_table(fa_dtype kind, float table[256])
{
    for (int b = 0; b < 256; b++)
        table[b] = kind == FA_DTYPE_F8E4M3 ? fa_e4m3_to_f32((uint8_t)b)
                                           : fa_e5m2_to_f32((uint8_t)b);
}

#endif /* FA_FP8_H */
