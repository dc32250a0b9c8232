/*
 * The gradients of score_mod's captured fp32 tensors (fa_bwd_args.mod_aux_grad) on the CPU: per
 * element, score_mod evaluated once more (scalar, in double, each step rounded to float where the
 * call computes in fp32, as the forward's values are), with the derivative of its root with
 * respect to each read of a slot that has a gradient: forward mode, fa_mod_grad.h's rules
 * seeded at the read (index operands are not differentiated: a read's derivative with respect
 * to its indices is 0). The root's derivative times the gradient of the element's score is
 * added to a per-thread double copy at the element read, the copies summed at the end.
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
    return FA_STATUS_OK;
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

void fa_cpu_mod_aux_grad_add(const fa_params *p, const fa_cpu_aux_grads_plan *g, double *acc,
                             int64_t b, int64_t h, int64_t q, int64_t kv, double score,
                             double ds)
{
    const fa_mod *m = p->mods.score_mod;
    const int f32 = p->dtype != FA_DTYPE_F64;
    double v[FA_MOD_MAX_NODES], dv[FA_CPU_AUX_GRAD_READS][FA_MOD_MAX_NODES];
    int64_t lin[FA_CPU_AUX_GRAD_READS] = {0};
    for (int s = 0; s < m->n_steps; s++) {
        const fa_mod_node *n = &m->steps[s];
        const double x = n->n_args > 0 ? v[n->args[0]] : 0, y = n->n_args > 1 ? v[n->args[1]] : 0;
        double r = 0;
        switch (n->op) {
        case FA_MOD_OP_VAR: {
            const double vars[] = {score, (double)b, (double)h, (double)q, (double)kv};
            r = vars[n->what];
            break;
        }
        case FA_MOD_OP_CONST:
            r = n->value;
            break;
        case FA_MOD_OP_WHERE:
            r = x != 0 ? y : v[n->args[2]];
            break;
        case FA_MOD_OP_AUX: {
            double ix[FA_MAX_DIMS] = {0};
            for (int d = 0; d < n->n_args; d++)
                ix[d] = v[n->args[d]];
            const void *at;
            const int64_t i = fa_aux_index(&p->mods.aux[n->what], ix, n->n_args, &at);
            r = p->mods.aux[n->what].dtype == FA_DTYPE_F32 ? *(const float *)at
                                                           : *(const int32_t *)at;
            for (int c = 0; c < g->reads; c++)
                if (g->step[c] == s)
                    lin[c] = g->offset[n->what] + i;
            break;
        }
        case FA_MOD_NEG: r = -x; break;
        case FA_MOD_EXP: r = exp(x); break;
        case FA_MOD_LOG: r = log(x); break;
        case FA_MOD_TANH: r = tanh(x); break;
        case FA_MOD_ABS: r = fabs(x); break;
        case FA_MOD_SQRT: r = sqrt(x); break;
        case FA_MOD_FLOOR: r = floor(x); break;
        case FA_MOD_NOT: r = x == 0; break;
        case FA_MOD_ADD: r = x + y; break;
        case FA_MOD_SUB: r = x - y; break;
        case FA_MOD_MUL: r = x * y; break;
        case FA_MOD_DIV: r = x / y; break;
        case FA_MOD_MIN: r = (x < y || x != x) ? x : y; break;
        case FA_MOD_MAX: r = (x > y || x != x) ? x : y; break;
        case FA_MOD_POW: r = pow(x, y); break;
        case FA_MOD_MOD: {
            const double rem = fmod(x, y);
            r = (rem != 0 && ((rem < 0) != (y < 0))) ? rem + y : rem;
            break;
        }
        case FA_MOD_LT: r = x < y; break;
        case FA_MOD_LE: r = x <= y; break;
        case FA_MOD_GT: r = x > y; break;
        case FA_MOD_GE: r = x >= y; break;
        case FA_MOD_EQ: r = x == y; break;
        case FA_MOD_NE: r = x != y; break;
        case FA_MOD_AND: r = (x != 0) & (y != 0); break;
        case FA_MOD_OR: r = (x != 0) | (y != 0); break;
        default: break;
        }
        v[s] = f32 ? (double)(float)r : r;
        for (int c = 0; c < g->reads; c++) {
            double d = 0;
            if (g->step[c] == s) {
                d = 1;
            } else if (n->op != FA_MOD_OP_AUX && n->op != FA_MOD_OP_VAR &&
                       n->op != FA_MOD_OP_CONST && n->type == FA_MOD_NUM) {
                const double dx = n->n_args > 0 ? dv[c][n->args[0]] : 0;
                const double dy = n->n_args > 1 ? dv[c][n->args[1]] : 0;
                const double dz = n->n_args > 2 ? dv[c][n->args[2]] : 0;
                switch (n->op) {
#define FA_AUX_GRAD_RULE(op, expr)                                                               \
    case op:                                                                                     \
        d = (expr);                                                                              \
        break;
                    FA_MOD_GRAD_RULES(FA_AUX_GRAD_RULE)
#undef FA_AUX_GRAD_RULE
                default:
                    break;
                }
            }
            dv[c][s] = d;
        }
    }
    const int root = m->n_steps - 1;
    for (int c = 0; c < g->reads; c++)
        if (dv[c][root] != 0)
            acc[lin[c]] += ds * dv[c][root];
}
