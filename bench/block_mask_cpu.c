/*
 * block_mask_cpu: fa_block_mask_build on the CPU for a causal mask (kv_idx <= q_idx) over
 * S x S in 128 x 128 blocks, full blocks separated, best of several builds.
 *
 *   cc -O2 -Iinclude bench/block_mask_cpu.c -Lbuild -lflashattn -lm -o build/block_mask_cpu
 *   FLASHATTN_NUM_THREADS=1 LD_LIBRARY_PATH=build build/block_mask_cpu [S [ROUNDS]]
 *       prints ms per build and one row's counts (a check that the lists were written)
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "flashattn.h"

static double bm_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    const int64_t s = argc > 1 ? atoll(argv[1]) : 8192, blk = 128;
    const int rounds = argc > 2 ? atoi(argv[2]) : 5;
    const int64_t nq = (s + blk - 1) / blk;
    fa_mod *m = fa_mod_create();
    const int q = fa_mod_var(m, FA_MOD_Q_IDX), kv = fa_mod_var(m, FA_MOD_KV_IDX);
    if (!m || fa_mod_finish(m, fa_mod_binary(m, FA_MOD_LE, kv, q), FA_MOD_KIND_MASK)) {
        fprintf(stderr, "mask: %s\n", fa_last_error());
        return 1;
    }
    /* kv_num_blocks / full_kv_num_blocks: [1, 1, nq]; the index lists: [1, 1, nq, nq] */
    const int64_t s3[3] = {1, 1, nq}, s4[4] = {1, 1, nq, nq};
    int32_t *num = malloc(nq * sizeof *num), *idx = malloc(nq * nq * sizeof *idx);
    int32_t *fnum = malloc(nq * sizeof *fnum), *fidx = malloc(nq * nq * sizeof *fidx);
    if (!num || !idx || !fnum || !fidx)
        return 1;
    const fa_tensor t_num = fa_tensor_make(num, FA_DTYPE_I32, 3, s3, NULL);
    const fa_tensor t_idx = fa_tensor_make(idx, FA_DTYPE_I32, 4, s4, NULL);
    const fa_tensor t_fnum = fa_tensor_make(fnum, FA_DTYPE_I32, 3, s3, NULL);
    const fa_tensor t_fidx = fa_tensor_make(fidx, FA_DTYPE_I32, 4, s4, NULL);
    fa_block_mask_args a;
    fa_block_mask_args_init(&a);
    a.mask_mod = m;
    a.b = a.h = 1;
    a.sq = a.sk = s;
    a.q_block = a.kv_block = blk;
    a.kv_num_blocks = &t_num, a.kv_indices = &t_idx;
    a.full_kv_num_blocks = &t_fnum, a.full_kv_indices = &t_fidx;
    double best = 1e30;
    for (int r = 0; r < rounds; r++) {
        const double t0 = bm_now();
        if (fa_block_mask_build(&a) != FA_STATUS_OK) {
            fprintf(stderr, "fa_block_mask_build: %s\n", fa_last_error());
            return 1;
        }
        const double t = bm_now() - t0;
        best = t < best ? t : best;
    }
    printf("causal %lld x %lld: %.1f ms (best of %d); query block 5: %d partial, %d full\n",
           (long long)s, (long long)s, best * 1e3, rounds, num[5], fnum[5]);
    fa_mod_destroy(m);
    free(num), free(idx), free(fnum), free(fidx);
    return 0;
}
