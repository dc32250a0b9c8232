/*
 * flashattn._fastpath's flex(): flex_attention's repeated torch call without gradients done in
 * C, a cache in front of its Python route (flex.flex_any: the walk of each mod's captures and
 * its trace in _flex_cache, the prepared call in _flex_prepared). What a repeated call costs
 * there is mostly that walk, which reads the same objects every time.
 *
 * When the route has run a call from a prepared call, it hands it here (flex_register) with
 * the checks its walks recorded (_fastpath_flex_checks.c). A later call with the same
 * arguments (q, k and v by metadata, the options by value, the mods and the block mask by
 * identity) is served here while every check holds: each read gives the same object, so the
 * route's walk would find the same traces and captures. Then, as _fastpath.c's dense(): new
 * outputs, the data pointers and stream written into the prepared arguments, the library
 * called without the GIL. A check that fails drops the entry and hands the call to the route,
 * which walks, traces and prepares again as it would have.
 *
 * Registering costs the route a good part of its own time, so the route asks first
 * (flex_wanted; flex() decided when it handed the call over): yes for arguments met the second
 * time, and at once after a change that an entry saw, unless the entries before it served no
 * call either: the second such entry in a row makes the route wait 2 calls before the next, each
 * further one twice as many (up to FX_BACKOFF_MAX). So two changes between served calls cost
 * nothing, a new function at every call is never registered, captures that change at every
 * call seldom.
 *
 * A call that records gradients is registered the same way, with its _flex_call._FlexCall
 * instead of prepared arguments (the key tells the two apart): flex() then checks as above and
 * calls the autograd Function's apply with it (flex_grad_apply), which runs the call's kept
 * arguments; the route's walk, trace lookups and signature are what it saves.
 *
 * The argument positions come from bind() by name (flex.FLEX_ARGS); the registered call's
 * fields by name from a dict (_flex_prepared.register).
 */
#include "_fastpath_flex.h"

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

/* A registered call: its fields, what it holds, how many calls it served and its checks; or,
 * with prepared NULL and no checks, the record of a call the route served without registering
 * it (when it will: fx_decide). A call with gradients (grad set) has no fields: prepared is its
 * _FlexCall, out_like and lse_like None. */
typedef struct fx_entry {
    int64_t f[XF_NUM];
    int grad;
    PyObject *prepared; /* _flex_prepared.Prepared: holds what args points to; its names */
    PyObject *out_like, *lse_like; /* lse_like None without an lse */
    PyObject *pins;                /* fx_pins: what holds the ids in the key */
    Py_ssize_t served;             /* calls served */
    long misses;  /* a record: the calls the route serves before it registers one */
    long backoff; /* the misses a change waits for where this entry served no call (0: none) */
    Py_ssize_t count;
    fx_check checks[];
} fx_entry;

static struct {
    PyObject *fallback;    /* flex.flex_any */
    PyObject *local;       /* _flex_prepared._LOCAL, whose "fast" holds a thread's entries */
    PyObject *lse_rows;    /* flex._lse_rows */
    PyObject *grad_apply;  /* _flex_call's FlexFn.apply(query, key, value, call) */
    int cuda;              /* CUDA tensors served too (flex_cuda) */
    Py_ssize_t at[XA_NUM], count;
    PyObject *str_fast, *str_is_cuda;
} fx;

/* The route's decision at the last call flex() did not serve (flex_wanted reads it): the thread,
 * the call's q, score_mod and block_mask (compared, not held) and whether to register it. */
static struct {
    PyThreadState *ts;
    PyObject *q, *mod, *bm;
    int want;
} fx_last;

#define FX_CAPSULE "flashattn._fastpath.flex_entry"
#define FX_CACHE_SIZE 64   /* entries and records a thread keeps (all dropped when full) */
#define FX_BACKOFF_MAX 64L /* the most route calls between registrations that serve nothing */

int fp_flex_bind(PyObject *table)
{
    if (!PyDict_GetItemString(table, "flex_fallback"))
        return 0; /* flex() not bound: its Python side did not ask */
    static const char *const held_names[] = {"flex_fallback", "flex_local", "flex_lse_rows",
                                             "flex_grad_apply"};
    PyObject **slots[] = {&fx.fallback, &fx.local, &fx.lse_rows, &fx.grad_apply};
    enum { N_HELD = sizeof slots / sizeof slots[0] };
    PyObject *held[N_HELD];
    for (int i = 0; i < N_HELD; i++)
        if (!(held[i] = fp_entry(table, held_names[i])))
            return -1;
    if (fp_positions(fp_entry(table, "flex_args"), fx_arg_names, XA_NUM, (1 << XA_NUM) - 1,
                     fx.at, &fx.count) != 0 ||
        fx_checks_bind(table) != 0 || fx_key_bind(table) != 0 ||
        !(fx.str_fast = PyUnicode_InternFromString("fast")) ||
        !(fx.str_is_cuda = PyUnicode_InternFromString("is_cuda")))
        return -1;
    PyObject *cuda = fp_entry(table, "flex_cuda");
    if (!cuda || (fx.cuda = PyObject_IsTrue(cuda)) < 0)
        return -1;
    for (int i = 0; i < N_HELD; i++) {
        Py_INCREF(held[i]);
        *slots[i] = held[i];
    }
    return 0;
}

/* ---- the per-thread cache ---------------------------------------------------------------- */

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

/* cache[key] = value, the cache emptied first when a new key finds it full: 0, or -1 with an
 * exception. */
static int fx_store(PyObject *cache, PyObject *key, PyObject *value)
{
    if (PyDict_Size(cache) >= FX_CACHE_SIZE) {
        const int has = PyDict_Contains(cache, key);
        if (has < 0)
            return -1;
        if (!has)
            PyDict_Clear(cache);
    }
    return PyDict_SetItem(cache, key, value);
}

/* ---- registration ------------------------------------------------------------------------- */

static void fx_entry_free(PyObject *capsule)
{
    fx_entry *e = PyCapsule_GetPointer(capsule, FX_CAPSULE);
    if (!e)
        return;
    for (Py_ssize_t i = 0; i < e->count; i++)
        fx_check_clear(&e->checks[i]);
    Py_XDECREF(e->prepared);
    Py_XDECREF(e->out_like);
    Py_XDECREF(e->lse_like);
    Py_XDECREF(e->pins);
    PyMem_Free(e);
}

/* A record (pins, misses, backoff) in a new capsule, or NULL. */
static PyObject *fx_record(PyObject *pins, long misses, long backoff)
{
    fx_entry *e = PyMem_Calloc(1, sizeof *e);
    if (!e)
        return PyErr_NoMemory();
    PyObject *capsule = PyCapsule_New(e, FX_CAPSULE, fx_entry_free);
    if (!capsule) {
        PyMem_Free(e);
        return NULL;
    }
    Py_INCREF(pins);
    e->pins = pins;
    e->misses = misses;
    e->backoff = backoff;
    return capsule;
}

/* The entry of a registration's arguments in a new capsule (fields None: a call with
 * gradients, prepared its _FlexCall); None where a check is not one C can make; NULL with an
 * exception. */
static PyObject *fx_make_entry(PyObject *const *a, PyObject *prepared, PyObject *fields,
                               PyObject *out_like, PyObject *lse_like, PyObject *checks)
{
    if ((fields != Py_None && !PyDict_Check(fields)) || !PyTuple_Check(checks)) {
        PyErr_SetString(PyExc_TypeError, "flashattn._fastpath.flex_register: fields is a dict "
                                         "or None, and checks a tuple");
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
    if (!(e->pins = fx_pins(a)))
        goto fail;
    e->grad = fields == Py_None;
    for (int i = 0; !e->grad && i < XF_NUM; i++) {
        PyObject *v = fp_entry(fields, fx_field_names[i]);
        if (!v || ((e->f[i] = PyLong_AsLongLong(v)) == -1 && PyErr_Occurred()))
            goto fail;
    }
    for (Py_ssize_t i = 0; i < count; i++, e->count++) {
        const int st = fx_check_parse(PyTuple_GetItem(checks, i), &e->checks[i]);
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

/* The checks flex() makes before it looks anything up: 1 if the arguments are plain (q, k and
 * v exact torch.Tensor, no kernel_options, the flags bools, the scale None or a Python number)
 * and, unless bind()'s flex_cuda is true (FLASHATTN_FLEX_FASTPATH_CUDA=0 makes it false), q
 * is not a CUDA tensor, else 0. */
static int fx_plain_arguments(PyObject *const *a)
{
    for (int i = XA_Q; i <= XA_V; i++)
        if ((PyObject *)Py_TYPE(a[i]) != fp_t.tensor_type)
            return 0;
    if (a[XA_OPTIONS] != Py_None || !PyBool_Check(a[XA_GQA]) || !PyBool_Check(a[XA_LSE]) ||
        (a[XA_SCALE] != Py_None && !fp_is_scalar(a[XA_SCALE])))
        return 0;
    if (fx.cuda)
        return 1;
    PyObject *is_cuda = PyObject_GetAttr(a[XA_Q], fx.str_is_cuda);
    const int cuda = is_cuda ? PyObject_IsTrue(is_cuda) : -1;
    Py_XDECREF(is_cuda);
    if (cuda < 0)
        PyErr_Clear(); /* not served: the route says what is wrong */
    return cuda == 0;
}

/* ---- when the route registers a call ------------------------------------------------------ */

/* Stores a record (pins: fx_pins of a where NULL) under key: 0, or -1 with an exception. */
static int fx_note(PyObject *cache, PyObject *key, PyObject *const *a, PyObject *pins,
                   long misses, long backoff)
{
    PyObject *made = pins ? NULL : fx_pins(a);
    PyObject *rec = pins || made ? fx_record(pins ? pins : made, misses, backoff) : NULL;
    const int st = rec ? fx_store(cache, key, rec) : -1;
    Py_XDECREF(rec);
    Py_XDECREF(made);
    return st;
}

/* The route's decision for call a, whose key has no entry (rec: its record, or NULL): 1 to
 * register it now, 0 not yet (a call met the first time waits for the next); -1 with an
 * exception. */
static int fx_decide(PyObject *cache, PyObject *key, PyObject *const *a, fx_entry *rec)
{
    if (!rec)
        return fx_note(cache, key, a, NULL, 1, 0) != 0 ? -1 : 0;
    return --rec->misses <= 0;
}

/* A check of entry e failed: its key's decision (1: at once where e served calls or e's
 * backoff is 0, else after e's backoff in misses), its record in its place, whose next entry
 * waits twice as long (at least 2) if it too serves nothing; -1 with an exception. */
static int fx_failed(PyObject *cache, PyObject *key, const fx_entry *e)
{
    const long wait = e->served ? 0 : e->backoff;
    long next = 0;
    if (!e->served)
        next = wait == 0 ? 2 : wait * 2 < FX_BACKOFF_MAX ? wait * 2 : FX_BACKOFF_MAX;
    PyObject *pins = e->pins;
    Py_INCREF(pins); /* the entry goes */
    const int st = fx_note(cache, key, NULL, pins, wait, next);
    Py_DECREF(pins);
    return st != 0 ? -1 : wait == 0;
}

/* Records decision want for flex_wanted, at the call a that flex() hands to the route. */
static void fx_remember(PyObject *const *a, int want)
{
    fx_last.ts = PyThreadState_Get();
    fx_last.q = a[XA_Q];
    fx_last.mod = a[XA_SCORE_MOD];
    fx_last.bm = a[XA_BLOCK_MASK];
    fx_last.want = want;
}

/* The entry or record of key in cache (borrowed), NULL where there is none (or with an
 * exception). */
static fx_entry *fx_lookup(PyObject *cache, PyObject *key)
{
    PyObject *capsule = PyDict_GetItemWithError(cache, key);
    return capsule ? PyCapsule_GetPointer(capsule, FX_CAPSULE) : NULL;
}

PyObject *fp_flex_wanted(PyObject *self, PyObject *call)
{
    (void)self;
    PyObject *a[XA_NUM];
    if (!fx.fallback || !PyTuple_Check(call) || !fx_unpack(call, a)) {
        PyErr_SetString(PyExc_ValueError, "flashattn._fastpath.flex_wanted: bound, and the "
                                          "call's arguments in flex_attention's order");
        return NULL;
    }
    if (fx_last.ts == PyThreadState_Get() && fx_last.q == a[XA_Q] &&
        fx_last.mod == a[XA_SCORE_MOD] && fx_last.bm == a[XA_BLOCK_MASK]) {
        fx_last.ts = NULL;
        return PyBool_FromLong(fx_last.want);
    }
    if (!fx_plain_arguments(a)) /* never served in C */
        Py_RETURN_FALSE;
    const int records = fx_records(a, NULL);
    if (records < 0)
        return NULL;
    PyObject *key = fx_key(a, records), *cache = key ? fx_cache(1) : NULL;
    int st = -1;
    if (cache) {
        fx_entry *e = fx_lookup(cache, key);
        st = PyErr_Occurred() ? -1 : e && e->prepared ? 0 : fx_decide(cache, key, a, e);
    }
    Py_XDECREF(cache);
    Py_XDECREF(key);
    return st < 0 ? NULL : PyBool_FromLong(st);
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
    const int records = fx_records(a, NULL);
    if (records < 0)
        return NULL;
    if (records != (fields == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "flashattn._fastpath.flex_register: a call that "
                                          "records gradients is registered without fields");
        return NULL;
    }
    PyObject *key = fx_key(a, records), *cache = key ? fx_cache(1) : NULL, *entry = NULL;
    const fx_entry *rec = cache ? fx_lookup(cache, key) : NULL;
    const long backoff = rec && !rec->prepared ? rec->backoff : 0;
    int st = -1;
    if (cache && !PyErr_Occurred() &&
        (entry = fx_make_entry(a, prepared, fields, out_like, lse_like, checks)) != NULL) {
        if (entry == Py_None) { /* a check C cannot make: asked again seldom */
            st = fx_note(cache, key, a, NULL, FX_BACKOFF_MAX, FX_BACKOFF_MAX);
        } else {
            ((fx_entry *)PyCapsule_GetPointer(entry, FX_CAPSULE))->backoff = backoff;
            st = fx_store(cache, key, entry);
        }
    }
    Py_XDECREF(cache);
    Py_XDECREF(key);
    if (st != 0) {
        Py_XDECREF(entry);
        return NULL;
    }
    if (entry == Py_None)
        return entry;
    Py_DECREF(entry);
    Py_RETURN_TRUE;
}

/* ---- the call ----------------------------------------------------------------------------- */

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

/* The registered call with gradients on q, k and v: its FlexFn's (out, lse), out alone or with
 * its lse's empty rows -inf where return_lse is True. */
static PyObject *fx_run_grad(PyObject *const *qkv, const fx_entry *e, PyObject *want_lse)
{
    PyObject *pair = PyObject_CallFunctionObjArgs(fx.grad_apply, qkv[0], qkv[1], qkv[2],
                                                  e->prepared, NULL);
    if (!pair)
        return NULL;
    PyObject *result = NULL;
    if (!PyTuple_Check(pair) || PyTuple_Size(pair) != 2) {
        PyErr_SetString(PyExc_TypeError, "flashattn._fastpath.flex: the call with gradients "
                                         "gave no (out, lse)");
    } else if (want_lse != Py_True) {
        result = PyTuple_GetItem(pair, 0);
        Py_INCREF(result);
    } else {
        PyObject *rows = PyObject_CallFunctionObjArgs(fx.lse_rows, PyTuple_GetItem(pair, 1),
                                                      NULL);
        if (rows && !(result = PyTuple_Pack(2, PyTuple_GetItem(pair, 0), rows)))
            Py_DECREF(rows);
        else
            Py_XDECREF(rows);
    }
    Py_DECREF(pair);
    return result;
}

/* flex() when the call is a registered one whose checks hold: 1 with *result, 0 when it is
 * not, -1 with an exception. */
static int fx_served(PyObject *const *a, PyObject **result)
{
    fx_last.ts = NULL;
    if (!fx_plain_arguments(a))
        return 0;
    int st = fp_modes_plain();
    if (st <= 0)
        return st;
    int grad;
    const int records = fx_records(a, &grad);
    if (records < 0)
        return -1;
    PyObject *key = fx_key(a, records), *cache = key ? fx_cache(1) : NULL, *capsule = NULL;
    if (!cache || (!(capsule = PyDict_GetItemWithError(cache, key)) && PyErr_Occurred())) {
        st = -1;
    } else {
        Py_XINCREF(capsule); /* held while Python code runs: a check may replace the entry */
        fx_entry *e = capsule ? PyCapsule_GetPointer(capsule, FX_CAPSULE) : NULL;
        if (capsule && !e) {
            st = -1;
        } else if (!e || !e->prepared) {
            st = (st = fx_decide(cache, key, a, e)) < 0 ? -1 : (fx_remember(a, st), 0);
        } else {
            st = 1;
            for (Py_ssize_t i = 0; st == 1 && i < e->count; i++)
                st = fx_check_holds(&e->checks[i], grad);
            if (st == 0)
                st = (st = fx_failed(cache, key, e)) < 0 ? -1 : (fx_remember(a, st), 0);
            else if (st == 1 && (*result = e->grad ? fx_run_grad(a + XA_Q, e, a[XA_LSE])
                                                   : fx_run(a + XA_Q, e, a[XA_LSE] == Py_True)))
                e->served++;
            else
                st = -1;
        }
        Py_XDECREF(capsule);
    }
    Py_XDECREF(cache);
    Py_XDECREF(key);
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
