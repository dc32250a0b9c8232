"""Gradients of the tensors a score_mod captures (the CPU backward's mod_aux_grad): a
relative-position bias table and a per-head scale against a dense torch reference, with a block
mask, GQA and a captured fp64 table; a tensor the mask_mod reads gets none; refusals."""

import numpy as np
import pytest
import torch

import flashattn
from flashattn import FlashAttnError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def randn(rng, *shape, dtype=torch.float64):
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype)


def dense(q, k, v, score_mod_dense, keep=None):
    """softmax(score_mod(q k^T / sqrt(d))) v in fp64, GQA by repeating k and v."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    s = score_mod_dense(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5)
    if keep is not None:
        s = s.masked_fill(~keep, -float("inf"))
    return s.softmax(-1) @ v


# (b, h, hkv, s): the CPU backward's two passes, and its fused form (32 sequence x kv head
# pairs), whose last stripe runs in halves of the query rows
SHAPES = [(2, 4, 2, 70), (4, 8, 8, 40)]


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-6), (torch.float32, 2e-5)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=["two-pass", "fused"])
def test_bias_table_and_head_scale(rng, dtype, tol, masked, shape):
    (B, H, HKV, S), D = shape, 16
    q = randn(rng, B, H, S, D, dtype=dtype).requires_grad_()
    k, v = (randn(rng, B, HKV, S, D, dtype=dtype).requires_grad_() for _ in range(2))
    table = randn(rng, H, 2 * S, dtype=torch.float32).requires_grad_()
    head_scale = randn(rng, H, dtype=torch.float64).requires_grad_()  # converted to fp32
    docs = torch.from_numpy(np.sort(rng.integers(0, 3, S)))

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * head_scale[h] + table[h, kv_idx - q_idx + S]

    def mask_mod(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

    bm = flashattn.create_block_mask(mask_mod, 1, 1, S, S, BLOCK_SIZE=32) if masked else None
    out = flashattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True)
    dout = randn(rng, *out.shape, dtype=dtype)
    (out * dout).sum().backward()

    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, table, head_scale)]
    qr, kr, vr, tr, sr = leaves
    i = torch.arange(S)
    rel = tr[:, i[None, :] - i[:, None] + S]  # [H, S, S]
    keep = ((docs[:, None] == docs[None, :]) & (i[:, None] >= i[None, :])) if masked else None
    ref = dense(qr, kr, vr, lambda s: s * sr[None, :, None, None] + rel[None], keep)
    (ref * dout.double()).sum().backward()
    for name, got, want in zip(("q", "k", "v", "table", "head_scale"),
                               (q, k, v, table, head_scale), leaves):
        assert got.grad is not None and got.grad.dtype == got.dtype, name
        scale = want.grad.abs().max().item()
        err = (got.grad.double() - want.grad).abs().max().item()
        assert err <= tol * max(scale, 1.0), "d%s: %.3g (scale %.3g)" % (name, err, scale)


def test_mask_capture_and_no_grad_mode(rng):
    """A tensor read by mask_mod alone gets no gradient; under no_grad nothing is recorded."""
    S = 40
    q, k, v = (randn(rng, 1, 2, S, 8).requires_grad_() for _ in range(3))
    table = randn(rng, 2 * S, dtype=torch.float32).requires_grad_()
    limit = torch.tensor([30.0], requires_grad=True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx - q_idx + S]

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < limit[0]

    bm = flashattn.create_block_mask(mask_mod, 1, 1, S, S, BLOCK_SIZE=16)
    flashattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm).sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0 and limit.grad is None
    with torch.no_grad():
        out = flashattn.flex_attention(q, k, v, score_mod=score_mod)
    assert not out.requires_grad


def test_only_the_capture_requires_grad(rng):
    """q, k and v without gradients: the table still gets its own."""
    S = 33
    q, k, v = (randn(rng, 1, 1, S, 8) for _ in range(3))
    table = randn(rng, 2 * S, dtype=torch.float32).requires_grad_()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + 2.0 * table[q_idx - kv_idx + S]

    out = flashattn.flex_attention(q, k, v, score_mod=score_mod)
    dout = randn(rng, *out.shape)
    (out * dout).sum().backward()
    tr = table.detach().double().requires_grad_()
    i = torch.arange(S)
    ref = dense(q, k, v, lambda s: s + 2.0 * tr[i[:, None] - i[None, :] + S])
    (ref * dout).sum().backward()
    torch.testing.assert_close(table.grad.double(), tr.grad, atol=1e-6, rtol=1e-6)


def test_library_refusals(rng):
    """The C API's checks of mod_aux_grad, through the library."""
    import ctypes
    from flashattn import _lib

    lib = _lib.get_lib()
    args = _lib.new_bwd_args()
    fwd = _lib.FaFwdArgs()
    lib.fa_fwd_args_init(ctypes.byref(fwd))
    args.fwd = ctypes.pointer(fwd)
    grad = _lib.FaTensor()
    args.mod_aux_grad[1] = ctypes.pointer(grad)
    with pytest.raises(FlashAttnError):
        _lib.backward(args)  # the forward's arguments are refused first; no crash
