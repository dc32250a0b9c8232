"""ctypes binding of libflashattn (include/flashattn.h).

This module mirrors the public C structures field for field and declares every exported
function's signature. It knows nothing about torch or NumPy; ``_core`` turns arrays into
``FaTensor`` views.

The library is loaded lazily, on the first call that needs it, from (in order):

1. ``$FLASHATTN_LIBRARY`` (a path to the shared library),
2. the package directory (where ``pip install`` and ``make build`` put ``libflashattn.so``),
3. ``<repo>/build/`` (a source checkout built with ``make build``).
"""

import ctypes
import os
import sys
import threading

__all__ = [
    "FlashAttnError",
    "FaTensor",
    "FaFwdArgs",
    "FaBlockMaskArgs",
    "FA_MAX_DIMS",
    "FA_MAX_HEAD_DIM",
    "FA_CUDA_MAX_HEAD_DIM",
    "FA_CUDA_DECODE_MAX_HEAD_DIM",
    "FA_DEVICE_CPU",
    "DTYPE_F32",
    "DTYPE_F16",
    "DTYPE_BF16",
    "DTYPE_F64",
    "DTYPE_I32",
    "DTYPE_F8E4M3",
    "DTYPE_F8E5M2",
    "get_lib",
    "library_path",
    "forward",
    "dropout_keep",
    "probs_block_n",
    "version",
    "cpu_description",
    "cpu_default_threads",
    "dtype_name",
    "dtype_size",
]

# Kept in sync with FA_VERSION_* in include/flashattn.h; checked against fa_version() at load.
VERSION = "0.1.0"

FA_MAX_DIMS = 6
FA_MAX_HEAD_DIM = 576  # the CPU's; CUDA devices take up to FA_CUDA_MAX_HEAD_DIM
FA_CUDA_MAX_HEAD_DIM = 256
FA_CUDA_DECODE_MAX_HEAD_DIM = 576  # the decode schedule (KV cache, forwards without dropout)
FA_DEVICE_CPU = -1

# enum fa_dtype
DTYPE_F32 = 0
DTYPE_F16 = 1
DTYPE_BF16 = 2
DTYPE_F64 = 3
DTYPE_I32 = 4
DTYPE_F8E4M3 = 5
DTYPE_F8E5M2 = 6

# enum fa_status
STATUS_OK = 0
STATUS_INVALID_ARGUMENT = 1
STATUS_UNSUPPORTED = 2
STATUS_OUT_OF_MEMORY = 3
STATUS_INTERNAL = 4

_STATUS_NAMES = {
    STATUS_OK: "ok",
    STATUS_INVALID_ARGUMENT: "invalid argument",
    STATUS_UNSUPPORTED: "unsupported",
    STATUS_OUT_OF_MEMORY: "out of memory",
    STATUS_INTERNAL: "internal error",
}


class FlashAttnError(RuntimeError):
    """A flashattn call failed.

    A subclass of RuntimeError, like the errors upstream flash_attn raises from TORCH_CHECK.
    ``status`` is the C library's fa_status (None for errors detected in Python) and the
    message names the argument and the rule it broke.
    """

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


class FaTensor(ctypes.Structure):
    """struct fa_tensor."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int),  # enum fa_dtype
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * FA_MAX_DIMS),
        ("stride", ctypes.c_int64 * FA_MAX_DIMS),
    ]


_PT = ctypes.POINTER(FaTensor)


class FaBlockMask(ctypes.Structure):
    """struct fa_block_mask (FlexAttention's BlockMask layout)."""

    _fields_ = [
        ("q_block", ctypes.c_int64),
        ("kv_block", ctypes.c_int64),
        ("kv_num_blocks", _PT),
        ("kv_indices", _PT),
        ("full_kv_num_blocks", _PT),
        ("full_kv_indices", _PT),
    ]


class FaBlockMaskArgs(ctypes.Structure):
    """struct fa_block_mask_args (fa_block_mask_build: a block mask from a mask program)."""

    _fields_ = [
        ("mask_mod", ctypes.c_void_p),  # a finished FA_MOD_KIND_MASK fa_mod
        ("mod_aux", _PT * 4),
        ("b", ctypes.c_int64),
        ("h", ctypes.c_int64),
        ("sq", ctypes.c_int64),
        ("sk", ctypes.c_int64),
        ("q_block", ctypes.c_int64),
        ("kv_block", ctypes.c_int64),
        ("kv_num_blocks", _PT),
        ("kv_indices", _PT),
        ("full_kv_num_blocks", _PT),
        ("full_kv_indices", _PT),
        ("device", ctypes.c_int),
        ("stream", ctypes.c_void_p),
    ]


class FaFwdArgs(ctypes.Structure):
    """struct fa_fwd_args."""

    _fields_ = [
        ("q", _PT),
        ("k", _PT),
        ("v", _PT),
        ("out", _PT),
        ("lse", _PT),
        ("cu_seqlens_q", _PT),
        ("cu_seqlens_k", _PT),
        ("seqused_k", _PT),
        ("max_seqlen_q", ctypes.c_int64),
        ("max_seqlen_k", ctypes.c_int64),
        ("alibi_slopes", _PT),
        ("sinks", _PT),
        ("probs", _PT),
        ("softmax_scale", ctypes.c_double),
        ("causal", ctypes.c_int),
        ("window_left", ctypes.c_int),
        ("window_right", ctypes.c_int),
        ("softcap", ctypes.c_double),
        ("dropout_p", ctypes.c_double),
        ("seed", ctypes.c_uint64),
        ("offset", ctypes.c_uint64),
        ("device", ctypes.c_int),
        ("stream", ctypes.c_void_p),
        ("num_threads", ctypes.c_int),
        ("workspace", ctypes.c_void_p),
        ("workspace_size", ctypes.c_size_t),
        ("q_descale", _PT),
        ("k_descale", _PT),
        ("v_descale", _PT),
        # user-defined scoring (fa_mod): finished programs (flex._trace) and their aux tensors
        ("score_mod", ctypes.c_void_p),
        ("mask_mod", ctypes.c_void_p),
        ("mod_aux", _PT * 4),
        ("block_mask", ctypes.POINTER(FaBlockMask)),
        ("block_table", _PT),
    ]


class FaBwdArgs(ctypes.Structure):
    """struct fa_bwd_args."""

    _fields_ = [
        ("fwd", ctypes.POINTER(FaFwdArgs)),
        ("dout", _PT),
        ("dq", _PT),
        ("dk", _PT),
        ("dv", _PT),
        ("dsinks", _PT),
        ("deterministic", ctypes.c_int),
        ("workspace", ctypes.c_void_p),
        ("workspace_size", ctypes.c_size_t),
        ("mod_aux_grad", _PT * 4),
    ]


_LIB = None
_LIB_PATH = None
_LOCK = threading.Lock()


def _lib_names():
    if sys.platform == "darwin":
        return ["libflashattn.dylib", "libflashattn.so"]
    if sys.platform.startswith("win"):
        return ["flashattn.dll", "libflashattn.dll"]
    return ["libflashattn.so"]


def _candidates():
    env = os.environ.get("FLASHATTN_LIBRARY")
    if env:
        # An explicit choice is final: never fall back silently to another build.
        return [env], True
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))
    paths = [os.path.join(here, n) for n in _lib_names()]
    paths += [os.path.join(repo, "build", n) for n in _lib_names()]
    return paths, False


def _declare(lib):
    c = ctypes
    lib.fa_tensor_make.argtypes = [c.c_void_p, c.c_int, c.c_int, c.POINTER(c.c_int64),
                                   c.POINTER(c.c_int64)]
    lib.fa_tensor_make.restype = FaTensor
    lib.fa_fwd_args_init.argtypes = [c.POINTER(FaFwdArgs)]
    lib.fa_fwd_args_init.restype = None
    lib.fa_attention_forward.argtypes = [c.POINTER(FaFwdArgs)]
    lib.fa_attention_forward.restype = c.c_int
    lib.fa_bwd_args_init.argtypes = [c.POINTER(FaBwdArgs)]
    lib.fa_bwd_args_init.restype = None
    lib.fa_attention_backward.argtypes = [c.POINTER(FaBwdArgs)]
    lib.fa_attention_backward.restype = c.c_int
    lib.fa_attention_forward_workspace_size.argtypes = [c.POINTER(FaFwdArgs)]
    lib.fa_attention_forward_workspace_size.restype = c.c_size_t
    lib.fa_attention_backward_workspace_size.argtypes = [c.POINTER(FaBwdArgs)]
    lib.fa_attention_backward_workspace_size.restype = c.c_size_t
    lib.fa_attention_backward_prepare.argtypes = [c.POINTER(FaFwdArgs)]
    lib.fa_attention_backward_prepare.restype = c.c_int
    lib.fa_dropout_keep.argtypes = [c.c_uint64, c.c_uint64, c.c_int64, c.c_int64, c.c_int64,
                                    c.c_int64, c.c_int64, c.c_double]
    lib.fa_dropout_keep.restype = c.c_int
    lib.fa_probs_block_n.argtypes = [c.c_int, c.c_int, c.c_int]
    lib.fa_probs_block_n.restype = c.c_int
    lib.fa_last_error.argtypes = []
    lib.fa_last_error.restype = c.c_char_p
    lib.fa_status_string.argtypes = [c.c_int]
    lib.fa_status_string.restype = c.c_char_p
    lib.fa_dtype_name.argtypes = [c.c_int]
    lib.fa_dtype_name.restype = c.c_char_p
    lib.fa_dtype_size.argtypes = [c.c_int]
    lib.fa_dtype_size.restype = c.c_size_t
    for name in ("fa_fp8_from_f32", "fa_fp8_to_f32"):
        getattr(lib, name).argtypes = [c.c_int, c.c_void_p, c.c_void_p, c.c_size_t]
        getattr(lib, name).restype = c.c_int
    lib.fa_version.argtypes = []
    lib.fa_version.restype = c.c_char_p
    lib.fa_cpu_default_threads.argtypes = []
    lib.fa_cpu_default_threads.restype = c.c_int
    lib.fa_cpu_description.argtypes = []
    lib.fa_cpu_description.restype = c.c_char_p
    _declare_mod(lib)


def _declare_mod(lib):
    """The fa_mod builder (user-defined score_mod / mask_mod programs) and the block-mask
    builder that evaluates a mask program."""
    c = ctypes
    lib.fa_mod_create.argtypes = []
    lib.fa_mod_create.restype = c.c_void_p
    lib.fa_mod_destroy.argtypes = [c.c_void_p]
    lib.fa_mod_destroy.restype = None
    for name, n_ints in (("fa_mod_var", 1), ("fa_mod_unary", 2), ("fa_mod_binary", 3),
                         ("fa_mod_where", 3)):
        getattr(lib, name).argtypes = [c.c_void_p] + [c.c_int] * n_ints
        getattr(lib, name).restype = c.c_int
    lib.fa_mod_const.argtypes = [c.c_void_p, c.c_double]
    lib.fa_mod_const.restype = c.c_int
    lib.fa_mod_aux.argtypes = [c.c_void_p, c.c_int, c.c_int, c.POINTER(c.c_int)]
    lib.fa_mod_aux.restype = c.c_int
    lib.fa_mod_finish.argtypes = [c.c_void_p, c.c_int, c.c_int]
    lib.fa_mod_finish.restype = c.c_int
    lib.fa_mod_text.argtypes = [c.c_void_p]
    lib.fa_mod_text.restype = c.c_char_p
    lib.fa_block_mask_args_init.argtypes = [c.POINTER(FaBlockMaskArgs)]
    lib.fa_block_mask_args_init.restype = None
    lib.fa_block_mask_build.argtypes = [c.POINTER(FaBlockMaskArgs)]
    lib.fa_block_mask_build.restype = c.c_int


def get_lib():
    """The loaded library (a ctypes.CDLL), loading it on first use."""
    global _LIB, _LIB_PATH
    if _LIB is not None:
        return _LIB
    with _LOCK:
        if _LIB is not None:
            return _LIB
        paths, explicit = _candidates()
        errors = []
        for p in paths:
            if not explicit and not os.path.exists(p):
                errors.append("%s (not found)" % p)
                continue
            try:
                lib = ctypes.CDLL(p)
            except OSError as e:
                errors.append("%s (%s)" % (p, e))
                continue
            try:
                _declare(lib)
            except AttributeError as e:
                errors.append("%s (missing symbol: %s)" % (p, e))
                continue
            got = lib.fa_version().decode()
            if got != VERSION:
                errors.append("%s (version %s, this package expects %s)" % (p, got, VERSION))
                continue
            _LIB, _LIB_PATH = lib, p
            return lib
        raise ImportError(
            "flashattn: could not load the C library libflashattn. Tried:\n  "
            + "\n  ".join(errors)
            + "\nBuild it with `make build` (or `pip install .`), or point "
            "$FLASHATTN_LIBRARY at libflashattn.so."
        )


def library_path():
    """Path of the loaded library (loads it if needed)."""
    get_lib()
    return _LIB_PATH


def last_error():
    return get_lib().fa_last_error().decode(errors="replace")


def check(status, context=None):
    """Raise FlashAttnError carrying fa_last_error() when status is not FA_STATUS_OK."""
    if status == STATUS_OK:
        return
    msg = last_error() or _STATUS_NAMES.get(status, "status %d" % status)
    if context:
        msg = "%s: %s" % (context, msg)
    raise FlashAttnError(msg, status)


_FWD_DEFAULTS = []  # fa_fwd_args_init's bytes, taken once: copying them is cheaper than a call


def new_fwd_args():
    if not _FWD_DEFAULTS:
        args = FaFwdArgs()
        get_lib().fa_fwd_args_init(ctypes.byref(args))
        _FWD_DEFAULTS.append(bytes(args))
    return FaFwdArgs.from_buffer_copy(_FWD_DEFAULTS[0])


def forward(args, context=None):
    """fa_attention_forward(&args); raises FlashAttnError on failure.

    ctypes releases the GIL for the duration of the call.
    """
    status = get_lib().fa_attention_forward(ctypes.byref(args))
    check(status, context)


def attach_workspace(args, size_fn, keep):
    """Split workspace for a CUDA call: ``size_fn(byref(args))`` bytes (the library's size
    query) from torch's caching allocator, kept in ``keep`` and set into args' workspace
    fields; nothing on the CPU or for calls that need none."""
    if args.device < 0:
        return
    size = int(size_fn(ctypes.byref(args)))
    if size:
        torch = sys.modules["torch"]
        ws = torch.empty(size, dtype=torch.uint8, device="cuda:%d" % args.device)
        keep.append(ws)
        args.workspace = ws.data_ptr()
        args.workspace_size = size


def forward_workspace(args, keep):
    """A CUDA forward's split workspace (fa_attention_forward_workspace_size bytes)."""
    attach_workspace(args, get_lib().fa_attention_forward_workspace_size, keep)


def new_bwd_args():
    args = FaBwdArgs()
    get_lib().fa_bwd_args_init(ctypes.byref(args))
    return args


def backward_prepare(args, keep=None):
    """fa_attention_backward_prepare(&args): compiles (or finds cached) the CUDA kernels the
    backward of this forward will run; ctypes releases the GIL, so a thread can run it beside
    the forward's first call. keep: what args points to, held for the call. Failures are left
    for the backward to report."""
    get_lib().fa_attention_backward_prepare(ctypes.byref(args))
    del keep


def backward_workspace_size(args):
    """fa_attention_backward_workspace_size(&args): bytes of device workspace (0 on the CPU)."""
    return int(get_lib().fa_attention_backward_workspace_size(ctypes.byref(args)))


def backward(args, context=None):
    """fa_attention_backward(&args); raises FlashAttnError on failure."""
    status = get_lib().fa_attention_backward(ctypes.byref(args))
    check(status, context)


def new_block_mask_args():
    args = FaBlockMaskArgs()
    get_lib().fa_block_mask_args_init(ctypes.byref(args))
    return args


def block_mask_build(args, context=None):
    """fa_block_mask_build(&args); raises FlashAttnError on failure. ctypes releases the GIL
    for the duration of the call."""
    status = get_lib().fa_block_mask_build(ctypes.byref(args))
    check(status, context)


def dropout_keep(seed, offset, num_heads, batch, head, row, col, dropout_p):
    return bool(get_lib().fa_dropout_keep(seed, offset, num_heads, batch, head, row, col,
                                          dropout_p))


def probs_block_n(head_dim, dropout, causal):
    return int(get_lib().fa_probs_block_n(int(head_dim), int(bool(dropout)), int(bool(causal))))


def version():
    return get_lib().fa_version().decode()


def cpu_description():
    return get_lib().fa_cpu_description().decode(errors="replace")


def cpu_default_threads():
    return int(get_lib().fa_cpu_default_threads())


def dtype_name(dtype):
    return get_lib().fa_dtype_name(dtype).decode()


def dtype_size(dtype):
    return int(get_lib().fa_dtype_size(dtype))


def fp8_convert(name, dtype, src, dst, n):
    """fa_fp8_from_f32 / fa_fp8_to_f32 (``name``) over n elements at the addresses src and dst:
    the library's fp8 conversions, as torch converts."""
    check(getattr(get_lib(), name)(dtype, src, dst, n))
