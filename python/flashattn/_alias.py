"""The opt-in ``flash_attn`` alias: code written for upstream runs unchanged on flashattn.

    import flashattn
    flashattn.install_alias()        # or FLASHATTN_ALIAS=1 when flashattn is imported
    from flash_attn import flash_attn_func
    from flash_attn.bert_padding import pad_input, unpad_input

The alias is installed only when no real ``flash_attn`` can be imported: an installed upstream
package always wins and is never shadowed. ``flash_attn`` becomes the flashattn package itself,
and each submodule flashattn mirrors resolves, on first import, to the same module object as
its flashattn counterpart (so ``flash_attn.bert_padding.pad_input is
flashattn.bert_padding.pad_input``); nothing is imported ahead, so the alias costs no torch
import. ``flash_attn.__version__`` is flashattn's version, and no ``flash_attn`` distribution
metadata is created, so tools that check installed packages still see that upstream is absent.
"""

import importlib
import importlib.abc
import importlib.util
import sys

# Upstream module name -> the flashattn module it resolves to.
_SUBMODULES = {
    "flash_attn.flash_attn_interface": "flashattn.flash_attn_interface",
    "flash_attn.bert_padding": "flashattn.bert_padding",
    "flash_attn.layers": "flashattn.layers",
    "flash_attn.layers.rotary": "flashattn.layers.rotary",
    "flash_attn.modules": "flashattn.modules",
    "flash_attn.modules.mha": "flashattn.modules.mha",
    "flash_attn.utils": "flashattn.utils",
    "flash_attn.utils.generation": "flashattn.utils.generation",
}


class _AliasLoader(importlib.abc.Loader):
    """Loads an aliased name as the already existing flashattn module."""

    def __init__(self, target):
        self._target = target
        self._own_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self._target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module):
        # The import system has just set module.__spec__ to the alias's spec; the module keeps
        # its own (importlib.reload and pickling read it).
        module.__spec__ = self._own_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Answers only for the mirrored names. It sits before the path finder, which would
    otherwise find flashattn's files through flash_attn.__path__ and execute a second copy of
    each module under the upstream name."""

    def find_spec(self, name, path=None, target=None):
        module = _SUBMODULES.get(name)
        if module is None:
            return None
        return importlib.util.spec_from_loader(name, _AliasLoader(module))


_FINDER = _AliasFinder()


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
    mirror()
    return True


def mirror():
    """Binds ``flash_attn`` and its mirrored submodules to flashattn unconditionally. The compat
    distribution (compat/ in the repository) calls it from its own ``flash_attn`` package."""
    sys.modules["flash_attn"] = importlib.import_module("flashattn")
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
