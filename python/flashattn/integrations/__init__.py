"""Bindings of flashattn into frameworks through their own extension points.

``flashattn.integrations.transformers``: Hugging Face transformers' ``AttentionInterface``.
Each binding imports its framework only when asked to register.
"""
