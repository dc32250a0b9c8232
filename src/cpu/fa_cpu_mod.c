/* The CPU evaluator of user-defined scoring (fa_cpu_mod.h), in fp32 and fp64. */
#include <math.h>

#include "cpu/fa_cpu_kernel.h"
#include "cpu/fa_cpu_math.h"
#include "cpu/fa_cpu_mod.h"
#include "mod/fa_mod.h"
#include "mod/fa_mod_grad.h"

/* exp in fp32 without a libm call per value: fa_expf up to 88 (where it stops growing), then the
 * square of exp(x / 2), which reaches inf past fp32's range as expf does. */
static inline float fa_cpu_mod_expf(float x)
{
    const float half = fa_expf(0.5f * x);
    return x > 88.0f ? half * half : fa_expf(x);
}

/* Query blocks rows [r0, r0 + bm) can touch: bm / q_block + 2 at most (one partial at
 * each end). */
static int64_t fa_cpu_mod_span(const fa_mod_blocks *blocks, int64_t bm)
{
    return bm / blocks->q_block + 2;
}

/* The values the hoisting evaluator keeps for m (fa_cpu_mod_eval.h's slots): one per phase-0
 * step, a chunk per phase-1 and phase-2 step, FA_CPU_MOD_ROWS chunks per phase-3 buffer. */
static size_t fa_cpu_mod_eval_reals(const fa_mod *m)
{
    const size_t ch = FA_CPU_MOD_CHUNK;
    if (!m)
        return 0;
    return ((size_t)m->n_slots[0] + ch - 1) / ch * ch +
           (size_t)(m->n_slots[1] + m->n_slots[2]) * ch +
           (size_t)m->n_slots[3] * FA_CPU_MOD_ROWS * ch;
}

/* The evaluator's buffers: both programs' slots side by side (fa_cpu_mod_eval.h). The
 * backward's derivatives take as many again (fa_cpu_mod_grad_parts). */
static size_t fa_cpu_mod_bufs_size(const fa_params *p, size_t real_size)
{
    const size_t reals =
        fa_cpu_mod_eval_reals(p->mods.score_mod) + fa_cpu_mod_eval_reals(p->mods.mask_mod);
    return (reals * real_size + 63) & ~(size_t)63;
}

size_t fa_cpu_mod_scratch_size(const fa_params *p, size_t real_size, int64_t bm)
{
    size_t n = fa_cpu_mod_bufs_size(p, real_size);
    const fa_mod_blocks *blocks = &p->mods.blocks;
    if (blocks->num.data)
        n += ((size_t)(fa_cpu_mod_span(blocks, bm) * blocks->nk) + 63) & ~(size_t)63;
    return n;
}

/* Whether the backward is asked for a captured tensor's gradient (fa_params.mod_aux_grad). */
static int fa_cpu_mod_wants_aux_grads(const fa_params *p)
{
    for (int s = 0; s < FA_MOD_AUX_SLOTS; s++)
        if (p->mod_aux_grad[s].data)
            return 1;
    return 0;
}

size_t fa_cpu_mod_grad_scratch_size(const fa_params *p, size_t real_size, int64_t bm, int64_t bn)
{
    const size_t tile = ((size_t)(bm * bn) * real_size + 63) & ~(size_t)63;
    return fa_cpu_mod_scratch_size(p, real_size, bm) + fa_cpu_mod_bufs_size(p, real_size) +
           tile * (fa_cpu_mod_wants_aux_grads(p) ? 2 : 1);
}

size_t fa_cpu_mod_cache_size(const fa_params *p, size_t real_size, int64_t bm)
{
    const fa_mod_blocks *blocks = &p->mods.blocks;
    const fa_mod *mm = p->mods.mask_mod;
    if (!mm && !blocks->num.data)
        return 0;
    if ((mm && mm->reads_h) ||
        (blocks->num.data && (blocks->num.stride[1] || blocks->idx.stride[1] ||
                              (blocks->full_num.data &&
                               (blocks->full_num.stride[1] || blocks->full_idx.stride[1])))))
        return 0;
    const size_t nkb = (size_t)((p->max_sk + FA_CPU_BN - 1) / FA_CPU_BN);
    const size_t n = FA_CPU_MOD_CACHE_HEAD + ((nkb + 63) & ~(size_t)63) +
                     nkb * 2 * (size_t)bm * real_size;
    return n <= FA_CPU_MOD_CACHE_MAX ? n : 0;
}

void fa_cpu_mod_cache_reset(void *cache)
{
    ((fa_cpu_mod_cache *)cache)->valid = 0;
}

void fa_cpu_mod_grad_parts(const fa_params *p, void *scratch, size_t real_size, int64_t bm,
                           int64_t bn, void **dbuf, void **factor, void **score_in)
{
    *dbuf = (char *)scratch + fa_cpu_mod_scratch_size(p, real_size, bm);
    *factor = (char *)*dbuf + fa_cpu_mod_bufs_size(p, real_size);
    *score_in = fa_cpu_mod_wants_aux_grads(p)
                    ? (char *)*factor + (((size_t)(bm * bn) * real_size + 63) & ~(size_t)63)
                    : NULL;
}

void fa_cpu_mod_blocks_load(const fa_params *p, fa_cpu_mod_at *at, void *scratch,
                            size_t real_size, int64_t r0, int64_t m)
{
    const fa_mod_blocks *blocks = &p->mods.blocks;
    at->states = NULL;
    if (!blocks->num.data || m < 1)
        return;
    at->states = (unsigned char *)scratch + fa_cpu_mod_bufs_size(p, real_size);
    at->qb0 = r0 / blocks->q_block;
    at->nqb = (r0 + m - 1) / blocks->q_block - at->qb0 + 1;
    fa_mod_blocks_fill(blocks, at->b, at->h, at->qb0, at->nqb, at->states);
}

/* Whether every block keys [j0, j0 + n) touch has state for every query block of the tile. */
static int fa_cpu_mod_blocks_all(const fa_params *p, const fa_cpu_mod_at *at, int64_t j0,
                                 int64_t n, unsigned char state)
{
    if (!at->states || n < 1)
        return 0;
    const fa_mod_blocks *blocks = &p->mods.blocks;
    const int64_t kb0 = j0 / blocks->kv_block, kb1 = (j0 + n - 1) / blocks->kv_block;
    for (int64_t q = 0; q < at->nqb; q++)
        for (int64_t kb = kb0; kb <= kb1; kb++)
            if (at->states[q * blocks->nk + kb] != state)
                return 0;
    return 1;
}

int fa_cpu_mod_blocks_full(const fa_params *p, const fa_cpu_mod_at *at, int64_t j0, int64_t n)
{
    return !p->mods.score_mod && fa_cpu_mod_blocks_all(p, at, j0, n, FA_BLOCK_FULL);
}

int fa_cpu_mod_blocks_skip(const fa_params *p, const fa_cpu_mod_at *at, int64_t j0, int64_t n)
{
    return fa_cpu_mod_blocks_all(p, at, j0, n, FA_BLOCK_SKIP);
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
