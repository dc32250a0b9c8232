/*
 * test_backward: fa_attention_backward against the double-precision gradient oracle
 * (ref/fa_ref_bwd.c), finite differences, determinism and argument errors.
 *
 * Every case draws fresh random inputs and dout (never zeros), runs the library's forward (out,
 * lse), poisons dq/dk/dv/dsinks with a NaN pattern (gaps of strided views and guard zones too),
 * runs the backward with num_threads 1, 2 and 3 (in a random order) and checks:
 *   - status OK; every element of the gradient views written, nothing outside them touched (for
 *     packed dqkv / dkv: nothing outside the union), the inputs q, k, v, out, lse, dout untouched;
 *   - the three runs bitwise identical;
 *   - dq, dk, dv, dsinks against fa_ref_backward (gradients G and magnitudes M: the sum of |terms|
 *     of each element, the scale of any rounding error). With m = max|G| and mm = max|M| over the
 *     tensor:
 *       F64:      err <= 1e-10 m + 1e-13 mm (with an fp32 lse, allowed too: as F32)
 *       F32:      err <= 1e-4 m + 1e-6 mm (+ terms for large lse and ALiBi, below)
 *       F16/BF16: err <= 3 max|naive - G| + 3 max|stored - G| + 2 u m + 1e-6 mm: upstream's
 *                 criterion, naive being fa_ref_backward_lowp (autograd through naive attention
 *                 in the dtype) and 2 u m (u the dtype's half ulp) upstream's dq_atol, the
 *                 output's own rounding; plus the part naive attention does not have: the
 *                 fused backward takes D = rowsum(dout * out) from out as stored in the dtype,
 *                 and "stored" (fa_ref_backward_stored_out) is G with that D.
 *     F32: the library computes in fp32 (eps 6e-8) from an fp32 lse; dot products of <= 256
 *     terms, softmax sums of <= 400, and dK/dV sums over <= 400 rows x 8 heads give errors of a
 *     few hundred eps relative to the terms (about 1e-5 at worst), so 1e-4 m leaves a margin of
 *     ~10 while still catching any wrong term (a wrong mask bit or scale is >= 1e-2). The mm terms
 *     cover gradients that cancel to ~0 (a row seeing one key: dS = P (dP - D) = 0), where only
 *     the rounding of the terms is left; there the half types' error is all the stored out's
 *     (the naive one is 0), hence its own factor 3. An element with no term at all (a row
 *     outside every sequence, a key nobody sees or past seqused_k) must be exactly 0.
 *   - fp64 finite differences: central differences of L = sum(w * out) with respect to random
 *     entries of q, k, v (step 1e-6) and every sink (Richardson on steps 2^-10, 2^-9, exact in
 *     fp32) against the library's gradients for dout = w;
 *   - every argument error of fa_attention_backward is FA_STATUS_INVALID_ARGUMENT naming it,
 *     with the gradients untouched.
 *
 * bf16 cases run on the fastest bf16 kernel the CPU has (or the fp32 path without one);
 * FA_TEST_BF16_KERNEL=amx-model runs them on the software model of AMX (test_amx_model.h), and
 * ctest runs the others through FLASHATTN_CPU_AMX / FLASHATTN_CPU_BF16.
 *
 * FA_TEST_SEED=<n> reruns a whole run; FA_TEST_ONLY=<case> runs one case of it;
 * FA_TEST_RANDOM_CASES=<n> sets the random cases; FA_TEST_VERBOSE prints each case.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fa_ref.h"
#include "fa_ref_bwd.h"
#include "flashattn.h"
#include "test_util.h"

#include "test_backward.h"

#include "cpu/fa_cpu_bf16.h"
#if defined(FA_CPU_HAS_BF16)
#include "test_amx_model.h"
#endif

static int g_case_index = 0;
static int g_only = -1;
static int g_cases = 0;
static char g_where[512];
static double g_worst[4]; /* largest err / tol per dtype, reported at the end */

static const char *dt_name(fa_dtype dt)
{
    static const char *names[] = {"f32", "f16", "bf16", "f64"};
    return (int)dt >= 0 && (int)dt < 4 ? names[dt] : "?";
}

static void describe(const bcase *c, const char *name)
{
    snprintf(g_where, sizeof g_where,
             "case %d (%s): %s %s b=%lld sq=%lld sk=%lld h=%lld hk=%lld d=%lld dv=%lld causal=%d "
             "window=(%d,%d) softcap=%g alibi=%d sinks=%d dropout=%g scale=%.4g layout=%d "
             "packed=%d lse64=%d threads=%d,%d,%d amp=%g%s%s",
             g_case_index, name, dt_name(c->dt), c->varlen ? "varlen" : "dense", (long long)c->b,
             (long long)c->sq, (long long)c->sk, (long long)c->h, (long long)c->hk,
             (long long)c->d, (long long)c->dv, c->causal, c->wl, c->wr, c->softcap, c->alibi,
             c->sinks, c->dropout_p, c->scale, c->layout, c->packed, c->lse64, c->threads[0],
             c->threads[1], c->threads[2], c->amp, c->vl_seqused ? " seqused_k" : "",
             c->vl_offset ? " offset" : "");
    tu_where = g_where;
}

static int pick_layout(const bcase *c, tu_rng *r)
{
    return c->layout >= 0 ? c->layout : (int)tu_rng_int(r, 0, TU_NUM_LAYOUTS - 1);
}

static void *dup_bytes(const void *p, size_t n)
{
    void *q = malloc(n ? n : 1);
    if (!q) {
        exit(2);
    }
    memcpy(q, p, n);
    return q;
}

static double *dalloc(int64_t n)
{
    double *p = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    if (!p) {
        exit(2);
    }
    return p;
}

/* Sequence lengths (varlen: random cu_seqlens, maybe not starting at 0, empty sequences). */
static void make_sequences(const bcase *c, tu_rng *r, bprob *pb)
{
    const int64_t b = c->b;
    if (!c->varlen) {
        pb->tokens_q = b * c->sq;
        pb->tokens_k = b * c->sk;
        pb->max_sq = c->sq;
        pb->max_sk = c->sk;
        return;
    }
    int64_t s1[1] = {b + 1}, s0[1] = {b};
    pb->cuq = tu_tensor_new(FA_DTYPE_I32, 1, s1, TU_CONTIGUOUS, r);
    pb->cuk = tu_tensor_new(FA_DTYPE_I32, 1, s1, TU_CONTIGUOUS, r);
    pb->used = tu_tensor_new(FA_DTYPE_I32, 1, s0, TU_CONTIGUOUS, r);
    int32_t *cu_q = pb->cuq.t.data, *cu_k = pb->cuk.t.data, *used = pb->used.t.data;
    const int same_k = c->packed == 1; /* qkv packed: the k tokens are the q tokens */
    cu_q[0] = c->vl_offset ? (int32_t)tu_rng_int(r, 1, 3) : 0;
    cu_k[0] = same_k ? cu_q[0] : (c->vl_offset ? (int32_t)tu_rng_int(r, 1, 3) : 0);
    pb->max_sq = pb->max_sk = 0;
    for (int64_t i = 0; i < b; i++) {
        int64_t lq = (c->vl_zero && tu_rng_chance(r, 0.35)) ? 0 : tu_rng_int(r, 0, c->sq);
        if (c->vl_zero == 2 && i % 2 == 0) {
            lq = 0; /* every other sequence empty: fewer tokens than sequences when sq is 1 */
        }
        int64_t lk = (c->vl_zero && tu_rng_chance(r, 0.35)) ? 0 : tu_rng_int(r, 0, c->sk);
        lk = same_k ? lq : lk;
        cu_q[i + 1] = cu_q[i] + (int32_t)lq;
        cu_k[i + 1] = cu_k[i] + (int32_t)lk;
        used[i] = (int32_t)tu_rng_int(r, 0, lk);
        pb->max_sq = lq > pb->max_sq ? lq : pb->max_sq;
        pb->max_sk = lk > pb->max_sk ? lk : pb->max_sk;
    }
    /* rows past the last sequence, which belong to none */
    pb->tokens_q = cu_q[b] + (c->vl_offset ? tu_rng_int(r, 0, 3) : 0);
    pb->tokens_k = same_k ? pb->tokens_q : cu_k[b] + (c->vl_offset ? tu_rng_int(r, 0, 3) : 0);
    pb->max_sq += tu_rng_int(r, 0, 1);
    pb->max_sk += tu_rng_int(r, 0, 1);
}

/* Shapes of q, k, v (and out) in the case's form. */
static int shapes(const bcase *c, const bprob *pb, int64_t *shq, int64_t *shk, int64_t *shv,
                  int64_t *sho, int64_t *shl)
{
    const int64_t h = c->h, hk = c->hk, d = c->d, dv = c->dv;
    if (c->varlen) {
        int64_t q[3] = {pb->tokens_q, h, d}, k[3] = {pb->tokens_k, hk, d};
        int64_t v[3] = {pb->tokens_k, hk, dv}, o[3] = {pb->tokens_q, h, dv};
        int64_t l[2] = {h, pb->tokens_q};
        memcpy(shq, q, sizeof q);
        memcpy(shk, k, sizeof k);
        memcpy(shv, v, sizeof v);
        memcpy(sho, o, sizeof o);
        memcpy(shl, l, sizeof l);
        return 3;
    }
    int64_t q[4] = {c->b, c->sq, h, d}, k[4] = {c->b, c->sk, hk, d}, v[4] = {c->b, c->sk, hk, dv},
            o[4] = {c->b, c->sq, h, dv}, l[3] = {c->b, h, c->sq};
    memcpy(shq, q, sizeof q);
    memcpy(shk, k, sizeof k);
    memcpy(shv, v, sizeof v);
    memcpy(sho, o, sizeof o);
    memcpy(shl, l, sizeof l);
    return 4;
}

/* q, k, v (or their gradients): separate, or parts of one packed buffer. */
static void make_qkv(const bcase *c, tu_rng *r, int nd, const int64_t *shq, const int64_t *shk,
                     const int64_t *shv, tu_tensor *q, tu_tensor *k, tu_tensor *v)
{
    fa_dtype dt = c->dt;
    if (c->packed == 1) {
        tu_tensor parts[3];
        tu_tensor_packed(dt, nd, shq, 3, pick_layout(c, r), r, parts);
        *q = parts[0];
        *k = parts[1];
        *v = parts[2];
    } else if (c->packed == 2) {
        tu_tensor parts[2];
        *q = tu_tensor_new(dt, nd, shq, pick_layout(c, r), r);
        tu_tensor_packed(dt, nd, shk, 2, pick_layout(c, r), r, parts);
        *k = parts[0];
        *v = parts[1];
    } else {
        *q = tu_tensor_new(dt, nd, shq, pick_layout(c, r), r);
        *k = tu_tensor_new(dt, nd, shk, pick_layout(c, r), r);
        *v = tu_tensor_new(dt, nd, shv, pick_layout(c, r), r);
    }
}

/* Parts of one packed buffer share their shapes. */
static void packed_shapes(bcase *c)
{
    if (c->packed == 1) {
        c->sk = c->sq;
        c->hk = c->h;
        c->dv = c->d;
    } else if (c->packed == 2) {
        c->dv = c->d;
    }
}

static void prob_build(const bcase *c, tu_rng *r, bprob *pb)
{
    memset(pb, 0, sizeof *pb);
    make_sequences(c, r, pb);
    int64_t shq[4], shk[4], shv[4], sho[4], shl[3];
    int nd = shapes(c, pb, shq, shk, shv, sho, shl);
    make_qkv(c, r, nd, shq, shk, shv, &pb->q, &pb->k, &pb->v);
    tu_fill_uniform(&pb->q, r, -c->amp, c->amp);
    tu_fill_uniform(&pb->k, r, -c->amp, c->amp);
    tu_fill_uniform(&pb->v, r, -2.0, 2.0);
    if (c->alibi) {
        int64_t sa[2] = {c->b, c->h};
        if (c->alibi == 1) {
            sa[0] = c->h;
        }
        pb->alibi = tu_tensor_new(FA_DTYPE_F32, c->alibi, sa, pick_layout(c, r), r);
        tu_fill_uniform(&pb->alibi, r, 0.01, 1.0);
    }
    if (c->sinks) {
        int64_t ss[1] = {c->h};
        pb->sinks = tu_tensor_new(FA_DTYPE_F32, 1, ss, TU_CONTIGUOUS, r);
        tu_fill_uniform(&pb->sinks, r, -3.0, 3.0);
        pb->dsinks = tu_tensor_new(FA_DTYPE_F32, 1, ss, TU_CONTIGUOUS, r);
    }
    pb->out = tu_tensor_new(c->dt, nd, sho, pick_layout(c, r), r);
    fa_dtype lse_dt = (c->dt == FA_DTYPE_F64 && c->lse64) ? FA_DTYPE_F64 : FA_DTYPE_F32;
    pb->lse = tu_tensor_new(lse_dt, nd - 1, shl, pick_layout(c, r), r);
    pb->dout = tu_tensor_new(c->dt, nd, sho, pick_layout(c, r), r);
    tu_fill_uniform(&pb->dout, r, -1.0, 1.0);
    make_qkv(c, r, nd, shq, shk, shv, &pb->dq, &pb->dk, &pb->dv);

    fa_fwd_args *a = &pb->fa;
    fa_fwd_args_init(a);
    a->q = &pb->q.t;
    a->k = &pb->k.t;
    a->v = &pb->v.t;
    a->out = &pb->out.t;
    a->lse = &pb->lse.t;
    if (c->varlen) {
        a->cu_seqlens_q = &pb->cuq.t;
        a->cu_seqlens_k = &pb->cuk.t;
        a->seqused_k = c->vl_seqused ? &pb->used.t : NULL;
        a->max_seqlen_q = pb->max_sq;
        a->max_seqlen_k = pb->max_sk;
    }
    a->alibi_slopes = c->alibi ? &pb->alibi.t : NULL;
    a->sinks = c->sinks ? &pb->sinks.t : NULL;
    a->softmax_scale = c->scale;
    a->causal = c->causal;
    a->window_left = c->wl;
    a->window_right = c->wr;
    a->softcap = c->softcap;
    a->dropout_p = c->dropout_p;
    a->seed = tu_rng_u64(r);
    a->offset = tu_rng_chance(r, 0.5) ? tu_rng_u64(r) : (uint64_t)tu_rng_int(r, 0, 1000);
    a->num_threads = c->threads[0];

    fa_bwd_args *ba = &pb->ba;
    fa_bwd_args_init(ba);
    ba->fwd = a;
    ba->dout = &pb->dout.t;
    ba->dq = &pb->dq.t;
    ba->dk = &pb->dk.t;
    ba->dv = &pb->dv.t;
    ba->dsinks = c->sinks ? &pb->dsinks.t : NULL;
}

static void prob_free(bprob *pb)
{
    tu_tensor *all[] = {&pb->cuq, &pb->cuk,  &pb->used, &pb->q,     &pb->k,
                        &pb->v,   &pb->out,  &pb->lse,  &pb->dout,  &pb->dq,
                        &pb->dk,  &pb->dv,   &pb->alibi, &pb->sinks, &pb->dsinks};
    /* a packed buffer is owned by its first part, freed with it */
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        tu_tensor_free(all[i]);
    }
}

static void grads_poison(const bcase *c, bprob *pb)
{
    tu_poison(&pb->dq); /* packed: poisons the whole shared buffer */
    tu_poison(&pb->dk);
    tu_poison(&pb->dv);
    if (c->sinks) {
        tu_poison(&pb->dsinks);
    }
}

/* Every element of the views written, nothing outside their union: each view sees exactly the
   other views' elements (written, so not poison) as changed outside itself. */
static void check_written(const char *name, const tu_tensor *const *views, int n)
{
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        total += tu_numel(&views[i]->t);
    }
    for (int i = 0; i < n; i++) {
        int64_t unwritten = tu_count_poisoned_in_view(views[i]);
        int64_t outside = tu_count_clobbered(views[i]) - (total - tu_numel(&views[i]->t));
        TU_CHECK(unwritten == 0, "%s part %d: %lld elements not written", name, i,
                 (long long)unwritten);
        TU_CHECK(outside == 0, "%s part %d: %lld elements outside the views written", name, i,
                 (long long)outside);
    }
}

static void check_all_written(const bcase *c, const bprob *pb)
{
    const tu_tensor *dqkv[3] = {&pb->dq, &pb->dk, &pb->dv};
    if (c->packed == 1) {
        check_written("dqkv", dqkv, 3);
    } else {
        check_written("dq", dqkv, 1);
        check_written(c->packed == 2 ? "dkv" : "dk", dqkv + 1, c->packed == 2 ? 2 : 1);
        if (c->packed != 2) {
            check_written("dv", dqkv + 2, 1);
        }
    }
    if (c->sinks) {
        const tu_tensor *ds[1] = {&pb->dsinks};
        check_written("dsinks", ds, 1);
    }
}

static double half_ulp_rel(fa_dtype dt)
{
    switch (dt) {
    case FA_DTYPE_F16:
        return ldexp(1.0, -11);
    case FA_DTYPE_BF16:
        return ldexp(1.0, -8);
    case FA_DTYPE_F32:
        return ldexp(1.0, -24);
    default:
        return ldexp(1.0, -53);
    }
}

/* One gradient tensor: the view t (dense rows per batch `seqlen`) against the oracle. */
typedef struct gcheck {
    const char *name;
    const fa_tensor *t;
    int varlen;
    int64_t seqlen, tokens, heads, dim;
    const double *ref, *mag, *lowp, *stored; /* stored: D from out in the dtype (half types) */
} gcheck;

static void grad_compare(const gcheck *g, const bcase *c, double bias_rel)
{
    double maxref = 0, maxmag = 0, maxlowp = 0, maxstored = 0, maxerr = 0, w_ours = 0, w_ref = 0;
    int64_t w_e = -1, nonzero = 0;
    for (int64_t t = 0; t < g->tokens; t++) {
        for (int64_t hh = 0; hh < g->heads; hh++) {
            for (int64_t x = 0; x < g->dim; x++) {
                int64_t ix[4] = {t, hh, x, 0};
                if (!g->varlen && g->t->ndim == 4) {
                    int64_t dense[4] = {t / g->seqlen, t % g->seqlen, hh, x};
                    memcpy(ix, dense, sizeof ix);
                } else if (g->t->ndim == 1) {
                    ix[0] = hh;
                }
                const int64_t e = (t * g->heads + hh) * g->dim + x;
                double ours = fa_ref_load(g->t, ix), want = g->ref[e];
                double err = isnan(ours) ? INFINITY : fabs(ours - want);
                if (g->mag[e] == 0.0 && ours != 0.0) {
                    /* no term at all (a row outside every sequence, a key nobody sees, past
                       seqused_k, or dropped everywhere): exactly 0, not just small */
                    nonzero++;
                }
                maxref = fmax(maxref, fabs(want));
                maxmag = fmax(maxmag, g->mag[e]);
                if (g->lowp) {
                    maxlowp = fmax(maxlowp, fabs(g->lowp[e] - want));
                    maxstored = fmax(maxstored, fabs(g->stored[e] - want));
                }
                if (err > maxerr || w_e < 0) {
                    maxerr = err;
                    w_e = e;
                    w_ours = ours;
                    w_ref = want;
                }
            }
        }
    }
    double tol;
    const char *crit;
    switch (c->dt) {
    case FA_DTYPE_F64:
        tol = (c->lse64 ? 1e-10 * maxref + 1e-13 * maxmag : 1e-4 * maxref + 1e-6 * maxmag);
        crit = c->lse64 ? "1e-10 m + 1e-13 mm" : "fp32 lse: 1e-4 m + 1e-6 mm";
        break;
    case FA_DTYPE_F32:
        tol = 1e-4 * maxref + 1e-6 * maxmag;
        crit = "1e-4 m + 1e-6 mm";
        break;
    default:
        tol = 3.0 * maxlowp + 3.0 * maxstored + 2.0 * half_ulp_rel(c->dt) * maxref +
              1e-6 * maxmag;
        crit = "3 max|naive - ref| + 3 max|stored - ref| + 2 u m + 1e-6 mm";
        break;
    }
    tol += bias_rel * maxmag;
    TU_CHECK(nonzero == 0, "%s: %lld elements that no term reaches are not exactly 0", g->name,
             (long long)nonzero);
    if (w_e >= 0 && tol > 0) {
        g_worst[c->dt] = fmax(g_worst[c->dt], maxerr / tol);
    }
    TU_CHECK(maxerr <= tol,
             "%s: max err %.3g > tol %.3g (%s, m %.3g, mm %.3g, naive %.3g, stored %.3g); at "
             "[token %lld, head %lld, %lld]: ours %.9g ref %.9g",
             g->name, maxerr, tol, crit, maxref, maxmag, maxlowp, maxstored,
             (long long)(w_e / (g->heads * g->dim)), (long long)(w_e / g->dim % g->heads),
             (long long)(w_e % g->dim), w_ours, w_ref);
}

/* max |x| over the finite elements of a view (an lse is +inf where a row sees nothing). */
static double max_abs(const fa_tensor *t)
{
    double m = 0.0;
    int64_t ix[4] = {0, 0, 0, 0};
    if (tu_numel(t) > 0) {
        do {
            double x = fabs(fa_ref_load(t, ix));
            m = isfinite(x) ? fmax(m, x) : m;
        } while (tu_next_index(t, ix));
    }
    return m;
}

/* The gradients of the case against the oracle. */
static void compare_oracle(const bcase *c, const bprob *pb)
{
    const int64_t nq = pb->tokens_q * c->h * c->d, nk = pb->tokens_k * c->hk * c->d;
    const int64_t nv = pb->tokens_k * c->hk * c->dv;
    double *g[4] = {dalloc(nq), dalloc(nk), dalloc(nv), dalloc(c->h)};
    double *m[4] = {dalloc(nq), dalloc(nk), dalloc(nv), dalloc(c->h)};
    double *l[4] = {NULL, NULL, NULL, NULL}, *so[4] = {NULL, NULL, NULL, NULL};
    int rc = fa_ref_backward_mag(&pb->ba, g[0], g[1], g[2], g[3], m[0], m[1], m[2], m[3]);
    TU_CHECK(rc == 0, "fa_ref_backward_mag failed");
    if (c->dt == FA_DTYPE_F16 || c->dt == FA_DTYPE_BF16) {
        l[0] = dalloc(nq), l[1] = dalloc(nk), l[2] = dalloc(nv), l[3] = dalloc(c->h);
        rc = fa_ref_backward_lowp(&pb->ba, l[0], l[1], l[2], l[3]);
        TU_CHECK(rc == 0, "fa_ref_backward_lowp failed");
        so[0] = dalloc(nq), so[1] = dalloc(nk), so[2] = dalloc(nv), so[3] = dalloc(c->h);
        rc = fa_ref_backward_stored_out(&pb->ba, so[0], so[1], so[2], so[3]);
        TU_CHECK(rc == 0, "fa_ref_backward_stored_out failed");
    }
    /* P = exp(s - lse) is recomputed from an lse stored in fp32 (and scores computed in fp32
       unless F64): absolute errors ~eps |lse| and ~eps |s| in the exponent move every term by
       that relative amount, so 4 eps max|lse| (finite entries of the forward's lse) is added to
       the mm factor; ALiBi makes scores as large as slope * distance, which test_forward budgets
       the same way. */
    const double eps = pb->lse.t.dtype == FA_DTYPE_F64 ? 0x1p-53 : 0x1p-24;
    double bias_rel = 4.0 * eps * max_abs(&pb->lse.t);
    if (c->alibi) {
        bias_rel += 4.0 * eps * max_abs(&pb->alibi.t) * (double)(pb->max_sq + pb->max_sk);
    }
    const gcheck checks[4] = {
        {"dq", &pb->dq.t, c->varlen, c->sq, pb->tokens_q, c->h, c->d, g[0], m[0], l[0], so[0]},
        {"dk", &pb->dk.t, c->varlen, c->sk, pb->tokens_k, c->hk, c->d, g[1], m[1], l[1], so[1]},
        {"dv", &pb->dv.t, c->varlen, c->sk, pb->tokens_k, c->hk, c->dv, g[2], m[2], l[2], so[2]},
        {"dsinks", &pb->dsinks.t, 0, 1, 1, c->h, 1, g[3], m[3], l[3], so[3]},
    };
    for (int i = 0; i < (c->sinks ? 4 : 3); i++) {
        /* dsinks is fp32 whatever the dtype: one fp32 rounding more */
        grad_compare(&checks[i], c, bias_rel + (i == 3 ? 0x1p-23 : 0.0));
    }
    for (int i = 0; i < 4; i++) {
        free(g[i]);
        free(m[i]);
        free(l[i]);
        free(so[i]);
    }
}

void tb_run_case(const bcase *c0, const char *name, tu_rng *rng)
{
    int idx = g_case_index++;
    if (g_only >= 0 && idx != g_only) {
        (void)tu_rng_u64(rng); /* keep the random stream identical to a full run */
        return;
    }
    tu_rng rr = {tu_rng_u64(rng)};
    bcase C = *c0, *c = &C;
    packed_shapes(c);
    describe(c, name);
    if (getenv("FA_TEST_VERBOSE")) {
        printf("%s\n", g_where);
    }
    alarm(60);
    int fails_before = tu_failures;
    bprob pb;
    prob_build(c, &rr, &pb);

    fa_status st = fa_attention_forward(&pb.fa);
    TU_CHECK(st == FA_STATUS_OK, "forward returned %s: %s", fa_status_string(st), fa_last_error());
    const tu_tensor *inputs[6] = {&pb.q, &pb.k, &pb.v, &pb.out, &pb.lse, &pb.dout};
    void *copies[6];
    for (int i = 0; i < 6; i++) {
        copies[i] = dup_bytes(inputs[i]->base, inputs[i]->nbytes);
    }
    void *first[4] = {NULL, NULL, NULL, NULL};
    const tu_tensor *grads[4] = {&pb.dq, &pb.dk, &pb.dv, &pb.dsinks};
    for (int run = 0; run < 3 && st == FA_STATUS_OK; run++) {
        grads_poison(c, &pb);
        pb.fa.num_threads = c->threads[run];
        st = fa_attention_backward(&pb.ba);
        TU_CHECK(st == FA_STATUS_OK, "backward (num_threads=%d) returned %s: %s",
                 c->threads[run], fa_status_string(st), fa_last_error());
        if (st != FA_STATUS_OK) {
            break;
        }
        for (int i = 0; i < (c->sinks ? 4 : 3); i++) {
            if (run == 0) {
                first[i] = dup_bytes(grads[i]->base, grads[i]->nbytes);
            } else {
                TU_CHECK(memcmp(first[i], grads[i]->base, grads[i]->nbytes) == 0,
                         "gradient %d differs between num_threads=%d and %d", i, c->threads[0],
                         c->threads[run]);
            }
        }
        if (run == 0) {
            check_all_written(c, &pb);
            for (int i = 0; i < 6; i++) {
                /* packed views share one buffer: compare only through the owning part */
                if (inputs[i]->owner) {
                    TU_CHECK(memcmp(copies[i], inputs[i]->base, inputs[i]->nbytes) == 0,
                             "input %d (q, k, v, out, lse, dout) was modified", i);
                }
            }
        }
    }
    if (st == FA_STATUS_OK) {
        compare_oracle(c, &pb);
    }
    for (int i = 0; i < 6; i++) {
        free(copies[i]);
    }
    for (int i = 0; i < 4; i++) {
        free(first[i]);
    }
    prob_free(&pb);
    g_cases++;
    if (tu_failures != fails_before) {
        printf("  ^ failing %s\n", g_where);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Finite differences (fp64)                                                                   */

/* L = sum(w * out) over every element of out, with w = dout; *labs = sum |w * out|. */
static double fd_loss(const bprob *pb, double *labs)
{
    double loss = 0.0, mag = 0.0;
    int64_t ix[4] = {0, 0, 0, 0};
    if (tu_numel(&pb->out.t) > 0) {
        do {
            double term = fa_ref_load(&pb->dout.t, ix) * fa_ref_load(&pb->out.t, ix);
            loss += term;
            mag += fabs(term);
        } while (tu_next_index(&pb->out.t, ix));
    }
    if (labs) {
        *labs = mag;
    }
    return loss;
}

/* L with one input element set to x (restored by the caller). */
static double fd_eval(bprob *pb, const fa_tensor *t, const int64_t *ix, double x)
{
    fa_ref_store(t, ix, x);
    fa_status st = fa_attention_forward(&pb->fa);
    TU_CHECK(st == FA_STATUS_OK, "forward returned %s: %s", fa_status_string(st),
             fa_last_error());
    return fd_loss(pb, NULL);
}

static void run_fd_case(const bcase *c0, tu_rng *rng)
{
    tu_rng rr = {tu_rng_u64(rng)};
    bcase C = *c0, *c = &C;
    packed_shapes(c);
    g_case_index = -1; /* not a numbered sweep case: FA_TEST_ONLY does not select it */
    describe(c, "finite differences");
    bprob pb;
    prob_build(c, &rr, &pb);
    for (int64_t hh = 0; c->sinks && hh < c->h; hh++) {
        /* on a 2^-12 grid, so that s +- 2^-10 and s +- 2^-9 are exact in fp32 even where they
           cross a power of two */
        const int64_t ix[1] = {hh};
        double s = ldexp(nearbyint(ldexp(fa_ref_load(&pb.sinks.t, ix), 12)), -12);
        fa_ref_store(&pb.sinks.t, ix, s != 0.0 ? s : 0x1p-12);
    }
    fa_status st = fa_attention_forward(&pb.fa);
    if (st == FA_STATUS_OK) {
        st = fa_attention_backward(&pb.ba);
    }
    TU_CHECK(st == FA_STATUS_OK, "forward/backward returned %s: %s", fa_status_string(st),
             fa_last_error());
    double labs;
    (void)fd_loss(&pb, &labs);
    /* step 1e-6: truncation ~1e-12 * L''', rounding ~eps * sum|w out| / step */
    const double h = 1e-6, noise = 8.0 * 0x1p-53 * labs / h;
    const tu_tensor *ins[3] = {&pb.q, &pb.k, &pb.v}, *gs[3] = {&pb.dq, &pb.dk, &pb.dv};
    for (int w = 0; w < 3 && st == FA_STATUS_OK; w++) {
        const fa_tensor *t = &ins[w]->t;
        const double tol = 1e-6 * fmax(1.0, max_abs(&gs[w]->t)) + noise;
        for (int e = 0; e < 6 && tu_numel(t) > 0; e++) {
            int64_t ix[4] = {0, 0, 0, 0};
            for (int i = 0; i < t->ndim; i++) {
                ix[i] = tu_rng_int(&rr, 0, t->shape[i] - 1);
            }
            double x0 = fa_ref_load(t, ix);
            double fd = (fd_eval(&pb, t, ix, x0 + h) - fd_eval(&pb, t, ix, x0 - h)) / (2.0 * h);
            fa_ref_store(t, ix, x0);
            double an = fa_ref_load(&gs[w]->t, ix);
            TU_CHECK(fabs(fd - an) <= tol,
                     "d%c at [%lld,%lld,%lld,%lld]: analytic %.12g, finite difference %.12g "
                     "(tol %.3g)",
                     "qkv"[w], (long long)ix[0], (long long)ix[1], (long long)ix[2],
                     (long long)ix[3], an, fd, tol);
        }
    }
    /* Sinks are fp32: steps 2^-10 and 2^-9 from the grid are exact, and Richardson's combination
       of the two central differences cancels the h^2 term, leaving h^4 ~ 1e-12 of sum|w out|. */
    for (int64_t hh = 0; c->sinks && hh < c->h && st == FA_STATUS_OK; hh++) {
        const fa_tensor *t = &pb.sinks.t;
        const int64_t ix[1] = {hh};
        const double s0 = fa_ref_load(t, ix), hs = 0x1p-10;
        double d1 = (fd_eval(&pb, t, ix, s0 + hs) - fd_eval(&pb, t, ix, s0 - hs)) / (2.0 * hs);
        double d2 =
            (fd_eval(&pb, t, ix, s0 + 2 * hs) - fd_eval(&pb, t, ix, s0 - 2 * hs)) / (4.0 * hs);
        fa_ref_store(t, ix, s0);
        double fd = (4.0 * d1 - d2) / 3.0, an = fa_ref_load(&pb.dsinks.t, ix);
        double tol = 4.0 * 0x1p-24 * fabs(an) + 8.0 * 0x1p-53 * labs / hs + 1e-10 * labs;
        TU_CHECK(fabs(fd - an) <= tol, "dsinks[%lld]: analytic %.9g, finite difference %.12g "
                 "(tol %.3g)", (long long)hh, an, fd, tol);
    }
    prob_free(&pb);
}

static void run_fd(tu_rng *rng)
{
    for (int i = 0; i < 16; i++) {
        bcase c;
        tb_base_case(&c, FA_DTYPE_F64, rng);
        c.varlen = i % 3 == 2;
        c.b = tu_rng_int(rng, 1, c.varlen ? 4 : 2);
        c.hk = tu_rng_int(rng, 1, 2);
        c.h = c.hk * (i % 4 == 3 ? 4 : tu_rng_int(rng, 1, 2));
        c.sq = tu_rng_int(rng, 1, 12);
        c.sk = tu_rng_int(rng, 1, 12);
        c.d = tu_rng_int(rng, 1, 16);
        c.dv = tu_rng_chance(rng, 0.5) ? c.d : tu_rng_int(rng, 1, 16);
        c.causal = i % 2;
        if (i % 5 == 1) {
            c.wl = (int)tu_rng_int(rng, 0, 4);
            c.wr = (int)tu_rng_int(rng, -1, 3);
        }
        c.alibi = i % 4 == 0 ? 1 + (i / 4) % 2 : 0;
        c.sinks = i % 3 != 1;
        if (i % 4 == 1) {
            c.dropout_p = tu_rng_uniform(rng, 0.1, 0.6);
        } else if (i % 4 == 2) {
            c.softcap = tu_rng_uniform(rng, 0.7, 5.0);
        }
        if (i % 6 == 5) {
            c.scale = tu_rng_uniform(rng, 0.2, 2.0);
        }
        c.packed = i % 7 == 3 ? 1 : (i % 7 == 6 ? 2 : 0);
        c.vl_zero = c.vl_offset = c.vl_seqused = c.varlen;
        run_fd_case(&c, rng);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Argument errors                                                                             */

static void check_error(bprob *pb, const fa_bwd_args *ba, const char *name, const char *what)
{
    fa_status st = fa_attention_backward(ba);
    const char *msg = fa_last_error();
    TU_CHECK(st == FA_STATUS_INVALID_ARGUMENT, "%s: status %s, want INVALID_ARGUMENT (%s)", what,
             fa_status_string(st), msg);
    TU_CHECK(tu_names(msg, name), "%s: message \"%s\" does not name %s", what, msg, name);
    const tu_tensor *g[4] = {&pb->dq, &pb->dk, &pb->dv, &pb->dsinks};
    for (int i = 0; i < 4; i++) {
        TU_CHECK(tu_count_poisoned_in_view(g[i]) == tu_numel(&g[i]->t) &&
                     tu_count_clobbered(g[i]) == 0,
                 "%s: gradient %d was written by a call that failed", what, i);
    }
}

static void run_errors(tu_rng *rng)
{
    bcase c;
    tb_base_case(&c, FA_DTYPE_F32, rng);
    c.b = 2;
    c.sq = 5;
    c.sk = 6;
    c.h = 4;
    c.hk = 2;
    c.d = c.dv = 8;
    c.sinks = 1;
    c.layout = TU_CONTIGUOUS;
    g_case_index = -1;
    describe(&c, "argument errors");
    tu_rng rr = {tu_rng_u64(rng)};
    bprob pb;
    prob_build(&c, &rr, &pb);
    fa_status st = fa_attention_forward(&pb.fa);
    TU_CHECK(st == FA_STATUS_OK, "forward returned %s", fa_status_string(st));
    grads_poison(&c, &pb);

    fa_bwd_args ba = pb.ba;
    fa_fwd_args fa = pb.fa;
    ba.fwd = NULL;
    check_error(&pb, &ba, "fwd", "NULL fwd");
    ba = pb.ba;
    ba.fwd = &fa;
    fa.lse = NULL;
    check_error(&pb, &ba, "lse", "no lse");

    const char *names[4] = {"dout", "dq", "dk", "dv"};
    for (int which = 0; which < 4; which++) {
        for (int kind = 0; kind < 6; kind++) {
            static const char *kinds[6] = {"NULL", "last dim", "first dim", "dtype", "last stride",
                                           "ndim"};
            ba = pb.ba;
            const fa_tensor **slot[4] = {&ba.dout, &ba.dq, &ba.dk, &ba.dv};
            fa_tensor t = **slot[which];
            if (kind == 1) {
                t.shape[t.ndim - 1] += 1;
            } else if (kind == 2) {
                t.shape[0] += 1;
            } else if (kind == 3) {
                t.dtype = FA_DTYPE_BF16;
            } else if (kind == 4) {
                t.stride[t.ndim - 1] = 2;
            } else if (kind == 5) {
                t.ndim = 3;
            }
            *slot[which] = kind == 0 ? NULL : &t;
            char what[64];
            snprintf(what, sizeof what, "%s: %s", names[which], kinds[kind]);
            check_error(&pb, &ba, names[which], what);
        }
    }

    ba = pb.ba;
    ba.dsinks = NULL;
    check_error(&pb, &ba, "dsinks", "dsinks missing with sinks");
    ba = pb.ba;
    fa = pb.fa;
    fa.sinks = NULL;
    ba.fwd = &fa;
    check_error(&pb, &ba, "dsinks", "dsinks without sinks");
    fa_tensor ds = pb.dsinks.t;
    ds.dtype = FA_DTYPE_F64;
    ba = pb.ba;
    ba.dsinks = &ds;
    check_error(&pb, &ba, "dsinks", "dsinks dtype");
    ds = pb.dsinks.t;
    ds.shape[0] += 1;
    check_error(&pb, &ba, "dsinks", "dsinks shape");
    TU_CHECK(fa_attention_backward(NULL) == FA_STATUS_INVALID_ARGUMENT, "NULL args accepted");

    st = fa_attention_backward(&pb.ba);
    TU_CHECK(st == FA_STATUS_OK, "a valid call after the failed ones returned %s: %s",
             fa_status_string(st), fa_last_error());
    prob_free(&pb);
}

int main(void)
{
    uint64_t seed = tu_master_seed("test_backward");
    const char *only = getenv("FA_TEST_ONLY");
    if (only && *only) {
        g_only = atoi(only);
    }
    tu_rng rng = {seed};
    tu_watchdog_install(g_where);
    const char *kernel = getenv("FA_TEST_BF16_KERNEL");
    if (kernel && strcmp(kernel, "amx-model") == 0) {
#if defined(FA_CPU_HAS_BF16)
        const fa_cpu_bf16_kernel *usable[2];
        if (fa_cpu_bf16_kernels(usable) > 0) { /* the packing around it needs AVX512-BF16 */
            fa_cpu_bf16_kernel_override(&k_amx_model);
            printf("test_backward: bf16 products on %s\n", k_amx_model.name);
        } else {
            printf("test_backward: no AVX512-BF16 here, bf16 runs the fp32 path\n");
        }
#endif
    }
    double t0 = tu_now();
    run_errors(&rng);
    run_fd(&rng);
    double t1 = tu_now();
    g_case_index = 0;
    tb_run_directed(&rng);
    double t2 = tu_now();
    int n_random = 1500;
    const char *nr = getenv("FA_TEST_RANDOM_CASES");
    if (nr && *nr) {
        n_random = atoi(nr);
    }
    tb_run_random(&rng, n_random);
    double t3 = tu_now();
    printf("test_backward: %d cases (errors + finite differences %.1fs, directed %.1fs, random "
           "%.1fs); largest err/tol: f32 %.3f, f16 %.3f, bf16 %.3f, f64 %.3f\n",
           g_cases, t1 - t0, t2 - t1, t3 - t2, g_worst[FA_DTYPE_F32], g_worst[FA_DTYPE_F16],
           g_worst[FA_DTYPE_BF16], g_worst[FA_DTYPE_F64]);
#if defined(FA_CPU_HAS_BF16)
    TU_CHECK(g_emu_errors == 0,
             "AMX model: %d tile operations without a configuration or with shapes that do not fit",
             g_emu_errors);
#endif
    return tu_finish("test_backward");
}
