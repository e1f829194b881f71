"""README is a front door that works: at most 250 lines, every link into docs/ resolves, and every command in its
```bash blocks runs. The two set-up commands are checked against `.ci/run` (which runs the test one, character for
character); every `fp8train ...` command runs for real, in README's order, in an empty folder with recipes/
beside it, with only size overrides appended (fewer steps, one seed, smaller evaluations) so the whole file takes
seconds, not the minutes the full-size commands take. Commands named in README's prose that are slow or need a GPU
(accelerate with 2 processes, the GPU check, bench, layer-recipes) must be run by the test named in RUN_ELSEWHERE."""

from __future__ import annotations

import json
import re
import shlex
import warnings
from pathlib import Path

import pytest
import torch

from fp8train import cli
from fp8train.nn.linear import Fp8Linear

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 250
# Pages a link may name before they exist (none now: every linked page is in the tree).
WRITTEN_ELSEWHERE: set[str] = set()  # every page README links to is in the tree

# Size overrides appended to README's commands, per subcommand: the same command on a smaller job.
SMALL_RUN = ["train.max_steps=4", "train.eval_every=2", "train.eval_batches=1", "train.batch_size=4",
             "model.seq_len=32", "optim.warmup_steps=1", "data.max_bytes=200000", "log.wandb=disabled",
             "log.telemetry_every=0", "--quiet"]
SMALLER = {
    "train": SMALL_RUN,
    "validate": SMALL_RUN + ["validate.seeds=2", "validate.workers=1", "validate.final_window=1"],
    "kv-eval": ["--calib-batches", "1", "--gen-prompts", "1", "--gen-tokens", "4", "--batches", "1"],
    "report": [], "export": [], "formats": [],
}
EXIT_CODES = {"validate": (0, 1, 3)}  # a two-seed verdict may be inconclusive; anything else must succeed
# Commands README names in its prose (inline code), too slow or needing other hardware to run here, and the test
# that runs each for real: (test file, strings of the call it makes).
RUN_ELSEWHERE = {
    "accelerate launch --multi_gpu --num_processes 2 scripts/train.py --config recipes/cpu_delayed.yaml":
        ("test_launch.py", ['"accelerate.commands.launch"', '"--multi_gpu", "--num_processes", "2"']),
    "scripts/gpu_check.sh OUT_DIR": ("test_gpu_check.py", ['["bash", str(SCRIPT), str(out), "--dry-run"]']),
    "fp8train layer-recipes": ("test_layer_recipes_e2e.py", ['cli.main(["layer-recipes", str(shadowed_run), "--out"']),
    "fp8train bench": ("test_bench.py", ['main(["bench", "--json", "--out", str(out), "--quick"']),
}
COMMAND_START = re.compile(r"(fp8train|accelerate|torchrun|python3?|pip|bash|scripts/)\b")


def bash_lines(text: str) -> list[str]:
    """The command lines of README's ```bash blocks (comment lines left out)."""
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        lines += [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return lines


def readme_commands() -> tuple[list[str], list[list[str]]]:
    """(the set-up lines, every fp8train command as argv) in README order; a set-up line's last part, the command
    it runs after installing, counts among the fp8train commands."""
    setup, commands = [], []
    for line in bash_lines(README.read_text()):
        if line.startswith("python3 -m venv "):
            setup.append(line)
            line = line.split(" && ")[-1]
            if not line.startswith("fp8train "):
                continue
        commands.append(shlex.split(line, comments=True))
    return setup, commands


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move reference material into docs/"
    assert "## Documentation" in README.read_text()


@pytest.mark.parametrize("page", ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                                                         for p in (ROOT / "docs").glob("*.md"))])
def test_every_link_to_a_page_resolves(page):
    source = ROOT / page
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", source.read_text()):
        path = (source.parent / target).resolve()
        name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        if not path.exists() and name not in WRITTEN_ELSEWHERE:
            missing.append(target)
    assert not missing, f"{page} links to pages that do not exist: {missing}"


def test_the_setup_commands_are_what_ci_runs():
    setup, _ = readme_commands()
    assert len(setup) == 2, setup
    install_and_run, install_and_test = setup
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install_and_test in ci_lines, "README's test command must be .ci/run's, character for character"
    assert install_and_test.endswith("&& python -m pytest -q -rs -n 2 --dist loadfile")
    # the first command installs the same way, without the test extra, then runs the main job (run below)
    assert install_and_run.split(" && ")[:-1] == install_and_test.replace('".[test]"', ".").split(" && ")[:-1]
    assert install_and_run.split(" && ")[-1] == "fp8train validate recipes/cpu_validate.yaml"


def test_every_readme_command_has_a_runner_here():
    _, commands = readme_commands()
    assert commands, "no fp8train command found in README"
    unknown = [" ".join(argv) for argv in commands if argv[0] != "fp8train" or argv[1] not in SMALLER]
    assert not unknown, f"README commands that no test runs (add them to SMALLER): {unknown}"


def test_commands_in_readme_prose_are_run_by_a_test():
    prose = re.sub(r"^```.*?^```", "", README.read_text(), flags=re.S | re.M)
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    commands = [span for span in spans if COMMAND_START.match(span)]
    assert commands, "the prose check found no command: is the pattern stale?"
    unrun = [command for command in commands if command not in RUN_ELSEWHERE]
    assert not unrun, f"README commands that no test runs (add them to RUN_ELSEWHERE or a bash block): {unrun}"
    for command, (test_file, calls) in RUN_ELSEWHERE.items():
        text = (ROOT / "tests" / test_file).read_text()
        missing = [call for call in calls if call not in text]
        assert not missing, f"{test_file} no longer runs {command!r}: {missing} not found"


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path, monkeypatch, capsys):
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")  # README's paths are relative to the repository root
    monkeypatch.chdir(tmp_path)
    _, commands = readme_commands()
    for argv in commands:
        sub = argv[1]
        code = cli.main(argv[1:] + SMALLER[sub])
        out = capsys.readouterr()
        assert code in EXIT_CODES.get(sub, (0,)), f"{' '.join(argv)} exited {code}: {out.err[-2000:]}"
    # what README says each command leaves behind
    assert json.loads(Path("runs/try1/summary.json").read_text())["status"] == "completed"
    assert Path("runs/try1/report.md").exists()
    for validation in ("runs/cpu_validate", "runs/two"):
        assert json.loads(Path(validation, "summary.json").read_text())["verdict"] in ("pass", "fail",
                                                                                       "inconclusive")
    assert json.loads(Path("try1_fp8/config.json").read_text())["quantization_config"]
    assert Path("runs/try1/kv_eval/kv_eval.md").exists()


class _ReadmeModel(torch.nn.Module):
    """MyModel of README's API example: two FP8-eligible linears and a loss."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)

    def forward(self, batch):
        return self.down(torch.relu(self.up(batch))).pow(2).mean()


def test_the_api_example_runs():
    (block,) = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    scope = {"MyModel": _ReadmeModel, "loader": [torch.randn(16, 64) for _ in range(3)]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # autocast("cuda") on a machine without CUDA says it is disabled
        exec(compile(block, "README.md", "exec"), scope)
    layers = [m for m in scope["model"].modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 2 and all(layer.weight_initialized.item() for layer in layers)  # scales were updated
