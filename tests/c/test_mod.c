/*
 * test_mod: user-defined scoring (fa_mod: score_mod, mask_mod) on the CPU forward.
 *
 * Builder and call errors name the problem; the canonical text reads back to the same text and
 * does not depend on the order a program was built in. Forward runs with mods
 * (test_mod_forward.c) are checked against a double-precision oracle written in plain C from
 * the intended mask or score (not through the library's evaluator), and, where a built-in
 * option means the same (causal, window, softcap, ALiBi), against the library's built-in path.
 * fp32, bf16, fp16, fp64; dense and varlen; GQA; fresh random inputs and poisoned outputs.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flashattn.h"
#include "mod/fa_mod.h"
#include "plan/fa_plan.h"
#include "test_mod.h"
#include "test_util.h"

/* ---- errors --------------------------------------------------------------------------------- */

/* status is not OK and the message contains w1 and w2 (each may be NULL). */
static void expect_error(fa_status st, const char *what, const char *w1, const char *w2)
{
    const char *msg = fa_last_error();
    TU_CHECK(st != FA_STATUS_OK, "%s: accepted", what);
    TU_CHECK(w1 == NULL || strstr(msg, w1), "%s: message '%s' lacks '%s'", what, msg, w1);
    TU_CHECK(w2 == NULL || strstr(msg, w2), "%s: message '%s' lacks '%s'", what, msg, w2);
}

/* A node constructor returned -1 with a message containing w1 and w2. */
#define EXPECT_ID_ERROR(expr, w1, w2)                                                            \
    expect_error((expr) < 0 ? FA_STATUS_INVALID_ARGUMENT : FA_STATUS_OK, #expr, w1, w2)

static void test_builder_errors(void)
{
    tu_where = "builder errors";
    fa_mod *m = fa_mod_create();
    const int q = V(Q_IDX), k = V(KV_IDX), s = V(SCORE), lt = B(LT, q, k);
    TU_CHECK(q >= 0 && k >= 0 && s >= 0 && lt >= 0, "plain nodes failed: %s", fa_last_error());
    TU_CHECK(V(Q_IDX) == q && B(LT, q, k) == lt, "identical nodes are not shared");
    EXPECT_ID_ERROR(B(ADD, lt, q), "operand 1 of add", "boolean");
    EXPECT_ID_ERROR(B(AND, lt, q), "operand 2 of and", "number");
    EXPECT_ID_ERROR(U(EXP, 99), "99", "not a node");
    EXPECT_ID_ERROR(U(EXP, -1), "-1", "not a node");
    EXPECT_ID_ERROR(U(ADD, q), "not a unary", NULL);
    EXPECT_ID_ERROR(B(NEG, q, k), "not a binary", NULL);
    EXPECT_ID_ERROR(fa_mod_var(m, (fa_mod_variable)9), "var", NULL);
    EXPECT_ID_ERROR(fa_mod_where(m, q, q, k), "cond", "boolean");
    EXPECT_ID_ERROR(fa_mod_where(m, lt, q, lt), "b (node", "number");
    EXPECT_ID_ERROR(fa_mod_aux(m, 4, 1, &q), "slot", NULL);
    EXPECT_ID_ERROR(fa_mod_aux(m, 0, 5, &q), "ndim", NULL);
    EXPECT_ID_ERROR(fa_mod_aux(m, 0, 1, &lt), "index[0]", "boolean");
    TU_CHECK(fa_mod_aux(m, 0, 1, &q) >= 0, "aux read failed: %s", fa_last_error());
    const int two[2] = {q, k};
    EXPECT_ID_ERROR(fa_mod_aux(m, 0, 2, two), "slot 0", "1 indices");
    TU_CHECK(fa_mod_text(m) == NULL && strstr(fa_last_error(), "not finished"),
             "text of an unfinished program");
    expect_error(fa_mod_finish(m, q, FA_MOD_KIND_MASK), "mask root a number", "root of a mask_mod",
                 "boolean");
    expect_error(fa_mod_finish(m, lt, FA_MOD_KIND_SCORE), "score root a boolean",
                 "root of a score_mod", "number");
    expect_error(fa_mod_finish(m, 1000, FA_MOD_KIND_SCORE), "root out of range", "1000", NULL);
    expect_error(fa_mod_finish(m, q, (fa_mod_kind)7), "bad kind", "kind", NULL);
    const int reads_score = B(LT, s, C(0));
    expect_error(fa_mod_finish(m, B(AND, lt, reads_score), FA_MOD_KIND_MASK), "mask reads score",
                 "may not read score", NULL);
    TU_CHECK(fa_mod_finish(m, lt, FA_MOD_KIND_MASK) == FA_STATUS_OK, "finish: %s", fa_last_error());
    EXPECT_ID_ERROR(V(H), "finished", NULL);
    expect_error(fa_mod_finish(m, lt, FA_MOD_KIND_MASK), "finish twice", "finished", NULL);
    fa_mod_destroy(m);

    m = fa_mod_create();
    int last = 0;
    for (int i = 0; i < FA_MOD_MAX_NODES; i++)
        last = C(i);
    TU_CHECK(last == FA_MOD_MAX_NODES - 1, "could not build FA_MOD_MAX_NODES nodes");
    TU_CHECK(C(0) == 0, "an existing constant is new");
    EXPECT_ID_ERROR(C(-1), "FA_MOD_MAX_NODES", NULL);
    fa_mod_destroy(m);
    EXPECT_ID_ERROR(fa_mod_var(NULL, FA_MOD_H), "NULL", NULL);
}

static void test_text(void)
{
    tu_where = "text";
    /* One expression built in two orders (and with unused nodes) has one text. */
    fa_mod *m = fa_mod_create(), *m2 = fa_mod_create();
    const int x = C(-0.0), y = C(0.1), z = C(-7);
    (void)x;
    int root = B(ADD, B(MUL, V(SCORE), y), B(MOD, V(KV_IDX), z));
    TU_CHECK(fa_mod_finish(m, root, FA_MOD_KIND_SCORE) == FA_STATUS_OK, "%s", fa_last_error());
    {
        fa_mod *keep = m;
        m = m2;
        const int kk = V(KV_IDX), zz = C(-7), ss = V(SCORE), yy = C(0.1);
        root = B(ADD, B(MUL, ss, yy), B(MOD, kk, zz));
        TU_CHECK(fa_mod_finish(m, root, FA_MOD_KIND_SCORE) == FA_STATUS_OK, "%s", fa_last_error());
        m = keep;
    }
    const char *want = "score: score; const 0x3fb999999999999a; mul $0 $1; kv_idx; const -7; mod "
                       "$3 $4; add $2 $5";
    TU_CHECK(strcmp(fa_mod_text(m), want) == 0, "text '%s', want '%s'", fa_mod_text(m), want);
    TU_CHECK(strcmp(fa_mod_text(m2), want) == 0, "other order: '%s'", fa_mod_text(m2));
    fa_mod *p = NULL;
    TU_CHECK(fa_mod_parse(want, &p) == FA_STATUS_OK && strcmp(fa_mod_text(p), want) == 0,
             "round trip: %s", fa_last_error());
    fa_mod_destroy(p);
    fa_mod_destroy(m);
    fa_mod_destroy(m2);

    /* -0 and NaN constants keep their bits; a where of booleans; aux reads. */
    const char *texts[] = {
        "mask: q_idx; kv_idx; le $0 $1; const 0x8000000000000000; lt $1 $3; where $2 $4 $2",
        "score: score; const 0x7ff8000000000000; add $0 $1",
        "mask: b; aux2 $0; h; q_idx; aux3 $2 $3 $1 $1; eq $1 $4; not $5",
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        p = NULL;
        fa_status st = fa_mod_parse(texts[i], &p);
        TU_CHECK(st == FA_STATUS_OK && strcmp(fa_mod_text(p), texts[i]) == 0,
                 "round trip of '%s' gives '%s' (%s)", texts[i], p ? fa_mod_text(p) : "-",
                 fa_last_error());
        fa_mod_destroy(p);
    }
    static const struct {
        const char *text, *w1, *w2;
    } bad[] = {
        {"q_idx; kv_idx; le $0 $1", "score:", NULL},
        {"masks: q_idx", "masks", NULL},
        {"mask: q_idx; kv_idx; lq $0 $1", "unknown operation 'lq'", NULL},
        {"mask: q_idx; kv_idx; le $0 $2", "$2", "statement 2"},
        {"mask: q_idx; kv_idx; le $0", "needs 2 operands", NULL},
        {"mask: q_idx; kv_idx; add $0 $1", "root of a mask_mod", NULL},
        {"mask: score; const 0; lt $0 $1", "may not read score", NULL},
        {"score: q_idx; const 1.5; add $0 $1", "1.5", NULL},
        {"score: q_idx; kv_idx; lt $0 $1; add $0 $2", "statement 3", "boolean"},
        {"score: q_idx; aux7 $0", "slot", NULL},
        {"mask:", "no statements", NULL},
        {"mask: q_idx;; kv_idx", "statement 1", NULL},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        p = (fa_mod *)&p;
        expect_error(fa_mod_parse(bad[i].text, &p), bad[i].text, bad[i].w1, bad[i].w2);
        TU_CHECK(p == NULL, "%s: out not NULL after a failure", bad[i].text);
    }
}

static void test_call_errors(tu_rng *r)
{
    tu_where = "call errors";
    int64_t qs[4] = {1, 20, 2, 16};
    tu_tensor q = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor k = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor v = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor out = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    int64_t ls[3] = {1, 2, 20};
    tu_tensor lse = tu_tensor_new(FA_DTYPE_F32, 3, ls, TU_CONTIGUOUS, r);
    tu_fill_uniform(&q, r, -1, 1);
    tu_fill_uniform(&k, r, -1, 1);
    tu_fill_uniform(&v, r, -1, 1);
    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.q = &q.t, a.k = &k.t, a.v = &v.t, a.out = &out.t, a.lse = &lse.t;

    fa_mod *m = fa_mod_create(), *open = fa_mod_create(), *mask = fa_mod_create();
    const int hv = V(H), bias = fa_mod_aux(m, 1, 1, &hv);
    TU_CHECK(fa_mod_finish(m, B(ADD, V(SCORE), bias), FA_MOD_KIND_SCORE) == FA_STATUS_OK, "%s",
             fa_last_error());
    {
        fa_mod *keep = m;
        m = mask;
        TU_CHECK(fa_mod_finish(m, B(LE, V(KV_IDX), V(Q_IDX)), FA_MOD_KIND_MASK) == FA_STATUS_OK,
                 "%s", fa_last_error());
        m = keep;
    }
    float hbias[2] = {0.5f, -0.25f};
    int64_t two[1] = {2}, ts[2] = {2, 1};
    fa_tensor aux = fa_tensor_make(hbias, FA_DTYPE_F32, 1, two, NULL);
    fa_tensor aux2d = fa_tensor_make(hbias, FA_DTYPE_F32, 2, ts, NULL);
    fa_tensor auxf16 = fa_tensor_make(hbias, FA_DTYPE_F16, 1, two, NULL);

    tu_poison(&out);
    a.score_mod = open;
    expect_error(fa_attention_forward(&a), "unfinished", "score_mod", "not finished");
    a.score_mod = mask;
    expect_error(fa_attention_forward(&a), "mask as score", "score_mod", "FA_MOD_KIND_SCORE");
    a.score_mod = NULL;
    a.mask_mod = m;
    expect_error(fa_attention_forward(&a), "score as mask", "mask_mod", "FA_MOD_KIND_MASK");
    a.mask_mod = NULL;
    a.score_mod = m;
    expect_error(fa_attention_forward(&a), "aux missing", "mod_aux[1]", "NULL");
    a.mod_aux[1] = &auxf16;
    expect_error(fa_attention_forward(&a), "aux fp16", "mod_aux[1]", "int32 or fp32");
    a.mod_aux[1] = &aux2d;
    expect_error(fa_attention_forward(&a), "aux 2-d", "mod_aux[1]", "2 dims");
    a.mod_aux[1] = &aux;
    a.mod_aux[2] = &aux;
    expect_error(fa_attention_forward(&a), "aux unread", "mod_aux[2]", "reads it");
    a.mod_aux[2] = NULL;
    tu_tensor probs = tu_tensor_new(FA_DTYPE_F32, 4, (int64_t[4]){1, 2, 20, 20}, TU_CONTIGUOUS, r);
    a.probs = &probs.t;
    expect_error(fa_attention_forward(&a), "probs", "probs", "score_mod");
    a.probs = NULL;
    TU_CHECK(tu_count_poisoned_in_view(&out) == tu_numel(&out.t),
             "a refused call wrote out");
    /* fp32 on a CUDA device: refused (the CUDA kernels compute fp16 and bf16), mods or not. */
    a.device = 0;
    fa_status st = fa_attention_forward(&a);
    TU_CHECK(st != FA_STATUS_OK, "an fp32 call on a CUDA device was accepted");
    if (fa_cuda_device_count() > 0)
        expect_error(st, "CUDA", "q", "fp16 and bf16");
    a.device = FA_DEVICE_CPU;

    /* Valid: out is written; the backward takes the mods too (test_block_mask checks its
     * values). */
    TU_CHECK(fa_attention_forward(&a) == FA_STATUS_OK, "valid call: %s", fa_last_error());
    tu_tensor dout = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor dq = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor dk = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor dv = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    tu_fill_uniform(&dout, r, -1, 1);
    fa_bwd_args ba;
    fa_bwd_args_init(&ba);
    ba.fwd = &a, ba.dout = &dout.t, ba.dq = &dq.t, ba.dk = &dk.t, ba.dv = &dv.t;
    tu_poison(&dq);
    st = fa_attention_backward(&ba);
    TU_CHECK(st == FA_STATUS_OK, "backward with score_mod: %s", fa_last_error());
    TU_CHECK(tu_count_poisoned_in_view(&dq) == 0, "backward with score_mod left dq unwritten");
    /* The CUDA backward takes the mods too (tests/gpu/test_gpu_mod.c checks its values): this
     * fp32 call is refused for its dtype or a missing device, never for the mod. */
    a.device = 0;
    st = fa_attention_backward(&ba);
    TU_CHECK(st != FA_STATUS_OK, "an fp32 backward on a CUDA device was accepted");
    TU_CHECK(!strstr(fa_last_error(), "score_mod"), "the CUDA backward refused the mod: %s",
             fa_last_error());
    a.device = FA_DEVICE_CPU;

    fa_mod_destroy(m);
    fa_mod_destroy(open);
    fa_mod_destroy(mask);
    tu_tensor *all[] = {&q, &k, &v, &out, &lse, &probs, &dout, &dq, &dk, &dv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tu_tensor_free(all[i]);
}

/* A score_mod of form score + term or score - term, the term not reading score (ALiBi, a bias
 * table), also carries the term alone, signed, which the kernels add in base 2
 * (fa_score_mod_base2); other forms (term - score, a product, a term that reads score) do not. */
static void test_cuda_additive(void)
{
    struct {
        const char *what, *ret; /* the term's return, NULL: not additive */
    } want[] = {{"score - slope[h] * (q - kv)", "return -(float)v"},
                {"(kv - q) + score", "return (float)v"},
                {"score + rel[h, kv - q + 7]", "return (float)v"},
                {"(q - kv) - score", NULL},
                {"score * 2", NULL},
                {"score + tanh(score)", NULL}};
    for (int c = 0; c < 6; c++) {
        fa_mod *m = fa_mod_create();
        const int diff = B(SUB, V(Q_IDX), V(KV_IDX)), rdiff = B(SUB, V(KV_IDX), V(Q_IDX));
        const int head[1] = {V(H)}, rel[2] = {V(H), B(ADD, rdiff, C(7))};
        int root = c == 0   ? B(SUB, V(SCORE), B(MUL, fa_mod_aux(m, 0, 1, head), diff))
                   : c == 1 ? B(ADD, rdiff, V(SCORE))
                   : c == 2 ? B(ADD, V(SCORE), fa_mod_aux(m, 1, 2, rel))
                   : c == 3 ? B(SUB, diff, V(SCORE))
                   : c == 4 ? B(MUL, V(SCORE), C(2))
                            : B(ADD, V(SCORE), U(TANH, V(SCORE)));
        TU_CHECK(fa_mod_finish(m, root, FA_MOD_KIND_SCORE) == FA_STATUS_OK, "%s: %s",
                 want[c].what, fa_last_error());
        /* the term's function alone (fa_score_mod_aux_grad follows it) */
        char fn_text[4096] = "";
        const char *fn = strstr(m->cuda, "fa_score_mod_term(");
        if (fn) {
            const char *end = strstr(fn, "\n}\n");
            const size_t n = end ? (size_t)(end - fn) + 3 : strlen(fn);
            snprintf(fn_text, sizeof fn_text, "%.*s", (int)n, fn);
            fn = fn_text;
        }
        if (!want[c].ret) {
            TU_CHECK(!fn && !strstr(m->cuda, "FA_SCORE_MOD_ADDITIVE"),
                     "%s: emitted as additive:\n%s", want[c].what, m->cuda);
        } else {
            TU_CHECK(fn && strstr(m->cuda, "#define FA_SCORE_MOD_ADDITIVE 1"),
                     "%s: not emitted as additive:\n%s", want[c].what, m->cuda);
            /* the term's function reads neither score nor anything computed from it */
            TU_CHECK(fn && !strstr(fn, "float score") && !strstr(fn, "= score;") &&
                         strstr(fn, want[c].ret),
                     "%s: term:\n%s",
                     want[c].what, fn ? fn : m->cuda);
            /* and returns the step that is the term: the root's operand */
            char ret[48];
            const fa_mod_node *r = &m->steps[m->n_steps - 1];
            const int term = m->steps[r->args[0]].op == FA_MOD_OP_VAR ? r->args[1] : r->args[0];
            snprintf(ret, sizeof ret, "%s%d;", want[c].ret, term);
            TU_CHECK(fn && strstr(fn, ret), "%s: '%s' missing from:\n%s", want[c].what, ret,
                     fn ? fn : "");
        }
        fa_mod_destroy(m);
    }
}

/* The CUDA C a finished program carries for the GPU (fa_mod_emit_cuda): the canonical text at
 * its head, one statement per step in the evaluator's operations, constants as their fp32
 * bits (integral ones as ints), index arithmetic in int, aux reads by slot with each index's
 * offset (int or fp32); programs that differ in a constant differ. */
static void test_cuda_text(void)
{
    tu_where = "cuda text";
    fa_mod *m = fa_mod_create();
    const int idx[2] = {V(B), B(SUB, V(Q_IDX), V(KV_IDX))};
    int root = B(LT, fa_mod_aux(m, 2, 2, idx), C(0.1));
    root = B(AND, root, U(NOT, B(EQ, V(H), C(3))));
    TU_CHECK(fa_mod_finish(m, root, FA_MOD_KIND_MASK) == FA_STATUS_OK, "%s", fa_last_error());
    const char *want[] = {
        "FA_DEV bool fa_mask_mod(const fa_kparams *kp, int b, int h, int q_idx, int kv_idx)",
        "__int_as_float(0x3dcccccd)", /* 0.1 rounded to fp32, as the CPU evaluates it */
        "const int v3 = v1 - v2;",
        "fa_mod_aux_at(kp, 2, fa_mod_off_i(kp, 2, 0, v0) + fa_mod_off_i(kp, 2, 1, v3))",
        "const float v4 = fa_mod_aux_at", "const bool v6 = v4 < v5;", "const int v8 = 3;",
        "!v9", "&&",
    };
    char head[512];
    snprintf(head, sizeof head, "/* %s */", fa_mod_text(m));
    TU_CHECK(strncmp(m->cuda, head, strlen(head)) == 0, "not headed by its text: %s", m->cuda);
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        TU_CHECK(strstr(m->cuda, want[i]), "'%s' missing from:\n%s", want[i], m->cuda);
    char last[32];
    snprintf(last, sizeof last, "return v%d;", m->n_steps - 1);
    TU_CHECK(strstr(m->cuda, last), "'%s' missing from:\n%s", last, m->cuda);
    fa_mod_destroy(m);

    fa_mod *s1 = fa_mod_create(), *s2 = fa_mod_create();
    m = s1;
    root = B(MAX, U(TANH, V(SCORE)), B(MOD, V(SCORE), C(-3)));
    TU_CHECK(fa_mod_finish(m, root, FA_MOD_KIND_SCORE) == FA_STATUS_OK, "%s", fa_last_error());
    m = s2;
    root = B(MAX, U(TANH, V(SCORE)), B(MOD, V(SCORE), C(-4)));
    TU_CHECK(fa_mod_finish(m, root, FA_MOD_KIND_SCORE) == FA_STATUS_OK, "%s", fa_last_error());
    const char *want_s[] = {("FA_DEV float fa_score_mod(const fa_kparams *kp, float score, "
                             "int b,"),
                            "fa_tanh_fast(v0)", "fa_mod_rem(v0, v2)", "fa_mod_max(v1, v3)"};
    for (size_t i = 0; i < sizeof want_s / sizeof want_s[0]; i++)
        TU_CHECK(strstr(s1->cuda, want_s[i]), "'%s' missing from:\n%s", want_s[i], s1->cuda);
    TU_CHECK(strcmp(s1->cuda, s2->cuda) != 0, "two constants, one text");
    /* The backward's function: values and derivatives, by the rules the CPU uses
     * (mod/fa_mod_grad.h; tanh's from its value, a constant divisor's term dropped), the root's
     * derivative returned through dscore; score's is 1, the constant's 0; a mask_mod has none. */
    const char *want_g[] = {
        ("FA_DEV float fa_score_mod_grad(const fa_kparams *kp, float score, int b, int h, "
         "int q_idx, int kv_idx, float *dscore)"),
        "const float d0 = 1.f;", "const float d2 = 0.f;",
        "d1 = (1 - FA_MOD_D_SQ(v1)) * dx;",
        "const float x = (float)v0, y = (float)v2, dx = d0, dy = d2, dz = 0.f;",
        "d3 = dx - (dy != 0 ? FA_MOD_D_FLOOR(x / y) * dy : 0);",
        "d4 = (x > y || x != x) ? dx : dy;", "*dscore = d4;"};
    for (size_t i = 0; i < sizeof want_g / sizeof want_g[0]; i++)
        TU_CHECK(strstr(s1->cuda, want_g[i]), "'%s' missing from:\n%s", want_g[i], s1->cuda);
    /* Division's derivative with fa_mod_div, the terms of a divisor or dividend that does not
     * read score dropped. */
    fa_mod *sd = fa_mod_create();
    m = sd;
    root = B(ADD, B(DIV, V(SCORE), C(30)), B(DIV, C(2), V(SCORE)));
    TU_CHECK(fa_mod_finish(m, root, FA_MOD_KIND_SCORE) == FA_STATUS_OK, "%s", fa_last_error());
    const char *want_d[] = {"= fa_mod_div(dx, y);", "= -fa_mod_div(fa_mod_div(x, y) * dy, y);",
                            "= dx + dy;"};
    for (size_t i = 0; i < sizeof want_d / sizeof want_d[0]; i++)
        TU_CHECK(strstr(sd->cuda, want_d[i]), "'%s' missing from:\n%s", want_d[i], sd->cuda);
    TU_CHECK(!strstr(sd->cuda, " / "), "an exact division left in:\n%s", sd->cuda);
    fa_mod_destroy(sd);
    fa_mod *mk = fa_mod_create();
    m = mk;
    TU_CHECK(fa_mod_finish(m, B(LT, V(Q_IDX), V(KV_IDX)), FA_MOD_KIND_MASK) == FA_STATUS_OK,
             "%s", fa_last_error());
    TU_CHECK(!strstr(s1->cuda, "fa_mask_mod") && !strstr(mk->cuda, "fa_score_mod"),
             "a function of the other kind emitted");
    /* Int forms: the remainder and floor quotient by positive constants; a fractional factor,
     * a negative divisor and a true division make fp32 steps. */
    fa_mod *mi = fa_mod_create();
    m = mi;
    const int quot = U(FLOOR, B(DIV, V(KV_IDX), C(16)));
    root = B(AND, B(EQ, B(MOD, V(Q_IDX), C(64)), quot),
             B(LT, B(MUL, V(Q_IDX), C(0.5)), B(MOD, V(KV_IDX), C(-4))));
    root = B(AND, root, B(GT, B(DIV, V(Q_IDX), C(3)), U(ABS, B(SUB, V(KV_IDX), V(Q_IDX)))));
    TU_CHECK(fa_mod_finish(m, root, FA_MOD_KIND_MASK) == FA_STATUS_OK, "%s", fa_last_error());
    const char *want_i[] = {"const int v2 = fa_mod_rem_i(v0, v1);",
                            "const int v6 = fa_mod_floordiv_i(v3, v4);",
                            "const float v9 = v0 * v8;", "const float v11 = fa_mod_rem(v3, v10);",
                            "const int v17 = abs(v16);", "const float v15 = fa_mod_div(v0, v14);"};
    for (size_t i = 0; i < sizeof want_i / sizeof want_i[0]; i++)
        TU_CHECK(strstr(mi->cuda, want_i[i]), "'%s' missing from:\n%s", want_i[i], mi->cuda);
    TU_CHECK(strstr(mi->cuda, "const float v4") == NULL && strstr(mi->cuda, "const int v4 = 16;"),
             "16 not an int constant:\n%s", mi->cuda);
    fa_mod_destroy(mi);
    fa_mod_destroy(s1);
    fa_mod_destroy(s2);
    fa_mod_destroy(mk);
    test_cuda_additive();
}

/* Whether plan defines `define` ("-DNAME=value"). */
static int plan_defines(const fa_plan *plan, const char *define)
{
    for (int i = 0; i < plan->num_defines; i++)
        if (strcmp(plan->defines[i], define) == 0)
            return 1;
    return 0;
}

/* Calls with mods plan the sm80 family on sm_80 and sm_86, the sm90 family's hooks on sm_90
 * (test_plan checks where they cannot go), with the features' defines; plans without them
 * carry none of those defines (their kernels keep their keys). */
static void test_plan_routes(void)
{
    tu_where = "plan";
    const unsigned mods[3] = {FA_PLAN_SCORE_MOD, FA_PLAN_MASK_MOD, FA_PLAN_BLOCK_MASK};
    const char *defs[3] = {"-DFA_SCORE_MOD=1", "-DFA_MASK_MOD=1", "-DFA_BLOCK_MASK=1"};
    const int archs[3] = {80, 86, 90};
    for (int a = 0; a < 3; a++)
        for (int i = 0; i < 3; i++) {
            fa_plan_key key = {archs[a], FA_DTYPE_BF16, 128, 128, mods[i], 0, 0, 0};
            fa_plan plan;
            TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK, "%s", fa_last_error());
            TU_CHECK(strcmp(plan.family, archs[a] == 90 ? "fa_fwd_sm90.cu" : "fa_fwd_sm80.cu") ==
                         0,
                     "arch %d: %s", archs[a], plan.family);
            for (int j = 0; j < 3; j++)
                TU_CHECK(plan_defines(&plan, defs[j]) == (i == j), "arch %d mod %d: %s %s",
                         archs[a], i, defs[j], i == j ? "missing" : "present");
            /* The backward likewise: the Hopper backward's hooks on sm_90, elsewhere the sm80
             * family with dK and dV split over warp pairs past head dim 64. */
            key.features = mods[i];
            TU_CHECK(fa_plan_backward(&key, &plan) == FA_STATUS_OK, "%s", fa_last_error());
            TU_CHECK(strcmp(plan.family,
                            archs[a] == 90 ? "fa_bwd_sm90.cu" : "fa_bwd_sm80.cu") == 0,
                     "backward arch %d: %s", archs[a], plan.family);
            TU_CHECK(archs[a] == 90 || plan_defines(&plan, "-DFA_DKV_SPLIT=2"),
                     "backward arch %d: not split", archs[a]);
            for (int j = 0; j < 3; j++)
                TU_CHECK(plan_defines(&plan, defs[j]) == (i == j), "backward arch %d mod %d: %s",
                         archs[a], i, defs[j]);
            key.features = 0;
            TU_CHECK(fa_plan_forward(&key, &plan) == FA_STATUS_OK, "%s", fa_last_error());
            for (int j = 0; j < 3; j++)
                TU_CHECK(!plan_defines(&plan, defs[j]), "plain plan has %s", defs[j]);
            TU_CHECK(fa_plan_backward(&key, &plan) == FA_STATUS_OK, "%s", fa_last_error());
            for (int j = 0; j < 3; j++)
                TU_CHECK(!plan_defines(&plan, defs[j]), "plain backward plan has %s", defs[j]);
            TU_CHECK(archs[a] != 90 || strcmp(plan.family, "fa_bwd_sm90.cu") == 0,
                     "plain backward on sm_90: %s", plan.family);
            /* Head dim 64 keeps its 128-key block (8 warps, dK and dV whole). */
            key.d = key.dv = 64;
            key.features = mods[i];
            TU_CHECK(fa_plan_backward(&key, &plan) == FA_STATUS_OK, "%s", fa_last_error());
            TU_CHECK(!plan_defines(&plan, "-DFA_DKV_SPLIT=2") && plan.bn == 16 * plan.nwarps,
                     "backward d 64 arch %d: split (%d keys, %d warps)", archs[a], plan.bn,
                     plan.nwarps);
        }
}

/* An aux read past the end of a dimension of 2^24 + 4 entries, whose last index fp32 rounds up
 * (2^24 + 3 -> 2^24 + 4): the clamp must stay inside. The entries past the tensor are NaN, the
 * last ones a constant (which shifts every score alike), so the output is the plain call's. */
static void test_aux_clamp_large(tu_rng *r)
{
    tu_where = "aux clamp past 2^24";
    const int64_t n = ((int64_t)1 << 24) + 4, extra = 64;
    float *table = malloc((size_t)(n + extra) * sizeof *table);
    TU_CHECK(table != NULL, "no memory for the aux table");
    if (!table)
        return;
    for (int64_t i = 0; i < n + extra; i++)
        table[i] = i < n - 8 ? (float)tu_rng_uniform(r, -1, 1) : i < n ? 0.75f : NAN;
    fa_tensor aux = fa_tensor_make(table, FA_DTYPE_F32, 1, &n, NULL);
    int64_t qs[4] = {1, 12, 2, 16}, ls[3] = {1, 2, 12};
    tu_tensor q = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor k = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor v = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor out = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor ref = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor lse = tu_tensor_new(FA_DTYPE_F32, 3, ls, TU_CONTIGUOUS, r);
    tu_fill_uniform(&q, r, -1, 1);
    tu_fill_uniform(&k, r, -1, 1);
    tu_fill_uniform(&v, r, -1, 1);
    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.q = &q.t, a.k = &k.t, a.v = &v.t, a.out = &ref.t;
    TU_CHECK(fa_attention_forward(&a) == FA_STATUS_OK, "plain call: %s", fa_last_error());

    fa_mod *m = fa_mod_create();
    const int far = fa_mod_const(m, 1e12), bias = fa_mod_aux(m, 0, 1, &far);
    TU_CHECK(fa_mod_finish(m, B(ADD, V(SCORE), bias), FA_MOD_KIND_SCORE) == FA_STATUS_OK, "%s",
             fa_last_error());
    a.out = &out.t, a.lse = &lse.t, a.score_mod = m, a.mod_aux[0] = &aux;
    tu_poison(&out);
    TU_CHECK(fa_attention_forward(&a) == FA_STATUS_OK, "aux call: %s", fa_last_error());
    double err = 0;
    const float *o = (const float *)out.t.data, *e = (const float *)ref.t.data;
    for (int64_t i = 0; i < tu_numel(&out.t); i++) {
        const double d = o[i] == o[i] ? fabs((double)o[i] - e[i]) : INFINITY;
        err = d > err ? d : err;
    }
    TU_CHECK(err < 1e-5, "out past the clamp differs from the plain call by %g", err);
    fa_mod_destroy(m);
    tu_tensor *all[] = {&q, &k, &v, &out, &ref, &lse};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tu_tensor_free(all[i]);
    free(table);
}

int main(void)
{
    tu_rng rng = {tu_master_seed("test_mod")};
    test_aux_clamp_large(&rng);
    test_builder_errors();
    test_text();
    test_cuda_text();
    test_plan_routes();
    test_call_errors(&rng);
    tm_test_forward(&rng);
    tm_test_aux_grad(&rng);
    return tu_finish("test_mod");
}
