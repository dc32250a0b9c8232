"""Upstream's raw extension entry points (``flash_attn_interface.flash_attn_gpu``).

Upstream's interface calls its compiled module ``flash_attn_2_cuda`` positionally: ``fwd``,
``varlen_fwd``, ``bwd``, ``varlen_bwd`` and ``fwd_kvcache``, with the arguments of
``mha_fwd`` and friends in csrc/flash_attn/flash_api.cpp, in that order, and returning lists.
Tests and libraries written against it reach for them; here they take the same arguments (any
array kind the public functions take) and run through the same calls as the public functions.
The four attention entry points keep upstream's dead ``generator`` slot, which must be None.
"""

import sys

from . import _arrays, _core
from ._lib import FlashAttnError

__all__ = ["RawEntryPoints"]

# csrc/flash_attn/flash_api.cpp's message, verbatim: callers match on it.
_GENERATOR = ("flash-attn: the RNG `generator` argument is no longer supported and must be "
              "None; dropout (when enabled) uses the default CUDA generator.")


def _no_generator(generator):
    if generator is not None:
        raise FlashAttnError(_GENERATOR)


def _kind(named, required):
    return _arrays.common_kind(named, required)


def _write(dst, src, kind):
    """dst[...] = src, in place (upstream writes the optional out_ / dq_ buffers)."""
    if dst is None:
        return src
    if kind == _arrays.TORCH:
        dst.copy_(src)
    else:
        dst[...] = src
    return dst


def _seed_offset(rng_state, dropout_p):
    """(seed, offset) to replay the forward's dropout from its rng_state."""
    if not _core.as_float(dropout_p, "p_dropout") > 0.0:
        return 0, 0
    if rng_state is None:
        raise FlashAttnError("rng_state: the forward's rng_state is needed to replay dropout")
    seed, offset = (int(x) for x in rng_state.tolist())
    return seed, offset


def _softmax_d(dout, out, kind, cu_seqlens_q=None):
    """Upstream's softmax_d, rowsum(dout * out) in fp32: (b, h, round128(sq)); varlen
    (h, total_q + 128 * b), sequence i's rows from cu_seqlens_q[i] + 128 * i. Padding is 0."""
    if kind == _arrays.TORCH:
        torch = sys.modules["torch"]
        d = (dout.float() * out.float()).sum(-1)  # (b, sq, h) or (total_q, h)
        if cu_seqlens_q is None:
            b, sq, h = d.shape
            res = torch.zeros((b, h, _arrays.round_multiple(sq, 128)), dtype=torch.float32,
                              device=d.device)
            res[:, :, :sq] = d.transpose(1, 2)
            return res
        cu = cu_seqlens_q.to(device=d.device, dtype=torch.int64)
        rows = torch.arange(d.shape[0], device=d.device)
        cols = rows + 128 * torch.searchsorted(cu[1:], rows, right=True)
        res = torch.zeros((d.shape[1], d.shape[0] + 128 * (cu.shape[0] - 1)),
                          dtype=torch.float32, device=d.device)
        res[:, cols] = d.t()
        return res
    np = sys.modules["numpy"]
    d = (np.asarray(dout, np.float32) * np.asarray(out, np.float32)).sum(-1)
    if cu_seqlens_q is None:
        b, sq, h = d.shape
        res = np.zeros((b, h, _arrays.round_multiple(sq, 128)), np.float32)
        res[:, :, :sq] = d.transpose(0, 2, 1)
        return res
    cu = np.asarray(cu_seqlens_q, np.int64)
    rows = np.arange(d.shape[0])
    cols = rows + 128 * np.searchsorted(cu[1:], rows, side="right")
    res = np.zeros((d.shape[1], d.shape[0] + 128 * (len(cu) - 1)), np.float32)
    res[:, cols] = d.T
    return res


class RawEntryPoints:
    """``flash_attn_gpu``: the five entry points over ``forward``, ``varlen_forward`` and
    ``with_kvcache`` (upstream's ``_flash_attn_forward``, ``_flash_attn_varlen_forward`` and
    ``flash_attn_with_kvcache``); the backward calls are the C library's own."""

    def __init__(self, forward, varlen_forward, with_kvcache):
        self._forward = forward
        self._varlen_forward = varlen_forward
        self._with_kvcache = with_kvcache

    def fwd(self, q, k, v, out_, alibi_slopes, p_dropout, softmax_scale, is_causal,
            window_size_left, window_size_right, softcap, return_softmax, generator):
        """mha_fwd: [out, softmax_lse, S_dmask, rng_state]."""
        _no_generator(generator)
        kind = _kind([("q", q), ("k", k), ("v", v), ("out_", out_),
                      ("alibi_slopes", alibi_slopes)], 3)
        out, lse, S, rng_state = self._forward(
            q, k, v, p_dropout, softmax_scale, is_causal, window_size_left, window_size_right,
            softcap, alibi_slopes, return_softmax, _kind=kind)
        return [_write(out_, out, kind), lse, S, rng_state]

    def varlen_fwd(self, q, k, v, out_, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k,
                   block_table, alibi_slopes, max_seqlen_q, max_seqlen_k, p_dropout,
                   softmax_scale, zero_tensors, is_causal, window_size_left, window_size_right,
                   softcap, return_softmax, generator, num_splits=0):
        """mha_varlen_fwd: [out, softmax_lse, S_dmask, rng_state]."""
        _no_generator(generator)
        kind = _kind([("q", q), ("k", k), ("v", v), ("out_", out_)], 3)
        out, lse, S, rng_state = self._varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, p_dropout,
            softmax_scale, is_causal, window_size_left, window_size_right, softcap,
            alibi_slopes, return_softmax, block_table, leftpad_k, seqused_k,
            _core.as_bool(zero_tensors, "zero_tensors"),
            _core.as_int(num_splits, "num_splits", _core.INT32))
        return [_write(out_, out, kind), lse, S, rng_state]

    @staticmethod
    def bwd(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, alibi_slopes, p_dropout,
            softmax_scale, is_causal, window_size_left, window_size_right, softcap,
            deterministic, generator, rng_state):
        """mha_bwd: [dq, dk, dv, softmax_d]; dq_, dk_, dv_ written when given."""
        _no_generator(generator)
        kind = _kind([("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out),
                      ("softmax_lse", softmax_lse)], 6)
        seed, offset = _seed_offset(rng_state, p_dropout)
        dq, dk, dv, _ = _core.backward(
            dout, q, k, v, out, softmax_lse, kind=kind, dropout_p=p_dropout,
            softmax_scale=softmax_scale, causal=is_causal,
            window_size=(window_size_left, window_size_right), softcap=softcap,
            alibi_slopes=alibi_slopes, seed=seed, offset=offset, deterministic=deterministic,
            names={"lse": "softmax_lse"}, dq=dq_, dk=dk_, dv=dv_)
        return [dq, dk, dv, _softmax_d(dout, out, kind)]

    @staticmethod
    def varlen_bwd(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, cu_seqlens_q, cu_seqlens_k,
                   alibi_slopes, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale,
                   zero_tensors, is_causal, window_size_left, window_size_right, softcap,
                   deterministic, generator, rng_state):
        """mha_varlen_bwd: [dq, dk, dv, softmax_d]; dq_, dk_, dv_ written when given."""
        _no_generator(generator)
        kind = _kind([("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out),
                      ("softmax_lse", softmax_lse), ("cu_seqlens_q", cu_seqlens_q),
                      ("cu_seqlens_k", cu_seqlens_k)], 8)
        _core.as_bool(zero_tensors, "zero_tensors")  # every gradient row is written
        seed, offset = _seed_offset(rng_state, p_dropout)
        dq, dk, dv, _ = _core.backward(
            dout, q, k, v, out, softmax_lse, kind=kind, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            dropout_p=p_dropout, softmax_scale=softmax_scale, causal=is_causal,
            window_size=(window_size_left, window_size_right), softcap=softcap,
            alibi_slopes=alibi_slopes, seed=seed, offset=offset, deterministic=deterministic,
            names={"lse": "softmax_lse"}, dq=dq_, dk=dk_, dv=dv_)
        return [dq, dk, dv, _softmax_d(dout, out, kind, cu_seqlens_q)]

    def fwd_kvcache(self, q, kcache, vcache, k_, v_, seqlens_k_, rotary_cos_, rotary_sin_,
                    cache_batch_idx_, leftpad_k_, block_table_, alibi_slopes_, out_,
                    softmax_scale, is_causal, window_size_left, window_size_right, softcap,
                    is_rotary_interleaved, num_splits):
        """mha_fwd_kvcache: [out, softmax_lse]."""
        kind = _kind([("q", q), ("kcache", kcache), ("vcache", vcache), ("out_", out_)], 3)
        out, lse = self._with_kvcache(
            q, kcache, vcache, k_, v_, rotary_cos_, rotary_sin_, seqlens_k_, cache_batch_idx_,
            leftpad_k_, block_table_, softmax_scale, is_causal,
            (window_size_left, window_size_right), softcap, is_rotary_interleaved,
            alibi_slopes_, num_splits, return_softmax_lse=True)
        return [_write(out_, out, kind), lse]
