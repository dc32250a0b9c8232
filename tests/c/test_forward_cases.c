/*
 * test_forward's case generator: the directed sweep (each feature alone and in the combinations
 * the edge-case list names, for every dtype) and random cases drawn over every option at once.
 */
#include <math.h>
#include <string.h>

#include "cpu/fa_cpu.h"
#include "cpu/fa_cpu_info.h"
#include "plan/fa_plan.h"
#include "plan/fa_plan_cpu.h"
#include "test_forward.h"

/* ------------------------------------------------------------------------------------------ */
/* Case generation                                                                             */

static const fa_dtype k_dtypes[4] = {FA_DTYPE_F32, FA_DTYPE_F16, FA_DTYPE_BF16, FA_DTYPE_F64};

static void base_case(fcase *c, fa_dtype dt, tu_rng *r)
{
    memset(c, 0, sizeof *c);
    c->dt = dt;
    c->b = tu_rng_int(r, 1, 3);
    c->hk = tu_rng_int(r, 1, 2);
    c->h = c->hk * (tu_rng_chance(r, 0.5) ? 1 : 2);
    c->sq = tu_rng_int(r, 1, 40);
    c->sk = tu_rng_int(r, 1, 40);
    c->d = 32;
    c->dv = 32;
    c->wl = -1;
    c->wr = -1;
    c->scale = NAN;
    c->layout = -1;
    c->with_lse = 1;
    c->threads_a = (int)tu_rng_int(r, 1, 3);
    c->threads_b = 1 + (c->threads_a % 3); /* a different one of 1, 2, 3 */
    c->amp = tu_rng_chance(r, 0.5) ? 1.0 : 3.0;
    c->row_step = 1;
}

/* shrink the sequence lengths until the reference work stays modest */
static void cap_cost(fcase *c, double budget)
{
    for (;;) {
        double cost = (double)c->b * (double)c->h * (double)(c->sq + 1) * (double)(c->sk + 1) *
                      (double)(c->d + c->dv) / (double)(c->row_step > 0 ? c->row_step : 1);
        if (c->dt == FA_DTYPE_F16 || c->dt == FA_DTYPE_BF16) {
            cost *= 2.0;
        }
        if (c->with_probs) {
            cost *= 1.5;
        }
        if (cost <= budget || (c->sq <= 8 && c->sk <= 8)) {
            return;
        }
        if (c->sq >= c->sk) {
            c->sq = c->sq * 3 / 4;
        } else {
            c->sk = c->sk * 3 / 4;
        }
    }
}

static void random_case(fcase *c, tu_rng *r)
{
    base_case(c, k_dtypes[tu_rng_int(r, 0, 3)], r);
    TU_RANDOM_ATTN(c, r);
    c->with_lse = tu_rng_chance(r, 0.85);
    c->with_probs = tu_rng_chance(r, c->dropout_p > 0 ? 0.5 : 0.2);
    if (tu_rng_chance(r, 0.2)) {
        /* packed layouts */
        if (tu_rng_chance(r, 0.5)) {
            c->packed = 1;
            c->sk = c->sq;
            c->hk = c->h;
            c->dv = c->d;
        } else {
            c->packed = 2;
            c->dv = c->d;
        }
    }
    if (c->varlen) {
        c->vl_zero = tu_rng_chance(r, 0.5);
        c->vl_offset = tu_rng_chance(r, 0.5);
        c->vl_seqused = tu_rng_chance(r, 0.4);
    }
    if (tu_rng_chance(r, 0.1)) {
        c->threads_a = 0; /* the default thread count */
    }
    cap_cost(c, 6e6);
}

void tf_run_random(tu_rng *rng, int n)
{
    for (int i = 0; i < n; i++) {
        fcase c;
        random_case(&c, rng);
        tf_run_case(&c, "random", rng);
    }
}

/* Each feature on its own and in the combinations the edge-case list names. */
/* The forward's tile height follows the thread's share of L2 (fa_cpu_forward_tile_rows): the
 * rule's choices for h 64, s 300, d 128, and the tiles a small share picks computing right. */
static void tiles_from_l2(tu_rng *rng)
{
    fa_params p = {0};
    p.b = 1, p.h = 64, p.hk = 8, p.max_sq = p.max_sk = 300, p.d = p.dv = 128;
    p.window_left = p.window_right = -1;
    p.num_threads = 4; /* 64 items are too few for 512-row tiles on 4 threads */
    static const struct {
        fa_dtype dt;
        size_t share;
        int64_t rows;
    } rule[] = {{FA_DTYPE_F32, 2 << 20, 256}, {FA_DTYPE_BF16, 2 << 20, 256},
                {FA_DTYPE_F64, 2 << 20, 256}, {FA_DTYPE_F32, 256 << 10, 128},
                {FA_DTYPE_F64, 256 << 10, 64},  {FA_DTYPE_F32, 96 << 10, 64}};
    tu_where = "forward tile rows from the L2 share";
    for (size_t i = 0; i < sizeof rule / sizeof rule[0]; i++) {
        p.dtype = rule[i].dt;
        fa_cpu_set_l2_share(rule[i].share);
        const int64_t rows = fa_cpu_forward_tile_rows(&p);
        TU_CHECK(rows == rule[i].rows, "dtype %d, %zu bytes of L2: %lld rows, expected %lld",
                 (int)rule[i].dt, rule[i].share, (long long)rows, (long long)rule[i].rows);
    }
    fcase c;
    for (int ci = 0; ci < 3; ci++) {
        base_case(&c, k_dtypes[ci], rng);
        c.b = 1;
        c.h = 24; /* three 128-row tiles a head make 72 items, enough for 128 rows */
        c.hk = 8;
        c.sq = 260;
        c.sk = 290;
        c.d = c.dv = 128;
        c.causal = ci == 1;
        c.row_step = 13;
        fa_cpu_set_l2_share(256 << 10);
        tf_run_case(&c, "128-row tiles of a 256 KB L2", rng);
    }
    fa_cpu_set_l2_share(0);
}

/* The fp32/fp64 tile grows to 512 rows where every thread gets 32 such items
 * (fa_cpu_forward_tile_rows) and stays at 256 otherwise. The tile's height never changes a
 * row's key blocks without a left window, so a run with 512-row tiles (1 thread) and one with
 * shorter tiles (2 threads) must agree to the bit: tf_run_case compares them. */
static void tall_tiles(tu_rng *rng)
{
    fa_params p = {0};
    p.b = 1, p.h = 16, p.hk = 4, p.max_sq = 1000, p.max_sk = 1100, p.d = p.dv = 64;
    p.dtype = FA_DTYPE_F32;
    p.window_left = p.window_right = -1;
    static const struct {
        int threads;
        int64_t window_left, rows;
    } rule[] = {{1, -1, 512}, {2, -1, 256}, {1, 600, 128}};
    tu_where = "forward tile rows against the thread count";
    for (size_t i = 0; i < sizeof rule / sizeof rule[0]; i++) {
        p.num_threads = rule[i].threads;
        p.window_left = rule[i].window_left;
        const int64_t rows = fa_cpu_forward_tile_rows(&p);
        TU_CHECK(rows == rule[i].rows, "%d threads, window_left %lld: %lld rows, expected %lld",
                 rule[i].threads, (long long)rule[i].window_left, (long long)rows,
                 (long long)rule[i].rows);
    }
    /* fp16 takes the same tile after converting K/V per block (its low-precision reference
     * over every row would take a minute here). */
    static const fa_dtype dts[] = {FA_DTYPE_F32, FA_DTYPE_F64};
    for (int di = 0; di < 2; di++) {
        for (int ci = 0; ci < 4; ci++) {
            fcase c;
            base_case(&c, dts[di], rng);
            c.b = 1;
            c.h = 16;
            c.hk = 4;
            c.sq = 600; /* one 512-row tile and one of 88, against 128-row tiles */
            c.sk = 700;
            c.d = c.dv = 64;
            c.threads_a = 1;
            c.threads_b = 2;
            c.causal = ci == 1;
            if (ci == 2) {
                c.softcap = 5.0;
                c.alibi = 1;
                c.wr = 30;
            }
            if (ci == 3) {
                c.dropout_p = 0.2;
                c.sinks = 1;
            }
            c.row_step = 41;
            tf_run_case(&c, "512-row tiles against 256", rng);
        }
    }
}

/* The plan's few-row rules (fa_plan_cpu.c) at their edges. */
static void few_rows_plan(void)
{
    fa_params p = {0};
    p.b = 1, p.h = 32, p.hk = 8, p.max_sq = FA_DECODE_MAX_ROWS, p.max_sk = 4096, p.d = p.dv = 128;
    tu_where = "the forward's few-row rule";
    TU_CHECK(fa_plan_few_rows(&p), "%d rows: not few", FA_DECODE_MAX_ROWS);
    p.max_sq = FA_DECODE_MAX_ROWS + 1;
    TU_CHECK(!fa_plan_few_rows(&p), "%d rows: few", FA_DECODE_MAX_ROWS + 1);
    p.max_sq = 1;
    p.dropout_p = 0.1;
    TU_CHECK(!fa_plan_few_rows(&p), "dropout: few");
    p.dropout_p = 0;
    p.probs = &p;
    TU_CHECK(!fa_plan_few_rows(&p), "probs: few");
    p.probs = NULL;
    /* CUDA's forward: few rows, and heads past FA_CUDA_MAX_HEAD_DIM at any row count */
    tu_where = "the CUDA forward's decode rule";
    p.max_sq = 4096;
    TU_CHECK(!fa_plan_cuda_decodes(&p), "d 128, 4096 rows: decodes");
    p.d = 576, p.dv = 512;
    TU_CHECK(fa_plan_cuda_decodes(&p), "d 576 / dv 512, 4096 rows: does not decode");
    p.d = 128, p.dv = FA_CUDA_MAX_HEAD_DIM + 1;
    TU_CHECK(fa_plan_cuda_decodes(&p), "dv %d, 4096 rows: does not decode", FA_CUDA_MAX_HEAD_DIM + 1);
    p.dropout_p = 0.1;
    TU_CHECK(!fa_plan_cuda_decodes(&p), "wide, dropout: decodes");
    p.dropout_p = 0;
    p.probs = &p;
    TU_CHECK(!fa_plan_cuda_decodes(&p), "wide, probs: decodes");
    p.probs = NULL, p.d = p.dv = FA_CUDA_MAX_HEAD_DIM, p.max_sq = 1;
    TU_CHECK(fa_plan_cuda_decodes(&p), "d %d, one row: does not decode", FA_CUDA_MAX_HEAD_DIM);
    tu_where = "the forward's few-row rule";
    p.d = p.dv = 128;
    /* kv heads an item: the packed rows of as many as fill a tile of FA_CPU_DECODE_ROWS */
    static const int64_t heads[][4] = {{1, 32, 8, 8},  {2, 32, 8, 8}, {4, 32, 8, 4},
                                       {16, 32, 8, 1}, {1, 64, 1, 1}, {3, 8, 8, 8}};
    for (size_t i = 0; i < sizeof heads / sizeof heads[0]; i++) {
        p.h = heads[i][1], p.hk = heads[i][2];
        const int64_t got = fa_plan_cpu_decode_heads(&p, heads[i][0]);
        TU_CHECK(got == heads[i][3], "sq %lld h %lld/%lld: %lld kv heads an item, expected %lld",
                 (long long)heads[i][0], (long long)p.h, (long long)p.hk, (long long)got,
                 (long long)heads[i][3]);
    }
    /* splits: FA_CPU_FEW_ITEMS items, chunks of at least FA_KV_MIN_CHUNK keys */
    static const int64_t splits[][3] = {{1, 0, 1},       {1, 256, 1},     {1, 257, 2},
                                        {1, 4096, 16},   {1, 32768, 128}, {8, 32768, 16},
                                        {64, 32768, 2},  {128, 32768, 1}, {0, 4096, 1},
                                        {1, 1 << 20, 128}};
    for (size_t i = 0; i < sizeof splits / sizeof splits[0]; i++) {
        const int got = fa_plan_cpu_few_splits(splits[i][0], splits[i][1]);
        TU_CHECK(got == splits[i][2], "%lld items, %lld keys: %d splits, expected %lld",
                 (long long)splits[i][0], (long long)splits[i][1], got, (long long)splits[i][2]);
    }
}

/*
 * Few query rows run the decode schedule (fa_plan_few_rows; tf_run_case checks the route
 * from the log): rows 1..16 and one past, every dtype, MHA, GQA and MQA, each feature alone and
 * together, dense and varlen, key counts around the chunk sizes of the split rule and whole key
 * blocks. One sequence whose packed rows fill at most one tile is one item before splitting, so
 * its split count is the plan's for one item, which the log must name.
 */
static void few_rows(tu_rng *rng)
{
    static const int64_t rows[] = {1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 6};
    static const int64_t keys[] = {1, 17, 255, 256, 257, 511, 512, 513, 1100, 0, 4100};
    static const int64_t heads[][2] = {{8, 2}, {8, 1}, {4, 4}, {12, 3}, {16, 2}}; /* h, hk */
    few_rows_plan();
    for (int i = 0; i < 190; i++) {
        fcase c;
        base_case(&c, k_dtypes[i % 4], rng);
        c.sq = rows[i % 13];
        c.sk = keys[i % 11];
        c.h = heads[i % 5][0];
        c.hk = heads[i % 5][1];
        c.b = i % 3 == 0 ? 1 : tu_rng_int(rng, 1, 3);
        c.d = c.dv = i % 7 == 3 ? 128 : 64;
        if (i % 9 == 4) {
            c.d = 40; /* padded rows */
            c.dv = 24;
        }
        if (c.sk > 1000 && c.dt != FA_DTYPE_F32) {
            c.h = c.hk; /* the long sequence's low-precision reference stays short */
        }
        switch (i % 7) {
        case 1:
            c.causal = 1;
            break;
        case 2:
            c.wl = (int)tu_rng_int(rng, 0, c.sk + 2);
            c.wr = (int)tu_rng_int(rng, -1, 40);
            break;
        case 3:
            c.alibi = (int)tu_rng_int(rng, 1, 2);
            break;
        case 4:
            c.softcap = tu_rng_uniform(rng, 0.5, 20.0);
            break;
        case 5:
            c.sinks = 1;
            break;
        case 6:
            c.causal = 1;
            c.wl = (int)tu_rng_int(rng, 0, 300);
            c.sinks = 1;
            c.alibi = 1;
            c.softcap = 8.0;
            break;
        default:
            break;
        }
        c.with_lse = i % 11 != 7;
        c.varlen = i % 4 == 1 || i % 4 == 2;
        if (c.varlen) {
            c.b = tu_rng_int(rng, 1, 4);
            c.vl_zero = tu_rng_chance(rng, 0.3);
            c.vl_offset = tu_rng_chance(rng, 0.5);
            c.vl_seqused = tu_rng_chance(rng, 0.4);
        }
        if (!c.varlen && c.b == 1 && c.sq <= FA_DECODE_MAX_ROWS &&
            c.sq * c.h <= FA_CPU_DECODE_ROWS) {
            c.expect_splits = fa_plan_cpu_few_splits(1, c.sk);
        }
        tf_run_case(&c, "few rows", rng);
    }
}

void tf_run_directed(tu_rng *rng)
{
    fcase c;
    static const int64_t head_dims[] = {1, 7, 33, 64, 96, 128, 256};

    /* head_dim sweep, every dtype; dv sometimes different */
    for (int di = 0; di < 4; di++) {
        for (size_t hi = 0; hi < sizeof head_dims / sizeof head_dims[0]; hi++) {
            base_case(&c, k_dtypes[di], rng);
            c.d = head_dims[hi];
            c.dv = (hi % 3 == 1) ? head_dims[(hi + 3) % 7] : c.d;
            c.sq = tu_rng_int(rng, 1, 70);
            c.sk = tu_rng_int(rng, 1, 150);
            c.causal = (int)(hi & 1);
            cap_cost(&c, 3e6);
            tf_run_case(&c, "head_dim sweep", rng);
        }
    }

    /* Past the CUDA families' 256, every dtype: MLA's d 576 / dv 512 (MQA, one query row on the
     * decode schedule, then a block of rows, causal) and an odd pair. */
    static const int64_t wide[][2] = {{576, 512}, {576, 512}, {FA_MAX_HEAD_DIM, 300}};
    for (int di = 0; di < 4; di++)
        for (size_t i = 0; i < sizeof wide / sizeof wide[0]; i++) {
            base_case(&c, k_dtypes[di], rng);
            c.b = 1, c.hk = 1, c.h = 4;
            c.d = wide[i][0], c.dv = wide[i][1];
            c.sq = i == 0 ? 1 : tu_rng_int(rng, 17, 40);
            c.sk = tu_rng_int(rng, 60, 200);
            c.causal = i == 1;
            cap_cost(&c, 4e7);
            tf_run_case(&c, "head dims past 256", rng);
        }

    for (int di = 0; di < 4; di++) {
        fa_dtype dt = k_dtypes[di];
        /* seqlen 0 and 1 */
        int64_t lens[][2] = {{0, 5}, {5, 0}, {0, 0}, {1, 1}, {1, 17}, {17, 1}, {1, 0}};
        for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
            base_case(&c, dt, rng);
            c.sq = lens[i][0];
            c.sk = lens[i][1];
            c.causal = (int)(i & 1);
            c.sinks = (i % 3 == 2);
            c.with_probs = (i % 2 == 0);
            tf_run_case(&c, "seqlen 0/1", rng);
        }
        /* causal, sq > sk (fully masked first rows) and sq < sk */
        base_case(&c, dt, rng);
        c.causal = 1;
        c.sq = 37;
        c.sk = 11;
        c.with_probs = 1;
        tf_run_case(&c, "causal sq>sk", rng);
        base_case(&c, dt, rng);
        c.causal = 1;
        c.sq = 13;
        c.sk = 150;
        tf_run_case(&c, "causal sq<sk", rng);
        base_case(&c, dt, rng);
        c.causal = 1;
        c.sinks = 1;
        c.sq = 40;
        c.sk = 9;
        tf_run_case(&c, "causal sq>sk with sinks", rng);
        /* causal with a left window */
        base_case(&c, dt, rng);
        c.causal = 1;
        c.wl = 5;
        c.wr = 9; /* ignored: causal sets right = 0 */
        c.sq = 60;
        c.sk = 60;
        tf_run_case(&c, "causal + window_left", rng);
        /* narrow windows, fully masked rows */
        int wins[][2] = {{0, 0}, {2, 1}, {1, -1}, {-1, 2}, {0, -1}, {-1, 0}, {3, 0}};
        for (size_t i = 0; i < sizeof wins / sizeof wins[0]; i++) {
            base_case(&c, dt, rng);
            c.wl = wins[i][0];
            c.wr = wins[i][1];
            c.sq = tu_rng_int(rng, 30, 90);
            c.sk = tu_rng_int(rng, 3, 20);
            if (i & 1) {
                int64_t t = c.sq;
                c.sq = c.sk;
                c.sk = t;
            }
            c.with_probs = (i % 3 == 0);
            tf_run_case(&c, "narrow window", rng);
        }
        /* windows wider than the sequence */
        base_case(&c, dt, rng);
        c.wl = 1000;
        c.wr = 1000;
        c.sq = 31;
        c.sk = 47;
        tf_run_case(&c, "window wider than sequence", rng);
        base_case(&c, dt, rng);
        c.wl = 100000;
        c.wr = 0;
        c.sq = 50;
        c.sk = 20;
        tf_run_case(&c, "left window wider than sequence", rng);
        /* GQA ratios */
        int64_t ratios[] = {1, 2, 8};
        for (int i = 0; i < 3; i++) {
            base_case(&c, dt, rng);
            c.hk = tu_rng_int(rng, 1, 2);
            c.h = c.hk * ratios[i];
            c.causal = i == 1;
            tf_run_case(&c, "GQA", rng);
        }
        /* alibi [h] and [b, h] */
        for (int a = 1; a <= 2; a++) {
            base_case(&c, dt, rng);
            c.alibi = a;
            c.causal = a == 1;
            c.sq = tu_rng_int(rng, 1, 60);
            c.sk = tu_rng_int(rng, 1, 60);
            c.with_probs = 1;
            tf_run_case(&c, "alibi", rng);
        }
        /* softcap, with and without causal */
        for (int k = 0; k < 2; k++) {
            base_case(&c, dt, rng);
            c.softcap = k ? 0.7 : 15.0;
            c.causal = k;
            c.amp = 3.0;
            c.with_probs = k;
            tf_run_case(&c, "softcap", rng);
        }
        /* sinks */
        base_case(&c, dt, rng);
        c.sinks = 1;
        c.wl = 2;
        c.wr = 0;
        c.sq = 50;
        c.sk = 12;
        tf_run_case(&c, "sinks + window", rng);
        /* dropout, with probs */
        double ps[] = {0.1, 0.5, 0.85};
        for (int i = 0; i < 3; i++) {
            base_case(&c, dt, rng);
            c.dropout_p = ps[i];
            c.causal = i == 2;
            c.with_probs = 1;
            c.sq = tu_rng_int(rng, 1, 60);
            c.sk = tu_rng_int(rng, 60, 200);
            c.d = i == 0 ? 64 : (i == 1 ? 128 : 40);
            c.dv = c.d;
            tf_run_case(&c, "dropout", rng);
        }
        /* probs over several key blocks, every block width */
        int64_t pd[] = {32, 64, 96, 128, 256};
        for (int i = 0; i < 5; i++) {
            base_case(&c, dt, rng);
            c.d = pd[i];
            c.dv = pd[i];
            c.sq = tu_rng_int(rng, 1, 20);
            c.sk = tu_rng_int(rng, 130, 300);
            c.with_probs = 1;
            c.causal = i & 1;
            c.dropout_p = (i % 2 == 0) ? 0.3 : 0.0;
            c.amp = 3.0;
            tf_run_case(&c, "probs blocks", rng);
        }
        /* custom scale */
        base_case(&c, dt, rng);
        c.scale = 0.37;
        tf_run_case(&c, "custom scale", rng);
        /* varlen */
        for (int k = 0; k < 4; k++) {
            base_case(&c, dt, rng);
            c.varlen = 1;
            c.b = tu_rng_int(rng, 2, 7);
            c.sq = tu_rng_int(rng, 1, 40);
            c.sk = tu_rng_int(rng, 1, 40);
            c.vl_zero = (k != 3);
            c.vl_offset = (k >= 1);
            c.vl_seqused = (k >= 2);
            c.causal = k & 1;
            c.with_probs = (k == 2);
            tf_run_case(&c, "varlen", rng);
        }
        /* varlen: total tokens < batch */
        base_case(&c, dt, rng);
        c.varlen = 1;
        c.b = 8;
        c.sq = 1;
        c.sk = 2;
        c.vl_zero = 2;
        c.sinks = 1;
        c.causal = 1;
        tf_run_case(&c, "varlen total < batch", rng);
        /* strided views: packed qkv, packed kv, padded, permuted */
        for (int k = 0; k < 4; k++) {
            base_case(&c, dt, rng);
            c.varlen = k >= 2;
            c.b = tu_rng_int(rng, 1, 3);
            if (k % 2 == 0) {
                c.packed = 1;
                c.sk = c.sq;
                c.hk = c.h;
            } else {
                c.packed = 2;
                c.layout = TU_PERMUTED;
            }
            c.d = c.dv = 24;
            c.with_probs = k == 1;
            tf_run_case(&c, "packed", rng);
        }
        for (int l = 0; l < TU_NUM_LAYOUTS; l++) {
            base_case(&c, dt, rng);
            c.layout = l;
            c.with_probs = 1;
            c.varlen = l == 2;
            tf_run_case(&c, "layout", rng);
        }
    }

    /* Long sequences (many tiles), reference on every 7th / 5th row */
    base_case(&c, FA_DTYPE_F32, rng);
    c.b = 1;
    c.h = 2;
    c.hk = 1;
    c.sq = 700;
    c.sk = 900;
    c.d = c.dv = 64;
    c.causal = 1;
    c.row_step = 7;
    tf_run_case(&c, "long causal", rng);
    base_case(&c, FA_DTYPE_F64, rng);
    c.b = 1;
    c.h = 1;
    c.hk = 1;
    c.sq = 400;
    c.sk = 1000;
    c.d = c.dv = 128;
    c.wl = 100;
    c.wr = 30;
    c.row_step = 5;
    tf_run_case(&c, "long window", rng);
    /* fp32 K/V rows 4 KB apart (8 kv heads x 128, contiguous): the kernels copy K and V blocks
     * instead of reading them in place (fa_cpu_rows_alias); GQA, a partial last block */
    for (int ci = 0; ci < 2; ci++) {
        base_case(&c, FA_DTYPE_F32, rng);
        c.b = 1;
        c.hk = 8;
        c.h = 8 * (1 + ci);
        c.sq = 150;
        c.sk = 300 - 37 * ci;
        c.d = c.dv = 128;
        c.layout = TU_CONTIGUOUS;
        c.causal = ci;
        c.wl = ci ? -1 : 90;
        c.row_step = 3;
        tf_run_case(&c, "fp32 K/V rows 4 KB apart", rng);
    }
    /* bf16 over several tiles and key blocks of its own kernels (AMX or AVX512-BF16) */
    base_case(&c, FA_DTYPE_BF16, rng);
    c.b = 1;
    c.h = 4;
    c.hk = 2;
    c.sq = 520;
    c.sk = 700;
    c.d = c.dv = 64;
    c.row_step = 5;
    tf_run_case(&c, "long bf16", rng);
    base_case(&c, FA_DTYPE_BF16, rng);
    c.b = 1;
    c.h = 2;
    c.hk = 1;
    c.sq = 600;
    c.sk = 600;
    c.d = c.dv = 128;
    c.causal = 1;
    c.row_step = 7;
    tf_run_case(&c, "long bf16 causal", rng);
    base_case(&c, FA_DTYPE_F16, rng);
    c.b = 1;
    c.h = 2;
    c.hk = 2;
    c.sq = 256;
    c.sk = 513;
    c.d = c.dv = 64;
    c.dropout_p = 0.2;
    c.alibi = 1;
    c.row_step = 3;
    tf_run_case(&c, "long dropout alibi", rng);
    /* Enough heads for the forward's tallest tiles (256 rows, 128 under a window), whose
     * query-column buffers have a padded leading dimension (fa_cpu_tile_ld), and a short last
     * tile whose buffers have none */
    const fa_dtype tall[3] = {FA_DTYPE_F32, FA_DTYPE_BF16, FA_DTYPE_F16};
    for (int ci = 0; ci < 4; ci++) {
        base_case(&c, tall[ci % 3], rng);
        c.b = 1;
        c.h = 64;
        c.hk = 8;
        c.sq = 300;
        c.sk = 333;
        c.d = c.dv = 128;
        c.causal = ci == 1;
        c.wl = ci == 2 ? 70 : -1;
        c.softcap = ci == 3 ? 20.0 : 0.0;
        c.row_step = 11;
        tf_run_case(&c, "tall tiles", rng);
    }
    tiles_from_l2(rng);
    tall_tiles(rng);
    few_rows(rng);
}
