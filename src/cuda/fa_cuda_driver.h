/*
 * The CUDA driver and NVRTC as the library sees them: loaded with dlopen at run time, so the
 * library builds without a CUDA toolkit and runs CPU-only where they are absent. Only the entry
 * points the library uses are declared, with the driver's ABI types spelled out here.
 */
#ifndef FA_CUDA_DRIVER_H
#define FA_CUDA_DRIVER_H

#include <stddef.h>

#include "flashattn.h"

typedef int fa_cu_result; /* CUresult; 0 is success */
typedef int fa_cu_device;
typedef struct fa_cu_ctx_st *fa_cu_context;
typedef struct fa_cu_mod_st *fa_cu_module;
typedef struct fa_cu_func_st *fa_cu_function;
typedef struct fa_cu_stream_st *fa_cu_stream;
typedef struct fa_cu_event_st *fa_cu_event;
typedef unsigned long long fa_cu_deviceptr;
typedef int fa_nvrtc_result; /* nvrtcResult; 0 is success */
#define FA_NVRTC_INVALID_OPTION 5 /* NVRTC_ERROR_INVALID_OPTION */
/* CUtensorMap: 128 opaque bytes, 64-byte aligned. */
typedef struct fa_cu_tensor_map {
    _Alignas(64) unsigned long long opaque[16];
} fa_cu_tensor_map;
typedef struct fa_nvrtc_prog_st *fa_nvrtc_program;

/* Driver enum values the library passes (from the driver API's stable ABI). */
#define FA_CU_ATTR_MULTIPROCESSOR_COUNT 16
#define FA_CU_ATTR_CC_MAJOR 75
#define FA_CU_ATTR_CC_MINOR 76
#define FA_CU_ATTR_MAX_SMEM_PER_BLOCK_OPTIN 97
#define FA_CU_FUNC_ATTR_MAX_DYNAMIC_SMEM 8
#define FA_CU_FUNC_ATTR_NON_PORTABLE_CLUSTER 14 /* clusters above 8 CTAs allowed */
#define FA_CU_TENSOR_MAP_FLOAT16 6
#define FA_CU_TENSOR_MAP_BFLOAT16 9
#define FA_CU_TENSOR_MAP_SWIZZLE_128B 3
#define FA_CU_TENSOR_MAP_L2_PROMOTION_128B 2

/* CUlaunchAttribute and CUlaunchConfig (cuLaunchKernelEx), as cuda.h lays them out. */
typedef struct fa_cu_launch_attr {
    int id;
    char pad_[4];
    union {
        char bytes[64];
        int value;
        unsigned cluster[3];
        void *align_;
    } value;
} fa_cu_launch_attr;
typedef struct fa_cu_launch_config {
    unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, smem;
    fa_cu_stream stream;
    fa_cu_launch_attr *attrs;
    unsigned num_attrs;
} fa_cu_launch_config;
/* CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: the kernel may start before the one
 * ahead of it in the stream has finished; it waits for it with griddepcontrol.wait. */
#define FA_CU_LAUNCH_ATTR_PROGRAMMATIC_SERIALIZATION 6
/* CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION: value.cluster holds the cluster's x, y, z in CTAs. */
#define FA_CU_LAUNCH_ATTR_CLUSTER_DIMENSION 4

typedef struct fa_cuda_driver {
    fa_cu_result (*init)(unsigned flags);
    fa_cu_result (*driver_get_version)(int *version);
    fa_cu_result (*device_get_count)(int *count);
    fa_cu_result (*device_get)(fa_cu_device *dev, int ordinal);
    fa_cu_result (*device_get_name)(char *name, int len, fa_cu_device dev);
    fa_cu_result (*device_get_attribute)(int *value, int attr, fa_cu_device dev);
    fa_cu_result (*device_total_mem)(size_t *bytes, fa_cu_device dev);
    fa_cu_result (*primary_ctx_retain)(fa_cu_context *ctx, fa_cu_device dev);
    fa_cu_result (*ctx_get_current)(fa_cu_context *ctx);
    fa_cu_result (*ctx_get_device)(fa_cu_device *dev);
    fa_cu_result (*ctx_push)(fa_cu_context ctx);
    fa_cu_result (*ctx_pop)(fa_cu_context *ctx);
    fa_cu_result (*module_load_data)(fa_cu_module *mod, const void *image);
    fa_cu_result (*module_get_function)(fa_cu_function *fn, fa_cu_module mod, const char *name);
    fa_cu_result (*func_set_attribute)(fa_cu_function fn, int attr, int value);
    fa_cu_result (*launch_kernel)(fa_cu_function fn, unsigned gx, unsigned gy, unsigned gz,
                                  unsigned bx, unsigned by, unsigned bz, unsigned smem,
                                  fa_cu_stream stream, void **params, void **extra);
    fa_cu_result (*stream_synchronize)(fa_cu_stream stream);
    fa_cu_result (*get_error_name)(fa_cu_result r, const char **s);
    fa_cu_result (*get_error_string)(fa_cu_result r, const char **s);
    /* The paged capacity check's report, written by the kernels into pinned host memory
     * (src/cuda/fa_cuda_decode.c). */
    fa_cu_result (*mem_host_alloc)(void **p, size_t bytes, unsigned flags);
    fa_cu_result (*mem_free_host)(void *p);
    fa_cu_result (*mem_host_get_device_pointer)(fa_cu_deviceptr *dptr, void *p, unsigned flags);
    fa_cu_result (*stream_query)(fa_cu_stream stream);
    /* Used by the tests and benchmarks, not by the library's own calls. */
    fa_cu_result (*mem_alloc)(fa_cu_deviceptr *p, size_t bytes);
    fa_cu_result (*mem_free)(fa_cu_deviceptr p);
    fa_cu_result (*memcpy_htod)(fa_cu_deviceptr dst, const void *src, size_t bytes);
    fa_cu_result (*memcpy_dtoh)(void *dst, fa_cu_deviceptr src, size_t bytes);
    fa_cu_result (*ctx_synchronize)(void);
    fa_cu_result (*event_create)(fa_cu_event *ev, unsigned flags);
    fa_cu_result (*event_record)(fa_cu_event ev, fa_cu_stream stream);
    fa_cu_result (*event_synchronize)(fa_cu_event ev);
    fa_cu_result (*event_elapsed_time)(float *ms, fa_cu_event start, fa_cu_event end);
    fa_cu_result (*event_destroy)(fa_cu_event ev);
    /* cuTensorMapEncodeTiled (CUDA 12+); NULL on older drivers, which then never get the sm90
     * family. Arguments: map, data type, rank, address, dims, byte strides (rank - 1), box,
     * element strides, interleave, swizzle, L2 promotion, OOB fill. */
    fa_cu_result (*tensor_map_encode_tiled)(fa_cu_tensor_map *map, int dtype, unsigned rank,
                                            void *addr, const unsigned long long *dims,
                                            const unsigned long long *strides,
                                            const unsigned *box, const unsigned *elem_strides,
                                            int interleave, int swizzle, int l2_promotion,
                                            int oob_fill);
    /* cuLaunchKernelEx (CUDA 12+); NULL on older drivers, whose launches then never overlap. */
    fa_cu_result (*launch_kernel_ex)(const fa_cu_launch_config *config, fa_cu_function fn,
                                     void **params, void **extra);
} fa_cuda_driver;

typedef struct fa_nvrtc {
    fa_nvrtc_result (*version)(int *major, int *minor);
    fa_nvrtc_result (*create_program)(fa_nvrtc_program *prog, const char *src, const char *name,
                                      int num_headers, const char *const *headers,
                                      const char *const *include_names);
    fa_nvrtc_result (*compile_program)(fa_nvrtc_program prog, int num_options,
                                       const char *const *options);
    fa_nvrtc_result (*get_program_log_size)(fa_nvrtc_program prog, size_t *size);
    fa_nvrtc_result (*get_program_log)(fa_nvrtc_program prog, char *log);
    fa_nvrtc_result (*get_cubin_size)(fa_nvrtc_program prog, size_t *size);
    fa_nvrtc_result (*get_cubin)(fa_nvrtc_program prog, char *cubin);
    fa_nvrtc_result (*destroy_program)(fa_nvrtc_program *prog);
    const char *(*get_error_string)(fa_nvrtc_result r);
    int major, minor;
    char soname[32]; /* the library that was loaded */
} fa_nvrtc;

/* The driver with cuInit done, or NULL (fa_cuda_status says why). Thread-safe, loads once. */
const fa_cuda_driver *fa_cuda_driver_get(void);
/* NVRTC, or NULL. Needs no driver and no GPU. */
const fa_nvrtc *fa_nvrtc_get(void);

/* Records "what: CUDA_ERROR_X (text)" for fa_last_error() and returns FA_STATUS_INTERNAL, or
 * FA_STATUS_OUT_OF_MEMORY for an allocation failure. */
fa_status fa_cuda_error(fa_cu_result r, const char *what);

/*
 * Makes a context of `device` current for the calling thread: the caller's own when its current
 * context is on that device, else the device's primary context (the one PyTorch and the runtime
 * API use), pushed. *pushed tells fa_cuda_context_leave whether to pop it.
 */
fa_status fa_cuda_context_enter(int device, fa_cu_context *ctx, int *pushed);
void fa_cuda_context_leave(int pushed);

/* The compute capability of device as 10 * major + minor (cached per device). */
fa_status fa_cuda_device_arch(int device, int *arch, int *smem_optin);

/* The device's multiprocessor count (cached with the arch), 0 where it cannot be read. */
int fa_cuda_device_sms(int device);

#endif /* FA_CUDA_DRIVER_H */
