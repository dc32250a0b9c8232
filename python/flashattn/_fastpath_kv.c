/*
 * flashattn._fastpath's kvcache(): flash_attn_with_kvcache's torch call done in C, a cache in
 * front of its Python route (_route.kvcache_any -> _torch_kvcache.kvcache_call -> _cached). A
 * decoding step's attention can take less time than the Python that prepares it.
 *
 * A plain eager call without gradients, whose tensors are torch.Tensor or None (cache_seqlens
 * a tensor or None) and whose signature _cached.kvcache_torch has prepared, runs here: the key
 * (_cached._kvcache_key) built item for item, the prepared call found in _cached's per-thread
 * cache, new outputs and split workspace, the data pointers, stream and capture flag written
 * into the prepared arguments, the library called without the GIL (it validates every call
 * itself, the values in cache_seqlens included). Every other call goes to the fallback,
 * _route.kvcache_any, which also prepares the signature for the next call.
 *
 * The argument positions and the prepared call's fields come from bind() by name
 * (_route.KV_ARGS, _cached.KV_FIELDS).
 */
#include "_fastpath.h"

#include <string.h>

/* flash_attn_with_kvcache's arguments: first the 15 tensors in the signature's order
 * (_cached._kvcache_key, the fp8 caches' descales last), then the options. */
enum kv_arg {
    KA_Q, KA_K_CACHE, KA_V_CACHE, KA_K, KA_V, KA_COS, KA_SIN, KA_SEQLENS, KA_BATCH_IDX,
    KA_LEFTPAD, KA_BLOCK_TABLE, KA_ALIBI, KA_SINK, KA_K_DESCALE, KA_V_DESCALE, KA_TENSORS,
    KA_SCALE = KA_TENSORS, KA_CAUSAL, KA_WINDOW, KA_SOFTCAP, KA_INTERLEAVED, KA_SPLITS,
    KA_WANT_LSE, KA_NUM
};
static const char *const kv_arg_names[KA_NUM] = {
    "q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
    "cache_batch_idx", "cache_leftpad", "block_table", "alibi_slopes", "learnable_sink",
    "k_descale", "v_descale", "softmax_scale", "causal", "window_size", "softcap",
    "rotary_interleaved", "num_splits", "return_softmax_lse"};

/* The prepared call's C side (_cached._CachedKvcache.fast, int64 each): the entry point and
 * its fa_kvcache_args, the data field of each tensor's FaTensor (the 15 inputs, out and lse;
 * 0 where absent), the args' lse field and the FaTensor it points to with an lse, the fields
 * written per call (stream and skip_capacity_check on CUDA, workspace where the call splits;
 * 0 where unused), the device (-1: CPU) and whether the cache is paged. */
#define KF_SLOTS (KA_TENSORS + 2)
enum kv_field {
    KF_FN, KF_ARGS, KF_SLOT0, KF_LSE_FIELD = KF_SLOT0 + KF_SLOTS, KF_LSE_REF, KF_STREAM,
    KF_WORKSPACE, KF_SKIP_CHECK, KF_DEVICE, KF_PAGED, KF_NUM
};
static const char *const kv_field_names[KF_NUM] = {
    "fn", "args", "q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin",
    "cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table", "alibi_slopes",
    "learnable_sink", "k_descale", "v_descale", "out", "lse", "lse_field", "lse_ref", "stream",
    "workspace", "skip_check", "device", "paged"};

static struct {
    PyObject *fallback;           /* _route.kvcache_any: every call kvcache() does not serve */
    PyObject *capturing;          /* torch.cuda.is_current_stream_capturing, or None */
    Py_ssize_t at[KA_NUM], count; /* kvcache()'s arguments */
    Py_ssize_t field_at[KF_NUM], field_count;
    PyObject *tag, *str_likes; /* "kv", "likes" */
} kv;

int fp_kv_bind(PyObject *table)
{
    PyObject *fallback = fp_entry(table, "kv_fallback");
    PyObject *capturing = fallback ? fp_entry(table, "capturing") : NULL;
    if (!capturing ||
        fp_positions(fp_entry(table, "kv_args"), kv_arg_names, KA_NUM, (1 << KA_NUM) - 1, kv.at,
                     &kv.count) != 0 ||
        fp_positions(fp_entry(table, "kv_fields"), kv_field_names, KF_NUM, (1 << KF_NUM) - 1,
                     kv.field_at, &kv.field_count) != 0)
        return -1;
    if (kv.field_count != KF_NUM) {
        PyErr_Format(PyExc_ValueError, "flashattn._fastpath.bind: kv_fields: %d names",
                     (int)KF_NUM);
        return -1;
    }
    if (!(kv.tag = PyUnicode_InternFromString("kv")) ||
        !(kv.str_likes = PyUnicode_InternFromString("likes")))
        return -1;
    Py_INCREF(fallback);
    Py_INCREF(capturing);
    kv.fallback = fallback;
    kv.capturing = capturing;
    return 0;
}

/* The checks of _torch_kvcache.kvcache_call's eager step that need no tensor attribute: 1 if the
 * arguments are plain (tensors exact torch.Tensor or None, options of their plain types),
 * else 0. */
static int kv_plain_arguments(PyObject *const *a)
{
    for (int i = 0; i < KA_TENSORS; i++) {
        const int required = i <= KA_V_CACHE;
        if ((required || a[i] != Py_None) && (PyObject *)Py_TYPE(a[i]) != fp_t.tensor_type)
            return 0;
    }
    return (a[KA_SCALE] == Py_None || fp_is_scalar(a[KA_SCALE])) && PyBool_Check(a[KA_CAUSAL]) &&
           fp_is_scalar(a[KA_SOFTCAP]) && PyBool_Check(a[KA_INTERLEAVED]) &&
           PyLong_CheckExact(a[KA_SPLITS]) && PyBool_Check(a[KA_WANT_LSE]);
}

/* _cached._kvcache_key: ("kv", the 15 tensors' signatures (None for an absent one), scale,
 * causal, window left, window right, softcap, rotary_interleaved, num_splits). A new tuple or
 * NULL. */
static PyObject *kv_key(PyObject *const *a, PyObject *window)
{
    PyObject *sig = PyTuple_New(KA_TENSORS), *key = NULL;
    if (!sig)
        return NULL;
    for (int i = 0; i < KA_TENSORS; i++) {
        PyObject *item = a[i] == Py_None ? (Py_INCREF(Py_None), Py_None)
                                         : fp_tensor_signature(a[i]);
        if (!item || PyTuple_SetItem(sig, i, item) != 0) /* steals item */
            goto done;
    }
    key = PyTuple_New(9);
    if (!key)
        goto done;
    PyObject *items[9] = {kv.tag, sig, a[KA_SCALE], a[KA_CAUSAL], PyTuple_GetItem(window, 0),
                          PyTuple_GetItem(window, 1), a[KA_SOFTCAP], a[KA_INTERLEAVED],
                          a[KA_SPLITS]};
    for (int i = 0; i < 9; i++) {
        Py_INCREF(items[i]);
        if (PyTuple_SetItem(key, i, items[i]) != 0) {
            Py_CLEAR(key);
            break;
        }
    }
done:
    Py_DECREF(sig);
    return key;
}

/* The prepared call on a's tensors: new out (and lse, and a split workspace), every pointer and
 * the CUDA fields written, the library run; out, or (out, lse). As in _fastpath.c's fp_run,
 * every Python call comes before the first write into the prepared arguments. */
static PyObject *kv_run(PyObject *const *a, PyObject *call, const int64_t *f, int want_lse)
{
#define KV_F(name) f[kv.field_at[name]]
    PyObject *likes = PyObject_GetAttr(call, kv.str_likes);
    PyObject *out = NULL, *lse = NULL, *ws = NULL, *result = NULL;
    int made = 0;
    if (!likes || !PyTuple_Check(likes) || PyTuple_Size(likes) != 2) {
        if (likes && !PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "flashattn._fastpath: malformed prepared call");
        goto done;
    }
    out = PyObject_CallFunctionObjArgs(fp_t.empty_like, PyTuple_GetItem(likes, 0), NULL);
    if (!out)
        goto done;
    if (want_lse &&
        !(lse = PyObject_CallFunctionObjArgs(fp_t.empty_like, PyTuple_GetItem(likes, 1), NULL)))
        goto done;
    if (!(ws = fp_new_like(call, fp_str_ws_like, &made)))
        goto done;
    PyObject *tensors[KF_SLOTS];
    void *ptrs[KF_SLOTS], *stream = NULL, *ws_ptr = NULL;
    memcpy(tensors, a, KA_TENSORS * sizeof *tensors);
    tensors[KA_TENSORS] = out;
    tensors[KA_TENSORS + 1] = lse ? lse : Py_None;
    for (int i = 0; i < KF_SLOTS; i++) {
        const int present = tensors[i] != Py_None, slot = KV_F(KF_SLOT0 + i) != 0;
        if (present != slot && i != KA_TENSORS + 1) {
            PyErr_SetString(PyExc_RuntimeError, "flashattn._fastpath: malformed prepared call");
            goto done;
        }
        ptrs[i] = NULL;
        if (present && fp_data_ptr(tensors[i], &ptrs[i]) != 0)
            goto done;
    }
    if (made && fp_data_ptr(ws, &ws_ptr) != 0)
        goto done;
    const int64_t device = KV_F(KF_DEVICE);
    int capturing = 0;
    if (device >= 0) {
        PyObject *s = PyObject_CallFunction(fp_t.raw_stream, "L", (long long)device);
        if (!s)
            goto done;
        stream = PyLong_AsVoidPtr(s);
        Py_DECREF(s);
        if (!stream && PyErr_Occurred())
            goto done;
        if (KV_F(KF_PAGED) && kv.capturing != Py_None &&
            (capturing = fp_call_true(kv.capturing)) < 0)
            goto done;
    }
    for (int i = 0; i < KF_SLOTS; i++)
        if (ptrs[i])
            *(void **)(uintptr_t)KV_F(KF_SLOT0 + i) = ptrs[i];
    *(void **)(uintptr_t)KV_F(KF_LSE_FIELD) = want_lse ? (void *)(uintptr_t)KV_F(KF_LSE_REF)
                                                       : NULL;
    if (KV_F(KF_WORKSPACE))
        *(void **)(uintptr_t)KV_F(KF_WORKSPACE) = ws_ptr;
    if (device >= 0) {
        *(void **)(uintptr_t)KV_F(KF_STREAM) = stream;
        if (KV_F(KF_SKIP_CHECK))
            *(int *)(uintptr_t)KV_F(KF_SKIP_CHECK) = capturing;
    }
    if (fp_call_library(KV_F(KF_FN), KV_F(KF_ARGS), call) != 0)
        goto done;
    if (!want_lse) {
        result = out;
        out = NULL;
    } else if ((result = PyTuple_New(2)) != NULL) {
        PyTuple_SetItem(result, 0, out); /* steals out and lse */
        PyTuple_SetItem(result, 1, lse);
        out = lse = NULL;
    }
done:
    Py_XDECREF(likes);
    Py_XDECREF(out);
    Py_XDECREF(lse);
    Py_XDECREF(ws);
    return result;
#undef KV_F
}

/* kvcache() when the call is the common one: 1 with *result set, 0 when it is not (or its
 * signature is not prepared), -1 with an exception. */
static int kv_served(PyObject *const *a, PyObject **result)
{
    if (!kv_plain_arguments(a))
        return 0;
    int st = fp_modes_plain();
    if (st == 1)
        st = fp_records_grad(a, KA_TENSORS) == 0 ? 1 : PyErr_Occurred() ? -1 : 0;
    if (st <= 0)
        return st;
    PyObject *window = fp_window(a[KA_WINDOW]);
    if (!window)
        return -1;
    PyObject *key = kv_key(a, window), *call = NULL;
    Py_DECREF(window);
    if (!key)
        return -1;
    int64_t fields[KF_NUM] = {0};
    st = fp_prepared(key, KF_NUM, &call, fields);
    Py_DECREF(key);
    if (st <= 0)
        return st;
    const int want_lse = a[KA_WANT_LSE] == Py_True;
    *result = kv_run(a, call, fields, want_lse);
    Py_DECREF(call);
    return *result ? 1 : -1;
}

PyObject *fp_kvcache(PyObject *self, PyObject *args)
{
    (void)self;
    if (!kv.fallback) {
        PyErr_SetString(PyExc_RuntimeError, "flashattn._fastpath: bind() was not called");
        return NULL;
    }
    PyObject *a[KA_NUM], *result = NULL;
    int st = 0;
    if (PyTuple_Size(args) == kv.count) {
        for (int i = 0; i < KA_NUM; i++)
            a[i] = PyTuple_GetItem(args, kv.at[i]);
        st = kv_served(a, &result);
    }
    if (st != 0)
        return st > 0 ? result : NULL;
    return PyObject_Call(kv.fallback, args, NULL);
}
