"""fp8train: FP8 mixed-precision training recipes for PyTorch, with paired bf16 validation.

The numerics core is imported eagerly; the training-side names are imported on first use so that
``import fp8train`` stays light.
"""

from importlib.metadata import PackageNotFoundError, version as _distribution_version

from fp8train.torch_support import check_torch_version

check_torch_version()  # before anything touches torch's FP8 API: one line, not a traceback from deep inside

from fp8train.numerics.formats import FORMATS, Fp8Format, get_format  # noqa: E402
from fp8train.numerics.quant import Fp8Tensor, compute_amax, convert_dialect, quant_error, quantize, scale_from_amax  # noqa: E402,E501

try:  # the version is pyproject.toml's, as installed; a source tree that was never installed has none
    __version__ = _distribution_version("fp8train")
except PackageNotFoundError:
    __version__ = "unknown"

_LAZY = {
    "recipe": "fp8train.nn.recipes",
    "Fp8Recipe": "fp8train.nn.recipes",
    "RECIPE_NAMES": "fp8train.nn.recipes",
    "Fp8Linear": "fp8train.nn.linear",
    "OperandQuantizer": "fp8train.nn.quantizer",
    "convert_to_fp8": "fp8train.nn.convert",
    "LayerPolicy": "fp8train.nn.convert",
    "update_fp8_scales": "fp8train.nn.linear",
    "fp8_layers": "fp8train.nn.convert",
    "save_pretrained": "fp8train.training.models.pretrained",
    "from_pretrained": "fp8train.training.models.pretrained",
    "Fp8ScalingCallback": "fp8train.training.models.hf_trainer",
    "Fp8TelemetryCallback": "fp8train.training.runs.hf_telemetry",
    "collect_fp8_telemetry": "fp8train.training.runs.telemetry",
    "sample_fp8_telemetry": "fp8train.training.runs.telemetry",
}

__all__ = [
    "FORMATS", "Fp8Format", "get_format", "Fp8Tensor", "quantize", "quant_error", "compute_amax",
    "scale_from_amax", "convert_dialect", *_LAZY,
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fp8train' has no attribute {name!r}")
