"""Weighted combinations of loaded adapters, served as one derived adapter: PEFT's
`add_weighted_adapter(adapters, weights, name, combination_type="cat")`, without merging anything into the base.

The combination stacks its parts: per module A = [A_1; A_2; ...] and B = [w_1 s_1 B_1, w_2 s_2 B_2, ...] (each
part's weight w_i and scaling s_i; a part without the module adds nothing there), so its update is
sum_i w_i s_i B_i A_i, times PEFT's scaling of the new adapter: 1, or sqrt(r_new) when the first part uses rsLoRA
(PEFT gives the new adapter the first part's config with lora_alpha = r = r_new, the sum of the parts' ranks).
Its rank in a module is the sum of its parts' ranks there, held to the slots' max_lora_rank.

A combination's name (names.combination_name) lists its parts in the caller's order, `style*0.5&legal*1.0`; the
same parts and weights are always the same derived adapter (its own identity for slots, LRU and the prefix
cache).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from loramux.adapters.checkpoint import MAX_ABS_WEIGHT, AdapterWeights, ModuleLoRA, _peak
from loramux.adapters.names import InvalidCombinationError


def combine(name: str, parts: list[tuple[str, AdapterWeights, float]], max_rank: int) -> AdapterWeights:
    """The derived adapter of `parts` ((name, host weights, weight) in order) as PEFT's cat combination."""
    for part, weights, _ in parts:
        why = ("it uses DoRA" if weights.has_dora else "it replaces whole modules (modules_to_save)" if weights.copies
               else "it has LoRA on MoE experts" if any(m.a.dim() != 2 for m in weights.modules.values()) else "")
        if why:
            raise InvalidCombinationError(f"adapter {part!r} cannot be part of a combination: {why}")
    first = parts[0][1].spec
    new_rank = sum(max([w.spec.r, *w.spec.rank_pattern.values()]) for _, w, _ in parts)
    scaling = math.sqrt(new_rank) if first.use_rslora else 1.0
    modules = {}
    for module in dict.fromkeys(m for _, w, _ in parts for m in w.modules):
        pieces = [(w.modules[module], weight) for _, w, weight in parts if module in w.modules]
        rank = sum(p.rank for p, _ in pieces)
        if rank > max_rank:
            raise InvalidCombinationError(f"combination {name!r} has rank {rank} in {module} (the sum of its parts'), "
                                          f"above max_lora_rank={max_rank}")
        a = torch.cat([p.a.float() for p, _ in pieces])
        b = torch.cat([p.b.float() * (weight * scaling) for p, weight in pieces], dim=1)  # [out, rank]
        peak = _peak(b)
        if not peak <= MAX_ABS_WEIGHT:
            raise InvalidCombinationError(f"combination {name!r}: its weights make {module}'s lora_B values up to "
                                          f"{peak:.3g}, above {MAX_ABS_WEIGHT:g}")
        dtype = pieces[0][0].b.dtype
        rank_major = torch.empty(b.shape[::-1], dtype=dtype).copy_(b.t())  # as slots hold B (checkpoint.py)
        modules[module] = ModuleLoRA(a=a.to(dtype), b=rank_major.t())
    spec = replace(first, r=new_rank, lora_alpha=new_rank, rank_pattern={}, alpha_pattern={}, use_dora=False)
    return AdapterWeights(name=name, spec=spec, modules=modules)
