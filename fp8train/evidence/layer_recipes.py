"""`fp8train layer-recipes RUN_DIR --out LAYERS.yaml`: a recipe per layer from measurements, not shape rules.

Two measurements decide each layer the run's layer policy converts (or would convert, for a bf16 run):

1. **Speed on this device**: every distinct layer shape (M tokens per micro-batch, in_features, out_features) is
   timed forward+backward as the run trains it: nn.Linear in the run's precision (bf16 autocast, or fp32 with
   train.autocast=none) against Fp8Linear for each shadowed recipe (its quantize + GEMMs, backend auto), in
   interleaved rounds, median of `--repeats`; fp32 and bf16 are both timed and both reported.
2. **Numerics on the run's own operands**: the run's shadow telemetry (`log.shadow_recipes`), i.e. SQNR,
   overflow and underflow per role that each recipe would have had on this layer's real tensors.

A layer gets the FASTEST recipe whose numerics pass every threshold and whose speedup over the run's precision
is at least `min_speedup`; otherwise it stays high precision ('bf16'). Thresholds (defaults: the report
advisor's, advisor.MEAN_THRESHOLDS, plus min_speedup 1.05 because FP8 costs accuracy and 5% is within the
timing noise of a loaded machine): mean SQNR >= sqnr_db_min in every role, worst overflow <= overflow_frac_max,
mean underflow <= underflow_frac_max. The choices are written as `policy.overrides` (one anchored regex per
layer, with a comment giving the speedups and SQNRs behind the choice) for `policy.overrides_file=LAYERS.yaml` or
a validation candidate `layers=current:policy.overrides_file=LAYERS.yaml`. On a CPU the honest outcome may be
"no layer is faster in FP8 here", and the file says so.
"""

from __future__ import annotations

import copy
import datetime
import math
import re
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from fp8train.nn.convert import LayerPolicy, convert_to_fp8
from fp8train.nn.linear import Fp8Linear
from fp8train.nn.overrides import OVERRIDE_BF16
from fp8train.nn.recipes import BASELINE_RECIPE, ROLES, recipe
from fp8train.evidence import advisor
from fp8train.training.config import layer_policy_from_config, load_config
from fp8train.training.models.decoder import build_model, check_model_for_run
from fp8train.training.runs import telemetry
from fp8train.training.runs.run_log import counted
from fp8train.training.storage.outputs import check_output_file, claim_output_path
from fp8train.training.storage.files import write_text_atomic
from fp8train.training.shadow import SHADOW_STAT_KEYS

__all__ = ["DEFAULT_THRESHOLDS", "shadow_table", "converted_linears", "time_shapes", "choose", "measure_layer_recipes",
           "layer_recipes_yaml", "check_fp8_conversion", "add_cli_arguments", "cli_main"]

DEFAULT_THRESHOLDS = {**advisor.MEAN_THRESHOLDS, "min_speedup": 1.05}
LAYER_RECIPES_HEADER = "# fp8train layer-recipes"  # the first line of every file it writes: --force replaces those


def _as_float(value) -> float | None:
    """A stat as float (telemetry.jsonl writes non-finite floats as strings such as "inf"), or None."""
    try:
        return None if value is None or isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        return None


def shadow_table(records: list[dict]) -> dict:
    """{layer: {recipe: {role: {sqnr_db (mean of finite), overflow_frac (max), underflow_frac (mean)}}}}."""
    samples: dict = {}
    for record in {int(r["step"]): r for r in records if r.get("shadow")}.values():  # a resumed step counts once
        for layer, recipes in record["shadow"].items():
            for rname, roles in recipes.items():
                for role, stats in roles.items():
                    slot = samples.setdefault(layer, {}).setdefault(rname, {}).setdefault(role, {})
                    for key in SHADOW_STAT_KEYS:
                        value = _as_float(stats.get(key))
                        if value is not None:
                            slot.setdefault(key, []).append(value)
    table: dict = {}
    for layer, recipes in samples.items():
        for rname, roles in recipes.items():
            for role, values in roles.items():
                sqnr = [v for v in values.get("sqnr_db", []) if v != float("inf")]
                table.setdefault(layer, {}).setdefault(rname, {})[role] = {
                    "sqnr_db": statistics.fmean(sqnr) if sqnr else float("inf"),
                    "overflow_frac": max(values.get("overflow_frac", [0.0])),
                    "underflow_frac": statistics.fmean(values.get("underflow_frac", [0.0])),
                }
    return table


def _meta_conversion(cfg, policy: LayerPolicy):
    """convert_to_fp8 on a meta-device copy of the run's model (no memory, no data): (report, skeleton)."""
    run_recipe = cfg.fp8.to_recipe().replace(backend="emulated")  # a bf16 run's: the default preset's
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no nn.Linear was eligible" is the caller's to report
        skeleton = build_model(cfg.model, load_weights=False)  # the architecture only: no weights read
        return convert_to_fp8(skeleton, run_recipe, policy), skeleton


def check_fp8_conversion(cfg) -> None:
    """Raise the ValueError `fp8train train` would raise at conversion (e.g. a policy.overrides_file made for another
    model), without building anything: validation calls it for every candidate before the first run."""
    if cfg.fp8.recipe != BASELINE_RECIPE:
        report, skeleton = _meta_conversion(cfg, layer_policy_from_config(cfg))
        check_model_for_run(skeleton, 0, report, cfg.policy.allow_no_fp8)  # e.g. all layers overridden to bf16


def converted_linears(cfg) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of every Linear the run's policy converts, ignoring its overrides."""
    policy = layer_policy_from_config(cfg)
    report, skeleton = _meta_conversion(cfg, LayerPolicy(**{**policy.__dict__, "overrides": ()}))
    modules = dict(skeleton.named_modules())  # FP8 experts projections are Parameters: converted_experts
    return [(name, modules[name].in_features, modules[name].out_features)
            for name, _ in report.converted if name in modules]


def converted_experts(cfg) -> list[str]:
    """The FP8 experts projections (`...experts.gate_up_proj`) of the run: the choices leave them at the run's
    recipe (the shadow telemetry and the timings are per Linear)."""
    report, skeleton = _meta_conversion(cfg, layer_policy_from_config(cfg))
    modules = dict(skeleton.named_modules())
    return [name for name, _ in report.converted if name not in modules]


def _fwd_bwd(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, autocast: bool):
    def step():
        x_ = x.detach().requires_grad_(True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            y = module(x_)
        y.backward(grad.to(y.dtype))
        module.zero_grad(set_to_none=True)
    return step


def time_shapes(shapes, recipe_names, device: str, run_autocast: bool, repeats: int) -> dict:
    """{(m, k, n): {contender: median seconds}} for fp32, bf16 and each recipe, fwd+bwd, interleaved rounds."""
    timings = {}
    for m, k, n in sorted(set(shapes)):
        torch.manual_seed(0)
        linear = nn.Linear(k, n, bias=False, device=device)
        x, grad = torch.randn(m, k, device=device), torch.randn(m, n, device=device)
        contenders = {"fp32": _fwd_bwd(linear, x, grad, False), "bf16": _fwd_bwd(linear, x, grad, True)}
        for name in recipe_names:
            layer = Fp8Linear.from_linear(copy.deepcopy(linear), recipe(name))
            contenders[name] = _fwd_bwd(layer, x, grad, run_autocast)
        seconds = {name: [] for name in contenders}
        for round_ in range(repeats + 1):  # round 0 warms up (caches, kernel probes)
            for name, step in contenders.items():
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                step()
                if device == "cuda":
                    torch.cuda.synchronize()
                if round_:
                    seconds[name].append(time.perf_counter() - start)
        timings[(m, k, n)] = {name: statistics.median(v) for name, v in seconds.items()}
    return timings


def _numerics_failure(stats: dict, t: dict) -> str | None:
    for role in ROLES:
        s = stats.get(role)
        if s is None:
            return f"no {role} telemetry"
        if s["sqnr_db"] < t["sqnr_db_min"]:
            return f"{role} SQNR {s['sqnr_db']:.1f} dB < {t['sqnr_db_min']:g}"
        if s["overflow_frac"] > t["overflow_frac_max"]:
            return f"{role} overflow {s['overflow_frac']:.2%} > {t['overflow_frac_max']:.2%}"
        if s["underflow_frac"] > t["underflow_frac_max"]:
            return f"{role} underflow {s['underflow_frac']:.1%} > {t['underflow_frac_max']:.0%}"
    return None


def choose(timing: dict, shadow: dict, baseline: str, thresholds: dict) -> tuple[str, str]:
    """(choice, comment) for one layer from its shape's timings and its shadow table."""
    speedups = {r: timing[baseline] / timing[r] for r in shadow if r in timing}
    passing = {r: s for r, s in speedups.items() if _numerics_failure(shadow[r], thresholds) is None}
    fast = {r: s for r, s in passing.items() if s >= thresholds["min_speedup"]}
    choice = max(fast, key=fast.get) if fast else OVERRIDE_BF16
    parts = [f"{r} {s:.2f}x" for r, s in sorted(speedups.items(), key=lambda kv: -kv[1])]
    best = max(speedups, key=speedups.get) if speedups else None
    other = "fp32" if baseline == "bf16" else "bf16"  # both baselines are reported (one decides)
    comment = f"speedup over {baseline}: " + ", ".join(parts) + (
        f"; over {other}: {best} {timing[other] / timing[best]:.2f}x" if best else "")
    if choice != OVERRIDE_BF16:
        sqnr = "/".join(f"{shadow[choice][role]['sqnr_db']:.1f}" for role in ROLES)
        return choice, f"{comment}; {choice} SQNR in/w/grad {sqnr} dB"
    failures = {r: _numerics_failure(shadow[r], thresholds) for r in speedups if r not in passing}
    why = "; ".join(f"{r}: {f}" for r, f in failures.items())
    slow = f"none >= {thresholds['min_speedup']:g}x faster" if passing else "no recipe passes the numerics"
    return choice, f"{comment}; {slow}" + (f"; {why}" if why else "")


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return f"cpu ({torch.get_num_threads()} threads)"


def measure_layer_recipes(run_dir: str | Path, device: str, repeats: int, thresholds: dict) -> dict:
    """Everything the layer-recipes file says: per-layer choices with their reasons, and how they were measured."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    cfg = load_config(str(run_dir / "config.yaml"))
    table = shadow_table(telemetry.load(run_dir / "telemetry.jsonl"))  # a damaged line: ValueError naming it
    if not table:
        raise ValueError(f"{run_dir / 'telemetry.jsonl'} has no shadow telemetry: train with "
                         f"log.shadow_recipes=[current,rowwise,block,mxfp8] and log.telemetry_every > 0")
    layers = converted_linears(cfg)
    missing = [name for name, _, _ in layers if name not in table]
    if len(missing) == len(layers):
        raise ValueError(f"the shadow telemetry of {run_dir} names none of this model's layers "
                         f"(telemetry from another model?)")
    recipes = sorted({r for per_layer in table.values() for r in per_layer})
    tokens = cfg.train.batch_size // cfg.train.grad_accum * cfg.model.seq_len  # per micro-batch, one process
    run_autocast = cfg.train.autocast == "bf16"
    baseline = "bf16" if run_autocast else "fp32"
    timings = time_shapes([(tokens, k, n) for _, k, n in layers], recipes, device, run_autocast, repeats)
    rows = []
    for name, k, n in layers:
        timing = timings[(tokens, k, n)]
        if name in missing:
            choice, comment = OVERRIDE_BF16, "no shadow telemetry for this layer"
        else:
            choice, comment = choose(timing, table[name], baseline, thresholds)
        rows.append(dict(layer=name, shape=[tokens, k, n], choice=choice, comment=f"{tokens}x{k}x{n} {comment}"))
    return dict(run_dir=str(run_dir), device=device, device_name=_device_name(device), baseline=baseline,
                repeats=repeats, thresholds=thresholds, recipes=recipes, layers=rows,
                fp8_layers=sum(r["choice"] != OVERRIDE_BF16 for r in rows), experts=converted_experts(cfg))


def _yaml_quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"  # YAML single quotes: backslashes stay literal


def layer_recipes_yaml(choices: dict) -> str:
    """The choices as a config fragment: a commented `policy.overrides`, one anchored regex per layer."""
    t = choices["thresholds"]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"{LAYER_RECIPES_HEADER} for {choices['run_dir']}, measured {when} on {choices['device_name']} "
        f"({choices['device']})",
        f"# speed: fwd+bwd per layer shape (MxKxN), median of {choices['repeats']} interleaved rounds, speedup over "
        f"the run's precision ({choices['baseline']}); fp32 shown too",
        f"# numerics: the run's shadow telemetry; thresholds: SQNR >= {t['sqnr_db_min']:g} dB in every role, "
        f"overflow <= {t['overflow_frac_max']:.2%}, underflow <= {t['underflow_frac_max']:.0%}, speedup >= "
        f"{t['min_speedup']:g}x",
    ]
    if choices["fp8_layers"] == 0:
        lines.append("# outcome: no layer is faster in FP8 here, so every layer stays high precision (as a validation "
                     "candidate, add policy.allow_no_fp8=true)")
    else:
        lines.append(f"# outcome: {choices['fp8_layers']} of {counted(len(choices['layers']), 'layer')} in FP8")
    if choices.get("experts"):
        lines.append(f"# experts: {len(choices['experts'])} FP8 expert projections are not chosen per layer and "
                     "keep the run's recipe (shadow telemetry and timings are per Linear)")
    lines += ["# use: fp8train train CONFIG policy.overrides_file=THIS_FILE, or validate.candidates: "
              "[layers=current:policy.overrides_file=THIS_FILE]", "policy:", "  overrides:"]
    for row in choices["layers"]:
        pattern = "^" + re.escape(row["layer"]) + "$"
        lines.append(f"    {_yaml_quoted(pattern)}: {row['choice']}  # {row['comment']}")
    return "\n".join(lines) + "\n"


def add_cli_arguments(parser) -> None:
    parser.add_argument("run_dir", help="a run directory trained with log.shadow_recipes")
    parser.add_argument("--out", required=True, help="YAML to write (refused if it exists, unless --force)")
    parser.add_argument("--force", action="store_true", help="overwrite --out")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where to time the layer shapes (default: cuda if available)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per shape (median; default 5)")
    for key, value in DEFAULT_THRESHOLDS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=float, default=value, dest=key,
                            help=f"threshold (default {value:g})")


MAX_REPEATS = 1000


def cli_main(args) -> int:
    with claim_output_path(args.out, "layer-recipes --out"):  # a second one to the same file meanwhile is refused
        return _plan(args)


def _not_layer_recipes(path: Path) -> str | None:
    """None when `path` is a file an earlier layer-recipes wrote (its first line says so), the one kind of file
    layer-recipes --force replaces; else what it lacks."""
    try:
        first = path.read_text().split("\n", 1)[0]
    except (OSError, UnicodeDecodeError):
        return "it is not text"
    return None if first.startswith(LAYER_RECIPES_HEADER) else f"its first line is not {LAYER_RECIPES_HEADER!r}"


def _plan(args) -> int:
    out = check_output_file(args.out, force=args.force, sources=[args.run_dir], ours=_not_layer_recipes)
    if not 1 <= args.repeats <= MAX_REPEATS:  # each round times every layer shape: a bound on hours of timing
        raise ValueError(f"--repeats={args.repeats}: must be in [1, {MAX_REPEATS}]")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible to torch")
    thresholds = {key: getattr(args, key) for key in DEFAULT_THRESHOLDS}
    for key, value in thresholds.items():  # a NaN threshold compares false with everything: a silent choice
        if not math.isfinite(value):
            raise ValueError(f"--{key.replace('_', '-')}={value}: a threshold must be a finite number")
        if key.endswith("_frac_max") and not 0 <= value <= 1:  # a fraction: -1 would keep every layer in bf16
            raise ValueError(f"--{key.replace('_', '-')}={value}: a fraction of values, in [0, 1]")
        if key == "min_speedup" and value < 0:  # (0 is meaningful: decide on numerics alone, docs/layer-recipes.md)
            raise ValueError(f"--min-speedup={value}: a ratio of times, >= 0")
    choices = measure_layer_recipes(args.run_dir, device, args.repeats, thresholds)
    write_text_atomic(out, layer_recipes_yaml(choices))
    print(f"{choices['fp8_layers']} of {counted(len(choices['layers']), 'layer')} in FP8 on {choices['device_name']}"
          + (": no layer is faster in FP8 here" if choices["fp8_layers"] == 0 else "") + f"; written to {out}")
    return 0
