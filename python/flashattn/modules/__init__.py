"""Modules mirroring upstream's ``flash_attn.modules`` (``mha``)."""
