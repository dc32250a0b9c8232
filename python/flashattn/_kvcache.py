"""``flash_attn_with_kvcache`` and ``flash_attn_combine`` over the C library.

``flash_attn_with_kvcache`` has upstream FA2's signature (plus the keyword-only
``learnable_sink``) and calls ``fa_attention_kvcache``; ``flash_attn_combine`` has FA3's and
calls ``fa_attention_combine``. Both take torch CPU tensors or NumPy arrays and return the same
kind; both also take CUDA tensors (the KV-cache call then runs ``_kvcache_varlen``'s
composition of torch ops and the varlen forward). Neither has a backward pass (upstream's have
none either).

The caches are updated in place when new keys are given, through the caller's own memory:
they are never copied, so they must already have a contiguous last dimension (and, for NumPy,
be writeable).
"""

import ctypes
import sys

from . import _core, _lib
from ._lib import FlashAttnError

__all__ = ["flash_attn_with_kvcache", "flash_attn_combine"]

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


def _kv_lib():
    """The library with this module's four functions declared (once)."""
    global _DECLARED
    lib = _lib.get_lib()
    if _DECLARED is not lib:
        try:
            lib.fa_kvcache_args_init.argtypes = [ctypes.POINTER(FaKvcacheArgs)]
            lib.fa_kvcache_args_init.restype = None
            lib.fa_attention_kvcache.argtypes = [ctypes.POINTER(FaKvcacheArgs)]
            lib.fa_attention_kvcache.restype = ctypes.c_int
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
_NAMES = {
    "sinks": "learnable_sink",
    "window_left": "window_size[0] (left)",
    "window_right": "window_size[1] (right)",
}


def _in_place(x, name, kind, written, cuda=False):
    """A cache is used through the caller's memory, never a copy: it must be usable as is.
    ``written``: what the call writes into it (None: nothing). ``cuda``: a CUDA tensor is
    accepted (the combine's out)."""
    if written:
        _core.refuse_overlap(x, name, written)
    if kind == _core.TORCH:
        _core.check_device(x, name, cuda)
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


def _is_array(x):
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    return ((torch is not None and isinstance(x, torch.Tensor))
            or (np is not None and isinstance(x, np.ndarray)))


def _seqlens_array(cache_seqlens, kind, b, like):
    """An int cache_seqlens becomes an int32 array of b copies, as upstream does."""
    if cache_seqlens is None or _is_array(cache_seqlens):
        return cache_seqlens
    n = _core.as_int(cache_seqlens, "cache_seqlens", _core.INT32)
    if kind == _core.TORCH:
        torch = sys.modules["torch"]
        return torch.full((b,), n, dtype=torch.int32, device=like.device)
    np = sys.modules["numpy"]
    return np.full((b,), n, dtype=np.int32)


def _call(fn, args, names):
    status = fn(ctypes.byref(args))
    try:
        _lib.check(status)
    except FlashAttnError as e:
        raise FlashAttnError(_core._rename(str(e), names), e.status) from None


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, learnable_sink=None):
    """Attention of q against a KV cache, appending k and v to the cache in place first.

    If k and v are given they are written into k_cache / v_cache at positions cache_seqlens
    (rotated first when rotary_cos / rotary_sin are given), and the attention runs over the
    updated cache, as one call. For decoding: q holds the new tokens' queries.

    Arguments:
        q: (batch_size, seqlen, nheads, headdim)
        k_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim), or with block_table
            (num_blocks, page_block_size, nheads_k, headdim): any page size >= 1.
        v_cache: as k_cache, with headdim_v.
        k, v [optional]: (batch_size, seqlen_new, nheads_k, headdim / headdim_v), appended
            at cache_seqlens (which is then required).
        rotary_cos, rotary_sin [optional]: (seqlen_ro, rotary_dim / 2), q's dtype; any even
            rotary_dim <= headdim. Rotates k at positions cache_seqlens + i, and q at
            cache_seqlens + i when causal or local, else at cache_seqlens.
        cache_seqlens: int or int32 (batch_size,): keys already in each cache row; None:
            the whole cache.
        cache_batch_idx [optional]: int32 (batch_size,): the cache row of each sequence.
        cache_leftpad [optional]: int32 (batch_size,): the first cache position used.
        block_table [optional]: int32 (batch_size, max_num_blocks_per_seq): paged cache.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as flash_attn_func.
        rotary_interleaved: True pairs dims (0, 1), (2, 3)... (GPT-J); False pairs
            (i, i + rotary_dim / 2) (GPT-NeoX).
        num_splits: split-KV chunks; 0 lets the library choose (CUDA tensors: 8 where the
            unsplit kernel would be long, else none), 1 never splits.
        return_softmax_lse: also return the float32 lse (batch_size, nheads, seqlen).
        learnable_sink (keyword only): float (nheads,) sink logit per head.
    Return:
        out: (batch_size, seqlen, nheads, headdim_v), and softmax_lse when asked for.
    """
    kind = _core.common_kind(
        [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
         ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
         ("cache_seqlens", cache_seqlens if _is_array(cache_seqlens) else None),
         ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
         ("block_table", block_table), ("alibi_slopes", alibi_slopes),
         ("learnable_sink", learnable_sink)], 3)
    if kind == _core.TORCH:
        # torch calls go through the custom op flashattn::kvcache, so torch.compile keeps the
        # call (and its in-place append) as one node instead of breaking the graph.
        from . import _torch_ops

        out, lse = _torch_ops.kvcache_call(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, alibi_slopes, learnable_sink, softmax_scale, causal,
            window_size, softcap, rotary_interleaved, num_splits, return_softmax_lse)
    else:
        out, lse = kvcache_run(kind, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                               cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                               alibi_slopes, learnable_sink, softmax_scale, causal, window_size,
                               softcap, rotary_interleaved, num_splits)
    return (out, lse) if return_softmax_lse else out


def kvcache_run(kind, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                cache_batch_idx, cache_leftpad, block_table, alibi_slopes, learnable_sink,
                softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits):
    """One fa_attention_kvcache call on arrays of ``kind``; returns (out, lse)."""
    args, _, _, _, out, lse = kvcache_prepare(
        kind, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, alibi_slopes, learnable_sink, softmax_scale, causal,
        window_size, softcap, rotary_interleaved, num_splits)
    _call(_kv_lib().fa_attention_kvcache, args, _NAMES)
    return out, lse


def kvcache_prepare(kind, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                    cache_batch_idx, cache_leftpad, block_table, alibi_slopes, learnable_sink,
                    softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits):
    """The checked fa_kvcache_args of a call and its new outputs: (args, keep, arrays, slots,
    out, lse), where arrays are what the library is given for q .. lse in the struct's order
    (None where absent; a copy where an input was converted), slots their FaTensors, and keep
    what must outlive the call."""
    written = _core.APPENDED if k is not None or v is not None else None
    k_cache = _in_place(k_cache, "k_cache", kind, written)
    v_cache = _in_place(v_cache, "v_cache", kind, written)
    q = _core.prepare(q, "q", kind)
    for x, name, layout in ((q, "q", "(batch_size, seqlen, nheads, headdim)"),
                            (v_cache, "v_cache", "(batch, seqlen_cache, nheads_k, headdim)")):
        if len(x.shape) != 4:
            raise FlashAttnError("%s: expected 4 dimensions %s, got shape %s"
                                 % (name, layout, tuple(x.shape)))
    b, sq, h = int(q.shape[0]), int(q.shape[1]), int(q.shape[2])
    dv = int(v_cache.shape[3])
    cache_seqlens = _seqlens_array(cache_seqlens, kind, b, q)
    sinks = _core.to_float32(learnable_sink, "learnable_sink", kind)

    out = _core.empty(kind, (b, sq, h, dv), q)
    lse = _core.empty_f32(kind, (b, h, sq), q)
    left, right = _core.window_pair(window_size)
    softcap = _core.as_float(softcap, "softcap")
    scale = _core.as_scale(softmax_scale)
    scale = float("nan") if scale is None else scale
    num_splits = _core.as_int(num_splits, "num_splits", _core.INT32)

    keep, arrays, slots = [], [], []

    def ptr(x, name, expected=None, prepared=False):
        if x is not None and not prepared:
            x = _core.prepare(x, name, kind)
            keep.append(x)
        arrays.append(x)
        if x is None:
            slots.append(None)
            return None
        t = _core.make_tensor(x, _NAMES.get(name, name), kind, None, expected)
        keep.append(t)
        slots.append(t)
        return ctypes.pointer(t)

    args = FaKvcacheArgs()
    _kv_lib().fa_kvcache_args_init(ctypes.byref(args))
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
    return args, keep, arrays, slots, out, lse


def _out_dtype(kind, out_dtype, out, out_partial):
    if out_dtype is None:
        return out.dtype if out is not None else out_partial.dtype
    if kind == _core.TORCH:
        return out_dtype
    return sys.modules["numpy"].dtype(out_dtype)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merges attention computed over disjoint chunks of the keys (FA3's function).

    Arguments:
        out_partial: float32 (num_splits, batch_size, seqlen, nheads, headdim), each chunk's
            normalised output.
        lse_partial: float32 (num_splits, batch_size, seqlen, nheads), each chunk's
            log-sum-exp; -inf (or +inf, what the forward gives a row that sees no key)
            marks an empty chunk, whose output is not read.
        out [optional]: (batch_size, seqlen, nheads, headdim), written in place.
        out_dtype [optional]: float32 (default: out_partial's), float16, bfloat16 or float64.
    Return:
        (out, lse): out (batch_size, seqlen, nheads, headdim) in out_dtype; lse float32
        (batch_size, seqlen, nheads), a transposed view of a (batch_size, nheads, seqlen)
        array as FA3 returns it. A row whose chunks are all empty gets out 0, lse -inf.

    Torch tensors go through the custom op ``torch.ops.flashattn.combine`` (CPU and CUDA).
    """
    kind = _core.common_kind([("out_partial", out_partial), ("lse_partial", lse_partial),
                              ("out", out)], 2)
    if kind == _core.TORCH:
        # Checked here, the rest inside the op (so that torch.compile traces no more than this).
        _core.check_device(out_partial, "out_partial", cuda=True)
        _core.check_device(lse_partial, "lse_partial", cuda=True)
    else:
        out_partial = _core.prepare(out_partial, "out_partial", kind)
    if len(out_partial.shape) != 5:
        raise FlashAttnError("out_partial: expected 5 dimensions (num_splits, batch_size, "
                             "seqlen, nheads, headdim), got shape %s" % (tuple(out_partial.shape),))
    _, b, sq, h, dv = (int(n) for n in out_partial.shape)
    dtype = _out_dtype(kind, out_dtype, out, out_partial)
    if out is not None:
        if out.dtype != dtype:
            raise FlashAttnError("out: dtype %s does not match out_dtype %s" % (out.dtype, dtype))
        out = _in_place(out, "out", kind, "the merged output is written into it", cuda=True)
    elif kind == _core.TORCH:
        out = sys.modules["torch"].empty((b, sq, h, dv), dtype=dtype, device=out_partial.device)
    else:
        out = sys.modules["numpy"].empty((b, sq, h, dv), dtype=dtype)
    if kind == _core.TORCH:
        from . import _torch_ops

        return out, _torch_ops.combine_call(out_partial, lse_partial, out)
    return out, combine_run(kind, out_partial, lse_partial, out)


def combine_run(kind, out_partial, lse_partial, out):
    """One fa_attention_combine call writing ``out``; returns the lse it allocates. CUDA
    tensors the library refuses (its combine has no CUDA backend yet) are merged by
    ``_combine_torch`` after the library has validated them."""
    out_partial = _core.prepare(out_partial, "out_partial", kind, cuda=True)
    lse_partial = _core.prepare(lse_partial, "lse_partial", kind, cuda=True)
    if kind == _core.TORCH:
        torch = sys.modules["torch"]
        target = _core.cuda_target([("out_partial", out_partial), ("lse_partial", lse_partial),
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
        t = _core.make_tensor(x, name, kind)
        keep.append(t)
        return ctypes.pointer(t)

    lib = _kv_lib()
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
            and _lib.last_error().startswith("device:")):
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
