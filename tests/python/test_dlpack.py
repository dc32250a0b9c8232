"""DLPack: the forward functions take any object with __dlpack__ and answer in its kind, through
torch.from_dlpack (torch imported) or numpy.from_dlpack (torch absent), without copying the
inputs."""

import os
import subprocess
import sys

import numpy as np
import torch

import flashattn
from flashattn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_varlen_func,
                       flash_attn_varlen_qkvpacked_func)


class OnlyDLPack:
    """The least a producer offers: the two DLPack methods and nothing else."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


class WithNamespace(OnlyDLPack):
    """A producer naming its array API namespace (here NumPy), whose from_dlpack the results
    come back through."""

    def __array_namespace__(self, api_version=None):
        return np


def _arrays(rng, *shapes, dtype=np.float32):
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def test_only_dlpack_objects_give_numpy_results(rng):
    q, k, v = _arrays(rng, (2, 6, 4, 16), (2, 9, 2, 16), (2, 9, 2, 16))
    sink = rng.standard_normal(4).astype(np.float32)
    want = flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    got = flash_attn_func(OnlyDLPack(q), OnlyDLPack(k), v=OnlyDLPack(v), causal=True,
                          learnable_sink=OnlyDLPack(sink))
    assert isinstance(got, np.ndarray) and np.array_equal(got, want)


def test_namespace_round_trip_with_probs(rng):
    q, k, v = _arrays(rng, (1, 5, 2, 8), (1, 7, 2, 8), (1, 7, 2, 8), dtype=np.float64)
    np.random.seed(11)
    torch.manual_seed(11)
    got = flash_attn_func(WithNamespace(q), WithNamespace(k), WithNamespace(v), dropout_p=0.2,
                          return_attn_probs=True)
    assert isinstance(got, tuple) and len(got) == 3
    assert all(isinstance(x, np.ndarray) for x in got)
    out, lse, S = got
    assert out.shape == (1, 5, 2, 8) and out.dtype == np.float64
    assert lse.shape == (1, 2, 5) and lse.dtype == np.float32
    assert S.shape == (1, 2, 128, 128)
    # the seed came from torch's generator (torch is imported): the torch call with the same
    # seed gives the same mask
    torch.manual_seed(11)
    t_out, _, t_S = flash_attn_func(*(torch.from_numpy(x) for x in (q, k, v)), dropout_p=0.2,
                                    return_attn_probs=True)
    assert np.array_equal(out, t_out.numpy()) and np.array_equal(S, t_S.numpy())


def test_inputs_are_not_copied(rng, monkeypatch):
    """The tensors reaching the op share the producer's buffers."""
    from flashattn import _torch_ops

    q, k = _arrays(rng, (1, 4, 2, 8), (1, 6, 2, 8))
    seen = []

    def spy(q_, k_, v_, *args, **kwargs):
        seen.extend(x.data_ptr() for x in (q_, k_, v_))
        return dense(q_, k_, v_, *args, **kwargs)

    dense = _torch_ops.dense
    monkeypatch.setattr(_torch_ops, "dense", spy)
    flash_attn_func(OnlyDLPack(q), OnlyDLPack(k), OnlyDLPack(k))
    assert seen == [x.__array_interface__["data"][0] for x in (q, k, k)]


def test_varlen_and_packed_forms(rng):
    cu = np.array([0, 3, 8], dtype=np.int32)
    qkv = _arrays(rng, (8, 3, 2, 8))[0]
    want = flash_attn_varlen_qkvpacked_func(qkv, cu, 5, causal=True)
    got = flash_attn_varlen_qkvpacked_func(OnlyDLPack(qkv), OnlyDLPack(cu), 5, causal=True)
    assert np.array_equal(got, want)
    q, k, v = _arrays(rng, (8, 2, 8), (8, 1, 8), (8, 1, 8))
    got = flash_attn_varlen_func(WithNamespace(q), k, v, cu, OnlyDLPack(cu), 5, 5)
    assert np.array_equal(got, flash_attn_varlen_func(q, k, v, cu, cu, 5, 5))
    q, kv = _arrays(rng, (2, 3, 4, 8), (2, 5, 2, 2, 8))
    got = flash_attn_kvpacked_func(OnlyDLPack(q), OnlyDLPack(kv), window_size=(1, 1))
    assert np.array_equal(got, flash_attn_kvpacked_func(q, kv, window_size=(1, 1)))


def test_numpy_round_trip_through_dlpack(rng):
    """Results re-imported with np.from_dlpack (and torch results exported through DLPack) are
    the same arrays."""
    q = _arrays(rng, (2, 5, 2, 8))[0]
    out = flash_attn_func(OnlyDLPack(q), OnlyDLPack(q), OnlyDLPack(q))
    again = np.from_dlpack(out)
    assert np.shares_memory(again, out)
    t_out = flash_attn_func(*(torch.from_numpy(q),) * 3)
    assert np.array_equal(np.from_dlpack(t_out), again)


def test_signatures_survive_the_wrapper():
    import inspect

    params = list(inspect.signature(flashattn.flash_attn_func).parameters)
    assert params[:3] == ["q", "k", "v"] and params[-1] == "learnable_sink"


def test_without_torch_numpy_from_dlpack(rng):
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import numpy as np, flashattn\n"
        "class W:\n"
        "    def __init__(self, a): self.a = a\n"
        "    def __dlpack__(self, **kw): return self.a.__dlpack__(**kw)\n"
        "    def __dlpack_device__(self): return self.a.__dlpack_device__()\n"
        "q = np.random.default_rng(0).standard_normal((1, 5, 2, 8))\n"
        "out = flashattn.flash_attn_func(W(q), W(q), W(q), causal=True)\n"
        "assert isinstance(out, np.ndarray)\n"
        "assert np.array_equal(out, flashattn.flash_attn_func(q, q, q, causal=True))\n"
        "print('ok')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(flashattn.__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
