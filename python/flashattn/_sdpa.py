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
- CUDA (where this torch build has CUDA kernels): ``aten::_scaled_dot_product_flash_attention``
  and its backward, which SDPA calls for CUDA tensors when it picks its flash backend (its own
  checks first: fp16/bf16, sm80+, no mask, is_causal only with sq == sk). Served on the current
  stream, without host synchronisation; handed to the previous kernels: dropout and the debug
  mask (torch's Philox state and mask encoding are not flashattn's), the cases above, and what
  the CUDA backend refuses as unsupported (for example the backward of head dims it has no
  kernel for yet). Without dropout the two directions only exchange out and logsumexp, whose
  definitions agree, so either side may be ours.
"""

import torch

from . import _arrays, _core
from ._lib import STATUS_UNSUPPORTED, FlashAttnError

IMPL_NAME = "flashattn"

_CPU_FWD = "_scaled_dot_product_flash_attention_for_cpu"
_CPU_BWD = "_scaled_dot_product_flash_attention_for_cpu_backward"
_CUDA_FWD = "_scaled_dot_product_flash_attention"
_CUDA_BWD = "_scaled_dot_product_flash_attention_backward"


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
    lib = torch.library.Library("aten", "IMPL")
    _activate_cpu(lib)
    _activate_cuda(lib)
    return _Handle(lib)


def _activate_cpu(lib):
    # The kernels to fall back to are looked up before ours replace them.
    fwd_prev = torch.library.get_kernel("aten::" + _CPU_FWD, "CPU")
    bwd_prev = torch.library.get_kernel("aten::" + _CPU_BWD, "CPU")

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


def _activate_cuda(lib):
    try:
        fwd_prev = torch.library.get_kernel("aten::" + _CUDA_FWD, "CUDA")
        bwd_prev = torch.library.get_kernel("aten::" + _CUDA_BWD, "CUDA")
    except RuntimeError:  # a torch build without CUDA kernels: nothing to override
        return

    def forward(keyset, query, key, value, dropout_p=0.0, is_causal=False,
                return_debug_mask=False, *, scale=None):
        def previous():
            return fwd_prev.call_boxed(keyset, query, key, value, dropout_p, is_causal,
                                       return_debug_mask, scale=scale)

        if return_debug_mask or not _serves_cuda(query, key, value, dropout_p, is_causal):
            return previous()
        return _unsupported_to(previous, _cuda_forward, query, key, value, is_causal, scale)

    def backward(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                 max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        def previous():
            return bwd_prev.call_boxed(keyset, grad_out, query, key, value, out, logsumexp,
                                       cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                       philox_seed, philox_offset, scale=scale)

        if not _serves_cuda(query, key, value, dropout_p, is_causal):
            return previous()
        return _unsupported_to(previous, _cuda_backward, grad_out, query, key, value, out,
                               logsumexp, is_causal, scale)

    lib.impl(_CUDA_FWD, forward, "CUDA", with_keyset=True)
    lib.impl(_CUDA_BWD, backward, "CUDA", with_keyset=True)


def _unsupported_to(previous, fn, *args):
    """fn(*args), or previous() where the library has no kernel for the case."""
    try:
        return fn(*args)
    except FlashAttnError as e:
        if e.status != STATUS_UNSUPPORTED:
            raise
    return previous()


def _serves(query, key, value, dropout_p, is_causal, attn_mask):
    """Whether flashattn computes exactly what the aten op would. The forward and the backward
    ask with the same arguments, so on the CPU a call never pairs our forward with aten's
    backward."""
    if attn_mask is not None or dropout_p != 0.0 or query.dim() != 4:
        return False
    sq, sk = query.shape[2], key.shape[2]
    if is_causal and sq < sk:
        return False
    if query.shape[-1] > 256 or value.shape[-1] != query.shape[-1]:
        return False
    return min(query.shape[0], query.shape[1], sq, sk) > 0


def _serves_cuda(query, key, value, dropout_p, is_causal):
    return query.dtype in (torch.float16, torch.bfloat16) and _serves(
        query, key, value, dropout_p, is_causal, None)


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
                  kind=_arrays.TORCH, softmax_scale=scale, causal=causal, window_size=window,
                  out=out.transpose(1, 2), lse=lse)
    logsumexp = torch.empty((b, sq, h), dtype=lse_dtype, device=query.device).transpose(1, 2)
    logsumexp.copy_(lse)
    return out, logsumexp


def _cpu_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale):
    """Gradients with aten's layout: (b, h, s, d) views of (b, s, h, d) buffers."""
    causal, window = _mask_options(query.shape[2], key.shape[2], is_causal)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    dq, dk, dv, _ = _core.backward(t(grad_out), t(query), t(key), t(value), t(out),
                                   logsumexp.contiguous(), kind=_arrays.TORCH,
                                   softmax_scale=scale, causal=causal, window_size=window)
    return t(dq), t(dk), t(dv)


def _cuda_forward(query, key, value, is_causal, scale):
    """aten's nine outputs: attention laid out like query and fp32 logsumexp (b, h, sq), as
    the meta function allocates them, no cumulative lengths, the sequence lengths, a zero
    Philox state and offset (no dropout), and an empty debug mask."""
    b, h, sq, sk = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    causal, window = _mask_options(sq, sk, is_causal)
    out = torch.empty_like(query)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=query.device)
    _core.forward(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                  kind=_arrays.TORCH, softmax_scale=scale, causal=causal, window_size=window,
                  out=out.transpose(1, 2), lse=lse)
    seed = torch.zeros((2,), dtype=torch.uint64, device=query.device)
    offset = torch.zeros((), dtype=torch.uint64, device=query.device)
    debug_mask = torch.empty((0,), dtype=query.dtype, device=query.device)
    return out, lse, None, None, sq, sk, seed, offset, debug_mask


def _cuda_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale):
    """Gradients laid out like query, key and value (aten's meta: empty_like)."""
    causal, window = _mask_options(query.shape[2], key.shape[2], is_causal)
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    _core.backward(t(grad_out), t(query), t(key), t(value), t(out), logsumexp.contiguous(),
                   kind=_arrays.TORCH, softmax_scale=scale, causal=causal, window_size=window,
                   dq=t(dq), dk=t(dk), dv=t(dv))
    return dq, dk, dv
