"""Tracing torch-style score_mod / mask_mod functions into the C library's fa_mod programs.

A mod is called once with ``Value`` proxies for (score,) b, h, q_idx, kv_idx. A proxy records
every operation on it (operators, torch functions through ``__torch_function__``, tensor
methods) as a node of a ``Graph``; a captured tensor indexed by proxies becomes an aux read.
What a one-time call cannot record (Python ``if``/``and``/``or``/``min`` on a proxy, ``.item()``,
unsupported functions) raises FlashAttnError naming the construct and the user's source line.

Values have a kind: "bool", "int" or "float" (torch's promotion: int op int stays int, ``/``
gives float, a bool in arithmetic counts as 0 / 1). The C program computes in the forward's
precision, so integers are exact up to 2^24 in fp32.

``Graph.record`` runs the trace; ``_flex_cache`` keeps what it traced and builds the C programs.
"""

import functools
import math
import os
import sys
import threading
import traceback

from ._lib import FlashAttnError

BOOL, INT, FLOAT = "bool", "int", "float"
VARS = ("score", "b", "h", "q_idx", "kv_idx")  # fa_mod_variable order
# fa_mod_op order (include/flashattn.h)
OPS = ("neg", "exp", "log", "tanh", "abs", "sqrt", "floor", "not", "add", "sub", "mul", "div",
       "min", "max", "pow", "mod", "lt", "le", "gt", "ge", "eq", "ne", "and", "or")
OP_CODE = {name: i for i, name in enumerate(OPS)}
KIND_SCORE, KIND_MASK = 1, 2  # fa_mod_kind
AUX_SLOTS = 4
MAX_AUX_DIMS = 4

_HERE = os.path.dirname(os.path.abspath(__file__))


def user_line(frames=None):
    """'file:line: code' of the innermost of ``frames`` (a traceback.extract_* list; the
    current stack by default) outside this package and torch: the user's line."""
    torch = sys.modules.get("torch")
    skip = [_HERE] + ([os.path.dirname(torch.__file__)] if torch is not None else [])
    for fr in reversed(frames if frames is not None else traceback.extract_stack()):
        # normalised: the package may be imported through a path with ".." in it
        if not any(os.path.abspath(fr.filename).startswith(s) for s in skip):
            return "%s:%d: %s" % (fr.filename, fr.lineno, (fr.line or "").strip())
    return "the mod defined at %s" % _TRACING.defined


def refuse(what):
    raise FlashAttnError("%s cannot be traced: %s (at %s)" % (_TRACING.name, what, user_line()))


class _State(threading.local):
    graph = None
    name = "mod"
    defined = "an unknown line"  # where the mod being traced is defined


_TRACING = _State()


class Graph:
    """Nodes of one traced mod, operands before their users, identical nodes shared. A node:
    ("var", i) | ("const", float.hex()) | ("true",) | ("false",) | (op, a[, b]) |
    ("where", c, a, b) | ("aux", local slot, index node, ...)."""

    def __init__(self, leaves):
        self.nodes = []
        self.ids = {}
        self.leaves = leaves  # id(object) -> discovery path, for the captured tensors
        self.aux = []  # per local slot: (path or None, tensor, its kind)
        self.aux_slot = {}  # id(tensor) -> local slot

    def add(self, node):
        i = self.ids.get(node)
        if i is None:
            i = self.ids[node] = len(self.nodes)
            self.nodes.append(node)
        return i

    def record(self, fn, kind, name):
        """Calls mod fn with this graph's variables (score first for a score mod) while
        recording; returns what it returned, lifted to a Value of the right kind."""
        saved = _TRACING.graph, _TRACING.name, _TRACING.defined
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        _TRACING.graph, _TRACING.name = self, name
        _TRACING.defined = "%s:%d" % (code.co_filename, code.co_firstlineno) if code else (
            "an unknown line")
        try:
            variables = [Value(self.add(("var", i)), FLOAT if i == 0 else INT, i > 0)
                         for i in range(len(VARS))]
            try:
                out = fn(*(variables if kind == KIND_SCORE else variables[1:]))
            except FlashAttnError:
                raise
            except Exception as e:
                raise FlashAttnError("%s cannot be traced: calling it with traced values "
                                     "raised %s: %s (at %s)" % (
                                         name, type(e).__name__, e,
                                         user_line(traceback.extract_tb(e.__traceback__)))
                                     ) from e
            out = lift(out)
            if kind == KIND_MASK and out.kind != BOOL:
                raise FlashAttnError("%s: must return a boolean (True keeps the key), got a "
                                     "traced %s value" % (name, out.kind))
            return as_num(out) if kind == KIND_SCORE else out
        finally:
            _TRACING.graph, _TRACING.name, _TRACING.defined = saved

    def aux_of(self, t):
        """The local slot reading tensor t (a new one on first use; a 0-d tensor is read as
        one of shape [1])."""
        slot = self.aux_slot.get(id(t))
        if slot is None:
            if int(t.dim()) > MAX_AUX_DIMS:
                refuse("a captured tensor of %d dims (shape %s) is indexed; at most %d"
                       % (t.dim(), tuple(t.shape), MAX_AUX_DIMS))
            slot = self.aux_slot[id(t)] = len(self.aux)
            self.aux.append((self.leaves.get(id(t)), t, _tensor_kind(t)))
        return slot

    def depends_on(self, root, var):
        return self.ids.get(("var", var)) in self.reachable(root)

    def reachable(self, root):
        """Node ids the root reads, in creation (topological) order."""
        need = [False] * len(self.nodes)
        need[root] = True
        for i in range(root, -1, -1):
            if need[i]:
                for a in operands(self.nodes[i]):
                    need[a] = True
        return [i for i in range(root + 1) if need[i]]


def operands(node):
    """The node ids a node reads."""
    op = node[0]
    if op in ("var", "const", "true", "false"):
        return ()
    if op == "aux":
        return node[2:]
    return node[1:]


def _tensor_kind(t):
    if t.dtype == sys.modules["torch"].bool:
        return BOOL
    return FLOAT if t.is_floating_point() else INT


class Value:
    """A traced scalar of a mod: node ``id`` of the current graph, of kind ``kind``;
    ``nonneg``: known >= 0 (an index that needs no wrap-around); ``const``: its Python value
    when a constant."""

    __slots__ = ("id", "kind", "nonneg", "const")

    def __init__(self, id, kind, nonneg=False, const=None):
        self.id, self.kind, self.nonneg, self.const = id, kind, nonneg, const

    def __repr__(self):
        return "<traced %s value>" % self.kind

    __hash__ = object.__hash__

    # Python-level uses a one-time trace cannot record
    def __bool__(self):
        refuse("Python control flow (if / and / or / not / min / max / a chained comparison) "
               "on a traced value; use torch.where, &, |, ~, torch.minimum or torch.maximum")

    def __index__(self):
        refuse("a traced value used as a Python int (indexing a list, range, ...); index a "
               "captured torch tensor instead")

    def __int__(self):
        self.__index__()

    def __float__(self):
        refuse("float() of a traced value")

    def __len__(self):
        refuse("len() of a traced value (it is a scalar)")

    def __iter__(self):
        refuse("iterating over a traced value (it is a scalar)")

    def __getitem__(self, index):
        refuse("indexing a traced value (it is a scalar)")

    def item(self):
        refuse(".item() of a traced value (its value is only known at run time)")

    tolist = numpy = item

    # what torch code reads off a tensor
    @property
    def dtype(self):
        torch = sys.modules.get("torch")
        if torch is None:
            return self.kind
        return {BOOL: torch.bool, INT: torch.int32, FLOAT: torch.float32}[self.kind]

    @property
    def device(self):
        torch = sys.modules.get("torch")
        return torch.device("cpu") if torch is not None else "cpu"

    shape = property(lambda self: ())
    ndim = property(lambda self: 0)

    def dim(self):
        return 0

    def size(self, d=None):
        return () if d is None else refuse("size(%r) of a scalar" % (d,))

    def is_floating_point(self):
        return self.kind == FLOAT

    @classmethod
    def __torch_function__(cls, func, types=(), args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        return apply(name, args, kwargs or {})

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in _FUNCS and name.rstrip("_") not in _FUNCS:
            # an AttributeError keeps hasattr() working; the trace reports it with the line
            raise AttributeError("traced values have no .%s (not supported)" % name)
        return lambda *args, **kwargs: apply(name, (self,) + args, kwargs)


def _dunder(name, swap=False):
    def method(self, *other):
        return apply(name, (other[0], self) if swap else (self,) + other, {})
    return method


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor"):
    setattr(Value, "__%s__" % _name, _dunder(_name))
    setattr(Value, "__r%s__" % _name, _dunder(_name, swap=True))
for _name in ("lt", "le", "gt", "ge", "eq", "ne", "neg", "abs", "invert"):
    setattr(Value, "__%s__" % _name, _dunder(_name))
Value.__pos__ = lambda self: self


# ---- building nodes ------------------------------------------------------------------------


def _graph():
    return _TRACING.graph


def const(x):
    if x is True or x is False:
        return Value(_graph().add(("true",) if x else ("false",)), BOOL, True, x)
    kind = INT if isinstance(x, int) else FLOAT
    x = float(x)
    return Value(_graph().add(("const", x.hex())), kind, x >= 0, x)


def lift(x):
    """x as a Value: Values, Python / NumPy numbers, one-element tensors (a captured one is
    read from memory at run time; others are constants of the trace)."""
    if isinstance(x, Value):
        return x
    if isinstance(x, (bool, int, float)):
        return const(x)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if x.dim() == 0 and id(x) in _graph().leaves:
            return _aux_read(_graph().aux_of(x), [const(0)], x)
        if x.dim() == 0:
            return const(x.item())
        refuse("a tensor of shape %s used as a scalar; index it with the variables "
               "(e.g. bias[h, q_idx - kv_idx])" % (tuple(x.shape),))
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.generic):
        return const(x.item())
    refuse("an operand of type %s" % type(x).__name__)


def node(op, *args, kind=FLOAT, nonneg=False):
    return Value(_graph().add((op,) + tuple(a.id for a in args)), kind, nonneg)


def as_num(v):
    v = lift(v)
    if v.kind != BOOL:
        return v
    return Value(_graph().add(("where", v.id, const(1).id, const(0).id)), INT, True)


def as_bool(v):
    v = lift(v)
    return v if v.kind == BOOL else node("ne", v, const(0), kind=BOOL)


def _promote(a, b):
    return FLOAT if FLOAT in (a.kind, b.kind) else INT


def binary(op, a, b):
    a, b = as_num(a), as_num(b)
    kind = _promote(a, b)
    if op in ("lt", "le", "gt", "ge", "eq", "ne"):
        return node(op, a, b, kind=BOOL, nonneg=True)
    if op == "div":
        return node("div", a, b, nonneg=a.nonneg and b.nonneg)
    if op == "floordiv":
        q = node("div", a, b)
        return node("floor", q, kind=kind, nonneg=a.nonneg and b.nonneg)
    if op == "mod":  # the divisor's sign (torch.remainder, Python's %)
        return node("mod", a, b, kind=kind, nonneg=b.const is not None and b.const > 0)
    nonneg = a.nonneg and b.nonneg and op in ("add", "mul", "min", "max", "pow")
    return node(op, a, b, kind=kind, nonneg=nonneg or (op == "max" and (a.nonneg or b.nonneg)))


def logical(op, a, b):
    a, b = lift(a), lift(b)
    if a.kind != BOOL or b.kind != BOOL:
        refuse("bitwise %s on integer or float values (only on booleans, as masks combine)"
               % {"and": "&", "or": "|", "xor": "^"}[op])
    if op == "xor":
        return node("ne", as_num(a), as_num(b), kind=BOOL, nonneg=True)
    return node(op, a, b, kind=BOOL, nonneg=True)


def where(c, a, b):
    c, a, b = as_bool(c), lift(a), lift(b)
    if a.kind == BOOL and b.kind == BOOL:
        return Value(_graph().add(("where", c.id, a.id, b.id)), BOOL, True)
    a, b = as_num(a), as_num(b)
    return Value(_graph().add(("where", c.id, a.id, b.id)), _promote(a, b),
                 a.nonneg and b.nonneg)


def trunc(x):
    x = as_num(x)
    if x.kind == INT:
        return x
    down = node("floor", x)
    up = node("neg", node("floor", node("neg", x)))
    return where(binary("lt", x, 0), up, down)


def to_kind(x, kind):
    x = lift(x)
    if kind == BOOL:
        return as_bool(x)
    if kind == INT:
        x = trunc(x)
        return Value(x.id, INT, x.nonneg, x.const)
    x = as_num(x)
    return Value(x.id, FLOAT, x.nonneg, x.const)


def _dtype_kind(dtype):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        if dtype == torch.bool:
            return BOOL
        return FLOAT if dtype.is_floating_point else INT
    if dtype in (bool, int, float):
        return {bool: BOOL, int: INT, float: FLOAT}[dtype]
    refuse("conversion to %r" % (dtype,))


def _unary(op, kind=FLOAT, nonneg=False):
    return lambda x: node(op, as_num(x), kind=kind, nonneg=nonneg)


def _keep_kind(op):
    return lambda x: node(op, as_num(x), kind=as_num(x).kind)


def _alpha(op):
    def f(a, b, alpha=1):
        return binary(op, a, b if alpha == 1 else binary("mul", b, alpha))
    return f


def _div(a, b, rounding_mode=None):
    if rounding_mode is None:
        return binary("div", a, b)
    if rounding_mode == "floor":
        return binary("floordiv", a, b)
    q = binary("div", a, b)
    return to_kind(trunc(q), _promote(as_num(a), as_num(b)))


def _clamp(x, min=None, max=None):
    if min is not None:
        x = binary("max", x, min)
    if max is not None:
        x = binary("min", x, max)
    return lift(x)


def _fmod(a, b):
    a, b = as_num(a), as_num(b)
    return binary("sub", a, binary("mul", to_kind(trunc(binary("div", a, b)), _promote(a, b)),
                                   b))


def _minmax(op):
    def f(a, b=None, **kw):
        if b is None or kw:
            refuse("a reduction (torch.%s over a tensor); use torch.%s(a, b)"
                   % (op, "minimum" if op == "min" else "maximum"))
        return binary(op, a, b)
    return f


def _to(x, *args, **kwargs):
    dtype = kwargs.get("dtype")
    torch = sys.modules.get("torch")
    for a in args:
        if (torch is not None and isinstance(a, torch.dtype)) or (
                isinstance(a, type) and a in (bool, int, float)):
            dtype = a
    return lift(x) if dtype is None else to_kind(x, _dtype_kind(dtype))


def _full(x, value, dtype=None, size=()):
    if tuple(size) not in ((), (1,)):
        refuse("a tensor of shape %s made from a traced value" % (tuple(size),))
    kind = _dtype_kind(dtype) if dtype is not None else lift(x).kind
    return to_kind(const(value), kind)


def _new(value):
    def f(x, *size, dtype=None, **kw):
        if len(size) == 1 and isinstance(size[0], (tuple, list)):
            size = size[0]
        return _full(x, value, dtype, kw.get("size", size))
    return f


def _getitem(t, index):
    """A captured tensor indexed by traced values: an aux read."""
    torch = sys.modules["torch"]
    if not isinstance(t, torch.Tensor):
        refuse("indexing a %s with a traced value (only captured torch tensors)"
               % type(t).__name__)
    index = index if isinstance(index, tuple) else (index,)
    if len(index) != t.dim() or t.dim() == 0:
        refuse("a tensor of shape %s indexed with %d indices; index every dimension with an "
               "integer so that each read is one element" % (tuple(t.shape), len(index)))
    idx = []
    for d, i in enumerate(index):
        if not isinstance(i, (Value, int)) or isinstance(i, bool):
            refuse("index %d of a captured tensor is %s (integers and traced integer values "
                   "only; no slices, None or tensors)" % (d, type(i).__name__))
        i = as_num(i)
        if i.kind != INT:
            refuse("index %d of a captured tensor is a float value" % d)
        if not i.nonneg:  # torch counts negative indices from the end
            i = where(binary("lt", i, 0), binary("add", i, int(t.shape[d])), i)
        idx.append(i)
    slot = _graph().aux_of(t)
    return _aux_read(slot, idx, t)


def _aux_read(slot, idx, t):
    kind = _tensor_kind(t)
    v = Value(_graph().add(("aux", slot) + tuple(i.id for i in idx)), INT if kind == BOOL
              else kind, kind == BOOL)
    return as_bool(v) if kind == BOOL else v


def _identity(x, *args, **kwargs):
    return lift(x)


def _refuse_inplace(x, *args, **kwargs):
    refuse("an in-place operation on a traced value; write it out of place")


_FUNCS = {
    "add": _alpha("add"), "sub": _alpha("sub"), "subtract": _alpha("sub"),
    "rsub": lambda a, b, alpha=1: _alpha("sub")(b, a, alpha),
    "mul": functools.partial(binary, "mul"), "multiply": functools.partial(binary, "mul"),
    "div": _div, "divide": _div, "true_divide": _div, "truediv": _div,
    "floordiv": functools.partial(binary, "floordiv"),
    "floor_divide": functools.partial(binary, "floordiv"),
    "mod": functools.partial(binary, "mod"), "remainder": functools.partial(binary, "mod"),
    "fmod": _fmod,
    "pow": functools.partial(binary, "pow"),
    "minimum": functools.partial(binary, "min"), "maximum": functools.partial(binary, "max"),
    "min": _minmax("min"), "max": _minmax("max"),
    "clamp": _clamp, "clip": _clamp,
    "clamp_min": lambda x, m: _clamp(x, min=m), "clamp_max": lambda x, m: _clamp(x, max=m),
    "neg": _keep_kind("neg"), "negative": _keep_kind("neg"),
    "abs": lambda x: Value(node("abs", as_num(x)).id, as_num(x).kind, True),
    "absolute": lambda x: _FUNCS["abs"](x),
    "exp": _unary("exp", nonneg=True), "log": _unary("log"), "tanh": _unary("tanh"),
    "sqrt": _unary("sqrt", nonneg=True),
    "rsqrt": lambda x: binary("div", 1.0, node("sqrt", as_num(x))),
    "sigmoid": lambda x: binary("div", 1.0, binary("add", 1.0, node("exp", node(
        "neg", as_num(x))))),
    "exp2": lambda x: binary("pow", 2.0, x),
    "log2": lambda x: binary("div", node("log", as_num(x)), math.log(2.0)),
    "square": lambda x: binary("mul", x, x),
    "floor": lambda x: x if as_num(x).kind == INT else _keep_kind("floor")(x),
    "ceil": lambda x: x if as_num(x).kind == INT else node(
        "neg", node("floor", node("neg", as_num(x)))),
    "trunc": trunc, "fix": trunc,
    "lt": functools.partial(binary, "lt"), "less": functools.partial(binary, "lt"),
    "le": functools.partial(binary, "le"), "less_equal": functools.partial(binary, "le"),
    "gt": functools.partial(binary, "gt"), "greater": functools.partial(binary, "gt"),
    "ge": functools.partial(binary, "ge"), "greater_equal": functools.partial(binary, "ge"),
    "eq": functools.partial(binary, "eq"),
    "ne": functools.partial(binary, "ne"), "not_equal": functools.partial(binary, "ne"),
    "and": functools.partial(logical, "and"), "or": functools.partial(logical, "or"),
    "xor": functools.partial(logical, "xor"),
    "bitwise_and": functools.partial(logical, "and"),
    "bitwise_or": functools.partial(logical, "or"),
    "bitwise_xor": functools.partial(logical, "xor"),
    "logical_and": lambda a, b: logical("and", as_bool(a), as_bool(b)),
    "logical_or": lambda a, b: logical("or", as_bool(a), as_bool(b)),
    "logical_xor": lambda a, b: logical("xor", as_bool(a), as_bool(b)),
    "logical_not": lambda x: node("not", as_bool(x), kind=BOOL, nonneg=True),
    "invert": lambda x: (node("not", lift(x), kind=BOOL, nonneg=True) if lift(x).kind == BOOL
                         else refuse("~ on an integer value (only on booleans)")),
    "bitwise_not": lambda x: _FUNCS["invert"](x),
    "where": lambda c, a, b: where(c, a, b),
    "masked_fill": lambda x, m, value: where(m, value, x),
    "to": _to, "type": _to,
    "float": lambda x: to_kind(x, FLOAT), "double": lambda x: to_kind(x, FLOAT),
    "half": lambda x: to_kind(x, FLOAT), "bfloat16": lambda x: to_kind(x, FLOAT),
    "int": lambda x: to_kind(x, INT), "long": lambda x: to_kind(x, INT),
    "short": lambda x: to_kind(x, INT), "bool": lambda x: to_kind(x, BOOL),
    "new_ones": _new(1), "new_zeros": _new(0),
    "new_full": lambda x, size, value, dtype=None, **kw: _full(x, value, dtype, size),
    "ones_like": lambda x, dtype=None, **kw: _full(x, 1, dtype),
    "zeros_like": lambda x, dtype=None, **kw: _full(x, 0, dtype),
    "full_like": lambda x, value, dtype=None, **kw: _full(x, value, dtype),
    "clone": _identity, "detach": _identity, "contiguous": _identity,
    "getitem": _getitem,
}


# Keyword arguments that do not change a scalar's value.
_IGNORED_KWARGS = ("device", "out", "layout", "pin_memory", "requires_grad", "memory_format",
                   "non_blocking", "copy")


def apply(name, args, kwargs):
    """Records torch function / method / operator ``name`` on args."""
    base = name.strip("_")
    if name.endswith("_") and not name.endswith("__") and base in _FUNCS:
        _refuse_inplace(*args)
    fn = _FUNCS.get(base)
    if fn is None and base.startswith("r") and base[1:] in _FUNCS and len(args) == 2:
        fn, args = _FUNCS[base[1:]], (args[1], args[0])  # a reflected operator
    if fn is None:
        refuse("torch.%s is not supported (supported: arithmetic, comparisons, & | ~, where, "
               "exp, log, tanh, abs, sqrt, floor, minimum/maximum, clamp, indexing captured "
               "tensors)" % base)
    if kwargs.get("out") is not None:
        refuse("out= in a traced function")
    kwargs = {k: v for k, v in kwargs.items() if k not in _IGNORED_KWARGS}
    try:
        return fn(*args, **kwargs)
    except TypeError as e:
        refuse("torch.%s called as %s(%s) (%s)" % (base, base, ", ".join(
            type(a).__name__ for a in args), e))
