/* CPU feature detection, and the thread count the CPU backend uses by default. */
#include "cpu/fa_cpu_info.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "api/fa_internal.h"
#include "cpu/fa_cpu_bf16.h"
#include "cpu/fa_cpu_gemm.h"

static fa_cpu_info g_info;
static char g_description[256];
static char g_report[320]; /* g_description and the kernels picked from it */
static pthread_once_t g_report_once = PTHREAD_ONCE_INIT;
static int g_affinity_cpus;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

#if defined(__x86_64__)
/* XCR0 says which register state the OS saves on a context switch. Inline asm rather than
 * _xgetbv() so that the file needs no -mxsave. Only call it when CPUID reports OSXSAVE. */
static uint64_t xcr0_read(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static int bit(unsigned reg, int n)
{
    return (int)((reg >> n) & 1u);
}

static void x86_features_detect(fa_cpu_info *ci)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return;
    uint64_t xcr0 = bit(c, 27) ? xcr0_read() : 0;
    int os_avx = (xcr0 & 0x6) == 0x6;                 /* XMM, YMM */
    int os_avx512 = os_avx && (xcr0 & 0xe0) == 0xe0; /* opmask, ZMM0-15 upper, ZMM16-31 */
    int os_amx = (xcr0 & 0x60000) == 0x60000;         /* XTILECFG, XTILEDATA */

    ci->avx = os_avx && bit(c, 28);
    ci->fma = ci->avx && bit(c, 12);
    ci->f16c = ci->avx && bit(c, 29);

    if ((unsigned)__get_cpuid_max(0, NULL) < 7u)
        return;
    __cpuid_count(7, 0, a, b, c, d);
    unsigned max_subleaf = a;
    ci->avx2 = ci->avx && bit(b, 5);
    ci->avx512f = os_avx512 && bit(b, 16);
    ci->avx512bw = ci->avx512f && bit(b, 30);
    ci->avx512vl = ci->avx512f && bit(b, 31);
    ci->avx512fp16 = ci->avx512f && bit(d, 23);
    ci->amx_tile = os_amx && bit(d, 24);
    ci->amx_bf16 = ci->amx_tile && bit(d, 22);
    if (max_subleaf >= 1) {
        __cpuid_count(7, 1, a, b, c, d);
        ci->avx512bf16 = ci->avx512f && bit(a, 5);
    }
}

/* Some hypervisors hide /proc/cpuinfo's model name; the CPUID brand string is then the best. */
static void x86_brand_read(char *dst, size_t size)
{
    unsigned regs[12];
    if ((unsigned)__get_cpuid_max(0x80000000u, NULL) < 0x80000004u)
        return;
    for (unsigned i = 0; i < 3; i++)
        __get_cpuid(0x80000002u + i, &regs[4 * i], &regs[4 * i + 1], &regs[4 * i + 2],
                    &regs[4 * i + 3]);
    char brand[49];
    memcpy(brand, regs, 48);
    brand[48] = '\0';
    const char *s = brand;
    while (*s == ' ')
        s++;
    if (*s)
        snprintf(dst, size, "%s", s);
}
#endif

/* Copies the first "model name" of /proc/cpuinfo into dst; leaves dst alone when there is none
 * (e.g. most ARM kernels). */
static void cpuinfo_model_read(char *dst, size_t size)
{
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10) != 0)
            continue;
        const char *s = strchr(line, ':');
        if (!s)
            continue;
        s++;
        while (*s == ' ' || *s == '\t')
            s++;
        size_t n = strcspn(s, "\r\n");
        while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t'))
            n--;
        if (n > 0)
            snprintf(dst, size, "%.*s", (int)n, s);
        break;
    }
    fclose(f);
}

static void description_build(const fa_cpu_info *ci, char *dst, size_t size)
{
    const struct {
        int on;
        const char *name;
    } features[] = {
        {ci->avx, "avx"},
        {ci->avx2, "avx2"},
        {ci->fma, "fma"},
        {ci->f16c, "f16c"},
        {ci->avx512f, "avx512f"},
        {ci->avx512bw, "avx512bw"},
        {ci->avx512vl, "avx512vl"},
        {ci->avx512bf16, "avx512bf16"},
        {ci->avx512fp16, "avx512fp16"},
        {ci->amx_tile, "amx_tile"},
        {ci->amx_bf16, "amx_bf16"},
        {ci->neon, "neon"},
    };
#if defined(__x86_64__)
    const char *arch = "x86_64";
#elif defined(__aarch64__)
    const char *arch = "aarch64";
#else
    const char *arch = "unknown architecture";
#endif
    size_t len = (size_t)snprintf(dst, size, "%s (%s:", ci->model, arch);
    int any = 0;
    for (size_t i = 0; i < sizeof features / sizeof features[0] && len < size; i++) {
        if (!features[i].on)
            continue;
        len += (size_t)snprintf(dst + len, size - len, " %s", features[i].name);
        any = 1;
    }
    if (len < size)
        snprintf(dst + len, size - len, "%s)", any ? "" : " no SIMD extensions detected");
}

/* The size of CPU 0's highest cache level, from sysfs ("32768K"), 0 when unknown. sysfs rather
 * than sysconf(_SC_LEVEL3_CACHE_SIZE): on an AMD EPYC VM glibc answered 320 MB, the whole
 * package's, where one core's threads share 32 MB. */
static long llc_bytes_read(void)
{
    long best = 0;
    int best_level = 0;
    for (int i = 0; i < 10; i++) {
        char path[96], text[32];
        int level = 0;
        long size = 0;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
        FILE *f = fopen(path, "r");
        if (!f)
            break;
        if (fscanf(f, "%d", &level) != 1)
            level = 0;
        fclose(f);
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        f = fopen(path, "r");
        if (!f)
            continue;
        if (fgets(text, sizeof text, f)) {
            char *end;
            size = strtol(text, &end, 10);
            size *= *end == 'K' ? 1024L : *end == 'M' ? 1024L * 1024 : 1;
        }
        fclose(f);
        if (level > best_level && size > 0)
            best = size, best_level = level;
    }
    return best;
}

static int online_cpu_count(void)
{
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    return online > 0 && online <= INT_MAX ? (int)online : 1;
}

/* CPUs this thread may run on (0 when unknown): taskset, cgroup cpusets and numactl all narrow
 * the affinity mask, and more threads than that only time-slice. */
static int affinity_cpu_count(void)
{
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0)
        return CPU_COUNT(&set);
    /* EINVAL: the kernel's mask is wider than cpu_set_t (more than CPU_SETSIZE CPUs). */
    int err = errno;
    for (int ncpu = 2 * CPU_SETSIZE; err == EINVAL && ncpu <= (1 << 20); ncpu *= 2) {
        cpu_set_t *dyn = CPU_ALLOC(ncpu);
        if (!dyn)
            break;
        size_t bytes = CPU_ALLOC_SIZE(ncpu);
        int n = sched_getaffinity(0, bytes, dyn) == 0 ? CPU_COUNT_S(bytes, dyn) : -1;
        err = errno;
        CPU_FREE(dyn);
        if (n >= 0)
            return n;
    }
#endif
    return 0;
}

static void cpu_info_detect(void)
{
    fa_cpu_info *ci = &g_info;
    snprintf(ci->model, sizeof ci->model, "unknown");
#if defined(__x86_64__)
    x86_brand_read(ci->model, sizeof ci->model);
    x86_features_detect(ci);
#elif defined(__aarch64__) || defined(__ARM_NEON)
    ci->neon = 1; /* mandatory on AArch64; on 32-bit ARM the compiler was told it is there */
#endif
    cpuinfo_model_read(ci->model, sizeof ci->model);
    ci->num_cores = online_cpu_count();
    ci->llc_bytes = llc_bytes_read();
    int allowed = affinity_cpu_count();
    g_affinity_cpus = allowed > 0 ? allowed : ci->num_cores;
    description_build(ci, g_description, sizeof g_description);
}

const fa_cpu_info *fa_cpu_info_get(void)
{
    pthread_once(&g_once, cpu_info_detect);
    return &g_info;
}

/* A separate once: choosing the kernels reads fa_cpu_info_get(), whose once must be done. */
static void report_build(void)
{
    const fa_cpu_bf16_kernel *bf16 = fa_cpu_bf16_kernel_get();
    snprintf(g_report, sizeof g_report, "%s; kernels: fp32 %s, bf16 %s", g_description,
             fa_cpu_gemm_name(), bf16 ? bf16->name : "as fp32");
}

FA_API const char *fa_cpu_description(void)
{
    pthread_once(&g_once, cpu_info_detect);
    pthread_once(&g_report_once, report_build);
    return g_report;
}

FA_API int fa_cpu_default_threads(void)
{
    /* Read on every call (it is cheap), so that a program may set it after loading us. */
    const char *env = getenv("FLASHATTN_NUM_THREADS");
    if (env && *env) {
        char *end;
        errno = 0;
        long n = strtol(env, &end, 10);
        if (errno == 0 && end != env && *end == '\0' && n > 0 && n <= INT_MAX)
            return (int)n;
    }
    /* The mask is read once (a syscall would cost ~0.5 us on every call of the API), as OpenMP
     * runtimes do; a program that re-pins itself later passes num_threads explicitly. */
    pthread_once(&g_once, cpu_info_detect);
    return g_affinity_cpus;
}
