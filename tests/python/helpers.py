"""Shared helpers: inputs of each kind/dtype, conversions and accuracy criteria."""

import os
import subprocess
import sys

import numpy as np
import torch

KINDS = ["torch", "numpy"]

try:  # NumPy has no bf16; ml_dtypes provides one (optional)
    import ml_dtypes

    NP_BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    NP_BF16 = None

DTYPES = ["float32", "float64", "float16", "bfloat16"]

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64,
                "float16": torch.float16, "bfloat16": torch.bfloat16}


def kind_dtypes():
    """(kind, dtype) pairs this environment can express."""
    out = []
    for kind in KINDS:
        for dt in DTYPES:
            if kind == "numpy" and dt == "bfloat16" and NP_BF16 is None:
                continue
            out.append((kind, dt))
    return out


def np_dtype(dt):
    if dt == "bfloat16":
        return NP_BF16
    return np.dtype(dt)


def rounded(x64, dt):
    """x64 rounded to dtype dt, returned as float64 (what the library actually sees)."""
    return torch.from_numpy(np.ascontiguousarray(x64)).to(TORCH_DTYPES[dt]).double().numpy()


def make(x64, dt, kind):
    """An array of the given kind and dtype holding x64 rounded to dt."""
    t = torch.from_numpy(np.ascontiguousarray(x64)).to(TORCH_DTYPES[dt])
    if kind == "torch":
        return t
    if dt == "bfloat16":
        return t.float().numpy().astype(NP_BF16)
    return t.numpy()


def make_int32(x, kind):
    a = np.asarray(x, dtype=np.int32)
    return torch.from_numpy(a.copy()) if kind == "torch" else a.copy()


def make_f32(x, kind):
    a = np.asarray(x, dtype=np.float32)
    return torch.from_numpy(a.copy()) if kind == "torch" else a.copy()


def to64(x):
    """Any result (torch or NumPy, any dtype) as a float64 NumPy array."""
    if isinstance(x, torch.Tensor):
        return x.detach().double().numpy()
    if NP_BF16 is not None and x.dtype == NP_BF16:
        return x.astype(np.float64)
    return np.asarray(x, dtype=np.float64)


def is_kind(x, kind):
    return isinstance(x, torch.Tensor) if kind == "torch" else isinstance(x, np.ndarray)


def dtype_name(x):
    if isinstance(x, torch.Tensor):
        return {v: k for k, v in TORCH_DTYPES.items()}.get(x.dtype, str(x.dtype))
    if NP_BF16 is not None and x.dtype == NP_BF16:
        return "bfloat16"
    return str(x.dtype)


def randn(rng, *shape, scale=1.0):
    return rng.standard_normal(shape) * scale


EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23,
       "float64": 2.0 ** -52}


def max_err(a, b):
    a, b = to64(a), to64(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.size == 0:
        return 0.0
    fin = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), fin), "non-finite entries differ"
    assert np.array_equal(a[~fin], b[~fin]), "infinite entries differ"
    if not fin.any():
        return 0.0
    return float(np.abs(a[fin] - b[fin]).max())


def assert_close_hi(got, ref, dt, what="out"):
    """fp32 / fp64: error relative to the magnitude of the reference."""
    ref = to64(ref)
    err = max_err(got, ref)
    mag = max(1.0, float(np.abs(ref[np.isfinite(ref)]).max())) if np.isfinite(ref).any() else 1.0
    tol = (2e-5 if dt == "float32" else 1e-11) * mag
    assert err <= tol, "%s: max error %.3g > %.3g (%s)" % (what, err, tol, dt)


def assert_close_lowp(got, ref, naive, dt, what="out"):
    """fp16 / bf16, upstream's criterion: error <= 2x the same-dtype naive attention's error,
    plus one ulp at the output's magnitude as a floor (for cases where naive is exact)."""
    ref = to64(ref)
    err = max_err(got, ref)
    err_naive = max_err(naive, ref)
    mag = float(np.abs(ref).max()) if ref.size else 0.0
    tol = 2 * err_naive + EPS[dt] * mag
    assert err <= tol, "%s: max error %.3g > 2 * naive %.3g + floor (%s)" % (
        what, err, err_naive, dt)


def assert_lse(got, ref, dt):
    """lse is fp32: computed in fp32 from the (rounded) inputs, or in fp64 and then rounded to
    fp32 for fp64 inputs (one fp32 ulp)."""
    ref = to64(ref)
    err = max_err(got, ref)
    fin = np.isfinite(ref)
    mag = max(1.0, float(np.abs(ref[fin]).max())) if fin.any() else 1.0
    tol = (2.0 ** -23 if dt == "float64" else 1e-5) * mag
    assert err <= tol, "lse: max error %.3g > %.3g (%s)" % (err, tol, dt)


def run_python(code, *argv):
    """``python -c code *argv`` in a fresh interpreter that imports the flashattn under test:
    the CompletedProcess, output as text."""
    import flashattn

    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(flashattn.__file__)))
    return subprocess.run([sys.executable, "-c", code] + list(argv), capture_output=True,
                          text=True, env=env, timeout=300)
