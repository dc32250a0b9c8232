/*
 * fa_block_mask_build on a device: a block mask from a mask program (fa_mask_mod, generated
 * into fa_mod_gen.cuh), with the CPU builder's rule (src/cpu/fa_cpu_block_mask.c): the kept
 * pairs of each (query block, key block) counted, a block full where every pair of it is kept
 * (never at an edge), partial where some are, and each (b, h, query block)'s lists written in
 * FlexAttention's order (the listed blocks ascending, then the rest ascending).
 *
 * Defines: FA_MASK_MOD, FA_MOD_AUX_I32, FA_MOD_AUX_OFF32 (the plan's); FA_THREADS.
 * Entry point: fa_block_mask_build, grid (nq, rh, rb), FA_THREADS threads, nk bytes of dynamic
 * shared memory (the row's states). Warps take a block's query rows, lanes its keys.
 */
#include "fa_common.cuh"
#include "fa_bmparams.h"
#include "fa_mod_flags.h"
#include "fa_mod.cuh"

#define FA_BMB_WARPS (FA_THREADS / 32)

/* The state a block takes from its count of kept pairs: 0 skipped, 1 partial, 2 full. */
FA_DEV int fa_bmb_state(const fa_bmparams *p, long long kept, int rows, int keys)
{
    const int full = p->full_num && rows == p->q_block && keys == p->kv_block &&
                     kept == (long long)rows * keys;
    return kept == 0 ? 0 : full ? 2 : 1;
}

/* Row (b, h, qb)'s count and list of the blocks in `state` (st: the row's states), by warp 0:
 * 32 blocks at a time, each lane's place from a ballot's prefix. */
FA_DEV void fa_bmb_write(int *num, const fa_i64 *ns, int *idx, const fa_i64 *is, int b, int h,
                         int qb, const unsigned char *st, int nk, int state, int lane)
{
    int *row = idx + b * is[0] + h * is[1] + qb * is[2];
    int n = 0;
    for (int pass = 0; pass < 2; pass++) /* those in the state, then the rest */
        for (int k0 = 0; k0 < nk; k0 += 32) {
            const int kb = k0 + lane;
            const int take = kb < nk && ((st[kb] == state) == (pass == 0));
            const unsigned bits = __ballot_sync(0xffffffffu, take);
            if (take)
                row[(n + __popc(bits & ((1u << lane) - 1))) * is[3]] = kb;
            n += __popc(bits);
            if (pass == 0 && k0 + 32 >= nk && lane == 0)
                num[b * ns[0] + h * ns[1] + qb * ns[2]] = n;
        }
}

extern "C" __global__ void __launch_bounds__(FA_THREADS) fa_block_mask_build(const fa_bmparams p)
{
    extern __shared__ unsigned char fa_bmb_states[];
    __shared__ long long kept_s;
    const int qb = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int q0 = qb * p.q_block, rows = min(p.q_block, p.sq - q0);
    for (int kb = 0; kb < p.nk; kb++) {
        const int j0 = kb * p.kv_block, keys = min(p.kv_block, p.sk - j0);
        if (threadIdx.x == 0)
            kept_s = 0;
        __syncthreads();
        long long kept = 0;
        for (int i = warp; i < rows; i += FA_BMB_WARPS)
            for (int j = lane; j < keys; j += 32)
                kept += fa_mask_mod(&p.f, b, h, q0 + i, j0 + j);
#pragma unroll
        for (int s = 16; s > 0; s >>= 1)
            kept += __shfl_xor_sync(0xffffffffu, kept, s);
        if (lane == 0 && kept)
            atomicAdd((unsigned long long *)&kept_s, (unsigned long long)kept);
        __syncthreads();
        if (threadIdx.x == 0)
            fa_bmb_states[kb] = (unsigned char)fa_bmb_state(&p, kept_s, rows, keys);
    }
    __syncthreads();
    if (warp != 0)
        return;
    /* every sequence and head this evaluation stands for */
    for (int bo = b; bo < p.b; bo += p.rb)
        for (int ho = h; ho < p.h; ho += p.rh) {
            fa_bmb_write(p.num, p.num_stride, p.idx, p.idx_stride, bo, ho, qb, fa_bmb_states,
                         p.nk, 1, lane);
            if (p.full_num)
                fa_bmb_write(p.full_num, p.full_num_stride, p.full_idx, p.full_idx_stride, bo, ho,
                             qb, fa_bmb_states, p.nk, 2, lane);
        }
}
