/*
 * test_mod's captured-tensor gradients (fa_bwd_args.mod_aux_grad) on the CPU: the refusals, and
 * the gradients of score = score * scale[h] + bias[h, kv_idx - q_idx + S] (a per-head scale, a
 * relative-position table, fp32) in an fp64 call against a double-precision oracle written
 * here from the formula (P = softmax(s'), dS = P (dP - D), d scale[h] = sum dS s, d bias[h, r]
 * = sum of dS where kv - q + S = r); and the CUDA C of the same program's gradients
 * (fa_score_mod_aux_grad), which the GPU tests run.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flashattn.h"
#include "mod/fa_mod.h"
#include "test_mod.h"
#include "test_util.h"

enum { S = 23, H = 2, D = 8 };

static void expect_refused(fa_status st, const char *what, const char *word)
{
    TU_CHECK(st != FA_STATUS_OK, "%s: accepted", what);
    TU_CHECK(strstr(fa_last_error(), word) != NULL, "%s: '%s' lacks '%s'", what,
             fa_last_error(), word);
}

/* fa_score_mod_aux_grad's text for score * scale[h] + bias[h, kv - q + S]: a block per read,
 * each compiled only where FA_MOD_AUX_GRAD asks for its slot, the scale's derivative the score
 * and its add summed over the tile and the warp (its index reads only h), the table's 1 and its
 * add per lane, paired through the held elements of its read (the second). */
static void test_aux_grad_cuda_text(void)
{
    fa_mod *m = fa_mod_create();
    const int head[1] = {V(H)}, rel[2] = {V(H), B(ADD, B(SUB, V(KV_IDX), V(Q_IDX)), C(S))};
    const int root = B(ADD, B(MUL, V(SCORE), fa_mod_aux(m, 0, 1, head)), fa_mod_aux(m, 1, 2, rel));
    TU_CHECK(fa_mod_finish(m, root, FA_MOD_KIND_SCORE) == FA_STATUS_OK, "%s", fa_last_error());
    const char *fn = strstr(m->cuda, "FA_DEV void fa_score_mod_aux_grad(");
    TU_CHECK(fn != NULL, "no fa_score_mod_aux_grad in:\n%s", m->cuda);
    if (!fn) {
        fa_mod_destroy(m);
        return;
    }
    const char *b0 = strstr(fn, "#if (FA_MOD_AUX_GRAD >> 0) & 1");
    const char *b1 = strstr(fn, "#if (FA_MOD_AUX_GRAD >> 1) & 1");
    TU_CHECK(b0 && b1 && b0 < b1, "a block per read, in step order:\n%s", fn);
    char want[128];
    const int last = m->n_steps - 1;
    snprintf(want, sizeof want,
             "fa_mod_aux_grad_sum(kp, 0, go, g != 0.f ? g * d%d : 0.f, sum + 0, first, last);",
             last);
    TU_CHECK(b0 && b1 && strstr(b0, want) && strstr(b0, want) < b1, "scale's add '%s':\n%s",
             want, fn);
    snprintf(want, sizeof want,
             "fa_mod_aux_grad_pair(kp, 1, go, g != 0.f ? g * d%d : 0.f, from ? from + 1 : 0, "
             "to ? to + 1 : 0);",
             last);
    TU_CHECK(b1 && strstr(b1, want), "table's add '%s':\n%s", want, fn);
    /* the gradient's offsets through its own strides */
    TU_CHECK(b0 && strstr(b0, "const fa_mod_off go = fa_mod_goff_i(kp, 0, 0, "),
             "scale's offset:\n%s", fn);
    /* the product's rule seeded at the scale's read: x * dy (dx, the score's, is 0 there) */
    TU_CHECK(b0 && b1 && strstr(b0, "= x * dy;") && strstr(b0, "= x * dy;") < b1,
             "scale's derivative:\n%s", fn);
    fa_mod_destroy(m);
}

void tm_test_aux_grad(tu_rng *r)
{
    test_aux_grad_cuda_text();
    tu_where = "mod_aux_grad";
    const int64_t qs[4] = {1, S, H, D}, ls[3] = {1, H, S};
    tu_tensor q = tu_tensor_new(FA_DTYPE_F64, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor k = tu_tensor_new(FA_DTYPE_F64, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor v = tu_tensor_new(FA_DTYPE_F64, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor out = tu_tensor_new(FA_DTYPE_F64, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor lse = tu_tensor_new(FA_DTYPE_F64, 3, ls, TU_CONTIGUOUS, r);
    tu_tensor dout = tu_tensor_new(FA_DTYPE_F64, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor dq = tu_tensor_new(FA_DTYPE_F64, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor dk = tu_tensor_new(FA_DTYPE_F64, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor dv = tu_tensor_new(FA_DTYPE_F64, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor *in[] = {&q, &k, &v, &dout};
    for (int i = 0; i < 4; i++)
        tu_fill_uniform(in[i], r, -1, 1);
    float scale[H], bias[H][2 * S], gscale[H], gbias[H][2 * S];
    int32_t ibias[H][2 * S];
    for (int h = 0; h < H; h++) {
        scale[h] = (float)tu_rng_uniform(r, 0.5, 1.5);
        for (int j = 0; j < 2 * S; j++)
            bias[h][j] = (float)tu_rng_uniform(r, -1, 1), ibias[h][j] = j % 3;
    }
    const int64_t sh[1] = {H}, bh[2] = {H, 2 * S}, wrong[2] = {H, 2 * S - 1};
    fa_tensor t_scale = fa_tensor_make(scale, FA_DTYPE_F32, 1, sh, NULL);
    fa_tensor t_bias = fa_tensor_make(bias, FA_DTYPE_F32, 2, bh, NULL);
    fa_tensor t_ibias = fa_tensor_make(ibias, FA_DTYPE_I32, 2, bh, NULL);
    fa_tensor g_scale = fa_tensor_make(gscale, FA_DTYPE_F32, 1, sh, NULL);
    fa_tensor g_bias = fa_tensor_make(gbias, FA_DTYPE_F32, 2, bh, NULL);
    fa_tensor g_wrong = fa_tensor_make(gbias, FA_DTYPE_F32, 2, wrong, NULL);
    fa_tensor g_f16 = fa_tensor_make(gbias, FA_DTYPE_F16, 2, bh, NULL);

    fa_mod *m = fa_mod_create();
    const int hv = V(H), rel[2] = {V(H), B(ADD, B(SUB, V(KV_IDX), V(Q_IDX)), C(S))};
    const int root = B(ADD, B(MUL, V(SCORE), fa_mod_aux(m, 0, 1, &hv)), fa_mod_aux(m, 1, 2, rel));
    TU_CHECK(fa_mod_finish(m, root, FA_MOD_KIND_SCORE) == FA_STATUS_OK, "%s", fa_last_error());
    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.q = &q.t, a.k = &k.t, a.v = &v.t, a.out = &out.t, a.lse = &lse.t;
    a.score_mod = m, a.mod_aux[0] = &t_scale, a.mod_aux[1] = &t_bias;
    TU_CHECK(fa_attention_forward(&a) == FA_STATUS_OK, "forward: %s", fa_last_error());
    fa_bwd_args ba;
    fa_bwd_args_init(&ba);
    ba.fwd = &a, ba.dout = &dout.t, ba.dq = &dq.t, ba.dk = &dk.t, ba.dv = &dv.t;

    ba.mod_aux_grad[2] = &g_bias;
    expect_refused(fa_attention_backward(&ba), "an unread slot", "mod_aux_grad[2]");
    ba.mod_aux_grad[2] = NULL;
    ba.mod_aux_grad[1] = &g_wrong;
    expect_refused(fa_attention_backward(&ba), "a wrong shape", "mod_aux_grad[1]");
    ba.mod_aux_grad[1] = &g_f16;
    expect_refused(fa_attention_backward(&ba), "an fp16 gradient", "mod_aux_grad[1]");
    a.mod_aux[1] = &t_ibias;
    ba.mod_aux_grad[1] = &g_bias;
    expect_refused(fa_attention_backward(&ba), "an int32 tensor", "only an fp32 tensor");
    a.mod_aux[1] = &t_bias;
    ba.mod_aux_grad[1] = &t_bias; /* the gradient written over the table the backward reads */
    expect_refused(fa_attention_backward(&ba), "a gradient over its tensor", "overlaps mod_aux[1]");
    ba.mod_aux_grad[1] = &g_bias;

    for (int h = 0; h < H; h++) {
        gscale[h] = NAN;
        for (int j = 0; j < 2 * S; j++)
            gbias[h][j] = NAN;
    }
    ba.mod_aux_grad[0] = &g_scale;
    TU_CHECK(fa_attention_backward(&ba) == FA_STATUS_OK, "backward: %s", fa_last_error());

    /* The oracle, in double: s' = s * scale[h] + bias[h, j - i + S]. */
    const double *Q = q.t.data, *K = k.t.data, *V_ = v.t.data, *DO = dout.t.data;
    double wscale[H] = {0}, wbias[H][2 * S];
    memset(wbias, 0, sizeof wbias);
    for (int h = 0; h < H; h++)
        for (int i = 0; i < S; i++) {
            double s[S], p[S], dp[S], mx = -INFINITY, sum = 0, dsum = 0;
            for (int j = 0; j < S; j++) {
                double dot = 0;
                for (int x = 0; x < D; x++)
                    dot += Q[(i * H + h) * D + x] * K[(j * H + h) * D + x];
                s[j] = dot / sqrt((double)D);
                const double t = s[j] * scale[h] + bias[h][j - i + S];
                p[j] = t, mx = t > mx ? t : mx;
            }
            for (int j = 0; j < S; j++)
                p[j] = exp(p[j] - mx), sum += p[j];
            for (int j = 0; j < S; j++) {
                p[j] /= sum;
                dp[j] = 0;
                for (int x = 0; x < D; x++)
                    dp[j] += DO[(i * H + h) * D + x] * V_[(j * H + h) * D + x];
                dsum += p[j] * dp[j];
            }
            for (int j = 0; j < S; j++) {
                const double ds = p[j] * (dp[j] - dsum);
                wscale[h] += ds * s[j];
                wbias[h][j - i + S] += ds;
            }
        }
    double err = 0, big = 0;
    for (int h = 0; h < H; h++) {
        err = fmax(err, fabs(gscale[h] - wscale[h]));
        big = fmax(big, fabs(wscale[h]));
        for (int j = 0; j < 2 * S; j++) {
            err = fmax(err, fabs(gbias[h][j] - wbias[h][j]));
            big = fmax(big, fabs(wbias[h][j]));
        }
    }
    TU_CHECK(big > 1e-3 && err <= 1e-6 * big, "gradients off the oracle by %g (largest %g)", err,
             big);
    fa_mod_destroy(m);
    tu_tensor *all[] = {&q, &k, &v, &out, &lse, &dout, &dq, &dk, &dv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tu_tensor_free(all[i]);
}
