"""Run files read back safely: a torn last line (what `kill -9` during an append leaves) is dropped by every
reader of run logs (telemetry.load, validate.load_curve, the loop's resume), a damaged line before the end is an
error naming the file and line, and appending after a torn line starts a fresh line."""

from __future__ import annotations

import json
import math

import pytest

from fp8train.evidence.curves import load_curve
from fp8train.evidence import advisor
from fp8train.training.runs import telemetry
from fp8train.training.storage.files import read_jsonl, truncate_jsonl

STATS = {"layers.0.attn.q_proj": {"input": {"amax": 3.5, "sqnr_db": 31.25, "overflow_frac": 0.0},
                                  "weight": {"amax": 0.5, "sqnr_db": math.inf, "overflow_frac": 0.0}}}
METRICS = [{"step": 0, "val_loss": 5.5, "lr": 0.001},
           {"step": 1, "loss": 5.25, "lr": 0.002, "tokens_per_s": 100.0},
           {"step": 2, "loss": 4.75, "val_loss": 4.5, "lr": 0.003, "tokens_per_s": 125.0}]


def _torn(line: str) -> str:
    return line[: len(line) // 2]  # half a record and no newline: a writer killed mid-append


@pytest.mark.parametrize("cut", [1, 7, -2])
def test_telemetry_load_drops_a_torn_last_line(tmp_path, cut):
    path = tmp_path / "telemetry.jsonl"
    telemetry.append(path, 4, STATS)
    telemetry.append(path, 8, STATS)
    whole = path.read_text()
    third = json.dumps({"step": 12, "layers": {"x": {"input": {"amax": 1.0}}}})
    path.write_text(whole + third[:cut])
    records = telemetry.load(path)
    assert [r["step"] for r in records] == [4, 8]
    assert records[0]["layers"]["layers.0.attn.q_proj"]["input"]["sqnr_db"] == 31.25
    # SQNR inf (an exact tensor) survives the strict-JSON file as "inf" and reads back as inf.
    table = advisor.layer_table(records)
    assert table["layers.0.attn.q_proj"]["weight"]["sqnr_db"] == math.inf


def test_telemetry_append_after_a_torn_line_starts_a_new_line(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    telemetry.append(path, 4, STATS)
    path.write_text(path.read_text() + '{"step": 8, "lay')
    telemetry.append(path, 8, STATS)
    assert [r["step"] for r in telemetry.load(path)] == [4, 8]
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_load_curve_drops_a_torn_last_line(tmp_path):
    lines = [json.dumps(r) for r in METRICS]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n" + _torn(lines[2]))
    curve = load_curve(tmp_path)
    assert curve.val == {0: 5.5}
    assert curve.train == {1: 5.25}
    assert curve.tokens_per_s == [100.0]


def test_load_curve_reads_every_complete_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in METRICS))
    curve = load_curve(tmp_path)
    assert curve.val == {0: 5.5, 2: 4.5} and curve.train == {1: 5.25, 2: 4.75}


@pytest.mark.parametrize("reader", [telemetry.load, lambda p: load_curve(p.parent)])
def test_a_damaged_line_before_the_end_is_an_error_naming_file_and_line(tmp_path, reader):
    path = tmp_path / ("telemetry.jsonl" if reader is telemetry.load else "metrics.jsonl")
    shape = {"layers": {}} if reader is telemetry.load else {}  # a telemetry record holds its layers' stats
    lines = [json.dumps({**r, **shape}) for r in METRICS]
    path.write_text(lines[0] + "\n" + _torn(lines[1]) + "\n" + lines[2] + "\n")
    with pytest.raises(ValueError, match=rf"{path.name}, line 2"):
        reader(path)


def test_truncate_keeps_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps(r) for r in METRICS]
    path.write_text("\n".join(lines) + "\n" + '{"step": 3, "lo')
    kept = truncate_jsonl(path, 1)
    assert kept == METRICS[:2] and read_jsonl(path) == METRICS[:2]
    assert path.read_text().endswith("\n")
