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
#include <stdlib.h>

#include "fa_rules.h"
#include "flashattn.h"
#include "util/fa_half.h"

static inline int fa_dtype_is_fp8(fa_dtype dt)
{
    return dt == FA_DTYPE_F8E4M3 || dt == FA_DTYPE_F8E5M2;
}

/* CUDA devices take fp8 (e4m3) q, k, v through the Hopper kernel (kernels/fa_fwd_sm90_fp8.cu)
 * unless FLASHATTN_SM90_FP8=0, which makes them refuse fp8 as unsupported. */
static inline int fa_sm90_fp8_enabled(void)
{
    const char *env = getenv("FLASHATTN_SM90_FP8");
    return !(env && env[0] == '0' && env[1] == '\0');
}

/*
 * fp8 -> fp32 without branches, whose outcome on random codes the CPU mispredicted: the normal
 * rule and the subnormal value (from the integer mantissa, exact and untouched by a
 * denormals-are-zero mode) both computed, the NaNs and infinities selected; the sign ORed in
 * last, so a NaN keeps the code's sign as torch gives it.
 */
static inline float fa_e4m3_to_f32(uint8_t b)
{
    const uint32_t mag = b & 0x7fu;
    const float sub = (float)(mag & 7u) * (1.0f / 512.0f); /* e == 0: m * 2^-9 */
    uint32_t bits = mag < 8u ? fa_f32_to_bits(sub) : (mag << 20) + (120u << 23); /* bias 7 -> 127 */
    bits = mag == 0x7fu ? 0x7fc00000u : bits; /* S.1111.111: NaN */
    return fa_bits_to_f32(bits | (uint32_t)(b & 0x80u) << 24);
}

static inline float fa_e5m2_to_f32(uint8_t b)
{
    const uint32_t mag = b & 0x7fu;
    const float sub = (float)(mag & 3u) * (1.0f / 65536.0f); /* e == 0: m * 2^-16 */
    uint32_t bits = mag < 4u ? fa_f32_to_bits(sub) : (mag << 21) + (112u << 23); /* 15 -> 127 */
    bits = mag >= 0x7cu ? (mag == 0x7cu ? 0x7f800000u : 0x7fc00000u) : bits; /* e == 31 */
    return fa_bits_to_f32(bits | (uint32_t)(b & 0x80u) << 24);
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
