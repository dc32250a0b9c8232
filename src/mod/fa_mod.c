/*
 * The fa_mod builder: nodes are interned (an identical node returns the existing id), so the
 * post-order walk from the root that fa_mod_finish makes gives one canonical program and text
 * for an expression whatever order it was built in. The text parser rebuilds through the same
 * builder calls, so parsed programs pass the same checks.
 */
#define _POSIX_C_SOURCE 200809L /* strtok_r, strdup */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/fa_check.h"
#include "mod/fa_mod.h"
#include "mod/fa_mod_cuda.h"
#include "util/fa_export.h"

/* Name, operand count and types of each operation; FA_MOD_OP_* after the public ones. */
typedef struct fa_mod_opinfo {
    const char *name;
    int arity;
    int arg_type; /* of every operand (where: of the condition) */
    int type;     /* of the result */
} fa_mod_opinfo;

static const fa_mod_opinfo fa_mod_ops[] = {
    [FA_MOD_NEG] = {"neg", 1, FA_MOD_NUM, FA_MOD_NUM},
    [FA_MOD_EXP] = {"exp", 1, FA_MOD_NUM, FA_MOD_NUM},
    [FA_MOD_LOG] = {"log", 1, FA_MOD_NUM, FA_MOD_NUM},
    [FA_MOD_TANH] = {"tanh", 1, FA_MOD_NUM, FA_MOD_NUM},
    [FA_MOD_ABS] = {"abs", 1, FA_MOD_NUM, FA_MOD_NUM},
    [FA_MOD_SQRT] = {"sqrt", 1, FA_MOD_NUM, FA_MOD_NUM},
    [FA_MOD_FLOOR] = {"floor", 1, FA_MOD_NUM, FA_MOD_NUM},
    [FA_MOD_NOT] = {"not", 1, FA_MOD_BOOL, FA_MOD_BOOL},
    [FA_MOD_ADD] = {"add", 2, FA_MOD_NUM, FA_MOD_NUM},
    [FA_MOD_SUB] = {"sub", 2, FA_MOD_NUM, FA_MOD_NUM},
    [FA_MOD_MUL] = {"mul", 2, FA_MOD_NUM, FA_MOD_NUM},
    [FA_MOD_DIV] = {"div", 2, FA_MOD_NUM, FA_MOD_NUM},
    [FA_MOD_MIN] = {"min", 2, FA_MOD_NUM, FA_MOD_NUM},
    [FA_MOD_MAX] = {"max", 2, FA_MOD_NUM, FA_MOD_NUM},
    [FA_MOD_POW] = {"pow", 2, FA_MOD_NUM, FA_MOD_NUM},
    [FA_MOD_MOD] = {"mod", 2, FA_MOD_NUM, FA_MOD_NUM},
    [FA_MOD_LT] = {"lt", 2, FA_MOD_NUM, FA_MOD_BOOL},
    [FA_MOD_LE] = {"le", 2, FA_MOD_NUM, FA_MOD_BOOL},
    [FA_MOD_GT] = {"gt", 2, FA_MOD_NUM, FA_MOD_BOOL},
    [FA_MOD_GE] = {"ge", 2, FA_MOD_NUM, FA_MOD_BOOL},
    [FA_MOD_EQ] = {"eq", 2, FA_MOD_NUM, FA_MOD_BOOL},
    [FA_MOD_NE] = {"ne", 2, FA_MOD_NUM, FA_MOD_BOOL},
    [FA_MOD_AND] = {"and", 2, FA_MOD_BOOL, FA_MOD_BOOL},
    [FA_MOD_OR] = {"or", 2, FA_MOD_BOOL, FA_MOD_BOOL},
};
#define FA_MOD_N_PUBLIC_OPS ((int)(sizeof fa_mod_ops / sizeof fa_mod_ops[0]))

static const char *const fa_mod_var_names[] = {"score", "b", "h", "q_idx", "kv_idx"};
#define FA_MOD_N_VARS ((int)(sizeof fa_mod_var_names / sizeof fa_mod_var_names[0]))

static const char *fa_mod_type_name(int type)
{
    return type == FA_MOD_BOOL ? "a boolean" : "a number";
}

FA_API fa_mod *fa_mod_create(void)
{
    fa_mod *m = calloc(1, sizeof *m);
    if (!m)
        fa_error_set(FA_STATUS_OUT_OF_MEMORY, "fa_mod_create: out of memory");
    return m;
}

FA_API void fa_mod_destroy(fa_mod *m)
{
    if (!m)
        return;
    free(m->text);
    free(m->cuda);
    free(m);
}

/* The program may still grow: not NULL, not finished. */
static fa_status fa_mod_open(const fa_mod *m, const char *fn)
{
    if (!m)
        return FA_BAD("%s: m is NULL", fn);
    if (m->kind)
        return FA_BAD("%s: the program is finished (fa_mod_finish); build a new one", fn);
    return FA_STATUS_OK;
}

/* Operand `which` of fn is an existing node of the given type. */
static fa_status fa_mod_operand(const fa_mod *m, const char *fn, const char *which, int id,
                                int type)
{
    if (id < 0 || id >= m->n)
        return FA_BAD("%s: %s is %d, not a node of this program (ids 0 .. %d)", fn, which, id,
                      m->n - 1);
    if (type >= 0 && m->nodes[id].type != type)
        return FA_BAD("%s: %s (node %d) is %s, but must be %s", fn, which, id,
                      fa_mod_type_name(m->nodes[id].type), fa_mod_type_name(type));
    return FA_STATUS_OK;
}

static int fa_mod_same(const fa_mod_node *a, const fa_mod_node *b)
{
    if (a->op != b->op || a->n_args != b->n_args || a->what != b->what)
        return 0;
    for (int i = 0; i < a->n_args; i++)
        if (a->args[i] != b->args[i])
            return 0;
    return memcmp(&a->value, &b->value, sizeof a->value) == 0; /* bits: -0 and NaNs stay apart */
}

/* The id of node (an existing identical node's, else a new one). */
static int fa_mod_intern(fa_mod *m, const char *fn, fa_mod_node node)
{
    for (int i = 0; i < m->n; i++)
        if (fa_mod_same(&m->nodes[i], &node))
            return i;
    if (m->n >= FA_MOD_MAX_NODES) {
        FA_BAD("%s: the program already has FA_MOD_MAX_NODES (%d) nodes", fn, FA_MOD_MAX_NODES);
        return -1;
    }
    m->nodes[m->n] = node;
    return m->n++;
}

FA_API int fa_mod_var(fa_mod *m, fa_mod_variable var)
{
    if (fa_mod_open(m, "fa_mod_var") != FA_STATUS_OK)
        return -1;
    if ((int)var < 0 || (int)var >= FA_MOD_N_VARS) {
        FA_BAD("fa_mod_var: var is %d, not an fa_mod_variable (FA_MOD_SCORE .. FA_MOD_KV_IDX)",
               (int)var);
        return -1;
    }
    return fa_mod_intern(m, "fa_mod_var",
                         (fa_mod_node){.op = FA_MOD_OP_VAR, .type = FA_MOD_NUM, .what = var});
}

FA_API int fa_mod_const(fa_mod *m, double value)
{
    if (fa_mod_open(m, "fa_mod_const") != FA_STATUS_OK)
        return -1;
    return fa_mod_intern(m, "fa_mod_const",
                         (fa_mod_node){.op = FA_MOD_OP_CONST, .type = FA_MOD_NUM, .value = value});
}

/* A unary (arity 1) or binary (2) operation with its operands checked against the table. */
static int fa_mod_apply(fa_mod *m, const char *fn, int arity, fa_mod_op op, const int *args)
{
    if (fa_mod_open(m, fn) != FA_STATUS_OK)
        return -1;
    if ((int)op < 0 || (int)op >= FA_MOD_N_PUBLIC_OPS || fa_mod_ops[op].arity != arity) {
        FA_BAD("%s: op %d is not a %s operation", fn, (int)op, arity == 1 ? "unary" : "binary");
        return -1;
    }
    const fa_mod_opinfo *info = &fa_mod_ops[op];
    fa_mod_node node = {.op = op, .type = info->type, .n_args = arity};
    for (int i = 0; i < arity; i++) {
        char which[32];
        snprintf(which, sizeof which, "operand %d of %s", i + 1, info->name);
        if (fa_mod_operand(m, fn, which, args[i], info->arg_type) != FA_STATUS_OK)
            return -1;
        node.args[i] = args[i];
    }
    return fa_mod_intern(m, fn, node);
}

FA_API int fa_mod_unary(fa_mod *m, fa_mod_op op, int a)
{
    return fa_mod_apply(m, "fa_mod_unary", 1, op, &a);
}

FA_API int fa_mod_binary(fa_mod *m, fa_mod_op op, int a, int b)
{
    const int args[2] = {a, b};
    return fa_mod_apply(m, "fa_mod_binary", 2, op, args);
}

FA_API int fa_mod_where(fa_mod *m, int cond, int a, int b)
{
    const char *fn = "fa_mod_where";
    if (fa_mod_open(m, fn) != FA_STATUS_OK ||
        fa_mod_operand(m, fn, "cond", cond, FA_MOD_BOOL) != FA_STATUS_OK ||
        fa_mod_operand(m, fn, "a", a, -1) != FA_STATUS_OK ||
        fa_mod_operand(m, fn, "b", b, m->nodes[a].type) != FA_STATUS_OK)
        return -1;
    return fa_mod_intern(m, fn,
                         (fa_mod_node){.op = FA_MOD_OP_WHERE, .type = m->nodes[a].type,
                                       .n_args = 3, .args = {cond, a, b}});
}

FA_API int fa_mod_aux(fa_mod *m, int slot, int ndim, const int *index)
{
    const char *fn = "fa_mod_aux";
    if (fa_mod_open(m, fn) != FA_STATUS_OK)
        return -1;
    if (slot < 0 || slot >= FA_MOD_AUX_SLOTS) {
        FA_BAD("%s: slot is %d, must be in [0, %d)", fn, slot, FA_MOD_AUX_SLOTS);
        return -1;
    }
    if (ndim < 1 || ndim > FA_MOD_MAX_ARGS) {
        FA_BAD("%s: ndim is %d, must be in [1, %d]", fn, ndim, FA_MOD_MAX_ARGS);
        return -1;
    }
    if (!index) {
        FA_BAD("%s: index is NULL (needs ndim = %d node ids)", fn, ndim);
        return -1;
    }
    fa_mod_node node = {.op = FA_MOD_OP_AUX, .type = FA_MOD_NUM, .n_args = ndim, .what = slot};
    for (int i = 0; i < ndim; i++) {
        char which[32];
        snprintf(which, sizeof which, "index[%d]", i);
        if (fa_mod_operand(m, fn, which, index[i], FA_MOD_NUM) != FA_STATUS_OK)
            return -1;
        node.args[i] = index[i];
    }
    for (int i = 0; i < m->n; i++)
        if (m->nodes[i].op == FA_MOD_OP_AUX && m->nodes[i].what == slot &&
            m->nodes[i].n_args != ndim) {
            FA_BAD("%s: slot %d is read with %d indices by node %d, so it cannot be read with "
                   "ndim = %d",
                   fn, slot, m->nodes[i].n_args, i, ndim);
            return -1;
        }
    return fa_mod_intern(m, fn, node);
}

/* ---- finishing ------------------------------------------------------------------------- */

static const char *fa_mod_op_name(const fa_mod_node *n, char *buf, size_t size)
{
    switch (n->op) {
    case FA_MOD_OP_VAR:
        return fa_mod_var_names[n->what];
    case FA_MOD_OP_CONST:
        return "const";
    case FA_MOD_OP_WHERE:
        return "where";
    case FA_MOD_OP_AUX:
        snprintf(buf, size, "aux%d", n->what);
        return buf;
    default:
        return fa_mod_ops[n->op].name;
    }
}

/* Post-order from id: operands (in order) before their user, each node once. */
static void fa_mod_walk(fa_mod *m, int id, int *step_of)
{
    if (step_of[id] >= 0)
        return;
    const fa_mod_node *n = &m->nodes[id];
    for (int i = 0; i < n->n_args; i++)
        fa_mod_walk(m, n->args[i], step_of);
    fa_mod_node s = *n;
    for (int i = 0; i < s.n_args; i++)
        s.args[i] = step_of[n->args[i]];
    step_of[id] = m->n_steps;
    m->steps[m->n_steps++] = s;
}

/* Appends the canonical text of the finished program to a new string. */
static fa_status fa_mod_make_text(fa_mod *m)
{
    const size_t cap = 64 + (size_t)m->n_steps * 48;
    char *t = malloc(cap);
    if (!t)
        return fa_error_set(FA_STATUS_OUT_OF_MEMORY, "fa_mod_finish: out of memory");
    size_t at = (size_t)snprintf(t, cap, "%s:", m->kind == FA_MOD_KIND_SCORE ? "score" : "mask");
    for (int i = 0; i < m->n_steps; i++) {
        const fa_mod_node *s = &m->steps[i];
        char name[8];
        at += (size_t)snprintf(t + at, cap - at, "%s %s", i ? ";" : "",
                               fa_mod_op_name(s, name, sizeof name));
        if (s->op == FA_MOD_OP_CONST) {
            const double v = s->value;
            uint64_t bits;
            memcpy(&bits, &v, sizeof bits);
            /* Integers print as such; anything else (and -0) as its exact bits. */
            if (v > -9007199254740992.0 && v < 9007199254740992.0 && v == (double)(int64_t)v &&
                !(v == 0 && (bits >> 63)))
                at += (size_t)snprintf(t + at, cap - at, " %" PRId64, (int64_t)v);
            else
                at += (size_t)snprintf(t + at, cap - at, " 0x%016" PRIx64, bits);
        }
        for (int a = 0; a < s->n_args; a++)
            at += (size_t)snprintf(t + at, cap - at, " $%d", s->args[a]);
    }
    free(m->text);
    m->text = t;
    return FA_STATUS_OK;
}

FA_API fa_status fa_mod_finish(fa_mod *m, int root, fa_mod_kind kind)
{
    const char *fn = "fa_mod_finish";
    FA_TRY(fa_mod_open(m, fn));
    if (kind != FA_MOD_KIND_SCORE && kind != FA_MOD_KIND_MASK)
        return FA_BAD("%s: kind is %d, must be FA_MOD_KIND_SCORE or FA_MOD_KIND_MASK", fn,
                      (int)kind);
    const int want = kind == FA_MOD_KIND_SCORE ? FA_MOD_NUM : FA_MOD_BOOL;
    FA_TRY(fa_mod_operand(m, fn, kind == FA_MOD_KIND_SCORE ? "root of a score_mod"
                                                           : "root of a mask_mod",
                          root, want));
    int step_of[FA_MOD_MAX_NODES];
    for (int i = 0; i < m->n; i++)
        step_of[i] = -1;
    m->n_steps = 0;
    fa_mod_walk(m, root, step_of);
    for (int i = 0; i < FA_MOD_AUX_SLOTS; i++)
        m->aux_ndim[i] = 0;
    for (int i = 0; i < m->n_steps; i++) {
        const fa_mod_node *s = &m->steps[i];
        if (kind == FA_MOD_KIND_MASK && s->op == FA_MOD_OP_VAR && s->what == FA_MOD_SCORE)
            return FA_BAD("%s: a mask_mod may not read score (the mask must not depend on the "
                          "scores); use a score_mod",
                          fn);
        if (s->op == FA_MOD_OP_AUX)
            m->aux_ndim[s->what] = s->n_args;
    }
    fa_mod_layout(m);
    m->kind = kind;
    fa_status st = fa_mod_make_text(m);
    if (st == FA_STATUS_OK)
        st = fa_mod_emit_cuda(m);
    if (st != FA_STATUS_OK)
        m->kind = 0;
    return st;
}

FA_API const char *fa_mod_text(const fa_mod *m)
{
    if (!m) {
        FA_BAD("fa_mod_text: m is NULL");
        return NULL;
    }
    if (!m->kind) {
        FA_BAD("fa_mod_text: the program is not finished (call fa_mod_finish first)");
        return NULL;
    }
    return m->text;
}

/* ---- parsing --------------------------------------------------------------------------- */

/* One statement "op args" of the text, number i, into m (ids[j]: the node of statement j). */
static fa_status fa_mod_parse_statement(fa_mod *m, char *stmt, int i, const int *ids, int *id)
{
    const char *fn = "fa_mod_parse";
    char *save = NULL;
    const char *op = strtok_r(stmt, " \t\n", &save);
    if (!op)
        return FA_BAD("%s: statement %d is empty", fn, i);
    const char *tok;
    int args[FA_MOD_MAX_ARGS + 1], n_args = 0;
    double value = 0;
    int have_value = 0;
    while ((tok = strtok_r(NULL, " \t\n", &save)) != NULL) {
        if (tok[0] == '$') {
            char *end;
            errno = 0;
            long j = strtol(tok + 1, &end, 10);
            if (*end || end == tok + 1 || errno || j < 0 || j >= i)
                return FA_BAD("%s: statement %d (%s): operand '%s' must be $j with j < %d", fn,
                              i, op, tok, i);
            if (n_args == FA_MOD_MAX_ARGS + 1)
                return FA_BAD("%s: statement %d (%s): too many operands", fn, i, op);
            args[n_args++] = ids[j];
        } else if (strcmp(op, "const") == 0 && !have_value) {
            char *end;
            errno = 0;
            if (tok[0] == '0' && tok[1] == 'x') {
                uint64_t bits = strtoull(tok + 2, &end, 16);
                if (*end || strlen(tok) != 18 || errno)
                    return FA_BAD("%s: statement %d: '%s' is not 0x and 16 hex digits", fn, i,
                                  tok);
                memcpy(&value, &bits, sizeof value);
            } else {
                long long v = strtoll(tok, &end, 10);
                if (*end || end == tok || errno)
                    return FA_BAD("%s: statement %d: '%s' is not an integer constant", fn, i,
                                  tok);
                value = (double)v;
            }
            have_value = 1;
        } else {
            return FA_BAD("%s: statement %d (%s): unexpected '%s'", fn, i, op, tok);
        }
    }
    int want = -1; /* operand count the op needs */
    if (strcmp(op, "const") == 0) {
        if (!have_value || n_args)
            return FA_BAD("%s: statement %d: const needs one value and no operands", fn, i);
        *id = fa_mod_const(m, value);
    } else if (strcmp(op, "where") == 0) {
        want = 3;
        if (n_args == want)
            *id = fa_mod_where(m, args[0], args[1], args[2]);
    } else if (strncmp(op, "aux", 3) == 0 && op[3] >= '0' && op[3] <= '9' && !op[4]) {
        if (n_args < 1 || n_args > FA_MOD_MAX_ARGS)
            return FA_BAD("%s: statement %d (%s): needs 1 to %d indices, got %d", fn, i, op,
                          FA_MOD_MAX_ARGS, n_args);
        *id = fa_mod_aux(m, op[3] - '0', n_args, args);
    } else {
        int found = 0;
        for (int v = 0; v < FA_MOD_N_VARS && !found; v++)
            if (strcmp(op, fa_mod_var_names[v]) == 0) {
                found = 1;
                want = 0;
                if (n_args == 0)
                    *id = fa_mod_var(m, (fa_mod_variable)v);
            }
        for (int o = 0; o < FA_MOD_N_PUBLIC_OPS && !found; o++)
            if (strcmp(op, fa_mod_ops[o].name) == 0) {
                found = 1;
                want = fa_mod_ops[o].arity;
                if (n_args == want)
                    *id = want == 1 ? fa_mod_unary(m, (fa_mod_op)o, args[0])
                                    : fa_mod_binary(m, (fa_mod_op)o, args[0], args[1]);
            }
        if (!found)
            return FA_BAD("%s: statement %d: unknown operation '%s'", fn, i, op);
    }
    if (want >= 0 && n_args != want)
        return FA_BAD("%s: statement %d (%s): needs %d operands, got %d", fn, i, op, want,
                      n_args);
    if (*id >= 0)
        return FA_STATUS_OK;
    char why[512]; /* the builder's message, copied: the error buffer is rewritten below */
    snprintf(why, sizeof why, "%s", fa_last_error());
    return FA_BAD("%s: statement %d: %s", fn, i, why);
}

static fa_status fa_mod_parse_into(fa_mod *m, char *text)
{
    const char *fn = "fa_mod_parse";
    char *colon = strchr(text, ':');
    if (!colon)
        return FA_BAD("%s: the text must start with 'score:' or 'mask:'", fn);
    *colon = 0;
    fa_mod_kind kind;
    if (strcmp(text, "score") == 0)
        kind = FA_MOD_KIND_SCORE;
    else if (strcmp(text, "mask") == 0)
        kind = FA_MOD_KIND_MASK;
    else
        return FA_BAD("%s: kind '%s' is neither 'score' nor 'mask'", fn, text);
    int ids[FA_MOD_MAX_NODES], n = 0;
    char *stmt = colon + 1;
    if (!stmt[strspn(stmt, " \t\n")])
        return FA_BAD("%s: no statements after '%s:'", fn, text);
    for (char *end; stmt; stmt = end ? end + 1 : NULL) {
        if ((end = strchr(stmt, ';')) != NULL) /* split by hand: strtok would skip ";;" */
            *end = 0;
        if (n == FA_MOD_MAX_NODES)
            return FA_BAD("%s: more than FA_MOD_MAX_NODES (%d) statements", fn, FA_MOD_MAX_NODES);
        FA_TRY(fa_mod_parse_statement(m, stmt, n, ids, &ids[n]));
        n++;
    }
    return fa_mod_finish(m, ids[n - 1], kind);
}

FA_API fa_status fa_mod_parse(const char *text, fa_mod **out)
{
    if (!out)
        return FA_BAD("fa_mod_parse: out is NULL");
    *out = NULL;
    if (!text)
        return FA_BAD("fa_mod_parse: text is NULL");
    char *copy = strdup(text);
    fa_mod *m = fa_mod_create();
    fa_status st = copy && m ? fa_mod_parse_into(m, copy)
                             : fa_error_set(FA_STATUS_OUT_OF_MEMORY, "fa_mod_parse: out of memory");
    free(copy);
    if (st != FA_STATUS_OK)
        fa_mod_destroy(m);
    else
        *out = m;
    return st;
}

/* ---- a forward call's mods ------------------------------------------------------------- */

static fa_status fa_mod_check_one(const fa_mod *m, const char *name, fa_mod_kind kind)
{
    if (!m)
        return FA_STATUS_OK;
    if (!m->kind)
        return FA_BAD("%s: the program is not finished (call fa_mod_finish)", name);
    if (m->kind != kind)
        return FA_BAD("%s: is a %s program; finish it with %s", name,
                      m->kind == FA_MOD_KIND_SCORE ? "score" : "mask",
                      kind == FA_MOD_KIND_SCORE ? "FA_MOD_KIND_SCORE" : "FA_MOD_KIND_MASK");
    return FA_STATUS_OK;
}

const char *fa_mod_args_user(const fa_fwd_args *a)
{
    return a->score_mod ? "score_mod" : a->mask_mod ? "mask_mod" : a->block_mask ? "block_mask"
                                                                                  : NULL;
}

fa_status fa_mod_check_call(const fa_fwd_args *a, const fa_mod_dims *dims, fa_mod_call *call)
{
    *call = (fa_mod_call){0};
    static const char *const names[FA_MOD_AUX_SLOTS] = {"mod_aux[0]", "mod_aux[1]",
                                                        "mod_aux[2]", "mod_aux[3]"};
    FA_TRY(fa_mod_check_one(a->score_mod, "score_mod", FA_MOD_KIND_SCORE));
    FA_TRY(fa_mod_check_one(a->mask_mod, "mask_mod", FA_MOD_KIND_MASK));
    const char *user = a->score_mod ? "score_mod" : "mask_mod";
    if ((a->score_mod || a->mask_mod) && a->probs)
        return FA_BAD("probs: cannot be combined with %s", user);
    for (int i = 0; i < FA_MOD_AUX_SLOTS; i++) {
        const fa_tensor *t = a->mod_aux[i];
        const int s = a->score_mod ? a->score_mod->aux_ndim[i] : 0;
        const int k = a->mask_mod ? a->mask_mod->aux_ndim[i] : 0;
        if (s && k && s != k)
            return FA_BAD("%s: score_mod reads it with %d indices, mask_mod with %d", names[i],
                          s, k);
        const int ndim = s ? s : k;
        if (!ndim && t)
            return FA_BAD("%s: given, but neither score_mod nor mask_mod reads it", names[i]);
        if (!ndim)
            continue;
        if (!t)
            return FA_BAD("%s: %s reads it with %d indices, but it is NULL", names[i],
                          s ? "score_mod" : "mask_mod", ndim);
        if (t->ndim != ndim)
            return FA_BAD("%s: %s reads it with %d indices, but it has %d dims", names[i],
                          s ? "score_mod" : "mask_mod", ndim, t->ndim);
        FA_TRY(fa_check_strided(t, names[i], ndim));
        if (t->dtype != FA_DTYPE_I32 && t->dtype != FA_DTYPE_F32)
            return FA_BAD("%s: dtype must be int32 or fp32, got %s", names[i],
                          fa_dtype_name(t->dtype));
        for (int d = 0; d < ndim; d++)
            if (t->shape[d] < 1)
                return FA_BAD("%s: dimension %d is %lld; indices are clamped into it, so it "
                              "must be at least 1",
                              names[i], d, (long long)t->shape[d]);
        call->aux[i] = *t;
    }
    FA_TRY(fa_mod_blocks_check(a, dims, &call->blocks));
    call->score_mod = a->score_mod;
    call->mask_mod = a->mask_mod;
    return FA_STATUS_OK;
}
