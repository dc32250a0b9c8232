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

/* Disk cache (fa_jit_disk.c). The key is the full text the cubin depends on; the entry is found
 * by its hash, and its header repeats the key and carries a tag keyed by the directory's secret,
 * so a collision, a damaged file or one written without the secret reads as a miss. */
typedef struct fa_jit_disk fa_jit_disk;

/* File: this header | key | cubin. The tag is the keyed hash (fa_jit_mac) of the header's bytes
 * before it, the key and the cubin. */
typedef struct fa_jit_header {
    char magic[8];
    uint64_t key_size;
    uint64_t cubin_size;
    uint64_t tag;
} fa_jit_header;

/* The process's cache, opened at first use from the environment; NULL when caching on disk is
 * off or the directory was refused (said once on stderr): kernels are then cached in memory. */
fa_jit_disk *fa_jit_disk_default(void);
/* Opens dir (creating it 0700 where missing) as a cache. NULL when refused, with the reason in
 * why and *untrusted 1 when the directory exists but is not this user's private one (owned by
 * another user, writable by group or others, a symbolic link, not a directory). */
fa_jit_disk *fa_jit_disk_open(const char *dir, int *untrusted, char *why, size_t why_size);
void fa_jit_disk_close(fa_jit_disk *disk);
/* The directory, absolute when it was given relative (resolved once, at the open). */
const char *fa_jit_disk_path(const fa_jit_disk *disk);
/* The cubin stored under key (malloc'ed, *size bytes), or NULL: absent, damaged, or not a file
 * this cache wrote. disk may be NULL (a miss). */
void *fa_jit_disk_load(fa_jit_disk *disk, const char *key, size_t *size);
/* Stores cubin under key, replacing any entry; 0 when written. */
int fa_jit_disk_store(fa_jit_disk *disk, const char *key, const void *cubin, size_t size);
/* The file name of key's entry in the cache directory (size >= 40). */
void fa_jit_disk_entry_name(const char *key, char *name, size_t size);

/* SipHash-2-4, fed in pieces: the keyed hash of the disk cache's tags. */
#define FA_JIT_SECRET_SIZE 16
typedef struct fa_jit_mac {
    uint64_t v[4];
    uint64_t total;          /* bytes fed */
    unsigned char tail[8];   /* the last total % 8 of them */
} fa_jit_mac;
void fa_jit_mac_init(fa_jit_mac *m, const unsigned char key[FA_JIT_SECRET_SIZE]);
void fa_jit_mac_update(fa_jit_mac *m, const void *data, size_t size);
uint64_t fa_jit_mac_final(fa_jit_mac *m);

/* 64-bit hashes for keys and checksums. */
uint64_t fa_jit_hash(const void *data, size_t size, uint64_t seed);

/* Nonzero when FLASHATTN_LOG asks for compile and cache messages on stderr. */
int fa_jit_logging(void);

#endif /* FA_JIT_H */
