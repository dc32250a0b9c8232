/*
 * User-defined scoring on the CPU: score_mod and mask_mod (mod/fa_mod.h) evaluated over a tile
 * of scores numexpr-style, FA_CPU_MOD_CHUNK values at a time: each step of the program is one
 * loop over the chunk into a buffer of a per-thread scratch, so no compiler is needed at run time.
 * Each step runs as often as what it reads varies (fa_cpu_mod_eval.h); the forward takes the
 * mask before the products to bound each row's keys (fa_cpu_mod_bounds), the backward takes
 * score_mod's derivative beside its values.
 */
#ifndef FA_CPU_MOD_H
#define FA_CPU_MOD_H

#include <stddef.h>
#include <stdint.h>

#include "core/fa_params.h"

#define FA_CPU_MOD_CHUNK 64 /* values per evaluation step */
#define FA_CPU_MOD_ROWS 8   /* keys per pass of the forward's evaluator (fa_cpu_mod_eval.h) */

/* Where a tile sits: column i of its scores is query q0 + i, row j is key j0 + j. With a block
 * mask, states[(qb - qb0) * nk + kb] is the state (FA_BLOCK_*) of key block kb for the tile's
 * query blocks qb0 .. qb0 + nqb - 1 (fa_cpu_mod_blocks_load), else NULL. */
typedef struct fa_cpu_mod_at {
    int64_t b, h, q0, j0;
    unsigned char *states;
    int64_t qb0, nqb;
    int exact; /* the tile's key bounds are exactly what the mask keeps: apply only score_mod */
} fa_cpu_mod_at;

/* Bytes of scratch one thread needs to evaluate p's mods in real_size precision on tiles of up
 * to bm rows (0: none): the evaluator's buffers, then the block states. */
size_t fa_cpu_mod_scratch_size(const fa_params *p, size_t real_size, int64_t bm);

/* The block states of rows [r0, r0 + m) of sequence at->b, head at->h into at, at->states
 * pointing into scratch (the thread's fa_cpu_mod_scratch_size bytes for real_size); NULL
 * without a block mask. */
void fa_cpu_mod_blocks_load(const fa_params *p, fa_cpu_mod_at *at, void *scratch,
                            size_t real_size, int64_t r0, int64_t m);

/* Whether keys [j0, j0 + n) need nothing evaluated for any row of the tile: no score_mod, and
 * the block mask's blocks there all full (the tile then takes them as without mods). */
int fa_cpu_mod_blocks_full(const fa_params *p, const fa_cpu_mod_at *at, int64_t j0, int64_t n);

/* Whether every key of [j0, j0 + n) is skipped by the block mask for every row of the tile. */
int fa_cpu_mod_blocks_skip(const fa_params *p, const fa_cpu_mod_at *at, int64_t j0, int64_t n);

/* Replaces the scores st[j * ld + i] (keys j < n, queries c0 <= i < c1) with score_mod's
 * values, then -inf where the key is masked: by the block mask's state where there is one
 * (skipped: masked; full: kept; partial: mask_mod decides), by mask_mod elsewhere.
 * buf: fa_cpu_mod_scratch_size bytes. */
void fa_cpu_mod_apply_f32(const fa_params *p, float *buf, float *st, int64_t ld, int64_t n,
                          int64_t c0, int64_t c1, const fa_cpu_mod_at *at);
void fa_cpu_mod_apply_f64(const fa_params *p, double *buf, double *st, int64_t ld, int64_t n,
                          int64_t c0, int64_t c1, const fa_cpu_mod_at *at);

/* The keys of [j0, j0 + n) (at->j0 = j0) each query i of [c0, c1) keeps by the mask (mask_mod
 * and block mask, not score_mod) inside the call's own bounds [olo[i], ohi[i]) (causal, window):
 * lo[i] the first, hi[i] one past the last, cnt[i] how many; lo[i] = inf and hi[i] = -inf where
 * it keeps none. Counting past the call's bounds would let the keys cut off there stand in for
 * a gap of masked keys, and hi - lo == cnt wrongly mark the row exact. Returns 0 without touching
 * them where the block mask keeps the whole block or the call has no mask. */
int fa_cpu_mod_bounds_f32(const fa_params *p, float *buf, int64_t n, int64_t c0, int64_t c1,
                          const fa_cpu_mod_at *at, const float *olo, const float *ohi, float *lo,
                          float *hi, float *cnt);
int fa_cpu_mod_bounds_f64(const fa_params *p, double *buf, int64_t n, int64_t c0, int64_t c1,
                          const fa_cpu_mod_at *at, const double *olo, const double *ohi,
                          double *lo, double *hi, double *cnt);

/* A thread's cache of the forward's bounds (fa_cpu_mod_bounds, narrowed) for every key block of
 * its last query tile, which the tiles of the same rows in other heads reuse: bytes for tiles
 * of bm rows, 0 where the mask depends on the head (mask_mod reads h, or the block mask has
 * heads of its own), there is no mask, or it would take more than FA_CPU_MOD_CACHE_MAX.
 * fa_cpu_mod_cache_reset marks it empty. */
#define FA_CPU_MOD_CACHE_MAX ((size_t)8 << 20)
size_t fa_cpu_mod_cache_size(const fa_params *p, size_t real_size, int64_t bm);
void fa_cpu_mod_cache_reset(void *cache);

/* The cache's record: the tile it holds (seq, r0, m, first key) and each key block's state
 * (0: not yet, 1: not narrowed, 2: narrowed, 3: narrowed and exact), then per block the
 * narrowed lo and hi ([bm] each, FA_REAL). */
typedef struct fa_cpu_mod_cache {
    int64_t seq, r0, m, k_lo;
    int64_t valid;
} fa_cpu_mod_cache;
#define FA_CPU_MOD_CACHE_HEAD 64 /* bytes before the states */

/* fa_cpu_mod_apply for the backward: also multiplies dst[j * ld + i] by score_mod's derivative
 * with respect to the score (dbuf: from fa_cpu_mod_grad_parts). */
void fa_cpu_mod_apply_grad_f32(const fa_params *p, float *buf, float *dbuf, float *st, float *dst,
                               int64_t ld, int64_t n, int64_t c0, int64_t c1,
                               const fa_cpu_mod_at *at);
void fa_cpu_mod_apply_grad_f64(const fa_params *p, double *buf, double *dbuf, double *st,
                               double *dst, int64_t ld, int64_t n, int64_t c0, int64_t c1,
                               const fa_cpu_mod_at *at);

/* The backward's scratch for p's mods on tiles of up to bm rows and bn keys, in real_size
 * precision: fa_cpu_mod_scratch_size's, then the derivative buffers, a [bn][bm] factor and,
 * where a captured tensor's gradient is asked, a [bn][bm] copy of score_mod's input scores;
 * fa_cpu_mod_grad_parts gives where those start (score_in NULL without the copy). */
size_t fa_cpu_mod_grad_scratch_size(const fa_params *p, size_t real_size, int64_t bm, int64_t bn);
void fa_cpu_mod_grad_parts(const fa_params *p, void *scratch, size_t real_size, int64_t bm,
                           int64_t bn, void **dbuf, void **factor, void **score_in);

/* The gradients of score_mod's captured fp32 tensors (fa_params.mod_aux_grad;
 * fa_cpu_mod_auxgrad.c): the plan of a call (the steps that read a slot with a gradient, each
 * slot's place in a row-major buffer of `total` doubles), refused past FA_CPU_AUX_GRAD_READS
 * such reads; then, over a run of up to FA_CPU_AUX_CHUNK elements of one (b, h), the root's
 * derivative with respect to each read, times ds (the gradient of the element's final score),
 * added into acc at the element read. score: the score score_mod was given (after softcap and
 * ALiBi). A thread's run and the evaluation's buffers lie in its
 * fa_cpu_aux_grad_scratch_size bytes of scratch (fa_cpu_aux_run_at). */
#define FA_CPU_AUX_GRAD_READS 8
#define FA_CPU_AUX_CHUNK 64
typedef struct fa_cpu_aux_grads_plan {
    int reads;                        /* 0: no gradient asked */
    int step[FA_CPU_AUX_GRAD_READS];  /* steps of score_mod */
    int64_t offset[FA_MOD_AUX_SLOTS]; /* of each slot's elements in the buffer */
    int64_t total;                    /* doubles of the buffer */
    int n_steps;                      /* score_mod's */
    /* live[c][i]: whether step i's derivative with respect to read c can be other than 0 */
    unsigned char live[FA_CPU_AUX_GRAD_READS][FA_MOD_MAX_NODES];
} fa_cpu_aux_grads_plan;
fa_status fa_cpu_aux_grads(const fa_params *p, fa_cpu_aux_grads_plan *g);
size_t fa_cpu_aux_grad_scratch_size(const fa_cpu_aux_grads_plan *g);

/* A run of visible elements waiting for fa_cpu_mod_aux_grad_add: n of them, each a query and
 * key index, the score score_mod was given and ds. */
typedef struct fa_cpu_aux_run {
    int64_t *q, *kv;
    double *score, *ds;
    int n;
} fa_cpu_aux_run;
fa_cpu_aux_run fa_cpu_aux_run_at(const fa_cpu_aux_grads_plan *g, void *scratch);
/* Adds the run's gradients (of sequence b, head h) and empties it. */
void fa_cpu_mod_aux_grad_add(const fa_params *p, const fa_cpu_aux_grads_plan *g, void *scratch,
                             fa_cpu_aux_run *run, double *acc, int64_t b, int64_t h);

#endif /* FA_CPU_MOD_H */
