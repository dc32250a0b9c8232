"""``flash_attn_with_kvcache`` for CUDA tensors, composed of torch ops and the varlen forward.

The C library's KV-cache entry point runs on the CPU only; on a GPU the same call is three
steps, none of which reads a device value on the host (so it captures into CUDA graphs):
1. Rotary (when rotary_cos / rotary_sin are given) on q and on the new k, at the positions
   upstream uses (``flashattn.layers.rotary``).
2. The new k and v written into the caches in place at cache_seqlens (``index_put_``), after a
   device-side check that they fit (``torch._assert_async``: an error, not an out-of-bounds
   write).
3. The attention as a varlen forward over the caches seen as packed sequences of seqlen_cache
   rows each, seqused_k = cache_seqlens + seqlen_new: q rows of sequence b are
   [b * seqlen, (b + 1) * seqlen), its keys [b * seqlen_cache, ...) up to seqused_k, so causal
   and local masks align to the end of the used keys, as upstream's.
Paged caches (block_table), cache_batch_idx and cache_leftpad are refused on CUDA, by name.
num_splits has no effect (the result does not depend on it). Written device-neutral: the CPU
tests run it against the C library's own KV-cache call.
"""

import torch

from ._lib import FlashAttnError
from .layers.rotary import apply_rotary_emb

__all__ = ["kvcache_varlen"]


def _refuse(x, name, why):
    if x is not None:
        raise FlashAttnError("%s: not supported with CUDA tensors yet (%s); use CPU tensors "
                             "for it" % (name, why))


def _packed(cache, name):
    """(b_c, s_c, hk, d) -> (b_c * s_c, hk, d), a view of the same memory."""
    if cache.dim() != 4:
        raise FlashAttnError("%s: expected 4 dimensions (batch, seqlen_cache, nheads_k, "
                             "headdim), got shape %s" % (name, tuple(cache.shape)))
    if cache.shape[-1] > 1 and cache.stride(-1) != 1:
        raise FlashAttnError("%s: the last dimension must be contiguous (stride 1); the cache "
                             "is used in place, so it is not copied" % name)
    if cache.shape[0] > 1 and cache.stride(0) != cache.shape[1] * cache.stride(1):
        raise FlashAttnError("%s: on CUDA the batch rows of the cache must follow each other "
                             "(stride(0) == seqlen_cache * stride(1)), got strides %s"
                             % (name, tuple(cache.stride())))
    return cache.view(cache.shape[0] * cache.shape[1], cache.shape[2], cache.shape[3])


def kvcache_varlen(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                   cache_batch_idx, cache_leftpad, block_table, alibi_slopes, learnable_sink,
                   softmax_scale, causal, window_left, window_right, softcap,
                   rotary_interleaved, num_splits):
    """flashattn::kvcache's arguments (cache_seqlens an int32 tensor or None); (out, lse)."""
    _refuse(block_table, "block_table", "paged caches")
    _refuse(cache_batch_idx, "cache_batch_idx", "the cache rows must be the batch's")
    _refuse(cache_leftpad, "cache_leftpad", "the keys must start at position 0")
    if q.dim() != 4:
        raise FlashAttnError("q: expected 4 dimensions (batch_size, seqlen, nheads, headdim), "
                             "got shape %s" % (tuple(q.shape),))
    b, sq, h = q.shape[0], q.shape[1], q.shape[2]
    kc, vc = _packed(k_cache, "k_cache"), _packed(v_cache, "v_cache")
    s_c = k_cache.shape[1]
    if k_cache.shape[0] != b:
        raise FlashAttnError("k_cache: dimension 0 (batch) must be %d, as q's, got %d"
                             % (b, k_cache.shape[0]))
    if (k is None) != (v is None):
        raise FlashAttnError("%s: k and v are given together or not at all"
                             % ("v" if k is not None else "k"))
    s_new = 0 if k is None else k.shape[1]
    for x, cache, name in ((k, k_cache, "k"), (v, v_cache, "v")):
        if x is not None and (x.dim() != 4 or x.shape[0] != b or x.shape[2:] != cache.shape[2:]
                              or x.dtype != cache.dtype or x.shape[1] != s_new):
            raise FlashAttnError("%s: expected %s of shape (%d, seqlen_new, %s), as the cache, "
                                 "got %s %s" % (name, cache.dtype, b,
                                                ", ".join(str(n) for n in cache.shape[2:]),
                                                x.dtype, tuple(x.shape)))
    if s_new > 0 and cache_seqlens is None:
        raise FlashAttnError("cache_seqlens: required when k and v are appended")
    if cache_seqlens is None:
        cache_seqlens = torch.full((b,), s_c, dtype=torch.int32, device=q.device)
    elif cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (b,):
        raise FlashAttnError("cache_seqlens: expected int32 of shape (%d,), got %s %s"
                             % (b, cache_seqlens.dtype, tuple(cache_seqlens.shape)))
    seqlens = cache_seqlens.long()
    torch._assert_async(((seqlens >= 0) & (seqlens + s_new <= s_c)).all(),
                        "flash_attn_with_kvcache: cache_seqlens + seqlen_new must lie in "
                        "[0, seqlen_cache]")

    if rotary_cos is not None:
        # Per-row positions when causal or local (a window side below the capacity), as the
        # C library's KV-cache call rotates.
        local = causal or 0 <= window_left < s_c or 0 <= window_right < s_c
        if local:
            q = apply_rotary_emb(q, rotary_cos, rotary_sin, rotary_interleaved,
                                 seqlen_offsets=cache_seqlens)
        else:
            # Every query row at position cache_seqlens: rows of one token each.
            q = apply_rotary_emb(q.reshape(b * sq, 1, h, q.shape[3]), rotary_cos, rotary_sin,
                                 rotary_interleaved,
                                 seqlen_offsets=cache_seqlens.repeat_interleave(sq)
                                 ).reshape(q.shape)
        if s_new > 0:
            k = apply_rotary_emb(k, rotary_cos, rotary_sin, rotary_interleaved,
                                 seqlen_offsets=cache_seqlens)
    if s_new > 0:
        rows = (torch.arange(b, device=q.device) * s_c)[:, None] + seqlens[:, None] + \
            torch.arange(s_new, device=q.device)[None, :]
        kc.index_put_((rows.reshape(-1),), k.reshape(b * s_new, *k.shape[2:]))
        vc.index_put_((rows.reshape(-1),), v.reshape(b * s_new, *v.shape[2:]))

    from . import _torch_ops  # noqa: F401  (registers torch.ops.flashattn)

    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (b + 1) * s_c, s_c, dtype=torch.int32, device=q.device)
    used = (cache_seqlens + s_new).to(torch.int32)
    out, lse, _, _ = torch.ops.flashattn.varlen_fwd(
        q.reshape(b * sq, h, q.shape[3]), kc, vc, cu_q, cu_k, used, alibi_slopes,
        learnable_sink, None, sq, s_c, 0.0, softmax_scale, bool(causal), window_left,
        window_right, softcap, False, False)
    out = out.view(b, sq, h, out.shape[-1])
    lse = lse.view(h, b, sq).permute(1, 0, 2).contiguous()
    return out, lse
