"""Layers whose weights stay quantized (formats: ops/quant_torch.py): QuantizedLinear and QuantizedEmbedding.

A QuantizedLinear runs the quantized-matmul op the model runner picks once (quant_ops, as the pointwise
layers' pointwise_ops); the activations and the output stay in the model's dtype. A fused projection (q|k|v,
gate|up) whose parts come in different formats (a GGUF Q4_K_M file keeps v in Q6_K) holds one weight per
run of parts of one format, each computing its columns. LoRA wraps a QuantizedLinear like an nn.Linear:
the adapters' A and B stay in the activation dtype (LoRALinear), only the base matmul is quantized.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from loramux.layers import DirectCall
from loramux.ops import quant_torch
from loramux.ops.quant_torch import QuantizedWeight


class QuantizedLinear(DirectCall, nn.Module):
    quant_ops = {"op": "quantized_linear"}  # set by the model runner from the quantized-matmul backend

    def __init__(self, weights: Sequence[QuantizedWeight], bias: torch.Tensor | None, dtype: torch.dtype,
                 output_sizes: Sequence[int] | None = None):
        super().__init__()
        if len({w.in_features for w in weights}) != 1:
            raise ValueError("every part of a quantized linear takes the same inputs")
        # A plain attribute, as PrepackedLinear's packed weight: raw blocks have no place in a state_dict.
        self.weights = list(weights)
        self.in_features = weights[0].in_features
        self.out_features = sum(w.out_features for w in weights)
        self.bias = bias
        self.dtype, self.device = dtype, weights[0].data.device  # the activations' (LoRALinear sizes its buffers so)
        if output_sizes is not None:
            self.output_sizes = tuple(output_sizes)
        self.op = quant_torch.quantized_linear

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights) + (0 if self.bias is None else self.bias.nbytes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features] in x's dtype."""
        if len(self.weights) == 1:
            return self.op(x, self.weights[0], self.bias)
        out = torch.cat([self.op(x, w) for w in self.weights], dim=-1)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        formats = "+".join(w.fmt for w in self.weights)
        return f"in_features={self.in_features}, out_features={self.out_features}, format={formats}"


class QuantizedEmbedding(nn.Module):
    """An embedding table kept quantized: a lookup decodes only the rows it reads."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        self.qweight, self.dtype = weight, dtype
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [n] -> [n, embedding_dim] in the model's dtype."""
        return quant_torch.embedding_rows(self.qweight, ids, self.dtype)


def fused_parts(parts: Sequence[QuantizedWeight]) -> list[QuantizedWeight]:
    """The parts of a fused projection, consecutive parts of one format stacked into one weight."""
    runs: list[list[QuantizedWeight]] = []
    for part in parts:
        if runs and runs[-1][0].fmt == part.fmt:
            runs[-1].append(part)
        else:
            runs.append([part])
    return [run[0] if len(run) == 1 else quant_torch.stack_rows(run) for run in runs]


def quantize_linears(model: nn.Module, fmt: str | Callable[[int], str], skip: Sequence[str] = ("lm_head",)) -> int:
    """Replace every nn.Linear of `model` but `skip` by a QuantizedLinear in `fmt` (or fmt(in_features)) (round
    to nearest, see ops.quant_torch.quantize); returns how many. The output head stays in the model's dtype (as
    GPTQ and AWQ checkpoints keep it: logits are the most sensitive)."""
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] not in skip]
    for name, linear in targets:
        prefix, _, attr = name.rpartition(".")
        weight = quant_torch.quantize(linear.weight, fmt if isinstance(fmt, str) else fmt(linear.in_features))
        weight.data = weight.data.to(linear.weight.device)
        layer = QuantizedLinear([weight], linear.bias, linear.weight.dtype, getattr(linear, "output_sizes", None))
        (model.get_submodule(prefix) if prefix else model).register_module(attr, layer)
    return len(targets)


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take (quantized ones as stored; a tied embedding/head counted once). Before
    the model runner prepacks the plain Linears."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            parts = [w.data for w in module.weights] + ([module.bias] if module.bias is not None else [])
        elif isinstance(module, QuantizedEmbedding):
            parts = [module.qweight.data]
        else:
            parts = list(module.parameters(recurse=False))
        for t in parts:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.nbytes
    return total
