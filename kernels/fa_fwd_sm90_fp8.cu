/*
 * Forward attention for sm_90a with fp8 (e4m3) q, k, v: FA3's fp8 forward in CUDA C with inline
 * PTX. The structure of fa_fwd_sm90.cu (warp specialised, TMA-fed, wgmma, the softmax of block i
 * overlapped with P_(i-1) V_(i-1), pingpong between the consumers), with what fp8 changes:
 *   - wgmma e4m3 k32 (QGMMA). fp8 wgmma has no transpose: both operands K-major. Q and K are
 *     (rows of d bytes); V is [keys][dv], MN-major for O = P V, so the producer warpgroup
 *     transposes each stage into V^T [dv][keys] (K-major) in shared memory (fa_fwd_sm90_fp8_v.cuh).
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
 *     K[stage], V into Vr[stage] - and V^T[stage] is made from Vr[stage] (FA_TRANSPOSE 0: by the
 *     whole warpgroup, thread 0 included; 1: by warps 1 .. 3 with ldmatrix / stmatrix, so the
 *     copies never wait behind a transpose), announced on v_full; FA_TRANSPOSE 2 (dense calls):
 *     V^T was written to global memory ahead of the kernel (fa_fwd_vt), thread 0 copies it into
 *     V^T[stage] by TMA like K, and there is no Vr;
 *   warpgroups 1, 2, the consumers (setmaxnreg.inc 240): 64 query rows each, as fa_fwd_sm90.cu:
 *     S_i = Q K_i^T and O += P_(i-1) V_(i-1) issued together, the softmax of S_i under the
 *     second (FA_ORDER: a shared store keeps ptxas from hoisting the wait above it), and with
 *     FA_PINGPONG the two take turns issuing their GEMMs (named barriers 1 and 2).
 *
 * Shared memory (from a 1024-byte aligned base; fa_smem.h's FA_SMEM_FWD90_FP8):
 *   Q  [FA_DP / FA_RB][FA_BM][FA_RB]             FA_RB = 128 bytes (64 at d 64): TMA swizzle of
 *   K  [FA_STAGES][FA_DP / FA_RB][FA_BN][FA_RB]   the same width, read by wgmma descriptors of
 *                                                 layout 1 (128B) or 2 (64B)
 *   Vt [FA_STAGES][ceil(FA_BN / 128)][FA_DVP][128 keys]   128B swizzle, written by the producer
 *   Vr [FA_STAGES][FA_DVP / FA_RB][FA_BN][FA_RB]  as K (TMA, swizzled), read by the producer
 *                                                 (none with FA_TRANSPOSE 2)
 *   mbarriers: q_full, q_empty, scratch (8 bytes), k_full[S], k_empty[S], r_full[S], r_empty[S],
 *   v_full[S], v_empty[S]; r_keys[S] (8 bytes each: Vr[stage]'s keys in the sequence)
 *
 * Defines from the plan (fa_plan_forward_sm90_fp8): FA_BF16 (the output: bf16, else fp16), FA_D,
 * FA_DP = FA_DVP (64, 128, 256; d = dv), FA_NCW 2, FA_BM 128, FA_BN (a multiple of 32 from 64 to
 * 256), FA_STAGES, FA_PINGPONG, FA_TRANSPOSE, FA_ORDER, FA_SOFTCAP, FA_VARLEN. Entry points
 * fa_fwd(kp, maps), fa_fwd_fill, and with FA_TRANSPOSE 2 fa_fwd_vt (V^T ahead of fa_fwd).
 */
/* 24 + 2 x 240 = 3 x 168, the launch's registers a thread (384 threads, 65536 registers): with a
 * larger sum the consumers' setmaxnreg.inc would wait forever for registers nobody frees. */
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
#ifndef FA_PINGPONG
#define FA_PINGPONG 0
#endif
#ifndef FA_TRANSPOSE
#define FA_TRANSPOSE 0
#endif
#ifndef FA_ORDER
#define FA_ORDER 0
#endif
/* The producers of a V^T stage: the arrivals its v_full waits for (thread 0, or one a warp). */
#define FA_VT_WRITERS (FA_TRANSPOSE == 1 ? 3 : 1)
/* Bytes of a stage's raw V (none where V^T comes from global memory). */
#define FA_VR_BYTES (FA_TRANSPOSE == 2 ? 0 : FA_V_BYTES)

#if FA_NCW != 2 || FA_BM != 128 || FA_BN % 32 != 0 || FA_BN < 64 || FA_BN > 256 ||              \
    FA_DP != FA_DVP || (FA_DP != 64 && FA_DP != 128 && FA_DP != 256) || FA_STAGES < 2 ||          \
    FA_TRANSPOSE < 0 || FA_TRANSPOSE > 2 || (FA_TRANSPOSE == 2 && FA_VARLEN)
#error "fa_fwd_sm90_fp8.cu: 2 consumers, 128-row tiles, 32k keys, d = dv padded to 64, 128 or 256"
#endif

#include "fa_fwd_sm90_tile.cuh"

/* The kernel's second parameter, the same layout as fa_cuda_tmaps8 on the host: the tensor maps
 * (Q and K in rows of FA_RB bytes, swizzled; V likewise, or with FA_TRANSPOSE 2 V^T in rows of
 * 128 keys), the schedule, the descales and their element strides (NULL: 1). */
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

/* S (+)= Q K^T, m64nNk32 e4m3 with N = FA_BN, both operands by descriptor (SS, no transpose for
 * fp8); RL/FL list its N / 2 accumulator registers, IA IB IP the operands after them. */
#define FA_DEF_WGMMA8_S(N, RL, FL, IA, IB, IP)                                                    \
    FA_DEV void fa_wgmma8_s(float *d, fa_u64 da, fa_u64 db, int accumulate)                     \
    {                                                                                           \
        asm volatile("{ .reg .pred p; setp.ne.b32 p, " IP ", 0;\n"                              \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {" RL "}, " IA    \
                     ", " IB ", p, 1, 1; }"                                                     \
                     : FL(d)                                                                    \
                     : "l"(da), "l"(db), "r"(accumulate));                                      \
    }
#if FA_BN == 64
FA_DEF_WGMMA8_S(64, FA_RL32, FA_FL32, "%32", "%33", "%34")
#elif FA_BN == 96
FA_DEF_WGMMA8_S(96, FA_RL48, FA_FL48, "%48", "%49", "%50")
#elif FA_BN == 128
FA_DEF_WGMMA8_S(128, FA_RL64, FA_FL64, "%64", "%65", "%66")
#elif FA_BN == 160
FA_DEF_WGMMA8_S(160, FA_RL80, FA_FL80, "%80", "%81", "%82")
#elif FA_BN == 192
FA_DEF_WGMMA8_S(192, FA_RL96, FA_FL96, "%96", "%97", "%98")
#elif FA_BN == 224
FA_DEF_WGMMA8_S(224, FA_RL112, FA_FL112, "%112", "%113", "%114")
#else
FA_DEF_WGMMA8_S(256, FA_RL128, FA_FL128, "%128", "%129", "%130")
#endif
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
    fa_u32 q_full, q_empty, scratch;
    fa_u32 k_full, k_empty, r_full, r_empty, v_full, v_empty; /* + 8 * stage */
    fa_u32 r_keys; /* + 8 * stage: FA_TRANSPOSE 1, the keys of Vr[stage] in the sequence, or -1 */
} fa_smem8;

/* One consumer thread's view of its two rows (r and r + 8 of its warp's 16). */
typedef struct fa_rows8 {
    int row0, q4;
    int lo[2], hi[2], lo_max, hi_min;
    float sm;        /* the factor in front of exp2 (1 when prescaled) */
    int prescale;
    float f; /* scale_log2 with the descales (softcap: softcap's pre-factor with them) */
} fa_rows8;

#include "fa_fwd_sm90_fp8_v.cuh"
#include "fa_fwd_sm90_fp8_produce.cuh"

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

/* O += P V for one key block from V^T (blocks of 128 keys, rows of 128 key bytes, 128B swizzle):
 * FA_KS k-steps, each over dv in n128 pieces (then n64). */
FA_DEV void fa_gemm8_pv(float *o, fa_u32 pa[][4], fa_u32 vt)
{
    const fa_u64 d0 = fa_desc8(vt, 128);
#pragma unroll
    for (int kk = 0; kk < FA_KS; kk++) {
        const fa_u32 at = (kk >> 2) * (FA_DVP * 128) + (kk & 3) * 32;
#pragma unroll
        for (int c = 0; c + 128 <= FA_DVP; c += 128)
            fa_wgmma8_pv128(o + c / 2, pa[kk], fa_desc_at(d0, at + c * 128));
#if FA_DVP % 128
        fa_wgmma8_pv64(o + (FA_DVP - 64) / 2, pa[kk], fa_desc_at(d0, at + (FA_DVP - 64) * 128));
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
    fa_softmax_rows(sacc, r->sm, 8.f, row_max, row_sum, alpha);
}

FA_DEV float fa_descale(const float *t, fa_i64 bs, fa_i64 hs, int b, int hk)
{
    return t ? t[b * bs + hk * hs] : 1.f;
}

/*
 * A consumer warpgroup's share of a tile (rows 64 cw ..): fa_fwd_sm90.cu's loop; V^T comes on
 * v_full from the producer warpgroup. With FA_PINGPONG each unit of GEMMs sits between a sync on
 * the warpgroup's own barrier and an arrive on the other's; per tile each side syncs and is
 * arrived at n_blocks + 1 times, so nothing is left pending between tiles.
 */
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
    FA_ROWS_EDGES(kp, r, sq, sk);
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
#if FA_PINGPONG
        const int bar_mine = 1 + cw, bar_other = 2 - cw;
        fa_pingpong_start(cw);
#endif
        fa_mbar_wait(m->q_full, *q_round & 1);
        fa_mbar_wait(m->k_full + 8 * (kv0 % FA_STAGES), (kv0 / FA_STAGES) & 1);
        fa_wg_fence();
        fa_gemm8_s(sacc, q_rows, m->k + (kv0 % FA_STAGES) * FA_K_BYTES);
#if FA_PINGPONG
        fa_named_arrive(bar_other);
#endif
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
#if FA_PINGPONG
            fa_named_sync(bar_mine);
#endif
            fa_mbar_wait(m->k_full + 8 * s, ph);
            fa_mbar_wait(m->v_full + 8 * sp, php);
            fa_operands_pin(o, pa, FA_KS);
            fa_wg_fence();
            fa_gemm8_s(sacc, q_rows, m->k + s * FA_K_BYTES);
            fa_gemm8_pv(o, pa, m->vt + sp * FA_VT_BYTES);
#if FA_PINGPONG
            fa_named_arrive(bar_other);
#endif
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
#pragma unroll
            for (int j = 0; j < FA_SACC; j++)
                FA_PIN(sacc[j]);
            fa_stage_release(m->k_empty + 8 * s, lane);
            if (it == nb - 1)
                fa_stage_release(m->q_empty, lane);
            fa_softmax8(kp, &r, sacc, w->n_max - 1 - it, row_max, row_sum, alpha);
#if FA_ORDER
            fa_softmax_order(m->scratch, row_sum);
#endif
            fa_wg_wait0();
            fa_operands_pin(o, pa, FA_KS);
            fa_stage_release(m->v_empty + 8 * sp, lane);
            fa_o_rescale_moved(o, alpha);
            fa_p_pack8(sacc, pa);
        }

        const int sp = (kv0 + nb - 1) % FA_STAGES, php = ((kv0 + nb - 1) / FA_STAGES) & 1;
#if FA_PINGPONG
        fa_named_sync(bar_mine);
#endif
        fa_mbar_wait(m->v_full + 8 * sp, php);
        fa_operands_pin(o, pa, FA_KS);
        fa_wg_fence();
        fa_gemm8_pv(o, pa, m->vt + sp * FA_VT_BYTES);
#if FA_PINGPONG
        /* Only the first warpgroup still has a partner waiting for its turn in this tile. */
        if (cw == 0)
            fa_named_arrive(bar_other);
#endif
        fa_wg_wait0();
        fa_operands_pin(o, pa, FA_KS);
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
    m.vr = m.vt + FA_STAGES * FA_VT_BYTES;
    m.q_full = m.vr + FA_STAGES * FA_VR_BYTES;
    m.q_empty = m.q_full + 8;
    m.scratch = m.q_empty + 8;
    m.k_full = m.scratch + 8;
    m.k_empty = m.k_full + 8 * FA_STAGES;
    m.r_full = m.k_empty + 8 * FA_STAGES;
    m.r_empty = m.r_full + 8 * FA_STAGES;
    m.v_full = m.r_empty + 8 * FA_STAGES;
    m.v_empty = m.v_full + 8 * FA_STAGES;
    m.r_keys = m.v_empty + 8 * FA_STAGES;

    if (threadIdx.x == 0) {
        fa_mbar_init(m.q_full, 1);
        fa_mbar_init(m.q_empty, FA_CONSUMER_WARPS);
        for (int s = 0; s < FA_STAGES; s++) {
            fa_mbar_init(m.k_full + 8 * s, 1);
            fa_mbar_init(m.k_empty + 8 * s, FA_CONSUMER_WARPS);
            fa_mbar_init(m.r_full + 8 * s, 1);
            fa_mbar_init(m.r_empty + 8 * s, FA_VT_WRITERS);
            fa_mbar_init(m.v_full + 8 * s, FA_VT_WRITERS);
            fa_mbar_init(m.v_empty + 8 * s, FA_CONSUMER_WARPS);
        }
        fa_mbar_init_fence();
    }
    __syncthreads();

    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / FA_WG_THREADS, 0);
    if (wg == 0) {
        fa_regs_producer();
        if (threadIdx.x == 0) {
            fa_tma_prefetch(&tm.q);
            fa_tma_prefetch(&tm.k);
            fa_tma_prefetch(&tm.v);
        }
#if FA_TRANSPOSE == 1
        /* Thread 0 loads, warps 1 .. 3 transpose; the rest of warp 0 has nothing to do. */
        if (threadIdx.x >= 32)
            fa_transpose8(&m);
#endif
#if FA_TRANSPOSE
        if (threadIdx.x != 0)
            return;
#endif
        fa_produce8(&kp, &tm, &m);
        return;
    }
    fa_regs_consumer();
    int kv = 0, q_round = 0, m_blocks, n_units;
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

#if FA_TRANSPOSE == 2
/* V^T ahead of the forward (grid ceil(sk16 / 128) x ceil(dv / 64) x b * hk, 256 threads,
 * FA_SMEM_FWD90_FP8_PREPASS bytes of dynamic shared memory). */
extern "C" __global__ void __launch_bounds__(FA_VT_THREADS)
    fa_fwd_vt(const fa_kparams kp, unsigned char *vt, fa_i64 sk16)
{
    extern __shared__ __align__(1024) unsigned char fa_smem[];
    fa_vt_prepass(&kp, vt, sk16, (unsigned char(*)[FA_VT_TK + 4])fa_smem);
}
#endif
