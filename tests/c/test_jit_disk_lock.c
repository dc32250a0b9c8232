/*
 * The disk cache's compile lock (fa_jit_disk_lock), across processes:
 *   - without a disk cache there is no lock, and no wait;
 *   - a second process waits while the first holds a key's lock, then finds the entry the
 *     holder stored before letting go;
 *   - a holder that exits without unlocking releases the lock;
 *   - other keys' locks are free meanwhile, and a lock file is never read as an entry.
 */
#define _POSIX_C_SOURCE 200809L
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test_jit_disk.h"

#define HOLD_MS 300

static void sleep_ms(int ms)
{
    const struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* Waits for child pid; its exit status, or -1. */
static int child_status(pid_t pid)
{
    int status = 0;
    if (pid <= 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
        return -1;
    return WEXITSTATUS(status);
}

/* The child of test_wait: takes the lock the parent holds; exit 0 when it waited about as long
 * as the parent held it and then found the entry, 1 when it took the lock too soon, 2 when the
 * entry was missing, 3 without a lock. */
static int waiter_run(const char *dir, const char *key, const jd_blob *b, int ready_fd)
{
    fa_jit_disk *d = jd_open_ok(dir);
    char go;
    if (!d || read(ready_fd, &go, 1) != 1)
        return 3;
    double waited = -1.0;
    const int lock = fa_jit_disk_lock(d, key, &waited);
    int rc = lock < 0 ? 3 : waited < 0.8 * HOLD_MS ? 1 : jd_loads(d, key, b) ? 0 : 2;
    fa_jit_disk_unlock(lock);
    fa_jit_disk_close(d);
    return rc;
}

static void test_wait(void)
{
    tu_where = "a second process waits for the holder";
    char dir[PATH_MAX], key[128], other[128];
    jd_path_of(dir, sizeof dir, jd_base, "lock_wait");
    jd_random_key(key, sizeof key, "lock");
    jd_random_key(other, sizeof other, "lock other");
    const jd_blob b = jd_random_blob();
    fa_jit_disk *d = jd_open_ok(dir);
    if (!d)
        return;
    double waited = -1.0;
    TU_CHECK(fa_jit_disk_lock(NULL, key, &waited) == -1 && waited == 0.0,
             "no disk cache: lock or wait (%.1f ms)", waited);
    const int lock = fa_jit_disk_lock(d, key, &waited);
    TU_CHECK(lock >= 0 && waited == 0.0, "a free lock: descriptor %d after %.1f ms", lock, waited);
    TU_CHECK(jd_misses(d, key), "the lock file reads as the key's entry");
    int pipe_fd[2];
    if (lock < 0 || pipe(pipe_fd) != 0)
        return;
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
        close(pipe_fd[1]);
        _exit(waiter_run(dir, key, &b, pipe_fd[0]));
    }
    close(pipe_fd[0]);
    TU_CHECK(write(pipe_fd[1], "g", 1) == 1, "the waiter's start");
    close(pipe_fd[1]);
    /* Another key's lock is free while this one is held. */
    const int other_lock = fa_jit_disk_lock(d, other, &waited);
    TU_CHECK(other_lock >= 0 && waited == 0.0, "another key's lock waited %.1f ms", waited);
    fa_jit_disk_unlock(other_lock);
    sleep_ms(HOLD_MS);
    /* The compile's end: the entry stored, then the lock let go. */
    TU_CHECK(fa_jit_disk_store(d, key, b.data, b.size) == 0, "the holder's store");
    fa_jit_disk_unlock(lock);
    const int rc = child_status(pid);
    TU_CHECK(rc == 0, "the waiter: %s",
             rc == 1   ? "took the lock while it was held"
             : rc == 2 ? "found no entry after the wait"
                       : "had no lock");
    fa_jit_disk_close(d);
}

static void test_holder_exits(void)
{
    tu_where = "a holder that exits without unlocking";
    char dir[PATH_MAX], key[128];
    jd_path_of(dir, sizeof dir, jd_base, "lock_exit");
    jd_random_key(key, sizeof key, "lock exit");
    fa_jit_disk *d = jd_open_ok(dir);
    int pipe_fd[2];
    if (!d || pipe(pipe_fd) != 0)
        return;
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
        close(pipe_fd[0]);
        double w;
        const int held = fa_jit_disk_lock(d, key, &w) >= 0;
        if (write(pipe_fd[1], held ? "h" : "n", 1) != 1)
            _exit(2);
        sleep_ms(HOLD_MS);
        _exit(held ? 0 : 1); /* the lock neither unlocked nor closed: the exit releases it */
    }
    close(pipe_fd[1]);
    char held = 0;
    TU_CHECK(read(pipe_fd[0], &held, 1) == 1 && held == 'h', "the holder took no lock");
    close(pipe_fd[0]);
    double waited = -1.0;
    const int lock = fa_jit_disk_lock(d, key, &waited);
    TU_CHECK(lock >= 0 && waited >= 0.5 * HOLD_MS,
             "after the holder's exit: descriptor %d after %.1f ms", lock, waited);
    fa_jit_disk_unlock(lock);
    TU_CHECK(child_status(pid) == 0, "the holder's exit status");
    fa_jit_disk_close(d);
}

void jd_test_lock(void)
{
    test_wait();
    test_holder_exits();
}
