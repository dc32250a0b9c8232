/*
 * test_paged: the varlen forward with paged k and v (fa_fwd_args.block_table) on the CPU.
 *
 * Random cases (every dtype, fp8 included; page sizes from 1 to 256; few rows, which take the
 * decode schedule, and many; causal, windows, GQA, ALiBi, sinks, softcap, dropout with probs,
 * seqused_k, empty sequences; random strides): the keys are scattered over a shuffled cache of
 * blocks (spare blocks nobody uses, block_table columns past every sequence holding ids outside
 * the cache) and copied in order into the dense varlen layout. The paged call must give out,
 * lse and probs bitwise equal to the dense call's (the same arithmetic on the same keys), write
 * every output element and nothing outside the views.
 * Then the refusals: each names its argument and leaves the outputs untouched.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flashattn.h"
#include "test_util.h"

#define MAXB 6

typedef struct paged_case {
    fa_dtype dt;
    int64_t b, h, hk, d, dv, page;
    int64_t lq[MAXB], lk[MAXB], used[MAXB];
    int causal, wl, wr, alibi, sinks, seqused, probs;
    double softcap, dropout_p;
} paged_case;

/* Element (blk, row, kh, c) of a [blocks, page, hk, dim] view, or (row, kh, c) of [rows, hk,
 * dim] when blk < 0: its byte offset. */
static size_t elem_at(const fa_tensor *t, int64_t blk, int64_t row, int64_t kh, int64_t c)
{
    const int o = blk < 0 ? 0 : 1;
    int64_t e = row * t->stride[o] + kh * t->stride[o + 1] + c * t->stride[o + 2];
    if (blk >= 0)
        e += blk * t->stride[0];
    return (size_t)e * fa_dtype_size(t->dtype);
}

/* Two contiguous results of one shape: bitwise equal (tol 0), or equal or within tol relative,
 * NaN where the other is NaN (fp32 or fp64 elements; other dtypes bitwise). */
static int same_within(const tu_tensor *a, const tu_tensor *b, double tol)
{
    if (tol == 0.0 || (a->t.dtype != FA_DTYPE_F64 && a->t.dtype != FA_DTYPE_F32))
        return memcmp(a->base, b->base, a->nbytes) == 0;
    const size_t n = a->nbytes / a->elem_size;
    for (size_t i = 0; i < n; i++) {
        double x, y;
        if (a->t.dtype == FA_DTYPE_F64) {
            x = ((const double *)a->base)[i], y = ((const double *)b->base)[i];
        } else {
            x = ((const float *)a->base)[i], y = ((const float *)b->base)[i];
        }
        if (x == y || (isnan(x) && isnan(y)))
            continue;
        if (!(fabs(x - y) <= tol * (1.0 + fabs(y))))
            return 0;
    }
    return 1;
}

static void run_case(const paged_case *c, tu_rng *r, int index)
{
    char where[160];
    snprintf(where, sizeof where, "case %d %s page %lld b %lld h %lld/%lld d %lld/%lld", index,
             fa_dtype_name(c->dt), (long long)c->page, (long long)c->b, (long long)c->h,
             (long long)c->hk, (long long)c->d, (long long)c->dv);
    tu_where = where;
    const int fp8 = c->dt == FA_DTYPE_F8E4M3;
    const fa_dtype out_dt = fp8 ? FA_DTYPE_BF16 : c->dt;
    int32_t cu_q[MAXB + 1] = {0}, cu_k[MAXB + 1] = {0}, used[MAXB];
    int64_t pages[MAXB], cols = 1, nb = 2, max_q = 1, max_k = 1;
    for (int64_t i = 0; i < c->b; i++) {
        cu_q[i + 1] = cu_q[i] + (int32_t)c->lq[i];
        cu_k[i + 1] = cu_k[i] + (int32_t)c->lk[i];
        used[i] = (int32_t)c->used[i];
        pages[i] = (c->lk[i] + c->page - 1) / c->page;
        cols = pages[i] + 1 > cols ? pages[i] + 1 : cols;
        nb += pages[i];
        max_q = c->lq[i] > max_q ? c->lq[i] : max_q;
        max_k = c->lk[i] > max_k ? c->lk[i] : max_k;
    }
    const int64_t tq = cu_q[c->b], tk = cu_k[c->b];
    const int64_t sq[3] = {tq, c->h, c->d}, so[3] = {tq, c->h, c->dv};
    const int64_t skd[3] = {tk, c->hk, c->d}, svd[3] = {tk, c->hk, c->dv};
    const int64_t skp[4] = {nb, c->page, c->hk, c->d}, svp[4] = {nb, c->page, c->hk, c->dv};
    const int64_t sl[2] = {c->h, tq}, sp[4] = {c->b, c->h, max_q + 1, max_k + 2};
    const int64_t sbt[2] = {c->b, cols}, scu[1] = {c->b + 1}, su[1] = {c->b}, sh[1] = {c->h};
    const int lay = (int)tu_rng_int(r, 0, TU_NUM_LAYOUTS - 1);
    tu_tensor q = tu_tensor_new(c->dt, 3, sq, lay, r);
    tu_tensor kd = tu_tensor_new(c->dt, 3, skd, lay, r), vd = tu_tensor_new(c->dt, 3, svd, lay, r);
    tu_tensor kp = tu_tensor_new(c->dt, 4, skp, lay, r), vp = tu_tensor_new(c->dt, 4, svp, lay, r);
    tu_tensor bt = tu_tensor_new(FA_DTYPE_I32, 2, sbt, TU_CONTIGUOUS, r);
    tu_tensor cq = tu_tensor_new(FA_DTYPE_I32, 1, scu, TU_CONTIGUOUS, r);
    tu_tensor ck = tu_tensor_new(FA_DTYPE_I32, 1, scu, TU_CONTIGUOUS, r);
    tu_tensor us = tu_tensor_new(FA_DTYPE_I32, 1, su, TU_CONTIGUOUS, r);
    tu_tensor al = tu_tensor_new(FA_DTYPE_F32, 1, sh, TU_CONTIGUOUS, r);
    tu_tensor sk = tu_tensor_new(FA_DTYPE_F32, 1, sh, TU_CONTIGUOUS, r);
    tu_tensor outs[2], lses[2], probs[2];
    for (int t = 0; t < 2; t++) {
        outs[t] = tu_tensor_new(out_dt, 3, so, TU_CONTIGUOUS, r); /* compared byte for byte */
        lses[t] = tu_tensor_new(FA_DTYPE_F32, 2, sl, TU_CONTIGUOUS, r);
        probs[t] = tu_tensor_new(c->dt, 4, sp, TU_CONTIGUOUS, r);
        tu_poison(&outs[t]);
        tu_poison(&lses[t]);
        tu_poison(&probs[t]);
    }
    tu_fill_uniform(&q, r, -1, 1);
    tu_fill_uniform(&kp, r, -1, 1);
    tu_fill_uniform(&vp, r, -1, 1);
    tu_fill_uniform(&al, r, 0.01, 0.3);
    tu_fill_uniform(&sk, r, -1, 1);
    memcpy(cq.t.data, cu_q, sizeof(int32_t) * (size_t)(c->b + 1));
    memcpy(ck.t.data, cu_k, sizeof(int32_t) * (size_t)(c->b + 1));
    memcpy(us.t.data, used, sizeof(int32_t) * (size_t)c->b);

    /* Blocks in a random order; the keys of sequence i copied into the dense layout in order. */
    int64_t *perm = malloc((size_t)nb * sizeof *perm);
    for (int64_t i = 0; i < nb; i++)
        perm[i] = i;
    for (int64_t i = nb - 1; i > 0; i--) {
        const int64_t j = tu_rng_int(r, 0, i), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    int32_t *table = bt.t.data;
    const size_t es = fa_dtype_size(c->dt);
    for (int64_t i = 0, next = 0; i < c->b; i++) {
        for (int64_t p = 0; p < cols; p++)
            table[i * cols + p] = p < pages[i] ? (int32_t)perm[next++]
                                  : p % 2          ? -5
                                                   : (int32_t)nb;
        for (int64_t j = 0; j < c->lk[i]; j++) {
            const int64_t blk = table[i * cols + j / c->page], row = j % c->page;
            for (int64_t kh = 0; kh < c->hk; kh++) {
                for (int64_t x = 0; x < c->d; x++)
                    memcpy((char *)kd.t.data + elem_at(&kd.t, -1, cu_k[i] + j, kh, x),
                           (char *)kp.t.data + elem_at(&kp.t, blk, row, kh, x), es);
                for (int64_t x = 0; x < c->dv; x++)
                    memcpy((char *)vd.t.data + elem_at(&vd.t, -1, cu_k[i] + j, kh, x),
                           (char *)vp.t.data + elem_at(&vp.t, blk, row, kh, x), es);
            }
        }
    }
    free(perm);

    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.q = &q.t;
    a.cu_seqlens_q = &cq.t;
    a.cu_seqlens_k = &ck.t;
    a.seqused_k = c->seqused ? &us.t : NULL;
    a.max_seqlen_q = max_q;
    a.max_seqlen_k = max_k;
    a.causal = c->causal;
    a.window_left = c->wl;
    a.window_right = c->wr;
    a.softcap = c->softcap;
    a.dropout_p = c->dropout_p;
    a.seed = 0x1234 + (uint64_t)index;
    a.offset = 5;
    a.alibi_slopes = c->alibi ? &al.t : NULL;
    a.sinks = c->sinks ? &sk.t : NULL;
    a.num_threads = (int)tu_rng_int(r, 1, 4);
    for (int t = 0; t < 2; t++) {
        fa_fwd_args x = a;
        x.k = t ? &kp.t : &kd.t;
        x.v = t ? &vp.t : &vd.t;
        x.block_table = t ? &bt.t : NULL;
        x.out = &outs[t].t;
        x.lse = &lses[t].t;
        x.probs = c->probs ? &probs[t].t : NULL;
        fa_status st = fa_attention_forward(&x);
        TU_CHECK(st == FA_STATUS_OK, "%s call: %s", t ? "paged" : "dense", fa_last_error());
    }
    /* fp64 few-row calls: the decode reads a block spanning two pages from a copy, whose fp64
     * dot products may round differently from the in-place ones (last bit). */
    const double tol = c->dt == FA_DTYPE_F64 ? 1e-13 : 0.0;
    TU_CHECK(same_within(&outs[0], &outs[1], tol),
             "out differs between the paged and the dense call");
    TU_CHECK(same_within(&lses[0], &lses[1], tol),
             "lse differs between the paged and the dense call");
    TU_CHECK(memcmp(probs[0].base, probs[1].base, probs[0].nbytes) == 0,
             "probs differ between the paged and the dense call");
    TU_CHECK(tu_count_poisoned_in_view(&outs[1]) == 0, "paged out not fully written");
    TU_CHECK(tu_count_clobbered(&outs[1]) == 0, "paged out written outside its view");

    tu_tensor all[] = {q, kd, vd, kp, vp, bt, cq, ck, us, al, sk, outs[0], outs[1], lses[0],
                       lses[1], probs[0], probs[1]};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tu_tensor_free(&all[i]);
}

static void random_case(paged_case *c, tu_rng *r)
{
    static const fa_dtype dts[] = {FA_DTYPE_F32, FA_DTYPE_F64, FA_DTYPE_F16, FA_DTYPE_BF16,
                                   FA_DTYPE_F8E4M3};
    static const int64_t page_sizes[] = {1, 2, 3, 7, 16, 64, 256};
    memset(c, 0, sizeof *c);
    c->dt = dts[tu_rng_int(r, 0, 4)];
    c->page = page_sizes[tu_rng_int(r, 0, 6)];
    c->b = tu_rng_int(r, 1, MAXB);
    c->hk = tu_rng_int(r, 1, 3);
    c->h = c->hk * tu_rng_int(r, 1, 4);
    const int fp8 = c->dt == FA_DTYPE_F8E4M3;
    c->d = fp8 ? 16 * tu_rng_int(r, 1, 8) : tu_rand_head_dim(r);
    c->dv = fp8 ? 16 * tu_rng_int(r, 1, 8) : tu_rng_chance(r, 0.7) ? c->d : tu_rand_head_dim(r);
    const int few = tu_rng_chance(r, 0.4);
    for (int64_t i = 0; i < c->b; i++) {
        c->lq[i] = tu_rng_chance(r, 0.1) ? 0 : tu_rng_int(r, 1, few ? FA_DECODE_MAX_ROWS : 200);
        c->lk[i] = tu_rng_chance(r, 0.1) ? 0 : tu_rng_int(r, 1, 600);
        c->used[i] = tu_rng_int(r, 0, c->lk[i]);
    }
    c->seqused = tu_rng_chance(r, 0.3);
    c->causal = tu_rng_chance(r, 0.4);
    c->wl = c->wr = -1;
    if (tu_rng_chance(r, 0.3)) {
        c->wl = tu_rand_window_side(r, 600);
        c->wr = tu_rand_window_side(r, 600);
    }
    c->alibi = tu_rng_chance(r, 0.25);
    c->sinks = tu_rng_chance(r, 0.25);
    if (!fp8 && tu_rng_chance(r, 0.2)) {
        c->dropout_p = tu_rng_uniform(r, 0.1, 0.6);
        c->probs = tu_rng_chance(r, 0.5);
    } else if (tu_rng_chance(r, 0.25)) {
        c->softcap = tu_rng_uniform(r, 1.0, 30.0);
    }
}

/* A valid paged call (page 4, two sequences, 6 and 9 keys in 2 + 3 blocks of 6) that each check
 * breaks in one way. */
typedef struct bad_env {
    float qb[64 * 8], kb[6 * 4 * 2 * 8], vb[6 * 4 * 2 * 8], ob[64 * 8], lb[64];
    int32_t cuq[3], cuk[3], table[2 * 4];
    fa_tensor q, k, v, out, lse, cq, ck, bt;
    fa_fwd_args a;
} bad_env;

static void bad_reset(bad_env *E)
{
    const int32_t cuq[3] = {0, 3, 7}, cuk[3] = {0, 6, 15}, table[8] = {5, 1, 0, 0, 0, 2, 4, 9};
    memcpy(E->cuq, cuq, sizeof cuq);
    memcpy(E->cuk, cuk, sizeof cuk);
    memcpy(E->table, table, sizeof table);
    for (size_t i = 0; i < sizeof E->kb / sizeof E->kb[0]; i++)
        E->kb[i] = E->vb[i] = (float)(i % 7) * 0.1f;
    for (size_t i = 0; i < sizeof E->qb / sizeof E->qb[0]; i++)
        E->qb[i] = (float)(i % 5) * 0.2f;
    E->q = fa_tensor_make(E->qb, FA_DTYPE_F32, 3, (int64_t[3]){7, 2, 8}, NULL);
    E->k = fa_tensor_make(E->kb, FA_DTYPE_F32, 4, (int64_t[4]){6, 4, 2, 8}, NULL);
    E->v = fa_tensor_make(E->vb, FA_DTYPE_F32, 4, (int64_t[4]){6, 4, 2, 8}, NULL);
    E->out = fa_tensor_make(E->ob, FA_DTYPE_F32, 3, (int64_t[3]){7, 2, 8}, NULL);
    E->lse = fa_tensor_make(E->lb, FA_DTYPE_F32, 2, (int64_t[2]){2, 7}, NULL);
    E->cq = fa_tensor_make(E->cuq, FA_DTYPE_I32, 1, (int64_t[1]){3}, NULL);
    E->ck = fa_tensor_make(E->cuk, FA_DTYPE_I32, 1, (int64_t[1]){3}, NULL);
    E->bt = fa_tensor_make(E->table, FA_DTYPE_I32, 2, (int64_t[2]){2, 4}, NULL);
    fa_fwd_args_init(&E->a);
    E->a.q = &E->q, E->a.k = &E->k, E->a.v = &E->v, E->a.out = &E->out, E->a.lse = &E->lse;
    E->a.cu_seqlens_q = &E->cq, E->a.cu_seqlens_k = &E->ck, E->a.block_table = &E->bt;
    E->a.max_seqlen_q = 4;
    E->a.max_seqlen_k = 9;
    E->a.num_threads = 1;
}

static void expect_bad(bad_env *E, const char *label, fa_status want, const char *name)
{
    tu_where = label;
    for (size_t i = 0; i < sizeof E->ob / sizeof E->ob[0]; i++)
        E->ob[i] = 12345.0f;
    fa_status st = fa_attention_forward(&E->a);
    TU_CHECK(st == want, "status %d, expected %d (%s)", (int)st, (int)want, fa_last_error());
    TU_CHECK(tu_names(fa_last_error(), name), "message \"%s\" does not name %s",
             fa_last_error(), name);
    int touched = 0;
    for (size_t i = 0; i < sizeof E->ob / sizeof E->ob[0]; i++)
        touched |= E->ob[i] != 12345.0f;
    TU_CHECK(!touched, "a refused call wrote out");
}

#define BAD(label, mutation, name)                                                                \
    do {                                                                                          \
        bad_reset(&E);                                                                            \
        mutation;                                                                                 \
        expect_bad(&E, label, FA_STATUS_INVALID_ARGUMENT, name);                                  \
    } while (0)

static void refusals(void)
{
    static bad_env E;
    bad_reset(&E);
    tu_where = "the valid paged call";
    TU_CHECK(fa_attention_forward(&E.a) == FA_STATUS_OK, "%s", fa_last_error());
    BAD("dense form", (E.a.cu_seqlens_q = E.a.cu_seqlens_k = NULL), "block_table");
    BAD("k 3 dims", E.k.ndim = 3, "k");
    BAD("v blocks", E.v.shape[0] = 5, "v");
    BAD("v page size", (E.v.shape[1] = 2, E.v.shape[0] = 12), "v");
    BAD("page size 0", (E.k.shape[1] = E.v.shape[1] = 0), "k");
    BAD("block_table dtype", E.bt.dtype = FA_DTYPE_F32, "block_table");
    BAD("block_table rows", (E.bt.shape[0] = 1, E.bt.shape[1] = 8), "block_table");
    BAD("block_table 1 dim", E.bt.ndim = 1, "block_table");
    BAD("block id negative", E.table[1] = -1, "block_table");
    BAD("block id past the cache", E.table[6] = 6, "block_table");
    BAD("more keys than the row holds", (E.cuk[2] = 23, E.a.max_seqlen_k = 17), "block_table");
    /* Columns past a sequence's keys are never read: any value there is fine. */
    bad_reset(&E);
    E.table[2] = -100, E.table[3] = 1 << 30;
    tu_where = "padding columns";
    TU_CHECK(fa_attention_forward(&E.a) == FA_STATUS_OK, "%s", fa_last_error());

    /* No paged backward, as upstream. */
    bad_reset(&E);
    float dq[64 * 8], dk[6 * 4 * 2 * 8], dv[6 * 4 * 2 * 8];
    fa_tensor tdq = E.q, tdk = E.k, tdv = E.v, tdo = E.out;
    tdq.data = dq, tdk.data = dk, tdv.data = dv, tdo.data = E.qb;
    fa_bwd_args b;
    fa_bwd_args_init(&b);
    b.fwd = &E.a, b.dout = &tdo, b.dq = &tdq, b.dk = &tdk, b.dv = &tdv;
    tu_where = "backward";
    TU_CHECK(fa_attention_backward(&b) == FA_STATUS_UNSUPPORTED &&
                 tu_names(fa_last_error(), "block_table"),
             "backward with block_table: %s", fa_last_error());
}

int main(void)
{
    tu_rng r = {tu_master_seed("test_paged")};
    const char *env = getenv("FA_TEST_RANDOM_CASES");
    const int n = env ? atoi(env) : 150;
    for (int i = 0; i < n; i++) {
        paged_case c;
        random_case(&c, &r);
        run_case(&c, &r, i);
    }
    /* MLA's head dims (d 576 / dv 512, MQA), enough rows for the tiled forward: a block's V
     * rows on several pages are gathered a slice of columns at a time. */
    static const fa_dtype wide_dts[] = {FA_DTYPE_BF16, FA_DTYPE_F16, FA_DTYPE_F32};
    for (int i = 0; i < 6; i++) {
        paged_case c;
        memset(&c, 0, sizeof c);
        c.dt = wide_dts[i % 3];
        c.page = i < 3 ? 7 : 16;
        c.b = 2, c.hk = 1, c.h = 2, c.d = 576, c.dv = 512;
        for (int64_t s = 0; s < c.b; s++) {
            c.lq[s] = tu_rng_int(&r, 40, 90);
            c.lk[s] = tu_rng_int(&r, 150, 300);
            c.used[s] = c.lk[s];
        }
        c.causal = i & 1;
        c.wl = c.wr = -1;
        run_case(&c, &r, n + i);
    }
    refusals();
    return tu_finish("test_paged");
}
