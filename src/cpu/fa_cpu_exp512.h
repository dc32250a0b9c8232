/*
 * exp on AVX-512 for the softmax's exponentials (fa_cpu_bf16_exp_pack, fa_cpu_exp_rows_f32):
 * within 1.2e-7 relative (about an ulp; 9.05e-8 the worst seen over 2M arguments), 0 below
 * e^-87.34 and for -inf so that results stay normal, as fa_expf's do, NaN for NaN, in about half
 * of fa_expf's instructions. exp(x) = 2^n 2^r with n = round(x log2 e) and r = x log2 e - n in
 * [-1/2, 1/2], taken with log2 e in two parts so that r carries no error proportional to |x|;
 * 2^r by a degree-6 polynomial fitted for relative error on that interval (7.9e-8 with fp32
 * rounding); scalef adds n to the exponent.
 */
#ifndef FA_CPU_EXP512_H
#define FA_CPU_EXP512_H

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define FA_EXP512_TARGET __attribute__((target("avx512f")))

FA_EXP512_TARGET static inline __m512 fa_exp512(__m512 x)
{
    const __m512 log2e_hi = _mm512_set1_ps(1.44269502e+0f);
    const __m512 log2e_lo = _mm512_set1_ps(1.92596303e-8f); /* log2 e - log2e_hi */
    const __m512 t = _mm512_mul_ps(x, log2e_hi);
    /* Not-less-than, unordered: a NaN argument is live, so scalef returns NaN (a NaN score must
     * reach the row's sum and output, not vanish as a 0). */
    const __mmask16 live = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(x, log2e_lo, _mm512_fmsub_ps(x, log2e_hi, n));
    __m512 y = _mm512_set1_ps(1.5345811e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3399931e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(9.6184891e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.5503286e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(2.4022646e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(6.9314718e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(live, y, n);
}

/* 16 of a row's exponentials exp(s * emul - bmax), the difference taken in one rounding as
 * fa_expf's callers do, so that it is exact near the maximum. */
FA_EXP512_TARGET static inline __m512 fa_exp512_row(const float *s, __m512 emul, __m512 bmax)
{
    return fa_exp512(_mm512_fmsub_ps(_mm512_loadu_ps(s), emul, bmax));
}

#endif /* x86-64 */
#endif /* FA_CPU_EXP512_H */
