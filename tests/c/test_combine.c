/*
 * test_combine: fa_attention_combine against the merge written out here in double precision:
 *   lse = log(sum_s exp(l_s)) over the non-empty parts (l_s neither -inf nor +inf),
 *   out = sum_s exp(l_s - lse) * o_s;  a row with only empty parts gets out 0, lse -inf (FA3).
 * Random partials with random empty parts (whose o_s is NaN, which must never be read), rows
 * with every part empty, 1 to FA_MAX_SPLITS parts, every out dtype, strided views, fp64 parts.
 * Every element of out and lse must be written, nothing around them, and the result must not
 * depend on the thread count.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_ref.h"
#include "flashattn.h"
#include "test_util.h"

static double ulp_rel(fa_dtype dt)
{
    switch (dt) {
    case FA_DTYPE_F16:
        return ldexp(1.0, -11);
    case FA_DTYPE_BF16:
        return ldexp(1.0, -8);
    case FA_DTYPE_F32:
        return ldexp(1.0, -24);
    default:
        return ldexp(1.0, -50);
    }
}

static int64_t g_cases = 0;

static void run_case(tu_rng *r, int64_t splits, int64_t b, int64_t sq, int64_t h, int64_t dv,
                     fa_dtype part_dt, fa_dtype out_dt, int with_lse, double p_empty)
{
    char where[256];
    snprintf(where, sizeof where,
             "splits=%lld b=%lld sq=%lld h=%lld dv=%lld parts=%s out=%s lse=%d empty=%.2f",
             (long long)splits, (long long)b, (long long)sq, (long long)h, (long long)dv,
             fa_dtype_name(part_dt), fa_dtype_name(out_dt), with_lse, p_empty);
    tu_where = where;
    int64_t ps[5] = {splits, b, sq, h, dv}, ls[4] = {splits, b, sq, h};
    int64_t os[4] = {b, sq, h, dv}, l3[3] = {b, sq, h};
    tu_tensor op = tu_tensor_new(part_dt, 5, ps, (int)tu_rng_int(r, 0, TU_NUM_LAYOUTS - 1), r);
    tu_tensor lp = tu_tensor_new(part_dt, 4, ls, (int)tu_rng_int(r, 0, TU_NUM_LAYOUTS - 1), r);
    tu_tensor out = tu_tensor_new(out_dt, 4, os, (int)tu_rng_int(r, 0, TU_NUM_LAYOUTS - 1), r);
    fa_dtype lse_dt =
        part_dt == FA_DTYPE_F64 && tu_rng_chance(r, 0.5) ? FA_DTYPE_F64 : FA_DTYPE_F32;
    tu_tensor lse = tu_tensor_new(lse_dt, 3, l3, (int)tu_rng_int(r, 0, TU_NUM_LAYOUTS - 1), r);
    tu_fill_uniform(&op, r, -3.0, 3.0);
    tu_fill_uniform(&lp, r, -20.0, 20.0);
    /* Empty parts: lse -inf or +inf and a NaN output; some rows entirely empty. */
    int64_t idx[4] = {0, 0, 0, 0};
    int64_t rows = b * sq * h;
    unsigned char *all_empty = calloc((size_t)rows, 1);
    for (int64_t x = 0; x < rows; x++)
        all_empty[x] = tu_rng_chance(r, 0.1);
    if (rows > 0) {
        do {
            int64_t row = (idx[1] * sq + idx[2]) * h + idx[3];
            if (all_empty[row] || tu_rng_chance(r, p_empty)) {
                fa_ref_store(&lp.t, idx, tu_rng_chance(r, 0.5) ? -INFINITY : INFINITY);
                for (int64_t e = 0; e < dv; e++) {
                    int64_t oi[5] = {idx[0], idx[1], idx[2], idx[3], e};
                    fa_ref_store(&op.t, oi, NAN);
                }
            }
        } while (tu_next_index(&lp.t, idx));
    }

    fa_combine_args a;
    fa_combine_args_init(&a);
    a.out_partial = &op.t;
    a.lse_partial = &lp.t;
    a.out = &out.t;
    a.lse = with_lse ? &lse.t : NULL;
    void *first = NULL;
    for (int run = 0; run < 2; run++) {
        tu_poison(&out);
        tu_poison(&lse);
        a.num_threads = run == 0 ? 1 : (int)tu_rng_int(r, 2, 4);
        fa_status st = fa_attention_combine(&a);
        TU_CHECK(st == FA_STATUS_OK, "status %d: %s", (int)st, fa_last_error());
        TU_CHECK(tu_count_poisoned_in_view(&out) == 0, "out not fully written");
        TU_CHECK(tu_count_clobbered(&out) == 0, "bytes around out written");
        if (with_lse) {
            TU_CHECK(tu_count_poisoned_in_view(&lse) == 0, "lse not fully written");
            TU_CHECK(tu_count_clobbered(&lse) == 0, "bytes around lse written");
        } else {
            TU_CHECK(tu_count_poisoned_in_view(&lse) == tu_numel(&lse.t), "lse written");
        }
        if (run == 0)
            first = malloc(out.nbytes);
        if (run == 0)
            memcpy(first, out.base, out.nbytes);
        else
            TU_CHECK(memcmp(first, out.base, out.nbytes) == 0, "result depends on threads");
    }
    free(first);

    double *w = malloc(sizeof(double) * (size_t)splits);
    for (int64_t bi = 0; bi < b; bi++)
        for (int64_t rr = 0; rr < sq; rr++)
            for (int64_t hh = 0; hh < h; hh++) {
                double mx = -INFINITY;
                for (int64_t s = 0; s < splits; s++) {
                    int64_t li[4] = {s, bi, rr, hh};
                    double x = fa_ref_load(&lp.t, li);
                    w[s] = isinf(x) ? -INFINITY : x;
                    mx = fmax(mx, w[s]);
                }
                double sum = 0.0;
                for (int64_t s = 0; s < splits; s++)
                    sum += isinf(w[s]) ? 0.0 : exp(w[s] - mx);
                double ref_lse = mx == -INFINITY ? -INFINITY : mx + log(sum);
                for (int64_t e = 0; e < dv; e++) {
                    double acc = 0.0;
                    for (int64_t s = 0; s < splits; s++) {
                        if (isinf(w[s]))
                            continue;
                        int64_t oi[5] = {s, bi, rr, hh, e};
                        acc += exp(w[s] - ref_lse) * fa_ref_load(&op.t, oi);
                    }
                    int64_t ti[4] = {bi, rr, hh, e};
                    double got = fa_ref_load(&out.t, ti);
                    /* half an ulp of rounding; fp16's subnormals round at 2^-24 absolute */
                    double tol = 4.0 * ulp_rel(out_dt) * fabs(acc) + 1e-7;
                    if (part_dt == FA_DTYPE_F32 && out_dt == FA_DTYPE_F64)
                        tol = 1e-12 * fmax(fabs(acc), 1.0);
                    TU_CHECK(fabs(got - acc) <= tol,
                             "out[%lld, %lld, %lld, %lld] = %.9g, want %.9g",
                             (long long)bi, (long long)rr, (long long)hh, (long long)e, got, acc);
                }
                if (with_lse) {
                    int64_t li[3] = {bi, rr, hh};
                    double got = fa_ref_load(&lse.t, li);
                    double lse_tol = 1e-6 * fmax(1.0, fabs(ref_lse));
                    int ok = isinf(ref_lse) ? got == ref_lse : fabs(got - ref_lse) <= lse_tol;
                    TU_CHECK(ok, "lse[%lld, %lld, %lld] = %.9g, want %.9g", (long long)bi,
                             (long long)rr, (long long)hh, got, ref_lse);
                }
            }
    free(w);
    free(all_empty);
    tu_tensor_free(&op);
    tu_tensor_free(&lp);
    tu_tensor_free(&out);
    tu_tensor_free(&lse);
    g_cases++;
}

/* Dispatch: a CUDA ordinal on a machine without that device: FA_STATUS_UNSUPPORTED naming the
 * device, out untouched; the same arguments on the CPU with num_threads = 0 (the
 * CPU backend's default count) succeed. */
static void dispatch_case(tu_rng *r)
{
    tu_where = "dispatch";
    int64_t ps[5] = {3, 2, 4, 2, 8}, ls[4] = {3, 2, 4, 2}, os[4] = {2, 4, 2, 8};
    tu_tensor op = tu_tensor_new(FA_DTYPE_F32, 5, ps, 0, r);
    tu_tensor lp = tu_tensor_new(FA_DTYPE_F32, 4, ls, 0, r);
    tu_tensor out = tu_tensor_new(FA_DTYPE_F32, 4, os, 0, r);
    tu_fill_uniform(&op, r, -3.0, 3.0);
    tu_fill_uniform(&lp, r, -20.0, 20.0);
    fa_combine_args a;
    fa_combine_args_init(&a);
    a.out_partial = &op.t;
    a.lse_partial = &lp.t;
    a.out = &out.t;
    a.device = 4096 + (int)tu_rng_int(r, 0, 3); /* no such device anywhere */
    tu_poison(&out);
    fa_status st = fa_attention_combine(&a);
    const char *msg = fa_last_error();
    TU_CHECK(st == FA_STATUS_UNSUPPORTED, "device %d: status %d (%s), expected UNSUPPORTED",
             a.device, (int)st, fa_status_string(st));
    TU_CHECK(tu_names(msg, "device"), "message does not name the device: %s", msg);
    TU_CHECK(tu_count_poisoned_in_view(&out) == tu_numel(&out.t), "out was written");
    a.device = FA_DEVICE_CPU;
    a.num_threads = 0;
    st = fa_attention_combine(&a);
    TU_CHECK(st == FA_STATUS_OK, "num_threads 0: status %d: %s", (int)st, fa_last_error());
    TU_CHECK(tu_count_poisoned_in_view(&out) == 0, "num_threads 0: out not fully written");
    tu_tensor_free(&op);
    tu_tensor_free(&lp);
    tu_tensor_free(&out);
    g_cases++;
}

int main(void)
{
    tu_rng rng = {tu_master_seed("test_combine")};
    const fa_dtype outs[4] = {FA_DTYPE_F32, FA_DTYPE_F16, FA_DTYPE_BF16, FA_DTYPE_F64};
    const int64_t splits[6] = {1, 2, 3, 7, 64, FA_MAX_SPLITS};
    for (int oi = 0; oi < 4; oi++)
        for (int si = 0; si < 6; si++)
            run_case(&rng, splits[si], 2, 3, 2, 5 + si, FA_DTYPE_F32, outs[oi], 1, 0.2);
    run_case(&rng, 4, 1, 1, 1, 256, FA_DTYPE_F32, FA_DTYPE_F32, 1, 0.0);
    run_case(&rng, 5, 3, 2, 4, 1, FA_DTYPE_F32, FA_DTYPE_BF16, 0, 0.5);
    run_case(&rng, 6, 2, 5, 3, 33, FA_DTYPE_F64, FA_DTYPE_F64, 1, 0.3);
    run_case(&rng, 3, 1, 70, 2, 16, FA_DTYPE_F64, FA_DTYPE_F32, 1, 0.3);
    run_case(&rng, 2, 2, 4, 3, 8, FA_DTYPE_F32, FA_DTYPE_F32, 1, 1.0);
    for (int k = 0; k < 30; k++)
        run_case(&rng, tu_rng_int(&rng, 1, 20), tu_rng_int(&rng, 1, 3), tu_rng_int(&rng, 0, 9),
                 tu_rng_int(&rng, 1, 5), tu_rng_int(&rng, 1, 130),
                 tu_rng_chance(&rng, 0.2) ? FA_DTYPE_F64 : FA_DTYPE_F32,
                 outs[tu_rng_int(&rng, 0, 3)], tu_rng_chance(&rng, 0.7),
                 tu_rng_uniform(&rng, 0.0, 0.6));
    dispatch_case(&rng);
    printf("test_combine: %lld cases\n", (long long)g_cases);
    return tu_finish("test_combine");
}
