/*
 * The forward tile for bf16 inputs on bf16 products (fa_cpu_bf16.h: AMX or AVX512-BF16).
 * fa_cpu_forward.c includes this after the fp32 instance of fa_cpu_fwd_body.h, whose softmax,
 * dropout and store it shares, so masks, ALiBi, softcap, sinks and dropout follow one code.
 *
 * The tile keeps the fp32 path's orientation (keys on rows, queries on columns):
 *  - S^T = K Q^T with K (A operand) from the call's packed K/V (below) and Q^T packed once per
 *    tile as VNNI pairs (B). Q is not pre-scaled, so the products are those of the inputs
 *    exactly; the softmax applies the scale in fp32.
 *  - O^T += V^T P^T: V^T (A) from the packed K/V, P^T rounded to bf16 into VNNI pairs (B), which
 *    is an interleave of two key rows. O^T [dvp][ld] stays fp32 for the whole tile.
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

/* Columns of V a paged block's gather copies at a time (a multiple of 16). */
#define FA_BF16_GATHER_COLS 256

typedef struct fa_tile_bf16 {
    fa_tile_f32 f;   /* st, o (holding O^T [dvp][ld]), m, l, lo, hi, diag, bmax */
    uint32_t *qv;    /* [dk/2][ld] Q^T in VNNI pairs, dk = d rounded up to the kernels' depth */
    uint32_t *pv;    /* [FA_CPU_BF16_BN / 2][ld] P^T in VNNI pairs */
    float *alpha;    /* [FA_CPU_FWD_BM_MAX] each query's rescale factor in this block */
} fa_tile_bf16;

enum { FA_BF16_QV, FA_BF16_PV, FA_BF16_ST, FA_BF16_O, FA_BF16_ROWS, FA_BF16_PARTS };

/* Bytes of each scratch region (fa_cpu_scratch_layout places them). */
static void fa_bf16_part_sizes(const fa_params *p, size_t s[FA_BF16_PARTS])
{
    const size_t bm = FA_CPU_FWD_BM_MAX, ld = FA_CPU_FWD_LD_MAX, bn = FA_CPU_BF16_BN;
    const size_t dk = (size_t)fa_cpu_round_up(p->d, FA_CPU_BF16_KALIGN);
    const size_t dvp = (size_t)fa_cpu_gemm_pad(p->dv);
    s[FA_BF16_QV] = dk * ld * 2;
    s[FA_BF16_PV] = bn * ld * 2;
    s[FA_BF16_ST] = bn * ld * 4;
    s[FA_BF16_O] = ld * dvp * 4;
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

/*
 * K and V are packed once per call, before the tiles that read them (fa_cpu_forward's first
 * pass), by key blocks of FA_CPU_BF16_BN keys counted from key 0. A block is
 *   K   [FA_CPU_BF16_BN][dk]   rows, zero past d and past the sequence's last key (A of S^T)
 *   V^T [dvp][FA_CPU_BF16_BN]  zero past dv and past the last key (A of O^T)
 * and a (sequence, kv head)'s blocks follow one another. Packing once per call costs less than
 * every tile packing the blocks it reads.
 */
static int64_t fa_bf16_block_elems(const fa_params *p)
{
    return FA_CPU_BF16_BN *
           (fa_cpu_round_up(p->d, FA_CPU_BF16_KALIGN) + fa_cpu_gemm_pad(p->dv));
}

/* Packs key block b of kv head hk of sequence seq_index into dst. */
FA_CPU_AVX512 static void fa_bf16_pack_block(const fa_params *p, uint16_t *dst,
                                             int64_t seq_index, int64_t hk, int64_t b)
{
    const fa_seq seq = fa_params_seq(p, seq_index);
    const int64_t d = p->d, dk = fa_cpu_round_up(d, FA_CPU_BF16_KALIGN);
    const int64_t j0 = b * FA_CPU_BF16_BN;
    const int64_t n = seq.sk - j0 < FA_CPU_BF16_BN ? seq.sk - j0 : FA_CPU_BF16_BN;
    const uint16_t *k = (const uint16_t *)p->k + hk * p->k_hstride;
    const uint16_t *v = (const uint16_t *)p->v + hk * p->v_hstride;
    int64_t k_at, v_at;
    for (int64_t j = 0; j < FA_CPU_BF16_BN; j++) {
        uint16_t *row = dst + j * dk;
        const int64_t w = j < n ? d : 0;
        if (w) {
            fa_kv_key_at(p, seq_index, seq.k_start, j0 + j, &k_at, &v_at);
            memcpy(row, k + k_at, (size_t)w * sizeof *row);
        }
        memset(row + w, 0, (size_t)(dk - w) * sizeof *row);
    }
    uint16_t *vt = dst + FA_CPU_BF16_BN * dk;
    const int64_t dvp = fa_cpu_gemm_pad(p->dv);
    fa_kv_key_at(p, seq_index, seq.k_start, j0, &k_at, &v_at);
    if (fa_kv_keys_adjacent(p, j0, n)) {
        fa_cpu_bf16_pack_vt(vt, FA_CPU_BF16_BN, v + v_at, p->v_rstride, n, FA_CPU_BF16_BN, p->dv,
                            dvp);
        return;
    }
    /* V rows on more than one page are gathered first (the transpose reads rows by a stride),
     * FA_BF16_GATHER_COLS columns at a time: a larger buffer on the stack would not suit every
     * caller's thread. */
    uint16_t gathered[FA_CPU_BF16_BN * FA_BF16_GATHER_COLS];
    for (int64_t c0 = 0; c0 < dvp; c0 += FA_BF16_GATHER_COLS) {
        const int64_t left = p->dv - c0, w = left < FA_BF16_GATHER_COLS ? left : FA_BF16_GATHER_COLS;
        for (int64_t j = 0; j < n && w > 0; j++) {
            fa_kv_key_at(p, seq_index, seq.k_start, j0 + j, &k_at, &v_at);
            memcpy(gathered + j * FA_BF16_GATHER_COLS, v + v_at + c0, (size_t)w * sizeof *gathered);
        }
        const int64_t cols = dvp - c0 < FA_BF16_GATHER_COLS ? dvp - c0 : FA_BF16_GATHER_COLS;
        fa_cpu_bf16_pack_vt(vt + c0 * FA_CPU_BF16_BN, FA_CPU_BF16_BN, gathered,
                            FA_BF16_GATHER_COLS, n, FA_CPU_BF16_BN, w > 0 ? w : 0, cols);
    }
}

/* Rows [r0, r0 + m) of head h in sequence seq_index; kv holds the packed blocks of its
 * (sequence, kv head). */
FA_CPU_AVX512 static void fa_cpu_tile_bf16(const fa_params *p, const fa_cpu_bf16_kernel *kern,
                                           fa_tile_bf16 *t, const uint16_t *kv,
                                           int64_t seq_index, int64_t h, int64_t r0, int64_t m)
{
    fa_tile_f32 *f = &t->f;
    const fa_seq seq = fa_params_seq(p, seq_index);
    const int64_t d = p->d, dv = p->dv, dvp = fa_cpu_gemm_pad(dv), mp = fa_cpu_gemm_pad(m);
    const int64_t dk = fa_cpu_round_up(d, FA_CPU_BF16_KALIGN);
    const int64_t ld = fa_cpu_tile_ld(mp); /* of qv, pv, st and O^T */
    const float slope = p->alibi_slopes ? p->alibi_slopes[seq_index * p->alibi_bstride +
                                                          h * p->alibi_hstride]
                                        : 0;
    const uint16_t *q = (const uint16_t *)p->q + seq_index * p->q_bstride +
                        seq.q_start * p->q_rstride + h * p->q_hstride;

    fa_cpu_bf16_pack_q(t->qv, ld, q + r0 * p->q_rstride, p->q_rstride, m, mp, d, dk);
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
    for (int64_t x = 0; x < dvp * ld; x++)
        f->o[x] = 0;

    int64_t k_lo, k_hi;
    fa_params_tile_keys(p, r0, m, seq.sq, seq.sk, &k_lo, &k_hi);
    kern->begin();
    /* Blocks are packed from key 0: the first may start before k_lo, whose keys the masks hide. */
    for (int64_t j0 = k_lo - k_lo % FA_CPU_BF16_BN; j0 < k_hi; j0 += FA_CPU_BF16_BN) {
        const int64_t n = k_hi - j0 < FA_CPU_BF16_BN ? k_hi - j0 : FA_CPU_BF16_BN;
        const int64_t nm = fa_cpu_round_up(n, FA_CPU_BF16_MALIGN);
        const int64_t nk = fa_cpu_round_up(n, FA_CPU_BF16_KALIGN);
        const uint16_t *kp = kv + j0 / FA_CPU_BF16_BN * fa_bf16_block_elems(p);
        const uint16_t *vt = kp + FA_CPU_BF16_BN * dk;
        int64_t c0, c1;
        fa_edge_cols_f32(f->lo, f->hi, m, j0, n, &c0, &c1);
        const int64_t mr = (c1 < m ? c1 : m) - c0; /* real rows among the columns */
        if (mr <= 0)
            continue;
        kern->gemm(f->st + c0, ld, kp, dk, t->qv + c0, ld, nm, c1 - c0, dk, 0);

        /* Interior blocks once every column has a maximum: try the exponentials against the
         * running maxima first, which skips the max pass when none of them moves. */
        int plain = p->softcap == 0 && slope == 0 && p->scale > 0 && p->dropout_p == 0 &&
                    c1 <= m && fa_edge_full_f32(f->lo, f->hi, c0, c1 - c0, j0, n);
        for (int64_t i = c0; plain && i < c1; i++)
            plain = f->m[i] != -INFINITY;
        if (plain && fa_cpu_bf16_exp_pack_under(t->pv + c0, ld, f->st + c0, ld, n, nk, c1 - c0,
                                                (float)p->scale, f->m + c0, FA_BF16_SLACK,
                                                f->l + c0, t->alpha + c0)) {
            memcpy(f->l + c0, t->alpha + c0, (size_t)(c1 - c0) * sizeof *f->l);
            kern->gemm(f->o + c0, ld, vt, FA_CPU_BF16_BN, t->pv + c0, ld, dvp, c1 - c0, nk, 1);
            continue;
        }
        const float emul = fa_tile_softmax_max_f32(p, f, m, c0, c1, n, ld, dvp, j0, slope,
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
                memcpy(&o, f->o + c * ld + g, sizeof o);
                o *= a;
                memcpy(f->o + c * ld + g, &o, sizeof o);
            }
        }
        if (p->dropout_p > 0) {
            fa_tile_softmax_exp_f32(f, c0, c1, n, ld, emul);
            fa_tile_dropout_f32(p, f, seq_index, h, r0, c0, c0 + mr, ld, j0, n);
            fa_cpu_bf16_pack_p(t->pv + c0, ld, f->st + c0, ld, n, nk, c1 - c0);
        } else {
            fa_cpu_bf16_exp_pack(t->pv + c0, ld, f->st + c0, ld, n, nk, c1 - c0, emul,
                                 f->bmax + c0, f->l + c0);
        }
        kern->gemm(f->o + c0, ld, vt, FA_CPU_BF16_BN, t->pv + c0, ld, dvp, c1 - c0, nk, 1);
    }
    kern->end();
    /* O^T to rows, 16 queries at a time, through st (free now; it holds 16 x dvp floats). */
    for (int64_t g = 0; g < m; g += 16) {
        fa_cpu_transpose_f32(f->st, dvp, f->o + g, ld, dvp, 16, 1.0f);
        fa_tile_store_f32(p, f->m + g, f->l + g, f->st, dvp, seq_index, h, r0 + g,
                          m - g < 16 ? m - g : 16);
    }
}
