/* The bench's self-check: the library's output against the double-precision oracle. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fa_bench.h"
#include "fa_ref.h"

/* Multiply-adds the oracle may spend on every row (its loops visit every key, masked or not):
 * about a second of plain double loops. Bigger problems are checked on a sample of tokens. */
#define ORACLE_FULL_BUDGET 3e8
/* Tokens checked when sampling: enough to cover every head, tile edge and mask shape. */
#define SAMPLE_TOKENS 64

/* Every (query, key) pair of every sequence, visible or not. */
static double all_pairs(const fa_fwd_args *a)
{
    if (!a->cu_seqlens_q)
        return (double)a->q->shape[0] * (double)a->q->shape[1] * (double)a->k->shape[1];
    const int32_t *cu_q = a->cu_seqlens_q->data, *cu_k = a->cu_seqlens_k->data;
    double pairs = 0.0;
    for (int64_t s = 0; s + 1 < a->cu_seqlens_q->shape[0]; s++)
        pairs += (double)(cu_q[s + 1] - cu_q[s]) * (double)(cu_k[s + 1] - cu_k[s]);
    return pairs;
}

/* Positions of token t of out ([b, sq, h, dv] or [tokens, h, dv]) and lse ([b, h, sq] or
 * [h, tokens]) for head hh; out's last index is left for the caller. */
static void token_index(const fa_bench_problem *p, int64_t t, int64_t hh, int64_t *out_idx,
                        int64_t *lse_idx)
{
    if (p->args.cu_seqlens_q) {
        out_idx[0] = t;
        out_idx[1] = hh;
        lse_idx[0] = hh;
        lse_idx[1] = t;
    } else {
        int64_t sq = p->q.shape[1];
        out_idx[0] = t / sq;
        out_idx[1] = t % sq;
        out_idx[2] = hh;
        lse_idx[0] = t / sq;
        lse_idx[1] = hh;
        lse_idx[2] = t % sq;
    }
}

/* Elements the kernel left unwritten (still the NaN poison) or wrote as non-finite. lse may be
 * +inf (a row with nothing visible) but never NaN. */
static int64_t unwritten_count(const fa_bench_problem *p)
{
    int64_t bad = 0, idx[FA_MAX_DIMS] = {0};
    int64_t n = fa_bench_numel(&p->out);
    for (int64_t e = 0; e < n; e++, fa_bench_index_next(&p->out, idx))
        bad += !isfinite(fa_ref_load(&p->out, idx));
    memset(idx, 0, sizeof idx);
    n = fa_bench_numel(&p->lse);
    for (int64_t e = 0; e < n; e++, fa_bench_index_next(&p->lse, idx))
        bad += isnan(fa_ref_load(&p->lse, idx));
    return bad;
}

/* Errors |got - want| where NaN counts as infinitely wrong, and two equal infinities as
 * right (an empty row's lse is +inf in both). */
static double abs_error(double got, double want)
{
    if (isnan(got) || isnan(want))
        return INFINITY;
    if (got == want)
        return 0.0;
    return fabs(got - want);
}

int fa_bench_check(const fa_bench_problem *p, const fa_bench_config *cfg,
                   fa_bench_check_result *r)
{
    const fa_fwd_args *a = &p->args;
    const int64_t h = cfg->heads, dv = cfg->head_dim_v, tokens = p->tokens_q;
    const int lowp = cfg->dtype == FA_DTYPE_F16 || cfg->dtype == FA_DTYPE_BF16;
    const int full = (double)h * all_pairs(a) * (double)(cfg->head_dim + dv) <= ORACLE_FULL_BUDGET;
    int64_t row_step = 1;
    if (!full) {
        row_step = (tokens + SAMPLE_TOKENS - 1) / SAMPLE_TOKENS;
        /* An odd step lands on every residue modulo the power-of-two tile heights. */
        row_step += row_step > 1 && row_step % 2 == 0;
    }

    memset(r, 0, sizeof *r);
    /* calloc: pages of rows the oracle skips are never touched, so sampling stays cheap.
     * One spare element keeps an empty problem from asking for 0 bytes. */
    size_t n_out = (size_t)(tokens * h * dv) + 1, n_lse = (size_t)(tokens * h) + 1;
    double *ref_out = calloc(n_out, sizeof *ref_out);
    double *ref_lse = calloc(n_lse, sizeof *ref_lse);
    double *lowp_out = lowp && full ? calloc(n_out, sizeof *lowp_out) : NULL;
    int rc = FA_EXIT_FAIL;
    if (!ref_out || !ref_lse || (lowp && full && !lowp_out)) {
        fprintf(stderr, "flashattn bench: out of memory for the oracle's output\n");
        goto done;
    }
    if (fa_ref_forward(a, row_step, ref_out, ref_lse) != 0 ||
        (lowp_out && fa_ref_forward_lowp(a, lowp_out) != 0)) {
        fprintf(stderr, "flashattn bench: the oracle could not read the arguments\n");
        goto done;
    }

    double ref_max = 0.0, lowp_err = 0.0, lse_max = 0.0;
    for (int64_t t = 0; t < tokens; t += row_step) {
        for (int64_t hh = 0; hh < h; hh++) {
            int64_t out_idx[4], lse_idx[3];
            token_index(p, t, hh, out_idx, lse_idx);
            const double *want = ref_out + (t * h + hh) * dv;
            for (int64_t c = 0; c < dv; c++) {
                out_idx[p->out.ndim - 1] = c;
                r->out_err = fmax(r->out_err, abs_error(fa_ref_load(&p->out, out_idx), want[c]));
                ref_max = fmax(ref_max, fabs(want[c]));
                if (lowp_out)
                    lowp_err = fmax(lowp_err, fabs(lowp_out[(t * h + hh) * dv + c] - want[c]));
            }
            double want_lse = ref_lse[t * h + hh];
            r->lse_err = fmax(r->lse_err, abs_error(fa_ref_load(&p->lse, lse_idx), want_lse));
            if (isfinite(want_lse))
                lse_max = fmax(lse_max, fabs(want_lse));
        }
        r->tokens_checked++;
    }

    const char *dt = fa_dtype_name(cfg->dtype);
    if (cfg->dtype == FA_DTYPE_F32 || cfg->dtype == FA_DTYPE_F64) {
        const int f32 = cfg->dtype == FA_DTYPE_F32;
        r->out_tol = (f32 ? 1e-4 : 1e-10) * ref_max;
        snprintf(r->criterion, sizeof r->criterion, "%s * max|ref| (%s)", f32 ? "1e-4" : "1e-10",
                 dt);
    } else if (lowp_out) {
        /* Upstream's criterion: at most twice the error of naive attention in the same dtype. */
        r->out_tol = 2.0 * lowp_err + 1e-3;
        snprintf(r->criterion, sizeof r->criterion,
                 "2 * max|naive %s - ref| + 1e-3, naive error %.3g", dt, lowp_err);
    } else {
        const int f16 = cfg->dtype == FA_DTYPE_F16;
        r->out_tol = (f16 ? 1e-2 : 4e-2) * p->max_abs_v / (1.0 - cfg->dropout_p);
        snprintf(r->criterion, sizeof r->criterion,
                 "%s * max|v| / (1 - dropout) (%s; too big for the naive %s baseline)",
                 f16 ? "1e-2" : "4e-2", dt, dt);
    }
    /* lse is fp32 for every dtype; its error grows with the log of the row's key count. */
    r->lse_tol = 1e-4 * fmax(1.0, lse_max);
    r->unwritten = unwritten_count(p);
    r->pass = r->out_err <= r->out_tol && r->lse_err <= r->lse_tol && r->unwritten == 0;
    rc = FA_EXIT_OK;
done:
    free(ref_out);
    free(ref_lse);
    free(lowp_out);
    return rc;
}
