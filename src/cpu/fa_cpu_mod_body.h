/*
 * The evaluator of fa_cpu_mod.h for one precision; fa_cpu_mod.c includes it with FA_REAL float
 * and double. Needs FA_REAL, FA_FN(name) (adds the precision suffix), FA_M(name) (the libm
 * function of that precision) and FA_MOD_EXPV / FA_MOD_TANHV (elementwise exp and tanh that
 * vectorise). Booleans are 0 / 1; a NaN compares false.
 */

/* Index value v floored (by the integer conversion after it) and clamped into a dimension whose
 * last index is hi (fa_mod_last's): below 1 (NaN included: its comparison is false) 0, past it
 * hi; each ternary is one max or min instruction, so the loops vectorise. */
FA_CPU_INLINE FA_REAL FA_FN(fa_mod_clamp)(FA_REAL v, FA_REAL hi)
{
    const FA_REAL m = v > 0 ? v : 0;
    return m < hi ? m : hi;
}

/* The largest FA_REAL whose integer part indexes a dimension of dim entries: dim - 1, or the
 * value below it where FA_REAL rounds dim - 1 up (past 2^24 entries in fp32). */
FA_CPU_INLINE FA_REAL FA_FN(fa_mod_last)(int64_t dim)
{
    FA_REAL x = (FA_REAL)(dim - 1);
    while ((int64_t)x > dim - 1)
        x = sizeof(FA_REAL) == sizeof(float) ? (FA_REAL)nextafterf((float)x, 0.f)
                                             : (FA_REAL)nextafter((double)x, 0.0);
    return x;
}

/* The square, for the derivative rules (mod/fa_mod_grad.h). */
FA_CPU_INLINE FA_REAL FA_FN(fa_mod_sq)(FA_REAL x) { return x * x; }

#include "cpu/fa_cpu_mod_eval.h"

/* What decides a key's keep in fa_mod_bound_row: the block state and mask_mod's value per
 * query, the state and one value for the row, mask_mod's value per query, nothing. */
#ifndef FA_CPU_MOD_KEEP_BY /* once for both instantiations of this body */
#define FA_CPU_MOD_KEEP_BY
enum { FA_MOD_KEEP_STATE_EACH, FA_MOD_KEEP_STATE_ROW, FA_MOD_KEEP_EACH, FA_MOD_KEEP_ALL };
#endif

/* fa_cpu_mod_bounds' update by key kj of the queries' lo, hi and cnt [w] where it is kept
 * inside their own bounds [ol, oh). A function of restrict parameters, so the compiler
 * vectorises it (written in the caller's loop it did not). */
FA_CPU_INLINE void FA_FN(fa_mod_bound_row)(int keep_by, const FA_REAL *restrict rr, int rk,
                                           const unsigned char *restrict state, FA_REAL kj,
                                           int64_t w, const FA_REAL *restrict ol,
                                           const FA_REAL *restrict oh, FA_REAL *restrict lo,
                                           FA_REAL *restrict hi, FA_REAL *restrict cnt)
{
    const FA_REAL inf = (FA_REAL)INFINITY, kj1 = kj + 1;
    for (int64_t k = 0; k < w; k++) {
        const int keep =
            keep_by == FA_MOD_KEEP_STATE_EACH
                ? (state[k] == FA_BLOCK_FULL) | ((state[k] == FA_BLOCK_PARTIAL) & (rr[k] != 0))
            : keep_by == FA_MOD_KEEP_STATE_ROW
                ? (state[k] == FA_BLOCK_FULL) | ((state[k] == FA_BLOCK_PARTIAL) & rk)
            : keep_by == FA_MOD_KEEP_EACH ? rr[k] != 0
                                          : 1;
        const int kp = keep & (kj >= ol[k]) & (kj < oh[k]);
        const FA_REAL a = kp ? kj : inf, b = kp ? kj1 : -inf;
        lo[k] = a < lo[k] ? a : lo[k];
        cnt[k] += kp ? (FA_REAL)1 : (FA_REAL)0;
        hi[k] = b > hi[k] ? b : hi[k];
    }
}

/*
 * fa_cpu_mod_apply, fa_cpu_mod_apply_grad (dst given: dst times score_mod's derivative) and
 * fa_cpu_mod_bounds (blo given: the keys kept inside each query's [olo, ohi), st untouched) by
 * the hoisting evaluator (fa_cpu_mod_eval.h): per chunk of keys and chunk of queries, passes of
 * FA_CPU_MOD_ROWS keys that stay inside one key block of the block mask, so one state per query
 * holds for a pass.
 * Cloned for AVX2 and AVX-512 as the kernels are; static, as clones must be to resolve under
 * clang too, behind the exported functions below.
 */
FA_CPU_CLONES static void FA_FN(fa_mod_apply)(const fa_params *p, FA_REAL *buf, FA_REAL *st,
                                              int64_t ld, int64_t n, int64_t c0, int64_t c1,
                                              const fa_cpu_mod_at *at, FA_REAL *dbuf, FA_REAL *dst,
                                              FA_REAL *blo, FA_REAL *bhi, FA_REAL *bcnt,
                                              const FA_REAL *olo, const FA_REAL *ohi)
{
    const int64_t ch = FA_CPU_MOD_CHUNK;
    const fa_mod *sm = p->mods.score_mod, *mm = p->mods.mask_mod;
    const fa_tensor *aux = p->mods.aux;
    const fa_mod_blocks *blocks = &p->mods.blocks;
    const fa_cpu_mod_at bare = {.b = at->b, .h = at->h, .q0 = at->q0, .j0 = at->j0};
    if (at->exact) /* the tile's bounds are the mask: only score_mod is left */
        mm = NULL, at = &bare;
    FA_FN(fa_mod_ctx) cs = {0}, cm = {0};
    FA_REAL *ws = buf;
    if (sm)
        ws = FA_FN(fa_mod_ctx_init)(&cs, sm, ws);
    if (mm)
        ws = FA_FN(fa_mod_ctx_init)(&cm, mm, ws);
    if (sm && dst)
        cs.dvt = dbuf; /* phase 3 also takes the derivatives */
    cs.b = cm.b = (FA_REAL)at->b;
    cs.h = cm.h = (FA_REAL)at->h;
    cs.ld = cm.ld = ld;
    if (sm && sm->n_slots[0])
        FA_FN(fa_mod_eval)(sm, aux, 0, &cs, NULL, 0);
    if (mm && mm->n_slots[0])
        FA_FN(fa_mod_eval)(mm, aux, 0, &cm, NULL, 0);
    unsigned char state[FA_CPU_MOD_CHUNK]; /* each query's block state at the pass's kb */
    for (int64_t kb0 = 0; kb0 < n; kb0 += ch) {
        const int64_t nn = n - kb0 < ch ? n - kb0 : ch;
        cs.w = cm.w = nn;
        cs.lane0 = cm.lane0 = (FA_REAL)(at->j0 + kb0);
        if (sm && sm->n_slots[FA_MOD_VARY_KV])
            FA_FN(fa_mod_eval)(sm, aux, FA_MOD_VARY_KV, &cs, NULL, 0);
        if (mm && mm->n_slots[FA_MOD_VARY_KV])
            FA_FN(fa_mod_eval)(mm, aux, FA_MOD_VARY_KV, &cm, NULL, 0);
        for (int64_t i0 = c0; i0 < c1; i0 += ch) {
            const int64_t w = c1 - i0 < ch ? c1 - i0 : ch;
            cs.w = cm.w = w;
            cs.lane0 = cm.lane0 = (FA_REAL)(at->q0 + i0);
            if (sm && sm->n_slots[FA_MOD_VARY_Q])
                FA_FN(fa_mod_eval)(sm, aux, FA_MOD_VARY_Q, &cs, NULL, 0);
            if (mm && mm->n_slots[FA_MOD_VARY_Q])
                FA_FN(fa_mod_eval)(mm, aux, FA_MOD_VARY_Q, &cm, NULL, 0);
            int64_t kb_at = -1, g;
            int all_full = 0, all_skip = 0, consult = 1;
            for (int64_t jg = kb0; jg < kb0 + nn; jg += g) {
                g = kb0 + nn - jg < FA_CPU_MOD_ROWS ? kb0 + nn - jg : FA_CPU_MOD_ROWS;
                if (at->states) {
                    const int64_t kb = (at->j0 + jg) / blocks->kv_block;
                    const int64_t left = (kb + 1) * blocks->kv_block - (at->j0 + jg);
                    g = g < left ? g : left;
                    if (kb != kb_at) {
                        kb_at = kb;
                        int64_t qb = (at->q0 + i0) / blocks->q_block - at->qb0;
                        int64_t next = (qb + at->qb0 + 1) * blocks->q_block - (at->q0 + i0);
                        int n_full = 0, n_skip = 0;
                        for (int64_t k = 0; k < w; k++) {
                            if (k == next) {
                                qb++;
                                next += blocks->q_block;
                            }
                            state[k] =
                                qb < at->nqb ? at->states[qb * blocks->nk + kb] : FA_BLOCK_SKIP;
                            n_full += state[k] == FA_BLOCK_FULL;
                            n_skip += state[k] == FA_BLOCK_SKIP;
                        }
                        all_full = n_full == w, all_skip = n_skip == w;
                        consult = n_full + n_skip < w;
                    }
                }
                FA_REAL *rs = st ? st + jg * ld + i0 : NULL; /* the pass's g rows of w scores */
                const FA_REAL key = (FA_REAL)(at->j0 + jg); /* the pass's first key */
                if (at->states && all_skip && blo)
                    continue;
                if (at->states && all_full && blo) {
                    for (int64_t k = 0; k < w; k++) { /* the pass's keys inside the call's */
                        const FA_REAL ol = olo[i0 + k], oh = ohi[i0 + k];
                        const FA_REAL a_ = key > ol ? key : ol;
                        const FA_REAL b_ = key + (FA_REAL)g < oh ? key + (FA_REAL)g : oh;
                        const int in_ = a_ < b_;
                        bcnt[i0 + k] += in_ ? b_ - a_ : (FA_REAL)0;
                        blo[i0 + k] = in_ && a_ < blo[i0 + k] ? a_ : blo[i0 + k];
                        bhi[i0 + k] = in_ && b_ > bhi[i0 + k] ? b_ : bhi[i0 + k];
                    }
                    continue;
                }
                if (at->states && all_skip) {
                    for (int64_t jj = 0; jj < g; jj++)
                        for (int64_t k = 0; k < w; k++)
                            rs[jj * ld + k] = -(FA_REAL)INFINITY;
                    continue;
                }
                cs.rows = cm.rows = g;
                cs.jrel = cm.jrel = jg - kb0;
                cs.score = cm.score = rs;
                if (sm && !blo) {
                    const FA_FN(fa_mod_opnd) r =
                        FA_FN(fa_mod_eval)(sm, aux, FA_MOD_VARY_QKV, &cs, rs, ld);
                    if (r.p != rs || r.rs != ld) /* a root that is not a phase-3 operation */
                        for (int64_t jj = 0; jj < g; jj++)
                            for (int64_t k = 0; k < w; k++)
                                rs[jj * ld + k] = r.p[jj * r.rs + (r.v ? k : 0)];
                    if (dst) {
                        const FA_FN(fa_mod_opnd) d = FA_FN(fa_mod_ddesc)(sm, sm->n_steps - 1, &cs);
                        for (int64_t jj = 0; jj < g; jj++) {
                            FA_REAL *drow = dst + (jg + jj) * ld + i0;
                            const FA_REAL *dr = d.p + jj * d.rs;
                            for (int64_t k = 0; k < w; k++)
                                drow[k] *= dr[d.v ? k : 0];
                        }
                    }
                }
                if (at->states && all_full)
                    continue;
                /* mask_mod is consulted where the block mask leaves it the choice (partial),
                 * and everywhere without one. */
                const int have = mm && consult;
                static const FA_REAL one = 1;
                FA_FN(fa_mod_opnd) r = {&one, 0, 0};
                if (have)
                    r = FA_FN(fa_mod_eval)(mm, aux, FA_MOD_VARY_QKV, &cm, NULL, 0);
                /* bounds: the keys kept inside the call's own (fa_cpu_mod_bounds says why) */
                for (int64_t jj = 0; jj < g && blo; jj++) {
                    const FA_REAL *rr = r.p + jj * r.rs;
                    const int rk = !have || rr[0] != 0; /* where the root is one per row */
                    const FA_REAL kj = key + (FA_REAL)jj;
                    /* each form a call of its own: a constant keep_by vectorises */
#define FA_MOD_BOUND(keep_by)                                                                    \
    FA_FN(fa_mod_bound_row)(keep_by, rr, rk, state, kj, w, olo + i0, ohi + i0, blo + i0,        \
                            bhi + i0, bcnt + i0)
                    if (at->states && have && r.v)
                        FA_MOD_BOUND(FA_MOD_KEEP_STATE_EACH);
                    else if (at->states)
                        FA_MOD_BOUND(FA_MOD_KEEP_STATE_ROW);
                    else if (have && r.v)
                        FA_MOD_BOUND(FA_MOD_KEEP_EACH);
                    else if (rk)
                        FA_MOD_BOUND(FA_MOD_KEEP_ALL);
#undef FA_MOD_BOUND
                }
                for (int64_t jj = 0; jj < g && !blo; jj++) {
                    FA_REAL *row = rs + jj * ld;
                    const FA_REAL *rr = r.p + jj * r.rs;
                    if (at->states && have && r.v) {
                        for (int64_t k = 0; k < w; k++) {
                            const int keep = state[k] == FA_BLOCK_FULL ||
                                             (state[k] == FA_BLOCK_PARTIAL && rr[k] != 0);
                            row[k] = keep ? row[k] : -(FA_REAL)INFINITY;
                        }
                    } else if (at->states) {
                        const int rk = !have || rr[0] != 0;
                        for (int64_t k = 0; k < w; k++) {
                            const int keep = state[k] == FA_BLOCK_FULL ||
                                             (state[k] == FA_BLOCK_PARTIAL && rk);
                            row[k] = keep ? row[k] : -(FA_REAL)INFINITY;
                        }
                    } else if (have && r.v) {
                        for (int64_t k = 0; k < w; k++)
                            row[k] = rr[k] != 0 ? row[k] : -(FA_REAL)INFINITY;
                    } else if (have && rr[0] == 0) {
                        for (int64_t k = 0; k < w; k++)
                            row[k] = -(FA_REAL)INFINITY;
                    }
                }
            }
        }
    }
}

void FA_FN(fa_cpu_mod_apply)(const fa_params *p, FA_REAL *buf, FA_REAL *st, int64_t ld,
                             int64_t n, int64_t c0, int64_t c1, const fa_cpu_mod_at *at)
{
    FA_FN(fa_mod_apply)(p, buf, st, ld, n, c0, c1, at, NULL, NULL, NULL, NULL, NULL, NULL,
                        NULL);
}

int FA_FN(fa_cpu_mod_bounds)(const fa_params *p, FA_REAL *buf, int64_t n, int64_t c0, int64_t c1,
                             const fa_cpu_mod_at *at, const FA_REAL *olo, const FA_REAL *ohi,
                             FA_REAL *lo, FA_REAL *hi, FA_REAL *cnt)
{
    if (!p->mods.mask_mod && !at->states)
        return 0;
    if (at->states && fa_cpu_mod_blocks_all(p, at, at->j0, n, FA_BLOCK_FULL))
        return 0;
    for (int64_t i = c0; i < c1; i++) {
        lo[i] = (FA_REAL)INFINITY;
        hi[i] = -(FA_REAL)INFINITY;
        cnt[i] = 0;
    }
    FA_FN(fa_mod_apply)(p, buf, NULL, 0, n, c0, c1, at, NULL, NULL, lo, hi, cnt, olo, ohi);
    return 1;
}

void FA_FN(fa_cpu_mod_apply_grad)(const fa_params *p, FA_REAL *buf, FA_REAL *dbuf, FA_REAL *st,
                                  FA_REAL *dst, int64_t ld, int64_t n, int64_t c0, int64_t c1,
                                  const fa_cpu_mod_at *at)
{
    FA_FN(fa_mod_apply)(p, buf, st, ld, n, c0, c1, at, dbuf, dst, NULL, NULL, NULL, NULL, NULL);
}
