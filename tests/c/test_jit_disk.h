/*
 * Shared pieces of test_jit_disk: scratch paths, random blobs and keys, and checks of the disk
 * cache's answers (src/cuda/fa_jit.h).
 */
#ifndef FA_TEST_JIT_DISK_H
#define FA_TEST_JIT_DISK_H

#include <stddef.h>

#include "cuda/fa_jit.h"
#include "test_util.h"

#define JD_BLOB_MAX 6000

extern char jd_base[256]; /* this run's scratch directory */
extern tu_rng jd_rng;

typedef struct jd_blob {
    unsigned char data[JD_BLOB_MAX];
    size_t size;
} jd_blob;

jd_blob jd_random_blob(void);
void jd_random_key(char *key, size_t size, const char *what);
void jd_path_of(char *out, size_t size, const char *dir, const char *name);
/* The path of key's entry in dir. */
void jd_entry_path(char *out, size_t size, const char *dir, const char *key);
/* dir opened as a cache, or NULL after a failed check. */
fa_jit_disk *jd_open_ok(const char *dir);
/* Checks that opening dir is refused as untrusted with a reason containing `reason`. */
void jd_expect_refused(const char *dir, const char *reason);
/* Whether load gives exactly b; whether it misses. */
int jd_loads(fa_jit_disk *d, const char *key, const jd_blob *b);
int jd_misses(fa_jit_disk *d, const char *key);
/* The first 64 KiB of a file, NUL-terminated (malloc'ed), or NULL. */
unsigned char *jd_read_file(const char *path, size_t *size);

/* The directory checks (test_jit_disk_dir.c). */
void jd_test_dirs(void);
/* The compile lock across processes (test_jit_disk_lock.c). */
void jd_test_lock(void);

#endif /* FA_TEST_JIT_DISK_H */
