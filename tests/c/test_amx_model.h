/*
 * A software model of the AMX tile instructions, written from the SDM's pseudo-code, and the
 * AMX kernel of the CPU bf16 path (src/cpu/fa_cpu_amx_body.h) compiled against it as
 * k_amx_model: the code AMX machines run, on any x86-64 machine. For test_bf16 (the products,
 * whole forwards) and test_backward (whole backwards, FA_TEST_BF16_KERNEL=amx-model). Include
 * once, after test_util.h and cpu/fa_cpu_bf16.h, where FA_CPU_HAS_BF16 is defined; g_emu_errors
 * counts tile operations without a configuration or on shapes that do not fit.
 */
#ifndef FA_TEST_AMX_MODEL_H
#define FA_TEST_AMX_MODEL_H

#include <stdint.h>
#include <string.h>

#include "util/fa_half.h"

typedef struct emu_tile {
    int rows, colsb;
    uint8_t data[16][64];
} emu_tile;

/* Per thread, like the registers: the forward runs the kernel on several threads. */
static _Thread_local emu_tile g_tmm[8];
static _Thread_local int g_configured;
static int g_emu_errors;

static void emu_config(const void *cfg)
{
    const uint8_t *c = cfg;
    TU_CHECK(c[0] == 1, "tile config palette %d", c[0]);
    for (int t = 0; t < 8; t++) {
        g_tmm[t].colsb = c[16 + 2 * t] | c[17 + 2 * t] << 8;
        g_tmm[t].rows = c[48 + t];
        memset(g_tmm[t].data, 0, sizeof g_tmm[t].data);
    }
    g_configured = 1;
}

static void emu_save(void *cfg)
{
    uint8_t *c = cfg;
    memset(c, 0, 64);
    if (!g_configured)
        return;
    c[0] = 1;
    for (int t = 0; t < 8; t++) {
        c[16 + 2 * t] = (uint8_t)(g_tmm[t].colsb & 0xff);
        c[17 + 2 * t] = (uint8_t)(g_tmm[t].colsb >> 8);
        c[48 + t] = (uint8_t)g_tmm[t].rows;
    }
}

static void emu_release(void)
{
    g_configured = 0;
}

static emu_tile *emu_get(int t)
{
    if (!g_configured)
        g_emu_errors++;
    return &g_tmm[t];
}

static void emu_zero(int t)
{
    memset(emu_get(t)->data, 0, sizeof g_tmm[t].data);
}

static void emu_load(int t, const void *p, long stride)
{
    emu_tile *x = emu_get(t);
    for (int r = 0; r < x->rows; r++)
        memcpy(x->data[r], (const uint8_t *)p + r * stride, (size_t)x->colsb);
}

static void emu_store(int t, void *p, long stride)
{
    emu_tile *x = emu_get(t);
    for (int r = 0; r < x->rows; r++)
        memcpy((uint8_t *)p + r * stride, x->data[r], (size_t)x->colsb);
}

static float emu_bf16(const uint8_t *row, int i)
{
    uint16_t h;
    memcpy(&h, row + 2 * i, 2);
    return fa_bf16_to_f32(h);
}

/* TDPBF16PS: for each row m, pair k, column n, in that order, the even then the odd product
 * added to the fp32 accumulator (products of bf16 values are exact in fp32). */
static void emu_dp(int c, int a, int b)
{
    emu_tile *tc = emu_get(c), *ta = emu_get(a), *tb = emu_get(b);
    if (ta->colsb / 4 != tb->rows || tc->colsb != tb->colsb || tc->rows != ta->rows)
        g_emu_errors++;
    for (int m = 0; m < tc->rows; m++) {
        float acc[16];
        memcpy(acc, tc->data[m], sizeof acc);
        for (int k = 0; k < ta->colsb / 4; k++)
            for (int n = 0; n < tc->colsb / 4; n++) {
                acc[n] += emu_bf16(ta->data[m], 2 * k) * emu_bf16(tb->data[k], 2 * n);
                acc[n] += emu_bf16(ta->data[m], 2 * k + 1) * emu_bf16(tb->data[k], 2 * n + 1);
            }
        memcpy(tc->data[m], acc, sizeof acc);
    }
}

#define FA_AMX_FN(name) name##_emu
#define FA_AMX_TARGET
#define FA_AMX_CONFIG(cfg) emu_config(cfg)
#define FA_AMX_SAVE(cfg) emu_save(cfg)
#define FA_AMX_RELEASE() emu_release()
#define FA_AMX_ZERO(t) emu_zero(t)
#define FA_AMX_LOAD(t, p, s) emu_load(t, p, s)
#define FA_AMX_STORE(t, p, s) emu_store(t, p, s)
#define FA_AMX_DP(c, a, b) emu_dp(c, a, b)
#include "cpu/fa_cpu_amx_body.h"

static const fa_cpu_bf16_kernel k_amx_model = {fa_amx_begin_emu, fa_amx_gemm_emu, fa_amx_end_emu,
                                                "amx (software model)"};

#endif /* FA_TEST_AMX_MODEL_H */
