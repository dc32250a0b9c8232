/*
 * CPU attention against a KV cache (fa_attention_kvcache): append, then attend, then (with
 * split-KV) combine. The forward's few-row problems (fa_plan_few_rows) run the same
 * schedule, their keys read as a contiguous cache (fa_cpu_decode_forward).
 *
 * Work items are (sequence, group of kv heads, tile of packed rows, key chunk). Packing the
 * g = h / hk query heads of each kv head into the rows of one tile reads each K/V row once for
 * all of them, and a group of kv heads is contiguous in the usual [pos, hk, d] layout, so a
 * thread streams through memory. Cutting the keys into chunks (split-KV) gives every core work
 * when b * hk is small, as in decoding a few sequences. Each item runs start to finish on one
 * thread in a fixed order and the chunks are merged in split order, so for a given split count
 * the result does not depend on the thread count.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_rules.h"
#include "core/fa_kvcache.h"
#include "cpu/fa_cpu.h"
#include "cpu/fa_cpu_info.h"
#include "cpu/fa_cpu_kernel.h"
#include "cpu/fa_cpu_log.h"
#include "util/fa_threadpool.h"

/* Tunables; -D overrides them for experiments. */
#ifndef FA_KV_BM
#define FA_KV_BM FA_CPU_DECODE_ROWS /* packed (query row, head) rows per tile */
#endif
#ifndef FA_KV_BN
#define FA_KV_BN 128 /* key rows (keys x kv heads of the item) per block */
#endif
#ifndef FA_KV_RUN_BYTES
#define FA_KV_RUN_BYTES (32 << 10) /* most bytes of one kv head's key rows in a block */
#endif
#ifndef FA_KV_PREFETCH
#define FA_KV_PREFETCH 8 /* positions loaded ahead of use */
#endif
#ifndef FA_KV_PREFETCH_BLOCKS
#define FA_KV_PREFETCH_BLOCKS 4 /* blocks ahead that a streaming call prefetches */
#endif
#ifndef FA_KV_LANES_F32
#define FA_KV_LANES_F32 16 /* partial sums of an fp32 dot product */
#endif

typedef struct fa_kv_item {
    int64_t seq;      /* sequence */
    int64_t kh0, nkh; /* kv heads [kh0, kh0 + nkh) */
    int64_t p0, m;    /* packed rows [p0, p0 + m) */
    int64_t split;    /* chunk index, for the workspace */
    int64_t j0, j1;   /* the chunk: keys [j0, j1) of the sequence */
    int64_t cost;     /* key-row products, to schedule the longest first */
} fa_kv_item;

/*
 * Sequence i as the decode reads it: query rows [q0, q0 + sq) (of its batch row, or varlen
 * rows), keys at cache positions [k0, k0 + n), its first row at row ws of a split's workspace.
 * A forward's record reads as a contiguous cache (fa_cpu_decode_forward): a dense batch row is
 * a cache row, and varlen keys lie in one block from cu_seqlens_k.
 */
typedef struct fa_kv_seq {
    int64_t q0, sq, k0, n, ws;
} fa_kv_seq;

static inline fa_kv_seq fa_kv_seq_get(const fa_params *p, int64_t i)
{
    const fa_seq s = fa_params_seq(p, i);
    fa_kv_seq r = {s.q_start, s.sq, s.k_start, s.sk, 0};
    if (p->is_varlen) {
        r.ws = s.q_start - p->cu_seqlens_q[0];
    } else {
        r.k0 = fa_kv_seq_start(p, i);
        r.n = fa_kv_seq_end(p, i) - r.k0;
        r.ws = i * p->max_sq;
    }
    return r;
}

/*
 * The run of packed rows from row i that share a query row and a kv head (the same keys, the
 * same K and V rows) in an item of m packed rows from p0, per_row = nkh * g of them per query
 * row: returns its end, with its kv head (from the item's first) and its keys [a, b) among the
 * nb keys of the block from j0, of a sequence of sq query rows and n keys.
 */
static inline int64_t fa_kv_run(const fa_params *p, int64_t p0, int64_t per_row, int64_t g,
                                int64_t m, int64_t i, int64_t sq, int64_t n, int64_t j0,
                                int64_t nb, int64_t *e, int64_t *a, int64_t *b)
{
    const int64_t r = (p0 + i) / per_row, within = (p0 + i) % per_row;
    *e = within / g;
    /* per_row is a multiple of g, so the run ends at the next multiple of g (or at m). */
    const int64_t i1 = i + g - within % g < m ? i + g - within % g : m;
    fa_params_key_range(p, r, sq, n, a, b);
    *a = *a - j0 > 0 ? *a - j0 : 0;
    *b = *b - j0 < nb ? *b - j0 : nb;
    return i1;
}

/* Keys per block of an item of nkh kv heads: FA_KV_BN key rows, fewer while one head's key
 * rows would outgrow FA_KV_RUN_BYTES. Each run of packed rows (a query row of a kv head) reads
 * them again, from L1 only if they stay there. */
static inline int64_t fa_kv_block_keys(const fa_params *p, int64_t nkh)
{
    int64_t bn = FA_KV_BN / nkh > 0 ? FA_KV_BN / nkh : 1;
    const int64_t row = p->d * (int64_t)fa_dtype_size(p->kv_dtype);
    while (bn > 16 && bn * row > FA_KV_RUN_BYTES)
        bn /= 2;
    return bn;
}

/* How the cache rows that the fp32 kernels read in place are stored (fa_kv_load_chunk): as
 * FA_REAL itself, or as bf16 or fp8 codes widened in registers. */
enum { FA_KV_FORM_REAL, FA_KV_FORM_BF16, FA_KV_FORM_E4M3, FA_KV_FORM_E5M2 };

static inline int fa_kv_form(fa_dtype dtype)
{
    switch (dtype) {
    case FA_DTYPE_BF16:
        return FA_KV_FORM_BF16;
    case FA_DTYPE_F8E4M3:
        return FA_KV_FORM_E4M3;
    case FA_DTYPE_F8E5M2:
        return FA_KV_FORM_E5M2;
    default:
        return FA_KV_FORM_REAL;
    }
}

#define FA_REAL float
#define FA_FN(name) name##_f32
#define FA_NATIVE FA_DTYPE_F32
#define FA_GEMM fa_cpu_gemm_f32
#define FA_EXP expf
#define FA_EXP_LOOP fa_expf /* fa_cpu_math.h: vectorises, unlike libm's expf */
#define FA_TANH tanhf
#define FA_LOG logf
#define FA_LANES FA_KV_LANES_F32
#include "cpu/fa_cpu_rows.h"
#include "cpu/fa_cpu_decode_append.h"
#include "cpu/fa_cpu_decode_body.h"
#undef FA_REAL
#undef FA_FN
#undef FA_GEMM
#undef FA_NATIVE
#undef FA_EXP
#undef FA_EXP_LOOP
#undef FA_TANH
#undef FA_LOG
#undef FA_LANES

#define FA_REAL double
#define FA_FN(name) name##_f64
#define FA_NATIVE FA_DTYPE_F64
#define FA_GEMM fa_cpu_gemm_f64
#define FA_EXP exp
#define FA_EXP_LOOP exp
#define FA_TANH tanh
#define FA_LOG log
#define FA_LANES 8
#include "cpu/fa_cpu_rows.h"
#include "cpu/fa_cpu_decode_append.h"
#include "cpu/fa_cpu_decode_body.h"
#undef FA_REAL
#undef FA_FN
#undef FA_GEMM
#undef FA_NATIVE
#undef FA_EXP
#undef FA_TANH
#undef FA_LOG
#undef FA_LANES
#undef FA_EXP_LOOP

typedef struct fa_kv_job {
    const fa_params *p;
    fa_kv_item *items;
    char *scratch;       /* one region per thread */
    size_t scratch_size; /* bytes per thread */
    void *ws_o;          /* split workspace [splits, ws_rows, h, dv], or NULL */
    void *ws_lse;        /* [splits, ws_rows, h] */
    int64_t ws_rows;     /* query rows of the call (fa_kv_seq's ws) */
    int stream;          /* the call's K/V outgrow the last-level cache: prefetch them */
} fa_kv_job;

/* A head dimension rounded up to the kernel's partial-sum lanes. */
static int64_t fa_kv_padded(const fa_params *p, int64_t dim)
{
    const int64_t lanes = p->dtype == FA_DTYPE_F64 ? 8 : FA_KV_LANES_F32;
    return (dim + lanes - 1) / lanes * lanes;
}

static size_t fa_kv_scratch_size(const fa_params *p, size_t real_size)
{
    const int64_t dp = fa_kv_padded(p, p->d), dvp = fa_kv_padded(p, p->dv);
    size_t n = (size_t)(FA_KV_BM * dp + FA_KV_BN * dp + FA_KV_BN * dvp + FA_KV_BM * FA_KV_BN +
                        FA_KV_BM * dvp + 3 * FA_KV_BM);
    return (n * real_size + 63) & ~(size_t)63;
}

#define FA_KV_CARVE(REAL, t, base, dp, dvp)                                                      \
    do {                                                                                         \
        REAL *cur_ = (REAL *)(base);                                                             \
        (t).q = cur_;                                                                            \
        cur_ += FA_KV_BM * (dp);                                                                 \
        (t).k = cur_;                                                                            \
        cur_ += FA_KV_BN * (dp);                                                                 \
        (t).v = cur_;                                                                            \
        cur_ += FA_KV_BN * (dvp);                                                                \
        (t).s = cur_;                                                                            \
        cur_ += FA_KV_BM * FA_KV_BN;                                                             \
        (t).o = cur_;                                                                            \
        cur_ += FA_KV_BM * (dvp);                                                                \
        (t).m = cur_;                                                                            \
        cur_ += FA_KV_BM;                                                                        \
        (t).l = cur_;                                                                            \
        cur_ += FA_KV_BM;                                                                        \
        (t).slope = cur_;                                                                        \
    } while (0)

static void fa_kv_attend_task(void *ctx, int64_t item, int thread)
{
    const fa_kv_job *job = ctx;
    const fa_params *p = job->p;
    const int64_t dp = fa_kv_padded(p, p->d), dvp = fa_kv_padded(p, p->dv);
    char *base = job->scratch + (size_t)thread * job->scratch_size;
    if (p->dtype == FA_DTYPE_F64) {
        fa_kv_tile_f64 t;
        FA_KV_CARVE(double, t, base, dp, dvp);
        fa_kv_attend_f64(p, &t, &job->items[item], job->ws_o, job->ws_lse, job->ws_rows,
                         job->stream);
    } else {
        fa_kv_tile_f32 t;
        FA_KV_CARVE(float, t, base, dp, dvp);
        fa_kv_attend_f32(p, &t, &job->items[item], job->ws_o, job->ws_lse, job->ws_rows,
                         job->stream);
    }
}

static void fa_kv_append_task(void *ctx, int64_t item, int thread)
{
    const fa_params *p = ctx;
    (void)thread;
    if (p->dtype == FA_DTYPE_F64)
        fa_kv_append_head_f64(p, item);
    else
        fa_kv_append_head_f32(p, item);
}

static int fa_kv_item_cmp(const void *a, const void *b)
{
    const fa_kv_item *x = a, *y = b;
    if (x->cost != y->cost)
        return x->cost > y->cost ? -1 : 1;
    if (x->seq != y->seq)
        return x->seq < y->seq ? -1 : 1;
    if (x->kh0 != y->kh0)
        return x->kh0 < y->kh0 ? -1 : 1;
    if (x->p0 != y->p0)
        return x->p0 < y->p0 ? -1 : 1;
    return x->split < y->split ? -1 : (x->split > y->split);
}

/*
 * The attention of the decode schedule, with its split-KV merge. The split count is p's
 * num_splits, else the plan's: from the shape only for a forward (few), whose results are the
 * same bits for any thread count, from the thread count for the KV cache. what names the call
 * in its FLASHATTN_LOG line.
 */
static fa_status fa_kv_attention(const fa_params *p, int few, fa_cpu_log *log, const char *what)
{
    /* The items, longest first: kv heads grouped by the plan, their packed rows in tiles. */
    const int64_t g = p->h / p->hk, group = fa_plan_cpu_decode_heads(p, p->max_sq);
    int64_t base_items = 0, max_keys = 0, ws_rows = 0;
    for (int64_t i = 0; i < p->b; i++) {
        const fa_kv_seq sg = fa_kv_seq_get(p, i);
        for (int64_t kh0 = 0; kh0 < p->hk; kh0 += group) {
            const int64_t nkh = p->hk - kh0 < group ? p->hk - kh0 : group;
            base_items += (sg.sq * nkh * g + FA_KV_BM - 1) / FA_KV_BM;
        }
        max_keys = sg.n > max_keys ? sg.n : max_keys;
        ws_rows = sg.ws + sg.sq > ws_rows ? sg.ws + sg.sq : ws_rows;
    }
    if (base_items == 0)
        return FA_STATUS_OK;
    const int64_t splits = p->num_splits > 0 ? p->num_splits
                           : few ? fa_plan_cpu_few_splits(base_items, max_keys)
                                 : fa_plan_cpu_splits(p->num_threads, base_items, max_keys);

    const int64_t n_items = base_items * splits;
    fa_kv_item *items = malloc((size_t)n_items * sizeof *items);
    if (!items)
        return fa_error_set(FA_STATUS_OUT_OF_MEMORY, "out of memory for %lld work items",
                            (long long)n_items);
    int64_t at = 0;
    for (int64_t i = 0; i < p->b; i++) {
        const fa_kv_seq sg = fa_kv_seq_get(p, i);
        for (int64_t kh0 = 0; kh0 < p->hk; kh0 += group) {
            const int64_t nkh = p->hk - kh0 < group ? p->hk - kh0 : group;
            const int64_t rows = sg.sq * nkh * g, per_row = nkh * g;
            for (int64_t p0 = 0; p0 < rows; p0 += FA_KV_BM) {
                const int64_t m = rows - p0 < FA_KV_BM ? rows - p0 : FA_KV_BM;
                int64_t lo, hi, unused;
                fa_params_key_range(p, p0 / per_row, sg.sq, sg.n, &lo, &unused);
                fa_params_key_range(p, (p0 + m - 1) / per_row, sg.sq, sg.n, &unused, &hi);
                /* Chunks of whole key blocks, so that a split never adds a ragged block. */
                const int64_t bn = fa_kv_block_keys(p, nkh);
                int64_t chunk = (hi - lo + splits - 1) / splits;
                chunk = (chunk + bn - 1) / bn * bn;
                for (int64_t s = 0; s < splits; s++) {
                    int64_t j0 = lo + s * chunk < hi ? lo + s * chunk : hi;
                    int64_t j1 = j0 + chunk < hi ? j0 + chunk : hi;
                    items[at++] =
                        (fa_kv_item){i, kh0, nkh, p0, m, s, j0, j1, (j1 - j0) * m};
                }
            }
        }
    }
    qsort(items, (size_t)n_items, sizeof *items, fa_kv_item_cmp);

    fa_status st = FA_STATUS_OK;
    const size_t real_size = p->dtype == FA_DTYPE_F64 ? sizeof(double) : sizeof(float);
    const int threads = p->num_threads < n_items ? p->num_threads : (int)n_items;
    fa_kv_job job = {p, items, NULL, fa_kv_scratch_size(p, real_size), NULL, NULL, ws_rows, 0};
    /* Prefetching ahead pays where the K/V come from DRAM and costs where they sit in the
     * cache; what the call reads against the last-level cache (32 MiB when unknown) tells the
     * two apart. */
    double kv_bytes = 0;
    for (int64_t i = 0; i < p->b; i++)
        kv_bytes += (double)fa_kv_seq_get(p, i).n * (double)p->hk * (double)(p->d + p->dv) *
                    (double)fa_dtype_size(p->kv_dtype);
    const long llc = fa_cpu_info_get()->llc_bytes;
    job.stream = kv_bytes > (double)(llc > 0 ? llc : 32L << 20);
    job.scratch = aligned_alloc(64, job.scratch_size * (size_t)threads);
    const size_t rows = (size_t)(ws_rows * p->h);
    if (splits > 1) {
        job.ws_o = malloc((size_t)splits * rows * (size_t)p->dv * real_size);
        job.ws_lse = malloc((size_t)splits * rows * real_size);
    }
    if (!job.scratch || (splits > 1 && (!job.ws_o || !job.ws_lse))) {
        st = fa_error_set(FA_STATUS_OUT_OF_MEMORY, "out of memory for the attention buffers");
        goto done;
    }
    st = fa_cpu_log_phase(log, "attend", threads, n_items, fa_kv_attend_task, &job);
    if (st != FA_STATUS_OK || splits == 1)
        goto done;

    /* The chunks merge as a combine call: the record already holds its shape, out, lse, sinks
     * and threads; the partials are the split workspace. Varlen rows merge as one sequence of
     * the rows from cu_seqlens_q[0]. */
    fa_params c = *p;
    if (p->is_varlen) {
        const int64_t r0 = p->cu_seqlens_q[0];
        c.b = 1;
        c.max_sq = ws_rows;
        c.out = (char *)p->out + (ptrdiff_t)(r0 * p->o_rstride) * (ptrdiff_t)fa_dtype_size(p->dtype);
        c.o_bstride = 0;
        if (p->lse)
            c.lse = (char *)p->lse + (ptrdiff_t)(r0 * p->lse_rstride) *
                                         (ptrdiff_t)fa_dtype_size(p->lse_dtype);
        c.lse_bstride = 0;
    }
    c.num_splits = splits;
    c.accum_dtype = p->dtype == FA_DTYPE_F64 ? FA_DTYPE_F64 : FA_DTYPE_F32;
    c.oaccum = job.ws_o;
    c.oaccum_hstride = p->dv;
    c.oaccum_rstride = p->h * c.oaccum_hstride;
    c.oaccum_bstride = c.max_sq * c.oaccum_rstride;
    c.oaccum_sstride = ws_rows * c.oaccum_rstride;
    c.lseaccum = job.ws_lse;
    c.lseaccum_hstride = 1;
    c.lseaccum_rstride = p->h;
    c.lseaccum_bstride = c.max_sq * p->h;
    c.lseaccum_sstride = ws_rows * p->h;
    c.empty_lse = INFINITY; /* the forward's convention for a row that sees no key */
    c.log = log;
    st = fa_cpu_combine(&c);
done:
    if (log->on && st == FA_STATUS_OK) {
        char head[224];
        snprintf(head, sizeof head,
                 "%s %s b %lld h %lld/%lld sq %lld keys %lld d %lld/%lld, %d threads, "
                 "%lld splits%s",
                 what, fa_dtype_name(p->dtype), (long long)p->b, (long long)p->h,
                 (long long)p->hk, (long long)p->max_sq, (long long)max_keys, (long long)p->d,
                 (long long)p->dv, p->num_threads, (long long)splits,
                 job.stream ? ", prefetch" : "");
        fa_cpu_log_print(log, head);
    }
    free(job.ws_lse);
    free(job.ws_o);
    free(job.scratch);
    free(items);
    return st;
}

fa_status fa_cpu_kvcache(const fa_params *p)
{
    fa_cpu_log log;
    fa_cpu_log_begin(&log);
    if (p->s_new > 0) {
        int threads = p->num_threads < p->hk ? p->num_threads : (int)p->hk;
        fa_status st =
            fa_cpu_log_phase(&log, "append", threads, p->hk, fa_kv_append_task, (void *)p);
        if (st != FA_STATUS_OK)
            return st;
    }
    return fa_kv_attention(p, 0, &log, "kvcache");
}

/* A forward's record as a contiguous cache: each dense batch row one block of max_sk rows; all
 * varlen keys one block, whose sequences start at cu_seqlens_k (fa_kv_seq_get). A paged varlen
 * forward keeps its pages: its keys are positions from 0 of its block_table row. Nothing else of
 * the cache's own (append, rotary, indices) applies. */
fa_status fa_cpu_decode_forward(const fa_params *p)
{
    fa_params d = *p;
    d.kv_dtype = p->dtype;
    if (!p->paged) {
        d.page_size = p->is_varlen ? p->total_k : p->max_sk;
        d.page_size = d.page_size > 0 ? d.page_size : 1;
        d.num_blocks = p->is_varlen ? 1 : p->b;
        d.k_bstride = p->is_varlen ? 0 : p->k_bstride;
        d.v_bstride = p->is_varlen ? 0 : p->v_bstride;
        d.block_table = NULL;
    }
    d.batch_idx = NULL;
    d.cache_seqlens = NULL;
    d.leftpad = NULL;
    d.s_new = 0;
    d.rot_cos = d.rot_sin = NULL;
    d.num_splits = 0;
    fa_cpu_log log;
    fa_cpu_log_begin(&log);
    return fa_kv_attention(&d, 1, &log, "forward (decode schedule)");
}
