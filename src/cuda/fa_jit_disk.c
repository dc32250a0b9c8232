/*
 * The disk cache of compiled kernels: one file per key under $FLASHATTN_CACHE_DIR (default
 * $XDG_CACHE_HOME/flashattn, else ~/.cache/flashattn; an empty FLASHATTN_CACHE_DIR turns it off).
 * Cached code runs on the GPU, so the cache trusts nothing it did not write:
 *   - the directory is opened once, component by component (any path length), its last component
 *     without following a symbolic link, and used only when it is owned by this user and not
 *     writable by group or others; every later access goes through that descriptor, so a relative
 *     path is resolved once, against the working directory of the first use. Directories it
 *     creates are 0700;
 *   - entries are opened O_NOFOLLOW | O_NONBLOCK and read only when they are regular files of this
 *     user (a symbolic link, FIFO or device is a miss, never followed or blocked on);
 *   - each entry carries a SipHash-2-4 tag, keyed by a random secret kept 0600 in the directory,
 *     over its header, key and cubin: a file made without the secret is a miss, and rebuilt. A
 *     missing or damaged secret is made anew, which turns every older entry into a miss.
 * File: header | key | cubin, written to a unique temporary file (O_EXCL, 0600), synced and renamed
 * into place, so a reader in any process sees a whole file or none; concurrent writers of one key
 * write the same bytes. An empty <entry>.lock beside each entry is its compile lock (flock).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cuda/fa_jit_disk.h"

#define FA_JIT_MAGIC "FACUBIN2"
#define FA_JIT_SECRET_FILE "secret"
#define FA_JIT_MAX_CUBIN ((uint64_t)1 << 30)
/* The longest wait for another process's compile of a kernel, and the poll's step. */
#define FA_JIT_LOCK_WAIT_MS 60000.0
#define FA_JIT_LOCK_POLL_NS 2000000L

#ifdef O_PATH
#define FA_JIT_DIR_FLAGS (O_PATH | O_DIRECTORY | O_CLOEXEC) /* needs search, not read, rights */
#else
#define FA_JIT_DIR_FLAGS (O_RDONLY | O_DIRECTORY | O_CLOEXEC)
#endif

struct fa_jit_disk {
    int dir_fd;
    unsigned char secret[FA_JIT_SECRET_SIZE];
    char *path; /* for messages: absolute when the given path was relative */
};

/* ---- files this user made --------------------------------------------------------------- */

/* Why a directory is not trusted with executable code, or NULL when it is. */
static const char *fa_jit_dir_distrust(const struct stat *st, char *buf, size_t size)
{
    if (S_ISLNK(st->st_mode))
        return "it is a symbolic link";
    if (!S_ISDIR(st->st_mode))
        return "it is not a directory";
    if (st->st_uid != geteuid()) {
        snprintf(buf, size, "it is owned by uid %ld, not by this user (uid %ld)",
                 (long)st->st_uid, (long)geteuid());
        return buf;
    }
    if (st->st_mode & (S_IWGRP | S_IWOTH)) {
        snprintf(buf, size, "it is writable by its group or others (mode %04o)",
                 (unsigned)(st->st_mode & 07777));
        return buf;
    }
    return NULL;
}

/* Opens name in dir for reading when it is a regular file of this user, never following a link
 * or waiting on a FIFO; else -1 with errno ENOENT when absent, EPERM when present but not
 * trusted, another when it could not be opened (no descriptor left, say). */
static int fa_jit_open_owned(int dir_fd, const char *name, struct stat *st)
{
    int fd = openat(dir_fd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        if (errno == ELOOP || errno == ENXIO) /* a link; a socket or absent device */
            errno = EPERM;
        return -1;
    }
    if (fstat(fd, st) != 0 || !S_ISREG(st->st_mode) || st->st_uid != geteuid()) {
        close(fd);
        errno = EPERM;
        return -1;
    }
    return fd;
}

static int fa_jit_read_all(int fd, void *data, size_t size)
{
    char *p = data;
    while (size > 0) {
        ssize_t n = read(fd, p, size);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        size -= (size_t)n;
    }
    char extra;
    return read(fd, &extra, 1) == 0 ? 0 : -1; /* the file is no longer than it said */
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

static int fa_jit_random(void *buf, size_t size)
{
    char *p = buf;
    while (size > 0) {
        ssize_t n = getrandom(p, size, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        p += n;
        size -= (size_t)n;
    }
    if (size == 0)
        return 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, p, size);
    close(fd);
    return n == (ssize_t)size ? 0 : -1;
}

/* Writes a new file in dir under a fresh temporary name (0600, never an existing file or a link),
 * synced: the caller renames or links it into place. Returns 0 and the name in tmp. */
static int fa_jit_write_temp(int dir_fd, const char *base, const void *const *parts,
                             const size_t *sizes, int num_parts, char *tmp, size_t tmp_size)
{
    static pthread_mutex_t counter_lock = PTHREAD_MUTEX_INITIALIZER;
    static unsigned counter;
    pthread_mutex_lock(&counter_lock);
    unsigned n = counter++;
    pthread_mutex_unlock(&counter_lock);
    uint64_t nonce = 0;
    fa_jit_random(&nonce, sizeof nonce); /* pids repeat across containers sharing a directory */
    snprintf(tmp, tmp_size, "%s.tmp.%ld.%u.%016llx", base, (long)getpid(), n,
             (unsigned long long)nonce);
    int fd = openat(dir_fd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return -1;
    int ok = 1;
    for (int i = 0; i < num_parts && ok; i++)
        ok = fa_jit_write_all(fd, parts[i], sizes[i]) == 0;
    ok = ok && fsync(fd) == 0;
    ok = close(fd) == 0 && ok;
    if (!ok) {
        int e = errno;
        unlinkat(dir_fd, tmp, 0);
        errno = e;
        return -1;
    }
    return 0;
}

/* ---- the secret ------------------------------------------------------------------------- */

/* 0: read; ENOENT: absent; EPERM: present but not a 0600 regular file of this user holding a
 * secret; other errno: could not read. */
static int fa_jit_secret_read(int dir_fd, unsigned char *secret)
{
    struct stat st;
    int fd = fa_jit_open_owned(dir_fd, FA_JIT_SECRET_FILE, &st);
    if (fd < 0)
        return errno;
    int r = 0;
    if ((st.st_mode & 077) != 0 || st.st_size != FA_JIT_SECRET_SIZE ||
        fa_jit_read_all(fd, secret, FA_JIT_SECRET_SIZE) != 0)
        r = EPERM;
    close(fd);
    return r;
}

/* The directory's secret, made when absent or damaged. A new one is linked into place, never
 * over one another process has just made, so processes starting together agree on it (two that
 * replace a damaged one at once may not: that costs misses, not trust). */
static int fa_jit_secret_get(int dir_fd, unsigned char *secret, char *why, size_t why_size)
{
    for (int attempt = 0; attempt < 4; attempt++) {
        int r = fa_jit_secret_read(dir_fd, secret);
        if (r == 0)
            return 0;
        if (r == EPERM) {
            if (fa_jit_logging())
                fprintf(stderr, "flashattn: the kernel cache's secret is damaged; making a new "
                                "one (older entries will be rebuilt)\n");
            if (unlinkat(dir_fd, FA_JIT_SECRET_FILE, 0) != 0 && errno != ENOENT)
                break;
            continue;
        }
        if (r != ENOENT) {
            errno = r;
            break;
        }
        unsigned char fresh[FA_JIT_SECRET_SIZE];
        char tmp[128];
        const void *parts[1] = {fresh};
        const size_t sizes[1] = {sizeof fresh};
        if (fa_jit_random(fresh, sizeof fresh) != 0 ||
            fa_jit_write_temp(dir_fd, FA_JIT_SECRET_FILE, parts, sizes, 1, tmp, sizeof tmp) != 0)
            break;
        int linked = linkat(dir_fd, tmp, dir_fd, FA_JIT_SECRET_FILE, 0);
        if (linked != 0 && errno != EEXIST) /* a file system without hard links */
            linked = renameat(dir_fd, tmp, dir_fd, FA_JIT_SECRET_FILE);
        unlinkat(dir_fd, tmp, 0);
        if (linked == 0) {
            memcpy(secret, fresh, sizeof fresh);
            return 0;
        }
        if (errno != EEXIST)
            break;
    }
    snprintf(why, why_size, "cannot read or make its secret file: %s", strerror(errno));
    return -1;
}

/* ---- the directory ---------------------------------------------------------------------- */

/* Opens path one component at a time from / or the working directory, creating missing ones
 * (0700), the last without following a link. Returns the descriptor, or -1 with why set and
 * *untrusted 1 when the directory exists but is not this user's private one. */
static int fa_jit_dir_walk(const char *path, int *untrusted, char *why, size_t why_size)
{
    const char *start = path[0] == '/' ? "/" : ".";
    int fd = open(start, FA_JIT_DIR_FLAGS);
    if (fd < 0) {
        snprintf(why, why_size, "cannot open %s: %s", start, strerror(errno));
        return -1;
    }
    const char *p = path;
    char name[NAME_MAX + 1];
    for (;;) {
        while (*p == '/')
            p++;
        if (!*p)
            break;
        size_t len = strcspn(p, "/");
        int last = p[len + strspn(p + len, "/")] == '\0';
        if (len > NAME_MAX) {
            snprintf(why, why_size, "a path component is longer than %d bytes", NAME_MAX);
            close(fd);
            return -1;
        }
        memcpy(name, p, len);
        name[len] = '\0';
        int flags = FA_JIT_DIR_FLAGS | (last ? O_NOFOLLOW : 0);
        int next = openat(fd, name, flags);
        if (next < 0 && errno == ENOENT && (mkdirat(fd, name, 0700) == 0 || errno == EEXIST))
            next = openat(fd, name, flags);
        const int open_errno = errno;
        struct stat st;
        if (next < 0 && last && fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
            S_ISLNK(st.st_mode)) {
            *untrusted = 1;
            snprintf(why, why_size, "it is a symbolic link");
        } else if (next < 0) {
            snprintf(why, why_size, "cannot open or create %s: %s", name, strerror(open_errno));
        }
        close(fd);
        if (next < 0)
            return -1;
        fd = next;
        p += len;
    }
    struct stat st;
    const char *distrust = NULL;
    if (fstat(fd, &st) != 0) {
        snprintf(why, why_size, "cannot inspect it: %s", strerror(errno));
    } else if ((distrust = fa_jit_dir_distrust(&st, why, why_size))) {
        *untrusted = 1;
        if (distrust != why)
            snprintf(why, why_size, "%s", distrust);
    } else {
        return fd;
    }
    close(fd);
    return -1;
}

fa_jit_disk *fa_jit_disk_open(const char *dir, int *untrusted, char *why, size_t why_size)
{
    *untrusted = 0;
    fa_jit_disk *d = calloc(1, sizeof *d);
    char *cwd = dir[0] == '/' ? NULL : getcwd(NULL, 0);
    size_t n = (cwd ? strlen(cwd) + 1 : 0) + strlen(dir) + 1;
    if (!d || !(d->path = malloc(n))) {
        snprintf(why, why_size, "out of memory");
        free(cwd);
        free(d);
        return NULL;
    }
    snprintf(d->path, n, "%s%s%s", cwd ? cwd : "", cwd ? "/" : "", dir);
    free(cwd);
    d->dir_fd = fa_jit_dir_walk(dir, untrusted, why, why_size);
    if (d->dir_fd < 0 || fa_jit_secret_get(d->dir_fd, d->secret, why, why_size) != 0) {
        fa_jit_disk_close(d);
        return NULL;
    }
    return d;
}

void fa_jit_disk_close(fa_jit_disk *disk)
{
    if (!disk)
        return;
    if (disk->dir_fd >= 0)
        close(disk->dir_fd);
    memset(disk->secret, 0, sizeof disk->secret);
    free(disk->path);
    free(disk);
}

const char *fa_jit_disk_path(const fa_jit_disk *disk)
{
    return disk->path;
}

static pthread_once_t fa_jit_default_once = PTHREAD_ONCE_INIT;
static fa_jit_disk *fa_jit_default;

/* The directory from the environment; NULL when caching on disk is off. XDG paths must be
 * absolute (the XDG spec: a relative one is ignored); FLASHATTN_CACHE_DIR may be relative. */
static char *fa_jit_default_path(void)
{
    const char *env = getenv("FLASHATTN_CACHE_DIR");
    const char *xdg = getenv("XDG_CACHE_HOME");
    const char *home = getenv("HOME");
    const char *base = NULL, *tail = "";
    if (env)
        base = *env ? env : NULL;
    else if (xdg && xdg[0] == '/')
        base = xdg, tail = "/flashattn";
    else if (home && home[0] == '/')
        base = home, tail = "/.cache/flashattn";
    if (!base)
        return NULL;
    size_t n = strlen(base) + strlen(tail) + 1;
    char *path = malloc(n);
    if (path)
        snprintf(path, n, "%s%s", base, tail);
    return path;
}

static void fa_jit_default_init(void)
{
    char *path = fa_jit_default_path();
    if (!path)
        return;
    char why[256];
    int untrusted;
    fa_jit_default = fa_jit_disk_open(path, &untrusted, why, sizeof why);
    /* A directory someone else could write is worth saying even unasked: it is either an attack
     * or a misconfiguration that turns every kernel into a compile. */
    if (!fa_jit_default && (untrusted || fa_jit_logging()))
        fprintf(stderr,
                "flashattn: not using the kernel cache directory %s: %s; kernels are cached in "
                "memory only\n",
                path, why);
    free(path);
}

fa_jit_disk *fa_jit_disk_default(void)
{
    pthread_once(&fa_jit_default_once, fa_jit_default_init);
    return fa_jit_default;
}

/* ---- entries ---------------------------------------------------------------------------- */

void fa_jit_disk_entry_name(const char *key, char *name, size_t size)
{
    size_t n = strlen(key);
    snprintf(name, size, "%016llx%016llx.cubin", (unsigned long long)fa_jit_hash(key, n, 0),
             (unsigned long long)fa_jit_hash(key, n, 0x9e3779b97f4a7c15ull));
}

/* The tag of an entry: the header up to the tag, the key and the cubin. */
static uint64_t fa_jit_tag(const fa_jit_disk *d, const fa_jit_header *h, const char *key,
                           const void *cubin)
{
    fa_jit_mac m;
    fa_jit_mac_init(&m, d->secret);
    fa_jit_mac_update(&m, h, offsetof(fa_jit_header, tag));
    fa_jit_mac_update(&m, key, (size_t)h->key_size);
    fa_jit_mac_update(&m, cubin, (size_t)h->cubin_size);
    return fa_jit_mac_final(&m);
}

void *fa_jit_disk_load(fa_jit_disk *disk, const char *key, size_t *size)
{
    if (!disk)
        return NULL;
    char name[64];
    fa_jit_disk_entry_name(key, name, sizeof name);
    struct stat st;
    int fd = fa_jit_open_owned(disk->dir_fd, name, &st);
    if (fd < 0) {
        if (errno != ENOENT && fa_jit_logging())
            fprintf(stderr, "flashattn: cache entry %s/%s ignored: %s\n", disk->path, name,
                    errno == EPERM ? "not a regular file of this user" : strerror(errno));
        return NULL;
    }
    const uint64_t key_size = strlen(key), head = sizeof(fa_jit_header) + key_size;
    const uint64_t file_size = (uint64_t)st.st_size;
    char *buf = NULL;
    fa_jit_header h;
    int ok = file_size > head && file_size - head <= FA_JIT_MAX_CUBIN &&
             (buf = malloc((size_t)file_size)) && fa_jit_read_all(fd, buf, (size_t)file_size) == 0;
    if (ok) {
        memcpy(&h, buf, sizeof h);
        ok = memcmp(h.magic, FA_JIT_MAGIC, 8) == 0 && h.key_size == key_size &&
             h.cubin_size == file_size - head && memcmp(buf + sizeof h, key, key_size) == 0 &&
             fa_jit_tag(disk, &h, key, buf + head) == h.tag;
    }
    close(fd);
    if (!ok) {
        if (fa_jit_logging())
            fprintf(stderr, "flashattn: cache entry %s/%s is damaged, stale or not ours; "
                            "rebuilding it\n", disk->path, name);
        free(buf);
        return NULL;
    }
    memmove(buf, buf + head, (size_t)h.cubin_size);
    *size = (size_t)h.cubin_size;
    return buf;
}

int fa_jit_disk_store(fa_jit_disk *disk, const char *key, const void *cubin, size_t size)
{
    if (!disk)
        return -1;
    char name[64], tmp[128];
    fa_jit_disk_entry_name(key, name, sizeof name);
    fa_jit_header h;
    memcpy(h.magic, FA_JIT_MAGIC, 8);
    h.key_size = strlen(key);
    h.cubin_size = size;
    h.tag = fa_jit_tag(disk, &h, key, cubin);
    const void *parts[3] = {&h, key, cubin};
    const size_t sizes[3] = {sizeof h, (size_t)h.key_size, size};
    int ok = size > 0 && size <= FA_JIT_MAX_CUBIN &&
             fa_jit_write_temp(disk->dir_fd, name, parts, sizes, 3, tmp, sizeof tmp) == 0;
    if (ok && renameat(disk->dir_fd, tmp, disk->dir_fd, name) != 0) {
        int e = errno;
        unlinkat(disk->dir_fd, tmp, 0);
        errno = e;
        ok = 0;
    }
    /* The cache is an optimisation: a read-only or full disk costs a recompile, not a call. */
    if (!ok && fa_jit_logging())
        fprintf(stderr, "flashattn: could not write cache entry %s/%s: %s\n", disk->path, name,
                strerror(errno));
    return ok ? 0 : -1;
}

/* ---- the compile lock ------------------------------------------------------------------- */

static double fa_jit_ms_since(const struct timespec *t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0->tv_sec) * 1e3 + (double)(t.tv_nsec - t0->tv_nsec) * 1e-6;
}

int fa_jit_disk_lock(fa_jit_disk *disk, const char *key, double *waited_ms)
{
    *waited_ms = 0.0;
    if (!disk)
        return -1;
    char name[64];
    fa_jit_disk_entry_name(key, name, sizeof name);
    char *ext = strrchr(name, '.');
    if (!ext || (size_t)(ext - name) + sizeof ".lock" > sizeof name)
        return -1;
    memcpy(ext, ".lock", sizeof ".lock");
    /* Only this user can make files in the directory (fa_jit_disk_open), so the name is ours. */
    const int fd = openat(disk->dir_fd, name, O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK |
                                                  O_CLOEXEC, 0600);
    if (fd < 0)
        return -1;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    /* Polled rather than blocking, so that a holder that never lets go costs a bounded wait. */
    for (;;) {
        if (flock(fd, LOCK_EX | LOCK_NB) == 0)
            return fd;
        if (errno != EWOULDBLOCK && errno != EINTR)
            break;
        *waited_ms = fa_jit_ms_since(&t0);
        if (*waited_ms > FA_JIT_LOCK_WAIT_MS)
            break;
        const struct timespec step = {0, FA_JIT_LOCK_POLL_NS};
        nanosleep(&step, NULL);
    }
    if (fa_jit_logging())
        fprintf(stderr, "flashattn: compiling without the lock %s/%s (%s)\n", disk->path, name,
                *waited_ms > FA_JIT_LOCK_WAIT_MS ? "held too long" : strerror(errno));
    close(fd);
    return -1;
}

void fa_jit_disk_unlock(int lock)
{
    if (lock < 0)
        return;
    flock(lock, LOCK_UN);
    close(lock);
}
