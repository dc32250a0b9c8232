"""create_block_mask's two evaluations (_flex_blocks): the torch one, which builds CUDA block
masks on the device, run here on the CPU against the NumPy one of CPU block masks, field by
field, for test_flex's masks and a few more (division, floor, mod, exp, captured tables);
tests/gpu/test_python_cuda.py runs it on a CUDA device."""

import numpy as np
import pytest
import torch

from flashattn import _flex_blocks
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
def test_torch_evaluation_equals_numpy(rng, name, blocks):
    t, tensors = trace(masks(rng)[name], KIND_MASK, "mask_mod")
    for separate in (True, False):
        host = _flex_blocks.build(t, tensors, B, H, SQ, SK, *blocks, separate, "cpu",
                                  on_device=False)
        torch_built = _flex_blocks.build(t, tensors, B, H, SQ, SK, *blocks, separate, "cpu",
                                         on_device=True)
        for field, a, b in zip(FIELDS, host, torch_built):
            if a is None:
                assert b is None, field
                continue
            assert b.dtype == torch.int32 and b.is_contiguous(), field
            assert torch.equal(a, b), "%s (%s blocks, separate %s)" % (field, blocks, separate)
