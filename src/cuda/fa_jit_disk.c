/*
 * The disk cache of compiled kernels: one file per key under $FLASHATTN_CACHE_DIR (default
 * $XDG_CACHE_HOME/flashattn, else ~/.cache/flashattn; an empty FLASHATTN_CACHE_DIR turns it off).
 *
 * File: header | key | cubin. Written to a unique temporary file and renamed into place, so a
 * reader in any process sees a whole file or none; concurrent writers of one key write the same
 * bytes. A file whose header, length, key or checksum disagrees is a miss, and the fresh compile
 * replaces it. The directory is created 0700: cached code is executed, so it is private.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda/fa_jit_disk.h"

#define FA_JIT_MAGIC "FACUBIN1"

typedef struct fa_jit_header {
    char magic[8];
    uint64_t key_size;
    uint64_t cubin_size;
    uint64_t checksum; /* of key and cubin */
} fa_jit_header;

static pthread_once_t fa_dir_once = PTHREAD_ONCE_INIT;
static char fa_dir[1024];

uint64_t fa_jit_hash(const void *data, size_t size, uint64_t seed)
{
    /* FNV-1a, then a murmur-style finaliser so nearby keys spread over all 64 bits. */
    const unsigned char *p = data;
    uint64_t h = 0xcbf29ce484222325ull ^ seed;
    for (size_t i = 0; i < size; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

static void fa_dir_init(void)
{
    const char *env = getenv("FLASHATTN_CACHE_DIR");
    const char *xdg = getenv("XDG_CACHE_HOME");
    const char *home = getenv("HOME");
    if (env)
        snprintf(fa_dir, sizeof fa_dir, "%s", env);
    else if (xdg && *xdg)
        snprintf(fa_dir, sizeof fa_dir, "%s/flashattn", xdg);
    else if (home && *home)
        snprintf(fa_dir, sizeof fa_dir, "%s/.cache/flashattn", home);
}

const char *fa_jit_disk_dir(void)
{
    pthread_once(&fa_dir_once, fa_dir_init);
    return fa_dir;
}

static void fa_jit_path(const char *key, char *path, size_t size)
{
    size_t n = strlen(key);
    snprintf(path, size, "%s/%016llx%016llx.cubin", fa_jit_disk_dir(),
             (unsigned long long)fa_jit_hash(key, n, 0),
             (unsigned long long)fa_jit_hash(key, n, 0x9e3779b97f4a7c15ull));
}

static uint64_t fa_jit_checksum(const char *key, const void *cubin, size_t size)
{
    return fa_jit_hash(cubin, size, fa_jit_hash(key, strlen(key), 1));
}

void *fa_jit_disk_load(const char *key, size_t *size)
{
    if (!*fa_jit_disk_dir())
        return NULL;
    char path[1200];
    fa_jit_path(key, path, sizeof path);
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fa_jit_header h;
    size_t key_size = strlen(key);
    char *file_key = NULL;
    void *cubin = NULL;
    int ok = fread(&h, sizeof h, 1, f) == 1 && memcmp(h.magic, FA_JIT_MAGIC, 8) == 0 &&
             h.key_size == key_size && h.cubin_size > 0 && h.cubin_size < ((uint64_t)1 << 30);
    if (ok) {
        file_key = malloc(key_size);
        cubin = malloc(h.cubin_size);
        ok = file_key && cubin && fread(file_key, 1, key_size, f) == key_size &&
             memcmp(file_key, key, key_size) == 0 &&
             fread(cubin, 1, h.cubin_size, f) == h.cubin_size && fgetc(f) == EOF &&
             fa_jit_checksum(key, cubin, h.cubin_size) == h.checksum;
    }
    fclose(f);
    free(file_key);
    if (!ok) {
        if (fa_jit_logging())
            fprintf(stderr, "flashattn: cache entry %s is damaged or stale; rebuilding it\n", path);
        free(cubin);
        return NULL;
    }
    *size = h.cubin_size;
    return cubin;
}

/* mkdir -p with mode 0700 for the directories it creates. */
static int fa_jit_mkdirs(const char *dir)
{
    char tmp[1024];
    snprintf(tmp, sizeof tmp, "%s", dir);
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(tmp, 0700) != 0 && errno != EEXIST)
            return -1;
        *p = '/';
    }
    return mkdir(tmp, 0700) == 0 || errno == EEXIST ? 0 : -1;
}

static int fa_jit_write_all(int fd, const void *data, size_t size)
{
    const char *p = data;
    while (size > 0) {
        ssize_t n = write(fd, p, size);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        size -= (size_t)n;
    }
    return 0;
}

void fa_jit_disk_store(const char *key, const void *cubin, size_t size)
{
    const char *dir = fa_jit_disk_dir();
    if (!*dir)
        return;
    char path[1200], tmp[1300];
    fa_jit_path(key, path, sizeof path);
    static pthread_mutex_t counter_lock = PTHREAD_MUTEX_INITIALIZER;
    static unsigned counter;
    pthread_mutex_lock(&counter_lock);
    unsigned n = counter++;
    pthread_mutex_unlock(&counter_lock);
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld.%u", path, (long)getpid(), n);

    fa_jit_header h;
    memcpy(h.magic, FA_JIT_MAGIC, 8);
    h.key_size = strlen(key);
    h.cubin_size = size;
    h.checksum = fa_jit_checksum(key, cubin, size);
    int fd = -1;
    int ok = fa_jit_mkdirs(dir) == 0 &&
             (fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600)) >= 0 &&
             fa_jit_write_all(fd, &h, sizeof h) == 0 &&
             fa_jit_write_all(fd, key, h.key_size) == 0 &&
             fa_jit_write_all(fd, cubin, size) == 0;
    if (fd >= 0 && close(fd) != 0)
        ok = 0;
    if (ok && rename(tmp, path) != 0)
        ok = 0;
    if (!ok) {
        /* The cache is an optimisation: a read-only or full disk costs a recompile, not a call. */
        if (fa_jit_logging())
            fprintf(stderr, "flashattn: could not write cache entry %s: %s\n", path,
                    strerror(errno));
        if (fd >= 0)
            unlink(tmp);
    }
}
