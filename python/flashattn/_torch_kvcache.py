"""The KV-cache and combine ops, and the torch side of flash_attn_with_kvcache and
flash_attn_combine:

    torch.ops.flashattn.kvcache     (q, k_cache!, v_cache!, ...)    -> out, lse
    torch.ops.flashattn.combine     (out_partial, lse_partial, merged!) -> lse

kvcache appends k/v into the caches in place, hence mutates_args, then attends; combine merges
split results into the caller's (or a new) out and returns lse. Both have fake implementations
for tracing; neither has an autograd formula. Imported by _torch_ops, which the package imports
on its first torch call."""

from typing import Optional, Tuple

import torch

from . import _arrays, _cached, _core, _kvcache
from ._lib import FlashAttnError
from ._torch_call import DEVICE_TYPES, OptT, T, is_eager, needs_grad, run


@torch.library.custom_op("flashattn::kvcache", mutates_args=("k_cache", "v_cache"),
                         device_types=("cpu",))
def kvcache(q: T, k_cache: T, v_cache: T, k: OptT, v: OptT, rotary_cos: OptT,
            rotary_sin: OptT, cache_seqlens: OptT, cache_batch_idx: OptT,
            cache_leftpad: OptT, block_table: OptT, alibi_slopes: OptT,
            learnable_sink: OptT, softmax_scale: Optional[float], causal: bool,
            window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
            num_splits: int, k_descale: OptT = None,
            v_descale: OptT = None) -> Tuple[torch.Tensor, torch.Tensor]:
    return _kvcache_impl(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                         cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
                         learnable_sink, softmax_scale, causal, window_left, window_right,
                         softcap, rotary_interleaved, num_splits, k_descale, v_descale)


def _kvcache_impl(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                  cache_batch_idx, cache_leftpad, block_table, alibi_slopes, learnable_sink,
                  softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
                  num_splits, k_descale=None, v_descale=None):
    """flashattn::kvcache's kernel on either device: the C library's KV-cache call on q's
    device, its preparation cached per call signature."""
    return _cached.kvcache_torch(
        (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
         cache_leftpad, block_table, alibi_slopes, learnable_sink, k_descale, v_descale),
        softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
        num_splits)


@kvcache.register_kernel("cuda")
def _kvcache_cuda(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                  cache_batch_idx, cache_leftpad, block_table, alibi_slopes, learnable_sink,
                  softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
                  num_splits, k_descale=None, v_descale=None):
    """flashattn::kvcache's CUDA kernel: the same call (append, attention over the cache in
    place, split merge) on the current stream."""
    return _kvcache_impl(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                         cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
                         learnable_sink, softmax_scale, causal, window_left, window_right,
                         softcap, rotary_interleaved, num_splits, k_descale, v_descale)


@kvcache.register_fake
def _kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                  cache_batch_idx, cache_leftpad, block_table, alibi_slopes, learnable_sink,
                  softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
                  num_splits, k_descale=None, v_descale=None):
    b, sq, h = q.shape[0], q.shape[1], q.shape[2]
    out = q.new_empty((b, sq, h, v_cache.shape[-1]))
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    return out, lse


def kvcache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                 cache_batch_idx, cache_leftpad, block_table, alibi_slopes, learnable_sink,
                 softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits,
                 want_lse=True, k_descale=None, v_descale=None):
    """flash_attn_with_kvcache for torch tensors: the op (the C library's KV-cache call on
    the tensors' device), with an int cache_seqlens turned into the int32 (b,) tensor the op
    takes, as upstream does. Eager calls run the op's kernel directly (the dispatcher costs more
    than a decoding step's attention), and without the lse where ``want_lse`` is false (a
    repeated eager call then returns None for it)."""
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.shape[0],), _core.as_int(cache_seqlens, "cache_seqlens",
                                                                _core.INT32),
                                   dtype=torch.int32, device=q.device)
    left, right = _core.window_pair(window_size)
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, alibi_slopes, learnable_sink,
            _core.as_scale(softmax_scale), _core.as_bool(causal, "causal"), left, right,
            _core.as_float(softcap, "softcap"),
            _core.as_bool(rotary_interleaved, "rotary_interleaved"),
            _core.as_int(num_splits, "num_splits", _core.INT32), k_descale, v_descale)
    # The op's inputs in the prepared call's order (_cached.kvcache_torch), then its scalars.
    tensors, scalars = args[:13] + args[20:], args[13:20]
    eager = is_eager(tensors) and not needs_grad(tensors)
    if eager:
        # A signature already prepared had every tensor on q's device: its checks passed.
        res = _cached.kvcache_repeat(tensors, *scalars, want_lse=want_lse)
        if res is not None:
            return res
    # Devices named by argument, rather than left to the dispatcher's missing-kernel message.
    for name, x in zip(_kvcache.ARG_NAMES, tensors):
        if isinstance(x, torch.Tensor):
            _arrays.check_device(x, name, cuda=True)
            if x.device != q.device:
                raise FlashAttnError("%s: expected a tensor on %s like q, got %s"
                                     % (name, q.device, x.device))
    if k is not None or v is not None:
        _arrays.refuse_overlap(k_cache, "k_cache", _arrays.APPENDED, _arrays.TORCH)
        _arrays.refuse_overlap(v_cache, "v_cache", _arrays.APPENDED, _arrays.TORCH)
    if eager:
        return _kvcache_impl(*args)
    return kvcache(*args)


# --------------------------------------------------------------------------------------------
# Combine: merges split results into the caller's (or a new) out, returns lse


def _combine_impl(out_partial: T, lse_partial: T, merged: T) -> T:
    return _kvcache.combine_run(_arrays.TORCH, out_partial, lse_partial, merged)


combine = torch.library.custom_op("flashattn::combine", _combine_impl, mutates_args=("merged",),
                                  device_types=DEVICE_TYPES)


@combine.register_fake
def _combine_fake(out_partial, lse_partial, merged):
    b, sq, h = out_partial.shape[1], out_partial.shape[2], out_partial.shape[3]
    return torch.empty_strided((b, sq, h), (h * sq, 1, sq), dtype=lse_partial.dtype,
                               device=out_partial.device)


def combine_call(out_partial, lse_partial, merged):
    """flash_attn_combine for torch tensors: lse, with ``merged`` written."""
    tensors = (out_partial, lse_partial, merged)
    return run(torch.ops.flashattn.combine, _combine_impl, None, tensors, tensors,
                is_eager(tensors))
