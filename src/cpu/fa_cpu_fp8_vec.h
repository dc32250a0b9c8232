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
typedef float fa_f32x16 __attribute__((vector_size(64)));

/* Lanes of a where mask (a comparison's result) is all ones, else of b. */
#define FA_U32X16_SELECT(mask, a, b) (((fa_u32x16)(mask) & (a)) | (~(fa_u32x16)(mask) & (b)))

/* Lane l of table[idx[l] % 16]: one vpermd. */
static inline __attribute__((always_inline)) void fa_u32x16_lookup(fa_u32x16 *dst,
                                                                   const fa_u32x16 *table,
                                                                   const fa_u32x16 *idx)
{
#if defined(__clang__)
    for (int l = 0; l < 16; l++)
        (*dst)[l] = (*table)[(*idx)[l] & 15u];
#else
    *dst = __builtin_shuffle(*table, *idx);
#endif
}

/*
 * src[0 .. 16), e4m3 codes when e4m3, else e5m2, as fp32 into *dst (through a pointer: a
 * 64-byte vector passed by value would change the ABI between the builds' targets). A normal
 * magnitude m rebiases its exponent: (m << (23 - mantissa bits)) + rebias. The few others (the
 * subnormals, infinities and NaNs) move by (code + shift) & 0x7f to the table's first entries
 * and take their bits from it.
 */
static inline __attribute__((always_inline)) void fa_fp8_widen16(fa_f32x16 *dst,
                                                                const uint8_t *src, int e4m3)
{
    /* e4m3: NaN S.1111.111 (+1 wraps to 0), then the subnormals m * 2^-9, m = 0 .. 7 */
    static const fa_u32x16 e4m3_special = {0x7fc00000u, 0, 0x3b000000u, 0x3b800000u,
                                           0x3bc00000u, 0x3c000000u, 0x3c200000u, 0x3c400000u,
                                           0x3c600000u};
    /* e5m2: inf S.11111.00, NaN S.11111.{01,10,11}, then the subnormals m * 2^-16, m = 0 .. 3 */
    static const fa_u32x16 e5m2_special = {0x7f800000u, 0x7fc00000u, 0x7fc00000u, 0x7fc00000u,
                                           0, 0x37800000u, 0x38000000u, 0x38400000u};
    /* Widened by a loop over the lanes: gcc 12 compiled __builtin_convertvector from bytes a
     * lane at a time. */
    uint32_t lanes[16];
    for (int l = 0; l < 16; l++)
        lanes[l] = src[l];
    fa_u32x16 c;
    memcpy(&c, lanes, sizeof c);
    const uint32_t mbits = e4m3 ? 3u : 2u, rebias = e4m3 ? 120u << 23 : 112u << 23;
    const uint32_t shift = e4m3 ? 1u : 4u, specials = e4m3 ? 9u : 8u;
    const fa_u32x16 idx = (c + shift) & 0x7fu;
    fa_u32x16 special;
    fa_u32x16_lookup(&special, e4m3 ? &e4m3_special : &e5m2_special, &idx);
    fa_u32x16 bits = FA_U32X16_SELECT(idx < specials, special,
                                      ((c & 0x7fu) << (23 - mbits)) + rebias);
    bits |= (c & 0x80u) << 24;
    memcpy(dst, &bits, sizeof *dst);
}

#endif /* FA_CPU_FP8_VEC_H */
