/*
 * fa_ref: the double-precision oracle for flashattn.
 *
 * Plain loops written from the semantics in include/flashattn.h (not from the library's code), so
 * that it is an independent check. Not part of the library: the tests and the command-line tool's
 * self-check link it.
 *
 * All forward functions read the inputs through args (q/k/v of any fa_dtype F32/F16/BF16/F64, or
 * fp8 with the descales: loads then give the decoded value times its descale; any strides, dense
 * or varlen form), assume args already passed the library's validation, return 0 on
 * success and -1 on an argument they cannot interpret.
 * Rows are query tokens: tokens_q = b*sq (dense, token = batch*sq + row) or q->shape[0] (varlen).
 */
#ifndef FA_REF_H
#define FA_REF_H

#include <stdint.h>

#include "flashattn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out: double [tokens_q, h, dv] contiguous; lse: double [tokens_q, h] (may be NULL).
   Only tokens with token % row_step == 0 are computed (row_step >= 1); other rows are untouched.
   Tokens outside every varlen sequence get out 0, lse +inf. */
int fa_ref_forward(const fa_fwd_args *args, int64_t row_step, double *out, double *lse);

/* Naive attention in the inputs' own low precision, as upstream's tests compute their baseline
   (same-dtype naive attention): q*scale, scores, softcap steps, bias, softmax probabilities,
   v/(1-p) and the output are each rounded to the dtype (dot products accumulate exactly, like a
   wide accumulator). out: double [tokens_q, h, dv]. For F64 inputs it equals fa_ref_forward.
   fp8 inputs: as upstream's fp8 baseline, the dequantised q, k, v are rounded to out's dtype,
   every stage is rounded to it, and the normalised probabilities are rounded to e4m3. */
int fa_ref_forward_lowp(const fa_fwd_args *args, double *out);

/* fp8 inputs only: fa_ref_forward with the probabilities rounded as the header's FP8 paragraph
   says (2^8 exp(s - m) to e4m3, m = max(scores, sink), the sum unrounded), all else exact. */
int fa_ref_forward_fp8(const fa_fwd_args *args, double *out, double *lse);

/* The probs (S_dmask) encoding described in the header, double [b, h, max_sq, max_sk]
   (max_sq/max_sk = sq/sk dense, max_seqlen_q/k varlen), padding 0. The block width is
   fa_ref_probs_block_n(d, dropout_p > 0, causal). */
int fa_ref_probs(const fa_fwd_args *args, double *probs);

/* Element access helpers the tests and the CLI can share. */
double fa_ref_load(const fa_tensor *t, const int64_t *idx);               /* idx: t->ndim entries */
void fa_ref_store(const fa_tensor *t, const int64_t *idx, double value); /* rounds to t->dtype */
/* round-to-nearest-even to fp16/bf16/fp32/fp8 (e4m3 saturates to +-448, as torch) */
double fa_ref_round(double x, fa_dtype dtype);
double fa_ref_fp8_value(uint8_t code, fa_dtype dtype); /* an fp8 code's value */

/* Extras (used by the tests). */

/* Philox4x32 of `rounds` rounds (Random123's philox4x32_R): one block of four 32-bit words from
   counter ctr and key. */
void fa_ref_philox4x32(const uint32_t ctr[4], const uint32_t key[2], int rounds, uint32_t out[4]);

/* The dropout keep bit as the header defines it (an independent implementation of
   fa_dropout_keep): 1 kept, 0 dropped. */
int fa_ref_dropout_keep(uint64_t seed, uint64_t offset, int64_t num_heads, int64_t batch,
                        int64_t head, int64_t row, int64_t col, double dropout_p);

/* Upstream's kBlockN for sm80 (flash_attn_interface._get_block_size_n on an A100). */
int fa_ref_probs_block_n(int head_dim, int dropout, int causal);

#ifdef __cplusplus
}
#endif

#endif /* FA_REF_H */
