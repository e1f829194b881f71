"""The prepared GPU check: `scripts/gpu_check.sh OUT_DIR [--dry-run] [--budget S] [--sections a,b]`.

Runs the sections of fp8train.bench.gpu_sections in order of information per second, each in its own process
(its own process group, killed at its time limit), never past the total budget (default 470 s, at most 480 s =
8 minutes). Every section writes OUT_DIR/<section>.json when it ends (this process writes it, with the log's tail,
for a section that was killed or crashed first), its output goes to OUT_DIR/<section>.log, and OUT_DIR/summary.json
is rewritten after each one, so a timeout or crash loses only the section it hit.
`--dry-run` runs every section on the CPU at toy sizes (the CUDA tests are only collected): the test suite runs
it to prove the check itself cannot break. Nothing is installed or downloaded: HF and wandb are forced offline.
Exit status: 0 every section ok; 1 a section failed, timed out or was skipped; 2 usage error, or (not dry) the
checks found no usable GPU or a missing module, in which case nothing else runs; 3 the parity section failed (CUDA
and the CPU emulation disagree, see parity.jsonl), whatever the others did. The last lines printed are a digest.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from fp8train.bench.gpu_sections import OFFLINE_ENV, SECTION_FUNCTIONS, SECTION_NEEDS, SECTIONS, module_missing
from fp8train.training.storage.files import write_json_atomic

DEFAULT_BUDGET_S, MAX_BUDGET_S = 470, 480
MIN_SECTION_S = 10  # a section given less than this is skipped (and reported as skipped)


def _run_section_process(name: str, out_dir: Path, dry: bool, limit_s: float) -> dict:
    command = [sys.executable, "-m", "fp8train.bench.gpu_check", str(out_dir), "--section", name,
               "--limit", f"{limit_s:.0f}"] + (["--dry-run"] if dry else [])
    env = {**os.environ, **OFFLINE_ENV}
    start = time.monotonic()
    with open(out_dir / f"{name}.log", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode = proc.wait(timeout=limit_s)
            status = "ok" if returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the section and whatever it started (pytest, bench)
            proc.wait()
            returncode, status = None, "timeout"
    seconds = round(time.monotonic() - start, 1)
    if not (out_dir / f"{name}.json").exists():  # killed or crashed before writing: the parent writes it
        tail = (out_dir / f"{name}.log").read_text(errors="replace")[-3000:]
        write_json_atomic(out_dir / f"{name}.json", dict(ok=False, section=name, status=status, returncode=returncode,
                                                         seconds=seconds, limit_s=round(limit_s), log_tail=tail))
    return dict(status=status, returncode=returncode, seconds=seconds, limit_s=round(limit_s), json=f"{name}.json")


def run_check(out_dir: Path, dry: bool, budget_s: float, sections: list[str]) -> int:
    deadline = time.monotonic() + budget_s
    summary = dict(dry_run=dry, budget_s=budget_s, sections={})
    for name in sections:
        limit = min(SECTIONS[name], deadline - time.monotonic() - 2)
        if limit < MIN_SECTION_S:
            summary["sections"][name] = dict(status="skipped", reason=f"{limit:.0f} s of the budget left")
        else:
            summary["sections"][name] = _run_section_process(name, out_dir, dry, limit)
        write_json_atomic(out_dir / "summary.json", summary)
        print(f"gpu_check: {name}: {summary['sections'][name]['status']}", flush=True)
        if name == "checks" and not dry and summary["sections"][name]["status"] != "ok":
            print(f"gpu_check: the checks failed, nothing else can run: see {out_dir / 'checks.json'}",
                  file=sys.stderr)
            return 2
    for line in digest(out_dir):
        print(f"gpu_check: {line}", flush=True)
    if "parity" in summary["sections"] and summary["sections"]["parity"]["status"] != "ok":
        return 3  # CUDA and the emulation disagree (or the parity section could not finish): the first thing to read
    return 0 if all(s["status"] == "ok" for s in summary["sections"].values()) else 1


def _read(out_dir: Path, name: str) -> dict:
    try:
        return json.loads((out_dir / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {}


def digest(out_dir: Path) -> list[str]:
    """A few lines to read first: parity, the GEMM speedups at the largest shape, the end-to-end step ratios."""
    lines = []
    parity = _read(out_dir, "parity")
    if parity:
        failed = [f"{c.get('kind') or c.get('recipe')}/{c.get('out') or c.get('gemm')}" for c in parity.get("failed", [])]
        lines.append(f"parity: {parity.get('cases', 0) - len(failed)}/{parity.get('cases', 0)} cases hold"
                     + (f"; FAILED: {', '.join(failed)}" if failed else "") + (" (error: " + parity["error"] + ")"
                                                                               if "error" in parity else ""))
    rows = _read(out_dir, "gemm_tflops").get("rows") or []
    if rows:
        first = rows[0]
        ratios = [f"{key[:-len('_vs_bf16')]} {value:.2f}x" for key, value in first.items()
                  if key.endswith("_vs_bf16") and isinstance(value, float)]
        lines.append(f"gemm {first.get('shape')}: bf16 {first.get('bf16_tflops', 0):.3g} TFLOP/s; FP8 vs bf16: "
                     + (", ".join(ratios) or "no FP8 kind ran"))
    runs = _read(out_dir, "e2e").get("runs") or {}
    if runs:
        lines.append("e2e tokens/s vs bf16: " + ", ".join(
            f"{name} {run['vs_bf16']:.2f}x" for name, run in runs.items() if name != "none" and run.get("vs_bf16")))
    return lines


def run_one_section(name: str, out_dir: Path, dry: bool, limit_s: float) -> int:
    """Inside the section's process: run it, write <name>.json (also on error), exit 0 only when ok."""
    device = "cpu" if dry else "cuda"
    start = time.monotonic()
    lacking = [m for m in SECTION_NEEDS.get(name, ()) if module_missing(m)]
    try:
        if lacking:  # said at once, so the budget goes to the sections that can run
            raise ModuleNotFoundError(f"section {name} needs {', '.join(lacking)}: run scripts/prepare_gpu_wheels.sh "
                                      f"where there is network and carry .gpu_site with the tree")
        result = SECTION_FUNCTIONS[name](device, dry, out_dir, limit_s)
    except Exception as err:  # recorded, so the summary says what broke; the next section still runs
        result = dict(ok=False, error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
    result.update(section=name, device=device, seconds=round(time.monotonic() - start, 2))
    write_json_atomic(out_dir / f"{name}.json", result)
    print(json.dumps({k: v for k, v in result.items() if k in ("ok", "problems", "error", "seconds")}))
    return 0 if result.get("ok") else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="folder for the JSON results and logs (created)")
    parser.add_argument("--dry-run", action="store_true", help="every section on the CPU at toy sizes")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help=f"total seconds (default {DEFAULT_BUDGET_S}, at most {MAX_BUDGET_S})")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"subset of {','.join(SECTIONS)}")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section in this process
    parser.add_argument("--limit", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown or not 0 < args.budget <= MAX_BUDGET_S:
        print(f"gpu_check: error: unknown sections {unknown} (allowed: {', '.join(SECTIONS)})" if unknown else
              f"gpu_check: error: --budget must be in (0, {MAX_BUDGET_S}] seconds", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.section:
        return run_one_section(args.section, out_dir, args.dry_run, args.limit)
    ordered = [s for s in SECTIONS if s in wanted]
    if "checks" not in ordered:
        ordered.insert(0, "checks")  # the checks always run first: they are what makes the rest readable
    return run_check(out_dir, args.dry_run, args.budget, ordered)


if __name__ == "__main__":
    sys.exit(main())
