/*
 * The fp8 forward's V transposes (fa_fwd_sm90_fp8.cu's producer warpgroup): the raw V of a stage,
 * Vr [FA_DVP / FA_RB][FA_BN keys][FA_RB] as TMA wrote it (swizzled: 128B, or 64B at d 64), into
 * V^T [ceil(FA_BN / 128)][FA_DVP][128 keys] (K-major, 128B swizzle: the 16-byte chunk of keys
 * 16h .. 16h + 15 of row n sits at chunk (h % 8) ^ (n % 8) of block h / 8), the keys of each 16
 * permuted so that P packs from S's registers with no shuffle: logical key 16h + 4q + e holds the
 * actual key 16h + 8(e >> 1) + 2q + (e & 1). Keys past the sequence (varlen: the next sequence's
 * rows) are written as zeros, as 0 * inf would be NaN in P V.
 *   FA_TRANSPOSE 0: the whole warpgroup with plain 4-byte loads and stores, thread 0 also issuing
 *     the copies (it reloads Vr[s] once named barrier 4 says the transpose read it);
 *   FA_TRANSPOSE 1: warps 1 .. 3 with ldmatrix.trans and stmatrix, while thread 0 only loads
 *     (r_empty tells it when Vr[s] was read; r_keys gives them each stage's keys);
 *   FA_TRANSPOSE 2 (dense calls): a kernel ahead of the forward (fa_fwd_vt) writes the whole V^T
 *     to global memory in that order, and TMA's 128B swizzle lays each 128-key box out as above.
 * Included by fa_fwd_sm90_fp8.cu after its fa_smem8 and sizes.
 */
#ifndef FA_FWD_SM90_FP8_V_CUH
#define FA_FWD_SM90_FP8_V_CUH

#define FA_VT_BYTES FA_SMEM_FWD90_FP8_VT(FA_BN, FA_DVP)
/* The 16-key chunks of a column group one transposing warp takes (warps 1 .. 3). */
#define FA_VT_UNITS ((FA_BN / 16 + 2) / 3)

/* Byte `cb` (a column of V) of key row `key` in Vr: its FA_RB block, then the 16-byte chunk XOR
 * the swizzle's key (128B: key % 8; 64B: (key / 2) % 4). */
FA_DEV fa_u32 fa_vr_at(fa_u32 src, int key, int cb)
{
    const int b = cb % FA_RB, swz = FA_RB == 128 ? (key & 7) : ((key >> 1) & 3);
    return src + (cb / FA_RB) * (FA_BN * FA_RB) + key * FA_RB + ((((b >> 4) ^ swz) << 4) | (b & 15));
}

/* The 16-byte chunk of V^T row n holding logical keys 16h .. 16h + 15. */
FA_DEV fa_u32 fa_vt_at(fa_u32 dst, int n, int h)
{
    return dst + (h >> 3) * (FA_DVP * 128) + n * 128 + (((h & 7) ^ (n & 7)) << 4);
}

#if FA_TRANSPOSE == 0
/*
 * The whole warpgroup. A unit is 4 columns x 4 logical keys: four 4-byte loads of actual keys
 * 16b + 2q' (+1, +8, +9), a 4 x 4 byte transpose, four 4-byte stores. A warp's 32 units are 8
 * key quads x 4 column groups: with both swizzles that is at most 2 lanes a bank, loads and
 * stores alike.
 */
FA_DEV void fa_transpose_v(const fa_smem8 *m, int kv, int valid)
{
    const int s = kv % FA_STAGES, ph = (kv / FA_STAGES) & 1, tid = threadIdx.x;
    fa_mbar_wait(m->r_full + 8 * s, ph);
    fa_mbar_wait(m->v_empty + 8 * s, ph ^ 1);
    const fa_u32 src = m->vr + s * FA_V_BYTES, dst = m->vt + s * FA_VT_BYTES;
    constexpr int cg = FA_DVP / 16; /* column-group quads per warp row of units */
#pragma unroll 1
    for (int u = tid; u < FA_DVP * FA_BN / 16; u += FA_WG_THREADS) {
        const int l = u & 31, rest = u >> 5;
        const int c4 = (l & 3) + 4 * (rest % cg), kq = (l >> 2) + 8 * (rest / cg);
        const int b = kq >> 2, qq = kq & 3;
        const int k0 = 16 * b + 2 * qq;
        fa_u32 a[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int key = k0 + 8 * (e >> 1) + (e & 1);
            fa_u32 x;
            asm volatile("ld.shared.u32 %0, [%1];" : "=r"(x) : "r"(fa_vr_at(src, key, 4 * c4)));
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
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(fa_vt_at(dst, n, b) + 4 * qq), "r"(o[j])
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
#elif FA_TRANSPOSE == 1
/* ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: the four transposed 8 x 8 matrices whose rows
 * the lanes address (lane 8i + r: row r of matrix i), as fa_transpose_v describes. */
FA_DEV void fa_ldmatrix_t4(fa_u32 r[4], fa_u32 addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* Unit h of column group j (V^T rows from to_j): the byte gathers, the varlen tail's zeros, and
 * the stmatrix of the four rows each lane addresses. */
FA_DEV void fa_vt_unit_store(const fa_u32 r[4], fa_u32 to_j, int h, fa_u32 sel_a, int lane,
                             int valid)
{
    const fa_u32 sel_b = sel_a ^ 0x1111u;
    fa_u32 s0 = __byte_perm(r[0], r[1], sel_a), s1 = __byte_perm(r[0], r[1], sel_b);
    fa_u32 s2 = __byte_perm(r[2], r[3], sel_a), s3 = __byte_perm(r[2], r[3], sel_b);
#if FA_VARLEN
    if (16 * h + 16 > valid) {
        /* Bytes e of the words hold keys 16h + 2(lane % 4) + 8(e / 2) + e % 2. */
        const int k = 16 * h + 2 * (lane & 3) - valid;
        const fa_u32 keep = (k < 0 ? 0xffu : 0u) | (k + 1 < 0 ? 0xff00u : 0u) |
                            (k + 8 < 0 ? 0xff0000u : 0u) | (k + 9 < 0 ? 0xff000000u : 0u);
        s0 &= keep, s1 &= keep, s2 &= keep, s3 &= keep;
    }
#else
    (void)lane, (void)valid;
#endif
    /* h >> 3 is 0 while a stage has at most 8 chunks: said so, it frees registers. */
    const fa_u32 at = (to_j ^ ((h & 7) << 4)) + (FA_BN > 128 ? h >> 3 : 0) * (FA_DVP * 128);
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 ::"r"(at), "r"(s0), "r"(s1), "r"(s2), "r"(s3)
                 : "memory");
}

/*
 * Warp w (1 .. 3) of the producer warpgroup, for each group j of 32 columns the key chunks
 * h = w - 1, w + 2, ... A unit, keys 16h .. 16h + 15 by columns 32j .. 32j + 31:
 *   ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {r0, r1, r2, r3}, [addr]: four 8 x 8 matrices
 *     of 16-bit elements (column pairs), matrix i's row (lane % 8) at lane 8i + lane % 8's
 *     address: keys 8(i % 2) + 0 .. 7, columns 32j + 16(i / 2) .. + 15. Transposed, lane
 *     4c + q receives of matrix i the column pair c (columns 2c, 2c + 1) of keys 2q and 2q + 1:
 *     bytes (key 2q: col 2c, 2c + 1; key 2q + 1: col 2c, 2c + 1).
 *   __byte_perm(r0, r1, 0x6420) gathers column 2c's bytes of keys 2q, 2q + 1, 8 + 2q, 9 + 2q:
 *     logical keys 4q .. 4q + 3, the 4 bytes at 4q of V^T row 32j + 2c's chunk h; 0x7531 those
 *     of row 2c + 1; likewise r2, r3 for rows 32j + 16 + 2c, + 1.
 *   stmatrix.sync.aligned.m8n8.x4.shared.b16 [addr], {s0, s1, s2, s3}: matrix i's row (lane % 8)
 *     at lane 8i + lane % 8's address, its bytes 4q .. 4q + 3 from register si of lane 4 row + q.
 *     Lanes 4c + q of c >= 4 hand their odd row first, so each matrix's rows are 2c + (c >= 4)
 *     (or + (c < 4)): eight distinct rows mod 8, eight distinct swizzled chunks, no bank
 *     conflict (rows 2c alone would be two lanes a bank).
 * The ldmatrix rows are 8 keys at one 16-byte chunk: distinct chunks under both swizzles.
 */
FA_DEV void fa_transpose_v(const fa_smem8 *m, int kv, int valid)
{
    /* %tid.x read per stage (volatile): the lane's addresses made once and held across stages
     * did not fit the producer's registers beside the loads in flight. */
    fa_u32 tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    const int warp = (int)(tid >> 5), lane = (int)(tid & 31);
    const int s = kv % FA_STAGES, ph = (kv / FA_STAGES) & 1;
    fa_mbar_wait(m->r_full + 8 * s, ph);
    fa_mbar_wait(m->v_empty + 8 * s, ph ^ 1);
    const fa_u32 src = m->vr + s * FA_V_BYTES, dst = m->vt + s * FA_VT_BYTES;
    /* The lane's ldmatrix row (key lkey of chunk 0, column 16(lane / 16) of group 0) and
     * stmatrix row (lrow of group 0). Every base is 1024-byte aligned and a row's bytes start at
     * a multiple of FA_RB (or 128), so a chunk's swizzle is an XOR on the address's low bits:
     * group j's columns move the Vr chunk by XOR (2j) % (FA_RB / 16), chunk h's keys the V^T
     * chunk by XOR h % 8. */
    const int lkey = 8 * ((lane >> 3) & 1) + (lane & 7);
    const int mi = lane >> 3, rr = lane & 7;
    const int lrow = 16 * (mi >> 1) + 2 * rr + ((mi & 1) ^ (rr >= 4 ? 1 : 0));
    const fa_u32 from = fa_vr_at(src, lkey, 16 * (lane >> 4));
    const fa_u32 to = dst + lrow * 128 + ((lrow & 7) << 4);
    /* Lanes of c = lane / 4 >= 4 hand their odd row first: the byte selectors swap. */
    const fa_u32 sel_a = lane >= 16 ? 0x7531u : 0x6420u;
#pragma unroll 1
    for (int j = 0; j < FA_DVP / 32; j++) {
        const fa_u32 from_j = (from ^ (((2 * j) % (FA_RB / 16)) << 4)) +
                              (32 * j / FA_RB) * (FA_BN * FA_RB);
        const fa_u32 to_j = to + 32 * j * 128;
        /* The warp's chunks h = warp - 1 + 3i in pairs, both loads ahead of the stores: under
         * the consumers' wgmma reads an ldmatrix waits long, and two in flight is what the
         * producer's 24 registers hold. */
#pragma unroll
        for (int i0 = 0; i0 < FA_VT_UNITS; i0 += 2) {
            fa_u32 r[2][4];
#pragma unroll
            for (int i = i0; i < i0 + 2 && i < FA_VT_UNITS; i++) {
                const int h = warp - 1 + 3 * i;
                if (h < FA_BN / 16)
                    fa_ldmatrix_t4(r[i - i0], from_j + 16 * h * FA_RB);
            }
#pragma unroll
            for (int i = i0; i < i0 + 2 && i < FA_VT_UNITS; i++) {
                const int h = warp - 1 + 3 * i;
                if (h < FA_BN / 16)
                    fa_vt_unit_store(r[i - i0], to_j, h, sel_a, lane, valid);
            }
        }
    }
    /* Each lane's writes reach the async proxy (wgmma) before its warp announces the stage (and
     * the reads of Vr[s] are done before the loading thread reloads it). */
    fa_fence_proxy_async();
    __syncwarp();
    /* The stage's offset made again from kv (pinned): held across the loop, it and kv did not
     * both fit the producer's registers. */
    int kv_end = kv;
    FA_PINU(kv_end);
    if (lane == 0) {
        fa_mbar_arrive(m->r_empty + 8 * (kv_end % FA_STAGES));
        fa_mbar_arrive(m->v_full + 8 * (kv_end % FA_STAGES));
    }
}
#else
#define FA_VT_TK FA_FP8_VT_KEYS /* keys of a pre-pass tile */
#define FA_VT_TC FA_FP8_VT_COLS /* columns of V (rows of V^T) of a pre-pass tile */
#define FA_VT_THREADS FA_FP8_VT_THREADS

/*
 * One CTA of fa_fwd_vt: keys 128 x, columns 64 y of kv head z % hk of sequence z / hk, from V
 * [b, sk, hk, dv] (16-byte aligned rows, dv a multiple of 16) into
 *   vt: [b][hk][dv][sk16], sk16 = sk rounded up to 16; row n holds column n of V, logical key l
 *       at byte l (the permutation above; zero where its actual key is at or past sk).
 * Rows of 16 bytes in, through a column-major tile in shared memory (tile: [column][key],
 * FA_SMEM_FWD90_FP8_PREPASS bytes), rows of 16 bytes out.
 */
FA_DEV void fa_vt_prepass(const fa_kparams *kp, unsigned char *vt, fa_i64 sk16,
                          unsigned char (*tile)[FA_VT_TK + 4])
{
    const int k0 = blockIdx.x * FA_VT_TK, c0 = blockIdx.y * FA_VT_TC;
    const int bi = blockIdx.z / kp->hk, hk = blockIdx.z % kp->hk;
    const fa_i64 sk = kp->max_sk;
    const int dv = kp->dv;
    const unsigned char *v = (const unsigned char *)kp->v + bi * kp->v_bstride + hk * kp->v_hstride;
    /* Thread i: key i / 4, columns 16 (i % 4) .. + 15 (a warp reads 8 rows of 64 bytes). */
    for (int i = threadIdx.x; i < FA_VT_TK * FA_VT_TC / 16; i += FA_VT_THREADS) {
        const int key = i >> 2, c = 16 * (i & 3);
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (k0 + key < sk && c0 + c < dv)
            x = *(const uint4 *)(v + (k0 + key) * kp->v_rstride + c0 + c);
        const fa_u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int j = 0; j < 16; j++)
            tile[c + j][key] = (unsigned char)(w[j >> 2] >> (8 * (j & 3)));
    }
    __syncthreads();
    /* Thread i: V^T row i / 8, logical keys 16 (i % 8) .. + 15. Word e of the chunk holds actual
     * keys 4e .. 4e + 3; logical word q takes keys 2q, 2q + 1 (of word q / 2) and 8 + 2q, 9 + 2q
     * (of word 2 + q / 2), the same byte pair of each. */
    for (int i = threadIdx.x; i < FA_VT_TC * FA_VT_TK / 16; i += FA_VT_THREADS) {
        const int n = i >> 3, h = i & 7;
        if (c0 + n >= dv || k0 + 16 * h >= sk16)
            continue;
        const fa_u32 *t = (const fa_u32 *)&tile[n][16 * h];
        const fa_u32 a0 = t[0], a1 = t[1], a2 = t[2], a3 = t[3];
        const uint4 y = make_uint4(__byte_perm(a0, a2, 0x5410), __byte_perm(a0, a2, 0x7632),
                                   __byte_perm(a1, a3, 0x5410), __byte_perm(a1, a3, 0x7632));
        *(uint4 *)(vt + ((fa_i64)blockIdx.z * dv + c0 + n) * sk16 + k0 + 16 * h) = y;
    }
}
#endif

#endif /* FA_FWD_SM90_FP8_V_CUH */
