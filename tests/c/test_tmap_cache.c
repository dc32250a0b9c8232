/*
 * The per-thread tensor-map cache of src/cuda/fa_cuda_forward.c (fa_cuda_tmaps_encode), checked
 * with a stand-in for the driver's encoder (no GPU needed): it records its arguments in the map
 * and counts its calls, so the test sees
 *   - a repeated call with the same tensors encodes nothing and returns the same maps;
 *   - a changed pointer, stride or tile re-encodes that map alone, with the new values;
 *   - the dO map of the backward is cached like the others;
 *   - a map the encoder refuses is refused again, never served from the cache;
 *   - more tensors than the cache holds still give correct maps (least recent dropped).
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "core/fa_params.h"
#include "cuda/fa_cuda.h"
#include "cuda/fa_cuda_driver.h"
#include "test_util.h"

static int encodes;
static unsigned long long refused_stride; /* a byte stride the fake encoder refuses, or 0 */

/* Writes (address, dims, byte strides, box rows) into the map's first words. */
static fa_cu_result fake_encode(fa_cu_tensor_map *map, int dtype, unsigned rank, void *addr,
                                const unsigned long long *dims,
                                const unsigned long long *strides, const unsigned *box,
                                const unsigned *elem_strides, int interleave, int swizzle,
                                int l2, int fill)
{
    (void)elem_strides, (void)interleave, (void)swizzle, (void)l2, (void)fill;
    encodes++;
    for (unsigned i = 0; i + 1 < rank; i++)
        if (strides[i] == refused_stride)
            return 1;
    memset(map, 0, sizeof *map);
    map->opaque[0] = (unsigned long long)(uintptr_t)addr;
    for (unsigned i = 0; i < rank; i++)
        map->opaque[1 + i] = dims[i];
    for (unsigned i = 0; i + 1 < rank; i++)
        map->opaque[5 + i] = strides[i];
    map->opaque[8] = box[1];
    map->opaque[9] = (unsigned long long)dtype;
    return 0;
}

/* The map fake_encode would make for a [b, rows, heads, dim] view (element strides). */
static int map_is(const fa_cu_tensor_map *m, const void *ptr, int64_t dim, int64_t rows,
                  int64_t heads, int64_t b, int64_t rs, int64_t hs, int64_t bs, int box_rows)
{
    return m->opaque[0] == (unsigned long long)(uintptr_t)ptr && m->opaque[1] == (uint64_t)dim &&
           m->opaque[2] == (uint64_t)rows && m->opaque[3] == (uint64_t)heads &&
           m->opaque[4] == (uint64_t)b && m->opaque[5] == (uint64_t)(rs * 2) &&
           m->opaque[6] == (uint64_t)(hs * 2) && m->opaque[7] == (uint64_t)(bs * 2) &&
           m->opaque[8] == (uint64_t)box_rows;
}

/* A dense bf16 problem [b, s, h, d] with q, k, v, dO at the given addresses. */
static fa_params problem(char *base, int64_t off)
{
    fa_params p;
    memset(&p, 0, sizeof p);
    p.dtype = FA_DTYPE_BF16;
    p.b = 2, p.h = 4, p.hk = 2, p.d = p.dv = 64, p.max_sq = 100, p.max_sk = 120;
    p.total_q = p.b * p.max_sq, p.total_k = p.b * p.max_sk;
    p.q = base + off;
    p.q_hstride = 64, p.q_rstride = 4 * 64, p.q_bstride = 100 * 4 * 64;
    p.k = base + 1000000 + off;
    p.k_hstride = 64, p.k_rstride = 2 * 64, p.k_bstride = 120 * 2 * 64;
    p.v = base + 2000000 + off;
    p.v_hstride = 64, p.v_rstride = 2 * 64, p.v_bstride = 120 * 2 * 64;
    p.dout_data = base + 3000000 + off;
    p.do_hstride = 64, p.do_rstride = 4 * 64, p.do_bstride = 100 * 4 * 64;
    return p;
}

int main(void)
{
    tu_master_seed("test_tmap_cache");
    static char base[4000000]; /* addresses only: nothing is read */
    fa_cuda_driver d;
    memset(&d, 0, sizeof d);
    d.tensor_map_encode_tiled = fake_encode;
    fa_cu_tensor_map q, k, v, dout, q2, k2, v2;

    fa_params p = problem(base, 0);
    TU_CHECK(fa_cuda_tmaps_encode(&d, &p, 128, 80, &q, &k, &v, NULL) == 0 && encodes == 3,
             "first call: %d encodes, expected 3", encodes);
    TU_CHECK(map_is(&q, p.q, 64, 100, 4, 2, 256, 64, 25600, 128) &&
                 map_is(&k, p.k, 64, 120, 2, 2, 128, 64, 15360, 80) &&
                 map_is(&v, p.v, 64, 120, 2, 2, 128, 64, 15360, 80),
             "first call: maps do not describe q, k, v");
    TU_CHECK(fa_cuda_tmaps_encode(&d, &p, 128, 80, &q2, &k2, &v2, NULL) == 0 && encodes == 3,
             "repeated call: %d encodes, expected none more", encodes);
    TU_CHECK(memcmp(&q, &q2, sizeof q) == 0 && memcmp(&k, &k2, sizeof k) == 0 &&
                 memcmp(&v, &v2, sizeof v) == 0,
             "repeated call: the cached maps differ from the encoded ones");

    /* A new q pointer, then a new key-block size: only what changed is encoded. */
    p.q = base + 64;
    TU_CHECK(fa_cuda_tmaps_encode(&d, &p, 128, 80, &q2, &k2, &v2, NULL) == 0 && encodes == 4 &&
                 map_is(&q2, base + 64, 64, 100, 4, 2, 256, 64, 25600, 128),
             "new q pointer: %d encodes, expected 4, or a stale map", encodes);
    TU_CHECK(fa_cuda_tmaps_encode(&d, &p, 128, 64, &q2, &k2, &v2, NULL) == 0 && encodes == 6 &&
                 map_is(&k2, p.k, 64, 120, 2, 2, 128, 64, 15360, 64) &&
                 map_is(&v2, p.v, 64, 120, 2, 2, 128, 64, 15360, 64),
             "new key block: %d encodes, expected 6, or stale k/v maps", encodes);
    /* A new row stride of k only. */
    p.k_rstride = 3 * 64;
    TU_CHECK(fa_cuda_tmaps_encode(&d, &p, 128, 64, &q2, &k2, &v2, NULL) == 0 && encodes == 7 &&
                 map_is(&k2, p.k, 64, 120, 2, 2, 192, 64, 15360, 64),
             "new k stride: %d encodes, expected 7, or a stale map", encodes);

    /* The backward's dO map: encoded once, then cached. */
    int before = encodes;
    TU_CHECK(fa_cuda_tmaps_encode(&d, &p, 64, 128, &q2, &k2, &v2, &dout) == 0 &&
                 map_is(&dout, p.dout_data, 64, 100, 4, 2, 256, 64, 25600, 64),
             "dO map wrong");
    int after = encodes;
    TU_CHECK(fa_cuda_tmaps_encode(&d, &p, 64, 128, &q2, &k2, &v2, &dout) == 0 &&
                 encodes == after && after > before,
             "backward maps: %d then %d encodes", after - before, encodes - after);

    /* A refusal is never cached. */
    refused_stride = 5 * 64 * 2;
    p.q_rstride = 5 * 64;
    before = encodes;
    TU_CHECK(fa_cuda_tmaps_encode(&d, &p, 128, 80, &q2, &k2, &v2, NULL) != 0 &&
                 fa_cuda_tmaps_encode(&d, &p, 128, 80, &q2, &k2, &v2, NULL) != 0 &&
                 encodes == before + 2,
             "a refused map: %d encodes over two calls, expected 2", encodes - before);
    refused_stride = 0;

    /* More distinct tensors than the cache holds: every map still right. */
    for (int round = 0; round < 2; round++)
        for (int64_t off = 0; off < 40 * 128; off += 128) {
            fa_params r = problem(base, off);
            TU_CHECK(fa_cuda_tmaps_encode(&d, &r, 128, 80, &q2, &k2, &v2, NULL) == 0 &&
                         map_is(&q2, r.q, 64, 100, 4, 2, 256, 64, 25600, 128) &&
                         map_is(&v2, r.v, 64, 120, 2, 2, 128, 64, 15360, 80),
                     "round %d offset %lld: wrong maps", round, (long long)off);
        }
    return tu_finish("test_tmap_cache");
}
