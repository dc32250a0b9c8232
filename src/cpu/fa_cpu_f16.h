/* fp16 rows widened to fp32 for the CPU kernels, with F16C where the CPU has it. */
#ifndef FA_CPU_F16_H
#define FA_CPU_F16_H

#include <stdint.h>

/* dst[i] = src[i] as fp32 for i < n, the same bits as fa_f16_to_f32 (NaNs made quiet). */
void fa_cpu_f16_to_f32_row(float *dst, const uint16_t *src, int64_t n);

#endif /* FA_CPU_F16_H */
