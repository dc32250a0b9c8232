/*
 * One micro-kernel family, instantiated by fa_cpu_gemm.c per instruction set with:
 *   FA_GEMM_FN(name)  adds the family's suffix
 *   FA_GEMM_TARGET    function attribute selecting the instruction set
 *   FA_GEMM_VL        floats per vector
 *   FA_GEMM_MR        rows of C held in registers
 *   FA_GEMM_NRV       vectors of C per row held in registers
 *   FA_GEMM_COLS_OUTER 1: column panels of C outermost, 0: row blocks outermost
 *   FA_GEMM_TILE4     (optional, column order) a 4-row tile of the same width for leftover rows
 * MR x NRV accumulators stay in registers across the whole K loop: per k, NRV loads of B and MR
 * broadcasts of A feed MR * NRV fused multiply-adds (FA_CPU_UNROLL on every loop over them).
 */

#ifndef FA_GEMM_EDGE_MAX
#define FA_GEMM_EDGE_MAX 6 /* largest MR of any family; fa_gemm_edge's switch covers 1..6 */
#endif

typedef float FA_GEMM_FN(fa_vec) __attribute__((vector_size(FA_GEMM_VL * 4)));

/* A full MR x (NRV vectors) block of C. */
FA_GEMM_TARGET static inline void FA_GEMM_FN(fa_gemm_tile)(float *c, int64_t ldc, const float *a,
                                                            int64_t a_rs, int64_t a_cs,
                                                            const float *b, int64_t ldb, int64_t k,
                                                            int accumulate)
{
    FA_GEMM_FN(fa_vec) acc[FA_GEMM_MR][FA_GEMM_NRV];
    FA_CPU_UNROLL for (int r = 0; r < FA_GEMM_MR; r++)
        FA_CPU_UNROLL for (int v = 0; v < FA_GEMM_NRV; v++)
            if (accumulate)
                FA_VLOAD(acc[r][v], c + r * ldc + v * FA_GEMM_VL);
            else
                acc[r][v] = (FA_GEMM_FN(fa_vec)){0};
    for (int64_t x = 0; x < k; x++) {
        FA_GEMM_FN(fa_vec) bv[FA_GEMM_NRV];
        FA_CPU_UNROLL for (int v = 0; v < FA_GEMM_NRV; v++)
            FA_VLOAD(bv[v], b + x * ldb + v * FA_GEMM_VL);
        FA_CPU_UNROLL for (int r = 0; r < FA_GEMM_MR; r++) {
            const float ar = a[r * a_rs + x * a_cs];
            FA_CPU_UNROLL for (int v = 0; v < FA_GEMM_NRV; v++)
                acc[r][v] += ar * bv[v];
        }
    }
    FA_CPU_UNROLL for (int r = 0; r < FA_GEMM_MR; r++)
        FA_CPU_UNROLL for (int v = 0; v < FA_GEMM_NRV; v++)
            FA_VSTORE(c + r * ldc + v * FA_GEMM_VL, acc[r][v]);
}

/* Edges: mr rows and one vector of columns. Inlined with mr a constant (fa_gemm_edge's switch),
 * so that the loops unroll and the accumulators stay in registers: with mr known only at run
 * time every multiply-add loaded and stored its accumulator. */
FA_GEMM_TARGET static inline __attribute__((always_inline)) void
FA_GEMM_FN(fa_gemm_edge_rows)(float *c, int64_t ldc, const float *a, int64_t a_rs, int64_t a_cs,
                              const float *b, int64_t ldb, int mr, int64_t k, int accumulate)
{
    FA_GEMM_FN(fa_vec) acc[FA_GEMM_EDGE_MAX];
    FA_CPU_UNROLL for (int r = 0; r < mr; r++)
        if (accumulate)
            FA_VLOAD(acc[r], c + r * ldc);
        else
            acc[r] = (FA_GEMM_FN(fa_vec)){0};
    for (int64_t x = 0; x < k; x++) {
        FA_GEMM_FN(fa_vec) bv;
        FA_VLOAD(bv, b + x * ldb);
        FA_CPU_UNROLL for (int r = 0; r < mr; r++)
            acc[r] += a[r * a_rs + x * a_cs] * bv;
    }
    FA_CPU_UNROLL for (int r = 0; r < mr; r++)
        FA_VSTORE(c + r * ldc, acc[r]);
}

/* mr <= MR rows (more are cut to MR) and one vector of columns. */
FA_GEMM_TARGET static inline void FA_GEMM_FN(fa_gemm_edge)(float *c, int64_t ldc, const float *a,
                                                            int64_t a_rs, int64_t a_cs,
                                                            const float *b, int64_t ldb,
                                                            int64_t mr, int64_t k, int accumulate)
{
#define FA_GEMM_EDGE_CASE(n)                                                                    \
    case n:                                                                                     \
        FA_GEMM_FN(fa_gemm_edge_rows)(c, ldc, a, a_rs, a_cs, b, ldb, n, k, accumulate);         \
        break
    switch (mr < FA_GEMM_MR ? mr : FA_GEMM_MR) {
        FA_GEMM_EDGE_CASE(1);
        FA_GEMM_EDGE_CASE(2);
        FA_GEMM_EDGE_CASE(3);
        FA_GEMM_EDGE_CASE(4);
        FA_GEMM_EDGE_CASE(5);
        FA_GEMM_EDGE_CASE(6);
    default:
        break;
    }
#undef FA_GEMM_EDGE_CASE
}

FA_GEMM_TARGET static void FA_GEMM_FN(fa_gemm)(float *c, int64_t ldc, const float *a,
                                               int64_t a_rs, int64_t a_cs, const float *b,
                                               int64_t ldb, int64_t m, int64_t n, int64_t k,
                                               int accumulate)
{
    const int64_t nr = FA_GEMM_VL * FA_GEMM_NRV;
    int64_t i = 0;
#if FA_GEMM_COLS_OUTER
    /* Column panels outermost: one k x nr panel of B stays in L1 while every row block of A
     * passes over it, instead of B streaming from L2 once per row block. */
    const int64_t m_full = m / FA_GEMM_MR * FA_GEMM_MR;
#ifdef FA_GEMM_TILE4
    /* Four leftover rows (64 keys in 6-row tiles) take a full-width 4-row tile rather than the
     * much slower one-vector edge kernel. */
    const int64_t m_tiled = m - m_full >= 4 ? m_full + 4 : m_full;
#else
    const int64_t m_tiled = m_full;
#endif
    int64_t j = 0;
    for (; j + nr <= n; j += nr) {
        for (i = 0; i < m_full; i += FA_GEMM_MR)
            FA_GEMM_FN(fa_gemm_tile)(c + i * ldc + j, ldc, a + i * a_rs, a_rs, a_cs, b + j, ldb,
                                     k, accumulate);
#ifdef FA_GEMM_TILE4
        if (m_tiled > m_full)
            FA_GEMM_TILE4(c + m_full * ldc + j, ldc, a + m_full * a_rs, a_rs, a_cs, b + j, ldb, k,
                          accumulate);
#endif
    }
    for (; j < n; j += FA_GEMM_VL)
        for (i = 0; i < m_tiled; i += FA_GEMM_MR)
            FA_GEMM_FN(fa_gemm_edge)(c + i * ldc + j, ldc, a + i * a_rs, a_rs, a_cs, b + j, ldb,
                                     m_tiled - i, k, accumulate);
    i = m_tiled;
#else
    for (; i + FA_GEMM_MR <= m; i += FA_GEMM_MR) {
        int64_t j = 0;
        for (; j + nr <= n; j += nr)
            FA_GEMM_FN(fa_gemm_tile)(c + i * ldc + j, ldc, a + i * a_rs, a_rs, a_cs, b + j, ldb,
                                     k, accumulate);
        for (; j < n; j += FA_GEMM_VL)
            FA_GEMM_FN(fa_gemm_edge)(c + i * ldc + j, ldc, a + i * a_rs, a_rs, a_cs, b + j, ldb,
                                     FA_GEMM_MR, k, accumulate);
    }
#endif
    if (i < m)
        for (int64_t jj = 0; jj < n; jj += FA_GEMM_VL)
            FA_GEMM_FN(fa_gemm_edge)(c + i * ldc + jj, ldc, a + i * a_rs, a_rs, a_cs, b + jj,
                                     ldb, m - i, k, accumulate);
}
