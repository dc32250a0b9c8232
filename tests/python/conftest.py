"""pytest setup for the flashattn Python tests.

The package is imported from <repo>/python unless flashattn is already importable from
elsewhere (an installed copy) and FLASHATTN_TEST_INSTALLED=1 is set. The C library is found as
the package finds it ($FLASHATTN_LIBRARY, the package directory, <repo>/build/).

Random inputs: every test gets its own numpy Generator, seeded from the test's id and a base
seed that is fresh on every run (printed in the report header); set $FLASHATTN_TEST_SEED to that
value to reproduce a run.
"""

import os
import sys
import zlib

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# torch.compile's on-disk graph caches are keyed by the traced graph, not by the Python of an
# op's autograd formula: a cached graph from an earlier checkout would run instead of this one's.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

if os.environ.get("FLASHATTN_TEST_INSTALLED") != "1":
    sys.path.insert(0, os.path.join(REPO, "python"))
sys.path.insert(0, HERE)

BASE_SEED = int(os.environ.get("FLASHATTN_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))


def _test_seed(request):
    return zlib.crc32(request.node.nodeid.encode()) ^ BASE_SEED


@pytest.fixture
def rng(request):
    return np.random.default_rng(_test_seed(request))


@pytest.fixture(autouse=True)
def _seed_global_rngs(request):
    """Dropout seeds come from torch's / NumPy's global generators: seed them per test so that
    a run is reproducible (and varies with FLASHATTN_TEST_SEED)."""
    import torch

    seed = _test_seed(request)
    torch.manual_seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)


def pytest_report_header(config):
    try:
        import flashattn
        from flashattn import _lib

        return "FLASHATTN_TEST_SEED=%d; flashattn %s from %s, library %s (%s)" % (
            BASE_SEED, flashattn.__version__, os.path.dirname(flashattn.__file__), _lib.library_path(),
            _lib.cpu_description())
    except Exception as e:  # the tests will report it properly
        return "flashattn: %s" % e
