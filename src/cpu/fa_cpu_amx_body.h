/*
 * The AMX kernel of fa_cpu_bf16.h's contract, written against eight tile operations so that one
 * source compiles both to the instructions (fa_cpu_bf16.c) and to a software model of them that
 * any machine can run (tests/c/test_bf16.c), which is how it is tested where there is no AMX:
 *   FA_AMX_CONFIG(cfg)     ldtilecfg of a 64-byte configuration
 *   FA_AMX_SAVE(cfg)       sttilecfg (all zero when the tiles are not configured)
 *   FA_AMX_RELEASE()       tilerelease
 *   FA_AMX_ZERO(t)         tilezero tmm t
 *   FA_AMX_LOAD(t, p, s)   tileloadd tmm t from p, s bytes between rows
 *   FA_AMX_STORE(t, p, s)  tilestored tmm t to p
 *   FA_AMX_DP(c, a, b)     tdpbf16ps: tmm c += tmm a . tmm b
 *   FA_AMX_FN(name), FA_AMX_TARGET
 * Tile numbers are literals, since the instructions encode them. Every tile is 16 rows of 64
 * bytes: tmm0-3 hold a 32x32 block of C (16x16 fp32 each), tmm4-5 two 16x32 slices of A, tmm6-7
 * two 16-pair x 16-column slices of B. Each A and B slice feeds two products, so a 32-deep step
 * loads 4 tiles for 4 tdpbf16ps (16x16x32 each).
 */

typedef struct FA_AMX_FN(fa_amx_config) {
    _Alignas(64) uint8_t palette;
    uint8_t start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} FA_AMX_FN(fa_amx_config);

/* Constant data: ldtilecfg reads it from memory that nothing ever writes. */
static const FA_AMX_FN(fa_amx_config) FA_AMX_FN(fa_amx_cfg) = {
    1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

/* One block of C: 16 or 32 rows (two_m) by 16 or 32 columns (two_n), over all of k. */
FA_AMX_TARGET static inline void FA_AMX_FN(fa_amx_block)(float *c, int64_t ldc,
                                                          const uint16_t *a, int64_t lda,
                                                          const uint32_t *b, int64_t ldb,
                                                          int64_t k, int accumulate, int two_m,
                                                          int two_n)
{
    const long sc = (long)(ldc * 4), sa = (long)(lda * 2), sb = (long)(ldb * 4);
    float *c1 = c + 16 * ldc;
    const uint16_t *a1 = a + 16 * lda;
    if (accumulate) {
        FA_AMX_LOAD(0, c, sc);
        if (two_n)
            FA_AMX_LOAD(1, c + 16, sc);
        if (two_m)
            FA_AMX_LOAD(2, c1, sc);
        if (two_m && two_n)
            FA_AMX_LOAD(3, c1 + 16, sc);
    } else {
        FA_AMX_ZERO(0);
        if (two_n)
            FA_AMX_ZERO(1);
        if (two_m)
            FA_AMX_ZERO(2);
        if (two_m && two_n)
            FA_AMX_ZERO(3);
    }
    for (int64_t x = 0; x < k; x += 32) {
        const uint32_t *bx = b + (x / 2) * ldb;
        FA_AMX_LOAD(4, a + x, sa);
        FA_AMX_LOAD(6, bx, sb);
        FA_AMX_DP(0, 4, 6);
        if (two_n) {
            FA_AMX_LOAD(7, bx + 16, sb);
            FA_AMX_DP(1, 4, 7);
        }
        if (two_m) {
            FA_AMX_LOAD(5, a1 + x, sa);
            FA_AMX_DP(2, 5, 6);
        }
        if (two_m && two_n)
            FA_AMX_DP(3, 5, 7);
    }
    FA_AMX_STORE(0, c, sc);
    if (two_n)
        FA_AMX_STORE(1, c + 16, sc);
    if (two_m)
        FA_AMX_STORE(2, c1, sc);
    if (two_m && two_n)
        FA_AMX_STORE(3, c1 + 16, sc);
}

/*
 * Our configuration lives from begin to end, around all of a work item's products. The calling
 * thread may be one whose tiles other code configured (thread 0 of the pool is the caller's, and
 * oneDNN, for one, may keep a configuration across its calls), so end puts the previous
 * configuration back, or releases the tiles when there was none (a released tile state also
 * costs nothing on context switches). Tile data is not preserved: no caller may expect that.
 */
static _Thread_local FA_AMX_FN(fa_amx_config) FA_AMX_FN(fa_amx_saved);

FA_AMX_TARGET static void FA_AMX_FN(fa_amx_begin)(void)
{
    FA_AMX_SAVE(&FA_AMX_FN(fa_amx_saved));
    FA_AMX_CONFIG(&FA_AMX_FN(fa_amx_cfg));
}

FA_AMX_TARGET static void FA_AMX_FN(fa_amx_end)(void)
{
    if (FA_AMX_FN(fa_amx_saved).palette != 0)
        FA_AMX_CONFIG(&FA_AMX_FN(fa_amx_saved));
    else
        FA_AMX_RELEASE();
}

/* The whole product, in 32x32 blocks of C (16-wide at the edges). */
FA_AMX_TARGET static void FA_AMX_FN(fa_amx_gemm)(float *c, int64_t ldc, const uint16_t *a,
                                                  int64_t lda, const uint32_t *b, int64_t ldb,
                                                  int64_t m, int64_t n, int64_t k, int accumulate)
{
    for (int64_t i = 0; i < m; i += 32) {
        const int two_m = m - i >= 32;
        float *ci = c + i * ldc;
        const uint16_t *ai = a + i * lda;
        int64_t j = 0;
        if (two_m) {
            for (; j + 32 <= n; j += 32)
                FA_AMX_FN(fa_amx_block)(ci + j, ldc, ai, lda, b + j, ldb, k, accumulate, 1, 1);
            if (j < n)
                FA_AMX_FN(fa_amx_block)(ci + j, ldc, ai, lda, b + j, ldb, k, accumulate, 1, 0);
        } else {
            for (; j + 32 <= n; j += 32)
                FA_AMX_FN(fa_amx_block)(ci + j, ldc, ai, lda, b + j, ldb, k, accumulate, 0, 1);
            if (j < n)
                FA_AMX_FN(fa_amx_block)(ci + j, ldc, ai, lda, b + j, ldb, k, accumulate, 0, 0);
        }
    }
}
