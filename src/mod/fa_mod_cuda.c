/*
 * The CUDA C of a finished fa_mod program (fa_mod.h): one device function per program, a
 * statement per step, in the CPU evaluator's arithmetic (fa_cpu_mod_body.h) operator by
 * operator (but division, within 2 ulp: fa_mod_div): fp32 values, booleans as bool, constants as the bits of their fp32 value, aux reads
 * through the kernel's fa_mod_aux (indices floored and clamped into the tensor). The kernels
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
    [FA_MOD_TANH] = "tanhf(%s)",
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

/* Step i's statement into t at *at (cap bytes in all). */
static void fa_mod_cuda_step(const fa_mod *m, int i, char *t, size_t cap, size_t *at)
{
    const fa_mod_node *s = &m->steps[i];
    char a[FA_MOD_MAX_ARGS][16];
    for (int k = 0; k < FA_MOD_MAX_ARGS; k++)
        snprintf(a[k], sizeof a[k], k < s->n_args ? "v%d" : "0.f", s->args[k]);
    *at += (size_t)snprintf(t + *at, cap - *at, "    const %s v%d = ",
                            s->type == FA_MOD_BOOL ? "bool" : "float", i);
    switch (s->op) {
    case FA_MOD_OP_VAR:
        *at += (size_t)snprintf(t + *at, cap - *at, "%s", fa_mod_cuda_vars[s->what]);
        break;
    case FA_MOD_OP_CONST: {
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
        *at += (size_t)snprintf(t + *at, cap - *at, "fa_mod_aux(kp, %d, %d, %s, %s, %s, %s)",
                                s->what, s->n_args, a[0], a[1], a[2], a[3]);
        break;
    default:
        /* Operands as arguments of the form: at most two. */
        *at += (size_t)snprintf(t + *at, cap - *at, fa_mod_cuda_forms[s->op], a[0], a[1]);
        break;
    }
    *at += (size_t)snprintf(t + *at, cap - *at, ";\n");
}

/* Step i's derivative with respect to score, d<i>, into t at *at: its rule with the operands'
 * values and derivatives bound to the rule's names (missing operands 0), else 0 or, for the
 * variable score, 1. */
static void fa_mod_cuda_dstep(const fa_mod *m, int i, char *t, size_t cap, size_t *at)
{
    const fa_mod_node *s = &m->steps[i];
    const char *rule = s->op <= FA_MOD_OP_WHERE ? fa_mod_cuda_grads[s->op] : NULL;
    if (s->op == FA_MOD_OP_VAR || !rule) {
        const int one = s->op == FA_MOD_OP_VAR && s->what == FA_MOD_SCORE;
        *at += (size_t)snprintf(t + *at, cap - *at, "    const float d%d = %s;\n", i,
                                one ? "1.f" : "0.f");
        return;
    }
    char v[3][16], d[3][16];
    for (int k = 0; k < 3; k++) {
        snprintf(v[k], sizeof v[k], k < s->n_args ? "(float)v%d" : "0.f", s->args[k]);
        snprintf(d[k], sizeof d[k], k < s->n_args ? "d%d" : "0.f", s->args[k]);
    }
    *at += (size_t)snprintf(t + *at, cap - *at,
                            "    float d%d;\n    {\n        const float x = %s, y = %s, dx = %s, "
                            "dy = %s, dz = %s;\n        (void)x, (void)y, (void)dx, (void)dy, "
                            "(void)dz;\n        d%d = %s;\n    }\n    (void)d%d;\n",
                            i, v[0], v[1], d[0], d[1], d[2], i, rule, i);
}

/* The function's statements and return into t at *at: values, with their derivatives when
 * grad (the derivative of the root into *dscore). */
static void fa_mod_cuda_body(const fa_mod *m, int grad, char *t, size_t cap, size_t *at)
{
    const int score = m->kind == FA_MOD_KIND_SCORE;
    for (int i = 0; i < m->n_steps; i++) {
        fa_mod_cuda_step(m, i, t, cap, at);
        if (grad)
            fa_mod_cuda_dstep(m, i, t, cap, at);
    }
    if (grad)
        *at += (size_t)snprintf(t + *at, cap - *at, "    *dscore = d%d;\n", m->n_steps - 1);
    *at += (size_t)snprintf(t + *at, cap - *at,
                            "    (void)kp, %s(void)b, (void)h, (void)q_idx, (void)kv_idx;\n"
                            "    return v%d;\n}\n",
                            score ? "(void)score, " : "", m->n_steps - 1);
}

fa_status fa_mod_emit_cuda(fa_mod *m)
{
    const int score = m->kind == FA_MOD_KIND_SCORE;
    /* A step's value line and, for a score_mod, its value again and its derivative's block. */
    const size_t cap = 1024 + strlen(m->text) + (size_t)m->n_steps * (score ? 512 : 96);
    char *t = malloc(cap);
    if (!t)
        return fa_error_set(FA_STATUS_OUT_OF_MEMORY, "fa_mod_finish: out of memory");
    /* A mask_mod does not read the score (fa_mod_finish refuses it), so takes none. */
    size_t at = (size_t)snprintf(t, cap,
                                 "/* %s */\n"
                                 "FA_DEV %s fa_%s_mod(const fa_kparams *kp, %sfloat b, float h, "
                                 "float q_idx, float kv_idx)\n{\n",
                                 m->text, score ? "float" : "bool", score ? "score" : "mask",
                                 score ? "float score, " : "");
    fa_mod_cuda_body(m, 0, t, cap, &at);
    if (score) {
        at += (size_t)snprintf(t + at, cap - at,
                               "FA_DEV float fa_score_mod_grad(const fa_kparams *kp, float score, "
                               "float b, float h, float q_idx, float kv_idx, float *dscore)\n{\n");
        fa_mod_cuda_body(m, 1, t, cap, &at);
    }
    free(m->cuda);
    m->cuda = t;
    return FA_STATUS_OK;
}
