/*
 * Checks every attention call shares (the forward's, the backward's through it, and the KV
 * cache's), written once here with the same messages; the scoring options are fa_options_check
 * (fa_params.c), which stores them in the record.
 */
#ifndef FA_OPTIONS_H
#define FA_OPTIONS_H

#include <stdint.h>

#include "core/fa_error.h"

/* device: FA_DEVICE_CPU or a CUDA ordinal. */
fa_status fa_check_device(int device);

/* num_threads: >= 0, 0 for the backend's default (the backend clamps the count it uses). */
fa_status fa_check_threads(int num_threads);

/* lse's dtype: fp32, or fp64 when q is fp64. */
fa_status fa_check_lse_dtype(const fa_tensor *t, fa_dtype q_dtype);

/* lse of a dense problem: [b, h, sq], last dim contiguous, dtype as fa_check_lse_dtype. */
fa_status fa_check_lse_dense(const fa_tensor *t, fa_dtype q_dtype, int64_t b, int64_t h,
                             int64_t sq);

#endif /* FA_OPTIONS_H */
