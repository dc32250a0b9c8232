/*
 * The sm80 forward's tile copies (kernels/fa_fwd_sm80.cu includes it after its tile defines):
 * rows of Q, K or V from global memory into swizzled shared-memory tiles by cp.async (FA_VEC,
 * 16-byte aligned rows) or element by element, zero-filled past the rows and columns, and with
 * FA_PAGED each key row found through the block table.
 */
#ifndef FA_FWD_SM80_COPY_CUH
#define FA_FWD_SM80_COPY_CUH

typedef struct fa_copy {
    fa_u32 tile;      /* shared address of the tile */
    fa_u32 dst;       /* fixed chunk: shared address of chunk ch of row r0 */
    fa_i64 src;       /* fixed chunk: element offset of chunk ch of row r0 in the slice */
    int r0, ch;
    int ncols;
} fa_copy;

FA_DEV fa_copy fa_copy_make(fa_u32 tile, fa_i64 rs, int ncols, int cpr)
{
    fa_copy c;
    const int fixed = FA_FIXED_CHUNK(cpr);
    c.r0 = fixed ? (int)threadIdx.x / cpr : 0;
    c.ch = fixed ? (int)threadIdx.x % cpr : 0;
    c.tile = tile;
    c.dst = tile + fa_swz(c.r0, c.ch, cpr);
    c.src = c.r0 * rs + c.ch * 8;
    c.ncols = ncols;
    return c;
}

#if FA_VEC
/* Copies rows [0, rows) of a global slice (row stride rs) into the tile with cp.async,
 * zero-filling rows >= nrows and chunks beyond the columns. `src` is the slice plus cp->src,
 * kept by the caller and stepped block to block, so that the loop carries one 64-bit pointer
 * rather than recomputing it from the parameters; `safe` is a valid address given to
 * zero-length copies. */
FA_DEV void fa_tile_load(const fa_copy *cp, const fa_u16 *src, fa_i64 rs, int nrows, int rows,
                         int cpr, const void *safe)
{
    if (FA_FIXED_CHUNK(cpr)) {
        const int rpp = FA_THREADS / cpr;
        const int col_ok = cp->ch * 8 < cp->ncols;
#pragma unroll
        for (int j = 0; j * rpp < rows; j++) {
            const int r = cp->r0 + j * rpp;
            if (rows % rpp == 0 || r < rows) {
                const int ok = col_ok && r < nrows;
                const fa_u32 dst =
                    (cp->dst ^ (fa_swz_key(j * rpp, cpr) << 4)) + j * rpp * cpr * 16;
                fa_cp_async16(dst, ok ? (const void *)(src + j * rpp * rs) : safe, ok ? 16 : 0);
            }
        }
    } else {
#pragma unroll
        for (int i0 = 0; i0 < rows * cpr; i0 += FA_THREADS) {
            const int i = i0 + (int)threadIdx.x;
            const int r = i / cpr, c = i - r * cpr;
            const int ok = i < rows * cpr && r < nrows && c * 8 < cp->ncols;
            if (i < rows * cpr)
                fa_cp_async16(cp->tile + fa_swz(r, c, cpr),
                              ok ? (const void *)(src + r * rs + c * 8) : safe, ok ? 16 : 0);
        }
    }
}
#else
/* Unaligned rows: element by element through registers, into the tile at generic address
 * `tile`, zero-filling rows >= nrows and columns >= ncols. */
FA_DEV void fa_tile_load_scalar(fa_u16 *tile, const fa_u16 *g, fa_i64 rs, int nrows, int ncols,
                                int rows, int cpr)
{
    for (int i = threadIdx.x; i < rows * cpr; i += FA_THREADS) {
        const int r = i / cpr, c = i - r * cpr;
        fa_u16 *dst = tile + (fa_swz(r, c, cpr) >> 1);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const int col = (c << 3) + e;
            dst[e] = (r < nrows && col < ncols) ? g[r * rs + col] : (fa_u16)0;
        }
    }
}
#endif

#if FA_PAGED
/* Key j's row of kv head hk in paged v (v = 1) or k of sequence bi (j below the sequence's keys,
 * so within its block_table row). Everything is formed from the parameters here, at the copy,
 * so that the key loop carries no pointers of its own. */
FA_DEV const fa_u16 *fa_pages_row(const fa_kparams *kp, int bi, int hk, int v, int j)
{
    const fa_u16 *base = (const fa_u16 *)(v ? kp->v : kp->k);
    const fa_i64 hs = v ? kp->v_hstride : kp->k_hstride;
    const fa_i64 bs = v ? kp->v_bstride : kp->k_bstride, rs = v ? kp->v_rstride : kp->k_rstride;
    return base + hk * hs + fa_page_row(kp, kp->block_table + bi * kp->bt_bstride, j, bs, rs);
}

#if FA_VEC
/* fa_tile_load for keys [n0, n0 + rows) of paged k or v: each row's address looked up. */
FA_DEV void fa_tile_load_paged(const fa_copy *cp, const fa_kparams *kp, int bi, int hk, int v,
                               int n0, int nrows, int rows, int cpr, const void *safe)
{
    if (FA_FIXED_CHUNK(cpr)) {
        const int rpp = FA_THREADS / cpr;
        const int col_ok = cp->ch * 8 < cp->ncols;
#pragma unroll
        for (int j = 0; j * rpp < rows; j++) {
            const int r = cp->r0 + j * rpp;
            if (rows % rpp == 0 || r < rows) {
                const int ok = col_ok && r < nrows;
                const fa_u32 dst =
                    (cp->dst ^ (fa_swz_key(j * rpp, cpr) << 4)) + j * rpp * cpr * 16;
                const void *src = safe;
                if (ok)
                    src = fa_pages_row(kp, bi, hk, v, n0 + r) + cp->ch * 8;
                fa_cp_async16(dst, src, ok ? 16 : 0);
            }
        }
    } else {
#pragma unroll
        for (int i0 = 0; i0 < rows * cpr; i0 += FA_THREADS) {
            const int i = i0 + (int)threadIdx.x;
            const int r = i / cpr, c = i - r * cpr;
            const int ok = i < rows * cpr && r < nrows && c * 8 < cp->ncols;
            const void *src = safe;
            if (ok)
                src = fa_pages_row(kp, bi, hk, v, n0 + r) + c * 8;
            if (i < rows * cpr)
                fa_cp_async16(cp->tile + fa_swz(r, c, cpr), src, ok ? 16 : 0);
        }
    }
}
#else
/* fa_tile_load_scalar for keys [n0, n0 + rows) of paged k or v. */
FA_DEV void fa_tile_load_scalar_paged(fa_u16 *tile, const fa_kparams *kp, int bi, int hk,
                                      int v, int n0, int nrows, int ncols, int rows, int cpr)
{
    for (int i = threadIdx.x; i < rows * cpr; i += FA_THREADS) {
        const int r = i / cpr, c = i - r * cpr;
        fa_u16 *dst = tile + (fa_swz(r, c, cpr) >> 1);
        const fa_u16 *g = r < nrows ? fa_pages_row(kp, bi, hk, v, n0 + r) : 0;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const int col = (c << 3) + e;
            dst[e] = (g && col < ncols) ? g[col] : (fa_u16)0;
        }
    }
}
#endif
#endif

#endif /* FA_FWD_SM80_COPY_CUH */
