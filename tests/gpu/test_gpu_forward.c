/*
 * GPU forward against the CPU backend and the double oracle, on the same random inputs:
 *   out:   max|gpu - ref| <= 2 * max|naive same-dtype - ref| + floor   (upstream's criterion)
 *   lse:   within 2e-3 of the oracle, +inf exactly where the oracle has it
 *   probs: within one rounding of the CPU's, with the same signs (the same dropout mask)
 *   every output element written, nothing written outside the views, and a second run bitwise
 *   identical to the first.
 * Exits 77 (skipped) when no CUDA device is usable.
 *
 * test_gpu_forward runs the sm80 family on every device (FLASHATTN_SM90=0). Built a second time
 * with FA_TEST_SM90 as test_gpu_sm90: the default plan on the cases the sm90 family
 * (kernels/fa_fwd_sm90.cu) supports, each checked to have run on that family, plus cases it does
 * not support, checked to have gone to the sm80 family (on sm_90 devices; elsewhere every case
 * must take the sm80 family). Both also run gpu_nan.c's NaN and Inf cases against the CPU, and
 * gpu_paged.c's paged varlen calls (block_table), which take the sm80 family on every device.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/fa_cuda.h"
#include "cuda/fa_cuda_driver.h"
#include "fa_ref.h"
#include "gpu_nan.h"
#include "gpu_paged.h"
#include "gpu_test_util.h"
#include "util/fa_half.h"

typedef struct gpu_case {
    const char *name;
    int b, h, hk, sq, sk, d, dv;
    int causal, wl, wr;
    double softcap;
    int alibi, sinks;
    double dropout;
    int varlen, seqused, probs, pad;
} gpu_case;

#ifdef FA_TEST_SM90
#define FA_TEST_NAME "test_gpu_sm90"
#else
#define FA_TEST_NAME "test_gpu_forward"
static const gpu_case gpu_cases[] = {
    {"dense d64", 2, 4, 4, 257, 257, 64, 64, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"causal d128 sq<sk", 2, 4, 4, 300, 517, 128, 128, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"gqa window d96 padded", 1, 8, 2, 333, 290, 96, 96, 0, 32, 16, 0, 0, 0, 0, 0, 0, 0, 8},
    {"mqa unaligned d37 dv24", 2, 6, 1, 70, 150, 37, 24, 0, 50, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"softcap alibi sinks d128", 1, 4, 2, 200, 200, 128, 128, 1, -1, -1, 30, 1, 1, 0, 0, 0, 0, 0},
    {"dropout probs causal d64", 2, 3, 3, 129, 300, 64, 64, 1, -1, -1, 0, 0, 0, 0.17, 0, 0, 1, 0},
    {"varlen seqused alibi causal", 4, 4, 2, 190, 260, 128, 128, 1, -1, -1, 0, 1, 0, 0, 1, 1, 0, 0},
    {"varlen dropout probs d256", 3, 2, 2, 90, 140, 256, 256, 0, 40, 40, 0, 0, 1, 0.3, 1, 0, 1, 0},
    {"decode sq1 gqa", 3, 8, 2, 1, 1000, 128, 128, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    /* Few rows: the decode schedule (packed GQA, split over the keys), every scoring option. */
    {"few rows sq16 gqa4 causal softcap", 2, 16, 4, 16, 3000, 128, 128, 1, -1, -1, 20, 0, 0, 0, 0, 0, 0, 0},
    {"few rows sq5 window alibi sinks", 1, 8, 2, 5, 2500, 64, 64, 0, 300, 2, 0, 1, 1, 0, 0, 0, 0, 0},
    {"few rows sq3 mqa d256 sq>sk", 2, 4, 1, 3, 2, 256, 256, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"few rows sq2 unaligned d40 dv24 padded", 2, 6, 3, 2, 700, 40, 24, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 8},
    /* Varlen few rows: sequences located from cu_seqlens in the decode kernels, rows outside
     * every sequence filled, an empty sequence (run_case's varlen lengths). */
    {"few rows varlen sq7 gqa4 causal seqused", 6, 16, 4, 7, 900, 128, 128, 1, -1, -1, 0, 0, 0, 0, 1, 1, 0, 0},
    {"few rows varlen sq1 window alibi sinks d64", 5, 8, 2, 1, 2000, 64, 64, 0, 100, 0, 0, 1, 1, 0, 1, 0, 0, 0},
    {"few rows varlen sq16 unaligned d40 dv24 softcap", 3, 6, 3, 16, 500, 40, 24, 1, -1, -1, 15, 0, 0, 0, 1, 0, 0, 0},
    /* MLA's decode shape (d 576 / dv 512, one kv head) as a few-row forward, dense and varlen */
    {"few rows mla sq1 mqa16 d576 dv512", 2, 16, 1, 1, 1200, 576, 512, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"few rows varlen mla sq2 mqa32 causal", 3, 32, 1, 2, 700, 576, 512, 1, -1, -1, 0, 0, 0, 0, 1, 0, 0, 0},
    /* Heads past FA_CUDA_MAX_HEAD_DIM at any row count: the decode schedule, 64 packed rows a
     * tile (several tiles a kv head, each its own causal key range), v's columns in slices. */
    {"wide mla sq40 mqa16 causal", 2, 16, 1, 40, 300, 576, 512, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"wide varlen mla sq33 gqa8 causal", 3, 16, 2, 33, 200, 576, 512, 1, -1, -1, 0, 0, 0, 0, 1, 0, 0, 0},
    {"wide d320 sq100 window softcap alibi sinks", 1, 4, 4, 100, 260, 320, 320, 0, 64, 8, 25, 1, 1, 0, 0, 0, 0, 0},
    {"wide d288 dv40 sq>sk causal", 2, 6, 3, 70, 50, 288, 40, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"sq>sk causal empty rows d32", 2, 2, 2, 200, 60, 32, 32, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"empty rows with sinks", 1, 3, 3, 150, 40, 64, 64, 1, -1, -1, 0, 0, 1, 0, 0, 0, 0, 0},
    {"d192 dv128 window-left", 1, 4, 4, 400, 700, 192, 128, 0, 100, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"d256 long", 1, 2, 2, 1024, 1024, 256, 256, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"d80 softcap dropout-free probs", 1, 2, 1, 100, 333, 80, 80, 0, -1, -1, 20, 0, 0, 0, 0, 0, 1, 0},
    /* The quad-shared Philox with 4 and 8 n-tiles per block (d128: 32 keys, d32: 128 keys). */
    {"dropout probs d128 window", 2, 2, 2, 140, 333, 128, 128, 0, 60, 30, 0, 0, 0, .25, 0, 0, 1, 0},
    {"dropout probs d32 sq>sk", 1, 3, 1, 300, 200, 32, 32, 1, -1, -1, 0, 0, 1, 0.4, 0, 0, 1, 0},
    /* d192: 24 chunks per row, the per-chunk copy path; several full K/V blocks. */
    {"d192 long causal", 1, 2, 1, 700, 900, 192, 192, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
};

/* A softmax scale <= 0 takes the prescaled softmax (the max of scale * s is not scale * max s,
 * and a masked -inf times the scale is not -inf). */
static const struct {
    gpu_case c;
    double scale;
} scale_cases[] = {
    {{"negative scale causal d64", 2, 2, 2, 150, 190, 64, 64, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
     -0.1},
    {{"zero scale d128 sinks", 1, 2, 2, 70, 90, 128, 128, 0, -1, -1, 0, 0, 1, 0, 0, 0, 0, 0}, 0.0},
};
#endif

#ifdef FA_TEST_SM90
/* Every head dim row (32 and 80/96 padded up to 64/128, 192, 256) and d != dv, causal or not,
 * windows, GQA/MQA, softcap, ALiBi, sinks, dropout, empty rows, padded rows, several wraps of the stage
 * ring; sm90 = 1 where the sm90 family must run the case on sm_90. */
static const struct {
    gpu_case c;
    int sm90;
} sm90_cases[] = {
    {{"sm90 dense d64", 2, 4, 4, 257, 257, 64, 64, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    {{"sm90 causal d128 sq<sk", 2, 4, 4, 300, 517, 128, 128, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    {{"sm90 gqa window d128 padded", 1, 8, 2, 333, 290, 128, 128, 0, 32, 16, 0, 0, 0, 0, 0, 0, 0, 8}, 1},
    {{"sm90 decode sq1 gqa d128", 3, 8, 2, 1, 1000, 128, 128, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    {{"sm90 sq>sk causal empty d64", 2, 2, 2, 200, 60, 64, 64, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    {{"sm90 empty rows sinks d64", 1, 3, 3, 150, 40, 64, 64, 1, -1, -1, 0, 0, 1, 0, 0, 0, 0, 0}, 1},
    {{"sm90 long causal mqa d128", 1, 4, 1, 1000, 1100, 128, 128, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    {{"sm90 long d64 ring wraps", 2, 2, 2, 700, 1300, 64, 64, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    {{"sm90 window-left d128", 1, 4, 4, 400, 700, 128, 128, 0, 100, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    /* Unmasked from FA_PLAN_LONG_ROWS_UNMASKED rows: the long plan (three consumers at d 64,
     * a partial last tile of 192 rows). */
    {{"sm90 unmasked long gqa softcap sinks d64", 1, 4, 2, 2100, 2050, 64, 64, 0, -1, -1, 30, 0, 1, 0, 0, 0, 0, 0}, 1},
    /* Routed to sm80: another head dim, softcap, probs, varlen. */
    {{"sm90 d96 padded causal", 1, 4, 2, 200, 300, 96, 96, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    {{"sm90 softcap d128", 1, 4, 2, 200, 200, 128, 128, 1, -1, -1, 30, 0, 0, 0, 0, 0, 0, 0}, 1},
    {{"sm90 alibi sinks gqa d64", 2, 6, 2, 230, 410, 64, 64, 1, -1, -1, 0, 1, 1, 0, 0, 0, 0, 0}, 1},
    {{"sm90 softcap alibi window d256", 1, 4, 2, 333, 517, 256, 256, 0, 90, 40, 25, 1, 0, 0, 0, 0, 0, 0}, 1},
    {{"sm90 d192 long causal ring", 1, 2, 1, 700, 900, 192, 192, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    {{"sm90 d256 long wraps", 1, 2, 2, 1024, 1100, 256, 256, 0, -1, -1, 0, 0, 1, 0, 0, 0, 0, 0}, 1},
    {{"sm90 d32 padded sq>sk", 2, 2, 2, 200, 60, 32, 32, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    {{"sm90 d80 decode", 4, 8, 1, 1, 777, 80, 80, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    /* More tiles than the H200's 132 SMs without causal or window: persistent CTAs take several
     * tiles each. */
    {{"sm90 persistent gqa d64", 3, 24, 6, 300, 170, 64, 64, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    {{"sm90 persistent sinks d128", 1, 70, 10, 250, 90, 128, 128, 0, -1, -1, 0, 0, 1, 0, 0, 0, 0, 0}, 1},
    {{"sm90 persistent d256", 1, 140, 140, 64, 100, 256, 256, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    /* Varlen: random lengths with an empty sequence, rows outside every sequence, key blocks
     * that end inside the next sequence (its V rows must not reach P V). */
    {{"sm90 varlen causal d128", 3, 4, 2, 190, 260, 128, 128, 1, -1, -1, 0, 0, 0, 0, 1, 0, 0, 0}, 1},
    {{"sm90 varlen seqused alibi d64", 4, 4, 2, 400, 520, 64, 64, 0, -1, -1, 0, 1, 0, 0, 1, 1, 0, 0}, 1},
    {{"sm90 varlen window sinks d256", 3, 2, 1, 300, 333, 256, 256, 0, 70, 20, 0, 0, 1, 0, 1, 0, 0, 0}, 1},
    {{"sm90 varlen softcap gqa d192", 4, 6, 3, 260, 700, 192, 192, 1, -1, -1, 15, 0, 0, 0, 1, 0, 0, 0}, 1},
    /* d != dv: V's stages, the P V product, O and its stores dv wide (DeepSeek's MLA prefill,
     * d 192 / dv 128, on its grown 128-key tile), each padded to 64 on its own. */
    {{"sm90 d192 dv128", 2, 4, 4, 300, 517, 192, 128, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    {{"sm90 d192 dv128 causal ring", 1, 4, 2, 700, 900, 192, 128, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    {{"sm90 varlen d192 dv128 causal", 4, 4, 2, 260, 700, 192, 128, 1, -1, -1, 0, 0, 0, 0, 1, 1, 0, 0}, 1},
    {{"sm90 gqa window d192 dv128 padded", 1, 8, 2, 333, 290, 192, 128, 0, 32, 16, 0, 0, 0, 0, 0, 0, 0, 8}, 1},
    {{"sm90 softcap alibi sinks d192 dv128", 1, 4, 2, 200, 333, 192, 128, 1, -1, -1, 30, 1, 1, 0, 0, 0, 0, 0}, 1},
    {{"sm90 persistent mqa d192 dv128", 1, 140, 1, 64, 100, 192, 128, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    {{"sm90 d128 dv64", 1, 2, 2, 100, 180, 128, 64, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    {{"sm90 window-left d64 dv256", 1, 4, 4, 400, 700, 64, 256, 0, 100, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 1},
    {{"sm90 varlen window d256 dv64", 3, 2, 1, 300, 333, 256, 64, 0, 70, 20, 0, 0, 1, 0, 1, 0, 0, 0}, 1},
    {{"sm90 d96 dv160 padded causal", 1, 4, 2, 200, 300, 96, 160, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 8}, 1},
    {{"sm90 d40 dv24 padded sq>sk", 2, 2, 2, 200, 60, 40, 24, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 8}, 1},
    /* Dropout: the mask of the CPU backend bit for bit, or out misses the oracle. 32-key chunks
     * (d64, d128), d192's 112-key block ending in a half chunk, d256's 64-key block; chunks
     * no row sees (causal, window, varlen ends) skipped; short key ranges where one wrong keep
     * bit moves out past the bound. */
    {{"sm90 dropout d128", 1, 2, 2, 100, 180, 128, 128, 0, -1, -1, 0, 0, 0, 0.2, 0, 0, 0, 0}, 1},
    {{"sm90 dropout causal d64", 2, 3, 3, 257, 300, 64, 64, 1, -1, -1, 0, 0, 0, 0.17, 0, 0, 0, 0}, 1},
    {{"sm90 dropout window gqa d128", 2, 8, 2, 333, 290, 128, 128, 0, 60, 30, 0, 0, 0, 0.25, 0, 0, 0, 8}, 1},
    {{"sm90 dropout alibi sinks d192", 1, 4, 2, 150, 100, 192, 192, 0, -1, -1, 0, 1, 1, 0.3, 0, 0, 0, 0}, 1},
    {{"sm90 dropout causal mqa d192", 1, 4, 1, 300, 500, 192, 192, 1, -1, -1, 0, 0, 0, 0.1, 0, 0, 0, 0}, 1},
    {{"sm90 dropout causal d256", 1, 4, 2, 300, 333, 256, 256, 1, -1, -1, 0, 0, 0, 0.1, 0, 0, 0, 0}, 1},
    {{"sm90 dropout sq>sk empty d80", 2, 2, 2, 200, 60, 80, 80, 1, -1, -1, 0, 0, 1, 0.4, 0, 0, 0, 0}, 1},
    {{"sm90 dropout decode sq1 d64", 3, 8, 2, 1, 700, 64, 64, 1, -1, -1, 0, 0, 0, 0.15, 0, 0, 0, 0}, 1},
    {{"sm90 varlen dropout alibi gqa d128", 4, 4, 2, 300, 420, 128, 128, 1, -1, -1, 0, 1, 0, 0.2, 1, 1, 0, 0}, 1},
    {{"sm90 varlen dropout window d256", 3, 2, 1, 300, 333, 256, 256, 0, 70, 20, 0, 0, 0, 0.3, 1, 0, 0, 0}, 1},
    {{"sm90 varlen dropout d192", 3, 4, 4, 200, 260, 192, 192, 0, -1, -1, 0, 0, 0, 0.05, 1, 0, 0, 0}, 1},
    /* dropout_p within 1/512 of 1: a keep threshold of 0, every key dropped. */
    {{"sm90 dropout p~1 d64", 1, 2, 2, 90, 130, 64, 64, 0, -1, -1, 0, 0, 0, 0.99999, 0, 0, 0, 0}, 1},
    /* Cases the family does not take: the sm80 family runs them. */
    {{"sm90->sm80 probs d64", 1, 2, 2, 129, 300, 64, 64, 1, -1, -1, 0, 0, 0, 0, 0, 0, 1, 0}, 0},
    {{"sm90->sm80 unaligned d192 dv100", 1, 2, 1, 70, 150, 192, 100, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 0},
    {{"sm90->sm80 dropout probs d128", 1, 2, 2, 100, 180, 128, 128, 0, -1, -1, 0, 0, 0, 0.2, 0, 0, 1, 0}, 0},
    {{"sm90->sm80 unaligned d37", 1, 2, 1, 70, 150, 37, 37, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0}, 0},
};
/* Plans the rows take only for some shapes, forced with FLASHATTN_SM90_TILE=BN,STAGES,PINGPONG,
 * PERSISTENT,CONSUMERS on sizes the CPU reference affords: persistent CTAs over mirrored pairs of
 * query tiles (PERSISTENT 2) under causal and a window, with more pairs than SMs and an odd tile
 * count (a lone middle tile), a window past FA_SM90_PAIRED_MAX_TILES tiles; one CTA per causal tile (the choice above
 * FA_SM90_PAIRED_MAX_TILES); three consumer warpgroups (192-row tiles, head dim 64 from
 * FA_PLAN_LONG_ROWS on), dense persistent, causal paired, and varlen. */
static const struct {
    gpu_case c;
    const char *tile;
} sm90_tile_cases[] = {
    {{"sm90 paired causal gqa d128", 2, 40, 8, 640, 640, 128, 128, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
     "128,2,1,2,2"},
    {{"sm90 paired window odd d64", 1, 64, 16, 600, 650, 64, 64, 0, 100, 20, 0, 0, 1, 0, 0, 0, 0, 0},
     "128,4,0,2,2"},
    /* Windows pair past FA_SM90_PAIRED_MAX_TILES: 65 tiles, a lone middle one. */
    {{"sm90 paired window 65 tiles d64", 1, 2, 1, 8300, 8350, 64, 64, 0, 100, 20, 0, 0, 1, 0, 0, 0, 0, 0},
     "128,4,0,2,2"},
    {{"sm90 per-tile causal gqa d128", 2, 40, 8, 640, 640, 128, 128, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
     "128,2,1,1,2"},
    {{"sm90 3 consumers persistent d64", 2, 48, 12, 500, 530, 64, 64, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
     "128,4,0,1,3"},
    {{"sm90 3 consumers paired causal d64", 1, 96, 8, 700, 760, 64, 64, 1, -1, -1, 0, 1, 1, 0, 0, 0, 0, 0},
     "128,4,0,2,3"},
    {{"sm90 3 consumers varlen softcap d64", 4, 4, 2, 400, 520, 64, 64, 1, -1, -1, 20, 0, 0, 0, 1, 1, 0, 0},
     "128,4,0,1,3"},
    /* Dense softcap on three consumers: the chained tanh (FA_FWD_TANH_CHAIN) over whole blocks. */
    {{"sm90 3 consumers paired causal softcap alibi d64", 1, 32, 8, 600, 650, 64, 64, 1, -1, -1, 30, 1, 0, 0, 0, 0, 0, 0},
     "128,4,0,2,3"},
    /* Key blocks that end in a lone 16-column Philox block (80) or a chunk of one (112). */
    {{"sm90 dropout causal bn80 d64", 2, 3, 3, 257, 300, 64, 64, 1, -1, -1, 0, 0, 0, 0.17, 0, 0, 0, 0},
     "80,2,0,1,2"},
    {{"sm90 dropout window bn112 d128", 1, 4, 2, 200, 333, 128, 128, 0, 90, 40, 0, 1, 0, 0.3, 0, 0, 0, 0},
     "112,2,1,1,2"},
    /* Three consumers store O in 4-byte pieces, up to dv's columns of the padded 64. */
    {{"sm90 3 consumers d64 dv40 padded", 1, 8, 2, 450, 500, 64, 40, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 8},
     "128,4,0,1,3"},
    /* d 192 / dv 128 with d 192's own key block (the 112 its row had before growing). */
    {{"sm90 d192 dv128 112 keys paired causal", 1, 24, 4, 640, 640, 192, 128, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
     "112,2,1,2,2"},
    {{"sm90 3 consumers paired dropout d64", 1, 64, 8, 600, 650, 64, 64, 1, -1, -1, 0, 1, 0, 0.2, 0, 0, 0, 0},
     "128,4,0,2,3"},
    {{"sm90 persistent dropout gqa d128", 2, 40, 8, 300, 290, 128, 128, 0, -1, -1, 0, 0, 0, 0.1, 0, 0, 0, 0},
     "128,2,1,1,2"},
};
static const struct {
    gpu_case c;
    double scale;
} sm90_scale_cases[] = {
    {{"sm90 negative scale causal d64", 2, 2, 2, 150, 190, 64, 64, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
     -0.1},
    {{"sm90 zero scale d128 sinks", 1, 2, 2, 70, 90, 128, 128, 0, -1, -1, 0, 0, 1, 0, 0, 0, 0, 0}, 0.0},
};
#endif

static int failures;
/* The family each GPU run must have taken (NULL: not checked). */
static const char *expect_family;

/* scale: NULL for the default softmax scale. */
/* FA_TEST_ONLY and FA_TEST_SHARD as gu_only and gu_shard_take say. */
static int case_selected(const gpu_case *c)
{
    return gu_shard_take(gu_attn_cost(c->b, c->h, c->sq, c->sk, c->d, c->dv, c->causal)) &&
           gu_only(c->name);
}

static void run_case(const gpu_case *c, fa_dtype dt, const double *scale)
{
    if (!case_selected(c))
        return;
    const int vl = c->varlen;
    int32_t cu_q[9], cu_k[9], used[8];
    int64_t total_q = (int64_t)c->b * c->sq, total_k = (int64_t)c->b * c->sk;
    int64_t max_q = c->sq, max_k = c->sk;
    if (vl) {
        /* Random lengths with an empty sequence, and rows outside every sequence at both ends. */
        cu_q[0] = 3;
        cu_k[0] = 5;
        max_q = max_k = 1;
        for (int i = 0; i < c->b; i++) {
            int lq = i == 1 ? 0 : (int)gu_uniform(1, c->sq + 1);
            int lk = (int)gu_uniform(1, c->sk + 1);
            cu_q[i + 1] = cu_q[i] + lq;
            cu_k[i + 1] = cu_k[i] + lk;
            used[i] = c->seqused ? (int)gu_uniform(0, lk + 1) : lk;
            max_q = lq > max_q ? lq : max_q;
            max_k = lk > max_k ? lk : max_k;
        }
        total_q = cu_q[c->b] + 4;
        total_k = cu_k[c->b] + 2;
    }
    int64_t sq_shape[4] = {c->b, c->sq, c->h, c->d}, sk_shape[4] = {c->b, c->sk, c->hk, c->d};
    int64_t sv_shape[4] = {c->b, c->sk, c->hk, c->dv}, so_shape[4] = {c->b, c->sq, c->h, c->dv};
    if (vl) {
        int64_t q3[3] = {total_q, c->h, c->d}, k3[3] = {total_k, c->hk, c->d};
        int64_t v3[3] = {total_k, c->hk, c->dv}, o3[3] = {total_q, c->h, c->dv};
        memcpy(sq_shape, q3, sizeof q3);
        memcpy(sk_shape, k3, sizeof k3);
        memcpy(sv_shape, v3, sizeof v3);
        memcpy(so_shape, o3, sizeof o3);
    }
    int nd = vl ? 3 : 4;
    gpu_buf q = gu_buf_new(dt, nd, sq_shape, c->pad), k = gu_buf_new(dt, nd, sk_shape, c->pad);
    gpu_buf v = gu_buf_new(dt, nd, sv_shape, c->pad), o = gu_buf_new(dt, nd, so_shape, c->pad);
    int64_t lse_shape[3] = {c->b, c->h, c->sq}, lse_v[2] = {c->h, total_q};
    gpu_buf lse = vl ? gu_buf_new(FA_DTYPE_F32, 2, lse_v, 0)
                     : gu_buf_new(FA_DTYPE_F32, 3, lse_shape, 0);
    int64_t pshape[4] = {c->b, c->h, max_q + 3, max_k + 5};
    gpu_buf pr = gu_buf_new(dt, 4, c->probs ? pshape : (int64_t[4]){1, 1, 1, 1}, 0);
    int64_t hs[1] = {c->h}, bs[1] = {c->b + 1}, us[1] = {c->b};
    gpu_buf al = gu_buf_new(FA_DTYPE_F32, 1, hs, 0), sk = gu_buf_new(FA_DTYPE_F32, 1, hs, 0);
    gpu_buf cq = gu_buf_new(FA_DTYPE_I32, 1, bs, 0), ck = gu_buf_new(FA_DTYPE_I32, 1, bs, 0);
    gpu_buf su = gu_buf_new(FA_DTYPE_I32, 1, us, 0);
    gu_fill_uniform(&q, -1, 1);
    gu_fill_uniform(&k, -1, 1);
    gu_fill_uniform(&v, -1, 1);
    gu_fill_uniform(&al, 0.01, 0.3);
    gu_fill_uniform(&sk, -1, 2);
    memcpy(cq.host.data, cu_q, sizeof(int32_t) * (size_t)(c->b + 1));
    memcpy(ck.host.data, cu_k, sizeof(int32_t) * (size_t)(c->b + 1));
    memcpy(su.host.data, used, sizeof(int32_t) * (size_t)c->b);
    gpu_buf *inputs[] = {&q, &k, &v, &al, &sk, &cq, &ck, &su};
    for (size_t i = 0; i < sizeof inputs / sizeof inputs[0]; i++)
        gu_buf_upload(inputs[i]);

    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.causal = c->causal;
    a.window_left = c->wl;
    a.window_right = c->wr;
    a.softcap = c->softcap;
    if (scale)
        a.softmax_scale = *scale;
    a.dropout_p = c->dropout;
    a.seed = 0x5eed0000ull + (uint64_t)c->b;
    a.offset = 77;
    a.max_seqlen_q = max_q;
    a.max_seqlen_k = max_k;
    fa_fwd_args host = a, dev = a;
    host.q = &q.host, host.k = &k.host, host.v = &v.host, host.out = &o.host, host.lse = &lse.host;
    dev.q = &q.dev, dev.k = &k.dev, dev.v = &v.dev, dev.out = &o.dev, dev.lse = &lse.dev;
    if (vl) {
        host.cu_seqlens_q = &cq.host, host.cu_seqlens_k = &ck.host;
        dev.cu_seqlens_q = &cq.dev, dev.cu_seqlens_k = &ck.dev;
        if (c->seqused)
            host.seqused_k = &su.host, dev.seqused_k = &su.dev;
    }
    if (c->alibi)
        host.alibi_slopes = &al.host, dev.alibi_slopes = &al.dev;
    if (c->sinks)
        host.sinks = &sk.host, dev.sinks = &sk.dev;
    if (c->probs)
        host.probs = &pr.host, dev.probs = &pr.dev;
    dev.device = 0;

    /* The oracle and the naive same-dtype baseline, then the CPU backend (for probs). */
    size_t n_out = (size_t)(vl ? total_q : total_q) * (size_t)c->h * (size_t)c->dv;
    double *ref = malloc(n_out * sizeof(double)), *naive = malloc(n_out * sizeof(double));
    double *ref_lse = malloc((size_t)total_q * (size_t)c->h * sizeof(double));
    if (fa_ref_forward(&host, 1, ref, ref_lse) != 0 || fa_ref_forward_lowp(&host, naive) != 0)
        FAIL("oracle refused the case");
    if (fa_attention_forward(&host) != FA_STATUS_OK)
        FAIL("CPU forward: %s", fa_last_error());
    void *probs_cpu = c->probs ? malloc(pr.bytes) : NULL;
    if (probs_cpu)
        memcpy(probs_cpu, pr.host.data, pr.bytes);

    /* The decode schedule's split partials (other calls need none). */
    fa_cu_deviceptr ws = 0;
    const size_t ws_size = fa_attention_forward_workspace_size(&dev);
    if (ws_size) {
        CHECK_CU(gu_drv->mem_alloc(&ws, ws_size));
        dev.workspace = (void *)(uintptr_t)ws, dev.workspace_size = ws_size;
    }
    void *first_out = NULL, *first_lse = NULL, *first_probs = NULL;
    for (int run = 0; run < 2; run++) {
        gu_buf_poison_device(&o);
        gu_buf_poison_device(&lse);
        gu_buf_poison_device(&pr);
        fa_status st = fa_attention_forward(&dev);
        if (st != FA_STATUS_OK) {
            FAIL("GPU forward: %s", fa_last_error());
            break;
        }
        CHECK_CU(gu_drv->ctx_synchronize());
        /* Few-row calls, and heads past FA_CUDA_MAX_HEAD_DIM, take the decode schedule,
         * whatever the family under test. */
        const int wide = c->d > FA_CUDA_MAX_HEAD_DIM || c->dv > FA_CUDA_MAX_HEAD_DIM;
        const char *want = (max_q <= FA_DECODE_MAX_ROWS || wide) && c->dropout <= 0 && !c->probs
                               ? "fa_decode.cu"
                               : expect_family;
        if (want && strcmp(fa_cuda_last_family(), want) != 0)
            FAIL("ran on %s, expected %s", fa_cuda_last_family(), want);
        void *go = gu_buf_download(&o), *gl = gu_buf_download(&lse), *gp = gu_buf_download(&pr);
        if (run == 1) {
            if (memcmp(go, first_out, o.bytes) || memcmp(gl, first_lse, lse.bytes) ||
                memcmp(gp, first_probs, pr.bytes))
                FAIL("second run differs from the first (not bitwise reproducible)");
            free(go);
            free(gl);
            free(gp);
            break;
        }
        first_out = go, first_lse = gl, first_probs = gp;
    }
    if (first_out) {
        /* out: the criterion, every element written, padding untouched. */
        double err = 0, err_naive = 0;
        int64_t unwritten = 0, lse_bad = 0, clobbered = 0;
        for (int64_t t = 0; t < total_q; t++) {
            int64_t bi = vl ? 0 : t / c->sq, r = vl ? t : t % c->sq;
            for (int hh = 0; hh < c->h; hh++) {
                for (int col = 0; col < c->dv; col++) {
                    int64_t at = (vl ? 0 : bi * o.host.stride[0]) + r * o.host.stride[nd - 3] +
                                 hh * o.host.stride[nd - 2] + col;
                    double g = gu_elem_load(first_out, dt, at);
                    size_t ri = ((size_t)t * (size_t)c->h + (size_t)hh) * (size_t)c->dv + (size_t)col;
                    if (isnan(g)) {
                        unwritten++;
                        continue;
                    }
                    err = fmax(err, fabs(g - ref[ri]));
                    err_naive = fmax(err_naive, fabs(naive[ri] - ref[ri]));
                }
                int64_t la = vl ? hh * lse.host.stride[0] + t * lse.host.stride[1]
                                : bi * lse.host.stride[0] + hh * lse.host.stride[1] + r;
                double gl = ((const float *)first_lse)[la], rl = ref_lse[t * c->h + hh];
                if (isinf(rl) ? gl != rl : !(fabs(gl - rl) <= 2e-3 * fmax(1.0, fabs(rl))))
                    lse_bad++;
            }
        }
        if (c->pad) {
            const uint16_t *w = first_out;
            for (size_t i = 0; i < o.bytes / 2; i++)
                clobbered += w[i] == 0xffff ? 0 : 1;
            clobbered -= (int64_t)n_out;
        }
        double floor = dt == FA_DTYPE_BF16 ? 4e-3 : 5e-4;
        if (unwritten)
            FAIL("%lld output elements unwritten (still poison)", (long long)unwritten);
        if (!(err <= 2 * err_naive + floor))
            FAIL("max |gpu - ref| = %.3g > 2 * naive %.3g + %.1g", err, err_naive, floor);
        if (lse_bad)
            FAIL("%lld lse values off", (long long)lse_bad);
        if (clobbered)
            FAIL("%lld elements written outside the output view", (long long)clobbered);
        /* probs: same encoding as the CPU, same signs where the CPU's entry is not tiny. */
        int64_t p_bad = 0, sign_bad = 0;
        if (c->probs)
            for (size_t i = 0; i < pr.bytes / 2; i++) {
                double g = gu_elem_load(first_probs, dt, (int64_t)i);
                double cp = gu_elem_load(probs_cpu, dt, (int64_t)i);
                if (!(fabs(g - cp) <= 1e-2 * fmax(1.0, fabs(cp))))
                    p_bad++;
                if (fabs(cp) > 1e-3 && signbit(g) != signbit(cp))
                    sign_bad++;
            }
        if (p_bad || sign_bad)
            FAIL("probs: %lld values off, %lld dropout signs differ", (long long)p_bad,
                 (long long)sign_bad);
        printf("%-32s %-5s max|gpu-ref| %.2e  naive %.2e  %s\n", c->name, fa_dtype_name(dt), err,
               err_naive, fa_cuda_last_family());
    }
    free(first_out);
    free(first_lse);
    free(first_probs);
    free(probs_cpu);
    if (ws)
        CHECK_CU(gu_drv->mem_free(ws));
    free(ref);
    free(naive);
    free(ref_lse);
    gpu_buf *all[] = {&q, &k, &v, &o, &lse, &pr, &al, &sk, &cq, &ck, &su};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        gu_buf_free(all[i]);
}

#ifndef FA_TEST_SM90
/* Errors reach the caller with their text. */
static void run_error_checks(void)
{
    /* Never touched (refused first); out apart from the inputs, which it may not alias. */
    fa_tensor t = fa_tensor_make((void *)16, FA_DTYPE_F32, 4, (int64_t[4]){1, 8, 2, 64}, NULL);
    fa_tensor t_out = fa_tensor_make((void *)(uintptr_t)(1 << 20), FA_DTYPE_F32, 4,
                                     (int64_t[4]){1, 8, 2, 64}, NULL);
    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.q = a.k = a.v = &t;
    a.out = &t_out;
    a.device = 0;
    if (fa_attention_forward(&a) != FA_STATUS_UNSUPPORTED || !strstr(fa_last_error(), "fp16")) {
        fprintf(stderr, "FAIL fp32 on the GPU: %s\n", fa_last_error());
        failures++;
    }
    a.device = 999;
    if (fa_attention_forward(&a) != FA_STATUS_UNSUPPORTED || !strstr(fa_last_error(), "device")) {
        fprintf(stderr, "FAIL device 999: %s\n", fa_last_error());
        failures++;
    }
}
#endif

#ifdef FA_TEST_SM90
/* The sm90 cases with dropout (softcap: with softcap) again, with var=value set. */
static void run_sm90_again(int arch, const char *var, const char *value, int softcap)
{
    setenv(var, value, 1);
    for (size_t i = 0; i < sizeof sm90_cases / sizeof sm90_cases[0]; i++) {
        const gpu_case *c = &sm90_cases[i].c;
        if ((softcap ? c->softcap : c->dropout) <= 0)
            continue;
        expect_family = sm90_cases[i].sm90 && arch == 90 ? "fa_fwd_sm90.cu" : "fa_fwd_sm80.cu";
        run_case(c, FA_DTYPE_F16, NULL);
        run_case(c, FA_DTYPE_BF16, NULL);
    }
    unsetenv(var);
}
#endif

int main(void)
{
    const int start = gu_start(FA_TEST_NAME, 0x1234567887654321ull);
    if (start != 0)
        return start;
#ifdef FA_TEST_SM90
    unsetenv("FLASHATTN_SM90");
    int arch = 0, smem = 0;
    if (fa_cuda_device_arch(0, &arch, &smem) != FA_STATUS_OK) {
        fprintf(stderr, "no arch: %s\n", fa_last_error());
        return 1;
    }
    printf("test_gpu_sm90: device sm_%d, default plan\n", arch);
    /* The forced plans' cases first: the largest, so dealt out first they spread over the
     * shards (gu_shard_take) and the small ones fill in after. */
    expect_family = arch == 90 ? "fa_fwd_sm90.cu" : "fa_fwd_sm80.cu";
    for (size_t i = 0; i < sizeof sm90_tile_cases / sizeof sm90_tile_cases[0]; i++) {
        setenv("FLASHATTN_SM90_TILE", sm90_tile_cases[i].tile, 1);
        run_case(&sm90_tile_cases[i].c, FA_DTYPE_F16, NULL);
        run_case(&sm90_tile_cases[i].c, FA_DTYPE_BF16, NULL);
        unsetenv("FLASHATTN_SM90_TILE");
    }
    for (size_t i = 0; i < sizeof sm90_cases / sizeof sm90_cases[0]; i++) {
        expect_family = sm90_cases[i].sm90 && arch == 90 ? "fa_fwd_sm90.cu" : "fa_fwd_sm80.cu";
        run_case(&sm90_cases[i].c, FA_DTYPE_F16, NULL);
        run_case(&sm90_cases[i].c, FA_DTYPE_BF16, NULL);
    }
    /* The dropout cases again with the Philox words from the producer's ring (the same mask,
     * FLASHATTN_SM90_DROP_RING=1, and 2 with the previous P V waited for after the softmax; the
     * ring fits beside every head dim's dropout tile), and the softcap cases with softcap's
     * constants not folded (FLASHATTN_SM90_SOFTCAP_FOLD=0, the A/B form of the same rule). */
    run_sm90_again(arch, "FLASHATTN_SM90_DROP_RING", "1", 0);
    run_sm90_again(arch, "FLASHATTN_SM90_DROP_RING", "2", 0);
    run_sm90_again(arch, "FLASHATTN_SM90_SOFTCAP_FOLD", "0", 1);
    expect_family = arch == 90 ? "fa_fwd_sm90.cu" : "fa_fwd_sm80.cu";
    for (size_t i = 0; i < sizeof sm90_scale_cases / sizeof sm90_scale_cases[0]; i++) {
        run_case(&sm90_scale_cases[i].c, FA_DTYPE_F16, &sm90_scale_cases[i].scale);
        run_case(&sm90_scale_cases[i].c, FA_DTYPE_BF16, &sm90_scale_cases[i].scale);
    }
#else
    /* The sm80 family on every device: on sm_90 the default plan would take the sm90 family. */
    setenv("FLASHATTN_SM90", "0", 1);
    expect_family = "fa_fwd_sm80.cu";
    for (size_t i = 0; i < sizeof gpu_cases / sizeof gpu_cases[0]; i++) {
        run_case(&gpu_cases[i], FA_DTYPE_F16, NULL);
        run_case(&gpu_cases[i], FA_DTYPE_BF16, NULL);
    }
    for (size_t i = 0; i < sizeof scale_cases / sizeof scale_cases[0]; i++) {
        run_case(&scale_cases[i].c, FA_DTYPE_F16, &scale_cases[i].scale);
        run_case(&scale_cases[i].c, FA_DTYPE_BF16, &scale_cases[i].scale);
    }
    run_error_checks();
#endif
    failures += gpu_nan_checks(0); /* on the family the plan above selects */
    failures += gpu_paged_checks();
    printf("%s: %s (%d failure%s)\n", FA_TEST_NAME, failures ? "FAILED" : "passed", failures,
           failures == 1 ? "" : "s");
    return failures ? 1 : 0;
}
