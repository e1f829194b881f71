"""The GPU check's parity section: does CUDA compute what fp8train's CPU emulation computes?

Two parts, one JSON line per case:

1. GEMM kinds, bit for bit. For every scaled-matmul kind (tensorwise, rowwise, the three block kinds, MX) and an
   fp32 and a bf16 output, operands of small integer FP8 values (-3..3) with power-of-two scales that differ per
   tile (exponents -3..3). Every product is an integer times a power of two, every partial sum inside one scale
   tile an integer below 2^11 (exact even in Hopper's ~14-bit accumulator) and the whole sum spans fewer than 24
   bits, so the exact result is representable in fp32: the kernel, the float64 reference (written here from the
   scale layout, not from fp8train's dequantize) and the CPU emulation must agree exactly. A transposed or
   misplaced scale changes the result by a power of two at once. The expected value is the reference rounded to
   what the plan says the kernel returns (bf16 where CUTLASS rowwise refuses fp32) and widened to the output.
2. Every recipe's Fp8Linear forward and backward on the device against an emulated copy on the CPU (same weights,
   input and gradient; the casts are bit-identical, so both multiply the same FP8 values): output, grad_input and
   grad_weight within nn.accumulation.accumulation_error_bound for the device's accumulation (fast accumulation
   in the forward: no promotion; promotion every 128 in the backward).

On a CPU (the suite, `--dry-run`) the device side is planned for sm90 and sm100 with `target_gpu` instead, every
planned call replayed on meta tensors (torch's own checks), and CPU `torch._scaled_mm` run where this torch has it.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from fp8train.nn.accumulation import HopperAccumulation, accumulation_error_bound
from fp8train.nn.gemm import Fp8Operand, fp8_mm
from fp8train.nn.linear import Fp8Linear
from fp8train.nn.recipes import RECIPE_NAMES, recipe
from fp8train.nn.scaled_gemm import (call_scaled_mm, device_capability, scaled_mm_call, scaled_mm_arguments,
                                     scaled_mm_gemm, target_gpu)
from fp8train.nn.scaled_mm_rules import SCALED_MM_KINDS

__all__ = ["kind_operands", "gemm_parity_cases", "linear_parity_cases", "section_parity", "section_capability"]

TARGET_GPUS = {"sm90": (9, 0), "sm100": (10, 0)}  # planned on any machine with target_gpu
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
OUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (a tile, b tile) of each kind in the operands' stored orientation: a (M, K), b stored (N, K) and passed as b.t()
_KIND_TILES = {"tensorwise": (None, None), "rowwise": ("row", "row"),
               "blockwise_1x128_128x128": ((1, 128), (128, 128)), "blockwise_1x128_1x128": ((1, 128), (1, 128)),
               "blockwise_128x128_1x128": ((128, 128), (1, 128)), "mx_1x32": ((1, 32), (1, 32))}
# The device's accumulation, as the Hopper model describes it: the forward asks for fast accumulation (one narrow
# accumulator over all of K) where the kind takes it; the backward and every block / MX kind promote every 128.
PROMOTED = HopperAccumulation(accumulator_bits=14, promotion_interval=128)
FAST = HopperAccumulation(accumulator_bits=14, promotion_interval=0)


def _scale_grid(tile, rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """Power-of-two scales (exponents -3..3) for one operand: (), (rows, 1) or the tile grid."""
    if tile is None:
        shape = ()
    elif tile == "row":
        shape = (rows, 1)
    else:
        shape = (-(-rows // tile[0]), -(-cols // tile[1]))
    return torch.exp2(torch.randint(-3, 4, shape, generator=g).float())


def kind_operands(kind: str, m: int, k: int, n: int, device: str, *, values: str = "integer",
                  a_dtype=torch.float8_e4m3fn, b_dtype=torch.float8_e4m3fn, seed: int = 0):
    """(a (M, K), b (K, N)) Fp8Operands laid out for `kind`: integer values -3..3 ('integer', exact references)
    or randn * 4 ('random', speed and capability probes), with per-tile power-of-two scales."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    draw = (lambda *s: torch.randint(-3, 4, s, generator=g).float()) if values == "integer" else (
        lambda *s: torch.randn(*s, generator=g) * 4)
    a_tile, b_tile = _KIND_TILES[kind]
    a_data, b_data = draw(m, k).to(a_dtype), draw(n, k).to(b_dtype)  # b stored (N, K), passed as b.t()
    a_scale, b_scale = _scale_grid(a_tile, m, k, g), _scale_grid(b_tile, n, k, g)
    block = lambda tile: tile if isinstance(tile, tuple) else None  # noqa: E731
    a = Fp8Operand(a_data.to(device), a_scale.to(device), block(a_tile))
    b = Fp8Operand(b_data.to(device), b_scale.to(device), block(b_tile)).t()
    return a, b


def _expanded_scale(scale: torch.Tensor, tile, rows: int, cols: int) -> torch.Tensor:
    """Each element's scale as a (rows, cols) float64 tensor, from the grid as kind_operands laid it out."""
    scale = scale.double().cpu()
    if not isinstance(tile, tuple):
        return scale.expand(rows, cols)  # () or (rows, 1): broadcast
    return scale.repeat_interleave(tile[0], 0)[:rows].repeat_interleave(tile[1], 1)[:, :cols]


def float64_reference(kind: str, a: Fp8Operand, b: Fp8Operand) -> torch.Tensor:
    """sum_k a[i, k] s_a[i, k] * b[k, j] s_b[k, j] in float64, the scales placed by the documented tiles."""
    a_tile, b_tile = _KIND_TILES[kind]
    (m, k), n = a.shape, b.shape[1]
    a_values = a.data.double().cpu() * _expanded_scale(a.scale, a_tile, m, k)
    b_stored = b.data.t()  # (N, K), the orientation its scale grid was drawn in
    b_scale = b.scale.t() if b.scale.dim() == 2 else b.scale
    b_values = b_stored.double().cpu() * _expanded_scale(b_scale, b_tile, n, k)
    return a_values @ b_values.t()


def _meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t


def _planned_case(kind, a, b, out_dtype, expected_fp64, capability) -> dict:
    """What the plan for `capability` says, replayed on meta tensors; the emulation modelling that GPU, exactly."""
    plan = scaled_mm_call(a, b, out_dtype=out_dtype, bias=None, use_fast_accum=False, capability=capability)
    case = dict(kind=plan.kind, reason=plan.reason)
    if plan.kind is None:
        return case
    out = call_scaled_mm({key: _meta(v) for key, v in plan.args.items()}, plan.rounds_to, None, plan.fast_accum)
    with target_gpu(capability):
        modelled = scaled_mm_gemm(a, b, out_dtype=out_dtype)
    expected = expected_fp64.to(plan.rounds_to).to(out_dtype)
    case.update(meta_shape=list(out.shape), rounds_to=str(plan.rounds_to).split(".")[-1],
                modelled_exact=bool(torch.equal(modelled.cpu(), expected)))
    return case


def gemm_parity_cases(device: str, m: int = 256, k: int = 512, n: int = 256) -> list[dict]:
    """Part 1: one dict per (kind, output dtype); `ok` False where any comparison is not exact."""
    cases = []
    capability = device_capability(device) if device == "cuda" else None
    for kind in SCALED_MM_KINDS:
        a, b = kind_operands(kind, m, k, n, "cpu")  # the emulation's copy; the device's: the same draw, moved
        exact = float64_reference(kind, a, b)
        if not torch.equal(exact.float().double(), exact):  # the construction promises this: internal error
            raise AssertionError(f"parity operands for {kind} are not exact in fp32 (internal error)")
        for out_name, out_dtype in OUT_DTYPES.items():
            case = dict(part="gemm", kind=kind, out=out_name)
            emulated = fp8_mm(a, b, "emulated", out_dtype=out_dtype)
            case["emulated_exact"] = bool(torch.equal(emulated.double().cpu(), exact.to(out_dtype).double()))
            ok = case["emulated_exact"]
            if device == "cuda":
                record, (a_dev, b_dev) = {}, kind_operands(kind, m, k, n, device)
                out = fp8_mm(a_dev, b_dev, "scaled_mm", out_dtype=out_dtype, record=record, gemm=kind)
                plan = scaled_mm_call(a_dev, b_dev, out_dtype=out_dtype, bias=None, use_fast_accum=False,
                                      capability=capability)
                rounds_to = plan.rounds_to if plan.kind else out_dtype
                case.update(path=record[kind], device_exact=bool(torch.equal(
                    out.double().cpu(), exact.to(rounds_to).to(out_dtype).double())))
                ok = ok and case["device_exact"]
            else:
                for gpu, cap in TARGET_GPUS.items():
                    case[gpu] = planned = _planned_case(kind, a, b, out_dtype, exact, cap)
                    ok = ok and planned.get("modelled_exact", True)
                case["cpu_scaled_mm"] = _cpu_scaled_mm(kind, a, b, out_dtype, exact)
                ok = ok and case["cpu_scaled_mm"] in ("exact", "refused")
            case["ok"] = bool(ok)
            cases.append(case)
    return cases


def _cpu_scaled_mm(kind, a, b, out_dtype, exact) -> str:
    """'exact', 'refused' (this CPU torch has no such kernel) or 'WRONG' for the CPU's own scaled matmul."""
    plan = scaled_mm_call(a, b, out_dtype=out_dtype, bias=None, use_fast_accum=False, capability=None)
    if plan.kind is None:
        return "refused"
    try:
        out = call_scaled_mm(plan.args, out_dtype, None, False)
    except (RuntimeError, ValueError, NotImplementedError):
        return "refused"
    return "exact" if torch.equal(out.double(), exact.to(out_dtype).double()) else "WRONG"


def _magnitude(t: torch.Tensor, fmt_rel: float) -> torch.Tensor:
    """An upper bound on |dequantized FP8 copy of t| elementwise: rounding to nearest moves a normal value by at
    most 2^-(mantissa bits + 1) of itself (fmt_rel), a subnormal one by half a subnormal step of its scale; the
    absolute term covers that for any scale these recipes choose (<= 2 amax / fmt max, pow2 rounding included)."""
    t = t.detach().double().cpu().abs()
    return t * (1 + fmt_rel) + float(t.max()) * 2.0 ** -17 + 2.0 ** -10


def linear_parity_cases(device: str, tokens: int = 256, in_features: int = 512, out_features: int = 256) -> list:
    """Part 2: one dict per (recipe, tensor); on a CPU the device layer is planned for sm90 (target_gpu)."""
    cases = []
    for name in RECIPE_NAMES:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(tokens, in_features, generator=g)
        dy = torch.randn(tokens, out_features, generator=g) * 1e-2
        reference = Fp8Linear(in_features, out_features, bias=False, recipe=recipe(name, backend="emulated"))
        layer = Fp8Linear(in_features, out_features, bias=False, recipe=recipe(name, backend="scaled_mm"
                                                                                if device == "cuda" else "auto"))
        layer.load_state_dict(reference.state_dict())
        results = []
        for module, dev in ((reference, "cpu"), (layer.to(device), device)):
            x_leaf = x.clone().to(dev).requires_grad_(True)  # its own leaf: .to() of a CPU tensor is itself
            with target_gpu(TARGET_GPUS["sm90"]) if dev == "cpu" and module is layer else contextlib.nullcontext():
                y = module(x_leaf)
                y.backward(dy.to(dev))
            results.append((y.detach().cpu(), x_leaf.grad.cpu(), module.weight.grad.cpu(), dict(module.gemm_paths)))
        (y_ref, gi_ref, gw_ref, _), (y, gi, gw, paths) = results
        w = reference.weight.detach()
        in_rel, w_rel, go_rel = (2.0 ** -4 if reference.recipe.format_of(r) == "e4m3fn" else 2.0 ** -3
                                 for r in ("input", "weight", "grad_output"))
        x_mag, w_mag, dy_mag = _magnitude(x, in_rel), _magnitude(w, w_rel), _magnitude(dy, go_rel)
        gemms = {"output": (y, y_ref, x_mag, w_mag.t()), "grad_input": (gi, gi_ref, dy_mag, w_mag),
                 "grad_weight": (gw, gw_ref, dy_mag.t(), x_mag)}
        for gemm, (got, want, a_mag, b_mag) in gemms.items():
            fast = gemm == "output" and reference.recipe.fast_accum_forward and not reference.recipe.is_tiled
            bound = accumulation_error_bound(a_mag, b_mag, FAST if fast else PROMOTED)
            if paths.get(gemm, "").startswith("fallback"):  # bf16 GEMM inputs on CUDA: pow2 scales keep them exact,
                bound = bound + (a_mag @ b_mag) * 2.0 ** -7  # tensorwise scales need not: one bf16 rounding each
            diff = (got.double() - want.double()).abs()
            used = float((diff / bound).max())  # bound > 0 everywhere: it has an absolute term
            cases.append(dict(part="linear", recipe=name, gemm=gemm, path=paths.get(gemm), ok=used <= 1,
                              max_diff_over_bound=used, max_abs_diff=float(diff.max())))
    return cases


def section_parity(device: str, dry: bool, out_dir: Path, limit_s: float) -> dict:
    cases = gemm_parity_cases(device) + linear_parity_cases(device, tokens=128 if dry else 256)
    (out_dir / "parity.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
    failed = [c for c in cases if not c["ok"]]
    return dict(ok=not failed, cases=len(cases), failed=failed, jsonl="parity.jsonl")


# ------------------------------------------------------------------------------------------------------------
# The capability section: which calls this torch + GPU accept at all (random values, errors against a dequantized GEMM)
# ------------------------------------------------------------------------------------------------------------
def _operands(kind: str, a_dtype, b_dtype, size: int, device: str):
    """(a (M, K), b (K, N)) Fp8Operands with the scale layout of `kind` (pow2 scales, so references are exact)."""
    return kind_operands(kind, size, size, size, device, values="random", a_dtype=a_dtype, b_dtype=b_dtype)


def section_capability(device: str, dry: bool, out_dir: Path, limit_s: float) -> dict:
    size = 128 if dry else 256
    kinds = SCALED_MM_KINDS
    cells = []
    for a_name, b_name in (("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3"), ("e5m2", "e5m2")):
        for kind in kinds:
            a, b = _operands(kind, FP8[a_name], FP8[b_name], size, device)
            reference = a.dequantize(torch.float32) @ b.dequantize(torch.float32)
            for layout in ("TN", "NN", "TT"):  # TN: the layout fp8train passes; NN / TT probe what is refused
                args = scaled_mm_arguments(a, b, kind)
                if layout == "NN":
                    args["mat_b"] = args["mat_b"].contiguous()
                if layout == "TT":
                    args["mat_a"] = args["mat_a"].t().contiguous().t()
                for out_dtype in (torch.bfloat16, torch.float32):
                    cell = dict(a=a_name, b=b_name, kind=kind, layout=layout, out=str(out_dtype).split(".")[-1])
                    try:
                        out = call_scaled_mm(args, out_dtype, None, False)
                        cell.update(ok=True, rel_err=float((out.float() - reference).norm() / reference.norm()))
                    except Exception as err:  # the point is to record what this build refuses, and how
                        cell.update(ok=False, error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
                    cells.append(cell)
    accepted = sorted({(c["kind"], c["a"], c["b"]) for c in cells if c["ok"] and c["layout"] == "TN"})
    return dict(ok=True, cells=cells, accepted_tn=[list(x) for x in accepted])
