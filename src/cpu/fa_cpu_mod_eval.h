/*
 * The forward's evaluator of a program (fa_cpu_mod_body.h includes it once per precision): each
 * step runs as often as what it reads varies (fa_mod.vary), not once per score. For a tile of
 * keys (rows) by queries (lanes):
 *   phase 0: steps that read neither q_idx, kv_idx nor score (b, h, constants, tables at them),
 *            once per call, one number each;
 *   phase 1: steps of q_idx alone, once per chunk of up to FA_CPU_MOD_CHUNK queries;
 *   phase 2: steps of kv_idx alone, once per chunk of keys, the keys as the lanes;
 *   phase 3: the rest, over FA_CPU_MOD_ROWS keys by the query chunk at a time, reading the
 *            hoisted values as a number per tile (phase 0), per lane (1) or per row (2);
 *            for the backward also each step's derivative with respect to score (the rules
 *            of mod/fa_mod_grad.h), the steps of phases 0-2 having none.
 * An operand is a pointer, its stride between rows and whether it varies along the lanes, so each
 * operation has one loop per such combination, each of which vectorises.
 */

/* Element (row jj, lane k) of an operand is p[jj * rs + (v ? k : 0)]. */
typedef struct FA_FN(fa_mod_opnd) {
    const FA_REAL *p;
    int64_t rs;
    int v;
} FA_FN(fa_mod_opnd);

/* A program's slots in the thread's scratch, and where the current pass is. */
typedef struct FA_FN(fa_mod_ctx) {
    FA_REAL *sc, *vq, *vk, *vt; /* phase 0, 1, 2 values by slot; phase 3 buffers */
    FA_REAL *dvt;               /* phase 3 derivatives, laid out as vt; NULL: not taken */
    const FA_REAL *score;       /* phase 3: S^T at the pass's first key and query */
    int64_t ld;                 /* of score */
    int64_t jrel;               /* phase 3: the pass's first key among phase 2's lanes */
    int64_t rows, w;            /* of the pass */
    FA_REAL b, h, lane0;        /* lane0: the index of lane 0 (phase 1: q_idx, 2: kv_idx) */
} FA_FN(fa_mod_ctx);

/* Points ctx's slots at ws (fa_cpu_mod_eval_reals of m) and returns what follows them. */
static FA_REAL *FA_FN(fa_mod_ctx_init)(FA_FN(fa_mod_ctx) * c, const fa_mod *m, FA_REAL *ws)
{
    const int64_t ch = FA_CPU_MOD_CHUNK;
    c->sc = ws;
    c->vq = c->sc + ((m->n_slots[0] + ch - 1) / ch) * ch;
    c->vk = c->vq + m->n_slots[1] * ch;
    c->vt = c->vk + m->n_slots[2] * ch;
    return c->vt + m->n_slots[3] * FA_CPU_MOD_ROWS * ch;
}

/* x mod y with the divisor's sign (floor remainder): fmod is exact, then moved. */
FA_CPU_INLINE FA_REAL FA_FN(fa_mod_floor_rem)(FA_REAL x, FA_REAL y)
{
    const FA_REAL r = FA_M(fmod)(x, y);
    return (r != 0 && ((r < 0) != (y < 0))) ? r + y : r;
}

/* Step s's values as an operand of a step of `phase`. */
FA_CPU_INLINE FA_FN(fa_mod_opnd) FA_FN(fa_mod_desc)(const fa_mod *m, int s, int phase,
                                                    const FA_FN(fa_mod_ctx) * c)
{
    const int64_t ch = FA_CPU_MOD_CHUNK, slot = m->slot[s];
    switch (m->vary[s]) {
    case 0:
        return (FA_FN(fa_mod_opnd)){c->sc + slot, 0, 0};
    case FA_MOD_VARY_Q:
        return (FA_FN(fa_mod_opnd)){c->vq + slot * ch, 0, 1};
    case FA_MOD_VARY_KV:
        return phase == FA_MOD_VARY_KV ? (FA_FN(fa_mod_opnd)){c->vk + slot * ch, 0, 1}
                                       : (FA_FN(fa_mod_opnd)){c->vk + slot * ch + c->jrel, 1, 0};
    default:
        if (m->steps[s].op == FA_MOD_OP_VAR)
            return (FA_FN(fa_mod_opnd)){c->score, c->ld, 1};
        return (FA_FN(fa_mod_opnd)){c->vt + slot * FA_CPU_MOD_ROWS * ch, ch, 1};
    }
}

/* Step s's derivative with respect to score as an operand of a phase-3 step: 0 where s does
 * not vary with score (phases 0-2), 1 for score itself, else its slot of dvt. */
FA_CPU_INLINE FA_FN(fa_mod_opnd) FA_FN(fa_mod_ddesc)(const fa_mod *m, int s,
                                                     const FA_FN(fa_mod_ctx) * c)
{
    static const FA_REAL zero = 0, one = 1;
    if (m->vary[s] != FA_MOD_VARY_QKV)
        return (FA_FN(fa_mod_opnd)){&zero, 0, 0};
    if (m->steps[s].op == FA_MOD_OP_VAR) /* the one phase-3 variable */
        return (FA_FN(fa_mod_opnd)){&one, 0, 0};
    return (FA_FN(fa_mod_opnd)){c->dvt + m->slot[s] * FA_CPU_MOD_ROWS * FA_CPU_MOD_CHUNK,
                                FA_CPU_MOD_CHUNK, 1};
}

/* No dependence between a loop's iterations: an output is read (as an operand) at most at the
 * index it is written. clang warns where such a loop still does not vectorise (a libm call, a
 * table read it cannot gather): those stay scalar, as they would be without the hint. */
#if defined(__clang__)
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wpass-failed"
#define FA_MOD_IVDEP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define FA_MOD_IVDEP _Pragma("GCC ivdep")
#else
#define FA_MOD_IVDEP
#endif

/* The pass's rows: o the output row, xr / yr / zr the operands' rows. */
#define FA_MOD_E_ROWS(...)                                                                       \
    for (int64_t jj = 0; jj < rows; jj++) {                                                      \
        FA_REAL *o = o_ + jj * ors;                                                              \
        const FA_REAL *xr = A[0].p + jj * A[0].rs, *yr = A[1].p + jj * A[1].rs;                  \
        (void)xr, (void)yr;                                                                      \
        __VA_ARGS__                                                                              \
    }
#define FA_MOD_E_FILL(expr)                                                                      \
    FA_MOD_E_ROWS(FA_MOD_IVDEP for (int64_t k = 0; k < w; k++) o[k] = (expr);)                   \
    break
#define FA_MOD_E_MAP1(expr)                                                                      \
    FA_MOD_E_ROWS(FA_MOD_IVDEP for (int64_t k = 0; k < w; k++) {                                 \
        const FA_REAL x = xr[k];                                                                 \
        o[k] = (expr);                                                                           \
    })                                                                                           \
    break
/* A binary operation: one loop per (x varies, y varies). */
#define FA_MOD_E_MAP2(expr)                                                                      \
    FA_MOD_E_ROWS(if (A[0].v && A[1].v) {                                                        \
        FA_MOD_IVDEP for (int64_t k = 0; k < w; k++) {                                           \
            const FA_REAL x = xr[k], y = yr[k];                                                  \
            o[k] = (expr);                                                                       \
        }                                                                                        \
    } else if (A[0].v) {                                                                         \
        const FA_REAL y = yr[0];                                                                 \
        FA_MOD_IVDEP for (int64_t k = 0; k < w; k++) {                                           \
            const FA_REAL x = xr[k];                                                             \
            o[k] = (expr);                                                                       \
        }                                                                                        \
    } else if (A[1].v) {                                                                         \
        const FA_REAL x = xr[0];                                                                 \
        FA_MOD_IVDEP for (int64_t k = 0; k < w; k++) {                                           \
            const FA_REAL y = yr[k];                                                             \
            o[k] = (expr);                                                                       \
        }                                                                                        \
    } else {                                                                                     \
        const FA_REAL x = xr[0], y = yr[0], r = (expr);                                          \
        for (int64_t k = 0; k < w; k++)                                                          \
            o[k] = r;                                                                            \
    })                                                                                           \
    break

/* Gathers from one typed table (src) with offsets in integer type IT: ndim 1 and 2 with one loop
 * per (index varies) case, more dims element by element. I: the index operands; the row's parts
 * that do not vary along the lanes are added once per row. */
#define FA_MOD_IX(v, d, IT) ((IT)FA_FN(fa_mod_clamp)((v), last[d]))
#define FA_MOD_E_GATHER(src, IT)                                                                 \
    for (int64_t jj = 0; jj < rows; jj++) {                                                      \
        FA_REAL *o = o_ + jj * ors;                                                              \
        const IT s0 = (IT)t->stride[0], s1 = ndim >= 2 ? (IT)t->stride[1] : 0;                   \
        if (ndim <= 2) {                                                                         \
            const FA_REAL *i0 = I[0].p + jj * I[0].rs;                                           \
            const FA_REAL *i1 = ndim == 2 ? I[1].p + jj * I[1].rs : i0;                          \
            const int v0 = I[0].v, v1 = ndim == 2 && I[1].v;                                     \
            const IT base = (v0 ? 0 : FA_MOD_IX(i0[0], 0, IT) * s0) +                                \
                            (ndim == 2 && !v1 ? FA_MOD_IX(i1[0], 1, IT) * s1 : 0);                   \
            if (v0 && v1) {                                                                      \
                FA_MOD_IVDEP for (int64_t k = 0; k < w; k++) o[k] =                              \
                    (FA_REAL)src[FA_MOD_IX(i0[k], 0, IT) * s0 + FA_MOD_IX(i1[k], 1, IT) * s1];           \
            } else if (v0) {                                                                     \
                FA_MOD_IVDEP for (int64_t k = 0; k < w; k++) o[k] =                              \
                    (FA_REAL)src[base + FA_MOD_IX(i0[k], 0, IT) * s0];                               \
            } else if (v1 && FA_FN(fa_mod_run_of)(i1, w, last[1], s1, &step)) {                   \
                const IT at = base + (IT)i1[0] * s1; /* the lanes read one run of the table */    \
                if (step == 1) {                                                                 \
                    FA_MOD_IVDEP for (int64_t k = 0; k < w; k++) o[k] = (FA_REAL)src[at + k];    \
                } else {                                                                         \
                    FA_MOD_IVDEP for (int64_t k = 0; k < w; k++) o[k] = (FA_REAL)src[at - k];    \
                }                                                                                \
            } else if (v1) {                                                                     \
                FA_MOD_IVDEP for (int64_t k = 0; k < w; k++) o[k] =                              \
                    (FA_REAL)src[base + FA_MOD_IX(i1[k], 1, IT) * s1];                           \
            } else {                                                                             \
                const FA_REAL r = (FA_REAL)src[base];                                            \
                for (int64_t k = 0; k < w; k++)                                                  \
                    o[k] = r;                                                                    \
            }                                                                                    \
        } else {                                                                                 \
            for (int64_t k = 0; k < w; k++) {                                                    \
                IT off = 0;                                                                      \
                for (int d = 0; d < ndim; d++)                                                   \
                    off += FA_MOD_IX(I[d].p[jj * I[d].rs + (I[d].v ? k : 0)], d, IT) *               \
                           (IT)t->stride[d];                                                     \
                o[k] = (FA_REAL)src[off];                                                        \
            }                                                                                    \
        }                                                                                        \
    }

/* Whether indices x[0 .. w) are whole numbers in [0, last] that step by one (up or down) along
 * the lanes, with stride s the table's elements adjacent too (*step: +1 or -1 elements): a
 * relative position q_idx - kv_idx does, and its reads are then one contiguous run. */
FA_CPU_INLINE int FA_FN(fa_mod_run_of)(const FA_REAL *x, int64_t w, FA_REAL last, int64_t s,
                                       int *step)
{
    const FA_REAL a = x[0], d = w > 1 ? x[1] - a : 1;
    if ((s != 1 && s != -1) || (d != 1 && d != -1) || !(a >= 0 && a <= last) ||
        a != FA_M(floor)(a))
        return 0;
    const FA_REAL z = a + d * (FA_REAL)(w - 1);
    if (!(z >= 0 && z <= last) || a > 16777216 || z > 16777216) /* exact in fp32 */
        return 0;
    int ok = 1;
    for (int64_t k = 0; k < w; k++)
        ok &= x[k] == a + d * (FA_REAL)k;
    *step = (int)d * (int)s;
    return ok;
}

/* Aux slot t at the operands' values (floored, clamped as fa_mod_gather does). Offsets are
 * 32-bit where every element's offset fits (the gathers then take 16 lanes), else 64-bit. */
FA_CPU_INLINE void FA_FN(fa_mod_e_gather)(FA_REAL *o_, int64_t ors, const fa_tensor *t,
                                          const FA_FN(fa_mod_opnd) * I, int ndim, int64_t rows,
                                          int64_t w)
{
    FA_REAL last[FA_MOD_MAX_ARGS];
    int64_t lo = 0, hi = 0; /* the extreme offsets */
    int narrow = 1;
    for (int d = 0; d < ndim; d++) {
        last[d] = FA_FN(fa_mod_last)(t->shape[d]);
        const int64_t span = (t->shape[d] - 1) * t->stride[d];
        lo += span < 0 ? span : 0;
        hi += span > 0 ? span : 0;
        narrow &= t->shape[d] - 1 <= (int64_t)INT32_MAX; /* each index too */
    }
    if (ndim < 2)
        last[1] = last[0];
    int step = 0;
    narrow &= lo >= -(int64_t)INT32_MAX && hi <= (int64_t)INT32_MAX;
    if (t->dtype == FA_DTYPE_I32) {
        const int32_t *di = (const int32_t *)t->data;
        if (narrow) {
            FA_MOD_E_GATHER(di, int32_t)
        } else {
            FA_MOD_E_GATHER(di, int64_t)
        }
    } else {
        const float *df = (const float *)t->data;
        if (narrow) {
            FA_MOD_E_GATHER(df, int32_t)
        } else {
            FA_MOD_E_GATHER(df, int64_t)
        }
    }
}
#undef FA_MOD_IX

/* One step over rows x w values into o_ (rows ors apart) from its operands A. */
FA_CPU_INLINE void FA_FN(fa_mod_e_step)(const fa_mod_node *n, FA_REAL *o_, int64_t ors,
                                        const FA_FN(fa_mod_opnd) * A, const fa_tensor *aux,
                                        int64_t rows, int64_t w, const FA_FN(fa_mod_ctx) * c)
{
    switch (n->op) {
    case FA_MOD_OP_VAR:
        switch (n->what) {
        case FA_MOD_B:
            FA_MOD_E_FILL(c->b);
        case FA_MOD_H:
            FA_MOD_E_FILL(c->h);
        default: /* q_idx (phase 1) or kv_idx (phase 2): the lanes' own index */
            FA_MOD_E_FILL(c->lane0 + (FA_REAL)k);
        }
        break;
    case FA_MOD_OP_CONST:
        FA_MOD_E_FILL((FA_REAL)n->value);
    case FA_MOD_OP_WHERE:
        for (int64_t jj = 0; jj < rows; jj++) {
            FA_REAL *o = o_ + jj * ors;
            const FA_REAL *cr = A[0].p + jj * A[0].rs, *ar = A[1].p + jj * A[1].rs,
                          *br = A[2].p + jj * A[2].rs;
            if (!A[0].v) { /* one branch for the whole row */
                const FA_REAL *src = cr[0] != 0 ? ar : br;
                const int sv = cr[0] != 0 ? A[1].v : A[2].v;
                if (sv) {
                    FA_MOD_IVDEP for (int64_t k = 0; k < w; k++) o[k] = src[k];
                } else {
                    const FA_REAL r = src[0];
                    for (int64_t k = 0; k < w; k++)
                        o[k] = r;
                }
            } else if (A[1].v && A[2].v) {
                FA_MOD_IVDEP for (int64_t k = 0; k < w; k++) o[k] = cr[k] != 0 ? ar[k] : br[k];
            } else {
                const int64_t ma = A[1].v ? 1 : 0, mb = A[2].v ? 1 : 0;
                for (int64_t k = 0; k < w; k++)
                    o[k] = cr[k] != 0 ? ar[k * ma] : br[k * mb];
            }
        }
        break;
    case FA_MOD_OP_AUX:
        FA_FN(fa_mod_e_gather)(o_, ors, &aux[n->what], A, n->n_args, rows, w);
        break;
    case FA_MOD_NEG:
        FA_MOD_E_MAP1(-x);
    case FA_MOD_EXP:
        FA_MOD_E_MAP1(FA_MOD_EXPV(x));
    case FA_MOD_LOG:
        FA_MOD_E_MAP1(FA_M(log)(x));
    case FA_MOD_TANH:
        FA_MOD_E_MAP1(FA_MOD_TANHV(x));
    case FA_MOD_ABS:
        FA_MOD_E_MAP1(FA_M(fabs)(x));
    case FA_MOD_SQRT:
        FA_MOD_E_MAP1(FA_M(sqrt)(x));
    case FA_MOD_FLOOR:
        FA_MOD_E_MAP1(FA_M(floor)(x));
    case FA_MOD_NOT:
        FA_MOD_E_MAP1((FA_REAL)(x == 0));
    case FA_MOD_ADD:
        FA_MOD_E_MAP2(x + y);
    case FA_MOD_SUB:
        FA_MOD_E_MAP2(x - y);
    case FA_MOD_MUL:
        FA_MOD_E_MAP2(x * y);
    case FA_MOD_DIV:
        FA_MOD_E_MAP2(x / y);
    case FA_MOD_MIN: /* NaN in, NaN out (as torch.minimum) */
        FA_MOD_E_MAP2((x < y || x != x) ? x : y);
    case FA_MOD_MAX:
        FA_MOD_E_MAP2((x > y || x != x) ? x : y);
    case FA_MOD_POW:
        FA_MOD_E_MAP2(FA_M(pow)(x, y));
    case FA_MOD_MOD:
        FA_MOD_E_MAP2(FA_FN(fa_mod_floor_rem)(x, y));
    case FA_MOD_LT:
        FA_MOD_E_MAP2((FA_REAL)(x < y));
    case FA_MOD_LE:
        FA_MOD_E_MAP2((FA_REAL)(x <= y));
    case FA_MOD_GT:
        FA_MOD_E_MAP2((FA_REAL)(x > y));
    case FA_MOD_GE:
        FA_MOD_E_MAP2((FA_REAL)(x >= y));
    case FA_MOD_EQ:
        FA_MOD_E_MAP2((FA_REAL)(x == y));
    case FA_MOD_NE:
        FA_MOD_E_MAP2((FA_REAL)(x != y));
    case FA_MOD_AND:
        FA_MOD_E_MAP2((FA_REAL)((x != 0) & (y != 0)));
    case FA_MOD_OR:
        FA_MOD_E_MAP2((FA_REAL)((x != 0) | (y != 0)));
    default:
        break;
    }
}

/* Row jj of operand a as w lanes: a's own where it varies along them, else its one value
 * repeated into tmp. */
FA_CPU_INLINE const FA_REAL *FA_FN(fa_mod_lanes)(FA_FN(fa_mod_opnd) a, int64_t jj, int64_t w,
                                                 FA_REAL *tmp)
{
    if (a.v)
        return a.p + jj * a.rs;
    const FA_REAL r = a.p[jj * a.rs];
    for (int64_t k = 0; k < w; k++)
        tmp[k] = r;
    return tmp;
}

#define FA_MOD_D_EXP(v) FA_MOD_EXPV(v)
#define FA_MOD_D_LOG(v) FA_M(log)(v)
#define FA_MOD_D_TANH(v) FA_MOD_TANHV(v)
#define FA_MOD_D_SQRT(v) FA_M(sqrt)(v)
#define FA_MOD_D_FLOOR(v) FA_M(floor)(v)
#define FA_MOD_D_POW(v, e) FA_M(pow)(v, e)
#define FA_MOD_D_SQ(v) FA_FN(fa_mod_sq)(v)

/* One rule of mod/fa_mod_grad.h as a loop over a row; what it does not read the compiler drops. */
#define FA_MOD_GRAD_LOOP(op_code, expr)                                                          \
    case op_code:                                                                                \
        FA_MOD_IVDEP for (int64_t k = 0; k < w; k++) {                                           \
            const FA_REAL x = x_[k], y = y_[k], dx = dx_[k], dy = dy_[k], dz = dz_[k];           \
            (void)x, (void)y, (void)dx, (void)dy, (void)dz;                                      \
            d[k] = (expr);                                                                       \
        }                                                                                        \
        break;

/* The derivative of phase-3 step n into d_ (rows ch apart), from its operands' values A and
 * derivatives D, before the step's values overwrite any of them. Operations without a rule
 * (booleans, floor, aux reads) have derivative 0. */
FA_CPU_INLINE void FA_FN(fa_mod_e_dstep)(const fa_mod_node *n, FA_REAL *d_,
                                         const FA_FN(fa_mod_opnd) * A,
                                         const FA_FN(fa_mod_opnd) * D, int64_t rows, int64_t w)
{
    FA_REAL tmp[5][FA_CPU_MOD_CHUNK];
    for (int64_t jj = 0; jj < rows; jj++) {
        FA_REAL *d = d_ + jj * FA_CPU_MOD_CHUNK;
        const FA_REAL *x_ = FA_FN(fa_mod_lanes)(A[0], jj, w, tmp[0]);
        const FA_REAL *y_ = FA_FN(fa_mod_lanes)(A[1], jj, w, tmp[1]);
        const FA_REAL *dx_ = FA_FN(fa_mod_lanes)(D[0], jj, w, tmp[2]);
        const FA_REAL *dy_ = FA_FN(fa_mod_lanes)(D[1], jj, w, tmp[3]);
        const FA_REAL *dz_ = FA_FN(fa_mod_lanes)(D[2], jj, w, tmp[4]);
        switch (n->op) {
            FA_MOD_GRAD_RULES(FA_MOD_GRAD_LOOP)
        default:
            for (int64_t k = 0; k < w; k++)
                d[k] = 0;
        }
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

/*
 * Runs the steps of m that belong to `phase` (score itself is read, never run) with ctx's pass.
 * Phase 3 writes its root into root_out (rows ld apart) when root_out is given and the root is
 * a phase-3 operation; returns the root's values as an operand of phase 3 either way. With
 * c->dvt, phase 3 also leaves each step's derivative there (fa_mod_ddesc reads them).
 */
FA_CPU_CLONES static FA_FN(fa_mod_opnd)
    FA_FN(fa_mod_eval)(const fa_mod *m, const fa_tensor *aux, int phase,
                       const FA_FN(fa_mod_ctx) * c, FA_REAL *root_out, int64_t root_ld)
{
    const int64_t ch = FA_CPU_MOD_CHUNK;
    const int root = m->n_steps - 1;
    const int64_t rows = phase == FA_MOD_VARY_QKV ? c->rows : 1;
    const int64_t w = phase == 0 ? 1 : c->w;
    int wrote_root = 0;
    for (int s = 0; s < m->n_steps; s++) {
        const fa_mod_node *n = &m->steps[s];
        if (m->vary[s] != phase || (n->op == FA_MOD_OP_VAR && n->what == FA_MOD_SCORE))
            continue;
        FA_FN(fa_mod_opnd) A[FA_MOD_MAX_ARGS];
        for (int a = 0; a < FA_MOD_MAX_ARGS; a++)
            A[a] = a < n->n_args ? FA_FN(fa_mod_desc)(m, n->args[a], phase, c)
                                 : (FA_FN(fa_mod_opnd)){c->sc, 0, 0};
        if (phase == FA_MOD_VARY_QKV && c->dvt) {
            static const FA_REAL zero = 0;
            FA_FN(fa_mod_opnd) D[FA_MOD_MAX_ARGS];
            for (int a = 0; a < FA_MOD_MAX_ARGS; a++)
                D[a] = a < n->n_args ? FA_FN(fa_mod_ddesc)(m, n->args[a], c)
                                     : (FA_FN(fa_mod_opnd)){&zero, 0, 0};
            FA_FN(fa_mod_e_dstep)(n, c->dvt + m->slot[s] * FA_CPU_MOD_ROWS * ch, A, D, rows, w);
        }
        FA_REAL *o;
        int64_t ors = 0;
        switch (phase) {
        case 0:
            o = c->sc + m->slot[s];
            break;
        case FA_MOD_VARY_Q:
            o = c->vq + m->slot[s] * ch;
            break;
        case FA_MOD_VARY_KV:
            o = c->vk + m->slot[s] * ch;
            break;
        default:
            if (s == root && root_out) {
                o = root_out, ors = root_ld, wrote_root = 1;
            } else {
                o = c->vt + m->slot[s] * FA_CPU_MOD_ROWS * ch, ors = ch;
            }
        }
        FA_FN(fa_mod_e_step)(n, o, ors, A, aux, rows, w, c);
    }
    if (wrote_root)
        return (FA_FN(fa_mod_opnd)){root_out, root_ld, 1};
    return FA_FN(fa_mod_desc)(m, root, FA_MOD_VARY_QKV, c);
}

#undef FA_MOD_E_ROWS
#undef FA_MOD_E_FILL
#undef FA_MOD_E_MAP1
#undef FA_MOD_E_MAP2
#undef FA_MOD_E_GATHER

#if defined(__clang__)
#pragma clang diagnostic pop
#endif
