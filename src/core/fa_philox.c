/* The public form of the dropout mask, for callers and tests that need to reproduce it. */
#include "flashattn.h"
#include "util/fa_export.h"
#include "core/fa_philox.h"

FA_API int fa_dropout_keep(uint64_t seed, uint64_t offset, int64_t num_heads, int64_t batch,
                           int64_t head, int64_t row, int64_t col, double dropout_p)
{
    uint64_t stream = offset + (uint64_t)batch * (uint64_t)num_heads + (uint64_t)head;
    fa_philox4 block = fa_dropout_block(seed, stream, row, col);
    return fa_dropout_number(&block, col) < fa_dropout_threshold(dropout_p);
}
