"""flex_attention's forward without gradients on torch tensors, its prepared C arguments cached
per call signature (per thread, as ``_cached``'s): the query, key and value metadata, the scale,
whether lse is wanted, the mods' traces, the captured tensors (identity, version, data) and the
block mask (identity, its tensors' identities and versions). Everything
``_flex_call._FlexCall._args`` checks and builds depends only on those, so a later call with the
same signature allocates the outputs and swaps in the data pointers and the current stream
before calling the library, which validates every call itself.

Calls with gradients are cached apart (``store_grad``), by the same signature: their
``_flex_call._FlexCall`` (programs, converted captures, the first call's forward arguments as
a Prepared); their backwards' arguments per call and dout layout (``store_backward``), since
the autograd engine may run a backward on a thread of its own.

``register`` hands a prepared call to _fastpath (C, ``_fastpath_flex.c``) with the checks that
tell a later call with the same arguments it would find the same traces and captures; C serves
such calls without this module's walk of the mods.
"""

import ctypes
import os
import sys
import threading

from . import _lib
from ._arrays import TORCH, _raw_stream
from ._cached import _fastpath, _like
from ._core import _rename
from ._lib import FaTensor, FlashAttnError

_LOCAL = threading.local()  # the C call runs without the GIL: one cache (and args) a thread
_CACHE_SIZE = 32
BM_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
FLEX_C = None  # _fastpath.flex once bound to torch (flex.bound)
IS_COMPILING = None  # torch.compiler.is_compiling, with FLEX_C
FLEX_COMPILED = None  # _torch_flex.flex_compiled, with FLEX_C
# CUDA calls served in C too unless FLASHATTN_FLEX_FASTPATH_CUDA=0 (the route's, for comparison).
CUDA_IN_C = os.environ.get("FLASHATTN_FLEX_FASTPATH_CUDA") != "0"


class Prepared:
    """One signature's arguments: ``args`` (fa_fwd_args) with its q, k, v, out and lse FaTensors
    (whose data fields each call sets), the outputs' shapes, and what the pointers lead to:
    the call (programs, converted captures, block mask) and the block mask's held tensors."""

    __slots__ = ("args", "ref", "fn", "slots", "out_shape", "lse_shape", "dtype", "lse_dtype",
                 "device", "cuda", "names", "hold", "fast")


def _cache(name="calls"):
    """This thread's dict `name`: "calls" (prepared calls), "grad_calls" (calls with
    gradients) or "bwd_calls" (their backwards' arguments)."""
    cache = getattr(_LOCAL, name, None)
    if cache is None:
        cache = {}
        setattr(_LOCAL, name, cache)
    return cache


def _cache_with_room(name):
    """_cache(name), emptied first when full."""
    cache = _cache(name)
    if len(cache) >= _CACHE_SIZE:
        cache.clear()
    return cache


def key_of(query, key, value, scale, want_lse, programs, captured, block_mask):
    """The signature of a call, or None where it cannot be cached (a NumPy block mask: no
    versions; a captured tensor that records gradients, which the preparation refuses).
    programs: (field, trace, slots); captured: the torch tensors the mods read."""
    if any(x.requires_grad for x in captured) and sys.modules["torch"].is_grad_enabled():
        return None
    if block_mask is None:
        bm = None
    else:
        fields = [getattr(block_mask, n) for n in BM_FIELDS]
        if not all(x is None or hasattr(x, "_version") for x in fields):
            return None
        bm = (id(block_mask),) + tuple(None if x is None else (id(x), x._version)
                                       for x in fields)
    return ((tuple((x.shape, x.stride(), x.dtype, x.device, x.is_neg())
                   for x in (query, key, value)),
             scale, want_lse, bm) +
            tuple((f, id(t), tuple(s)) for f, t, s in programs) +
            tuple((id(x), x._version, x.data_ptr(), x.dtype, x.device, x.shape, x.stride())
                  for x in captured))


def lookup(key):
    return None if key is None else _cache().get(key)


def lookup_grad(key):
    return None if key is None else _cache("grad_calls").get(key)


def store_grad(key, call, keyed):
    """Caches a call with gradients (_flex_call._FlexCall, whose forward_grad keeps its arguments)
    under key (key_of's), apart from the prepared calls without gradients, holding keyed, the
    objects whose ids key holds. Its FlexFn saves the call's tensors; the cache holds none."""
    if key is None:
        return
    cache = _cache_with_room("grad_calls")
    call.keyed = tuple(keyed)
    cache[key] = call


def store(key, args, structs, tensors, call, keyed, names):
    """Caches the first call's arguments under key where ``prepared`` makes them a Prepared;
    keyed: the objects whose ids key holds (held, so that no other object takes their ids)."""
    if key is None:
        return None
    p = prepared(args, structs, tensors, call, keyed, names)
    if p is not None:
        _cache_with_room("calls")[key] = p
    return p


def prepared(args, structs, tensors, call, keyed, names):
    """A Prepared of a call's arguments where every pointer but the outputs' and the inputs'
    stays valid (no input was copied, no workspace is needed), else None. structs: what the
    arguments point to (FaTensors, the programs, the block mask's struct and tensors, the
    captures'), not the call's own tensors; tensors: query, key, value, out, lse or None;
    call and keyed held beside them."""
    if args.workspace_size:
        return None
    fts = [args.q, args.k, args.v, args.out]
    if any(not p for p in fts):
        return None
    fts = [p.contents for p in fts]
    if any(ft.data != x.data_ptr() for ft, x in zip(fts, tensors)):
        return None  # an input was copied (its layout): that copy is the call's own
    p = Prepared()
    p.args = args
    p.ref = ctypes.byref(args)
    p.fn = _lib.get_lib().fa_attention_forward
    p.slots = fts + ([args.lse.contents] if args.lse else [])
    out, lse = tensors[3], tensors[4]
    p.out_shape, p.dtype, p.device = tuple(out.shape), out.dtype, out.device
    p.lse_shape = tuple(out.shape[:3])
    p.lse_dtype = None if lse is None else lse.dtype
    p.cuda = out.device.index if out.device.type == "cuda" else None
    p.names = names
    p.hold = (call, tuple(keyed), structs)
    p.fast = None
    return p


def lookup_backward(layout):
    """The backward of a call with gradients kept for dout's layout on this thread
    (``store_backward``), or None."""
    return _cache("bwd_calls").get(layout)


def store_backward(layout, cached):
    """Keeps a call's backward arguments (_cached._CachedBackward) under layout: the call's id
    (the entry holds the call) and dout's layout."""
    _cache_with_room("bwd_calls")[layout] = cached


def may_serve_later(kind, call_args):
    """Whether _fastpath should serve later calls like this one (torch, the C path bound (when
    the package met torch), not traced by torch.compile, and ``wanted``): whether flex_any
    records the checks."""
    return (kind == TORCH and FLEX_C is not None and not IS_COMPILING()
            and (CUDA_IN_C or not call_args[0].is_cuda) and wanted(call_args))


def block_mask_checks(block_mask, checks):
    """What C checks of a block mask on a later call: the attributes this call reads
    (``_flex_call.check_block_mask``, ``key_of``, the mask_mod), by identity (as items of
    its __dict__ where they are plain instance attributes), and its tensors' versions."""
    seq = getattr(block_mask, "seq_lengths", None)
    if type(seq) is not tuple or any(type(n) is not int for n in seq):
        checks.append(("unsupported",))  # read by value each call
        return
    names = ("seq_lengths", "mask_mod") + BM_FIELDS
    attrs = getattr(block_mask, "__dict__", None)
    cls = type(block_mask)
    if (type(attrs) is not dict or cls.__getattribute__ is not object.__getattribute__
            or any(n not in attrs or any(n in vars(c) for c in cls.__mro__) for n in names)):
        attrs = None
    else:
        checks.extend((("type", block_mask, cls), ("attr", block_mask, "__dict__", attrs)))
    for name in names:
        x = getattr(block_mask, name)
        checks.append(("attr", block_mask, name, x) if attrs is None else
                      ("item", attrs, name, x))
        if name in BM_FIELDS and x is not None:
            version = getattr(x, "_version", None)
            checks.append(("unsupported",) if version is None else ("version", x, version))


def wanted(call_args):
    """Whether a call of ``call_args`` (flex_attention's, in ``flex.FLEX_ARGS``' order) that the
    route serves should be handed to _fastpath (``register``): _fastpath_flex.c says."""
    return _fastpath is not None and _fastpath.flex_wanted(tuple(call_args))


def register(call_args, p, checks, captured):
    """Hands prepared call p to _fastpath (C) for later calls of the same ``call_args``, with
    ``checks`` (the walks' and the block mask's, as ``_flex_cache.captured`` describes them)
    and those of the captured tensors (identity, version, data, shape, strides and dtype, as
    ``key_of`` keys them; requires_grad C reads itself). C keeps nothing where a check is
    not one it makes (("unsupported",)), and asks for the call again only much later.
    A call with gradients registers its _flex_call._FlexCall as p (``register_grad``)."""
    if _fastpath is None or checks is None:
        return
    if p.fast is None:
        p.fast = _fast_fields(p)
    _fastpath.flex_register(tuple(call_args), p, *p.fast, _aux_checks(checks, captured))


def register_grad(call_args, call, checks, captured):
    """``register`` of a call with gradients: C calls its autograd Function with ``call`` (a
    _flex_call._FlexCall)."""
    if _fastpath is None or checks is None:
        return
    _fastpath.flex_register(tuple(call_args), call, None, None, None,
                            _aux_checks(checks, captured))


def _aux_checks(checks, captured):
    return tuple(checks) + tuple(("aux", x, x._version, x.data_ptr(), x.shape, x.stride(),
                                  x.dtype) for x in captured)


def _fast_fields(p):
    """(fields, out_like, lse_like) of p for _fastpath: the addresses of the library's forward,
    of the arguments, of the data fields of q, k, v, out and lse (0 without one) and of the
    stream field (0 on the CPU), the CUDA device index (-1 on the CPU); and the outputs'
    ``_like``s."""
    torch = sys.modules["torch"]
    data = FaTensor.data.offset
    fields = dict(zip(("q", "k", "v", "out", "lse"),
                      (ctypes.addressof(t) + data for t in p.slots)))
    fields.setdefault("lse", 0)
    args = ctypes.addressof(p.args)
    fields.update(fn=ctypes.cast(p.fn, ctypes.c_void_p).value, args=args,
                  stream=0 if p.cuda is None else args + type(p.args).stream.offset,
                  device=-1 if p.cuda is None else p.cuda)
    lse_like = (None if p.lse_dtype is None else
                _like(torch, p.lse_shape, p.lse_dtype, p.device))
    return fields, _like(torch, p.out_shape, p.dtype, p.device), lse_like


def run(p, query, key, value):
    """The cached call on new tensors: (out, lse or None), lse as the library gives it."""
    torch = sys.modules["torch"]
    out = torch.empty(p.out_shape, dtype=p.dtype, device=p.device)
    lse = (torch.empty(p.lse_shape, dtype=p.lse_dtype, device=p.device)
           if p.lse_dtype is not None else None)
    arrays = (query, key, value, out, lse)
    for slot, x in zip(p.slots, arrays):
        slot.data = x.data_ptr()
    if p.cuda is not None:
        p.args.stream = _raw_stream(p.cuda)
    status = p.fn(p.ref)
    if status != _lib.STATUS_OK:
        try:
            _lib.check(status)
        except FlashAttnError as e:
            raise FlashAttnError(_rename(str(e), p.names), e.status) from None
    return out, lse
