/*
 * flashattn._fastpath: flash_attn_func's commonest torch call done in C. A small call's host
 * time was mostly Python (7.9 of 13.3 µs on the H200 host, the rest the library and the
 * launch); the same steps through the C API cost about 60% of that.
 *
 * dense() takes flash_attn_func's arguments and returns out, or None where the call is not
 * the common one (other types or options, gradients, a compile, trace or mode, a signature
 * not prepared yet): the caller then takes the Python path (_torch_ops.dense_fast, which also
 * prepares the signature for the next call). It repeats _cached.forward_dense_out's steps: the
 * key of the call signature, the prepared call found in _cached's per-thread cache, a new
 * output, the data pointers and the stream written into the prepared arguments, the library
 * called without the GIL (the library validates every call itself).
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
    int bound;
} fp;

static PyObject *fp_str_shape, *fp_str_stride, *fp_str_dtype, *fp_str_device, *fp_str_is_neg,
    *fp_str_data_ptr, *fp_str_requires_grad, *fp_str_calls, *fp_str_fast;
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

/* The rest of dense_fast's checks but q's rank and dtype: 1 if the call is plain eager
 * without dropout or a gradient to record, 0 if not, -1 with an exception. They come before
 * the key is built, so that a call with gradients loses little here before the Python path. */
static int fp_eager_no_grad(PyObject *const *a)
{
    int t = PyObject_IsTrue(a[3]); /* dropout_p */
    if (t != 0)
        return t < 0 ? -1 : 0;
    for (int i = 0; i < FP_NUM_MODES; i++)
        if ((t = fp_call_true(fp.modes[i])) != 0)
            return t < 0 ? -1 : 0;
    if ((t = fp_call_true(fp.grad_enabled)) != 0) {
        if (t < 0)
            return -1;
        for (int i = 0; i < 3; i++) {
            PyObject *r = PyObject_GetAttr(a[i], fp_str_requires_grad);
            if (!r)
                return -1;
            t = PyObject_IsTrue(r);
            Py_DECREF(r);
            if (t != 0)
                return t < 0 ? -1 : 0;
        }
    }
    return 1;
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

/* Sets key[15 ..] (0.0, scale, causal, window, softcap, False) and looks the key up in this
 * thread's cache: the prepared call (a new reference), or NULL, not prepared (no exception) or
 * an error. The default scale is q.shape[3] ** -0.5 as Python computes it (pow). */
static PyObject *fp_prepared_call(PyObject *const *a, PyObject *key, PyObject *shape)
{
    for (int i = 0; i < 6; i++) {
        PyObject *item;
        switch (i) {
        case 0: item = fp_zero, Py_INCREF(item); break; /* dropout_p */
        case 1:
            if (a[4] != Py_None) {
                item = fp_as_float(a[4]);
            } else {
                const double d = PyLong_AsDouble(PyTuple_GetItem(shape, 3));
                item = d == -1.0 && PyErr_Occurred() ? NULL : PyFloat_FromDouble(pow(d, -0.5));
            }
            break;
        case 2: item = a[5], Py_INCREF(item); break; /* causal */
        case 3: item = fp_window(a[6]); break;
        case 4: item = fp_as_float(a[7]); break; /* softcap */
        default: item = Py_False, Py_INCREF(item); break; /* want_lse */
        }
        if (!item || PyTuple_SetItem(key, 15 + i, item) != 0) /* SetItem steals item */
            return NULL;
    }
    PyObject *calls = PyObject_GetAttr(fp.local, fp_str_calls);
    if (!calls) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError))
            PyErr_Clear(); /* this thread has no cache yet */
        return NULL;
    }
    PyObject *call = PyDict_GetItemWithError(calls, key);
    Py_XINCREF(call);
    Py_DECREF(calls);
    return call;
}

/* The prepared call's C side, _cached._CachedCall.fast: eight int64 in this order. */
typedef struct fp_fast {
    int64_t fn;        /* the library's fa_attention_forward */
    int64_t args;      /* its fa_fwd_args */
    int64_t slots[4];  /* the data fields of q, k, v, out in args */
    int64_t stream;    /* the stream field of args, 0 on the CPU */
    int64_t device;    /* CUDA device index, -1 on the CPU */
} fp_fast;

/* 1 with *f filled, 0 if the call has no C side (fast is None), -1 with an exception. */
static int fp_fast_read(PyObject *call, fp_fast *f)
{
    PyObject *fast = PyObject_GetAttr(call, fp_str_fast);
    if (!fast)
        return -1;
    char *bytes = NULL;
    Py_ssize_t size = 0;
    int st = 0;
    if (fast != Py_None) {
        st = PyBytes_AsStringAndSize(fast, &bytes, &size) == 0 ? 1 : -1;
        if (st == 1 && size != (Py_ssize_t)sizeof *f) {
            PyErr_SetString(PyExc_RuntimeError, "flashattn._fastpath: malformed prepared call");
            st = -1;
        }
        if (st == 1)
            memcpy(f, bytes, sizeof *f);
    }
    Py_DECREF(fast);
    return st;
}

/* The call itself: new out, pointers and stream swapped in, the library run without the GIL.
 * Every Python call comes before the first write into the prepared arguments: Python code run
 * in between (a finalizer, say) could make a call of the same signature on this thread, which
 * would write them too. */
static PyObject *fp_run(PyObject *const *a, PyObject *call, const fp_fast *f)
{
    PyObject *out = PyObject_CallFunctionObjArgs(fp.empty_like, a[0], NULL);
    if (!out)
        return NULL;
    PyObject *tensors[4] = {a[0], a[1], a[2], out};
    void *ptrs[4], *stream = NULL;
    for (int i = 0; i < 4; i++)
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
    for (int i = 0; i < 4; i++)
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
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *fp_dense(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *a[11];
    if (!PyArg_UnpackTuple(args, "dense", 11, 11, &a[0], &a[1], &a[2], &a[3], &a[4], &a[5],
                           &a[6], &a[7], &a[8], &a[9], &a[10]))
        return NULL;
    if (!fp.bound || !fp_plain_arguments(a))
        Py_RETURN_NONE;
    int st = fp_eager_no_grad(a);
    if (st <= 0) {
        if (st < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    /* _cached.forward_dense_out's key, item for item; its q shape and dtype serve the last
     * checks (4-D, not fp64). */
    PyObject *key = PyTuple_New(21), *call = NULL, *out = NULL;
    if (!key)
        return NULL;
    st = fp_key_tensor(key, 0, a[0]) == 0 && fp_key_tensor(key, 5, a[1]) == 0 &&
                 fp_key_tensor(key, 10, a[2]) == 0
             ? PyTuple_Size(PyTuple_GetItem(key, 0)) == 4 &&
                   PyTuple_GetItem(key, 2) != fp.float64
             : -1;
    if (st == 1) {
        call = fp_prepared_call(a, key, PyTuple_GetItem(key, 0));
        st = call ? 1 : PyErr_Occurred() ? -1 : 0;
    }
    fp_fast f;
    if (st == 1)
        st = fp_fast_read(call, &f);
    if (st == 1)
        out = fp_run(a, call, &f);
    Py_XDECREF(call);
    Py_DECREF(key);
    if (st == 0)
        Py_RETURN_NONE;
    return out; /* NULL with the exception when st is -1 or the call failed */
}

static PyObject *fp_bind(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[13];
    if (!PyArg_UnpackTuple(args, "bind", 13, 13, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6],
                           &o[7], &o[8], &o[9], &o[10], &o[11], &o[12]))
        return NULL;
    /* o[12]: the version of _CachedCall.fast the Python side writes. */
    if (PyLong_AsLong(o[12]) != 1) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "flashattn._fastpath: layout version mismatch");
        return NULL;
    }
    if (fp.bound)
        Py_RETURN_NONE;
    for (int i = 0; i < 12; i++)
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
    fp.bound = 1;
    Py_RETURN_NONE;
}

static PyMethodDef fp_methods[] = {
    {"dense", fp_dense, METH_VARARGS,
     "dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, "
     "return_attn_probs, learnable_sink) -> out, or None for the Python path"},
    {"bind", fp_bind, METH_VARARGS,
     "bind(Tensor, float64, empty_like, 4 mode checks, is_grad_enabled, local, window_pair, "
     "raw_stream, call_failed, version)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fp_module = {PyModuleDef_HEAD_INIT, "_fastpath", NULL, -1, fp_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fastpath(void); /* the one exported symbol */

PyMODINIT_FUNC PyInit__fastpath(void)
{
    PyObject **names[] = {&fp_str_shape, &fp_str_stride, &fp_str_dtype, &fp_str_device,
                          &fp_str_is_neg, &fp_str_data_ptr, &fp_str_requires_grad,
                          &fp_str_calls, &fp_str_fast};
    const char *text[] = {"shape", "stride", "dtype", "device", "is_neg", "data_ptr",
                          "requires_grad", "calls", "fast"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!(*names[i] = PyUnicode_InternFromString(text[i])))
            return NULL;
    if (!(fp_zero = PyFloat_FromDouble(0.0)))
        return NULL;
    return PyModule_Create(&fp_module);
}
