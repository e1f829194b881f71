"""kv-eval's report files: kv_eval.json, kv_eval.md and kv_eval.png."""

from __future__ import annotations

import json
import math
from pathlib import Path

from fp8train.training.storage.outputs import check_output_files, write_output_set

__all__ = ["REPORT_FILES", "check_report_folder", "write_report", "format_stat", "kib", "weights_label"]

# ------------------------------------------------------------------------------------------------------------
# Report files
# ------------------------------------------------------------------------------------------------------------

def weights_label(result: dict, cell: dict) -> str:
    """How a cell's weights are named to a reader: the high-precision ones by the dtype they computed in (kv-eval
    keys them "bf16"; a run without bf16 autocast computed in fp32)."""
    return result.get("weights_dtype", "bf16") if cell["weights"] == "bf16" else cell["weights"]

def format_stat(stat: dict, scale: float = 1.0, digits: int = 4) -> str:
    mean, ci = stat["mean"] * scale, stat["ci95"] * scale
    return f"{mean:.{digits}g} ± {ci:.2g}" if math.isfinite(ci) else f"{mean:.{digits}g}"


def kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB" if n < 2**20 else f"{n / 2**20:,.1f} MiB"


REPORT_FILES = {"json": "kv_eval.json", "md": "kv_eval.md", "png": "kv_eval.png"}


def check_report_folder(out_dir, force: bool, run_dir) -> Path:
    """Before the evaluation: ``out_dir`` takes the report files (outputs.check_output_files: an earlier report is
    replaced only with --force, nothing is written through a link, the run's own files are never replaced)."""
    return check_output_files(out_dir, REPORT_FILES.values(), force=force, sources=[run_dir])


def write_report(result: dict, out_dir, run_dir=None) -> dict:
    """kv_eval.json, kv_eval.md and kv_eval.png in ``out_dir`` (created as an fp8train output folder if absent),
    written aside and moved in together (outputs.write_output_set): all three or none, never through a link;
    returns their paths. A ``run_dir`` (the default ``out_dir`` is in it) deleted meanwhile is not made again."""
    out_dir = Path(out_dir)
    write_output_set(out_dir, {REPORT_FILES["json"]: lambda tmp: tmp.write_text(json.dumps(result, indent=1)),
                               REPORT_FILES["md"]: lambda tmp: tmp.write_text(_markdown(result)),
                               REPORT_FILES["png"]: lambda tmp: _plot(result, tmp)}, "kv-eval",
                     source=None if run_dir is None else Path(run_dir))
    return {key: str(out_dir / name) for key, name in REPORT_FILES.items()}


def _markdown(r: dict) -> str:
    m = r["manifest"]
    lines = ["# FP8 KV-cache evaluation", "",
             f"Run `{m['run_dir']}`, checkpoint {m['checkpoint']} (step {m['checkpoint_step']}), seed {m['seed']}, "
             f"trained with recipe `{m['run_recipe']}`; weights: {m['weights_loaded_as']}; autocast {m['autocast']}; "
             f"backend {m['backend']}.", "",
             f"Cache: formats {', '.join(m['formats'])}; FP8 tensors {', '.join(m['kv'])}; granularity "
             f"{m['granularity']}; scale source {m['scale_source']}; margin {m['margin']}"
             f"{' (pow2 scales)' if m['pow2'] else ''}. Reference: {m['reference_cache']}. KL: {m['kl']}. "
             f"Intervals: {m['ci']}.", "",
             f"Evaluated on {m['eval']['sequences']} validation sequences x {m['eval']['positions']} positions."]
    if m["calibration"]:
        c = m["calibration"]
        lines.append(f"Calibration split: {c['split']} ({c['how']}), {c['sequences']} sequences, {c['tokens']} tokens.")
    lines += ["", "## KV memory", "", "| cache | per token | per full context |", "|---|---|---|"]
    for row in r["memory"]["rows"]:
        lines.append(f"| {row['cache']} | {kib(row['bytes_per_token'])} ({row['bytes_per_token']} B) | "
                     f"{kib(row['bytes_per_context'])} ({row['seq_len']} tokens) |")
    s = r["memory"]["scale_bytes_static"]
    lines += ["", f"Scales (not in the payload above): static per-tensor {s['tensor']} B, per-head {s['head']} B per "
              "model (fp32, K and V); dynamic per-token-per-head scales would add 8 B x layers x KV heads per token.",
              "", "## Overall", "",
              "| weights | cache | loss | Δloss vs bf16 cache | KL | accuracy | Δaccuracy | greedy exact match | "
              "K clip / underflow | V clip / underflow |", "|---|---|---|---|---|---|---|---|---|---|"]
    for cell in r["cells"]:
        o, g, h = cell["overall"], cell["generation"], cell["health"]
        health = {t: f"{100 * v['clip_frac']:.3g}% / {100 * v['underflow_frac']:.3g}%"
                  for t, v in (h["overall"].items() if h else [])}
        greedy = "-" if g is None else f"{100 * g['exact_match']:.0f}% (prefix {g['mean_agreeing_prefix']:.1f})"
        lines.append(f"| {weights_label(r, cell)} | {cell['cache']} | {format_stat(o['loss'])} | "
                     f"{format_stat(o['loss_delta'])} | "
                     f"{format_stat(o['kl'])} | {format_stat(o['accuracy'])} | {format_stat(o['accuracy_delta'])} | {greedy} | "
                     f"{health.get('k', '-')} | {health.get('v', '-')} |")
    if m["matrix"]:
        lines += ["", "## Weights x cache (Δ vs bf16 weights, bf16 cache)", "",
                  "| weights | cache | Δloss | KL |", "|---|---|---|---|"]
        for cell in r["cells"]:
            o = cell["overall"]
            lines.append(f"| {weights_label(r, cell)} | {cell['cache']} | {format_stat(o['loss_delta_vs_bf16_bf16'])} | "
                         f"{format_stat(o['kl_vs_bf16_bf16']) if 'kl_vs_bf16_bf16' in o else '-'} |")
    lines += ["", "## By context position", ""]
    for cell in r["cells"]:
        if cell["cache"] == "bf16":
            continue
        lines += [f"### weights {weights_label(r, cell)}, cache {cell['cache']}", "",
                  "| positions | Δloss | KL | accuracy | Δaccuracy |", "|---|---|---|---|---|"]
        for b in cell["by_position"]:
            lines.append(f"| {b['positions'][0]}-{b['positions'][1]} | {format_stat(b['loss_delta'])} | {format_stat(b['kl'])} | "
                         f"{format_stat(b['accuracy'])} | {format_stat(b['accuracy_delta'])} |")
        lines.append("")
    lines += _health_lines(r)
    lines.append("Plot: kv_eval.png (Δloss and KL against context position, 95% intervals).")
    return "\n".join(lines) + "\n"


def _health_lines(r: dict) -> list[str]:
    lines = ["## Cache health by layer (clip % / underflow %; per head in kv_eval.json)", ""]
    for cell in r["cells"]:
        if cell["health"] is None or cell["weights"] != "bf16":
            continue
        lines += [f"{cell['cache']}:", "", "| layer | tensor | clip % | underflow % | worst head clip % |",
                  "|---|---|---|---|---|"]
        for row in cell["health"]["layers"]:
            lines.append(f"| {row['layer']} | {row['tensor']} | {100 * row['clip_frac']:.3g} | "
                         f"{100 * row['underflow_frac']:.3g} | {100 * max(row['clip_frac_per_head']):.3g} |")
        lines.append("")
    return lines


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fp8_cells = [c for c in r["cells"] if c["cache"] != "bf16"]
    fig, (ax_loss, ax_kl) = plt.subplots(1, 2, figsize=(12, 4.5 + 0.25 * len(fp8_cells)))
    colors = plt.get_cmap("tab20" if len(fp8_cells) > 10 else "tab10").colors
    for i, cell in enumerate(fp8_cells):
        mids = [(lo + hi) / 2 for lo, hi in (b["positions"] for b in cell["by_position"])]
        label = cell["cache"] if not r["manifest"]["matrix"] else f"{cell['weights']} weights, {cell['cache']}"
        style = dict(color=colors[i % len(colors)], capsize=3, label=label,
                     marker="o" if cell["weights"] == "bf16" else "s", ls="-" if cell["weights"] == "bf16" else "--")
        for ax, key in ((ax_loss, "loss_delta"), (ax_kl, "kl")):
            ys = [b[key]["mean"] for b in cell["by_position"]]
            errs = [0 if not math.isfinite(b[key]["ci95"]) else b[key]["ci95"] for b in cell["by_position"]]
            ax.errorbar(mids, ys, yerr=errs, **style)
    ax_loss.axhline(0, color="gray", lw=0.8)
    ax_loss.set(xlabel="context position (bucket midpoint)", ylabel="loss(FP8 cache) - loss(bf16 cache) [nats]",
                title="Loss delta by position (95% CI)")
    ax_kl.set(xlabel="context position (bucket midpoint)", ylabel="KL(bf16 cache || FP8 cache) [nats/token]",
              title="Next-token KL by position (95% CI)")
    m = r["manifest"]
    fig.suptitle(f"FP8 KV cache, step {m['checkpoint_step']}: {m['granularity']} scales, {m['scale_source']}, "
                 f"margin {m['margin']}")
    for ax in (ax_loss, ax_kl):
        ax.grid(alpha=0.3)
    # One legend under both panels, so it never covers the curves.
    handles, labels = ax_loss.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, max(1, len(labels))), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.035 * math.ceil(len(labels) / 3), 1, 1))
    try:
        fig.savefig(path, dpi=120, format="png")
    finally:
        plt.close(fig)

