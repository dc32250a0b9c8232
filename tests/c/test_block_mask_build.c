/*
 * fa_block_mask_build (a block mask from a mask program, on the CPU) against an oracle that
 * evaluates the same rule pair by pair here: random sizes with edge blocks, document masks read
 * from a per-sequence int32 aux tensor (the program reads b), per-head windows from an fp32 aux
 * tensor (it reads h), a causal rule (it reads neither: one evaluation copied everywhere),
 * outputs in padded and permuted layouts, with and without the full lists; the lists' order
 * (the listed blocks ascending, then the others ascending); refusals naming the argument.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flashattn.h"
#include "block_mask_rules.h"
#include "test_util.h"


typedef struct bcase {
    int rule;
    int64_t b, h, sq, sk, qbs, kbs;
    int32_t *doc;  /* [b, doc_len]: the document of each position */
    int64_t doc_len;
    float *win;    /* [h]: keys kept behind each query */
} bcase;

static int keeps(const bcase *c, int64_t b, int64_t h, int64_t i, int64_t j)
{
    switch (c->rule) {
    case R_DOC: {
        /* positions past doc_len read its last entry, as the program's clamped reads */
        const int64_t di = i < c->doc_len ? i : c->doc_len - 1;
        const int64_t dj = j < c->doc_len ? j : c->doc_len - 1;
        return c->doc[b * c->doc_len + di] == c->doc[b * c->doc_len + dj] && j <= i;
    }
    case R_WINDOW: return j <= i && (float)(i - j) < c->win[h];
    default: return j <= i;
    }
}

static int32_t at(const tu_tensor *t, int64_t b, int64_t h, int64_t qb, int64_t i)
{
    const fa_tensor *v = &t->t;
    return ((const int32_t *)v->data)[b * v->stride[0] + h * v->stride[1] + qb * v->stride[2] +
                                      (v->ndim == 4 ? i * v->stride[3] : 0)];
}

/* One (b, h, qb)'s count and list against the oracle's states for blocks in `state`. */
static void check_list(const bcase *c, const tu_tensor *num, const tu_tensor *idx, int64_t b,
                       int64_t h, int64_t qb, const int *st, int64_t nk, int state,
                       const char *what)
{
    int64_t n = 0, k = 0;
    for (int64_t kb = 0; kb < nk; kb++)
        n += st[kb] == state;
    TU_CHECK(at(num, b, h, qb, 0) == n, "%s count at (%lld, %lld, %lld): %d, want %lld", what,
             (long long)b, (long long)h, (long long)qb, at(num, b, h, qb, 0), (long long)n);
    for (int pass = 0; pass < 2; pass++) /* those in the state, then the rest */
        for (int64_t kb = 0; kb < nk; kb++)
            if ((st[kb] == state) == (pass == 0)) {
                TU_CHECK(at(idx, b, h, qb, k) == kb, "%s at (%lld, %lld, %lld, %lld): %d, want "
                         "%lld", what, (long long)b, (long long)h, (long long)qb, (long long)k,
                         at(idx, b, h, qb, k), (long long)kb);
                k++;
            }
    (void)c;
}

/* Builds c's mask and checks it; returns its full blocks (the oracle's). */
static int64_t run_case(const bcase *c, const fa_mod *m, const fa_tensor *doc,
                        const fa_tensor *win, int full, int layout, tu_rng *r)
{
    const int64_t nq = (c->sq + c->qbs - 1) / c->qbs, nk = (c->sk + c->kbs - 1) / c->kbs;
    const int64_t s3[3] = {c->b, c->h, nq}, s4[4] = {c->b, c->h, nq, nk};
    tu_tensor num = tu_tensor_new(FA_DTYPE_I32, 3, s3, layout, r);
    tu_tensor idx = tu_tensor_new(FA_DTYPE_I32, 4, s4, layout, r);
    tu_tensor fnum = tu_tensor_new(FA_DTYPE_I32, 3, s3, layout, r);
    tu_tensor fidx = tu_tensor_new(FA_DTYPE_I32, 4, s4, layout, r);
    tu_tensor *outs[4] = {&num, &idx, &fnum, &fidx};
    for (int i = 0; i < 4; i++) /* poison */
        memset(outs[i]->base, 0xa5, outs[i]->nbytes);
    fa_block_mask_args a;
    fa_block_mask_args_init(&a);
    a.mask_mod = m;
    a.mod_aux[0] = c->rule == R_DOC ? doc : NULL;
    a.mod_aux[1] = c->rule == R_WINDOW ? win : NULL;
    a.b = c->b, a.h = c->h, a.sq = c->sq, a.sk = c->sk, a.q_block = c->qbs, a.kv_block = c->kbs;
    a.kv_num_blocks = &num.t, a.kv_indices = &idx.t;
    if (full)
        a.full_kv_num_blocks = &fnum.t, a.full_kv_indices = &fidx.t;
    const fa_status st = fa_block_mask_build(&a);
    TU_CHECK(st == FA_STATUS_OK, "build: %s", fa_last_error());
    int *states = malloc((size_t)nk * sizeof *states);
    int64_t partial = 0, fulls = 0;
    for (int64_t b = 0; b < c->b && st == FA_STATUS_OK; b++)
        for (int64_t h = 0; h < c->h; h++)
            for (int64_t qb = 0; qb < nq; qb++) {
                for (int64_t kb = 0; kb < nk; kb++) {
                    int64_t kept = 0;
                    for (int64_t i = qb * c->qbs; i < (qb + 1) * c->qbs && i < c->sq; i++)
                        for (int64_t j = kb * c->kbs; j < (kb + 1) * c->kbs && j < c->sk; j++)
                            kept += keeps(c, b, h, i, j);
                    states[kb] = kept == 0 ? 0 : full && kept == c->qbs * c->kbs ? 2 : 1;
                    partial += states[kb] == 1, fulls += states[kb] == 2;
                }
                check_list(c, &num, &idx, b, h, qb, states, nk, 1, "kv");
                if (full)
                    check_list(c, &fnum, &fidx, b, h, qb, states, nk, 2, "full_kv");
            }
    TU_CHECK(partial > 0, "no partial block: the case tests less than it says");
    free(states);
    for (int i = 0; i < 4; i++)
        tu_tensor_free(outs[i]);
    return fulls;
}

static void test_builds(tu_rng *r)
{
    int64_t fulls = 0;
    for (int it = 0; it < 28; it++) {
        bcase c = {0};
        c.rule = it % R_KINDS;
        c.b = 1 + (int64_t)(tu_rng_u64(r) % 3), c.h = 1 + (int64_t)(tu_rng_u64(r) % 3);
        c.sq = 20 + (int64_t)(tu_rng_u64(r) % 150), c.sk = 20 + (int64_t)(tu_rng_u64(r) % 150);
        static const int64_t blocks[] = {1, 4, 16, 32, 64};
        c.qbs = blocks[1 + tu_rng_u64(r) % 4], c.kbs = blocks[tu_rng_u64(r) % 5];
        if (it >= 24) /* one block past every row or every key: any size to 2^40 is valid */
            *(it % 2 ? &c.qbs : &c.kbs) = it < 26 ? (int64_t)1 << 40 : 1000;
        c.doc_len = c.sq > c.sk ? c.sq : c.sk;
        c.doc_len -= (int64_t)(tu_rng_u64(r) % 8); /* the last positions read past it */
        c.doc = malloc((size_t)(c.b * c.doc_len) * sizeof *c.doc);
        for (int64_t b = 0; b < c.b; b++) {
            int32_t d = 0;
            for (int64_t i = 0; i < c.doc_len; i++) {
                d += tu_rng_uniform(r, 0, 1) < 0.03;
                c.doc[b * c.doc_len + i] = d;
            }
        }
        c.win = malloc((size_t)c.h * sizeof *c.win);
        for (int64_t h = 0; h < c.h; h++)
            c.win[h] = (float)tu_rng_uniform(r, 1, 80);
        const fa_tensor doc = {c.doc, FA_DTYPE_I32, 2, {c.b, c.doc_len}, {c.doc_len, 1}};
        const fa_tensor win = {c.win, FA_DTYPE_F32, 1, {c.h}, {1}};
        fa_mod *m = rule_program(c.rule);
        char where[160];
        const int full = it % 2 == 0, layout = (it / 2) % TU_NUM_LAYOUTS;
        snprintf(where, sizeof where, "%s b %lld h %lld sq %lld sk %lld blocks %lld x %lld%s "
                 "layout %d", rule_names[c.rule], (long long)c.b, (long long)c.h,
                 (long long)c.sq, (long long)c.sk, (long long)c.qbs, (long long)c.kbs,
                 full ? " full" : "", layout);
        tu_where = where;
        fulls += run_case(&c, m, &doc, &win, full, layout, r);
        fa_mod_destroy(m);
        free(c.doc);
        free(c.win);
    }
    tu_where = "builds";
    TU_CHECK(fulls > 0, "no full block in any case: the full lists went untested");
}

static void expect_error(fa_status st, const char *what, const char *word)
{
    TU_CHECK(st != FA_STATUS_OK, "%s: accepted", what);
    TU_CHECK(strstr(fa_last_error(), word) != NULL, "%s: '%s' lacks '%s'", what,
             fa_last_error(), word);
}

static void test_errors(tu_rng *r)
{
    tu_where = "errors";
    fa_mod *m = rule_program(R_CAUSAL);
    const int64_t s3[3] = {1, 2, 4}, s4[4] = {1, 2, 4, 3}, s4b[4] = {1, 2, 4, 4};
    tu_tensor num = tu_tensor_new(FA_DTYPE_I32, 3, s3, TU_CONTIGUOUS, r);
    tu_tensor idx = tu_tensor_new(FA_DTYPE_I32, 4, s4, TU_CONTIGUOUS, r);
    tu_tensor wide = tu_tensor_new(FA_DTYPE_I32, 4, s4b, TU_CONTIGUOUS, r);
    tu_tensor f32 = tu_tensor_new(FA_DTYPE_F32, 3, s3, TU_CONTIGUOUS, r);
    fa_block_mask_args a;
    fa_block_mask_args_init(&a);
    a.mask_mod = m;
    a.b = 1, a.h = 2, a.sq = 64, a.sk = 40, a.q_block = 16, a.kv_block = 16;
    a.kv_num_blocks = &num.t, a.kv_indices = &idx.t;
    TU_CHECK(fa_block_mask_build(&a) == FA_STATUS_OK, "the valid call: %s", fa_last_error());
    fa_block_mask_args e = a;
    e.mask_mod = NULL;
    expect_error(fa_block_mask_build(&e), "no program", "mask_mod");
    e = a, e.q_block = 0;
    expect_error(fa_block_mask_build(&e), "q_block 0", "q_block");
    e = a, e.kv_indices = &wide.t;
    expect_error(fa_block_mask_build(&e), "a key-block dim of 4 (3 blocks)", "kv_indices");
    e = a, e.kv_num_blocks = &f32.t;
    expect_error(fa_block_mask_build(&e), "an fp32 count", "kv_num_blocks");
    e = a, e.full_kv_num_blocks = &num.t;
    expect_error(fa_block_mask_build(&e), "full counts without indices", "full_kv_indices");
    e = a, e.kv_indices = &num.t;
    expect_error(fa_block_mask_build(&e), "a 3-dim list", "kv_indices");
    e = a, e.mod_aux[2] = &idx.t;
    expect_error(fa_block_mask_build(&e), "an unread aux", "mod_aux[2]");
    e = a, e.device = 99;
    expect_error(fa_block_mask_build(&e), "a device that does not exist", "device");
    fa_mod *s = fa_mod_create();
    fa_mod_finish(s, fa_mod_var(s, FA_MOD_SCORE), FA_MOD_KIND_SCORE);
    e = a, e.mask_mod = s;
    expect_error(fa_block_mask_build(&e), "a score program", "mask_mod");
    expect_error(fa_block_mask_build(NULL), "NULL args", "args");
    fa_mod_destroy(s);
    fa_mod_destroy(m);
    tu_tensor *all[] = {&num, &idx, &wide, &f32};
    for (int i = 0; i < 4; i++)
        tu_tensor_free(all[i]);
}

int main(void)
{
    tu_rng rng = {tu_master_seed("test_block_mask_build")};
    test_errors(&rng);
    test_builds(&rng);
    return tu_finish("test_block_mask_build");
}
