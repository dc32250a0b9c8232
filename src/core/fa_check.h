/* Tensor argument checks; each names the argument in its error. */
#ifndef FA_CHECK_H
#define FA_CHECK_H

#include <stdint.h>

#include "core/fa_error.h"

int64_t fa_tensor_numel(const fa_tensor *t);
int fa_dtype_is_float(fa_dtype dt);
fa_status fa_check_tensor(const fa_tensor *t, const char *name, int ndim); /* last dim stride 1 */
fa_status fa_check_strided(const fa_tensor *t, const char *name, int ndim);
fa_status fa_check_dtype(const fa_tensor *t, const char *name, fa_dtype want, const char *why);
fa_status fa_check_dim(const fa_tensor *t, const char *name, int dim, int64_t want,
                       const char *what);
/* alibi_slopes, fp32 [h] or [b, h]; sinks, fp32 [h]: data and strides of valid tensors. */
fa_status fa_check_alibi(const fa_tensor *t, int64_t b, int64_t h, const float **data,
                         int64_t *bstride, int64_t *hstride);
fa_status fa_check_sinks(const fa_tensor *t, int64_t h, const float **data, int64_t *stride);

/* The bytes [*first, *end) a valid (non-NULL) tensor touches; 0 when it has no element. */
int fa_tensor_bytes(const fa_tensor *t, uintptr_t *first, uintptr_t *end);
/* Whether the bytes two tensors reach share an address range (NULL or empty: 0). Both must
 * have passed fa_check_tensor/fa_check_strided. */
int fa_tensors_overlap(const fa_tensor *a, const fa_tensor *b);
/* Refuses (naming out_name) an output that shares an element's bytes with the tensor in_name
 * (exactly for views of one dtype and strides into one buffer, such as a packed gradient's
 * dq, dk, dv; else where their byte ranges overlap); either may be NULL or empty. Both must
 * have passed fa_check_tensor/fa_check_strided. */
fa_status fa_check_disjoint(const fa_tensor *out, const char *out_name, const fa_tensor *in,
                            const char *in_name);
/* Refuses (naming it) a tensor the call writes whose elements are not all at distinct
 * addresses (a zero stride, or strides that interleave). NULL or empty: OK. */
fa_status fa_check_writable(const fa_tensor *t, const char *name);
/* The block ids a paged sequence's positions [start, end) use (its block_table row, host memory;
 * page_size rows a block), each in [0, num_blocks): only those must exist, later columns may be
 * padding. The error names block_table and sequence i. */
fa_status fa_check_block_ids(const int32_t *row, int64_t i, int64_t page_size, int64_t num_blocks,
                             int64_t start, int64_t end);
/* A count that sizes work (max_seqlen_q/k) but backs no tensor: [0, FA_MAX_EXTENT]. */
fa_status fa_check_count(int64_t value, const char *name);

#endif /* FA_CHECK_H */
