/*
 * Hopper (sm_90a) building blocks shared by the sm90 kernels, as inline PTX: mbarriers, TMA
 * copies by tensor map, wgmma (shared-memory descriptors, fences, groups, the register-A form of
 * O += P V), and the operand lists the wgmma asm blocks need. Included after the plan's defines
 * (FA_BF16 picks the wgmma types, FA_NCW the register split).
 */
#ifndef FA_SM90_CUH
#define FA_SM90_CUH

#include "fa_common.cuh"

/* A CUtensorMap image (128 bytes, 64-byte aligned), built on the host by cuTensorMapEncodeTiled
 * and passed inside a __grid_constant__ kernel parameter. */
typedef struct __align__(64) fa_tmap {
    fa_u64 w[16];
} fa_tmap;
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

/* mbarrier.expect_tx: `bytes` more of transactions the phase waits for, without arriving (the
 * arrival, which releases this thread's earlier writes to the waiters, comes later). */
FA_DEV void fa_mbar_expect_tx_only(fa_u32 bar, int bytes)
{
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar),
                 "r"(bytes)
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

/* fence.proxy.async.shared::cta: orders this thread's generic-proxy writes to shared memory before
 * later reads by the async proxy (a wgmma reading the tile by descriptor). */
FA_DEV void fa_fence_proxy_async(void) { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

/* setmaxnreg.{dec,inc}.sync.aligned.u32 N: the warpgroup's per-thread register budget becomes N
 * (dec returns registers to the CTA's pool, inc waits for them); FA_NCW consumer warpgroups. A
 * kernel may set its own split (FA_REGS_PRODUCER, FA_REGS_CONSUMER) before including this. */
#ifndef FA_REGS_PRODUCER
#if FA_NCW == 3
/* 128 x 32 + 384 x 160 = 65536: the register file split over four warpgroups. */
#define FA_REGS_PRODUCER 32
#define FA_REGS_CONSUMER 160
#else
#define FA_REGS_PRODUCER 24
#define FA_REGS_CONSUMER 240
#endif
#endif
FA_DEV void fa_regs_producer(void)
{
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(FA_REGS_PRODUCER));
}
FA_DEV void fa_regs_consumer(void)
{
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(FA_REGS_CONSUMER));
}

/* ---- TMA ------------------------------------------------------------------------------------ */

/* cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes: `bytes` (a multiple of 16)
 * from global src to shared dst (both 16-byte aligned), counted on mbarrier bar. */
FA_DEV void fa_bulk_load(fa_u32 dst, const void *src, int bytes, fa_u32 bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
                 "%2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

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

/* The descriptor of the operand `bytes` (a multiple of 16) past desc's: one add to the address
 * field, which cannot carry into LBO since every operand lies inside shared memory. Built per
 * k-step with fa_desc, each wgmma cost a dozen instructions of masks and shifts. */
FA_DEV fa_u64 fa_desc_at(fa_u64 desc, fa_u32 bytes) { return desc + (bytes >> 4); }

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
#define FA_PINU(x) asm volatile("" : "+r"(x)::"memory")

#if FA_BF16
#define FA_WG_TYPES ".f32.bf16.bf16"
#else
#define FA_WG_TYPES ".f32.f16.f16"
#endif

/* Operand lists of the wgmma asm blocks: the accumulator registers come first (%0 ..), 8 at a
 * time; the operands after them are named by their index in each instruction's definition. */
#define FA_RC0 "%0, %1, %2, %3, %4, %5, %6, %7"
#define FA_RC1 "%8, %9, %10, %11, %12, %13, %14, %15"
#define FA_RC2 "%16, %17, %18, %19, %20, %21, %22, %23"
#define FA_RC3 "%24, %25, %26, %27, %28, %29, %30, %31"
#define FA_RC4 "%32, %33, %34, %35, %36, %37, %38, %39"
#define FA_RC5 "%40, %41, %42, %43, %44, %45, %46, %47"
#define FA_RC6 "%48, %49, %50, %51, %52, %53, %54, %55"
#define FA_RC7 "%56, %57, %58, %59, %60, %61, %62, %63"
#define FA_RC8 "%64, %65, %66, %67, %68, %69, %70, %71"
#define FA_RC9 "%72, %73, %74, %75, %76, %77, %78, %79"
#define FA_RC10 "%80, %81, %82, %83, %84, %85, %86, %87"
#define FA_RC11 "%88, %89, %90, %91, %92, %93, %94, %95"
#define FA_RC12 "%96, %97, %98, %99, %100, %101, %102, %103"
#define FA_RC13 "%104, %105, %106, %107, %108, %109, %110, %111"
#define FA_RC14 "%112, %113, %114, %115, %116, %117, %118, %119"
#define FA_RC15 "%120, %121, %122, %123, %124, %125, %126, %127"
#define FA_RL32 FA_RC0 ", " FA_RC1 ", " FA_RC2 ", " FA_RC3
#define FA_RL40 FA_RL32 ", " FA_RC4
#define FA_RL48 FA_RL40 ", " FA_RC5
#define FA_RL56 FA_RL48 ", " FA_RC6
#define FA_RL64 FA_RL56 ", " FA_RC7
#define FA_RL72 FA_RL64 ", " FA_RC8
#define FA_RL80 FA_RL72 ", " FA_RC9
#define FA_RL88 FA_RL80 ", " FA_RC10
#define FA_RL96 FA_RL88 ", " FA_RC11
#define FA_RL104 FA_RL96 ", " FA_RC12
#define FA_RL112 FA_RL104 ", " FA_RC13
#define FA_RL120 FA_RL112 ", " FA_RC14
#define FA_RL128 FA_RL120 ", " FA_RC15
#define FA_F8(a, i)                                                                              \
    "+f"(a[i]), "+f"(a[i + 1]), "+f"(a[i + 2]), "+f"(a[i + 3]), "+f"(a[i + 4]), "+f"(a[i + 5]),  \
        "+f"(a[i + 6]), "+f"(a[i + 7])
#define FA_FL32(a) FA_F8(a, 0), FA_F8(a, 8), FA_F8(a, 16), FA_F8(a, 24)
#define FA_FL40(a) FA_FL32(a), FA_F8(a, 32)
#define FA_FL48(a) FA_FL40(a), FA_F8(a, 40)
#define FA_FL56(a) FA_FL48(a), FA_F8(a, 48)
#define FA_FL64(a) FA_FL56(a), FA_F8(a, 56)
#define FA_FL72(a) FA_FL64(a), FA_F8(a, 64)
#define FA_FL80(a) FA_FL72(a), FA_F8(a, 72)
#define FA_FL88(a) FA_FL80(a), FA_F8(a, 80)
#define FA_FL96(a) FA_FL88(a), FA_F8(a, 88)
#define FA_FL104(a) FA_FL96(a), FA_F8(a, 96)
#define FA_FL112(a) FA_FL104(a), FA_F8(a, 104)
#define FA_FL120(a) FA_FL112(a), FA_F8(a, 112)
#define FA_FL128(a) FA_FL120(a), FA_F8(a, 120)

/*
 * NAME(d, da, db, accumulate): D (+)= A B by wgmma.mma_async m64nNk16 with both operands in
 * shared memory (SS form):
 *   wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}x2 {d..}, descA, descB, p, 1, 1, TRANS
 * p = scale-d (accumulate 0: D = A B); scale-a = scale-b = 1; TRANS the operands' majorness
 * ("0, 0" both K-major; 1 MN-major, 16-bit types only). d is the m64nN fp32 accumulator: thread
 * t (warp w = t/32, lane l) holds in d[j] the element (row 16w + l/4 + 8((j>>1)&1), col
 * 8(j>>2) + 2(l%4) + (j&1)). RL/FL list its N/2 registers, IA, IB, IP the operand numbers
 * after them ("%32", "%33", "%34" for N 64).
 */
#define FA_DEF_WGMMA_SS(NAME, N, RL, FL, IA, IB, IP, TRANS)                                    \
    FA_DEV void NAME(float *d, fa_u64 da, fa_u64 db, int accumulate)                           \
    {                                                                                          \
        asm volatile("{ .reg .pred p; setp.ne.b32 p, " IP ", 0;\n"                             \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16" FA_WG_TYPES " {" RL "}, " IA \
                     ", " IB ", p, 1, 1, " TRANS "; }"                                         \
                     : FL(d)                                                                   \
                     : "l"(da), "l"(db), "r"(accumulate));                                     \
    }

/*
 * O += P V for one 64-column block of V, m64n64k16 with A from registers (RS form):
 *   wgmma.mma_async.sync.aligned.m64n64k16.f32.{bf16,f16}x2 {d..}, {a0, a1, a2, a3}, descB, p, 1, 1, 1
 * A fragment (K-major, 16-bit pairs, lower column in the low half): with r = 16w + l/4, q = l%4:
 * a0 = (row r, cols 2q, 2q+1), a1 = (row r+8, same cols), a2 = (row r, cols 8+2q, 9+2q),
 * a3 = (row r+8, cols 8+2q, 9+2q) - the S accumulator's own pattern, so P needs no shuffle.
 * The last immediate, transpose-b = 1: B (V) is MN-major in shared memory. The m64n128 form
 * covers two 64-column blocks at once (the descriptor's LBO steps between them).
 */
FA_DEV void fa_wgmma_pv64(float *d, const fa_u32 a[4], fa_u64 db)
{
    asm volatile("{ .reg .pred p; setp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16" FA_WG_TYPES " {" FA_RL32 "}, "
                 "{%32, %33, %34, %35}, %36, p, 1, 1, 1; }"
                 : FA_FL32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

FA_DEV void fa_wgmma_pv128(float *d, const fa_u32 a[4], fa_u64 db)
{
    asm volatile("{ .reg .pred p; setp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16" FA_WG_TYPES " {" FA_RL64 "}, "
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 1; }"
                 : FA_FL64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

/* The m64n256 form: four 64-column blocks of V at once (128 accumulator registers). */
FA_DEV void fa_wgmma_pv256(float *d, const fa_u32 a[4], fa_u64 db)
{
    asm volatile("{ .reg .pred p; setp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16" FA_WG_TYPES " {" FA_RL128 "}, "
                 "{%128, %129, %130, %131}, %132, p, 1, 1, 1; }"
                 : FA_FL128(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

#endif /* FA_SM90_CUH */
