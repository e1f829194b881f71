"""Dense export: a run as a plain Hugging Face folder, what anyone's `from_pretrained` loads and the next run's
`model.hf_path` fine-tunes from.

    fp8train export RUN_DIR --format hf --out model/ [--dtype float32|bfloat16]

The folder holds `config.json` (the model's own transformers config; fp8train's Decoder as the Llama it is, see
fp8train.serving.hf_export; `dtype` says what the tensors are), `generation_config.json`, the tokenizer's files
when the run tokenized text with one (`data.tokenizer`, or its model.hf_path folder's own), and
`model.safetensors`: the master weights of the run's newest valid checkpoint under the model's own names (no
`hf.` prefix) and in its own layout (a GPT-2 Conv1D weight (in, out)), a tied output head stored once, and no FP8
scaling state (training state of the run, not of the model). float32 (the default) is the master weights
exactly: a run fine-tuned from the folder starts from the weights this run ended with. bfloat16 halves the
folder and rounds every weight once.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fp8train.serving.hf_export import (generation_config_of, hf_config_dict, hf_export_names, refuse_moe_decoder,
                                        refuse_unsafe_out, run_tokenizer_folder, source_record, write_folder)
from fp8train.serving.run_loading import loaded_run, source_dir, tied_aliases

__all__ = ["DENSE_FORMAT", "DENSE_DTYPES", "export_dense_folder"]

DENSE_FORMAT = "hf"  # export --format value
DENSE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def export_dense_folder(run_dir, out, dtype: str = "float32", force: bool = False,
                        tokenizer: str | None = None) -> dict:
    """Write the dense Hugging Face folder of ``run_dir``'s newest valid checkpoint (or of a LoadedRun) to ``out``."""
    if dtype not in DENSE_DTYPES:
        raise ValueError(f"--dtype {dtype!r}; allowed: {', '.join(DENSE_DTYPES)}")
    out = refuse_unsafe_out(source_dir(run_dir), out, force)
    # the plain model (Conv1D again for GPT-2), its scaling buffers dropped; tokenizer: a Hugging Face folder's
    run = loaded_run(run_dir, tokenizer)
    refuse_moe_decoder(run)
    to_hf = hf_export_names(run.model)
    aliases = tied_aliases(run.model)
    tensors = {}
    for key, value in run.model.state_dict().items():
        if key in aliases:
            continue
        value = value.detach()
        tensors[to_hf(key)] = (value.to(DENSE_DTYPES[dtype]) if value.is_floating_point() else value).contiguous()
    config = hf_config_dict(run)
    config.pop("torch_dtype", None)
    config["dtype"] = dtype
    config["fp8train_export"] = source_record(run)
    write_folder(Path(out), tensors, config, run_tokenizer_folder(run), force, generation_config_of(run, config))
    return {"path": str(out), "format": DENSE_FORMAT, "dtype": dtype, "step": run.step, "tensors": len(tensors),
            "bytes": (Path(out) / "model.safetensors").stat().st_size}
