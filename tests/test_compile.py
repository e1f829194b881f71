"""train.compile and the quantize kernels: every recipe compiles with zero graph breaks under bf16 autocast
(dynamo's explain on CPU), compiled quantization gives the eager bytes, the kernel probe and its cache, and the
bad-input paths (a missing compiler, an unknown emulated dtype or kernel) are refused before anything is written.

Compiles cost 5-25 s each on a 2-core CPU, so the compile tests carry the ``compiled`` marker and use a tiny
model; torch's own compile caches make reruns cheaper.
"""

from __future__ import annotations


import pytest
import torch
import torch._dynamo
import torch.nn as nn

from fp8train.nn.linear import Fp8Linear, configure_execution
from fp8train.nn.recipes import RECIPE_NAMES
from fp8train.numerics.cast_kernels import resolve_kernel
from fp8train.numerics.quant import QUANT_KERNELS, quantize
from fp8train.training.compile import check_compiler
from fp8train.training.config import load_config


def _tiny(recipe_name: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Fp8Linear(64, 64, recipe=recipe_name), nn.ReLU(), Fp8Linear(64, 32, recipe=recipe_name))


@pytest.mark.compiled
@pytest.mark.slow
@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
def test_every_recipe_compiles_without_graph_breaks_under_autocast(recipe_name):
    model = _tiny(recipe_name)
    x = torch.randn(16, 64)

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # issue 17.7: block + autocast failed in dynamo
            return model(x)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.compiled
@pytest.mark.slow
def test_compiled_model_trains_like_eager_and_quantizes_the_same_bytes():
    """One compiled forward + backward of a current-scaling layer: the FP8 bytes it saves for backward are the
    eager bytes, and the gradients agree (same FP8 operands; GEMMs may differ in accumulation order only)."""
    eager, compiled = _tiny("current"), _tiny("current")
    compiled.compile()
    x = torch.randn(16, 64)
    saved = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        grabbed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: grabbed.append(t) or t, lambda t: t):
            out = model(x.clone().requires_grad_(True))
        out.float().pow(2).sum().backward()
        saved[name] = [t.view(torch.uint8) for t in grabbed if t.dtype == torch.float8_e4m3fn]
        saved[name + "_grad"] = model[0].weight.grad
    if saved["compiled"]:  # inductor may keep its own copies; when it saves FP8 bytes they are the eager ones
        assert any(torch.equal(c, saved["eager"][0]) for c in saved["compiled"] if c.shape == saved["eager"][0].shape)
    torch.testing.assert_close(saved["compiled_grad"], saved["eager_grad"], rtol=1e-5, atol=1e-6)


@pytest.mark.compiled
@pytest.mark.slow
@pytest.mark.parametrize("granularity, block", [("tensor", (1, 128)), ("block", (1, 32))])
def test_quantize_traced_inside_a_compiled_function_gives_eager_bytes(granularity, block):
    x = torch.randn(48, 96) * 5
    x[3, 4] = float("nan")

    def fn(t):
        q = quantize(t, "e4m3fn", granularity=granularity, block=block, pow2=True)
        return q.data.view(torch.uint8), q.scale

    torch._dynamo.reset()
    data, scale = torch.compile(fn)(x)
    eager_data, eager_scale = fn(x)
    assert torch.equal(data, eager_data) and torch.equal(scale, eager_scale)


# ---- which kernel 'auto' is ------------------------------------------------------------------------------------
def test_concrete_kernels_resolve_to_themselves_and_removed_names_are_refused():
    for kernel in QUANT_KERNELS:
        assert resolve_kernel(kernel, "cpu") == kernel
    with pytest.raises(ValueError, match="quantize kernel must be one of auto, eager, native, compiled"):
        resolve_kernel("fastest", "cpu")
    for removed in ("compiled_cast", "compiled_select"):
        with pytest.raises(ValueError, match="merged into 'compiled'"):
            resolve_kernel(removed, "cpu")
        with pytest.raises(ValueError, match="kernel must be one of eager, native, compiled"):
            quantize(torch.ones(4), kernel=removed)


def test_auto_is_native_on_a_cpu_with_the_c_kernel_compiled_on_cuda_else_eager():
    assert resolve_kernel("auto", "cpu", native_available=True) == "native"
    assert resolve_kernel("auto", "cpu", native_available=False) == "eager"
    assert resolve_kernel("auto", "cuda", native_available=True) == "compiled"
    assert resolve_kernel("auto", "meta") == "eager"


def test_configure_execution_sets_every_layer_and_refuses_unknown_names():
    model = _tiny("current")
    assert configure_execution(model, quantize_kernel="compiled", emulated_dtype="bf16") == 2
    assert all(m.quantize_kernel == "compiled" and m.emulated_dtype == "bf16"
               for m in model.modules() if isinstance(m, Fp8Linear))
    with pytest.raises(ValueError, match="quantize_kernel must be one of"):
        configure_execution(model, quantize_kernel="triton")
    with pytest.raises(ValueError, match="emulated_dtype must be one of auto, fp32, bf16"):
        configure_execution(model, emulated_dtype="fp16")


# ---- bad input: refused with the key named, before anything is written -----------------------------------------
@pytest.mark.parametrize("override, words", [("fp8.emulated_dtype=fp16", ["fp8.emulated_dtype", "bf16"]),
                                             ("fp8.quantize_kernel=fast", ["fp8.quantize_kernel", "compiled"]),
                                             ("fp8.quantize_kernel=compiled_select", ["fp8.quantize_kernel", "native"]),
                                             ("fp8.amax_outlier_factor=0.5", ["fp8.amax_outlier_factor", "> 1"])])
def test_bad_execution_keys_are_config_errors(override, words):
    with pytest.raises(ValueError) as err:
        load_config(None, [override])
    assert all(w in str(err.value) for w in words), str(err.value)


def test_compile_without_a_compiler_is_refused_before_the_run_directory(tmp_path, monkeypatch, capsys):
    from fp8train.cli import main

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no g++ anywhere on PATH
    with pytest.raises(ValueError, match="train.compile=true needs a C\\+\\+ compiler"):
        check_compiler("cpu")
    run_root = tmp_path / "runs"
    config = tmp_path / "tiny.yaml"
    config.write_text("model: {n_layers: 1, d_model: 64, n_heads: 2, seq_len: 32}\n"
                      "train: {max_steps: 1, batch_size: 2}\nlog: {wandb: disabled}\ndata: {max_bytes: 200000}\n")
    rc = main(["train", str(config), "--quiet", "train.compile=true", f"run.dir={run_root}", "run.name=c",
               "fp8.recipe=current"])
    err = capsys.readouterr().err
    assert rc == 2 and "train.compile" in err and "g++" in err
    assert not (run_root / "c").exists()
