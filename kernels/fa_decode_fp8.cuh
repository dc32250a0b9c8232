/*
 * fp8 KV caches in the decode kernel (fa_decode.cu, FA_KV_FP8 1: e4m3, 2: e5m2;
 * include/flashattn.h, "FP8 caches"). Key blocks are copied as fp8 into the stages and
 * converted in registers as the products read them: every fp8 value is exact in fp16, so the
 * products run on fp16 mma.sync whatever q's dtype, and are those of the dequantised cache.
 *
 * Fragment orders (m16n8k16; lane = 4 g + t):
 * - Q K^T: ldmatrix on the fp8 rows of K (16 bytes a row and k-step, read as b16 pairs) gives
 *   lane (g, t) the four codes at d = 4t .. 4t + 3 of its key g; they serve as the B fragment's
 *   k = 2t, 2t + 1 (codes 0, 1) and 2t + 8, 2t + 9 (codes 2, 3). The reduction over d does not
 *   care about its order, so Q is stored with each 16-column group in that same order
 *   (fa_q8_col) and read by the usual ldmatrix.
 * - P V: lane (g, t) reads 4 bytes of V's rows 2t, 2t + 1, 2t + 8, 2t + 9 (its B fragment's
 *   k) at columns 32 j + 4 g .. 4 g + 3, and takes byte i of each as the B fragment of n-tile
 *   4 j + i: n-tile 4 j + i, column n is V's column 32 j + 4 n + i. O's C fragment then holds,
 *   in lane (g, t), the 8 adjacent columns 32 j + 8 t .. 8 t + 7 (FA_OCOL).
 * The stages are swizzled by fa_swz8 so that both reads are free of bank conflicts at d 128
 * and 256.
 *
 * A bf16 q is scaled into fp16 by a power of two chosen per tile (fa_decode_load_q8); that
 * factor and k_descale join the softmax scale, v_descale the final normalisation
 * (fa_decode.cu). The append rounds x / descale to fp8 by fa_rules.h's rule, the CPU's, so that
 * a device and the CPU write the same bytes.
 *
 * Needs fa_decode.cu's FA_BN, FA_DP, FA_DVP, FA_BM, FA_THREADS, FA_NWARPS, FA_WKEYS, FA_NT,
 * FA_OT, FA_KS, FA_CPR_K macros, fa_rotary_elem, fa_decode_q_value and fa_kv_locate; its
 * stage copies are fa_decode.cu's (fa_decode_load, FA_KV_ESIZE 1).
 */
#ifndef FA_DECODE_FP8_CUH
#define FA_DECODE_FP8_CUH

typedef unsigned char fa_u8;

#define FA_CPR_K8 (FA_DP / 16) /* 16-byte chunks per fp8 row of K and V */
#define FA_CPR_V8 (FA_DVP / 16)

#if FA_DVP % 32 != 0 || FA_KS % 2 != 0
#error "fp8 caches: dv in groups of 32 columns, d in pairs of k-steps"
#endif

/* O's C fragment element (n-tile ot, lane quad position t, element e of a row's pair): its
 * column of v, by the P V order above. */
#define FA_OCOL(ot, t, e) (32 * ((ot) >> 2) + 8 * (t) + 4 * (e) + ((ot) & 3))

/* The swizzle key of row r of an fp8 tile of cpr 16-byte chunks per row (cpr 2, 4, 8, 12, 16):
 * it permutes the chunks within aligned groups, so that the 8 consecutive rows of an ldmatrix
 * and V's rows 2t (+ 1, + 8, + 9) over t land in different banks where the row width allows. */
FA_DEV int fa_swz8_key(int r, int cpr)
{
    return cpr % 8 == 0 ? (r & 7) : cpr % 4 == 0 ? ((r >> 1) & 3) : ((r >> 2) & 1);
}

/* Byte offset of chunk c of row r in a swizzled fp8 tile. */
FA_DEV int fa_swz8(int r, int c, int cpr) { return r * cpr * 16 + ((c ^ fa_swz8_key(r, cpr)) << 4); }

/* A lane's read of an fp8 tile, by chunks c0 + h for the compile-time even c0 of each read:
 * since (c0 + h) ^ key = c0 ^ (h ^ key), the address is the row's plus (c0 ^ (h ^ key)) << 4.
 * (Rows of 12 chunks do not start 128-byte aligned, so fa_swz_at's form does not apply.) */
typedef struct fa_rd8 {
    fa_u32 row; /* shared address of the row (plus the lane's byte within a chunk) */
    fa_u32 hk;  /* (h ^ the row's key) << 4 */
} fa_rd8;

FA_DEV fa_rd8 fa_rd8_make(fa_u32 base, int r, int h, int cpr, int byte)
{
    fa_rd8 x = {base + (fa_u32)(r * cpr * 16 + byte), (fa_u32)((h ^ fa_swz8_key(r, cpr)) << 4)};
    return x;
}

FA_DEV fa_u32 fa_rd8_at(fa_rd8 x, int c0) { return x.row + (((fa_u32)c0 << 4) ^ x.hk); }

/* Column c of q's row as stored in the Q tile for fp8 caches: within each group of 16, the
 * columns 4t, 4t + 1 at 2t, 2t + 1 and 4t + 2, 4t + 3 at 8 + 2t, 9 + 2t (the K fragments'
 * order, above). */
FA_DEV int fa_q8_col(int c) { return (c & ~15) | ((c & 2) << 2) | ((c >> 1) & 6) | (c & 1); }

/* Codes 0 and 1 (bytes 0 and 1 of x) as an f16x2, code 0 in the low half, exactly. */
FA_DEV fa_u32 fa_fp8x2_f16(fa_u32 x)
{
#if FA_KV_FP8 == 1 && __CUDA_ARCH__ >= 890
    /* cvt.rn.f16x2.e4m3x2: the hardware conversion (sm_89 and later), exact, NaN kept. */
    fa_u32 f16;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(f16) : "h"((unsigned short)(x & 0xffffu)));
    return f16;
#else
    /* Each byte into the high half of a 16-bit lane: an e5m2 code is then the fp16 with the
     * same value (e5m2 is fp16's top byte), an e4m3 code (s.eeee.mmm) the fp16 s.0eeee.mmm0000000,
     * its value times 2^-8 (subnormals too), restored by an fp16 multiply by 2^8, which keeps
     * fp16 subnormals. */
    const fa_u32 h = __byte_perm(x, 0, 0x1404);
#if FA_KV_FP8 == 1
    const fa_u32 mag = (h >> 1) & 0x3f803f80u, sign = h & 0x80008000u;
    fa_u32 f16;
    /* mul.rn.f16x2 by 2^8 (0x5c00): exact; then e4m3's NaN codes (s.1111.111), which the shift
     * made 480, become fp16 NaN. */
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(f16) : "r"(mag | sign), "r"(0x5c005c00u));
    const fa_u32 nan = __vcmpeq2(h & 0x7f007f00u, 0x7f007f00u);
    return (f16 & ~nan) | (nan & 0x7fff7fffu);
#else
    return h;
#endif
#endif
}

/* Two floats as an f16x2 (lo in the low half). */
FA_DEV fa_u32 fa_pack2_f16(float lo, float hi)
{
    fa_u32 r;
    /* cvt.rn.f16x2.f32 d, a, b: d.hi = f16(a), d.lo = f16(b) */
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

/* c += a * b, mma.sync m16n8k16 on fp16 operands, fp32 accumulate (fa_mma16816's fragments). */
FA_DEV void fa_mma16816_f16(float c[4], const fa_u32 a[4], fa_u32 b0, fa_u32 b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* ld.shared.b32 at shared address a. */
FA_DEV fa_u32 fa_lds32(fa_u32 a)
{
    fa_u32 r;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(r) : "r"(a));
    return r;
}

/* The Q tile for fp8 caches: packed rows [r0, r0 + FA_BM) of kv head kh as fp16 (rotated where
 * rotary is on, zero past the rows and columns), each 16-column group in fa_q8_col's order. A
 * bf16 q is first scaled by 2^e, e chosen from the tile's largest magnitude m so that m 2^e
 * lies in [2^14, 2^15): fp16 holds every value, to its precision but for values 2^-28 m or
 * smaller, whose products are below the rounding of the largest. Returns 2^-e (1 for an fp16
 * q), for the softmax scale. `scratch` is FA_NWARPS floats of shared memory no copy is writing;
 * every thread calls this, and it ends with every thread past its reads of scratch. */
FA_DEV float fa_decode_load_q8(const fa_dkparams *dp, int bi, fa_i64 q0, int kh,
                               const fa_kvseq *seq, int r0, int rows, int g, fa_u16 *q_p,
                               float *scratch)
{
    const fa_kparams *kp = &dp->f;
    const fa_u16 *qb = (const fa_u16 *)kp->q + bi * kp->q_bstride + q0 * kp->q_rstride;
    float up = 1.f, down = 1.f;
#if FA_BF16
    float m = 0.f;
    for (int i = threadIdx.x; i < FA_BM * FA_DP; i += FA_THREADS) {
        const int r = i / FA_DP, c = i - r * FA_DP;
        if (r0 + r < rows && c < kp->d)
            m = fmaxf(m, fabsf(fa_decode_q_value(dp, qb, seq, r0 + r, c, g, kh)));
    }
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0)
        scratch[threadIdx.x >> 5] = m;
    __syncthreads();
    m = 0.f;
#pragma unroll
    for (int w = 0; w < FA_NWARPS; w++)
        m = fmaxf(m, scratch[w]);
    __syncthreads();
    /* m's exponent; none for 0, inf or NaN (they pass through fp16 as they are). */
    const int em = (int)((__float_as_uint(m) >> 23) & 0xff) - 127;
    if (m > 0.f && em < 128) {
        const int e = 14 - em < -100 ? -100 : 14 - em > 100 ? 100 : 14 - em;
        up = __uint_as_float((fa_u32)(127 + e) << 23);
        down = __uint_as_float((fa_u32)(127 - e) << 23);
    }
#else
    (void)scratch;
#endif
    for (int i = threadIdx.x; i < FA_BM * FA_DP; i += FA_THREADS) {
        const int r = i / FA_DP, c = i - r * FA_DP;
        float x = 0.f;
        if (r0 + r < rows && c < kp->d)
            x = fa_decode_q_value(dp, qb, seq, r0 + r, c, g, kh) * up;
        const int s = fa_q8_col(c);
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        q_p[(fa_swz(r, s >> 3, FA_CPR_K) >> 1) + (s & 7)] = h;
    }
    return down;
}

/* S += Q K^T for the warp's FA_WKEYS keys of the block: q_ld the Q tile's ldmatrix address (as
 * fa_decode.cu's), k this lane's ldmatrix row of the fp8 K stage (key (lane & 7) + 8 ((lane >>
 * 3) & 1) of the warp's, h = lane >> 4) at byte offset soff. */
FA_DEV void fa_decode_qk8(float s[FA_NT][4], fa_u32 q_ld, fa_rd8 k, fa_u32 soff)
{
    k.row += soff;
#pragma unroll 1
    for (int ks2 = 0; ks2 < FA_KS / 2; ks2++) {
        fa_u32 qa0[4], qa1[4];
        fa_ldmatrix_x4(qa0, fa_swz_at(q_ld, 4 * ks2));
        fa_ldmatrix_x4(qa1, fa_swz_at(q_ld, 4 * ks2 + 2));
#pragma unroll
        for (int np = 0; np < FA_NT / 2; np++) {
            /* kb: keys 0-7 and 8-15 of the pair at k-step 2 ks2, then at 2 ks2 + 1. */
            fa_u32 kb[4];
            fa_ldmatrix_x4(kb, fa_rd8_at(k, 2 * ks2) + np * 16 * FA_CPR_K8 * 16);
            fa_mma16816_f16(s[2 * np], qa0, fa_fp8x2_f16(kb[0]), fa_fp8x2_f16(kb[0] >> 16));
            fa_mma16816_f16(s[2 * np + 1], qa0, fa_fp8x2_f16(kb[1]), fa_fp8x2_f16(kb[1] >> 16));
            fa_mma16816_f16(s[2 * np], qa1, fa_fp8x2_f16(kb[2]), fa_fp8x2_f16(kb[2] >> 16));
            fa_mma16816_f16(s[2 * np + 1], qa1, fa_fp8x2_f16(kb[3]), fa_fp8x2_f16(kb[3] >> 16));
        }
    }
}

/* O += P V for the warp's keys: s the probabilities (S's C fragments), v[i] this lane's read of
 * V's row 2t, 2t + 1, 2t + 8, 2t + 9 (i = 0..3) of the warp's first 16 keys at columns 4 g ..
 * 4 g + 3 (h = g >> 2, byte 4 (g & 3)), in the stage at byte offset soff. */
FA_DEV void fa_decode_pv8(float o[FA_OT][4], const float s[FA_NT][4], const fa_rd8 v[4],
                          fa_u32 soff)
{
#pragma unroll
    for (int kk = 0; kk < FA_WKEYS / 16; kk++) {
        fa_u32 pa[4];
        pa[0] = fa_pack2_f16(s[2 * kk][0], s[2 * kk][1]);
        pa[1] = fa_pack2_f16(s[2 * kk][2], s[2 * kk][3]);
        pa[2] = fa_pack2_f16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[3] = fa_pack2_f16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int j = 0; j < FA_DVP / 32; j++) {
            fa_u32 w[4];
#pragma unroll
            for (int i = 0; i < 4; i++)
                w[i] = fa_lds32(fa_rd8_at(v[i], 2 * j) + soff + kk * 16 * FA_CPR_V8 * 16);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                /* Byte i of rows 2t, 2t + 1 and of rows 2t + 8, 2t + 9: the B fragment's k
                 * pairs of n-tile 4 j + i. */
                const fa_u32 sel = (fa_u32)(i | ((4 + i) << 4));
                fa_mma16816_f16(o[4 * j + i], pa, fa_fp8x2_f16(__byte_perm(w[0], w[1], sel)),
                                fa_fp8x2_f16(__byte_perm(w[2], w[3], sel)));
            }
        }
    }
}

/* One row of out from O's C fragments (FA_OCOL's columns: lane t holds 8 adjacent ones of each
 * 32) times scale: columns below n, with one 16-byte store per 32 under FA_VEC. */
FA_DEV void fa_decode_store_row8(fa_u16 *r, int n, const float o[FA_OT][4], int hf, int t,
                                 float scale, int live)
{
    if (!live)
        return;
#pragma unroll
    for (int j = 0; j < FA_DVP / 32; j++) {
        const int col = 32 * j + 8 * t;
#if FA_VEC
        /* w[u]: columns col + 2u, col + 2u + 1, i.e. n-tiles 4 j + 2 (u & 1) (+ 1), element
         * u >> 1 of the row's pair. */
        fa_u32 w[4];
#pragma unroll
        for (int u = 0; u < 4; u++)
            w[u] = fa_pack2(o[4 * j + 2 * (u & 1)][2 * hf + (u >> 1)] * scale,
                            o[4 * j + 2 * (u & 1) + 1][2 * hf + (u >> 1)] * scale);
        if (col < n)
            asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(r + col), "r"(w[0]),
                         "r"(w[1]), "r"(w[2]), "r"(w[3])
                         : "memory");
#else
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int e = 0; e < 2; e++)
                if (col + 4 * e + i < n)
                    r[col + 4 * e + i] = fa_from_float(o[4 * j + i][2 * hf + e] * scale);
#endif
    }
}

/* x rounded to the cache's fp8 kind (fa_rules.h, as fa_fp8_from_f32 rounds). */
FA_DEV fa_u8 fa_fp8_encode(float x)
{
#if FA_KV_FP8 == 1
    return (fa_u8)fa_rule_e4m3_from_bits(__float_as_uint(x));
#else
    return (fa_u8)fa_rule_e5m2_from_bits(__float_as_uint(x));
#endif
}

/* The descale of (sequence bi, kv head kh): 1 without a tensor. */
FA_DEV float fa_fp8_descale(const float *t, fa_i64 bs, fa_i64 hs, int bi, int kh)
{
    return t ? t[bi * bs + kh * hs] : 1.f;
}

/* New row s of sequence bi, kv head kh (cache block blk, row `row`; kn, vn its new key and
 * value, cr, sr its rotary angles), written by one warp into the fp8 caches: x / descale rounded
 * to fp8, the key rotated in fp32 first. The whole row is read before any byte is written. */
FA_DEV void fa_kv_append_row8(const fa_dkparams *dp, int bi, int kh, int lane, fa_i64 blk,
                              fa_i64 row, const fa_u16 *kn, const fa_u16 *vn, const fa_u16 *cr,
                              const fa_u16 *sr)
{
    const float kd = fa_fp8_descale(dp->k_descale, dp->kd_bstride, dp->kd_hstride, bi, kh);
    const float vd = fa_fp8_descale(dp->v_descale, dp->vd_bstride, dp->vd_hstride, bi, kh);
    fa_u8 kv[FA_DP / 32 > 0 ? FA_DP / 32 : 1], vv[FA_DVP / 32 > 0 ? FA_DVP / 32 : 1];
#pragma unroll
    for (int j = 0; j < FA_DP / 32; j++) {
        const int c = j * 32 + lane;
        if (c < dp->f.d) {
            const float x = dp->rot_cos && c < dp->rotary_dim
                                ? fa_rotary_elem(kn, c, dp->rotary_dim, dp->rotary_interleaved,
                                                 cr, sr)
                                : fa_to_float(kn[c]);
            kv[j] = fa_fp8_encode(__fdiv_rn(x, kd));
        }
    }
#pragma unroll
    for (int j = 0; j < FA_DVP / 32; j++) {
        const int c = j * 32 + lane;
        if (c < dp->f.dv)
            vv[j] = fa_fp8_encode(__fdiv_rn(fa_to_float(vn[c]), vd));
    }
    __syncwarp();
    fa_u8 *kc = (fa_u8 *)dp->f.k + blk * dp->f.k_bstride + row * dp->f.k_rstride +
                kh * dp->f.k_hstride;
    fa_u8 *vc = (fa_u8 *)dp->f.v + blk * dp->f.v_bstride + row * dp->f.v_rstride +
                kh * dp->f.v_hstride;
    FA_KV_ROW_STORE(dp, lane, kc, vc, kv, vv);
}

#endif /* FA_DECODE_FP8_CUH */
