/*
 * Forward attention for sm_90a with fp8 (e4m3) q, k, v: FA3's fp8 forward in CUDA C with inline
 * PTX. The structure of fa_fwd_sm90.cu (warp specialised, TMA-fed, wgmma, the softmax of block i
 * overlapped with P_(i-1) V_(i-1)), with what fp8 changes:
 *   - wgmma e4m3 k32 (QGMMA). fp8 wgmma has no transpose: both operands K-major. Q and K are
 *     (rows of d bytes); V is [keys][dv], MN-major for O = P V, so the producer warpgroup
 *     transposes each stage into V^T [dv][keys] (K-major) in shared memory.
 *   - P as the register A fragment of k32 (bytes 4q .. 4q + 3 and 16 + 4q .. of rows r and r + 8)
 *     while S's accumulator gives a thread columns 2q, 2q + 1, 8 + 2q, 9 + 2q of each 16. The
 *     reduction's order is free, so V^T's keys are stored permuted to match: logical key
 *     16h + 4q + e of a 32-key step holds actual key 16h + 8(e >> 1) + 2q + (e & 1); P then packs
 *     from registers with no shuffle (fa_p_pack8).
 *   - P = 2^8 exp2(s - m) rounded to e4m3 (FA3's max offset of 8: p <= 256 < 448); the row sums
 *     take the unrounded p, and the 2^8 cancels in O / l.
 *   - Descales (fp32 [b, hk], NULL = 1): q_descale k_descale join the softmax scale (softcap's
 *     pre-factor with softcap), v_descale the final 1 / l.
 *
 * One CTA: FA_BM = 128 query rows, 3 warpgroups:
 *   warpgroup 0, the producer (setmaxnreg.dec 24): thread 0 issues the TMA copies - Q, K into
 *     K[stage], V into Vraw[stage] - and the whole warpgroup transposes Vraw[stage] into
 *     Vt[stage] (keys past the sequence written as zeros: in varlen they are the next
 *     sequence's, and 0 * inf would be NaN), then thread 0 arrives on v_full;
 *   warpgroups 1, 2, the consumers (setmaxnreg.inc 240): 64 query rows each, as fa_fwd_sm90.cu.
 *
 * Shared memory (from a 1024-byte aligned base):
 *   Q  [FA_DP / FA_RB][FA_BM][FA_RB]             FA_RB = 128 bytes (64 at d 64): TMA swizzle of
 *   K  [FA_STAGES][FA_DP / FA_RB][FA_BN][FA_RB]   the same width, read by wgmma descriptors of
 *                                                 layout 1 (128B) or 2 (64B)
 *   Vt [FA_STAGES][FA_DVP][128 keys]              128B swizzle, written by the producer
 *   Vr [FA_STAGES][FA_DVP / FA_RB][FA_BN][FA_RB]  as K (TMA, swizzled), read by the producer
 *   mbarriers: q_full, q_empty, k_full[S], k_empty[S], r_full[S], v_full[S], v_empty[S]
 *
 * Defines from the plan (fa_plan_forward_sm90_fp8): FA_BF16 (the output: bf16, else fp16), FA_D,
 * FA_DP = FA_DVP (64, 128, 256; d = dv), FA_NCW 2, FA_BM 128, FA_BN 128, FA_STAGES 2,
 * FA_SOFTCAP, FA_VARLEN. Entry points fa_fwd(kp, maps) and fa_fwd_fill.
 */
#define FA_REGS_PRODUCER 24
#define FA_REGS_CONSUMER 240
#include "fa_common.cuh"
#include "fa_sm90.cuh"
#include "fa_smem.h"

#define FA_WG_THREADS 128
#define FA_THREADS ((FA_NCW + 1) * FA_WG_THREADS)
#define FA_CONSUMER_WARPS (4 * FA_NCW)
#define FA_RB (FA_DP < 128 ? FA_DP : 128) /* bytes of a Q or K row block */
#define FA_KB (FA_DP / FA_RB)
#define FA_Q_BYTES (FA_BM * FA_DP)
#define FA_K_BYTES (FA_BN * FA_DP)
#define FA_V_BYTES (FA_BN * FA_DVP)
#define FA_SACC (FA_BN / 2)
#define FA_OACC (FA_DVP / 2)
#define FA_KS (FA_BN / 32) /* k32 steps of P V */
#define FA_ALIBI 0
#define FA_DROPOUT 0

#ifndef FA_DV
#define FA_DV FA_D
#endif

#if FA_NCW != 2 || FA_BM != 128 || FA_BN != 128 || FA_DP != FA_DVP ||                            \
    (FA_DP != 64 && FA_DP != 128 && FA_DP != 256) || FA_STAGES < 2
#error "fa_fwd_sm90_fp8.cu: 2 consumers, 128 x 128 tiles, d = dv padded to 64, 128 or 256"
#endif

#include "fa_fwd_sm90_tile.cuh"

/* The kernel's second parameter, the same layout as fa_cuda_tmaps8 on the host: the tensor maps
 * (Q and K in rows of FA_RB bytes, swizzled; V unswizzled), the schedule, the descales and their
 * element strides (NULL: 1). */
typedef struct fa_tmaps8 {
    fa_tmap q, k, v;
    const float *q_descale, *k_descale, *v_descale;
    fa_i64 qd_bstride, qd_hstride, kd_bstride, kd_hstride, vd_bstride, vd_hstride;
    int paired;
} fa_tmaps8;

/* Shared-memory descriptor of an fp8 K-major operand: rows of FA_RB bytes (128: layout 1, 128B
 * swizzle; 64: layout 2, 64B swizzle), 8-row groups sbo bytes apart (8 FA_RB). */
FA_DEV fa_u64 fa_desc8(fa_u32 addr, fa_u32 rb)
{
    return (fa_u64)((addr & 0x3FFFFu) >> 4) | ((fa_u64)1 << 16) | ((fa_u64)((8 * rb) >> 4) << 32) |
           ((fa_u64)(rb == 128 ? 1 : 2) << 62);
}

/* S (+)= Q K^T, m64n128k32 e4m3, both operands by descriptor (SS, no transpose for fp8). */
FA_DEV void fa_wgmma8_s(float *d, fa_u64 da, fa_u64 db, int accumulate)
{
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" FA_RL64 "}, %64, %65, "
                 "p, 1, 1; }"
                 : FA_FL64(d)
                 : "l"(da), "l"(db), "r"(accumulate));
}

/* O += P V for 64 or 128 columns of V^T (rows of 128 key bytes), A from registers (RS). */
FA_DEV void fa_wgmma8_pv64(float *d, const fa_u32 a[4], fa_u64 db)
{
    asm volatile("{ .reg .pred p; setp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" FA_RL32 "}, "
                 "{%32, %33, %34, %35}, %36, p, 1, 1; }"
                 : FA_FL32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

FA_DEV void fa_wgmma8_pv128(float *d, const fa_u32 a[4], fa_u64 db)
{
    asm volatile("{ .reg .pred p; setp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" FA_RL64 "}, "
                 "{%64, %65, %66, %67}, %68, p, 1, 1; }"
                 : FA_FL64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

/* Shared-memory addresses of the tiles and barriers. */
typedef struct fa_smem8 {
    fa_u32 q, k, vt, vr;
    fa_u32 q_full, q_empty;
    fa_u32 k_full, k_empty, r_full, v_full, v_empty; /* + 8 * stage */
} fa_smem8;

/* One consumer thread's view of its two rows (r and r + 8 of its warp's 16). */
typedef struct fa_rows8 {
    int row0, q4;
    int lo[2], hi[2], lo_max, hi_min;
    float sm;        /* the factor in front of exp2 (1 when prescaled) */
    int prescale;
    float f; /* scale_log2 with the descales (softcap: softcap's pre-factor with them) */
} fa_rows8;

/* ---- producer ------------------------------------------------------------------------------- */

/* Thread 0: K and raw V of the tile's key block `it` into stage kv % FA_STAGES. */
FA_DEV void fa_load_kv8(const fa_smem8 *m, const fa_tmaps8 *tm, const fa_tile *w, int kv, int it)
{
    const int n = w->n_max - 1 - it, s = kv % FA_STAGES, ph = (kv / FA_STAGES) & 1;
    const int row = w->k_start + n * FA_BN, bi = FA_VARLEN ? 0 : w->bi;
    fa_mbar_wait(m->k_empty + 8 * s, ph ^ 1);
    fa_mbar_expect_tx(m->k_full + 8 * s, FA_K_BYTES);
#pragma unroll
    for (int c = 0; c < FA_KB; c++)
        fa_tma_load4(m->k + s * FA_K_BYTES + c * FA_BN * FA_RB, &tm->k, FA_RB * c, row, w->hk, bi,
                     m->k_full + 8 * s);
    /* Vr[s] is free: the warpgroup finished transposing its previous block before this thread
     * got here (named barrier 4 in fa_transpose_v). */
    fa_mbar_expect_tx(m->r_full + 8 * s, FA_V_BYTES);
#pragma unroll
    for (int c = 0; c < FA_DVP / FA_RB; c++)
        fa_tma_load4(m->vr + s * FA_V_BYTES + c * FA_BN * FA_RB, &tm->v, FA_RB * c, row, w->hk, bi,
                     m->r_full + 8 * s);
}

/*
 * The producer warpgroup: Vr[s] ([keys][dv] in blocks of FA_RB columns, swizzled as TMA wrote it)
 * -> Vt[s] ([dv][128 keys], 128B swizzle, keys permuted as the header says), keys from `valid`
 * on written as zeros. A unit is 4 columns x 4 logical keys: four 4-byte loads of actual keys
 * 16b + 2q' (+1, +8, +9), a 4 x 4 byte transpose, four 4-byte stores. A warp's 32 units are 8
 * key quads x 4 column groups: with both swizzles that is at most 2 lanes a bank, loads and
 * stores alike.
 */
FA_DEV void fa_transpose_v(const fa_smem8 *m, int kv, int valid)
{
    const int s = kv % FA_STAGES, ph = (kv / FA_STAGES) & 1, tid = threadIdx.x;
    fa_mbar_wait(m->r_full + 8 * s, ph);
    fa_mbar_wait(m->v_empty + 8 * s, ph ^ 1);
    const fa_u32 src = m->vr + s * FA_V_BYTES, dst = m->vt + s * FA_V_BYTES;
    constexpr int cg = FA_DVP / 16; /* column-group quads per warp row of units */
#pragma unroll 1
    for (int u = tid; u < FA_DVP * 8; u += FA_WG_THREADS) {
        const int l = u & 31, rest = u >> 5;
        const int c4 = (l & 3) + 4 * (rest % cg), kq = (l >> 2) + 8 * (rest / cg);
        const int b = kq >> 2, qq = kq & 3;
        const int k0 = 16 * b + 2 * qq;
        fa_u32 a[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int key = k0 + 8 * (e >> 1) + (e & 1);
            fa_u32 x;
            /* Byte 4 c4 of the key's row: block c4 / (FA_RB / 4), then its 16-byte chunk XOR the
             * swizzle's key (128B: key % 8; 64B: (key / 2) % 4). */
            const int cb = (4 * c4) % FA_RB;
            const int swz = FA_RB == 128 ? (key & 7) : ((key >> 1) & 3);
            asm volatile("ld.shared.u32 %0, [%1];"
                         : "=r"(x)
                         : "r"(src + (4 * c4 / FA_RB) * (FA_BN * FA_RB) + key * FA_RB +
                               ((((cb >> 4) ^ swz) << 4) | (cb & 15))));
            a[e] = key < valid ? x : 0u;
        }
        const fa_u32 t0 = __byte_perm(a[0], a[1], 0x5140), t1 = __byte_perm(a[0], a[1], 0x7362);
        const fa_u32 t2 = __byte_perm(a[2], a[3], 0x5140), t3 = __byte_perm(a[2], a[3], 0x7362);
        fa_u32 o[4];
        o[0] = __byte_perm(t0, t2, 0x5410);
        o[1] = __byte_perm(t0, t2, 0x7632);
        o[2] = __byte_perm(t1, t3, 0x5410);
        o[3] = __byte_perm(t1, t3, 0x7632);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int n = 4 * c4 + j;
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(dst + n * 128 + ((b ^ (n & 7)) << 4) +
                                                         4 * qq),
                         "r"(o[j])
                         : "memory");
        }
    }
    /* The writes reach the async proxy (wgmma) before the stage is announced; the reads of Vr[s]
     * are done before thread 0 reloads it. */
    fa_fence_proxy_async();
    asm volatile("barrier.sync 4, %0;" ::"n"(FA_WG_THREADS) : "memory");
    if (tid == 0)
        fa_mbar_arrive(m->v_full + 8 * s);
}

/* The producer warpgroup's share of a tile (kv: blocks loaded so far, q_round: tiles). */
FA_DEV void fa_produce_tile8(const fa_smem8 *m, const fa_tmaps8 *tm, const fa_tile *w, int *kv,
                             int *q_round)
{
    if (threadIdx.x == 0) {
        fa_mbar_wait(m->q_empty, (*q_round & 1) ^ 1);
        fa_mbar_expect_tx(m->q_full, FA_Q_BYTES);
#pragma unroll
        for (int c = 0; c < FA_KB; c++)
            fa_tma_load4(m->q + c * FA_BM * FA_RB, &tm->q, FA_RB * c, w->q_start + w->m0, w->h,
                         FA_VARLEN ? 0 : w->bi, m->q_full);
        fa_load_kv8(m, tm, w, *kv, 0);
    }
    ++*q_round;
    for (int it = 0; it < w->n_blocks; it++, ++*kv) {
        /* The next block's copies fly while this one is transposed. */
        if (threadIdx.x == 0 && it + 1 < w->n_blocks)
            fa_load_kv8(m, tm, w, *kv + 1, it + 1);
        fa_transpose_v(m, *kv, w->sk - (w->n_max - 1 - it) * FA_BN);
    }
}

/* ---- consumers ------------------------------------------------------------------------------ */

/* S = Q K^T for one key block: FA_DP / 32 k-steps of 32 bytes, FA_RB / 32 per row block. */
FA_DEV void fa_gemm8_s(float *sacc, fa_u32 q_rows, fa_u32 k_rows)
{
    /* One descriptor each, stepped by fa_desc_at (an add to the address field). */
    const fa_u64 dq = fa_desc8(q_rows, FA_RB), dk = fa_desc8(k_rows, FA_RB);
#pragma unroll
    for (int kk = 0; kk < FA_DP / 32; kk++) {
        const int blk = kk / (FA_RB / 32), off = (kk % (FA_RB / 32)) * 32;
        fa_wgmma8_s(sacc, fa_desc_at(dq, blk * FA_BM * FA_RB + off),
                    fa_desc_at(dk, blk * FA_BN * FA_RB + off), kk > 0);
    }
    fa_wg_commit();
}

/* O += P V for one key block from V^T (rows of 128 key bytes, 128B swizzle): FA_KS k-steps, each
 * over dv in n128 pieces (then n64). */
FA_DEV void fa_gemm8_pv(float *o, fa_u32 pa[][4], fa_u32 vt)
{
    const fa_u64 d0 = fa_desc8(vt, 128);
#pragma unroll
    for (int kk = 0; kk < FA_KS; kk++) {
#pragma unroll
        for (int c = 0; c + 128 <= FA_DVP; c += 128)
            fa_wgmma8_pv128(o + c / 2, pa[kk], fa_desc_at(d0, c * 128 + kk * 32));
#if FA_DVP % 128
        fa_wgmma8_pv64(o + (FA_DVP - 64) / 2, pa[kk],
                       fa_desc_at(d0, (FA_DVP - 64) * 128 + kk * 32));
#endif
    }
    fa_wg_commit();
}

/* Four probabilities -> one A register: e4m3 of x0, x1, x2, x3 in bytes 0 .. 3 (nearest even,
 * saturated; cvt puts its first source in the high byte). */
FA_DEV fa_u32 fa_e4m3x4(float x0, float x1, float x2, float x3)
{
    fa_u32 r;
    asm("{ .reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
        "mov.b32 %0, {lo, hi}; }"
        : "=r"(r)
        : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
    return r;
}

/* P -> A fragments of FA_KS k32 steps. Register hf + 2h of step kk holds row half hf's logical
 * keys 16h + 4q .. + 3, which are the actual keys 16h + {2q, 2q + 1, 8 + 2q, 9 + 2q}: the S
 * accumulator's elements 16kk + 8h + 2hf + {0, 1, 4, 5}. */
FA_DEV void fa_p_pack8(const float *sacc, fa_u32 pa[][4])
{
#pragma unroll
    for (int kk = 0; kk < FA_KS; kk++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const float *x = sacc + 16 * kk + 8 * h + 2 * hf;
                pa[kk][hf + 2 * h] = fa_e4m3x4(x[0], x[1], x[4], x[5]);
            }
}

FA_DEV void fa_operands_pin8(float *o, fa_u32 pa[][4])
{
#pragma unroll
    for (int j = 0; j < FA_OACC; j++)
        FA_PIN(o[j]);
#pragma unroll
    for (int kk = 0; kk < FA_KS; kk++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            FA_PINU(pa[kk][e]);
}

/* tanh.approx.f32 (max relative error about 2^-11, far below e4m3's 2^-4): libm's tanhf spills
 * at d 256, and FA3 takes the approximate one too. */
FA_DEV float fa_tanh_approx(float x)
{
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* S of key block n -> 2^8 exp2 of the scaled, masked scores relative to the new row maxima (the
 * offset: FA3's 8 for e4m3), in place; row_max, row_sum (unrounded p) and alpha updated. */
FA_DEV void fa_softmax8(const fa_kparams *kp, const fa_rows8 *r, float *sacc, int n,
                        float row_max[2], float row_sum[2], float alpha[2])
{
    const int kb0 = n * FA_BN;
    if (r->prescale) {
#pragma unroll
        for (int j = 0; j < FA_SACC; j++) {
#if FA_SOFTCAP
            sacc[j] = FA_RULE_SOFTCAP(sacc[j], r->f, kp->scale_log2, fa_tanh_approx);
#else
            sacc[j] *= r->f;
#endif
        }
    }
    if (kb0 < r->lo_max || kb0 + FA_BN > r->hi_min) {
#pragma unroll
        for (int j = 0; j < FA_SACC; j++) {
            const int col = kb0 + 8 * (j >> 2) + 2 * r->q4 + (j & 1);
            const int hf = (j >> 1) & 1;
            if (col < r->lo[hf] || col >= r->hi[hf])
                sacc[j] = -FA_INF;
        }
    }
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float mx = row_max[hf];
#pragma unroll
        for (int j = 0; j < FA_SACC; j++)
            if (((j >> 1) & 1) == hf)
                mx = fmaxf(mx, sacc[j]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_use = mx == -FA_INF ? 0.f : mx;
        alpha[hf] = fa_exp2((row_max[hf] - m_use) * r->sm);
        row_max[hf] = mx;
        const float neg = 8.f - m_use * r->sm;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < FA_SACC; j++)
            if (((j >> 1) & 1) == hf) {
                sacc[j] = fa_exp2(fmaf(sacc[j], r->sm, neg));
                sum += sacc[j];
            }
        row_sum[hf] = row_sum[hf] * alpha[hf] + sum;
    }
}

FA_DEV float fa_descale(const float *t, fa_i64 bs, fa_i64 hs, int b, int hk)
{
    return t ? t[b * bs + hk * hs] : 1.f;
}

/* A consumer warpgroup's share of a tile (rows 64 cw ..): fa_fwd_sm90.cu's loop without
 * pingpong; V^T comes on v_full from the producer warpgroup. */
FA_DEV void fa_consume_tile8(const fa_kparams *kp, const fa_tmaps8 *tm, const fa_smem8 *m,
                             const fa_tile *w, int cw, int *kv, int *q_round)
{
    /* %tid.x read per tile (volatile, so not hoisted out of the tile loop): the row offsets
     * held across tiles were a register the widest variant lacked. */
    fa_u32 tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    const int lane = tid & 31, warp = (tid >> 5) & 3;
    const int sq = w->sq, sk = w->sk;
    fa_rows8 r;
    r.q4 = lane & 3;
    r.row0 = w->m0 + 64 * cw + 16 * warp + (lane >> 2);
    fa_key_range(kp, r.row0, sq, sk, &r.lo[0], &r.hi[0]);
    fa_key_range(kp, r.row0 + 8, sq, sk, &r.lo[1], &r.hi[1]);
    r.lo_max = fa_max(r.lo[0], r.lo[1]);
    r.hi_min = fa_min(r.hi[0], r.hi[1]);
    const float qk = fa_descale(tm->q_descale, tm->qd_bstride, tm->qd_hstride, w->bi, w->hk) *
                     fa_descale(tm->k_descale, tm->kd_bstride, tm->kd_hstride, w->bi, w->hk);
    r.f = (FA_SOFTCAP ? kp->softcap_pre : kp->scale_log2) * qk;
    r.prescale = FA_SOFTCAP || !(r.f > 0.f);
    r.sm = r.prescale ? 1.f : r.f;

    float o[FA_OACC];
    float row_max[2] = {-FA_INF, -FA_INF}, row_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < FA_OACC; j++)
        o[j] = 0.f;

    const int nb = w->n_blocks;
    if (nb > 0) {
        const fa_u32 q_rows = m->q + cw * 64 * FA_RB;
        const int kv0 = *kv;
        float sacc[FA_SACC], alpha[2];
        fa_u32 pa[FA_KS][4];
        fa_mbar_wait(m->q_full, *q_round & 1);
        fa_mbar_wait(m->k_full + 8 * (kv0 % FA_STAGES), (kv0 / FA_STAGES) & 1);
        fa_wg_fence();
        fa_gemm8_s(sacc, q_rows, m->k + (kv0 % FA_STAGES) * FA_K_BYTES);
        fa_wg_wait0();
#pragma unroll
        for (int j = 0; j < FA_SACC; j++)
            FA_PIN(sacc[j]);
        fa_stage_release(m->k_empty + 8 * (kv0 % FA_STAGES), lane);
        if (nb == 1)
            fa_stage_release(m->q_empty, lane);
        fa_softmax8(kp, &r, sacc, w->n_max - 1, row_max, row_sum, alpha);
        fa_p_pack8(sacc, pa);

        for (int it = 1; it < nb; it++) {
            const int sp = (kv0 + it - 1) % FA_STAGES, php = ((kv0 + it - 1) / FA_STAGES) & 1;
            const int s = (kv0 + it) % FA_STAGES, ph = ((kv0 + it) / FA_STAGES) & 1;
            fa_mbar_wait(m->k_full + 8 * s, ph);
            fa_mbar_wait(m->v_full + 8 * sp, php);
            fa_operands_pin8(o, pa);
            fa_wg_fence();
            fa_gemm8_s(sacc, q_rows, m->k + s * FA_K_BYTES);
            fa_gemm8_pv(o, pa, m->vt + sp * FA_V_BYTES);
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
#pragma unroll
            for (int j = 0; j < FA_SACC; j++)
                FA_PIN(sacc[j]);
            fa_stage_release(m->k_empty + 8 * s, lane);
            if (it == nb - 1)
                fa_stage_release(m->q_empty, lane);
            fa_softmax8(kp, &r, sacc, w->n_max - 1 - it, row_max, row_sum, alpha);
            fa_wg_wait0();
            fa_operands_pin8(o, pa);
            fa_stage_release(m->v_empty + 8 * sp, lane);
            fa_o_rescale(o, alpha);
            fa_p_pack8(sacc, pa);
        }

        const int sp = (kv0 + nb - 1) % FA_STAGES, php = ((kv0 + nb - 1) / FA_STAGES) & 1;
        fa_mbar_wait(m->v_full + 8 * sp, php);
        fa_operands_pin8(o, pa);
        fa_wg_fence();
        fa_gemm8_pv(o, pa, m->vt + sp * FA_V_BYTES);
        fa_wg_wait0();
        fa_operands_pin8(o, pa);
        fa_stage_release(m->v_empty + 8 * sp, lane);
        *kv = kv0 + nb;
        ++*q_round;
    }

    /* Epilogue: l and O both carry the 2^8 of P; lse from l / 2^8 (exact), O scaled by
     * v_descale / l. Empty rows give 0 and lse +inf. */
    const float vd = fa_descale(tm->v_descale, tm->vd_bstride, tm->vd_hstride, w->bi, w->hk);
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int row = r.row0 + 8 * hf;
        float lse, scale;
        fa_row_finish(row_sum[hf] * (1.f / 256.f), row_max[hf] * r.sm, -FA_INF, &lse, &scale);
        scale *= vd * (1.f / 256.f);
        fa_u16 *og = (fa_u16 *)kp->out + w->bi * kp->o_bstride +
                     (fa_i64)(w->q_start + row) * kp->o_rstride + w->h * kp->o_hstride;
        fa_store_row16(og, kp->dv, (const float(*)[4])o, FA_DVP, hf, r.q4, scale, row < sq);
        if (row < sq && kp->lse && r.q4 == 0)
            kp->lse[w->bi * kp->lse_bstride + w->h * kp->lse_hstride +
                    (fa_i64)(w->q_start + row) * kp->lse_rstride] = lse;
    }
}

/* ---- the kernel ----------------------------------------------------------------------------- */

extern "C" __global__ void __launch_bounds__(FA_THREADS, 1)
    fa_fwd(const fa_kparams kp, const __grid_constant__ fa_tmaps8 tm)
{
    extern __shared__ __align__(1024) unsigned char fa_smem[];
    fa_smem8 m;
    m.q = (fa_smem_addr(fa_smem) + 1023u) & ~1023u;
    m.k = m.q + FA_Q_BYTES;
    m.vt = m.k + FA_STAGES * FA_K_BYTES;
    m.vr = m.vt + FA_STAGES * FA_V_BYTES;
    m.q_full = m.vr + FA_STAGES * FA_V_BYTES;
    m.q_empty = m.q_full + 8;
    m.k_full = m.q_empty + 8;
    m.k_empty = m.k_full + 8 * FA_STAGES;
    m.r_full = m.k_empty + 8 * FA_STAGES;
    m.v_full = m.r_full + 8 * FA_STAGES;
    m.v_empty = m.v_full + 8 * FA_STAGES;

    if (threadIdx.x == 0) {
        fa_mbar_init(m.q_full, 1);
        fa_mbar_init(m.q_empty, FA_CONSUMER_WARPS);
        for (int s = 0; s < FA_STAGES; s++) {
            fa_mbar_init(m.k_full + 8 * s, 1);
            fa_mbar_init(m.k_empty + 8 * s, FA_CONSUMER_WARPS);
            fa_mbar_init(m.r_full + 8 * s, 1);
            fa_mbar_init(m.v_full + 8 * s, 1);
            fa_mbar_init(m.v_empty + 8 * s, FA_CONSUMER_WARPS);
        }
        fa_mbar_init_fence();
    }
    __syncthreads();

    int kv = 0, q_round = 0;
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / FA_WG_THREADS, 0);
    /* The schedule's numbers are made after each setmaxnreg: kept across it, they went to
     * local memory (d 256, varlen, softcap). */
    int m_blocks, n_units;
    if (wg == 0) {
        fa_regs_producer();
        m_blocks = (int)((kp.max_sq + FA_BM - 1) / FA_BM);
        n_units = fa_units(tm.paired, m_blocks, &kp);
        if (threadIdx.x == 0) {
            fa_tma_prefetch(&tm.q);
            fa_tma_prefetch(&tm.k);
            fa_tma_prefetch(&tm.v);
        }
        for (int t = blockIdx.x; t < n_units; t += gridDim.x)
            for (int half = 0, hb, mb; half < 2; half++)
                if ((mb = fa_unit_tile(tm.paired, m_blocks, t, half, &hb)) >= 0) {
                    const fa_tile w = fa_tile_get(&kp, hb, mb);
                    if (w.n_blocks > 0)
                        fa_produce_tile8(&m, &tm, &w, &kv, &q_round);
                }
        return;
    }
    fa_regs_consumer();
    for (int t = blockIdx.x;; t += gridDim.x) {
        /* Made again per tile from the parameters (pinned, so not hoisted): held across the
         * tile, they were the registers the widest variant (d 256, varlen, softcap) lacked. */
        m_blocks = (int)((kp.max_sq + FA_BM - 1) / FA_BM);
        n_units = fa_units(tm.paired, m_blocks, &kp);
        FA_PINU(n_units);
        if (t >= n_units)
            break;
        for (int half = 0, hb, mb; half < 2; half++) {
            m_blocks = (int)((kp.max_sq + FA_BM - 1) / FA_BM);
            FA_PINU(m_blocks);
            if ((mb = fa_unit_tile(tm.paired, m_blocks, t, half, &hb)) >= 0) {
                const fa_tile w = fa_tile_get(&kp, hb, mb);
                fa_consume_tile8(&kp, &tm, &m, &w, wg - 1, &kv, &q_round);
            }
        }
    }
}

extern "C" __global__ void fa_fwd_fill(const fa_kparams kp) { fa_fill_outside(&kp); }
