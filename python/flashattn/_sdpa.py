"""flashattn as an implementation of PyTorch's flash attention SDPA backend.

    import torch, flashattn
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl
    activate_flash_attention_impl("flashattn")   # F.scaled_dot_product_attention now runs here
    restore_flash_attention_impl()               # back to PyTorch's own kernels

torch >= 2.11 keeps a registry of flash attention implementations
(``torch.nn.attention.register_flash_attention_impl``). Registering stores a callable; only
``activate_flash_attention_impl`` calls it, and it then overrides dispatcher kernels of the
aten flash attention ops, for as long as the returned handle lives (``restore`` removes it).
flashattn is registered under the name "flashattn" and never activated on its own.

What activation overrides, by device:
- CPU: ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward, which
  ``F.scaled_dot_product_attention`` calls for CPU tensors whenever it picks the flash backend
  (dense 4-D inputs; no dropout, since SDPA routes dropout on the CPU to the math backend). The
  autograd formula stays aten's: it calls the backward op, which is ours too. Calls flashattn
  cannot serve exactly go to the kernel that was registered before: an explicit attn_mask,
  dropout (the aten backward has no seed to replay it), is_causal with fewer queries than keys
  (SDPA's causal mask is top-left aligned; with sq < sk that needs a window flashattn does not
  express), head dims over 256 or differing between q and v, and empty inputs.
- CUDA: nothing yet. The GPU registration overrides ``aten::_scaled_dot_product_flash_attention``
  / ``_flash_attention_forward`` and their backwards on the CUDA key the same way (see
  torch/nn/attention/_fa4.py for the calling convention), once flashattn's Python layer passes
  CUDA tensors and the current stream to the C library.
"""

import torch

from . import _core

IMPL_NAME = "flashattn"

_CPU_FWD = "_scaled_dot_product_flash_attention_for_cpu"
_CPU_BWD = "_scaled_dot_product_flash_attention_for_cpu_backward"


def available():
    """Whether this torch has the registry and the kernel lookup a fallback needs."""
    attention = getattr(torch.nn, "attention", None)
    return (attention is not None and hasattr(attention, "register_flash_attention_impl")
            and hasattr(torch.library, "get_kernel"))


def register():
    """Adds "flashattn" to torch's flash attention implementations (without activating it).
    Returns False when this torch has no such registry."""
    if not available():
        return False
    torch.nn.attention.register_flash_attention_impl(IMPL_NAME, register_fn=_activate)
    return True


class _Handle:
    """Keeps the overriding registrations alive; ``remove`` gives the ops their previous
    kernels back."""

    def __init__(self, library):
        self.library = library

    def remove(self):
        if self.library is not None:
            self.library._destroy()
            self.library = None


def _activate():
    # The kernels to fall back to are looked up before ours replace them.
    fwd_prev = torch.library.get_kernel("aten::" + _CPU_FWD, "CPU")
    bwd_prev = torch.library.get_kernel("aten::" + _CPU_BWD, "CPU")
    lib = torch.library.Library("aten", "IMPL")

    def forward(keyset, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                scale=None):
        if not _serves(query, key, value, dropout_p, is_causal, attn_mask):
            return fwd_prev.call_boxed(keyset, query, key, value, dropout_p, is_causal,
                                       attn_mask=attn_mask, scale=scale)
        return _cpu_forward(query, key, value, is_causal, scale)

    def backward(keyset, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                 attn_mask=None, scale=None):
        if not _serves(query, key, value, dropout_p, is_causal, attn_mask):
            return bwd_prev.call_boxed(keyset, grad_out, query, key, value, out, logsumexp,
                                       dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        return _cpu_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale)

    lib.impl(_CPU_FWD, forward, "CPU", with_keyset=True)
    lib.impl(_CPU_BWD, backward, "CPU", with_keyset=True)
    return _Handle(lib)


def _serves(query, key, value, dropout_p, is_causal, attn_mask):
    """Whether flashattn computes exactly what the aten op would. The forward and the backward
    ask with the same arguments, so a call never pairs our forward with aten's backward."""
    if attn_mask is not None or dropout_p != 0.0 or query.dim() != 4:
        return False
    sq, sk = query.shape[2], key.shape[2]
    if is_causal and sq < sk:
        return False
    if query.shape[-1] > 256 or value.shape[-1] != query.shape[-1]:
        return False
    return min(query.shape[0], query.shape[1], sq, sk) > 0


def _mask_options(sq, sk, is_causal):
    """SDPA's causal mask is aligned to the top-left corner (query i sees keys j <= i);
    flashattn's windows to the bottom-right, so the right bound is sq - sk."""
    if not is_causal:
        return False, (-1, -1)
    if sq == sk:
        return True, (-1, -1)
    return False, (-1, sq - sk)


def _cpu_forward(query, key, value, is_causal, scale):
    """(b, h, s, d) tensors in, aten's outputs out: attention (b, h, sq, d) laid out like
    query, and logsumexp (b, h, sq) in the computation dtype with (b, sq, h) strides, as
    aten's meta function describes them (compiled graphs check strides)."""
    b, h, sq = query.shape[0], query.shape[1], query.shape[2]
    causal, window = _mask_options(sq, key.shape[2], is_causal)
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    out = torch.empty_like(query)
    lse = torch.empty((b, h, sq), dtype=lse_dtype, device=query.device)
    _core.forward(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                  kind=_core.TORCH, softmax_scale=scale, causal=causal, window_size=window,
                  out=out.transpose(1, 2), lse=lse)
    logsumexp = torch.empty((b, sq, h), dtype=lse_dtype, device=query.device).transpose(1, 2)
    logsumexp.copy_(lse)
    return out, logsumexp


def _cpu_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale):
    """Gradients with aten's layout: (b, h, s, d) views of (b, s, h, d) buffers."""
    causal, window = _mask_options(query.shape[2], key.shape[2], is_causal)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    dq, dk, dv, _ = _core.backward(t(grad_out), t(query), t(key), t(value), t(out),
                                   logsumexp.contiguous(), kind=_core.TORCH,
                                   softmax_scale=scale, causal=causal, window_size=window)
    return t(dq), t(dk), t(dv)
