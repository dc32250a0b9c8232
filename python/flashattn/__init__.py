"""flashattn: FlashAttention as a C library, with upstream flash_attn's Python API.

    from flashattn import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)   # torch CPU tensors or NumPy arrays

torch and NumPy are optional and imported only when their arrays are passed in. The C library
(libflashattn) is loaded on the first call; see ``flashattn._lib`` for where it is looked for.
"""

from ._lib import VERSION as _VERSION
from ._lib import FlashAttnError
from .flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

# Kept equal to the C library's fa_version() (FA_VERSION_* in include/flashattn.h); the loader
# refuses a library of another version.
__version__ = _VERSION

__all__ = [
    "__version__",
    "FlashAttnError",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
]
