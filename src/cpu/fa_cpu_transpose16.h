/*
 * A 16x16 transpose of 32-bit elements in AVX-512 registers, for the kernels' packing: bf16
 * pairs (fa_cpu_bf16.c) and fp32 rows (fa_cpu_gemm.c). x86-64 with GCC-compatible compilers.
 */
#ifndef FA_CPU_TRANSPOSE16_H
#define FA_CPU_TRANSPOSE16_H

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* Transposes 16x16 32-bit elements held in r[0..15] (rows) in place. */
__attribute__((target("avx512f"))) static inline void fa_cpu_transpose16(__m512i r[16])
{
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* u[4g + q], 128-bit lane L: column 4L + q of rows 4g .. 4g+3 */
    __m512i u[16];
    for (int g = 0; g < 16; g += 4) {
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    /* row 4L + q of the result = lane L of u[q], u[4 + q], u[8 + q], u[12 + q] */
    for (int q = 0; q < 4; q++) {
        const __m512i s0 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0x44);
        const __m512i s1 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0xee);
        const __m512i s2 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0x44);
        const __m512i s3 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0xee);
        r[q] = _mm512_shuffle_i32x4(s0, s2, 0x88);
        r[4 + q] = _mm512_shuffle_i32x4(s0, s2, 0xdd);
        r[8 + q] = _mm512_shuffle_i32x4(s1, s3, 0x88);
        r[12 + q] = _mm512_shuffle_i32x4(s1, s3, 0xdd);
    }
}

#endif
#endif /* FA_CPU_TRANSPOSE16_H */
