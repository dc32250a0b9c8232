/*
 * 16 fp8 codes widened to fp32 at once, in vector registers: the branch-free rule of
 * core/fa_fp8.h written on GCC/clang vectors, which compilers did not derive from the scalar
 * loop. Bit for bit fa_e4m3_to_f32 / fa_e5m2_to_f32 (NaN signs included).
 */
#ifndef FA_CPU_FP8_VEC_H
#define FA_CPU_FP8_VEC_H

#include <stdint.h>
#include <string.h>

#include "core/fa_fp8.h"

typedef uint32_t fa_u32x16 __attribute__((vector_size(64)));
typedef int32_t fa_i32x16 __attribute__((vector_size(64)));
typedef float fa_f32x16 __attribute__((vector_size(64)));

/* Lanes of a where mask (a comparison's result) is all ones, else of b. */
#define FA_U32X16_SELECT(mask, a, b) (((fa_u32x16)(mask) & (a)) | (~(fa_u32x16)(mask) & (b)))

/* src[0 .. 16), e4m3 codes when e4m3, else e5m2, as fp32 into *dst (through a pointer: a
 * 64-byte vector passed by value would change the ABI between the builds' targets). */
static inline __attribute__((always_inline)) void fa_fp8_widen16(fa_f32x16 *dst,
                                                                const uint8_t *src, int e4m3)
{
    /* Widened by a loop over the lanes: gcc 12 compiled __builtin_convertvector from bytes a
     * lane at a time. */
    uint32_t lanes[16];
    for (int l = 0; l < 16; l++)
        lanes[l] = src[l];
    fa_u32x16 c;
    memcpy(&c, lanes, sizeof c);
    const fa_u32x16 mag = c & 0x7fu;
    /* mbits: mantissa bits; the subnormals m * 2^(1 - bias - mbits) from the integer m */
    const uint32_t mbits = e4m3 ? 3u : 2u, rebias = e4m3 ? 120u << 23 : 112u << 23;
    const float tiny = e4m3 ? 1.0f / 512.0f : 1.0f / 65536.0f;
    const fa_f32x16 sub =
        __builtin_convertvector((fa_i32x16)(mag & ((1u << mbits) - 1u)), fa_f32x16) * tiny;
    fa_u32x16 bits = FA_U32X16_SELECT((fa_u32x16)(mag < (1u << mbits)), (fa_u32x16)sub,
                                      (mag << (23 - mbits)) + rebias);
    if (e4m3) {
        bits = FA_U32X16_SELECT((fa_u32x16)(mag == 0x7fu), (fa_u32x16){0} + 0x7fc00000u, bits);
    } else {
        const fa_u32x16 special = FA_U32X16_SELECT((fa_u32x16)(mag == 0x7cu),
                                                   (fa_u32x16){0} + 0x7f800000u,
                                                   (fa_u32x16){0} + 0x7fc00000u);
        bits = FA_U32X16_SELECT((fa_u32x16)(mag >= 0x7cu), special, bits);
    }
    bits |= (c & 0x80u) << 24;
    memcpy(dst, &bits, sizeof *dst);
}

#endif /* FA_CPU_FP8_VEC_H */
