"""Reports: the verdict table, forest plot, gap and loss plots and per-layer FP8 health of a validation (or of
one run), rewritten from the files at any time (also while runs are missing).

    fp8train report runs/cpu_validate                     # a validation dir: report.md, *.png, summary.json
    fp8train report runs/cpu_validate/runs/current/seed1337   # a run dir: report.md, loss_curves.png, health.png

A plain run's own summary.json (train()'s) is never touched.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from fp8train.evidence import advisor, plots
from fp8train.evidence.completeness import (INCOMPLETE, fork_source_problem, headline_detail, incompleteness,
                                            source_note)
from fp8train.evidence.moe_report import expert_amax, moe_markdown, moe_summary, run_routing_markdown
from fp8train.evidence.pairing import check_pairing
from fp8train.evidence.run_plan import BASELINE, PLAN_FILE
from fp8train.evidence.layer_recipes import shadow_table
from fp8train.evidence.verdict import RunData, load_validation, summarize_validation
from fp8train.nn.recipes import ROLES
from fp8train.training.config import BASELINE_RECIPE, fp8_recipe_from_config, load_config
from fp8train.training.models.hf import HFCausalLM
from fp8train.training.runs.run_log import counted
from fp8train.training.storage.files import write_json_atomic, write_text_atomic
from fp8train.training.storage.claims import claim_folder
from fp8train.training.storage.outputs import write_output_set
from fp8train.training.storage.rundir import CONFIG_FILE, METRICS_FILE

__all__ = ["write_report", "write_validation_report", "write_run_report", "add_cli_arguments", "cli_main",
           "UNWRITABLE_REMEDY"]

# What to do when the folder to report on cannot be written: the report's files go into it, and nowhere else
UNWRITABLE_REMEDY = ("make it writable (chmod u+w), or copy the folder to one you can write (cp -r) and report the "
                     "copy")


def write_report(path: str | Path) -> dict:
    """Rewrite the report of a validation dir (has plan.json) or of a plain run dir (has metrics.jsonl)."""
    path = Path(path)
    return write_validation_report(path) if _is_validation(path) else write_run_report(path)


def _is_validation(path: Path) -> bool:
    """True for a validation dir, False for a run dir; anything else is refused, before anything is written."""
    if (path / PLAN_FILE).exists():
        return True
    if (path / METRICS_FILE).exists():
        return False
    raise ValueError(f"{path} is neither a validation directory ({PLAN_FILE}) nor a run directory ({METRICS_FILE})")


def _fmt(value, spec: str, none: str = "n/a") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return none
    return format(value, spec)


def _name(folder: Path) -> str:
    """The folder's own name for titles and labels, also when given as `.` or `..` (whose Path.name is empty)."""
    return Path(os.path.abspath(folder)).name


def _seconds(value) -> str:
    """"12 s", or "n/a" (not "n/a s") for a run that has not recorded its time (running, killed)."""
    return _fmt(value, ".0f") + " s" if _fmt(value, ".0f") != "n/a" else "n/a"


def _exclude_list(run: RunData) -> list[str]:
    config = run.dir / CONFIG_FILE
    if not config.exists():
        return []
    return list(load_config(str(config)).policy.exclude)  # a damaged config.yaml is one line naming it


# ------------------------------------------------------------------------------------------------------------
# Validation report
# ------------------------------------------------------------------------------------------------------------
def write_validation_report(vdir: str | Path) -> dict:
    vdir = Path(vdir)
    plan, runs = load_validation(vdir)
    check_pairing(vdir, plan, runs)  # runs that validate would refuse give no verdict here either
    summary = summarize_validation(plan, runs)
    # runs the plan needs have not ended: no verdict yet; a fork source changed since: said either way (completeness)
    incomplete, source = incompleteness(plan, summary, runs), fork_source_problem(plan)
    if incomplete is not None:
        summary.update(verdict=INCOMPLETE, verdict_so_far=summary["verdict"],
                       incomplete={**incomplete, "cannot_finish": source})
    summary["fork_source_changed"] = source if incomplete is None else None
    margin, drawn, base = summary["margin"], {}, _baseline(summary)
    tables = {label: advisor.layer_table([rec for r in by_seed.values() for rec in r.telemetry])
              for label, by_seed in runs.items() if label != BASELINE}
    # written aside and moved in together: a full disk leaves the earlier report whole, never a mix
    summary["moe"] = moe_summary(runs) or None  # MoE runs: routing agreement of every pair
    write_output_set(vdir, {
        "forest.png": lambda tmp: plots.plot_forest(tmp, summary["candidates"], margin, title=_name(vdir),
                                                    baseline=base),
        "gap.png": lambda tmp: plots.plot_gap_over_steps(tmp, summary["candidates"], margin, title=_name(vdir),
                                                         baseline=base),
        "loss_curves.png": lambda tmp: plots.plot_loss_curves(
            tmp, {(f"{base} baseline" if k == BASELINE else k): list(v.values()) for k, v in runs.items()},
            _name(vdir)),
        "health.png": lambda tmp: drawn.update(health=plots.plot_health(tmp, tables, title=_name(vdir))),
        "report.md": lambda tmp: write_text_atomic(tmp, _validation_markdown(vdir, plan, summary, runs, tables,
                                                                            drawn["health"])),
        "summary.json": lambda tmp: write_json_atomic(tmp, summary)}, "report", source=vdir)
    return summary


def _baseline(summary: dict) -> str:
    """The baseline's name in the report: the precision it ran in (bf16 autocast, or fp32 with autocast none)."""
    return summary.get("baseline_precision", "bf16")


def _verdict_table(summary: dict) -> list[str]:
    lines = ["| candidate | recipe | seeds | mean gap | one-sided 95% bounds | MDG | verdict | why | "
             f"speed vs {_baseline(summary)} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, c in summary["candidates"].items():
        needed = f"; ~{counted(c['seeds_needed'], 'seed')} would decide" if c.get("seeds_needed") and \
            "seeds" not in c["reason"] else ""
        lines.append(
            f"| {label} | `{c['recipe_code']}` | {c['seeds']} | {_fmt(c['gap_mean'], '+.2%')} "
            f"| [{_fmt(c['gap_lower'], '+.2%')}, {_fmt(c['gap_upper'], '+.2%')}] | {_fmt(c['mdg'], '.2%')} "
            f"| **{c['verdict'].upper()}** | {c['reason']}{needed} | {_fmt(c['speed_vs_bf16'], '.2f')}x |")
    return lines


def _seed_table(summary: dict, runs: dict) -> list[str]:
    seeds = summary["seeds"]
    lines = ["| run | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    base = summary["baseline_final_val_loss"]
    lines.append(f"| {_baseline(summary)} baseline (final-window val loss) | "
                 + " | ".join(_fmt(base.get(str(s)), ".4f") for s in seeds) + " |")
    for label, c in summary["candidates"].items():
        cells = []
        for s in seeds:
            gap, status = c["gaps"].get(str(s)), c["status"][str(s)]
            cells.append(_fmt(gap, "+.2%") if gap is not None else status)
        lines.append(f"| {label} (paired gap) | " + " | ".join(cells) + " |")
    return lines


def _how_to_read(summary: dict) -> list[str]:
    m, base = summary["margin"], _baseline(summary)
    return [
        f"How to read it: each seed trains the {base} baseline and every candidate from the same initial weights "
        "on the same batches, so a seed's paired gap is what the recipe alone changed. The verdict bounds the true "
        f"mean gap over seeds. **PASS**: the upper bound is at most the margin ({m:.2%}), so FP8 costs at most {m:.2%} "
        "(95% confidence). **FAIL**: a run diverged or the lower bound is above the margin. **INCONCLUSIVE**: "
        "the interval straddles the margin; more seeds (the count shown, at the observed spread) would decide. "
        "**INCOMPLETE**: runs the plan needs have not ended (still training, killed, or never started): no "
        "verdict yet. "
        "**MDG** (minimum detectable gap) is the smallest true gap this design detects with 80% power at the "
        "observed spread: a harmless candidate passes reliably only when MDG <= margin. A negative gap means FP8 "
        f"ended lower than {base}. Speed: median tokens/s over {base} (on CPU FP8 GEMMs are emulated in fp32, so "
        "CPU speed says nothing about GPU speed).", "", f"Method: {summary['method']}", ""]


def _validation_markdown(vdir, plan, summary, runs, tables, health_png) -> str:
    counts = {v: sum(c["verdict"] == v for c in summary["candidates"].values()) for v in ("pass", "fail",
                                                                                            "inconclusive")}
    incomplete = summary.get("incomplete")
    spread = summary["baseline_seed_spread_rel"]
    lines = [
        f"# FP8 validation: {_name(vdir)}", "",
        f"**Verdict: {summary['verdict'].upper()}** "
        + (f"({headline_detail(summary['incomplete'], summary['verdict_so_far'])}). So far: " if incomplete else "(")
        + f"{counts['pass']} pass, {counts['fail']} fail, "
        f"{counts['inconclusive']} inconclusive of {counted(len(summary['candidates']), 'candidate')}"
        + ("." if incomplete else ")"), "",
        *([source_note(summary["fork_source_changed"]), ""] if summary.get("fork_source_changed") else []),
        f"Declared margin (plan.json, written {plan.get('created', '?')} before any run): **{summary['margin']:.2%}** "
        f"relative validation-loss gap. {counted(len(summary['seeds']), 'paired seed')} {summary['seeds']}; final "
        f"window: the last {counted(summary['final_window'], 'evaluation point')}; "
        f"{counted(plan.get('max_steps'), 'step')}; config hash "
        f"`{plan['config_hash'][:12]}`.", "",
        *_fork_markdown(plan),
        "## Verdict", "", *_verdict_table(summary), "", *_cost_markdown(summary),
        f"For context, not a threshold: the {_baseline(summary)} seeds' final losses spread by "
        f"{_fmt(spread, '.2%')} (sd / mean); "
        "pairing removes most of that from the gaps.", "",
        *_how_to_read(summary),
        "## Paired gaps by seed", "", *_seed_table(summary, runs), "",
        "![forest plot of paired gaps](forest.png)", "",
        "## Gap over steps", "", "![mean paired gap over steps](gap.png)", "",
        "## Loss curves", "", "![loss curves](loss_curves.png)", "",
    ]
    diverged = {label: c["divergence"] for label, c in summary["candidates"].items() if c["divergence"]}
    if diverged:
        lines += ["## Divergence", ""]
        for label, events in diverged.items():
            for event in events:
                lines += [f"- **{label}**, seed {event['seed']}: {event['reason']}. Layers at that step (worst "
                          "first):"] + [f"  - {row}" for row in event["layers"]]
        lines.append("")
    if health_png:
        lines += ["## FP8 health", "", "![per-layer FP8 health](health.png)", ""]
    amaxes = {label: expert_amax([rec for r in by_seed.values() for rec in r.telemetry])
              for label, by_seed in runs.items() if label != BASELINE}
    lines += moe_markdown(vdir, summary.get("moe"), tables, amaxes)
    first = {label: next(iter(by_seed.values())) for label, by_seed in runs.items() if label != BASELINE}
    lines += _advisor_markdown({label: (tables[label], _exclude_list(first[label])) for label in tables})
    lines += _runs_table(summary)
    lines += _damage_markdown({f"{label}/seed{seed}": r for label, by_seed in runs.items()
                               for seed, r in by_seed.items()})
    return "\n".join(lines) + "\n"


def _damage_markdown(runs: dict) -> list[str]:
    """The damaged log lines that were skipped, per run (file and line each), when there are any."""
    damaged = {key: run.damage for key, run in runs.items() if run.damage}
    if not damaged:
        return []
    lines = ["## Damaged log lines (skipped)", ""]
    for key, messages in damaged.items():
        lines += [f"- {key}: {message}" for message in messages]
    return lines + [""]


def _fork_markdown(plan: dict) -> list[str]:
    """validate.fork_from: where every run started, and where each candidate's FP8 scaling state came from."""
    fork = plan.get("fork")
    if not fork:
        return []
    states = ", ".join(f"{label}: {state}" for label, state in fork["fp8_state"].items() if state != "none")
    return [f"Forked: every run of the plan starts from `{fork['checkpoint']}` (step {fork['step']} of a "
            f"`{fork['source_recipe']}` run, files sha256 `{fork['sha256'][:12]}`) and trained "
            f"{counted(plan.get('max_steps'), 'more step')}; FP8 scaling state: {states}.", ""]


def _cost_markdown(summary: dict) -> list[str]:
    """What the evidence cost, and what fixed designs would have run (verdict.evidence_cost)."""
    cost, seq = summary["cost"], summary.get("sequential")
    lines = []
    if seq:
        looks = ", ".join(f"{n}: {c:.3g}" for n, c in zip(seq["looks"], seq["critical"]))
        lines += [f"Design: validate.seeds=auto, looks at 2..{seq['max_seeds']} seeds, {seq['rule']} alpha "
                  f"spending (Lan & DeMets 1983), each look a t test at the alpha it spends; critical values "
                  f"(seeds: c) {looks}. A candidate stops at its first decided look.", ""]
    fixed = (f"; the fewest seeds with which a fixed design decides every candidate at the observed means and "
             f"spreads: {cost['fixed_design_seeds']} ({counted(cost['fixed_design_runs'], 'run')})"
             if cost["fixed_design_seeds"] else "")
    others = [f"{cost[key]} {what}" for key, what in (("running_runs", "running now"), ("unfinished_runs",
              "unfinished: no summary.json and no process holds it, killed?")) if cost.get(key)]
    started = f" (besides: {'; '.join(others)})" if others else ""
    lines += [f"Cost: **{counted(cost['runs'], 'run')}** ended{started}, {_seconds(cost['run_seconds'])} of run "
              f"time ({_fmt(cost['device_seconds'], '.0f')} device-seconds: wall time x processes), "
              f"{_fmt(cost['cpu_seconds'], '.0f')} CPU seconds (rank 0). Every planned seed "
              f"({len(summary['planned_seeds'])}) would have been {counted(cost['planned_seeds_runs'], 'run')}"
              f"{fixed}.", ""]
    return lines


def _runs_table(summary: dict) -> list[str]:
    lines = ["## Runs", "", "| run | status | final-window val loss | wall time | tokens/s |", "|---|---|---|---|---|"]
    for key, r in summary["runs"].items():
        lines.append(f"| {key} | {r['status']} | {_fmt(r['final_val_loss'], '.4f')} | "
                     f"{_seconds(r['wall_time_s'])} | {_fmt(r['tokens_per_s'], '.0f')} |")
    return lines + [""]


def _wrapper_prefix_note(layers: list[str]) -> list[str]:
    """Once per report, for a Hugging Face model: what the `hf.` in front of its layer names is."""
    prefix = HFCausalLM.wrapped_name_prefix
    if not any(name.startswith(prefix) for name in layers):
        return []
    return [f"Layer names are module paths in fp8train's wrapper of the transformers model: `{prefix}` "
            "followed by transformers' own name (`hf.model.layers.0.mlp.up_proj` is `model.layers.0.mlp.up_proj`). "
            "policy.exclude and policy.overrides match either form.", ""]


def _advisor_markdown(per_run: dict) -> list[str]:
    mean_t, worst_t = advisor.MEAN_THRESHOLDS, advisor.WORST_STEP_THRESHOLDS
    lines = ["## Advisor: layers to keep in high precision", "",
             f"A layer is flagged when, in any operand role, the mean over its sampled steps has SQNR below "
             f"{mean_t['sqnr_db_min']:g} dB, overflow (clipped) above {mean_t['overflow_frac_max']:.1%} or underflow "
             f"(flushed to zero) above {mean_t['underflow_frac_max']:.0%}; or when a single sampled step has SQNR "
             f"below {worst_t['sqnr_db_min']:g} dB, overflow above {worst_t['overflow_frac_max']:.0%}, underflow "
             f"above {worst_t['underflow_frac_max']:.0%} or staleness above {worst_t['staleness_max']:g}x (that step "
             "is named).", ""]
    lines += _wrapper_prefix_note([layer for health, _ in per_run.values() for layer in health])
    any_data = False
    for label, (health, exclude) in per_run.items():
        if not health:
            continue
        any_data = True
        flagged = advisor.by_policy_layer(advisor.advise(health))  # experts: their grouped layer
        if not flagged:
            lines += [f"- **{label}**: no layer crosses the thresholds; keep the current policy.", ""]
            continue
        layers = len(advisor.by_policy_layer(health))  # a grouped layer's experts count as one layer
        lines += [f"- **{label}**: {len(flagged)} of {layers} FP8 layers flagged. Paste into the config:", "",
                  "```yaml", "policy:", "  exclude:"]
        lines += [f"    - '{pattern}'" for pattern in exclude]
        for layer, reasons in sorted(flagged.items()):
            lines.append(f"    - '{advisor.exclude_regex(layer)}'  # {'; '.join(reasons[:2])}")
        lines += ["```", ""]
    if not any_data:
        lines += ["No FP8 telemetry was recorded (log.telemetry_every=0, or no FP8 layers).", ""]
    return lines


# ------------------------------------------------------------------------------------------------------------
# Plain run report
# ------------------------------------------------------------------------------------------------------------
def write_run_report(path: str | Path) -> dict:
    path = Path(path)
    run = RunData(path, _name(path))
    table, drawn = advisor.layer_table(run.telemetry), {}
    write_output_set(path, {  # written aside and moved in together (the report.md below with them)
        "loss_curves.png": lambda tmp: plots.plot_loss_curves(tmp, {run.label: [run]}, title=_name(path)),
        "health.png": lambda tmp: drawn.update(health=plots.plot_health(tmp, {run.label: table}, title=_name(path))),
        "report.md": lambda tmp: write_text_atomic(tmp, _run_markdown(path, run, table, drawn["health"]))}, "report",
        source=path)
    return {"status": run.status, "advisor": advisor.advise(table)}


def _run_markdown(path: Path, run: RunData, table: dict, health_png: bool) -> str:
    s = run.summary or {}
    recipe, steps = s.get("recipe") or _config_recipe(path), s.get("steps")
    if steps is not None:
        steps = counted(steps, "step")
    else:  # running or killed: no summary yet; its metrics.jsonl says how far it got
        logged = [*run.curve.train, *run.curve.val]  # step 0 logs its evaluation only
        steps = counted(max(logged), "logged step") if logged else "? steps"
    lines = [f"# Run report: {_name(path)}", "",
             f"Status {run.status}; recipe `{recipe}`; {steps}; final loss "
             f"{_fmt(s.get('loss'), '.4f')}, val loss {_fmt(s.get('val_loss'), '.4f')}; wall time "
             f"{_seconds(s.get('wall_time_s'))}; median {_fmt(run.tokens_per_s, '.0f')} tokens/s.", "",
             "![loss curves](loss_curves.png)", "", *_run_fork_markdown(s)]
    if health_png:
        lines += ["![per-layer FP8 health](health.png)", ""]
    lines += run_routing_markdown(s)
    lines += _advisor_markdown({run.label: (table, _exclude_list(run))})
    lines += _shadow_markdown(path, run.telemetry)
    lines += _damage_markdown({run.label: run})
    return "\n".join(lines) + "\n"


def _config_recipe(path: Path) -> str:
    """The recipe code the run's config.yaml names (what summary.json records when the run ends), or "?"."""
    try:
        recipe = fp8_recipe_from_config(load_config(str(path / CONFIG_FILE)))
    except (OSError, ValueError):  # missing or damaged: the report says "?" and _damage_markdown what it can
        return "?"
    return recipe.code() if recipe is not None else BASELINE_RECIPE


def _run_fork_markdown(summary: dict) -> list[str]:
    """train.fork_from: the checkpoint the run started from, as it recorded it just before loading."""
    fork = summary.get("fork")
    if not isinstance(fork, dict):
        return []
    return [f"Forked from `{fork.get('checkpoint')}` (step {fork.get('step')}, files sha256 "
            f"`{str(fork.get('sha256'))[:12]}`).", ""]


def _shadow_markdown(run_dir: Path, records: list[dict]) -> list[str]:
    """The worst layer per shadow recipe and role (log.shadow_recipes), when the run recorded any."""
    table = shadow_table(records)
    if not table:
        return []
    lines = ["## Recipe shadowing", "", "What each shadowed recipe would have done to this run's real operands "
             "(worst layer per role: lowest mean SQNR, highest overflow and underflow). "
             f"`fp8train layer-recipes {run_dir} --out layers.yaml` turns it into a recipe per layer.", "",
             "| recipe | role | min SQNR dB (layer) | max overflow | max underflow |", "|---|---|---|---|---|"]
    for rname in sorted({r for per_layer in table.values() for r in per_layer}):
        for role in ROLES:
            rows = [(layer, t[rname][role]) for layer, t in table.items() if role in t.get(rname, {})]
            if rows:
                layer, worst = min(rows, key=lambda row: row[1]["sqnr_db"])
                lines.append(f"| {rname} | {role} | {worst['sqnr_db']:.1f} ({layer}) "
                             f"| {max(r['overflow_frac'] for _, r in rows):.2%} "
                             f"| {max(r['underflow_frac'] for _, r in rows):.2%} |")
    return lines + [""]


# ------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------
def add_cli_arguments(parser) -> None:
    parser.add_argument("run_dir", help="a validation directory (with plan.json) or a run directory")


def cli_main(args) -> int:
    path = Path(args.run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} {'is not a directory' if path.exists() else 'does not exist'}")
    _is_validation(path)  # a folder that is neither: said before a claim file is made in it
    with claim_folder(path, "report", UNWRITABLE_REMEDY):  # two reports of one folder at once: one is refused
        summary = write_report(path)
    print(f"wrote {path / 'report.md'}" + (f" (verdict: {summary['verdict']})" if "verdict" in summary else ""))
    return 0
