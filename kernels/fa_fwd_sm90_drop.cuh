/*
 * Dropout's keep numbers made by the producer warpgroup (FA_DROP_RING, fa_fwd_sm90.cu): its
 * warps 1-3, idle otherwise (one thread issues the TMA copies), run the Philox blocks of every
 * key block of every tile into a ring of FA_DROP_SLOTS slots in shared memory, in the order the
 * consumers take the blocks (their block counter kv), so that a consumer reads a chunk's words
 * with one 16-byte load instead of running Philox and trading words in its quad
 * (fa_keep_chunk): the same numbers, off the consumers' instruction stream.
 *
 * A slot, per consumer warp (4 cw + warp), per 32-column chunk of the block, per lane: 16 bytes,
 * fa_keep_chunk's w[0..3] - word q4 = lane % 4 of row half i / 2 (rows g8 = lane / 4 and g8 + 8
 * of the warp's 16) and 16-column block 2 chunk + i % 2. mbarriers drop_full[slot] (the 96
 * producer threads arrive) and drop_empty[slot] (lane 0 of every consumer warp).
 *
 * Needs fa_fwd_sm90.cu's tile, map and FA_CONSUMER_WARPS, and fa_fwd_sm90_softmax.cuh.
 */
#ifndef FA_FWD_SM90_DROP_CUH
#define FA_FWD_SM90_DROP_CUH

#define FA_DROP_SLOTS 2
#define FA_DROP_THREADS 96 /* the producer warpgroup's warps 1-3 */
#define FA_DROP_CHUNKS ((FA_BN + 31) / 32)
#define FA_DROP_SLOT_BYTES FA_SMEM_FWD90_DROP_SLOT(FA_BM, FA_BN)

/* The byte of word i of lane `lane` of consumer warp cwarp, chunk c, in a slot. */
#define FA_DROP_AT(cwarp, c, lane, i)                                                           \
    ((((cwarp) * FA_DROP_CHUNKS + (c)) * 32 + (lane)) * 16 + 4 * (i))

/* Producer thread p (of FA_DROP_THREADS): key block n of tile w into the slot at `slot`. Each
 * (tile row, 16-column block) is one Philox run (the rule of fa_keep_chunk: block counter
 * FA_RULE_DROPOUT_BLOCK of its first column, the sequence row, the (sequence, head)'s stream),
 * whose word q goes to the lane of that row with q4 = q. */
FA_DEV void fa_drop_fill(const fa_tmaps *tm, fa_u32 slot, const fa_tile *w, int n,
                         fa_u32 stream_lo, fa_u32 stream_hi, int p)
{
    const fa_u32 blk0 = (fa_u32)FA_RULE_DROPOUT_BLOCK(n * FA_BN);
    for (int x = p; x < FA_BM * (FA_BN / 16); x += FA_DROP_THREADS) {
        const int row = x / (FA_BN / 16), cb = x - row * (FA_BN / 16);
        fa_u32 wd[4];
        fa_philox4_keys(blk0 + (fa_u32)cb, (fa_u32)(w->m0 + row), stream_lo, stream_hi,
                        tm->philox_keys, wd);
        const fa_u32 at =
            slot + FA_DROP_AT(row >> 4, cb >> 1, 4 * (row & 7), 2 * ((row >> 3) & 1) + (cb & 1));
#pragma unroll
        for (int q = 0; q < 4; q++)
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(at + 16 * q), "r"(wd[q]) : "memory");
    }
}

/* The producer warps' walk: the consumers' tiles in their order (fa_fwd's loop), each tile's
 * key blocks in fa_produce_tile's. */
FA_DEV void fa_drop_produce(const fa_kparams *kp, const fa_tmaps *tm, const fa_smem_map *m,
                            int m_blocks, int n_units)
{
    const int p = (int)threadIdx.x - 32;
    int blk = 0;
    for (int t = blockIdx.x; t < n_units; t += gridDim.x)
        for (int half = 0, hb, mb; half < 2; half++)
            if ((mb = fa_unit_tile(tm->paired, m_blocks, t, half, &hb)) >= 0) {
                const fa_tile w = fa_tile_get(kp, hb, mb);
                const fa_u64 stream = fa_dropout_stream(kp, w.bi, w.h);
                for (int it = 0; it < w.n_blocks; it++, blk++) {
                    const int s = blk % FA_DROP_SLOTS;
                    fa_mbar_wait(m->drop_empty + 8 * s, ((blk / FA_DROP_SLOTS) & 1) ^ 1);
                    fa_drop_fill(tm, m->drop + s * FA_DROP_SLOT_BYTES, &w, FA_TILE_BLOCK(&w, it),
                                 (fa_u32)stream, (fa_u32)(stream >> 32), p);
                    fa_mbar_arrive(m->drop_full + 8 * s);
                }
            }
}

/* A consumer's pack of block number blk (its kv counter) with dropout: waits for the slot,
 * packs P into the A fragment as fa_p_pack_keep does with the slot's words (one 16-byte load a
 * 32-column chunk), releases the slot. */
FA_DEV void fa_p_pack_ring(const fa_kparams *kp, const fa_smem_map *m, const float *sacc,
                           fa_u32 pa[][4], int blk, int cw)
{
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const int s = blk % FA_DROP_SLOTS;
    fa_mbar_wait(m->drop_full + 8 * s, (blk / FA_DROP_SLOTS) & 1);
    const fa_u32 at = m->drop + s * FA_DROP_SLOT_BYTES + FA_DROP_AT(4 * cw + warp, 0, lane, 0);
    const fa_u32 thr2 = fa_dropout_thr2(kp->keep_threshold);
#pragma unroll
    for (int b0 = 0; b0 < FA_BN / 16; b0 += 2) {
        fa_u32 w[4];
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                     : "r"(at + (b0 >> 1) * 32 * 16)
                     : "memory");
        fa_p_pack_words(sacc, pa, b0, FA_BN / 16 - b0 < 2 ? 1 : 2, w, thr2);
    }
    fa_stage_release(m->drop_empty + 8 * s, lane);
}

#endif /* FA_FWD_SM90_DROP_CUH */
