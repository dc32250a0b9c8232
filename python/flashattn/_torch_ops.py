"""PyTorch custom ops over the C library, and the torch side of the public functions.

    torch.ops.flashattn.fwd         (q, k, v, ...)                  -> out, lse, S_dmask, rng_state
    torch.ops.flashattn.varlen_fwd  (q, k, v, cu_seqlens_q, ...)    -> out, lse, S_dmask, rng_state
    torch.ops.flashattn.bwd         (dout, q, k, v, out, lse, ...)  -> dq, dk, dv, dsink
    torch.ops.flashattn.varlen_bwd  (dout, q, k, v, out, lse, ...)  -> dq, dk, dv, dsink
    torch.ops.flashattn.kvcache     (q, k_cache!, v_cache!, ...)    -> out, lse   (CPU)

Imported on the first torch call (``import flashattn`` does not import torch). Every torch call
of a public function goes through these ops, with or without gradients, so one path serves
eager mode, autograd and ``torch.compile``: each op has a fake implementation for tracing and the
forward ops carry an autograd formula (``register_autograd``) that calls the backward op, so a
compiled model keeps them as opaque nodes and traces without graph breaks. The ops are
functional (they allocate their outputs), which is what AOT autograd wants.

The kernels are Python functions over ``_core``, registered for the device types in
``DEVICE_TYPES``: "cuda" runs the same kernels, ``_core`` passing CUDA tensors' device pointers,
their device and the current stream to the C library (forward only: a CUDA tensor that requires
grad is refused by ``_core.check_device``).

Outputs, as upstream's ops (``flash_attn::_flash_attn_forward`` and friends): ``out`` (b, sq, h,
dv) / (total_q, h, dv); ``lse`` (b, h, sq) / (h, total_q), fp32, except fp64 for fp64 inputs so
that fp64 gradients stay exact (the public functions hand the caller an fp32 copy, as
upstream); ``S_dmask`` (b, h, round128(sq), round128(sk)) in q's dtype, or (0,) unless
``return_softmax``; ``rng_state`` int64 (2,) = [seed, offset]. The backward ops return new
gradients (upstream's write into caller buffers, which AOT autograd would have to
functionalise) and ``dsink``: fp32 (h,), or (0,) without a sink.

Dropout: the seed is an input, an int64 tensor that ``draw_seed`` takes from torch's default
generator with ``torch.randint`` outside the op. Eager calls consume the generator exactly as
one ``torch.randint`` does, so ``torch.manual_seed`` reproduces a run; under ``torch.compile``
the draw is an ordinary random op of the graph (Inductor's RNG, itself seeded from the default
generator, unless ``torch._inductor.config.fallback_random``).
"""

from typing import Optional, Tuple

import torch

from . import _core
from ._lib import FlashAttnError

DEVICE_TYPES = ("cpu", "cuda")

_T = torch.Tensor
_OptT = Optional[torch.Tensor]
_Result = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _round128(x):
    return (x + 127) // 128 * 128


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _seed_value(seed):
    return int(seed.item()) if seed is not None else 0


def _rng_state(seed, q):
    return torch.tensor([seed, 0], dtype=torch.int64, device=q.device)


def _dsink_or_empty(dsinks, q):
    if dsinks is None:
        return torch.empty((0,), dtype=torch.float32, device=q.device)
    return dsinks


# --------------------------------------------------------------------------------------------
# Forward ops


@torch.library.custom_op("flashattn::fwd", mutates_args=(), device_types=DEVICE_TYPES)
def fwd(q: _T, k: _T, v: _T, alibi_slopes: _OptT, learnable_sink: _OptT, seed: _OptT,
        dropout_p: float, softmax_scale: Optional[float], causal: bool, window_size_left: int,
        window_size_right: int, softcap: float, return_softmax: bool,
        deterministic: bool) -> _Result:
    """Dense attention. ``deterministic`` is the backward's option, carried here so that the
    autograd formula sees it; the forward ignores it."""
    s = _seed_value(seed)
    lse = None
    if q.dtype == torch.float64 and q.dim() == 4:
        lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float64,
                          device=q.device)
    out, lse, probs = _core.forward(
        q, k, v, kind=_core.TORCH, dropout_p=dropout_p, softmax_scale=softmax_scale,
        causal=causal, window_size=(window_size_left, window_size_right), softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=learnable_sink, return_softmax=return_softmax,
        seed=s, offset=0, lse=lse)
    S = probs if return_softmax else q.new_empty((0,))
    return out, lse, S, _rng_state(s, q)


@fwd.register_fake
def _fwd_fake(q, k, v, alibi_slopes, learnable_sink, seed, dropout_p, softmax_scale, causal,
              window_size_left, window_size_right, softcap, return_softmax, deterministic):
    b, sq, h = q.shape[0], q.shape[1], q.shape[2]
    out = q.new_empty((b, sq, h, v.shape[3]))
    lse = q.new_empty((b, h, sq), dtype=_lse_dtype(q))
    if return_softmax:
        S = q.new_empty((b, h, _round128(sq), _round128(k.shape[1])))
    else:
        S = q.new_empty((0,))
    return out, lse, S, q.new_empty((2,), dtype=torch.int64)


@torch.library.custom_op("flashattn::varlen_fwd", mutates_args=(), device_types=DEVICE_TYPES)
def varlen_fwd(q: _T, k: _T, v: _T, cu_seqlens_q: _T, cu_seqlens_k: _T, seqused_k: _OptT,
               alibi_slopes: _OptT, learnable_sink: _OptT, seed: _OptT, max_seqlen_q: int,
               max_seqlen_k: int, dropout_p: float, softmax_scale: Optional[float], causal: bool,
               window_size_left: int, window_size_right: int, softcap: float,
               return_softmax: bool, deterministic: bool) -> _Result:
    """Variable-length attention; ``deterministic`` as in ``fwd``."""
    s = _seed_value(seed)
    lse = None
    if q.dtype == torch.float64 and q.dim() == 3:
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float64, device=q.device)
    out, lse, probs = _core.forward(
        q, k, v, kind=_core.TORCH, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_size_left, window_size_right), softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=learnable_sink, return_softmax=return_softmax,
        seed=s, offset=0, lse=lse)
    S = probs if return_softmax else q.new_empty((0,))
    return out, lse, S, _rng_state(s, q)


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes,
                     learnable_sink, seed, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                     causal, window_size_left, window_size_right, softcap, return_softmax,
                     deterministic):
    total_q, h = q.shape[0], q.shape[1]
    out = q.new_empty((total_q, h, v.shape[2]))
    lse = q.new_empty((h, total_q), dtype=_lse_dtype(q))
    if return_softmax:
        b = cu_seqlens_q.shape[0] - 1
        S = q.new_empty((b, h, _round128(max_seqlen_q), _round128(max_seqlen_k)))
    else:
        S = q.new_empty((0,))
    return out, lse, S, q.new_empty((2,), dtype=torch.int64)


# --------------------------------------------------------------------------------------------
# Backward ops


@torch.library.custom_op("flashattn::bwd", mutates_args=(), device_types=DEVICE_TYPES)
def bwd(dout: _T, q: _T, k: _T, v: _T, out: _T, lse: _T, alibi_slopes: _OptT,
        learnable_sink: _OptT, rng_state: _T, dropout_p: float, softmax_scale: Optional[float],
        causal: bool, window_size_left: int, window_size_right: int, softcap: float,
        deterministic: bool) -> _Result:
    seed, offset = (int(x) for x in rng_state.tolist())
    dq, dk, dv, dsinks = _core.backward(
        dout, q, k, v, out, lse, kind=_core.TORCH, dropout_p=dropout_p,
        softmax_scale=softmax_scale, causal=causal,
        window_size=(window_size_left, window_size_right), softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=learnable_sink, seed=seed, offset=offset,
        deterministic=deterministic)
    return dq, dk, dv, _dsink_or_empty(dsinks, q)


def _grads_fake(q, k, v, learnable_sink):
    h = q.shape[-2]
    dsink = q.new_empty((h,) if learnable_sink is not None else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsink


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, alibi_slopes, learnable_sink, rng_state, dropout_p,
              softmax_scale, causal, window_size_left, window_size_right, softcap,
              deterministic):
    return _grads_fake(q, k, v, learnable_sink)


@torch.library.custom_op("flashattn::varlen_bwd", mutates_args=(), device_types=DEVICE_TYPES)
def varlen_bwd(dout: _T, q: _T, k: _T, v: _T, out: _T, lse: _T, cu_seqlens_q: _T,
               cu_seqlens_k: _T, seqused_k: _OptT, alibi_slopes: _OptT, learnable_sink: _OptT,
               rng_state: _T, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
               softmax_scale: Optional[float], causal: bool, window_size_left: int,
               window_size_right: int, softcap: float, deterministic: bool) -> _Result:
    seed, offset = (int(x) for x in rng_state.tolist())
    dq, dk, dv, dsinks = _core.backward(
        dout, q, k, v, out, lse, kind=_core.TORCH, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, dropout_p=dropout_p, softmax_scale=softmax_scale,
        causal=causal, window_size=(window_size_left, window_size_right), softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=learnable_sink, seed=seed, offset=offset,
        deterministic=deterministic)
    return dq, dk, dv, _dsink_or_empty(dsinks, q)


@varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                     alibi_slopes, learnable_sink, rng_state, max_seqlen_q, max_seqlen_k,
                     dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                     softcap, deterministic):
    return _grads_fake(q, k, v, learnable_sink)


# --------------------------------------------------------------------------------------------
# Autograd: the forward ops' formulas call the backward ops.


def _sink_grad(ctx, index, dsink):
    if not ctx.needs_input_grad[index]:
        return None
    return dsink.to(ctx.sink_dtype)


def _fwd_setup(ctx, inputs, output):
    (q, k, v, alibi, sink, _seed, dropout_p, scale, causal, left, right, softcap, _ret,
     deterministic) = inputs
    out, lse, S, rng_state = output
    ctx.mark_non_differentiable(lse, S, rng_state)
    ctx.save_for_backward(q, k, v, out, lse, rng_state, alibi, sink)
    ctx.options = (dropout_p, scale, causal, left, right, softcap, deterministic)
    ctx.sink_dtype = sink.dtype if sink is not None else None


def _fwd_backward(ctx, dout, _dlse, _dS, _drng):
    q, k, v, out, lse, rng_state, alibi, sink = ctx.saved_tensors
    dq, dk, dv, dsink = torch.ops.flashattn.bwd(dout, q, k, v, out, lse, alibi, sink, rng_state,
                                                *ctx.options)
    return (dq, dk, dv, None, _sink_grad(ctx, 4, dsink)) + (None,) * 9


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


def _varlen_setup(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, used_k, alibi, sink, _seed, max_q, max_k, dropout_p, scale, causal,
     left, right, softcap, _ret, deterministic) = inputs
    out, lse, S, rng_state = output
    ctx.mark_non_differentiable(lse, S, rng_state)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, used_k, alibi, sink, rng_state)
    ctx.options = (max_q, max_k, dropout_p, scale, causal, left, right, softcap, deterministic)
    ctx.sink_dtype = sink.dtype if sink is not None else None


def _varlen_backward(ctx, dout, _dlse, _dS, _drng):
    q, k, v, out, lse, cu_q, cu_k, used_k, alibi, sink, rng_state = ctx.saved_tensors
    dq, dk, dv, dsink = torch.ops.flashattn.varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k,
                                                       used_k, alibi, sink, rng_state,
                                                       *ctx.options)
    return (dq, dk, dv, None, None, None, None, _sink_grad(ctx, 7, dsink)) + (None,) * 11


varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup)


# --------------------------------------------------------------------------------------------
# The torch side of the public functions


# --------------------------------------------------------------------------------------------
# KV cache: appends k/v into the caches in place (hence mutates_args), then attends


@torch.library.custom_op("flashattn::kvcache", mutates_args=("k_cache", "v_cache"),
                         device_types=("cpu",))
def kvcache(q: _T, k_cache: _T, v_cache: _T, k: _OptT, v: _OptT, rotary_cos: _OptT,
            rotary_sin: _OptT, cache_seqlens: _OptT, cache_batch_idx: _OptT,
            cache_leftpad: _OptT, block_table: _OptT, alibi_slopes: _OptT,
            learnable_sink: _OptT, softmax_scale: Optional[float], causal: bool,
            window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
            num_splits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    from . import _kvcache

    return _kvcache.kvcache_run(
        _core.TORCH, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
        cache_batch_idx, cache_leftpad, block_table, alibi_slopes, learnable_sink,
        softmax_scale, causal, (window_left, window_right), softcap, rotary_interleaved,
        num_splits)


@kvcache.register_fake
def _kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                  cache_batch_idx, cache_leftpad, block_table, alibi_slopes, learnable_sink,
                  softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
                  num_splits):
    b, sq, h = q.shape[0], q.shape[1], q.shape[2]
    out = q.new_empty((b, sq, h, v_cache.shape[-1]))
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    return out, lse


def kvcache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                 cache_batch_idx, cache_leftpad, block_table, alibi_slopes, learnable_sink,
                 softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits):
    """flash_attn_with_kvcache for torch tensors: the op, with an int cache_seqlens turned into
    the int32 (b,) tensor the op takes, as upstream does."""
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.shape[0],), _core.as_int(cache_seqlens, "cache_seqlens"),
                                   dtype=torch.int32, device=q.device)
    left, right = _core.window_pair(window_size)
    if softmax_scale is not None:
        softmax_scale = _core.as_float(softmax_scale, "softmax_scale")
    return kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                   cache_batch_idx, cache_leftpad, block_table, alibi_slopes, learnable_sink,
                   softmax_scale, bool(causal), left, right, _core.as_float(softcap, "softcap"),
                   bool(rotary_interleaved), _core.as_int(num_splits, "num_splits"))


def draw_seed(dropout_p, device=None):
    """The dropout seed as an int64 (1,) tensor from the default generator (for CUDA tensors,
    ``device``'s CUDA generator: ``_core.draw_seed_cuda``), or None without dropout (so calls
    without dropout leave the generator alone). Seeds are in [0, 2**63 - 1) so that rng_state
    fits int64."""
    if dropout_p > 0.0 and device is not None and device.type == "cuda":
        return torch.tensor([_core.draw_seed_cuda(device)], dtype=torch.int64)
    if dropout_p > 0.0:
        return torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64)
    return None


def _scalars(dropout_p, softmax_scale, softcap):
    """Python-side checks the op schema would otherwise make with a less helpful message."""
    dropout_p = _core.as_float(dropout_p, "dropout_p")
    softcap = _core.as_float(softcap, "softcap")
    if softmax_scale is not None:
        softmax_scale = _core.as_float(softmax_scale, "softmax_scale")
    return dropout_p, softmax_scale, softcap


def _check_devices(named):
    # A tensor on a device without a kernel would otherwise reach the fake (meta) or fail in
    # the dispatcher with a message that does not name the argument.
    for name, x in named:
        if x is not None:
            _core.check_device(x, name, cuda=True)


def _renamed(e, names):
    return FlashAttnError(_core._rename(str(e), names), e.status)


def dense(q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes,
          deterministic, return_softmax, learnable_sink, names=None):
    """One dense call: (out, fp32 lse, S_dmask, rng_state). ``window`` is already a pair of C
    ints; ``names`` maps C argument names to the caller's, for error messages."""
    names = names or {}
    nm = lambda n: names.get(n, n)  # noqa: E731
    _check_devices([(nm("q"), q), (nm("k"), k), (nm("v"), v), ("alibi_slopes", alibi_slopes),
                    ("learnable_sink", learnable_sink)])
    dropout_p, softmax_scale, softcap = _scalars(dropout_p, softmax_scale, softcap)
    try:
        out, lse, S, rng_state = torch.ops.flashattn.fwd(
            q, k, v, alibi_slopes, learnable_sink, draw_seed(dropout_p, q.device), dropout_p,
            softmax_scale, bool(causal), window[0], window[1], softcap, bool(return_softmax),
            bool(deterministic))
    except FlashAttnError as e:
        raise _renamed(e, names) from None
    return out, lse.float(), S, rng_state


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
           softmax_scale, causal, window, softcap, alibi_slopes, deterministic, return_softmax,
           learnable_sink, seqused_k=None, names=None):
    """One varlen call: (out, fp32 lse, S_dmask, rng_state); arguments as in ``dense``."""
    names = names or {}
    nm = lambda n: names.get(n, n)  # noqa: E731
    _check_devices([(nm("q"), q), (nm("k"), k), (nm("v"), v),
                    (nm("cu_seqlens_q"), cu_seqlens_q), (nm("cu_seqlens_k"), cu_seqlens_k),
                    ("seqused_k", seqused_k), ("alibi_slopes", alibi_slopes),
                    ("learnable_sink", learnable_sink)])
    dropout_p, softmax_scale, softcap = _scalars(dropout_p, softmax_scale, softcap)
    max_seqlen_q = _core.as_int(max_seqlen_q, nm("max_seqlen_q"))
    max_seqlen_k = _core.as_int(max_seqlen_k, nm("max_seqlen_k"))
    try:
        out, lse, S, rng_state = torch.ops.flashattn.varlen_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, learnable_sink,
            draw_seed(dropout_p, q.device), max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
            bool(causal), window[0], window[1], softcap, bool(return_softmax),
            bool(deterministic))
    except FlashAttnError as e:
        raise _renamed(e, names) from None
    return out, lse.float(), S, rng_state
