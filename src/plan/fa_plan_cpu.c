/* The CPU backend's size rules (fa_plan_cpu.h). */
#include <math.h>

#include "plan/fa_plan_cpu.h"

/* Bytes a forward tile of bm rows keeps in L2 across its key blocks: Q^T, O and one block of
 * S^T, in the type the products accumulate in; the K/V blocks stream through. */
static size_t fa_plan_cpu_tile_bytes(const fa_params *p, int64_t bm)
{
    const size_t real_size = p->dtype == FA_DTYPE_F64 ? sizeof(double) : sizeof(float);
    return (size_t)bm * (size_t)(p->d + p->dv + FA_CPU_BN) * real_size;
}

/*
 * Query rows per work item. Each item reads its head's K/V once (fp32 rows in place or copied
 * per block, bf16 from the call's packed blocks), so taller tiles read K/V less often; they are
 * kept shorter when the problem has few of them, for windows bounded on the left, where a tall
 * tile computes more masked scores at both edges, and where the tile would not stay in the
 * thread's share of L2 (fa_cpu_l2_share; a 2 MB L2 keeps 256 rows at every head dim).
 * Causal alone keeps the tall tile: the key blocks skip the queries that see none of their keys,
 * and shorter tiles cost more K/V traffic than the diagonal saves.
 *
 * Up to 256 rows the choice depends on the shape and the cache only: a window bounded on the
 * left starts each tile's key blocks at its first row's first key, so there the height fixes
 * the order of the online softmax. Without one, every tile's blocks start at key 0 and a row's
 * scores, maxima, sums and products run through the same blocks in the same order whatever
 * the tile's height, so the fp32/fp64 tile may go to FA_CPU_FWD_BM_TALL rows where every
 * thread still gets FA_CPU_FWD_TALL_ITEMS of them: half the K/V rereads, while enough items
 * remain that the last wave does not wait on one slow core. The bf16 products keep 256 (their
 * scratch is laid out for it, and taller tiles were slower there).
 */
int64_t fa_plan_cpu_tile_rows(const fa_params *p, size_t l2, int bf16)
{
    const int tall = p->window_left < 0 && !bf16;
    int64_t bm = p->window_left >= 0 ? 128 : tall ? FA_CPU_FWD_BM_TALL : FA_CPU_FWD_BM_MAX;
    for (; bm > 64; bm /= 2) {
        if (fa_plan_cpu_tile_bytes(p, bm) > l2)
            continue;
        int64_t items = 0;
        for (int64_t i = 0; i < p->b; i++)
            items += (fa_params_seq(p, i).sq + bm - 1) / bm;
        const int64_t want =
            bm > FA_CPU_FWD_BM_MAX ? FA_CPU_FWD_TALL_ITEMS * p->num_threads : FA_CPU_MIN_ITEMS;
        if (items * p->h >= want)
            break;
    }
    return bm;
}

/*
 * Upstream's wave-efficiency rule, tightened for threads: the fewest chunks whose waves fill
 * the threads to within 2% of the best count (upstream: 85%, and no split once the items fill
 * 80% of the SMs), chunks keeping at least FA_KV_MIN_CHUNK keys. A GPU runs many blocks per SM
 * and hides a short last wave; an idle thread is 1/threads of the machine.
 */
int fa_plan_cpu_splits(int64_t threads, int64_t base_items, int64_t max_keys)
{
    if (base_items == 0)
        return 1;
    int64_t max_splits = (max_keys + FA_KV_MIN_CHUNK - 1) / FA_KV_MIN_CHUNK;
    if (max_splits > FA_MAX_SPLITS)
        max_splits = FA_MAX_SPLITS;
    if (max_splits <= 1)
        return 1;
    double eff[FA_MAX_SPLITS + 1], best = 0.0;
    for (int64_t s = 1; s <= max_splits; s++) {
        double work = (double)(base_items * s) / (double)threads;
        eff[s] = work / ceil(work);
        if (eff[s] > best)
            best = eff[s];
    }
    for (int64_t s = 1; s <= max_splits; s++)
        if (eff[s] >= 0.98 * best)
            return (int)s;
    return 1;
}

/* As many kv heads as fill the tile with the sq * g packed rows of each (at least one): with one
 * query row a thread streams through the adjacent heads of a key position; with more rows
 * each kv head's K/V is read once per tile. */
int64_t fa_plan_cpu_decode_heads(const fa_params *p, int64_t max_sq)
{
    const int64_t per_head = (max_sq > 0 ? max_sq : 1) * (p->h / p->hk);
    const int64_t heads = FA_CPU_DECODE_ROWS / per_head;
    return heads < 1 ? 1 : heads > p->hk ? p->hk : heads;
}

/* Enough chunks for FA_CPU_FEW_ITEMS items, chunks keeping at least FA_KV_MIN_CHUNK keys: with
 * that many equal items the last wave is short on any thread count, and the merge reads
 * splits x dv values per row, little beside the K/V rows of a chunk. */
int fa_plan_cpu_few_splits(int64_t base_items, int64_t max_keys)
{
    int64_t max_splits = (max_keys + FA_KV_MIN_CHUNK - 1) / FA_KV_MIN_CHUNK;
    if (max_splits > FA_MAX_SPLITS)
        max_splits = FA_MAX_SPLITS;
    if (base_items == 0 || max_splits <= 1)
        return 1;
    const int64_t want = (FA_CPU_FEW_ITEMS + base_items - 1) / base_items;
    return (int)(want < max_splits ? want : max_splits);
}

/* Keys per key-pass chunk: FA_CPU_BWD_NK, halved (down to a quarter of it) while the chunk's dK
 * and dV accumulators would not fit in the thread's share of L2 (on a 2 MB L2, every head dim
 * and type keeps FA_CPU_BWD_NK). */
static int64_t fa_plan_cpu_bwd_chunk_keys(size_t l2, size_t real_size, int64_t d_pad,
                                          int64_t dv_pad)
{
    const size_t row = (size_t)(d_pad + dv_pad) * real_size;
    int64_t nk = FA_CPU_BWD_NK;
    while (nk > FA_CPU_BWD_NK / 4 && (size_t)nk * row > l2)
        nk /= 2;
    return nk;
}

/*
 * The fused schedule's stripes (0: the two passes instead) and keys per chunk, from the shape
 * only, so that results never depend on the thread count. Fused needs FA_CPU_BWD_FUSED_ITEMS
 * items to keep the threads busy and aims for FA_CPU_BWD_STRIPE_ITEMS: (sequence, kv head)
 * pairs, times stripes of key chunks where the pairs are fewer, each stripe summing its share
 * of dQ in its own fp32 copy of q's size.
 * Chunks are fa_plan_cpu_bwd_chunk_keys, or half that where it takes that many to make the items (each
 * chunk packs its query tiles again, a smaller cost than the two passes' extra products). The
 * copies are bounded by FA_CPU_BWD_STRIPE_BYTES; past it the two passes run.
 */
int64_t fa_plan_cpu_bwd_stripes(const fa_params *p, size_t l2, size_t real_size, int64_t d_pad,
                                int64_t dv_pad, int64_t *chunk)
{
    const int64_t pairs = p->b * p->hk;
    const int64_t keys = fa_plan_cpu_bwd_chunk_keys(l2, real_size, d_pad, dv_pad);
    *chunk = keys;
    if (pairs >= FA_CPU_BWD_STRIPE_ITEMS)
        return 1;
    const double slot = (double)(p->total_q * p->h * d_pad) * (double)real_size;
    for (int64_t size = keys; size >= keys / 2; size /= 2) {
        const int64_t chunks = (p->max_sk + size - 1) / size;
        int64_t stripes = (FA_CPU_BWD_STRIPE_ITEMS + pairs - 1) / pairs;
        if (stripes > chunks)
            stripes = chunks;
        while (stripes > 1 && (double)stripes * slot > (double)FA_CPU_BWD_STRIPE_BYTES)
            stripes--;
        if (pairs * stripes >= FA_CPU_BWD_FUSED_ITEMS) {
            *chunk = size;
            return stripes;
        }
    }
    return 0;
}
