"""Dropout: the keep mask recovered from S_dmask's sign must be the header's Philox mask, out
must be the reference computed with that mask, |S_dmask| must be the documented encoding, and
the RNG must follow torch's / NumPy's global seeds."""

import math

import numpy as np
import pytest
import torch

from flashattn import (flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                       flash_attn_varlen_qkvpacked_func)
from flashattn import _lib
from flashattn.flash_attn_interface import (_flash_attn_forward, _flash_attn_varlen_forward,
                                            _get_block_size_n)
from helpers import (assert_close_hi, assert_close_lowp, is_kind, kind_dtypes, make, make_f32,
                     make_int32, randn, rounded, to64, dtype_name)
from reference import (attention_naive_lowp, attention_ref, dropout_keep_mask, keep_threshold,
                       varlen_ref, visible_mask)


def _upstream_block_n(d, dropout, causal):
    # flash_attn_interface._get_block_size_n for sm80 (A100/H100 class).
    if d <= 32:
        return 128
    if d <= 64:
        return 64 if dropout else 128
    if d <= 96:
        return 64
    if d <= 128:
        return 32 if dropout else 64
    return 64


def test_probs_block_n_is_upstreams():
    for d in range(1, 257):
        for dropout in (False, True):
            for causal in (False, True):
                want = _upstream_block_n(d, dropout, causal)
                assert _lib.probs_block_n(d, dropout, causal) == want
                assert _get_block_size_n("cpu", d, dropout, causal) == want


def test_c_keep_bit_matches_numpy_philox(rng):
    """fa_dropout_keep against the independent NumPy Philox, including 64-bit seeds/offsets and
    columns past 2**16."""
    for _ in range(40):
        seed = int(rng.integers(0, 2**63)) * 2 + int(rng.integers(0, 2))
        offset = int(rng.integers(0, 2**40))
        nh = int(rng.integers(1, 50))
        batch = int(rng.integers(0, 1000))
        p = float(rng.uniform(0.01, 0.99))
        row0, col0 = int(rng.integers(0, 100000)), int(rng.integers(0, 100000))
        # a small block at an arbitrary (row0, col0), element by element
        for head in {0, nh // 2, nh - 1}:
            for dr in range(2):
                for dc in range(17):
                    row, col = row0 + dr, col0 + dc
                    want = _keep_one(seed, offset, nh, batch, head, row, col, p)
                    got = _lib.dropout_keep(seed, offset, nh, batch, head, row, col, p)
                    assert got == want, (seed, offset, nh, batch, head, row, col, p)
    # Counters that carry into the high word, and the largest seeds.
    for seed, offset, nh, batch, head in [(2**64 - 1, 2**32 - 3, 4, 1, 3),
                                          (2**63 + 12345, 2**64 - 8, 8, 0, 7),
                                          (1, 0, 1, 0, 0)]:
        for row, col in [(0, 0), (5, 7), (65536, 65543)]:
            assert (_lib.dropout_keep(seed, offset, nh, batch, head, row, col, 0.37)
                    == _keep_one(seed, offset, nh, batch, head, row, col, 0.37))


def _keep_one(seed, offset, nh, batch, head, row, col, p):
    """The header's text, element by element: Philox4x32-7, counter (col >> 4, row, c), the
    number byte (col & 1) + 2 ((col >> 3) & 1) of word (col & 7) >> 1."""
    from reference import philox4x32

    c = (offset + batch * nh + head) & 0xFFFFFFFFFFFFFFFF
    w = philox4x32(col >> 4, row, c & 0xFFFFFFFF, c >> 32, seed & 0xFFFFFFFF, seed >> 32)
    r = (int(w[(col & 7) >> 1]) >> (8 * ((col & 1) + 2 * ((col >> 3) & 1)))) & 0xFF
    return r < keep_threshold(p)


def _state(rng_state):
    """(seed, offset) as Python ints (never through float64: seeds use all 63 bits)."""
    vals = rng_state.tolist()
    assert len(vals) == 2 and all(isinstance(x, int) for x in vals)
    return vals[0] & (2**64 - 1), vals[1] & (2**64 - 1)


def _check_probs(S, enc, vis_full, sq, sk, dt):
    """S [b, h, >=sq, >=sk] against the reference encoding [b, h, sq, sk]."""
    S = to64(S)
    assert np.all(S[:, :, sq:, :] == 0) and np.all(S[:, :, :, sk:] == 0), "padding not 0"
    Sv = S[:, :, :sq, :sk]
    assert np.all(Sv[~vis_full] == 0), "invisible entries not 0"
    tol = {"float32": 2e-6, "float64": 1e-12, "float16": 2e-3, "bfloat16": 1.6e-2}[dt]
    err = np.abs(np.abs(Sv) - np.abs(enc))[vis_full]
    assert err.size == 0 or err.max() <= tol * max(1.0, np.abs(enc).max()), err.max()


@pytest.mark.parametrize("kind,dt", kind_dtypes())
@pytest.mark.parametrize("causal,window,d,alibi,sinks", [
    (False, (-1, -1), 40, False, False),
    (True, (-1, -1), 64, True, False),
    (False, (9, 2), 24, False, True),
    (True, (30, -1), 128, True, True),
])
def test_dropout_dense(causal, window, d, alibi, sinks, kind, dt, rng):
    b, sq, sk, h, hk, p = 2, 37, 150, 4, 2, 0.17
    q64, k64, v64 = randn(rng, b, sq, h, d), randn(rng, b, sk, hk, d), randn(rng, b, sk, hk, d)
    qr, kr, vr = rounded(q64, dt), rounded(k64, dt), rounded(v64, dt)
    kw, rkw = dict(causal=causal, window_size=window), dict(causal=causal, window=window)
    al = rng.uniform(0.01, 0.3, h).astype(np.float32) if alibi else None
    sk_ = rng.standard_normal(h).astype(np.float32) if sinks else None
    out, lse, S, rng_state = _flash_attn_forward(
        make(q64, dt, kind), make(k64, dt, kind), make(v64, dt, kind), p, d ** -0.5, causal,
        window[0], window[1], 0.0, None if al is None else make_f32(al, kind), True,
        None if sk_ is None else make_f32(sk_, kind))
    assert is_kind(S, kind) and dtype_name(S) == dt
    assert tuple(S.shape) == (b, h, 128, 256)
    seed, offset = _state(rng_state)
    keep = np.stack([dropout_keep_mask(seed, offset, h, bi, sq, sk, p) for bi in range(b)])
    vis = np.broadcast_to(visible_mask(sq, sk, causal, window), keep.shape)
    # 1. The sign of S_dmask is the dropout mask, and it is the header's Philox mask.
    dropped = np.signbit(to64(S)[:, :, :sq, :sk])
    assert np.array_equal(~dropped[vis], keep[vis])
    kept, pk = keep[vis].mean(), keep_threshold(p) / 256
    assert abs(kept - pk) < 5 * np.sqrt(pk * (1 - pk) / vis.sum()), (kept, pk)
    # 2. out is the reference with that mask; lse does not depend on dropout.
    rargs = dict(alibi=None if al is None else al.astype(np.float64),
                 sinks=None if sk_ is None else sk_.astype(np.float64))
    o_ref, l_ref, enc = attention_ref(qr, kr, vr, d ** -0.5, keep=keep, dropout_p=p,
                                      block_n=_lib.probs_block_n(d, True, causal), **rkw,
                                      **rargs)
    if dt in ("float32", "float64"):
        assert_close_hi(out, o_ref, dt)
    else:
        tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dt]
        naive = attention_naive_lowp(qr, kr, vr, tdt, d ** -0.5, keep=keep, dropout_p=p, **rkw,
                                     **rargs)
        assert_close_lowp(out, o_ref, naive, dt)
    np.testing.assert_allclose(to64(lse), l_ref, rtol=2e-6, atol=2e-6)
    # 3. |S_dmask| is the documented encoding: exp(s - running max over blocks, last first).
    _check_probs(S, enc, vis, sq, sk, dt)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_dropout_varlen(kind, rng):
    """batch is the sequence index, row/col positions inside the sequence."""
    lq, lk, h, hk, d, p = [5, 0, 30, 12], [20, 4, 31, 0], 4, 2, 32, 0.3
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q64 = randn(rng, int(cu_q[-1]), h, d)
    k64, v64 = randn(rng, int(cu_k[-1]), hk, d), randn(rng, int(cu_k[-1]), hk, d)
    mq, mk = max(lq), max(lk)
    args = [make(x, "float32", kind) for x in (q64, k64, v64)]
    out, lse, S, rng_state = _flash_attn_varlen_forward(
        *args, make_int32(cu_q, kind), make_int32(cu_k, kind), mq, mk, p, d ** -0.5, True,
        return_softmax=True)
    assert tuple(S.shape) == (4, h, 128, 128)
    seed, offset = _state(rng_state)

    def keep_fn(i, n, m):
        return dropout_keep_mask(seed, offset, h, i, n, m, p)

    o_ref, l_ref, enc = varlen_ref(*(rounded(x, "float32") for x in (q64, k64, v64)), cu_q,
                                   cu_k, d ** -0.5, causal=True, keep_fn=keep_fn, dropout_p=p,
                                   block_n=_lib.probs_block_n(d, True, True), max_sq=mq,
                                   max_sk=mk)
    assert_close_hi(out, o_ref, "float32")
    S64 = to64(S)
    vis = np.zeros((4, h, mq, mk), dtype=bool)
    for i in range(4):
        vis[i, :, :lq[i], :lk[i]] = visible_mask(lq[i], lk[i], causal=True)
        keep = keep_fn(i, lq[i], lk[i])
        v = vis[i, :, :lq[i], :lk[i]]
        assert np.array_equal(~np.signbit(S64[i, :, :lq[i], :lk[i]])[v], keep[v])
    _check_probs(S, enc, vis, mq, mk, "float32")


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_dropout_public_functions_return_probs(kind, rng):
    b, s, h, d = 1, 20, 2, 16
    qkv = make(randn(rng, b, s, 3, h, d), "float16", kind)
    out, lse, S = flash_attn_qkvpacked_func(qkv, dropout_p=0.5, return_attn_probs=True)
    assert tuple(S.shape) == (b, h, 128, 128) and dtype_name(S) == "float16"
    assert np.signbit(to64(S)[:, :, :s, :s]).any() and (to64(S)[:, :, :s, :s] > 0).any()
    assert tuple(out.shape) == (b, s, h, d) and tuple(lse.shape) == (b, h, s)
    cu = make_int32([0, 7, 20], kind)
    qkv2 = make(randn(rng, 20, 3, h, d), "float32", kind)
    out, lse, S = flash_attn_varlen_qkvpacked_func(qkv2, cu, 13, dropout_p=0.25,
                                                   return_attn_probs=True)
    assert tuple(S.shape) == (2, h, 128, 128) and tuple(lse.shape) == (h, 20)
    # dropout_p == 0: S_dmask is the empty (0,) array, as upstream.
    out, lse, S = flash_attn_varlen_qkvpacked_func(qkv2, cu, 13, return_attn_probs=True)
    assert tuple(S.shape) == (0,)


def _inputs(rng, kind):
    return [make(randn(rng, 2, 33, 4, 32), "float32", kind) for _ in range(3)]


def test_torch_manual_seed_reproduces(rng):
    q, k, v = _inputs(rng, "torch")
    torch.manual_seed(1234)
    a = flash_attn_func(q, k, v, dropout_p=0.3)
    torch.manual_seed(1234)
    b = flash_attn_func(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b)
    c = flash_attn_func(q, k, v, dropout_p=0.3)  # the generator moved on
    assert not torch.equal(a, c)
    torch.manual_seed(4321)
    e = flash_attn_func(q, k, v, dropout_p=0.3)
    assert not torch.equal(a, e)
    # Same for varlen and for the probabilities.
    cu = torch.tensor([0, 30, 66], dtype=torch.int32)
    qv = q.reshape(66, 4, 32)
    torch.manual_seed(7)
    r1 = flash_attn_varlen_func(qv, qv, qv, cu, cu, 36, 36, dropout_p=0.5,
                                return_attn_probs=True)
    torch.manual_seed(7)
    r2 = flash_attn_varlen_func(qv, qv, qv, cu, cu, 36, 36, dropout_p=0.5,
                                return_attn_probs=True)
    for x, y in zip(r1, r2):
        assert torch.equal(x, y)


def test_dropout_seed_comes_from_default_generator(rng):
    """The seed is one torch.randint draw on the default CPU generator (documented), and calls
    without dropout do not touch the generator."""
    q, k, v = _inputs(rng, "torch")
    torch.manual_seed(99)
    _, _, _, state = _flash_attn_forward(q, k, v, 0.2, 0.1, False, -1, -1, 0.0, None, False)
    torch.manual_seed(99)
    want = torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64).item()
    assert state.tolist() == [want, 0]
    torch.manual_seed(5)
    flash_attn_func(q, k, v)
    x = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(x, torch.rand(3))


def test_numpy_seed_reproduces(rng):
    q, k, v = _inputs(rng, "numpy")
    np.random.seed(42)
    a = flash_attn_func(q, k, v, dropout_p=0.3)
    np.random.seed(42)
    b = flash_attn_func(q, k, v, dropout_p=0.3)
    assert np.array_equal(a, b)
    c = flash_attn_func(q, k, v, dropout_p=0.3)
    assert not np.array_equal(a, c)
    np.random.seed(43)
    assert not np.array_equal(a, flash_attn_func(q, k, v, dropout_p=0.3))


def test_dropout_expectation(rng):
    """Averaged over many seeds, dropout's output is unbiased (E[out] = out without dropout)."""
    q, k, v = (torch.from_numpy(randn(rng, 1, 4, 2, 8)) for _ in range(3))
    ref = flash_attn_func(q, k, v)
    torch.manual_seed(0)
    acc = sum(flash_attn_func(q, k, v, dropout_p=0.4) for _ in range(2000)) / 2000
    assert (acc - ref).abs().max().item() < 0.1
    assert math.isfinite(acc.sum().item())
