"""Array plumbing between torch / NumPy and the C library.

Everything here is framework-neutral: an argument is either a torch tensor (CPU or CUDA) or a
NumPy array, never both in one call. torch and NumPy are imported lazily: a framework that is not
imported yet cannot have produced the arrays we are given, so ``sys.modules`` is enough to
recognise them.

``forward`` (``run_forward``, which also hands back what it prepared) is the last Python step
of every forward route: it validates what only Python can know (array kinds, devices, dtypes
that have no C counterpart, ranks needed to allocate outputs), converts and checks the scalars
(the default softmax scale is resolved here, ``default_scale``), allocates the outputs, fills
an fa_fwd_args and calls ``fa_attention_forward``. Every other rule is checked by the C
library, whose message names the argument; ``forward`` renames the C argument names to the
caller's. ``backward`` / ``run_backward`` do the same for fa_attention_backward. ``_cached``
keeps what they prepared per call signature for the commonest torch calls.
"""

import ctypes
import operator
import re
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
    return _TORCH_CODES.get(t)


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
    return None


def _native_order():
    return "<" if sys.byteorder == "little" else ">"


_SUPPORTED_FLOATS = {
    TORCH: "torch.float16, torch.bfloat16, torch.float32 or torch.float64",
    NUMPY: "float16, float32, float64 (or ml_dtypes.bfloat16 when ml_dtypes is installed)",
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


def refuse_overlap(x, name, written):
    """x is written in place (``written`` says what is written): elements that share memory
    (a stride of 0 over more than one element, as expand() and broadcast_to make) are refused,
    since each write would land on all of them."""
    strides = x.stride() if hasattr(x, "stride") and callable(x.stride) else x.strides
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


def empty(kind, shape, like):
    """A new uninitialised array of ``like``'s kind and dtype."""
    if kind == TORCH:
        torch = sys.modules["torch"]
        return torch.empty(tuple(shape), dtype=like.dtype, device=like.device)
    np = sys.modules["numpy"]
    return np.empty(tuple(shape), dtype=like.dtype)


def empty_f32(kind, shape, like):
    if kind == TORCH:
        torch = sys.modules["torch"]
        return torch.empty(tuple(shape), dtype=torch.float32, device=like.device)
    np = sys.modules["numpy"]
    return np.empty(tuple(shape), dtype=np.float32)


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


# --------------------------------------------------------------------------------------------
# Argument helpers


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


INT32 = (-2**31, 2**31 - 1)
INT64 = (-2**63, 2**63 - 1)
SEED64 = (-2**63, 2**64 - 1)  # int64 (an rng_state element) or uint64, taken modulo 2**64


def as_int(x, name, bounds=INT64):
    """x as a Python int within ``bounds`` (the C field's range: ctypes would wrap it)."""
    try:
        n = operator.index(x)
    except TypeError:
        raise TypeError("%s: expected an int, got %s" % (name, type(x).__name__)) from None
    if not bounds[0] <= n <= bounds[1]:
        raise FlashAttnError("%s: %d is out of range [%d, %d]" % (name, n, bounds[0], bounds[1]))
    return n


def as_float(x, name):
    """x as a Python float; strings are refused (float() would parse them)."""
    if not isinstance(x, (str, bytes, bytearray)):
        try:
            return float(x)
        except (TypeError, ValueError):
            pass
    raise TypeError("%s: expected a float, got %s" % (name, type(x).__name__))


def as_bool(x, name):
    """A flag: bools, ints (0 is False) and NumPy bools, as upstream's bindings take them."""
    if x is True or x is False:
        return x
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.bool_):
        return bool(x)
    try:
        return operator.index(x) != 0
    except TypeError:
        raise TypeError("%s: expected a bool, got %s" % (name, type(x).__name__)) from None


def as_scale(softmax_scale):
    """softmax_scale as a float, or None (the default). NaN is refused: the C library reads a
    NaN scale as "use the default", which the caller spells None."""
    if softmax_scale is None:
        return None
    scale = as_float(softmax_scale, "softmax_scale")
    if scale != scale:
        raise FlashAttnError("softmax_scale: must be finite, got nan (None selects the default, "
                             "1 / sqrt(head_dim))")
    return scale


def default_scale(x, softmax_scale):
    """softmax_scale, None -> head_dim ** -0.5 of the caller's own tensor x (q, or qkv for the
    packed forms, as upstream: the unpadded head dim). Without a head dim (rank 0, or 0) it
    stays None and the C library's shape checks name the argument."""
    if softmax_scale is not None:
        return as_scale(softmax_scale)
    if len(x.shape) == 0 or not x.shape[-1] > 0:
        return None
    return x.shape[-1] ** -0.5


_INT_MAX = 2**31 - 1


def window_pair(window_size):
    """(left, right) as C ints. Any negative value (or None, FA4's spelling) means unbounded,
    as upstream; a bound that does not fit an int is wider than any sequence, so unbounded too."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError("window_size: expected a pair (left, right), got %r"
                        % (window_size,)) from None
    if type(left) is int and type(right) is int:
        return (left if 0 <= left <= _INT_MAX else -1, right if 0 <= right <= _INT_MAX else -1)

    def one(w, side):
        if w is None:
            return -1
        w = as_int(w, "window_size[%d] (%s)" % (side, "left" if side == 0 else "right"))
        if w < 0 or w > _INT_MAX:
            return -1
        return w

    return one(left, 0), one(right, 1)


def _require_ndim(x, name, ndim, layout):
    if x.ndim != ndim:
        raise FlashAttnError("%s: expected %d dimensions %s, got shape %s"
                             % (name, ndim, layout, tuple(x.shape)))


def _rename(msg, names):
    """The C message starts with the C argument name; say it as the caller named it. Longer
    names (max_seqlen_q, cu_seqlens_k, ...) are renamed in the rest of the message too."""
    head, sep, rest = msg.partition(": ")
    if not sep:
        return msg
    for c_name, py_name in names.items():
        if len(c_name) > 1 and c_name != py_name:
            rest = re.sub(r"\b%s\b" % re.escape(c_name), py_name, rest)
    return names.get(head, head) + ": " + rest


_FWD_NAMES = {
    "sinks": "learnable_sink",
    "window_left": "window_size[0] (left)",
    "window_right": "window_size[1] (right)",
}


def _namer(names):
    """C argument name -> the caller's name, for error messages."""
    names = dict(_FWD_NAMES, **names) if names else _FWD_NAMES
    return lambda c_name: names.get(c_name, c_name), names


def _fwd_args(q, k, v, out, lse, probs, cu_q, cu_k, used_k, alibi, sinks, codes, kind, nm,
              varlen, max_seqlen_q, max_seqlen_k, window_size, dropout_p, softcap,
              softmax_scale, causal, seed, offset, num_threads, target=None):
    """An FaFwdArgs for prepared arrays, and the FaTensor objects that must outlive the call.
    ``target``: (CUDA device, stream) from ``cuda_target``, or None for the CPU."""
    left, right = window_pair(window_size)
    dropout_p = as_float(dropout_p, "dropout_p")
    softcap = as_float(softcap, "softcap")
    scale = default_scale(q, softmax_scale)
    scale = float("nan") if scale is None else scale  # no head dim: C names q

    keep = []  # FaTensor objects must outlive the call

    def ptr(x, c_name, code=None, expected=None):
        if x is None:
            return None
        t = make_tensor(x, nm(c_name), kind, code, expected)
        keep.append(t)
        return ctypes.pointer(t)

    args = _lib.new_fwd_args()
    args.q = ptr(q, "q", codes[0])
    args.k = ptr(k, "k", codes[1])
    args.v = ptr(v, "v", codes[2])
    args.out = ptr(out, "out")
    args.lse = ptr(lse, "lse")
    if varlen:
        args.cu_seqlens_q = ptr(cu_q, "cu_seqlens_q", expected="int32")
        args.cu_seqlens_k = ptr(cu_k, "cu_seqlens_k", expected="int32")
        args.max_seqlen_q = max_seqlen_q
        args.max_seqlen_k = max_seqlen_k
    if used_k is not None:
        args.seqused_k = ptr(used_k, "seqused_k", expected="int32")
    if alibi is not None:
        args.alibi_slopes = ptr(alibi, "alibi_slopes", expected="float32")
    if sinks is not None:
        args.sinks = ptr(sinks, "sinks", expected="float32")
    if probs is not None:
        args.probs = ptr(probs, "probs")
    args.softmax_scale = scale
    args.causal = 1 if as_bool(causal, "causal") else 0
    args.window_left = left
    args.window_right = right
    args.softcap = softcap
    args.dropout_p = dropout_p
    args.seed = as_int(seed, "seed", SEED64) & 0xFFFFFFFFFFFFFFFF
    args.offset = as_int(offset, "offset", SEED64) & 0xFFFFFFFFFFFFFFFF
    if target is not None:
        args.device, args.stream = target
    args.num_threads = as_int(num_threads, "num_threads", INT32)

    return args, keep


def forward(q, k, v, *, kind, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
            max_seqlen_q=0, max_seqlen_k=0, dropout_p=0.0, softmax_scale=None, causal=False,
            window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
            return_softmax=False, seed=0, offset=0, out=None, lse=None, probs=None,
            names=None, num_threads=0):
    """One call of fa_attention_forward. Returns (out, lse, probs).

    q, k, v: arrays of ``kind`` (already checked to share it). In the varlen form
    (cu_seqlens_q given) lse is (h, total_q), otherwise (b, h, sq). probs is allocated as
    upstream's S_dmask, [b, h, round_up(sq, 128), round_up(sk, 128)] in q's dtype, when
    return_softmax is true, else None. out / lse / probs may be passed in (written in place).
    ``names`` maps the C argument names to the caller's names for error messages.
    """
    return run_forward(
        q, k, v, kind, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, sinks,
        return_softmax, seed, offset, out, lse, probs, names, num_threads)[3:6]


def run_forward(q, k, v, kind, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, sinks, return_softmax, seed, offset, out, lse, probs, names,
                num_threads, want_lse=True):
    """``forward``'s call, returning what it prepared for ``_cached`` to keep: (args, the
    FaTensors it points to (q, k, v, out, lse first), the prepared inputs (copies among
    them), out, lse (None without ``want_lse``: the library writes none), probs or None,
    names)."""
    args, keep, arrays, out, lse, probs, names = _prepare_forward(
        q, k, v, kind, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, sinks,
        return_softmax, seed, offset, out, lse, probs, names, num_threads)
    if not want_lse:
        args.lse = lse = None
    try:
        _lib.forward(args)
    except FlashAttnError as e:
        raise FlashAttnError(_rename(str(e), names), e.status) from None
    return args, keep, arrays, out, lse, probs, names


def _prepare_forward(q, k, v, kind, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                     alibi_slopes, sinks, return_softmax, seed, offset, out, lse, probs, names,
                     num_threads):
    """``forward`` up to the call: (args, the FaTensors it points to (q, k, v, out, lse
    first), the prepared inputs (copies among them), out, lse, probs or None, names). The
    FaTensors and the prepared inputs must outlive the call."""
    nm, names = _namer(names)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    q = prepare(q, nm("q"), kind, cuda=True)
    k = prepare(k, nm("k"), kind, cuda=True)
    v = prepare(v, nm("v"), kind, cuda=True)
    qc = dtype_code(q, nm("q"), kind)
    kc = dtype_code(k, nm("k"), kind)
    vc = dtype_code(v, nm("v"), kind)

    # Ranks needed to allocate the outputs (C checks everything else).
    nd = 3 if varlen else 4
    if q.ndim != nd or k.ndim != nd or v.ndim != nd:
        layout = ("[total_q, h, d]", "[total_k, hk, d]", "[total_k, hk, dv]") if varlen else (
            "[b, sq, h, d]", "[b, sk, hk, d]", "[b, sk, hk, dv]")
        _require_ndim(q, nm("q"), nd, layout[0])
        _require_ndim(k, nm("k"), nd, layout[1])
        _require_ndim(v, nm("v"), nd, layout[2])

    cu_q = cu_k = alibi = None
    if varlen:
        cu_q = prepare(cu_seqlens_q, nm("cu_seqlens_q"), kind, cuda=True)
        cu_k = prepare(cu_seqlens_k, nm("cu_seqlens_k"), kind, cuda=True)
    used_k = prepare(seqused_k, nm("seqused_k"), kind, cuda=True)
    if alibi_slopes is not None:
        alibi = prepare(alibi_slopes, nm("alibi_slopes"), kind, cuda=True)
    if sinks is not None:
        sinks = prepare(to_float32(sinks, nm("sinks"), kind), nm("sinks"), kind, cuda=True)

    if varlen:
        if cu_q is None or cu_k is None:
            missing = "cu_seqlens_k" if cu_q is not None else "cu_seqlens_q"
            raise FlashAttnError("%s: the varlen form needs both cu_seqlens_q and cu_seqlens_k"
                                 % nm(missing))
        _require_ndim(cu_q, nm("cu_seqlens_q"), 1, "[b + 1]")
        max_seqlen_q = as_int(max_seqlen_q, nm("max_seqlen_q"))
        max_seqlen_k = as_int(max_seqlen_k, nm("max_seqlen_k"))
        b = max(int(cu_q.shape[0]) - 1, 0)
        total_q, h = int(q.shape[0]), int(q.shape[1])
        out_shape = (total_q, h, int(v.shape[2]))
        lse_shape = (h, total_q)
        sq, sk = max(max_seqlen_q, 0), max(max_seqlen_k, 0)
    else:
        b, sq, h = int(q.shape[0]), int(q.shape[1]), int(q.shape[2])
        sk = int(k.shape[1])
        out_shape = (b, sq, h, int(v.shape[3]))
        lse_shape = (b, h, sq)

    target = None
    if kind == TORCH:
        target = cuda_target([(nm("q"), q), (nm("k"), k), (nm("v"), v),
                              (nm("cu_seqlens_q"), cu_q), (nm("cu_seqlens_k"), cu_k),
                              (nm("seqused_k"), used_k), (nm("alibi_slopes"), alibi),
                              (nm("sinks"), sinks), ("out", out), ("lse", lse),
                              ("probs", probs)])
    if out is None:
        out = empty(kind, out_shape, q)
    if lse is None:
        lse = empty_f32(kind, lse_shape, q)
    if not return_softmax:
        probs = None
    elif probs is None:
        probs = empty(kind, (b, h, round_multiple(sq, 128), round_multiple(sk, 128)), q)

    args, keep = _fwd_args(q, k, v, out, lse, probs, cu_q, cu_k, used_k, alibi, sinks,
                           (qc, kc, vc), kind, nm, varlen, max_seqlen_q, max_seqlen_k,
                           window_size, dropout_p, softcap, softmax_scale, causal, seed, offset,
                           num_threads, target)
    return args, keep, (q, k, v, cu_q, cu_k, used_k, alibi, sinks), out, lse, probs, names


def backward(dout, q, k, v, out, lse, *, kind, cu_seqlens_q=None, cu_seqlens_k=None,
             seqused_k=None, max_seqlen_q=0, max_seqlen_k=0, dropout_p=0.0, softmax_scale=None,
             causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
             seed=0, offset=0, deterministic=False, names=None, num_threads=0, dq=None,
             dk=None, dv=None):
    """One call of fa_attention_backward with the forward's inputs, out and lse.

    Returns (dq, dk, dv, dsinks): arrays shaped like q, k, v (new ones unless given, then
    written in place), and fp32 [h] for the sinks (None without sinks). The CPU result is
    bitwise reproducible whatever ``deterministic`` says.
    """
    return run_backward(
        dout, q, k, v, out, lse, kind, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
        max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        sinks, seed, offset, deterministic, names, num_threads, dq, dk, dv)[3]


def run_backward(dout, q, k, v, out, lse, kind, cu_seqlens_q, cu_seqlens_k, seqused_k,
                 max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                 softcap, alibi_slopes, sinks, seed, offset, deterministic, names, num_threads,
                 dq, dk, dv):
    """``backward``'s call, returning what it prepared for ``_cached`` to keep: (bwd args,
    the FaTensors they point to, the prepared inputs, (dq, dk, dv, dsinks), names, the CUDA
    workspace or None), as ``_prepare_backward`` describes them."""
    prepared = _prepare_backward(
        dout, q, k, v, out, lse, kind, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
        max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        sinks, seed, offset, deterministic, names, num_threads, dq, dk, dv)
    try:
        _lib.backward(prepared[0])
    except FlashAttnError as e:
        raise FlashAttnError(_rename(str(e), prepared[4]), e.status) from None
    return prepared


def _prepare_backward(dout, q, k, v, out, lse, kind, cu_seqlens_q, cu_seqlens_k, seqused_k,
                      max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, sinks, seed, offset, deterministic, names,
                      num_threads, dq, dk, dv):
    """``backward`` up to the call: (bwd args, the FaTensors they point to (the forward's q, k,
    v, out, lse first, then dout, dq, dk, dv, dsinks), the prepared inputs (dout, q, k, v,
    out, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, sinks; copies among them),
    (dq, dk, dv, dsinks), names, the CUDA workspace or None). What it returns must outlive the
    call: the FaTensors only point into the arrays."""
    nm, names = _namer(names)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    q = prepare(q, nm("q"), kind, cuda=True)
    k = prepare(k, nm("k"), kind, cuda=True)
    v = prepare(v, nm("v"), kind, cuda=True)
    out = prepare(out, nm("out"), kind, cuda=True)
    dout = prepare(dout, nm("dout"), kind, cuda=True)
    codes = (dtype_code(q, nm("q"), kind), dtype_code(k, nm("k"), kind),
             dtype_code(v, nm("v"), kind))
    cu_q = prepare(cu_seqlens_q, nm("cu_seqlens_q"), kind, cuda=True)
    cu_k = prepare(cu_seqlens_k, nm("cu_seqlens_k"), kind, cuda=True)
    used_k = prepare(seqused_k, nm("seqused_k"), kind, cuda=True)
    alibi = prepare(alibi_slopes, nm("alibi_slopes"), kind, cuda=True)
    sinks = prepare(to_float32(sinks, nm("sinks"), kind), nm("sinks"), kind, cuda=True)
    target = None
    if kind == TORCH:
        target = cuda_target([(nm("q"), q), (nm("k"), k), (nm("v"), v), ("out", out),
                              ("dout", dout), ("lse", lse), (nm("cu_seqlens_q"), cu_q),
                              (nm("cu_seqlens_k"), cu_k), (nm("seqused_k"), used_k),
                              (nm("alibi_slopes"), alibi), (nm("sinks"), sinks), ("dq", dq),
                              ("dk", dk), ("dv", dv)])

    if dq is None:
        dq = empty(kind, tuple(q.shape), q)
    if dk is None:
        dk = empty(kind, tuple(k.shape), k)
    if dv is None:
        dv = empty(kind, tuple(v.shape), v)
    dsinks = empty_f32(kind, (int(q.shape[-2]),), q) if sinks is not None else None

    args, keep = _fwd_args(q, k, v, out, lse, None, cu_q, cu_k, used_k, alibi, sinks, codes,
                           kind, nm, varlen, max_seqlen_q, max_seqlen_k, window_size, dropout_p,
                           softcap, softmax_scale, causal, seed, offset, num_threads, target)
    bwd = _lib.new_bwd_args()
    grads = [make_tensor(x, nm(n), kind) if x is not None else None
             for x, n in ((dout, "dout"), (dq, "dq"), (dk, "dk"), (dv, "dv"),
                          (dsinks, "dsinks"))]
    keep.extend(grads)
    bwd.fwd = ctypes.pointer(args)
    bwd.dout, bwd.dq, bwd.dk, bwd.dv, bwd.dsinks = (
        ctypes.pointer(g) if g is not None else None for g in grads)
    bwd.deterministic = 1 if as_bool(deterministic, "deterministic") else 0
    workspace = None
    if target is not None:
        # The CUDA backward allocates nothing itself: its dQ accumulator comes from torch's
        # allocator (aligned to 512 bytes, and stream-ordered with the caller's work).
        size = _lib.backward_workspace_size(bwd)
        workspace = sys.modules["torch"].empty(max(size, 1), dtype=sys.modules["torch"].uint8,
                                               device=q.device)
        bwd.workspace = workspace.data_ptr()
        bwd.workspace_size = size
    return (bwd, keep, (dout, q, k, v, out, cu_q, cu_k, used_k, alibi, sinks),
            (dq, dk, dv, dsinks), names, workspace)
