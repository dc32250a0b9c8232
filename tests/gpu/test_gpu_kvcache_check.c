/*
 * The paged capacity check on a CUDA device (kernels/fa_decode_check.cuh): cache_seqlens in
 * device memory, one sequence of 40 (past the first warp's 32) over what its block_table row
 * holds, or negative. Each case asserts:
 *   the call is refused, its message naming the failing sequence (block_table, or the negative
 *   entry of cache_seqlens);
 *   the caches hold exactly what was uploaded (nothing appended), and the context is usable;
 *   the same call with that entry mended to the largest that fits passes, and appends.
 * The append runs fused into the attention, or in fa_kv_append where a rotated k and v are
 * views of the caches' own rows. Exits 77 (skipped) when no CUDA device is usable.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/fa_cuda_driver.h"
#include "gpu_test_util.h"

#define B 40
#define H 4
#define HK 2
#define D 64
#define PAGE 16
#define BLOCKS 4 /* per sequence: capacity PAGE * BLOCKS */
#define CAP (PAGE * BLOCKS)
#define ROT 32 /* rotary_dim */

static int failures;

typedef struct check_case {
    const char *name;
    int s_new;
    int alias;  /* 1: k and v views of the caches' rows, rotated (the append in fa_kv_append) */
    int bad;    /* the failing sequence */
    int len;    /* its cache_seqlens entry */
    const char *says; /* in the error message */
} check_case;

static const check_case cases[] = {
    {"read only, one over", 0, 0, 37, CAP + 1, "block_table: sequence 37 needs 65"},
    {"read only, negative", 0, 0, 5, -1, "cache_seqlens: entry 5 is negative"},
    {"append fused, one over", 2, 0, 37, CAP - 1, "block_table: sequence 37 needs 65"},
    {"append alone, one over", 2, 1, 33, CAP - 1, "block_table: sequence 33 needs 65"},
};

static void run_case(const check_case *c)
{
    const fa_dtype dt = FA_DTYPE_BF16;
    int64_t qs[4] = {B, 1, H, D}, ks[4] = {B * BLOCKS, PAGE, HK, D}, ns[4] = {B, 2, HK, D};
    int64_t bsz[1] = {B}, bts[2] = {B, BLOCKS}, ros[2] = {CAP, ROT / 2};
    gpu_buf q = gu_buf_new(dt, 4, qs, 0), o = gu_buf_new(dt, 4, qs, 0);
    gpu_buf kc = gu_buf_new(dt, 4, ks, 0), vc = gu_buf_new(dt, 4, ks, 0);
    gpu_buf kn = gu_buf_new(dt, 4, ns, 0), vn = gu_buf_new(dt, 4, ns, 0);
    gpu_buf cs = gu_buf_new(dt, 2, ros, 0), sn = gu_buf_new(dt, 2, ros, 0);
    gpu_buf sl = gu_buf_new(FA_DTYPE_I32, 1, bsz, 0), bt = gu_buf_new(FA_DTYPE_I32, 2, bts, 0);
    gpu_buf *fill[] = {&q, &kc, &vc, &kn, &vn, &cs, &sn};
    for (size_t i = 0; i < sizeof fill / sizeof fill[0]; i++)
        gu_fill_uniform(fill[i], -1, 1);
    int32_t *len = sl.host.data, *tab = bt.host.data;
    for (int i = 0; i < B; i++) {
        len[i] = 5 + (i * 7) % 55; /* with 2 new keys at most 61 of 64 */
        for (int j = 0; j < BLOCKS; j++)
            tab[i * BLOCKS + j] = B * BLOCKS - 1 - (i * BLOCKS + j);
    }
    len[c->bad] = c->len;
    gpu_buf *in[] = {&q, &kc, &vc, &kn, &vn, &cs, &sn, &sl, &bt};
    for (size_t i = 0; i < sizeof in / sizeof in[0]; i++)
        gu_buf_upload(in[i]);
    /* alias: k[i] and v[i] are rows 0 and 1 of block 4 i of the caches. */
    const int64_t alias_stride[4] = {BLOCKS * PAGE * HK * D, HK * D, D, 1};
    fa_tensor ka = fa_tensor_make(kc.dev.data, dt, 4, ns, alias_stride);
    fa_tensor va = fa_tensor_make(vc.dev.data, dt, 4, ns, alias_stride);

    fa_kvcache_args a;
    fa_kvcache_args_init(&a);
    a.q = &q.dev, a.k_cache = &kc.dev, a.v_cache = &vc.dev, a.out = &o.dev;
    a.cache_seqlens = &sl.dev, a.block_table = &bt.dev;
    a.device = 0;
    if (c->s_new) {
        a.k = c->alias ? &ka : &kn.dev, a.v = c->alias ? &va : &vn.dev;
        if (c->alias)
            a.rotary_cos = &cs.dev, a.rotary_sin = &sn.dev;
    }
    fa_cu_deviceptr ws = 0;
    const size_t ws_size = fa_attention_kvcache_workspace_size(&a);
    if (ws_size) {
        CHECK_CU(gu_drv->mem_alloc(&ws, ws_size));
        a.workspace = (void *)(uintptr_t)ws, a.workspace_size = ws_size;
    }
    const fa_status st = fa_attention_kvcache(&a);
    if (st == FA_STATUS_OK || !strstr(fa_last_error(), c->says))
        FAIL("refusal: status %d, message \"%s\", wanted \"%s\"", st,
             st == FA_STATUS_OK ? "" : fa_last_error(), c->says);
    if (gu_drv->ctx_synchronize() != 0)
        FAIL("the refused call faulted the context");
    for (int i = 0; i < 2; i++) {
        const gpu_buf *cache = i ? &vc : &kc;
        void *now = gu_buf_download(cache);
        if (memcmp(now, cache->host.data, cache->bytes) != 0)
            FAIL("the refused call wrote the %s cache", i ? "v" : "k");
        free(now);
    }
    /* Mended to the largest entry that fits: passes, and (without rotary) appends the rows
     * bitwise at positions [len, len + s_new) of the sequence's blocks. */
    len[c->bad] = CAP - c->s_new;
    gu_buf_upload(&sl);
    if (fa_attention_kvcache(&a) != FA_STATUS_OK)
        FAIL("the mended call: %s", fa_last_error());
    if (gu_drv->ctx_synchronize() != 0)
        FAIL("the mended call faulted the context");
    if (c->s_new && !c->alias) {
        char *got = gu_buf_download(&kc);
        const size_t row = (size_t)HK * D * 2;
        for (int s = 0; s < c->s_new; s++) {
            const int pos = CAP - c->s_new + s;
            const int blk = tab[c->bad * BLOCKS + pos / PAGE];
            const char *at = got + ((size_t)blk * PAGE + (size_t)(pos % PAGE)) * row;
            const char *want = (const char *)kn.host.data + ((size_t)c->bad * 2 + (size_t)s) * row;
            if (memcmp(at, want, row) != 0)
                FAIL("the mended call did not append new key %d of sequence %d", s, c->bad);
        }
        free(got);
    }
    printf("ok  %-26s refused: %s\n", c->name, c->says);
    if (ws)
        CHECK_CU(gu_drv->mem_free(ws));
    gpu_buf *all[] = {&q, &o, &kc, &vc, &kn, &vn, &cs, &sn, &sl, &bt};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        gu_buf_free(all[i]);
}

int main(void)
{
    const int start = gu_start("test_gpu_kvcache_check", 0x2468ace013579bdfull);
    if (start != 0)
        return start;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (gu_shard_take(1e5))
            run_case(&cases[i]);
    printf("test_gpu_kvcache_check: %d failures\n", failures);
    return failures ? 1 : 0;
}
