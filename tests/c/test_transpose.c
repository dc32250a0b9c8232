/*
 * test_transpose: fa_cpu_transpose_f32 (the fp32 kernels' Q^T / dO^T packing) against the
 * element-by-element definition, bitwise: every rows x cols remainder of its 16x16 blocks, row
 * gaps on both sides, scales of 1 and not, and nothing written outside the transposed
 * rectangle (dst starts as NaN poison and must keep it there).
 *
 * FA_TEST_SEED=<n> reruns a run.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/fa_cpu_gemm.h"
#include "test_util.h"

static int check_case(tu_rng *r, int64_t rows, int64_t cols)
{
    const int64_t lds = cols + tu_rng_int(r, 0, 20), ldd = rows + tu_rng_int(r, 0, 20);
    const float scale = tu_rng_chance(r, 0.5) ? 1.0f : (float)tu_rng_uniform(r, 0.05, 2.0);
    const size_t ns = (size_t)(rows * lds) + 1, nd = (size_t)(cols * ldd) + 1;
    float *src = malloc(sizeof *src * ns), *dst = malloc(sizeof *dst * nd);
    for (size_t i = 0; i < ns; i++)
        src[i] = (float)tu_rng_uniform(r, -3, 3);
    for (size_t i = 0; i < nd; i++)
        dst[i] = NAN;
    fa_cpu_transpose_f32(dst, ldd, src, lds, rows, cols, scale);
    int bad = 0;
    for (int64_t c = 0; c < cols; c++)
        for (int64_t i = 0; i < ldd; i++) {
            const float got = dst[c * ldd + i];
            if (i < rows) {
                const float want = src[i * lds + c] * scale;
                bad += memcmp(&got, &want, sizeof got) != 0;
            } else {
                bad += !isnan(got);
            }
        }
    bad += !isnan(dst[nd - 1]); /* the element past the last row */
    if (bad)
        fprintf(stderr, "FAIL rows %lld cols %lld lds %lld ldd %lld scale %g: %d elements\n",
                (long long)rows, (long long)cols, (long long)lds, (long long)ldd, scale, bad);
    free(src);
    free(dst);
    return bad != 0;
}

int main(void)
{
    tu_rng rng = {tu_master_seed("test_transpose")};
    int failed = 0, cases = 0;
    for (int64_t rows = 1; rows <= 50; rows++)
        for (int64_t cols = 1; cols <= 50; cols += cols < 20 ? 1 : 7, cases++)
            failed += check_case(&rng, rows, cols);
    for (int i = 0; i < 40; i++, cases++)
        failed += check_case(&rng, 16 * tu_rng_int(&rng, 1, 16), tu_rng_int(&rng, 1, 256));
    printf("test_transpose: %d cases, %d failed\n", cases, failed);
    return failed != 0;
}
