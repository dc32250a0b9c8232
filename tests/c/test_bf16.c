/*
 * test_bf16: the bf16 kernels of the CPU forward and backward (src/cpu/fa_cpu_bf16.h).
 *
 *   - The AMX kernel's source (fa_cpu_amx_body.h) compiled against a software model of the tile
 *     instructions written from the SDM's pseudo-code (test_amx_model.h), so that it runs on any
 *     x86-64 machine; where the CPU has AMX, the real kernel too, and whether it matches the
 *     model bitwise is printed. AVX512-BF16 where the CPU has it. Each against exact products
 *     summed in double, within the fp32 summation bound (k+1) 2^-24 sum|terms|, over the
 *     contract's shapes (m, n multiples of 16, k of 32), with gaps between rows, accumulating or
 *     not, and nothing outside C written.
 *   - The packing helpers against scalar loops, exactly.
 *   - Whole forward passes on the model of AMX (the code path AMX machines run) against the
 *     double oracle with test_forward's bf16 criterion: max|ours - ref| <= 2 max|lowp - ref| +
 *     half an ulp of max|ref|. (Whole backward passes on the model: test_backward_amx_model.)
 *
 * FA_TEST_SEED=<n> reruns a run.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_ref.h"
#include "flashattn.h"
#include "test_util.h"

#include "cpu/fa_cpu.h"
#include "cpu/fa_cpu_info.h"
#include "cpu/fa_cpu_bf16.h"
#include "util/fa_half.h"

#if defined(FA_CPU_HAS_BF16)

#include "test_amx_model.h"

/* ---- the products ------------------------------------------------------------------------ */

static uint16_t rand_bf16(tu_rng *r, double amp)
{
    return fa_f32_to_bf16((float)tu_rng_uniform(r, -amp, amp));
}

/* C (m x n, ldc) against exact products; returns the number of bad elements, counts writes
 * outside C into *clobbered. */
static int64_t check_gemm(const fa_cpu_bf16_kernel *kern, tu_rng *r, int64_t m, int64_t n,
                          int64_t k, int accumulate, float *out_c, size_t c_size)
{
    const int64_t lda = k + tu_rng_int(r, 0, 9), ldb = n + 16 * tu_rng_int(r, 0, 1);
    const int64_t ldc = n + tu_rng_int(r, 0, 5);
    uint16_t *a = malloc(sizeof *a * (size_t)(m * lda));
    uint32_t *b = malloc(sizeof *b * (size_t)(k / 2 * ldb));
    float *c = out_c;
    for (int64_t i = 0; i < m * lda; i++)
        a[i] = rand_bf16(r, 2.0);
    for (int64_t i = 0; i < k / 2 * ldb; i++)
        b[i] = (uint32_t)rand_bf16(r, 2.0) | (uint32_t)rand_bf16(r, 2.0) << 16;
    for (size_t i = 0; i < c_size; i++)
        c[i] = (float)tu_rng_uniform(r, -4, 4);
    float *c0 = malloc(sizeof *c0 * c_size);
    memcpy(c0, c, sizeof *c0 * c_size);

    kern->begin();
    kern->gemm(c, ldc, a, lda, b, ldb, m, n, k, accumulate);
    kern->end();

    int64_t bad = 0;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double want = accumulate ? c0[i * ldc + j] : 0, mag = fabs(want);
            for (int64_t x = 0; x < k; x++) {
                const uint32_t pair = b[x / 2 * ldb + j];
                const double t = (double)fa_bf16_to_f32(a[i * lda + x]) *
                                 (double)fa_bf16_to_f32((uint16_t)(x & 1 ? pair >> 16 : pair));
                want += t;
                mag += fabs(t);
            }
            const double err = fabs((double)c[i * ldc + j] - want);
            if (!(err <= (double)(k + 1) * ldexp(mag, -24) * 1.01 + 1e-30)) {
                if (bad++ == 0)
                    TU_CHECK(0, "%s m=%lld n=%lld k=%lld acc=%d: C[%lld][%lld] = %.9g, want %.9g",
                             kern->name, (long long)m, (long long)n, (long long)k, accumulate,
                             (long long)i, (long long)j, c[i * ldc + j], want);
            }
        }
    int64_t clobbered = 0;
    for (int64_t i = 0; i < (int64_t)c_size; i++)
        if ((i % ldc >= n || i / ldc >= m) && memcmp(&c[i], &c0[i], sizeof *c) != 0)
            clobbered++;
    TU_CHECK(clobbered == 0, "%s m=%lld n=%lld k=%lld: %lld elements written outside C",
             kern->name, (long long)m, (long long)n, (long long)k, (long long)clobbered);
    free(a);
    free(b);
    free(c0);
    return bad;
}

/* Runs kern on random shapes; with model, the model too on the same operands, and counts the
 * products where the two agree bitwise. */
static void test_gemm(const fa_cpu_bf16_kernel *kern, const fa_cpu_bf16_kernel *model,
                      tu_rng *rng, int cases)
{
    int64_t differ = 0, compared = 0;
    for (int i = 0; i < cases; i++) {
        const int64_t m = 16 * tu_rng_int(rng, 1, 6), n = 16 * tu_rng_int(rng, 1, 6);
        const int64_t k = 32 * tu_rng_int(rng, 1, 8);
        const int accumulate = (int)tu_rng_int(rng, 0, 1);
        const size_t c_size = (size_t)((m + 1) * (n + 6));
        float *c1 = malloc(sizeof *c1 * c_size), *c2 = malloc(sizeof *c2 * c_size);
        const tu_rng start = *rng;
        check_gemm(kern, rng, m, n, k, accumulate, c1, c_size);
        if (model) {
            tu_rng again = start;
            check_gemm(model, &again, m, n, k, accumulate, c2, c_size);
            compared++;
            differ += memcmp(c1, c2, sizeof *c1 * c_size) != 0;
        }
        free(c1);
        free(c2);
    }
    if (model)
        printf("test_bf16: %s against %s: %lld of %lld products bitwise equal\n", kern->name,
               model->name, (long long)(compared - differ), (long long)compared);
}

/* ---- packing ----------------------------------------------------------------------------- */

/* The backward's operands: pairs of rows, rows rounded, a block rounded and transposed. */
static void test_packing_bwd(tu_rng *rng)
{
    const int64_t n = tu_rng_int(rng, 1, 64), kp = (n + 31) / 32 * 32;
    const int64_t cols = tu_rng_int(rng, 1, 130), colsp = (cols + 15) / 16 * 16;
    const int64_t lds = cols + tu_rng_int(rng, 0, 7), ldd = colsp + 16 * tu_rng_int(rng, 0, 1);
    uint16_t *src = malloc(sizeof *src * (size_t)(n * lds));
    for (int64_t i = 0; i < n * lds; i++)
        src[i] = rand_bf16(rng, 3.0);
    uint32_t *pairs = malloc(sizeof *pairs * (size_t)(kp / 2 * ldd));
    fa_cpu_bf16_pack_pairs(pairs, ldd, src, lds, n, kp, cols, colsp);
    int64_t bad = 0;
    for (int64_t x = 0; x < kp / 2; x++)
        for (int64_t c = 0; c < colsp; c++) {
            const uint32_t lo = 2 * x < n && c < cols ? src[2 * x * lds + c] : 0;
            const uint32_t hi = 2 * x + 1 < n && c < cols ? src[(2 * x + 1) * lds + c] : 0;
            bad += pairs[x * ldd + c] != (lo | hi << 16);
        }
    TU_CHECK(bad == 0, "pack_pairs n=%lld cols=%lld: %lld wrong", (long long)n, (long long)cols,
             (long long)bad);

    /* fp32 [n][colsp] (lds2 apart) with values that round both ways and ties */
    const int64_t lds2 = colsp + 16;
    float *f = malloc(sizeof *f * (size_t)(n * lds2));
    for (int64_t i = 0; i < n * lds2; i++)
        f[i] = i % 5 == 0 ? fa_bf16_to_f32(rand_bf16(rng, 2.0)) * (1.0f + 0x1p-8f)
                          : (float)tu_rng_uniform(rng, -2, 2);
    const int64_t np = (n + 15) / 16 * 16, ldr = colsp + 32;
    uint16_t *rows = malloc(sizeof *rows * (size_t)(np * ldr));
    fa_cpu_bf16_round_rows(rows, ldr, f, lds2, n, np, colsp);
    bad = 0;
    for (int64_t j = 0; j < np; j++)
        for (int64_t i = 0; i < colsp; i++)
            bad += rows[j * ldr + i] != (j < n ? fa_f32_to_bf16(f[j * lds2 + i]) : 0);
    TU_CHECK(bad == 0, "round_rows n=%lld cols=%lld: %lld wrong", (long long)n,
             (long long)colsp, (long long)bad);
    uint16_t *t = malloc(sizeof *t * (size_t)(colsp * (kp + 32)));
    fa_cpu_bf16_round_t(t, kp + 32, f, lds2, n, kp, colsp);
    bad = 0;
    for (int64_t i = 0; i < colsp; i++)
        for (int64_t j = 0; j < kp; j++)
            bad += t[i * (kp + 32) + j] != (j < n ? fa_f32_to_bf16(f[j * lds2 + i]) : 0);
    TU_CHECK(bad == 0, "round_t n=%lld cols=%lld: %lld wrong", (long long)n, (long long)colsp,
             (long long)bad);
    free(src);
    free(pairs);
    free(f);
    free(rows);
    free(t);
}

/*
 * The softmax's exponentials into P^T pairs, over st [kp][mp] (rows from n on unread). Each
 * row again alone, into a zeroed sum, gives its fp32 exponentials e: within 1.2e-7 relative
 * of exp(x) in double, x being the fp32 fused s * emul - bmax, and 0 below e^-87.34 (the
 * last normal result) and for -inf.
 * pv must hold bf16(e) rounded to nearest even and 0 in rows n and up, and l its input plus
 * the e of each row in order, bitwise.
 */
static void test_exp_pack(tu_rng *rng, float *st, uint32_t *pv, int64_t n, int64_t kp, int64_t mp)
{
    const float emul = (float)tu_rng_uniform(rng, 0.05, 1.0);
    float *bmax = malloc(sizeof *bmax * (size_t)mp), *l = malloc(sizeof *l * (size_t)mp);
    float *want = malloc(sizeof *want * (size_t)mp), *e = malloc(sizeof *e * (size_t)mp);
    uint32_t *one = malloc(sizeof *one * (size_t)mp);
    tu_softmax_args(rng, st, mp, kp, mp, emul, bmax, l);
    for (int64_t i = 0; i < mp; i++)
        want[i] = l[i];
    memset(pv, 0xa5, sizeof *pv * (size_t)(kp / 2 * mp));
    fa_cpu_bf16_exp_pack(pv, mp, st, mp, n, kp, mp, emul, bmax, l);
    int64_t bad_e = 0, bad_p = 0, bad_l = 0;
    for (int64_t j = 0; j < kp; j++) {
        for (int64_t i = 0; i < mp; i++)
            e[i] = 0;
        if (j < n)
            fa_cpu_bf16_exp_pack(one, mp, st + j * mp, mp, 1, 2, mp, emul, bmax, e);
        for (int64_t i = 0; i < mp; i++) {
            const uint32_t pair = pv[j / 2 * mp + i];
            bad_p += (uint16_t)(j % 2 ? pair >> 16 : pair & 0xffff) != fa_f32_to_bf16(e[i]);
            if (j >= n)
                continue;
            want[i] += e[i];
            bad_e += !tu_exp_ok(e[i], st[j * mp + i], emul, bmax[i]);
        }
    }
    for (int64_t i = 0; i < mp; i++)
        bad_l += l[i] != want[i];
    TU_CHECK(bad_e + bad_p + bad_l == 0,
             "exp_pack n=%lld cols=%lld: %lld exponentials, %lld pairs, %lld sums wrong",
             (long long)n, (long long)mp, (long long)bad_e, (long long)bad_p, (long long)bad_l);

    /* The same against running maxima (bmax here): accepted, the same bits as exp_pack;
     * refused exactly when a column's maximum times emul passes bmax + slack. */
    for (int pass = 0; pass < 2; pass++) {
        const float slack = pass ? 6.0f : (float)tu_rng_uniform(rng, 0, 5);
        int over = 0;
        for (int64_t i = 0; i < mp; i++) {
            float top = -INFINITY;
            for (int64_t j = 0; j < n; j++)
                top = st[j * mp + i] > top ? st[j * mp + i] : top;
            over |= top * emul > bmax[i] + slack;
        }
        float *l0 = malloc(sizeof *l0 * (size_t)mp);
        for (int64_t i = 0; i < mp; i++)
            l0[i] = l[i];
        uint32_t *pu = malloc(sizeof *pu * (size_t)(kp / 2 * mp));
        memset(pu, 0x5a, sizeof *pu * (size_t)(kp / 2 * mp));
        const int took =
            fa_cpu_bf16_exp_pack_under(pu, mp, st, mp, n, kp, mp, emul, bmax, slack, l0, e);
        fa_cpu_bf16_exp_pack(pv, mp, st, mp, n, kp, mp, emul, bmax, l0);
        int64_t differ = 0;
        for (int64_t i = 0; took && i < mp; i++)
            differ += e[i] != l0[i];
        if (took)
            differ += memcmp(pu, pv, sizeof *pu * (size_t)(kp / 2 * mp)) != 0;
        TU_CHECK(took == !over && differ == 0,
                 "exp_pack_under n=%lld slack %g: took %d (a maximum over: %d), %lld differ",
                 (long long)n, (double)slack, took, over, (long long)differ);
        free(l0);
        free(pu);
    }
    free(bmax);
    free(l);
    free(want);
    free(e);
    free(one);
}

static void test_packing(tu_rng *rng)
{
    for (int it = 0; it < 40; it++) {
        const int64_t m = tu_rng_int(rng, 1, 64), mp = (m + 15) / 16 * 16;
        const int64_t d = tu_rng_int(rng, 1, 130), dk = (d + 31) / 32 * 32;
        const int64_t ldq = d + tu_rng_int(rng, 0, 7);
        uint16_t *q = malloc(sizeof *q * (size_t)(m * ldq));
        for (int64_t i = 0; i < m * ldq; i++)
            q[i] = rand_bf16(rng, 3.0);
        uint32_t *qv = malloc(sizeof *qv * (size_t)(dk / 2 * mp));
        fa_cpu_bf16_pack_q(qv, mp, q, ldq, m, mp, d, dk);
        int64_t bad = 0;
        for (int64_t x = 0; x < dk / 2; x++)
            for (int64_t i = 0; i < mp; i++) {
                const uint32_t lo = i < m && 2 * x < d ? q[i * ldq + 2 * x] : 0;
                const uint32_t hi = i < m && 2 * x + 1 < d ? q[i * ldq + 2 * x + 1] : 0;
                bad += qv[x * mp + i] != (lo | hi << 16);
            }
        TU_CHECK(bad == 0, "pack_q m=%lld d=%lld: %lld wrong", (long long)m, (long long)d,
                 (long long)bad);
        free(q);
        free(qv);

        /* V^T of a block of n keys, dv columns */
        const int64_t n = tu_rng_int(rng, 1, 64), kp = (n + 31) / 32 * 32;
        const int64_t dv = tu_rng_int(rng, 1, 130), dvp = (dv + 15) / 16 * 16;
        const int64_t ldv = dv + tu_rng_int(rng, 0, 7), ldvt = 64;
        uint16_t *v = malloc(sizeof *v * (size_t)(n * ldv));
        for (int64_t i = 0; i < n * ldv; i++)
            v[i] = rand_bf16(rng, 3.0);
        uint16_t *vt = malloc(sizeof *vt * (size_t)(dvp * ldvt));
        fa_cpu_bf16_pack_vt(vt, ldvt, v, ldv, n, kp, dv, dvp);
        bad = 0;
        for (int64_t c = 0; c < dvp; c++)
            for (int64_t j = 0; j < kp; j++)
                bad += vt[c * ldvt + j] != (c < dv && j < n ? v[j * ldv + c] : 0);
        TU_CHECK(bad == 0, "pack_vt n=%lld dv=%lld: %lld wrong", (long long)n, (long long)dv,
                 (long long)bad);
        free(v);
        free(vt);

        /* P^T rows to pairs, rounded to nearest even */
        float *st = malloc(sizeof *st * (size_t)(kp * mp));
        for (int64_t i = 0; i < kp * mp; i++)
            st[i] = (float)tu_rng_uniform(rng, 0, 1);
        uint32_t *pv = malloc(sizeof *pv * (size_t)(kp / 2 * mp));
        fa_cpu_bf16_pack_p(pv, mp, st, mp, n, kp, mp);
        bad = 0;
        for (int64_t x = 0; x < kp / 2; x++)
            for (int64_t i = 0; i < mp; i++) {
                const uint32_t lo = 2 * x < n ? fa_f32_to_bf16(st[2 * x * mp + i]) : 0;
                const uint32_t hi = 2 * x + 1 < n ? fa_f32_to_bf16(st[(2 * x + 1) * mp + i]) : 0;
                bad += pv[x * mp + i] != (lo | hi << 16);
            }
        TU_CHECK(bad == 0, "pack_p n=%lld cols=%lld: %lld wrong", (long long)n, (long long)mp,
                 (long long)bad);

        test_exp_pack(rng, st, pv, n, kp, mp);
        free(st);
        free(pv);
        test_packing_bwd(rng);
    }
}

/* ---- whole forward passes on the model of AMX -------------------------------------------- */

typedef struct fwd_case {
    int64_t b, sq, sk, h, hk, d, dv;
    int causal, wl, wr, alibi, sinks, layout;
    double softcap, dropout_p;
} fwd_case;

static void run_forward(const fwd_case *c, tu_rng *rng)
{
    char where[256];
    snprintf(where, sizeof where,
             "forward on the AMX model: b=%lld sq=%lld sk=%lld h=%lld hk=%lld d=%lld dv=%lld "
             "causal=%d window=(%d,%d) softcap=%g alibi=%d sinks=%d dropout=%g layout=%d",
             (long long)c->b, (long long)c->sq, (long long)c->sk, (long long)c->h,
             (long long)c->hk, (long long)c->d, (long long)c->dv, c->causal, c->wl, c->wr,
             c->softcap, c->alibi, c->sinks, c->dropout_p, c->layout);
    tu_where = where;
    const fa_dtype dt = FA_DTYPE_BF16;
    tu_tensor q = tu_tensor_new(dt, 4, (int64_t[]){c->b, c->sq, c->h, c->d}, c->layout, rng);
    tu_tensor k = tu_tensor_new(dt, 4, (int64_t[]){c->b, c->sk, c->hk, c->d}, c->layout, rng);
    tu_tensor v = tu_tensor_new(dt, 4, (int64_t[]){c->b, c->sk, c->hk, c->dv}, c->layout, rng);
    tu_tensor o = tu_tensor_new(dt, 4, (int64_t[]){c->b, c->sq, c->h, c->dv}, TU_CONTIGUOUS, rng);
    tu_tensor al = tu_tensor_new(FA_DTYPE_F32, 1, (int64_t[]){c->h}, TU_CONTIGUOUS, rng);
    tu_tensor sk = tu_tensor_new(FA_DTYPE_F32, 1, (int64_t[]){c->h}, TU_CONTIGUOUS, rng);
    tu_fill_uniform(&q, rng, -2, 2);
    tu_fill_uniform(&k, rng, -2, 2);
    tu_fill_uniform(&v, rng, -1, 1);
    tu_fill_uniform(&al, rng, 0.01, 0.3);
    tu_fill_uniform(&sk, rng, -1, 2);
    tu_poison(&o);

    fa_fwd_args args;
    fa_fwd_args_init(&args);
    args.q = &q.t;
    args.k = &k.t;
    args.v = &v.t;
    args.out = &o.t;
    args.causal = c->causal;
    args.window_left = c->wl;
    args.window_right = c->wr;
    args.softcap = c->softcap;
    args.alibi_slopes = c->alibi ? &al.t : NULL;
    args.sinks = c->sinks ? &sk.t : NULL;
    args.dropout_p = c->dropout_p;
    args.seed = 42;
    args.num_threads = 2;
    fa_status st = fa_attention_forward(&args);
    TU_CHECK(st == FA_STATUS_OK, "forward: %s", fa_last_error());

    const size_t nout = (size_t)(c->b * c->sq * c->h * c->dv);
    double *ref = malloc(sizeof *ref * (nout ? nout : 1));
    double *lowp = malloc(sizeof *lowp * (nout ? nout : 1));
    TU_CHECK(fa_ref_forward(&args, 1, ref, NULL) == 0, "fa_ref_forward failed");
    TU_CHECK(fa_ref_forward_lowp(&args, lowp) == 0, "fa_ref_forward_lowp failed");
    double maxref = 0, maxerr = 0, maxlowp = 0;
    int64_t ix[4] = {0, 0, 0, 0};
    size_t at = 0;
    do {
        const double ours = fa_ref_load(&o.t, ix), want = ref[at];
        maxref = fmax(maxref, fabs(want));
        maxerr = isnan(ours) ? INFINITY : fmax(maxerr, fabs(ours - want));
        maxlowp = fmax(maxlowp, fabs(lowp[at] - want));
        at++;
    } while (nout && tu_next_index(&o.t, ix));
    const double tol = 2 * maxlowp + ldexp(maxref, -8);
    TU_CHECK(maxerr <= tol, "out: max err %.3g > tol %.3g (max|lowp-ref| %.3g)", maxerr, tol,
             maxlowp);
    free(ref);
    free(lowp);
    tu_tensor_free(&q);
    tu_tensor_free(&k);
    tu_tensor_free(&v);
    tu_tensor_free(&o);
    tu_tensor_free(&al);
    tu_tensor_free(&sk);
}

static void test_forward_on_model(tu_rng *rng)
{
    static const int64_t dims[] = {32, 40, 64, 96, 128, 200};
    for (int i = 0; i < 24; i++) {
        fwd_case c = {0};
        c.b = tu_rng_int(rng, 1, 2);
        c.hk = tu_rng_int(rng, 1, 3);
        c.h = c.hk * tu_rng_int(rng, 1, 2);
        c.sq = tu_rng_int(rng, 1, 150);
        c.sk = tu_rng_int(rng, 1, 300);
        c.d = dims[i % 6];
        c.dv = i % 4 == 3 ? dims[(i + 2) % 6] : c.d;
        c.causal = i % 3 == 1;
        c.wl = c.wr = -1;
        if (i % 5 == 2) {
            c.wl = (int)tu_rng_int(rng, 0, 40);
            c.wr = (int)tu_rng_int(rng, -1, 10);
        }
        c.softcap = i % 7 == 3 ? 5.0 : 0;
        c.alibi = i % 4 == 1;
        c.sinks = i % 6 == 5;
        c.dropout_p = i % 5 == 4 ? 0.2 : 0;
        c.layout = (int)tu_rng_int(rng, 0, TU_NUM_LAYOUTS - 1);
        /* every other case packs K/V one kv head per pass */
        fa_cpu_forward_set_pack_limit(i % 2 ? 1 : 0);
        run_forward(&c, rng);
    }
    fa_cpu_forward_set_pack_limit(0);
}

int main(void)
{
    tu_rng rng = {tu_master_seed("test_bf16")};

    tu_where = "products on the AMX model";
    test_gemm(&k_amx_model, NULL, &rng, 60);

    /* A configuration the thread had (oneDNN's, say) is back after a work item's products. */
    tu_where = "AMX configuration of the caller";
    static const uint8_t theirs[64] = {1, [16] = 32, [48] = 8};
    emu_config(theirs);
    k_amx_model.begin();
    TU_CHECK(g_tmm[0].colsb == 64 && g_tmm[0].rows == 16, "begin did not configure the tiles");
    k_amx_model.end();
    TU_CHECK(g_configured && g_tmm[0].colsb == 32 && g_tmm[0].rows == 8,
             "end did not restore the previous configuration");
    emu_release();

    const fa_cpu_bf16_kernel *usable[2];
    const int n = fa_cpu_bf16_kernels(usable);
    if (n == 0) {
        /* the packing and the forward's bf16 tile need AVX512-BF16 */
        printf("test_bf16: no AVX512-BF16 on this CPU: the AMX model's products only\n");
        return tu_finish("test_bf16");
    }
    for (int i = 0; i < n; i++) {
        tu_where = usable[i]->name;
        test_gemm(usable[i], &k_amx_model, &rng, 60);
    }

    tu_where = "packing";
    test_packing(&rng);

    const fa_cpu_bf16_kernel *saved = fa_cpu_bf16_kernel_get();
    fa_cpu_bf16_kernel_override(&k_amx_model);
    test_forward_on_model(&rng);
    fa_cpu_bf16_kernel_override(saved);
    tu_where = "AMX model";
    TU_CHECK(g_emu_errors == 0,
             "%d tile operations without a configuration or with shapes that do not fit",
             g_emu_errors);
    return tu_finish("test_bf16");
}

#else
int main(void)
{
    printf("test_bf16: no bf16 kernels in this build (x86-64 only)\n");
    return 0;
}
#endif
