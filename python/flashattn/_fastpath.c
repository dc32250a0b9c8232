/*
 * flashattn._fastpath: flash_attn_func's commonest torch call done in C. A small call's host
 * time is mostly Python's, and the same steps in C cost a fraction of it.
 *
 * dense() takes flash_attn_func's arguments and makes _torch_ops.dense_fast's checks. A call
 * that records gradients goes to _DenseFastFn.apply with its options; any other returns out,
 * or None where the call is not the common one (other types or options, a compile, trace or
 * mode, a signature not prepared yet), and the caller takes the Python path (which also
 * prepares the signature for the next call). The call repeats _cached.forward_dense_out's
 * steps: the key of the call signature, the prepared call found in _cached's per-thread cache,
 * a new output, the data pointers and the stream written into the prepared arguments, the
 * library called without the GIL (the library validates every call itself). dense_lse() is
 * _DenseFastFn.forward's call, with the lse (_cached.forward_dense_torch's cached path).
 *
 * Built against the limited API (one binary for CPython >= 3.8) and linked with neither torch
 * nor the library: torch is reached through the callables bind() hands over, the library
 * through the function address the prepared call carries (_cached._CachedCall.fast).
 */
#define Py_LIMITED_API 0x03080000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef int (*fa_forward_fn)(void *args);

#define FP_NUM_MODES 4

/* What bind() was given: borrowed from torch and flashattn's modules, held for good. */
static struct {
    PyObject *tensor_type;            /* torch.Tensor: subclasses take the Python path */
    PyObject *float64;                /* torch.float64 */
    PyObject *empty_like;             /* torch.empty_like */
    PyObject *modes[FP_NUM_MODES];    /* callables; a true result means not plain eager (the
                                       * caller checked torch.compiler.is_compiling()) */
    PyObject *grad_enabled;           /* torch.is_grad_enabled */
    PyObject *local;                  /* _cached._LOCAL, whose "calls" is the per-thread cache */
    PyObject *window_pair;            /* _core.window_pair */
    PyObject *raw_stream;             /* device index -> current CUDA stream handle */
    PyObject *failed;                 /* _cached._call_failed(call, status): raises */
    PyObject *grad_apply;             /* _torch_ops._DenseFastFn.apply */
    int bound;
} fp;

static PyObject *fp_str_shape, *fp_str_stride, *fp_str_dtype, *fp_str_device, *fp_str_is_neg,
    *fp_str_data_ptr, *fp_str_requires_grad, *fp_str_calls, *fp_str_fast, *fp_str_lse_like;
static PyObject *fp_zero; /* 0.0 */

/* x is a plain Python float or int (not bool), as type(x) in (float, int). */
static int fp_is_scalar(PyObject *x)
{
    return PyFloat_CheckExact(x) || PyLong_CheckExact(x);
}

/* 1 if fn() is true, 0 if not, -1 with an exception. */
static int fp_call_true(PyObject *fn)
{
    PyObject *r = PyObject_CallObject(fn, NULL);
    if (!r)
        return -1;
    const int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

/* Sets key[at .. at+4] to t's (shape, stride(), dtype, device, is_neg()); -1 with an exception. */
static int fp_key_tensor(PyObject *key, Py_ssize_t at, PyObject *t)
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

/* t.data_ptr() into *ptr; -1 with an exception. */
static int fp_data_ptr(PyObject *t, void **ptr)
{
    PyObject *p = PyObject_CallMethodObjArgs(t, fp_str_data_ptr, NULL);
    if (!p)
        return -1;
    *ptr = PyLong_AsVoidPtr(p);
    Py_DECREF(p);
    return !*ptr && PyErr_Occurred() ? -1 : 0;
}

/* The checks of _torch_ops.dense_fast that need no tensor attribute: 1 if they pass, else 0. */
static int fp_plain_arguments(PyObject *const *a)
{
    PyObject *dropout_p = a[3], *softmax_scale = a[4], *causal = a[5], *cap = a[7];
    for (int i = 0; i < 3; i++)
        if ((PyObject *)Py_TYPE(a[i]) != fp.tensor_type)
            return 0;
    return a[8] == Py_None && a[10] == Py_None && a[9] == Py_False && PyBool_Check(causal) &&
           fp_is_scalar(dropout_p) && fp_is_scalar(cap) &&
           (softmax_scale == Py_None || fp_is_scalar(softmax_scale));
}

/* dense_fast's remaining checks but rank, dtype and gradients: 1 if the call is plain eager
 * without dropout, 0 if not, -1 with an exception. */
static int fp_eager(PyObject *const *a)
{
    int t = PyObject_IsTrue(a[3]); /* dropout_p */
    if (t != 0)
        return t < 0 ? -1 : 0;
    for (int i = 0; i < FP_NUM_MODES; i++)
        if ((t = fp_call_true(fp.modes[i])) != 0)
            return t < 0 ? -1 : 0;
    return 1;
}

/* 1 if the call records a gradient (grad mode on, q, k or v requiring it), 0 if not, -1. */
static int fp_wants_grad(PyObject *const *a)
{
    int t = fp_call_true(fp.grad_enabled);
    for (int i = 0; t > 0 && i < 3; i++) {
        PyObject *r = PyObject_GetAttr(a[i], fp_str_requires_grad);
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

/* float(x) for the key (a new reference; NULL with OverflowError as float(x) raises it): x
 * itself when it is a float already. */
static PyObject *fp_as_float(PyObject *x)
{
    if (PyFloat_CheckExact(x)) {
        Py_INCREF(x);
        return x;
    }
    const double value = PyLong_AsDouble(x);
    return value == -1.0 && PyErr_Occurred() ? NULL : PyFloat_FromDouble(value);
}

/* _core.window_pair(w) (a new reference): a tuple of two ints is normalised here (negative or
 * past INT_MAX: -1, unbounded), anything else by window_pair itself. */
static PyObject *fp_window(PyObject *w)
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
    return PyObject_CallFunctionObjArgs(fp.window_pair, w, NULL);
}

/* The options as dense_fast passes them on, new references: o[0] float(softmax_scale) (q.shape[3]
 * ** -0.5 by default, as Python computes it), o[1] the window pair, o[2] float(softcap); -1 with
 * an exception. */
static int fp_options(PyObject *const *a, PyObject *shape, PyObject **o)
{
    if (a[4] != Py_None) {
        o[0] = fp_as_float(a[4]);
    } else {
        const double d = PyLong_AsDouble(PyTuple_GetItem(shape, 3));
        o[0] = d == -1.0 && PyErr_Occurred() ? NULL : PyFloat_FromDouble(pow(d, -0.5));
    }
    o[1] = o[0] ? fp_window(a[6]) : NULL;
    o[2] = o[1] ? fp_as_float(a[7]) : NULL;
    if (o[2])
        return 0;
    Py_XDECREF(o[0]);
    Py_XDECREF(o[1]);
    return -1;
}

/* _cached's key of a dense call, item for item: (shape, stride(), dtype, device, is_neg()) of q,
 * k and v, then 0.0 (dropout_p), scale, causal, window, softcap, want_lse. A new tuple or NULL. */
static PyObject *fp_key(PyObject *const *qkv, PyObject *scale, PyObject *causal,
                        PyObject *window, PyObject *softcap, PyObject *want_lse)
{
    PyObject *key = PyTuple_New(21);
    if (!key)
        return NULL;
    for (int i = 0; i < 3; i++)
        if (fp_key_tensor(key, 5 * i, qkv[i]) != 0)
            goto fail;
    PyObject *tail[6] = {fp_zero, scale, causal, window, softcap, want_lse};
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

/* The prepared call's C side, _cached._CachedCall.fast: nine int64 in this order. */
typedef struct fp_fast {
    int64_t fn;        /* the library's fa_attention_forward */
    int64_t args;      /* its fa_fwd_args */
    int64_t slots[5];  /* the data fields of q, k, v, out and lse in args (lse: 0 if none) */
    int64_t stream;    /* the stream field of args, 0 on the CPU */
    int64_t device;    /* CUDA device index, -1 on the CPU */
} fp_fast;

/* The prepared call of key in this thread's cache, with its C side read into *f: 1 with a new
 * reference in *call, 0 if there is none (not prepared, or no C side, or no lse slot when
 * want_lse), -1 with an exception. */
static int fp_prepared_call(PyObject *key, int want_lse, PyObject **call, fp_fast *f)
{
    PyObject *calls = PyObject_GetAttr(fp.local, fp_str_calls);
    if (!calls) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear(); /* this thread has no cache yet */
        return 0;
    }
    *call = PyDict_GetItemWithError(calls, key);
    Py_XINCREF(*call);
    Py_DECREF(calls);
    if (!*call)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *fast = PyObject_GetAttr(*call, fp_str_fast);
    int st = fast ? 0 : -1;
    if (fast && fast != Py_None) {
        char *bytes = NULL;
        Py_ssize_t size = 0;
        st = PyBytes_AsStringAndSize(fast, &bytes, &size) == 0 ? 1 : -1;
        if (st == 1 && size != (Py_ssize_t)sizeof *f) {
            PyErr_SetString(PyExc_RuntimeError, "flashattn._fastpath: malformed prepared call");
            st = -1;
        }
        if (st == 1)
            memcpy(f, bytes, sizeof *f);
        if (st == 1 && want_lse && f->slots[4] == 0)
            st = 0;
    }
    Py_XDECREF(fast);
    if (st != 1)
        Py_CLEAR(*call);
    return st;
}

/* The call itself: new out (and lse), pointers and stream swapped in, the library run without
 * the GIL; out, or (out, lse). Every Python call comes before the first write into the
 * prepared arguments: Python code run in between (a finalizer, say) could make a call of the
 * same signature on this thread, which would write them too. */
static PyObject *fp_run(PyObject *const *qkv, PyObject *call, const fp_fast *f, int want_lse)
{
    PyObject *out = PyObject_CallFunctionObjArgs(fp.empty_like, qkv[0], NULL), *lse = NULL;
    if (!out)
        return NULL;
    if (want_lse) {
        PyObject *like = PyObject_GetAttr(call, fp_str_lse_like);
        lse = like ? PyObject_CallFunctionObjArgs(fp.empty_like, like, NULL) : NULL;
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
        PyObject *s = PyObject_CallFunction(fp.raw_stream, "L", (long long)f->device);
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
    fa_forward_fn fn = (fa_forward_fn)(uintptr_t)f->fn;
    PyThreadState *ts = PyEval_SaveThread();
    const int status = fn((void *)(uintptr_t)f->args);
    PyEval_RestoreThread(ts);
    if (status != 0) {
        PyObject *r = PyObject_CallFunction(fp.failed, "Oi", call, status);
        Py_XDECREF(r);
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_RuntimeError, "flashattn: the library failed (status %d)", status);
        goto fail;
    }
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
    return NULL;
}

/* Looks up and runs the prepared call of key: the result of fp_run, or None if there is none. */
static PyObject *fp_run_prepared(PyObject *const *qkv, PyObject *key, int want_lse)
{
    PyObject *call = NULL;
    fp_fast f;
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

static PyObject *fp_dense(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *a[12];
    if (!PyArg_UnpackTuple(args, "dense", 12, 12, &a[0], &a[1], &a[2], &a[3], &a[4], &a[5],
                           &a[6], &a[7], &a[8], &a[9], &a[10], &a[11]))
        return NULL;
    if (!fp.bound || !fp_plain_arguments(a))
        Py_RETURN_NONE;
    PyObject *shape = PyObject_GetAttr(a[0], fp_str_shape);
    PyObject *dtype = shape ? PyObject_GetAttr(a[0], fp_str_dtype) : NULL;
    int st = !dtype ? -1 : PyTuple_Size(shape) == 4 && dtype != fp.float64 ? fp_eager(a) : 0;
    Py_XDECREF(dtype);
    PyObject *o[3], *result = NULL;
    if (st == 1)
        st = fp_options(a, shape, o) == 0 ? 1 : -1;
    Py_XDECREF(shape);
    if (st <= 0) {
        if (st < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    const int grad = fp_wants_grad(a);
    if (grad == 1) {
        /* _DenseFastFn's options: (scale, causal, left, right, softcap, deterministic). */
        const int det = PyObject_IsTrue(a[11]);
        PyObject *opts = det < 0 ? NULL
                                 : Py_BuildValue("(OOOOOO)", o[0], a[5],
                                                 PyTuple_GetItem(o[1], 0),
                                                 PyTuple_GetItem(o[1], 1), o[2],
                                                 det ? Py_True : Py_False);
        if (opts) {
            result = PyObject_CallFunctionObjArgs(fp.grad_apply, a[0], a[1], a[2], opts, NULL);
            Py_DECREF(opts);
        }
    } else if (grad == 0) {
        PyObject *key = fp_key(a, o[0], a[5], o[1], o[2], Py_False);
        if (key) {
            result = fp_run_prepared(a, key, 0);
            Py_DECREF(key);
        }
    }
    for (int i = 0; i < 3; i++)
        Py_DECREF(o[i]);
    return result;
}

static PyObject *fp_dense_lse(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *a[7];
    if (!PyArg_UnpackTuple(args, "dense_lse", 7, 7, &a[0], &a[1], &a[2], &a[3], &a[4], &a[5],
                           &a[6]))
        return NULL;
    for (int i = 0; i < 3; i++)
        if (!fp.bound || (PyObject *)Py_TYPE(a[i]) != fp.tensor_type)
            Py_RETURN_NONE;
    PyObject *key = fp_key(a, a[3], a[4], a[5], a[6], Py_True);
    if (!key)
        return NULL;
    PyObject *result = fp_run_prepared(a, key, 1);
    Py_DECREF(key);
    return result;
}

static PyObject *fp_bind(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[14];
    if (!PyArg_UnpackTuple(args, "bind", 14, 14, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6],
                           &o[7], &o[8], &o[9], &o[10], &o[11], &o[12], &o[13]))
        return NULL;
    /* o[13]: the version of _CachedCall.fast the Python side writes. */
    if (PyLong_AsLong(o[13]) != 2) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "flashattn._fastpath: layout version mismatch");
        return NULL;
    }
    if (fp.bound)
        Py_RETURN_NONE;
    for (int i = 0; i < 13; i++)
        Py_INCREF(o[i]);
    fp.tensor_type = o[0];
    fp.float64 = o[1];
    fp.empty_like = o[2];
    for (int i = 0; i < FP_NUM_MODES; i++)
        fp.modes[i] = o[3 + i];
    fp.grad_enabled = o[7];
    fp.local = o[8];
    fp.window_pair = o[9];
    fp.raw_stream = o[10];
    fp.failed = o[11];
    fp.grad_apply = o[12];
    fp.bound = 1;
    Py_RETURN_NONE;
}

static PyMethodDef fp_methods[] = {
    {"dense", fp_dense, METH_VARARGS,
     "dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, "
     "return_attn_probs, learnable_sink, deterministic) -> out, or None for the Python path"},
    {"dense_lse", fp_dense_lse, METH_VARARGS,
     "dense_lse(q, k, v, scale, causal, window, softcap) -> (out, lse) of a prepared call, or "
     "None"},
    {"bind", fp_bind, METH_VARARGS,
     "bind(Tensor, float64, empty_like, 4 mode checks, is_grad_enabled, local, window_pair, "
     "raw_stream, call_failed, grad_apply, version)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fp_module = {PyModuleDef_HEAD_INIT, "_fastpath", NULL, -1, fp_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fastpath(void); /* the one exported symbol */

PyMODINIT_FUNC PyInit__fastpath(void)
{
    PyObject **names[] = {&fp_str_shape, &fp_str_stride, &fp_str_dtype, &fp_str_device,
                          &fp_str_is_neg, &fp_str_data_ptr, &fp_str_requires_grad,
                          &fp_str_calls, &fp_str_fast, &fp_str_lse_like};
    const char *text[] = {"shape", "stride", "dtype", "device", "is_neg", "data_ptr",
                          "requires_grad", "calls", "fast", "lse_like"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!(*names[i] = PyUnicode_InternFromString(text[i])))
            return NULL;
    if (!(fp_zero = PyFloat_FromDouble(0.0)))
        return NULL;
    return PyModule_Create(&fp_module);
}
