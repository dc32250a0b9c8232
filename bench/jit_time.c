/*
 * jit_time: NVRTC's compile time of a user-defined mod's CUDA kernels, planned as a flex call
 * plans them (no GPU needed): the forward's module, the backward's, or both side by side in two
 * threads as a training step's first call compiles them (fa_attention_backward_prepare).
 *
 *   make build        (or: cc -O2 -Iinclude -Isrc -Ikernels bench/jit_time.c \
 *                       build/libflashattn.a -lpthread -ldl -lm -fopenmp -o build/jit_time)
 *   build/jit_time 'TEXT' [fwd|bwd|both] [options]
 *     TEXT      a mod in fa_mod_text's form, e.g. 'mask: kv_idx; q_idx; le $0 $1', or
 *               'none': the built-in kernels of the same key (causal is not a plan key)
 *     --block-mask        with create_block_mask's 128 x 128 block mask (mask_mods' calls)
 *     --mask TEXT         a mask_mod beside TEXT's score_mod (flex's score_mods over a
 *                         causal block mask: --mask 'mask: kv_idx; q_idx; le $0 $1')
 *     --aux BITS          the plan's aux bits (fa_plan_key.mod_aux: bit i aux i is int32,
 *                         16 offsets fit an int; default 16)
 *     --arch N --hdim D --dtype bf16|fp16    (default 90, 128, bf16)
 *     --sm80              the sm80 family's kernels (FA_PLAN_NO_SM90)
 *     --reps N            compiles of each (default 5): prints the least and the median, s
 *     --opt OPTION        an extra NVRTC option (e.g. --split-compile=0; 23 characters at most)
 *     --keep DIR          write the cubins into the disk cache at DIR (for cuobjdump and
 *                         tools/check_spills.py; each repetition's key is its own)
 * Each repetition compiles anew (the disk cache off, a define of its own in the key, and
 * NVRTC's own cache, which CUDA 12.9+ keeps in the driver's compute cache, off by
 * CUDA_CACHE_DISABLE); NVRTC is loaded by a built-in kernel's compile first. Exits 77
 * (skipped) without NVRTC. `make build` builds it too (tools/CMakeLists.txt), as
 * build/jit_time.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda/fa_cuda_driver.h"
#include "cuda/fa_jit.h"
#include "flashattn.h"
#include "mod/fa_mod_program.h"
#include "plan/fa_plan.h"

typedef struct jt_job {
    fa_plan plan;
    double secs;
    fa_status st;
} jt_job;

static double jt_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void *jt_build(void *arg)
{
    jt_job *j = arg;
    fa_jit_origin origin;
    const double t = jt_now();
    j->st = fa_jit_build(&j->plan, &origin);
    j->secs = jt_now() - t;
    if (j->st == FA_STATUS_OK && origin != FA_JIT_COMPILED)
        j->st = FA_STATUS_INTERNAL; /* found cached: not a compile's time */
    return NULL;
}

/* The plan's defines plus the repetition's own (a new key) and the extra option; 0 where they
 * do not fit. */
static int jt_defines(fa_plan *p, int rep, const char *opt)
{
    if (p->num_defines + 1 + (opt != NULL) > FA_PLAN_MAX_DEFINES)
        return 0;
    snprintf(p->defines[p->num_defines++], sizeof p->defines[0], "-DFA_JIT_REP=%u",
             (unsigned)rep % 1000u);
    if (opt)
        snprintf(p->defines[p->num_defines++], sizeof p->defines[0], "%s", opt);
    return 1;
}

static int jt_cmp(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: jit_time 'MOD TEXT' [fwd|bwd|both] [--block-mask] [--aux BITS] "
                        "[--arch N] [--hdim D] [--dtype bf16|fp16] [--sm80] [--reps N] "
                        "[--opt OPTION] [--keep DIR] [--mask TEXT]\n");
        return 2;
    }
    const char *mode = "both", *opt = NULL, *keep = "", *mask_text = NULL;
    int bmask = 0, sm80 = 0, reps = 5, arch = 90, hdim = 128;
    unsigned aux = 16;
    fa_dtype dt = FA_DTYPE_BF16;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "fwd") || !strcmp(a, "bwd") || !strcmp(a, "both"))
            mode = a;
        else if (!strcmp(a, "--block-mask"))
            bmask = 1;
        else if (!strcmp(a, "--sm80"))
            sm80 = 1;
        else if (v && !strcmp(a, "--aux"))
            aux = (unsigned)strtoul(argv[++i], NULL, 0);
        else if (v && !strcmp(a, "--arch"))
            arch = atoi(argv[++i]);
        else if (v && !strcmp(a, "--hdim"))
            hdim = atoi(argv[++i]);
        else if (v && !strcmp(a, "--dtype"))
            dt = !strcmp(argv[++i], "fp16") ? FA_DTYPE_F16 : FA_DTYPE_BF16;
        else if (v && !strcmp(a, "--reps"))
            reps = atoi(argv[++i]);
        else if (v && !strcmp(a, "--opt") && strlen(v) < sizeof((fa_plan *)0)->defines[0])
            opt = argv[++i];
        else if (v && !strcmp(a, "--keep"))
            keep = argv[++i];
        else if (v && !strcmp(a, "--mask"))
            mask_text = argv[++i];
        else {
            fprintf(stderr, "jit_time: unknown or incomplete option %s\n", a);
            return 2;
        }
    }
    if (reps < 1 || reps > 100)
        reps = 5;
    /* NVRTC's cache keys the front end's output, which the repetition's define leaves alone. */
    setenv("CUDA_CACHE_DISABLE", "1", 1);
    if (!fa_nvrtc_get()) {
        fprintf(stderr, "jit_time: NVRTC is missing, skipped\n%s\n", fa_cuda_status());
        return 77;
    }
    /* No disk cache unless --keep: every repetition compiles (its key is new either way). */
    setenv("FLASHATTN_CACHE_DIR", keep, 1);
    const int builtin = strcmp(argv[1], "none") == 0;
    fa_mod *m = NULL;
    if (!builtin && fa_mod_parse(argv[1], &m) != FA_STATUS_OK) {
        fprintf(stderr, "jit_time: %s\n", fa_last_error());
        return 1;
    }
    const int score = strncmp(argv[1], "score", 5) == 0;
    fa_mod *mask = NULL;
    if (mask_text && (!score || fa_mod_parse(mask_text, &mask) != FA_STATUS_OK)) {
        fprintf(stderr, "jit_time: --mask: %s\n", score ? fa_last_error() : "TEXT is no score_mod");
        return 1;
    }
    fa_plan_key key = {arch, dt, hdim, hdim, 0, aux, bmask ? 128 : 0, bmask ? 128 : 0};
    if (!builtin)
        key.features |= score ? FA_PLAN_SCORE_MOD : FA_PLAN_MASK_MOD;
    key.features |= mask ? FA_PLAN_MASK_MOD : 0;
    key.features |= bmask ? FA_PLAN_BLOCK_MASK : 0;
    key.features |= sm80 ? FA_PLAN_NO_SM90 : 0;
    fa_plan fwd, bwd;
    if (fa_plan_forward(&key, &fwd) != FA_STATUS_OK || fa_plan_backward(&key, &bwd) != FA_STATUS_OK) {
        fprintf(stderr, "jit_time: plan: %s\n", fa_last_error());
        return 1;
    }
    fwd.score_mod = bwd.score_mod = m && score ? m->cuda : NULL;
    fwd.mask_mod = bwd.mask_mod = m && !score ? m->cuda : mask ? mask->cuda : NULL;

    /* NVRTC loaded and warm: a built-in kernel first. */
    jt_job warm = {0};
    const fa_plan_key warm_key = {arch, dt, 64, 64, 0, 0, 0, 0};
    if (fa_plan_forward(&warm_key, &warm.plan) == FA_STATUS_OK)
        jt_build(&warm);

    const int do_fwd = strcmp(mode, "bwd") != 0, do_bwd = strcmp(mode, "fwd") != 0;
    double tf[100], tb[100], tt[100];
    for (int r = 0; r < reps; r++) {
        jt_job f = {fwd, 0, FA_STATUS_OK}, b = {bwd, 0, FA_STATUS_OK};
        if ((do_fwd && !jt_defines(&f.plan, r, opt)) || (do_bwd && !jt_defines(&b.plan, r, opt))) {
            fprintf(stderr, "jit_time: the plan's defines leave no room for the option\n");
            return 1;
        }
        const double t = jt_now();
        if (do_fwd && do_bwd) {
            pthread_t th;
            pthread_create(&th, NULL, jt_build, &b);
            jt_build(&f);
            pthread_join(th, NULL);
        } else if (do_fwd) {
            jt_build(&f);
        } else {
            jt_build(&b);
        }
        tt[r] = jt_now() - t;
        if ((do_fwd && f.st != FA_STATUS_OK) || (do_bwd && b.st != FA_STATUS_OK)) {
            fprintf(stderr, "jit_time: compile failed: %s\n", fa_last_error());
            return 1;
        }
        tf[r] = f.secs;
        tb[r] = b.secs;
    }
    qsort(tf, (size_t)reps, sizeof tf[0], jt_cmp);
    qsort(tb, (size_t)reps, sizeof tb[0], jt_cmp);
    qsort(tt, (size_t)reps, sizeof tt[0], jt_cmp);
    printf("%s | %s%s, %d reps, s (least / median):", argv[1], mode, bmask ? ", block mask" : "",
           reps);
    if (do_fwd)
        printf(" fwd %s %.2f / %.2f", fwd.family, tf[0], tf[reps / 2]);
    if (do_bwd)
        printf(" bwd %s %.2f / %.2f", bwd.family, tb[0], tb[reps / 2]);
    printf(" total %.2f / %.2f\n", tt[0], tt[reps / 2]);
    fa_mod_destroy(m);
    fa_mod_destroy(mask);
    return 0;
}
