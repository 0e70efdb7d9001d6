"""Mixture-of-experts families against HF transformers on the same weights: Qwen3-MoE (q/k norm), Mixtral
(fp32 routing weights), Qwen2-MoE (a shared expert behind a sigmoid gate, dense layers by mlp_only_layers),
from transformers 5 checkpoints (3D experts) and from the per-expert layout of older ones."""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from conftest import TINY, save_checkpoint
from loramux.models.loader import build_model, load_model
from models.test_llama import prefill_logits

MOE = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(moe_intermediate_size=32, num_experts=6,
                                                            num_experts_per_tok=2, norm_topk_prob=True)),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(intermediate_size=48, num_local_experts=5,
                                                       num_experts_per_tok=2)),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                                           shared_expert_intermediate_size=48, mlp_only_layers=[1],
                                                           norm_topk_prob=False)),
}


def tiny_moe(kind: str, seed: int = 0, **overrides):
    config_cls, model_cls, extra = MOE[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **extra, **overrides})).eval()
    with torch.no_grad():  # the router starts at zero in transformers 5: give it opinions
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") or "experts" in name:
                p.normal_(0, 0.5 if name.endswith("gate.weight") else 0.05)
    return model


@pytest.mark.parametrize("kind", list(MOE))
def test_moe_logits_equal_hf(kind):
    hf = tiny_moe(kind)
    ours = build_model(hf.config, hf.state_dict(), torch.float32, "cpu", 128)
    input_ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(input_ids).logits
    torch.testing.assert_close(prefill_logits(ours, input_ids), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_per_expert_checkpoints_are_stacked(kind, tmp_path):
    hf = tiny_moe(kind)
    path = save_checkpoint(hf, tmp_path / "m")
    state = load_file(os.path.join(path, "model.safetensors"))
    old = {}
    for name, t in state.items():  # the layout transformers 4 wrote
        if name.endswith("experts.gate_up_proj"):
            layer, inter = name.removesuffix(".mlp.experts.gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                names = ("w1", "w3") if kind == "mixtral" else ("gate_proj", "up_proj")
                block = "block_sparse_moe" if kind == "mixtral" else "mlp"
                old[f"{layer}.{block}.experts.{e}.{names[0]}.weight"] = t[e, :inter].clone()
                old[f"{layer}.{block}.experts.{e}.{names[1]}.weight"] = t[e, inter:].clone()
        elif name.endswith("experts.down_proj"):
            layer = name.removesuffix(".mlp.experts.down_proj")
            block, down = ("block_sparse_moe", "w2") if kind == "mixtral" else ("mlp", "down_proj")
            for e in range(t.shape[0]):
                old[f"{layer}.{block}.experts.{e}.{down}.weight"] = t[e].clone()
        elif kind == "mixtral" and name.endswith("mlp.gate.weight"):
            old[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t
        else:
            old[name] = t
    save_file(old, os.path.join(path, "model.safetensors"))
    loaded = load_model(path, dtype="float32")
    input_ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        expected = hf(input_ids).logits
    torch.testing.assert_close(prefill_logits(loaded.model, input_ids), expected, atol=1e-5, rtol=1e-5)
