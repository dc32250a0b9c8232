"""The commonest torch calls of the forward and the backward with their prepared C arguments
cached per call signature (``_core.forward``'s and ``_core.backward``'s work done once per
signature, per thread).

Everything ``_core._prepare_forward`` checks and builds depends only on the tensors' metadata and
the options, so a later call with the same signature only allocates the outputs and swaps in
the data pointers, the current stream and the seed before calling the library, which validates
every call itself. ``forward_dense_torch`` and ``forward_varlen_torch`` take the dense and
varlen forms; ``_fastpath`` (C) looks up and runs the dense form's prepared calls for
``flash_attn_func``'s commonest call. ``kvcache_torch`` does the same for
the KV-cache call, where a decoding step's attention can take less time than the Python that
prepares it.
"""

import ctypes
import struct
import sys
import threading
import types

from . import _kvcache, _lib
from ._arrays import TORCH, _raw_stream
from ._core import _rename, forward, run_backward, run_forward, window_pair
from ._lib import FaTensor, FlashAttnError

try:  # flash_attn_func's commonest call in C (_fastpath.c); absent where it was not built
    from . import _fastpath
except ImportError:
    _fastpath = None


class _CachedCall:
    """The prepared fa_fwd_args of one call signature (``forward_dense_torch``,
    ``forward_varlen_torch``): the FaTensors whose data pointers are swapped in per call (q, k, v,
    out, lse, then the varlen form's other tensors in ``_fwd_args``' order), the outputs'
    shapes, the CUDA device index (None on the CPU), whose current stream each call reads, the
    names for error messages and the library call itself. like_q: torch.empty_like(q), the
    cheapest allocation, gives out's shape, dtype and strides (q's strides are part of the
    signature, so it always will where out has q's dtype)."""

    __slots__ = ("args", "tensors", "out_shape", "dtype", "device", "cuda", "fn",
                 "ref", "like_q", "names", "fast", "lse_like", "ws_like")

    def __init__(self, args, keep, q, out, lse, names):
        self.args = args
        self.fn = _lib.get_lib().fa_attention_forward
        self.ref = ctypes.byref(args)
        torch = sys.modules["torch"]
        self.like_q = (out.shape == q.shape and out.dtype == q.dtype
                       and torch.empty_like(q).stride() == out.stride())
        self.tensors = _structs(keep)
        self.out_shape = out.shape
        self.dtype = out.dtype
        self.device = out.device
        self.cuda = out.device.index if out.device.type == "cuda" else None
        self.names = names
        self.lse_like = None if lse is None else _like(torch, lse.shape, torch.float32,
                                                        lse.device)
        # A split few-row call's workspace, new per call.
        self.ws_like = (_like(torch, (args.workspace_size,), torch.uint8, out.device)
                        if self.cuda is not None and args.workspace_size else None)
        self.fast = self._fast_fields() if self.like_q and _fastpath is not None else None

    def _fast_fields(self):
        """What _fastpath reads and calls, int64 each in FAST_FIELDS' order: the addresses of
        the library's forward, of the arguments, of the data fields of q, k, v, out and lse (0
        without one) and of the stream field (0 on the CPU), the CUDA device index (-1 on the
        CPU) and the address of the workspace field (0 for a call without a workspace)."""
        data = FaTensor.data.offset
        args = ctypes.addressof(self.args)
        fields = dict(zip(("q", "k", "v", "out"),
                          (ctypes.addressof(t) + data for t in self.tensors[:4])))
        fields.update(
            fn=ctypes.cast(self.fn, ctypes.c_void_p).value, args=args,
            lse=ctypes.addressof(self.tensors[4]) + data if self.lse_like is not None else 0,
            stream=args + type(self.args).stream.offset if self.cuda is not None else 0,
            device=-1 if self.cuda is None else self.cuda,
            workspace=args + type(self.args).workspace.offset if self.ws_like is not None else 0)
        return struct.pack("=%dq" % len(FAST_FIELDS), *(fields[f] for f in FAST_FIELDS))


# The layout of _CachedCall.fast and of _fastpath.dense_lse's arguments, handed to _fastpath.
FAST_FIELDS = ("fn", "args", "q", "k", "v", "out", "lse", "stream", "device", "workspace")
LSE_ARGS = ("q", "k", "v", "softmax_scale", "causal", "window_size", "softcap")


def _like(torch, shape, dtype, device):
    """One element of dtype expanded to shape: torch.empty_like of it is a new contiguous tensor
    of that shape (empty_like lays out stride-0 tensors contiguously), the cheapest allocation
    (a third of torch.empty(shape, dtype=, device=)'s argument parsing). The element is one
    seed per (dtype, device), shared by every cached call."""
    key = (dtype, device)
    seed = _SEEDS.get(key)
    if seed is None:
        seed = _SEEDS.setdefault(key, _new_seed(torch, dtype, device))
    return seed.expand(shape)


_SEEDS = {}


def _structs(keep):
    """What a cached call holds of its first call's ``keep``: the C structs, not the torch
    tensors (that call's workspace), which would outlive it and, allocated in a CUDA graph's
    pool, fail torch.compile's check that nothing there outlives the graph's outputs."""
    torch = sys.modules["torch"]
    return [t for t in keep if not isinstance(t, torch.Tensor)]


def _new_seed(torch, dtype, device):
    """A one-element tensor that no CUDA graph's memory pool holds. torch.compile's CUDA graphs
    route every allocation of the thread running the model to their pool and refuse to run when
    a block of it outlives the graph's outputs, so outside a stream capture the seed is made on
    a thread of its own; inside one (torch.cuda.graph) it comes from the captured pool as any
    allocation does, other threads' allocations being unsafe there."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.empty((), dtype=dtype, device=device)
    made = []
    worker = threading.Thread(target=lambda: made.append(torch.empty((), dtype=dtype,
                                                                     device=device)))
    worker.start()
    worker.join()
    if not made:
        raise RuntimeError("flashattn: could not allocate a one-element tensor on %s" % device)
    return made[0]


_LOCAL = threading.local()  # per-thread _CachedCall caches: the C call runs without the GIL
_CALL_CACHE_SIZE = 64


def _signature(*tensors):
    """What a cached call depends on of each tensor (None stays None); raises RuntimeError for
    tensors without strides (sparse and other layouts)."""
    return tuple(None if x is None else
                 (x.shape, x.stride(), x.dtype, x.device, x.is_neg()) for x in tensors)


def _call_cache():
    cache = getattr(_LOCAL, "calls", None)
    if cache is None:
        cache = _LOCAL.calls = {}
    return cache


def _lookup(cache, key):
    """cache.get(key); None for a key that cannot be looked up (an argument the caller gave
    unhashable: the preparation says what is wrong with it)."""
    if key is None:
        return None
    try:
        return cache.get(key)
    except TypeError:
        return None


def _keep_call(cache, key, call):
    """Keeps call under key (not when key cannot be hashed: ``_lookup`` never finds it)."""
    if len(cache) >= _CALL_CACHE_SIZE:
        cache.clear()
    try:
        cache[key] = call
    except TypeError:
        pass


def _repeat_call(call, q, k, v, others, want_lse, seed=0):
    """One more call of a cached signature on new tensors (q, k, v and the varlen form's
    others, None left out) with new outputs: (out, lse or None). As in
    ``_CachedBackward.run``, every allocation comes before the first write into the prepared
    arguments."""
    torch = sys.modules["torch"]
    if call.like_q:
        out = torch.empty_like(q)
    else:
        out = torch.empty(call.out_shape, dtype=call.dtype, device=call.device)
    lse = torch.empty_like(call.lse_like) if want_lse else None
    ws = torch.empty_like(call.ws_like) if call.ws_like is not None else None
    stream = _raw_stream(call.cuda) if call.cuda is not None else None
    arrays = [q, k, v, out, lse] + list(others or ())
    writes = [(slot, x.data_ptr()) for slot, x in zip(call.tensors, arrays) if x is not None]
    for slot, ptr in writes:
        slot.data = ptr
    args = call.args
    if stream is not None:
        args.stream = stream
    if ws is not None:
        args.workspace = ws.data_ptr()
    args.seed = seed & 0xFFFFFFFFFFFFFFFF
    status = call.fn(call.ref)
    if status != _lib.STATUS_OK:
        _call_failed(call, status)
    return out, lse


def _call_failed(call, status):
    """Raises the library's error for a cached call's status, in the caller's argument names."""
    try:
        _lib.check(status)
    except FlashAttnError as e:
        raise FlashAttnError(_rename(str(e), call.names), e.status) from None


def dense_key(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, want_lse):
    """The signature of a dense call (_fastpath's fp_key builds the same tuple): each tensor's
    metadata, then the options as the caller gave them (``softmax_scale`` None for the
    default), ``window_size`` already a pair. RuntimeError for tensors without strides."""
    return (q.shape, q.stride(), q.dtype, q.device, q.is_neg(),
            k.shape, k.stride(), k.dtype, k.device, k.is_neg(),
            v.shape, v.stride(), v.dtype, v.device, v.is_neg(),
            dropout_p, softmax_scale, causal, window_size, softcap, want_lse)


def forward_dense_torch(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, seed,
                        want_lse=True):
    """``forward`` for the commonest torch call, (out, lse): dense, no ALiBi, sinks or probs,
    new fp32-lse outputs; ``window_size`` a pair of ints. Without ``want_lse`` the library
    writes no lse and lse is None. Cached per signature (``dense_key``), per thread, a bounded
    number of signatures; a call with the lse and without dropout is looked up in C first."""
    if _DENSE_LSE and want_lse and not seed:
        res = _DENSE_LSE(q, k, v, softmax_scale, causal, window_size, softcap)
        if res is not None:
            return res
    try:
        key = dense_key(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                        want_lse)
    except RuntimeError:  # no strides (sparse and other layouts): forward says why
        out, lse = forward(q, k, v, kind=TORCH, dropout_p=dropout_p,
                           softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           softcap=softcap, seed=seed)[:2]
        return out, lse if want_lse else None
    cache = _call_cache()
    call = _lookup(cache, key)
    if call is not None:
        return _repeat_call(call, q, k, v, None, want_lse, seed)
    args, keep, arrays, out, lse, _, names = run_forward(
        q, k, v, TORCH, None, None, None, 0, 0, dropout_p, softmax_scale, causal,
        window_size, softcap, None, None, False, seed, 0, None, None, None, None, 0, want_lse)
    if key is not None and arrays[0] is q and arrays[1] is k and arrays[2] is v:
        # Inputs used as they are (no contiguous copy), so the signature says it all.
        _keep_call(cache, key, _CachedCall(args, keep, q, out, lse, names))
    return out, lse


_DENSE_LSE = None  # _fastpath.dense_lse once bound


def bind_fastpath(torch, grad_apply, fallback, dense_args, kv_fallback, kv_args, flex_table):
    """(``_fastpath.dense``, ``_fastpath.kvcache``, ``_fastpath.flex``) bound to torch's
    callables (once torch is imported), or (None, None, None) where the extension was not
    built. flex serves flex_attention's repeated calls (``flex_table``: its fallback, argument
    layout and per-thread cache, see ``flex.fastpath_table``; None: flex is not bound). dense
    serves flash_attn_func's commonest calls (arguments in ``dense_args``' order): without
    gradients once their signature is prepared here, with them through grad_apply
    (_DenseFastFn.apply);
    every other call goes to ``fallback``. kvcache serves flash_attn_with_kvcache's prepared
    calls without gradients (arguments in ``kv_args``' order), the others going to
    ``kv_fallback``. Their callers check ``torch.compiler.is_compiling()`` first (Dynamo cannot
    trace C). Nothing here initialises CUDA: it runs when the package meets torch, before any
    fork a caller may make (the capture query is called for CUDA calls only)."""
    global _DENSE_LSE
    if _fastpath is None:
        return None, None, None
    C = torch._C
    _fastpath.bind(dict(
        Tensor=torch.Tensor, float64=torch.float64, empty_like=torch.empty_like,
        modes=(C._len_torch_dispatch_stack, C._is_torch_function_mode_enabled,
               C._are_functorch_transforms_active, C._get_tracing_state),
        grad_enabled=torch.is_grad_enabled, local=_LOCAL, window_pair=window_pair,
        raw_stream=getattr(C, "_cuda_getCurrentRawStream", None) or _raw_stream,
        call_failed=_call_failed, grad_apply=grad_apply, fallback=fallback,
        dense_args=tuple(dense_args), lse_args=LSE_ARGS, fast_fields=FAST_FIELDS,
        kv_fallback=kv_fallback, kv_args=tuple(kv_args), kv_fields=KV_FIELDS,
        capturing=torch.cuda.is_current_stream_capturing, function_type=types.FunctionType,
        method_type=types.MethodType, **(flex_table or {})))
    _DENSE_LSE = _fastpath.dense_lse
    return _fastpath.dense, _fastpath.kvcache, _fastpath.flex if flex_table else None


def forward_varlen_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                         max_seqlen_k, softmax_scale, causal, window_size, softcap,
                         alibi_slopes=None, sinks=None, want_lse=True, names=None):
    """``forward``'s varlen form for torch tensors, cached per signature as
    ``forward_dense_torch`` is (no dropout or probs; the ints and floats already Python ints
    and floats, ``window_size`` a pair): (out, lse or None)."""
    others = (cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, sinks)
    key = ("varlen", _signature(q, k, v, *others), max_seqlen_q, max_seqlen_k, softmax_scale,
           causal, window_size, softcap, want_lse, tuple(sorted(names.items())) if names else ())
    cache = _call_cache()
    call = _lookup(cache, key)
    if call is not None:
        return _repeat_call(call, q, k, v, [x for x in others if x is not None], want_lse)
    args, keep, arrays, out, lse, _, nms = run_forward(
        q, k, v, TORCH, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, 0.0,
        softmax_scale, causal, window_size, softcap, alibi_slopes, sinks, False, 0, 0, None,
        None, None, names, 0, want_lse)
    if key is not None and all(a is b for a, b in zip(arrays, (q, k, v) + others)):
        _keep_call(cache, key, _CachedCall(args, keep, q, out, lse, nms))
    return out, lse


class _CachedBackward:
    """The prepared fa_bwd_args of one backward signature (``backward_dense_torch``, and
    flex_attention's): the FaTensors whose data pointers each call swaps (``slots``: the
    forward arguments' q, k, v, out, lse, then dout, dq, dk, dv), each gradient's ``_like``
    (new ones contiguous, as the first call's were), the workspace's (CUDA: a new one per
    call, of the first call's size), the CUDA device index (None on the CPU) and ``hold``,
    what else the arguments point to."""

    __slots__ = ("bwd", "ref", "fwd", "tensors", "likes", "ws_like", "device", "cuda",
                 "names", "fn", "hold")

    def __init__(self, bwd, slots, grads, names, hold=None):
        torch = sys.modules["torch"]
        self.bwd = bwd
        self.ref = ctypes.byref(bwd)
        self.fwd = bwd.fwd.contents
        self.tensors = slots
        self.hold = hold
        self.likes = tuple(_like(torch, g.shape, g.dtype, g.device) for g in grads[:3])
        self.device = grads[0].device
        self.cuda = self.device.index if self.device.type == "cuda" else None
        self.ws_like = None
        if self.cuda is not None:  # the workspace: a new one each call, of the first's size
            self.ws_like = _like(torch, (max(bwd.workspace_size, 1),), torch.uint8,
                                 self.device)
        self.names = names
        self.fn = _lib.get_lib().fa_attention_backward

    def run(self, tensors, seed, offset):
        """The call on new (dout, q, k, v, out, lse) of this signature: (dq, dk, dv). Every
        allocation comes before the first write into the prepared arguments: Python run in
        between (a finalizer) could make a call of this signature on this thread, which would
        write them too."""
        torch = sys.modules["torch"]
        grads = tuple(torch.empty_like(x) for x in self.likes)
        workspace = stream = None
        if self.cuda is not None:
            workspace = torch.empty_like(self.ws_like)
            stream = _raw_stream(self.cuda)
        dout, q, k, v, out, lse = tensors
        ptrs = [x.data_ptr() for x in (q, k, v, out, lse, dout) + grads]
        for slot, ptr in zip(self.tensors, ptrs):
            slot.data = ptr
        fwd = self.fwd
        fwd.seed = seed & 0xFFFFFFFFFFFFFFFF
        fwd.offset = offset & 0xFFFFFFFFFFFFFFFF
        if workspace is not None:
            fwd.stream = stream
            self.bwd.workspace = workspace.data_ptr()
        status = self.fn(self.ref)
        if status != _lib.STATUS_OK:
            _call_failed(self, status)
        return grads


def backward_dense_torch(dout, q, k, v, out, lse, dropout_p, softmax_scale, causal,
                         window_size, softcap, seed, offset, deterministic):
    """``backward`` for the commonest torch call, (dq, dk, dv): dense, no ALiBi or sinks, new
    gradients; the floats already floats and ``window_size`` a pair of ints. Cached per
    signature as ``forward_dense_torch`` is: a large backward's host time was mostly this
    preparation, during which the GPU waits."""
    tensors = (dout, q, k, v, out, lse)
    try:
        key = ("bwd", _signature(*tensors), dropout_p, softmax_scale, causal, window_size,
               softcap, bool(deterministic))
    except RuntimeError:  # no strides (sparse and other layouts): backward says why
        key = None
    cache = _call_cache()
    call = _lookup(cache, key)
    if call is not None:
        return call.run(tensors, seed, offset)
    bwd, keep, arrays, grads, names, workspace = run_backward(
        dout, q, k, v, out, lse, TORCH, None, None, None, 0, 0, dropout_p, softmax_scale, causal,
        window_size, softcap, None, None, seed, offset, deterministic, None, 0, None, None, None)
    if key is not None and all(a is b for a, b in zip(arrays[:5], tensors)):
        # Inputs used as they are (no contiguous copy), so the signature says it all.
        _keep_call(cache, key, _CachedBackward(bwd, keep[:5] + keep[-5:-1], grads, names))
    return grads[:3]


class _CachedKvcache:
    """The prepared fa_kvcache_args of one call signature (``kvcache_torch``): the FaTensor of
    each of the struct's tensors in ``_kvcache.ARG_NAMES``' order (None where absent), whose
    data pointers each call swaps, and the outputs' ``_like``s (new ones contiguous, as the
    first call's were)."""

    __slots__ = ("args", "ref", "fn", "slots", "keep", "likes", "names", "cuda", "ws_like",
                 "paged", "lse_ref", "fast")

    def __init__(self, args, keep, slots, out, lse, fn, names):
        torch = sys.modules["torch"]
        self.args = args
        self.ref = ctypes.byref(args)
        self.fn = fn
        self.slots = slots
        self.keep = _structs(keep)
        self.likes = (_like(torch, out.shape, out.dtype, out.device),
                      _like(torch, lse.shape, lse.dtype, lse.device))
        self.names = names
        # CUDA: the stream, the split workspace (its size fixed by the signature) and, for a
        # paged cache, whether a graph is being captured, per call (_kvcache._device_workspace).
        self.cuda = out.device.index if out.device.type == "cuda" else None
        self.ws_like = (_like(torch, (args.workspace_size,), torch.uint8, out.device)
                        if self.cuda is not None and args.workspace_size else None)
        self.paged = slots[_kvcache.ARG_NAMES.index("block_table")] is not None
        # The lse's FaTensor pointer, left out of calls without it: a pointer of its own (args.lse
        # read back would share the field's memory and turn NULL with it).
        self.lse_ref = ctypes.pointer(slots[-1])
        self.fast = self._fast_fields() if _fastpath is not None else None

    def _fast_fields(self):
        """What _fastpath.kvcache reads and writes, int64 each in KV_FIELDS' order (see there)."""
        data = FaTensor.data.offset
        args = ctypes.addressof(self.args)
        layout = type(self.args)
        cuda = self.cuda is not None
        fields = {name: 0 if slot is None else ctypes.addressof(slot) + data
                  for name, slot in zip(_kvcache.ARG_NAMES, self.slots)}
        fields.update(
            fn=ctypes.cast(self.fn, ctypes.c_void_p).value, args=args,
            lse_field=args + layout.lse.offset,
            lse_ref=ctypes.cast(self.lse_ref, ctypes.c_void_p).value,
            stream=args + layout.stream.offset if cuda else 0,
            workspace=args + layout.workspace.offset if self.ws_like is not None else 0,
            skip_check=args + layout.skip_capacity_check.offset if cuda and self.paged else 0,
            device=self.cuda if cuda else -1, paged=int(self.paged))
        return struct.pack("=%dq" % len(KV_FIELDS), *(fields[f] for f in KV_FIELDS))

    def run(self, tensors, want_lse=True):
        """The call on new tensors of this signature (its inputs, q .. v_descale): (out, lse;
        None without ``want_lse``, the library then writes none). Every allocation comes before
        the first write into the prepared arguments, as in ``_CachedBackward.run``."""
        torch = sys.modules["torch"]
        out = torch.empty_like(self.likes[0])
        lse = torch.empty_like(self.likes[1]) if want_lse else None
        ws = torch.empty_like(self.ws_like) if self.ws_like is not None else None
        ptrs = [(slot, x.data_ptr()) for slot, x in zip(self.slots, tensors + (out, lse))
                if slot is not None and x is not None]
        for slot, ptr in ptrs:
            slot.data = ptr
        self.args.lse = self.lse_ref if want_lse else None
        if self.cuda is not None:
            args = self.args
            args.stream = _raw_stream(self.cuda)
            if ws is not None:
                args.workspace = ws.data_ptr()
            if self.paged:
                args.skip_capacity_check = int(torch.cuda.is_current_stream_capturing())
        status = self.fn(self.ref)
        if status != _lib.STATUS_OK:
            _call_failed(self, status)
        return out, lse


# The layout of _CachedKvcache.fast, handed to _fastpath: the library's fa_attention_kvcache
# and its arguments; the data field of each tensor's FaTensor (_kvcache.ARG_NAMES, 0 where
# absent); the arguments' lse field and the lse FaTensor it points to in a call with the lse;
# the CUDA fields written per call (0 where the call has none); the device (-1: the CPU) and
# whether the cache is paged.
KV_FIELDS = (("fn", "args") + _kvcache.ARG_NAMES +
             ("lse_field", "lse_ref", "stream", "workspace", "skip_check", "device", "paged"))


def _kvcache_key(tensors, scalars):
    """A KV-cache call's signature, or None for tensors without strides (sparse and other
    layouts: the preparation says why)."""
    try:
        return ("kv", _signature(*tensors)) + scalars
    except RuntimeError:
        return None


def kvcache_repeat(tensors, *scalars, want_lse=True):
    """``kvcache_torch``'s call if its signature is already prepared on this thread, else
    None; the same arguments."""
    calls = getattr(_LOCAL, "calls", None)
    if not calls:
        return None
    call = calls.get(_kvcache_key(tensors, scalars))
    return call.run(tensors, want_lse) if call is not None else None


def kvcache_torch(tensors, softmax_scale, causal, window_left, window_right, softcap,
                  rotary_interleaved, num_splits, want_lse=True):
    """``_kvcache.kvcache_run`` for torch tensors (CPU or CUDA), cached per signature as
    ``forward_dense_torch`` is: tensors are its 15 inputs, q .. v_descale, cache_seqlens
    already a tensor (or None); the floats already floats, the window's ints ints. A call
    whose inputs reach the library as they are (no copy or conversion) is cached. The library
    validates every call itself, the values in cache_seqlens included. Without ``want_lse`` a
    cached call computes no lse (and returns None for it); the first one always does."""
    scalars = (softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
               num_splits)
    key = _kvcache_key(tensors, scalars)
    cache = _call_cache()
    call = _lookup(cache, key)
    if call is not None:
        return call.run(tensors, want_lse)
    args, keep, arrays, slots, out, lse = _kvcache.run_kvcache(
        TORCH, *tensors[:-2], softmax_scale, causal, (window_left, window_right), softcap,
        rotary_interleaved, num_splits, k_descale=tensors[-2], v_descale=tensors[-1])
    if key is not None and all(a is x for a, x in zip(arrays, tensors)):
        fn = _kvcache.kv_lib().fa_attention_kvcache
        _keep_call(cache, key, _CachedKvcache(args, keep, slots, out, lse, fn, _kvcache.NAMES))
    return out, lse
