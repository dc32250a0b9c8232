"""flashattn.fa3 (FA3's interface) against the package's FA2-style functions and a float64
reference: signatures, return values and lse layout, FA3's conventions (lse -inf for a row that
sees no key, seqused_q's diagonal), paged keys with any page size, scheduler metadata, and the
message of every refused argument."""

import inspect
import re

import numpy as np
import pytest
import torch

from flashattn import FlashAttnError, fa3
from flashattn import flash_attn_interface as fa2
from reference import attention_ref
from test_kvcache import check as kvcache_check
from test_kvcache import setup as kvcache_setup

I32 = torch.int32
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def rand(rng, *shape, dtype=torch.float32):
    return torch.from_numpy(rng.uniform(-1, 1, shape)).to(dtype)


def close(got, ref, dtype, what="out"):
    """got (torch) against a float64 reference, with FA3's -inf for rows that see no key."""
    got = got.detach().double().numpy()
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), fin), what
    assert np.array_equal(got[~fin], ref[~fin]), what
    np.testing.assert_allclose(got[fin], ref[fin], atol=TOL[dtype], rtol=1e-5, err_msg=what)


def fa3_lse(lse):
    """The reference's +inf (no key seen) as FA3 writes it."""
    return np.where(np.isinf(lse) & (lse > 0), -np.inf, lse)


def lengths(rng, b, lo, hi):
    n = rng.integers(lo, hi + 1, size=b)
    return n, torch.from_numpy(np.concatenate([[0], np.cumsum(n)])).to(I32)


CASES = [  # causal, window, softcap, h, hk
    (False, (-1, -1), 0.0, 4, 4),
    (True, (-1, -1), 0.0, 4, 2),
    (False, (3, 1), 0.0, 6, 2),
    (True, (-1, -1), 5.0, 2, 1),
    (False, (2, -1), 3.0, 4, 2),
]


# --------------------------------------------------------------------------------------------
# Signatures (FA3's hopper/flash_attn_interface.py, in order, with their defaults)

FA3_SIGNATURES = {
    "flash_attn_func": "q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, "
    "k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, "
    "num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False",
    "flash_attn_varlen_func": "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
    "max_seqlen_k, seqused_q=None, seqused_k=None, softmax_scale=None, causal=False, qv=None, "
    "q_descale=None, k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, "
    "softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0, "
    "return_attn_probs=False, *, page_table=None",
    "flash_attn_with_kvcache": "q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, "
    "rotary_sin=None, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, "
    "page_table=None, cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, "
    "rotary_seqlens=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, "
    "causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0, "
    "rotary_interleaved=True, scheduler_metadata=None, num_splits=0, pack_gqa=None, "
    "sm_margin=0, return_softmax_lse=False",
    "flash_attn_combine": "out_partial, lse_partial, out=None, out_dtype=None",
    "get_scheduler_metadata": "batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, "
    "num_heads_kv, headdim, cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None, "
    "cu_seqlens_q=None, cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, "
    "max_seqlen_k_new=0, causal=False, window_size=(-1, -1), attention_chunk=0, "
    "has_softcap=False, num_splits=0, pack_gqa=None, sm_margin=0",
    "flash_attn_qkvpacked_func": "qkv, softmax_scale=None, causal=False, q_descale=None, "
    "k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, "
    "deterministic=False, num_heads_q=None, sm_margin=0, return_attn_probs=False",
}


@pytest.mark.parametrize("name", sorted(FA3_SIGNATURES))
def test_signature_is_fa3s(name):
    assert str(inspect.signature(getattr(fa3, name))) == "(%s)" % FA3_SIGNATURES[name]
    assert name in fa3.__all__


# --------------------------------------------------------------------------------------------
# flash_attn_func / flash_attn_qkvpacked_func


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal,window,softcap,h,hk", CASES)
def test_func(rng, dtype, causal, window, softcap, h, hk):
    b, sq, sk, d = 2, int(rng.integers(1, 9)), int(rng.integers(1, 12)), 16
    q, k, v = rand(rng, b, sq, h, d, dtype=dtype), rand(rng, b, sk, hk, d, dtype=dtype), \
        rand(rng, b, sk, hk, 8, dtype=dtype)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = fa3.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    ro, rl, _ = attention_ref(q.numpy(), k.numpy(), v.numpy(), None, causal, window, softcap)
    close(out, ro, dtype)
    assert lse.dtype == torch.float32 and lse.shape == (b, h, sq)
    close(lse, fa3_lse(rl).astype(np.float32), torch.float32, "lse")
    # The package's FA2 function gives the same out bitwise, and lse but for FA3's -inf.
    out2, lse2, _ = fa2.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert torch.equal(out, out2)
    assert torch.equal(lse, torch.where(torch.isinf(lse2), float("-inf"), lse2))
    plain = fa3.flash_attn_func(q, k, v, **kw)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)


def test_func_row_without_keys_has_lse_minus_inf(rng):
    # causal with sq > sk: the first sq - sk rows see no key.
    q, k, v = rand(rng, 1, 6, 2, 8), rand(rng, 1, 2, 2, 8), rand(rng, 1, 2, 2, 8)
    out, lse = fa3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.all(lse[:, :, :4] == float("-inf")) and torch.isfinite(lse[:, :, 4:]).all()
    assert torch.all(out[:, :4] == 0)


def test_func_backward_matches_fa2(rng):
    q, k, v = (rand(rng, 2, 5, 4, 16, dtype=torch.float64).requires_grad_(),
               rand(rng, 2, 7, 2, 16, dtype=torch.float64).requires_grad_(),
               rand(rng, 2, 7, 2, 16, dtype=torch.float64).requires_grad_())
    dout = rand(rng, 2, 5, 4, 16, dtype=torch.float64)
    grads = torch.autograd.grad(fa3.flash_attn_func(q, k, v, causal=True, softcap=4.0),
                                (q, k, v), dout)
    ref = torch.autograd.grad(fa2.flash_attn_func(q, k, v, causal=True, softcap=4.0),
                              (q, k, v), dout)
    for g, r in zip(grads, ref):
        assert torch.isfinite(g).all() and g.abs().sum() > 0 and torch.equal(g, r)


def test_qkvpacked(rng):
    qkv = rand(rng, 2, 6, 3, 4, 16)
    out, lse = fa3.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    o, l = fa3.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True,
                               return_attn_probs=True)
    assert torch.equal(out, o) and torch.equal(lse, l)
    # 4-D: q's heads, then k's, then v's (GQA: 6 query heads, 2 kv heads).
    qkv4 = rand(rng, 2, 6, 10, 16)
    out = fa3.flash_attn_qkvpacked_func(qkv4, num_heads_q=6, window_size=(2, 0))
    ro, _, _ = attention_ref(qkv4[:, :, :6].numpy(), qkv4[:, :, 6:8].numpy(),
                             qkv4[:, :, 8:].numpy(), None, False, (2, 0))
    close(out, ro, torch.float32)
    with pytest.raises(FlashAttnError, match="num_heads_q"):
        fa3.flash_attn_qkvpacked_func(qkv4)
    with pytest.raises(FlashAttnError, match="num_heads_q"):
        fa3.flash_attn_qkvpacked_func(qkv4, num_heads_q=7)


# --------------------------------------------------------------------------------------------
# flash_attn_varlen_func


def varlen_reference(q, k, v, cu_q, cu_k, used_q, used_k, **kw):
    """float64 out (total_q, h, dv) and FA3's lse (h, total_q): sequence i's first used_q[i]
    queries against its first used_k[i] keys; the other rows 0 / -inf."""
    total, h = q.shape[0], q.shape[1]
    out, lse = np.zeros((total, h, v.shape[-1])), np.full((h, total), -np.inf)
    for i in range(len(cu_q) - 1):
        a, c = int(cu_q[i]), int(cu_k[i])
        n, m = int(used_q[i]), int(used_k[i])
        o, l, _ = attention_ref(q[None, a:a + n], k[None, c:c + m], v[None, c:c + m], **kw)
        out[a:a + n], lse[:, a:a + n] = o[0], fa3_lse(l[0])
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal,window,softcap,h,hk", CASES)
def test_varlen_seqused(rng, dtype, causal, window, softcap, h, hk):
    b, d = 3, 16
    nq, cu_q = lengths(rng, b, 0, 7)
    nk, cu_k = lengths(rng, b, 1, 9)
    used_q = torch.from_numpy(rng.integers(0, nq + 1)).to(I32)
    used_k = torch.from_numpy(rng.integers(0, nk + 1)).to(I32)
    q = rand(rng, int(cu_q[-1]), h, d, dtype=dtype)
    # Keys past seqused_k are poison: reading one would show in the output.
    k, v = rand(rng, int(cu_k[-1]), hk, d, dtype=dtype), rand(rng, int(cu_k[-1]), hk, 8,
                                                               dtype=dtype)
    for i in range(b):
        k[int(cu_k[i]) + int(used_k[i]):int(cu_k[i + 1])] = 1e4
        v[int(cu_k[i]) + int(used_k[i]):int(cu_k[i + 1])] = 1e4
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, int(nq.max()), int(nk.max()),
                                          seqused_q=used_q, seqused_k=used_k,
                                          return_attn_probs=True, **kw)
    ro, rl = varlen_reference(q.numpy(), k.numpy(), v.numpy(), cu_q, cu_k, used_q, used_k,
                              causal=causal, window=window, softcap=softcap)
    close(out, ro, dtype)
    assert lse.shape == (h, q.shape[0]) and lse.dtype == torch.float32
    close(lse, rl.astype(np.float32), torch.float32, "lse")
    # Without seqused_q: the package's FA2 varlen call on the same keys, bitwise.
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, int(nq.max()), int(nk.max()),
                                          seqused_k=used_k, return_attn_probs=True, **kw)
    o2, l2, _, _ = fa2._flash_attn_varlen_forward(
        q, k, v, cu_q, cu_k, int(nq.max()), int(nk.max()), 0.0, None, causal, window[0],
        window[1], softcap, None, False, seqused_k=used_k)
    assert torch.equal(out, o2)
    assert torch.equal(lse, torch.where(torch.isinf(l2), float("-inf"), l2))


def test_varlen_seqused_q_gradients(rng):
    b, h, d = 3, 2, 8
    nq, cu_q = lengths(rng, b, 1, 6)
    nk, cu_k = lengths(rng, b, 1, 6)
    used_q = torch.from_numpy(rng.integers(0, nq + 1)).to(I32)
    q = rand(rng, int(cu_q[-1]), h, d, dtype=torch.float64).requires_grad_()
    k = rand(rng, int(cu_k[-1]), h, d, dtype=torch.float64).requires_grad_()
    v = rand(rng, int(cu_k[-1]), h, d, dtype=torch.float64).requires_grad_()
    dout = rand(rng, int(cu_q[-1]), h, d, dtype=torch.float64)
    out = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, seqused_q=used_q, causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    # Reference: the used rows as their own varlen batch (their own causal diagonal).
    rows = torch.cat([torch.arange(int(cu_q[i]), int(cu_q[i]) + int(used_q[i]))
                      for i in range(b)]).long()
    cu_u = torch.cat([torch.zeros(1, dtype=I32), used_q.cumsum(0).to(I32)])
    ref = fa2.flash_attn_varlen_func(q[rows], k, v, cu_u, cu_k, 6, 6, causal=True)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), dout[rows])
    for g, r in ((dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12)
    unused = torch.ones(q.shape[0], dtype=torch.bool)
    unused[rows] = False
    assert torch.all(dq[unused] == 0) and torch.all(out[unused] == 0)


def make_pages(rng, b, page, h_k, d, dv, dtype=torch.float32, spare=3):
    """A paged cache (num_pages, page, h_k, d) with a shuffled page_table whose rows hold ~20
    keys; the spare pages are poison."""
    per_seq = -(-20 // page)
    n_pages = b * per_seq + spare
    table = torch.from_numpy(rng.permutation(n_pages)[:b * per_seq].reshape(b, per_seq)).to(I32)
    kc = torch.full((n_pages, page, h_k, d), 1e4, dtype=dtype)
    vc = torch.full((n_pages, page, h_k, dv), 1e4, dtype=dtype)
    used = table.flatten().long()
    kc[used] = rand(rng, len(used), page, h_k, d, dtype=dtype)
    vc[used] = rand(rng, len(used), page, h_k, dv, dtype=dtype)
    return kc, vc, table


def dense_keys(cache, table, n):
    """The first n keys of a page_table row as a (n, h_k, d) tensor."""
    page = cache.shape[1]
    return torch.stack([cache[int(table[p // page]), p % page] for p in range(n)]) if n else \
        cache.new_zeros((0,) + tuple(cache.shape[2:]))


@pytest.mark.parametrize("page", [1, 3, 16])
@pytest.mark.parametrize("batched_q", [False, True])
@pytest.mark.parametrize("causal,window,softcap,h,hk", CASES[1:4])
def test_varlen_paged(rng, page, batched_q, causal, window, softcap, h, hk):
    b, d = 3, 16
    kc, vc, table = make_pages(rng, b, page, hk, d, 8)
    cap = table.shape[1] * page
    used_k = torch.from_numpy(rng.integers(1, cap + 1, size=b)).to(I32)
    sq = 4
    if batched_q:
        q = rand(rng, b, sq, h, d)
        cu_q, qv = None, q.reshape(b * sq, h, d)
        cu = torch.arange(0, (b + 1) * sq, sq, dtype=I32)
    else:
        nq, cu = lengths(rng, b, 0, sq)
        q = qv = rand(rng, int(cu[-1]), h, d)
        cu_q = cu
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = fa3.flash_attn_varlen_func(q, kc, vc, cu_q, None, sq, int(used_k.max()),
                                          seqused_k=used_k, page_table=table,
                                          return_attn_probs=True, **kw)
    keys = [dense_keys(kc, table[i], int(used_k[i])) for i in range(b)]
    vals = [dense_keys(vc, table[i], int(used_k[i])) for i in range(b)]
    cu_k = torch.cat([torch.zeros(1, dtype=I32), used_k.cumsum(0).to(I32)])
    ro, rl = varlen_reference(qv.numpy(), torch.cat(keys).numpy(), torch.cat(vals).numpy(), cu,
                              cu_k, cu[1:] - cu[:-1], used_k, causal=causal, window=window,
                              softcap=softcap)
    if batched_q:
        ro = ro.reshape(b, sq, h, 8)
        rl = rl.reshape(h, b, sq).transpose(1, 0, 2)
    close(out, ro, torch.float32)
    close(lse, rl.astype(np.float32), torch.float32, "lse")
    # The package's FA2 form (block_table, key counts in cu_seqlens_k) gives the same out.
    o2 = fa2.flash_attn_varlen_func(qv, kc, vc, cu, cu_k, sq, int(used_k.max()),
                                    block_table=table, **kw)
    assert torch.equal(out.reshape(o2.shape), o2)


def test_varlen_paged_whole_rows_and_batched_k(rng):
    # No seqused_k: every key of each page_table row (FA3's default).
    b, h, d = 2, 2, 8
    kc, vc, table = make_pages(rng, b, 3, h, d, d, spare=0)
    q = rand(rng, b, 2, h, d)
    out = fa3.flash_attn_varlen_func(q, kc, vc, None, None, None, None, page_table=table)
    cap = table.shape[1] * 3
    ks = torch.stack([dense_keys(kc, table[i], cap) for i in range(b)])
    vs = torch.stack([dense_keys(vc, table[i], cap) for i in range(b)])
    assert torch.equal(out, fa3.flash_attn_func(q, ks, vs))
    # Batched q and k (both cu_seqlens None) with seqused_k: lse in (b, h, sq).
    used = torch.tensor([2, cap], dtype=I32)
    out, lse = fa3.flash_attn_varlen_func(q, ks, vs, None, None, None, None, seqused_k=used,
                                          return_attn_probs=True)
    for i in range(b):
        o, l = fa3.flash_attn_func(q[i:i + 1], ks[i:i + 1, :int(used[i])],
                                   vs[i:i + 1, :int(used[i])], return_attn_probs=True)
        torch.testing.assert_close(out[i:i + 1], o, rtol=0, atol=1e-6)
        torch.testing.assert_close(lse[i:i + 1], l, rtol=0, atol=1e-6)
    assert lse.shape == (b, h, 2) and lse.is_contiguous()


# --------------------------------------------------------------------------------------------
# flash_attn_with_kvcache, get_scheduler_metadata, flash_attn_combine


def kv_run(P, A, **kw):
    return fa3.flash_attn_with_kvcache(
        A["q"], A["kc"], A["vc"], A.get("k"), A.get("v"), None, A.get("cos"), A.get("sin"),
        cache_seqlens=torch.from_numpy(P["seqlens"].astype(np.int32)),
        page_table=None if P["table"] is None else torch.from_numpy(P["table"].astype(np.int32)),
        return_softmax_lse=True, **kw)


@pytest.mark.parametrize("page", [None, 1, 3, 16])
@pytest.mark.parametrize("opts", [{}, {"causal": True}, {"softcap": 4.0, "window_size": (5, 0)},
                                  {"rotary": True, "causal": True}])
def test_kvcache(rng, page, opts):
    opts = dict(opts)
    rotary = opts.pop("rotary", False)
    P, A, V = kvcache_setup(rng, "torch", "float32", sq=2, s_new=2, page=page, rotary=rotary)
    res = kv_run(P, A, **opts)
    assert len(res) == 4
    out, lse, out_accum, lse_accum = res
    assert out_accum.shape == (0,) == lse_accum.shape and out_accum.dtype == torch.float32
    assert lse.shape == (2, 4, 2)
    kvcache_check(P, A, V, "float32", out, lse, window=opts.get("window_size", (-1, -1)),
                  causal=opts.get("causal", False), softcap=opts.get("softcap", 0.0))


def test_kvcache_matches_fa2_and_default_return(rng):
    P, A, _ = kvcache_setup(rng, "torch", "float32", sq=3, s_new=0, page=3)
    table = torch.from_numpy(P["table"].astype(np.int32))
    seqlens = torch.from_numpy(P["seqlens"].astype(np.int32))
    out = fa3.flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], cache_seqlens=seqlens,
                                      page_table=table, causal=True)
    assert isinstance(out, torch.Tensor)
    ref = fa2.flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], cache_seqlens=seqlens,
                                      block_table=table, causal=True)
    assert torch.equal(out, ref)
    # An empty cache: FA3 gives lse -inf (FA2 +inf) and out 0.
    zero = torch.zeros_like(seqlens)
    out, lse, _, _ = fa3.flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], cache_seqlens=zero,
                                                 page_table=table, return_softmax_lse=True)
    assert torch.all(lse == float("-inf")) and torch.all(out == 0)


def test_scheduler_metadata_is_honoured(rng, monkeypatch):
    P, A, _ = kvcache_setup(rng, "torch", "float32", b=2, sq=1, h=4, hk=2, d=16, dv=16,
                            s_new=0, page=3)
    table = torch.from_numpy(P["table"].astype(np.int32))
    seqlens = torch.from_numpy(P["seqlens"].astype(np.int32))
    meta = fa3.get_scheduler_metadata(2, 1, 40, 4, 2, 16, seqlens, page_size=3, num_splits=3)
    assert meta.dtype == torch.int32 and meta.dim() == 1 and meta.device == seqlens.device
    call = dict(cache_seqlens=seqlens, page_table=table, return_softmax_lse=True)
    with_meta = fa3.flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], scheduler_metadata=meta,
                                            **call)
    direct = fa3.flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], num_splits=3, **call)
    assert torch.equal(with_meta[0], direct[0]) and torch.equal(with_meta[1], direct[1])
    # The split count reaches the package's call.
    seen = []
    real = fa2.flash_attn_with_kvcache

    def spy(*args, **kw):
        seen.append(args[17])
        return real(*args, **kw)

    monkeypatch.setattr(fa2, "flash_attn_with_kvcache", spy)
    fa3.flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], scheduler_metadata=meta, **call)
    fa3.flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], **call)
    assert seen == [3, 0]
    # Metadata of another problem, or not from get_scheduler_metadata, is refused.
    other = fa3.get_scheduler_metadata(2, 1, 40, 8, 2, 16, seqlens, page_size=3)
    with pytest.raises(FlashAttnError, match="scheduler_metadata: made for num_heads_q 8"):
        fa3.flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], scheduler_metadata=other, **call)
    unpaged = fa3.get_scheduler_metadata(2, 1, 40, 4, 2, 16, seqlens)
    with pytest.raises(FlashAttnError, match="scheduler_metadata: made for page_size 0"):
        fa3.flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], scheduler_metadata=unpaged,
                                    **call)
    with pytest.raises(FlashAttnError, match="scheduler_metadata: not made by"):
        fa3.flash_attn_with_kvcache(A["q"], A["kc"], A["vc"],
                                    scheduler_metadata=torch.zeros(8, dtype=I32), **call)
    with pytest.raises(FlashAttnError, match="scheduler_metadata: expected the int32"):
        fa3.flash_attn_with_kvcache(A["q"], A["kc"], A["vc"],
                                    scheduler_metadata=meta.long(), **call)
    with pytest.raises(FlashAttnError, match="num_splits: 2 differs"):
        fa3.flash_attn_with_kvcache(A["q"], A["kc"], A["vc"], scheduler_metadata=meta,
                                    num_splits=2, **call)


def test_combine_merges_fa3_lse(rng):
    # Two key chunks run by fa3.flash_attn_func (causal: some rows see no key of a chunk, lse
    # -inf), merged by fa3.flash_attn_combine, equal the whole attention.
    q, k, v = rand(rng, 2, 6, 2, 8), rand(rng, 2, 10, 2, 8), rand(rng, 2, 10, 2, 8)
    # Query i sees keys j <= i + 4: all of the first chunk, and in the second (bottom-right
    # aligned) keys j' <= i - 1, its causal mask.
    parts = [fa3.flash_attn_func(q, k[:, :5], v[:, :5], return_attn_probs=True),
             fa3.flash_attn_func(q, k[:, 5:], v[:, 5:], causal=True, return_attn_probs=True)]
    assert torch.isinf(parts[1][1]).any()
    out_partial = torch.stack([p[0] for p in parts])
    lse_partial = torch.stack([p[1].transpose(1, 2) for p in parts])
    poisoned = torch.full((2, 6, 2, 8), float("nan"))
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial, out=poisoned)
    assert out is poisoned
    ro, rl, _ = attention_ref(q.numpy(), k.numpy(), v.numpy(), None, True)
    close(out, ro, torch.float32)
    assert lse.shape == (2, 6, 2)
    close(lse, rl.transpose(0, 2, 1).astype(np.float32), torch.float32, "lse")


# --------------------------------------------------------------------------------------------
# Arguments accepted and ignored, and refused ones


def test_ignored_tuning_arguments(rng):
    q, k, v = rand(rng, 1, 4, 4, 8), rand(rng, 1, 5, 2, 8), rand(rng, 1, 5, 2, 8)
    base = fa3.flash_attn_func(q, k, v)
    assert torch.equal(fa3.flash_attn_func(q, k, v, num_splits=4, pack_gqa=True, sm_margin=8,
                                           deterministic=True), base)
    with pytest.raises(FlashAttnError, match="num_splits: 257"):
        fa3.flash_attn_func(q, k, v, num_splits=257)
    with pytest.raises(TypeError, match="sm_margin"):
        fa3.flash_attn_func(q, k, v, sm_margin="all")


def refusal_calls(rng):
    """(name, call(**kw)) for every function, each taking one refused argument."""
    q, k, v = rand(rng, 1, 2, 2, 8), rand(rng, 1, 3, 2, 8), rand(rng, 1, 3, 2, 8)
    cu = torch.tensor([0, 2], dtype=I32)
    cu_k = torch.tensor([0, 3], dtype=I32)
    lens = torch.tensor([1], dtype=I32)
    return {
        "func": lambda **kw: fa3.flash_attn_func(q, k, v, **kw),
        "varlen": lambda **kw: fa3.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu_k, 2, 3,
                                                          **kw),
        "kvcache": lambda **kw: fa3.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, **kw),
    }


@pytest.mark.parametrize("function", ["func", "varlen", "kvcache"])
@pytest.mark.parametrize("name,value,words", [
    ("qv", "tensor", "qv (MLA"),
    ("attention_chunk", 4, "attention_chunk=4 (chunked local attention)"),
])
def test_refused(rng, function, name, value, words):
    call = refusal_calls(rng)[function]
    arg = torch.ones(1, 1) if value == "tensor" else value
    with pytest.raises(NotImplementedError, match=re.escape(words)):
        call(**{name: arg})


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
def test_descales_need_fp8(rng, name):
    """FP8 descales: refused with non-fp8 inputs; the KV-cache call refuses an fp8 q
    (q_descale) and takes k_descale / v_descale with fp8 caches only."""
    calls = refusal_calls(rng)
    for function in ("func", "varlen"):
        with pytest.raises(FlashAttnError, match=name + ": descales apply to fp8 inputs only"):
            calls[function](**{name: torch.ones(1, 1)})
    if name == "q_descale":
        with pytest.raises(NotImplementedError, match=re.escape(name + " (an fp8 q")):
            calls["kvcache"](**{name: torch.ones(1, 1)})
    else:
        with pytest.raises(FlashAttnError, match=name + ": descales apply to fp8 inputs only"):
            calls["kvcache"](**{name: torch.ones(1, 1)})


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k_new", "rotary_seqlens"])
def test_refused_kvcache_varlen(rng, name):
    with pytest.raises(NotImplementedError, match="flashattn.fa3: %s " % name):
        refusal_calls(rng)["kvcache"](**{name: torch.tensor([0, 2], dtype=I32)})


def test_refused_scheduler_metadata_arguments():
    lens = torch.tensor([3], dtype=I32)
    with pytest.raises(NotImplementedError, match="attention_chunk=8"):
        fa3.get_scheduler_metadata(1, 1, 4, 2, 2, 8, lens, attention_chunk=8)
    with pytest.raises(NotImplementedError, match="cu_seqlens_q"):
        fa3.get_scheduler_metadata(1, 1, 4, 2, 2, 8, lens, cu_seqlens_q=lens)
    with pytest.raises(NotImplementedError, match="qkv_dtype torch.float8_e4m3fn"):
        fa3.get_scheduler_metadata(1, 1, 4, 2, 2, 8, lens, qkv_dtype=torch.float8_e4m3fn)
    with pytest.raises(FlashAttnError, match="num_heads_kv: 3 does not divide"):
        fa3.get_scheduler_metadata(1, 1, 4, 4, 3, 8, lens)


def test_bad_arguments_name_themselves(rng):
    q, k, v = rand(rng, 4, 2, 8), rand(rng, 5, 2, 8), rand(rng, 5, 2, 8)
    cu, cu_k = torch.tensor([0, 2, 4], dtype=I32), torch.tensor([0, 2, 5], dtype=I32)
    with pytest.raises(FlashAttnError, match=r"seqused_q: sequence 1 uses 3 queries"):
        fa3.flash_attn_varlen_func(q, k, v, cu, cu_k, 2, 3,
                                   seqused_q=torch.tensor([1, 3], dtype=I32))
    with pytest.raises(FlashAttnError, match=r"seqused_k: expected int32 of shape \(2,\)"):
        fa3.flash_attn_varlen_func(q, k, v, cu, cu_k, 2, 3, seqused_k=torch.tensor([1, 3]))
    kc, vc, table = make_pages(rng, 2, 4, 2, 8, 8)
    cap = table.shape[1] * 4
    with pytest.raises(FlashAttnError, match="cu_seqlens_k: must be None with page_table"):
        fa3.flash_attn_varlen_func(q, kc, vc, cu, cu_k, 2, 3, page_table=table)
    with pytest.raises(FlashAttnError, match=r"seqused_k: key counts must lie in \[0, %d\]"
                       % cap):
        fa3.flash_attn_varlen_func(q, kc, vc, cu, None, 2, None, page_table=table,
                                   seqused_k=torch.tensor([1, cap + 1], dtype=I32))
    with pytest.raises(FlashAttnError, match=r"seqused_k: key counts must lie in \[0, 6\]"):
        fa3.flash_attn_varlen_func(q, kc, vc, cu, None, 2, 6, page_table=table,
                                   seqused_k=torch.tensor([1, 7], dtype=I32))
    with pytest.raises(TypeError, match="q: flashattn.fa3 takes torch tensors"):
        fa3.flash_attn_func(q.numpy(), k, v)
