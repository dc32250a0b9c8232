"""Forward results of the dense public functions against the float64 reference, on torch CPU
tensors and NumPy arrays, in every dtype."""

import numpy as np
import pytest
import torch

import flashattn
from flashattn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func)
from flashattn import _lib
from helpers import (assert_close_hi, assert_close_lowp, assert_lse, dtype_name, is_kind,
                     kind_dtypes, make, make_f32, randn, rounded, to64)
from reference import attention_naive_lowp, attention_ref

# (b, sq, sk, h, hk, d, dv, options)
CONFIGS = [
    ("basic", 2, 17, 17, 4, 4, 64, 64, {}),
    ("causal_gqa_sq<sk_d37", 1, 33, 70, 6, 2, 37, 37, dict(causal=True)),
    ("causal_mqa_sq>sk", 2, 70, 33, 4, 1, 24, 24, dict(causal=True)),
    ("decode_sq1", 2, 1, 50, 8, 2, 128, 128, dict(causal=True)),
    ("seqlen1", 3, 1, 1, 2, 2, 5, 5, {}),
    ("window_both", 2, 40, 60, 4, 4, 13, 13, dict(window_size=(8, 3))),
    ("window_left", 1, 64, 64, 2, 2, 96, 96, dict(window_size=(16, -1))),
    ("window_right_sq>sk", 1, 50, 30, 2, 2, 32, 32, dict(window_size=(-1, 4))),
    ("window_causal", 1, 45, 70, 4, 2, 20, 20, dict(window_size=(10, 5), causal=True)),
    ("window_wider_than_seq", 1, 20, 25, 2, 2, 16, 16, dict(window_size=(100, 1000))),
    ("alibi_h_causal", 2, 30, 45, 4, 2, 16, 16, dict(causal=True, alibi="h")),
    ("alibi_bh", 2, 30, 30, 4, 4, 16, 16, dict(alibi="bh")),
    ("softcap", 2, 25, 40, 4, 2, 64, 64, dict(softcap=2.5, softmax_scale=0.3)),
    ("sinks", 2, 25, 40, 4, 2, 48, 48, dict(sinks=True)),
    ("sinks_fully_masked_rows", 1, 40, 20, 2, 1, 8, 8, dict(sinks=True, causal=True)),
    ("everything", 2, 37, 80, 6, 3, 72, 72,
     dict(causal=True, window_size=(20, -1), alibi="h", sinks=True, softcap=5.0)),
    ("d256", 1, 20, 33, 2, 1, 256, 256, dict(causal=True)),
    ("d1", 2, 9, 11, 3, 3, 1, 1, {}),
    ("d200", 1, 19, 40, 2, 2, 200, 200, dict(window_size=(5, 5))),
    ("dv_ne_d", 2, 21, 29, 4, 2, 32, 48, dict(causal=True)),
    ("multi_block", 1, 300, 257, 2, 1, 64, 64, dict(causal=True)),
    ("scale_explicit", 1, 31, 31, 2, 2, 40, 40, dict(softmax_scale=0.05)),
]


def _inputs(rng, kind, dt, b, sq, sk, h, hk, d, dv, opts):
    q64, k64, v64 = randn(rng, b, sq, h, d), randn(rng, b, sk, hk, d), randn(rng, b, sk, hk, dv)
    args = dict(q=make(q64, dt, kind), k=make(k64, dt, kind), v=make(v64, dt, kind))
    ref = dict(q=rounded(q64, dt), k=rounded(k64, dt), v=rounded(v64, dt))
    kw, rkw = {}, {}
    if opts.get("causal"):
        kw["causal"] = rkw["causal"] = True
    if "window_size" in opts:
        kw["window_size"] = rkw["window"] = opts["window_size"]
    if "softcap" in opts:
        kw["softcap"] = rkw["softcap"] = opts["softcap"]
    if opts.get("alibi"):
        shape = (h,) if opts["alibi"] == "h" else (b, h)
        sl = rng.uniform(0.02, 0.6, shape).astype(np.float32)
        kw["alibi_slopes"] = make_f32(sl, kind)
        rkw["alibi"] = sl.astype(np.float64)
    if opts.get("sinks"):
        sinks = (rng.standard_normal(h) * 2).astype(np.float32)
        kw["learnable_sink"] = make_f32(sinks, kind)
        rkw["sinks"] = sinks.astype(np.float64)
    scale = opts.get("softmax_scale")
    if scale is not None:
        kw["softmax_scale"] = scale
    rkw["scale"] = scale if scale is not None else d ** -0.5
    return args, ref, kw, rkw


def check_against_reference(out, lse, ref, rkw, dt, lse_ref=None):
    o_ref, l_ref, _ = attention_ref(ref["q"], ref["k"], ref["v"], **rkw)
    if dt in ("float32", "float64"):
        assert_close_hi(out, o_ref, dt)
    else:
        naive = attention_naive_lowp(ref["q"], ref["k"], ref["v"], _tdt(dt), **rkw)
        assert_close_lowp(out, o_ref, naive, dt)
    assert_lse(lse, l_ref, dt)


def _tdt(dt):
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}[dt]


@pytest.mark.parametrize("kind,dt", kind_dtypes())
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_flash_attn_func(cfg, kind, dt, rng):
    _, b, sq, sk, h, hk, d, dv, opts = cfg
    args, ref, kw, rkw = _inputs(rng, kind, dt, b, sq, sk, h, hk, d, dv, opts)
    out, lse, S = flash_attn_func(args["q"], args["k"], args["v"], return_attn_probs=True, **kw)
    for x in (out, lse, S):
        assert is_kind(x, kind)
    assert tuple(out.shape) == (b, sq, h, dv) and dtype_name(out) == dt
    assert tuple(lse.shape) == (b, h, sq) and dtype_name(lse) == "float32"
    assert tuple(S.shape) == (0,) and dtype_name(S) == dt
    check_against_reference(out, lse, ref, rkw, dt)
    # The plain call returns out alone, with the same values.
    out2 = flash_attn_func(args["q"], args["k"], args["v"], **kw)
    assert is_kind(out2, kind)
    np.testing.assert_array_equal(to64(out2), to64(out))


@pytest.mark.parametrize("kind,dt", kind_dtypes())
def test_qkvpacked(kind, dt, rng):
    b, s, h, d = 2, 29, 4, 40
    qkv64 = randn(rng, b, s, 3, h, d)
    qkv = make(qkv64, dt, kind)
    r = rounded(qkv64, dt)
    ref = dict(q=r[:, :, 0], k=r[:, :, 1], v=r[:, :, 2])
    for causal in (False, True):
        out, lse, S = flash_attn_qkvpacked_func(qkv, causal=causal, return_attn_probs=True)
        assert tuple(out.shape) == (b, s, h, d) and tuple(S.shape) == (0,)
        check_against_reference(out, lse, ref, dict(scale=d ** -0.5, causal=causal), dt)


@pytest.mark.parametrize("kind,dt", kind_dtypes())
def test_kvpacked(kind, dt, rng):
    b, sq, sk, h, hk, d = 2, 23, 41, 6, 2, 24
    q64, kv64 = randn(rng, b, sq, h, d), randn(rng, b, sk, 2, hk, d)
    q, kv = make(q64, dt, kind), make(kv64, dt, kind)
    rkv = rounded(kv64, dt)
    ref = dict(q=rounded(q64, dt), k=rkv[:, :, 0], v=rkv[:, :, 1])
    for causal, window in ((False, (-1, -1)), (True, (7, -1))):
        out, lse, _ = flash_attn_kvpacked_func(q, kv, causal=causal, window_size=window,
                                               return_attn_probs=True)
        assert tuple(out.shape) == (b, sq, h, d)
        check_against_reference(out, lse, ref,
                                dict(scale=d ** -0.5, causal=causal, window=window), dt)


class _Spy:
    """Records the fa_tensor views handed to fa_attention_forward."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = _lib.forward

        def spy(args, context=None):
            rec = {}
            for name in ("q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k",
                         "alibi_slopes", "sinks", "probs"):
                p = getattr(args, name)
                if p:
                    t = p.contents
                    rec[name] = (t.data or 0, tuple(t.shape[:t.ndim]), tuple(t.stride[:t.ndim]))
            self.calls.append(rec)
            return real(args, context)

        monkeypatch.setattr(_lib, "forward", spy)


def _ptr(x):
    return x.data_ptr() if isinstance(x, torch.Tensor) else x.__array_interface__["data"][0]


def _estrides(x):
    if isinstance(x, torch.Tensor):
        return tuple(x.stride())
    return tuple(s // x.dtype.itemsize for s in x.strides)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_packed_forms_pass_slices_without_copies(kind, rng, monkeypatch):
    spy = _Spy(monkeypatch)
    b, s, h, d = 2, 9, 4, 16
    qkv = make(randn(rng, b, s, 3, h, d), "float32", kind)
    flash_attn_qkvpacked_func(qkv)
    rec = spy.calls[-1]
    for i, name in enumerate("qkv"):
        sl = qkv[:, :, i]
        assert rec[name][0] == _ptr(sl), name
        assert rec[name][2] == _estrides(sl), name
    q = make(randn(rng, b, s, h, d), "float32", kind)
    kv = make(randn(rng, b, s + 3, 2, 2, d), "float32", kind)
    flash_attn_kvpacked_func(q, kv)
    rec = spy.calls[-1]
    assert rec["q"][0] == _ptr(q)
    assert rec["k"][0] == _ptr(kv[:, :, 0]) and rec["v"][0] == _ptr(kv[:, :, 1])
    assert rec["k"][2] == _estrides(kv[:, :, 0])
    # Varlen packed forms too.
    qkv = make(randn(rng, 20, 3, h, d), "float32", kind)
    cu = np.array([0, 7, 20], dtype=np.int32)
    cu = torch.from_numpy(cu) if kind == "torch" else cu
    from flashattn import flash_attn_varlen_qkvpacked_func
    flash_attn_varlen_qkvpacked_func(qkv, cu, 13)
    rec = spy.calls[-1]
    for i, name in enumerate("qkv"):
        assert rec[name][0] == _ptr(qkv[:, i]) and rec[name][2] == _estrides(qkv[:, i])
    assert rec["cu_seqlens_q"][0] == _ptr(cu) == rec["cu_seqlens_k"][0]


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_strided_inputs(kind, rng, monkeypatch):
    """Transposed layouts (last dim contiguous) go to C as they are; a non-contiguous last dim
    is copied first (upstream's maybe_contiguous); results are right either way."""
    spy = _Spy(monkeypatch)
    b, sq, sk, h, d = 2, 13, 21, 4, 24
    q64 = randn(rng, b, h, sq, d)  # stored as (b, h, s, d), viewed as (b, s, h, d)
    k64 = randn(rng, b, sk, h, 2 * d)
    v64 = randn(rng, b, sk, h, d)
    if kind == "torch":
        q = torch.from_numpy(q64).float().transpose(1, 2)
        k = torch.from_numpy(k64).float()[..., 0::2]
        v = torch.from_numpy(v64).float()
    else:
        q = q64.astype(np.float32).transpose(0, 2, 1, 3)
        k = k64.astype(np.float32)[..., 0::2]
        v = v64.astype(np.float32)
    out = flash_attn_func(q, k, v, causal=True)
    rec = spy.calls[-1]
    assert rec["q"][0] == _ptr(q) and rec["q"][2] == _estrides(q)  # no copy
    assert rec["k"][2][-1] == 1 and rec["k"][0] != _ptr(k)  # copied
    o_ref, _, _ = attention_ref(to64(q), to64(k), to64(v), causal=True)
    assert_close_hi(out, o_ref, "float32")


def test_numpy_negative_strides_and_byte_order(rng):
    b, sq, sk, h, d = 1, 11, 14, 2, 8
    q = rng.standard_normal((b, sq, h, d))[:, ::-1]  # negative row stride
    k = rng.standard_normal((b, sk, h, d)).astype(">f8")  # big-endian
    v = rng.standard_normal((b, sk, h, d))[:, :, ::-1]  # negative head stride
    out = flash_attn_func(q, k, v, causal=True)
    o_ref, _, _ = attention_ref(q, k.astype(np.float64), v, causal=True)
    assert_close_hi(out, o_ref, "float64")


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_empty_keys_and_queries(kind, rng):
    """seqlen_k == 0: out 0 and lse +inf (upstream); seqlen_q == 0: empty results."""
    b, h, d = 2, 3, 16
    q = make(randn(rng, b, 5, h, d), "float32", kind)
    k = make(randn(rng, b, 0, h, d), "float32", kind)
    out, lse, _ = flash_attn_func(q, k, k, return_attn_probs=True)
    assert np.all(to64(out) == 0) and np.all(to64(lse) == np.inf)
    # With a sink the row's softmax holds the sink alone: out 0, lse = sink.
    sinks = rng.standard_normal(h).astype(np.float32)
    out, lse, _ = flash_attn_func(q, k, k, return_attn_probs=True,
                                  learnable_sink=make_f32(sinks, kind))
    assert np.all(to64(out) == 0)
    np.testing.assert_allclose(to64(lse), np.broadcast_to(sinks[None, :, None], (b, h, 5)),
                               rtol=1e-6)
    q0 = make(randn(rng, b, 0, h, d), "float32", kind)
    k = make(randn(rng, b, 7, h, d), "float32", kind)
    out, lse, _ = flash_attn_func(q0, k, k, causal=True, return_attn_probs=True)
    assert tuple(out.shape) == (b, 0, h, d) and tuple(lse.shape) == (b, h, 0)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_learnable_sink_dtypes(kind, rng):
    """FA4 accepts the sink in fp16/bf16/fp32; it is used as fp32."""
    b, s, h, d = 1, 12, 4, 16
    q64, k64, v64 = randn(rng, b, s, h, d), randn(rng, b, s, h, d), randn(rng, b, s, h, d)
    sinks = rng.standard_normal(h).astype(np.float16)
    q, k, v = (make(x, "float32", kind) for x in (q64, k64, v64))
    sk = torch.from_numpy(sinks) if kind == "torch" else sinks
    out = flash_attn_func(q, k, v, learnable_sink=sk)
    o_ref, _, _ = attention_ref(rounded(q64, "float32"), rounded(k64, "float32"),
                                rounded(v64, "float32"), sinks=sinks.astype(np.float64))
    assert_close_hi(out, o_ref, "float32")


def test_softmax_scale_default_uses_unpadded_head_dim(rng):
    """None means q.shape[-1] ** -0.5 (for d not a multiple of 8, the unpadded d)."""
    b, s, h, d = 1, 10, 2, 20
    q, k, v = (torch.from_numpy(randn(rng, b, s, h, d)) for _ in range(3))
    out = flash_attn_func(q, k, v)
    out2 = flash_attn_func(q, k, v, softmax_scale=d ** -0.5)
    assert torch.equal(out, out2)
    out3 = flash_attn_func(q, k, v, softmax_scale=0.5 * d ** -0.5)
    assert not torch.allclose(out, out3)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_causal_window_minus_one_zero_equivalent(kind, rng):
    """window_size=(-1, 0) is causal; negative window values other than -1 mean unbounded."""
    b, sq, sk, h, d = 1, 17, 23, 2, 16
    q, k, v = (make(randn(rng, b, n, h, d), "float64", kind) for n in (sq, sk, sk))
    a = flash_attn_func(q, k, v, causal=True)
    c = flash_attn_func(q, k, v, window_size=(-1, 0))
    e = flash_attn_func(q, k, v, window_size=(-5, 0))
    np.testing.assert_array_equal(to64(a), to64(c))
    np.testing.assert_array_equal(to64(a), to64(e))
    full = flash_attn_func(q, k, v)
    big = flash_attn_func(q, k, v, window_size=(2**40, 2**40))
    np.testing.assert_array_equal(to64(full), to64(big))


def test_deterministic_accepted(rng):
    q, k, v = (torch.from_numpy(randn(rng, 1, 8, 2, 16)).float() for _ in range(3))
    assert torch.equal(flash_attn_func(q, k, v, deterministic=True),
                       flash_attn_func(q, k, v, deterministic=False))


def test_version():
    assert flashattn.__version__ == _lib.version() == "0.1.0"


@pytest.mark.parametrize("kind,dt", kind_dtypes())
def test_random_shapes(kind, dt, rng):
    """Random problems: sizes (including 1 and head_dim not a multiple of 8), GQA ratios and
    option combinations drawn per run."""
    for _ in range(10):
        hk = int(rng.integers(1, 4))
        h = hk * int(rng.integers(1, 4))
        b = int(rng.integers(1, 4))
        sq, sk = (int(x) for x in rng.integers(1, 90, 2))
        d = int(rng.choice([1, 3, 8, 12, 31, 64, 72, 100, 129, 160, 256]))
        dv = d if rng.random() < 0.8 else int(rng.integers(1, 257))
        opts = {}
        if rng.random() < 0.4:
            opts["causal"] = True
        if rng.random() < 0.3:
            opts["window_size"] = tuple(int(x) for x in rng.integers(-1, 40, 2))
        if rng.random() < 0.25:
            opts["alibi"] = "h" if rng.random() < 0.5 else "bh"
        if rng.random() < 0.25:
            opts["sinks"] = True
        if rng.random() < 0.2:
            opts["softcap"] = float(rng.uniform(1, 20))
        args, ref, kw, rkw = _inputs(rng, kind, dt, b, sq, sk, h, hk, d, dv, opts)
        out, lse, _ = flash_attn_func(args["q"], args["k"], args["v"], return_attn_probs=True,
                                      **kw)
        assert tuple(out.shape) == (b, sq, h, dv)
        check_against_reference(out, lse, ref, rkw, dt)
