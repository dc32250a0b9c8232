/*
 * The derivative of a score_mod's steps with respect to score (forward mode: each step's from
 * its operands' values and derivatives), written once for both backends: the CPU evaluator
 * (cpu/fa_cpu_mod_body.h) expands each rule into a loop over a chunk, the CUDA C emitter
 * (fa_mod_cuda.c) prints it as the text of a statement of fa_score_mod_grad.
 *
 * A rule is an expression in the operands' values x, y and derivatives dx, dy, dz (where: x the
 * condition, dy and dz the branches'), with the functions each side defines:
 *   FA_MOD_D_EXP, FA_MOD_D_LOG, FA_MOD_D_TANH, FA_MOD_D_SQRT, FA_MOD_D_FLOOR (one operand),
 *   FA_MOD_D_POW (two), FA_MOD_D_SQ (the square).
 * Operations not listed have derivative 0: booleans, floor, aux reads, constants, and every
 * variable but score (whose derivative is 1). At a kink (abs at 0, min / max ties) the branch
 * the value takes; pow and mod drop the terms of a constant base, exponent or divisor (log of a
 * negative base stays out of a constant base's derivative).
 */
#ifndef FA_MOD_GRAD_H
#define FA_MOD_GRAD_H

#include "mod/fa_mod_program.h"

#define FA_MOD_GRAD_RULES(X)                                                                     \
    X(FA_MOD_OP_WHERE, x != 0 ? dy : dz)                                                         \
    X(FA_MOD_NEG, -dx)                                                                           \
    X(FA_MOD_EXP, FA_MOD_D_EXP(x) * dx)                                                          \
    X(FA_MOD_LOG, dx / x)                                                                        \
    X(FA_MOD_TANH, (1 - FA_MOD_D_SQ(FA_MOD_D_TANH(x))) * dx)                                     \
    X(FA_MOD_ABS, x > 0 ? dx : x < 0 ? -dx : 0)                                                  \
    X(FA_MOD_SQRT, dx / (2 * FA_MOD_D_SQRT(x)))                                                  \
    X(FA_MOD_ADD, dx + dy)                                                                       \
    X(FA_MOD_SUB, dx - dy)                                                                       \
    X(FA_MOD_MUL, dx * y + x * dy)                                                               \
    X(FA_MOD_DIV, (dx - x / y * dy) / y)                                                         \
    X(FA_MOD_MIN, (x < y || x != x) ? dx : dy)                                                   \
    X(FA_MOD_MAX, (x > y || x != x) ? dx : dy)                                                   \
    X(FA_MOD_POW, (dx != 0 ? y * FA_MOD_D_POW(x, y - 1) * dx : 0) +                              \
                      (dy != 0 ? FA_MOD_D_POW(x, y) * FA_MOD_D_LOG(x) * dy : 0))                 \
    X(FA_MOD_MOD, dx - (dy != 0 ? FA_MOD_D_FLOOR(x / y) * dy : 0))

#endif /* FA_MOD_GRAD_H */
