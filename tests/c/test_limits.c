/*
 * test_limits: the limits of flashattn.h that keep validation overflow-proof. Claims whose
 * element count, stride reach or byte range pass FA_MAX_EXTENT or wrap, NULL data under them,
 * varlen lengths past the limit, scales and softcaps outside their ranges, an out that aliases
 * an input, a gradient over an input or another gradient (interleaved views of one packed
 * gradient are apart) and written tensors whose elements share addresses are refused with an
 * error naming the argument, before anything is read; thread counts past FA_MAX_THREADS run clamped, with the
 * result of one thread; and the bf16 path agrees with fp32 up to the largest scale accepted.
 */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fa_ref.h"
#include "flashattn.h"
#include "test_util.h"

#define B 2
#define SQ 5
#define SK 7
#define H 2
#define D 8

/* A dense fp32 problem [B, SQ, H, D] x [B, SK, H, D] over fresh random buffers. */
typedef struct prob {
    tu_tensor q, k, v, out, lse;
    fa_fwd_args a;
} prob;

static void prob_init(prob *P, tu_rng *r, fa_dtype dt)
{
    const int64_t qs[4] = {B, SQ, H, D}, ks[4] = {B, SK, H, D}, ls[3] = {B, H, SQ};
    P->q = tu_tensor_new(dt, 4, qs, TU_CONTIGUOUS, r);
    P->k = tu_tensor_new(dt, 4, ks, TU_CONTIGUOUS, r);
    P->v = tu_tensor_new(dt, 4, ks, TU_CONTIGUOUS, r);
    P->out = tu_tensor_new(dt, 4, qs, TU_CONTIGUOUS, r);
    P->lse = tu_tensor_new(FA_DTYPE_F32, 3, ls, TU_CONTIGUOUS, r);
    tu_fill_uniform(&P->q, r, -2.0, 2.0);
    tu_fill_uniform(&P->k, r, -2.0, 2.0);
    tu_fill_uniform(&P->v, r, -2.0, 2.0);
    tu_poison(&P->out);
    tu_poison(&P->lse);
    fa_fwd_args_init(&P->a);
    P->a.q = &P->q.t;
    P->a.k = &P->k.t;
    P->a.v = &P->v.t;
    P->a.out = &P->out.t;
    P->a.lse = &P->lse.t;
    P->a.num_threads = 1;
}

static void prob_free(prob *P)
{
    tu_tensor_free(&P->q);
    tu_tensor_free(&P->k);
    tu_tensor_free(&P->v);
    tu_tensor_free(&P->out);
    tu_tensor_free(&P->lse);
}

/* st must be INVALID_ARGUMENT with a message naming `name`. */
static void expect_refused(const char *label, fa_status st, const char *name)
{
    tu_where = label;
    const char *msg = fa_last_error();
    TU_CHECK(st == FA_STATUS_INVALID_ARGUMENT, "expected INVALID_ARGUMENT, got %s (%s)",
             fa_status_string(st), msg);
    TU_CHECK(tu_names(msg, name), "message \"%s\" does not name %s", msg, name);
}

/* Shapes whose products wrap int64 or pass FA_MAX_EXTENT, over NULL or a small buffer. */
static void check_extents(tu_rng *r)
{
    float small[64] = {0};
    /* Each dimension under 2^40, the element count 2^64: it wrapped to 0 and skipped the NULL
     * check, then the forward dereferenced NULL. */
    const int64_t wrap[4] = {1, (int64_t)1 << 24, (int64_t)1 << 40, 1};
    fa_tensor q = fa_tensor_make(NULL, FA_DTYPE_F32, 4, wrap, NULL);
    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.q = a.k = a.v = &q;
    fa_tensor o = q;
    a.out = &o;
    expect_refused("count wrapping to 0 over NULL", fa_attention_forward(&a), "q");

    /* [2^32, 2^32, 1, 8] over 64 floats: refused at once, not computed. */
    const int64_t huge[4] = {(int64_t)1 << 32, (int64_t)1 << 32, 1, 8};
    fa_tensor hq = fa_tensor_make(small, FA_DTYPE_F32, 4, huge, NULL);
    fa_tensor ho = hq;
    a.q = a.k = a.v = &hq;
    a.out = &ho;
    const double t0 = tu_now();
    expect_refused("[2^32, 2^32, 1, 8] over 64 floats", fa_attention_forward(&a), "q");
    TU_CHECK(tu_now() - t0 < 1.0, "the refusal took %.1f s", tu_now() - t0);

    prob P;
    prob_init(&P, r, FA_DTYPE_F32);
    /* A stride whose reach overflows int64, one that passes 2^40, one that reaches below
     * address 0, and a wild stride on a dimension of an empty tensor. */
    P.q.t.stride[0] = INT64_MAX / 2;
    expect_refused("q stride reach past int64", fa_attention_forward(&P.a), "q");
    P.q.t.stride[0] = (int64_t)1 << 40;
    expect_refused("q stride reach past 2^40", fa_attention_forward(&P.a), "q");
    P.q.t.stride[0] = SQ * H * D;
    fa_tensor low = P.k.t;
    low.data = (void *)(uintptr_t)64;
    low.stride[1] = -((int64_t)1 << 30);
    P.a.k = &low;
    expect_refused("k reaching below address 0", fa_attention_forward(&P.a), "k");
    fa_tensor empty = P.k.t;
    empty.shape[1] = 0;
    empty.stride[0] = INT64_MIN;
    fa_tensor empty_v = empty;
    P.a.k = &empty;
    P.a.v = &empty_v;
    expect_refused("empty k with a stride of INT64_MIN", fa_attention_forward(&P.a), "k");
    /* An empty k and v with sane strides and NULL data are fine: no key, out 0, lse +inf. */
    empty.stride[0] = 0;
    empty_v.stride[0] = 0;
    empty.data = empty_v.data = NULL;
    tu_where = "empty k and v over NULL";
    fa_status st = fa_attention_forward(&P.a);
    TU_CHECK(st == FA_STATUS_OK, "refused: %s", fa_last_error());
    const float *out = P.out.t.data, *lse = P.lse.t.data;
    TU_CHECK(st != FA_STATUS_OK || (out[0] == 0.0f && isinf(lse[0]) && lse[0] > 0),
             "out %g lse %g", out[0], lse[0]);

    /* fa_tensor_make: contiguous strides of a shape past int64 saturate, then are refused. */
    const int64_t over[4] = {(int64_t)1 << 40, (int64_t)1 << 40, (int64_t)1 << 40, 8};
    fa_tensor m = fa_tensor_make(small, FA_DTYPE_F32, 4, over, NULL);
    P.a.k = &P.k.t;
    P.a.v = &P.v.t;
    P.a.q = &m;
    expect_refused("fa_tensor_make past int64", fa_attention_forward(&P.a), "q");
    prob_free(&P);
}

/* Varlen lengths that back no tensor are bounded by FA_MAX_EXTENT too. */
static void check_varlen_max(tu_rng *r)
{
    const int64_t ts[3] = {6, H, D}, ls[2] = {H, 6}, cs[1] = {2};
    tu_tensor q = tu_tensor_new(FA_DTYPE_F32, 3, ts, TU_CONTIGUOUS, r);
    tu_tensor o = tu_tensor_new(FA_DTYPE_F32, 3, ts, TU_CONTIGUOUS, r);
    tu_tensor l = tu_tensor_new(FA_DTYPE_F32, 2, ls, TU_CONTIGUOUS, r);
    tu_tensor g[3] = {tu_tensor_new(FA_DTYPE_F32, 3, ts, TU_CONTIGUOUS, r),
                      tu_tensor_new(FA_DTYPE_F32, 3, ts, TU_CONTIGUOUS, r),
                      tu_tensor_new(FA_DTYPE_F32, 3, ts, TU_CONTIGUOUS, r)};
    tu_fill_uniform(&q, r, -1.0, 1.0);
    int32_t cu[2] = {0, 6};
    fa_tensor tcu = fa_tensor_make(cu, FA_DTYPE_I32, 1, cs, NULL);
    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.q = a.k = a.v = &q.t;
    a.out = &o.t;
    a.lse = &l.t;
    a.cu_seqlens_q = a.cu_seqlens_k = &tcu;
    a.max_seqlen_q = 6;
    a.max_seqlen_k = INT64_MAX;
    expect_refused("forward, max_seqlen_k INT64_MAX", fa_attention_forward(&a), "max_seqlen_k");
    fa_bwd_args b;
    fa_bwd_args_init(&b);
    b.fwd = &a;
    b.dout = &q.t;
    b.dq = &g[0].t;
    b.dk = &g[1].t;
    b.dv = &g[2].t;
    expect_refused("backward, max_seqlen_k INT64_MAX", fa_attention_backward(&b), "max_seqlen_k");
    a.max_seqlen_k = 6;
    a.max_seqlen_q = FA_MAX_EXTENT + 1;
    expect_refused("forward, max_seqlen_q 2^40 + 1", fa_attention_forward(&a), "max_seqlen_q");
    tu_tensor_free(&q);
    tu_tensor_free(&o);
    tu_tensor_free(&l);
    for (int i = 0; i < 3; i++)
        tu_tensor_free(&g[i]);
}

/* Scales and softcaps: refused outside their ranges; at the largest scale accepted the bf16
 * path gives fp32's answer on the same (bf16-exact) inputs. */
static void check_scalars(tu_rng *r)
{
    prob P;
    prob_init(&P, r, FA_DTYPE_F32);
    const double bad_scales[] = {1e39, -1e39, 1e11, FA_MAX_SOFTMAX_SCALE * 1.01};
    for (int i = 0; i < 4; i++) {
        P.a.softmax_scale = bad_scales[i];
        expect_refused("softmax_scale out of range", fa_attention_forward(&P.a), "softmax_scale");
    }
    P.a.softmax_scale = NAN;
    const double bad_caps[] = {1e38, FA_MAX_SOFTCAP * 1.01, 1e-5, FA_MIN_SOFTCAP * 0.99};
    for (int i = 0; i < 4; i++) {
        P.a.softcap = bad_caps[i];
        expect_refused("softcap out of range", fa_attention_forward(&P.a), "softcap");
    }
    P.a.softcap = 0.0;

    prob Q;
    prob_init(&Q, r, FA_DTYPE_BF16);
    tu_tensor *src[3] = {&Q.q, &Q.k, &Q.v}, *dst[3] = {&P.q, &P.k, &P.v};
    for (int t = 0; t < 3; t++) {
        int64_t idx[4] = {0, 0, 0, 0};
        do
            fa_ref_store(&dst[t]->t, idx, fa_ref_load(&src[t]->t, idx));
        while (tu_next_index(&src[t]->t, idx));
    }
    const double scales[] = {FA_MAX_SOFTMAX_SCALE, -FA_MAX_SOFTMAX_SCALE};
    const double caps[] = {0.0, FA_MAX_SOFTCAP};
    for (int i = 0; i < 2; i++) {
        P.a.softmax_scale = Q.a.softmax_scale = scales[i];
        P.a.softcap = Q.a.softcap = caps[i];
        tu_where = i ? "bf16 against fp32 at -FA_MAX_SOFTMAX_SCALE, FA_MAX_SOFTCAP"
                     : "bf16 against fp32 at FA_MAX_SOFTMAX_SCALE";
        fa_status s1 = fa_attention_forward(&P.a), s2 = fa_attention_forward(&Q.a);
        TU_CHECK(s1 == FA_STATUS_OK && s2 == FA_STATUS_OK, "refused: %s", fa_last_error());
        double worst = 0.0, lse_worst = 0.0;
        int64_t idx[4] = {0, 0, 0, 0};
        do {
            const double x = fa_ref_load(&Q.out.t, idx), y = fa_ref_load(&P.out.t, idx);
            worst = isfinite(x) && isfinite(y) ? fmax(worst, fabs(x - y)) : INFINITY;
        } while (tu_next_index(&Q.out.t, idx));
        memset(idx, 0, sizeof idx);
        do {
            const double x = fa_ref_load(&Q.lse.t, idx), y = fa_ref_load(&P.lse.t, idx);
            lse_worst = fmax(lse_worst, fabs(x - y) / fmax(1.0, fabs(y)));
        } while (tu_next_index(&Q.lse.t, idx));
        /* One bf16 rounding of P (and of out, |out| <= 2): a few units of 2^-8. */
        TU_CHECK(worst <= 0.05, "out differs by %g", worst);
        TU_CHECK(lse_worst <= 1e-5, "lse differs by %g (relative)", lse_worst);
    }
    prob_free(&Q);
    prob_free(&P);
}

/* out sharing bytes with an input, and written tensors whose elements share addresses. */
static void check_aliasing(tu_rng *r)
{
    prob P;
    prob_init(&P, r, FA_DTYPE_F32);
    fa_tensor alias = P.out.t;
    P.a.out = &alias;
    alias.data = P.q.t.data;
    expect_refused("out = q", fa_attention_forward(&P.a), "out");
    alias.data = (float *)P.v.t.data + 3;
    expect_refused("out inside v", fa_attention_forward(&P.a), "out");
    alias.data = (float *)P.k.t.data - 5;
    expect_refused("out overlapping the start of k", fa_attention_forward(&P.a), "out");
    P.a.out = &P.out.t;

    fa_tensor lse = P.lse.t;
    lse.stride[0] = 0;
    P.a.lse = &lse;
    expect_refused("lse with batch stride 0", fa_attention_forward(&P.a), "lse");
    P.a.lse = &P.lse.t;
    fa_tensor out = P.out.t;
    out.stride[1] = 3; /* rows 3 elements apart, each D = 8 long: they interleave */
    P.a.out = &out;
    expect_refused("out rows interleaved", fa_attention_forward(&P.a), "out");
    P.a.out = &P.out.t;

    tu_where = "valid baseline";
    TU_CHECK(fa_attention_forward(&P.a) == FA_STATUS_OK, "refused: %s", fa_last_error());
    tu_tensor dq = tu_tensor_new(FA_DTYPE_F32, 4, P.q.t.shape, TU_CONTIGUOUS, r);
    tu_tensor dk = tu_tensor_new(FA_DTYPE_F32, 4, P.k.t.shape, TU_CONTIGUOUS, r);
    tu_tensor dv = tu_tensor_new(FA_DTYPE_F32, 4, P.v.t.shape, TU_CONTIGUOUS, r);
    fa_bwd_args b;
    fa_bwd_args_init(&b);
    b.fwd = &P.a;
    b.dout = &P.q.t;
    fa_tensor zero_dq = dq.t;
    zero_dq.stride[2] = 0;
    b.dq = &zero_dq;
    b.dk = &dk.t;
    b.dv = &dv.t;
    expect_refused("dq with head stride 0", fa_attention_backward(&b), "dq");
    b.dq = &dq.t;
    tu_poison(&dq);
    tu_poison(&dk);
    tu_poison(&dv);
    b.deterministic = 1;
    tu_where = "backward baseline";
    TU_CHECK(fa_attention_backward(&b) == FA_STATUS_OK, "refused: %s", fa_last_error());
    /* Gradients written over what the backward reads, or over one another. */
    fa_tensor over = dk.t;
    b.dk = &over;
    over.data = P.k.t.data;
    expect_refused("dk = k", fa_attention_backward(&b), "dk");
    over.data = (float *)P.v.t.data + 7;
    expect_refused("dk inside v", fa_attention_backward(&b), "dk");
    over.data = P.q.t.data; /* dout is q here */
    expect_refused("dk = dout", fa_attention_backward(&b), "dk");
    over.data = (float *)dv.t.data + 1;
    expect_refused("dk one float into dv", fa_attention_backward(&b), "dv");
    b.dk = &dk.t;
    /* dq, dk, dv as interleaved views of one packed gradient [B, SK, 3, H, D]: apart, and the
     * same gradients as in separate buffers. */
    const int64_t ps[5] = {B, SK, 3, H, D};
    tu_tensor packed = tu_tensor_new(FA_DTYPE_F32, 5, ps, TU_CONTIGUOUS, r);
    tu_poison(&packed);
    fa_tensor pv[3];
    for (int i = 0; i < 3; i++) {
        const fa_tensor *like = i == 0 ? &P.q.t : i == 1 ? &P.k.t : &P.v.t;
        const int64_t st[4] = {SK * 3 * H * D, 3 * H * D, D, 1};
        pv[i] = fa_tensor_make((float *)packed.t.data + i * H * D, FA_DTYPE_F32, 4, like->shape,
                               st);
    }
    b.dq = &pv[0], b.dk = &pv[1], b.dv = &pv[2];
    tu_where = "packed gradient";
    TU_CHECK(fa_attention_backward(&b) == FA_STATUS_OK, "refused: %s", fa_last_error());
    const tu_tensor *sep[3] = {&dq, &dk, &dv};
    for (int i = 0; i < 3; i++) {
        int64_t idx[4] = {0};
        do
            TU_CHECK(fa_ref_load(&pv[i], idx) == fa_ref_load(&sep[i]->t, idx),
                     "gradient %d differs at [%lld, %lld, %lld, %lld]", i, (long long)idx[0],
                     (long long)idx[1], (long long)idx[2], (long long)idx[3]);
        while (tu_next_index(&pv[i], idx));
    }
    pv[1].data = (float *)packed.t.data + H * D - 1; /* dk's first head over dq's last float */
    expect_refused("packed dk shifted onto dq", fa_attention_backward(&b), "dq");
    tu_tensor_free(&packed);
    tu_tensor_free(&dq);
    tu_tensor_free(&dk);
    tu_tensor_free(&dv);

    /* The KV cache and the combine. */
    const int64_t cs[4] = {B, SK + 2, H, D}, ns[4] = {B, 1, H, D}, bs[1] = {B};
    tu_tensor kc = tu_tensor_new(FA_DTYPE_F32, 4, cs, TU_CONTIGUOUS, r);
    tu_tensor vc = tu_tensor_new(FA_DTYPE_F32, 4, cs, TU_CONTIGUOUS, r);
    tu_fill_uniform(&kc, r, -1.0, 1.0);
    tu_fill_uniform(&vc, r, -1.0, 1.0);
    int32_t lens[B] = {3, SK};
    fa_tensor tl = fa_tensor_make(lens, FA_DTYPE_I32, 1, bs, NULL);
    fa_kvcache_args k;
    fa_kvcache_args_init(&k);
    k.q = &P.q.t;
    k.k_cache = &kc.t;
    k.v_cache = &vc.t;
    k.cache_seqlens = &tl;
    k.out = &alias;
    k.num_threads = 1;
    alias.data = (float *)kc.t.data + 17;
    expect_refused("kvcache: out inside k_cache", fa_attention_kvcache(&k), "out");
    k.out = &P.out.t;
    tu_where = "kvcache baseline";
    TU_CHECK(fa_attention_kvcache(&k) == FA_STATUS_OK, "refused: %s", fa_last_error());
    fa_tensor bcast = kc.t;
    bcast.stride[0] = 0; /* one cache row read by both sequences: fine to read */
    k.k_cache = &bcast;
    tu_where = "kvcache, a broadcast k_cache read only";
    TU_CHECK(fa_attention_kvcache(&k) == FA_STATUS_OK, "refused: %s", fa_last_error());
    fa_tensor kn = fa_tensor_make(P.q.t.data, FA_DTYPE_F32, 4, ns, NULL);
    fa_tensor vn = fa_tensor_make(P.v.t.data, FA_DTYPE_F32, 4, ns, NULL);
    k.k = &kn;
    k.v = &vn;
    expect_refused("kvcache: appending to a broadcast k_cache", fa_attention_kvcache(&k),
                   "k_cache");
    tu_tensor_free(&kc);
    tu_tensor_free(&vc);

    const int64_t ops[5] = {2, B, SQ, H, D}, lps[4] = {2, B, SQ, H};
    tu_tensor op = tu_tensor_new(FA_DTYPE_F32, 5, ops, TU_CONTIGUOUS, r);
    tu_tensor lp = tu_tensor_new(FA_DTYPE_F32, 4, lps, TU_CONTIGUOUS, r);
    tu_fill_uniform(&op, r, -1.0, 1.0);
    tu_fill_uniform(&lp, r, -1.0, 1.0);
    fa_combine_args c;
    fa_combine_args_init(&c);
    c.out_partial = &op.t;
    c.lse_partial = &lp.t;
    c.out = &alias;
    alias.data = op.t.data;
    expect_refused("combine: out = out_partial", fa_attention_combine(&c), "out");
    tu_tensor_free(&op);
    tu_tensor_free(&lp);
    prob_free(&P);
}

/* Thread counts past FA_MAX_THREADS run clamped: bitwise the one-thread result (the backward
 * sized its scratch by the unclamped count and ran out of memory). */
static void check_threads(tu_rng *r)
{
    prob P;
    prob_init(&P, r, FA_DTYPE_F32);
    tu_tensor dout = tu_tensor_new(FA_DTYPE_F32, 4, P.q.t.shape, TU_CONTIGUOUS, r);
    tu_fill_uniform(&dout, r, -1.0, 1.0);
    tu_tensor g[2][3];
    const int counts[2] = {1, INT_MAX};
    for (int run = 0; run < 2; run++) {
        P.a.num_threads = counts[run];
        tu_where = run ? "forward, INT_MAX threads" : "forward, 1 thread";
        TU_CHECK(fa_attention_forward(&P.a) == FA_STATUS_OK, "refused: %s", fa_last_error());
        const fa_tensor *like[3] = {&P.q.t, &P.k.t, &P.v.t};
        for (int i = 0; i < 3; i++) {
            g[run][i] = tu_tensor_new(FA_DTYPE_F32, 4, like[i]->shape, TU_CONTIGUOUS, r);
            tu_poison(&g[run][i]);
        }
        fa_bwd_args b;
        fa_bwd_args_init(&b);
        b.fwd = &P.a;
        b.dout = &dout.t;
        b.dq = &g[run][0].t;
        b.dk = &g[run][1].t;
        b.dv = &g[run][2].t;
        tu_where = run ? "backward, INT_MAX threads" : "backward, 1 thread";
        TU_CHECK(fa_attention_backward(&b) == FA_STATUS_OK, "refused: %s", fa_last_error());
    }
    tu_where = "backward, INT_MAX threads against 1";
    for (int i = 0; i < 3; i++)
        TU_CHECK(memcmp(g[0][i].t.data, g[1][i].t.data,
                        (size_t)tu_numel(&g[0][i].t) * sizeof(float)) == 0,
                 "gradient %d differs", i);
    for (int run = 0; run < 2; run++)
        for (int i = 0; i < 3; i++)
            tu_tensor_free(&g[run][i]);
    tu_tensor_free(&dout);
    prob_free(&P);
}

/* fa_dropout_keep outside [0, 1): p <= 0 keeps every element, p >= 1 and NaN none (the
 * conversion of a negative or NaN threshold was undefined). */
static void check_dropout_keep(tu_rng *r)
{
    tu_where = "fa_dropout_keep outside [0, 1)";
    for (int i = 0; i < 64; i++) {
        const uint64_t seed = tu_rng_u64(r);
        const int64_t row = tu_rng_int(r, 0, 100), col = tu_rng_int(r, 0, 100);
        TU_CHECK(fa_dropout_keep(seed, 0, 4, 1, 2, row, col, -0.5) == 1, "p -0.5 dropped");
        TU_CHECK(fa_dropout_keep(seed, 0, 4, 1, 2, row, col, 0.0) == 1, "p 0 dropped");
        TU_CHECK(fa_dropout_keep(seed, 0, 4, 1, 2, row, col, 1.0) == 0, "p 1 kept");
        TU_CHECK(fa_dropout_keep(seed, 0, 4, 1, 2, row, col, 1.5) == 0, "p 1.5 kept");
        TU_CHECK(fa_dropout_keep(seed, 0, 4, 1, 2, row, col, NAN) == 0, "p NaN kept");
    }
}

int main(void)
{
    tu_rng rng = {tu_master_seed("test_limits")};
    check_extents(&rng);
    check_varlen_max(&rng);
    check_scalars(&rng);
    check_aliasing(&rng);
    check_threads(&rng);
    check_dropout_keep(&rng);
    return tu_finish("test_limits");
}
