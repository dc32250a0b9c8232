/*
 * The small fp32 matrix products every CPU attention kernel is made of:
 *   C[M][N] (+)= A[M][K] * B[K][N]
 * A is read through any strides (a_rs between rows, a_cs between columns: a transposed tile is
 * just swapped strides); B and C are row-major with leading dimensions ldb and ldc. N must be a
 * multiple of FA_CPU_GEMM_NPAD (callers pad their B and C rows with zero columns); M and K are
 * free. Register-blocked micro-kernels for AVX-512, AVX2+FMA and plain SSE2/portable C, picked
 * once from the CPU's features.
 */
#ifndef FA_CPU_GEMM_H
#define FA_CPU_GEMM_H

#include <stdint.h>

#define FA_CPU_GEMM_NPAD 16 /* widest vector, in floats */

/* Put before each loop over a small array of vector accumulators (and the loops that load and
 * store it): gcc keeps such an array in registers only where those loops are unrolled early;
 * otherwise it moves the array through the stack around the loops that walk it. */
#if defined(__GNUC__)
#define FA_CPU_UNROLL _Pragma("GCC unroll 16")
#else
#define FA_CPU_UNROLL
#endif

void fa_cpu_gemm_f32(float *c, int64_t ldc, const float *a, int64_t a_rs, int64_t a_cs,
                     const float *b, int64_t ldb, int64_t m, int64_t n, int64_t k,
                     int accumulate);

/* The same product in double, plain loops: the fp64 path exists for accuracy, not speed. */
void fa_cpu_gemm_f64(double *c, int64_t ldc, const double *a, int64_t a_rs, int64_t a_cs,
                     const double *b, int64_t ldb, int64_t m, int64_t n, int64_t k,
                     int accumulate);

/* The softmax's exponentials in place, st[j][i] = exp(st[j][i] * emul - bmax[i]), and l[i] +=
 * each in row order, for rows j < n and columns [c0, c1) (multiples of 16), on AVX-512
 * (fa_cpu_exp512.h: about half of fa_expf's instructions). Returns 0 having done nothing where
 * the CPU has no AVX-512; the caller then takes fa_expf. */
int fa_cpu_exp_rows_f32(float *st, int64_t ldst, int64_t n, int64_t c0, int64_t c1, float emul,
                        const float *bmax, float *l);

/* dst[c * ldd + r] = src[r * lds + c] * scale for r < rows, c < cols: the transposed tiles
 * (Q^T, dO^T) the kernels pack, in 16x16 register blocks where AVX-512 exists (per element
 * these were scalar strided stores, ~half of the backward's packing time). */
void fa_cpu_transpose_f32(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows,
                          int64_t cols, float scale);

/* The micro-kernel family in use ("avx512 6x64 cols", "avx2", "generic", ...), for reports. */
const char *fa_cpu_gemm_name(void);

static inline int64_t fa_cpu_gemm_pad(int64_t n)
{
    return (n + FA_CPU_GEMM_NPAD - 1) / FA_CPU_GEMM_NPAD * FA_CPU_GEMM_NPAD;
}

#endif /* FA_CPU_GEMM_H */
