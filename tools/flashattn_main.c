/* The `flashattn` command: what this build offers (info) and how fast it is (bench). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_bench.h"
#include "fa_precompile.h"

static void usage_print(FILE *f)
{
    fputs("usage: flashattn <command> [options]\n"
          "\n"
          "commands:\n"
          "  info      version, backends, the CPU and the default thread count\n"
          "  bench     time and check fa_attention_forward (flashattn bench --help)\n"
          "  peak      the cores' fp32 FMA rate, to quote CPU figures against\n"
          "  gemm      the CPU forward's fp32 micro-kernel products alone, one thread\n"
          "  precompile  compile CUDA kernels into the cache, no GPU needed\n"
          "            (flashattn precompile --help)\n"
          "  help      this text\n"
          "\n"
          "environment:\n"
          "  FLASHATTN_NUM_THREADS   CPU threads when a call asks for 0 (default: every CPU\n"
          "                          this process may run on)\n"
          "  FLASHATTN_CACHE_DIR     compiled CUDA kernels (default $XDG_CACHE_HOME/flashattn\n"
          "                          or ~/.cache/flashattn; empty: no disk cache)\n"
          "  FLASHATTN_LOG=1         log each kernel compile and cache hit, and each CPU\n"
          "                          forward/backward's schedule and phase times, to stderr\n",
          f);
}

static int info_main(void)
{
    const char *env_threads = getenv("FLASHATTN_NUM_THREADS");
    printf("flashattn %s\n", fa_version());
    printf("backends:\n");
    printf("  %-8s%s\n", "cpu", "available");
    int n_gpu = fa_cuda_device_count();
    printf("  %-8s%s\n", "cuda", n_gpu > 0 ? "available" : "not available");
    /* The driver and NVRTC lines say what was found, or why the GPU is not used. */
    printf("%s\n", fa_cuda_status());
    for (int i = 0; i < n_gpu; i++) {
        fa_cuda_device_info di;
        if (fa_cuda_device_info_get(i, &di) == FA_STATUS_OK)
            printf("gpu %d:    %s, sm_%d, %d SMs, %.1f GiB\n", i, di.name, di.arch,
                   di.multiprocessors, (double)di.total_memory / (1 << 30));
    }
    printf("cpu:      %s\n", fa_cpu_description());
    if (env_threads && *env_threads)
        printf("threads:  %d by default (FLASHATTN_NUM_THREADS=%s)\n", fa_cpu_default_threads(),
               env_threads);
    else
        printf("threads:  %d by default (the CPUs this process may run on)\n",
               fa_cpu_default_threads());
    return FA_EXIT_OK;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage_print(stderr);
        return FA_EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0) {
        usage_print(stdout);
        return FA_EXIT_OK;
    }
    if (strcmp(cmd, "--version") == 0) {
        printf("flashattn %s\n", fa_version());
        return FA_EXIT_OK;
    }
    if (strcmp(cmd, "info") == 0) {
        if (argc > 2) {
            fprintf(stderr, "flashattn info: unexpected argument '%s'\n", argv[2]);
            return FA_EXIT_USAGE;
        }
        return info_main();
    }
    if (strcmp(cmd, "bench") == 0)
        return fa_bench_main(argc - 2, argv + 2);
    if (strcmp(cmd, "peak") == 0)
        return fa_peak_main(argc - 2, argv + 2);
    if (strcmp(cmd, "gemm") == 0)
        return fa_gemm_bench_main(argc - 2, argv + 2);
    if (strcmp(cmd, "precompile") == 0)
        return fa_precompile_main(argc - 2, argv + 2);
    fprintf(stderr, "flashattn: unknown command '%s'\n\n", cmd);
    usage_print(stderr);
    return FA_EXIT_USAGE;
}
