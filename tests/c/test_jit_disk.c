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
 *   - processes and threads writing one key at once never expose a partial or foreign entry;
 *   - the compile lock makes a second process wait for the first (test_jit_disk_lock.c).
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

#include "test_jit_disk.h"

char jd_base[256];
tu_rng jd_rng;

jd_blob jd_random_blob(void)
{
    jd_blob b;
    b.size = (size_t)tu_rng_int(&jd_rng, 1, JD_BLOB_MAX);
    for (size_t i = 0; i < b.size; i++)
        b.data[i] = (unsigned char)tu_rng_u64(&jd_rng);
    return b;
}

void jd_random_key(char *key, size_t size, const char *what)
{
    snprintf(key, size, "flashattn-jit-test %s %016llx -DFA_BN=64", what,
             (unsigned long long)tu_rng_u64(&jd_rng));
}

void jd_path_of(char *out, size_t size, const char *dir, const char *name)
{
    int n = snprintf(out, size, "%s/%s", dir, name);
    TU_CHECK(n > 0 && (size_t)n < size, "the path %s/%s is too long for the test", dir, name);
}

void jd_entry_path(char *out, size_t size, const char *dir, const char *key)
{
    char name[64];
    fa_jit_disk_entry_name(key, name, sizeof name);
    jd_path_of(out, size, dir, name);
}

fa_jit_disk *jd_open_ok(const char *dir)
{
    int untrusted = -1;
    char why[256] = "";
    fa_jit_disk *d = fa_jit_disk_open(dir, &untrusted, why, sizeof why);
    TU_CHECK(d != NULL, "%s refused: %s", dir, why);
    return d;
}

void jd_expect_refused(const char *dir, const char *reason)
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
int jd_loads(fa_jit_disk *d, const char *key, const jd_blob *b)
{
    size_t size = 0;
    void *got = fa_jit_disk_load(d, key, &size);
    int same = got && size == b->size && memcmp(got, b->data, size) == 0;
    free(got);
    return same;
}

int jd_misses(fa_jit_disk *d, const char *key)
{
    size_t size = 0;
    void *got = fa_jit_disk_load(d, key, &size);
    free(got);
    return got == NULL;
}

unsigned char *jd_read_file(const char *path, size_t *size)
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
        size_t len = (size_t)tu_rng_int(&jd_rng, 0, 100);
        for (size_t i = 0; i < len; i++)
            data[i] = (unsigned char)tu_rng_u64(&jd_rng);
        for (int i = 0; i < 16; i++)
            key[i] = (unsigned char)tu_rng_u64(&jd_rng);
        fa_jit_mac whole, pieces;
        fa_jit_mac_init(&whole, key);
        fa_jit_mac_update(&whole, data, len);
        fa_jit_mac_init(&pieces, key);
        for (size_t at = 0; at < len;) {
            size_t n = (size_t)tu_rng_int(&jd_rng, 0, (int64_t)(len - at));
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
    jd_path_of(top, sizeof top, jd_base, "made");
    jd_path_of(dir, sizeof dir, top, "cache");
    jd_random_key(key, sizeof key, "round-trip");
    jd_random_key(other, sizeof other, "other");
    jd_blob b = jd_random_blob();
    fa_jit_disk *d = jd_open_ok(dir);
    if (!d)
        return;
    struct stat st;
    TU_CHECK(stat(top, &st) == 0 && (st.st_mode & 07777) == 0700, "made %s mode %o", top,
             (unsigned)(st.st_mode & 07777));
    TU_CHECK(stat(dir, &st) == 0 && (st.st_mode & 07777) == 0700, "made %s mode %o", dir,
             (unsigned)(st.st_mode & 07777));
    jd_path_of(secret, sizeof secret, dir, "secret");
    TU_CHECK(lstat(secret, &st) == 0 && S_ISREG(st.st_mode) && (st.st_mode & 07777) == 0600 &&
                 st.st_size == FA_JIT_SECRET_SIZE && st.st_uid == geteuid(),
             "secret file: mode %o size %lld", (unsigned)(st.st_mode & 07777),
             (long long)st.st_size);
    TU_CHECK(jd_misses(d, key), "an empty cache hits");
    TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0, "store failed");
    TU_CHECK(jd_loads(d, key, &b), "the stored blob does not load back");
    TU_CHECK(jd_misses(d, other), "another key hits");
    fa_jit_disk_close(d);
    d = jd_open_ok(dir); /* a later process: the secret is read back, not remade */
    TU_CHECK(d && jd_loads(d, key, &b), "the blob does not load in a later open");
    fa_jit_disk_close(d);
}

static void test_corrupt_entry(void)
{
    tu_where = "corrupt entry";
    char dir[PATH_MAX], entry[PATH_MAX], key[128], other[128];
    jd_path_of(dir, sizeof dir, jd_base, "corrupt");
    jd_random_key(key, sizeof key, "corrupt");
    jd_random_key(other, sizeof other, "corrupt-other");
    fa_jit_disk *d = jd_open_ok(dir);
    if (!d)
        return;
    jd_entry_path(entry, sizeof entry, dir, key);
    jd_blob b = jd_random_blob(), c = jd_random_blob();
    for (int kind = 0; kind < 5; kind++) {
        TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0, "store failed");
        size_t size = 0;
        unsigned char *file = jd_read_file(entry, &size);
        TU_CHECK(file && size == sizeof(fa_jit_header) + strlen(key) + b.size, "entry size %zu",
                 size);
        if (!file)
            return;
        const char *what = "";
        if (kind == 0) { /* one bit of the cubin */
            file[size - 1 - (size_t)tu_rng_int(&jd_rng, 0, (int64_t)b.size - 1)] ^= 0x10;
            what = "a flipped cubin bit";
        } else if (kind == 1) { /* one bit of the header */
            file[(size_t)tu_rng_int(&jd_rng, 0, (int64_t)sizeof(fa_jit_header) - 1)] ^= 0x01;
            what = "a flipped header bit";
        } else if (kind == 2) {
            size = (size_t)tu_rng_int(&jd_rng, 0, (int64_t)size - 1);
            what = "a truncated file";
        } else if (kind == 3) {
            file[size++] = 0;
            what = "a byte appended";
        }
        if (kind < 4) {
            plant_file(entry, file, size);
        } else { /* another key's whole entry under this key's name: a hash collision */
            char other_entry[PATH_MAX];
            jd_entry_path(other_entry, sizeof other_entry, dir, other);
            TU_CHECK(fa_jit_disk_store(d, other, c.data, c.size) == 0 &&
                         rename(other_entry, entry) == 0,
                     "cannot move an entry");
            what = "another key's entry";
        }
        free(file);
        TU_CHECK(jd_misses(d, key), "%s loads as a hit", what);
        TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0 && jd_loads(d, key, &b),
                 "after %s, the rebuilt entry does not load", what);
    }
    fa_jit_disk_close(d);
}

static void test_forged_entry(void)
{
    tu_where = "forged entry";
    char dir[PATH_MAX], entry[PATH_MAX], secret_path[PATH_MAX], key[128];
    jd_path_of(dir, sizeof dir, jd_base, "forged");
    jd_random_key(key, sizeof key, "forged");
    fa_jit_disk *d = jd_open_ok(dir);
    if (!d)
        return;
    jd_entry_path(entry, sizeof entry, dir, key);
    jd_path_of(secret_path, sizeof secret_path, dir, "secret");
    jd_blob b = jd_random_blob();
    TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0, "store failed");
    size_t size = 0, secret_size = 0;
    unsigned char *file = jd_read_file(entry, &size);
    unsigned char *secret = jd_read_file(secret_path, &secret_size);
    const size_t head = sizeof(fa_jit_header) + strlen(key);
    TU_CHECK(file && size == head + b.size && secret && secret_size == FA_JIT_SECRET_SIZE,
             "cannot read the entry or the secret");
    if (!file || size != head + b.size || !secret || secret_size != FA_JIT_SECRET_SIZE)
        return;
    /* The attacker's code: other bytes, same length, the header's tag recomputed. */
    jd_blob evil = b;
    for (size_t i = 0; i < evil.size; i++)
        evil.data[i] = (unsigned char)tu_rng_u64(&jd_rng);
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
                guessed[i] = attempt == 1 ? 0 : attempt == 2 ? (unsigned char)tu_rng_u64(&jd_rng)
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
            TU_CHECK(jd_misses(d, key), "an entry forged with %s loads as a hit", how);
        else
            TU_CHECK(jd_loads(d, key, &evil), "an entry tagged with the secret does not load");
    }
    TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0 && jd_loads(d, key, &b),
             "the rebuilt entry does not load");
    free(file);
    free(secret);
    fa_jit_disk_close(d);
}

static void test_symlink_entry(void)
{
    tu_where = "symbolic link as entry";
    char dir[PATH_MAX], entry[PATH_MAX], target[PATH_MAX], key[128];
    jd_path_of(dir, sizeof dir, jd_base, "symlink-entry");
    jd_path_of(target, sizeof target, jd_base, "symlink-target");
    jd_random_key(key, sizeof key, "symlink");
    fa_jit_disk *d = jd_open_ok(dir);
    if (!d)
        return;
    jd_entry_path(entry, sizeof entry, dir, key);
    jd_blob b = jd_random_blob(), c = jd_random_blob();
    /* The link's target is a valid entry: only refusing to follow makes the load miss. */
    TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0 && rename(entry, target) == 0 &&
                 symlink(target, entry) == 0,
             "cannot set up the link: %s", strerror(errno));
    size_t before_size = 0, after_size = 0;
    unsigned char *before = jd_read_file(target, &before_size);
    TU_CHECK(jd_misses(d, key), "a symbolic link to a valid entry is followed");
    TU_CHECK(fa_jit_disk_store(d, key, c.data, c.size) == 0, "store over the link failed");
    unsigned char *after = jd_read_file(target, &after_size);
    TU_CHECK(before && after && before_size == after_size &&
                 memcmp(before, after, before_size) == 0,
             "the link's target was written");
    struct stat st;
    TU_CHECK(lstat(entry, &st) == 0 && S_ISREG(st.st_mode), "the entry is still a link");
    TU_CHECK(jd_loads(d, key, &c), "the rebuilt entry does not load");
    free(before);
    free(after);
    fa_jit_disk_close(d);
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
    jd_path_of(dir, sizeof dir, jd_base, "fifo");
    jd_random_key(key, sizeof key, "fifo");
    fa_jit_disk *d = jd_open_ok(dir);
    if (!d)
        return;
    jd_entry_path(entry, sizeof entry, dir, key);
    jd_blob b = jd_random_blob();
    TU_CHECK(mkfifo(entry, 0600) == 0, "mkfifo: %s", strerror(errno));
    signal(SIGALRM, on_alarm);
    alarm(10);
    double t0 = tu_now();
    TU_CHECK(jd_misses(d, key), "a FIFO loads as a hit");
    TU_CHECK(tu_now() - t0 < 2.0, "the load took %.1f s", tu_now() - t0);
    TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0 && jd_loads(d, key, &b),
             "the entry stored over the FIFO does not load");
    fa_jit_disk_close(d);

    /* A FIFO in place of the secret: replaced by a new secret, without blocking. */
    tu_where = "FIFO as secret";
    jd_path_of(secret, sizeof secret, dir, "secret");
    TU_CHECK(unlink(secret) == 0 && mkfifo(secret, 0600) == 0, "mkfifo: %s", strerror(errno));
    d = jd_open_ok(dir);
    struct stat st;
    TU_CHECK(lstat(secret, &st) == 0 && S_ISREG(st.st_mode) && (st.st_mode & 0777) == 0600,
             "the FIFO secret was not replaced by a file");
    TU_CHECK(d && jd_misses(d, key), "an entry under the old secret hits under the new one");
    alarm(0);
    fa_jit_disk_close(d);
}

/* ---- concurrent writers ----------------------------------------------------------------- */

typedef struct writer {
    const char *dir;
    fa_jit_disk *disk;
    const char *key;
    const jd_blob *b;
    int failures;
} writer;

static void *writer_run(void *arg)
{
    writer *w = arg;
    for (int i = 0; i < 40; i++)
        if (fa_jit_disk_store(w->disk, w->key, w->b->data, w->b->size) != 0 ||
            !jd_loads(w->disk, w->key, w->b))
            w->failures++;
    return NULL;
}

static void test_concurrent(void)
{
    tu_where = "concurrent writers";
    char dir[PATH_MAX], key[128];
    jd_path_of(dir, sizeof dir, jd_base, "concurrent");
    jd_random_key(key, sizeof key, "concurrent");
    jd_blob b = jd_random_blob();
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
    fa_jit_disk *d = jd_open_ok(dir);
    TU_CHECK(d && jd_loads(d, key, &b), "the entry does not load after the writers");
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
    jd_rng.state = tu_master_seed("test_jit_disk");
    snprintf(jd_base, sizeof jd_base, "%s/fa_jit_disk_XXXXXX",
             getenv("TMPDIR") && getenv("TMPDIR")[0] == '/' ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(jd_base)) {
        printf("test_jit_disk: mkdtemp: %s\n", strerror(errno));
        return 1;
    }
    unsetenv("FLASHATTN_LOG");
    test_mac();
    test_round_trip();
    test_corrupt_entry();
    test_forged_entry();
    test_symlink_entry();
    test_fifo();
    jd_test_dirs();
    test_concurrent();
    jd_test_lock();
    remove_tree(AT_FDCWD, jd_base);
    return tu_finish("test_jit_disk");
}
