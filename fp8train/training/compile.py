"""`train.compile`: torch.compile the model, after checking, before anything is written, that it can run here.

Every recipe compiles without graph breaks (tests/test_compile.py checks it with dynamo's explain on CPU), and
the compiled quantization gives the same bytes as eager. The module is compiled in place (`nn.Module.compile`),
so its state_dict keys, checkpoints and FP8 buffers are exactly those of the eager model.
"""

from __future__ import annotations

import importlib.util
import shutil

import torch

from fp8train.numerics.quant import eager_division_options

__all__ = ["check_compiler", "compile_model"]


def check_compiler(device: torch.device | str) -> None:
    """ValueError (one line: the key and what to install) when torch.compile cannot build kernels for `device`."""
    device = torch.device(device)
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            raise ValueError("train.compile=true on CUDA needs triton (pip install triton, the version your torch "
                             "was built with); or set train.compile=false")
        return
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        compiler = get_cpp_compiler()
    except Exception as err:  # torch without inductor, or no compiler it recognizes
        raise ValueError(f"train.compile=true needs a C++ compiler for torch.compile on CPU ({err}); install g++ "
                         "(e.g. apt-get install g++) or set train.compile=false") from None
    if shutil.which(compiler) is None:
        raise ValueError(f"train.compile=true needs a C++ compiler for torch.compile on CPU; {compiler!r} was not "
                         "found on PATH: install g++ (e.g. apt-get install g++) or set train.compile=false")


def compile_model(model: torch.nn.Module) -> torch.nn.Module:
    """Compile `model`'s forward in place (state_dict unchanged); returns it. The caller checked the compiler."""
    import torch._dynamo as dynamo  # here, not at the top: importing dynamo costs every process ~1.7 s at start

    # One graph per FP8 format and scaling configuration: the default of 8 recompiles is too few for a model
    # whose layers differ in shape.
    dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
    # fp32 divisions IEEE-rounded as in eager (quant.eager_division_options): the FP8 quantization traced into
    # the model's graph then writes the same bytes compiled and eager, on GPUs too.
    model.compile(options=eager_division_options() or None)
    return model
