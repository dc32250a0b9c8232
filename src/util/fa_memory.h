/* Large buffers the CPU backend writes whole, backed by transparent huge pages where it can. */
#ifndef FA_MEMORY_H
#define FA_MEMORY_H

#include <stddef.h>
#include <stdint.h>

/*
 * Asks for huge pages under a strided array [sizes[i]] with strides[i] elements of esize bytes
 * that is about to be written. A fresh buffer (a new torch or NumPy output) is otherwise
 * faulted in 4 KiB at a time while the kernels write it, a fault per page. Only a hint:
 * without huge pages (another OS, THP off) nothing changes, and the contents are never
 * touched.
 */
void fa_memory_hint_array(const void *base, int ndim, const int64_t *sizes,
                          const int64_t *strides, size_t esize);

/* malloc for a workspace of `bytes` the caller fills at once, 64-byte aligned (a cache line);
 * when large, 2 MiB-aligned and hinted as above. Release with free(). */
void *fa_memory_alloc(size_t bytes);

/*
 * A workspace kept between calls, for one that is filled afresh on every call: new pages cost a
 * fault and a clear each. take returns the
 * kept buffer, grown to `bytes`, when no other call holds it and bytes <= FA_MEMORY_KEEP_MAX,
 * else a buffer of its own (NULL when out of memory); give hands either back. The kept buffer
 * stays allocated for the life of the process.
 */
#define FA_MEMORY_KEEP_MAX ((size_t)256 << 20)
void *fa_memory_take(size_t bytes);
void fa_memory_give(void *p);

#endif /* FA_MEMORY_H */
