"""flash_attn_with_kvcache with fp8 caches (torch.float8_e4m3fn / float8_e5m2) and FA3's
k_descale / v_descale, on the CPU: against the library's float32 path run on the caches
dequantised here (code * descale of the row's sequence and kv head), the appended rows against
torch's own rounding of k / k_descale, and the refusals."""

import numpy as np
import pytest
import torch

from flashattn import FlashAttnError, flash_attn_with_kvcache
from flashattn import fa3

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def fp8_cache(rng, shape, kind):
    x = torch.from_numpy(rng.uniform(-3, 3, shape).astype(np.float32))
    return (x * torch.from_numpy(2.0 ** -rng.integers(0, 6, shape)).float()).to(kind)


def dequant(cache, descale, rows_of):
    """cache (blocks, page, hk, d) in float32, each sequence's rows times its descales:
    rows_of[i] lists the (block, row) pairs sequence i reads."""
    out = cache.float()
    if descale is None:
        return out
    for i, rows in enumerate(rows_of):
        for blk, row in rows:
            out[blk, row] = cache[blk, row].float() * descale[i][:, None]
    return out


def setup(rng, dt, kind, b=3, sq=1, h=8, hk=2, d=64, page=None, cap=48, s_new=1, descales=True):
    q = torch.from_numpy(rng.uniform(-1, 1, (b, sq, h, d)).astype(np.float32)).to(dt)
    seqlens = torch.from_numpy(rng.integers(0, cap - s_new + 1, b).astype(np.int32))
    if page:
        nb = cap // page
        perm = torch.from_numpy(rng.permutation(b * nb + 2).astype(np.int32))
        table = perm[:b * nb].reshape(b, nb).contiguous()
        kc = fp8_cache(rng, (b * nb + 2, page, hk, d), kind)
        rows_of = [[(int(table[i, p // page]), p % page) for p in range(cap)] for i in range(b)]
    else:
        table = None
        kc = fp8_cache(rng, (b, cap, hk, d), kind)
        rows_of = [[(i, p) for p in range(cap)] for i in range(b)]
    vc = fp8_cache(rng, tuple(kc.shape), kind)
    knew = torch.from_numpy(rng.uniform(-1, 1, (b, s_new, hk, d)).astype(np.float32)).to(dt)
    vnew = torch.from_numpy(rng.uniform(-1, 1, (b, s_new, hk, d)).astype(np.float32)).to(dt)
    kd = torch.from_numpy(rng.uniform(0.1, 2, (b, hk)).astype(np.float32)) if descales else None
    vd = torch.from_numpy(rng.uniform(0.1, 2, (b, hk)).astype(np.float32)) if descales else None
    return q, kc, vc, knew, vnew, seqlens, table, kd, vd, rows_of


@pytest.mark.parametrize("kind", FP8)
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page", [None, 1, 3, 16])
def test_fp8_cache_matches_dequantised(rng, kind, dt, page):
    q, kc, vc, knew, vnew, seqlens, table, kd, vd, rows_of = setup(
        rng, dt, kind, sq=2, page=page)
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, knew, vnew, cache_seqlens=seqlens,
                                       block_table=table, causal=True, num_splits=3,
                                       return_softmax_lse=True, k_descale=kd, v_descale=vd)
    # The appended rows: torch's rounding of k / descale (the library's is torch's, bit for bit).
    changed_k = kc0.view(torch.uint8) != kc.view(torch.uint8)
    for i in range(q.shape[0]):
        blk, row = rows_of[i][int(seqlens[i])]
        want_k = (knew[i, 0].float() / kd[i][:, None]).to(kind)
        want_v = (vnew[i, 0].float() / vd[i][:, None]).to(kind)
        assert torch.equal(kc[blk, row].view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(vc[blk, row].view(torch.uint8), want_v.view(torch.uint8))
        changed_k[blk, row] = False
    assert not changed_k.any(), "the append wrote outside its rows"

    rows_after = [rows_of[i][:int(seqlens[i]) + 1] for i in range(q.shape[0])]
    kr, vr = dequant(kc, kd, rows_after), dequant(vc, vd, rows_after)
    ref, ref_lse = flash_attn_with_kvcache(q.float(), kr, vr, cache_seqlens=seqlens + 1,
                                           block_table=table, causal=True, num_splits=1,
                                           return_softmax_lse=True)
    # out's rounding and P's (rounded to q's dtype before P V), each at most half an ulp, of
    # |out| and of the largest |V| (3 * v_descale): twice both.
    ulp = 2.0 ** -7 if dt == torch.bfloat16 else 2.0 ** -10
    vmax = 3 * vd.amax()
    err = (out.float() - ref).abs()
    assert (err <= ulp * ref.abs() + ulp * vmax + 1e-6).all(), float(err.max())
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


def test_fp8_cache_without_descales_and_repeated(rng):
    """Descales absent mean 1; repeated calls (from their prepared arguments) give the first
    call's bits."""
    q, kc, vc, _, _, seqlens, _, _, _, _ = setup(rng, torch.bfloat16, torch.float8_e4m3fn,
                                                 descales=False)
    ref = flash_attn_with_kvcache(q.float(), kc.float(), vc.float(), cache_seqlens=seqlens)
    first = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    assert first.dtype == torch.bfloat16
    assert ((first.float() - ref).abs() <= 2.0 ** -7 * (ref.abs() + 3) + 1e-6).all()
    for _ in range(2):
        out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
        assert torch.equal(out, first)
    ones = torch.ones(q.shape[0], kc.shape[2])
    same = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k_descale=ones,
                                   v_descale=ones)
    assert torch.equal(same, out)


def test_fa3_kvcache_descales(rng):
    q, kc, vc, knew, vnew, seqlens, table, kd, vd, _ = setup(rng, torch.float16,
                                                            torch.float8_e4m3fn, page=16)
    kc2, vc2 = kc.clone(), vc.clone()
    a = fa3.flash_attn_with_kvcache(q, kc, vc, knew, vnew, cache_seqlens=seqlens,
                                    page_table=table, k_descale=kd, v_descale=vd, causal=True)
    b = flash_attn_with_kvcache(q, kc2, vc2, knew, vnew, cache_seqlens=seqlens, block_table=table,
                                k_descale=kd, v_descale=vd, causal=True)
    assert torch.equal(a, b) and torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8))
    with pytest.raises(NotImplementedError, match="q_descale"):
        fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table,
                                    q_descale=kd)


def test_fp8_cache_refusals(rng):
    q, kc, vc, _, _, seqlens, _, kd, vd, _ = setup(rng, torch.bfloat16, torch.float8_e4m3fn)
    with pytest.raises(FlashAttnError, match="^k_descale"):
        flash_attn_with_kvcache(q, kc.float().bfloat16(), vc.float().bfloat16(),
                                cache_seqlens=seqlens, k_descale=kd)
    with pytest.raises(FlashAttnError, match="^v_descale"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, v_descale=vd[:, :1])
    with pytest.raises(FlashAttnError, match="^v_cache"):
        flash_attn_with_kvcache(q, kc, vc.to(torch.float8_e5m2), cache_seqlens=seqlens)
    with pytest.raises(FlashAttnError, match="^q"):
        flash_attn_with_kvcache(q.to(torch.float8_e4m3fn), kc, vc, cache_seqlens=seqlens)
