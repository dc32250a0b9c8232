/*
 * The arguments every attention call shares (the forward's, the backward's through it, and the
 * KV cache's), checked once here with the same messages.
 */
#ifndef FA_OPTIONS_H
#define FA_OPTIONS_H

#include <stdint.h>

#include "core/fa_error.h"

/* The scoring options after validation. */
typedef struct fa_options {
    double scale;
    double softcap;   /* 0: off */
    int causal;
    int window_left;  /* -1 unbounded */
    int window_right; /* -1 unbounded; 0 under causal */
} fa_options;

/* device: FA_DEVICE_CPU or a CUDA ordinal. */
fa_status fa_check_device(int device);

/* softmax_scale (NaN: d^-0.5), softcap (<= 0: off), causal and the window, for head dim d. */
fa_status fa_options_check(double softmax_scale, double softcap, int causal, int window_left,
                           int window_right, int64_t d, fa_options *o);

/* num_threads: >= 0, 0 for the backend's default (the backend clamps the count it uses). */
fa_status fa_check_threads(int num_threads);

/* lse's dtype: fp32, or fp64 when q is fp64. */
fa_status fa_check_lse_dtype(const fa_tensor *t, fa_dtype q_dtype);

/* lse of a dense problem: [b, h, sq], last dim contiguous, dtype as fa_check_lse_dtype. */
fa_status fa_check_lse_dense(const fa_tensor *t, fa_dtype q_dtype, int64_t b, int64_t h,
                             int64_t sq);

#endif /* FA_OPTIONS_H */
