/*
 * Finding the CUDA driver and NVRTC at run time. Each is loaded once per process (pthread_once);
 * what was found, or why not, is kept as text for `flashattn info` and for error messages.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "core/fa_error.h"
#include "cuda/fa_cuda_driver.h"

#define FA_CUDA_MAX_DEVICES 64

static pthread_once_t fa_driver_once = PTHREAD_ONCE_INIT;
static pthread_once_t fa_nvrtc_once = PTHREAD_ONCE_INIT;
static fa_cuda_driver fa_driver_table;
static fa_nvrtc fa_nvrtc_table;
static int fa_driver_ok, fa_nvrtc_ok;
static int fa_device_count_value;
static char fa_driver_note[256];
static char fa_nvrtc_note[256];

/* Per-device facts read once; a device's arch never changes within a process. */
static pthread_mutex_t fa_arch_lock = PTHREAD_MUTEX_INITIALIZER;
static int fa_arch_cache[FA_CUDA_MAX_DEVICES];
static int fa_smem_cache[FA_CUDA_MAX_DEVICES];
static int fa_sms_cache[FA_CUDA_MAX_DEVICES];

/* dlsym into a function-pointer field; a missing symbol names itself in the note. */
#define FA_SYM(lib, table, field, name, note)                                                    \
    do {                                                                                         \
        void *sym_ = dlsym(lib, name);                                                           \
        if (!sym_) {                                                                             \
            snprintf(note, sizeof note, "%s lacks %s", #lib, name);                              \
            return 0;                                                                            \
        }                                                                                        \
        memcpy(&(table).field, &sym_, sizeof sym_);                                              \
    } while (0)

static int fa_driver_bind(void *libcuda)
{
    fa_cuda_driver *d = &fa_driver_table;
    FA_SYM(libcuda, *d, init, "cuInit", fa_driver_note);
    FA_SYM(libcuda, *d, driver_get_version, "cuDriverGetVersion", fa_driver_note);
    FA_SYM(libcuda, *d, device_get_count, "cuDeviceGetCount", fa_driver_note);
    FA_SYM(libcuda, *d, device_get, "cuDeviceGet", fa_driver_note);
    FA_SYM(libcuda, *d, device_get_name, "cuDeviceGetName", fa_driver_note);
    FA_SYM(libcuda, *d, device_get_attribute, "cuDeviceGetAttribute", fa_driver_note);
    FA_SYM(libcuda, *d, device_total_mem, "cuDeviceTotalMem_v2", fa_driver_note);
    FA_SYM(libcuda, *d, primary_ctx_retain, "cuDevicePrimaryCtxRetain", fa_driver_note);
    FA_SYM(libcuda, *d, ctx_get_current, "cuCtxGetCurrent", fa_driver_note);
    FA_SYM(libcuda, *d, ctx_get_device, "cuCtxGetDevice", fa_driver_note);
    FA_SYM(libcuda, *d, ctx_push, "cuCtxPushCurrent_v2", fa_driver_note);
    FA_SYM(libcuda, *d, ctx_pop, "cuCtxPopCurrent_v2", fa_driver_note);
    FA_SYM(libcuda, *d, module_load_data, "cuModuleLoadData", fa_driver_note);
    FA_SYM(libcuda, *d, module_get_function, "cuModuleGetFunction", fa_driver_note);
    FA_SYM(libcuda, *d, func_set_attribute, "cuFuncSetAttribute", fa_driver_note);
    FA_SYM(libcuda, *d, launch_kernel, "cuLaunchKernel", fa_driver_note);
    FA_SYM(libcuda, *d, stream_synchronize, "cuStreamSynchronize", fa_driver_note);
    FA_SYM(libcuda, *d, get_error_name, "cuGetErrorName", fa_driver_note);
    FA_SYM(libcuda, *d, get_error_string, "cuGetErrorString", fa_driver_note);
    FA_SYM(libcuda, *d, mem_host_alloc, "cuMemHostAlloc", fa_driver_note);
    FA_SYM(libcuda, *d, mem_free_host, "cuMemFreeHost", fa_driver_note);
    FA_SYM(libcuda, *d, mem_host_get_device_pointer, "cuMemHostGetDevicePointer_v2",
           fa_driver_note);
    FA_SYM(libcuda, *d, stream_query, "cuStreamQuery", fa_driver_note);
    FA_SYM(libcuda, *d, mem_alloc, "cuMemAlloc_v2", fa_driver_note);
    FA_SYM(libcuda, *d, mem_free, "cuMemFree_v2", fa_driver_note);
    FA_SYM(libcuda, *d, memcpy_htod, "cuMemcpyHtoD_v2", fa_driver_note);
    FA_SYM(libcuda, *d, memcpy_dtoh, "cuMemcpyDtoH_v2", fa_driver_note);
    FA_SYM(libcuda, *d, ctx_synchronize, "cuCtxSynchronize", fa_driver_note);
    FA_SYM(libcuda, *d, event_create, "cuEventCreate", fa_driver_note);
    FA_SYM(libcuda, *d, event_record, "cuEventRecord", fa_driver_note);
    FA_SYM(libcuda, *d, event_synchronize, "cuEventSynchronize", fa_driver_note);
    FA_SYM(libcuda, *d, event_elapsed_time, "cuEventElapsedTime", fa_driver_note);
    FA_SYM(libcuda, *d, event_destroy, "cuEventDestroy_v2", fa_driver_note);
    /* Optional: without it the plan keeps every case on the sm80 family. */
    void *tmap = dlsym(libcuda, "cuTensorMapEncodeTiled");
    if (tmap)
        memcpy(&d->tensor_map_encode_tiled, &tmap, sizeof tmap);
    void *launch_ex = dlsym(libcuda, "cuLaunchKernelEx");
    if (launch_ex)
        memcpy(&d->launch_kernel_ex, &launch_ex, sizeof launch_ex);
    return 1;
}

static void fa_driver_load(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        snprintf(fa_driver_note, sizeof fa_driver_note, "libcuda.so.1 not found (%s)",
                 why ? why : "dlopen failed");
        return;
    }
    if (!fa_driver_bind(lib))
        return;
    int version = 0;
    fa_cu_result r = fa_driver_table.init(0);
    if (r != 0) {
        const char *name = "?";
        fa_driver_table.get_error_name(r, &name);
        snprintf(fa_driver_note, sizeof fa_driver_note, "libcuda.so.1 found, cuInit failed: %s",
                 name);
        return;
    }
    fa_driver_table.driver_get_version(&version);
    if (fa_driver_table.device_get_count(&fa_device_count_value) != 0)
        fa_device_count_value = 0;
    if (fa_device_count_value > FA_CUDA_MAX_DEVICES)
        fa_device_count_value = FA_CUDA_MAX_DEVICES;
    snprintf(fa_driver_note, sizeof fa_driver_note, "libcuda.so.1 (driver API %d.%d), %d device%s",
             version / 1000, version % 1000 / 10, fa_device_count_value,
             fa_device_count_value == 1 ? "" : "s");
    fa_driver_ok = 1;
}

static int fa_nvrtc_bind(void *lib)
{
    fa_nvrtc *n = &fa_nvrtc_table;
    FA_SYM(lib, *n, version, "nvrtcVersion", fa_nvrtc_note);
    FA_SYM(lib, *n, create_program, "nvrtcCreateProgram", fa_nvrtc_note);
    FA_SYM(lib, *n, compile_program, "nvrtcCompileProgram", fa_nvrtc_note);
    FA_SYM(lib, *n, get_program_log_size, "nvrtcGetProgramLogSize", fa_nvrtc_note);
    FA_SYM(lib, *n, get_program_log, "nvrtcGetProgramLog", fa_nvrtc_note);
    FA_SYM(lib, *n, get_cubin_size, "nvrtcGetCUBINSize", fa_nvrtc_note);
    FA_SYM(lib, *n, get_cubin, "nvrtcGetCUBIN", fa_nvrtc_note);
    FA_SYM(lib, *n, destroy_program, "nvrtcDestroyProgram", fa_nvrtc_note);
    FA_SYM(lib, *n, get_error_string, "nvrtcGetErrorString", fa_nvrtc_note);
    return 1;
}

static void fa_nvrtc_load(void)
{
    /* Newest first; the unversioned name last, since it only exists with a toolkit's dev files. */
    static const char *const names[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};
    void *lib = NULL;
    size_t i;
    for (i = 0; i < sizeof names / sizeof names[0] && !lib; i++)
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(fa_nvrtc_note, sizeof fa_nvrtc_note,
                 "libnvrtc not found (tried libnvrtc.so.13, .so.12, .so)");
        return;
    }
    if (!fa_nvrtc_bind(lib))
        return;
    snprintf(fa_nvrtc_table.soname, sizeof fa_nvrtc_table.soname, "%s", names[i - 1]);
    if (fa_nvrtc_table.version(&fa_nvrtc_table.major, &fa_nvrtc_table.minor) != 0) {
        snprintf(fa_nvrtc_note, sizeof fa_nvrtc_note, "%s found, nvrtcVersion failed",
                 names[i - 1]);
        return;
    }
    snprintf(fa_nvrtc_note, sizeof fa_nvrtc_note, "%s (NVRTC %d.%d)", names[i - 1],
             fa_nvrtc_table.major, fa_nvrtc_table.minor);
    fa_nvrtc_ok = 1;
}

const fa_cuda_driver *fa_cuda_driver_get(void)
{
    pthread_once(&fa_driver_once, fa_driver_load);
    return fa_driver_ok ? &fa_driver_table : NULL;
}

const fa_nvrtc *fa_nvrtc_get(void)
{
    pthread_once(&fa_nvrtc_once, fa_nvrtc_load);
    return fa_nvrtc_ok ? &fa_nvrtc_table : NULL;
}

fa_status fa_cuda_error(fa_cu_result r, const char *what)
{
    const char *name = "CUDA_ERROR_UNKNOWN", *text = "";
    if (fa_driver_ok) {
        fa_driver_table.get_error_name(r, &name);
        fa_driver_table.get_error_string(r, &text);
    }
    /* 2 is CUDA_ERROR_OUT_OF_MEMORY */
    return fa_error_set(r == 2 ? FA_STATUS_OUT_OF_MEMORY : FA_STATUS_INTERNAL, "%s: %s (%s)", what,
                        name ? name : "?", text ? text : "");
}

static fa_status fa_cuda_device_check(int device)
{
    if (!fa_cuda_driver_get())
        return fa_error_set(FA_STATUS_UNSUPPORTED, "device: CUDA device %d requested, but %s",
                            device, fa_driver_note);
    if (device < 0 || device >= fa_device_count_value)
        return fa_error_set(FA_STATUS_UNSUPPORTED,
                            "device: CUDA device %d requested, but %d device%s present", device,
                            fa_device_count_value, fa_device_count_value == 1 ? " is" : "s are");
    return FA_STATUS_OK;
}

fa_status fa_cuda_context_enter(int device, fa_cu_context *ctx, int *pushed)
{
    fa_status st = fa_cuda_device_check(device);
    if (st != FA_STATUS_OK)
        return st;
    const fa_cuda_driver *d = &fa_driver_table;
    fa_cu_context cur = NULL;
    fa_cu_device cur_dev = -1;
    *pushed = 0;
    if (d->ctx_get_current(&cur) == 0 && cur && d->ctx_get_device(&cur_dev) == 0 &&
        cur_dev == device) {
        *ctx = cur;
        return FA_STATUS_OK;
    }
    fa_cu_device dev;
    fa_cu_result r = d->device_get(&dev, device);
    if (r == 0)
        r = d->primary_ctx_retain(ctx, dev);
    if (r == 0)
        r = d->ctx_push(*ctx);
    if (r != 0)
        return fa_cuda_error(r, "making the primary context of the device current");
    *pushed = 1;
    return FA_STATUS_OK;
}

void fa_cuda_context_leave(int pushed)
{
    fa_cu_context ctx;
    if (pushed)
        fa_driver_table.ctx_pop(&ctx);
}

fa_status fa_cuda_device_arch(int device, int *arch, int *smem_optin)
{
    fa_status st = fa_cuda_device_check(device);
    if (st != FA_STATUS_OK)
        return st;
    pthread_mutex_lock(&fa_arch_lock);
    if (!fa_arch_cache[device]) {
        const fa_cuda_driver *d = &fa_driver_table;
        fa_cu_device dev;
        int major = 0, minor = 0, smem = 0, sms = 0;
        fa_cu_result r = d->device_get(&dev, device);
        if (r == 0)
            r = d->device_get_attribute(&major, FA_CU_ATTR_CC_MAJOR, dev);
        if (r == 0)
            r = d->device_get_attribute(&sms, FA_CU_ATTR_MULTIPROCESSOR_COUNT, dev);
        if (r == 0)
            r = d->device_get_attribute(&minor, FA_CU_ATTR_CC_MINOR, dev);
        if (r == 0)
            r = d->device_get_attribute(&smem, FA_CU_ATTR_MAX_SMEM_PER_BLOCK_OPTIN, dev);
        if (r != 0) {
            pthread_mutex_unlock(&fa_arch_lock);
            return fa_cuda_error(r, "reading the device's compute capability");
        }
        fa_smem_cache[device] = smem;
        fa_sms_cache[device] = sms;
        fa_arch_cache[device] = major * 10 + minor;
    }
    *arch = fa_arch_cache[device];
    *smem_optin = fa_smem_cache[device];
    pthread_mutex_unlock(&fa_arch_lock);
    return FA_STATUS_OK;
}

int fa_cuda_device_sms(int device)
{
    int arch, smem;
    if (fa_cuda_device_arch(device, &arch, &smem) != FA_STATUS_OK)
        return 0;
    pthread_mutex_lock(&fa_arch_lock);
    int sms = fa_sms_cache[device];
    pthread_mutex_unlock(&fa_arch_lock);
    return sms;
}

/* The public face: device count, device facts, and what was found. */

FA_API int fa_cuda_device_count(void)
{
    return fa_cuda_driver_get() && fa_nvrtc_get() ? fa_device_count_value : 0;
}

FA_API fa_status fa_cuda_device_info_get(int device, fa_cuda_device_info *info)
{
    if (!info)
        return fa_error_set(FA_STATUS_INVALID_ARGUMENT, "info: NULL");
    memset(info, 0, sizeof *info);
    int smem = 0;
    fa_status st = fa_cuda_device_arch(device, &info->arch, &smem);
    if (st != FA_STATUS_OK)
        return st;
    const fa_cuda_driver *d = &fa_driver_table;
    fa_cu_device dev;
    fa_cu_result r = d->device_get(&dev, device);
    if (r == 0)
        r = d->device_get_name(info->name, (int)sizeof info->name, dev);
    if (r == 0)
        r = d->device_get_attribute(&info->multiprocessors, FA_CU_ATTR_MULTIPROCESSOR_COUNT, dev);
    if (r == 0)
        r = d->device_total_mem(&info->total_memory, dev);
    if (r != 0)
        return fa_cuda_error(r, "reading the device's properties");
    info->max_smem_per_block = smem;
    fa_error_clear();
    return FA_STATUS_OK;
}

FA_API const char *fa_cuda_status(void)
{
    static char text[640];
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    int driver = fa_cuda_driver_get() != NULL, nvrtc = fa_nvrtc_get() != NULL;
    const char *verdict = !driver                     ? "no driver: CPU only"
                          : !nvrtc                    ? "no NVRTC to compile kernels: CPU only"
                          : fa_device_count_value == 0 ? "no CUDA device: CPU only"
                                                      : "available";
    pthread_mutex_lock(&lock);
    snprintf(text, sizeof text, "driver: %s\nnvrtc:  %s\ncuda:   %s", fa_driver_note,
             fa_nvrtc_note, verdict);
    pthread_mutex_unlock(&lock);
    return text;
}
