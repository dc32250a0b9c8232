/*
 * CPU forward: few query rows run the decode schedule (fa_plan_few_rows, fa_cpu_decode.c;
 * calls with user-defined scoring never do, the mods are evaluated in the tiles below).
 * Otherwise the problem is cut into (sequence, head, query tile) items handed to the thread
 * pool, longest first. Each item is computed start to finish by one thread in a fixed order, so
 * results are bitwise identical for any thread count. bf16 on bf16 products first packs K and V
 * in a parallel pass of its own (fa_cpu_fwd_bf16.h), in passes over the kv heads when large, and
 * gives each thread heads of its own (fa_cpu_forward_owned).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_rules.h"
#include "core/fa_kvcache.h"
#include "cpu/fa_cpu.h"
#include "cpu/fa_cpu_bf16.h"
#include "cpu/fa_cpu_info.h"
#include "cpu/fa_cpu_kernel.h"
#include "cpu/fa_cpu_log.h"
#include "cpu/fa_cpu_mod.h"
#include "plan/fa_plan.h"
#include "util/fa_memory.h"
#include "util/fa_threadpool.h"

#define FA_REAL float
#define FA_FN(name) name##_f32
#define FA_NATIVE FA_DTYPE_F32
#define FA_GEMM fa_cpu_gemm_f32
#define FA_EXPV fa_expf
#define FA_EXP_ROWS fa_cpu_exp_rows_f32
#define FA_TANHV fa_tanhf
#define FA_EXP expf
#define FA_LOG logf
#include "cpu/fa_cpu_rows.h"
#include "cpu/fa_cpu_edge.h"
#include "cpu/fa_cpu_fwd_body.h"
#undef FA_REAL
#undef FA_FN
#undef FA_NATIVE
#undef FA_GEMM
#undef FA_EXPV
#undef FA_EXP_ROWS
#undef FA_TANHV
#undef FA_EXP
#undef FA_LOG

#if defined(FA_CPU_HAS_BF16)
#include "cpu/fa_cpu_fwd_bf16.h"
#endif

#define FA_REAL double
#define FA_FN(name) name##_f64
#define FA_NATIVE FA_DTYPE_F64
#define FA_GEMM fa_cpu_gemm_f64
#define FA_EXPV exp
#define FA_TANHV tanh
#define FA_EXP exp
#define FA_LOG log
#include "cpu/fa_cpu_rows.h"
#include "cpu/fa_cpu_edge.h"
#include "cpu/fa_cpu_fwd_body.h"
#undef FA_REAL
#undef FA_FN
#undef FA_NATIVE
#undef FA_GEMM
#undef FA_EXPV
#undef FA_TANHV
#undef FA_EXP
#undef FA_LOG

/* A query tile of one sequence; every head of it is a separate work item. */
typedef struct fa_cpu_chunk {
    int64_t seq, r0, m;
    int64_t cost; /* keys visited, to order items longest first */
} fa_cpu_chunk;

/* Items are (chunk, head) for the heads [h0, h0 + nh) of the current pass. */
typedef struct fa_cpu_job {
    const fa_params *p;
    const fa_cpu_bf16_kernel *bf16; /* bf16 inputs on bf16 products; NULL: the fp32 path */
    fa_cpu_chunk *chunks;
    int64_t n_chunks;
    int64_t bm; /* query rows per tile (fa_cpu_forward_tile_rows) */
    _Atomic int64_t *next; /* bf16: [nh] each head's next chunk (fa_cpu_forward_owned) */
    int workers;           /* bf16: threads of the pass, each owning heads */
    char *scratch;       /* one region per thread */
    size_t scratch_size; /* bytes per thread */
    size_t mod_offset;   /* where in a thread's region the mods' scratch starts */
    size_t cache_offset; /* and the mods' bounds cache (fa_cpu_mod_cache_size; 0: none) */
    int64_t h0, nh;
    /* bf16 products: the packed K/V blocks (fa_cpu_fwd_bf16.h) of the pass's kv heads, by
     * sequence, then kv head, then block (fa_cpu_kv_pair) */
    uint16_t *kv;
    int64_t *blocks; /* [b + 1] key blocks of the sequences before each */
} fa_cpu_job;

static int fa_cpu_chunk_cmp(const void *a, const void *b)
{
    const fa_cpu_chunk *x = a, *y = b;
    if (x->cost != y->cost)
        return x->cost > y->cost ? -1 : 1;
    if (x->seq != y->seq)
        return x->seq < y->seq ? -1 : 1;
    return x->r0 < y->r0 ? -1 : (x->r0 > y->r0);
}

/* Scratch of one thread's fp32/fp64 tile of up to bm rows (FA_TILE_CARVE lays it out). */
static size_t fa_cpu_scratch_size(const fa_params *p, size_t real_size, int64_t bm_rows)
{
    const size_t bm = (size_t)bm_rows, ld = (size_t)fa_cpu_tile_ld(bm_rows), bn = FA_CPU_BN;
    const size_t d = (size_t)p->d, dvp = (size_t)fa_cpu_gemm_pad(p->dv);
    size_t n = d * ld + bn * d + bn * dvp + bn * ld + bm * dvp + 9 * bm;
    return (n * real_size + 63) & ~(size_t)63;
}

#define FA_TILE_CARVE(REAL, t, base, p, bm)                                                      \
    do {                                                                                         \
        REAL *cur_ = (REAL *)(base);                                                             \
        const int64_t bm_ = (bm), ld_ = fa_cpu_tile_ld(bm), bn_ = FA_CPU_BN;                     \
        const int64_t d_ = (p)->d, dvp_ = fa_cpu_gemm_pad((p)->dv);                              \
        (t).scratch_rows = bm_;                                                                  \
        (t).qt = cur_, cur_ += d_ * ld_;                                                         \
        (t).kbuf = cur_, cur_ += bn_ * d_;                                                       \
        (t).vbuf = cur_, cur_ += bn_ * dvp_;                                                     \
        (t).st = cur_, cur_ += bn_ * ld_;                                                        \
        (t).o = cur_, cur_ += bm_ * dvp_;                                                        \
        (t).m = cur_, cur_ += bm_;                                                               \
        (t).l = cur_, cur_ += bm_;                                                               \
        (t).lo = cur_, cur_ += bm_;                                                              \
        (t).hi = cur_, cur_ += bm_;                                                              \
        (t).diag = cur_, cur_ += bm_;                                                            \
        (t).bmax = cur_, cur_ += bm_;                                                            \
        (t).mlo = cur_, cur_ += bm_;                                                             \
        (t).mhi = cur_, cur_ += bm_;                                                             \
        (t).mcnt = cur_;                                                                         \
    } while (0)

#if defined(FA_CPU_HAS_BF16)
/* The packed blocks of kv head hk (in this pass) of sequence seq. */
static const uint16_t *fa_cpu_kv_pair(const fa_cpu_job *job, int64_t seq, int64_t hk)
{
    const int64_t group = job->p->h / job->p->hk, nkv = job->nh / group, hk0 = job->h0 / group;
    const int64_t n = job->blocks[seq + 1] - job->blocks[seq];
    return job->kv + (job->blocks[seq] * nkv + (hk - hk0) * n) * fa_bf16_block_elems(job->p);
}

/* Item: (key block of all sequences, kv head of this pass). */
static void fa_cpu_pack_task(void *ctx, int64_t item, int thread)
{
    (void)thread;
    const fa_cpu_job *job = ctx;
    const fa_params *p = job->p;
    const int64_t group = p->h / p->hk, nkv = job->nh / group;
    const int64_t block = item / nkv, hk = job->h0 / group + item % nkv;
    int64_t lo = 0, hi = p->b; /* the sequence: blocks[lo] <= block < blocks[lo + 1] */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (job->blocks[mid] <= block)
            lo = mid;
        else
            hi = mid;
    }
    const int64_t b = block - job->blocks[lo];
    uint16_t *dst = (uint16_t *)fa_cpu_kv_pair(job, lo, hk) + b * fa_bf16_block_elems(p);
    fa_bf16_pack_block(p, dst, lo, hk, b);
}
#endif

static void fa_cpu_forward_item(const fa_cpu_job *job, const fa_cpu_chunk *c, int64_t h,
                                int thread)
{
    const fa_params *p = job->p;
    char *base = job->scratch + (size_t)thread * job->scratch_size;
#if defined(FA_CPU_HAS_BF16)
    if (job->bf16) {
        fa_tile_bf16 t;
        fa_bf16_carve(p, base, &t);
        fa_cpu_tile_bf16(p, job->bf16, &t, fa_cpu_kv_pair(job, c->seq, h / (p->h / p->hk)),
                         c->seq, h, c->r0, c->m);
        return;
    }
#endif
    fa_cpu_mod_at at = {c->seq, h, c->r0, 0, NULL, 0, 0, 0};
    fa_cpu_mod_blocks_load(p, &at, base + job->mod_offset,
                           p->dtype == FA_DTYPE_F64 ? sizeof(double) : sizeof(float), c->r0, c->m);
    if (p->dtype == FA_DTYPE_F64) {
        fa_tile_f64 t;
        FA_TILE_CARVE(double, t, base, p, job->bm);
        t.mod_buf = (double *)(base + job->mod_offset);
        t.mod_at = at;
        t.mcache = job->cache_offset ? base + job->cache_offset : NULL;
        fa_cpu_tile_f64(p, &t, c->seq, h, c->r0, c->m);
    } else {
        fa_tile_f32 t;
        FA_TILE_CARVE(float, t, base, p, job->bm);
        t.mod_buf = (float *)(base + job->mod_offset);
        t.mod_at = at;
        t.mcache = job->cache_offset ? base + job->cache_offset : NULL;
        fa_cpu_tile_f32(p, &t, c->seq, h, c->r0, c->m);
    }
}

/* Item (chunk, head) with the heads innermost: the threads start on different heads, and a
 * head's K/V is read again from the shared L3. */
static void fa_cpu_forward_task(void *ctx, int64_t item, int thread)
{
    const fa_cpu_job *job = ctx;
    fa_cpu_forward_item(job, &job->chunks[item / job->nh], job->h0 + item % job->nh, thread);
}

/* The bf16 product kernels where the inputs are bf16 and the CPU has them; NULL: the fp32 tile
 * (fa_cpu_fwd_body.h), which also serves bf16 calls with user-defined scoring. */
static const fa_cpu_bf16_kernel *fa_cpu_forward_bf16_kernel(const fa_params *p)
{
#if defined(FA_CPU_HAS_BF16)
    if (p->dtype == FA_DTYPE_BF16 && !fa_mod_call_active(&p->mods))
        return fa_cpu_bf16_kernel_get();
#endif
    (void)p;
    return NULL;
}

/* Query rows per work item: the plan's rule (fa_plan_cpu_tile_rows) for this machine's L2 share
 * and products. */
int64_t fa_cpu_forward_tile_rows(const fa_params *p)
{
    const int bf16 = fa_cpu_forward_bf16_kernel(p) != NULL;
    return fa_plan_cpu_tile_rows(p, (size_t)fa_cpu_l2_share(), bf16);
}

#if defined(FA_CPU_HAS_BF16)
/* The most bytes of packed K/V a pass holds: kv heads are taken in passes (pack, then compute
 * their tiles) so that the copy never doubles a large K/V. One pass covers h = 32, s = 32768,
 * d = 128 bf16 (256 MiB of K and V, 64 KiB a block of 128 keys). */
#define FA_CPU_PACK_MAX ((size_t)256 << 20)
static size_t fa_cpu_pack_max = FA_CPU_PACK_MAX;

void fa_cpu_forward_set_pack_limit(size_t bytes)
{
    fa_cpu_pack_max = bytes ? bytes : FA_CPU_PACK_MAX;
}

/* Counts each sequence's key blocks into job->blocks and returns the bytes of packed K/V for
 * per_pass kv heads, the most that fit FA_CPU_PACK_MAX (at least one). */
static fa_status fa_cpu_bf16_plan(fa_cpu_job *job, int64_t *per_pass, size_t *bytes)
{
    const fa_params *p = job->p;
    job->blocks = malloc((size_t)(p->b + 1) * sizeof *job->blocks);
    job->next = malloc((size_t)p->h * sizeof *job->next);
    if (!job->blocks || !job->next)
        return fa_error_set(FA_STATUS_OUT_OF_MEMORY,
                            "out of memory for %lld sequences and %lld heads", (long long)p->b,
                            (long long)p->h);
    job->blocks[0] = 0;
    for (int64_t i = 0; i < p->b; i++)
        job->blocks[i + 1] =
            job->blocks[i] + (fa_params_seq(p, i).sk + FA_CPU_BF16_BN - 1) / FA_CPU_BF16_BN;
    const size_t head_bytes = (size_t)job->blocks[p->b] * (size_t)fa_bf16_block_elems(p) * 2;
    int64_t n = head_bytes ? (int64_t)(fa_cpu_pack_max / head_bytes) : p->hk;
    *per_pass = n < 1 ? 1 : n > p->hk ? p->hk : n;
    *bytes = head_bytes * (size_t)*per_pass;
    return FA_STATUS_OK;
}

/*
 * Worker w runs the chunks of its own heads (w, w + workers, ...) longest first, then takes the
 * remaining chunks of the other workers' heads. A head's packed K/V (1 MiB at s = 2048, d = 128)
 * then stays in one core's L2 for all its chunks instead of being read back from L3. The fp32
 * path (2 MiB a head, read from the caller's rows) gains nothing from this order and does not
 * use it. Which thread runs a chunk never changes its result.
 */
static void fa_cpu_forward_owned(void *ctx, int64_t w, int thread)
{
    const fa_cpu_job *job = ctx;
    for (int64_t s = 0; s < job->workers; s++) {
        for (int64_t hh = (w + s) % job->workers; hh < job->nh; hh += job->workers) {
            int64_t c;
            while ((c = atomic_fetch_add_explicit(&job->next[hh], 1, memory_order_relaxed)) <
                   job->n_chunks)
                fa_cpu_forward_item(job, &job->chunks[c], job->h0 + hh, thread);
        }
    }
}

/* Passes over per_pass kv heads at a time: pack their K/V, then compute their tiles. */
static fa_status fa_cpu_forward_bf16(fa_cpu_job *job, int threads, int64_t per_pass,
                                     fa_cpu_log *log)
{
    const fa_params *p = job->p;
    const int64_t group = p->h / p->hk, n_blocks = job->blocks[p->b];
    fa_status st = FA_STATUS_OK;
    for (int64_t g0 = 0; g0 < p->hk && st == FA_STATUS_OK; g0 += per_pass) {
        const int64_t nkv = p->hk - g0 < per_pass ? p->hk - g0 : per_pass;
        const int64_t n_pack = n_blocks * nkv, n_items = job->n_chunks * nkv * group;
        job->h0 = g0 * group;
        job->nh = nkv * group;
        if (n_pack > 0)
            st = fa_cpu_log_phase(log, "pack", threads < n_pack ? threads : (int)n_pack, n_pack,
                                  fa_cpu_pack_task, job);
        if (st != FA_STATUS_OK)
            break;
        job->workers = threads < n_items ? threads : (int)n_items;
        for (int64_t i = 0; i < job->nh; i++)
            atomic_init(&job->next[i], 0);
        st = fa_cpu_log_phase(log, "tiles by owner", job->workers, job->workers,
                              fa_cpu_forward_owned, job);
    }
    return st;
}
#endif

/* Varlen rows that belong to no sequence still get defined values: out 0, lse +inf. */
static void fa_cpu_fill_uncovered(const fa_params *p)
{
    if (!p->is_varlen)
        return;
    size_t esize = fa_dtype_size(p->dtype);
    int64_t first = p->cu_seqlens_q[0], last = p->cu_seqlens_q[p->b];
    for (int64_t r = 0; r < p->total_q; r++) {
        if (r >= first && r < last)
            continue;
        for (int64_t h = 0; h < p->h; h++) {
            char *o = (char *)p->out + (ptrdiff_t)(r * p->o_rstride + h * p->o_hstride) * (ptrdiff_t)esize;
            for (int64_t c = 0; c < p->dv * (int64_t)esize; c++)
                o[c] = 0;
            if (p->lse)
                fa_params_lse_store(p, h * p->lse_hstride + r * p->lse_rstride, INFINITY);
        }
    }
}

fa_status fa_cpu_forward(const fa_params *p)
{
    fa_cpu_hint_rows(p->out, p, p->max_sq, p->total_q, p->h, p->dv, p->o_bstride, p->o_rstride,
                     p->o_hstride);
    fa_cpu_fill_uncovered(p);
    if (fa_plan_few_rows(p))
        return fa_cpu_decode_forward(p);

    const int64_t bm = fa_cpu_forward_tile_rows(p);
    int64_t n_chunks = 0;
    for (int64_t i = 0; i < p->b; i++) {
        fa_seq s = fa_params_seq(p, i);
        n_chunks += (s.sq + bm - 1) / bm;
    }
    if (n_chunks == 0)
        return FA_STATUS_OK;

    fa_cpu_chunk *chunks = malloc((size_t)n_chunks * sizeof *chunks);
    if (!chunks)
        return fa_error_set(FA_STATUS_OUT_OF_MEMORY, "out of memory for %lld work items",
                            (long long)n_chunks);
    int64_t at = 0;
    for (int64_t i = 0; i < p->b; i++) {
        fa_seq s = fa_params_seq(p, i);
        for (int64_t r0 = 0; r0 < s.sq; r0 += bm) {
            int64_t m = s.sq - r0 < bm ? s.sq - r0 : bm;
            int64_t lo, hi;
            fa_params_tile_keys(p, r0, m, s.sq, s.sk, &lo, &hi);
            chunks[at++] = (fa_cpu_chunk){i, r0, m, (hi - lo + 1) * m};
        }
    }
    qsort(chunks, (size_t)n_chunks, sizeof *chunks, fa_cpu_chunk_cmp);

    int64_t n_items = n_chunks * p->h;
    int threads = p->num_threads < n_items ? p->num_threads : (int)n_items;
    size_t real_size = p->dtype == FA_DTYPE_F64 ? sizeof(double) : sizeof(float);
    fa_cpu_job job = {.p = p,
                      .chunks = chunks,
                      .n_chunks = n_chunks,
                      .bm = bm,
                      .scratch_size = fa_cpu_scratch_size(p, real_size, bm),
                      .nh = p->h};
#if defined(FA_CPU_HAS_BF16)
    if ((job.bf16 = fa_cpu_forward_bf16_kernel(p)) != NULL)
        job.scratch_size = fa_bf16_scratch_size(p);
#endif
    job.mod_offset = job.scratch_size;
    job.scratch_size += fa_cpu_mod_scratch_size(p, real_size, bm);
    const size_t cache_size = job.bf16 ? 0 : fa_cpu_mod_cache_size(p, real_size, bm);
    job.cache_offset = cache_size ? job.scratch_size : 0;
    job.scratch_size += cache_size;
    /* Thread tiles and packed K/V in one kept workspace (util/fa_memory.h). */
    const size_t scratch_bytes = job.scratch_size * (size_t)threads;
    size_t kv_bytes = 0;
    int64_t per_pass = 0;
    fa_status st = FA_STATUS_OK;
#if defined(FA_CPU_HAS_BF16)
    if (job.bf16)
        st = fa_cpu_bf16_plan(&job, &per_pass, &kv_bytes);
#endif
    if (st == FA_STATUS_OK && !(job.scratch = fa_memory_take(scratch_bytes + kv_bytes)))
        st = fa_error_set(FA_STATUS_OUT_OF_MEMORY, "out of memory for %zu bytes of workspace",
                          scratch_bytes + kv_bytes);
    fa_cpu_log log;
    fa_cpu_log_begin(&log);
    for (int i = 0; st == FA_STATUS_OK && cache_size && i < threads; i++)
        fa_cpu_mod_cache_reset(job.scratch + (size_t)i * job.scratch_size + job.cache_offset);
    if (st == FA_STATUS_OK) {
        job.kv = (uint16_t *)(job.scratch + scratch_bytes);
#if defined(FA_CPU_HAS_BF16)
        if (job.bf16)
            st = fa_cpu_forward_bf16(&job, threads, per_pass, &log);
        else
#endif
            st = fa_cpu_log_phase(&log, "tiles", threads, n_items, fa_cpu_forward_task, &job);
    }
    if (st == FA_STATUS_OK && log.on) {
        char plan[96];
        snprintf(plan, sizeof plan, "%lld-row tiles%s", (long long)bm,
                 job.bf16 ? ", bf16 products, K/V packed" : "");
        fa_cpu_log_end(&log, p, "forward", plan);
    }
    fa_memory_give(job.scratch);
    free(job.blocks);
    free((void *)job.next);
    free(chunks);
    return st;
}
