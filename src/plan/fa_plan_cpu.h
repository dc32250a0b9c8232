/*
 * The CPU backend's size rules: the forward's tile height and when it takes the decode schedule,
 * the backward's key chunks and stripes, and the decode schedule's items and split count. Pure
 * functions of the problem and of the machine facts the backend passes in.
 */
#ifndef FA_PLAN_CPU_H
#define FA_PLAN_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "core/fa_params.h"

/* Largest forward tile of the shape-only rule: each tile reads its head's K/V once (fewer rows
 * on a small L2: fa_plan_cpu_tile_rows). */
#define FA_CPU_FWD_BM_MAX 256
/* The fp32/fp64 tile's height where every thread still gets FA_CPU_FWD_TALL_ITEMS tiles. */
#define FA_CPU_FWD_BM_TALL 512
#define FA_CPU_FWD_TALL_ITEMS 32
#define FA_CPU_BN 64 /* keys per block */
/* Tiles are shortened until the problem has this many work items (or they reach 64 rows). */
#define FA_CPU_MIN_ITEMS 64
/* Fewest keys per chunk the heuristic makes: below this the merge costs more than it gains. */
#define FA_KV_MIN_CHUNK 256

/* Query rows per forward work item for a thread's L2 share of l2 bytes; bf16: the bf16 product
 * kernels take the call. */
int64_t fa_plan_cpu_tile_rows(const fa_params *p, size_t l2, int bf16);

/* Key chunks per (sequence, kv head) of a KV-cache call: base_items of them before splitting,
 * max_keys the most keys a sequence attends to, on threads threads. */
int fa_plan_cpu_splits(int64_t threads, int64_t base_items, int64_t max_keys);

/* Packed (query row, head) rows per work item of the decode schedule (fa_cpu_decode.c). */
#define FA_CPU_DECODE_ROWS 64
/* Work items a forward on the decode schedule aims for by splitting the keys. */
#define FA_CPU_FEW_ITEMS 128

/* Kv heads per item of the decode schedule, for sequences of at most max_sq query rows. */
int64_t fa_plan_cpu_decode_heads(const fa_params *p, int64_t max_sq);

/* Key chunks per item of a forward on the decode schedule, from the shape only (so results
 * are the same bits for any thread count): base_items before splitting, max_keys the most keys
 * a sequence attends to. */
int fa_plan_cpu_few_splits(int64_t base_items, int64_t max_keys);

#define FA_CPU_BWD_FUSED_ITEMS 32 /* work items from which the backward runs fused */
/* Items the fused backward's stripes aim for: with many threads a slow core holds up the last
 * wave of equal items, and more, smaller items keep the threads busier for the same total
 * work, at the cost of more dQ copies to sum. */
#define FA_CPU_BWD_STRIPE_ITEMS 128
/* Below this many items, the last stripe of each (sequence, kv head) runs as two items of half
 * its query rows, queued last, so that the threads finish on items half as long; with more
 * items a thread the last wave costs little. Their dK/dV slots (2 x the last stripe's chunks)
 * must fit in the kept workspace with the dQ copies (FA_MEMORY_KEEP_MAX). */
#define FA_CPU_BWD_HALVES_BELOW (2 * FA_CPU_BWD_STRIPE_ITEMS)
/* Bound of the fused backward's dQ copies when it stripes key chunks (fa_plan_cpu_bwd_stripes). */
#define FA_CPU_BWD_STRIPE_BYTES ((size_t)256 << 20)
/* Keys per backward key-pass item (fewer on a small L2: fa_plan_cpu_bwd_chunk_keys). Query tiles are
 * packed once per item, so longer items transpose less; at 512 the item's dK/dV accumulators,
 * 512 KB at d128 fp32, still sit in a 2 MB L2. The bf16 backward on AMX is fastest at 512 too. */
#define FA_CPU_BWD_NK 512

/* The fused backward's stripes of key chunks per (sequence, kv head) (0: the two passes instead)
 * and, in *chunk, its keys per chunk, from the shape only (never the thread count, so results
 * are the same bits for any count). l2: a thread's L2 share; d_pad, dv_pad: the head dims as the
 * micro-kernels pad them; real_size: bytes of the accumulation type. */
int64_t fa_plan_cpu_bwd_stripes(const fa_params *p, size_t l2, size_t real_size, int64_t d_pad,
                                int64_t dv_pad, int64_t *chunk);

#endif /* FA_PLAN_CPU_H */
