/* Per-thread error messages: a failing call records why, fa_last_error() reads it back. */
#include <stdarg.h>
#include <stdio.h>

#include "core/fa_error.h"

static _Thread_local char fa_error_text[512];

fa_status fa_error_set(fa_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(fa_error_text, sizeof fa_error_text, fmt, ap);
    va_end(ap);
    return status;
}

void fa_error_clear(void)
{
    fa_error_text[0] = '\0';
}

FA_API const char *fa_last_error(void)
{
    return fa_error_text;
}

FA_API const char *fa_status_string(fa_status status)
{
    switch (status) {
    case FA_STATUS_OK:
        return "ok";
    case FA_STATUS_INVALID_ARGUMENT:
        return "invalid argument";
    case FA_STATUS_UNSUPPORTED:
        return "unsupported";
    case FA_STATUS_OUT_OF_MEMORY:
        return "out of memory";
    case FA_STATUS_INTERNAL:
        return "internal error";
    }
    return "unknown status";
}
