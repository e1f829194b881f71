"""Processes and ranks: the Accelerator a run trains with, what the launcher may and may not ask for, and the
one FP8 scaling state that every data-parallel rank must hold.

fp8train's loop is data parallel: every rank holds the whole model (DDP) and rank 0 writes the checkpoints.
Settings of `accelerate launch` (or `accelerate config`) that the loop cannot honour are refused here, before
anything is written, with a message that says what to do instead; none is silently replaced:
- FSDP, DeepSpeed and Megatron-LM plugins (`--use_fsdp`, `--use_deepspeed`, ...): the loop would run plain DDP;
  on CPU accelerate itself silently stays MULTI_CPU whatever the config file says, so the launcher's
  environment is read, not only the Accelerator's `distributed_type`. With `train.parallel=fsdp2`
  an FSDP launch is accepted: fp8train applies FSDP2 itself (fsdp2.py) and never hands accelerate the model, so
  the plugin's own options do not apply;
- `--mixed_precision` other than `no` or `bf16`: `bf16` means what `train.autocast=bf16` means (the loop applies
  autocast itself, the same on every backend), `fp16` needs loss scaling the loop does not do, and `fp8` is
  accelerate's own FP8 path (TE or torchao) that would fight fp8train's: fp8train IS the FP8 layer, chosen with
  `fp8.recipe`.

A launch that asked for several processes and got one is said in one line (`process_count_note`), not refused:
accelerate's simple launcher, which `accelerate launch --cpu --num_processes N` and a MULTI_CPU config file use
without mpirun, starts ONE process; it exports MASTER_ADDR / MASTER_PORT only when more than one process or
machine was asked for, and a launcher that really started several sets WORLD_SIZE (torchrun) or an MPI size.
fp8train makes its own Accelerator with `cpu=True` on CPU, so `accelerate launch --multi_gpu --num_processes N`
starts N gloo CPU processes.

How a process leaves its gloo group (`end_process_group_at_exit`): a gloo group still up when the interpreter
finalizes can abort the process (SIGABRT, "terminate called without an active exception", no traceback). gloo runs
every collective on a worker thread, which drops its reference to the finished work (and so to the tensors of the
collectives that work waited for) a moment AFTER the caller was told it completed. A tensor made in Python is freed
under the GIL; a thread asking for the GIL once finalization has begun is ended with pthread_exit, and the forced
unwind through the work's destructor (noexcept) calls std::terminate. The window is short (the thread drops the
work right after marking it complete), so it is hit when that thread is descheduled on a loaded CPU (core dump of
such a rank: the worker in ~AsyncBarrierWork -> ~AsyncAllgatherWork -> take_gil -> pthread_exit, the main thread in
Py_FinalizeEx). Destroying the group joins the worker threads while the interpreter is alive; fp8train does it at
exit for every gloo group it makes or joins, whether the process returns or raises.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import sys
from typing import Mapping

import torch
import torch.distributed as dist
from accelerate import Accelerator

from fp8train.nn.recipes import ROLES

__all__ = ["make_accelerator", "check_launch_settings", "process_count_note", "end_process_group_at_exit",
           "set_cpu_threads",
           "all_mean_tensor",
           "fp8_state_digest",
           "Fp8StateSync"]

# accelerate launch exports its choices as these environment variables (accelerate.commands.launch).
_PLUGIN_ENV = {"ACCELERATE_USE_FSDP": "FSDP", "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
               "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM"}
_MIXED_PRECISION_ENV = "ACCELERATE_MIXED_PRECISION"
_UNSUPPORTED_KINDS = ("FSDP", "DEEPSPEED", "MEGATRON_LM")


def check_launch_settings(cfg, env: Mapping[str, str] = os.environ) -> None:
    """Refuse launcher settings the loop cannot honour (see the module docstring); ValueError naming them."""
    for var, plugin in _PLUGIN_ENV.items():
        if env.get(var, "").lower() in ("true", "1", "yes"):
            if var == "ACCELERATE_USE_FSDP" and cfg.train.parallel == "fsdp2":
                continue  # fp8train shards the model itself (fsdp2.py); accelerate never sees the model
            raise ValueError(
                f"accelerate is configured for {plugin} ({var}=true), which fp8train's loop does not run: it keeps "
                "the model replicated (DDP) and checkpoints rank 0's full state. Launch with `accelerate launch "
                "--multi_gpu` (or --cpu) and a config file without the plugin" + (
                "; for FSDP set train.parallel=fsdp2 (fp8train applies FSDP2 itself)" if plugin == "FSDP" else ""))
    mixed = env.get(_MIXED_PRECISION_ENV, "no").lower()
    if mixed == "fp8":
        raise ValueError(
            "accelerate --mixed_precision fp8 is accelerate's own FP8 path; fp8train is the FP8 layer: launch with "
            "--mixed_precision no (or bf16) and choose the FP8 recipe with fp8.recipe=delayed|current|rowwise|block")
    if mixed not in ("no", "bf16"):
        raise ValueError(f"accelerate --mixed_precision {mixed} is not supported: use no or bf16 (bf16 means "
                         "train.autocast=bf16: bf16 autocast outside the FP8 layers)")
    if mixed == "bf16" and cfg.train.autocast != "bf16":
        raise ValueError(f"accelerate --mixed_precision bf16 asks for bf16 autocast but train.autocast="
                         f"{cfg.train.autocast}; drop one of the two")


# set by a launcher that started several processes: torchrun / accelerate's multi-process launcher, MPI
_WORLD_SIZE_ENV = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")


def process_count_note(num_processes: int, env: Mapping[str, str] = os.environ) -> str | None:
    """The line to print when `accelerate launch` asked for several processes and this one runs alone (see the
    module docstring), else None."""
    launched = _MIXED_PRECISION_ENV in env  # accelerate launch exports it whatever the choice
    asked_for_more = "MASTER_ADDR" in env and not any(var in env for var in _WORLD_SIZE_ENV)
    if num_processes != 1 or not (launched and asked_for_more):
        return None
    return ("fp8train: accelerate launch asked for several processes but started 1 (on CPU, --cpu and a MULTI_CPU "
            "config start one process unless mpirun runs them); training in 1 process, world_size 1. For N CPU "
            "processes: accelerate launch --multi_gpu --num_processes N (fp8train uses gloo on CPU)")


def make_accelerator(cfg) -> Accelerator:
    """The Accelerator of a run: CPU or CUDA as `train.device` says, mixed_precision="no" because the loop applies
    `train.autocast` itself; trackers are started by fp8train.training.runs.tracking, not by the Accelerator."""
    check_launch_settings(cfg)
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but no CUDA GPU is visible; use train.device=auto or cpu")
    cpu = cfg.train.device == "cpu" or (cfg.train.device == "auto" and not torch.cuda.is_available())
    accelerator = Accelerator(cpu=cpu, mixed_precision="no")
    check_distributed_type(accelerator, cfg)
    note = process_count_note(accelerator.num_processes)
    if note:
        print(note, file=sys.stderr)
    if accelerator.num_processes > 1:
        end_process_group_at_exit()
    return accelerator


_exit_hook = {"registered": False}


def end_process_group_at_exit() -> None:
    """Destroy the default process group, if it is a gloo one, when the interpreter exits (module docstring).
    Registered once per process; a group already destroyed (`accelerator.end_training()`) is left alone. No
    barrier: this runs on error exits too, where a barrier could wait for a rank that never comes, and gloo's
    destroy is local (no collective). NCCL groups are left to the caller (`end_training`), as accelerate does."""
    if not _exit_hook["registered"]:
        atexit.register(_destroy_gloo_group)
        _exit_hook["registered"] = True


def _destroy_gloo_group() -> None:
    if dist.is_available() and dist.is_initialized() and "gloo" in str(dist.get_backend()):
        dist.destroy_process_group()


def check_distributed_type(accelerator, cfg=None) -> None:
    kind = getattr(accelerator, "distributed_type", "")
    kind = str(getattr(kind, "value", kind)).rsplit(".", 1)[-1].upper()  # DistributedType.FSDP -> "FSDP"
    if kind == "FSDP" and cfg is not None and cfg.train.parallel == "fsdp2":
        return  # accelerate's FSDP plugin is never given the model: fp8train applies FSDP2 itself (fsdp2.py)
    if kind in _UNSUPPORTED_KINDS:
        raise ValueError(f"accelerate is configured for {kind}, which fp8train's loop does not support: it keeps "
                         "the model replicated (DDP) and checkpoints rank 0's full state; launch with "
                         "`accelerate launch --multi_gpu` (or --cpu) instead")


def set_cpu_threads(cfg, accelerator) -> None:
    if accelerator.device.type != "cpu":
        return
    if cfg.train.threads > 0:  # tiny GEMMs: OpenMP threads cost more than they give
        torch.set_num_threads(cfg.train.threads)
    elif accelerator.num_processes > 1:  # several processes on one CPU: share the cores, don't oversubscribe
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // accelerator.num_processes))


def all_mean_tensor(accelerator, value: torch.Tensor) -> torch.Tensor:
    """The mean over ranks of a () tensor on the device, without a host sync (one all-reduce)."""
    if accelerator.num_processes == 1:
        return value
    return accelerator.reduce(value.reshape(1), reduction="mean").reshape(())


def fp8_state_digest(layers) -> str:
    """SHA-256 over the FP8 buffers (scales, amax histories, counters; not the per-step pending amaxes) of
    `layers` [(name, Fp8Linear)], in order: equal digests mean bit-identical FP8 scaling state."""
    names, flat = [], []
    for name, layer in layers:
        for buf_name, buf in layer.named_buffers(recurse=False):
            if not buf_name.endswith("_pending_amax"):  # per-step scratch, -1 between steps
                names.append(f"{name}.{buf_name}")
                flat.append(buf.detach().reshape(-1).view(torch.uint8))
    digest = hashlib.sha256("\n".join(names).encode())
    if flat:
        digest.update(torch.cat(flat).cpu().numpy().tobytes())  # one device-to-host copy
    return digest.hexdigest()


class Fp8StateSync:
    """Keeps the FP8 state of data-parallel ranks one state.

    Scales and amax histories are made identical by update_fp8_scales (one all-reduce MAX per step); `check()`
    proves it by comparing a digest of all FP8 buffers across ranks. The non-finite amax counters are event
    counts of each rank's own tensors, so `check()` first adds up what every rank saw since the last check:
    afterwards every rank (and every checkpoint) holds the totals of all ranks. One process: nothing to do."""

    def __init__(self, layers, accelerator):
        self.layers, self.accelerator = layers, accelerator
        self.active = accelerator.num_processes > 1 and bool(layers)
        self.counters = [getattr(layer, f"{role}_nonfinite_amax_count") for _, layer in layers for role in ROLES]
        self.synced = torch.stack(self.counters).clone() if self.active else None

    def sync_counters(self) -> None:
        if not self.active:
            return
        delta = torch.stack(self.counters) - self.synced
        dist.all_reduce(delta, op=dist.ReduceOp.SUM)
        self.synced = self.synced + delta
        for counter, total in zip(self.counters, self.synced):
            counter.copy_(total)

    def check(self, step: int) -> None:
        """Sync the counters, then compare the FP8 state digests of all ranks (raises if they differ)."""
        if not self.active:
            return
        self.sync_counters()
        digest = fp8_state_digest(self.layers)
        words = torch.tensor([int(digest[i:i + 15], 16) for i in range(0, 60, 15)], dtype=torch.int64,
                             device=self.accelerator.device)
        gathered = self.accelerator.gather(words).reshape(self.accelerator.num_processes, -1)
        if not bool((gathered == gathered[0]).all()):
            raise RuntimeError(f"FP8 scaling state differs between ranks after step {step} (a bug: "
                               "update_fp8_scales must leave every rank with the same scales)")
