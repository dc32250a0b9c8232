"""DLPack arrays for the forward functions: any object with ``__dlpack__`` (CuPy, JAX, ...) is
accepted where a torch tensor or a NumPy array is, and the results come back as that kind.

How a call routes:
1. Each argument that is neither a torch tensor nor a NumPy array but has ``__dlpack__`` is
   imported without copying, as the kind of the call's other arrays if it has some, else with
   ``torch.from_dlpack`` when torch is already imported (it reads every dtype, bf16 included,
   and every device torch knows), else ``numpy.from_dlpack`` (CPU arrays of NumPy dtypes).
2. The call runs on those tensors / arrays like any other.
3. When the first array argument (q, or qkv) is such an object, each array result is handed
   back through the DLPack consumer of its array namespace
   (``x.__array_namespace__().from_dlpack``: NumPy, JAX and other array API libraries), else
   through the ``from_dlpack`` of the package that defines its type (CuPy), else as NumPy
   arrays.

On the GPU the same steps route a CuPy or JAX device array through ``torch.from_dlpack`` (torch
must be imported; the CUDA stream is negotiated by the ``stream`` argument of ``__dlpack__``)
into the CUDA path and back through ``cupy.from_dlpack`` / ``jax.numpy.from_dlpack``, still
without copies. Only the forward functions convert: gradients need torch tensors.
"""

import functools
import sys

_SCALARS = (bool, int, float, str, bytes, tuple, list, dict)
# Types that are never converted: scalars and containers, and the native array types once seen
# (a call with native arrays then costs a set lookup per argument).
_NOT_FOREIGN = set(_SCALARS) | {type(None)}


def note_torch(torch):
    """Torch's tensor types are native from the start: a call traced by torch.compile then finds
    them in _NOT_FOREIGN (Dynamo cannot trace the set's update, nor, in some versions, a lookup
    that misses)."""
    _NOT_FOREIGN.update((torch.Tensor, torch.nn.Parameter))


def _native(x):
    """'torch' or 'numpy' for the arrays flashattn takes directly, else None."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray):
        return "numpy"
    return None


def _is_foreign(x):
    t = type(x)
    if t in _NOT_FOREIGN:
        return False
    if _native(x) is not None:
        _NOT_FOREIGN.add(t)
        return False
    return not isinstance(x, _SCALARS) and hasattr(x, "__dlpack__")


def _importer(values):
    """The consumer for the foreign arguments: the kind of the call's native arrays if it has
    some (a call takes one kind), else torch when it is imported, else NumPy."""
    kind = next((k for k in map(_native, values) if k is not None), None)
    if kind is None:
        kind = "torch" if sys.modules.get("torch") is not None else "numpy"
    if kind == "torch":
        return sys.modules["torch"].from_dlpack
    import numpy as np

    return np.from_dlpack


def _exporter(first):
    """The DLPack consumer of ``first``'s kind: its array namespace's; else the one of the
    package that defines its type (CuPy arrays name no namespace, ``cupy.from_dlpack``
    exists); else NumPy's."""
    namespace = getattr(first, "__array_namespace__", None)
    if namespace is not None:
        return namespace().from_dlpack
    package = sys.modules.get(type(first).__module__.partition(".")[0])
    from_dlpack = getattr(package, "from_dlpack", None)
    if callable(from_dlpack):
        return from_dlpack
    import numpy as np

    return np.from_dlpack


def accepts_dlpack(fn):
    """Wraps a forward function so that DLPack arrays go in and come out (see the module).
    The results take the kind of the call's first array argument (q, or qkv)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not any(map(_is_foreign, args)) and not any(map(_is_foreign, kwargs.values())):
            return fn(*args, **kwargs)
        values = args + tuple(kwargs.values())
        load = _importer(values)
        conv = lambda x: load(x) if _is_foreign(x) else x  # noqa: E731
        result = fn(*map(conv, args), **{k: conv(x) for k, x in kwargs.items()})
        lead = next(x for x in values if _is_foreign(x) or _native(x) is not None)
        if not _is_foreign(lead):
            return result
        export = _exporter(lead)
        if isinstance(result, tuple):
            return tuple(export(r) for r in result)
        return export(result)

    return wrapper
