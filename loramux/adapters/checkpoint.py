"""An adapter's tensors and PEFT config -> per-module (A, B) tensors in the model's module names.

A PEFT checkpoint stores `base_model.model.<module>.lora_A.weight` ([r, in]) and `.lora_B.weight`
([out, r]) (adapters/files.py reads them). `build_adapter` checks the tensors against the model's LoRA-able
modules and folds the scaling into B once, so the hot path never multiplies by it; `config_from_tensors`
makes the PEFT config of a lone weights file from its tensors' names and shapes.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from loramux.adapters.peft_config import AdapterSpec, InvalidAdapterError, saved_modules, unsupported_features

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_ABS_WEIGHT = 1e4
"""Largest |value| of A or of B with its scaling folded in. Trained LoRA weights are O(1); values near
this would overflow the activations into NaN logits (found with weights x1e18)."""

# `.lora_A.weight`, or `.lora_A.<adapter name>.weight` as some trainers save it; an embedding's
# `.lora_embedding_A` ([r, vocab]) and `.lora_embedding_B` ([hidden, r]) have no `.weight`.
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
_EMBEDDING_PAIR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_embedding_(?P<ab>[AB])(?:\.[^.]+)?$")
_ODD_KEY = re.compile(r"\.lora_[AB].*\.bias$")
_MAGNITUDE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_magnitude_vector(?:\.[^.]+)?(?:\.weight)?$")
# PEFT's save_embedding_layers writes the base embedding / head next to their LoRA, and modules_to_save
# writes a saved module's whole weight
_BASE_COPY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.base_layer\.weight$")
_WHOLE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.weight$")


@dataclass(frozen=True)
class ModuleLoRA:
    """One module's low-rank update: delta_W = b @ a, scaling already folded into b. An MoE block's experts
    (module <block>.experts.gate_up_proj / .down_proj) have one per expert and slice: a [E, slices, r, in],
    b [E, out, r], slice i of a serving the i-th equal part of the outputs (gate_up: gate, then up)."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: torch.Tensor | None = None  # DoRA: fp32 [out], magnitude / ||W + b a|| per output row (None: plain LoRA)

    @property
    def rank(self) -> int:
        return self.b.shape[-1]


class Structure(NamedTuple):
    """Which tensors an adapter has, in AdapterWeights.tensors()' order (adapters of one shape share it)."""

    modules: tuple[str, ...]
    scaled: tuple[bool, ...]  # each module's: whether it has a DoRA scale
    copies: tuple[str, ...]


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter in host memory, keyed by the model's module names (e.g. model.layers.0.self_attn.q_proj).
    copies: modules_to_save, the adapter's own whole weight of a module (embed_tokens, lm_head)."""

    name: str
    spec: AdapterSpec
    modules: dict[str, ModuleLoRA]
    path: str | None = None
    copies: dict[str, torch.Tensor] = field(default_factory=dict)
    digest: str = ""  # of the files it was read from (files.AdapterFiles); "" when built from tensors
    signature: object = None  # how those files looked when they were read (files.Signature; None: changing)

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        scales = sum(m.scale.nbytes for m in self.modules.values() if m.scale is not None)
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values()) + scales + self.copies_nbytes

    @property
    def has_dora(self) -> bool:
        return any(m.scale is not None for m in self.modules.values())

    @property
    def copies_nbytes(self) -> int:
        return sum(t.nbytes for t in self.copies.values())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor, in one order: each module's a, b and scale (if any), then the copies."""
        found = [t for m in self.modules.values() for t in (m.a, m.b, m.scale) if t is not None]
        return found + list(self.copies.values())

    def structure(self) -> Structure:
        """Where each of tensors() goes (with an empty copy of this adapter, what assemble() needs)."""
        return Structure(tuple(self.modules), tuple(m.scale is not None for m in self.modules.values()),
                         tuple(self.copies))

    def assemble(self, structure: Structure, tensors: Iterable[torch.Tensor]) -> AdapterWeights:
        """This adapter (its fields but the tensors) over `tensors`, placed as structure() and tensors() say."""
        found = iter(tensors)
        modules = {k: ModuleLoRA(next(found), next(found), next(found) if scaled else None)
                   for k, scaled in zip(structure.modules, structure.scaled)}
        return replace(self, modules=modules, copies={k: next(found) for k in structure.copies})

    def pinned(self) -> AdapterWeights:
        """The same, in page-locked host memory (needs CUDA): slot writes to a GPU become DMA copies that
        return at once (the caching host allocator keeps a page until the copies reading it are done)."""
        def pin(t: torch.Tensor) -> torch.Tensor:  # (add_adapter may hand over tensors already on the GPU)
            return t.cpu().contiguous().pin_memory()  # (a view pinned as it is would pin its whole stack)

        modules = {k: ModuleLoRA(pin(m.a), pin(m.b.t()).t(), m.scale) for k, m in self.modules.items()}  # B rank-major
        return replace(self, modules=modules, copies={k: pin(t) for k, t in self.copies.items()})


# ---- building ---------------------------------------------------------------------------------------
@dataclass
class _Sorted:
    """An adapter file's tensors by kind."""

    pairs: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # module -> {"A": t, "B": t}
    base_copies: dict[str, torch.Tensor] = field(default_factory=dict)  # module -> its base weight, as saved
    whole: dict[str, torch.Tensor] = field(default_factory=dict)  # module -> a whole weight (modules_to_save)
    magnitudes: dict[str, torch.Tensor] = field(default_factory=dict)  # module -> its DoRA magnitude vector
    odd: list[str] = field(default_factory=list)  # keys that are none of these (biases, ...)


def _sort_tensors(tensors: dict[str, torch.Tensor], saved: tuple[str, ...]) -> _Sorted:
    out = _Sorted()
    for key, tensor in tensors.items():  # (each pattern tried only where the ones before it failed)
        if _ODD_KEY.search(key):
            out.odd.append(key)
        elif magnitude := _MAGNITUDE.match(key):
            out.magnitudes[magnitude["module"]] = tensor
        elif pair := _KEY.match(key) or _EMBEDDING_PAIR.match(key):
            out.pairs.setdefault(pair["module"], {})[pair["ab"]] = tensor
        elif base := _BASE_COPY.match(key):
            out.base_copies[base["module"]] = tensor
        elif (whole := _WHOLE.match(key)) and whole["module"].rsplit(".", 1)[-1] in saved:
            out.whole[whole["module"]] = tensor
        else:
            out.odd.append(key)
    return out


def config_from_tensors(tensors: dict[str, torch.Tensor], lora_alpha: float | None, path: str) -> dict:
    """The PEFT config a lone weights file of LoRA pairs implies: r the most common rank of its A tensors
    (the others in rank_pattern, by module), target_modules the modules' last names, lora_alpha the caller's.
    Refused when the file holds anything but LoRA pairs (whole modules, DoRA magnitudes, biases: what they
    need is not in the tensors) or no lora_alpha is given (alpha / r scales every update)."""
    found = _sort_tensors(tensors, saved=())
    others = sorted([*found.odd, *found.base_copies, *found.whole, *found.magnitudes])
    if others:
        raise InvalidAdapterError(f"{path} holds {', '.join(others[:3])}{' ...' if len(others) > 3 else ''}: a "
                                  "lone weights file may hold only LoRA pairs (lora_A / lora_B); give the adapter's "
                                  "directory with its adapter_config.json")
    if not found.pairs:
        raise InvalidAdapterError(f"{path} holds no LoRA pairs (<module>.lora_A.weight and .lora_B.weight)")
    if lora_alpha is None:
        raise InvalidAdapterError(f"{path} does not say its lora_alpha: pass lora_alpha, or put its PEFT config "
                                  f"beside it as {os.path.basename(path).removesuffix('.safetensors')}.json")
    ranks = {module: ab["A"].shape[0] for module, ab in found.pairs.items() if "A" in ab and ab["A"].dim() == 2}
    r = Counter(ranks.values()).most_common(1)[0][0] if ranks else 1
    return {"peft_type": "LORA", "r": r, "lora_alpha": lora_alpha, "bias": "none", "lora_dropout": 0.0,
            "target_modules": sorted({module.rsplit(".", 1)[-1] for module in found.pairs}),
            "rank_pattern": {re.escape(module): rank for module, rank in ranks.items() if rank != r}}


def _dtype_problems(tensors: dict[str, torch.Tensor]) -> list[str]:
    allowed = ", ".join(str(d).removeprefix("torch.") for d in WEIGHT_DTYPES)
    return [f"tensor {key!r} is {str(t.dtype).removeprefix('torch.')} (LoRA weights must be {allowed})"
            for key, t in tensors.items() if t.dtype not in WEIGHT_DTYPES]


def build_adapter(
    name: str,
    config: dict,
    tensors: dict[str, torch.Tensor],
    module_shapes: dict[str, tuple[int, int]],
    max_rank: int,
    dtype: torch.dtype = torch.float32,
    path: str | None = None,
    all_linear: tuple[str, ...] | None = None,
    base_weight: Callable[[str], torch.Tensor | None] | None = None,
    dora_scale: Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    whole_copies: bool = True,
    experts: dict[str, tuple[int, int, int]] | None = None,
    unwrapped_experts: frozenset[str] = frozenset(),
) -> AdapterWeights:
    """Check an adapter against the model and fold scaling into B.

    module_shapes: LoRA-able (wrapped) module name -> (in_features, out_features), as the model names them
    (an embedding's "in" is its vocabulary: its LoRA is a LoRA on one-hot rows).
    all_linear: the module-name suffixes PEFT's "all-linear" stands for in this model: every Linear but the
    output head, wrapped or not (default: the wrapped ones), so that an "all-linear" adapter with weights for
    a module that is not wrapped is refused as the same adapter written as a list is.
    base_weight: the model's own weight of a module an adapter may carry whole (modules_to_save) or as a
    base copy (PEFT's save_embedding_layers), None where the model does not wrap that module.
    dora_scale(module, a, b, magnitude): a DoRA module's scale against the model's base weight (AdapterSlots'),
    None where DoRA cannot be computed (adapters with DoRA are then refused).
    whole_copies: whether modules_to_save copies are served at all (LoRAConfig.max_module_copies_bytes > 0).
    experts: the MoE blocks whose experts have LoRA layers: block (e.g. model.layers.0.mlp.experts) ->
    (experts, hidden, one expert's intermediate size); unwrapped_experts: the model's MoE blocks without.
    Raises InvalidAdapterError listing every problem found, not only the first.
    """
    problems = unsupported_features(config) + _dtype_problems(tensors)
    parts = _sort_tensors(tensors, saved_modules(config))
    problems += [f"non-LoRA tensor {key!r} (a bias or other weights)" for key in parts.odd]
    if problems:
        raise InvalidAdapterError(f"adapter {name!r} uses unsupported PEFT features: " + "; ".join(problems))
    spec = AdapterSpec.from_dict(config)
    linear = all_linear if all_linear is not None else tuple({m.rsplit(".", 1)[-1] for m in module_shapes})
    expert_pairs = _take_expert_pairs(parts.pairs, experts or {}, spec, linear)
    unserved = sorted(_take_expert_pairs(parts.pairs, dict.fromkeys(unwrapped_experts), spec, linear))
    targeted = {m: ab for m, ab in sorted(parts.pairs.items()) if spec.targets(m, linear)}
    stray = sorted(set(parts.pairs) - set(targeted))
    if not targeted and not parts.whole and not expert_pairs and not stray and not unserved:
        raise InvalidAdapterError(f"adapter {name!r} has no LoRA weights for the modules its config targets")
    errors = [_unserved_experts_problem(name, unserved), _stray_problem(name, stray, parts.pairs)]
    pairs = {m: _collect(errors, _module_pair, name, m, ab, spec, module_shapes, max_rank) for m, ab in targeted.items()}
    modules = _fold_scaling(name, {m: pair for m, pair in pairs.items() if pair is not None}, dtype, errors)
    modules = _with_dora(name, spec, parts.magnitudes, modules, dora_scale, module_shapes, errors)
    for block, found in sorted(expert_pairs.items()):
        modules.update(_collect(errors, _expert_loras, name, block, found, spec, experts[block], max_rank, dtype) or {})
    errors += [_base_copy_problem(name, m, t, base_weight) for m, t in sorted(parts.base_copies.items())]
    copies = {m: _collect(errors, _whole_copy, name, m, w, base_weight, dtype, whole_copies)
              for m, w in sorted(parts.whole.items())}
    errors.append(_alora_problem(name, spec, modules, parts.whole))
    errors = [e for e in errors if e]
    if errors:
        more = f" (and {len(errors) - 3} more modules)" if len(errors) > 3 else ""
        raise InvalidAdapterError("; ".join(errors[:3]) + more)
    return AdapterWeights(name=name, spec=spec, modules=modules, path=path, copies=copies)


# ---- DoRA ---------------------------------------------------------------------------------------------
# PEFT's DoRA (use_dora) keeps a magnitude vector m [out] per module (`<module>.lora_magnitude_vector`) and runs
# result = bias + (m / ||W + s B A||) * (W x + s B A x), the norm taken per output row and held constant. The
# scale depends on weights alone, so it is computed once, at load (dora_scale), and applied per row by slot.
_WHOLE_TABLE_MODULES = ("embed_tokens", "lm_head")  # rows of a vocabulary, not of a linear layer's outputs


def _on_linear_rows(module: str, lora: ModuleLoRA) -> bool:
    """Whether a module's LoRA acts on a linear layer's output rows (not the embedding, the head or MoE experts):
    where DoRA's scales and aLoRA's activation apply."""
    return module.rsplit(".", 1)[-1] not in _WHOLE_TABLE_MODULES and lora.a.dim() == 2


def _with_dora(name, spec, magnitudes, modules, dora_scale, module_shapes, errors) -> dict[str, ModuleLoRA]:
    """`modules` with each DoRA module's scale; problems (a missing, misshapen or non-finite magnitude, DoRA
    where it is not run, magnitudes without use_dora) added to `errors`."""
    if not spec.use_dora:
        if magnitudes:
            errors.append(f"adapter {name!r} has DoRA magnitude vectors ({next(iter(magnitudes))}, ...) but "
                          "adapter_config.json does not set use_dora")
        return modules
    if dora_scale is None:
        errors.append(f"adapter {name!r} uses DoRA (use_dora=true), which this engine cannot compute")
        return modules
    stray = sorted(set(magnitudes) - set(modules))
    if stray:
        errors.append(f"adapter {name!r} has DoRA magnitudes for modules without LoRA weights: {', '.join(stray[:3])}")
    out = dict(modules)
    for module, lora in modules.items():
        out[module] = _collect(errors, _dora_module, name, module, lora, magnitudes.get(module), dora_scale,
                               module_shapes) or lora
    return out


def _dora_module(name, module, lora, magnitude, dora_scale, module_shapes) -> ModuleLoRA:
    if not _on_linear_rows(module, lora):
        raise InvalidAdapterError(f"adapter {name!r}: DoRA on {module} is not supported (DoRA runs on linear "
                                  "layers, not on the embedding, the output head or MoE experts)")
    out = module_shapes[module][1]
    if magnitude is None or tuple(magnitude.shape) != (out,):
        found = "none" if magnitude is None else f"shape {tuple(magnitude.shape)}"
        raise InvalidAdapterError(f"adapter {name!r}: DoRA module {module} needs a lora_magnitude_vector of "
                                  f"shape ({out},); the file has {found}")
    _check_values(name, "{} lora_magnitude_vector", magnitude, module)
    scale = dora_scale(module, lora.a, lora.b, magnitude)
    _check_values(name, "{}'s DoRA scale (magnitude / the norm of W + s B A; a zero norm?)", scale, module)
    return replace(lora, scale=scale)


def _alora_problem(name: str, spec: AdapterSpec, modules: dict[str, ModuleLoRA], whole: dict) -> str:
    """aLoRA acts on a prompt's tokens from its invocation on: on the linear layers' rows. What would act on
    every token (a saved module, the embedding's rows, the head's whole-vocabulary rows) or scale rows (DoRA) is
    not run with it."""
    if not spec.alora_invocation_tokens:
        return ""
    other = [m for m, lora in modules.items() if not _on_linear_rows(m, lora)]
    why = ("it uses DoRA too" if spec.use_dora else f"it has LoRA on {other[0]}" if other
           else f"it saves {next(iter(whole))}" if whole else "")
    return f"adapter {name!r} is an aLoRA adapter (alora_invocation_tokens) and {why}: not supported" if why else ""


def _collect(errors: list[str], make: Callable, *args):
    """make(*args), or None with its InvalidAdapterError's message added to `errors`: every problem of an
    adapter is reported at once, not only the first."""
    try:
        return make(*args)
    except InvalidAdapterError as e:
        errors.append(str(e))
        return None


def _unserved_experts_problem(name: str, blocks: list[str]) -> str:
    if not blocks:
        return ""
    more = f" and {len(blocks) - 1} more blocks" if len(blocks) > 1 else ""
    return (f"adapter {name!r} has LoRA on the MoE experts of {blocks[0]}{more}, which this engine does not wrap: "
            "add 'experts' to LoRAConfig.target_modules (--lora-target-modules)")


def _stray_problem(name: str, stray: list[str], pairs: dict) -> str:
    """PEFT never writes these: a hand-made or damaged file, whose weights would be dropped unseen."""
    if not stray:
        return ""
    named = [f"{m} (lora_{'embedding_' if m.endswith('embed_tokens') else ''}{sorted(pairs[m])[0]})" for m in stray[:3]]
    return (f"adapter {name!r} has weights for modules its adapter_config.json does not target: "
            f"{', '.join(named)}{' ...' if len(stray) > 3 else ''}")


# ---- MoE experts -------------------------------------------------------------------------------------
# PEFT's target_parameters (ParamWrapper) on a block's 3D weights: `<block>.lora_A.weight` [r * E, in],
# `.lora_B.weight` [out, r * E]; several parameters of one block nest, the first listed innermost (its keys
# carry one `.base_layer` per parameter listed after it). Older checkpoints: one Linear per expert,
# `<layer>.mlp.experts.<e>.gate_proj` (Qwen) or `<layer>.block_sparse_moe.experts.<e>.w1` (Mixtral: w1 gate,
# w3 up, w2 down).
_NESTED = re.compile(r"^(?P<module>.+?)(?P<depth>(?:\.base_layer)*)$")
_PER_EXPERT = re.compile(r"^(?P<layer>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)$")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _take_expert_pairs(pairs: dict, experts: dict, spec: AdapterSpec, linear: tuple[str, ...]) -> dict[str, dict]:
    """Moves the pairs of `experts` blocks that the config targets out of `pairs` (the rest stay, and are
    refused as weights it does not target): {block: {("3d", depth) or (expert, proj): ({"A", "B"}, key)}}."""
    found: dict[str, dict] = {}
    for module in list(pairs) if experts else ():  # (a model without MoE blocks: nothing to look for)
        nested, per = _NESTED.match(module), _PER_EXPERT.match(module)
        if nested["module"] in experts and spec.parameters_of(nested["module"]):
            found.setdefault(nested["module"], {})["3d", nested["depth"].count(".base_layer")] = (pairs.pop(module), module)
        elif per and f"{per['layer']}.mlp.experts" in experts and spec.targets(module, linear):
            proj = _PROJ.get(per["proj"], per["proj"])
            found.setdefault(f"{per['layer']}.mlp.experts", {})[(int(per["expert"]), proj)] = (pairs.pop(module), module)
    return found


def _expert_loras(name, block, found, spec, shape, max_rank, dtype) -> dict[str, ModuleLoRA]:
    """The block's gate_up_proj and down_proj ModuleLoRAs (a [E, slices, r, in], b [E, out, r])."""
    if any(key[0] == "3d" for key in found):
        return _expert_loras_3d(name, block, found, spec, shape, max_rank, dtype)
    return _expert_loras_per_expert(name, block, found, spec, shape, max_rank, dtype)


def _expert_loras_3d(name, block, found, spec, shape, max_rank, dtype) -> dict[str, ModuleLoRA]:
    num, hidden, inter = shape
    params = spec.parameters_of(block)
    sizes = {"gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden)}  # (in, out): never equal
    out = {}
    for ab, key in found.values():
        # which parameter a nesting depth holds follows PEFT's wrapping order, which is not the config's (it
        # changed from run to run here); the shapes tell them apart
        a, b = ab.get("A"), ab.get("B")
        param = next((p for p in params if a is not None and b is not None and a.dim() == b.dim() == 2
                      and (a.shape[1], b.shape[0]) == sizes[p]), None)
        if param is None or a.shape[0] % num or b.shape[1] != a.shape[0]:
            wanted = "; ".join(f"{p}: lora_A [r * {num}, {sizes[p][0]}] and lora_B [{sizes[p][1]}, r * {num}]" for p in params)
            raise InvalidAdapterError(f"adapter {name!r}: {key} fits none of its target_parameters ({wanted or 'none'}); "
                                      f"the file has {_shapes(ab)}")
        n_in, n_out = sizes[param]
        r = a.shape[0] // num
        _check_rank(name, f"{block}.{param}", r, spec.rank(f"{block}.{param}"), max_rank)
        a_e = a.reshape(num, r, n_in)
        b_e = b.reshape(n_out, r, num).permute(2, 0, 1) * spec.scaling(f"{block}.{param}")  # PEFT: expert e's columns j * E + e
        slices = 2 if param == "gate_up_proj" else 1  # one A for both halves: both slices get it
        out[f"{block}.{param}"] = _checked_expert(name, f"{block}.{param}", a_e.unsqueeze(1).expand(-1, slices, -1, -1), b_e, dtype)
    return out


def _expert_loras_per_expert(name, block, found, spec, shape, max_rank, dtype) -> dict[str, ModuleLoRA]:
    num, hidden, inter = shape
    sizes = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    ranks = [ab["B"].shape[1] for ab, _ in found.values() if "B" in ab and ab["B"].dim() == 2]
    r = max(ranks, default=0)
    a_gu, b_gu = torch.zeros(num, 2, r, hidden), torch.zeros(num, 2 * inter, r)
    a_d, b_d = torch.zeros(num, 1, r, inter), torch.zeros(num, hidden, r)
    for (expert, proj), (ab, key) in found.items():
        n_in, n_out = sizes[proj]
        a, b = ab.get("A"), ab.get("B")
        if expert >= num or a is None or b is None or a.shape[1:] != (n_in,) or b.shape[0] != n_out or b.shape[1] != a.shape[0]:
            raise InvalidAdapterError(f"adapter {name!r}: {key} needs expert < {num}, lora_A [r, {n_in}] and lora_B "
                                      f"[{n_out}, r]; the file has {_shapes(ab)}")
        k = a.shape[0]
        _check_rank(name, key, k, spec.rank(key), max_rank)
        b = b.float() * spec.scaling(key)
        if proj == "down_proj":
            a_d[expert, 0, :k], b_d[expert, :, :k] = a, b
        else:
            part = 0 if proj == "gate_proj" else 1
            a_gu[expert, part, :k], b_gu[expert, part * inter:(part + 1) * inter, :k] = a, b
    return {f"{block}.gate_up_proj": _checked_expert(name, f"{block}.gate_up_proj", a_gu, b_gu, dtype),
            f"{block}.down_proj": _checked_expert(name, f"{block}.down_proj", a_d, b_d, dtype)}


def _checked_expert(name, module, a, b, dtype) -> ModuleLoRA:
    _check_values(name, f"{module} lora_A", a)
    _check_values(name, f"{module} lora_B (scaling folded in)", b)
    return ModuleLoRA(a=a.to(dtype).contiguous(), b=b.to(dtype).contiguous())


def _check_rank(name: str, module: str, r: int, configured: int, max_rank: int) -> None:
    if r > max_rank:
        raise InvalidAdapterError(f"adapter {name!r} has rank {r} (module {module!r}), above max_lora_rank={max_rank}")
    if r != configured:
        raise InvalidAdapterError(f"adapter {name!r}: module {module!r} has rank {r} in its weights but {configured} "
                                  "in adapter_config.json")


def _shapes(ab: dict) -> str:
    return ", ".join(f"lora_{k} {tuple(t.shape)}" for k, t in sorted(ab.items())) or "nothing"


def _vocabulary_problem(name: str, module: str, rows: int, model_rows: int) -> str:
    what = "adds tokens" if rows > model_rows else "was made for a smaller vocabulary"
    return (f"adapter {name!r} {what}: its {module} has {rows} rows, the model's vocabulary {model_rows}; "
            "adapters for another vocabulary are not supported")


def _base_copy_problem(name: str, module: str, weight: torch.Tensor, base_weight) -> str:
    """A base-layer copy (save_embedding_layers) must be the model's own weight: '' if it is."""
    base = base_weight(module) if base_weight else None
    if base is None:
        return f"adapter {name!r} holds base weights for {module!r}, which this model does not serve with LoRA"
    if weight.shape != base.shape:
        return _vocabulary_problem(name, module, weight.shape[0], base.shape[0])
    if not torch.equal(weight.to(base.device, base.dtype), base):
        return (f"adapter {name!r} holds weights for {module!r} that differ from this model's (a fine-tuned "
                "embedding): list it in modules_to_save for a per-adapter copy")
    return ""


def _whole_copy(name: str, module: str, weight: torch.Tensor, base_weight, dtype: torch.dtype,
                served: bool = True) -> torch.Tensor:
    """A modules_to_save weight: this adapter's own copy of the whole module (served: whether the engine serves
    such copies at all)."""
    if not served:
        raise InvalidAdapterError(f"adapter {name!r} saves a whole {module!r} (modules_to_save): set "
                                  "LoRAConfig.max_module_copies_bytes (--max-module-copies-bytes) to serve "
                                  "per-adapter copies")
    base = base_weight(module) if base_weight else None
    if base is None:
        raise InvalidAdapterError(f"adapter {name!r} saves a whole {module!r} (modules_to_save), which this model "
                                  "does not wrap: add it to LoRAConfig.target_modules")
    if weight.shape != base.shape:
        raise InvalidAdapterError(_vocabulary_problem(name, module, weight.shape[0], base.shape[0]))
    _check_values(name, f"{module}.weight (modules_to_save)", weight)
    return weight.to(dtype).contiguous()


def _module_pair(name, module, ab, spec, module_shapes, max_rank) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One module's (A, B, scaling), checked against the model (shapes, rank, config); values are checked by
    _fold_scaling."""
    if module.endswith((".mlp.gate", ".block_sparse_moe.gate")):
        raise InvalidAdapterError(f"adapter {name!r} has LoRA on an MoE router ({module}); router LoRA is not supported")
    if module not in module_shapes:
        wrapped = sorted({m.rsplit(".", 1)[-1] for m in module_shapes})
        raise InvalidAdapterError(
            f"adapter {name!r} has weights for module {module!r}, which this model does not have "
            f"or does not wrap with LoRA (wrapped: {', '.join(wrapped)}; LoRAConfig.target_modules sets them)"
        )
    if set(ab) != {"A", "B"}:
        raise InvalidAdapterError(f"adapter {name!r}: module {module!r} has lora_{next(iter(ab))} but not its pair")
    a, b = ab["A"], ab["B"]
    in_features, out_features = module_shapes[module]
    if module.endswith("embed_tokens") and a.dim() == 2 and a.shape[1] != in_features:
        raise InvalidAdapterError(_vocabulary_problem(name, module, a.shape[1], in_features))
    if module.endswith("lm_head") and b.dim() == 2 and b.shape[0] != out_features:
        raise InvalidAdapterError(_vocabulary_problem(name, module, b.shape[0], out_features))
    r = a.shape[0] if a.dim() == 2 else -1
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, r):
        raise InvalidAdapterError(
            f"adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
            f"the model needs lora_A [r, {in_features}] and lora_B [{out_features}, r]"
        )
    if r > max_rank:
        raise InvalidAdapterError(
            f"adapter {name!r} has rank {r} (module {module!r}), above max_lora_rank={max_rank}"
        )
    if r != spec.rank(module):
        raise InvalidAdapterError(
            f"adapter {name!r}: module {module!r} has rank {r} in its weights but {spec.rank(module)} in adapter_config.json"
        )
    return a, b, spec.scaling(module)


def _fold_scaling(name: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]], dtype: torch.dtype,
                  errors: list[str]) -> dict[str, ModuleLoRA]:
    """Each module's scaling folded into its B (in fp32, then cast to dtype) and every value checked, in a few
    ops for the whole adapter: the A's of one width, and the B's of one rank, are stacked, scaled, checked and
    cast together, then split into views. (An op a tensor, ~10 a module, made a read of a 210-module adapter
    cost ~10 ms of CPU.) A module with a bad value adds its problem to `errors` and is left out."""
    a_stacks = _stacks({m: a for m, (a, _, _) in pairs.items()}, None)
    b_stacks = _stacks({m: b for m, (_, b, _) in pairs.items()}, {m: s for m, (_, _, s) in pairs.items()})
    ok = all(_within_bounds(stack.buffer) for stack in (*a_stacks, *b_stacks))
    a = {m: v for stack in a_stacks for m, v in stack.split(dtype if ok else torch.float32).items()}
    b = {m: v for stack in b_stacks for m, v in stack.split_rank_major(dtype if ok else torch.float32).items()}
    if ok:
        return {m: ModuleLoRA(a=a[m], b=b[m]) for m in pairs}
    return _fold_checked(name, pairs, a, b, dtype, errors)


class _Stack(NamedTuple):
    modules: list[str]  # whose tensors it holds, one under the other
    buffer: torch.Tensor  # fp32 [rows, width]
    rows: list[int]  # each one's rows

    def split(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return dict(zip(self.modules, self.buffer.to(dtype).split(self.rows)))

    def split_rank_major(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """As split, each [out, r] a transposed view of [r, out] rows: a device slot holds B rank-major
        (LoRALinear.lora_b), and a copy between the same layouts is a few row copies, not a transposing one
        on the step thread. (The cast and the transpose are one op here.)"""
        major = torch.empty(self.buffer.shape[::-1], dtype=dtype).copy_(self.buffer.t())
        return {m: v.t() for m, v in zip(self.modules, major.split(self.rows, dim=1))}


STACK_ELEMENTS = 32768
"""torch's grain size for elementwise ops (at::internal::GRAIN_SIZE): an op on no more elements runs on the
calling thread alone. The loader thread's ops stay within it, so a read never starts an OpenMP team of its
own beside the step's (its threads would spin on the cores the step computes on)."""


def _stacks(tensors: dict[str, torch.Tensor], scalings: dict[str, float] | None) -> list[_Stack]:
    """The tensors ([rows, width] each) stacked into fp32 buffers of one width and at most STACK_ELEMENTS
    elements (or one tensor), each one's rows times its module's scaling when given."""
    runs: list[list[str]] = []
    filling: dict[int, tuple[list[str], int]] = {}  # width -> the run being filled, its elements
    for module, t in tensors.items():
        run, size = filling.get(t.shape[1], (None, 0))
        if run is None or size + t.numel() > STACK_ELEMENTS:
            run, size = [], 0
            runs.append(run)
        run.append(module)
        filling[t.shape[1]] = (run, size + t.numel())
    stacks = []
    for modules in runs:
        buffer = torch.cat([tensors[m] for m in modules]).to(torch.float32)  # (a new buffer: scaled in place)
        rows = [tensors[m].shape[0] for m in modules]
        if scalings is not None:
            factors = [scalings[m] for m in modules]
            if len(set(factors)) == 1:
                buffer.mul_(factors[0])
            else:
                buffer.mul_(torch.tensor(factors).repeat_interleave(torch.tensor(rows)).unsqueeze(1))
        stacks.append(_Stack(modules, buffer, rows))
    return stacks


def _within_bounds(t: torch.Tensor) -> bool:
    return _peak(t) <= MAX_ABS_WEIGHT


def _peak(t: torch.Tensor) -> float:
    """The largest |value| of t in one pass: NaN when t holds a NaN, inf when it holds an inf."""
    if not t.numel():
        return 0.0
    low, high = torch.aminmax(t)  # a NaN comes out as both
    return max(-float(low), float(high))


def _fold_checked(name, pairs, a, b, dtype, errors) -> dict[str, ModuleLoRA]:
    """_fold_scaling's way for an adapter with a value out of bounds, module by module: which ones (a and b:
    fp32 views, scaling folded into b)."""
    modules = {}
    for module, (_, _, scaling) in pairs.items():
        try:
            _check_values(name, "{}.lora_A.weight", a[module], module)
            _check_values(name, "{} (scaling {:g} folded in)", b[module], f"{module}.lora_B.weight", scaling)
        except InvalidAdapterError as e:
            errors.append(str(e))
            continue
        modules[module] = ModuleLoRA(a=a[module].to(dtype), b=b[module].to(dtype))
    return modules


def _check_values(name: str, what: str, t: torch.Tensor, *what_args) -> None:
    """what.format(*what_args) names t (formatted only for the error: an adapter has hundreds of tensors)."""
    peak = _peak(t)
    if peak <= MAX_ABS_WEIGHT:
        return
    what = what.format(*what_args) if what_args else what  # (module names come from the file: never a format)
    kind = "NaN" if peak != peak else "Inf" if peak == float("inf") else f"|values| up to {peak:.3g}"
    raise InvalidAdapterError(f"adapter {name!r}: {what} has {kind}; LoRA weights must be finite and at most "
                              f"{MAX_ABS_WEIGHT:g} in size")
