"""The mixture-of-experts part of a validation report: routing agreement and per-expert FP8 health.

Routing agreement. Every MoE run's summary.json holds, per MoE block, the routing of the first validation batch
by the run's final weights (training.models.moe.routing_snapshot): each token's top_k experts and the
assignments per expert. The runs of a pair see the same tokens, so for each candidate, seed and block:

    flipped = (routing decisions (token, expert) the FP8 run made that the bf16 run did not) / (tokens x top_k)

0 means FP8 routes every token to the same experts. It measures the end state of two trainings that started
from the same weights: what FP8 rounding changed in the routers' inputs and weights over the whole run, not one
forward's rounding alone. The per-expert counts (bf16, FP8 and their difference) show whether the flips move
load between experts or only swap decisions.

Per-expert health. Fp8GroupedLinear records telemetry per expert, named `{layer}.expert{e}` (telemetry.py):
the table lists, per grouped layer and role, the smallest and largest mean amax over its experts, the expert with
the lowest mean SQNR and the one with the highest underflow: rarely routed experts have few tokens, hence noisy
amaxes.
"""

from __future__ import annotations

from fp8train.evidence import plots
from fp8train.evidence.advisor import number
from fp8train.evidence.run_plan import BASELINE
from fp8train.training.models.moe import routing_agreement
from fp8train.training.runs.telemetry import expert_layer_of

__all__ = ["moe_summary", "moe_markdown", "expert_amax", "run_routing_markdown"]


def moe_summary(runs: dict) -> dict:
    """{candidate: {seed: {block: routing_agreement row}}} for every pair whose two runs recorded routing; {}
    when no run is an MoE run."""
    baseline = runs.get(BASELINE, {})
    out: dict = {}
    for label, by_seed in runs.items():
        if label == BASELINE:
            continue
        for seed, run in by_seed.items():
            base = baseline.get(seed)
            cand_moe = (run.summary or {}).get("moe")
            base_moe = (base.summary or {}).get("moe") if base is not None else None
            if cand_moe and base_moe:
                out.setdefault(label, {})[str(seed)] = routing_agreement(base_moe, cand_moe)
    return out


def _agreement_table(moe: dict) -> list[str]:
    lines = ["| candidate | seed | block | flipped | tokens per expert, bf16 | FP8 | FP8 - bf16 |",
             "|---|---|---|---|---|---|---|"]
    for label, by_seed in moe.items():
        for seed, blocks in by_seed.items():
            for block, row in blocks.items():
                lines.append(f"| {label} | {seed} | {block} | {row['flipped']:.2%} | {row['baseline_tokens']} "
                             f"| {row['candidate_tokens']} | {row['token_diff']} |")
    return lines


def expert_amax(records: list[dict]) -> dict:
    """{(grouped layer, role): {expert: mean amax over the sampled steps}} from telemetry.jsonl records."""
    sums: dict = {}
    for record in records:
        for name, roles in record.get("layers", {}).items():
            layer = expert_layer_of(name)
            if layer is None:
                continue
            for role, stats in roles.items():
                amax = number(stats.get("amax"))
                if amax is not None:
                    cell = sums.setdefault((layer, role), {}).setdefault(name.rpartition(".")[2], [0.0, 0])
                    cell[0], cell[1] = cell[0] + amax, cell[1] + 1
    return {key: {e: total / n for e, (total, n) in per.items()} for key, per in sums.items()}


def _expert_health(tables: dict, amaxes: dict) -> list[str]:
    lines = ["| candidate | grouped layer | role | mean amax, smallest - largest expert | lowest mean SQNR dB (expert) "
             "| highest mean underflow (expert) | highest mean overflow |", "|---|---|---|---|---|---|---|"]
    for label, table in tables.items():
        layers: dict = {}
        for name, roles in table.items():
            layer = expert_layer_of(name)
            if layer is not None:
                for role, row in roles.items():
                    layers.setdefault((layer, role), []).append((name.rpartition(".")[2], row))
        for (layer, role), rows in sorted(layers.items()):
            with_sqnr = [(e, r) for e, r in rows if r.get("sqnr_db") is not None]
            low = min(with_sqnr, key=lambda er: er[1]["sqnr_db"]) if with_sqnr else None
            high = max(rows, key=lambda er: er[1].get("underflow_frac") or 0.0)
            over = max((r.get("overflow_frac") or 0.0) for _, r in rows)
            amax = amaxes.get(label, {}).get((layer, role), {})
            spread = (f"{min(amax.values()):.3g} ({min(amax, key=amax.get)}) - {max(amax.values()):.3g} "
                      f"({max(amax, key=amax.get)})") if amax else "n/a"
            lines.append(f"| {label} | {layer} | {role} | {spread} | "
                         + (f"{low[1]['sqnr_db']:.1f} ({low[0]})" if low else "n/a")
                         + f" | {(high[1].get('underflow_frac') or 0.0):.2%} ({high[0]}) | {over:.2%} |")
    return lines if len(lines) > 2 else []


def moe_markdown(vdir, moe: dict, tables: dict, amaxes: dict) -> list[str]:
    """The report's "Mixture of experts" section (routing agreement, token-count plot, per-expert health)."""
    if not moe:
        return []
    png = plots.plot_expert_tokens(vdir / "experts.png", moe, title=vdir.name)
    means = {label: sum(r["flipped"] for blocks in by_seed.values() for r in blocks.values())
             / max(1, sum(len(blocks) for blocks in by_seed.values())) for label, by_seed in moe.items()}
    lines = ["## Mixture of experts: routing agreement", "",
             "Routing of the first validation batch by each run's final weights, FP8 run against its bf16 pair "
             "(same tokens). **flipped**: the share of (token, expert) routing decisions the FP8 run made that "
             "the bf16 run did not (0 = identical routing); token counts are assignments per expert (top_k per "
             "token). Mean flipped over seeds and blocks: "
             + ", ".join(f"{label} {value:.2%}" for label, value in means.items()) + ".", "",
             *_agreement_table(moe), ""]
    if png:
        lines += ["![tokens per expert, bf16 vs FP8](experts.png)", ""]
    health = _expert_health(tables, amaxes)
    if health:
        lines += ["Per-expert FP8 health (telemetry of each expert's own GEMMs, pooled over seeds; the advisor "
                  "below names a grouped layer when any of its experts crosses a threshold):", "", *health, ""]
    return lines



def run_routing_markdown(summary: dict) -> list[str]:
    """A single MoE run's report: tokens per expert of each MoE block on the first validation batch."""
    moe = summary.get("moe")
    if not isinstance(moe, dict) or not moe:
        return []
    lines = ["## Mixture of experts: routing", "", "Tokens routed to each expert on the first validation batch by the "
             "final weights (assignments: top_k per token).", "", "| block | tokens per expert | busiest / mean |",
             "|---|---|---|"]
    for block, row in moe.items():
        counts = row.get("expert_tokens") or []
        mean = sum(counts) / len(counts) if counts else 0
        lines.append(f"| {block} | {counts} | {max(counts) / mean:.2f} |" if mean else f"| {block} | {counts} | n/a |")
    return lines + [""]
