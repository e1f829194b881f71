"""The report of ``fp8train bench``: the issue's targets checked against the measured figures, and the tables
(every heading names the CPU, its relevant flags and the emulated GEMMs' compute dtype)."""

from __future__ import annotations

from fp8train.bench.distributed_section import format_distributed
from fp8train.bench.options import RECIPES, TARGET_SHAPE
from fp8train.nn.recipes import TENSORWISE_SCALINGS, ScalingKind

__all__ = ["check_targets", "format_report"]


def check_targets(results: dict, device: str) -> list[dict]:
    """The issue's targets against what this run measured (met: None when the figure was not measured)."""
    out = []

    def target(name, value, op, threshold, note=""):
        met = None if value is None else {">=": value >= threshold, "<=": value <= threshold,
                                          "<": value < threshold}[op]
        out.append({"target": name, "value": value, "op": op, "threshold": threshold, "met": met, "note": note})

    sections = results.get("sections", {})
    quant = {(r["granularity"], r["format"], r["path"]): r for r in sections.get("quant", {}).get("rows", [])}
    linear = {(tuple(r["shape"]), r["contender"]): r for r in sections.get("linear", {}).get("rows", [])}
    train = {r["contender"]: r for r in sections.get("train", {}).get("rows", [])}
    if device == "cpu":
        _quant_targets(quant, target)
        for pair in sections.get("quant", {}).get("format_pairs", []):  # one format must not have a slow path
            target(f"quantize {pair['granularity']} e4m3fn / e5m2 speed (paired)", pair["speed_ratio_e4m3fn_e5m2"],
                   ">=", 0.9, f"{pair['kernel']} kernel, same rounds")
        _ops_targets(sections.get("ops"), target)
        shape = "x".join(map(str, TARGET_SHAPE))
        for name in RECIPES:
            r, ao = linear.get((TARGET_SHAPE, name)), linear.get((TARGET_SHAPE, "torchao"))
            target(f"Fp8Linear {name} fwd+bwd {shape} (x fastest high-precision)", r and r["ratio_fastest_hp"],
                   "<=", 1.3 if name in TENSORWISE_SCALINGS else 1.5, "" if r is None else
                   f"fastest: {r['fastest_hp']}; {r['ratio']:.2f}x bf16, {r['ratio_fp32']:.2f}x fp32")
            target(f"Fp8Linear {name} fwd+bwd {shape} (x torchao Float8Linear)", r and ao and r["ratio_torchao"],
                   "<", 1.0, "" if ao else "torchao not measured")
        current = linear.get((TARGET_SHAPE, "current"))
        for name in (ScalingKind.BLOCK, ScalingKind.MXFP8):  # per-tile scales should cost little over tensorwise
            r = linear.get((TARGET_SHAPE, name))
            target(f"Fp8Linear {name} fwd+bwd {shape} (x current)", r and current and r["median_s"] /
                   current["median_s"], "<=", 1.25)
        for name in RECIPES:
            r = train.get(name)
            target(f"train step {name} (x bf16)", r and r["ratio"], "<=",
                   1.3 if name in TENSORWISE_SCALINGS else 1.5)
    else:
        for name in TENSORWISE_SCALINGS:
            r = linear.get(((8192, 8192, 8192), name))
            target(f"Fp8Linear {name} fwd+bwd 8192^3 speedup vs bf16", r and r["speedup_vs_bf16"], ">=", 1.5,
                   "" if r is None else f"{r['pct_of_2x']:.0f}% of the 2x FP8 ideal")
            ao = linear.get(((8192, 8192, 8192), "torchao"))
            target(f"Fp8Linear {name} 8192^3 time / torchao tensorwise", r and ao and r["ratio_torchao"],
                   "<=", 1.0, "" if ao else "torchao not measured")
        for name in TENSORWISE_SCALINGS:
            r = train.get(name)
            target(f"train step {name} speedup vs bf16 (~1B recipe)", r and r.get("speedup_vs_bf16"), ">=", 1.2)
    experts = sections.get("experts")
    for r in (experts or {}).get("rows", []):  # (both devices: the same shape, the fastest high precision there)
        if "target" in r:
            target(f"experts {r['contender']} fwd+bwd (x fastest high-precision grouped GEMM)", r["ratio"], "<=",
                   r["target"], f"fastest: {experts['fastest_high_precision']}")
    for r in sections.get("memory", {}).get("rows", []):
        if r["contender"] != "bf16":
            target(f"activation memory {r['contender']} (x bf16)", r["ratio"], "<=", 1.0)
    return out


def _quant_targets(quant: dict, target) -> None:
    """The fastest fp8train kernel per layout (what `quantize_kernel: auto` picks), 16M fp32 elements."""
    best: dict = {}
    for (gran, fmt, path), r in quant.items():
        if not path.startswith("fp8train") or "known scale" in path:  # (the target is for a scale from the amax)
            continue
        if (gran, fmt) not in best or r["gelem_per_s"] > best[(gran, fmt)]["gelem_per_s"]:
            best[(gran, fmt)] = r
    for (gran, fmt), r in best.items():
        target(f"quantize {gran} {fmt} {r['numel'] / 2**20:.0f}M (G el/s)", r["gelem_per_s"], ">=",
               1.5 if gran == "tensor" else 1.0, r["path"])



def _ops_targets(ops: dict | None, target) -> None:
    rows = {r["contender"]: r for r in (ops or {}).get("rows", [])}
    for name in RECIPES:
        r = rows.get(name)
        target(f"aten ops fwd+bwd 512x256->256 {name}", r and r["ops"], "<=", 50,
               "" if r is None else f"{r['ops_fresh_weight']} with a fresh weight copy; nn.Linear bf16 "
               f"{rows['nn.Linear bf16']['ops']}")
    update = (ops or {}).get("delayed_update_ops", {})
    target("aten ops of one delayed update, 8 layers (stacked)", update.get("8"), "<=", 60,
           f"1 layer: {update.get('1')}" if update else "")


def _fmt_ratio(r: dict, key: str = "ratio") -> str:
    if r.get(key) is None:
        return "-"
    q1, q3 = r.get(f"{key}_q1"), r.get(f"{key}_q3")
    return f"{r[key]:.2f}x" + (f" [{q1:.2f}-{q3:.2f}]" if q1 is not None else "")


def _table(header: list, rows: list) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def format_report(results: dict) -> str:
    m = results["machine"]
    where = f"({m['cpu']}, {m.get('cpu_flags', '?')}; GEMMs in {m.get('emulated_dtype', '?')})"
    parts = [_machine_line(m), _settings_line(results["settings"])]
    sections = results["sections"]
    for name, format_section in _SECTION_FORMATTERS:
        if name in sections:
            parts += format_section(sections, where)
    if results.get("targets"):
        rows = [[t["target"], "-" if t["value"] is None else f"{t['value']:.2f}", f"{t['op']} {t['threshold']}",
                 {True: "met", False: "MISSED", None: "not measured"}[t["met"]], t["note"]] for t in results["targets"]]
        parts.append("\ntargets\n" + _table(["target", "value", "target", "status", "note"], rows))
    parts += [f"note: {note}" for note in results.get("notes", [])]
    parts += [f"ERROR in section {name}: {err}" for name, err in results.get("errors", {}).items()]
    return "\n".join(parts)


def _machine_line(m: dict) -> str:
    return (f"machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), flags "
            f"{m.get('cpu_flags', '?')}; emulated FP8 GEMMs in {m.get('emulated_dtype', '?')}"
            + ("" if "native_bf16_gemm" not in m else " (fp32 results and K tiles: "
               + ("fp8train's native bf16 GEMM)" if m["native_bf16_gemm"] else "torch's fp32 GEMM)"))
            + "; torch "
            f"{m['torch']}, python {m['python']}, load average {m['load_average']}"
            + (f"; GPU {m['gpu']} (sm{m['gpu_capability']}, CUDA {m['cuda']})" if "gpu" in m else ""))


def _settings_line(s: dict) -> str:
    return (f"settings: device {s['device']}, quick={s['quick']}, warm-up {s['warmup']}, repeats "
            f"{s['repeats']} (quant {s.get('quant_repeats', s['repeats'])}; median; spreads are IQR of paired "
            f"per-round ratios), contenders interleaved round by round; malloc reuse (glibc mallopt, all "
            f"contenders): {s['malloc_tuning']}; linear/train quantize path: {s['fp8_path']}")


def _format_quant(sec: dict, where: str) -> list[str]:
    """Quantize throughput per granularity, format and kernel."""
    parts: list[str] = []
    q = sec["quant"]
    rows = [[r["granularity"], r["format"], r["path"], f"{r['gelem_per_s']:.2f}",
             f"{r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f}", f"{r['speedup_vs_naive']:.2f}x",
             "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"] for r in q["rows"]]
    parts.append(f"\nquantize, {q['numel'] / 2**20:.0f}M fp32 elements {tuple(q['shape'])} {where}\n" + _table(
        ["granularity", "format", "path", "G el/s", "min-max ms", "vs naive", "compile s"], rows))
    pairs = q.get("format_pairs", [])
    if pairs:
        parts.append("e4m3fn / e5m2 quantize speed, interleaved rounds: " + ", ".join(
            f"{p['granularity']} {p['speed_ratio_e4m3fn_e5m2']:.2f}x [{p['q1']:.2f}-{p['q3']:.2f}]" for p in pairs)
            + f" ({pairs[0]['kernel']} kernel)")
    return parts


def _format_ops(sec: dict, where: str) -> list[str]:
    """Top-level aten op counts per contender."""
    parts: list[str] = []
    o = sec["ops"]
    rows = [[r["contender"], r["ops"], "-" if r["ops_fresh_weight"] is None else r["ops_fresh_weight"],
             r.get("input_reads", "-")] for r in o["rows"]]
    parts.append(f"\ntop-level aten ops, one forward + .float().sum().backward() of 512x256->256 under bf16 "
                 f"autocast {where}; delayed update (stacked) for 1 / 8 layers: "
                 f"{o['delayed_update_ops'].get('1')} / {o['delayed_update_ops'].get('8')}\n"
                 + _table(["contender", "ops (weight copy reused)", "ops (fresh weight copy)",
                           "passes over the input (fp32 forward)"], rows))
    return parts


def _format_linear(sec: dict, where: str) -> list[str]:
    """Fp8Linear forward+backward against nn.Linear (and torchao)."""
    parts: list[str] = []
    rows = [["x".join(map(str, r["shape"])), r["contender"], f"{r['median_s'] * 1e3:.1f}",
             f"{r['q1_s'] * 1e3:.1f}-{r['q3_s'] * 1e3:.1f}", f"{r['tflops'] * 1e3:.1f}", _fmt_ratio(r),
             _fmt_ratio(r, "ratio_fp32"), "-" if r.get("ratio_torchao") is None else f"{r['ratio_torchao']:.2f}x"]
            + ([f"{r['pct_of_2x']:.0f}%", "-" if r.get("pct_of_peak") is None else f"{r['pct_of_peak']:.0f}%"]
               if "pct_of_2x" in r else []) for r in sec["linear"]["rows"]]
    header = ["MxKxN", "contender", "ms", "IQR ms", "GFLOP/s", "x bf16 [IQR]", "x fp32 [IQR]", "x torchao"]
    if any("pct_of_2x" in r for r in sec["linear"]["rows"]):
        header += ["% of 2x", "% of peak"]
    parts.append(f"\nlinear forward+backward {where} (bf16 = nn.Linear under bf16 autocast; FP8 rows under "
                 "autocast too)\n" + _table(header, rows))
    kernels = {r["contender"]: r["gemm_paths"] for r in sec["linear"]["rows"] if r.get("gemm_paths")}
    parts += [f"  {name} GEMMs: " + ", ".join(f"{g} {p}" for g, p in paths.items())
              for name, paths in kernels.items()]
    return parts


def _format_train(sec: dict, where: str) -> list[str]:
    """Train steps of the CPU recipe."""
    parts: list[str] = []
    t = sec["train"]
    rows = [[r["contender"], r["fp8_layers"], f"{r['median_s'] * 1e3:.1f}",
             f"{r['q1_s'] * 1e3:.1f}-{r['q3_s'] * 1e3:.1f}", f"{r['tokens_per_s']:.0f}", _fmt_ratio(r),
             _fmt_ratio(r, "ratio_fp32"), f"{r['step_peak_mb']:.1f}", f"{r['resident_mb']:.1f}"] for r in t["rows"]]
    md = t["model"]
    threads = f", {t['threads']} thread{'s' if t['threads'] != 1 else ''}" if t.get("threads") else ""
    if t.get("steps_per_round", 1) > 1:
        threads += f", {t['steps_per_round']} steps per timed round"
    parts.append(f"\ntrain step {where} ({t['config']}: {md['n_layers']} layers, d_model {md['d_model']}, "
                 f"{md['batch_size']}x{md['seq_len']} tokens{threads})\n" + _table(
                     ["contender", "fp8 layers", "ms/step", "IQR ms", "tokens/s", "x bf16 [IQR]",
                      "x fp32 [IQR]", "step peak MB", "resident MB"], rows))
    return parts


def _format_memory(sec: dict, where: str) -> list[str]:
    """Activation memory saved for backward."""
    parts: list[str] = []
    rows = [[r["contender"], f"{r['saved_mb']:.2f}", f"{r['ratio']:.2f}x", f"{100 * r['saved_fraction']:.0f}%",
             ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["by_dtype_mb"].items()))]
            for r in sec["memory"]["rows"]]
    parts.append(f"\nactivation memory saved for backward, one forward of {sec['memory']['tokens']} tokens\n"
                 + _table(["contender", "saved MB", "x bf16", "saved vs bf16", "by dtype (MB)"], rows))
    return parts


def _format_distributed(sec: dict, where: str) -> list[str]:
    """The multi-process section."""
    parts: list[str] = []
    parts.append(format_distributed(sec["distributed"]))
    return parts


# In the order they print (the order the suite runs them).
def _format_experts(sec: dict, where: str) -> list[str]:
    """FP8 grouped GEMMs (experts) against the fastest high-precision grouped GEMM (bench/experts_section.py)."""
    s = sec["experts"]
    shape = s["shape"]
    rows = [[r["contender"], f"{r['median_s'] * 1e3:.0f}", f"{r['q1_s'] * 1e3:.0f}-{r['q3_s'] * 1e3:.0f}",
             f"{r['tflops'] * 1e3:.1f}", _fmt_ratio(r)] for r in s["rows"]]
    return [f"\nexperts forward+backward {where}: {shape['experts']} experts, K={shape['k']}, N={shape['n']}, "
            f"{shape['tokens']} routed tokens in skewed groups {shape['group_sizes']}; ratios x the fastest "
            f"high-precision contender, {s['fastest_high_precision']} (torch grouped_mm runs here: "
            f"{s['grouped_mm_runs']})\n" + _table(["contender", "ms", "IQR ms", "GFLOP/s", "x fastest [IQR]"], rows)]


_SECTION_FORMATTERS = (("quant", _format_quant), ("ops", _format_ops), ("linear", _format_linear),
                       ("train", _format_train), ("memory", _format_memory), ("distributed", _format_distributed),
                       ("experts", _format_experts))
