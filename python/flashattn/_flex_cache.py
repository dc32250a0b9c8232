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


def captured(fn):
    """[(path, object)]: what fn's trace depends on. The tensors, arrays and numbers it reaches
    through closures, globals, defaults and the attributes of captured objects, recursively
    through captured functions and small lists, tuples and dicts; the code of each function and
    the identity of each class or builtin it reaches."""
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    values = (bool, int, float, str, type(None), type, types.BuiltinFunctionType)
    arrays = tuple(t for t in (torch and torch.Tensor, torch and torch.dtype,
                               np and np.ndarray, np and np.generic) if t)
    found, seen = [], set()

    def visit(path, x, depth):
        if isinstance(x, values + arrays):
            found.append((path, x))
            return
        if isinstance(x, types.ModuleType) or depth > 6 or id(x) in seen or len(
                seen) > _MAX_VISITS:
            return
        seen.add(id(x))
        if isinstance(x, (list, tuple)) and len(x) <= 64:
            for i, y in enumerate(x):
                visit(path + (i,), y, depth + 1)
        elif isinstance(x, dict) and len(x) <= 64:
            for k in sorted(x, key=str):
                visit(path + ("item", k), x[k], depth + 1)
        elif isinstance(x, functools.partial):
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
            for k in sorted(attrs, key=str):
                visit(path + ("attr", k), attrs[k], depth + 1)
            call = getattr(type(x), "__call__", None)
            if isinstance(call, types.FunctionType):
                visit(path + ("call",), call, depth + 1)

    def function(path, f, depth):
        code = f.__code__
        found.append((path + ("code",), code))
        for name, cell in zip(code.co_freevars, f.__closure__ or ()):
            try:
                visit(path + ("cell", name), cell.cell_contents, depth + 1)
            except ValueError:  # an empty cell
                pass
        visit(path + ("defaults",), f.__defaults__ or (), depth + 1)
        visit(path + ("kwdefaults",), f.__kwdefaults__ or {}, depth + 1)
        g = f.__globals__
        for name in _global_names(code):
            if name in g:
                visit(path + ("global", name), g[name], depth + 1)

    visit((), fn, 0)
    return found


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
        self._programs = {}

    def program(self, slots):
        """The C program with local aux slot i at the call's slot slots[i]."""
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


def trace(fn, kind, name):
    """(Trace, its aux tensors for this call) of mod ``fn`` (KIND_SCORE: fn(score, b, h, q_idx,
    kv_idx); KIND_MASK: fn(b, h, q_idx, kv_idx)); ``name`` (score_mod / mask_mod) for errors."""
    if not callable(fn):
        raise TypeError("%s: expected a function, got %s" % (name, type(fn).__name__))
    found = captured(fn)
    try:  # functions of one code that capture the same share a trace
        key = (kind, _signature(found) if found else fn)
        hash(key)
    except TypeError:  # an unhashable captured value: trace every call
        key = None
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
    return t, t.tensors(leaves)


def _trace(fn, kind, name, leaves):
    graph = Graph(leaves)
    root = graph.record(fn, kind, name)
    if len(graph.aux) > AUX_SLOTS:
        raise FlashAttnError("%s: reads %d captured tensors; at most %d per call (score_mod "
                             "and mask_mod together)" % (name, len(graph.aux), AUX_SLOTS))
    return Trace(graph, root.id, kind)
