/*
 * test_block_mask: block sparsity (fa_block_mask) in the CPU forward.
 *
 * Each case draws a mask_mod (documents from an aux tensor, a band, or none), derives the block
 * states (skipped, partial, full) from the mask itself, sometimes perturbs them (a block mask
 * need not agree with its mask_mod: a skipped block drops keys mask_mod keeps, a full one keeps
 * keys it drops), lists them in FlexAttention's layout (shuffled, with garbage past the counts,
 * b and h dims of 1 or not), and checks out and lse against a double-precision oracle of the
 * rule: key j of row i is visible iff causal allows it and its block is full, or partial and
 * mask_mod keeps it. Where the states are the mask's own, the result is also bitwise the call
 * without a block mask. Then each bad argument is refused with a message naming it.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_ref.h"
#include "flashattn.h"
#include "test_util.h"

#define MAXB 2
#define MAXS 260

enum { M_DOC, M_BAND, M_NONE, M_KINDS };
static const char *const mask_names[M_KINDS] = {"documents", "band", "no mask_mod"};
enum { S_SKIP, S_PARTIAL, S_FULL };

typedef struct bcase {
    fa_dtype dt;
    int kind, causal, perturb, lists_full, bcast_b, bcast_h;
    int64_t b, h, hk, d, dv, sq, sk, qbl, kbl, nq, nk;
    int64_t band;
    int32_t doc[MAXB][MAXS];
} bcase;

static int mask_keeps(const bcase *c, int64_t b, int64_t i, int64_t j)
{
    switch (c->kind) {
    case M_DOC:
        return c->doc[b][i] == c->doc[b][j];
    case M_BAND:
        return llabs(i - j) <= c->band;
    default:
        return 1;
    }
}

static fa_mod *build_mask(const bcase *c)
{
    if (c->kind == M_NONE)
        return NULL;
    fa_mod *m = fa_mod_create();
    const int q = fa_mod_var(m, FA_MOD_Q_IDX), k = fa_mod_var(m, FA_MOD_KV_IDX);
    int root;
    if (c->kind == M_DOC) {
        const int bv = fa_mod_var(m, FA_MOD_B), iq[2] = {bv, q}, ik[2] = {bv, k};
        root = fa_mod_binary(m, FA_MOD_EQ, fa_mod_aux(m, 1, 2, iq), fa_mod_aux(m, 1, 2, ik));
    } else {
        const int dist = fa_mod_unary(m, FA_MOD_ABS, fa_mod_binary(m, FA_MOD_SUB, q, k));
        root = fa_mod_binary(m, FA_MOD_LE, dist, fa_mod_const(m, (double)c->band));
    }
    TU_CHECK(fa_mod_finish(m, root, FA_MOD_KIND_MASK) == FA_STATUS_OK, "mask: %s",
             fa_last_error());
    return m;
}

/* The state of block (qb, kb) of sequence b, head h as the block mask lists it: from the mask's
 * own keys, then perturbed by a hash of the position when the case says so. */
static int block_state(const bcase *c, int64_t b, int64_t h, int64_t qb, int64_t kb)
{
    int64_t kept = 0, all = 0;
    for (int64_t i = qb * c->qbl; i < (qb + 1) * c->qbl && i < c->sq; i++)
        for (int64_t j = kb * c->kbl; j < (kb + 1) * c->kbl && j < c->sk; j++) {
            kept += mask_keeps(c, b, i, j);
            all++;
        }
    int s = kept == 0 ? S_SKIP : kept == all ? S_FULL : S_PARTIAL;
    if (c->perturb) {
        const uint64_t x = (uint64_t)(((b * 31 + h) * 131 + qb) * 257 + kb) * 0x9e3779b97f4a7c15ull;
        if ((x >> 60) < 5) /* about a third of the blocks get another state */
            s = (int)((x >> 40) % 3);
    }
    return s == S_FULL && !c->lists_full ? S_PARTIAL : s;
}

/* Key j visible to row i: causal (bottom-right) and the block rule. */
static int visible(const bcase *c, const int *states, int64_t b, int64_t h, int64_t i, int64_t j)
{
    if (c->causal && j > i + c->sk - c->sq)
        return 0;
    const int64_t hb = c->bcast_h ? 0 : h, bb = c->bcast_b ? 0 : b;
    const int s = states[((bb * c->h + hb) * c->nq + i / c->qbl) * c->nk + j / c->kbl];
    return s == S_FULL || (s == S_PARTIAL && mask_keeps(c, b, i, j));
}

static void oracle(const bcase *c, const int *states, const fa_fwd_args *a, double *out,
                   double *lse)
{
    const double scale = 1.0 / sqrt((double)c->d);
    double *s = malloc(sizeof(double) * (size_t)c->sk);
    for (int64_t b = 0; b < c->b; b++)
        for (int64_t h = 0; h < c->h; h++) {
            const int64_t kh = h / (c->h / c->hk);
            for (int64_t i = 0; i < c->sq; i++) {
                double mx = -INFINITY, sum = 0;
                double *o = out + ((b * c->sq + i) * c->h + h) * c->dv;
                for (int64_t j = 0; j < c->sk; j++) {
                    double dot = 0;
                    for (int64_t e = 0; e < c->d; e++) {
                        int64_t qi[4] = {b, i, h, e}, ki[4] = {b, j, kh, e};
                        dot += fa_ref_load(a->q, qi) * fa_ref_load(a->k, ki);
                    }
                    s[j] = visible(c, states, b, h, i, j) ? dot * scale : -INFINITY;
                    mx = s[j] > mx ? s[j] : mx;
                }
                for (int64_t e = 0; e < c->dv; e++)
                    o[e] = 0;
                if (mx == -INFINITY) {
                    lse[(b * c->h + h) * c->sq + i] = INFINITY;
                    continue;
                }
                for (int64_t j = 0; j < c->sk; j++) {
                    const double p = exp(s[j] - mx);
                    sum += p;
                    for (int64_t e = 0; e < c->dv && p > 0; e++) {
                        int64_t vi[4] = {b, j, kh, e};
                        o[e] += p * fa_ref_load(a->v, vi);
                    }
                }
                for (int64_t e = 0; e < c->dv; e++)
                    o[e] /= sum;
                lse[(b * c->h + h) * c->sq + i] = mx + log(sum);
            }
        }
    free(s);
}

/* The block mask's tensors: [B, H, nqt] counts and [B, H, nqt, n] indices, listed in a shuffled
 * order with garbage past the counts (and now and then an index past the keys, which names no
 * key). */
typedef struct blists {
    int32_t *num, *idx, *fnum, *fidx;
    int64_t nqt, n;
    int64_t nshape[3], ishape[4];
    fa_tensor tnum, tidx, tfnum, tfidx;
    fa_block_mask bm;
} blists;

static void lists_make(const bcase *c, const int *states, tu_rng *r, blists *L)
{
    const int64_t B = c->bcast_b ? 1 : c->b, H = c->bcast_h ? 1 : c->h;
    L->nqt = c->nq + tu_rng_int(r, 0, 2);
    L->n = c->nk + tu_rng_int(r, 0, 2);
    const size_t rows = (size_t)(B * H * L->nqt);
    L->num = calloc(rows, sizeof(int32_t));
    L->fnum = calloc(rows, sizeof(int32_t));
    L->idx = malloc(rows * (size_t)L->n * sizeof(int32_t));
    L->fidx = malloc(rows * (size_t)L->n * sizeof(int32_t));
    for (size_t x = 0; x < rows * (size_t)L->n; x++) {
        L->idx[x] = (int32_t)tu_rng_int(r, -5, 1000); /* garbage past the counts */
        L->fidx[x] = (int32_t)tu_rng_int(r, -5, 1000);
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t qb = 0; qb < L->nqt; qb++) {
                const size_t row = (size_t)((b * H + h) * L->nqt + qb);
                int32_t *pi = L->idx + row * (size_t)L->n, *fi = L->fidx + row * (size_t)L->n;
                int32_t np = 0, nf = 0;
                for (int64_t kb = 0; qb < c->nq && kb < c->nk; kb++) {
                    const int s = states[((b * c->h + h) * c->nq + qb) * c->nk + kb];
                    if (s == S_PARTIAL)
                        pi[np++] = (int32_t)kb;
                    else if (s == S_FULL)
                        fi[nf++] = (int32_t)kb;
                }
                if (np < L->n && tu_rng_chance(r, 0.1))
                    pi[np++] = (int32_t)(c->nk + tu_rng_int(r, 0, 3)); /* past the keys */
                for (int32_t x = np - 1; x > 0; x--) { /* any order */
                    const int32_t y = (int32_t)tu_rng_int(r, 0, x), t = pi[x];
                    pi[x] = pi[y], pi[y] = t;
                }
                L->num[row] = np, L->fnum[row] = nf;
            }
    L->nshape[0] = L->ishape[0] = B;
    L->nshape[1] = L->ishape[1] = H;
    L->nshape[2] = L->ishape[2] = L->nqt;
    L->ishape[3] = L->n;
    L->tnum = fa_tensor_make(L->num, FA_DTYPE_I32, 3, L->nshape, NULL);
    L->tidx = fa_tensor_make(L->idx, FA_DTYPE_I32, 4, L->ishape, NULL);
    L->tfnum = fa_tensor_make(L->fnum, FA_DTYPE_I32, 3, L->nshape, NULL);
    L->tfidx = fa_tensor_make(L->fidx, FA_DTYPE_I32, 4, L->ishape, NULL);
    L->bm = (fa_block_mask){c->qbl, c->kbl, &L->tnum, &L->tidx, NULL, NULL};
    if (c->lists_full)
        L->bm.full_kv_num_blocks = &L->tfnum, L->bm.full_kv_indices = &L->tfidx;
}

static void lists_free(blists *L)
{
    free(L->num), free(L->idx), free(L->fnum), free(L->fidx);
}

static void compare(const bcase *c, const tu_tensor *out, const tu_tensor *lse, const double *want,
                    const double *want_lse, const char *what)
{
    const double tol = c->dt == FA_DTYPE_F64 ? 1e-10 : c->dt == FA_DTYPE_F32 ? 2e-5 : 8e-3;
    int bad = 0;
    for (int64_t b = 0; b < c->b && bad < 3; b++)
        for (int64_t i = 0; i < c->sq && bad < 3; i++)
            for (int64_t h = 0; h < c->h && bad < 3; h++) {
                int64_t li[3] = {b, h, i};
                const double gl = fa_ref_load(&lse->t, li), wl = want_lse[(b * c->h + h) * c->sq + i];
                if (!(gl == wl || fabs(gl - wl) <= 5e-5 * (1 + fabs(wl)))) {
                    bad++;
                    TU_CHECK(0, "%s: lse b %lld row %lld head %lld: got %.9g, want %.9g", what,
                             (long long)b, (long long)i, (long long)h, gl, wl);
                }
                for (int64_t e = 0; e < c->dv; e++) {
                    int64_t oi[4] = {b, i, h, e};
                    const double g = fa_ref_load(&out->t, oi);
                    const double w = want[((b * c->sq + i) * c->h + h) * c->dv + e];
                    if (!(fabs(g - w) <= tol * (1 + fabs(w)))) {
                        bad++;
                        TU_CHECK(0, "%s: out b %lld row %lld head %lld col %lld: got %.9g, want "
                                    "%.9g",
                                 what, (long long)b, (long long)i, (long long)h, (long long)e, g,
                                 w);
                        break;
                    }
                }
            }
}

static void run_case(bcase *c, tu_rng *r)
{
    char what[200];
    snprintf(what, sizeof what,
             "%s %s b=%lld h=%lld/%lld d=%lld sq=%lld sk=%lld blocks %lldx%lld%s%s%s",
             mask_names[c->kind], fa_dtype_name(c->dt), (long long)c->b, (long long)c->h,
             (long long)c->hk, (long long)c->d, (long long)c->sq, (long long)c->sk,
             (long long)c->qbl, (long long)c->kbl, c->causal ? " causal" : "",
             c->perturb ? " perturbed" : "", c->lists_full ? "" : " no full lists");
    tu_where = what;
    c->nq = (c->sq + c->qbl - 1) / c->qbl;
    c->nk = (c->sk + c->kbl - 1) / c->kbl;
    for (int64_t b = 0; b < c->b; b++) {
        int32_t doc = 0;
        for (int64_t j = 0; j < MAXS; j++) {
            doc += tu_rng_chance(r, 0.03);
            c->doc[b][j] = doc;
        }
    }
    /* States per (b, h) as listed; with a b or h dim of 1 every sequence / head takes those of
     * sequence / head 0. */
    int *states = malloc(sizeof(int) * (size_t)(c->b * c->h * c->nq * c->nk + 1));
    for (int64_t b = 0; b < c->b; b++)
        for (int64_t h = 0; h < c->h; h++)
            for (int64_t qb = 0; qb < c->nq; qb++)
                for (int64_t kb = 0; kb < c->nk; kb++)
                    states[((b * c->h + h) * c->nq + qb) * c->nk + kb] =
                        block_state(c, c->bcast_b ? 0 : b, c->bcast_h ? 0 : h, qb, kb);

    const int layout = (int)tu_rng_int(r, 0, TU_NUM_LAYOUTS - 1);
    int64_t qs[4] = {c->b, c->sq, c->h, c->d}, ks[4] = {c->b, c->sk, c->hk, c->d};
    int64_t vs[4] = {c->b, c->sk, c->hk, c->dv}, os[4] = {c->b, c->sq, c->h, c->dv};
    int64_t ls[3] = {c->b, c->h, c->sq};
    tu_tensor q = tu_tensor_new(c->dt, 4, qs, layout, r), k = tu_tensor_new(c->dt, 4, ks, layout, r);
    tu_tensor v = tu_tensor_new(c->dt, 4, vs, layout, r), out = tu_tensor_new(c->dt, 4, os, layout, r);
    const fa_dtype ldt = c->dt == FA_DTYPE_F64 ? FA_DTYPE_F64 : FA_DTYPE_F32;
    tu_tensor lse = tu_tensor_new(ldt, 3, ls, TU_CONTIGUOUS, r);
    tu_fill_uniform(&q, r, -1.5, 1.5);
    tu_fill_uniform(&k, r, -1.5, 1.5);
    tu_fill_uniform(&v, r, -1, 1);
    int64_t dshape[2] = {MAXB, MAXS};
    fa_tensor aux1 = fa_tensor_make(c->doc, FA_DTYPE_I32, 2, dshape, NULL);

    fa_mod *mask = build_mask(c);
    blists L;
    lists_make(c, states, r, &L);
    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.q = &q.t, a.k = &k.t, a.v = &v.t, a.out = &out.t, a.lse = &lse.t;
    a.causal = c->causal;
    a.num_threads = (int)tu_rng_int(r, 1, 3);
    a.mask_mod = mask;
    if (c->kind == M_DOC)
        a.mod_aux[1] = &aux1;
    a.block_mask = &L.bm;

    const size_t n_out = (size_t)(c->b * c->sq * c->h * c->dv), n_lse = (size_t)(c->b * c->h * c->sq);
    double *want = calloc(n_out + 1, sizeof(double)), *want_lse = calloc(n_lse + 1, sizeof(double));
    oracle(c, states, &a, want, want_lse);
    tu_poison(&out);
    tu_poison(&lse);
    fa_status st = fa_attention_forward(&a);
    TU_CHECK(st == FA_STATUS_OK, "forward failed: %s", fa_last_error());
    if (st == FA_STATUS_OK) {
        TU_CHECK(tu_count_poisoned_in_view(&out) == 0 && tu_count_poisoned_in_view(&lse) == 0,
                 "outputs left unwritten");
        TU_CHECK(tu_count_clobbered(&out) == 0 && tu_count_clobbered(&lse) == 0,
                 "wrote outside out/lse");
        compare(c, &out, &lse, want, want_lse, what);
    }

    /* The mask's own states with full lists: the same values as without a block mask (read
     * through fa_ref_load, exact for every dtype). Documents differ by sequence, so states
     * shared by every sequence are sequence 0's, not the others' own. */
    const int own = !c->perturb && c->lists_full && mask && !(c->bcast_b && c->kind == M_DOC);
    if (st == FA_STATUS_OK && own) {
        double *o1 = malloc(sizeof(double) * (n_out + 1)), *l1 = malloc(sizeof(double) * (n_lse + 1));
        size_t at = 0, diff = 0;
        for (int64_t b = 0; b < c->b; b++)
            for (int64_t i = 0; i < c->sq; i++)
                for (int64_t h = 0; h < c->h; h++) {
                    int64_t li[3] = {b, h, i};
                    l1[(b * c->h + h) * c->sq + i] = fa_ref_load(&lse.t, li);
                    for (int64_t e = 0; e < c->dv; e++) {
                        int64_t oi[4] = {b, i, h, e};
                        o1[at++] = fa_ref_load(&out.t, oi);
                    }
                }
        a.block_mask = NULL;
        tu_poison(&out);
        tu_poison(&lse);
        TU_CHECK(fa_attention_forward(&a) == FA_STATUS_OK, "without a block mask: %s",
                 fa_last_error());
        at = 0;
        for (int64_t b = 0; b < c->b; b++)
            for (int64_t i = 0; i < c->sq; i++)
                for (int64_t h = 0; h < c->h; h++) {
                    int64_t li[3] = {b, h, i};
                    diff += l1[(b * c->h + h) * c->sq + i] != fa_ref_load(&lse.t, li);
                    for (int64_t e = 0; e < c->dv; e++) {
                        int64_t oi[4] = {b, i, h, e};
                        diff += o1[at++] != fa_ref_load(&out.t, oi);
                    }
                }
        TU_CHECK(diff == 0, "%zu values differ from the call without a block mask", diff);
        free(o1), free(l1);
    }
    free(want), free(want_lse), free(states);
    lists_free(&L);
    fa_mod_destroy(mask);
    tu_tensor_free(&q), tu_tensor_free(&k), tu_tensor_free(&v);
    tu_tensor_free(&out), tu_tensor_free(&lse);
}

static void test_forward(tu_rng *r)
{
    static const fa_dtype dts[] = {FA_DTYPE_F32, FA_DTYPE_F64, FA_DTYPE_BF16, FA_DTYPE_F16};
    static const int64_t blocks[] = {1, 3, 16, 32, 64, 100, 128, 300};
    for (int n = 0; n < 60; n++) {
        bcase c = {0};
        c.dt = dts[n % 4];
        c.kind = (int)(n / 4 % M_KINDS);
        c.causal = tu_rng_chance(r, 0.4);
        c.perturb = tu_rng_chance(r, 0.5);
        c.lists_full = tu_rng_chance(r, 0.75);
        c.bcast_b = tu_rng_chance(r, 0.5);
        c.bcast_h = tu_rng_chance(r, 0.5);
        c.b = tu_rng_int(r, 1, MAXB);
        c.hk = tu_rng_int(r, 1, 2);
        c.h = c.hk * tu_rng_int(r, 1, 2);
        c.d = tu_rng_int(r, 1, 4) * 16;
        c.dv = tu_rng_chance(r, 0.3) ? 24 : c.d;
        c.sq = tu_rng_int(r, 1, MAXS);
        c.sk = tu_rng_int(r, 1, MAXS);
        c.qbl = blocks[tu_rng_int(r, 0, 7)];
        c.kbl = blocks[tu_rng_int(r, 0, 7)];
        if (c.qbl == 1 && c.kbl == 1)
            c.kbl = 16; /* keeps the states table small */
        c.band = tu_rng_int(r, 0, 90);
        run_case(&c, r);
    }
}

/* ---- errors --------------------------------------------------------------------------------- */

static void expect_error(fa_status st, const char *what, const char *w1, const char *w2)
{
    const char *msg = fa_last_error();
    TU_CHECK(st != FA_STATUS_OK, "%s: accepted", what);
    TU_CHECK(w1 == NULL || strstr(msg, w1), "%s: message '%s' lacks '%s'", what, msg, w1);
    TU_CHECK(w2 == NULL || strstr(msg, w2), "%s: message '%s' lacks '%s'", what, msg, w2);
}

static void test_errors(tu_rng *r)
{
    tu_where = "block_mask errors";
    const int64_t b = 2, h = 2, sq = 40, sk = 50, d = 16;
    int64_t qs[4] = {b, sq, h, d}, ks[4] = {b, sk, h, d}, ls[3] = {b, h, sq};
    tu_tensor q = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor k = tu_tensor_new(FA_DTYPE_F32, 4, ks, TU_CONTIGUOUS, r);
    tu_tensor v = tu_tensor_new(FA_DTYPE_F32, 4, ks, TU_CONTIGUOUS, r);
    tu_tensor out = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor lse = tu_tensor_new(FA_DTYPE_F32, 3, ls, TU_CONTIGUOUS, r);
    tu_fill_uniform(&q, r, -1, 1);
    tu_fill_uniform(&k, r, -1, 1);
    tu_fill_uniform(&v, r, -1, 1);
    /* q_block 16, kv_block 16: 3 query blocks, 4 key blocks. */
    int32_t num[2][2][3], idx[2][2][3][4], fnum[2][2][3];
    float fbad[2][2][3];
    for (int x = 0; x < 12; x++) {
        ((int32_t *)num)[x] = 2, ((int32_t *)fnum)[x] = 1, ((float *)fbad)[x] = 1;
    }
    for (int x = 0; x < 48; x++)
        ((int32_t *)idx)[x] = x % 4;
    int64_t ns[3] = {2, 2, 3}, is[4] = {2, 2, 3, 4}, short_ns[3] = {2, 2, 2}, bad_h[3] = {2, 3, 3};
    fa_tensor tn = fa_tensor_make(num, FA_DTYPE_I32, 3, ns, NULL);
    fa_tensor ti = fa_tensor_make(idx, FA_DTYPE_I32, 4, is, NULL);
    fa_tensor tf = fa_tensor_make(fnum, FA_DTYPE_I32, 3, ns, NULL);
    fa_tensor tbad = fa_tensor_make(fbad, FA_DTYPE_F32, 3, ns, NULL);
    fa_tensor tshort = fa_tensor_make(num, FA_DTYPE_I32, 3, short_ns, NULL);
    fa_tensor tbadh = fa_tensor_make(idx, FA_DTYPE_I32, 3, bad_h, NULL);
    fa_block_mask bm = {16, 16, &tn, &ti, NULL, NULL};
    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.q = &q.t, a.k = &k.t, a.v = &v.t, a.out = &out.t, a.lse = &lse.t;
    a.block_mask = &bm;
    TU_CHECK(fa_attention_forward(&a) == FA_STATUS_OK, "a good block mask: %s", fa_last_error());

    fa_block_mask x = bm;
    x.q_block = 0;
    a.block_mask = &x;
    expect_error(fa_attention_forward(&a), "q_block 0", "q_block", NULL);
    x = bm, x.kv_num_blocks = &tbad;
    expect_error(fa_attention_forward(&a), "fp32 counts", "block_mask.kv_num_blocks", "int32");
    x = bm, x.kv_num_blocks = &tshort;
    expect_error(fa_attention_forward(&a), "2 query blocks", "block_mask.kv_num_blocks", "3");
    x = bm, x.kv_num_blocks = &tbadh;
    expect_error(fa_attention_forward(&a), "3 heads", "block_mask.kv_num_blocks", "heads");
    x = bm, x.kv_indices = &tn;
    expect_error(fa_attention_forward(&a), "3-dim indices", "block_mask.kv_indices", "4 dims");
    x = bm, x.full_kv_num_blocks = &tf;
    expect_error(fa_attention_forward(&a), "full counts alone", "full_kv_indices", NULL);
    num[1][0][2] = 5;
    x = bm;
    expect_error(fa_attention_forward(&a), "count 5 of 4", "block_mask.kv_num_blocks[1, 0, 2]",
                 NULL);
    num[1][0][2] = 2;
    idx[0][1][1][1] = -3;
    expect_error(fa_attention_forward(&a), "index -3", "block_mask.kv_indices[0, 1, 1, 1]", NULL);
    idx[0][1][1][1] = 1;
    TU_CHECK(fa_attention_forward(&a) == FA_STATUS_OK, "restored: %s", fa_last_error());

    /* What takes no block mask yet: the backward, fp8, the varlen form. */
    fa_bwd_args bw;
    fa_bwd_args_init(&bw);
    tu_tensor dq = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor dk = tu_tensor_new(FA_DTYPE_F32, 4, ks, TU_CONTIGUOUS, r);
    tu_tensor dv = tu_tensor_new(FA_DTYPE_F32, 4, ks, TU_CONTIGUOUS, r);
    bw.fwd = &a, bw.dout = &out.t, bw.dq = &dq.t, bw.dk = &dk.t, bw.dv = &dv.t;
    TU_CHECK(fa_attention_backward(&bw) == FA_STATUS_OK, "backward with a block mask: %s",
             fa_last_error());

    int32_t cu[3] = {0, 20, 40}, cuk[3] = {0, 25, 50};
    int64_t n3[1] = {3}, vq[3] = {40, h, d}, vk[3] = {50, h, d};
    fa_tensor tcu = fa_tensor_make(cu, FA_DTYPE_I32, 1, n3, NULL);
    fa_tensor tcuk = fa_tensor_make(cuk, FA_DTYPE_I32, 1, n3, NULL);
    fa_tensor qv = fa_tensor_make(q.t.data, FA_DTYPE_F32, 3, vq, NULL);
    fa_tensor kv = fa_tensor_make(k.t.data, FA_DTYPE_F32, 3, vk, NULL);
    fa_tensor vv = fa_tensor_make(v.t.data, FA_DTYPE_F32, 3, vk, NULL);
    fa_tensor ov = fa_tensor_make(out.t.data, FA_DTYPE_F32, 3, vq, NULL);
    fa_fwd_args va = a;
    va.q = &qv, va.k = &kv, va.v = &vv, va.out = &ov, va.lse = NULL;
    va.cu_seqlens_q = &tcu, va.cu_seqlens_k = &tcuk, va.max_seqlen_q = 20, va.max_seqlen_k = 25;
    expect_error(fa_attention_forward(&va), "varlen", "block_mask", "dense");
    tu_tensor_free(&dq), tu_tensor_free(&dk), tu_tensor_free(&dv);
    tu_tensor_free(&q), tu_tensor_free(&k), tu_tensor_free(&v);
    tu_tensor_free(&out), tu_tensor_free(&lse);
}

/* ---- backward -------------------------------------------------------------------------------- */

enum { S_NONE, S_TANH, S_ALIBI, S_RELBIAS, S_SQUARE, S_WHERE, S_EXP, S_MAX, S_SQRT, S_MOD,
       S_KINDS };
static const char *const score_names[S_KINDS] = {"", " tanh", " alibi", " relbias", " square",
                                                 " where", " exp", " max", " sqrt", " mod"};

/* A score_mod of each kind (aux slot 2: fp32 slopes [h]; slot 3: fp32 bias [h, 21]). */
static fa_mod *build_score(int kind)
{
    if (kind == S_NONE)
        return NULL;
    fa_mod *m = fa_mod_create();
    const int s = fa_mod_var(m, FA_MOD_SCORE), q = fa_mod_var(m, FA_MOD_Q_IDX);
    const int k = fa_mod_var(m, FA_MOD_KV_IDX), hv = fa_mod_var(m, FA_MOD_H);
#define SB(op, x, y) fa_mod_binary(m, FA_MOD_##op, (x), (y))
#define SU(op, x) fa_mod_unary(m, FA_MOD_##op, (x))
#define SC(x) fa_mod_const(m, (x))
    int root;
    switch (kind) {
    case S_TANH:
        root = SB(MUL, SC(3), SU(TANH, SB(DIV, s, SC(3))));
        break;
    case S_ALIBI:
        root = SB(SUB, s, SB(MUL, fa_mod_aux(m, 2, 1, &hv), SU(ABS, SB(SUB, q, k))));
        break;
    case S_RELBIAS: {
        const int ix[2] = {hv, SB(ADD, SB(SUB, k, q), SC(10))};
        root = SB(ADD, s, fa_mod_aux(m, 3, 2, ix));
        break;
    }
    case S_SQUARE:
        root = SB(MUL, SB(MUL, s, s), SC(0.25));
        break;
    case S_WHERE:
        root = fa_mod_where(m, SB(GT, q, k), SB(MUL, s, SC(2)), SB(SUB, s, SC(1)));
        break;
    case S_EXP:
        root = SU(EXP, SB(DIV, s, SC(4)));
        break;
    case S_MAX:
        root = SB(MAX, s, SC(0.1));
        break;
    case S_SQRT:
        root = SU(SQRT, SB(ADD, SU(ABS, s), SC(1)));
        break;
    default: /* mod: a sawtooth in the score, and a division by the key position */
        root = SB(ADD, SB(MOD, s, SC(0.7)), SB(DIV, s, SB(ADD, k, SC(2))));
        break;
    }
#undef SB
#undef SU
#undef SC
    TU_CHECK(fa_mod_finish(m, root, FA_MOD_KIND_SCORE) == FA_STATUS_OK, "score: %s",
             fa_last_error());
    return m;
}

/* L = sum(out * g) of the forward a (fp64), for the finite differences. */
static double loss(fa_fwd_args *a, const tu_tensor *out, const double *g, const bcase *c)
{
    TU_CHECK(fa_attention_forward(a) == FA_STATUS_OK, "forward: %s", fa_last_error());
    double l = 0;
    for (int64_t b = 0; b < c->b; b++)
        for (int64_t i = 0; i < c->sq; i++)
            for (int64_t h = 0; h < c->h; h++)
                for (int64_t e = 0; e < c->dv; e++) {
                    int64_t oi[4] = {b, i, h, e};
                    l += fa_ref_load(&out->t, oi) * g[((b * c->sq + i) * c->h + h) * c->dv + e];
                }
    return l;
}

/* dq, dk, dv of calls with a mask_mod, a block mask (most of the time), a score_mod of each
 * kind (most of the time), softcap now and then, causal or not, in fp64 against central
 * differences of the forward at random elements; then the same call in fp32 and bf16 against
 * the fp64 gradients. */
static void test_backward(tu_rng *r)
{
    for (int n = 0; n < 3 + 2 * (S_KINDS - 1); n++) {
        bcase c = {0};
        c.dt = FA_DTYPE_F64;
        c.kind = n % 2 ? M_DOC : M_BAND;
        c.causal = tu_rng_chance(r, 0.5);
        c.perturb = tu_rng_chance(r, 0.5);
        c.lists_full = tu_rng_chance(r, 0.7);
        c.bcast_b = tu_rng_chance(r, 0.5), c.bcast_h = tu_rng_chance(r, 0.5);
        c.b = tu_rng_int(r, 1, 2), c.hk = tu_rng_int(r, 1, 2), c.h = c.hk * tu_rng_int(r, 1, 2);
        c.d = 8 * tu_rng_int(r, 1, 2), c.dv = c.d;
        c.sq = tu_rng_int(r, 1, 40), c.sk = tu_rng_int(r, 1, 40);
        c.qbl = tu_rng_int(r, 1, 16), c.kbl = tu_rng_int(r, 1, 16);
        c.band = tu_rng_int(r, 0, 10);
        const int skind = n < 3 ? S_NONE : (int)(1 + (n - 3) % (S_KINDS - 1));
        const int softcap = tu_rng_chance(r, 0.25), use_blocks = n % 3 != 2;
        char what[200];
        snprintf(what, sizeof what,
                 "backward %s%s%s b=%lld h=%lld/%lld sq=%lld sk=%lld blocks %lldx%lld%s%s%s",
                 mask_names[c.kind], score_names[skind], softcap ? " softcap" : "", (long long)c.b,
                 (long long)c.h, (long long)c.hk, (long long)c.sq, (long long)c.sk,
                 (long long)c.qbl, (long long)c.kbl, c.causal ? " causal" : "",
                 c.perturb ? " perturbed" : "", use_blocks ? "" : " no block mask");
        tu_where = what;
        c.nq = (c.sq + c.qbl - 1) / c.qbl, c.nk = (c.sk + c.kbl - 1) / c.kbl;
        for (int64_t b = 0; b < c.b; b++)
            for (int64_t j = 0, doc = 0; j < MAXS; j++) {
                doc += tu_rng_chance(r, 0.15);
                c.doc[b][j] = (int32_t)doc;
            }
        int *states = malloc(sizeof(int) * (size_t)(c.b * c.h * c.nq * c.nk + 1));
        for (int64_t b = 0; b < c.b; b++)
            for (int64_t h = 0; h < c.h; h++)
                for (int64_t qb = 0; qb < c.nq; qb++)
                    for (int64_t kb = 0; kb < c.nk; kb++)
                        states[((b * c.h + h) * c.nq + qb) * c.nk + kb] =
                            block_state(&c, c.bcast_b ? 0 : b, c.bcast_h ? 0 : h, qb, kb);
        blists L;
        lists_make(&c, states, r, &L);
        fa_mod *mask = build_mask(&c), *score = build_score(skind);
        int64_t qs[4] = {c.b, c.sq, c.h, c.d}, ks[4] = {c.b, c.sk, c.hk, c.d};
        int64_t ls[3] = {c.b, c.h, c.sq}, dshape[2] = {MAXB, MAXS};
        fa_tensor aux1 = fa_tensor_make(c.doc, FA_DTYPE_I32, 2, dshape, NULL);
        float slopes[4], bias[4][21];
        for (int x = 0; x < 4; x++) {
            slopes[x] = (float)tu_rng_uniform(r, 0.05, 0.5);
            for (int y = 0; y < 21; y++)
                bias[x][y] = (float)tu_rng_uniform(r, -1, 1);
        }
        int64_t hs[1] = {4}, bs[2] = {4, 21};
        fa_tensor aux2 = fa_tensor_make(slopes, FA_DTYPE_F32, 1, hs, NULL);
        fa_tensor aux3 = fa_tensor_make(bias, FA_DTYPE_F32, 2, bs, NULL);
        double *grads[3] = {NULL, NULL, NULL}; /* fp64 dq, dk, dv in index order */
        const fa_dtype dts[3] = {FA_DTYPE_F64, FA_DTYPE_F32, FA_DTYPE_BF16};
        /* The inputs' values, drawn once and rounded into each dtype. */
        const int64_t nq_el = c.b * c.sq * c.h * c.d, nk_el = c.b * c.sk * c.hk * c.d;
        double *vals[4];
        const int64_t counts[4] = {nq_el, nk_el, nk_el, nq_el};
        const double spans[4] = {1.5, 1.5, 1, 1};
        for (int w = 0; w < 4; w++) {
            vals[w] = malloc(sizeof(double) * (size_t)counts[w]);
            for (int64_t x = 0; x < counts[w]; x++)
                vals[w][x] = tu_rng_uniform(r, -spans[w], spans[w]);
        }
        /* bf16 rounding moves scores across a jump (mod) or a kink (abs in sqrt, max): there
         * its gradients are not the fp64 ones' to compare with */
        const int kinked = skind == S_MOD || skind == S_SQRT || skind == S_MAX;
        for (int di = 0; di < (kinked ? 2 : 3); di++) {
            const fa_dtype dt = dts[di], ldt = dt == FA_DTYPE_F64 ? FA_DTYPE_F64 : FA_DTYPE_F32;
            tu_tensor q = tu_tensor_new(dt, 4, qs, TU_CONTIGUOUS, r);
            tu_tensor k = tu_tensor_new(dt, 4, ks, TU_CONTIGUOUS, r);
            tu_tensor v = tu_tensor_new(dt, 4, ks, TU_CONTIGUOUS, r);
            tu_tensor out = tu_tensor_new(dt, 4, qs, TU_CONTIGUOUS, r);
            tu_tensor dout = tu_tensor_new(dt, 4, qs, TU_CONTIGUOUS, r);
            tu_tensor lse = tu_tensor_new(ldt, 3, ls, TU_CONTIGUOUS, r);
            tu_tensor dq = tu_tensor_new(dt, 4, qs, TU_CONTIGUOUS, r);
            tu_tensor dk = tu_tensor_new(dt, 4, ks, TU_CONTIGUOUS, r);
            tu_tensor dv = tu_tensor_new(dt, 4, ks, TU_CONTIGUOUS, r);
            tu_tensor *ins[4] = {&q, &k, &v, &dout};
            for (int w = 0; w < 4; w++) {
                int64_t idx[4] = {0, 0, 0, 0}, at = 0;
                do
                    fa_ref_store(&ins[w]->t, idx, vals[w][at++]);
                while (tu_next_index(&ins[w]->t, idx));
            }
            fa_fwd_args a;
            fa_fwd_args_init(&a);
            a.q = &q.t, a.k = &k.t, a.v = &v.t, a.out = &out.t, a.lse = &lse.t;
            a.causal = c.causal, a.mask_mod = mask, a.block_mask = use_blocks ? &L.bm : NULL;
            a.score_mod = score;
            a.softcap = softcap ? 4.0 : 0.0;
            a.num_threads = (int)tu_rng_int(r, 1, 3);
            if (c.kind == M_DOC)
                a.mod_aux[1] = &aux1;
            if (skind == S_ALIBI)
                a.mod_aux[2] = &aux2;
            if (skind == S_RELBIAS)
                a.mod_aux[3] = &aux3;
            TU_CHECK(fa_attention_forward(&a) == FA_STATUS_OK, "forward: %s", fa_last_error());
            fa_bwd_args bw;
            fa_bwd_args_init(&bw);
            bw.fwd = &a, bw.dout = &dout.t, bw.dq = &dq.t, bw.dk = &dk.t, bw.dv = &dv.t;
            tu_poison(&dq), tu_poison(&dk), tu_poison(&dv);
            TU_CHECK(fa_attention_backward(&bw) == FA_STATUS_OK, "%s backward: %s",
                     fa_dtype_name(dt), fa_last_error());
            const tu_tensor *gt[3] = {&dq, &dk, &dv};
            if (di == 0) {
                /* fp64: against central differences at a few random elements of each input */
                double *g = malloc(sizeof(double) * (size_t)(c.b * c.sq * c.h * c.dv + 1));
                for (int64_t x = 0; x < c.b * c.sq * c.h * c.dv; x++) {
                    int64_t oi[4] = {x / (c.sq * c.h * c.dv), x / (c.h * c.dv) % c.sq,
                                     x / c.dv % c.h, x % c.dv};
                    g[x] = fa_ref_load(&dout.t, oi);
                }
                tu_tensor *in[3] = {&q, &k, &v};
                const double eps = 1e-6;
                for (int w = 0; w < 3; w++) {
                    const int64_t numel = tu_numel(&in[w]->t);
                    grads[w] = malloc(sizeof(double) * (size_t)numel);
                    int64_t idx[4] = {0, 0, 0, 0}, at = 0;
                    do
                        grads[w][at++] = fa_ref_load(&gt[w]->t, idx);
                    while (tu_next_index(&gt[w]->t, idx));
                    for (int trial = 0; trial < 6; trial++) {
                        const int64_t e = tu_rng_int(r, 0, numel - 1);
                        double *x = (double *)in[w]->t.data + e; /* contiguous */
                        const double x0 = *x;
                        *x = x0 + eps;
                        const double lp = loss(&a, &out, g, &c);
                        *x = x0 - eps;
                        const double lm = loss(&a, &out, g, &c);
                        *x = x0;
                        const double fd = (lp - lm) / (2 * eps), got = grads[w][e];
                        int ok = fabs(fd - got) <= 1e-6 * (1 + fabs(fd));
                        if (!ok && kinked) {
                            /* a jump (mod) or kink (max, abs) of score_mod can lie between
                             * x0 - eps and x0 + eps; the one-sided difference on x0's side of
                             * it still holds, to first order in eps */
                            const double l0 = loss(&a, &out, g, &c);
                            const double fp = (lp - l0) / eps, fm = (l0 - lm) / eps;
                            ok = fabs(fp - got) <= 1e-4 * (1 + fabs(got)) ||
                                 fabs(fm - got) <= 1e-4 * (1 + fabs(got));
                        }
                        TU_CHECK(ok, "d%c element %lld: backward %.12g, differences %.12g",
                                 "qkv"[w], (long long)e, got, fd);
                    }
                }
                free(g);
            } else {
                const double tol = dt == FA_DTYPE_F32 ? 2e-4 : 6e-2;
                for (int w = 0; w < 3; w++) {
                    int64_t idx[4] = {0, 0, 0, 0}, at = 0;
                    int bad = 0;
                    do {
                        const double got = fa_ref_load(&gt[w]->t, idx), want = grads[w][at++];
                        if (!(fabs(got - want) <= tol * (1 + fabs(want))) && bad++ < 2)
                            TU_CHECK(0, "%s d%c element %lld: %.9g, fp64 %.9g", fa_dtype_name(dt),
                                     "qkv"[w], (long long)(at - 1), got, want);
                    } while (tu_next_index(&gt[w]->t, idx));
                }
            }
            tu_tensor_free(&q), tu_tensor_free(&k), tu_tensor_free(&v), tu_tensor_free(&out);
            tu_tensor_free(&dout), tu_tensor_free(&lse), tu_tensor_free(&dq);
            tu_tensor_free(&dk), tu_tensor_free(&dv);
        }
        for (int w = 0; w < 3; w++)
            free(grads[w]);
        for (int w = 0; w < 4; w++)
            free(vals[w]);
        free(states);
        lists_free(&L);
        fa_mod_destroy(mask);
        fa_mod_destroy(score);
    }
}

/* A mask_mod whose kept keys have a gap as wide as the keys causal cuts off the row's end
 * (|q_idx - kv_idx| <= 9 or kv_idx >= 18; sq 9, sk 27, so row i sees keys up to i + 18): the
 * forward must not take the row's kept keys for one contiguous run once causal narrows them. */
static void test_gap_cut(tu_rng *r)
{
    tu_where = "mask_mod gap as wide as the causal cut";
    enum { sq = 9, sk = 27, h = 2, d = 8 };
    fa_mod *m = fa_mod_create();
    const int q = fa_mod_var(m, FA_MOD_Q_IDX), k = fa_mod_var(m, FA_MOD_KV_IDX);
    const int dist = fa_mod_unary(m, FA_MOD_ABS, fa_mod_binary(m, FA_MOD_SUB, q, k));
    const int root = fa_mod_binary(m, FA_MOD_OR,
                                   fa_mod_binary(m, FA_MOD_LE, dist, fa_mod_const(m, 9)),
                                   fa_mod_binary(m, FA_MOD_GE, k, fa_mod_const(m, 18)));
    TU_CHECK(fa_mod_finish(m, root, FA_MOD_KIND_MASK) == FA_STATUS_OK, "mask: %s",
             fa_last_error());
    int64_t qs[4] = {1, sq, h, d}, ks[4] = {1, sk, h, d}, ls[3] = {1, h, sq};
    tu_tensor tq = tu_tensor_new(FA_DTYPE_F64, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor tk = tu_tensor_new(FA_DTYPE_F64, 4, ks, TU_CONTIGUOUS, r);
    tu_tensor tv = tu_tensor_new(FA_DTYPE_F64, 4, ks, TU_CONTIGUOUS, r);
    tu_tensor out = tu_tensor_new(FA_DTYPE_F64, 4, qs, TU_CONTIGUOUS, r);
    tu_tensor lse = tu_tensor_new(FA_DTYPE_F64, 3, ls, TU_CONTIGUOUS, r);
    tu_fill_uniform(&tq, r, -1.5, 1.5), tu_fill_uniform(&tk, r, -1.5, 1.5);
    tu_fill_uniform(&tv, r, -1, 1);
    tu_poison(&out), tu_poison(&lse);
    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.q = &tq.t, a.k = &tk.t, a.v = &tv.t, a.out = &out.t, a.lse = &lse.t;
    a.causal = 1, a.mask_mod = m, a.num_threads = 1;
    TU_CHECK(fa_attention_forward(&a) == FA_STATUS_OK, "forward: %s", fa_last_error());
    for (int64_t hh = 0; hh < h; hh++)
        for (int64_t i = 0; i < sq; i++) {
            double s[sk], mx = -INFINITY, sum = 0, o[d] = {0};
            for (int64_t j = 0; j < sk; j++) {
                double dot = 0;
                for (int64_t e = 0; e < d; e++) {
                    int64_t qi[4] = {0, i, hh, e}, ki[4] = {0, j, hh, e};
                    dot += fa_ref_load(&tq.t, qi) * fa_ref_load(&tk.t, ki);
                }
                const int keep = j <= i + sk - sq && (llabs(i - j) <= 9 || j >= 18);
                s[j] = keep ? dot / sqrt((double)d) : -INFINITY;
                mx = s[j] > mx ? s[j] : mx;
            }
            for (int64_t j = 0; j < sk; j++) {
                const double p = exp(s[j] - mx);
                sum += p;
                for (int64_t e = 0; e < d; e++) {
                    int64_t vi[4] = {0, j, hh, e};
                    o[e] += p * fa_ref_load(&tv.t, vi);
                }
            }
            int64_t li[3] = {0, hh, i};
            const double got_lse = fa_ref_load(&lse.t, li), want_lse = mx + log(sum);
            TU_CHECK(fabs(got_lse - want_lse) <= 1e-10 * (1 + fabs(want_lse)),
                     "row %lld head %lld: lse %.12g, want %.12g", (long long)i, (long long)hh,
                     got_lse, want_lse);
            for (int64_t e = 0; e < d; e++) {
                int64_t oi[4] = {0, i, hh, e};
                const double got = fa_ref_load(&out.t, oi), want = o[e] / sum;
                TU_CHECK(fabs(got - want) <= 1e-10, "row %lld head %lld col %lld: %.12g, want %.12g",
                         (long long)i, (long long)hh, (long long)e, got, want);
            }
        }
    tu_tensor_free(&tq), tu_tensor_free(&tk), tu_tensor_free(&tv);
    tu_tensor_free(&out), tu_tensor_free(&lse);
    fa_mod_destroy(m);
}

int main(void)
{
    tu_rng rng = {tu_master_seed("test_block_mask")};
    test_errors(&rng);
    test_gap_cut(&rng);
    test_forward(&rng);
    test_backward(&rng);
    return tu_finish("test_block_mask");
}
