"""The package surface: names, signatures, version, optional dependencies, library loading,
autograd placeholder, outputs written in full, thread safety."""

import inspect
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import flashattn
from flashattn import _core, _lib, flash_attn_func, flash_attn_varlen_func
from helpers import assert_close_hi, randn, to64
from reference import attention_ref

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
          ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
          ("deterministic", False), ("return_attn_probs", False)]
UPSTREAM = {
    "flash_attn_qkvpacked_func": ["qkv"] + COMMON,
    "flash_attn_kvpacked_func": ["q", "kv"] + COMMON,
    "flash_attn_func": ["q", "k", "v"] + COMMON,
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen"] + COMMON,
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k",
                                        "max_seqlen_q", "max_seqlen_k"] + COMMON,
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                               "max_seqlen_k"] + COMMON + [("block_table", None)],
}


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_signature_is_upstreams(name):
    sig = inspect.signature(getattr(flashattn, name))
    params = list(sig.parameters.values())
    want = UPSTREAM[name]
    for p, w in zip(params, want):
        wname, wdefault = (w, inspect.Parameter.empty) if isinstance(w, str) else w
        assert p.name == wname and p.default == wdefault, (p, w)
        assert p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
    extra = params[len(want):]
    assert [(p.name, p.kind, p.default) for p in extra] == [
        ("learnable_sink", inspect.Parameter.KEYWORD_ONLY, None)]


def test_exports_and_version():
    for name in UPSTREAM:
        assert name in flashattn.__all__
        assert getattr(flashattn, name) is getattr(flashattn.flash_attn_interface, name)
    assert flashattn.__version__ == "0.1.0" == _lib.version()
    assert issubclass(flashattn.FlashAttnError, RuntimeError)
    assert os.path.isfile(_lib.library_path())
    assert _lib.cpu_default_threads() >= 1 and _lib.cpu_description()


def _run_py(code, env_extra=None):
    env = dict(os.environ)
    # The same flashattn the tests import (the source tree or an installed copy).
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(flashattn.__file__)))
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)


def test_import_without_torch():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # makes 'import torch' fail\n"
        "import numpy as np, flashattn\n"
        "q = np.random.default_rng(0).standard_normal((1, 5, 2, 8)).astype(np.float32)\n"
        "out = flashattn.flash_attn_func(q, q, q, causal=True, dropout_p=0.1)\n"
        "assert isinstance(out, np.ndarray) and out.shape == (1, 5, 2, 8)\n"
        "print('ok')\n")
    r = _run_py(code)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_import_without_numpy_or_torch():
    r = _run_py("import sys\nsys.modules['torch'] = None\nsys.modules['numpy'] = None\n"
                "import flashattn\nprint(flashattn.__version__)\n")
    assert r.returncode == 0 and r.stdout.strip() == "0.1.0", r.stderr


def test_import_does_not_load_torch_or_library():
    r = _run_py("import sys, flashattn\n"
                "print('torch' in sys.modules, flashattn._lib._LIB is None)\n")
    assert r.returncode == 0 and r.stdout.split() == ["False", "True"], r.stderr


def test_library_not_found_message():
    r = _run_py("import numpy as np, flashattn\n"
                "q = np.ones((1, 2, 1, 8))\n"
                "try:\n"
                "    flashattn.flash_attn_func(q, q, q)\n"
                "except ImportError as e:\n"
                "    print('ImportError', e)\n",
                {"FLASHATTN_LIBRARY": "/nonexistent/libflashattn.so"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ImportError") and "/nonexistent/libflashattn.so" in r.stdout
    assert "FLASHATTN_LIBRARY" in r.stdout


def test_library_from_env():
    path = _lib.library_path()
    r = _run_py("from flashattn import _lib\nprint(_lib.library_path())\n",
                {"FLASHATTN_LIBRARY": path})
    assert r.returncode == 0 and r.stdout.strip() == path, r.stderr


def test_structs_match_header():
    """Field order and types of the ctypes mirrors, as include/flashattn.h declares them."""
    import ctypes

    with open(os.path.join(REPO, "include", "flashattn.h")) as f:
        header = f.read()
    assert "#define FA_MAX_DIMS %d" % _lib.FA_MAX_DIMS in header
    version = tuple(int(x) for x in _lib.VERSION.split("."))
    for part, val in zip(("MAJOR", "MINOR", "PATCH"), version):
        assert "#define FA_VERSION_%s %d" % (part, val) in header
    for name in ("F32", "F16", "BF16", "F64", "I32"):
        assert "FA_DTYPE_%s = %d," % (name, getattr(_lib, "DTYPE_" + name)) in header
    body = header[header.index("typedef struct fa_fwd_args {"):]
    body = body[:body.index("} fa_fwd_args;")]
    c_fields = []
    for line in body.splitlines()[1:]:
        line = line.split("/*")[0].strip()
        if line:
            c_fields.append(line.rstrip(";").split()[-1].lstrip("*").split("[")[0])
    assert [f[0] for f in _lib.FaFwdArgs._fields_] == c_fields
    body = header[header.index("typedef struct fa_bwd_args {"):]
    body = body[:body.index("} fa_bwd_args;")]
    c_fields = [line.split("/*")[0].strip().rstrip(";").split()[-1].lstrip("*").split("[")[0]
                for line in body.splitlines()[1:] if line.split("/*")[0].strip()]
    assert [f[0] for f in _lib.FaBwdArgs._fields_] == c_fields
    # fa_block_mask_args declares several fields a line ("int64_t b, h, sq, sk;")
    body = header[header.index("typedef struct fa_block_mask_args {"):]
    body = body[:body.index("} fa_block_mask_args;")]
    c_fields = []
    for line in body.splitlines()[1:]:
        decl = line.split("/*")[0].strip().rstrip(";")
        if decl:
            names = decl.split(",")
            names[0] = names[0].split()[-1]
            c_fields += [n.strip().lstrip("*").split("[")[0] for n in names]
    assert [f[0] for f in _lib.FaBlockMaskArgs._fields_] == c_fields
    assert ctypes.sizeof(_lib.FaBlockMaskArgs) == 8 + 8 * 4 + 8 * 6 + 8 * 4 + 8 + 8
    body = header[header.index("typedef struct fa_tensor {"):]
    body = body[:body.index("} fa_tensor;")]
    assert [f[0] for f in _lib.FaTensor._fields_] == ["data", "dtype", "ndim", "shape",
                                                      "stride"]
    assert ctypes.sizeof(_lib.FaTensor) == 8 + 4 + 4 + 8 * 6 * 2
    # fa_tensor_make round trip through the C library.
    shape = (ctypes.c_int64 * 3)(2, 3, 4)
    t = _lib.get_lib().fa_tensor_make(None, _lib.DTYPE_F16, 3, shape, None)
    assert t.ndim == 3 and t.dtype == _lib.DTYPE_F16
    assert list(t.shape[:3]) == [2, 3, 4] and list(t.stride[:3]) == [12, 4, 1]
    assert _lib.dtype_name(_lib.DTYPE_BF16) and _lib.dtype_size(_lib.DTYPE_F64) == 8
    # fa_fwd_args_init's defaults, read back through the mirror.
    a = _lib.new_fwd_args()
    assert np.isnan(a.softmax_scale) and (a.window_left, a.window_right) == (-1, -1)
    assert a.device == _lib.FA_DEVICE_CPU and not a.q and a.num_threads == 0


def test_outputs_fully_written(rng):
    """Poisoned out / lse / probs buffers: every element is written (padding of probs is 0)."""
    b, sq, sk, h, d = 2, 19, 45, 3, 16
    q, k, v = (np.ascontiguousarray(randn(rng, b, n, h, d)) for n in (sq, sk, sk))
    out = np.full((b, sq, h, d), np.nan)
    lse = np.full((b, h, sq), np.nan, dtype=np.float32)
    probs = np.full((b, h, 128, 128), np.nan)
    _core.forward(q, k, v, kind="numpy", dropout_p=0.2, causal=True, return_softmax=True,
                  seed=5, out=out, lse=lse, probs=probs)
    assert not np.isnan(out).any() and not np.isnan(lse).any() and not np.isnan(probs).any()
    assert np.all(probs[:, :, sq:] == 0) and np.all(probs[:, :, :, sk:] == 0)
    # varlen: rows outside every sequence are written too.
    qv = np.ascontiguousarray(randn(rng, 12, h, d))
    cu = np.array([0, 3, 8], dtype=np.int32)
    out = np.full((12, h, d), np.nan)
    lse = np.full((h, 12), np.nan, dtype=np.float32)
    _core.forward(qv, qv, qv, kind="numpy", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5,
                  max_seqlen_k=5, out=out, lse=lse)
    assert np.all(out[8:] == 0) and np.all(lse[:, 8:] == np.inf) and not np.isnan(out).any()


def test_concurrent_calls_from_threads(rng):
    """ctypes releases the GIL: calls from several Python threads run side by side and each gets
    its own right answer (and its own error message)."""
    inputs = [tuple(torch.from_numpy(randn(rng, 2, 40, 4, 32)).float() for _ in range(3))
              for _ in range(6)]
    want = [flash_attn_func(*x, causal=True) for x in inputs]
    got, errors = [None] * 6, []

    def work(i):
        try:
            for _ in range(5):
                got[i] = flash_attn_func(*inputs[i], causal=True)
                if i % 2:
                    try:
                        flash_attn_func(inputs[i][0], inputs[i][1][:1], inputs[i][2])
                    except flashattn.FlashAttnError as e:
                        assert str(e).startswith("k: dimension 0")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for g, w in zip(got, want):
        assert torch.equal(g, w)
