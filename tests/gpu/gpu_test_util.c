/* The GPU tests' shared helpers (gpu_test_util.h). */
#include "gpu_test_util.h"

#include <string.h>

#include "core/fa_fp8.h"
#include "util/fa_half.h"

const fa_cuda_driver *gu_drv;

int gu_start(const char *test, uint64_t seed)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (fa_cuda_device_count() == 0) {
        printf("%s: skipped, no usable CUDA device\n%s\n", test, fa_cuda_status());
        return 77;
    }
    gu_drv = fa_cuda_driver_get();
    gu_seed(seed);
    fa_cu_context ctx;
    int pushed;
    if (fa_cuda_context_enter(0, &ctx, &pushed) != FA_STATUS_OK) {
        fprintf(stderr, "%s: no context: %s\n", test, fa_last_error());
        return 1;
    }
    return 0;
}

static uint64_t gu_state;

void gu_seed(uint64_t seed) { gu_state = seed; }

double gu_uniform(double lo, double hi)
{
    gu_state += 0x9e3779b97f4a7c15ull;
    uint64_t z = gu_state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return lo + (hi - lo) * (double)(z >> 11) / 9007199254740992.0;
}

gpu_buf gu_buf_new(fa_dtype dt, int ndim, const int64_t *shape, int pad)
{
    gpu_buf g;
    int64_t stride[4];
    stride[ndim - 1] = 1;
    for (int i = ndim - 2; i >= 0; i--)
        stride[i] = stride[i + 1] * shape[i + 1] + (i == ndim - 2 ? pad : 0);
    g.bytes = (size_t)(shape[0] * stride[0]) * fa_dtype_size(dt);
    if (g.bytes == 0)
        g.bytes = 16;
    void *h = malloc(g.bytes);
    memset(h, 0xff, g.bytes);
    fa_cu_deviceptr d;
    CHECK_CU(gu_drv->mem_alloc(&d, g.bytes));
    g.host = fa_tensor_make(h, dt, ndim, shape, stride);
    g.dev = fa_tensor_make((void *)(uintptr_t)d, dt, ndim, shape, stride);
    return g;
}

void gu_buf_free(gpu_buf *g)
{
    free(g->host.data);
    gu_drv->mem_free((fa_cu_deviceptr)(uintptr_t)g->dev.data);
}

void gu_buf_upload(gpu_buf *g)
{
    CHECK_CU(gu_drv->memcpy_htod((fa_cu_deviceptr)(uintptr_t)g->dev.data, g->host.data,
                                 g->bytes));
}

void gu_buf_poison_device(gpu_buf *g)
{
    void *nan = malloc(g->bytes);
    memset(nan, 0xff, g->bytes);
    CHECK_CU(gu_drv->memcpy_htod((fa_cu_deviceptr)(uintptr_t)g->dev.data, nan, g->bytes));
    free(nan);
}

void *gu_buf_download(const gpu_buf *g)
{
    void *h = malloc(g->bytes);
    CHECK_CU(gu_drv->memcpy_dtoh(h, (fa_cu_deviceptr)(uintptr_t)g->dev.data, g->bytes));
    return h;
}

double gu_elem_load(const void *base, fa_dtype dt, int64_t at)
{
    switch (dt) {
    case FA_DTYPE_F16:
        return fa_f16_to_f32(((const uint16_t *)base)[at]);
    case FA_DTYPE_BF16:
        return fa_bf16_to_f32(((const uint16_t *)base)[at]);
    case FA_DTYPE_F32:
        return ((const float *)base)[at];
    default:
        return ((const int32_t *)base)[at];
    }
}

void gu_fill_uniform(gpu_buf *g, double lo, double hi)
{
    fa_tensor *t = &g->host;
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    for (int64_t e = 0; e < n; e++) {
        int64_t rem = e, at = 0;
        for (int i = t->ndim - 1; i >= 0; i--) {
            at += (rem % t->shape[i]) * t->stride[i];
            rem /= t->shape[i];
        }
        float x = (float)gu_uniform(lo, hi);
        if (t->dtype == FA_DTYPE_F16)
            ((uint16_t *)t->data)[at] = fa_f32_to_f16(x);
        else if (t->dtype == FA_DTYPE_BF16)
            ((uint16_t *)t->data)[at] = fa_f32_to_bf16(x);
        else if (t->dtype == FA_DTYPE_F8E4M3)
            ((uint8_t *)t->data)[at] = fa_f32_to_e4m3(x);
        else
            ((float *)t->data)[at] = x;
    }
}

#define GU_MAX_SHARDS 256

int gu_only(const char *name)
{
    const char *only = getenv("FA_TEST_ONLY");
    if (!only || !*only)
        return 1;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", only);
    for (char *part = strtok(buf, "|"); part; part = strtok(NULL, "|"))
        if (strstr(name, part))
            return 1;
    return 0;
}

int gu_shard_take(double cost)
{
    static double load[GU_MAX_SHARDS];
    int shard, shards;
    const char *sh = getenv("FA_TEST_SHARD");
    if (!sh || sscanf(sh, "%d/%d", &shard, &shards) != 2 || shards <= 0)
        return 1;
    if (shards > GU_MAX_SHARDS)
        shards = GU_MAX_SHARDS;
    int least = 0;
    for (int i = 1; i < shards; i++)
        if (load[i] < load[least])
            least = i;
    load[least] += cost;
    return least == shard;
}

double gu_attn_cost(int b, int h, int sq, int sk, int d, int dv, int causal)
{
    return (double)b * h * sq * sk * (d + dv) * (causal ? 0.5 : 1.0) + 1e8;
}
