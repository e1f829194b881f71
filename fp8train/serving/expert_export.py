"""FP8 export of mixture-of-experts weights (transformers' 3-D experts, nn/hf_experts.py) in compressed-tensors'
per-expert layout, and their load back by fp8train's own loader.

transformers 5 holds a Qwen3-MoE layer's experts as two fused 3-D Parameters (`experts.gate_up_proj` (E, 2I, H),
gate rows first, and `experts.down_proj` (E, H, I)); the FP8 checkpoints it and vLLM load name every expert's
projection as its own Linear: `experts.{e}.gate_proj`, `experts.{e}.up_proj`, `experts.{e}.down_proj`, each with
`.weight` (E4M3) and `.weight_scale`, the scheme of every other FP8 Linear of the export (per output channel, or
per b x b tile). transformers' loader (its weight conversion for these model types) dequantizes them and fuses
them back into the 3-D Parameters: there the experts run with FP8-rounded weights in high precision
(weight-only), which is also what `load_hf_experts` below does for fp8train's loader; vLLM runs them W8A8.

Only the model types whose per-expert names and fused layout were checked against transformers 5.25 +
compressed-tensors 0.20.1 (logits compared) are written (PER_EXPERT_MODEL_TYPES); any other is refused in one
line naming the dense export, as are `--activations static` (calibration hooks see Linear inputs; an expert's
input is its routed tokens only) and a model whose experts are stored transposed (gpt-oss).
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn

from fp8train.nn.hf_experts import is_hf_experts
from fp8train.serving.fp8_weights import quantize_weight_blocks, quantize_weight_per_channel

__all__ = ["PER_EXPERT_MODEL_TYPES", "split_expert_names", "check_expert_export", "expert_fp8_tensors",
           "load_hf_experts"]

# model_type: checked by tests/test_moe_cli.py (transformers 5.25 + compressed-tensors 0.20.1 load the folder,
# logits compared); all four share transformers' per-expert gate_proj / up_proj / down_proj conversion
PER_EXPERT_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3")
_PER_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale)$")


def split_expert_names(model: nn.Module, fp8_names: list) -> tuple[list, list]:
    """(FP8 module names, FP8 expert projection names `...experts.gate_up_proj`) of a run's FP8 names."""
    modules = dict(model.named_modules())
    return [n for n in fp8_names if n in modules], [n for n in fp8_names if n not in modules]


def check_expert_export(run, expert_names: list, activations: str) -> None:
    """Refuse, in one line with the reason, an FP8 export of experts transformers cannot load (or not checked)."""
    if not expert_names:
        return
    model_type = getattr(getattr(run.model, "hf", run.model).config, "model_type", None)
    dense = f"write the dense folder instead: fp8train export {run.run_dir} --format hf --out DIR"
    if model_type not in PER_EXPERT_MODEL_TYPES:
        raise ValueError(f"FP8 export of mixture-of-experts weights is checked against transformers' loader for "
                         f"model_type {', '.join(PER_EXPERT_MODEL_TYPES)} only (per-expert compressed-tensors "
                         f"Linears fused back at load); {model_type!r} is not; {dense}")
    owner = run.model.get_submodule(expert_names[0].rpartition(".")[0])
    if getattr(owner, "is_transposed", False) or getattr(owner, "has_bias", False) or not owner.has_gate:
        raise ValueError(f"FP8 export of experts needs gate/up/down experts without biases in (out, in) layout; "
                         f"{expert_names[0]} is not; {dense}")
    if activations == "static":
        raise ValueError("--activations static calibrates one input scale per Linear; an expert's input is its "
                         "routed tokens only and is not calibrated: use --activations dynamic for this MoE run")


def _quantize(weight: torch.Tensor, weight_block: int):
    return quantize_weight_blocks(weight, "e4m3fn", weight_block) if weight_block \
        else quantize_weight_per_channel(weight, "e4m3fn")


def expert_fp8_tensors(run, expert_names: list, to_hf, weight_block: int) -> dict:
    """{per-expert HF name: tensor} for every FP8 expert projection: E4M3 weights and their weight_scale."""
    tensors = {}
    for name in expert_names:
        owner_name, _, param = name.rpartition(".")
        weight = getattr(run.model.get_submodule(owner_name), param).detach()   # (E, N, K)
        base = to_hf(owner_name)
        for e in range(weight.shape[0]):
            half = weight.shape[1] // 2  # gate_up_proj: gate rows, then up rows (transformers' layout)
            parts = {"gate_proj": weight[e, :half], "up_proj": weight[e, half:]} if param == "gate_up_proj" \
                else {param: weight[e]}
            for part, w in parts.items():
                q = _quantize(w, weight_block)
                tensors[f"{base}.{e}.{part}.weight"] = q.data.contiguous()
                tensors[f"{base}.{e}.{part}.weight_scale"] = q.scale.float().reshape(q.scale.shape[0], -1).contiguous()
    return tensors


def _dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes (N, K) x scale (N, 1) per channel, or (ceil(N/b), ceil(K/b)) per tile, in fp32."""
    values = codes.float()
    if scale.shape[1] == 1:
        return values * scale.float()
    rows = -(-codes.shape[0] // scale.shape[0])
    cols = -(-codes.shape[1] // scale.shape[1])
    full = scale.float().repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return values * full[:codes.shape[0], :codes.shape[1]]


@torch.no_grad()
def load_hf_experts(model: nn.Module, tensors: dict) -> set:
    """Pop the per-expert FP8 keys of `tensors` into `model`'s fused 3-D experts Parameters, dequantized
    (weight-only, as transformers' loader does); returns the state_dict keys filled. Refuses an expert it finds
    no Parameter, no weight or no scale for, and a fused Parameter some expert is missing from."""
    found: dict = {}
    filled = set()
    for key in list(tensors):
        match = _PER_EXPERT_KEY.match(key)
        if match:
            owner, e, part, kind = match.groups()
            found.setdefault(owner, {}).setdefault((int(e), part), {})[kind] = tensors.pop(key)
    for owner, parts in found.items():
        module = model.get_submodule(owner)
        if not is_hf_experts(module):
            raise ValueError(f"export: per-expert FP8 keys under {owner!r}, which is no experts module of the model")
        for (e, part), pair in parts.items():
            if set(pair) != {"weight", "weight_scale"}:
                raise ValueError(f"export: {owner}.{e}.{part} lacks its weight or weight_scale")
            values = _dequantize(pair["weight"], pair["weight_scale"])
            if part == "down_proj":
                module.down_proj[e].copy_(values)
            else:
                half = module.gate_up_proj.shape[1] // 2
                rows = slice(0, half) if part == "gate_proj" else slice(half, 2 * half)
                module.gate_up_proj[e, rows].copy_(values)
        names = {"down_proj": ["down_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
        for param, part_names in names.items():
            have = {(e, p) for e, p in parts if p in part_names}
            if have:
                if len(have) != module.num_experts * len(part_names):
                    raise ValueError(f"export: {owner}.{param} has {len(have)} of its "
                                     f"{module.num_experts * len(part_names)} per-expert FP8 weights")
                filled.add(f"{owner}.{param}")
    return filled
