/* The JIT's disk cache of cubins (fa_jit_disk.c), and the switch for its messages. */
#ifndef FA_JIT_DISK_H
#define FA_JIT_DISK_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Disk cache. The key is the full text the cubin depends on; the entry is found by its hash
 * and its header repeats the key, so a collision or a damaged file reads as a miss. */
void *fa_jit_disk_load(const char *key, size_t *size);
void fa_jit_disk_store(const char *key, const void *cubin, size_t size);
/* The cache directory ("" when caching on disk is off). */
const char *fa_jit_disk_dir(void);

/* 64-bit hashes for keys and checksums. */
uint64_t fa_jit_hash(const void *data, size_t size, uint64_t seed);

/* Nonzero when FLASHATTN_LOG asks for compile and cache messages on stderr. */
static inline int fa_jit_logging(void)
{
    const char *v = getenv("FLASHATTN_LOG");
    return v && *v && strcmp(v, "0") != 0;
}

#endif /* FA_JIT_DISK_H */
