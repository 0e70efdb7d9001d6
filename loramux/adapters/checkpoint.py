"""PEFT adapter directories -> per-module (A, B) tensors in the model's module names.

A PEFT checkpoint stores `base_model.model.<module>.lora_A.weight` ([r, in]) and `.lora_B.weight`
([out, r]). `read_adapter_dir` reads the files (each one resolved inside the allowed directories, the
safetensors header checked before any tensor is read); `build_adapter` checks the tensors against the
model's LoRA-able modules and folds the scaling into B once, so the hot path never multiplies by it.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch

from loramux.adapters.names import parse_adapter_arg  # noqa: F401  (the "name=path" form; re-exported)
from loramux.adapters.peft_config import AdapterSpec, InvalidAdapterError, unsupported_features

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_ABS_WEIGHT = 1e4
"""Largest |value| of A or of B with its scaling folded in. Trained LoRA weights are O(1); values near
this would overflow the activations into NaN logits (found with weights x1e18)."""
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit

# `.lora_A.weight`, or `.lora_A.<adapter name>.weight` as some trainers save it.
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
_EMBEDDING_KEY = re.compile(r"lora_embedding_[AB]|lora_magnitude_vector|\.lora_[AB].*\.bias$")


class AdapterPathError(FileNotFoundError):
    """The path is not a readable PEFT adapter directory, or leads outside the allowed directories."""


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


# ---- reading ----------------------------------------------------------------------------------------
def read_adapter_dir(path: str, allow_pickle: bool = False, allowed_dirs: tuple[str, ...] = (),
                     max_weight_bytes: int | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read adapter_config.json and the weights. Pickle only when asked, and then weights_only.

    allowed_dirs: when given, every file read must resolve (symlinks and `..` followed) inside one of them.
    max_weight_bytes: a weights file larger than this is refused before it is read."""
    _check_dir(path)
    config_path = _resolve(os.path.join(path, CONFIG_FILE), allowed_dirs)
    if not os.path.isfile(config_path):
        raise AdapterPathError(f"adapter path {path!r} has no {CONFIG_FILE}")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidAdapterError(f"{CONFIG_FILE} in {path!r}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise InvalidAdapterError(f"{CONFIG_FILE} in {path!r}: expected a JSON object, got {type(config).__name__}")
    return config, _read_weights(path, allow_pickle, allowed_dirs, max_weight_bytes)


def _check_dir(path: str) -> None:
    if not isinstance(path, str) or not path or "\x00" in path:
        raise AdapterPathError(f"invalid adapter path {path!r}")
    if not os.path.exists(path):
        raise AdapterPathError(f"adapter path {path!r} does not exist")
    if not os.path.isdir(path):
        raise AdapterPathError(f"adapter path {path!r} is a file; give the adapter's directory (the one that "
                               f"holds {CONFIG_FILE})")


def _resolve(file: str, allowed_dirs: tuple[str, ...]) -> str:
    """The real path of `file`, refused when it leads outside every allowed directory (checked per file:
    a directory inside may hold a symlink to a file outside)."""
    real = os.path.realpath(file)
    roots = [os.path.realpath(d) for d in allowed_dirs]
    if roots and not any(os.path.commonpath([real, root]) == root for root in roots):
        raise AdapterPathError(f"{file} resolves to {real}, outside the allowed adapter directories "
                               f"({', '.join(roots)})")
    return real


def _read_weights(path: str, allow_pickle: bool, allowed_dirs, max_bytes) -> dict[str, torch.Tensor]:
    st_path, bin_path = os.path.join(path, SAFETENSORS_FILE), os.path.join(path, PICKLE_FILE)
    if os.path.lexists(st_path):
        return _read_safetensors(_resolve(st_path, allowed_dirs), max_bytes)
    if os.path.lexists(bin_path):
        if not allow_pickle:
            raise InvalidAdapterError(
                f"{bin_path} is a pickle file; refusing to unpickle it. Convert it to "
                f"{SAFETENSORS_FILE}, or pass allow_pickle=True to read it with torch.load(weights_only=True)"
            )
        real = _resolve(bin_path, allowed_dirs)
        _check_size(real, max_bytes)
        try:
            tensors = torch.load(real, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises UnpicklingError, RuntimeError, ... for bad files
            raise InvalidAdapterError(f"{bin_path}: cannot be read with weights_only=True ({e})") from e
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise InvalidAdapterError(f"{bin_path}: expected a dict of tensors")
        return tensors
    raise AdapterPathError(f"adapter path {path!r} has neither {SAFETENSORS_FILE} nor {PICKLE_FILE}")


def _check_size(file: str, max_bytes: int | None) -> int:
    if not os.path.isfile(file):
        raise AdapterPathError(f"{file} is not a regular file")
    size = os.path.getsize(file)
    if max_bytes is not None and size > max_bytes:
        raise InvalidAdapterError(f"{file} is {size} bytes; LoRA weights for this model's wrapped modules at "
                                  f"max_lora_rank take at most {max_bytes}")
    return size


def _read_safetensors(file: str, max_bytes: int | None) -> dict[str, torch.Tensor]:
    """The header is parsed here first: the safetensors library takes the last of two equal keys and reads
    any length prefix; then the library reads the tensors (and checks offsets and sizes).

    The file is read whole (its size is bounded above) and decoded with `safetensors.torch.load`: its
    `load_file` / `safe_open(...).get_tensor` keep ~1.5 KB of Python objects alive per call in safetensors
    0.8 (measured with tracemalloc: +3 MB over 2,000 loads), which adapter churn turns into a leak."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    size = _check_size(file, max_bytes)
    with open(file, "rb") as f:
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < length <= min(size - 8, MAX_HEADER_BYTES):
            raise InvalidAdapterError(f"{file}: not a safetensors file (a {size}-byte file whose header length "
                                      f"field reads {length})")
        data = prefix + f.read()
    try:
        header = json.loads(data[8:8 + length], object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidAdapterError(f"{file}: malformed safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise InvalidAdapterError(f"{file}: malformed safetensors header (not a JSON object)")
    try:
        return load(data)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise InvalidAdapterError(f"{file}: unreadable safetensors file ({e})") from e


def _unique_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise ValueError(f"duplicate keys {duplicates}")
    return dict(pairs)


# ---- building ---------------------------------------------------------------------------------------
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
) -> AdapterWeights:
    """Check an adapter against the model and fold scaling into B.

    module_shapes: LoRA-able (wrapped) module name -> (in_features, out_features), as the model names them.
    all_linear: the module-name suffixes PEFT's "all-linear" stands for in this model: every Linear but the
    output head, wrapped or not (default: the wrapped ones), so that an "all-linear" adapter with weights for
    a module that is not wrapped is refused as the same adapter written as a list is.
    Raises InvalidAdapterError listing every problem found, not only the first.
    """
    problems = unsupported_features(config) + _dtype_problems(tensors)
    pairs, odd = _pair_tensors(tensors)
    problems += [f"non-LoRA tensor {key!r} (embedding LoRA, DoRA or bias weights)" for key in odd]
    problems += [f"embedding/lm_head LoRA ({m})" for m in pairs if m.rsplit(".", 1)[-1] in ("embed_tokens", "lm_head")]
    if problems:
        raise InvalidAdapterError(f"adapter {name!r} uses unsupported PEFT features: " + "; ".join(problems))
    spec = AdapterSpec.from_dict(config)
    linear = all_linear if all_linear is not None else tuple({m.rsplit(".", 1)[-1] for m in module_shapes})
    targeted = {m: ab for m, ab in sorted(pairs.items()) if spec.targets(m, linear)}
    if not targeted:
        raise InvalidAdapterError(f"adapter {name!r} has no LoRA weights for the modules its config targets")
    modules, errors = {}, []
    for module, ab in targeted.items():
        try:
            modules[module] = _module_lora(name, module, ab, spec, module_shapes, max_rank, dtype)
        except InvalidAdapterError as e:
            errors.append(str(e))
    if errors:
        more = f" (and {len(errors) - 3} more modules)" if len(errors) > 3 else ""
        raise InvalidAdapterError("; ".join(errors[:3]) + more)
    return AdapterWeights(name=name, spec=spec, modules=modules, path=path)


def _module_lora(name, module, ab, spec, module_shapes, max_rank, dtype) -> ModuleLoRA:
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
    b = b.to(torch.float32) * spec.scaling(module)
    _check_values(name, f"{module}.lora_A.weight", a)
    _check_values(name, f"{module}.lora_B.weight (scaling {spec.scaling(module):g} folded in)", b)
    return ModuleLoRA(a=a.to(dtype).contiguous(), b=b.to(dtype).contiguous())


def _check_values(name: str, what: str, t: torch.Tensor) -> None:
    """One pass: the max of |t| is NaN when t holds a NaN, and inf when it holds an inf."""
    peak = float(t.abs().max()) if t.numel() else 0.0
    if peak <= MAX_ABS_WEIGHT:
        return
    kind = "NaN" if peak != peak else "Inf" if peak == float("inf") else f"|values| up to {peak:.3g}"
    raise InvalidAdapterError(f"adapter {name!r}: {what} has {kind}; LoRA weights must be finite and at most "
                              f"{MAX_ABS_WEIGHT:g} in size")
