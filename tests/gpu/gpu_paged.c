/*
 * Paged K/V in the varlen forward (fa_fwd_args.block_table) on the GPU, against the oracle and
 * the CPU backend on the same inputs. Each case builds a shuffled paged cache (two blocks no
 * sequence uses, a block_table column past every sequence holding an id outside the cache) and
 * the same keys in the dense varlen layout; then
 *   out:  max|gpu - ref| <= 2 * max|naive same-dtype - ref| + floor (the oracle on the dense
 *         layout; test_gpu_forward.c's criterion), every element written, lse within 2e-3;
 *   the CPU backend's paged call within the same bound, and its dense varlen call bitwise equal
 *   to its paged one (the same arithmetic, only the rows' addresses differ);
 *   the GPU's paged call bitwise equal to its dense varlen call where both run on one family
 *   (few rows: the decode kernels; many rows: the sm80 family; on sm_90 the dense call may take
 *   the sm90 family, the paged one never does).
 * Page sizes 1, 3, 16 and 256; few rows (the decode schedule) and many; causal, windows, GQA,
 * seqused_k, unaligned head dims. A last case gives block ids outside the cache and a sequence
 * longer than its block_table row (the CPU refuses it; the GPU clamps, the other sequences keep
 * their answer and nothing faults).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/fa_cuda.h"
#include "fa_ref.h"
#include "gpu_paged.h"
#include "gpu_test_util.h"

typedef struct paged_case {
    const char *name;
    int b, h, hk, sq, sk, d, page;
    int causal, wl, wr, seqused;
} paged_case;

static const paged_case paged_cases[] = {
    {"paged p1 many rows causal gqa", 3, 8, 2, 150, 300, 128, 1, 1, -1, -1, 0},
    {"paged p3 many rows window", 2, 4, 4, 200, 260, 64, 3, 0, 40, 10, 1},
    {"paged p16 many rows causal mqa", 3, 6, 1, 130, 400, 128, 16, 1, -1, -1, 0},
    {"paged p256 many rows d256", 2, 2, 2, 100, 700, 256, 256, 0, -1, -1, 0},
    {"paged p16 many rows unaligned d40", 2, 4, 2, 90, 200, 40, 16, 1, -1, -1, 0},
    {"paged p1 few rows gqa4", 4, 16, 4, 1, 900, 128, 1, 0, -1, -1, 0},
    {"paged p3 few rows causal seqused", 3, 8, 2, 7, 500, 128, 3, 1, -1, -1, 1},
    {"paged p16 few rows window gqa", 3, 8, 2, 16, 1200, 64, 16, 0, 200, 0, 0},
    {"paged p256 few rows causal", 2, 4, 1, 5, 1500, 128, 256, 1, -1, -1, 0},
};

static int paged_failures;

#define PAGED_FAIL(...)                                                                          \
    do {                                                                                         \
        fprintf(stderr, "FAIL [%s %s] ", c->name, fa_dtype_name(dt));                            \
        fprintf(stderr, __VA_ARGS__);                                                            \
        fputc('\n', stderr);                                                                     \
        paged_failures++;                                                                        \
    } while (0)

/* max |x - ref| over rows [0, total_q) of out (x in dtype dt, ref double), unwritten (NaN)
 * elements counted apart; and the lse values off. */
static void paged_compare(const void *x, const float *lse, fa_dtype dt, const paged_case *c,
                          int64_t total_q, const double *ref, const double *ref_lse, double *err,
                          int64_t *unwritten, int64_t *lse_bad)
{
    *err = 0, *unwritten = 0, *lse_bad = 0;
    for (int64_t t = 0; t < total_q; t++)
        for (int hh = 0; hh < c->h; hh++) {
            for (int col = 0; col < c->d; col++) {
                const int64_t at = (t * c->h + hh) * c->d + col;
                const double g = gu_elem_load(x, dt, at);
                if (isnan(g))
                    ++*unwritten;
                else
                    *err = fmax(*err, fabs(g - ref[at]));
            }
            const double gl = lse[hh * total_q + t], rl = ref_lse[t * c->h + hh];
            if (isinf(rl) ? gl != rl : !(fabs(gl - rl) <= 2e-3 * fmax(1.0, fabs(rl))))
                ++*lse_bad;
        }
}

/* bad: block ids outside the cache in sequence 0's row, sequence 2 longer than its row. */
static void paged_run(const paged_case *c, fa_dtype dt, int bad)
{
    int32_t cu_q[9], cu_k[9], used[8];
    int lens[8], pages[8], max_pages = 0;
    int64_t max_q = 1, max_k = 1;
    cu_q[0] = 0;
    cu_k[0] = 0;
    for (int i = 0; i < c->b; i++) {
        const int lq = i == 1 && c->b > 2 && !bad ? 0 : (int)gu_uniform(1, c->sq + 1);
        lens[i] = (int)gu_uniform(1, c->sk + 1);
        cu_q[i + 1] = cu_q[i] + lq;
        cu_k[i + 1] = cu_k[i] + lens[i];
        used[i] = c->seqused ? (int)gu_uniform(0, lens[i] + 1) : lens[i];
        pages[i] = (lens[i] + c->page - 1) / c->page;
        max_pages = pages[i] > max_pages ? pages[i] : max_pages;
        max_q = lq > max_q ? lq : max_q;
        max_k = lens[i] > max_k ? lens[i] : max_k;
    }
    int nb = 2;
    for (int i = 0; i < c->b; i++)
        nb += pages[i];
    /* Blocks in a random order; one column past every sequence holds an id outside the cache. */
    const int cols = max_pages + 1;
    int *perm = malloc((size_t)nb * sizeof *perm);
    for (int i = 0; i < nb; i++)
        perm[i] = i;
    for (int i = nb - 1; i > 0; i--) {
        const int j = (int)gu_uniform(0, i + 1), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    const int64_t total_q = cu_q[c->b], total_k = cu_k[c->b];
    const int64_t q_shape[3] = {total_q, c->h, c->d}, o_shape[3] = {total_q, c->h, c->d};
    const int64_t kd_shape[3] = {total_k, c->hk, c->d};
    const int64_t kp_shape[4] = {nb, c->page, c->hk, c->d};
    const int64_t bt_shape[2] = {c->b, cols}, cu_shape[1] = {c->b + 1}, u_shape[1] = {c->b};
    const int64_t lse_shape[2] = {c->h, total_q};
    gpu_buf q = gu_buf_new(dt, 3, q_shape, 0), o = gu_buf_new(dt, 3, o_shape, 0);
    gpu_buf kd = gu_buf_new(dt, 3, kd_shape, 0), vd = gu_buf_new(dt, 3, kd_shape, 0);
    gpu_buf kp = gu_buf_new(dt, 4, kp_shape, 0), vp = gu_buf_new(dt, 4, kp_shape, 0);
    gpu_buf lse = gu_buf_new(FA_DTYPE_F32, 2, lse_shape, 0);
    gpu_buf bt = gu_buf_new(FA_DTYPE_I32, 2, bt_shape, 0);
    gpu_buf cq = gu_buf_new(FA_DTYPE_I32, 1, cu_shape, 0);
    gpu_buf ck = gu_buf_new(FA_DTYPE_I32, 1, cu_shape, 0);
    gpu_buf su = gu_buf_new(FA_DTYPE_I32, 1, u_shape, 0);
    gu_fill_uniform(&q, -1, 1);
    gu_fill_uniform(&kp, -1, 1);
    gu_fill_uniform(&vp, -1, 1);
    int32_t *table = bt.host.data;
    const size_t row_bytes = (size_t)c->hk * (size_t)c->d * fa_dtype_size(dt);
    for (int i = 0, next = 0; i < c->b; i++) {
        for (int p = 0; p < cols; p++)
            table[i * cols + p] = p < pages[i] ? perm[next++] : nb + 1000;
        for (int j = 0; j < lens[i]; j++) { /* the dense layout: the same keys, in order */
            const int64_t blk = table[i * cols + j / c->page], row = j % c->page;
            const size_t from = (size_t)(blk * c->page + row) * row_bytes;
            const size_t to = (size_t)(cu_k[i] + j) * row_bytes;
            memcpy((char *)kd.host.data + to, (char *)kp.host.data + from, row_bytes);
            memcpy((char *)vd.host.data + to, (char *)vp.host.data + from, row_bytes);
        }
    }
    memcpy(cq.host.data, cu_q, sizeof(int32_t) * (size_t)(c->b + 1));
    memcpy(ck.host.data, cu_k, sizeof(int32_t) * (size_t)(c->b + 1));
    memcpy(su.host.data, used, sizeof(int32_t) * (size_t)c->b);

    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.causal = c->causal;
    a.window_left = c->wl;
    a.window_right = c->wr;
    a.max_seqlen_q = max_q;
    a.max_seqlen_k = max_k;
    fa_fwd_args hd = a, hp, dd, dp;
    hd.q = &q.host, hd.k = &kd.host, hd.v = &vd.host, hd.out = &o.host, hd.lse = &lse.host;
    hd.cu_seqlens_q = &cq.host, hd.cu_seqlens_k = &ck.host;
    hd.seqused_k = c->seqused ? &su.host : NULL;
    hp = hd;
    hp.k = &kp.host, hp.v = &vp.host, hp.block_table = &bt.host;
    dd = a;
    dd.q = &q.dev, dd.k = &kd.dev, dd.v = &vd.dev, dd.out = &o.dev, dd.lse = &lse.dev;
    dd.cu_seqlens_q = &cq.dev, dd.cu_seqlens_k = &ck.dev;
    dd.seqused_k = c->seqused ? &su.dev : NULL;
    dd.device = 0;
    dp = dd;
    dp.k = &kp.dev, dp.v = &vp.dev, dp.block_table = &bt.dev;

    const size_t n_out = (size_t)total_q * (size_t)c->h * (size_t)c->d;
    double *ref = malloc(n_out * sizeof(double)), *naive = malloc(n_out * sizeof(double));
    double *ref_lse = malloc((size_t)total_q * (size_t)c->h * sizeof(double));
    if (fa_ref_forward(&hd, 1, ref, ref_lse) != 0 || fa_ref_forward_lowp(&hd, naive) != 0)
        PAGED_FAIL("oracle refused the case");
    double err_naive = 0;
    for (size_t i = 0; i < n_out; i++)
        err_naive = fmax(err_naive, fabs(naive[i] - ref[i]));
    const double bound = 2 * err_naive + (dt == FA_DTYPE_BF16 ? 4e-3 : 5e-4);

    /* The CPU: dense and paged bitwise equal, both within the bound. */
    void *cpu_dense = malloc(o.bytes);
    double err;
    int64_t unwritten, lse_bad;
    if (fa_attention_forward(&hd) != FA_STATUS_OK)
        PAGED_FAIL("CPU dense: %s", fa_last_error());
    memcpy(cpu_dense, o.host.data, o.bytes);
    memset(o.host.data, 0xff, o.bytes);
    if (bad) {
        table[0] = -3;             /* sequence 0: ids outside the cache, */
        table[cols - 1] = 1 << 30; /* at both ends of its row */
        for (int i = 3; i <= c->b; i++) /* sequence 2: more keys than its row holds */
            cu_k[i] += (cols + 2) * c->page;
        memcpy(ck.host.data, cu_k, sizeof(int32_t) * (size_t)(c->b + 1));
        /* max_seqlen_k covers it, so that the refusal is block_table's capacity, not this. */
        for (int i = 0; i < c->b; i++)
            if (cu_k[i + 1] - cu_k[i] > hp.max_seqlen_k)
                hp.max_seqlen_k = dp.max_seqlen_k = cu_k[i + 1] - cu_k[i];
        if (fa_attention_forward(&hp) != FA_STATUS_INVALID_ARGUMENT ||
            !strstr(fa_last_error(), "block_table"))
            PAGED_FAIL("CPU took bad indices: %s", fa_last_error());
    } else {
        if (fa_attention_forward(&hp) != FA_STATUS_OK)
            PAGED_FAIL("CPU paged: %s", fa_last_error());
        if (memcmp(o.host.data, cpu_dense, o.bytes) != 0)
            PAGED_FAIL("CPU paged differs from CPU dense varlen");
        paged_compare(o.host.data, lse.host.data, dt, c, total_q, ref, ref_lse, &err, &unwritten,
                      &lse_bad);
        if (unwritten || lse_bad || !(err <= bound))
            PAGED_FAIL("CPU paged: err %.3g (bound %.3g), %lld unwritten, %lld lse off", err,
                       bound, (long long)unwritten, (long long)lse_bad);
    }

    /* The GPU: dense first (its family and result), then paged, twice. */
    gpu_buf *inputs[] = {&q, &kd, &vd, &kp, &vp, &bt, &cq, &ck, &su};
    for (size_t i = 0; i < sizeof inputs / sizeof inputs[0]; i++)
        gu_buf_upload(inputs[i]);
    fa_cu_deviceptr ws = 0;
    size_t ws_size = fa_attention_forward_workspace_size(&dd);
    const size_t ws_paged = fa_attention_forward_workspace_size(&dp);
    ws_size = ws_paged > ws_size ? ws_paged : ws_size;
    if (ws_size) {
        CHECK_CU(gu_drv->mem_alloc(&ws, ws_size));
        dd.workspace = dp.workspace = (void *)(uintptr_t)ws;
        dd.workspace_size = dp.workspace_size = ws_size;
    }
    void *gpu_dense = NULL, *first = NULL;
    char dense_family[64] = "";
    gu_buf_poison_device(&o);
    if (!bad && fa_attention_forward(&dd) == FA_STATUS_OK) {
        CHECK_CU(gu_drv->ctx_synchronize());
        gpu_dense = gu_buf_download(&o);
        snprintf(dense_family, sizeof dense_family, "%s", fa_cuda_last_family());
    } else if (!bad) {
        PAGED_FAIL("GPU dense: %s", fa_last_error());
    }
    for (int run = 0; run < 2; run++) {
        gu_buf_poison_device(&o);
        gu_buf_poison_device(&lse);
        if (fa_attention_forward(&dp) != FA_STATUS_OK) {
            PAGED_FAIL("GPU paged: %s", fa_last_error());
            break;
        }
        CHECK_CU(gu_drv->ctx_synchronize());
        const char *want = max_q <= FA_DECODE_MAX_ROWS ? "fa_decode.cu" : "fa_fwd_sm80.cu";
        if (strcmp(fa_cuda_last_family(), want) != 0)
            PAGED_FAIL("ran on %s, expected %s", fa_cuda_last_family(), want);
        void *go = gu_buf_download(&o), *gl = gu_buf_download(&lse);
        if (run == 1) {
            if (memcmp(go, first, o.bytes) != 0)
                PAGED_FAIL("second run differs from the first (not bitwise reproducible)");
            free(go);
            free(gl);
            break;
        }
        first = go;
        if (bad) {
            /* Sequences 1 and 3.. keep their keys: their rows still match the oracle. */
            int64_t off = 0, seen = 0;
            for (int64_t t = cu_q[1]; t < cu_q[c->b]; t++)
                for (int x = 0; x < c->h * c->d && (t < cu_q[2] || t >= cu_q[3]); x++) {
                    const int64_t at = t * c->h * c->d + x;
                    const double g = gu_elem_load(go, dt, at);
                    off += !(fabs(g - ref[at]) <= bound);
                    seen++;
                }
            if (off || !seen)
                PAGED_FAIL("bad indices elsewhere changed the other sequences (%lld of %lld "
                           "values off)",
                           (long long)off, (long long)seen);
        } else {
            paged_compare(go, gl, dt, c, total_q, ref, ref_lse, &err, &unwritten, &lse_bad);
            if (unwritten)
                PAGED_FAIL("%lld output elements unwritten (still poison)", (long long)unwritten);
            if (!(err <= bound))
                PAGED_FAIL("max |gpu - ref| = %.3g > %.3g", err, bound);
            if (lse_bad)
                PAGED_FAIL("%lld lse values off", (long long)lse_bad);
            if (gpu_dense && strcmp(dense_family, fa_cuda_last_family()) == 0 &&
                memcmp(go, gpu_dense, o.bytes) != 0)
                PAGED_FAIL("GPU paged differs from GPU dense varlen on the same family (%s)",
                           dense_family);
            printf("%-36s %-5s max|gpu-ref| %.2e  bound %.2e  %s (dense: %s)\n", c->name,
                   fa_dtype_name(dt), err, bound, fa_cuda_last_family(), dense_family);
        }
        free(gl);
    }
    free(first);
    free(gpu_dense);
    free(cpu_dense);
    if (ws)
        CHECK_CU(gu_drv->mem_free(ws));
    free(ref);
    free(naive);
    free(ref_lse);
    free(perm);
    gpu_buf *all[] = {&q, &o, &kd, &vd, &kp, &vp, &lse, &bt, &cq, &ck, &su};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        gu_buf_free(all[i]);
}

int gpu_paged_checks(void)
{
    paged_failures = 0;
    const fa_dtype dts[2] = {FA_DTYPE_F16, FA_DTYPE_BF16};
    for (size_t i = 0; i < sizeof paged_cases / sizeof paged_cases[0]; i++)
        for (int t = 0; t < 2; t++) {
            const paged_case *c = &paged_cases[i];
            if (gu_shard_take(gu_attn_cost(c->b, c->h, c->sq, c->sk, c->d, c->d, c->causal)))
                paged_run(c, dts[t], 0);
        }
    /* Bad indices, few rows and many. */
    const paged_case bad[2] = {
        {"paged bad ids few rows", 4, 4, 2, 3, 300, 64, 16, 0, -1, -1, 0},
        {"paged bad ids many rows", 4, 4, 2, 100, 300, 64, 3, 1, -1, -1, 0},
    };
    for (int i = 0; i < 2; i++)
        if (gu_shard_take(gu_attn_cost(bad[i].b, bad[i].h, bad[i].sq, bad[i].sk, 64, 64, 0)))
            paged_run(&bad[i], FA_DTYPE_BF16, 1);
    return paged_failures;
}
