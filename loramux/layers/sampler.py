"""Sampler: per-request penalties, temperature, top-k, top-p and seeds over one batch of logits.

A seeded request draws from its own torch.Generator, advanced once per token it samples, so its
tokens do not depend on which requests share its batch.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from loramux.logprobs import Logprobs
from loramux.ops import pointwise_torch
from loramux.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    output_token_ids: list[int]
    generator: torch.Generator | None  # None: greedy, or the engine's shared generator
    allowed: torch.Tensor | None = None  # structured outputs: [vocab] bool, the tokens its grammar allows now
    blocked: list[int] = field(default_factory=list)  # tokens it may not take now (min_tokens, bad_words)
    prompt_token_ids: list[int] = field(default_factory=list)  # for repetition_penalty


def allowed_tokens(bitmask: bytes, vocab_size: int) -> torch.Tensor:
    """A grammar engine's bitmask (bit j of byte i = token 8i + j may come next) -> [vocab_size] bool."""
    packed = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8)
    bits = (packed[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.flatten()[:vocab_size].bool()


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In vLLM's order: HF's repetition penalty over prompt and generated tokens (a positive logit divided by
    it, a negative one multiplied), then OpenAI's over generated tokens: logit -= frequency * count +
    presence * (count > 0)."""
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long,
                               device=logits.device)
            seen = logits[i, ids]
            logits[i, ids] = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            ids = torch.tensor(row.output_token_ids, device=logits.device)
            counts = torch.bincount(ids, minlength=logits.shape[1]).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            ids = torch.tensor(list(row.params.logit_bias), dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor(list(row.params.logit_bias.values()), dtype=logits.dtype, device=logits.device)


def apply_masks(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Blocked tokens and those a grammar does not allow set to -inf (in place). Where the blocked tokens (bad
    words) are all that the grammar allows, the grammar wins: the output must stay valid."""
    for i, row in enumerate(rows):
        blocked = torch.tensor(row.blocked, dtype=torch.long, device=logits.device) if row.blocked else None
        if row.allowed is None:
            if blocked is not None:
                logits[i, blocked] = float("-inf")
            continue
        allowed = row.allowed.to(logits.device)
        if blocked is not None:
            kept = allowed.clone()
            kept[blocked] = False
            allowed = kept if kept.any() else allowed
        logits[i].masked_fill_(~allowed, float("-inf"))


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [vocab] (already divided by temperature) -> logits with filtered tokens at -inf."""
    if 0 < top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        drop[0] = False  # and always the most likely one: with a tiny top_p, rounding could drop them all
        logits = logits.masked_fill(torch.empty_like(drop).scatter_(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           argmax: Callable[[torch.Tensor], torch.Tensor] = pointwise_torch.argmax,
           on_host: bool | None = None) -> list[int | None]:
    """logits: [batch, vocab] float32 -> one token id per row (sample_and_score, no row scored)."""
    return sample_and_score(logits, rows, {}, argmax, on_host)[0]


def sample_and_score(logits: torch.Tensor, rows: list[SamplingRow], scored: dict[int, int],
                     argmax: Callable[[torch.Tensor], torch.Tensor] = pointwise_torch.argmax,
                     on_host: bool | None = None) -> tuple[list[int | None], dict[int, Logprobs]]:
    """logits: [batch, vocab] float32 -> (one token id per row; {row: its token's logprob, rank and k most
    likely tokens} for the rows of `scored` ({row: k}), from the raw logits, before any of the following).
    `argmax`: a pointwise backend's (greedy rows). Order, as vLLM's: logit bias, penalties, blocked tokens and
    the grammar's mask, then (sampled rows) temperature, min_p, top-k, top-p. The logits are changed in place.

    None for a row whose logits are not all finite (NaN or Inf, from its adapter or its inputs): no token
    can be trusted there, and that request fails alone; the other rows are sampled as usual. On a GPU the
    tokens, these flags and the scored rows' logprobs are read back together, once: the step's one wait for
    the device.

    on_host: draw sampled rows on the host, from CPU generators with torch.multinomial (None: where the logits
    are on a CPU); else on the logits' device, from generators there (_race)."""
    raw = torch.log_softmax(logits[list(scored)], -1) if scored else None  # [len(scored), vocab], raw logits'
    finite = torch.isfinite(logits.sum(-1))  # one pass over [batch, vocab]; inf - inf gives NaN
    apply_logit_bias(logits, rows)  # finite values (SamplingParams) keep finite logits finite
    apply_penalties(logits, rows)
    apply_masks(logits, rows)  # after the check: a mask's -inf is not a broken row
    tokens = argmax(logits)
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    if not (on_host if on_host is not None else logits.device.type == "cpu"):
        for i in drawn:
            tokens[i], drawable = _race(logits[i], rows[i])
            finite[i] &= drawable
        return _read_once(tokens, finite, raw, scored)
    ok, ids = finite.tolist(), tokens.tolist()
    drawn = [i for i in drawn if ok[i]]
    if drawn:
        probs = logits.new_empty(len(drawn), logits.shape[1])
        for j, i in enumerate(drawn):
            torch.softmax(_filtered(logits[i], rows[i].params), -1, out=probs[j])
        for j, i in enumerate(drawn):
            ids[i] = _draw(probs[j], rows[i].generator)
    ids = [t if f else None for t, f in zip(ids, ok)]
    return ids, {i: token_logprobs(raw[j:j + 1], [ids[i]], k) for j, (i, k) in enumerate(scored.items())
                 if ids[i] is not None}


def _read_once(tokens: torch.Tensor, finite: torch.Tensor, raw: torch.Tensor | None,
               scored: dict[int, int]) -> tuple[list[int | None], dict[int, Logprobs]]:
    """The device's tokens, finite flags and scored rows' logprobs, packed into one float64 tensor (token ids and
    ranks are exact there, fp32 logprobs too) and read back in one copy."""
    batch, n, k = tokens.shape[0], len(scored), max(scored.values(), default=0)
    parts = [tokens.double(), finite.double()]
    if n:
        rows = torch.tensor(list(scored), device=tokens.device)
        chosen = raw.gather(1, tokens[rows][:, None])  # [n, 1]
        parts += [chosen.flatten().double(), ((raw > chosen).sum(-1) + 1).double()]
        if k:
            top = raw.topk(k, -1)
            parts += [top.indices.flatten().double(), top.values.flatten().double()]
    values = torch.cat(parts).tolist()
    ids = [int(t) if f else None for t, f in zip(values[:batch], values[batch:2 * batch])]
    chosen, ranks = values[2 * batch:2 * batch + n], values[2 * batch + n:2 * batch + 2 * n]
    top_ids, top_values = values[2 * batch + 2 * n:2 * batch + 2 * n + n * k], values[2 * batch + 2 * n + n * k:]
    out = {}
    for j, (i, want) in enumerate(scored.items()):
        if ids[i] is not None:
            out[i] = Logprobs([ids[i]], [chosen[j]], [int(ranks[j])], [[int(t) for t in top_ids[j * k:j * k + want]]],
                              [top_values[j * k:j * k + want]])
    return ids, out


def _race(logits: torch.Tensor, row: SamplingRow) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's draw on its device, read nothing back: argmax(p / q) with q ~ Exp(1) per token picks token i
    with probability p_i (an exponential race; vLLM's GPU sampler draws so). -> (token, whether p was a
    distribution at all: a row whose filters left nothing finite gets None, as torch.multinomial refuses it)."""
    probs = torch.softmax(_filtered(logits, row.params), -1)
    drawable = torch.isfinite(probs.sum())
    q = torch.empty_like(probs).exponential_(generator=row.generator)
    return probs.div_(q).argmax(), drawable


def _filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's logits after temperature, min_p, top-k and top-p (dropped tokens at -inf)."""
    scaled = logits / p.temperature
    if p.min_p > 0:  # keep tokens with probability >= min_p x the top one's: logit >= top + log(min_p)
        scaled = scaled.masked_fill(scaled < scaled.max() + math.log(p.min_p), float("-inf"))
    return filter_top_k_top_p(scaled, p.top_k, p.top_p)


def _draw(probs: torch.Tensor, generator) -> int | None:
    try:
        return int(torch.multinomial(probs, 1, generator=generator).item())
    except RuntimeError:  # "probability tensor contains either inf, nan or element < 0"
        return None


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], k: int) -> Logprobs:
    """logprobs: [n, vocab] log-softmaxed float32; token_ids: the n tokens to score -> their logprobs, ranks
    (1 + how many tokens are strictly more likely) and the k most likely tokens of each row."""
    ids = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])
    ranks = (logprobs > chosen).sum(-1) + 1
    if k:
        top = logprobs.topk(k, -1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    else:
        top_ids = top_values = [[] for _ in token_ids]
    return Logprobs(list(token_ids), chosen.squeeze(1).tolist(), ranks.tolist(), top_ids, top_values)
