"""Make a tiny local Hugging Face model and tokenizer to try fp8train's HF flow on a CPU, nothing downloaded.

    python scripts/make_tiny_hf.py hf_tiny                 # a Llama
    python scripts/make_tiny_hf.py hf_gpt2 --arch gpt2     # a GPT-2 (Conv1D layers, tied head)

writes OUT/tokenizer/ (a byte-level BPE tokenizer, 512 tokens, trained with `tokenizers` on the running
Python's standard-library sources) and OUT/pretrained/ (a 2-layer, 64-wide model with that vocabulary,
pretrained for a few dozen AdamW steps on the same kind of text, written by transformers' save_pretrained, its
tokenizer saved beside it as a published checkpoint has it). It stands in for the checkpoint and tokenizer you
would fine-tune: recipes/hf_tiny.yaml points model.hf_path and data.tokenizer at hf_tiny's.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch

VOCAB = 512
SEQ_LEN = 64


def stdlib_text(max_bytes: int) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return "".join(parts)[:max_bytes]


def make_tokenizer(folder: Path, text: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([text], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tokenizer.save_pretrained(str(folder))
    return tokenizer


def tiny_model(arch: str, tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    ids = dict(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=SEQ_LEN,
                                          **ids))
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ_LEN,
                                        **ids))


def make_pretrained(folder: Path, tokenizer, text: str, steps: int, arch: str = "llama") -> None:
    torch.manual_seed(0)
    model = tiny_model(arch, tokenizer)
    ids = torch.tensor(tokenizer(text)["input_ids"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        starts = torch.randint(0, len(ids) - SEQ_LEN, (8,), generator=torch.Generator().manual_seed(step))
        batch = torch.stack([ids[s:s + SEQ_LEN] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"pretrained {steps} steps, last loss {float(loss.detach()):.3f}")
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder to create (tokenizer/ and pretrained/ inside)")
    parser.add_argument("--steps", type=int, default=60, help="pretraining steps (default 60)")
    parser.add_argument("--arch", choices=("llama", "gpt2"), default="llama", help="architecture (default llama)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    text = stdlib_text(400_000)
    tokenizer = make_tokenizer(out / "tokenizer", text)
    make_pretrained(out / "pretrained", tokenizer, text, args.steps, args.arch)
    print(f"wrote {out / 'tokenizer'} ({len(tokenizer)} tokens) and {out / 'pretrained'}")


if __name__ == "__main__":
    main()
