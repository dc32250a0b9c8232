/*
 * The gradients of score_mod's captured fp32 tensors (fa_bwd_args.mod_aux_grad) on the CPU:
 * score_mod evaluated once more over runs of up to FA_CPU_AUX_CHUNK visible elements (a step at
 * a time over the run, in double, each step rounded to float where the call computes in fp32,
 * as the forward's values are), with the derivative of its root with respect to each read of a
 * slot that has a gradient: forward mode, fa_mod_grad.h's rules seeded at the read, over the
 * steps the read reaches (index operands are not differentiated: a read's derivative with
 * respect to its indices is 0). The root's derivative times the gradient of the element's score is added
 * to a per-thread double copy at the element read, in the elements' order; the copies are
 * summed at the end.
 */
#include <math.h>
#include <string.h>

#include "cpu/fa_cpu_mod.h"
#include "mod/fa_mod_grad.h"

#define FA_MOD_D_EXP(x) exp(x)
#define FA_MOD_D_LOG(x) log(x)
#define FA_MOD_D_TANH(x) tanh(x)
#define FA_MOD_D_SQRT(x) sqrt(x)
#define FA_MOD_D_FLOOR(x) floor(x)
#define FA_MOD_D_POW(x, y) pow(x, y)
#define FA_MOD_D_SQ(x) ((x) * (x))

/* Whether step n has a derivative rule (fa_mod_grad.h): the other steps' derivatives are 0. */
static int fa_aux_grad_rule_has(const fa_mod_node *n)
{
    if (n->type != FA_MOD_NUM)
        return 0;
    switch (n->op) {
#define FA_AUX_GRAD_HAS(op, expr) case op:
        FA_MOD_GRAD_RULES(FA_AUX_GRAD_HAS)
#undef FA_AUX_GRAD_HAS
        return 1;
    default:
        return 0;
    }
}

fa_status fa_cpu_aux_grads(const fa_params *p, fa_cpu_aux_grads_plan *g)
{
    memset(g, 0, sizeof *g);
    const fa_mod *m = p->mods.score_mod;
    if (!m)
        return FA_STATUS_OK;
    for (int s = 0; s < FA_MOD_AUX_SLOTS; s++) {
        g->offset[s] = g->total;
        if (p->mod_aux_grad[s].data) {
            int64_t n = 1;
            for (int d = 0; d < p->mods.aux[s].ndim; d++)
                n *= p->mods.aux[s].shape[d];
            g->total += n;
        }
    }
    for (int i = 0; i < m->n_steps; i++)
        if (m->steps[i].op == FA_MOD_OP_AUX && p->mod_aux_grad[m->steps[i].what].data) {
            if (g->reads == FA_CPU_AUX_GRAD_READS)
                return fa_error_set(FA_STATUS_UNSUPPORTED,
                                    "mod_aux_grad: score_mod reads the tensors with a gradient "
                                    "at more than %d places", FA_CPU_AUX_GRAD_READS);
            g->step[g->reads++] = i;
        }
    /* live[c][i]: whether step i's derivative with respect to read c can be other than 0 */
    g->n_steps = m->n_steps;
    for (int c = 0; c < g->reads; c++)
        for (int i = 0; i < m->n_steps; i++) {
            const fa_mod_node *n = &m->steps[i];
            int reached = i == g->step[c];
            if (fa_aux_grad_rule_has(n))
                for (int a = 0; a < n->n_args; a++)
                    reached |= g->live[c][n->args[a]];
            g->live[c][i] = (unsigned char)reached;
        }
    return FA_STATUS_OK;
}

/* A thread's scratch for the runs, in doubles from its start: the values of every step
 * [n_steps][C], each read's derivatives of every step [reads][n_steps][C], each read's element
 * offsets [reads][C] (int64), then the run's q, kv (int64), score and ds [C] each. */
enum { FA_AUX_VALUES, FA_AUX_DERIVS, FA_AUX_OFFSETS, FA_AUX_RUN, FA_AUX_END };
static size_t fa_aux_part(const fa_cpu_aux_grads_plan *g, int part)
{
    const size_t C = FA_CPU_AUX_CHUNK, S = (size_t)g->n_steps, R = (size_t)g->reads;
    const size_t start[FA_AUX_END + 1] = {0, S * C, S * C * (1 + R), S * C * (1 + R) + R * C,
                                          S * C * (1 + R) + R * C + 4 * C};
    return start[part];
}

size_t fa_cpu_aux_grad_scratch_size(const fa_cpu_aux_grads_plan *g)
{
    if (!g->reads)
        return 0;
    return (fa_aux_part(g, FA_AUX_END) * sizeof(double) + 63) & ~(size_t)63;
}

fa_cpu_aux_run fa_cpu_aux_run_at(const fa_cpu_aux_grads_plan *g, void *scratch)
{
    double *at = (double *)scratch + fa_aux_part(g, FA_AUX_RUN);
    fa_cpu_aux_run r = {(int64_t *)at, (int64_t *)(at + FA_CPU_AUX_CHUNK),
                        at + 2 * FA_CPU_AUX_CHUNK, at + 3 * FA_CPU_AUX_CHUNK, 0};
    return r;
}

/* The row-major index of aux slot t at the index values x[0 .. n) (floored and clamped into
 * each dimension, as the forward reads them), and its element's address. */
static int64_t fa_aux_index(const fa_tensor *t, const double *x, int n, const void **at)
{
    int64_t lin = 0, off = 0;
    for (int d = 0; d < n; d++) {
        const double last = (double)(t->shape[d] - 1), v = x[d] > 0 ? x[d] : 0;
        const int64_t i = (int64_t)(v < last ? v : last);
        lin = lin * t->shape[d] + i;
        off += i * t->stride[d];
    }
    *at = (const char *)t->data + off * 4; /* fp32 or int32 */
    return lin;
}

/* Step s's values over the run's n elements into r (ix: its operands' values; lin: where a read
 * with a gradient puts its elements' offsets in the gradients' buffer). */
static void fa_aux_values(const fa_params *p, const fa_cpu_aux_grads_plan *g, int s,
                          const fa_cpu_aux_run *run, int64_t b, int64_t h,
                          const double *const *ix, double *r, int64_t *lin)
{
    const fa_mod_node *nd = &p->mods.score_mod->steps[s];
    const int n = run->n;
    const double *x = ix[0], *y = ix[1], *z = ix[2];
#define FA_AUX_EACH(expr)                                                                          \
    for (int i = 0; i < n; i++)                                                                    \
        r[i] = (expr);                                                                             \
    break
    switch (nd->op) {
    case FA_MOD_OP_VAR:
        switch (nd->what) {
        case FA_MOD_SCORE: FA_AUX_EACH(run->score[i]);
        case FA_MOD_B: FA_AUX_EACH((double)b);
        case FA_MOD_H: FA_AUX_EACH((double)h);
        case FA_MOD_Q_IDX: FA_AUX_EACH((double)run->q[i]);
        default: FA_AUX_EACH((double)run->kv[i]);
        }
        break;
    case FA_MOD_OP_CONST: FA_AUX_EACH(nd->value);
    case FA_MOD_OP_WHERE: FA_AUX_EACH(x[i] != 0 ? y[i] : z[i]);
    case FA_MOD_OP_AUX: {
        const fa_tensor *t = &p->mods.aux[nd->what];
        int64_t *into = NULL; /* the offsets of a read with a gradient */
        for (int c = 0; c < g->reads; c++)
            if (g->step[c] == s)
                into = lin + (size_t)c * FA_CPU_AUX_CHUNK;
        for (int i = 0; i < n; i++) {
            double at_ix[FA_MAX_DIMS] = {0};
            for (int d = 0; d < nd->n_args; d++)
                at_ix[d] = ix[d][i];
            const void *at;
            const int64_t k = fa_aux_index(t, at_ix, nd->n_args, &at);
            r[i] = t->dtype == FA_DTYPE_F32 ? *(const float *)at : *(const int32_t *)at;
            if (into)
                into[i] = g->offset[nd->what] + k;
        }
        break;
    }
    case FA_MOD_NEG: FA_AUX_EACH(-x[i]);
    case FA_MOD_EXP: FA_AUX_EACH(exp(x[i]));
    case FA_MOD_LOG: FA_AUX_EACH(log(x[i]));
    case FA_MOD_TANH: FA_AUX_EACH(tanh(x[i]));
    case FA_MOD_ABS: FA_AUX_EACH(fabs(x[i]));
    case FA_MOD_SQRT: FA_AUX_EACH(sqrt(x[i]));
    case FA_MOD_FLOOR: FA_AUX_EACH(floor(x[i]));
    case FA_MOD_NOT: FA_AUX_EACH(x[i] == 0);
    case FA_MOD_ADD: FA_AUX_EACH(x[i] + y[i]);
    case FA_MOD_SUB: FA_AUX_EACH(x[i] - y[i]);
    case FA_MOD_MUL: FA_AUX_EACH(x[i] * y[i]);
    case FA_MOD_DIV: FA_AUX_EACH(x[i] / y[i]);
    case FA_MOD_MIN: FA_AUX_EACH((x[i] < y[i] || x[i] != x[i]) ? x[i] : y[i]);
    case FA_MOD_MAX: FA_AUX_EACH((x[i] > y[i] || x[i] != x[i]) ? x[i] : y[i]);
    case FA_MOD_POW: FA_AUX_EACH(pow(x[i], y[i]));
    case FA_MOD_MOD:
        for (int i = 0; i < n; i++) {
            const double rem = fmod(x[i], y[i]);
            r[i] = (rem != 0 && ((rem < 0) != (y[i] < 0))) ? rem + y[i] : rem;
        }
        break;
    case FA_MOD_LT: FA_AUX_EACH(x[i] < y[i]);
    case FA_MOD_LE: FA_AUX_EACH(x[i] <= y[i]);
    case FA_MOD_GT: FA_AUX_EACH(x[i] > y[i]);
    case FA_MOD_GE: FA_AUX_EACH(x[i] >= y[i]);
    case FA_MOD_EQ: FA_AUX_EACH(x[i] == y[i]);
    case FA_MOD_NE: FA_AUX_EACH(x[i] != y[i]);
    case FA_MOD_AND: FA_AUX_EACH((x[i] != 0) & (y[i] != 0));
    case FA_MOD_OR: FA_AUX_EACH((x[i] != 0) | (y[i] != 0));
    default: FA_AUX_EACH(0.0);
    }
#undef FA_AUX_EACH
}

/* Step s's derivative over the run into d by its rule (X, Y: its operands' values; DX, DY, DZ
 * their derivatives). */
static void fa_aux_derivs(const fa_mod_node *nd, int n, const double *X, const double *Y,
                          const double *DX, const double *DY, const double *DZ, double *d)
{
    switch (nd->op) {
#define FA_AUX_GRAD_RULE(op_code, expr)                                                            \
    case op_code:                                                                                  \
        for (int i = 0; i < n; i++) {                                                              \
            const double x = X[i], y = Y[i], dx = DX[i], dy = DY[i], dz = DZ[i];                   \
            (void)x, (void)y, (void)dx, (void)dy, (void)dz;                                        \
            d[i] = (expr);                                                                         \
        }                                                                                          \
        break;
        FA_MOD_GRAD_RULES(FA_AUX_GRAD_RULE)
#undef FA_AUX_GRAD_RULE
    default:
        for (int i = 0; i < n; i++)
            d[i] = 0;
        break;
    }
}

void fa_cpu_mod_aux_grad_add(const fa_params *p, const fa_cpu_aux_grads_plan *g, void *scratch,
                             fa_cpu_aux_run *run, double *acc, int64_t b, int64_t h)
{
    const fa_mod *m = p->mods.score_mod;
    const int f32 = p->dtype != FA_DTYPE_F64, n = run->n, S = m->n_steps;
    enum { C = FA_CPU_AUX_CHUNK };
    static const double zero[C];
    double *val = (double *)scratch + fa_aux_part(g, FA_AUX_VALUES);
    double *der = (double *)scratch + fa_aux_part(g, FA_AUX_DERIVS);
    int64_t *lin = (int64_t *)((double *)scratch + fa_aux_part(g, FA_AUX_OFFSETS));
    if (n < 1)
        return;
    for (int s = 0; s < S; s++) {
        const fa_mod_node *nd = &m->steps[s];
        /* its operands' values (zeros past them: the rules read three) */
        const double *arg[FA_MOD_MAX_ARGS];
        for (int a = 0; a < FA_MOD_MAX_ARGS; a++)
            arg[a] = a < nd->n_args ? val + (size_t)nd->args[a] * C : zero;
        double *r = val + (size_t)s * C;
        fa_aux_values(p, g, s, run, b, h, arg, r, lin);
        if (f32)
            for (int i = 0; i < n; i++)
                r[i] = (double)(float)r[i];
        for (int c = 0; c < g->reads; c++) {
            if (!g->live[c][s])
                continue;
            double *d = der + ((size_t)c * S + s) * C;
            if (s == g->step[c]) {
                for (int i = 0; i < n; i++)
                    d[i] = 1;
                continue;
            }
            const double *da[3] = {zero, zero, zero};
            for (int a = 0; a < nd->n_args && a < 3; a++)
                if (g->live[c][nd->args[a]])
                    da[a] = der + ((size_t)c * S + nd->args[a]) * C;
            fa_aux_derivs(nd, n, arg[0], arg[1], da[0], da[1], da[2], d);
        }
    }
    for (int c = 0; c < g->reads; c++) {
        if (!g->live[c][S - 1])
            continue;
        const double *d = der + ((size_t)c * S + S - 1) * C;
        const int64_t *at = lin + (size_t)c * C;
        for (int i = 0; i < n; i++)
            if (d[i] != 0)
                acc[at[i]] += run->ds[i] * d[i];
    }
    run->n = 0;
}
