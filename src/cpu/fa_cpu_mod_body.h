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

/* Aux slot t at the floored, clamped indices idx[d][k]. */
FA_CPU_INLINE void FA_FN(fa_mod_gather)(FA_REAL *o, const fa_tensor *t, const FA_REAL *const *idx,
                                 int ndim, int64_t w)
{
    for (int64_t k = 0; k < w; k++) {
        int64_t off = 0;
        for (int d = 0; d < ndim; d++) {
            const FA_REAL v = idx[d][k];
            const int64_t dim = t->shape[d];
            const int64_t i = v >= 1 ? (v < (FA_REAL)dim ? (int64_t)v : dim - 1) : 0;
            off += i * t->stride[d];
        }
        o[k] = t->dtype == FA_DTYPE_I32 ? (FA_REAL)((const int32_t *)t->data)[off]
                                        : (FA_REAL)((const float *)t->data)[off];
    }
}

/* Runs m over w values (score the scores, the other variables from at) and returns the buffer
 * holding its root's values. */
FA_CPU_INLINE const FA_REAL *FA_FN(fa_mod_run)(const fa_mod *m, const fa_tensor *aux, FA_REAL *buf,
                                        const FA_REAL *score, int64_t w, FA_REAL b, FA_REAL h,
                                        FA_REAL q0, FA_REAL kv)
{
    for (int s = 0; s < m->n_steps; s++) {
        const fa_mod_node *n = &m->steps[s];
        FA_REAL *o = buf + (size_t)m->buf[s] * FA_CPU_MOD_CHUNK;
        const FA_REAL *arg[FA_MOD_MAX_ARGS] = {NULL, NULL, NULL, NULL};
        for (int a = 0; a < n->n_args; a++)
            arg[a] = buf + (size_t)m->buf[n->args[a]] * FA_CPU_MOD_CHUNK;
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
            FA_FN(fa_mod_gather)(o, &aux[n->what], arg, n->n_args, w);
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
    return buf + (size_t)m->buf[m->n_steps - 1] * FA_CPU_MOD_CHUNK;
}

#undef FA_MOD_FILL
#undef FA_MOD_MAP1
#undef FA_MOD_MAP2

/* Cloned for AVX2 and AVX-512 as the kernels are; static, as clones must be to resolve under
 * clang too, behind the exported fa_cpu_mod_apply below. */
FA_CPU_CLONES static void FA_FN(fa_mod_apply)(const fa_params *p, FA_REAL *buf, FA_REAL *st,
                                              int64_t ld, int64_t n, int64_t c0, int64_t c1,
                                              const fa_cpu_mod_at *at)
{
    const FA_REAL b = (FA_REAL)at->b, h = (FA_REAL)at->h;
    const fa_mod_blocks *blocks = &p->mods.blocks;
    unsigned char state[FA_CPU_MOD_CHUNK]; /* each query's block state at key j */
    for (int64_t j = 0; j < n; j++) {
        const FA_REAL kv = (FA_REAL)(at->j0 + j);
        const int64_t kb = at->states ? (at->j0 + j) / blocks->kv_block : 0;
        for (int64_t i0 = c0; i0 < c1; i0 += FA_CPU_MOD_CHUNK) {
            const int64_t w = c1 - i0 < FA_CPU_MOD_CHUNK ? c1 - i0 : FA_CPU_MOD_CHUNK;
            const FA_REAL q0 = (FA_REAL)(at->q0 + i0);
            FA_REAL *row = st + j * ld + i0;
            if (p->mods.score_mod) {
                const FA_REAL *r =
                    FA_FN(fa_mod_run)(p->mods.score_mod, p->mods.aux, buf, row, w, b, h, q0, kv);
                for (int64_t k = 0; k < w; k++)
                    row[k] = r[k];
            }
            /* mask_mod is consulted where the block mask leaves it the choice (partial), and
             * everywhere without one. */
            int consult = 1;
            if (at->states) {
                consult = 0;
                for (int64_t k = 0; k < w; k++) {
                    const int64_t qb = (at->q0 + i0 + k) / blocks->q_block - at->qb0;
                    state[k] = qb < at->nqb ? at->states[qb * blocks->nk + kb] : FA_BLOCK_SKIP;
                    consult |= state[k] == FA_BLOCK_PARTIAL;
                }
            }
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

void FA_FN(fa_cpu_mod_apply)(const fa_params *p, FA_REAL *buf, FA_REAL *st, int64_t ld,
                             int64_t n, int64_t c0, int64_t c1, const fa_cpu_mod_at *at)
{
    FA_FN(fa_mod_apply)(p, buf, st, ld, n, c0, c1, at);
}
