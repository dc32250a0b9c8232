/*
 * bf16 products for the CPU forward, on AMX tiles (tdpbf16ps) or AVX512-BF16 (vdpbf16ps):
 *   C[m][n] (+)= A[m][k] * B[k][n]
 * with C fp32 row-major (leading dimension ldc floats), A bf16 row-major (lda elements, read in
 * place, so it may be a K or V^T tensor view), and B in the VNNI pair layout both instruction
 * sets read: b[x][j] (uint32, ldb per row) holds B[2x][j] in its low half and B[2x+1][j] in its
 * high half. Products are exact in fp32 and summed in fp32.
 *
 * One contract for every kernel, so that the forward builds the same operands whichever one runs
 * (and this machine's tests cover what an AMX machine executes): m and n multiples of 16 (a
 * tile's rows and columns), k a multiple of 32 (a tile's depth), every A row readable for k
 * elements and every C row writable for n.
 */
#ifndef FA_CPU_BF16_H
#define FA_CPU_BF16_H

#include <stdint.h>

#define FA_CPU_BF16_MALIGN 16
#define FA_CPU_BF16_KALIGN 32

typedef void (*fa_cpu_bf16_gemm_fn)(float *c, int64_t ldc, const uint16_t *a, int64_t lda,
                                    const uint32_t *b, int64_t ldb, int64_t m, int64_t n,
                                    int64_t k, int accumulate);

typedef struct fa_cpu_bf16_kernel {
    void (*begin)(void); /* before a thread's first product of a work item (AMX: tile config) */
    fa_cpu_bf16_gemm_fn gemm;
    void (*end)(void); /* after its last one, before any other code may use the tiles */
    const char *name;  /* "amx", "avx512bf16" */
} fa_cpu_bf16_kernel;

/*
 * The kernel for this process, or NULL when the CPU has neither AMX-BF16 (with the OS's
 * permission to use tile data) nor AVX512-BF16; bf16 inputs then take the fp32 path. Chosen once:
 * FLASHATTN_CPU_AMX=0 skips AMX and FLASHATTN_CPU_BF16=0 turns the whole bf16 path off, to
 * compare the paths and to test the fallbacks on AMX machines.
 */
const fa_cpu_bf16_kernel *fa_cpu_bf16_kernel_get(void);

/* Every kernel this CPU can run, whatever the environment says (for the tests and benchmarks);
 * returns how many, AVX512-BF16 first. */
int fa_cpu_bf16_kernels(const fa_cpu_bf16_kernel *usable[2]);

/* Makes fa_cpu_bf16_kernel_get return kernel (NULL: the fp32 path) from now on. For the tests,
 * which run the forward on a software model of AMX; not thread-safe against running forwards. */
void fa_cpu_bf16_kernel_override(const fa_cpu_bf16_kernel *kernel);

#if defined(__x86_64__) && defined(__GNUC__)
#define FA_CPU_HAS_BF16 1 /* the kernels exist in this build (x86-64, GCC or Clang) */

/*
 * Operand packing, AVX-512 (only called when fa_cpu_bf16_kernel_get() is not NULL).
 *
 * V^T of a key block: vt[c][j] (ldvt elements per row, a multiple of 2) = v[j][c] (rows of the
 * bf16 tensor, ldv elements apart) for c < dv, j < n; zero for n <= j < kp and dv <= c < dvp.
 * kp is a multiple of 32 and dvp of 16.
 */
void fa_cpu_bf16_pack_vt(uint16_t *vt, int64_t ldvt, const uint16_t *v, int64_t ldv, int64_t n,
                         int64_t kp, int64_t dv, int64_t dvp);

/*
 * Q^T of a query tile in VNNI pairs: qv[x][i] (ldqv per row) = q[i][2x] | q[i][2x+1] << 16 for
 * i < m (rows of the bf16 tensor, ldq elements apart), zero for elements past d, for rows
 * m <= i < mp and for pairs up to dk/2. mp is a multiple of 16 and dk of 32.
 */
void fa_cpu_bf16_pack_q(uint32_t *qv, int64_t ldqv, const uint16_t *q, int64_t ldq, int64_t m,
                        int64_t mp, int64_t d, int64_t dk);

/*
 * P^T to VNNI pairs: pv[x][i] (ldpv per row) = bf16(st[2x][i]) | bf16(st[2x+1][i]) << 16 for
 * rows below n, zero halves from row n on, for x < kp/2 and i < cols (a multiple of 16).
 * Rounds to nearest even.
 */
void fa_cpu_bf16_pack_p(uint32_t *pv, int64_t ldpv, const float *st, int64_t ldst, int64_t n,
                        int64_t kp, int64_t cols);

/*
 * The softmax's exponentials straight into P^T's VNNI pairs (fa_cpu_bf16_pack_p's layout), one
 * pass instead of fa_tile_softmax_exp's and pack_p's two: for rows j < n of st and columns
 * i < cols (a multiple of 16), e = exp(st[j][i] * emul - bmax[i]) in fp32 (within 1.2e-7
 * relative, 0 below e^-87.34), l[i] += e in row order, and pv gets bf16(e) rounded to nearest
 * even; zero halves from row n on, up to kp (even).
 */
void fa_cpu_bf16_exp_pack(uint32_t *pv, int64_t ldpv, const float *st, int64_t ldst, int64_t n,
                          int64_t kp, int64_t cols, float emul, const float *bmax, float *l);

/*
 * fa_cpu_bf16_exp_pack on an interior block against the running maxima m (bmax = m), which
 * also checks them: returns 1 when no column's block maximum times emul exceeds m + slack (the
 * softmax would keep m, so pv and lout = l + the row sums are what its max pass and exp_pack
 * give, bitwise), else 0 (the caller takes that path; lout and pv are then garbage).
 */
int fa_cpu_bf16_exp_pack_under(uint32_t *pv, int64_t ldpv, const float *st, int64_t ldst,
                               int64_t n, int64_t kp, int64_t cols, float emul, const float *m,
                               float slack, const float *l, float *lout);

/* The backward's operands (fa_cpu_bwd_bf16.h). */

/*
 * Pairs of bf16 rows as VNNI pairs: dst[x][c] (ldd per row) = src[2x][c] | src[2x+1][c] << 16
 * for rows below n (lds elements apart) and c < cols, zero elsewhere, for x < kp/2 and c < colsp.
 * kp is a multiple of 2 and colsp of 16. Q or dO rows become B of dK += dS^T Q or dV += P^T dO,
 * K rows B of dQ += dS K.
 */
void fa_cpu_bf16_pack_pairs(uint32_t *dst, int64_t ldd, const uint16_t *src, int64_t lds,
                            int64_t n, int64_t kp, int64_t cols, int64_t colsp);

/* fp32 rows to bf16 rows: dst[j][i] (ldd per row) = bf16(src[j][i]) for j < n and i < cols (a
 * multiple of 16), zero rows for n <= j < np. Rounds to nearest even. */
void fa_cpu_bf16_round_rows(uint16_t *dst, int64_t ldd, const float *src, int64_t lds, int64_t n,
                            int64_t np, int64_t cols);

/* An fp32 [n][cols] block transposed to bf16 rows: dst[i][j] (ldd per row) = bf16(src[j][i]) for
 * i < cols (a multiple of 16) and j < n, zero for n <= j < kp (a multiple of 32). */
void fa_cpu_bf16_round_t(uint16_t *dst, int64_t ldd, const float *src, int64_t lds, int64_t n,
                         int64_t kp, int64_t cols);
#endif

#endif /* FA_CPU_BF16_H */
