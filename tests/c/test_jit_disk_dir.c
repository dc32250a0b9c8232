/*
 * test_jit_disk's directory checks: a linked, shared or foreign directory is refused; paths of
 * any length work; a relative FLASHATTN_CACHE_DIR is resolved once; a refusal is said once.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_jit_disk.h"

static void test_symlink_dir(void)
{
    tu_where = "symbolic link as directory";
    char real[PATH_MAX], link[PATH_MAX], slash[PATH_MAX], below[PATH_MAX];
    char dangling[PATH_MAX], nowhere[PATH_MAX];
    jd_path_of(real, sizeof real, jd_base, "real-dir");
    jd_path_of(link, sizeof link, jd_base, "linked-dir");
    jd_path_of(dangling, sizeof dangling, jd_base, "dangling-dir");
    jd_path_of(nowhere, sizeof nowhere, jd_base, "nowhere");
    jd_path_of(slash, sizeof slash, link, "");
    fa_jit_disk_close(jd_open_ok(real));
    TU_CHECK(symlink(real, link) == 0 && symlink(nowhere, dangling) == 0, "symlink: %s",
             strerror(errno));
    jd_expect_refused(link, "symbolic link");
    jd_expect_refused(slash, "symbolic link");
    jd_expect_refused(dangling, "symbolic link");
    struct stat st;
    TU_CHECK(lstat(nowhere, &st) != 0, "a dangling link's target was created");
    /* A link above the directory is the user's own layout (/home -> /usr/home): allowed. */
    jd_path_of(below, sizeof below, link, "below");
    fa_jit_disk_close(jd_open_ok(below));
}

static void test_writable_dir(void)
{
    tu_where = "directory writable by others";
    static const unsigned modes[] = {0770, 0730, 0707, 0703, 0777, 01777, 02770};
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
        char dir[PATH_MAX], secret[PATH_MAX];
        snprintf(dir, sizeof dir, "%s/mode-%o", jd_base, modes[i]);
        TU_CHECK(mkdir(dir, 0700) == 0 && chmod(dir, modes[i]) == 0, "cannot make %s", dir);
        jd_expect_refused(dir, "writable by its group or others");
        jd_path_of(secret, sizeof secret, dir, "secret");
        TU_CHECK(access(secret, F_OK) != 0, "a refused directory got a secret");
    }
    char dir[PATH_MAX];
    jd_path_of(dir, sizeof dir, jd_base, "mode-755");
    TU_CHECK(mkdir(dir, 0700) == 0 && chmod(dir, 0755) == 0, "cannot make %s", dir);
    fa_jit_disk_close(jd_open_ok(dir)); /* readable by others is fine: cubins are not secret */
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
            jd_expect_refused("/", "owned by uid 0");
        return;
    }
    const uid_t nobody = 65534;
    char dir[PATH_MAX], secret[PATH_MAX], entry[PATH_MAX], key[128];
    jd_path_of(dir, sizeof dir, jd_base, "foreign");
    TU_CHECK(mkdir(dir, 0700) == 0 && chown(dir, nobody, nobody) == 0, "cannot give %s away: %s",
             dir, strerror(errno));
    jd_expect_refused(dir, "owned by uid 65534");

    tu_where = "entry of another user";
    jd_path_of(dir, sizeof dir, jd_base, "own");
    jd_random_key(key, sizeof key, "foreign");
    fa_jit_disk *d = jd_open_ok(dir);
    if (!d)
        return;
    jd_entry_path(entry, sizeof entry, dir, key);
    jd_blob b = jd_random_blob();
    TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0 && jd_loads(d, key, &b), "store failed");
    TU_CHECK(chown(entry, nobody, nobody) == 0, "chown: %s", strerror(errno));
    TU_CHECK(jd_misses(d, key), "another user's entry loads as a hit");
    TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0 && jd_loads(d, key, &b),
             "the rebuilt entry does not load");
    fa_jit_disk_close(d);

    tu_where = "secret of another user";
    jd_path_of(secret, sizeof secret, dir, "secret");
    TU_CHECK(chown(secret, nobody, nobody) == 0, "chown: %s", strerror(errno));
    d = jd_open_ok(dir);
    struct stat st;
    TU_CHECK(stat(secret, &st) == 0 && st.st_uid == geteuid(), "another user's secret was kept");
    TU_CHECK(d && jd_misses(d, key), "an entry under another user's secret hits");
    fa_jit_disk_close(d);
}

static void test_long_path(void)
{
    tu_where = "long path";
    /* 30 components of 200 bytes: over PATH_MAX, and a cut at 1023 bytes (where paths were once
     * truncated) falls inside a component. */
    static char dir[8192];
    int n = snprintf(dir, sizeof dir, "%s/long", jd_base);
    for (int i = 0; i < 30; i++) {
        dir[n++] = '/';
        for (int j = 0; j < 200; j++)
            dir[n++] = (char)('a' + (i + j) % 26);
    }
    dir[n] = '\0';
    TU_CHECK(n > PATH_MAX, "the path is only %d bytes", n);
    char key[128];
    jd_random_key(key, sizeof key, "long");
    jd_blob b = jd_random_blob();
    fa_jit_disk *d = jd_open_ok(dir);
    TU_CHECK(d && fa_jit_disk_store(d, key, b.data, b.size) == 0 && jd_loads(d, key, &b),
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
    n = snprintf(longname, sizeof longname, "%s/", jd_base);
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
    jd_path_of(cwd, sizeof cwd, jd_base, "cwd");
    jd_path_of(dir, sizeof dir, cwd, "rel/cache");
    jd_random_key(key, sizeof key, "relative");
    jd_blob b = jd_random_blob();
    TU_CHECK(mkdir(cwd, 0700) == 0 && chdir(cwd) == 0, "cannot enter %s", cwd);
    setenv("FLASHATTN_CACHE_DIR", "rel/cache", 1);
    fa_jit_disk *d = fa_jit_disk_default();
    TU_CHECK(d && strcmp(fa_jit_disk_path(d), dir) == 0, "the relative path became %s",
             d ? fa_jit_disk_path(d) : "nothing");
    TU_CHECK(chdir("/") == 0 && fa_jit_disk_default() == d, "a second call opened again");
    TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0 && jd_loads(d, key, &b),
             "no round trip after chdir");
    jd_entry_path(entry, sizeof entry, dir, key);
    TU_CHECK(access(entry, F_OK) == 0, "the entry is not under the first working directory");
}

static void child_refusal_said_once(void)
{
    char dir[PATH_MAX], log[PATH_MAX];
    jd_path_of(dir, sizeof dir, jd_base, "said-once");
    jd_path_of(log, sizeof log, jd_base, "said-once.log");
    TU_CHECK(mkdir(dir, 0700) == 0 && chmod(dir, 0777) == 0, "cannot make %s", dir);
    setenv("FLASHATTN_CACHE_DIR", dir, 1);
    unsetenv("FLASHATTN_LOG"); /* said even unasked */
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    TU_CHECK(fd >= 0 && dup2(fd, STDERR_FILENO) == STDERR_FILENO, "cannot redirect stderr");
    TU_CHECK(fa_jit_disk_default() == NULL && fa_jit_disk_default() == NULL,
             "a 0777 directory was used");
    size_t size = 0;
    unsigned char *text = jd_read_file(log, &size);
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
void jd_test_dirs(void)
{
    test_symlink_dir();
    test_writable_dir();
    test_foreign_owner();
    test_long_path();
    tu_where = "relative FLASHATTN_CACHE_DIR";
    in_child(child_relative);
    tu_where = "refused directory said once";
    in_child(child_refusal_said_once);
    tu_where = "empty FLASHATTN_CACHE_DIR";
    in_child(child_off);
}
