/*
 * The JIT's disk cache (src/cuda/fa_jit_disk.c) against someone who can write where it looks,
 * through its store/load of a blob under a key (no GPU or NVRTC needed):
 *   - SipHash-2-4 matches the reference vectors, fed whole or in pieces;
 *   - a store then a load round-trips, also in a later open; the directories it makes are 0700
 *     and its secret 0600;
 *   - a damaged, truncated or misplaced entry is a miss, and a store rebuilds it;
 *   - a forged entry (cubin changed, tag recomputed without the secret) is a miss;
 *   - a symbolic link in place of an entry is a miss, its target is never written;
 *   - a symbolically linked cache directory is refused;
 *   - a FIFO in place of an entry (or the secret) is a miss that returns at once;
 *   - a directory writable by group or others, or owned by another user, is refused, as are
 *     entries and secrets of another user;
 *   - a path longer than PATH_MAX works and is not truncated; an over-long component is refused;
 *   - a relative FLASHATTN_CACHE_DIR is resolved once; a refused directory is said once;
 *   - processes and threads writing one key at once never expose a partial or foreign entry.
 */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda/fa_jit.h"
#include "test_util.h"

#define BLOB_MAX 6000

static char base[256]; /* this run's scratch directory */
static tu_rng rng;

typedef struct blob {
    unsigned char data[BLOB_MAX];
    size_t size;
} blob;

static blob random_blob(void)
{
    blob b;
    b.size = (size_t)tu_rng_int(&rng, 1, BLOB_MAX);
    for (size_t i = 0; i < b.size; i++)
        b.data[i] = (unsigned char)tu_rng_u64(&rng);
    return b;
}

static void random_key(char *key, size_t size, const char *what)
{
    snprintf(key, size, "flashattn-jit-test %s %016llx -DFA_BN=64", what,
             (unsigned long long)tu_rng_u64(&rng));
}

static void path_of(char *out, size_t size, const char *dir, const char *name)
{
    int n = snprintf(out, size, "%s/%s", dir, name);
    TU_CHECK(n > 0 && (size_t)n < size, "the path %s/%s is too long for the test", dir, name);
}

static void entry_path(char *out, size_t size, const char *dir, const char *key)
{
    char name[64];
    fa_jit_disk_entry_name(key, name, sizeof name);
    path_of(out, size, dir, name);
}

static fa_jit_disk *open_ok(const char *dir)
{
    int untrusted = -1;
    char why[256] = "";
    fa_jit_disk *d = fa_jit_disk_open(dir, &untrusted, why, sizeof why);
    TU_CHECK(d != NULL, "%s refused: %s", dir, why);
    return d;
}

static void expect_refused(const char *dir, const char *reason)
{
    int untrusted = -1;
    char why[256] = "";
    fa_jit_disk *d = fa_jit_disk_open(dir, &untrusted, why, sizeof why);
    TU_CHECK(d == NULL && untrusted == 1 && strstr(why, reason),
             "%s: expected a refusal saying '%s', got %s (untrusted %d, '%s')", dir, reason,
             d ? "an open cache" : "a refusal", untrusted, why);
    fa_jit_disk_close(d);
}

/* Whether load gives exactly b. */
static int loads(fa_jit_disk *d, const char *key, const blob *b)
{
    size_t size = 0;
    void *got = fa_jit_disk_load(d, key, &size);
    int same = got && size == b->size && memcmp(got, b->data, size) == 0;
    free(got);
    return same;
}

static int misses(fa_jit_disk *d, const char *key)
{
    size_t size = 0;
    void *got = fa_jit_disk_load(d, key, &size);
    free(got);
    return got == NULL;
}

static unsigned char *read_file(const char *path, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    unsigned char *buf = malloc((1 << 16) + 1);
    *size = buf ? fread(buf, 1, 1 << 16, f) : 0;
    if (buf)
        buf[*size] = '\0'; /* text files read as strings */
    fclose(f);
    return buf;
}

/* Replaces path with data the way a writer of the directory would: a new file renamed over it. */
static void plant_file(const char *path, const void *data, size_t size)
{
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s.planted", path);
    FILE *f = fopen(tmp, "wb");
    TU_CHECK(f && fwrite(data, 1, size, f) == size && fclose(f) == 0 && rename(tmp, path) == 0,
             "cannot plant %s: %s", path, strerror(errno));
}

/* Removes name in dir_fd and everything under it, through descriptors (any depth and length). */
static void remove_tree(int dir_fd, const char *name)
{
    if (unlinkat(dir_fd, name, 0) == 0 || errno == ENOENT)
        return;
    int fd = openat(dir_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
    if (!dir) {
        if (fd >= 0)
            close(fd);
        return;
    }
    for (struct dirent *e; (e = readdir(dir));)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
            remove_tree(fd, e->d_name);
    closedir(dir);
    unlinkat(dir_fd, name, AT_REMOVEDIR);
}

static void test_mac(void)
{
    tu_where = "SipHash-2-4";
    unsigned char key[FA_JIT_SECRET_SIZE], msg[64];
    for (int i = 0; i < 64; i++)
        msg[i] = (unsigned char)i, key[i % 16] = (unsigned char)(i % 16);
    /* The reference implementation's vectors: key 00..0f, message 00..(len-1). */
    static const struct {
        size_t len;
        uint64_t tag;
    } vectors[] = {{0, 0x726fdb47dd0e0e31ull},
                   {1, 0x74f839c593dc67fdull},
                   {8, 0x93f5f5799a932462ull},
                   {15, 0xa129ca6149be45e5ull}};
    for (size_t v = 0; v < sizeof vectors / sizeof vectors[0]; v++) {
        fa_jit_mac m;
        fa_jit_mac_init(&m, key);
        fa_jit_mac_update(&m, msg, vectors[v].len);
        uint64_t got = fa_jit_mac_final(&m);
        TU_CHECK(got == vectors[v].tag, "length %zu: %016llx, expected %016llx", vectors[v].len,
                 (unsigned long long)got, (unsigned long long)vectors[v].tag);
    }
    /* Fed in random pieces, a random message under a random key gives the one-shot tag. */
    for (int round = 0; round < 200; round++) {
        unsigned char data[100];
        size_t len = (size_t)tu_rng_int(&rng, 0, 100);
        for (size_t i = 0; i < len; i++)
            data[i] = (unsigned char)tu_rng_u64(&rng);
        for (int i = 0; i < 16; i++)
            key[i] = (unsigned char)tu_rng_u64(&rng);
        fa_jit_mac whole, pieces;
        fa_jit_mac_init(&whole, key);
        fa_jit_mac_update(&whole, data, len);
        fa_jit_mac_init(&pieces, key);
        for (size_t at = 0; at < len;) {
            size_t n = (size_t)tu_rng_int(&rng, 0, (int64_t)(len - at));
            fa_jit_mac_update(&pieces, data + at, n);
            at += n;
        }
        TU_CHECK(fa_jit_mac_final(&whole) == fa_jit_mac_final(&pieces),
                 "length %zu: pieces disagree with the whole", len);
    }
}

static void test_round_trip(void)
{
    tu_where = "round trip";
    char top[PATH_MAX], dir[PATH_MAX], secret[PATH_MAX], key[128], other[128];
    path_of(top, sizeof top, base, "made");
    path_of(dir, sizeof dir, top, "cache");
    random_key(key, sizeof key, "round-trip");
    random_key(other, sizeof other, "other");
    blob b = random_blob();
    fa_jit_disk *d = open_ok(dir);
    if (!d)
        return;
    struct stat st;
    TU_CHECK(stat(top, &st) == 0 && (st.st_mode & 07777) == 0700, "made %s mode %o", top,
             (unsigned)(st.st_mode & 07777));
    TU_CHECK(stat(dir, &st) == 0 && (st.st_mode & 07777) == 0700, "made %s mode %o", dir,
             (unsigned)(st.st_mode & 07777));
    path_of(secret, sizeof secret, dir, "secret");
    TU_CHECK(lstat(secret, &st) == 0 && S_ISREG(st.st_mode) && (st.st_mode & 07777) == 0600 &&
                 st.st_size == FA_JIT_SECRET_SIZE && st.st_uid == geteuid(),
             "secret file: mode %o size %lld", (unsigned)(st.st_mode & 07777),
             (long long)st.st_size);
    TU_CHECK(misses(d, key), "an empty cache hits");
    TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0, "store failed");
    TU_CHECK(loads(d, key, &b), "the stored blob does not load back");
    TU_CHECK(misses(d, other), "another key hits");
    fa_jit_disk_close(d);
    d = open_ok(dir); /* a later process: the secret is read back, not remade */
    TU_CHECK(d && loads(d, key, &b), "the blob does not load in a later open");
    fa_jit_disk_close(d);
}

static void test_corrupt_entry(void)
{
    tu_where = "corrupt entry";
    char dir[PATH_MAX], entry[PATH_MAX], key[128], other[128];
    path_of(dir, sizeof dir, base, "corrupt");
    random_key(key, sizeof key, "corrupt");
    random_key(other, sizeof other, "corrupt-other");
    fa_jit_disk *d = open_ok(dir);
    if (!d)
        return;
    entry_path(entry, sizeof entry, dir, key);
    blob b = random_blob(), c = random_blob();
    for (int kind = 0; kind < 5; kind++) {
        TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0, "store failed");
        size_t size = 0;
        unsigned char *file = read_file(entry, &size);
        TU_CHECK(file && size == sizeof(fa_jit_header) + strlen(key) + b.size, "entry size %zu",
                 size);
        if (!file)
            return;
        const char *what = "";
        if (kind == 0) { /* one bit of the cubin */
            file[size - 1 - (size_t)tu_rng_int(&rng, 0, (int64_t)b.size - 1)] ^= 0x10;
            what = "a flipped cubin bit";
        } else if (kind == 1) { /* one bit of the header */
            file[(size_t)tu_rng_int(&rng, 0, (int64_t)sizeof(fa_jit_header) - 1)] ^= 0x01;
            what = "a flipped header bit";
        } else if (kind == 2) {
            size = (size_t)tu_rng_int(&rng, 0, (int64_t)size - 1);
            what = "a truncated file";
        } else if (kind == 3) {
            file[size++] = 0;
            what = "a byte appended";
        }
        if (kind < 4) {
            plant_file(entry, file, size);
        } else { /* another key's whole entry under this key's name: a hash collision */
            char other_entry[PATH_MAX];
            entry_path(other_entry, sizeof other_entry, dir, other);
            TU_CHECK(fa_jit_disk_store(d, other, c.data, c.size) == 0 &&
                         rename(other_entry, entry) == 0,
                     "cannot move an entry");
            what = "another key's entry";
        }
        free(file);
        TU_CHECK(misses(d, key), "%s loads as a hit", what);
        TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0 && loads(d, key, &b),
                 "after %s, the rebuilt entry does not load", what);
    }
    fa_jit_disk_close(d);
}

static void test_forged_entry(void)
{
    tu_where = "forged entry";
    char dir[PATH_MAX], entry[PATH_MAX], secret_path[PATH_MAX], key[128];
    path_of(dir, sizeof dir, base, "forged");
    random_key(key, sizeof key, "forged");
    fa_jit_disk *d = open_ok(dir);
    if (!d)
        return;
    entry_path(entry, sizeof entry, dir, key);
    path_of(secret_path, sizeof secret_path, dir, "secret");
    blob b = random_blob();
    TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0, "store failed");
    size_t size = 0, secret_size = 0;
    unsigned char *file = read_file(entry, &size);
    unsigned char *secret = read_file(secret_path, &secret_size);
    const size_t head = sizeof(fa_jit_header) + strlen(key);
    TU_CHECK(file && size == head + b.size && secret && secret_size == FA_JIT_SECRET_SIZE,
             "cannot read the entry or the secret");
    if (!file || size != head + b.size || !secret || secret_size != FA_JIT_SECRET_SIZE)
        return;
    /* The attacker's code: other bytes, same length, the header's tag recomputed. */
    blob evil = b;
    for (size_t i = 0; i < evil.size; i++)
        evil.data[i] = (unsigned char)tu_rng_u64(&rng);
    memcpy(file + head, evil.data, evil.size);
    fa_jit_header h;
    memcpy(&h, file, sizeof h);
    unsigned char guessed[FA_JIT_SECRET_SIZE];
    for (int attempt = 0; attempt < 4; attempt++) {
        const char *how = "";
        if (attempt == 0) { /* the unkeyed checksum of the format before */
            h.tag = fa_jit_hash(evil.data, evil.size, fa_jit_hash(key, strlen(key), 1));
            how = "an unkeyed checksum";
        } else {
            /* SipHash under an all-zero, a random, and the real secret (the control: the forger
             * who has it is the user; it must be accepted, or the misses prove nothing). */
            for (int i = 0; i < FA_JIT_SECRET_SIZE; i++)
                guessed[i] = attempt == 1 ? 0 : attempt == 2 ? (unsigned char)tu_rng_u64(&rng)
                                                             : secret[i];
            fa_jit_mac m;
            fa_jit_mac_init(&m, guessed);
            fa_jit_mac_update(&m, &h, offsetof(fa_jit_header, tag));
            fa_jit_mac_update(&m, key, strlen(key));
            fa_jit_mac_update(&m, evil.data, evil.size);
            h.tag = fa_jit_mac_final(&m);
            how = attempt == 1 ? "a zero key" : attempt == 2 ? "a random key" : "the secret";
        }
        memcpy(file, &h, sizeof h);
        plant_file(entry, file, size);
        if (attempt < 3)
            TU_CHECK(misses(d, key), "an entry forged with %s loads as a hit", how);
        else
            TU_CHECK(loads(d, key, &evil), "an entry tagged with the secret does not load");
    }
    TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0 && loads(d, key, &b),
             "the rebuilt entry does not load");
    free(file);
    free(secret);
    fa_jit_disk_close(d);
}

static void test_symlink_entry(void)
{
    tu_where = "symbolic link as entry";
    char dir[PATH_MAX], entry[PATH_MAX], target[PATH_MAX], key[128];
    path_of(dir, sizeof dir, base, "symlink-entry");
    path_of(target, sizeof target, base, "symlink-target");
    random_key(key, sizeof key, "symlink");
    fa_jit_disk *d = open_ok(dir);
    if (!d)
        return;
    entry_path(entry, sizeof entry, dir, key);
    blob b = random_blob(), c = random_blob();
    /* The link's target is a valid entry: only refusing to follow makes the load miss. */
    TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0 && rename(entry, target) == 0 &&
                 symlink(target, entry) == 0,
             "cannot set up the link: %s", strerror(errno));
    size_t before_size = 0, after_size = 0;
    unsigned char *before = read_file(target, &before_size);
    TU_CHECK(misses(d, key), "a symbolic link to a valid entry is followed");
    TU_CHECK(fa_jit_disk_store(d, key, c.data, c.size) == 0, "store over the link failed");
    unsigned char *after = read_file(target, &after_size);
    TU_CHECK(before && after && before_size == after_size &&
                 memcmp(before, after, before_size) == 0,
             "the link's target was written");
    struct stat st;
    TU_CHECK(lstat(entry, &st) == 0 && S_ISREG(st.st_mode), "the entry is still a link");
    TU_CHECK(loads(d, key, &c), "the rebuilt entry does not load");
    free(before);
    free(after);
    fa_jit_disk_close(d);
}

static void test_symlink_dir(void)
{
    tu_where = "symbolic link as directory";
    char real[PATH_MAX], link[PATH_MAX], slash[PATH_MAX], below[PATH_MAX];
    char dangling[PATH_MAX], nowhere[PATH_MAX];
    path_of(real, sizeof real, base, "real-dir");
    path_of(link, sizeof link, base, "linked-dir");
    path_of(dangling, sizeof dangling, base, "dangling-dir");
    path_of(nowhere, sizeof nowhere, base, "nowhere");
    path_of(slash, sizeof slash, link, "");
    fa_jit_disk_close(open_ok(real));
    TU_CHECK(symlink(real, link) == 0 && symlink(nowhere, dangling) == 0, "symlink: %s",
             strerror(errno));
    expect_refused(link, "symbolic link");
    expect_refused(slash, "symbolic link");
    expect_refused(dangling, "symbolic link");
    struct stat st;
    TU_CHECK(lstat(nowhere, &st) != 0, "a dangling link's target was created");
    /* A link above the directory is the user's own layout (/home -> /usr/home): allowed. */
    path_of(below, sizeof below, link, "below");
    fa_jit_disk_close(open_ok(below));
}

static void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "FAIL: test_jit_disk: blocked on a FIFO\n";
    ssize_t rc = write(STDOUT_FILENO, msg, sizeof msg - 1);
    (void)rc;
    _exit(3);
}

static void test_fifo(void)
{
    tu_where = "FIFO as entry";
    char dir[PATH_MAX], entry[PATH_MAX], secret[PATH_MAX], key[128];
    path_of(dir, sizeof dir, base, "fifo");
    random_key(key, sizeof key, "fifo");
    fa_jit_disk *d = open_ok(dir);
    if (!d)
        return;
    entry_path(entry, sizeof entry, dir, key);
    blob b = random_blob();
    TU_CHECK(mkfifo(entry, 0600) == 0, "mkfifo: %s", strerror(errno));
    signal(SIGALRM, on_alarm);
    alarm(10);
    double t0 = tu_now();
    TU_CHECK(misses(d, key), "a FIFO loads as a hit");
    TU_CHECK(tu_now() - t0 < 2.0, "the load took %.1f s", tu_now() - t0);
    TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0 && loads(d, key, &b),
             "the entry stored over the FIFO does not load");
    fa_jit_disk_close(d);

    /* A FIFO in place of the secret: replaced by a new secret, without blocking. */
    tu_where = "FIFO as secret";
    path_of(secret, sizeof secret, dir, "secret");
    TU_CHECK(unlink(secret) == 0 && mkfifo(secret, 0600) == 0, "mkfifo: %s", strerror(errno));
    d = open_ok(dir);
    struct stat st;
    TU_CHECK(lstat(secret, &st) == 0 && S_ISREG(st.st_mode) && (st.st_mode & 0777) == 0600,
             "the FIFO secret was not replaced by a file");
    TU_CHECK(d && misses(d, key), "an entry under the old secret hits under the new one");
    alarm(0);
    fa_jit_disk_close(d);
}

static void test_writable_dir(void)
{
    tu_where = "directory writable by others";
    static const unsigned modes[] = {0770, 0730, 0707, 0703, 0777, 01777, 02770};
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
        char dir[PATH_MAX], secret[PATH_MAX];
        snprintf(dir, sizeof dir, "%s/mode-%o", base, modes[i]);
        TU_CHECK(mkdir(dir, 0700) == 0 && chmod(dir, modes[i]) == 0, "cannot make %s", dir);
        expect_refused(dir, "writable by its group or others");
        path_of(secret, sizeof secret, dir, "secret");
        TU_CHECK(access(secret, F_OK) != 0, "a refused directory got a secret");
    }
    char dir[PATH_MAX];
    path_of(dir, sizeof dir, base, "mode-755");
    TU_CHECK(mkdir(dir, 0700) == 0 && chmod(dir, 0755) == 0, "cannot make %s", dir);
    fa_jit_disk_close(open_ok(dir)); /* readable by others is fine: cubins are not secret */
}

static void test_foreign_owner(void)
{
    tu_where = "directory of another user";
    if (geteuid() != 0) {
        /* Without root nothing can be given away; a root-owned directory stands in. */
        printf("test_jit_disk: not root: ownership checked on / (owned by root) only; entries "
               "and secrets of another user are not exercised\n");
        struct stat st;
        if (stat("/", &st) == 0 && st.st_uid == 0 && !(st.st_mode & (S_IWGRP | S_IWOTH)))
            expect_refused("/", "owned by uid 0");
        return;
    }
    const uid_t nobody = 65534;
    char dir[PATH_MAX], secret[PATH_MAX], entry[PATH_MAX], key[128];
    path_of(dir, sizeof dir, base, "foreign");
    TU_CHECK(mkdir(dir, 0700) == 0 && chown(dir, nobody, nobody) == 0, "cannot give %s away: %s",
             dir, strerror(errno));
    expect_refused(dir, "owned by uid 65534");

    tu_where = "entry of another user";
    path_of(dir, sizeof dir, base, "own");
    random_key(key, sizeof key, "foreign");
    fa_jit_disk *d = open_ok(dir);
    if (!d)
        return;
    entry_path(entry, sizeof entry, dir, key);
    blob b = random_blob();
    TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0 && loads(d, key, &b), "store failed");
    TU_CHECK(chown(entry, nobody, nobody) == 0, "chown: %s", strerror(errno));
    TU_CHECK(misses(d, key), "another user's entry loads as a hit");
    TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0 && loads(d, key, &b),
             "the rebuilt entry does not load");
    fa_jit_disk_close(d);

    tu_where = "secret of another user";
    path_of(secret, sizeof secret, dir, "secret");
    TU_CHECK(chown(secret, nobody, nobody) == 0, "chown: %s", strerror(errno));
    d = open_ok(dir);
    struct stat st;
    TU_CHECK(stat(secret, &st) == 0 && st.st_uid == geteuid(), "another user's secret was kept");
    TU_CHECK(d && misses(d, key), "an entry under another user's secret hits");
    fa_jit_disk_close(d);
}

static void test_long_path(void)
{
    tu_where = "long path";
    /* 30 components of 200 bytes: over PATH_MAX, and a cut at 1023 bytes (where paths were once
     * truncated) falls inside a component. */
    static char dir[8192];
    int n = snprintf(dir, sizeof dir, "%s/long", base);
    for (int i = 0; i < 30; i++) {
        dir[n++] = '/';
        for (int j = 0; j < 200; j++)
            dir[n++] = (char)('a' + (i + j) % 26);
    }
    dir[n] = '\0';
    TU_CHECK(n > PATH_MAX, "the path is only %d bytes", n);
    char key[128];
    random_key(key, sizeof key, "long");
    blob b = random_blob();
    fa_jit_disk *d = open_ok(dir);
    TU_CHECK(d && fa_jit_disk_store(d, key, b.data, b.size) == 0 && loads(d, key, &b),
             "no round trip under a %d-byte path", n);
    TU_CHECK(d && strcmp(fa_jit_disk_path(d), dir) == 0, "the path was changed");
    fa_jit_disk_close(d);
    /* The entry is at the end of the whole path. */
    int fd = open("/", O_RDONLY | O_DIRECTORY);
    for (char *p = dir + 1, *slash; fd >= 0 && *p; p = slash ? slash + 1 : p + strlen(p)) {
        slash = strchr(p, '/');
        if (slash)
            *slash = '\0';
        int next = openat(fd, p, O_RDONLY | O_DIRECTORY);
        if (slash)
            *slash = '/';
        close(fd);
        fd = next;
    }
    char name[64];
    fa_jit_disk_entry_name(key, name, sizeof name);
    struct stat st;
    TU_CHECK(fd >= 0 && fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode),
             "the entry is not at the end of the path");
    if (fd >= 0)
        close(fd);
    char cut[1024];
    memcpy(cut, dir, 1023);
    cut[1023] = '\0';
    TU_CHECK(dir[1023] != '/' && cut[1022] != '/' && access(cut, F_OK) != 0,
             "something was made at the path cut at 1023 bytes");

    tu_where = "over-long component";
    char longname[PATH_MAX];
    n = snprintf(longname, sizeof longname, "%s/", base);
    memset(longname + n, 'x', NAME_MAX + 1);
    longname[n + NAME_MAX + 1] = '\0';
    int untrusted = -1;
    char why[256] = "";
    d = fa_jit_disk_open(longname, &untrusted, why, sizeof why);
    TU_CHECK(!d && strstr(why, "longer than"), "an over-long component: '%s'", why);
    fa_jit_disk_close(d);
}

/* Runs fn in a child (the environment's cache is opened once per process); its failures count. */
static void in_child(void (*fn)(void))
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        tu_failures = 0; /* the child's own */
        fn();
        fflush(stdout);
        _exit(tu_failures ? 1 : 0);
    }
    int status = 0;
    TU_CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
                 WEXITSTATUS(status) == 0,
             "%s: the child failed (status %d)", tu_where, status);
}

static void child_relative(void)
{
    char cwd[PATH_MAX], dir[PATH_MAX], entry[PATH_MAX], key[128];
    path_of(cwd, sizeof cwd, base, "cwd");
    path_of(dir, sizeof dir, cwd, "rel/cache");
    random_key(key, sizeof key, "relative");
    blob b = random_blob();
    TU_CHECK(mkdir(cwd, 0700) == 0 && chdir(cwd) == 0, "cannot enter %s", cwd);
    setenv("FLASHATTN_CACHE_DIR", "rel/cache", 1);
    fa_jit_disk *d = fa_jit_disk_default();
    TU_CHECK(d && strcmp(fa_jit_disk_path(d), dir) == 0, "the relative path became %s",
             d ? fa_jit_disk_path(d) : "nothing");
    TU_CHECK(chdir("/") == 0 && fa_jit_disk_default() == d, "a second call opened again");
    TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0 && loads(d, key, &b),
             "no round trip after chdir");
    entry_path(entry, sizeof entry, dir, key);
    TU_CHECK(access(entry, F_OK) == 0, "the entry is not under the first working directory");
}

static void child_refusal_said_once(void)
{
    char dir[PATH_MAX], log[PATH_MAX];
    path_of(dir, sizeof dir, base, "said-once");
    path_of(log, sizeof log, base, "said-once.log");
    TU_CHECK(mkdir(dir, 0700) == 0 && chmod(dir, 0777) == 0, "cannot make %s", dir);
    setenv("FLASHATTN_CACHE_DIR", dir, 1);
    unsetenv("FLASHATTN_LOG"); /* said even unasked */
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    TU_CHECK(fd >= 0 && dup2(fd, STDERR_FILENO) == STDERR_FILENO, "cannot redirect stderr");
    TU_CHECK(fa_jit_disk_default() == NULL && fa_jit_disk_default() == NULL,
             "a 0777 directory was used");
    size_t size = 0;
    unsigned char *text = read_file(log, &size);
    int count = 0;
    for (size_t i = 0; text && i < size; i++)
        count += strncmp((char *)text + i, "not using the kernel cache directory", 36) == 0;
    TU_CHECK(text && count == 1 && strstr((char *)text, "writable") &&
                 strstr((char *)text, "memory only"),
             "said %d times: %.*s", count, (int)size, text ? (char *)text : "");
    free(text);
}

static void child_off(void)
{
    setenv("FLASHATTN_CACHE_DIR", "", 1);
    TU_CHECK(fa_jit_disk_default() == NULL, "an empty FLASHATTN_CACHE_DIR did not turn it off");
}

/* ---- concurrent writers ----------------------------------------------------------------- */

typedef struct writer {
    const char *dir;
    fa_jit_disk *disk;
    const char *key;
    const blob *b;
    int failures;
} writer;

static void *writer_run(void *arg)
{
    writer *w = arg;
    for (int i = 0; i < 40; i++)
        if (fa_jit_disk_store(w->disk, w->key, w->b->data, w->b->size) != 0 ||
            !loads(w->disk, w->key, w->b))
            w->failures++;
    return NULL;
}

static void test_concurrent(void)
{
    tu_where = "concurrent writers";
    char dir[PATH_MAX], key[128];
    path_of(dir, sizeof dir, base, "concurrent");
    random_key(key, sizeof key, "concurrent");
    blob b = random_blob();
    enum { PROCS = 4, THREADS = 2 };
    pid_t pids[PROCS];
    fflush(stdout);
    for (int p = 0; p < PROCS; p++) {
        pids[p] = fork();
        if (pids[p] == 0) {
            /* Every process makes the directory and its secret at once: they must agree. */
            int untrusted;
            char why[256];
            fa_jit_disk *d = fa_jit_disk_open(dir, &untrusted, why, sizeof why);
            if (!d)
                _exit(2);
            writer w[THREADS];
            pthread_t t[THREADS];
            for (int i = 0; i < THREADS; i++) {
                w[i] = (writer){dir, d, key, &b, 0};
                pthread_create(&t[i], NULL, writer_run, &w[i]);
            }
            int failures = 0;
            for (int i = 0; i < THREADS; i++) {
                pthread_join(t[i], NULL);
                failures += w[i].failures;
            }
            _exit(failures ? 1 : 0);
        }
    }
    for (int p = 0; p < PROCS; p++) {
        int status = 0;
        TU_CHECK(pids[p] > 0 && waitpid(pids[p], &status, 0) == pids[p] && WIFEXITED(status) &&
                     WEXITSTATUS(status) == 0,
                 "writer %d: a store failed or a load missed or differed (status %d)", p, status);
    }
    fa_jit_disk *d = open_ok(dir);
    TU_CHECK(d && loads(d, key, &b), "the entry does not load after the writers");
    fa_jit_disk_close(d);
    DIR *listing = opendir(dir);
    int files = 0;
    for (struct dirent *e; listing && (e = readdir(listing));)
        if (e->d_name[0] != '.') {
            files++;
            TU_CHECK(!strstr(e->d_name, ".tmp."), "a temporary file was left: %s", e->d_name);
        }
    if (listing)
        closedir(listing);
    TU_CHECK(files == 2, "%d files in the directory, expected the secret and one entry", files);
}

int main(void)
{
    rng.state = tu_master_seed("test_jit_disk");
    snprintf(base, sizeof base, "%s/fa_jit_disk_XXXXXX",
             getenv("TMPDIR") && getenv("TMPDIR")[0] == '/' ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(base)) {
        printf("test_jit_disk: mkdtemp: %s\n", strerror(errno));
        return 1;
    }
    unsetenv("FLASHATTN_LOG");
    test_mac();
    test_round_trip();
    test_corrupt_entry();
    test_forged_entry();
    test_symlink_entry();
    test_symlink_dir();
    test_fifo();
    test_writable_dir();
    test_foreign_owner();
    test_long_path();
    tu_where = "relative FLASHATTN_CACHE_DIR";
    in_child(child_relative);
    tu_where = "refused directory said once";
    in_child(child_refusal_said_once);
    tu_where = "empty FLASHATTN_CACHE_DIR";
    in_child(child_off);
    test_concurrent();
    remove_tree(AT_FDCWD, base);
    return tu_finish("test_jit_disk");
}
