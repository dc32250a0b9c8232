"""The opt-in ``flash_attn`` alias: code written for upstream runs unchanged on flashattn.

    import flashattn
    flashattn.install_alias()        # or FLASHATTN_ALIAS=1 in the environment
    from flash_attn import flash_attn_func
    from flash_attn.bert_padding import pad_input, unpad_input

The alias is installed only when no real ``flash_attn`` can be imported: an installed upstream
package always wins and is never shadowed. It maps each module flashattn mirrors to the same
module object (so ``flash_attn.flash_attn_func is flashattn.flash_attn_func``); the modules built
on torch are mapped only where torch is installed, and mapping them imports torch.
``flash_attn.__version__`` is flashattn's version, and no ``flash_attn`` distribution metadata
is created, so tools that check installed packages still see that upstream is absent.
"""

import importlib
import importlib.util
import sys

# Upstream module name -> flashattn module; the first two need no torch.
_MODULES = [
    ("flash_attn", "flashattn"),
    ("flash_attn.flash_attn_interface", "flashattn.flash_attn_interface"),
    ("flash_attn.bert_padding", "flashattn.bert_padding"),
    ("flash_attn.layers", "flashattn.layers"),
    ("flash_attn.layers.rotary", "flashattn.layers.rotary"),
    ("flash_attn.modules", "flashattn.modules"),
    ("flash_attn.modules.mha", "flashattn.modules.mha"),
    ("flash_attn.utils", "flashattn.utils"),
    ("flash_attn.utils.generation", "flashattn.utils.generation"),
]
_NEEDS_NO_TORCH = 2


def is_installed():
    """Whether ``flash_attn`` currently resolves to flashattn through the alias."""
    module = sys.modules.get("flash_attn")
    return module is not None and module is sys.modules.get("flashattn")


def install_alias():
    """Makes ``import flash_attn`` (and its mirrored submodules) resolve to flashattn, unless a
    real flash_attn is importable. Returns True when the alias is in place."""
    if is_installed():
        return True
    if "flash_attn" in sys.modules or importlib.util.find_spec("flash_attn") is not None:
        return False
    with_torch = sys.modules.get("torch") is not None or (
        "torch" not in sys.modules and importlib.util.find_spec("torch") is not None)
    for i, (alias, target) in enumerate(_MODULES):
        if i >= _NEEDS_NO_TORCH and not with_torch:
            break
        sys.modules[alias] = importlib.import_module(target)
    return True
