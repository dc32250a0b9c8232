/*
 * test_exp_rows: fa_cpu_exp_rows_f32, the fp32 forward's exponentials on AVX-512, against exp in
 * double of the same fp32 argument s * emul - bmax (fused): within 1.2e-7 relative, 0 below
 * e^-87.34 and for -inf (masked scores), NaN for NaN scores, l grown by the outputs in row order
 * bitwise, columns outside [c0, c1) untouched. Without AVX-512 it must report so and change
 * nothing. fa_expf, the portable exponential, likewise: within 2.5e-7 relative, 0 below -87.3 and
 * for -inf, NaN for NaN.
 *
 * FA_TEST_SEED=<n> reruns a run.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/fa_cpu_gemm.h"
#include "cpu/fa_cpu_math.h"
#include "test_util.h"

static void check_case(tu_rng *r)
{
    const int64_t n = tu_rng_int(r, 1, 70), cols = 16 * tu_rng_int(r, 1, 6);
    const int64_t c0 = 16 * tu_rng_int(r, 0, cols / 16 - 1), c1 = cols, ld = cols + 16;
    const float emul = (float)tu_rng_uniform(r, 0.05, 1.0);
    float *st = malloc(sizeof *st * (size_t)(n * ld)), *in = malloc(sizeof *in * (size_t)(n * ld));
    float *bmax = malloc(sizeof *bmax * (size_t)cols), *l = malloc(sizeof *l * (size_t)cols);
    float *l_in = malloc(sizeof *l_in * (size_t)cols);
    tu_softmax_args(r, st, ld, n, cols, emul, bmax, l);
    for (int64_t k = tu_rng_int(r, 0, 3); k > 0; k--) /* NaN scores (q, k or softcap NaN) */
        st[tu_rng_int(r, 0, n - 1) * ld + tu_rng_int(r, 0, cols - 1)] = NAN;
    memcpy(in, st, sizeof *st * (size_t)(n * ld));
    memcpy(l_in, l, sizeof *l * (size_t)cols);
    if (!fa_cpu_exp_rows_f32(st, ld, n, c0, c1, emul, bmax, l)) {
        TU_CHECK(memcmp(st, in, sizeof *st * (size_t)(n * ld)) == 0 &&
                     memcmp(l, l_in, sizeof *l * (size_t)cols) == 0,
                 "declined, but changed its arguments");
        goto done;
    }
    int64_t bad_e = 0, bad_l = 0, bad_out = 0;
    for (int64_t i = 0; i < cols; i++) {
        float want = l_in[i];
        for (int64_t j = 0; j < n; j++) {
            const float got = st[j * ld + i], s = in[j * ld + i];
            if (i < c0) {
                bad_out += memcmp(&got, &s, sizeof got) != 0;
                continue;
            }
            want += got;
            bad_e += !tu_exp_ok(got, s, emul, bmax[i]);
        }
        for (int64_t j = 0; j < n; j++)
            for (int64_t k = c1; k < ld; k++)
                bad_out += memcmp(&st[j * ld + k], &in[j * ld + k], sizeof(float)) != 0;
        bad_l += i < c0 ? l[i] != l_in[i] : !(l[i] == want || (isnan(l[i]) && isnan(want)));
    }
    TU_CHECK(bad_e + bad_l + bad_out == 0,
             "n=%lld cols [%lld, %lld): %lld exponentials, %lld sums, %lld outside wrong",
             (long long)n, (long long)c0, (long long)c1, (long long)bad_e, (long long)bad_l,
             (long long)bad_out);
done:
    free(st);
    free(in);
    free(bmax);
    free(l);
    free(l_in);
}

static void check_expf(tu_rng *r)
{
    int64_t bad = 0;
    for (int it = 0; it < 200000; it++) {
        const float x = (float)tu_rng_uniform(r, -90.0, 88.0);
        const double ref = x < -87.3f ? 0 : exp((double)x);
        /* 2.55e-7 relative is the worst seen over 1e8 arguments where the compiler does not
         * contract the polynomial into FMAs (2.3e-7 where it does): about 2 ulp. */
        bad += !(fabs((double)fa_expf(x) - ref) <= ref * 3e-7);
    }
    TU_CHECK(bad == 0, "fa_expf: %lld of 200000 arguments off", (long long)bad);
    TU_CHECK(isnan(fa_expf(NAN)) && fa_expf(-INFINITY) == 0 && fa_expf(0) == 1,
             "fa_expf: NaN %g, -inf %g, 0 %g", (double)fa_expf(NAN), (double)fa_expf(-INFINITY),
             (double)fa_expf(0));
}

int main(void)
{
    tu_rng rng = {tu_master_seed("test_exp_rows")};
    for (int it = 0; it < 200; it++)
        check_case(&rng);
    check_expf(&rng);
    return tu_finish("test_exp_rows");
}
