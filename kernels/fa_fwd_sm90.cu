/*
 * Forward attention for sm_90a (Hopper): FlashAttention-3's building blocks in CUDA C with inline
 * PTX. First increment of issue 6: warp-specialised, TMA-fed, wgmma-computed, not yet overlapped.
 *
 * One CTA computes FA_BM = 128 query rows of one (sequence, head) with 3 warpgroups:
 *   warpgroup 0, the producer: gives its registers back (setmaxnreg.dec 24); one thread issues
 *     every TMA copy (cp.async.bulk.tensor) - Q once, then K and V of each key block into a ring
 *     of FA_STAGES shared-memory stages - each completing on an mbarrier with a byte count;
 *   warpgroups 1 and 2, the consumers (setmaxnreg.inc 240): 64 query rows each. Per key block:
 *     S = Q K^T with wgmma.mma_async (both operands in shared memory, by descriptor), mask, online
 *     softmax in base 2 with scale * log2(e) folded into the FFMA in front of each exp2, P converted
 *     in registers to the A fragment, O += P V with the register-A form of wgmma (V by descriptor,
 *     MN-major), then the stage is released to the producer on its "empty" mbarrier.
 * Keys are visited from the last visible block to the first (masked blocks first), as in sm80.
 * Epilogue: O / l and lse straight from the accumulator registers; rows with no visible key and no
 * sink give 0 and lse +inf (the sm80 family's rule).
 *
 * Shared memory (from a 1024-byte aligned base, as the 128-byte swizzle requires):
 *   Q [FA_DP/64 column blocks][FA_BM rows][128 B]
 *   K [FA_STAGES][FA_DP/64][FA_BN rows][128 B]
 *   V [FA_STAGES][FA_DVP/64][FA_BN rows][128 B]
 *   mbarriers: q_full, k_full[S], v_full[S], empty[S]
 * Each [rows][128 B] block is the canonical 128B-swizzled layout: 16-byte chunk c of row r sits at
 * chunk c ^ (r % 8). TMA with CU_TENSOR_MAP_SWIZZLE_128B and a 64-element inner box writes exactly
 * that, and the wgmma descriptors with layout type 1 (128B swizzle) read exactly that.
 *
 * Tensor maps (built on the host by cuTensorMapEncodeTiled, src/cuda/fa_cuda_forward.c): rank 4,
 * dims {d, rows, heads, batch} innermost first, box {64, FA_BM or FA_BN, 1, 1}, bf16/fp16, 128B
 * swizzle, out-of-bounds rows zero-filled (so a partial last block reads zeros, never the next
 * head); passed by value as a __grid_constant__ parameter.
 *
 * Defines from the plan (src/plan/fa_plan.c): FA_BF16, FA_DP = FA_DVP (64 or 128), FA_BM (128),
 * FA_BN (128), FA_STAGES. Features not compiled here (varlen, ALiBi, softcap, dropout, probs,
 * unaligned rows, other head dims) are routed to the sm80 family by the plan.
 * Entry point: fa_fwd(kp, tensor maps).
 */
#include "fa_common.cuh"

#define FA_WG_THREADS 128
#define FA_THREADS (3 * FA_WG_THREADS)
#define FA_KB (FA_DP / 64)  /* 64-column (128-byte) blocks of a Q or K row */
#define FA_VB (FA_DVP / 64) /* of a V row */
#define FA_Q_BYTES (FA_BM * FA_DP * 2)
#define FA_K_BYTES (FA_BN * FA_DP * 2)
#define FA_V_BYTES (FA_BN * FA_DVP * 2)
#define FA_SACC (FA_BN / 2)  /* S accumulator registers per thread (m64 x FA_BN fp32) */
#define FA_OACC (FA_DVP / 2) /* O accumulator registers per thread */

#if FA_BM != 128 || FA_BN != 128 || (FA_DP != 64 && FA_DP != 128) || FA_DVP != FA_DP
#error "fa_fwd_sm90.cu: this increment compiles BM = BN = 128 and d = dv in {64, 128}"
#endif

/* The kernel's second parameter: three CUtensorMap images (128 bytes, 64-byte aligned each), the
 * same layout as fa_cuda_tmaps on the host. */
typedef struct __align__(64) fa_tmap {
    fa_u64 w[16];
} fa_tmap;
typedef struct fa_tmaps {
    fa_tmap q, k, v;
} fa_tmaps;

/* ---- mbarriers ------------------------------------------------------------------------------ */

/* mbarrier.init.shared::cta.b64: the barrier at `bar` expects `count` arrivals per phase. */
FA_DEV void fa_mbar_init(fa_u32 bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

/* fence.mbarrier_init.release.cluster: makes the inits visible to the async proxy (TMA) and the
 * other threads before they use the barriers (followed by __syncthreads). */
FA_DEV void fa_mbar_init_fence(void)
{
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

/* mbarrier.arrive.expect_tx: one arrival plus `bytes` of transactions the phase now waits for
 * (the TMA copies completing on this barrier count them down). */
FA_DEV void fa_mbar_expect_tx(fa_u32 bar, int bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}

/* mbarrier.arrive: one plain arrival (consumers releasing a stage). */
FA_DEV void fa_mbar_arrive(fa_u32 bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

/* mbarrier.try_wait.parity: true once the phase of parity `parity` has completed (a fresh barrier
 * counts its phase "-1", of parity 1, as completed). May time out, hence the loop. */
FA_DEV void fa_mbar_wait(fa_u32 bar, int parity)
{
    fa_u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
                     "selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}

/* ---- TMA ------------------------------------------------------------------------------------ */

/* cp.async.bulk.tensor.4d ... tile.mbarrier::complete_tx::bytes: the box of the tensor map at
 * `tmap` (generic address of the __grid_constant__ parameter) whose first element has coordinates
 * {c0, c1, c2, c3} (innermost first, elements) lands at shared address dst, swizzled as the map
 * says; its bytes complete on mbarrier `bar`. Out-of-bounds elements are written as zeros. */
FA_DEV void fa_tma_load4(fa_u32 dst, const fa_tmap *tmap, int c0, int c1, int c2, int c3,
                         fa_u32 bar)
{
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(dst),
                 "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
                 : "memory");
}

/* prefetch.tensormap: pulls the tensor map into the descriptor cache ahead of the first copy. */
FA_DEV void fa_tma_prefetch(const fa_tmap *tmap)
{
    asm volatile("prefetch.tensormap [%0];" ::"l"(tmap) : "memory");
}

/* ---- wgmma ---------------------------------------------------------------------------------- */

/*
 * Shared-memory matrix descriptor (64 bits): start address >> 4 in bits 0-13, leading byte offset
 * >> 4 in 16-29, stride byte offset >> 4 in 32-45, base offset 0 (every swizzle atom of ours is
 * 1024-byte aligned), layout type in 62-63 (1 = 128-byte swizzle).
 *   K-major operand (Q as A, K as B of S = Q K^T; rows of 128 bytes, K contiguous): SBO = 1024
 *     (the next group of 8 rows), LBO unused by the swizzled K-major form (16); one k16 step is
 *     +32 bytes inside the 128-byte row, 4 steps then the next 64-column block.
 *   MN-major operand (V as B of O = P V; key rows, d contiguous): LBO = FA_BN * 128 (the next
 *     64-column block of d), SBO = 1024 (the next 8 keys); one k16 step is +2048 bytes.
 */
FA_DEV fa_u64 fa_desc(fa_u32 addr, fa_u32 lbo, fa_u32 sbo)
{
    return (fa_u64)((addr & 0x3FFFFu) >> 4) | ((fa_u64)(lbo >> 4) << 16) |
           ((fa_u64)(sbo >> 4) << 32) | (1ull << 62);
}

/* wgmma.fence.sync.aligned: orders this warpgroup's register writes (accumulators, A fragments)
 * before the wgmma.mma_async that read them. */
FA_DEV void fa_wg_fence(void) { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

/* wgmma.commit_group.sync.aligned: closes the group of wgmma issued so far. */
FA_DEV void fa_wg_commit(void) { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

/* wgmma.wait_group.sync.aligned 0: waits until every committed group has finished (accumulators
 * written, shared operands read). */
FA_DEV void fa_wg_wait0(void) { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

/* Pins a register across the asynchronous window: the compiler may not move its reads or writes
 * over this point (the wgmma asm blocks do not name the in-flight registers after the issue). */
#define FA_PIN(x) asm volatile("" : "+f"(x)::"memory")

#if FA_BF16
#define FA_WG_TYPES ".f32.bf16.bf16"
#else
#define FA_WG_TYPES ".f32.f16.f16"
#endif

#define FA_R32                                                                                   \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define FA_R64                                                                                   \
    FA_R32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
           "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define FA_F8(a, i)                                                                              \
    "+f"(a[i]), "+f"(a[i + 1]), "+f"(a[i + 2]), "+f"(a[i + 3]), "+f"(a[i + 4]), "+f"(a[i + 5]),  \
        "+f"(a[i + 6]), "+f"(a[i + 7])
#define FA_F32(a) FA_F8(a, 0), FA_F8(a, 8), FA_F8(a, 16), FA_F8(a, 24)
#define FA_F64(a) FA_F32(a), FA_F8(a, 32), FA_F8(a, 40), FA_F8(a, 48), FA_F8(a, 56)

/*
 * d (+)= A B, m64n128k16, both operands in shared memory (SS form):
 *   wgmma.mma_async.sync.aligned.m64n128k16.f32.{bf16,f16}x2 {d0..d63}, descA, descB, p, 1, 1, 0, 0
 * p = scale-d (0: d = A B, 1: d += A B); scale-a = scale-b = 1; transpose-a = transpose-b = 0 (both
 * K-major). d is the m64n128 fp32 accumulator: thread t (warp w = t/32, lane l) holds in d[j] the
 * element (row 16w + l/4 + 8((j>>1)&1), col 8(j>>2) + 2(l%4) + (j&1)).
 */
FA_DEV void fa_wgmma_ss_n128(float d[64], fa_u64 da, fa_u64 db, int accumulate)
{
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16" FA_WG_TYPES " {" FA_R64 "}, %64, %65, "
                 "p, 1, 1, 0, 0; }"
                 : FA_F64(d)
                 : "l"(da), "l"(db), "r"(accumulate));
}

/*
 * d += A B, m64nNk16 with A from registers (RS form):
 *   wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}x2 {d..}, {a0, a1, a2, a3}, descB, p, 1, 1, 1
 * A fragment (K-major, 16-bit pairs, lower column in the low half): with r = 16w + l/4, q = l%4:
 * a0 = (row r, cols 2q, 2q+1), a1 = (row r+8, same cols), a2 = (row r, cols 8+2q, 9+2q),
 * a3 = (row r+8, cols 8+2q, 9+2q) - the accumulator's own pattern, so P needs no shuffle.
 * The last immediate, transpose-b = 1: B (V) is MN-major in shared memory.
 */
#if FA_DVP == 128
FA_DEV void fa_wgmma_rs_n128(float d[64], const fa_u32 a[4], fa_u64 db)
{
    asm volatile("{ .reg .pred p; setp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16" FA_WG_TYPES " {" FA_R64 "}, "
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 1; }"
                 : FA_F64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

#else
FA_DEV void fa_wgmma_rs_n64(float d[32], const fa_u32 a[4], fa_u64 db)
{
    asm volatile("{ .reg .pred p; setp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16" FA_WG_TYPES " {" FA_R32 "}, "
                 "{%32, %33, %34, %35}, %36, p, 1, 1, 1; }"
                 : FA_F32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
#endif

/* setmaxnreg.{dec,inc}.sync.aligned.u32 N: the warpgroup's per-thread register budget becomes N
 * (dec returns registers to the CTA's pool, inc waits for them). */
FA_DEV void fa_regs_producer(void) { asm volatile("setmaxnreg.dec.sync.aligned.u32 24;"); }
FA_DEV void fa_regs_consumer(void) { asm volatile("setmaxnreg.inc.sync.aligned.u32 240;"); }

/* ---- the kernel ----------------------------------------------------------------------------- */

extern "C" __global__ void __launch_bounds__(FA_THREADS, 1)
    fa_fwd(const fa_kparams kp, const __grid_constant__ fa_tmaps tm)
{
    extern __shared__ __align__(1024) unsigned char fa_smem[];
    /* The plan adds 1024 bytes so the base can be rounded up to the swizzle atom. */
    const fa_u32 base = (fa_smem_addr(fa_smem) + 1023u) & ~1023u;
    const fa_u32 sq_a = base;
    const fa_u32 sk_a = sq_a + FA_Q_BYTES;
    const fa_u32 sv_a = sk_a + FA_STAGES * FA_K_BYTES;
    const fa_u32 bar_q = sv_a + FA_STAGES * FA_V_BYTES;
    const fa_u32 bar_k = bar_q + 8;                  /* k_full[s] = bar_k + 8 s */
    const fa_u32 bar_v = bar_k + 8 * FA_STAGES;      /* v_full[s] */
    const fa_u32 bar_e = bar_v + 8 * FA_STAGES;      /* empty[s]: 8 arrivals, lane 0 of each
                                                        consumer warp */

    /* Heavy (late, under causal) query tiles first. */
    const int m_block = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, bi = blockIdx.z;
    const int sq = (int)kp.max_sq, sk = (int)kp.max_sk;
    const int m0 = m_block * FA_BM;
    const int hk = h / (kp.h / kp.hk);

    /* The key blocks any row of the tile sees (both window edges grow with the row). */
    const int m_last = fa_min(m0 + FA_BM, sq) - 1;
    int lo_first, hi_first, lo_last, hi_last;
    fa_key_range(&kp, m0, sq, sk, &lo_first, &hi_first);
    fa_key_range(&kp, m_last, sq, sk, &lo_last, &hi_last);
    const int n_min = lo_first / FA_BN;
    const int n_max = hi_last > lo_first ? (hi_last + FA_BN - 1) / FA_BN : n_min;
    const int n_blocks = n_max - n_min;

    if (threadIdx.x == 0) {
        fa_mbar_init(bar_q, 1);
        for (int s = 0; s < FA_STAGES; s++) {
            fa_mbar_init(bar_k + 8 * s, 1);
            fa_mbar_init(bar_v + 8 * s, 1);
            fa_mbar_init(bar_e + 8 * s, 8);
        }
        fa_mbar_init_fence();
    }
    __syncthreads();

    const int wg = threadIdx.x / FA_WG_THREADS;
    if (wg == 0) {
        /* Producer. */
        fa_regs_producer();
        if (threadIdx.x == 0 && n_blocks > 0) {
            fa_tma_prefetch(&tm.q);
            fa_tma_prefetch(&tm.k);
            fa_tma_prefetch(&tm.v);
            fa_mbar_expect_tx(bar_q, FA_Q_BYTES);
#pragma unroll
            for (int c = 0; c < FA_KB; c++)
                fa_tma_load4(sq_a + c * FA_BM * 128, &tm.q, 64 * c, m0, h, bi, bar_q);
            for (int it = 0; it < n_blocks; it++) {
                const int n = n_max - 1 - it, s = it % FA_STAGES, ph = (it / FA_STAGES) & 1;
                /* Wait until both consumers released this stage's previous use. */
                fa_mbar_wait(bar_e + 8 * s, ph ^ 1);
                fa_mbar_expect_tx(bar_k + 8 * s, FA_K_BYTES);
#pragma unroll
                for (int c = 0; c < FA_KB; c++)
                    fa_tma_load4(sk_a + s * FA_K_BYTES + c * FA_BN * 128, &tm.k, 64 * c, n * FA_BN,
                                 hk, bi, bar_k + 8 * s);
                fa_mbar_expect_tx(bar_v + 8 * s, FA_V_BYTES);
#pragma unroll
                for (int c = 0; c < FA_VB; c++)
                    fa_tma_load4(sv_a + s * FA_V_BYTES + c * FA_BN * 128, &tm.v, 64 * c, n * FA_BN,
                                 hk, bi, bar_v + 8 * s);
            }
        }
    } else {
        /* Consumer warpgroup cw owns tile rows 64 cw .. 64 cw + 63. */
        fa_regs_consumer();
        const int cw = wg - 1;
        const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
        const int q4 = lane & 3;
        const int row0 = m0 + 64 * cw + 16 * warp + (lane >> 2); /* rows row0, row0 + 8 */
        int lo[2], hi[2];
        fa_key_range(&kp, row0, sq, sk, &lo[0], &hi[0]);
        fa_key_range(&kp, row0 + 8, sq, sk, &lo[1], &hi[1]);
        const int lo_max = fa_max(lo[0], lo[1]), hi_min = fa_min(hi[0], hi[1]);

        /* The factor in front of exp2; a scale <= 0 (never in practice) prescales the scores. */
        const int prescale = !(kp.scale_log2 > 0.f);
        const float sm = prescale ? 1.f : kp.scale_log2;

        float o[FA_OACC];
        float row_max[2] = {-FA_INF, -FA_INF}, row_sum[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < FA_OACC; j++)
            o[j] = 0.f;

        if (n_blocks > 0) {
            fa_mbar_wait(bar_q, 0);
            const fa_u32 q_base = sq_a + cw * 64 * 128;
            for (int it = 0; it < n_blocks; it++) {
                const int n = n_max - 1 - it, s = it % FA_STAGES, ph = (it / FA_STAGES) & 1;
                const fa_u32 k_base = sk_a + s * FA_K_BYTES, v_base = sv_a + s * FA_V_BYTES;

                /* S = Q K^T over FA_DP / 16 k-steps. */
                float sacc[FA_SACC];
                fa_mbar_wait(bar_k + 8 * s, ph);
                fa_wg_fence();
#pragma unroll
                for (int kk = 0; kk < FA_DP / 16; kk++) {
                    const fa_u32 koff = (kk & 3) * 32;
                    fa_wgmma_ss_n128(sacc,
                                     fa_desc(q_base + (kk >> 2) * FA_BM * 128 + koff, 16, 1024),
                                     fa_desc(k_base + (kk >> 2) * FA_BN * 128 + koff, 16, 1024),
                                     kk > 0);
                }
                fa_wg_commit();
                fa_wg_wait0();
#pragma unroll
                for (int j = 0; j < FA_SACC; j++)
                    FA_PIN(sacc[j]);

                if (prescale) {
#pragma unroll
                    for (int j = 0; j < FA_SACC; j++)
                        sacc[j] *= kp.scale_log2;
                }
                /* Mask keys outside each row's visible range (only blocks that cross an edge). */
                const int kb0 = n * FA_BN;
                if (kb0 < lo_max || kb0 + FA_BN > hi_min) {
#pragma unroll
                    for (int j = 0; j < FA_SACC; j++) {
                        const int col = kb0 + 8 * (j >> 2) + 2 * q4 + (j & 1);
                        const int hf = (j >> 1) & 1;
                        if (col < lo[hf] || col >= hi[hf])
                            sacc[j] = -FA_INF;
                    }
                }

                /* Online softmax: per row, the block max over the quad, the rescale of O and l. */
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    float mx = row_max[hf];
#pragma unroll
                    for (int j = 0; j < FA_SACC; j++)
                        if (((j >> 1) & 1) == hf)
                            mx = fmaxf(mx, sacc[j]);
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    /* A row with nothing visible yet keeps max -inf: exponentiate against 0. */
                    const float m_use = mx == -FA_INF ? 0.f : mx;
                    const float alpha = fa_exp2((row_max[hf] - m_use) * sm);
                    row_max[hf] = mx;
                    row_sum[hf] *= alpha;
#pragma unroll
                    for (int j = 0; j < FA_OACC; j++)
                        if (((j >> 1) & 1) == hf)
                            o[j] *= alpha;
                    const float neg = -m_use * sm;
                    float sum = 0.f;
#pragma unroll
                    for (int j = 0; j < FA_SACC; j++)
                        if (((j >> 1) & 1) == hf) {
                            sacc[j] = fa_exp2(fmaf(sacc[j], sm, neg));
                            sum += sacc[j];
                        }
                    row_sum[hf] += sum;
                }

                /* P as the A fragments of FA_BN / 16 k-slices: slice kk holds d[8kk .. 8kk+7]. */
                fa_u32 pa[FA_BN / 16][4];
#pragma unroll
                for (int kk = 0; kk < FA_BN / 16; kk++)
#pragma unroll
                    for (int r = 0; r < 4; r++)
                        pa[kk][r] = fa_pack2(sacc[8 * kk + 2 * r], sacc[8 * kk + 2 * r + 1]);

                /* O += P V. */
                fa_mbar_wait(bar_v + 8 * s, ph);
#pragma unroll
                for (int j = 0; j < FA_OACC; j++)
                    FA_PIN(o[j]);
                fa_wg_fence();
#pragma unroll
                for (int kk = 0; kk < FA_BN / 16; kk++) {
                    const fa_u64 dv = fa_desc(v_base + kk * 2048, FA_BN * 128, 1024);
#if FA_DVP == 128
                    fa_wgmma_rs_n128(o, pa[kk], dv);
#else
                    fa_wgmma_rs_n64(o, pa[kk], dv);
#endif
                }
                fa_wg_commit();
                fa_wg_wait0();
#pragma unroll
                for (int j = 0; j < FA_OACC; j++)
                    FA_PIN(o[j]);
                /* This warp is done with the stage (its wgmma finished reading K and V). */
                __syncwarp();
                if (lane == 0)
                    fa_mbar_arrive(bar_e + 8 * s);
            }
        }

        /* Epilogue: the sink joins the denominator; empty rows give 0 and lse +inf. */
        const float sink2 = kp.sinks ? kp.sinks[h * kp.sinks_stride] * FA_LOG2E : -FA_INF;
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int row = row0 + 8 * hf;
            float l = row_sum[hf];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float mx = row_max[hf] * sm; /* base 2 */
            const float big = fmaxf(mx, sink2);
            float lse, scale;
            if (big == -FA_INF) {
                lse = FA_INF;
                scale = 0.f;
            } else {
                const float lm = l > 0.f ? fa_exp2(mx - big) : 0.f;
                const float total = l * lm + (kp.sinks ? fa_exp2(sink2 - big) : 0.f);
                lse = (big + log2f(total)) * FA_LN2;
                scale = l > 0.f ? lm / total : 0.f;
            }
            if (row >= sq)
                continue;
            fa_u16 *og = (fa_u16 *)kp.out + bi * kp.o_bstride + (fa_i64)row * kp.o_rstride +
                         h * kp.o_hstride;
#pragma unroll
            for (int j = 0; j < FA_OACC; j += 2)
                if (((j >> 1) & 1) == hf)
                    *(fa_u32 *)(og + 8 * (j >> 2) + 2 * q4) = fa_pack2(o[j] * scale, o[j + 1] * scale);
            if (kp.lse && q4 == 0)
                kp.lse[bi * kp.lse_bstride + h * kp.lse_hstride + (fa_i64)row * kp.lse_rstride] = lse;
        }
    }
}
