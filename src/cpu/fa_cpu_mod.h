/*
 * User-defined scoring on the CPU: score_mod and mask_mod (mod/fa_mod.h) evaluated over a tile
 * of scores numexpr-style, FA_CPU_MOD_CHUNK values at a time: each step of the program is one
 * loop over the chunk into a buffer of a per-thread scratch, so no compiler is needed at run time.
 */
#ifndef FA_CPU_MOD_H
#define FA_CPU_MOD_H

#include <stddef.h>
#include <stdint.h>

#include "core/fa_params.h"

#define FA_CPU_MOD_CHUNK 64 /* values per evaluation step */

/* Where a tile sits: column i of its scores is query q0 + i, row j is key j0 + j. */
typedef struct fa_cpu_mod_at {
    int64_t b, h, q0, j0;
} fa_cpu_mod_at;

/* Bytes of scratch one thread needs to evaluate p's mods in real_size precision (0: none). */
size_t fa_cpu_mod_scratch_size(const fa_params *p, size_t real_size);

/* Replaces the scores st[j * ld + i] (keys j < n, queries c0 <= i < c1) with score_mod's
 * values, then -inf where mask_mod is false. buf: fa_cpu_mod_scratch_size bytes. */
void fa_cpu_mod_apply_f32(const fa_params *p, float *buf, float *st, int64_t ld, int64_t n,
                          int64_t c0, int64_t c1, const fa_cpu_mod_at *at);
void fa_cpu_mod_apply_f64(const fa_params *p, double *buf, double *st, int64_t ld, int64_t n,
                          int64_t c0, int64_t c1, const fa_cpu_mod_at *at);

#endif /* FA_CPU_MOD_H */
