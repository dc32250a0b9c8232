/*
 * Device helpers every kernel family shares: small types, fp16/bf16 conversions, the PTX wrappers
 * of the sm80 tensor-core path (cp.async, ldmatrix, mma.sync) and counter-based Philox.
 * CUDA C compiled by NVRTC with no headers: everything here is builtins and inline PTX.
 *
 * Needs FA_BF16 (0: fp16 data, 1: bf16 data).
 */
#ifndef FA_COMMON_CUH
#define FA_COMMON_CUH

#include "fa_kparams.h"
#include "fa_rules.h"

typedef unsigned short fa_u16;

#define FA_DEV static __device__ __forceinline__
#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f
#define FA_INF __int_as_float(0x7f800000)

FA_DEV int fa_min(int a, int b) { return a < b ? a : b; }
FA_DEV int fa_max(int a, int b) { return a > b ? a : b; }

/* The 32-bit .shared window address of a generic pointer into shared memory. */
FA_DEV fa_u32 fa_smem_addr(const void *p)
{
    fa_u32 a;
    /* cvta.to.shared.u64: generic -> shared window; cvt.u32.u64: shared addresses fit 32 bits */
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

/* ---- swizzled tiles of 16-byte chunks (the sm80 families' shared-memory layout) ---- */

/* The swizzle key of row r: the value XORed into its chunk index. With 8 or more chunks per row
 * it is r % 8; with 4 (64-byte rows, two rows per 128-byte line) it is (r / 2) % 4. */
FA_DEV int fa_swz_key(int r, int cpr) { return cpr >= 8 ? (r & 7) : ((r >> 1) & 3); }

/* Byte offset of chunk c of row r in a swizzled tile of cpr 16-byte chunks per row. */
FA_DEV int fa_swz(int r, int c, int cpr) { return r * cpr * 16 + ((c ^ fa_swz_key(r, cpr)) << 4); }

/* The address of chunk c0 + h of a row, from `a`, the address of chunk h (0 or 1) of the same
 * row, for an even compile-time c0. Since c0 is even, (c0 + h) ^ key = c0 ^ (h ^ key): the
 * low three bits of c0 flip bits 4..6 of `a` (which hold (h ^ key) and are zero in the row's
 * start, the tiles being 128-byte aligned), the rest is a plain offset. So a thread computes one
 * address per operand once and each ldmatrix costs a LOP3 and an immediate offset. The same
 * holds with any row added whose key is 0 (multiples of 8 rows, or of 16 with cpr 4). */
FA_DEV fa_u32 fa_swz_at(fa_u32 a, int c0) { return (a ^ ((c0 & 7) << 4)) + ((c0 & ~7) << 4); }

/* Element conversions; the bf16 path widens by a shift since bf16 is fp32's top half. */
FA_DEV float fa_to_float(fa_u16 x)
{
#if FA_BF16
    return __uint_as_float((fa_u32)x << 16);
#else
    float f;
    /* cvt.f32.f16: exact widening of one fp16 */
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
#endif
}

FA_DEV fa_u16 fa_from_float(float f)
{
    fa_u16 x;
#if FA_BF16
    /* cvt.rn.bf16.f32: round to nearest even (sm_80+) */
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(x) : "f"(f));
#else
    /* cvt.rn.f16.f32: round to nearest even */
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(x) : "f"(f));
#endif
    return x;
}

/* Two floats as one 32-bit register of two 16-bit values, lo in bits 0..15 (the operand order of
 * the f16x2/bf16x2 fragments of mma.sync: the lower column in the lower half). */
FA_DEV fa_u32 fa_pack2(float lo, float hi)
{
    fa_u32 r;
#if FA_BF16
    /* cvt.rn.bf16x2.f32 d, a, b: d.hi = bf16(a), d.lo = bf16(b) */
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    /* cvt.rn.f16x2.f32 d, a, b: d.hi = f16(a), d.lo = f16(b) */
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

/* Columns col and col + 1 of a 16-bit row (lo and hi, a C fragment's pair), those below n: one
 * 32-bit store where FA_VEC promises aligned rows and an even n, else one element at a time. */
FA_DEV void fa_store_pair(fa_u16 *row, int col, int n, float lo, float hi)
{
#if FA_VEC
    if (col < n)
        *(fa_u32 *)(row + col) = fa_pack2(lo, hi);
#else
    if (col < n)
        row[col] = fa_from_float(lo);
    if (col + 1 < n)
        row[col + 1] = fa_from_float(hi);
#endif
}

/* The quad's 4 x 4 transpose of 32-bit words: lane t of the quad gives w[i] and ends with lane
 * i's w[t] in w[i]. Two butterfly steps (partner lane t ^ 1, then t ^ 2), each trading the two
 * words whose index differs from the lane's in that bit. Every lane of the warp must call it. */
FA_DEV void fa_quad_transpose(fa_u32 w[4], int t)
{
#pragma unroll
    for (int m = 1; m <= 2; m <<= 1) {
        const int up = (t & m) != 0;
        /* The words this lane gives: index bit m unlike the lane's (m = 1: indices 1, 3 for an
         * even lane; m = 2: 2, 3 for lanes 0, 1); the partner's arrive in their place. */
        const fa_u32 s0 = up ? w[0] : w[m], s1 = up ? w[m == 1 ? 2 : 1] : w[3];
        const fa_u32 r0 = __shfl_xor_sync(0xffffffffu, s0, m);
        const fa_u32 r1 = __shfl_xor_sync(0xffffffffu, s1, m);
        if (m == 1) {
            w[0] = up ? r0 : w[0], w[1] = up ? w[1] : r0;
            w[2] = up ? r1 : w[2], w[3] = up ? w[3] : r1;
        } else {
            w[0] = up ? r0 : w[0], w[1] = up ? r1 : w[1];
            w[2] = up ? w[2] : r0, w[3] = up ? w[3] : r1;
        }
    }
}

/* One row of C fragments (half hf of acc[nt][e]: row g + 8 hf, column 8 nt + 2t + (e % 2)),
 * times scale, in 16-bit into row r (16-byte aligned) below column n (a multiple of 8), when
 * live: the quad's four lanes trade their pairs of each 32 columns so that lane t holds columns
 * 8 (4j + t) .. + 7 and stores them as 16 bytes. Every lane of the warp must call it (live
 * only gates the stores). A 4-byte store per pair would have a warp's store touch 8 rows with
 * 16 bytes each, several times the memory transactions. */
FA_DEV void fa_store_row16(fa_u16 *r, int n, const float acc[][4], int cols, int hf, int t,
                           float scale, int live)
{
#pragma unroll
    for (int j = 0; j < cols / 32; j++) {
        fa_u32 w[4];
#pragma unroll
        for (int u = 0; u < 4; u++)
            w[u] = fa_pack2(acc[4 * j + u][2 * hf] * scale, acc[4 * j + u][2 * hf + 1] * scale);
        fa_quad_transpose(w, t);
        const int col = 8 * (4 * j + t);
        /* st.global.v4.b32: one 16-byte store (a plain uint4 store was split into four 4-byte
         * ones where its registers were not adjacent). */
        if (live && col < n)
            asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(r + col), "r"(w[0]),
                         "r"(w[1]), "r"(w[2]), "r"(w[3])
                         : "memory");
    }
}

/* 2^x on the special-function unit; -inf gives 0, which the online softmax relies on. */
FA_DEV float fa_exp2(float x)
{
    float y;
    /* ex2.approx.ftz.f32: about 2 ulp, denormals flushed */
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* 2 log2(e): tanh's exponent in base 2 (fa_tanh_fast). */
#define FA_2LOG2E 2.88539008177792681f

/* 1 / (2^x + 1) on the special-function unit (ex2, then rcp.approx.ftz.f32: within 1 ulp);
 * 0 once 2^x overflows, 1 once it flushes. */
FA_DEV float fa_rcp_exp2p1(float x)
{
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(fa_exp2(x) + 1.f));
    return r;
}

/* tanh(x) = 1 - 2 / (2^(2 x log2 e) + 1): no branch and an absolute error of a few 1e-7 (a
 * softcapped score, tanh times the cap, needs the absolute error small); +-1 once the power
 * overflows or flushes, NaN kept. libm's tanhf selects between a polynomial and this form in
 * about four times the instructions. */
FA_DEV float fa_tanh_fast(float x) { return fmaf(-2.f, fa_rcp_exp2p1(x * FA_2LOG2E), 1.f); }

/* x, made to wait for y: x | (y & zero), with zero 0 at run time but unknown to ptxas
 * (fa_kparams.zero), so x's users are scheduled after y is ready. One LOP3; empty asm
 * statements do not reach ptxas's schedule. */
FA_DEV float fa_after(float x, float y, int zero)
{
    return __uint_as_float(__float_as_uint(x) | (__float_as_uint(y) & (fa_u32)zero));
}


/* cp.async.cg.shared.global: 16-byte copy global -> shared that skips L1 and does not block;
 * bytes past src_bytes are zero-filled, so src_bytes = 0 writes a zero chunk and reads nothing. */
FA_DEV void fa_cp_async16(fa_u32 dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}

/* cp.async.commit_group: closes the group of copies issued so far by this thread. */
FA_DEV void fa_cp_async_commit(void) { asm volatile("cp.async.commit_group;" ::: "memory"); }

/* cp.async.wait_group 0: waits until every committed group of this thread has landed. */
FA_DEV void fa_cp_async_wait_all(void) { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

/* ldmatrix.sync.aligned.m8n8.x4.shared.b16: four 8x8 matrices of 16-bit values. Lanes 8i..8i+7
 * give the addresses of the 8 rows (16 bytes each) of matrix i; lane l receives, in r[i], row l/4,
 * elements 2(l%4) and 2(l%4)+1 of matrix i: the A/B fragment layout of mma.m16n8k16. */
FA_DEV void fa_ldmatrix_x4(fa_u32 r[4], fa_u32 addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* The same with .trans: lane l receives column l/4, rows 2(l%4) and 2(l%4)+1 of matrix i, so a
 * row-major [k][n] tile serves as the column-major B operand. */
FA_DEV void fa_ldmatrix_x4_trans(fa_u32 r[4], fa_u32 addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* c += a * b with mma.sync.aligned.m16n8k16.row.col, fp32 accumulate. With g = lane/4 and
 * t = lane%4, the fragments are:
 *   a[0]: A[g][2t..2t+1]  a[1]: A[g+8][2t..2t+1]  a[2]: A[g][2t+8..]  a[3]: A[g+8][2t+8..]
 *   b[0]: B[2t..2t+1][g]  b[1]: B[2t+8..2t+9][g]
 *   c[0..1]: C[g][2t..2t+1]  c[2..3]: C[g+8][2t..2t+1] */
FA_DEV void fa_mma16816(float c[4], const fa_u32 a[4], fa_u32 b0, fa_u32 b1)
{
#if FA_BF16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

/* One Philox4x32 round on the counter words c0..c3 (lvalues) under the round key (k0, k1). */
#define FA_PHILOX_ROUND(c0, c1, c2, c3, k0, k1)                                                    \
    do {                                                                                           \
        fa_u32 lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);                            \
        fa_u32 lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);                            \
        c0 = hi1 ^ c1 ^ (k0);                                                                      \
        c1 = lo1;                                                                                  \
        c2 = hi0 ^ c3 ^ (k1);                                                                      \
        c3 = lo0;                                                                                  \
    } while (0)

/* Philox4x32 (FA_RULE_PHILOX_ROUNDS rounds) exactly as src/core/fa_philox.h computes it on the
 * CPU (the dropout mask must be bit-identical): the four words of block (c0, c1, c2, c3) under
 * key (k0, k1), in w[0..3]. */
FA_DEV void fa_philox4(fa_u32 c0, fa_u32 c1, fa_u32 c2, fa_u32 c3, fa_u32 k0, fa_u32 k1,
                       fa_u32 w[4])
{
#pragma unroll
    for (int round = 0; round < FA_RULE_PHILOX_ROUNDS; round++) {
        FA_PHILOX_ROUND(c0, c1, c2, c3, k0, k1);
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    w[0] = c0;
    w[1] = c1;
    w[2] = c2;
    w[3] = c3;
}

/* The same block with the round keys precomputed on the host (fa_philox_keys): round r uses
 * keys[2r], keys[2r + 1]. */
FA_DEV void fa_philox4_keys(fa_u32 c0, fa_u32 c1, fa_u32 c2, fa_u32 c3, const fa_u32 *keys,
                            fa_u32 w[4])
{
#pragma unroll
    for (int round = 0; round < FA_RULE_PHILOX_ROUNDS; round++)
        FA_PHILOX_ROUND(c0, c1, c2, c3, keys[2 * round], keys[2 * round + 1]);
    w[0] = c0;
    w[1] = c1;
    w[2] = c2;
    w[3] = c3;
}

/* w[i] for a run-time i in 0..3, as selects: an indexed local array would go to local memory. */
FA_DEV fa_u32 fa_pick4(const fa_u32 w[4], int i)
{
    const fa_u32 lo = (i & 1) ? w[1] : w[0], hi = (i & 1) ? w[3] : w[2];
    return (i & 2) ? hi : lo;
}

/* The dropout stream of (sequence, head): Philox's counter words 2 and 3. */
FA_DEV fa_u64 fa_dropout_stream(const fa_kparams *kp, int batch, int head)
{
    return kp->offset + (fa_u64)batch * (fa_u64)kp->h + (fa_u64)head;
}

/* The 32-bit word holding column col's number in one row (fa_rules.h's dropout rule); the number
 * is (word >> FA_RULE_DROPOUT_SHIFT(col)) & 0xff. */
FA_DEV fa_u32 fa_dropout_word(const fa_kparams *kp, int batch, int head, int row, int col)
{
    const fa_u64 stream = fa_dropout_stream(kp, batch, head);
    fa_u32 w[4];
    fa_philox4((fa_u32)FA_RULE_DROPOUT_BLOCK(col), (fa_u32)row, (fa_u32)stream,
               (fa_u32)(stream >> 32), (fa_u32)kp->seed, (fa_u32)(kp->seed >> 32), w);
    return fa_pick4(w, FA_RULE_DROPOUT_WORD(col));
}

/* Dropout words for the 4 lanes of a quad (lanes 4g..4g+3, t = lane % 4), which hold columns
 * 16j + 2t, + 1, + 8, + 9 of the same row for 4 consecutive 16-column blocks j = 0..3 (block
 * counters blk0 + j): lane t needs word t of every block. Instead of each lane running all four
 * Philox blocks, lane t runs block j = t and the quad transposes the 4x4 words with 3 shuffles:
 * in round r lane t reads lane t ^ r, which sends word t of its block t ^ r. out[j] gets word t
 * of block j. Every lane of the warp must call this together. */
FA_DEV void fa_dropout_quad(fa_u32 blk0, fa_u32 row, fa_u64 stream, fa_u64 seed, int t,
                            fa_u32 out[4])
{
    fa_u32 w[4], got[4];
    fa_philox4(blk0 + (fa_u32)t, row, (fa_u32)stream, (fa_u32)(stream >> 32), (fa_u32)seed,
               (fa_u32)(seed >> 32), w);
    got[0] = fa_pick4(w, t);
#pragma unroll
    for (int r = 1; r < 4; r++)
        got[r] = __shfl_xor_sync(0xffffffffu, fa_pick4(w, t ^ r), r);
    /* got[r] is word t of block t ^ r, so block j arrived in round t ^ j. */
#pragma unroll
    for (int j = 0; j < 4; j++)
        out[j] = fa_pick4(got, t ^ j);
}

/* The threshold in both halves, for the f16x2 compares of fa_dropout_mask2 and _apply2. */
FA_DEV fa_u32 fa_dropout_thr2(fa_u32 threshold)
{
    return threshold * 0x00010001u;
}

/* The 8-bit numbers of columns 2t + 8 hi, + 1 of a 16-column block, from the lane's word w of
 * that block (bytes 2 hi, 2 hi + 1: FA_RULE_DROPOUT_SHIFT), spread by prmt into the low bytes
 * of two 16-bit halves: as f16 bit patterns they are subnormals whose order is the integers' (as
 * the threshold's, at most 0x0100), so one f16x2 compare against fa_dropout_thr2 tests both. */
FA_DEV fa_u32 fa_dropout_nums2(fa_u32 w, int hi)
{
    return __byte_perm(w, 0u, hi ? 0x4342u : 0x4140u);
}

/* The keep mask of those two columns: 0xffff in each 16-bit half kept (set.lt.u32.f16x2). */
FA_DEV fa_u32 fa_dropout_mask2(fa_u32 w, int hi, fa_u32 thr2)
{
    fa_u32 m;
    asm("set.lt.u32.f16x2 %0, %1, %2;" : "=r"(m) : "r"(fa_dropout_nums2(w, hi)), "r"(thr2));
    return m;
}

/* Dropout on the two probabilities x0, x1 of those two columns: zeroed where the number is not
 * below the threshold (setp.lt.f16x2: p the low half, q the high). */
FA_DEV void fa_dropout_apply2(float *x0, float *x1, fa_u32 w, int hi, fa_u32 thr2)
{
    asm("{\n\t.reg .pred p, q;\n\t"
        "setp.lt.f16x2 p|q, %2, %3;\n\t"
        "selp.f32 %0, %0, 0f00000000, p;\n\t"
        "selp.f32 %1, %1, 0f00000000, q;\n\t}"
        : "+f"(*x0), "+f"(*x1)
        : "r"(fa_dropout_nums2(w, hi)), "r"(thr2));
}

/* The visible keys [lo, hi) of row `row` of a sequence of sq queries and sk keys. */
FA_DEV void fa_key_range(const fa_kparams *kp, int row, int sq, int sk, int *lo, int *hi)
{
    fa_i64 l, r;
    FA_RULE_KEY_RANGE(row, sq, sk, kp->window_left, kp->window_right, l, r);
    *lo = (int)l;
    *hi = (int)r;
}

/* The keys [lo, hi) that any of the rows [r0, r0 + m) sees (m >= 1). */
FA_DEV void fa_tile_keys(const fa_kparams *kp, int r0, int m, int sq, int sk, int *lo, int *hi)
{
    fa_i64 l, r;
    FA_RULE_TILE_KEYS(r0, m, sq, sk, kp->window_left, kp->window_right, l, r);
    *lo = (int)l;
    *hi = (int)r;
}

/* Where sequence `bi` lives. Varlen offsets come from device memory the host never checked, so
 * every value is clamped into the tensors: bad offsets give wrong rows, never a wild access. */
typedef struct fa_seq {
    fa_i64 q_start, k_start;
    int sq, sk;
} fa_seq;

FA_DEV fa_seq fa_seq_get(const fa_kparams *kp, int bi, int varlen)
{
    fa_seq s;
    if (!varlen) {
        s.q_start = 0;
        s.k_start = 0;
        s.sq = (int)kp->max_sq;
        s.sk = (int)kp->max_sk;
        return s;
    }
    fa_i64 qa = kp->cu_seqlens_q[bi], qb = kp->cu_seqlens_q[bi + 1];
    fa_i64 ka = kp->cu_seqlens_k[bi], kb = kp->cu_seqlens_k[bi + 1];
    qa = qa < 0 ? 0 : qa > kp->total_q ? kp->total_q : qa;
    qb = qb < qa ? qa : qb > kp->total_q ? kp->total_q : qb;
    ka = ka < 0 ? 0 : ka > kp->total_k ? kp->total_k : ka;
    kb = kb < ka ? ka : kb > kp->total_k ? kp->total_k : kb;
    fa_i64 sk = kb - ka;
#if defined(FA_PAGED) && FA_PAGED
    if (kp->seqused_k) /* paged, seqused_k replaces the count, up to the capacity (below) */
        sk = kp->page_keys;
#endif
    if (kp->seqused_k) {
        fa_i64 used = kp->seqused_k[bi];
        sk = used < 0 ? 0 : used > sk ? sk : used;
    }
    s.q_start = qa;
    s.k_start = ka;
    s.sq = (int)(qb - qa < kp->max_sq ? qb - qa : kp->max_sq);
#if defined(FA_PAGED) && FA_PAGED
    /* Paged: cu_seqlens_k counts keys, which are positions from 0 in the sequence's blocks, no
     * more than its block_table row holds. */
    s.k_start = 0;
    sk = sk < kp->page_keys ? sk : kp->page_keys;
#endif
    s.sk = (int)sk;
    return s;
}

/* j / d for j < 2^31 by the host's multiply-and-shift for d (fa_div_magic), a division being a
 * long software routine. */
FA_DEV fa_u32 fa_div_by(fa_u32 j, fa_u32 mul, fa_u32 shift)
{
    return (__umulhi(j, mul) + j) >> shift;
}

/* A block id clamped into the cache's [0, last_block]: a bad id gives a wrong answer for its
 * sequence, never a read outside the cache. */
FA_DEV int fa_block_clamp(int b, int last_block)
{
    return b < 0 ? 0 : b > last_block ? last_block : b;
}

/* The block id at `page` of a block_table row, clamped (fa_block_clamp). */
FA_DEV int fa_page_block(const int *bt_row, fa_u32 page, int last_block)
{
    return fa_block_clamp(bt_row[page], last_block);
}

/* Element offset of key j (< kp->page_keys) of a paged varlen forward's sequence in k or v
 * (block stride bs, row stride rs); bt_row its block_table row. */
FA_DEV fa_i64 fa_page_row(const fa_kparams *kp, const int *bt_row, int j, fa_i64 bs, fa_i64 rs)
{
    const fa_u32 page = fa_div_by((fa_u32)j, kp->page_mul, kp->page_shift);
    const int blk = fa_page_block(bt_row, page, kp->last_block);
    return (fa_i64)blk * bs + (fa_i64)((fa_u32)j - page * (fa_u32)kp->page_size) * rs;
}

/* The end of a row's online softmax, called by all four lanes of the row's quad: l, this lane's
 * part of the sum of exp2 (summed over the quad here), mx the row's maximum in base-2 units (-inf
 * when no key was visible), sink2 the sink logit in base 2 (-inf without). *lse gets the natural
 * log-sum-exp, +inf for a row with no visible key and no sink (upstream's empty row), *scale the
 * factor of the unnormalised O: 0 for such a row; both NaN when l is. */
FA_DEV void fa_row_finish(float l, float mx, float sink2, float *lse, float *scale)
{
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float big = fmaxf(mx, sink2);
    /* A NaN score (or +inf, exp2(inf - inf)) reached the sum, while fmaxf skipped it in mx: the
     * row is NaN, out and lse, checked before the empty-row test that a NaN-only row would pass. */
    if (l != l) {
        *lse = l;
        *scale = l;
        return;
    }
    if (big == -FA_INF) {
        *lse = FA_INF;
        *scale = 0.f;
        return;
    }
    const float lm = l > 0.f ? fa_exp2(mx - big) : 0.f;
    const float total = FA_RULE_SINK_TOTAL(l * lm, sink2 > -FA_INF, sink2, big, fa_exp2);
    *lse = (big + log2f(total)) * FA_LN2;
    *scale = l > 0.f ? lm / total : 0.f;
}

/* Varlen rows outside every sequence (before cu_seqlens_q[0] or from cu_seqlens_q[b] on): out 0
 * and lse +inf, one thread per (row, head) over [total_q, h]. Both forward families' fa_fwd_fill. */
FA_DEV void fa_fill_outside(const fa_kparams *kp)
{
    const fa_i64 i = (fa_i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= kp->total_q * kp->h)
        return;
    const fa_i64 r = i / kp->h;
    const int h = (int)(i - r * kp->h);
    if (r >= kp->cu_seqlens_q[0] && r < kp->cu_seqlens_q[kp->b])
        return;
    fa_u16 *og = (fa_u16 *)kp->out + r * kp->o_rstride + h * kp->o_hstride;
    for (int c = 0; c < kp->dv; c++)
        og[c] = 0;
    if (kp->lse)
        kp->lse[h * kp->lse_hstride + r * kp->lse_rstride] = FA_INF;
}

/* bar.sync id, n: the n threads (whole warps) that name barrier id meet (0 is
 * __syncthreads'). */
FA_DEV void fa_bar_sync(int id, int n)
{
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}

/* bar.arrive id, n: counts this warp toward barrier id's n threads without waiting. */
FA_DEV void fa_bar_arrive(int id, int n)
{
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}

/* Programmatic dependent launch (sm_90 and later; no-ops before, and for a kernel launched
 * without the dependency). wait: until the grids ahead of this one have completed and their
 * memory is visible. launch_dependents: the kernel behind this one may start now (it waits
 * for this grid's end before reading what it writes). */
FA_DEV void fa_grid_dependency_wait(void)
{
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

FA_DEV void fa_grid_dependents_launch(void)
{
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Thread block clusters (sm_90 and later; a kernel launched without one is a cluster of one).
 * fa_cluster_rank: this CTA's rank in its cluster (%cluster_ctarank). fa_cluster_map: the
 * shared::cluster address of the local shared address a in the CTA of rank r (mapa).
 * fa_cluster_ld: a float read through such an address (ld.shared::cluster). fa_cluster_sync:
 * every thread of every CTA of the cluster arrives, its shared-memory writes released, and
 * waits for all of them (barrier.cluster, acquire); warp-aligned. */
#if __CUDA_ARCH__ >= 900
FA_DEV fa_u32 fa_cluster_rank(void)
{
    fa_u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

FA_DEV fa_u32 fa_cluster_map(fa_u32 a, fa_u32 r)
{
    fa_u32 x;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(x) : "r"(a), "r"(r));
    return x;
}

FA_DEV float fa_cluster_ld(fa_u32 a)
{
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a));
    return v;
}

FA_DEV void fa_cluster_sync(void)
{
    asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
#endif

#endif /* FA_COMMON_CUH */
