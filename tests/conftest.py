"""Shared fixtures for the fp8train test suite.

Compilation: fp8train.numerics.quant runs eagerly unless a caller asks for a compiled kernel (``kernel=`` on
quantize, ``fp8.quantize_kernel`` / ``train.compile`` in a config). A compile costs seconds to tens of seconds on
CPU per configuration, and every kernel gives the same bits, so tests run eagerly; a test that compiles carries
the ``compiled`` marker (``pytest -m compiled`` runs just those, ``-m "not compiled"`` skips them).
"""

from __future__ import annotations

import random

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

SEED = 1234


def pytest_configure(config):
    config.addinivalue_line("markers", "compiled: runs fp8train's torch.compile path; slow")


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


# A tiny FP8-trained run (current scaling, fp32 activations: bf16 GEMMs are slow on CPUs without bf16 hardware),
# trained once per session for the tests that read a finished run (export, kv-eval).
TINY_FP8_RUN = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.seq_len=64", "train.max_steps=30",
                "train.batch_size=4", "train.eval_every=30", "train.eval_batches=2", "train.lr=1e-2",
                "optim.warmup_steps=5", "log.wandb=disabled", "log.telemetry_every=0", "data.max_bytes=1000000",
                "fp8.recipe=current", "policy.min_features=16", "train.autocast=none"]


@pytest.fixture(scope="session")
def tiny_fp8_run(tmp_path_factory):
    from fp8train.training.config import load_config
    from fp8train.training.loop import train

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tiny_fp8_run")
    cfg = load_config(None, [f"run.dir={root}", "run.name=tiny", *TINY_FP8_RUN])
    assert train(cfg, show_progress=False)["status"] == "completed"
    torch.set_num_threads(previous)
    return root / "tiny"
