"""PyTorch custom ops over the C library, and the torch side of the public functions.

    torch.ops.flashattn.fwd         (q, k, v, ...)                  -> out, lse, S_dmask, rng_state
    torch.ops.flashattn.varlen_fwd  (q, k, v, cu_seqlens_q, ...)    -> out, lse, S_dmask, rng_state
    torch.ops.flashattn.varlen_fwd_paged (..., block_table, ...)    -> the same, forward only
    torch.ops.flashattn.bwd         (dout, q, k, v, out, lse, ...)  -> dq, dk, dv, dsink
    torch.ops.flashattn.varlen_bwd  (dout, q, k, v, out, lse, ...)  -> dq, dk, dv, dsink

and, from _torch_kvcache (imported here), torch.ops.flashattn.kvcache and .combine; from
_torch_flex, torch.ops.flashattn.flex_fwd and .flex_bwd (flex_attention under torch.compile).

Imported on the first torch call (``import flashattn`` does not import torch). Each op has a
fake implementation for tracing and the forward ops carry an autograd formula
(``register_autograd``) that calls the backward op, so a compiled model keeps them as opaque
nodes and traces without graph breaks. The ops are functional (they allocate their outputs),
which is what AOT autograd wants; kvcache and combine declare what they write.

The public functions call the ops whenever torch could observe the difference: under
torch.compile, a dispatch or function mode, functorch transforms, or with tensor subclasses.
Otherwise (plain eager tensors) they run the same kernel functions and the same autograd
formula directly (``_torch_call.is_eager``): the dispatcher's Python round trips through a custom op cost
tens of microseconds per call, more than the kernel launch itself on small inputs.

The kernels are Python functions over ``_core``, registered for the device types in
``DEVICE_TYPES``: "cuda" runs the same kernels, ``_core`` passing CUDA tensors' device pointers,
their device and the current stream to the C library.

Outputs, as upstream's ops (``flash_attn::_flash_attn_forward`` and friends): ``out`` (b, sq, h,
dv) / (total_q, h, dv); ``lse`` (b, h, sq) / (h, total_q), fp32, except fp64 for fp64 inputs so
that fp64 gradients stay exact (the public functions hand the caller an fp32 copy, as
upstream); ``S_dmask`` (b, h, round128(sq), round128(sk)) in q's dtype, or (0,) unless
``return_softmax``; ``rng_state`` int64 (2,) = [seed, offset] on q's device, as upstream. The
backward ops read their rng_state on the host, and only with dropout; the autograd formulas
hand them one built from the forward's seed input (a CPU tensor), so no backward reads device
memory on the host. The backward ops return new gradients (upstream's write into caller
buffers, which AOT autograd would have to functionalise) and ``dsink``: fp32 (h,), or (0,)
without a sink.

Dropout: the seed is an input, an int64 tensor that ``draw_seed`` takes outside the op from
torch's default generator (``torch.randint``; for CUDA tensors in eager mode the device's CUDA
generator, ``_arrays.draw_seed_cuda``). Eager calls consume the generator as one draw does, so
``torch.manual_seed`` reproduces a run; under ``torch.compile`` the draw is an ordinary random op
of the graph, ``torch.randint`` on the CPU for every device (Inductor's RNG, itself seeded from
the default generator, unless ``torch._inductor.config.fallback_random``). Dropout cannot be
captured in a CUDA graph: the kernel takes the seed by value, so every replay would repeat one
mask; the forward kernels refuse it (``_refuse_capture``), and so does ``draw_seed`` before it
touches the CUDA generator.
"""

from typing import Optional, Tuple

import torch

from . import _arrays, _cached, _core
from ._lib import FlashAttnError
from ._torch_call import DEVICE_TYPES, OptT, T, is_eager, needs_grad, run
# The KV-cache and combine ops (registered on import) and their public functions' torch side.
from ._torch_kvcache import combine_call, kvcache_call  # noqa: F401
# flex_attention's ops (registered on import) and the route of its compiled calls.
from ._torch_flex import flex_compiled  # noqa: F401

_Result = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _round128(x):
    return (x + 127) // 128 * 128


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _seed_value(seed):
    return int(seed.item()) if seed is not None else 0


def _rng_state(seed, q):
    """[seed, 0] on q's device, written by fills rather than copied from the host: no
    synchronisation, and nothing a CUDA graph could not capture."""
    state = torch.zeros((2,), dtype=torch.int64, device=q.device)
    if seed:
        state[0] = seed
    return state


def _host_rng_state(rng_state, seed):
    """The rng_state the backward op gets: [seed, 0] on the CPU from the forward's seed input
    (itself a CPU tensor), so that replaying dropout does not read device memory; the
    forward's own rng_state without dropout (then never read)."""
    if seed is None:
        return rng_state
    return torch.cat([seed, torch.zeros_like(seed)])


def _seed_offset(rng_state, dropout_p):
    """(seed, offset) for the backward, read only when there is dropout to replay."""
    if dropout_p > 0.0:
        seed, offset = rng_state.tolist()
        return seed, offset
    return 0, 0


def _dsink_or_empty(dsinks, q):
    if dsinks is None:
        return torch.empty((0,), dtype=torch.float32, device=q.device)
    return dsinks


def _refuse_capture(device, dropout_p):
    """Dropout on a stream being captured into a CUDA graph: the seed would be frozen into the
    graph and every replay would drop the same elements, so the call is refused instead."""
    if dropout_p > 0.0 and device.type == "cuda":
        with torch.cuda.device(device):
            capturing = torch.cuda.is_current_stream_capturing()
        if capturing:
            raise FlashAttnError(
                "dropout_p: %g under CUDA graph capture is not supported: the kernel takes the "
                "dropout seed by value, so every replay of the graph would apply the same "
                "dropout mask; capture with dropout_p=0 or call it outside the graph"
                % dropout_p)


# --------------------------------------------------------------------------------------------
# Forward ops


def _fwd_impl(q: T, k: T, v: T, alibi_slopes: OptT, learnable_sink: OptT, seed: OptT,
              dropout_p: float, softmax_scale: Optional[float], causal: bool,
              window_size_left: int, window_size_right: int, softcap: float,
              return_softmax: bool, deterministic: bool) -> _Result:
    """Dense attention. ``deterministic`` is the backward's option, carried here so that the
    autograd formula sees it; the forward ignores it."""
    out, lse, probs, s = _fwd_outputs(q, k, v, alibi_slopes, learnable_sink, seed, dropout_p,
                                      softmax_scale, causal, window_size_left,
                                      window_size_right, softcap, return_softmax)
    S = probs if return_softmax else q.new_empty((0,))
    return out, lse, S, _rng_state(s, q)


def _fwd_outputs(q, k, v, alibi_slopes, learnable_sink, seed, dropout_p, softmax_scale, causal,
                 window_size_left, window_size_right, softcap, return_softmax):
    """The dense forward's work: (out, lse, probs or None, the seed value)."""
    _refuse_capture(q.device, dropout_p)
    s = _seed_value(seed)
    window = (window_size_left, window_size_right)
    if q.dtype == torch.float64 or alibi_slopes is not None or learnable_sink is not None or (
            return_softmax):
        lse = None
        if q.dtype == torch.float64 and q.dim() == 4:
            lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float64,
                              device=q.device)
        out, lse, probs = _core.forward(
            q, k, v, kind=_arrays.TORCH, dropout_p=dropout_p, softmax_scale=softmax_scale,
            causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi_slopes,
            sinks=learnable_sink, return_softmax=return_softmax, seed=s, offset=0, lse=lse)
    else:
        out, lse = _cached.forward_dense_torch(q, k, v, dropout_p, softmax_scale, causal, window,
                                             softcap, s)
        probs = None
    return out, lse, probs, s


fwd = torch.library.custom_op("flashattn::fwd", _fwd_impl, mutates_args=(),
                              device_types=DEVICE_TYPES)


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


def _varlen_fwd_impl(q: T, k: T, v: T, cu_seqlens_q: T, cu_seqlens_k: T,
                     seqused_k: OptT, alibi_slopes: OptT, learnable_sink: OptT, seed: OptT,
                     max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                     softmax_scale: Optional[float], causal: bool, window_size_left: int,
                     window_size_right: int, softcap: float, return_softmax: bool,
                     deterministic: bool) -> _Result:
    """Variable-length attention; ``deterministic`` as in ``fwd``."""
    return _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes,
                        learnable_sink, seed, max_seqlen_q, max_seqlen_k, dropout_p,
                        softmax_scale, causal, window_size_left, window_size_right, softcap,
                        return_softmax)


def _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, learnable_sink,
                 seed, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                 window_size_left, window_size_right, softcap, return_softmax, block_table=None):
    _refuse_capture(q.device, dropout_p)
    s = _seed_value(seed)
    lse = None
    if q.dtype == torch.float64 and q.dim() == 3:
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float64, device=q.device)
    out, lse, probs = _core.forward(
        q, k, v, kind=_arrays.TORCH, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_size_left, window_size_right), softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=learnable_sink, return_softmax=return_softmax,
        seed=s, offset=0, lse=lse, block_table=block_table)
    S = probs if return_softmax else q.new_empty((0,))
    return out, lse, S, _rng_state(s, q)


varlen_fwd = torch.library.custom_op("flashattn::varlen_fwd", _varlen_fwd_impl, mutates_args=(),
                                     device_types=DEVICE_TYPES)


def _varlen_paged_impl(q: T, k: T, v: T, cu_seqlens_q: T, cu_seqlens_k: T,
                       seqused_k: OptT, block_table: T, alibi_slopes: OptT,
                       learnable_sink: OptT, seed: OptT, max_seqlen_q: int, max_seqlen_k: int,
                       dropout_p: float, softmax_scale: Optional[float], causal: bool,
                       window_size_left: int, window_size_right: int, softcap: float,
                       return_softmax: bool) -> _Result:
    """Variable-length attention over pages k, v (num_blocks, page_size, h_k, d) read in place
    through block_table. No autograd formula: a call that wants gradients gathers the pages
    with torch ops instead (``_paged``), as upstream has no paged backward."""
    return _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes,
                        learnable_sink, seed, max_seqlen_q, max_seqlen_k, dropout_p,
                        softmax_scale, causal, window_size_left, window_size_right, softcap,
                        return_softmax, block_table)


varlen_fwd_paged = torch.library.custom_op("flashattn::varlen_fwd_paged", _varlen_paged_impl,
                                           mutates_args=(), device_types=DEVICE_TYPES)


@varlen_fwd_paged.register_fake
def _varlen_paged_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                       alibi_slopes, learnable_sink, seed, max_seqlen_q, max_seqlen_k,
                       dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                       softcap, return_softmax):
    return _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes,
                            learnable_sink, seed, max_seqlen_q, max_seqlen_k, dropout_p,
                            softmax_scale, causal, window_size_left, window_size_right, softcap,
                            return_softmax, False)


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes,
                     learnable_sink, seed, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                     causal, window_size_left, window_size_right, softcap, return_softmax,
                     deterministic):
    total_q, h = q.shape[0], q.shape[1]
    out = q.new_empty((total_q, h, v.shape[-1]))
    lse = q.new_empty((h, total_q), dtype=_lse_dtype(q))
    if return_softmax:
        b = cu_seqlens_q.shape[0] - 1
        S = q.new_empty((b, h, _round128(max_seqlen_q), _round128(max_seqlen_k)))
    else:
        S = q.new_empty((0,))
    return out, lse, S, q.new_empty((2,), dtype=torch.int64)


# --------------------------------------------------------------------------------------------
# Backward ops


def _bwd_impl(dout: T, q: T, k: T, v: T, out: T, lse: T, alibi_slopes: OptT,
              learnable_sink: OptT, rng_state: T, dropout_p: float,
              softmax_scale: Optional[float], causal: bool, window_size_left: int,
              window_size_right: int, softcap: float, deterministic: bool) -> _Result:
    seed, offset = _seed_offset(rng_state, dropout_p)
    if alibi_slopes is None and learnable_sink is None:
        dq, dk, dv = _cached.backward_dense_torch(
            dout, q, k, v, out, lse, dropout_p, softmax_scale, causal,
            (window_size_left, window_size_right), softcap, seed, offset, deterministic)
        return dq, dk, dv, _dsink_or_empty(None, q)
    dq, dk, dv, dsinks = _core.backward(
        dout, q, k, v, out, lse, kind=_arrays.TORCH, dropout_p=dropout_p,
        softmax_scale=softmax_scale, causal=causal,
        window_size=(window_size_left, window_size_right), softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=learnable_sink, seed=seed, offset=offset,
        deterministic=deterministic)
    return dq, dk, dv, _dsink_or_empty(dsinks, q)


bwd = torch.library.custom_op("flashattn::bwd", _bwd_impl, mutates_args=(),
                              device_types=DEVICE_TYPES)


def _grads_fake(q, k, v, learnable_sink):
    h = q.shape[-2]
    dsink = q.new_empty((h,) if learnable_sink is not None else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsink


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, alibi_slopes, learnable_sink, rng_state, dropout_p,
              softmax_scale, causal, window_size_left, window_size_right, softcap,
              deterministic):
    return _grads_fake(q, k, v, learnable_sink)


def _varlen_bwd_impl(dout: T, q: T, k: T, v: T, out: T, lse: T, cu_seqlens_q: T,
                     cu_seqlens_k: T, seqused_k: OptT, alibi_slopes: OptT,
                     learnable_sink: OptT, rng_state: T, max_seqlen_q: int,
                     max_seqlen_k: int, dropout_p: float, softmax_scale: Optional[float],
                     causal: bool, window_size_left: int, window_size_right: int,
                     softcap: float, deterministic: bool) -> _Result:
    seed, offset = _seed_offset(rng_state, dropout_p)
    dq, dk, dv, dsinks = _core.backward(
        dout, q, k, v, out, lse, kind=_arrays.TORCH, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, dropout_p=dropout_p, softmax_scale=softmax_scale,
        causal=causal, window_size=(window_size_left, window_size_right), softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=learnable_sink, seed=seed, offset=offset,
        deterministic=deterministic)
    return dq, dk, dv, _dsink_or_empty(dsinks, q)


varlen_bwd = torch.library.custom_op("flashattn::varlen_bwd", _varlen_bwd_impl, mutates_args=(),
                                     device_types=DEVICE_TYPES)


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
    (q, k, v, alibi, sink, seed, dropout_p, scale, causal, left, right, softcap, _ret,
     deterministic) = inputs
    out, lse, S, rng_state = output
    ctx.mark_non_differentiable(lse, S, rng_state)
    # Their gradients would be zeros made on every backward call (3 allocations and fills).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, out, lse, rng_state, seed, alibi, sink)
    ctx.options = (dropout_p, scale, causal, left, right, softcap, deterministic)
    ctx.sink_dtype = sink.dtype if sink is not None else None


def _fwd_backward(ctx, dout, _dlse, _dS, _drng):
    if dout is None:  # out's gradient undefined (gradients are not materialised)
        return (None,) * 14
    q, k, v, out, lse, rng_state, seed, alibi, sink = ctx.saved_tensors
    args = (dout, q, k, v, out, lse, alibi, sink,
            _host_rng_state(rng_state, seed)) + ctx.options
    tensors = (dout, q, k, v, out, lse, alibi, sink)
    dq, dk, dv, dsink = run(torch.ops.flashattn.bwd, _bwd_impl, None, tensors, args,
                             is_eager(tensors))
    return (dq, dk, dv, None, _sink_grad(ctx, 4, dsink)) + (None,) * 9


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


def _varlen_setup(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, used_k, alibi, sink, seed, max_q, max_k, dropout_p, scale, causal,
     left, right, softcap, _ret, deterministic) = inputs
    out, lse, S, rng_state = output
    ctx.mark_non_differentiable(lse, S, rng_state)
    ctx.set_materialize_grads(False)  # as _fwd_setup's
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, used_k, alibi, sink, rng_state, seed)
    ctx.options = (max_q, max_k, dropout_p, scale, causal, left, right, softcap, deterministic)
    ctx.sink_dtype = sink.dtype if sink is not None else None


def _varlen_backward(ctx, dout, _dlse, _dS, _drng):
    if dout is None:  # as _fwd_backward's
        return (None,) * 19
    q, k, v, out, lse, cu_q, cu_k, used_k, alibi, sink, rng_state, seed = ctx.saved_tensors
    args = (dout, q, k, v, out, lse, cu_q, cu_k, used_k, alibi, sink,
            _host_rng_state(rng_state, seed)) + ctx.options
    tensors = (dout, q, k, v, out, lse, cu_q, cu_k, used_k, alibi, sink)
    dq, dk, dv, dsink = run(torch.ops.flashattn.varlen_bwd, _varlen_bwd_impl, None, tensors,
                             args, is_eager(tensors))
    return (dq, dk, dv, None, None, None, None, _sink_grad(ctx, 7, dsink)) + (None,) * 11


varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup)


class _DenseFn(torch.autograd.Function):
    """flashattn::fwd with its registered formula, for ``run``: (q, k, v, alibi_slopes,
    learnable_sink, the other arguments as a tuple), since every argument of apply costs."""

    @staticmethod
    def forward(ctx, q, k, v, alibi, sink, rest):
        inputs = (q, k, v, alibi, sink) + rest
        output = _fwd_impl(*inputs)
        _fwd_setup(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        return _fwd_backward(ctx, *grads)[:5] + (None,)


class _DenseFastFn(torch.autograd.Function):
    """``dense``'s one-step calls that record gradients (and _fastpath's): flashattn::fwd's
    formula for a call without dropout, ALiBi, sinks or probs, whose only output is out (no S
    or rng_state to make), for (q, k, v, (scale, causal, left, right, softcap,
    deterministic)); scale and softcap as the caller gave them (None: the default scale)."""

    @staticmethod
    def forward(ctx, q, k, v, options):
        if _arrays.is_fp8(q):  # _fastpath hands calls that record gradients straight here
            raise NotImplementedError(_FP8_NO_BACKWARD % "q")
        scale, causal, left, right, softcap, _ = options
        out, lse = _cached.forward_dense_torch(q, k, v, 0.0, scale, causal, (left, right),
                                               softcap, 0)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (0.0,) + options
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        tensors = (dout, q, k, v, out, lse)
        if is_eager(tensors) and not needs_grad(tensors):
            _, scale, causal, left, right, softcap, deterministic = ctx.options
            dq, dk, dv = _cached.backward_dense_torch(dout, q, k, v, out, lse, 0.0, scale,
                                                      causal, (left, right), softcap, 0, 0,
                                                      deterministic)
            return dq, dk, dv, None
        rng_state = torch.zeros((2,), dtype=torch.int64, device=q.device)  # never read
        args = (dout, q, k, v, out, lse, None, None, rng_state) + ctx.options
        dq, dk, dv, _ = torch.ops.flashattn.bwd(*args)
        return dq, dk, dv, None


class _VarlenFn(torch.autograd.Function):
    """flashattn::varlen_fwd with its registered formula, for ``run``: the eight tensor
    arguments, then the others as a tuple."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, used_k, alibi, sink, rest):
        inputs = (q, k, v, cu_q, cu_k, used_k, alibi, sink) + rest
        output = _varlen_fwd_impl(*inputs)
        _varlen_setup(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        return _varlen_backward(ctx, *grads)[:8] + (None,)


# --------------------------------------------------------------------------------------------
# The torch side of the public functions


def draw_seed(dropout_p, q):
    """The dropout seed of a call on ``q``'s device as an int64 (1,) CPU tensor, or None without
    dropout (so calls without dropout leave the generators alone). Seeds are in
    [0, 2**63 - 1) so that rng_state fits int64. Eager CUDA calls draw from the device's CUDA
    generator (``_arrays.draw_seed_cuda``); everything else, compiled CUDA calls included, with
    ``torch.randint`` from the default CPU generator, a random op that a compiled graph
    keeps."""
    if not dropout_p > 0.0:
        return None
    device = q.device
    if device.type == "cuda" and not torch.compiler.is_compiling():
        _refuse_capture(device, dropout_p)
        return torch.tensor([_arrays.draw_seed_cuda(device)], dtype=torch.int64)
    return torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64)


def _scalars(dropout_p, softmax_scale, softcap):
    """Python-side checks the op schema would otherwise make with a less helpful message."""
    dropout_p = _core.as_float(dropout_p, "dropout_p")
    softcap = _core.as_float(softcap, "softcap")
    return dropout_p, _core.as_scale(softmax_scale), softcap


def _check_devices(named):
    # Before an op: a tensor on a device without a kernel would otherwise reach the fake (meta)
    # or fail in the dispatcher with a message that does not name the argument. (The kernels
    # check devices themselves, so a direct call needs no check here.)
    for name, x in named:
        if x is not None:
            _arrays.check_device(x, name, cuda=True)


def _renamed(e, names):
    return FlashAttnError(_core._rename(str(e), names), e.status)


_FP8_NO_BACKWARD = ("%s: fp8 has no backward (as FA3); run the fp8 forward on tensors that do "
                    "not require grad, or under torch.no_grad()")


def fp8_forward(q, k, v, names=None, **options):
    """``_core.forward`` (its keyword ``options``) on fp8 q, k, v, as FA3's fp8 forward: out
    bf16, no autograd (fp8 has no backward, so inputs that require grad are refused here rather
    than at the backward) and no custom op (eager calls only)."""
    names = dict(names or {}, probs="return_attn_probs")
    tensors = (q, k, v)
    if needs_grad(tensors):
        raise NotImplementedError(_FP8_NO_BACKWARD % names.get("q", "q"))
    if not is_eager(tensors):
        raise NotImplementedError("%s: fp8 inputs run eagerly only (not under torch.compile, "
                                  "tracing or a tensor subclass)" % names.get("q", "q"))
    return _core.forward(q, k, v, kind=_arrays.TORCH, names=names, **options)


def _fp8_result(q, out, lse, S, return_softmax, want):
    """fp8_forward's (out, lse, probs) as ``dense`` / ``varlen`` return theirs."""
    if want is not None:
        return out, lse, S if return_softmax else None
    return out, lse, S if return_softmax else q.new_empty((0,)), _rng_state(0, q)


def dense(q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes,
          deterministic, return_softmax, learnable_sink, names=None, want=None):
    """One dense call. ``window`` is already a pair of C ints; ``names`` maps C argument names
    to the caller's, for error messages. ``want`` None: upstream's (out, fp32 lse, S_dmask,
    rng_state). ``want`` a bool (the public functions, which drop rng_state and return the lse
    only when asked): (out, fp32 lse or None, S_dmask or None unless ``return_softmax``), and
    a plain eager call without dropout, ALiBi, sinks or probs is made in one step, as
    _fastpath makes it: with gradients through ``_DenseFastFn``, without them from the prepared
    call of its signature (``_cached``)."""
    names = names or {}
    if _arrays.is_fp8(q):
        out, lse, S = fp8_forward(
            q, k, v, names, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
            window_size=window, softcap=softcap, alibi_slopes=alibi_slopes,
            sinks=learnable_sink, return_softmax=return_softmax)
        return _fp8_result(q, out, lse, S, return_softmax, want)
    tensors = (q, k, v, alibi_slopes, learnable_sink)
    eager = is_eager(tensors)
    if not eager:
        nm = lambda n: names.get(n, n)  # noqa: E731
        _check_devices([(nm("q"), q), (nm("k"), k), (nm("v"), v),
                        ("alibi_slopes", alibi_slopes), ("learnable_sink", learnable_sink)])
    dropout_p = _core.as_float(dropout_p, "dropout_p")
    deterministic = _core.as_bool(deterministic, "deterministic")
    try:
        if (want is not None and eager and not dropout_p and alibi_slopes is None
                and learnable_sink is None and not return_softmax
                and q.dtype != torch.float64 and q.dim() == 4):
            # The other scalars as the caller gave them: _core checks and converts them, and
            # the prepared call's signature holds them as _fastpath sees them.
            if not needs_grad(tensors):
                out, lse = _cached.forward_dense_torch(q, k, v, 0.0, softmax_scale, causal,
                                                       window, softcap, 0, want_lse=want)
                return out, lse, None
            if not want:
                options = (softmax_scale, _core.as_bool(causal, "causal"), window[0],
                           window[1], softcap, deterministic)
                return _DenseFastFn.apply(q, k, v, options), None, None
        dropout_p, softmax_scale, softcap = _scalars(dropout_p, softmax_scale, softcap)
        causal = _core.as_bool(causal, "causal")
        args = (q, k, v, alibi_slopes, learnable_sink, draw_seed(dropout_p, q), dropout_p,
                softmax_scale, causal, window[0], window[1], softcap, bool(return_softmax),
                deterministic)
        if eager and want is not None and not needs_grad(tensors):
            out, lse, S, _ = _fwd_outputs(*args[:-1])
            return out, lse.float(), S
        out, lse, S, rng_state = run(torch.ops.flashattn.fwd, _fwd_impl, _DenseFn, tensors,
                                      args, eager)
    except FlashAttnError as e:
        raise _renamed(e, names) from None
    if want is None:
        return out, lse.float(), S, rng_state
    return out, lse.float(), S


def bind_fastpath(fallback, dense_args, kv_fallback, kv_args, flex_table):
    """(_fastpath.dense, _fastpath.kvcache, _fastpath.flex) in front of ``fallback``
    (flash_attn_func's route, its arguments in ``dense_args``' order, the calls with gradients
    handed to _DenseFastFn), ``kv_fallback`` (flash_attn_with_kvcache's, in ``kv_args``'
    order) and flex_attention's route (``flex_table``: flex.fastpath_table()); (None, None,
    None) where the extension was not built."""
    return _cached.bind_fastpath(torch, _DenseFastFn.apply, fallback, dense_args, kv_fallback,
                                 kv_args, flex_table)


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
           softmax_scale, causal, window, softcap, alibi_slopes, deterministic, return_softmax,
           learnable_sink, seqused_k=None, names=None, block_table=None):
    """One varlen call: (out, fp32 lse, S_dmask, rng_state); arguments as in ``dense``.
    With block_table k and v are pages read in place (flashattn::varlen_fwd_paged, forward
    only: the caller gathers them when it wants gradients)."""
    names = names or {}
    if _arrays.is_fp8(q):
        out, lse, S = fp8_forward(
            q, k, v, names, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window,
            softcap=softcap, alibi_slopes=alibi_slopes, sinks=learnable_sink,
            return_softmax=return_softmax, block_table=block_table)
        return _fp8_result(q, out, lse, S, return_softmax, None)
    nm = lambda n: names.get(n, n)  # noqa: E731
    tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, learnable_sink)
    if block_table is not None:
        tensors = tensors[:6] + (block_table,) + tensors[6:]
    eager = is_eager(tensors)
    if not eager:
        _check_devices([(nm("q"), q), (nm("k"), k), (nm("v"), v),
                        (nm("cu_seqlens_q"), cu_seqlens_q), (nm("cu_seqlens_k"), cu_seqlens_k),
                        ("seqused_k", seqused_k), ("block_table", block_table),
                        ("alibi_slopes", alibi_slopes), ("learnable_sink", learnable_sink)])
    dropout_p, softmax_scale, softcap = _scalars(dropout_p, softmax_scale, softcap)
    max_seqlen_q = _core.as_int(max_seqlen_q, nm("max_seqlen_q"))
    max_seqlen_k = _core.as_int(max_seqlen_k, nm("max_seqlen_k"))
    args = tensors + (draw_seed(dropout_p, q), max_seqlen_q, max_seqlen_k, dropout_p,
                      softmax_scale, _core.as_bool(causal, "causal"), window[0], window[1],
                      softcap, bool(return_softmax))
    if block_table is None:
        args += (_core.as_bool(deterministic, "deterministic"),)
        op, impl, function = torch.ops.flashattn.varlen_fwd, _varlen_fwd_impl, _VarlenFn
    else:
        op, impl, function = torch.ops.flashattn.varlen_fwd_paged, _varlen_paged_impl, None
    try:
        out, lse, S, rng_state = run(op, impl, function, tensors, args, eager)
    except FlashAttnError as e:
        raise _renamed(e, names) from None
    return out, lse.float(), S, rng_state
