"""The forward and backward calls of the C library over prepared arrays (``_arrays``), and the
scalar arguments: their checks and conversions, written once.

``forward`` (``run_forward``, which also hands back what it prepared) is the last Python step
of every forward route: it validates what only Python can know (array kinds, devices, dtypes
that have no C counterpart, ranks needed to allocate outputs), converts and checks the scalars
(a default softmax scale goes to C as NaN, ``c_scale``), allocates the outputs, fills
an fa_fwd_args and calls ``fa_attention_forward``. Every other rule is checked by the C
library, whose message names the argument; ``forward`` renames the C argument names to the
caller's. ``backward`` / ``run_backward`` do the same for fa_attention_backward. ``_cached``
keeps what they prepared per call signature for the commonest torch calls.
"""

import ctypes
import operator
import re
import sys

from . import _lib
from ._arrays import (TORCH, cuda_target, dtype_code, empty, empty_f32, empty_out, make_tensor,
                      prepare, round_multiple, to_float32)
from ._lib import FlashAttnError

INT32 = (-2**31, 2**31 - 1)
INT64 = (-2**63, 2**63 - 1)
SEED64 = (-2**63, 2**64 - 1)  # int64 (an rng_state element) or uint64, taken modulo 2**64


def as_int(x, name, bounds=INT64):
    """x as a Python int within ``bounds`` (the C field's range: ctypes would wrap it)."""
    if type(x) is int and bounds[0] <= x <= bounds[1]:
        return x
    try:
        n = operator.index(x)
    except TypeError:
        raise TypeError("%s: expected an int, got %s" % (name, type(x).__name__)) from None
    if not bounds[0] <= n <= bounds[1]:
        raise FlashAttnError("%s: %d is out of range [%d, %d]" % (name, n, bounds[0], bounds[1]))
    return n


def as_float(x, name):
    """x as a Python float; strings are refused (float() would parse them)."""
    if type(x) is float:
        return x
    if not isinstance(x, (str, bytes, bytearray)):
        try:
            return float(x)
        except (TypeError, ValueError):
            pass
    raise TypeError("%s: expected a float, got %s" % (name, type(x).__name__))


def as_bool(x, name):
    """A flag: bools, ints (0 is False) and NumPy bools, as upstream's bindings take them."""
    if x is True or x is False:
        return x
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.bool_):
        return bool(x)
    try:
        return operator.index(x) != 0
    except TypeError:
        raise TypeError("%s: expected a bool, got %s" % (name, type(x).__name__)) from None


def as_scale(softmax_scale):
    """softmax_scale as a float, or None (the default). NaN is refused: the C library reads a
    NaN scale as "use the default", which the caller spells None."""
    if softmax_scale is None:
        return None
    scale = as_float(softmax_scale, "softmax_scale")
    if scale != scale:
        raise FlashAttnError("softmax_scale: must be finite, got nan (None selects the default, "
                             "1 / sqrt(head_dim))")
    return scale


def c_scale(softmax_scale):
    """softmax_scale as the C library takes it: None (the default) is NaN, which the library
    resolves with its one rule (kernels/fa_rules.h: head_dim ** -0.5, as upstream)."""
    scale = as_scale(softmax_scale)
    return float("nan") if scale is None else scale


_INT_MAX = 2**31 - 1


def window_pair(window_size):
    """(left, right) as C ints. Any negative value (or None, FA4's spelling) means unbounded,
    as upstream; a bound that does not fit an int is wider than any sequence, so unbounded too."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError("window_size: expected a pair (left, right), got %r"
                        % (window_size,)) from None
    if type(left) is int and type(right) is int:
        return (left if 0 <= left <= _INT_MAX else -1, right if 0 <= right <= _INT_MAX else -1)

    def one(w, side):
        if w is None:
            return -1
        w = as_int(w, "window_size[%d] (%s)" % (side, "left" if side == 0 else "right"))
        if w < 0 or w > _INT_MAX:
            return -1
        return w

    return one(left, 0), one(right, 1)


def _require_ndim(x, name, ndim, layout):
    if x.ndim != ndim:
        raise FlashAttnError("%s: expected %d dimensions %s, got shape %s"
                             % (name, ndim, layout, tuple(x.shape)))


def _rename(msg, names):
    """The C message starts with the C argument name; say it as the caller named it. Longer
    names (max_seqlen_q, cu_seqlens_k, ...) are renamed in the rest of the message too."""
    head, sep, rest = msg.partition(": ")
    if not sep:
        return msg
    for c_name, py_name in names.items():
        if len(c_name) > 1 and c_name != py_name:
            rest = re.sub(r"\b%s\b" % re.escape(c_name), py_name, rest)
    return names.get(head, head) + ": " + rest


_FWD_NAMES = {
    "sinks": "learnable_sink",
    "window_left": "window_size[0] (left)",
    "window_right": "window_size[1] (right)",
}


def _namer(names):
    """C argument name -> the caller's name, for error messages."""
    names = dict(_FWD_NAMES, **names) if names else _FWD_NAMES
    return lambda c_name: names.get(c_name, c_name), names


def _fwd_args(q, k, v, out, lse, probs, cu_q, cu_k, used_k, alibi, sinks, codes, kind, nm,
              varlen, max_seqlen_q, max_seqlen_k, window_size, dropout_p, softcap,
              softmax_scale, causal, seed, offset, num_threads, target=None, descales=(),
              block_table=None):
    """An FaFwdArgs for prepared arrays, and the FaTensor objects that must outlive the call.
    ``target``: (CUDA device, stream) from ``cuda_target``, or None for the CPU; ``descales``:
    the fp8 (q_descale, k_descale, v_descale), each prepared or None; ``block_table``: a paged
    varlen call's, prepared, or None."""
    left, right = window_pair(window_size)
    dropout_p = as_float(dropout_p, "dropout_p")
    softcap = as_float(softcap, "softcap")
    scale = c_scale(softmax_scale)

    keep = []  # FaTensor objects must outlive the call

    def ptr(x, c_name, code=None, expected=None):
        if x is None:
            return None
        t = make_tensor(x, nm(c_name), kind, code, expected)
        keep.append(t)
        return ctypes.pointer(t)

    args = _lib.new_fwd_args()
    args.q = ptr(q, "q", codes[0])
    args.k = ptr(k, "k", codes[1])
    args.v = ptr(v, "v", codes[2])
    args.out = ptr(out, "out")
    args.lse = ptr(lse, "lse")
    if varlen:
        args.cu_seqlens_q = ptr(cu_q, "cu_seqlens_q", expected="int32")
        args.cu_seqlens_k = ptr(cu_k, "cu_seqlens_k", expected="int32")
        args.max_seqlen_q = max_seqlen_q
        args.max_seqlen_k = max_seqlen_k
    if used_k is not None:
        args.seqused_k = ptr(used_k, "seqused_k", expected="int32")
    if block_table is not None:
        args.block_table = ptr(block_table, "block_table", expected="int32")
    if alibi is not None:
        args.alibi_slopes = ptr(alibi, "alibi_slopes", expected="float32")
    if sinks is not None:
        args.sinks = ptr(sinks, "sinks", expected="float32")
    if probs is not None:
        args.probs = ptr(probs, "probs")
    for name, x in zip(("q_descale", "k_descale", "v_descale"), descales):
        if x is not None:
            setattr(args, name, ptr(x, name, expected="float32"))
    args.softmax_scale = scale
    args.causal = 1 if as_bool(causal, "causal") else 0
    args.window_left = left
    args.window_right = right
    args.softcap = softcap
    args.dropout_p = dropout_p
    args.seed = as_int(seed, "seed", SEED64) & 0xFFFFFFFFFFFFFFFF
    args.offset = as_int(offset, "offset", SEED64) & 0xFFFFFFFFFFFFFFFF
    if target is not None:
        args.device, args.stream = target
    args.num_threads = as_int(num_threads, "num_threads", INT32)

    return args, keep


def forward(q, k, v, *, kind, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
            max_seqlen_q=0, max_seqlen_k=0, dropout_p=0.0, softmax_scale=None, causal=False,
            window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
            return_softmax=False, seed=0, offset=0, out=None, lse=None, probs=None,
            names=None, num_threads=0, q_descale=None, k_descale=None, v_descale=None,
            block_table=None):
    """One call of fa_attention_forward. Returns (out, lse, probs).

    q, k, v: arrays of ``kind`` (already checked to share it). In the varlen form
    (cu_seqlens_q given) lse is (h, total_q), otherwise (b, h, sq). probs is allocated as
    upstream's S_dmask, [b, h, round_up(sq, 128), round_up(sk, 128)] in q's dtype, when
    return_softmax is true, else None. out / lse / probs may be passed in (written in place).
    ``names`` maps the C argument names to the caller's names for error messages. fp8 q, k, v
    (out bf16 unless given) take the optional fp32 (b, h_k) descales. With block_table (int32
    (b, max_blocks), varlen only) k and v are pages (num_blocks, page_size, h_k, d), read in
    place.
    """
    return run_forward(
        q, k, v, kind, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, sinks,
        return_softmax, seed, offset, out, lse, probs, names, num_threads,
        descales=(q_descale, k_descale, v_descale), block_table=block_table)[3:6]


def run_forward(q, k, v, kind, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, sinks, return_softmax, seed, offset, out, lse, probs, names,
                num_threads, want_lse=True, descales=(), block_table=None):
    """``forward``'s call, returning what it prepared for ``_cached`` to keep: (args, the
    FaTensors it points to (q, k, v, out, lse first), the prepared inputs (copies among
    them), out, lse (None without ``want_lse``: the library writes none), probs or None,
    names)."""
    args, keep, arrays, out, lse, probs, names = _prepare_forward(
        q, k, v, kind, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, sinks,
        return_softmax, seed, offset, out, lse, probs, names, num_threads, descales,
        block_table)
    if not want_lse:
        args.lse = lse = None
    _lib.forward_workspace(args, keep)
    try:
        _lib.forward(args)
    except FlashAttnError as e:
        raise FlashAttnError(_rename(str(e), names), e.status) from None
    return args, keep, arrays, out, lse, probs, names


def _prepare_forward(q, k, v, kind, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                     alibi_slopes, sinks, return_softmax, seed, offset, out, lse, probs, names,
                     num_threads, descales=(), block_table=None):
    """``forward`` up to the call: (args, the FaTensors it points to (q, k, v, out, lse
    first), the prepared inputs (copies among them), out, lse, probs or None, names). The
    FaTensors and the prepared inputs must outlive the call."""
    nm, names = _namer(names)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    q = prepare(q, nm("q"), kind, cuda=True)
    k = prepare(k, nm("k"), kind, cuda=True)
    v = prepare(v, nm("v"), kind, cuda=True)
    qc = dtype_code(q, nm("q"), kind)
    kc = dtype_code(k, nm("k"), kind)
    vc = dtype_code(v, nm("v"), kind)

    # Ranks needed to allocate the outputs (C checks everything else).
    nd = 3 if varlen else 4
    nd_kv = 4 if block_table is not None else nd
    if q.ndim != nd or k.ndim != nd_kv or v.ndim != nd_kv:
        layout = ("[total_q, h, d]", "[total_k, hk, d]", "[total_k, hk, dv]") if varlen else (
            "[b, sq, h, d]", "[b, sk, hk, d]", "[b, sk, hk, dv]")
        if block_table is not None:
            layout = (layout[0], "[num_blocks, page_size, hk, d]",
                      "[num_blocks, page_size, hk, dv]")
        _require_ndim(q, nm("q"), nd, layout[0])
        _require_ndim(k, nm("k"), nd_kv, layout[1])
        _require_ndim(v, nm("v"), nd_kv, layout[2])

    cu_q = cu_k = alibi = None
    if varlen:
        cu_q = prepare(cu_seqlens_q, nm("cu_seqlens_q"), kind, cuda=True)
        cu_k = prepare(cu_seqlens_k, nm("cu_seqlens_k"), kind, cuda=True)
    used_k = prepare(seqused_k, nm("seqused_k"), kind, cuda=True)
    table = prepare(block_table, nm("block_table"), kind, cuda=True)
    if alibi_slopes is not None:
        alibi = prepare(alibi_slopes, nm("alibi_slopes"), kind, cuda=True)
    if sinks is not None:
        sinks = prepare(to_float32(sinks, nm("sinks"), kind), nm("sinks"), kind, cuda=True)
    descales = tuple(prepare(x, n, kind, cuda=True) for x, n in
                     zip(descales, ("q_descale", "k_descale", "v_descale")))

    if varlen:
        if cu_q is None or cu_k is None:
            missing = "cu_seqlens_k" if cu_q is not None else "cu_seqlens_q"
            raise FlashAttnError("%s: the varlen form needs both cu_seqlens_q and cu_seqlens_k"
                                 % nm(missing))
        _require_ndim(cu_q, nm("cu_seqlens_q"), 1, "[b + 1]")
        max_seqlen_q = as_int(max_seqlen_q, nm("max_seqlen_q"))
        max_seqlen_k = as_int(max_seqlen_k, nm("max_seqlen_k"))
        b = max(int(cu_q.shape[0]) - 1, 0)
        total_q, h = int(q.shape[0]), int(q.shape[1])
        out_shape = (total_q, h, int(v.shape[-1]))
        lse_shape = (h, total_q)
        sq, sk = max(max_seqlen_q, 0), max(max_seqlen_k, 0)
    else:
        b, sq, h = int(q.shape[0]), int(q.shape[1]), int(q.shape[2])
        sk = int(k.shape[1])
        out_shape = (b, sq, h, int(v.shape[3]))
        lse_shape = (b, h, sq)

    target = None
    if kind == TORCH:
        target = cuda_target([(nm("q"), q), (nm("k"), k), (nm("v"), v),
                              (nm("cu_seqlens_q"), cu_q), (nm("cu_seqlens_k"), cu_k),
                              (nm("seqused_k"), used_k), (nm("block_table"), table),
                              (nm("alibi_slopes"), alibi),
                              (nm("sinks"), sinks), ("out", out), ("lse", lse),
                              ("probs", probs)] + list(zip(("q_descale", "k_descale",
                                                            "v_descale"), descales)))
    if out is None:
        out = empty_out(kind, out_shape, q)
    if lse is None:
        lse = empty_f32(kind, lse_shape, q)
    if not return_softmax:
        probs = None
    elif probs is None:
        probs = empty(kind, (b, h, round_multiple(sq, 128), round_multiple(sk, 128)), q)

    args, keep = _fwd_args(q, k, v, out, lse, probs, cu_q, cu_k, used_k, alibi, sinks,
                           (qc, kc, vc), kind, nm, varlen, max_seqlen_q, max_seqlen_k,
                           window_size, dropout_p, softcap, softmax_scale, causal, seed, offset,
                           num_threads, target, descales, table)
    return (args, keep, (q, k, v, cu_q, cu_k, used_k, alibi, sinks) + descales + (table,), out,
            lse, probs, names)


def backward(dout, q, k, v, out, lse, *, kind, cu_seqlens_q=None, cu_seqlens_k=None,
             seqused_k=None, max_seqlen_q=0, max_seqlen_k=0, dropout_p=0.0, softmax_scale=None,
             causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
             seed=0, offset=0, deterministic=False, names=None, num_threads=0, dq=None,
             dk=None, dv=None):
    """One call of fa_attention_backward with the forward's inputs, out and lse.

    Returns (dq, dk, dv, dsinks): arrays shaped like q, k, v (new ones unless given, then
    written in place), and fp32 [h] for the sinks (None without sinks). The CPU result is
    bitwise reproducible whatever ``deterministic`` says.
    """
    return run_backward(
        dout, q, k, v, out, lse, kind, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
        max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        sinks, seed, offset, deterministic, names, num_threads, dq, dk, dv)[3]


def run_backward(dout, q, k, v, out, lse, kind, cu_seqlens_q, cu_seqlens_k, seqused_k,
                 max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                 softcap, alibi_slopes, sinks, seed, offset, deterministic, names, num_threads,
                 dq, dk, dv):
    """``backward``'s call, returning what it prepared for ``_cached`` to keep: (bwd args,
    the FaTensors they point to, the prepared inputs, (dq, dk, dv, dsinks), names, the CUDA
    workspace or None), as ``_prepare_backward`` describes them."""
    prepared = _prepare_backward(
        dout, q, k, v, out, lse, kind, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
        max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        sinks, seed, offset, deterministic, names, num_threads, dq, dk, dv)
    try:
        _lib.backward(prepared[0])
    except FlashAttnError as e:
        raise FlashAttnError(_rename(str(e), prepared[4]), e.status) from None
    return prepared


def _prepare_backward(dout, q, k, v, out, lse, kind, cu_seqlens_q, cu_seqlens_k, seqused_k,
                      max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, sinks, seed, offset, deterministic, names,
                      num_threads, dq, dk, dv):
    """``backward`` up to the call: (bwd args, the FaTensors they point to (the forward's q, k,
    v, out, lse first, then dout, dq, dk, dv, dsinks), the prepared inputs (dout, q, k, v,
    out, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, sinks; copies among them),
    (dq, dk, dv, dsinks), names, the CUDA workspace or None). What it returns must outlive the
    call: the FaTensors only point into the arrays."""
    nm, names = _namer(names)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    q = prepare(q, nm("q"), kind, cuda=True)
    k = prepare(k, nm("k"), kind, cuda=True)
    v = prepare(v, nm("v"), kind, cuda=True)
    out = prepare(out, nm("out"), kind, cuda=True)
    dout = prepare(dout, nm("dout"), kind, cuda=True)
    codes = (dtype_code(q, nm("q"), kind), dtype_code(k, nm("k"), kind),
             dtype_code(v, nm("v"), kind))
    cu_q = prepare(cu_seqlens_q, nm("cu_seqlens_q"), kind, cuda=True)
    cu_k = prepare(cu_seqlens_k, nm("cu_seqlens_k"), kind, cuda=True)
    used_k = prepare(seqused_k, nm("seqused_k"), kind, cuda=True)
    alibi = prepare(alibi_slopes, nm("alibi_slopes"), kind, cuda=True)
    sinks = prepare(to_float32(sinks, nm("sinks"), kind), nm("sinks"), kind, cuda=True)
    target = None
    if kind == TORCH:
        target = cuda_target([(nm("q"), q), (nm("k"), k), (nm("v"), v), ("out", out),
                              ("dout", dout), ("lse", lse), (nm("cu_seqlens_q"), cu_q),
                              (nm("cu_seqlens_k"), cu_k), (nm("seqused_k"), used_k),
                              (nm("alibi_slopes"), alibi), (nm("sinks"), sinks), ("dq", dq),
                              ("dk", dk), ("dv", dv)])

    if dq is None:
        dq = empty(kind, tuple(q.shape), q)
    if dk is None:
        dk = empty(kind, tuple(k.shape), k)
    if dv is None:
        dv = empty(kind, tuple(v.shape), v)
    dsinks = empty_f32(kind, (int(q.shape[-2]),), q) if sinks is not None else None

    args, keep = _fwd_args(q, k, v, out, lse, None, cu_q, cu_k, used_k, alibi, sinks, codes,
                           kind, nm, varlen, max_seqlen_q, max_seqlen_k, window_size, dropout_p,
                           softcap, softmax_scale, causal, seed, offset, num_threads, target)
    bwd = _lib.new_bwd_args()
    grads = [make_tensor(x, nm(n), kind) if x is not None else None
             for x, n in ((dout, "dout"), (dq, "dq"), (dk, "dk"), (dv, "dv"),
                          (dsinks, "dsinks"))]
    keep.extend(grads)
    bwd.fwd = ctypes.pointer(args)
    bwd.dout, bwd.dq, bwd.dk, bwd.dv, bwd.dsinks = (
        ctypes.pointer(g) if g is not None else None for g in grads)
    bwd.deterministic = 1 if as_bool(deterministic, "deterministic") else 0
    workspace = None
    if target is not None:
        # The CUDA backward allocates nothing itself: its dQ accumulator comes from torch's
        # allocator (aligned to 512 bytes, and stream-ordered with the caller's work).
        size = _lib.backward_workspace_size(bwd)
        workspace = sys.modules["torch"].empty(max(size, 1), dtype=sys.modules["torch"].uint8,
                                               device=q.device)
        bwd.workspace = workspace.data_ptr()
        bwd.workspace_size = size
    return (bwd, keep, (dout, q, k, v, out, cu_q, cu_k, used_k, alibi, sinks),
            (dq, dk, dv, dsinks), names, workspace)
