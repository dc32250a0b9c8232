"""Hostile scalar and layout inputs: each is refused with the argument's name (never a Python
crash, a wrapped integer or a silently ignored value), and upstream's newest interface names."""

import numpy as np
import pytest
import torch

from flashattn import (FlashAttnError, flash_attn_combine, flash_attn_func,
                       flash_attn_qkvpacked_func, flash_attn_varlen_func,
                       flash_attn_with_kvcache)
from flashattn import flash_attn_interface as fi
from helpers import KINDS, make, make_int32, randn, to64


def qkv(rng, kind, b=2, sq=6, sk=9, h=4, hk=2, d=16, dt="float32"):
    return (make(randn(rng, b, sq, h, d), dt, kind), make(randn(rng, b, sk, hk, d), dt, kind),
            make(randn(rng, b, sk, hk, d), dt, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_head_dim_zero_names_q(kind, rng):
    """The default scale of head dim 0 is no ZeroDivisionError: the shape check names q."""
    q, k, v = qkv(rng, kind, d=0)
    with pytest.raises(FlashAttnError, match=r"^q: head_dim must be in \[1, 576\], got 0"):
        flash_attn_func(q, k, v)
    qkvp = make(randn(rng, 2, 6, 3, 4, 0), "float32", kind)
    with pytest.raises(FlashAttnError, match=r"^qkv\[:, :, 0\] \(q\): head_dim"):
        flash_attn_qkvpacked_func(qkvp)
    cu = make_int32([0, 2, 6], kind)
    with pytest.raises(FlashAttnError, match=r"^q: head_dim"):
        flash_attn_varlen_func(q[0], k[0, :6], v[0, :6], cu, cu, 4, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_nan_softmax_scale_refused(kind, rng):
    """NaN is the C library's "default" marker: from the caller it is an error, not the
    default."""
    q, k, v = qkv(rng, kind)
    for scale in (float("nan"), np.float32("nan")):
        with pytest.raises(FlashAttnError, match=r"^softmax_scale: must be finite"):
            flash_attn_func(q, k, v, softmax_scale=scale)
    cu = make_int32([0, 2, 6], kind)
    with pytest.raises(FlashAttnError, match=r"^softmax_scale: must be finite"):
        flash_attn_varlen_func(q[0], k[0, :6], v[0, :6], cu, cu, 4, 4, softmax_scale=np.nan)
    kc, vc = k[:, :8], v[:, :8]
    for scale in (float("nan"), float("inf")):
        with pytest.raises(FlashAttnError, match=r"^softmax_scale: must be finite"):
            flash_attn_with_kvcache(q, kc, vc, softmax_scale=scale)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("big", [2**64 + 6, 2**70, -2**63 - 1])
def test_integers_range_checked_before_ctypes(kind, big, rng):
    """ctypes would store 2**64 + 6 as 6 and 2**70 as 0: they are refused by name."""
    q, k, v = qkv(rng, kind)
    cu = make_int32([0, 2, 6], kind)
    for mq, mk, name in ((big, 4, "max_seqlen_q"), (4, big, "max_seqlen_k")):
        with pytest.raises(FlashAttnError, match=r"^%s: -?%d is out of range" % (name, big)):
            flash_attn_varlen_func(q[0], k[0, :6], v[0, :6], cu, cu, mq, mk)
    kc, vc = k[:, :8], v[:, :8]
    with pytest.raises(FlashAttnError, match=r"^num_splits: -?%d is out of range" % big):
        flash_attn_with_kvcache(q, kc, vc, num_splits=big)
    with pytest.raises(FlashAttnError, match=r"^cache_seqlens: -?%d is out of range" % big):
        flash_attn_with_kvcache(q, kc, vc, k=k[:, :1], v=v[:, :1], cache_seqlens=big)
    with pytest.raises(FlashAttnError, match=r"^num_splits: -?%d is out of range" % big):
        fi.flash_attn_gpu.varlen_fwd(q[0], k[0, :6], v[0, :6], None, cu, cu, None, None, None,
                                     None, 4, 4, 0.0, None, False, False, -1, -1, 0.0, False,
                                     None, big)


@pytest.mark.parametrize("kind", KINDS)
def test_window_past_int_is_unbounded_not_wrapped(kind, rng):
    """A window bound past any int is wider than any sequence (unbounded), never wrapped."""
    q, k, v = qkv(rng, kind)
    want = to64(flash_attn_func(q, k, v, window_size=(-1, -1)))
    narrow = to64(flash_attn_func(q, k, v, window_size=(6, 6)))
    got = to64(flash_attn_func(q, k, v, window_size=(2**64 + 6, 2**64 + 6)))
    assert np.array_equal(got, want) and not np.array_equal(got, narrow)


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_scalar_types(kind, rng):
    q, k, v = qkv(rng, kind)
    bad = [("dropout_p", "0.1"), ("dropout_p", b"0"), ("softcap", "2"), ("softmax_scale", "1"),
           ("causal", "yes"), ("causal", None), ("causal", 0.5), ("deterministic", "no"),
           ("return_attn_probs", "yes")]
    for name, value in bad:
        with pytest.raises(TypeError, match=r"^%s: expected a (float|bool), got" % name):
            flash_attn_func(q, k, v, **{name: value})
    kc, vc = k[:, :8], v[:, :8]
    for name in ("causal", "rotary_interleaved"):
        with pytest.raises(TypeError, match=r"^%s: expected a bool, got str" % name):
            flash_attn_with_kvcache(q, kc, vc, **{name: "yes"})
    cu = make_int32([0, 2, 6], kind)
    with pytest.raises(TypeError, match=r"^causal: expected a bool, got str"):
        flash_attn_varlen_func(q[0], k[0, :6], v[0, :6], cu, cu, 4, 4, causal="yes")


@pytest.mark.parametrize("kind", KINDS)
def test_flags_take_bools_ints_and_numpy_bools(kind, rng):
    """As upstream's bindings: bool, int (0 is False) and numpy.bool_ are flags."""
    q, k, v = qkv(rng, kind)
    causal = to64(flash_attn_func(q, k, v, causal=True))
    full = to64(flash_attn_func(q, k, v, causal=False))
    assert not np.array_equal(causal, full)
    for flag, want in ((1, causal), (np.bool_(True), causal), (0, full), (np.False_, full)):
        got = to64(flash_attn_func(q, k, v, causal=flag))
        assert np.array_equal(got, want), flag


def test_expanded_torch_cache_refused_for_appends(rng):
    """A stride-0 cache (expand()) would take every append into all its aliases: refused by
    name on the append; reading it is fine."""
    q = torch.from_numpy(randn(rng, 2, 1, 4, 16))
    base = torch.from_numpy(randn(rng, 1, 8, 2, 16))
    kc, vc = base.expand(2, 8, 2, 16), base.clone().expand(2, 8, 2, 16)
    new = torch.from_numpy(randn(rng, 2, 1, 2, 16))
    snapshot = base.clone()
    with pytest.raises(FlashAttnError, match=r"^k_cache: elements share memory .*new keys are "
                       r"written into it in place"):
        flash_attn_with_kvcache(q, kc, vc.contiguous(), k=new, v=new, cache_seqlens=3)
    with pytest.raises(FlashAttnError, match=r"^v_cache: elements share memory"):
        flash_attn_with_kvcache(q, kc.contiguous(), vc, k=new, v=new, cache_seqlens=3)
    assert torch.equal(base, snapshot)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5)
    want = flash_attn_with_kvcache(q, kc.contiguous(), vc.contiguous(), cache_seqlens=5)
    assert torch.equal(out, want)


def test_combine_read_only_message_says_what_is_written(rng):
    part = randn(rng, 3, 1, 2, 2, 8).astype(np.float32)
    lse = randn(rng, 3, 1, 2, 2).astype(np.float32)
    out = np.zeros((1, 2, 2, 8), np.float32)
    out.flags.writeable = False
    with pytest.raises(FlashAttnError) as e:
        flash_attn_combine(part, lse, out=out)
    assert str(e.value) == "out: the array is read-only, but the merged output is written into it"
    expanded = torch.zeros(1, 1, 2, 8).expand(1, 2, 2, 8)
    with pytest.raises(FlashAttnError, match=r"^out: elements share memory .*merged output"):
        flash_attn_combine(torch.from_numpy(part), torch.from_numpy(lse), out=expanded)


GENERATOR = r"generator` argument is no longer supported"


def test_upstream_interface_names():
    from flashattn.flash_attn_interface import USE_TRITON_ROCM, flash_attn_gpu

    assert USE_TRITON_ROCM is False
    for name in ("fwd", "varlen_fwd", "bwd", "varlen_bwd", "fwd_kvcache"):
        assert callable(getattr(flash_attn_gpu, name))


def test_raw_entry_points_refuse_a_generator(rng):
    """Upstream's test_flash_attn_generator_arg_must_be_none, on CPU tensors."""
    g = fi.flash_attn_gpu
    q, k, v = (torch.from_numpy(randn(rng, 1, 1, h, 8)) for h in (2, 1, 1))
    lse = torch.from_numpy(randn(rng, 1, 2, 1)).float()
    bad = torch.empty(1)
    with pytest.raises(RuntimeError, match=GENERATOR):
        g.fwd(q, k, v, None, None, 0.0, 0.3, True, -1, -1, 0.0, False, bad)
    with pytest.raises(RuntimeError, match=GENERATOR):
        g.bwd(q, q, k, v, q, lse, None, None, None, None, 0.0, 0.3, True, -1, -1, 0.0, False,
              bad, None)
    qf, kf, vf = q.view(1, 2, 8), k.view(1, 1, 8), v.view(1, 1, 8)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=GENERATOR):
        g.varlen_fwd(qf, kf, vf, None, cu, cu, None, None, None, None, 1, 1, 0.0, 0.3, False,
                     True, -1, -1, 0.0, False, bad, 0)
    with pytest.raises(RuntimeError, match=GENERATOR):
        g.varlen_bwd(qf, qf, kf, vf, qf, lse, None, None, None, cu, cu, None, 1, 1, 0.0, 0.3,
                     False, True, -1, -1, 0.0, False, bad, None)


@pytest.mark.parametrize("kind", KINDS)
def test_raw_entry_points_compute_what_the_functions_do(kind, rng):
    g = fi.flash_attn_gpu
    q, k, v = qkv(rng, kind, b=1)
    scale = 0.3
    out_ = make(np.full((1, 6, 4, 16), np.nan), "float32", kind)
    out, lse, S, rng_state = g.fwd(q, k, v, out_, None, 0.0, scale, True, 2, -1, 0.0, False,
                                   None)
    want, want_lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=True,
                                        window_size=(2, -1), return_attn_probs=True)
    assert out is out_ and np.array_equal(to64(out), to64(want))
    assert np.array_equal(to64(lse), to64(want_lse)) and tuple(S.shape) == (0,)
    dout = make(randn(rng, 1, 6, 4, 16), "float32", kind)
    dq_ = make(np.full((1, 6, 4, 16), np.nan), "float32", kind)
    dq, dk, dv, softmax_d = g.bwd(dout, q, k, v, out, lse, dq_, None, None, None, 0.0, scale,
                                  True, 2, -1, 0.0, False, None, rng_state)
    assert dq is dq_ and np.isfinite(to64(dq)).all()
    d = (to64(dout).astype(np.float64) * to64(out)).sum(-1).transpose(0, 2, 1)
    sd = to64(softmax_d)
    assert sd.shape == (1, 4, 128) and not sd[:, :, 6:].any()
    np.testing.assert_allclose(sd[:, :, :6], d, rtol=1e-5, atol=1e-5)
    if kind == "torch":
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        flash_attn_func(qg, kg, vg, softmax_scale=scale, causal=True,
                        window_size=(2, -1)).backward(dout)
        for got, ref in ((dq, qg.grad), (dk, kg.grad), (dv, vg.grad)):
            assert torch.equal(got, ref)
    # varlen: two sequences of q rows (2, 4) over key rows (3, 6)
    cu_q, cu_k = make_int32([0, 2, 6], kind), make_int32([0, 3, 9], kind)
    qv, kv, vv = q[0], k[0], v[0]
    o, l_, _, _ = g.varlen_fwd(qv, kv, vv, None, cu_q, cu_k, None, None, None, None, 4, 6, 0.0,
                               scale, False, True, -1, -1, 0.0, False, None)
    want_o = flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 4, 6, softmax_scale=scale,
                                    causal=True)
    assert np.array_equal(to64(o), to64(want_o))
    res = g.varlen_bwd(dout[0], qv, kv, vv, o, l_, None, None, None, cu_q, cu_k, None, 4, 6,
                       0.0, scale, False, True, -1, -1, 0.0, False, None, None)
    sd = to64(res[3])
    d = (to64(dout[0]).astype(np.float64) * to64(o)).sum(-1).T  # (h, total_q)
    assert sd.shape == (4, 6 + 2 * 128)
    np.testing.assert_allclose(sd[:, 0:2], d[:, 0:2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sd[:, 130:134], d[:, 2:6], rtol=1e-5, atol=1e-5)
    assert not sd[:, 2:130].any() and not sd[:, 134:].any()
    # kvcache: upstream's positional order
    kc, vc = make(randn(rng, 1, 12, 2, 16), "float32", kind), make(randn(rng, 1, 12, 2, 16),
                                                                   "float32", kind)
    seqlens = make_int32([7], kind)
    o, l_ = g.fwd_kvcache(q, kc, vc, None, None, seqlens, None, None, None, None, None, None,
                          None, scale, True, -1, -1, 0.0, True, 0)
    want_o, want_l = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                             softmax_scale=scale, causal=True,
                                             return_softmax_lse=True)
    assert np.array_equal(to64(o), to64(want_o))
    assert np.array_equal(to64(l_), to64(want_l))
