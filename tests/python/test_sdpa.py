"""flashattn as torch's flash attention SDPA implementation (torch.nn.attention's registry):
registered but not active on import; once activated, F.scaled_dot_product_attention on CPU
tensors runs flashattn's forward and backward where it can be exact, and falls back to the
kernels it replaced elsewhere; restoring gives them back."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import torch.nn.attention as attention

import flashattn
from flashattn import _core, _sdpa
from helpers import run_python

# torch < 2.11 has no registry: there is nothing to register with (test_register_result checks
# that registering then says so).
needs_registry = pytest.mark.skipif(not _sdpa.available(),
                                    reason="this torch has no register_flash_attention_impl")


def test_register_result():
    assert flashattn.register_sdpa_impl() is _sdpa.available()


@contextlib.contextmanager
def activated():
    attention.activate_flash_attention_impl("flashattn")
    try:
        yield
    finally:
        attention.restore_flash_attention_impl()


@pytest.fixture
def spy(monkeypatch):
    """Counts flashattn's forward and backward calls made by the SDPA kernels."""
    calls = {"fwd": 0, "bwd": 0}
    fwd, bwd = _core.forward, _core.backward

    def counting_fwd(*a, **kw):
        calls["fwd"] += 1
        return fwd(*a, **kw)

    def counting_bwd(*a, **kw):
        calls["bwd"] += 1
        return bwd(*a, **kw)

    monkeypatch.setattr(_core, "forward", counting_fwd)
    monkeypatch.setattr(_core, "backward", counting_bwd)
    return calls


def _qkv(rng, b, h, hk, sq, sk, d, dtype=torch.float32, layout="bhsd"):
    def one(heads, s):
        if layout == "bshd":  # the common transposed view of a (b, s, h, d) projection
            x = torch.tensor(rng.standard_normal((b, s, heads, d)), dtype=dtype).transpose(1, 2)
        else:
            x = torch.tensor(rng.standard_normal((b, heads, s, d)), dtype=dtype)
        return x.requires_grad_()
    return one(h, sq), one(hk, sk), one(hk, sk)


def _sdpa_and_grads(q, k, v, dout, **kw):
    out = F.scaled_dot_product_attention(q, k, v, **kw)
    return out, torch.autograd.grad(out, (q, k, v), dout)


@needs_registry
def test_registered_not_active():
    assert "flashattn" in attention.list_flash_attention_impls()
    assert attention.current_flash_attention_impl() is None


CASES = [
    dict(shape=(2, 4, 4, 9, 9, 16), kw=dict()),
    dict(shape=(2, 4, 4, 9, 9, 16), kw=dict(is_causal=True)),
    dict(shape=(1, 4, 2, 12, 7, 32), kw=dict(is_causal=True, enable_gqa=True)),  # sq > sk
    dict(shape=(2, 2, 2, 5, 11, 8), kw=dict(scale=0.3)),
]


@needs_registry
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("case", CASES, ids=["plain", "causal", "gqa-causal-sq>sk", "scale"])
def test_activated_sdpa_runs_flashattn(rng, spy, case, layout):
    q, k, v = _qkv(rng, *case["shape"], layout=layout)
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],))
    want, want_grads = _sdpa_and_grads(q, k, v, dout, **case["kw"])
    with activated():
        assert attention.current_flash_attention_impl() == "flashattn"
        got, grads = _sdpa_and_grads(q, k, v, dout, **case["kw"])
    assert spy == {"fwd": 1, "bwd": 1}
    assert got.stride() == want.stride() and torch.allclose(got, want, atol=1e-5)
    for g, w in zip(grads, want_grads):
        assert g.shape == w.shape and g.stride() == w.stride()
        assert torch.allclose(g, w, atol=1e-4)
    # restored: torch's kernels again
    assert attention.current_flash_attention_impl() is None
    _sdpa_and_grads(q, k, v, dout, **case["kw"])
    assert spy == {"fwd": 1, "bwd": 1}


@needs_registry
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtypes(rng, spy, dtype):
    q, k, v = _qkv(rng, 2, 2, 2, 8, 8, 16, dtype=dtype)
    dout = torch.randn(q.shape, dtype=dtype)
    want, want_grads = _sdpa_and_grads(q, k, v, dout, is_causal=True)
    with activated():
        got, grads = _sdpa_and_grads(q, k, v, dout, is_causal=True)
    assert spy == {"fwd": 1, "bwd": 1}
    tol = 1e-12 if dtype == torch.float64 else 3e-2
    assert torch.allclose(got, want, atol=tol)
    for g, w in zip(grads, want_grads):
        assert torch.allclose(g, w, atol=tol * 4)


@needs_registry
@pytest.mark.parametrize("kind", ["attn_mask", "causal-sq<sk"])
def test_falls_back_to_the_previous_kernel(rng, spy, kind):
    q, k, v = _qkv(rng, 2, 2, 2, 5, 9, 16)
    kw = dict(is_causal=True)
    if kind == "attn_mask":
        kw = dict(attn_mask=torch.tensor(rng.random((5, 9)) < 0.7))
    dout = torch.randn(q.shape)
    want, want_grads = _sdpa_and_grads(q, k, v, dout, **kw)
    with activated():
        got, grads = _sdpa_and_grads(q, k, v, dout, **kw)
    assert spy == {"fwd": 0, "bwd": 0}
    assert torch.equal(got, want)
    for g, w in zip(grads, want_grads):
        assert torch.equal(g, w)


@needs_registry
@pytest.mark.parametrize("first", ["torch", "flashattn"])
def test_registration_follows_import_order(first):
    """Registered whichever of torch and flashattn is imported first (flashattn's import
    still does not load torch); registering again is harmless."""
    code = ("import sys, %s\n"
            "assert ('torch' in sys.modules) == (sys.argv[1] == 'torch')\n"
            "import flashattn, torch\n"
            "from torch.nn.attention import list_flash_attention_impls as ls\n"
            "before = 'flashattn' in ls()\n"
            "assert flashattn.register_sdpa_impl() is True\n"
            "print(before, 'flashattn' in ls())\n" % first)
    r = run_python(code, first)
    assert r.returncode == 0 and r.stdout.split() == ["True", "True"], r.stderr
