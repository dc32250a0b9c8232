"""flex_attention under torch.compile: the library's flex call as two custom ops, so that a
compiled graph keeps it as opaque nodes (the forward and, through its autograd formula, the
backward), and the tracing of score_mod / mask_mod, which Dynamo cannot follow, done once when
Dynamo meets the mods.

    torch.ops.flashattn.flex_fwd (query, key, value, <block mask>, plan, scale, grad_slots,
                                  captured)                                        -> out, lse
    torch.ops.flashattn.flex_bwd (dout, query, key, value, out, lse, <block mask>, plan, scale,
                                  grad_slots, captured)          -> dq, dk, dv, captured's grads

<block mask>: the block mask's kv_num_blocks, kv_indices, full_kv_num_blocks and
full_kv_indices (None without a block mask), then its BLOCK_SIZE and seq_lengths. ``plan``
numbers the pair (score_mod, mask_mod) in ``_PLANS``: ``plan_of`` runs at compile time
(``torch._dynamo.assume_constant_result``), traces the pair (a mod that cannot be traced is
refused then, naming its line) and returns its number, a constant of the graph. At every call
the ops find the mods' captured tensors afresh through the registered functions, as an eager
call does, so a captured tensor's current values are read. A mod made inside the compiled
region is no constant of the graph: there the call breaks the graph (under fullgraph, Dynamo's
error) and runs in a frame of its own, compiled anew for each new function object until
Dynamo's recompile limit. ``captured``: the captured tensors that take a gradient (slots
``grad_slots``), inputs of the ops so that autograd hands them their gradients; Dynamo finds
them by following, from score_mod, the names it reads (``grad_captures_of``), so they enter the
graph as its inputs. ``lse`` is the library's (+inf
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
from ._flex_call import check_block_mask, check_shapes, mods_of, new_call, score_reads
from ._lib import FlashAttnError
from ._torch_call import DEVICE_TYPES, OptT, T

_PLANS = {}  # (score_mod, mask_mod) -> plan number
_PLAN_MODS = []  # plan number -> (score_mod, mask_mod)


@torch._dynamo.assume_constant_result
def plan_of(score_mod, mask_mod):
    """The plan number of a pair of mods (either may be None), traced on first sight."""
    key = (score_mod, mask_mod)
    mods_of(score_mod, mask_mod)  # refuses what cannot be traced, now
    n = _PLANS.get(key)
    if n is None:
        n = _PLANS[key] = len(_PLAN_MODS)
        _PLAN_MODS.append(key)
    return n


def _path_to(fn, x):
    """Where score_mod fn reaches tensor x: ("cell", i, attrs...) for a closure variable or
    ("global", name, attrs...) for a global, attrs at most one attribute read of it (a
    module's parameter); None elsewhere (a callable without code of its own included)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    names = code.co_names
    roots = [(("cell", i), c.cell_contents) for i, c in enumerate(fn.__closure__ or ())
             if _has_contents(c)]
    roots += [(("global", n), fn.__globals__[n]) for n in names if n in fn.__globals__]
    for path, obj in roots:
        if obj is x:
            return path
    for path, obj in roots:
        for attr in names:
            if not isinstance(obj, torch.Tensor) and getattr(obj, attr, None) is x:
                return path + (attr,)
    return None


def _has_contents(cell):
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


@torch._dynamo.assume_constant_result
def grad_captures_of(score_mod, mask_mod):
    """The captured tensors score_mod reads that take a gradient (grad mode on, the tensor
    requiring grad), as constants of the graph: ((slot, path), ...) with _path_to's paths,
    which flex_compiled follows so that the tensors enter the graph as inputs."""
    if score_mod is None or not torch.is_grad_enabled():
        return ()
    programs, aux = mods_of(score_mod, mask_mod)
    found = []
    for i in score_reads(programs):
        x = aux[i][1]
        if not x.requires_grad:
            continue
        path = _path_to(score_mod, x)
        if path is None:
            raise FlashAttnError(
                "score_mod's captured tensor %d (shape %s) requires grad, but under "
                "torch.compile flex_attention finds only the tensors score_mod names itself "
                "(a global or closure variable, or one attribute of one); detach it, or name "
                "it so" % (i, tuple(x.shape)))
        found.append((i, path))
    return tuple(found)


def _follow(fn, path):
    """The object at a path of _path_to from fn (traced by Dynamo: the tensor a graph input)."""
    obj = fn.__closure__[path[1]].cell_contents if path[0] == "cell" else fn.__globals__[path[1]]
    for attr in path[2:]:
        obj = getattr(obj, attr)
    return obj


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
                   seq_lengths: List[int], plan: int, scale: Optional[float],
                   grad_slots: List[int], captured: List[T]) -> Tuple[T, T]:
    # captured (the tensors of grad_slots) are inputs for autograd's sake: the call reads
    # every captured tensor afresh, these among them
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
                   full_kv_indices, block_size, seq_lengths, plan, scale, grad_slots, captured):
    b, h, sq = query.shape[:3]
    return (query.new_empty((b, h, sq, value.shape[3])),
            query.new_empty((b, h, sq), dtype=_lse_dtype(query)))


def _flex_bwd_impl(dout: T, query: T, key: T, value: T, out: T, lse: T, kv_num_blocks: OptT,
                   kv_indices: OptT, full_kv_num_blocks: OptT, full_kv_indices: OptT,
                   block_size: List[int], seq_lengths: List[int], plan: int,
                   scale: Optional[float], grad_slots: List[int],
                   captured: List[T]) -> Tuple[T, T, T, List[T]]:
    bm = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    call = _call(plan, query.device, scale, bm, block_size, seq_lengths)
    if not grad_slots:
        return call.backward(query, key, value, out, lse, dout) + ([],)
    dq, dk, dv, grads = call.backward(query, key, value, out, lse, dout, tuple(grad_slots))
    return dq, dk, dv, [g.reshape(x.shape).to(x.dtype) for g, x in zip(grads, captured)]


flex_bwd = torch.library.custom_op("flashattn::flex_bwd", _flex_bwd_impl, mutates_args=(),
                                   device_types=DEVICE_TYPES)


@flex_bwd.register_fake
def _flex_bwd_fake(dout, query, key, value, out, lse, kv_num_blocks, kv_indices,
                   full_kv_num_blocks, full_kv_indices, block_size, seq_lengths, plan, scale,
                   grad_slots, captured):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format)
                 for x in (query, key, value)) + ([torch.empty_like(x) for x in captured],)


def _flex_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    captured = inputs[12]
    ctx.save_for_backward(*inputs[:3], *output, *inputs[3:7], *captured)
    ctx.options = tuple(inputs[7:12])  # block_size .. grad_slots


def _flex_backward(ctx, dout, _dlse):
    grad_slots = ctx.options[4]
    # The inputs' structure: an empty list (grad_slots without slots) is a node of it, a list
    # of ints a leaf.
    slots_grad = None if grad_slots else []
    if dout is None:
        return (None,) * 11 + (slots_grad, [None] * len(grad_slots))
    query, key, value, out, lse, *rest = ctx.saved_tensors
    bm, captured = rest[:4], rest[4:]
    dq, dk, dv, grads = torch.ops.flashattn.flex_bwd(dout, query, key, value, out, lse, *bm,
                                                     *ctx.options, captured)
    return (dq, dk, dv) + (None,) * 8 + (slots_grad, list(grads))


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
    grads = grad_captures_of(score_mod, mask_mod)
    out, lse = torch.ops.flashattn.flex_fwd(query, key, value, *bm, block_size, seq_lengths,
                                            plan_of(score_mod, mask_mod),
                                            _core.as_scale(scale), [i for i, _ in grads],
                                            [_follow(score_mod, p) for _, p in grads])
    if not return_lse:
        return out
    return out, lse.masked_fill(lse == math.inf, -math.inf)
