/*
 * GPU backward (kernels/fa_bwd_sm80.cu) against the double oracle and the CPU backward, on the
 * same inputs (q, k, v, dout random; out and lse from the CPU forward, as the GPU backward reads
 * them):
 *   dq, dk, dv, dsinks: max|gpu - ref| <= 3 max|naive - ref| + 3 max|stored - ref| + 4 u max|ref|
 *     + 1e-5 (upstream's criterion: naive = autograd through same-dtype naive attention,
 *     fa_ref_backward_lowp; stored = the oracle with D taken from out rounded to the dtype, the
 *     share of the error that reading the stored out causes; u the dtype's unit roundoff)
 *   every output element written (outputs are poisoned with NaN first);
 *   deterministic = 1: two runs bitwise identical in dq, dk, dv, dsinks; deterministic = 0: two
 *   runs bitwise identical in dk, dv, dsinks, and on the sm80 family identical to the
 *   deterministic run's (the sm90 family's atomic mode visits the query tiles in another order,
 *   fa_bwd_tour, so its dK and dV round differently);
 *   varlen (random lengths with an empty sequence, rows of q and k outside every sequence,
 *   seqused_k, max_seqlen above the longest sequence): the same, and exact zeros on the rows
 *   outside every sequence and the keys past seqused_k, as the CPU backward writes them;
 *   head dims past 128 and d != dv (the sm80 family's dK/dV columns split over two warps per 16
 *   keys), also on the tiles of the 99 KB parts and sm_80's one query stage (FLASHATTN_BWD_TILE
 *   picks them on any device: tiled_cases);
 *   an unsupported case (head dim > 256, which the CPU takes) and a short workspace refused with
 *   a message;
 *   gpu_nan.c's NaN and Inf cases (forward and backward) against the CPU, on each family.
 *   On sm_90 every case runs first with FLASHATTN_BWD_SM90=0 (the sm80 family), then the cases
 *   the sm90 families take run again with the default plan: every run must take the family the
 *   plan names (fa_bwd_sm90.cu for d = dv up to 128, fa_bwd_sm90_wide.cu for wider heads and
 *   d != dv), and both a deterministic and the atomic run are held against the oracle.
 *   FA_TEST_SHARD=i/n runs a share of the cases (tests/gpu/run_sharded.sh).
 * `test_gpu_backward --bench` times the backward (hdim 128, seqlen 4k, bf16, causal and not);
 * `test_gpu_backward --case TEXT` runs only the cases whose name contains TEXT (a short run for
 * compute-sanitizer).
 * Exits 77 (skipped) when no CUDA device is usable.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda/fa_cuda.h"
#include "cuda/fa_cuda_driver.h"
#include "fa_ref.h"
#include "fa_ref_bwd.h"
#include "gpu_nan.h"
#include "gpu_test_util.h"
#include "util/fa_half.h"

typedef struct bcase {
    const char *name;
    int b, h, hk, sq, sk, d, dv;
    int causal, wl, wr;
    double softcap;
    int alibi, sinks;
    double dropout;
    int pad;
    int varlen, seqused, slack; /* slack: max_seqlen_q/k above the longest sequence */
} bcase;

static const bcase cases[] = {
    {"dense d64", 2, 4, 4, 257, 257, 64, 64, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"causal d128 sq<sk", 2, 4, 4, 300, 517, 128, 128, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"gqa window d96 padded", 1, 8, 2, 333, 290, 96, 96, 0, 32, 16, 0, 0, 0, 0, 8, 0, 0, 0},
    {"mqa unaligned d37 dv24", 2, 6, 1, 70, 150, 37, 24, 0, 50, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    /* dv not a multiple of 8: fa_bwd_pre's element-by-element dot products. */
    {"unaligned d40 dv20 causal", 2, 4, 2, 90, 120, 40, 20, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"softcap alibi sinks d128", 1, 4, 2, 200, 200, 128, 128, 1, -1, -1, 30, 1, 1, 0, 0, 0, 0, 0},
    {"dropout causal d64", 2, 3, 3, 129, 300, 64, 64, 1, -1, -1, 0, 0, 0, 0.17, 0, 0, 0, 0},
    {"dropout alibi window d128", 2, 2, 2, 140, 333, 128, 128, 0, 60, 30, 0, 1, 0, 0.25, 0, 0, 0,
     0},
    {"sq>sk causal empty rows d32", 2, 2, 2, 200, 60, 32, 32, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"empty rows with sinks d64", 1, 3, 3, 150, 40, 64, 64, 1, -1, -1, 0, 0, 1, 0, 0, 0, 0, 0},
    {"long causal gqa d128", 1, 4, 2, 1000, 1100, 128, 128, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"decode sq1 gqa d128", 3, 8, 2, 1, 1000, 128, 128, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"d64 dv128 softcap window", 1, 4, 4, 190, 260, 64, 128, 0, 70, 0, 20, 0, 0, 0, 0, 0, 0, 0},
    /* Key blocks whose query tiles are partly whole (the unmasked path) and partly cut by a
     * window wider than a tile, over several heads of a group (both query stages in turn). */
    {"wide window gqa d128", 2, 4, 2, 600, 650, 128, 128, 0, 300, 150, 0, 0, 0, 0, 0, 0, 0, 0},
    {"dropout causal mqa d64 long", 1, 4, 1, 520, 700, 64, 64, 1, -1, -1, 0, 0, 0, 0.1, 0, 0, 0, 0},
    /* d 64's chained element-wise step (FA_BWD_CHAIN): softcap; dropout with ALiBi or varlen. */
    {"softcap causal gqa d64 long", 1, 4, 2, 400, 520, 64, 64, 1, -1, -1, 30, 0, 0, 0, 0, 0, 0, 0},
    {"dropout alibi gqa d64", 2, 4, 2, 300, 420, 64, 64, 0, -1, -1, 0, 1, 0, 0.15, 0, 0, 0, 0},
    /* More key blocks x kv heads x sequences (144) than an H200 has multiprocessors (132): the
     * sm90 backward's persistent grid claims some items after finishing others. Few queries,
     * many keys: the items without the reference's cost. */
    {"persistent grid d64", 2, 8, 8, 300, 1030, 64, 64, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"persistent grid causal gqa d128", 3, 12, 6, 160, 1000, 128, 128, 1, -1, -1, 0, 0, 0, 0, 0, 0,
     0, 0},
    /* A right window edge without causal: also claimed longest first, in chunks (16 pairs: 8
     * and 8). */
    {"persistent grid window d64", 2, 8, 8, 300, 1030, 64, 64, 0, 90, 30, 0, 0, 0, 0, 0, 0, 0, 0},
    /* Varlen (see run_case): key blocks past seqused_k and past shorter sequences, query tiles
     * of the workspace a sequence leaves unused, with GQA/MQA and every feature. */
    {"varlen causal gqa d128", 4, 4, 2, 190, 260, 128, 128, 1, -1, -1, 0, 0, 0, 0, 0, 1, 0, 0},
    {"varlen seqused alibi d64 slack", 5, 4, 2, 300, 420, 64, 64, 0, -1, -1, 0, 1, 0, 0, 0, 1, 1,
     1},
    {"varlen window sinks dropout d96 padded", 3, 4, 1, 200, 333, 96, 96, 0, 70, 20, 0, 0, 1, 0.2,
     8, 1, 0, 1},
    {"varlen softcap mqa unaligned d37 dv24", 5, 6, 1, 90, 150, 37, 24, 0, -1, -1, 20, 0, 0, 0, 0,
     1, 1, 0},
    {"varlen sq>sk causal seqused sinks d32", 4, 2, 2, 200, 60, 32, 32, 1, -1, -1, 0, 0, 1, 0, 0,
     1, 1, 1},
    {"varlen long dropout causal gqa d64", 3, 4, 2, 700, 900, 64, 64, 1, -1, -1, 0, 0, 0, 0.1, 0,
     1, 1, 0},
    {"varlen softcap alibi causal d64", 3, 4, 2, 260, 300, 64, 64, 1, -1, -1, 25, 1, 0, 0, 0, 1,
     1, 0},
    /* Head dims past 128 and d != dv: FA_DKV_SPLIT kernels (two warps per 16 keys). */
    {"d256", 2, 4, 4, 200, 230, 256, 256, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"causal gqa d192 sq<sk", 2, 4, 2, 190, 300, 192, 192, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"window d160 padded", 1, 4, 4, 260, 250, 160, 160, 0, 60, 20, 0, 0, 0, 0, 8, 0, 0, 0},
    /* d = dv = 192 on a persistent grid (136 items of five tiles), with ALiBi and sinks. */
    {"persistent grid alibi sinks gqa d192", 2, 8, 4, 300, 1030, 192, 192, 0, -1, -1, 0, 1, 1, 0,
     0, 0, 0, 0},
    {"causal gqa d192 dv128", 2, 8, 2, 257, 257, 192, 128, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"softcap alibi sinks d96 dv256", 1, 4, 2, 150, 190, 96, 256, 0, -1, -1, 30, 1, 1, 0, 0, 0, 0,
     0},
    {"dropout causal d256 dv128", 2, 3, 3, 129, 300, 256, 128, 1, -1, -1, 0, 0, 0, 0.17, 0, 0, 0,
     0},
    {"mqa unaligned d200 dv140 window", 2, 4, 1, 110, 170, 200, 140, 0, 50, -1, 0, 0, 0, 0, 0, 0,
     0, 0},
    {"d32 dv256 causal", 2, 2, 2, 130, 140, 32, 256, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"long causal gqa d256", 1, 4, 2, 700, 800, 256, 256, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
    {"persistent grid alibi d256", 2, 4, 4, 130, 1030, 256, 256, 0, -1, -1, 0, 1, 0, 0, 0, 0, 0,
     0},
    {"varlen causal gqa d256", 4, 4, 2, 190, 260, 256, 256, 1, -1, -1, 0, 0, 0, 0, 0, 1, 0, 0},
    /* d or dv 256 with each feature set the precompile matrix compiles (the wide sm90 family:
     * softcap with a window, varlen with ALiBi and dropout, varlen at d 256 / dv 128 and back;
     * softcap with dropout is refused by the API). */
    {"softcap window sinks gqa d256", 2, 4, 2, 170, 220, 256, 256, 0, 90, 20, 25, 0, 1, 0, 0, 0,
     0, 0},
    {"dropout alibi causal d256", 2, 3, 3, 150, 260, 256, 256, 1, -1, -1, 0, 1, 0, 0.2, 0, 0, 0,
     0},
    {"varlen seqused alibi dropout gqa d256 slack", 3, 4, 2, 200, 260, 256, 256, 0, -1, -1, 0, 1,
     0, 0.2, 0, 1, 1, 1},
    {"varlen window softcap mqa d256 dv128", 3, 4, 1, 180, 240, 256, 128, 0, 60, 10, 20, 0, 0, 0,
     0, 1, 0, 0},
    {"varlen dropout causal seqused d128 dv256", 3, 4, 2, 160, 200, 128, 256, 1, -1, -1, 0, 0, 0,
     0.1, 0, 1, 1, 0},
    {"varlen seqused alibi dropout d192 dv128 slack", 3, 4, 2, 200, 300, 192, 128, 0, -1, -1, 0,
     1, 0, 0.2, 0, 1, 1, 1},
    {"varlen window sinks mqa d160 padded", 3, 4, 1, 200, 233, 160, 160, 0, 70, 20, 0, 0, 1, 0, 8,
     1, 0, 0},
    /* The wide sm90 family's 128-key blocks (no dropout, padded d 128 or 192 and d + dv <= 320:
     * each consumer warpgroup 64 of the keys), with blocks whose keys end inside either half,
     * dense and varlen. */
    {"softcap alibi window gqa d192 dv128", 2, 4, 2, 300, 420, 192, 128, 0, 100, 40, 25, 1, 0, 0,
     0, 0, 0, 0},
    {"long causal sq>sk sinks mqa d128 dv96", 1, 4, 1, 700, 600, 128, 96, 1, -1, -1, 0, 0, 1, 0, 0,
     0, 0, 0},
    {"varlen softcap causal seqused d192 dv128 slack", 3, 4, 2, 260, 330, 192, 128, 1, -1, -1, 20,
     0, 0, 0, 0, 1, 1, 1},
    /* The wide sm90 family on a persistent grid (more work items than SMs), with a right window
     * edge (its longest-first claims) and without. */
    {"persistent grid causal gqa d256 dv128", 3, 12, 6, 160, 1000, 256, 128, 1, -1, -1, 0, 0, 0,
     0, 0, 0, 0, 0},
    {"persistent grid window dropout d192 dv128", 2, 8, 8, 300, 1030, 192, 128, 0, 90, 30, 0, 0,
     0, 0.1, 0, 0, 0, 0},
    {"persistent grid softcap alibi d128 dv64", 2, 8, 4, 200, 1100, 128, 64, 0, -1, -1, 25, 1, 0,
     0, 0, 0, 0, 0},
    /* 128-key blocks at d 192 on a persistent grid (tours of an odd number of tiles), and with
     * dv 64 under causal. */
    {"persistent grid odd tours d192 dv128", 2, 8, 8, 300, 1030, 192, 128, 0, -1, -1, 0, 0, 0, 0,
     0, 0, 0, 0},
    {"causal mqa d192 dv64", 2, 4, 1, 330, 400, 192, 64, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0},
};

/* Wide heads on the tiles another part's plan picks, through FLASHATTN_BWD_TILE (warps, query
 * stages, query rows): the 99 KB parts' (4 warps, one stage; 32-row query tiles at d 256) and
 * sm_80's one stage at 8 warps. */
static const struct {
    const char *tile;
    bcase c;
} tiled_cases[] = {
    {"4,1", {"tile 4,1 varlen causal gqa dropout d192", 3, 4, 2, 200, 260, 192, 192, 1, -1, -1, 0,
             0, 0, 0.15, 0, 1, 1, 0}},
    {"4,1", {"tile 4,1 window d160 dv128", 2, 4, 4, 150, 210, 160, 128, 0, 40, 10, 0, 0, 0, 0, 0, 0,
             0, 0}},
    {"4,1,32", {"tile 4,1,32 alibi window d256", 2, 4, 2, 170, 200, 256, 256, 0, 80, 0, 0, 1, 0, 0,
                0, 0, 0, 0}},
    {"4,1,32", {"tile 4,1,32 varlen seqused dropout d256 dv96", 3, 4, 2, 150, 190, 256, 96, 1, -1,
                -1, 0, 0, 0, 0.1, 0, 1, 1, 1}},
    {"8,1", {"tile 8,1 causal dropout alibi d256", 2, 4, 4, 220, 240, 256, 256, 1, -1, -1, 0, 1,
             0, 0.1, 0, 0, 0, 0}},
    {"8,1", {"tile 8,1 varlen causal d192 dv128", 3, 4, 2, 180, 220, 192, 128, 1, -1, -1, 0, 0, 0,
             0, 0, 1, 0, 0}},
};

static int failures;
/* The second pass on sm_90 (the default plan, deterministic calls opted in) over the cases the
 * sm90 family takes: every run must take it; its dQ sums run in another order than the sm80
 * family's, so a deterministic and the atomic run are each checked against the oracle. sm90_runs
 * counts the runs. */
static int sm90_pass, sm90_runs;

/* Whether the sm90 families take case c (fa_plan_backward_sm90: d and dv in 33..256, rows
 * 16-byte aligned), for the second pass's family check. */
static int sm90_takes(const bcase *c)
{
    return c->d > 32 && c->dv > 32 && c->d % 8 == 0 && c->dv % 8 == 0 && c->pad % 8 == 0;
}

/* Which of them: fa_bwd_sm90.cu for d = dv up to 128, fa_bwd_sm90_wide.cu for the rest. */
static const char *sm90_family(const bcase *c)
{
    return c->d == c->dv && c->d <= 128 ? "fa_bwd_sm90.cu" : "fa_bwd_sm90_wide.cu";
}

/* One gradient's comparison: the raw downloaded data `got` (layout of view t, [b, s, heads, w]
 * dense, [total, heads, w] varlen, or fp32 [h] for dsinks when ndim is 1) against the oracle
 * arrays [tokens, heads, w]. */
typedef struct grad_err {
    double err, naive, stored, maxref, cpu;
    long long unwritten;
} grad_err;

static grad_err compare(const void *got, const void *cpu, const fa_tensor *t, const double *ref,
                        const double *lowp, const double *stored)
{
    grad_err r = {0, 0, 0, 0, 0, 0};
    const int one = t->ndim == 1, nd = t->ndim;
    /* As [nb, ns, nh, w] with strides (sb, ss, sh, 1): nb = 1 unless dense. */
    const int64_t nb = nd == 4 ? t->shape[0] : 1, ns = one ? 1 : t->shape[nd - 3];
    const int64_t nh = t->shape[one ? 0 : nd - 2], w = one ? 1 : t->shape[nd - 1];
    const int64_t sb = nd == 4 ? t->stride[0] : 0, ss = one ? 0 : t->stride[nd - 3];
    const int64_t sh = t->stride[one ? 0 : nd - 2];
    for (int64_t bi = 0; bi < nb; bi++)
        for (int64_t s = 0; s < ns; s++)
            for (int64_t hh = 0; hh < nh; hh++)
                for (int64_t col = 0; col < w; col++) {
                    const int64_t at = bi * sb + s * ss + hh * sh + col;
                    const size_t ri = (size_t)(((bi * ns + s) * nh + hh) * w + col);
                    const double g = gu_elem_load(got, t->dtype, at);
                    if (isnan(g)) {
                        r.unwritten++;
                        continue;
                    }
                    r.err = fmax(r.err, fabs(g - ref[ri]));
                    r.naive = fmax(r.naive, fabs(lowp[ri] - ref[ri]));
                    r.stored = fmax(r.stored, fabs(stored[ri] - ref[ri]));
                    r.maxref = fmax(r.maxref, fabs(ref[ri]));
                    r.cpu = fmax(r.cpu, fabs(gu_elem_load(cpu, t->dtype, at) - ref[ri]));
                }
    return r;
}

/* Elements of rows [r0, r1) of a [total, heads, w] view that are not exactly zero (NaN too). */
static long long nonzero_rows(const void *got, const fa_tensor *t, int64_t r0, int64_t r1)
{
    long long n = 0;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t hh = 0; hh < t->shape[1]; hh++)
            for (int64_t col = 0; col < t->shape[2]; col++)
                n += gu_elem_load(got, t->dtype, r * t->stride[0] + hh * t->stride[1] + col) != 0;
    return n;
}

static void run_case(const bcase *c, fa_dtype dt)
{
    /* Varlen: random lengths with an empty sequence (the second), rows of q and k outside every
     * sequence at both ends, seqused_k anywhere in [0, length], as the forward's GPU test. */
    int32_t cu_q[9] = {0}, cu_k[9] = {0}, used[8] = {0};
    int64_t total_q = (int64_t)c->b * c->sq, total_k = (int64_t)c->b * c->sk;
    int64_t max_q = 1, max_k = 1;
    if (c->varlen) {
        cu_q[0] = 3;
        cu_k[0] = 5;
        for (int i = 0; i < c->b; i++) {
            const int lq = i == 1 ? 0 : (int)gu_uniform(1, c->sq + 1);
            const int lk = (int)gu_uniform(1, c->sk + 1);
            cu_q[i + 1] = cu_q[i] + lq;
            cu_k[i + 1] = cu_k[i] + lk;
            used[i] = c->seqused ? (int)gu_uniform(0, lk + 1) : lk;
            max_q = lq > max_q ? lq : max_q;
            max_k = lk > max_k ? lk : max_k;
        }
        total_q = cu_q[c->b] + 4;
        total_k = cu_k[c->b] + 2;
        /* More than a query tile and a key block of slack: tiles and key blocks that meet no
         * sequence at all. */
        if (c->slack)
            max_q += 70, max_k += 150;
    }
    const int nd = c->varlen ? 3 : 4;
    int64_t qs[4] = {c->b, c->sq, c->h, c->d}, ks[4] = {c->b, c->sk, c->hk, c->d};
    int64_t vs[4] = {c->b, c->sk, c->hk, c->dv}, os[4] = {c->b, c->sq, c->h, c->dv};
    int64_t ls[3] = {c->b, c->h, c->sq}, hs[1] = {c->h};
    if (c->varlen) {
        const int64_t q3[3] = {total_q, c->h, c->d}, k3[3] = {total_k, c->hk, c->d};
        const int64_t v3[3] = {total_k, c->hk, c->dv}, o3[3] = {total_q, c->h, c->dv};
        const int64_t l2[2] = {c->h, total_q};
        memcpy(qs, q3, sizeof q3);
        memcpy(ks, k3, sizeof k3);
        memcpy(vs, v3, sizeof v3);
        memcpy(os, o3, sizeof o3);
        memcpy(ls, l2, sizeof l2);
    }
    int64_t bs[1] = {c->b + 1}, us[1] = {c->b};
    gpu_buf q = gu_buf_new(dt, nd, qs, c->pad), k = gu_buf_new(dt, nd, ks, c->pad);
    gpu_buf v = gu_buf_new(dt, nd, vs, c->pad), o = gu_buf_new(dt, nd, os, c->pad);
    gpu_buf dout = gu_buf_new(dt, nd, os, c->pad), dq = gu_buf_new(dt, nd, qs, c->pad);
    gpu_buf dk = gu_buf_new(dt, nd, ks, c->pad), dv = gu_buf_new(dt, nd, vs, c->pad);
    gpu_buf lse = gu_buf_new(FA_DTYPE_F32, nd - 1, ls, 0);
    gpu_buf al = gu_buf_new(FA_DTYPE_F32, 1, hs, 0), snk = gu_buf_new(FA_DTYPE_F32, 1, hs, 0);
    gpu_buf dsk = gu_buf_new(FA_DTYPE_F32, 1, hs, 0);
    gpu_buf cq = gu_buf_new(FA_DTYPE_I32, 1, bs, 0), ck = gu_buf_new(FA_DTYPE_I32, 1, bs, 0);
    gpu_buf su = gu_buf_new(FA_DTYPE_I32, 1, us, 0);
    memcpy(cq.host.data, cu_q, sizeof(int32_t) * (size_t)(c->b + 1));
    memcpy(ck.host.data, cu_k, sizeof(int32_t) * (size_t)(c->b + 1));
    memcpy(su.host.data, used, sizeof(int32_t) * (size_t)c->b);
    gu_fill_uniform(&q, -1, 1);
    gu_fill_uniform(&k, -1, 1);
    gu_fill_uniform(&v, -1, 1);
    gu_fill_uniform(&dout, -1, 1);
    gu_fill_uniform(&al, 0.01, 0.3);
    gu_fill_uniform(&snk, -1, 2);

    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.causal = c->causal;
    a.window_left = c->wl;
    a.window_right = c->wr;
    a.softcap = c->softcap;
    a.dropout_p = c->dropout;
    a.seed = 0xbadc0ffee0ddf00dull;
    a.offset = 1234;
    fa_fwd_args host = a, dev = a;
    host.q = &q.host, host.k = &k.host, host.v = &v.host, host.out = &o.host, host.lse = &lse.host;
    dev.q = &q.dev, dev.k = &k.dev, dev.v = &v.dev, dev.out = &o.dev, dev.lse = &lse.dev;
    if (c->varlen) {
        host.max_seqlen_q = dev.max_seqlen_q = max_q;
        host.max_seqlen_k = dev.max_seqlen_k = max_k;
        host.cu_seqlens_q = &cq.host, host.cu_seqlens_k = &ck.host;
        dev.cu_seqlens_q = &cq.dev, dev.cu_seqlens_k = &ck.dev;
        if (c->seqused)
            host.seqused_k = &su.host, dev.seqused_k = &su.dev;
    }
    if (c->alibi)
        host.alibi_slopes = &al.host, dev.alibi_slopes = &al.dev;
    if (c->sinks)
        host.sinks = &snk.host, dev.sinks = &snk.dev;
    dev.device = 0;
    fprintf(stderr, "... %s %s\n", c->name, fa_dtype_name(dt));
    /* The backward's module built ahead of it: it must build where the backward runs. */
    if (fa_attention_backward_prepare(&dev) != FA_STATUS_OK)
        FAIL("fa_attention_backward_prepare: %s", fa_last_error());
    if (fa_attention_forward(&host) != FA_STATUS_OK) {
        FAIL("CPU forward: %s", fa_last_error());
        return;
    }
    gpu_buf *ins[] = {&q, &k, &v, &o, &lse, &dout, &al, &snk, &cq, &ck, &su};
    for (size_t i = 0; i < sizeof ins / sizeof ins[0]; i++)
        gu_buf_upload(ins[i]);

    /* Oracle, naive same-dtype baseline, D-from-stored-out oracle, CPU backward. */
    fa_bwd_args hb;
    fa_bwd_args_init(&hb);
    hb.fwd = &host, hb.dout = &dout.host, hb.dq = &dq.host, hb.dk = &dk.host, hb.dv = &dv.host;
    hb.dsinks = c->sinks ? &dsk.host : NULL;
    const size_t nq = (size_t)total_q * c->h * c->d, nk = (size_t)total_k * c->hk * c->d;
    const size_t nv = (size_t)total_k * c->hk * c->dv, ns = (size_t)c->h;
    double *r[3][4];
    for (int i = 0; i < 3; i++) {
        r[i][0] = malloc(nq * sizeof(double));
        r[i][1] = malloc(nk * sizeof(double));
        r[i][2] = malloc(nv * sizeof(double));
        r[i][3] = malloc(ns * sizeof(double));
    }
    if (fa_ref_backward(&hb, r[0][0], r[0][1], r[0][2], r[0][3]) != 0 ||
        fa_ref_backward_lowp(&hb, r[1][0], r[1][1], r[1][2], r[1][3]) != 0 ||
        fa_ref_backward_stored_out(&hb, r[2][0], r[2][1], r[2][2], r[2][3]) != 0)
        FAIL("oracle refused the case");
    if (fa_attention_backward(&hb) != FA_STATUS_OK)
        FAIL("CPU backward: %s", fa_last_error());
    const void *cpu[4] = {dq.host.data, dk.host.data, dv.host.data, dsk.host.data};

    fa_bwd_args gb = hb;
    gb.fwd = &dev, gb.dout = &dout.dev, gb.dq = &dq.dev, gb.dk = &dk.dev, gb.dv = &dv.dev;
    gb.dsinks = c->sinks ? &dsk.dev : NULL;
    size_t wsz = fa_attention_backward_workspace_size(&gb);
    fa_cu_deviceptr ws = 0;
    if (wsz == 0)
        FAIL("workspace size 0: %s", fa_last_error());
    else
        CHECK_CU(gu_drv->mem_alloc(&ws, wsz));
    gb.workspace = (void *)(uintptr_t)ws;
    gb.workspace_size = wsz;

    /* Runs: deterministic twice, then atomics twice. */
    gpu_buf *outs[4] = {&dq, &dk, &dv, &dsk};
    void *got[4][4] = {{NULL}};
    const int det[4] = {1, 1, 0, 0};
    int ok = wsz > 0;
    for (int run = 0; ok && run < 4; run++) {
        for (int i = 0; i < 4; i++)
            gu_buf_poison_device(outs[i]);
        gb.deterministic = det[run];
        fa_status st = fa_attention_backward(&gb);
        if (st != FA_STATUS_OK) {
            FAIL("GPU backward (deterministic %d): %s", det[run], fa_last_error());
            ok = 0;
            break;
        }
        const char *fam = fa_cuda_last_backward_family();
        const int on_sm90 = strncmp(fam, "fa_bwd_sm90", 11) == 0;
        if (sm90_pass && sm90_takes(c) ? strcmp(fam, sm90_family(c)) != 0 : on_sm90)
            FAIL("ran on %s (deterministic %d)", fam, det[run]);
        sm90_runs += on_sm90;
        CHECK_CU(gu_drv->ctx_synchronize());
        for (int i = 0; i < 4; i++)
            got[run][i] = gu_buf_download(outs[i]);
    }
    if (ok) {
        const char *names[4] = {"dq", "dk", "dv", "dsinks"};
        const fa_tensor *views[4] = {&dq.host, &dk.host, &dv.host, &dsk.host};
        const double u = dt == FA_DTYPE_BF16 ? ldexp(1.0, -8) : ldexp(1.0, -11);
        /* The runs held against the oracle: a deterministic one, and on the sm90 pass the
         * atomic one too. */
        for (int checked = 0; checked < 3; checked += sm90_pass ? 2 : 3) {
            printf("%-28s %-5s %s%s", c->name, fa_dtype_name(dt), fa_cuda_last_backward_family(),
                   det[checked] ? " det" : "");
            for (int i = 0; i < (c->sinks ? 4 : 3); i++) {
                grad_err e = compare(got[checked][i], cpu[i], views[i], r[0][i], r[1][i], r[2][i]);
                const double tol = 3 * e.naive + 3 * e.stored + 4 * u * e.maxref + 1e-5;
                if (e.unwritten)
                    FAIL("%s: %lld elements unwritten (still poison)", names[i], e.unwritten);
                if (!(e.err <= tol))
                    FAIL("%s: max|gpu - ref| %.3g > tol %.3g (naive %.3g, stored %.3g, "
                         "max|ref| %.3g, cpu %.3g)",
                         names[i], e.err, tol, e.naive, e.stored, e.maxref, e.cpu);
                printf("  %s %.2e (tol %.1e, cpu %.1e)", names[i], e.err, tol, e.cpu);
            }
            printf("\n");
            /* Varlen: exact zeros where the CPU backward writes them (the tolerance above allows
             * small values): rows outside every sequence, keys past seqused_k. */
            for (int i = 0; c->varlen && i < 3; i++) {
                const int of_k = i > 0;
                const int32_t *cu = of_k ? cu_k : cu_q;
                long long bad =
                    nonzero_rows(got[checked][i], views[i], 0, cu[0]) +
                    nonzero_rows(got[checked][i], views[i], cu[c->b], of_k ? total_k : total_q);
                for (int s = 0; of_k && s < c->b; s++)
                    bad += nonzero_rows(got[checked][i], views[i], cu[s] + used[s], cu[s + 1]);
                if (bad)
                    FAIL("%s: %lld elements not zero outside the sequences or past seqused_k",
                         names[i], bad);
            }
        }
        for (int i = 0; i < 4; i++) {
            if (memcmp(got[0][i], got[1][i], outs[i]->bytes) != 0)
                FAIL("%s: deterministic runs differ", names[i]);
            if (i > 0 && memcmp(got[2][i], got[3][i], outs[i]->bytes) != 0)
                FAIL("%s: atomic runs differ", names[i]);
            if (i > 0 && !sm90_pass && memcmp(got[0][i], got[2][i], outs[i]->bytes) != 0)
                FAIL("%s: differs between deterministic and atomic modes", names[i]);
        }
    }
    for (int run = 0; run < 4; run++)
        for (int i = 0; i < 4; i++)
            free(got[run][i]);
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 4; j++)
            free(r[i][j]);
    if (ws)
        gu_drv->mem_free(ws);
    gpu_buf *all[] = {&q, &k, &v, &o, &dout, &dq, &dk, &dv, &lse, &al, &snk, &dsk, &cq, &ck, &su};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        gu_buf_free(all[i]);
}

/* Refusals: head dim over FA_CUDA_MAX_HEAD_DIM (the CPU takes it), a workspace too small; each
 * with a message. */
static void run_refusals(void)
{
    const bcase cc = {"refusals", 1, 2, 2, 64, 64, 264, 264, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    const bcase *c = &cc;
    const fa_dtype dt = FA_DTYPE_F16;
    int64_t qs[4] = {1, 64, 2, 264}, ls[3] = {1, 2, 64};
    /* Outputs apart from the inputs and from each other (a call may not alias them); q, k and
     * v share one input buffer, which inputs may. */
    gpu_buf q = gu_buf_new(dt, 4, qs, 0), o = gu_buf_new(dt, 4, qs, 0), g = gu_buf_new(dt, 4, qs, 0);
    gpu_buf dq = gu_buf_new(dt, 4, qs, 0), dk = gu_buf_new(dt, 4, qs, 0), dv = gu_buf_new(dt, 4, qs, 0);
    gpu_buf lse = gu_buf_new(FA_DTYPE_F32, 3, ls, 0);
    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.q = a.k = a.v = &q.dev;
    a.out = &o.dev;
    a.lse = &lse.dev;
    a.device = 0;
    fa_bwd_args b;
    fa_bwd_args_init(&b);
    b.fwd = &a, b.dout = &g.dev, b.dq = &dq.dev, b.dk = &dk.dev, b.dv = &dv.dev;
    b.workspace = (void *)(uintptr_t)4096; /* never touched: refused first */
    b.workspace_size = (size_t)1 << 40;
    if (fa_attention_backward(&b) == FA_STATUS_OK || !strstr(fa_last_error(), "head_dim"))
        FAIL("d 264: %s", fa_last_error());
    /* The forward takes d 264 on the decode schedule, but not with dropout (the tiled path's). */
    a.dropout_p = 0.1;
    if (fa_attention_forward(&a) != FA_STATUS_UNSUPPORTED || !strstr(fa_last_error(), "head_dim"))
        FAIL("forward d 264 with dropout: %s", fa_last_error());
    a.dropout_p = 0;
    /* d 64 views of the same memory: a short workspace. */
    gpu_buf *bufs[6] = {&q, &o, &g, &dq, &dk, &dv};
    fa_tensor v64[6];
    for (int i = 0; i < 6; i++)
        v64[i] = fa_tensor_make(bufs[i]->dev.data, dt, 4, (int64_t[4]){1, 64, 2, 64}, NULL);
    a.q = a.k = a.v = &v64[0];
    a.out = &v64[1];
    b.dout = &v64[2], b.dq = &v64[3], b.dk = &v64[4], b.dv = &v64[5];
    size_t need = fa_attention_backward_workspace_size(&b);
    b.workspace_size = need - 1;
    if (need == 0 || fa_attention_backward(&b) != FA_STATUS_INVALID_ARGUMENT ||
        !strstr(fa_last_error(), "workspace"))
        FAIL("short workspace (need %zu): %s", need, fa_last_error());
    for (int i = 0; i < 6; i++)
        gu_buf_free(bufs[i]);
    gu_buf_free(&lse);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Backward time at b 4, h 16, seqlen 4096, hdim 128, bf16 (the shapes of bench/NOTES.md), each
 * mode; FLOPs counted as upstream's benchmark: 2.5 x the forward's 4 b h s^2 d (halved causal). */
static int run_bench(void)
{
    const int b = 4, h = 16, s = 4096, d = 128;
    const fa_dtype dt = FA_DTYPE_BF16;
    int64_t qs[4] = {b, s, h, d}, ls[3] = {b, h, s};
    gpu_buf q = gu_buf_new(dt, 4, qs, 0), k = gu_buf_new(dt, 4, qs, 0);
    gpu_buf v = gu_buf_new(dt, 4, qs, 0), o = gu_buf_new(dt, 4, qs, 0);
    gpu_buf dout = gu_buf_new(dt, 4, qs, 0), dq = gu_buf_new(dt, 4, qs, 0);
    gpu_buf dk = gu_buf_new(dt, 4, qs, 0), dv = gu_buf_new(dt, 4, qs, 0);
    gpu_buf lse = gu_buf_new(FA_DTYPE_F32, 3, ls, 0);
    gu_fill_uniform(&q, -1, 1);
    gu_fill_uniform(&k, -1, 1);
    gu_fill_uniform(&v, -1, 1);
    gu_fill_uniform(&dout, -1, 1);
    gpu_buf *ins[] = {&q, &k, &v, &dout};
    for (int i = 0; i < 4; i++)
        gu_buf_upload(ins[i]);
    for (int causal = 0; causal < 2; causal++)
        for (int det = 0; det < 2; det++) {
            fa_fwd_args a;
            fa_fwd_args_init(&a);
            a.q = &q.dev, a.k = &k.dev, a.v = &v.dev, a.out = &o.dev, a.lse = &lse.dev;
            a.causal = causal;
            a.device = 0;
            if (fa_attention_forward(&a) != FA_STATUS_OK) {
                fprintf(stderr, "bench forward: %s\n", fa_last_error());
                return 1;
            }
            fa_bwd_args g;
            fa_bwd_args_init(&g);
            g.fwd = &a, g.dout = &dout.dev, g.dq = &dq.dev, g.dk = &dk.dev, g.dv = &dv.dev;
            g.deterministic = det;
            size_t wsz = fa_attention_backward_workspace_size(&g);
            fa_cu_deviceptr ws;
            CHECK_CU(gu_drv->mem_alloc(&ws, wsz));
            g.workspace = (void *)(uintptr_t)ws, g.workspace_size = wsz;
            double best = 1e30;
            for (int it = 0; it < 6; it++) {
                CHECK_CU(gu_drv->ctx_synchronize());
                double t0 = now_s();
                if (fa_attention_backward(&g) != FA_STATUS_OK) {
                    fprintf(stderr, "bench backward: %s\n", fa_last_error());
                    return 1;
                }
                CHECK_CU(gu_drv->ctx_synchronize());
                double t = now_s() - t0;
                best = it > 0 && t < best ? t : best; /* the first run compiles */
            }
            gu_drv->mem_free(ws);
            double flops = 2.5 * 4.0 * b * h * (double)s * s * d / (causal ? 2 : 1);
            printf("bench bwd b%d h%d s%d d%d bf16 causal=%d deterministic=%d: %.3f ms, %.1f "
                   "TFLOP/s\n",
                   b, h, s, d, causal, det, best * 1e3, flops / best * 1e-12);
        }
    gpu_buf *all[] = {&q, &k, &v, &o, &dout, &dq, &dk, &dv, &lse};
    for (int i = 0; i < 9; i++)
        gu_buf_free(all[i]);
    return 0;
}

int main(int argc, char **argv)
{
    const int start = gu_start("test_gpu_backward", 0x2468ace013579bdfull);
    if (start != 0)
        return start;
    if (argc > 1 && strcmp(argv[1], "--bench") == 0)
        return run_bench();
    const char *only = argc > 2 && strcmp(argv[1], "--case") == 0 ? argv[2] : NULL;
    int arch = 0, smem = 0;
    if (fa_cuda_device_arch(0, &arch, &smem) != FA_STATUS_OK) {
        fprintf(stderr, "no arch: %s\n", fa_last_error());
        return 1;
    }
    /* On sm_90 the sm80 family first (opted out), then the default plan's sm90 family. */
    for (sm90_pass = 0; sm90_pass <= (arch == 90); sm90_pass++) {
        if (arch == 90 && !sm90_pass)
            setenv("FLASHATTN_BWD_SM90", "0", 1);
        if (sm90_pass)
            printf("test_gpu_backward: the sm90 family (default plan)\n");
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            if ((only && !strstr(cases[i].name, only)) || (sm90_pass && !sm90_takes(&cases[i])))
                continue;
            const bcase *c = &cases[i];
            const double cost = gu_attn_cost(c->b, c->h, c->sq, c->sk, c->d, c->dv, c->causal);
            if (gu_shard_take(cost))
                run_case(c, FA_DTYPE_F16);
            if (gu_shard_take(cost))
                run_case(c, FA_DTYPE_BF16);
        }
        for (size_t i = 0; !sm90_pass && i < sizeof tiled_cases / sizeof tiled_cases[0]; i++) {
            const bcase *c = &tiled_cases[i].c;
            if (only && !strstr(c->name, only))
                continue;
            const double cost = gu_attn_cost(c->b, c->h, c->sq, c->sk, c->d, c->dv, c->causal);
            setenv("FLASHATTN_BWD_TILE", tiled_cases[i].tile, 1);
            if (gu_shard_take(cost))
                run_case(c, FA_DTYPE_F16);
            if (gu_shard_take(cost))
                run_case(c, FA_DTYPE_BF16);
            unsetenv("FLASHATTN_BWD_TILE");
        }
        if (!only && gu_shard_take(gu_attn_cost(2, 2, 200, 200, 128, 128, 0) * 24))
            failures += gpu_nan_checks(1);
        unsetenv("FLASHATTN_BWD_SM90");
    }
    if (arch == 90)
        printf("test_gpu_backward: %d runs on the sm90 backward\n", sm90_runs);
    if (!only)
        run_refusals();
    printf("test_gpu_backward: %s (%d failure%s)\n", failures ? "FAILED" : "passed", failures,
           failures == 1 ? "" : "s");
    return failures ? 1 : 0;
}
