/*
 * How the KV-cache attention reads its fields of fa_params: the cache positions of a sequence,
 * the block holding a position, the element offset of a cache row. Used by core's validation
 * (fa_kvcache.c), the CPU decode (fa_cpu_decode.c) and the CPU forward's key loads
 * (fa_kv_key_at).
 */
#ifndef FA_KVCACHE_H
#define FA_KVCACHE_H

#include <stdint.h>

#include "core/fa_params.h"

/* First cache position sequence i attends to. */
static inline int64_t fa_kv_seq_start(const fa_params *p, int64_t i)
{
    return p->leftpad ? p->leftpad[i] : 0;
}

/* One past the last cache position of sequence i, the new keys included. */
static inline int64_t fa_kv_seq_end(const fa_params *p, int64_t i)
{
    return p->cache_seqlens ? (int64_t)p->cache_seqlens[i] + p->s_new : p->max_sk;
}

/* Element offsets of kv head kh's key and value rows at row `row` of cache block blk. */
static inline int64_t fa_kv_k_at(const fa_params *p, int64_t blk, int64_t row, int64_t kh)
{
    return blk * p->k_bstride + row * p->k_rstride + kh * p->k_hstride;
}

static inline int64_t fa_kv_v_at(const fa_params *p, int64_t blk, int64_t row, int64_t kh)
{
    return blk * p->v_bstride + row * p->v_rstride + kh * p->v_hstride;
}

/* The block (paged) or cache row (contiguous) holding page `page` of sequence i. */
static inline int64_t fa_kv_block(const fa_params *p, int64_t i, int64_t page)
{
    if (p->paged)
        return p->block_table[i * p->bt_bstride + page];
    return p->batch_idx ? p->batch_idx[i] : i;
}

/* Element offsets in k and v (the kv head's offset not included) of key j of sequence i in a
 * forward's record, k_start being the sequence's first row (fa_seq): row k_start + j of its
 * batch row (dense; varlen batch strides are 0), or, paged, position j of its blocks. Every
 * CPU forward path finds a key row here. */
static inline void fa_kv_key_at(const fa_params *p, int64_t i, int64_t k_start, int64_t j,
                                int64_t *k_at, int64_t *v_at)
{
    int64_t blk = i, row = k_start + j;
    if (p->paged) {
        blk = fa_kv_block(p, i, j / p->page_size);
        row = j % p->page_size;
    }
    *k_at = blk * p->k_bstride + row * p->k_rstride;
    *v_at = blk * p->v_bstride + row * p->v_rstride;
}

/* Whether keys [j0, j0 + n) of a sequence are rows in a row (one page when paged), so that
 * fa_kv_key_at(j0) and the row strides reach them all. */
static inline int fa_kv_keys_adjacent(const fa_params *p, int64_t j0, int64_t n)
{
    return !p->paged || n <= 0 || j0 / p->page_size == (j0 + n - 1) / p->page_size;
}

/* Every cache_seqlens entry (host memory, [b]) non-negative and, with the s_new new keys, within
 * the capacity (FA_RULE_KV_FITS); a paged cache's error names block_table. Core's validation
 * applies it to host indices. */
fa_status fa_kvcache_check_seqlens(const fa_params *p, const int32_t *cache_seqlens);

/* The same for entry i alone, of value len: a device backend's report of the first entry that
 * fails the rule in its kernels. */
fa_status fa_kvcache_check_seqlen(const fa_params *p, int64_t i, int64_t len);

#endif /* FA_KVCACHE_H */
