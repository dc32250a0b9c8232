/*
 * Counter-based Philox4x32 (FA_RULE_PHILOX_ROUNDS rounds): the dropout keep bit of an element is a
 * pure function of (seed, offset, batch, head, row, col), so every backend and every tile size
 * draws the same mask. The rule is kernels/fa_rules.h's; fa_dropout_keep() in flashattn.h states it.
 */
#ifndef FA_PHILOX_H
#define FA_PHILOX_H

#include <stdint.h>

#include "fa_rules.h"

typedef struct fa_philox4 {
    uint32_t w[4];
} fa_philox4;

/* The Weyl increments of the two key words, added after each round. */
#define FA_PHILOX_W0 0x9E3779B9u
#define FA_PHILOX_W1 0xBB67AE85u

/* Philox4x32 of `rounds` rounds (Random123's philox4x32_R) on counter (c0..c3), key (k0, k1). */
static inline fa_philox4 fa_philox4x32(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                       uint32_t k0, uint32_t k1, int rounds)
{
    for (int round = 0; round < rounds; round++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0;
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += FA_PHILOX_W0;
        k1 += FA_PHILOX_W1;
    }
    fa_philox4 r = {{c0, c1, c2, c3}};
    return r;
}

/* The round keys of the dropout Philox under seed: round r uses keys[2r], keys[2r + 1]. */
static inline void fa_philox_keys(uint64_t seed, uint32_t keys[2 * FA_RULE_PHILOX_ROUNDS])
{
    for (uint32_t r = 0; r < FA_RULE_PHILOX_ROUNDS; r++) {
        keys[2 * r] = (uint32_t)seed + r * FA_PHILOX_W0;
        keys[2 * r + 1] = (uint32_t)(seed >> 32) + r * FA_PHILOX_W1;
    }
}

/* The sixteen 8-bit numbers of the block of columns holding col of one (batch, head, row). */
static inline fa_philox4 fa_dropout_block(uint64_t seed, uint64_t stream, int64_t row,
                                          int64_t col)
{
    return fa_philox4x32((uint32_t)FA_RULE_DROPOUT_BLOCK(col), (uint32_t)row, (uint32_t)stream,
                         (uint32_t)(stream >> 32), (uint32_t)seed, (uint32_t)(seed >> 32),
                         FA_RULE_PHILOX_ROUNDS);
}

/* Whether two columns share a block (so the caller may reuse it). */
static inline int fa_dropout_same_block(int64_t col_a, int64_t col_b)
{
    return FA_RULE_DROPOUT_BLOCK(col_a) == FA_RULE_DROPOUT_BLOCK(col_b);
}

static inline uint32_t fa_dropout_number(const fa_philox4 *block, int64_t col)
{
    return (block->w[FA_RULE_DROPOUT_WORD(col)] >> FA_RULE_DROPOUT_SHIFT(col)) & 0xffu;
}

/* keep iff number < threshold; threshold = (1 - p) * 256 rounded to nearest, in [0, 256]. A p
 * outside [0, 1] (which only fa_dropout_keep lets through) is taken at the nearer end; NaN keeps
 * nothing. */
static inline uint32_t fa_dropout_threshold(double p)
{
    if (!(p < 1.0))
        return 0;
    return p <= 0.0 ? 256u : (uint32_t)((1.0 - p) * 256.0 + 0.5);
}

#endif /* FA_PHILOX_H */
