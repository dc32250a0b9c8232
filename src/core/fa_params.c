/*
 * Validation: every rule a caller can break is checked here, once, with a message that names the
 * argument. Backends receive an fa_params they can trust.
 */
#include <math.h>

#include "core/fa_check.h"
#include "core/fa_fp8.h"
#include "core/fa_options.h"
#include "core/fa_params.h"
#include "core/fa_philox.h"

/* cu_seqlens: int32 [b+1], non-negative, non-decreasing, within total rows and max_seqlen.
 * The values are checked only when they live in host memory (on_host): device offsets are never
 * read here, and the CUDA kernels clamp them into the tensors instead. */
static fa_status fa_check_cu_seqlens(const fa_tensor *t, const char *name, int64_t b,
                                     int64_t total, int64_t max_seqlen, const char *max_name,
                                     int on_host)
{
    FA_TRY(fa_check_tensor(t, name, 1));
    FA_TRY(fa_check_dtype(t, name, FA_DTYPE_I32, "sequence offsets"));
    FA_TRY(fa_check_dim(t, name, 0, b + 1, "batch + 1"));
    if (!on_host)
        return FA_STATUS_OK;
    const int32_t *cu = (const int32_t *)t->data;
    if (cu[0] < 0)
        return FA_BAD("%s: first offset is negative (%d)", name, cu[0]);
    for (int64_t i = 0; i < b; i++) {
        int64_t len = (int64_t)cu[i + 1] - cu[i];
        if (len < 0)
            return FA_BAD("%s: offsets must be non-decreasing, but [%lld]=%d > [%lld]=%d", name,
                          (long long)i, cu[i], (long long)(i + 1), cu[i + 1]);
        if (len > max_seqlen)
            return FA_BAD("%s: sequence %lld has length %lld > %s=%lld", name, (long long)i,
                          (long long)len, max_name, (long long)max_seqlen);
    }
    if (cu[b] > total)
        return FA_BAD("%s: last offset %d is past the tensor's %lld rows", name, cu[b],
                      (long long)total);
    return FA_STATUS_OK;
}

static fa_status fa_check_inputs(const fa_fwd_args *a, fa_params *p)
{
    const fa_tensor *q = a->q, *k = a->k, *v = a->v, *o = a->out;
    p->is_varlen = a->cu_seqlens_q != NULL || a->cu_seqlens_k != NULL;
    if (p->is_varlen && (!a->cu_seqlens_q || !a->cu_seqlens_k))
        return FA_BAD("%s: the varlen form needs both cu_seqlens_q and cu_seqlens_k",
                      a->cu_seqlens_q ? "cu_seqlens_k" : "cu_seqlens_q");
    if (!p->is_varlen && a->seqused_k)
        return FA_BAD("seqused_k: only allowed in the varlen form (with cu_seqlens_q/k)");

    if (!p->is_varlen && a->block_table)
        return FA_BAD("block_table: paged k/v are taken in the varlen form only (with "
                      "cu_seqlens_q/k), as upstream");
    p->paged = a->block_table != NULL;

    int nd = p->is_varlen ? 3 : 4;
    int hd = nd - 2;             /* index of the heads dimension */
    int kd = p->paged ? 2 : hd; /* and of k's and v's: [num_blocks, page_size, hk, d] */
    FA_TRY(fa_check_tensor(q, "q", nd));
    FA_TRY(fa_check_tensor(k, "k", kd + 2));
    FA_TRY(fa_check_tensor(v, "v", kd + 2));
    FA_TRY(fa_check_tensor(o, "out", nd));

    const int fp8 = fa_dtype_is_fp8(q->dtype);
    if (!fa_dtype_is_float(q->dtype) && !fp8)
        return FA_BAD("q: dtype must be fp32, fp16, bf16, fp64, fp8_e4m3 or fp8_e5m2, got %s",
                      fa_dtype_name(q->dtype));
    if (k->dtype != q->dtype)
        return FA_BAD("k: dtype %s does not match q's %s", fa_dtype_name(k->dtype),
                      fa_dtype_name(q->dtype));
    if (v->dtype != q->dtype)
        return FA_BAD("v: dtype %s does not match q's %s", fa_dtype_name(v->dtype),
                      fa_dtype_name(q->dtype));
    if (fp8 && o->dtype != FA_DTYPE_BF16 && o->dtype != FA_DTYPE_F16)
        return FA_BAD("out: dtype must be bf16 or fp16 with %s inputs (as FA3's bf16), got %s",
                      fa_dtype_name(q->dtype), fa_dtype_name(o->dtype));
    if (!fp8 && o->dtype != q->dtype)
        return FA_BAD("out: dtype %s does not match q's %s", fa_dtype_name(o->dtype),
                      fa_dtype_name(q->dtype));
    if (fp8 && a->device != FA_DEVICE_CPU && !fa_sm90_fp8_enabled())
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "q: dtype %s is not supported on a CUDA device yet (the CPU "
                            "backend computes fp8)",
                            fa_dtype_name(q->dtype));
    p->dtype = q->dtype;
    p->out_dtype = o->dtype;

    p->h = q->shape[hd];
    p->d = q->shape[hd + 1];
    p->hk = k->shape[kd];
    p->dv = v->shape[kd + 1];
    if (p->d < 1 || p->d > FA_MAX_HEAD_DIM)
        return FA_BAD("q: head_dim must be in [1, %d], got %lld", FA_MAX_HEAD_DIM,
                      (long long)p->d);
    if (p->dv < 1 || p->dv > FA_MAX_HEAD_DIM)
        return FA_BAD("v: head_dim must be in [1, %d], got %lld", FA_MAX_HEAD_DIM,
                      (long long)p->dv);
    if (fp8 && (p->d % 16 != 0 || p->dv % 16 != 0))
        return FA_BAD("%s: head_dim must be a multiple of 16 with fp8 inputs (as upstream), got "
                      "%lld",
                      p->d % 16 ? "q" : "v", (long long)(p->d % 16 ? p->d : p->dv));
    FA_TRY(fa_check_dim(k, "k", kd + 1, p->d, "head_dim, as q"));
    if (p->h < 1)
        return FA_BAD("q: number of heads must be positive, got %lld", (long long)p->h);
    if (p->hk < 1)
        return FA_BAD("k: number of heads must be positive, got %lld", (long long)p->hk);
    if (p->h % p->hk != 0)
        return FA_BAD("k: number of kv heads (%lld) must divide the number of query heads in q "
                      "(%lld)",
                      (long long)p->hk, (long long)p->h);
    FA_TRY(fa_check_dim(v, "v", kd, p->hk, "kv heads, as k"));
    FA_TRY(fa_check_dim(o, "out", hd, p->h, "heads, as q"));
    FA_TRY(fa_check_dim(o, "out", hd + 1, p->dv, "head_dim, as v"));

    if (!p->is_varlen) {
        p->b = q->shape[0];
        p->max_sq = q->shape[1];
        p->max_sk = k->shape[1];
        if (p->b < 1)
            return FA_BAD("q: batch size must be positive, got %lld", (long long)p->b);
        FA_TRY(fa_check_dim(k, "k", 0, p->b, "batch, as q"));
        FA_TRY(fa_check_dim(v, "v", 0, p->b, "batch, as q"));
        FA_TRY(fa_check_dim(v, "v", 1, p->max_sk, "seqlen_k, as k"));
        FA_TRY(fa_check_dim(o, "out", 0, p->b, "batch, as q"));
        FA_TRY(fa_check_dim(o, "out", 1, p->max_sq, "seqlen_q, as q"));
        /* Both are at most an element count of q / k, which fa_check_tensor bounded. */
        p->total_q = p->b * p->max_sq;
        p->total_k = p->b * p->max_sk;
        p->q_bstride = q->stride[0];
        p->k_bstride = k->stride[0];
        p->v_bstride = v->stride[0];
        p->o_bstride = o->stride[0];
    } else {
        FA_TRY(fa_check_tensor(a->cu_seqlens_q, "cu_seqlens_q", 1));
        p->b = a->cu_seqlens_q->shape[0] - 1;
        if (p->b < 1)
            return FA_BAD("cu_seqlens_q: batch size must be positive (needs at least 2 entries, "
                          "got %lld)",
                          (long long)a->cu_seqlens_q->shape[0]);
        FA_TRY(fa_check_count(a->max_seqlen_q, "max_seqlen_q"));
        FA_TRY(fa_check_count(a->max_seqlen_k, "max_seqlen_k"));
        p->max_sq = a->max_seqlen_q;
        p->max_sk = a->max_seqlen_k;
        FA_TRY(fa_check_dim(v, "v", 0, k->shape[0], p->paged ? "blocks, as k" : "total_k, as k"));
        if (p->paged)
            FA_TRY(fa_check_dim(v, "v", 1, k->shape[1], "page size, as k"));
        FA_TRY(fa_check_dim(o, "out", 0, q->shape[0], "total_q, as q"));
        const int on_host = a->device == FA_DEVICE_CPU;
        /* Paged, cu_seqlens_k counts keys: any int32 offset is a valid count. */
        p->total_k = p->paged ? INT32_MAX : k->shape[0];
        FA_TRY(fa_check_cu_seqlens(a->cu_seqlens_q, "cu_seqlens_q", p->b, q->shape[0], p->max_sq,
                                   "max_seqlen_q", on_host));
        FA_TRY(fa_check_cu_seqlens(a->cu_seqlens_k, "cu_seqlens_k", p->b, p->total_k, p->max_sk,
                                   "max_seqlen_k", on_host));
        p->cu_seqlens_q = (const int32_t *)a->cu_seqlens_q->data;
        p->cu_seqlens_k = (const int32_t *)a->cu_seqlens_k->data;
        if (a->seqused_k) {
            const fa_tensor *u = a->seqused_k;
            FA_TRY(fa_check_tensor(u, "seqused_k", 1));
            FA_TRY(fa_check_dtype(u, "seqused_k", FA_DTYPE_I32, "keys used per sequence"));
            FA_TRY(fa_check_dim(u, "seqused_k", 0, p->b, "batch"));
            const int32_t *used = (const int32_t *)u->data;
            for (int64_t i = 0; on_host && i < p->b; i++) {
                /* Paged, the count replaces cu_seqlens_k's (upstream's rule): its keys are
                 * positions in the blocks, not rows of a sequence. */
                int64_t len = p->paged ? p->max_sk : p->cu_seqlens_k[i + 1] - p->cu_seqlens_k[i];
                if (used[i] < 0 || used[i] > len)
                    return FA_BAD("seqused_k: entry %lld is %d, outside [0, %lld] (%s)",
                                  (long long)i, used[i], (long long)len,
                                  p->paged ? "max_seqlen_k"
                                           : "the length of that sequence in cu_seqlens_k");
            }
            p->seqused_k = used;
        }
        p->total_q = q->shape[0];
        p->q_bstride = p->k_bstride = p->v_bstride = p->o_bstride = 0;
        if (p->paged) {
            p->k_bstride = k->stride[0];
            p->v_bstride = v->stride[0];
        }
    }
    p->q = q->data;
    p->k = k->data;
    p->v = v->data;
    p->out = o->data;
    p->q_rstride = q->stride[hd - 1];
    p->q_hstride = q->stride[hd];
    p->k_rstride = k->stride[kd - 1];
    p->k_hstride = k->stride[kd];
    p->v_rstride = v->stride[kd - 1];
    p->v_hstride = v->stride[kd];
    p->o_rstride = o->stride[hd - 1];
    p->o_hstride = o->stride[hd];
    return FA_STATUS_OK;
}

/* block_table (varlen only; fa_check_inputs took k and v as blocks): int32 [b, max_blocks]. On
 * the host, every sequence's keys within its row's capacity and in blocks that exist (the KV
 * cache's rule, fa_check_block_ids); a device clamps them in its kernels instead. */
static fa_status fa_check_paged(const fa_fwd_args *a, fa_params *p)
{
    if (!p->paged)
        return FA_STATUS_OK;
    const fa_tensor *bt = a->block_table;
    FA_TRY(fa_check_tensor(bt, "block_table", 2));
    FA_TRY(fa_check_dtype(bt, "block_table", FA_DTYPE_I32, "block ids"));
    FA_TRY(fa_check_dim(bt, "block_table", 0, p->b, "batch, as cu_seqlens_q"));
    p->num_blocks = a->k->shape[0];
    p->page_size = a->k->shape[1];
    if (p->page_size < 1)
        return FA_BAD("k: page size (dimension 1 of paged k) must be >= 1, got %lld",
                      (long long)p->page_size);
    int64_t capacity;
    if (__builtin_mul_overflow(bt->shape[1], p->page_size, &capacity) ||
        capacity > FA_MAX_EXTENT)
        return FA_BAD("block_table: %lld blocks of %lld keys exceed FA_MAX_EXTENT = 2^40 keys",
                      (long long)bt->shape[1], (long long)p->page_size);
    p->block_table = (const int32_t *)bt->data;
    p->bt_bstride = bt->stride[0];
    p->bt_cols = bt->shape[1];
    if (a->device != FA_DEVICE_CPU)
        return FA_STATUS_OK;
    for (int64_t i = 0; i < p->b; i++) {
        const int64_t sk = fa_params_seq(p, i).sk;
        if (sk > capacity)
            return FA_BAD("block_table: sequence %lld has %lld keys but its %lld blocks of %lld "
                          "hold %lld",
                          (long long)i, (long long)sk, (long long)p->bt_cols,
                          (long long)p->page_size, (long long)capacity);
        FA_TRY(fa_check_block_ids(p->block_table + i * p->bt_bstride, i, p->page_size,
                                  p->num_blocks, 0, sk));
    }
    return FA_STATUS_OK;
}

fa_status fa_check_descale(const fa_tensor *t, const char *name, const char *owner, fa_dtype dt,
                           int64_t b, int64_t hk, const float **data, int64_t *bstride,
                           int64_t *hstride)
{
    if (!t)
        return FA_STATUS_OK;
    if (!fa_dtype_is_fp8(dt))
        return FA_BAD("%s: descales apply to fp8 inputs only, but %s is %s", name, owner,
                      fa_dtype_name(dt));
    FA_TRY(fa_check_strided(t, name, 2));
    FA_TRY(fa_check_dtype(t, name, FA_DTYPE_F32, "one scale per sequence and kv head"));
    FA_TRY(fa_check_dim(t, name, 0, b, "batch"));
    FA_TRY(fa_check_dim(t, name, 1, hk, "kv heads"));
    *data = (const float *)t->data;
    *bstride = t->stride[0];
    *hstride = t->stride[1];
    return FA_STATUS_OK;
}

/* FA3's fp8 forward has no dropout, probs or backward; descales are fp8's alone; the fp8 forward
 * applies no user-defined scoring yet. */
static fa_status fa_check_fp8(const fa_fwd_args *a, fa_params *p)
{
    FA_TRY(fa_check_descale(a->q_descale, "q_descale", "q", p->dtype, p->b, p->hk,
                            &p->q_descale, &p->qd_bstride, &p->qd_hstride));
    FA_TRY(fa_check_descale(a->k_descale, "k_descale", "q", p->dtype, p->b, p->hk,
                            &p->k_descale, &p->kd_bstride, &p->kd_hstride));
    FA_TRY(fa_check_descale(a->v_descale, "v_descale", "q", p->dtype, p->b, p->hk,
                            &p->v_descale, &p->vd_bstride, &p->vd_hstride));
    if (!fa_dtype_is_fp8(p->dtype))
        return FA_STATUS_OK;
    if (a->dropout_p != 0.0)
        return FA_BAD("dropout_p: fp8 inputs have no dropout (as FA3), got %g", a->dropout_p);
    if (a->probs)
        return FA_BAD("probs: not available with fp8 inputs (as FA3)");
    if (fa_mod_args_user(a))
        return FA_BAD("%s: not available with fp8 inputs yet", fa_mod_args_user(a));
    return FA_STATUS_OK;
}

/* fp32 as upstream; fp64 inputs may keep it in fp64 so their gradients stay exact. */
static fa_status fa_check_extras(const fa_fwd_args *a, fa_params *p)
{
    if (a->lse) {
        const fa_tensor *t = a->lse;
        if (p->is_varlen) {
            FA_TRY(fa_check_tensor(t, "lse", 2));
            FA_TRY(fa_check_lse_dtype(t, p->dtype));
            FA_TRY(fa_check_dim(t, "lse", 0, p->h, "heads"));
            FA_TRY(fa_check_dim(t, "lse", 1, p->total_q, "total_q"));
            p->lse_bstride = 0;
            p->lse_hstride = t->stride[0];
            p->lse_rstride = t->stride[1];
        } else {
            FA_TRY(fa_check_lse_dense(t, p->dtype, p->b, p->h, p->max_sq));
            p->lse_bstride = t->stride[0];
            p->lse_hstride = t->stride[1];
            p->lse_rstride = t->stride[2];
        }
        p->lse = t->data;
        p->lse_dtype = t->dtype;
    }
    if (a->alibi_slopes)
        FA_TRY(fa_check_alibi(a->alibi_slopes, p->b, p->h, &p->alibi_slopes, &p->alibi_bstride,
                              &p->alibi_hstride));
    if (a->sinks)
        FA_TRY(fa_check_sinks(a->sinks, p->h, &p->sinks, &p->sinks_stride));
    if (a->probs) {
        const fa_tensor *t = a->probs;
        FA_TRY(fa_check_tensor(t, "probs", 4));
        if (t->dtype != p->dtype)
            return FA_BAD("probs: dtype %s does not match q's %s", fa_dtype_name(t->dtype),
                          fa_dtype_name(p->dtype));
        FA_TRY(fa_check_dim(t, "probs", 0, p->b, "batch"));
        FA_TRY(fa_check_dim(t, "probs", 1, p->h, "heads"));
        if (t->shape[2] < p->max_sq || t->shape[3] < p->max_sk)
            return FA_BAD("probs: must be at least [%lld, %lld, %lld, %lld], got [.., .., %lld, "
                          "%lld]",
                          (long long)p->b, (long long)p->h, (long long)p->max_sq,
                          (long long)p->max_sk, (long long)t->shape[2], (long long)t->shape[3]);
        p->probs = t->data;
        p->p_bstride = t->stride[0];
        p->p_hstride = t->stride[1];
        p->p_rstride = t->stride[2];
        p->probs_sq = t->shape[2];
        p->probs_sk = t->shape[3];
    }
    return FA_STATUS_OK;
}

fa_status fa_options_check(double softmax_scale, double softcap, int causal, int window_left,
                           int window_right, fa_params *p)
{
    if (isnan(softmax_scale))
        p->scale = fa_rule_default_scale(p->d);
    else if (!isfinite(softmax_scale))
        return FA_BAD("softmax_scale: must be finite (or NaN for the default d^-0.5)");
    else if (fabs(softmax_scale) > FA_MAX_SOFTMAX_SCALE)
        return FA_BAD("softmax_scale: must be within [-%g, %g], got %g", FA_MAX_SOFTMAX_SCALE,
                      FA_MAX_SOFTMAX_SCALE, softmax_scale);
    else
        p->scale = softmax_scale;

    if (!isfinite(softcap))
        return FA_BAD("softcap: must be a finite number (<= 0 disables it)");
    if (softcap > 0 && (softcap < FA_MIN_SOFTCAP || softcap > FA_MAX_SOFTCAP))
        return FA_BAD("softcap: must be <= 0 (off) or within [%g, %g], got %g", FA_MIN_SOFTCAP,
                      FA_MAX_SOFTCAP, softcap);
    p->softcap = softcap > 0 ? softcap : 0.0;

    if (window_left < -1)
        return FA_BAD("window_left: must be -1 (unbounded) or >= 0, got %d", window_left);
    if (window_right < -1)
        return FA_BAD("window_right: must be -1 (unbounded) or >= 0, got %d", window_right);
    p->causal = causal != 0;
    p->window_left = window_left;
    p->window_right = p->causal ? 0 : window_right;
    return FA_STATUS_OK;
}

static fa_status fa_check_options(const fa_fwd_args *a, fa_params *p)
{
    FA_TRY(fa_options_check(a->softmax_scale, a->softcap, a->causal, a->window_left,
                            a->window_right, p));

    if (!(a->dropout_p >= 0.0 && a->dropout_p < 1.0))
        return FA_BAD("dropout_p: must be in [0, 1), got %g", a->dropout_p);
    if (a->dropout_p > 0.0 && p->softcap > 0.0)
        return FA_BAD("dropout_p: dropout cannot be combined with softcap (softcap=%g)",
                      a->softcap);
    p->dropout_p = a->dropout_p;
    p->keep_threshold = fa_dropout_threshold(a->dropout_p);
    p->dropout_scale = 1.0 / (1.0 - a->dropout_p);
    p->seed = a->seed;
    p->offset = a->offset;

    FA_TRY(fa_check_threads(a->num_threads));
    p->num_threads = a->num_threads;
    return FA_STATUS_OK;
}

/* Upstream's kBlockN of its sm80 forward kernels, which fixes how S_dmask is blocked. */
FA_API int fa_probs_block_n(int head_dim, int dropout, int causal)
{
    (void)causal;
    if (head_dim <= 32)
        return 128;
    if (head_dim <= 64)
        return dropout ? 64 : 128;
    if (head_dim <= 96)
        return 64;
    if (head_dim <= 128)
        return dropout ? 32 : 64;
    return 64;
}

fa_status fa_params_from_fwd_args(const fa_fwd_args *a, fa_params *p)
{
    *p = (fa_params){0};
    if (!a)
        return FA_BAD("args: NULL");
    FA_TRY(fa_check_device(a->device));
    FA_TRY(fa_check_inputs(a, p));
    FA_TRY(fa_check_paged(a, p));
    FA_TRY(fa_check_disjoint(a->out, "out", a->q, "q"));
    FA_TRY(fa_check_disjoint(a->out, "out", a->k, "k"));
    FA_TRY(fa_check_disjoint(a->out, "out", a->v, "v"));
    FA_TRY(fa_check_options(a, p));
    FA_TRY(fa_check_fp8(a, p));
    FA_TRY(fa_check_extras(a, p));
    const fa_mod_dims dims = {p->is_varlen, p->b, p->h, p->max_sq, p->max_sk};
    FA_TRY(fa_mod_check_call(a, &dims, &p->mods));
    FA_TRY(fa_check_writable(a->out, "out"));
    FA_TRY(fa_check_writable(a->lse, "lse"));
    FA_TRY(fa_check_writable(a->probs, "probs"));
    if (p->probs)
        p->probs_block_n = fa_probs_block_n((int)p->d, p->dropout_p > 0.0, p->causal);
    return FA_STATUS_OK;
}

/* A gradient tensor has exactly the shape, dtype and layout rules of the tensor it differentiates. */
static fa_status fa_check_like(const fa_tensor *t, const char *name, const fa_tensor *like,
                               const char *like_name)
{
    FA_TRY(fa_check_tensor(t, name, like->ndim));
    if (t->dtype != like->dtype)
        return FA_BAD("%s: dtype %s does not match %s's %s", name, fa_dtype_name(t->dtype),
                      like_name, fa_dtype_name(like->dtype));
    for (int i = 0; i < like->ndim; i++)
        if (t->shape[i] != like->shape[i])
            return FA_BAD("%s: dimension %d must be %lld as in %s, got %lld", name, i,
                          (long long)like->shape[i], like_name, (long long)t->shape[i]);
    return FA_STATUS_OK;
}

static const char *const fa_aux_grad_names[FA_MOD_AUX_SLOTS] = {
    "mod_aux_grad[0]", "mod_aux_grad[1]", "mod_aux_grad[2]", "mod_aux_grad[3]"};

/* bwd->mod_aux_grad: each given slot's forward tensor is fp32 and read by score_mod (an
 * integer tensor has no gradient), the gradient fp32 of its shape, writable (apart from
 * mod_aux and every other tensor of the call: fa_bwd_apart). */
static fa_status fa_params_aux_grads(const fa_bwd_args *a, fa_params *p)
{
    const char *const *names = fa_aux_grad_names;
    for (int i = 0; i < FA_MOD_AUX_SLOTS; i++) {
        const fa_tensor *g = a->mod_aux_grad[i];
        memset(&p->mod_aux_grad[i], 0, sizeof p->mod_aux_grad[i]);
        if (!g)
            continue;
        const fa_tensor *x = &p->mods.aux[i];
        if (!p->mods.score_mod || !x->data)
            return FA_BAD("%s: given, but score_mod reads no mod_aux[%d]", names[i], i);
        if (x->dtype != FA_DTYPE_F32)
            return FA_BAD("%s: mod_aux[%d] is %s; only an fp32 tensor has a gradient", names[i],
                          i, fa_dtype_name(x->dtype));
        FA_TRY(fa_check_tensor(g, names[i], x->ndim));
        FA_TRY(fa_check_dtype(g, names[i], FA_DTYPE_F32, "as mod_aux"));
        for (int d = 0; d < x->ndim; d++)
            FA_TRY(fa_check_dim(g, names[i], d, x->shape[d], "as mod_aux"));
        FA_TRY(fa_check_writable(g, names[i]));
        p->mod_aux_grad[i] = *g;
    }
    return FA_STATUS_OK;
}

/* The backward's outputs apart from its inputs and from one another: a gradient written over
 * what the backward still reads, or over another gradient, would be a silently wrong result. */
static fa_status fa_bwd_apart(const fa_bwd_args *a)
{
    const fa_fwd_args *f = a->fwd;
    const fa_tensor *outs[4 + FA_MOD_AUX_SLOTS] = {a->dq, a->dk, a->dv, a->dsinks};
    const fa_tensor *ins[8 + FA_MOD_AUX_SLOTS] = {f->q,   f->k,            f->v,
                                                  f->out, a->dout,         f->lse,
                                                  f->alibi_slopes, f->sinks};
    const char *out_names[4 + FA_MOD_AUX_SLOTS] = {"dq", "dk", "dv", "dsinks"};
    static const char *const in_names[8 + FA_MOD_AUX_SLOTS] = {
        "q", "k", "v", "out", "dout", "lse", "alibi_slopes", "sinks", "mod_aux[0]",
        "mod_aux[1]", "mod_aux[2]", "mod_aux[3]"};
    for (int i = 0; i < FA_MOD_AUX_SLOTS; i++) {
        outs[4 + i] = a->mod_aux_grad[i], ins[8 + i] = f->mod_aux[i];
        out_names[4 + i] = fa_aux_grad_names[i];
    }
    /* Each tensor's byte range once; the element-wise test only where two ranges meet. */
    enum { NO = 4 + FA_MOD_AUX_SLOTS, NI = 8 + FA_MOD_AUX_SLOTS };
    uintptr_t lo[NO + NI], hi[NO + NI];
    for (int i = 0; i < NO + NI; i++) {
        const fa_tensor *t = i < NO ? outs[i] : ins[i - NO];
        if (!t || !fa_tensor_bytes(t, &lo[i], &hi[i]))
            lo[i] = hi[i] = 0;
    }
    for (int i = 0; i < NO; i++)
        for (int j = i + 1; j < NO + NI; j++)
            if (lo[i] < hi[j] && lo[j] < hi[i])
                FA_TRY(fa_check_disjoint(outs[i], out_names[i], j < NO ? outs[j] : ins[j - NO],
                                         j < NO ? out_names[j] : in_names[j - NO]));
    return FA_STATUS_OK;
}

fa_status fa_params_from_bwd_args(const fa_bwd_args *a, fa_params *p)
{
    *p = (fa_params){0};
    if (!a)
        return FA_BAD("args: NULL");
    if (!a->fwd)
        return FA_BAD("fwd: the forward's arguments are required");
    fa_fwd_args fwd = *a->fwd;
    fwd.probs = NULL; /* a forward-only debugging output */
    if (!fwd.lse)
        return FA_BAD("lse: the backward needs the forward's lse (fwd->lse)");
    if (fwd.block_table)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "block_table: a paged forward has no backward (as upstream); pass "
                            "k and v in the varlen layout to differentiate");
    FA_TRY(fa_params_from_fwd_args(&fwd, p));
    if (fa_dtype_is_fp8(p->dtype))
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "q: fp8 has no backward (as FA3); dtype %s is forward only",
                            fa_dtype_name(p->dtype));

    int hd = p->is_varlen ? 1 : 2; /* index of the heads dimension */
    FA_TRY(fa_check_like(a->dout, "dout", fwd.out, "out"));
    FA_TRY(fa_check_like(a->dq, "dq", fwd.q, "q"));
    FA_TRY(fa_check_like(a->dk, "dk", fwd.k, "k"));
    FA_TRY(fa_check_like(a->dv, "dv", fwd.v, "v"));
    p->dout_data = a->dout->data;
    p->dq_data = a->dq->data;
    p->dk_data = a->dk->data;
    p->dv_data = a->dv->data;
    p->do_bstride = p->is_varlen ? 0 : a->dout->stride[0];
    p->dq_bstride = p->is_varlen ? 0 : a->dq->stride[0];
    p->dk_bstride = p->is_varlen ? 0 : a->dk->stride[0];
    p->dv_bstride = p->is_varlen ? 0 : a->dv->stride[0];
    p->do_rstride = a->dout->stride[hd - 1];
    p->dq_rstride = a->dq->stride[hd - 1];
    p->dk_rstride = a->dk->stride[hd - 1];
    p->dv_rstride = a->dv->stride[hd - 1];
    p->do_hstride = a->dout->stride[hd];
    p->dq_hstride = a->dq->stride[hd];
    p->dk_hstride = a->dk->stride[hd];
    p->dv_hstride = a->dv->stride[hd];

    if (p->sinks && !a->dsinks)
        return FA_BAD("dsinks: required when the forward used sinks (fp32 [h])");
    if (a->dsinks) {
        if (!p->sinks)
            return FA_BAD("dsinks: given, but the forward used no sinks");
        FA_TRY(fa_check_tensor(a->dsinks, "dsinks", 1));
        FA_TRY(fa_check_dtype(a->dsinks, "dsinks", FA_DTYPE_F32, "as sinks"));
        FA_TRY(fa_check_dim(a->dsinks, "dsinks", 0, p->h, "heads"));
        p->dsinks = (float *)a->dsinks->data;
        p->dsinks_stride = a->dsinks->stride[0];
    }
    FA_TRY(fa_check_writable(a->dq, "dq"));
    FA_TRY(fa_check_writable(a->dk, "dk"));
    FA_TRY(fa_check_writable(a->dv, "dv"));
    FA_TRY(fa_check_writable(a->dsinks, "dsinks"));
    FA_TRY(fa_params_aux_grads(a, p));
    return fa_bwd_apart(a);
}
