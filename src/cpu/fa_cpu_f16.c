/*
 * fp16 rows to fp32. gcc 12 converts _Float16 one element at a time, even in the kernels'
 * AVX-512 clones, and those clones cannot call F16C's intrinsics (their baseline sibling is
 * compiled from the same source without the instructions). So the rows go through this
 * out-of-line function, picked once: vcvtph2ps eight at a time where the CPU has F16C, else the
 * branch-free conversion that vectorises (fa_f16_to_f32_lanes, ~12 vector operations per 16
 * elements). Both give fa_f16_to_f32's bits (tests/c/test_half.c).
 */
#include "cpu/fa_cpu_f16.h"

#include <pthread.h>

#include "cpu/fa_cpu_info.h"
#include "util/fa_half.h"

static void fa_f16_row_lanes(float *dst, const uint16_t *src, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = fa_f16_to_f32_lanes(src[i]);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FA_HAVE_F16C_PATH 1

__attribute__((target("avx,f16c"))) static void fa_f16_row_f16c(float *dst, const uint16_t *src,
                                                                 int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    fa_f16_row_lanes(dst + i, src + i, n - i);
}
#endif

typedef void (*fa_f16_row_fn)(float *, const uint16_t *, int64_t);
static fa_f16_row_fn fa_f16_row_selected;
static pthread_once_t fa_f16_row_once = PTHREAD_ONCE_INIT;

static void fa_f16_row_select(void)
{
    fa_f16_row_selected = fa_f16_row_lanes;
#if defined(FA_HAVE_F16C_PATH)
    if (fa_cpu_info_get()->f16c)
        fa_f16_row_selected = fa_f16_row_f16c;
#endif
}

void fa_cpu_f16_to_f32_row(float *dst, const uint16_t *src, int64_t n)
{
    pthread_once(&fa_f16_row_once, fa_f16_row_select);
    fa_f16_row_selected(dst, src, n);
}
