"""torch.autograd.Function wrappers (imported only once a torch tensor that needs a graph is
seen, so the package imports without torch).

Forward only for now: the Functions save what upstream's save for backward (q, k, v, out,
softmax_lse, rng_state and the options), so the backward pass can be added here without
touching the public functions; until then ``backward`` raises NotImplementedError.
"""

import torch

from . import flash_attn_interface as _fi

_NO_BACKWARD = (
    "flashattn: the backward pass is not implemented yet by this build; run the forward under "
    "torch.no_grad() (or on tensors that do not require grad)"
)


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_softmax, learnable_sink, names):
        out, lse, S_dmask, rng_state = _fi._flash_attn_forward(
            q, k, v, dropout_p, softmax_scale, causal, window_size[0], window_size[1], softcap,
            alibi_slopes, return_softmax, learnable_sink, _kind="torch", _names=names)
        ctx.save_for_backward(q, k, v, out, lse, rng_state, alibi_slopes, learnable_sink)
        ctx.dropout_p = dropout_p
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.window_size = window_size
        ctx.softcap = softcap
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse, S_dmask)
        return out, lse, S_dmask

    @staticmethod
    def backward(ctx, dout, *args):
        raise NotImplementedError(_NO_BACKWARD)


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, learnable_sink, names):
        out, lse, S_dmask, rng_state = _fi._flash_attn_varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size[0], window_size[1], softcap, alibi_slopes,
            return_softmax, learnable_sink=learnable_sink, _kind="torch", _names=names)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state,
                              alibi_slopes, learnable_sink)
        ctx.max_seqlen_q = max_seqlen_q
        ctx.max_seqlen_k = max_seqlen_k
        ctx.dropout_p = dropout_p
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.window_size = window_size
        ctx.softcap = softcap
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse, S_dmask)
        return out, lse, S_dmask

    @staticmethod
    def backward(ctx, dout, *args):
        raise NotImplementedError(_NO_BACKWARD)
