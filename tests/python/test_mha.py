"""flashattn.modules.mha.MHA against a plain PyTorch multi-head attention written here from the
module's weights: self and cross attention, GQA, causal, sliding window, ALiBi, rotary, the
unfused (use_flash_attn=False) path, varlen, gradients, and generation with a KV cache (prompt,
then token-by-token decoding through flash_attn_with_kvcache) against the full sequence."""

import math

import pytest
import torch

from flashattn import flash_attn_with_kvcache
from flashattn.bert_padding import pad_input, unpad_input
from flashattn.modules import mha as mha_module
from flashattn.modules.mha import MHA, get_alibi_slopes
from flashattn.utils.generation import InferenceParams


def plain_rotary(x, dim, base, interleaved, offset=0):
    """x (b, s, h, d): rotate the first dim features at positions offset.., with the angles in
    fp32 as upstream's tables hold them."""
    s = x.shape[1]
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ang = (torch.arange(s, dtype=torch.float32) + offset)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
    if interleaved:
        a, b = x[..., 0:dim:2], x[..., 1:dim:2]
        rot = torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)
    else:
        a, b = x[..., :dim // 2], x[..., dim // 2:dim]
        rot = torch.cat((a * cos - b * sin, a * sin + b * cos), -1)
    return torch.cat((rot, x[..., dim:]), -1)


def plain_mha(m, x, x_kv=None, causal=False, window=(-1, -1), alibi=None, rotary=None):
    """Reference attention from m's weights: projections, optional rotary, GQA by repetition,
    an explicit mask (bottom-right aligned causal / window), softmax, output projection."""
    h, hk, d = m.num_heads, m.num_heads_kv, m.head_dim
    b, sq = x.shape[:2]
    if m.cross_attn:
        q = m.Wq(x).view(b, sq, h, d)
        kv = m.Wkv(x_kv if x_kv is not None else x)
        k, v = kv.view(b, kv.shape[1], 2, hk, d).unbind(2)
    else:
        qkv = m.Wqkv(x)
        q = qkv[..., :h * d].view(b, sq, h, d)
        k, v = qkv[..., h * d:].view(b, sq, 2, hk, d).unbind(2)
    if rotary is not None:
        q, k = (plain_rotary(t, *rotary) for t in (q, k))
    k, v = (t.repeat_interleave(h // hk, dim=2) for t in (k, v))
    sk = k.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    if alibi is not None:
        scores = scores - alibi[None, :, None, None] * (i - j).abs()
    left, right = window
    right = 0 if causal else right
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return m.out_proj(out.reshape(b, sq, h * d))


def _x(rng, *shape, dtype=torch.float64):
    return torch.tensor(rng.standard_normal(shape), dtype=dtype)


CASES = [
    dict(num_heads=4),
    dict(num_heads=4, causal=True),
    dict(num_heads=4, num_heads_kv=2, causal=True, window_size=(3, 0)),
    dict(num_heads=8, num_heads_kv=1, use_alibi=True),
    dict(num_heads=4, num_heads_kv=2, causal=True, rotary_emb_dim=8),
    dict(num_heads=2, causal=True, rotary_emb_dim=16, rotary_emb_interleaved=True),
    dict(num_heads=4, num_heads_kv=2, cross_attn=True),
]


def _ids(case):
    return ",".join("%s=%s" % kv for kv in case.items())


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_mha_matches_plain_attention(rng, case):
    torch.manual_seed(int(rng.integers(2**31)))
    m = MHA(32, use_flash_attn=True, dtype=torch.float64, **case)
    x = _x(rng, 2, 9, 32)
    x_kv = _x(rng, 2, 13, 32) if case.get("cross_attn") else None
    rotary = None
    if case.get("rotary_emb_dim"):
        rotary = (case["rotary_emb_dim"], 10000.0, case.get("rotary_emb_interleaved", False))
    alibi = torch.tensor(get_alibi_slopes(case["num_heads"]), dtype=torch.float64) \
        if case.get("use_alibi") else None
    want = plain_mha(m, x, x_kv, causal=case.get("causal", False),
                     window=case.get("window_size", (-1, -1)), alibi=alibi, rotary=rotary)
    got = m(x, x_kv=x_kv)
    assert got.shape == (2, 9, 32)
    assert torch.allclose(got, want, atol=1e-10)
    if not case.get("use_alibi") and case.get("window_size", (-1, -1)) == (-1, -1):
        # upstream's unfused path, same weights
        plain = MHA(32, use_flash_attn=False, dtype=torch.float64, **case)
        plain.load_state_dict(m.state_dict())
        assert torch.allclose(plain(x, x_kv=x_kv), want, atol=1e-10)


def test_alibi_slopes_are_the_papers():
    assert get_alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    s6 = get_alibi_slopes(6)
    assert s6[:4] == get_alibi_slopes(4) and s6[4:] == get_alibi_slopes(8)[0::2][:2]


def test_gradients_match_plain(rng):
    m = MHA(32, 4, num_heads_kv=2, causal=True, rotary_emb_dim=8, use_flash_attn=True,
            dtype=torch.float64, return_residual=True)
    x = _x(rng, 2, 7, 32).requires_grad_()
    out, residual = m(x)
    assert residual is x
    params = [x] + list(m.parameters())
    got = torch.autograd.grad(out.square().sum(), params)
    want = torch.autograd.grad(plain_mha(m, x, causal=True, rotary=(8, 10000.0, False))
                               .square().sum(), params)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-9)


def test_varlen_forward_equals_padded(rng):
    m = MHA(32, 4, causal=True, use_flash_attn=True, dtype=torch.float64)
    x = _x(rng, 3, 8, 32)
    mask = torch.arange(8)[None, :] < torch.tensor([8, 3, 6])[:, None]
    x_unpad, idx, cu, max_s, _ = unpad_input(x, mask)
    out = pad_input(m(x_unpad, cu_seqlens=cu, max_seqlen=max_s), idx, 3, 8)
    for i, n in enumerate((8, 3, 6)):
        assert torch.allclose(out[i, :n], m(x[i:i + 1, :n])[0], atol=1e-10)


DECODE_CASES = [
    dict(num_heads=4, causal=True, use_flash_attn=True),
    dict(num_heads=4, num_heads_kv=2, causal=True, rotary_emb_dim=8, use_flash_attn=True),
    dict(num_heads=2, causal=True, rotary_emb_dim=16, rotary_emb_interleaved=True,
         use_flash_attn=True),
    dict(num_heads=4, num_heads_kv=1, causal=True, window_size=(4, 0), use_flash_attn=True),
    dict(num_heads=4, num_heads_kv=2, causal=True, rotary_emb_dim=8, use_flash_attn=False),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=_ids)
def test_generation_with_kv_cache(rng, case, monkeypatch):
    """Prompt of 5 tokens, then 4 tokens one at a time: every step's output equals the
    corresponding rows of one causal pass over the whole sequence. The flash path decodes
    through flash_attn_with_kvcache (rotary applied inside it), the unfused one does not."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs.get("rotary_cos") is not None)
        return flash_attn_with_kvcache(*args, **kwargs)

    monkeypatch.setattr(mha_module, "flash_attn_with_kvcache", counting)
    torch.manual_seed(int(rng.integers(2**31)))
    m = MHA(32, layer_idx=0, dtype=torch.float32, **case)
    b, prompt, total = 2, 5, 9
    x = _x(rng, b, total, 32, dtype=torch.float32)
    with torch.no_grad():
        full = m(x)
        params = InferenceParams(max_seqlen=16, max_batch_size=b)
        steps = [m(x[:, :prompt], inference_params=params)]
        params.seqlen_offset = prompt
        for t in range(prompt, total):
            steps.append(m(x[:, t:t + 1], inference_params=params))
            params.seqlen_offset += 1
    got = torch.cat(steps, dim=1)
    rotary_inside = bool(case.get("rotary_emb_dim"))
    assert calls == ([rotary_inside] * (total - prompt) if case["use_flash_attn"] else [])
    assert torch.allclose(got, full, atol=2e-5), (got - full).abs().max()
    cache = params.key_value_memory_dict[0]
    assert cache.shape == (b, 16, 2, m.num_heads_kv, m.head_dim)
    alloc = m.allocate_inference_cache(b, 16)
    assert alloc.shape == cache.shape and alloc.dtype == cache.dtype


@pytest.mark.parametrize("num_heads_kv", [4, 2])
def test_dwconv_and_checkpointing(rng, num_heads_kv):
    """dwconv: depthwise causal convolutions of the projections (checked against conv1d with
    left padding); checkpointing changes nothing in values or gradients."""
    m = MHA(32, 4, num_heads_kv=num_heads_kv, causal=True, dwconv=True, use_flash_attn=True,
            dtype=torch.float64)
    x = _x(rng, 2, 6, 32).requires_grad_()
    got = m(x)
    convs = [m.dwconv_qkv] if num_heads_kv == 4 else [m.dwconv_q, m.dwconv_kv]
    proj = m.Wqkv(x)
    parts = [proj] if num_heads_kv == 4 else list(proj.split([32, 2 * 8 * num_heads_kv], -1))
    mixed = []
    for conv, p in zip(convs, parts):
        padded = torch.nn.functional.pad(p.transpose(1, 2), (2, 0))
        mixed.append(torch.nn.functional.conv1d(padded, conv.weight, conv.bias,
                                                groups=conv.groups).transpose(1, 2))
    mixed = torch.cat(mixed, -1)
    ref_model = MHA(32, 4, num_heads_kv=num_heads_kv, causal=True, use_flash_attn=True,
                    dtype=torch.float64)
    ref_model.Wqkv = torch.nn.Identity()
    ref_model.out_proj = m.out_proj
    assert torch.allclose(got, ref_model(mixed), atol=1e-10)
    ckpt = MHA(32, 4, num_heads_kv=num_heads_kv, causal=True, dwconv=True, use_flash_attn=True,
               checkpointing=True, dtype=torch.float64)
    ckpt.load_state_dict(m.state_dict())
    out = ckpt(x)
    assert torch.equal(out, got)
    g1 = torch.autograd.grad(got.sum(), [x] + list(m.parameters()))
    g2 = torch.autograd.grad(out.sum(), [x] + list(ckpt.parameters()))
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-12)
