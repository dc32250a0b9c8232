"""Multi-head attention modules, as upstream's ``flash_attn.modules.mha``: ``MHA`` with the same
constructor, forward arguments, parameter names (so state dicts load unchanged) and inference
path, and the inner attention modules it is built from.

    mha = MHA(embed_dim=512, num_heads=8, num_heads_kv=2, causal=True, rotary_emb_dim=32,
              use_flash_attn=True, layer_idx=0)
    y = mha(x)                                              # x: (batch, seqlen, 512)

``use_flash_attn=False`` (upstream's default) computes attention with plain torch ops
(``SelfAttention`` / ``CrossAttention``); ``True`` uses flashattn's functions. Unlike upstream,
the flash path takes CPU tensors and fp32/fp64 as well as fp16/bf16.

Inference (``inference_params``, an ``InferenceParams`` from ``flashattn.utils.generation``):
the first call (``seqlen_offset == 0``, the prompt) writes the keys and values into the cache
and attends over them; later calls (decoding) append and attend in one
``flash_attn_with_kvcache`` call, which also applies the rotary embedding to q and the new
keys. Differences from upstream, all fixes: the decoding call passes the sliding window
(upstream drops it there), xPos rotary (``rotary_emb_scale_base``) decodes through the unfused
path instead of failing an assertion, and the dwconv layers follow ``device`` / ``dtype``.

``ParallelMHA`` (tensor parallel, needs upstream's fused dense ops) is not provided.
"""

import math
from functools import partial

import torch
import torch.nn as nn
import torch.utils.checkpoint

from ..flash_attn_interface import (
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from ..layers.rotary import RotaryEmbedding

__all__ = ["get_alibi_slopes", "FlashSelfAttention", "FlashCrossAttention", "SelfAttention",
           "CrossAttention", "MHA"]


def get_alibi_slopes(nheads):
    """The ALiBi paper's head slopes: a geometric sequence from 2^(-8/n) for a power of two n;
    otherwise those of the power of two below, then every other slope of the one above."""
    def power_of_2(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(nheads).is_integer():
        return power_of_2(nheads)
    below = 2 ** math.floor(math.log2(nheads))
    return power_of_2(below) + get_alibi_slopes(2 * below)[0::2][:nheads - below]


class FlashSelfAttention(nn.Module):
    """Softmax attention over a packed qkv with flashattn.

    softmax_scale: default 1/sqrt(headdim). attention_dropout: dropout probability in training.
    """

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0,
                 window_size=(-1, -1), alibi_slopes=None, deterministic=False):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        self.window_size = window_size
        self.deterministic = deterministic

    def forward(self, qkv, causal=None, cu_seqlens=None, max_seqlen=None):
        """qkv: (B, S, 3, H, D), or (total, 3, H, D) with cu_seqlens (int32 (B + 1,)) and
        max_seqlen (int). causal overrides self.causal. Returns (B, S, H, D) / (total, H, D)."""
        causal = self.causal if causal is None else causal
        if self.alibi_slopes is not None:
            self.alibi_slopes = self.alibi_slopes.to(torch.float32)
        common = dict(softmax_scale=self.softmax_scale, causal=causal,
                      alibi_slopes=self.alibi_slopes, window_size=self.window_size,
                      deterministic=self.deterministic)
        p = self.drop.p if self.training else 0.0
        if cu_seqlens is not None:
            assert cu_seqlens.dtype == torch.int32 and isinstance(max_seqlen, int)
            return flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, p, **common)
        return flash_attn_qkvpacked_func(qkv, p, **common)


class FlashCrossAttention(nn.Module):
    """Softmax attention of q over a packed kv with flashattn (GQA when kv has fewer heads)."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0,
                 alibi_slopes=None, window_size=(-1, -1), deterministic=False):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        self.window_size = window_size
        self.deterministic = deterministic

    def forward(self, q, kv, causal=None, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None,
                max_seqlen_k=None):
        """q: (B, Sq, H, D); kv: (B, Sk, 2, H_k, D); or the varlen forms (total, ...) with
        cu_seqlens / max_seqlen for q and cu_seqlens_k / max_seqlen_k for kv."""
        causal = self.causal if causal is None else causal
        if self.alibi_slopes is not None:
            self.alibi_slopes = self.alibi_slopes.to(torch.float32)
        common = dict(softmax_scale=self.softmax_scale, causal=causal,
                      alibi_slopes=self.alibi_slopes, window_size=self.window_size,
                      deterministic=self.deterministic)
        p = self.drop.p if self.training else 0.0
        if cu_seqlens is not None:
            assert cu_seqlens.dtype == torch.int32 and isinstance(max_seqlen, int)
            assert cu_seqlens_k is not None and cu_seqlens_k.dtype == torch.int32
            assert isinstance(max_seqlen_k, int)
            return flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens_k, max_seqlen,
                                                   max_seqlen_k, p, **common)
        assert kv.shape[0] == q.shape[0] and kv.shape[4] == q.shape[3]
        return flash_attn_kvpacked_func(q, kv, p, **common)


def _scores(q, k, scale, key_padding_mask):
    """Upstream's unfused scores: (B, H, Sq, Sk), with -10000 added at padded keys (so a row
    whose keys are all masked averages every value rather than giving zeros)."""
    scores = torch.einsum("bthd,bshd->bhts", q, k * scale)
    if key_padding_mask is not None:
        pad = torch.full(key_padding_mask.shape, -10000.0, dtype=scores.dtype,
                         device=scores.device)
        pad.masked_fill_(key_padding_mask, 0.0)
        scores = scores + pad[:, None, None, :]
    return scores


def _weighted_values(scores, v, drop):
    attention = drop(torch.softmax(scores, dim=-1, dtype=v.dtype))
    return torch.einsum("bhts,bshd->bthd", attention, v)


class SelfAttention(nn.Module):
    """Softmax attention over a packed qkv (B, S, 3, H, D) in plain torch."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, qkv, causal=None, key_padding_mask=None):
        """key_padding_mask: bool (B, S), True keeps a key."""
        causal = self.causal if causal is None else causal
        q, k, v = qkv.unbind(dim=2)
        scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = _scores(q, k, scale, key_padding_mask)
        if causal:
            seqlen = qkv.shape[1]
            upper = torch.full((seqlen, seqlen), -10000.0, device=scores.device).triu(1)
            scores = scores + upper.to(dtype=scores.dtype)
        return _weighted_values(scores, v, self.drop)


class CrossAttention(nn.Module):
    """Softmax attention of q (B, Sq, H, D) over kv (B, Sk, 2, H_k, D) in plain torch."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, q, kv, causal=None, key_padding_mask=None):
        """key_padding_mask: bool (B, Sk), True keeps a key."""
        causal = self.causal if causal is None else causal
        assert kv.shape[0] == q.shape[0] and kv.shape[4] == q.shape[3]
        if kv.shape[3] != q.shape[2]:  # GQA / MQA: each kv head serves a group of q heads
            kv = kv.repeat_interleave(q.shape[2] // kv.shape[3], dim=3)
        k, v = kv.unbind(dim=2)
        scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = _scores(q, k, scale, key_padding_mask)
        if causal:
            # Bottom-right aligned; with key padding, to each row's last valid key.
            sq, sk = q.shape[1], k.shape[1]
            rows = torch.arange(sq, device=q.device)[:, None]
            cols = torch.arange(sk, device=q.device)
            last = (sk if key_padding_mask is None
                    else key_padding_mask.sum(-1)[:, None, None, None])
            scores = scores.masked_fill(cols > rows + last - sq, -10000.0)
        return _weighted_values(scores, v, self.drop)


def _update_kv_cache(kv, inference_params, layer_idx):
    """Writes kv (B, S, 2, H_k, D) into the layer's cache at seqlen_offset (allocating the cache
    on first use) and returns the cache up to the end of what was written."""
    num_heads, head_dim = kv.shape[-2:]
    cache = inference_params.key_value_memory_dict.get(layer_idx)
    if cache is None:
        cache = torch.empty(inference_params.max_batch_size, inference_params.max_seqlen, 2,
                            num_heads, head_dim, dtype=kv.dtype, device=kv.device)
        inference_params.key_value_memory_dict[layer_idx] = cache
    b0 = inference_params.batch_size_offset
    b1 = b0 + kv.shape[0]
    s0 = inference_params.seqlen_offset
    s1 = s0 + kv.shape[1]
    assert b1 <= cache.shape[0] and s1 <= cache.shape[1], "kv cache too small"
    cache[b0:b1, s0:s1] = kv
    return cache[b0:b1, :s1]


class MHA(nn.Module):
    """Multi-head self-attention and cross-attention."""

    def __init__(
        self,
        embed_dim,
        num_heads,
        num_heads_kv=None,
        cross_attn=False,
        qkv_proj_bias=True,
        out_proj_bias=True,
        dropout=0.0,
        softmax_scale=None,
        causal=False,
        layer_idx=None,
        dwconv=False,
        rotary_emb_dim=0,
        rotary_emb_base=10000.0,
        rotary_emb_scale_base=None,
        rotary_emb_interleaved=False,
        use_alibi=False,
        window_size=(-1, -1),
        fused_bias_fc=False,
        use_flash_attn=False,
        return_residual=False,
        checkpointing=False,
        device=None,
        dtype=None,
    ) -> None:
        """
        num_heads_kv: fewer kv heads than num_heads gives MQA / GQA; None means num_heads.
        return_residual: also return the input x (for post-norm architectures).
        fused_bias_fc: accepted and ignored, as upstream.
        """
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.cross_attn = cross_attn
        self.causal = causal
        self.layer_idx = layer_idx
        self.dwconv = dwconv
        self.rotary_emb_dim = rotary_emb_dim
        self.use_flash_attn = use_flash_attn
        self.return_residual = return_residual
        self.checkpointing = checkpointing
        alibi_slopes = None
        if use_alibi:
            assert use_flash_attn, "ALiBi code path requires flash_attn"
            alibi_slopes = torch.tensor(get_alibi_slopes(num_heads), device=device)
        if window_size != (-1, -1):
            assert use_flash_attn, "Local (sliding window) attention code path requires flash_attn"

        self.num_heads = num_heads
        self.num_heads_kv = num_heads_kv if num_heads_kv is not None else num_heads
        assert self.num_heads % self.num_heads_kv == 0, \
            "num_heads must be divisible by num_heads_kv"
        assert self.embed_dim % num_heads == 0, "embed_dim must be divisible by num_heads"
        self.head_dim = self.embed_dim // num_heads
        qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        kv_dim = 2 * self.head_dim * self.num_heads_kv

        if self.rotary_emb_dim > 0:
            assert not cross_attn, "MHA with rotary embedding does not support cross-attention yet"
            self.rotary_emb = RotaryEmbedding(self.rotary_emb_dim, base=rotary_emb_base,
                                              scale_base=rotary_emb_scale_base,
                                              interleaved=rotary_emb_interleaved, device=device)

        if use_flash_attn:
            inner_attn_cls = partial(FlashSelfAttention, alibi_slopes=alibi_slopes,
                                     window_size=window_size)
            inner_cross_attn_cls = partial(FlashCrossAttention, alibi_slopes=alibi_slopes,
                                           window_size=window_size)
        else:
            inner_attn_cls, inner_cross_attn_cls = SelfAttention, CrossAttention
        if not self.cross_attn:
            self.Wqkv = nn.Linear(embed_dim, qkv_dim, bias=qkv_proj_bias, **factory_kwargs)
        else:
            self.Wq = nn.Linear(embed_dim, embed_dim, bias=qkv_proj_bias, **factory_kwargs)
            self.Wkv = nn.Linear(embed_dim, kv_dim, bias=qkv_proj_bias, **factory_kwargs)
        if self.dwconv:
            # Depthwise causal convolutions over the sequence (kernel 3, padded by 2 and
            # trimmed at the end); parameter names as upstream's, which creates them without
            # the device and dtype (so dwconv fails with dtype=...); here they follow them.
            conv = partial(nn.Conv1d, kernel_size=3, padding=2, **factory_kwargs)
            if self.num_heads_kv == self.num_heads:
                self.dwconv_qkv = conv(qkv_dim, qkv_dim, groups=qkv_dim)
            else:
                self.dwconv_q = conv(embed_dim, embed_dim, groups=embed_dim)
                self.dwconv_kv = conv(kv_dim, kv_dim, groups=kv_dim)
        self.inner_attn = inner_attn_cls(causal=causal, softmax_scale=softmax_scale,
                                         attention_dropout=dropout)
        self.inner_cross_attn = inner_cross_attn_cls(causal=causal, softmax_scale=softmax_scale,
                                                     attention_dropout=dropout)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_proj_bias, **factory_kwargs)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None):
        """An empty (batch_size, max_seqlen, 2, num_heads_kv, head_dim) kv cache."""
        dtype = self.out_proj.weight.dtype if dtype is None else dtype
        return torch.empty(batch_size, max_seqlen, 2, self.num_heads_kv, self.head_dim,
                           dtype=dtype, device=self.out_proj.weight.device)

    def _update_kv_cache(self, kv, inference_params):
        """kv: (batch_size, seqlen, 2, nheads, head_dim)"""
        assert not self.dwconv, "Generation does not support dwconv yet"
        assert self.layer_idx is not None, "Generation requires layer_idx in the constructor"
        return _update_kv_cache(kv, inference_params, self.layer_idx)

    def _cache_and_lengths(self, q, inference_params):
        cache = inference_params.key_value_memory_dict[self.layer_idx][:q.shape[0]]
        lengths = inference_params.lengths_per_sample
        seqlens = lengths[:q.shape[0]] if lengths is not None else inference_params.seqlen_offset
        return cache, seqlens

    def _kvcache_attention(self, q, kv, inference_params, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=False):
        """Appends kv to the cache and attends over it, in one flash_attn_with_kvcache call."""
        cache, seqlens = self._cache_and_lengths(q, inference_params)
        inner = self.inner_cross_attn
        return flash_attn_with_kvcache(
            q, cache[:, :, 0], cache[:, :, 1], kv[:, :, 0], kv[:, :, 1], rotary_cos=rotary_cos,
            rotary_sin=rotary_sin, cache_seqlens=seqlens, softmax_scale=inner.softmax_scale,
            causal=inner.causal, window_size=inner.window_size,
            rotary_interleaved=rotary_interleaved,
            alibi_slopes=getattr(inner, "alibi_slopes", None))

    def _apply_rotary_update_kvcache_attention(self, q, kv, inference_params):
        """Rotary on q and the new keys, cache update and attention, fused in one call.
        q: (batch_size, seqlen_q, nheads, head_dim); kv: (batch_size, seqlen_k, 2, nheads_kv,
        head_dim)."""
        assert inference_params is not None and inference_params.seqlen_offset > 0
        assert self.use_flash_attn
        cos = sin = None
        if self.rotary_emb_dim > 0:
            self.rotary_emb._update_cos_sin_cache(inference_params.max_seqlen, device=q.device,
                                                  dtype=q.dtype)
            cos, sin = self.rotary_emb._cos_cached, self.rotary_emb._sin_cached
        interleaved = self.rotary_emb.interleaved if self.rotary_emb_dim > 0 else False
        return self._kvcache_attention(q, kv, inference_params, cos, sin, interleaved)

    def _update_kvcache_attention(self, q, kv, inference_params):
        """Write kv to inference_params, then do attention."""
        if inference_params.seqlen_offset == 0 or not self.use_flash_attn:
            # As upstream, this branch places kv at seqlen_offset for the whole batch (it does
            # not read lengths_per_sample).
            kv = self._update_kv_cache(kv, inference_params)
            return self.inner_cross_attn(q, kv)
        return self._kvcache_attention(q, kv, inference_params)

    def _fused_decode(self, inference_params):
        """Whether this call decodes through flash_attn_with_kvcache with the rotary applied
        inside it (xPos scales q and k differently, which the kernel cannot)."""
        return (inference_params is not None and inference_params.seqlen_offset > 0
                and self.use_flash_attn and self.rotary_emb_dim > 0
                and self.rotary_emb.scale is None)

    def _attend(self, q, kv, qkv, inference_params, seqlen_offset, rotary_max_seqlen, kwargs):
        """Rotary, then attention: over the packed qkv when given (self-attention with as many
        kv heads as q heads), else over q and kv."""
        if self._fused_decode(inference_params):
            if qkv is not None:
                q, kv = qkv[:, :, 0], qkv[:, :, 1:]
            return self._apply_rotary_update_kvcache_attention(q, kv, inference_params)
        if self.rotary_emb_dim > 0:
            if qkv is not None:
                qkv = self.rotary_emb(qkv, seqlen_offset=seqlen_offset,
                                      max_seqlen=rotary_max_seqlen)
            else:
                q, kv = self.rotary_emb(q, kv, seqlen_offset=seqlen_offset,
                                        max_seqlen=rotary_max_seqlen)
        if inference_params is not None:
            if qkv is not None:
                q, kv = qkv[:, :, 0], qkv[:, :, 1:]
            return self._update_kvcache_attention(q, kv, inference_params)
        inner, args = ((self.inner_attn, (qkv,)) if qkv is not None
                       else (self.inner_cross_attn, (q, kv)))
        if self.checkpointing:
            return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)

    def _dwconv(self, conv, x):
        """Depthwise conv over the sequence of x (B, S, C), keeping the first S outputs."""
        return conv(x.transpose(1, 2))[..., :-2].transpose(1, 2).contiguous()

    def forward(self, x, x_kv=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None,
                mixer_subset=None, inference_params=None, **kwargs):
        """
        Arguments:
            x: (batch, seqlen, hidden_dim) (hidden_dim = num heads * head dim), or
                (total, hidden_dim) with cu_seqlens / max_seqlen (the varlen form).
            x_kv: (batch, seqlen, hidden_dim), for cross-attention only; None uses x.
            key_padding_mask: bool (batch, seqlen), True keeps; only without flash attention.
            cu_seqlens: (batch_size + 1,), int32; max_seqlen: int (flash attention only).
            mixer_subset: cross-attention only: the positions of x to compute queries for.
            inference_params: for generation (flashattn.utils.generation.InferenceParams).
        """
        if cu_seqlens is not None:
            assert max_seqlen is not None and key_padding_mask is None
            assert self.use_flash_attn and not self.dwconv and self.rotary_emb_dim == 0
        if key_padding_mask is not None:
            assert cu_seqlens is None and max_seqlen is None and not self.use_flash_attn
        if inference_params is not None:
            assert key_padding_mask is None and cu_seqlens is None and max_seqlen is None
            assert not self.dwconv
        if self.use_flash_attn:
            kwargs = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, **kwargs}
        else:
            kwargs = {"key_padding_mask": key_padding_mask, **kwargs}
        seqlen_offset = 0
        rotary_max_seqlen = None
        if inference_params is not None:
            lengths = inference_params.lengths_per_sample
            seqlen_offset = lengths if lengths is not None else inference_params.seqlen_offset
            rotary_max_seqlen = inference_params.max_seqlen

        d = self.head_dim
        q = kv = qkv = None
        if not self.cross_attn and self.num_heads_kv == self.num_heads:
            assert x_kv is None and mixer_subset is None
            qkv = self.Wqkv(x)
            if self.dwconv:
                qkv = self._dwconv(self.dwconv_qkv, qkv)
            qkv = qkv.unflatten(-1, (3, self.num_heads, d))
        else:
            if self.cross_attn:
                q = self.Wq(x if mixer_subset is None else x[:, mixer_subset])
                kv = self.Wkv(x_kv if x_kv is not None else x)
            else:
                qkv_flat = self.Wqkv(x)
                q = qkv_flat[..., :self.num_heads * d]
                kv = qkv_flat[..., self.num_heads * d:]
            if self.dwconv:
                q = self._dwconv(self.dwconv_q, q)
                kv = self._dwconv(self.dwconv_kv, kv)
            q = q.unflatten(-1, (self.num_heads, d))
            kv = kv.unflatten(-1, (2, self.num_heads_kv, d))
        context = self._attend(q, kv, qkv, inference_params, seqlen_offset, rotary_max_seqlen,
                               kwargs)
        out = self.out_proj(context.flatten(-2))
        return out if not self.return_residual else (out, x)
