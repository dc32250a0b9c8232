/*
 * fa_block_mask_build on the CPU: for each query block and key block, mask_mod's kept pairs
 * counted by the forward's bounds pass (fa_cpu_mod_bounds_f32, the hoisting evaluator in fp32,
 * as a call evaluates the mask), then each (b, h, query block)'s lists written in
 * FlexAttention's order. A program that reads neither b nor h is evaluated once and its lists
 * copied to every sequence and head.
 */
#include <stdlib.h>
#include <string.h>

#include "cpu/fa_cpu.h"
#include "cpu/fa_cpu_mod.h"
#include "mod/fa_block_mask.h"
#include "mod/fa_mod_program.h"

/* Whether program m reads variable v. */
static int fa_bm_reads(const fa_mod *m, int v)
{
    for (int i = 0; i < m->n_steps; i++)
        if (m->steps[i].op == FA_MOD_OP_VAR && m->steps[i].what == v)
            return 1;
    return 0;
}

static int32_t *fa_bm_at(const fa_tensor *t, int64_t b, int64_t h, int64_t qb, int64_t i)
{
    return (int32_t *)t->data + b * t->stride[0] + h * t->stride[1] + qb * t->stride[2] +
           (t->ndim == 4 ? i * t->stride[3] : 0);
}

/* One (b, h, query block)'s count and list for blocks in state `state`: those first, ascending,
 * then the rest, ascending (a stable descending sort of the 0/1 row, as torch's). */
static void fa_bm_write(const fa_tensor *num, const fa_tensor *idx, int64_t b, int64_t h,
                        int64_t qb, const unsigned char *st, int64_t nk, unsigned char state)
{
    int64_t n = 0;
    for (int64_t kb = 0; kb < nk; kb++)
        if (st[kb] == state)
            *fa_bm_at(idx, b, h, qb, n++) = (int32_t)kb;
    *fa_bm_at(num, b, h, qb, 0) = (int32_t)n;
    for (int64_t kb = 0; kb < nk; kb++)
        if (st[kb] != state)
            *fa_bm_at(idx, b, h, qb, n++) = (int32_t)kb;
}

fa_status fa_cpu_block_mask_build(const fa_params *p, const fa_block_mask_args *a)
{
    const fa_mod *m = a->mask_mod;
    const int64_t qbs = a->q_block, kbs = a->kv_block;
    const int64_t nq = (a->sq + qbs - 1) / qbs, nk = (a->sk + kbs - 1) / kbs;
    const int64_t rb = fa_bm_reads(m, FA_MOD_B) ? a->b : 1, rh = m->reads_h ? a->h : 1;
    const int full = a->full_kv_num_blocks != NULL;
    const size_t scratch = (fa_cpu_mod_scratch_size(p, sizeof(float), qbs) + 63) & ~(size_t)63;
    /* the evaluator's buffers, the rows' bounds (olo, ohi, lo, hi, cnt), a row of states */
    const size_t rows = ((size_t)qbs * sizeof(float) + 63) & ~(size_t)63;
    char *mem = aligned_alloc(64, scratch + 5 * rows + (((size_t)nk + 63) & ~(size_t)63));
    if (!mem)
        return fa_error_set(FA_STATUS_OUT_OF_MEMORY, "fa_block_mask_build: out of memory for "
                                                     "%lld query rows", (long long)qbs);
    float *buf = (float *)mem, *olo = (float *)(mem + scratch), *ohi = olo + rows / 4;
    float *lo = ohi + rows / 4, *hi = lo + rows / 4, *cnt = hi + rows / 4;
    unsigned char *st = (unsigned char *)(cnt + rows / 4);
    for (int64_t i = 0; i < qbs; i++)
        olo[i] = 0.f, ohi[i] = (float)a->sk;
    for (int64_t b = 0; b < rb; b++)
        for (int64_t h = 0; h < rh; h++)
            for (int64_t qb = 0; qb < nq; qb++) {
                const int64_t q0 = qb * qbs, c1 = a->sq - q0 < qbs ? a->sq - q0 : qbs;
                for (int64_t kb = 0; kb < nk; kb++) {
                    const int64_t j0 = kb * kbs, n = a->sk - j0 < kbs ? a->sk - j0 : kbs;
                    const fa_cpu_mod_at at = {.b = b, .h = h, .q0 = q0, .j0 = j0};
                    fa_cpu_mod_bounds_f32(p, buf, n, 0, c1, &at, olo, ohi, lo, hi, cnt);
                    int64_t kept = 0;
                    for (int64_t i = 0; i < c1; i++)
                        kept += (int64_t)cnt[i];
                    st[kb] = kept == 0                        ? FA_BLOCK_SKIP
                             : full && kept == qbs * kbs ? FA_BLOCK_FULL
                                                         : FA_BLOCK_PARTIAL;
                }
                /* every sequence and head this evaluation stands for */
                for (int64_t bo = b; bo < a->b; bo += rb)
                    for (int64_t ho = h; ho < a->h; ho += rh) {
                        fa_bm_write(a->kv_num_blocks, a->kv_indices, bo, ho, qb, st, nk,
                                    FA_BLOCK_PARTIAL);
                        if (full)
                            fa_bm_write(a->full_kv_num_blocks, a->full_kv_indices, bo, ho, qb,
                                        st, nk, FA_BLOCK_FULL);
                    }
            }
    free(mem);
    return FA_STATUS_OK;
}
