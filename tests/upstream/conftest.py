"""Upstream FlashAttention's tests/test_flash_attn.py, unmodified, run against flashattn.

The copied file imports ``flash_attn`` and hard-codes CUDA; this file adapts it from outside:
- ``flash_attn`` resolves to flashattn through the package's opt-in alias;
- device: on a machine without CUDA, or with FLASHATTN_UPSTREAM_DEVICE=cpu, the module's
  ``torch`` is a proxy whose factory functions put ``device="cuda"`` tensors on the CPU and
  whose ``torch.cuda`` answers upstream's capability and memory queries for an sm90 device (the
  CPU backend supports everything sm90 does); on CUDA nothing is patched;
- cases that the CPU cannot give, and the intended differences listed in README.md's "Beyond
  and different from upstream", are skipped or xfailed (strict) with their reason;
- a deterministic sample of the parametrized cases: every case of the small tests (at most
  SMALL_TEST cases), and of each large one the FLASHATTN_UPSTREAM_CASES cases (default 30 on
  the CPU, 60 on CUDA) whose ids hash lowest, among those within FLASHATTN_UPSTREAM_MAX_WORK
  (the CPU's default leaves out the longest shapes). 'all' lifts either limit.
Run it in its own pytest process (make test-upstream): the alias must not reach other tests.
"""

import os
import sys
import types
import zlib

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
UPSTREAM_FILE = "test_flash_attn.py"

if os.environ.get("FLASHATTN_TEST_INSTALLED") != "1":
    sys.path.insert(0, os.path.join(REPO, "python"))

import torch  # noqa: E402

import flashattn  # noqa: E402

if not flashattn.install_alias():
    raise RuntimeError("an upstream flash_attn is importable; it would be tested instead of flashattn")

_requested = os.environ.get("FLASHATTN_UPSTREAM_DEVICE", "")
ON_CPU = _requested == "cpu" or (_requested == "" and not torch.cuda.is_available())
if _requested not in ("", "cpu", "cuda"):
    raise ValueError("FLASHATTN_UPSTREAM_DEVICE must be cpu or cuda, not %r" % _requested)
if _requested == "cuda" and not torch.cuda.is_available():
    raise RuntimeError("FLASHATTN_UPSTREAM_DEVICE=cuda but torch sees no CUDA device")


# ---------------------------------------------------------------- the CPU device proxy

def _cpu_device(device):
    """'cuda', 'cuda:N' or a CUDA torch.device -> 'cpu'; anything else unchanged."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.split(":")[0] == "cuda":
        return "cpu"
    return device


def _on_cpu(factory):
    def call(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    call.__name__ = factory.__name__
    return call


# Every torch function that upstream's file calls with a device (and the usual others).
_FACTORIES = ("arange", "empty", "full", "ones", "rand", "randint", "randn", "randperm",
              "tensor", "zeros", "zeros_like", "ones_like", "empty_like", "randn_like",
              "rand_like", "full_like", "linspace", "as_tensor")


class _CudaQueries(types.ModuleType):
    """torch.cuda as upstream's module-level and per-test queries see it on the CPU: an sm90
    device with the host's memory. Any other torch.cuda call is refused, so a test that needs
    the GPU itself fails loudly instead of running half on the CPU."""

    _ALLOWED = ("is_available",)

    def __init__(self):
        super().__init__("torch.cuda")

    @staticmethod
    def get_device_capability(device=None):
        return (9, 0)

    @staticmethod
    def get_device_properties(device=None):
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return types.SimpleNamespace(name="cpu", total_memory=pages, major=9, minor=0)

    def __getattr__(self, name):
        if name in self._ALLOWED:
            return getattr(torch.cuda, name)
        raise RuntimeError("torch.cuda.%s needs a CUDA device (the upstream tests run on CPU "
                           "tensors here)" % name)


class _TorchOnCpu(types.ModuleType):
    """The test module's ``torch``: torch itself, except the factories and torch.cuda."""

    def __init__(self):
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))
        self.cuda = _CudaQueries()

    def __getattr__(self, name):
        return getattr(torch, name)


_TORCH_PROXY = _TorchOnCpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_pycollect_makemodule(module_path, parent):
    # The upstream module's `import torch` binds sys.modules["torch"]: swap in the proxy for
    # the module's own execution only. flashattn and its helpers imported torch above, so
    # they keep the real module.
    outcome = yield
    if not ON_CPU or os.path.basename(str(module_path)) != UPSTREAM_FILE:
        return
    module = outcome.get_result()
    if module is None:
        return
    real_getobj = module._getobj

    def getobj():
        saved = sys.modules["torch"]
        sys.modules["torch"] = _TORCH_PROXY
        try:
            return real_getobj()
        finally:
            sys.modules["torch"] = saved

    module._getobj = getobj


# ---------------------------------------------------------------- the sample

def _env_count(name, default):
    """A positive count from the environment; 'all' (None) means no limit."""
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value == "all":
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError("%s must be a positive count or 'all', not %r" % (name, value))
    return int(value)


# Cases per test function; a test of at most SMALL_TEST cases runs whole.
SMALL_TEST = 64
CASES_PER_TEST = _env_count("FLASHATTN_UPSTREAM_CASES", 30 if ON_CPU else 60)
# Work bound per case, batch * heads * repeats * seqlen_q * seqlen_k * head dim: on the CPU the
# references of the longest cases take a minute each. Cases above it are left out of the sample;
# a test with none below it runs its cheapest case.
MAX_WORK = _env_count("FLASHATTN_UPSTREAM_MAX_WORK", 3 * 10**8 if ON_CPU else None)

# batch_size * nheads (* repeated calls) of each upstream test, as its body sets them.
_WORK_FACTOR = {
    "test_flash_attn_qkvpacked": 4 * 9,
    "test_flash_attn_varlen_qkvpacked": 5 * 6,
    "test_flash_attn_output": 4 * 6,
    "test_flash_attn_varlen_output": 4 * 6,
    "test_flash_attn_causal": 8 * 9,
    "test_flash_attn_varlen_causal": 8 * 9,
    "test_flash_attn_splitkv": 1 * 12,
    "test_flash_attn_kvcache": 2 * 6,
    "test_flash_attn_race_condition": 60 * 4 * 251,
    "test_flash_attn_deterministic": 4 * 9,
    "test_flash_attn_varlen_deterministic": 2 * 9,
}


# Tests whose every case is long even on a GPU: fewer cases of them.
_CASES_AT_MOST = {"test_flash_attn_race_condition": 6}


def _work(name, params):
    sq = params.get("seqlen_q", params.get("seqlen", 1))
    sk = params.get("seqlen_k", params.get("seqlen", 1))
    return _WORK_FACTOR.get(name, 36) * sq * sk * params.get("d", 128)


def _stable_rank(name, callspec_id):
    return zlib.crc32(("%s[%s]" % (name, callspec_id)).encode())


@pytest.hookimpl(hookwrapper=True)
def pytest_generate_tests(metafunc):
    # Filtering the parametrizations (pytest's Metafunc._calls, each with .id and .params)
    # before pytest makes an item of each keeps collection short: upstream's file has about
    # half a million cases.
    yield
    calls = metafunc._calls
    name = metafunc.function.__name__
    if len(calls) <= SMALL_TEST:
        return
    if MAX_WORK is not None and calls:
        work = [_work(name, c.params) for c in calls]
        within = [c for c, w in zip(calls, work) if w <= MAX_WORK]
        calls = within or [calls[work.index(min(work))]]
    cases = CASES_PER_TEST
    if cases is not None and name in _CASES_AT_MOST:
        cases = min(cases, _CASES_AT_MOST[name])
    if cases is not None and len(calls) > cases:
        rank = {id(c): _stable_rank(name, c.id) for c in calls}
        keep = set(sorted(rank.values())[:cases])
        calls = [c for c in calls if rank[id(c)] in keep]
    metafunc._calls = calls


def pytest_report_header(config):
    return "upstream tests on %s tensors: %s cases per test, work bound %s" % (
        "CPU" if ON_CPU else "CUDA", CASES_PER_TEST or "all", MAX_WORK or "none")


# ---------------------------------------------------------------- intended differences

# Cases whose dropout fraction misses upstream's tolerance (0.01 of dropout_p; 0.025 or 0.04
# with a window) by chance: the mask is ours (Philox over seed, offset, batch, head, row and
# column; README), so a given seed drops other elements than upstream's, and over the few
# thousand elements of a short case the fraction's spread is near the tolerance. Each is
# deterministic (upstream seeds every test); ids as pytest prints them, per device.
_DROPOUT_FRACTION_CASES = {
    "cpu": set(),
    "cuda": {
        "test_flash_attn_varlen_output[0.0-0.17-1-147-224-True-False-False-False-mha-dtype0-True]",
    },
}


def _xfail(raises, reason):
    return pytest.mark.xfail(strict=True, raises=raises, reason=reason)


def _difference(name, params, case_id):
    """A mark for a case that differs from upstream on purpose, or None: an xfail names the
    exception the difference raises, so that any other failure still fails."""
    if case_id in _DROPOUT_FRACTION_CASES["cpu" if ON_CPU else "cuda"]:
        return _xfail(AssertionError, "dropout mask: ours, not upstream's; this case's dropped "
                      "fraction misses upstream's tolerance by chance")
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if os.path.basename(str(item.path)) != UPSTREAM_FILE:
            continue
        params = item.callspec.params if hasattr(item, "callspec") else {}
        mark = _difference(item.originalname, params, item.name)
        if mark is not None:
            item.add_marker(mark)
