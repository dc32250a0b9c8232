"""FP8 inputs on the CPU: the library's conversions bit for bit against torch's casts, and the
forward (FA2's functions with descale 1, FA3's with q_descale / k_descale / v_descale) against a
torch float64 reference that rounds P as the header's FP8 paragraph says: p = 2^8 exp(s - m)
rounded to e4m3, the row sum unrounded, m the row's largest score (or the sink)."""

import math

import numpy as np
import pytest
import torch

from flashattn import _lib, fa3, flash_attn_func, flash_attn_varlen_func
from flashattn._lib import FlashAttnError
from flashattn.flash_attn_interface import _flash_attn_forward

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - depends on the environment
    ml_dtypes = None

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
KINDS = [(E4M3, _lib.DTYPE_F8E4M3), (E5M2, _lib.DTYPE_F8E5M2)]


# --------------------------------------------------------------------------------------------
# Conversions


def _from_f32(code, x):
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, dtype=np.uint8)
    _lib.fp8_convert("fa_fp8_from_f32", code, x.ctypes.data, out.ctypes.data, x.size)
    return out


@pytest.mark.parametrize("kind,code", KINDS)
def test_every_code_decodes_as_torch(kind, code):
    codes = np.arange(256, dtype=np.uint8)
    got = np.empty(256, dtype=np.float32)
    _lib.fp8_convert("fa_fp8_to_f32", code, codes.ctypes.data, got.ctypes.data, 256)
    want = torch.from_numpy(codes).view(kind).float().numpy()
    assert np.array_equal(got.view(np.uint32)[~np.isnan(want)],
                          want.view(np.uint32)[~np.isnan(want)])
    assert np.array_equal(np.isnan(got), np.isnan(want))


@pytest.mark.parametrize("kind,code", KINDS)
def test_fp32_sweep_encodes_as_torch(kind, code):
    """Every upper 16 bits with lower 16 bits 0, 1, 0x7fff, 0x8000, 0xffff: every exponent
    (subnormals, overflow, inf, NaN), both signs, and the exact ties of both kinds' mantissas
    with their neighbours."""
    hi = np.arange(65536, dtype=np.uint32) << 16
    bits = (hi[:, None] | np.array([0, 1, 0x7FFF, 0x8000, 0xFFFF], np.uint32)).ravel()
    x = bits.view(np.float32)
    got = _from_f32(code, x)
    want = torch.from_numpy(x.copy()).to(kind).view(torch.uint8).numpy()
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, "0x%08x -> 0x%02x, torch 0x%02x" % (bits[bad[0]], got[bad[0]],
                                                                want[bad[0]])


def test_conversion_refuses_other_dtypes():
    x = np.ones(1, np.float32)
    with pytest.raises(FlashAttnError, match="dtype: must be fp8_e4m3 or fp8_e5m2, got bf16"):
        _lib.fp8_convert("fa_fp8_from_f32", _lib.DTYPE_BF16, x.ctypes.data, x.ctypes.data, 1)


# --------------------------------------------------------------------------------------------
# The forward against a torch reference


def _fp8(rng, shape, kind, amp):
    x = torch.from_numpy(rng.uniform(-amp, amp, shape).astype(np.float32))
    return x.to(kind)


def _reference(q, k, v, descales, scale, causal, window, softcap, alibi, sinks, round_p):
    """(out float64 (b, sq, h, dv), lse float64 (b, h, sq)) of dense fp8 inputs; round_p: P as
    the header rounds it, else exact."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    qd, kd, vd = (torch.ones(b, hk, dtype=torch.float64) if x is None else x.double()
                  for x in descales)
    per_head = lambda t: t.repeat_interleave(g, dim=1)[:, None, :, None]  # noqa: E731
    qf = q.double() * per_head(qd)
    kf = k.double().repeat_interleave(g, dim=2) * per_head(kd)
    vf = v.double().repeat_interleave(g, dim=2) * per_head(vd)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    diag = i + sk - sq
    if alibi is not None:
        s = s - alibi.double()[None, :, None, None] * (diag - j).abs()
    left, right = window
    right = 0 if causal else right
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    s = s.masked_fill(~visible, -math.inf)
    m = s.amax(-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.double()[None, :, None, None])
    p = 256 * torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    if sinks is not None:
        total = total + 256 * torch.exp(sinks.double()[None, :, None, None] - m)
    pv = p.float().to(E4M3).double() if round_p else p
    out = torch.einsum("bhqk,bkhd->bqhd", pv / total, vf)
    lse = (m + torch.log(total) - 8 * math.log(2)).squeeze(-1)
    empty = ~visible.any(-1)
    if sinks is None:
        out = out.masked_fill(empty[None, :, None, None], 0.0)
        lse = lse.masked_fill(empty[None, None, :], math.inf)
    return out, lse


CASES = [
    # (kind, b, sq, sk, h, hk, d, causal, window, softcap, alibi, sinks)
    (E4M3, 2, 37, 53, 4, 2, 64, False, (-1, -1), 0.0, False, False),
    (E4M3, 1, 64, 64, 2, 2, 128, True, (-1, -1), 0.0, False, False),
    (E4M3, 2, 20, 90, 6, 2, 32, False, (17, 3), 0.0, False, True),
    (E4M3, 1, 33, 41, 4, 1, 48, True, (-1, -1), 15.0, True, False),
    (E5M2, 2, 25, 31, 4, 2, 64, False, (-1, -1), 0.0, False, False),
    (E5M2, 1, 40, 40, 3, 3, 16, True, (8, -1), 0.0, True, True),
]


def _inputs(rng, kind, b, sq, sk, h, hk, d):
    amp = 2.5 if kind == E4M3 else 2.0
    return (_fp8(rng, (b, sq, h, d), kind, amp), _fp8(rng, (b, sk, hk, d), kind, amp),
            _fp8(rng, (b, sk, hk, d), kind, 3.0))


def _check(out, lse, q, k, v, descales, scale, causal, window, softcap, alibi, sinks):
    """out against the rounded reference (bf16 rounding, and a rare key whose p lies at an
    e4m3 rounding midpoint), against the exact one (the header's bound), lse against both."""
    assert out.dtype == torch.bfloat16
    exact, lse_ref = _reference(q, k, v, descales, scale, causal, window, softcap, alibi, sinks,
                                False)
    rounded, _ = _reference(q, k, v, descales, scale, causal, window, softcap, alibi, sinks,
                            True)
    vd = descales[2].double().abs().max().item() if descales[2] is not None else 1.0
    vmax = v.double().abs().max().item() * vd
    err_rounded = (out.double() - rounded).abs()
    err_exact = (out.double() - exact).abs()
    # bf16 output (half an ulp of |out| <= vmax), and fp32 scores and sums. The library's p is
    # an fp32 number within ~2e-7 of the reference's: about one key in 3e5 lies that close to
    # an e4m3 rounding midpoint and rounds the other way, moving its row's outputs by up to an
    # e4m3 ulp of p / l. Two such rows in a case are allowed.
    tight = 2.0 ** -8 * rounded.abs() + 1e-4 * vmax
    rows_off = (err_rounded > tight).any(-1).sum().item()
    assert rows_off <= 2, (rows_off, err_rounded.max())
    # Rounding P accounts for the error: rounding as specified leaves little of it.
    assert err_rounded.square().sum() <= 0.1 * err_exact.square().sum() + 1e-12
    # The header's bound: 2^-4 relative for normal p, 2^-10 for subnormal ones, l >= 2^8.
    sk = k.shape[1]
    assert (err_exact <= vmax * (1 / 16 + sk / 2**18 + 1e-4)
            + 2.0 ** -8 * exact.abs()).all()
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse.double()[finite], lse_ref[finite], rtol=2e-6, atol=2e-6)


def _case_tensors(rng, case):
    kind, b, sq, sk, h, hk, d, causal, window, softcap, alibi_on, sinks_on = case
    q, k, v = _inputs(rng, kind, b, sq, sk, h, hk, d)
    alibi = torch.from_numpy(rng.uniform(0.01, 0.3, h).astype(np.float32)) if alibi_on else None
    sinks = torch.from_numpy(rng.normal(0, 1, h).astype(np.float32)) if sinks_on else None
    return q, k, v, alibi, sinks


def _descales(rng, b, hk):
    """FA3's tests draw U(0, 2); one of them transposed (any strides)."""
    qd, kd = (torch.from_numpy(rng.uniform(0.05, 2, (b, hk)).astype(np.float32))
              for _ in range(2))
    vd = torch.from_numpy(rng.uniform(0.05, 2, (hk, b)).astype(np.float32)).t()
    return qd, kd, vd


@pytest.mark.parametrize("case", CASES)
def test_fa2_dense_matches_reference(rng, case):
    """FA2's flash_attn_func on fp8 (no descale arguments upstream: descale 1), out bf16."""
    _, b, sq, sk, h, hk, d, causal, window, softcap = case[:10]
    q, k, v, alibi, sinks = _case_tensors(rng, case)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                          alibi_slopes=alibi, learnable_sink=sinks)
    out2, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, None, causal, window[0], window[1],
                                          softcap, alibi, False, sinks)
    assert torch.equal(out, out2)
    out3, lse3, _ = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                    alibi_slopes=alibi, learnable_sink=sinks,
                                    return_attn_probs=True)
    assert torch.equal(out, out3) and torch.equal(lse, lse3)
    _check(out, lse, q, k, v, (None, None, None), d ** -0.5, causal, window, softcap, alibi,
           sinks)


@pytest.mark.parametrize("case", [c for c in CASES if not c[10] and not c[11]])
def test_fa3_descales_match_reference(rng, case):
    """FA3's flash_attn_func with q_descale, k_descale, v_descale (b, h_k); lse -inf as FA3
    for empty rows."""
    _, b, sq, sk, h, hk, d, causal, window, softcap = case[:10]
    q, k, v, _, _ = _case_tensors(rng, case)
    descales = _descales(rng, b, hk)
    scale = 0.7 * d ** -0.5
    out, lse = fa3.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal,
                                   q_descale=descales[0], k_descale=descales[1],
                                   v_descale=descales[2], window_size=window, softcap=softcap,
                                   return_attn_probs=True)
    lse = torch.where(lse == -math.inf, math.inf, lse)
    _check(out, lse, q, k, v, descales, scale, causal, window, softcap, None, None)
    plain = fa3.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal,
                                window_size=window, softcap=softcap)
    assert not torch.equal(plain, out)  # the descales were applied


@pytest.mark.parametrize("kind", [E4M3, E5M2])
def test_varlen_matches_dense(rng, kind):
    """Varlen (FA2's and FA3's, with descales) against each sequence run dense."""
    lens_q, lens_k, h, hk, d = [5, 0, 23, 9], [7, 3, 30, 9], 4, 2, 32
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32)
    q = _fp8(rng, (sum(lens_q), h, d), kind, 2.0)
    k = _fp8(rng, (sum(lens_k), hk, d), kind, 2.0)
    v = _fp8(rng, (sum(lens_k), hk, d), kind, 2.0)
    b = len(lens_q)
    qd, kd, vd = _descales(rng, b, hk)
    out2 = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    out3, lse3 = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                            causal=True, q_descale=qd, k_descale=kd,
                                            v_descale=vd, return_attn_probs=True)
    assert out2.dtype == out3.dtype == torch.bfloat16
    for i in range(b):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if lens_q[i] == 0:
            continue
        dense2 = flash_attn_func(q[None, qs], k[None, ks], v[None, ks], causal=True)[0]
        dense3, lse_d = fa3.flash_attn_func(q[None, qs], k[None, ks], v[None, ks], causal=True,
                                            q_descale=qd[i:i + 1], k_descale=kd[i:i + 1],
                                            v_descale=vd[i:i + 1], return_attn_probs=True)
        assert torch.equal(out2[qs], dense2)
        assert torch.equal(out3[qs], dense3[0])
        assert torch.equal(lse3[:, qs], lse_d[0])


def test_upstream_criterion(rng):
    """hopper/test_flash_attn.py's: error against the exact result at most twice that of a
    same-precision reference (bf16 math on the dequantised inputs, the normalised P rounded to
    e4m3), plus twice bf16's rounding near the values."""
    b, sq, sk, h, hk, d = 2, 96, 160, 4, 2, 64
    q, k, v = _inputs(rng, E4M3, b, sq, sk, h, hk, d)
    descales = _descales(rng, b, hk)
    out = fa3.flash_attn_func(q, k, v, causal=True, q_descale=descales[0],
                              k_descale=descales[1], v_descale=descales[2])
    exact, _ = _reference(q, k, v, descales, d ** -0.5, True, (-1, -1), 0.0, None, None, False)
    g = h // hk
    per_head = lambda t: t.repeat_interleave(g, dim=1)[:, None, :, None]  # noqa: E731
    qb = (q.float() * per_head(descales[0])).bfloat16()
    kb = (k.float().repeat_interleave(g, dim=2) * per_head(descales[1])).bfloat16()
    vb = (v.float().repeat_interleave(g, dim=2) * per_head(descales[2])).bfloat16()
    s = torch.einsum("bqhd,bkhd->bhqk", qb * d ** -0.5, kb)
    s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq).logical_not(),
                      -math.inf)
    p = torch.softmax(s.float(), -1).to(E4M3).bfloat16()
    out_pt = torch.einsum("bhqk,bkhd->bqhd", p, vb)
    atol = 2 * ((exact + 0.3 - 0.3).bfloat16().double() - exact).abs().max()
    err = (out.double() - exact).abs().max()
    err_pt = (out_pt.double() - exact).abs().max()
    assert err <= 2 * err_pt + atol, (err, err_pt, atol)


@pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")
def test_numpy_ml_dtypes(rng):
    """NumPy arrays of ml_dtypes' float8_e4m3fn reach the same forward (out ml_dtypes bf16)."""
    q, k, v = _inputs(rng, E4M3, 1, 9, 11, 2, 2, 16)
    out_t = flash_attn_func(q, k, v, causal=True)
    as_np = lambda t: t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)  # noqa: E731
    out_n = flash_attn_func(as_np(q), as_np(k), as_np(v), causal=True)
    assert out_n.dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.array_equal(out_n.view(np.uint16), out_t.view(torch.int16).numpy().view(np.uint16))


# --------------------------------------------------------------------------------------------
# Refusals


def test_requires_grad_is_refused(rng):
    q, k, v = _inputs(rng, E4M3, 1, 4, 5, 2, 2, 16)
    k.requires_grad_()
    for call in (lambda: flash_attn_func(q, k, v),
                 lambda: fa3.flash_attn_func(q, k, v)):
        with pytest.raises(NotImplementedError, match="q: fp8 has no backward"):
            call()
    with torch.no_grad():
        assert flash_attn_func(q, k, v).dtype == torch.bfloat16


def test_bad_inputs_name_their_argument(rng):
    q, k, v = _inputs(rng, E4M3, 2, 4, 5, 4, 2, 32)
    qd, kd, vd = _descales(rng, 2, 2)
    with pytest.raises(FlashAttnError, match="^k: dtype fp8_e5m2 does not match q's fp8_e4m3"):
        flash_attn_func(q, k.float().to(E5M2), v)
    with pytest.raises(FlashAttnError, match="^v: dtype bf16 does not match q's fp8_e4m3"):
        flash_attn_func(q, k, v.float().bfloat16())
    with pytest.raises(FlashAttnError, match="^k_descale: dimension 1 .kv heads. must be 2"):
        fa3.flash_attn_func(q, k, v, k_descale=torch.ones(2, 4))
    with pytest.raises(FlashAttnError, match="^v_descale: dtype must be fp32"):
        fa3.flash_attn_func(q, k, v, v_descale=vd.double())
    with pytest.raises(FlashAttnError, match="^q_descale: descales apply to fp8 inputs only"):
        fa3.flash_attn_func(q.float(), k.float(), v.float(), q_descale=qd)
    with pytest.raises(FlashAttnError, match="^dropout_p: fp8 inputs have no dropout"):
        flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(FlashAttnError, match="^return_attn_probs: not available with fp8"):
        _flash_attn_forward(q, k, v, 0.0, None, False, -1, -1, 0.0, None, True)
    q24, k24, v24 = _inputs(rng, E4M3, 1, 4, 5, 2, 2, 24)
    with pytest.raises(FlashAttnError, match="^q: head_dim must be a multiple of 16"):
        flash_attn_func(q24, k24, v24)
    with pytest.raises(NotImplementedError, match="page_table: fp8"):
        fa3.flash_attn_varlen_func(q[0], k[0], v[0], torch.tensor([0, 4], dtype=torch.int32),
                                   None, 4, None, page_table=torch.zeros(1, 1,
                                                                         dtype=torch.int32))
