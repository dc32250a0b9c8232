"""Paged keys for the varlen functions (upstream's ``block_table`` argument), as torch ops, for
calls that want gradients. Others pass block_table to the library, which reads the pages in
place (its forward has no backward, as upstream's).

Upstream's flash_attn_varlen_func reads k and v from a paged cache, (num_blocks, page_size,
nheads_k, headdim), key p of sequence b at block block_table[b, p // page_size], row p %
page_size; cu_seqlens_k gives each sequence's number of keys (its offsets are not positions in
k). Here the keys are gathered into a padded dense layout, sequence b at rows
[b * max_seqlen_k, b * max_seqlen_k + len_b), and the call runs as the dense varlen one with
seqused_k = len_b: the same attention, and, since the gather is a torch op, gradients flow back
into the pages. No device value is read on the host; block indices outside the cache and
lengths past a sequence's blocks are clamped. Torch tensors only (CPU and CUDA).
"""

import torch

from ._lib import FlashAttnError

__all__ = ["page_rows", "paged_kv"]


def page_rows(block_table, pos, page):
    """Rows, in the cache seen as (num_blocks * page, ...), of positions pos ([b, n] long) of
    each sequence: block block_table[b, pos // page] (the last column past the table), row
    pos % page."""
    slot = torch.div(pos, page, rounding_mode="floor").clamp(max=block_table.shape[1] - 1)
    return block_table.long().gather(1, slot) * page + pos % page


def paged_kv(k, v, cu_seqlens_k, block_table, max_seqlen_k, seqused_k=None):
    """(k, v, cu_seqlens_k, seqused_k) of the dense varlen call equal to the paged one."""
    if not isinstance(block_table, torch.Tensor) or not isinstance(k, torch.Tensor):
        raise NotImplementedError("flashattn: block_table (a paged KV cache) needs torch tensors")
    for x, name in ((k, "k"), (v, "v")):
        if x.dim() != 4:
            raise FlashAttnError("%s: with block_table, expected 4 dimensions (num_blocks, "
                                 "page_block_size, nheads_k, headdim), got shape %s"
                                 % (name, tuple(x.shape)))
    if v.shape[:3] != k.shape[:3]:
        raise FlashAttnError("v: expected the pages of k, (%s, headdim_v), got shape %s"
                             % (", ".join(str(n) for n in k.shape[:3]), tuple(v.shape)))
    b = cu_seqlens_k.shape[0] - 1
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != b:
        raise FlashAttnError("block_table: expected int32 of shape (%d, max_num_blocks), got %s "
                             "%s" % (b, block_table.dtype, tuple(block_table.shape)))
    nb, page = k.shape[0], k.shape[1]
    width = int(max_seqlen_k)
    lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long() if seqused_k is None \
        else seqused_k.long()
    pos = torch.arange(width, device=k.device)[None, :]
    # Values the host never reads are clamped into the cache, as the library's kernels clamp
    # theirs: a bad index gives its sequence wrong keys, never an access outside k and v (nor a
    # device-side assertion, which would end the process's CUDA context).
    lens = lens.clamp(0, min(width, block_table.shape[1] * page))
    used = pos < lens[:, None]
    rows = page_rows(block_table, pos.expand(b, width), page).clamp(0, nb * page - 1)
    rows = torch.where(used, rows, torch.zeros_like(rows)).reshape(-1)
    k_pad = k.reshape(nb * page, *k.shape[2:]).index_select(0, rows)
    v_pad = v.reshape(nb * page, *v.shape[2:]).index_select(0, rows)
    cu = torch.arange(0, (b + 1) * width, width, dtype=torch.int32, device=k.device)
    return k_pad, v_pad, cu, lens.to(torch.int32)
