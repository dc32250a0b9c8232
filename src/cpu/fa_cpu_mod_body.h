/*
 * The evaluator of fa_cpu_mod.h for one precision; fa_cpu_mod.c includes it with FA_REAL float
 * and double. Needs FA_REAL, FA_FN(name) (adds the precision suffix), FA_M(name) (the libm
 * function of that precision) and FA_MOD_EXPV / FA_MOD_TANHV (elementwise exp and tanh that
 * vectorise). Booleans are 0 / 1; a NaN compares false.
 */

/* o[k] = expr for the chunk, over the operands' values x = x_[k], y = y_[k], z = z_[k]. */
#define FA_MOD_FILL(expr)                                                                        \
    for (int64_t k = 0; k < w; k++)                                                              \
        o[k] = (expr);                                                                           \
    break
#define FA_MOD_MAP1(expr)                                                                        \
    for (int64_t k = 0; k < w; k++) {                                                            \
        const FA_REAL x = x_[k];                                                                 \
        o[k] = (expr);                                                                           \
    }                                                                                            \
    break
#define FA_MOD_MAP2(expr)                                                                        \
    for (int64_t k = 0; k < w; k++) {                                                            \
        const FA_REAL x = x_[k], y = y_[k];                                                      \
        o[k] = (expr);                                                                           \
    }                                                                                            \
    break

/* Index value v floored and clamped into a dimension whose last index is `last`
 * (fa_mod_last's): below 1 (NaN included: its comparison is false) 0, past it `last`; each
 * ternary is one max or min instruction, so the loops vectorise. */
#define FA_MOD_INDEX(v, last) ((int64_t)FA_FN(fa_mod_clamp)((v), (last)))

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

/* Aux slot t at the floored, clamped indices idx[d][k]. One and two dims (the common tables)
 * have loops of their own, with the dtype test outside them. */
FA_CPU_INLINE void FA_FN(fa_mod_gather)(FA_REAL *o, const fa_tensor *t, const FA_REAL *const *idx,
                                 int ndim, int64_t w)
{
    const int i32 = t->dtype == FA_DTYPE_I32;
    const int32_t *di = (const int32_t *)t->data;
    const float *df = (const float *)t->data;
    const FA_REAL d0 = FA_FN(fa_mod_last)(t->shape[0]);
    const int64_t s0 = t->stride[0];
    const FA_REAL *x0 = idx[0];
    if (ndim == 1) {
        if (i32)
            for (int64_t k = 0; k < w; k++)
                o[k] = (FA_REAL)di[FA_MOD_INDEX(x0[k], d0) * s0];
        else
            for (int64_t k = 0; k < w; k++)
                o[k] = (FA_REAL)df[FA_MOD_INDEX(x0[k], d0) * s0];
        return;
    }
    if (ndim == 2) {
        const FA_REAL d1 = FA_FN(fa_mod_last)(t->shape[1]);
        const int64_t s1 = t->stride[1];
        const FA_REAL *x1 = idx[1];
        if (i32)
            for (int64_t k = 0; k < w; k++)
                o[k] = (FA_REAL)di[FA_MOD_INDEX(x0[k], d0) * s0 + FA_MOD_INDEX(x1[k], d1) * s1];
        else
            for (int64_t k = 0; k < w; k++)
                o[k] = (FA_REAL)df[FA_MOD_INDEX(x0[k], d0) * s0 + FA_MOD_INDEX(x1[k], d1) * s1];
        return;
    }
    FA_REAL last[FA_MOD_MAX_ARGS];
    for (int d = 0; d < ndim; d++)
        last[d] = FA_FN(fa_mod_last)(t->shape[d]);
    for (int64_t k = 0; k < w; k++) {
        int64_t off = 0;
        for (int d = 0; d < ndim; d++)
            off += FA_MOD_INDEX(idx[d][k], last[d]) * t->stride[d];
        o[k] = i32 ? (FA_REAL)di[off] : (FA_REAL)df[off];
    }
}

/* One step of a program: o = the node's values over the chunk, from its operands' values in
 * arg (o may be one of them: each value is read before its slot is written). */
FA_CPU_INLINE void FA_FN(fa_mod_step)(const fa_mod_node *n, FA_REAL *o, const FA_REAL *const *arg,
                                      const fa_tensor *aux, const FA_REAL *score, int64_t w,
                                      FA_REAL b, FA_REAL h, FA_REAL q0, FA_REAL kv)
{
    {
        const FA_REAL *x_ = arg[0], *y_ = arg[1], *z_ = arg[2];
        switch (n->op) {
        case FA_MOD_OP_VAR:
            switch (n->what) {
            case FA_MOD_SCORE:
                FA_MOD_FILL(score[k]);
            case FA_MOD_B:
                FA_MOD_FILL(b);
            case FA_MOD_H:
                FA_MOD_FILL(h);
            case FA_MOD_Q_IDX:
                FA_MOD_FILL(q0 + (FA_REAL)k);
            default:
                FA_MOD_FILL(kv);
            }
            break;
        case FA_MOD_OP_CONST:
            FA_MOD_FILL((FA_REAL)n->value);
        case FA_MOD_OP_WHERE:
            for (int64_t k = 0; k < w; k++)
                o[k] = x_[k] != 0 ? y_[k] : z_[k];
            break;
        case FA_MOD_OP_AUX:
            FA_FN(fa_mod_gather)(o, &aux[n->what], (const FA_REAL *const *)arg, n->n_args, w);
            break;
        case FA_MOD_NEG:
            FA_MOD_MAP1(-x);
        case FA_MOD_EXP:
            FA_MOD_MAP1(FA_MOD_EXPV(x));
        case FA_MOD_LOG:
            FA_MOD_MAP1(FA_M(log)(x));
        case FA_MOD_TANH:
            FA_MOD_MAP1(FA_MOD_TANHV(x));
        case FA_MOD_ABS:
            FA_MOD_MAP1(FA_M(fabs)(x));
        case FA_MOD_SQRT:
            FA_MOD_MAP1(FA_M(sqrt)(x));
        case FA_MOD_FLOOR:
            FA_MOD_MAP1(FA_M(floor)(x));
        case FA_MOD_NOT:
            FA_MOD_MAP1((FA_REAL)(x == 0));
        case FA_MOD_ADD:
            FA_MOD_MAP2(x + y);
        case FA_MOD_SUB:
            FA_MOD_MAP2(x - y);
        case FA_MOD_MUL:
            FA_MOD_MAP2(x * y);
        case FA_MOD_DIV:
            FA_MOD_MAP2(x / y);
        case FA_MOD_MIN: /* NaN in, NaN out (as torch.minimum) */
            FA_MOD_MAP2((x < y || x != x) ? x : y);
        case FA_MOD_MAX:
            FA_MOD_MAP2((x > y || x != x) ? x : y);
        case FA_MOD_POW:
            FA_MOD_MAP2(FA_M(pow)(x, y));
        case FA_MOD_MOD: { /* floor remainder: fmod is exact, then moved to the divisor's sign */
            for (int64_t k = 0; k < w; k++) {
                const FA_REAL x = x_[k], y = y_[k], r = FA_M(fmod)(x, y);
                o[k] = (r != 0 && ((r < 0) != (y < 0))) ? r + y : r;
            }
            break;
        }
        case FA_MOD_LT:
            FA_MOD_MAP2((FA_REAL)(x < y));
        case FA_MOD_LE:
            FA_MOD_MAP2((FA_REAL)(x <= y));
        case FA_MOD_GT:
            FA_MOD_MAP2((FA_REAL)(x > y));
        case FA_MOD_GE:
            FA_MOD_MAP2((FA_REAL)(x >= y));
        case FA_MOD_EQ:
            FA_MOD_MAP2((FA_REAL)(x == y));
        case FA_MOD_NE:
            FA_MOD_MAP2((FA_REAL)(x != y));
        case FA_MOD_AND:
            FA_MOD_MAP2((FA_REAL)((x != 0) & (y != 0)));
        case FA_MOD_OR:
            FA_MOD_MAP2((FA_REAL)((x != 0) | (y != 0)));
        default:
            break;
        }
    }
}

/* The operands' slots of step s of m in buf (values) or dbuf (derivatives). */
FA_CPU_INLINE void FA_FN(fa_mod_args)(const fa_mod *m, int s, FA_REAL *buf,
                                      const FA_REAL **arg)
{
    const fa_mod_node *n = &m->steps[s];
    for (int a = 0; a < FA_MOD_MAX_ARGS; a++)
        arg[a] = a < n->n_args ? buf + (size_t)m->buf[n->args[a]] * FA_CPU_MOD_CHUNK : NULL;
}

/* Runs m over w values (score the scores, the other variables from at) and returns the buffer
 * holding its root's values. */
FA_CPU_INLINE const FA_REAL *FA_FN(fa_mod_run)(const fa_mod *m, const fa_tensor *aux, FA_REAL *buf,
                                        const FA_REAL *score, int64_t w, FA_REAL b, FA_REAL h,
                                        FA_REAL q0, FA_REAL kv)
{
    for (int s = 0; s < m->n_steps; s++) {
        const FA_REAL *arg[FA_MOD_MAX_ARGS];
        FA_FN(fa_mod_args)(m, s, buf, arg);
        FA_FN(fa_mod_step)(&m->steps[s], buf + (size_t)m->buf[s] * FA_CPU_MOD_CHUNK, arg, aux,
                           score, w, b, h, q0, kv);
    }
    return buf + (size_t)m->buf[m->n_steps - 1] * FA_CPU_MOD_CHUNK;
}

/* The square, for the derivative rules (mod/fa_mod_grad.h). */
FA_CPU_INLINE FA_REAL FA_FN(fa_mod_sq)(FA_REAL x) { return x * x; }

#define FA_MOD_D_EXP(v) FA_MOD_EXPV(v)
#define FA_MOD_D_LOG(v) FA_M(log)(v)
#define FA_MOD_D_TANH(v) FA_MOD_TANHV(v)
#define FA_MOD_D_SQRT(v) FA_M(sqrt)(v)
#define FA_MOD_D_FLOOR(v) FA_M(floor)(v)
#define FA_MOD_D_POW(v, e) FA_M(pow)(v, e)
#define FA_MOD_D_SQ(v) FA_FN(fa_mod_sq)(v)

/* One rule of mod/fa_mod_grad.h as a loop over the chunk; an operand the step lacks reads
 * zeros, and what the rule does not use the compiler drops. */
#define FA_MOD_GRAD_LOOP(op_code, expr)                                                          \
    case op_code:                                                                                \
        for (int64_t k = 0; k < w; k++) {                                                        \
            const FA_REAL x = x_[k], y = y_[k], dx = dx_[k], dy = dy_[k], dz = dz_[k];           \
            (void)x, (void)y, (void)dx, (void)dy, (void)dz;                                      \
            d[k] = (expr);                                                                       \
        }                                                                                        \
        return;

/*
 * The derivative of step n with respect to score, into d, from its operands' values (arg)
 * and derivatives (darg), before the step's values overwrite any of them: the rules of
 * mod/fa_mod_grad.h, which the CUDA C emitter prints too.
 */
FA_CPU_INLINE void FA_FN(fa_mod_dstep)(const fa_mod_node *n, FA_REAL *d,
                                       const FA_REAL *const *arg, const FA_REAL *const *darg,
                                       int64_t w)
{
    static const FA_REAL zeros[FA_CPU_MOD_CHUNK];
    const FA_REAL *x_ = arg[0] ? arg[0] : zeros, *y_ = arg[1] ? arg[1] : zeros;
    const FA_REAL *dx_ = darg[0] ? darg[0] : zeros, *dy_ = darg[1] ? darg[1] : zeros;
    const FA_REAL *dz_ = darg[2] ? darg[2] : zeros;
    switch (n->op) {
    case FA_MOD_OP_VAR:
        for (int64_t k = 0; k < w; k++)
            d[k] = n->what == FA_MOD_SCORE ? 1 : 0;
        return;
        FA_MOD_GRAD_RULES(FA_MOD_GRAD_LOOP)
    default:
        for (int64_t k = 0; k < w; k++)
            d[k] = 0;
        return;
    }
}

#undef FA_MOD_GRAD_LOOP
#undef FA_MOD_D_EXP
#undef FA_MOD_D_LOG
#undef FA_MOD_D_TANH
#undef FA_MOD_D_SQRT
#undef FA_MOD_D_FLOOR
#undef FA_MOD_D_POW
#undef FA_MOD_D_SQ

/* fa_mod_run with the derivative of the root with respect to score: returns the values'
 * buffer, *deriv the derivatives' (in dbuf, laid out as buf). */
FA_CPU_INLINE const FA_REAL *FA_FN(fa_mod_run_grad)(const fa_mod *m, const fa_tensor *aux,
                                                    FA_REAL *buf, FA_REAL *dbuf,
                                                    const FA_REAL *score, int64_t w, FA_REAL b,
                                                    FA_REAL h, FA_REAL q0, FA_REAL kv,
                                                    const FA_REAL **deriv)
{
    for (int s = 0; s < m->n_steps; s++) {
        const FA_REAL *arg[FA_MOD_MAX_ARGS], *darg[FA_MOD_MAX_ARGS];
        FA_FN(fa_mod_args)(m, s, buf, arg);
        FA_FN(fa_mod_args)(m, s, dbuf, darg);
        const size_t at = (size_t)m->buf[s] * FA_CPU_MOD_CHUNK;
        FA_FN(fa_mod_dstep)(&m->steps[s], dbuf + at, arg, darg, w);
        FA_FN(fa_mod_step)(&m->steps[s], buf + at, arg, aux, score, w, b, h, q0, kv);
    }
    *deriv = dbuf + (size_t)m->buf[m->n_steps - 1] * FA_CPU_MOD_CHUNK;
    return buf + (size_t)m->buf[m->n_steps - 1] * FA_CPU_MOD_CHUNK;
}

#include "cpu/fa_cpu_mod_eval.h"

#undef FA_MOD_FILL
#undef FA_MOD_MAP1
#undef FA_MOD_MAP2
#undef FA_MOD_INDEX

/* Cloned for AVX2 and AVX-512 as the kernels are; static, as clones must be to resolve under
 * clang too, behind the exported fa_cpu_mod_apply below. */
FA_CPU_CLONES static void FA_FN(fa_mod_apply)(const fa_params *p, FA_REAL *buf, FA_REAL *st,
                                              int64_t ld, int64_t n, int64_t c0, int64_t c1,
                                              const fa_cpu_mod_at *at, FA_REAL *dbuf,
                                              FA_REAL *dst)
{
    const FA_REAL b = (FA_REAL)at->b, h = (FA_REAL)at->h;
    const fa_mod_blocks *blocks = &p->mods.blocks;
    unsigned char state[FA_CPU_MOD_CHUNK]; /* each query's block state at the current kb */
    for (int64_t i0 = c0; i0 < c1; i0 += FA_CPU_MOD_CHUNK) {
        const int64_t w = c1 - i0 < FA_CPU_MOD_CHUNK ? c1 - i0 : FA_CPU_MOD_CHUNK;
        const FA_REAL q0 = (FA_REAL)(at->q0 + i0);
        /* The chunk's states at key block kb_at (they change only where j crosses a key
         * block): all full, all skipped, or mask_mod consulted where partial. */
        int64_t kb_at = -1;
        int all_full = 0, all_skip = 0, consult = 1;
        for (int64_t j = 0; j < n; j++) {
            const FA_REAL kv = (FA_REAL)(at->j0 + j);
            FA_REAL *row = st + j * ld + i0;
            if (at->states && (at->j0 + j) / blocks->kv_block != kb_at) {
                kb_at = (at->j0 + j) / blocks->kv_block;
                int64_t qb = (at->q0 + i0) / blocks->q_block - at->qb0;
                int64_t next = (qb + at->qb0 + 1) * blocks->q_block - (at->q0 + i0);
                int n_full = 0, n_skip = 0;
                for (int64_t k = 0; k < w; k++) {
                    if (k == next) {
                        qb++;
                        next += blocks->q_block;
                    }
                    state[k] = qb < at->nqb ? at->states[qb * blocks->nk + kb_at] : FA_BLOCK_SKIP;
                    n_full += state[k] == FA_BLOCK_FULL;
                    n_skip += state[k] == FA_BLOCK_SKIP;
                }
                all_full = n_full == w, all_skip = n_skip == w;
                consult = n_full + n_skip < w;
            }
            if (at->states && all_skip) {
                for (int64_t k = 0; k < w; k++)
                    row[k] = -(FA_REAL)INFINITY;
                continue;
            }
            if (p->mods.score_mod && dst) {
                const FA_REAL *dr, *r = FA_FN(fa_mod_run_grad)(p->mods.score_mod, p->mods.aux,
                                                                buf, dbuf, row, w, b, h, q0, kv,
                                                                &dr);
                FA_REAL *drow = dst + j * ld + i0;
                for (int64_t k = 0; k < w; k++) {
                    row[k] = r[k];
                    drow[k] *= dr[k];
                }
            } else if (p->mods.score_mod) {
                const FA_REAL *r =
                    FA_FN(fa_mod_run)(p->mods.score_mod, p->mods.aux, buf, row, w, b, h, q0, kv);
                for (int64_t k = 0; k < w; k++)
                    row[k] = r[k];
            }
            if (at->states && all_full)
                continue;
            /* mask_mod is consulted where the block mask leaves it the choice (partial), and
             * everywhere without one. */
            const FA_REAL *r = p->mods.mask_mod && consult
                                   ? FA_FN(fa_mod_run)(p->mods.mask_mod, p->mods.aux, buf, row,
                                                       w, b, h, q0, kv)
                                   : NULL;
            if (at->states) {
                for (int64_t k = 0; k < w; k++) {
                    const int keep = state[k] == FA_BLOCK_FULL ||
                                     (state[k] == FA_BLOCK_PARTIAL && (!r || r[k] != 0));
                    row[k] = keep ? row[k] : -(FA_REAL)INFINITY;
                }
            } else if (r) {
                for (int64_t k = 0; k < w; k++)
                    row[k] = r[k] != 0 ? row[k] : -(FA_REAL)INFINITY;
            }
        }
    }
}

/*
 * fa_cpu_mod_apply's rule as fa_mod_apply has it, by the hoisting evaluator
 * (fa_cpu_mod_eval.h): per chunk of keys and chunk of queries, passes of FA_CPU_MOD_ROWS keys
 * that stay inside one key block of the block mask, so one state per query holds for a pass.
 */
FA_CPU_CLONES static void FA_FN(fa_mod_apply_fwd)(const fa_params *p, FA_REAL *buf, FA_REAL *st,
                                                  int64_t ld, int64_t n, int64_t c0, int64_t c1,
                                                  const fa_cpu_mod_at *at, FA_REAL *blo,
                                                  FA_REAL *bhi, FA_REAL *bcnt)
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
                    for (int64_t k = 0; k < w; k++) {
                        bcnt[i0 + k] += (FA_REAL)g;
                        blo[i0 + k] = key < blo[i0 + k] ? key : blo[i0 + k];
                        bhi[i0 + k] = key + (FA_REAL)g > bhi[i0 + k] ? key + (FA_REAL)g
                                                                     : bhi[i0 + k];
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
                for (int64_t jj = 0; jj < g && blo; jj++) { /* bounds: the keys kept */
                    const FA_REAL *rr = r.p + jj * r.rs, kj = key + (FA_REAL)jj, kj1 = kj + 1;
                    FA_REAL *restrict lo = blo + i0, *restrict hi = bhi + i0, *restrict cnt = bcnt + i0;
                    const int rk = !have || rr[0] != 0; /* where the root is one per row */
                    const FA_REAL inf = (FA_REAL)INFINITY;
#define FA_MOD_BOUND(keep)                                                                       \
    for (int64_t k = 0; k < w; k++) {                                                            \
        const int kp_ = (keep);                                                                  \
        const FA_REAL a_ = kp_ ? kj : inf, b_ = kp_ ? kj1 : -inf;                                \
        lo[k] = a_ < lo[k] ? a_ : lo[k];                                                         \
        cnt[k] += kp_ ? (FA_REAL)1 : (FA_REAL)0;                                                 \
        hi[k] = b_ > hi[k] ? b_ : hi[k];                                                         \
    }
                    if (at->states && have && r.v)
                        FA_MOD_BOUND((state[k] == FA_BLOCK_FULL) |
                                     ((state[k] == FA_BLOCK_PARTIAL) & (rr[k] != 0)))
                    else if (at->states)
                        FA_MOD_BOUND((state[k] == FA_BLOCK_FULL) |
                                     ((state[k] == FA_BLOCK_PARTIAL) & rk))
                    else if (have && r.v)
                        FA_MOD_BOUND(rr[k] != 0)
                    else if (rk)
                        FA_MOD_BOUND(1)
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
    FA_FN(fa_mod_apply_fwd)(p, buf, st, ld, n, c0, c1, at, NULL, NULL, NULL);
}

int FA_FN(fa_cpu_mod_bounds)(const fa_params *p, FA_REAL *buf, int64_t n, int64_t c0, int64_t c1,
                             const fa_cpu_mod_at *at, FA_REAL *lo, FA_REAL *hi, FA_REAL *cnt)
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
    FA_FN(fa_mod_apply_fwd)(p, buf, NULL, 0, n, c0, c1, at, lo, hi, cnt);
    return 1;
}

void FA_FN(fa_cpu_mod_apply_grad)(const fa_params *p, FA_REAL *buf, FA_REAL *dbuf, FA_REAL *st,
                                  FA_REAL *dst, int64_t ld, int64_t n, int64_t c0, int64_t c1,
                                  const fa_cpu_mod_at *at)
{
    FA_FN(fa_mod_apply)(p, buf, st, ld, n, c0, c1, at, dbuf, dst);
}
