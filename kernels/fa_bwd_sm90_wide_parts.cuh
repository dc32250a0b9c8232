/*
 * The wide sm90 backward's parts (kernels/fa_bwd_sm90_wide.cu, included after its defines and
 * layout): its wgmma products, dQ's additions to the workspace (deterministic turns included),
 * the per-tile shared addresses and P^T / dS^T stores of 128-key blocks, the stores of dK and
 * dV at an item's end, and the issue of a 64-key tile's S^T and dP^T.
 */
#ifndef FA_BWD_SM90_WIDE_PARTS_CUH
#define FA_BWD_SM90_WIDE_PARTS_CUH

#define FA_RL16 FA_RC0 ", " FA_RC1
#define FA_FL16(a) FA_F8(a, 0), FA_F8(a, 8)
/* S^T = K Q^T, dP^T = V dO^T over 32 queries: rows of keys and of queries, head dim contiguous
 * (both K-major). */
FA_DEF_WGMMA_SS(fa_wgmma_kk32, 32, FA_RL16, FA_FL16, "%16", "%17", "%18", "0, 0")
/* S^T or dP^T over all 64 queries of the tile (FA_BWD_N64) */
FA_DEF_WGMMA_SS(fa_wgmma_kk64, 64, FA_RL32, FA_FL32, "%32", "%33", "%34", "0, 0")
/* dV += P^T dO, dK += dS^T Q: P^T, dS^T rows of keys (queries contiguous, K-major), dO and Q
 * rows of queries (columns contiguous, MN-major). */
FA_DEF_WGMMA_SS(fa_wgmma_kt64, 64, FA_RL32, FA_FL32, "%32", "%33", "%34", "0, 1")
FA_DEF_WGMMA_SS(fa_wgmma_kt128, 128, FA_RL64, FA_FL64, "%64", "%65", "%66", "0, 1")
/* dQ = dS K: dS^T rows of keys (queries contiguous) and K rows of keys (columns contiguous),
 * both MN-major. */
FA_DEF_WGMMA_SS(fa_wgmma_tt64, 64, FA_RL32, FA_FL32, "%32", "%33", "%34", "1, 1")
FA_DEF_WGMMA_SS(fa_wgmma_tt128, 128, FA_RL64, FA_FL64, "%64", "%65", "%66", "1, 1")

/* Issues S^T (or dP^T) of the block's 64 keys x nq = 32 or 64 queries (a constant at each call)
 * over `cols` of the head dim: 16-column k-steps, 32 bytes apart inside a 128-byte row, the next
 * 64-column block of the key rows (FA_BN rows) and of the query rows (FA_BM rows) after four. */
FA_DEV void fa_gemm_t(float *acc, fa_u64 kv_rows, fa_u64 q_rows, int cols, int nq)
{
#pragma unroll
    for (int kk = 0; kk < cols / 16; kk++) {
        const fa_u64 a = fa_desc_at(kv_rows, (kk >> 2) * FA_BN * 128 + (kk & 3) * 32);
        const fa_u64 b = fa_desc_at(q_rows, (kk >> 2) * FA_BM * 128 + (kk & 3) * 32);
        if (nq == 64)
            fa_wgmma_kk64(acc, a, b, kk > 0);
        else
            fa_wgmma_kk32(acc, a, b, kk > 0);
    }
}

/* Issues acc += P^T B (or dS^T B) over the tile's queries 16 kk0 .. 16 kk1 - 1, a k-step each:
 * A the buffer's rows of keys (K-major, +32 bytes a step), B `nblk` 64-column blocks of the
 * stage's dO or Q (MN-major, +16 rows a step), two blocks an instruction where they pair; nblk
 * (0 to 4) is the same over the warpgroup. */
FA_DEV void fa_gemm_kv(float *acc, int nblk, fa_u64 a_rows, fa_u64 b_cols, int kk0, int kk1)
{
#pragma unroll
    for (int kk = kk0; kk < kk1; kk++)
#pragma unroll
        for (int j = 0; j < nblk; j += 2) {
            const fa_u64 a = fa_desc_at(a_rows, kk * 32);
            const fa_u64 b = fa_desc_at(b_cols, kk * 2048 + j * FA_BM * 128);
            if (nblk - j >= 2)
                fa_wgmma_kt128(acc + 32 * j, a, b, 1);
            else
                fa_wgmma_kt64(acc + 32 * j, a, b, 1);
        }
}

/* Issues dQ = dS K over the block's FA_BN keys, a k-step of 16 rows of keys (2048 bytes) in both
 * operands: A the dS^T buffer (MN-major), B nblk 64-column blocks of K (MN-major). */
FA_DEV void fa_gemm_dq(float *acc, int nblk, fa_u64 ds_rows, fa_u64 k_cols)
{
#pragma unroll
    for (int kk = 0; kk < FA_BN / 16; kk++) {
        if (nblk == 2)
            fa_wgmma_tt128(acc, fa_desc_at(ds_rows, kk * 2048), fa_desc_at(k_cols, kk * 2048),
                           kk > 0);
        else if (nblk == 1)
            fa_wgmma_tt64(acc, fa_desc_at(ds_rows, kk * 2048), fa_desc_at(k_cols, kk * 2048),
                          kk > 0);
    }
}

/* Adds this warp's dQ rows (16 of the tile at acc_w, 16 x 8 blocks of the accumulator, this
 * lane's four values at 4 lane, dq[c][0..3]: block c of the warpgroup's columns) for nblk
 * 64-column blocks. */
FA_DEV void fa_dq_add(float *acc_w, int lane, int nblk, float dq[][4])
{
#pragma unroll
    for (int c = 0; c < 8 * FA_QB_MAX; c++)
        if (c < 8 * nblk)
            fa_red_add_v4(acc_w + c * 128 + 4 * lane, dq[c][0], dq[c][1], dq[c][2], dq[c][3]);
}

/* Deterministic mode, both consumer warpgroups (ct: the thread's index among them): waits for
 * query tile mb's turn (every later key block that meets it has added: the sm80 family's
 * counter, in the same workspace) before this block's dQ adds ... */
FA_DEV void fa_dq_turn_wait(const fa_bkparams *bp, const fa_seq *s, int bi, int h, int mb,
                            int nb, int ct)
{
    if (ct == 0)
        fa_bwd_turn_wait(&bp->f, s, mb, nb, fa_bwd_sem(bp, bi, h, mb));
    fa_bar_sync(FA_BAR_DET, 256);
}

/* ... and after them, once every consumer thread's adds are visible, passes the turn on. */
FA_DEV void fa_dq_turn_pass(const fa_bkparams *bp, int bi, int h, int mb, int ct)
{
    __threadfence();
    fa_bar_sync(FA_BAR_DET, 256);
    if (ct == 0)
        atomicAdd(fa_bwd_sem(bp, bi, h, mb), 1);
}

/* Row g + 8 hf of this thread's C fragments acc (nblk 64-column blocks from column c0) to the
 * global row r of n columns, times scale; live: the key exists. */
FA_DEV void fa_store_blocks(fa_u16 *r, int n, const float acc[][4], int c0, int nblk, int hf,
                            int t, float scale, int live)
{
    if (nblk > 0)
        fa_bwd_store_row(r + c0, n - c0, acc, 64 * nblk, hf, t, scale, live);
}

/* dK (times the softmax scale dS lacked) and dV of this thread's keys key0 and key0 + 8 of kv
 * head hk, sequence bi: the warpgroup's blocks (nkb of dK from column kc0, nvb of dV from vc0);
 * keys up to sk (dense) or, varlen, up to the sequence's end in k, as fa_bwd_store_dkdv. */
FA_DEV void fa_store_dkdv(const fa_bkparams *bp, int bi, int hk, int key0, int t, int sk,
                          int kc0, int nkb, int vc0, int nvb, const float dk[][4],
                          const float dv[][4])
{
    const fa_kparams *kp = &bp->f;
    fa_i64 k_start;
    int key_end;
    fa_bwd_key_span(kp, bi, sk, &k_start, &key_end);
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int key = key0 + 8 * hf;
        fa_u16 *dkr = (fa_u16 *)bp->dk + bi * bp->dk_bstride + (k_start + key) * bp->dk_rstride +
                      hk * bp->dk_hstride;
        fa_u16 *dvr = (fa_u16 *)bp->dv + bi * bp->dv_bstride + (k_start + key) * bp->dv_rstride +
                      hk * bp->dv_hstride;
        fa_store_blocks(dkr, kp->d, dk, kc0, nkb, hf, t, kp->scale, key < key_end);
        fa_store_blocks(dvr, kp->dv, dv, vc0, nvb, hf, t, 1.f, key < key_end);
    }
}

#if FA_KEY_SPLIT
/* A tile's shared addresses for warpgroup rows from kw0: its K and V rows, the Q and dO stage
 * qs, its rows of the P^T and dS^T buffers s. From a base made opaque at each call, so that they
 * are recomputed where used rather than held over the tile. */
typedef struct fa_tile_smem {
    fa_u32 k, v, q, dout, p, ds;
} fa_tile_smem;

FA_DEV fa_tile_smem fa_tile_smem_at(fa_u32 sm, int qs, int s, int kw0)
{
    fa_u32 sb = sm;
    FA_PINU(sb);
    fa_tile_smem a;
    a.k = sb + kw0 * 128;
    a.v = sb + FA_OFF_V + kw0 * 128;
    a.q = sb + FA_OFF_Q + qs * FA_Q_BYTES;
    a.dout = sb + FA_OFF_DO + qs * FA_DO_BYTES;
    a.p = sb + FA_OFF_P + s * FA_PS_BYTES + kw0 * 128;
    a.ds = sb + FA_OFF_DS + s * FA_PS_BYTES + kw0 * 128;
    return a;
}

/* dV's product takes P^T from registers (RS), the shared buffer's reads left to dK's, dQ's and
 * the S^T / dP^T products; varlen's kernel spilled with it and keeps P^T in shared memory. */
#define FA_P_RS (!FA_VARLEN)

/* Issues acc += A B for A the register fragments a[2][4] (this warpgroup's keys x queries 16
 * kk0 .. 16 kk0 + 31, a k-step each: the S^T accumulator's pattern) and B nblk 64-column blocks
 * of the stage's dO or Q (MN-major), two blocks an instruction where they pair. */
FA_DEV void fa_gemm_kv_rs(float *acc, int nblk, const fa_u32 a[2][4], fa_u64 b_cols, int kk0)
{
#pragma unroll
    for (int kk = 0; kk < 2; kk++)
#pragma unroll
        for (int j = 0; j < nblk; j += 2) {
            const fa_u64 b = fa_desc_at(b_cols, (kk0 + kk) * 2048 + j * FA_BM * 128);
            if (nblk - j >= 2)
                fa_wgmma_pv128(acc + 32 * j, a[kk], b);
            else
                fa_wgmma_pv64(acc + 32 * j, a[kk], b);
        }
}

/* Issues and commits dV += P^T dO and dK += dS^T Q of the warpgroup's keys over the tile's
 * queries 16 kk0 .. 16 kk0 + 31 (one half): P^T from registers (pa, which the caller keeps,
 * fa_pin_frags, until a wait has seen the group done) or the tile's buffer, dS^T from its. */
FA_DEV void fa_gemm_dkdv(float dk[][4], float dv[][4], const fa_tile_smem *a, int kk0,
                         const fa_u32 pa[2][4])
{
#if FA_P_RS
    fa_gemm_kv_rs(&dv[0][0], FA_NVB, pa, fa_desc(a->dout, FA_BM * 128, 1024), kk0);
#else
    fa_gemm_kv(&dv[0][0], FA_NVB, fa_desc(a->p, 16, 1024), fa_desc(a->dout, FA_BM * 128, 1024),
               kk0, kk0 + 2);
#endif
    fa_gemm_kv(&dk[0][0], FA_NKB, fa_desc(a->ds, 16, 1024), fa_desc(a->q, FA_BM * 128, 1024),
               kk0, kk0 + 2);
    fa_wg_commit();
}

/* Keeps a half's fragments pa alive to here: after the wait for the product that read them. */
FA_DEV void fa_pin_frags(fa_u32 pa[2][4])
{
#pragma unroll
    for (int kk = 0; kk < 2; kk++)
#pragma unroll
        for (int r = 0; r < 4; r++)
            FA_PINU(pa[kk][r]);
}

#endif

/* Fragment r of k-step kk (16 queries) of a C tile x of this warp's 16 keys x 32 queries as a
 * 16-bit A fragment: the 8 x 8 block of keys + 8 (r % 2), queries + 8 (r / 2). */
FA_DEV fa_u32 fa_frag_pack(const float x[4][4], int kk, int r)
{
    return fa_pack2(x[2 * kk + (r >> 1)][2 * (r & 1)], x[2 * kk + (r >> 1)][2 * (r & 1) + 1]);
}

/* This lane's stmatrix offset for k-step kk in a [keys][64 queries] buffer from its query q0:
 * row = key, queries contiguous, this lane giving row st_key of block blk4. */
FA_DEV fa_u32 fa_frag_off(int st_key, int q0, int kk, int blk4)
{
    return fa_swz128(st_key, q0 + 16 * kk + 8 * (blk4 >> 1));
}

/* P^T (st, 32 queries from q0) as A fragments pa[kk] (fa_frag_pack), stored into the buffer p_t
 * too where store_p (a constant at each call), and dS^T (dpt) into ds_t, one stmatrix a k-step
 * (fa_frag_off); then visible to wgmma. */
FA_DEV void fa_pds_store(const float st[4][4], const float dpt[4][4], fa_u32 pa[2][4],
                         int store_p, fa_u32 p_t, fa_u32 ds_t, int st_key, int q0, int blk4)
{
#pragma unroll
    for (int kk = 0; kk < 2; kk++) {
        fa_u32 da[4];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            pa[kk][r] = fa_frag_pack(st, kk, r);
            da[r] = fa_frag_pack(dpt, kk, r);
        }
        const fa_u32 off = fa_frag_off(st_key, q0, kk, blk4);
        if (store_p)
            fa_stmatrix_x4(p_t + off, pa[kk]);
        fa_stmatrix_x4(ds_t + off, da);
    }
    fa_fence_proxy_async();
}

#if FA_BWD_N64
/* The C tile x as the A fragments of both k-steps (fa_frag_pack) ... */
FA_DEV void fa_frags_pack(const float x[4][4], fa_u32 f[2][4])
{
#pragma unroll
    for (int kk = 0; kk < 2; kk++)
#pragma unroll
        for (int r = 0; r < 4; r++)
            f[kk][r] = fa_frag_pack(x, kk, r);
}

/* ... and back, each value widened from 16 bits. */
FA_DEV void fa_frags_unpack(const fa_u32 f[2][4], float x[4][4])
{
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const fa_u32 w = f[nt >> 1][2 * (nt & 1) + (e >> 1)];
            x[nt][e] = fa_to_float((fa_u16)(e & 1 ? w >> 16 : w & 0xffffu));
        }
}
#endif

/* fa_pds_store of P^T and dS^T made from the products st and dpt by fa_bwd_probs (full: no pair
 * of the tile masked). */
FA_DEV void fa_probs_store(const fa_kparams *kp, const fa_bwd_tile *tl, int t, int full,
                           float st[4][4], float dpt[4][4], fa_u32 pa[2][4], int store_p,
                           fa_u32 p_t, fa_u32 ds_t, int st_key, int q0, int blk4)
{
    if (full)
        fa_bwd_probs(kp, tl, t, st, dpt, 0);
    else
        fa_bwd_probs(kp, tl, t, st, dpt, 1);
    fa_pds_store(st, dpt, pa, store_p, p_t, ds_t, st_key, q0, blk4);
}

#if !FA_KEY_SPLIT
/* S^T and dP^T of the item's tile (h, mb) against this warpgroup's 32 queries (qw0), from the
 * Q / dO stage that `run` names, issued as one wgmma group and left running; tl <- the tile's
 * rows for fa_bwd_probs, their lse and D loaded while the products run. */
FA_DEV void fa_bwd_sdp_issue(const fa_bkparams *bp, fa_u32 sm, const fa_seq *sv, int bi, int h,
                             int mb, int run, int qw0, int key0, int t, float st[4][4],
                             float dpt[4][4], fa_bwd_tile *tl)
{
    const fa_kparams *kp = &bp->f;
    const int qs = run >> 3, qph = (run >> 2) & 1;
    fa_u32 sb = sm;
    FA_PINU(sb);
    const fa_u32 q_t = sb + FA_OFF_Q + qs * FA_Q_BYTES, do_t = sb + FA_OFF_DO + qs * FA_DO_BYTES;
    fa_mbar_wait(sm + FA_OFF_Q_FULL + 8 * qs, qph);
    fa_wg_fence();
    fa_gemm_t(&st[0][0], fa_desc(sb, 16, 1024), fa_desc(q_t + qw0 * 128, 16, 1024), FA_DP, 32);
    fa_gemm_t(&dpt[0][0], fa_desc(sb + FA_OFF_V, 16, 1024), fa_desc(do_t + qw0 * 128, 16, 1024),
              FA_DVP, 32);
    fa_wg_commit();
    int wlo, whi;
    fa_bwd_window(kp, &wlo, &whi);
    const int m0 = mb * FA_BM;
    const fa_i64 row0 = fa_bwd_row0(bp, h, bi) + m0;
    *tl = fa_bwd_tile_make(kp, sv, bi, h, m0 + qw0, key0, t, wlo, whi, bp->lse2 + row0 + qw0,
                           bp->dsum + row0 + qw0);
#if FA_DROPOUT
    fa_bwd_keep_bits(kp, key0, m0 + qw0, t, fa_dropout_stream(kp, bi, h), tl->keep);
#endif
}
#endif

#endif
