"""The figures of a report (matplotlib with the Agg backend: no display needed; imported lazily, it is optional
for everything but reports).

- forest.png: per candidate, each seed's paired gap, the mean and its one-sided 95% bounds, against the margin;
- gap.png: the mean paired gap over steps with its interval, per candidate;
- loss_curves.png: training and validation loss of every run (the baseline black, seeds thin);
- health.png: per layer and operand, mean overflow, underflow and SQNR over the sampled steps;
- experts.png (MoE runs): per MoE block, tokens routed to each expert on the first validation batch, the baseline
  and every candidate, summed over seeds.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from fp8train.evidence import advisor
from fp8train.nn.recipes import ROLES
from fp8train.training.storage.files import write_file_atomic

__all__ = ["plot_forest", "plot_gap_over_steps", "plot_loss_curves", "plot_health", "plot_expert_tokens"]

HEALTH_METRICS = (("overflow_frac", "overflow (clipped) %", 100.0),
                  ("underflow_frac", "underflow (flushed to 0) %", 100.0),
                  ("sqnr_db", "SQNR dB (higher is better)", 1.0))
VERDICT_COLORS = {"pass": "tab:green", "fail": "tab:red", "inconclusive": "tab:orange"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _percent(value) -> float:
    return 100 * value if value is not None and math.isfinite(value) else math.nan


def _save(fig, plt, path: Path) -> None:
    fig.tight_layout()
    _write_png(fig, plt, path)


def _write_png(fig, plt, path: Path) -> None:
    # Whole or not at all, never through a link (storage.files.write_file_atomic); the temp name has no .png suffix,
    # so the format is named.
    try:
        write_file_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)


def plot_forest(path: Path, candidates: dict, margin: float, title: str, baseline: str = "bf16") -> None:
    """One row per candidate: seeds as dots, the mean as a square, [lower, upper] as a bar; margin dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.8 * max(1, len(candidates))))
    labels = list(candidates)
    for row, label in enumerate(labels):
        c = candidates[label]
        y = len(labels) - 1 - row
        color = VERDICT_COLORS.get(c["verdict"], "black")
        seeds = [_percent(g) for g in c["gaps"].values()]
        ax.plot(seeds, [y + 0.18] * len(seeds), "o", color="grey", ms=5, alpha=0.8,
                label="one seed's paired gap" if row == 0 else None)
        low, high, mean = _percent(c["gap_lower"]), _percent(c["gap_upper"]), _percent(c["gap_mean"])
        if math.isfinite(low) and math.isfinite(high):
            ax.plot([low, high], [y, y], "-", color=color, lw=3, label="one-sided 95% bounds" if row == 0 else None)
        if math.isfinite(mean):
            ax.plot([mean], [y], "s", color=color, ms=9, mec="black", label="mean gap" if row == 0 else None)
    ax.axvline(100 * margin, color="tab:red", ls="--", lw=1.2, label=f"margin {margin:.1%}")
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels([f"{lab} ({candidates[lab]['verdict'].upper()})" for lab in reversed(labels)], fontsize=9)
    ax.set_ylim(-0.6, len(labels) - 0.4)
    ax.set(xlabel=f"paired gap (FP8 - {baseline}) / {baseline} of the final-window validation loss, %",
           title=f"{title}: paired gaps over seeds (PASS when the upper bound is left of the margin)")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8, loc="best")
    _save(fig, plt, path)


def plot_gap_over_steps(path: Path, candidates: dict, margin: float, title: str, baseline: str = "bf16") -> None:
    """The mean paired gap at every evaluation step, with its one-sided 95% bounds shaded."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 5.5))
    colors = plt.get_cmap("tab10").colors
    ax.axhline(100 * margin, color="tab:red", ls="--", lw=1.2, label=f"margin {margin:.1%}")
    ax.axhline(0, color="black", lw=0.8)
    for i, (label, c) in enumerate(candidates.items()):
        rows = [r for r in c["per_step"] if r["step"] > 0 and math.isfinite(r["gap_mean"])]
        if not rows:
            continue
        steps, color = [r["step"] for r in rows], colors[i % 10]
        ax.plot(steps, [_percent(r["gap_mean"]) for r in rows], marker="o", ms=3, color=color,
                label=f"{label}: final {_percent(c['gap_mean']):+.2f}% ({c['verdict'].upper()})")
        low, high = [_percent(r["gap_lower"]) for r in rows], [_percent(r["gap_upper"]) for r in rows]
        if all(math.isfinite(v) for v in low + high):
            ax.fill_between(steps, low, high, color=color, alpha=0.15)
    # symlog: linear within a few margins (where verdicts are decided), logarithmic beyond, so a candidate far
    # off does not flatten the others to a line.
    ax.set_yscale("symlog", linthresh=100 * max(margin, 0.002) * 2)
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:+g}%" if v else "0"))
    ax.set(title=f"{title}: mean paired gap over steps (shaded: one-sided 95% bounds over seeds)",
           xlabel="optimizer step", ylabel=f"(FP8 - {baseline}) / {baseline} validation loss, % (symlog)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="best")
    _save(fig, plt, path)


def plot_loss_curves(path: Path, runs: dict[str, list], title: str) -> None:
    """``runs``: {label: [RunData, ...]} (one per seed), the baseline first. Training loss (log scale) and
    validation loss, the second half zoomed."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    colors = plt.get_cmap("tab10").colors
    for i, (label, seeds) in enumerate(runs.items()):
        kw = dict(color="black", lw=1.8, zorder=5) if i == 0 else dict(color=colors[(i - 1) % 10], lw=1.1)
        for j, run in enumerate(seeds):
            name = label if j == 0 else None
            if run.curve.train:
                axes[0].plot(*_xy(run.curve.train), label=name, alpha=0.8, **kw)
            for ax in axes[1:]:
                if run.curve.val:
                    ax.plot(*_xy(run.curve.val), marker="o", ms=2, label=name, alpha=0.8, **kw)
    axes[0].set(title="training loss", xlabel="optimizer step", ylabel="loss (nats/token, log scale)", yscale="log")
    axes[1].set(title="validation loss", xlabel="optimizer step", ylabel="validation loss (log scale)", yscale="log")
    _zoom_second_half(axes[2], [run for seeds in runs.values() for run in seeds])
    axes[2].set(title="validation loss, second half (zoom)", xlabel="optimizer step", ylabel="validation loss")
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
    axes[-1].legend(fontsize=8, loc="upper right")
    fig.suptitle(f"{title}: loss curves (one line per seed)")
    _save(fig, plt, path)


def _xy(points: dict[int, float]) -> tuple[list[int], list[float]]:
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def _zoom_second_half(ax, runs: list) -> None:
    steps = sorted({s for r in runs for s in r.curve.val})
    if not steps:
        return
    start = steps[-1] / 2
    values = sorted(v for r in runs for s, v in r.curve.val.items() if s >= start and math.isfinite(v))
    if values:
        # Zoom on the runs near the middle; a failed run far above is clipped rather than squashing the rest.
        low, ref = values[0], values[len(values) // 2]
        high = min(values[-1], ref + 3 * max(ref - low, 1e-3))
        pad = 0.05 * (high - low or 1e-3)
        ax.set_ylim(low - pad, high + pad)
    if steps[-1] > 0:
        ax.set_xlim(start - (steps[-1] - start) * 0.05, steps[-1] * 1.02)
    else:  # only the step-0 evaluation so far (a run that has just started): one step wide around it, not [0, 0]
        ax.set_xlim(-1, 1)


def plot_health(path: Path, tables: dict[str, dict], title: str) -> bool:
    """Heatmaps, one per statistic: rows = layers, columns = run x role; cells annotated. False if no data."""
    tables = {k: t for k, t in tables.items() if t}
    if not tables:
        return False
    plt = _pyplot()
    layers = sorted({layer for t in tables.values() for layer in t}, key=_layer_order)
    columns = [(run, role) for run, t in tables.items() for role in ROLES
               if any(role in t.get(layer, {}) for layer in layers)]
    # Stacked panels (not side by side): each gets the full width, so layer names and cell values stay legible.
    fig, axes = plt.subplots(3, 1, figsize=(max(8.0, 0.75 * len(columns) + 4), 3 * (1.6 + 0.28 * len(layers))),
                             squeeze=False)
    for ax, (key, name, factor) in zip(axes[:, 0], HEALTH_METRICS):
        grid = [[_cell(tables[run].get(layer, {}).get(role, {}).get(key), key, factor) for run, role in columns]
                for layer in layers]
        _heatmap(fig, ax, plt, grid, key, name)
        ax.set_xticks(range(len(columns)))
        ax.set_xticklabels([f"{run}\n{role}" if len(tables) > 1 else role for run, role in columns], fontsize=7)
        ax.set_yticks(range(len(layers)))
        ax.set_yticklabels(layers, fontsize=7)
    fig.suptitle(f"{title}: per-layer FP8 health (mean over sampled steps and seeds)")
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    _write_png(fig, plt, path)
    return True


def plot_expert_tokens(path: Path, moe: dict, title: str) -> bool:
    """experts.png from moe_report.moe_summary's {candidate: {seed: {block: row}}}; False when there is none."""
    totals: dict = {}  # block -> {"bf16" or candidate: per-expert counts summed over seeds}
    for n, (label, by_seed) in enumerate(moe.items()):
        for blocks in by_seed.values():
            for block, row in blocks.items():
                per = totals.setdefault(block, {})
                # every candidate's pair holds the same bf16 run of that seed: its counts are taken once
                pairs = ((("bf16", row["baseline_tokens"]),) if n == 0 else ()) + ((label, row["candidate_tokens"]),)
                for key, counts in pairs:
                    per[key] = [a + b for a, b in zip(per.get(key, [0] * len(counts)), counts)]
    if not totals:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(totals), figsize=(5 * len(totals), 3.6), squeeze=False)
    for ax, (block, per) in zip(axes[0], sorted(totals.items(), key=lambda kv: _layer_order(kv[0]))):
        labels = list(per)
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            xs = [e + (i - (len(labels) - 1) / 2) * width for e in range(len(per[label]))]
            ax.bar(xs, per[label], width, label=label, color="black" if label == "bf16" else None)
        ax.set_xticks(range(len(per[labels[0]])))
        ax.set_xlabel("expert")
        ax.set_ylabel("tokens routed (first validation batch)")
        ax.set_title(block, fontsize=9)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{title}: tokens per expert, bf16 vs FP8")
    _save(fig, plt, path)
    return True


def _cell(value, key: str, factor: float) -> float:
    if value is None:
        return math.nan
    return min(value, 99.0) if key == "sqnr_db" else value * factor  # an exact tensor (SQNR inf) shows as 99


def _heatmap(fig, ax, plt, grid: list[list[float]], key: str, name: str) -> None:
    import numpy as np
    from matplotlib.colors import LogNorm

    grid = np.array(grid, dtype=float)
    t = advisor.MEAN_THRESHOLDS
    if key == "sqnr_db":  # low is bad: dark cells
        image = ax.imshow(grid, aspect="auto", cmap=plt.get_cmap("magma").with_extremes(bad="#dddddd"), vmin=0, vmax=40)
        ax.set_title(f"{name}\nflag: mean < {t['sqnr_db_min']:g} dB; grey = not FP8")
    else:
        positive = grid[np.isfinite(grid) & (grid > 0)]
        vmax = max(float(positive.max()) if positive.size else 1.0, 1.0)
        vmin = min(1e-3, float(positive.min()) if positive.size else 1e-3)
        cmap = plt.get_cmap("viridis").with_extremes(bad="#dddddd", under="white")  # exact zeros: white
        shown = np.where(grid > 0, grid, np.where(np.isfinite(grid), 1e-12, np.nan))
        image = ax.imshow(shown, aspect="auto", cmap=cmap, norm=LogNorm(vmin=vmin, vmax=vmax))
        limit = t["overflow_frac_max"] if key == "overflow_frac" else t["underflow_frac_max"]
        none = "; none anywhere" if not positive.size else ""
        ax.set_title(f"{name}, log colour\nflag: mean > {100 * limit:g}%; white = 0, grey = not FP8{none}")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if not np.isfinite(value) or (key != "sqnr_db" and value <= 0):
                continue
            if key == "sqnr_db":
                text, dark = ("inf" if value >= 99 else f"{value:.0f}"), value < 20
            else:
                text, dark = f"{value:.3g}", value < 0.05 * vmax
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
    fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02)


def _layer_order(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
