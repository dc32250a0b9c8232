/*
 * fp8 KV caches in the decode kernel (fa_decode.cu, FA_KV_FP8 1: e4m3, 2: e5m2;
 * include/flashattn.h, "FP8 caches"). Key blocks are copied as fp8 into stages of half the
 * size, then each block is converted once into one tile of q's dtype with fa_decode.cu's
 * swizzled layout, which the mma loop reads as it reads a bf16/fp16 stage: every fp8 value is
 * exact in fp16 and bf16, so the products are those of the dequantised cache. The descales are
 * folded in by fa_decode.cu (k_descale into the softmax scale of the CTA's (sequence, kv head),
 * v_descale into the final normalisation). The append rounds x / descale to fp8 by fa_rules.h's
 * rule, the CPU's, so that a device and the CPU write the same bytes.
 *
 * Needs fa_decode.cu's FA_BN, FA_DP, FA_DVP, FA_THREADS, FA_CHUNK_* macros, fa_rotary_elem and
 * fa_kv_locate.
 */
#ifndef FA_DECODE_FP8_CUH
#define FA_DECODE_FP8_CUH

typedef unsigned char fa_u8;

#define FA_CPR_K8 (FA_DP / 16) /* 16-byte chunks per fp8 row of K and V */
#define FA_CPR_V8 (FA_DVP / 16)
#define FA_STAGE8_BYTES (FA_BN * (FA_DP + FA_DVP))
#define FA_CHUNKS_K8 ((FA_BN * FA_CPR_K8 + FA_THREADS - 1) / FA_THREADS)
#define FA_CHUNKS_V8 ((FA_BN * FA_CPR_V8 + FA_THREADS - 1) / FA_THREADS)
/* The converted tile after the fp8 stages: both fit the stages of q's dtype (two at least). */
#define FA_CONV_AT (FA_STAGES * FA_STAGE8_BYTES)

#if FA_STAGES * FA_STAGE8_BYTES + FA_STAGE_BYTES > FA_STAGES * FA_STAGE_BYTES
#error "the fp8 stages and the converted tile must fit the stages of q's dtype"
#endif

/* Two fp8 values (bytes 0 and 1 of x) as a pair of q's dtype, exactly. */
FA_DEV fa_u32 fa_fp8x2_convert(fa_u32 x)
{
    /* Each byte into the high half of a 16-bit lane: an e5m2 code is then the fp16 with the
     * same value (e5m2 is fp16's top byte), an e4m3 code (s.eeee.mmm) the fp16 s.0eeee.mmm0000000,
     * its value times 2^-8 (subnormals too), restored by an fp16 multiply by 2^8, which keeps
     * fp16 subnormals. */
    const fa_u32 h = __byte_perm(x, 0, 0x1404);
#if FA_KV_FP8 == 1
#if __CUDA_ARCH__ >= 890
    /* cvt.rn.f16x2.e4m3x2: the hardware conversion (sm_89 and later), exact, NaN kept. */
    fa_u32 f16;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(f16) : "h"((unsigned short)(x & 0xffffu)));
    (void)h;
#else
    const fa_u32 mag = (h >> 1) & 0x3f803f80u, sign = h & 0x80008000u;
    fa_u32 f16;
    /* mul.rn.f16x2 by 2^8 (0x5c00): exact; then e4m3's NaN codes (s.1111.111), which the shift
     * made 480, become fp16 NaN. */
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(f16) : "r"(mag | sign), "r"(0x5c005c00u));
    const fa_u32 nan = __vcmpeq2(h & 0x7f007f00u, 0x7f007f00u);
    f16 = (f16 & ~nan) | (nan & 0x7fff7fffu);
#endif
#else
    const fa_u32 f16 = h;
#endif
#if FA_BF16
    /* fp16 -> bf16 through fp32: exact for every fp8 value (infinities and NaN kept). */
    fa_u32 lo, hi;
    asm("{ .reg .b16 a, b; .reg .f32 fa, fb; mov.b32 {a, b}, %2; cvt.f32.f16 fa, a;"
        " cvt.f32.f16 fb, b; mov.b32 %0, fa; mov.b32 %1, fb; }"
        : "=r"(lo), "=r"(hi)
        : "r"(f16));
    return fa_pack2(__uint_as_float(lo), __uint_as_float(hi));
#else
    return f16;
#endif
}

/* Copies this thread's chunks of keys [j0, j0 + FA_BN) of one fp8 cache (base g of the kv head,
 * strides bs and rs in bytes, cpr 16-byte chunks per row, n columns; paged, the rows' offsets
 * at rows, fa_decode_row_keep's) into the fp8 stage at shared address a (generic p), row-major,
 * zero-filling rows from jend on and columns from n. */
FA_DEV void fa_decode_copy8(const fa_kvseq *seq, fa_i64 j0, fa_i64 jend, const fa_u8 *g,
                            fa_i64 bs, fa_i64 rs, const fa_i64 *rows, int cpr, int nchunks, int n,
                            fa_u32 a, fa_u8 *p, const void *safe)
{
#pragma unroll
    for (int u = 0; u < FA_CHUNKS_K8 || u < FA_CHUNKS_V8; u++) {
        if (u >= nchunks || !FA_CHUNK_LIVE(u, cpr))
            break;
        const int r = FA_CHUNK_ROW(u, cpr), c = FA_CHUNK_COL(u, cpr);
        const int ok = j0 + r < jend && c * 16 < n;
#if FA_PAGED
        (void)bs;
        const fa_u8 *src = ok ? g + rows[r] + c * 16 : (const fa_u8 *)safe;
#else
        (void)rows;
        const fa_u8 *src = ok ? g + seq->blk * bs + (seq->start + j0 + r) * rs + c * 16
                              : (const fa_u8 *)safe;
#endif
#if FA_VEC
        (void)p;
        fa_cp_async16(a + r * cpr * 16 + c * 16, src, ok ? 16 : 0);
#else
        (void)a;
        fa_u8 *dst = p + r * cpr * 16 + c * 16;
#pragma unroll
        for (int e = 0; e < 16; e++)
            dst[e] = ok && c * 16 + e < n ? src[e] : (fa_u8)0;
#endif
    }
}

/* Copies keys [j0, j0 + FA_BN) of the sequence's fp8 caches into fp8 stage s (paged: the rows'
 * offsets at rows). */
FA_DEV void fa_decode_load8(const fa_dkparams *dp, int kh, const fa_kvseq *seq, fa_i64 j0,
                            fa_i64 jend, fa_u32 base_a, fa_u8 *base_p, int s, const fa_i64 *rows)
{
    const fa_kparams *kp = &dp->f;
    const fa_u8 *kg = (const fa_u8 *)kp->k + kh * kp->k_hstride;
    const fa_u8 *vg = (const fa_u8 *)kp->v + kh * kp->v_hstride;
    const int k_at = s * FA_STAGE8_BYTES, v_at = k_at + FA_BN * FA_DP;
    fa_decode_copy8(seq, j0, jend, kg, kp->k_bstride, kp->k_rstride, rows, FA_CPR_K8, FA_CHUNKS_K8,
                    kp->d, base_a + k_at, base_p + k_at, kp->k);
    fa_decode_copy8(seq, j0, jend, vg, kp->v_bstride, kp->v_rstride, rows + FA_BN, FA_CPR_V8,
                    FA_CHUNKS_V8, kp->dv, base_a + v_at, base_p + v_at, kp->v);
}

/* Rows of cpr8 fp8 chunks at st into the swizzled tile of q's dtype at cv (2 * cpr8 chunks a
 * row), 16 values a thread at a time. */
FA_DEV void fa_decode_convert_rows(const fa_u8 *st, char *cv, int cpr8)
{
    for (int i = threadIdx.x; i < FA_BN * cpr8; i += FA_THREADS) {
        const int r = i / cpr8, c = i - r * cpr8;
        const uint4 x = *(const uint4 *)(st + i * 16);
        uint4 lo, hi;
        lo.x = fa_fp8x2_convert(x.x), lo.y = fa_fp8x2_convert(x.x >> 16);
        lo.z = fa_fp8x2_convert(x.y), lo.w = fa_fp8x2_convert(x.y >> 16);
        hi.x = fa_fp8x2_convert(x.z), hi.y = fa_fp8x2_convert(x.z >> 16);
        hi.z = fa_fp8x2_convert(x.w), hi.w = fa_fp8x2_convert(x.w >> 16);
        *(uint4 *)(cv + fa_swz(r, 2 * c, 2 * cpr8)) = lo;
        *(uint4 *)(cv + fa_swz(r, 2 * c + 1, 2 * cpr8)) = hi;
    }
}

/* fp8 stage st (K then V) into the tile at cv, laid out as a stage of q's dtype. */
FA_DEV void fa_decode_convert(const fa_u8 *st, fa_u16 *cv)
{
    fa_decode_convert_rows(st, (char *)cv, FA_CPR_K8);
    fa_decode_convert_rows(st + FA_BN * FA_DP, (char *)cv + FA_BN * FA_DP * 2, FA_CPR_V8);
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
#pragma unroll
    for (int j = 0; j < FA_DP / 32; j++) {
        const int c = j * 32 + lane;
        if (c < dp->f.d)
            kc[c] = kv[j];
    }
#pragma unroll
    for (int j = 0; j < FA_DVP / 32; j++) {
        const int c = j * 32 + lane;
        if (c < dp->f.dv)
            vc[c] = vv[j];
    }
}

#endif /* FA_DECODE_FP8_CUH */
