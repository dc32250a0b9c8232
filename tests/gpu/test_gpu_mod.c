/*
 * User-defined scoring on a CUDA device (score_mod, mask_mod, aux tensors, block masks; the
 * sm80 family's hooks) against the CPU backend on the same random inputs, fp16 and bf16:
 *   out:  within a bf16/fp16 tolerance of the CPU's (both compute in fp32)
 *   lse:  within 2e-3 of the CPU's, +inf exactly where the CPU has it (rows with no key)
 *   every output element written (out and lse poisoned before the run).
 * Cases: causal, document (int aux), prefix-LM and sliding-window masks, softcap, ALiBi and a
 * relative-position table (float aux) as score_mods, their combinations with GQA and the
 * built-in causal, with and without block masks (aligned with the kernel's tiles and finer or
 * unaligned ones; random states, unordered lists with repeats); aux reads at indices outside
 * their tensors (clamped, as on the CPU); two mods that differ in a constant only (their own
 * kernels); a block mask whose device entries are out of range (counts clamped, indices
 * ignored: the CPU gets the equivalent valid mask).
 * The backward of every case too (the sm80 family's, on every arch), from each backend's own
 * forward, against the CPU backward on the same inputs and dout:
 *   dq, dk, dv: within a bf16/fp16 tolerance of the CPU's relative to their largest element,
 *   every element written (poisoned before), in the atomic and the deterministic dQ order (the
 *   block mask's skipped tiles are passed over in one and visited, masked, in the other).
 * The cases run on the sm80 family (FLASHATTN_SM90_MODS=0 and FLASHATTN_BWD_SM90_MODS=0, which
 * keep it on sm_90 too); on sm_90 the forward cases run a second time on the Hopper kernel's
 * hooks (fa_fwd_sm90.cu, the default there), against the same CPU results (forward only), and
 * the backward cases a third time on fa_bwd_sm90.cu's hooks where the plan takes them (the
 * default there too).
 * (Block-masked ones too: in one dQ order their skipped query tiles are passed over, in the
 * other visited, every key masked.) FA_MOD_PASSES (sm80, sm90, bwd90) picks some of the three.
 * Each case's line names the family that ran.
 * Exits 77 (skipped) without a usable device.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/fa_cuda.h"
#include "cuda/fa_cuda_driver.h"
#include "gpu_test_util.h"

enum { S_NONE, S_SOFTCAP, S_SOFTCAP2, S_ALIBI, S_RELPOS };
enum { M_NONE, M_CAUSAL, M_DOC, M_DOC_BAD, M_PREFIX, M_WINDOW };
enum { BM_NONE, BM_RANDOM, BM_CAUSAL, BM_BANDS };

typedef struct mod_case {
    const char *name;
    int b, h, hk, sq, sk, d;
    int score, mask;
    int bm, q_block, kv_block; /* block mask kind and sizes */
    int causal;                /* the built-in causal too */
} mod_case;

static const mod_case cases[] = {
    {"causal mask_mod", 2, 4, 4, 300, 300, 128, S_NONE, M_CAUSAL, BM_NONE, 0, 0, 0},
    {"causal mask_mod block mask 128", 2, 4, 4, 300, 300, 128, S_NONE, M_CAUSAL, BM_CAUSAL, 128,
     128, 0},
    {"document gqa", 2, 4, 2, 384, 384, 64, S_NONE, M_DOC, BM_NONE, 0, 0, 0},
    {"document block mask 64x64", 2, 4, 2, 384, 384, 64, S_NONE, M_DOC, BM_RANDOM, 64, 64, 0},
    {"prefix-LM gqa3", 1, 6, 2, 257, 257, 128, S_NONE, M_PREFIX, BM_NONE, 0, 0, 0},
    {"sliding window block mask 32x96", 2, 4, 4, 500, 500, 96, S_NONE, M_WINDOW, BM_RANDOM, 32, 96,
     0},
    {"softcap 20", 2, 4, 4, 200, 333, 128, S_SOFTCAP, M_NONE, BM_NONE, 0, 0, 0},
    {"softcap 7.5", 2, 4, 4, 200, 333, 128, S_SOFTCAP2, M_NONE, BM_NONE, 0, 0, 0},
    {"alibi causal gqa4", 2, 8, 2, 256, 256, 64, S_ALIBI, M_NONE, BM_NONE, 0, 0, 1},
    {"relpos table clamped", 2, 4, 4, 190, 190, 128, S_RELPOS, M_NONE, BM_NONE, 0, 0, 0},
    {"relpos document gqa block mask 128", 2, 8, 2, 400, 400, 128, S_RELPOS, M_DOC, BM_RANDOM,
     128, 128, 0},
    {"document bad indices", 2, 4, 4, 150, 150, 64, S_NONE, M_DOC_BAD, BM_NONE, 0, 0, 0},
    {"d256 softcap window", 1, 4, 4, 300, 300, 256, S_SOFTCAP, M_WINDOW, BM_NONE, 0, 0, 0},
    {"block mask only 128x64", 2, 4, 4, 333, 333, 128, S_NONE, M_NONE, BM_RANDOM, 128, 64, 0},
    {"sq < sk alibi causal mask", 2, 4, 4, 100, 300, 128, S_ALIBI, M_CAUSAL, BM_RANDOM, 16, 16, 0},
    /* Random full blocks above the diagonal keep keys mask_mod masks; past fa_bwd_sm90.cu's
     * 128-key block and 64-query tile on both sides. */
    {"softcap causal gqa block mask 64x128", 1, 4, 2, 704, 704, 128, S_SOFTCAP, M_CAUSAL,
     BM_RANDOM, 64, 128, 0},
    /* Long runs of skipped query blocks (over words of the backward's live bits), per head. */
    {"causal gqa banded block mask 16x64", 1, 2, 1, 2100, 2100, 128, S_NONE, M_CAUSAL, BM_BANDS,
     16, 64, 0},
};

#define DOC_LEN 512 /* the document-id table's positions */
#define REL_SPAN 40 /* the relative-position table covers q - kv in [-40, 40] */
#define PREFIX 37

static int failures;
/* The forward family the cases must run on, and whether the backward follows (sm80 pass). */
static const char *expect_family = "fa_fwd_sm80.cu";
static int with_backward = 1;
/* The backward's pass on fa_bwd_sm90.cu's hooks (sm_90). */
static int bwd_sm90;

/* The backward family case c must run on: the sm80 family, or in the sm90 pass fa_bwd_sm90.cu
 * where the plan takes the mods there (d = dv in 65..128, block masks too on these dense
 * calls: fa_plan_backward.c). */
static const char *bwd_family_want(const mod_case *c)
{
    return bwd_sm90 && c->d > 64 && c->d <= 128 ? "fa_bwd_sm90.cu" : "fa_bwd_sm80.cu";
}

/* ---- the programs ---------------------------------------------------------------------- */

static int var(fa_mod *m, fa_mod_variable v) { return fa_mod_var(m, v); }
static int cst(fa_mod *m, double x) { return fa_mod_const(m, x); }
static int bin(fa_mod *m, fa_mod_op op, int a, int b) { return fa_mod_binary(m, op, a, b); }
static int un(fa_mod *m, fa_mod_op op, int a) { return fa_mod_unary(m, op, a); }

static fa_mod *finish(fa_mod *m, int root, fa_mod_kind kind)
{
    if (root < 0 || fa_mod_finish(m, root, kind) != FA_STATUS_OK) {
        fprintf(stderr, "FATAL: building a mod: %s\n", fa_last_error());
        exit(1);
    }
    return m;
}

/* score_mod of kind k (S_*), NULL for S_NONE. Aux slot 1: the relative-position table, fp32
 * [h, 2 REL_SPAN + 1] (q - kv outside the span reads past it: clamped to its ends). */
static fa_mod *score_mod_make(int k, int heads)
{
    if (k == S_NONE)
        return NULL;
    fa_mod *m = fa_mod_create();
    const int s = var(m, FA_MOD_SCORE), q = var(m, FA_MOD_Q_IDX), kv = var(m, FA_MOD_KV_IDX);
    const int h = var(m, FA_MOD_H);
    int r = -1;
    if (k == S_SOFTCAP || k == S_SOFTCAP2) {
        const int cap = cst(m, k == S_SOFTCAP ? 20.0 : 7.5);
        r = bin(m, FA_MOD_MUL, cap, un(m, FA_MOD_TANH, bin(m, FA_MOD_DIV, s, cap)));
    } else if (k == S_ALIBI) { /* slope 2^(-8 (h + 1) / heads) */
        const int e = bin(m, FA_MOD_MUL, cst(m, -8.0 / heads), bin(m, FA_MOD_ADD, h, cst(m, 1)));
        const int slope = bin(m, FA_MOD_POW, cst(m, 2), e);
        r = bin(m, FA_MOD_SUB, s,
                bin(m, FA_MOD_MUL, slope, un(m, FA_MOD_ABS, bin(m, FA_MOD_SUB, q, kv))));
    } else {
        const int idx[2] = {h, bin(m, FA_MOD_ADD, bin(m, FA_MOD_SUB, q, kv), cst(m, REL_SPAN))};
        r = bin(m, FA_MOD_ADD, s, fa_mod_aux(m, 1, 2, idx));
    }
    return finish(m, r, FA_MOD_KIND_SCORE);
}

/* mask_mod of kind k (M_*), NULL for M_NONE. Aux slot 0: document ids, int32 [b, DOC_LEN]. */
static fa_mod *mask_mod_make(int k)
{
    if (k == M_NONE)
        return NULL;
    fa_mod *m = fa_mod_create();
    const int q = var(m, FA_MOD_Q_IDX), kv = var(m, FA_MOD_KV_IDX), b = var(m, FA_MOD_B);
    const int causal = bin(m, FA_MOD_GE, q, kv);
    int r = -1;
    if (k == M_CAUSAL) {
        r = causal;
    } else if (k == M_DOC || k == M_DOC_BAD) {
        /* M_DOC_BAD reads at 2 q - 17 (below 0 for the first rows) and 4 kv + 17 (past
         * DOC_LEN for the last keys). */
        const int qi = k == M_DOC ? q : bin(m, FA_MOD_SUB, bin(m, FA_MOD_MUL, q, cst(m, 2)),
                                            cst(m, 17));
        const int ki = k == M_DOC ? kv : bin(m, FA_MOD_ADD, bin(m, FA_MOD_MUL, kv, cst(m, 4)),
                                             cst(m, 17));
        const int iq[2] = {b, qi}, ik[2] = {b, ki};
        r = bin(m, FA_MOD_EQ, fa_mod_aux(m, 0, 2, iq), fa_mod_aux(m, 0, 2, ik));
        if (k == M_DOC)
            r = bin(m, FA_MOD_AND, r, causal);
    } else if (k == M_PREFIX) {
        r = bin(m, FA_MOD_OR, bin(m, FA_MOD_LT, kv, cst(m, PREFIX)), causal);
    } else {
        const int near = bin(m, FA_MOD_LE, bin(m, FA_MOD_SUB, q, kv), cst(m, 48));
        /* Causal within 48 keys; above the diagonal every seventh key (dilated). */
        const int dilated = bin(m, FA_MOD_EQ, bin(m, FA_MOD_MOD, kv, cst(m, 7)), cst(m, 3));
        r = fa_mod_where(m, causal, near, dilated);
    }
    return finish(m, r, FA_MOD_KIND_MASK);
}

/* ---- block masks ------------------------------------------------------------------------ */

/* A block mask's four int32 tensors, host and device: [B, H, nq] and [B, H, nq, nk + 2]. */
typedef struct bm_bufs {
    gpu_buf num, idx, full_num, full_idx;
    int nq, nk, n;
} bm_bufs;

static int32_t *i32_at(gpu_buf *g, int64_t i0, int64_t i1, int64_t i2, int64_t i3)
{
    const fa_tensor *t = &g->host;
    return (int32_t *)t->data + i0 * t->stride[0] + i1 * t->stride[1] + i2 * t->stride[2] +
           (t->ndim == 4 ? i3 * t->stride[3] : 0);
}

/* Shuffles a[0 .. n). */
static void shuffle(int32_t *a, int n)
{
    for (int i = n - 1; i > 0; i--) {
        int j = (int)gu_uniform(0, i + 1);
        j = j > i ? i : j;
        const int32_t x = a[i];
        a[i] = a[j];
        a[j] = x;
    }
}

/* The block mask of c: causal geometry (full below the diagonal, partial on it, skipped above)
 * or random states in unordered lists with a repeat and a block in both lists; batch shared
 * (B = 1) in the random ones. Banded: bands of BAND_ROWS query rows skipped for every other
 * 128-key block (the other band of each head: h shifts them), random states elsewhere. Entries
 * past the counts are junk (never read). */
#define BAND_ROWS 1100
static bm_bufs bm_make(const mod_case *c)
{
    bm_bufs m;
    m.nq = (c->sq + c->q_block - 1) / c->q_block;
    m.nk = (c->sk + c->kv_block - 1) / c->kv_block;
    m.n = m.nk + 2;
    if (m.nk > 64) {
        fprintf(stderr, "FATAL: %s: more than 64 key blocks\n", c->name);
        exit(1);
    }
    const int B = c->bm == BM_CAUSAL ? c->b : 1, H = c->h;
    m.num = gu_buf_new(FA_DTYPE_I32, 3, (int64_t[]){B, H, m.nq}, 0);
    m.full_num = gu_buf_new(FA_DTYPE_I32, 3, (int64_t[]){B, H, m.nq}, 0);
    m.idx = gu_buf_new(FA_DTYPE_I32, 4, (int64_t[]){B, H, m.nq, m.n}, 0);
    m.full_idx = gu_buf_new(FA_DTYPE_I32, 4, (int64_t[]){B, H, m.nq, m.n}, 0);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int qb = 0; qb < m.nq; qb++) {
                int32_t part[64 + 2], full[64 + 2];
                int np = 0, nf = 0;
                for (int kb = 0; kb < m.nk; kb++) {
                    int st; /* 0 skip, 1 partial, 2 full */
                    if (c->bm == BM_CAUSAL) {
                        const int last_row = (qb + 1) * c->q_block - 1 + c->sk - c->sq;
                        const int first_row = qb * c->q_block + c->sk - c->sq;
                        st = kb * c->kv_block > last_row ? 0
                             : (kb + 1) * c->kv_block - 1 <= first_row ? 2
                                                                       : 1;
                    } else if (c->bm == BM_BANDS &&
                               (qb * c->q_block / BAND_ROWS + kb * c->kv_block / 128 + h) % 2 == 0) {
                        st = 0;
                    } else {
                        const double u = gu_uniform(0, 1);
                        st = c->bm == BM_BANDS ? 1 + (u < 0.6) : u < 0.25 ? 0 : u < 0.65 ? 1 : 2;
                    }
                    if (st == 1)
                        part[np++] = kb;
                    else if (st == 2)
                        full[nf++] = kb;
                }
                if (c->bm != BM_CAUSAL) {
                    if (np > 0 && np < m.n)
                        part[np] = part[0], np++; /* a repeat */
                    if (nf > 0 && np < m.n)
                        part[np++] = full[0]; /* in both lists: full */
                    shuffle(part, np);
                    shuffle(full, nf);
                }
                *i32_at(&m.num, b, h, qb, 0) = np;
                *i32_at(&m.full_num, b, h, qb, 0) = nf;
                for (int i = 0; i < m.n; i++) {
                    *i32_at(&m.idx, b, h, qb, i) = i < np ? part[i] : -1000 - i;
                    *i32_at(&m.full_idx, b, h, qb, i) = i < nf ? full[i] : 1 << 30;
                }
            }
    return m;
}

static void bm_upload(bm_bufs *m)
{
    gu_buf_upload(&m->num);
    gu_buf_upload(&m->idx);
    gu_buf_upload(&m->full_num);
    gu_buf_upload(&m->full_idx);
}

static void bm_free(bm_bufs *m)
{
    gu_buf_free(&m->num);
    gu_buf_free(&m->idx);
    gu_buf_free(&m->full_num);
    gu_buf_free(&m->full_idx);
}

/* The device copy made out of range in ways the kernel must ignore: each list gets an index
 * below 0 or past the key blocks appended to its count, and a full-length list a count past
 * its tensor (clamped), an empty one a negative count. The host copy stays as it was: the CPU
 * refuses such entries, and the valid mask is their meaning. */
static void bm_corrupt_device(bm_bufs *m)
{
    gpu_buf *nums[2] = {&m->num, &m->full_num}, *idxs[2] = {&m->idx, &m->full_idx};
    for (int l = 0; l < 2; l++) {
        gpu_buf num = *nums[l], idx = *idxs[l];
        const size_t nb = num.bytes, ib = idx.bytes;
        int32_t *save_n = malloc(nb), *save_i = malloc(ib);
        memcpy(save_n, num.host.data, nb);
        memcpy(save_i, idx.host.data, ib);
        int k = 0;
        for (int64_t b = 0; b < num.host.shape[0]; b++)
            for (int64_t h = 0; h < num.host.shape[1]; h++)
                for (int qb = 0; qb < m->nq; qb++, k++) {
                    int32_t *cnt = i32_at(&num, b, h, qb, 0);
                    if (*cnt == 0 && k % 3 == 0) {
                        *cnt = -4;
                    } else if (*cnt < m->n) {
                        *i32_at(&idx, b, h, qb, *cnt) = k % 2 ? -1 - k : m->nk + k;
                        *cnt += 1;
                        if (*cnt < m->n && k % 5 == 0) /* the rest of the row: all ignored */
                            for (int i = *cnt; i < m->n; i++)
                                *i32_at(&idx, b, h, qb, i) = m->nk + i;
                        if (k % 5 == 0)
                            *cnt = m->n + 7;
                    }
                }
        gu_buf_upload(&num);
        gu_buf_upload(&idx);
        memcpy(num.host.data, save_n, nb);
        memcpy(idx.host.data, save_i, ib);
        free(save_n);
        free(save_i);
    }
}

/* ---- one run ---------------------------------------------------------------------------- */

/* Compares the device's out and lse (downloaded) with the CPU's; rows are [b, sq, h, d]. */
static void compare(const mod_case *c, fa_dtype dt, const gpu_buf *out, const gpu_buf *lse)
{
    void *go = gu_buf_download(out), *gl = gu_buf_download(lse);
    const double tol = dt == FA_DTYPE_BF16 ? 1.6e-2 : 3e-3;
    double err = 0, scale = 1e-3, lerr = 0;
    int64_t unwritten = 0, inf_mismatch = 0, empty_rows = 0;
    for (int b = 0; b < c->b; b++)
        for (int i = 0; i < c->sq; i++)
            for (int h = 0; h < c->h; h++) {
                for (int e = 0; e < c->d; e++) {
                    const int64_t at = b * out->host.stride[0] + i * out->host.stride[1] +
                                       h * out->host.stride[2] + e;
                    const double g = gu_elem_load(go, dt, at);
                    const double r = gu_elem_load(out->host.data, dt, at);
                    if (isnan(g) && !isnan(r)) {
                        unwritten++;
                        continue;
                    }
                    err = fmax(err, fabs(g - r));
                    scale = fmax(scale, fabs(r));
                }
                const int64_t at = b * lse->host.stride[0] + h * lse->host.stride[1] + i;
                const double g = ((const float *)gl)[at], r = ((const float *)lse->host.data)[at];
                empty_rows += isinf(r) != 0;
                if (isnan(g) && !isnan(r))
                    unwritten++;
                else if (isinf(g) || isinf(r))
                    inf_mismatch += g != r;
                else
                    lerr = fmax(lerr, fabs(g - r));
            }
    if (unwritten)
        FAIL("%lld elements of out / lse not written", (long long)unwritten);
    if (err > tol * scale)
        FAIL("out: max |gpu - cpu| %.3g over %.3g * %.3g", err, tol, scale);
    if (lerr > 2e-3 || inf_mismatch)
        FAIL("lse: max |gpu - cpu| %.3g, %lld rows +inf on one side only", lerr,
             (long long)inf_mismatch);
    printf("  %-40s %s: out err %.2e (scale %.2f), lse err %.2e, %lld empty rows (%s)\n",
           c->name, fa_dtype_name(dt), err, scale, lerr, (long long)empty_rows,
           fa_cuda_last_family());
    free(go);
    free(gl);
}

/* Compares the device's gradient g (downloaded) with the CPU's; returns 0 on a failure. */
/* g (of g_dt: dt, or fp32 for a captured table's gradient) against its host copy, to dt's
 * tolerance; the padding of both copies is NaN, so it is passed over. */
static int compare_grad(const mod_case *c, fa_dtype dt, fa_dtype g_dt, const char *name,
                        const gpu_buf *g, int deterministic)
{
    void *got = gu_buf_download(g);
    const int64_t n = (int64_t)(g->bytes / (g_dt == FA_DTYPE_F32 ? 4 : 2));
    /* P^T and dS^T enter the products rounded to the dtype: a few of its ulps over sums of a
     * few hundred terms, relative to the tensor's largest gradient. */
    const double tol = dt == FA_DTYPE_BF16 ? 3e-2 : 6e-3;
    double err = 0, scale = 1e-3;
    int64_t unwritten = 0;
    for (int64_t i = 0; i < n; i++) {
        const double x = gu_elem_load(got, g_dt, i), r = gu_elem_load(g->host.data, g_dt, i);
        if (isnan(x) && !isnan(r)) {
            unwritten++;
            continue;
        }
        err = fmax(err, fabs(x - r));
        scale = fmax(scale, fabs(r));
    }
    free(got);
    int ok = 1;
    if (unwritten) {
        FAIL("%lld elements of %s not written", (long long)unwritten, name);
        ok = 0;
    }
    if (!(err <= tol * scale)) {
        FAIL("%s%s: max |gpu - cpu| %.3g over %.3g * %.3g", name,
             deterministic ? " (deterministic)" : "", err, tol, scale);
        ok = 0;
    }
    printf(" %s %.2e/%.2f", name, err, scale);
    return ok;
}

/* The backward of the forward that a (host tensors, the CPU's out and lse) and ad (device
 * tensors, the GPU's) describe: the CPU's into the buffers' host copies, the GPU's, in both dQ
 * orders, compared with them; with the relative table's gradient (mod_aux_grad[1], its rows
 * padded: strides of its own) where score_mod reads the table. */
static void run_backward(const mod_case *c, fa_dtype dt, fa_fwd_args *a, fa_fwd_args *ad)
{
    gpu_buf dout = gu_buf_new(dt, 4, (int64_t[]){c->b, c->sq, c->h, c->d}, 0);
    gpu_buf dq = gu_buf_new(dt, 4, (int64_t[]){c->b, c->sq, c->h, c->d}, 0);
    gpu_buf dk = gu_buf_new(dt, 4, (int64_t[]){c->b, c->sk, c->hk, c->d}, 0);
    gpu_buf dv = gu_buf_new(dt, 4, (int64_t[]){c->b, c->sk, c->hk, c->d}, 0);
    gu_fill_uniform(&dout, -1, 1);
    gu_buf_upload(&dout);
    const int table = a->mod_aux[1] != NULL;
    gpu_buf dtab = gu_buf_new(FA_DTYPE_F32, 2, (int64_t[]){c->h, 2 * REL_SPAN + 1}, 3);
    /* The mods' backward module built ahead of it: it must build where the backward runs. */
    if (fa_attention_backward_prepare(ad) != FA_STATUS_OK)
        FAIL("fa_attention_backward_prepare: %s", fa_last_error());
    fa_bwd_args hb;
    fa_bwd_args_init(&hb);
    hb.fwd = a, hb.dout = &dout.host, hb.dq = &dq.host, hb.dk = &dk.host, hb.dv = &dv.host;
    hb.mod_aux_grad[1] = table ? &dtab.host : NULL;
    if (fa_attention_backward(&hb) != FA_STATUS_OK) {
        FAIL("CPU backward: %s", fa_last_error());
        goto done;
    }
    fa_bwd_args gb = hb;
    gb.fwd = ad, gb.dout = &dout.dev, gb.dq = &dq.dev, gb.dk = &dk.dev, gb.dv = &dv.dev;
    gb.mod_aux_grad[1] = table ? &dtab.dev : NULL;
    const size_t wsz = fa_attention_backward_workspace_size(&gb);
    if (wsz == 0) {
        FAIL("workspace size 0: %s", fa_last_error());
        goto done;
    }
    fa_cu_deviceptr ws = 0;
    CHECK_CU(gu_drv->mem_alloc(&ws, wsz));
    gb.workspace = (void *)(uintptr_t)ws;
    gb.workspace_size = wsz;
    for (int det = 0; det < 2; det++) {
        gb.deterministic = det;
        gu_buf_poison_device(&dq);
        gu_buf_poison_device(&dk);
        gu_buf_poison_device(&dv);
        gu_buf_poison_device(&dtab);
        if (fa_attention_backward(&gb) != FA_STATUS_OK) {
            FAIL("CUDA backward: %s", fa_last_error());
            break;
        }
        if (gu_drv->ctx_synchronize() != 0) {
            FAIL("CUDA backward: the kernel faulted");
            break;
        }
        if (strcmp(fa_cuda_last_backward_family(), bwd_family_want(c)) != 0) {
            FAIL("the backward ran on %s, not %s", fa_cuda_last_backward_family(),
                 bwd_family_want(c));
            break;
        }
        printf("  %-40s %s backward%s on %s:", c->name, fa_dtype_name(dt), det ? " (det)" : "",
               fa_cuda_last_backward_family());
        compare_grad(c, dt, dt, "dq", &dq, det);
        compare_grad(c, dt, dt, "dk", &dk, det);
        compare_grad(c, dt, dt, "dv", &dv, det);
        if (table)
            compare_grad(c, dt, FA_DTYPE_F32, "dtable", &dtab, det);
        printf("\n");
    }
    gu_drv->mem_free(ws);
done:
    gu_buf_free(&dout);
    gu_buf_free(&dtab);
    gu_buf_free(&dq);
    gu_buf_free(&dk);
    gu_buf_free(&dv);
}

static void run_case(const mod_case *c, fa_dtype dt, int corrupt)
{
    if (!gu_shard_take(gu_attn_cost(c->b, c->h, c->sq, c->sk, c->d, c->d, 0)))
        return;
    gpu_buf q = gu_buf_new(dt, 4, (int64_t[]){c->b, c->sq, c->h, c->d}, 0);
    gpu_buf k = gu_buf_new(dt, 4, (int64_t[]){c->b, c->sk, c->hk, c->d}, 0);
    gpu_buf v = gu_buf_new(dt, 4, (int64_t[]){c->b, c->sk, c->hk, c->d}, 0);
    gpu_buf out = gu_buf_new(dt, 4, (int64_t[]){c->b, c->sq, c->h, c->d}, 0);
    gpu_buf lse = gu_buf_new(FA_DTYPE_F32, 3, (int64_t[]){c->b, c->h, c->sq}, 0);
    gpu_buf doc = gu_buf_new(FA_DTYPE_I32, 2, (int64_t[]){c->b, DOC_LEN}, 0);
    gpu_buf rel = gu_buf_new(FA_DTYPE_F32, 2, (int64_t[]){c->h, 2 * REL_SPAN + 1}, 0);
    gu_fill_uniform(&q, -1, 1);
    gu_fill_uniform(&k, -1, 1);
    gu_fill_uniform(&v, -1, 1);
    gu_fill_uniform(&rel, -2, 2);
    for (int b = 0; b < c->b; b++) { /* documents of random lengths 1 .. 120 */
        int id = (int)gu_uniform(0, 100), left = 0;
        for (int i = 0; i < DOC_LEN; i++, left--) {
            if (left <= 0)
                id += 1, left = 1 + (int)gu_uniform(0, 120);
            ((int32_t *)doc.host.data)[b * DOC_LEN + i] = id;
        }
    }
    gu_buf_upload(&q);
    gu_buf_upload(&k);
    gu_buf_upload(&v);
    gu_buf_upload(&doc);
    gu_buf_upload(&rel);
    gu_buf_poison_device(&out);
    gu_buf_poison_device(&lse);
    bm_bufs bm = {0};
    fa_block_mask bmh = {0}, bmd = {0};
    if (c->bm) {
        bm = bm_make(c);
        bm_upload(&bm);
        if (corrupt)
            bm_corrupt_device(&bm);
        bmh = (fa_block_mask){c->q_block, c->kv_block, &bm.num.host, &bm.idx.host,
                              &bm.full_num.host, &bm.full_idx.host};
        bmd = (fa_block_mask){c->q_block, c->kv_block, &bm.num.dev, &bm.idx.dev,
                              &bm.full_num.dev, &bm.full_idx.dev};
    }
    fa_mod *sm = score_mod_make(c->score, c->h), *mm = mask_mod_make(c->mask);

    fa_fwd_args a;
    fa_fwd_args_init(&a);
    a.q = &q.host, a.k = &k.host, a.v = &v.host, a.out = &out.host, a.lse = &lse.host;
    a.causal = c->causal;
    a.score_mod = sm, a.mask_mod = mm;
    if (c->mask == M_DOC || c->mask == M_DOC_BAD)
        a.mod_aux[0] = &doc.host;
    if (c->score == S_RELPOS)
        a.mod_aux[1] = &rel.host;
    a.block_mask = c->bm ? &bmh : NULL;
    fa_status st = fa_attention_forward(&a);
    fa_fwd_args ah = a; /* the CPU's forward, for its backward */
    if (st != FA_STATUS_OK) {
        FAIL("CPU: %s", fa_last_error());
    } else {
        a.q = &q.dev, a.k = &k.dev, a.v = &v.dev, a.out = &out.dev, a.lse = &lse.dev;
        a.mod_aux[0] = a.mod_aux[0] ? &doc.dev : NULL;
        a.mod_aux[1] = a.mod_aux[1] ? &rel.dev : NULL;
        a.block_mask = c->bm ? &bmd : NULL;
        a.device = 0;
        st = fa_attention_forward(&a);
        if (st != FA_STATUS_OK)
            FAIL("CUDA: %s", fa_last_error());
        else if (gu_drv->ctx_synchronize() != 0)
            FAIL("CUDA: the kernel faulted");
        else if (strcmp(fa_cuda_last_family(), expect_family) != 0)
            FAIL("ran on %s, not %s", fa_cuda_last_family(), expect_family);
        else {
            compare(c, dt, &out, &lse);
            if (with_backward)
                run_backward(c, dt, &ah, &a);
        }
    }
    fa_mod_destroy(sm);
    fa_mod_destroy(mm);
    if (c->bm)
        bm_free(&bm);
    gpu_buf *all[] = {&q, &k, &v, &out, &lse, &doc, &rel};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        gu_buf_free(all[i]);
}

int main(void)
{
    const int start = gu_start("test_gpu_mod", 0x6d6f64677075ull);
    if (start != 0)
        return start;
    /* FA_MOD_PASSES (a list of sm80, sm90, bwd90; unset: all three) picks the passes. */
    const char *passes = getenv("FA_MOD_PASSES");
    if (!passes || !*passes)
        passes = "sm80,sm90,bwd90";
    setenv("FLASHATTN_SM90_MODS", "0", 1);
    setenv("FLASHATTN_BWD_SM90_MODS", "0", 1);
    if (strstr(passes, "sm80")) {
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            run_case(&cases[i], FA_DTYPE_BF16, 0);
            run_case(&cases[i], FA_DTYPE_F16, 0);
        }
        /* Out-of-range block mask entries on the device, for the aligned and the finer masks. */
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
            if (cases[i].bm == BM_RANDOM)
                run_case(&cases[i], FA_DTYPE_BF16, 1);
    }
    /* The forward cases again on the Hopper kernel's hooks, the default on sm_90. */
    unsetenv("FLASHATTN_SM90_MODS");
    unsetenv("FLASHATTN_BWD_SM90_MODS");
    int arch = 0, smem = 0;
    if (fa_cuda_device_arch(0, &arch, &smem) == FA_STATUS_OK && arch == 90 &&
        strstr(passes, "sm90")) {
        printf("test_gpu_mod: the forward on fa_fwd_sm90.cu (the default on sm_90)\n");
        expect_family = "fa_fwd_sm90.cu";
        with_backward = 0;
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            run_case(&cases[i], FA_DTYPE_BF16, 0);
            run_case(&cases[i], FA_DTYPE_F16, 0);
            if (cases[i].bm == BM_RANDOM)
                run_case(&cases[i], FA_DTYPE_BF16, 1);
        }
        expect_family = "fa_fwd_sm80.cu";
        with_backward = 1;
    }
    if (arch == 90 && strstr(passes, "bwd90")) {
        /* The backward cases again on fa_bwd_sm90.cu's hooks where the plan takes them (the
         * default on sm_90; bwd_family_want), from the sm80 family's forward. */
        printf("test_gpu_mod: the backward on fa_bwd_sm90.cu's hooks (the default on sm_90)\n");
        setenv("FLASHATTN_SM90_MODS", "0", 1);
        setenv("FLASHATTN_BWD_SM90_MODS", "1", 1);
        bwd_sm90 = 1;
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            run_case(&cases[i], FA_DTYPE_BF16, 0);
            run_case(&cases[i], FA_DTYPE_F16, 0);
        }
        bwd_sm90 = 0;
        unsetenv("FLASHATTN_BWD_SM90_MODS");
        unsetenv("FLASHATTN_SM90_MODS");
    }
    printf("test_gpu_mod: %d failures\n", failures);
    return failures ? 1 : 0;
}
