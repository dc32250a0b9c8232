/*
 * test_kvcache: fa_attention_kvcache against the double-precision oracle (ref/fa_ref.c).
 *
 * For every case: fresh random caches (the rows no sequence occupies NaN), new keys, q, cos/sin
 * (never zero), outputs poisoned with NaN. The call must
 *   - leave every cache element outside the appended rows bitwise as it was (the gaps and
 *     guard zones of strided views too), and store rotary(k) rounded to the dtype there;
 *   - write every element of out and lse, and nothing around them; not modify q, k, v, cos, sin;
 *   - match the oracle run on the dense equivalent built here, independently of the library:
 *     the keys [start_i, end_i) of each sequence gathered from the cache (through the block
 *     table or cache_batch_idx) into a varlen problem, q rotated in double. Tolerances are
 *     test_forward's (fp64 1e-12, fp32 1e-5, fp16/bf16 twice naive low-precision attention's
 *     error plus half an ulp);
 *   - give the same result within that tolerance for num_splits 1, 3 and 0 (heuristic), and
 *     bitwise the same result for one split count under two thread counts.
 * And with one item a sequence, num_splits 0 gives the bits of one chunk per thread.
 * The argument checks are test_kvcache_errors.c's.
 *
 * FA_TEST_SEED=<n> reruns a run; FA_TEST_ONLY=<case> runs one case of it.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_ref.h"
#include "flashattn.h"
#include "test_util.h"

typedef struct kcase {
    fa_dtype dt;
    int64_t b, sq, h, hk, d, dv;
    int64_t page_size; /* 0: contiguous cache */
    int64_t capacity;  /* positions per sequence: s_cache, or max_blocks * page_size */
    int64_t s_new;     /* new keys appended (0: none) */
    int seqlens;       /* pass cache_seqlens (forced with s_new) */
    int fill;          /* one sequence ends exactly at the capacity */
    int batch_idx;     /* contiguous: cache rows through cache_batch_idx, with spare rows */
    int leftpad;
    int rotary; /* 0 none, 1 interleaved, 2 not interleaved */
    int64_t rotary_dim;
    int causal, wl, wr;
    double softcap;
    int alibi, sinks;
    double scale; /* NaN: default */
    int with_lse;
    int threads_a, threads_b;
} kcase;

static int g_case_index = 0, g_only = -1, g_checked = 0;
static char g_where[512];

static double eps_of(fa_dtype dt)
{
    switch (dt) {
    case FA_DTYPE_F16:
        return ldexp(1.0, -10);
    case FA_DTYPE_BF16:
        return ldexp(1.0, -7);
    case FA_DTYPE_F32:
        return ldexp(1.0, -23);
    default:
        return ldexp(1.0, -52);
    }
}

static double ld4(const tu_tensor *T, int64_t a, int64_t b, int64_t c, int64_t d)
{
    int64_t idx[4] = {a, b, c, d};
    return fa_ref_load(&T->t, idx);
}

static double ld2(const tu_tensor *T, int64_t a, int64_t b)
{
    int64_t idx[2] = {a, b};
    return fa_ref_load(&T->t, idx);
}

static void *dup_bytes(const void *p, size_t n)
{
    void *q = malloc(n ? n : 1);
    if (!q)
        exit(2);
    memcpy(q, p, n);
    return q;
}

/* The rotation the header defines, in double, on the values stored in cos/sin. */
static void rotate_ref(double *x, int64_t pos, const tu_tensor *tc, const tu_tensor *ts,
                       int64_t rd, int interleaved)
{
    for (int64_t t = 0; t < rd / 2; t++) {
        int64_t i0 = interleaved ? 2 * t : t, i1 = interleaved ? 2 * t + 1 : t + rd / 2;
        double c = ld2(tc, pos, t), s = ld2(ts, pos, t);
        double x0 = x[i0], x1 = x[i1];
        x[i0] = x0 * c - x1 * s;
        x[i1] = x0 * s + x1 * c;
    }
}

typedef struct kprob {
    const kcase *c;
    int64_t nblocks, page; /* cache dims 0 and 1 */
    int64_t max_blocks;
    int32_t *seqlens, *leftpad, *bidx, *table; /* host copies */
    tu_tensor q, kc, vc, kn, vn, cos, sin, out, lse, tseq, tlp, tbidx, ttable, alibi, sinks;
    fa_kvcache_args args;
} kprob;

static int64_t seq_start(const kprob *P, int64_t i)
{
    return P->c->leftpad ? P->leftpad[i] : 0;
}

static int64_t seq_end(const kprob *P, int64_t i)
{
    return P->c->seqlens ? P->seqlens[i] + P->c->s_new : P->c->capacity;
}

/* Cache (block, row) of position pos of sequence i, as the header defines it. */
static void locate(const kprob *P, int64_t i, int64_t pos, int64_t *blk, int64_t *row)
{
    if (P->c->page_size) {
        *blk = P->table[i * P->max_blocks + pos / P->c->page_size];
        *row = pos % P->c->page_size;
    } else {
        *blk = P->c->batch_idx ? P->bidx[i] : i;
        *row = pos;
    }
}

/* Every cache row no sequence's keys [start_i, end_i) occupy (past the ends, before leftpad,
 * spare rows and blocks) set to NaN in K and V: no backend may read one into a result (a key
 * outside the sequence gets P = 0, and 0 times NaN is NaN). */
static void poison_unused_rows(const kprob *P)
{
    const int64_t nrows = P->nblocks * P->page;
    unsigned char *used = calloc((size_t)nrows, 1);
    for (int64_t i = 0; i < P->c->b; i++)
        for (int64_t pos = seq_start(P, i); pos < seq_end(P, i); pos++) {
            int64_t blk, row;
            locate(P, i, pos, &blk, &row);
            used[blk * P->page + row] = 1;
        }
    for (int64_t x = 0; x < nrows; x++)
        for (int64_t kh = 0; kh < P->c->hk && !used[x]; kh++) {
            int64_t idx[4] = {x / P->page, x % P->page, kh, 0};
            for (idx[3] = 0; idx[3] < P->c->d; idx[3]++)
                fa_ref_store(&P->kc.t, idx, NAN);
            for (idx[3] = 0; idx[3] < P->c->dv; idx[3]++)
                fa_ref_store(&P->vc.t, idx, NAN);
        }
    free(used);
}

static int pick_layout(tu_rng *r)
{
    return (int)tu_rng_int(r, 0, TU_NUM_LAYOUTS - 1);
}

static tu_tensor i32_tensor(const int32_t *v, int ndim, const int64_t *shape, tu_rng *r)
{
    tu_tensor T = tu_tensor_new(FA_DTYPE_I32, ndim, shape, ndim == 2 ? pick_layout(r) : 0, r);
    int64_t idx[2] = {0, 0}, k = 0;
    do {
        fa_ref_store(&T.t, idx, (double)v[k++]);
    } while (tu_next_index(&T.t, idx));
    return T;
}

/* Draws the sequence layout and every tensor of a case. */
static void prob_build(kprob *P, const kcase *c, tu_rng *r)
{
    memset(P, 0, sizeof *P);
    P->c = c;
    const int64_t b = c->b, cap = c->capacity;
    P->seqlens = calloc((size_t)b, sizeof(int32_t));
    P->leftpad = calloc((size_t)b, sizeof(int32_t));
    P->bidx = calloc((size_t)b, sizeof(int32_t));
    for (int64_t i = 0; i < b; i++) {
        int64_t len = tu_rng_int(r, 0, cap - c->s_new);
        if (c->fill && i == b - 1)
            len = cap - c->s_new;
        P->seqlens[i] = (int32_t)len;
        int64_t limit = c->seqlens ? len : cap;
        P->leftpad[i] = (int32_t)(tu_rng_chance(r, 0.7) ? tu_rng_int(r, 0, limit) : 0);
    }
    if (c->page_size) {
        /* The lengths above go up to the capacity, which the block table must hold whole. */
        if (cap % c->page_size != 0) {
            fprintf(stderr, "test_kvcache: case capacity %lld not a multiple of its page %lld\n",
                    (long long)cap, (long long)c->page_size);
            exit(2);
        }
        P->page = c->page_size;
        P->max_blocks = cap / c->page_size;
        /* Every block a sequence uses is its own, shuffled; unused entries are invalid ids,
           which the library must never read. */
        int64_t used = 0;
        P->table = calloc((size_t)(b * P->max_blocks + 1), sizeof(int32_t));
        for (int64_t i = 0; i < b; i++)
            used += P->max_blocks;
        P->nblocks = used + tu_rng_int(r, 0, 3);
        int64_t *perm = malloc(sizeof(int64_t) * (size_t)P->nblocks);
        for (int64_t k = 0; k < P->nblocks; k++)
            perm[k] = k;
        for (int64_t k = P->nblocks - 1; k > 0; k--) {
            int64_t j = tu_rng_int(r, 0, k), t = perm[k];
            perm[k] = perm[j];
            perm[j] = t;
        }
        int64_t next = 0;
        for (int64_t i = 0; i < b; i++) {
            int64_t first = seq_start(P, i) / c->page_size;
            int64_t last = (seq_end(P, i) + c->page_size - 1) / c->page_size;
            for (int64_t j = 0; j < P->max_blocks; j++) {
                int64_t id = perm[next++];
                int in_use = j >= first && j < last && seq_end(P, i) > seq_start(P, i);
                P->table[i * P->max_blocks + j] =
                    in_use ? (int32_t)id : (tu_rng_chance(r, 0.5) ? -1 : (int32_t)(P->nblocks + 5));
            }
        }
        free(perm);
    } else {
        P->page = cap;
        P->nblocks = b + (c->batch_idx ? tu_rng_int(r, 1, 3) : 0);
        for (int64_t i = 0; i < b; i++) /* distinct rows when appending, else any */
            P->bidx[i] = (int32_t)(c->s_new ? P->nblocks - 1 - i
                                            : tu_rng_int(r, 0, P->nblocks - 1));
    }

    const fa_dtype dt = c->dt;
    int64_t sq_shape[4] = {b, c->sq, c->h, c->d}, out_shape[4] = {b, c->sq, c->h, c->dv};
    int64_t kc_shape[4] = {P->nblocks, P->page, c->hk, c->d};
    int64_t vc_shape[4] = {P->nblocks, P->page, c->hk, c->dv};
    int64_t kn_shape[4] = {b, c->s_new, c->hk, c->d}, vn_shape[4] = {b, c->s_new, c->hk, c->dv};
    P->q = tu_tensor_new(dt, 4, sq_shape, pick_layout(r), r);
    P->kc = tu_tensor_new(dt, 4, kc_shape, pick_layout(r), r);
    P->vc = tu_tensor_new(dt, 4, vc_shape, pick_layout(r), r);
    P->out = tu_tensor_new(dt, 4, out_shape, pick_layout(r), r);
    tu_fill_uniform(&P->q, r, -2.0, 2.0);
    tu_fill_uniform(&P->kc, r, -2.0, 2.0);
    tu_fill_uniform(&P->vc, r, -2.0, 2.0);
    poison_unused_rows(P);
    fa_kvcache_args *a = &P->args;
    fa_kvcache_args_init(a);
    a->q = &P->q.t;
    a->k_cache = &P->kc.t;
    a->v_cache = &P->vc.t;
    a->out = &P->out.t;
    if (c->s_new) {
        P->kn = tu_tensor_new(dt, 4, kn_shape, pick_layout(r), r);
        P->vn = tu_tensor_new(dt, 4, vn_shape, pick_layout(r), r);
        tu_fill_uniform(&P->kn, r, -2.0, 2.0);
        tu_fill_uniform(&P->vn, r, -2.0, 2.0);
        a->k = &P->kn.t;
        a->v = &P->vn.t;
    }
    if (c->rotary) {
        int64_t ro = 0;
        for (int64_t i = 0; i < b; i++) {
            int64_t span = c->s_new > c->sq ? c->s_new : c->sq;
            ro = P->seqlens[i] + span > ro ? P->seqlens[i] + span : ro;
        }
        int64_t shape[2] = {ro + tu_rng_int(r, 0, 4), c->rotary_dim / 2};
        P->cos = tu_tensor_new(dt, 2, shape, pick_layout(r), r);
        P->sin = tu_tensor_new(dt, 2, shape, pick_layout(r), r);
        int64_t idx[2] = {0, 0};
        do {
            double th = tu_rng_uniform(r, -3.1, 3.1);
            fa_ref_store(&P->cos.t, idx, fa_ref_round(cos(th), dt));
            fa_ref_store(&P->sin.t, idx, fa_ref_round(sin(th), dt));
        } while (tu_next_index(&P->cos.t, idx));
        a->rotary_cos = &P->cos.t;
        a->rotary_sin = &P->sin.t;
        a->rotary_interleaved = c->rotary == 1;
    }
    int64_t sb[1] = {b};
    if (c->seqlens) {
        P->tseq = i32_tensor(P->seqlens, 1, sb, r);
        a->cache_seqlens = &P->tseq.t;
    }
    if (c->leftpad) {
        P->tlp = i32_tensor(P->leftpad, 1, sb, r);
        a->cache_leftpad = &P->tlp.t;
    }
    if (c->batch_idx && !c->page_size) {
        P->tbidx = i32_tensor(P->bidx, 1, sb, r);
        a->cache_batch_idx = &P->tbidx.t;
    }
    if (c->page_size) {
        int64_t ts[2] = {b, P->max_blocks};
        P->ttable = i32_tensor(P->table, 2, ts, r);
        a->block_table = &P->ttable.t;
    }
    if (c->alibi) {
        int64_t sa[2] = {b, c->h};
        if (c->alibi == 1)
            sa[0] = c->h;
        P->alibi = tu_tensor_new(FA_DTYPE_F32, c->alibi, sa, pick_layout(r), r);
        tu_fill_uniform(&P->alibi, r, 0.01, 1.0);
        a->alibi_slopes = &P->alibi.t;
    }
    if (c->sinks) {
        int64_t ss[1] = {c->h};
        P->sinks = tu_tensor_new(FA_DTYPE_F32, 1, ss, TU_CONTIGUOUS, r);
        tu_fill_uniform(&P->sinks, r, -3.0, 3.0);
        a->sinks = &P->sinks.t;
    }
    if (c->with_lse) {
        int64_t sl[3] = {b, c->h, c->sq};
        fa_dtype lt = dt == FA_DTYPE_F64 && tu_rng_chance(r, 0.5) ? FA_DTYPE_F64 : FA_DTYPE_F32;
        P->lse = tu_tensor_new(lt, 3, sl, pick_layout(r), r);
        a->lse = &P->lse.t;
    }
    a->softmax_scale = c->scale;
    a->causal = c->causal;
    a->window_left = c->wl;
    a->window_right = c->wr;
    a->softcap = c->softcap;
}

static void prob_free(kprob *P)
{
    tu_tensor *all[] = {&P->q,   &P->kc,  &P->vc,   &P->kn,    &P->vn,     &P->cos,
                        &P->sin, &P->out, &P->lse,  &P->tseq,  &P->tlp,    &P->tbidx,
                        &P->ttable, &P->alibi, &P->sinks};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (all[i]->base)
            tu_tensor_free(all[i]);
    free(P->seqlens);
    free(P->leftpad);
    free(P->bidx);
    free(P->table);
}

/* q rotated as the header says, in double: [b * sq, h, d]. */
static double *q_rotated(const kprob *P)
{
    const kcase *c = P->c;
    double *q = malloc(sizeof(double) * (size_t)(c->b * c->sq * c->h * c->d + 1));
    int per_row = c->causal || (c->wl >= 0 && c->wl < c->capacity) ||
                  (c->wr >= 0 && c->wr < c->capacity);
    for (int64_t i = 0; i < c->b; i++)
        for (int64_t r = 0; r < c->sq; r++)
            for (int64_t hh = 0; hh < c->h; hh++) {
                double *x = q + ((i * c->sq + r) * c->h + hh) * c->d;
                for (int64_t e = 0; e < c->d; e++)
                    x[e] = ld4(&P->q, i, r, hh, e);
                if (c->rotary)
                    rotate_ref(x, P->seqlens[i] + (per_row ? r : 0), &P->cos, &P->sin,
                               c->rotary_dim, c->rotary == 1);
            }
    return q;
}

/*
 * Checks the cache after a call against its copy from before: appended rows hold rotary(k) /
 * v (rounded), every other byte of the allocation is unchanged. Patches the appended rows of
 * the copies with what the library wrote, so that later calls compare bitwise.
 */
static void check_cache(const kprob *P, unsigned char *kc_before, unsigned char *vc_before)
{
    const kcase *c = P->c;
    const size_t es = P->kc.elem_size;
    double tol_k = 6.0 * eps_of(c->dt) * 2.0;
    for (int64_t i = 0; i < c->b; i++)
        for (int64_t t = 0; t < c->s_new; t++) {
            int64_t pos = P->seqlens[i] + t, blk, row;
            locate(P, i, pos, &blk, &row);
            for (int64_t kh = 0; kh < c->hk; kh++) {
                double x[FA_MAX_HEAD_DIM];
                for (int64_t e = 0; e < c->d; e++)
                    x[e] = ld4(&P->kn, i, t, kh, e);
                if (c->rotary)
                    rotate_ref(x, pos, &P->cos, &P->sin, c->rotary_dim, c->rotary == 1);
                for (int64_t e = 0; e < c->d; e++) {
                    double got = ld4(&P->kc, blk, row, kh, e);
                    double want = c->rotary ? x[e] : fa_ref_round(x[e], c->dt);
                    TU_CHECK(fabs(got - want) <= (c->rotary ? tol_k : 0.0),
                             "k_cache[%lld, %lld, %lld, %lld] = %.9g, expected %.9g (seq %lld "
                             "new key %lld)",
                             (long long)blk, (long long)row, (long long)kh, (long long)e, got,
                             want, (long long)i, (long long)t);
                    size_t off = (size_t)((char *)P->kc.t.data - (char *)P->kc.base) +
                                 (size_t)(blk * P->kc.t.stride[0] + row * P->kc.t.stride[1] +
                                          kh * P->kc.t.stride[2] + e) * es;
                    memcpy(kc_before + off, (char *)P->kc.base + off, es);
                }
                for (int64_t e = 0; e < c->dv; e++) {
                    double got = ld4(&P->vc, blk, row, kh, e), want = ld4(&P->vn, i, t, kh, e);
                    TU_CHECK(got == want, "v_cache[%lld, %lld, %lld, %lld] = %.9g, expected %.9g",
                             (long long)blk, (long long)row, (long long)kh, (long long)e, got,
                             want);
                    size_t off = (size_t)((char *)P->vc.t.data - (char *)P->vc.base) +
                                 (size_t)(blk * P->vc.t.stride[0] + row * P->vc.t.stride[1] +
                                          kh * P->vc.t.stride[2] + e) * es;
                    memcpy(vc_before + off, (char *)P->vc.base + off, es);
                }
            }
        }
    TU_CHECK(memcmp(kc_before, P->kc.base, P->kc.nbytes) == 0,
             "k_cache bytes outside the appended rows changed");
    TU_CHECK(memcmp(vc_before, P->vc.base, P->vc.nbytes) == 0,
             "v_cache bytes outside the appended rows changed");
}

typedef struct kref {
    double *out, *lse; /* [b * sq, h, dv], [b * sq, h] */
    double tol, lse_tol;
} kref;

/* The oracle on the dense (varlen) equivalent of the cache after the call. */
static void reference_build(const kprob *P, kref *R)
{
    const kcase *c = P->c;
    const int64_t b = c->b, tq = c->b * c->sq;
    int32_t *cuq = malloc(sizeof(int32_t) * (size_t)(b + 1));
    int32_t *cuk = malloc(sizeof(int32_t) * (size_t)(b + 1));
    cuq[0] = cuk[0] = 0;
    int64_t max_n = 0;
    for (int64_t i = 0; i < b; i++) {
        int64_t n = seq_end(P, i) - seq_start(P, i);
        cuq[i + 1] = cuq[i] + (int32_t)c->sq;
        cuk[i + 1] = cuk[i] + (int32_t)n;
        max_n = n > max_n ? n : max_n;
    }
    const int64_t tk = cuk[b];
    /* exact (F64) and low-precision (the dtype) copies of the same values */
    int64_t sq_[3] = {tq, c->h, c->d}, sk_[3] = {tk, c->hk, c->d}, sv_[3] = {tk, c->hk, c->dv};
    int64_t so_[3] = {tq, c->h, c->dv}, s1[1] = {b + 1};
    fa_tensor t8[3], tl[3];
    void *buf[6];
    const int64_t *shapes[3] = {sq_, sk_, sv_};
    for (int k = 0; k < 3; k++) {
        int64_t n = shapes[k][0] * shapes[k][1] * shapes[k][2];
        buf[k] = malloc(sizeof(double) * (size_t)(n + 1));
        buf[3 + k] = malloc(8 * (size_t)(n + 1));
        t8[k] = fa_tensor_make(buf[k], FA_DTYPE_F64, 3, shapes[k], NULL);
        tl[k] = fa_tensor_make(buf[3 + k], c->dt, 3, shapes[k], NULL);
    }
    double *qr = q_rotated(P);
    for (int64_t x = 0; x < tq * c->h * c->d; x++) {
        int64_t idx[3] = {x / (c->h * c->d), (x / c->d) % c->h, x % c->d};
        fa_ref_store(&t8[0], idx, qr[x]);
        fa_ref_store(&tl[0], idx, qr[x]);
    }
    free(qr);
    for (int64_t i = 0; i < b; i++)
        for (int64_t j = 0; j < cuk[i + 1] - cuk[i]; j++) {
            int64_t blk, row;
            locate(P, i, seq_start(P, i) + j, &blk, &row);
            for (int64_t kh = 0; kh < c->hk; kh++) {
                for (int64_t e = 0; e < c->d; e++) {
                    int64_t idx[3] = {cuk[i] + j, kh, e};
                    double x = ld4(&P->kc, blk, row, kh, e);
                    fa_ref_store(&t8[1], idx, x);
                    fa_ref_store(&tl[1], idx, x);
                }
                for (int64_t e = 0; e < c->dv; e++) {
                    int64_t idx[3] = {cuk[i] + j, kh, e};
                    double x = ld4(&P->vc, blk, row, kh, e);
                    fa_ref_store(&t8[2], idx, x);
                    fa_ref_store(&tl[2], idx, x);
                }
            }
        }
    fa_tensor tcuq = fa_tensor_make(cuq, FA_DTYPE_I32, 1, s1, NULL);
    fa_tensor tcuk = fa_tensor_make(cuk, FA_DTYPE_I32, 1, s1, NULL);
    fa_tensor tout = fa_tensor_make(NULL, c->dt, 3, so_, NULL);
    fa_fwd_args f;
    fa_fwd_args_init(&f);
    f.q = &t8[0];
    f.k = &t8[1];
    f.v = &t8[2];
    f.out = &tout;
    f.cu_seqlens_q = &tcuq;
    f.cu_seqlens_k = &tcuk;
    f.max_seqlen_q = c->sq;
    f.max_seqlen_k = max_n;
    f.alibi_slopes = P->args.alibi_slopes;
    f.sinks = P->args.sinks;
    f.softmax_scale = c->scale;
    f.causal = c->causal;
    f.window_left = c->wl;
    f.window_right = c->wr;
    f.softcap = c->softcap;
    R->out = malloc(sizeof(double) * (size_t)(tq * c->h * c->dv + 1));
    R->lse = malloc(sizeof(double) * (size_t)(tq * c->h + 1));
    TU_CHECK(fa_ref_forward(&f, 1, R->out, R->lse) == 0, "oracle refused the problem");
    double vmax = 1.0;
    for (int64_t x = 0; x < tq * c->h * c->dv; x++)
        vmax = fabs(R->out[x]) > vmax ? fabs(R->out[x]) : vmax;
    R->lse_tol = 1e-5;
    if (c->dt == FA_DTYPE_F64) {
        R->tol = 1e-12 * vmax;
        R->lse_tol = P->lse.t.dtype == FA_DTYPE_F64 ? 1e-12 : 1e-7; /* fp32 lse: its rounding */
    } else if (c->dt == FA_DTYPE_F32) {
        R->tol = 1e-5 * vmax;
    } else {
        f.q = &tl[0];
        f.k = &tl[1];
        f.v = &tl[2];
        double *low = malloc(sizeof(double) * (size_t)(tq * c->h * c->dv + 1));
        TU_CHECK(fa_ref_forward_lowp(&f, low) == 0, "low-precision oracle refused the problem");
        double err = 0.0;
        for (int64_t x = 0; x < tq * c->h * c->dv; x++)
            err = fabs(low[x] - R->out[x]) > err ? fabs(low[x] - R->out[x]) : err;
        free(low);
        R->tol = 2.0 * err + 0.5 * eps_of(c->dt) * vmax;
    }
    for (int k = 0; k < 6; k++)
        free(buf[k]);
    free(cuq);
    free(cuk);
}

/* out and lse of the last call against the oracle. */
static void check_against(const kprob *P, const kref *R, const char *what)
{
    const kcase *c = P->c;
    double worst = 0.0;
    int64_t where = -1;
    for (int64_t i = 0; i < c->b; i++)
        for (int64_t r = 0; r < c->sq; r++)
            for (int64_t hh = 0; hh < c->h; hh++)
                for (int64_t e = 0; e < c->dv; e++) {
                    int64_t x = ((i * c->sq + r) * c->h + hh) * c->dv + e;
                    double err = fabs(ld4(&P->out, i, r, hh, e) - R->out[x]);
                    if (!(err <= worst)) {
                        worst = err;
                        where = x;
                    }
                }
    TU_CHECK(worst <= R->tol, "%s: out max |err| %.3g > tol %.3g at flat index %lld", what,
             worst, R->tol, (long long)where);
    if (!c->with_lse)
        return;
    for (int64_t i = 0; i < c->b; i++)
        for (int64_t hh = 0; hh < c->h; hh++)
            for (int64_t r = 0; r < c->sq; r++) {
                int64_t idx[3] = {i, hh, r};
                double got = fa_ref_load(&P->lse.t, idx);
                double want = R->lse[(i * c->sq + r) * c->h + hh];
                int ok = isinf(want) ? got == want
                                     : fabs(got - want) <= R->lse_tol * fmax(1.0, fabs(want));
                TU_CHECK(ok, "%s: lse[%lld, %lld, %lld] = %.9g, oracle %.9g", what, (long long)i,
                         (long long)hh, (long long)r, got, want);
            }
}

static void run_case(const kcase *c, const char *name, tu_rng *rng)
{
    int idx = g_case_index++;
    tu_rng rr = {tu_rng_u64(rng)};
    if (g_only >= 0 && idx != g_only)
        return;
    snprintf(g_where, sizeof g_where,
             "case %d (%s): dt=%s b=%lld sq=%lld h=%lld hk=%lld d=%lld dv=%lld page=%lld cap=%lld "
             "s_new=%lld seqlens=%d fill=%d bidx=%d leftpad=%d rotary=%d/%lld causal=%d "
             "window=(%d,%d) softcap=%g alibi=%d sinks=%d lse=%d threads=%d/%d",
             idx, name, fa_dtype_name(c->dt), (long long)c->b, (long long)c->sq, (long long)c->h,
             (long long)c->hk, (long long)c->d, (long long)c->dv, (long long)c->page_size,
             (long long)c->capacity, (long long)c->s_new, c->seqlens, c->fill, c->batch_idx,
             c->leftpad, c->rotary, (long long)c->rotary_dim, c->causal, c->wl, c->wr, c->softcap,
             c->alibi, c->sinks, c->with_lse, c->threads_a, c->threads_b);
    tu_where = g_where;
    if (getenv("FA_TEST_VERBOSE"))
        printf("%s\n", g_where);

    kprob P;
    prob_build(&P, c, &rr);
    unsigned char *kc0 = dup_bytes(P.kc.base, P.kc.nbytes);
    unsigned char *vc0 = dup_bytes(P.vc.base, P.vc.nbytes);
    unsigned char *q0 = dup_bytes(P.q.base, P.q.nbytes);
    unsigned char *kn0 = P.kn.base ? dup_bytes(P.kn.base, P.kn.nbytes) : NULL;
    unsigned char *vn0 = P.vn.base ? dup_bytes(P.vn.base, P.vn.nbytes) : NULL;
    unsigned char *cos0 = P.cos.base ? dup_bytes(P.cos.base, P.cos.nbytes) : NULL;

    const int splits[5] = {1, 1, 3, 3, 0};
    const int threads[5] = {c->threads_a, c->threads_b, c->threads_a, c->threads_b, c->threads_a};
    void *prev_out = NULL, *prev_lse = NULL;
    kref R = {0};
    for (int run = 0; run < 5; run++) {
        tu_poison(&P.out);
        if (c->with_lse)
            tu_poison(&P.lse);
        P.args.num_splits = splits[run];
        P.args.num_threads = threads[run];
        fa_status st = fa_attention_kvcache(&P.args);
        TU_CHECK(st == FA_STATUS_OK, "run %d: status %d: %s", run, (int)st, fa_last_error());
        if (st != FA_STATUS_OK)
            break;
        check_cache(&P, kc0, vc0);
        TU_CHECK(tu_count_poisoned_in_view(&P.out) == 0, "run %d: out not fully written", run);
        TU_CHECK(tu_count_clobbered(&P.out) == 0, "run %d: bytes around out written", run);
        if (c->with_lse) {
            TU_CHECK(tu_count_poisoned_in_view(&P.lse) == 0, "run %d: lse not fully written", run);
            TU_CHECK(tu_count_clobbered(&P.lse) == 0, "run %d: bytes around lse written", run);
        }
        TU_CHECK(memcmp(q0, P.q.base, P.q.nbytes) == 0, "q was modified");
        TU_CHECK(!kn0 || memcmp(kn0, P.kn.base, P.kn.nbytes) == 0, "k was modified");
        TU_CHECK(!vn0 || memcmp(vn0, P.vn.base, P.vn.nbytes) == 0, "v was modified");
        TU_CHECK(!cos0 || memcmp(cos0, P.cos.base, P.cos.nbytes) == 0, "rotary_cos modified");
        if (run == 0)
            reference_build(&P, &R);
        char what[64];
        snprintf(what, sizeof what, "run %d (num_splits %d, %d threads)", run, splits[run],
                 threads[run]);
        check_against(&P, &R, what);
        if (run % 2 == 1) { /* same split count as the run before, another thread count */
            TU_CHECK(memcmp(prev_out, P.out.base, P.out.nbytes) == 0,
                     "%s: out differs bitwise from the same split count's other thread count",
                     what);
            TU_CHECK(!c->with_lse || memcmp(prev_lse, P.lse.base, P.lse.nbytes) == 0,
                     "%s: lse differs bitwise across thread counts", what);
        }
        free(prev_out);
        free(prev_lse);
        prev_out = dup_bytes(P.out.base, P.out.nbytes);
        prev_lse = c->with_lse ? dup_bytes(P.lse.base, P.lse.nbytes) : NULL;
    }
    free(prev_out);
    free(prev_lse);
    free(R.out);
    free(R.lse);
    free(kc0);
    free(vc0);
    free(q0);
    free(kn0);
    free(vn0);
    free(cos0);
    prob_free(&P);
    g_checked++;
}

static kcase base_case(fa_dtype dt)
{
    kcase c = {.dt = dt, .b = 2, .sq = 1, .h = 4, .hk = 2, .d = 32, .dv = 32, .capacity = 100,
               .seqlens = 1, .wl = -1, .wr = -1, .scale = NAN, .with_lse = 1, .threads_a = 1,
               .threads_b = 2};
    return c;
}

static void run_directed(tu_rng *r)
{
    const fa_dtype dts[4] = {FA_DTYPE_F32, FA_DTYPE_BF16, FA_DTYPE_F16, FA_DTYPE_F64};
    const int64_t pages[5] = {0, 1, 3, 16, 256};
    /* Every page size with every dtype: decode with an append and rotary, GQA. */
    for (int di = 0; di < 4; di++)
        for (int pi = 0; pi < 5; pi++) {
            kcase c = base_case(dts[di]);
            c.page_size = pages[pi];
            c.capacity = pages[pi] == 256 ? 512
                         : pages[pi]      ? pages[pi] * (130 / pages[pi] + 1)
                                          : 150;
            c.s_new = 1;
            c.rotary = 1 + (pi % 2);
            c.rotary_dim = 16;
            c.causal = 1;
            c.fill = 1;
            run_case(&c, "page sizes", r);
        }
    /* Appends that reach the end of the cache; several new keys, non-interleaved rotary. */
    for (int pi = 0; pi < 5; pi++) {
        kcase c = base_case(FA_DTYPE_F32);
        c.page_size = pages[pi];
        c.capacity = pages[pi] ? (pages[pi] == 256 ? 256 : pages[pi] * 20) : 64;
        c.s_new = pi + 2;
        c.sq = c.s_new;
        c.fill = 1;
        c.rotary = 2;
        c.rotary_dim = 32;
        c.causal = pi % 2;
        run_case(&c, "append to the end", r);
    }
    /* No cache_seqlens: the whole cache; leftpad; batch_idx with a larger cache. */
    {
        kcase c = base_case(FA_DTYPE_F32);
        c.seqlens = 0;
        c.leftpad = 1;
        c.batch_idx = 1;
        run_case(&c, "whole cache, leftpad, batch_idx", r);
        c.page_size = 16;
        c.capacity = 96;
        c.batch_idx = 0;
        run_case(&c, "whole paged cache, leftpad", r);
    }
    /* MLA's decode shape past the CUDA families' 256: d 576 / dv 512, MQA, rotary over the
     * first 64 columns, contiguous and paged, every dtype. */
    for (int di = 0; di < 4; di++)
        for (int pi = 0; pi < 2; pi++) {
            kcase c = base_case(dts[di]);
            c.b = 2, c.h = 8, c.hk = 1, c.d = 576, c.dv = 512;
            c.page_size = pi ? 16 : 0;
            c.capacity = 96;
            c.s_new = 1;
            c.rotary = 2;
            c.rotary_dim = 64;
            c.causal = 1;
            run_case(&c, "MLA head dims", r);
        }
    /* MQA decode with many keys: the heuristic splits across threads. */
    {
        kcase c = base_case(FA_DTYPE_BF16);
        c.b = 1;
        c.h = 8;
        c.hk = 1;
        c.d = 64;
        c.dv = 64;
        c.capacity = 1504; /* 94 blocks of 16 */
        c.page_size = 16;
        c.s_new = 1;
        c.threads_a = 4;
        c.threads_b = 3;
        run_case(&c, "mqa long decode", r);
    }
    /* Many packed rows (sq * g > the tile) with a window, softcap, ALiBi, sinks. */
    {
        kcase c = base_case(FA_DTYPE_F32);
        c.sq = 40;
        c.h = 6;
        c.hk = 2;
        c.s_new = 40;
        c.capacity = 200;
        c.page_size = 3;
        c.capacity = 201;
        c.wl = 30;
        c.wr = 2;
        c.softcap = 5.0;
        c.alibi = 2;
        c.sinks = 1;
        c.rotary = 1;
        c.rotary_dim = 20;
        c.d = 40;
        c.dv = 24;
        run_case(&c, "prefill chunk with every option", r);
    }
    /* Several groups of kv heads per sequence, the last one smaller (g = 32, 3 kv heads), and
       more query heads per kv head than a tile has rows (g = 66). */
    {
        kcase c = base_case(FA_DTYPE_F32);
        c.h = 96;
        c.hk = 3;
        c.sq = 2;
        c.s_new = 2;
        c.d = 8;
        c.dv = 8;
        c.causal = 1;
        c.page_size = 5;
        c.capacity = 300;
        c.alibi = 1;
        run_case(&c, "kv head groups", r);
        c.h = 132;
        c.hk = 2;
        c.sinks = 1;
        run_case(&c, "more query heads than tile rows", r);
    }
    /* Empty sequences: cache_seqlens 0 with no append; rows with no key get 0 / +inf. */
    {
        kcase c = base_case(FA_DTYPE_F64);
        c.capacity = 10;
        c.b = 3;
        c.sq = 3;
        c.causal = 1;
        c.wl = 0;
        run_case(&c, "short and empty sequences", r);
    }
}

/*
 * The split heuristic fills every thread: one item per sequence (4 query heads on 1 kv head)
 * over 4096 keys gives 16 chunks on 16 threads and 8 on 8 (upstream's 85% rule gave 14 and
 * 7). A fixed split count is bitwise reproducible, so num_splits 0 must give the bits of that
 * count and differ from one chunk fewer. (Chunks are whole 128-key blocks here, so these
 * counts cut 4096 keys evenly and one fewer cuts them otherwise.) run_case checks values.
 */
static void run_split_rule(tu_rng *r)
{
    const int threads[2] = {16, 8};
    for (int t = 0; t < 2; t++) {
        kcase c = base_case(FA_DTYPE_F32);
        c.b = 1;
        c.h = 4;
        c.hk = 1;
        c.d = 16;
        c.dv = 16;
        c.capacity = 4096;
        c.seqlens = 0;
        snprintf(g_where, sizeof g_where, "split rule, %d threads", threads[t]);
        tu_where = g_where;
        tu_rng rr = {tu_rng_u64(r)};
        kprob P;
        prob_build(&P, &c, &rr);
        void *out[3];
        const int splits[3] = {0, threads[t], threads[t] - 1};
        for (int k = 0; k < 3; k++) {
            tu_poison(&P.out);
            P.args.num_splits = splits[k];
            P.args.num_threads = threads[t];
            fa_status st = fa_attention_kvcache(&P.args);
            TU_CHECK(st == FA_STATUS_OK, "num_splits %d: status %d: %s", splits[k], (int)st,
                     fa_last_error());
            out[k] = dup_bytes(P.out.base, P.out.nbytes);
        }
        TU_CHECK(memcmp(out[0], out[1], P.out.nbytes) == 0,
                 "num_splits 0 differs bitwise from %d chunks", threads[t]);
        TU_CHECK(memcmp(out[0], out[2], P.out.nbytes) != 0,
                 "num_splits 0 gave the bits of %d chunks", threads[t] - 1);
        for (int k = 0; k < 3; k++)
            free(out[k]);
        prob_free(&P);
    }
}

static void run_random(tu_rng *r, int n)
{
    const fa_dtype dts[4] = {FA_DTYPE_F32, FA_DTYPE_BF16, FA_DTYPE_F16, FA_DTYPE_F64};
    const int64_t pages[6] = {0, 0, 1, 3, 16, 256};
    const int64_t heads[4][2] = {{1, 1}, {4, 1}, {6, 2}, {4, 4}};
    const int64_t dims[6] = {1, 8, 16, 40, 64, 128};
    for (int k = 0; k < n; k++) {
        kcase c = base_case(dts[tu_rng_int(r, 0, 3)]);
        c.b = tu_rng_int(r, 1, 3);
        c.sq = tu_rng_chance(r, 0.6) ? 1 : tu_rng_int(r, 2, 9);
        int hi = (int)tu_rng_int(r, 0, 3);
        c.h = heads[hi][0];
        c.hk = heads[hi][1];
        c.d = dims[tu_rng_int(r, 0, 5)];
        c.dv = tu_rng_chance(r, 0.7) ? c.d : dims[tu_rng_int(r, 1, 4)];
        c.page_size = pages[tu_rng_int(r, 0, 5)];
        int64_t want = tu_rng_int(r, 1, 300);
        c.capacity = c.page_size ? ((want + c.page_size - 1) / c.page_size) * c.page_size : want;
        c.s_new = tu_rng_chance(r, 0.6) ? tu_rng_int(r, 1, c.capacity < 6 ? c.capacity : 6) : 0;
        c.seqlens = c.s_new ? 1 : tu_rng_chance(r, 0.8);
        c.fill = tu_rng_chance(r, 0.3);
        c.batch_idx = !c.page_size && tu_rng_chance(r, 0.4);
        c.leftpad = tu_rng_chance(r, 0.3);
        if (c.s_new && c.d >= 2 && tu_rng_chance(r, 0.6)) {
            c.rotary = (int)tu_rng_int(r, 1, 2);
            c.rotary_dim = 2 * tu_rng_int(r, 1, c.d / 2);
        }
        c.causal = tu_rng_chance(r, 0.4);
        if (tu_rng_chance(r, 0.3)) {
            c.wl = (int)tu_rng_int(r, -1, 40);
            c.wr = (int)tu_rng_int(r, -1, 5);
        }
        c.softcap = tu_rng_chance(r, 0.2) ? tu_rng_uniform(r, 1.0, 10.0) : 0.0;
        c.alibi = tu_rng_chance(r, 0.25) ? (int)tu_rng_int(r, 1, 2) : 0;
        c.sinks = tu_rng_chance(r, 0.25);
        c.scale = tu_rng_chance(r, 0.2) ? tu_rng_uniform(r, 0.05, 0.5) : NAN;
        c.with_lse = tu_rng_chance(r, 0.8);
        c.threads_a = (int)tu_rng_int(r, 1, 4);
        c.threads_b = (int)tu_rng_int(r, 1, 4);
        run_case(&c, "random", r);
    }
}

int main(void)
{
    uint64_t seed = tu_master_seed("test_kvcache");
    const char *only = getenv("FA_TEST_ONLY");
    if (only && *only)
        g_only = atoi(only);
    tu_rng rng = {seed};
    double t0 = tu_now();
    run_directed(&rng);
    if (g_only < 0)
        run_split_rule(&rng);
    int n_random = 150;
    const char *nr = getenv("FA_TEST_RANDOM_CASES");
    if (nr && *nr)
        n_random = atoi(nr);
    run_random(&rng, n_random);
    printf("test_kvcache: %d cases in %.1fs\n", g_checked, tu_now() - t0);
    return tu_finish("test_kvcache");
}
