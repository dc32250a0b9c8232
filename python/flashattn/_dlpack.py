"""DLPack arrays for the forward functions: any object with ``__dlpack__`` (CuPy, JAX, ...) is
accepted where a torch tensor or a NumPy array is, and the results come back as that kind.

How a call routes:
1. Each argument that is neither a torch tensor nor a NumPy array but has ``__dlpack__`` is
   imported without copying: with ``torch.from_dlpack`` when torch is already imported (it
   reads every dtype, bf16 included, and every device torch knows), else ``numpy.from_dlpack``
   (CPU arrays of NumPy dtypes).
2. The call runs on those tensors / arrays like any other.
3. Each array result is handed back through the DLPack consumer of the first foreign argument's
   array namespace (``x.__array_namespace__().from_dlpack``: NumPy, CuPy, JAX and other array
   API libraries); an object that names no namespace gets NumPy arrays.

On the GPU (when flashattn takes CUDA tensors), the same steps route a CuPy or JAX device array
through ``torch.from_dlpack`` (the CUDA stream is negotiated by the ``stream`` argument of
``__dlpack__``) and back through ``cupy.from_dlpack`` / ``jax.numpy.from_dlpack``, still without
copies. Only the forward functions convert: gradients need torch tensors.
"""

import functools
import sys

_SCALARS = (bool, int, float, str, bytes, tuple, list, dict)


def _is_foreign(x):
    if x is None or isinstance(x, _SCALARS):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return False
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray):
        return False
    return hasattr(x, "__dlpack__")


def _import(x):
    if not _is_foreign(x):
        return x
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.from_dlpack(x)
    import numpy as np

    return np.from_dlpack(x)


def _exporter(first):
    namespace = getattr(first, "__array_namespace__", None)
    if namespace is not None:
        return namespace().from_dlpack
    import numpy as np

    return np.from_dlpack


def accepts_dlpack(fn):
    """Wraps a forward function so that DLPack arrays go in and come out (see the module)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = next((x for x in args if _is_foreign(x)), None)
        if first is None:
            first = next((x for x in kwargs.values() if _is_foreign(x)), None)
        if first is None:
            return fn(*args, **kwargs)
        result = fn(*(_import(x) for x in args), **{k: _import(x) for k, x in kwargs.items()})
        export = _exporter(first)
        if isinstance(result, tuple):
            return tuple(export(r) for r in result)
        return export(result)

    return wrapper
