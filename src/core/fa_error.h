/* Error reporting: a failing call records why on its thread, fa_last_error() reads it back. */
#ifndef FA_ERROR_H
#define FA_ERROR_H

#include "flashattn.h"
#include "util/fa_export.h"

/* Records the message for fa_last_error() on this thread and returns status. */
fa_status fa_error_set(fa_status status, const char *fmt, ...) FA_PRINTF(2, 3);
void fa_error_clear(void);

#define FA_BAD(...) fa_error_set(FA_STATUS_INVALID_ARGUMENT, __VA_ARGS__)

#define FA_TRY(expr)                                                                             \
    do {                                                                                         \
        fa_status fa_try_status_ = (expr);                                                       \
        if (fa_try_status_ != FA_STATUS_OK)                                                      \
            return fa_try_status_;                                                               \
    } while (0)

#endif /* FA_ERROR_H */
