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
static char g_report[384]; /* g_description, the kernels picked from it, the L2 share */
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

/* One line of a sysfs cache file of CPU 0 (index i, e.g. "size"), NULL when absent. */
static char *cache_file_read(int i, const char *name, char *text, int size)
{
    char path[96];
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/%s", i, name);
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    char *line = fgets(text, size, f);
    fclose(f);
    return line;
}

/* CPUs in a sysfs list such as "0-3,8-11" or "0,16". */
static int cpu_list_count(const char *list)
{
    int n = 0;
    for (const char *at = list; *at >= '0' && *at <= '9';) {
        char *end;
        long lo = strtol(at, &end, 10), hi = lo;
        if (*end == '-')
            hi = strtol(end + 1, &end, 10);
        n += hi >= lo ? (int)(hi - lo + 1) : 1;
        at = *end == ',' ? end + 1 : end;
    }
    return n;
}

/*
 * From sysfs: the size of CPU 0's highest cache level ("32768K"), and its level-2 cache divided
 * by the CPUs that share it (SMT siblings, or a cluster), 0 when unknown. sysfs rather than
 * sysconf(_SC_LEVEL3_CACHE_SIZE): on an AMD EPYC VM glibc answered 320 MB, the whole package's,
 * where one core's threads share 32 MB.
 */
static void cache_sizes_read(fa_cpu_info *ci)
{
    int best_level = 0;
    for (int i = 0; i < 10; i++) {
        char text[256];
        int level = 0;
        long size = 0;
        if (!cache_file_read(i, "level", text, sizeof text))
            break;
        level = atoi(text);
        if (cache_file_read(i, "type", text, sizeof text) && strncmp(text, "Instruction", 11) == 0)
            continue;
        if (cache_file_read(i, "size", text, sizeof text)) {
            char *end;
            size = strtol(text, &end, 10);
            size *= *end == 'K' ? 1024L : *end == 'M' ? 1024L * 1024 : 1;
        }
        if (size <= 0)
            continue;
        if (level > best_level)
            ci->llc_bytes = size, best_level = level;
        if (level == 2) {
            int sharers = 1;
            if (cache_file_read(i, "shared_cpu_list", text, sizeof text))
                sharers = cpu_list_count(text);
            ci->l2_share_bytes = size / (sharers > 0 ? sharers : 1);
        }
    }
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
    cache_sizes_read(ci);
    int allowed = affinity_cpu_count();
    g_affinity_cpus = allowed > 0 ? allowed : ci->num_cores;
    description_build(ci, g_description, sizeof g_description);
}

const fa_cpu_info *fa_cpu_info_get(void)
{
    pthread_once(&g_once, cpu_info_detect);
    return &g_info;
}

/* The tiles' constants were tuned where each thread has a 2 MB L2 of its own; that is the
 * share assumed when sysfs does not say. */
#define FA_CPU_L2_SHARE_DEFAULT (2L << 20)
static long g_l2_share_override;

long fa_cpu_l2_share(void)
{
    if (g_l2_share_override > 0)
        return g_l2_share_override;
    const long share = fa_cpu_info_get()->l2_share_bytes;
    return share > 0 ? share : FA_CPU_L2_SHARE_DEFAULT;
}

void fa_cpu_set_l2_share(size_t bytes)
{
    g_l2_share_override = bytes > (size_t)LONG_MAX ? LONG_MAX : (long)bytes;
}

/* A separate once: choosing the kernels reads fa_cpu_info_get(), whose once must be done. */
static void report_build(void)
{
    const fa_cpu_bf16_kernel *bf16 = fa_cpu_bf16_kernel_get();
    const long l2 = fa_cpu_info_get()->l2_share_bytes;
    char cache[48];
    if (l2 > 0)
        snprintf(cache, sizeof cache, "L2 %ld KB a thread", l2 >> 10);
    else
        snprintf(cache, sizeof cache, "L2 unknown (tiles sized for %ld KB)",
                 FA_CPU_L2_SHARE_DEFAULT >> 10);
    snprintf(g_report, sizeof g_report, "%s; kernels: fp32 %s, bf16 %s; %s", g_description,
             fa_cpu_gemm_name(), bf16 ? bf16->name : "as fp32", cache);
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
