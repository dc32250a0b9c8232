/*
 * The fp8 (e4m3) forward on sm_90 (kernels/fa_fwd_sm90_fp8.cu) against the CPU oracles of ref/fa_ref.h, judged as tests/c/test_fp8.c judges
 * the CPU's fp8 forward: upstream's criterion (hopper/test_flash_attn.py) - the error against
 * the exact attention at most twice that of the same-precision baseline plus twice out's
 * rounding - and every element near the oracle that rounds P as FA3 (2^8 exp(s - m) to e4m3).
 * Dense cases also run with V^T written to the workspace ahead of the kernel: its bytes are
 * checked, and out must keep its bits. Fresh random inputs per case, out and lse poisoned with
 * NaN before each call, the family that ran checked; shardable with FA_TEST_SHARD=i/n. Exits 77
 * without a GPU or on another arch.
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/fa_fp8.h"
#include "cuda/fa_cuda.h"
#include "fa_ref.h"
#include "gpu_test_util.h"

typedef struct f8case {
    const char *name;
    int b, sq, sk, h, hk, d;
    int causal, wl, wr;
    double softcap;
    int varlen, descales, pad;
    fa_dtype out_dt;
} f8case;

static int failures;

/*
 * The V^T the workspace must hold after a call (fa_fwd_vt): [b][hk][dv][sk16], byte l of row n
 * is column n of V at key 16 (l / 16) + 8 (e / 2) + 2 q + e % 2 (q = l / 4 % 4, e = l % 4), zero
 * where that key is at or past sk. Returns the mismatches (the first few printed).
 */
static int64_t vt_mismatches(const f8case *c, const gpu_buf *v, const unsigned char *ws)
{
    const fa_dtype dt = FA_DTYPE_F8E4M3;
    const int64_t sk16 = (c->sk + 15) / 16 * 16;
    const unsigned char *vh = v->host.data;
    int64_t bad = 0;
    for (int bi = 0; bi < c->b; bi++)
        for (int hk = 0; hk < c->hk; hk++)
            for (int n = 0; n < c->d; n++)
                for (int64_t l = 0; l < sk16; l++) {
                    const int64_t e = l % 4, q = l / 4 % 4;
                    const int64_t key = 16 * (l / 16) + 8 * (e / 2) + 2 * q + e % 2;
                    const unsigned want =
                        key < c->sk ? vh[bi * v->host.stride[0] + key * v->host.stride[1] +
                                         hk * v->host.stride[2] + n * v->host.stride[3]]
                                    : 0u;
                    const unsigned got = ws[((int64_t)(bi * c->hk + hk) * c->d + n) * sk16 + l];
                    if (got != want && bad++ < 3)
                        FAIL("V^T[b %d, hk %d, row %d, key %lld]: 0x%02x, want 0x%02x", bi, hk, n,
                             (long long)l, got, want);
                }
    return bad;
}

/* Element index (token, head, col) of a [b, s, h, x] or [total, h, x] buffer. */
static int64_t at3(const fa_tensor *t, int64_t tok, int64_t s, int varlen, int64_t hh, int64_t x)
{
    if (varlen)
        return tok * t->stride[0] + hh * t->stride[1] + x * t->stride[2];
    return (tok / s) * t->stride[0] + (tok % s) * t->stride[1] + hh * t->stride[2] +
           x * t->stride[3];
}

/* out and lse of one device run against the oracles: the exact attention (FA3's criterion:
 * error at most twice the same-precision baseline's plus twice out's rounding, and a bound on
 * each element), the oracle that rounds P as FA3 does, and lse. */
static void check_out(const f8case *c, const gpu_buf *o, const gpu_buf *lse, const void *got_o,
                      const float *got_l, int64_t total_q, const double *ref, const double *refp,
                      const double *lowp, const double *ref_lse, int vt)
{
    const fa_dtype dt = FA_DTYPE_F8E4M3;
    const double vmax = 3.0 * (c->descales ? 2.0 : 1.0); /* a bound on |v_descale v| */
    const double out_rel = c->out_dt == FA_DTYPE_BF16 ? 1.0 / 256 : 1.0 / 1024;
    const double bound_abs = vmax * (1.0 / 16 + (double)c->sk / 262144.0 + 1e-4);
    double err = 0, err_lowp = 0, atol = 0, worst = 0;
    int64_t bad = 0, at = 0;
    for (int64_t t = 0; t < total_q; t++)
        for (int hh = 0; hh < c->h; hh++)
            for (int x = 0; x < c->d; x++, at++) {
                const double g =
                    gu_elem_load(got_o, c->out_dt, at3(&o->host, t, c->sq, c->varlen, hh, x));
                const double want = ref[at], e = fabs(g - want);
                if (!(e <= bound_abs + out_rel * fabs(want)) && bad++ < 3)
                    FAIL("out[tok %lld, h %d, %d]: %.6g, exact %.6g", (long long)t, hh, x, g, want);
                err = e > err ? e : err;
                err_lowp = fabs(lowp[at] - want) > err_lowp ? fabs(lowp[at] - want) : err_lowp;
                const float w = (float)want;
                const double u = fabs((c->out_dt == FA_DTYPE_BF16
                                           ? fa_bf16_to_f32(fa_f32_to_bf16(w))
                                           : fa_f16_to_f32(fa_f32_to_f16(w))) -
                                      want);
                atol = u > atol ? u : atol;
                worst = fabs(g - refp[at]) > worst ? fabs(g - refp[at]) : worst;
            }
    if (!(err <= 2 * err_lowp + 2 * atol))
        FAIL("error %.4g > 2 x baseline's %.4g + 2 x %.3g", err, err_lowp, atol);
    if (!(worst <= bound_abs + out_rel * vmax))
        FAIL("against the P-rounding oracle: %.4g", worst);
    for (int64_t t = 0; t < total_q; t++)
        for (int hh = 0; hh < c->h; hh++) {
            const int64_t li = c->varlen ? hh * lse->host.stride[0] + t * lse->host.stride[1]
                                         : (t / c->sq) * lse->host.stride[0] +
                                               hh * lse->host.stride[1] +
                                               (t % c->sq) * lse->host.stride[2];
            const double g = got_l[li], want = ref_lse[t * c->h + hh];
            const int ok = isinf(want) ? g == want : fabs(g - want) <= 1e-3 * (1 + fabs(want));
            if (!ok && bad++ < 6)
                FAIL("lse[tok %lld, h %d]: %.7g, want %.7g", (long long)t, hh, g, want);
        }
    printf("%-28s%s err %.3g (baseline %.3g), vs P-rounding oracle %.3g\n", c->name,
           vt ? " V^T ws" : "", err, err_lowp, worst);
}

static void run_case(const f8case *c)
{
    const fa_dtype dt = FA_DTYPE_F8E4M3;
    if (!gu_shard_take(gu_attn_cost(c->b, c->h, c->sq, c->sk, c->d, c->d, c->causal)) ||
        !gu_only(c->name))
        return;
    int64_t total_q = (int64_t)c->b * c->sq, total_k = (int64_t)c->b * c->sk;
    const int64_t s1[1] = {c->b + 1};
    gpu_buf cq = gu_buf_new(FA_DTYPE_I32, 1, s1, 0), ck = gu_buf_new(FA_DTYPE_I32, 1, s1, 0);
    if (c->varlen) {
        int32_t *a = cq.host.data, *bk = ck.host.data;
        a[0] = (int32_t)gu_uniform(0, 3); /* rows before the first sequence stay uncovered */
        bk[0] = 0;
        for (int i = 0; i < c->b; i++) {
            a[i + 1] = a[i] + (int32_t)gu_uniform(0, c->sq + 1);
            bk[i + 1] = bk[i] + (int32_t)gu_uniform(0, c->sk + 1);
        }
        total_q = a[c->b] + 2;
        total_k = bk[c->b];
        gu_buf_upload(&cq);
        gu_buf_upload(&ck);
    }
    const int nd = c->varlen ? 3 : 4;
    int64_t shq[4] = {c->b, c->sq, c->h, c->d}, shk[4] = {c->b, c->sk, c->hk, c->d};
    int64_t sho[4] = {c->b, c->sq, c->h, c->d}, shl[3] = {c->b, c->h, c->sq};
    if (c->varlen) {
        const int64_t q3[3] = {total_q, c->h, c->d}, k3[3] = {total_k, c->hk, c->d};
        memcpy(shq, q3, sizeof q3), memcpy(shk, k3, sizeof k3), memcpy(sho, q3, sizeof q3);
        shl[0] = c->h, shl[1] = total_q;
    }
    gpu_buf q = gu_buf_new(dt, nd, shq, c->pad), k = gu_buf_new(dt, nd, shk, c->pad);
    gpu_buf v = gu_buf_new(dt, nd, shk, c->pad), o = gu_buf_new(c->out_dt, nd, sho, 0);
    gpu_buf lse = gu_buf_new(FA_DTYPE_F32, nd - 1, shl, 0);
    gu_fill_uniform(&q, -2.5, 2.5);
    gu_fill_uniform(&k, -2.5, 2.5);
    gu_fill_uniform(&v, -3.0, 3.0);
    const int64_t shd[2] = {c->b, c->hk};
    gpu_buf dsc[3];
    for (int i = 0; i < 3; i++) {
        dsc[i] = gu_buf_new(FA_DTYPE_F32, 2, shd, 0);
        gu_fill_uniform(&dsc[i], 0.05, 2.0); /* FA3's tests draw U(0, 2) */
        gu_buf_upload(&dsc[i]);
    }
    gu_buf_upload(&q), gu_buf_upload(&k), gu_buf_upload(&v);
    gu_buf_poison_device(&o), gu_buf_poison_device(&lse);

    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.causal = c->causal, a.window_left = c->wl, a.window_right = c->wr;
    a.softcap = c->softcap;
    if (c->varlen)
        a.max_seqlen_q = c->sq, a.max_seqlen_k = c->sk;
    fa_fwd_args host = a, dev = a;
    host.q = &q.host, host.k = &k.host, host.v = &v.host, host.out = &o.host, host.lse = &lse.host;
    dev.q = &q.dev, dev.k = &k.dev, dev.v = &v.dev, dev.out = &o.dev, dev.lse = &lse.dev;
    if (c->varlen) {
        host.cu_seqlens_q = &cq.host, host.cu_seqlens_k = &ck.host;
        dev.cu_seqlens_q = &cq.dev, dev.cu_seqlens_k = &ck.dev;
    }
    if (c->descales) {
        host.q_descale = &dsc[0].host, host.k_descale = &dsc[1].host;
        host.v_descale = &dsc[2].host;
        dev.q_descale = &dsc[0].dev, dev.k_descale = &dsc[1].dev, dev.v_descale = &dsc[2].dev;
    }
    host.device = FA_DEVICE_CPU;
    dev.device = 0;
    const int64_t n_out = total_q * c->h * c->d;
    double *ref = malloc(sizeof(double) * (size_t)(n_out + 1));
    double *refp = malloc(sizeof(double) * (size_t)(n_out + 1));
    double *lowp = malloc(sizeof(double) * (size_t)(n_out + 1));
    double *ref_lse = malloc(sizeof(double) * (size_t)(total_q * c->h + 1));
    if (fa_ref_forward(&host, 1, ref, ref_lse) != 0 || fa_ref_forward_fp8(&host, refp, NULL) != 0 ||
        fa_ref_forward_lowp(&host, lowp) != 0)
        FAIL("an oracle refused the case");
    /* Dense calls of 128 keys or more run three times: V transposed in the kernel, then into the
     * workspace ahead of it (FLASHATTN_SM90_FP8_VT=1; poisoned first, so every byte of V^T the
     * kernel reads must have been written), both in 128-key blocks (FLASHATTN_SM90_FP8_TILE),
     * which gives the same shared-memory operands and so the same bits; then V^T from the
     * workspace in the plan's own key block for it. A tile the caller set holds for all three. */
    const int ways = !c->varlen && c->sk >= 128 ? 3 : 1;
    const int own_tile = getenv("FLASHATTN_SM90_FP8_TILE") != NULL;
    const int64_t sk16 = (c->sk + 15) / 16 * 16;
    void *first_o = NULL;
    for (int way = 0; way < ways; way++) {
        const int vt = way > 0, pinned = ways == 3 && way < 2 && !own_tile;
        setenv("FLASHATTN_SM90_FP8_VT", vt ? "1" : "0", 1);
        if (pinned)
            setenv("FLASHATTN_SM90_FP8_TILE", "128,2,1", 1);
        const size_t ws_size = fa_attention_forward_workspace_size(&dev);
        const size_t ws_want = vt ? ((size_t)(c->b * c->hk * c->d * sk16) + 255) / 256 * 256 : 0;
        if (ws_size != ws_want)
            FAIL("workspace %zu bytes, want %zu", ws_size, ws_want);
        const int64_t shw[1] = {ws_want ? (int64_t)ws_want / 4 : 1};
        gpu_buf ws = gu_buf_new(FA_DTYPE_I32, 1, shw, 0);
        gu_buf_poison_device(&ws);
        gu_buf_poison_device(&o), gu_buf_poison_device(&lse);
        dev.workspace = ws_want ? ws.dev.data : NULL, dev.workspace_size = ws_want;
        const fa_status st = fa_attention_forward(&dev);
        unsetenv("FLASHATTN_SM90_FP8_VT");
        if (pinned)
            unsetenv("FLASHATTN_SM90_FP8_TILE");
        if (st != FA_STATUS_OK) {
            FAIL("forward%s: %s", vt ? " (V^T in the workspace)" : "", fa_last_error());
        } else if (strcmp(fa_cuda_last_family(), "fa_fwd_sm90_fp8.cu") != 0) {
            FAIL("ran on %s, not the fp8 kernel", fa_cuda_last_family());
        } else {
            CHECK_CU(gu_drv->ctx_synchronize());
            if (vt) {
                unsigned char *w = gu_buf_download(&ws);
                vt_mismatches(c, &v, w);
                free(w);
            }
            void *got_o = gu_buf_download(&o), *got_l = gu_buf_download(&lse);
            check_out(c, &o, &lse, got_o, got_l, total_q, ref, refp, lowp, ref_lse, vt);
            if (way == 0)
                first_o = got_o;
            else if (way == 1 && first_o && memcmp(first_o, got_o, o.bytes) != 0)
                FAIL("out with V^T from the workspace differs from the in-kernel transpose's");
            if (way > 0)
                free(got_o);
            free(got_l);
        }
        gu_buf_free(&ws);
    }
    free(first_o), free(ref), free(refp), free(lowp), free(ref_lse);
    gpu_buf *all[] = {&q, &k, &v, &o, &lse, &cq, &ck, &dsc[0], &dsc[1], &dsc[2]};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        gu_buf_free(all[i]);
}

/* Refusals on the device, naming the argument (e5m2: q; sinks). */
static void check_refusals(void)
{
    const f8case cc = {"refusals", 0, 0, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 0, FA_DTYPE_BF16};
    const f8case *c = &cc;
    const fa_dtype dt = FA_DTYPE_F8E5M2;
    const int64_t sh[4] = {1, 64, 2, 64}, ss[1] = {2};
    gpu_buf q = gu_buf_new(dt, 4, sh, 0), o = gu_buf_new(FA_DTYPE_BF16, 4, sh, 0);
    gpu_buf sk = gu_buf_new(FA_DTYPE_F32, 1, ss, 0);
    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.q = a.k = a.v = &q.dev, a.out = &o.dev, a.device = 0;
    if (fa_attention_forward(&a) != FA_STATUS_UNSUPPORTED || strncmp(fa_last_error(), "q:", 2))
        FAIL("e5m2: %s", fa_last_error());
    q.dev.dtype = FA_DTYPE_F8E4M3;
    a.sinks = &sk.dev;
    if (fa_attention_forward(&a) != FA_STATUS_UNSUPPORTED || strncmp(fa_last_error(), "sinks:", 6))
        FAIL("sinks: %s", fa_last_error());
    gu_buf_free(&q), gu_buf_free(&o), gu_buf_free(&sk);
}

int main(void)
{
    const int start = gu_start("test_gpu_fp8", 0x5eed0f8f8ull);
    if (start != 0)
        return start;
    int arch = 0, smem = 0;
    if (fa_cuda_device_arch(0, &arch, &smem) != FA_STATUS_OK || arch != 90) {
        printf("test_gpu_fp8: skipped (the fp8 kernel needs sm_90, device is %d)\n", arch);
        return 77;
    }
    static const f8case cases[] = {
        /* name                b  sq   sk    h  hk  d   causal wl  wr  softcap vl ds pad out */
        {"d64", 2, 256, 256, 4, 4, 64, 0, -1, -1, 0, 0, 1, 0, FA_DTYPE_BF16},
        {"d128", 2, 300, 333, 4, 2, 128, 0, -1, -1, 0, 0, 1, 0, FA_DTYPE_BF16},
        {"d256", 1, 200, 400, 4, 1, 256, 0, -1, -1, 0, 0, 1, 0, FA_DTYPE_BF16},
        {"d128 causal", 2, 513, 513, 4, 4, 128, 1, -1, 0, 0, 0, 1, 0, FA_DTYPE_BF16},
        {"d64 causal sq<sk", 1, 100, 700, 2, 1, 64, 1, -1, 0, 0, 0, 0, 0, FA_DTYPE_F16},
        {"d256 causal", 1, 384, 384, 2, 2, 256, 1, -1, 0, 0, 0, 1, 0, FA_DTYPE_F16},
        {"d128 window", 2, 600, 600, 2, 1, 128, 0, 100, 37, 0, 0, 1, 0, FA_DTYPE_BF16},
        {"d128 softcap", 1, 256, 512, 4, 4, 128, 0, -1, -1, 30.0, 0, 1, 0, FA_DTYPE_BF16},
        {"d256 softcap causal", 1, 300, 300, 2, 1, 256, 1, -1, 0, 15.0, 0, 1, 0, FA_DTYPE_BF16},
        {"d80 padded", 1, 200, 200, 2, 2, 80, 0, -1, -1, 0, 0, 1, 0, FA_DTYPE_BF16},
        {"d32 padded", 2, 150, 260, 4, 2, 32, 1, -1, 0, 0, 0, 1, 0, FA_DTYPE_BF16},
        {"d192 padded", 1, 260, 260, 2, 1, 192, 0, -1, -1, 0, 0, 1, 0, FA_DTYPE_F16},
        {"d128 row pad", 2, 130, 250, 2, 2, 128, 0, -1, -1, 0, 0, 1, 16, FA_DTYPE_BF16},
        {"varlen d64", 4, 300, 300, 4, 2, 64, 0, -1, -1, 0, 1, 1, 0, FA_DTYPE_BF16},
        {"varlen d128 causal", 5, 400, 400, 4, 4, 128, 1, -1, 0, 0, 1, 1, 0, FA_DTYPE_BF16},
        {"varlen d256 softcap", 3, 300, 300, 2, 1, 256, 1, -1, 0, 20.0, 1, 1, 0, FA_DTYPE_F16},
        /* Long enough for the stages to wrap many times; its CPU oracles take the time. */
        {"d128 long", 1, 1536, 1536, 2, 1, 128, 1, -1, 0, 0, 0, 1, 0, FA_DTYPE_BF16},
    };
    check_refusals();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i]);
    /* Every second exponential off the MUFU pipe (fa_rule_exp2_poly), an A/B of the plan. */
    static const f8case poly[] = {
        {"exp2 poly d128", 2, 300, 333, 4, 2, 128, 0, -1, -1, 0, 0, 1, 0, FA_DTYPE_BF16},
        {"exp2 poly d256 causal", 1, 384, 384, 2, 2, 256, 1, -1, 0, 0, 0, 1, 0, FA_DTYPE_F16},
        {"exp2 poly d64 window", 2, 300, 300, 2, 1, 64, 0, 60, 20, 0, 0, 1, 0, FA_DTYPE_BF16},
    };
    setenv("FLASHATTN_SM90_FP8_TILE", "128,2,1,1,1,2", 1);
    for (size_t i = 0; i < sizeof poly / sizeof poly[0]; i++)
        run_case(&poly[i]);
    unsetenv("FLASHATTN_SM90_FP8_TILE");
    printf("test_gpu_fp8: %d failure(s)\n", failures);
    return failures ? 1 : 0;
}
