"""Config and command-line fuzz through the real CLI: every config field given a wrong type or an out-of-range value,
unknown keys, broken override syntax, broken YAML files and bad command lines all end with exit status 2 and ONE
line that names the key (or the file, or the argument), never a traceback from deep inside.

Most cases run `fp8train.cli.main([...])` in-process (it is the console script's body, so exit code and stderr are
the real ones); two run the installed `fp8train` executable in a subprocess. The config given to the CLI points at a
data file that does not exist, so a bad value that slipped through would fail visibly (naming data.path, not the
key) instead of starting a run.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from fp8train import cli
from fp8train.training.config import FullConfig, load_config


def _leaf_types(schema=FullConfig, prefix="") -> dict[str, object]:
    out = {}
    for name, tp in typing.get_type_hints(schema).items():
        if dataclasses.is_dataclass(tp):
            out.update(_leaf_types(tp, f"{prefix}{name}."))
        else:
            out[prefix + name] = tp
    return out


LEAVES = _leaf_types()


def _kind(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union:  # Optional[X]
        return _kind(args[0])
    if typing.get_origin(tp) in (list, typing.List):
        return "list"
    if typing.get_origin(tp) in (dict, typing.Dict):
        return "dict"
    return {int: "int", float: "float", bool: "bool", str: "str", typing.Any: "any"}[tp]


WRONG_TYPE = {
    "int": ["abc", "1.5", "{a: 1}"],
    "float": ["abc", "nan", "inf"],
    "bool": ["abc", "{a: 1}"],
    "str": ["{a: 1}"],
    "list": ["abc", "{a: 1}"],
    "any": ["{a: 1}"],  # train.resume: true | false | auto; validate.seeds (other values in OUT_OF_RANGE)
    "dict": ["abc", "[a, b]"],
}

# Out-of-range values, per field. Fields absent here must be listed in NO_RANGE (checked below).
OUT_OF_RANGE = {
    "run.name": ["''", "a/b", ".."],
    "run.dir": ["''"],
    "model.n_layers": ["0", "-1"],
    "model.d_model": ["0", "-8"],
    "model.n_heads": ["0", "3"],  # 128 is not divisible by 3
    "model.n_kv_heads": ["-1", "3"],
    "model.seq_len": ["1", "0"],
    "model.vocab_size": ["1"],
    "model.ffn_hidden": ["-1"],
    "model.norm_eps": ["0", "-1e-5"],
    "model.rope_theta": ["0", "-1"],
    "model.n_experts": ["-1", "1000"],
    "model.top_k": ["0", "-2"],
    "model.n_shared_experts": ["-1"],
    "model.moe_every": ["0"],
    "model.moe_ffn_hidden": ["-1"],
    "model.aux_loss_coef": ["-0.1", "nan"],
    "data.val_fraction": ["0", "1", "-0.1", "1.5"],
    "data.max_bytes": ["-1"],
    "data.split_seed": [],
    "train.seed": ["-1", "99999999999999999999"],
    "train.max_steps": ["0", "-5"],
    "train.batch_size": ["0"],
    "train.grad_accum": ["0", "3"],  # 16 sequences do not split into 3 micro-batches
    "train.lr": ["0", "-1e-3"],
    "train.eval_every": ["-1"],
    "train.eval_batches": ["0"],
    "train.grad_clip": ["-1"],
    "train.device": ["tpu", "gpu"],
    "train.threads": ["-1", "two"],
    "train.autocast": ["fp16"],
    "train.resume": ["maybe", "2", "[true]"],
    "optim.weight_decay": ["-0.1"],
    "optim.betas": ["[0.9]", "[0.9, 1.0]", "[-0.1, 0.9]", "[0.9, 0.95, 0.99]", "[a, b]"],
    "optim.eps": ["0", "-1"],
    "optim.warmup_steps": ["-1"],
    "optim.min_lr_ratio": ["1.5", "-0.1"],
    "fp8.recipe": ["fp16", "e4m3", "''"],
    "fp8.backend": ["cuda", "torchao"],
    "fp8.margin": ["-1"],
    "fp8.pow2_scales": [],
    "fp8.amax_history_len": ["0", "-3"],
    "fp8.amax_compute_algo": ["mean"],
    "fp8.input_format": ["e3m4", "int8"],
    "fp8.weight_format": ["fp8"],
    "fp8.grad_output_format": ["bf16"],
    "fp8.input_block": ["[1]", "[0, 128]", "[1, 2, 3]"],
    "fp8.weight_block": ["[128, -1]"],
    "fp8.grad_output_block": ["[]"],
    "data.text_field": ["''"],
    "policy.min_features": ["-1"],
    "policy.divisible_by": ["0"],
    "policy.exclude": ["['(unclosed']", "['[a-']"],
    "policy.skip_first_blocks": ["-1"],
    "policy.skip_last_blocks": ["-2"],
    "log.every": ["0"],
    "log.telemetry_every": ["-1"],
    "log.wandb": ["cloud", "true"],
    "log.wandb_tags": ["['']", "[" + "x" * 65 + "]"],
    "log.trackers": ["[wandbx]", "[wandb, wandb]", "[tensorboard, neptune]"],
    "log.shadow_recipes": ["[nope]", "[current, current]"],
    "fp8.fast_accum_forward": [],
    "fp8.accumulator_bits": ["1", "25", "-1"],
    "fp8.accumulator_promotion": ["100", "-32"],
    "fp8.emulated_dtype": ["fp16", "float32"],
    "fp8.quantize_kernel": ["fast", "triton"],
    "fp8.amax_outlier_factor": ["0.5", "1", "-2"],
    "train.compile": ["maybe", "2"],
    "train.parallel": ["fsdp", "zero3"],
    "fp8.all_gather": ["maybe"],
    "policy.overrides": ["{'(unclosed': bf16}", "{mlp: fp16}"],
    "policy.overrides_file": ["/no/such/plan.yaml"],
    "policy.linear_subclasses": ["['not a name']", "['']"],
    "checkpoint.every": ["-1"],
    "checkpoint.keep_last": ["-1"],
    "validate.candidates": ["[]", "[none]", "[delayed, delayed]", "[fp16]"],
    "validate.margin": ["-0.1", "0", "1"],
    "validate.seeds": ["0", "[]", "[1, 1]", "[-1]", "abc", "1.5", "true"],
    "validate.workers": ["0", "-2"],
    "validate.final_window": ["0"],
    "validate.stop_on_divergence": [],
    "validate.divergence_factor": ["1", "0.5"],
    "validate.max_seeds": ["-1", "0"],
    "validate.max_plan_steps": ["-1", "1.5"],
    "train.tp_size": ["0", "65", "1.5"],
    "validate.spending": ["linear"],
}
# Free-form strings and switches: any value of the right type is in range.
NO_RANGE = {"data.path", "model.hf_config", "model.hf_path", "data.tokenizer", "data.hf_dataset", "policy.allow_no_fp8",
            "policy.exclude_defaults", "train.fork_from", "validate.fork_from",
            "log.wandb_project", "log.wandb_name", "log.wandb_group", "log.wandb_job_type", "model.tie_embeddings",
            "train.skip_nonfinite_grads", "train.sequence_parallel",
            "checkpoint.save_final"}


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    config = {"run": {"dir": str(root / "runs"), "name": "fuzz"}, "data": {"path": str(root / "no-such-corpus.txt")},
              "model": {"n_layers": 2, "d_model": 128, "n_heads": 4}, "train": {"max_steps": 1, "batch_size": 16},
              "log": {"wandb": "disabled"}}
    path = root / "fuzz.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _run_cli(capsys, argv: list[str]) -> tuple[int, list[str]]:
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "Traceback" not in captured.out
    return code, captured.err.strip().splitlines()


def _assert_user_error(capsys, argv: list[str], *names: str) -> None:
    code, err = _run_cli(capsys, argv)
    assert code == 2, (argv, code, err)
    assert len(err) == 1, (argv, err)
    assert err[0].startswith("fp8train train: error: "), err
    for name in names:
        assert name in err[0], (argv, name, err[0])


def test_every_field_is_covered():
    assert set(LEAVES) == set(OUT_OF_RANGE) | NO_RANGE


def _assert_rejected(config_file: Path, capsys, key: str, values: list[str]) -> None:
    for value in values:
        _assert_user_error(capsys, ["train", str(config_file), f"{key}={value}", "--quiet"], key)


def test_library_raises_value_error_naming_the_key(config_file):
    """What the CLI prints is the ValueError that Python callers of load_config get."""
    for override, key in [("train.lr=abc", "train.lr"), ("optim.betas={a: 1}", "optim.betas"),
                          ("model.n_heads=3", "model.n_heads"), ("train.lr=[1,", "train.lr"),
                          ("log.wandb=cloud", "log.wandb"), ("train.seed=99999999999999999999", "train.seed")]:
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            load_config(str(config_file), [override])


@pytest.mark.parametrize("key", sorted(LEAVES))
def test_wrong_type_names_the_key(config_file, capsys, key):
    _assert_rejected(config_file, capsys, key, WRONG_TYPE[_kind(LEAVES[key])])


@pytest.mark.parametrize("key", sorted(k for k, v in OUT_OF_RANGE.items() if v))
def test_out_of_range_names_the_key(config_file, capsys, key):
    _assert_rejected(config_file, capsys, key, OUT_OF_RANGE[key])


@pytest.mark.parametrize("override, names", [
    ("train.lrr=1", ["train.lrr", "train.lr"]),  # unknown key, with the suggestion
    ("bogus.x=1", ["bogus"]),
    ("lr=0.1", ["'lr'", "train.lr"]),  # a bare leaf name at the top level
    ("train.lr.x=1", ["train.lr"]),
    ("train._section=x", ["train._section"]),
    ("model=5", ["model"]),
    ("train.lr", ["train.lr"]),  # no '='
    ("=5", ["=5"]),
    ("train.lr=[1,", ["train.lr"]),
    ("train.lr={", ["train.lr"]),
])
def test_unknown_keys_and_bad_override_syntax(config_file, capsys, override, names):
    _assert_user_error(capsys, ["train", str(config_file), override, "--quiet"], *names)


@pytest.mark.parametrize("name, text, expected", [
    ("broken.yaml", "train: [1, 2\n", ["broken.yaml", "not valid YAML"]),  # yaml's error spans lines: joined
    ("list.yaml", "- 1\n- 2\n", ["list.yaml", "mapping"]),
    ("scalar_section.yaml", "train: 5\n", ["config train must be a mapping"]),
    ("list_section.yaml", "model: [1, 2]\n", ["config model must be a mapping"]),
    ("wrong_type.yaml", "train:\n  lr: [1]\n", ["train.lr"]),
    ("unknown.yaml", "train:\n  lrr: 1\n", ["train.lrr", "did you mean 'lr'"]),
    ("mapping_for_list.yaml", "optim:\n  betas: {b1: 0.9}\n", ["optim.betas"]),
])
def test_broken_config_files(tmp_path, capsys, name, text, expected):
    path = tmp_path / name
    path.write_text(text)
    _assert_user_error(capsys, ["train", str(path), "--quiet"], *expected)


def test_missing_or_directory_config(tmp_path, capsys):
    _assert_user_error(capsys, ["train", str(tmp_path / "nope.yaml"), "--quiet"], "nope.yaml", "does not exist")
    _assert_user_error(capsys, ["train", str(tmp_path), "--quiet"], "is a directory")


@pytest.mark.parametrize("argv, expected", [
    (["bogus"], "invalid choice: 'bogus'"),
    (["train"], "the following arguments are required: config"),
    (["train", "cfg.yaml", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["--nope"], "unrecognized arguments: --nope"),
    # an option that keeps one value, given twice: argparse alone would keep the last without a word
    (["kv-eval", "runs/x", "--format", "e4m3fn", "--format", "e5m2"],
     "--format is given twice ('e4m3fn', then 'e5m2')"),
    (["kv-eval", "--format=e4m3fn", "runs/x", "--form", "e5m2"], "--format is given twice ('e4m3fn', then 'e5m2')"),
    (["bench", "--sections", "train", "--repeats", "3", "--sections", "ops"],
     "--sections is given twice ('train', then 'ops')"),
    (["train", "cfg.yaml", "--config", "other.yaml", "--config", "third.yaml"], "--config is given twice"),
])
def test_bad_command_lines(capsys, argv, expected):
    code, err = _run_cli(capsys, argv)
    assert code == 2
    assert err[0].startswith("usage: fp8train") and err[-1].startswith("fp8train") and expected in err[-1], err


def test_no_command_prints_help(capsys):
    capsys.readouterr()
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("args, names", [
    (["train", "/nonexistent/config.yaml"], ["/nonexistent/config.yaml"]),
    (["train", "{config}", "optim.betas={{a: 1}}"], ["optim.betas"]),  # was a TypeError traceback from OmegaConf
])
def test_real_executable_exits_2_with_one_line(config_file, args, names, commands):
    argv = [a.format(config=config_file) for a in args]
    proc = commands.run(commands.fp8train(*argv, "--quiet"), timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, (proc.returncode, proc.stderr)
    assert err[0].startswith("fp8train train: error: ") and all(n in err[0] for n in names), err
