"""FlexAttention's interface on the C library: ``flex_attention`` and ``create_block_mask``
with torch.nn.attention.flex_attention's signatures and layout (q, k, v [b, h, s, d]).

score_mod(score, b, h, q_idx, kv_idx) and mask_mod(b, h, q_idx, kv_idx), written for torch, are
traced once into the library's fa_mod programs (``_flex_trace``); the CPU forward evaluates them,
and the CUDA forward compiles them into its kernels. The block mask has FlexAttention's layout,
built from the traced mask by the library's fa_block_mask_build (on the host, or on the CUDA
device it is made for); the forward takes it as the library's fa_block_mask, skipping the
blocks it skips and evaluating mask_mod only in its partial blocks (full ones keep every key),
as FlexAttention's kernels do. Gradients to query, key and value (the library's backward, on
the CPU or on CUDA with the mods compiled into its kernels) and to the float tensors score_mod
captures that require grad.
"""

import math
import sys

from . import _flex_blocks, _flex_prepared
from ._arrays import TORCH, common_kind
from ._core import as_bool, as_int, as_scale
from ._flex_call import (_flex_fn, _numpy, _swap, check_block_mask, check_shapes, mods_of,
                         new_call, score_reads)
from ._flex_cache import trace
from ._flex_trace import KIND_MASK
from ._lib import FlashAttnError

__all__ = ["flex_attention", "create_block_mask", "BlockMask", "noop_mask"]

def noop_mask(b, h, q_idx, kv_idx):
    """The mask that keeps every key (FlexAttention's default)."""
    return b.new_ones((), dtype=bool)


# ---- block masks ---------------------------------------------------------------------------


class BlockMask:
    """FlexAttention's BlockMask: per (batch, head, query block), the key blocks that are
    partial (kv_num_blocks / kv_indices: the mask must be evaluated) and full
    (full_kv_num_blocks / full_kv_indices: every key visible), each list's blocks first in
    ascending order followed by the others; q_* the same per key block. int32 tensors (NumPy
    arrays when torch is not imported), [B, H, blocks] and [B, H, blocks, blocks]."""

    def __init__(self, seq_lengths, kv_num_blocks, kv_indices, full_kv_num_blocks,
                 full_kv_indices, q_num_blocks, q_indices, full_q_num_blocks, full_q_indices,
                 BLOCK_SIZE, mask_mod):
        self.seq_lengths = tuple(seq_lengths)
        self.kv_num_blocks, self.kv_indices = kv_num_blocks, kv_indices
        self.full_kv_num_blocks, self.full_kv_indices = full_kv_num_blocks, full_kv_indices
        self.q_num_blocks, self.q_indices = q_num_blocks, q_indices
        self.full_q_num_blocks, self.full_q_indices = full_q_num_blocks, full_q_indices
        self.BLOCK_SIZE = tuple(BLOCK_SIZE)
        self.mask_mod = mask_mod

    @property
    def shape(self):
        return tuple(self.kv_indices.shape[:-2]) + self.seq_lengths

    def sparsity(self):
        """Percentage of the blocks that are skipped (neither partial nor full)."""
        total = 1
        for n in self.kv_indices.shape[:-1]:
            total *= int(n)
        total *= -(-self.seq_lengths[1] // self.BLOCK_SIZE[1])
        used = int(self.kv_num_blocks.sum())
        if self.full_kv_num_blocks is not None:
            used += int(self.full_kv_num_blocks.sum())
        return 100.0 * (1 - used / total) if total else 0.0

    def __repr__(self):
        return "BlockMask(shape=%s, BLOCK_SIZE=%s, sparsity=%.2f%%, mask_mod=%s)" % (
            self.shape, self.BLOCK_SIZE, self.sparsity(),
            getattr(self.mask_mod, "__name__", self.mask_mod))


def _check_device(device):
    name = getattr(device, "type", device)
    if device is not None and str(name).split(":")[0] not in ("cpu", "cuda"):
        raise FlashAttnError("device: %r is not supported (cpu or cuda)" % (device,))


def _block_sizes(block_size):
    if isinstance(block_size, (tuple, list)):
        if len(block_size) != 2:
            raise FlashAttnError("BLOCK_SIZE: expected an int or a pair, got %r" % (block_size,))
        sizes = tuple(block_size)
    else:
        sizes = (block_size, block_size)
    sizes = tuple(as_int(s, "BLOCK_SIZE") for s in sizes)
    if min(sizes) < 1:
        raise FlashAttnError("BLOCK_SIZE: must be positive, got %r" % (block_size,))
    return sizes


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=128,
                      separate_full_blocks=True):
    """FlexAttention's create_block_mask: the BlockMask of mask_mod(b, h, q_idx, kv_idx) over
    [B, H, Q_LEN, KV_LEN] (B or H None means 1), in blocks of BLOCK_SIZE (an int or a pair
    (query, key)). mask_mod is traced (and refused if it cannot be) and evaluated by the
    library's fa_block_mask_build, the forward's rule (fp32 arithmetic, aux indices clamped
    into their tensors): on the host for a CPU block mask, on the device, on torch's current
    stream, for a CUDA one (_flex_blocks)."""
    _check_device(device)
    B = 1 if B is None else as_int(B, "B")
    H = 1 if H is None else as_int(H, "H")
    Q_LEN, KV_LEN = as_int(Q_LEN, "Q_LEN"), as_int(KV_LEN, "KV_LEN")
    for name, n in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if n < (1 if name in ("B", "H") else 0):
            raise FlashAttnError("%s: must be %s, got %d" % (name, "positive" if name in (
                "B", "H") else "non-negative", n))
    qbs, kbs = _block_sizes(BLOCK_SIZE)
    t, tensors = trace(mask_mod, KIND_MASK, "mask_mod")
    fields = _flex_blocks.build(t, tensors, B, H, Q_LEN, KV_LEN, qbs, kbs, separate_full_blocks,
                                device)
    bm = BlockMask((Q_LEN, KV_LEN), *fields, BLOCK_SIZE=(qbs, kbs), mask_mod=mask_mod)
    return bm


_BM_FIELDS = _flex_prepared.BM_FIELDS


# ---- the forward --------------------------------------------------------------------------


def _check_inputs(query, key, value, enable_gqa):
    kind = common_kind((("query", query), ("key", key), ("value", value)), 3)
    check_shapes(query, key, value, enable_gqa)
    return kind


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                   enable_gqa=False, return_lse=False, kernel_options=None):
    """torch.nn.attention.flex_attention on the library's forward and backward.

    query [b, hq, sq, d], key [b, hkv, sk, d], value [b, hkv, sk, dv]: torch CPU tensors or
    NumPy arrays, fp32, bf16, fp16 or fp64; or torch CUDA tensors, fp16 or bf16 (the CUDA
    forward; the backward as below). Returns out [b, hq, sq, dv] in the input's dtype
    and, with return_lse, lse [b, hq, sq] (natural log; fp32, fp64 for fp64 inputs; -inf for a
    row that sees no key, whose out is 0). score_mod(score, b, h, q_idx, kv_idx) maps the scaled
    score; block_mask (from create_block_mask) selects keys by its mask_mod. scale defaults to
    1 / sqrt(d); enable_gqa lets hq be a multiple of hkv. Gradients flow to query, key and value
    (torch inputs; the library's backward on the inputs' device) and, on the CPU, to the float
    tensors score_mod captures that require grad (refused on CUDA and under torch.compile);
    without mods it runs flash_attn_func, with autograd.
    """
    # _fastpath (C) serves a repeated torch call without gradients whose mods and captures it
    # finds unchanged, and hands every other call to flex_any; Dynamo cannot trace C, nor the
    # mods' tracing: under torch.compile the mods are traced once and the call is a custom op.
    entry = _flex_prepared.FLEX_C
    if _flex_prepared.IS_COMPILING is not None and _flex_prepared.IS_COMPILING():
        if kernel_options is not None:
            raise FlashAttnError("kernel_options: tunes torch's kernels; flashattn takes none")
        return_lse = as_bool(return_lse, "return_lse")
        if score_mod is None and block_mask is None:
            return _plain(query, key, value, as_scale(scale), return_lse)
        return _flex_prepared.FLEX_COMPILED(query, key, value, score_mod, block_mask, scale,
                                            as_bool(enable_gqa, "enable_gqa"), return_lse)
    if entry is None:
        entry = flex_any
    return entry(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                 kernel_options)


# flex_attention's arguments in order, as ``flex_any`` and _fastpath (which reads it) take them.
FLEX_ARGS = ("query", "key", "value", "score_mod", "block_mask", "scale", "enable_gqa",
             "return_lse", "kernel_options")


def flex_any(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
             kernel_options):
    """flex_attention's route (its arguments in ``FLEX_ARGS``' order), and _fastpath's
    fallback. A torch call without gradients whose arguments are prepared is handed to
    _fastpath with the checks its walks of the mods recorded, where _fastpath wants it."""
    call_args = (query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                 kernel_options)
    if kernel_options is not None:
        raise FlashAttnError("kernel_options: tunes torch's kernels; flashattn takes none")
    enable_gqa, return_lse = as_bool(enable_gqa, "enable_gqa"), as_bool(return_lse,
                                                                        "return_lse")
    kind = _check_inputs(query, key, value, enable_gqa)
    scale = as_scale(scale)
    B, H, Lq = (int(n) for n in query.shape[:3])
    Lkv = int(key.shape[2])
    grad = kind == TORCH and sys.modules["torch"].is_grad_enabled() and any(
        x.requires_grad for x in (query, key, value))
    if grad and score_mod is None and block_mask is None:
        return _plain(query, key, value, scale, return_lse)
    # what C checks on a later call, where it should serve one
    checks = [] if _flex_prepared.may_serve_later(kind, call_args) else None
    if block_mask is not None:
        check_block_mask(block_mask, B, H, Lq, Lkv)
        if checks is not None:
            _flex_prepared.block_mask_checks(block_mask, checks)
    programs, aux = mods_of(score_mod, block_mask.mask_mod if block_mask is not None else None,
                            checks)
    captured = [x for _, x in aux]
    keyed = [t for _, t, _ in programs] + captured + [block_mask]
    grad_slots = _grad_slots(kind, programs, captured)
    if grad_slots:
        grad = True
        checks = None  # the C path does not give captured tensors gradients
    if grad:
        # A call with gradients of a signature met before reuses that call's preparation
        # (its programs, converted captures and, in forward_grad, its arguments).
        grad_key = _flex_prepared.key_of(query, key, value, scale, True, programs, captured,
                                         block_mask)
        call = _flex_prepared.lookup_grad(grad_key)
        if call is None:
            call = new_call(kind, scale, programs, aux, block_mask, query.device)
            _flex_prepared.store_grad(grad_key, call, keyed)
        out, lse = _flex_fn().apply(query, key, value, call, grad_slots,
                                    *[captured[i] for i in grad_slots])
        _flex_prepared.register_grad(call_args, call, checks, captured)
        return out if not return_lse else (out, _empty_rows(lse, kind))
    prepared_key = None
    if kind == TORCH:
        prepared_key = _flex_prepared.key_of(query, key, value, scale, return_lse, programs,
                                             captured, block_mask)
        p = _flex_prepared.lookup(prepared_key)
        if p is not None:
            out, lse = _flex_prepared.run(p, query, key, value)
            _flex_prepared.register(call_args, p, checks, captured)
            return out if not return_lse else (out, _empty_rows(lse, kind))
    call = new_call(kind, scale, programs, aux, block_mask,
                    query.device if kind == TORCH else None)
    out, lse, p = call.forward(query, key, value, return_lse, prepared_key, keyed)
    if p is not None:
        _flex_prepared.register(call_args, p, checks, captured)
    if not return_lse:
        return out
    return out, _empty_rows(lse, kind)


def _grad_slots(kind, programs, captured):
    """The aux slots whose captured tensor requires grad (grad mode on) and that score_mod
    reads: the backward gives them their gradients (the CPU's and CUDA's)."""
    if kind != TORCH or not sys.modules["torch"].is_grad_enabled():
        return ()
    return tuple(i for i in score_reads(programs) if captured[i].requires_grad)


def _lse_rows(lse):
    """_empty_rows of a torch lse, for _fastpath."""
    return _empty_rows(lse, TORCH)


def bound(entry, is_compiling, compiled):
    """_route binds _fastpath when the package meets torch: flex_attention's C entry (None
    where the extension was not built), torch.compiler.is_compiling and the compiled route
    (_torch_flex.flex_compiled)."""
    _flex_prepared.FLEX_C, _flex_prepared.IS_COMPILING = entry, is_compiling
    _flex_prepared.FLEX_COMPILED = compiled


def fastpath_table():
    """What _fastpath's bind() takes for flex(): the fallback, the argument layout, the
    per-thread cache's holder, _lse_rows, the autograd Function's apply (calls with
    gradients) and whether CUDA tensors are served too."""
    return dict(flex_fallback=flex_any, flex_args=FLEX_ARGS, flex_local=_flex_prepared._LOCAL,
                flex_lse_rows=_lse_rows, flex_grad_apply=_flex_fn().apply,
                flex_cuda=_flex_prepared.CUDA_IN_C)


def _empty_rows(lse, kind):
    """A row that sees no key: the library's lse +inf is FlexAttention's -inf (a new array: the
    library's stays for the backward)."""
    if kind == TORCH:
        return lse.masked_fill(lse == math.inf, -math.inf)
    np = _numpy()
    return np.where(lse == math.inf, -math.inf, lse).astype(lse.dtype)


def _plain(query, key, value, scale, return_lse):
    """No mods, with autograd: flash_attn_func on [b, s, h, d] views."""
    from .flash_attn_interface import flash_attn_func

    out, lse, _ = flash_attn_func(_swap(query, TORCH), _swap(key, TORCH), _swap(value, TORCH),
                                  softmax_scale=scale, return_attn_probs=True)
    out = _swap(out, TORCH)
    if not return_lse:
        return out
    return out, lse.masked_fill(lse == math.inf, -math.inf)

