/* What the CPU kernels share: tile sizes, the multiversioning attribute, the helpers they use. */
#ifndef FA_CPU_KERNEL_H
#define FA_CPU_KERNEL_H

#include "core/fa_params.h"
#include "cpu/fa_cpu_f16.h"
#include "cpu/fa_cpu_gemm.h"
#include "cpu/fa_cpu_math.h"
#include "plan/fa_plan_cpu.h"
#include "util/fa_half.h"
#include "util/fa_memory.h"
#include "core/fa_philox.h"

#define FA_CPU_BM 64 /* query rows per tile (backward) */
/* Most columns of a forward tile's query-column buffers (Q^T, S^T, P^T, O^T): see
 * fa_cpu_tile_ld. */
#define FA_CPU_FWD_LD_MAX (FA_CPU_FWD_BM_MAX + 16)
#define FA_CPU_LANES 16 /* chunk of a score row that the softmax loops vectorise over */

/* Helpers of the kernels: always inlined, so that each clone below gets its own vectorised copy
 * (an out-of-line helper would be compiled for the baseline ISA, without FMA, and change the
 * results bitwise). */
#if defined(__GNUC__)
#define FA_CPU_INLINE static inline __attribute__((always_inline))
#else
#define FA_CPU_INLINE static inline
#endif

/* Compile the kernels for AVX-512 and AVX2+FMA machines too, picked at load time; not under
 * ThreadSanitizer, whose runtime is not ready when the clones' resolvers run. */
#if defined(__SANITIZE_THREAD__) && !defined(FA_CPU_NO_CLONES)
#define FA_CPU_NO_CLONES
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#if defined(FA_CPU_NO_CLONES)
#define FA_CPU_CLONES
#else
#define FA_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
/* Code that only runs where AVX-512 exists (the bf16 paths). */
#define FA_CPU_AVX512 __attribute__((target("arch=x86-64-v4")))
#else
#define FA_CPU_CLONES
#endif

/* Whether rows ld elements of esize bytes apart fall a multiple of 4 KB apart: then every row's
 * element c maps to the same L1 set, and an operand panel of such rows read in place evicts
 * itself (h * d * 4 bytes = 4 KB from h 8 at d 128). The kernels copy K blocks (fp32: V too)
 * into their buffers there. */
static inline int fa_cpu_rows_alias(int64_t ld, size_t esize)
{
    /* Unsigned: the stride of a dimension of size 1 may be anything, and wrapping modulo 2^64
     * keeps the product's residue modulo 4096. */
    return ((uint64_t)ld * (uint64_t)esize) % 4096 == 0;
}

/* Leading dimension of a forward tile's buffers of mp query columns. The products reuse them in
 * panels of 32-64 columns down 64-128 rows; with mp 256 (1 KB rows) a panel's rows fall in 16
 * of the L1's 64 sets (48 KB, 12 ways) and it cannot stay cached. 16 more columns spread the rows
 * over every set. */
static inline int64_t fa_cpu_tile_ld(int64_t mp)
{
    return mp > 64 ? mp + 16 : mp;
}

static inline int64_t fa_cpu_round_up(int64_t x, int64_t to)
{
    return (x + to - 1) / to * to;
}

/* Lays n scratch regions of sizes[i] bytes one after another from base, each rounded up to 64
 * bytes so that every region stays 64-byte aligned; at[i] gets each one's start (at may be NULL
 * to size only). Returns the bytes of all of them. */
static inline size_t fa_cpu_scratch_layout(const size_t *sizes, int n, char *base, char **at)
{
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        if (at)
            at[i] = base + total;
        total += (sizes[i] + 63) & ~(size_t)63;
    }
    return total;
}

/* Hints huge pages under an array laid out as q's or k's rows, [b, rows, heads, cols] dense or
 * [total, heads, cols] varlen (rows: p->max_sq or p->max_sk, total: p->total_q or p->total_k),
 * in p's dtype, before the kernels write it (util/fa_memory.h says why). */
static inline void fa_cpu_hint_rows(const void *data, const fa_params *p, int64_t rows,
                                    int64_t total, int64_t heads, int64_t cols, int64_t bstride,
                                    int64_t rstride, int64_t hstride)
{
    const size_t esize = fa_dtype_size(p->dtype);
    if (p->is_varlen) {
        const int64_t sizes[3] = {total, heads, cols}, strides[3] = {rstride, hstride, 1};
        fa_memory_hint_array(data, 3, sizes, strides, esize);
    } else {
        const int64_t sizes[4] = {p->b, rows, heads, cols};
        const int64_t strides[4] = {bstride, rstride, hstride, 1};
        fa_memory_hint_array(data, 4, sizes, strides, esize);
    }
}

#endif /* FA_CPU_KERNEL_H */
