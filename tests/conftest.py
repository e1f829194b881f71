"""Shared fixtures for the fp8train test suite.

Compilation: fp8train.numerics.quant runs eagerly unless a caller asks for a compiled kernel (``kernel=`` on
quantize, ``fp8.quantize_kernel`` / ``train.compile`` in a config). A compile costs seconds to tens of seconds on
CPU per configuration, and every kernel gives the same bits, so tests run eagerly; a test that compiles carries
the ``compiled`` marker (``pytest -m compiled`` runs just those, ``-m "not compiled"`` skips them).
"""

from __future__ import annotations

import copy
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

# The suite runs in 2 pytest-xdist workers on 2 cores (README's test command): one intra-op thread each, or
# the two OpenMP pools would oversubscribe the cores. Run alone (plain `pytest`), a test process gets both.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

SEED = 1234


def pytest_addoption(parser):
    # Every CPU code path on any CPU (README, "Testing"): CI runs the numerics, nn and GEMM tests once per setting.
    group = parser.getgroup("fp8train", "fp8train's CPU code paths")
    group.addoption("--emulated-auto", choices=("cpu", "bf16", "fp32"), default="cpu",
                    help="what fp8.emulated_dtype 'auto' resolves to on CPU in the test processes: as this CPU's "
                         "flags say (cpu, the default), or forced (fp8train.nn.gemm.set_cpu_bf16_gemm)")
    group.addoption("--native-cast", choices=("on", "off"), default="on",
                    help="off: every quantize runs its eager kernel, as on a machine without a C compiler "
                         "(fp8train.numerics.native_cast.set_enabled)")
    group.addoption("--native-gemm", choices=("auto", "on", "off"), default="auto",
                    help="fp8train's native bf16 -> fp32 GEMM under bf16 emulation: where its AVX512-BF16 loop is "
                         "built (auto), wherever the library builds (on: the plain C loop elsewhere), or never "
                         "(off) (fp8train.numerics.native_gemm.set_mode)")


def pytest_configure(config):
    config.addinivalue_line("markers", "compiled: runs fp8train's torch.compile path; slow")
    from fp8train.nn.gemm import set_cpu_bf16_gemm
    from fp8train.numerics.native_cast import set_enabled

    set_cpu_bf16_gemm({"cpu": None, "bf16": True, "fp32": False}[config.getoption("--emulated-auto")])
    set_enabled(config.getoption("--native-cast") == "on")
    from fp8train.numerics import native_gemm

    native_gemm.set_mode(config.getoption("--native-gemm"))


def pytest_report_header(config):
    from fp8train.nn.gemm import cpu_has_bf16_gemm
    from fp8train.numerics import native_cast

    from fp8train.numerics import native_gemm

    return (f"fp8train: emulated_dtype auto -> {'bf16' if cpu_has_bf16_gemm() else 'fp32'} on CPU "
            f"(--emulated-auto={config.getoption('--emulated-auto')}); native cast "
            f"{'on' if native_cast.available() else 'off: ' + str(native_cast.unavailable_reason() or 'switched off')}"
            f"; native bf16 GEMM {'in use' if native_gemm.in_use('cpu') else 'not used'} "
            f"(--native-gemm={config.getoption('--native-gemm')}, AVX512-BF16 loop "
            f"{'built' if native_gemm.fast() else 'not built'})")


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


# ------------------------------------------------------------------------------------------------------------
# The tiny training setup (model, corpus, config) shared by every test that trains
# ------------------------------------------------------------------------------------------------------------
# d_model 64, 2 layers, seq_len 32, batch 8 on ~200 KB of real text (the standard library's sources), CPU: a step
# takes milliseconds, so a test can afford a few dozen. Tests change what they need with `tiny.config(...)`.
TINY_CONFIG = {
    "model": {"n_layers": 2, "d_model": 64, "n_heads": 2, "seq_len": 32},
    "train": {"max_steps": 12, "batch_size": 8, "eval_every": 6, "eval_batches": 2, "lr": 3e-3, "device": "cpu"},
    "optim": {"warmup_steps": 2},
    "fp8": {"recipe": "delayed"},
    "policy": {"min_features": 16},
    "log": {"wandb": "disabled", "every": 1, "telemetry_every": 4},
    "checkpoint": {"every": 4, "keep_last": 0},
}


def _merged(base: dict, changes: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        out[key] = _merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


class TinySetup:
    """The tiny config and its corpus. ``config(root, **sections)`` is TINY_CONFIG with runs under ``root/runs``,
    the corpus as data, and ``sections`` merged in (``train={"max_steps": 16}``); ``write`` saves it as YAML."""

    def __init__(self, corpus: Path):
        self.corpus = corpus

    def config(self, root: Path, **sections) -> dict:
        base = _merged(TINY_CONFIG, {"run": {"dir": str(Path(root) / "runs"), "name": "tiny"},
                                     "data": {"path": str(self.corpus)}})
        return _merged(base, sections)

    def write(self, root: Path, name: str = "tiny.yaml", **sections) -> Path:
        path = Path(root) / name
        path.write_text(yaml.safe_dump(self.config(root, **sections)))
        return path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinySetup:
    from refs import write_stdlib_corpus

    corpus = tmp_path_factory.mktemp("tiny_corpus") / "corpus.txt"
    write_stdlib_corpus(corpus)
    return TinySetup(corpus)


# ------------------------------------------------------------------------------------------------------------
# Commands: the real executable, the crash wrapper, accelerate launch, and the CLI in-process
# ------------------------------------------------------------------------------------------------------------
TESTS_DIR = Path(__file__).resolve().parent
# torchrun's report of failed ranks: a traceback of the launcher itself ending in ChildFailedError, then a table
# between two lines of "=" naming each failed rank's exit code or signal (torch.distributed.elastic).
_LAUNCHER_TRACEBACK = re.compile(r"Traceback \(most recent call last\):\n(?:[ \t].*\n)*"
                                 r"torch\.distributed\.elastic\.multiprocessing\.errors\.ChildFailedError:.*\n"
                                 r"=+\n(?:.*\n)*?=+\n?")
_LAUNCHER_SUMMARY = re.compile(r"^=+\n.* FAILED\n(?:.*\n)*?=+$", re.MULTILINE)


class Commands:
    """How tests start fp8train. Subprocesses get `env()`: one OpenMP thread, unbuffered output, no GPU (these
    tests are about CPU processes), and the caller's PYTHONPATH (so they import this tree)."""

    @staticmethod
    def env(**extra: str) -> dict:
        # PYTHONFAULTHANDLER: a process killed by SIGABRT or SIGSEGV prints every thread's Python stack first, so a
        # failed launch says whether a rank died inside a step or after its last line ("<no Python frame>").
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "",
               "PYTHONFAULTHANDLER": "1"}
        env.update(extra)
        return env

    @staticmethod
    def fp8train(*args: str) -> list[str]:
        """argv of the installed `fp8train` executable (or `python -m fp8train.cli` without one)."""
        script = Path(sys.executable).parent / "fp8train"
        return [str(script), *args] if script.exists() else [sys.executable, "-m", "fp8train.cli", *args]

    @staticmethod
    def crashpoint(kill_at: str, *args: str) -> list[str]:
        """argv of `fp8train ARGS` with a SIGKILL planted at `kill_at` (see tests/crashpoint.py)."""
        return [sys.executable, str(TESTS_DIR / "crashpoint.py"), kill_at, *args]

    @staticmethod
    def accelerate_launch(processes: int, script: str, *args: str) -> list[str]:
        """argv of a real `accelerate launch` of CPU processes. Run it with `launch_env()`: its rendezvous port is
        picked by torch's own store binding port 0, so no port is probed, released and raced for."""
        return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", script, *args]

    @classmethod
    def launch_env(cls, hf_home: Path, **extra: str) -> dict:
        # PET_STANDALONE is torchrun's --standalone (accelerate hands its arguments to torch.distributed.run):
        # a local c10d store on a port the OS assigns. HF_HOME: no user-level accelerate config leaks in.
        return cls.env(PET_STANDALONE="1", HF_HOME=str(hf_home), **extra)

    @staticmethod
    def launch_failure(returncode: int, stdout: str, stderr: str) -> str:
        """What a failed `accelerate launch` printed, for an assertion message: the launcher's summary (which rank
        failed, with which exit code or signal), then the tail of the ranks' own stderr with the launcher's
        ChildFailedError traceback taken out (it is ~40 lines and would push a rank's last words out of a tail)."""
        summary = _LAUNCHER_SUMMARY.search(stderr)
        ranks = _LAUNCHER_TRACEBACK.sub("", stderr)
        return (f"accelerate launch exited {returncode}\n"
                f"--- launcher's summary:\n{summary.group(0) if summary else '(none)'}\n"
                f"--- ranks' stderr, last 5000 characters:\n{ranks[-5000:]}\n"
                f"--- stdout, last 2000 characters:\n{stdout[-2000:]}")

    @classmethod
    def run(cls, argv: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("env", cls.env())
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)

    @staticmethod
    def main(argv: list[str], capsys) -> tuple[int, str, str]:
        """`fp8train ARGV` in this process: (exit code, stdout, stderr); argparse's exits become codes."""
        from fp8train import cli

        capsys.readouterr()
        try:
            code = cli.main(argv)
        except SystemExit as exit_:
            code = exit_.code
        captured = capsys.readouterr()
        return code, captured.out, captured.err


@pytest.fixture(scope="session")
def commands() -> Commands:
    return Commands()


# A one-rank process group and a tiny model for the single-process FSDP2 and sharded-checkpoint tests.
TINY_FSDP2_MODEL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.seq_len=16",
                    "policy.min_features=16"]


@pytest.fixture
def one_rank_group():
    from fp8train.training.parallel import fsdp2

    created = fsdp2.ensure_process_group(torch.device("cpu"))
    yield
    fsdp2.release_process_group(created)


@pytest.fixture
def small_fs(tmp_path):
    """small_fs(size) -> the folder of a real tmpfs of that size (e.g. "256k"), unmounted after the test: a full
    disk, a read-only folder. Mounting needs root; the test is skipped where it cannot mount."""
    mount = tmp_path / "fs"
    mount.mkdir()

    def make(size: str):
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                              capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
        return mount

    yield make
    subprocess.run(["umount", str(mount)], capture_output=True)
