/* The kernels' parameter block (kernels/fa_kparams.h) from the validated record: shared by the
 * forward, the backward and the decode launchers. */
#include <stdint.h>

#include "fa_kparams.h"
#include "fa_rules.h"
#include "cuda/fa_cuda.h"
#include "plan/fa_plan.h"

/* The user-defined scoring's part of the block (the fields after zero). */
static void fa_kparams_fill_mods(const fa_params *p, fa_kparams *kp)
{
    const fa_mod_call *c = &p->mods;
    for (int i = 0; i < FA_MOD_AUX_SLOTS; i++) {
        const fa_tensor *t = &c->aux[i];
        if (!t->data)
            continue;
        kp->mod_aux[i] = t->data;
        for (int d = 0; d < 4; d++) { /* past the tensor's dimensions: 1, stride 0 */
            kp->mod_aux_shape[i][d] = d < t->ndim ? t->shape[d] : 1;
            kp->mod_aux_stride[i][d] = d < t->ndim ? t->stride[d] : 0;
        }
    }
    /* (the backward's record only) */
    for (int i = 0; i < FA_MOD_AUX_SLOTS; i++) {
        const fa_tensor *g = &p->mod_aux_grad[i];
        kp->mod_aux_grad[i] = g->data;
        for (int d = 0; d < g->ndim; d++)
            kp->mod_aux_grad_stride[i][d] = g->stride[d];
    }
    const fa_mod_blocks *b = &c->blocks;
    if (!b->num.data)
        return;
    kp->bm_q_block = (int)b->q_block;
    kp->bm_kv_block = (int)b->kv_block;
    kp->bm_nk = (int)b->nk;
    kp->bm_num = b->num.data;
    kp->bm_idx = b->idx.data;
    kp->bm_n = (int)(b->idx.shape[3] < INT32_MAX ? b->idx.shape[3] : INT32_MAX);
    for (int d = 0; d < 4; d++) {
        kp->bm_idx_stride[d] = b->idx.stride[d];
        if (d < 3)
            kp->bm_num_stride[d] = b->num.stride[d];
    }
    if (!b->full_num.data)
        return;
    kp->bm_full_num = b->full_num.data;
    kp->bm_full_idx = b->full_idx.data;
    kp->bm_full_n = (int)(b->full_idx.shape[3] < INT32_MAX ? b->full_idx.shape[3] : INT32_MAX);
    for (int d = 0; d < 4; d++) {
        kp->bm_full_idx_stride[d] = b->full_idx.stride[d];
        if (d < 3)
            kp->bm_full_num_stride[d] = b->full_num.stride[d];
    }
}

/* The farthest element of t from its start, either way, as fa_mod_aux sums the offset. */
static int64_t fa_kparams_far(const fa_tensor *t)
{
    int64_t far = 0;
    for (int d = 0; d < t->ndim; d++)
        far += (t->shape[d] - 1) * (t->stride[d] < 0 ? -t->stride[d] : t->stride[d]);
    return far;
}

/* The plan key's mod_aux: which aux tensors are int32, which have a gradient (the backward's
 * mod_aux_grad) and whether every element's offset fits an int, theirs too; 0 without aux
 * tensors. */
static unsigned fa_kparams_mod_aux(const fa_params *p)
{
    unsigned bits = FA_PLAN_AUX_OFF32;
    for (int i = 0; i < FA_MOD_AUX_SLOTS; i++) {
        const fa_tensor *t = &p->mods.aux[i], *g = &p->mod_aux_grad[i];
        if (!t->data)
            continue;
        bits |= t->dtype == FA_DTYPE_I32 ? 1u << i : 0u;
        bits |= g->data ? FA_PLAN_AUX_GRAD(i) : 0u;
        if (fa_kparams_far(t) > INT32_MAX || (g->data && fa_kparams_far(g) > INT32_MAX))
            bits &= ~FA_PLAN_AUX_OFF32;
    }
    return bits;
}

void fa_kparams_key_mods(const fa_params *p, fa_plan_key *key)
{
    key->features |= p->mods.score_mod ? FA_PLAN_SCORE_MOD : 0;
    key->features |= p->mods.mask_mod ? FA_PLAN_MASK_MOD : 0;
    key->mod_aux = fa_kparams_mod_aux(p);
    if (p->mods.blocks.num.data) {
        key->features |= FA_PLAN_BLOCK_MASK;
        key->bm_q_block = (int)p->mods.blocks.q_block;
        key->bm_kv_block = (int)p->mods.blocks.kv_block;
    }
}

void fa_kparams_fill(const fa_params *p, fa_kparams *kp)
{
    *kp = (fa_kparams){0};
    kp->q = p->q;
    kp->k = p->k;
    kp->v = p->v;
    kp->out = p->out;
    kp->lse = p->lse;
    kp->cu_seqlens_q = p->cu_seqlens_q;
    kp->cu_seqlens_k = p->cu_seqlens_k;
    kp->seqused_k = p->seqused_k;
    kp->alibi_slopes = p->alibi_slopes;
    kp->sinks = p->sinks;
    kp->probs = p->probs;
    kp->q_bstride = p->q_bstride, kp->q_rstride = p->q_rstride, kp->q_hstride = p->q_hstride;
    kp->k_bstride = p->k_bstride, kp->k_rstride = p->k_rstride, kp->k_hstride = p->k_hstride;
    kp->v_bstride = p->v_bstride, kp->v_rstride = p->v_rstride, kp->v_hstride = p->v_hstride;
    kp->o_bstride = p->o_bstride, kp->o_rstride = p->o_rstride, kp->o_hstride = p->o_hstride;
    kp->lse_bstride = p->lse_bstride, kp->lse_hstride = p->lse_hstride;
    kp->lse_rstride = p->lse_rstride;
    kp->alibi_bstride = p->alibi_bstride, kp->alibi_hstride = p->alibi_hstride;
    kp->sinks_stride = p->sinks_stride;
    kp->p_bstride = p->p_bstride, kp->p_hstride = p->p_hstride, kp->p_rstride = p->p_rstride;
    kp->probs_sq = p->probs_sq, kp->probs_sk = p->probs_sk;
    kp->total_q = p->total_q;
    kp->total_k = p->total_k;
    kp->max_sq = p->max_sq, kp->max_sk = p->max_sk;
    kp->seed = p->seed, kp->offset = p->offset;
    kp->b = (int)p->b, kp->h = (int)p->h, kp->hk = (int)p->hk;
    kp->d = (int)p->d, kp->dv = (int)p->dv;
    kp->window_left = p->window_left, kp->window_right = p->window_right;
    kp->probs_block_n = p->probs_block_n;
    kp->keep_threshold = p->keep_threshold;
    kp->dropout_scale = (float)p->dropout_scale;
    kp->scale = (float)p->scale;
    kp->softcap = (float)p->softcap;
    fa_rule_softcap_fold(p->scale, p->softcap, &kp->softcap_pre, &kp->scale_log2);
    if (p->paged && p->is_varlen) {
        kp->block_table = p->block_table;
        kp->bt_bstride = p->bt_bstride;
        kp->page_size = p->page_size;
        /* Without blocks no key exists to read: every sequence is then empty. */
        kp->page_keys = p->num_blocks > 0 ? p->bt_cols * p->page_size : 0;
        fa_div_magic(p->page_size, &kp->page_mul, &kp->page_shift);
        kp->last_block = (int)(p->num_blocks - 1 < INT32_MAX ? p->num_blocks - 1 : INT32_MAX);
    }
    if (fa_mod_call_active(&p->mods))
        fa_kparams_fill_mods(p, kp);
}

int fa_cuda_all_aligned(const int64_t *strides, size_t n, const void *const *ptrs, size_t m)
{
    for (size_t i = 0; i < n; i++)
        if (strides[i] % 8 != 0)
            return 0;
    for (size_t i = 0; i < m; i++)
        if ((uintptr_t)ptrs[i] % 16 != 0)
            return 0;
    return 1;
}

int fa_cuda_rows_aligned(const fa_params *p)
{
    const int64_t strides[] = {p->q_bstride, p->q_rstride, p->q_hstride, p->k_bstride,
                               p->k_rstride, p->k_hstride, p->v_bstride, p->v_rstride,
                               p->v_hstride, p->o_bstride, p->o_rstride, p->o_hstride};
    const void *const ptrs[] = {p->q, p->k, p->v, p->out};
    return p->d % 8 == 0 && p->dv % 8 == 0 &&
           fa_cuda_all_aligned(strides, sizeof strides / sizeof strides[0], ptrs,
                               sizeof ptrs / sizeof ptrs[0]);
}
