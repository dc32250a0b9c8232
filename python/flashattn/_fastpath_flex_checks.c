/*
 * The checks of flashattn._fastpath's flex() (_fastpath_flex.h): what a call's walk of its mods'
 * captures read, as _flex_cache.captured records it (each read as the container, how it was
 * read and the object found), the block mask's attributes and tensor versions
 * (flex._block_mask_checks) and the captured tensors' metadata (_flex_prepared.register). A
 * check is made again at each call by the same read in C: objects compared by identity,
 * lengths, versions and data pointers by value, shapes and strides by equality.
 */
#include "_fastpath_flex.h"

/* The checks, by the names _flex_cache.captured and _flex_prepared.register give them. */
enum fx_op { XO_CELL, XO_EMPTY_CELL, XO_ITEM, XO_ABSENT, XO_LEN, XO_INDEX, XO_ATTR,
             XO_NOT_FUNCTION, XO_TYPE, XO_META, XO_AUX, XO_VERSION, XO_NUM };
static const char *const fx_op_names[XO_NUM] = {
    "cell", "empty_cell", "item", "absent", "len", "index", "attr", "not_function", "type",
    "meta", "aux", "version"};
/* Items of each op's tuple after its name. */
static const int fx_op_items[XO_NUM] = {2, 1, 3, 2, 2, 3, 3, 2, 2, 4, 6, 2};

static struct {
    PyObject *function_type; /* types.FunctionType */
    PyObject *str_cell_contents, *str_version, *op_names[XO_NUM];
} fc;

int fx_checks_bind(PyObject *table)
{
    PyObject *function_type = fp_entry(table, "function_type");
    if (!function_type || !(fc.str_cell_contents = PyUnicode_InternFromString("cell_contents")) ||
        !(fc.str_version = PyUnicode_InternFromString("_version")))
        return -1;
    for (int i = 0; i < XO_NUM; i++)
        if (!(fc.op_names[i] = PyUnicode_InternFromString(fx_op_names[i])))
            return -1;
    Py_INCREF(function_type);
    fc.function_type = function_type;
    return 0;
}

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
int fx_requires_grad(PyObject *t)
{
    PyObject *r = PyObject_GetAttr(t, fp_str_requires_grad);
    const int st = r ? PyObject_IsTrue(r) : -1;
    Py_XDECREF(r);
    return st;
}

/* 1 if t._version is version, 0 if not, -1. */
static int fx_version_is(PyObject *t, long long version)
{
    PyObject *x = PyObject_GetAttr(t, fc.str_version);
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

int fx_check_holds(const fx_check *c, int grad)
{
    PyObject *x = NULL;
    int st;
    switch (c->op) {
    case XO_CELL:
    case XO_EMPTY_CELL:
        x = PyObject_GetAttr(c->obj, fc.str_cell_contents);
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
        st = c->op == XO_ATTR ? x == c->want : (PyObject *)Py_TYPE(x) != fc.function_type;
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

int fx_check_parse(PyObject *t, fx_check *c)
{
    if (!PyTuple_Check(t) || PyTuple_Size(t) < 1)
        return 0;
    c->op = -1;
    for (int i = 0; i < XO_NUM && c->op < 0; i++) {
        const int eq = PyObject_RichCompareBool(PyTuple_GetItem(t, 0), fc.op_names[i], Py_EQ);
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

void fx_check_clear(fx_check *c)
{
    Py_CLEAR(c->obj);
    Py_CLEAR(c->key);
    Py_CLEAR(c->want);
    Py_CLEAR(c->want2);
    Py_CLEAR(c->dtype);
}
