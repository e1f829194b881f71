"""The compact decoder: shapes, causality, RoPE, GQA, tying, the kv_transform hook, init, the HF wrapper."""

import json
import math
import sys

import numpy as np
import pytest
import torch

from fp8train.training.config import ModelConfig
from fp8train.training.models.decoder import Decoder, RMSNorm, apply_rope, build_model, count_params, rope_cos_sin

V, B, T = 256, 2, 16


def tiny(**kw) -> ModelConfig:
    args = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, seq_len=T, vocab_size=V)
    args.update(kw)
    return ModelConfig(**args)


def hf_tiny(**kw) -> ModelConfig:
    # An HF model takes its architecture from config.json: only the data fields (seq_len, vocab_size) are set.
    return ModelConfig(seq_len=T, vocab_size=V, **kw)


def make(seed=0, **kw) -> Decoder:
    torch.manual_seed(seed)
    return build_model(tiny(**kw))


def tokens(seed=1, b=B, t=T):
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_loss_at_init():
    model = make()
    idx = tokens()
    logits, loss = model(idx, idx)
    assert logits.shape == (B, T, V)
    assert loss.dtype == torch.float32 and loss.shape == ()
    # Small init => nearly uniform predictions => cross entropy ~ ln(V).
    assert abs(loss.item() - math.log(V)) < 0.05
    # Mean NLL from log-softmax written out, as an independent reference.
    ref = -torch.log_softmax(logits.double(), -1).gather(-1, idx[..., None]).mean()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert model(idx)[1] is None


def test_contract_module_names():
    names = dict(make().named_modules())
    for n in ["embed", "norm", "lm_head", "layers.1.attn_norm", "layers.1.mlp_norm"]:
        assert n in names
    for p in ["q_proj", "k_proj", "v_proj", "o_proj"]:
        assert isinstance(names[f"layers.0.attn.{p}"], torch.nn.Linear)
    for p in ["gate_proj", "up_proj", "down_proj"]:
        assert isinstance(names[f"layers.1.mlp.{p}"], torch.nn.Linear)
    assert names["layers.0.mlp.gate_proj"].out_features == tiny().ffn_dim() == 96  # 8/3*32=85 -> 96


def test_causality():
    model = make()
    idx = tokens()
    t = 9
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % V
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_rope_matches_complex_rotation_and_is_relative():
    hd, n = 8, 12
    cos, sin = rope_cos_sin(n, hd, theta=10000.0)
    x = torch.randn(1, 1, n, hd, dtype=torch.float32)
    # Independent reference: channels (i, i + hd/2) form a complex number rotated by angle pos * theta^(-2i/hd).
    freqs = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * freqs  # (n, hd/2)
    z = torch.complex(x[..., : hd // 2].double(), x[..., hd // 2:].double()) * torch.polar(torch.ones_like(angle), angle)
    ref = torch.cat([z.real, z.imag], dim=-1)
    torch.testing.assert_close(apply_rope(x, cos, sin).double(), ref, atol=1e-5, rtol=1e-5)
    # Relative position: <rope(q, m), rope(k, n)> depends on m - n only.
    q, k = torch.randn(hd), torch.randn(hd)
    qs = apply_rope(q.expand(1, 1, n, hd), cos, sin)[0, 0]
    ks = apply_rope(k.expand(1, 1, n, hd), cos, sin)[0, 0]
    for shift in (1, 4):
        assert torch.allclose(qs[7] @ ks[3], qs[7 + shift] @ ks[3 + shift], atol=1e-5)
    assert not torch.allclose(qs[7] @ ks[3], qs[7] @ ks[5], atol=1e-3)


def test_tied_embeddings_share_storage():
    tied, untied = make(tie_embeddings=True), make(tie_embeddings=False)
    assert tied.lm_head.weight is tied.embed.weight
    assert tied.lm_head.weight.data_ptr() == tied.embed.weight.data_ptr()
    assert count_params(untied) - count_params(tied) == V * 32
    idx = tokens()
    _, loss = tied(idx, idx)
    loss.backward()
    assert tied.embed.weight.grad is not None


def test_count_params_by_hand():
    cfg = tiny()
    d, kv, f, L = 32, cfg.kv_heads() * 8, cfg.ffn_dim(), 2
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * f + 2 * d  # q,o + k,v + mlp + 2 norms
    assert count_params(make()) == V * d + L * per_layer + d + d * V


def test_kv_transform_shapes_identity_and_effect():
    model = make()
    idx = tokens()
    seen = []

    def identity(k, v, layer_idx):
        seen.append((tuple(k.shape), tuple(v.shape), layer_idx))
        return k, v

    with torch.no_grad():
        ref, _ = model(idx)
        for layer in model.layers:
            layer.attn.kv_transform = identity
        same, _ = model(idx)
        for layer in model.layers:
            layer.attn.kv_transform = lambda k, v, i: (k, torch.zeros_like(v))
        zeroed, _ = model(idx)
    assert seen == [((B, 2, T, 8), (B, 2, T, 8), 0), ((B, 2, T, 8), (B, 2, T, 8), 1)]
    assert torch.equal(ref, same)
    assert not torch.allclose(ref, zeroed)


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = make(n_kv_heads=2)
    mha = make(n_kv_heads=4)
    state = gqa.state_dict()
    hd, group = 8, 2
    for name, w in list(state.items()):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            # kv head j serves query heads j*group .. (j+1)*group-1
            state[name] = w.view(2, hd, 32).repeat_interleave(group, dim=0).reshape(4 * hd, 32)
    mha.load_state_dict(state)
    idx = tokens()
    with torch.no_grad():
        torch.testing.assert_close(gqa(idx)[0], mha(idx)[0], atol=1e-5, rtol=1e-5)


def test_init_scales():
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layers=8, d_model=256, n_heads=4, seq_len=16))
    assert model.layers[0].attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.layers[0].mlp.down_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert model.layers[3].attn.o_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones(256))


def test_rmsnorm_computes_in_fp32():
    norm = RMSNorm(64)
    x = (torch.randn(4, 64) * 30).bfloat16()
    y = norm(x)
    assert y.dtype == torch.bfloat16
    x64 = x.double()
    ref = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    # only the final rounding to bf16 (2^-8 relative) is allowed
    torch.testing.assert_close(y.double(), ref, atol=0, rtol=2**-8)


def test_autocast_bf16_forward_backward():
    """bf16 autocast: bf16 logits, an fp32 loss and fp32 gradients that agree with the fp32 model's to bf16
    precision (8 significant bits per operand, fp32 accumulation)."""
    model = make()
    idx = tokens()
    logits_fp32, loss_fp32 = model(idx, idx)
    loss_fp32.backward()
    grads_fp32 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx, idx)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    torch.testing.assert_close(logits.float(), logits_fp32, rtol=2**-6, atol=2**-6 * logits_fp32.abs().max().item())
    assert loss.item() == pytest.approx(loss_fp32.item(), rel=1e-3)
    loss.backward()
    for (name, p), g32 in zip(model.named_parameters(), grads_fp32):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        cosine = torch.nn.functional.cosine_similarity(p.grad.flatten().double(), g32.flatten().double(), dim=0)
        assert cosine > 0.99, (name, cosine.item())


def test_a_few_steps_learn_a_fixed_batch():
    model = make()
    idx = tokens()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(8):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first - 0.3


def test_longer_context_than_seq_len_extends_rope():
    """A forward over 2x model.seq_len tokens: the first T positions see exactly what a T-token forward sees
    (causal attention, the same rotation angles), and the extended tables hold the RoPE angles of positions
    T..2T-1, p * theta^(-2i/hd) in the rotate-half layout, computed here in numpy float64."""
    model = make()
    idx = tokens(t=2 * T)
    short_logits, _ = model(idx[:, :T])
    logits, _ = model(idx)
    assert logits.shape == (B, 2 * T, V)
    torch.testing.assert_close(logits[:, :T], short_logits, rtol=1e-5, atol=1e-6)
    hd, theta = model.cfg.d_model // model.cfg.n_heads, model.cfg.rope_theta
    angles = np.arange(2 * T)[:, None] * theta ** (-np.arange(0, hd, 2) / hd)[None, :]
    angles = np.concatenate([angles, angles], axis=1)
    assert model.rope_cos.shape == (2 * T, hd)
    np.testing.assert_allclose(model.rope_cos.double().numpy(), np.cos(angles), rtol=0, atol=1e-7)
    np.testing.assert_allclose(model.rope_sin.double().numpy(), np.sin(angles), rtol=0, atol=1e-7)


# ---- Hugging Face wrapper -------------------------------------------------------------------------------------

TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=32,
    intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
)


def test_hf_llama_from_local_config_trains_one_step(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    torch.manual_seed(0)
    for hf_config in (str(tmp_path), str(tmp_path / "config.json")):
        model = build_model(hf_tiny(hf_config=hf_config))
    names = dict(model.named_modules())
    assert any(n.endswith("layers.0.self_attn.q_proj") for n in names)
    idx = tokens()
    logits, loss = model(idx, idx)
    assert logits.shape == (B, T, 256) and loss.dtype == torch.float32
    before = [p.detach().clone() for p in model.parameters()]
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_hf_config_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="model.hf_config"):
        build_model(hf_tiny(hf_config=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="no config.json"):
        build_model(hf_tiny(hf_config=str(tmp_path)))
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY_LLAMA, vocab_size=100)))
    with pytest.raises(ValueError, match="vocab_size"):  # model.vocab_size set on purpose (a nanoGPT .bin's ids)
        build_model(ModelConfig(seq_len=T, vocab_size=300, hf_config=str(tmp_path)))
    # at its default (the Decoder's byte vocabulary, unused by an HF model) it is not compared: the data's token
    # ids are checked against the model's vocabulary where the data is known (training/setup.py)
    assert build_model(ModelConfig(seq_len=T, hf_config=str(tmp_path))).hf.config.vocab_size == 100


def test_hf_missing_transformers_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match="pip install transformers"):
        build_model(hf_tiny(hf_config=str(tmp_path)))
