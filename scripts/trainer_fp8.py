"""Fine-tune a local Hugging Face model with transformers' Trainer, its Linear layers in FP8 (delayed scaling).

    python scripts/trainer_fp8.py hf_tiny/pretrained --out hf_tiny/trainer     # -> hf_tiny/trainer/checkpoint-20

The habits of a Trainer user, kept: the model is loaded with from_pretrained, converted with
`fp8train.convert_to_fp8`, trained by `Trainer` with `fp8train.Fp8ScalingCallback` (delayed scaling updates its
scales after each optimizer step), and checkpointed by the Trainer itself (no tokenizer in the checkpoint, as a
Trainer without processing_class saves none). `fp8train.from_pretrained(checkpoint)` restores the FP8 model and
`fp8train export CHECKPOINT --format e4m3fn --tokenizer TOKENIZER --out DIR` writes the FP8 folder to serve.
Text: the running Python's standard-library sources, tokenized with the model folder's tokenizer.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch

SEQ_LEN = 64


class Windows(torch.utils.data.Dataset):
    """Fixed windows of SEQ_LEN tokens of one long text: the labels are the inputs (the model shifts them)."""

    def __init__(self, ids: torch.Tensor, count: int):
        starts = torch.randint(0, len(ids) - SEQ_LEN, (count,), generator=torch.Generator().manual_seed(0))
        self.windows = torch.stack([ids[s:s + SEQ_LEN] for s in starts.tolist()])

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def stdlib_text(max_bytes: int) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    return "".join(p.read_text(errors="replace") for p in sorted(root.glob("*.py"))[:20])[:max_bytes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="local model folder (config.json, safetensors weights, tokenizer)")
    parser.add_argument("--out", required=True, help="the Trainer's output_dir (checkpoint-N folders inside)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps; one checkpoint at the end")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    import fp8train

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)  # fp32 master weights
    # min_features 32: the tiny Llama's k_proj / v_proj (32 outputs) go to FP8 with q_proj, as vLLM fuses them
    print(fp8train.convert_to_fp8(model, "delayed", fp8train.LayerPolicy(min_features=32)).__str__().splitlines()[0])
    ids = torch.tensor(tokenizer(stdlib_text(200_000))["input_ids"])
    training = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4,
                                 learning_rate=1e-3, warmup_steps=2, use_cpu=True, report_to="none",
                                 logging_steps=max(1, args.steps // 4), save_strategy="steps", save_steps=args.steps,
                                 dataloader_num_workers=0)
    trainer = Trainer(model=model, args=training, train_dataset=Windows(ids, 4 * args.steps),
                      callbacks=[fp8train.Fp8ScalingCallback()])
    trainer.train()
    print(f"wrote {Path(args.out) / f'checkpoint-{args.steps}'}")


if __name__ == "__main__":
    main()
