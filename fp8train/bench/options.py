"""Options of ``fp8train bench``: what to run, at which sizes, and the parsing of the command-line lists."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fp8train.nn.recipes import RECIPE_NAMES
from fp8train.numerics import native_cast

__all__ = ["BenchOptions", "parse_shapes", "parse_list", "resolve_fp8_kernel", "log", "SECTIONS", "OPTIONAL_SECTIONS",
           "RECIPES",
           "SHAPES", "QUANT_LAYOUTS", "QUANT_FORMATS", "GPU_PEAKS", "REPO_RECIPES", "TARGET_SHAPE"]

SECTIONS = ("quant", "ops", "linear", "train", "memory")
# Not in the default run: launches 2 processes (fp8train.bench.distributed_section and tp_section; ~3 minutes on 2 CPU cores).
OPTIONAL_SECTIONS = ("distributed", "experts")  # experts: FP8 grouped GEMMs, ~2 minutes on 2 CPU cores
RECIPES = RECIPE_NAMES
# (M, K, N): input (M, K), weight (N, K). The full CPU list stops at 4096x1024x1024 (the target shape): a bf16
# nn.Linear fwd+bwd already takes ~20 s there on the reference box (see the module docstring).
SHAPES = {
    ("cpu", False): [(1024, 256, 256), (2048, 512, 512), (4096, 1024, 1024)],
    ("cpu", True): [(1024, 256, 256), (4096, 1024, 1024)],
    ("cuda", False): [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192)],
    ("cuda", True): [(4096, 4096, 4096), (8192, 8192, 8192)],
}
QUANT_LAYOUTS = [("tensor", (1, 128)), ("row", (1, 128)), ("block", (1, 128)), ("block", (128, 128))]
QUANT_FORMATS = ("e4m3fn", "e5m2")
# Dense (no sparsity) tensor-core peaks in TFLOP/s from vendor datasheets: (bf16, fp8). Matched by substring.
GPU_PEAKS = {"H100": (989.0, 1979.0), "H200": (989.0, 1979.0), "H800": (989.0, 1979.0), "GH200": (989.0, 1979.0),
             "B200": (2250.0, 4500.0), "L40S": (362.0, 733.0), "L4": (121.0, 242.5)}
REPO_RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TARGET_SHAPE = (4096, 1024, 1024)  # the CPU shape the linear targets are stated at (also in --quick)


@dataclass
class BenchOptions:
    device: str = "cpu"
    """'cpu' or 'cuda'."""
    quick: bool = False
    """Smaller sizes, fewer shapes and repeats (CPU: under 3 minutes)."""
    shapes: Optional[list] = None
    """Linear shapes (M, K, N); None = the default list for the device and mode."""
    recipes: tuple = RECIPES
    """FP8 recipes to compare with bf16."""
    sections: tuple = SECTIONS
    """Which sections run."""
    compile: str = "auto"
    """FP8 quantize kernel in linear/train where the native C kernel does not run: 'on' (compiled), 'off'
    (eager), or 'auto' (off for --quick on CPU, where the compiled kernel does not pay for its compile time)."""
    malloc_tuning: bool = True
    """CPU: keep freed memory in the process (glibc mallopt) so repeats do not page-fault."""
    train_config: Optional[str] = None
    """Recipe YAML whose model/batch the train and memory sections use; None = the device's default."""
    quant_numel: Optional[int] = None
    """Elements quantized per call; None = 16M (the size the targets are stated at, --quick too)."""
    warmup: Optional[int] = None
    repeats: Optional[int] = None
    threads: Optional[int] = None
    """torch intra-op threads on CPU; None = leave torch's default."""
    torchao: bool = True
    """Compare with torchao's Float8Linear when it is installed."""
    out: Optional[str] = None
    """JSON file, rewritten after every section (so a run cut short by a timeout still leaves results)."""


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'4096x1024x1024,1024x256x256' -> [(4096, 1024, 1024), (1024, 256, 256)]; ValueError naming a bad item."""
    shapes = []
    for item in (s.strip() for s in str(text).split(",")):
        parts = item.lower().split("x")
        try:
            dims = tuple(int(p) for p in parts)
        except ValueError:
            dims = ()
        if len(dims) != 3 or any(d <= 0 for d in dims):
            raise ValueError(f"--shapes: cannot parse {item!r}; expected MxKxN with three positive ints, "
                             "e.g. 4096x1024x1024 (input M x K, weight N x K), comma-separated")
        shapes.append(dims)
    return shapes


def parse_list(text: str, allowed: tuple, key: str) -> tuple:
    items = tuple(s.strip() for s in str(text).split(",") if s.strip())
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise ValueError(f"{key}: {', '.join(bad) or repr(text)} not allowed; choose from {', '.join(allowed)}")
    return items


def resolve_fp8_kernel(opts: BenchOptions) -> tuple[str, str]:
    """(quantize kernel for the linear/train sections, why): on a CPU where the C kernel builds, native (no
    compile; bit-exact); else --compile off -> eager, on -> compiled; auto -> eager for --quick on CPU (a compile
    costs 5-25 s there), else compiled."""
    if opts.device == "cpu" and native_cast.available():
        return "native", ("native: fp8train's C kernel (numerics/native_cast.c), built for this CPU, threads: "
                          f"{native_cast.threading_kind()}")
    why_native = f" (native C kernel unavailable: {native_cast.unavailable_reason()})" if opts.device == "cpu" else ""
    if opts.compile == "off":
        return "eager", "--compile off" + why_native
    if opts.compile == "auto" and opts.quick and opts.device == "cpu":
        return "eager", "auto: eager for --quick on CPU (each kernel compile costs 5-25 s here)" + why_native
    return "compiled", f"--compile {opts.compile}: the compiled kernel" + why_native


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)
