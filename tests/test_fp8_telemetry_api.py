"""Per-layer FP8 health for code outside fp8train's loop: `fp8train.collect_fp8_telemetry(model)` (library and
accelerate users) and `fp8train.Fp8TelemetryCallback` (transformers.Trainer users, logged through `report_to`).

Independent references: the weight's amax from torch and its SQNR from ml_dtypes' float8_e4m3fn rounding of the
tensorwise-scaled weight in float64 (the current recipe's documented rule: scale = 448 / amax); the Trainer test
reads the metrics back from a real wandb offline run file (tests/wandb_records.py).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8train
from fp8train import LayerPolicy, convert_to_fp8, recipe
from fp8train.nn.recipes import ROLES
from hf_helpers import VOCAB, hf_config
from wandb_records import records

pytestmark = pytest.mark.usefixtures("single_thread")
E4M3_MAX = 448.0
STATS = ("amax", "scale", "overflow_frac", "underflow_frac", "sqnr_db")


def _weight_sqnr_db(weight: torch.Tensor) -> float:
    w = weight.detach().double().numpy()
    scale = E4M3_MAX / np.abs(w).max()
    dequantized = (w * scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) / scale
    return 10 * math.log10((w ** 2).sum() / ((w - dequantized) ** 2).sum())


def test_collect_fp8_telemetry_reports_every_layer_and_role_against_references():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    convert_to_fp8(model, recipe("current"), LayerPolicy(min_features=16))
    assert fp8train.collect_fp8_telemetry(model) == {}  # nothing sampled yet
    assert fp8train.sample_fp8_telemetry(model) == 2
    model(torch.randn(16, 32)).square().mean().backward()
    metrics = fp8train.collect_fp8_telemetry(model)
    per_layer = {f"fp8/{name}/{role}/{stat}" for name in ("0", "2") for role in ROLES for stat in STATS}
    assert per_layer <= set(metrics)
    for name in ("0", "2"):
        weight = model[int(name)].weight
        assert metrics[f"fp8/{name}/weight/amax"] == pytest.approx(weight.abs().max().item(), rel=1e-6)
        assert metrics[f"fp8/{name}/weight/sqnr_db"] == pytest.approx(_weight_sqnr_db(weight), abs=0.05)
        assert metrics[f"fp8/{name}/weight/overflow_frac"] == 0.0
    assert metrics["fp8/weight/sqnr_min_db"] == pytest.approx(min(metrics["fp8/0/weight/sqnr_db"],
                                                                  metrics["fp8/2/weight/sqnr_db"]))
    assert fp8train.collect_fp8_telemetry(model) == {}  # read once: the next call waits for the next sample
    model(torch.randn(16, 32)).sum().backward()
    assert fp8train.collect_fp8_telemetry(model) == {}  # an unsampled step records nothing


def test_layer_names_are_the_transformers_names(tmp_path):
    from fp8train.training.config import ModelConfig
    from fp8train.training.models.decoder import build_model

    hf_config("llama").save_pretrained(str(tmp_path / "cfg"))
    model = build_model(ModelConfig(hf_config=str(tmp_path / "cfg"), seq_len=16))
    convert_to_fp8(model, recipe("current"), LayerPolicy(min_features=16))
    fp8train.sample_fp8_telemetry(model)
    x = torch.randint(0, VOCAB, (2, 16))
    model(x, x)[1].backward()
    layers = {key.split("/")[1] for key in fp8train.collect_fp8_telemetry(model) if key.count("/") == 3}
    transformers_names = {name for name, m in model.hf.named_modules() if isinstance(m, fp8train.Fp8Linear)}
    assert layers == transformers_names and "model.layers.0.mlp.up_proj" in layers


class _Windows(torch.utils.data.Dataset):
    def __init__(self, n=8, length=16):
        self.ids = torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _history(run_file) -> dict[int, dict]:
    """{train/global_step: the logged values} of every history record of a wandb offline run file."""
    import json

    out = {}
    for record in records(run_file):
        if record.WhichOneof("record_type") == "history":
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
            if "train/global_step" in row:
                out.setdefault(int(row["train/global_step"]), {}).update(row)
    return out


@pytest.mark.slow
def test_trainer_callback_sends_per_layer_health_to_wandb(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from wandb_records import offline_run

    for var, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_PROJECT": "trainer-fp8",
                       "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "home"),
                       "WANDB_CACHE_DIR": str(tmp_path / "home"), "WANDB_DATA_DIR": str(tmp_path / "home")}.items():
        monkeypatch.setenv(var, value)
    import wandb

    wandb.teardown()  # wandb reads its environment once per process: another test in this worker may have set it up
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("llama"), dtype=torch.float32)
    report = convert_to_fp8(model, recipe("delayed"), LayerPolicy(min_features=16))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=2,
                             learning_rate=1e-3, use_cpu=True, report_to=["wandb"], logging_steps=1,
                             save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=_Windows(), callbacks=[fp8train.Fp8ScalingCallback()])
    trainer.add_callback(fp8train.Fp8TelemetryCallback(trainer, every=2))
    trainer.train()
    wandb.finish()  # what the end of a script does; the Trainer leaves the run open
    sampled = {row["step"] for row in trainer.state.log_history if "fp8/weight/sqnr_min_db" in row}
    assert sampled == {2, 4}, trainer.state.log_history
    offline_run(tmp_path)
    history = _history(next(tmp_path.glob("wandb/offline-run-*/run-*.wandb")))
    layers = [name for name, _ in report.converted]
    for step in (2, 4):
        row = history[step]
        for name in layers:
            for role in ROLES:
                sqnr = row[f"train/fp8/{name}/{role}/sqnr_db"]
                assert sqnr == "Infinity" or sqnr > 15, (name, role, sqnr)  # E4M3 / E5M2 on smooth tensors
                assert 0 <= row[f"train/fp8/{name}/{role}/overflow_frac"] <= 1
    for step in (1, 3):
        assert not any(key.startswith("train/fp8/") for key in history.get(step, {})), step


def test_the_callback_without_its_trainer_says_how_to_attach_it(tmp_path):
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_config(hf_config("llama"), dtype=torch.float32)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to="none")
    trainer = Trainer(model=model, args=args, train_dataset=_Windows(), callbacks=[fp8train.Fp8TelemetryCallback()])
    with pytest.raises(ValueError, match=r"trainer\.add_callback\(Fp8TelemetryCallback\(trainer"):
        trainer.train()
    with pytest.raises(ValueError, match="every=0"):
        fp8train.Fp8TelemetryCallback(trainer, every=0)
