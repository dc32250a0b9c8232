/*
 * The scoring rules of kernels/fa_rules.h against their definitions, on random sequences and
 * windows: the key range of a row is exactly the keys j with -window_right <= i + sk - sq - j <=
 * window_left (each side -1 unbounded) within [0, sk); the key range of a tile of rows covers
 * every row's and no more; the rows of a key block are exactly the rows seeing one of its keys
 * (an empty range may lie past the rows);
 * the kernels' per-element bounds agree with the key range; softcap, its gradient, ALiBi, the
 * sink term and the default scale give their formulas' values; the kernels' division by a
 * multiply and shift (fa_div_magic, applied as fa_div_by does) gives the quotient.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "fa_kparams.h"
#include "fa_rules.h"
#include "test_util.h"

#define N_CASES 3000

/* The definition, key by key. */
static int sees(int64_t i, int64_t j, int64_t sq, int64_t sk, int wl, int wr)
{
    const int64_t dg = i + sk - sq - j;
    return j >= 0 && j < sk && (wl < 0 || dg <= wl) && (wr < 0 || dg >= -wr);
}

static void check_ranges(tu_rng *r)
{
    for (int c = 0; c < N_CASES; c++) {
        const int64_t sq = tu_rand_len(r), sk = tu_rand_len(r);
        const int wl = tu_rand_window_side(r, sk), wr = tu_rand_window_side(r, sk);
        const int dg_max = FA_RULE_DG_MAX(wl), dg_min = FA_RULE_DG_MIN(wr);
        int64_t tile_lo = INT64_MAX, tile_hi = INT64_MIN;
        const int64_t r0 = sq > 0 ? tu_rng_int(r, 0, sq - 1) : 0;
        const int64_t m = sq > 0 ? tu_rng_int(r, 1, sq - r0) : 0;
        for (int64_t i = 0; i < sq; i++) {
            int64_t lo = -7, hi = -7, first = -1, last = -2;
            FA_RULE_KEY_RANGE(i, sq, sk, wl, wr, lo, hi);
            for (int64_t j = 0; j < sk; j++) {
                const int64_t dg = i + sk - sq - j;
                const int in_bounds = dg >= dg_min && dg <= dg_max;
                TU_CHECK(in_bounds == sees(i, j, sq, sk, wl, wr),
                         "sq %lld sk %lld window (%d,%d) row %lld key %lld: DG bounds [%d, %d]",
                         (long long)sq, (long long)sk, wl, wr, (long long)i, (long long)j,
                         dg_min, dg_max);
                if (sees(i, j, sq, sk, wl, wr)) {
                    first = first < 0 ? j : first;
                    last = j;
                }
            }
            const int empty = first < 0;
            TU_CHECK(lo >= 0 && lo <= hi && hi <= sk &&
                         (empty ? lo == hi : lo == first && hi == last + 1),
                     "sq %lld sk %lld window (%d,%d) row %lld: [%lld, %lld), want [%lld, %lld]",
                     (long long)sq, (long long)sk, wl, wr, (long long)i, (long long)lo,
                     (long long)hi, (long long)first, (long long)last);
            if (i >= r0 && i < r0 + m && lo < hi) {
                tile_lo = lo < tile_lo ? lo : tile_lo;
                tile_hi = hi > tile_hi ? hi : tile_hi;
            }
        }
        if (m > 0 && tile_lo < tile_hi) {
            int64_t lo = -7, hi = -7;
            FA_RULE_TILE_KEYS(r0, m, sq, sk, wl, wr, lo, hi);
            TU_CHECK(lo == tile_lo && hi == tile_hi,
                     "sq %lld sk %lld window (%d,%d) rows [%lld, +%lld): [%lld, %lld), want "
                     "[%lld, %lld)",
                     (long long)sq, (long long)sk, wl, wr, (long long)r0, (long long)m,
                     (long long)lo, (long long)hi, (long long)tile_lo, (long long)tile_hi);
        }
        /* The rows that see a key of [j0, j1): an interval, exactly those rows. */
        const int64_t j0 = tu_rng_int(r, 0, sk + 3), j1 = j0 + tu_rng_int(r, 1, 40);
        int64_t lo = -7, hi = -7;
        FA_RULE_ROW_RANGE(j0, j1, sq, sk, wl, wr, lo, hi);
        TU_CHECK(lo == hi || (lo >= 0 && lo < hi && hi <= sq), "row range [%lld, %lld) of sq %lld",
                 (long long)lo, (long long)hi, (long long)sq);
        for (int64_t i = 0; i < sq; i++) {
            int any = 0;
            for (int64_t j = j0; j < j1; j++)
                any |= sees(i, j, sq, sk, wl, wr);
            TU_CHECK(any == (i >= lo && i < hi),
                     "sq %lld sk %lld window (%d,%d) keys [%lld, %lld): rows [%lld, %lld), row "
                     "%lld sees %d",
                     (long long)sq, (long long)sk, wl, wr, (long long)j0, (long long)j1,
                     (long long)lo, (long long)hi, (long long)i, any);
        }
    }
}

static int close_to(double got, double want)
{
    return fabs(got - want) <= 1e-12 * (1.0 + fabs(want));
}

static void check_scores(tu_rng *r)
{
    for (int c = 0; c < N_CASES; c++) {
        const double s = tu_rng_uniform(r, -50.0, 50.0), scale = tu_rng_uniform(r, 0.01, 2.0);
        const double cap = tu_rng_uniform(r, 0.5, 60.0);
        const double want = cap * tanh(s * scale / cap);
        const double th = FA_RULE_SOFTCAP_TANH(s, scale / cap, tanh);
        TU_CHECK(close_to(FA_RULE_SOFTCAP(s, scale / cap, cap, tanh), want),
                 "softcap %g of %g at scale %g: %g, want %g", cap, s, scale,
                 FA_RULE_SOFTCAP(s, scale / cap, cap, tanh), want);
        /* The derivative by a central difference of the softcapped score in the scaled score. */
        const double x = s * scale, h = 1e-6;
        const double diff = (cap * tanh((x + h) / cap) - cap * tanh((x - h) / cap)) / (2 * h);
        TU_CHECK(fabs(FA_RULE_SOFTCAP_GRAD(th) - diff) <= 1e-6,
                 "softcap %g at %g: gradient %g, want %g", cap, x, FA_RULE_SOFTCAP_GRAD(th), diff);
        /* The kernels' base-2 fold: exp2 of the folded score is exp of the softcapped one. */
        float pre = 0.f, scale_log2 = 0.f;
        fa_rule_softcap_fold(scale, cap, &pre, &scale_log2);
        const double folded = FA_RULE_SOFTCAP(s, (double)pre, (double)scale_log2, tanh);
        TU_CHECK(fabs(folded - want / log(2.0)) <= 1e-5 * (1.0 + fabs(want)),
                 "softcap fold %g at %g: %g base-2, want %g", cap, s, folded, want / log(2.0));
        fa_rule_softcap_fold(scale, 0.0, &pre, &scale_log2);
        TU_CHECK(fabs((double)scale_log2 - scale / log(2.0)) <= 1e-6 * scale / log(2.0),
                 "no softcap: scale_log2 %g for scale %g", (double)scale_log2, scale);

        const int64_t dist = tu_rng_int(r, -100000, 100000);
        const double slope = tu_rng_uniform(r, 0.0, 1.0);
        TU_CHECK(FA_RULE_ALIBI(slope, dist) == slope * (double)llabs((long long)dist),
                 "ALiBi slope %g dist %lld: %g", slope, (long long)dist,
                 FA_RULE_ALIBI(slope, dist));

        const double sink = tu_rng_uniform(r, -20.0, 20.0), big = tu_rng_uniform(r, -20.0, 20.0);
        const double l = tu_rng_uniform(r, 0.0, 100.0);
        TU_CHECK(FA_RULE_SINK_TOTAL(l, 1, sink, big, exp) == l + exp(sink - big) &&
                     FA_RULE_SINK_TOTAL(l, 0, sink, big, exp) == l,
                 "sink %g, max %g, sum %g", sink, big, l);
        TU_CHECK(FA_RULE_SINK_GRAD(sink, big, l, exp) == exp(sink - big) * l,
                 "sink gradient %g, lse %g, D %g", sink, big, l);

        const int64_t d = tu_rng_int(r, 1, 512);
        TU_CHECK(close_to(fa_rule_default_scale(d) * fa_rule_default_scale(d) * (double)d, 1.0),
                 "default scale of head dim %lld: %g", (long long)d, fa_rule_default_scale(d));
    }
}

/* j / d as fa_div_by (kernels/fa_common.cuh) computes it from fa_div_magic's numbers. */
static uint32_t div_by(uint32_t j, uint32_t mul, uint32_t shift)
{
    return (uint32_t)((((uint64_t)j * mul) >> 32) + j) >> shift;
}

static void check_div_one(uint32_t d, uint32_t j)
{
    fa_u32 mul, shift;
    fa_div_magic(d, &mul, &shift);
    TU_CHECK(div_by(j, mul, shift) == j / d, "%u / %u: %u, want %u (mul %u, shift %u)", j, d,
             div_by(j, mul, shift), j / d, mul, shift);
}

/* Every divisor to 4096 and random ones to 2^30, each at dividends around its multiples, at the
 * range's ends and at random. */
static void check_div(tu_rng *r)
{
    const uint32_t top = 0x7fffffffu;
    for (int c = 0; c < 4096 + N_CASES; c++) {
        const uint32_t d = c < 4096 ? (uint32_t)c + 1 : (uint32_t)tu_rng_int(r, 1, 1 << 30);
        const uint32_t last = top / d * d; /* the largest multiple in range */
        const uint32_t edges[] = {0, 1, d - 1, d, d + 1, 2 * d - 1, last - 1, last, top - 1, top};
        for (size_t e = 0; e < sizeof edges / sizeof edges[0]; e++)
            if (edges[e] <= top)
                check_div_one(d, edges[e]);
        for (int k = 0; k < 16; k++) {
            const uint32_t m = (uint32_t)tu_rng_int(r, 0, top / d);
            const uint32_t j = m * d + (uint32_t)tu_rng_int(r, 0, d - 1);
            if (j <= top)
                check_div_one(d, j);
        }
    }
}

/* fa_rule_exp2_poly against exp2: within 1.1e-4 relatively on [-126, 127) (a grid of every
 * 1/4096 and random points), below 2^-125 between -127 and -126, exactly +0 at -127 and under
 * (and -inf), NaN kept. */
static void check_exp2_poly(tu_rng *r)
{
    double worst = 0;
    for (int c = 0; c < 253 * 4096 + N_CASES; c++) {
        const float x = c < 253 * 4096 ? -126.f + (float)c / 4096.f
                                       : (float)tu_rng_uniform(r, -126.0, 127.0);
        const double want = exp2((double)x), got = fa_rule_exp2_poly(x);
        const double rel = fabs(got - want) / want;
        worst = rel > worst ? rel : worst;
        if (!(rel <= 1.1e-4))
            TU_CHECK(0, "exp2_poly(%.9g): %.9g, want %.9g", (double)x, got, want);
    }
    const float zeros[] = {-127.f, -127.5f, -200.f, -1e30f, -INFINITY};
    for (size_t i = 0; i < sizeof zeros / sizeof zeros[0]; i++) {
        const float y = fa_rule_exp2_poly(zeros[i]);
        TU_CHECK(y == 0.f && !signbit(y), "exp2_poly(%g): %g, want +0", (double)zeros[i],
                 (double)y);
    }
    for (float x = -127.f; x < -126.f; x += 1.f / 64) { /* exponent field 0: tiny, not garbage */
        const float y = fa_rule_exp2_poly(x);
        TU_CHECK(y >= 0.f && y < 0x1p-125f, "exp2_poly(%.9g): %g", (double)x, (double)y);
    }
    TU_CHECK(isnan(fa_rule_exp2_poly(NAN)), "exp2_poly(NaN) not NaN");
    TU_CHECK(worst > 1e-6, "exp2_poly: error %.3g, suspiciously exact", worst);
}

int main(void)
{
    tu_rng r = {tu_master_seed("test_rules")};
    check_ranges(&r);
    check_scores(&r);
    check_div(&r);
    check_exp2_poly(&r);
    return tu_finish("test_rules");
}
