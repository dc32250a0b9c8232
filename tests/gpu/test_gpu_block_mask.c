/*
 * fa_block_mask_build on the GPU (kernels/fa_block_mask.cu) against the CPU builder (which
 * test_block_mask_build checks against an oracle): document masks from a per-sequence int32 aux
 * tensor (the program reads b), per-head windows from an fp32 aux tensor (it reads h), a causal
 * rule (it reads neither: one evaluation copied to every sequence and head); random sizes with
 * edge blocks, blocks longer than the call, padded outputs, with and without the full lists,
 * and a 4k x 4k call in 128-blocks. Every output element equal; the device's outputs poisoned
 * first.
 */
#include <string.h>

#include "../c/block_mask_rules.h"
#include "gpu_test_util.h"

static int failures;


typedef struct bm_case {
    const char *name;
    int rule, full;
    int64_t b, h, sq, sk, qbs, kbs;
} bm_case;

/* Builds c's mask on the CPU and the GPU and compares every output element. */
static void run_case(const bm_case *c)
{
    const fa_dtype dt = FA_DTYPE_I32; /* for FAIL's name */
    const int64_t nq = (c->sq + c->qbs - 1) / c->qbs, nk = (c->sk + c->kbs - 1) / c->kbs;
    const int64_t s3[3] = {c->b, c->h, nq}, s4[4] = {c->b, c->h, nq, nk};
    const int64_t len = c->sq > c->sk ? c->sq : c->sk, ds[2] = {c->b, len - 3}, ws[1] = {c->h};
    gpu_buf doc = gu_buf_new(FA_DTYPE_I32, 2, ds, 0), win = gu_buf_new(FA_DTYPE_F32, 1, ws, 0);
    for (int64_t b = 0; b < c->b; b++) {
        int32_t d = 0;
        for (int64_t i = 0; i < ds[1]; i++) {
            d += gu_uniform(0, 1) < 4.0 / (double)len;
            ((int32_t *)doc.host.data)[b * ds[1] + i] = d;
        }
    }
    for (int64_t h = 0; h < c->h; h++)
        ((float *)win.host.data)[h] = (float)gu_uniform(1, (double)len / 2);
    gu_buf_upload(&doc);
    gu_buf_upload(&win);
    gpu_buf out[4] = {gu_buf_new(FA_DTYPE_I32, 3, s3, 1), gu_buf_new(FA_DTYPE_I32, 4, s4, 3),
                      gu_buf_new(FA_DTYPE_I32, 3, s3, 0), gu_buf_new(FA_DTYPE_I32, 4, s4, 2)};
    fa_mod *m = rule_program(c->rule);
    fa_block_mask_args a;
    fa_block_mask_args_init(&a);
    a.mask_mod = m;
    a.b = c->b, a.h = c->h, a.sq = c->sq, a.sk = c->sk, a.q_block = c->qbs, a.kv_block = c->kbs;
    for (int side = 0; side < 2; side++) { /* the CPU's, then the device's */
        const int dev = side == 1;
        a.device = dev ? 0 : FA_DEVICE_CPU;
        a.mod_aux[0] = c->rule == R_DOC ? (dev ? &doc.dev : &doc.host) : NULL;
        a.mod_aux[1] = c->rule == R_WINDOW ? (dev ? &win.dev : &win.host) : NULL;
        const fa_tensor *t[4];
        for (int i = 0; i < 4; i++) {
            if (dev)
                gu_buf_poison_device(&out[i]);
            t[i] = dev ? &out[i].dev : &out[i].host;
        }
        a.kv_num_blocks = t[0], a.kv_indices = t[1];
        a.full_kv_num_blocks = c->full ? t[2] : NULL, a.full_kv_indices = c->full ? t[3] : NULL;
        if (fa_block_mask_build(&a) != FA_STATUS_OK) {
            FAIL("%s build: %s", dev ? "device" : "CPU", fa_last_error());
            goto done;
        }
    }
    CHECK_CU(gu_drv->ctx_synchronize());
    for (int i = 0; i < (c->full ? 4 : 2); i++) {
        int32_t *got = gu_buf_download(&out[i]);
        const fa_tensor *v = &out[i].host;
        int64_t bad = 0, first = -1;
        const int64_t n1 = v->ndim == 4 ? nk : 1;
        for (int64_t b = 0; b < c->b; b++)
            for (int64_t h = 0; h < c->h; h++)
                for (int64_t q = 0; q < nq; q++)
                    for (int64_t k = 0; k < n1; k++) {
                        const int64_t at = b * v->stride[0] + h * v->stride[1] +
                                           q * v->stride[2] + (v->ndim == 4 ? k * v->stride[3] : 0);
                        if (got[at] != ((int32_t *)v->data)[at] && bad++ == 0)
                            first = at;
                    }
        if (bad)
            FAIL("output %d: %lld elements differ, first at %lld: %d, CPU %d", i,
                 (long long)bad, (long long)first, got[first], ((int32_t *)v->data)[first]);
        free(got);
    }
done:
    fa_mod_destroy(m);
    for (int i = 0; i < 4; i++)
        gu_buf_free(&out[i]);
    gu_buf_free(&doc);
    gu_buf_free(&win);
}

int main(void)
{
    const int st = gu_start("test_gpu_block_mask", 0x6b6d61736bULL);
    if (st)
        return st;
    char names[40][120];
    bm_case cases[40];
    int n = 0;
    static const int64_t blocks[] = {1, 16, 32, 64, 128};
    for (; n < 36; n++) {
        bm_case *c = &cases[n];
        c->rule = n % R_KINDS, c->full = (n / R_KINDS) % 2;
        c->b = 1 + (int64_t)gu_uniform(0, 3), c->h = 1 + (int64_t)gu_uniform(0, 3);
        c->sq = 1 + (int64_t)gu_uniform(0, 400), c->sk = 1 + (int64_t)gu_uniform(0, 400);
        c->qbs = blocks[1 + (int)gu_uniform(0, 4)], c->kbs = blocks[(int)gu_uniform(0, 5)];
    }
    cases[n++] = (bm_case){NULL, R_DOC, 1, 2, 4, 4096, 4096, 128, 128};
    cases[n++] = (bm_case){NULL, R_CAUSAL, 1, 1, 2, 4096, 4096, 128, 128};
    cases[n++] = (bm_case){NULL, R_WINDOW, 1, 1, 3, 50, 70, 64, 128}; /* blocks past the call */
    for (int i = 0; i < n; i++) {
        bm_case *c = &cases[i];
        snprintf(names[i], sizeof names[i], "%s b %lld h %lld sq %lld sk %lld blocks %lld x %lld%s",
                 rule_names[c->rule], (long long)c->b, (long long)c->h, (long long)c->sq,
                 (long long)c->sk, (long long)c->qbs, (long long)c->kbs, c->full ? " full" : "");
        c->name = names[i];
        if (!gu_only(c->name))
            continue;
        const int before = failures;
        run_case(c);
        printf("%-60s %s\n", c->name, failures == before ? "ok" : "FAILED");
    }
    printf("test_gpu_block_mask: %d failures\n", failures);
    return failures != 0;
}
