"""Reports: the verdict table, loss and gap plots and per-layer FP8 health of a validation (or of one run).

    fp8train report runs/cpu_validate        # a validation dir: report.md, *.png, summary.json (rewritten)
    fp8train report runs/cpu_validate/runs/delayed    # a plain run dir: report.md, loss_curves.png, health.png

Everything is recomputed from the files (plan.json, each run's metrics.jsonl, summary.json, telemetry.jsonl),
so a report can be rewritten at any time, e.g. while runs are still missing. The verdict arithmetic lives in
fp8train.evidence.validate; the health tables and the advisor's thresholds in fp8train.training.telemetry. A plain run's own
summary.json is never touched.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from fp8train.training import telemetry
from fp8train.training.rundir import read_json, read_jsonl, write_json_atomic, write_text_atomic
from fp8train.evidence.plan import shadow_table
from fp8train.evidence.validate import BASELINE, PLAN_FILE, Curve, compare, load_curve

__all__ = ["write_report", "write_validation_report", "write_run_report", "add_cli_arguments", "cli_main"]

METRICS = (("overflow_frac", "overflow (clipped) %", 100.0), ("underflow_frac", "underflow (flushed to 0) %", 100.0),
           ("sqnr_db", "SQNR dB (higher is better)", 1.0))


def write_report(path: str | Path) -> dict:
    """Rewrite the report of a validation dir (has plan.json) or of a plain run dir (has metrics.jsonl)."""
    path = Path(path)
    if (path / PLAN_FILE).exists():
        return write_validation_report(path)
    if (path / "metrics.jsonl").exists():
        return write_run_report(path)
    raise ValueError(f"{path} is neither a validation directory ({PLAN_FILE}) nor a run directory (metrics.jsonl)")


# ------------------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------------------
class RunData:
    def __init__(self, run_dir: Path, label: str):
        self.dir, self.label = run_dir, label
        summary_path = run_dir / "summary.json"
        self.summary = read_json(summary_path) if summary_path.exists() else None
        self.curve = load_curve(run_dir)
        self.health = telemetry.layer_table(telemetry.load(run_dir / "telemetry.jsonl"))

    @property
    def status(self) -> str:
        if self.summary is None:
            return "running" if self.curve.val or self.curve.train else "missing"
        return self.summary.get("status", "unknown")

    @property
    def tokens_per_s(self) -> float | None:
        # Median of the logged steps: robust to the first step's warm-up and to resumes (wall time is not).
        return statistics.median(self.curve.tokens_per_s) if self.curve.tokens_per_s else None

    def exclude_list(self) -> list[str]:
        from omegaconf import OmegaConf

        config = self.dir / "config.yaml"
        if not config.exists():
            return []
        return list(OmegaConf.to_container(OmegaConf.load(config)).get("policy", {}).get("exclude", []))


# ------------------------------------------------------------------------------------------------------------
# Validation report
# ------------------------------------------------------------------------------------------------------------
def write_validation_report(vdir: str | Path) -> dict:
    vdir = Path(vdir)
    plan = read_json(vdir / PLAN_FILE)
    runs_root = vdir / "runs"
    base = RunData(runs_root / BASELINE, BASELINE)
    seeds = [RunData(runs_root / label, label) for label in plan["seeds"] if label != BASELINE]
    cands = [RunData(runs_root / c["label"], c["label"]) for c in plan["candidates"]]
    codes = {c["label"]: c.get("recipe_code", c["recipe"]) for c in plan["candidates"]}
    seed_curves = [s.curve.val for s in seeds if s.status == "completed"]
    margin, window = float(plan["margin"]), int(plan["final_window"])

    verdicts = {}
    for cand in cands:
        if base.status != "completed":
            v = compare(base.curve.val, cand.curve.val, seed_curves, margin, window, status=cand.status)
            v["pass"], v["reason"] = False, f"baseline {base.status}: no verdict possible"
        else:
            reason = (cand.summary or {}).get("reason")
            v = compare(base.curve.val, cand.curve.val, seed_curves, margin, window, cand.status, reason)
        v["recipe_code"] = codes[cand.label]
        v["wall_time_s"] = (cand.summary or {}).get("wall_time_s")
        v["tokens_per_s"] = cand.tokens_per_s
        v["speed_vs_bf16"] = (cand.tokens_per_s / base.tokens_per_s
                              if cand.tokens_per_s and base.tokens_per_s else None)
        div = (cand.summary or {}).get("divergence_telemetry")
        v["divergence_layers"] = _worst_layers(div) if div else None
        v["advisor"] = telemetry.advise(cand.health)
        verdicts[cand.label] = v

    overall = "pass" if verdicts and all(v["pass"] for v in verdicts.values()) else "fail"
    summary = {
        "verdict": overall, "margin": margin, "final_window": window, "baseline": BASELINE,
        "baseline_final_val_loss": _final(base.curve, window), "baseline_status": base.status,
        "noise_band_seeds": [s.label for s in seeds if s.status == "completed"],
        "advisor_thresholds": telemetry.ADVISOR_THRESHOLDS,
        "candidates": verdicts,
        "runs": {r.label: {"status": r.status, "wall_time_s": (r.summary or {}).get("wall_time_s"),
                           "tokens_per_s": r.tokens_per_s, "final_val_loss": _final(r.curve, window)}
                 for r in [base, *cands, *seeds]},
    }
    _plot_loss_curves(vdir / "loss_curves.png", base, cands, seeds, verdicts, title=vdir.name)
    _plot_gap(vdir / "gap.png", verdicts, margin, title=vdir.name)
    health_png = _plot_health(vdir / "health.png", {c.label: c.health for c in cands}, title=vdir.name)
    write_text_atomic(vdir / "report.md", _validation_markdown(vdir, plan, summary, base, cands, seeds, health_png))
    write_json_atomic(vdir / "summary.json", _jsonable(summary))
    return summary


def _final(curve: Curve, window: int) -> float | None:
    from fp8train.evidence.validate import final_window_mean

    value = final_window_mean(curve.val, window)
    return value if not math.isnan(value) else None


def _worst_layers(stats: dict, n: int = 3) -> list[str]:
    """The layers/roles that look worst in a one-step telemetry capture (non-finite first, then low SQNR)."""
    rows = []
    for layer, roles in stats.items():
        for role, s in roles.items():
            amax, sqnr = telemetry._number(s.get("amax")), telemetry._number(s.get("sqnr_db"))
            bad = s.get("nonfinite") or (amax is not None and not math.isfinite(amax))
            rows.append((0 if bad else 1, sqnr if sqnr is not None and math.isfinite(sqnr) else 1e9, layer, role, s))
    rows.sort(key=lambda r: (r[0], r[1]))
    return [f"{layer} {role}: amax {s.get('amax')}, SQNR {s.get('sqnr_db')}, overflow {s.get('overflow_frac')}, "
            f"underflow {s.get('underflow_frac')}" for _, _, layer, role, s in rows[:n]]


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _fmt(value, spec: str, none: str = "n/a") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return none
    return format(value, spec)


def _validation_markdown(vdir, plan, summary, base, cands, seeds, health_png) -> str:
    margin, window = summary["margin"], summary["final_window"]
    lines = [
        f"# FP8 validation: {vdir.name}", "",
        f"**Verdict: {summary['verdict'].upper()}** ({sum(v['pass'] for v in summary['candidates'].values())} of "
        f"{len(summary['candidates'])} candidates pass)", "",
        f"Declared margin (plan.json, written {plan.get('created', '?')} before any run): **{margin:.2%}** relative "
        f"validation-loss gap. Final window: mean of the last {window} evaluation points. Noise band from "
        f"{len(summary['noise_band_seeds'])} extra bf16 seed(s). Config hash `{plan['config_hash'][:12]}`, "
        f"{plan.get('max_steps')} steps.", "",
        "## Verdict", "",
        "| candidate | recipe | final val loss | abs gap | rel gap | noise band | threshold | first step out of band "
        "| verdict | wall time | speed vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, v in summary["candidates"].items():
        lines.append(
            f"| {label} | `{v['recipe_code']}` | {_fmt(v['final_val_loss'], '.4f')} | {_fmt(v['gap_abs'], '+.4f')} "
            f"| {_fmt(v['gap_rel'], '+.2%')} | {_fmt(v['noise_band_rel'], '.2%')} | {_fmt(v['threshold_rel'], '.2%')} "
            f"| {v['first_step_out_of_band'] if v['first_step_out_of_band'] is not None else '-'} "
            f"| **{'PASS' if v['pass'] else 'FAIL'}** ({v['reason']}) | {_fmt(v['wall_time_s'], '.0f')} s "
            f"| {_fmt(v['speed_vs_bf16'], '.2f')}x |")
    lines += ["", f"bf16 baseline final val loss: {_fmt(summary['baseline_final_val_loss'], '.4f')} ({base.status})."]
    band = max((v["noise_band_rel"] for v in summary["candidates"].values()
                if isinstance(v["noise_band_rel"], float) and math.isfinite(v["noise_band_rel"])), default=0.0)
    if band > margin:
        lines += ["", f"**Note:** the bf16 seed-noise band ({band:.2%}) is wider than the declared margin "
                  f"({margin:.2%}): at this run length two bf16 seeds differ by more than the margin, so the "
                  "threshold is the noise, not the margin; longer runs narrow it."]
    lines += [
        "",
        "How to read it: gap = candidate - baseline over the candidate's last evaluation points (same steps for "
        "both); rel gap = gap / baseline. Noise band = max over extra bf16 seeds of |seed - baseline| (final "
        "window), relative. A candidate **passes** when it ran to the end with finite losses and "
        "rel gap <= threshold = max(noise band, margin). The test is one-sided: FP8 better than bf16 (negative "
        "gap) passes. *First step out of band* is the first evaluation step where the per-step rel gap exceeds "
        "max(per-step band, margin); informative only (early steps are noisy). Speed = median tokens/s relative "
        "to bf16 (on CPU the FP8 GEMMs are emulated in fp32, so CPU speed says nothing about GPU speed).", "",
    ]
    failed = {k: v for k, v in summary["candidates"].items() if v["divergence_layers"]}
    if failed:
        lines += ["## Divergence", ""]
        for label, v in failed.items():
            lines += [f"- **{label}**: {v['reason']}. Layers at that step (worst first):"]
            lines += [f"  - {row}" for row in v["divergence_layers"]]
        lines.append("")
    lines += ["## Runs", "", "| run | seed | status | steps | final val loss | wall time | tokens/s |",
              "|---|---|---|---|---|---|---|"]
    for r in [base, *cands, *seeds]:
        s = r.summary or {}
        lines.append(f"| {r.label} | {s.get('seed', plan['seeds'].get(r.label, '-'))} | {r.status} "
                     f"| {s.get('steps', '-')} | {_fmt(summary['runs'][r.label]['final_val_loss'], '.4f')} "
                     f"| {_fmt(s.get('wall_time_s'), '.0f')} s | {_fmt(r.tokens_per_s, '.0f')} |")
    lines += ["", "## Plots", "", "![loss curves](loss_curves.png)", "", "![relative gap](gap.png)", ""]
    if health_png:
        lines += ["![per-layer FP8 health](health.png)", ""]
    lines += _advisor_markdown({c.label: (c.health, c.exclude_list()) for c in cands})
    return "\n".join(lines) + "\n"


def _shadow_markdown(run_dir: Path) -> list[str]:
    """The worst layer per shadow recipe and role (log.shadow_recipes), when the run recorded any."""
    table = shadow_table(read_jsonl(run_dir / "telemetry.jsonl"))
    if not table:
        return []
    lines = ["## Recipe shadowing", "", "What each shadowed recipe would have done to this run's real operands "
             "(worst layer per role: lowest mean SQNR, highest overflow and underflow). "
             f"`fp8train plan {run_dir} --out plan.yaml` turns it into a per-layer plan.", "",
             "| recipe | role | min SQNR dB (layer) | max overflow | max underflow |", "|---|---|---|---|---|"]
    for rname in sorted({r for per_layer in table.values() for r in per_layer}):
        for role in telemetry.ROLES:
            rows = [(layer, t[rname][role]) for layer, t in table.items() if role in t.get(rname, {})]
            if rows:
                layer, worst = min(rows, key=lambda row: row[1]["sqnr_db"])
                lines.append(f"| {rname} | {role} | {worst['sqnr_db']:.1f} ({layer}) "
                             f"| {max(r['overflow_frac'] for _, r in rows):.2%} "
                             f"| {max(r['underflow_frac'] for _, r in rows):.2%} |")
    return lines + [""]


def _advisor_markdown(per_run: dict) -> list[str]:
    t = telemetry.ADVISOR_THRESHOLDS
    lines = ["## Advisor: layers to keep in bf16", "",
             f"A layer is flagged when, averaged over the sampled steps, any operand role has SQNR below "
             f"{t['sqnr_db_min']:g} dB, overflow (clipped) above {t['overflow_frac_max']:.1%} or underflow "
             f"(flushed to zero) above {t['underflow_frac_max']:.0%}.", ""]
    any_data = False
    for label, (health, exclude) in per_run.items():
        if not health:
            continue
        any_data = True
        flagged = telemetry.advise(health)
        if not flagged:
            lines += [f"- **{label}**: no layer crosses the thresholds; keep the current policy.", ""]
            continue
        lines += [f"- **{label}**: {len(flagged)} of {len(health)} FP8 layers flagged. Paste into the config:", "",
                  "```yaml", "policy:", "  exclude:"]
        lines += [f"    - '{pattern}'" for pattern in exclude]
        for layer, reasons in sorted(flagged.items()):
            lines.append(f"    - '{telemetry.exclude_regex(layer)}'  # {'; '.join(reasons[:2])}")
        lines += ["```", ""]
    if not any_data:
        lines += ["No FP8 telemetry was recorded (log.telemetry_every=0, or no FP8 layers).", ""]
    return lines


# ------------------------------------------------------------------------------------------------------------
# Plain run report
# ------------------------------------------------------------------------------------------------------------
def write_run_report(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    run = RunData(run_dir, run_dir.name)
    s = run.summary or {}
    _plot_loss_curves(run_dir / "loss_curves.png", None, [run], [], {}, title=run_dir.name)
    health_png = _plot_health(run_dir / "health.png", {run.label: run.health}, title=run_dir.name)
    lines = [f"# Run report: {run_dir.name}", "",
             f"Status {run.status}; recipe `{s.get('recipe', '?')}`; {s.get('steps', '?')} steps; final loss "
             f"{_fmt(s.get('loss'), '.4f')}, val loss {_fmt(s.get('val_loss'), '.4f')}; wall time "
             f"{_fmt(s.get('wall_time_s'), '.0f')} s; median {_fmt(run.tokens_per_s, '.0f')} tokens/s.", "",
             "![loss curves](loss_curves.png)", ""]
    if health_png:
        lines += ["![per-layer FP8 health](health.png)", ""]
    lines += _advisor_markdown({run.label: (run.health, run.exclude_list())})
    lines += _shadow_markdown(run_dir)
    write_text_atomic(run_dir / "report.md", "\n".join(lines) + "\n")
    return {"status": run.status, "advisor": telemetry.advise(run.health)}


# ------------------------------------------------------------------------------------------------------------
# Plots (matplotlib, Agg: no display needed)
# ------------------------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _xy(points: dict[int, float]) -> tuple[list[int], list[float]]:
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def _band(base: RunData, seeds: list[RunData]) -> tuple[list[int], list[float], list[float]]:
    """Per evaluation step, baseline +- max |seed - baseline|."""
    steps, lows, highs = [], [], []
    for s in sorted(base.curve.val):
        spread = [abs(r.curve.val[s] - base.curve.val[s]) for r in seeds if s in r.curve.val]
        if spread:
            steps.append(s)
            lows.append(base.curve.val[s] - max(spread))
            highs.append(base.curve.val[s] + max(spread))
    return steps, lows, highs


def _label(run: RunData, verdicts: dict) -> str:
    v = verdicts.get(run.label)
    return run.label if v is None else f"{run.label} ({'pass' if v['pass'] else 'FAIL'})"


def _plot_loss_curves(path: Path, base: RunData | None, cands: list[RunData], seeds: list[RunData],
                      verdicts: dict, title: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3 if base is not None else 2, figsize=(18 if base is not None else 12, 5))
    colors = plt.get_cmap("tab10").colors
    styles = []  # (run, plot kwargs)
    if base is not None:
        styles.append((base, dict(color="black", lw=2.2, label=f"{BASELINE} baseline", zorder=5)))
        styles += [(r, dict(color="grey", lw=1, ls="--", label=r.label)) for r in seeds]
    styles += [(r, dict(color=colors[i % 10], lw=1.4, label=_label(r, verdicts))) for i, r in enumerate(cands)]
    band = _band(base, seeds) if base is not None and seeds else None

    ax = axes[0]
    for run, kw in styles:
        if run.curve.train:
            ax.plot(*_xy(run.curve.train), **kw)
    ax.set(title="training loss", xlabel="optimizer step", ylabel="loss (nats/token, log scale)", yscale="log")

    for ax, zoom in zip(axes[1:], (False, True)):
        for run, kw in styles:
            if run.curve.val:
                ax.plot(*_xy(run.curve.val), marker="o", ms=3, **kw)
        if band and band[0]:
            ax.fill_between(band[0], band[1], band[2], color="black", alpha=0.15, label="bf16 seed-noise band")
        ax.set(xlabel="optimizer step", ylabel="validation loss")
        if zoom:
            _zoom_second_half(ax, [run for run, _ in styles])
            ax.set_title("validation loss, second half (zoom)")
        else:
            ax.set(title="validation loss", yscale="log")
            ax.set_ylabel("validation loss (log scale)")
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
    axes[-1].legend(fontsize=8, loc="upper right")
    fig.suptitle(f"{title}: loss curves")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _zoom_second_half(ax, runs: list[RunData]) -> None:
    steps = sorted({s for r in runs for s in r.curve.val})
    if not steps:
        return
    start = steps[-1] / 2
    values = [v for r in runs for s, v in r.curve.val.items() if s >= start and math.isfinite(v)]
    if values:
        # Zoom on the runs near the baseline; a failed run far above is clipped rather than squashing the rest.
        low = min(values)
        ref = sorted(values)[len(values) // 2]
        high = min(max(values), ref + 3 * max(ref - low, 1e-3))
        pad = 0.05 * (high - low or 1e-3)
        ax.set_ylim(low - pad, high + pad)
    ax.set_xlim(start - (steps[-1] - start) * 0.05, steps[-1] * 1.02)


def _plot_gap(path: Path, verdicts: dict, margin: float, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 5.5))
    colors = plt.get_cmap("tab10").colors
    rows_any = next((v["per_step"] for v in verdicts.values() if v["per_step"]), [])
    if rows_any:
        steps = [r["step"] for r in rows_any]
        thr = [100 * r["threshold_rel"] for r in rows_any]
        ax.fill_between(steps, [-t for t in thr], thr, color="grey", alpha=0.2,
                        label="±threshold = max(seed band, margin)")
    ax.axhline(100 * margin, color="grey", ls="--", lw=1, label=f"±margin {margin:.1%}")
    ax.axhline(-100 * margin, color="grey", ls="--", lw=1)
    ax.axhline(0, color="black", lw=0.8)
    finite_gaps = []
    for i, (label, v) in enumerate(verdicts.items()):
        rows = [r for r in v["per_step"] if math.isfinite(r["gap_rel"])]
        if not rows:
            continue
        steps, gaps = [r["step"] for r in rows], [100 * r["gap_rel"] for r in rows]
        finite_gaps += gaps
        color = colors[i % 10]
        ax.plot(steps, gaps, marker="o", ms=3, color=color,
                label=f"{label}: final {_fmt(v['gap_rel'], '+.2%')} ({'pass' if v['pass'] else 'FAIL'})")
        out = v["first_step_out_of_band"]
        if out is not None and out in steps:
            ax.plot([out], [gaps[steps.index(out)]], marker="X", ms=11, color=color, mec="black", ls="none")
    # symlog: linear within a few margins (where the verdict is decided), logarithmic beyond, so a candidate
    # that is 50% off does not flatten the others to a line.
    linthresh = 100 * max(margin, 0.002) * 2
    ax.set_yscale("symlog", linthresh=linthresh)
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:+g}%" if v else "0"))
    ax.set(title=f"{title}: relative validation-loss gap of FP8 to bf16 (X = first step out of band)",
           xlabel="optimizer step", ylabel="(candidate - bf16) / bf16, % (symlog)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_health(path: Path, tables: dict[str, dict], title: str) -> bool:
    """Heatmaps, one per statistic: rows = layers, columns = run x role; cells annotated. False if no data."""
    tables = {k: t for k, t in tables.items() if t}
    if not tables:
        return False
    plt = _pyplot()
    import numpy as np
    from matplotlib.colors import LogNorm

    layers = sorted({layer for t in tables.values() for layer in t}, key=_layer_order)
    columns = [(run, role) for run, t in tables.items() for role in telemetry.ROLES
               if any(role in t.get(layer, {}) for layer in layers)]
    t = telemetry.ADVISOR_THRESHOLDS
    # Stacked panels (not side by side): each gets the full width, so layer names and cell values stay legible.
    fig, axes = plt.subplots(3, 1, figsize=(max(8.0, 0.75 * len(columns) + 4), 3 * (1.6 + 0.28 * len(layers))),
                             squeeze=False)
    for ax, (key, name, factor) in zip(axes[:, 0], METRICS):
        grid = np.full((len(layers), len(columns)), np.nan)
        for i, layer in enumerate(layers):
            for j, (run, role) in enumerate(columns):
                value = tables[run].get(layer, {}).get(role, {}).get(key)
                if value is not None:
                    grid[i, j] = min(value, 99.0) if key == "sqnr_db" else value * factor
        if key == "sqnr_db":  # low is bad: dark cells; an exact tensor (inf) shows as 99
            cmap = plt.get_cmap("magma").with_extremes(bad="#dddddd")
            image = ax.imshow(grid, aspect="auto", cmap=cmap, vmin=0, vmax=40)
            ax.set_title(f"{name}\nflag < {t['sqnr_db_min']:g} dB; grey = not FP8")
        else:
            positive = grid[np.isfinite(grid) & (grid > 0)]
            vmax = max(float(positive.max()) if positive.size else 1.0, 1.0)
            # exact zeros: white, below the log colour scale
            cmap = plt.get_cmap("viridis").with_extremes(bad="#dddddd", under="white")
            image = ax.imshow(np.where(grid > 0, grid, np.where(np.isfinite(grid), 1e-12, np.nan)), aspect="auto",
                              cmap=cmap, norm=LogNorm(vmin=min(1e-3, float(positive.min()) if positive.size else 1e-3),
                                                      vmax=vmax))
            limit = t["overflow_frac_max"] if key == "overflow_frac" else t["underflow_frac_max"]
            none = "; none anywhere" if not positive.size else ""
            ax.set_title(f"{name}, log colour\nflag > {100 * limit:g}%; white = 0, grey = not FP8{none}")
        for i in range(len(layers)):
            for j in range(len(columns)):
                value = grid[i, j]
                if not np.isfinite(value) or (key != "sqnr_db" and value <= 0):
                    continue
                if key == "sqnr_db":
                    text, dark = ("inf" if value >= 99 else f"{value:.0f}"), value < 20
                else:
                    text, dark = f"{value:.3g}", value < 0.05 * vmax
                ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
        ax.set_xticks(range(len(columns)))
        ax.set_xticklabels([f"{run}\n{role}" if len(tables) > 1 else role for run, role in columns], fontsize=7)
        ax.set_yticks(range(len(layers)))
        ax.set_yticklabels(layers, fontsize=7)
        fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
    fig.suptitle(f"{title}: per-layer FP8 health (mean over sampled steps)")
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _layer_order(name: str):
    import re

    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


# ------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------
def add_cli_arguments(parser) -> None:
    parser.add_argument("run_dir", help="a validation directory (with plan.json) or a run directory")


def cli_main(args) -> int:
    path = Path(args.run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    summary = write_report(path)
    print(f"wrote {path / 'report.md'}" + (f" (verdict: {summary['verdict']})" if "verdict" in summary else ""))
    return 0
