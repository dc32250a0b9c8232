/*
 * The JIT's hashes: fa_jit_hash (FNV-1a with a finaliser) finds entries by their keys, and
 * SipHash-2-4 (fa_jit_mac), keyed by the cache directory's secret, tags the disk cache's files
 * (fa_jit_disk.c).
 */

#include <string.h>

#include "cuda/fa_jit_hash.h"

uint64_t fa_jit_hash(const void *data, size_t size, uint64_t seed)
{
    /* FNV-1a, then a murmur-style finaliser so nearby keys spread over all 64 bits. */
    const unsigned char *p = data;
    uint64_t h = 0xcbf29ce484222325ull ^ seed;
    for (size_t i = 0; i < size; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

/* ---- SipHash-2-4 ------------------------------------------------------------------------ */

#define FA_ROTL64(x, b) (((x) << (b)) | ((x) >> (64 - (b))))

static uint64_t fa_le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static void fa_sip_rounds(uint64_t v[4], int n)
{
    for (int i = 0; i < n; i++) {
        v[0] += v[1], v[1] = FA_ROTL64(v[1], 13), v[1] ^= v[0], v[0] = FA_ROTL64(v[0], 32);
        v[2] += v[3], v[3] = FA_ROTL64(v[3], 16), v[3] ^= v[2];
        v[0] += v[3], v[3] = FA_ROTL64(v[3], 21), v[3] ^= v[0];
        v[2] += v[1], v[1] = FA_ROTL64(v[1], 17), v[1] ^= v[2], v[2] = FA_ROTL64(v[2], 32);
    }
}

static void fa_sip_block(fa_jit_mac *m, uint64_t word)
{
    m->v[3] ^= word;
    fa_sip_rounds(m->v, 2);
    m->v[0] ^= word;
}

void fa_jit_mac_init(fa_jit_mac *m, const unsigned char key[FA_JIT_SECRET_SIZE])
{
    const uint64_t k0 = fa_le64(key), k1 = fa_le64(key + 8);
    m->v[0] = k0 ^ 0x736f6d6570736575ull;
    m->v[1] = k1 ^ 0x646f72616e646f6dull;
    m->v[2] = k0 ^ 0x6c7967656e657261ull;
    m->v[3] = k1 ^ 0x7465646279746573ull;
    m->total = 0;
}

void fa_jit_mac_update(fa_jit_mac *m, const void *data, size_t size)
{
    const unsigned char *p = data;
    size_t have = m->total % 8;
    m->total += size;
    while (size > 0 && (have > 0 || size < 8)) { /* into the partial block */
        m->tail[have++] = *p++;
        size--;
        if (have == 8) {
            fa_sip_block(m, fa_le64(m->tail));
            have = 0;
        }
    }
    for (; size >= 8; p += 8, size -= 8)
        fa_sip_block(m, fa_le64(p));
    memcpy(m->tail, p, size);
}

uint64_t fa_jit_mac_final(fa_jit_mac *m)
{
    uint64_t last = (uint64_t)m->total << 56;
    for (size_t i = 0; i < m->total % 8; i++)
        last |= (uint64_t)m->tail[i] << (8 * i);
    fa_sip_block(m, last);
    m->v[2] ^= 0xff;
    fa_sip_rounds(m->v, 4);
    return m->v[0] ^ m->v[1] ^ m->v[2] ^ m->v[3];
}
