/*
 * The CUDA C of a finished fa_mod program (fa_mod.h): one device function per program, a
 * statement per step, in the CPU evaluator's arithmetic (fa_cpu_mod_body.h) operator by
 * operator: fp32 values, booleans as bool, constants as the bits of their fp32 value, aux reads
 * through the kernel's fa_mod_aux (indices floored and clamped into the tensor). The kernels
 * include it as the generated header fa_mod_gen.cuh; the program's canonical text heads it, and
 * the JIT keys the cubin by the whole text.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mod/fa_mod_cuda.h"

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
    [FA_MOD_DIV] = "%s / %s",
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

fa_status fa_mod_emit_cuda(fa_mod *m)
{
    const int score = m->kind == FA_MOD_KIND_SCORE;
    const size_t cap = 512 + strlen(m->text) + (size_t)m->n_steps * 96;
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
    for (int i = 0; i < m->n_steps; i++)
        fa_mod_cuda_step(m, i, t, cap, &at);
    snprintf(t + at, cap - at,
             "    (void)kp, %s(void)b, (void)h, (void)q_idx, (void)kv_idx;\n"
             "    return v%d;\n}\n",
             score ? "(void)score, " : "", m->n_steps - 1);
    free(m->cuda);
    m->cuda = t;
    return FA_STATUS_OK;
}
