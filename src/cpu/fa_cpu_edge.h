/*
 * Blocks on a mask's edge (causal's diagonal, a window's two edges), for the forward and the
 * backward alike: which of a tile's rows (queries) see a block of keys, which keys a panel of
 * rows sees. Both edges of a row's visible keys [lo, hi) grow with the row, so either answer is
 * one contiguous range. Included once per precision, with FA_REAL and FA_FN(name) defined (see
 * fa_cpu_kernel.h); lo and hi are the tile's per-row bounds, in FA_REAL (exact below 2^24).
 *
 * On an edge the kernels go in panels of FA_CPU_EDGE_PANEL keys (each over the rows that see
 * one of its keys) or rows (each over the keys one of its rows sees): what a panel skips is
 * masked anyway, so the results are the same bits for a fraction of the edge blocks' products
 * (whole blocks computed each masked triangle of 64 keys).
 */

#ifndef FA_CPU_EDGE_PANEL
#define FA_CPU_EDGE_PANEL 12
#endif

/* The columns [*c0, *c1) of the tile's m rows that see some key of [j0, j0 + n), rounded out to
 * whole vectors (FA_CPU_GEMM_NPAD); *c1 == *c0 when none does. */
FA_CPU_INLINE void FA_FN(fa_edge_cols)(const FA_REAL *lo, const FA_REAL *hi, int64_t m,
                                       int64_t j0, int64_t n, int64_t *c0, int64_t *c1)
{
    int64_t a = 0, b = m;
    while (a < m && hi[a] <= (FA_REAL)j0)
        a++;
    while (b > a && lo[b - 1] >= (FA_REAL)(j0 + n))
        b--;
    *c0 = a / FA_CPU_GEMM_NPAD * FA_CPU_GEMM_NPAD;
    *c1 = b > a ? fa_cpu_gemm_pad(b) : *c0;
}

/* Whether rows [c0, c0 + mr) (mr > 0) all see every key of [j0, j0 + n): an interior block. */
FA_CPU_INLINE int FA_FN(fa_edge_full)(const FA_REAL *lo, const FA_REAL *hi, int64_t c0,
                                      int64_t mr, int64_t j0, int64_t n)
{
    return lo[c0 + mr - 1] <= (FA_REAL)j0 && hi[c0] >= (FA_REAL)(j0 + n);
}

/* The keys [*a, *b) of [j0, j0 + n), relative to j0, that rows [r, r + rn) see between them
 * (*b <= *a when none): the first row has the lowest left edge, the last the highest right. */
FA_CPU_INLINE void FA_FN(fa_edge_keys)(const FA_REAL *lo, const FA_REAL *hi, int64_t r,
                                       int64_t rn, int64_t j0, int64_t n, int64_t *a, int64_t *b)
{
    const int64_t x = (int64_t)lo[r] - j0, y = (int64_t)hi[r + rn - 1] - j0;
    *a = x > 0 ? x : 0;
    *b = y < n ? y : n;
}

/*
 * Bounds [lo, hi) of the keys each of a tile's m rows keeps in block [j0, ...) (lo = inf where
 * none) narrowed by the call's own bounds olo / ohi, in place, into the form the functions above
 * read: a row that keeps nothing gets lo = hi at the previous row's hi (j0 for the first), padding
 * rows up to mp see nothing. Returns whether both edges grow with the row, which those functions
 * need; where they do not, the caller keeps the call's bounds.
 */
FA_CPU_INLINE int FA_FN(fa_edge_narrow)(FA_REAL *lo, FA_REAL *hi, const FA_REAL *olo,
                                        const FA_REAL *ohi, int64_t m, int64_t mp, int64_t j0)
{
    int grows = 1;
    for (int64_t i = 0; i < m; i++) {
        FA_REAL a = lo[i] > olo[i] ? lo[i] : olo[i], b = hi[i] < ohi[i] ? hi[i] : ohi[i];
        if (!(a < b))
            a = b = i ? hi[i - 1] : (FA_REAL)j0;
        lo[i] = a, hi[i] = b;
        grows &= !i || (a >= lo[i - 1] && b >= hi[i - 1]);
    }
    for (int64_t i = m; i < mp; i++)
        lo[i] = hi[i] = 0;
    return grows;
}
