/*
 * What the GPU tests share: the driver, a seeded generator, and tensors that live both on the host
 * (inputs filled there, references computed there) and on the device, with the same strides.
 */
#ifndef GPU_TEST_UTIL_H
#define GPU_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda/fa_cuda_driver.h"
#include "flashattn.h"

/* The driver table: each test's main sets it once a device is known to be usable. */
extern const fa_cuda_driver *gu_drv;

#define CHECK_CU(expr)                                                                           \
    do {                                                                                         \
        fa_cu_result r_ = (expr);                                                                \
        if (r_ != 0) {                                                                           \
            fprintf(stderr, "FATAL %s:%d: %s -> %d\n", __FILE__, __LINE__, #expr, r_);           \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)

/* The start of a GPU test's main: stdout line-buffered (progress survives a timeout), gu_drv
 * set, the generator seeded and device 0's context made current. Returns 0, or the status the
 * test should exit with: 77 (skipped) without a usable device, 1 without a context. */
int gu_start(const char *test, uint64_t seed);

/* A failed check of case c (its name) in dtype dt, counted in the test's `failures`: the three
 * names the using function and file must have in scope. */
#define FAIL(...)                                                                                \
    do {                                                                                         \
        fprintf(stderr, "FAIL [%s %s] ", c->name, fa_dtype_name(dt));                            \
        fprintf(stderr, __VA_ARGS__);                                                            \
        fputc('\n', stderr);                                                                     \
        failures++;                                                                              \
    } while (0)

/* Uniform in [lo, hi) from a splitmix64 stream; gu_seed restarts it. */
void gu_seed(uint64_t seed);
double gu_uniform(double lo, double hi);

/* A host buffer and a device buffer of the same layout, viewed as the same tensor. */
typedef struct gpu_buf {
    fa_tensor host, dev;
    size_t bytes;
} gpu_buf;

/* shape[0 .. ndim) (ndim 1-4), the rows of the last dimension padded by pad elements; the host
 * copy starts as NaN (0xff bytes) in every float dtype, so padding must never be read. */
gpu_buf gu_buf_new(fa_dtype dt, int ndim, const int64_t *shape, int pad);
void gu_buf_free(gpu_buf *g);
void gu_buf_upload(gpu_buf *g);
void gu_buf_poison_device(gpu_buf *g); /* the device copy to 0xff bytes */
void *gu_buf_download(const gpu_buf *g); /* a malloc'd copy of the device buffer */

/* Element at of a buffer of dtype dt (fp16, bf16, fp32; anything else read as int32). */
double gu_elem_load(const void *base, fa_dtype dt, int64_t at);

/* Every element of the host copy uniform in [lo, hi). */
void gu_fill_uniform(gpu_buf *g, double lo, double hi);

/* Whether the next run (a test's runs in order, each with its estimated cost) is this
 * process's: with FA_TEST_SHARD=i/n, every process deals the runs out the same way, each to the
 * shard with the least cost so far, and takes shard i's (tests/gpu/run_sharded.sh runs the n
 * shards side by side: the CPU references, not the GPU, take the time, so the slowest shard
 * sets the run's length); without it, every run. */
int gu_shard_take(double cost);

/* Whether FA_TEST_ONLY=a|b|... (unset or empty: every case) selects a case of this name: one
 * of the '|'-separated parts is in it (for compute-sanitizer, whose slowdown the long cases
 * cannot afford, or one case alone). */
int gu_only(const char *name);

/* A run's estimated cost for gu_shard_take: the references' work, ~pairs of rows seen times
 * (d + dv), plus a fixed share for the GPU side. Costs measured for test_gpu_sm90's cases on
 * one core followed it within ~25% (bench/NOTES.md, ninth session). */
double gu_attn_cost(int b, int h, int sq, int sk, int d, int dv, int causal);

#endif /* GPU_TEST_UTIL_H */
