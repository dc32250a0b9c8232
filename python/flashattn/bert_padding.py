"""Moving between padded batches and the packed (varlen) layout, as upstream's
``flash_attn.bert_padding``: same functions, signatures and return values, in plain torch
(no einops).

    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out_unpad = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens, cu_seqlens,
                                       max_seqlen, max_seqlen)
    out = pad_input(out_unpad, indices, batch, seqlen)

Every function is differentiable. The index functions take int64 ``indices`` into the first
axis (``unpad_input`` returns them); they gather and scatter whole rows, so the trailing
dimensions may have any shape.
"""

import torch
import torch.nn.functional as F

__all__ = [
    "index_first_axis",
    "index_put_first_axis",
    "index_first_axis_residual",
    "unpad_input",
    "unpad_input_for_concatenated_sequences",
    "pad_input",
]


class IndexFirstAxis(torch.autograd.Function):
    """``input[indices]`` along the first axis. The backward accumulates with index_add, so a
    repeated index gets the sum of its gradients (upstream's scatter keeps one of them)."""

    @staticmethod
    def forward(ctx, input, indices):
        assert input.ndim >= 2, "index_first_axis: input needs at least 2 dimensions"
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        flat = input.reshape(input.shape[0], -1)
        return flat.index_select(0, indices).reshape(-1, *input.shape[1:])

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        flat = grad_output.reshape(grad_output.shape[0], -1)
        grad = flat.new_zeros((ctx.first_axis_dim, flat.shape[1]))
        grad.index_add_(0, indices, flat)
        return grad.reshape(ctx.first_axis_dim, *grad_output.shape[1:]), None


index_first_axis = IndexFirstAxis.apply


class IndexPutFirstAxis(torch.autograd.Function):
    """A zero tensor with ``first_axis_dim`` rows, and ``values`` written at rows ``indices``."""

    @staticmethod
    def forward(ctx, values, indices, first_axis_dim):
        assert indices.ndim == 1, "index_put_first_axis: indices must be 1-D"
        assert values.ndim >= 2, "index_put_first_axis: values need at least 2 dimensions"
        ctx.save_for_backward(indices)
        output = values.new_zeros((first_axis_dim,) + tuple(values.shape[1:]))
        output[indices] = values
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        return grad_output[indices], None, None


index_put_first_axis = IndexPutFirstAxis.apply


class IndexFirstAxisResidual(torch.autograd.Function):
    """``(input[indices], input)``: the selected rows and the whole input, both differentiable,
    for callers that keep using the full tensor (upstream uses it to fuse a residual)."""

    @staticmethod
    def forward(ctx, input, indices):
        assert input.ndim >= 2, "index_first_axis_residual: input needs at least 2 dimensions"
        ctx.save_for_backward(indices)
        # The residual is returned detached: an output that is the input itself would make
        # autograd treat it as a view modified by the function.
        return input[indices], input.detach()

    @staticmethod
    def backward(ctx, grad_output, grad_residual):
        (indices,) = ctx.saved_tensors
        return grad_residual.index_add(0, indices, grad_output), None


index_first_axis_residual = IndexFirstAxisResidual.apply


def _flatten_batch(hidden_states):
    """(b, s, ...) -> (b * s, ...), the row order ``indices`` refer to."""
    return hidden_states.reshape(-1, *hidden_states.shape[2:])


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Packs the tokens a mask selects.

    Arguments:
        hidden_states: (batch, seqlen, ...)
        attention_mask: (batch, seqlen), bool or int; 1 marks a valid token.
        unused_mask: (batch, seqlen), bool or int, optional; 1 marks a token that is allocated
            but unused. Such tokens are kept in the packed output (and counted in cu_seqlens)
            but not in ``seqused``.
    Return:
        hidden_states: (total_nnz, ...), the tokens of attention_mask + unused_mask.
        indices: (total_nnz,) int64, their positions in the flattened (batch * seqlen) input.
        cu_seqlens: (batch + 1,) int32, the cumulative sequence lengths.
        max_seqlen_in_batch: int.
        seqused: (batch,) int32, the number of tokens attention_mask selects in each sequence.
    """
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item())
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return (index_first_axis(_flatten_batch(hidden_states), indices), indices, cu_seqlens,
            max_seqlen, used)


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """Packs batches whose rows each hold several short samples back to back.

    Arguments:
        hidden_states: (batch, seqlen, ...)
        attention_mask_in_length: (batch, seqlen), int. Row b lists the lengths of the samples
            concatenated at the start of row b, followed by zeros: [[2, 3, 0, 0, 0, 0], ...]
            means samples of 2 and 3 tokens, then one token of padding.
    Return:
        hidden_states: (total_nnz, ...), the tokens of every sample.
        indices: (total_nnz,) int64, their positions in the flattened input.
        cu_seqlens: (num_samples + 1,) int32, one sequence per sample.
        max_seqlen_in_batch: int, the longest sample.
    """
    lengths = attention_mask_in_length
    seqlen = lengths.shape[-1]
    per_row = lengths.sum(dim=-1)
    positions = torch.arange(seqlen, device=lengths.device, dtype=per_row.dtype)
    token_mask = positions.expand(lengths.shape[0], seqlen) < per_row.unsqueeze(1)
    flat = lengths.flatten()
    sample_lens = flat[torch.nonzero(flat, as_tuple=False).flatten()]
    indices = torch.nonzero(token_mask.flatten(), as_tuple=False).flatten()
    max_seqlen = int(sample_lens.max().item())
    cu_seqlens = F.pad(torch.cumsum(sample_lens, dim=0, dtype=torch.int32), (1, 0))
    return (index_first_axis(_flatten_batch(hidden_states), indices), indices, cu_seqlens,
            max_seqlen)


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of ``unpad_input``: scatters packed tokens back into a zero-padded batch.

    Arguments:
        hidden_states: (total_nnz, ...)
        indices: (total_nnz,), positions in the flattened (batch * seqlen) batch.
        batch: int; seqlen: int.
    Return:
        hidden_states: (batch, seqlen, ...), zeros where no token was placed.
    """
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.reshape(batch, seqlen, *output.shape[1:])
