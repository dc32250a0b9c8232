/*
 * flashattn._fastpath's flex(): flex_attention's repeated torch call without gradients done in
 * C, a cache in front of its Python route (flex.flex_any: the walk of each mod's captures and
 * its trace in _flex_cache, the prepared call in _flex_prepared). What a repeated call costs
 * there is mostly that walk, which reads the same objects every time.
 *
 * When the route has run a call from a prepared call, it hands it here (flex_register) with
 * the checks its walks recorded (_flex_cache.captured describes them: each read the walk made,
 * as the container, how it was read and the object found; the block mask's attributes and
 * tensor versions; the captured tensors' identity, version, data, shape, strides and dtype).
 * A later call with the same arguments (q, k and v by metadata, the options by value, the mods
 * and the block mask by identity) is served here while every check holds: each read gives the
 * same object, so the route's walk would find the same traces and captures. Then, as
 * _fastpath.c's dense(): new outputs, the data pointers and stream written into the prepared
 * arguments, the library called without the GIL. Any check that fails drops the entry and
 * hands the call to the route, which walks, traces and prepares again as it would have.
 *
 * The argument positions come from bind() by name (flex.FLEX_ARGS); the registered call's
 * fields by name from a dict (_flex_prepared.register).
 */
#include "_fastpath.h"

#include <string.h>

enum fx_arg { XA_Q, XA_K, XA_V, XA_SCORE_MOD, XA_BLOCK_MASK, XA_SCALE, XA_GQA, XA_LSE,
              XA_OPTIONS, XA_NUM };
static const char *const fx_arg_names[XA_NUM] = {
    "query", "key", "value", "score_mod", "block_mask", "scale", "enable_gqa", "return_lse",
    "kernel_options"};

/* The registered call's fields (int64 each): the library's forward and its fa_fwd_args, the
 * data fields of the q, k, v, out and lse FaTensors (lse 0 without one), the args' stream
 * field (0 on the CPU) and the CUDA device index (-1: the CPU). */
enum fx_field { XF_FN, XF_ARGS, XF_Q, XF_K, XF_V, XF_OUT, XF_LSE, XF_STREAM, XF_DEVICE,
                XF_NUM };
static const char *const fx_field_names[XF_NUM] = {"fn",  "args", "q",      "k",     "v",
                                                   "out", "lse",  "stream", "device"};

/* The checks, by the names _flex_cache.captured and _flex_prepared.register give them. */
enum fx_op { XO_CELL, XO_EMPTY_CELL, XO_ITEM, XO_ABSENT, XO_LEN, XO_INDEX, XO_ATTR,
             XO_NOT_FUNCTION, XO_TYPE, XO_META, XO_AUX, XO_VERSION, XO_NUM };
static const char *const fx_op_names[XO_NUM] = {
    "cell", "empty_cell", "item", "absent", "len", "index", "attr", "not_function", "type",
    "meta", "aux", "version"};
/* Items of each op's tuple after its name. */
static const int fx_op_items[XO_NUM] = {2, 1, 3, 2, 2, 3, 3, 2, 2, 4, 6, 2};

/* One check: obj read as op says gives want (by identity); held references. */
typedef struct fx_check {
    int op;
    PyObject *obj;   /* the cell, dict, list, object, type or tensor read */
    PyObject *key;   /* item / absent: the key; attr / not_function: the name */
    PyObject *want;  /* the object found; type: the type; meta / aux: the shape */
    PyObject *want2; /* meta: the device; aux: the strides */
    PyObject *dtype; /* meta / aux */
    Py_ssize_t n;    /* len: the length; index: the index */
    long long version;
    void *data; /* aux: data_ptr() */
} fx_check;

/* A registered call: its fields, what it holds and its checks. */
typedef struct fx_entry {
    int64_t f[XF_NUM];
    PyObject *prepared; /* _flex_prepared.Prepared: holds what args points to; its names */
    PyObject *out_like, *lse_like; /* lse_like None without an lse */
    PyObject *mods;                /* (score_mod, block_mask): their ids are in the key */
    Py_ssize_t count;
    fx_check checks[];
} fx_entry;

static struct {
    PyObject *fallback; /* flex.flex_any */
    PyObject *local;    /* _flex_prepared._LOCAL, whose "fast" is the per-thread cache */
    PyObject *lse_rows; /* flex._lse_rows */
    PyObject *function_type, *method_type; /* types.FunctionType, types.MethodType */
    Py_ssize_t at[XA_NUM], count;
    PyObject *str_fast, *str_cell_contents, *str_version, *str_self, *str_func;
    PyObject *op_names[XO_NUM];
} fx;

#define FX_CAPSULE "flashattn._fastpath.flex_entry"
#define FX_CACHE_SIZE 32

int fp_flex_bind(PyObject *table)
{
    PyObject *held[5] = {fp_entry(table, "flex_fallback"), NULL, NULL, NULL, NULL};
    if (!held[0] || !(held[1] = fp_entry(table, "flex_local")) ||
        !(held[2] = fp_entry(table, "flex_lse_rows")) ||
        !(held[3] = fp_entry(table, "function_type")) ||
        !(held[4] = fp_entry(table, "method_type")) ||
        fp_positions(fp_entry(table, "flex_args"), fx_arg_names, XA_NUM, (1 << XA_NUM) - 1,
                     fx.at, &fx.count) != 0)
        return -1;
    if (!(fx.str_fast = PyUnicode_InternFromString("fast")) ||
        !(fx.str_cell_contents = PyUnicode_InternFromString("cell_contents")) ||
        !(fx.str_version = PyUnicode_InternFromString("_version")) ||
        !(fx.str_self = PyUnicode_InternFromString("__self__")) ||
        !(fx.str_func = PyUnicode_InternFromString("__func__")))
        return -1;
    for (int i = 0; i < XO_NUM; i++)
        if (!(fx.op_names[i] = PyUnicode_InternFromString(fx_op_names[i])))
            return -1;
    PyObject **slots[5] = {&fx.fallback, &fx.local, &fx.lse_rows, &fx.function_type,
                           &fx.method_type};
    for (int i = 0; i < 5; i++) {
        Py_INCREF(held[i]);
        *slots[i] = held[i];
    }
    return 0;
}

/* ---- the key and the per-thread cache --------------------------------------------------- */

/* An object's identity as the key holds it (None stays None; a bound method, new at each
 * attribute read, by the identities of its object and function, all the walk reads of it): a
 * new reference. */
static PyObject *fx_identity(PyObject *x)
{
    if (x == Py_None) {
        Py_INCREF(x);
        return x;
    }
    if ((PyObject *)Py_TYPE(x) != fx.method_type)
        return PyLong_FromVoidPtr(x);
    PyObject *self = PyObject_GetAttr(x, fx.str_self), *func = NULL, *pair = NULL;
    if (self && (func = PyObject_GetAttr(x, fx.str_func)) != NULL)
        pair = Py_BuildValue("(NN)", PyLong_FromVoidPtr(self), PyLong_FromVoidPtr(func));
    Py_XDECREF(self);
    Py_XDECREF(func);
    return pair;
}

/* The key of a call: (shape, stride(), dtype, device, is_neg()) of q, k and v, the scale,
 * enable_gqa and return_lse as given, the identities of score_mod and block_mask. A new tuple
 * or NULL. */
static PyObject *fx_key(PyObject *const *a)
{
    PyObject *key = PyTuple_New(20);
    if (!key)
        return NULL;
    for (int i = XA_Q; i <= XA_V; i++)
        if (fp_key_tensor(key, 5 * i, a[i]) != 0)
            goto fail;
    PyObject *tail[5] = {a[XA_SCALE], a[XA_GQA], a[XA_LSE], NULL, NULL};
    for (int i = 0; i < 5; i++) {
        if (i < 3)
            Py_INCREF(tail[i]);
        else if (!(tail[i] = fx_identity(a[i == 3 ? XA_SCORE_MOD : XA_BLOCK_MASK])))
            goto fail;
        if (PyTuple_SetItem(key, 15 + i, tail[i]) != 0) /* steals tail[i] */
            goto fail;
    }
    return key;
fail:
    Py_DECREF(key);
    return NULL;
}

/* This thread's cache (a new reference), made if there is none and make is set; NULL without
 * an exception where there is none, NULL with one on a failure. */
static PyObject *fx_cache(int make)
{
    PyObject *cache = PyObject_GetAttr(fx.local, fx.str_fast);
    if (cache || !PyErr_ExceptionMatches(PyExc_AttributeError))
        return cache;
    PyErr_Clear();
    if (!make)
        return NULL;
    cache = PyDict_New();
    if (cache && PyObject_SetAttr(fx.local, fx.str_fast, cache) != 0)
        Py_CLEAR(cache);
    return cache;
}

/* ---- the checks --------------------------------------------------------------------------- */

/* PyObject_GetAttr that reads an AttributeError as no attribute: 1 with *x, 0 without, -1. */
static int fx_getattr(PyObject *obj, PyObject *name, PyObject **x)
{
    *x = PyObject_GetAttr(obj, name);
    if (*x)
        return 1;
    if (!PyErr_ExceptionMatches(PyExc_AttributeError))
        return -1;
    PyErr_Clear();
    return 0;
}

/* 1 if t.name() (call set) or t.name equals want (by identity where same is set, else by
 * value), 0 if not, -1 with an exception. */
static int fx_tensor_is(PyObject *t, PyObject *name, int call, PyObject *want, int same)
{
    PyObject *x = call ? PyObject_CallMethodObjArgs(t, name, NULL) : PyObject_GetAttr(t, name);
    if (!x)
        return -1;
    const int eq = same ? x == want : PyObject_RichCompareBool(x, want, Py_EQ);
    Py_DECREF(x);
    return eq;
}

/* t.requires_grad: 1, 0 or -1. */
static int fx_requires_grad(PyObject *t)
{
    PyObject *r = PyObject_GetAttr(t, fp_str_requires_grad);
    const int st = r ? PyObject_IsTrue(r) : -1;
    Py_XDECREF(r);
    return st;
}

/* 1 if t._version is version, 0 if not, -1. */
static int fx_version_is(PyObject *t, long long version)
{
    PyObject *x = PyObject_GetAttr(t, fx.str_version);
    if (!x)
        return -1;
    const long long v = PyLong_AsLongLong(x);
    Py_DECREF(x);
    return v == -1 && PyErr_Occurred() ? -1 : v == version;
}

/* An aux tensor as registered (and, where grad records, not requiring it): 1, 0 or -1. */
static int fx_aux_holds(const fx_check *c, int grad)
{
    int st = fx_version_is(c->obj, c->version);
    if (st == 1) {
        void *data = NULL;
        st = fp_data_ptr(c->obj, &data) != 0 ? -1 : data == c->data;
    }
    if (st == 1)
        st = fx_tensor_is(c->obj, fp_str_shape, 0, c->want, 0);
    if (st == 1)
        st = fx_tensor_is(c->obj, fp_str_stride, 1, c->want2, 0);
    if (st == 1)
        st = fx_tensor_is(c->obj, fp_str_dtype, 0, c->dtype, 1);
    if (st == 1 && grad)
        st = (st = fx_requires_grad(c->obj)) < 0 ? -1 : !st;
    return st;
}

/* 1 if check c holds, 0 if not, -1 with an exception. grad: grad mode is on. */
static int fx_holds(const fx_check *c, int grad)
{
    PyObject *x = NULL;
    int st;
    switch (c->op) {
    case XO_CELL:
    case XO_EMPTY_CELL:
        x = PyObject_GetAttr(c->obj, fx.str_cell_contents);
        if (!x) {
            if (!PyErr_ExceptionMatches(PyExc_ValueError))
                return -1;
            PyErr_Clear(); /* an empty cell */
            return c->op == XO_EMPTY_CELL;
        }
        st = c->op == XO_CELL && x == c->want;
        Py_DECREF(x);
        return st;
    case XO_ITEM:
    case XO_ABSENT: /* borrowed */
        x = PyDict_GetItemWithError(c->obj, c->key);
        if (!x && PyErr_Occurred())
            return -1;
        return c->op == XO_ITEM ? x == c->want : x == NULL;
    case XO_LEN: {
        const Py_ssize_t n = PyObject_Size(c->obj);
        return n < 0 ? -1 : n == c->n;
    }
    case XO_INDEX: /* borrowed; the length was checked first */
        x = PyList_GetItem(c->obj, c->n);
        if (!x) {
            if (!PyErr_ExceptionMatches(PyExc_IndexError))
                return -1;
            PyErr_Clear();
        }
        return x == c->want;
    case XO_ATTR:
    case XO_NOT_FUNCTION:
        st = fx_getattr(c->obj, c->key, &x);
        if (st <= 0)
            return st < 0 ? -1 : c->op == XO_NOT_FUNCTION;
        st = c->op == XO_ATTR ? x == c->want : (PyObject *)Py_TYPE(x) != fx.function_type;
        Py_DECREF(x);
        return st;
    case XO_TYPE:
        return (PyObject *)Py_TYPE(c->obj) == c->want;
    case XO_META:
        st = fx_tensor_is(c->obj, fp_str_shape, 0, c->want, 0);
        if (st == 1)
            st = fx_tensor_is(c->obj, fp_str_dtype, 0, c->dtype, 1);
        if (st == 1)
            st = fx_tensor_is(c->obj, fp_str_device, 0, c->want2, 0);
        return st;
    case XO_AUX:
        return fx_aux_holds(c, grad);
    default: /* XO_VERSION */
        return fx_version_is(c->obj, c->version);
    }
}

/* ---- registration ------------------------------------------------------------------------- */

static void fx_entry_free(PyObject *capsule)
{
    fx_entry *e = PyCapsule_GetPointer(capsule, FX_CAPSULE);
    if (!e)
        return;
    for (Py_ssize_t i = 0; i < e->count; i++) {
        fx_check *c = &e->checks[i];
        Py_XDECREF(c->obj);
        Py_XDECREF(c->key);
        Py_XDECREF(c->want);
        Py_XDECREF(c->want2);
        Py_XDECREF(c->dtype);
    }
    Py_XDECREF(e->prepared);
    Py_XDECREF(e->out_like);
    Py_XDECREF(e->lse_like);
    Py_XDECREF(e->mods);
    PyMem_Free(e);
}

/* Reads check tuple t into c (its references taken): 1, 0 when it is not one C can make (an
 * unknown op, an item of no dict, an index of no list), -1 with an exception. */
static int fx_parse_check(PyObject *t, fx_check *c)
{
    if (!PyTuple_Check(t) || PyTuple_Size(t) < 1)
        return 0;
    c->op = -1;
    for (int i = 0; i < XO_NUM && c->op < 0; i++) {
        const int eq = PyObject_RichCompareBool(PyTuple_GetItem(t, 0), fx.op_names[i], Py_EQ);
        if (eq < 0)
            return -1;
        if (eq)
            c->op = i;
    }
    if (c->op < 0 || PyTuple_Size(t) != 1 + fx_op_items[c->op])
        return 0;
    PyObject *item[6] = {NULL};
    for (int i = 0; i < fx_op_items[c->op]; i++)
        item[i] = PyTuple_GetItem(t, 1 + i);
    PyObject **to[6] = {&c->obj, NULL, NULL, NULL, NULL, NULL}; /* where each item goes */
    switch (c->op) {
    case XO_ITEM:
        to[2] = &c->want;
        /* fall through */
    case XO_ABSENT:
        if (!PyDict_Check(item[0]))
            return 0;
        to[1] = &c->key;
        break;
    case XO_INDEX:
        if (!PyList_Check(item[0]))
            return 0;
        to[2] = &c->want;
        /* fall through */
    case XO_LEN:
        c->n = PyLong_AsSsize_t(item[1]);
        break;
    case XO_ATTR:
        to[2] = &c->want;
        /* fall through */
    case XO_NOT_FUNCTION:
        to[1] = &c->key;
        break;
    case XO_CELL:
    case XO_TYPE:
        to[1] = &c->want;
        break;
    case XO_META: /* shape, dtype, device */
        to[1] = &c->want;
        to[2] = &c->dtype;
        to[3] = &c->want2;
        break;
    case XO_AUX: /* version, data_ptr, shape, strides, dtype */
        c->version = PyLong_AsLongLong(item[1]);
        c->data = PyLong_AsVoidPtr(item[2]);
        to[3] = &c->want;
        to[4] = &c->want2;
        to[5] = &c->dtype;
        break;
    case XO_VERSION:
        c->version = PyLong_AsLongLong(item[1]);
        break;
    default: /* XO_EMPTY_CELL: the cell alone */
        break;
    }
    if (PyErr_Occurred())
        return -1;
    for (int i = 0; i < 6; i++) {
        if (to[i]) {
            Py_INCREF(item[i]);
            *to[i] = item[i];
        }
    }
    return 1;
}

/* The entry of a registration's arguments in a new capsule; None where a check is not one C
 * can make; NULL with an exception. */
static PyObject *fx_make_entry(PyObject *const *a, PyObject *prepared, PyObject *fields,
                               PyObject *out_like, PyObject *lse_like, PyObject *checks)
{
    if (!PyDict_Check(fields) || !PyTuple_Check(checks)) {
        PyErr_SetString(PyExc_TypeError, "flashattn._fastpath.flex_register: fields is a dict "
                                         "and checks a tuple");
        return NULL;
    }
    const Py_ssize_t count = PyTuple_Size(checks);
    fx_entry *e = PyMem_Calloc(1, sizeof *e + (size_t)count * sizeof(fx_check));
    if (!e)
        return PyErr_NoMemory();
    PyObject *capsule = PyCapsule_New(e, FX_CAPSULE, fx_entry_free);
    if (!capsule) {
        PyMem_Free(e);
        return NULL;
    }
    PyObject *held[3] = {prepared, out_like, lse_like};
    PyObject **slots[3] = {&e->prepared, &e->out_like, &e->lse_like};
    for (int i = 0; i < 3; i++) {
        Py_INCREF(held[i]);
        *slots[i] = held[i];
    }
    if (!(e->mods = PyTuple_Pack(2, a[XA_SCORE_MOD], a[XA_BLOCK_MASK])))
        goto fail;
    for (int i = 0; i < XF_NUM; i++) {
        PyObject *v = fp_entry(fields, fx_field_names[i]);
        if (!v || ((e->f[i] = PyLong_AsLongLong(v)) == -1 && PyErr_Occurred()))
            goto fail;
    }
    for (Py_ssize_t i = 0; i < count; i++, e->count++) {
        const int st = fx_parse_check(PyTuple_GetItem(checks, i), &e->checks[i]);
        if (st < 0)
            goto fail;
        if (st == 0) {
            Py_DECREF(capsule);
            Py_RETURN_NONE;
        }
    }
    return capsule;
fail:
    Py_DECREF(capsule);
    return NULL;
}

/* The arguments of a call at fx.at's positions into a: 1, or 0 for another count. */
static int fx_unpack(PyObject *args, PyObject **a)
{
    if (PyTuple_Size(args) != fx.count)
        return 0;
    for (int i = 0; i < XA_NUM; i++)
        a[i] = PyTuple_GetItem(args, fx.at[i]);
    return 1;
}

PyObject *fp_flex_register(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *call, *prepared, *fields, *out_like, *lse_like, *checks, *a[XA_NUM];
    if (!fx.fallback) {
        PyErr_SetString(PyExc_RuntimeError, "flashattn._fastpath: bind() was not called");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!OOOOO:flex_register", &PyTuple_Type, &call, &prepared,
                          &fields, &out_like, &lse_like, &checks))
        return NULL;
    if (!fx_unpack(call, a)) {
        PyErr_SetString(PyExc_ValueError, "flashattn._fastpath.flex_register: the call's "
                                          "arguments are not flex_attention's");
        return NULL;
    }
    PyObject *entry = fx_make_entry(a, prepared, fields, out_like, lse_like, checks);
    if (!entry || entry == Py_None)
        return entry;
    PyObject *key = fx_key(a), *cache = key ? fx_cache(1) : NULL;
    int st = cache ? 0 : -1;
    if (cache && PyDict_Size(cache) >= FX_CACHE_SIZE)
        PyDict_Clear(cache);
    if (cache)
        st = PyDict_SetItem(cache, key, entry);
    Py_XDECREF(cache);
    Py_XDECREF(key);
    Py_DECREF(entry);
    if (st != 0)
        return NULL;
    Py_RETURN_TRUE;
}

/* ---- the call ----------------------------------------------------------------------------- */

/* The checks flex() makes before it looks anything up: 1 if the arguments are plain (q, k and
 * v exact torch.Tensor, no kernel_options, the flags bools, the scale None or a Python number),
 * else 0. */
static int fx_plain_arguments(PyObject *const *a)
{
    for (int i = XA_Q; i <= XA_V; i++)
        if ((PyObject *)Py_TYPE(a[i]) != fp_t.tensor_type)
            return 0;
    return a[XA_OPTIONS] == Py_None && PyBool_Check(a[XA_GQA]) && PyBool_Check(a[XA_LSE]) &&
           (a[XA_SCALE] == Py_None || fp_is_scalar(a[XA_SCALE]));
}

/* The registered call on q, k and v: new out (and lse), pointers and stream written, the
 * library run without the GIL; out, or (out, lse with its empty rows -inf). As in _fastpath.c's
 * fp_run, every Python call comes before the first write into the prepared arguments. */
static PyObject *fx_run(PyObject *const *qkv, const fx_entry *e, int want_lse)
{
    PyObject *out = PyObject_CallFunctionObjArgs(fp_t.empty_like, e->out_like, NULL);
    PyObject *lse = NULL, *result = NULL;
    if (!out)
        return NULL;
    if (want_lse && !(lse = PyObject_CallFunctionObjArgs(fp_t.empty_like, e->lse_like, NULL)))
        goto done;
    PyObject *tensors[5] = {qkv[0], qkv[1], qkv[2], out, lse};
    void *ptrs[5], *stream = NULL;
    const int n = want_lse ? 5 : 4;
    for (int i = 0; i < n; i++)
        if (fp_data_ptr(tensors[i], &ptrs[i]) != 0)
            goto done;
    if (e->f[XF_DEVICE] >= 0) {
        PyObject *s = PyObject_CallFunction(fp_t.raw_stream, "L", (long long)e->f[XF_DEVICE]);
        if (!s)
            goto done;
        stream = PyLong_AsVoidPtr(s);
        Py_DECREF(s);
        if (!stream && PyErr_Occurred())
            goto done;
    }
    for (int i = 0; i < n; i++)
        *(void **)(uintptr_t)e->f[XF_Q + i] = ptrs[i];
    if (e->f[XF_DEVICE] >= 0)
        *(void **)(uintptr_t)e->f[XF_STREAM] = stream;
    if (fp_call_library(e->f[XF_FN], e->f[XF_ARGS], e->prepared) != 0)
        goto done;
    if (!want_lse) {
        result = out;
        out = NULL;
    } else {
        PyObject *rows = PyObject_CallFunctionObjArgs(fx.lse_rows, lse, NULL);
        if (rows && !(result = PyTuple_Pack(2, out, rows)))
            Py_DECREF(rows);
        else
            Py_XDECREF(rows);
    }
done:
    Py_XDECREF(out);
    Py_XDECREF(lse);
    return result;
}

/* flex() when the call is a registered one whose checks hold: 1 with *result, 0 when it is
 * not, -1 with an exception. */
static int fx_served(PyObject *const *a, PyObject **result)
{
    if (!fx_plain_arguments(a))
        return 0;
    int st = fp_modes_plain();
    if (st <= 0)
        return st;
    const int grad = fp_call_true(fp_t.grad_enabled);
    if (grad < 0)
        return -1;
    for (int i = XA_Q; grad && i <= XA_V; i++) /* with gradients: the route's autograd */
        if ((st = fx_requires_grad(a[i])) != 0)
            return st < 0 ? -1 : 0;
    PyObject *cache = fx_cache(0);
    if (!cache)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *key = fx_key(a), *capsule = NULL;
    if (key && !(capsule = PyDict_GetItemWithError(cache, key)) && !PyErr_Occurred())
        st = 0;
    else if (capsule) {
        Py_INCREF(capsule); /* held while Python code runs: a check may replace the entry */
        const fx_entry *e = PyCapsule_GetPointer(capsule, FX_CAPSULE);
        st = e ? 1 : -1;
        for (Py_ssize_t i = 0; st == 1 && i < e->count; i++)
            st = fx_holds(&e->checks[i], grad);
        if (st == 0 && PyDict_DelItem(cache, key) != 0) /* the route registers it anew */
            PyErr_Clear(); /* already gone: a check's Python code made a call */
        if (st == 1)
            st = (*result = fx_run(a + XA_Q, e, a[XA_LSE] == Py_True)) ? 1 : -1;
        Py_DECREF(capsule);
    } else {
        st = -1;
    }
    Py_XDECREF(key);
    Py_DECREF(cache);
    return st;
}

PyObject *fp_flex(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *a[XA_NUM], *result = NULL;
    if (!fx.fallback) {
        PyErr_SetString(PyExc_RuntimeError, "flashattn._fastpath: bind() was not called");
        return NULL;
    }
    const int st = fx_unpack(args, a) ? fx_served(a, &result) : 0;
    if (st != 0)
        return st > 0 ? result : NULL;
    return PyObject_Call(fx.fallback, args, NULL);
}
