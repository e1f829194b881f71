"""Tiny Hugging Face artifacts made locally for the HF tests: pretrained folders (a few training steps, then
transformers' own save_pretrained), a byte-level BPE tokenizer trained with `tokenizers` on local text, and
`datasets` folders. Nothing is downloaded."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

VOCAB = 320  # >= the byte-level BPE vocabulary below, so every token id has an embedding row
TINY_ARCHS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                  tie_word_embeddings=False),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                  tie_word_embeddings=True),
    "gpt2": dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=64, n_layer=2, n_head=2,
                 n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
}

# Mixture-of-experts models whose experts are transformers 5's 3-D parameters (the experts interface): 4 experts,
# top-2, 2 layers. gpt-oss stores them transposed, gate and up interleaved, with per-expert biases.
_MOE_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                   max_position_embeddings=64, tie_word_embeddings=False, num_experts_per_tok=2)
TINY_MOE_ARCHS = {
    "qwen3_moe": dict(_MOE_COMMON, model_type="qwen3_moe", moe_intermediate_size=64, intermediate_size=128,
                      num_experts=4, decoder_sparse_step=1),
    "mixtral": dict(_MOE_COMMON, model_type="mixtral", intermediate_size=64, num_local_experts=4),
    "gpt_oss": dict(_MOE_COMMON, model_type="gpt_oss", intermediate_size=64, num_local_experts=4, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "qwen2_moe": dict(_MOE_COMMON, model_type="qwen2_moe", moe_intermediate_size=64, intermediate_size=128,
                      shared_expert_intermediate_size=64, num_experts=4, decoder_sparse_step=1),
    "olmoe": dict(_MOE_COMMON, model_type="olmoe", intermediate_size=64, num_experts=4),
    "deepseek_v3": dict(_MOE_COMMON, model_type="deepseek_v3", moe_intermediate_size=64, intermediate_size=128,
                        n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
                        q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                        head_dim=16),  # (its rotary dim: qk_rope_head_dim)
}


def local_text(max_bytes: int = 120_000) -> str:
    """Real text every machine has: the head of a few standard-library modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = ""
    for name in ("argparse.py", "textwrap.py", "string.py", "difflib.py"):
        text += (root / name).read_text()
    return text[:max_bytes]


def hf_config(arch: str):
    from transformers import AutoConfig

    fields = dict({**TINY_ARCHS, **TINY_MOE_ARCHS}[arch], vocab_size=VOCAB)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def make_pretrained(folder: Path, arch: str = "llama", steps: int = 10, seed: int = 0) -> Path:
    """A tiny causal LM trained `steps` SGD steps, written by transformers' save_pretrained. Its training text is
    random tokens with every other one a 7, so the weights are clearly not a random init: its loss on real text
    is far from log(VOCAB), where every freshly initialized model sits."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (4, 32))
        x[:, ::2] = 7
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(str(folder))
    return folder


def make_tokenizer(folder: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer trained on local text, saved as a transformers fast tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([local_text()], trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(str(folder))
    return folder


def make_text_folder(folder: Path, n_files: int = 8) -> Path:
    """A folder of text files (a by-file train/validation split needs several)."""
    folder.mkdir(parents=True, exist_ok=True)
    text = local_text()
    chunk = len(text) // n_files
    for i in range(n_files):
        (folder / f"doc{i}.txt").write_text(text[i * chunk:(i + 1) * chunk])
    return folder
