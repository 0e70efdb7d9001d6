"""adapter_config.json -> AdapterSpec: which modules an adapter touches, with what rank and scaling.

Stdlib only (the cache imports this module, and the cache has no torch). Matching follows PEFT's
`check_target_module_exists` and `get_pattern_key`, so a module gets LoRA here exactly when PEFT
would give it LoRA.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field


class InvalidAdapterError(ValueError):
    """The adapter's files are readable but describe something we cannot (or will not) run."""


# (field, test that says the value asks for something we cannot run, what to call it in the error)
_UNSUPPORTED_FIELDS = (
    ("bias", lambda v: v not in (None, "none"), "trained biases (bias={!r})"),
    ("lora_bias", bool, "LoRA bias (lora_bias=true)"),
    ("use_qalora", bool, "QALoRA (use_qalora=true)"),
    ("layer_replication", bool, "layer_replication={!r}"),
    ("trainable_token_indices", bool, "trainable_token_indices"),
    ("megatron_config", bool, "megatron_config"),
    ("use_bdlora", bool, "block-diagonal LoRA (use_bdlora)"),
)
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
"""target_parameters loramux runs: the 3D expert weights of MoE models (PEFT's ParamWrapper)."""
SAVABLE_MODULES = ("embed_tokens", "lm_head")
"""modules_to_save loramux runs: full per-adapter copies of the embedding table and the output head."""


def unsupported_features(config: dict) -> list[str]:
    """Every PEFT feature in `config` that changes the math in a way we do not implement."""
    found = []
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        found.append(f"peft_type={peft_type!r} (only LORA)")
    for name, is_set, label in _UNSUPPORTED_FIELDS:
        value = config.get(name)
        if value is not None and is_set(value):
            found.append(label.format(value))
    params = config.get("target_parameters") or []
    if isinstance(params, str) or not isinstance(params, (list, tuple)):
        found.append(f"target_parameters={params!r} (a list of parameter names)")
    else:
        others = [p for p in params if not str(p).endswith(EXPERT_PARAMETERS)]
        if others:
            found.append(f"target_parameters={others!r} (only MoE experts' {' and '.join(EXPERT_PARAMETERS)})")
    saved = config.get("modules_to_save") or []
    if isinstance(saved, str) or not isinstance(saved, (list, tuple)):
        found.append(f"modules_to_save={saved!r} (a list of module names)")
    else:
        others = [m for m in saved if str(m).rsplit(".", 1)[-1] not in SAVABLE_MODULES]
        if others:
            found.append(f"modules_to_save={others!r} (only {' and '.join(SAVABLE_MODULES)} can be saved)")
    return found


def saved_modules(config: dict) -> tuple[str, ...]:
    """adapter_config.json's modules_to_save by module (last name; () if malformed: that is reported apart);
    with ensure_weight_tying, a saved embedding or head means both (PEFT writes the tied pair)."""
    listed = config.get("modules_to_save") or ()
    if not isinstance(listed, (list, tuple)):
        return ()
    saved = tuple(str(m).rsplit(".", 1)[-1] for m in listed)
    if config.get("ensure_weight_tying") is True and set(saved) & {"embed_tokens", "lm_head"}:
        saved = tuple(dict.fromkeys((*saved, "embed_tokens", "lm_head")))
    return saved


def _invocation(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not value or len(value) > 64 or \
            any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in value):
        raise ValueError(f"alora_invocation_tokens must be a list of 1 to 64 token ids, got {value!r}")
    return tuple(value)


def _rank(value, field: str) -> int:
    # JSON gives 8.7 or true as easily as 8; PEFT would build nn.Linear(in, 8.7) (an error) or scale by alpha/8.7
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field} must be a positive integer, got {value!r}")
    return value


def _number(value, field: str) -> float:
    # NaN and 1e400 (inf, as JSON reads it) would be folded into every B and poison the logits
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{field} must be a finite number, got {value!r}")
    return float(value)


def _regex(pattern: str, field: str) -> str:
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{field} {pattern!r} is not a valid regular expression ({e})") from e
    return pattern


def _modules(value, field: str) -> tuple[str, ...] | str:
    """A list of module-name suffixes, or one regex string (PEFT's two forms)."""
    if isinstance(value, str):
        return _regex(value, field)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(f"{field} must be a list of module names or a regex string, got {value!r}")


def _layers(value) -> tuple[int, ...] | None:
    if value is None:
        return None
    values = [value] if isinstance(value, int) else value
    if (not isinstance(values, (list, tuple))
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)):
        raise ValueError(f"layers_to_transform must be a layer index or a list of them, got {value!r}")
    return tuple(values) or None


def _patterns(value, field: str, check) -> dict:
    if not value:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{field} must map module-name patterns to values, got {value!r}")
    return {_regex(k, field): check(v, f"{field}[{k!r}]") for k, v in value.items()}


def _flag(config: dict, field: str) -> bool:
    value = config.get(field, False)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{field} must be true or false, got {value!r}")
    return bool(value)


def _matches_list(names: tuple[str, ...], key: str) -> bool:
    return key in names or any(key.endswith(f".{n}") for n in names)


def _layer_index(key: str, layers_pattern: tuple[str, ...] | None) -> int | None:
    # The first numbered segment, as PEFT does (a greedy match would pick up MoE expert indices).
    if not layers_pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        match = None
        for pattern in layers_pattern:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if match:
                break
    return int(match.group("idx")) if match else None


def _pattern_key(pattern_keys, key: str) -> str:
    """PEFT's get_pattern_key: the first pattern that matches a dotted suffix of `key`."""
    for pattern in pattern_keys:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return key


@dataclass(frozen=True)
class AdapterSpec:
    """The parts of a PEFT LoraConfig that decide which modules get LoRA and how it is scaled."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str
    use_rslora: bool = False
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    exclude_modules: tuple[str, ...] | str | None = None
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None
    modules_to_save: tuple[str, ...] = ()  # whole modules the adapter replaces (embed_tokens, lm_head)
    # PEFT's ensure_weight_tying: on a tied model the head follows the embedding (its LoRA, its saved copy)
    ensure_weight_tying: bool = False
    target_parameters: tuple[str, ...] = ()  # 3D expert weights with LoRA (e.g. mlp.experts.gate_up_proj)
    # Only the base layer's weight layout (GPT-2 Conv1D) depends on this; lora_A is [r, in] and
    # lora_B is [out, r] either way, so the LoRA delta is computed the same.
    fan_in_fan_out: bool = False
    use_dora: bool = False  # DoRA: each module's output rows scaled by magnitude / ||W + s B A|| (checkpoint.py)
    # aLoRA: the token ids whose last occurrence in a prompt activates the adapter (from its first token on)
    alora_invocation_tokens: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, config: dict) -> AdapterSpec:
        problems = unsupported_features(config)
        if problems:
            raise InvalidAdapterError("unsupported PEFT features: " + "; ".join(problems))
        try:
            return cls._parse(config)
        except (TypeError, ValueError) as e:
            raise InvalidAdapterError(f"malformed adapter_config.json: {e}") from e

    @classmethod
    def _parse(cls, config: dict) -> AdapterSpec:
        if "r" not in config:
            raise ValueError("missing field 'r' (the rank)")
        targets = config.get("target_modules")
        if not targets and not config.get("target_parameters"):
            raise ValueError("target_modules is missing or empty")
        layers_pattern = config.get("layers_pattern")
        if layers_pattern:
            layers_pattern = _modules(layers_pattern, "layers_pattern")
            layers_pattern = (layers_pattern,) if isinstance(layers_pattern, str) else layers_pattern
        excluded = config.get("exclude_modules")
        return cls(
            r=_rank(config["r"], "r"),
            lora_alpha=_number(config.get("lora_alpha", 8), "lora_alpha"),
            target_modules=_modules(targets, "target_modules") if targets else (),
            use_rslora=_flag(config, "use_rslora"),
            rank_pattern=_patterns(config.get("rank_pattern"), "rank_pattern", _rank),
            alpha_pattern=_patterns(config.get("alpha_pattern"), "alpha_pattern", _number),
            exclude_modules=_modules(excluded, "exclude_modules") if excluded else None,
            layers_to_transform=_layers(config.get("layers_to_transform")),
            layers_pattern=layers_pattern or None,
            fan_in_fan_out=_flag(config, "fan_in_fan_out"),
            modules_to_save=tuple(config.get("modules_to_save") or ()),
            ensure_weight_tying=_flag(config, "ensure_weight_tying"),
            target_parameters=tuple(config.get("target_parameters") or ()),
            use_dora=_flag(config, "use_dora"),
            alora_invocation_tokens=_invocation(config.get("alora_invocation_tokens")),
        )

    def targets(self, module: str, all_linear: tuple[str, ...] = ()) -> bool:
        """Whether PEFT gives `module` (full dotted name in the base model) a LoRA layer.

        `all_linear` lists the modules that the "all-linear" shorthand stands for in this model."""
        if self._excluded(module):
            return False
        if self.ensure_weight_tying and module.rsplit(".", 1)[-1] == "lm_head" and self._targets_embedding():
            return True  # the tied head's LoRA, which PEFT writes beside the embedding's
        if isinstance(self.target_modules, str):
            if self.target_modules.lower() == "all-linear":
                return _matches_list(all_linear, module)
            return re.fullmatch(self.target_modules, module) is not None
        if module in self.target_modules:
            return True
        if not _matches_list(self.target_modules, module):
            return False
        if self.layers_to_transform is None:
            return True
        return _layer_index(module, self.layers_pattern) in self.layers_to_transform

    def _targets_embedding(self) -> bool:
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, "model.embed_tokens") is not None
        return any(t.rsplit(".", 1)[-1] == "embed_tokens" for t in self.target_modules)

    def parameters_of(self, module: str) -> list[str]:
        """The names of the target_parameters on `module` (full dotted name). PEFT applies layers_to_transform to
        target_modules only: parameters get LoRA in every layer."""
        return [p.rsplit(".", 1)[1] for p in self.target_parameters if f"{module}.{p.rsplit('.', 1)[1]}".endswith(p)]

    def _excluded(self, module: str) -> bool:
        if not self.exclude_modules:
            return False
        if isinstance(self.exclude_modules, str):
            return re.fullmatch(self.exclude_modules, module) is not None
        return _matches_list(self.exclude_modules, module)

    def rank(self, module: str) -> int:
        return self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r)

    def scaling(self, module: str) -> float:
        """alpha / r, or alpha / sqrt(r) with rsLoRA (Kalajdzievski 2023), per-module patterns applied."""
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.lora_alpha)
        r = self.rank(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r
