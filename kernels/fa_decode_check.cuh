/*
 * The paged capacity check in the kernels (fa_decode.cu): cache_seqlens is device memory, so
 * the kernels (fa_decode.cu, fa_decode_wg.cu) apply FA_RULE_KV_FITS themselves. A kernel that appends writes no cache row when
 * any sequence fails it; the launch the host names (dp->check_report) reports the first failing
 * sequence into pinned host memory, which the host waits for (src/cuda/fa_cuda_decode.c) instead
 * of copying cache_seqlens behind the stream's work.
 *
 * The report: two 64-bit words, each the call's ticket in its high half, word 0 the first
 * failing sequence (b: none) and word 1 its cache_seqlens entry. Each word is one store, so the
 * host takes both once both carry its ticket.
 */
#ifndef FA_DECODE_CHECK_CUH
#define FA_DECODE_CHECK_CUH

/* By a whole warp: whether a sequence fails the rule (the same answer in every lane); lane 0
 * writes the report where report is not NULL. */
FA_DEV int fa_kv_check(const fa_dkparams *dp, fa_u64 *report, int lane)
{
    const int b = dp->f.b;
    int first = b, first_len = 0;
    for (int i0 = 0; i0 < b; i0 += 32) {
        const int i = i0 + lane;
        const int len = i < b ? dp->cache_seqlens[i] : 0;
        const unsigned bad =
            __ballot_sync(0xffffffffu, i < b && !FA_RULE_KV_FITS(len, dp->s_new, dp->f.max_sk));
        if (bad) {
            const int l = __ffs(bad) - 1;
            first = i0 + l;
            first_len = __shfl_sync(0xffffffffu, len, l);
            break;
        }
    }
    if (report && lane == 0) {
        const fa_u64 ticket = (fa_u64)(unsigned)dp->check_ticket << 32;
        volatile fa_u64 *w = report;
        w[1] = ticket | (unsigned)first_len;
        w[0] = ticket | (unsigned)first;
        __threadfence_system();
    }
    return first < b;
}

/* A decode CTA's part of the check (every thread; warp, lane its own): the launch's first CTA
 * reports, and a CTA that appends learns whether it must not (1: some sequence fails). */
FA_DEV int fa_decode_check_cta(const fa_dkparams *dp, int warp, int lane)
{
    int refused = 0;
    if (dp->check_ticket) {
        const int reports = dp->check_report && blockIdx.x == 0 && blockIdx.y == 0 &&
                            blockIdx.z == 0;
        const int appends = dp->append_fused && dp->s_new > 0;
        if (reports || appends) {
            const int bad = warp == 0 && fa_kv_check(dp, reports ? dp->check_report : 0, lane);
            if (appends)
                refused = __syncthreads_or(bad);
        }
    }
    return refused;
}

#endif /* FA_DECODE_CHECK_CUH */
