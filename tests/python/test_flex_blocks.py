"""create_block_mask's lists (_flex_blocks): the C library's fa_block_mask_build called directly
through ctypes on the traced program against create_block_mask's fields (its kv_ lists are the
builder's, its q_ lists their transposes); the torch route of the transposes (CUDA block
masks), run here on the CPU, against the NumPy one, for test_flex's masks and a few more
(division, floor, mod, exp, captured tables). tests/gpu/test_python_cuda.py builds on a CUDA
device."""

import ctypes

import numpy as np
import pytest
import torch

import flashattn
from flashattn import FlashAttnError, _flex_blocks, _lib
from flashattn._flex_cache import trace
from flashattn._flex_trace import KIND_MASK
from test_flex import FIELDS, make_cases

B, H, SQ, SK = 2, 4, 96, 130


def extra_masks(rng):
    table = torch.from_numpy(rng.integers(0, 3, (H, SK))).int()
    scale = torch.from_numpy(rng.uniform(0.5, 2.0, H)).float()

    def striped(b, h, q_idx, kv_idx):  # division, floor, mod
        return (torch.floor(kv_idx / 24.0) % 2 == 0) | (q_idx // 32 == kv_idx // 32)

    def decaying(b, h, q_idx, kv_idx):  # exp of a captured float per head
        return torch.exp(-(q_idx - kv_idx).abs() * scale[h] / 16.0) > 0.2

    def table_heads(b, h, q_idx, kv_idx):  # an int table per (head, key)
        return (table[h, kv_idx] != b) & (kv_idx <= q_idx + 40)

    def clamped(b, h, q_idx, kv_idx):  # indices past the table, clamped into it
        return (table[h, kv_idx + 10] == 1) | (table[h, q_idx * 3 // 2] == 0)

    def nothing(b, h, q_idx, kv_idx):
        return q_idx < 0

    return {"striped": striped, "decaying": decaying, "table_heads": table_heads,
            "clamped": clamped, "nothing": nothing}


def masks(rng):
    found = {name: m for name, (m, _) in make_cases(rng, B, H, SQ, SK).items() if m is not None}
    found.update(extra_masks(rng))
    return found


NAMES = sorted(masks(np.random.default_rng(0)))


@pytest.mark.parametrize("blocks", [(32, 32), (16, 48), (128, 128)])
@pytest.mark.parametrize("name", NAMES)
def test_torch_route_equals_numpy(rng, name, blocks):
    t, tensors = trace(masks(rng)[name], KIND_MASK, "mask_mod")
    for separate in (True, False):
        host = _flex_blocks.build(t, tensors, B, H, SQ, SK, *blocks, separate, "cpu",
                                  torch_ops=False)
        torch_built = _flex_blocks.build(t, tensors, B, H, SQ, SK, *blocks, separate, "cpu",
                                         torch_ops=True)
        for field, a, b in zip(FIELDS, host, torch_built):
            if a is None:
                assert b is None, field
                continue
            assert b.dtype == torch.int32 and b.is_contiguous(), field
            assert torch.equal(a, b), "%s (%s blocks, separate %s)" % (field, blocks, separate)


# ---- the C builder, called directly --------------------------------------------------------


def _c_tensor(x):
    """An fa_tensor of contiguous NumPy array x (int32 or fp32), by fa_tensor_make."""
    code = _lib.DTYPE_I32 if x.dtype == np.int32 else _lib.DTYPE_F32
    shape = (ctypes.c_int64 * x.ndim)(*x.shape)
    return _lib.get_lib().fa_tensor_make(x.ctypes.data, code, x.ndim, shape, None)


def c_builder(mask_mod, b, h, sq, sk, qbs, kbs, separate):
    """fa_block_mask_build's four outputs (None for the full pair without ``separate``) for
    mask_mod's traced program, its captured tensors as int32 / fp32 NumPy arrays."""
    t, tensors = trace(mask_mod, KIND_MASK, "mask_mod")
    nq, nk = -(-sq // qbs), -(-sk // kbs)
    outs = [np.full(s, -7, dtype=np.int32) for s in ((b, h, nq), (b, h, nq, nk)) * 2]
    arrays = [np.ascontiguousarray(x.numpy(), dtype=np.float32 if x.is_floating_point()
                                   else np.int32).reshape(x.shape or (1,)) for x in tensors]
    c = [_c_tensor(x) for x in outs + arrays]
    args = _lib.FaBlockMaskArgs()
    _lib.get_lib().fa_block_mask_args_init(ctypes.byref(args))
    args.mask_mod = t.program(range(len(tensors))).ptr
    for i in range(len(arrays)):
        args.mod_aux[i] = ctypes.pointer(c[4 + i])
    args.b, args.h, args.sq, args.sk, args.q_block, args.kv_block = b, h, sq, sk, qbs, kbs
    args.kv_num_blocks, args.kv_indices = ctypes.pointer(c[0]), ctypes.pointer(c[1])
    if separate:
        args.full_kv_num_blocks = ctypes.pointer(c[2])
        args.full_kv_indices = ctypes.pointer(c[3])
    _lib.check(_lib.get_lib().fa_block_mask_build(ctypes.byref(args)))
    return outs if separate else outs[:2] + [None, None]


def transposed(num, idx):
    """The q_ lists of kv lists (num, idx): the 0/1 matrix, transposed, set blocks first."""
    dense = np.zeros(idx.shape, dtype=np.int32)
    for pos in np.ndindex(num.shape):
        dense[pos][idx[pos][:num[pos]]] = 1
    dense = dense.swapaxes(-1, -2)
    return dense.sum(-1), np.argsort(-dense, axis=-1, kind="stable")


def documents(rng, b, lengths):
    """A document id per (sequence, position): runs of random lengths, per sequence."""
    return torch.from_numpy(np.stack([np.cumsum(rng.random(lengths) < 0.04)
                                      for _ in range(b)])).to(torch.int64)


@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize("blocks", [(32, 32), (16, 48), (128, 64), (1 << 40, 48), (32, 1000)])
def test_create_block_mask_is_the_c_builder(rng, blocks, separate):
    """Document masks over captured tensors (int64 ids, converted to int32 as a call converts
    them; per sequence, per head, both or neither), B, H > 1, lengths no multiple of the
    blocks, and blocks past every row or key: create_block_mask's kv_ lists are
    fa_block_mask_build's on the same program, its q_ lists their transposes, int32 and
    contiguous."""
    b, h, sq, sk = 3, 2, 203, 147
    doc = documents(rng, b, max(sq, sk))
    window = torch.from_numpy(rng.integers(20, 90, h)).int()
    shared = doc[0].clone()

    def doc_per_sequence(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)

    def doc_window(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx - kv_idx < window[h])

    def doc_shared(b, h, q_idx, kv_idx):  # reads neither b nor h: built once, copied
        return shared[q_idx] == shared[kv_idx]

    for mask_mod in (doc_per_sequence, doc_window, doc_shared):
        ours = flashattn.create_block_mask(mask_mod, b, h, sq, sk, BLOCK_SIZE=blocks,
                                           separate_full_blocks=separate)
        c = c_builder(mask_mod, b, h, sq, sk, *blocks, separate)
        for pair in (0, 2):
            if c[pair] is None:
                for f in FIELDS[pair:pair + 2] + FIELDS[pair + 4:pair + 6]:
                    assert getattr(ours, f) is None, f
                continue
            expect = c[pair:pair + 2] + list(transposed(*c[pair:pair + 2]))
            for f, e in zip(FIELDS[pair:pair + 2] + FIELDS[pair + 4:pair + 6], expect):
                x = getattr(ours, f)
                assert x.dtype == torch.int32 and x.is_contiguous(), f
                assert np.array_equal(x.numpy(), e), "%s: %s" % (mask_mod.__name__, f)
        if not separate:  # every block with a kept pair is partial
            full = c_builder(mask_mod, b, h, sq, sk, *blocks, True)
            any_kept = ours.kv_num_blocks.numpy()
            assert np.array_equal(any_kept, full[0] + full[2]), mask_mod.__name__


def test_builder_errors_are_flashattn_errors():
    """A refusal of fa_block_mask_build surfaces as FlashAttnError with C's message, its
    arguments named as create_block_mask's caller named them."""
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    with pytest.raises(FlashAttnError, match=r"^create_block_mask: BLOCK_SIZE\[0\]: must be in "
                       r"\[1, 2\^40\], got 2199023255552$") as e:
        flashattn.create_block_mask(causal, 1, 1, 16, 16, BLOCK_SIZE=(2**41, 16))
    assert e.value.status == _lib.STATUS_INVALID_ARGUMENT
    empty = torch.zeros(0, dtype=torch.int32)

    def reads_empty(b, h, q_idx, kv_idx):
        return empty[q_idx] == 0

    with pytest.raises(FlashAttnError, match="mask_mod's captured tensor 0: dimension 0 is 0"):
        flashattn.create_block_mask(reads_empty, 1, 1, 16, 16)


def test_empty_lengths():
    """A length 0 (no pairs: the builder is not called) lists no block; shapes as for any
    length."""
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    for sq, sk in ((0, 40), (40, 0), (0, 0)):
        bm = flashattn.create_block_mask(causal, 2, 3, sq, sk, BLOCK_SIZE=16)
        nq, nk = -(-sq // 16), -(-sk // 16)
        shapes = [(2, 3, nq), (2, 3, nq, nk)] * 2 + [(2, 3, nk), (2, 3, nk, nq)] * 2
        for f, shape in zip(FIELDS, shapes):
            x = getattr(bm, f)
            assert x.dtype == torch.int32 and tuple(x.shape) == shape, f
            assert not x.any(), f
