"""PEFT adapter directories -> per-module (A, B) tensors in the model's module names.

A PEFT checkpoint stores `base_model.model.<module>.lora_A.weight` ([r, in]) and `.lora_B.weight`
([out, r]). `build_adapter` checks them against the model's LoRA-able modules and folds the scaling
into B once, so the hot path never multiplies by it.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch

from loramux.adapters.peft_config import AdapterSpec, InvalidAdapterError, unsupported_features

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

# `.lora_A.weight`, or `.lora_A.<adapter name>.weight` as some trainers save it.
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
_EMBEDDING_KEY = re.compile(r"lora_embedding_[AB]|lora_magnitude_vector|\.lora_[AB].*\.bias$")


class AdapterPathError(FileNotFoundError):
    """The path is not a readable PEFT adapter directory."""


def parse_adapter_arg(arg: str) -> tuple[str, str]:
    """`"name=path"` -> (name, path); a bare path names the adapter after itself (as MAX does)."""
    if "=" not in arg:
        return arg, arg
    name, path = arg.split("=", 1)
    if not name or not path:
        raise ValueError(f"expected 'name=path' or a path, got {arg!r}")
    return name, path


@dataclass(frozen=True)
class ModuleLoRA:
    """One module's low-rank update: delta_W = b @ a, scaling already folded into b."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter in host memory, keyed by the model's module names (e.g. model.layers.0.self_attn.q_proj)."""

    name: str
    spec: AdapterSpec
    modules: dict[str, ModuleLoRA]
    path: str | None = None

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def read_adapter_dir(path: str, allow_pickle: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read adapter_config.json and the weights. Pickle only when asked, and then weights_only."""
    if not os.path.isdir(path):
        raise AdapterPathError(f"adapter path {path!r} is not a directory")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise AdapterPathError(f"adapter path {path!r} has no {CONFIG_FILE}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidAdapterError(f"{config_path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise InvalidAdapterError(f"{config_path}: expected a JSON object")
    return config, _read_weights(path, allow_pickle)


def _read_weights(path: str, allow_pickle: bool) -> dict[str, torch.Tensor]:
    st_path, bin_path = os.path.join(path, SAFETENSORS_FILE), os.path.join(path, PICKLE_FILE)
    if os.path.isfile(st_path):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(st_path, device="cpu")
        except (SafetensorError, OSError, ValueError) as e:
            raise InvalidAdapterError(f"{st_path}: unreadable safetensors file ({e})") from e
    if os.path.isfile(bin_path):
        if not allow_pickle:
            raise InvalidAdapterError(
                f"{bin_path} is a pickle file; refusing to unpickle it. Convert it to "
                f"{SAFETENSORS_FILE}, or pass allow_pickle=True to read it with torch.load(weights_only=True)"
            )
        try:
            return torch.load(bin_path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises UnpicklingError, RuntimeError, ... for bad files
            raise InvalidAdapterError(f"{bin_path}: cannot be read with weights_only=True ({e})") from e
    raise AdapterPathError(f"adapter path {path!r} has neither {SAFETENSORS_FILE} nor {PICKLE_FILE}")


def _pair_tensors(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, dict[str, torch.Tensor]], list[str]]:
    """{module: {"A": t, "B": t}} plus the keys that are no plain LoRA weights."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    odd = []
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or _EMBEDDING_KEY.search(key):
            odd.append(key)
            continue
        pairs.setdefault(match["module"], {})[match["ab"]] = tensor
    return pairs, odd


def build_adapter(
    name: str,
    config: dict,
    tensors: dict[str, torch.Tensor],
    module_shapes: dict[str, tuple[int, int]],
    max_rank: int,
    dtype: torch.dtype = torch.float32,
    path: str | None = None,
) -> AdapterWeights:
    """Check an adapter against the model and fold scaling into B.

    module_shapes: LoRA-able module name -> (in_features, out_features), as the model names them.
    Raises InvalidAdapterError listing every problem found, not only the first.
    """
    problems = unsupported_features(config)
    pairs, odd = _pair_tensors(tensors)
    problems += [f"non-LoRA tensor {key!r} (embedding LoRA, DoRA or bias weights)" for key in odd]
    problems += [f"embedding/lm_head LoRA ({m})" for m in pairs if m.rsplit(".", 1)[-1] in ("embed_tokens", "lm_head")]
    if problems:
        raise InvalidAdapterError(f"adapter {name!r} uses unsupported PEFT features: " + "; ".join(problems))
    spec = AdapterSpec.from_dict(config)
    linear_names = tuple({m.rsplit(".", 1)[-1] for m in module_shapes})
    targeted = {m: ab for m, ab in pairs.items() if spec.targets(m, linear_names)}
    if not targeted:
        raise InvalidAdapterError(f"adapter {name!r} has no LoRA weights for the modules its config targets")
    modules = {m: _module_lora(name, m, ab, spec, module_shapes, max_rank, dtype) for m, ab in targeted.items()}
    return AdapterWeights(name=name, spec=spec, modules=modules, path=path)


def _module_lora(name, module, ab, spec, module_shapes, max_rank, dtype) -> ModuleLoRA:
    if module not in module_shapes:
        wrapped = sorted({m.rsplit(".", 1)[-1] for m in module_shapes})
        raise InvalidAdapterError(
            f"adapter {name!r} has weights for module {module!r}, which this model does not have "
            f"or does not wrap with LoRA (wrapped: {', '.join(wrapped)})"
        )
    if set(ab) != {"A", "B"}:
        raise InvalidAdapterError(f"adapter {name!r}: module {module!r} has lora_{next(iter(ab))} but not its pair")
    a, b = ab["A"], ab["B"]
    in_features, out_features = module_shapes[module]
    r = a.shape[0]
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
    b = b.to(torch.float32) * spec.scaling(module)
    return ModuleLoRA(a=a.to(dtype).contiguous(), b=b.to(dtype).contiguous())
