/*
 * The fuzzer's case generator, shared by the deterministic driver (fa_fuzz.c) and the libFuzzer
 * entry (fa_fuzz_libfuzzer.c): one case is one call of the public C API (forward, varlen
 * forward, backward, KV cache, combine, block mask build, program parse, precompile or a small
 * query) with adversarial shapes, strides, pointers, indices, scalars and thread counts, drawn
 * from a source of random choices.
 *
 * The contract every case checks: the call returns a status, and a non-empty fa_last_error()
 * with any status but OK; a call the library must refuse (NULL data under a non-empty tensor, a
 * claim past FA_MAX_EXTENT over a small buffer, an out that aliases an input, a scalar outside
 * its documented range) is refused; a call that returns OK on finite inputs writes finite
 * outputs. Buffers are exactly as large as the shapes and strides claim where the claim is
 * small, their gaps poisoned with NaN, so that a sanitizer sees any access out of bounds and the
 * finiteness check any read of a gap. A broken contract prints the case and aborts.
 */
#ifndef FA_FUZZ_CASE_H
#define FA_FUZZ_CASE_H

#include <stddef.h>
#include <stdint.h>

/* Random choices: from a splitmix64 stream, or from a byte string (libFuzzer), read front to
 * back and then as zeros. */
typedef struct fz_src {
    const uint8_t *bytes;
    size_t size, pos;
    uint64_t state;
} fz_src;

void fz_src_from_seed(fz_src *s, uint64_t seed);
void fz_src_from_bytes(fz_src *s, const uint8_t *bytes, size_t size);

/* Runs one case drawn from s; returns only when the contract held, with the number of calls
 * that returned OK. */
int fz_run_case(fz_src *s);

#endif /* FA_FUZZ_CASE_H */
