"""flashattn.flex_attention / create_block_mask against torch's FlexAttention (run eagerly on
the CPU), against flash_attn_func where a mod equals a built-in feature, and their refusals."""

import math

import numpy as np
import pytest
import torch

import flashattn
from flashattn import FlashAttnError, _flex_cache, _flex_call  # noqa: F401

tflex = pytest.importorskip("torch.nn.attention.flex_attention")  # torch >= 2.5

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore:return_lse is deprecated:FutureWarning")]

FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def randn(rng, *shape, dtype=torch.float32):
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype)


def qkv(rng, b=2, hq=4, hkv=4, sq=96, sk=130, d=32, dv=24, dtype=torch.float32):
    return (randn(rng, b, hq, sq, d, dtype=dtype), randn(rng, b, hkv, sk, d, dtype=dtype),
            randn(rng, b, hkv, sk, dv, dtype=dtype))


def assert_block_masks_equal(ours, theirs):
    for f in FIELDS:
        a, b = getattr(ours, f), getattr(theirs, f)
        assert a.dtype == b.dtype == torch.int32, f
        assert torch.equal(a, b), f
    assert ours.BLOCK_SIZE == theirs.BLOCK_SIZE
    assert ours.shape == theirs.shape


def both(rng, mask_mod, score_mod, b, h, sq, sk, block=32, hkv=None, dtype=torch.float32):
    """(ours, torch's) (out, lse) for one call, the block masks checked equal on the way."""
    q, k, v = qkv(rng, b, h, hkv or h, sq, sk, dtype=dtype)
    ours_bm = theirs_bm = None
    if mask_mod is not None:
        ours_bm = flashattn.create_block_mask(mask_mod, b, h, sq, sk, BLOCK_SIZE=block)
        theirs_bm = tflex.create_block_mask(mask_mod, b, h, sq, sk, device="cpu",
                                            BLOCK_SIZE=block)
        assert_block_masks_equal(ours_bm, theirs_bm)
    gqa = hkv is not None
    out, lse = flashattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=ours_bm,
                                        enable_gqa=gqa, return_lse=True)
    ref, ref_lse = tflex.flex_attention(q, k, v, score_mod=score_mod, block_mask=theirs_bm,
                                        enable_gqa=gqa, return_lse=True)
    return out, lse, ref, ref_lse


def assert_matches(out, lse, ref, ref_lse, tol=2e-5):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert lse.dtype == ref_lse.dtype and lse.shape == ref_lse.shape
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)


# ---- mods (torch-style, as users write them) -----------------------------------------------


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def make_cases(rng, B, H, SQ, SK):
    """name -> (mask_mod, score_mod); the aux tensors are fresh random ones."""
    doc = torch.from_numpy(np.sort(rng.integers(0, 4, max(SQ, SK)))).long()
    prefix = torch.from_numpy(rng.integers(1, SK, B)).long()
    window = int(rng.integers(8, 40))
    cap = float(rng.uniform(5, 30))
    table = randn(rng, H, SQ + SK - 1)  # relative position bias per head
    rel = randn(rng, max(SQ, SK))  # read at q_idx - kv_idx: negative counts from the end
    keep = torch.from_numpy(rng.random((B, H, SQ, SK)) < 0.7)  # an arbitrary boolean mask

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix[b]) | (q_idx >= kv_idx)

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    def dilated(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx) % 3 == 0) & ~(kv_idx > q_idx)

    def head_window(b, h, q_idx, kv_idx):  # a window per head and a bool tensor
        return torch.where(h % 2 == 0, (q_idx - kv_idx).abs() < 16 * (h + 1),
                           keep[b, h, q_idx, kv_idx])

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    def alibi(score, b, h, q_idx, kv_idx):
        slope = torch.exp2(-((h + 1) * 8.0 / H))
        return score - slope * torch.abs(q_idx - kv_idx)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + SK - 1]

    def rel_wrap(score, b, h, q_idx, kv_idx):
        return score + rel[q_idx - kv_idx] * 0.5

    cap_t = torch.tensor(cap)  # a 0-d captured tensor: read at run time

    def softcap_bias(score, b, h, q_idx, kv_idx):
        s = score.masked_fill(q_idx == kv_idx, 0.0) + table[h, q_idx - kv_idx + SK - 1]
        return torch.clamp(cap_t * (s / cap_t).tanh(), min=-2.5)

    def many_ops(score, b, h, q_idx, kv_idx):  # the traced operations, against torch's
        d = (q_idx - kv_idx).float() / 7.0
        t = torch.div(q_idx - kv_idx, 5, rounding_mode="trunc") + (kv_idx // 3) % 4
        u = torch.fmod(d, 1.5) + torch.remainder(-d, 2.5) + d.int() + torch.ceil(d) * 0.25
        v = torch.sqrt(torch.abs(d) + 1) + torch.log(d.abs() + 2)
        w = torch.sigmoid(score) + torch.minimum(score, d) - torch.maximum(score, -d) + 0.5 ** h
        x = torch.where((q_idx > kv_idx) ^ (h == 1), u, -v) + t * 0.1 + w
        return x.clamp(-20, 20) + (kv_idx % 2 == 0) + torch.exp(-d.abs()) + (~(b == 0)).float()

    def many_masks(b, h, q_idx, kv_idx):
        near = torch.logical_and(kv_idx <= q_idx + h, torch.logical_not(kv_idx < q_idx - 20))
        return near | ((kv_idx % 7 == 0) & (b == 1)) | torch.eq(kv_idx, 0)

    return {
        "ops": (many_masks, many_ops),
        "causal": (causal, None), "document": (document, None), "prefix_lm": (prefix_lm, None),
        "sliding": (sliding, None), "dilated": (dilated, None),
        "head_window": (head_window, None), "softcap": (None, softcap), "alibi": (None, alibi),
        "rel_bias": (None, rel_bias), "rel_wrap": (None, rel_wrap),
        "document+softcap+bias": (document, softcap_bias), "sliding+alibi": (sliding, alibi),
        "prefix_lm+rel_wrap": (prefix_lm, rel_wrap),
    }


CASES = list(make_cases(np.random.default_rng(0), 2, 4, 96, 130))


@pytest.mark.parametrize("case", CASES)
def test_matches_torch_flex_attention(rng, case):
    B, H, SQ, SK = 2, 4, 96, 130
    mask_mod, score_mod = make_cases(rng, B, H, SQ, SK)[case]
    assert_matches(*both(rng, mask_mod, score_mod, B, H, SQ, SK))


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3),
                                       (torch.float64, 1e-10)])
def test_dtypes(rng, dtype, tol):
    mask_mod, score_mod = make_cases(rng, 1, 2, 64, 80)["document+softcap+bias"]
    q, k, v = qkv(rng, 1, 2, 2, 64, 80, dtype=dtype)
    bm = flashattn.create_block_mask(mask_mod, 1, 2, 64, 80)
    out, lse = flashattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                        return_lse=True)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64
                                                else torch.float32)
    # the exact answer: torch's flex_attention on the same (rounded) values in fp64
    tbm = tflex.create_block_mask(mask_mod, 1, 2, 64, 80, device="cpu")
    ref, ref_lse = tflex.flex_attention(q.double(), k.double(), v.double(), score_mod=score_mod,
                                        block_mask=tbm, return_lse=True)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)


def test_gqa(rng):
    B, H, SQ, SK = 2, 6, 40, 70
    mask_mod, score_mod = make_cases(rng, B, H, SQ, SK)["sliding+alibi"]
    assert_matches(*both(rng, mask_mod, score_mod, B, H, SQ, SK, block=16, hkv=2))
    q, k, v = qkv(rng, B, H, 2, SQ, SK)
    with pytest.raises(ValueError, match="enable_gqa"):
        flashattn.flex_attention(q, k, v)
    with pytest.raises(ValueError, match="multiple"):
        flashattn.flex_attention(q, k[:, :1].expand(-1, 4, -1, -1), v[:, :1].expand(
            -1, 4, -1, -1), enable_gqa=True)


def test_scale_and_empty_rows(rng):
    """A row that sees no key: out 0 and lse -inf, as torch; scale is applied before the mod."""
    SQ, SK = 50, 60
    cut = int(rng.integers(10, 40))

    def late(b, h, q_idx, kv_idx):
        return (q_idx < cut) & (kv_idx <= q_idx)

    def double(score, b, h, q_idx, kv_idx):
        return score * 2

    scale = float(rng.uniform(0.05, 0.3))
    q, k, v = qkv(rng, 1, 2, 2, SQ, SK)
    bm = flashattn.create_block_mask(late, None, None, SQ, SK, BLOCK_SIZE=(16, 32))
    tbm = tflex.create_block_mask(late, None, None, SQ, SK, device="cpu", BLOCK_SIZE=(16, 32))
    assert_block_masks_equal(bm, tbm)
    out, lse = flashattn.flex_attention(q, k, v, double, bm, scale=scale, return_lse=True)
    ref, ref_lse = tflex.flex_attention(q, k, v, double, tbm, scale=scale, return_lse=True)
    assert_matches(out, lse, ref, ref_lse)
    assert torch.all(lse[:, :, cut:] == -math.inf) and torch.all(out[:, :, cut:] == 0)
    # without return_lse, only out
    again = flashattn.flex_attention(q, k, v, double, bm, scale=scale)
    assert torch.equal(again, out)


def test_matches_builtins(rng):
    """Mods that equal flash_attn_func's features give its answer (bottom-right causal
    alignment spelled out in the mask)."""
    B, H, SQ, SK = 2, 4, 80, 112
    q, k, v = qkv(rng, B, H, H, SQ, SK)
    qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))
    off = SK - SQ
    left, right = int(rng.integers(4, 30)), int(rng.integers(0, 12))
    cap = float(rng.uniform(5, 20))
    slopes = torch.from_numpy(rng.uniform(0.01, 0.5, H)).float()

    def bottom_right(b, h, q_idx, kv_idx):
        return q_idx + off >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (kv_idx >= q_idx + off - left) & (kv_idx <= q_idx + off + right)

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx + off - kv_idx).abs()

    calls = [
        (bottom_right, None, dict(causal=True)),
        (window, None, dict(window_size=(left, right))),
        (None, softcap, dict(softcap=cap)),
        (None, alibi, dict(alibi_slopes=slopes)),
        (bottom_right, softcap, dict(causal=True, softcap=cap)),
    ]
    for mask_mod, score_mod, kw in calls:
        bm = mask_mod and flashattn.create_block_mask(mask_mod, B, H, SQ, SK, BLOCK_SIZE=64)
        out, lse = flashattn.flex_attention(q, k, v, score_mod, bm, return_lse=True)
        ref, ref_lse, _ = flashattn.flash_attn_func(qs, ks, vs, return_attn_probs=True, **kw)
        torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_numpy_inputs(rng):
    mask_mod, score_mod = make_cases(rng, 1, 2, 40, 50)["document+softcap+bias"]
    q, k, v = qkv(rng, 1, 2, 2, 40, 50)
    bm = flashattn.create_block_mask(mask_mod, 1, 2, 40, 50, BLOCK_SIZE=16)
    out, lse = flashattn.flex_attention(q, k, v, score_mod, bm, return_lse=True)
    for dt in (np.float32, np.float64):
        got, got_lse = flashattn.flex_attention(q.numpy().astype(dt), k.numpy().astype(dt),
                                                v.numpy().astype(dt), score_mod, bm,
                                                return_lse=True)
        assert isinstance(got, np.ndarray) and got.dtype == dt and got_lse.dtype == dt
        np.testing.assert_allclose(got, out.numpy(), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(got_lse, lse.numpy(), atol=1e-5, rtol=1e-5)


def test_create_block_mask_fields(rng):
    """Fields equal torch's over shapes, block sizes and masks that depend on b and h."""
    doc = torch.from_numpy(np.sort(rng.integers(0, 5, (3, 300)), axis=1))

    def per_batch_docs(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx + h)

    for mask_mod, B, H, SQ, SK, bs in [
            (causal, None, None, 300, 300, 128), (causal, 1, 1, 1, 257, 128),
            (per_batch_docs, 3, 2, 260, 300, 64), (per_batch_docs, 3, None, 33, 65, (16, 32)),
            (flashattn.flex.noop_mask, 2, 1, 70, 90, 32)]:
        ours = flashattn.create_block_mask(mask_mod, B, H, SQ, SK, BLOCK_SIZE=bs)
        theirs = tflex.create_block_mask(mask_mod, B, H, SQ, SK, device="cpu", BLOCK_SIZE=bs)
        assert_block_masks_equal(ours, theirs)
        assert ours.seq_lengths == (SQ, SK) and ours.mask_mod is mask_mod
        assert abs(ours.sparsity() - theirs.sparsity()) < 1e-9
    ours = flashattn.create_block_mask(causal, 1, 1, 200, 200, BLOCK_SIZE=32,
                                       separate_full_blocks=False)
    theirs = tflex.create_block_mask(causal, 1, 1, 200, 200, device="cpu", BLOCK_SIZE=32,
                                     separate_full_blocks=False)
    assert ours.full_kv_num_blocks is None and theirs.full_kv_num_blocks is None
    assert torch.equal(ours.kv_num_blocks, theirs.kv_num_blocks)
    assert torch.equal(ours.kv_indices, theirs.kv_indices)
    with pytest.raises(FlashAttnError, match="device"):
        flashattn.create_block_mask(causal, 1, 1, 64, 64, device="xla")


def test_block_structure_of_a_foreign_block_mask(rng):
    """A block mask whose blocks are not its mask_mod's (built from kv blocks, one batch entry
    for a call of two): full blocks are visible, partial ones masked by mask_mod, the rest
    skipped, as FlexAttention's kernels do. (torch's eager CPU path applies only mask_mod, so
    the reference is a dense mask.)"""
    B, H, L, bs = 2, 2, 64, 16
    n = L // bs
    q, k, v = qkv(rng, B, H, H, L, L)
    dense = torch.from_numpy(rng.integers(0, 3, (1, H, n, n))).int()  # 0 skip, 1 partial, 2 full

    def ordered(x):
        x = x.int()
        return x.sum(-1).int(), torch.argsort(x, dim=-1, descending=True, stable=True).int()

    def stripes(b, h, q_idx, kv_idx):
        return (q_idx + kv_idx + h + b) % 3 != 0

    bm = tflex.BlockMask.from_kv_blocks(*ordered(dense == 1), *ordered(dense == 2),
                                        BLOCK_SIZE=bs, mask_mod=stripes, seq_lengths=(L, L))
    out = flashattn.flex_attention(q, k, v, block_mask=bm)
    qi, ki = torch.arange(L)[:, None], torch.arange(L)[None, :]
    hh, bb = torch.arange(H)[:, None, None], torch.arange(B)[:, None, None, None]
    s = dense[:, :, qi // bs, ki // bs]
    allowed = (s == 2) | ((s == 1) & stripes(bb, hh, qi, ki))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    ref = torch.where(allowed.any(-1)[..., None], ref, 0.0)  # rows with no key: 0
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # create_block_mask's own for batch entry 0, used for two: its blocks apply to both
    def reach(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | ((b == 1) & (kv_idx < q_idx + 20))

    ours = flashattn.create_block_mask(reach, 1, H, L, L, BLOCK_SIZE=bs)
    theirs = tflex.create_block_mask(reach, 1, H, L, L, device="cpu", BLOCK_SIZE=bs)
    assert_block_masks_equal(ours, theirs)
    out = flashattn.flex_attention(q, k, v, block_mask=ours)
    count = reach(0, 0, qi, ki).reshape(n, bs, n, bs).sum((1, 3))
    s = torch.where(count == bs * bs, 2, (count > 0).int())[qi // bs, ki // bs]
    allowed = (s == 2) | ((s == 1) & reach(bb, hh, qi, ki))
    assert not torch.equal(allowed[0], allowed[1])  # entry 1 lost keys beyond entry 0's blocks
    assert not torch.equal(allowed[1], reach(1, hh, qi, ki))
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed), atol=2e-5, rtol=2e-5)


def dense_reference(q, k, v, bias, allowed):
    """softmax(q k^T / sqrt(d) + bias, over allowed keys) v, in fp64."""
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    return (torch.softmax(s.masked_fill(~allowed, -math.inf), -1) @ v.double()).float()


def test_traced_once_per_capture(rng, monkeypatch):
    """A repeated call does not trace again (a new function of the same code and captures
    neither); a changed captured number does; captured tensors are read at every call."""
    traced = []
    trace = _flex_cache._trace
    monkeypatch.setattr(_flex_cache, "_trace", lambda fn, *a: traced.append(fn) or trace(fn, *a))
    bias = randn(rng, 4)
    S = 40
    rows, cols = torch.arange(S)[:, None], torch.arange(S)[None, :]

    def biased(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx > 8, -math.inf, score + bias[h])

    q, k, v = qkv(rng, 1, 4, 4, S, S)
    first = flashattn.flex_attention(q, k, v, biased)
    assert torch.equal(flashattn.flex_attention(q, k, v, biased), first)
    assert traced == [biased]
    torch.testing.assert_close(first, dense_reference(q, k, v, bias[:, None, None],
                                                      rows - cols <= 8), atol=1e-5, rtol=1e-5)
    bias.add_(torch.from_numpy(rng.uniform(0.5, 1, 4)).float())  # in place: read again, no trace
    shifted = flashattn.flex_attention(q, k, v, biased)
    assert traced == [biased]
    torch.testing.assert_close(shifted, dense_reference(q, k, v, bias[:, None, None],
                                                        rows - cols <= 8), atol=1e-5, rtol=1e-5)

    def windowed(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= WINDOW

    global WINDOW
    for w in (4, 12):  # a captured global changed: traced again
        WINDOW = w
        bm = flashattn.create_block_mask(windowed, 1, 1, S, S, BLOCK_SIZE=8)
        out = flashattn.flex_attention(q, k, v, block_mask=bm)
        torch.testing.assert_close(out, dense_reference(q, k, v, 0.0, (rows - cols).abs() <= w),
                                   atol=1e-5, rtol=1e-5)
    assert traced[1:] == [windowed, windowed]

    def make(w):
        return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= w

    for w in (3, 3, 5):  # a new lambda each time: traced per value of w
        out = flashattn.flex_attention(q, k, v, block_mask=flashattn.create_block_mask(
            make(w), 1, 1, S, S, BLOCK_SIZE=8))
        torch.testing.assert_close(out, dense_reference(q, k, v, 0.0, (rows - cols).abs() <= w),
                                   atol=1e-5, rtol=1e-5)
    assert len(traced) == 5


def test_int64_captures_read_at_every_call(rng):
    """An int64 captured tensor is converted once per version: a second call with it unchanged
    gives the same answer, an in-place change is read, and values past int32 are refused."""
    S = 48
    docs = torch.arange(S) * 3 // S  # int64, three documents
    rows, cols = torch.arange(S)[:, None], torch.arange(S)[None, :]

    def same_doc(score, b, h, q_idx, kv_idx):
        return torch.where(docs[q_idx] == docs[kv_idx], score, -math.inf)

    q, k, v = qkv(rng, 1, 2, 2, S, S)
    first = flashattn.flex_attention(q, k, v, same_doc)
    assert torch.equal(flashattn.flex_attention(q, k, v, same_doc), first)
    torch.testing.assert_close(first, dense_reference(q, k, v, 0.0, docs[rows] == docs[cols]),
                               atol=1e-5, rtol=1e-5)
    docs[S // 2:] = 7  # in place: two documents now
    second = flashattn.flex_attention(q, k, v, same_doc)
    torch.testing.assert_close(second, dense_reference(q, k, v, 0.0, docs[rows] == docs[cols]),
                               atol=1e-5, rtol=1e-5)
    assert not torch.equal(second, first)
    docs[0] = 2**40
    with pytest.raises(FlashAttnError, match="do not fit int32"):
        flashattn.flex_attention(q, k, v, same_doc)


def test_captures_read_off_the_result_are_not_passed(rng):
    """A captured tensor whose value the mod's result does not use (read into a name that is
    then dropped) is not handed to the library, which refuses a tensor no program reads: the
    call equals the same mods without the read, with and without gradients, and a tensor read
    only so gets none."""
    S = 40
    docs = torch.arange(S) // 9
    table = torch.randn(S, generator=torch.Generator().manual_seed(3)).requires_grad_()

    def causal(b, h, q_idx, kv_idx):
        unused = docs[q_idx] == docs[kv_idx]  # noqa: F841
        return q_idx >= kv_idx

    def scaled(score, b, h, q_idx, kv_idx):
        unused = table[kv_idx] * 2  # noqa: F841
        return score * 1.5

    q, k, v = (x.requires_grad_() for x in qkv(rng, 1, 2, 2, S, S))
    bm = flashattn.create_block_mask(causal, 1, 1, S, S, BLOCK_SIZE=16)
    plain = flashattn.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 1, 1, S, S,
                                        BLOCK_SIZE=16)
    assert_block_masks_equal(bm, plain)
    got = flashattn.flex_attention(q, k, v, scaled, bm)
    got.sum().backward()
    want = flashattn.flex_attention(q, k, v, lambda s, b, h, q_idx, kv_idx: s * 1.5, plain)
    assert torch.equal(got, want)
    assert q.grad is not None and table.grad is None


def test_prepared_calls(rng, monkeypatch):
    """A repeated call without gradients reuses its prepared arguments (no new preparation)
    and reads the new tensors; new strides, lse asked for, an in-place change of a captured
    tensor or of the block mask's tensors each prepare again; every result matches the
    reference."""
    prepared = []
    args = flashattn._flex_call._FlexCall._args
    monkeypatch.setattr(flashattn._flex_call._FlexCall, "_args",
                        lambda self, *a: prepared.append(1) or args(self, *a))
    S = 48
    rows, cols = torch.arange(S)[:, None], torch.arange(S)[None, :]
    bias = randn(rng, 2)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    bm = flashattn.create_block_mask(causal, 1, 1, S, S, BLOCK_SIZE=16)
    for step in range(3):
        q, k, v = qkv(rng, 1, 2, 2, S, S)
        out = flashattn.flex_attention(q, k, v, biased, block_mask=bm)
        torch.testing.assert_close(out, dense_reference(q, k, v, bias[:, None, None],
                                                        cols <= rows), atol=1e-5, rtol=1e-5)
    assert len(prepared) == 1
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, other strides
    out = flashattn.flex_attention(qt, k, v, biased, block_mask=bm)
    assert len(prepared) == 2 and torch.equal(out, flashattn.flex_attention(q, k, v, biased,
                                                                             block_mask=bm))
    out, lse = flashattn.flex_attention(q, k, v, biased, block_mask=bm, return_lse=True)
    assert len(prepared) == 3 and lse.shape == (1, 2, S) and torch.isfinite(lse).all()
    bias.mul_(-2.0)
    out = flashattn.flex_attention(q, k, v, biased, block_mask=bm)
    assert len(prepared) == 4
    torch.testing.assert_close(out, dense_reference(q, k, v, bias[:, None, None], cols <= rows),
                               atol=1e-5, rtol=1e-5)
    full = flashattn.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 0, 1, 1, S, S,
                                       BLOCK_SIZE=16)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        getattr(bm, name).copy_(getattr(full, name))  # in place: every block full now
    out = flashattn.flex_attention(q, k, v, biased, block_mask=bm)
    assert len(prepared) == 5
    torch.testing.assert_close(out, dense_reference(q, k, v, bias[:, None, None],
                                                    torch.ones(S, S, dtype=torch.bool)),
                               atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # inputs that require grad, with grad mode off: prepared too
        qg = q.clone().requires_grad_()
        flashattn.flex_attention(qg, k, v, biased, block_mask=bm)
        flashattn.flex_attention(qg, k, v, biased, block_mask=bm)
    assert len(prepared) == 5
    bias.requires_grad_()  # a capture that records gradients: the autograd route, not a hit
    with torch.no_grad():
        flashattn.flex_attention(q, k, v, biased, block_mask=bm)
    out = flashattn.flex_attention(q, k, v, biased, block_mask=bm)
    assert out.requires_grad
    out.sum().backward()
    assert bias.grad is not None and bias.grad.shape == bias.shape


WINDOW = 0


def test_refusals(rng):
    q, k, v = qkv(rng, 1, 2, 2, 16, 16)

    def branchy(score, b, h, q_idx, kv_idx):
        if q_idx > kv_idx:  # data-dependent Python control flow
            return score
        return score * 2

    with pytest.raises(FlashAttnError, match=r"control flow.*test_flex.py:\d+: if q_idx > kv_idx"):
        flashattn.flex_attention(q, k, v, branchy)

    def sine(score, b, h, q_idx, kv_idx):
        return torch.sin(score)

    with pytest.raises(FlashAttnError, match=r"torch\.sin is not supported.*torch\.sin\(score\)"):
        flashattn.flex_attention(q, k, v, sine)

    table = randn(rng, 4, 16)

    def partial_index(score, b, h, q_idx, kv_idx):
        return score + table[h].sum()

    with pytest.raises(FlashAttnError, match=r"shape \(4, 16\) indexed with 1 indices"):
        flashattn.flex_attention(q, k, v, partial_index)

    def not_bool(b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    with pytest.raises(FlashAttnError, match="must return a boolean"):
        flashattn.create_block_mask(not_bool, 1, 1, 16, 16)

    many = [randn(rng, 16) for _ in range(5)]

    def five(score, b, h, q_idx, kv_idx):
        return score + many[0][q_idx] + many[1][q_idx] + many[2][q_idx] + many[3][q_idx] + \
            many[4][kv_idx]

    with pytest.raises(FlashAttnError, match="5 captured tensors; at most 4"):
        flashattn.flex_attention(q, k, v, five)

    def ints_and(b, h, q_idx, kv_idx):
        return (q_idx & kv_idx) == 0

    with pytest.raises(FlashAttnError, match="bitwise &"):
        flashattn.create_block_mask(ints_and, 1, 1, 16, 16)


def test_requires_grad(rng):
    q, k, v = qkv(rng, 1, 2, 2, 24, 24)

    def scaled(score, b, h, q_idx, kv_idx):
        return score * 0.5

    # gradients through a score_mod: halving the score is halving the scale
    q.requires_grad_()
    out = flashattn.flex_attention(q, k, v, scaled)
    dout = randn(rng, *out.shape)
    (dq,) = torch.autograd.grad(out, (q,), dout)
    q3 = q.detach().clone().requires_grad_()
    ref = torch.nn.functional.scaled_dot_product_attention(q3, k, v, scale=0.5 / math.sqrt(32))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(dq, torch.autograd.grad(ref, (q3,), dout)[0], atol=1e-4,
                               rtol=1e-4)
    learned = randn(rng, 2).requires_grad_()

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + learned[h]

    # a captured tensor that requires grad gets its gradient (the CPU backward)
    out = flashattn.flex_attention(q.detach(), k, v, head_bias)
    (dlearned,) = torch.autograd.grad(out, (learned,), dout)
    lr = learned.detach().clone().requires_grad_()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.detach(), k, v, attn_mask=lr[None, :, None, None].expand(1, 2, 24, 24))
    torch.testing.assert_close(dlearned, torch.autograd.grad(ref, (lr,), dout)[0], atol=1e-4,
                               rtol=1e-4)
    # without mods: flash_attn_func's autograd
    out = flashattn.flex_attention(q, k, v)
    dout = randn(rng, *out.shape)
    out.backward(dout)
    q2 = q.detach().clone().requires_grad_()
    torch.nn.functional.scaled_dot_product_attention(q2, k, v).backward(dout)
    torch.testing.assert_close(q.grad, q2.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5),
                                       (torch.bfloat16, 3e-2)], ids=["fp64", "fp32", "bf16"])
def test_gradients_through_a_block_mask(rng, dtype, tol):
    """A block mask's call has a backward: dq, dk, dv (and out) against SDPA's autograd with
    the same mask spelled out, in fp64; a foreign block mask's full and skipped blocks included
    (its block rule, not its mask_mod, decides there). GQA, lse asked for too."""
    B, H, HKV, L, bs = 2, 4, 2, 80, 16
    docs = torch.from_numpy(np.sort(rng.integers(0, 4, L))).int()

    def mask(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (kv_idx <= q_idx)

    n = L // bs
    dense = torch.from_numpy(rng.integers(0, 3, (B, 1, n, n))).int()  # 0 skip, 1 partial, 2 full

    def ordered(x):
        x = x.int()
        return x.sum(-1).int(), torch.argsort(x, dim=-1, descending=True, stable=True).int()

    qi, ki = torch.arange(L)[:, None], torch.arange(L)[None, :]
    own = flashattn.create_block_mask(mask, None, None, L, L, BLOCK_SIZE=bs)
    foreign = tflex.BlockMask.from_kv_blocks(*ordered(dense == 1), *ordered(dense == 2),
                                             BLOCK_SIZE=bs, mask_mod=mask, seq_lengths=(L, L))
    s = dense[:, :, qi // bs, ki // bs]
    for bm, allowed in ((own, mask(0, 0, qi, ki)[None, None].expand(B, H, L, L)),
                        (foreign, ((s == 2) | ((s == 1) & mask(0, 0, qi, ki))).expand(B, H, L, L))):
        q = randn(rng, B, H, L, 32, dtype=dtype).requires_grad_()
        k = randn(rng, B, HKV, L, 32, dtype=dtype).requires_grad_()
        v = randn(rng, B, HKV, L, 24, dtype=dtype).requires_grad_()
        out, lse = flashattn.flex_attention(q, k, v, block_mask=bm, enable_gqa=True,
                                            return_lse=True)
        dout = randn(rng, *out.shape, dtype=dtype)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        q2, k2, v2 = (x.detach().double().requires_grad_() for x in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(
            q2, k2.repeat_interleave(H // HKV, 1), v2.repeat_interleave(H // HKV, 1),
            attn_mask=allowed)
        ref = torch.where(allowed.any(-1)[..., None], ref, 0.0)  # rows with no key: 0
        want = torch.autograd.grad(ref, (q2, k2, v2), dout.double())
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
        for name, got, w in zip("qkv", grads, want):
            torch.testing.assert_close(got.double(), w, atol=tol, rtol=tol, msg="d" + name)
        assert not lse.requires_grad


def test_gradients_through_a_score_mod(rng):
    """score_mod's backward (torch's FlexAttention has none on the CPU): a softcap and a
    relative-position bias read from a captured tensor, with a causal block mask, against
    autograd through the same scores written as tensor operations, in fp64."""
    B, H, L, D = 2, 2, 50, 16
    rel = randn(rng, H, 2 * L)  # captured: no gradient

    def softcap_rel(score, b, h, q_idx, kv_idx):
        return 3 * torch.tanh(score / 3) + rel[h, kv_idx - q_idx + L]

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    bm = flashattn.create_block_mask(causal, None, None, L, L, BLOCK_SIZE=16)
    q, k, v = (randn(rng, B, H, L, D, dtype=torch.float64).requires_grad_() for _ in range(3))
    out = flashattn.flex_attention(q, k, v, score_mod=softcap_rel, block_mask=bm)
    dout = randn(rng, *out.shape, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qi, ki = torch.arange(L)[:, None], torch.arange(L)[None, :]
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    s = q2 @ k2.transpose(-1, -2) / math.sqrt(D)
    s = 3 * torch.tanh(s / 3) + rel[:, (ki - qi + L)].double()[None]
    ref = torch.softmax(s.masked_fill(ki > qi, -math.inf), -1) @ v2
    want = torch.autograd.grad(ref, (q2, k2, v2), dout)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for name, got, w in zip("qkv", grads, want):
        torch.testing.assert_close(got, w, atol=1e-10, rtol=1e-10, msg="d" + name)


def test_gradients_of_a_broadcast_dout(rng):
    """out.sum()'s dout is one element broadcast (stride 0), which the backward copies: the copy
    stays alive through the library's call (ASan saw it freed before)."""
    B, H, L, D = 1, 2, 24, 8
    q, k, v = (randn(rng, B, H, L, D, dtype=torch.float64).requires_grad_() for _ in range(3))

    def halve(score, b, h, q_idx, kv_idx):
        return score * 0.5

    flashattn.flex_attention(q, k, v, halve).sum().backward()
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    s = q2 @ k2.transpose(-1, -2) / math.sqrt(D) * 0.5
    (torch.softmax(s, -1) @ v2).sum().backward()
    for name, got, want in zip("qkv", (q, k, v), (q2, k2, v2)):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-10, rtol=1e-10, msg="d" + name)


def test_backward_arguments_kept_or_rebuilt(rng):
    """A kept graph's second backward gives the first's gradients (from the backward
    arguments the first kept), and so do both backwards of a call whose query was copied (its
    last dim strided), whose arguments are never kept."""
    B, H, L, D = 1, 2, 40, 8

    def halve(score, b, h, q_idx, kv_idx):
        return score * 0.5

    for strided in (False, True):
        base = randn(rng, B, H, L, 2 * D, dtype=torch.float64)
        q = (base[..., ::2] if strided else base[..., :D]).detach().requires_grad_()
        k, v = (randn(rng, B, H, L, D, dtype=torch.float64).requires_grad_() for _ in range(2))
        out = flashattn.flex_attention(q, k, v, halve)
        dout = randn(rng, *out.shape, dtype=torch.float64)
        first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        second = torch.autograd.grad(out, (q, k, v), dout)
        q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
        ref = torch.softmax(q2 @ k2.transpose(-1, -2) / math.sqrt(D) * 0.5, -1) @ v2
        want = torch.autograd.grad(ref, (q2, k2, v2), dout)
        for name, a, b, w in zip("qkv", first, second, want):
            torch.testing.assert_close(a, w, atol=1e-10, rtol=1e-10, msg="d" + name)
            torch.testing.assert_close(b, w, atol=1e-10, rtol=1e-10, msg="d" + name)


def test_repeated_calls_with_gradients(rng):
    """Calls with gradients of one signature share their preparation, each with its own
    arguments: two forwards, then their backwards in the other order, each gradient its own
    inputs'; a captured tensor changed in place between calls is read anew; douts of three
    layouts, twice each."""
    B, H, L, D = 1, 2, 40, 8
    bias = randn(rng, H, 2 * L)  # captured: read as float32

    def rel(score, b, h, q_idx, kv_idx):
        return score + bias[h, kv_idx - q_idx + L]

    def reference(q, k, v, dout):
        q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
        qi, ki = torch.arange(L)[:, None], torch.arange(L)[None, :]
        s = q2 @ k2.transpose(-1, -2) / math.sqrt(D) + bias[:, ki - qi + L].double()[None]
        return torch.autograd.grad(torch.softmax(s, -1) @ v2, (q2, k2, v2), dout)

    def inputs():
        return [randn(rng, B, H, L, D, dtype=torch.float64).requires_grad_() for _ in range(3)]

    calls = []
    for _ in range(2):
        x = inputs()
        out = flashattn.flex_attention(*x, rel)
        calls.append((x, out, randn(rng, *out.shape, dtype=torch.float64)))
    for x, out, dout in reversed(calls):
        got, want = torch.autograd.grad(out, x, dout), reference(*x, dout)
        for name, a, w in zip("qkv", got, want):
            torch.testing.assert_close(a, w, atol=1e-10, rtol=1e-10, msg="d" + name)
    bias.mul_(-2)
    # dout of other layouts after the first: a slice (its own backward arguments) and one
    # strided in its last dim (copied, never kept)
    douts = (lambda o: randn(rng, *o.shape, dtype=torch.float64),
             lambda o: randn(rng, B, H, L + 3, D, dtype=torch.float64)[:, :, 1:L + 1],
             lambda o: randn(rng, B, H, D, L, dtype=torch.float64).transpose(-1, -2))
    for make in douts + douts[:2]:
        x = inputs()
        out = flashattn.flex_attention(*x, rel)
        dout = make(out)
        for name, a, w in zip("qkv", torch.autograd.grad(out, x, dout), reference(*x, dout)):
            torch.testing.assert_close(a, w, atol=1e-10, rtol=1e-10, msg="d" + name)


def test_negative_view_is_not_a_prepared_call(rng):
    """A repeated call's prepared arguments are keyed by q, k and v's negative bit too: a
    negative view (torch._neg_view) reads as its values, not as the tensor it views."""
    q, k, v = qkv(rng, 1, 2, 2, 16, 16)

    def halve(score, b, h, q_idx, kv_idx):
        return score * 0.5

    with torch.no_grad():
        flashattn.flex_attention(q, k, v, halve)
        got = flashattn.flex_attention(torch._neg_view(q), k, v, halve)
        torch.testing.assert_close(got, flashattn.flex_attention(-q, k, v, halve), atol=1e-6,
                                   rtol=1e-6)


def test_bad_arguments(rng):
    q, k, v = qkv(rng, 1, 2, 2, 20, 24)
    with pytest.raises(FlashAttnError, match=r"key: expected 4 dimensions \[b, h, s, d\]"):
        flashattn.flex_attention(q, k[0], v)
    with pytest.raises(FlashAttnError, match="key: .*head_dim"):
        flashattn.flex_attention(q, k[..., :16], v)
    with pytest.raises(FlashAttnError, match="key: dtype"):
        flashattn.flex_attention(q, k.double(), v)
    with pytest.raises(TypeError, match="value: expected a torch.Tensor or a numpy.ndarray"):
        flashattn.flex_attention(q, k, [1.0])
    with pytest.raises(ValueError, match=r"block_mask: it was made for query / key lengths "
                                         r"\(20, 20\), but the call has \(20, 24\)"):
        flashattn.flex_attention(q, k, v, block_mask=flashattn.create_block_mask(
            causal, 1, 2, 20, 20))
    with pytest.raises(ValueError, match=r"block_mask: its batch and heads \(1, 3\)"):
        flashattn.flex_attention(q, k, v, block_mask=flashattn.create_block_mask(
            causal, 1, 3, 20, 24))
    with pytest.raises(TypeError, match="score_mod: expected a function"):
        flashattn.flex_attention(q, k, v, score_mod=2.0)
    with pytest.raises(FlashAttnError, match="score_mod cannot be traced: calling it .* "
                                             "TypeError.*defined at .*test_flex.py"):
        flashattn.flex_attention(q, k, v, score_mod=lambda score, b, h: score)
    with pytest.raises(FlashAttnError, match="kernel_options"):
        flashattn.flex_attention(q, k, v, kernel_options={"BLOCK_M": 64})
    with pytest.raises(FlashAttnError, match="BLOCK_SIZE: must be positive"):
        flashattn.create_block_mask(causal, 1, 1, 8, 8, BLOCK_SIZE=(0, 16))
    with pytest.raises(FlashAttnError, match="Q_LEN: must be non-negative"):
        flashattn.create_block_mask(causal, 1, 1, -1, 8)


def test_refusal_names_the_users_line_under_a_dotted_path():
    """The line an untraceable mod is refused at is the user's also where the package was
    imported through a path with ".." in it (the frames then name the package that way)."""
    from helpers import run_python

    code = """if True:
        import os, sys
        pkg = os.environ["PYTHONPATH"]
        sys.path.insert(0, os.path.join(pkg, "..", os.path.basename(pkg)))
        import numpy as np
        import flashattn
        assert ".." in flashattn.__file__
        def branchy(score, b, h, q_idx, kv_idx):
            if q_idx > kv_idx:
                return score
            return -score
        q = np.ones((1, 1, 4, 8), dtype=np.float32)
        try:
            flashattn.flex_attention(q, q, q, score_mod=branchy)
        except flashattn.FlashAttnError as e:
            print(str(e).rsplit("(at ", 1)[1])
    """
    r = run_python(code)  # the mod's line is line 9 of the -c program
    assert r.returncode == 0 and r.stdout.startswith("<string>:9:"), r.stdout + r.stderr


def test_numpy_without_torch(rng):
    """NumPy arrays and operator-only mods need no torch: the block mask's fields are NumPy."""
    from helpers import run_python

    code = """if True:
        import sys
        import numpy as np
        import flashattn
        seed, scale = int(sys.argv[1]), float(sys.argv[2])
        rng = np.random.default_rng(seed)
        q, k, v = (rng.standard_normal((1, 2, 30, 8)).astype(np.float32) for _ in range(3))
        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
        def distance(score, b, h, q_idx, kv_idx):
            return score - abs(q_idx - kv_idx) * scale
        bm = flashattn.create_block_mask(causal, 1, 2, 30, 30, BLOCK_SIZE=16)
        out = flashattn.flex_attention(q, k, v, score_mod=distance, block_mask=bm)
        i = np.arange(30)
        s = q[0] @ k[0].transpose(0, 2, 1) / np.sqrt(8) - abs(i[:, None] - i) * scale
        s = np.where(i[:, None] >= i, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        ref = (p / p.sum(-1, keepdims=True)) @ v[0]
        assert "torch" not in sys.modules
        assert isinstance(bm.kv_indices, np.ndarray)
        # block (1, 0) has rows past 30, which count as masked: partial, as torch's
        assert bm.kv_num_blocks.tolist() == [[[1, 2], [1, 2]]]
        assert bm.full_kv_num_blocks.tolist() == [[[0, 0], [0, 0]]]
        assert bm.kv_indices.tolist() == [[[[0, 1], [0, 1]]] * 2]
        assert np.abs(out[0] - ref).max() < 1e-5, np.abs(out[0] - ref).max()
        print("ok")
    """
    r = run_python(code, str(int(rng.integers(1 << 30))), str(rng.uniform(0.05, 0.5)))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
