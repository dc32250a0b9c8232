/* Instantiates the micro-kernel families and picks one for this CPU, once. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/fa_cpu_gemm.h"
#include "cpu/fa_cpu_exp512.h"
#include "cpu/fa_cpu_info.h"
#include "cpu/fa_cpu_transpose16.h"

/* Unaligned vector loads and stores; macros, so no vector crosses a function boundary. */
#define FA_VLOAD(v, p) memcpy(&(v), (p), sizeof(v))
#define FA_VSTORE(p, v) memcpy((p), &(v), sizeof(v))

#if defined(__x86_64__) && defined(__GNUC__)
#define FA_GEMM_TARGET __attribute__((target("avx512f,avx512vl,avx2,fma")))
#define FA_GEMM_VL 16
#define FA_GEMM_FN(name) name##_avx512
#define FA_GEMM_MR 4
#define FA_GEMM_NRV 4
#define FA_GEMM_COLS_OUTER 0
#include "cpu/fa_cpu_gemm_body.h"
#undef FA_GEMM_FN
#undef FA_GEMM_COLS_OUTER
#define FA_GEMM_FN(name) name##_avx512_cols
#define FA_GEMM_COLS_OUTER 1
#include "cpu/fa_cpu_gemm_body.h"
#undef FA_GEMM_FN
#undef FA_GEMM_MR
#undef FA_GEMM_COLS_OUTER
#define FA_GEMM_FN(name) name##_avx512_6x4
#define FA_GEMM_MR 6
#define FA_GEMM_COLS_OUTER 0
#include "cpu/fa_cpu_gemm_body.h"
#undef FA_GEMM_FN
#undef FA_GEMM_COLS_OUTER
#define FA_GEMM_FN(name) name##_avx512_6x4_cols
#define FA_GEMM_COLS_OUTER 1
#define FA_GEMM_TILE4 fa_gemm_tile_avx512
#include "cpu/fa_cpu_gemm_body.h"
#undef FA_GEMM_TILE4
#undef FA_GEMM_FN
#undef FA_GEMM_TARGET
#undef FA_GEMM_VL
#undef FA_GEMM_MR
#undef FA_GEMM_NRV
#undef FA_GEMM_COLS_OUTER

#define FA_GEMM_FN(name) name##_avx2
#define FA_GEMM_TARGET __attribute__((target("avx2,fma")))
#define FA_GEMM_VL 8
#define FA_GEMM_MR 4
#define FA_GEMM_NRV 2
#define FA_GEMM_COLS_OUTER 0
#include "cpu/fa_cpu_gemm_body.h"
#undef FA_GEMM_FN
#undef FA_GEMM_TARGET
#undef FA_GEMM_VL
#undef FA_GEMM_MR
#undef FA_GEMM_NRV
#undef FA_GEMM_COLS_OUTER
#endif

/* Portable: 4-wide vectors, which every 64-bit target lowers to its own SIMD or to scalars. */
#define FA_GEMM_FN(name) name##_generic
#define FA_GEMM_TARGET
#define FA_GEMM_VL 4
#define FA_GEMM_MR 4
#define FA_GEMM_NRV 2
#define FA_GEMM_COLS_OUTER 0
#include "cpu/fa_cpu_gemm_body.h"
#undef FA_GEMM_FN
#undef FA_GEMM_TARGET
#undef FA_GEMM_VL
#undef FA_GEMM_MR
#undef FA_GEMM_NRV
#undef FA_GEMM_COLS_OUTER

/* The rectangle [r0, r1) x [c0, c1) of fa_cpu_transpose_f32, one element at a time. */
static void fa_transpose_rect(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t r0,
                              int64_t r1, int64_t c0, int64_t c1, float scale)
{
    for (int64_t r = r0; r < r1; r++)
        for (int64_t c = c0; c < c1; c++)
            dst[c * ldd + r] = src[r * lds + c] * scale;
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f"))) static void fa_transpose_avx512(float *dst, int64_t ldd,
                                                                   const float *src, int64_t lds,
                                                                   int64_t rows, int64_t cols,
                                                                   float scale)
{
    const __m512 s = _mm512_set1_ps(scale);
    const int64_t rows16 = rows / 16 * 16, cols16 = cols / 16 * 16;
    for (int64_t r0 = 0; r0 < rows16; r0 += 16)
        for (int64_t c0 = 0; c0 < cols16; c0 += 16) {
            __m512i w[16];
            FA_CPU_UNROLL for (int t = 0; t < 16; t++)
                w[t] = _mm512_castps_si512(
                    _mm512_mul_ps(_mm512_loadu_ps(src + (r0 + t) * lds + c0), s));
            fa_cpu_transpose16(w);
            FA_CPU_UNROLL for (int t = 0; t < 16; t++)
                _mm512_storeu_ps(dst + (c0 + t) * ldd + r0, _mm512_castsi512_ps(w[t]));
        }
    fa_transpose_rect(dst, ldd, src, lds, 0, rows16, cols16, cols, scale);
    fa_transpose_rect(dst, ldd, src, lds, rows16, rows, 0, cols, scale);
}
#endif

typedef void (*fa_gemm_fn)(float *, int64_t, const float *, int64_t, int64_t, const float *,
                           int64_t, int64_t, int64_t, int64_t, int);

static fa_gemm_fn fa_gemm_selected;
#if defined(__x86_64__) && defined(__GNUC__)
static int fa_gemm_avx512_ok; /* the transposes and exponentials below may use AVX-512 */
#endif
static const char *fa_gemm_selected_name;
static pthread_once_t fa_gemm_once = PTHREAD_ONCE_INIT;

static void fa_gemm_select(void)
{
    fa_gemm_selected = fa_gemm_generic;
    fa_gemm_selected_name = "generic";
#if defined(__x86_64__) && defined(__GNUC__)
    const fa_cpu_info *cpu = fa_cpu_info_get();
    if (cpu->avx512f && cpu->avx512vl && cpu->avx2 && cpu->fma) {
        fa_gemm_avx512_ok = 1;
        /* 6x64 register tiles, column panels outermost: the fastest order on CPUs with two
         * 512-bit FMA units per core, and no slower elsewhere. FLASHATTN_CPU_GEMM=4x4,
         * 4x4-cols or 6x4 picks one of the others, for measuring them on a CPU. */
        fa_gemm_selected = fa_gemm_avx512_6x4_cols;
        fa_gemm_selected_name = "avx512 6x64 cols";
        const char *env = getenv("FLASHATTN_CPU_GEMM");
        if (env && strcmp(env, "4x4") == 0) {
            fa_gemm_selected = fa_gemm_avx512;
            fa_gemm_selected_name = "avx512 4x64";
        } else if (env && strcmp(env, "4x4-cols") == 0) {
            fa_gemm_selected = fa_gemm_avx512_cols;
            fa_gemm_selected_name = "avx512 4x64 cols";
        } else if (env && strcmp(env, "6x4") == 0) {
            fa_gemm_selected = fa_gemm_avx512_6x4;
            fa_gemm_selected_name = "avx512 6x64";
        }
    } else if (cpu->avx2 && cpu->fma) {
        fa_gemm_selected = fa_gemm_avx2;
        fa_gemm_selected_name = "avx2";
    }
#endif
}

void fa_cpu_gemm_f32(float *c, int64_t ldc, const float *a, int64_t a_rs, int64_t a_cs,
                     const float *b, int64_t ldb, int64_t m, int64_t n, int64_t k,
                     int accumulate)
{
    pthread_once(&fa_gemm_once, fa_gemm_select);
    fa_gemm_selected(c, ldc, a, a_rs, a_cs, b, ldb, m, n, k, accumulate);
}

void fa_cpu_transpose_f32(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows,
                          int64_t cols, float scale)
{
    pthread_once(&fa_gemm_once, fa_gemm_select);
#if defined(__x86_64__) && defined(__GNUC__)
    if (fa_gemm_avx512_ok) {
        fa_transpose_avx512(dst, ldd, src, lds, rows, cols, scale);
        return;
    }
#endif
    fa_transpose_rect(dst, ldd, src, lds, 0, rows, 0, cols, scale);
}

#if defined(__x86_64__) && defined(__GNUC__)
FA_EXP512_TARGET static void fa_exp_rows_avx512(float *st, int64_t ldst, int64_t n, int64_t c0,
                                                int64_t c1, float emul, const float *bmax,
                                                float *l)
{
    const __m512 em = _mm512_set1_ps(emul);
    for (int64_t i = c0; i < c1; i += 16) {
        const __m512 b = _mm512_loadu_ps(bmax + i);
        __m512 sum = _mm512_loadu_ps(l + i);
        for (int64_t j = 0; j < n; j++) {
            const __m512 e = fa_exp512_row(st + j * ldst + i, em, b);
            sum = _mm512_add_ps(sum, e);
            _mm512_storeu_ps(st + j * ldst + i, e);
        }
        _mm512_storeu_ps(l + i, sum);
    }
}
#endif

int fa_cpu_exp_rows_f32(float *st, int64_t ldst, int64_t n, int64_t c0, int64_t c1, float emul,
                        const float *bmax, float *l)
{
    pthread_once(&fa_gemm_once, fa_gemm_select);
#if defined(__x86_64__) && defined(__GNUC__)
    if (fa_gemm_avx512_ok) {
        fa_exp_rows_avx512(st, ldst, n, c0, c1, emul, bmax, l);
        return 1;
    }
#endif
    (void)st, (void)ldst, (void)n, (void)c0, (void)c1, (void)emul, (void)bmax, (void)l;
    return 0;
}

const char *fa_cpu_gemm_name(void)
{
    pthread_once(&fa_gemm_once, fa_gemm_select);
    return fa_gemm_selected_name;
}

void fa_cpu_gemm_f64(double *c, int64_t ldc, const double *a, int64_t a_rs, int64_t a_cs,
                     const double *b, int64_t ldb, int64_t m, int64_t n, int64_t k,
                     int accumulate)
{
    for (int64_t i = 0; i < m; i++) {
        double *restrict ci = c + i * ldc;
        if (!accumulate)
            for (int64_t j = 0; j < n; j++)
                ci[j] = 0;
        for (int64_t x = 0; x < k; x++) {
            const double ax = a[i * a_rs + x * a_cs];
            const double *restrict bx = b + x * ldb;
            for (int64_t j = 0; j < n; j++)
                ci[j] += ax * bx[j];
        }
    }
}
