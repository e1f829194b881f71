"""A process that made or joined a gloo group through fp8train leaves it destroyed before the interpreter
finalizes, whether it returns or raises: a group left to finalization can abort the process with "terminate called without an
active exception" (fp8train/training/parallel/distributed.py explains the race; tests/test_multiprocess.py checks
the same under a real 2-process `accelerate launch`).

Each case is a real Python process with a one-rank gloo group made the way `train.parallel=fsdp2` makes it
without a launcher (fsdp2.ensure_process_group). An atexit function registered BEFORE the group exists runs
AFTER fp8train's own exit hook (atexit calls the last registered first) and writes down whether a group is
still up at that point.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = r'''
import atexit, json, sys
import torch
import torch.distributed as dist

record, ending = sys.argv[1], sys.argv[2]


def write_record():
    with open(record, "w") as f:
        json.dump({"group_alive": dist.is_initialized()}, f)


atexit.register(write_record)
from fp8train.training.parallel.fsdp2 import ensure_process_group

assert ensure_process_group(torch.device("cpu"))
total = torch.ones(4)
dist.all_reduce(total)  # a collective on a tensor made in Python, the kind a gloo worker thread frees late
dist.barrier()
if ending == "raises":
    raise RuntimeError("a run that failed after making its group")
if ending == "destroyed by the caller":  # `fp8train train` (accelerator.end_training) does this itself
    dist.destroy_process_group()
'''


@pytest.mark.parametrize("ending, exit_code", [("raises", 1), ("destroyed by the caller", 0)])
def test_a_gloo_group_is_destroyed_before_finalization_on_every_exit_path(tmp_path, commands, ending, exit_code):
    record = tmp_path / "exit.json"
    proc = commands.run([sys.executable, "-c", SCRIPT, str(record), ending], timeout=120)
    assert proc.returncode == exit_code, proc.stderr[-3000:]
    assert json.loads(record.read_text()) == {"group_alive": False}
    assert "terminate called" not in proc.stderr and "Error in atexit" not in proc.stderr, proc.stderr[-3000:]
    if ending == "raises":
        assert "RuntimeError: a run that failed after making its group" in proc.stderr
