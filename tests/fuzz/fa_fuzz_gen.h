/*
 * What the fuzzer's generator (fa_fuzz_case.c) gives its cases (fa_fuzz_calls.c): random
 * choices, adversarial tensors over exact buffers, scalars at and past their limits, and the
 * contract checks.
 */
#ifndef FA_FUZZ_GEN_H
#define FA_FUZZ_GEN_H

#include <stdint.h>

#include "fa_fuzz_case.h"
#include "flashattn.h"

#define FZ_MAX_TENSORS 32
#define FZ_CAP ((int64_t)1 << 18) /* the most elements a claim gets a real buffer for */
#define FZ_TINY 64                /* bytes under a claim past the limits */

/* ---- random choices ---- */
uint64_t fz_below(fz_src *s, uint64_t n); /* [0, n) */
int fz_chance(fz_src *s, int percent);
int64_t fz_range(fz_src *s, int64_t lo, int64_t hi); /* [lo, hi] */
double fz_uniform(fz_src *s, double lo, double hi);
#define FZ_PICK(s, table) ((table)[fz_below((s), sizeof(table) / sizeof((table)[0]))])

/* ---- one case ---- */
typedef struct fz_case {
    fz_src *src;
    const char *entry;
    fa_tensor tensors[FZ_MAX_TENSORS];
    void *allocs[FZ_MAX_TENSORS];
    int backed[FZ_MAX_TENSORS]; /* a real buffer covers every element the view claims */
    int n_tensors;
    int must_fail; /* an argument the library must refuse */
    int nonfinite; /* an input holds NaN or Inf: outputs may too */
    int calls, accepted;
    int chaos; /* 0: every draw valid but the scalars' and indices' edges; 1: anything */
    fa_mod *mods[2]; /* a forward's score_mod and mask_mod, destroyed with the case */
    fa_block_mask block_mask; /* a forward's block mask (its tensors among tensors[]) */
    char log[2048]; /* what was drawn, printed when the contract breaks */
    size_t log_len;
} fz_case;

void fz_note(fz_case *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prints the case and aborts: a broken contract. */
void fz_fail(const fz_case *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)))
    __attribute__((noreturn));

/* ---- tensors ---- */
enum { FZ_IN, FZ_OUT, FZ_IDX }; /* filled with values in [-2, 2] / NaN / 0 */
int64_t fz_numel(const fa_tensor *t); /* INT64_MAX past int64 */
int fz_next(const fa_tensor *t, int64_t *idx);
void fz_store(const fa_tensor *t, const int64_t *idx, double value);
/*
 * A tensor of the given shape, perhaps mutated, with adversarial strides; a real buffer exactly
 * as large as its reach where that is small (gaps NaN; inputs random in [-2, 2], outputs NaN,
 * indices 0), a small buffer or NULL under a claim past the library's limits (which must then
 * refuse the call), NULL under any other large claim (refused too: NULL data).
 */
fa_tensor *fz_tensor(fz_case *c, const char *name, fa_dtype dt, int nd, const int64_t *shape,
                     int role);
int fz_backed(const fz_case *c, const fa_tensor *t);
void fz_set_i32(const fz_case *c, const fa_tensor *t, int64_t row, int64_t col, int64_t value);
void fz_check_finite(const fz_case *c, const fa_tensor *t, const char *name, int allow_inf);
/* The status contract of one call; returns whether its outputs should be checked. */
int fz_check_status(fz_case *c, fa_status st);

/* ---- scalars and problems ---- */
double fz_scale(fz_case *c);
double fz_softcap(fz_case *c);
int fz_window(fz_case *c, const char *name);
int fz_threads(fz_case *c);
int fz_device(fz_case *c);
fa_dtype fz_float_dtype(fz_src *s);
int64_t fz_len(fz_src *s);
int64_t fz_head_dim(const fz_case *c);
typedef struct fz_dims {
    fa_dtype dt;
    int64_t b, sq, sk, h, hk, d, dv;
} fz_dims;
fz_dims fz_problem(fz_case *c);
fa_dtype fz_lse_dtype(fz_src *s, fa_dtype dt);
/* Now and then makes out share in's buffer: the library must refuse it. */
void fz_maybe_alias(fz_case *c, fa_tensor *out, const fa_tensor *in, const char *in_name);

/* ---- user-defined scoring (fa_fuzz_mods.c) ---- */
/* Now and then a score_mod and a mask_mod, with aux tensors, on a forward call. */
void fz_mods(fz_case *c, fa_fwd_args *a);
/* The cases of fa_mod_parse and fa_block_mask_build. */
void fz_mod_parse(fz_case *c);
void fz_block_mask_build(fz_case *c);

#endif /* FA_FUZZ_GEN_H */
