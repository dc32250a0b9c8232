/*
 * The fp16 -> fp32 conversions (src/util/fa_half.h, src/cpu/fa_cpu_f16.c): the CPU kernels' row
 * loads (fa_cpu_f16_to_f32_row: F16C where the CPU has it) and fa_f16_to_f32_lanes (compilers
 * vectorise it) give the same bits as fa_f16_to_f32 for every one of the 65536 inputs, at odd
 * offsets and every short length, and fa_f16_to_f32_lanes does in loops compiled for wide
 * vectors too (where the CPU has them); known values come out exactly; every non-NaN input
 * survives the round trip through fa_f32_to_f16.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "test_util.h"
#include "cpu/fa_cpu_f16.h"
#include "util/fa_half.h"

#define N_INPUTS 65536

static uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* The same loop three times: as the baseline build compiles it, and for AVX2 and AVX-512, as
 * the kernels' clones do (vectorised there; the attribute is gcc's and clang's). */
static void convert(float *dst, const uint16_t *src, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = fa_f16_to_f32_lanes(src[i]);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_WIDE 1
__attribute__((target("arch=x86-64-v3"))) static void convert_v3(float *dst, const uint16_t *src,
                                                                 int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = fa_f16_to_f32_lanes(src[i]);
}

__attribute__((target("arch=x86-64-v4"))) static void convert_v4(float *dst, const uint16_t *src,
                                                                 int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = fa_f16_to_f32_lanes(src[i]);
}
#else
#define HAVE_WIDE 0
#endif

/* Inputs in a shuffled order at an odd offset, so vector loops see unaligned rows. */
static void check_loop(const char *name, void (*fn)(float *, const uint16_t *, int64_t),
                       const uint16_t *src, int64_t n)
{
    static float out[N_INPUTS + 1];
    out[n] = 12345.f;
    fn(out, src, n);
    int64_t wrong = 0, first = -1;
    for (int64_t i = 0; i < n; i++)
        if (bits(out[i]) != bits(fa_f16_to_f32(src[i])) && wrong++ == 0)
            first = i;
    TU_CHECK(wrong == 0, "%s: %lld of %lld inputs differ from fa_f16_to_f32 (first 0x%04x)", name,
             (long long)wrong, (long long)n, first >= 0 ? src[first] : 0);
    TU_CHECK(out[n] == 12345.f, "%s: wrote past the row", name);
}

int main(void)
{
    tu_rng rng = {tu_master_seed("test_half")};
    static uint16_t all[N_INPUTS + 1];
    for (int64_t i = 0; i < N_INPUTS; i++)
        all[i + 1] = (uint16_t)i;
    for (int64_t i = N_INPUTS - 1; i > 0; i--) {
        const int64_t j = tu_rng_int(&rng, 0, i);
        const uint16_t t = all[i + 1];
        all[i + 1] = all[j + 1];
        all[j + 1] = t;
    }
    const uint16_t *src = all + 1;

    check_loop("baseline", convert, src, N_INPUTS);
#if HAVE_WIDE
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        check_loop("x86-64-v3", convert_v3, src, N_INPUTS);
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        check_loop("x86-64-v4", convert_v4, src, N_INPUTS);
#endif
    check_loop("fa_cpu_f16_to_f32_row", fa_cpu_f16_to_f32_row, src, N_INPUTS);
    /* Lengths that leave every remainder of a vector loop. */
    for (int64_t n = 0; n <= 70; n++) {
        check_loop("short", convert, src + tu_rng_int(&rng, 0, 1000), n);
        check_loop("short row", fa_cpu_f16_to_f32_row, src + tu_rng_int(&rng, 0, 1000), n);
    }

    static const struct {
        uint16_t h;
        float f;
    } known[] = {
        {0x3c00, 1.0f},          {0xc000, -2.0f},        {0x7bff, 65504.0f},
        {0x0001, 0x1p-24f},      {0x03ff, 1023 * 0x1p-24f}, {0x0400, 0x1p-14f},
        {0x3555, 0x1.554p-2f},   {0x7c00, INFINITY},     {0xfc00, -INFINITY},
    };
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        TU_CHECK(bits(fa_f16_to_f32_lanes(known[i].h)) == bits(known[i].f),
                 "0x%04x -> %a, expected %a", known[i].h, fa_f16_to_f32_lanes(known[i].h),
                 known[i].f);
    TU_CHECK(bits(fa_f16_to_f32_lanes(0x8000)) == 0x80000000u, "0x8000 is not -0");
    /* NaN: quiet, with its payload and sign. */
    TU_CHECK(bits(fa_f16_to_f32_lanes(0x7c01)) == 0x7fc02000u, "signalling NaN 0x7c01 -> 0x%08x",
             bits(fa_f16_to_f32_lanes(0x7c01)));
    TU_CHECK(bits(fa_f16_to_f32_lanes(0xfe00)) == 0xffc00000u, "quiet NaN 0xfe00 -> 0x%08x",
             bits(fa_f16_to_f32_lanes(0xfe00)));

    int64_t lost = 0;
    for (int64_t i = 0; i < N_INPUTS; i++) {
        const uint16_t h = (uint16_t)i;
        if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu))
            continue;
        lost += fa_f32_to_f16(fa_f16_to_f32_lanes(h)) != h;
    }
    TU_CHECK(lost == 0, "%lld inputs did not survive fp16 -> fp32 -> fp16", (long long)lost);
    return tu_finish("test_half");
}
