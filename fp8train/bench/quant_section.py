"""``fp8train bench`` section quant: quantize throughput (G elements/s) per granularity, format and kernel.

Contenders: a naive eager chain (amax, divide, clamp, torch's float8 cast: the reference speedups are relative
to), fp8train's eager kernel, its native C kernel (numerics/native_cast.c, on CPU where it builds), its compiled
kernel (compile time reported apart, never inside the timing), delayed scaling's cast (a known scale, the amax
taken in the same single read), and an amax-only pass (one read of the tensor: what the memory system allows).
"""

from __future__ import annotations

import torch

from fp8train.bench.harness import paired_ratio, side_by_side
from fp8train.bench.options import QUANT_FORMATS, QUANT_LAYOUTS, BenchOptions, log
from fp8train.numerics import native_cast
from fp8train.numerics.formats import get_format
from fp8train.numerics.names import Granularity
from fp8train.numerics.quant import quantize

__all__ = ["bench_quant"]


def _naive_quantize(x: torch.Tensor, fmt, granularity: str, block: tuple[int, int]) -> torch.Tensor:
    """The textbook eager chain: amax, scale, divide, clamp, torch's float8 cast (the reference)."""
    if granularity == Granularity.TENSOR:
        amax = x.abs().max()
    elif granularity == Granularity.ROW:
        amax = x.abs().amax(dim=-1, keepdim=True)
    else:
        rows, cols = x.shape
        br, bc = block
        tiles = x.reshape(rows // br, br, cols // bc, bc)
        amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
        scale = (amax / fmt.max).clamp(min=1e-30)
        return (tiles / scale).clamp(-fmt.max, fmt.max).to(fmt.torch_dtype).reshape(rows, cols)
    scale = (amax / fmt.max).clamp(min=1e-30)
    return (x / scale).clamp(-fmt.max, fmt.max).to(fmt.torch_dtype)


def bench_quant(opts: BenchOptions, warmup: int, repeats: int) -> dict:
    numel = opts.quant_numel or (1 << 24)  # 16M: the size the targets are stated at
    cols = 4096 if numel >= 4096 * 128 else 1024
    rows = max(numel // cols // 128, 1) * 128
    x = torch.randn(rows, cols, device=opts.device)
    numel = x.numel()
    # --quick: both formats tensorwise, e4m3fn at the other granularities; compiled kernels only for tensorwise
    # e4m3fn there (each compile costs 5-25 s on a 2-core CPU).
    configs = [(g, b, f) for g, b in QUANT_LAYOUTS for f in QUANT_FORMATS
               if not (opts.quick and f != "e4m3fn" and g != "tensor")]
    rows_out = []
    for granularity, block, fmt_name in configs:
        fmt = get_format(fmt_name)
        label = granularity if granularity != Granularity.BLOCK else f"block {block[0]}x{block[1]}"

        def run(kernel, g=granularity, b=block, f=fmt_name):
            return lambda: quantize(x, f, granularity=g, block=b, kernel=kernel)

        def naive(g=granularity, b=block, f=fmt):
            return _naive_quantize(x, f, g, b)

        contenders = {"naive eager": naive, "fp8train eager": run("eager")}
        if native_cast.available() and opts.device == "cpu":  # the C kernel: no compile, timed like the others
            contenders["fp8train native"] = run("native")
        if granularity == Granularity.TENSOR and fmt_name == "e4m3fn":  # what the memory system allows right now
            contenders["reference: amax only (1 read)"] = lambda: torch.amax(x)
            if "fp8train native" in contenders:  # delayed scaling's cast: a known scale, the amax in the same pass
                known = torch.tensor(float(x.abs().max()) / fmt.max, device=opts.device)
                contenders["fp8train native, known scale + amax (delayed, 1 read)"] = \
                    lambda: quantize(x, fmt_name, scale=known, with_amax=True, validate_scale=False, kernel="native")
        if opts.compile != "off" and not (opts.quick and (granularity, fmt_name) != ("tensor", "e4m3fn")):
            contenders["fp8train compiled"] = run("compiled")
        first = {}
        timings = side_by_side(contenders, opts.device, warmup, repeats, first_call=first)
        base = timings["naive eager"]
        for name, timing in timings.items():
            rows_out.append({
                "granularity": label, "format": fmt_name, "path": name, "numel": numel,
                "gelem_per_s": numel / timing.median / 1e9,
                "speedup_vs_naive": 1.0 / paired_ratio(timing, base)["ratio"],
                "compile_s": max(first[name] - timing.median, 0.0) if "compiled" in name else None,
                **timing.summary(), **paired_ratio(timing, base),
            })
        log(f"quant {label} {fmt_name}: " + ", ".join(
            f"{n} {numel / t.median / 1e9:.2f} G el/s" for n, t in timings.items()))
    return {"numel": numel, "shape": list(x.shape), "rows": rows_out,
            "format_pairs": _format_pairs(x, opts, warmup, repeats)}


def _format_pairs(x: torch.Tensor, opts: BenchOptions, warmup: int, repeats: int) -> list[dict]:
    """e4m3fn against e5m2, interleaved in the same rounds (one format must not have a slow path): the speed
    ratio as the median of per-round ratios, so load that drifts between two sections' runs cancels."""
    kernel = "native" if native_cast.available() and opts.device == "cpu" else "eager"
    layouts = QUANT_LAYOUTS[:1] if opts.quick else QUANT_LAYOUTS
    out = []
    for granularity, block in layouts:
        label = granularity if granularity != Granularity.BLOCK else f"block {block[0]}x{block[1]}"
        timings = side_by_side({f: (lambda f=f: quantize(x, f, granularity=granularity, block=block, kernel=kernel))
                                for f in QUANT_FORMATS}, opts.device, warmup, repeats)
        paired = paired_ratio(timings["e5m2"], timings["e4m3fn"])  # e5m2 time / e4m3fn time = e4m3fn's speed ratio
        out.append({"granularity": label, "kernel": kernel, "speed_ratio_e4m3fn_e5m2": paired["ratio"],
                    "q1": paired["ratio_q1"], "q3": paired["ratio_q3"]})
        log(f"quant {label} {kernel}: e4m3fn / e5m2 speed {paired['ratio']:.2f}x (paired)")
    return out
