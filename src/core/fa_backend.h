/*
 * What a backend provides: one table of entry points that src/cpu and src/cuda each fill and the
 * API layer calls after validation. A NULL slot is an entry point the backend lacks.
 */
#ifndef FA_BACKEND_H
#define FA_BACKEND_H

#include <stddef.h>

#include "core/fa_params.h"

typedef struct fa_backend {
    /* The forward, and the probabilities when p->probs is set. */
    fa_status (*forward)(const fa_params *p, const fa_fwd_args *args);
    /* Bytes of workspace the forward needs for p on args->device; NULL: none. */
    size_t (*forward_workspace_size)(const fa_params *p, const fa_fwd_args *args);
    fa_status (*backward)(const fa_params *p, const fa_bwd_args *args);
    /* Bytes of workspace the backward needs for p; NULL: none. */
    size_t (*backward_workspace_size)(const fa_params *p);
    /* Builds what the backward of a forward's p will need, ahead of it; NULL: nothing to do. */
    fa_status (*backward_prepare)(const fa_params *p, const fa_fwd_args *args);
    fa_status (*kvcache)(const fa_params *p, const fa_kvcache_args *args);
    /* Bytes of workspace the KV-cache call needs for p on args->device; NULL: none. */
    size_t (*kvcache_workspace_size)(const fa_params *p, const fa_kvcache_args *args);
    fa_status (*combine)(const fa_params *p, const fa_combine_args *args);
    /* A block mask from a mask program (p: fa_block_mask_args_check's); NULL: not here. */
    fa_status (*block_mask_build)(const fa_params *p, const fa_block_mask_args *args);
} fa_backend;

/* FA_STATUS_UNSUPPORTED naming the entry point, for the backend of device that lacks it. */
fa_status fa_backend_missing(int device, const char *entry);

#endif /* FA_BACKEND_H */
