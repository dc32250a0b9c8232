"""``flash_attn_with_kvcache`` for CUDA tensors, composed of torch ops and the varlen forward.

The C library's KV-cache entry point runs on the CPU only; on a GPU the same call is three
steps, none of which reads a device value on the host (so it captures into CUDA graphs):
1. Rotary (when rotary_cos / rotary_sin are given) on q and on the new k, at the positions
   upstream uses (``flashattn.layers.rotary``).
2. The new k and v written into the caches in place (``index_put_``) at the cache rows of
   positions cache_seqlens + i, after device-side checks that every row lies in the cache
   (``torch._assert_async``: an error, not a write out of it).
3. The attention as a varlen forward with seqused_k = cache_seqlens + seqlen_new - leftpad, q
   rows of sequence b at [b * seqlen, (b + 1) * seqlen), so causal and local masks align to the
   end of the used keys, as upstream's. The keys are read where they are (the caches seen as
   packed sequences of seqlen_cache rows) when each sequence's rows are its own batch row from
   position 0; with a block_table (paged), cache_batch_idx or cache_leftpad they are first
   gathered into a [batch, capacity] copy, in position order.
Cache position p of sequence b lives at packed row block_table[b, p // page] * page + p % page
(paged), else cache_batch_idx[b] * seqlen_cache + p.
Split-KV: where a row's keys need no position of their own (one query row, or no causal mask,
and no window, ALiBi or sinks) the keys may be cut into num_splits chunks, each its own varlen
sequence with the g query heads of a kv head packed as its rows, merged by a softmax over the
chunks' lse (the partial outputs rounded to the dtype on the way: a half-ulp more error than
upstream's fp32 partials). num_splits 1 never splits; 0 splits into 8 where the unsplit
kernel would take longer than the split path's extra host work (_auto_splits). Written
device-neutral: the CPU tests run it against the reference.
"""

import torch

from . import _cached
from ._lib import FlashAttnError
from ._paged import page_rows
from .layers.rotary import apply_rotary_emb

__all__ = ["kvcache_varlen"]

# The C argument names of the varlen call as the KV-cache call's caller knows them.
_NAMES = {"k": "k_cache", "v": "v_cache", "seqused_k": "cache_seqlens"}


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


def _rows(pos, b, s_c, page, block_table, cache_batch_idx):
    """Packed cache rows of cache positions pos ([b, n] long)."""
    if block_table is not None:
        return page_rows(block_table, pos, page)
    if cache_batch_idx is not None:
        return cache_batch_idx.long()[:, None] * s_c + pos
    return torch.arange(b, device=pos.device)[:, None] * s_c + pos


# The model behind num_splits 0 (measured on an H200, bf16, d 128): an unsplit CTA spends
# ~0.36 ms on 32k keys (one 128-row query tile's products per key block whatever the rows in
# use), the CTAs run in waves of one per SM, and the split path costs ~0.2 ms more host time
# (its merge is torch ops). 8 chunks: the count that was fastest there.
_MS_PER_KEY = 0.36 / 32768
_SPLIT_HOST_MS = 0.2
_AUTO_SPLITS = 8
_SMS = {}  # device index -> multiprocessor count


def _auto_splits(b, sq, h, cap, sms):
    """num_splits 0: _AUTO_SPLITS where the unsplit call's estimated kernel time (b h query
    tiles of 128 rows, each over cap keys, in waves of sms) exceeds the split path's extra host
    time, else 1."""
    waves = -(-(b * h * -(-sq // 128)) // sms)
    return _AUTO_SPLITS if waves * cap * _MS_PER_KEY > _SPLIT_HOST_MS else 1


def _sm_count(device):
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device.index]


def _splits(num_splits, q, cap, causal, window_left, window_right, alibi_slopes,
            learnable_sink):
    """How many chunks to cut each sequence's keys into (1: none)."""
    if (causal and q.shape[1] > 1) or window_left >= 0 or window_right >= 0 or \
            alibi_slopes is not None or learnable_sink is not None or cap < 2:
        return 1
    if num_splits == 0 and q.is_cuda:
        num_splits = _auto_splits(q.shape[0], q.shape[1], q.shape[2], cap, _sm_count(q.device))
    return min(max(num_splits, 1), cap)


def _int32(x, name, b):
    if x is not None and (x.dtype != torch.int32 or tuple(x.shape) != (b,)):
        raise FlashAttnError("%s: expected int32 of shape (%d,), got %s %s"
                             % (name, b, x.dtype, tuple(x.shape)))
    return x


_INDEX = {}  # (kind, shapes..., device) -> index tensors


def _index(key, make):
    """make()'s index tensors, made once per key (its shapes and device, last): a decoding loop
    calls with the same few shapes, and CUDA graph replays read the same tensors. Made during a
    CUDA graph capture they hold nothing until a replay, so they are not kept then."""
    idx = _INDEX.get(key)
    if idx is None:
        idx = make()
        if key[-1].type != "cuda" or not torch.cuda.is_current_stream_capturing():
            if len(_INDEX) >= 64:
                _INDEX.clear()
            _INDEX[key] = idx
    return idx


def _plain_index(b, sq, cap, s_new, device):
    """The index tensors of a plain cache (each sequence its own batch row from position 0):
    cu_seqlens_q and cu_seqlens_k (int32 [b + 1]: q's rows and the cache rows as packed
    sequences) and the appended keys' row offsets (int64 [b, s_new]: b * cap + i, to which
    cache_seqlens is added)."""
    return _index(("plain", b, sq, cap, s_new, device), lambda: (
        torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=device),
        torch.arange(0, (b + 1) * cap, cap, dtype=torch.int32, device=device),
        torch.arange(b, device=device)[:, None] * cap +
        torch.arange(s_new, device=device)[None, :]))


def _attend(q, kc, vc, used, cap, alibi_slopes, learnable_sink, softmax_scale, causal,
            window_left, window_right, softcap, want_lse):
    """The attention without splits: the varlen forward over the caches (kc, vc: [b * cap, hk,
    d], sequence i at rows [i * cap, (i + 1) * cap), used[i] of them), through the library call
    cached per signature."""
    b, sq, h, d = q.shape
    cu_q, cu_k, _ = _plain_index(b, sq, cap, 0, q.device)
    sinks = learnable_sink
    if sinks is not None and sinks.dtype != torch.float32:
        sinks = sinks.float()
    out, lse = _cached.forward_varlen_torch(
        q.reshape(b * sq, h, d), kc, vc, cu_q, cu_k, used, sq, cap,
        None if softmax_scale is None else float(softmax_scale), bool(causal),
        (int(window_left), int(window_right)), float(softcap), alibi_slopes, sinks, want_lse,
        _NAMES)
    out = out.view(b, sq, h, out.shape[-1])
    if lse is not None:
        lse = lse.view(h, b, sq).permute(1, 0, 2).contiguous()
    return out, lse


def _split_index(b, rows, cap, n, span, device):
    """The index tensors of n key chunks of span keys per sequence: cu_seqlens_q (int32
    [b n + 1], ``rows`` packed query rows per chunk), cu_seqlens_k (int32 [b n + 1]: chunk c of
    sequence i starts at row i cap + c span; the last one ends at (i + 1) cap) and the chunks'
    first keys (int32 [1, n])."""
    def make():
        first = torch.arange(n, device=device, dtype=torch.int32)[None, :] * span
        starts = torch.arange(b, device=device, dtype=torch.int32)[:, None] * cap + first
        return (torch.arange(0, (b * n + 1) * rows, rows, dtype=torch.int32, device=device),
                torch.cat([starts.reshape(-1),
                           torch.full((1,), b * cap, dtype=torch.int32, device=device)]),
                first)

    return _index(("split", b, rows, cap, n, span, device), make)


def _attend_split(q, kc, vc, used, cap, n, softmax_scale, softcap, want_lse):
    """The attention of rows whose keys need no position of their own (_splits), the keys cut
    into chunks of span keys, one varlen sequence each, merged by their lse (a softmax over the
    chunks). The g query heads of a kv head are packed as rows of one sequence, so each chunk's
    keys are read by one CTA for all of them: chunk (i, c) holds rows (query row s, head
    kvh g + e) as row s g + e of kv head kvh. Without a mask every row may sit in any order."""
    b, sq, h, d = q.shape
    hk, dv = kc.shape[1], vc.shape[2]
    g, rows = h // hk, sq * (h // hk)
    span = -(-cap // n)
    n = -(-cap // span)  # no chunk past the capacity
    cu_q, cu_k, first = _split_index(b, rows, cap, n, span, q.device)
    qp = q.reshape(b, 1, sq, hk, g, d).transpose(3, 4).expand(b, n, sq, g, hk, d)
    used_k = (used[:, None] - first).clamp_(0, span).view(-1)
    out_p, lse_p = _cached.forward_varlen_torch(
        qp.reshape(b * n * rows, hk, d), kc, vc, cu_q, cu_k, used_k, rows, span,
        None if softmax_scale is None else float(softmax_scale), False, (-1, -1),
        float(softcap), want_lse=True, names=_NAMES)
    # A chunk row without keys has lse +inf (the forward's convention): it weighs nothing; a
    # row of no keys at all (every weight NaN) gets out 0 and lse +inf.
    lse_p = lse_p.view(hk, b, n, sq, g).nan_to_num(posinf=float("-inf"))
    w = torch.softmax(lse_p, dim=2).nan_to_num_(0.0).permute(1, 2, 3, 4, 0).unsqueeze(-1)
    merged = (out_p.view(b, n, sq, g, hk, dv) * w).sum(1)
    out = torch.empty((b, sq, h, dv), dtype=q.dtype, device=q.device)
    out.view(b, sq, hk, g, dv).copy_(merged.transpose(2, 3))
    if not want_lse:
        return out, None
    lse = torch.logsumexp(lse_p, dim=2).nan_to_num(neginf=float("inf"))
    return out, lse.permute(1, 0, 3, 2).reshape(b, h, sq)


def kvcache_varlen(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                   cache_batch_idx, cache_leftpad, block_table, alibi_slopes, learnable_sink,
                   softmax_scale, causal, window_left, window_right, softcap,
                   rotary_interleaved, num_splits, want_lse=True):
    """flashattn::kvcache's arguments (cache_seqlens an int32 tensor or None); (out, lse), lse
    None where ``want_lse`` is false."""
    if q.dim() != 4:
        raise FlashAttnError("q: expected 4 dimensions (batch_size, seqlen, nheads, headdim), "
                             "got shape %s" % (tuple(q.shape),))
    b, sq, h = q.shape[0], q.shape[1], q.shape[2]
    kc, vc = _packed(k_cache, "k_cache"), _packed(v_cache, "v_cache")
    n_rows = kc.shape[0]
    if block_table is not None:
        if cache_batch_idx is not None:
            raise FlashAttnError("cache_batch_idx: not supported with a paged cache (block_table "
                                 "already picks each sequence's blocks)")
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or \
                block_table.shape[0] != b:
            raise FlashAttnError("block_table: expected int32 of shape (%d, max_num_blocks), got "
                                 "%s %s" % (b, block_table.dtype, tuple(block_table.shape)))
        page = k_cache.shape[1]
        cap = block_table.shape[1] * page
    else:
        page, cap = 0, k_cache.shape[1]
        if cache_batch_idx is None and k_cache.shape[0] != b:
            raise FlashAttnError("k_cache: dimension 0 (batch) must be %d, as q's, got %d"
                                 % (b, k_cache.shape[0]))
    _int32(cache_batch_idx, "cache_batch_idx", b)
    _int32(cache_leftpad, "cache_leftpad", b)
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
        cache_seqlens = torch.full((b,), cap, dtype=torch.int32, device=q.device)
    _int32(cache_seqlens, "cache_seqlens", b)
    plain = block_table is None and cache_batch_idx is None and cache_leftpad is None
    if plain:
        # The decoding step's common form: one check in as few kernels as torch allows.
        ok = cache_seqlens.clamp(0, cap - s_new).eq(cache_seqlens).all()
        seqlens = start = None
    else:
        seqlens = cache_seqlens.long()
        start = cache_leftpad.long() if cache_leftpad is not None else torch.zeros_like(seqlens)
        ok = (start >= 0) & (start <= seqlens) & (seqlens + s_new <= cap)
        if block_table is not None:
            ok = ok & ((block_table >= 0) & (block_table * page < n_rows)).all(1)
        if cache_batch_idx is not None:
            ok = ok & (cache_batch_idx >= 0) & (cache_batch_idx.long() * cap < n_rows)
        ok = ok.all()
    torch._assert_async(ok, "flash_attn_with_kvcache: cache_seqlens, cache_leftpad, "
                        "cache_batch_idx or block_table point outside the cache")

    if rotary_cos is not None:
        # Per-row positions when causal or local (a window side below the capacity), as the
        # C library's KV-cache call rotates.
        local = causal or 0 <= window_left < cap or 0 <= window_right < cap
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
        if plain:
            rows = (cache_seqlens[:, None] + _plain_index(b, sq, cap, s_new, q.device)[2])
        else:
            pos = seqlens[:, None] + torch.arange(s_new, device=q.device)[None, :]
            rows = _rows(pos, b, cap, page, block_table, cache_batch_idx)
        rows = rows.reshape(-1)
        kc.index_put_((rows,), k.reshape(b * s_new, *k.shape[2:]))
        vc.index_put_((rows,), v.reshape(b * s_new, *v.shape[2:]))

    n = _splits(num_splits, q, cap, causal, window_left, window_right, alibi_slopes,
                learnable_sink)
    if plain:
        k_att, v_att = kc, vc
        used = cache_seqlens + s_new if s_new else cache_seqlens
    else:
        # Positions start .. start + cap - 1 of each sequence, clamped into the capacity (the
        # ones past the used keys are never seen).
        pos = (start[:, None] + torch.arange(cap, device=q.device)[None, :]).clamp(max=cap - 1)
        rows = _rows(pos, b, cap, page, block_table, cache_batch_idx).reshape(-1)
        k_att, v_att = kc.index_select(0, rows), vc.index_select(0, rows)
        used = (seqlens + s_new - start).to(torch.int32)
    if n == 1:
        return _attend(q, k_att, v_att, used, cap, alibi_slopes, learnable_sink, softmax_scale,
                       causal, window_left, window_right, softcap, want_lse)
    return _attend_split(q, k_att, v_att, used, cap, n, softmax_scale, softcap, want_lse)
