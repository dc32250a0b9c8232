"""torch.autograd.Function wrappers (imported only once a torch tensor that needs a graph is
seen, so the package imports without torch).

The forward saves what upstream's saves (q, k, v, out, softmax_lse, rng_state and the options);
the backward calls fa_attention_backward, which recomputes the probabilities tile by tile and
replays the dropout mask from rng_state. fp64 inputs keep an fp64 lse internally so their
gradients are exact to fp64 rounding; the lse handed to the caller is fp32, as upstream's.
"""

import torch

from . import _core
from . import flash_attn_interface as _fi


def _lse_buffer(q, shape):
    if q.dtype == torch.float64:
        return torch.empty(shape, dtype=torch.float64, device=q.device)
    return None


def _sink_grad(sink, dsinks):
    if sink is None or not sink.requires_grad:
        return None
    return dsinks.to(sink.dtype)


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_softmax, learnable_sink, names):
        seed = _fi._seed_for(_core.TORCH, dropout_p)
        lse = _lse_buffer(q, (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else None)
        out, lse, probs = _core.forward(
            q, k, v, kind=_core.TORCH, dropout_p=dropout_p, softmax_scale=softmax_scale,
            causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
            sinks=learnable_sink, return_softmax=return_softmax, seed=seed, offset=0, lse=lse,
            names=names)
        S_dmask = probs if return_softmax else _fi._empty_dmask(_core.TORCH, q)
        rng_state = _core.rng_state_array(_core.TORCH, seed, 0, q)
        ctx.save_for_backward(q, k, v, out, lse, rng_state, alibi_slopes, learnable_sink)
        ctx.options = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                           window_size=window_size, softcap=softcap,
                           deterministic=deterministic, names=names)
        lse_out = lse.float() if lse.dtype != torch.float32 else lse
        ctx.mark_non_differentiable(lse_out, S_dmask)
        return out, lse_out, S_dmask

    @staticmethod
    def backward(ctx, dout, *_unused):
        q, k, v, out, lse, rng_state, alibi_slopes, sink = ctx.saved_tensors
        o = ctx.options
        dq, dk, dv, dsinks = _core.backward(
            dout, q, k, v, out, lse, kind=_core.TORCH, dropout_p=o["dropout_p"],
            softmax_scale=o["softmax_scale"], causal=o["causal"], window_size=o["window_size"],
            softcap=o["softcap"], alibi_slopes=alibi_slopes, sinks=sink,
            seed=int(rng_state[0]), offset=int(rng_state[1]),
            deterministic=o["deterministic"], names=o["names"])
        return (dq, dk, dv) + (None,) * 8 + (_sink_grad(sink, dsinks), None)


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, learnable_sink, names):
        seed = _fi._seed_for(_core.TORCH, dropout_p)
        lse = _lse_buffer(q, (q.shape[1], q.shape[0]) if q.dim() == 3 else None)
        out, lse, probs = _core.forward(
            q, k, v, kind=_core.TORCH, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p,
            softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, sinks=learnable_sink,
            return_softmax=return_softmax, seed=seed, offset=0, lse=lse, names=names)
        S_dmask = probs if return_softmax else _fi._empty_dmask(_core.TORCH, q)
        rng_state = _core.rng_state_array(_core.TORCH, seed, 0, q)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state,
                              alibi_slopes, learnable_sink)
        ctx.options = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                           dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                           window_size=window_size, softcap=softcap,
                           deterministic=deterministic, names=names)
        lse_out = lse.float() if lse.dtype != torch.float32 else lse
        ctx.mark_non_differentiable(lse_out, S_dmask)
        return out, lse_out, S_dmask

    @staticmethod
    def backward(ctx, dout, *_unused):
        (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state, alibi_slopes,
         sink) = ctx.saved_tensors
        o = ctx.options
        dq, dk, dv, dsinks = _core.backward(
            dout, q, k, v, out, lse, kind=_core.TORCH, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=o["max_seqlen_q"],
            max_seqlen_k=o["max_seqlen_k"], dropout_p=o["dropout_p"],
            softmax_scale=o["softmax_scale"], causal=o["causal"], window_size=o["window_size"],
            softcap=o["softcap"], alibi_slopes=alibi_slopes, sinks=sink,
            seed=int(rng_state[0]), offset=int(rng_state[1]),
            deterministic=o["deterministic"], names=o["names"])
        return (dq, dk, dv) + (None,) * 12 + (_sink_grad(sink, dsinks), None)
