"""flashattn as an attention implementation of Hugging Face transformers, registered through
transformers' ``AttentionInterface`` (no ``flash_attn`` distribution needed):

    import flashattn.integrations.transformers as fx
    name = fx.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)

``register`` adds ``attention_forward`` to ``AttentionInterface`` and transformers' own
flash-attention mask builder (the 2-D padding mask, or None when nothing is padded; it refuses
the mask rules it would drop) to ``AttentionMaskInterface`` under the same name. The name must
not contain "flash": transformers reads any such name as a flash kernel it has to load itself
(``is_flash_attention_requested``).

``attention_forward`` gets transformers' (batch, heads, seqlen, head_dim) tensors and returns
(out (batch, seqlen, heads, head_dim_v), None). It handles padding (unpadded into the varlen
call), packed sequences (``cu_seq_lens_*`` kwargs, or position_ids that restart), sliding
windows, softcap, sinks (``s_aux``), dropout, GQA/MQA (K/V heads are never repeated), causal
or bidirectional modules and cross-attention. Written for transformers >= 4.53 (where
masking_utils has ``AttentionMaskInterface``).

Continuous batching (``model.generate_batch``, transformers' paged cache) runs through the same
function: the tokens of every request in one row with ``cu_seq_lens_*``, and keys either already
gathered from the paged cache (transformers 5.24 updates the cache before the call), or new
ones this function writes and gathers through the ``cache`` kwarg (transformers 5.17). A
decode batch handed with ``block_table`` and the cache's pages (``k_cache`` / ``v_cache``) goes
to ``flash_attn_with_kvcache``.
"""

import functools

import torch

from ..bert_padding import index_first_axis, pad_input, unpad_input
from ..flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__all__ = ["DEFAULT_NAME", "register", "attention_forward"]

DEFAULT_NAME = "fattn"

# Substrings that make transformers treat a name as one of its own implementations (flash
# kernels, sdpa, flex, eager, paged), and the characters of a Hub kernel reference.
_RESERVED = ("flash", "sdpa", "flex", "eager", "paged", "/", ":", "|")

# The names register() has given out: the continuous-batching manager keeps them (see
# _keep_registered_names).
_NAMES = set()


def register(name=DEFAULT_NAME):
    """Registers ``attention_forward`` (and its mask builder) with transformers under ``name``
    and returns ``name``, the value to pass as ``attn_implementation``."""
    if not isinstance(name, str) or not name:
        raise ValueError("register: name must be a non-empty string, got %r" % (name,))
    taken = [s for s in _RESERVED if s in name.lower()]
    if taken:
        raise ValueError("register: name %r contains %r, which transformers reserves for its own "
                         "implementations; choose another name" % (name, taken[0]))
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as e:
        raise ImportError("flashattn.integrations.transformers needs transformers >= 4.53 "
                          "(AttentionInterface and masking_utils.AttentionMaskInterface): %s"
                          % e) from e
    mask = _mask_builder(flash_attention_mask)
    # "paged|" + name: transformers 5.17's spelling of a paged implementation, which a user may
    # pass to load a model for continuous batching.
    for key in (name, "paged|" + name):
        AttentionInterface.register(key, attention_forward)
        AttentionMaskInterface.register(key, mask)
    _NAMES.update((name, "paged|" + name))
    _keep_registered_names()
    return name


def _keep_registered_names():
    """Lets transformers' continuous-batching manager run a model under a name register() gave.
    transformers 5.24 refuses any name but "sdpa", "paged|eager" and flash kernels there,
    although the function it calls gets the same arguments as theirs; the manager's switch is
    wrapped once to leave these names as they are and to act as before on every other name."""
    try:
        from transformers.generation.continuous_batching import continuous_api
    except ImportError:  # a transformers without continuous batching
        return
    manager = getattr(continuous_api, "ContinuousBatchingManager", None)
    switch = getattr(manager, "switch_to_cb_friendly_attn", None)
    if switch is None or getattr(switch, "_flashattn_keeps", False):
        return

    @functools.wraps(switch)
    def keep(self, model, *args, **kwargs):
        if getattr(model.config, "_attn_implementation", None) in _NAMES:
            return None
        return switch(self, model, *args, **kwargs)

    keep._flashattn_keeps = True
    manager.switch_to_cb_friendly_attn = keep


def _mask_builder(flash_attention_mask):
    """transformers' flash mask builder (the 2-D padding mask, or None), refusing the masks it
    would silently drop: rules a model adds beyond padding, causality, windows and packing (its
    or/and mask functions, flagged by use_vmap in transformers 5) and chunked attention."""

    def build(*args, use_vmap=False, config=None, **kwargs):
        if use_vmap:
            raise NotImplementedError(
                "flashattn: this model adds its own mask rules (or/and mask functions, such as "
                "bidirectional spans); use attn_implementation='sdpa' or 'eager'")
        if getattr(config, "attention_chunk_size", None) is not None:
            raise NotImplementedError(
                "flashattn: chunked attention (config.attention_chunk_size) is not supported; "
                "use attn_implementation='sdpa' or 'eager'")
        return flash_attention_mask(*args, config=config, **kwargs)

    return build


def _window(sliding_window, causal):
    """transformers' sliding_window W as upstream's (left, right). Causal: query i sees keys
    i - W < j <= i, so left = W - 1. Bidirectional: |i - j| <= W (transformers'
    sliding_window_bidirectional_overlay), so (W, W)."""
    if sliding_window is None:
        return (-1, -1)
    w = int(sliding_window)
    if w < 1:
        raise ValueError("sliding_window must be >= 1, got %d" % w)
    return (w - 1, 0) if causal else (w, w)


def _as_int(x):
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def _cu_seqlens(cu, name):
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError("%s must be 1-D with at least 2 offsets, got shape %s"
                         % (name, tuple(cu.shape)))
    return cu.to(torch.int32)


def _packed_offsets(position_ids, batch, seqlen):
    """cu_seqlens (int32) of the sequences packed in the rows of position_ids, where a sequence
    starts wherever a position is not its predecessor + 1 (as transformers' masks read packing);
    None when every row holds one sequence."""
    if position_ids is None or position_ids.ndim != 2 or position_ids.shape[-1] != seqlen \
            or seqlen < 2 or position_ids.shape[0] not in (1, batch):
        return None
    pos = position_ids.expand(batch, seqlen)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    first = torch.nonzero(starts.flatten(), as_tuple=False).flatten()
    total = torch.tensor([batch * seqlen], device=first.device, dtype=first.dtype)
    return torch.cat((first, total)).to(torch.int32)


def _packed(q, k, v, cu_q, cu_k, max_q, max_k, opts):
    """Sequences packed in the rows of a batch: q (b, sq, h, d), k/v (b, sk, hk, d[v]) with
    cu_q / cu_k offsets into the flattened (b * sq) / (b * sk) tokens -> (b, sq, h, dv)."""
    out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                 v.reshape(-1, *v.shape[2:]), cu_q, cu_k, max_q, max_k, **opts)
    return out.view(q.shape[0], q.shape[1], *out.shape[1:])


def _of_layer(x, layer_type, name):
    """x, or its entry for this layer's type where transformers gives one per type."""
    if not isinstance(x, dict):
        return x
    if layer_type in x:
        return x[layer_type]
    if len(x) == 1:
        return next(iter(x.values()))
    raise ValueError("%s: no entry for %r among %s" % (name, layer_type, sorted(x)))


def _paged_gather(module, key, value, cache, kwargs):
    """Writes the new keys / values (1, heads_k, new, d) into transformers' paged cache and
    returns every request's keys / values as one row (1, total_k, heads_k, d), the request
    order of cu_seq_lens_k (transformers 5.17, where the attention function does this)."""
    if "read_index" not in kwargs or "write_index" not in kwargs:
        raise ValueError("flashattn: a paged cache needs the read_index and write_index of the "
                         "batch")
    k, v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                        read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    if k.ndim == 3:  # (total_k, heads_k, d)
        return k.unsqueeze(0), v.unsqueeze(0)
    return k.transpose(1, 2), v.transpose(1, 2)


def _paged_decode(q, k, v, k_cache, v_cache, block_table, cu_k, opts):
    """A decode batch on a paged cache: q (1, r, h, d) and k/v (1, r, hk, d) hold one new
    token per request; each is appended to its request's pages (block_table (r, blocks)) after
    the cu_k[i + 1] - cu_k[i] - 1 keys already there, then attends to them -> (1, r, h, dv)."""
    if k_cache is None or v_cache is None:
        raise NotImplementedError("flashattn: block_table needs the paged cache as k_cache and "
                                  "v_cache (pages, page_size, heads_k, head_dim)")
    if opts["dropout_p"] > 0.0:
        raise ValueError("flashattn: dropout is not supported on a paged cache (decoding)")
    r = q.shape[1]
    if block_table.ndim != 2 or block_table.shape[0] != r or cu_k.shape[0] < r + 1:
        raise ValueError("block_table: expected (requests=%d, blocks) with cu_seq_lens_k of at "
                         "least %d offsets, got %s and %d" % (r, r + 1, tuple(block_table.shape),
                                                              cu_k.shape[0]))
    cache_seqlens = (cu_k[1:r + 1] - cu_k[:r] - 1).to(torch.int32)
    out = flash_attn_with_kvcache(
        q.transpose(0, 1), k_cache, v_cache, k.transpose(0, 1), v.transpose(0, 1),
        cache_seqlens=cache_seqlens, block_table=block_table.to(torch.int32),
        softmax_scale=opts["softmax_scale"], causal=opts["causal"],
        window_size=opts["window_size"], softcap=opts["softcap"],
        learnable_sink=opts["learnable_sink"])
    return out.transpose(0, 1)


def _padded(q, k, v, mask, opts):
    """Attention over a padded batch: q (b, sq, h, d), k/v (b, sk, hk, d[v]), mask (b, L) with 1
    on the keys' valid tokens, L <= sk (a static cache keeps unused slots past L).

    Causal (self-attention): the queries are the mask's last sq columns (a single query is
    always valid). Not causal: the queries may be another sequence (cross-attention), so every
    query row is kept and only the keys are unpadded, except under a window, whose alignment
    needs the queries unpadded alike (self-attention, sq == L)."""
    if mask.ndim != 2 or mask.shape[0] != q.shape[0] or mask.shape[1] > k.shape[1]:
        raise ValueError("attention_mask: expected the 2-D padding mask (batch=%d, <= %d keys) "
                         "built by the mask function register() installs, got shape %s"
                         % (q.shape[0], k.shape[1], tuple(mask.shape)))
    b, sq = q.shape[0], q.shape[1]
    seen = mask.shape[1]
    windowed = opts["window_size"] != (-1, -1)
    k_unpad, idx_k, cu_k, max_k, _ = unpad_input(k[:, :seen], mask)
    v_unpad = index_first_axis(v[:, :seen].reshape(b * seen, *v.shape[2:]), idx_k)
    if sq == seen and (opts["causal"] or windowed):
        idx_q, cu_q, max_q = idx_k, cu_k, max_k
        q_unpad = index_first_axis(q.reshape(b * sq, *q.shape[2:]), idx_q)
    elif sq == 1 or not opts["causal"]:
        if windowed and not opts["causal"]:
            raise ValueError("attention_mask: a bidirectional sliding window needs as many "
                             "queries as mask columns (%d), got %d" % (seen, sq))
        cu_q = torch.arange(0, (b + 1) * sq, sq, device=q.device, dtype=torch.int32)
        out = flash_attn_varlen_func(q.reshape(b * sq, *q.shape[2:]), k_unpad, v_unpad, cu_q,
                                     cu_k, sq, max_k, **opts)
        return out.view(b, sq, *out.shape[1:])
    else:
        q_unpad, idx_q, cu_q, max_q, _ = unpad_input(q, mask[:, -sq:])
    out = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_q, cu_k, max_q, max_k, **opts)
    return pad_input(out, idx_q, b, sq)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, s_aux=None,
                      position_ids=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                      max_length_q=None, max_length_k=None, position_bias=None,
                      block_table=None, cache=None, k_cache=None, v_cache=None, **kwargs):
    """transformers' attention function signature.

    query: (batch, heads, seqlen_q, head_dim); key, value: (batch, heads_k, seqlen_k, head_dim
    / head_dim_v), heads % heads_k == 0. attention_mask: None or the 2-D padding mask (batch,
    <= seqlen_k) of the registered mask builder. s_aux: (heads,) sink logits. Returns
    (out (batch, seqlen_q, heads, head_dim_v), None): no attention weights are materialised.

    Continuous batching (batch 1, every request's tokens in the row): cu_seq_lens_q / _k with
    max_length_q / _k (max_seqlen_q / _k in transformers 5.17; per layer type dicts where
    the cache has several); cache: the paged cache that gathers the keys, when transformers
    has not done it itself (read_index / write_index in kwargs); block_table (requests,
    blocks) int32 with k_cache / v_cache (pages, page_size, heads_k, head_dim): a decode batch
    (one query per request) appended to and read from the pages.
    """
    if position_bias is not None:
        raise NotImplementedError("flashattn: position_bias (an additive score bias) is not "
                                  "supported; use attn_implementation='eager' or 'sdpa'")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    opts = {"dropout_p": float(dropout or 0.0), "softmax_scale": scaling, "causal": causal,
            "window_size": _window(sliding_window, causal),
            "softcap": float(softcap) if softcap else 0.0, "learnable_sink": s_aux}
    b, sq = query.shape[0], query.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (b, s, h, d)

    paged = cache is not None or block_table is not None
    if attention_mask is not None and not paged:
        return _padded(q, k, v, attention_mask, opts), None
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        if cu_seq_lens_q is None or cu_seq_lens_k is None:
            raise ValueError("cu_seq_lens_q and cu_seq_lens_k must be given together")
        # transformers 5.17's names, and the per-layer-type dicts of a hybrid cache.
        layer_type = "sliding_attention" if sliding_window is not None else "full_attention"
        max_q = _of_layer(max_length_q if max_length_q is not None
                          else kwargs.get("max_seqlen_q"), layer_type, "max_length_q")
        max_k = _of_layer(max_length_k if max_length_k is not None
                          else kwargs.get("max_seqlen_k"), layer_type, "max_length_k")
        cu_q = _cu_seqlens(_of_layer(cu_seq_lens_q, layer_type, "cu_seq_lens_q"), "cu_seq_lens_q")
        cu_k = _cu_seqlens(_of_layer(cu_seq_lens_k, layer_type, "cu_seq_lens_k"), "cu_seq_lens_k")
        if block_table is not None:
            return _paged_decode(q, k, v, k_cache, v_cache, block_table, cu_k, opts), None
        if cache is not None:
            k, v = _paged_gather(module, key, value, cache, kwargs)
        max_q = _as_int(max_q if max_q is not None else cu_q.diff().max())
        max_k = _as_int(max_k if max_k is not None else cu_k.diff().max())
        return _packed(q, k, v, cu_q, cu_k, max_q, max_k, opts), None
    if paged:
        raise ValueError("flashattn: a paged cache (cache / block_table) needs the cu_seq_lens_q "
                         "and cu_seq_lens_k of its requests")
    # Packing read from position_ids is a causal self-attention matter (transformers' masks
    # read it only there).
    cu = _packed_offsets(position_ids, b, sq) if causal and k.shape[1] == sq else None
    if cu is not None:
        longest = _as_int(cu.diff().max())
        return _packed(q, k, v, cu, cu, longest, longest, opts), None
    return flash_attn_func(q, k, v, **opts), None
