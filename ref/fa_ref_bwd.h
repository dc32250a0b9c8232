/*
 * fa_ref_bwd: the double-precision oracle for fa_attention_backward.
 *
 * Analytic gradients written as plain loops from the semantics in include/flashattn.h, sharing
 * nothing with src/. The forward is recomputed here in double (scores, lse, out), so the
 * gradients depend only on q, k, v, dout and the options, never on the library's out or lse.
 *
 * Layouts (contiguous doubles, as fa_ref_forward's out):
 *   dq [tokens_q, h, d]    tokens_q = b * sq (dense, token = batch * sq + row) or q->shape[0]
 *   dk [tokens_k, hk, d]   tokens_k = b * sk (dense, token = batch * sk + key) or k->shape[0]
 *   dv [tokens_k, hk, dv]
 *   dsinks [h]             only read/written when fwd->sinks is given (may be NULL otherwise)
 * Every element is written: rows outside every varlen sequence, keys past seqused_k and keys
 * or rows nobody sees get 0. args->fwd->q/k/v/sinks and args->dout are read (any dtype and
 * strides, dense or varlen); out, lse, dq, dk, dv and dsinks of args are not. Returns 0, or -1
 * on an argument it cannot interpret or out of memory.
 */
#ifndef FA_REF_BWD_H
#define FA_REF_BWD_H

#include "flashattn.h"

#ifdef __cplusplus
extern "C" {
#endif

int fa_ref_backward(const fa_bwd_args *args, double *dq, double *dk, double *dv,
                    double *dsinks);

/*
 * fa_ref_backward, plus the magnitude of every gradient element (same layouts): the sum of the
 * absolute values of the terms it is made of, each |dS_j| counted as P_j (|dP_j| + |D|) with |dP_j|
 * and |D| themselves sums of |terms| (times 1 + t_j^2 with softcap, the |terms| of the tanh
 * derivative 1 - t_j^2). Rounding errors of any evaluation order are proportional
 * to it, so it is the scale that tolerances for gradients that cancel (e.g. dq of a row that
 * sees a single key, which is 0) are relative to.
 */
int fa_ref_backward_mag(const fa_bwd_args *args, double *dq, double *dk, double *dv,
                        double *dsinks, double *mq, double *mk, double *mv, double *msinks);

/*
 * fa_ref_backward, except that D = dout . out uses the out the arguments carry (what the forward
 * stored, rounding and all), as the fused backward takes D from it. Its difference to
 * fa_ref_backward is the share of a low-precision result's error that the stored out causes
 * (the naive baseline below has no such share: it takes D from its own P and dP).
 */
int fa_ref_backward_stored_out(const fa_bwd_args *args, double *dq, double *dk, double *dv,
                               double *dsinks);

/*
 * The same-dtype naive baseline of upstream's tests for F16/BF16 inputs: the gradients that
 * autograd would produce through naive attention computed in the inputs' dtype. Every tensor a
 * PyTorch op would produce is rounded to the dtype (reductions accumulate exactly, like a wide
 * accumulator): forward as fa_ref_forward_lowp (q * scale, scores, softcap steps, bias,
 * probabilities P, v / (1 - p)); backward dP = dout . (v / (1 - p)), dS = P * (dP - rowsum(P dP)),
 * the softcap steps' gradients, dq before and after the scale, dk and dv per query head and
 * again after the sum over a GQA group, dv before and after the 1 / (1 - p) factor, dsinks.
 * For F32/F64 inputs it rounds to that dtype (F64: equal to fa_ref_backward up to rounding).
 */
int fa_ref_backward_lowp(const fa_bwd_args *args, double *dq, double *dk, double *dv,
                         double *dsinks);

#ifdef __cplusplus
}
#endif

#endif /* FA_REF_BWD_H */
