"""Shared fixtures for the fp8train test suite.

Compilation: fp8train.quant runs its fused kernels through torch.compile for large tensors (FP8TRAIN_COMPILE=auto,
the default), always (1) or never (0). A compile costs seconds to tens of seconds on CPU per configuration, and eager mode gives the same bits, so tests run
eagerly by default. The default is set here, at import, before any test module imports fp8train (setdefault: a
caller who exports FP8TRAIN_COMPILE=1 runs the whole suite compiled). A test that must exercise the compiled
path takes the ``compiled`` fixture and carries the ``compiled`` marker (``pytest -m compiled`` runs just those,
``-m "not compiled"`` skips them).
"""

from __future__ import annotations

import os
import random

os.environ.setdefault("FP8TRAIN_COMPILE", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

SEED = 1234


def pytest_configure(config):
    config.addinivalue_line("markers", "compiled: runs fp8train's torch.compile path (FP8TRAIN_COMPILE=1); slow")


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test starts from the same RNG state, whatever ran before it."""
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    yield


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh, seeded numpy Generator (the preferred source of random test data)."""
    return np.random.default_rng(SEED)


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a module of small-tensor tests. On tensors of a few thousand elements an OpenMP
    parallel region costs more than the work, and on a loaded 2-core machine each one can take milliseconds;
    one thread runs the numerics tests several times faster. Use with
    ``pytestmark = pytest.mark.usefixtures("single_thread")``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def compiled(monkeypatch):
    """Opt in to fp8train's torch.compile path for one test (restored afterwards)."""
    monkeypatch.setenv("FP8TRAIN_COMPILE", "1")
    yield
