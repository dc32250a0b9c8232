/*
 * What the two sm_90a backward kernels (fa_bwd_sm90.cu, d = dv up to 128; fa_bwd_sm90_wide.cu,
 * wider heads and d != dv) share, included after fa_bwd_common.cuh: their tensor maps, the
 * swizzled stores of dS^T, the bulk reduce-add, the work items and their tours,
 * and the producer warpgroup's loop (TMA: K and V once per item, Q and dO per query tile).
 * The kernel defines before including it: FA_K_BYTES, FA_V_BYTES (one key block of K, of V) and
 * FA_Q_BYTES, FA_DO_BYTES (one stage's query tile of Q, of dO), all in 128-byte swizzled rows of
 * 64 columns, column blocks one after another.
 */
#ifndef FA_BWD_SM90_CUH
#define FA_BWD_SM90_CUH

/* The kernel's second parameter: tensor maps of Q, K, V, dO (src/cuda/fa_cuda_backward.c). */
typedef struct fa_bwd_tmaps {
    fa_tmap q, k, v, dout;
} fa_bwd_tmaps;

/* wgmma.wait_group.sync.aligned 1: every committed group but the newest has finished. */
FA_DEV void fa_wg_wait1(void) { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }

/* stmatrix.sync.aligned.m8n8.x4.shared.b16: stores four 8x8 matrices of 16-bit values, the
 * inverse of fa_ldmatrix_x4: lane l gives, in r[i], row l/4, elements 2(l%4) and 2(l%4)+1 of
 * matrix i (the A fragment layout), and lanes 8i..8i+7 the addresses of matrix i's 8 rows, 16
 * bytes each. */
FA_DEV void fa_stmatrix_x4(fa_u32 addr, const fa_u32 r[4])
{
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
                 "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

/* Byte offset of (row, col) in a tile of 128-byte rows (64 16-bit columns) under the 128-byte
 * swizzle: the 16-byte chunk index XOR the row's index within its 8-row atom (what TMA writes
 * and wgmma reads with layout type 1). */
FA_DEV fa_u32 fa_swz128(int row, int col)
{
    const fa_u32 byte = (fa_u32)col * 2;
    return (fa_u32)row * 128 + ((((byte >> 4) ^ (fa_u32)(row & 7)) << 4) | (byte & 15));
}

/* ld.shared.b32 / st.shared.b32 at shared address a, in order among the volatile asm of the
 * barrier operations (the load without a memory clobber: it then left the compiler free to keep
 * the tile's values in registers across it). */
FA_DEV int fa_lds32(fa_u32 a)
{
    int v;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(a));
    return v;
}

FA_DEV void fa_sts32(fa_u32 a, int v)
{
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(a), "r"(v) : "memory");
}

#if FA_VARLEN
/* A varlen item's sequence as its tour and tiles use it: its lengths, which the producer wrote
 * beside the item's slot (lens[0..1]: sq, sk), read there at each use: held in registers over
 * the item, they made ptxas spill (the dense kernel's lengths are kernel parameters, read where
 * used). */
FA_DEV fa_seq fa_item_seq(const volatile int *lens)
{
    fa_seq s;
    s.q_start = 0;
    s.k_start = 0;
    s.sq = lens[0];
    s.sk = lens[1];
    return s;
}

/* The same from the lengths' shared address (a family that keeps no generic pointer to them). */
FA_DEV fa_seq fa_item_seq_at(fa_u32 lens)
{
    fa_seq s;
    s.q_start = 0;
    s.k_start = 0;
    s.sq = fa_lds32(lens);
    s.sk = fa_lds32(lens + 4);
    return s;
}
#define FA_ITEM_SEQ fa_item_seq(lens)
#else
#define FA_ITEM_SEQ seq
#endif

/* Pins an accumulator array over a wgmma's asynchronous window. */
FA_DEV void fa_pin_acc(float *a, int n)
{
#pragma unroll
    for (int i = 0; i < n; i++)
        FA_PIN(a[i]);
}

/* cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32: adds `bytes` of fp32 at shared
 * address src to global dst, element by element, asynchronously (both 16-byte aligned). */
FA_DEV void fa_bulk_add_f32(float *dst, fa_u32 src, int bytes)
{
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}

FA_DEV void fa_bulk_commit(void) { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

/* cp.async.bulk.wait_group.read 0: this thread's bulk operations have read their sources. */
FA_DEV void fa_bulk_wait_read(void)
{
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

/* A work item: key block nb of kv head hk, sequence bi, from its index in blockIdx order (key
 * blocks fastest). Deterministic mode takes the key blocks last to first, as the sm80 family
 * does (the top of fa_bwd_sm80.cu: a tile's adds wait only for CTAs already running or done;
 * its grid is never persistent). The TMA coordinates: varlen tensor maps span the packed rows
 * (batch extent 1). */
typedef struct fa_bwd_item {
    fa_seq seq;
    int nb, hk, bi, n0, k_row0, q_row0, tma_b;
    int h0, h_end; /* the query heads of kv head hk */
} fa_bwd_item;

FA_DEV fa_bwd_item fa_bwd_item_make(const fa_bkparams *bp, int wi)
{
    /* The GQA group's query heads, h0 .. h_end - 1, divided per item: held from the kernel's
     * start, the quotient went to local memory. */
    int nh = bp->f.h;
    FA_PINU(nh);
    const int group = nh / bp->f.hk;
    fa_bwd_item im;
    int nx, grp; /* key block (in claim order) and (kv head, sequence) pair of item wi */
    if (bp->lpt_groups > 0) {
        /* Within a chunk, every pair's key block 0 (the longest under a right window edge)
         * before any pair's block 1: the long items go out first, so the grid does not end on
         * one CTA finishing a long item alone, while the pairs in flight, whose queries the
         * items share, stay few enough for L2. */
        const int chunk = wi / bp->lpt_items, idx = wi - chunk * bp->lpt_items;
        const int g0 = chunk * bp->lpt_groups;
        const int cg = fa_min(bp->lpt_groups, bp->f.hk * bp->f.b - g0);
        nx = idx / cg;
        grp = g0 + idx - nx * cg;
    } else {
        nx = wi % bp->n_tiles;
        grp = wi / bp->n_tiles;
    }
    im.nb = bp->deterministic ? bp->n_tiles - 1 - nx : nx;
    im.hk = grp % bp->f.hk;
    im.h0 = im.hk * group;
    im.h_end = im.h0 + group;
    im.bi = grp / bp->f.hk;
    im.seq = fa_bwd_seq(&bp->f, im.bi);
    im.n0 = im.nb * FA_BN;
#if FA_VARLEN
    im.k_row0 = (int)im.seq.k_start + im.n0;
    im.q_row0 = (int)im.seq.q_start;
    im.tma_b = 0;
#else
    im.k_row0 = im.n0;
    im.q_row0 = 0;
    im.tma_b = im.bi;
#endif
    return im;
}

/* Moves (h, mb) to the next query tile of an item's tour that meets key block nb (h = h_end when
 * none is left; in_run: (h, mb) is one step on from a tile that met it): the heads of the group
 * in turn, each head's tiles last to first, or first to last in deterministic mode. Under a
 * right window edge (causal) block nb meets the tiles from its diagonal on, so first to last
 * its tour starts there: the items of a kv head in flight read Q and dO, and add into dQ, over a
 * span as long as the sequence, which at 16k is tens of MB (of L2's 50). Last to first they
 * start at the same tile and go in step, as without a window edge. Deterministic mode adds each
 * tile's dQ in key-block order, which the first-to-last tours' starts at the diagonals stagger
 * by themselves. */
FA_DEV void fa_bwd_tour(const fa_bkparams *bp, const fa_seq *s, int nb, int h_end, int *h,
                        int *mb, int in_run)
{
    if (bp->deterministic)
        fa_bwd_next(bp, s, nb, h_end, h, mb);
    else
        fa_bwd_prev(bp, s, nb, h_end, h, mb, in_run);
}

/* Behind the mbarriers, from `slot` (on a 16-byte boundary: the tiles are whole KB and an even
 * number of mbarriers precede it), FA_BWD90_SLOT_INTS ints (FA_SMEM_BWD90_SLOTS): the item
 * slots [2], their lengths [2][2], 2 unused, then a record per Q/dO stage of the tile the
 * producer loads there, {the tour's next tile: h, mb (FA_BWD90_REC_END past its end); the
 * tile's block-mask state; unused}, written before the stage's q_full arrival, read by the
 * consumers after its wait: their tours are the producer's, walked once. */
#define FA_BWD90_REC_END (-1)
/* The item slot's value once the CTA's items are done: the consumers stop there. */
#define FA_BWD90_NO_ITEM (-1)
#define FA_BWD90_SLOT_INTS (FA_SMEM_BWD90_SLOTS(FA_QSTAGES) / 4)
/* Field f of stage qs's record, a shared address from the slots' (slot_s): 32 bits where a
 * generic pointer held over the consumers' loop took two registers more, and ptxas spilled. */
#define FA_BWD90_REC(slot_s, qs, f) ((slot_s) + FA_SMEM_BWD90_SLOTS(qs) + 4 * (f))

#if FA_BLOCK_MASK
/* The block mask's view of the CTA's item in hand (fa_bwd_bm, fa_bwd_mod.cuh) sits behind the
 * slots, its states after it: bp->bm_stride bytes (the launcher adds them), copied by the
 * producer with the item's K and V from bp->bm_tabs. */
#define FA_BWD90_BM_META(slot) ((slot) + FA_BWD90_SLOT_INTS)

/* The workspace table of key block nb of kv head hk, sequence bi (FA_BM_TABLE_KV_HEADS): its
 * bp->bm_stride bytes. */
FA_DEV const unsigned char *fa_bwd90_bm_table(const fa_bkparams *bp, int nb, int hk, int bi)
{
    const int th = FA_BM_TABLE_KV_HEADS(&bp->f);
    return bp->bm_tabs +
           ((fa_i64)(bi * th + (th > 1 ? hk : 0)) * bp->n_tiles + nb) * bp->bm_stride;
}

/* One CTA (FA_THREADS threads) per table (fa_bwd90_bm_table), before fa_bwd: the states of its
 * key block over every query block of its heads, its view ahead of them (fa_bwd_bm_put), and
 * the live bits. A table shared by every kv head names kv head 0's heads: with one table head
 * fa_bwd_bm_head and fa_bwd_bm_live ignore them. */
extern "C" __global__ void __launch_bounds__(FA_THREADS, 1) fa_bwd_bm_tables(const fa_bkparams bp)
{
    const fa_kparams *kp = &bp.f;
    const int th = FA_BM_TABLE_KV_HEADS(kp), nb = blockIdx.x % bp.n_tiles;
    const int hk = blockIdx.x / bp.n_tiles % th, bi = blockIdx.x / bp.n_tiles / th;
    volatile int *const meta = (volatile int *)fa_bwd90_bm_table(&bp, nb, hk, bi);
    const fa_seq seq = fa_bwd_seq(kp, bi);
    const int group = kp->h / kp->hk;
    const fa_bwd_bm bmv = fa_bwd_bm_fill(kp, meta, bi, &seq, hk * group, group, nb * FA_BN);
    fa_bwd_bm_live_make(&bmv);
}

/* fa_bwd_tour past the query tiles the block mask skips whole (meta: FA_BWD90_BM_META), by the
 * live bits (fa_bwd_bm_live): from a skipped tile straight to the tile of the next live query
 * block below, or past the head's first tile. Not in deterministic mode, whose dQ order
 * (fa_bwd_later) counts every tile that meets the key block: there they are visited, every key
 * masked. A skipped tile met the block, so the tile reached continues the run. */
FA_DEV void fa_bwd_tour_bm(const fa_bkparams *bp, const fa_seq *s, int nb, int h_end, int *h,
                           int *mb, int in_run, const volatile int *meta)
{
    if (bp->deterministic) {
        fa_bwd_next(bp, s, nb, h_end, h, mb);
        return;
    }
    const fa_bwd_bm view = fa_bwd_bm_get(meta);
    const int qs = bp->f.bm_q_block;
    for (;;) {
        fa_bwd_prev(bp, s, nb, h_end, h, mb, in_run);
        if (*h >= h_end)
            return;
        const int m0 = *mb * FA_BM, qlo = m0 / qs, qhi = (fa_min(m0 + FA_BM, s->sq) - 1) / qs;
        const int l = fa_bwd_bm_live_below(fa_bwd_bm_live(&view, *h), qhi);
        if (l >= qlo)
            return;
        *mb = l < 0 ? -1 : (fa_min((l + 1) * qs, s->sq) - 1) / FA_BM;
        in_run = 1;
    }
}
/* The producer walks the tours, the consumers an item's first step: `slot` is in scope at both. */
#define FA_BWD_TOUR(bp, s, nb, h_end, h, mb, in_run)                                              \
    fa_bwd_tour_bm(bp, s, nb, h_end, h, mb, in_run, FA_BWD90_BM_META(slot))
#else
#define FA_BWD_TOUR fa_bwd_tour
#endif

/* Column blocks of 64 of the wider of K and V (and of Q and dO). */
#define FA_BWD90_CBLKS ((FA_DP > FA_DVP ? FA_DP : FA_DVP) / 64)

/* The producer warpgroup's thread 0 over the CTA's work items (from `first`, then claimed from
 * bp->sched on a persistent grid): K and V of each item into k_s, v_s once the consumers
 * released the previous item's (kv_empty), its index into slot[ii % 2] (varlen: its lengths
 * beside, FA_ITEM_SEQ), then Q and dO of each query tile its tour meets into the FA_QSTAGES
 * stages at q_s, do_s (q_full / q_empty, 8 bytes apart), each with its record (FA_BWD90_REC);
 * FA_BWD90_NO_ITEM tells the consumers to stop. */
FA_DEV void fa_bwd90_produce(const fa_bkparams *bp, const fa_bwd_tmaps *tm, fa_u32 k_s,
                             fa_u32 v_s, fa_u32 q_s, fa_u32 do_s, fa_u32 kv_full,
                             fa_u32 kv_empty, fa_u32 q_full, fa_u32 q_empty, volatile int *slot,
                             int first, int n_items, int mb_first, int mb_step)
{
    int ii = 0;          /* items so far */
    int qs = 0, qph = 0; /* the next tile's Q/dO stage and that stage's phase */
    for (int wi = first;; ii++) {
        /* The previous item's K and V released by every consumer warp (a fresh barrier's
         * phase "-1" counts as done), so its slot's last reader is done too. */
        fa_mbar_wait(kv_empty, (ii & 1) ^ 1);
        slot[ii & 1] = wi >= n_items ? FA_BWD90_NO_ITEM : wi;
        if (wi >= n_items) {
            fa_mbar_arrive(kv_full); /* no item: the consumers stop */
            break;
        }
        const fa_bwd_item im = fa_bwd_item_make(bp, wi);
        const int h_end = im.h_end;
#if FA_VARLEN
        volatile int *lens = slot + 2 + 2 * (ii & 1);
        lens[0] = im.seq.sq;
        lens[1] = im.seq.sk;
#else
        const fa_seq seq = im.seq;
#endif
#if FA_BLOCK_MASK
        /* The item's block-mask states with its K and V, into the one buffer: the consumers
         * released it with K and V (kv_empty). */
        fa_mbar_expect_tx(kv_full, FA_K_BYTES + FA_V_BYTES + bp->bm_stride);
        fa_bulk_load(fa_smem_addr((const void *)FA_BWD90_BM_META(slot)),
                     fa_bwd90_bm_table(bp, im.nb, im.hk, im.bi), bp->bm_stride, kv_full);
#else
        fa_mbar_expect_tx(kv_full, FA_K_BYTES + FA_V_BYTES);
#endif
#pragma unroll
        for (int c = 0; c < FA_BWD90_CBLKS; c++) {
            if (c < FA_DP / 64)
                fa_tma_load4(k_s + c * FA_BN * 128, &tm->k, 64 * c, im.k_row0, im.hk, im.tma_b,
                             kv_full);
            if (c < FA_DVP / 64)
                fa_tma_load4(v_s + c * FA_BN * 128, &tm->v, 64 * c, im.k_row0, im.hk, im.tma_b,
                             kv_full);
        }
#if FA_BLOCK_MASK
        fa_mbar_wait(kv_full, ii & 1); /* the tour reads the states */
#endif
        int h = im.h0, mb = mb_first;
        const fa_seq sv_first = FA_ITEM_SEQ;
        FA_BWD_TOUR(bp, &sv_first, im.nb, h_end, &h, &mb, 0);
        for (; h < h_end;) {
            /* Stage qs's previous tile released (its record read). The stage's bytes expected
             * first, its one arrival after the record is written. */
            fa_mbar_wait(q_empty + 8 * qs, qph ^ 1);
            fa_mbar_expect_tx_only(q_full + 8 * qs, FA_Q_BYTES + FA_DO_BYTES);
#pragma unroll
            for (int c = 0; c < FA_BWD90_CBLKS; c++) {
                if (c < FA_DP / 64)
                    fa_tma_load4(q_s + qs * FA_Q_BYTES + c * FA_BM * 128, &tm->q, 64 * c,
                                 im.q_row0 + mb * FA_BM, h, im.tma_b, q_full + 8 * qs);
                if (c < FA_DVP / 64)
                    fa_tma_load4(do_s + qs * FA_DO_BYTES + c * FA_BM * 128, &tm->dout, 64 * c,
                                 im.q_row0 + mb * FA_BM, h, im.tma_b, q_full + 8 * qs);
            }
            const fa_u32 slot_s = kv_empty + 8;
            const fa_seq sv = FA_ITEM_SEQ;
#if FA_BLOCK_MASK
            {
                const fa_bwd_bm bm = fa_bwd_bm_get(FA_BWD90_BM_META(slot));
                fa_sts32(FA_BWD90_REC(slot_s, qs, 2), fa_bwd_bm_state(&bp->f, &bm, h, mb, sv.sq));
            }
#endif
            /* The tour's next tile into the record while the copies run, then the arrival. */
            mb += mb_step;
            FA_BWD_TOUR(bp, &sv, im.nb, h_end, &h, &mb, 1);
            fa_sts32(FA_BWD90_REC(slot_s, qs, 0), h);
            fa_sts32(FA_BWD90_REC(slot_s, qs, 1), h < h_end ? mb : FA_BWD90_REC_END);
            fa_mbar_arrive(q_full + 8 * qs);
            if (++qs == FA_QSTAGES)
                qs = 0, qph ^= 1;
        }
#if FA_VARLEN
        break; /* one item per CTA (varlen grids are never persistent) */
#endif
        wi = bp->persistent ? (int)gridDim.x + atomicAdd(bp->sched, 1) : n_items;
    }
}

/* The start of both sm90 backward kernels, past their shared-memory maps: a varlen CTA whose key
 * block is at or past its sequence's keys only zeroes its dK and dV; thread 0 initialises the
 * barriers; the producer warpgroup gives its registers back and its thread 0 loads the tiles
 * (fa_bwd90_produce: work items from `first`, the CTA's own, of n_items). Returns 1 in the
 * consumer threads, registers raised; 0 in the others, which are done. */
FA_DEV int fa_bwd90_start(const fa_bkparams *bp, const fa_bwd_tmaps *tm, fa_u32 k_s, fa_u32 v_s,
                          fa_u32 q_s, fa_u32 do_s, fa_u32 kv_full, fa_u32 kv_empty,
                          fa_u32 q_full, fa_u32 q_empty, volatile int *slot, int first,
                          int n_items)
{
#if FA_VARLEN
    /* Varlen grids are never persistent. */
    {
        const fa_bwd_item im = fa_bwd_item_make(bp, first);
        if (im.n0 >= im.seq.sk) {
            fa_bwd_block_zero(bp, &im.seq, im.bi, im.hk, im.n0);
            return 0;
        }
    }
#endif
    if (threadIdx.x == 0) {
        fa_mbar_init(kv_full, 1);
        fa_mbar_init(kv_empty, 4 * FA_NCW); /* lane 0 of each consumer warp */
        for (int s = 0; s < FA_QSTAGES; s++) {
            fa_mbar_init(q_full + 8 * s, 1);
            fa_mbar_init(q_empty + 8 * s, 128 * FA_NCW); /* every consumer thread */
        }
        fa_mbar_init_fence();
    }
    __syncthreads();
    if (threadIdx.x < 128) {
        fa_regs_producer();
        /* The tours (fa_bwd_tour) start at the last query tile and step back, or in the
         * deterministic mode at the first and step on. */
        if (threadIdx.x == 0)
            fa_bwd90_produce(bp, tm, k_s, v_s, q_s, do_s, kv_full, kv_empty, q_full, q_empty,
                             slot, first, n_items, bp->deterministic ? 0 : bp->m_tiles - 1,
                             bp->deterministic ? 1 : -1);
        return 0;
    }
    fa_regs_consumer();
    return 1;
}

#endif /* FA_BWD_SM90_CUH */
