/*
 * Kernels compiled at first use: NVRTC turns a kernel family's source plus the plan's defines
 * into a cubin for one arch. Cubins are cached in memory for the process and on disk across
 * processes (fa_jit_disk.c); modules are loaded once per CUDA context.
 */
#ifndef FA_JIT_H
#define FA_JIT_H

#include <stddef.h>
#include <stdint.h>

#include "cuda/fa_cuda_driver.h"
#include "plan/fa_plan.h"

/* Where the cubin of a plan came from. */
typedef enum fa_jit_origin { FA_JIT_COMPILED, FA_JIT_DISK, FA_JIT_MEMORY } fa_jit_origin;

/* Compiles plan's module (or finds it in a cache). Needs NVRTC only: no driver, no GPU. */
fa_status fa_jit_build(const fa_plan *plan, fa_jit_origin *origin);

/* The kernel `entry` of plan's module in context ctx (current on this thread), with its dynamic
 * shared-memory limit raised to the plan's need. Loaded once per context. */
fa_status fa_jit_function(const fa_plan *plan, fa_cu_context ctx, const char *entry,
                          fa_cu_function *fn);

/* The embedded kernel sources (generated at build time from kernels/). */
typedef struct fa_kernel_file {
    const char *name; /* file name in kernels/ */
    const char *text;
} fa_kernel_file;
extern const fa_kernel_file fa_kernel_files[];
extern const int fa_kernel_file_count;

/* Disk cache. The key is the full text the cubin depends on; the entry is found by its hash
 * and its header repeats the key, so a collision or a damaged file reads as a miss. */
void *fa_jit_disk_load(const char *key, size_t *size);
void fa_jit_disk_store(const char *key, const void *cubin, size_t size);
/* The cache directory ("" when caching on disk is off). */
const char *fa_jit_disk_dir(void);

/* 64-bit hashes for keys and checksums. */
uint64_t fa_jit_hash(const void *data, size_t size, uint64_t seed);

/* Nonzero when FLASHATTN_LOG asks for compile and cache messages on stderr. */
int fa_jit_logging(void);

#endif /* FA_JIT_H */
