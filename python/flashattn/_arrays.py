"""Arrays between torch / NumPy and the C library: which kind a call's arrays are, their
dtypes' codes, their preparation (device, layout) and their ``FaTensor`` views, new outputs.

Framework-neutral: an argument is either a torch tensor (CPU or CUDA) or a NumPy array, never
both in one call. torch and NumPy are imported lazily: a framework that is not imported yet
cannot have produced the arrays we are given, so ``sys.modules`` is enough to recognise them.
"""

import sys

from . import _lib
from ._lib import FlashAttnError

TORCH = "torch"
NUMPY = "numpy"

_BF16_NUMPY = None  # ml_dtypes.bfloat16 as a NumPy dtype, when ml_dtypes is importable


def _numpy_bf16():
    global _BF16_NUMPY
    if _BF16_NUMPY is None:
        try:
            import ml_dtypes  # noqa: F401  (optional)
            import numpy as np

            _BF16_NUMPY = np.dtype(ml_dtypes.bfloat16)
        except Exception:  # pragma: no cover - depends on the environment
            _BF16_NUMPY = False
    return _BF16_NUMPY or None


_KINDS = {}  # array type -> kind, for the types seen so far


def kind_of(x, name):
    """'torch', 'numpy' or None (x is None); TypeError for anything else."""
    if x is None:
        return None
    kind = _KINDS.get(type(x))
    if kind is not None:
        return kind
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if torch is not None and isinstance(x, torch.Tensor):
        kind = TORCH
    elif np is not None and isinstance(x, np.ndarray):
        kind = NUMPY
    else:
        raise TypeError(
            "%s: expected a torch.Tensor or a numpy.ndarray, got %s" % (name, type(x).__name__)
        )
    _KINDS[type(x)] = kind
    return kind


def common_kind(named, required):
    """The one array kind shared by every non-None argument in ``named`` ((name, value)
    pairs; the first ``required`` of them may not be None)."""
    kind, first = None, None
    for i, (name, x) in enumerate(named):
        if x is None:
            if i < required:
                raise TypeError("%s: expected a torch.Tensor or a numpy.ndarray, got None"
                                % name)
            continue
        k = kind_of(x, name)
        if kind is None:
            kind, first = k, name
        elif k != kind:
            raise TypeError(
                "%s is a %s but %s is a %s: pass all arrays as torch tensors or all as NumPy "
                "arrays" % (name, _kind_desc(k), first, _kind_desc(kind))
            )
    return kind


def _kind_desc(kind):
    return "torch.Tensor" if kind == TORCH else "numpy.ndarray"


# --------------------------------------------------------------------------------------------
# dtypes


_TORCH_CODES = {}  # torch dtype -> fa_dtype, filled on the first torch call


def _torch_dtype_code(t):
    if not _TORCH_CODES:
        torch = sys.modules["torch"]
        _TORCH_CODES.update({
            torch.float32: _lib.DTYPE_F32,
            torch.float16: _lib.DTYPE_F16,
            torch.bfloat16: _lib.DTYPE_BF16,
            torch.float64: _lib.DTYPE_F64,
            torch.int32: _lib.DTYPE_I32,
        })
        for name, code in _FP8_NAMES:
            if hasattr(torch, name):
                _TORCH_CODES[getattr(torch, name)] = code
    return _TORCH_CODES.get(t)


# The fp8 kinds, by their torch and ml_dtypes names (forward inputs only; out is bf16).
_FP8_NAMES = (("float8_e4m3fn", _lib.DTYPE_F8E4M3), ("float8_e5m2", _lib.DTYPE_F8E5M2))
_FP8_NUMPY = None  # NumPy dtype -> fa_dtype for ml_dtypes' fp8 kinds, when importable


def _numpy_fp8():
    global _FP8_NUMPY
    if _FP8_NUMPY is None:
        _FP8_NUMPY = {}
        try:
            import ml_dtypes  # (optional)
            import numpy as np

            _FP8_NUMPY = {np.dtype(getattr(ml_dtypes, n)): c for n, c in _FP8_NAMES}
        except Exception:  # pragma: no cover - depends on the environment
            pass
    return _FP8_NUMPY


def is_fp8(x):
    """Whether array x holds fp8 (torch.float8_e4m3fn / float8_e5m2 or ml_dtypes' kinds)."""
    dt = getattr(x, "dtype", None)
    name = str(dt)
    return name.endswith(("float8_e4m3fn", "float8_e5m2"))


def _numpy_dtype_code(dt):
    np = sys.modules["numpy"]
    dt = np.dtype(dt)
    if dt.byteorder not in ("=", "|") and dt.byteorder != _native_order():
        return None
    if dt.kind == "f":
        return {2: _lib.DTYPE_F16, 4: _lib.DTYPE_F32, 8: _lib.DTYPE_F64}.get(dt.itemsize)
    if dt.kind == "i" and dt.itemsize == 4:
        return _lib.DTYPE_I32
    bf16 = _numpy_bf16()
    if bf16 is not None and dt == bf16:
        return _lib.DTYPE_BF16
    return _numpy_fp8().get(dt)


def _native_order():
    return "<" if sys.byteorder == "little" else ">"


_SUPPORTED_FLOATS = {
    TORCH: "torch.float16, torch.bfloat16, torch.float32, torch.float64, "
           "torch.float8_e4m3fn or torch.float8_e5m2",
    NUMPY: "float16, float32, float64 (or ml_dtypes.bfloat16, float8_e4m3fn or float8_e5m2 "
           "when ml_dtypes is installed)",
}


# --------------------------------------------------------------------------------------------
# Views


def check_device(x, name, cuda=False):
    """CPU tensors, and CUDA tensors where ``cuda`` (the functions with a CUDA path)."""
    dev = x.device.type
    if dev == "cpu":
        return
    if dev == "cuda":
        if not cuda:
            raise FlashAttnError(
                "%s: CUDA tensors are not supported yet by this function (CPU tensors and "
                "NumPy arrays only)" % name
            )
        return
    raise FlashAttnError("%s: tensors on device '%s' are not supported (CPU only)" % (name, dev))


def cuda_target(named):
    """(device index, stream handle) for a call whose torch tensors (``named``: (name, tensor)
    pairs, the first being q) live on one CUDA device, or None when they are on the CPU: the
    caller's current torch stream on that device, so the call orders with the caller's work.
    Every tensor must be on q's device (the library reads them all, cu_seqlens included, from
    the one device the call names)."""
    device = named[0][1].device
    for name, x in named[1:]:
        if x is not None and x.device != device:
            raise FlashAttnError("%s: expected a tensor on %s like %s, got one on %s"
                                 % (name, device, named[0][0], x.device))
    if device.type != "cuda":
        return None
    return device.index, _raw_stream(device.index)


def _raw_stream(index):
    # The raw handle without building a torch.cuda.Stream object (what Inductor's generated
    # code calls); older torch builds only have the public spelling.
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(index)
    return torch.cuda.current_stream(index).cuda_stream


def draw_seed_cuda(device):
    """A fresh dropout seed for a call on CUDA ``device`` (offset is then 0), from torch's
    default CUDA generator of that device: its seed and Philox offset, the offset advanced by 4
    (the generator's unit) so that the next call differs, mixed into one 63-bit seed by
    splitmix64. ``torch.manual_seed`` (or ``torch.cuda.manual_seed``) resets both, so it
    reproduces a run, as it does for torch's own CUDA dropout."""
    torch = sys.modules["torch"]
    index = device.index if device.index is not None else torch.cuda.current_device()
    gen = torch.cuda.default_generators[index]
    seed, offset = gen.initial_seed(), gen.get_offset()
    gen.set_offset(offset + 4)
    mask = 0xFFFFFFFFFFFFFFFF
    z = (seed ^ (offset * 0x9E3779B97F4A7C15)) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) % (2**63 - 1)


def prepare(x, name, kind, cuda=False):
    """Returns x ready for C: on the CPU (or a CUDA device, where ``cuda``), strided, with a
    contiguous last dimension.

    Like upstream's maybe_contiguous, copies only when the last dimension is not contiguous, so
    slices of packed buffers reach the library without copies.
    """
    if x is None:
        return None
    if kind == TORCH:
        torch = sys.modules["torch"]
        check_device(x, name, cuda)
        if x.layout != torch.strided:
            raise FlashAttnError("%s: only dense (strided) tensors are supported, got %s"
                                 % (name, x.layout))
        if x.dim() > 0 and x.shape[-1] > 1 and x.stride(-1) != 1:
            x = x.contiguous()
        if x.is_conj() or x.is_neg():
            x = x.resolve_conj().resolve_neg()
        return x
    np = sys.modules["numpy"]
    dt = x.dtype
    if dt.byteorder not in ("=", "|") and dt.byteorder != _native_order():
        x = x.astype(dt.newbyteorder("="))
    item = x.dtype.itemsize
    if x.ndim > 0 and (
        any(s % item for s in x.strides) or (x.shape[-1] > 1 and x.strides[-1] != item)
    ):
        x = np.ascontiguousarray(x)
    return x


APPENDED = "new keys are written into it"  # what a KV-cache call writes into the caches


def refuse_overlap(x, name, written, kind):
    """x is written in place (``written`` says what is written): elements that share memory
    (a stride of 0 over more than one element, as expand() and broadcast_to make) are refused,
    since each write would land on all of them. ``kind`` picks the stride accessor (a branch
    torch.compile can trace)."""
    strides = x.stride() if kind == TORCH else x.strides
    if any(st == 0 and n > 1 for n, st in zip(x.shape, strides)):
        raise FlashAttnError("%s: elements share memory (a stride of 0, as expand() makes, "
                             "strides %s), but %s in place" % (name, tuple(strides), written))


def dtype_code(x, name, kind, expected=None):
    """The fa_dtype of x. A dtype the C library has no code for is rejected here (naming the
    argument and what it should be); any other dtype rule is the C library's to check."""
    code = _torch_dtype_code(x.dtype) if kind == TORCH else _numpy_dtype_code(x.dtype)
    if code is None:
        raise FlashAttnError("%s: dtype %s is not supported (expected %s)"
                             % (name, x.dtype, expected or _SUPPORTED_FLOATS[kind]))
    return code


def make_tensor(x, name, kind, code=None, expected=None):
    """An FaTensor describing x (which must already have gone through ``prepare``)."""
    if code is None:
        code = dtype_code(x, name, kind, expected)
    if kind == TORCH:
        shape, strides, ptr = x.shape, x.stride(), x.data_ptr()
    else:
        item = x.dtype.itemsize
        shape = x.shape
        strides = tuple(s // item for s in x.strides)
        ptr = x.__array_interface__["data"][0]
    n = len(shape)
    if n > _lib.FA_MAX_DIMS:
        raise FlashAttnError("%s: expected at most %d dimensions, got %d (shape %s)"
                             % (name, _lib.FA_MAX_DIMS, n, tuple(shape)))
    if 0 in shape:
        # An empty array's strides are arbitrary (torch and NumPy may report 0): describe it
        # as row-major, which is what it would be if it held anything.
        strides, acc = [0] * n, 1
        for i in reversed(range(n)):
            strides[i] = acc
            acc *= max(int(shape[i]), 1)
    t = _lib.FaTensor()
    t.data = ptr or None
    t.dtype = code
    t.ndim = n
    t.shape[:n] = shape
    t.stride[:n] = strides
    if n and shape[n - 1] <= 1:
        # A dimension of size <= 1 is never stepped over; report stride 1 for the last one so
        # that a (legal) odd stride on a size-1 dimension is not mistaken for a strided one.
        t.stride[n - 1] = 1
    return t


def empty(kind, shape, like, float32=False):
    """A new uninitialised array of ``like``'s kind (and device), in like's dtype or fp32."""
    module = sys.modules[kind]  # "torch" or "numpy"
    dtype = module.float32 if float32 else like.dtype
    if kind == TORCH:
        return module.empty(tuple(shape), dtype=dtype, device=like.device)
    return module.empty(tuple(shape), dtype=dtype)


def empty_f32(kind, shape, like):
    return empty(kind, shape, like, float32=True)


def empty_out(kind, shape, q):
    """A new attention output for q: in q's dtype, bf16 for fp8 q (as FA3)."""
    if not is_fp8(q):
        return empty(kind, shape, q)
    if kind == TORCH:
        torch = sys.modules["torch"]
        return torch.empty(tuple(shape), dtype=torch.bfloat16, device=q.device)
    return sys.modules["numpy"].empty(tuple(shape), dtype=_numpy_bf16())


def to_float32(x, name, kind):
    """learnable_sink accepts any float dtype (FA4 takes fp16/bf16/fp32); C reads fp32."""
    if x is None:
        return None
    if kind == TORCH:
        if x.is_floating_point() and x.dtype != sys.modules["torch"].float32:
            return x.float()
        return x
    np = sys.modules["numpy"]
    code = _numpy_dtype_code(x.dtype)
    if code in (_lib.DTYPE_F16, _lib.DTYPE_BF16, _lib.DTYPE_F64):
        return x.astype(np.float32)
    return x


def rng_state_array(seed, offset):
    """NumPy int64 [seed, offset]: upstream's rng_state (the torch ops make their own)."""
    np = sys.modules["numpy"]
    return np.array([seed, offset], dtype=np.int64)


def draw_seed():
    """A fresh dropout seed for a NumPy call (offset is then 0): ``np.random.randint`` on the
    legacy global state, so ``np.random.seed`` reproduces it. Seeds are in [0, 2**63 - 1) so
    that the rng_state fits int64. Torch calls draw theirs in ``_torch_ops.draw_seed``.
    """
    np = sys.modules["numpy"]
    return int(np.random.randint(0, 2**63 - 1, dtype=np.int64))


def fill_uncovered_rows(lse, cu_seqlens, kind, value):
    """lse (h, total_q): set the columns that belong to no sequence to value."""
    total = int(lse.shape[1])
    if kind == TORCH:
        # On lse's device, without reading cu_seqlens on the host (no device synchronisation).
        torch = sys.modules["torch"]
        cu = cu_seqlens.detach().to(device=lse.device, dtype=torch.int64)
        rows = torch.arange(total, device=lse.device)
        covered = ((rows[None, :] >= cu[:-1, None]) & (rows[None, :] < cu[1:, None])).any(0)
        lse.masked_fill_(~covered, value)
        return
    np = sys.modules["numpy"]
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    rows = np.arange(total)
    covered = ((rows[None, :] >= cu[:-1, None]) & (rows[None, :] < cu[1:, None])).any(0)
    lse[:, ~covered] = value


def round_multiple(x, m):
    return (x + m - 1) // m * m
