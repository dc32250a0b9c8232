/* The JIT's disk cache of cubins (fa_jit_disk.c), and the switch for its messages. */
#ifndef FA_JIT_DISK_H
#define FA_JIT_DISK_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/fa_jit_hash.h"

/* Disk cache. The key is the full text the cubin depends on; the entry is found by its hash, and
 * its header repeats the key and carries a tag keyed by the directory's secret, so a collision, a
 * damaged file or one written without the secret reads as a miss. */
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
/* The cross-process lock of key's entry (flock on <entry>.lock in the cache directory), taken
 * before a compile so that, of the processes sharing a cache (the ranks of a job, a test's
 * shards), one compiles each kernel and the others wait, then read it from disk. Returns the
 * lock's descriptor, or -1 where there is none: no disk cache, a file system without locks, or
 * FA_JIT_LOCK_WAIT_MS spent waiting (a holder stopped mid-compile stops no one); the caller then
 * compiles unlocked. *waited_ms: the time spent waiting for another holder. */
int fa_jit_disk_lock(fa_jit_disk *disk, const char *key, double *waited_ms);
void fa_jit_disk_unlock(int lock);
/* The file name of key's entry in the cache directory (size >= 40). */
void fa_jit_disk_entry_name(const char *key, char *name, size_t size);

/* Nonzero when FLASHATTN_LOG asks for compile and cache messages on stderr. */
static inline int fa_jit_logging(void)
{
    const char *v = getenv("FLASHATTN_LOG");
    return v && *v && strcmp(v, "0") != 0;
}

#endif /* FA_JIT_DISK_H */
