"""The sparse MLP block of the mixture-of-experts families (Qwen3-MoE, Mixtral, Qwen2-MoE with its shared
expert): a router picks each token's top-k experts, the fused-experts op runs them (ops/moe_torch.py), the
shared expert (Qwen2-MoE) is added through its sigmoid gate. The rest of these models is the Llama family's
(models/llama.py). Parameter names follow HF transformers 5: mlp.gate.weight [E, H] (the router),
mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I], mlp.shared_expert.*, mlp.shared_expert_gate.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from loramux.layers import DirectCall
from loramux.ops import moe_torch

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe")


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's
    normalize: bool  # renormalize the top-k weights to sum to 1
    keep_float: bool  # routing weights stay fp32 (Mixtral) instead of the activations' dtype
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)


def moe_spec(config) -> MoeSpec | None:
    kind = getattr(config, "model_type", None)
    if kind == "mixtral":
        return MoeSpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True, True)
    if kind in ("qwen3_moe", "qwen2_moe"):
        shared = getattr(config, "shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0
        return MoeSpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       bool(config.norm_topk_prob), False, shared)
    return None


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Whether decoder layer `layer_idx` has a sparse block (Qwen's decoder_sparse_step and mlp_only_layers say
    which; Mixtral's are all sparse)."""
    spec = moe_spec(config)
    if spec is None or spec.num_experts == 0:
        return False
    if getattr(config, "model_type", None) == "mixtral":
        return True
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and (layer_idx + 1) % step == 0


class FusedExperts(DirectCall, nn.Module):
    """The experts of one block, stacked. op: the fused-experts op, set once by the model runner (moe_ops);
    lora: the per-slot expert LoRA a LoRA layer hands it for one forward pass (None: base)."""

    moe_ops = {"op": "fused_experts"}

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.op = moe_torch.fused_experts

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                lora: moe_torch.ExpertLoRA | None = None) -> torch.Tensor:
        return self.op(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights, lora)


class SparseMoeBlock(DirectCall, nn.Module):
    def __init__(self, config, dense_mlp: type[nn.Module]):
        super().__init__()
        spec = moe_spec(config)
        self.spec = spec
        self.gate = nn.Linear(config.hidden_size, spec.num_experts, bias=False)
        self.experts = FusedExperts(spec.num_experts, config.hidden_size, spec.intermediate_size)
        if spec.shared_intermediate_size:
            self.shared_expert = dense_mlp(config, spec.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden]."""
        weights, ids = moe_torch.route(self.gate(x), self.spec.top_k, self.spec.normalize, self.spec.keep_float)
        out = self.experts(x, ids, weights)
        if self.spec.shared_intermediate_size:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


# Checkpoints written before transformers 5 keep one Linear per expert (Mixtral: block_sparse_moe.experts.<e>.w1
# gate, w3 up, w2 down; Qwen: mlp.experts.<e>.gate_proj / up_proj / down_proj) and Mixtral's router as
# block_sparse_moe.gate: stacked here into transformers 5's 3D layout.
_PER_EXPERT = re.compile(r"^(?P<layer>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def stack_expert_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with per-expert Linear weights stacked into mlp.experts.gate_up_proj / down_proj."""
    per_layer: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out = {}
    for name, tensor in state.items():
        match = _PER_EXPERT.match(name)
        if match:
            per_layer.setdefault(match["layer"], {})[int(match["expert"]), _PROJ.get(match["proj"], match["proj"])] = tensor
        else:
            out[name.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = tensor
    for layer, weights in per_layer.items():
        num = 1 + max(e for e, _ in weights)
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([weights[e, "gate_proj"], weights[e, "up_proj"]]) for e in range(num)])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([weights[e, "down_proj"] for e in range(num)])
    return out
