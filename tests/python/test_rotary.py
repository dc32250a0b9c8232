"""flashattn.layers.rotary against a plain float64 rotation written here, per feature: both pair
layouts, partial rotary_dim, int and per-sequence offsets, varlen, in place, the packed qkv/kv
forms, xPos, and gradients."""

import numpy as np
import pytest
import torch

from flashattn.layers.rotary import (RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_kv_,
                                     apply_rotary_emb_qkv_, apply_rotary_emb_torch)


def plain_rotary(x, cos, sin, positions, interleaved):
    """x (..., tokens, heads, d) as float64 NumPy; positions (..., tokens) ints. Pair t is
    (2t, 2t + 1) interleaved, else (t, t + rd/2); positions past the tables are unrotated."""
    x = np.array(x, dtype=np.float64)
    cos, sin = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    half = cos.shape[1]
    out = x.copy()
    for t in range(half):
        i, j = (2 * t, 2 * t + 1) if interleaved else (t, t + half)
        inside = positions < cos.shape[0]
        p = np.where(inside, positions, 0)
        c = np.where(inside, cos[p, t], 1.0)[..., None]
        s = np.where(inside, sin[p, t], 0.0)[..., None]
        out[..., i] = x[..., i] * c - x[..., j] * s
        out[..., j] = x[..., i] * s + x[..., j] * c
    return out


def _tables(rng, seqlen_ro, rd, dtype=torch.float32):
    angles = rng.uniform(-np.pi, np.pi, (seqlen_ro, rd // 2))
    return torch.tensor(np.cos(angles), dtype=dtype), torch.tensor(np.sin(angles), dtype=dtype)


def _np(t):
    return t.detach().double().numpy()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rd,d", [(16, 16), (8, 20)])
def test_dense_int_offset(rng, interleaved, rd, d):
    b, s, h, off = 2, 7, 3, 4
    x = torch.tensor(rng.standard_normal((b, s, h, d)), dtype=torch.float32)
    cos, sin = _tables(rng, s + off, rd)
    got = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=off)
    pos = np.broadcast_to(np.arange(s) + off, (b, s))
    want = plain_rotary(_np(x), cos, sin, pos, interleaved)
    assert np.abs(_np(got) - want).max() < 1e-5
    assert torch.equal(got[..., rd:], x[..., rd:])


def test_tensor_offsets_past_table_and_reference(rng):
    """Per-sequence offsets; positions past the table stay unrotated (upstream's kernel reads
    cos 1, sin 0 there). Offsets 0 agree with upstream's reference formula."""
    b, s, h, d = 3, 5, 2, 12
    x = torch.tensor(rng.standard_normal((b, s, h, d)), dtype=torch.float64)
    cos, sin = _tables(rng, 8, 12, torch.float64)
    offs = torch.tensor([0, 2, 6], dtype=torch.int32)
    got = apply_rotary_emb(x, cos, sin, seqlen_offsets=offs)
    pos = np.arange(s)[None, :] + offs.numpy()[:, None]
    assert np.abs(_np(got) - plain_rotary(_np(x), cos, sin, pos, False)).max() < 1e-12
    assert torch.equal(got[2, 2:], x[2, 2:])  # positions 8.. are past the 8-row table
    ref = apply_rotary_emb_torch(x, cos[:s], sin[:s])
    assert torch.allclose(apply_rotary_emb(x, cos, sin), ref, atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
def test_varlen(rng, interleaved):
    h, d, rd = 2, 8, 8
    cu = torch.tensor([1, 4, 4, 9], dtype=torch.int32)  # row 0 and row 9 belong to no sequence
    x = torch.tensor(rng.standard_normal((10, h, d)), dtype=torch.float32)
    cos, sin = _tables(rng, 9, rd)
    offs = torch.tensor([0, 3, 1])
    got = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offs,
                           cu_seqlens=cu, max_seqlen=5)
    want = _np(x).copy()
    for i in range(3):
        a, e = int(cu[i]), int(cu[i + 1])
        pos = np.arange(e - a) + int(offs[i])
        want[a:e] = plain_rotary(_np(x)[a:e], cos, sin, pos, interleaved)
    assert np.abs(_np(got) - want).max() < 1e-5
    assert torch.equal(got[0], x[0]) and torch.equal(got[9], x[9])


def test_low_precision_rounds_once(rng):
    """bf16 input: rotation in fp32, one rounding to bf16 at the end."""
    x = torch.tensor(rng.standard_normal((1, 6, 2, 16)), dtype=torch.bfloat16)
    cos, sin = _tables(rng, 6, 16, torch.bfloat16)
    got = apply_rotary_emb(x, cos, sin)
    want = plain_rotary(_np(x), cos.float(), sin.float(), np.arange(6)[None], False)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.tensor(want).to(torch.bfloat16))


def test_inplace_and_gradients(rng):
    x = torch.tensor(rng.standard_normal((2, 5, 2, 10)), dtype=torch.float64, requires_grad=True)
    cos, sin = _tables(rng, 7, 6, torch.float64)
    offs = torch.tensor([1, 2])
    assert torch.autograd.gradcheck(
        lambda t: apply_rotary_emb(t, cos, sin, interleaved=True, seqlen_offsets=offs), (x,))
    y = x * 1.0
    out = apply_rotary_emb(y, cos, sin, inplace=True, seqlen_offsets=2)
    assert out is y
    assert torch.equal(out, apply_rotary_emb(x, cos, sin, seqlen_offsets=2))
    # rotation is orthogonal: the gradient is the inverse rotation of the upstream gradient
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, (x,), g)
    pos = np.broadcast_to(np.arange(5) + 2, (2, 5))
    inv = plain_rotary(_np(g), cos, -sin, pos, False)
    assert np.abs(_np(gx) - inv).max() < 1e-12


@pytest.mark.parametrize("packed", ["5d", "gqa"])
def test_qkv_and_kv_inplace(rng, packed):
    b, s, h, hk, d = 2, 6, 4, 2, 8
    cos, sin = _tables(rng, s + 3, 8)
    cos_k, sin_k = _tables(rng, s + 3, 8)
    if packed == "5d":
        qkv = torch.tensor(rng.standard_normal((b, s, 3, h, d)), dtype=torch.float32)
        q, k, v = qkv[:, :, 0].clone(), qkv[:, :, 1].clone(), qkv[:, :, 2].clone()
        out = apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, seqlen_offsets=3)
        got = out[:, :, 0], out[:, :, 1], out[:, :, 2]
    else:
        qkv = torch.tensor(rng.standard_normal((b, s, h + 2 * hk, d)), dtype=torch.float32)
        q, k, v = (t.clone() for t in qkv.split([h, hk, hk], dim=2))
        out = apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, seqlen_offsets=3,
                                    num_heads_q=h)
        got = out.split([h, hk, hk], dim=2)
    assert out is qkv
    assert torch.allclose(got[0], apply_rotary_emb(q, cos, sin, seqlen_offsets=3), atol=1e-6)
    assert torch.allclose(got[1], apply_rotary_emb(k, cos_k, sin_k, seqlen_offsets=3), atol=1e-6)
    assert torch.equal(got[2], v)
    kv = torch.tensor(rng.standard_normal((b, s, 2, hk, d)), dtype=torch.float32)
    k0, v0 = kv[:, :, 0].clone(), kv[:, :, 1].clone()
    assert apply_rotary_emb_kv_(kv, cos, sin, interleaved=True) is kv
    assert torch.allclose(kv[:, :, 0], apply_rotary_emb(k0, cos, sin, interleaved=True))
    assert torch.equal(kv[:, :, 1], v0)


@pytest.mark.parametrize("scale_base", [None, 64.0])
def test_rotary_embedding_module(rng, scale_base):
    """The module's tables are cos/sin of position * base^(-2i/dim) (times the xPos scale for q,
    divided by it for k), and forward rotates qkv or (q, kv) in place with them."""
    dim, b, s, h, d = 8, 2, 5, 2, 12
    mod = RotaryEmbedding(dim, base=100.0, interleaved=False, scale_base=scale_base)
    qkv = torch.tensor(rng.standard_normal((b, s, 3, h, d)), dtype=torch.float32)
    q0, k0 = qkv[:, :, 0].clone(), qkv[:, :, 1].clone()
    out = mod(qkv, seqlen_offset=2)
    assert out is qkv and mod._seq_len_cached == s + 2
    inv_freq = 100.0 ** -(np.arange(0, dim, 2) / dim)
    ang = np.arange(s + 2)[:, None] * inv_freq[None, :]
    if scale_base is None:
        sq = sk = np.ones_like(ang)
    else:
        base_scale = (np.arange(0, dim, 2) + 0.4 * dim) / (1.4 * dim)
        power = (np.arange(s + 2) - (s + 2) // 2) / scale_base
        sq = base_scale[None, :] ** power[:, None]
        sk = 1.0 / sq
    pos = np.broadcast_to(np.arange(s) + 2, (b, s))
    want_q = plain_rotary(_np(q0), np.cos(ang) * sq, np.sin(ang) * sq, pos, False)
    want_k = plain_rotary(_np(k0), np.cos(ang) * sk, np.sin(ang) * sk, pos, False)
    assert np.abs(_np(qkv[:, :, 0]) - want_q).max() < 1e-5
    assert np.abs(_np(qkv[:, :, 1]) - want_k).max() < 1e-5
    q = q0.clone()
    kv = torch.stack([k0, k0], dim=2)
    q_out, kv_out = mod(q, kv, seqlen_offset=2)
    assert q_out is q and kv_out is kv
    assert np.abs(_np(q) - want_q).max() < 1e-5 and np.abs(_np(kv[:, :, 0]) - want_k).max() < 1e-5
