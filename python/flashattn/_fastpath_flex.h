/*
 * What the three parts of flashattn._fastpath's flex() share: _fastpath_flex.c (the
 * per-thread cache, registration and the call), _fastpath_flex_key.c (a call's key) and
 * _fastpath_flex_checks.c (the checks, read from the tuples _flex_cache.captured and
 * _flex_prepared.register make, and made again at each call).
 */
#ifndef FA_FASTPATH_FLEX_H
#define FA_FASTPATH_FLEX_H

#include "_fastpath.h"

/* flex_attention's arguments, at bind()'s positions (flex.FLEX_ARGS). */
enum fx_arg { XA_Q, XA_K, XA_V, XA_SCORE_MOD, XA_BLOCK_MASK, XA_SCALE, XA_GQA, XA_LSE,
              XA_OPTIONS, XA_NUM };

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

/* _fastpath_flex_key.c. bind()'s entries the key uses (function_type, method_type): 0, or -1
 * with an exception. */
int fx_key_bind(PyObject *table);
/* The key of call a (its arguments at enum fx_arg's positions; records: fx_records): a new
 * tuple, or NULL. */
PyObject *fx_key(PyObject *const *a, int records);
/* What an entry of call a's key holds so that no other object takes the ids in it: a new
 * tuple, or NULL. */
PyObject *fx_pins(PyObject *const *a);
/* Whether call a records gradients (grad mode on, q, k or v requiring grad): 1, 0 or -1 with
 * an exception; *grad (where given) whether grad mode is on. */
int fx_records(PyObject *const *a, int *grad);

#endif
