"""Calling a flashattn op from the torch side: through the dispatcher, or its kernel and autograd
formula directly where torch could not tell the difference (``is_eager``): the dispatcher's Python
round trips cost more than a small call's kernel. Used by _torch_ops and _torch_kvcache."""

from typing import Optional

import torch

# The device types the ops' kernels are registered for ("cuda" runs the same Python kernels,
# _core passing the C library device pointers, the device and the current stream).
DEVICE_TYPES = ("cpu", "cuda")

T = torch.Tensor
OptT = Optional[torch.Tensor]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_eager(tensors):
    """Whether running an op's kernel (and autograd formula) directly is indistinguishable from
    calling the op: nothing is tracing or compiling, no mode or functorch transform intercepts
    ops, and every tensor is a plain one (a subclass may override any op)."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled()
            or torch._C._are_functorch_transforms_active() or torch._C._get_tracing_state()):
        return False
    for t in tensors:
        if t is not None and type(t) not in _PLAIN:
            return False
    return True


def needs_grad(tensors):
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def run(op, impl, function, tensors, args, eager):
    """op(*args), or where ``eager`` (``is_eager(tensors)``) the same through ``impl`` (the op's
    kernel) and ``function`` (an autograd.Function with the op's formula, applied to the
    tensor arguments, which come first in ``args``, and a tuple of the others; None for an op
    without a formula, which then goes through the dispatcher whenever gradients are
    recorded)."""
    if eager:
        if not needs_grad(tensors):
            return impl(*args)
        if function is not None:
            n = len(tensors)
            return function.apply(*args[:n], args[n:])
    return op(*args)
