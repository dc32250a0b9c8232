"""The varlen public functions against the float64 reference (per sequence)."""

import numpy as np
import pytest
import torch

from flashattn import (flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                       flash_attn_varlen_qkvpacked_func)
from helpers import (assert_close_hi, assert_close_lowp, assert_lse, dtype_name, is_kind,
                     kind_dtypes, make, make_f32, make_int32, randn, rounded, to64)
from reference import attention_naive_lowp, varlen_ref

# (name, q lengths, k lengths, h, hk, d, options); q extra rows appended after the last
# sequence with "pad_q".
CONFIGS = [
    ("basic", [5, 17, 1], [9, 17, 30], 4, 4, 32, {}),
    ("zero_lengths_causal_gqa", [0, 3, 17, 1, 0], [5, 0, 20, 1, 7], 6, 2, 19, dict(causal=True)),
    ("total_lt_batch", [0, 1, 0, 0], [0, 2, 1, 0], 2, 1, 8, dict(causal=True)),
    ("window_alibi_bh", [12, 30, 7], [40, 10, 7], 4, 2, 40,
     dict(window_size=(6, 2), alibi="bh")),
    ("sinks_softcap", [9, 25], [14, 3], 4, 4, 64, dict(sinks=True, softcap=3.0)),
    ("alibi_h_causal_sinks", [20, 33], [33, 20], 3, 1, 24,
     dict(causal=True, alibi="h", sinks=True)),
    ("pad_rows_and_max_seqlen", [4, 11], [6, 15], 2, 2, 16, dict(pad_q=5, extra_max=9)),
    ("decode", [1, 1, 1, 1], [50, 3, 0, 77], 8, 2, 128, dict(causal=True)),
]


def _build(rng, kind, dt, lq, lk, h, hk, d, opts):
    pad = opts.get("pad_q", 0)
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    tq, tk = int(cu_q[-1]) + pad, int(cu_k[-1])
    q64, k64, v64 = randn(rng, tq, h, d), randn(rng, tk, hk, d), randn(rng, tk, hk, d)
    extra = opts.get("extra_max", 0)
    mq, mk = max(lq) + extra, max(lk) + extra
    args = dict(q=make(q64, dt, kind), k=make(k64, dt, kind), v=make(v64, dt, kind),
                cu_seqlens_q=make_int32(cu_q, kind), cu_seqlens_k=make_int32(cu_k, kind),
                max_seqlen_q=mq, max_seqlen_k=mk)
    ref = dict(q=rounded(q64, dt), k=rounded(k64, dt), v=rounded(v64, dt), cu_q=cu_q, cu_k=cu_k)
    kw, rkw = {}, dict(scale=d ** -0.5)
    if opts.get("causal"):
        kw["causal"] = rkw["causal"] = True
    if "window_size" in opts:
        kw["window_size"] = rkw["window"] = opts["window_size"]
    if "softcap" in opts:
        kw["softcap"] = rkw["softcap"] = opts["softcap"]
    b = len(lq)
    if opts.get("alibi"):
        shape = (h,) if opts["alibi"] == "h" else (b, h)
        sl = rng.uniform(0.02, 0.6, shape).astype(np.float32)
        kw["alibi_slopes"] = make_f32(sl, kind)
        rkw["alibi"] = sl.astype(np.float64)
    if opts.get("sinks"):
        sinks = (rng.standard_normal(h) * 2).astype(np.float32)
        kw["learnable_sink"] = make_f32(sinks, kind)
        rkw["sinks"] = sinks.astype(np.float64)
    return args, ref, kw, rkw


def _naive_varlen(ref, dt, rkw):
    """Same-dtype naive attention, sequence by sequence (rows outside sequences: 0)."""
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dt]
    q, k, v, cu_q, cu_k = ref["q"], ref["k"], ref["v"], ref["cu_q"], ref["cu_k"]
    out = np.zeros(q.shape[:2] + (v.shape[2],))
    for i in range(len(cu_q) - 1):
        a, e = cu_q[i], cu_q[i + 1]
        c, f = cu_k[i], cu_k[i + 1]
        kw = dict(rkw)
        if kw.get("alibi") is not None and kw["alibi"].ndim == 2:
            kw["alibi"] = kw["alibi"][i]
        if e > a:
            out[a:e] = attention_naive_lowp(q[None, a:e], k[None, c:f], v[None, c:f], tdt,
                                            **kw)[0]
    return out


def check_varlen(out, lse, ref, rkw, dt):
    o_ref, l_ref, _ = varlen_ref(ref["q"], ref["k"], ref["v"], ref["cu_q"], ref["cu_k"], **rkw)
    if dt in ("float32", "float64"):
        assert_close_hi(out, o_ref, dt)
    else:
        assert_close_lowp(out, o_ref, _naive_varlen(ref, dt, rkw), dt)
    assert_lse(lse, l_ref, dt)


@pytest.mark.parametrize("kind,dt", kind_dtypes())
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_flash_attn_varlen_func(cfg, kind, dt, rng):
    _, lq, lk, h, hk, d, opts = cfg
    args, ref, kw, rkw = _build(rng, kind, dt, lq, lk, h, hk, d, opts)
    out, lse, S = flash_attn_varlen_func(**args, return_attn_probs=True, **kw)
    for x in (out, lse, S):
        assert is_kind(x, kind)
    tq = ref["q"].shape[0]
    assert tuple(out.shape) == (tq, h, d) and dtype_name(out) == dt
    assert tuple(lse.shape) == (h, tq) and dtype_name(lse) == "float32"
    assert tuple(S.shape) == (0,)
    check_varlen(out, lse, ref, rkw, dt)
    # Rows past the last sequence: out 0 and lse +inf (the header's rule).
    last = int(ref["cu_q"][-1])
    assert np.all(to64(out)[last:] == 0) and np.all(to64(lse)[:, last:] == np.inf)


@pytest.mark.parametrize("kind,dt", kind_dtypes())
def test_varlen_qkvpacked(kind, dt, rng):
    lens, h, d = [7, 0, 21, 2], 4, 24
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total = int(cu[-1])
    qkv64 = randn(rng, total, 3, h, d)
    qkv = make(qkv64, dt, kind)
    r = rounded(qkv64, dt)
    ref = dict(q=r[:, 0], k=r[:, 1], v=r[:, 2], cu_q=cu, cu_k=cu)
    for causal in (False, True):
        out, lse, _ = flash_attn_varlen_qkvpacked_func(qkv, make_int32(cu, kind), max(lens),
                                                       causal=causal, return_attn_probs=True)
        assert tuple(out.shape) == (total, h, d)
        check_varlen(out, lse, ref, dict(scale=d ** -0.5, causal=causal), dt)


@pytest.mark.parametrize("kind,dt", kind_dtypes())
def test_varlen_kvpacked(kind, dt, rng):
    lq, lk, h, hk, d = [3, 15, 0], [10, 4, 6], 6, 3, 33
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q64, kv64 = randn(rng, int(cu_q[-1]), h, d), randn(rng, int(cu_k[-1]), 2, hk, d)
    rkv = rounded(kv64, dt)
    ref = dict(q=rounded(q64, dt), k=rkv[:, 0], v=rkv[:, 1], cu_q=cu_q, cu_k=cu_k)
    out, lse, _ = flash_attn_varlen_kvpacked_func(
        make(q64, dt, kind), make(kv64, dt, kind), make_int32(cu_q, kind),
        make_int32(cu_k, kind), max(lq), max(lk), causal=True, window_size=(4, -1),
        return_attn_probs=True)
    check_varlen(out, lse, ref, dict(scale=d ** -0.5, causal=True, window=(4, -1)), dt)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_varlen_matches_dense_per_sequence(kind, rng):
    """A varlen batch gives, row for row, what flash_attn_func gives for each sequence alone."""
    from flashattn import flash_attn_func

    lq, lk, h, d = [6, 13], [9, 13], 2, 16
    args, ref, kw, _ = _build(rng, kind, "float32", lq, lk, h, h, d, dict(causal=True))
    out = to64(flash_attn_varlen_func(**args, **kw))
    for i in range(2):
        a, e = ref["cu_q"][i], ref["cu_q"][i + 1]
        c, f = ref["cu_k"][i], ref["cu_k"][i + 1]
        one = flash_attn_func(args["q"][None, a:e], args["k"][None, c:f], args["v"][None, c:f],
                              causal=True)
        np.testing.assert_allclose(out[a:e], to64(one)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("page", [1, 3, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_kv_matches_dense(rng, page, causal):
    """block_table: k and v as pages in a shuffled paged cache give the dense varlen call's out,
    lse and gradients (dk, dv land in the pages of their keys, zero in pages nobody uses)."""
    lq, lk, h, hk, d = [5, 0, 9], [11, 7, 20], 4, 2, 16
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lq)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lk)]), dtype=torch.int32)
    q = torch.from_numpy(randn(rng, sum(lq), h, d)).float().requires_grad_()
    k = torch.from_numpy(randn(rng, sum(lk), hk, d)).float().requires_grad_()
    v = torch.from_numpy(randn(rng, sum(lk), hk, d)).float().requires_grad_()
    blocks = [-(-n // page) for n in lk]
    nb = sum(blocks) + 2  # two pages nobody uses
    perm = torch.from_numpy(rng.permutation(nb)).long()
    table = torch.zeros(3, max(blocks), dtype=torch.int32)
    kp = torch.zeros(nb, page, hk, d)
    vp = torch.zeros(nb, page, hk, d)
    nxt = 0
    for i, n in enumerate(lk):
        for j in range(blocks[i]):
            blk = int(perm[nxt])
            nxt += 1
            table[i, j] = blk
            rows = slice(int(cu_k[i]) + j * page, int(cu_k[i]) + min(n, (j + 1) * page))
            kp[blk, :rows.stop - rows.start] = k.detach()[rows]
            vp[blk, :rows.stop - rows.start] = v.detach()[rows]
    kp.requires_grad_()
    vp.requires_grad_()
    kw = dict(causal=causal, return_attn_probs=True)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), **kw)
    outp, lsep, _ = flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, max(lq), max(lk),
                                           block_table=table, **kw)
    torch.testing.assert_close(outp, out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lsep, lse, rtol=1e-6, atol=1e-6)
    dout = torch.from_numpy(randn(rng, sum(lq), h, d)).float()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    dqp, dkp, dvp = torch.autograd.grad(outp, (q, kp, vp), dout)
    torch.testing.assert_close(dqp, dq, rtol=1e-5, atol=1e-6)
    for i, n in enumerate(lk):
        for p in range(n):
            blk, r = int(table[i, p // page]), p % page
            torch.testing.assert_close(dkp[blk, r], dk[int(cu_k[i]) + p], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(dvp[blk, r], dv[int(cu_k[i]) + p], rtol=1e-5, atol=1e-6)
    unused = sorted(set(range(nb)) - set(table[i, j].item() for i in range(3)
                                         for j in range(blocks[i])))
    assert torch.all(dkp[unused] == 0) and torch.all(dvp[unused] == 0)


def _paged_cache(rng, lk, hk, d, page, dt, kind):
    """A shuffled paged cache holding the keys of sequences of lk keys (two spare blocks, one
    block_table column past every sequence with an id outside the cache): (k pages, v pages,
    block_table, k dense, v dense) as arrays of ``kind``."""
    blocks = [-(-n // page) for n in lk]
    nb = sum(blocks) + 2
    perm = rng.permutation(nb)
    table = np.full((len(lk), max(blocks) + 1), nb + 7, dtype=np.int32)
    kp, vp = randn(rng, nb, page, hk, d), randn(rng, nb, page, hk, d)
    rows = []
    at = 0
    for i, n in enumerate(lk):
        table[i, :blocks[i]] = perm[at:at + blocks[i]]
        at += blocks[i]
        rows += [(table[i, j // page], j % page) for j in range(n)]
    kd = np.stack([kp[b, r] for b, r in rows]) if rows else np.zeros((0, hk, d))
    vd = np.stack([vp[b, r] for b, r in rows]) if rows else np.zeros((0, hk, d))
    return (make(kp, dt, kind), make(vp, dt, kind), make_int32(table, kind), make(kd, dt, kind),
            make(vd, dt, kind))


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("page", [1, 3, 16, 256])
@pytest.mark.parametrize("rows,opts", [
    ("few", dict(causal=True)),
    ("few", dict(window_size=(40, 3))),
    ("many", dict(causal=True)),
    ("many", dict(window_size=(25, 0), softcap=5.0)),
])
def test_paged_kv_in_place(rng, monkeypatch, kind, page, rows, opts):
    """block_table without gradients: the library reads the pages in place (the torch gather is
    never called) and gives the dense varlen call's out and lse bit for bit, GQA, few query rows
    (the decode schedule) and many, an empty sequence, seqused_k through the internal forward."""
    from flashattn import _paged
    from flashattn.flash_attn_interface import _flash_attn_varlen_forward

    def no_gather(*args, **kwargs):
        raise AssertionError("the paged call gathered its pages")

    lq = [1, 0, 3, 2] if rows == "few" else [40, 0, 77, 9]
    lk = [300, 5, 128, 513]
    h, hk, d = 8, 2, 32
    kp, vp, table, kd, vd = _paged_cache(rng, lk, hk, d, page, "float32", kind)
    q = make(randn(rng, sum(lq), h, d), "float32", kind)
    cu_q = make_int32(np.concatenate([[0], np.cumsum(lq)]), kind)
    cu_k = make_int32(np.concatenate([[0], np.cumsum(lk)]), kind)
    kw = dict(return_attn_probs=True, **opts)
    out, lse, _ = flash_attn_varlen_func(q, kd, vd, cu_q, cu_k, max(lq), max(lk), **kw)
    monkeypatch.setattr(_paged, "paged_kv", no_gather)
    outp, lsep, _ = flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, max(lq), max(lk),
                                           block_table=table, **kw)
    np.testing.assert_array_equal(to64(outp), to64(out))
    np.testing.assert_array_equal(to64(lsep), to64(lse))
    used = make_int32([17, 5, 0, 400], kind)
    fw = dict(dropout_p=0.0, softmax_scale=0.3, causal=opts.get("causal", False),
              window_size_left=opts.get("window_size", (-1, -1))[0],
              window_size_right=opts.get("window_size", (-1, -1))[1], seqused_k=used)
    ref = _flash_attn_varlen_forward(q, kd, vd, cu_q, cu_k, max(lq), max(lk), **fw)
    got = _flash_attn_varlen_forward(q, kp, vp, cu_q, cu_k, max(lq), max(lk),
                                     block_table=table, **fw)
    np.testing.assert_array_equal(to64(got[0]), to64(ref[0]))
    np.testing.assert_array_equal(to64(got[1]), to64(ref[1]))


def test_paged_kv_gathers_only_for_gradients(rng, monkeypatch):
    """The torch gather runs exactly when autograd records the call (an input that requires
    grad, grad mode on); under torch.no_grad the pages are read in place, and a paged call
    refuses more keys than its block_table row holds, naming block_table."""
    from flashattn import _paged

    calls = []
    gather = _paged.paged_kv
    monkeypatch.setattr(_paged, "paged_kv", lambda *a, **k: calls.append(1) or gather(*a, **k))
    lq, lk = [3, 20], [40, 70]
    kp, vp, table, _, _ = _paged_cache(rng, lk, 2, 16, 16, "float32", "torch")
    q = torch.from_numpy(randn(rng, sum(lq), 4, 16)).float().requires_grad_()
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lq)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lk)]), dtype=torch.int32)
    out = flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 20, 70, block_table=table)
    assert calls == [1] and out.requires_grad
    with torch.no_grad():
        out_ng = flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 20, 70, block_table=table)
    assert calls == [1]
    torch.testing.assert_close(out_ng, out.detach(), rtol=0, atol=0)
    long_k = torch.tensor([0, 40, 40 + 16 * table.shape[1] + 1], dtype=torch.int32)
    with pytest.raises(Exception, match="block_table"):
        with torch.no_grad():
            flash_attn_varlen_func(q, kp, vp, cu_q, long_k, 20, 200, block_table=table)


def test_zero_tensors_internal(rng):
    """Upstream's internal _flash_attn_varlen_forward(zero_tensors=True) leaves -inf in lse
    rows outside every sequence."""
    from flashattn.flash_attn_interface import _flash_attn_varlen_forward

    q = torch.from_numpy(randn(rng, 10, 2, 8)).float()
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out, lse, S, rng_state = _flash_attn_varlen_forward(q, q, q, cu, cu, 4, 4, 0.0, 0.3, False,
                                                        zero_tensors=True)
    assert torch.all(lse[:, 7:] == float("-inf")) and torch.all(torch.isfinite(lse[:, :7]))
    assert torch.all(out[7:] == 0)
    assert tuple(S.shape) == (0,) and tuple(rng_state.shape) == (2,)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_seqused_k_internal(kind, rng):
    """_flash_attn_varlen_forward(seqused_k=...): sequence i uses only its first seqused_k[i]
    keys (and causal alignment counts those)."""
    from flashattn.flash_attn_interface import _flash_attn_varlen_forward

    lq, lk, used, h, d = [4, 9, 3], [10, 12, 5], [7, 0, 5], 2, 16
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q64, k64, v64 = (randn(rng, int(c[-1]), h, d) for c in (cu_q, cu_k, cu_k))
    out, lse, _, _ = _flash_attn_varlen_forward(
        make(q64, "float64", kind), make(k64, "float64", kind), make(v64, "float64", kind),
        make_int32(cu_q, kind), make_int32(cu_k, kind), max(lq), max(lk), 0.0, d ** -0.5, True,
        seqused_k=make_int32(used, kind))
    # Reference: the same batch with each k sequence cut to its used length.
    keep_rows = np.concatenate([np.arange(cu_k[i], cu_k[i] + used[i]) for i in range(3)])
    cu_used = np.concatenate([[0], np.cumsum(used)]).astype(np.int32)
    o_ref, l_ref, _ = varlen_ref(q64, k64[keep_rows], v64[keep_rows], cu_q, cu_used,
                                 d ** -0.5, causal=True)
    assert_close_hi(out, o_ref, "float64")
    assert_lse(lse, l_ref, "float64")


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_rows_outside_sequences(kind, rng):
    """cu_seqlens need not start at 0 nor end at the last row: rows before cu_seqlens_q[0] and
    after cu_seqlens_q[b] get out 0 and lse +inf."""
    h, d = 3, 12
    cu_q = np.array([3, 7, 10], dtype=np.int32)
    cu_k = np.array([2, 9, 9], dtype=np.int32)
    q64, k64, v64 = randn(rng, 12, h, d), randn(rng, 11, h, d), randn(rng, 11, h, d)
    out, lse, _ = flash_attn_varlen_func(
        make(q64, "float32", kind), make(k64, "float32", kind), make(v64, "float32", kind),
        make_int32(cu_q, kind), make_int32(cu_k, kind), 4, 7, causal=True,
        return_attn_probs=True)
    o_ref, l_ref, _ = varlen_ref(*(rounded(x, "float32") for x in (q64, k64, v64)), cu_q, cu_k,
                                 d ** -0.5, causal=True)
    assert_close_hi(out, o_ref, "float32")
    assert_lse(lse, l_ref, "float32")
    o, l = to64(out), to64(lse)
    assert np.all(o[:3] == 0) and np.all(o[10:] == 0)
    assert np.all(l[:, :3] == np.inf) and np.all(l[:, 10:] == np.inf)
