/*
 * flashattn._fastpath: flash_attn_func's commonest torch call done in C, a cache in front of
 * the Python route (flash_attn_interface -> _route -> _torch_ops -> _cached -> _core -> the
 * library). A small call's host time is mostly Python; the same steps through the C API cost
 * a fraction of it.
 *
 * dense() takes flash_attn_func's arguments and makes _torch_ops.dense's one-step checks. A call
 * that records gradients goes to _DenseFastFn.apply with its options, as _torch_ops.dense would
 * send it; a call without them whose signature _cached has prepared runs here: the key of the
 * call signature (_cached.dense_key), the prepared call found in _cached's per-thread cache, a
 * new output, the data pointers and the stream written into the prepared arguments, the
 * library called without the GIL (the library validates every call itself). Every other call
 * goes to the fallback, _route.dense_any, which also prepares the signature for the next call.
 * dense_lse() is _cached.forward_dense_torch's cached path with the lse. kvcache()
 * (_fastpath_kv.c) does the same for flash_attn_with_kvcache, flex() (_fastpath_flex.c) for
 * flex_attention.
 *
 * The argument positions and the prepared call's fields are not written here: bind() receives
 * their names in order (_route.DENSE_ARGS, _cached.LSE_ARGS, _cached.FAST_FIELDS).
 *
 * Built against the limited API (one binary for CPython >= 3.8) and linked with neither torch
 * nor the library: torch is reached through the callables bind() hands over, the library
 * through the function address the prepared call carries (_cached._CachedCall.fast).
 */
#include "_fastpath.h"

#include <limits.h>
#include <string.h>

/* The arguments dense() and dense_lse() read, by name: bind() receives each function's
 * argument names in order (_route.DENSE_ARGS, _cached.LSE_ARGS) and the positions are looked up
 * there, so that the Python signature is the one description of the layout. */
enum fp_arg {
    FP_Q, FP_K, FP_V, FP_DROPOUT, FP_SCALE, FP_CAUSAL, FP_WINDOW, FP_SOFTCAP, FP_ALIBI,
    FP_DETERMINISTIC, FP_PROBS, FP_SINK, FP_NUM_ARGS
};
static const char *const fp_arg_names[FP_NUM_ARGS] = {
    "q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
    "alibi_slopes", "deterministic", "return_attn_probs", "learnable_sink"};

/* The fields of a prepared call's C side (_cached._CachedCall.fast, int64 each), by name:
 * bind() receives their order (_cached.FAST_FIELDS). */
enum fp_field {
    FF_FN, FF_ARGS, FF_Q, FF_K, FF_V, FF_OUT, FF_LSE, FF_STREAM, FF_DEVICE, FF_WORKSPACE, FF_NUM
};
static const char *const fp_field_names[FF_NUM] = {"fn", "args", "q", "k", "v", "out", "lse",
                                                   "stream", "device", "workspace"};

/* Positions of the arguments of one function: at[i] is where fp_arg i sits (-1: absent). */
typedef struct fp_layout {
    Py_ssize_t count;
    Py_ssize_t at[FP_NUM_ARGS];
} fp_layout;

fp_torch fp_t;

/* What bind() was given for dense() and dense_lse(). */
static struct {
    PyObject *float64;           /* torch.float64 */
    PyObject *grad_apply;        /* _torch_ops._DenseFastFn.apply */
    PyObject *fallback;          /* _route.dense_any: every call dense() does not serve */
    fp_layout dense, lse;        /* dense()'s and dense_lse()'s arguments */
    Py_ssize_t field_at[FF_NUM]; /* where each fp_field sits in _CachedCall.fast */
    Py_ssize_t field_count;
    int bound;
} fp;

PyObject *fp_str_shape, *fp_str_stride, *fp_str_dtype, *fp_str_device, *fp_str_is_neg,
    *fp_str_data_ptr, *fp_str_requires_grad, *fp_str_calls, *fp_str_fast, *fp_str_ws_like;
static PyObject *fp_str_lse_like;
static PyObject *fp_zero; /* 0.0 */

int fp_is_scalar(PyObject *x)
{
    return PyFloat_CheckExact(x) || PyLong_CheckExact(x);
}

int fp_call_true(PyObject *fn)
{
    PyObject *r = PyObject_CallObject(fn, NULL);
    if (!r)
        return -1;
    const int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

int fp_modes_plain(void)
{
    for (int i = 0; i < FP_NUM_MODES; i++) {
        const int t = fp_call_true(fp_t.modes[i]);
        if (t != 0)
            return t < 0 ? -1 : 0;
    }
    return 1;
}

int fp_key_tensor(PyObject *key, Py_ssize_t at, PyObject *t)
{
    for (int i = 0; i < 5; i++) {
        PyObject *item;
        switch (i) {
        case 0: item = PyObject_GetAttr(t, fp_str_shape); break;
        case 1: item = PyObject_CallMethodObjArgs(t, fp_str_stride, NULL); break;
        case 2: item = PyObject_GetAttr(t, fp_str_dtype); break;
        case 3: item = PyObject_GetAttr(t, fp_str_device); break;
        default: item = PyObject_CallMethodObjArgs(t, fp_str_is_neg, NULL); break;
        }
        if (!item || PyTuple_SetItem(key, at + i, item) != 0) /* SetItem steals item */
            return -1;
    }
    return 0;
}

PyObject *fp_tensor_signature(PyObject *t)
{
    PyObject *sig = PyTuple_New(5);
    if (sig && fp_key_tensor(sig, 0, t) != 0)
        Py_CLEAR(sig);
    return sig;
}

int fp_data_ptr(PyObject *t, void **ptr)
{
    PyObject *p = PyObject_CallMethodObjArgs(t, fp_str_data_ptr, NULL);
    if (!p)
        return -1;
    *ptr = PyLong_AsVoidPtr(p);
    Py_DECREF(p);
    return !*ptr && PyErr_Occurred() ? -1 : 0;
}

/* The checks of _torch_ops.dense's one-step call that need no tensor attribute: 1 if they
 * pass, else 0. */
static int fp_plain_arguments(PyObject *const *a)
{
    for (int i = FP_Q; i <= FP_V; i++)
        if ((PyObject *)Py_TYPE(a[i]) != fp_t.tensor_type)
            return 0;
    return a[FP_ALIBI] == Py_None && a[FP_SINK] == Py_None && a[FP_PROBS] == Py_False &&
           PyBool_Check(a[FP_CAUSAL]) && PyBool_Check(a[FP_DETERMINISTIC]) &&
           fp_is_scalar(a[FP_DROPOUT]) && fp_is_scalar(a[FP_SOFTCAP]) &&
           (a[FP_SCALE] == Py_None || fp_is_scalar(a[FP_SCALE]));
}

/* The one-step call's remaining checks but rank, dtype and gradients: 1 if the call is plain
 * eager without dropout, 0 if not, -1 with an exception. */
static int fp_eager(PyObject *const *a)
{
    const int t = PyObject_IsTrue(a[FP_DROPOUT]);
    if (t != 0)
        return t < 0 ? -1 : 0;
    return fp_modes_plain();
}

int fp_records_grad(PyObject *const *tensors, int n)
{
    int t = fp_call_true(fp_t.grad_enabled);
    for (int i = 0; t > 0 && i < n; i++) {
        if (!tensors[i] || tensors[i] == Py_None)
            continue;
        PyObject *r = PyObject_GetAttr(tensors[i], fp_str_requires_grad);
        if (!r)
            return -1;
        t = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (t != 0)
            return t;
        t = 1; /* not this one: ask the next */
    }
    return t < 0 ? -1 : 0;
}

/* A tuple of two ints is normalised here (negative or past INT_MAX: -1, unbounded), anything
 * else by window_pair itself. */
PyObject *fp_window(PyObject *w)
{
    if (PyTuple_CheckExact(w) && PyTuple_Size(w) == 2) {
        PyObject *l = PyTuple_GetItem(w, 0), *r = PyTuple_GetItem(w, 1);
        if (PyLong_CheckExact(l) && PyLong_CheckExact(r)) {
            int overflow[2];
            long long side[2] = {PyLong_AsLongLongAndOverflow(l, &overflow[0]),
                                 PyLong_AsLongLongAndOverflow(r, &overflow[1])};
            if (PyErr_Occurred())
                return NULL;
            int same = 1; /* w is already normalised: the key can hold w itself */
            for (int i = 0; i < 2; i++) {
                if (overflow[i] || side[i] < 0 || side[i] > INT_MAX) {
                    same = same && !overflow[i] && side[i] == -1;
                    side[i] = -1;
                }
            }
            if (same) {
                Py_INCREF(w);
                return w;
            }
            return Py_BuildValue("(ii)", (int)side[0], (int)side[1]);
        }
    }
    return PyObject_CallFunctionObjArgs(fp_t.window_pair, w, NULL);
}

/* _cached.dense_key(q, k, v, 0.0, scale, causal, window, softcap, want_lse), item for item:
 * (shape, stride(), dtype, device, is_neg()) of q, k and v, then the options as the caller gave
 * them (the window normalised). A new tuple or NULL. */
static PyObject *fp_key(PyObject *const *a, PyObject *window, PyObject *want_lse)
{
    PyObject *key = PyTuple_New(21);
    if (!key)
        return NULL;
    for (int i = FP_Q; i <= FP_V; i++)
        if (fp_key_tensor(key, 5 * (i - FP_Q), a[i]) != 0)
            goto fail;
    PyObject *tail[6] = {fp_zero, a[FP_SCALE], a[FP_CAUSAL], window, a[FP_SOFTCAP], want_lse};
    for (int i = 0; i < 6; i++) {
        Py_INCREF(tail[i]);
        if (PyTuple_SetItem(key, 15 + i, tail[i]) != 0) /* steals tail[i] */
            goto fail;
    }
    return key;
fail:
    Py_DECREF(key);
    return NULL;
}

/* The prepared call's C side, read from _CachedCall.fast through fp.field_at. */
typedef struct fp_fast {
    int64_t fn;        /* the library's fa_attention_forward */
    int64_t args;      /* its fa_fwd_args */
    int64_t slots[5];  /* the data fields of q, k, v, out and lse in args (lse: 0 if none) */
    int64_t stream;    /* the stream field of args, 0 on the CPU */
    int64_t device;    /* CUDA device index, -1 on the CPU */
    int64_t workspace; /* the workspace field of args where the call splits (CUDA), else 0 */
} fp_fast;

int fp_prepared(PyObject *key, Py_ssize_t count, PyObject **call, int64_t *fields)
{
    PyObject *calls = PyObject_GetAttr(fp_t.local, fp_str_calls);
    if (!calls) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear(); /* this thread has no cache yet */
        return 0;
    }
    *call = PyDict_GetItemWithError(calls, key);
    Py_XINCREF(*call);
    Py_DECREF(calls);
    if (!*call) {
        if (!PyErr_Occurred())
            return 0;
        if (!PyErr_ExceptionMatches(PyExc_TypeError))
            return -1;
        PyErr_Clear(); /* an unhashable argument: never prepared (_cached._lookup) */
        return 0;
    }
    PyObject *fast = PyObject_GetAttr(*call, fp_str_fast);
    int st = fast ? 0 : -1;
    if (fast && fast != Py_None) {
        char *bytes = NULL;
        Py_ssize_t size = 0;
        st = PyBytes_AsStringAndSize(fast, &bytes, &size) == 0 ? 1 : -1;
        if (st == 1 && size != count * (Py_ssize_t)sizeof(int64_t)) {
            PyErr_SetString(PyExc_RuntimeError, "flashattn._fastpath: malformed prepared call");
            st = -1;
        }
        if (st == 1)
            memcpy(fields, bytes, (size_t)size);
    }
    Py_XDECREF(fast);
    if (st != 1)
        Py_CLEAR(*call);
    return st;
}

PyObject *fp_new_like(PyObject *obj, PyObject *name, int *made)
{
    PyObject *like = PyObject_GetAttr(obj, name);
    if (!like)
        return NULL;
    *made = like != Py_None;
    if (!*made)
        return like;
    PyObject *x = PyObject_CallFunctionObjArgs(fp_t.empty_like, like, NULL);
    Py_DECREF(like);
    return x;
}

int fp_call_library(int64_t fn, int64_t args, PyObject *call)
{
    PyThreadState *ts = PyEval_SaveThread();
    const int status = ((fa_call_fn)(uintptr_t)fn)((void *)(uintptr_t)args);
    PyEval_RestoreThread(ts);
    if (status == 0)
        return 0;
    PyObject *r = PyObject_CallFunction(fp_t.failed, "Oi", call, status);
    Py_XDECREF(r);
    if (!PyErr_Occurred())
        PyErr_Format(PyExc_RuntimeError, "flashattn: the library failed (status %d)", status);
    return -1;
}

/* The prepared call of key with its C side read into *f: fp_prepared's result, 0 also when
 * want_lse and the call has no lse slot. */
static int fp_prepared_call(PyObject *key, int want_lse, PyObject **call, fp_fast *f)
{
    int64_t fields[FF_NUM] = {0};
    const int st = fp_prepared(key, fp.field_count, call, fields);
    if (st != 1)
        return st;
    f->fn = fields[fp.field_at[FF_FN]];
    f->args = fields[fp.field_at[FF_ARGS]];
    for (int i = 0; i < 5; i++)
        f->slots[i] = fields[fp.field_at[FF_Q + i]];
    f->stream = fields[fp.field_at[FF_STREAM]];
    f->device = fields[fp.field_at[FF_DEVICE]];
    f->workspace = fields[fp.field_at[FF_WORKSPACE]];
    if (want_lse && f->slots[4] == 0) {
        Py_CLEAR(*call);
        return 0;
    }
    return 1;
}

/* The call itself: new out (and lse, and a split workspace), pointers and stream swapped in, the
 * library run without the GIL; out, or (out, lse). Every Python call comes before the first write into the
 * prepared arguments: Python code run in between (a finalizer, say) could make a call of the
 * same signature on this thread, which would write them too. */
static PyObject *fp_run(PyObject *const *qkv, PyObject *call, const fp_fast *f, int want_lse)
{
    PyObject *out = PyObject_CallFunctionObjArgs(fp_t.empty_like, qkv[0], NULL), *lse = NULL;
    PyObject *ws = NULL;
    void *ws_ptr = NULL;
    int made = 0;
    if (!out)
        return NULL;
    if (f->workspace && (!(ws = fp_new_like(call, fp_str_ws_like, &made)) ||
                         (made && fp_data_ptr(ws, &ws_ptr) != 0)))
        goto fail;
    if (want_lse) {
        PyObject *like = PyObject_GetAttr(call, fp_str_lse_like);
        lse = like ? PyObject_CallFunctionObjArgs(fp_t.empty_like, like, NULL) : NULL;
        Py_XDECREF(like);
        if (!lse)
            goto fail;
    }
    PyObject *tensors[5] = {qkv[0], qkv[1], qkv[2], out, lse};
    void *ptrs[5], *stream = NULL;
    const int n = want_lse ? 5 : 4;
    for (int i = 0; i < n; i++)
        if (fp_data_ptr(tensors[i], &ptrs[i]) != 0)
            goto fail;
    if (f->device >= 0) {
        PyObject *s = PyObject_CallFunction(fp_t.raw_stream, "L", (long long)f->device);
        if (!s)
            goto fail;
        stream = PyLong_AsVoidPtr(s);
        Py_DECREF(s);
        if (!stream && PyErr_Occurred())
            goto fail;
    }
    for (int i = 0; i < n; i++)
        *(void **)(uintptr_t)f->slots[i] = ptrs[i];
    if (f->device >= 0)
        *(void **)(uintptr_t)f->stream = stream;
    if (f->workspace)
        *(void **)(uintptr_t)f->workspace = ws_ptr;
    if (fp_call_library(f->fn, f->args, call) != 0)
        goto fail;
    Py_CLEAR(ws); /* freed in stream order after the call, as the Python path's */
    if (!want_lse)
        return out;
    PyObject *pair = PyTuple_New(2);
    if (!pair)
        goto fail;
    PyTuple_SetItem(pair, 0, out); /* steals out and lse */
    PyTuple_SetItem(pair, 1, lse);
    return pair;
fail:
    Py_DECREF(out);
    Py_XDECREF(lse);
    Py_XDECREF(ws);
    return NULL;
}

/* Looks up and runs the prepared call of key: the result of fp_run, or None if there is none. */
static PyObject *fp_run_prepared(PyObject *const *qkv, PyObject *key, int want_lse)
{
    PyObject *call = NULL;
    fp_fast f = {0};
    const int st = fp_prepared_call(key, want_lse, &call, &f);
    if (st <= 0) {
        if (st < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *result = fp_run(qkv, call, &f, want_lse);
    Py_DECREF(call);
    return result;
}

/* The arguments of args at layout l's positions into a (absent ones NULL): 1, or 0 when args
 * has another count (a call the layout does not describe). */
static int fp_unpack(PyObject *args, const fp_layout *l, PyObject **a)
{
    if (PyTuple_Size(args) != l->count)
        return 0;
    for (int i = 0; i < FP_NUM_ARGS; i++)
        a[i] = l->at[i] >= 0 ? PyTuple_GetItem(args, l->at[i]) : NULL;
    return 1;
}

/* dense() when the call is the common one: 1 with *result set (out, or _DenseFastFn's), 0 when
 * it is not (or its signature is not prepared), -1 with an exception. */
static int fp_dense_served(PyObject *const *a, PyObject **result)
{
    if (!fp_plain_arguments(a))
        return 0;
    PyObject *shape = PyObject_GetAttr(a[FP_Q], fp_str_shape);
    PyObject *dtype = shape ? PyObject_GetAttr(a[FP_Q], fp_str_dtype) : NULL;
    int st = !dtype ? -1 : PyTuple_Size(shape) == 4 && dtype != fp.float64 ? fp_eager(a) : 0;
    Py_XDECREF(dtype);
    Py_XDECREF(shape);
    if (st <= 0)
        return st;
    PyObject *window = fp_window(a[FP_WINDOW]);
    if (!window)
        return -1;
    const int grad = fp_records_grad(a + FP_Q, 3);
    if (grad == 1) {
        /* _DenseFastFn's options: (scale, causal, left, right, softcap, deterministic). */
        PyObject *opts = Py_BuildValue("(OOOOOO)", a[FP_SCALE], a[FP_CAUSAL],
                                       PyTuple_GetItem(window, 0), PyTuple_GetItem(window, 1),
                                       a[FP_SOFTCAP], a[FP_DETERMINISTIC]);
        if (opts) {
            *result = PyObject_CallFunctionObjArgs(fp.grad_apply, a[FP_Q], a[FP_K], a[FP_V],
                                                   opts, NULL);
            Py_DECREF(opts);
        }
        st = *result ? 1 : -1;
    } else if (grad == 0) {
        PyObject *key = fp_key(a, window, Py_False);
        *result = key ? fp_run_prepared(a + FP_Q, key, 0) : NULL;
        Py_XDECREF(key);
        st = !*result ? -1 : *result != Py_None ? 1 : 0;
        if (st == 0)
            Py_CLEAR(*result);
    } else {
        st = -1;
    }
    Py_DECREF(window);
    return st;
}

static PyObject *fp_dense(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *a[FP_NUM_ARGS], *result = NULL;
    if (!fp.bound) {
        PyErr_SetString(PyExc_RuntimeError, "flashattn._fastpath: bind() was not called");
        return NULL;
    }
    const int st = fp_unpack(args, &fp.dense, a) ? fp_dense_served(a, &result) : 0;
    if (st != 0)
        return st > 0 ? result : NULL;
    return PyObject_Call(fp.fallback, args, NULL);
}

static PyObject *fp_dense_lse(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *a[FP_NUM_ARGS];
    if (!fp.bound || !fp_unpack(args, &fp.lse, a))
        Py_RETURN_NONE;
    for (int i = FP_Q; i <= FP_V; i++)
        if ((PyObject *)Py_TYPE(a[i]) != fp_t.tensor_type)
            Py_RETURN_NONE;
    PyObject *key = fp_key(a, a[FP_WINDOW], Py_True);
    if (!key)
        return NULL;
    PyObject *result = fp_run_prepared(a + FP_Q, key, 1);
    Py_DECREF(key);
    return result;
}

PyObject *fp_entry(PyObject *table, const char *name)
{
    PyObject *x = PyDict_GetItemString(table, name);
    if (!x)
        PyErr_Format(PyExc_KeyError, "flashattn._fastpath.bind: no entry '%s'", name);
    return x;
}

int fp_positions(PyObject *order, const char *const *names, int n, int required, Py_ssize_t *at,
                 Py_ssize_t *count)
{
    if (!order || !PyTuple_Check(order)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "flashattn._fastpath.bind: a layout is a tuple");
        return -1;
    }
    *count = PyTuple_Size(order);
    for (int i = 0; i < n; i++) {
        at[i] = -1;
        for (Py_ssize_t j = 0; j < *count && at[i] < 0; j++) {
            PyObject *name = PyUnicode_FromString(names[i]);
            if (!name)
                return -1;
            const int eq = PyObject_RichCompareBool(PyTuple_GetItem(order, j), name, Py_EQ);
            Py_DECREF(name);
            if (eq < 0)
                return -1;
            if (eq)
                at[i] = j;
        }
        if (at[i] < 0 && (required >> i & 1)) {
            PyErr_Format(PyExc_ValueError, "flashattn._fastpath.bind: the layout has no '%s'",
                         names[i]);
            return -1;
        }
    }
    return 0;
}

/* The names of the objects bind() holds, in fp's order, then the layouts. */
static const char *const fp_held_names[] = {"Tensor", "float64", "empty_like", "grad_enabled",
                                            "local", "window_pair", "raw_stream", "call_failed",
                                            "grad_apply", "fallback"};

static PyObject *fp_bind(PyObject *self, PyObject *table)
{
    (void)self;
    if (!PyDict_Check(table)) {
        PyErr_SetString(PyExc_TypeError, "flashattn._fastpath.bind: expected a dict");
        return NULL;
    }
    if (fp.bound)
        Py_RETURN_NONE;
    enum { N_HELD = sizeof fp_held_names / sizeof fp_held_names[0] };
    PyObject *held[N_HELD], *modes = fp_entry(table, "modes");
    for (int i = 0; i < N_HELD; i++)
        if (!(held[i] = fp_entry(table, fp_held_names[i])))
            return NULL;
    if (!modes || !PyTuple_Check(modes) || PyTuple_Size(modes) != FP_NUM_MODES) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "flashattn._fastpath.bind: modes: 4 callables");
        return NULL;
    }
    const int dense_needs = (1 << FP_NUM_ARGS) - 1;
    const int lse_needs = 1 << FP_Q | 1 << FP_K | 1 << FP_V | 1 << FP_SCALE | 1 << FP_CAUSAL |
                          1 << FP_WINDOW | 1 << FP_SOFTCAP;
    if (fp_positions(fp_entry(table, "dense_args"), fp_arg_names, FP_NUM_ARGS, dense_needs,
                     fp.dense.at, &fp.dense.count) != 0 ||
        fp_positions(fp_entry(table, "lse_args"), fp_arg_names, FP_NUM_ARGS, lse_needs,
                     fp.lse.at, &fp.lse.count) != 0 ||
        fp_positions(fp_entry(table, "fast_fields"), fp_field_names, FF_NUM, (1 << FF_NUM) - 1,
                     fp.field_at, &fp.field_count) != 0)
        return NULL;
    if (fp.field_count != FF_NUM) {
        PyErr_Format(PyExc_ValueError, "flashattn._fastpath.bind: fast_fields: %d names",
                     (int)FF_NUM);
        return NULL;
    }
    /* Last: nothing after them can fail, so kvcache() and flex() are bound exactly when
     * dense() is. */
    if (fp_kv_bind(table) != 0 || fp_flex_bind(table) != 0)
        return NULL;
    PyObject **slots[N_HELD] = {&fp_t.tensor_type, &fp.float64,       &fp_t.empty_like,
                                &fp_t.grad_enabled, &fp_t.local,      &fp_t.window_pair,
                                &fp_t.raw_stream,   &fp_t.failed,     &fp.grad_apply,
                                &fp.fallback};
    for (int i = 0; i < N_HELD; i++) {
        Py_INCREF(held[i]);
        *slots[i] = held[i];
    }
    for (int i = 0; i < FP_NUM_MODES; i++) {
        fp_t.modes[i] = PyTuple_GetItem(modes, i);
        Py_INCREF(fp_t.modes[i]);
    }
    fp.bound = 1;
    Py_RETURN_NONE;
}

static PyMethodDef fp_methods[] = {
    {"dense", fp_dense, METH_VARARGS,
     "dense(*args in bind's dense_args order) -> flash_attn_func's result: out of a prepared "
     "call, _DenseFastFn's for a call with gradients, or the fallback's for any other"},
    {"dense_lse", fp_dense_lse, METH_VARARGS,
     "dense_lse(*args in bind's lse_args order) -> (out, lse) of a prepared call, or None"},
    {"kvcache", fp_kvcache, METH_VARARGS,
     "kvcache(*args in bind's kv_args order) -> flash_attn_with_kvcache's result: a prepared "
     "call's, or the kv_fallback's for any other"},
    {"flex", fp_flex, METH_VARARGS,
     "flex(*args in bind's flex_args order) -> flex_attention's result: a registered call's "
     "whose checks hold, or the flex_fallback's for any other"},
    {"flex_register", fp_flex_register, METH_VARARGS,
     "flex_register(args, prepared, fields, out_like, lse_like, checks): serve later calls of "
     "args from the prepared call (fields None: a call with gradients, prepared its "
     "_FlexCall) while the checks hold; True, or None where a check is not one C makes"},
    {"flex_wanted", fp_flex_wanted, METH_O,
     "flex_wanted(args) -> whether the route should register a call of args now"},
    {"bind", fp_bind, METH_O,
     "bind(table): the torch and flashattn objects used, and the argument and field layouts"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fp_module = {PyModuleDef_HEAD_INIT, "_fastpath", NULL, -1, fp_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fastpath(void); /* the one exported symbol */

PyMODINIT_FUNC PyInit__fastpath(void)
{
    PyObject **names[] = {&fp_str_shape, &fp_str_stride, &fp_str_dtype, &fp_str_device,
                          &fp_str_is_neg, &fp_str_data_ptr, &fp_str_requires_grad,
                          &fp_str_calls, &fp_str_fast, &fp_str_lse_like, &fp_str_ws_like};
    const char *text[] = {"shape", "stride", "dtype", "device", "is_neg", "data_ptr",
                          "requires_grad", "calls", "fast", "lse_like", "ws_like"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!(*names[i] = PyUnicode_InternFromString(text[i])))
            return NULL;
    if (!(fp_zero = PyFloat_FromDouble(0.0)))
        return NULL;
    return PyModule_Create(&fp_module);
}
