/*
 * test_errors: argument validation.
 *
 * Every invalid argument must give FA_STATUS_INVALID_ARGUMENT (a device that does not exist may
 * give FA_STATUS_UNSUPPORTED) and a message from fa_last_error() that names the argument as a
 * whole identifier (e.g. "window_left", not just any text containing it). The outputs must stay
 * untouched ("validates every argument, then computes"). Also: the message is per thread, and a
 * successful call after failed ones gives correct results.
 */
#define _POSIX_C_SOURCE 200809L
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_ref.h"
#include "flashattn.h"
#include "test_util.h"

/* Buffers far larger than any view used here, so that a library that reads or writes through a
   bad view before rejecting it still stays inside memory we own (and the poison check sees it). */
#define BIG 65536

typedef struct env {
    /* storage */
    float *q_buf, *k_buf, *v_buf, *out_buf, *lse_buf, *probs_buf, *alibi_buf, *sinks_buf;
    int32_t cuq_buf[8], cuk_buf[8], used_buf[8];
    /* views (mutated by the checks, restored by reset) */
    fa_tensor q, k, v, out, lse, probs, alibi, sinks, cuq, cuk, used;
    fa_fwd_args a;
    int varlen;
} env;

static float *alloc_buf(tu_rng *r)
{
    float *p = malloc(sizeof(float) * BIG);
    if (!p) {
        exit(2);
    }
    for (int i = 0; i < BIG; i++) {
        p[i] = (float)tu_rng_uniform(r, 0.05, 1.0) * (i & 1 ? 1.0f : -1.0f);
    }
    return p;
}

static void env_init(env *E, tu_rng *r)
{
    memset(E, 0, sizeof *E);
    E->q_buf = alloc_buf(r);
    E->k_buf = alloc_buf(r);
    E->v_buf = alloc_buf(r);
    E->out_buf = alloc_buf(r);
    E->lse_buf = alloc_buf(r);
    E->probs_buf = alloc_buf(r);
    E->alibi_buf = alloc_buf(r);
    E->sinks_buf = alloc_buf(r);
    for (int i = 0; i < BIG; i++) {
        E->alibi_buf[i] = fabsf(E->alibi_buf[i]);
    }
}

static void env_free(env *E)
{
    free(E->q_buf);
    free(E->k_buf);
    free(E->v_buf);
    free(E->out_buf);
    free(E->lse_buf);
    free(E->probs_buf);
    free(E->alibi_buf);
    free(E->sinks_buf);
}

/* Dense baseline: b=2 sq=5 sk=6 h=4 hk=2 d=dv=8, F32, with lse, probs, alibi [h], sinks. */
#define B 2
#define SQ 5
#define SK 6
#define H 4
#define HK 2
#define D 8

static void reset_dense(env *E)
{
    int64_t sq[4] = {B, SQ, H, D}, sk[4] = {B, SK, HK, D}, so[4] = {B, SQ, H, D};
    int64_t sl[3] = {B, H, SQ}, sp[4] = {B, H, SQ, SK}, sa[1] = {H}, ss[1] = {H};
    E->varlen = 0;
    E->q = fa_tensor_make(E->q_buf, FA_DTYPE_F32, 4, sq, NULL);
    E->k = fa_tensor_make(E->k_buf, FA_DTYPE_F32, 4, sk, NULL);
    E->v = fa_tensor_make(E->v_buf, FA_DTYPE_F32, 4, sk, NULL);
    E->out = fa_tensor_make(E->out_buf, FA_DTYPE_F32, 4, so, NULL);
    E->lse = fa_tensor_make(E->lse_buf, FA_DTYPE_F32, 3, sl, NULL);
    E->probs = fa_tensor_make(E->probs_buf, FA_DTYPE_F32, 4, sp, NULL);
    E->alibi = fa_tensor_make(E->alibi_buf, FA_DTYPE_F32, 1, sa, NULL);
    E->sinks = fa_tensor_make(E->sinks_buf, FA_DTYPE_F32, 1, ss, NULL);
    fa_fwd_args_init(&E->a);
    E->a.q = &E->q;
    E->a.k = &E->k;
    E->a.v = &E->v;
    E->a.out = &E->out;
    E->a.lse = &E->lse;
    E->a.probs = &E->probs;
    E->a.alibi_slopes = &E->alibi;
    E->a.sinks = &E->sinks;
    E->a.num_threads = 1;
}

/* Varlen baseline: b=2, q tokens 10 (sequences 0..4, 4..9), k tokens 12 (0..5, 5..12) with
   seqused_k {3, 7}, max_seqlen 5 / 7, h=4 hk=2 d=dv=8. */
#define TQ 10
#define TK 12
static void reset_varlen(env *E)
{
    int64_t sq[3] = {TQ, H, D}, sk[3] = {TK, HK, D}, so[3] = {TQ, H, D};
    int64_t sl[2] = {H, TQ}, sp[4] = {B, H, 5, 7}, sa[2] = {B, H}, ss[1] = {H};
    int64_t sc[1] = {B + 1}, su[1] = {B};
    E->varlen = 1;
    const int32_t cuq[3] = {0, 4, 9}, cuk[3] = {0, 5, 12}, used[2] = {3, 7};
    memcpy(E->cuq_buf, cuq, sizeof cuq);
    memcpy(E->cuk_buf, cuk, sizeof cuk);
    memcpy(E->used_buf, used, sizeof used);
    E->q = fa_tensor_make(E->q_buf, FA_DTYPE_F32, 3, sq, NULL);
    E->k = fa_tensor_make(E->k_buf, FA_DTYPE_F32, 3, sk, NULL);
    E->v = fa_tensor_make(E->v_buf, FA_DTYPE_F32, 3, sk, NULL);
    E->out = fa_tensor_make(E->out_buf, FA_DTYPE_F32, 3, so, NULL);
    E->lse = fa_tensor_make(E->lse_buf, FA_DTYPE_F32, 2, sl, NULL);
    E->probs = fa_tensor_make(E->probs_buf, FA_DTYPE_F32, 4, sp, NULL);
    E->alibi = fa_tensor_make(E->alibi_buf, FA_DTYPE_F32, 2, sa, NULL);
    E->sinks = fa_tensor_make(E->sinks_buf, FA_DTYPE_F32, 1, ss, NULL);
    E->cuq = fa_tensor_make(E->cuq_buf, FA_DTYPE_I32, 1, sc, NULL);
    E->cuk = fa_tensor_make(E->cuk_buf, FA_DTYPE_I32, 1, sc, NULL);
    E->used = fa_tensor_make(E->used_buf, FA_DTYPE_I32, 1, su, NULL);
    fa_fwd_args_init(&E->a);
    E->a.q = &E->q;
    E->a.k = &E->k;
    E->a.v = &E->v;
    E->a.out = &E->out;
    E->a.lse = &E->lse;
    E->a.probs = &E->probs;
    E->a.alibi_slopes = &E->alibi;
    E->a.sinks = &E->sinks;
    E->a.cu_seqlens_q = &E->cuq;
    E->a.cu_seqlens_k = &E->cuk;
    E->a.seqused_k = &E->used;
    E->a.max_seqlen_q = 5;
    E->a.max_seqlen_k = 7;
    E->a.num_threads = 1;
}

static const uint32_t POISON = 0x7fc5a5a5u;

static void poison_outputs(env *E)
{
    float *bufs[3] = {E->out_buf, E->lse_buf, E->probs_buf};
    for (int b = 0; b < 3; b++) {
        for (int i = 0; i < BIG; i++) {
            memcpy(&bufs[b][i], &POISON, 4);
        }
    }
}

static int64_t outputs_touched(const env *E)
{
    const float *bufs[3] = {E->out_buf, E->lse_buf, E->probs_buf};
    int64_t n = 0;
    for (int b = 0; b < 3; b++) {
        for (int i = 0; i < BIG; i++) {
            uint32_t u;
            memcpy(&u, &bufs[b][i], 4);
            n += (u != POISON);
        }
    }
    return n;
}

static int g_checks = 0;

/* names: NULL-terminated list; the message must name at least one of them */
static void expect_invalid(env *E, const char *label, int allow_unsupported, const char **names)
{
    char where[256];
    snprintf(where, sizeof where, "%s: %s", E->varlen ? "varlen" : "dense", label);
    tu_where = where;
    g_checks++;
    poison_outputs(E);
    fa_status st = fa_attention_forward(&E->a);
    const char *msg = fa_last_error();
    int status_ok = (st == FA_STATUS_INVALID_ARGUMENT) ||
                    (allow_unsupported && st == FA_STATUS_UNSUPPORTED);
    TU_CHECK(status_ok, "expected INVALID_ARGUMENT%s, got %d (%s); message: \"%s\"",
             allow_unsupported ? " or UNSUPPORTED" : "", (int)st, fa_status_string(st),
             msg ? msg : "(null)");
    TU_CHECK(msg != NULL && msg[0] != '\0', "empty error message");
    if (getenv("FA_TEST_VERBOSE")) {
        printf("  %-45s -> %d \"%s\"\n", where, (int)st, msg ? msg : "(null)");
    }
    if (msg && names && names[0]) {
        int named = 0;
        char list[128] = "";
        for (const char **n = names; *n; n++) {
            named |= tu_names(msg, *n);
            strncat(list, *n, sizeof list - strlen(list) - 4);
            if (n[1]) {
                strncat(list, " | ", sizeof list - strlen(list) - 1);
            }
        }
        TU_CHECK(named, "message \"%s\" does not name %s", msg, list);
    }
    if (st != FA_STATUS_OK) {
        int64_t n = outputs_touched(E);
        TU_CHECK(n == 0, "a rejected call wrote %lld output elements", (long long)n);
    }
    /* fa_attention_backward_prepare validates the same arguments as the forward. */
    if (st == FA_STATUS_INVALID_ARGUMENT) {
        char fwd_msg[512];
        snprintf(fwd_msg, sizeof fwd_msg, "%s", msg ? msg : "");
        const fa_status sp = fa_attention_backward_prepare(&E->a);
        TU_CHECK(sp == st && strcmp(fa_last_error(), fwd_msg) == 0,
                 "fa_attention_backward_prepare: %d \"%s\", the forward %d \"%s\"", (int)sp,
                 fa_last_error(), (int)st, fwd_msg);
    }
}

#define NAMES(...) ((const char *[]){__VA_ARGS__, NULL})

#define BAD_DENSE(label, mutation, ...)                                                            \
    do {                                                                                           \
        reset_dense(E);                                                                            \
        {                                                                                          \
            mutation;                                                                              \
        }                                                                                          \
        expect_invalid(E, label, 0, NAMES(__VA_ARGS__));                                           \
    } while (0)

#define BAD_VARLEN(label, mutation, ...)                                                           \
    do {                                                                                           \
        reset_varlen(E);                                                                           \
        {                                                                                          \
            mutation;                                                                              \
        }                                                                                          \
        expect_invalid(E, label, 0, NAMES(__VA_ARGS__));                                           \
    } while (0)

static void set_shape(fa_tensor *t, int dim, int64_t n)
{
    /* keep the view row-major contiguous */
    t->shape[dim] = n;
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        t->stride[i] = s;
        s *= t->shape[i] > 0 ? t->shape[i] : 1;
    }
}

static void set_ndim(fa_tensor *t, int ndim)
{
    for (int i = t->ndim; i < ndim && i < FA_MAX_DIMS; i++) {
        t->shape[i] = 1;
    }
    t->ndim = ndim;
    if (ndim > 0 && ndim <= FA_MAX_DIMS) {
        set_shape(t, 0, t->shape[0]);
    }
}

/* the baselines must pass, or every check below would be meaningless */
static int check_baseline(env *E, int varlen)
{
    if (varlen) {
        reset_varlen(E);
    } else {
        reset_dense(E);
    }
    tu_where = varlen ? "varlen baseline" : "dense baseline";
    poison_outputs(E);
    fa_status st = fa_attention_forward(&E->a);
    TU_CHECK(st == FA_STATUS_OK, "valid baseline rejected: %d %s", (int)st, fa_last_error());
    const fa_status sp = fa_attention_backward_prepare(&E->a); /* the CPU: nothing to build */
    TU_CHECK(sp == FA_STATUS_OK, "fa_attention_backward_prepare on the CPU: %d %s", (int)sp,
             fa_last_error());
    return st == FA_STATUS_OK;
}

static void dense_checks(env *E)
{
    tu_where = "NULL args";
    g_checks++;
    fa_status st = fa_attention_forward(NULL);
    TU_CHECK(st == FA_STATUS_INVALID_ARGUMENT, "NULL args: got %d", (int)st);
    TU_CHECK(fa_last_error()[0] != '\0', "NULL args: empty message");

    BAD_DENSE("q NULL", E->a.q = NULL, "q");
    BAD_DENSE("k NULL", E->a.k = NULL, "k");
    BAD_DENSE("v NULL", E->a.v = NULL, "v");
    BAD_DENSE("out NULL", E->a.out = NULL, "out");

    BAD_DENSE("q data NULL", E->q.data = NULL, "q");
    BAD_DENSE("k data NULL", E->k.data = NULL, "k");
    BAD_DENSE("v data NULL", E->v.data = NULL, "v");
    BAD_DENSE("out data NULL", E->out.data = NULL, "out");
    BAD_DENSE("lse data NULL", E->lse.data = NULL, "lse");
    BAD_DENSE("probs data NULL", E->probs.data = NULL, "probs");
    BAD_DENSE("alibi data NULL", E->alibi.data = NULL, "alibi_slopes");
    BAD_DENSE("sinks data NULL", E->sinks.data = NULL, "sinks");

    /* dtypes */
    BAD_DENSE("q,k,v,out int32", E->q.dtype = E->k.dtype = E->v.dtype = E->out.dtype =
                                     E->probs.dtype = FA_DTYPE_I32,
              "q");
    BAD_DENSE("q dtype out of range", E->q.dtype = (fa_dtype)42, "q");
    BAD_DENSE("q dtype negative", E->q.dtype = (fa_dtype)-1, "q");
    BAD_DENSE("k dtype mismatch", E->k.dtype = FA_DTYPE_F16, "k");
    BAD_DENSE("v dtype mismatch", E->v.dtype = FA_DTYPE_F64, "v");
    BAD_DENSE("out dtype mismatch", E->out.dtype = FA_DTYPE_BF16, "out");

    /* ndim */
    BAD_DENSE("q ndim 3", set_ndim(&E->q, 3), "q");
    BAD_DENSE("k ndim 5", set_ndim(&E->k, 5), "k");
    BAD_DENSE("v ndim 2", set_ndim(&E->v, 2), "v");
    BAD_DENSE("out ndim 3", set_ndim(&E->out, 3), "out");
    BAD_DENSE("q ndim 0", E->q.ndim = 0, "q");
    BAD_DENSE("q ndim 7", E->q.ndim = FA_MAX_DIMS + 1, "q");
    BAD_DENSE("q ndim -1", E->q.ndim = -1, "q");

    /* shape mismatches */
    BAD_DENSE("k batch", set_shape(&E->k, 0, B + 1), "k");
    BAD_DENSE("v batch", set_shape(&E->v, 0, B + 1), "v");
    BAD_DENSE("v seqlen != k seqlen", set_shape(&E->v, 1, SK + 1), "v");
    BAD_DENSE("k head_dim != q head_dim", set_shape(&E->k, 3, D + 1), "k");
    BAD_DENSE("v heads != k heads", set_shape(&E->v, 2, HK + 2), "v");
    BAD_DENSE("out batch", set_shape(&E->out, 0, B + 1), "out");
    BAD_DENSE("out seqlen", set_shape(&E->out, 1, SQ + 1), "out");
    BAD_DENSE("out heads", set_shape(&E->out, 2, H / 2), "out");
    BAD_DENSE("out head_dim", set_shape(&E->out, 3, D + 1), "out");
    BAD_DENSE("h % hk != 0", (set_shape(&E->k, 2, 3), set_shape(&E->v, 2, 3)), "k", "q");
    BAD_DENSE("hk > h", (set_shape(&E->k, 2, 2 * H), set_shape(&E->v, 2, 2 * H)), "k", "q");

    /* head dims */
    BAD_DENSE("head_dim 0", (set_shape(&E->q, 3, 0), set_shape(&E->k, 3, 0)), "q", "k",
              "head_dim");
    BAD_DENSE("head_dim over FA_MAX_HEAD_DIM",
              (set_shape(&E->q, 3, FA_MAX_HEAD_DIM + 1), set_shape(&E->k, 3, FA_MAX_HEAD_DIM + 1),
               E->a.probs = NULL),
              "q", "k", "head_dim");
    BAD_DENSE("dv 0", (set_shape(&E->v, 3, 0), set_shape(&E->out, 3, 0)), "v", "out",
              "head_dim", "head_dim_v");
    BAD_DENSE("dv over FA_MAX_HEAD_DIM",
              (set_shape(&E->v, 3, FA_MAX_HEAD_DIM + 1), set_shape(&E->out, 3, FA_MAX_HEAD_DIM + 1)),
              "v", "out", "head_dim", "head_dim_v");

    /* non-unit last stride */
    BAD_DENSE("q last stride 2", E->q.stride[3] = 2, "q");
    BAD_DENSE("k last stride 2", E->k.stride[3] = 2, "k");
    BAD_DENSE("v last stride 0", E->v.stride[3] = 0, "v");
    BAD_DENSE("out last stride 2", E->out.stride[3] = 2, "out");
    BAD_DENSE("lse last stride 2", E->lse.stride[2] = 2, "lse");
    BAD_DENSE("probs last stride 2", E->probs.stride[3] = 2, "probs");

    /* negative shapes */
    BAD_DENSE("q negative seqlen", E->q.shape[1] = -1, "q");
    BAD_DENSE("q negative batch", E->q.shape[0] = -2, "q");
    BAD_DENSE("k negative seqlen", (E->k.shape[1] = -3, E->v.shape[1] = -3), "k");
    BAD_DENSE("v negative head_dim", E->v.shape[3] = -8, "v");

    /* scalars */
    BAD_DENSE("dropout_p < 0", E->a.dropout_p = -0.1, "dropout_p");
    BAD_DENSE("dropout_p = 1", E->a.dropout_p = 1.0, "dropout_p");
    BAD_DENSE("dropout_p > 1", E->a.dropout_p = 1.5, "dropout_p");
    BAD_DENSE("dropout_p NaN", E->a.dropout_p = NAN, "dropout_p");
    BAD_DENSE("dropout with softcap", (E->a.dropout_p = 0.1, E->a.softcap = 5.0), "dropout_p",
              "softcap");
    BAD_DENSE("window_left -2", E->a.window_left = -2, "window_left");
    BAD_DENSE("window_right -2", E->a.window_right = -2, "window_right");
    BAD_DENSE("window_left INT_MIN", E->a.window_left = INT_MIN, "window_left");

    /* lse */
    BAD_DENSE("lse seqlen", set_shape(&E->lse, 2, SQ + 1), "lse");
    BAD_DENSE("lse transposed shape", (set_shape(&E->lse, 1, SQ), set_shape(&E->lse, 2, H)),
              "lse");
    BAD_DENSE("lse batch", set_shape(&E->lse, 0, 1), "lse");
    BAD_DENSE("lse dtype f64", E->lse.dtype = FA_DTYPE_F64, "lse");
    BAD_DENSE("lse dtype f16", E->lse.dtype = FA_DTYPE_F16, "lse");
    BAD_DENSE("lse dtype f16 with fp64 q",
              (E->q.dtype = E->k.dtype = E->v.dtype = E->out.dtype = E->probs.dtype = FA_DTYPE_F64,
               E->lse.dtype = FA_DTYPE_F16),
              "lse");
    BAD_DENSE("lse ndim 2", set_ndim(&E->lse, 2), "lse");

    /* probs */
    BAD_DENSE("probs rows < sq", set_shape(&E->probs, 2, SQ - 1), "probs");
    BAD_DENSE("probs cols < sk", set_shape(&E->probs, 3, SK - 1), "probs");
    BAD_DENSE("probs batch", set_shape(&E->probs, 0, 1), "probs");
    BAD_DENSE("probs heads", set_shape(&E->probs, 1, H - 1), "probs");
    BAD_DENSE("probs dtype", E->probs.dtype = FA_DTYPE_F64, "probs");
    BAD_DENSE("probs ndim 3", set_ndim(&E->probs, 3), "probs");

    /* alibi, sinks */
    BAD_DENSE("alibi dtype f64", E->alibi.dtype = FA_DTYPE_F64, "alibi_slopes");
    BAD_DENSE("alibi dtype f16", E->alibi.dtype = FA_DTYPE_F16, "alibi_slopes");
    BAD_DENSE("alibi [h+1]", set_shape(&E->alibi, 0, H + 1), "alibi_slopes");
    BAD_DENSE("alibi [hk]", set_shape(&E->alibi, 0, HK), "alibi_slopes");
    BAD_DENSE("alibi [b+1, h]", (set_ndim(&E->alibi, 2), set_shape(&E->alibi, 0, B + 1),
                                 set_shape(&E->alibi, 1, H)),
              "alibi_slopes");
    BAD_DENSE("alibi [b, h+1]",
              (set_ndim(&E->alibi, 2), set_shape(&E->alibi, 0, B), set_shape(&E->alibi, 1, H + 1)),
              "alibi_slopes");
    BAD_DENSE("alibi ndim 3", set_ndim(&E->alibi, 3), "alibi_slopes");
    BAD_DENSE("alibi stride", (set_ndim(&E->alibi, 2), set_shape(&E->alibi, 0, B),
                               set_shape(&E->alibi, 1, H), E->alibi.stride[1] = 2),
              "alibi_slopes");
    BAD_DENSE("sinks dtype f16", E->sinks.dtype = FA_DTYPE_F16, "sinks");
    BAD_DENSE("sinks dtype i32", E->sinks.dtype = FA_DTYPE_I32, "sinks");
    BAD_DENSE("sinks [h-1]", set_shape(&E->sinks, 0, H - 1), "sinks");
    BAD_DENSE("sinks ndim 2", set_ndim(&E->sinks, 2), "sinks");

    /* varlen-only arguments in the dense form */
    reset_varlen(E); /* only to get valid int32 tensors */
    fa_tensor used = E->used, cuk = E->cuk;
    BAD_DENSE("seqused_k without cu_seqlens", E->a.seqused_k = &used, "seqused_k");
    BAD_DENSE("cu_seqlens_k without cu_seqlens_q", E->a.cu_seqlens_k = &cuk, "cu_seqlens_q",
              "cu_seqlens_k");

    /* device */
    reset_dense(E);
    E->a.device = 1000;
    expect_invalid(E, "device 1000", 1, NAMES("device"));
    reset_dense(E);
    E->a.device = -2;
    expect_invalid(E, "device -2", 1, NAMES("device"));
}

static void varlen_checks(env *E)
{
    BAD_VARLEN("cu_seqlens_k NULL", E->a.cu_seqlens_k = NULL, "cu_seqlens_k");
    BAD_VARLEN("cu_seqlens_q data NULL", E->cuq.data = NULL, "cu_seqlens_q");
    BAD_VARLEN("cu_seqlens_q dtype f32", E->cuq.dtype = FA_DTYPE_F32, "cu_seqlens_q");
    BAD_VARLEN("cu_seqlens_k dtype f16", E->cuk.dtype = FA_DTYPE_F16, "cu_seqlens_k");
    BAD_VARLEN("cu_seqlens_q longer than cu_seqlens_k",
               (E->cuq_buf[3] = 10, set_shape(&E->cuq, 0, B + 2)), "cu_seqlens_q", "cu_seqlens_k");
    BAD_VARLEN("cu_seqlens_k shorter", set_shape(&E->cuk, 0, B), "cu_seqlens_k", "cu_seqlens_q");
    BAD_VARLEN("cu_seqlens_q ndim 2", set_ndim(&E->cuq, 2), "cu_seqlens_q");
    BAD_VARLEN("cu_seqlens_q empty", (set_shape(&E->cuq, 0, 0), set_shape(&E->cuk, 0, 0)),
               "cu_seqlens_q");
    BAD_VARLEN("cu_seqlens_q stride", E->cuq.stride[0] = 2, "cu_seqlens_q");
    BAD_VARLEN("cu_seqlens_q decreasing", E->cuq_buf[2] = 3, "cu_seqlens_q"); /* {0, 4, 3} */
    BAD_VARLEN("cu_seqlens_k decreasing", (E->cuk_buf[2] = 4, E->a.seqused_k = NULL),
               "cu_seqlens_k"); /* {0, 5, 4} */
    BAD_VARLEN("cu_seqlens_q negative start", E->cuq_buf[0] = -1, "cu_seqlens_q");
    /* (max_seqlen raised so that only the token count is wrong) */
    BAD_VARLEN("cu_seqlens_q past total_q",
               (E->cuq_buf[2] = TQ + 1, E->a.max_seqlen_q = 100, E->a.probs = NULL),
               "cu_seqlens_q");
    BAD_VARLEN("cu_seqlens_q far past total_q",
               (E->cuq_buf[1] = 1000000, E->cuq_buf[2] = 1000002, E->a.max_seqlen_q = 2000000,
                E->a.probs = NULL),
               "cu_seqlens_q");
    BAD_VARLEN("cu_seqlens_k past total_k",
               (E->cuk_buf[2] = TK + 1, E->a.max_seqlen_k = 100, E->a.probs = NULL),
               "cu_seqlens_k");
    BAD_VARLEN("sequence longer than max_seqlen_q", E->a.max_seqlen_q = 4, "max_seqlen_q",
               "cu_seqlens_q");
    BAD_VARLEN("sequence longer than max_seqlen_k",
               (E->a.seqused_k = NULL, E->a.max_seqlen_k = 6), "max_seqlen_k", "cu_seqlens_k");
    BAD_VARLEN("max_seqlen_q negative", E->a.max_seqlen_q = -1, "max_seqlen_q");
    BAD_VARLEN("max_seqlen_k negative", E->a.max_seqlen_k = -5, "max_seqlen_k");
    BAD_VARLEN("seqused_k beyond the sequence", E->used_buf[1] = 8, "seqused_k");
    BAD_VARLEN("seqused_k negative", E->used_buf[0] = -1, "seqused_k");
    BAD_VARLEN("seqused_k dtype", E->used.dtype = FA_DTYPE_F32, "seqused_k");
    BAD_VARLEN("seqused_k shape", set_shape(&E->used, 0, B + 1), "seqused_k");
    BAD_VARLEN("seqused_k data NULL", E->used.data = NULL, "seqused_k");
    BAD_VARLEN("q ndim 4", set_ndim(&E->q, 4), "q");
    BAD_VARLEN("k ndim 4", set_ndim(&E->k, 4), "k");
    BAD_VARLEN("v tokens != k tokens", set_shape(&E->v, 0, TK - 1), "v");
    BAD_VARLEN("out tokens", set_shape(&E->out, 0, TQ - 1), "out");
    BAD_VARLEN("out ndim 4", set_ndim(&E->out, 4), "out");
    BAD_VARLEN("lse [h, total_q+1]", set_shape(&E->lse, 1, TQ + 1), "lse");
    BAD_VARLEN("lse [total_q, h]", (set_shape(&E->lse, 0, TQ), set_shape(&E->lse, 1, H)), "lse");
    BAD_VARLEN("lse ndim 3", set_ndim(&E->lse, 3), "lse");
    BAD_VARLEN("probs rows < max_seqlen_q", set_shape(&E->probs, 2, 4), "probs");
    BAD_VARLEN("probs cols < max_seqlen_k", set_shape(&E->probs, 3, 6), "probs");
    BAD_VARLEN("alibi [b+1, h]", set_shape(&E->alibi, 0, B + 1), "alibi_slopes");
    BAD_VARLEN("dropout_p >= 1", E->a.dropout_p = 1.0, "dropout_p");
    BAD_VARLEN("window_left -3", E->a.window_left = -3, "window_left");
}

/* ---- the message is per thread ---------------------------------------------------------- */

typedef struct thread_ctx {
    int role;
    env E;
    pthread_barrier_t *bar;
    char first[256], second[256];
    fa_status st;
} thread_ctx;

static void *thread_main(void *p)
{
    thread_ctx *T = p;
    env *E = &T->E;
    reset_dense(E);
    if (T->role == 0) {
        E->a.dropout_p = 2.0;
        T->st = fa_attention_forward(&E->a);
        snprintf(T->first, sizeof T->first, "%s", fa_last_error());
        pthread_barrier_wait(T->bar); /* 1: thread 1 fails now */
        pthread_barrier_wait(T->bar); /* 2 */
        snprintf(T->second, sizeof T->second, "%s", fa_last_error());
    } else if (T->role == 1) {
        pthread_barrier_wait(T->bar); /* 1 */
        E->a.window_left = -9;
        T->st = fa_attention_forward(&E->a);
        snprintf(T->first, sizeof T->first, "%s", fa_last_error());
        pthread_barrier_wait(T->bar); /* 2 */
        snprintf(T->second, sizeof T->second, "%s", fa_last_error());
    } else {
        pthread_barrier_wait(T->bar); /* 1 */
        T->st = fa_attention_forward(&E->a); /* valid */
        snprintf(T->first, sizeof T->first, "%s", fa_last_error());
        pthread_barrier_wait(T->bar); /* 2 */
        snprintf(T->second, sizeof T->second, "%s", fa_last_error());
    }
    return NULL;
}

static void per_thread_checks(tu_rng *r)
{
    env M;
    env_init(&M, r);
    env *E = &M;
    /* the main thread fails with a "sinks" error first */
    BAD_DENSE("main thread: sinks dtype", E->sinks.dtype = FA_DTYPE_F64, "sinks");
    char main_msg[256];
    snprintf(main_msg, sizeof main_msg, "%s", fa_last_error());

    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, 3);
    thread_ctx *T = calloc(3, sizeof *T);
    pthread_t th[3];
    for (int i = 0; i < 3; i++) {
        T[i].role = i;
        T[i].bar = &bar;
        env_init(&T[i].E, r);
        pthread_create(&th[i], NULL, thread_main, &T[i]);
    }
    for (int i = 0; i < 3; i++) {
        pthread_join(th[i], NULL);
    }
    pthread_barrier_destroy(&bar);
    tu_where = "per-thread error message";
    TU_CHECK(T[0].st == FA_STATUS_INVALID_ARGUMENT, "thread 0: status %d", (int)T[0].st);
    TU_CHECK(tu_names(T[0].first, "dropout_p"), "thread 0: \"%s\" does not name dropout_p",
             T[0].first);
    TU_CHECK(strcmp(T[0].first, T[0].second) == 0,
             "thread 0's message changed after another thread failed: \"%s\" -> \"%s\"",
             T[0].first, T[0].second);
    TU_CHECK(T[1].st == FA_STATUS_INVALID_ARGUMENT, "thread 1: status %d", (int)T[1].st);
    TU_CHECK(tu_names(T[1].first, "window_left") && !tu_names(T[1].first, "dropout_p"),
             "thread 1: \"%s\" should name window_left only", T[1].first);
    TU_CHECK(strcmp(T[1].first, T[1].second) == 0, "thread 1's message changed: \"%s\" -> \"%s\"",
             T[1].first, T[1].second);
    TU_CHECK(T[2].st == FA_STATUS_OK, "thread 2: valid call failed: %s", T[2].first);
    TU_CHECK(T[2].first[0] == '\0' && T[2].second[0] == '\0',
             "thread 2 never failed but fa_last_error() is \"%s\" / \"%s\"", T[2].first,
             T[2].second);
    TU_CHECK(strcmp(main_msg, fa_last_error()) == 0,
             "the main thread's message changed while other threads ran: \"%s\" -> \"%s\"",
             main_msg, fa_last_error());
    for (int i = 0; i < 3; i++) {
        env_free(&T[i].E);
    }
    free(T);
    env_free(&M);
}

/* ---- a valid call after failed ones computes the right thing ----------------------------- */

static void check_against_ref(env *E, const char *label)
{
    tu_where = label;
    poison_outputs(E);
    fa_status st = fa_attention_forward(&E->a);
    TU_CHECK(st == FA_STATUS_OK, "status %d: %s", (int)st, fa_last_error());
    if (st != FA_STATUS_OK) {
        return;
    }
    int64_t tokens = E->varlen ? TQ : B * SQ;
    double ref[TQ * H * D + B * SQ * H * D], ref_lse[TQ * H + B * SQ * H];
    TU_CHECK(fa_ref_forward(&E->a, 1, ref, ref_lse) == 0, "reference failed");
    double maxerr = 0, maxref = 0, lse_err = 0;
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t hh = 0; hh < H; hh++) {
            for (int64_t x = 0; x < D; x++) {
                int64_t ix[4];
                if (E->varlen) {
                    ix[0] = t, ix[1] = hh, ix[2] = x;
                } else {
                    ix[0] = t / SQ, ix[1] = t % SQ, ix[2] = hh, ix[3] = x;
                }
                double ours = fa_ref_load(&E->out, ix), want = ref[(t * H + hh) * D + x];
                double err = isnan(ours) ? INFINITY : fabs(ours - want);
                maxerr = fmax(maxerr, err);
                maxref = fmax(maxref, fabs(want));
            }
            int64_t il[3];
            if (E->varlen) {
                il[0] = hh, il[1] = t;
            } else {
                il[0] = t / SQ, il[1] = hh, il[2] = t % SQ;
            }
            double ours = fa_ref_load(&E->lse, il), want = ref_lse[t * H + hh];
            double err = (isinf(want) && ours == want) ? 0.0 : fabs(ours - want);
            if (isnan(ours)) {
                err = INFINITY;
            }
            lse_err = fmax(lse_err, err / fmax(1.0, fabs(want)));
        }
    }
    TU_CHECK(maxerr <= 1e-5 * fmax(1.0, maxref), "out max err %.3g (max|ref| %.3g)", maxerr,
             maxref);
    TU_CHECK(lse_err <= 1e-5, "lse rel err %.3g", lse_err);
}

static void recovery_checks(env *E)
{
    reset_dense(E);
    E->a.dropout_p = 5.0;
    (void)fa_attention_forward(&E->a);
    reset_dense(E);
    E->a.causal = 1;
    E->a.probs = NULL;
    check_against_ref(E, "dense call after a failed one");
    reset_varlen(E);
    E->a.window_left = -4;
    (void)fa_attention_forward(&E->a);
    reset_varlen(E);
    E->a.probs = NULL;
    E->a.window_left = 2;
    check_against_ref(E, "varlen call after a failed one");
}

int main(void)
{
    uint64_t seed = tu_master_seed("test_errors");
    tu_rng rng = {seed};
    env Env;
    env_init(&Env, &rng);
    env *E = &Env;
    int ok_dense = check_baseline(E, 0);
    int ok_varlen = check_baseline(E, 1);
    if (ok_dense) {
        dense_checks(E);
    }
    if (ok_varlen) {
        varlen_checks(E);
    }
    per_thread_checks(&rng);
    recovery_checks(E);
    env_free(E);
    printf("test_errors: %d invalid-argument checks\n", g_checks);
    return tu_finish("test_errors");
}
