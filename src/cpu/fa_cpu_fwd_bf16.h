/*
 * The forward tile for bf16 inputs on bf16 products (fa_cpu_bf16.h: AMX or AVX512-BF16).
 * fa_cpu_forward.c includes this after the fp32 instance of fa_cpu_fwd_body.h, whose softmax,
 * dropout and store it shares, so masks, ALiBi, softcap, sinks and dropout follow one code.
 *
 * The tile keeps the fp32 path's orientation (keys on rows, queries on columns):
 *  - S^T = K Q^T with K read in place where it can be (A operand) and Q^T packed once per tile
 *    as VNNI pairs (B). Q is not pre-scaled, so the products are those of the inputs exactly;
 *    the softmax applies the scale in fp32.
 *  - O^T += V^T P^T: V^T is packed per key block (A), P^T rounded to bf16 into VNNI pairs (B),
 *    which is an interleave of two key rows. O^T [dvp][mp] stays fp32 for the whole tile.
 * S, m, l and O are fp32 as in the fp32 path; only P is rounded, to bf16, as GPU
 * FlashAttention does for its P.V product. Like the fp32 tile, a block only computes the
 * queries that see one of its keys.
 */

/* Keys per block: AMX loads and stores each 16x16 tile of O^T once per block, so a 128-key
 * block spends 4 tdpbf16ps per such round trip (64 keys: 2). */
#define FA_CPU_BF16_BN 128
/* How far (natural log) a query's running maximum may trail a block's before its column of O^T
 * is rescaled: a column rescale costs dv multiplies per 16 queries whichever of them changed,
 * and with random scores some query of 16 sees a new maximum in most of the first blocks. P then
 * reaches e^5.5 = 256 at most, which bf16 and the fp32 sums hold with their usual precision
 * (FlashAttention 4 does the same on GPUs). */
#define FA_BF16_SLACK 5.5f

typedef struct fa_tile_bf16 {
    fa_tile_f32 f;   /* st, o (holding O^T [dvp][mp]), m, l, lo, hi, diag, bmax */
    uint32_t *qv;    /* [dk/2][mp] Q^T in VNNI pairs, dk = d rounded up to the kernels' depth */
    uint16_t *kbuf;  /* [FA_CPU_BF16_BN][dk] K rows not read in place */
    uint16_t *vt;    /* [dvp][FA_CPU_BF16_BN] V^T of the block */
    uint32_t *pv;    /* [FA_CPU_BF16_BN / 2][mp] P^T in VNNI pairs */
    float *alpha;    /* [FA_CPU_FWD_BM_MAX] each query's rescale factor in this block */
} fa_tile_bf16;

enum { FA_BF16_QV, FA_BF16_KBUF, FA_BF16_VT, FA_BF16_PV, FA_BF16_ST, FA_BF16_O, FA_BF16_ROWS,
       FA_BF16_PARTS };

/* Bytes of each scratch region (fa_cpu_scratch_layout places them). */
static void fa_bf16_part_sizes(const fa_params *p, size_t s[FA_BF16_PARTS])
{
    const size_t bm = FA_CPU_FWD_BM_MAX, bn = FA_CPU_BF16_BN;
    const size_t dk = (size_t)fa_cpu_round_up(p->d, FA_CPU_BF16_KALIGN);
    const size_t dvp = (size_t)fa_cpu_gemm_pad(p->dv);
    s[FA_BF16_QV] = dk * bm * 2;
    s[FA_BF16_KBUF] = bn * dk * 2;
    s[FA_BF16_VT] = dvp * bn * 2;
    s[FA_BF16_PV] = bn * bm * 2;
    s[FA_BF16_ST] = bn * bm * 4;
    s[FA_BF16_O] = bm * dvp * 4;
    s[FA_BF16_ROWS] = 7 * bm * 4;
}

static size_t fa_bf16_scratch_size(const fa_params *p)
{
    size_t s[FA_BF16_PARTS];
    fa_bf16_part_sizes(p, s);
    return fa_cpu_scratch_layout(s, FA_BF16_PARTS, NULL, NULL);
}

static void fa_bf16_carve(const fa_params *p, char *base, fa_tile_bf16 *t)
{
    size_t s[FA_BF16_PARTS];
    char *at[FA_BF16_PARTS];
    fa_bf16_part_sizes(p, s);
    fa_cpu_scratch_layout(s, FA_BF16_PARTS, base, at);
    t->qv = (uint32_t *)at[FA_BF16_QV];
    t->kbuf = (uint16_t *)at[FA_BF16_KBUF];
    t->vt = (uint16_t *)at[FA_BF16_VT];
    t->pv = (uint32_t *)at[FA_BF16_PV];
    t->f.qt = t->f.kbuf = t->f.vbuf = NULL;
    t->f.st = (float *)at[FA_BF16_ST];
    t->f.o = (float *)at[FA_BF16_O];
    float *rows = (float *)at[FA_BF16_ROWS];
    float **parts[7] = {&t->f.m, &t->f.l, &t->f.lo, &t->f.hi, &t->f.diag, &t->f.bmax, &t->alpha};
    for (int i = 0; i < 7; i++)
        *parts[i] = rows + i * FA_CPU_FWD_BM_MAX;
}

typedef float fa_bf16_v16 __attribute__((vector_size(64)));

/* Asks for rows [j0, j1) of a bf16 K or V head (ld elements apart, n wide) to come to L2 while
 * the current block computes: rows of one head are h * d elements apart, not a stream. */
static inline void fa_bf16_prefetch(const uint16_t *x, int64_t ld, int64_t j0, int64_t j1,
                                    int64_t n)
{
    for (int64_t j = j0; j < j1; j++)
        for (int64_t c = 0; c < n; c += 32)
            __builtin_prefetch(x + j * ld + c, 0, 2);
}

FA_CPU_AVX512 static void fa_cpu_tile_bf16(const fa_params *p, const fa_cpu_bf16_kernel *kern,
                                           fa_tile_bf16 *t, int64_t seq_index, int64_t h,
                                           int64_t r0, int64_t m)
{
    fa_tile_f32 *f = &t->f;
    const fa_seq seq = fa_params_seq(p, seq_index);
    const int64_t d = p->d, dv = p->dv, dvp = fa_cpu_gemm_pad(dv), mp = fa_cpu_gemm_pad(m);
    const int64_t dk = fa_cpu_round_up(d, FA_CPU_BF16_KALIGN);
    const int64_t hk = h / (p->h / p->hk);
    const float slope = p->alibi_slopes ? p->alibi_slopes[seq_index * p->alibi_bstride +
                                                          h * p->alibi_hstride]
                                        : 0;
    const uint16_t *q = (const uint16_t *)p->q + seq_index * p->q_bstride +
                        seq.q_start * p->q_rstride + h * p->q_hstride;
    const uint16_t *k = (const uint16_t *)p->k + seq_index * p->k_bstride +
                        seq.k_start * p->k_rstride + hk * p->k_hstride;
    const uint16_t *v = (const uint16_t *)p->v + seq_index * p->v_bstride +
                        seq.k_start * p->v_rstride + hk * p->v_hstride;

    fa_cpu_bf16_pack_q(t->qv, mp, q + r0 * p->q_rstride, p->q_rstride, m, mp, d, dk);
    for (int64_t i = 0; i < mp; i++) {
        int64_t lo = 0, hi = 0; /* padding rows see nothing */
        if (i < m)
            fa_params_key_range(p, r0 + i, seq.sq, seq.sk, &lo, &hi);
        f->lo[i] = (float)lo;
        f->hi[i] = (float)hi;
        f->diag[i] = (float)(r0 + i + seq.sk - seq.sq);
        f->m[i] = -INFINITY;
        f->l[i] = 0;
    }
    for (int64_t x = 0; x < dvp * mp; x++)
        f->o[x] = 0;

    int64_t k_lo, k_hi;
    fa_params_tile_keys(p, r0, m, seq.sq, seq.sk, &k_lo, &k_hi);
    kern->begin();
    for (int64_t j0 = k_lo; j0 < k_hi; j0 += FA_CPU_BF16_BN) {
        const int64_t n = k_hi - j0 < FA_CPU_BF16_BN ? k_hi - j0 : FA_CPU_BF16_BN;
        const int64_t nm = fa_cpu_round_up(n, FA_CPU_BF16_MALIGN);
        const int64_t nk = fa_cpu_round_up(n, FA_CPU_BF16_KALIGN);
        int64_t c0, c1;
        fa_edge_cols_f32(f->lo, f->hi, m, j0, n, &c0, &c1);
        const int64_t mr = (c1 < m ? c1 : m) - c0; /* real rows among the columns */
        const int64_t next = j0 + n + FA_CPU_BF16_BN < k_hi ? j0 + n + FA_CPU_BF16_BN : k_hi;
        fa_bf16_prefetch(k, p->k_rstride, j0 + n, next, d);
        fa_bf16_prefetch(v, p->v_rstride, j0 + n, next, dv);
        if (mr <= 0)
            continue;
        /* K rows are the A operand: in place when whole tiles of them exist and their stride
         * is not a multiple of 4 KB, else copied with zero padding (the last block, a head dim
         * short of the kernels' depth). At a multiple of 4 KB (h * d = 2048 bf16 and up) the
         * 16 rows of an AMX tile load all fall in one L1 set: copying is 2-20% faster there
         * and 3-7% slower at 1 KB, on the H200 host (bench/NOTES.md). */
        const uint16_t *kp = k + j0 * p->k_rstride;
        int64_t k_ld = p->k_rstride;
        if (n != nm || d != dk || fa_cpu_rows_alias(p->k_rstride, sizeof *k)) {
            for (int64_t j = 0; j < nm; j++)
                for (int64_t c = 0; c < dk; c++)
                    t->kbuf[j * dk + c] = j < n && c < d ? kp[j * p->k_rstride + c] : 0;
            kp = t->kbuf;
            k_ld = dk;
        }
        kern->gemm(f->st + c0, mp, kp, k_ld, t->qv + c0, mp, nm, c1 - c0, dk, 0);

        const float emul = fa_tile_softmax_max_f32(p, f, m, c0, c1, n, mp, dvp, j0, slope,
                                                   (float)p->scale, t->alpha, FA_BF16_SLACK);
        for (int64_t g = c0; g < c1; g += 16) {
            fa_bf16_v16 a, o;
            memcpy(&a, t->alpha + g, sizeof a);
            int same = 1;
            for (int i = 0; i < 16; i++)
                same &= a[i] == 1;
            if (same)
                continue;
            for (int64_t c = 0; c < dvp; c++) {
                memcpy(&o, f->o + c * mp + g, sizeof o);
                o *= a;
                memcpy(f->o + c * mp + g, &o, sizeof o);
            }
        }
        if (p->dropout_p > 0) {
            fa_tile_softmax_exp_f32(f, c0, c1, n, mp, emul);
            fa_tile_dropout_f32(p, f, seq_index, h, r0, c0, c0 + mr, mp, j0, n);
            fa_cpu_bf16_pack_p(t->pv + c0, mp, f->st + c0, mp, n, nk, c1 - c0);
        } else {
            fa_cpu_bf16_exp_pack(t->pv + c0, mp, f->st + c0, mp, n, nk, c1 - c0, emul,
                                 f->bmax + c0, f->l + c0);
        }
        fa_cpu_bf16_pack_vt(t->vt, FA_CPU_BF16_BN, v + j0 * p->v_rstride, p->v_rstride, n, nk, dv,
                            dvp);
        kern->gemm(f->o + c0, mp, t->vt, FA_CPU_BF16_BN, t->pv + c0, mp, dvp, c1 - c0, nk, 1);
    }
    kern->end();
    /* O^T to rows, 16 queries at a time, through st (free now; it holds 16 x dvp floats). */
    for (int64_t g = 0; g < m; g += 16) {
        fa_cpu_transpose_f32(f->st, dvp, f->o + g, mp, dvp, 16, 1.0f);
        fa_tile_store_f32(p, f->m + g, f->l + g, f->st, dvp, seq_index, h, r0 + g,
                          m - g < 16 ? m - g : 16);
    }
}
