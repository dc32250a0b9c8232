/*
 * The scoring rules: which keys a query row sees, softcap, ALiBi, sinks and the default scale,
 * fp32 -> fp8 rounding, and an exp2 off the MUFU pipe, each written once.
 * Compiled by the host (C11: the API's validation and the CPU backend) and by
 * NVRTC (CUDA C: the kernels), like fa_kparams.h, so no backend can drift from another.
 *
 * Positions are computed in 64 bits (fa_i64: exact for any sequence the API accepts); kernels
 * pass their 32-bit ones, which widen as the kernels' own arithmetic did. Most rules are macros:
 * one text serves int64 and int positions, float and double scores and the caller's tanh / exp
 * (libm, a vectorisable approximation, or a PTX intrinsic), and the window's fields are read
 * where used, as the code they replaced did, so every compiler emits the same instructions.
 */
#ifndef FA_RULES_H
#define FA_RULES_H

#include "fa_kparams.h"

#if defined(__CUDACC__)
#define FA_RULE static __device__ __forceinline__
#else
#include <math.h>
#include <stdint.h>
#include <string.h>
#define FA_RULE static inline
#endif

/* ---- the visible keys ------------------------------------------------------------------------ */

/*
 * The keys [*lo, *hi) that query row i sees in a sequence of sq queries and sk keys (fa_i64 lo,
 * hi). Bottom-right aligned: row i's diagonal is key i + sk - sq (the last query row sees the last
 * key). The window keeps keys [diag - window_left, diag + window_right], -1 unbounded on that
 * side; causal is window_right 0, folded in by validation. An empty range has lo == hi.
 */
#define FA_RULE_KEY_RANGE(i, sq, sk, window_left, window_right, lo, hi)                           \
    do {                                                                                          \
        const fa_i64 fa_diag_ = (fa_i64)(i) + (sk) - (sq);                                       \
        fa_i64 fa_l_ = (window_left) >= 0 ? fa_diag_ - (window_left) : 0;                         \
        fa_i64 fa_r_ = (window_right) >= 0 ? fa_diag_ + (window_right) + 1 : (sk);                \
        if (fa_l_ < 0)                                                                            \
            fa_l_ = 0;                                                                            \
        if (fa_r_ > (sk))                                                                         \
            fa_r_ = (sk);                                                                         \
        if (fa_r_ < fa_l_)                                                                        \
            fa_r_ = fa_l_;                                                                        \
        (lo) = fa_l_;                                                                             \
        (hi) = fa_r_;                                                                             \
    } while (0)

/* The keys [lo, hi) that any of the rows [r0, r0 + m) sees (m >= 1): both window edges grow with
 * the row, so they lie between the first row's first key and the last row's last one. */
#define FA_RULE_TILE_KEYS(r0, m, sq, sk, window_left, window_right, lo, hi)                       \
    do {                                                                                          \
        fa_i64 fa_unused_;                                                                        \
        FA_RULE_KEY_RANGE(r0, sq, sk, window_left, window_right, lo, fa_unused_);                 \
        FA_RULE_KEY_RANGE((r0) + (m) - 1, sq, sk, window_left, window_right, fa_unused_, hi);     \
        (void)&fa_unused_;                                                                        \
    } while (0)

/* The query rows [lo, hi) among sq that see any key of [j0, j1) (the backward's view from the
 * keys): row i sees [i + shift - window_left, i + shift + window_right], shift = sk - sq, so it
 * sees the block iff j0 - shift - window_right <= i < j1 - shift + window_left; keys from sk on
 * are seen by no row. */
#define FA_RULE_ROW_RANGE(j0, j1, sq, sk, window_left, window_right, lo, hi)                      \
    do {                                                                                          \
        const fa_i64 fa_shift_ = (fa_i64)(sk) - (sq);                                            \
        fa_i64 fa_l_ = 0, fa_h_ = (sq);                                                           \
        if ((j0) >= (sk))                                                                         \
            fa_h_ = 0;                                                                            \
        if ((window_right) >= 0 && (j0) - fa_shift_ - (window_right) > fa_l_)                     \
            fa_l_ = (j0) - fa_shift_ - (window_right);                                            \
        if ((window_left) >= 0 && (j1) - fa_shift_ + (window_left) < fa_h_)                       \
            fa_h_ = (j1) - fa_shift_ + (window_left);                                             \
        (lo) = fa_l_;                                                                             \
        (hi) = fa_h_ > fa_l_ ? fa_h_ : fa_l_;                                                     \
    } while (0)

/* The window as bounds on dg = i + sk - sq - j, key j's distance behind row i's diagonal: key j
 * is in row i's window iff FA_RULE_DG_MIN(window_right) <= dg <= FA_RULE_DG_MAX(window_left)
 * (32-bit, for the kernels' per-element test; an unbounded side gives +-INT_MAX). */
#define FA_RULE_DG_MAX(window_left) ((window_left) < 0 ? 0x7fffffff : (window_left))
#define FA_RULE_DG_MIN(window_right) ((window_right) < 0 ? -0x7fffffff : -(window_right))

/* ---- the score of query i and key j ----------------------------------------------------------- */

/*
 * Softcap: a scaled score x becomes softcap * tanh(x / softcap). Written with the softmax scale
 * folded into tanh's argument, s the raw q.k: pre = scale / softcap and post = softcap, or post =
 * softcap * log2(e) where scores are kept in base-2 units for exp2 (fa_rule_softcap_fold). TANH is
 * the caller's tanh for the element type.
 */
#define FA_RULE_SOFTCAP_TANH(s, pre, TANH) TANH((s) * (pre))
#define FA_RULE_SOFTCAP(s, pre, post, TANH) (FA_RULE_SOFTCAP_TANH(s, pre, TANH) * (post))
/* d(softcapped score) / d(scaled score), from th = FA_RULE_SOFTCAP_TANH(...). */
#define FA_RULE_SOFTCAP_GRAD(th) (1 - (th) * (th))

/* The kernels' factors for base-2 scores: without softcap, score * scale * log2(e); with softcap,
 * FA_RULE_SOFTCAP(s, *pre, *scale_log2, tanh). */
FA_RULE void fa_rule_softcap_fold(double scale, double softcap, float *pre, float *scale_log2)
{
    const double log2e = 1.4426950408889634;
    if (softcap > 0) {
        *pre = (float)(scale / softcap);
        *scale_log2 = (float)(softcap * log2e);
    } else {
        *scale_log2 = (float)(scale * log2e);
    }
}

/* ALiBi: the score of query i and key j loses slope * |dist|, dist = i + sk - sq - j its distance
 * from the row's (bottom-right aligned) diagonal; slope per head, or per batch and head. */
#define FA_RULE_ABS_DIST(dist) ((dist) < 0 ? -(dist) : (dist))
#define FA_RULE_ALIBI(slope, dist) ((slope) * FA_RULE_ABS_DIST(dist))

/*
 * 2^x on the FMA pipe, for kernels whose exponentials queue on the MUFU pipe (FA4 moves a share
 * of them so): x = j + f with j = rint(x) from the 1.5 * 2^23 shift, 2^f (|f| <= 1/2) a cubic
 * through 1 at f = 0 (relative error 1.0e-4, against the fp8 P's 2^-4), j added to the exponent
 * field. x is clamped to -127, where the sum is exactly +0 (ex2.approx.ftz gives 0 under -126),
 * NaN stays NaN; x above 127 is not handled (callers pass scores minus their row maximum).
 */
FA_RULE float fa_rule_exp2_poly(float x)
{
    const float xc = fmaxf(x, -127.f);
    const float t = xc + 12582912.f; /* rint(xc) in the low mantissa bits */
    const float f = xc - (t - 12582912.f);
    const float p = fmaf(fmaf(fmaf(0.05500882f, f, 0.24221078f), f, 0.6932829f), f, 1.f);
#if defined(__CUDACC__)
    const float y = __int_as_float(__float_as_int(p) + (int)((unsigned)__float_as_int(t) << 23));
#else
    int32_t pb, tb;
    memcpy(&pb, &p, 4);
    memcpy(&tb, &t, 4);
    const int32_t yb = (int32_t)((uint32_t)pb + ((uint32_t)tb << 23));
    float y;
    memcpy(&y, &yb, 4);
#endif
    return x == x ? y : x;
}

/* ---- a row's softmax ---------------------------------------------------------------------------- */

/*
 * Sinks: a head's sink logit joins each row's softmax denominator as one more key with no value.
 * With big = max(row maximum, sink) and l_scaled the row's sum of exp(score - big), the row's
 * normaliser is l_scaled + exp(sink - big) (has_sink false: no term), lse = big + log(total), and
 * out = sum exp(score - big) v / total. A row with no visible key and no sink gets lse +inf and out
 * 0 (upstream's empty row). EXP is the caller's exp (or exp2 with base-2 logits).
 */
#define FA_RULE_SINK_TERM(has_sink, sink, big, EXP) ((has_sink) ? EXP((sink) - (big)) : 0)
#define FA_RULE_SINK_TOTAL(l_scaled, has_sink, sink, big, EXP)                                   \
    ((l_scaled) + FA_RULE_SINK_TERM(has_sink, sink, big, EXP))
/* A split's partial with lse +-inf (INF: the caller's infinity) holds nothing and is skipped
 * by the merge; a NaN lse is not empty: it makes the merged row NaN. */
#define FA_RULE_PART_EMPTY(l, INF) ((l) == (INF) || (l) == -(INF))
/* What one row takes from the sink's gradient: exp(sink - lse) * D, D = rowsum(dO * O). */
#define FA_RULE_SINK_GRAD(sink, lse, dsum, EXP) (EXP((sink) - (lse)) * (dsum))

/* The softmax scale when the caller gives none (NaN): head_dim ** -0.5, computed as upstream's
 * Python computes it, so that the default is the same double. */
FA_RULE double fa_rule_default_scale(fa_i64 head_dim)
{
    return pow((double)head_dim, -0.5);
}

/* ---- the dropout mask ----------------------------------------------------------------------- */

/*
 * The keep bit of element (row, col) of a (sequence, head) whose Philox stream is c (fa_dropout_keep
 * in flashattn.h is the public statement): Philox4x32 with FA_RULE_PHILOX_ROUNDS rounds, key
 * (lo32(seed), hi32(seed)) and counter (FA_RULE_DROPOUT_BLOCK(col), row, lo32(c), hi32(c)) gives
 * words w0..w3; the element's number is the byte (w[FA_RULE_DROPOUT_WORD(col)] >>
 * FA_RULE_DROPOUT_SHIFT(col)) & 0xff, and it is kept iff that number is below the call's
 * threshold, (1 - p) * 256 rounded to nearest (fa_dropout_threshold). Seven rounds and 8-bit
 * numbers are upstream FA2's; a block's 16 columns sit so that columns 2t, 2t + 1, 8 + 2t and
 * 9 + 2t (one lane's share of an mma fragment's 16 columns) are the bytes of word t.
 */
#define FA_RULE_PHILOX_ROUNDS 7
#define FA_RULE_DROPOUT_BLOCK(col) ((col) >> 4)
#define FA_RULE_DROPOUT_WORD(col) (((col) & 7) >> 1)
#define FA_RULE_DROPOUT_SHIFT(col) (8 * (((col) & 1) | (((col) >> 2) & 2)))

/* ---- a KV cache's capacity ------------------------------------------------------------------ */

/* Whether a sequence with len positions in its cache takes s_new more within capacity positions
 * (the paged capacity check: on the host for host cache_seqlens, in the kernels for device ones). */
#define FA_RULE_KV_FITS(len, s_new, capacity) ((len) >= 0 && (len) + (s_new) <= (capacity))

/* ---- fp8 rounding ------------------------------------------------------------------------- */

/*
 * fp32 -> fp8 as torch converts, bit for bit (fa_fp8_from_f32; the fp8 KV caches' append on
 * every backend): from the fp32 bits u, round to nearest, ties to even, in integer arithmetic
 * (no dependence on the FP rounding mode or on denormal flushing), subnormals kept, NaN the
 * kind's NaN with u's sign. e4m3 (torch.float8_e4m3fn) saturates finite overflow and infinities
 * to +-448; e5m2 overflows to +-inf.
 */

/* |x| (fp32 bits a, normal or subnormal, below the smallest normal of the fp8 kind) as a multiple
 * of 2^qexp, nearest even: the fp8 subnormal's mantissa (which may carry into the smallest normal,
 * whose code follows the subnormals). */
FA_RULE fa_u32 fa_rule_fp8_subnormal(fa_u32 a, int qexp)
{
    if (a < 0x00800000u)
        return 0; /* an fp32 subnormal is far below half of any fp8 quantum */
    const int e = (int)(a >> 23) - 127;
    const fa_u32 mant = (a & 0x7fffffu) | 0x800000u; /* |x| = mant * 2^(e - 23) */
    const int shift = qexp - (e - 23);               /* |x| / 2^qexp = mant >> shift */
    if (shift > 24)
        return 0; /* below half a quantum */
    fa_u32 q = mant >> shift;
    const fa_u32 rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u)))
        q++;
    return q;
}

FA_RULE fa_u32 fa_rule_e4m3_from_bits(fa_u32 u)
{
    const fa_u32 a = u & 0x7fffffffu, sign = (u >> 24) & 0x80u;
    if (a > 0x7f800000u)
        return sign | 0x7fu; /* NaN */
    if (a >= 0x43e00000u)
        return sign | 0x7eu; /* >= 448, infinities included: saturate to 448 */
    if (a < 0x3c800000u)     /* below 2^-6: subnormal, quantum 2^-9 */
        return sign | fa_rule_fp8_subnormal(a, -9);
    const fa_u32 r = a + 0x7ffffu + ((a >> 20) & 1u); /* 3 mantissa bits, ties to even */
    return sign | (((r >> 23) - 120u) << 3) | ((r >> 20) & 7u);
}

FA_RULE fa_u32 fa_rule_e5m2_from_bits(fa_u32 u)
{
    const fa_u32 a = u & 0x7fffffffu, sign = (u >> 24) & 0x80u;
    if (a > 0x7f800000u)
        return sign | 0x7fu; /* NaN */
    if (a >= 0x47700000u)
        return sign | 0x7cu; /* >= 61440 rounds past 57344: infinity */
    if (a < 0x38800000u)     /* below 2^-14: subnormal, quantum 2^-16 */
        return sign | fa_rule_fp8_subnormal(a, -16);
    const fa_u32 r = a + 0xfffffu + ((a >> 21) & 1u); /* 2 mantissa bits, ties to even */
    return sign | (((r >> 23) - 112u) << 2) | ((r >> 21) & 3u);
}

#endif /* FA_RULES_H */
