"""NaN and Inf in q, k or v on CPU tensors: out is NaN exactly where torch's SDPA is NaN on the
same inputs, equal to it elsewhere, and lse is NaN exactly on the NaN rows. Covers every dtype,
the dense, varlen and KV-cache forwards (split and unsplit) and the backward; a NaN key outside a
row's causal mask leaves that row alone. The backward's gradients are NaN at least where the
math says (keys each row sees) and at most where SDPA's arithmetic puts NaN (it also multiplies
masked probabilities 0 by NaN, as any block that spans a mask's edge does)."""

import pytest
import torch
import torch.nn.functional as F

from flashattn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}
B, S, H, D = 2, 70, 2, 64  # S spans more than one key block
# (what, position): a NaN in one q row, one k row, one v element; +Inf in one k element
CASES = [("q", float("nan")), ("k", float("nan")), ("v", float("nan")), ("k", float("inf"))]
ROW = 37
# Causal runs leave out the NaN in v: a masked key's probability is 0 and 0 * NaN is NaN in
# SDPA's matmul as in any tile that spans the mask's edge, so no rule says which rows it reaches.
MASKED = [(w, x, c) for w, x in CASES for c in (False, True) if not (w == "v" and c)]


def inputs(dtype, what, value, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, H, D, generator=g).to(dtype) for _ in range(3))
    t = {"q": q, "k": k, "v": v}[what]
    if what == "v":
        t[1, ROW, 0, 5] = value
    elif value != value:
        t[1, ROW, 0, :] = value
    else:
        t[1, ROW, 0, 3] = value
    return q, k, v


def sdpa(q, k, v, causal):
    """torch's SDPA in float64 on the same (rounded) inputs; [b, s, h, d] layout."""
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)


def sliced(q, k, v):
    """Causal attention row by row over exactly the keys each row sees: the math's NaN pattern."""
    rows = [sdpa(q[:, i:i + 1], k[:, :i + 1], v[:, :i + 1], False) for i in range(q.shape[1])]
    return torch.cat(rows, 1)


def check(got, ref, dtype, what="out", some_nan=True):
    got = got.double()
    assert torch.equal(got.isnan(), ref.isnan()), f"{what}: NaN pattern differs from SDPA"
    assert got.isnan().any() == some_nan, f"{what}: NaN reached {got.isnan().any()}"
    ok = ~ref.isnan()
    torch.testing.assert_close(got[ok], ref[ok], atol=TOL[dtype], rtol=TOL[dtype])


def check_lse(lse, out):
    """lse [b, h, s] NaN exactly on the rows of out [b, s, h, d] that are all NaN; finite else."""
    rows = out.double().isnan().all(-1).transpose(1, 2)
    assert torch.equal(lse.isnan(), rows)
    assert torch.isfinite(lse[~rows]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("what,value,causal", MASKED)
def test_dense(dtype, what, value, causal):
    q, k, v = inputs(dtype, what, value, 1)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    check(out, sdpa(q, k, v, causal), dtype)
    check_lse(lse, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_nan_key(dtype):
    """Rows before the NaN key do not see it under the causal mask and stay finite."""
    q, k, v = inputs(dtype, "k", float("nan"), 2)
    out = flash_attn_func(q, k, v, causal=True)
    ref = sdpa(q, k, v, True)
    check(out, ref, dtype)
    assert torch.isfinite(out[1, :ROW, 0]).all() and out[1, ROW:, 0].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("what,value", CASES)
def test_varlen(dtype, what, value):
    q, k, v = inputs(dtype, what, value, 3)
    cu = torch.tensor([0, S, 2 * S], dtype=torch.int32)
    flat = [x.reshape(B * S, H, D) for x in (q, k, v)]
    out, lse, _ = flash_attn_varlen_func(*flat, cu, cu, S, S, return_attn_probs=True)
    out = out.reshape(B, S, H, D)
    check(out, sdpa(q, k, v, False), dtype)
    check_lse(lse.reshape(H, B, S).transpose(0, 1), out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("what,value", CASES)
@pytest.mark.parametrize("splits", [1, 3])
def test_kvcache(dtype, what, value, splits):
    """Decode: 2 query rows against the cache, with and without the split (and the combine)."""
    q, k, v = inputs(dtype, what, value, 4)
    q = q[:, ROW - 1:ROW + 1].contiguous() if what == "q" else q[:, :2].contiguous()
    out, lse = flash_attn_with_kvcache(q, k, v, num_splits=splits, return_softmax_lse=True)
    check(out, sdpa(q, k, v, False), dtype)
    check_lse(lse, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("what,value,causal", MASKED)
def test_backward(dtype, what, value, causal):
    q, k, v = inputs(dtype, what, value, 5)
    dout = torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(6)).to(dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    flash_attn_func(*leaves, causal=causal).backward(dout)
    refs = [x.double().clone().requires_grad_() for x in (q, k, v)]
    sdpa(*refs, causal).backward(dout.double())
    if not causal:
        for name, got, ref in zip("qkv", leaves, refs):
            check(got.grad, ref.grad, dtype, "d" + name, some_nan=(name, what) != ("v", "v"))
        return
    least = [x.double().clone().requires_grad_() for x in (q, k, v)]
    sliced(*least).backward(dout.double())
    for name, got, ref, low in zip("qkv", leaves, refs, least):
        nan = got.grad.double().isnan()
        assert (nan >= low.grad.isnan()).all(), f"d{name}: NaN missing where the math has it"
        assert (nan <= ref.grad.isnan()).all(), f"d{name}: NaN where SDPA has none"
        assert nan.any() or name == "v"
        torch.testing.assert_close(got.grad.double()[~nan], low.grad[~nan], atol=TOL[dtype],
                                   rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_alibi_nan_slope(dtype):
    """A NaN ALiBi slope makes every row of its head NaN (out and lse); the other head is SDPA's
    with the same bias."""
    q, k, v = inputs(dtype, "v", 0.5, 7)
    slopes = torch.tensor([float("nan"), 0.25])
    out, lse, _ = flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True)
    assert out[:, :, 0].isnan().all() and lse[:, 0].isnan().all()
    i = torch.arange(S)
    bias = -0.25 * (i[:, None] - i[None, :]).abs().double()
    qh, kh, vh = (x[:, :, 1:].double().transpose(1, 2) for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias).transpose(1, 2)
    check(out[:, :, 1:], ref, dtype, some_nan=False)
    check_lse(lse[:, 1:], out[:, :, 1:])
