"""Utilities mirroring upstream's ``flash_attn.utils`` (``generation.InferenceParams``)."""
