/*
 * bf16 kernels of the CPU forward (fa_cpu_bf16.h): AMX tiles where the CPU and the OS allow
 * them, AVX512-BF16 dot products otherwise, and the AVX-512 packing both read.
 */
#include "cpu/fa_cpu_bf16.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/fa_cpu_exp512.h"
#include "cpu/fa_cpu_info.h"
#include "cpu/fa_cpu_transpose16.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* The AMX kernel on the real instructions. The compiler barriers keep earlier stores to the
 * operands ahead of the tile loads, which GCC's intrinsics do not declare as memory reads, and
 * the saved configuration ahead of the C that reads it (GCC declares 8 of its 64 bytes). */
#define FA_AMX_FN(name) name##_hw
#define FA_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#define FA_AMX_CONFIG(cfg)                                                                     \
    do {                                                                                       \
        __asm__ volatile("" ::: "memory");                                                     \
        _tile_loadconfig(cfg);                                                                 \
    } while (0)
#define FA_AMX_SAVE(cfg)                                                                       \
    do {                                                                                       \
        _tile_storeconfig(cfg);                                                                \
        __asm__ volatile("" ::: "memory");                                                     \
    } while (0)
#define FA_AMX_RELEASE() _tile_release()
#define FA_AMX_ZERO(t) _tile_zero(t)
#define FA_AMX_LOAD(t, p, s) _tile_loadd(t, p, s)
#define FA_AMX_STORE(t, p, s) _tile_stored(t, p, s)
#define FA_AMX_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#include "cpu/fa_cpu_amx_body.h"

#define FA_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/*
 * 4 rows x nv vectors (16 floats) of C in registers: per pair of k, nv loads of B and 4
 * broadcasts of an A pair feed 4 * nv vdpbf16ps. Always inlined, so that nv is a constant and
 * the accumulators stay in registers.
 */
FA_BF16_TARGET static inline __attribute__((always_inline)) void
fa_bf16_tile(float *c, int64_t ldc, const uint16_t *a, int64_t lda, const uint32_t *b, int64_t ldb,
             int64_t k, int accumulate, int nv)
{
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < nv; v++)
            acc[r][v] = accumulate ? _mm512_loadu_ps(c + r * ldc + 16 * v) : _mm512_setzero_ps();
    for (int64_t x = 0; x < k / 2; x++) {
        __m512i bv[4];
        for (int v = 0; v < nv; v++)
            bv[v] = _mm512_loadu_si512(b + x * ldb + 16 * v);
        for (int r = 0; r < 4; r++) {
            uint32_t pair;
            memcpy(&pair, a + r * lda + 2 * x, sizeof pair);
            const __m512i ar = _mm512_set1_epi32((int)pair);
            for (int v = 0; v < nv; v++)
                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)ar, (__m512bh)bv[v]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < nv; v++)
            _mm512_storeu_ps(c + r * ldc + 16 * v, acc[r][v]);
}

FA_BF16_TARGET static void fa_bf16_gemm_avx512(float *c, int64_t ldc, const uint16_t *a,
                                               int64_t lda, const uint32_t *b, int64_t ldb,
                                               int64_t m, int64_t n, int64_t k, int accumulate)
{
    for (int64_t i = 0; i < m; i += 4) {
        int64_t j = 0;
        for (; j + 64 <= n; j += 64)
            fa_bf16_tile(c + i * ldc + j, ldc, a + i * lda, lda, b + j, ldb, k, accumulate, 4);
        for (; j < n; j += 16)
            fa_bf16_tile(c + i * ldc + j, ldc, a + i * lda, lda, b + j, ldb, k, accumulate, 1);
    }
}

/* 16 columns of one V row, zero past dv (masked loads never touch memory they skip). */
FA_BF16_TARGET static inline __m512i fa_bf16_vrow(const uint16_t *v, int64_t ldv, int64_t j,
                                                  int64_t n, int64_t c0, __mmask16 cmask)
{
    if (j >= n)
        return _mm512_setzero_si512();
    if (cmask == 0xffff)
        return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + j * ldv + c0)));
    return _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cmask, v + j * ldv + c0));
}

/* Pairs of key rows become 32-bit elements (key 2x low, 2x+1 high), then 16x16 transposes turn
 * [key pair][column] into [column][key pair], which is V^T with pairs of keys adjacent. */
FA_BF16_TARGET void fa_cpu_bf16_pack_vt(uint16_t *vt, int64_t ldvt, const uint16_t *v,
                                        int64_t ldv, int64_t n, int64_t kp, int64_t dv,
                                        int64_t dvp)
{
    uint32_t *vt32 = (uint32_t *)vt;
    const int64_t ld32 = ldvt / 2;
    for (int64_t c0 = 0; c0 < dvp; c0 += 16) {
        const int64_t left = dv - c0;
        const __mmask16 cmask = left >= 16 ? (__mmask16)0xffff
                                           : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        for (int64_t x0 = 0; x0 < kp / 2; x0 += 16) {
            __m512i w[16];
            for (int t = 0; t < 16; t++) {
                const int64_t j = 2 * (x0 + t);
                const __m512i lo = fa_bf16_vrow(v, ldv, j, n, c0, cmask);
                const __m512i hi = fa_bf16_vrow(v, ldv, j + 1, n, c0, cmask);
                w[t] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
            }
            fa_cpu_transpose16(w);
            for (int t = 0; t < 16; t++)
                _mm512_storeu_si512(vt32 + (c0 + t) * ld32 + x0, w[t]);
        }
    }
}

FA_BF16_TARGET void fa_cpu_bf16_pack_q(uint32_t *qv, int64_t ldqv, const uint16_t *q, int64_t ldq,
                                       int64_t m, int64_t mp, int64_t d, int64_t dk)
{
    for (int64_t x0 = 0; x0 < dk / 2; x0 += 16) {
        const int64_t left = d - 2 * x0;
        const __mmask32 emask = left >= 32 ? (__mmask32)0xffffffffu
                                           : left > 0 ? (__mmask32)((1u << left) - 1) : 0;
        for (int64_t i0 = 0; i0 < mp; i0 += 16) {
            __m512i w[16];
            for (int t = 0; t < 16; t++)
                w[t] = i0 + t < m ? _mm512_maskz_loadu_epi16(emask, q + (i0 + t) * ldq + 2 * x0)
                                  : _mm512_setzero_si512();
            fa_cpu_transpose16(w);
            for (int t = 0; t < 16; t++)
                _mm512_storeu_si512(qv + (x0 + t) * ldqv + i0, w[t]);
        }
    }
}

/* Words 2t and 2t+1 of a 32-word vector from words t and 16 + t: two rows of 16 bf16 values
 * interleaved into 16 pairs (as _mm512_cvtne2ps_pbh(hi, lo) leaves them, lo in words 0-15). */
static const uint16_t fa_bf16_pair_order[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

FA_BF16_TARGET void fa_cpu_bf16_pack_p(uint32_t *pv, int64_t ldpv, const float *st,
                                       int64_t ldst, int64_t n, int64_t kp, int64_t cols)
{
    const __m512i idx = _mm512_loadu_si512(fa_bf16_pair_order);
    for (int64_t x = 0; x < kp / 2; x++) {
        uint32_t *dst = pv + x * ldpv;
        const float *r0 = st + 2 * x * ldst, *r1 = r0 + ldst;
        for (int64_t i = 0; i < cols; i += 16) {
            const __m512 lo = 2 * x < n ? _mm512_loadu_ps(r0 + i) : _mm512_setzero_ps();
            const __m512 hi = 2 * x + 1 < n ? _mm512_loadu_ps(r1 + i) : _mm512_setzero_ps();
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
            _mm512_storeu_si512(dst + i, _mm512_permutexvar_epi16(idx, both));
        }
    }
}

/* Columns [i, i + 16) of exp_pack: the pairs into pv, the row sums onto *sum; returns the
 * columns' maxima of st (for exp_pack_under's test). */
FA_BF16_TARGET static inline __m512 fa_bf16_exp_pack16(uint32_t *pv, int64_t ldpv,
                                                       const float *st, int64_t ldst, int64_t n,
                                                       int64_t kp, __m512 em, __m512 b,
                                                       __m512 *sum)
{
    const __m512i idx = _mm512_loadu_si512(fa_bf16_pair_order);
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t x = 0; x < kp / 2; x++) {
        __m512 e[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int r = 0; r < 2 && 2 * x + r < n; r++) {
            const __m512 s = _mm512_loadu_ps(st + (2 * x + r) * ldst);
            top = _mm512_max_ps(top, s);
            e[r] = fa_exp512(_mm512_fmsub_ps(s, em, b));
            *sum = _mm512_add_ps(*sum, e[r]);
        }
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]);
        _mm512_storeu_si512(pv + x * ldpv, _mm512_permutexvar_epi16(idx, both));
    }
    return top;
}

FA_BF16_TARGET void fa_cpu_bf16_exp_pack(uint32_t *pv, int64_t ldpv, const float *st,
                                         int64_t ldst, int64_t n, int64_t kp, int64_t cols,
                                         float emul, const float *bmax, float *l)
{
    const __m512 em = _mm512_set1_ps(emul);
    for (int64_t i = 0; i < cols; i += 16) {
        __m512 sum = _mm512_loadu_ps(l + i);
        fa_bf16_exp_pack16(pv + i, ldpv, st + i, ldst, n, kp, em, _mm512_loadu_ps(bmax + i),
                           &sum);
        _mm512_storeu_ps(l + i, sum);
    }
}

FA_BF16_TARGET int fa_cpu_bf16_exp_pack_under(uint32_t *pv, int64_t ldpv, const float *st,
                                               int64_t ldst, int64_t n, int64_t kp,
                                               int64_t cols, float emul, const float *m,
                                               float slack, const float *l, float *lout)
{
    const __m512 em = _mm512_set1_ps(emul);
    __mmask16 over = 0;
    for (int64_t i = 0; i < cols; i += 16) {
        const __m512 b = _mm512_loadu_ps(m + i);
        __m512 sum = _mm512_loadu_ps(l + i);
        const __m512 top = fa_bf16_exp_pack16(pv + i, ldpv, st + i, ldst, n, kp, em, b, &sum);
        /* the softmax's test: a maximum more than slack over m would have moved it */
        over |= _mm512_cmp_ps_mask(_mm512_mul_ps(top, em),
                                   _mm512_add_ps(b, _mm512_set1_ps(slack)), _CMP_GT_OQ);
        _mm512_storeu_ps(lout + i, sum);
    }
    return over == 0;
}

FA_BF16_TARGET void fa_cpu_bf16_pack_pairs(uint32_t *dst, int64_t ldd, const uint16_t *src,
                                           int64_t lds, int64_t n, int64_t kp, int64_t cols,
                                           int64_t colsp)
{
    for (int64_t c0 = 0; c0 < colsp; c0 += 16) {
        const int64_t left = cols - c0;
        const __mmask16 cmask = left >= 16 ? (__mmask16)0xffff
                                           : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        for (int64_t x = 0; x < kp / 2; x++) {
            const __m512i lo = fa_bf16_vrow(src, lds, 2 * x, n, c0, cmask);
            const __m512i hi = fa_bf16_vrow(src, lds, 2 * x + 1, n, c0, cmask);
            _mm512_storeu_si512(dst + x * ldd + c0, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

FA_BF16_TARGET void fa_cpu_bf16_round_rows(uint16_t *dst, int64_t ldd, const float *src,
                                           int64_t lds, int64_t n, int64_t np, int64_t cols)
{
    for (int64_t j = 0; j < np; j++)
        for (int64_t i = 0; i < cols; i += 16) {
            const __m256i h =
                j < n ? (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + j * lds + i))
                      : _mm256_setzero_si256();
            _mm256_storeu_si256((__m256i *)(dst + j * ldd + i), h);
        }
}

FA_BF16_TARGET void fa_cpu_bf16_round_t(uint16_t *dst, int64_t ldd, const float *src,
                                        int64_t lds, int64_t n, int64_t kp, int64_t cols)
{
    const __m512i idx = _mm512_loadu_si512(fa_bf16_pair_order);
    uint32_t *d32 = (uint32_t *)dst;
    const int64_t ld32 = ldd / 2;
    for (int64_t i0 = 0; i0 < cols; i0 += 16)
        for (int64_t x0 = 0; x0 < kp / 2; x0 += 16) {
            /* w[t]: keys 2(x0+t) and 2(x0+t)+1 of columns i0..i0+15 as pairs, transposed into
             * column i0+t's 16 pairs of keys */
            __m512i w[16];
            for (int t = 0; t < 16; t++) {
                const int64_t j = 2 * (x0 + t);
                const __m512 lo = j < n ? _mm512_loadu_ps(src + j * lds + i0) : _mm512_setzero_ps();
                const __m512 hi =
                    j + 1 < n ? _mm512_loadu_ps(src + (j + 1) * lds + i0) : _mm512_setzero_ps();
                w[t] = _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
            fa_cpu_transpose16(w);
            for (int t = 0; t < 16; t++)
                _mm512_storeu_si512(d32 + (i0 + t) * ld32 + x0, w[t]);
        }
}

static void fa_bf16_nothing(void)
{
}

static const fa_cpu_bf16_kernel fa_bf16_amx = {fa_amx_begin_hw, fa_amx_gemm_hw, fa_amx_end_hw,
                                               "amx"};
static const fa_cpu_bf16_kernel fa_bf16_avx512 = {fa_bf16_nothing, fa_bf16_gemm_avx512,
                                                  fa_bf16_nothing, "avx512bf16"};

/* Linux hands out the 8 KiB of tile state only to processes that ask (once per process;
 * threads created later inherit it). */
static int fa_amx_permitted(void)
{
#if defined(__linux__) && defined(SYS_arch_prctl)
    enum { arch_get_xcomp_perm = 0x1022, arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18 };
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) != 0)
        return 0;
    if (syscall(SYS_arch_prctl, arch_get_xcomp_perm, &granted) != 0)
        return 0;
    return (int)((granted >> xfeature_xtiledata) & 1u);
#else
    return 0;
#endif
}

static int fa_env_off(const char *name)
{
    const char *e = getenv(name);
    return e && strcmp(e, "0") == 0;
}
#endif /* x86-64 */

static const fa_cpu_bf16_kernel *fa_bf16_usable[2]; /* slower first */
static int fa_bf16_num_usable;
static const fa_cpu_bf16_kernel *fa_bf16_selected;
static pthread_once_t fa_bf16_once = PTHREAD_ONCE_INIT;

static void fa_bf16_select(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    const fa_cpu_info *cpu = fa_cpu_info_get();
    if (!cpu->avx512bf16 || !cpu->avx512bw || !cpu->avx512vl)
        return;
    fa_bf16_usable[fa_bf16_num_usable++] = &fa_bf16_avx512;
    if (cpu->amx_bf16 && fa_amx_permitted())
        fa_bf16_usable[fa_bf16_num_usable++] = &fa_bf16_amx;
    const int fastest = fa_env_off("FLASHATTN_CPU_AMX") ? 0 : fa_bf16_num_usable - 1;
    if (!fa_env_off("FLASHATTN_CPU_BF16"))
        fa_bf16_selected = fa_bf16_usable[fastest];
#endif
}

const fa_cpu_bf16_kernel *fa_cpu_bf16_kernel_get(void)
{
    pthread_once(&fa_bf16_once, fa_bf16_select);
    return fa_bf16_selected;
}

int fa_cpu_bf16_kernels(const fa_cpu_bf16_kernel *usable[2])
{
    pthread_once(&fa_bf16_once, fa_bf16_select);
    for (int i = 0; i < fa_bf16_num_usable; i++)
        usable[i] = fa_bf16_usable[i];
    return fa_bf16_num_usable;
}

void fa_cpu_bf16_kernel_override(const fa_cpu_bf16_kernel *kernel)
{
    pthread_once(&fa_bf16_once, fa_bf16_select);
    fa_bf16_selected = kernel;
}
