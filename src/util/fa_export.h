/* The export macro and the printf-format attribute, the lowest layer's only shared macros. */
#ifndef FA_EXPORT_H
#define FA_EXPORT_H

#define FA_API __attribute__((visibility("default")))

#if defined(__GNUC__)
#define FA_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define FA_PRINTF(a, b)
#endif

#endif /* FA_EXPORT_H */
