/*
 * fa_attention_kvcache's validation. Every rule is checked here, before the backend writes
 * anything: a bad call must leave the caller's cache exactly as it was, and no index taken from
 * the caller (block ids, batch indices, lengths) may reach memory unchecked.
 */
#include "core/fa_check.h"
#include "core/fa_fp8.h"
#include "core/fa_kvcache.h"
#include "core/fa_options.h"
#include "fa_rules.h"

static fa_status fa_kv_check_same_dtype(const fa_tensor *t, const char *name, fa_dtype dt)
{
    if (t->dtype != dt)
        return FA_BAD("%s: dtype %s does not match q's %s", name, fa_dtype_name(t->dtype),
                      fa_dtype_name(dt));
    return FA_STATUS_OK;
}

/* The caches' dtype: q's, or (FP8 in include/flashattn.h) one fp8 kind for both with a q in
 * fp16, bf16 or fp32. */
static fa_status fa_kv_check_cache_dtype(const fa_kvcache_args *a, fa_params *p)
{
    const fa_tensor *kc = a->k_cache, *vc = a->v_cache;
    p->kv_dtype = p->dtype;
    if (!fa_dtype_is_fp8(kc->dtype) && !fa_dtype_is_fp8(vc->dtype)) {
        FA_TRY(fa_kv_check_same_dtype(kc, "k_cache", p->dtype));
        return fa_kv_check_same_dtype(vc, "v_cache", p->dtype);
    }
    if (kc->dtype != vc->dtype)
        return FA_BAD("v_cache: dtype %s does not match k_cache's %s (an fp8 cache holds keys and "
                      "values in one kind)",
                      fa_dtype_name(vc->dtype), fa_dtype_name(kc->dtype));
    if (p->dtype == FA_DTYPE_F64)
        return FA_BAD("q: dtype %s with an fp8 cache; fp8 caches take a q in fp16, bf16 or fp32",
                      fa_dtype_name(p->dtype));
    p->kv_dtype = kc->dtype;
    return FA_STATUS_OK;
}

/* An int32 [b] tensor of per-sequence values; returns its data. */
static fa_status fa_kv_check_index(const fa_tensor *t, const char *name, int64_t b,
                                   const char *what, const int32_t **dst)
{
    FA_TRY(fa_check_tensor(t, name, 1));
    FA_TRY(fa_check_dtype(t, name, FA_DTYPE_I32, what));
    FA_TRY(fa_check_dim(t, name, 0, b, "batch, as q"));
    if (t->stride[0] != 1 && b > 1)
        return FA_BAD("%s: must be contiguous (stride 1), got stride %lld", name,
                      (long long)t->stride[0]);
    *dst = (const int32_t *)t->data;
    return FA_STATUS_OK;
}

/* q, out, the caches and the new keys: ranks, dtypes, shapes; fills sizes and strides. */
static fa_status fa_kv_check_tensors(const fa_kvcache_args *a, fa_params *p)
{
    const fa_tensor *q = a->q, *kc = a->k_cache, *vc = a->v_cache, *o = a->out;
    FA_TRY(fa_check_tensor(q, "q", 4));
    FA_TRY(fa_check_tensor(kc, "k_cache", 4));
    FA_TRY(fa_check_tensor(vc, "v_cache", 4));
    FA_TRY(fa_check_tensor(o, "out", 4));
    if (!fa_dtype_is_float(q->dtype))
        return FA_BAD("q: dtype must be fp32, fp16, bf16 or fp64%s, got %s",
                      fa_dtype_is_fp8(q->dtype) ? " (fp8 caches take a q in fp16, bf16 or fp32; "
                                                  "an fp8 q is not supported)"
                                                : "",
                      fa_dtype_name(q->dtype));
    p->dtype = q->dtype;
    FA_TRY(fa_kv_check_cache_dtype(a, p));
    FA_TRY(fa_kv_check_same_dtype(o, "out", p->dtype));

    p->b = q->shape[0];
    p->max_sq = q->shape[1];
    p->h = q->shape[2];
    p->d = q->shape[3];
    p->hk = kc->shape[2];
    p->dv = vc->shape[3];
    if (p->b < 1)
        return FA_BAD("q: batch size must be positive, got %lld", (long long)p->b);
    if (p->h < 1)
        return FA_BAD("q: number of heads must be positive, got %lld", (long long)p->h);
    if (p->d < 1 || p->d > FA_MAX_HEAD_DIM)
        return FA_BAD("q: head_dim must be in [1, %d], got %lld", FA_MAX_HEAD_DIM,
                      (long long)p->d);
    if (p->dv < 1 || p->dv > FA_MAX_HEAD_DIM)
        return FA_BAD("v_cache: head_dim must be in [1, %d], got %lld", FA_MAX_HEAD_DIM,
                      (long long)p->dv);
    FA_TRY(fa_check_dim(kc, "k_cache", 3, p->d, "head_dim, as q"));
    if (p->hk < 1)
        return FA_BAD("k_cache: number of kv heads must be positive, got %lld",
                      (long long)p->hk);
    if (p->h % p->hk != 0)
        return FA_BAD("k_cache: number of kv heads (%lld) must divide the number of query "
                      "heads in q (%lld)",
                      (long long)p->hk, (long long)p->h);
    FA_TRY(fa_check_dim(vc, "v_cache", 0, kc->shape[0], "blocks or batch, as k_cache"));
    FA_TRY(fa_check_dim(vc, "v_cache", 1, kc->shape[1], "page size or seqlen, as k_cache"));
    FA_TRY(fa_check_dim(vc, "v_cache", 2, p->hk, "kv heads, as k_cache"));
    FA_TRY(fa_check_dim(o, "out", 0, p->b, "batch, as q"));
    FA_TRY(fa_check_dim(o, "out", 1, p->max_sq, "seqlen_q, as q"));
    FA_TRY(fa_check_dim(o, "out", 2, p->h, "heads, as q"));
    FA_TRY(fa_check_dim(o, "out", 3, p->dv, "head_dim, as v_cache"));

    p->q = q->data;
    p->q_bstride = q->stride[0];
    p->q_rstride = q->stride[1];
    p->q_hstride = q->stride[2];
    p->out = o->data;
    p->o_bstride = o->stride[0];
    p->o_rstride = o->stride[1];
    p->o_hstride = o->stride[2];
    p->k = kc->data;
    p->k_bstride = kc->stride[0];
    p->k_rstride = kc->stride[1];
    p->k_hstride = kc->stride[2];
    p->v = vc->data;
    p->v_bstride = vc->stride[0];
    p->v_rstride = vc->stride[1];
    p->v_hstride = vc->stride[2];

    if (!a->k != !a->v)
        return FA_BAD("%s: new keys and values are appended together; %s is NULL",
                      a->k ? "k" : "v", a->k ? "v" : "k");
    if (a->k) {
        const fa_tensor *k = a->k, *v = a->v;
        FA_TRY(fa_check_tensor(k, "k", 4));
        FA_TRY(fa_check_tensor(v, "v", 4));
        FA_TRY(fa_kv_check_same_dtype(k, "k", p->dtype));
        FA_TRY(fa_kv_check_same_dtype(v, "v", p->dtype));
        p->s_new = k->shape[1];
        FA_TRY(fa_check_dim(k, "k", 0, p->b, "batch, as q"));
        FA_TRY(fa_check_dim(k, "k", 2, p->hk, "kv heads, as k_cache"));
        FA_TRY(fa_check_dim(k, "k", 3, p->d, "head_dim, as q"));
        FA_TRY(fa_check_dim(v, "v", 0, p->b, "batch, as q"));
        FA_TRY(fa_check_dim(v, "v", 1, p->s_new, "new keys, as k"));
        FA_TRY(fa_check_dim(v, "v", 2, p->hk, "kv heads, as k_cache"));
        FA_TRY(fa_check_dim(v, "v", 3, p->dv, "head_dim, as v_cache"));
        p->knew = k->data;
        p->knew_bstride = k->stride[0];
        p->knew_rstride = k->stride[1];
        p->knew_hstride = k->stride[2];
        p->vnew = v->data;
        p->vnew_bstride = v->stride[0];
        p->vnew_rstride = v->stride[1];
        p->vnew_hstride = v->stride[2];
        p->new_in_cache = fa_tensors_overlap(k, a->k_cache) || fa_tensors_overlap(v, a->v_cache);
    }
    return FA_STATUS_OK;
}

/* The layout of the cache: paged through block_table, or one row per sequence. */
static fa_status fa_kv_check_layout(const fa_kvcache_args *a, fa_params *p, int on_host)
{
    const fa_tensor *kc = a->k_cache;
    p->paged = a->block_table != NULL;
    p->num_blocks = kc->shape[0];
    p->page_size = kc->shape[1];
    if (p->paged) {
        const fa_tensor *bt = a->block_table;
        FA_TRY(fa_check_tensor(bt, "block_table", 2));
        FA_TRY(fa_check_dtype(bt, "block_table", FA_DTYPE_I32, "block ids"));
        FA_TRY(fa_check_dim(bt, "block_table", 0, p->b, "batch, as q"));
        if (p->page_size < 1)
            return FA_BAD("k_cache: page size (dimension 1 of a paged cache) must be >= 1, got "
                          "%lld",
                          (long long)p->page_size);
        if (a->cache_batch_idx)
            return FA_BAD("cache_batch_idx: not supported with a paged cache (block_table "
                          "already maps sequences to blocks)");
        p->block_table = (const int32_t *)bt->data;
        p->bt_bstride = bt->stride[0];
        p->bt_cols = bt->shape[1];
        if (__builtin_mul_overflow(bt->shape[1], p->page_size, &p->max_sk) ||
            p->max_sk > FA_MAX_EXTENT)
            return FA_BAD("block_table: %lld blocks of %lld positions exceed FA_MAX_EXTENT = "
                          "2^40 positions",
                          (long long)bt->shape[1], (long long)p->page_size);
    } else {
        p->max_sk = p->page_size;
        if (a->cache_batch_idx) {
            FA_TRY(fa_kv_check_index(a->cache_batch_idx, "cache_batch_idx", p->b,
                                     "cache row of each sequence", &p->batch_idx));
            for (int64_t i = 0; on_host && i < p->b; i++) {
                if (p->batch_idx[i] < 0 || p->batch_idx[i] >= p->num_blocks)
                    return FA_BAD("cache_batch_idx: entry %lld is %d, outside [0, %lld) (the "
                                  "batch size of k_cache)",
                                  (long long)i, p->batch_idx[i], (long long)p->num_blocks);
            }
        }
        if (!a->cache_batch_idx && p->num_blocks < p->b) {
            return FA_BAD("k_cache: dimension 0 (batch) is %lld, fewer than q's batch %lld "
                          "(pass cache_batch_idx to pick cache rows)",
                          (long long)p->num_blocks, (long long)p->b);
        }
    }
    return FA_STATUS_OK;
}

fa_status fa_kvcache_check_seqlen(const fa_params *p, int64_t i, int64_t len)
{
    if (FA_RULE_KV_FITS(len, p->s_new, p->max_sk))
        return FA_STATUS_OK;
    if (len < 0)
        return FA_BAD("cache_seqlens: entry %lld is negative (%lld)", (long long)i,
                      (long long)len);
    if (p->paged)
        return FA_BAD("block_table: sequence %lld needs %lld positions (cache_seqlens %lld + "
                      "%lld new keys) but its %lld blocks of %lld hold %lld",
                      (long long)i, (long long)(len + p->s_new), (long long)len,
                      (long long)p->s_new, (long long)(p->max_sk / p->page_size),
                      (long long)p->page_size, (long long)p->max_sk);
    return FA_BAD("cache_seqlens: sequence %lld needs %lld positions (cache_seqlens %lld + "
                  "%lld new keys), more than the cache's %lld",
                  (long long)i, (long long)(len + p->s_new), (long long)len, (long long)p->s_new,
                  (long long)p->max_sk);
}

fa_status fa_kvcache_check_seqlens(const fa_params *p, const int32_t *cache_seqlens)
{
    for (int64_t i = 0; i < p->b; i++)
        FA_TRY(fa_kvcache_check_seqlen(p, i, cache_seqlens[i]));
    return FA_STATUS_OK;
}

/* cache_seqlens and cache_leftpad, then the blocks each sequence reaches; the values only when
 * they are host memory (on_host). */
static fa_status fa_kv_check_lengths(const fa_kvcache_args *a, fa_params *p, int on_host)
{
    if (a->cache_seqlens)
        FA_TRY(fa_kv_check_index(a->cache_seqlens, "cache_seqlens", p->b,
                                 "positions already in the cache", &p->cache_seqlens));
    else if (a->k)
        return FA_BAD("cache_seqlens: required when new keys k/v are appended (they are "
                      "written at cache_seqlens)");
    if (a->cache_leftpad)
        FA_TRY(fa_kv_check_index(a->cache_leftpad, "cache_leftpad", p->b,
                                 "first position of each sequence", &p->leftpad));
    if (!on_host)
        return FA_STATUS_OK;
    if (p->cache_seqlens)
        FA_TRY(fa_kvcache_check_seqlens(p, p->cache_seqlens));
    for (int64_t i = 0; p->leftpad && i < p->b; i++) {
        int64_t lp = p->leftpad[i];
        int64_t limit = p->cache_seqlens ? p->cache_seqlens[i] : p->max_sk;
        if (lp < 0 || lp > limit)
            return FA_BAD("cache_leftpad: entry %lld is %lld, outside [0, %lld] (%s)",
                          (long long)i, (long long)lp, (long long)limit,
                          p->cache_seqlens ? "its cache_seqlens" : "the cache capacity");
    }
    if (!p->paged)
        return FA_STATUS_OK;
    for (int64_t i = 0; i < p->b; i++)
        FA_TRY(fa_check_block_ids(p->block_table + i * p->bt_bstride, i, p->page_size,
                                  p->num_blocks, fa_kv_seq_start(p, i), fa_kv_seq_end(p, i)));
    return FA_STATUS_OK;
}

static fa_status fa_kv_check_rotary(const fa_kvcache_args *a, fa_params *p, int on_host)
{
    const fa_tensor *c = a->rotary_cos, *s = a->rotary_sin;
    if (!c && !s)
        return FA_STATUS_OK;
    if (!c || !s)
        return FA_BAD("%s: rotary_cos and rotary_sin go together; %s is NULL",
                      c ? "rotary_sin" : "rotary_cos", c ? "rotary_sin" : "rotary_cos");
    if (!a->k)
        return FA_BAD("rotary_cos: rotary embedding needs new keys k/v to append (it rotates "
                      "them and q)");
    FA_TRY(fa_check_tensor(c, "rotary_cos", 2));
    FA_TRY(fa_check_tensor(s, "rotary_sin", 2));
    FA_TRY(fa_kv_check_same_dtype(c, "rotary_cos", p->dtype));
    FA_TRY(fa_kv_check_same_dtype(s, "rotary_sin", p->dtype));
    FA_TRY(fa_check_dim(s, "rotary_sin", 0, c->shape[0], "seqlen_ro, as rotary_cos"));
    FA_TRY(fa_check_dim(s, "rotary_sin", 1, c->shape[1], "rotary_dim / 2, as rotary_cos"));
    if (c->shape[1] < 1)
        return FA_BAD("rotary_cos: dimension 1 (rotary_dim / 2) must be >= 1, got 0");
    p->rotary_dim = 2 * c->shape[1];
    if (p->rotary_dim > p->d)
        return FA_BAD("rotary_cos: rotary_dim (2 * dimension 1 = %lld) must be <= head_dim "
                      "(%lld)",
                      (long long)p->rotary_dim, (long long)p->d);

    /* FA2 decides "local" after mapping a window side that spans the cache to unbounded. */
    int local = (a->window_left >= 0 && a->window_left < p->max_sk) ||
                (a->window_right >= 0 && a->window_right < p->max_sk);
    p->rotary_per_row = a->causal || local;
    p->rotary_interleaved = a->rotary_interleaved != 0;

    const int64_t seqlen_ro = c->shape[0];
    const int64_t q_span = p->rotary_per_row ? p->max_sq : (p->max_sq > 0 ? 1 : 0);
    const int64_t span = q_span > p->s_new ? q_span : p->s_new;
    p->seqlen_ro = seqlen_ro;
    for (int64_t i = 0; on_host && i < p->b; i++) {
        int64_t last = (int64_t)p->cache_seqlens[i] + span;
        if (last > seqlen_ro)
            return FA_BAD("rotary_cos: seqlen_ro (dimension 0) is %lld, but sequence %lld "
                          "rotates positions up to %lld",
                          (long long)seqlen_ro, (long long)i, (long long)(last - 1));
    }
    p->rot_cos = c->data;
    p->rot_sin = s->data;
    p->cos_rstride = c->stride[0];
    p->sin_rstride = s->stride[0];
    return FA_STATUS_OK;
}

/* lse, ALiBi, sinks and the scalar options (the forward's rules). */
static fa_status fa_kv_check_options(const fa_kvcache_args *a, fa_params *p)
{
    if (a->lse) {
        const fa_tensor *t = a->lse;
        FA_TRY(fa_check_lse_dense(t, p->dtype, p->b, p->h, p->max_sq));
        p->lse = t->data;
        p->lse_dtype = t->dtype;
        p->lse_bstride = t->stride[0];
        p->lse_hstride = t->stride[1];
        p->lse_rstride = t->stride[2];
    }
    if (a->alibi_slopes)
        FA_TRY(fa_check_alibi(a->alibi_slopes, p->b, p->h, &p->alibi_slopes, &p->alibi_bstride,
                              &p->alibi_hstride));
    if (a->sinks)
        FA_TRY(fa_check_sinks(a->sinks, p->h, &p->sinks, &p->sinks_stride));

    FA_TRY(fa_options_check(a->softmax_scale, a->softcap, a->causal, a->window_left,
                            a->window_right, p));

    FA_TRY(fa_check_descale(a->k_descale, "k_descale", "k_cache", p->kv_dtype, p->b, p->hk,
                            &p->k_descale, &p->kd_bstride, &p->kd_hstride));
    FA_TRY(fa_check_descale(a->v_descale, "v_descale", "v_cache", p->kv_dtype, p->b, p->hk,
                            &p->v_descale, &p->vd_bstride, &p->vd_hstride));

    if (a->num_splits < 0 || a->num_splits > FA_MAX_SPLITS)
        return FA_BAD("num_splits: must be in [0, %d] (0 = chosen by the library), got %d",
                      FA_MAX_SPLITS, a->num_splits);
    p->num_splits = a->num_splits;
    FA_TRY(fa_check_threads(a->num_threads));
    p->num_threads = a->num_threads;
    return FA_STATUS_OK;
}

fa_status fa_params_from_kvcache_args(const fa_kvcache_args *a, fa_params *p)
{
    *p = (fa_params){0};
    if (!a)
        return FA_BAD("args: NULL");
    FA_TRY(fa_check_device(a->device));
    FA_TRY(fa_kv_check_tensors(a, p));
    const fa_tensor *inputs[5] = {a->q, a->k_cache, a->v_cache, a->k, a->v};
    const char *names[5] = {"q", "k_cache", "v_cache", "k", "v"};
    for (int i = 0; i < 5; i++)
        FA_TRY(fa_check_disjoint(a->out, "out", inputs[i], names[i]));
    FA_TRY(fa_check_writable(a->out, "out"));
    if (a->k) { /* the append writes the caches */
        FA_TRY(fa_check_writable(a->k_cache, "k_cache"));
        FA_TRY(fa_check_writable(a->v_cache, "v_cache"));
    }
    /* Index values on a device are clamped by the kernels; the host reads only its own. */
    const int on_host = a->device == FA_DEVICE_CPU;
    FA_TRY(fa_kv_check_layout(a, p, on_host));
    FA_TRY(fa_kv_check_lengths(a, p, on_host));
    FA_TRY(fa_kv_check_options(a, p));
    FA_TRY(fa_check_writable(a->lse, "lse"));
    FA_TRY(fa_kv_check_rotary(a, p, on_host));
    return FA_STATUS_OK;
}
