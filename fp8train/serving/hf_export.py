"""FP8 export as a Hugging Face folder: what `transformers.AutoModelForCausalLM.from_pretrained` and vLLM load.

    fp8train export RUN_DIR --format e4m3fn --out model-fp8/ [--activations dynamic|static] [--weight-block 128]

The folder holds `model.safetensors`, `config.json` (`dtype: bfloat16`, the dtype of its high-precision
tensors), `generation_config.json` and, when the run tokenized text with a tokenizer (`data.tokenizer`, or the
model.hf_path folder's own), the tokenizer's files. Names are Hugging Face names: an HF run's own
(`model.layers.0.self_attn.q_proj`, the `hf.` prefix of fp8train's wrapper dropped); fp8train's Decoder is
written as the Llama it is (RMSNorm, RoPE in the rotate-half layout, SwiGLU, grouped-query attention:
`LlamaForCausalLM`, names mapped by `_DECODER_TO_LLAMA`).

config.json carries a compressed-tensors `quantization_config` (format `float-quantized`), the scheme
transformers 5 and vLLM read for FP8 checkpoints:
- weights: E4M3 (OCP e4m3fn; compressed-tensors has no FNUZ), symmetric, static, one dequant scale per output
  channel (`weight_scale` float32 (out, 1)), or with a weight block b, one per b x b tile (`strategy: block`,
  `weight_scale` (ceil(out/b), ceil(in/b)), DeepSeek-V3's `weight_block_size` for b = 128);
- input activations: E4M3, dynamic per token (scale = amax(|token|) / 448 at run time; per 1 x b group with block
  weights), or static: one `input_scale` per layer, amax(|input|) / 448 over calibration windows of the run's
  train split after its last step (never the validation tokens), under the run's autocast;
- `ignore`: every Linear the run's layer policy kept out of FP8 (lm_head, routers, ...), which stay bf16 as do
  embeddings and norms. GPT-2's Conv1D layers are not nn.Linear, which compressed-tensors quantizes, so they are
  written dense in bf16 and not listed; a run whose FP8 layers are all Conv1D (GPT-2) is refused, pointing at
  the dense folder (`--format hf`, fp8train.serving.dense_export), which transformers and vLLM load as GPT-2.

`load_hf_export(folder)` is fp8train's own loader: the architecture from config.json, each FP8 Linear run as
`Fp8ActivationLinear` (the same W8A8 arithmetic, written from the scheme above, in fp32).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from fp8train.numerics.formats import get_format
from fp8train.serving.expert_export import check_expert_export, expert_fp8_tensors, load_hf_experts, split_expert_names
from fp8train.serving.fp8_weights import (ACTIVATION_SCHEMES, Fp8ActivationLinear, quantize_weight_blocks,
                                          quantize_weight_per_channel)
from fp8train.serving.run_loading import (LoadedRun, fp8_linear_names, loaded_run, package_version, source_dir,
                                          tied_aliases)
from fp8train.training.data.corpus import build_data, is_pretokenized
from fp8train.training.models.hf import HFCausalLM
from fp8train.training.storage.outputs import check_output_folder, replace_output_folder
from fp8train.training.storage.files import as_os_error, give_default_mode, write_text_atomic
from fp8train.training.data.tokenized import run_tokenizer

__all__ = ["export_hf_folder", "load_hf_export", "hf_export_names", "quantization_config", "llama_config_of",
           "hf_config_dict", "run_tokenizer_folder", "generation_config_of", "source_record", "write_folder",
           "refuse_unsafe_out", "vllm_mixed_groups", "VLLM_FUSED", "export_notes", "refuse_moe_decoder"]

_DECODER_TO_LLAMA = (
    (r"^embed\.", "model.embed_tokens."),
    (r"^layers\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^layers\.(\d+)\.mlp_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^layers\.(\d+)\.attn\.", r"model.layers.\1.self_attn."),
    (r"^layers\.(\d+)\.mlp\.", r"model.layers.\1.mlp."),
    (r"^norm\.", "model.norm."),
)
E4M3_MAX = get_format("e4m3fn").max
# Sibling projections vLLM fuses into one layer (qkv_proj, gate_up_proj); it refuses a fused layer whose parts
# differ in precision (some FP8, some in `ignore`), so an export that splits one is flagged.
VLLM_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def hf_export_names(model: nn.Module):
    """name -> Hugging Face name, for state_dict keys and module names of the run's model."""
    if isinstance(model, HFCausalLM):
        return lambda name: name[len("hf."):] if name.startswith("hf.") else name

    def to_llama(name: str) -> str:
        for pattern, replacement in _DECODER_TO_LLAMA:  # "." appended so a module name maps like its tensors
            mapped, count = re.subn(pattern, replacement, name + ".")
            if count:
                return mapped[:-1]
        return name

    return to_llama


def refuse_moe_decoder(run: LoadedRun) -> None:
    """A Hugging Face folder of fp8train's own decoder is a Llama: its MoE blocks (model.n_experts > 0) have no
    Llama counterpart, and a Llama folder without them would load with fresh MLPs (wrong logits), so it is
    refused before anything is written."""
    if not isinstance(run.model, HFCausalLM) and run.cfg.model.n_experts > 0:
        raise ValueError(f"{run.run_dir} trained fp8train's decoder with model.n_experts={run.cfg.model.n_experts} "
                         "(MoE blocks): a Hugging Face folder of that decoder is a Llama, which has no experts; "
                         "export it as a .safetensors file (--out NAME.safetensors), or fine-tune a Hugging Face "
                         "MoE model (model.hf_path) to export a folder")


def llama_config_of(model_cfg) -> dict:
    """The LlamaConfig (as a dict) that computes what fp8train's Decoder of ``model_cfg`` computes."""
    from transformers import LlamaConfig

    head_dim = model_cfg.d_model // model_cfg.n_heads
    config = LlamaConfig(
        vocab_size=model_cfg.vocab_size, hidden_size=model_cfg.d_model, intermediate_size=model_cfg.ffn_dim(),
        num_hidden_layers=model_cfg.n_layers, num_attention_heads=model_cfg.n_heads,
        num_key_value_heads=model_cfg.kv_heads(), head_dim=head_dim, max_position_embeddings=model_cfg.seq_len,
        rms_norm_eps=model_cfg.norm_eps, rope_theta=model_cfg.rope_theta, hidden_act="silu",
        tie_word_embeddings=model_cfg.tie_embeddings, attention_bias=False, mlp_bias=False)
    config.architectures = ["LlamaForCausalLM"]
    return config.to_dict()


def hf_config_dict(run: LoadedRun) -> dict:
    """The model's own transformers config (a Decoder run: the Llama it is) as a dict, fp8train keys left out."""
    if isinstance(run.model, HFCausalLM):
        config = json.loads(run.model.hf.config.to_json_string(use_diff=False))
        for key in ("fp8train", "quantization_config", "_attn_implementation_autoset"):
            config.pop(key, None)
        config.pop("_attn_implementation", None)
        return config
    return llama_config_of(run.cfg.model)


def vllm_mixed_groups(model: nn.Module, fp8_names: list, to_hf) -> list[str]:
    """The fused groups (VLLM_FUSED) whose members the export splits between FP8 and `ignore`, by HF name."""
    fp8, mixed = set(fp8_names), []
    for parent, module in model.named_modules():
        for group in VLLM_FUSED:
            members = [f"{parent}.{child}" if parent else child for child in group
                       if isinstance(getattr(module, child, None), nn.Linear)]
            if len(members) > 1 and len({m in fp8 for m in members}) > 1:
                mixed.append(" + ".join(to_hf(m) for m in members))
    return mixed


def source_record(run: LoadedRun) -> dict:
    """Where an exported folder came from (its config.json's `fp8train_export`)."""
    return {"source_run": str(run.run_dir.resolve()), "source_step": run.step, "source_recipe": run.cfg.fp8.recipe,
            "fp8train_version": package_version()}


def quantization_config(ignore: list, activations: str, weight_block: int) -> dict:
    """The compressed-tensors quantization_config of an export (see the module docstring)."""
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    weights = {**fp8, "dynamic": False, "strategy": "block" if weight_block else "channel",
               "block_structure": [weight_block, weight_block] if weight_block else None}
    if activations == "static":
        inputs = {**fp8, "dynamic": False, "strategy": "tensor"}
    elif weight_block:
        inputs = {**fp8, "dynamic": True, "strategy": "group", "group_size": weight_block}
    else:
        inputs = {**fp8, "dynamic": True, "strategy": "token"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None}},
            "ignore": ignore, "kv_cache_scheme": None}


# ------------------------------------------------------------------------------------------------------------
# Calibration (static input scales)
# ------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def calibrate_input_amax(run: LoadedRun, names: list, batches: int) -> dict:
    """{layer name: amax(|input|)} over ``batches`` train-split windows after the run's last step."""
    if batches < 1:
        raise ValueError("--calib-batches must be >= 1 for --activations static")
    data = build_data(run.cfg)
    amax = {name: torch.zeros(()) for name in names}

    def recorder(name):
        def hook(module, args):
            amax[name] = torch.maximum(amax[name], args[0].detach().abs().max().float().cpu())
        return hook

    handles = [run.model.get_submodule(name).register_forward_pre_hook(recorder(name)) for name in names]
    try:
        for i in range(batches):
            x, _ = data.train_batch(run.cfg.train.max_steps + i)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=run.cfg.train.autocast == "bf16"):
                run.model(x)
    finally:
        for handle in handles:
            handle.remove()
    return amax


# ------------------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------------------
def _check_options(fmt: str, activations: str, weight_block: int) -> None:
    if get_format(fmt).name != "e4m3fn":
        raise ValueError(f"--format {fmt!r}: a Hugging Face folder export holds OCP e4m3fn weights (compressed-tensors "
                         "has no FNUZ); for e4m3fnuz export a .safetensors file (--out NAME.safetensors)")
    if activations not in ACTIVATION_SCHEMES:
        raise ValueError(f"--activations {activations!r}; allowed: {', '.join(ACTIVATION_SCHEMES)}")
    if weight_block < 0 or (weight_block and weight_block % 16):
        raise ValueError(f"--weight-block {weight_block}: 0 (per output channel) or a multiple of 16, e.g. 128")


def _fp8_tensors(run: LoadedRun, names: list, to_hf, weight_block: int, input_amax: dict | None) -> dict:
    tensors = {}
    for name in names:
        linear = run.model.get_submodule(name)
        q = quantize_weight_blocks(linear.weight, "e4m3fn", weight_block) if weight_block \
            else quantize_weight_per_channel(linear.weight, "e4m3fn")
        hf_name = to_hf(name)
        tensors[f"{hf_name}.weight"] = q.data.contiguous()
        tensors[f"{hf_name}.weight_scale"] = q.scale.float().reshape(q.scale.shape[0], -1).contiguous()
        if input_amax is not None:  # an all-zero calibration input gets scale 1, never 0
            amax = float(input_amax[name])
            tensors[f"{hf_name}.input_scale"] = torch.tensor([amax / E4M3_MAX if amax > 0 else 1.0])
        if linear.bias is not None:
            tensors[f"{hf_name}.bias"] = linear.bias.detach().to(torch.bfloat16).contiguous()
    return tensors


def run_tokenizer_folder(run: LoadedRun) -> str | None:
    """The tokenizer folder the run tokenized its text with (None: bytes, or pre-tokenized ids)."""
    return run_tokenizer(run.cfg, pretokenized=is_pretokenized(run.cfg.data))


def generation_config_of(run: LoadedRun, config: dict):
    """The generation config a folder of ``run`` carries: an HF model's own, else one from config.json's ids."""
    from transformers import GenerationConfig

    if isinstance(run.model, HFCausalLM) and getattr(run.model.hf, "generation_config", None) is not None:
        return run.model.hf.generation_config
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    return GenerationConfig(**ids)


def write_folder(out: Path, tensors: dict, config: dict, tokenizer_folder: str | None, force: bool = False,
                 generation_config=None) -> None:
    # Built aside and renamed into place (outputs.replace_output_folder): a failure never leaves half a folder at
    # `out`; with --force the old folder (fp8train's own, checked before by refuse_unsafe_out) is replaced only
    # once the new one is complete.
    def build(folder: Path) -> None:
        try:
            save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        except Exception as err:  # safetensors' own error type: its OSError (full disk) only in the text
            raise as_os_error(err, out) or err
        give_default_mode(folder / "model.safetensors")  # safetensors writes 0600
        write_text_atomic(folder / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
        if generation_config is not None:
            generation_config.save_pretrained(str(folder))
        if tokenizer_folder:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(os.path.expanduser(tokenizer_folder), local_files_only=True
                                          ).save_pretrained(str(folder))

    replace_output_folder(out, "export", build)


def refuse_unsafe_out(run_dir, out, force: bool) -> Path:
    """``out`` checked as a folder output of an export of ``run_dir`` (outputs.check_output_folder: --force only
    over a folder fp8train wrote, never the source run, a folder holding it, or its checkpoints)."""
    return check_output_folder(out, force=force, sources=[run_dir])


def export_hf_folder(run_dir, out, fmt="e4m3fn", activations: str = "dynamic", weight_block: int = 0,
                     calib_batches: int = 4, force: bool = False, tokenizer: str | None = None) -> dict:
    """Write the Hugging Face FP8 folder of ``run_dir``'s newest valid checkpoint (or of a LoadedRun) to ``out``."""
    _check_options(fmt, activations, weight_block)
    out = refuse_unsafe_out(source_dir(run_dir), out, force)
    run = loaded_run(run_dir, tokenizer)  # (tokenizer: a Hugging Face folder without one)
    refuse_moe_decoder(run)
    _, expert_names = split_expert_names(run.model, run.fp8_names)
    check_expert_export(run, expert_names, activations)
    names = fp8_linear_names(run, experts_exported=True)
    ragged = [n for n in names if weight_block and run.model.get_submodule(n).in_features % weight_block]
    if ragged:
        raise ValueError(f"--weight-block {weight_block} must divide in_features of every FP8 layer (compressed-tensors "
                         f"groups the inputs 1 x {weight_block}); {ragged[0]} has "
                         f"{run.model.get_submodule(ragged[0]).in_features}")
    to_hf = hf_export_names(run.model)
    input_amax = calibrate_input_amax(run, names, calib_batches) if activations == "static" else None
    tensors = _fp8_tensors(run, names, to_hf, weight_block, input_amax)
    tensors.update(expert_fp8_tensors(run, expert_names, to_hf, weight_block))
    skip = {f"{n}.{t}" for n in names for t in ("weight", "bias")} | set(expert_names) | tied_aliases(run.model)
    for key, value in run.model.state_dict().items():
        if key in skip:
            continue
        value = value.detach()
        tensors[to_hf(key)] = (value.to(torch.bfloat16) if value.is_floating_point() else value).contiguous()
    linears = [n for n, m in run.model.named_modules() if isinstance(m, nn.Linear)]
    config = hf_config_dict(run)
    config.pop("torch_dtype", None)  # transformers 5 reads `dtype`; one key, the dtype of the bf16 tensors
    config.update(dtype="bfloat16", quantization_config=quantization_config(
        [to_hf(n) for n in linears if n not in names], activations, weight_block))
    config["fp8train_export"] = source_record(run)
    write_folder(out, tensors, config, run_tokenizer_folder(run), force, generation_config_of(run, config))
    return {"path": str(out), "format": "e4m3fn", "fp8_layers": len(names), "fp8_experts": len(expert_names),
            "step": run.step,
            "activations": activations, "weight_block": weight_block,
            "vllm_mixed_fused": vllm_mixed_groups(run.model, names, to_hf),
            # transformers loads a partial last block row; vLLM checks each fused shard's outputs against B
            "ragged_out_features": [(to_hf(n), run.model.get_submodule(n).out_features) for n in names
                                    if weight_block and run.model.get_submodule(n).out_features % weight_block],
            "bytes": (out / "model.safetensors").stat().st_size}


def export_notes(result: dict) -> list[str]:
    """What a reader of `export_hf_folder`'s ``result`` should know before serving the folder with vLLM: fused
    layers split between FP8 and bf16, and FP8 layers whose outputs are not a multiple of the weight block
    (transformers loads both; vLLM checks each part of a fused layer)."""
    notes, mixed, ragged = [], result["vllm_mixed_fused"], result["ragged_out_features"]
    if mixed:
        notes.append(f"vLLM fuses {mixed[0]}" + (f" (and {len(mixed) - 1} more groups)" if len(mixed) > 1 else "")
                     + " into one layer and refuses parts of different precision; this export has some in FP8 and "
                     "some in bf16 (layer policy: lower policy.min_features, or exclude them together)")
    if ragged:
        block = result["weight_block"]
        notes.append(f"--weight-block {block}: {ragged[0][0]} has {ragged[0][1]} outputs, not a multiple of {block}"
                     + (f" (and {len(ragged) - 1} more layers)" if len(ragged) > 1 else "") + "; transformers loads "
                     "its partial last tile, vLLM refuses a fused part whose outputs are not a multiple of the block "
                     "(choose a block that divides them)")
    return notes


# ------------------------------------------------------------------------------------------------------------
# fp8train's own loader of the folder
# ------------------------------------------------------------------------------------------------------------
def _read_scheme(folder: Path) -> tuple[dict, dict]:
    config_file = folder / "config.json"
    if not config_file.is_file() or not (folder / "model.safetensors").is_file():
        raise ValueError(f"{str(folder)!r} is not an fp8train Hugging Face export (needs config.json and "
                         "model.safetensors)")
    config = json.loads(config_file.read_text())
    scheme = config.get("quantization_config") or {}
    if scheme.get("quant_method") != "compressed-tensors" or scheme.get("format") != "float-quantized":
        raise ValueError(f"{str(folder)!r}: config.json has no compressed-tensors float-quantized "
                         "quantization_config")
    return config, scheme["config_groups"]["group_0"]


def load_hf_export(folder, device="cpu") -> nn.Module:
    """The transformers model of an export folder with every FP8 Linear as Fp8ActivationLinear (eval mode)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    _, group = _read_scheme(folder)
    block = (group["weights"].get("block_structure") or [0])[0]
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    for key in ("quantization_config", "fp8train_export"):
        if hasattr(config, key):
            delattr(config, key)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_file(str(folder / "model.safetensors"), device=str(device))
    filled = load_hf_experts(model, tensors)  # per-expert FP8 keys into the fused experts (expert_export.py)
    for name in [k[:-len(".weight_scale")] for k in tensors if k.endswith(".weight_scale")]:
        layer = Fp8ActivationLinear(tensors.pop(f"{name}.weight"), tensors.pop(f"{name}.weight_scale"),
                                    tensors.pop(f"{name}.bias", None), tensors.pop(f"{name}.input_scale", None),
                                    weight_block=block)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    expected = model.state_dict()
    unexpected = [k for k in tensors if k not in expected]
    missing = [k for k in expected if k not in tensors and k not in tied_aliases(model) and k not in filled
               and not isinstance(model.get_submodule(k.rpartition(".")[0]), Fp8ActivationLinear)]
    if unexpected or missing:
        raise ValueError(f"export {str(folder)!r} does not fit its config.json: missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]}")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()}, strict=False)
    return model.eval()
