"""Sampler: per-request penalties, temperature, top-k, top-p and seeds over one batch of logits.

A seeded request draws from its own torch.Generator, advanced once per token it samples, so its
tokens do not depend on which requests share its batch.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loramux.ops import pointwise_torch
from loramux.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    output_token_ids: list[int]
    generator: torch.Generator | None  # None: greedy, or the engine's shared generator


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """OpenAI semantics over generated tokens: logit -= frequency * count + presence * (count > 0)."""
    for i, row in enumerate(rows):
        p = row.params
        if not (p.presence_penalty or p.frequency_penalty) or not row.output_token_ids:
            continue
        ids = torch.tensor(row.output_token_ids, device=logits.device)
        counts = torch.bincount(ids, minlength=logits.shape[1]).to(logits.dtype)
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [vocab] (already divided by temperature) -> logits with filtered tokens at -inf."""
    if 0 < top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.empty_like(drop).scatter_(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           argmax: Callable[[torch.Tensor], torch.Tensor] = pointwise_torch.argmax) -> list[int | None]:
    """logits: [batch, vocab] float32 -> one token id per row. `argmax`: a pointwise backend's (greedy rows).

    None for a row whose logits are not all finite (NaN or Inf, from its adapter or its inputs): no token
    can be trusted there, and that request fails alone; the other rows are sampled as usual."""
    apply_penalties(logits, rows)
    finite = torch.isfinite(logits.sum(-1)).tolist()  # one pass over [batch, vocab]; inf - inf gives NaN
    tokens: list[int | None] = argmax(logits).tolist()
    for i, row in enumerate(rows):
        if not finite[i]:
            tokens[i] = None
        elif not row.params.greedy:
            tokens[i] = _draw(logits[i], row)
    return tokens


def _draw(logits: torch.Tensor, row: SamplingRow) -> int | None:
    p = row.params
    filtered = filter_top_k_top_p(logits / p.temperature, p.top_k, p.top_p)
    probs = filtered.softmax(-1).cpu()  # generators live on the CPU, whatever the device
    try:
        return int(torch.multinomial(probs, 1, generator=row.generator).item())
    except RuntimeError:  # "probability tensor contains either inf, nan or element < 0"
        return None
