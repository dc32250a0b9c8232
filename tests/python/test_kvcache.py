"""flash_attn_with_kvcache and flash_attn_combine against a float64 NumPy reference.

The reference gathers each sequence's keys from the cache (through block_table or
cache_batch_idx), applies the append and the rotary embedding in float64 as upstream defines
them, and runs reference.attention_ref on the dense result.
"""

import inspect

import numpy as np
import pytest
import torch

import flashattn
from flashattn import FlashAttnError, flash_attn_combine, flash_attn_with_kvcache
from helpers import make, rounded
from reference import attention_ref

TOL = {"float64": 1e-10, "float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
ULP = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def to64(x):
    if isinstance(x, torch.Tensor):
        return x.detach().double().numpy()
    return np.asarray(x, dtype=np.float64)


def rotate(x, cos, sin, interleaved):
    """x [..., d] rotated on its first 2 * cos.shape[-1] features; cos/sin broadcast to x."""
    half = cos.shape[-1]
    x = x.copy()
    if interleaved:
        x0, x1 = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2] = x0 * cos - x1 * sin
        x[..., 1:2 * half:2] = x0 * sin + x1 * cos
    else:
        x0, x1 = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half] = x0 * cos - x1 * sin
        x[..., half:2 * half] = x0 * sin + x1 * cos
    return x


def locate(i, pos, page, table, bidx):
    if table is not None:
        return table[i][pos // page], pos % page
    return (bidx[i] if bidx is not None else i), pos


def kvcache_ref(q, kc, vc, k, v, cos, sin, seqlens, bidx, leftpad, table, dt, causal=False,
                window=(-1, -1), softcap=0.0, interleaved=True, alibi=None, sinks=None,
                scale=None):
    """float64 arrays in; returns out, lse and the caches after the append."""
    kc, vc = kc.copy(), vc.copy()
    b, sq, h, _ = q.shape
    page = kc.shape[1]
    cap = table.shape[1] * page if table is not None else kc.shape[1]
    s_new = 0 if k is None else k.shape[1]
    per_row = causal or (0 <= window[0] < cap) or (0 <= window[1] < cap)
    outs, lses = [], []
    for i in range(b):
        if k is not None:
            for t in range(s_new):
                pos = seqlens[i] + t
                blk, row = locate(i, pos, page, table, bidx)
                kt = k[i, t]
                if cos is not None:
                    kt = rounded(rotate(kt, cos[pos], sin[pos], interleaved), dt)
                kc[blk, row], vc[blk, row] = kt, v[i, t]
        start = 0 if leftpad is None else leftpad[i]
        end = cap if seqlens is None else seqlens[i] + s_new
        rows = [locate(i, p, page, table, bidx) for p in range(start, end)]
        kk = np.stack([kc[a, r] for a, r in rows]) if rows else np.zeros((0,) + kc.shape[2:])
        vv = np.stack([vc[a, r] for a, r in rows]) if rows else np.zeros((0,) + vc.shape[2:])
        qi = q[i]
        if cos is not None:
            pos = seqlens[i] + (np.arange(sq) if per_row else np.zeros(sq, dtype=int))
            qi = rotate(qi, cos[pos][:, None, :], sin[pos][:, None, :], interleaved)
        al = None if alibi is None else (alibi if alibi.ndim == 1 else alibi[i])
        o, l, _ = attention_ref(qi[None], kk[None], vv[None], scale, causal, window, softcap,
                                al, sinks)
        outs.append(o[0])
        lses.append(l[0])
    return np.stack(outs), np.stack(lses), kc, vc


def int32(x, kind):
    a = np.asarray(x, dtype=np.int32)
    return torch.from_numpy(a) if kind == "torch" else a


def setup(rng, kind, dt, b=2, sq=1, h=4, hk=2, d=16, dv=16, page=None, cap=40, s_new=1,
          rotary=None, rotary_dim=8, leftpad=False, bidx=False, seqlens=True):
    """Random inputs of the given kind/dtype and their float64 values."""
    P = {}
    if page:
        mb = -(-cap // page)
        cap = mb * page
        perm = rng.permutation(b * mb + 2)
        table = perm[:b * mb].reshape(b, mb)
        nblk = b * mb + 2
        rows = page
    else:
        table, nblk, rows = None, b + (2 if bidx else 0), cap
    lens = rng.integers(0, cap - s_new + 1, size=b)
    lens[-1] = cap - s_new  # one sequence appends up to the end of the cache
    P["seqlens"] = lens if seqlens else None
    P["leftpad"] = np.array([rng.integers(0, n + 1) for n in lens]) if leftpad else None
    P["bidx"] = rng.permutation(nblk)[:b] if bidx else None
    P["table"] = table
    x = {
        "q": rng.uniform(-1, 1, (b, sq, h, d)),
        "kc": rng.uniform(-1, 1, (nblk, rows, hk, d)),
        "vc": rng.uniform(-1, 1, (nblk, rows, hk, dv)),
    }
    if s_new:
        x["k"] = rng.uniform(-1, 1, (b, s_new, hk, d))
        x["v"] = rng.uniform(-1, 1, (b, s_new, hk, dv))
    if rotary:
        th = rng.uniform(-3, 3, (cap + sq + 2, rotary_dim // 2))
        x["cos"], x["sin"] = np.cos(th), np.sin(th)
    arrays = {name: make(val, dt, kind) for name, val in x.items()}
    values = {name: rounded(val, dt) for name, val in x.items()}
    return P, arrays, values


def run(P, A, kind, **kw):
    return flash_attn_with_kvcache(
        A["q"], A["kc"], A["vc"], A.get("k"), A.get("v"), A.get("cos"), A.get("sin"),
        cache_seqlens=None if P["seqlens"] is None else int32(P["seqlens"], kind),
        cache_batch_idx=None if P["bidx"] is None else int32(P["bidx"], kind),
        cache_leftpad=None if P["leftpad"] is None else int32(P["leftpad"], kind),
        block_table=None if P["table"] is None else int32(P["table"], kind),
        return_softmax_lse=True, **kw)


def check(P, A, V, dt, out, lse, interleaved=True, **kw):
    ro, rl, rkc, rvc = kvcache_ref(V["q"], V["kc"], V["vc"], V.get("k"), V.get("v"),
                                   V.get("cos"), V.get("sin"), P["seqlens"], P["bidx"],
                                   P["leftpad"], P["table"], dt, interleaved=interleaved, **kw)
    np.testing.assert_allclose(to64(out), ro, atol=TOL[dt], rtol=0)
    fin = np.isfinite(rl)
    assert np.array_equal(np.isfinite(to64(lse)), fin)
    np.testing.assert_allclose(to64(lse)[fin], rl[fin], rtol=1e-5, atol=1e-5)
    # The caller's caches were updated in place: rotated keys within an ulp, the rest exact.
    np.testing.assert_allclose(to64(A["kc"]), rkc, atol=2 * ULP[dt], rtol=0)
    assert np.array_equal(to64(A["vc"]), rvc)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("dt", ["float32", "bfloat16", "float16", "float64"])
@pytest.mark.parametrize("page", [None, 1, 3, 16, 256])
def test_append_rotary_pages(rng, kind, dt, page):
    if kind == "numpy" and dt == "bfloat16":
        pytest.importorskip("ml_dtypes")
    interleaved = page in (None, 3, 256)
    cap = 300 if page == 256 else 40
    P, A, V = setup(rng, kind, dt, page=page, cap=cap, s_new=2, sq=2, rotary=True)
    out, lse = run(P, A, kind, causal=True, rotary_interleaved=interleaved)
    assert type(out) is type(A["q"]) and out.dtype == A["q"].dtype
    assert tuple(lse.shape) == (2, 4, 2)
    check(P, A, V, dt, out, lse, interleaved=interleaved, causal=True)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("opts", [
    dict(),
    dict(causal=True, leftpad=True),
    dict(bidx=True, leftpad=True, window=(5, 1)),
    dict(page=3, softcap=2.0, alibi=True, sinks=True),
    dict(page=16, seqlens=False, s_new=0, leftpad=True),
    dict(seqlens=False, s_new=0, bidx=True),
    dict(rotary=True, rotary_dim=12, window=(7, 0), sq=5, s_new=5),
])
def test_options(rng, kind, opts):
    opts = dict(opts)
    kw = {}
    for name in ("causal", "window", "softcap"):
        if name in opts:
            kw[name] = opts.pop(name)
    alibi, sinks = opts.pop("alibi", False), opts.pop("sinks", False)
    P, A, V = setup(rng, kind, "float32", h=6, hk=2, d=24, dv=8, **opts)
    extra = {}
    if alibi:
        V["alibi"] = rng.uniform(0.1, 1.0, (2, 6))
        extra["alibi_slopes"] = make(V["alibi"], "float32", kind)
    if sinks:
        V["sinks"] = rng.uniform(-2, 2, 6)
        extra["learnable_sink"] = make(V["sinks"], "float32", kind)
    call = dict(kw)
    if "window" in call:
        call["window_size"] = call.pop("window")
    out, lse = run(P, A, kind, **call, **extra)
    check(P, A, V, "float32", out, lse, alibi=V.get("alibi"), sinks=V.get("sinks"), **kw)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_num_splits_agree(rng, kind):
    P, A, V = setup(rng, kind, "float32", b=1, h=8, hk=1, d=32, dv=32, page=16, cap=900)
    results = [run(P, A, kind, num_splits=s) for s in (1, 3, 0, 1)]
    for out, lse in results:
        check(P, A, V, "float32", out, lse)
    np.testing.assert_allclose(to64(results[1][0]), to64(results[0][0]), atol=1e-5, rtol=0)
    assert np.array_equal(to64(results[3][0]), to64(results[0][0]))  # repeatable


def test_int_cache_seqlens_and_default_return(rng):
    P, A, V = setup(rng, "torch", "float32", b=3, s_new=1, cap=20)
    n = 7
    P["seqlens"] = np.full(3, n)
    out = flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], A["k"], A["v"], cache_seqlens=n)
    assert isinstance(out, torch.Tensor) and out.shape == (3, 1, 4, 16)
    ro, _, rkc, _ = kvcache_ref(V["q"], V["kc"], V["vc"], V["k"], V["v"], None, None,
                                P["seqlens"], None, None, None, "float32")
    np.testing.assert_allclose(out.numpy(), ro, atol=TOL["float32"], rtol=0)
    np.testing.assert_array_equal(A["kc"].double().numpy(), rkc)


def test_signature_cache_swaps_data_not_results(rng):
    """Torch CPU calls that share a signature reuse one prepared call (its data pointers
    swapped): each result, lse and appended cache is still its own inputs' (bitwise against the
    uncached path, on copies of the caches), with new cache_seqlens values every call (a tensor,
    or an int); a tensor on another device and a value the library refuses are still refused by
    name once the signature is prepared; an input that needed a copy is not served from a
    prepared call."""
    from flashattn import _arrays, _cached, _kvcache

    def uncached(P, A):
        kc, vc = A["kc"].clone(), A["vc"].clone()
        out, lse = _kvcache.kvcache_run(
            _arrays.TORCH, A["q"], kc, vc, A["k"], A["v"], A["cos"], A["sin"],
            int32(P["seqlens"], "torch"), None, None, int32(P["table"], "torch"), None, None,
            None, False, (-1, -1), 0.0, True, 0)
        return out, lse, kc, vc

    for _ in range(4):
        P, A, V = setup(rng, "torch", "float32", b=3, h=4, hk=2, page=4, cap=24, s_new=2,
                        rotary=True)
        want = uncached(P, A)
        out, lse = run(P, A, "torch")
        check(P, A, V, "float32", out, lse)
        for got, w in zip((out, lse, A["kc"], A["vc"]), want):
            assert torch.equal(got, w)
    assert any(key[0] == "kv" for key in _cached._LOCAL.calls if isinstance(key, tuple))

    bad = P["table"].copy()
    bad[1, 0] = 10**6
    with pytest.raises(FlashAttnError, match="block_table"):
        flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], A["k"], A["v"], A["cos"], A["sin"],
                                cache_seqlens=int32(P["seqlens"], "torch"),
                                block_table=int32(P["table"], "torch").to("meta"))
    with pytest.raises(FlashAttnError, match="block_table"):
        flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], A["k"], A["v"], A["cos"], A["sin"],
                                cache_seqlens=int32(P["seqlens"], "torch"),
                                block_table=int32(bad, "torch"))
    for n in (5, 9):  # an int cache_seqlens, the same signature each time
        P, A, V = setup(rng, "torch", "float32", b=3, h=4, hk=2, cap=24, s_new=2)
        P["seqlens"] = np.full(3, n)
        out, lse = flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], A["k"], A["v"],
                                           cache_seqlens=n, return_softmax_lse=True)
        check(P, A, V, "float32", out, lse)

    P, A, V = setup(rng, "torch", "float32", b=3, h=4, hk=2, page=4, cap=24, s_new=2,
                    rotary=True)
    wide = torch.randn(*A["q"].shape[:-1], 2 * A["q"].shape[-1])
    wide[..., ::2] = A["q"]
    A["q"] = wide[..., ::2]  # q's values, its last dimension strided: prepared as a copy
    for _ in range(2):  # the second append rewrites the same positions with the same rows
        out, lse = run(P, A, "torch")
    check(P, A, V, "float32", out, lse)


def test_signature_matches_upstream():
    params = inspect.signature(flash_attn_with_kvcache).parameters
    names = ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
             "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal",
             "window_size", "softcap", "rotary_interleaved", "alibi_slopes", "num_splits",
             "return_softmax_lse", "learnable_sink", "k_descale", "v_descale"]
    assert list(params) == names
    assert params["rotary_interleaved"].default is True and params["num_splits"].default == 0
    for name in ("learnable_sink", "k_descale", "v_descale"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(flash_attn_combine).parameters) == [
        "out_partial", "lse_partial", "out", "out_dtype"]
    assert "flash_attn_with_kvcache" in flashattn.__all__
    assert "flash_attn_combine" in flashattn.__all__


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_bad_arguments_leave_the_cache_alone(rng, kind):
    P, A, V = setup(rng, kind, "float32", page=4, cap=12, s_new=2)
    before = to64(A["kc"]).copy()
    bad = P["table"].copy()
    bad[0, 0] = 10**6
    with pytest.raises(FlashAttnError, match="block_table"):
        flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], A["k"], A["v"],
                                cache_seqlens=int32([10, 10], kind), block_table=int32(bad, kind))
    with pytest.raises(FlashAttnError, match="block_table"):  # 11 + 2 new > 3 blocks of 4
        flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], A["k"], A["v"],
                                cache_seqlens=int32([11, 0], kind),
                                block_table=int32(P["table"], kind))
    with pytest.raises(FlashAttnError, match="rotary_cos"):
        th = np.zeros((3, 4))
        flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], A["k"], A["v"], make(th, "float32", kind),
                                make(th, "float32", kind), cache_seqlens=int32([5, 5], kind),
                                block_table=int32(P["table"], kind))
    with pytest.raises(FlashAttnError, match="learnable_sink"):
        flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], cache_seqlens=1,
                                block_table=int32(P["table"], kind),
                                learnable_sink=make(np.ones(3), "float32", kind))
    assert np.array_equal(to64(A["kc"]), before)


def test_cache_must_be_usable_in_place(rng):
    P, A, V = setup(rng, "numpy", "float32", cap=10)
    ro = A["kc"].copy()
    ro.flags.writeable = False
    with pytest.raises(FlashAttnError, match="k_cache"):
        flash_attn_with_kvcache(A["q"], ro, A["vc"], A["k"], A["v"], cache_seqlens=1)
    strided = np.asfortranarray(A["kc"])
    with pytest.raises(FlashAttnError, match="k_cache"):
        flash_attn_with_kvcache(A["q"], strided, A["vc"], A["k"], A["v"], cache_seqlens=1)


def combine_ref(op, lp):
    empty = np.isinf(lp)
    w = np.where(empty, -np.inf, lp)
    mx = w.max(axis=0)
    mx_safe = np.where(np.isfinite(mx), mx, 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(np.isfinite(mx), mx_safe + np.log(np.exp(w - mx_safe).sum(0)), -np.inf)
    scale = np.where(empty, 0.0, np.exp(w - np.where(np.isfinite(lse), lse, 0.0)))
    out = (scale[..., None] * np.where(empty[..., None], 0.0, op)).sum(0)
    return out, lse


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("out_dtype", [None, "float16", "bfloat16", "float64"])
def test_combine(rng, kind, out_dtype):
    if kind == "numpy" and out_dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    s, b, sq, h, d = 5, 2, 3, 4, 10
    op = rng.uniform(-1, 1, (s, b, sq, h, d)).astype(np.float32)
    lp = rng.uniform(-5, 5, (s, b, sq, h)).astype(np.float32)
    lp[rng.random((s, b, sq, h)) < 0.3] = -np.inf
    lp[:, 0, 1, 2] = -np.inf  # a row with nothing to merge
    lp[1, 1, 0, 0] = np.inf   # what the forward gives a row that sees no key: empty too
    op[np.isinf(lp)] = np.nan  # never read
    ro, rl = combine_ref(op.astype(np.float64), lp.astype(np.float64))
    if kind == "torch":
        a, c = torch.from_numpy(op), torch.from_numpy(lp)
        dtype = None if out_dtype is None else getattr(torch, out_dtype)
    else:
        a, c = op, lp
        dtype = None if out_dtype is None else (
            out_dtype if out_dtype != "bfloat16" else __import__("ml_dtypes").bfloat16)
    out, lse = flash_attn_combine(a, c, out_dtype=dtype)
    assert type(out) is type(a) and tuple(out.shape) == (b, sq, h, d)
    assert tuple(lse.shape) == (b, sq, h)
    tol = {None: 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2, "float64": 1e-12}[out_dtype]
    np.testing.assert_allclose(to64(out), ro, atol=tol, rtol=0)
    assert to64(out)[0, 1, 2].tolist() == [0.0] * d and to64(lse)[0, 1, 2] == -np.inf
    fin = np.isfinite(rl)
    np.testing.assert_allclose(to64(lse)[fin], rl[fin], rtol=1e-6)
    assert np.all(to64(lse)[~fin] == -np.inf)


def test_combine_into_out(rng):
    op = torch.randn(3, 1, 2, 2, 8)
    lp = torch.randn(3, 1, 2, 2)
    out = torch.empty(1, 2, 2, 8)
    got, _ = flash_attn_combine(op, lp, out=out)
    assert got is out
    ro, _ = combine_ref(op.double().numpy(), lp.double().numpy())
    np.testing.assert_allclose(out.double().numpy(), ro, atol=1e-6)
    with pytest.raises(FlashAttnError, match="out_partial"):
        flash_attn_combine(torch.randn(300, 1, 1, 1, 4), torch.randn(300, 1, 1, 1))
