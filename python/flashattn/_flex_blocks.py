"""create_block_mask's evaluation: a traced mask_mod over every (query, key) pair, counted per
(query block, key block) and ordered into FlexAttention's BlockMask lists.

The same steps run on NumPy arrays on the host (CPU block masks) or on torch tensors on a CUDA
device (CUDA block masks are built there: only the captured tensors move), in fp32 as the
library's forward evaluates a program, aux indices floored and clamped into their tensors as it
reads them. Division, comparisons, floor, mod and where are exact on both; exp, log, tanh, sqrt
and pow take each side's fp32 functions, which may differ in the last place.
"""

import contextlib
import sys

from ._flex_call import _aux_tensor, _numpy


class _Host:
    """NumPy, on the host."""

    elements = 1 << 22  # mask elements an evaluation takes at a time

    def __init__(self):
        self.np = _numpy()
        self.f32 = self.np.float32

    def table(self, t):
        return t.numpy()

    def errstate(self):
        return self.np.errstate(all="ignore")

    def broadcast(self, x, shape):
        return self.np.broadcast_to(x, shape)

    def arange(self, a, b):
        return self.np.arange(a, b, dtype=self.f32)

    def const(self, x):
        return self.f32(x)

    def flag(self, x):
        return self.np.bool_(x)

    def aux(self, a, index):
        return a[tuple(index)].astype(self.f32)

    def index(self, v, dim):
        np = self.np
        return np.where(v >= 1, np.where(v < dim, v, dim - 1), 0).astype(np.int64)

    def where(self, c, x, y):
        return self.np.where(c, x, y)

    def unary(self, op, x):
        return getattr(self.np, op)(x)

    def fmod(self, x, y):
        return self.np.fmod(x, y)

    def counts(self, m, shape, nb, qbs, nkb, kbs):
        """The kept pairs of m (broadcast to shape [rb, rh, rows, KV]) per block: [rb, rh, nb,
        nkb]."""
        np = self.np
        padded = np.zeros(shape[:2] + (nb * qbs, nkb * kbs), dtype=bool)
        padded[:, :, :shape[2], :shape[3]] = np.broadcast_to(m, shape)
        return padded.reshape(shape[:2] + (nb, qbs, nkb, kbs)).sum((3, 5))

    def zeros(self, shape):
        return self.np.zeros(shape, dtype=self.np.int64)

    def ordered(self, dense):
        """FlexAttention's ordered form of a 0/1 block matrix [..., rows, cols]: the count per
        row and the column indices, those set first, each group ascending (a stable descending
        sort)."""
        np = self.np
        dense = dense.astype(np.int32)
        return (dense.sum(-1).astype(np.int32),
                np.argsort(-dense, axis=-1, kind="stable").astype(np.int32))

    def export(self, x, device):
        if x is None:
            return None
        x = self.np.ascontiguousarray(x)
        torch = sys.modules.get("torch")
        if torch is None:
            return x
        x = torch.from_numpy(x)
        return x if device is None or str(device) == "cpu" else x.to(device)


class _Device:
    """torch, on the block mask's (CUDA) device."""

    elements = 1 << 26

    def __init__(self, device):
        self.torch = sys.modules["torch"]
        self.device = self.torch.device(device)
        self.f32 = self.torch.float32

    def table(self, t):
        return t

    def errstate(self):
        return contextlib.nullcontext()

    def broadcast(self, x, shape):
        return x.expand(shape)

    def arange(self, a, b):
        return self.torch.arange(a, b, dtype=self.f32, device=self.device)

    def const(self, x):
        return self.torch.tensor(x, dtype=self.f32, device=self.device)

    def flag(self, x):
        return self.torch.tensor(bool(x), device=self.device)

    def aux(self, a, index):
        return a[tuple(index)].to(self.f32)

    def index(self, v, dim):
        torch = self.torch
        return torch.where(v >= 1, torch.clamp(v, max=dim - 1), 0).to(torch.int64)

    def where(self, c, x, y):
        return self.torch.where(c, x, y)

    def unary(self, op, x):
        return getattr(self.torch, op)(x)

    def fmod(self, x, y):
        return self.torch.fmod(x, y)

    def counts(self, m, shape, nb, qbs, nkb, kbs):
        torch = self.torch
        padded = torch.zeros(shape[:2] + (nb * qbs, nkb * kbs), dtype=torch.bool,
                             device=self.device)
        padded[:, :, :shape[2], :shape[3]] = torch.as_tensor(m, device=self.device).expand(
            shape)
        return padded.view(shape[:2] + (nb, qbs, nkb, kbs)).sum((3, 5))

    def zeros(self, shape):
        return self.torch.zeros(shape, dtype=self.torch.int64, device=self.device)

    def ordered(self, dense):
        torch = self.torch
        dense = dense.to(torch.int32)
        return (dense.sum(-1, dtype=torch.int32),
                torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32))

    def export(self, x, device):
        return None if x is None else x.contiguous()


def _mod(xp, x, y):
    r = xp.fmod(x, y)
    return xp.where((r != 0) & ((r < 0) != (y < 0)), r + y, r)


_OPS = {
    "neg": lambda xp, x: -x, "exp": lambda xp, x: xp.unary("exp", x),
    "log": lambda xp, x: xp.unary("log", x), "tanh": lambda xp, x: xp.unary("tanh", x),
    "abs": lambda xp, x: xp.unary("abs", x), "sqrt": lambda xp, x: xp.unary("sqrt", x),
    "floor": lambda xp, x: xp.unary("floor", x),
    "not": lambda xp, x: ~x, "add": lambda xp, x, y: x + y, "sub": lambda xp, x, y: x - y,
    "mul": lambda xp, x, y: x * y, "div": lambda xp, x, y: x / y,
    "min": lambda xp, x, y: xp.where((x < y) | (x != x), x, y),
    "max": lambda xp, x, y: xp.where((x > y) | (x != x), x, y),
    "pow": lambda xp, x, y: x ** y, "mod": _mod,
    "lt": lambda xp, x, y: x < y, "le": lambda xp, x, y: x <= y,
    "gt": lambda xp, x, y: x > y, "ge": lambda xp, x, y: x >= y,
    "eq": lambda xp, x, y: x == y, "ne": lambda xp, x, y: x != y,
    "and": lambda xp, x, y: x & y, "or": lambda xp, x, y: x | y,
    "where": lambda xp, c, x, y: xp.where(c, x, y),
}


def _evaluate(xp, t, arrays, B, H, r0, r1, KV):
    """The traced mask over b [B], h [H], q_idx [r0, r1), kv_idx [KV] (broadcast shapes)."""
    var = [None, xp.arange(0, B)[:, None, None, None], xp.arange(0, H)[None, :, None, None],
           xp.arange(r0, r1)[None, None, :, None], xp.arange(0, KV)[None, None, None, :]]
    g, vals = t.graph, {}
    for i in g.reachable(t.root):
        n = g.nodes[i]
        op = n[0]
        if op == "var":
            vals[i] = var[n[1]]
        elif op == "const":
            vals[i] = xp.const(float.fromhex(n[1]))
        elif op in ("true", "false"):
            vals[i] = xp.flag(op == "true")
        elif op == "aux":
            a = arrays[n[1]]
            vals[i] = xp.aux(a, [xp.index(vals[j], a.shape[d]) for d, j in enumerate(n[2:])])
        else:
            vals[i] = _OPS[op](xp, *[vals[j] for j in n[1:]])
    return vals[t.root]


def build(t, tensors, B, H, Q_LEN, KV_LEN, qbs, kbs, separate_full, device, on_device=None):
    """The BlockMask fields (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
    then the q_ ones) of trace t (its captured tensors ``tensors``) over [B, H, Q_LEN, KV_LEN]
    in qbs x kbs blocks, as torch tensors on ``device`` (NumPy arrays without torch).
    on_device: evaluate with torch on ``device`` (default: where it is a CUDA device)."""
    if on_device is None:
        on_device = device is not None and str(device).split(":")[0] == "cuda"
    xp = _Device(device) if on_device else _Host()
    arrays = [xp.table(_aux_tensor(x, "mask_mod", i, device if on_device else "cpu"))
              for i, x in enumerate(tensors)]
    nqb, nkb = -(-Q_LEN // qbs), -(-KV_LEN // kbs)
    rb, rh = (B if t.depends_b else 1), (H if t.depends_h else 1)
    counts = xp.zeros((rb, rh, nqb, nkb))
    # Query blocks per evaluation: about xp.elements mask elements at a time.
    step = max(1, xp.elements // max(1, rb * rh * qbs * nkb * kbs))
    with xp.errstate():
        for qb in range(0, nqb, step):
            nb = min(step, nqb - qb)
            r0, r1 = qb * qbs, min(Q_LEN, (qb + nb) * qbs)
            m = _evaluate(xp, t, arrays, B, H, r0, r1, KV_LEN)
            counts[:, :, qb:qb + nb] = xp.counts(m, (rb, rh, r1 - r0, KV_LEN), nb, qbs, nkb,
                                                 kbs)
    counts = xp.broadcast(counts, (B, H, nqb, nkb))
    if separate_full:
        full = counts == qbs * kbs
        partial = (counts > 0) & ~full
    else:
        full, partial = None, counts > 0
    fields = list(xp.ordered(partial)) + (list(xp.ordered(full)) if full is not None
                                          else [None] * 2)
    fields += list(xp.ordered(partial.swapaxes(-1, -2)))
    fields += list(xp.ordered(full.swapaxes(-1, -2))) if full is not None else [None] * 2
    return [xp.export(f, device) for f in fields]
