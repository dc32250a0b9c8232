/*
 * The wide sm90 backward's layout (kernels/fa_bwd_sm90_wide.cu includes it after its tile
 * defines and byte sizes): the shared-memory offsets of its head comment, the 64-column blocks
 * of dK, dV and dQ that each consumer warpgroup holds, and its named barriers.
 */
#ifndef FA_BWD_SM90_WIDE_LAYOUT_CUH
#define FA_BWD_SM90_WIDE_LAYOUT_CUH

/* Byte offsets from the 1024-aligned base (the layout of fa_bwd_sm90_wide.cu's head comment):
 * K, V, the Q and dO stages, the P^T and dS^T buffers, the mbarriers ([FA_QSTAGES] each, 8 bytes
 * apart), the item slots. */
#define FA_OFF_V FA_K_BYTES
#define FA_OFF_Q (FA_OFF_V + FA_V_BYTES)
#define FA_OFF_DO (FA_OFF_Q + FA_QSTAGES * FA_Q_BYTES)
#define FA_OFF_P (FA_OFF_DO + FA_QSTAGES * FA_DO_BYTES)
#define FA_OFF_DS (FA_OFF_P + 2 * FA_PS_BYTES)
#define FA_OFF_KV_FULL (FA_OFF_DS + 2 * FA_PS_BYTES)
#define FA_OFF_Q_FULL (FA_OFF_KV_FULL + 8)
#define FA_OFF_Q_EMPTY (FA_OFF_Q_FULL + 8 * FA_QSTAGES)
#define FA_OFF_KV_EMPTY (FA_OFF_Q_EMPTY + 8 * FA_QSTAGES)

/* 64-column blocks of dK (and dQ) and of dV, and warpgroup 0's share of each (warpgroup 1 has
 * the rest): dK and dV halved (warpgroup 0 the larger dK half, the smaller dV half), then dQ's
 * blocks so that both warpgroups' products are as even as whole blocks allow. At most two of a
 * kind per warpgroup, so every product is m64n64 or m64n128. */
#define FA_NKB (FA_DP / 64)
#define FA_NVB (FA_DVP / 64)
#define FA_MAX2(a, b) ((a) > (b) ? (a) : (b))
#if FA_KEY_SPLIT
/* Each warpgroup all the blocks of dK and dV (of its keys), dQ's blocks halved (warpgroup 0 the
 * larger half), one block's product at a time. */
#define FA_K0 FA_NKB
#define FA_V0 FA_NVB
#define FA_Q0 ((FA_NKB + 1) / 2)
#define FA_KB_MAX FA_NKB
#define FA_VB_MAX FA_NVB
#define FA_QB_MAX 1
#define FA_DQ_HALVES 0
#else
#define FA_K0 ((FA_NKB + 1) / 2)
#define FA_V0 (FA_NVB / 2)
#define FA_Q0_EVEN ((2 * FA_NKB + FA_NVB) / 2 - FA_K0 - FA_V0)
#define FA_Q0 (FA_Q0_EVEN < 0 ? 0 : FA_Q0_EVEN > FA_NKB ? FA_NKB : FA_Q0_EVEN)
#define FA_KB_MAX FA_MAX2(FA_K0, FA_NKB - FA_K0) /* a warpgroup's blocks of dK at most */
#define FA_VB_MAX FA_MAX2(FA_V0, FA_NVB - FA_V0)
#define FA_QB_MAX FA_MAX2(FA_Q0, FA_NKB - FA_Q0)
/* At d = dv = 256 each warpgroup holds two blocks of each (192 accumulators): dQ's two blocks
 * then take turns in one block's registers (fa_consume). */
#define FA_DQ_HALVES (FA_NKB + FA_NVB == 8)
#if FA_DQ_HALVES && (FA_Q0 != 2 || FA_NKB - FA_Q0 != 2)
#error "fa_bwd_sm90_wide.cu: dQ in halves takes two blocks a warpgroup"
#endif
#if FA_KB_MAX > 2 || FA_VB_MAX > 2 || FA_QB_MAX > 2
#error "fa_bwd_sm90_wide.cu: a warpgroup holds at most two column blocks of each product"
#endif
#endif

/* Named barriers (0 is __syncthreads'): both consumer warpgroups, the tile's P^T and dS^T
 * written; both, the deterministic mode's turns; with 128-key blocks warpgroup cw alone
 * (FA_BAR_OWN + cw), its first half's P^T and dS^T written. */
#define FA_BAR_PDS 1
#define FA_BAR_DET 2
#define FA_BAR_OWN 3

#endif /* FA_BWD_SM90_WIDE_LAYOUT_CUH */
