"""flashattn.bert_padding: round trips between padded batches and the packed layout, upstream's
return values, gradients, and padded attention through the varlen function."""

import numpy as np
import torch

from flashattn import flash_attn_func, flash_attn_varlen_func
from flashattn.bert_padding import (index_first_axis, index_first_axis_residual,
                                    index_put_first_axis, pad_input, unpad_input,
                                    unpad_input_for_concatenated_sequences)


def _mask(rng, b, s, min_len=0):
    lens = rng.integers(min_len, s + 1, b)
    lens[rng.integers(0, b)] = s  # one full row, so max_seqlen == s
    return torch.arange(s)[None, :] < torch.tensor(lens)[:, None], lens


def test_unpad_pad_round_trip(rng):
    b, s = 5, 9
    mask, lens = _mask(rng, b, s)
    x = torch.tensor(rng.standard_normal((b, s, 3, 4)))
    x_unpad, indices, cu, max_s, used = unpad_input(x, mask)
    assert x_unpad.shape == (int(lens.sum()), 3, 4)
    assert indices.dtype == torch.int64 and cu.dtype == torch.int32 and used.dtype == torch.int32
    assert cu.tolist() == [0] + np.cumsum(lens).tolist()
    assert isinstance(max_s, int) and max_s == s
    assert used.tolist() == lens.tolist()
    # the packed rows are the valid tokens in batch-major order
    want = torch.cat([x[i, :lens[i]] for i in range(b)])
    assert torch.equal(x_unpad, want)
    back = pad_input(x_unpad, indices, b, s)
    assert torch.equal(back, x * mask[:, :, None, None])


def test_unused_mask(rng):
    """Tokens marked unused are packed (and counted in cu_seqlens) but not in seqused."""
    b, s = 3, 8
    mask, lens = _mask(rng, b, s - 2)
    mask = torch.cat([mask, torch.zeros(b, 2, dtype=torch.bool)], 1)
    unused = torch.zeros(b, s, dtype=torch.bool)
    unused[:, s - 2:] = True
    x = torch.tensor(rng.standard_normal((b, s, 4)))
    x_unpad, indices, cu, max_s, used = unpad_input(x, mask, unused)
    assert used.tolist() == lens.tolist()
    assert cu.tolist() == [0] + np.cumsum(lens + 2).tolist()
    assert x_unpad.shape[0] == int((lens + 2).sum()) and max_s == int((lens + 2).max())


def test_concatenated_sequences(rng):
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    x = torch.tensor(rng.standard_normal((3, 6, 2)))
    x_unpad, indices, cu, max_s = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.tolist() == [0, 2, 5, 8, 10, 16] and cu.dtype == torch.int32
    assert max_s == 6
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10] + list(range(12, 18))
    assert torch.equal(x_unpad, x.reshape(18, 2)[indices])


def test_index_functions_gradients(rng):
    x = torch.tensor(rng.standard_normal((7, 2, 3)), requires_grad=True)
    idx = torch.tensor([5, 0, 3, 0])  # a repeated index accumulates its gradients
    assert torch.autograd.gradcheck(lambda t: index_first_axis(t, idx), (x,))
    vals = torch.tensor(rng.standard_normal((3, 2, 3)), requires_grad=True)
    put_idx = torch.tensor([6, 1, 2])
    assert torch.autograd.gradcheck(lambda t: index_put_first_axis(t, put_idx, 7), (vals,))
    out = index_put_first_axis(vals, put_idx, 7)
    assert torch.equal(out[put_idx], vals) and (out[[0, 3, 4, 5]] == 0).all()
    sel, res = index_first_axis_residual(x, idx)
    assert torch.equal(sel, x[idx]) and torch.equal(res, x)
    assert torch.autograd.gradcheck(lambda t: tuple(index_first_axis_residual(t, idx)), (x,))


def test_padded_attention_through_varlen(rng):
    """The intended use: unpad q/k/v, run the varlen function, pad back; equals dense attention
    of each sequence on its own, and gradients flow back to the padded inputs."""
    b, s, h, d = 3, 10, 2, 8
    mask, lens = _mask(rng, b, s, min_len=1)
    q, k, v = (torch.tensor(rng.standard_normal((b, s, h, d)), requires_grad=True)
               for _ in range(3))
    q_u, idx, cu, max_s, _ = unpad_input(q, mask)
    k_u, _, _, _, _ = unpad_input(k, mask)
    v_u, _, _, _, _ = unpad_input(v, mask)
    out = pad_input(flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_s, max_s, causal=True),
                    idx, b, s)
    for i in range(b):
        n = int(lens[i])
        ref = flash_attn_func(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n], causal=True)
        assert torch.allclose(out[i, :n], ref[0], atol=1e-12)
        assert (out[i, n:] == 0).all()
    (gq,) = torch.autograd.grad(out.sum(), (q,))
    assert (gq[~mask] == 0).all() and gq[mask].abs().sum() > 0
