"""What a traced mod becomes and how long it is kept: the captures that key the cache, the
``Trace`` of a mod, and its C programs (fa_mod, one per assignment of aux slots).

``trace`` keeps what it traced per (function code, what the function captures): the tensors
and numbers reached through its closure, globals, defaults and captured objects' attributes
(and those of the functions it captures, as ``and_masks`` does); a changed number or a tensor
of another shape or dtype traces again. Captured tensors are read afresh at every call (their
current values); a tensor reached another way (a module's attribute, a tensor made inside the
mod) is bound by identity at the first trace.
"""

import collections
import ctypes
import functools
import sys
import threading
import types

from . import _lib
from ._flex_trace import AUX_SLOTS, OP_CODE, Graph, operands
from ._lib import FlashAttnError


# ---- discovery of what a mod captures ----------------------------------------------------


def _code_names(code, out):
    out.update(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code_names(c, out)
    return out


@functools.lru_cache(maxsize=1024)
def _global_names(code):
    """The names code and the code inside it read, sorted: once per code object, since a
    repeated call walks the same functions."""
    return tuple(sorted(_code_names(code, set())))


_MAX_VISITS = 4096  # objects one discovery walks at most


def captured(fn, checks=None, keyed=False):
    """[(path, object)]: what fn's trace depends on. The tensors, arrays and numbers it reaches
    through closures, globals, defaults and the attributes of captured objects, recursively
    through captured functions and small lists, tuples and dicts; the code of each function and
    the identity of each class or builtin it reaches.

    With a list ``checks``, each read the walk makes is appended to it as a check that
    _fastpath (C) repeats on a later call: while every check holds, the walk would find the
    same objects (tuples, code, method objects and closure tuples are immutable and need
    none). ("cell", cell, obj) / ("empty_cell", cell); ("item", dict, key, obj) /
    ("absent", dict, key); ("len", list or dict, n); ("index", list, i, obj); ("attr", obj,
    name, value); ("not_function", type, name): getattr gives no Python function; ("type",
    obj, type); ("unsupported",) where a read has no such check (the call is not served in C).
    Objects are compared by identity, lengths by value. keyed: fn's own reads, where it is a
    plain function (its code, defaults, kwdefaults and closure cells' contents), are in the
    caller's key (_fastpath_flex.c's fx_function_parts) and need no checks."""
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    values = (bool, int, float, str, type(None), type, types.BuiltinFunctionType)
    arrays = tuple(t for t in (torch and torch.Tensor, torch and torch.dtype,
                               np and np.ndarray, np and np.generic) if t)
    found, seen = [], set()
    note = checks.append if checks is not None else None

    def visit(path, x, depth):
        if isinstance(x, values + arrays):
            found.append((path, x))
            return
        if note is not None and isinstance(x, (list, dict)):
            note(("len", x, len(x)) if _plain_container(x) else ("unsupported",))
        if isinstance(x, types.ModuleType) or depth > 6 or id(x) in seen or len(
                seen) > _MAX_VISITS:
            return
        seen.add(id(x))
        if isinstance(x, (list, tuple)) and len(x) <= 64:
            mutable = note is not None and not isinstance(x, tuple)
            for i, y in enumerate(x):
                if mutable:
                    note(("index", x, i, y))
                visit(path + (i,), y, depth + 1)
        elif isinstance(x, dict) and len(x) <= 64:
            for k in sorted(x, key=str):
                if note is not None:
                    note(("item", x, k, x[k]))
                visit(path + ("item", k), x[k], depth + 1)
        elif isinstance(x, functools.partial):
            if note is not None:
                for name in ("func", "args", "keywords"):
                    note(("attr", x, name, getattr(x, name)))
            visit(path + ("func",), x.func, depth + 1)
            visit(path + ("args",), x.args, depth + 1)
            visit(path + ("kw",), x.keywords, depth + 1)
        elif isinstance(x, types.MethodType):
            visit(path + ("self",), x.__self__, depth + 1)
            visit(path + ("func",), x.__func__, depth + 1)
        elif isinstance(x, types.FunctionType):
            function(path, x, depth)
        elif hasattr(x, "__dict__"):
            attrs = vars(x)
            if note is not None:
                note(("type", x, type(x)))
                note(("attr", x, "__dict__", attrs))
                note(("len", attrs, len(attrs)) if _plain_container(attrs) else
                     ("unsupported",))
            for k in sorted(attrs, key=str):
                if note is not None:
                    note(("item", attrs, k, attrs[k]))
                visit(path + ("attr", k), attrs[k], depth + 1)
            call = getattr(type(x), "__call__", None)
            if isinstance(call, types.FunctionType):
                if note is not None:
                    note(("attr", type(x), "__call__", call))
                visit(path + ("call",), call, depth + 1)
            elif note is not None:
                note(("not_function", type(x), "__call__"))
        elif note is not None and not isinstance(x, (tuple, list, dict)):
            note(("type", x, type(x)))  # read nothing, which another type might change

    def function(path, f, depth):
        code = f.__code__
        own = note if depth or not keyed else None  # the checks of f's own reads
        if own is not None:
            for name in ("__code__", "__defaults__", "__kwdefaults__"):
                own(("attr", f, name, getattr(f, name)))
        found.append((path + ("code",), code))
        for name, cell in zip(code.co_freevars, f.__closure__ or ()):
            try:
                x = cell.cell_contents
            except ValueError:  # an empty cell
                if own is not None:
                    own(("empty_cell", cell))
                continue
            if own is not None:
                own(("cell", cell, x))
            visit(path + ("cell", name), x, depth + 1)
        visit(path + ("defaults",), f.__defaults__ or (), depth + 1)
        kwdefaults = f.__kwdefaults__  # the dict itself even when empty: it may be filled
        if kwdefaults is not None:
            visit(path + ("kwdefaults",), kwdefaults, depth + 1)
        g = f.__globals__
        if note is not None and not _plain_container(g):
            note(("unsupported",))
        for name in _global_names(code):
            if name in g:
                if note is not None:
                    note(("item", g, name, g[name]))
                visit(path + ("global", name), g[name], depth + 1)
            elif note is not None:
                note(("absent", g, name))

    visit((), fn, 0)
    return found


def _plain_container(x):
    """x is a list or dict whose items C reads as Python does (no overridden item access,
    length or iteration)."""
    base = list if isinstance(x, list) else dict
    t = type(x)
    return t is base or all(getattr(t, m) is getattr(base, m) for m in (
        "__getitem__", "__len__", "__contains__") + (("__iter__",) if base is list else ()))


def _signature(found):
    """What the cache compares: numbers, code and classes by value, arrays by shape and
    dtype."""
    np = sys.modules.get("numpy")
    sig = []
    for path, x in found:
        if np is not None and isinstance(x, np.generic):
            sig.append((path, "numpy", x.item()))
        elif not isinstance(x, (type, bool, int, float)) and hasattr(x, "shape"):
            sig.append((path, type(x).__name__, tuple(x.shape), str(x.dtype),
                        str(getattr(x, "device", "cpu"))))
        else:
            sig.append((path, type(x).__name__, x))
    return tuple(sig)


# ---- traces and their C programs ---------------------------------------------------------


class Program:
    """A finished fa_mod (freed with this object)."""

    def __init__(self, graph, root, kind, slots):
        lib = _lib.get_lib()
        self.ptr = lib.fa_mod_create()
        if not self.ptr:
            raise FlashAttnError("fa_mod_create: out of memory", _lib.STATUS_OUT_OF_MEMORY)
        ids = {}
        for i in graph.reachable(root):
            n = graph.nodes[i]
            op, args = n[0], [ids[a] for a in operands(n)]
            if op == "var":
                r = lib.fa_mod_var(self.ptr, n[1])
            elif op == "const":
                r = lib.fa_mod_const(self.ptr, float.fromhex(n[1]))
            elif op in ("true", "false"):
                z = lib.fa_mod_const(self.ptr, 0.0)
                r = lib.fa_mod_binary(self.ptr, OP_CODE["eq" if op == "true" else "ne"], z, z)
            elif op == "where":
                r = lib.fa_mod_where(self.ptr, *args)
            elif op == "aux":
                r = lib.fa_mod_aux(self.ptr, slots[n[1]], len(args),
                                   (ctypes.c_int * len(args))(*args))
            elif len(args) == 1:
                r = lib.fa_mod_unary(self.ptr, OP_CODE[op], args[0])
            else:
                r = lib.fa_mod_binary(self.ptr, OP_CODE[op], *args)
            if r < 0:
                raise FlashAttnError("the traced mod does not fit the library: %s"
                                     % _lib.last_error())
            ids[i] = r
        _lib.check(lib.fa_mod_finish(self.ptr, ids[root], kind), "fa_mod_finish")
        self.text = lib.fa_mod_text(self.ptr).decode()

    def __del__(self, _lib=_lib):
        if getattr(self, "ptr", None):
            _lib.get_lib().fa_mod_destroy(self.ptr)
            self.ptr = None


class Trace:
    """A traced mod: its graph, root, kind (KIND_SCORE / KIND_MASK) and, per local aux slot,
    where the tensor is found at a call (a discovery path, or the object itself)."""

    def __init__(self, graph, root, kind):
        self.graph, self.root, self.kind = graph, root, kind
        self.aux = [(path, None if path is not None else t, k) for path, t, k in graph.aux]
        self.depends_b = graph.depends_on(root, 1)
        self.depends_h = graph.depends_on(root, 2)
        # the local aux slots the root reads (a capture read only off its path is not passed:
        # the library refuses a tensor its program does not read)
        self.read = frozenset(graph.nodes[i][1] for i in graph.reachable(root)
                              if graph.nodes[i][0] == "aux")
        self._programs = {}

    def program(self, slots):
        """The C program with local aux slot i at the call's slot slots[i] (any value for a
        slot not in ``read``)."""
        slots = tuple(slots)
        p = self._programs.get(slots)
        if p is None:
            p = self._programs[slots] = Program(self.graph, self.root, self.kind, slots)
        return p

    def tensors(self, leaves):
        """The aux tensors of a call: found afresh by path in ``leaves`` (path -> object)."""
        return [leaves[path] if path is not None else t for path, t, _ in self.aux]


_CACHE = collections.OrderedDict()
_CACHE_SIZE = 256
_CACHE_LOCK = threading.Lock()


def trace(fn, kind, name, checks=None, keyed=False):
    """(Trace, its aux tensors for this call) of mod ``fn`` (KIND_SCORE: fn(score, b, h, q_idx,
    kv_idx); KIND_MASK: fn(b, h, q_idx, kv_idx)); ``name`` (score_mod / mask_mod) for errors.
    With a list ``checks``, what a later call must find unchanged to be this one's trace is
    appended (``captured``'s checks, and ("meta", tensor, shape, dtype, device) for each
    captured tensor the trace does not read as an aux tensor; the caller checks those); keyed
    as ``captured`` takes it."""
    if not callable(fn):
        raise TypeError("%s: expected a function, got %s" % (name, type(fn).__name__))
    found = captured(fn, checks, keyed)
    try:  # functions of one code that capture the same share a trace
        key = (kind, _signature(found) if found else fn)
        hash(key)
    except TypeError:  # an unhashable captured value: trace every call
        key = None
        if checks is not None:
            checks.append(("unsupported",))
    leaves = dict(found)
    with _CACHE_LOCK:
        t = _CACHE.get(key) if key is not None else None
        if t is not None:
            _CACHE.move_to_end(key)
    if t is None:
        t = _trace(fn, kind, name, {id(x): path for path, x in found})
        if key is not None:
            with _CACHE_LOCK:
                _CACHE[key] = t
                while len(_CACHE) > _CACHE_SIZE:
                    _CACHE.popitem(last=False)
    tensors = t.tensors(leaves)
    if checks is not None:
        _signature_checks(found, tensors, checks)
    return t, tensors


def _signature_checks(found, aux, checks):
    """The checks of what ``_signature`` reads of the captured arrays: the metadata of each
    torch tensor that is not one of aux (the caller checks those); NumPy values have none."""
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    for _, x in found:
        if torch is not None and isinstance(x, torch.Tensor):
            if not any(x is a for a in aux):
                checks.append(("meta", x, x.shape, x.dtype, x.device))
        elif np is not None and isinstance(x, (np.ndarray, np.generic)):
            checks.append(("unsupported",))


def _trace(fn, kind, name, leaves):
    graph = Graph(leaves)
    root = graph.record(fn, kind, name)
    if len(graph.aux) > AUX_SLOTS:
        raise FlashAttnError("%s: reads %d captured tensors; at most %d per call (score_mod "
                             "and mask_mod together)" % (name, len(graph.aux), AUX_SLOTS))
    return Trace(graph, root.id, kind)
