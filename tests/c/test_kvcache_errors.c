/*
 * test_kvcache_errors: every bad argument of fa_attention_kvcache and fa_attention_combine is
 * refused with FA_STATUS_INVALID_ARGUMENT and a message naming it, before anything is written:
 * the caches keep every byte and out keeps its poison. Bad block tables and indices must be
 * errors, never out-of-bounds accesses (run it under a sanitizer to see that too).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_ref.h"
#include "flashattn.h"
#include "test_util.h"

enum { B = 2, SQ = 2, H = 4, HK = 2, D = 16, PAGE = 4, MAXB = 3, NBLK = 7, SNEW = 2, RO = 12 };

typedef struct eprob {
    tu_tensor q, kc, vc, kn, vn, cos, sin, out, lse;
    int32_t seqlens[B], leftpad[B], bidx[B], table[B * MAXB];
    fa_tensor tseq, tlp, tbidx, ttable;
    fa_kvcache_args a;
} eprob;

/* A valid paged call: sequences of 5 and 9 positions (+2 new) in blocks of 4, rotary. */
static void eprob_init(eprob *E, tu_rng *r)
{
    memset(E, 0, sizeof *E);
    int64_t qs[4] = {B, SQ, H, D}, cs[4] = {NBLK, PAGE, HK, D}, ns[4] = {B, SNEW, HK, D};
    int64_t ros[2] = {RO, 4}, ls[3] = {B, H, SQ}, bs[1] = {B}, ts[2] = {B, MAXB};
    E->q = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    E->kc = tu_tensor_new(FA_DTYPE_F32, 4, cs, TU_PADDED, r);
    E->vc = tu_tensor_new(FA_DTYPE_F32, 4, cs, TU_PADDED, r);
    E->kn = tu_tensor_new(FA_DTYPE_F32, 4, ns, TU_CONTIGUOUS, r);
    E->vn = tu_tensor_new(FA_DTYPE_F32, 4, ns, TU_CONTIGUOUS, r);
    E->cos = tu_tensor_new(FA_DTYPE_F32, 2, ros, TU_CONTIGUOUS, r);
    E->sin = tu_tensor_new(FA_DTYPE_F32, 2, ros, TU_CONTIGUOUS, r);
    E->out = tu_tensor_new(FA_DTYPE_F32, 4, qs, TU_CONTIGUOUS, r);
    E->lse = tu_tensor_new(FA_DTYPE_F32, 3, ls, TU_CONTIGUOUS, r);
    tu_tensor *fill[] = {&E->q, &E->kc, &E->vc, &E->kn, &E->vn, &E->cos, &E->sin};
    for (size_t i = 0; i < sizeof fill / sizeof fill[0]; i++)
        tu_fill_uniform(fill[i], r, -1.0, 1.0);
    tu_poison(&E->out);
    tu_poison(&E->lse);
    E->seqlens[0] = 5;
    E->seqlens[1] = 9;
    E->leftpad[0] = 1;
    E->leftpad[1] = 4;
    E->bidx[0] = 1;
    E->bidx[1] = 0;
    const int32_t table[B * MAXB] = {6, 2, -1, 99, 0, 4}; /* unused entries may be anything */
    memcpy(E->table, table, sizeof table);
    E->tseq = fa_tensor_make(E->seqlens, FA_DTYPE_I32, 1, bs, NULL);
    E->tlp = fa_tensor_make(E->leftpad, FA_DTYPE_I32, 1, bs, NULL);
    E->tbidx = fa_tensor_make(E->bidx, FA_DTYPE_I32, 1, bs, NULL);
    E->ttable = fa_tensor_make(E->table, FA_DTYPE_I32, 2, ts, NULL);
    fa_kvcache_args *a = &E->a;
    fa_kvcache_args_init(a);
    a->q = &E->q.t;
    a->k_cache = &E->kc.t;
    a->v_cache = &E->vc.t;
    a->k = &E->kn.t;
    a->v = &E->vn.t;
    a->rotary_cos = &E->cos.t;
    a->rotary_sin = &E->sin.t;
    a->cache_seqlens = &E->tseq;
    a->cache_leftpad = &E->tlp;
    a->block_table = &E->ttable;
    a->out = &E->out.t;
    a->lse = &E->lse.t;
    a->causal = 1;
}

static void eprob_free(eprob *E)
{
    tu_tensor *all[] = {&E->q, &E->kc, &E->vc, &E->kn, &E->vn, &E->cos, &E->sin, &E->out, &E->lse};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tu_tensor_free(all[i]);
}

typedef void (*mutate_fn)(eprob *E);

/* Runs the call after `mutate`; expects `want` naming `name`, and nothing written. */
static void expect_refused(const char *what, mutate_fn mutate, fa_status want, const char *name,
                           tu_rng *r)
{
    eprob E;
    eprob_init(&E, r);
    mutate(&E);
    void *kc0 = malloc(E.kc.nbytes), *vc0 = malloc(E.vc.nbytes);
    memcpy(kc0, E.kc.base, E.kc.nbytes);
    memcpy(vc0, E.vc.base, E.vc.nbytes);
    tu_where = what;
    fa_status st = fa_attention_kvcache(&E.a);
    const char *msg = fa_last_error();
    TU_CHECK(st == want, "status %d (%s), expected %d; message: %s", (int)st,
             fa_status_string(st), (int)want, msg);
    TU_CHECK(tu_names(msg, name), "message does not name %s: %s", name, msg);
    TU_CHECK(memcmp(kc0, E.kc.base, E.kc.nbytes) == 0, "k_cache was written");
    TU_CHECK(memcmp(vc0, E.vc.base, E.vc.nbytes) == 0, "v_cache was written");
    TU_CHECK(tu_count_poisoned_in_view(&E.out) == tu_numel(&E.out.t), "out was written");
    free(kc0);
    free(vc0);
    eprob_free(&E);
}

static void m_none(eprob *E) { (void)E; }
static void m_block_big(eprob *E) { E->table[1] = NBLK; }
static void m_block_neg(eprob *E) { E->table[4] = -3; }
static void m_block_before_leftpad(eprob *E) { E->leftpad[1] = 3; } /* block 0 of seq 1 is 99 */
static void m_too_few_blocks(eprob *E) { E->seqlens[1] = 11; }      /* 11 + 2 > 3 * 4 */
static void m_seqlens_neg(eprob *E) { E->seqlens[0] = -1; }
static void m_seqlens_dtype(eprob *E) { E->tseq.dtype = FA_DTYPE_F32; }
static void m_seqlens_shape(eprob *E) { E->tseq.shape[0] = 1; }
static void m_seqlens_missing(eprob *E) { E->a.cache_seqlens = NULL; }
static void m_leftpad_big(eprob *E) { E->leftpad[0] = 6; }
static void m_leftpad_neg(eprob *E) { E->leftpad[1] = -1; }
static void m_bidx_paged(eprob *E) { E->a.cache_batch_idx = &E->tbidx; }
static void m_page_zero(eprob *E)
{
    E->kc.t.shape[1] = 0;
    E->vc.t.shape[1] = 0;
}
static void m_no_v(eprob *E) { E->a.v = NULL; }
static void m_no_k(eprob *E) { E->a.k = NULL; }
static void m_k_heads(eprob *E) { E->kn.t.shape[2] = 1; }
static void m_v_len(eprob *E) { E->vn.t.shape[1] = 1; }
static void m_rotary_no_sin(eprob *E) { E->a.rotary_sin = NULL; }
static void m_rotary_no_k(eprob *E)
{
    E->a.k = NULL;
    E->a.v = NULL;
}
static void m_rotary_short(eprob *E) { E->cos.t.shape[0] = E->sin.t.shape[0] = 10; }
static void m_rotary_wide(eprob *E)
{
    E->cos.t.shape[1] = E->sin.t.shape[1] = 9; /* rotary_dim 18 > 16 */
}
static void m_rotary_dtype(eprob *E) { E->cos.t.dtype = FA_DTYPE_F64; }
static void m_sin_shape(eprob *E) { E->sin.t.shape[1] = 3; }
static void m_splits_big(eprob *E) { E->a.num_splits = FA_MAX_SPLITS + 1; }
static void m_splits_neg(eprob *E) { E->a.num_splits = -1; }
static void m_kc_dtype(eprob *E) { E->kc.t.dtype = FA_DTYPE_F16; }
static void m_vc_blocks(eprob *E) { E->vc.t.shape[0] = NBLK - 1; }
static void m_heads(eprob *E)
{
    E->kc.t.shape[2] = E->vc.t.shape[2] = 3;
    E->kn.t.shape[2] = E->vn.t.shape[2] = 3;
}
static void m_out_shape(eprob *E) { E->out.t.shape[2] = H - 1; }
static void m_lse_shape(eprob *E) { E->lse.t.shape[2] = SQ + 1; }
static void m_q_dim(eprob *E) { E->q.t.shape[3] = FA_MAX_HEAD_DIM + 1; }
static void m_window(eprob *E) { E->a.window_left = -2; }
static void m_threads(eprob *E) { E->a.num_threads = -1; }
static void m_device(eprob *E) { E->a.device = 4096; /* no such device anywhere */ }
static void m_contig_overflow(eprob *E)
{
    E->a.block_table = NULL; /* a contiguous cache of 7 rows of 4 positions */
    E->a.cache_leftpad = NULL;
    E->seqlens[0] = 3;
}
static void m_contig_bidx(eprob *E)
{
    E->a.block_table = NULL;
    E->a.cache_leftpad = NULL;
    E->a.rotary_cos = E->a.rotary_sin = NULL;
    E->seqlens[0] = E->seqlens[1] = 0;
    E->a.cache_batch_idx = &E->tbidx;
    E->bidx[1] = NBLK;
}
static void m_contig_small_batch(eprob *E)
{
    E->a.block_table = NULL;
    E->a.cache_leftpad = NULL;
    E->a.rotary_cos = E->a.rotary_sin = NULL;
    E->seqlens[0] = E->seqlens[1] = 0;
    E->kc.t.shape[0] = E->vc.t.shape[0] = 1;
}

static void run_kvcache_checks(tu_rng *r)
{
    /* The baseline itself must pass, and leave the cache usable. */
    {
        eprob E;
        eprob_init(&E, r);
        fa_status st = fa_attention_kvcache(&E.a);
        tu_where = "valid baseline";
        TU_CHECK(st == FA_STATUS_OK, "baseline refused: %s", fa_last_error());
        TU_CHECK(tu_count_poisoned_in_view(&E.out) == 0, "baseline left out unwritten");
        eprob_free(&E);
    }
    (void)m_none;
    const fa_status BAD = FA_STATUS_INVALID_ARGUMENT;
    expect_refused("block id past the blocks", m_block_big, BAD, "block_table", r);
    expect_refused("negative block id", m_block_neg, BAD, "block_table", r);
    expect_refused("leftpad reaches an invalid block", m_block_before_leftpad, BAD,
                   "block_table", r);
    expect_refused("too few blocks", m_too_few_blocks, BAD, "block_table", r);
    expect_refused("negative cache_seqlens", m_seqlens_neg, BAD, "cache_seqlens", r);
    expect_refused("cache_seqlens fp32", m_seqlens_dtype, BAD, "cache_seqlens", r);
    expect_refused("cache_seqlens shape", m_seqlens_shape, BAD, "cache_seqlens", r);
    expect_refused("append without cache_seqlens", m_seqlens_missing, BAD, "cache_seqlens", r);
    expect_refused("leftpad past seqlens", m_leftpad_big, BAD, "cache_leftpad", r);
    expect_refused("negative leftpad", m_leftpad_neg, BAD, "cache_leftpad", r);
    expect_refused("batch_idx with pages", m_bidx_paged, BAD, "cache_batch_idx", r);
    expect_refused("page size 0", m_page_zero, BAD, "k_cache", r);
    expect_refused("k without v", m_no_v, BAD, "k", r);
    expect_refused("v without k", m_no_k, BAD, "v", r);
    expect_refused("k heads", m_k_heads, BAD, "k", r);
    expect_refused("v length", m_v_len, BAD, "v", r);
    expect_refused("cos without sin", m_rotary_no_sin, BAD, "rotary_sin", r);
    expect_refused("rotary without k", m_rotary_no_k, BAD, "rotary_cos", r);
    expect_refused("seqlen_ro too short", m_rotary_short, BAD, "rotary_cos", r);
    expect_refused("rotary_dim > d", m_rotary_wide, BAD, "rotary_cos", r);
    expect_refused("rotary dtype", m_rotary_dtype, BAD, "rotary_cos", r);
    expect_refused("sin shape", m_sin_shape, BAD, "rotary_sin", r);
    expect_refused("num_splits too big", m_splits_big, BAD, "num_splits", r);
    expect_refused("num_splits negative", m_splits_neg, BAD, "num_splits", r);
    expect_refused("k_cache dtype", m_kc_dtype, BAD, "k_cache", r);
    expect_refused("v_cache blocks", m_vc_blocks, BAD, "v_cache", r);
    expect_refused("h % hk", m_heads, BAD, "k_cache", r);
    expect_refused("out shape", m_out_shape, BAD, "out", r);
    expect_refused("lse shape", m_lse_shape, BAD, "lse", r);
    expect_refused("head_dim too big", m_q_dim, BAD, "q", r);
    expect_refused("window", m_window, BAD, "window_left", r);
    expect_refused("threads", m_threads, BAD, "num_threads", r);
    expect_refused("cuda device", m_device, FA_STATUS_UNSUPPORTED, "device", r);
    expect_refused("contiguous overflow", m_contig_overflow, BAD, "cache_seqlens", r);
    expect_refused("batch_idx out of range", m_contig_bidx, BAD, "cache_batch_idx", r);
    expect_refused("cache smaller than batch", m_contig_small_batch, BAD, "k_cache", r);
    tu_where = "NULL args";
    TU_CHECK(fa_attention_kvcache(NULL) == FA_STATUS_INVALID_ARGUMENT, "NULL args accepted");
}

static void run_combine_checks(tu_rng *r)
{
    int64_t ps[5] = {3, 2, 2, 4, 8}, ls[4] = {3, 2, 2, 4}, os[4] = {2, 2, 4, 8}, l3[3] = {2, 2, 4};
    tu_tensor op = tu_tensor_new(FA_DTYPE_F32, 5, ps, TU_PADDED, r);
    tu_tensor lp = tu_tensor_new(FA_DTYPE_F32, 4, ls, TU_PADDED, r);
    tu_tensor out = tu_tensor_new(FA_DTYPE_BF16, 4, os, TU_CONTIGUOUS, r);
    tu_tensor lse = tu_tensor_new(FA_DTYPE_F32, 3, l3, TU_CONTIGUOUS, r);
    tu_fill_uniform(&op, r, -1.0, 1.0);
    tu_fill_uniform(&lp, r, -1.0, 1.0);
    struct {
        const char *what, *name;
        int field; /* which tensor to break */
        int dim;
        int64_t value;   /* new size, or -1 to change the dtype */
        fa_dtype dtype;
    } cases[] = {
        {"partial fp16", "out_partial", 0, 0, -1, FA_DTYPE_F16},
        {"lse_partial dtype", "lse_partial", 1, 0, -1, FA_DTYPE_F64},
        {"out int32", "out", 2, 0, -1, FA_DTYPE_I32},
        {"too many splits", "out_partial", 0, 0, FA_MAX_SPLITS + 1, FA_DTYPE_F32},
        {"no splits", "out_partial", 0, 0, 0, FA_DTYPE_F32},
        {"lse_partial splits", "lse_partial", 1, 0, 2, FA_DTYPE_F32},
        {"lse_partial heads", "lse_partial", 1, 3, 3, FA_DTYPE_F32},
        {"out head_dim", "out", 2, 3, 7, FA_DTYPE_F32},
        {"lse heads", "lse", 3, 2, 5, FA_DTYPE_F32},
        {"lse fp64", "lse", 3, 0, -1, FA_DTYPE_F64},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        fa_tensor t[4] = {op.t, lp.t, out.t, lse.t};
        if (cases[k].value < 0)
            t[cases[k].field].dtype = cases[k].dtype;
        else
            t[cases[k].field].shape[cases[k].dim] = cases[k].value;
        fa_combine_args a;
        fa_combine_args_init(&a);
        a.out_partial = &t[0];
        a.lse_partial = &t[1];
        a.out = &t[2];
        a.lse = &t[3];
        tu_poison(&out);
        tu_where = cases[k].what;
        fa_status st = fa_attention_combine(&a);
        TU_CHECK(st == FA_STATUS_INVALID_ARGUMENT, "status %d: %s", (int)st, fa_last_error());
        TU_CHECK(tu_names(fa_last_error(), cases[k].name), "message does not name %s: %s",
                 cases[k].name, fa_last_error());
        TU_CHECK(tu_count_poisoned_in_view(&out) == tu_numel(&out.t), "out was written");
    }
    tu_tensor_free(&op);
    tu_tensor_free(&lp);
    tu_tensor_free(&out);
    tu_tensor_free(&lse);
}

int main(void)
{
    tu_rng rng = {tu_master_seed("test_kvcache_errors")};
    run_kvcache_checks(&rng);
    run_combine_checks(&rng);
    return tu_finish("test_kvcache_errors");
}
