/*
 * The KV-cache call and the combine on a CUDA device against the CPU backend, on the same random
 * inputs and the same cache contents (the rows no sequence occupies NaN):
 *   out:    within a bf16/fp16 tolerance of the CPU's (the CPU computes in fp32)
 *   lse:    within 2e-3 of the CPU's, +inf exactly where the CPU has it
 *   caches: after the append equal to the CPU's (rotated keys within one rounding; fp8 caches:
 *           the same codes, rotated keys at most one code apart)
 *   every output element written, and a second run bitwise identical to the first.
 * Then bad indices (clamped in the kernel, never a fault), the paged capacity check and a
 * workspace smaller than the call asks for (fewer splits, the same results).
 * Exits 77 (skipped) when no CUDA device is usable.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/fa_cuda.h"
#include "cuda/fa_cuda_driver.h"
#include "gpu_test_util.h"

typedef struct kv_case {
    const char *name;
    int b, h, hk, sq, d, dv;
    int cap;     /* positions a sequence can hold */
    int page;    /* 0: contiguous cache */
    int s_new;   /* new keys appended */
    int rotary;  /* 0 none, 1 interleaved, 2 GPT-NeoX */
    int batch_idx, leftpad, empty;
    int causal, wl, wr;
    double softcap;
    int alibi, sinks;
    int splits; /* num_splits (0: the library's choice) */
    fa_dtype kv; /* fp8 caches: FA_DTYPE_F8E4M3 or F8E5M2 (0: q's dtype) */
    int descales; /* fp8: k_descale and v_descale given */
    int v_in_k;   /* v_cache and v the first dv columns of k_cache and k (MLA's one cache) */
} kv_case;

static const kv_case cases[] = {
    {"decode gqa4 contiguous", 3, 32, 8, 1, 128, 128, 1000, 0, 0, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0},
    {"decode paged16 split auto", 4, 8, 2, 1, 128, 128, 2048, 16, 1, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0},
    {"paged page1 append rotary", 2, 4, 2, 1, 64, 64, 300, 1, 1, 1, 0, 0, 0, 1, -1, -1, 0, 0, 0, 3, 0, 0, 0},
    {"paged page3 neox leftpad", 3, 6, 3, 4, 64, 64, 333, 3, 2, 2, 0, 1, 0, 1, -1, -1, 0, 0, 0, 5, 0, 0, 0},
    {"paged256 chunk16 causal", 2, 16, 2, 16, 128, 128, 1500, 256, 16, 1, 0, 0, 0, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0},
    {"batch_idx window softcap", 3, 4, 4, 2, 128, 128, 700, 0, 2, 0, 1, 0, 0, 0, 100, 0, 30, 0, 0, 7, 0, 0, 0},
    {"alibi sinks mqa d256", 2, 8, 1, 3, 256, 256, 900, 0, 0, 0, 0, 0, 0, 1, -1, -1, 0, 1, 1, 0, 0, 0, 0},
    {"empty sequences sinks", 3, 4, 2, 2, 64, 64, 200, 16, 0, 0, 0, 0, 1, 0, -1, -1, 0, 0, 1, 4, 0, 0, 0},
    {"splits 64 d192 dv128", 2, 4, 2, 1, 192, 128, 5000, 0, 0, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 64, 0, 0, 0},
    {"unaligned d36 paged7", 2, 6, 3, 3, 36, 36, 400, 7, 2, 1, 0, 0, 0, 1, -1, -1, 0, 0, 0, 2, 0, 0, 0},
    {"unsplit causal gqa8 d128", 2, 16, 2, 5, 128, 128, 3000, 32, 3, 2, 0, 0, 0, 1, -1, -1, 0, 0, 0, 1, 0, 0, 0},
    {"prefill 40 rows gqa8", 1, 16, 2, 40, 128, 128, 1200, 64, 40, 2, 0, 0, 0, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0},
    /* One split, no window or append: the first stages copied before cache_seqlens is read,
     * sequences shorter than them (their rows past the keys NaN in the cache) */
    {"early contiguous short", 5, 8, 2, 1, 128, 128, 150, 0, 0, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 1, 0, 0, 0},
    {"early contiguous d64 empty", 3, 4, 2, 2, 64, 64, 90, 0, 0, 0, 0, 0, 1, 1, -1, -1, 0, 0, 0, 1, 0, 0, 0},
    {"early paged16 short", 4, 8, 2, 1, 128, 128, 200, 16, 0, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 1, 0, 0, 0},
    {"early paged1 d64 causal alibi", 3, 6, 3, 3, 64, 64, 120, 1, 0, 0, 0, 0, 0, 1, -1, -1, 0, 1, 0, 1, 0, 0, 0},
    {"early rows paged append", 2, 4, 2, 1, 128, 128, 100, 16, 1, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 1, 0, 0, 0},
    /* Heads past 256 (MLA's d 576 / dv 512): v's columns in slices of 256, a CTA each */
    {"mla d576 dv512 mqa16", 2, 16, 1, 1, 576, 512, 700, 0, 0, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0},
    {"mla paged64 append causal", 2, 64, 1, 2, 576, 512, 900, 64, 2, 0, 0, 0, 0, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0},
    {"mla mqa128 page16 splits 7", 2, 128, 1, 1, 576, 512, 1500, 16, 0, 0, 0, 0, 1, 0, -1, -1, 0, 0, 0, 7, 0, 0, 0},
    /* v a view of the cache's first 512 columns (v_cache = kv_cache[..., :512]), read from K */
    {"mla v in k mqa32", 3, 32, 1, 1, 576, 512, 900, 0, 0, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 0, 0, 0, 1},
    {"mla v in k paged16 append", 2, 16, 1, 2, 576, 512, 700, 16, 2, 0, 0, 0, 0, 1, -1, -1, 0, 0, 0, 3, 0, 0, 1},
    {"wide d320 dv576 alibi sinks", 2, 4, 2, 1, 320, 576, 300, 0, 0, 0, 0, 0, 0, 0, -1, -1, 20, 1, 1, 3, 0, 0, 0},
    {"wide d576 dv64 window leftpad", 3, 4, 2, 3, 576, 64, 400, 0, 1, 0, 0, 1, 0, 1, 50, 0, 0, 0, 0, 0, 0, 0, 0},
    /* fp8 caches (e4m3, e5m2) with per-(sequence, kv head) descales */
    {"fp8 decode gqa4 contiguous", 3, 32, 8, 1, 128, 128, 1000, 0, 0, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 0,
     FA_DTYPE_F8E4M3, 1, 0},
    {"fp8 paged16 split auto", 4, 8, 2, 1, 128, 128, 2048, 16, 1, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 0,
     FA_DTYPE_F8E4M3, 1, 0},
    {"fp8 page1 append rotary", 2, 4, 2, 1, 64, 64, 300, 1, 1, 1, 0, 0, 0, 1, -1, -1, 0, 0, 0, 3,
     FA_DTYPE_F8E4M3, 1, 0},
    {"fp8 page3 neox leftpad e5m2", 3, 6, 3, 4, 64, 64, 333, 3, 2, 2, 0, 1, 0, 1, -1, -1, 0, 0, 0, 5,
     FA_DTYPE_F8E5M2, 1, 0},
    {"fp8 batch_idx softcap", 3, 4, 4, 2, 128, 128, 700, 0, 2, 0, 1, 0, 0, 0, 100, 0, 30, 0, 0, 7,
     FA_DTYPE_F8E4M3, 1, 0},
    {"fp8 alibi sinks mqa d256", 2, 8, 1, 3, 256, 256, 900, 0, 0, 0, 0, 0, 0, 1, -1, -1, 0, 1, 1, 0,
     FA_DTYPE_F8E5M2, 0, 0},
    {"fp8 splits 64 d192 dv128", 2, 4, 2, 1, 192, 128, 5000, 0, 0, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 64,
     FA_DTYPE_F8E4M3, 1, 0},
    {"fp8 unaligned d40 paged7", 2, 6, 3, 3, 40, 40, 400, 7, 2, 1, 0, 0, 0, 1, -1, -1, 0, 0, 0, 2,
     FA_DTYPE_F8E4M3, 1, 0},
    {"fp8 prefill 40 rows gqa8", 1, 16, 2, 40, 128, 128, 1200, 64, 40, 2, 0, 0, 0, 1, -1, -1, 0, 0, 0, 0,
     FA_DTYPE_F8E4M3, 1, 0},
};

static int failures;
/* The decode family each GPU call must have planned (NULL: not checked). */
static const char *expect_family;

static int randint(int lo, int hi) { return lo + (int)gu_uniform(0, hi - lo + 1 - 1e-9); }

/* Every element of two 16-bit buffers equal, or within one rounding where `loose` (rotated). */
static double max_rel_diff(const void *a, const void *b, fa_dtype dt, size_t n)
{
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        double x = gu_elem_load(a, dt, (int64_t)i), y = gu_elem_load(b, dt, (int64_t)i);
        if (isnan(x) && isnan(y))
            continue;
        worst = fmax(worst, fabs(x - y) / fmax(fabs(y), 1e-3));
    }
    return worst;
}

/* fp8 caches after the append: the same codes, or (rotated keys, loose) codes of one sign at
 * most one step apart (a rotation one fp32 rounding apart may round the other way). Returns the
 * number of elements that break it. */
static int64_t fp8_codes_differ(const uint8_t *a, const uint8_t *b, size_t n, int loose)
{
    int64_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        const int step = a[i] > b[i] ? a[i] - b[i] : b[i] - a[i];
        bad += step != 0 && !(loose && step == 1 && (a[i] & 0x80) == (b[i] & 0x80));
    }
    return bad;
}

/* Every cache row no sequence's keys [leftpad, seqlen + s_new) occupy (past the ends, before
 * leftpad, spare rows and blocks) set to NaN (0xff bytes, NaN in every cache dtype) in K and V:
 * no kernel may read one into a result (a key outside the sequence gets P = 0, and 0 times NaN
 * is NaN), the early stages' copies included (fa_decode zeroes what they bring past the keys). */
static void poison_unused_rows(const kv_case *c, gpu_buf *kc, gpu_buf *vc, const int32_t *sl,
                               const int32_t *lp, const int32_t *bx, const int32_t *btab,
                               int max_blocks, int cap, int nblocks, int rows_per)
{
    unsigned char *used = calloc((size_t)nblocks * (size_t)rows_per, 1);
    for (int i = 0; i < c->b; i++)
        for (int pos = lp[i]; pos < sl[i] + c->s_new && pos < cap; pos++) {
            const int blk = c->page ? btab[i * max_blocks + pos / c->page]
                                    : c->batch_idx ? bx[i] : i;
            used[(size_t)blk * (size_t)rows_per + (size_t)(c->page ? pos % c->page : pos)] = 1;
        }
    gpu_buf *caches[2] = {kc, vc};
    for (int w = 0; w < 2; w++) {
        const fa_tensor *t = &caches[w]->host;
        const size_t es = fa_dtype_size(t->dtype);
        for (int blk = 0; blk < nblocks; blk++)
            for (int row = 0; row < rows_per; row++)
                for (int kh = 0; used[(size_t)blk * (size_t)rows_per + (size_t)row] == 0 &&
                                 kh < c->hk;
                     kh++)
                    memset((char *)t->data + (size_t)(blk * t->stride[0] + row * t->stride[1] +
                                                      kh * t->stride[2]) * es,
                           0xff, (size_t)t->shape[3] * es);
    }
    free(used);
}

/* The caller's workspace: this fraction of what the call asks for (1: all of it). */
static size_t ws_divisor = 1;

static void run_case_on(const kv_case *c, fa_dtype dt)
{
    const int paged = c->page > 0;
    const int max_blocks = paged ? (c->cap + c->page - 1) / c->page : 0;
    const int cap = paged ? max_blocks * c->page : c->cap;
    const int b_cache = c->batch_idx ? c->b + 2 : c->b;
    const int nblocks = paged ? c->b * max_blocks + 3 : b_cache;
    const int rows_per = paged ? c->page : cap;
    int64_t qs[4] = {c->b, c->sq, c->h, c->d}, os[4] = {c->b, c->sq, c->h, c->dv};
    int64_t ks[4] = {nblocks, rows_per, c->hk, c->d}, vs[4] = {nblocks, rows_per, c->hk, c->dv};
    int64_t kn[4] = {c->b, c->s_new > 0 ? c->s_new : 1, c->hk, c->d};
    int64_t vn[4] = {c->b, c->s_new > 0 ? c->s_new : 1, c->hk, c->dv};
    int64_t ls[3] = {c->b, c->h, c->sq}, bsz[1] = {c->b}, hs[1] = {c->h};
    int64_t bts[2] = {c->b, max_blocks > 0 ? max_blocks : 1};
    const int rd = c->d >= 32 ? 32 : c->d / 2 * 2;
    int64_t ros[2] = {cap + c->sq + 2, rd / 2};
    gpu_buf q = gu_buf_new(dt, 4, qs, 0), o = gu_buf_new(dt, 4, os, 0);
    const fa_dtype kvt = c->kv ? c->kv : dt;
    gpu_buf kc = gu_buf_new(kvt, 4, ks, 0), vc = gu_buf_new(kvt, 4, vs, 0);
    int64_t dss[2] = {c->b, c->hk};
    gpu_buf kdesc = gu_buf_new(FA_DTYPE_F32, 2, dss, 0), vdesc = gu_buf_new(FA_DTYPE_F32, 2, dss, 0);
    gpu_buf knew = gu_buf_new(dt, 4, kn, 0), vnew = gu_buf_new(dt, 4, vn, 0);
    gpu_buf lse = gu_buf_new(FA_DTYPE_F32, 3, ls, 0);
    gpu_buf seqlens = gu_buf_new(FA_DTYPE_I32, 1, bsz, 0), bidx = gu_buf_new(FA_DTYPE_I32, 1, bsz, 0);
    gpu_buf lpad = gu_buf_new(FA_DTYPE_I32, 1, bsz, 0), bt = gu_buf_new(FA_DTYPE_I32, 2, bts, 0);
    gpu_buf al = gu_buf_new(FA_DTYPE_F32, 1, hs, 0), sk = gu_buf_new(FA_DTYPE_F32, 1, hs, 0);
    gpu_buf cs = gu_buf_new(dt, 2, ros, 0), sn = gu_buf_new(dt, 2, ros, 0);
    gu_fill_uniform(&q, -1, 1);
    if (c->kv) {
        /* fp8 codes of values in [-2, 2] (no NaN code); the new rows then divide by descales
         * in [0.2, 1.5]. */
        gpu_buf *caches[2] = {&kc, &vc};
        for (int w = 0; w < 2; w++)
            for (size_t i = 0; i < caches[w]->bytes; i++) {
                const float x = (float)gu_uniform(-2, 2);
                fa_fp8_from_f32(c->kv, &x, (uint8_t *)caches[w]->host.data + i, 1);
            }
        gu_fill_uniform(&kdesc, 0.2, 1.5);
        gu_fill_uniform(&vdesc, 0.2, 1.5);
    } else {
        gu_fill_uniform(&kc, -1, 1);
        gu_fill_uniform(&vc, -1, 1);
    }
    gu_fill_uniform(&knew, -1, 1);
    gu_fill_uniform(&vnew, -1, 1);
    gu_fill_uniform(&al, 0.01, 0.3);
    gu_fill_uniform(&sk, -1, 2);
    gu_fill_uniform(&cs, -1, 1);
    gu_fill_uniform(&sn, -1, 1);
    int32_t *sl = seqlens.host.data, *bx = bidx.host.data, *lp = lpad.host.data, *btab = bt.host.data;
    for (int i = 0; i < c->b; i++) {
        sl[i] = c->empty && i != 1 ? 0 : randint(c->sq, cap - c->s_new);
        bx[i] = (i * 7 + 1) % b_cache; /* distinct rows, not in order */
        lp[i] = c->leftpad ? randint(0, sl[i] / 2) : 0;
    }
    /* A random permutation of the blocks, so that no sequence's blocks are adjacent. */
    int *perm = malloc(sizeof(int) * (size_t)nblocks);
    for (int i = 0; i < nblocks; i++)
        perm[i] = i;
    for (int i = nblocks - 1; i > 0; i--) {
        int j = randint(0, i), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    for (int i = 0; i < (int)(bts[0] * bts[1]); i++)
        btab[i] = paged ? perm[i] : 0;
    free(perm);
    poison_unused_rows(c, &kc, &vc, sl, lp, bx, btab, max_blocks, cap, nblocks, rows_per);
    gpu_buf *inputs[] = {&q,       &kc,   &vc,   &knew, &vnew, &al,    &sk,
                         &cs,      &sn,   &seqlens, &bidx, &lpad, &bt, &kdesc, &vdesc};
    for (size_t i = 0; i < sizeof inputs / sizeof inputs[0]; i++)
        gu_buf_upload(inputs[i]);

    fa_kvcache_args a;
    fa_kvcache_args_init(&a);
    a.causal = c->causal;
    a.window_left = c->wl;
    a.window_right = c->wr;
    a.softcap = c->softcap;
    a.num_splits = c->splits;
    a.rotary_interleaved = c->rotary == 1;
    fa_kvcache_args host = a, dev = a;
    host.q = &q.host, dev.q = &q.dev;
    host.k_cache = &kc.host, dev.k_cache = &kc.dev;
    host.v_cache = &vc.host, dev.v_cache = &vc.dev;
    /* v_in_k: views of k_cache and k of dv columns (vc and vnew then unused) */
    fa_tensor vk_host = kc.host, vk_dev = kc.dev, vn_host = knew.host, vn_dev = knew.dev;
    vk_host.shape[3] = vk_dev.shape[3] = vn_host.shape[3] = vn_dev.shape[3] = c->dv;
    if (c->v_in_k)
        host.v_cache = &vk_host, dev.v_cache = &vk_dev;
    host.out = &o.host, dev.out = &o.dev;
    host.lse = &lse.host, dev.lse = &lse.dev;
    host.cache_seqlens = &seqlens.host, dev.cache_seqlens = &seqlens.dev;
    if (c->s_new > 0)
        host.k = &knew.host, dev.k = &knew.dev, host.v = &vnew.host, dev.v = &vnew.dev;
    if (c->s_new > 0 && c->v_in_k)
        host.v = &vn_host, dev.v = &vn_dev;
    if (c->rotary)
        host.rotary_cos = &cs.host, dev.rotary_cos = &cs.dev, host.rotary_sin = &sn.host,
        dev.rotary_sin = &sn.dev;
    if (c->batch_idx)
        host.cache_batch_idx = &bidx.host, dev.cache_batch_idx = &bidx.dev;
    if (c->leftpad)
        host.cache_leftpad = &lpad.host, dev.cache_leftpad = &lpad.dev;
    if (paged)
        host.block_table = &bt.host, dev.block_table = &bt.dev;
    if (c->alibi)
        host.alibi_slopes = &al.host, dev.alibi_slopes = &al.dev;
    if (c->sinks)
        host.sinks = &sk.host, dev.sinks = &sk.dev;
    if (c->descales)
        host.k_descale = &kdesc.host, dev.k_descale = &kdesc.dev, host.v_descale = &vdesc.host,
        dev.v_descale = &vdesc.dev;
    dev.device = 0;

    fa_cu_deviceptr ws = 0;
    size_t ws_size = fa_attention_kvcache_workspace_size(&dev);
    if (ws_size) {
        CHECK_CU(gu_drv->mem_alloc(&ws, ws_size));
        dev.workspace = (void *)(uintptr_t)ws, dev.workspace_size = ws_size / ws_divisor;
    } else if (c->splits > 16) {
        /* Up to 16 splits may merge inside a thread block cluster (sm_90) and need none. */
        FAIL("no workspace for num_splits %d: %s", c->splits, fa_last_error());
    }
    if (fa_attention_kvcache(&host) != FA_STATUS_OK)
        FAIL("CPU: %s", fa_last_error());

    void *first_out = NULL, *first_lse = NULL;
    for (int run = 0; run < 2; run++) {
        gu_buf_poison_device(&o);
        gu_buf_poison_device(&lse);
        if (fa_attention_kvcache(&dev) != FA_STATUS_OK) {
            FAIL("GPU: %s", fa_last_error());
            break;
        }
        CHECK_CU(gu_drv->ctx_synchronize());
        if (expect_family && strcmp(fa_cuda_decode_last_family(), expect_family) != 0)
            FAIL("ran %s, expected %s", fa_cuda_decode_last_family(), expect_family);
        void *go = gu_buf_download(&o), *gl = gu_buf_download(&lse);
        if (run == 1) {
            if (memcmp(go, first_out, o.bytes) || memcmp(gl, first_lse, lse.bytes))
                FAIL("second run differs from the first (not bitwise reproducible)");
            free(go);
            free(gl);
            break;
        }
        first_out = go, first_lse = gl;
    }
    if (first_out) {
        const double tol = dt == FA_DTYPE_BF16 ? 1.6e-2 : 3e-3;
        double err = 0, scale = 1e-3, lse_err = 0;
        int64_t unwritten = 0, lse_bad = 0;
        const size_t n_out = o.bytes / fa_dtype_size(dt);
        for (size_t i = 0; i < n_out; i++) {
            double g = gu_elem_load(first_out, dt, (int64_t)i);
            double r = gu_elem_load(o.host.data, dt, (int64_t)i);
            if (isnan(g)) {
                unwritten++;
                continue;
            }
            err = fmax(err, fabs(g - r));
            scale = fmax(scale, fabs(r));
        }
        for (int64_t i = 0; i < (int64_t)c->b * c->h * c->sq; i++) {
            double g = ((const float *)first_lse)[i], r = ((const float *)lse.host.data)[i];
            if (isinf(r) || isinf(g)) {
                lse_bad += g != r;
                continue;
            }
            lse_err = fmax(lse_err, fabs(g - r));
        }
        if (unwritten)
            FAIL("%lld output elements never written", (long long)unwritten);
        if (err > tol * scale)
            FAIL("out: max |gpu - cpu| %.3g over %.3g * %.3g", err, tol, scale);
        if (lse_bad || lse_err > 2e-3)
            FAIL("lse: max err %.3g, %lld infinities differ", lse_err, (long long)lse_bad);
        void *gk = gu_buf_download(&kc), *gv = gu_buf_download(&vc);
        if (c->kv) {
            const int64_t bk = fp8_codes_differ(gk, kc.host.data, kc.bytes, c->rotary != 0);
            const int64_t bv = fp8_codes_differ(gv, vc.host.data, vc.bytes, 0);
            if (bk || bv)
                FAIL("fp8 caches after the append differ from the CPU's: %lld k, %lld v codes",
                     (long long)bk, (long long)bv);
        } else {
            double dk = max_rel_diff(gk, kc.host.data, dt, kc.bytes / 2);
            double dv = max_rel_diff(gv, vc.host.data, dt, vc.bytes / 2);
            if (dv != 0 || dk > (c->rotary ? (dt == FA_DTYPE_BF16 ? 1.6e-2 : 2e-3) : 0))
                FAIL("caches after the append differ from the CPU's: k %.3g, v %.3g", dk, dv);
        }
        free(gk);
        free(gv);
        printf("ok  %-28s %s  out err %.2e (scale %.2f)  lse err %.2e  workspace %zu\n", c->name,
               fa_dtype_name(dt), err, scale, lse_err, ws_size);
    }
    free(first_out);
    free(first_lse);
    if (ws)
        CHECK_CU(gu_drv->mem_free(ws));
    gpu_buf *all[] = {&q,   &o,  &kc, &vc, &knew, &vnew, &lse,  &seqlens, &bidx,
                      &lpad, &bt, &al, &sk, &cs,   &sn,   &kdesc, &vdesc};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        gu_buf_free(all[i]);
}

/* Bad device indices: block ids and batch rows out of range, lengths past the capacity. With
 * the capacity check the paged call is refused naming block_table; without it, and for the
 * contiguous cache, the kernels clamp: the call completes and the context stays usable. */
static void run_bad_indices(void)
{
    const kv_case cc = {"bad indices", 2, 4, 2, 1, 64, 64, 256, 16, 1, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0};
    const kv_case *c = &cc;
    const fa_dtype dt = FA_DTYPE_BF16;
    int64_t qs[4] = {2, 1, 4, 64}, ks[4] = {40, 16, 2, 64}, kn[4] = {2, 1, 2, 64};
    int64_t bsz[1] = {2}, bts[2] = {2, 16};
    gpu_buf q = gu_buf_new(dt, 4, qs, 0), o = gu_buf_new(dt, 4, qs, 0);
    gpu_buf kc = gu_buf_new(dt, 4, ks, 0), vc = gu_buf_new(dt, 4, ks, 0);
    gpu_buf knew = gu_buf_new(dt, 4, kn, 0), vnew = gu_buf_new(dt, 4, kn, 0);
    gpu_buf sl = gu_buf_new(FA_DTYPE_I32, 1, bsz, 0), bt = gu_buf_new(FA_DTYPE_I32, 2, bts, 0);
    gu_fill_uniform(&q, -1, 1);
    gu_fill_uniform(&kc, -1, 1);
    gu_fill_uniform(&vc, -1, 1);
    gu_fill_uniform(&knew, -1, 1);
    gu_fill_uniform(&vnew, -1, 1);
    int32_t *s = sl.host.data, *t = bt.host.data;
    s[0] = 300, s[1] = -5; /* past the 256 positions; negative */
    for (int i = 0; i < 32; i++)
        t[i] = i % 3 == 0 ? -7 : i % 3 == 1 ? 1 << 30 : i;
    gpu_buf *in[] = {&q, &kc, &vc, &knew, &vnew, &sl, &bt};
    for (size_t i = 0; i < sizeof in / sizeof in[0]; i++)
        gu_buf_upload(in[i]);
    fa_kvcache_args a;
    fa_kvcache_args_init(&a);
    a.q = &q.dev, a.k_cache = &kc.dev, a.v_cache = &vc.dev, a.out = &o.dev;
    a.k = &knew.dev, a.v = &vnew.dev, a.cache_seqlens = &sl.dev, a.block_table = &bt.dev;
    a.device = 0;
    fa_status st = fa_attention_kvcache(&a);
    if (st == FA_STATUS_OK || !strstr(fa_last_error(), "block_table"))
        FAIL("paged capacity check: status %d, message \"%s\"", st, fa_last_error());
    /* Refused before anything is written: the caches hold what was uploaded. */
    for (int i = 0; i < 2; i++) {
        const gpu_buf *cache = i ? &vc : &kc;
        void *now = gu_buf_download(cache);
        if (memcmp(now, cache->host.data, (size_t)(40 * 16 * 2 * 64) * 2) != 0)
            FAIL("refused paged call wrote its %s cache", i ? "v" : "k");
        free(now);
    }
    /* Without new rows the call launches before its check ends, and is refused all the same. */
    a.k = a.v = NULL;
    st = fa_attention_kvcache(&a);
    if (st == FA_STATUS_OK || !strstr(fa_last_error(), "block_table"))
        FAIL("paged capacity check, no append: status %d, message \"%s\"", st, fa_last_error());
    if (gu_drv->ctx_synchronize() != 0)
        FAIL("refused paged read faulted the context");
    a.k = &knew.dev, a.v = &vnew.dev;
    a.skip_capacity_check = 1;
    if (fa_attention_kvcache(&a) != FA_STATUS_OK)
        FAIL("unchecked paged call refused: %s", fa_last_error());
    if (gu_drv->ctx_synchronize() != 0)
        FAIL("bad paged indices faulted the context");
    /* Contiguous, with cache rows out of range. */
    int64_t kcs[4] = {2, 256, 2, 64};
    gpu_buf kc2 = gu_buf_new(dt, 4, kcs, 0), vc2 = gu_buf_new(dt, 4, kcs, 0);
    gpu_buf bx = gu_buf_new(FA_DTYPE_I32, 1, bsz, 0);
    ((int32_t *)bx.host.data)[0] = 99, ((int32_t *)bx.host.data)[1] = -3;
    gu_fill_uniform(&kc2, -1, 1);
    gu_fill_uniform(&vc2, -1, 1);
    gu_buf_upload(&kc2);
    gu_buf_upload(&vc2);
    gu_buf_upload(&bx);
    a.k_cache = &kc2.dev, a.v_cache = &vc2.dev, a.block_table = NULL, a.cache_batch_idx = &bx.dev;
    a.skip_capacity_check = 0;
    if (fa_attention_kvcache(&a) != FA_STATUS_OK)
        FAIL("contiguous call with bad device indices refused: %s", fa_last_error());
    if (gu_drv->ctx_synchronize() != 0)
        FAIL("bad contiguous indices faulted the context");
    printf("ok  bad indices: refused with the check, clamped without it\n");
    gpu_buf *all[] = {&q, &o, &kc, &vc, &knew, &vnew, &sl, &bt, &kc2, &vc2, &bx};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        gu_buf_free(all[i]);
}

/* A rotated k that is a view of the very cache rows it fills (and v of v_cache's): each row
 * must be rotated once, as the CPU does, whatever CTAs of the device write it. Four splits, so
 * several CTAs of a kv head run the call. */
static void run_alias_rotary(fa_dtype dt)
{
    const kv_case cc = {"k a view of its rows", 2, 4, 2, 2, 64, 64, 300, 0, 3, 1, 0, 0, 0, 1, -1, -1, 0, 0, 0, 4, 0, 0, 0};
    const kv_case *c = &cc;
    const int len = 100, rd = 32;
    int64_t qs[4] = {2, 2, 4, 64}, ks[4] = {2, 300, 2, 64}, ls[3] = {2, 4, 2}, bsz[1] = {2};
    int64_t ros[2] = {len + 8, rd / 2}, news[4] = {2, 3, 2, 64};
    gpu_buf q = gu_buf_new(dt, 4, qs, 0), o = gu_buf_new(dt, 4, qs, 0);
    gpu_buf kc = gu_buf_new(dt, 4, ks, 0), vc = gu_buf_new(dt, 4, ks, 0);
    gpu_buf lse = gu_buf_new(FA_DTYPE_F32, 3, ls, 0), sl = gu_buf_new(FA_DTYPE_I32, 1, bsz, 0);
    gpu_buf cs = gu_buf_new(dt, 2, ros, 0), sn = gu_buf_new(dt, 2, ros, 0);
    gu_fill_uniform(&q, -1, 1);
    gu_fill_uniform(&kc, -1, 1);
    gu_fill_uniform(&vc, -1, 1);
    gu_fill_uniform(&cs, -1, 1);
    gu_fill_uniform(&sn, -1, 1);
    ((int32_t *)sl.host.data)[0] = ((int32_t *)sl.host.data)[1] = len;
    gpu_buf *in[] = {&q, &kc, &vc, &sl, &cs, &sn};
    for (size_t i = 0; i < sizeof in / sizeof in[0]; i++)
        gu_buf_upload(in[i]);
    /* k, v: rows [len, len + 3) of each cache row, in place. */
    const size_t at = (size_t)len * (size_t)kc.host.stride[1] * fa_dtype_size(dt);
    fa_tensor kh = fa_tensor_make((char *)kc.host.data + at, dt, 4, news, kc.host.stride);
    fa_tensor vh = fa_tensor_make((char *)vc.host.data + at, dt, 4, news, vc.host.stride);
    fa_tensor kd = fa_tensor_make((char *)kc.dev.data + at, dt, 4, news, kc.dev.stride);
    fa_tensor vd = fa_tensor_make((char *)vc.dev.data + at, dt, 4, news, vc.dev.stride);
    fa_kvcache_args a;
    fa_kvcache_args_init(&a);
    a.causal = 1;
    a.num_splits = c->splits;
    a.rotary_interleaved = 1;
    fa_kvcache_args host = a, dev = a;
    host.q = &q.host, host.k_cache = &kc.host, host.v_cache = &vc.host, host.out = &o.host;
    host.lse = &lse.host, host.cache_seqlens = &sl.host, host.k = &kh, host.v = &vh;
    host.rotary_cos = &cs.host, host.rotary_sin = &sn.host;
    dev.q = &q.dev, dev.k_cache = &kc.dev, dev.v_cache = &vc.dev, dev.out = &o.dev;
    dev.lse = &lse.dev, dev.cache_seqlens = &sl.dev, dev.k = &kd, dev.v = &vd;
    dev.rotary_cos = &cs.dev, dev.rotary_sin = &sn.dev;
    dev.device = 0;
    fa_cu_deviceptr ws = 0;
    const size_t ws_size = fa_attention_kvcache_workspace_size(&dev);
    if (ws_size) {
        CHECK_CU(gu_drv->mem_alloc(&ws, ws_size));
        dev.workspace = (void *)(uintptr_t)ws, dev.workspace_size = ws_size;
    }
    gu_buf_poison_device(&o);
    if (fa_attention_kvcache(&host) != FA_STATUS_OK)
        FAIL("CPU: %s", fa_last_error());
    if (fa_attention_kvcache(&dev) != FA_STATUS_OK)
        FAIL("GPU: %s", fa_last_error());
    CHECK_CU(gu_drv->ctx_synchronize());
    void *go = gu_buf_download(&o), *gk = gu_buf_download(&kc), *gv = gu_buf_download(&vc);
    const double tol = dt == FA_DTYPE_BF16 ? 1.6e-2 : 3e-3;
    double err = 0;
    for (int64_t i = 0; i < (int64_t)(o.bytes / fa_dtype_size(dt)); i++) {
        const double g = gu_elem_load(go, dt, i), r = gu_elem_load(o.host.data, dt, i);
        err = isnan(g) ? INFINITY : fmax(err, fabs(g - r));
    }
    const double dk = max_rel_diff(gk, kc.host.data, dt, kc.bytes / 2);
    const double dv = max_rel_diff(gv, vc.host.data, dt, vc.bytes / 2);
    if (err > tol * 2 || dk > tol || dv != 0)
        FAIL("out err %.3g, caches: k %.3g, v %.3g", err, dk, dv);
    else
        printf("ok  %-28s %s  out err %.2e\n", c->name, fa_dtype_name(dt), err);
    free(go);
    free(gk);
    free(gv);
    if (ws)
        CHECK_CU(gu_drv->mem_free(ws));
    gpu_buf *all[] = {&q, &o, &kc, &vc, &lse, &sl, &cs, &sn};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        gu_buf_free(all[i]);
}

/* fa_attention_combine on the device against the CPU's, with empty (+-inf) and NaN-free parts;
 * split counts that give a row's columns to one, two and four warps of the combine (kernels/
 * fa_dkparams.h: FA_COMBINE_PART_WARPS), dv below and above one warp's 128 columns. */
static void run_combine(fa_dtype dt, int splits, int dv)
{
    const kv_case cc = {"combine", 3, 5, 5, 4, 0, dv, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0};
    const kv_case *c = &cc;
    int64_t ops[5] = {splits, 3, 4, 5, dv}, lps[4] = {splits, 3, 4, 5}, os[4] = {3, 4, 5, dv};
    int64_t ls[3] = {3, 4, 5}, flat[4] = {splits * 3, 4, 5, dv};
    /* gpu_buf holds up to 4 dimensions: out_partial is a 5-D view of a 4-D buffer. */
    gpu_buf op = gu_buf_new(FA_DTYPE_F32, 4, flat, 0), lp = gu_buf_new(FA_DTYPE_F32, 4, lps, 0);
    op.host = fa_tensor_make(op.host.data, FA_DTYPE_F32, 5, ops, NULL);
    op.dev = fa_tensor_make(op.dev.data, FA_DTYPE_F32, 5, ops, NULL);
    gpu_buf o = gu_buf_new(dt, 4, os, 0), lse = gu_buf_new(FA_DTYPE_F32, 3, ls, 0);
    gu_fill_uniform(&op, -1, 1);
    gu_fill_uniform(&lp, -3, 3);
    float *l = lp.host.data;
    for (int i = 0; i < splits * 60; i += 7)
        l[i] = i % 2 ? INFINITY : -INFINITY;
    for (int s = 0; s < splits; s++)
        l[s * 60 + 13] = -INFINITY; /* a row with every part empty */
    gu_buf_upload(&op);
    gu_buf_upload(&lp);
    fa_combine_args a;
    fa_combine_args_init(&a);
    fa_combine_args host = a, dev = a;
    host.out_partial = &op.host, host.lse_partial = &lp.host, host.out = &o.host, host.lse = &lse.host;
    dev.out_partial = &op.dev, dev.lse_partial = &lp.dev, dev.out = &o.dev, dev.lse = &lse.dev;
    dev.device = 0;
    gu_buf_poison_device(&o);
    gu_buf_poison_device(&lse);
    if (fa_attention_combine(&host) != FA_STATUS_OK || fa_attention_combine(&dev) != FA_STATUS_OK)
        FAIL("combine refused: %s", fa_last_error());
    CHECK_CU(gu_drv->ctx_synchronize());
    void *go = gu_buf_download(&o), *gl = gu_buf_download(&lse);
    double err = max_rel_diff(go, o.host.data, dt, o.bytes / fa_dtype_size(dt)), lerr = 0;
    int inf_bad = 0;
    for (int i = 0; i < 60; i++) {
        double g = ((float *)gl)[i], r = ((float *)lse.host.data)[i];
        if (isinf(g) || isinf(r) || isnan(g) || isnan(r))
            inf_bad += !(g == r);
        else
            lerr = fmax(lerr, fabs(g - r));
    }
    if (err > (dt == FA_DTYPE_BF16 ? 8e-3 : 1e-3) || lerr > 1e-5 || inf_bad)
        FAIL("combine %d parts dv %d: out rel err %.3g, lse err %.3g, %d infinities differ",
             splits, dv, err, lerr, inf_bad);
    else
        printf("ok  combine %s %d parts dv %d: out rel err %.2e, lse err %.2e\n",
               fa_dtype_name(dt), splits, dv, err, lerr);
    free(go);
    free(gl);
    gpu_buf *all[] = {&op, &lp, &o, &lse};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        gu_buf_free(all[i]);
}

static void run_case(const kv_case *c, fa_dtype dt)
{
    if (gu_shard_take(gu_attn_cost(c->b, c->h, c->sq, c->cap, c->d, c->dv, 0)))
        run_case_on(c, dt);
}

/* A workspace a third of the size the call asks for (one sized for another plan): the library's
 * split count lowered to what it holds, not dropped to one, and the same results. */
static void run_short_workspace(fa_dtype dt)
{
    const kv_case cc = {"short workspace mqa8", 1, 8, 1, 1, 128, 128, 8000, 0, 0, 0, 0, 0, 0, 0,
                        -1, -1, 0, 0, 0, 0, 0, 0, 0};
    const kv_case *c = &cc;
    run_case_on(c, dt);
    const int full = fa_cuda_decode_last_splits();
    ws_divisor = 3;
    run_case_on(c, dt);
    ws_divisor = 1;
    const int part = fa_cuda_decode_last_splits();
    if (full <= 16 || part <= 1 || part >= full)
        FAIL("splits %d with the whole workspace, %d with a third: expected 16 < full, 1 < third "
             "< full", full, part);
    else
        printf("ok  %-28s %s  splits %d, with a third of the workspace %d\n", c->name,
               fa_dtype_name(dt), full, part);
}

/* MLA's decode on wgmma (fa_decode_wg.cu, sm_90's default): v k's column prefix,
 * one and several 64-row tiles a kv head, contiguous and paged (pages shorter and longer than a
 * 64-key block), splits, the fused append, causal rows, every scoring option, d 512 / dv 320 and
 * a padded d 520 / dv 300. */
static const kv_case wg_cases[] = {
    {"wg mla mqa16", 2, 16, 1, 1, 576, 512, 700, 0, 0, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 0, 0, 0, 1},
    {"wg mla mqa128 paged16 splits 5", 2, 128, 1, 1, 576, 512, 1500, 16, 0, 0, 0, 0, 1, 0, -1, -1, 0, 0, 0, 5, 0, 0, 1},
    {"wg mla paged256 append causal", 2, 64, 1, 3, 576, 512, 900, 256, 3, 0, 0, 0, 0, 1, -1, -1, 0, 0, 0, 0, 0, 0, 1},
    {"wg mla mqa32 window softcap alibi sinks", 3, 32, 1, 2, 576, 512, 500, 0, 0, 0, 0, 1, 0, 1, 90, 0, 25, 1, 1, 3, 0, 0, 1},
    {"wg d512 dv320 gqa2 batch_idx", 3, 48, 2, 1, 512, 320, 400, 0, 1, 0, 1, 0, 0, 0, -1, -1, 0, 0, 0, 1, 0, 0, 1},
    {"wg d520 dv300 paged7 empty", 3, 16, 1, 2, 520, 300, 300, 7, 0, 0, 0, 0, 1, 1, -1, -1, 0, 0, 0, 2, 0, 0, 1},
};

int main(void)
{
    const int start = gu_start("test_gpu_kvcache", 0x13572468acebdf01ull);
    if (start != 0)
        return start;
    /* MLA's shapes on the sliced mma.sync plan here, on wgmma (sm_90's default) below */
    setenv("FLASHATTN_DECODE_WG", "0", 1);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        run_case(&cases[i], FA_DTYPE_BF16);
        run_case(&cases[i], FA_DTYPE_F16);
    }
    unsetenv("FLASHATTN_DECODE_WG");
    int arch = 0, smem = 0;
    if (fa_cuda_device_arch(0, &arch, &smem) != FA_STATUS_OK) {
        fprintf(stderr, "no arch: %s\n", fa_last_error());
        return 1;
    }
    expect_family = arch == 90 ? "fa_decode_wg.cu" : "fa_decode.cu";
    for (size_t i = 0; i < sizeof wg_cases / sizeof wg_cases[0]; i++) {
        run_case(&wg_cases[i], FA_DTYPE_BF16);
        run_case(&wg_cases[i], FA_DTYPE_F16);
    }
    expect_family = NULL;
    if (gu_shard_take(1e6)) {
        run_bad_indices();
        run_alias_rotary(FA_DTYPE_BF16);
        run_alias_rotary(FA_DTYPE_F16);
        run_short_workspace(FA_DTYPE_BF16);
        run_combine(FA_DTYPE_BF16, 37, 96);
        run_combine(FA_DTYPE_BF16, 12, 200);
        run_combine(FA_DTYPE_BF16, 5, 200);
        run_combine(FA_DTYPE_F32, 37, 96);
    }
    printf("test_gpu_kvcache: %d failures\n", failures);
    return failures ? 1 : 0;
}
