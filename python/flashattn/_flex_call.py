"""flex_attention's call of the library: one call's arguments apart from its tensors (the
mods' programs, their converted captures, the block mask as the library's struct), its forward,
its backward, and the autograd Function of calls with gradients (``flex`` traces the mods and
picks the call; this module prepares and runs it).
"""

import ctypes
import sys
import threading
import weakref

from . import _flex_prepared, _lib
from ._arrays import NUMPY, TORCH, make_tensor, prepare
from ._cached import _CachedBackward
from ._core import _prepare_forward, _rename, as_int
from ._flex_cache import trace
from ._flex_trace import AUX_SLOTS, KIND_MASK, KIND_SCORE
from ._lib import FlashAttnError

_NAMES = {"q": "query", "k": "key", "v": "value", "softmax_scale": "scale"}
_BM_FIELDS = _flex_prepared.BM_FIELDS


def _numpy():
    try:
        import numpy
    except ImportError:  # pragma: no cover - depends on the environment
        raise FlashAttnError("create_block_mask needs NumPy") from None
    return numpy


def _swap(x, kind):
    """[b, h, s, d] <-> [b, s, h, d], a view."""
    return x.transpose(1, 2) if kind == TORCH else x.swapaxes(1, 2)


def _empty(kind, shape, like, lse=False):
    module = sys.modules[kind]
    dtype = like.dtype
    if lse:
        dtype = module.float64 if dtype == module.float64 else module.float32
    if kind == TORCH:
        return module.empty(shape, dtype=dtype, device=like.device)
    return module.empty(shape, dtype=dtype)


# ---- the block mask as the library's struct ------------------------------------------------


def _c_block_mask(block_mask, keep, device):
    """_c_block_mask_make's struct, made once per block mask, device and version of its torch
    tensors (a block mask is built once and used for many calls): the cache entry holds what
    the struct points to, a weak reference tells a reused id from the same block mask."""
    tensors = [getattr(block_mask, n) for n in _BM_FIELDS]
    if not all(x is None or hasattr(x, "_version") for x in tensors):
        return _c_block_mask_make(block_mask, keep, device)  # NumPy: no version to key on
    key = (id(block_mask), str(device)) + tuple(
        None if x is None else (id(x), x._version) for x in tensors)
    hit = _bm_converted.get(key)
    if hit is not None and hit[0]() is block_mask:
        keep.append(hit[2])
        return hit[1]
    held = []
    bm = _c_block_mask_make(block_mask, held, device)
    if len(_bm_converted) >= _BM_CONVERTED_MAX:
        _bm_converted.pop(next(iter(_bm_converted)))
    try:
        _bm_converted[key] = (weakref.ref(block_mask), bm, held)
    except TypeError:  # a block mask class without weak references: not cached
        pass
    keep.append(held)
    return bm


# Block masks as the library's struct, by (id, device, their tensors' ids and versions).
_bm_converted = {}
_BM_CONVERTED_MAX = 16


def _c_block_mask_make(block_mask, keep, device):
    """The library's fa_block_mask of block_mask: its index tensors as int32 NumPy arrays (torch
    ones on the CPU are read in place), or for a call on a CUDA device (``device``) int32 torch
    tensors there (copied there when they are elsewhere), kept alive in keep."""
    np = _numpy()
    fields = {}
    for name in _BM_FIELDS:
        x = getattr(block_mask, name)
        if x is None:
            continue
        if device is not None and device.type == "cuda":
            torch = sys.modules["torch"]
            x = torch.as_tensor(x).detach().to(device=device, dtype=torch.int32).contiguous()
            t = make_tensor(x, "block_mask." + name, TORCH)
            keep.append((x, t))
            fields[name] = ctypes.pointer(t)
            continue
        if hasattr(x, "detach"):
            x = x.detach().cpu().numpy()
        x = np.ascontiguousarray(x, dtype=np.int32)
        t = make_tensor(x, "block_mask." + name, NUMPY)
        keep.append((x, t))
        fields[name] = ctypes.pointer(t)
    if "full_kv_num_blocks" in fields and "full_kv_indices" not in fields:
        raise ValueError("block_mask: full_kv_num_blocks without full_kv_indices")
    qbs, kbs = (as_int(n, "block_mask.BLOCK_SIZE") for n in block_mask.BLOCK_SIZE)
    bm = _lib.FaBlockMask(qbs, kbs, **fields)
    keep.append(bm)
    return bm


# ---- the shapes a call takes (flex_attention's route and its compiled form) ----------------


def check_shapes(query, key, value, enable_gqa):
    """query, key and value are [b, h, s, d]; key's heads are query's, or divide them with
    enable_gqa."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise FlashAttnError("%s: expected 4 dimensions [b, h, s, d], got shape %s"
                                 % (name, tuple(x.shape)))
    hq, hkv = int(query.shape[1]), int(key.shape[1])
    if not enable_gqa and hq != hkv:
        raise ValueError("Expect query and key/value to have the same number of heads but got "
                         "Hq=%d and Hkv=%d. Try setting enable_gqa=True for GQA." % (hq, hkv))
    if enable_gqa and (hkv == 0 or hq % hkv):
        raise ValueError("Expect number of query heads to be a multiple of kv heads for GQA "
                         "but got Hq=%d and Hkv=%d." % (hq, hkv))


def check_block_mask(block_mask, B, H, Lq, Lkv):
    """A block mask fits a [B, H, Lq, Lkv] call: made for its lengths, batch and heads 1 or the
    query's (the library checks its tensors' dims and entries)."""
    seq = tuple(int(n) for n in block_mask.seq_lengths)
    if seq != (Lq, Lkv):
        raise ValueError("block_mask: it was made for query / key lengths %s, but the call has "
                         "(%d, %d)" % (seq, Lq, Lkv))
    bm_b, bm_h = (int(n) for n in block_mask.kv_num_blocks.shape[:2])
    if bm_b not in (1, B) or bm_h not in (1, H):
        raise ValueError("block_mask: its batch and heads (%d, %d) must be 1 or the query's "
                         "(%d, %d)" % (bm_b, bm_h, B, H))


# ---- the mods' programs and captured tensors -----------------------------------------------


def mods_of(score_mod, mask_mod, checks=None):
    """(programs, aux) of a call's mods (mask_mod: its block mask's, or None): per traced mod
    (argument field, Trace, its aux slots: -1 for a capture it does not read), and per aux slot
    of the call (field, captured tensor), each tensor read once. checks as
    ``_flex_cache.trace`` takes them."""
    mods = []  # (argument field, trace, aux tensors)
    if score_mod is not None:
        # C keys a score_mod that is a plain function by its code and captures (keyed)
        mods.append(("score_mod",) + trace(score_mod, KIND_SCORE, "score_mod", checks, True))
    if mask_mod is not None:
        mods.append(("mask_mod",) + trace(mask_mod, KIND_MASK, "block_mask.mask_mod", checks))
    aux, slot_of, programs = [], {}, []
    for field, t, tensors in mods:
        slots = []
        for i, x in enumerate(tensors):
            if i not in t.read:
                slots.append(-1)
                continue
            if id(x) not in slot_of:
                slot_of[id(x)] = len(aux)
                aux.append((field, x))
            slots.append(slot_of[id(x)])
        programs.append((field, t, slots))
    if len(aux) > AUX_SLOTS:
        raise FlashAttnError("flex_attention: score_mod and block_mask.mask_mod read %d "
                             "captured tensors together; at most %d"
                             % (len(aux), AUX_SLOTS))
    return programs, aux


def score_reads(programs):
    """The call's aux slots score_mod reads (mods_of's programs), those a gradient can reach."""
    return sorted({i for field, _, slots in programs if field == "score_mod" for i in slots
                   if i >= 0})


def _aux_tensor(t, user, i, device):
    """A captured tensor as the library reads it: on the call's device (copied there when it
    is elsewhere), int32 or fp32, at least 1-d."""
    torch = sys.modules["torch"]
    name = "%s's captured tensor %d (shape %s, %s)" % (user, i, tuple(t.shape), t.dtype)
    if t.device.type not in ("cpu", "cuda"):
        raise FlashAttnError("%s: is on %s; flex_attention reads CPU and CUDA tensors"
                             % (name, t.device))
    if t.dtype in (torch.int32, torch.float32) and t.device == torch.device(device):
        return t.detach() if t.dim() else t.detach().reshape(1)
    # A conversion or copy is made once per tensor and version: an int64 tensor's range check
    # synchronises with the device, which a call repeated with the same captures should not.
    key = (id(t), t._version, str(device))
    hit = _aux_converted.get(key)
    if hit is not None and hit[0]() is t:
        return hit[1]
    src = t
    t = t.detach().to(device)
    if t.dim() == 0:
        t = t.reshape(1)
    if t.is_floating_point():
        t = t.float()
    else:
        if t.dtype != torch.int32 and t.numel():
            lo, hi = int(t.min()), int(t.max())
            if lo < -2**31 or hi > 2**31 - 1:
                raise FlashAttnError("%s: values in [%d, %d] do not fit int32"
                                     % (name, lo, hi))
        t = t.to(torch.int32)
    if len(_aux_converted) >= _AUX_CONVERTED_MAX:
        _aux_converted.pop(next(iter(_aux_converted)))
    _aux_converted[key] = (weakref.ref(src), t)
    return t


# Captured tensors as converted for the library, by (id, version, device); the weak reference
# tells a reused id from the same tensor. Oldest dropped first.
_aux_converted = {}
_AUX_CONVERTED_MAX = 64


def new_call(kind, scale, programs, aux, block_mask, device):
    """A _FlexCall of the traced programs ((field, trace, slots)) and the aux slots' captured
    tensors ((field, tensor)), converted for the library."""
    aux = [_aux_tensor(x, field, i, device or "cpu") for i, (field, x) in enumerate(aux)]
    return _FlexCall(kind, scale, [(f, t.program(slots)) for f, t, slots in programs], aux,
                     block_mask, device)


# ---- one call ------------------------------------------------------------------------------

# The FaTensors a call's arguments hold of its own tensors (the rest is the signature's).
_FWD_TENSORS = ("q", "k", "v", "out", "lse")
_BWD_TENSORS = ("dout", "dq", "dk", "dv")


def _args_at(args, tensors):
    """Whether args' q, k, v, out and lse point at tensors' data (no input copied) and no
    workspace is attached: then the arguments serve a later call of the same signature with
    their data pointers swapped."""
    return not args.workspace_size and all(
        getattr(args, n).contents.data == x.data_ptr() for n, x in zip(_FWD_TENSORS, tensors))


class _FlexCall:
    """One flex_attention call's library arguments apart from its tensors: the mods' programs,
    their aux tensors and the block mask, for the forward and (masks only) the backward. A
    call with gradients is cached per signature and thread (``_flex_prepared.store_grad``);
    its forward keeps the first call's arguments (``fwd``) and its backward those of the
    first backward of each dout layout (``_flex_prepared``'s "bwd_calls", per thread: the
    engine may run it on another), each call swapping in its tensors' data."""

    def __init__(self, kind, scale, programs, aux, block_mask, device):
        self.kind, self.scale, self.programs, self.aux = kind, scale, programs, aux
        self.block_mask, self.device = block_mask, device
        self.fwd = None  # forward_grad's prepared arguments (_flex_prepared.Prepared)
        self.bwd_built = False  # the backward's kernels asked for (fa_attention_backward_prepare)
        self.keyed = ()  # cached with gradients: the objects whose ids its key holds

    def _args(self, query, key, value, out, lse):
        """(fa_fwd_args, the structs and converted tensors they point to, the prepared inputs
        and outputs they point to, names) over the [b, h, s, d] tensors."""
        kind = self.kind
        args, keep, arrays, _, _, _, names = _prepare_forward(
            _swap(query, kind), _swap(key, kind), _swap(value, kind), kind, None, None, None,
            0, 0, 0.0, self.scale, False, (-1, -1), 0.0, None, None, False, 0, 0,
            _swap(out, kind), lse, None,
            dict(_NAMES, **{"mod_aux[%d]" % i: "captured tensor %d" % i
                            for i in range(len(self.aux))}), 0)
        if lse is None:
            args.lse = None
        for field, program in self.programs:
            setattr(args, field, program.ptr)
        keep.append(self.programs)
        if self.block_mask is not None:
            args.block_mask = ctypes.pointer(_c_block_mask(self.block_mask, keep, self.device))
        for i, x in enumerate(self.aux):
            x = prepare(x, "captured tensor %d" % i, TORCH, cuda=True)
            ft = make_tensor(x, "captured tensor %d" % i, TORCH)
            keep.append((x, ft))
            args.mod_aux[i] = ctypes.pointer(ft)
        return args, keep, arrays, names

    def forward(self, query, key, value, want_lse, prepared_key=None, keyed=()):
        """(out, lse or None, the prepared call or None), lse as the library gives it (+inf for
        a row with no key); with prepared_key (torch, no gradients) the arguments are cached
        for the next such call, beside keyed, the objects whose ids the key holds."""
        out = _empty(self.kind, tuple(query.shape[:3]) + (int(value.shape[3]),), query)
        lse = _empty(self.kind, tuple(query.shape[:3]), query, lse=True) if want_lse else None
        args, keep, arrays, names = self._args(query, key, value, out, lse)
        self._run(args, names)
        p = None
        if prepared_key is not None:
            p = _flex_prepared.store(prepared_key, args, keep, (query, key, value, out, lse),
                                     self, keyed, names)
        del keep, arrays
        return out, lse, p

    def forward_grad(self, query, key, value):
        """The forward of a call with gradients: (out, lse). The first call whose inputs the
        library reads in place keeps its arguments; later ones (of this signature: the call
        is cached by it) swap in their tensors' data, as a prepared call without gradients."""
        p = self.fwd
        if p is not None:
            return _flex_prepared.run(p, query, key, value)
        out = _empty(self.kind, tuple(query.shape[:3]) + (int(value.shape[3]),), query)
        lse = _empty(self.kind, tuple(query.shape[:3]), query, lse=True)
        tensors = (query, key, value, out, lse)
        args, keep, arrays, names = self._args(*tensors)
        if not self.bwd_built and self.kind == TORCH and query.is_cuda:
            # A new mod's backward kernels compile on a thread beside its forward's (NVRTC runs
            # without the GIL); not a daemon, so the interpreter's exit waits for the compile.
            self.bwd_built = True
            threading.Thread(target=_lib.backward_prepare, args=(args, keep),
                             name="flashattn backward prepare").start()
        self._run(args, names)
        if self.kind == TORCH and _args_at(args, tensors):
            self.fwd = _flex_prepared.prepared(args, keep, tensors, None, (), names)
        return out, lse

    @staticmethod
    def _run(args, names):
        try:
            _lib.forward(args)
        except FlashAttnError as e:
            raise FlashAttnError(_rename(str(e), names), e.status) from None

    def backward(self, query, key, value, out, lse, dout, grad_slots=()):
        """(dq, dk, dv) in the inputs' [b, h, s, d] layout, from the arguments of this call's
        first backward with dout of this layout on this thread where it kept them; with
        grad_slots (aux slots score_mod reads), also the fp32 gradient of each slot's
        converted tensor, in a list after them (such a backward keeps no arguments)."""
        torch = sys.modules["torch"]
        tensors = (dout, query, key, value, out, lse)
        layout = None
        if dout.layout == torch.strided and not grad_slots:
            layout = (id(self), dout.shape, dout.stride(), dout.dtype, dout.device,
                      dout.is_neg(), dout.is_conj())
            hit = _flex_prepared.lookup_backward(layout)
            if hit is not None:
                return hit.run(tensors, 0, 0)
        dq, dk, dv = (torch.empty_like(x, memory_format=torch.contiguous_format)
                      for x in (query, key, value))
        args, keep, arrays, names = self._args(query, key, value, out, lse)
        bwd = _lib.new_bwd_args()
        named = zip(_BWD_TENSORS, (dout, dq, dk, dv))
        prepared = [prepare(x, n, TORCH, cuda=True) for n, x in named]  # dout maybe a copy
        grads = [make_tensor(_swap(x, TORCH), n, TORCH)
                 for n, x in zip(_BWD_TENSORS, prepared)]
        bwd.fwd = ctypes.pointer(args)
        bwd.dout, bwd.dq, bwd.dk, bwd.dv = (ctypes.pointer(g) for g in grads)
        aux_grads = [torch.empty(self.aux[i].shape, dtype=torch.float32, device=query.device)
                     for i in grad_slots]
        for i, g in zip(grad_slots, aux_grads):
            ft = make_tensor(g, "captured tensor %d's gradient" % i, TORCH)
            keep.append((g, ft))
            bwd.mod_aux_grad[i] = ctypes.pointer(ft)
        workspace = None
        if query.device.type == "cuda":
            # The CUDA backward's workspace bytes (0: the call is refused, which the backward
            # then says why): the dQ accumulator and the rest, from torch's allocator.
            size = _lib.backward_workspace_size(bwd)
            workspace = torch.empty(max(size, 1), dtype=torch.uint8, device=query.device)
            bwd.workspace = workspace.data_ptr()
            bwd.workspace_size = size
        try:
            _lib.backward(bwd)
        except FlashAttnError as e:
            raise FlashAttnError(_rename(str(e), names), e.status) from None
        if (layout is not None and prepared[0] is dout
                and _args_at(args, (query, key, value, out, lse))):
            slots = [getattr(args, n).contents for n in _FWD_TENSORS] + grads
            _flex_prepared.store_backward(layout, _CachedBackward(
                bwd, slots, (dq, dk, dv), names, hold=(self, keep)))
        del keep, arrays
        return (dq, dk, dv, aux_grads) if grad_slots else (dq, dk, dv)


_FLEX_FN = []


def _flex_fn():
    """The autograd Function of masked calls (defined once torch is imported)."""
    if not _FLEX_FN:
        torch = sys.modules["torch"]

        class FlexFn(torch.autograd.Function):
            """(query, key, value, call, grad_slots, *captured): captured are the tensors of
            the aux slots grad_slots (those score_mod reads that require grad), inputs so
            that autograd hands them their gradients."""

            @staticmethod
            def forward(ctx, query, key, value, call, grad_slots=(), *captured):
                out, lse = call.forward_grad(query, key, value)
                ctx.save_for_backward(query, key, value, out, lse)
                ctx.call, ctx.grad_slots, ctx.captured = call, grad_slots, [
                    (x.shape, x.dtype) for x in captured]
                ctx.mark_non_differentiable(lse)
                ctx.set_materialize_grads(False)  # no zeros made for lse's gradient
                return out, lse

            @staticmethod
            def backward(ctx, dout, _dlse):
                if dout is None:
                    return (None,) * (5 + len(ctx.captured))
                query, key, value, out, lse = ctx.saved_tensors
                if not ctx.grad_slots:
                    return ctx.call.backward(query, key, value, out, lse, dout) + (None, None)
                dq, dk, dv, grads = ctx.call.backward(query, key, value, out, lse, dout,
                                                      ctx.grad_slots)
                grads = [g.reshape(shape).to(dtype)
                         for g, (shape, dtype) in zip(grads, ctx.captured)]
                return (dq, dk, dv, None, None) + tuple(grads)

        _FLEX_FN.append(FlexFn)
    return _FLEX_FN[0]
