"""Rotary position embeddings, as upstream's ``flash_attn.layers.rotary``: the same functions,
signatures and semantics, written in plain torch (upstream runs a Triton kernel).

Conventions (upstream's):
- ``cos``, ``sin``: (seqlen_ro, rotary_dim / 2); the first ``rotary_dim`` features of each head
  are rotated, the rest pass through unchanged.
- Non-interleaved (GPT-NeoX) rotates the pairs (i, i + rotary_dim / 2); interleaved (GPT-J) the
  pairs (2i, 2i + 1): x' = x cos - y sin, y' = x sin + y cos.
- Token t of sequence b sits at position t + seqlen_offsets (an int, or a (batch,) tensor for
  sequences at different offsets, as in decoding with a KV cache). A position past the end of
  the tables is left unrotated (cos 1, sin 0), as upstream's kernel does.
- The rotation is computed in fp32 (fp64 for fp64 inputs, where upstream drops to fp32) and
  rounded to x's dtype.

Gradients flow through ordinary torch ops, in place or not (the in-place forms write through
``copy_``, which autograd tracks), so the functions also trace under ``torch.compile``.
"""

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "rotate_half",
    "apply_rotary_emb_torch",
    "apply_rotary_emb",
    "apply_rotary_emb_func",
    "apply_rotary_emb_qkv_",
    "apply_rotary_emb_kv_",
    "RotaryEmbedding",
]


def rotate_half(x, interleaved=False):
    """(x, y) -> (-y, x) over the rotation pairs."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_emb_torch(x, cos, sin, interleaved=False):
    """Upstream's reference formula, positions 0..seqlen-1 (no offsets).

    x: (batch_size, seqlen, nheads, headdim); cos, sin: (seqlen, rotary_dim / 2) or
    (batch_size, seqlen, rotary_dim / 2).
    """
    ro_dim = cos.shape[-1] * 2
    assert ro_dim <= x.shape[-1]
    cos, sin = (_expand_table(t, interleaved).unsqueeze(-2) for t in (cos, sin))
    rotated = x[..., :ro_dim] * cos + rotate_half(x[..., :ro_dim], interleaved) * sin
    return torch.cat([rotated, x[..., ro_dim:]], dim=-1)


def _expand_table(t, interleaved):
    """(..., rotary_dim / 2) -> (..., rotary_dim), each angle repeated for both members of its
    pair in the layout of ``interleaved``."""
    if interleaved:
        return t.repeat_interleave(2, dim=-1)
    return torch.cat((t, t), dim=-1)


def _positions(x, seqlen_offsets, cu_seqlens, max_seqlen, seqlen_ro):
    """Integer positions with x's token layout: (batch, seqlen) dense, (total,) varlen."""
    device = x.device
    if cu_seqlens is None:
        batch, seqlen = x.shape[0], x.shape[1]
        assert seqlen_ro >= seqlen, "seqlen_ro must be >= seqlen"
        pos = torch.arange(seqlen, device=device).expand(batch, seqlen)
        if isinstance(seqlen_offsets, Tensor):
            assert tuple(seqlen_offsets.shape) == (batch,), "seqlen_offsets must be (batch,)"
            return pos + seqlen_offsets.to(device=device, dtype=torch.int64)[:, None]
        assert seqlen_offsets + seqlen <= seqlen_ro, "seqlen_offsets + seqlen > seqlen_ro"
        return pos + seqlen_offsets
    assert max_seqlen is not None, "If cu_seqlens is passed in, then max_seqlen must be passed"
    assert seqlen_ro >= max_seqlen, "seqlen_ro must be >= max_seqlen"
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    total = x.shape[0]
    rows = torch.arange(total, device=device)
    # Sequence of each row; rows outside [cu_seqlens[0], cu_seqlens[-1]) belong to no sequence
    # and stay as they are (upstream's kernel does not visit them).
    seq = torch.searchsorted(cu[1:], rows, right=True).clamp(max=cu.shape[0] - 2)
    pos = rows - cu[seq]
    if isinstance(seqlen_offsets, Tensor):
        pos = pos + seqlen_offsets.to(device=device, dtype=torch.int64)[seq]
    else:
        pos = pos + seqlen_offsets
    inside = (rows >= cu[0]) & (rows < cu[-1])
    return torch.where(inside, pos, torch.full_like(pos, seqlen_ro))


def _rotated(x, cos, sin, interleaved, conjugate, pos):
    """The first rotary_dim features of x rotated by the angles at ``pos`` (computed in fp32, or
    fp64 for fp64 x; returned in x's dtype); rows whose position is past the tables are
    unchanged."""
    seqlen_ro, half = cos.shape
    rd = 2 * half
    compute = torch.promote_types(x.dtype, torch.float32)
    inside = (pos >= 0) & (pos < seqlen_ro)
    idx = torch.where(inside, pos, torch.zeros_like(pos))
    c = torch.where(inside[..., None], cos.to(compute)[idx], torch.ones((), device=x.device))
    s = torch.where(inside[..., None], sin.to(compute)[idx], torch.zeros((), device=x.device))
    if conjugate:
        s = -s
    # One row of angles per token, broadcast over heads.
    c, s = _expand_table(c, interleaved).unsqueeze(-2), _expand_table(s, interleaved).unsqueeze(-2)
    xr = x[..., :rd].to(compute)
    return (xr * c + rotate_half(xr, interleaved) * s).to(x.dtype)


def _apply(x, cos, sin, interleaved=False, inplace=False, conjugate=False, seqlen_offsets=0,
           cu_seqlens=None, max_seqlen=None):
    assert sin.shape == cos.shape, "cos and sin must have the same shape"
    rd = 2 * cos.shape[1]
    assert rd <= x.shape[-1], "rotary_dim must be <= headdim"
    pos = _positions(x, seqlen_offsets, cu_seqlens, max_seqlen, cos.shape[0])
    rot = _rotated(x, cos, sin, interleaved, conjugate, pos)
    if inplace:
        x[..., :rd].copy_(rot)
        return x
    if rd == x.shape[-1]:
        return rot
    return torch.cat([rot, x[..., rd:]], dim=-1)


def apply_rotary_emb(
    x,
    cos,
    sin,
    interleaved=False,
    inplace=False,
    seqlen_offsets: Union[int, Tensor] = 0,
    cu_seqlens: Optional[Tensor] = None,
    max_seqlen: Optional[int] = None,
):
    """
    Arguments:
        x: (batch_size, seqlen, nheads, headdim) if cu_seqlens is None
            else (total_seqlen, nheads, headdim)
        cos, sin: (seqlen_rotary, rotary_dim / 2)
        interleaved: if True, rotate pairs of even and odd dimensions (GPT-J style) instead
            of 1st half and 2nd half (GPT-NeoX style).
        inplace: if True, apply rotary embedding in-place.
        seqlen_offsets: (batch_size,) or int. Each sequence in x is shifted by this amount.
        cu_seqlens: (batch + 1,) or None
        max_seqlen: int
    Return:
        out: x's shape. rotary_dim must be <= headdim; the first rotary_dim features rotate.
    """
    return _apply(x, cos, sin, interleaved, inplace, False, seqlen_offsets, cu_seqlens,
                  max_seqlen)


# Upstream keeps this name for backward compatibility.
apply_rotary_emb_func = apply_rotary_emb


def _split_qk(qkv, num_heads_q):
    """Views of q and k inside a packed qkv."""
    if qkv.dim() == 5:
        assert qkv.shape[2] == 3, "qkv must be (batch, seqlen, 3, nheads, headdim)"
        return qkv[:, :, 0], qkv[:, :, 1]
    assert qkv.dim() == 4, "qkv must be 5-D, or 4-D with num_heads_q"
    assert num_heads_q is not None, "num_heads_q is required for a 4-D qkv"
    num_heads_k = (qkv.shape[2] - num_heads_q) // 2
    assert qkv.shape[2] == num_heads_q + 2 * num_heads_k, "qkv heads must be hq + 2 * hk"
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + num_heads_k]


def apply_rotary_emb_qkv_(
    qkv,
    cos,
    sin,
    cos_k=None,
    sin_k=None,
    interleaved=False,
    seqlen_offsets: Union[int, Tensor] = 0,
    num_heads_q: Optional[int] = None,
):
    """
    Arguments:
        qkv: (batch_size, seqlen, 3, nheads, headdim) or
            (batch_size, seqlen, num_heads_q + 2 * num_heads_k, headdim); the 4-D (GQA) form
            needs num_heads_q.
        cos, sin: (seqlen, rotary_dim / 2), for q (and k unless cos_k / sin_k are given).
        cos_k, sin_k: (seqlen, rotary_dim / 2), optional, for k (xPos scales q and k apart).
        interleaved: GPT-J style pairs instead of GPT-NeoX halves.
        seqlen_offsets: (batch_size,) or int.
    Return:
        qkv, rotated *in place* in its q and k parts.
    """
    q, k = _split_qk(qkv, num_heads_q)
    cos_k = cos if cos_k is None else cos_k
    sin_k = sin if sin_k is None else sin_k
    _apply(q, cos, sin, interleaved, True, seqlen_offsets=seqlen_offsets)
    _apply(k, cos_k, sin_k, interleaved, True, seqlen_offsets=seqlen_offsets)
    return qkv


def apply_rotary_emb_kv_(
    kv,
    cos,
    sin,
    interleaved=False,
    seqlen_offsets: Union[int, Tensor] = 0,
):
    """
    Arguments:
        kv: (batch_size, seqlen, 2, nheads, headdim)
        cos, sin: (seqlen, rotary_dim / 2)
        interleaved: GPT-J style pairs instead of GPT-NeoX halves.
        seqlen_offsets: (batch_size,) or int.
    Return:
        kv, with k rotated *in place*.
    """
    assert kv.dim() == 5 and kv.shape[2] == 2, "kv must be (batch, seqlen, 2, nheads, headdim)"
    _apply(kv[:, :, 0], cos, sin, interleaved, True, seqlen_offsets=seqlen_offsets)
    return kv


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embeddings (RoFormer, Su et al.), with upstream's interface.

    If scale_base is not None this is XPos (Sun et al., https://arxiv.org/abs/2212.10554): q is
    scaled up and k down by a per-position factor; 512 is the recommended scale_base.
    """

    def __init__(self, dim: int, base=10000.0, interleaved=False, scale_base=None, device=None):
        """
        dim: rotary_dim, the number of features rotated in each head.
        interleaved: if True, rotate pairs of even and odd dimensions (GPT-J style) instead
            of 1st half and 2nd half (GPT-NeoX style).
        """
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        self.interleaved = interleaved
        self.scale_base = scale_base
        scale = None
        if scale_base is not None:
            scale = ((torch.arange(0, dim, 2, device=device, dtype=torch.float32) + 0.4 * dim)
                     / (1.4 * dim))
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None
        self._cos_k_cached = None
        self._sin_k_cached = None

    def _compute_inv_freq(self, device=None):
        exponents = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim
        return 1.0 / (self.base ** exponents)

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        """Rebuild the tables when they are too short, on another device or dtype, or were
        made in inference mode and are now needed for training."""
        if not (seqlen > self._seq_len_cached or self._cos_cached is None
                or self._cos_cached.device != device or self._cos_cached.dtype != dtype
                or (self.training and self._cos_cached.is_inference())):
            return
        self._seq_len_cached = seqlen
        # Angles in fp32 even for bf16/fp16 models: positions times frequencies are large and
        # would lose most of their precision in 16 bits.
        t = torch.arange(seqlen, device=device, dtype=torch.float32)
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:  # the module was cast; recompute in fp32
            inv_freq = self._compute_inv_freq(device=device)
        freqs = torch.outer(t, inv_freq)
        if self.scale is None:
            self._cos_cached = torch.cos(freqs).to(dtype)
            self._sin_cached = torch.sin(freqs).to(dtype)
            return
        power = (torch.arange(seqlen, dtype=self.scale.dtype, device=self.scale.device)
                 - seqlen // 2) / self.scale_base
        scale = self.scale.to(device=power.device) ** power[:, None]
        self._cos_cached = (torch.cos(freqs) * scale).to(dtype)
        self._sin_cached = (torch.sin(freqs) * scale).to(dtype)
        self._cos_k_cached = (torch.cos(freqs) / scale).to(dtype)
        self._sin_k_cached = (torch.sin(freqs) / scale).to(dtype)

    def forward(
        self,
        qkv: Tensor,
        kv: Optional[Tensor] = None,
        seqlen_offset: Union[int, Tensor] = 0,
        max_seqlen: Optional[int] = None,
        num_heads_q: Optional[int] = None,
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """
        qkv: (batch, seqlen, 3, nheads, headdim) or (batch, seqlen, num_heads_q + 2 * num_heads_k,
            headdim) if kv is None (the 4-D form needs num_heads_q), else q of shape
            (batch, seqlen, nheads, headdim).
        kv: (batch, seqlen, 2, nheads, headdim)
        seqlen_offset: (batch_size,) or int, the position of each sequence's first token. With
            a tensor, pass max_seqlen so that the tables cover every position.
        Rotates *in place*; returns qkv, or (q, kv).
        """
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device,
                                       dtype=qkv.dtype)
        xpos = self.scale is not None
        if kv is None:
            return apply_rotary_emb_qkv_(
                qkv, self._cos_cached, self._sin_cached,
                self._cos_k_cached if xpos else None, self._sin_k_cached if xpos else None,
                interleaved=self.interleaved, seqlen_offsets=seqlen_offset,
                num_heads_q=num_heads_q)
        q = apply_rotary_emb_func(qkv, self._cos_cached, self._sin_cached,
                                  interleaved=self.interleaved, inplace=True,
                                  seqlen_offsets=seqlen_offset)
        kv = apply_rotary_emb_kv_(kv, self._cos_k_cached if xpos else self._cos_cached,
                                  self._sin_k_cached if xpos else self._sin_cached,
                                  interleaved=self.interleaved, seqlen_offsets=seqlen_offset)
        return q, kv
