/*
 * The in-process side of the JIT: one entry per distinct (source, defines, arch, NVRTC) key,
 * holding the cubin and the modules loaded from it. A thread that finds an entry being built by
 * another waits for it, so a kernel is compiled once per process however many threads ask.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/fa_error.h"
#include "cuda/fa_jit.h"

#define FA_JIT_MAX_FNS 16 /* (context, entry point) pairs per module */

typedef struct fa_jit_fn {
    fa_cu_context ctx;
    const char *entry;
    fa_cu_function fn;
} fa_jit_fn;

typedef struct fa_jit_entry {
    struct fa_jit_entry *next;
    char *key;
    int ready; /* 0 while a thread builds it */
    void *cubin;
    size_t size;
    int num_mods;
    fa_cu_context mod_ctx[FA_JIT_MAX_FNS];
    fa_cu_module mods[FA_JIT_MAX_FNS];
    int num_fns;
    fa_jit_fn fns[FA_JIT_MAX_FNS];
    char *perf_note; /* ptxas's performance-loss remark of this process's compile, or NULL */
} fa_jit_entry;

static pthread_mutex_t fa_jit_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fa_jit_built = PTHREAD_COND_INITIALIZER;
static fa_jit_entry *fa_jit_entries;

static double fa_jit_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* The hash of every embedded kernel file, computed once: it is in every key, and hashing
 * the sources on each call would dominate the host cost of a cached call. */
static pthread_once_t fa_jit_src_once = PTHREAD_ONCE_INIT;
static uint64_t fa_jit_src_hash;

static void fa_jit_src_hash_init(void)
{
    uint64_t h = 0x5ca1ab1e;
    for (int i = 0; i < fa_kernel_file_count; i++) {
        h = fa_jit_hash(fa_kernel_files[i].name, strlen(fa_kernel_files[i].name), h);
        h = fa_jit_hash(fa_kernel_files[i].text, strlen(fa_kernel_files[i].text), h);
    }
    fa_jit_src_hash = h;
}

/* The name the kernels include the mods' generated functions by (fa_jit_mod_text). */
static const char *const fa_jit_mod_header = "fa_mod_gen.cuh";

/* Bytes the key's mod part takes (fa_jit_key): the generated text of each, with a separator. */
static size_t fa_jit_mod_size(const fa_plan *plan)
{
    return (plan->score_mod ? strlen(plan->score_mod) + 1 : 0) +
           (plan->mask_mod ? strlen(plan->mask_mod) + 1 : 0);
}

/* Everything the cubin depends on, as text: the key of both caches. -1 when it does not fit:
 * a cut key would give two plans one cubin. The mods' generated CUDA C (each headed by its
 * program's canonical text) is part of it whole, so two programs never share a cubin. */
static int fa_jit_key(const fa_plan *plan, const fa_nvrtc *nv, char *key, size_t size)
{
    pthread_once(&fa_jit_src_once, fa_jit_src_hash_init);
    int n = snprintf(key, size, "flashattn-jit-1 %s %s nvrtc-%d.%d src-%016llx", plan->family,
                     plan->target, nv->major, nv->minor, (unsigned long long)fa_jit_src_hash);
    if (n < 0 || (size_t)n >= size)
        return -1;
    /* The defines appended without snprintf: the key is made on every call. */
    size_t at = (size_t)n;
    for (int i = 0; i < plan->num_defines; i++) {
        const size_t len = strlen(plan->defines[i]);
        if (at + 1 + len >= size)
            return -1;
        key[at++] = ' ';
        memcpy(key + at, plan->defines[i], len);
        at += len;
    }
    const char *mods[2] = {plan->score_mod, plan->mask_mod};
    for (int i = 0; i < 2; i++) {
        if (!mods[i])
            continue;
        const size_t len = strlen(mods[i]);
        if (at + 1 + len >= size)
            return -1;
        key[at++] = '\n';
        memcpy(key + at, mods[i], len);
        at += len;
    }
    key[at] = '\0';
    return 0;
}

/* The text of the generated header: the mods' functions, score_mod's first. */
static char *fa_jit_mod_text(const fa_plan *plan)
{
    const size_t n = fa_jit_mod_size(plan) + 1;
    char *t = malloc(n);
    if (t)
        snprintf(t, n, "%s%s", plan->score_mod ? plan->score_mod : "",
                 plan->mask_mod ? plan->mask_mod : "");
    return t;
}

const char *fa_jit_perf_note(const char *log, size_t *len)
{
    const char *hit = log ? strstr(log, "Potential Performance Loss") : NULL;
    if (!hit)
        return NULL;
    while (hit > log && hit[-1] != '\n')
        hit--;
    const char *end = strchr(hit, '\n');
    *len = end ? (size_t)(end - hit) : strlen(hit);
    return hit;
}

/* The program's log (the caller frees it), or NULL when there is none. */
static char *fa_jit_program_log(const fa_nvrtc *nv, fa_nvrtc_program prog)
{
    size_t size = 0;
    char *log = NULL;
    if (nv->get_program_log_size(prog, &size) != 0 || size <= 1 || !(log = malloc(size + 1)) ||
        nv->get_program_log(prog, log) != 0) {
        free(log);
        return NULL;
    }
    log[size] = '\0';
    return log;
}

/* The compiled program's log, searched for fa_jit_perf_note's remark: a copy of it in *note
 * (NULL when none), logged under FLASHATTN_LOG. */
static void fa_jit_read_note(const fa_plan *plan, const fa_nvrtc *nv, fa_nvrtc_program prog,
                             char **note)
{
    *note = NULL;
    size_t len = 0;
    char *log = fa_jit_program_log(nv, prog);
    const char *line = fa_jit_perf_note(log, &len);
    if (line && (*note = malloc(len + 1))) {
        memcpy(*note, line, len);
        (*note)[len] = '\0';
        if (fa_jit_logging())
            fprintf(stderr, "flashattn: %s (%s): %s\n", plan->family, plan->target, *note);
    }
    free(log);
}

static fa_status fa_jit_compile(const fa_plan *plan, const fa_nvrtc *nv, void **cubin,
                                size_t *size, char **note)
{
    const char *main_text = NULL;
    /* Every other embedded file is offered as a header, and the mods' text beside them. */
    enum { FA_JIT_MAX_HEADERS = 64 };
    const char *headers[FA_JIT_MAX_HEADERS], *names[FA_JIT_MAX_HEADERS];
    if (fa_kernel_file_count > FA_JIT_MAX_HEADERS)
        return fa_error_set(FA_STATUS_INTERNAL,
                            "%d kernel sources are embedded, more than the %d headers the JIT "
                            "offers NVRTC (FA_JIT_MAX_HEADERS in src/cuda/fa_jit.c)",
                            fa_kernel_file_count, FA_JIT_MAX_HEADERS);
    int num_headers = 0;
    for (int i = 0; i < fa_kernel_file_count; i++) {
        if (strcmp(fa_kernel_files[i].name, plan->family) == 0) {
            main_text = fa_kernel_files[i].text;
        } else {
            headers[num_headers] = fa_kernel_files[i].text;
            names[num_headers++] = fa_kernel_files[i].name;
        }
    }
    if (!main_text)
        return fa_error_set(FA_STATUS_INTERNAL, "kernel source %s is not embedded", plan->family);
    /* The mods' functions, as a header the kernel includes where the plan defines them. */
    char *mod_text = NULL;
    if (plan->score_mod || plan->mask_mod) {
        if (!(mod_text = fa_jit_mod_text(plan)))
            return fa_error_set(FA_STATUS_OUT_OF_MEMORY, "out of memory for a kernel's source");
        headers[num_headers] = mod_text;
        names[num_headers++] = fa_jit_mod_header;
    }

    char arch_opt[48];
    snprintf(arch_opt, sizeof arch_opt, "--gpu-architecture=%s", plan->target);
    const char *opts[FA_PLAN_MAX_DEFINES + 3];
    int num_opts = 0;
    /* The backward's modules (its main kernel and the pre-, post- and table passes) optimised
     * on threads of their own: the same SASS, sooner. The forward's and decode's kernels come
     * out scheduled differently with it, so they go without. An NVRTC without the option
     * refuses it, and the program is compiled again without. */
    const int split = strncmp(plan->family, "fa_bwd", 6) == 0;
    opts[num_opts++] = "--split-compile=0";
    opts[num_opts++] = arch_opt;
    opts[num_opts++] = "--std=c++17";
    for (int i = 0; i < plan->num_defines; i++)
        opts[num_opts++] = plan->defines[i];

    fa_nvrtc_program prog;
    fa_nvrtc_result r;
    for (int skip = !split;; skip = 1) { /* skip: leave out the split option */
        r = nv->create_program(&prog, main_text, plan->family, num_headers, headers, names);
        if (r != 0) {
            free(mod_text);
            return fa_error_set(FA_STATUS_INTERNAL, "nvrtcCreateProgram(%s): %s", plan->family,
                                nv->get_error_string(r));
        }
        r = nv->compile_program(prog, num_opts - skip, opts + skip);
        if (r != FA_NVRTC_INVALID_OPTION || skip)
            break;
        nv->destroy_program(&prog);
    }
    free(mod_text); /* NVRTC keeps its own copy */
    if (r != 0) {
        char *log = fa_jit_program_log(nv, prog);
        if (log && fa_jit_logging())
            fprintf(stderr, "flashattn: NVRTC log for %s (%s):\n%s\n", plan->family,
                    plan->target, log);
        fa_status st = fa_error_set(FA_STATUS_INTERNAL, "NVRTC could not compile %s for %s: %s: %.360s",
                                    plan->family, plan->target, nv->get_error_string(r),
                                    log ? log : "");
        free(log);
        nv->destroy_program(&prog);
        return st;
    }
    *cubin = NULL;
    if (nv->get_cubin_size(prog, size) == 0 && (*cubin = malloc(*size)) &&
        nv->get_cubin(prog, *cubin) == 0) {
        fa_jit_read_note(plan, nv, prog, note);
        nv->destroy_program(&prog);
        return FA_STATUS_OK;
    }
    free(*cubin);
    *cubin = NULL;
    nv->destroy_program(&prog);
    return fa_error_set(FA_STATUS_INTERNAL, "NVRTC produced no cubin for %s (%s)", plan->family,
                        plan->target);
}

/* fa_jit_entry_get with a buffer of key_size bytes to write plan's key into. */
static fa_status fa_jit_entry_find(const fa_plan *plan, const fa_nvrtc *nv, char *key,
                                   size_t key_size, fa_jit_entry **out, fa_jit_origin *origin)
{
    if (fa_jit_key(plan, nv, key, key_size) != 0)
        return fa_error_set(FA_STATUS_INTERNAL, "the JIT cache key of %s (%s) is too long",
                            plan->family, plan->target);

    pthread_mutex_lock(&fa_jit_lock);
    for (;;) {
        fa_jit_entry *e = fa_jit_entries, **link = &fa_jit_entries;
        while (e && strcmp(e->key, key) != 0) {
            link = &e->next;
            e = e->next;
        }
        if (!e)
            break;
        if (e->ready) {
            /* To the front: a process calls a few kernels over and over, and the keys share
             * long prefixes, so each comparison on the way costs. */
            *link = e->next;
            e->next = fa_jit_entries;
            fa_jit_entries = e;
            pthread_mutex_unlock(&fa_jit_lock);
            if (fa_jit_logging())
                fprintf(stderr, "flashattn: cache hit (memory) %s\n", key);
            *out = e;
            *origin = FA_JIT_MEMORY;
            return FA_STATUS_OK;
        }
        pthread_cond_wait(&fa_jit_built, &fa_jit_lock);
    }
    fa_jit_entry *e = calloc(1, sizeof *e);
    if (!e || !(e->key = strdup(key))) {
        free(e);
        pthread_mutex_unlock(&fa_jit_lock);
        return fa_error_set(FA_STATUS_OUT_OF_MEMORY, "out of memory for a JIT cache entry");
    }
    e->next = fa_jit_entries;
    fa_jit_entries = e;
    pthread_mutex_unlock(&fa_jit_lock);

    /* Built outside the lock: other kernels compile in parallel meanwhile. */
    fa_status st = FA_STATUS_OK;
    double t0 = fa_jit_now_ms();
    fa_jit_disk *disk = fa_jit_disk_default();
    e->cubin = fa_jit_disk_load(disk, key, &e->size);
    /* A miss: look again under the entry's lock, whose holder may have been another process
     * compiling it (or one that finished between the look and the lock). */
    double waited = 0.0;
    const int lock = e->cubin ? -1 : fa_jit_disk_lock(disk, key, &waited);
    if (lock >= 0)
        e->cubin = fa_jit_disk_load(disk, key, &e->size);
    if (e->cubin) {
        *origin = FA_JIT_DISK;
        if (fa_jit_logging())
            fprintf(stderr, "flashattn: cache hit (disk, %.1f ms%s) %s\n", fa_jit_now_ms() - t0,
                    waited > 0.0 ? ", after another process's compile" : "", key);
    } else {
        *origin = FA_JIT_COMPILED;
        st = fa_jit_compile(plan, nv, &e->cubin, &e->size, &e->perf_note);
        if (st == FA_STATUS_OK) {
            if (fa_jit_logging())
                fprintf(stderr, "flashattn: compiled in %.1f ms (%zu bytes) %s\n",
                        fa_jit_now_ms() - t0, e->size, key);
            fa_jit_disk_store(disk, key, e->cubin, e->size);
        }
    }
    fa_jit_disk_unlock(lock);

    pthread_mutex_lock(&fa_jit_lock);
    if (st == FA_STATUS_OK) {
        e->ready = 1;
    } else {
        /* Unlink the failed entry, so a later call tries again. */
        fa_jit_entry **link = &fa_jit_entries;
        while (*link != e)
            link = &(*link)->next;
        *link = e->next;
        free(e->key);
        free(e);
        e = NULL;
    }
    pthread_cond_broadcast(&fa_jit_built);
    pthread_mutex_unlock(&fa_jit_lock);
    *out = e;
    return st;
}

/* The ready entry of plan, compiling it (or reading it from disk) when this process has not. */
static fa_status fa_jit_entry_get(const fa_plan *plan, fa_jit_entry **out, fa_jit_origin *origin)
{
    const fa_nvrtc *nv = fa_nvrtc_get();
    if (!nv)
        return fa_error_set(FA_STATUS_UNSUPPORTED, "cannot compile CUDA kernels: %s",
                            fa_cuda_status());
    /* A fixed buffer for the plain kernels (their key is made on every call); the mods' text
     * needs more. */
    char key_buf[512], *key = key_buf;
    const size_t key_size = sizeof key_buf + fa_jit_mod_size(plan);
    if (key_size > sizeof key_buf && !(key = malloc(key_size)))
        return fa_error_set(FA_STATUS_OUT_OF_MEMORY, "out of memory for a JIT cache key");
    fa_status st = fa_jit_entry_find(plan, nv, key, key_size, out, origin);
    if (key != key_buf)
        free(key);
    return st;
}

fa_status fa_jit_build(const fa_plan *plan, fa_jit_origin *origin)
{
    fa_jit_entry *e;
    return fa_jit_entry_get(plan, &e, origin);
}

fa_status fa_jit_precompile(const fa_plan *plan, fa_jit_origin *origin)
{
    fa_jit_entry *e;
    FA_TRY(fa_jit_entry_get(plan, &e, origin));
    if (e->perf_note)
        return fa_error_set(FA_STATUS_INTERNAL,
                            "ptxas reports a performance loss in %s (%s), a bug of its kernel "
                            "source: %.300s",
                            plan->family, plan->target, e->perf_note);
    return FA_STATUS_OK;
}

fa_status fa_jit_function(const fa_plan *plan, fa_cu_context ctx, const char *entry,
                          fa_cu_function *fn)
{
    fa_jit_entry *e;
    fa_jit_origin origin;
    fa_status st = fa_jit_entry_get(plan, &e, &origin);
    if (st != FA_STATUS_OK)
        return st;
    const fa_cuda_driver *d = fa_cuda_driver_get();
    if (!d)
        return fa_error_set(FA_STATUS_UNSUPPORTED, "no CUDA driver: %s", fa_cuda_status());

    /* Module loads are rare and cheap next to a compile: one lock covers the lookups and them. */
    pthread_mutex_lock(&fa_jit_lock);
    for (int i = 0; i < e->num_fns; i++)
        if (e->fns[i].ctx == ctx && strcmp(e->fns[i].entry, entry) == 0) {
            *fn = e->fns[i].fn;
            pthread_mutex_unlock(&fa_jit_lock);
            return FA_STATUS_OK;
        }
    fa_cu_result r = 0;
    fa_cu_module mod = NULL;
    for (int i = 0; i < e->num_mods; i++)
        if (e->mod_ctx[i] == ctx)
            mod = e->mods[i];
    if (!mod && e->num_mods == FA_JIT_MAX_FNS)
        st = fa_error_set(FA_STATUS_UNSUPPORTED, "kernel loaded in too many CUDA contexts");
    if (st == FA_STATUS_OK && !mod) {
        r = d->module_load_data(&mod, e->cubin);
        if (r == 0) {
            e->mod_ctx[e->num_mods] = ctx;
            e->mods[e->num_mods++] = mod;
        } else {
            st = fa_cuda_error(r, "cuModuleLoadData (the JIT-compiled kernel)");
        }
    }
    if (st == FA_STATUS_OK && e->num_fns == FA_JIT_MAX_FNS)
        st = fa_error_set(FA_STATUS_UNSUPPORTED, "too many kernels loaded from one module");
    if (st == FA_STATUS_OK) {
        r = d->module_get_function(fn, mod, entry);
        if (r == 0 && plan->smem > 48 * 1024)
            r = d->func_set_attribute(*fn, FA_CU_FUNC_ATTR_MAX_DYNAMIC_SMEM, (int)plan->smem);
        if (r == 0 && plan->cluster_max > 8)
            r = d->func_set_attribute(*fn, FA_CU_FUNC_ATTR_NON_PORTABLE_CLUSTER, 1);
        if (r == 0)
            e->fns[e->num_fns++] = (fa_jit_fn){ctx, entry, *fn};
        else
            st = fa_cuda_error(r, "loading a kernel from the JIT-compiled module");
    }
    pthread_mutex_unlock(&fa_jit_lock);
    return st;
}
