/* What the CPU kernels share: tile sizes, the multiversioning attribute, the helpers they use. */
#ifndef FA_CPU_KERNEL_H
#define FA_CPU_KERNEL_H

#include "cpu/fa_cpu_gemm.h"
#include "cpu/fa_cpu_math.h"
#include "util/fa_half.h"
#include "util/fa_philox.h"

#define FA_CPU_BM 64 /* query rows per tile (backward) */
#define FA_CPU_BWD_FUSED_ITEMS 32 /* (sequence, kv head) pairs from which the backward runs fused */
#define FA_CPU_BWD_NK 256 /* keys per backward key-pass item: query tiles are packed once per item */
#define FA_CPU_FWD_BM_MAX 256 /* largest forward tile: K/V blocks are packed once per tile */
#define FA_CPU_BN 64 /* keys per block */
#define FA_CPU_LANES 16 /* chunk of a score row that the softmax loops vectorise over */

/* Helpers of the kernels: always inlined, so that each clone below gets its own vectorised copy
 * (an out-of-line helper would be compiled for the baseline ISA, without FMA, and change the
 * results bitwise). */
#if defined(__GNUC__)
#define FA_CPU_INLINE static inline __attribute__((always_inline))
#else
#define FA_CPU_INLINE static inline
#endif

/* Compile the kernels for AVX-512 and AVX2+FMA machines too, picked at load time. */
#if defined(__x86_64__) && defined(__GNUC__)
#define FA_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
/* Code that only runs where AVX-512 exists (the bf16 paths). */
#define FA_CPU_AVX512 __attribute__((target("arch=x86-64-v4")))
#else
#define FA_CPU_CLONES
#endif

#endif /* FA_CPU_KERNEL_H */
