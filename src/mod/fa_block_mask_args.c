/* fa_block_mask_build's arguments: the program and its tensors as a call's, the sizes, the
 * four int32 outputs. */
#include "core/fa_check.h"
#include "core/fa_options.h"
#include "mod/fa_block_mask_args.h"
#include "mod/fa_mod.h"

/* An int32 output of shape dims[0 .. ndim), written by the builder. */
static fa_status fa_bm_output(const fa_tensor *t, const char *name, int ndim, const int64_t *dims)
{
    if (!t)
        return FA_BAD("%s: NULL", name);
    FA_TRY(fa_check_strided(t, name, ndim));
    FA_TRY(fa_check_dtype(t, name, FA_DTYPE_I32, "(block indices)"));
    static const char *const what[4] = {"the batch b", "the heads h", "ceil(sq / q_block)",
                                        "ceil(sk / kv_block)"};
    for (int d = 0; d < ndim; d++)
        FA_TRY(fa_check_dim(t, name, d, dims[d], what[d]));
    return fa_check_writable(t, name);
}

fa_status fa_block_mask_args_check(const fa_block_mask_args *a, fa_params *p)
{
    *p = (fa_params){0};
    if (!a)
        return FA_BAD("args: NULL");
    FA_TRY(fa_check_device(a->device));
    if (!a->mask_mod)
        return FA_BAD("mask_mod: NULL; fa_block_mask_build evaluates a mask program");
    const struct {
        const char *name;
        int64_t v;
    } sizes[] = {{"b", a->b},        {"h", a->h},     {"sq", a->sq},
                 {"sk", a->sk},      {"q_block", a->q_block}, {"kv_block", a->kv_block}};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (sizes[i].v < 1 || sizes[i].v > FA_MAX_EXTENT)
            return FA_BAD("%s: must be in [1, 2^40], got %lld", sizes[i].name,
                          (long long)sizes[i].v);
    /* The program and its tensors, checked as a forward call's. */
    fa_fwd_args f = {0};
    f.mask_mod = a->mask_mod;
    f.device = a->device;
    for (int i = 0; i < FA_MOD_AUX_SLOTS; i++)
        f.mod_aux[i] = a->mod_aux[i];
    const fa_mod_dims dims = {0, a->b, a->h, a->sq, a->sk};
    FA_TRY(fa_mod_check_call(&f, &dims, &p->mods));
    const int64_t nq = (a->sq + a->q_block - 1) / a->q_block;
    const int64_t nk = (a->sk + a->kv_block - 1) / a->kv_block;
    const int64_t shape[4] = {a->b, a->h, nq, nk};
    FA_TRY(fa_bm_output(a->kv_num_blocks, "kv_num_blocks", 3, shape));
    FA_TRY(fa_bm_output(a->kv_indices, "kv_indices", 4, shape));
    if (!a->full_kv_num_blocks != !a->full_kv_indices)
        return FA_BAD("%s: given without %s; give both or neither",
                      a->full_kv_num_blocks ? "full_kv_num_blocks" : "full_kv_indices",
                      a->full_kv_num_blocks ? "full_kv_indices" : "full_kv_num_blocks");
    const fa_tensor *out[4] = {a->kv_num_blocks, a->kv_indices, a->full_kv_num_blocks,
                               a->full_kv_indices};
    static const char *const names[4] = {"kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                         "full_kv_indices"};
    if (a->full_kv_num_blocks) {
        FA_TRY(fa_bm_output(a->full_kv_num_blocks, "full_kv_num_blocks", 3, shape));
        FA_TRY(fa_bm_output(a->full_kv_indices, "full_kv_indices", 4, shape));
    }
    /* The outputs apart from one another and from what the program reads. */
    for (int i = 0; i < 4; i++) {
        for (int j = i + 1; j < 4; j++)
            FA_TRY(fa_check_disjoint(out[i], names[i], out[j], names[j]));
        for (int s = 0; s < FA_MOD_AUX_SLOTS; s++)
            FA_TRY(fa_check_disjoint(out[i], names[i], a->mod_aux[s], "mod_aux"));
    }
    p->b = a->b, p->h = a->h, p->hk = a->h;
    p->max_sq = a->sq, p->max_sk = a->sk;
    return FA_STATUS_OK;
}
