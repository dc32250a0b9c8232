/* The JIT's hashes (fa_jit_hash.c): entry lookup and the disk cache's tags. */
#ifndef FA_JIT_HASH_H
#define FA_JIT_HASH_H

#include <stddef.h>
#include <stdint.h>

/* SipHash-2-4, fed in pieces: the keyed hash of the disk cache's tags. */
#define FA_JIT_SECRET_SIZE 16
typedef struct fa_jit_mac {
    uint64_t v[4];
    uint64_t total;        /* bytes fed */
    unsigned char tail[8]; /* the last total % 8 of them */
} fa_jit_mac;
void fa_jit_mac_init(fa_jit_mac *m, const unsigned char key[FA_JIT_SECRET_SIZE]);
void fa_jit_mac_update(fa_jit_mac *m, const void *data, size_t size);
uint64_t fa_jit_mac_final(fa_jit_mac *m);

/* 64-bit hashes for keys and checksums. */
uint64_t fa_jit_hash(const void *data, size_t size, uint64_t seed);

#endif /* FA_JIT_HASH_H */
