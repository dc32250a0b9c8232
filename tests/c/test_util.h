/*
 * Shared helpers of the C tests: a seeded RNG, failure reporting, strided test tensors with guard
 * zones and NaN poison.
 */
#ifndef FA_TEST_UTIL_H
#define FA_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "flashattn.h"

/* ---- RNG (splitmix64) -------------------------------------------------------------------- */
typedef struct tu_rng {
    uint64_t state;
} tu_rng;

uint64_t tu_rng_u64(tu_rng *r);
double tu_rng_uniform(tu_rng *r, double lo, double hi); /* [lo, hi) */
int64_t tu_rng_int(tu_rng *r, int64_t lo, int64_t hi);  /* [lo, hi] inclusive */
int tu_rng_chance(tu_rng *r, double p);                 /* 1 with probability p */
/* On SIGALRM (the tests arm alarm(60) per case) print `where`, the description of the case in
   progress, and exit: a hang reports where it happened. */
void tu_watchdog_install(const char *where);
int64_t tu_rand_len(tu_rng *r);                         /* a sequence length, 0 and 1 often */
int64_t tu_rand_head_dim(tu_rng *r);                    /* a head dim in [1, 256] */
int tu_rand_window_side(tu_rng *r, int64_t sk);         /* -1, 0, or up to past sk */

/* Arguments for the softmax's exponential kernels: bmax[cols] in [-20, 20], l[cols] in [0, 50]
   and scores st[rows][ld] with x = st * emul - bmax[i % cols] at most 5.5 (bf16's slack): half
   within 3 of that, some far under exp's cut-off, 5% -inf (masked). */
void tu_softmax_args(tu_rng *r, float *st, int64_t ld, int64_t rows, int64_t cols, float emul,
                     float *bmax, float *l);
/* Whether got is exp(s * emul - bmax), the argument fused in fp32, within 1.2e-7 relative, or
   0 where the argument is below e^-87.34 (the last normal result; either side of it within the
   argument's rounding). */
int tu_exp_ok(float got, float s, float emul, float bmax);

/* The run's master seed: $FA_TEST_SEED if set, else time ^ pid. Printed once at start. */
uint64_t tu_master_seed(const char *test_name);

/* ---- attention cases --------------------------------------------------------------------- */
/* The fields the forward and backward tests' cases share (fcase, bcase): the problem and every
 * attention option. */
#define TU_ATTN_FIELDS                                                                           \
    fa_dtype dt;                                                                                 \
    int varlen;                                                                                  \
    int64_t b, sq, sk, h, hk, d, dv; /* varlen: sq/sk are the largest generated lengths */       \
    int causal, wl, wr;                                                                          \
    double softcap;                                                                              \
    int alibi; /* 0 none, 1 [h], 2 [b, h] */                                                     \
    int sinks;                                                                                   \
    double dropout_p;                                                                            \
    double scale; /* NaN: default */                                                             \
    int layout;   /* -1: random per tensor, else a tu_layout for every tensor */                 \
    int packed;   /* 0 separate, 1 qkv (and dqkv) in one buffer, 2 kv (and dkv) */               \
    double amp;   /* q and k uniform in [-amp, amp] */                                           \
    int vl_zero;  /* 1: some sequences empty; 2: also every other one */                         \
    int vl_offset, vl_seqused;

/* The draws random forward and backward cases share, in one order (a seed gives both tests the
 * same problems), on a case c (a pointer to a struct with TU_ATTN_FIELDS, its base case set)
 * with the tu_rng pointer r: the shape, the mask, dropout or softcap, ALiBi, sinks, scale. */
#define TU_RANDOM_ATTN(c, r)                                                                     \
    do {                                                                                         \
        static const int64_t tu_ratios_[] = {1, 1, 2, 3, 8};                                     \
        (c)->varlen = tu_rng_chance(r, 0.35);                                                    \
        (c)->b = tu_rng_int(r, 1, (c)->varlen ? 6 : 3);                                          \
        (c)->hk = tu_rng_int(r, 1, 3);                                                           \
        (c)->h = (c)->hk * tu_ratios_[tu_rng_int(r, 0, 4)];                                      \
        (c)->d = tu_rand_head_dim(r);                                                            \
        (c)->dv = tu_rng_chance(r, 0.7) ? (c)->d : tu_rand_head_dim(r);                          \
        (c)->sq = tu_rand_len(r);                                                                \
        (c)->sk = tu_rand_len(r);                                                                \
        (c)->causal = tu_rng_chance(r, 0.3);                                                     \
        if (tu_rng_chance(r, 0.35)) {                                                            \
            (c)->wl = tu_rand_window_side(r, (c)->sk);                                           \
            (c)->wr = tu_rand_window_side(r, (c)->sk);                                           \
        }                                                                                        \
        (c)->dropout_p = tu_rng_chance(r, 0.25) ? tu_rng_uniform(r, 0.05, 0.9) : 0.0;            \
        if ((c)->dropout_p == 0.0 && tu_rng_chance(r, 0.25))                                     \
            (c)->softcap = tu_rng_uniform(r, 0.5, 20.0);                                         \
        (c)->alibi = tu_rng_chance(r, 0.25) ? (int)tu_rng_int(r, 1, 2) : 0;                      \
        (c)->sinks = tu_rng_chance(r, 0.25);                                                     \
        if (tu_rng_chance(r, 0.3))                                                               \
            (c)->scale = tu_rng_uniform(r, 0.3, 3.0) / sqrt((double)(c)->d);                     \
    } while (0)

/* ---- failure reporting ------------------------------------------------------------------- */
extern int tu_failures;
extern uint64_t tu_seed;     /* master seed, printed with every failure */
extern const char *tu_where; /* current case description, printed with every failure */

void tu_fail(const char *file, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

#define TU_CHECK(cond, ...)                                                                        \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            tu_fail(__FILE__, __LINE__, __VA_ARGS__);                                              \
        }                                                                                          \
    } while (0)

/* 0 if no failure, 1 otherwise; prints a summary line. */
int tu_finish(const char *test_name);

/* ---- test tensors ------------------------------------------------------------------------ */
enum tu_layout {
    TU_CONTIGUOUS = 0,
    TU_PADDED = 1,   /* row-major with random gaps between rows at every level */
    TU_PERMUTED = 2, /* the leading dims stored in a random order, with gaps */
    TU_NUM_LAYOUTS = 3,
};

#define TU_GUARD 7 /* elements of poison before and after every view's span (odd: misaligns) */

typedef struct tu_tensor {
    fa_tensor t;      /* the view passed to the library */
    void *base;       /* allocation (owned unless shared) */
    size_t nbytes;    /* bytes of the allocation */
    size_t elem_size; /* element size of the buffer */
    int owner;
} tu_tensor;

/* A view of a fresh buffer with the given layout; shape entries may be 0. */
tu_tensor tu_tensor_new(fa_dtype dtype, int ndim, const int64_t *shape, int layout, tu_rng *r);

/* nparts views of one packed buffer: shape [..., nparts, heads, dim] where the parts dim sits
   just before the head dim (e.g. qkv [b, s, 3, h, d] or [total, 3, h, d]); views[p] is part p. */
void tu_tensor_packed(fa_dtype dtype, int ndim, const int64_t *shape, int nparts, int layout,
                      tu_rng *r, tu_tensor *views);

void tu_tensor_free(tu_tensor *t);

/* Fill every element of the view with uniform(lo, hi), rounded to the dtype; never exactly 0. */
void tu_fill_uniform(tu_tensor *t, tu_rng *r, double lo, double hi);

/* Fill the whole allocation with the poison pattern (a NaN with a payload for float dtypes). */
void tu_poison(tu_tensor *t);

/* Number of elements of the allocation outside the view that no longer hold the poison. */
int64_t tu_count_clobbered(const tu_tensor *t);

/* Number of elements of the view (all of them) that still hold the poison. */
int64_t tu_count_poisoned_in_view(const tu_tensor *t);

/* Element count of the view. */
int64_t tu_numel(const fa_tensor *t);

/* Next multi-index of the view in row-major order; returns 0 after the last one. */
int tu_next_index(const fa_tensor *t, int64_t *idx);

/* Does msg contain name as a whole identifier (neighbours not [A-Za-z0-9_])? */
int tu_names(const char *msg, const char *name);

/* Wall clock seconds. */
double tu_now(void);

#endif /* FA_TEST_UTIL_H */
