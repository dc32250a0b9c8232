/* libFuzzer entry: the input bytes are the generator's choices (fa_fuzz_case.h). Built with
 * clang and -fsanitize=fuzzer when FA_LIBFUZZER is on. */
#include <stddef.h>
#include <stdint.h>

#include "fa_fuzz_case.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_src src;
    fz_src_from_bytes(&src, data, size);
    fz_run_case(&src);
    return 0;
}
