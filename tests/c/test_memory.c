/*
 * The kept workspace (src/util/fa_memory.c): a second taker while the first holds it gets a
 * buffer of its own; given back, the kept buffer serves the next taker again, grown when asked
 * for more, with every byte asked for writable (run under a sanitizer, an overrun shows); above
 * FA_MEMORY_KEEP_MAX nothing is kept.
 */
#include <string.h>

#include "test_util.h"
#include "util/fa_memory.h"

int main(void)
{
    tu_rng rng = {tu_master_seed("test_memory")};
    const size_t small = (size_t)tu_rng_int(&rng, 1, 1 << 20);
    const size_t big = small + (size_t)tu_rng_int(&rng, 5 << 20, 9 << 20);

    char *a = fa_memory_take(small), *b = fa_memory_take(small);
    TU_CHECK(a && b && a != b, "a second taker shares the held buffer (%p, %p)", (void *)a,
             (void *)b);
    memset(a, 0x11, small);
    memset(b, 0x22, small);
    TU_CHECK(a[small - 1] == 0x11, "the two buffers overlap");
    fa_memory_give(b);
    fa_memory_give(a);

    char *c = fa_memory_take(small);
    TU_CHECK(c == a, "the kept buffer was not handed out again");
    fa_memory_give(c);

    char *d = fa_memory_take(big);
    TU_CHECK(d != NULL, "out of memory for %zu bytes", big);
    memset(d, 0x33, big);
    fa_memory_give(d);
    char *e = fa_memory_take(small);
    TU_CHECK(e == d, "the grown buffer was not kept");
    fa_memory_give(e);

    char *f = fa_memory_take(FA_MEMORY_KEEP_MAX + 1), *g = fa_memory_take(small);
    TU_CHECK(f && g == d, "a buffer over the limit took the kept one's place");
    fa_memory_give(f);
    fa_memory_give(g);
    return tu_finish("test_memory");
}
