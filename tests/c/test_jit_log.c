/*
 * fa_jit_perf_note (src/cuda/fa_jit.c), which finds ptxas's "Potential Performance Loss" remark
 * in an NVRTC program log, so that precompile refuses a kernel whose wgmma ptxas serialised:
 * logs made of NVRTC's and ptxas's other lines in random order and number, with the remark at a
 * random place or absent, the last line with or without its newline. The remark's line comes
 * back whole (a pointer into the log, its length without the newline); no remark, an empty log
 * or none gives NULL.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/fa_jit.h"
#include "test_util.h"

#define N_CASES 2000

/* Lines a log holds beside the remark (ptxas's C7519 info comes with a serialisation). */
static const char *const benign[] = {
    "fa_fwd_sm90_mainloop.cuh(173): warning #177-D: variable \"php\" was declared but never "
    "referenced",
    "              const int sp = (kv0 + it - 1) % FA_STAGES;",
    "                                                         ^",
    "Remark: The warnings can be suppressed with \"-diag-suppress <warning-number>\"",
    "",
    "ptxas info    : (C7519) warpgroup.arrive is injected in around line 733 by compiler to "
    "allow use of registers in GMMA in function 'fa_fwd'",
    "ptxas info    : Used 168 registers, used 1 barriers",
    "Performance hint: none",
};
static const char *const remarks[] = {
    "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are "
    "serialized due to non wgmma instructions reading accumulator registers of  a wgmma between "
    "start and end of the pipeline stage in the function 'fa_fwd'",
    "ptxas info    : (C7510) Potential Performance Loss: wgmma.mma_async instructions are "
    "serialized due to the presence of Extern calls in the function 'fa_bwd'",
};

static void check_case(tu_rng *r, int i)
{
    char log[4096];
    size_t at = 0;
    const int lines = (int)tu_rng_int(r, 0, 12);
    const int remark_at = tu_rng_chance(r, 0.6) ? (int)tu_rng_int(r, 0, lines) : -1;
    const char *remark = remarks[tu_rng_int(r, 0, 1)];
    size_t remark_off = 0;
    const int newline_last = tu_rng_chance(r, 0.5);
    const int total = lines + (remark_at >= 0);
    for (int l = 0; l < total; l++) {
        const char *text;
        if (l == remark_at) {
            text = remark;
            remark_off = at;
        } else {
            text = benign[tu_rng_int(r, 0, sizeof benign / sizeof benign[0] - 1)];
        }
        const size_t len = strlen(text);
        memcpy(log + at, text, len);
        at += len;
        if (l < total - 1 || newline_last)
            log[at++] = '\n';
    }
    log[at] = '\0';

    size_t len = 12345;
    const char *got = fa_jit_perf_note(log, &len);
    if (remark_at < 0) {
        TU_CHECK(got == NULL, "case %d: a remark found in a log without one: %.80s", i,
                 got ? got : "");
        return;
    }
    TU_CHECK(got == log + remark_off, "case %d: the remark at %zu, found at %td", i, remark_off,
             got ? got - log : (ptrdiff_t)-1);
    TU_CHECK(got && len == strlen(remark), "case %d: length %zu, want %zu", i, len,
             strlen(remark));
}

int main(void)
{
    tu_rng r = {tu_master_seed("test_jit_log")};
    for (int i = 0; i < N_CASES; i++)
        check_case(&r, i);
    size_t len = 0;
    TU_CHECK(fa_jit_perf_note(NULL, &len) == NULL, "no log: a remark");
    TU_CHECK(fa_jit_perf_note("", &len) == NULL, "an empty log: a remark");
    return tu_finish("test_jit_log");
}
