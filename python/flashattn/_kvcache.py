"""The C library's KV-cache and combine calls over arrays (``fa_attention_kvcache``,
``fa_attention_combine``): their argument structs, the checks only Python can make, the
preparation and the call. Framework-neutral (torch tensors on the CPU or a CUDA device, or NumPy
arrays), below the public ``flash_attn_with_kvcache`` and ``flash_attn_combine``
(``flash_attn_interface``) and the torch ops and caches that call it.

The caches are updated in place when new keys are given, through the caller's own memory:
they are never copied, so they must already have a contiguous last dimension (and, for NumPy,
be writeable).
"""

import ctypes
import sys

from . import _arrays, _core, _lib
from ._lib import FlashAttnError

__all__ = ["kvcache_run", "run_kvcache", "kvcache_prepare", "combine_run"]

_PT = ctypes.POINTER(_lib.FaTensor)


class FaKvcacheArgs(ctypes.Structure):
    """struct fa_kvcache_args."""

    _fields_ = [
        ("q", _PT),
        ("k_cache", _PT),
        ("v_cache", _PT),
        ("k", _PT),
        ("v", _PT),
        ("rotary_cos", _PT),
        ("rotary_sin", _PT),
        ("cache_seqlens", _PT),
        ("cache_batch_idx", _PT),
        ("cache_leftpad", _PT),
        ("block_table", _PT),
        ("alibi_slopes", _PT),
        ("sinks", _PT),
        ("out", _PT),
        ("lse", _PT),
        ("softmax_scale", ctypes.c_double),
        ("causal", ctypes.c_int),
        ("window_left", ctypes.c_int),
        ("window_right", ctypes.c_int),
        ("softcap", ctypes.c_double),
        ("rotary_interleaved", ctypes.c_int),
        ("num_splits", ctypes.c_int),
        ("device", ctypes.c_int),
        ("stream", ctypes.c_void_p),
        ("num_threads", ctypes.c_int),
        ("workspace", ctypes.c_void_p),
        ("workspace_size", ctypes.c_size_t),
        ("skip_capacity_check", ctypes.c_int),
        ("k_descale", _PT),
        ("v_descale", _PT),
    ]


class FaCombineArgs(ctypes.Structure):
    """struct fa_combine_args."""

    _fields_ = [
        ("out_partial", _PT),
        ("lse_partial", _PT),
        ("out", _PT),
        ("lse", _PT),
        ("device", ctypes.c_int),
        ("stream", ctypes.c_void_p),
        ("num_threads", ctypes.c_int),
    ]


_DECLARED = None


def kv_lib():
    """The library with this module's four functions declared (once)."""
    global _DECLARED
    lib = _lib.get_lib()
    if _DECLARED is not lib:
        try:
            lib.fa_kvcache_args_init.argtypes = [ctypes.POINTER(FaKvcacheArgs)]
            lib.fa_kvcache_args_init.restype = None
            lib.fa_attention_kvcache.argtypes = [ctypes.POINTER(FaKvcacheArgs)]
            lib.fa_attention_kvcache.restype = ctypes.c_int
            lib.fa_attention_kvcache_workspace_size.argtypes = [ctypes.POINTER(FaKvcacheArgs)]
            lib.fa_attention_kvcache_workspace_size.restype = ctypes.c_size_t
            lib.fa_combine_args_init.argtypes = [ctypes.POINTER(FaCombineArgs)]
            lib.fa_combine_args_init.restype = None
            lib.fa_attention_combine.argtypes = [ctypes.POINTER(FaCombineArgs)]
            lib.fa_attention_combine.restype = ctypes.c_int
        except AttributeError as e:
            raise FlashAttnError("flashattn: the loaded library %s has no KV-cache functions (%s);"
                                 " rebuild it" % (_lib.library_path(), e)) from None
        _DECLARED = lib
    return lib


# Names of the C arguments as the Python caller knows them.
NAMES = {
    "sinks": "learnable_sink",
    "window_left": "window_size[0] (left)",
    "window_right": "window_size[1] (right)",
}


def in_place(x, name, kind, written, cuda=False):
    """A cache is used through the caller's memory, never a copy: it must be usable as is.
    ``written``: what the call writes into it (None: nothing). ``cuda``: a CUDA tensor is
    accepted (the combine's out)."""
    if written:
        _arrays.refuse_overlap(x, name, written, kind)
    if kind == _arrays.TORCH:
        _arrays.check_device(x, name, cuda)
        if x.dim() > 0 and x.shape[-1] > 1 and x.stride(-1) != 1:
            raise FlashAttnError("%s: the last dimension must be contiguous (stride 1); the cache "
                                 "is used in place, so it is not copied" % name)
        return x
    if x.ndim > 0 and x.shape[-1] > 1 and x.strides[-1] != x.dtype.itemsize:
        raise FlashAttnError("%s: the last dimension must be contiguous; the cache is used in "
                             "place, so it is not copied" % name)
    if any(s % x.dtype.itemsize for s in x.strides):
        raise FlashAttnError("%s: strides must be multiples of the element size" % name)
    if x.dtype.byteorder not in ("=", "|") and x.dtype.byteorder != ("<" if sys.byteorder ==
                                                                     "little" else ">"):
        raise FlashAttnError("%s: must be in native byte order (it is used in place)" % name)
    if written and not x.flags.writeable:
        raise FlashAttnError("%s: the array is read-only, but %s" % (name, written))
    return x


def is_array(x):
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    return ((torch is not None and isinstance(x, torch.Tensor))
            or (np is not None and isinstance(x, np.ndarray)))


def seqlens_array(cache_seqlens, kind, b, like):
    """An int cache_seqlens becomes an int32 array of b copies, as upstream does."""
    if cache_seqlens is None or is_array(cache_seqlens):
        return cache_seqlens
    n = _core.as_int(cache_seqlens, "cache_seqlens", _core.INT32)
    if kind == _arrays.TORCH:
        torch = sys.modules["torch"]
        return torch.full((b,), n, dtype=torch.int32, device=like.device)
    np = sys.modules["numpy"]
    return np.full((b,), n, dtype=np.int32)


def call(fn, args, names):
    status = fn(ctypes.byref(args))
    try:
        _lib.check(status)
    except FlashAttnError as e:
        raise FlashAttnError(_core._rename(str(e), names), e.status) from None


def kvcache_run(kind, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                cache_batch_idx, cache_leftpad, block_table, alibi_slopes, learnable_sink,
                softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits,
                k_descale=None, v_descale=None):
    """One fa_attention_kvcache call on arrays of ``kind``; returns (out, lse)."""
    return run_kvcache(
        kind, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, alibi_slopes, learnable_sink, softmax_scale, causal,
        window_size, softcap, rotary_interleaved, num_splits, k_descale=k_descale,
        v_descale=v_descale)[4:6]


def run_kvcache(*arguments, **descales):
    """``kvcache_run``'s call (the same arguments), returning what ``kvcache_prepare``
    prepared, for ``_cached`` to keep: (args, keep, arrays, slots, out, lse)."""
    prepared = kvcache_prepare(*arguments, **descales)
    call(kv_lib().fa_attention_kvcache, prepared[0], NAMES)
    return prepared


def kvcache_prepare(kind, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                    cache_batch_idx, cache_leftpad, block_table, alibi_slopes, learnable_sink,
                    softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits,
                    k_descale=None, v_descale=None):
    """The checked fa_kvcache_args of a call and its new outputs: (args, keep, arrays, slots,
    out, lse), where arrays are what the library is given for the tensors of ``ARG_NAMES``
    (None where absent; a copy where an input was converted), slots their FaTensors, and keep
    what must outlive the call. The fp8 caches' descales are float32 (batch, nheads_k), absent
    meaning 1."""
    written = _arrays.APPENDED if k is not None or v is not None else None
    cuda = kind == _arrays.TORCH and q.is_cuda
    k_cache = in_place(k_cache, "k_cache", kind, written, cuda)
    v_cache = in_place(v_cache, "v_cache", kind, written, cuda)
    q = _arrays.prepare(q, "q", kind, cuda)
    for x, name, layout in ((q, "q", "(batch_size, seqlen, nheads, headdim)"),
                            (v_cache, "v_cache", "(batch, seqlen_cache, nheads_k, headdim)")):
        if len(x.shape) != 4:
            raise FlashAttnError("%s: expected 4 dimensions %s, got shape %s"
                                 % (name, layout, tuple(x.shape)))
    b, sq, h = int(q.shape[0]), int(q.shape[1]), int(q.shape[2])
    dv = int(v_cache.shape[3])
    cache_seqlens = seqlens_array(cache_seqlens, kind, b, q)
    sinks = _arrays.to_float32(learnable_sink, "learnable_sink", kind)

    out = _arrays.empty(kind, (b, sq, h, dv), q)
    lse = _arrays.empty_f32(kind, (b, h, sq), q)
    left, right = _core.window_pair(window_size)
    softcap = _core.as_float(softcap, "softcap")
    scale = _core.c_scale(softmax_scale)
    num_splits = _core.as_int(num_splits, "num_splits", _core.INT32)

    keep, arrays, slots = [], [], []

    def ptr(x, name, expected=None, prepared=False):
        if x is not None and not prepared:
            x = _arrays.prepare(x, name, kind, cuda)
            keep.append(x)
        arrays.append(x)
        if x is None:
            slots.append(None)
            return None
        t = _arrays.make_tensor(x, NAMES.get(name, name), kind, None, expected)
        keep.append(t)
        slots.append(t)
        return ctypes.pointer(t)

    args = FaKvcacheArgs()
    kv_lib().fa_kvcache_args_init(ctypes.byref(args))
    args.q = ptr(q, "q", prepared=True)
    args.k_cache = ptr(k_cache, "k_cache", prepared=True)
    args.v_cache = ptr(v_cache, "v_cache", prepared=True)
    args.k = ptr(k, "k")
    args.v = ptr(v, "v")
    args.rotary_cos = ptr(rotary_cos, "rotary_cos")
    args.rotary_sin = ptr(rotary_sin, "rotary_sin")
    args.cache_seqlens = ptr(cache_seqlens, "cache_seqlens", "int32")
    args.cache_batch_idx = ptr(cache_batch_idx, "cache_batch_idx", "int32")
    args.cache_leftpad = ptr(cache_leftpad, "cache_leftpad", "int32")
    args.block_table = ptr(block_table, "block_table", "int32")
    args.alibi_slopes = ptr(alibi_slopes, "alibi_slopes", "float32")
    args.sinks = ptr(sinks, "sinks", "float32")
    args.k_descale = ptr(k_descale, "k_descale", "float32")
    args.v_descale = ptr(v_descale, "v_descale", "float32")
    args.out = ptr(out, "out", prepared=True)
    args.lse = ptr(lse, "lse", prepared=True)
    args.softmax_scale = scale
    args.causal = 1 if _core.as_bool(causal, "causal") else 0
    args.window_left = left
    args.window_right = right
    args.softcap = softcap
    args.rotary_interleaved = 1 if _core.as_bool(rotary_interleaved, "rotary_interleaved") else 0
    args.num_splits = num_splits
    args.device = _lib.FA_DEVICE_CPU
    args.num_threads = 0
    if cuda:
        named = [(name, x) for name, x in zip(ARG_NAMES, arrays) if x is not None]
        args.device, args.stream = _arrays.cuda_target(named)
        _device_workspace(args, keep)
    return args, keep, arrays, slots, out, lse


# The tensors of fa_kvcache_args (kvcache_prepare's ``arrays``): the inputs in the order of
# flash_attn_with_kvcache's arguments, then the outputs.
ARG_NAMES = ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
              "cache_batch_idx", "cache_leftpad", "block_table", "alibi_slopes",
              "learnable_sink", "k_descale", "v_descale", "out", "lse")


def _device_workspace(args, keep):
    """A CUDA call's split workspace (from torch's caching allocator, so nothing is allocated
    by the library), and, while a CUDA graph is being captured, no host check of
    cache_seqlens: the copy it makes cannot be captured, and the kernels clamp indices."""
    _lib.attach_workspace(args, kv_lib().fa_attention_kvcache_workspace_size, keep)
    torch = sys.modules["torch"]
    args.skip_capacity_check = 1 if torch.cuda.is_current_stream_capturing() else 0


def combine_run(kind, out_partial, lse_partial, out):
    """One fa_attention_combine call writing ``out``; returns the lse it allocates. CUDA
    tensors the library's device combine does not take (fp64, or no CUDA driver) are merged by
    ``_combine_torch`` after the library has validated them."""
    out_partial = _arrays.prepare(out_partial, "out_partial", kind, cuda=True)
    lse_partial = _arrays.prepare(lse_partial, "lse_partial", kind, cuda=True)
    if kind == _arrays.TORCH:
        torch = sys.modules["torch"]
        target = _arrays.cuda_target([("out_partial", out_partial), ("lse_partial", lse_partial),
                                    ("out", out)])
        b, sq, h = (int(n) for n in out_partial.shape[1:4])
        lse = torch.empty_strided((b, sq, h), (h * sq, 1, sq), dtype=lse_partial.dtype,
                                  device=out_partial.device)
    else:
        target = None
        b, sq, h = out_partial.shape[1:4]
        lse = sys.modules["numpy"].empty((b, h, sq), dtype=lse_partial.dtype).transpose(0, 2, 1)

    keep = []

    def ptr(x, name):
        t = _arrays.make_tensor(x, name, kind)
        keep.append(t)
        return ctypes.pointer(t)

    lib = kv_lib()
    args = FaCombineArgs()
    lib.fa_combine_args_init(ctypes.byref(args))
    args.out_partial = ptr(out_partial, "out_partial")
    args.lse_partial = ptr(lse_partial, "lse_partial")
    args.out = ptr(out, "out")
    args.lse = ptr(lse, "lse")
    if target is not None:
        args.device, args.stream = target
    status = lib.fa_attention_combine(ctypes.byref(args))
    if (target is not None and status == _lib.STATUS_UNSUPPORTED
            and _lib.last_error().startswith(("device:", "out_partial:", "out:"))):
        _combine_torch(out_partial, lse_partial, out, lse)
        return lse
    _lib.check(status)
    return lse


def _combine_torch(out_partial, lse_partial, out, lse):
    """fa_attention_combine's merge in torch ops, in float64 as the C library computes it: no
    host synchronisation, so it runs inside CUDA graphs too. An infinite part lse marks an
    empty part (its output is never read, even if it holds NaN); a NaN lse makes its row NaN;
    a row with no part gets out 0 and lse -inf."""
    torch = sys.modules["torch"]
    part = lse_partial.double()
    empty = torch.isinf(part)
    part = part.masked_fill(empty, float("-inf"))
    top = part.amax(0)
    top = top.masked_fill(top == float("-inf"), 0.0)
    total = top + torch.log(torch.exp(part - top).sum(0))
    weight = torch.exp(part - total).masked_fill(empty, 0.0)
    merged = torch.where(empty.unsqueeze(-1), 0.0, out_partial.double() * weight.unsqueeze(-1))
    out.copy_(merged.sum(0))
    lse.copy_(total)
