/* The CPU evaluator of user-defined scoring (fa_cpu_mod.h), in fp32 and fp64. */
#include <math.h>

#include "cpu/fa_cpu_mod.h"
#include "mod/fa_mod.h"

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
#include "cpu/fa_cpu_mod_body.h"
#undef FA_REAL
#undef FA_FN
#undef FA_M

#define FA_REAL double
#define FA_FN(name) name##_f64
#define FA_M(name) name
#include "cpu/fa_cpu_mod_body.h"
#undef FA_REAL
#undef FA_FN
#undef FA_M
