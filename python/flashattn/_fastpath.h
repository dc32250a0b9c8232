/*
 * What the parts of flashattn._fastpath share: _fastpath.c (the module, bind(), dense() and
 * the helpers below), _fastpath_kv.c (kvcache()) and _fastpath_flex.c (flex(), its checks in
 * _fastpath_flex_checks.c). Torch's and flashattn's objects are
 * the ones bind() hands over; the helpers are the steps every cached call takes.
 */
#ifndef FA_FASTPATH_H
#define FA_FASTPATH_H

#define Py_LIMITED_API 0x03080000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#define FP_NUM_MODES 4

/* A library entry point: fa_attention_forward or fa_attention_kvcache on its args struct. */
typedef int (*fa_call_fn)(void *args);

/* What bind() was given that both parts use: borrowed from torch and flashattn's modules,
 * held for good. */
typedef struct fp_torch {
    PyObject *tensor_type;         /* torch.Tensor: subclasses take the Python path */
    PyObject *empty_like;          /* torch.empty_like */
    PyObject *modes[FP_NUM_MODES]; /* callables; a true result means not plain eager (the caller
                                    * checked torch.compiler.is_compiling()) */
    PyObject *grad_enabled;        /* torch.is_grad_enabled */
    PyObject *local;               /* _cached._LOCAL, whose "calls" is the per-thread cache */
    PyObject *window_pair;         /* _core.window_pair */
    PyObject *raw_stream;          /* device index -> current CUDA stream handle */
    PyObject *failed;              /* _cached._call_failed(call, status): raises */
} fp_torch;

extern fp_torch fp_t;

/* Interned attribute names. */
extern PyObject *fp_str_shape, *fp_str_stride, *fp_str_dtype, *fp_str_device, *fp_str_is_neg,
    *fp_str_data_ptr, *fp_str_requires_grad, *fp_str_calls, *fp_str_fast, *fp_str_ws_like;

/* x is a plain Python float or int (not bool), as type(x) in (float, int). */
int fp_is_scalar(PyObject *x);
/* 1 if fn() is true, 0 if not, -1 with an exception. */
int fp_call_true(PyObject *fn);
/* 1 if no mode, transform or tracer intercepts torch ops, 0 if one does, -1. */
int fp_modes_plain(void);
/* (shape, stride(), dtype, device, is_neg()) of t, the signature of one tensor (_cached's
 * _signature and dense_key): a new tuple, or NULL. */
PyObject *fp_tensor_signature(PyObject *t);
/* Sets key[at .. at+4] to t's signature items; -1 with an exception. */
int fp_key_tensor(PyObject *key, Py_ssize_t at, PyObject *t);
/* 1 if the call records a gradient (grad mode on, one of tensors[0 .. n) requiring it; NULL
 * and None skipped), 0 if not, -1 with an exception. */
int fp_records_grad(PyObject *const *tensors, int n);
/* t.data_ptr() into *ptr; -1 with an exception. */
int fp_data_ptr(PyObject *t, void **ptr);
/* _core.window_pair(w) (a new reference). */
PyObject *fp_window(PyObject *w);
/* The call prepared under key in this thread's cache, whose C side (its "fast" bytes, count
 * int64 fields) is copied into fields: 1 with a new reference in *call, 0 if there is none (or
 * it has no C side), -1 with an exception. */
int fp_prepared(PyObject *key, Py_ssize_t count, PyObject **call, int64_t *fields);
/* torch.empty_like(obj.name) (a new tensor, *made 1), or None when obj.name is None (*made 0);
 * NULL with an exception. */
PyObject *fp_new_like(PyObject *obj, PyObject *name, int *made);
/* The library's entry point fn on args, without the GIL; on failure raises through
 * _cached._call_failed(call, status) and returns -1. */
int fp_call_library(int64_t fn, int64_t args, PyObject *call);
/* table[name] (borrowed), or NULL with an exception naming the entry. */
PyObject *fp_entry(PyObject *table, const char *name);
/* Where each of names[0 .. n) sits in the tuple of strings order (-1: absent, or an error if
 * bit i of required is set); *count: its length. 0, or -1 with an exception. */
int fp_positions(PyObject *order, const char *const *names, int n, int required, Py_ssize_t *at,
                 Py_ssize_t *count);

/* _fastpath_kv.c: bind()'s entries for kvcache() (0, or -1 with an exception), and kvcache(). */
int fp_kv_bind(PyObject *table);
PyObject *fp_kvcache(PyObject *self, PyObject *args);

/* _fastpath_flex.c: bind()'s entries for flex() (0, or -1 with an exception), flex(),
 * flex_register() and flex_wanted(). */
int fp_flex_bind(PyObject *table);
PyObject *fp_flex(PyObject *self, PyObject *args);
PyObject *fp_flex_register(PyObject *self, PyObject *args);
PyObject *fp_flex_wanted(PyObject *self, PyObject *call);

#endif
