/*
 * The order in which the persistent sm90 backward's CTAs claim work items under a right window
 * edge (causal): key blocks longest first within chunks of `groups` (kv head, sequence) pairs
 * (kernels/fa_bwd_sm90.cuh, fa_bwd_item_make). The chunk size bounds the pairs whose Q and dO
 * are in flight (L2), and it decides the grid's tail: a CTA claims the next item when it is
 * done, and where a chunk's items number about a multiple of the multiprocessors the CTAs that
 * drew short items take the next chunk's long ones, while other sizes leave long items to
 * start near the end. Which size is best jumps with the shape, so the host simulates the claims
 * for each size the L2 bound allows and moves off the bound where another finishes sooner.
 */
#include <stdint.h>
#include <string.h>

#include "fa_rules.h"
#include "plan/fa_plan.h"

/* The pairs' Q and dO that the chunk may keep in L2, and the chunk's most pairs. */
#define FA_LPT_L2_BYTES ((int64_t)16 << 20)
#define FA_LPT_MAX_GROUPS 8
/* An item's fixed cost (K and V loaded, dK and dV stored) in query tiles' time. */
#define FA_LPT_ITEM_COST 1
/* Claims simulated per shape at most (items times candidate sizes), key blocks and
 * multiprocessors: past them the L2 bound alone decides. */
#define FA_LPT_MAX_CLAIMS ((int64_t)1 << 21)
#define FA_LPT_MAX_BLOCKS 1024
#define FA_LPT_MAX_SMS 512

_Static_assert(sizeof(fa_lpt_shape) == 4 * sizeof(int64_t) + 8 * sizeof(int),
               "fa_lpt_shape: no padding, so the memo's memcmp compares fields only");

/* Query tiles of bm rows that see key block nb of bn keys (FA_RULE_ROW_RANGE), times the query
 * heads of the kv head: the item's tour. */
static int64_t fa_lpt_item_tiles(const fa_lpt_shape *s, int64_t nb)
{
    const int64_t j0 = nb * s->bn, j1 = j0 + s->bn < s->sk ? j0 + s->bn : s->sk;
    fa_i64 lo, hi;
    FA_RULE_ROW_RANGE(j0, j1, s->sq, s->sk, s->window_left, s->window_right, lo, hi);
    return hi > lo ? ((hi - 1) / s->bm - lo / s->bm + 1) * s->group : 0;
}

/* Every key block's tour (the items of a block are alike across pairs); 0 past the limits. */
static int fa_lpt_tours(const fa_lpt_shape *s, int64_t tiles[FA_LPT_MAX_BLOCKS])
{
    if (s->sms < 1 || s->sms > FA_LPT_MAX_SMS || s->n_tiles < 1 || s->n_tiles > FA_LPT_MAX_BLOCKS)
        return 0;
    for (int64_t nb = 0; nb < s->n_tiles; nb++)
        tiles[nb] = fa_lpt_item_tiles(s, nb);
    return 1;
}

/* The last CTA's finishing time when `sms` CTAs claim the items in the kernel's order for chunks
 * of `groups` pairs: each claim goes to the CTA that is free first (a min-heap of their
 * finishing times). */
static int64_t fa_lpt_makespan(const fa_lpt_shape *s, const int64_t *tiles, int groups)
{
    int64_t heap[FA_LPT_MAX_SMS] = {0};
    const int n = s->sms;
    for (int64_t g0 = 0; g0 < s->pairs; g0 += groups) {
        const int64_t cg = s->pairs - g0 < groups ? s->pairs - g0 : groups;
        for (int64_t nb = 0; nb < s->n_tiles; nb++)
            for (int64_t k = 0; k < cg; k++) {
                /* the root, the earliest free CTA, takes the item; then sifted down */
                const int64_t t = heap[0] + tiles[nb] + FA_LPT_ITEM_COST;
                int i = 0;
                for (;;) {
                    const int l = 2 * i + 1, r = l + 1;
                    int m = i;
                    int64_t v = t;
                    if (l < n && heap[l] < v)
                        m = l, v = heap[l];
                    if (r < n && heap[r] < v)
                        m = r, v = heap[r];
                    if (m == i)
                        break;
                    heap[i] = heap[m];
                    i = m;
                }
                heap[i] = t;
            }
    }
    int64_t end = 0;
    for (int i = 0; i < n; i++)
        end = heap[i] > end ? heap[i] : end;
    return end;
}

int64_t fa_plan_backward_lpt_makespan(const fa_lpt_shape *s, int groups)
{
    int64_t tiles[FA_LPT_MAX_BLOCKS];
    return groups >= 1 && fa_lpt_tours(s, tiles) ? fa_lpt_makespan(s, tiles, groups) : -1;
}

int fa_plan_backward_lpt_groups(const fa_lpt_shape *s)
{
    const int64_t pair_bytes = s->sq * (s->d + s->dv) * 2 * s->group;
    int64_t gmax = pair_bytes > 0 ? FA_LPT_L2_BYTES / pair_bytes : FA_LPT_MAX_GROUPS;
    gmax = gmax < 1 ? 1 : gmax > FA_LPT_MAX_GROUPS ? FA_LPT_MAX_GROUPS : gmax;
    if (gmax > s->pairs)
        gmax = s->pairs > 0 ? s->pairs : 1;
    if (gmax == 1 || s->pairs * s->n_tiles * gmax > FA_LPT_MAX_CLAIMS)
        return (int)gmax;

    /* The last shapes' answers (a backward's shape repeats over a training run); the shape
     * has no padding, so memcmp compares its fields. */
    static _Thread_local struct {
        fa_lpt_shape s;
        int groups;
    } memo[4];
    static _Thread_local int memo_next;
    for (int i = 0; i < 4; i++)
        if (memo[i].groups > 0 && memcmp(&memo[i].s, s, sizeof *s) == 0)
            return memo[i].groups;

    int64_t tiles[FA_LPT_MAX_BLOCKS];
    if (!fa_lpt_tours(s, tiles))
        return (int)gmax;

    /* The L2 bound unless it simulates over 1% longer than the shortest grid; then the most
     * pairs among those within 0.2% of the shortest. */
    int64_t span[FA_LPT_MAX_GROUPS + 1];
    int64_t best = INT64_MAX;
    for (int g = 1; g <= gmax; g++) {
        span[g] = fa_lpt_makespan(s, tiles, g);
        best = span[g] < best ? span[g] : best;
    }
    int groups = (int)gmax;
    if (span[gmax] * 100 > best * 101)
        for (int g = (int)gmax; g >= 1; g--)
            if (span[g] * 1000 <= best * 1002) {
                groups = g;
                break;
            }
    memo[memo_next].s = *s;
    memo[memo_next].groups = groups;
    memo_next = (memo_next + 1) % 4;
    return groups;
}
