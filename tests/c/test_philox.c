/*
 * test_philox: Philox4x32 and the dropout keep bit.
 *  - the reference's Philox (10 and 7 rounds) against Random123's published known-answer vectors;
 *  - the library's fa_dropout_keep on exact thresholds derived from the 7-round vectors (this
 *    pins the counter/key layout and the byte extraction of the header's definition);
 *  - fa_dropout_keep against the reference's independent implementation on many random inputs;
 *  - keep fraction statistically near round((1 - p) * 256) / 256, pairs uncorrelated.
 */
#include <math.h>
#include <stdio.h>

#include "fa_ref.h"
#include "flashattn.h"
#include "test_util.h"

typedef struct kat {
    uint32_t ctr[4];
    uint32_t key[2];
    uint32_t expect[4];
} kat;

/* Random123's kat_vectors, philox4x32 10 and philox4x32 7 (what dropout runs). */
static const kat kats10[3] = {
    {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
    {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
     {0xffffffffu, 0xffffffffu},
     {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
    {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
     {0xa4093822u, 0x299f31d0u},
     {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
};
static const kat kats[3] = {
    {{0, 0, 0, 0}, {0, 0}, {0x5f6fb709u, 0x0d893f64u, 0x4f121f81u, 0x4f730a48u}},
    {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
     {0xffffffffu, 0xffffffffu},
     {0x5207ddc2u, 0x45165e59u, 0x4d8ee751u, 0x8c52f662u}},
    {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
     {0xa4093822u, 0x299f31d0u},
     {0x4dfccabau, 0x190a87f0u, 0xc47362bau, 0xb6b5242au}},
};

static void test_kat(void)
{
    tu_where = "ref Philox KAT";
    for (int v = 0; v < 6; v++) {
        const kat *K = v < 3 ? &kats10[v] : &kats[v - 3];
        uint32_t out[4];
        fa_ref_philox4x32(K->ctr, K->key, v < 3 ? 10 : 7, out);
        for (int i = 0; i < 4; i++) {
            TU_CHECK(out[i] == K->expect[i], "vector %d word %d: got %08x want %08x", v, i, out[i],
                     K->expect[i]);
        }
    }
}

/* Exact-threshold checks of the library's keep bit. For each 7-round KAT vector we choose
   (seed, offset, num_heads, batch, head, row, col) that make the header's counter and key equal to
   the vector's, so the element's 8-bit number r is known; then with p = 1 - k/256 (exact) the
   element must be dropped for k = r and kept for k = r + 1. */
static void test_keep_kat(void)
{
    tu_where = "fa_dropout_keep on KAT-derived thresholds";
    for (int v = 0; v < 3; v++) {
        const kat *K = &kats[v];
        uint64_t seed = (uint64_t)K->key[0] | ((uint64_t)K->key[1] << 32);
        uint64_t c = (uint64_t)K->ctr[2] | ((uint64_t)K->ctr[3] << 32);
        int64_t row = (int64_t)K->ctr[1];
        /* split c = offset + batch * num_heads + head in a few different ways */
        int64_t nh_choices[3] = {1, 5, 16};
        for (int s = 0; s < 3; s++) {
            int64_t nh = nh_choices[s];
            int64_t batch = (s == 0) ? 0 : 3;
            int64_t head = (s == 0) ? 0 : nh - 1;
            uint64_t used = (uint64_t)(batch * nh + head);
            if (c < used) {
                batch = 0;
                head = 0;
                used = 0;
            }
            uint64_t offset = c - used;
            for (int t = 0; t < 16; t++) {
                int64_t col = ((int64_t)K->ctr[0] << 4) + t;
                /* column t of the block: word (t % 8) / 2, byte t % 2 + 2 (t / 8) */
                uint32_t r = (K->expect[(t % 8) / 2] >> (8 * (t % 2 + 2 * (t / 8)))) & 0xffu;
                /* k = r: threshold r, r < r false -> dropped */
                double p_drop = 1.0 - (double)r / 256.0;
                double p_keep = 1.0 - (double)(r + 1) / 256.0;
                int ref_drop = fa_ref_dropout_keep(seed, offset, nh, batch, head, row, col, p_drop);
                int ref_keep = fa_ref_dropout_keep(seed, offset, nh, batch, head, row, col, p_keep);
                TU_CHECK((r == 0 || ref_drop == 0) && ref_keep == 1,
                         "ref keep bit wrong: vector %d col %d", v, t);
                if (r > 0) { /* r = 0 would need p = 1, outside the domain */
                    int lib_drop = fa_dropout_keep(seed, offset, nh, batch, head, row, col, p_drop);
                    TU_CHECK(lib_drop == 0,
                             "vector %d col%%16=%d (r=0x%02x): p=1-r/256 must drop, got keep=%d", v,
                             t, r, lib_drop);
                }
                int lib_keep = fa_dropout_keep(seed, offset, nh, batch, head, row, col, p_keep);
                TU_CHECK(lib_keep == 1,
                         "vector %d col%%16=%d (r=0x%02x): p=1-(r+1)/256 must keep, got %d", v, t, r,
                         lib_keep);
            }
        }
    }
}

static void test_random_agreement(tu_rng *rng)
{
    tu_where = "fa_dropout_keep vs ref on random inputs";
    int mismatches = 0;
    const int n = 400000;
    for (int it = 0; it < n; it++) {
        uint64_t seed = tu_rng_u64(rng);
        uint64_t offset = tu_rng_chance(rng, 0.5) ? tu_rng_u64(rng) : (uint64_t)tu_rng_int(rng, 0, 1 << 20);
        if (tu_rng_chance(rng, 0.1)) {
            offset = 0xffffffffull - (uint64_t)tu_rng_int(rng, 0, 300); /* lo32 carry region */
        }
        int64_t nh = tu_rng_int(rng, 1, 64);
        int64_t batch = tu_rng_int(rng, 0, tu_rng_chance(rng, 0.5) ? 7 : 100000);
        int64_t head = tu_rng_int(rng, 0, nh - 1);
        int64_t row = tu_rng_chance(rng, 0.5) ? tu_rng_int(rng, 0, 4096) : tu_rng_int(rng, 0, 0x7fffffff);
        int64_t col = tu_rng_chance(rng, 0.5) ? tu_rng_int(rng, 0, 4096) : tu_rng_int(rng, 0, ((int64_t)1 << 34) - 1);
        double p;
        switch (tu_rng_int(rng, 0, 3)) {
        case 0:
            p = tu_rng_uniform(rng, 0.0, 1.0);
            break;
        case 1:
            p = 1.0 - (double)tu_rng_int(rng, 1, 256) / 256.0; /* exact thresholds */
            break;
        case 2:
            p = (double)tu_rng_int(rng, 1, 99) / 100.0; /* decimal values */
            break;
        default:
            p = tu_rng_chance(rng, 0.5) ? 0.0 : 0.5;
            break;
        }
        int want = fa_ref_dropout_keep(seed, offset, nh, batch, head, row, col, p);
        int got = fa_dropout_keep(seed, offset, nh, batch, head, row, col, p);
        if ((got != 0) != (want != 0)) {
            if (++mismatches <= 10) {
                TU_CHECK(0,
                         "seed=%llu offset=%llu nh=%lld batch=%lld head=%lld row=%lld col=%lld "
                         "p=%.17g: lib %d ref %d",
                         (unsigned long long)seed, (unsigned long long)offset, (long long)nh,
                         (long long)batch, (long long)head, (long long)row, (long long)col, p, got,
                         want);
            }
        }
        TU_CHECK(got == 0 || got == 1, "fa_dropout_keep returned %d (not 0/1)", got);
    }
    TU_CHECK(mismatches == 0, "%d of %d random elements disagree", mismatches, n);
}

static void test_fraction(tu_rng *rng)
{
    tu_where = "keep fraction";
    const double ps[] = {0.0, 0.1, 0.17, 0.25, 0.5, 0.9, 0.999};
    for (size_t pi = 0; pi < sizeof ps / sizeof ps[0]; pi++) {
        double p = ps[pi];
        uint64_t seed = tu_rng_u64(rng);
        uint64_t offset = (uint64_t)tu_rng_int(rng, 0, 1000000);
        int64_t nh = 3, rows = 300, cols = 256;
        int64_t kept = 0, pairs = 0, npairs = 0, diff_heads = 0;
        int64_t n = 0;
        for (int64_t head = 0; head < nh; head++) {
            for (int64_t row = 0; row < rows; row++) {
                int prev = -1;
                for (int64_t col = 0; col < cols; col++) {
                    int k = fa_dropout_keep(seed, offset, nh, 1, head, row, col, p);
                    kept += k;
                    n++;
                    if (prev >= 0 && (col & 1)) {
                        pairs += (prev && k);
                        npairs++;
                    }
                    prev = k;
                    if (head == 1) {
                        diff_heads += k != fa_dropout_keep(seed, offset, nh, 1, 0, row, col, p);
                    }
                }
            }
        }
        double q = floor((1.0 - p) * 256.0 + 0.5) / 256.0;
        double frac = (double)kept / (double)n;
        double sigma = sqrt(q * (1.0 - q) / (double)n);
        if (p == 0.0) {
            TU_CHECK(kept == n, "p=0 must keep everything, kept %lld of %lld", (long long)kept,
                     (long long)n);
        } else {
            TU_CHECK(fabs(frac - q) <= 6.0 * sigma + 1e-12,
                     "p=%g: keep fraction %.6f, expected %.6f +- %.6f (6 sigma)", p, frac, q,
                     6.0 * sigma);
            double pf = (double)pairs / (double)npairs;
            double psig = sqrt(q * q * (1.0 - q * q) / (double)npairs);
            TU_CHECK(fabs(pf - q * q) <= 6.0 * psig + 1e-12,
                     "p=%g: adjacent columns both kept %.6f, expected %.6f (independent)", p, pf,
                     q * q);
            if (p >= 0.1 && p <= 0.9) {
                TU_CHECK(diff_heads > 0, "p=%g: heads 0 and 1 have identical masks", p);
            }
        }
    }
}

int main(void)
{
    uint64_t seed = tu_master_seed("test_philox");
    tu_rng rng = {seed};
    test_kat();
    test_keep_kat();
    test_random_agreement(&rng);
    test_fraction(&rng);
    return tu_finish("test_philox");
}
