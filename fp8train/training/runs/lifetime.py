"""How a training process ends when it is told to, or when the process that started it is gone.

- `interrupts_raised()`: inside it, SIGTERM (a scheduler's or `kill`'s stop) and SIGINT (Ctrl-C) raise
  `Interrupted`, a KeyboardInterrupt that names its signal, in the main thread; the loop catches it to write a
  summary.json saying "interrupted" and at which step, then lets it end the process (run_log.summary_on_interrupt).
  Handlers are installed only in the main thread and only over the default ones, and restored on the way out.
- `interrupts_held()`: inside it such a signal waits, and is raised when the block ends: a checkpoint is written
  whole, and the loop's record of it updated, before the interrupt ends the run (so the summary names the newest
  checkpoint on disk, and no pruning is cut short).
- `die_with_parent(parent_pid)`: a worker process (validate.workers > 1) gets SIGTERM when its parent dies, even
  by SIGKILL, so no worker is left training, or blocked on a queue nobody will write, after `kill -9` of
  `fp8train validate` (Linux: prctl(PR_SET_PDEATHSIG); elsewhere a thread polls the parent's pid).

One signal ends a run; its repeats are dropped until the interrupt has been handled (the summary written, the
lock released). They do come: Linux sends the parent-death signal each time the thread a worker is a child of
exits and the worker is handed to another thread of the same parent, so a `kill -9` of a validate with several
threads delivers SIGTERM to each worker several times within milliseconds; a scheduler or an impatient user may
repeat a signal too. Were a repeat raised, it would cut the summary's writing short (seen: a worker's run left
without summary.json).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

__all__ = ["Interrupted", "interrupts_raised", "interrupts_held", "die_with_parent"]

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_DEFAULTS = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT, raised where the main thread was; `signum` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# The process's signal state (handlers run in the main thread only): how deeply nested interrupts_raised and
# interrupts_held are, the first signal that arrived inside interrupts_held (raised when it ends), and the signal
# already raised as Interrupted since the outermost interrupts_raised began (its repeats are dropped; it stays set
# after the block, so a worker's _exit_on_signal drops them too while the interrupt unwinds to os._exit).
_held = {"raising": 0, "depth": 0, "pending": None, "raised": None}


def _interrupt(signum: int) -> Interrupted:
    """The one Interrupted of this block; every later signal is a repeat."""
    _held["raised"] = signum
    return Interrupted(signum)


def _raise(signum, _frame):
    if _held["raised"] is not None:
        return  # the run is already ending on a signal: a repeat must not interrupt the summary being written
    if _held["depth"]:
        if _held["pending"] is None:
            _held["pending"] = signum
        return
    raise _interrupt(signum)


@contextmanager
def interrupts_raised():
    """SIGTERM and SIGINT raise Interrupted inside the block, once (see the module docstring)."""
    installed = {}
    if threading.current_thread() is threading.main_thread():
        if not _held["raising"]:  # a new outermost block: an interrupt handled before this one is over
            _held["raised"] = None
        for signum in _SIGNALS:  # over the defaults, or our own (a validate worker's _exit_on_signal)
            if signal.getsignal(signum) in (_DEFAULTS[signum], _raise, _exit_on_signal):
                installed[signum] = signal.signal(signum, _raise)
    _held["raising"] += 1
    try:
        yield
    finally:
        _held["raising"] -= 1
        for signum, previous in installed.items():
            signal.signal(signum, previous)


@contextmanager
def interrupts_held():
    """SIGTERM and SIGINT that arrive inside the block are raised (as Interrupted) when it ends (module docstring).
    Nests; only the outermost block raises."""
    _held["depth"] += 1
    try:
        yield
    finally:
        _held["depth"] -= 1
        if not _held["depth"] and _held["pending"] is not None:
            signum, _held["pending"] = _held["pending"], None
            raise _interrupt(signum)


def _exit_on_signal(signum, _frame):
    if _held["raised"] is not None:
        return  # a repeat of the signal whose interrupt is unwinding this worker to its os._exit
    os._exit(128 + signum)


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM to this process when `parent_pid` (its parent) ends. Outside a run (idle in the pool, or between
    runs) the signal ends the process at once; inside one, interrupts_raised turns it into an interrupted
    summary first."""
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="die-with-parent").start()
    if os.getppid() != parent_pid:  # the parent died before the line above: nobody would signal us
        os.kill(os.getpid(), signal.SIGTERM)


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)
