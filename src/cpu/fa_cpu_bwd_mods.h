/*
 * The CPU backward's parts for calls with user-defined scoring (fa_cpu_mod.h), for one compute
 * precision: fa_cpu_bwd_body.h includes it after its tile type, with the same FA_* macros.
 */

/*
 * fa_bwd_probs for calls with user-defined scoring: the scores recomputed as the forward's
 * (scale, softcap, ALiBi, then score_mod and the masks, fa_cpu_mod_apply_grad), the factor
 * d(final score)/d(q.k scaled) kept per element (softcap's and score_mod's derivatives), then
 * pt = P^T * Z and dxt = dS^T * factor * scale; masked keys and padding rows 0. Cloned itself:
 * a callee the compiler does not inline is built for the baseline, whatever its caller's clone.
 */
FA_CPU_CLONES static void FA_FN(fa_bwd_probs_mods)(const fa_params *p, FA_FN(fa_bwd_tile) * t,
                                     const fa_cpu_mod_at *at, int64_t m, int64_t mp, int64_t j0,
                                     int64_t n, FA_REAL slope, FA_REAL sscale)
{
    void *dbuf, *factor, *score_in;
    fa_cpu_mod_grad_parts(p, t->mod_scratch, sizeof(FA_REAL), FA_CPU_BM, FA_CPU_BN, &dbuf,
                          &factor, &score_in);
    FA_REAL *restrict fac = factor; /* [n][mp] */
    FA_REAL *sin = t->aux_acc ? score_in : NULL; /* [n][mp] score_mod's input scores */
    const int softcap = p->softcap > 0;
    const FA_REAL cap = (FA_REAL)p->softcap, inv_cap = softcap ? (FA_REAL)(1.0 / p->softcap) : 0;
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < mp; i++) {
            FA_REAL x = t->pt[j * mp + i] * sscale, deriv = 1;
            if (softcap) {
                const FA_REAL th = FA_RULE_SOFTCAP_TANH(x, inv_cap, FA_TANHV);
                x = cap * th;
                deriv = FA_RULE_SOFTCAP_GRAD(th);
            }
            t->pt[j * mp + i] = x - FA_RULE_ALIBI(slope, t->diag[i] - (FA_REAL)(j0 + j));
            fac[j * mp + i] = deriv;
        }
    if (sin)
        memcpy(sin, t->pt, (size_t)(n * mp) * sizeof(FA_REAL));
    FA_FN(fa_cpu_mod_apply_grad)(p, (FA_REAL *)t->mod_scratch, (FA_REAL *)dbuf, t->pt, fac, mp,
                                 n, 0, m, at);
    const FA_REAL scale = (FA_REAL)p->scale;
    const int dropout = p->dropout_p > 0;
    /* The captured tensors' gradients first, apart: a call in the loop below would keep it
     * from vectorising. ds is the gradient of the element's final score; the visible elements
     * are gathered into runs. */
    fa_cpu_aux_run run = {0};
    if (sin)
        run = fa_cpu_aux_run_at(t->aux_plan, t->aux_scratch);
    for (int64_t j = 0; sin && j < n; j++) {
        const FA_REAL key = (FA_REAL)(j0 + j);
        for (int64_t i = 0; i < m; i++) {
            const FA_REAL x = t->pt[j * mp + i];
            if (x == -(FA_REAL)INFINITY || key < t->lo[i] || key >= t->hi[i])
                continue;
            const FA_REAL prob = FA_EXPV(x - t->lse[i]);
            const FA_REAL z = dropout ? t->zt[j * mp + i] : 1;
            const FA_REAL ds = prob * (t->dxt[j * mp + i] * z - t->dsum[i]);
            run.q[run.n] = at->q0 + i;
            run.kv[run.n] = j0 + j;
            run.score[run.n] = (double)sin[j * mp + i];
            run.ds[run.n++] = (double)ds;
            if (run.n == FA_CPU_AUX_CHUNK)
                fa_cpu_mod_aux_grad_add(p, t->aux_plan, t->aux_scratch, &run, t->aux_acc, at->b,
                                        at->h);
        }
    }
    if (sin)
        fa_cpu_mod_aux_grad_add(p, t->aux_plan, t->aux_scratch, &run, t->aux_acc, at->b, at->h);
    for (int64_t j = 0; j < n; j++) {
        const FA_REAL key = (FA_REAL)(j0 + j);
        for (int64_t i = 0; i < mp; i++) {
            const FA_REAL x = t->pt[j * mp + i];
            const int seen = x != -(FA_REAL)INFINITY && key >= t->lo[i] && key < t->hi[i];
            const FA_REAL prob = FA_EXPV(x - t->lse[i]);
            const FA_REAL z = dropout ? t->zt[j * mp + i] : 1;
            t->pt[j * mp + i] = seen ? prob * z : 0;
            t->dxt[j * mp + i] =
                seen ? prob * (t->dxt[j * mp + i] * z - t->dsum[i]) * fac[j * mp + i] * scale : 0;
        }
    }
}

/* Whether the block mask skips keys [j0, j0 + n) for every row of [r0, r0 + m) of head h: the
 * block then adds nothing to any gradient, as in the forward it adds nothing to out. */
static int FA_FN(fa_bwd_mod_skip)(const fa_params *p, FA_FN(fa_bwd_tile) * t, int64_t seq_index,
                                  int64_t h, int64_t r0, int64_t m, int64_t j0, int64_t n)
{
    if (!fa_mod_call_active(&p->mods) || !p->mods.blocks.num.data)
        return 0;
    fa_cpu_mod_at at = {seq_index, h, r0, j0, NULL, 0, 0, 0};
    fa_cpu_mod_blocks_load(p, &at, t->mod_scratch, sizeof(FA_REAL), r0, m);
    return fa_cpu_mod_blocks_skip(p, &at, j0, n);
}
