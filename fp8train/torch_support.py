"""The torch releases fp8train supports: the range CI tests, checked once at import.

Why a range and a check: fp8train leans on torch internals that move between releases (`torch._scaled_mm`'s
argument rules, float8 dtypes, FSDP2's `fully_shard`, torch.compile of custom ops), so a release nobody ran is
refused with one line at import rather than failing somewhere inside a training step. CI runs the core tests
under the oldest and the newest release of the range as well as README's pin (.ci/run); pyproject.toml states
the same range (a test checks that the two agree).
"""

from __future__ import annotations

import re

__all__ = ["TORCH_OLDEST", "TORCH_BELOW", "TORCH_REQUIREMENT", "check_torch_version", "torch_release"]

TORCH_OLDEST = (2, 11)  # the GPU machine's image (torch 2.11.0+cu130)
TORCH_BELOW = (2, 15)   # 2.14.x is the newest release CI installs and runs
TORCH_REQUIREMENT = f"torch>={TORCH_OLDEST[0]}.{TORCH_OLDEST[1]},<{TORCH_BELOW[0]}.{TORCH_BELOW[1]}"


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: '2.14.1+cu130' -> (2, 14), '2.15.0.dev20261101' -> (2, 15)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ImportError(f"fp8train cannot read the torch version {version!r}; it needs {TORCH_REQUIREMENT}")
    return int(found.group(1)), int(found.group(2))


def check_torch_version(version: str | None = None) -> None:
    """Raise ImportError, in one line, when `version` (default: the installed torch's) is outside the range."""
    if version is None:
        import torch

        version = torch.__version__
    if not TORCH_OLDEST <= torch_release(version) < TORCH_BELOW:
        raise ImportError(f"fp8train needs {TORCH_REQUIREMENT} (the range its CI tests); this is torch {version}: "
                          f"pip install '{TORCH_REQUIREMENT}'")
