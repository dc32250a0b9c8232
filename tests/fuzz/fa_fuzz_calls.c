/* The fuzzer's cases, one per entry point of the C API (fa_fuzz_case.h). */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fa_fuzz_gen.h"

/* ---- entry points ------------------------------------------------------------------------ */

static int fz_is_fp8(fa_dtype dt) { return dt == FA_DTYPE_F8E4M3 || dt == FA_DTYPE_F8E5M2; }

/* A block mask tensor's entries: counts in [0, hi] or indices in [0, hi) mostly, and now and
 * then one past either end. */
static void fz_block_values(fz_case *c, const fa_tensor *t, int64_t hi)
{
    if (!fz_backed(c, t) || t->dtype != FA_DTYPE_I32)
        return;
    int64_t idx[4] = {0, 0, 0, 0};
    if (fz_numel(t) == 0)
        return;
    do {
        const int64_t x = fz_chance(c->src, 97) ? fz_range(c->src, 0, hi) : FZ_PICK(c->src,
                                                                        ((const int64_t[]){-1, hi + 1, INT32_MAX}));
        fz_store(t, idx, (double)x);
    } while (fz_next(t, idx));
}

/* Now and then a block mask: block sizes, dims and entries around the valid ones. The library
 * takes or refuses it as the call allows; it must never read past the tensors. */
static void fz_block_mask(fz_case *c, fa_fwd_args *a, const fz_dims *p)
{
    fz_src *s = c->src;
    if (!fz_chance(s, 8))
        return;
    fa_block_mask *bm = &c->block_mask;
    bm->q_block = fz_chance(s, 95) ? fz_range(s, 1, 70) : fz_range(s, -1, 0);
    bm->kv_block = fz_chance(s, 95) ? fz_range(s, 1, 70) : fz_range(s, -1, 0);
    const int64_t qbl = bm->q_block > 0 ? bm->q_block : 1, kbl = bm->kv_block > 0 ? bm->kv_block : 1;
    const int64_t nq = (p->sq + qbl - 1) / qbl + (fz_chance(s, 90) ? fz_range(s, 0, 1) : -1);
    const int64_t nk = (p->sk + kbl - 1) / kbl;
    const int64_t n = fz_chance(s, 90) ? nk + fz_range(s, 0, 2) : fz_range(s, 0, nk);
    const int64_t B = fz_chance(s, 50) ? 1 : p->b + (fz_chance(s, 95) ? 0 : 1);
    const int64_t H = fz_chance(s, 50) ? 1 : p->h + (fz_chance(s, 95) ? 0 : 1);
    const int64_t ns[3] = {B, H, nq < 0 ? 0 : nq}, is[4] = {B, H, nq < 0 ? 0 : nq, n};
    const fa_dtype dt = fz_chance(s, 97) ? FA_DTYPE_I32 : FA_DTYPE_F32;
    bm->kv_num_blocks = fz_tensor(c, "kv_num_blocks", dt, 3, ns, FZ_IDX);
    bm->kv_indices = fz_tensor(c, "kv_indices", FA_DTYPE_I32, fz_chance(s, 97) ? 4 : 3, is, FZ_IDX);
    fz_block_values(c, bm->kv_num_blocks, n);
    fz_block_values(c, bm->kv_indices, nk + 1);
    if (fz_chance(s, 50)) {
        bm->full_kv_num_blocks = fz_tensor(c, "full_kv_num_blocks", FA_DTYPE_I32, 3, ns, FZ_IDX);
        if (fz_chance(s, 97))
            bm->full_kv_indices = fz_tensor(c, "full_kv_indices", FA_DTYPE_I32, 4, is, FZ_IDX);
        fz_block_values(c, bm->full_kv_num_blocks, n);
        fz_block_values(c, bm->full_kv_indices, nk + 1);
    }
    fz_note(c, " block_mask %lldx%lld [%lld, %lld, %lld, %lld]", (long long)bm->q_block,
            (long long)bm->kv_block, (long long)B, (long long)H, (long long)nq, (long long)n);
    a->block_mask = bm;
}

/* fp8 inputs: a 16-bit out most of the time (fp8 has no fp8 out), and FA3's descales; descales
 * now and then on other inputs too, which must refuse them. */
static void fz_fp8(fz_case *c, fa_fwd_args *a, const fz_dims *p)
{
    fz_src *s = c->src;
    const int fp8 = fz_is_fp8(p->dt);
    const int64_t ds[2] = {p->b, p->hk};
    const fa_tensor **descales[3] = {&a->q_descale, &a->k_descale, &a->v_descale};
    static const char *const names[3] = {"q_descale", "k_descale", "v_descale"};
    for (int i = 0; i < 3; i++)
        if (fz_chance(s, fp8 ? 40 : 3)) {
            *descales[i] = fz_tensor(c, names[i], FA_DTYPE_F32, 2, ds, FZ_IN);
            c->must_fail |= !fp8;
        }
}

/* Dense or varlen forward arguments over fresh tensors; lse always (the backward needs it). */
static void fz_fwd_args(fz_case *c, fa_fwd_args *a, int varlen, int for_backward)
{
    fz_src *s = c->src;
    fz_dims p = fz_problem(c);
    fa_fwd_args_init(a);
    /* fp8 inputs write a 16-bit out (an fp8 out is refused) */
    const fa_dtype odt = fz_is_fp8(p.dt) && fz_chance(s, 85)
                             ? (fz_chance(s, 70) ? FA_DTYPE_BF16 : FA_DTYPE_F16)
                             : p.dt;
    if (!varlen) {
        const int64_t qs[4] = {p.b, p.sq, p.h, p.d}, ks[4] = {p.b, p.sk, p.hk, p.d},
                      vs[4] = {p.b, p.sk, p.hk, p.dv}, os[4] = {p.b, p.sq, p.h, p.dv},
                      ls[3] = {p.b, p.h, p.sq};
        a->q = fz_tensor(c, "q", p.dt, 4, qs, FZ_IN);
        a->k = fz_tensor(c, "k", p.dt, 4, ks, FZ_IN);
        a->v = fz_tensor(c, "v", p.dt, 4, vs, FZ_IN);
        a->out = fz_tensor(c, "out", odt, 4, os, FZ_OUT);
        if (for_backward || fz_chance(s, 80))
            a->lse = fz_tensor(c, "lse", fz_lse_dtype(s, p.dt), 3, ls, FZ_OUT);
    } else {
        /* Sequence lengths, then offsets that leave rows outside every sequence now and then. */
        int64_t lq[4], lk[4], tq = 0, tk = 0, mq = 0, mk = 0;
        const int64_t b = p.b > 3 ? 3 : p.b;
        for (int64_t i = 0; i < b; i++) {
            lq[i] = fz_len(s);
            lk[i] = fz_len(s);
            tq += lq[i];
            tk += lk[i];
            mq = lq[i] > mq ? lq[i] : mq;
            mk = lk[i] > mk ? lk[i] : mk;
        }
        const int64_t q0 = fz_chance(s, 20) ? fz_range(s, 1, 3) : 0;
        const int64_t k0 = fz_chance(s, 20) ? fz_range(s, 1, 3) : 0;
        const int64_t total_q = tq + q0 + (fz_chance(s, 20) ? 2 : 0);
        const int64_t total_k = tk + k0 + (fz_chance(s, 20) ? 2 : 0);
        const int64_t qs[3] = {total_q, p.h, p.d}, ks[3] = {total_k, p.hk, p.d},
                      vs[3] = {total_k, p.hk, p.dv}, os[3] = {total_q, p.h, p.dv},
                      ls[2] = {p.h, total_q}, cs[1] = {b + 1}, us[1] = {b};
        a->q = fz_tensor(c, "q", p.dt, 3, qs, FZ_IN);
        a->k = fz_tensor(c, "k", p.dt, 3, ks, FZ_IN);
        a->v = fz_tensor(c, "v", p.dt, 3, vs, FZ_IN);
        a->out = fz_tensor(c, "out", odt, 3, os, FZ_OUT);
        if (for_backward || fz_chance(s, 80))
            a->lse = fz_tensor(c, "lse", fz_lse_dtype(s, p.dt), 2, ls, FZ_OUT);
        const fa_tensor *cq = fz_tensor(c, "cu_seqlens_q", FA_DTYPE_I32, 1, cs, FZ_IDX);
        const fa_tensor *ck = fz_tensor(c, "cu_seqlens_k", FA_DTYPE_I32, 1, cs, FZ_IDX);
        int64_t oq = q0, ok = k0;
        for (int64_t i = 0; i <= b; i++) {
            fz_set_i32(c, cq, i, 0, oq);
            fz_set_i32(c, ck, i, 0, ok);
            if (i < b) {
                oq += lq[i];
                ok += lk[i];
            }
        }
        if (fz_chance(s, 10)) { /* a bad offset: non-monotone, negative, past the end */
            static const int64_t odd[] = {-1, -5, INT32_MAX, INT32_MIN, 1000};
            const int64_t i = fz_range(s, 0, b);
            const int64_t x = fz_chance(s, 50) ? FZ_PICK(s, odd) : fz_range(s, 0, total_q + 2);
            fz_set_i32(c, fz_chance(s, 50) ? cq : ck, i, 0, x);
            fz_note(c, " (cu_seqlens[%lld] = %lld)", (long long)i, (long long)x);
        }
        a->cu_seqlens_q = cq;
        a->cu_seqlens_k = ck;
        static const int64_t odd_max[] = {-1, INT64_MAX, FA_MAX_EXTENT, FA_MAX_EXTENT + 1, 0};
        a->max_seqlen_q = fz_chance(s, 90) ? mq + (fz_chance(s, 20) ? 3 : 0) : FZ_PICK(s, odd_max);
        a->max_seqlen_k = fz_chance(s, 90) ? mk + (fz_chance(s, 20) ? 3 : 0) : FZ_PICK(s, odd_max);
        if (a->max_seqlen_q < 0 || a->max_seqlen_q > FA_MAX_EXTENT || a->max_seqlen_k < 0 ||
            a->max_seqlen_k > FA_MAX_EXTENT)
            c->must_fail = 1;
        fz_note(c, " max_seqlen %lld/%lld", (long long)a->max_seqlen_q,
                (long long)a->max_seqlen_k);
        if (fz_chance(s, 25)) {
            const fa_tensor *u = fz_tensor(c, "seqused_k", FA_DTYPE_I32, 1, us, FZ_IDX);
            for (int64_t i = 0; i < b; i++)
                fz_set_i32(c, u, i, 0, fz_chance(s, 95) ? fz_range(s, 0, lk[i]) : lk[i] + 1);
            a->seqused_k = u;
        }
    }
    fz_maybe_alias(c, (fa_tensor *)a->out, a->q, "q");
    if (fz_chance(s, 15)) {
        const int64_t as1[1] = {p.h}, as2[2] = {p.b, p.h};
        const int two = fz_chance(s, 50);
        fa_tensor *t = fz_tensor(c, "alibi_slopes", FA_DTYPE_F32, two ? 2 : 1, two ? as2 : as1,
                                 FZ_IN);
        a->alibi_slopes = t;
    }
    if (fz_chance(s, 15)) {
        const int64_t hs[1] = {p.h};
        a->sinks = fz_tensor(c, "sinks", FA_DTYPE_F32, 1, hs, FZ_IN);
    }
    if (!for_backward && !varlen && fz_chance(s, 10)) {
        const int64_t ps[4] = {p.b, p.h, p.sq + fz_range(s, 0, 2), p.sk + fz_range(s, 0, 2)};
        a->probs = fz_tensor(c, "probs", p.dt, 4, ps, FZ_OUT);
    }
    a->softmax_scale = fz_scale(c);
    a->softcap = fz_softcap(c);
    a->causal = fz_chance(s, 30);
    a->window_left = fz_window(c, "left");
    a->window_right = fz_window(c, "right");
    if (fz_chance(s, 20)) {
        static const double odd[] = {0.5, 0.99, -0.1, 1.0, NAN, INFINITY};
        a->dropout_p = fz_chance(s, 60) ? fz_uniform(s, 0.0, 0.9) : odd[fz_below(s, c->chaos ? 6 : 2)];
        if (!(a->dropout_p >= 0.0 && a->dropout_p < 1.0) ||
            (a->dropout_p > 0.0 && a->softcap > 0.0))
            c->must_fail = 1;
        fz_note(c, " dropout %g", a->dropout_p);
    }
    a->seed = fz_below(s, UINT64_MAX);
    a->offset = fz_chance(s, 90) ? fz_below(s, 1000) : UINT64_MAX - fz_below(s, 4);
    a->device = fz_device(c);
    a->num_threads = fz_threads(c);
    fz_fp8(c, a, &p);
    fz_mods(c, a);
    fz_block_mask(c, a, &p);
}

static void fz_forward(fz_case *c, int varlen)
{
    c->entry = varlen ? "fa_attention_forward (varlen)" : "fa_attention_forward";
    fa_fwd_args a;
    fz_fwd_args(c, &a, varlen, 0);
    if (c->chaos && fz_chance(c->src, 2)) {
        a.q = NULL;
        c->must_fail = 1;
    }
    if (fz_check_status(c, fa_attention_forward(&a))) {
        fz_check_finite(c, a.out, "out", 0);
        fz_check_finite(c, a.lse, "lse", 1);
        fz_check_finite(c, a.probs, "probs", 0);
    }
}

/* A gradient shaped as `like`, perhaps mutated. */
static const fa_tensor *fz_like(fz_case *c, const char *name, const fa_tensor *like, int role)
{
    return fz_tensor(c, name, like->dtype, like->ndim, like->shape, role);
}

static void fz_backward(fz_case *c, int varlen)
{
    c->entry = "fa_attention_forward (before the backward)";
    fa_fwd_args a;
    fz_fwd_args(c, &a, varlen, 1);
    const int fwd_must_fail = c->must_fail;
    const fa_status fst = fa_attention_forward(&a);
    const int fwd_ok = fz_check_status(c, fst);
    c->entry = varlen ? "fa_attention_backward (varlen)" : "fa_attention_backward";
    fz_note(c, " | backward:");
    if (!fwd_ok && a.lse && fz_backed(c, a.lse) && fz_numel(a.lse) > 0) {
        /* The forward refused: the backward still gets an lse, of garbage. */
        int64_t idx[FA_MAX_DIMS] = {0};
        do
            fz_store(a.lse, idx, fz_uniform(c->src, -3.0, 3.0));
        while (fz_next(a.lse, idx));
    }
    if (fst != FA_STATUS_OK && fz_backed(c, a.out) && fz_numel(a.out) > 0) {
        int64_t idx[FA_MAX_DIMS] = {0};
        do
            fz_store(a.out, idx, fz_uniform(c->src, -1.0, 1.0));
        while (fz_next(a.out, idx));
    }
    fa_bwd_args g;
    fa_bwd_args_init(&g);
    g.fwd = &a;
    g.dout = fz_like(c, "dout", a.out, FZ_IN);
    g.dq = fz_like(c, "dq", a.q, FZ_OUT);
    g.dk = fz_like(c, "dk", a.k, FZ_OUT);
    g.dv = fz_like(c, "dv", a.v, FZ_OUT);
    if (a.sinks && fz_chance(c->src, 95)) {
        const int64_t hs[1] = {a.sinks->shape[0]};
        g.dsinks = fz_tensor(c, "dsinks", FA_DTYPE_F32, 1, hs, FZ_OUT);
    } else if (a.sinks) {
        c->must_fail = 1;
    }
    g.deterministic = fz_chance(c->src, 50);
    /* Now and then a gradient over what the backward reads, or over another gradient. */
    fz_maybe_alias(c, (fa_tensor *)g.dk, a.k, "k");
    fz_maybe_alias(c, (fa_tensor *)g.dv, g.dout, "dout");
    fz_maybe_alias(c, (fa_tensor *)g.dq, g.dv, "dv");
    if (c->chaos && fz_chance(c->src, 3)) {
        a.lse = NULL;
        c->must_fail = 1;
    }
    (void)fa_attention_backward_workspace_size(&g);
    if (fz_check_status(c, fa_attention_backward(&g)) && fwd_ok && !fwd_must_fail) {
        /* A gradient may pass fp16's range (scale up to 1e4, dropout's 1 / (1 - p)): inf is
         * then its rounding; NaN never is. */
        const int inf_ok = a.q->dtype == FA_DTYPE_F16;
        fz_check_finite(c, g.dq, "dq", inf_ok);
        fz_check_finite(c, g.dk, "dk", inf_ok);
        fz_check_finite(c, g.dv, "dv", inf_ok);
        fz_check_finite(c, g.dsinks, "dsinks", 0);
    }
}

static void fz_kvcache(fz_case *c)
{
    c->entry = "fa_attention_kvcache";
    fz_src *s = c->src;
    fz_dims p = fz_problem(c);
    fa_kvcache_args a;
    fa_kvcache_args_init(&a);
    const int paged = fz_chance(s, 40);
    const int64_t s_new = fz_chance(s, 50) ? fz_range(s, 0, 4) : -1; /* -1: no append */
    const int64_t page = paged ? fz_range(s, 1, 5) : 0;
    const int64_t max_blocks = paged ? fz_range(s, 1, 5) : 0;
    const int64_t n_blocks = paged ? fz_range(s, 1, p.b * max_blocks + 1) : 0;
    const int64_t b_cache = paged ? n_blocks : p.b + fz_range(s, 0, 2);
    const int64_t s_cache = paged ? page : fz_range(s, 0, 16);
    const int64_t capacity = paged ? page * max_blocks : s_cache;
    fz_note(c, " paged %d page %lld blocks %lld/%lld s_cache %lld s_new %lld;", paged,
            (long long)page, (long long)max_blocks, (long long)n_blocks, (long long)s_cache,
            (long long)s_new);
    const int64_t qs[4] = {p.b, p.sq, p.h, p.d}, os[4] = {p.b, p.sq, p.h, p.dv},
                  kc[4] = {b_cache, s_cache, p.hk, p.d}, vc[4] = {b_cache, s_cache, p.hk, p.dv},
                  bs[1] = {p.b}, ls[3] = {p.b, p.h, p.sq};
    a.q = fz_tensor(c, "q", p.dt, 4, qs, FZ_IN);
    a.k_cache = fz_tensor(c, "k_cache", p.dt, 4, kc, FZ_IN);
    a.v_cache = fz_tensor(c, "v_cache", p.dt, 4, vc, FZ_IN);
    a.out = fz_tensor(c, "out", p.dt, 4, os, FZ_OUT);
    if (fz_chance(s, 60))
        a.lse = fz_tensor(c, "lse", fz_lse_dtype(s, p.dt), 3, ls, FZ_OUT);
    if (s_new >= 0) {
        const int64_t ks[4] = {p.b, s_new, p.hk, p.d}, vs[4] = {p.b, s_new, p.hk, p.dv};
        a.k = fz_tensor(c, "k", p.dt, 4, ks, FZ_IN);
        a.v = fz_tensor(c, "v", p.dt, 4, vs, FZ_IN);
    }
    const int64_t room = capacity - (s_new > 0 ? s_new : 0);
    int32_t lens[4] = {0, 0, 0, 0};
    if (s_new >= 0 || fz_chance(s, 60)) {
        const fa_tensor *t = fz_tensor(c, "cache_seqlens", FA_DTYPE_I32, 1, bs, FZ_IDX);
        for (int64_t i = 0; i < p.b && i < 4; i++) {
            static const int64_t odd[] = {-1, INT32_MAX, INT32_MIN};
            int64_t x = room < 0 || fz_chance(s, 5) ? (fz_chance(s, 50) ? room + 1 : FZ_PICK(s, odd))
                                                    : fz_range(s, 0, room);
            lens[i] = (int32_t)x;
            fz_set_i32(c, t, i, 0, x);
        }
        a.cache_seqlens = t;
    }
    if (fz_chance(s, 15)) {
        const fa_tensor *t = fz_tensor(c, "cache_leftpad", FA_DTYPE_I32, 1, bs, FZ_IDX);
        for (int64_t i = 0; i < p.b && i < 4; i++)
            fz_set_i32(c, t, i, 0, fz_chance(s, 95) ? fz_range(s, 0, lens[i] > 0 ? lens[i] : 0) : -1);
        a.cache_leftpad = t;
    }
    if (paged) {
        const int64_t bt[2] = {p.b, max_blocks};
        const fa_tensor *t = fz_tensor(c, "block_table", FA_DTYPE_I32, 2, bt, FZ_IDX);
        for (int64_t i = 0; i < p.b; i++)
            for (int64_t j = 0; j < max_blocks; j++) {
                static const int64_t odd[] = {-1, INT32_MAX, INT32_MIN};
                int64_t x = fz_chance(s, 97) ? fz_range(s, 0, n_blocks - 1)
                                             : fz_chance(s, 50) ? n_blocks : FZ_PICK(s, odd);
                fz_set_i32(c, t, i, j, x);
            }
        a.block_table = t;
    } else if (fz_chance(s, 25)) {
        const fa_tensor *t = fz_tensor(c, "cache_batch_idx", FA_DTYPE_I32, 1, bs, FZ_IDX);
        for (int64_t i = 0; i < p.b; i++)
            fz_set_i32(c, t, i, 0, fz_chance(s, 95) ? fz_range(s, 0, b_cache - 1) : b_cache);
        a.cache_batch_idx = t;
    }
    if (s_new >= 0 && fz_chance(s, 30) && p.d >= 2) {
        const int64_t half = fz_range(s, 1, p.d / 2);
        const int64_t ro[2] = {capacity + p.sq + fz_range(s, -2, 2), half};
        fa_tensor *cs = fz_tensor(c, "rotary_cos", p.dt, 2, ro, FZ_OUT);
        fa_tensor *sn = fz_tensor(c, "rotary_sin", p.dt, 2, ro, FZ_OUT);
        /* Angles of a unit circle: cos and sin stay in [-1, 1]. */
        for (int which = 0; which < 2; which++) {
            fa_tensor *t = which ? sn : cs;
            if (!fz_backed(c, t) || fz_numel(t) == 0)
                continue;
            int64_t idx[FA_MAX_DIMS] = {0};
            do {
                const double ang = 0.1 * (double)idx[0] * (double)(idx[1] + 1);
                fz_store(t, idx, which ? sin(ang) : cos(ang));
            } while (fz_next(t, idx));
        }
        a.rotary_cos = cs;
        a.rotary_sin = sn;
        a.rotary_interleaved = fz_chance(s, 50);
    }
    if (fz_chance(s, 10)) {
        const int64_t hs[1] = {p.h};
        a.alibi_slopes = fz_tensor(c, "alibi_slopes", FA_DTYPE_F32, 1, hs, FZ_IN);
    }
    if (fz_chance(s, 10)) {
        const int64_t hs[1] = {p.h};
        a.sinks = fz_tensor(c, "sinks", FA_DTYPE_F32, 1, hs, FZ_IN);
    }
    fz_maybe_alias(c, (fa_tensor *)a.out, fz_chance(s, 50) ? a.q : a.k_cache, "an input");
    a.softmax_scale = fz_scale(c);
    a.softcap = fz_softcap(c);
    a.causal = fz_chance(s, 30);
    a.window_left = fz_window(c, "left");
    a.window_right = fz_window(c, "right");
    static const int odd_splits[] = {-1, FA_MAX_SPLITS, FA_MAX_SPLITS + 1, INT_MAX, 1, 2, 3};
    a.num_splits = fz_chance(s, 70) ? 0 : FZ_PICK(s, odd_splits);
    if (a.num_splits < 0 || a.num_splits > FA_MAX_SPLITS)
        c->must_fail = 1;
    a.device = fz_device(c);
    a.num_threads = fz_threads(c);
    if (fz_check_status(c, fa_attention_kvcache(&a))) {
        fz_check_finite(c, a.out, "out", 0);
        fz_check_finite(c, a.lse, "lse", 1);
    }
}

static void fz_combine(fz_case *c)
{
    c->entry = "fa_attention_combine";
    fz_src *s = c->src;
    const fa_dtype pd = fz_chance(s, 80) ? FA_DTYPE_F32 : FA_DTYPE_F64;
    static const int64_t odd_splits[] = {0, FA_MAX_SPLITS, FA_MAX_SPLITS + 1};
    const int64_t splits = fz_chance(s, 95) ? fz_range(s, 1, 5) : FZ_PICK(s, odd_splits);
    const int64_t b = fz_range(s, 1, 3), sq = fz_len(s), h = fz_range(s, 1, 3);
    const int64_t dv = fz_head_dim(c);
    if (splits < 1 || splits > FA_MAX_SPLITS)
        c->must_fail = 1;
    fz_note(c, "splits %lld b %lld sq %lld h %lld dv %lld;", (long long)splits, (long long)b,
            (long long)sq, (long long)h, (long long)dv);
    const int64_t ops[5] = {splits, b, sq, h, dv}, lps[4] = {splits, b, sq, h},
                  os[4] = {b, sq, h, dv}, ls[3] = {b, sq, h};
    fa_combine_args a;
    fa_combine_args_init(&a);
    a.out_partial = fz_tensor(c, "out_partial", pd, 5, ops, FZ_IN);
    fa_tensor *lp = fz_tensor(c, "lse_partial", pd, 4, lps, FZ_IN);
    if (fz_backed(c, lp) && fz_numel(lp) > 0) {
        /* Log-sum-exps, with empty parts (-inf, or +inf as the forward writes) now and then. */
        int64_t idx[FA_MAX_DIMS] = {0};
        do {
            const int k = (int)fz_below(s, 10);
            fz_store(lp, idx, k == 0 ? -INFINITY : k == 1 ? INFINITY : fz_uniform(s, -30, 30));
        } while (fz_next(lp, idx));
    }
    a.lse_partial = lp;
    a.out = fz_tensor(c, "out", fz_float_dtype(s), 4, os, FZ_OUT);
    if (fz_chance(s, 60))
        a.lse = fz_tensor(c, "lse", pd == FA_DTYPE_F64 && fz_chance(s, 50) ? pd : FA_DTYPE_F32,
                          3, ls, FZ_OUT);
    fz_maybe_alias(c, (fa_tensor *)a.out, a.out_partial, "out_partial");
    a.device = fz_device(c);
    a.num_threads = fz_threads(c);
    if (fz_check_status(c, fa_attention_combine(&a))) {
        fz_check_finite(c, a.out, "out", 0);
        fz_check_finite(c, a.lse, "lse", 1);
    }
}

/* Precompile with at least one argument the plan refuses (a valid one would run NVRTC for
 * seconds), and the small queries. */
static void fz_misc(fz_case *c)
{
    fz_src *s = c->src;
    c->entry = "fa_cuda_precompile";
    static const int archs[] = {0, -1, 79, 75, INT_MIN, 80, 90};
    static const int dims[] = {0, -1, FA_MAX_HEAD_DIM + 1, INT_MAX, INT_MIN, 64, 128};
    static const fa_dtype dts[] = {FA_DTYPE_F32, FA_DTYPE_F64, FA_DTYPE_I32, (fa_dtype)77,
                                   (fa_dtype)-1, FA_DTYPE_F16, FA_DTYPE_BF16};
    int arch = FZ_PICK(s, archs), d = FZ_PICK(s, dims), dv = FZ_PICK(s, dims);
    fa_dtype dt = FZ_PICK(s, dts);
    if (arch >= 80 && (dt == FA_DTYPE_F16 || dt == FA_DTYPE_BF16) && d >= 1 &&
        d <= FA_MAX_HEAD_DIM && dv >= 1 && dv <= FA_MAX_HEAD_DIM)
        d = 0;
    c->must_fail = 1;
    fz_note(c, "arch %d dtype %d d %d dv %d", arch, (int)dt, d, dv);
    int cached = -1;
    fz_check_status(c, fa_cuda_precompile(arch, dt, d, dv, (unsigned)fz_below(s, 1u << 8),
                                          fz_chance(s, 50) ? &cached : NULL));
    c->must_fail = 0;

    c->entry = "fa_cuda_device_info_get";
    fa_cuda_device_info info;
    const int dev = (int)fz_range(s, -3, 3);
    if (dev >= fa_cuda_device_count() || dev < 0)
        c->must_fail = 1;
    fz_check_status(c, fa_cuda_device_info_get(dev, fz_chance(s, 80) ? &info : NULL));
    c->must_fail = 0;

    static const int64_t odd[] = {0, -1, 1, INT64_MAX, INT64_MIN, 7};
    (void)fa_dropout_keep(fz_below(s, UINT64_MAX), fz_below(s, UINT64_MAX), FZ_PICK(s, odd),
                          FZ_PICK(s, odd), FZ_PICK(s, odd), FZ_PICK(s, odd), FZ_PICK(s, odd),
                          fz_chance(s, 50) ? NAN : fz_uniform(s, -1.0, 2.0));
    (void)fa_probs_block_n((int)FZ_PICK(s, odd), (int)fz_below(s, 3), (int)fz_below(s, 3));
    const int64_t shape[FA_MAX_DIMS] = {FZ_PICK(s, odd), FZ_PICK(s, odd), FZ_PICK(s, odd),
                                        FZ_PICK(s, odd), FZ_PICK(s, odd), FZ_PICK(s, odd)};
    fa_tensor t = fa_tensor_make(NULL, (fa_dtype)fz_range(s, -1, 6), (int)fz_range(s, -2, 8),
                                 fz_chance(s, 90) ? shape : NULL, NULL);
    (void)t;
    if (!fa_dtype_name((fa_dtype)fz_range(s, -5, 10)) ||
        !fa_status_string((fa_status)fz_range(s, -5, 10)) || !fa_version() ||
        !fa_cpu_description() || !fa_cuda_status())
        fz_fail(c, "a query returned NULL");
    (void)fa_dtype_size((fa_dtype)fz_range(s, -5, 10));
}

int fz_run_case(fz_src *s)
{
    fz_case *c = calloc(1, sizeof *c);
    if (!c)
        abort();
    c->src = s;
    c->chaos = fz_chance(s, 50);
    const int kind = (int)fz_below(s, 100);
    if (kind < 25)
        fz_forward(c, 0);
    else if (kind < 42)
        fz_forward(c, 1);
    else if (kind < 55)
        fz_backward(c, 0);
    else if (kind < 64)
        fz_backward(c, 1);
    else if (kind < 82)
        fz_kvcache(c);
    else if (kind < 92)
        fz_combine(c);
    else if (kind < 95)
        fz_block_mask_build(c);
    else if (kind < 97)
        fz_mod_parse(c);
    else
        fz_misc(c);
    for (int i = 0; i < c->n_tensors; i++)
        free(c->allocs[i]);
    fa_mod_destroy(c->mods[0]);
    fa_mod_destroy(c->mods[1]);
    const int accepted = c->accepted;
    free(c);
    return accepted;
}
