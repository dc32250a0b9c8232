"""Layers mirroring upstream's ``flash_attn.layers`` (``rotary``)."""
