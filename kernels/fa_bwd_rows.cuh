/*
 * The backward's kernels around the main one (each family's module, fa_bwd_sm80.cu and
 * fa_bwd_sm90.cu, includes this file after its helpers, so one module holds them all):
 * fa_bwd_pre before it, per query tile (D, lse in base 2, the dQ accumulator zeroed), and after it
 * fa_bwd_dsinks, fa_bwd_convert, and, for varlen, fa_bwd_fill for the rows outside every
 * sequence; fa_bwd_aux_zero before it where the mods' captured tensors get gradients. Each works row by row; none uses tensor cores.
 */
#ifndef FA_BWD_ROWS_CUH
#define FA_BWD_ROWS_CUH

/* Lanes that share one row of D's dot product, a power of two: each reads 8 elements (16
 * bytes) of dO and O at a time, so a warp covers 32 / FA_PRE_LANES rows at once. One row per
 * warp at two bytes a lane kept too few loads in flight for DRAM's latency (half its bandwidth
 * at head dim 64). */
#define FA_PRE_LANES (FA_DVP <= 64 ? 8 : FA_DVP <= 128 ? 16 : 32)
#define FA_PRE_ROWS (32 / FA_PRE_LANES) /* rows per warp at a time */

/* Grid (m_tiles, h, b), FA_THREADS threads: for the FA_BM rows of query tile mb, D and
 * lse * log2(e) (0 and +inf on padded rows), FA_PRE_ROWS rows per warp at a time; zeroes the
 * tile's block of the dQ accumulator and its ordering counter (and the first CTA the
 * persistent grid's item counter). A varlen tile past its sequence is
 * left alone: no later kernel reads it (fa_bwd visits only tiles that meet a key block,
 * fa_bwd_dsinks and fa_bwd_convert only the sequence's rows and tiles). */
extern "C" __global__ void __launch_bounds__(FA_THREADS) fa_bwd_pre(const fa_bkparams bp)
{
    const fa_kparams *kp = &bp.f;
    const int mb = blockIdx.x, h = blockIdx.y, bi = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = lane / FA_PRE_LANES, part = lane % FA_PRE_LANES;
    const int m0 = mb * FA_BM;
    const fa_seq seq = fa_bwd_seq(kp, bi);
    const int sq = seq.sq, dv = kp->dv;
    if (bp.persistent && mb == 0 && h == 0 && bi == 0 && threadIdx.x == 0)
        *bp.sched = 0;
#if FA_VARLEN
    if (m0 >= sq)
        return;
#endif
    const fa_i64 r0 = fa_bwd_row0(&bp, h, bi) + m0;
    if (threadIdx.x == 0)
        *fa_bwd_sem(&bp, bi, h, mb) = 0;
    float4 *acc = (float4 *)(bp.dq_accum + r0 * FA_DP);
    for (int i = threadIdx.x; i < FA_BM * FA_DP / 4; i += FA_THREADS)
        acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    /* Warp-uniform trip count (the shuffles below take the whole warp); FA_BM is a multiple of
     * FA_PRE_ROWS, so every lane's row r is inside the tile. */
    for (int rw = warp * FA_PRE_ROWS; rw < FA_BM; rw += FA_NWARPS * FA_PRE_ROWS) {
        const int r = rw + sub, row = m0 + r;
        float s = 0.f, lse2 = FA_INF;
        if (row < sq) {
            const fa_u16 *dor = (const fa_u16 *)bp.dout + bi * bp.do_bstride +
                                (seq.q_start + row) * bp.do_rstride + h * bp.do_hstride;
            const fa_u16 *orow = (const fa_u16 *)kp->out + bi * kp->o_bstride +
                                 (seq.q_start + row) * kp->o_rstride + h * kp->o_hstride;
            if (dv % 8 == 0 && (((fa_u64)dor | (fa_u64)orow) & 15) == 0) {
                for (int c = 8 * part; c < dv; c += 8 * FA_PRE_LANES) {
                    const uint4 x = *(const uint4 *)(dor + c), y = *(const uint4 *)(orow + c);
                    const fa_u32 xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        s += fa_to_float((fa_u16)xs[j]) * fa_to_float((fa_u16)ys[j]);
                        s += fa_to_float((fa_u16)(xs[j] >> 16)) *
                             fa_to_float((fa_u16)(ys[j] >> 16));
                    }
                }
            } else {
                for (int c = part; c < dv; c += FA_PRE_LANES)
                    s += fa_to_float(dor[c]) * fa_to_float(orow[c]);
            }
            /* lse is [b, h, sq] dense, [h, total_q] varlen (lse_bstride 0), as the forward. */
            lse2 = kp->lse[bi * kp->lse_bstride + h * kp->lse_hstride +
                           (FA_VARLEN ? seq.q_start + row : row) * kp->lse_rstride] *
                   FA_LOG2E;
        }
#pragma unroll
        for (int sh = FA_PRE_LANES / 2; sh > 0; sh >>= 1)
            s += __shfl_xor_sync(0xffffffffu, s, sh);
        if (part == 0) {
            bp.dsum[r0 + r] = s;
            bp.lse2[r0 + r] = lse2;
        }
    }
}

/* Grid (h), 256 threads: d_sink[h] = -sum over (sequence, row) of exp(sink - lse) * D, each
 * thread a fixed stride of the rows (varlen: of each sequence's rows in turn), then a fixed tree:
 * bitwise reproducible. */
extern "C" __global__ void __launch_bounds__(256) fa_bwd_dsinks(const fa_bkparams bp)
{
    const fa_kparams *kp = &bp.f;
    __shared__ float part[256];
    const int h = blockIdx.x;
    const float sink = kp->sinks[h * kp->sinks_stride];
    float s = 0.f;
#if FA_VARLEN
    for (int bi = 0; bi < kp->b; bi++) {
        const fa_seq seq = fa_bwd_seq(kp, bi);
        const float *dsum = bp.dsum + fa_bwd_row0(&bp, h, bi);
        for (int row = threadIdx.x; row < seq.sq; row += 256) {
            const float lse = kp->lse[h * kp->lse_hstride + (seq.q_start + row) * kp->lse_rstride];
            s -= FA_RULE_SINK_GRAD(sink, lse, dsum[row], expf);
        }
    }
#else
    const fa_i64 n = (fa_i64)kp->b * kp->max_sq;
    for (fa_i64 x = threadIdx.x; x < n; x += 256) {
        const int bi = (int)(x / kp->max_sq), row = (int)(x - (fa_i64)bi * kp->max_sq);
        const float lse = kp->lse[bi * kp->lse_bstride + h * kp->lse_hstride + row * kp->lse_rstride];
        s -= FA_RULE_SINK_GRAD(sink, lse, bp.dsum[fa_bwd_row0(&bp, h, bi) + row], expf);
    }
#endif
    part[threadIdx.x] = s;
    __syncthreads();
    for (int w = 128; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w)
            part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        bp.dsinks[h * bp.dsinks_stride] = part[0];
}

/* Row g + 8 * hf, columns 0..7, of a 16 x 8 accumulator block from the four float4s lane (g, t)
 * of fa_bwd_convert read. The main kernels add a C fragment's values (lane (g, t): rows g, g + 8,
 * columns 2t, 2t + 1) at block offsets 4 * lane + {0..3} with sm_90's vector reductions,
 * 32 * {0..3} + lane without: float4 j is lane (g, j)'s four values in the first layout, and
 * element j of lanes (g, 0..3) in the second. */
FA_DEV void fa_bwd_acc_row(const float4 x[4], int hf, float v[8])
{
#pragma unroll
    for (int j = 0; j < 4; j++) {
#if FA_RED_V4
        v[2 * j] = hf ? x[j].z : x[j].x;
        v[2 * j + 1] = hf ? x[j].w : x[j].y;
#else
        const float4 lo = x[2 * hf], hi = x[2 * hf + 1];
        const float a[4] = {lo.x, lo.y, lo.z, lo.w}, b[4] = {hi.x, hi.y, hi.z, hi.w};
        v[2 * j] = a[j];
        v[2 * j + 1] = b[j];
#endif
    }
}

/* Grid (x, h, b), 256 threads: dq = dtype(scale * accumulator) for one (head, sequence), each
 * warp one 16 x 32 stripe of the accumulator (four consecutive 16 x 8 blocks) at a time, rows past
 * the sequence and columns past d skipped (varlen: only the sequence's own tiles, the rest of its
 * m_tiles were never written). Lane (g, t) takes rows g and g + 8 of block t whole: the 64
 * contiguous bytes that hold them in either accumulator layout (fa_bwd_acc_row), stored as 16
 * bytes per row: fewer, wider stores than a lane storing 4 bytes per row. */
extern "C" __global__ void __launch_bounds__(256) fa_bwd_convert(const fa_bkparams bp)
{
    const fa_kparams *kp = &bp.f;
    const int h = blockIdx.y, bi = blockIdx.z;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const fa_seq seq = fa_bwd_seq(kp, bi);
    const int tiles = FA_VARLEN ? (seq.sq + FA_BM - 1) / FA_BM : bp.m_tiles;
    const int stripes = tiles * (FA_BM / 16) * (FA_DP / 32);
    const int rows = FA_VARLEN ? seq.sq : kp->max_sq;
    const float *acc = bp.dq_accum + fa_bwd_row0(&bp, h, bi) * FA_DP;
    fa_u16 *dqb = (fa_u16 *)bp.dq + bi * bp.dq_bstride + seq.q_start * bp.dq_rstride +
                  h * bp.dq_hstride;
    for (int sp = blockIdx.x * 8 + (threadIdx.x >> 5); sp < stripes; sp += gridDim.x * 8) {
        const int r16 = sp / (FA_DP / 32), c8 = (sp - r16 * (FA_DP / 32)) * 4 + t;
        const float4 *src = (const float4 *)(acc + ((fa_i64)r16 * (FA_DP / 8) + c8) * 128);
        float4 x[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            x[j] = src[FA_RED_V4 ? 4 * g + j : 8 * j + g];
        const int col = c8 * 8;
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int row = r16 * 16 + g + 8 * hf;
            if (row >= rows || col >= kp->d)
                continue;
            float v[8];
            fa_bwd_acc_row(x, hf, v);
            fa_u16 *out = dqb + (fa_i64)row * bp.dq_rstride + col;
#if FA_VEC
            *(uint4 *)out = make_uint4(fa_pack2(v[0] * kp->scale, v[1] * kp->scale),
                                       fa_pack2(v[2] * kp->scale, v[3] * kp->scale),
                                       fa_pack2(v[4] * kp->scale, v[5] * kp->scale),
                                       fa_pack2(v[6] * kp->scale, v[7] * kp->scale));
#else
            for (int c = 0; c < 8 && col + c < kp->d; c++)
                out[c] = fa_from_float(v[c] * kp->scale);
#endif
        }
    }
}

#if FA_VARLEN
/* Grid (x), 256 threads, each a stride of the (row, head) pairs: zero dq on the rows of q, and
 * dk, dv on those of k, outside every sequence (before cu_seqlens[0] or from cu_seqlens[b] on:
 * the CPU backward's rule, and fa_fill_outside's for the forward). The grid may be capped below
 * the pairs' count, hence the stride. */
extern "C" __global__ void __launch_bounds__(256) fa_bwd_fill(const fa_bkparams bp)
{
    const fa_kparams *kp = &bp.f;
    const fa_i64 nq = kp->total_q * kp->h, nk = kp->total_k * kp->hk;
    const fa_i64 n = nq > nk ? nq : nk;
    for (fa_i64 i = (fa_i64)blockIdx.x * 256 + threadIdx.x; i < n; i += (fa_i64)gridDim.x * 256) {
        if (i < nq) {
            const fa_i64 r = i / kp->h;
            const int h = (int)(i - r * kp->h);
            if (r < kp->cu_seqlens_q[0] || r >= kp->cu_seqlens_q[kp->b])
                fa_bwd_zero((fa_u16 *)bp.dq + r * bp.dq_rstride + h * bp.dq_hstride, 0, 1, kp->d,
                            0, 1);
        }
        if (i < nk) {
            const fa_i64 r = i / kp->hk;
            const int h = (int)(i - r * kp->hk);
            if (r < kp->cu_seqlens_k[0] || r >= kp->cu_seqlens_k[kp->b]) {
                fa_bwd_zero((fa_u16 *)bp.dk + r * bp.dk_rstride + h * bp.dk_hstride, 0, 1, kp->d,
                            0, 1);
                fa_bwd_zero((fa_u16 *)bp.dv + r * bp.dv_rstride + h * bp.dv_hstride, 0, 1, kp->dv,
                            0, 1);
            }
        }
    }
}
#endif

#if FA_SCORE_MOD && FA_MOD_AUX_GRAD
/* Zeroes the captured tensors' gradients the plan's FA_MOD_AUX_GRAD gives (any strides;
 * dimensions past a tensor's own are 1), before fa_bwd adds into them (fa_mod_aux_grad_add).
 * A grid-stride loop over each one's elements, 256 threads a CTA. */
extern "C" __global__ void __launch_bounds__(256) fa_bwd_aux_zero(const fa_bkparams bp)
{
    const fa_kparams *kp = &bp.f;
#pragma unroll 1
    for (int s = 0; s < 4; s++) {
        if (!((FA_MOD_AUX_GRAD >> s) & 1))
            continue;
        const fa_i64 *n = kp->mod_aux_shape[s], *st = kp->mod_aux_grad_stride[s];
        const fa_i64 total = n[0] * n[1] * n[2] * n[3];
        for (fa_i64 i = (fa_i64)blockIdx.x * 256 + threadIdx.x; i < total;
             i += (fa_i64)gridDim.x * 256) {
            fa_i64 r = i, off = 0;
            for (int d = 3; d >= 0; d--) {
                const fa_i64 q = r / n[d];
                off += (r - q * n[d]) * st[d];
                r = q;
            }
            kp->mod_aux_grad[s][off] = 0.f;
        }
    }
}
#endif

#endif /* FA_BWD_ROWS_CUH */
