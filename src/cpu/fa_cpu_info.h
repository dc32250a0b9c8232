/*
 * What the CPU offers, detected once per process. The CPU backend picks its micro-kernels from
 * these flags, so a flag is set only when both the CPU has the instructions and the OS saves
 * their register state (otherwise the first such instruction faults).
 */
#ifndef FA_CPU_INFO_H
#define FA_CPU_INFO_H

#include <stddef.h>

typedef struct fa_cpu_info {
    int avx, avx2, fma, f16c;
    int avx512f, avx512bw, avx512vl, avx512bf16, avx512fp16;
    int amx_tile, amx_bf16; /* Linux also wants ARCH_REQ_XCOMP_PERM before the first tile use */
    int neon;
    int num_cores;  /* online logical CPUs; the affinity mask may allow fewer */
    long llc_bytes; /* the last-level cache CPU 0 shares (Linux sysfs), 0 when unknown */
    /* CPU 0's level-2 cache over the CPUs sharing it (Linux sysfs), 0 when unknown */
    long l2_share_bytes;
    char model[64]; /* "model name" of /proc/cpuinfo, "unknown" when absent */
} fa_cpu_info;

/* Thread-safe; the result lives for the whole process. */
const fa_cpu_info *fa_cpu_info_get(void);

/* The CPU's description (model and the features the kernels use); thread-safe. */
const char *fa_cpu_info_description(void);

/* The tiles' constants were tuned where each thread has a 2 MB L2 of its own; that is the
 * share assumed when sysfs does not say. */
#define FA_CPU_L2_SHARE_DEFAULT (2L << 20)

/* Bytes of L2 one thread can count on, for sizing tiles: l2_share_bytes, or
 * FA_CPU_L2_SHARE_DEFAULT when unknown, or what fa_cpu_set_l2_share last set. */
long fa_cpu_l2_share(void);

/* For the tests: the L2 bytes per thread that the CPU tiles are sized for (0: the machine's). Not
 * thread-safe against running calls. */
void fa_cpu_set_l2_share(size_t bytes);

#endif /* FA_CPU_INFO_H */
