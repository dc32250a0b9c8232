"""FA3's Python interface (upstream ``hopper/flash_attn_interface.py``) over this package.

    from flashattn import fa3
    out = fa3.flash_attn_func(q, k, v, causal=True)            # out
    out, lse = fa3.flash_attn_func(q, k, v, return_attn_probs=True)

The functions keep FA3's names, signatures, defaults and return values; each runs on this
package's FA2-style functions (``flash_attn_interface``), so they take torch tensors on the CPU
or a CUDA device and the attention ones are differentiable where FA3's are. Return values:

* ``flash_attn_func`` / ``flash_attn_varlen_func`` / ``flash_attn_qkvpacked_func``: ``out``, or
  ``(out, softmax_lse)`` with ``return_attn_probs`` (FA3 has no S_dmask). lse is fp32
  ``(b, h, seqlen_q)``, varlen ``(h, total_q)``.
* ``flash_attn_with_kvcache``: ``out``, or with ``return_softmax_lse`` FA3's four values
  ``(out, softmax_lse, out_accum, softmax_lse_accum)``; the last two are FA3's split buffers,
  which here stay inside the call: empty fp32 ``(0,)`` tensors on q's device.
* ``flash_attn_combine``: ``(out, lse)`` (the package's function, already FA3's).
* ``get_scheduler_metadata``: an int32 tensor the KV-cache call takes as ``scheduler_metadata``.

FA3's conventions kept here where FA2's differ: a row that sees no key has lse -inf (FA2: +inf)
and out 0; varlen rows outside every sequence get the same.

Arguments FA3 has and this package cannot honour: ``pack_gqa`` and ``sm_margin`` are accepted
and ignored (the library chooses its own layout and uses the whole device); ``num_splits`` is
checked (at most 256; <= 0 means "choose") and passed to the KV-cache call, which takes it;
the attention functions do not split (every split count gives the same result). ``qv`` (MLA)
and ``attention_chunk != 0`` raise NotImplementedError naming the argument, as do the KV-cache
call's ``cu_seqlens_q``, ``cu_seqlens_k_new``, ``rotary_seqlens`` and ``q_descale`` (an fp8 q).

FP8 KV caches (``flash_attn_with_kvcache``): ``torch.float8_e4m3fn`` (or ``float8_e5m2``)
k_cache and v_cache with a float16 / bfloat16 q and optional fp32 ``(b, h_k)`` ``k_descale``,
``v_descale`` (include/flashattn.h, "FP8 caches"), on the CPU and on a CUDA device.

FP8 (``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_qkvpacked_func``; CPU
tensors, and CUDA tensors on a Hopper device): q, k, v ``torch.float8_e4m3fn`` (or all
``float8_e5m2``) with optional fp32 ``(b, h_k)`` ``q_descale``, ``k_descale``, ``v_descale``
(absent: 1), out bf16, as FA3's forward, P rounded to e4m3 for the P V product as FA3's kernel
does (include/flashattn.h, "FP8"). FP8 has no backward: inputs that require grad (with grad
mode on) raise NotImplementedError at the forward; descales with non-fp8 inputs are refused.

``seqused_q``: FA3 computes only the first seqused_q[b] queries of sequence b, and its causal /
window diagonal is that of a sequence of seqused_q[b] queries. Here those rows are gathered,
run as their own varlen batch and scattered back; the rows past them get out 0 and lse -inf
(FA3 leaves them unwritten). The lengths are read on the host (a synchronisation on a device).

``page_table`` on ``flash_attn_varlen_func`` (keyword only; FA3's Python function lacks it, its
kernel and FA4's varlen function take it): k and v are paged caches
``(num_pages, page_size, h_k, d)`` with any page size, cu_seqlens_k must be None (as FA3
requires), sequence b has seqused_k[b] keys (default: its whole page_table row) at pages
page_table[b, p // page_size]. With seqused_k, max_seqlen_k bounds the counts (the keys are
gathered into that width); on CPU tensors a count past it, or past the row's capacity, is
refused (on a device such a count is clamped, as the package's block_table path does).
"""

import torch

from . import _arrays, _core, _route
from . import flash_attn_interface as _fa2
from ._lib import FlashAttnError

__all__ = [
    "flash_attn_qkvpacked_func",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_combine",
    "flash_attn_with_kvcache",
    "get_scheduler_metadata",
]

# FA3's flash_attn_combine has this package's signature and return value.
flash_attn_combine = _fa2.flash_attn_combine

_MAX_SPLITS = 256  # FA_MAX_SPLITS, FA3's limit too

# get_scheduler_metadata's tensor: a tag, then the fields the KV-cache call checks and uses.
_META_TAG = 0x46413301
_META_FIELDS = ("tag", "num_splits", "batch_size", "num_heads_q", "num_heads_kv", "headdim",
                "headdim_v", "page_size")


# --------------------------------------------------------------------------------------------
# Arguments this package cannot honour, and the ones it takes but ignores


def _refuse(name, value, what):
    """NotImplementedError for an FA3 argument this package has no kernel for."""
    if value is not None:
        raise NotImplementedError("flashattn.fa3: %s (%s) is not supported; pass None"
                                  % (name, what))


def _refuse_fa3_only(qv, attention_chunk):
    _refuse("qv", qv, "MLA's extra query part")
    chunk = 0 if attention_chunk is None else _core.as_int(attention_chunk, "attention_chunk")
    if chunk != 0:
        raise NotImplementedError("flashattn.fa3: attention_chunk=%d (chunked local attention) "
                                  "is not supported; pass 0" % chunk)


def _fp8(q, descales):
    """Whether the call is FA3's fp8 forward: fp8 q, or descales given (which then must come
    with fp8 inputs)."""
    if _arrays.is_fp8(q):
        return True
    for name, x in zip(("q_descale", "k_descale", "v_descale"), descales):
        if x is not None:
            raise FlashAttnError("%s: descales apply to fp8 inputs only, but q is %s"
                                 % (name, q.dtype))
    return False


def _fp8_forward(q, k, v, descales, softmax_scale, causal, window_size, softcap, **varlen):
    """FA3's fp8 forward: (out bf16, lse)."""
    q_descale, k_descale, v_descale = descales
    out, lse, _ = _route.torch_ops().fp8_forward(
        q, k, v, None, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
        **varlen)
    return out, lse


def _splits(num_splits):
    """num_splits as the library takes it: 0 (choose) for FA3's <= 0, else 1..256."""
    n = _core.as_int(num_splits, "num_splits")
    if n > _MAX_SPLITS:
        raise FlashAttnError("num_splits: %d is more than %d" % (n, _MAX_SPLITS))
    return max(n, 0)


def _ignored(pack_gqa, sm_margin):
    """pack_gqa and sm_margin are FA3's tuning knobs; checked for type, then ignored."""
    if pack_gqa is not None:
        _core.as_bool(pack_gqa, "pack_gqa")
    _core.as_int(sm_margin, "sm_margin")


def _torch(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError("%s: flashattn.fa3 takes torch tensors, got %s"
                        % (name, type(x).__name__))


def _index(x, name, n):
    """An int32 (n,) tensor argument (seqused_q, seqused_k)."""
    _torch(x, name)
    if x.dtype != torch.int32 or tuple(x.shape) != (n,):
        raise FlashAttnError("%s: expected int32 of shape (%d,), got %s %s"
                             % (name, n, x.dtype, tuple(x.shape)))


def _fa3_lse(lse):
    """FA3 gives a row that sees no key lse -inf where FA2 (and this library) gives +inf."""
    return torch.where(lse == float("inf"), float("-inf"), lse)


# --------------------------------------------------------------------------------------------
# Attention


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None,
                              k_descale=None, v_descale=None, window_size=(-1, -1),
                              attention_chunk=0, softcap=0.0, deterministic=False,
                              num_heads_q=None, sm_margin=0, return_attn_probs=False):
    """flash_attn_func over a packed qkv: (b, s, 3, h, d), or (b, s, h + 2 * h_k, d) with
    num_heads_q = h (q's heads first, then k's, then v's)."""
    _torch(qkv, "qkv")
    if qkv.dim() == 5 and qkv.shape[2] == 3:
        q, k, v = qkv.unbind(2)
    elif qkv.dim() == 4:
        if num_heads_q is None:
            raise FlashAttnError("num_heads_q: required with a 4-D qkv (b, s, h + 2 * h_k, d)")
        hq = _core.as_int(num_heads_q, "num_heads_q")
        hk2 = qkv.shape[2] - hq
        if hq < 1 or hk2 < 2 or hk2 % 2:
            raise FlashAttnError("num_heads_q: %d does not split qkv's %d heads into h + 2 * h_k"
                                 % (hq, qkv.shape[2]))
        q, k, v = qkv.split([hq, hk2 // 2, hk2 // 2], dim=2)
    else:
        raise FlashAttnError("qkv: expected (batch, seqlen, 3, nheads, headdim) or (batch, "
                             "seqlen, nheads + 2 * nheads_k, headdim), got shape %s"
                             % (tuple(qkv.shape),))
    return flash_attn_func(q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale,
                           window_size, attention_chunk, softcap, 1, None, deterministic,
                           sm_margin, return_attn_probs)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                    k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                    softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                    return_attn_probs=False):
    """FA3's flash_attn_func: q (b, sq, h, d), k / v (b, sk, h_k, d / dv).

    Returns out (b, sq, h, dv), or (out, softmax_lse fp32 (b, h, sq)) with return_attn_probs.
    The other arguments are as in ``flash_attn_interface.flash_attn_func`` (no dropout or
    ALiBi in FA3); see the module's text for the FA3-only ones."""
    _refuse_fa3_only(qv, attention_chunk)
    _splits(num_splits)
    _ignored(pack_gqa, sm_margin)
    _torch(q, "q")
    want = _core.as_bool(return_attn_probs, "return_attn_probs")
    if _fp8(q, (q_descale, k_descale, v_descale)):
        out, lse = _fp8_forward(q, k, v, (q_descale, k_descale, v_descale), softmax_scale,
                                causal, window_size, softcap)
        return (out, _fa3_lse(lse)) if want else out
    res = _fa2.flash_attn_func(q, k, v, 0.0, softmax_scale, causal, window_size, softcap, None,
                               deterministic, want)
    return (res[0], _fa3_lse(res[1])) if want else res


def _varlen_q(q, cu_seqlens_q, max_seqlen_q):
    """(q (total_q, h, d), cu_seqlens_q, max_seqlen_q, batch shape or None): a batched q
    (cu_seqlens_q None, FA3's form) seen as a varlen batch of equal lengths."""
    if cu_seqlens_q is not None:
        return q, cu_seqlens_q, max_seqlen_q, None
    if q.dim() != 4:
        raise FlashAttnError("q: without cu_seqlens_q, expected (batch, seqlen_q, nheads, "
                             "headdim), got shape %s" % (tuple(q.shape),))
    b, sq = q.shape[0], q.shape[1]
    cu = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
    return q.reshape(b * sq, *q.shape[2:]), cu, sq, (b, sq)


def _paged_lengths(k, page_table, seqused_k, max_seqlen_k, b):
    """(seqused_k, the gathered width) of a paged call. FA3 reads every key of a page_table row
    unless seqused_k says fewer; max_seqlen_k, with seqused_k, narrows the gather (checked on
    CPU tensors)."""
    _torch(page_table, "page_table")
    if page_table.dim() != 2 or k.dim() != 4:
        raise FlashAttnError("page_table: expected int32 (batch_size, max_num_pages) with k "
                             "(num_pages, page_size, nheads_k, headdim), got shapes %s and %s"
                             % (tuple(page_table.shape), tuple(k.shape)))
    capacity = page_table.shape[1] * k.shape[1]
    if seqused_k is None:
        return torch.full((b,), capacity, dtype=torch.int32, device=k.device), capacity
    _index(seqused_k, "seqused_k", b)
    width = capacity
    if max_seqlen_k is not None:
        width = min(capacity, _core.as_int(max_seqlen_k, "max_seqlen_k"))
    if seqused_k.device.type == "cpu" and b > 0:
        lo, hi = int(seqused_k.min()), int(seqused_k.max())
        if lo < 0 or hi > width:
            raise FlashAttnError("seqused_k: key counts must lie in [0, %d] (max_seqlen_k, and "
                                 "a page_table row's %d keys), got [%d, %d]"
                                 % (width, capacity, lo, hi))
    return seqused_k, width


def _varlen_k(k, v, cu_seqlens_k, max_seqlen_k, seqused_k, page_table, b, device):
    """(k, v, cu_seqlens_k, max_seqlen_k, seqused_k) for the package's varlen call."""
    if page_table is not None:
        if cu_seqlens_k is not None:
            raise FlashAttnError("cu_seqlens_k: must be None with page_table (seqused_k gives "
                                 "the key counts), as in FA3")
        seqused_k, width = _paged_lengths(k, page_table, seqused_k, max_seqlen_k, b)
        # The paged path reads only cu_seqlens_k's length; the counts are seqused_k.
        cu = torch.zeros(b + 1, dtype=torch.int32, device=device)
        return k, v, cu, width, seqused_k
    if seqused_k is not None:
        _index(seqused_k, "seqused_k", b)
    if cu_seqlens_k is not None:
        return k, v, cu_seqlens_k, max_seqlen_k, seqused_k
    for x, name in ((k, "k"), (v, "v")):
        if x.dim() != 4 or x.shape[0] != b:
            raise FlashAttnError("%s: without cu_seqlens_k, expected (%d, seqlen_k, nheads_k, "
                                 "headdim), got shape %s" % (name, b, tuple(x.shape)))
    sk = k.shape[1]
    cu = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=device)
    return (k.reshape(b * sk, *k.shape[2:]), v.reshape(b * sk, *v.shape[2:]), cu, sk,
            seqused_k)


def _used_rows(cu_seqlens_q, seqused_q, b):
    """(row indices (n,) long, cu_seqlens (b + 1,) int32) of the first seqused_q[b] queries of
    each sequence; the counts are checked against the sequences on the host."""
    _index(seqused_q, "seqused_q", b)
    used = seqused_q.long()
    starts = cu_seqlens_q[:-1].long()
    lens = cu_seqlens_q[1:].long() - starts
    bad = ((used < 0) | (used > lens)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise FlashAttnError("seqused_q: sequence %d uses %d queries, outside [0, %d]"
                             % (i, int(used[i]), int(lens[i])))
    offsets = torch.cat([used.new_zeros(1), used.cumsum(0)])
    n = int(offsets[-1])
    rows = (torch.arange(n, device=used.device)
            + (starts - offsets[:-1]).repeat_interleave(used, output_size=n))
    return rows, offsets.to(torch.int32)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                           qv=None, q_descale=None, k_descale=None, v_descale=None,
                           window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0,
                           return_attn_probs=False, *, page_table=None):
    """FA3's flash_attn_varlen_func.

    q: (total_q, h, d) with cu_seqlens_q (b + 1,) int32, or (b, sq, h, d) with None.
    k, v: (total_k, h_k, d / dv) with cu_seqlens_k, (b, sk, h_k, d / dv) with None, or paged
        (num_pages, page_size, h_k, d / dv) with page_table (keyword only; see the module).
    seqused_q, seqused_k: int32 (b,): only the first seqused_q[b] queries / seqused_k[b] keys
        of each sequence are used (FA3's rule for the queries: see the module).
    Returns out in q's layout (dv), or (out, softmax_lse fp32 (h, total_q), or (b, h, sq) for
    a batched q) with return_attn_probs.
    """
    _refuse_fa3_only(qv, attention_chunk)
    _splits(num_splits)
    _ignored(pack_gqa, sm_margin)
    _torch(q, "q")
    want = _core.as_bool(return_attn_probs, "return_attn_probs")
    fp8 = _fp8(q, (q_descale, k_descale, v_descale))
    if fp8 and page_table is not None:
        raise NotImplementedError("page_table: fp8 paged keys and values are not supported yet")
    left, right = _core.window_pair(window_size)
    q, cu_q, max_q, batched = _varlen_q(q, cu_seqlens_q, max_seqlen_q)
    _torch(cu_q, "cu_seqlens_q")
    b = cu_q.shape[0] - 1
    k, v, cu_k, max_k, seqused_k = _varlen_k(k, v, cu_seqlens_k, max_seqlen_k, seqused_k,
                                             page_table, b, q.device)
    q_run, cu_run = q, cu_q
    if seqused_q is not None:
        rows, cu_run = _used_rows(cu_q, seqused_q, b)
        q_run = q.index_select(0, rows)
    if fp8:
        out, lse = _fp8_forward(q_run, k, v, (q_descale, k_descale, v_descale), softmax_scale,
                                causal, (left, right), softcap, cu_seqlens_q=cu_run,
                                cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                                seqused_k=seqused_k)
    else:
        out, lse, _, _ = _fa2._flash_attn_varlen_forward(
            q_run, k, v, cu_run, cu_k, max_q, max_k, 0.0, softmax_scale, causal, left, right,
            softcap, None, False, block_table=page_table, seqused_k=seqused_k,
            _deterministic=_core.as_bool(deterministic, "deterministic"))
    if seqused_q is not None:
        out = out.new_zeros((q.shape[0],) + tuple(out.shape[1:])).index_copy(0, rows, out)
        lse = lse.new_full((lse.shape[0], q.shape[0]), float("-inf")).index_copy(1, rows, lse)
    lse = _fa3_lse(lse)
    if batched is not None:
        out = out.reshape(batched + tuple(out.shape[1:]))
        lse = lse.reshape((lse.shape[0],) + batched).transpose(0, 1).contiguous()
    return (out, lse) if want else out


# --------------------------------------------------------------------------------------------
# KV cache


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv,
                           headdim, cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None,
                           cu_seqlens_q=None, cu_seqlens_k_new=None, cache_leftpad=None,
                           page_size=None, max_seqlen_k_new=0, causal=False,
                           window_size=(-1, -1), attention_chunk=0, has_softcap=False,
                           num_splits=0, pack_gqa=None, sm_margin=0):
    """FA3's scheduler metadata for ``flash_attn_with_kvcache(..., scheduler_metadata=)``.

    Returns an int32 (8,) tensor on cache_seqlens' device: a tag, num_splits, batch_size,
    num_heads_q, num_heads_kv, headdim, headdim_v, page_size (0: no page_table). The KV-cache
    call checks that the shapes match its own and splits as num_splits says (0: the library
    chooses, at the call, from the problem and the device). FA3's per-batch tile schedule
    has no counterpart here; the other arguments are checked and ignored."""
    _refuse("cu_seqlens_q", cu_seqlens_q, "a varlen q in the KV-cache call")
    _refuse("cu_seqlens_k_new", cu_seqlens_k_new, "varlen new keys in the KV-cache call")
    _refuse_fa3_only(None, attention_chunk)
    if qkv_dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise NotImplementedError("flashattn.fa3: qkv_dtype %s is not supported (FP8 has no "
                                  "kernels here)" % (qkv_dtype,))
    _torch(cache_seqlens, "cache_seqlens")
    _ignored(pack_gqa, sm_margin)
    _core.window_pair(window_size)
    fields = [_META_TAG, _splits(num_splits)]
    for name, n in (("batch_size", batch_size), ("num_heads_q", num_heads_q),
                    ("num_heads_kv", num_heads_kv), ("headdim", headdim),
                    ("headdim_v", headdim if headdim_v is None else headdim_v),
                    ("page_size", 0 if page_size is None else page_size)):
        n = _core.as_int(n, name, _core.INT32)
        if n < (0 if name in ("batch_size", "page_size") else 1):
            raise FlashAttnError("%s: %d is out of range" % (name, n))
        fields.append(n)
    if fields[3] % fields[4]:
        raise FlashAttnError("num_heads_kv: %d does not divide num_heads_q %d"
                             % (fields[4], fields[3]))
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k),
                    ("max_seqlen_k_new", max_seqlen_k_new)):
        _core.as_int(n, name)
    return torch.tensor(fields, dtype=torch.int32, device=cache_seqlens.device)


def _metadata_splits(meta, q, k_cache, v_cache, page_table, num_splits):
    """The split count of a call given scheduler_metadata: the call's num_splits when it asks
    for one, else the metadata's; the metadata must describe this call's shapes."""
    _torch(meta, "scheduler_metadata")
    if meta.dtype != torch.int32 or tuple(meta.shape) != (len(_META_FIELDS),):
        raise FlashAttnError("scheduler_metadata: expected the int32 (%d,) tensor of "
                             "flashattn.fa3.get_scheduler_metadata, got %s %s"
                             % (len(_META_FIELDS), meta.dtype, tuple(meta.shape)))
    if meta.is_cuda and torch.cuda.is_current_stream_capturing():
        return num_splits  # reading it would synchronise, which a capture forbids
    got = dict(zip(_META_FIELDS, (int(x) for x in meta.tolist())))
    if got["tag"] != _META_TAG:
        raise FlashAttnError("scheduler_metadata: not made by flashattn.fa3."
                             "get_scheduler_metadata")
    want = {"batch_size": q.shape[0], "num_heads_q": q.shape[2],
            "num_heads_kv": k_cache.shape[-2], "headdim": q.shape[-1],
            "headdim_v": v_cache.shape[-1],
            "page_size": 0 if page_table is None else k_cache.shape[1]}
    for name, n in want.items():
        if got[name] != n:
            raise FlashAttnError("scheduler_metadata: made for %s %d, but this call has %d"
                                 % (name, got[name], n))
    if num_splits and got["num_splits"] and num_splits != got["num_splits"]:
        raise FlashAttnError("num_splits: %d differs from scheduler_metadata's %d"
                             % (num_splits, got["num_splits"]))
    return num_splits or got["num_splits"]


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, page_table=None, cu_seqlens_q=None,
                            cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                            rotary_interleaved=True, scheduler_metadata=None, num_splits=0,
                            pack_gqa=None, sm_margin=0, return_softmax_lse=False):
    """FA3's flash_attn_with_kvcache: ``flash_attn_interface.flash_attn_with_kvcache`` with
    page_table for FA2's block_table (any page size) and FA3's extra arguments (see the
    module). Not differentiable, as in FA3.

    Returns out (b, sq, h, dv), or with return_softmax_lse (out, softmax_lse fp32 (b, h, sq),
    out_accum, softmax_lse_accum), the last two empty (0,) fp32 tensors."""
    _refuse_fa3_only(qv, attention_chunk)
    _refuse("q_descale", q_descale, "an fp8 q with fp8 KV caches (the caches may be fp8 with a "
            "float16 / bfloat16 q, with k_descale and v_descale)")
    _refuse("cu_seqlens_q", cu_seqlens_q, "a varlen q")
    _refuse("cu_seqlens_k_new", cu_seqlens_k_new, "varlen new keys")
    _refuse("rotary_seqlens", rotary_seqlens, "rotary positions apart from cache_seqlens")
    _ignored(pack_gqa, sm_margin)
    _torch(q, "q")
    splits = _splits(num_splits)
    if scheduler_metadata is not None:
        splits = _metadata_splits(scheduler_metadata, q, k_cache, v_cache, page_table, splits)
    want = _core.as_bool(return_softmax_lse, "return_softmax_lse")
    res = _fa2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                       cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
                                       softmax_scale, causal, window_size, softcap,
                                       rotary_interleaved, None, splits, want,
                                       k_descale=k_descale, v_descale=v_descale)
    if not want:
        return res
    empty = torch.empty((0,), dtype=torch.float32, device=q.device)
    return res[0], _fa3_lse(res[1]), empty, empty.clone()
