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
#include "cuda/fa_jit_disk.h"
#include "plan/fa_plan.h"

/* Where the cubin of a plan came from. */
typedef enum fa_jit_origin { FA_JIT_COMPILED, FA_JIT_DISK, FA_JIT_MEMORY } fa_jit_origin;

/* Compiles plan's module (or finds it in a cache). Needs NVRTC only: no driver, no GPU. */
fa_status fa_jit_build(const fa_plan *plan, fa_jit_origin *origin);

/* fa_jit_build for fa_cuda_precompile: also an error where this process compiled the module and
 * ptxas reported a potential performance loss (wgmma serialised, ...), which no kernel of the
 * library should have; a GPU-less CI catches it there. A call's own compile only logs it. */
fa_status fa_jit_precompile(const fa_plan *plan, fa_jit_origin *origin);

/* The line of an NVRTC program log in which ptxas reports a potential performance loss, its
 * length in *len (without the newline); NULL when there is none (or no log). */
const char *fa_jit_perf_note(const char *log, size_t *len);

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

#endif /* FA_JIT_H */
