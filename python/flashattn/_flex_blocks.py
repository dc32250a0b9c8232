"""create_block_mask's lists, built by the C library's fa_block_mask_build: the traced mask_mod,
as the fa_mod program the forward runs, evaluated at every (query, key) pair by the library's
rule (fp32, aux reads floored and clamped into their tensors), counted per (query block, key
block) and written in FlexAttention's order as kv_num_blocks / kv_indices and, with full
blocks separated, full_kv_num_blocks / full_kv_indices. One rule for the library's forward and
for Python's block masks.

A CPU block mask is built on the host into NumPy arrays (shared with torch tensors when torch
is imported); a CUDA one into torch tensors on its device, on torch's current stream there,
with no host synchronisation. The captured tensors are read where the build runs, as
``_aux_tensor`` converts them for a call.

The q_* lists (per key block, its query blocks) are the transposes: the 0/1 block matrices
rebuilt from the kv lists and ordered as FlexAttention orders a row (a stable descending sort),
with NumPy on the host or torch ops on the device.
"""

import ctypes
import sys

from . import _lib
from ._arrays import NUMPY, TORCH, _raw_stream, make_tensor, prepare
from ._core import _rename
from ._flex_call import _aux_tensor, _numpy
from ._flex_trace import AUX_SLOTS
from ._lib import FlashAttnError

# fa_block_mask_args' names as create_block_mask's caller knows them, for C's messages.
_NAMES = dict({"b": "B", "h": "H", "sq": "Q_LEN", "sk": "KV_LEN", "q_block": "BLOCK_SIZE[0]",
               "kv_block": "BLOCK_SIZE[1]"},
              **{"mod_aux[%d]" % i: "mask_mod's captured tensor %d" % i
                 for i in range(AUX_SLOTS)})


class _Host:
    """NumPy arrays on the host."""

    kind = NUMPY

    def __init__(self):
        self.np = _numpy()

    def empty(self, shape):
        return self.np.empty(shape, dtype=self.np.int32)

    def zeros(self, shape):
        return self.np.zeros(shape, dtype=self.np.int32)

    def dense(self, num, idx):
        """The 0/1 matrix [..., rows, cols] of lists num [..., rows] / idx [..., rows, cols]
        (idx a permutation of the columns per row, its first num entries the listed ones)."""
        np = self.np
        listed = (np.arange(idx.shape[-1], dtype=np.int32) < num[..., None]).astype(np.int32)
        dense = np.zeros_like(listed)
        np.put_along_axis(dense, idx, listed, axis=-1)
        return dense

    def ordered(self, dense):
        """FlexAttention's ordered form of a 0/1 block matrix [..., rows, cols]: the count per
        row and the column indices, those set first, each group ascending (a stable descending
        sort)."""
        np = self.np
        return (dense.sum(-1, dtype=np.int32),
                np.argsort(-dense, axis=-1, kind="stable").astype(np.int32))

    def export(self, x, device):
        if x is None:
            return None
        x = self.np.ascontiguousarray(x)
        torch = sys.modules.get("torch")
        return x if torch is None else torch.from_numpy(x)


class _Torch:
    """torch tensors on the block mask's device (a CUDA one, or the CPU in tests)."""

    kind = TORCH

    def __init__(self, device):
        self.torch = sys.modules["torch"]
        self.device = device

    def empty(self, shape):
        return self.torch.empty(shape, dtype=self.torch.int32, device=self.device)

    def zeros(self, shape):
        return self.torch.zeros(shape, dtype=self.torch.int32, device=self.device)

    def dense(self, num, idx):
        torch = self.torch
        cols = torch.arange(idx.shape[-1], dtype=torch.int32, device=self.device)
        listed = (cols < num.unsqueeze(-1)).to(torch.int32)
        return torch.zeros_like(listed).scatter_(-1, idx.long(), listed)

    def ordered(self, dense):
        torch = self.torch
        return (dense.sum(-1, dtype=torch.int32),
                torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32))

    def export(self, x, device):
        return None if x is None else x.contiguous()


def _target(device):
    """(torch device, CUDA ordinal) of a CUDA block mask ("cuda" is the current device), or
    None for the CPU."""
    if device is None or str(device).split(":")[0] != "cuda":
        return None
    torch = sys.modules.get("torch")
    if torch is None:
        raise FlashAttnError("device: %r needs torch (CUDA block masks are torch tensors)"
                             % (device,))
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", index), index


def _c_build(t, tensors, sizes, outputs, kind, device, index):
    """fa_block_mask_build of trace t into outputs (kv_num_blocks, kv_indices and the full_*
    pair or two Nones; arrays of ``kind``), on the CPU (index None) or on CUDA device
    ``index`` on torch's current stream there."""
    args = _lib.new_block_mask_args()
    args.mask_mod = t.program(range(len(tensors))).ptr
    keep = []
    for i in sorted(t.read):
        name = "mask_mod's captured tensor %d" % i
        x = prepare(_aux_tensor(tensors[i], "mask_mod", i, device), name, TORCH, cuda=True)
        ft = make_tensor(x, name, TORCH)
        keep.append((x, ft))
        args.mod_aux[i] = ctypes.pointer(ft)
    args.b, args.h, args.sq, args.sk, args.q_block, args.kv_block = sizes
    for field, x in zip(("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                         "full_kv_indices"), outputs):
        if x is not None:
            ft = make_tensor(x, field, kind)
            keep.append(ft)
            setattr(args, field, ctypes.pointer(ft))
    if index is not None:
        args.device, args.stream = index, _raw_stream(index)
    try:
        _lib.block_mask_build(args)
    except FlashAttnError as e:
        raise FlashAttnError("create_block_mask: " + _rename(str(e), _NAMES), e.status) from None
    del keep


def build(t, tensors, B, H, Q_LEN, KV_LEN, qbs, kbs, separate_full, device, torch_ops=None):
    """The BlockMask fields (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
    then the q_ ones) of trace t (its captured tensors ``tensors``) over [B, H, Q_LEN, KV_LEN]
    in qbs x kbs blocks, as torch tensors on ``device`` (NumPy arrays without torch).
    torch_ops: build into torch tensors and derive the q_ lists with torch (default: for a
    CUDA device; on the CPU, to test that route)."""
    target = _target(device)
    if torch_ops is None:
        torch_ops = target is not None
    where = target[0] if target is not None else "cpu"
    xp = _Torch(where) if torch_ops else _Host()
    nqb, nkb = -(-Q_LEN // qbs), -(-KV_LEN // kbs)
    # Without pairs (a length 0, which the library refuses) nothing is listed: zeros.
    new = xp.empty if nqb and nkb else xp.zeros
    kv = [new((B, H, nqb)), new((B, H, nqb, nkb))]
    full = [new((B, H, nqb)), new((B, H, nqb, nkb))] if separate_full else [None] * 2
    if nqb and nkb:
        _c_build(t, tensors, (B, H, Q_LEN, KV_LEN, qbs, kbs), kv + full, xp.kind, where,
                 target[1] if target is not None else None)
    fields = kv + full
    for num, idx in (kv, full):
        if num is None:
            fields += [None] * 2
            continue
        fields += list(xp.ordered(xp.dense(num, idx).swapaxes(-1, -2)))
    return [xp.export(f, device) for f in fields]
