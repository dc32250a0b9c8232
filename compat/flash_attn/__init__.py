"""``flash_attn`` from the compat distribution: this module replaces itself with flashattn, and
flashattn's alias resolves the upstream submodules it mirrors (bert_padding, layers.rotary,
modules.mha, utils.generation, flash_attn_interface) to flashattn's own modules."""

try:
    from flashattn import _alias
except ImportError as e:  # the shim alone is useless; say what is missing
    raise ImportError("the flash-attn compat distribution needs flashattn: install it from the "
                      "flashattn repository (pip install .)") from e

_alias.mirror()  # the import statement returns sys.modules["flash_attn"], now flashattn itself
