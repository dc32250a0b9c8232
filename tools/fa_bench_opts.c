/* Command-line options of `flashattn bench`. Every malformed option is reported by name. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "fa_bench.h"

void fa_bench_usage(FILE *f)
{
    fputs("usage: flashattn bench [options]\n"
          "\n"
          "Times fa_attention_forward on seeded random inputs, then checks the result against\n"
          "the double-precision oracle.\n"
          "\n"
          "shape:\n"
          "  -b, --batch N         sequences (default 1)\n"
          "  --heads N             query heads (default 16)\n"
          "  --kv-heads N          key/value heads, dividing --heads (default: --heads)\n"
          "  --seqlen N            queries and keys per sequence (default 1024)\n"
          "  --seqlen-q N          queries per sequence\n"
          "  --seqlen-k N          keys per sequence\n"
          "  --head-dim N          q/k head dimension (default 128)\n"
          "  --head-dim-v N        v/out head dimension (default: --head-dim)\n"
          "  --dtype T             fp32 | fp16 | bf16 | fp64 (default fp32)\n"
          "  --varlen              packed sequences of random lengths, same total tokens\n"
          "features:\n"
          "  --causal              causal mask, aligned to the bottom-right corner\n"
          "  --window L,R          local attention; -1 is unbounded on that side\n"
          "  --softcap X           X * tanh(s / X) on the scores\n"
          "  --alibi               ALiBi slopes 2^(-8 (i+1) / heads)\n"
          "  --sinks               one random sink logit per head\n"
          "  --dropout P           drop probability in [0, 1)\n"
          "run:\n"
          "  --device D            cpu | cuda[:N] (default cpu)\n"
          "  --threads N           CPU threads, 0 for the library's default (default 0)\n"
          "  --warmup N            untimed calls first (default 1)\n"
          "  --iters N             timed calls (default 3)\n"
          "  --seed N              seed of the inputs and of dropout (default 0)\n"
          "  --no-check            skip the comparison with the oracle\n"
          "  --bwd                 also time fa_attention_backward (2.5x the forward's FLOPs, as\n"
          "                        FlashAttention counts) and fwd+bwd; checks the gradients\n"
          "  -h, --help            this text\n"
          "  --decode              time fa_attention_kvcache on a decoding step instead, with\n"
          "                        its own options (flashattn bench --decode --help)\n"
          "\n"
          "FLOPs follow FlashAttention's benchmarks: 2 * h * (visible query-key pairs) * (d + dv),\n"
          "the pairs counted exactly from the mask. Exit status: 0 ok, 1 check failed or the\n"
          "library failed, 2 bad usage.\n",
          f);
}

/* The option being parsed: its name as typed, and the value given with '=' if any. */
typedef struct opt_cursor {
    int argc;
    char **argv;
    int i;
    const char *name;
    const char *inline_value;
} opt_cursor;

static int opt_is(opt_cursor *c, const char *long_name, const char *short_name)
{
    const char *arg = c->argv[c->i];
    if (short_name && strcmp(arg, short_name) == 0) {
        c->name = short_name;
        c->inline_value = NULL;
        return 1;
    }
    size_t n = strlen(long_name);
    if (strncmp(arg, long_name, n) != 0 || (arg[n] != '\0' && arg[n] != '='))
        return 0;
    c->name = long_name;
    c->inline_value = arg[n] == '=' ? arg + n + 1 : NULL;
    return 1;
}

/* The value of an option that takes one: after '=', or the next word. */
static const char *opt_value(opt_cursor *c)
{
    if (c->inline_value)
        return c->inline_value;
    if (c->i + 1 >= c->argc) {
        fprintf(stderr, "flashattn bench: option %s needs a value\n", c->name);
        return NULL;
    }
    return c->argv[++c->i];
}

static int flag_take(opt_cursor *c, int *dst)
{
    if (c->inline_value) {
        fprintf(stderr, "flashattn bench: option %s takes no value\n", c->name);
        return FA_EXIT_USAGE;
    }
    *dst = 1;
    return FA_EXIT_OK;
}

static int int_parse(const char *name, const char *s, int64_t lo, int64_t hi, int64_t *dst)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0') {
        fprintf(stderr, "flashattn bench: %s: '%s' is not an integer\n", name, s);
        return FA_EXIT_USAGE;
    }
    if (v < lo || v > hi) {
        fprintf(stderr, "flashattn bench: %s: %lld is outside [%lld, %lld]\n", name, v,
                (long long)lo, (long long)hi);
        return FA_EXIT_USAGE;
    }
    *dst = (int64_t)v;
    return FA_EXIT_OK;
}

static int int_take(opt_cursor *c, int64_t lo, int64_t hi, int64_t *dst)
{
    const char *s = opt_value(c);
    return s ? int_parse(c->name, s, lo, hi, dst) : FA_EXIT_USAGE;
}

/* lo <= value, and value < hi (hi_open) or value <= hi. */
static int double_take(opt_cursor *c, double lo, double hi, int hi_open, double *dst)
{
    const char *s = opt_value(c);
    if (!s)
        return FA_EXIT_USAGE;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno != 0 || end == s || *end != '\0' || !isfinite(v)) {
        fprintf(stderr, "flashattn bench: %s: '%s' is not a finite number\n", c->name, s);
        return FA_EXIT_USAGE;
    }
    if (v < lo || (hi_open ? v >= hi : v > hi)) {
        fprintf(stderr, "flashattn bench: %s: %g is outside [%g, %g%c\n", c->name, v, lo, hi,
                hi_open ? ')' : ']');
        return FA_EXIT_USAGE;
    }
    *dst = v;
    return FA_EXIT_OK;
}

static int dtype_take(opt_cursor *c, fa_dtype *dst)
{
    static const struct {
        const char *name;
        fa_dtype dtype;
    } names[] = {
        {"fp32", FA_DTYPE_F32}, {"f32", FA_DTYPE_F32}, {"float32", FA_DTYPE_F32},
        {"fp16", FA_DTYPE_F16}, {"f16", FA_DTYPE_F16}, {"float16", FA_DTYPE_F16},
        {"bf16", FA_DTYPE_BF16}, {"bfloat16", FA_DTYPE_BF16},
        {"fp64", FA_DTYPE_F64}, {"f64", FA_DTYPE_F64}, {"float64", FA_DTYPE_F64},
    };
    const char *s = opt_value(c);
    if (!s)
        return FA_EXIT_USAGE;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (strcmp(s, names[i].name) == 0) {
            *dst = names[i].dtype;
            return FA_EXIT_OK;
        }
    }
    fprintf(stderr, "flashattn bench: %s: '%s' is not one of fp32, fp16, bf16, fp64\n", c->name,
            s);
    return FA_EXIT_USAGE;
}

static int window_take(opt_cursor *c, fa_bench_config *cfg)
{
    const char *s = opt_value(c);
    if (!s)
        return FA_EXIT_USAGE;
    const char *comma = strchr(s, ',');
    if (!comma) {
        fprintf(stderr, "flashattn bench: %s: '%s' is not L,R (e.g. 256,0)\n", c->name, s);
        return FA_EXIT_USAGE;
    }
    char left[32];
    size_t n = (size_t)(comma - s);
    if (n >= sizeof left) {
        fprintf(stderr, "flashattn bench: %s: '%s' is not L,R (e.g. 256,0)\n", c->name, s);
        return FA_EXIT_USAGE;
    }
    memcpy(left, s, n);
    left[n] = '\0';
    /* The library takes int windows; a wider one is the same as unbounded anyway. */
    if (int_parse("--window L", left, -1, INT32_MAX, &cfg->window_left) != FA_EXIT_OK ||
        int_parse("--window R", comma + 1, -1, INT32_MAX, &cfg->window_right) != FA_EXIT_OK)
        return FA_EXIT_USAGE;
    return FA_EXIT_OK;
}

static int device_take(opt_cursor *c, int *dst)
{
    const char *s = opt_value(c);
    if (!s)
        return FA_EXIT_USAGE;
    if (strcmp(s, "cpu") == 0) {
        *dst = FA_DEVICE_CPU;
        return FA_EXIT_OK;
    }
    if (strcmp(s, "cuda") == 0) {
        *dst = 0;
        return FA_EXIT_OK;
    }
    if (strncmp(s, "cuda:", 5) == 0) {
        int64_t ordinal;
        if (int_parse("--device cuda:N", s + 5, 0, 1023, &ordinal) != FA_EXIT_OK)
            return FA_EXIT_USAGE;
        *dst = (int)ordinal;
        return FA_EXIT_OK;
    }
    fprintf(stderr, "flashattn bench: %s: '%s' is not cpu, cuda or cuda:N\n", c->name, s);
    return FA_EXIT_USAGE;
}

/* One option at c->i; FA_EXIT_OK, FA_EXIT_USAGE, or -1 for --help. */
static int option_parse(opt_cursor *c, fa_bench_config *cfg, int *seqlen_q_set,
                        int *seqlen_k_set)
{
    /* Sizes stay far below what would overflow the byte counts of the tensors. */
    const int64_t big = (int64_t)1 << 31;
    int64_t seqlen;
    int rc;

    if (opt_is(c, "--help", "-h"))
        return -1;
    if (opt_is(c, "--batch", "-b"))
        return int_take(c, 1, big, &cfg->batch);
    if (opt_is(c, "--heads", NULL))
        return int_take(c, 1, big, &cfg->heads);
    if (opt_is(c, "--kv-heads", NULL))
        return int_take(c, 1, big, &cfg->kv_heads);
    if (opt_is(c, "--seqlen", NULL)) {
        rc = int_take(c, 0, big, &seqlen);
        /* An explicit --seqlen-q / --seqlen-k wins whatever the order. */
        if (rc == FA_EXIT_OK && !*seqlen_q_set)
            cfg->seqlen_q = seqlen;
        if (rc == FA_EXIT_OK && !*seqlen_k_set)
            cfg->seqlen_k = seqlen;
        return rc;
    }
    if (opt_is(c, "--seqlen-q", NULL)) {
        *seqlen_q_set = 1;
        return int_take(c, 0, big, &cfg->seqlen_q);
    }
    if (opt_is(c, "--seqlen-k", NULL)) {
        *seqlen_k_set = 1;
        return int_take(c, 0, big, &cfg->seqlen_k);
    }
    if (opt_is(c, "--head-dim", NULL))
        return int_take(c, 1, 1 << 16, &cfg->head_dim);
    if (opt_is(c, "--head-dim-v", NULL))
        return int_take(c, 1, 1 << 16, &cfg->head_dim_v);
    if (opt_is(c, "--dtype", NULL))
        return dtype_take(c, &cfg->dtype);
    if (opt_is(c, "--causal", NULL))
        return flag_take(c, &cfg->causal);
    if (opt_is(c, "--window", NULL))
        return window_take(c, cfg);
    if (opt_is(c, "--softcap", NULL))
        return double_take(c, 0.0, 1e30, 0, &cfg->softcap);
    if (opt_is(c, "--alibi", NULL))
        return flag_take(c, &cfg->alibi);
    if (opt_is(c, "--sinks", NULL))
        return flag_take(c, &cfg->sinks);
    if (opt_is(c, "--dropout", NULL))
        return double_take(c, 0.0, 1.0, 1, &cfg->dropout_p);
    if (opt_is(c, "--varlen", NULL))
        return flag_take(c, &cfg->varlen);
    if (opt_is(c, "--threads", NULL))
        return int_take(c, 0, 1 << 16, &cfg->threads);
    if (opt_is(c, "--iters", NULL))
        return int_take(c, 1, big, &cfg->iters);
    if (opt_is(c, "--warmup", NULL))
        return int_take(c, 0, big, &cfg->warmup);
    if (opt_is(c, "--seed", NULL)) {
        const char *s = opt_value(c);
        char *end;
        if (!s)
            return FA_EXIT_USAGE;
        errno = 0;
        unsigned long long v = strtoull(s, &end, 0);
        if (errno != 0 || end == s || *end != '\0' || s[0] == '-') {
            fprintf(stderr, "flashattn bench: --seed: '%s' is not an unsigned integer\n", s);
            return FA_EXIT_USAGE;
        }
        cfg->seed = (uint64_t)v;
        return FA_EXIT_OK;
    }
    if (opt_is(c, "--no-check", NULL)) {
        int off = 0;
        rc = flag_take(c, &off);
        cfg->check = !off;
        return rc;
    }
    if (opt_is(c, "--device", NULL))
        return device_take(c, &cfg->device);
    if (opt_is(c, "--bwd", NULL))
        return flag_take(c, &cfg->bwd);
    fprintf(stderr, "flashattn bench: unknown option '%s' (flashattn bench --help lists them)\n",
            c->argv[c->i]);
    return FA_EXIT_USAGE;
}

int fa_bench_config_parse(int argc, char **argv, fa_bench_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->batch = 1;
    cfg->heads = 16;
    cfg->seqlen_q = cfg->seqlen_k = 1024;
    cfg->head_dim = 128;
    cfg->dtype = FA_DTYPE_F32;
    cfg->window_left = cfg->window_right = -1;
    cfg->warmup = 1;
    cfg->iters = 3;
    cfg->check = 1;
    cfg->device = FA_DEVICE_CPU;

    int seqlen_q_set = 0, seqlen_k_set = 0;
    opt_cursor c = {argc, argv, 0, NULL, NULL};
    for (; c.i < argc; c.i++) {
        int rc = option_parse(&c, cfg, &seqlen_q_set, &seqlen_k_set);
        if (rc != FA_EXIT_OK)
            return rc;
    }
    if (cfg->kv_heads == 0)
        cfg->kv_heads = cfg->heads;
    if (cfg->head_dim_v == 0)
        cfg->head_dim_v = cfg->head_dim;
    /* The library rejects the remaining bad combinations (h % hk, head_dim too large, dropout
     * with softcap) with a message naming the argument; the bench passes those on. */
    return FA_EXIT_OK;
}

/* Appends one space-separated word to dst[0..len), truncating rather than overflowing. */
__attribute__((format(printf, 4, 5))) static size_t word_append(char *dst, size_t size,
                                                                size_t len, const char *fmt, ...)
{
    if (len + 1 >= size)
        return len;
    if (len > 0)
        dst[len++] = ' ';
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(dst + len, size - len, fmt, ap);
    va_end(ap);
    len += n > 0 ? (size_t)n : 0;
    return len < size ? len : size - 1;
}

void fa_bench_features_format(const fa_bench_config *cfg, char *dst, size_t size)
{
    size_t len = 0;
    dst[0] = '\0';
    if (cfg->causal)
        len = word_append(dst, size, len, "causal");
    if (cfg->window_left >= 0 || cfg->window_right >= 0)
        len = word_append(dst, size, len, "window=(%lld,%lld)", (long long)cfg->window_left,
                          (long long)cfg->window_right);
    if (cfg->softcap > 0)
        len = word_append(dst, size, len, "softcap=%g", cfg->softcap);
    if (cfg->alibi)
        len = word_append(dst, size, len, "alibi");
    if (cfg->sinks)
        len = word_append(dst, size, len, "sinks");
    if (cfg->dropout_p > 0)
        len = word_append(dst, size, len, "dropout=%g", cfg->dropout_p);
    if (cfg->varlen)
        len = word_append(dst, size, len, "varlen");
    if (len == 0)
        snprintf(dst, size, "none");
}
