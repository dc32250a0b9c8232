/* The fuzzer's cases of user-defined scoring (fa_fuzz_case.h): random mod programs for the
 * forward, fa_mod_parse on their texts mutated, and fa_block_mask_build. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_fuzz_gen.h"
#include "fa_ref.h"

/* A random well-typed expression of at most depth levels into m: a boolean (want_bool) or a
 * number, over b, h, q_idx, kv_idx (and score where score), constants, every operation and aux
 * reads (slot i with nd[i] indices, so a program's reads of a slot agree). -1 when the builder
 * refused a node (an id -1 is refused again by every node above it). */
static int fz_expr(fz_src *s, fa_mod *m, int want_bool, int depth, int score, const int *nd)
{
    if (want_bool) {
        const int k = depth > 0 ? (int)fz_below(s, 5) : 5;
        if (k <= 2 || k == 5)
            return fa_mod_binary(m, (fa_mod_op)fz_range(s, FA_MOD_LT, FA_MOD_NE),
                                 fz_expr(s, m, 0, depth - 1, score, nd),
                                 fz_expr(s, m, 0, depth - 1, score, nd));
        if (k == 3)
            return fa_mod_binary(m, fz_chance(s, 50) ? FA_MOD_AND : FA_MOD_OR,
                                 fz_expr(s, m, 1, depth - 1, score, nd),
                                 fz_expr(s, m, 1, depth - 1, score, nd));
        return fa_mod_unary(m, FA_MOD_NOT, fz_expr(s, m, 1, depth - 1, score, nd));
    }
    static const fa_mod_variable vars[] = {FA_MOD_Q_IDX, FA_MOD_KV_IDX, FA_MOD_Q_IDX,
                                           FA_MOD_KV_IDX, FA_MOD_B, FA_MOD_H, FA_MOD_SCORE};
    switch (depth > 0 ? fz_below(s, 10) : fz_below(s, 3)) {
    case 0:
    case 1: {
        const fa_mod_variable v = vars[fz_below(s, score ? 7 : 6)];
        return fa_mod_var(m, v);
    }
    case 2:
        return fa_mod_const(m, fz_chance(s, 80) ? (double)fz_range(s, -8, 40)
                                                : fz_uniform(s, -4.0, 4.0));
    case 3:
    case 4:
    case 5:
        return fa_mod_binary(m, (fa_mod_op)fz_range(s, FA_MOD_ADD, FA_MOD_MOD),
                             fz_expr(s, m, 0, depth - 1, score, nd),
                             fz_expr(s, m, 0, depth - 1, score, nd));
    case 6:
        return fa_mod_unary(m, (fa_mod_op)fz_range(s, FA_MOD_NEG, FA_MOD_FLOOR),
                            fz_expr(s, m, 0, depth - 1, score, nd));
    case 7:
        return fa_mod_where(m, fz_expr(s, m, 1, depth - 1, score, nd),
                            fz_expr(s, m, 0, depth - 1, score, nd),
                            fz_expr(s, m, 0, depth - 1, score, nd));
    default: {
        const int slot = (int)fz_below(s, FA_MOD_AUX_SLOTS);
        int index[4];
        for (int i = 0; i < nd[slot]; i++)
            index[i] = fz_expr(s, m, 0, i == 0 ? 0 : depth - 1, score, nd);
        return fa_mod_aux(m, slot, nd[slot], index);
    }
    }
}

/* A random score_mod or mask_mod program: a well-typed expression (fz_expr), or builder calls
 * with ids, ops, variables, aux slots and dimensions drawn around and past their valid ranges
 * (each refused call returns -1), finished on a random root most of the time; *finished says
 * whether fa_mod_finish accepted it. */
static fa_mod *fz_mod(fz_case *c, fa_mod_kind kind, int *finished)
{
    static const double odd[] = {NAN, INFINITY, -INFINITY, 1e300, -0.0, 4294967296.5};
    fz_src *s = c->src;
    *finished = 0;
    fa_mod *m = fa_mod_create();
    if (!m)
        return NULL;
    if (fz_chance(s, 60)) {
        int nd[FA_MOD_AUX_SLOTS];
        for (int i = 0; i < FA_MOD_AUX_SLOTS; i++)
            nd[i] = (int)fz_range(s, 1, 3);
        const int root = fz_expr(s, m, kind == FA_MOD_KIND_MASK, (int)fz_range(s, 1, 3),
                                 kind == FA_MOD_KIND_SCORE, nd);
        *finished = root >= 0 && fa_mod_finish(m, root, kind) == FA_STATUS_OK;
        fz_note(c, " %s %s", kind == FA_MOD_KIND_SCORE ? "score_mod" : "mask_mod",
                *finished ? fa_mod_text(m) : "(unfinished)");
        return m;
    }
    int n = 0, last = -1;
    const int steps = (int)fz_range(s, 1, 12);
    for (int i = 0; i < steps; i++) {
        const int a = (int)fz_range(s, -1, n), b = (int)fz_range(s, -1, n);
        const int w = (int)fz_range(s, -1, n);
        int id;
        switch (fz_below(s, 6)) {
        case 0: id = fa_mod_var(m, (fa_mod_variable)fz_range(s, -1, 5)); break;
        case 1: id = fa_mod_const(m, fz_chance(s, 90) ? fz_uniform(s, -4, 4) : FZ_PICK(s, odd)); break;
        case 2: id = fa_mod_unary(m, (fa_mod_op)fz_range(s, -1, FA_MOD_OR + 1), a); break;
        case 3: id = fa_mod_binary(m, (fa_mod_op)fz_range(s, -1, FA_MOD_OR + 1), a, b); break;
        case 4: id = fa_mod_where(m, a, b, w); break;
        default: {
            const int index[5] = {a, b, w, a, b}; /* room for every ndim drawn */
            id = fa_mod_aux(m, (int)fz_range(s, -1, FA_MOD_AUX_SLOTS), (int)fz_range(s, 0, 5),
                            index);
        }
        }
        if (id >= 0) {
            last = id;
            n = id + 1 > n ? id + 1 : n;
        }
    }
    const int root = fz_chance(s, 90) ? last : (int)fz_range(s, -1, n);
    *finished = fz_chance(s, 90) && fa_mod_finish(m, root, kind) == FA_STATUS_OK;
    fz_note(c, " %s %s", kind == FA_MOD_KIND_SCORE ? "score_mod" : "mask_mod",
            *finished ? fa_mod_text(m) : "(unfinished)");
    return m;
}

/* The number of indices program m reads aux tensor `slot` with (0: it does not), from its text
 * ("aux<slot> $i $j ..." statements). */
static int fz_aux_ndim(const fa_mod *m, int slot)
{
    const char *t = m ? fa_mod_text(m) : NULL;
    char op[16];
    snprintf(op, sizeof op, "aux%d", slot);
    for (const char *p = t ? strstr(t, op) : NULL; p; p = strstr(p + 1, op)) {
        if (p[4] != ' ' || (p != t && p[-1] != ' ' && p[-1] != ';'))
            continue;
        int n = 0;
        for (p += 4; *p && *p != ';'; p++)
            n += *p == '$';
        return n;
    }
    return 0;
}

/* The aux tensors of programs m[0], m[1] (either NULL): of the dims a program reads most of the
 * time, extents 0..5 (reads are clamped into them), int32 or fp32; now and then a slot no
 * program reads, or other dims (the library must refuse either). */
static void fz_mod_aux(fz_case *c, fa_mod *const *m, const fa_tensor **aux)
{
    fz_src *s = c->src;
    for (int slot = 0; slot < FA_MOD_AUX_SLOTS; slot++) {
        const int k0 = fz_aux_ndim(m[0], slot), k1 = fz_aux_ndim(m[1], slot);
        const int read = k0 ? k0 : k1;
        if (read ? !fz_chance(s, 95) : !fz_chance(s, 3)) {
            c->must_fail |= read != 0; /* read, but not given */
            continue;
        }
        const int nd = read && fz_chance(s, 95) ? read : (int)fz_range(s, 1, 4);
        c->must_fail |= !read || nd != read || (k0 && k1 && k0 != k1);
        int64_t shape[4];
        for (int j = 0; j < nd; j++)
            shape[j] = fz_range(s, fz_chance(s, 95), 5);
        const int is_int = fz_chance(s, 50);
        aux[slot] = fz_tensor(c, "mod_aux", is_int ? FA_DTYPE_I32 : FA_DTYPE_F32, nd, shape,
                              is_int ? FZ_IDX : FZ_IN);
    }
}

/* Now and then a score_mod and a mask_mod with aux tensors; an unfinished program must be
 * refused, and a score_mod's own arithmetic may give non-finite outputs. */
void fz_mods(fz_case *c, fa_fwd_args *a)
{
    fz_src *s = c->src;
    for (int i = 0; i < 2; i++) {
        if (!fz_chance(s, 8))
            continue;
        int finished;
        fa_mod *m = fz_mod(c, i == 0 ? FA_MOD_KIND_SCORE : FA_MOD_KIND_MASK, &finished);
        if (!m)
            continue;
        c->mods[i] = m;
        c->must_fail |= !finished;
        if (i == 0)
            a->score_mod = m, c->nonfinite = 1;
        else
            a->mask_mod = m;
    }
    if (c->mods[0] || c->mods[1])
        fz_mod_aux(c, c->mods, a->mod_aux);
}

/* ---- fa_mod_parse ------------------------------------------------------------------------ */

#define FZ_TEXT 2048

/* One edit of text (at most FZ_TEXT - 1 characters): a character changed, a range cut or
 * repeated, the end cut, or a token put in. */
static void fz_text_edit(fz_src *s, char *text)
{
    static const char chars[] = " $;:0123456789-xabcdefq_\t\n";
    static const char *const tokens[] = {
        "$0", " $1 ", "$-1", " $99999999999999999999", ";", ";;", " const 7",
        " const 0x7ff8000000000000", " 0x", " where $0 $0 $0", " aux0 $0", " aux9 $0", " aux4",
        " score", " q_idx", "kv_idx ", " add", " div $0 $0", "mask:", "score:", "  ", "\t",
        " -9223372036854775808", " 99999999999999999999999", " const", " not $0", " lt $0"};
    const size_t n = strlen(text);
    const size_t at = (size_t)fz_below(s, n + 1), len = (size_t)fz_range(s, 1, 12);
    switch (fz_below(s, 5)) {
    case 0:
        if (at < n)
            text[at] = fz_chance(s, 80) ? chars[fz_below(s, sizeof chars - 1)]
                                        : (char)fz_range(s, 1, 255);
        break;
    case 1: {
        const size_t cut = at + len < n ? len : n - at;
        memmove(text + at, text + at + cut, n - at - cut + 1);
        break;
    }
    case 2:
        text[at] = 0;
        break;
    default: {
        char piece[64];
        if (fz_chance(s, 50)) {
            snprintf(piece, sizeof piece, "%s", FZ_PICK(s, tokens));
        } else {
            const size_t from = (size_t)fz_below(s, n + 1), take = from + len < n ? len : n - from;
            memcpy(piece, text + from, take);
            piece[take] = 0;
        }
        const size_t add = strlen(piece);
        if (n + add >= FZ_TEXT)
            break;
        memmove(text + at + add, text + at, n - at + 1);
        memcpy(text + at, piece, add);
    }
    }
}

/* fa_mod_parse of a random program's canonical text, edited or not, and of NULLs. A text it
 * takes gives a program whose own text parses back to that text; an unedited one gives the text
 * it was parsed from. */
void fz_mod_parse(fz_case *c)
{
    c->entry = "fa_mod_parse";
    fz_src *s = c->src;
    int finished;
    c->mods[0] = fz_mod(c, fz_chance(s, 50) ? FA_MOD_KIND_SCORE : FA_MOD_KIND_MASK, &finished);
    const char *orig = finished ? fa_mod_text(c->mods[0]) : NULL;
    char text[FZ_TEXT];
    snprintf(text, sizeof text, "%s", orig ? orig : fz_chance(s, 50) ? "score: " : "mask: ");
    const int edits = orig && fz_chance(s, 30) ? 0 : (int)fz_range(s, 1, 6);
    for (int i = 0; i < edits; i++)
        fz_text_edit(s, text);
    if (strlen(text) + 1 >= sizeof text)
        fz_fail(c, "the edited text overran its buffer");
    fz_note(c, " parse '%s'", text);
    const int null_text = fz_chance(s, 2), null_out = fz_chance(s, 2);
    c->must_fail = null_text || null_out;
    fa_mod *out = (fa_mod *)c; /* any non-NULL: the call must set it */
    const fa_status st = fa_mod_parse(null_text ? NULL : text, null_out ? NULL : &out);
    fz_check_status(c, st);
    if (null_out)
        return;
    if (st != FA_STATUS_OK) {
        if (out)
            fz_fail(c, "refused the text but left *out non-NULL");
        return;
    }
    const char *t1 = out ? fa_mod_text(out) : NULL;
    if (!t1)
        fz_fail(c, "took the text but gave no finished program");
    if (edits == 0 && strcmp(t1, orig) != 0)
        fz_fail(c, "the program parsed from '%s' reads '%s'", orig, t1);
    fa_mod *again = NULL;
    if (fa_mod_parse(t1, &again) != FA_STATUS_OK || strcmp(fa_mod_text(again), t1) != 0)
        fz_fail(c, "its own text '%s' did not parse back to itself: %s", t1, fa_last_error());
    fa_mod_destroy(again);
    fa_mod_destroy(out);
}

/* ---- fa_block_mask_build ----------------------------------------------------------------- */

/* An int32 element of a written output. */
static int64_t fz_at(const fa_tensor *t, int64_t b, int64_t h, int64_t q, int64_t k)
{
    const int64_t idx[4] = {b, h, q, k};
    return (int64_t)fa_ref_load(t, idx);
}

/* One row (b, h, query block q) of a built mask: count in [0, nk]; every key block listed once,
 * the counted ones first, each part ascending. Marks the counted ones in seen (nk entries) with
 * mark, failing where one was marked already. */
static int64_t fz_bm_row(const fz_case *c, const fa_tensor *num, const fa_tensor *idx,
                         const char *name, int64_t b, int64_t h, int64_t q, int64_t nk,
                         unsigned char *seen, unsigned char mark)
{
    const int64_t n = fz_at(num, b, h, q, 0);
    if (n < 0 || n > nk)
        fz_fail(c, "%s[%lld, %lld, %lld] = %lld, outside [0, %lld]", name, (long long)b,
                (long long)h, (long long)q, (long long)n, (long long)nk);
    int64_t prev = -1;
    unsigned char *listed = calloc((size_t)nk + 1, 1);
    for (int64_t j = 0; j < nk; j++) {
        const int64_t k = fz_at(idx, b, h, q, j);
        if (k < 0 || k >= nk || listed[k])
            fz_fail(c, "%s row [%lld, %lld, %lld]: entry %lld is %lld (not a block, or listed "
                       "twice)", name, (long long)b, (long long)h, (long long)q, (long long)j,
                    (long long)k);
        if (j != n && k <= prev)
            fz_fail(c, "%s row [%lld, %lld, %lld]: entry %lld (%lld) not ascending", name,
                    (long long)b, (long long)h, (long long)q, (long long)j, (long long)k);
        listed[k] = 1;
        prev = k;
        if (j < n) {
            if (seen[k])
                fz_fail(c, "block [%lld, %lld, %lld, %lld] both full and partial", (long long)b,
                        (long long)h, (long long)q, (long long)k);
            seen[k] = mark;
        }
    }
    free(listed);
    return n;
}

/* fa_block_mask_build on the CPU: a program (unfinished or a score program now and then), its
 * aux tensors, sizes, block sizes and outputs around the valid ones. On OK every row is checked
 * (fz_bm_row), no edge block is full, and, with the full lists, a second build without them
 * lists as partial exactly the blocks the first listed as partial or full. */
void fz_block_mask_build(fz_case *c)
{
    c->entry = "fa_block_mask_build";
    fz_src *s = c->src;
    fa_block_mask_args a;
    fa_block_mask_args_init(&a);
    if (fz_chance(s, 97)) {
        const int score = fz_chance(s, 4);
        int finished;
        c->mods[1] = fz_mod(c, score ? FA_MOD_KIND_SCORE : FA_MOD_KIND_MASK, &finished);
        a.mask_mod = c->mods[1];
        c->must_fail |= !finished || score || !a.mask_mod;
    } else {
        c->must_fail = 1;
    }
    fa_mod *const progs[2] = {c->mods[1], NULL};
    fz_mod_aux(c, progs, a.mod_aux);
    static const int64_t odd[] = {0, -1, FA_MAX_EXTENT + 1, INT64_MIN};
    int64_t *sizes[6] = {&a.b, &a.h, &a.sq, &a.sk, &a.q_block, &a.kv_block};
    a.b = fz_range(s, 1, 3), a.h = fz_range(s, 1, 3);
    a.sq = fz_len(s), a.sk = fz_len(s);
    a.q_block = fz_range(s, 1, 20), a.kv_block = fz_range(s, 1, 20);
    if (fz_chance(s, 5))
        *sizes[fz_below(s, 6)] = FZ_PICK(s, odd);
    if (fz_chance(s, 2))
        *sizes[4 + fz_below(s, 2)] = FA_MAX_EXTENT; /* one block over every row or key */
    int64_t e[6];
    for (int i = 0; i < 6; i++) {
        c->must_fail |= *sizes[i] < 1 || *sizes[i] > FA_MAX_EXTENT;
        e[i] = *sizes[i] < 1 || *sizes[i] > FA_MAX_EXTENT ? 1 : *sizes[i];
    }
    const int64_t nq = (e[2] + e[4] - 1) / e[4], nk = (e[3] + e[5] - 1) / e[5];
    int64_t ns[3] = {e[0], e[1], nq}, is[4] = {e[0], e[1], nq, nk};
    if (fz_chance(s, 3)) {
        const int d = (int)fz_below(s, 4);
        is[d] += 1; /* a dim of kv_indices that is not the mask's */
        c->must_fail = 1;
    }
    const fa_dtype dt = fz_chance(s, 98) ? FA_DTYPE_I32 : FA_DTYPE_F32;
    c->must_fail |= dt != FA_DTYPE_I32;
    a.kv_num_blocks = fz_tensor(c, "kv_num_blocks", dt, 3, ns, FZ_OUT);
    a.kv_indices = fz_tensor(c, "kv_indices", FA_DTYPE_I32, 4, is, FZ_OUT);
    const int full = (int)fz_below(s, 40); /* < 20: both full lists; 20, 21: one of them */
    if (full < 22) {
        if (full != 21)
            a.full_kv_num_blocks = fz_tensor(c, "full_kv_num_blocks", FA_DTYPE_I32, 3, ns, FZ_OUT);
        if (full != 20)
            a.full_kv_indices = fz_tensor(c, "full_kv_indices", FA_DTYPE_I32, 4, is, FZ_OUT);
        c->must_fail |= full >= 20;
        if (a.full_kv_indices)
            fz_maybe_alias(c, (fa_tensor *)a.full_kv_indices, a.kv_indices, "kv_indices");
    }
    a.device = fz_device(c);
    fz_note(c, " b %lld h %lld sq %lld sk %lld blocks %lld x %lld", (long long)a.b,
            (long long)a.h, (long long)a.sq, (long long)a.sk, (long long)a.q_block,
            (long long)a.kv_block);
    const fa_status st = fa_block_mask_build(&a);
    fz_check_status(c, st);
    if (st != FA_STATUS_OK || !fz_backed(c, a.kv_num_blocks) || !fz_backed(c, a.kv_indices) ||
        (a.full_kv_num_blocks &&
         (!fz_backed(c, a.full_kv_num_blocks) || !fz_backed(c, a.full_kv_indices))))
        return;
    unsigned char *seen = calloc((size_t)nk + 1, 1);
    for (int64_t b = 0; b < a.b; b++)
        for (int64_t h = 0; h < a.h; h++)
            for (int64_t q = 0; q < nq; q++) {
                memset(seen, 0, (size_t)nk + 1);
                if (a.full_kv_num_blocks) {
                    fz_bm_row(c, a.full_kv_num_blocks, a.full_kv_indices, "full_kv_indices", b,
                              h, q, nk, seen, 2);
                    const int q_edge = q == nq - 1 && a.sq % a.q_block != 0;
                    if ((q_edge && fz_at(a.full_kv_num_blocks, b, h, q, 0) > 0) ||
                        (a.sk % a.kv_block != 0 && seen[nk - 1] == 2))
                        fz_fail(c, "an edge block of row [%lld, %lld, %lld] is full",
                                (long long)b, (long long)h, (long long)q);
                }
                fz_bm_row(c, a.kv_num_blocks, a.kv_indices, "kv_indices", b, h, q, nk, seen, 1);
            }
    if (a.full_kv_num_blocks && !c->chaos) {
        /* The same build without the full lists: their union, as partial blocks. */
        int32_t *un = malloc((size_t)(a.b * a.h * nq) * sizeof *un);
        int32_t *ui = malloc((size_t)(a.b * a.h * nq * nk) * sizeof *ui);
        if (!un || !ui)
            fz_fail(c, "out of memory");
        const fa_tensor tn = fa_tensor_make(un, FA_DTYPE_I32, 3, ns, NULL);
        const fa_tensor ti = fa_tensor_make(ui, FA_DTYPE_I32, 4, is, NULL);
        fa_block_mask_args u = a;
        u.full_kv_num_blocks = u.full_kv_indices = NULL;
        u.kv_num_blocks = &tn;
        u.kv_indices = &ti;
        if (fa_block_mask_build(&u) != FA_STATUS_OK)
            fz_fail(c, "refused the build without full lists: %s", fa_last_error());
        for (int64_t b = 0; b < a.b; b++)
            for (int64_t h = 0; h < a.h; h++)
                for (int64_t q = 0; q < nq; q++) {
                    memset(seen, 0, (size_t)nk + 1);
                    const int64_t n = fz_bm_row(c, u.kv_num_blocks, u.kv_indices, "union", b, h,
                                                q, nk, seen, 1);
                    int64_t m = 0;
                    for (int pass = 0; pass < 2; pass++) {
                        const fa_tensor *num = pass ? a.full_kv_num_blocks : a.kv_num_blocks;
                        const fa_tensor *ix = pass ? a.full_kv_indices : a.kv_indices;
                        const int64_t cnt = fz_at(num, b, h, q, 0);
                        for (int64_t j = 0; j < cnt; j++)
                            m += seen[fz_at(ix, b, h, q, j)] == 1;
                    }
                    if (n != m || n != fz_at(a.kv_num_blocks, b, h, q, 0) +
                                          fz_at(a.full_kv_num_blocks, b, h, q, 0))
                        fz_fail(c, "row [%lld, %lld, %lld]: %lld blocks without full lists, "
                                   "not the %lld partial and full ones with them",
                                (long long)b, (long long)h, (long long)q, (long long)n,
                                (long long)m);
                }
        free(un);
        free(ui);
    }
    free(seen);
}
