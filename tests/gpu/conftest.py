"""pytest setup for the Python GPU tests: the package from <repo>/python, and fresh random
inputs on every run. Each test that takes ``gen`` gets a torch.Generator seeded from its id and
a base seed drawn per run (printed in the report header); $FLASHATTN_TEST_SEED reproduces a
run."""

import os
import sys
import zlib

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

BASE_SEED = int(os.environ.get("FLASHATTN_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))


def pytest_report_header(config):
    return "FLASHATTN_TEST_SEED=%d" % BASE_SEED


@pytest.fixture
def gen(request):
    import torch

    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()) ^ BASE_SEED)
