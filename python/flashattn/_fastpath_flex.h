/*
 * What the two parts of flashattn._fastpath's flex() share: _fastpath_flex.c (the key, the
 * per-thread cache, registration and the call) and _fastpath_flex_checks.c (the checks, read
 * from the tuples _flex_cache.captured and _flex_prepared.register make, and made again at
 * each call).
 */
#ifndef FA_FASTPATH_FLEX_H
#define FA_FASTPATH_FLEX_H

#include "_fastpath.h"

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

/* bind()'s entry the checks use (function_type): 0, or -1 with an exception. */
int fx_checks_bind(PyObject *table);
/* Reads check tuple t into c (its references taken): 1, 0 when it is not one C can make (an
 * unknown op, an item of no dict, an index of no list), -1 with an exception. */
int fx_check_parse(PyObject *t, fx_check *c);
/* Drops the references c holds. */
void fx_check_clear(fx_check *c);
/* 1 if check c holds, 0 if not, -1 with an exception. grad: grad mode is on (a captured
 * tensor must then not require grad). */
int fx_check_holds(const fx_check *c, int grad);
/* t.requires_grad: 1, 0 or -1. */
int fx_requires_grad(PyObject *t);

#endif
