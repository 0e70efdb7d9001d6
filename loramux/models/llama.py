"""The Llama family in one file: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm), SmolLM2,
TinyLlama, and the mixture-of-experts members that share its attention (Qwen3-MoE, Mixtral, Qwen2-MoE: their
sparse MLP block is models/moe.py). GQA, RoPE, RMSNorm, SwiGLU, tied embeddings.

Module names follow HF transformers, except that q/k/v and gate/up are fused (`packed_modules_mapping`
says which HF projections each fused Linear holds), so PEFT adapter keys map onto this model directly.
The forward pass takes flat tokens: input_ids and positions are [num_tokens] for the whole batch.
"""
from __future__ import annotations

import torch
from torch import nn

from loramux.layers import DirectCall
from loramux.layers.attention import Attention, AttentionMetadata
from loramux.layers.linear import PackedLinear
from loramux.layers.activation import SiluAndMul
from loramux.layers.norm import RMSNorm
from loramux.layers.rotary import RotaryEmbedding
from loramux.models.moe import MOE_MODEL_TYPES, SparseMoeBlock, is_sparse_layer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(DirectCall, nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = head_dim_of(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.model_type in ("qwen2", "qwen2_moe") or bool(getattr(config, "attention_bias", False))
        self.qkv_sizes = (q_size, kv_size, kv_size)  # kept here: a LoRA layer may wrap qkv_proj
        self.qkv_proj = PackedLinear(config.hidden_size, self.qkv_sizes, bias=bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=bool(getattr(config, "attention_bias", False)))
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, rope, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """rope: RotaryEmbedding.lookup(positions); x: [num_tokens, hidden]."""
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(DirectCall, nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = PackedLinear(config.hidden_size, (inter, inter), bias=bool(getattr(config, "mlp_bias", False)))
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=bool(getattr(config, "mlp_bias", False)))
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(DirectCall, nn.Module):
    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # mixture-of-experts families: a sparse block where the config says so (models/moe.py)
        self.mlp = SparseMoeBlock(config, LlamaMLP) if is_sparse_layer(config, layer_idx) else LlamaMLP(config)

    def forward(self, rope, hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata):
        """hidden: the previous layer's MLP output (the embeddings in layer 0, residual None); residual: the
        stream it adds to. Returns (this layer's MLP output, the stream). HF's adds, in HF's order, each fused
        into the next norm."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(DirectCall, nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = rotary
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # [num_tokens, hidden]
        rope = self.rotary.lookup(positions)
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, meta)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    packed_modules_mapping = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config):
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        self.config = config
        self.rotary = RotaryEmbedding()
        self.model = LlamaModel(config, self.rotary)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] (only the rows that sample) -> float32 logits [n, vocab]."""
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]


def fuse_hf_state_dict(state_dict: dict[str, torch.Tensor], tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """HF names (q_proj, k_proj, ...) -> this model's names (qkv_proj, gate_up_proj)."""
    fused, parts = {}, {}
    for name, tensor in state_dict.items():
        if "rotary_emb" in name:
            continue
        prefix, _, leaf = name.rpartition(".")
        module_prefix, _, module = prefix.rpartition(".")
        packed = next((p for p, subs in LlamaForCausalLM.packed_modules_mapping.items() if module in subs), None)
        if packed is None:
            fused[name] = tensor
        else:
            index = LlamaForCausalLM.packed_modules_mapping[packed].index(module)
            parts.setdefault(f"{module_prefix}.{packed}.{leaf}", {})[index] = tensor
    for name, pieces in parts.items():
        fused[name] = torch.cat([pieces[i] for i in sorted(pieces)], dim=0)
    if (tie_word_embeddings or "lm_head.weight" not in fused) and "model.embed_tokens.weight" in fused:
        fused["lm_head.weight"] = fused["model.embed_tokens.weight"]
    return fused


def fuse_quantized(quantized: dict, share_head: bool) -> dict[str, list]:
    """Quantized weights under HF names -> {this model's module name: its parts in output order} (q_proj,
    k_proj, v_proj -> qkv_proj). share_head: the output head is the (quantized) embedding table."""
    layers: dict[str, dict[int, object]] = {}
    mapping = LlamaForCausalLM.packed_modules_mapping
    for name, weight in quantized.items():
        module_prefix, _, module = name.removesuffix(".weight").rpartition(".")
        packed = next((p for p, subs in mapping.items() if module in subs), None)
        if packed is None:
            layers[f"{module_prefix}.{module}" if module_prefix else module] = {0: weight}
        else:
            layers.setdefault(f"{module_prefix}.{packed}", {})[mapping[packed].index(module)] = weight
    for name, parts in layers.items():
        packed = name.rpartition(".")[2]
        if packed in mapping and len(parts) != len(mapping[packed]):
            raise ValueError(f"{name}: {', '.join(mapping[packed])} must all be quantized or all plain")
    out = {name: [parts[i] for i in sorted(parts)] for name, parts in layers.items()}
    if share_head and "model.embed_tokens" in out and "lm_head" not in out:
        out["lm_head"] = out["model.embed_tokens"]
    return out
