/*
 * `flashattn bench`: the problem a user asked for on the command line, built into real tensors,
 * timed, and checked against the double-precision oracle.
 */
#ifndef FA_BENCH_H
#define FA_BENCH_H

#include <stdint.h>
#include <stdio.h>

#include "flashattn.h"

/* Exit codes of the command: 0 ok, 1 check failed or the library failed, 2 bad usage. */
enum { FA_EXIT_OK = 0, FA_EXIT_FAIL = 1, FA_EXIT_USAGE = 2 };

/* `flashattn bench ARGS...`: argv holds the words after "bench". Returns the exit status. */
int fa_bench_main(int argc, char **argv);

/* `flashattn peak`: the fp32 FMA rate of the cores (argv: the words after "peak"). */
int fa_peak_main(int argc, char **argv);

/* The fp32 FMA rate of `threads` threads with `lanes`-wide vectors, GFLOP/s (0 on failure), and
 * the widest vectors the CPU has (16, 8, or 0 without AVX2). */
double fa_peak_gflops(int threads, int lanes);
int fa_peak_lanes(void);

/* `flashattn gemm`: the forward's fp32 micro-kernel products timed alone, one thread. */
int fa_gemm_bench_main(int argc, char **argv);

/* `flashattn bench --decode ARGS...` (fa_bench_decode.c): times fa_attention_kvcache. */
int fa_bench_decode_main(int argc, char **argv);

typedef struct fa_bench_config {
    int64_t batch, heads, kv_heads;
    int64_t seqlen_q, seqlen_k;
    int64_t head_dim, head_dim_v;
    fa_dtype dtype;
    int causal;
    int64_t window_left, window_right; /* -1: unbounded */
    double softcap;                    /* 0: off */
    int alibi, sinks, varlen;
    double dropout_p;
    int64_t threads; /* 0: the library's default */
    int64_t iters, warmup;
    uint64_t seed;
    int check;
    int device; /* FA_DEVICE_CPU or a CUDA ordinal */
    int bwd;    /* --bwd: time (and check) fa_attention_backward too */
} fa_bench_config;

/* Fills cfg from argv (the words after "bench"). Returns FA_EXIT_OK, FA_EXIT_USAGE after printing
 * why to stderr, or -1 when --help was asked for. */
int fa_bench_config_parse(int argc, char **argv, fa_bench_config *cfg);
void fa_bench_usage(FILE *f);

/* "causal window=(L,R) softcap=X alibi sinks dropout=P varlen", or "none". */
void fa_bench_features_format(const fa_bench_config *cfg, char *dst, size_t size);

/* The inputs and outputs of one call, owned by the bench. */
typedef struct fa_bench_problem {
    fa_tensor q, k, v, out, lse;
    fa_tensor cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks;
    fa_fwd_args args;
    int64_t tokens_q; /* rows of q: b * sq dense, total_q varlen */
    double max_abs_v; /* the scale of the outputs, for tolerances relative to it */
    void *buffers[9];
    int num_buffers;
} fa_bench_problem;

/* Allocates and fills the problem with seeded random values; FA_EXIT_OK or FA_EXIT_FAIL. */
int fa_bench_problem_init(fa_bench_problem *p, const fa_bench_config *cfg);
void fa_bench_problem_free(fa_bench_problem *p);

/* Fills every element of out (and lse) with NaN, so that an element the kernel never writes
 * shows up in the check. */
void fa_bench_outputs_poison(const fa_bench_problem *p);

/* (query, key) pairs that the mask leaves visible, summed over the sequences of one head. */
double fa_bench_visible_pairs(const fa_fwd_args *args);

typedef struct fa_bench_check_result {
    int pass;
    int64_t tokens_checked;
    int64_t unwritten;       /* non-finite elements of out, or NaN in lse, over every row */
    double out_err;          /* max |out - ref| on the checked tokens */
    double out_tol;
    double lse_err, lse_tol; /* max |lse - ref| over finite entries; inf-ness must match */
    char criterion[160];     /* how out_tol was chosen, in words */
} fa_bench_check_result;

/* Compares out and lse against the oracle; FA_EXIT_OK when the oracle ran, else FA_EXIT_FAIL. */
int fa_bench_check(const fa_bench_problem *p, const fa_bench_config *cfg,
                   fa_bench_check_result *r);

/* --bwd (fa_bench_bwd.c): times fa_attention_backward on the problem after its forward ran (out,
 * lse) and checks dq, dk, dv (dsinks) against fa_ref_backward when the problem is small enough;
 * prints the details. bwd FLOPs are 2.5 x fwd_flop (FlashAttention's convention). */
typedef struct fa_bench_bwd_result {
    double mean_s, min_s;
    const char *verdict; /* "PASS", "FAIL" or "skipped" */
} fa_bench_bwd_result;
int fa_bench_bwd_run(const fa_bench_problem *p, const fa_bench_config *cfg,
                     fa_bench_bwd_result *r, double fwd_flop);
/* The "bwd ..." and "fwd+bwd ..." summary lines. */
void fa_bench_bwd_summary(const fa_bench_config *cfg, const char *shape, const char *features,
                          double fwd_s, double fwd_flop, const fa_bench_bwd_result *r);

/* Walks a tensor's elements in row-major order: idx starts at zeros and is advanced in place. */
void fa_bench_index_next(const fa_tensor *t, int64_t *idx);
int64_t fa_bench_numel(const fa_tensor *t);

#endif /* FA_BENCH_H */
