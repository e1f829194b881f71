"""Work that only the main process does, with a failure every process sees.

Under `accelerate launch` the main process alone writes the run directory (and holds its lock); the other ranks
wait at a barrier. If the main process failed there alone (the directory is locked by another run, the disk is
full), the others would wait forever. `on_main_process` runs the action on the main process, broadcasts what
happened, and raises the same error on every rank.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["on_main_process"]


def on_main_process(accelerator, action: Callable[[], Any]) -> Any:
    """`action()` on the main process; its ValueError/OSError is re-raised on EVERY rank (as ValueError on the
    others, carrying the same message). Returns the action's result on the main process, None elsewhere."""
    result, failure = None, None
    if accelerator.is_main_process:
        try:
            result = action()
        except (ValueError, OSError) as err:
            if accelerator.num_processes == 1:
                raise
            failure = err
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        message = [f"{type(failure).__name__}: {failure}" if failure is not None else None]
        broadcast_object_list(message, from_process=0)
        if failure is not None:
            raise failure
        if message[0] is not None:
            raise ValueError(f"the main process failed: {message[0]}")
    return result
