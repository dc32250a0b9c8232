/* The CPU backend: its table for the API layer, its entry points, and the hooks its tests use. */
#ifndef FA_CPU_H
#define FA_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "core/fa_backend.h"
#include "core/fa_params.h"

/* The table the API layer dispatches FA_DEVICE_CPU calls through (fa_cpu_backend.c). Its entry
 * points give num_threads = 0 the default (fa_cpu_default_threads) before calling those below. */
extern const fa_backend fa_cpu_backend;

/* Entry points; p->num_threads >= 1. */
fa_status fa_cpu_forward(const fa_params *p);
fa_status fa_cpu_probs(const fa_params *p);
fa_status fa_cpu_backward(const fa_params *p);
fa_status fa_cpu_kvcache(const fa_params *p);
fa_status fa_cpu_combine(const fa_params *c);
/* fa_block_mask_build (fa_cpu_block_mask.c); p from fa_block_mask_args_check, its
 * num_threads set. */
fa_status fa_cpu_block_mask_build(const fa_params *p, const fa_block_mask_args *a);
/* The forward for fp8 inputs (fa_cpu_fp8.c). */
fa_status fa_cpu_forward_fp8(const fa_params *p);
/* The forward on the decode schedule (fa_cpu_decode.c), for fa_cpu_forward's few-row calls. */
fa_status fa_cpu_decode_forward(const fa_params *p);

/* For the tests: the most bytes of packed K/V one pass of the bf16 forward holds, so that small
 * problems take several passes (0: the default). Not thread-safe against running forwards. */
void fa_cpu_forward_set_pack_limit(size_t bytes);
/* Query rows per forward work item (fa_cpu_forward.c), exposed for the tests of its rule. */
int64_t fa_cpu_forward_tile_rows(const fa_params *p);

#endif /* FA_CPU_H */
