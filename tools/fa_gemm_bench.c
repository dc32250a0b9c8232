/*
 * `flashattn gemm`: the CPU forward's two fp32 products timed alone on one thread, at the shapes
 * one tile of the forward gives them, with operands that stay warm in cache between calls:
 *   S^T [n][m] = K [n][d] . Q^T [d][m]      (n keys of a block, m query rows of a tile)
 *   O [m][dv] += P [m][n] . V [n][dv]       (P read through S^T's transposed strides)
 * Each as GFLOP/s and as a fraction of one core's FMA peak, measured in the same run: the share
 * of the forward's time its micro-kernel itself loses, apart from softmax, packing and memory.
 * FLASHATTN_CPU_GEMM picks the micro-kernel as it does for the forward.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu/fa_cpu_gemm.h"
#include "cpu/fa_cpu_kernel.h"
#include "fa_bench.h"

static double fa_gemm_bench_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void fa_gemm_bench_fill(float *x, int64_t n, unsigned seed)
{
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        x[i] = (float)(seed >> 8) * 0x1p-24f - 0.5f;
    }
}

/* One product's arguments, as fa_cpu_gemm_f32 takes them. */
typedef struct fa_gemm_case {
    float *c, *a, *b;
    int64_t ldc, a_rs, a_cs, ldb, m, n, k;
    int accumulate;
} fa_gemm_case;

/* Best seconds per call over `reps` timed rounds of `calls` calls each. */
static double fa_gemm_bench_time(const fa_gemm_case *g, int calls, int reps)
{
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = fa_gemm_bench_seconds();
        for (int i = 0; i < calls; i++)
            fa_cpu_gemm_f32(g->c, g->ldc, g->a, g->a_rs, g->a_cs, g->b, g->ldb, g->m, g->n,
                            g->k, g->accumulate);
        double t = (fa_gemm_bench_seconds() - t0) / calls;
        best = t < best ? t : best;
    }
    return best;
}

int fa_gemm_bench_main(int argc, char **argv)
{
    int64_t d = 128, m = FA_CPU_FWD_BM_MAX, n = FA_CPU_BN;
    int reps = 5;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--head-dim") == 0 && i + 1 < argc) {
            d = atoll(argv[++i]);
        } else if (strcmp(argv[i], "--rows") == 0 && i + 1 < argc) {
            m = atoll(argv[++i]);
        } else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
            reps = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: flashattn gemm [--head-dim D (128)] [--rows M (%d)] "
                            "[--reps R (5)]\n",
                    FA_CPU_FWD_BM_MAX);
            return FA_EXIT_USAGE;
        }
    }
    if (d < 1 || d > 256 || m < 1 || m > 4096 || reps < 1) {
        fprintf(stderr, "flashattn gemm: --head-dim must be in 1..256, --rows in 1..4096, "
                        "--reps >= 1\n");
        return FA_EXIT_USAGE;
    }
    const int64_t mp = fa_cpu_gemm_pad(m), ld = fa_cpu_tile_ld(mp), dvp = fa_cpu_gemm_pad(d);
    /* k: [n][d] (K rows), qt: [d][ld], st: [n][ld], v: [n][dvp], o: [m][dvp] */
    float *k = malloc(sizeof(float) * (size_t)(n * d));
    float *qt = malloc(sizeof(float) * (size_t)(d * ld));
    float *st = malloc(sizeof(float) * (size_t)(n * ld));
    float *v = malloc(sizeof(float) * (size_t)(n * dvp));
    float *o = malloc(sizeof(float) * (size_t)(m * dvp));
    if (!k || !qt || !st || !v || !o) {
        fprintf(stderr, "flashattn gemm: out of memory\n");
        free(k), free(qt), free(st), free(v), free(o);
        return FA_EXIT_FAIL;
    }
    fa_gemm_bench_fill(k, n * d, 1);
    fa_gemm_bench_fill(qt, d * ld, 2);
    fa_gemm_bench_fill(st, n * ld, 3);
    fa_gemm_bench_fill(v, n * dvp, 4);
    fa_gemm_bench_fill(o, m * dvp, 5);

    const fa_gemm_case qk = {st, k, qt, ld, d, 1, ld, n, mp, d, 0};
    const fa_gemm_case pv = {o, st, v, dvp, 1, ld, dvp, m, dvp, n, 1};
    const double flops_qk = 2.0 * (double)(n * mp * d), flops_pv = 2.0 * (double)(m * dvp * n);
    /* About 0.1 s per timed round. */
    const int calls_qk = (int)(2e9 / flops_qk) + 1, calls_pv = (int)(2e9 / flops_pv) + 1;
    const double t_qk = fa_gemm_bench_time(&qk, calls_qk, reps);
    const double t_pv = fa_gemm_bench_time(&pv, calls_pv, reps);
    const int lanes = fa_peak_lanes();
    const double peak = lanes ? fa_peak_gflops(1, lanes) : 0.0;
    printf("micro-kernel %s, one thread, d=%lld, tile %lld rows x %lld keys (%s)\n",
           fa_cpu_gemm_name(), (long long)d, (long long)m, (long long)n, fa_cpu_description());
    const char *names[2] = {"S^T = K Q^T", "O += P V"};
    const double rates[2] = {flops_qk / t_qk * 1e-9, flops_pv / t_pv * 1e-9};
    for (int i = 0; i < 2; i++) {
        if (peak > 0)
            printf("  %-12s %8.1f GFLOP/s  %5.1f%% of one core's peak (%.1f)\n", names[i],
                   rates[i], 100.0 * rates[i] / peak, peak);
        else
            printf("  %-12s %8.1f GFLOP/s\n", names[i], rates[i]);
    }
    free(k), free(qt), free(st), free(v), free(o);
    return FA_EXIT_OK;
}
