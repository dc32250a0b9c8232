/*
 * The deterministic fuzzer: fa_fuzz [cases [seed]] runs `cases` cases (default 2000) drawn from
 * `seed` (default 1), case i from seed + i, so that a failing case reruns alone with
 * `fa_fuzz 1 <seed + i>`. Meant to run under ASan and UBSan; see fa_fuzz_case.h.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>

#include "fa_fuzz_case.h"

/* Under a sanitizer, which ends the process on its first report, say which case it was. */
void __sanitizer_set_death_callback(void (*callback)(void)) __attribute__((weak));
static unsigned long long fz_current_seed;

static void fz_on_death(void)
{
    fprintf(stderr, "fa_fuzz: stopped in the case of seed %llu (rerun it alone: fa_fuzz 1 %llu; "
                    "FA_FUZZ_VERBOSE=1 prints its calls)\n",
            fz_current_seed, fz_current_seed);
}

/* Sanitizer reports end in abort(), so that the handler below names the case. */
const char *__asan_default_options(void);
const char *__ubsan_default_options(void);
const char *__asan_default_options(void)
{
    return "abort_on_error=1";
}
const char *__ubsan_default_options(void)
{
    return "abort_on_error=1:print_stacktrace=1";
}

static void fz_on_abort(int sig)
{
    (void)sig;
    fz_on_death();
}

static int fz_parse(const char *text, unsigned long long *value)
{
    char *end;
    errno = 0;
    *value = strtoull(text, &end, 0);
    return errno == 0 && end != text && *end == '\0';
}

int main(int argc, char **argv)
{
    unsigned long long cases = 2000, seed = 1, accepted = 0;
    if (argc > 3 || (argc > 1 && !fz_parse(argv[1], &cases)) ||
        (argc > 2 && !fz_parse(argv[2], &seed))) {
        fprintf(stderr, "usage: %s [cases [seed]]\n", argv[0]);
        return 2;
    }
    signal(SIGABRT, fz_on_abort); /* a broken contract: fz_fail printed it, then aborts */
    if (__sanitizer_set_death_callback)
        __sanitizer_set_death_callback(fz_on_death);
    for (unsigned long long i = 0; i < cases; i++) {
        fz_src src;
        fz_current_seed = seed + i;
        fz_src_from_seed(&src, seed + i);
        if (getenv("FA_FUZZ_VERBOSE"))
            fprintf(stderr, "case %llu (seed %llu)\n", i, seed + i);
        accepted += (unsigned long long)fz_run_case(&src);
    }
    printf("fa_fuzz: %llu cases from seed %llu (%llu calls returned OK), every contract held\n",
           cases, seed, accepted);
    return 0;
}
