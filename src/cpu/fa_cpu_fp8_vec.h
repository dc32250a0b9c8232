/*
 * 16 fp8 codes widened to fp32 at once, in vector registers (GCC/clang vectors: compilers
 * did not vectorise the scalar conversions well), for the CPU decode's fp8 KV caches. Bit for
 * bit fa_e4m3_to_f32 / fa_e5m2_to_f32 of core/fa_fp8.h, NaN signs included
 * (test_kvcache_fp8_codes checks every code).
 */
#ifndef FA_CPU_FP8_VEC_H
#define FA_CPU_FP8_VEC_H

#include <stdint.h>
#include <string.h>

#include "core/fa_fp8.h"

typedef uint32_t fa_u32x16 __attribute__((vector_size(64)));
typedef float fa_f32x16 __attribute__((vector_size(64)));

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

/* The normal rule's bits for magnitude m (rebiased exponent, mantissa shifted up). */
#define FA_FP8_NORMAL(m, mbits, rebias) (((uint32_t)(m) << (23 - (mbits))) + (rebias))

/* e4m3: the magnitudes (code & 0x7f) + 1 below 9: NaN S.1111.111 (wrapped to 0), then the
 * subnormals m * 2^-9, m = 0 .. 7; each entry the difference from the normal rule's bits. */
#define FA_E4M3_FIX(m, bits) ((uint32_t)(bits) - FA_FP8_NORMAL(m, 3, 120u << 23))
static const fa_u32x16 fa_e4m3_fixes = {
    FA_E4M3_FIX(0x7f, 0x7fc00000u), FA_E4M3_FIX(0, 0),           FA_E4M3_FIX(1, 0x3b000000u),
    FA_E4M3_FIX(2, 0x3b800000u),    FA_E4M3_FIX(3, 0x3bc00000u), FA_E4M3_FIX(4, 0x3c000000u),
    FA_E4M3_FIX(5, 0x3c200000u),    FA_E4M3_FIX(6, 0x3c400000u), FA_E4M3_FIX(7, 0x3c600000u)};

/* e5m2: the magnitudes + 4 below 8: inf S.11111.00 and NaN S.11111.{01,10,11} (wrapped to
 * 0 .. 3), then the subnormals m * 2^-16, m = 0 .. 3. */
#define FA_E5M2_FIX(m, bits) ((uint32_t)(bits) - FA_FP8_NORMAL(m, 2, 112u << 23))
static const fa_u32x16 fa_e5m2_fixes = {
    FA_E5M2_FIX(0x7c, 0x7f800000u), FA_E5M2_FIX(0x7d, 0x7fc00000u),
    FA_E5M2_FIX(0x7e, 0x7fc00000u), FA_E5M2_FIX(0x7f, 0x7fc00000u),
    FA_E5M2_FIX(0, 0),              FA_E5M2_FIX(1, 0x37800000u),
    FA_E5M2_FIX(2, 0x38000000u),    FA_E5M2_FIX(3, 0x38400000u)};

/*
 * src[0 .. 16), e4m3 codes when e4m3, else e5m2, as fp32 into *dst (through a pointer: a
 * 64-byte vector passed by value would change the ABI between the builds' targets). Every
 * magnitude takes the normal rule (rebiased exponent), plus a fix for the few codes the rule
 * misses (the subnormals, infinities and NaNs): (magnitude + shift) & 0x7f moves those to the
 * first entries of a 16-entry table, and the others' fixes are masked to zero.
 */
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
    const uint32_t mbits = e4m3 ? 3u : 2u, rebias = e4m3 ? 120u << 23 : 112u << 23;
    const fa_u32x16 mag = c & 0x7fu;
    const fa_u32x16 idx = (mag + (e4m3 ? 1u : 4u)) & 0x7fu;
    fa_u32x16 fix;
    fa_u32x16_lookup(&fix, e4m3 ? &fa_e4m3_fixes : &fa_e5m2_fixes, &idx);
    fix &= (fa_u32x16)(idx < (e4m3 ? 9u : 8u));
    const fa_u32x16 bits = (mag << (23 - mbits)) + rebias + fix;
    *dst = (fa_f32x16)(bits | ((c << 24) & 0x80000000u));
}

#endif /* FA_CPU_FP8_VEC_H */
