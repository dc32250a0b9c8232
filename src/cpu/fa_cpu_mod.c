/* The CPU evaluator of user-defined scoring (fa_cpu_mod.h), in fp32 and fp64. */
#include <math.h>

#include "cpu/fa_cpu_kernel.h"
#include "cpu/fa_cpu_math.h"
#include "cpu/fa_cpu_mod.h"
#include "mod/fa_mod.h"

/* exp in fp32 without a libm call per value: fa_expf up to 88 (where it stops growing), then the
 * square of exp(x / 2), which reaches inf past fp32's range as expf does. */
static inline float fa_cpu_mod_expf(float x)
{
    const float half = fa_expf(0.5f * x);
    return x > 88.0f ? half * half : fa_expf(x);
}

size_t fa_cpu_mod_scratch_size(const fa_params *p, size_t real_size)
{
    int bufs = 0;
    if (p->mods.score_mod)
        bufs = p->mods.score_mod->n_bufs;
    if (p->mods.mask_mod && p->mods.mask_mod->n_bufs > bufs)
        bufs = p->mods.mask_mod->n_bufs;
    return ((size_t)bufs * FA_CPU_MOD_CHUNK * real_size + 63) & ~(size_t)63;
}

#define FA_REAL float
#define FA_FN(name) name##_f32
#define FA_M(name) name##f
#define FA_MOD_EXPV fa_cpu_mod_expf
#define FA_MOD_TANHV fa_tanhf
#include "cpu/fa_cpu_mod_body.h"
#undef FA_REAL
#undef FA_FN
#undef FA_M
#undef FA_MOD_EXPV
#undef FA_MOD_TANHV

#define FA_REAL double
#define FA_FN(name) name##_f64
#define FA_M(name) name
#define FA_MOD_EXPV exp
#define FA_MOD_TANHV tanh
#include "cpu/fa_cpu_mod_body.h"
#undef FA_REAL
#undef FA_FN
#undef FA_M
#undef FA_MOD_EXPV
#undef FA_MOD_TANHV
