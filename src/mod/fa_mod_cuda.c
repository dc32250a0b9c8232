/*
 * The CUDA C of a finished fa_mod program (fa_mod.h): one device function per program, a
 * statement per step, in the CPU evaluator's arithmetic (fa_cpu_mod_body.h) operator by
 * operator (but division, within 2 ulp: fa_mod_div): fp32 values, booleans as bool, constants as
 * the bits of their fp32 value, aux reads through the kernel's fa_mod_aux_at (indices floored
 * and clamped into the tensor). Index arithmetic stays in int (fa_mod_cuda_ints): b, h, q_idx,
 * kv_idx, integral constants and their sums, differences, products, min / max / abs, floor
 * division and remainder by a positive constant, as torch's int32 index tensors compute them
 * (the CPU's fp32 agrees below 2^24); a float operand makes a step fp32. The kernels
 * include it as the generated header fa_mod_gen.cuh; the program's canonical text heads it, and
 * the JIT keys the cubin by the whole text. A score_mod also gets fa_score_mod_grad, its value
 * and its derivative with respect to score for the backward: the rules of fa_mod_grad.h printed
 * as text, a statement per step beside the value's.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mod/fa_mod_cuda.h"
#include "mod/fa_mod_grad.h"

/* The C operator or function of each elementwise op: "%s" the operands, in order. */
static const char *const fa_mod_cuda_forms[] = {
    [FA_MOD_NEG] = "-%s",
    [FA_MOD_EXP] = "expf(%s)",
    [FA_MOD_LOG] = "logf(%s)",
    [FA_MOD_TANH] = "fa_tanh_fast(%s)",
    [FA_MOD_ABS] = "fabsf(%s)",
    [FA_MOD_SQRT] = "sqrtf(%s)",
    [FA_MOD_FLOOR] = "floorf(%s)",
    [FA_MOD_NOT] = "!%s",
    [FA_MOD_ADD] = "%s + %s",
    [FA_MOD_SUB] = "%s - %s",
    [FA_MOD_MUL] = "%s * %s",
    [FA_MOD_DIV] = "fa_mod_div(%s, %s)",
    [FA_MOD_MIN] = "fa_mod_min(%s, %s)",
    [FA_MOD_MAX] = "fa_mod_max(%s, %s)",
    [FA_MOD_POW] = "powf(%s, %s)",
    [FA_MOD_MOD] = "fa_mod_rem(%s, %s)",
    [FA_MOD_LT] = "%s < %s",
    [FA_MOD_LE] = "%s <= %s",
    [FA_MOD_GT] = "%s > %s",
    [FA_MOD_GE] = "%s >= %s",
    [FA_MOD_EQ] = "%s == %s",
    [FA_MOD_NE] = "%s != %s",
    [FA_MOD_AND] = "%s && %s",
    [FA_MOD_OR] = "%s || %s",
};

/* The derivative rules (fa_mod_grad.h) as text, in the names fa_mod.cuh defines. */
#define FA_MOD_GRAD_TEXT(op_code, expr) [op_code] = #expr,
static const char *const fa_mod_cuda_grads[FA_MOD_OP_WHERE + 1] = {
    FA_MOD_GRAD_RULES(FA_MOD_GRAD_TEXT)};
#undef FA_MOD_GRAD_TEXT

static const char *const fa_mod_cuda_vars[] = {"score", "b", "h", "q_idx", "kv_idx"};

/* The largest integral constant kept in int: fp32 holds every integer up to it. */
#define FA_MOD_CUDA_INT_MAX 16777216.0

/* Whether constant step s is an integer that int arithmetic can take (not -0: its sign). */
static int fa_mod_cuda_int_const(const fa_mod_node *s)
{
    const double v = s->value;
    /* In range first: the conversion of a value outside long long's (or NaN) is undefined. */
    return v >= -FA_MOD_CUDA_INT_MAX && v <= FA_MOD_CUDA_INT_MAX && v == (double)(long long)v &&
           !(v == 0.0 && 1.0 / v < 0.0);
}

/* Whether step i is a floor division of int operands by a positive int constant (floor of a
 * division step), which int arithmetic computes exactly: the fp32 quotient of integers below
 * 2^24 never rounds across an integer. */
static int fa_mod_cuda_floor_div(const fa_mod *m, const int *is_int, int i)
{
    const fa_mod_node *s = &m->steps[i];
    if (s->op != FA_MOD_FLOOR)
        return 0;
    const fa_mod_node *q = &m->steps[s->args[0]];
    return q->op == FA_MOD_DIV && is_int[q->args[0]] && is_int[q->args[1]] &&
           m->steps[q->args[1]].op == FA_MOD_OP_CONST && m->steps[q->args[1]].value > 0;
}

/* is_int[i]: whether step i's value is an int (numbers only; booleans count as ints where
 * they enter arithmetic). */
static void fa_mod_cuda_ints(const fa_mod *m, int *is_int)
{
    for (int i = 0; i < m->n_steps; i++) {
        const fa_mod_node *s = &m->steps[i];
        int all = s->n_args > 0;
        for (int k = 0; k < s->n_args; k++)
            all = all && (is_int[s->args[k]] || m->steps[s->args[k]].type == FA_MOD_BOOL);
        switch (s->op) {
        case FA_MOD_OP_VAR: is_int[i] = s->what != FA_MOD_SCORE; break;
        case FA_MOD_OP_CONST: is_int[i] = fa_mod_cuda_int_const(s); break;
        case FA_MOD_ADD:
        case FA_MOD_SUB:
        case FA_MOD_MUL:
        case FA_MOD_NEG:
        case FA_MOD_ABS:
        case FA_MOD_MIN:
        case FA_MOD_MAX: is_int[i] = all; break;
        case FA_MOD_MOD:
            is_int[i] = all && m->steps[s->args[1]].op == FA_MOD_OP_CONST &&
                        m->steps[s->args[1]].value > 0;
            break;
        case FA_MOD_FLOOR:
            is_int[i] = is_int[s->args[0]] || fa_mod_cuda_floor_div(m, is_int, i);
            break;
        case FA_MOD_OP_WHERE:
            is_int[i] = (is_int[s->args[1]] || m->steps[s->args[1]].type == FA_MOD_BOOL) &&
                        (is_int[s->args[2]] || m->steps[s->args[2]].type == FA_MOD_BOOL);
            break;
        default: is_int[i] = 0; break;
        }
        if (s->type == FA_MOD_BOOL)
            is_int[i] = 0;
    }
}

/* The int forms of the ops fa_mod_cuda_ints keeps in int ("%s" the operands). */
static const char *fa_mod_cuda_int_form(int op)
{
    switch (op) {
    case FA_MOD_ABS: return "abs(%s)";
    case FA_MOD_MIN: return "min(%s, %s)";
    case FA_MOD_MAX: return "max(%s, %s)";
    case FA_MOD_MOD: return "fa_mod_rem_i(%s, %s)";
    case FA_MOD_FLOOR: return "%s";
    default: return fa_mod_cuda_forms[op];
    }
}

/* The offset of aux read s's element, an index at a time (int or fp32: fa_mod_<off>_i / _f,
 * off "off" for the tensor read, "goff" for its gradient), into t at *at. */
static void fa_mod_cuda_offset(const fa_mod_node *s, const int *is_int, const char *off, char *t,
                               size_t cap, size_t *at)
{
    for (int k = 0; k < s->n_args; k++)
        *at += (size_t)snprintf(t + *at, cap - *at, "%sfa_mod_%s_%c(kp, %d, %d, v%d)",
                                k ? " + " : "", off, is_int[s->args[k]] ? 'i' : 'f', s->what, k,
                                s->args[k]);
}

/* Step i's statement into t at *at (cap bytes in all). */
static void fa_mod_cuda_step(const fa_mod *m, const int *is_int, int i, char *t, size_t cap,
                             size_t *at)
{
    const fa_mod_node *s = &m->steps[i];
    char a[FA_MOD_MAX_ARGS][16];
    for (int k = 0; k < FA_MOD_MAX_ARGS; k++)
        snprintf(a[k], sizeof a[k], k < s->n_args ? "v%d" : "0.f", s->args[k]);
    *at += (size_t)snprintf(t + *at, cap - *at, "    const %s v%d = ",
                            s->type == FA_MOD_BOOL ? "bool" : is_int[i] ? "int" : "float", i);
    switch (s->op) {
    case FA_MOD_OP_VAR:
        *at += (size_t)snprintf(t + *at, cap - *at, "%s", fa_mod_cuda_vars[s->what]);
        break;
    case FA_MOD_OP_CONST: {
        if (is_int[i]) {
            *at += (size_t)snprintf(t + *at, cap - *at, "%lld", (long long)s->value);
            break;
        }
        const float f = (float)s->value; /* the CPU's (FA_REAL)value */
        unsigned bits;
        memcpy(&bits, &f, sizeof bits);
        *at += (size_t)snprintf(t + *at, cap - *at, "__int_as_float(0x%08x)", bits);
        break;
    }
    case FA_MOD_OP_WHERE:
        *at += (size_t)snprintf(t + *at, cap - *at, "%s ? %s : %s", a[0], a[1], a[2]);
        break;
    case FA_MOD_OP_AUX:
        *at += (size_t)snprintf(t + *at, cap - *at, "fa_mod_aux_at(kp, %d, ", s->what);
        fa_mod_cuda_offset(s, is_int, "off", t, cap, at);
        *at += (size_t)snprintf(t + *at, cap - *at, ")");
        break;
    case FA_MOD_FLOOR:
        if (is_int[i] && !is_int[s->args[0]]) { /* floor division (fa_mod_cuda_floor_div) */
            const fa_mod_node *q = &m->steps[s->args[0]];
            *at += (size_t)snprintf(t + *at, cap - *at, "fa_mod_floordiv_i(v%d, v%d)",
                                    q->args[0], q->args[1]);
            break;
        }
        *at += (size_t)snprintf(t + *at, cap - *at,
                                is_int[i] ? fa_mod_cuda_int_form(s->op) : fa_mod_cuda_forms[s->op],
                                a[0]);
        break;
    default:
        if (is_int[i]) {
            *at += (size_t)snprintf(t + *at, cap - *at, fa_mod_cuda_int_form(s->op), a[0], a[1]);
            break;
        }
        /* Operands as arguments of the form: at most two. */
        *at += (size_t)snprintf(t + *at, cap - *at, fa_mod_cuda_forms[s->op], a[0], a[1]);
        break;
    }
    *at += (size_t)snprintf(t + *at, cap - *at, ";\n");
}

/* Which steps' derivatives are identically 0 (zero[i]): with respect to score (seed < 0), the
 * steps that do not read score, through any operand; with respect to the value of step seed
 * (an aux read), those that do not read that step. */
static void fa_mod_cuda_zero_d(const fa_mod *m, int seed, int *zero)
{
    for (int i = 0; i < m->n_steps; i++) {
        const fa_mod_node *s = &m->steps[i];
        if (i == seed) {
            zero[i] = 0;
            continue;
        }
        if (s->op == FA_MOD_OP_VAR) {
            zero[i] = seed >= 0 || s->what != FA_MOD_SCORE;
            continue;
        }
        /* Operations without a rule have derivative 0 (fa_mod_grad.h). */
        const int ruled = s->op <= FA_MOD_OP_WHERE && fa_mod_cuda_grads[s->op];
        zero[i] = 1;
        for (int k = 0; ruled && k < s->n_args; k++)
            zero[i] = zero[i] && zero[s->args[k]];
    }
}

/* The rule of step i in the form the kernels take: an operand whose derivative is 0 drops the
 * terms it multiplies (the compiler may not: 0 * inf is NaN), division is fa_mod_div's (the
 * values' own, so the slow path of an exact quotient stays out of the backward's loop), and
 * exp and tanh reuse the step's value v<i>. NULL: fa_mod_grad.h's rule as written. */
static const char *fa_mod_cuda_drule(const fa_mod_node *s, const int *zero, int i, char *buf,
                                     size_t cap)
{
    const int zx = s->n_args > 0 && zero[s->args[0]], zy = s->n_args > 1 && zero[s->args[1]];
    const char *form = NULL;
    switch (s->op) {
    case FA_MOD_ADD: form = zy ? "dx" : zx ? "dy" : NULL; break;
    case FA_MOD_SUB: form = zy ? "dx" : zx ? "-dy" : NULL; break;
    case FA_MOD_MUL: form = zy ? "dx * y" : zx ? "x * dy" : NULL; break;
    case FA_MOD_DIV:
        form = zy ? "fa_mod_div(dx, y)"
             : zx ? "-fa_mod_div(fa_mod_div(x, y) * dy, y)"
                  : "fa_mod_div(dx - fa_mod_div(x, y) * dy, y)";
        break;
    case FA_MOD_LOG: form = "fa_mod_div(dx, x)"; break;
    case FA_MOD_SQRT: form = "fa_mod_div(dx, 2 * FA_MOD_D_SQRT(x))"; break;
    case FA_MOD_EXP: snprintf(buf, cap, "v%d * dx", i); return buf;
    case FA_MOD_TANH: snprintf(buf, cap, "(1 - FA_MOD_D_SQ(v%d)) * dx", i); return buf;
    default: break;
    }
    return form;
}

/* Step i's derivative with respect to score or step seed (fa_mod_cuda_zero_d's), d<i>, into t
 * at *at: its rule with the operands' values and derivatives bound to the rule's names (missing
 * operands 0), else 0 or, for the variable score or the seed, 1. */
static void fa_mod_cuda_dstep(const fa_mod *m, const int *zero, int seed, int i, char *t,
                              size_t cap, size_t *at)
{
    const fa_mod_node *s = &m->steps[i];
    if (zero[i] || s->op == FA_MOD_OP_VAR || i == seed) {
        *at += (size_t)snprintf(t + *at, cap - *at, "    const float d%d = %s;\n", i,
                                zero[i] ? "0.f" : "1.f");
        return;
    }
    char v[3][16], d[3][16], buf[64];
    for (int k = 0; k < 3; k++) {
        snprintf(v[k], sizeof v[k], k < s->n_args ? "(float)v%d" : "0.f", s->args[k]);
        snprintf(d[k], sizeof d[k], k < s->n_args ? "d%d" : "0.f", s->args[k]);
    }
    const char *rule = fa_mod_cuda_drule(s, zero, i, buf, sizeof buf);
    *at += (size_t)snprintf(t + *at, cap - *at,
                            "    float d%d;\n    {\n        const float x = %s, y = %s, dx = %s, "
                            "dy = %s, dz = %s;\n        (void)x, (void)y, (void)dx, (void)dy, "
                            "(void)dz;\n        d%d = %s;\n    }\n    (void)d%d;\n",
                            i, v[0], v[1], d[0], d[1], d[2], i,
                            rule ? rule : fa_mod_cuda_grads[s->op], i);
}

/* The function's statements and return into t at *at: values, with their derivatives when
 * grad (the derivative of the root into *dscore). */
static void fa_mod_cuda_body(const fa_mod *m, int grad, char *t, size_t cap, size_t *at)
{
    const int score = m->kind == FA_MOD_KIND_SCORE;
    int is_int[FA_MOD_MAX_NODES], zero[FA_MOD_MAX_NODES];
    fa_mod_cuda_ints(m, is_int);
    fa_mod_cuda_zero_d(m, -1, zero);
    for (int i = 0; i < m->n_steps; i++) {
        fa_mod_cuda_step(m, is_int, i, t, cap, at);
        if (grad)
            fa_mod_cuda_dstep(m, zero, -1, i, t, cap, at);
    }
    if (grad)
        *at += (size_t)snprintf(t + *at, cap - *at, "    *dscore = d%d;\n", m->n_steps - 1);
    *at += (size_t)snprintf(t + *at, cap - *at,
                            "    (void)kp, %s(void)b, (void)h, (void)q_idx, (void)kv_idx;\n"
                            "    return v%d;\n}\n",
                            score ? "(void)score, " : "", m->n_steps - 1);
}

/* Whether a score_mod is score + term or score - term with a term that does not read score
 * (zero: fa_mod_cuda_zero_d): *term its step, *neg whether it is subtracted. The kernels then
 * add the term to the score in base 2 (fa_score_mod_base2 in kernels/fa_mod.cuh). */
static int fa_mod_cuda_additive(const fa_mod *m, const int *zero, int *term, int *neg)
{
    const fa_mod_node *r = &m->steps[m->n_steps - 1];
    if ((r->op != FA_MOD_ADD && r->op != FA_MOD_SUB) || r->type == FA_MOD_BOOL)
        return 0;
    for (int k = 0; k < 2; k++) {
        const fa_mod_node *x = &m->steps[r->args[k]];
        const int t = r->args[1 - k];
        /* term - score is not: its derivative is -1 */
        if (x->op == FA_MOD_OP_VAR && x->what == FA_MOD_SCORE && zero[t] &&
            m->steps[t].type != FA_MOD_BOOL && (k == 0 || r->op == FA_MOD_ADD)) {
            *term = t;
            *neg = r->op == FA_MOD_SUB;
            return 1;
        }
    }
    return 0;
}

/* fa_score_mod_term for an additive score_mod (fa_mod_cuda_additive): the steps that do not
 * read score, the term returned with its sign, as fp32. */
static void fa_mod_cuda_term(const fa_mod *m, const int *zero, int term, int neg, char *t,
                             size_t cap, size_t *at)
{
    int is_int[FA_MOD_MAX_NODES];
    fa_mod_cuda_ints(m, is_int);
    *at += (size_t)snprintf(t + *at, cap - *at,
                            "#define FA_SCORE_MOD_ADDITIVE 1\n"
                            "FA_DEV float fa_score_mod_term(const fa_kparams *kp, int b, int h, "
                            "int q_idx, int kv_idx)\n{\n");
    for (int i = 0; i <= term; i++)
        if (zero[i])
            fa_mod_cuda_step(m, is_int, i, t, cap, at);
    *at += (size_t)snprintf(t + *at, cap - *at,
                            "    (void)kp, (void)b, (void)h, (void)q_idx, (void)kv_idx;\n"
                            "    return %s(float)v%d;\n}\n",
                            neg ? "-" : "", term);
}

/* fa_score_mod_aux_grad: score_mod's values, then for each aux read, in a block compiled where
 * the plan's FA_MOD_AUX_GRAD asks for its slot's gradient, the root's derivative with respect
 * to the value read (forward mode, seeded there) times g added at the element's place in the
 * gradient: where the indices read neither q_idx, kv_idx nor score (every element of the
 * caller's tile then reads the same one), summed in the caller's sum[read] from its first
 * element to its last and added over the warp (fa_mod_aux_grad_sum); else fa_mod_aux_grad_pair
 * with the caller's held elements from[read] / to[read]. FA_MOD_AUX_READS of each; read is the
 * aux read's number in step order. */
static void fa_mod_cuda_aux_grad(const fa_mod *m, char *t, size_t cap, size_t *at)
{
    int is_int[FA_MOD_MAX_NODES], zero[FA_MOD_MAX_NODES];
    fa_mod_cuda_ints(m, is_int);
    int reads = 0;
    for (int r = 0; r < m->n_steps; r++)
        reads += m->steps[r].op == FA_MOD_OP_AUX;
    *at += (size_t)snprintf(t + *at, cap - *at,
                            "#define FA_MOD_AUX_READS %d\n"
                            "FA_DEV void fa_score_mod_aux_grad(const fa_kparams *kp, float score, "
                            "int b, int h, int q_idx, int kv_idx, float g, "
                            "const fa_mod_aux_held *from, fa_mod_aux_held *to, "
                            "fa_mod_aux_held *sum, int first, int last)\n{\n",
                            reads > 0 ? reads : 1);
    for (int i = 0; i < m->n_steps; i++)
        fa_mod_cuda_step(m, is_int, i, t, cap, at);
    for (int r = 0, n = 0; r < m->n_steps; r++) {
        const fa_mod_node *s = &m->steps[r];
        if (s->op != FA_MOD_OP_AUX)
            continue;
        const int read = n++;
        unsigned vary = 0;
        for (int k = 0; k < s->n_args; k++)
            vary |= m->vary[s->args[k]];
        *at += (size_t)snprintf(t + *at, cap - *at,
                                "#if (FA_MOD_AUX_GRAD >> %d) & 1\n    {\n"
                                "    const fa_mod_off go = ", s->what);
        fa_mod_cuda_offset(s, is_int, "goff", t, cap, at);
        *at += (size_t)snprintf(t + *at, cap - *at, ";\n");
        fa_mod_cuda_zero_d(m, r, zero);
        for (int i = 0; i < m->n_steps; i++)
            fa_mod_cuda_dstep(m, zero, r, i, t, cap, at);
        if (vary == 0)
            *at += (size_t)snprintf(t + *at, cap - *at,
                                    "    fa_mod_aux_grad_sum(kp, %d, go, g != 0.f ? g * d%d : 0.f, "
                                    "sum + %d, first, last);\n",
                                    s->what, m->n_steps - 1, read);
        else
            *at += (size_t)snprintf(t + *at, cap - *at,
                                    "    fa_mod_aux_grad_pair(kp, %d, go, g != 0.f ? g * d%d : 0.f, "
                                    "from ? from + %d : 0, to ? to + %d : 0);\n",
                                    s->what, m->n_steps - 1, read, read);
        *at += (size_t)snprintf(t + *at, cap - *at, "    }\n#endif\n");
    }
    *at += (size_t)snprintf(t + *at, cap - *at,
                            "    (void)kp, (void)score, (void)b, (void)h, (void)q_idx, "
                            "(void)kv_idx, (void)g, (void)from, (void)to, (void)sum, "
                            "(void)first, (void)last;\n}\n");
}

fa_status fa_mod_emit_cuda(fa_mod *m)
{
    const int score = m->kind == FA_MOD_KIND_SCORE;
    /* A step's value line and, for a score_mod, its value again, its derivative's block,
     * additive its value a third time, its value for fa_mod_cuda_aux_grad and there, for each
     * aux read, its derivative's block once more. */
    int reads = 0;
    for (int i = 0; i < m->n_steps; i++)
        reads += m->steps[i].op == FA_MOD_OP_AUX;
    const size_t cap = 1024 + strlen(m->text) +
                       (size_t)m->n_steps * (score ? 1536 + 512 * (size_t)reads : 256);
    char *t = malloc(cap);
    if (!t)
        return fa_error_set(FA_STATUS_OUT_OF_MEMORY, "fa_mod_finish: out of memory");
    /* A mask_mod does not read the score (fa_mod_finish refuses it), so takes none. */
    size_t at = (size_t)snprintf(t, cap,
                                 "/* %s */\n"
                                 "FA_DEV %s fa_%s_mod(const fa_kparams *kp, %sint b, int h, "
                                 "int q_idx, int kv_idx)\n{\n",
                                 m->text, score ? "float" : "bool", score ? "score" : "mask",
                                 score ? "float score, " : "");
    fa_mod_cuda_body(m, 0, t, cap, &at);
    if (score) {
        at += (size_t)snprintf(t + at, cap - at,
                               "FA_DEV float fa_score_mod_grad(const fa_kparams *kp, float score, "
                               "int b, int h, int q_idx, int kv_idx, float *dscore)\n{\n");
        fa_mod_cuda_body(m, 1, t, cap, &at);
        int zero[FA_MOD_MAX_NODES], term, neg;
        fa_mod_cuda_zero_d(m, -1, zero);
        if (fa_mod_cuda_additive(m, zero, &term, &neg))
            fa_mod_cuda_term(m, zero, term, neg, t, cap, &at);
        fa_mod_cuda_aux_grad(m, t, cap, &at);
    }
    free(m->cuda);
    m->cuda = t;
    return FA_STATUS_OK;
}
