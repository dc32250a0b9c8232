"""The route from the public forward functions to the C library.

    flash_attn_interface (public signatures)
      -> _route.dense / _route.varlen (array kind, flags; upstream's internal forwards)
         torch:  -> _torch_ops.dense / varlen (eager call, autograd, or the custom op)
                 -> _cached (the prepared call of the signature, or its preparation)
         NumPy:  -> _core.forward
      -> _core (arguments checked and converted into fa_fwd_args) -> _lib -> the library

``_fastpath`` (C) is a cache in front of this route for ``flash_attn_func``'s and
``flash_attn_with_kvcache``'s commonest torch calls: it looks the call's signature up among
_cached's prepared calls and hands every call it does not serve to ``dense_any`` /
``kvcache_any``, so the route is the same whichever serves it (and in front of
``flex.flex_any`` for ``flex_attention``'s repeated calls). Scalars pass down
as the caller gave them; ``_core`` converts and checks them where it fills the C arguments
(the default softmax scale included), so that a prepared call's signature holds the caller's
values.
"""

from . import _arrays, _core, _kvcache
from ._dlpack import accepts_dlpack

__all__ = ["DENSE_ARGS", "KV_ARGS", "dense", "dense_any", "forward", "kvcache_any", "varlen",
           "varlen_forward"]

# flash_attn_func's arguments in order, as ``dense`` and _fastpath (which reads it) take them.
DENSE_ARGS = ("q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
              "alibi_slopes", "deterministic", "return_attn_probs", "learnable_sink")

# flash_attn_with_kvcache's arguments in order (learnable_sink and the fp8 caches' descales,
# keyword-only there, last), as ``kvcache_any`` and _fastpath take them.
KV_ARGS = ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
           "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal",
           "window_size", "softcap", "rotary_interleaved", "alibi_slopes", "num_splits",
           "return_softmax_lse", "learnable_sink", "k_descale", "v_descale")

_TORCH_OPS = []  # flashattn._torch_ops once a torch call has imported it (and torch)
DENSE_C = None  # _fastpath.dense bound to torch (None: not built, or no torch call yet)
KVCACHE_C = None  # _fastpath.kvcache, with DENSE_C
IS_COMPILING = None  # torch.compiler.is_compiling, with DENSE_C
_FLEX = []  # (flex.fastpath_table, flex.bound), given by the package: flex reaches this module


def use_flex(table, bound):
    """flex_attention's C entry is bound with the others (``torch_ops``): ``table()`` gives
    bind() its entries, ``bound(entry, is_compiling, compiled)`` receives the bound entry and
    the route of compiled calls."""
    _FLEX[:] = [(table, bound)]


def torch_ops():
    """_torch_ops, imported when the package meets torch (its import, or torch's after it; see
    ``flashattn._bind_torch``) or on the first torch call, with the C fast path bound in front
    of ``dense_any``. Binding before any call keeps it out of a first call that torch.compile
    traces (Dynamo cannot trace the C binding)."""
    global DENSE_C, KVCACHE_C, IS_COMPILING
    if not _TORCH_OPS:
        from . import _torch_ops as module

        _TORCH_OPS.append(module)
        IS_COMPILING = module.torch.compiler.is_compiling
        flex_table, flex_bound = _FLEX[0] if _FLEX else (lambda: None, lambda *a: None)
        DENSE_C, KVCACHE_C, flex_c = module.bind_fastpath(dense_any, DENSE_ARGS, kvcache_any,
                                                          KV_ARGS, flex_table())
        flex_bound(flex_c, IS_COMPILING, module.flex_compiled)
    return _TORCH_OPS[0]


def _positive(dropout_p):
    return _core.as_float(dropout_p, "dropout_p") > 0.0


def _empty_dmask(kind, q):
    return _arrays.empty(kind, (0,), q)


def _seed_for(dropout_p):
    """The seed of a NumPy call (torch calls draw theirs inside ``_torch_ops``)."""
    return _arrays.draw_seed() if _positive(dropout_p) else 0


def forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
            softcap, alibi_slopes, return_softmax, learnable_sink=None, *, _kind=None,
            _names=None, _deterministic=False):
    """Upstream's ``_flash_attn_forward``: (out, softmax_lse, S_dmask, rng_state).

    S_dmask is (0,) unless return_softmax; rng_state is int64 [seed, offset]. Torch tensors go
    through the differentiable op ``torch.ops.flashattn.fwd``."""
    kind = _kind or _arrays.common_kind(
        [("q", q), ("k", k), ("v", v), ("alibi_slopes", alibi_slopes),
         ("learnable_sink", learnable_sink)], 3)
    if kind == _arrays.TORCH:
        return torch_ops().dense(q, k, v, dropout_p, softmax_scale, causal,
                            _core.window_pair((window_size_left, window_size_right)), softcap,
                            alibi_slopes, _deterministic, return_softmax, learnable_sink,
                            _names)
    seed = _seed_for(dropout_p)
    out, lse, probs = _core.forward(
        q, k, v, kind=kind, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_size_left, window_size_right), softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=learnable_sink, return_softmax=return_softmax,
        seed=seed, offset=0, names=_names)
    S_dmask = probs if return_softmax else _empty_dmask(kind, q)
    return out, lse, S_dmask, _arrays.rng_state_array(seed, 0)


def _wants_grad(tensors):
    """Whether autograd records a call on these arrays (torch tensors that require grad, with
    grad mode on); torch is imported only when one could."""
    if not any(getattr(t, "requires_grad", False) for t in tensors if t is not None):
        return False
    import torch

    return torch.is_grad_enabled()


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                   softcap=0.0, alibi_slopes=None, return_softmax=False, block_table=None,
                   leftpad_k=None, seqused_k=None, zero_tensors=False, num_splits=0,
                   learnable_sink=None, *, _kind=None, _names=None, _deterministic=False):
    """Upstream's ``_flash_attn_varlen_forward``: (out, softmax_lse, S_dmask, rng_state);
    torch tensors go through ``torch.ops.flashattn.varlen_fwd``."""
    if leftpad_k is not None:
        raise NotImplementedError("flashattn: leftpad_k is not supported yet by this build")
    num_splits = _core.as_int(num_splits, "num_splits", _core.INT32)
    if block_table is not None:
        if num_splits > 1:
            # Upstream's message: the paged varlen forward has no split-KV.
            raise _core.FlashAttnError("num_splits > 1 is not supported for varlen paged KV "
                                       "(num_splits=%d)" % num_splits)
        if _wants_grad((q, k, v, alibi_slopes, learnable_sink)):
            # The library reads pages in place in its forward only (upstream has no paged
            # backward): gathered by torch ops, the pages get their gradients.
            from . import _paged  # imports torch: only on this path

            k, v, cu_seqlens_k, seqused_k = _paged.paged_kv(k, v, cu_seqlens_k, block_table,
                                                            max_seqlen_k, seqused_k)
            block_table = None
    kind = _kind or _arrays.common_kind(
        [("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
         ("cu_seqlens_k", cu_seqlens_k), ("seqused_k", seqused_k),
         ("block_table", block_table), ("alibi_slopes", alibi_slopes),
         ("learnable_sink", learnable_sink)], 5)
    if kind == _arrays.TORCH:
        out, lse, S_dmask, rng_state = torch_ops().varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, _core.window_pair((window_size_left, window_size_right)),
            softcap, alibi_slopes, _deterministic, return_softmax, learnable_sink, seqused_k,
            _names, block_table=block_table)
    else:
        seed = _seed_for(dropout_p)
        out, lse, probs = _core.forward(
            q, k, v, kind=kind, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
            window_size=(window_size_left, window_size_right), softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=learnable_sink, return_softmax=return_softmax,
            seed=seed, offset=0, names=_names, block_table=block_table)
        S_dmask = probs if return_softmax else _empty_dmask(kind, q)
        rng_state = _arrays.rng_state_array(seed, 0)
    if _core.as_bool(zero_tensors, "zero_tensors"):
        # Upstream pre-fills lse with -inf (and out with 0) when zero_tensors; rows outside every
        # sequence keep those values. The C library writes 0 / +inf there: patch lse.
        _arrays.fill_uncovered_rows(lse, cu_seqlens_q, kind, float("-inf"))
    return out, lse, S_dmask, rng_state


def dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
          deterministic, return_attn_probs, learnable_sink, kind=None, names=None):
    """flash_attn_func (and the packed forms, which pass their slices, the array ``kind`` and
    the ``names`` of q, k and v): out, or (out, softmax_lse, S_dmask)."""
    if kind is None:
        kind = _arrays.common_kind([("q", q), ("k", k), ("v", v), ("alibi_slopes", alibi_slopes),
                                  ("learnable_sink", learnable_sink)], 3)
    window = _core.window_pair(window_size)
    return_attn_probs = _core.as_bool(return_attn_probs, "return_attn_probs")
    deterministic = _core.as_bool(deterministic, "deterministic")
    return_softmax = return_attn_probs and _positive(dropout_p)
    if kind == _arrays.TORCH:
        out, lse, S_dmask = torch_ops().dense(q, k, v, dropout_p, softmax_scale, causal, window,
                                         softcap, alibi_slopes, deterministic, return_softmax,
                                         learnable_sink, names, want=return_attn_probs)
        if S_dmask is None and return_attn_probs:
            S_dmask = _empty_dmask(kind, q)
    else:
        out, lse, S_dmask, _ = forward(q, k, v, dropout_p, softmax_scale, causal, window[0],
                                       window[1], softcap, alibi_slopes, return_softmax,
                                       learnable_sink, _kind=kind, _names=names)
    return (out, lse, S_dmask) if return_attn_probs else out


# flash_attn_func's route for any array (DLPack ones converted), and _fastpath's fallback.
dense_any = accepts_dlpack(dense)


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
           softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
           return_attn_probs, learnable_sink, kind, names=None, block_table=None):
    """The varlen functions: out, or (out, softmax_lse, S_dmask)."""
    left, right = _core.window_pair(window_size)
    return_attn_probs = _core.as_bool(return_attn_probs, "return_attn_probs")
    deterministic = _core.as_bool(deterministic, "deterministic")
    return_softmax = return_attn_probs and _positive(dropout_p)
    out, lse, S_dmask, _ = varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, left, right, softcap, alibi_slopes, return_softmax,
        block_table=block_table, learnable_sink=learnable_sink, _kind=kind, _names=names,
        _deterministic=deterministic)
    return (out, lse, S_dmask) if return_attn_probs else out


def kvcache_any(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_size,
                softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse,
                learnable_sink, k_descale=None, v_descale=None):
    """flash_attn_with_kvcache (its arguments in ``KV_ARGS``' order), and _fastpath's fallback:
    out, or (out, softmax_lse)."""
    kind = _arrays.common_kind(
        [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
         ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
         ("cache_seqlens", cache_seqlens if _kvcache.is_array(cache_seqlens) else None),
         ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
         ("block_table", block_table), ("alibi_slopes", alibi_slopes),
         ("learnable_sink", learnable_sink), ("k_descale", k_descale),
         ("v_descale", v_descale)], 3)
    if kind == _arrays.TORCH:
        # torch calls go through the custom op flashattn::kvcache, so torch.compile keeps the
        # call (and its in-place append) as one node instead of breaking the graph.
        out, lse = torch_ops().kvcache_call(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, alibi_slopes, learnable_sink, softmax_scale, causal,
            window_size, softcap, rotary_interleaved, num_splits, return_softmax_lse,
            k_descale=k_descale, v_descale=v_descale)
    else:
        out, lse = _kvcache.kvcache_run(kind, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                        cache_seqlens, cache_batch_idx, cache_leftpad,
                                        block_table, alibi_slopes, learnable_sink, softmax_scale,
                                        causal, window_size, softcap, rotary_interleaved,
                                        num_splits, k_descale=k_descale, v_descale=v_descale)
    return (out, lse) if return_softmax_lse else out
