"""The inference state that ``flashattn.modules.mha.MHA`` reads and fills while generating, as
upstream's ``flash_attn.utils.generation.InferenceParams`` (the decoding loops of upstream's
module are not provided)."""

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["InferenceParams"]


@dataclass
class InferenceParams:
    """Per-generation state shared by the layers of a model.

    max_seqlen, max_batch_size: the size of the kv caches each layer allocates.
    seqlen_offset: tokens already in the caches (0 for the prompt); the caller advances it.
    batch_size_offset: first cache row of this batch.
    key_value_memory_dict: layer_idx -> kv cache (batch, max_seqlen, 2, nheads_kv, head_dim).
    lengths_per_sample: optional int32 (batch,), per-sequence lengths for ragged decoding.
    """

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: Optional[Any] = None

    def reset(self, max_seqlen, max_batch_size):
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()
