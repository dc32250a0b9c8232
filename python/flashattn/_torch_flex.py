"""flex_attention under torch.compile: the library's flex call as two custom ops, so that a
compiled graph keeps it as opaque nodes (the forward and, through its autograd formula, the
backward), and the tracing of score_mod / mask_mod, which Dynamo cannot follow, done once when
Dynamo meets the mods.

    torch.ops.flashattn.flex_fwd (query, key, value, <block mask>, plan, scale)   -> out, lse
    torch.ops.flashattn.flex_bwd (dout, query, key, value, out, lse, <block mask>, plan, scale)
                                                                                   -> dq, dk, dv

<block mask>: the block mask's kv_num_blocks, kv_indices, full_kv_num_blocks and
full_kv_indices (None without a block mask), then its BLOCK_SIZE and seq_lengths. ``plan``
numbers the pair (score_mod, mask_mod) in ``_PLANS``: ``plan_of`` runs at compile time
(``torch._dynamo.assume_constant_result``), traces the pair (a mod that cannot be traced is
refused then, naming its line) and returns its number, a constant of the graph. At every call
the ops find the mods' captured tensors afresh through the registered functions, as an eager
call does, so a captured tensor's current values are read. A mod made inside the compiled
region is no constant of the graph: there the call breaks the graph (under fullgraph, Dynamo's
error) and runs in a frame of its own, compiled anew for each new function object until
Dynamo's recompile limit. ``lse`` is the library's (+inf
for a row that sees no key), which the backward takes; ``flex_compiled`` hands the caller
FlexAttention's -inf.

Imported by _torch_ops (the ops register on import); flex.bound receives ``flex_compiled``.
"""

import collections
import math
from typing import List, Optional, Tuple

import torch
from torch._dynamo.comptime import comptime

from . import _core
from ._arrays import TORCH
from ._flex_call import check_block_mask, check_shapes, mods_of, new_call
from ._lib import FlashAttnError
from ._torch_call import DEVICE_TYPES, OptT, T

_PLANS = {}  # (score_mod, mask_mod) -> plan number
_PLAN_MODS = []  # plan number -> (score_mod, mask_mod)


@torch._dynamo.assume_constant_result
def plan_of(score_mod, mask_mod):
    """The plan number of a pair of mods (either may be None), traced on first sight."""
    key = (score_mod, mask_mod)
    _, aux = mods_of(score_mod, mask_mod)  # refuses what cannot be traced, now
    if torch.is_grad_enabled():
        for i, (field, x) in enumerate(aux):
            if field == "score_mod" and x.requires_grad:
                raise FlashAttnError(
                    "score_mod's captured tensor %d (shape %s) requires grad, but under "
                    "torch.compile flex_attention gives captured tensors no gradient yet "
                    "(eager calls on the CPU do); detach it" % (i, tuple(x.shape)))
    n = _PLANS.get(key)
    if n is None:
        n = _PLANS[key] = len(_PLAN_MODS)
        _PLAN_MODS.append(key)
    return n


class _OpBlockMask:
    """The block mask of an op's arguments, as the library's call reads one."""

    def __init__(self, mask_mod, tensors, block_size, seq_lengths):
        self.mask_mod = mask_mod
        (self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks,
         self.full_kv_indices) = tensors
        self.BLOCK_SIZE, self.seq_lengths = tuple(block_size), tuple(seq_lengths)


# Calls by plan, device, scale, block-mask tensors and captured tensors (identity and version):
# a forward's call serves its backward (whose arguments it keeps) and the next calls.
_CALLS = collections.OrderedDict()
_CALLS_MAX = 16


def _call(plan, device, scale, bm_tensors, block_size, seq_lengths):
    score_mod, mask_mod = _PLAN_MODS[plan]
    bm = None
    if bm_tensors[0] is not None:
        bm = _OpBlockMask(mask_mod, bm_tensors, block_size, seq_lengths)
    programs, aux = mods_of(score_mod, mask_mod if bm is not None else None)
    key = (plan, str(device), scale, tuple(block_size), tuple(seq_lengths)) + tuple(
        None if x is None else (id(x), x._version) for x in bm_tensors) + tuple(
        (id(x), x._version) for _, x in aux)
    held = list(bm_tensors) + [x for _, x in aux]
    hit = _CALLS.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[1], held)):
        _CALLS.move_to_end(key)
        return hit[0]
    call = new_call(TORCH, scale, programs, aux, bm, device)
    _CALLS[key] = (call, held)  # held: what the key's ids name
    while len(_CALLS) > _CALLS_MAX:
        _CALLS.popitem(last=False)
    return call


def _flex_fwd_impl(query: T, key: T, value: T, kv_num_blocks: OptT, kv_indices: OptT,
                   full_kv_num_blocks: OptT, full_kv_indices: OptT, block_size: List[int],
                   seq_lengths: List[int], plan: int,
                   scale: Optional[float]) -> Tuple[T, T]:
    bm = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    call = _call(plan, query.device, scale, bm, block_size, seq_lengths)
    out, lse, _ = call.forward(query, key, value, True)
    return out, lse


flex_fwd = torch.library.custom_op("flashattn::flex_fwd", _flex_fwd_impl, mutates_args=(),
                                   device_types=DEVICE_TYPES)


def _lse_dtype(query):
    return torch.float64 if query.dtype == torch.float64 else torch.float32


@flex_fwd.register_fake
def _flex_fwd_fake(query, key, value, kv_num_blocks, kv_indices, full_kv_num_blocks,
                   full_kv_indices, block_size, seq_lengths, plan, scale):
    b, h, sq = query.shape[:3]
    return (query.new_empty((b, h, sq, value.shape[3])),
            query.new_empty((b, h, sq), dtype=_lse_dtype(query)))


def _flex_bwd_impl(dout: T, query: T, key: T, value: T, out: T, lse: T, kv_num_blocks: OptT,
                   kv_indices: OptT, full_kv_num_blocks: OptT, full_kv_indices: OptT,
                   block_size: List[int], seq_lengths: List[int], plan: int,
                   scale: Optional[float]) -> Tuple[T, T, T]:
    bm = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    call = _call(plan, query.device, scale, bm, block_size, seq_lengths)
    return call.backward(query, key, value, out, lse, dout)


flex_bwd = torch.library.custom_op("flashattn::flex_bwd", _flex_bwd_impl, mutates_args=(),
                                   device_types=DEVICE_TYPES)


@flex_bwd.register_fake
def _flex_bwd_fake(dout, query, key, value, out, lse, kv_num_blocks, kv_indices,
                   full_kv_num_blocks, full_kv_indices, block_size, seq_lengths, plan, scale):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format)
                 for x in (query, key, value))


def _flex_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*inputs[:3], *output, *inputs[3:7])
    ctx.options = tuple(inputs[7:])


def _flex_backward(ctx, dout, _dlse):
    if dout is None:
        return (None,) * 11
    query, key, value, out, lse, *bm = ctx.saved_tensors
    dq, dk, dv = torch.ops.flashattn.flex_bwd(dout, query, key, value, out, lse, *bm,
                                              *ctx.options)
    return (dq, dk, dv) + (None,) * 8


flex_fwd.register_autograd(_flex_backward, setup_context=_flex_setup)


def _constant_mods(ctx):
    """At compile time, in flex_compiled: a graph break unless score_mod and mask_mod are
    constants of the graph (functions made inside the compiled region are not); the call then
    runs in a frame of its own, where they are."""
    for name in ("score_mod", "mask_mod"):
        try:
            ctx.get_local(name).as_python_constant()
        except Exception:
            ctx.graph_break("flashattn.flex_attention: %s is a function made inside the "
                            "compiled region; for fullgraph, make it before (a module-level "
                            "function, or a closure made outside)" % name)
            return


def flex_compiled(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse):
    """flex_attention's call as Dynamo traces it (flex.flex_attention's arguments; calls with
    mods or a block mask): the checks eager calls make of shapes, then the ops."""
    check_shapes(query, key, value, enable_gqa)
    mask_mod, bm, block_size, seq_lengths = None, (None,) * 4, [0, 0], [0, 0]
    if block_mask is not None:
        check_block_mask(block_mask, query.shape[0], query.shape[1], query.shape[2],
                         key.shape[2])
        mask_mod = block_mask.mask_mod
        bm = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
              block_mask.full_kv_indices)
        block_size = [int(n) for n in block_mask.BLOCK_SIZE]
        seq_lengths = [int(n) for n in block_mask.seq_lengths]
    comptime(_constant_mods)
    out, lse = torch.ops.flashattn.flex_fwd(query, key, value, *bm, block_size, seq_lengths,
                                            plan_of(score_mod, mask_mod),
                                            _core.as_scale(scale))
    if not return_lse:
        return out
    return out, lse.masked_fill(lse == math.inf, -math.inf)
