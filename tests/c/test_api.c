/*
 * test_api: the small helpers of the public API: version, status/dtype names and sizes,
 * fa_tensor_make, fa_fwd_args_init defaults, fa_probs_block_n (against upstream's sm80 kBlockN
 * table in the reference), CPU information, and fa_last_error() before any failure.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "fa_ref.h"
#include "flashattn.h"
#include "test_util.h"

static void test_version(void)
{
    tu_where = "fa_version";
    char want[64];
    snprintf(want, sizeof want, "%d.%d.%d", FA_VERSION_MAJOR, FA_VERSION_MINOR, FA_VERSION_PATCH);
    const char *v = fa_version();
    TU_CHECK(v != NULL && strncmp(v, want, strlen(want)) == 0, "fa_version() \"%s\", want \"%s\"",
             v ? v : "(null)", want);
}

static void test_names(void)
{
    tu_where = "fa_status_string";
    const char *seen[5];
    for (int s = 0; s <= FA_STATUS_INTERNAL; s++) {
        const char *n = fa_status_string((fa_status)s);
        TU_CHECK(n != NULL && n[0] != '\0', "status %d has no name", s);
        seen[s] = n ? n : "";
        for (int t = 0; t < s; t++) {
            TU_CHECK(strcmp(seen[t], seen[s]) != 0, "statuses %d and %d share the name \"%s\"", t,
                     s, seen[s]);
        }
    }

    tu_where = "fa_dtype_name / fa_dtype_size";
    const fa_dtype dts[5] = {FA_DTYPE_F32, FA_DTYPE_F16, FA_DTYPE_BF16, FA_DTYPE_F64,
                             FA_DTYPE_I32};
    const size_t sizes[5] = {4, 2, 2, 8, 4};
    const char *dseen[5];
    for (int i = 0; i < 5; i++) {
        const char *n = fa_dtype_name(dts[i]);
        TU_CHECK(n != NULL && n[0] != '\0', "dtype %d has no name", (int)dts[i]);
        dseen[i] = n ? n : "";
        for (int j = 0; j < i; j++) {
            TU_CHECK(strcmp(dseen[i], dseen[j]) != 0, "dtypes %d and %d share the name \"%s\"", i,
                     j, dseen[i]);
        }
        TU_CHECK(fa_dtype_size(dts[i]) == sizes[i], "fa_dtype_size(%s) = %zu, want %zu", dseen[i],
                 fa_dtype_size(dts[i]), sizes[i]);
    }
}

static void test_tensor_make(void)
{
    tu_where = "fa_tensor_make";
    float buf[4];
    int64_t shape[4] = {2, 3, 5, 7};
    fa_tensor t = fa_tensor_make(buf, FA_DTYPE_F16, 4, shape, NULL);
    TU_CHECK(t.data == buf && t.dtype == FA_DTYPE_F16 && t.ndim == 4, "fields not set");
    int64_t want[4] = {105, 35, 7, 1};
    for (int i = 0; i < 4; i++) {
        TU_CHECK(t.shape[i] == shape[i], "shape[%d] = %lld", i, (long long)t.shape[i]);
        TU_CHECK(t.stride[i] == want[i], "contiguous stride[%d] = %lld, want %lld", i,
                 (long long)t.stride[i], (long long)want[i]);
    }
    int64_t strides[4] = {1000, 300, 9, 1};
    t = fa_tensor_make(buf, FA_DTYPE_F32, 4, shape, strides);
    for (int i = 0; i < 4; i++) {
        TU_CHECK(t.stride[i] == strides[i], "given stride[%d] = %lld, want %lld", i,
                 (long long)t.stride[i], (long long)strides[i]);
    }
    int64_t s1[1] = {9};
    t = fa_tensor_make(buf, FA_DTYPE_I32, 1, s1, NULL);
    TU_CHECK(t.ndim == 1 && t.shape[0] == 9 && t.stride[0] == 1, "1-D tensor wrong");
}

static void test_args_init(void)
{
    tu_where = "fa_fwd_args_init";
    fa_fwd_args a;
    memset(&a, 0xab, sizeof a); /* garbage everywhere first */
    fa_fwd_args_init(&a);
    TU_CHECK(a.q == NULL && a.k == NULL && a.v == NULL && a.out == NULL, "q/k/v/out not NULL");
    TU_CHECK(a.lse == NULL && a.cu_seqlens_q == NULL && a.cu_seqlens_k == NULL &&
                 a.seqused_k == NULL && a.alibi_slopes == NULL && a.sinks == NULL &&
                 a.probs == NULL,
             "optional tensors not NULL");
    TU_CHECK(isnan(a.softmax_scale), "softmax_scale default %g, want NaN", a.softmax_scale);
    TU_CHECK(a.causal == 0, "causal %d", a.causal);
    TU_CHECK(a.window_left == -1 && a.window_right == -1, "window (%d, %d), want (-1, -1)",
             a.window_left, a.window_right);
    TU_CHECK(a.softcap <= 0.0, "softcap %g, want off", a.softcap);
    TU_CHECK(a.dropout_p == 0.0, "dropout_p %g", a.dropout_p);
    TU_CHECK(a.device == FA_DEVICE_CPU, "device %d", a.device);
    TU_CHECK(a.stream == NULL, "stream not NULL");
    TU_CHECK(a.num_threads == 0, "num_threads %d, want 0", a.num_threads);
    TU_CHECK(a.max_seqlen_q == 0 && a.max_seqlen_k == 0, "max_seqlen not 0");
    TU_CHECK(a.seed == 0 && a.offset == 0, "seed/offset not 0");
}

static void test_block_n(void)
{
    tu_where = "fa_probs_block_n";
    for (int d = 1; d <= FA_MAX_HEAD_DIM; d++) {
        for (int drop = 0; drop <= 1; drop++) {
            for (int causal = 0; causal <= 1; causal++) {
                int got = fa_probs_block_n(d, drop, causal);
                int want = fa_ref_probs_block_n(d, drop, causal);
                TU_CHECK(got == want, "d=%d dropout=%d causal=%d: %d, want %d", d, drop, causal,
                         got, want);
            }
        }
    }
}

static void test_cpu(void)
{
    tu_where = "cpu info";
    TU_CHECK(fa_cpu_default_threads() >= 1, "fa_cpu_default_threads() = %d",
             fa_cpu_default_threads());
    const char *desc = fa_cpu_description();
    TU_CHECK(desc != NULL && desc[0] != '\0', "empty CPU description");
    tu_where = "fa_last_error before any failure";
    const char *e = fa_last_error();
    TU_CHECK(e != NULL && e[0] == '\0', "fa_last_error() is \"%s\" before any call failed",
             e ? e : "(null)");
}

/* The oracle's own conversions: rounding against the compiler's double->float conversion, and
   fp16/bf16 encodings on values whose bits are known (ties to even, subnormals, overflow). */
static void test_ref_rounding(void)
{
    tu_where = "fa_ref_round / fa_ref_store (oracle self-check)";
    tu_rng r = {12345};
    for (int i = 0; i < 200000; i++) {
        double x = ldexp(tu_rng_uniform(&r, -1.0, 1.0), (int)tu_rng_int(&r, -160, 130));
        double want = (double)(float)x;
        double got = fa_ref_round(x, FA_DTYPE_F32);
        if (got != want) {
            TU_CHECK(0, "fp32 rounding of %.17g: %.17g, want %.17g", x, got, want);
            break;
        }
    }
    struct {
        double x;
        uint16_t f16, bf16;
    } cases[] = {
        {1.0, 0x3c00, 0x3f80},
        {-2.0, 0xc000, 0xc000},
        {65504.0, 0x7bff, 0x4780},                /* bf16 rounds up to 2^16 */
        {65520.0, 0x7c00, 0x4780},                /* f16 overflows (tie rounds up to 2^16) */
        {ldexp(1.0, -24), 0x0001, 0x3380},        /* smallest f16 subnormal */
        {ldexp(1.0, -25), 0x0000, 0x3300},        /* tie between 0 and 2^-24 -> even (0) */
        {3.0 * ldexp(1.0, -25), 0x0002, 0x33c0},  /* tie between 1 and 2 quanta -> 2 */
        {1.0 + ldexp(1.0, -11), 0x3c00, 0x3f80},  /* tie -> even */
        {1.0 + 3.0 * ldexp(1.0, -11), 0x3c02, 0x3f80},
        {1.0 + ldexp(1.0, -8), 0x3c04, 0x3f80},   /* bf16 tie -> even */
        {1.0 + 3.0 * ldexp(1.0, -8), 0x3c0c, 0x3f82},
        {ldexp(1.0, -14), 0x0400, 0x3880},        /* smallest f16 normal */
        {1e10, 0x7c00, 0x5015},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint16_t h = 0, bf = 0;
        int64_t sh[1] = {1}, idx[1] = {0};
        fa_tensor th = fa_tensor_make(&h, FA_DTYPE_F16, 1, sh, NULL);
        fa_tensor tb = fa_tensor_make(&bf, FA_DTYPE_BF16, 1, sh, NULL);
        fa_ref_store(&th, idx, cases[i].x);
        fa_ref_store(&tb, idx, cases[i].x);
        TU_CHECK(h == cases[i].f16, "f16 bits of %.17g: %04x, want %04x", cases[i].x, h,
                 cases[i].f16);
        TU_CHECK(bf == cases[i].bf16, "bf16 bits of %.17g: %04x, want %04x", cases[i].x, bf,
                 cases[i].bf16);
        double back = fa_ref_load(&th, idx);
        TU_CHECK(back == fa_ref_round(cases[i].x, FA_DTYPE_F16),
                 "f16 load(store(%.17g)) = %.17g, round = %.17g", cases[i].x, back,
                 fa_ref_round(cases[i].x, FA_DTYPE_F16));
        back = fa_ref_load(&tb, idx);
        TU_CHECK(back == fa_ref_round(cases[i].x, FA_DTYPE_BF16),
                 "bf16 load(store(%.17g)) = %.17g, round = %.17g", cases[i].x, back,
                 fa_ref_round(cases[i].x, FA_DTYPE_BF16));
    }
    /* every f16 bit pattern survives load -> store */
    for (uint32_t bits = 0; bits < 0x10000; bits++) {
        uint16_t h = (uint16_t)bits, h2 = 0;
        int64_t sh[1] = {1}, idx[1] = {0};
        fa_tensor t1 = fa_tensor_make(&h, FA_DTYPE_F16, 1, sh, NULL);
        fa_tensor t2 = fa_tensor_make(&h2, FA_DTYPE_F16, 1, sh, NULL);
        double v = fa_ref_load(&t1, idx);
        fa_ref_store(&t2, idx, v);
        if (isnan(v)) {
            continue;
        }
        if (h2 != h) {
            TU_CHECK(0, "f16 %04x -> %.17g -> %04x", h, v, h2);
            break;
        }
    }
}

/* fa_cuda_precompile refuses a feature set no call can use, before it looks for NVRTC. */
static void test_precompile_refusal(void)
{
    tu_where = "precompile dropout+softcap";
    int cached = 7;
    const fa_status st = fa_cuda_precompile(90, FA_DTYPE_BF16, 128, 128,
                                            FA_FEATURE_DROPOUT | FA_FEATURE_SOFTCAP, &cached);
    TU_CHECK(st == FA_STATUS_INVALID_ARGUMENT, "status %d: %s", (int)st, fa_last_error());
    TU_CHECK(strstr(fa_last_error(), "dropout") && strstr(fa_last_error(), "softcap"),
             "message \"%s\" does not name dropout and softcap", fa_last_error());
    TU_CHECK(cached == 7, "a refused call set *cached to %d", cached);
}

int main(void)
{
    (void)tu_master_seed("test_api");
    test_cpu(); /* first: no call has failed yet */
    test_version();
    test_names();
    test_tensor_make();
    test_args_init();
    test_block_n();
    test_ref_rounding();
    test_precompile_refusal();
    return tu_finish("test_api");
}
