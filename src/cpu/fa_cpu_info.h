/*
 * What the CPU offers, detected once per process. The CPU backend picks its micro-kernels from
 * these flags, so a flag is set only when both the CPU has the instructions and the OS saves
 * their register state (otherwise the first such instruction faults).
 */
#ifndef FA_CPU_INFO_H
#define FA_CPU_INFO_H

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

/* Bytes of L2 one thread can count on, for sizing tiles: l2_share_bytes, or 2 MB when unknown,
 * or what fa_cpu_set_l2_share (api/fa_internal.h) last set. */
long fa_cpu_l2_share(void);

#endif /* FA_CPU_INFO_H */
