"""flash_attn-compatible functions (upstream ``flash_attn/flash_attn_interface.py``).

The six public functions keep upstream's exact signatures and defaults and add one
keyword-only argument, ``learnable_sink`` (FA4's name: a per-head sink logit, shape ``(h,)``).
They take torch CPU tensors (and return torch tensors) or NumPy arrays (and return NumPy
arrays), all arguments of one call being of one kind; any other array with ``__dlpack__`` is
taken as well and answered in its own kind (``_dlpack``).

Return value: ``out``; with ``return_attn_probs=True`` the 3-tuple ``(out, softmax_lse,
S_dmask)``. ``softmax_lse`` is fp32 ``(b, h, seqlen_q)`` (varlen: ``(h, total_q)``).
``S_dmask`` is an empty ``(0,)`` array unless ``dropout_p > 0``; then it is upstream's
debugging encoding ``(b, h, round_up(seqlen_q, 128), round_up(seqlen_k, 128))`` in q's dtype
(unnormalised probabilities, negative where dropout dropped the element).

Dropout RNG: each call with ``dropout_p > 0`` draws a fresh 63-bit Philox seed (offset 0) from
the framework's global generator: ``torch.randint`` on torch's default CPU generator for
tensors (so ``torch.manual_seed`` reproduces a run), ``np.random.randint`` on NumPy's legacy
global state for arrays (so ``np.random.seed`` does). Calls without dropout draw nothing.

Upstream's module-level names are here too: ``USE_TRITON_ROCM`` (False) and ``flash_attn_gpu``,
its compiled module's raw entry points with their positional arguments (``_raw``).

Layering: this module holds the signatures; every forward function takes ``_route`` to the C
library (``_route`` draws the route; upstream's internal ``_flash_attn_forward`` and
``_flash_attn_varlen_forward`` are its functions). ``flash_attn_with_kvcache`` (upstream FA2's
signature) and ``flash_attn_combine`` (FA3's) call ``_kvcache``'s C calls, through
``_torch_ops``' ops for torch tensors.
"""

import sys

from . import _arrays, _kvcache, _raw, _route
from ._dlpack import accepts_dlpack
from ._lib import FlashAttnError

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
]


# Upstream's flag for its Triton (ROCm) backend, which this package does not have.
USE_TRITON_ROCM = False


def maybe_contiguous(x):
    """Upstream's helper: a copy only when the last dimension is not contiguous."""
    if x is None:
        return None
    if hasattr(x, "stride") and callable(x.stride):  # torch
        return x.contiguous() if x.stride(-1) != 1 else x
    return _arrays.prepare(x, "x", _arrays.NUMPY)


def round_multiple(x, m):
    return (x + m - 1) // m * m


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """Column block width of the S_dmask encoding (upstream's helper of the same name).

    There is no second table to keep in sync: the C library answers (fa_probs_block_n)."""
    from . import _lib

    assert head_dim <= 256
    return _lib.probs_block_n(head_dim, is_dropout, is_causal)


# Upstream's internal forward functions (their names, arguments and return values).
_flash_attn_forward = _route.forward
_flash_attn_varlen_forward = _route.varlen_forward


def _check_packed(x, name, ndim, slot, count, layout):
    if len(x.shape) != ndim or x.shape[slot] != count:
        raise FlashAttnError("%s: expected shape %s, got %s" % (name, layout, tuple(x.shape)))


# --------------------------------------------------------------------------------------------
# Public API


@accepts_dlpack
def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *,
                              learnable_sink=None):
    """Attention over a packed qkv of shape (batch, seqlen, 3, nheads, headdim).

    Equivalent to flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], ...) without
    copying the slices. See flash_attn_func for the arguments and the return value.
    """
    kind = _arrays.common_kind([("qkv", qkv), ("alibi_slopes", alibi_slopes),
                              ("learnable_sink", learnable_sink)], 1)
    _check_packed(qkv, "qkv", 5, 2, 3, "(batch, seqlen, 3, nheads, headdim)")
    names = {"q": "qkv[:, :, 0] (q)", "k": "qkv[:, :, 1] (k)", "v": "qkv[:, :, 2] (v)"}
    return _route.dense(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale,
                        causal, window_size, softcap, alibi_slopes, deterministic,
                        return_attn_probs, learnable_sink, kind, names)


@accepts_dlpack
def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *,
                             learnable_sink=None):
    """Attention with a packed kv of shape (batch, seqlen_k, 2, nheads_k, headdim).

    Equivalent to flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], ...) without copying the
    slices. See flash_attn_func for the arguments and the return value.
    """
    kind = _arrays.common_kind([("q", q), ("kv", kv), ("alibi_slopes", alibi_slopes),
                              ("learnable_sink", learnable_sink)], 2)
    _check_packed(kv, "kv", 5, 2, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    names = {"k": "kv[:, :, 0] (k)", "v": "kv[:, :, 1] (v)"}
    return _route.dense(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                        window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                        learnable_sink, kind, names)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, learnable_sink=None):
    """Exact attention, tiled with an online softmax.

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim)
        k: (batch_size, seqlen_k, nheads_k, headdim)
        v: (batch_size, seqlen_k, nheads_k, headdim_v)
            nheads % nheads_k == 0 (MQA/GQA: query head i uses kv head i // (nheads/nheads_k)).
            dtype float16, bfloat16, float32 or float64; any headdim in 1..576 on the CPU, 1..256 on
            CUDA, and up to 576 there without dropout (the decode kernels: MLA, d 576 / dv 512;
            no backward past 256).
        dropout_p: float, dropout probability in [0, 1).
        softmax_scale: float; default 1 / sqrt(headdim).
        causal: bool; the mask is aligned to the bottom-right corner of the score matrix
            (query i sees keys j <= i + seqlen_k - seqlen_q).
        window_size: (left, right); -1 is unbounded. Query i sees keys in
            [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right].
        softcap: float > 0 applies softcap * tanh(score / softcap); cannot be used with dropout.
        alibi_slopes: float32 (nheads,) or (batch_size, nheads); adds
            -slope * |i + seqlen_k - seqlen_q - j| to the score.
        deterministic: accepted for compatibility (the forward pass is deterministic).
        return_attn_probs: also return softmax_lse and S_dmask (testing only).
        learnable_sink (keyword only): float (nheads,) sink logit per head; it adds
            exp(sink) to each row's softmax denominator.
    Return:
        out: (batch_size, seqlen_q, nheads, headdim_v).
        softmax_lse [optional]: float32 (batch_size, nheads, seqlen_q); +inf for a row that
            sees no key (and has no sink).
        S_dmask [optional]: (0,) when dropout_p == 0, otherwise
            (batch_size, nheads, round_up(seqlen_q, 128), round_up(seqlen_k, 128)).
    """
    # _fastpath (C) serves the commonest torch calls from their prepared signatures and hands
    # every other call to the same route; Dynamo cannot trace C, so compiling takes the route.
    entry = _route.DENSE_C
    if entry is None or _route.IS_COMPILING():
        entry = _route.dense_any
    return entry(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                 deterministic, return_attn_probs, learnable_sink)


@accepts_dlpack
def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, learnable_sink=None):
    """Variable-length attention over a packed qkv of shape (total, 3, nheads, headdim).

    cu_seqlens: int32 (batch_size + 1,), the offsets of the sequences in the total dimension;
    max_seqlen: int, the longest sequence. See flash_attn_varlen_func.
    """
    kind = _arrays.common_kind([("qkv", qkv), ("cu_seqlens", cu_seqlens),
                              ("alibi_slopes", alibi_slopes),
                              ("learnable_sink", learnable_sink)], 2)
    _check_packed(qkv, "qkv", 4, 1, 3, "(total, 3, nheads, headdim)")
    names = {"q": "qkv[:, 0] (q)", "k": "qkv[:, 1] (k)", "v": "qkv[:, 2] (v)",
             "cu_seqlens_q": "cu_seqlens", "cu_seqlens_k": "cu_seqlens",
             "max_seqlen_q": "max_seqlen", "max_seqlen_k": "max_seqlen"}
    return _route.varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen,
                         max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                         alibi_slopes, deterministic, return_attn_probs, learnable_sink, kind,
                         names)


@accepts_dlpack
def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, learnable_sink=None):
    """Variable-length attention with a packed kv of shape (total_k, 2, nheads_k, headdim).

    See flash_attn_varlen_func.
    """
    kind = _arrays.common_kind([("q", q), ("kv", kv), ("cu_seqlens_q", cu_seqlens_q),
                              ("cu_seqlens_k", cu_seqlens_k), ("alibi_slopes", alibi_slopes),
                              ("learnable_sink", learnable_sink)], 4)
    _check_packed(kv, "kv", 4, 1, 2, "(total_k, 2, nheads_k, headdim)")
    names = {"k": "kv[:, 0] (k)", "v": "kv[:, 1] (v)"}
    return _route.varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                         alibi_slopes, deterministic, return_attn_probs, learnable_sink, kind,
                         names)


@accepts_dlpack
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *,
                           learnable_sink=None):
    """Variable-length (unpadded) attention.

    Arguments:
        q: (total_q, nheads, headdim), the sequences concatenated.
        k: (total_k, nheads_k, headdim); v: (total_k, nheads_k, headdim_v).
        cu_seqlens_q, cu_seqlens_k: int32 (batch_size + 1,), non-decreasing offsets of the
            sequences in q and k (sequences may be empty).
        max_seqlen_q, max_seqlen_k: int, at least the longest sequence.
        block_table [optional]: int32 (batch_size, max_num_blocks_per_seq), torch tensors:
            k and v are then paged caches (num_blocks, page_block_size, nheads_k, headdim), key
            p of sequence b in block block_table[b, p // page_block_size] (any page size), and
            cu_seqlens_k gives the sequences' key counts (its offsets are not rows of k).
        The other arguments are as in flash_attn_func.
    Return:
        out: (total_q, nheads, headdim_v); rows outside every sequence get 0.
        softmax_lse [optional]: float32 (nheads, total_q).
        S_dmask [optional]: (0,) when dropout_p == 0, otherwise
            (batch_size, nheads, round_up(max_seqlen_q, 128), round_up(max_seqlen_k, 128)).
    """
    kind = _arrays.common_kind([("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                              ("cu_seqlens_k", cu_seqlens_k), ("alibi_slopes", alibi_slopes),
                              ("learnable_sink", learnable_sink)], 5)
    return _route.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                         deterministic, return_attn_probs, learnable_sink, kind, None,
                         block_table)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, learnable_sink=None, k_descale=None,
                            v_descale=None):
    """Attention of q against a KV cache, appending k and v to the cache in place first.

    If k and v are given they are written into k_cache / v_cache at positions cache_seqlens
    (rotated first when rotary_cos / rotary_sin are given), and the attention runs over the
    updated cache, as one call. For decoding: q holds the new tokens' queries.

    Arguments:
        q: (batch_size, seqlen, nheads, headdim)
        k_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim), or with block_table
            (num_blocks, page_block_size, nheads_k, headdim): any page size >= 1.
        v_cache: as k_cache, with headdim_v.
        k, v [optional]: (batch_size, seqlen_new, nheads_k, headdim / headdim_v), appended
            at cache_seqlens (which is then required).
        rotary_cos, rotary_sin [optional]: (seqlen_ro, rotary_dim / 2), q's dtype; any even
            rotary_dim <= headdim. Rotates k at positions cache_seqlens + i, and q at
            cache_seqlens + i when causal or local, else at cache_seqlens.
        cache_seqlens: int or int32 (batch_size,): keys already in each cache row; None:
            the whole cache.
        cache_batch_idx [optional]: int32 (batch_size,): the cache row of each sequence.
        cache_leftpad [optional]: int32 (batch_size,): the first cache position used.
        block_table [optional]: int32 (batch_size, max_num_blocks_per_seq): paged cache.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as flash_attn_func.
        rotary_interleaved: True pairs dims (0, 1), (2, 3)... (GPT-J); False pairs
            (i, i + rotary_dim / 2) (GPT-NeoX).
        num_splits: split-KV chunks; 0 lets the library choose from the problem and the
            device (or the CPU's threads), 1 never splits.
        return_softmax_lse: also return the float32 lse (batch_size, nheads, seqlen).
        learnable_sink (keyword only): float (nheads,) sink logit per head.
        k_descale, v_descale (keyword only, FA3's names): float32 (batch_size, nheads_k), the
            dequantisation scales of fp8 caches (torch.float8_e4m3fn / float8_e5m2 k_cache and
            v_cache with a float16 / bfloat16 q): the attention reads k_cache * k_descale[b, h_k]
            and v_cache * v_descale[b, h_k], and appended rows are stored as
            round_to_fp8(k / k_descale) (include/flashattn.h, "FP8 caches"). None: 1.
    Return:
        out: (batch_size, seqlen, nheads, headdim_v), and softmax_lse when asked for.
    """
    # As in flash_attn_func: _fastpath (C) first, the route for what it does not serve.
    entry = _route.KVCACHE_C
    if entry is None or _route.IS_COMPILING():
        entry = _route.kvcache_any
    return entry(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                 cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_size,
                 softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse,
                 learnable_sink, k_descale, v_descale)


def _out_dtype(kind, out_dtype, out, out_partial):
    if out_dtype is None:
        return out.dtype if out is not None else out_partial.dtype
    if kind == _arrays.TORCH:
        return out_dtype
    return sys.modules["numpy"].dtype(out_dtype)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merges attention computed over disjoint chunks of the keys (FA3's function).

    Arguments:
        out_partial: float32 (num_splits, batch_size, seqlen, nheads, headdim), each chunk's
            normalised output.
        lse_partial: float32 (num_splits, batch_size, seqlen, nheads), each chunk's
            log-sum-exp; -inf (or +inf, what the forward gives a row that sees no key)
            marks an empty chunk, whose output is not read.
        out [optional]: (batch_size, seqlen, nheads, headdim), written in place.
        out_dtype [optional]: float32 (default: out_partial's), float16, bfloat16 or float64.
    Return:
        (out, lse): out (batch_size, seqlen, nheads, headdim) in out_dtype; lse float32
        (batch_size, seqlen, nheads), a transposed view of a (batch_size, nheads, seqlen)
        array as FA3 returns it. A row whose chunks are all empty gets out 0, lse -inf.

    Torch tensors go through the custom op ``torch.ops.flashattn.combine`` (CPU and CUDA).
    """
    kind = _arrays.common_kind([("out_partial", out_partial), ("lse_partial", lse_partial),
                              ("out", out)], 2)
    if kind == _arrays.TORCH:
        # Checked here, the rest inside the op (so that torch.compile traces no more than this).
        _arrays.check_device(out_partial, "out_partial", cuda=True)
        _arrays.check_device(lse_partial, "lse_partial", cuda=True)
    else:
        out_partial = _arrays.prepare(out_partial, "out_partial", kind)
    if len(out_partial.shape) != 5:
        raise FlashAttnError("out_partial: expected 5 dimensions (num_splits, batch_size, "
                             "seqlen, nheads, headdim), got shape %s" % (tuple(out_partial.shape),))
    _, b, sq, h, dv = (int(n) for n in out_partial.shape)
    dtype = _out_dtype(kind, out_dtype, out, out_partial)
    if out is not None:
        if out.dtype != dtype:
            raise FlashAttnError("out: dtype %s does not match out_dtype %s" % (out.dtype, dtype))
        out = _kvcache.in_place(out, "out", kind, "the merged output is written into it",
                                cuda=True)
    elif kind == _arrays.TORCH:
        out = sys.modules["torch"].empty((b, sq, h, dv), dtype=dtype, device=out_partial.device)
    else:
        out = sys.modules["numpy"].empty((b, sq, h, dv), dtype=dtype)
    if kind == _arrays.TORCH:
        return out, _route.torch_ops().combine_call(out_partial, lse_partial, out)
    return out, _kvcache.combine_run(kind, out_partial, lse_partial, out)


# Upstream's compiled module, called positionally (``_raw``).
flash_attn_gpu = _raw.RawEntryPoints(_flash_attn_forward, _flash_attn_varlen_forward,
                                     flash_attn_with_kvcache)
