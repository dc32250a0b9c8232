/*
 * The evaluation layout of a finished program (fa_mod_program.h): what each step varies with
 * and the buffer it writes (vary, slot, n_slots, reads_h, reads_b).
 */
#include "mod/fa_mod_program.h"

/* vary, slot and n_slots (fa_mod_program.h): a step varies with what its operands vary with.
 * QKV steps share buffers: a step's operands are released before its result takes one, so an
 * elementwise step may write over an operand it is the last (QKV) reader of. */
static void fa_mod_classify(fa_mod *m)
{
    int last[FA_MOD_MAX_NODES], free_list[FA_MOD_MAX_NODES], n_free = 0;
    for (int c = 0; c < 4; c++)
        m->n_slots[c] = 0;
    m->reads_h = m->reads_b = 0;
    for (int i = 0; i < m->n_steps; i++) {
        const fa_mod_node *s = &m->steps[i];
        int v = 0;
        if (s->op == FA_MOD_OP_VAR)
            v = s->what == FA_MOD_SCORE   ? FA_MOD_VARY_QKV
                : s->what == FA_MOD_Q_IDX ? FA_MOD_VARY_Q
                : s->what == FA_MOD_KV_IDX ? FA_MOD_VARY_KV
                                           : 0;
        for (int a = 0; a < s->n_args; a++)
            v |= m->vary[s->args[a]];
        m->vary[i] = (unsigned char)v;
        m->reads_h |= s->op == FA_MOD_OP_VAR && s->what == FA_MOD_H;
        m->reads_b |= s->op == FA_MOD_OP_VAR && s->what == FA_MOD_B;
        last[i] = i;
        for (int a = 0; a < s->n_args; a++)
            if (v == FA_MOD_VARY_QKV)
                last[s->args[a]] = i;
    }
    for (int i = 0; i < m->n_steps; i++) {
        const fa_mod_node *s = &m->steps[i];
        if (m->vary[i] != FA_MOD_VARY_QKV) {
            m->slot[i] = m->n_slots[m->vary[i]]++;
            continue;
        }
        for (int a = 0; a < s->n_args; a++) {
            const int x = s->args[a];
            int seen = 0;
            for (int b = 0; b < a; b++)
                seen |= s->args[b] == x;
            if (m->vary[x] == FA_MOD_VARY_QKV && last[x] == i && !seen)
                free_list[n_free++] = m->slot[x];
        }
        m->slot[i] = n_free ? free_list[--n_free] : m->n_slots[FA_MOD_VARY_QKV]++;
    }
}

void fa_mod_layout(fa_mod *m)
{
    fa_mod_classify(m);
}
