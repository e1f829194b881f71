"""GPU checks (``pytest -m cuda tests/test_cuda.py``; scripts/gpu_check.sh runs them): the scaled_mm backend
against the emulated one, delayed scaling state living on the GPU, and a short training run per recipe on CUDA.

References are independent of the code under test where they can be: the emulated backend is checked against
plain fp32 matmuls of dequantized operands in test_gemm.py, so here scaled_mm is held to the emulated result
(FP8 products are exact in fp32; only the accumulation order differs), and Fp8Linear to nn.Linear by SQNR.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from fp8train.nn.accumulation import HopperAccumulation, accumulation_error_bound
from fp8train.nn.gemm import Fp8Operand, fp8_mm, scaled_mm_available
from fp8train.nn.scaled_gemm import HAS_SCALED_MM_V2
from fp8train.numerics.quant import quantize
from fp8train.nn.recipes import RECIPE_NAMES


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and scaled_mm_available("cuda")


pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU with FP8 (sm89+)")]

M, K, N = 256, 512, 384  # multiples of 16 (scaled_mm), of 128 (block tiles)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    noise = (ref.double() - test.double()).pow(2).sum()
    return float(10 * torch.log10(ref.double().pow(2).sum() / noise)) if noise > 0 else math.inf


@pytest.fixture
def operands():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g)             # input        (M, K)
    w = torch.randn(N, K, device="cuda", generator=g) * 0.02      # weight       (N, K)
    dy = torch.randn(M, N, device="cuda", generator=g) * 1e-3     # grad_output  (M, N)
    return x, w, dy


def _three_gemms(x_q, w_q, dy_q):
    """(a, b) operand pairs of output = x @ w.T, grad_input = dy @ w, grad_weight = dy.T @ x."""
    x_op, w_op, dy_op = (Fp8Operand.from_fp8_tensor(q, keep_values=False) for q in (x_q, w_q, dy_q))
    return {"output": (x_op, w_op.t()), "grad_input": (dy_op, w_op), "grad_weight": (dy_op.t(), x_op)}


@pytest.mark.parametrize("gemm", ["output", "grad_input", "grad_weight"])
def test_scaled_mm_tensorwise_matches_emulated(operands, gemm):
    x, w, dy = operands
    pairs = _three_gemms(quantize(x, "e4m3fn"), quantize(w, "e4m3fn"), quantize(dy, "e5m2"))
    a, b = pairs[gemm]
    emulated = fp8_mm(a, b, "emulated")
    scaled = fp8_mm(a, b, "scaled_mm")
    assert scaled.dtype == torch.float32 and scaled.shape == emulated.shape
    # Same exact products, summed in another order (a wrong layout or scale would be off by O(1)).
    assert _rel_err(scaled, emulated) < 1e-3, gemm
    reference = a.dequantize(torch.float32) @ b.dequantize(torch.float32)  # fp32 matmul of the FP8 values
    assert _rel_err(scaled, reference) < 1e-3


def test_scaled_mm_rowwise_matches_emulated(operands):
    x, w, _ = operands
    x_q = quantize(x, "e4m3fn", granularity="row", pow2=True)     # per-token scales (M, 1)
    w_q = quantize(w, "e4m3fn", granularity="row", pow2=True)     # per-output-channel scales (N, 1)
    a, b = Fp8Operand.from_fp8_tensor(x_q), Fp8Operand.from_fp8_tensor(w_q).t()
    emulated = fp8_mm(a, b, "emulated")
    scaled = fp8_mm(a, b, "scaled_mm")  # rowwise kernel where torch has one, else the dequantized bf16 GEMM
    # Same FP8 operands on both sides: at most one bf16 rounding of the result (2^-9 relative) on top of the
    # accumulation-order difference bounded in the tensorwise test.
    assert _rel_err(scaled, emulated) < 2**-9 + 1e-3


def _int_fp8(shape, dtype, seed):
    """Integers in [-3, 3] as FP8: every product is an integer <= 9 and every partial sum over K = 512 an integer
    below 2^13, exact even in an accumulator that keeps only ~14 bits (Hopper's FP8 tensor cores)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(-3, 4, shape, device="cuda", generator=g).float().to(dtype)


def test_scaled_mm_is_exact_where_the_products_are():
    """Integer FP8 operands with power-of-two scales: the result is exact whatever the accumulation order, so
    scaled_mm must equal the fp64 reference bit for bit (tensorwise: fp32 output), or that reference rounded
    once to bf16 (a rowwise kernel with bf16 output)."""
    x_data, w_data = _int_fp8((M, K), torch.float8_e4m3fn, 1), _int_fp8((N, K), torch.float8_e4m3fn, 2)
    dy_data = _int_fp8((M, N), torch.float8_e5m2, 3)
    x = Fp8Operand(x_data, torch.tensor(2.0**-5, device="cuda"))
    w = Fp8Operand(w_data, torch.tensor(2.0**-7, device="cuda"))
    dy = Fp8Operand(dy_data, torch.tensor(2.0**-2, device="cuda"))
    for gemm, (a, b) in {"output": (x, w.t()), "grad_input": (dy, w), "grad_weight": (dy.t(), x)}.items():
        reference = (a.data.double() @ b.data.double()) * float(a.scale) * float(b.scale)
        assert torch.equal(fp8_mm(a, b, "scaled_mm").double(), reference), gemm
    row_x = Fp8Operand(x_data, torch.exp2(torch.randint(-4, 4, (M, 1), device="cuda").float()))
    row_w = Fp8Operand(w_data, torch.exp2(torch.randint(-4, 4, (N, 1), device="cuda").float()))
    reference = (x_data.double() @ w_data.double().t()) * row_x.scale.double() * row_w.scale.double().t()
    out = fp8_mm(row_x, row_w.t(), "scaled_mm").double()
    assert torch.equal(out, reference) or torch.equal(out, reference.to(torch.bfloat16).double())


@pytest.mark.parametrize("blocks", [((1, 128), (128, 128))], ids=["1x128-128x128"])
def test_scaled_mm_block_layout_matches_emulated(operands, blocks):
    x, w, dy = operands
    x_q = quantize(x, "e4m3fn", granularity="block", block=blocks[0], pow2=True)
    w_q = quantize(w, "e4m3fn", granularity="block", block=blocks[1], pow2=True)
    dy_q = quantize(dy, "e4m3fn", granularity="block", block=blocks[0], pow2=True)
    for gemm, (a, b) in _three_gemms(x_q, w_q, dy_q).items():
        emulated = fp8_mm(a, b, "emulated")
        scaled = fp8_mm(a, b, "scaled_mm")
        # Hopper's block kernels accumulate each 128-deep K block in a narrow (~14-bit, truncating) accumulator
        # before promoting it to fp32: accumulation_error_bound derives the elementwise bound from that model
        # (4 truncations per block, each < 2^-13 of a partial sum <= sum |products|, plus fp32 summation on
        # both sides); tests/test_accumulation.py checks the model stays inside it and a 10-bit one does not.
        bound = accumulation_error_bound(a.dequantize(torch.float32), b.dequantize(torch.float32),
                                         HopperAccumulation(accumulator_bits=14, promotion_interval=128))
        excess = (scaled.double() - emulated.double()).abs() - bound
        assert float(excess.max()) <= 0, (gemm, float(excess.max()))


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_fp8_linear_on_cuda_matches_emulated_and_nn_linear(name):
    from fp8train.nn.linear import Fp8Linear
    from fp8train.nn.recipes import recipe

    torch.manual_seed(0)
    linear = torch.nn.Linear(K, N, device="cuda")
    x = torch.randn(M, K, device="cuda")
    dy = torch.randn(M, N, device="cuda")
    results = {}
    for backend in ("scaled_mm", "emulated"):
        layer = Fp8Linear.from_linear(copy.deepcopy(linear), recipe(name, backend=backend))
        x_ = x.clone().requires_grad_(True)
        y = layer(x_)
        y.backward(dy)
        results[backend] = (y.detach(), x_.grad, layer.weight.grad)
    x_ = x.clone().requires_grad_(True)
    y_ref = linear(x_)
    y_ref.backward(dy)
    # Both layers quantize the same tensors to the same FP8 operands; the GEMMs differ by accumulation order and
    # at most one bf16 rounding of a rowwise kernel's result.
    for got, want in zip(results["scaled_mm"], results["emulated"]):
        assert _rel_err(got, want) < 2**-9 + 1e-3
    assert _sqnr_db(y_ref.detach(), results["scaled_mm"][0]) > 25
    assert _sqnr_db(x_.grad, results["scaled_mm"][1]) > 20
    assert _sqnr_db(linear.weight.grad, results["scaled_mm"][2]) > 20


def test_delayed_scaling_state_on_gpu():
    from fp8train.nn.linear import Fp8Linear, update_fp8_scales
    from fp8train.numerics.formats import get_format

    layer = Fp8Linear(K, N, bias=False, recipe="delayed").cuda()
    assert all(b.is_cuda for b in layer.buffers())
    e4m3, e5m2 = get_format("e4m3fn").max, get_format("e5m2").max
    seen = {"input": [], "weight": [], "grad_output": []}
    for step, gain in enumerate((1.0, 4.0, 0.5)):
        x = torch.randn(M, K, device="cuda") * gain
        dy = torch.randn(M, N, device="cuda") * gain * 1e-3
        layer(x).backward(dy)
        seen["input"].append(float(x.abs().max()))
        seen["weight"].append(float(layer.weight.detach().abs().max()))
        seen["grad_output"].append(float(dy.abs().max()))
        update_fp8_scales(layer)
        for role, fmt_max in (("input", e4m3), ("weight", e4m3), ("grad_output", e5m2)):
            history = getattr(layer, f"{role}_amax_history")
            assert history.is_cuda
            expected = list(reversed(seen[role]))  # newest first
            torch.testing.assert_close(history[:step + 1].cpu(), torch.tensor(expected), rtol=0, atol=0)
            scale = float(getattr(layer, f"{role}_scale"))
            assert scale == pytest.approx(max(seen[role]) / fmt_max, rel=1e-6)  # "max" over the history
            assert bool(getattr(layer, f"{role}_initialized"))


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_short_train_on_cuda(tmp_path, name):
    from fp8train.training.config import load_config
    from fp8train.training.data.corpus import stdlib_files
    from fp8train.training.loop import train

    _, files = stdlib_files()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(p.read_text(errors="replace") for p in files[:40])[:200_000])
    overrides = [f"run.dir={tmp_path / 'runs'}", f"run.name={name}", f"data.path={corpus}", f"fp8.recipe={name}",
                 "model.n_layers=2", "model.d_model=128", "model.n_heads=4", "model.seq_len=64",
                 "train.max_steps=8", "train.batch_size=8", "train.eval_every=4", "train.eval_batches=2",
                 "train.device=cuda", "optim.warmup_steps=2", "log.wandb=disabled", "log.every=1",
                 "checkpoint.every=0", "checkpoint.save_final=false", "policy.min_features=64"]
    summary = train(load_config(None, overrides), show_progress=False)
    assert summary["status"] == "completed", summary.get("reason")
    assert summary["fp8_layers"] > 0
    assert math.isfinite(summary["loss"]) and math.isfinite(summary["val_loss"])
    assert summary["loss"] < math.log(256)  # below the uniform guess over the byte vocabulary


def _blockwise_expected() -> bool:
    """cuBLAS has DeepSeek-style blockwise FP8 GEMMs on sm90 from CUDA 12.9, reached through F.scaled_mm."""
    cuda = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
    return HAS_SCALED_MM_V2 and torch.cuda.get_device_capability() == (9, 0) and cuda >= (12, 9)


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_every_gemm_reports_its_kernel_and_tensorwise_rowwise_reach_fp8(name):
    from fp8train.nn.linear import Fp8Linear

    layer = Fp8Linear(K, N, recipe=name).cuda()
    x = torch.randn(M, K, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    y.float().sum().backward()
    paths = layer.gemm_paths
    assert set(paths) == {"output", "grad_input", "grad_weight"}, paths
    if name in ("delayed", "current", "rowwise"):
        assert all(p.startswith("scaled_mm:") for p in paths.values()), paths
    if name == "block" and _blockwise_expected():
        assert all(p.startswith("scaled_mm:blockwise") for p in paths.values()), paths
    assert y.dtype == torch.bfloat16  # straight from the GEMM under autocast


# Each case is a cold Triton compile (~10-20 s on a fresh machine): the cases that decide are kept. Tensor scales
# are not powers of two (a division rounded one ulp off would change a byte, quant.eager_division_options); block
# scales are.
@pytest.mark.parametrize("kernel", ["compiled"])
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "block"])
def test_compiled_quantize_matches_eager_bytes_at_2_20_elements(kernel, fmt, granularity):
    import ml_dtypes
    import numpy as np

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1024, 1024, device="cuda", generator=g) * 3  # 2^20 elements
    kwargs = dict(granularity=granularity, block=(1, 128), pow2=granularity != "tensor")
    compiled = quantize(x, fmt, kernel=kernel, **kwargs)
    eager = quantize(x, fmt, kernel="eager", **kwargs)
    assert torch.equal(compiled.data.view(torch.uint8), eager.data.view(torch.uint8))
    assert torch.equal(compiled.scale, eager.scale)
    scaled = (x / eager.expanded_scale()).clamp(-eager.fmt.max, eager.fmt.max).cpu().numpy()
    ml = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]
    np.testing.assert_array_equal(eager.data.view(torch.uint8).cpu().numpy(), scaled.astype(ml).view(np.uint8))


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_no_host_sync_in_forward_backward_and_scale_update(name):
    from fp8train.nn.linear import Fp8Linear, update_fp8_scales

    layer = Fp8Linear(K, N, recipe=name).cuda()
    x = torch.randn(M, K, device="cuda", requires_grad=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.float().sum().backward()
        update_fp8_scales(layer)
    step()  # the first call may probe kernels and compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_no_host_sync_in_loop_steps_between_logging_steps(tmp_path):
    """The loop's promise on a GPU: the steps between sync points (here 2-3 and 5-7) make no host sync, the
    fused AdamW with found_inf, the device-side guard, clipping and the FP8 scale update included."""
    from fp8train.bench.gpu_sections import train_watching_syncs
    from fp8train.training.config import load_config

    overrides = [f"run.dir={tmp_path / 'runs'}", "run.name=nosync", "fp8.recipe=delayed", "model.n_layers=2",
                 "model.d_model=128", "model.n_heads=4", "model.seq_len=64", "train.max_steps=8",
                 "train.batch_size=8", "train.eval_every=0", "train.eval_batches=1", "train.device=cuda",
                 "log.wandb=disabled", "log.every=4", "log.telemetry_every=0", "checkpoint.every=0",
                 "checkpoint.save_final=false", "policy.min_features=64", "data.max_bytes=200000"]
    summary, syncs = train_watching_syncs(load_config(None, overrides))
    assert summary["status"] == "completed", summary.get("reason")
    assert syncs == []
