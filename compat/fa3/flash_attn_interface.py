"""FA3's top-level ``flash_attn_interface`` from the compat distribution: this module replaces
itself with flashattn.fa3, so ``flash_attn_interface is flashattn.fa3``."""

import sys

try:
    from flashattn import fa3 as _fa3
except ImportError as e:
    raise ImportError("the flash-attn-3 compat distribution needs flashattn: install it from "
                      "the flashattn repository (pip install .)") from e

sys.modules[__name__] = _fa3  # the import statement returns this entry
