"""flashattn: FlashAttention as a C library, with upstream flash_attn's Python API.

    from flashattn import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)   # torch CPU or CUDA tensors, or NumPy arrays

torch and NumPy are optional and imported only when their arrays are passed in. The C library
(libflashattn) is loaded on the first call; see ``flashattn._lib`` for where it is looked for.

Beyond the functions: ``flashattn.bert_padding``, ``flashattn.layers.rotary``,
``flashattn.modules.mha`` and ``flashattn.utils.generation`` mirror upstream's modules;
``flashattn.fa3`` has FA3's interface; ``flex_attention`` and ``create_block_mask`` have
torch FlexAttention's (CPU, forward); ``flashattn.integrations.transformers.register()`` makes
the package a Hugging Face transformers attention implementation;
``install_alias()`` (or ``FLASHATTN_ALIAS=1``) lets ``import flash_attn`` resolve here when
upstream is not installed; with torch >= 2.11, "flashattn" is registered as a flash attention
implementation for ``torch.nn.attention.activate_flash_attention_impl`` whichever of torch and
flashattn is imported first.
"""

import os as _os
import sys as _sys

from ._alias import install_alias
from ._lib import VERSION as _VERSION
from ._lib import FlashAttnError
from .flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    flash_attn_combine,
)
from .flex import BlockMask, create_block_mask, flex_attention
from . import _route as _route_module, flex as _flex_module

_route_module.use_flex(_flex_module.fastpath_table, _flex_module.bound)

# Kept equal to the C library's fa_version() (FA_VERSION_* in include/flashattn.h); the loader
# refuses a library of another version.
__version__ = _VERSION

__all__ = [
    "__version__",
    "FlashAttnError",
    "install_alias",
    "register_sdpa_impl",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "flex_attention",
    "create_block_mask",
    "BlockMask",
]


def register_sdpa_impl():
    """Registers "flashattn" with ``torch.nn.attention.register_flash_attention_impl`` (never
    activates it). Returns False when this torch has no such registry."""
    from . import _sdpa

    return _sdpa.register()


def _bind_torch():
    """What the package does once torch is imported: registers with torch's SDPA registry,
    and imports its torch ops with the C fast path bound (so that the first call, which
    torch.compile may trace, does none of this). Initialises no CUDA."""
    from . import _dlpack, _route

    register_sdpa_impl()
    _dlpack.note_torch(_sys.modules["torch"])
    _route.torch_ops()


class _RegisterAfterTorch:
    """A one-shot import hook: when torch is imported after flashattn, runs ``_bind_torch``
    once torch's module has run (importing torch here would make ``import flashattn`` slow for
    callers that never use torch)."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "torch":
            return None
        try:
            _sys.meta_path.remove(cls)
        except ValueError:  # another thread's import of torch took the hook
            return None
        import importlib.util

        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            try:
                _bind_torch()
            except Exception as e:  # never fail the caller's import of torch
                import warnings

                warnings.warn("flashattn: could not bind to torch: %s" % e)

        spec.loader.exec_module = exec_then_register
        return spec


if _sys.modules.get("torch") is not None:
    _bind_torch()
elif _RegisterAfterTorch not in _sys.meta_path:
    _sys.meta_path.insert(0, _RegisterAfterTorch)

if _os.environ.get("FLASHATTN_ALIAS") == "1":
    install_alias()

