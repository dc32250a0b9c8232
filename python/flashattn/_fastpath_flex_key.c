/*
 * The key of a flex() call (_fastpath_flex.c): what the per-thread cache is keyed by and what
 * an entry holds so that the ids in its key stay its objects'. q, k and v by metadata, the
 * options by value, score_mod and the block mask by identity (a plain function by its code and
 * captures, a bound method by its object and function), and whether the call records
 * gradients.
 */
#include "_fastpath_flex.h"

static struct {
    PyObject *function_type, *method_type; /* types.FunctionType, types.MethodType */
    PyObject *empty;                       /* stands for an empty closure cell */
    PyObject *str_self, *str_func, *str_closure, *str_cell_contents;
    PyObject *str_function[4]; /* __code__, __globals__, __defaults__, __kwdefaults__ */
} fk;

int fx_key_bind(PyObject *table)
{
    PyObject *types[2] = {fp_entry(table, "function_type"), fp_entry(table, "method_type")};
    if (!types[0] || !types[1])
        return -1;
    static const char *const names[] = {"__self__", "__func__", "__closure__", "cell_contents",
                                        "__code__", "__globals__", "__defaults__",
                                        "__kwdefaults__"};
    PyObject **strs[] = {&fk.str_self, &fk.str_func, &fk.str_closure, &fk.str_cell_contents,
                         &fk.str_function[0], &fk.str_function[1], &fk.str_function[2],
                         &fk.str_function[3]};
    for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++)
        if (!(*strs[i] = PyUnicode_InternFromString(names[i])))
            return -1;
    if (!(fk.empty = PyObject_CallObject((PyObject *)&PyBaseObject_Type, NULL)))
        return -1;
    Py_INCREF(types[0]);
    Py_INCREF(types[1]);
    fk.function_type = types[0];
    fk.method_type = types[1];
    return 0;
}

/* What the key holds of a plain function: the code, globals, defaults and kwdefaults it has and
 * the objects in its closure cells (fk.empty for an empty one), all that the walk reads of the
 * function itself (_flex_cache.captured records no checks of them for a score_mod), so that a
 * function made anew at each call from the same code and captures (a lambda in a model's
 * forward) is the same key. A new tuple of those objects (ids set: of their ids, which a kept
 * key holds: fx_pins), or NULL. */
static PyObject *fx_function_parts(PyObject *f, int ids)
{
    PyObject *closure = PyObject_GetAttr(f, fk.str_closure), *parts = NULL;
    if (!closure)
        return NULL;
    const Py_ssize_t n = closure == Py_None ? 0 : PyTuple_Size(closure);
    if (n >= 0 && (parts = PyTuple_New(4 + n)) != NULL) {
        for (Py_ssize_t i = 0; i < 4 + n; i++) {
            PyObject *x = i < 4 ? PyObject_GetAttr(f, fk.str_function[i])
                                : PyObject_GetAttr(PyTuple_GetItem(closure, i - 4),
                                                   fk.str_cell_contents);
            if (!x && i >= 4 && PyErr_ExceptionMatches(PyExc_ValueError)) {
                PyErr_Clear(); /* an empty cell */
                Py_INCREF(fk.empty);
                x = fk.empty;
            }
            if (x && ids) {
                PyObject *id = PyLong_FromVoidPtr(x);
                Py_DECREF(x);
                x = id;
            }
            if (!x || PyTuple_SetItem(parts, i, x) != 0) { /* steals x */
                Py_CLEAR(parts);
                break;
            }
        }
    }
    Py_DECREF(closure);
    return parts;
}

/* A tuple of the ids of the items of t: a new reference, or NULL. */
static PyObject *fx_ids(PyObject *t)
{
    const Py_ssize_t n = PyTuple_Size(t);
    PyObject *ids = PyTuple_New(n);
    for (Py_ssize_t i = 0; ids && i < n; i++) {
        PyObject *id = PyLong_FromVoidPtr(PyTuple_GetItem(t, i));
        if (!id || PyTuple_SetItem(ids, i, id) != 0) /* steals id */
            Py_CLEAR(ids);
    }
    return ids;
}

/* score_mod's or the block mask's part of the key: None stays None; a score_mod that is a plain
 * function its parts' ids (fx_function_parts); a bound method, new at each attribute read, the
 * ids of its object and function (all the walk reads of it); anything else its id. A new
 * reference, or NULL. */
static PyObject *fx_identity(PyObject *x, int mod)
{
    if (x == Py_None) {
        Py_INCREF(x);
        return x;
    }
    if (mod && (PyObject *)Py_TYPE(x) == fk.function_type)
        return fx_function_parts(x, 1);
    if ((PyObject *)Py_TYPE(x) != fk.method_type)
        return PyLong_FromVoidPtr(x);
    PyObject *parts = Py_BuildValue("(NN)", PyObject_GetAttr(x, fk.str_self),
                                    PyObject_GetAttr(x, fk.str_func));
    PyObject *ids = parts ? fx_ids(parts) : NULL;
    Py_XDECREF(parts);
    return ids;
}

/* What a kept key holds so that no other object takes the ids in it: (score_mod, block_mask,
 * score_mod's parts where it is a plain function). A new reference, or NULL. */
PyObject *fx_pins(PyObject *const *a)
{
    PyObject *mod = a[XA_SCORE_MOD];
    if ((PyObject *)Py_TYPE(mod) != fk.function_type)
        return PyTuple_Pack(2, mod, a[XA_BLOCK_MASK]);
    PyObject *parts = fx_function_parts(mod, 0);
    PyObject *pins = parts ? Py_BuildValue("(OOO)", mod, a[XA_BLOCK_MASK], parts) : NULL;
    Py_XDECREF(parts);
    return pins;
}

/* The key of a call: (shape, stride(), dtype, device, is_neg()) of q, k and v, the scale,
 * enable_gqa and return_lse as given, the identities of score_mod and block_mask, whether it
 * records gradients (records: fx_records). A new tuple or NULL. */
PyObject *fx_key(PyObject *const *a, int records)
{
    PyObject *key = PyTuple_New(21);
    if (!key)
        return NULL;
    for (int i = XA_Q; i <= XA_V; i++)
        if (fp_key_tensor(key, 5 * i, a[i]) != 0)
            goto fail;
    PyObject *tail[5] = {a[XA_SCALE], a[XA_GQA], a[XA_LSE], NULL, NULL};
    for (int i = 0; i < 5; i++) {
        if (i < 3)
            Py_INCREF(tail[i]);
        else if (!(tail[i] = fx_identity(a[i == 3 ? XA_SCORE_MOD : XA_BLOCK_MASK], i == 3)))
            goto fail;
        if (PyTuple_SetItem(key, 15 + i, tail[i]) != 0) /* steals tail[i] */
            goto fail;
    }
    PyObject *flag = PyBool_FromLong(records);
    if (PyTuple_SetItem(key, 20, flag) != 0) /* steals flag */
        goto fail;
    return key;
fail:
    Py_DECREF(key);
    return NULL;
}

/* Whether call a records gradients (grad mode on, q, k or v requiring grad): 1, 0 or -1 with
 * an exception. *grad (where given): whether grad mode is on. */
int fx_records(PyObject *const *a, int *grad)
{
    const int on = fp_call_true(fp_t.grad_enabled);
    if (grad)
        *grad = on;
    if (on <= 0)
        return on;
    for (int i = XA_Q; i <= XA_V; i++) {
        const int st = fx_requires_grad(a[i]);
        if (st != 0)
            return st;
    }
    return 0;
}
