/* Block sparsity: the check of a call's block mask and the block states (fa_block_mask.h). */
#include <limits.h>

#include "core/fa_check.h"
#include "mod/fa_block_mask.h"

/* One int32 tensor of the mask: [B, H, nq] (ndim 3) or [B, H, nq, n] (ndim 4) with B in {1, b},
 * H in {1, h}, B and H those of ref when given (kv_num_blocks'), nq >= the call's query blocks;
 * into *view with the B, H strides 0 where they are 1. */
static fa_status fa_blocks_tensor(const fa_tensor *t, const char *name, int ndim,
                                  const fa_tensor *ref, const fa_mod_dims *dims, int64_t nq,
                                  fa_tensor *view)
{
    if (!t)
        return FA_BAD("%s: NULL", name);
    if (t->ndim != ndim)
        return FA_BAD("%s: expected %d dims, got %d", name, ndim, t->ndim);
    FA_TRY(fa_check_strided(t, name, ndim));
    if (t->dtype != FA_DTYPE_I32)
        return FA_BAD("%s: dtype must be int32, got %s", name, fa_dtype_name(t->dtype));
    if (t->shape[0] != 1 && t->shape[0] != dims->b)
        return FA_BAD("%s: dim 0 must be 1 or the batch %lld, got %lld", name,
                      (long long)dims->b, (long long)t->shape[0]);
    if (t->shape[1] != 1 && t->shape[1] != dims->h)
        return FA_BAD("%s: dim 1 must be 1 or the heads %lld, got %lld", name,
                      (long long)dims->h, (long long)t->shape[1]);
    if (ref && (t->shape[0] != ref->shape[0] || t->shape[1] != ref->shape[1] ||
                t->shape[2] != ref->shape[2]))
        return FA_BAD("%s: its first dims (%lld, %lld, %lld) must be its count tensor's (%lld, "
                      "%lld, %lld)",
                      name, (long long)t->shape[0], (long long)t->shape[1],
                      (long long)t->shape[2], (long long)ref->shape[0], (long long)ref->shape[1],
                      (long long)ref->shape[2]);
    if (t->shape[2] < nq)
        return FA_BAD("%s: %lld query blocks, the call has %lld (sq %lld)", name,
                      (long long)t->shape[2], (long long)nq, (long long)dims->sq);
    *view = *t;
    for (int i = 0; i < 2; i++)
        if (t->shape[i] == 1)
            view->stride[i] = 0;
    return FA_STATUS_OK;
}

static int32_t fa_blocks_at(const fa_tensor *t, int64_t b, int64_t h, int64_t qb, int64_t i)
{
    const int64_t at = b * t->stride[0] + h * t->stride[1] + qb * t->stride[2] +
                       (t->ndim == 4 ? i * t->stride[3] : 0);
    return ((const int32_t *)t->data)[at];
}

/* Every count in [0, n] and every listed index >= 0, for the query blocks the call has. */
static fa_status fa_blocks_values(const fa_tensor *num, const fa_tensor *idx, const char *num_name,
                                  const char *idx_name, const fa_mod_dims *dims, int64_t nq)
{
    const int64_t nb = num->shape[0], nh = num->shape[1], n = idx->shape[3];
    for (int64_t b = 0; b < nb; b++)
        for (int64_t h = 0; h < nh; h++)
            for (int64_t qb = 0; qb < nq; qb++) {
                const int32_t c = fa_blocks_at(num, b, h, qb, 0);
                if (c < 0 || c > n)
                    return FA_BAD("%s[%lld, %lld, %lld] is %d: counts are in [0, %lld] (the "
                                  "last dim of %s)",
                                  num_name, (long long)b, (long long)h, (long long)qb, (int)c,
                                  (long long)n, idx_name);
                for (int64_t i = 0; i < c; i++)
                    if (fa_blocks_at(idx, b, h, qb, i) < 0)
                        return FA_BAD("%s[%lld, %lld, %lld, %lld] is %d: block indices are >= 0",
                                      idx_name, (long long)b, (long long)h, (long long)qb,
                                      (long long)i, (int)fa_blocks_at(idx, b, h, qb, i));
            }
    (void)dims;
    return FA_STATUS_OK;
}

fa_status fa_mod_blocks_check(const fa_fwd_args *a, const fa_mod_dims *dims, fa_mod_blocks *blocks)
{
    *blocks = (fa_mod_blocks){0};
    const fa_block_mask *m = a->block_mask;
    if (!m)
        return FA_STATUS_OK;
    if (dims->is_varlen)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "block_mask: the varlen form takes no block mask (dense only)");
    if (m->q_block < 1 || m->kv_block < 1)
        return FA_BAD("block_mask: q_block and kv_block must be >= 1, got %lld and %lld",
                      (long long)m->q_block, (long long)m->kv_block);
    if (m->q_block > INT32_MAX || m->kv_block > INT32_MAX)
        return FA_BAD("block_mask: q_block and kv_block must be below 2^31");
    if (!m->full_kv_num_blocks != !m->full_kv_indices)
        return FA_BAD("block_mask: full_kv_num_blocks and full_kv_indices come together (%s is "
                      "NULL)",
                      m->full_kv_num_blocks ? "full_kv_indices" : "full_kv_num_blocks");
    const int64_t nq = (dims->sq + m->q_block - 1) / m->q_block;
    FA_TRY(fa_blocks_tensor(m->kv_num_blocks, "block_mask.kv_num_blocks", 3, NULL, dims, nq,
                            &blocks->num));
    FA_TRY(fa_blocks_tensor(m->kv_indices, "block_mask.kv_indices", 4, m->kv_num_blocks, dims, nq,
                            &blocks->idx));
    /* Entries in device memory are not read here: the kernels clamp counts into [0, n] and
     * ignore indices outside the keys' blocks. */
    const int on_host = a->device == FA_DEVICE_CPU;
    if (on_host)
        FA_TRY(fa_blocks_values(&blocks->num, &blocks->idx, "block_mask.kv_num_blocks",
                                "block_mask.kv_indices", dims, nq));
    if (m->full_kv_num_blocks) {
        FA_TRY(fa_blocks_tensor(m->full_kv_num_blocks, "block_mask.full_kv_num_blocks", 3,
                                m->kv_num_blocks, dims, nq, &blocks->full_num));
        FA_TRY(fa_blocks_tensor(m->full_kv_indices, "block_mask.full_kv_indices", 4,
                                m->kv_num_blocks, dims, nq, &blocks->full_idx));
        if (on_host)
            FA_TRY(fa_blocks_values(&blocks->full_num, &blocks->full_idx,
                                    "block_mask.full_kv_num_blocks",
                                    "block_mask.full_kv_indices", dims, nq));
    }
    blocks->q_block = m->q_block;
    blocks->kv_block = m->kv_block;
    blocks->nk = (dims->sk + m->kv_block - 1) / m->kv_block;
    return FA_STATUS_OK;
}

/* Marks the listed blocks of (b, h, qb) in row with state, ignoring indices past the keys. */
static void fa_blocks_mark(const fa_tensor *num, const fa_tensor *idx, int64_t b, int64_t h,
                           int64_t qb, int64_t nk, unsigned char state, unsigned char *row)
{
    const int32_t c = fa_blocks_at(num, b, h, qb, 0);
    for (int32_t i = 0; i < c; i++) {
        const int32_t kb = fa_blocks_at(idx, b, h, qb, i);
        if (kb < nk)
            row[kb] = state;
    }
}

void fa_mod_blocks_fill(const fa_mod_blocks *blocks, int64_t b, int64_t h, int64_t qb0,
                        int64_t nqb, unsigned char *states)
{
    const int64_t nk = blocks->nk;
    for (int64_t q = 0; q < nqb; q++) {
        unsigned char *row = states + q * nk;
        for (int64_t kb = 0; kb < nk; kb++)
            row[kb] = FA_BLOCK_SKIP;
        fa_blocks_mark(&blocks->num, &blocks->idx, b, h, qb0 + q, nk, FA_BLOCK_PARTIAL, row);
        if (blocks->full_num.data)
            fa_blocks_mark(&blocks->full_num, &blocks->full_idx, b, h, qb0 + q, nk,
                           FA_BLOCK_FULL, row);
    }
}
