/* The CUDA C emitter of finished fa_mod programs (fa_mod_cuda.c). */
#ifndef FA_MOD_CUDA_H
#define FA_MOD_CUDA_H

#include "core/fa_error.h"
#include "mod/fa_mod_program.h"

/* Writes m's CUDA C into m->cuda (fa_mod_cuda.c): `FA_DEV float fa_score_mod(kp, score, b, h,
 * q_idx, kv_idx)` or `FA_DEV bool fa_mask_mod(...)`, headed by the canonical text. Called by
 * fa_mod_finish, so a call on the GPU only reads it. */
fa_status fa_mod_emit_cuda(fa_mod *m);

#endif /* FA_MOD_CUDA_H */
