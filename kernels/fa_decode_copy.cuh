/*
 * The decode kernel's stage copies (fa_decode.cu): keys [j0, j0 + FA_BN) of one kv head's K
 * and V, in q's dtype or fp8 (FA_KV_ESIZE bytes an element), into a stage of shared memory in
 * swizzled 16-byte chunks by cp.async, rows past the sequence zero-filled; a paged cache's
 * rows located a block ahead and kept in shared memory for the copies.
 *
 * The Q tile's load too (fa_decode_load_q).
 *
 * Needs fa_decode.cu's FA_THREADS, FA_BN, FA_BM, FA_DP, FA_DVP, FA_CPR_K, FA_STAGE_BYTES,
 * FA_SLICE_COLS, FA_KV_* macros and fa_decode_cache.cuh.
 */
#ifndef FA_DECODE_COPY_CUH
#define FA_DECODE_COPY_CUH

/* cp.async.wait_group N: waits until at most N committed groups of this thread are in flight. */
#define FA_CP_ASYNC_WAIT(n) asm volatile("cp.async.wait_group %0;" ::"n"(n) : "memory")

/* The copy loops unrolled whole, but for heads past 256 (d 576: 18 chunks a thread and more),
 * where ptxas computed every chunk's address ahead and spilled beside the 256-column O (an enum:
 * #pragma unroll takes a constant but expands no macro). */
#define FA_COPY_ROLLED (FA_DP > 256)
enum { fa_copy_unroll = FA_COPY_ROLLED ? 2 : FA_KV_CHUNKS_K + FA_KV_CHUNKS_V };

/* This thread's chunk u of a tile of cpr chunks per row: its row and column chunk. Where the
 * thread count is a multiple of cpr (every padded head dim but 192) a thread keeps one column
 * chunk, rows r0, r0 + rpp, ... (rpp = FA_THREADS / cpr), so its addresses step by constants
 * (the scheme of fa_fwd_sm80.cu's copies). */
#define FA_CHUNK_ROW(u, cpr) (((u) * FA_THREADS + (int)threadIdx.x) / (cpr))
#define FA_CHUNK_COL(u, cpr) (((u) * FA_THREADS + (int)threadIdx.x) % (cpr))
#define FA_CHUNK_LIVE(u, cpr) ((u) * FA_THREADS + (int)threadIdx.x < FA_BN * (cpr))
#define FA_FIXED_CHUNK(cpr) (FA_THREADS % (cpr) == 0)

/* Chunk u of this thread's share of a stage copy of cpr chunks per row: its row r and column
 * chunk c, and whether the stage has it (live). Where FA_FIXED_CHUNK(cpr) the column and the
 * first row are the thread's for the whole kernel and the rows step by a constant, so the
 * compiler keeps no per-chunk division and, mostly, no per-chunk live test. */
typedef struct fa_chunk {
    int r, c, live;
} fa_chunk;

FA_DEV fa_chunk fa_chunk_at(int u, int cpr)
{
    fa_chunk x;
    if (FA_FIXED_CHUNK(cpr)) {
        const int rpp = FA_THREADS / cpr;
        x.r = (int)(threadIdx.x / (unsigned)cpr) + u * rpp;
        x.c = (int)(threadIdx.x % (unsigned)cpr);
        x.live = FA_BN % rpp == 0 ? u * rpp < FA_BN : x.r < FA_BN;
    } else {
        x.r = FA_CHUNK_ROW(u, cpr);
        x.c = FA_CHUNK_COL(u, cpr);
        x.live = FA_CHUNK_LIVE(u, cpr);
    }
    return x;
}

/* Paged: one key row's place in the caches, worked out by thread `row` of the first FA_BN for
 * a block (not by every thread for each of its 16-byte chunks) and kept in shared memory as the
 * row's byte offsets in K and V, where the copies of the block read them. The table read is
 * issued a block ahead (fa_decode_row_find) and its result stored after the block's math
 * (fa_decode_row_keep), so that its latency hides behind that math. */
typedef struct fa_paged_key {
    int blk;     /* block_table entry, not yet clamped */
    fa_u32 row;  /* row within the page */
} fa_paged_key;

/* Position pos's entry in a sequence's block_table row bt. */
FA_DEV fa_paged_key fa_decode_row_at(const fa_dkparams *dp, const int *bt, fa_u32 pos)
{
    const fa_u32 page = fa_kv_page(dp, pos);
    fa_paged_key pr = {bt[page], pos - page * (fa_u32)dp->page_size};
    return pr;
}

/* The entry of this thread's key row of the block of keys [j0, j0 + FA_BN); {0, 0} past jend. */
FA_DEV fa_paged_key fa_decode_row_find(const fa_dkparams *dp, const fa_kvseq *seq, fa_i64 j0,
                                       fa_i64 jend)
{
    fa_paged_key pr = {0, 0};
    const int r = threadIdx.x;
    if (r < FA_BN && j0 + r < jend)
        pr = fa_decode_row_at(dp, seq->bt, (fa_u32)(seq->start + j0 + r));
    return pr;
}

/* Where a copy of cpr chunks per row gives each thread one column chunk and the rows r0 + u rpp
 * (fa_chunk_at), the slots of those rows' offsets are adjacent: row r at slot
 * (r % rpp) * (FA_BN / rpp) + r / rpp, so that a thread reads its offsets with 16-byte loads.
 * Otherwise row r at slot r. */
#define FA_ROWS_GROUPED(cpr) (FA_FIXED_CHUNK(cpr) && FA_BN % (FA_THREADS / (cpr)) == 0)

FA_DEV int fa_row_slot(int r, int cpr)
{
    const int rpp = FA_THREADS / cpr;
    return FA_ROWS_GROUPED(cpr) ? (r % rpp) * (FA_BN / rpp) + r / rpp : r;
}

/* Stores pr's byte offsets from the kv head's first element (row 0 of block 0) for the stage
 * whose offsets are at rows (int64 [2][FA_BN]: K, V, each in fa_row_slot's order; K's alone
 * with FA_V_IN_K), its block id clamped into [0, last_block]. */
FA_DEV void fa_decode_row_keep(const fa_kparams *kp, int last_block, fa_paged_key pr,
                               fa_i64 *rows)
{
    const int r = threadIdx.x;
    if (r < FA_BN) {
        const fa_i64 blk = fa_block_clamp(pr.blk, last_block);
        rows[fa_row_slot(r, FA_KV_CPR_K)] =
            (blk * kp->k_bstride + (fa_i64)pr.row * kp->k_rstride) * FA_KV_ESIZE;
#if !FA_V_IN_K /* (V is read from K's stage) */
        rows[FA_BN + fa_row_slot(r, FA_KV_CPR_V)] =
            (blk * kp->v_bstride + (fa_i64)pr.row * kp->v_rstride) * FA_KV_ESIZE;
#endif
    }
}

/* x, opaque to the optimiser: a row step it cannot see into stays one add a chunk, where it
 * would otherwise fold the step back into a 64-bit multiply of each chunk's row. */
FA_DEV fa_i64 fa_opaque64(fa_i64 x)
{
    asm("" : "+l"(x));
    return x;
}

/* The rows of a stage that hold keys of [j0, jend): min(jend - j0, FA_BN), at least 0. One
 * 64-bit difference a copy, then a 32-bit compare a chunk. */
FA_DEV int fa_copy_rows(fa_i64 j0, fa_i64 jend)
{
    const fa_i64 n = jend - j0;
    return n <= 0 ? 0 : n < FA_BN ? (int)n : FA_BN;
}

/* The stage's swizzle: chunk c of row r at byte fa_swz (a tile of q's dtype) or fa_swz8 (fp8),
 * rows FA_STAGE_ROW_BYTES apart within a column chunk group; the Q tile's, FA_Q_SWZ. A kernel
 * that lays its tiles out otherwise (fa_decode_wg.cu: wgmma's) defines all four first. */
#ifndef FA_STAGE_SWZ
#if FA_KV_FP8
#define FA_STAGE_SWZ fa_swz8
#define FA_STAGE_KEY fa_swz8_key
#else
#define FA_STAGE_SWZ fa_swz
#define FA_STAGE_KEY fa_swz_key
#endif
#define FA_STAGE_ROW_BYTES(cpr) ((cpr) * 16)
#define FA_Q_SWZ fa_swz
#endif

/* Copies this thread's chunks of keys [j0, j0 + FA_BN) of one cache (base g of the kv head;
 * strides bs, rs in elements of FA_KV_ESIZE bytes, or a paged cache's row byte offsets `rows`
 * in fa_row_slot's order; cpr 16-byte chunks per row, nb bytes of each) into the stage at
 * shared address a (generic p), swizzled, zero-filling rows from jend on. Where
 * FA_FIXED_CHUNK(cpr) a chunk costs one compare, a 64-bit add and the copy: the source steps by
 * a row step (or adds its row's offset), the destination by a constant. */
FA_DEV void fa_decode_copy(const fa_kvseq *seq, fa_i64 j0, fa_i64 jend, const char *g, fa_i64 bs,
                           fa_i64 rs, const fa_i64 *rows, int cpr, int nchunks, int nb, fa_u32 a,
                           char *p, const void *safe)
{
    const int es = FA_KV_ESIZE;
    const fa_chunk x0 = fa_chunk_at(0, cpr);
    const int nrows = fa_copy_rows(j0, jend);
    /* chunk u (fixed) holds a key while its row offset from x0's is below lim */
    const int lim = x0.c * 16 < nb ? nrows - x0.r : 0;
    const fa_u32 dst0 = a + FA_STAGE_SWZ(x0.r, x0.c, cpr);
#if FA_PAGED
    /* Where the slots are grouped, this thread's rows' offsets come in 16-byte loads: up to 8
     * of them read together before its first copy (each copy's asm is a barrier to the
     * compiler, which would otherwise issue every read after the copy before), more (d 256) a
     * pair at a time, as the copies need them. Otherwise each is read as its copy needs it. */
    const int grouped = FA_ROWS_GROUPED(cpr) && FA_BN / (FA_THREADS / cpr) % 2 == 0;
    /* (not where the loop is rolled: off[] would go to local memory) */
    const int preload = grouped && FA_BN / (FA_THREADS / cpr) <= 8 && !FA_COPY_ROLLED;
    const longlong2 *o2 = (const longlong2 *)(rows + fa_row_slot(x0.r, cpr));
    fa_i64 off[FA_COPY_ROLLED                ? 2
               : FA_KV_CHUNKS_K > FA_KV_CHUNKS_V ? FA_KV_CHUNKS_K
                                                 : FA_KV_CHUNKS_V];
    longlong2 pair = make_longlong2(0, 0);
    if (preload) {
#pragma unroll
        for (int u = 0; u < FA_KV_CHUNKS_K || u < FA_KV_CHUNKS_V; u += 2)
            if (u < nchunks) {
                const longlong2 w = o2[u / 2];
                off[u] = w.x;
                off[u + 1] = w.y;
            }
    }
#else
    const char *src_u = g + (seq->blk * bs + (seq->start + j0 + x0.r) * rs) * es + x0.c * 16;
    const fa_i64 row_step = fa_opaque64((fa_i64)(FA_THREADS / cpr) * rs * es);
#endif
#pragma unroll fa_copy_unroll
    for (int u = 0; u < FA_KV_CHUNKS_K || u < FA_KV_CHUNKS_V; u++) {
        const fa_chunk x = fa_chunk_at(u, cpr);
        if (u >= nchunks || !x.live)
            break;
        const int r = x.r, c = x.c;
        const int ok = FA_FIXED_CHUNK(cpr) ? r - x0.r < lim : r < nrows && c * 16 < nb;
#if FA_PAGED
        (void)bs, (void)es;
        if (grouped && !preload && u % 2 == 0)
            pair = o2[u / 2];
        const fa_i64 o = preload ? off[u] : grouped ? (u % 2 ? pair.y : pair.x)
                                                    : rows[fa_row_slot(r, cpr)];
        const char *src = g + c * 16 + o;
#else
        (void)rows;
        const char *src = FA_FIXED_CHUNK(cpr) ? src_u
                                              : g + (seq->blk * bs + (seq->start + j0 + r) * rs) * es + c * 16;
        src_u += row_step;
#endif
#if FA_VEC
        (void)p;
        /* rows x0.r + u rpp: rpp is a power of two past x0.r's bits, so the keys xor */
        const int step = r - x0.r;
        const fa_u32 dst = FA_FIXED_CHUNK(cpr)
                               ? (dst0 ^ (fa_u32)(FA_STAGE_KEY(step, cpr) << 4)) +
                                     step * FA_STAGE_ROW_BYTES(cpr)
                               : a + FA_STAGE_SWZ(r, c, cpr);
        fa_cp_async16(dst, ok ? (const void *)src : safe, ok ? 16 : 0);
#else
        (void)dst0;
        char *dst = p + FA_STAGE_SWZ(r, c, cpr);
#pragma unroll
        for (int e = 0; e < 16; e += es)
            if (es == 1)
                dst[e] = ok && c * 16 + e < nb ? src[e] : (char)0;
            else
                *(fa_u16 *)(dst + e) = ok && c * 16 + e < nb ? *(const fa_u16 *)(src + e) : (fa_u16)0;
#endif
    }
}

/* Zeroes the rows of stages 0 .. FA_STAGES - 2 that hold keys from `from` on (stage s holding
 * keys [s FA_BN, (s + 1) FA_BN)), K and V; by every thread, through generic pointers. */
FA_DEV void fa_decode_stages_zero(char *p, int from)
{
    const int cpr = FA_KV_CPR_K + (FA_V_IN_K ? 0 : FA_KV_CPR_V); /* a row's chunks, K's, V's */
    for (int i = threadIdx.x; i < (FA_STAGES - 1) * FA_BN * cpr; i += FA_THREADS) {
        const int s = i / (FA_BN * cpr), r = i / cpr % FA_BN, c = i % cpr;
        if (s * FA_BN + r < from)
            continue;
        char *st = p + s * FA_STAGE_BYTES, *vt = st + FA_BN * FA_KV_CPR_K * 16;
        char *at = c < FA_KV_CPR_K ? st + FA_STAGE_SWZ(r, c, FA_KV_CPR_K)
                                   : vt + FA_STAGE_SWZ(r, c - FA_KV_CPR_K, FA_KV_CPR_V);
        *(uint4 *)at = make_uint4(0, 0, 0, 0);
    }
}

/* Copies keys [j0, j0 + FA_BN) of the sequence (rows from jend on zero-filled) into stage s,
 * in swizzled 16-byte chunks; a paged cache's rows where the stage's row offsets (rows) say.
 * V's columns from vc0 (the CTA's slice, FA_DV_SLICES), the stage's past dv zero. */
FA_DEV void fa_decode_load(const fa_dkparams *dp, int kh, const fa_kvseq *seq, fa_i64 j0,
                           fa_i64 jend, fa_u32 base_a, char *base_p, int s, const fa_i64 *rows,
                           int vc0)
{
    const fa_kparams *kp = &dp->f;
    const char *kg = (const char *)kp->k + kh * kp->k_hstride * FA_KV_ESIZE;
    const char *vg = (const char *)kp->v + (kh * kp->v_hstride + vc0) * FA_KV_ESIZE;
    const int vcols = FA_SLICE_COLS(kp->dv, vc0);
    const int k_at = s * FA_STAGE_BYTES, v_at = k_at + FA_BN * FA_DP * FA_KV_ESIZE;
    fa_decode_copy(seq, j0, jend, kg, kp->k_bstride, kp->k_rstride, rows, FA_KV_CPR_K,
                   FA_KV_CHUNKS_K, kp->d * FA_KV_ESIZE, base_a + k_at, base_p + k_at, kp->k);
#if FA_V_IN_K
    (void)vg, (void)vcols, (void)v_at; /* V is read from K's rows */
#else
    fa_decode_copy(seq, j0, jend, vg, kp->v_bstride, kp->v_rstride, rows + FA_BN, FA_KV_CPR_V,
                   FA_KV_CHUNKS_V, vcols * FA_KV_ESIZE, base_a + v_at, base_p + v_at, kp->v);
#endif
}

/* The stages' row offsets (paged): int64 [FA_STAGES][FA_DECODE_ROWS_STRIDE], K's then V's; a
 * kernel that keeps K's alone (V read from K's stage) defines it as FA_BN first. */
#ifndef FA_DECODE_ROWS_STRIDE
#define FA_DECODE_ROWS_STRIDE (2 * FA_BN)
#endif

/* The copy pipeline's turn at key block nb of the CTA's [nb0, nb1) (every thread): waits until
 * block nb has landed in its stage, then (a barrier: every thread is done with block nb - 1)
 * issues the copy of block nb + FA_STAGES - 1 into the stage block nb - 1 held. `fence`: a
 * kernel whose tensor cores read the stages by descriptor (the async proxy) fences each
 * thread's copies before the barrier. */
FA_DEV void fa_decode_turn(const fa_dkparams *dp, int kh, const fa_kvseq *seq, int klo, int khi,
                           int nb, int nb0, int nb1, fa_u32 base_a, char *base_p,
                           const fa_i64 *rows_p, int vc0, int fence)
{
    FA_CP_ASYNC_WAIT(FA_STAGES - 2);
    if (fence)
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const int nx = nb + FA_STAGES - 1, nslot = (nx - nb0) % FA_STAGES;
    if (nx < nb1)
        fa_decode_load(dp, kh, seq, klo + (fa_i64)nx * FA_BN, khi, base_a, base_p, nslot,
                       rows_p + nslot * FA_DECODE_ROWS_STRIDE, vc0);
    fa_cp_async_commit();
}

/* The Q tile: packed rows [r0, r0 + FA_BM) of kv head kh, rotated where rotary is on, rounded
 * to the data type, zero past the rows and columns; q of sequence bi starts at row q0. */
FA_DEV void fa_decode_load_q(const fa_dkparams *dp, int bi, fa_i64 q0, int kh, const fa_kvseq *seq,
                             int r0, int rows, int g, fa_u16 *q_p)
{
    const fa_kparams *kp = &dp->f;
    const fa_u16 *qb = (const fa_u16 *)kp->q + bi * kp->q_bstride + q0 * kp->q_rstride;
#if FA_VEC
    /* Without rotary, 16-byte chunks (q's rows are aligned under FA_VEC). */
    if (!dp->rot_cos) {
        for (int i = threadIdx.x; i < FA_BM * FA_CPR_K; i += FA_THREADS) {
            const int r = i / FA_CPR_K, c = i - r * FA_CPR_K;
            uint4 x = make_uint4(0, 0, 0, 0);
            if (r0 + r < rows && c * 8 < kp->d) {
                const int qi = fa_div_g(dp, r0 + r), hh = kh * g + (r0 + r) - qi * g;
                x = *(const uint4 *)(qb + qi * kp->q_rstride + hh * kp->q_hstride + c * 8);
            }
            *(uint4 *)((char *)q_p + FA_Q_SWZ(r, c, FA_CPR_K)) = x;
        }
        return;
    }
#endif
    for (int i = threadIdx.x; i < FA_BM * FA_DP; i += FA_THREADS) {
        const int r = i / FA_DP, c = i - r * FA_DP;
        const float x =
            r0 + r < rows && c < kp->d ? fa_decode_q_value(dp, qb, seq, r0 + r, c, g, kh) : 0.f;
        q_p[(FA_Q_SWZ(r, c >> 3, FA_CPR_K) >> 1) + (c & 7)] = fa_from_float(x);
    }
}

#endif /* FA_DECODE_COPY_CUH */
