/*
 * The CPU backend's size rules: the forward's tile height and the KV-cache attention's split
 * count. Pure functions of the problem and of the machine facts the backend passes in.
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

#endif /* FA_PLAN_CPU_H */
