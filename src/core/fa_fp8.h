/*
 * fp8 <-> fp32, bit for bit as torch converts: e4m3 is torch.float8_e4m3fn (bias 7, no
 * infinities, NaN S.1111.111, largest 448; fp32 -> e4m3 saturates finite overflow and infinities
 * to +-448), e5m2 is torch.float8_e5m2 (bias 15, infinities; overflow rounds to +-inf). Both round
 * to nearest, ties to even, in integer arithmetic (no dependence on the FP rounding mode), keep
 * subnormals, and give NaN the input's sign. In core beside kernels/fa_rules.h, whose rounding
 * rule the fp8 KV caches' append shares with the kernels.
 */
#ifndef FA_FP8_H
#define FA_FP8_H

#include <stdint.h>

#include "fa_rules.h"
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

/* fp32 -> fp8: the rounding rule of kernels/fa_rules.h, shared with the kernels. */
static inline uint8_t fa_f32_to_e4m3(float f)
{
    return (uint8_t)fa_rule_e4m3_from_bits(fa_f32_to_bits(f));
}

static inline uint8_t fa_f32_to_e5m2(float f)
{
    return (uint8_t)fa_rule_e5m2_from_bits(fa_f32_to_bits(f));
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
