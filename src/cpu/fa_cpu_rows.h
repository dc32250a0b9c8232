/*
 * Row loads and stores between a tensor of any dtype and the kernels' compute precision.
 * Included once per precision, with FA_REAL and FA_FN(name) defined (see fa_cpu_kernel.h).
 * Loads take fp8 too (the KV cache's fp8 caches), exactly as fa_fp8_to_f32 converts.
 */
#include "cpu/fa_cpu_fp8_vec.h"

FA_CPU_INLINE void FA_FN(fa_load_row)(FA_REAL *dst, const void *base, int64_t offset, int64_t n,
                                      fa_dtype dtype)
{
    switch (dtype) {
    case FA_DTYPE_F32: {
        const float *src = (const float *)base + offset;
        for (int64_t i = 0; i < n; i++)
            dst[i] = (FA_REAL)src[i];
        break;
    }
    case FA_DTYPE_F16: {
        const uint16_t *src = (const uint16_t *)base + offset;
        if (sizeof(FA_REAL) == sizeof(float)) {
            fa_cpu_f16_to_f32_row((float *)dst, src, n);
            break;
        }
        for (int64_t i = 0; i < n; i++)
            dst[i] = (FA_REAL)fa_f16_to_f32_lanes(src[i]);
        break;
    }
    case FA_DTYPE_BF16: {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++)
            dst[i] = (FA_REAL)fa_bf16_to_f32(src[i]);
        break;
    }
    case FA_DTYPE_F64: {
        const double *src = (const double *)base + offset;
        for (int64_t i = 0; i < n; i++)
            dst[i] = (FA_REAL)src[i];
        break;
    }
    case FA_DTYPE_F8E4M3:
    case FA_DTYPE_F8E5M2: {
        const uint8_t *src = (const uint8_t *)base + offset;
        const int e4m3 = dtype == FA_DTYPE_F8E4M3;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            fa_f32x16 w;
            fa_fp8_widen16(&w, src + i, e4m3);
            for (int l = 0; l < 16; l++)
                dst[i + l] = (FA_REAL)w[l];
        }
        for (; i < n; i++)
            dst[i] = (FA_REAL)(e4m3 ? fa_e4m3_to_f32(src[i]) : fa_e5m2_to_f32(src[i]));
        break;
    }
    default:
        break;
    }
}

FA_CPU_INLINE void FA_FN(fa_store_row)(void *base, int64_t offset, const FA_REAL *src,
                                       FA_REAL scale, int64_t n, fa_dtype dtype)
{
    switch (dtype) {
    case FA_DTYPE_F32: {
        float *dst = (float *)base + offset;
        for (int64_t i = 0; i < n; i++)
            dst[i] = (float)(src[i] * scale);
        break;
    }
    case FA_DTYPE_F16: {
        uint16_t *dst = (uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++)
            dst[i] = fa_f32_to_f16((float)(src[i] * scale));
        break;
    }
    case FA_DTYPE_BF16: {
        uint16_t *dst = (uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++)
            dst[i] = fa_f32_to_bf16((float)(src[i] * scale));
        break;
    }
    case FA_DTYPE_F64: {
        double *dst = (double *)base + offset;
        for (int64_t i = 0; i < n; i++)
            dst[i] = (double)(src[i] * scale);
        break;
    }
    default:
        break;
    }
}
