/*
 * Huge-page hints. Linux's transparent huge pages default to "madvise" on common
 * distributions: a mapping gets 2 MiB pages only where madvise(MADV_HUGEPAGE) asked for them.
 * The hint covers the 2 MiB-aligned interior of a buffer, so it never reaches memory outside
 * it; below two huge pages it is not worth the system call.
 */
#include <pthread.h>
#include <stdlib.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "util/fa_memory.h"

#define FA_HUGE_PAGE ((uintptr_t)2 << 20)

static void fa_memory_hint_range(uintptr_t lo, uintptr_t hi)
{
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t start = (lo + FA_HUGE_PAGE - 1) & ~(FA_HUGE_PAGE - 1);
    const uintptr_t end = hi & ~(FA_HUGE_PAGE - 1);
    if (end > start && end - start >= 2 * FA_HUGE_PAGE)
        (void)madvise((void *)start, end - start, MADV_HUGEPAGE); /* a refusal changes nothing */
#else
    (void)lo;
    (void)hi;
#endif
}

void fa_memory_hint_array(const void *base, int ndim, const int64_t *sizes,
                          const int64_t *strides, size_t esize)
{
    int64_t lo = 0, hi = 0; /* element offsets of the first and last elements */
    for (int i = 0; i < ndim; i++) {
        if (sizes[i] <= 0)
            return;
        int64_t reach;
        /* Only a hint: an extent past int64 is left without one. */
        if (__builtin_mul_overflow(sizes[i] - 1, strides[i], &reach) ||
            __builtin_add_overflow(reach < 0 ? lo : hi, reach, reach < 0 ? &lo : &hi))
            return;
    }
    int64_t lo_bytes, end_bytes;
    if (__builtin_mul_overflow(lo, (int64_t)esize, &lo_bytes) ||
        __builtin_add_overflow(hi, 1, &hi) || __builtin_mul_overflow(hi, (int64_t)esize, &end_bytes))
        return;
    const uintptr_t at = (uintptr_t)base;
    fa_memory_hint_range(at + (uintptr_t)lo_bytes, at + (uintptr_t)end_bytes);
}

void *fa_memory_alloc(size_t bytes)
{
    if (bytes < 2 * FA_HUGE_PAGE)
        return aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    const size_t size = (bytes + FA_HUGE_PAGE - 1) & ~(FA_HUGE_PAGE - 1);
    void *p = aligned_alloc(FA_HUGE_PAGE, size);
    if (p)
        fa_memory_hint_range((uintptr_t)p, (uintptr_t)p + size);
    return p;
}

/* The kept buffer: at most one, owned by one call at a time. */
static pthread_mutex_t fa_kept_lock = PTHREAD_MUTEX_INITIALIZER;
static void *fa_kept;
static size_t fa_kept_size;
static int fa_kept_busy;

void *fa_memory_take(size_t bytes)
{
    pthread_mutex_lock(&fa_kept_lock);
    if (!fa_kept_busy && bytes <= FA_MEMORY_KEEP_MAX) {
        if (fa_kept_size < bytes) {
            free(fa_kept);
            fa_kept = fa_memory_alloc(bytes);
            fa_kept_size = fa_kept ? bytes : 0;
        }
        if (fa_kept) {
            fa_kept_busy = 1;
            void *p = fa_kept;
            pthread_mutex_unlock(&fa_kept_lock);
            return p;
        }
    }
    pthread_mutex_unlock(&fa_kept_lock);
    return fa_memory_alloc(bytes);
}

void fa_memory_give(void *p)
{
    pthread_mutex_lock(&fa_kept_lock);
    if (p && p == fa_kept)
        fa_kept_busy = 0;
    else
        free(p);
    pthread_mutex_unlock(&fa_kept_lock);
}
