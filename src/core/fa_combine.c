/* fa_attention_combine's validation: the public split-KV merge. */
#include <math.h>

#include "core/fa_check.h"
#include "core/fa_params.h"
#include "core/fa_options.h"

fa_status fa_params_from_combine_args(const fa_combine_args *a, fa_params *c)
{
    *c = (fa_params){0};
    if (!a)
        return FA_BAD("args: NULL");
    FA_TRY(fa_check_device(a->device));
    const fa_tensor *op = a->out_partial, *lp = a->lse_partial, *o = a->out;
    FA_TRY(fa_check_tensor(op, "out_partial", 5));
    FA_TRY(fa_check_strided(lp, "lse_partial", 4));
    FA_TRY(fa_check_tensor(o, "out", 4));
    if (op->dtype != FA_DTYPE_F32 && op->dtype != FA_DTYPE_F64)
        return FA_BAD("out_partial: dtype must be fp32 (or fp64), got %s",
                      fa_dtype_name(op->dtype));
    if (lp->dtype != op->dtype)
        return FA_BAD("lse_partial: dtype %s does not match out_partial's %s",
                      fa_dtype_name(lp->dtype), fa_dtype_name(op->dtype));
    if (!fa_dtype_is_float(o->dtype))
        return FA_BAD("out: dtype must be fp32, fp16, bf16 or fp64, got %s",
                      fa_dtype_name(o->dtype));

    c->num_splits = op->shape[0];
    c->b = op->shape[1];
    c->max_sq = op->shape[2];
    c->h = op->shape[3];
    c->dv = op->shape[4];
    if (c->num_splits < 1 || c->num_splits > FA_MAX_SPLITS)
        return FA_BAD("out_partial: dimension 0 (splits) must be in [1, %d], got %lld",
                      FA_MAX_SPLITS, (long long)c->num_splits);
    FA_TRY(fa_check_dim(lp, "lse_partial", 0, c->num_splits, "splits, as out_partial"));
    FA_TRY(fa_check_dim(lp, "lse_partial", 1, c->b, "batch, as out_partial"));
    FA_TRY(fa_check_dim(lp, "lse_partial", 2, c->max_sq, "seqlen, as out_partial"));
    FA_TRY(fa_check_dim(lp, "lse_partial", 3, c->h, "heads, as out_partial"));
    FA_TRY(fa_check_dim(o, "out", 0, c->b, "batch, as out_partial"));
    FA_TRY(fa_check_dim(o, "out", 1, c->max_sq, "seqlen, as out_partial"));
    FA_TRY(fa_check_dim(o, "out", 2, c->h, "heads, as out_partial"));
    FA_TRY(fa_check_dim(o, "out", 3, c->dv, "head_dim, as out_partial"));

    c->accum_dtype = op->dtype;
    c->oaccum = op->data;
    c->oaccum_sstride = op->stride[0];
    c->oaccum_bstride = op->stride[1];
    c->oaccum_rstride = op->stride[2];
    c->oaccum_hstride = op->stride[3];
    c->lseaccum = lp->data;
    c->lseaccum_sstride = lp->stride[0];
    c->lseaccum_bstride = lp->stride[1];
    c->lseaccum_rstride = lp->stride[2];
    c->lseaccum_hstride = lp->stride[3];
    c->dtype = o->dtype;
    c->out = o->data;
    c->o_bstride = o->stride[0];
    c->o_rstride = o->stride[1];
    c->o_hstride = o->stride[2];

    if (a->lse) {
        const fa_tensor *t = a->lse;
        FA_TRY(fa_check_strided(t, "lse", 3));
        if (t->dtype != FA_DTYPE_F32 &&
            !(t->dtype == FA_DTYPE_F64 && c->accum_dtype == FA_DTYPE_F64))
            return FA_BAD("lse: dtype must be fp32 (or fp64 with fp64 partials), got %s",
                          fa_dtype_name(t->dtype));
        FA_TRY(fa_check_dim(t, "lse", 0, c->b, "batch"));
        FA_TRY(fa_check_dim(t, "lse", 1, c->max_sq, "seqlen"));
        FA_TRY(fa_check_dim(t, "lse", 2, c->h, "heads"));
        c->lse = t->data;
        c->lse_dtype = t->dtype;
        c->lse_bstride = t->stride[0];
        c->lse_rstride = t->stride[1];
        c->lse_hstride = t->stride[2];
    }
    FA_TRY(fa_check_disjoint(o, "out", op, "out_partial"));
    FA_TRY(fa_check_disjoint(o, "out", lp, "lse_partial"));
    FA_TRY(fa_check_writable(o, "out"));
    FA_TRY(fa_check_writable(a->lse, "lse"));
    c->empty_lse = -INFINITY;
    FA_TRY(fa_check_threads(a->num_threads));
    c->num_threads = a->num_threads;
    return FA_STATUS_OK;
}
