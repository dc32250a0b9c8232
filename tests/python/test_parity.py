"""API parity with upstream flash_attn: module layout, signatures of the helper modules (as in
upstream's flash_attn/{bert_padding,layers/rotary,modules/mha,utils/generation}.py), MHA's
parameter names, and the return shapes and dtypes of every public forward function."""

import dataclasses
import inspect

import numpy as np
import pytest
import torch

import flashattn
from flashattn import bert_padding
from flashattn.layers import rotary
from flashattn.modules import mha
from flashattn.utils.generation import InferenceParams

E = inspect.Parameter.empty

UPSTREAM_SIGNATURES = {
    bert_padding.unpad_input: [("hidden_states", E), ("attention_mask", E),
                               ("unused_mask", None)],
    bert_padding.pad_input: [("hidden_states", E), ("indices", E), ("batch", E), ("seqlen", E)],
    bert_padding.unpad_input_for_concatenated_sequences: [("hidden_states", E),
                                                          ("attention_mask_in_length", E)],
    rotary.rotate_half: [("x", E), ("interleaved", False)],
    rotary.apply_rotary_emb_torch: [("x", E), ("cos", E), ("sin", E), ("interleaved", False)],
    rotary.apply_rotary_emb: [("x", E), ("cos", E), ("sin", E), ("interleaved", False),
                              ("inplace", False), ("seqlen_offsets", 0), ("cu_seqlens", None),
                              ("max_seqlen", None)],
    rotary.apply_rotary_emb_qkv_: [("qkv", E), ("cos", E), ("sin", E), ("cos_k", None),
                                   ("sin_k", None), ("interleaved", False), ("seqlen_offsets", 0),
                                   ("num_heads_q", None)],
    rotary.apply_rotary_emb_kv_: [("kv", E), ("cos", E), ("sin", E), ("interleaved", False),
                                  ("seqlen_offsets", 0)],
    rotary.RotaryEmbedding.__init__: [("self", E), ("dim", E), ("base", 10000.0),
                                      ("interleaved", False), ("scale_base", None),
                                      ("device", None)],
    rotary.RotaryEmbedding.forward: [("self", E), ("qkv", E), ("kv", None), ("seqlen_offset", 0),
                                     ("max_seqlen", None), ("num_heads_q", None)],
    mha.get_alibi_slopes: [("nheads", E)],
    mha.FlashSelfAttention.__init__: [("self", E), ("causal", False), ("softmax_scale", None),
                                      ("attention_dropout", 0.0), ("window_size", (-1, -1)),
                                      ("alibi_slopes", None), ("deterministic", False)],
    mha.FlashSelfAttention.forward: [("self", E), ("qkv", E), ("causal", None),
                                     ("cu_seqlens", None), ("max_seqlen", None)],
    mha.FlashCrossAttention.__init__: [("self", E), ("causal", False), ("softmax_scale", None),
                                       ("attention_dropout", 0.0), ("alibi_slopes", None),
                                       ("window_size", (-1, -1)), ("deterministic", False)],
    mha.FlashCrossAttention.forward: [("self", E), ("q", E), ("kv", E), ("causal", None),
                                      ("cu_seqlens", None), ("max_seqlen", None),
                                      ("cu_seqlens_k", None), ("max_seqlen_k", None)],
    mha.SelfAttention.__init__: [("self", E), ("causal", False), ("softmax_scale", None),
                                 ("attention_dropout", 0.0)],
    mha.SelfAttention.forward: [("self", E), ("qkv", E), ("causal", None),
                                ("key_padding_mask", None)],
    mha.CrossAttention.forward: [("self", E), ("q", E), ("kv", E), ("causal", None),
                                 ("key_padding_mask", None)],
    mha.MHA.__init__: [("self", E), ("embed_dim", E), ("num_heads", E), ("num_heads_kv", None),
                       ("cross_attn", False), ("qkv_proj_bias", True), ("out_proj_bias", True),
                       ("dropout", 0.0), ("softmax_scale", None), ("causal", False),
                       ("layer_idx", None), ("dwconv", False), ("rotary_emb_dim", 0),
                       ("rotary_emb_base", 10000.0), ("rotary_emb_scale_base", None),
                       ("rotary_emb_interleaved", False), ("use_alibi", False),
                       ("window_size", (-1, -1)), ("fused_bias_fc", False),
                       ("use_flash_attn", False), ("return_residual", False),
                       ("checkpointing", False), ("device", None), ("dtype", None)],
    mha.MHA.forward: [("self", E), ("x", E), ("x_kv", None), ("key_padding_mask", None),
                      ("cu_seqlens", None), ("max_seqlen", None), ("mixer_subset", None),
                      ("inference_params", None), ("kwargs", E)],
    mha.MHA.allocate_inference_cache: [("self", E), ("batch_size", E), ("max_seqlen", E),
                                       ("dtype", None)],
}


@pytest.mark.parametrize("fn", list(UPSTREAM_SIGNATURES),
                         ids=lambda f: f.__qualname__)
def test_helper_signatures(fn):
    got = [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]
    assert got == UPSTREAM_SIGNATURES[fn]


def test_module_layout_and_aliases():
    assert rotary.apply_rotary_emb_func is rotary.apply_rotary_emb
    for name in ("index_first_axis", "index_put_first_axis", "index_first_axis_residual"):
        assert callable(getattr(bert_padding, name))
    fields = [(f.name, f.default) for f in dataclasses.fields(InferenceParams)]
    assert [n for n, _ in fields] == ["max_seqlen", "max_batch_size", "seqlen_offset",
                                      "batch_size_offset", "key_value_memory_dict",
                                      "lengths_per_sample"]
    interface = flashattn.flash_attn_interface
    assert interface.flash_attn_with_kvcache is flashattn.flash_attn_with_kvcache


@pytest.mark.parametrize("cfg", [dict(), dict(num_heads_kv=2), dict(cross_attn=True),
                                 dict(dwconv=True), dict(dwconv=True, num_heads_kv=2),
                                 dict(rotary_emb_dim=8)])
def test_mha_state_dict_keys_are_upstreams(cfg):
    m = mha.MHA(32, 4, **cfg)
    if cfg.get("cross_attn"):
        want = {"Wq.weight", "Wq.bias", "Wkv.weight", "Wkv.bias"}
    else:
        want = {"Wqkv.weight", "Wqkv.bias"}
    if cfg.get("dwconv"):
        names = ["dwconv_qkv"] if "num_heads_kv" not in cfg else ["dwconv_q", "dwconv_kv"]
        want |= {"%s.%s" % (n, p) for n in names for p in ("weight", "bias")}
    want |= {"out_proj.weight", "out_proj.bias"}
    assert set(m.state_dict()) == want  # rotary tables are non-persistent buffers
    head = m.head_dim
    qkv_out = head * (4 + 2 * cfg.get("num_heads_kv", 4))
    if not cfg.get("cross_attn"):
        assert m.Wqkv.weight.shape == (qkv_out, 32)


def _inputs(kind, dtype, *shapes):
    rng = np.random.default_rng(0)
    out = []
    for s in shapes:
        t = torch.tensor(rng.standard_normal(s), dtype=dtype)
        out.append(t if kind == "torch" else t.numpy())
    return out


KIND_DTYPES = [("torch", torch.float16), ("torch", torch.bfloat16), ("torch", torch.float32),
               ("torch", torch.float64), ("numpy", torch.float16), ("numpy", torch.float32),
               ("numpy", torch.float64)]


@pytest.mark.parametrize("kind,dtype", KIND_DTYPES, ids=lambda x: str(x))
def test_return_shapes_and_dtypes(kind, dtype):
    b, sq, sk, h, hk, d = 2, 5, 7, 4, 2, 16
    q, k, v = _inputs(kind, dtype, (b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))
    cu_q = np.array([0, 2, 5], dtype=np.int32)
    cu_k = np.array([0, 3, 7], dtype=np.int32)
    if kind == "torch":
        cu_q, cu_k = torch.from_numpy(cu_q), torch.from_numpy(cu_k)
    mod = torch if kind == "torch" else np
    kv = mod.stack([k, v], 2) if kind == "torch" else np.stack([k, v], 2)
    qkv = mod.stack([q, q, q], 2) if kind == "torch" else np.stack([q, q, q], 2)
    calls = {
        "flash_attn_func": (lambda **kw: flashattn.flash_attn_func(q, k, v, **kw), (b, sq, h, d),
                            (b, h, sq), (b, h, 128, 128)),
        "flash_attn_kvpacked_func": (lambda **kw: flashattn.flash_attn_kvpacked_func(q, kv, **kw),
                                     (b, sq, h, d), (b, h, sq), (b, h, 128, 128)),
        "flash_attn_qkvpacked_func": (lambda **kw: flashattn.flash_attn_qkvpacked_func(qkv, **kw),
                                      (b, sq, h, d), (b, h, sq), (b, h, 128, 128)),
        "flash_attn_varlen_func": (
            lambda **kw: flashattn.flash_attn_varlen_func(q.reshape(b * sq, h, d),
                                                          k.reshape(b * sk, hk, d),
                                                          v.reshape(b * sk, hk, d), cu_q, cu_k,
                                                          3, 4, **kw),
            (b * sq, h, d), (h, b * sq), (b, h, 128, 128)),
        "flash_attn_varlen_kvpacked_func": (
            lambda **kw: flashattn.flash_attn_varlen_kvpacked_func(
                q.reshape(b * sq, h, d), kv.reshape(b * sk, 2, hk, d), cu_q, cu_k, 3, 4, **kw),
            (b * sq, h, d), (h, b * sq), (b, h, 128, 128)),
        "flash_attn_varlen_qkvpacked_func": (
            lambda **kw: flashattn.flash_attn_varlen_qkvpacked_func(
                qkv.reshape(b * sq, 3, h, d), cu_q, 3, **kw),
            (b * sq, h, d), (h, b * sq), (b, h, 128, 128)),
    }
    for name, (call, out_shape, lse_shape, s_shape) in calls.items():
        out = call()
        assert tuple(out.shape) == out_shape and out.dtype == q.dtype, name
        for p, want_s in ((0.0, (0,)), (0.1, s_shape)):
            out, lse, S = call(dropout_p=p, return_attn_probs=True)
            assert tuple(out.shape) == out_shape and out.dtype == q.dtype, name
            assert tuple(lse.shape) == lse_shape, name
            assert str(lse.dtype).endswith("float32"), name
            assert tuple(S.shape) == want_s and S.dtype == q.dtype, name
