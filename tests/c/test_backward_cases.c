/*
 * test_backward's case generator: the directed sweep (each feature alone and in the combinations
 * test_forward covers, for every dtype) and random cases drawn over every option at once.
 */
#include <math.h>
#include <string.h>

#include "cpu/fa_cpu_info.h"
#include "test_backward.h"

/* ------------------------------------------------------------------------------------------ */
/* Case generation                                                                             */

static const fa_dtype k_dtypes[4] = {FA_DTYPE_F32, FA_DTYPE_F16, FA_DTYPE_BF16, FA_DTYPE_F64};

void tb_base_case(bcase *c, fa_dtype dt, tu_rng *r)
{
    memset(c, 0, sizeof *c);
    c->dt = dt;
    c->b = tu_rng_int(r, 1, 3);
    c->hk = tu_rng_int(r, 1, 2);
    c->h = c->hk * (tu_rng_chance(r, 0.5) ? 1 : 2);
    c->sq = tu_rng_int(r, 1, 40);
    c->sk = tu_rng_int(r, 1, 40);
    c->d = c->dv = 32;
    c->wl = c->wr = -1;
    c->scale = NAN;
    c->layout = -1;
    c->lse64 = 1; /* F64 only; a few cases take the fp32 lse instead */
    /* 1, 2, 3 in a random order: the first run is checked, the others must match it */
    int first = (int)tu_rng_int(r, 1, 3), step = tu_rng_chance(r, 0.5) ? 1 : 2;
    for (int i = 0; i < 3; i++) {
        c->threads[i] = 1 + (first - 1 + i * step) % 3;
    }
    c->amp = tu_rng_chance(r, 0.5) ? 1.0 : 3.0;
}

/* shrink the sequence lengths until the oracle's work stays modest */
static void cap_cost(bcase *c, double budget)
{
    for (;;) {
        double cost = (double)c->b * (double)c->h * (double)(c->sq + 1) * (double)(c->sk + 1) *
                      (double)(c->d + c->dv);
        if (c->dt == FA_DTYPE_F16 || c->dt == FA_DTYPE_BF16) {
            cost *= 1.6; /* the naive baseline too */
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

static void random_case(bcase *c, tu_rng *r)
{
    tb_base_case(c, k_dtypes[tu_rng_int(r, 0, 3)], r);
    TU_RANDOM_ATTN(c, r);
    c->lse64 = tu_rng_chance(r, 0.85);
    if (tu_rng_chance(r, 0.2)) {
        c->packed = tu_rng_chance(r, 0.5) ? 1 : 2;
    }
    if (c->varlen) {
        c->vl_zero = tu_rng_chance(r, 0.5);
        c->vl_offset = tu_rng_chance(r, 0.5);
        c->vl_seqused = tu_rng_chance(r, 0.4);
    }
    cap_cost(c, 1.5e6);
}

/* Each feature on its own and in the combinations the forward sweep covers, every dtype. */
void tb_run_directed(tu_rng *rng)
{
    bcase c;
    static const int64_t head_dims[] = {1, 7, 33, 64, 96, 128, 256};
    for (int di = 0; di < 4; di++) {
        for (int hi = 0; hi < 7; hi++) {
            tb_base_case(&c, k_dtypes[di], rng);
            c.d = head_dims[hi];
            c.dv = (hi % 3 == 1) ? head_dims[(hi + 3) % 7] : c.d;
            c.sq = tu_rng_int(rng, 1, 70);
            c.sk = tu_rng_int(rng, 1, 150);
            c.causal = hi & 1;
            cap_cost(&c, 1e6);
            tb_run_case(&c, "head_dim sweep", rng);
        }
    }
    /* Past the CUDA families' 256, every dtype: MLA's d 576 / dv 512 (MQA), causal and not, and
     * an odd pair. */
    static const int64_t wide[][2] = {{576, 512}, {576, 512}, {FA_MAX_HEAD_DIM, 300}};
    for (int di = 0; di < 4; di++)
        for (int i = 0; i < 3; i++) {
            tb_base_case(&c, k_dtypes[di], rng);
            c.b = 1, c.hk = 1, c.h = 4;
            c.d = wide[i][0], c.dv = wide[i][1];
            c.sq = tu_rng_int(rng, 8, 40);
            c.sk = tu_rng_int(rng, 40, 120);
            c.causal = i == 1;
            cap_cost(&c, 1e7);
            tb_run_case(&c, "head dims past 256", rng);
        }
    for (int di = 0; di < 4; di++) {
        fa_dtype dt = k_dtypes[di];
        int64_t lens[][2] = {{0, 5}, {5, 0}, {0, 0}, {1, 1}, {1, 17}, {17, 1}, {1, 0}};
        for (int i = 0; i < 7; i++) {
            tb_base_case(&c, dt, rng);
            c.sq = lens[i][0];
            c.sk = lens[i][1];
            c.causal = i & 1;
            c.sinks = i % 3 == 2 || i == 5;
            tb_run_case(&c, "seqlen 0/1", rng);
        }
        int64_t causal_lens[][3] = {{37, 11, 0}, {13, 150, 0}, {40, 9, 1}};
        for (int i = 0; i < 3; i++) {
            tb_base_case(&c, dt, rng);
            c.causal = 1;
            c.sq = causal_lens[i][0];
            c.sk = causal_lens[i][1];
            c.sinks = (int)causal_lens[i][2];
            tb_run_case(&c, "causal sq != sk (fully masked rows)", rng);
        }
        tb_base_case(&c, dt, rng);
        c.causal = 1;
        c.wl = 5;
        c.wr = 9; /* ignored: causal sets right = 0 */
        c.sq = c.sk = 60;
        tb_run_case(&c, "causal + window_left", rng);
        int wins[][2] = {{0, 0}, {2, 1}, {1, -1}, {-1, 2}, {0, -1}, {-1, 0}, {3, 0}, {1000, 1000}};
        for (int i = 0; i < 8; i++) {
            tb_base_case(&c, dt, rng);
            c.wl = wins[i][0];
            c.wr = wins[i][1];
            c.sq = tu_rng_int(rng, 30, 90);
            c.sk = tu_rng_int(rng, 3, 20);
            if (i & 1) {
                int64_t t = c.sq;
                c.sq = c.sk;
                c.sk = t;
            }
            c.sinks = i == 2;
            tb_run_case(&c, "window", rng);
        }
        int64_t ratios[] = {1, 2, 8};
        for (int i = 0; i < 3; i++) {
            tb_base_case(&c, dt, rng);
            c.hk = tu_rng_int(rng, 1, 2);
            c.h = c.hk * ratios[i];
            c.causal = i == 1;
            c.sq = tu_rng_int(rng, 20, 100);
            tb_run_case(&c, "GQA", rng);
        }
        for (int a = 1; a <= 2; a++) {
            tb_base_case(&c, dt, rng);
            c.alibi = a;
            c.causal = a == 1;
            c.sq = tu_rng_int(rng, 1, 60);
            c.sk = tu_rng_int(rng, 1, 60);
            tb_run_case(&c, "alibi", rng);
        }
        for (int k = 0; k < 2; k++) {
            tb_base_case(&c, dt, rng);
            c.softcap = k ? 0.7 : 15.0;
            c.causal = k;
            c.amp = 3.0;
            tb_run_case(&c, "softcap", rng);
        }
        tb_base_case(&c, dt, rng);
        c.sinks = 1;
        c.wl = 2;
        c.wr = 0;
        c.sq = 50;
        c.sk = 12;
        c.hk = 2;
        c.h = 4;
        tb_run_case(&c, "sinks + window + GQA", rng);
        double ps[] = {0.1, 0.5, 0.85};
        for (int i = 0; i < 3; i++) {
            tb_base_case(&c, dt, rng);
            c.dropout_p = ps[i];
            c.causal = i == 2;
            c.sinks = i == 1;
            c.alibi = i == 0;
            c.sq = tu_rng_int(rng, 1, 60);
            c.sk = tu_rng_int(rng, 60, 140);
            c.d = c.dv = i == 0 ? 64 : (i == 1 ? 128 : 40);
            tb_run_case(&c, "dropout", rng);
        }
        tb_base_case(&c, dt, rng);
        c.scale = 0.37;
        tb_run_case(&c, "custom scale", rng);
        for (int k = 0; k < 4; k++) {
            tb_base_case(&c, dt, rng);
            c.varlen = 1;
            c.b = tu_rng_int(rng, 2, 7);
            c.sq = tu_rng_int(rng, 1, 40);
            c.sk = tu_rng_int(rng, 1, 40);
            c.vl_zero = k != 3;
            c.vl_offset = k >= 1;
            c.vl_seqused = k >= 2;
            c.causal = k & 1;
            c.sinks = k == 2;
            c.dropout_p = k == 3 ? 0.3 : 0.0;
            tb_run_case(&c, "varlen", rng);
        }
        tb_base_case(&c, dt, rng);
        c.varlen = 1;
        c.b = 8;
        c.sq = 1;
        c.sk = 2;
        c.vl_zero = 2;
        c.sinks = 1;
        c.causal = 1;
        tb_run_case(&c, "varlen total < batch", rng);
        for (int k = 0; k < 4; k++) {
            tb_base_case(&c, dt, rng);
            c.varlen = k >= 2;
            c.packed = 1 + (k & 1);
            c.layout = k & 1 ? TU_PERMUTED : -1;
            c.d = c.dv = 24;
            c.vl_offset = c.vl_seqused = k == 3;
            tb_run_case(&c, "packed qkv/dqkv, kv/dkv", rng);
        }
        for (int l = 0; l < TU_NUM_LAYOUTS; l++) {
            tb_base_case(&c, dt, rng);
            c.layout = l;
            c.varlen = l == 2;
            tb_run_case(&c, "layout", rng);
        }
    }
    /* several query tiles and key blocks, in every pass */
    tb_base_case(&c, FA_DTYPE_F32, rng);
    c.b = 1;
    c.h = 4;
    c.hk = 2;
    c.sq = 300;
    c.sk = 333;
    c.d = c.dv = 64;
    c.causal = 1;
    c.sinks = 1;
    tb_run_case(&c, "long causal", rng);
    tb_base_case(&c, FA_DTYPE_F64, rng);
    c.b = 1;
    c.h = c.hk = 1;
    c.sq = 250;
    c.sk = 400;
    c.d = c.dv = 96;
    c.wl = 70;
    c.wr = 20;
    tb_run_case(&c, "long window", rng);
    tb_base_case(&c, FA_DTYPE_BF16, rng);
    c.b = 1;
    c.h = c.hk = 2;
    c.sq = 200;
    c.sk = 260;
    c.d = c.dv = 48;
    c.dropout_p = 0.2;
    c.alibi = 2;
    tb_run_case(&c, "long dropout alibi", rng);
    tb_base_case(&c, FA_DTYPE_F64, rng);
    c.lse64 = 0;
    c.sinks = 1;
    c.causal = 1;
    tb_run_case(&c, "f64 with an fp32 lse", rng);
    /* 16 (batch, kv head) pairs and two 512-key chunks: the fused schedule in two stripes */
    for (int di = 0; di < 4; di++) {
        tb_base_case(&c, k_dtypes[di], rng);
        c.b = 2;
        c.h = 8 * (1 + di % 2);
        c.hk = 8;
        c.sq = 90 + 7 * di;
        c.sk = 520 + 50 * di;
        c.causal = di % 2;
        c.sinks = di == 2;
        c.dropout_p = di == 3 ? 0.15 : 0;
        tb_run_case(&c, "fused in stripes", rng);
    }
    /* fp32 K/V rows 4 KB apart (8 kv heads x 128, contiguous): copied, not read in place */
    for (int ci = 0; ci < 2; ci++) {
        tb_base_case(&c, FA_DTYPE_F32, rng);
        c.b = 1;
        c.hk = 8;
        c.h = 8 * (1 + ci);
        c.sq = 100 + 30 * ci;
        c.sk = 200 - 37 * ci;
        c.d = c.dv = 128;
        c.layout = TU_CONTIGUOUS;
        c.causal = ci;
        tb_run_case(&c, "fp32 K/V rows 4 KB apart", rng);
    }
    /* 8 pairs and 800 keys: four stripes of one 256-key chunk each */
    tb_base_case(&c, k_dtypes[tu_rng_int(rng, 0, 3)], rng);
    c.b = 1;
    c.h = c.hk = 8;
    c.sq = 70;
    c.sk = 800;
    c.causal = 1;
    tb_run_case(&c, "fused in stripes of 256-key chunks", rng);
    /* 64 pairs and 1100 keys: two stripes over three 512-key chunks (stripe 0 takes two, the
     * last runs in query halves that meet on one chunk) */
    for (int di = 0; di < 4; di++) {
        tb_base_case(&c, k_dtypes[di], rng);
        c.b = 2;
        c.h = c.hk = 32;
        c.sq = 40 + 9 * di;
        c.sk = 1100 - 30 * di;
        c.causal = di % 2 == 0;
        tb_run_case(&c, "fused in stripes of two chunks", rng);
    }
    /* varlen, 4 x 4 pairs and up to 1000 keys: stripes whose sequences end before their chunks */
    tb_base_case(&c, k_dtypes[tu_rng_int(rng, 0, 3)], rng);
    c.varlen = 1;
    c.vl_zero = c.vl_offset = c.vl_seqused = 1;
    c.b = 4;
    c.h = c.hk = 4;
    c.sq = 30;
    c.sk = 1000;
    c.causal = tu_rng_int(rng, 0, 1);
    tb_run_case(&c, "fused in stripes, varlen", rng);
    /* A 160 KB share of L2 cuts the key chunks to 128 keys (fa_bwd_chunk_keys): 16 pairs take
     * the fused schedule's stripes of 128-key chunks, 128 pairs one stripe of them (in query
     * halves: fewer than FA_CPU_BWD_HALVES_BELOW items) */
    fa_cpu_set_l2_share(160 << 10);
    for (int di = 0; di < 4; di++) {
        tb_base_case(&c, k_dtypes[di], rng);
        c.b = di % 2 ? 4 : 1;
        c.h = c.hk = di % 2 ? 32 : 16;
        c.sq = 60 + 11 * di;
        c.sk = 300 + 45 * di;
        c.d = c.dv = 128;
        c.causal = di % 2;
        tb_run_case(&c, "128-key chunks of a 160 KB L2", rng);
    }
    fa_cpu_set_l2_share(0);
    /* 256 pairs: one stripe, whole items (FA_CPU_BWD_HALVES_BELOW items or more) */
    for (int di = 0; di < 2; di++) {
        tb_base_case(&c, k_dtypes[tu_rng_int(rng, 0, 3)], rng);
        c.b = 8;
        c.h = 32 * (1 + di);
        c.hk = 32;
        c.sq = 20 + 13 * di;
        c.sk = 40 + 7 * di;
        c.causal = di;
        tb_run_case(&c, "fused, one stripe of whole items", rng);
    }
}

void tb_run_random(tu_rng *rng, int n)
{
    for (int i = 0; i < n; i++) {
        bcase c;
        random_case(&c, rng);
        tb_run_case(&c, "random", rng);
    }
}
