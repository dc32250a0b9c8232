/*
 * The sm80 backward's tile copies (kernels/fa_bwd_sm80.cu includes it after its tile defines and
 * fa_bwd_common.cuh): tiles of Q, dO, K and V from global memory into padded shared-memory rows
 * by cp.async (FA_VEC, 16-byte aligned rows) or element by element, zero-filled past the rows and
 * head dims, and a query tile's stage with its rows of lse and D.
 */
#ifndef FA_BWD_SM80_COPY_CUH
#define FA_BWD_SM80_COPY_CUH

/* The most cp.async chunks per thread a tile copy issues unrolled (fa_bwd_tile_load): beside
 * the split kernels' wider accumulators, fewer. */
#define FA_UNROLLED_CHUNKS (FA_DKV_SPLIT > 1 ? 4 : 8)

#if FA_VEC
/* Chunk i (16 bytes) of fa_bwd_tile_load's tile: row i / cpr, column chunk i % cpr. */
FA_DEV void fa_bwd_chunk_load(fa_u16 *tile, int ld, const fa_u16 *src, fa_i64 rs, int nrows,
                              int ncols, int cpr, int i)
{
    const int r = i / cpr, c = i - r * cpr;
    const int ok = c * 8 < ncols && r < nrows;
    fa_cp_async16(fa_smem_addr(tile) + (r * ld + c * 8) * 2,
                  ok ? (const void *)(src + r * rs + c * 8) : src, ok ? 16 : 0);
}
#endif

/* Copies rows [0, rows) x columns [0, ncols) of a global slice (row stride rs; row 0 must
 * exist) into a shared tile of row stride ld (elements) at `tile`, zero-filling rows >= nrows
 * and columns past ncols up to cols (the padded width). With FA_VEC the copies are cp.async in
 * 16-byte chunks (committed by the caller): where cols / 8 divides FA_THREADS and step =
 * FA_THREADS / (cols / 8) divides rows into at most FA_UNROLLED_CHUNKS steps, a thread owns one
 * column chunk and rows r0, r0 + step, ..., so its addresses are one base plus constants;
 * otherwise chunk i of the tile goes to thread i % FA_THREADS (cols 192), in a rolled loop past
 * FA_UNROLLED_CHUNKS chunks a thread (whose unrolled addresses ptxas kept in registers over the
 * main loop: spills at head dim 256 with 2 warps).
 * A zero-length copy writes a zero chunk and reads nothing (its source is the slice's first
 * element, which exists). Without FA_VEC, plain loads and stores. */
FA_DEV void fa_bwd_tile_load(fa_u16 *tile, int ld, const fa_u16 *src, fa_i64 rs, int nrows,
                             int ncols, int rows, int cols)
{
#if FA_VEC
    const int cpr = cols / 8, step = FA_THREADS / cpr;
    const int per_thread = (rows * cpr + FA_THREADS - 1) / FA_THREADS;
    if (FA_THREADS % cpr != 0 || rows % step != 0 || per_thread > FA_UNROLLED_CHUNKS) {
        if (per_thread <= FA_UNROLLED_CHUNKS) {
#pragma unroll
            for (int j = 0; j < per_thread; j++)
                if (threadIdx.x + j * FA_THREADS < rows * cpr)
                    fa_bwd_chunk_load(tile, ld, src, rs, nrows, ncols, cpr,
                                      threadIdx.x + j * FA_THREADS);
        } else {
#pragma unroll 1
            for (int i = threadIdx.x; i < rows * cpr; i += FA_THREADS)
                fa_bwd_chunk_load(tile, ld, src, rs, nrows, ncols, cpr, i);
        }
        return;
    }
    const int c = threadIdx.x % cpr, r0 = threadIdx.x / cpr;
    const int col_ok = c * 8 < ncols;
    const fa_u32 dst = fa_smem_addr(tile) + (r0 * ld + c * 8) * 2;
    const fa_u16 *from = src + r0 * rs + c * 8;
#pragma unroll
    for (int j = 0; j < rows / step; j++) {
        const int ok = col_ok && r0 + j * step < nrows;
        fa_cp_async16(dst + j * step * ld * 2, ok ? (const void *)(from + j * step * rs) : src,
                      ok ? 16 : 0);
    }
#else
    for (int i = threadIdx.x; i < rows * cols; i += FA_THREADS) {
        const int r = i / cols, c = i - r * cols;
        tile[r * ld + c] = (r < nrows && c < ncols) ? src[r * rs + c] : (fa_u16)0;
    }
#endif
}
/* Starts the copies of query tile mb of head h, sequence bi (a tile that meets a key block, so
 * its row m0 exists): Q, dO (zero-filled past the sequence and the head dims) and the tile's
 * lse * log2 e and D rows of the workspace (padded to whole tiles, so always in bounds) into one
 * stage's buffers. */
FA_DEV void fa_bwd_load_q(const fa_bkparams *bp, const fa_seq *s, int bi, int h, int mb,
                          fa_u16 *s_q, fa_u16 *s_do, float *s_lse, float *s_dsum)
{
    const fa_kparams *kp = &bp->f;
    const int m0 = mb * FA_BM;
    const fa_u16 *qg = (const fa_u16 *)kp->q + bi * kp->q_bstride +
                       (s->q_start + m0) * kp->q_rstride + h * kp->q_hstride;
    const fa_u16 *dog = (const fa_u16 *)bp->dout + bi * bp->do_bstride +
                        (s->q_start + m0) * bp->do_rstride + h * bp->do_hstride;
    fa_bwd_tile_load(s_q, FA_LDK, qg, kp->q_rstride, s->sq - m0, kp->d, FA_BM, FA_DP);
    fa_bwd_tile_load(s_do, FA_LDV, dog, bp->do_rstride, s->sq - m0, kp->dv, FA_BM, FA_DVP);
    const fa_i64 r0 = fa_bwd_row0(bp, h, bi) + m0;
    const int i = threadIdx.x;
    if (i < FA_BM / 4)
        fa_cp_async16(fa_smem_addr(s_lse + 4 * i), bp->lse2 + r0 + 4 * i, 16);
    else if (i < FA_BM / 2)
        fa_cp_async16(fa_smem_addr(s_dsum + 4 * (i - FA_BM / 4)), bp->dsum + r0 + 4 * (i - FA_BM / 4),
                      16);
}

#endif /* FA_BWD_SM80_COPY_CUH */
