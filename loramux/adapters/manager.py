"""LoRAManager: the adapter system over one model, and its public API in one vocabulary (the engine's, which is
Modular MAX's and TensorRT Edge-LLM's: load_adapter / unload_adapter / activate_adapter / pin_adapter by name);
vLLM's manager names are a facade over it (`manager.vllm`, adapters/vllm_names.py).

It builds the three parts side by side and owns them: the AdapterCache (policy: which identity lives in
which tier), the AdapterSlots (the model's LoRA layers and their slot buffers) and the AdapterStore (names,
identities, host copies). An engine hands the cache to its scheduler and the slots to its model runner;
LoRAModel drives a plain HF model with it.
"""
from __future__ import annotations

import contextlib
import functools
import json
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from loramux.adapters.cache import AdapterCache
from loramux.adapters.combinations import combine
from loramux.adapters.names import (AdapterRef, InvalidAdapterNameError, InvalidCombinationError, check_adapter_name,
                                    is_combination, parse_adapter_arg, parse_combination)
from loramux.adapters.slots import AdapterSlots
from loramux.adapters.status import LoRAResult, LoRAStatus
from loramux.adapters.store import AdapterStore, Source
from loramux.adapters.vllm_names import VLLMNames
from loramux.config import LoRAConfig


NEVER = 1 << 62  # an activation no position reaches
MAX_COMBINATIONS = 32  # weighted combinations kept built (each holds its parts' weights again in host memory)


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig | None = None, backend: str = "auto"):
        self.model = model
        self.config = config or LoRAConfig()
        self.cache = AdapterCache(self.config.max_loras, self.config.max_cpu_loras, self.config.max_cpu_lora_bytes)
        self.slots = AdapterSlots(model, self.config, backend)
        self.store = AdapterStore(self.cache, self.slots, self.config)
        self._combinations: OrderedDict[str, tuple[AdapterRef, ...]] = OrderedDict()  # name -> its parts' identities

    # ---- loading ---------------------------------------------------------------------------------
    def load_adapter(self, spec: str, path: str | None = None, allow_pickle: bool | None = None,
                     allowed_dirs: Sequence[str] = (), replace: bool = False, pinned: bool = False,
                     lora_alpha: float | None = None) -> LoRAResult:
        """Load a PEFT adapter directory: `load_adapter("name=path")`, a bare path (named after itself), or
        `load_adapter(name, path)` (the name is never parsed). The path may also be one .safetensors file of
        LoRA pairs (TensorRT Edge-LLM's loadWeights): `load_adapter("name", "x.safetensors", lora_alpha=16)`,
        rank and targets from its tensors (adapters/files.py). allowed_dirs: every file read, now and on a
        reload from disk, must resolve inside one of them. allow_pickle: None = LoRAConfig.allow_pickle.
        A name already loaded from the same directory answers SUCCESS (from another, LOAD_NAME_EXISTS).
        replace: an adapter of that name is reloaded in place (vLLM's load_inplace): requests starting from
        now get the new weights, running ones finish on the old; a pinned adapter stays pinned.
        pinned: pin it too (pin_adapter); if that fails, nothing is loaded or replaced."""
        try:
            name, path = (check_adapter_name(spec), path) if path is not None else parse_adapter_arg(spec)
        except InvalidAdapterNameError as e:
            return LoRAResult(LoRAStatus.LOAD_INVALID_NAME, str(e))
        except ValueError as e:
            return LoRAResult(LoRAStatus.LOAD_INVALID_PATH, str(e))
        allow = self.config.allow_pickle if allow_pickle is None else allow_pickle
        return self.store.load(name, Source(path, allow, tuple(allowed_dirs), lora_alpha), replace, pinned)

    def add_adapter(self, name: str, tensors: dict[str, torch.Tensor], peft_config: dict,
                    replace: bool = False) -> LoRAResult:
        """Register an adapter from in-memory PEFT tensors (named as in adapter_model.safetensors) and its PEFT
        config (adapter_config.json's dict), under the checks files get; no I/O, no disk copy. replace: new
        weights for a loaded name, in place (AdapterStore.add_tensors)."""
        try:
            check_adapter_name(name)
        except InvalidAdapterNameError as e:
            return LoRAResult(LoRAStatus.LOAD_INVALID_NAME, str(e))
        problem = _push_problem(tensors, peft_config)
        config = _as_saved(peft_config) if not problem else None
        if problem or config is None:
            problem = problem or "the PEFT config does not convert to JSON as adapter_config.json would"
            return LoRAResult(LoRAStatus.LOAD_INVALID_ADAPTER, f"adapter {name!r}: {problem}")
        detached = {key: t.detach() for key, t in tensors.items()}  # (a trainer's tensors may carry autograd state)
        return self.store.add_tensors(name, detached, config, replace)

    def unload_adapter(self, name: str) -> LoRAResult:
        """The name goes at once; its weights and slot go as soon as no request (or `using` block) runs on them."""
        return self.store.unload(name)

    def pin_adapter(self, name: str) -> LoRAResult:
        """Keep the adapter in host memory and in a device slot until it is unpinned or unloaded."""
        return self.store.pin(name)

    def unpin_adapter(self, name: str) -> LoRAResult:
        return self.store.unpin(name)

    # ---- identities and slots --------------------------------------------------------------------
    def identity_for(self, model: str) -> AdapterRef:
        """The identity a request for `model` starts on now: a loaded name, `name@rev` for one of its kept
        revisions (LoRAConfig.keep_revisions), or a weighted combination of loaded names (combination_name:
        built now if new, or if a part has been reloaded since); LookupError if none of these,
        InvalidCombinationError for a combination that cannot be served."""
        if is_combination(model):
            self._combine(model)
        return self.store.identity_for(model)

    def _combine(self, name: str) -> None:
        """Build (or rebuild) the combination `name` from its parts' current identities; the least recently used
        of more than MAX_COMBINATIONS goes (its running requests finish on it)."""
        parts = parse_combination(name)
        refs = tuple(self.store.identity_for(part) for part in parts)  # LookupError: a part is not loaded
        if self._combinations.get(name) != refs or self.store.current(name) is None:
            weights = combine(name, [(p, self.store.weights_of(r), w) for (p, w), r in zip(parts.items(), refs)],
                              self.config.max_lora_rank)
            result = self.store.add_weights(weights)
            if not result:
                raise InvalidCombinationError(result.message)
        self._combinations[name] = refs
        self._combinations.move_to_end(name)
        while len(self._combinations) > MAX_COMBINATIONS:
            oldest, _ = self._combinations.popitem(last=False)
            self.store.unload(oldest)

    def lookup(self, model: str) -> AdapterRef | None:
        """identity_for(), or None."""
        return self.store.lookup(model)

    def activation(self, ref: AdapterRef, prompt: Sequence[int]) -> int:
        """The first position of `prompt` the identity acts on: 0, or for an aLoRA adapter the start of the last
        occurrence of its invocation tokens in the prompt (PEFT's alora_offsets), NEVER if they are not in it
        (PEFT then runs the base model for the whole request)."""
        tokens = self.store.invocation_of(ref)
        if not tokens:
            return 0
        n = len(tokens)
        return next((i for i in range(len(prompt) - n, -1, -1) if tuple(prompt[i:i + n]) == tokens), NEVER)

    def revisions(self, name: str) -> list[AdapterRef]:
        """`name`'s earlier revisions still addressable as name@rev (AdapterRef.revision), oldest first."""
        return self.store.revisions(name)

    def current(self, name: str) -> AdapterRef | None:
        """`name`'s current identity, or None."""
        return self.store.current(name)

    def __contains__(self, ref: AdapterRef) -> bool:
        """Whether the identity still exists: named, or unloaded / replaced while requests still use it."""
        return ref in self.store

    def activate(self, ref: AdapterRef) -> int:
        """A device slot for the identity (read from disk if it left host memory)."""
        return self.store.activate(ref)

    def activate_adapter(self, name: str) -> int:
        """Put the adapter in a device slot (reloading it from disk if it left host memory); its slot."""
        return self.activate(self.identity_for(name))

    def deactivate_adapter(self, name: str) -> None:
        """vLLM's deactivate_adapter: take the adapter out of its slot (it stays in host memory). Refused
        while requests use it or while it is pinned."""
        self.store.deactivate(self.identity_for(name))

    def retire(self) -> None:
        """Free the identities unloaded or replaced whose last request has ended."""
        self.store.retire()

    @contextlib.contextmanager
    def using(self, refs: Sequence[AdapterRef]) -> Iterator[None]:
        """Hold in-flight references: none of these identities is evicted or removed in the block."""
        held = []
        try:
            for ref in refs:
                self.cache.acquire(ref)
                held.append(ref)
            yield
        finally:
            for ref in held:
                self.cache.release(ref)
            self.retire()

    # ---- other vocabularies -----------------------------------------------------------------------
    @functools.cached_property
    def vllm(self) -> VLLMNames:
        """vLLM's LoRA model manager names over this manager (adapters/vllm_names.py)."""
        return VLLMNames(self)

    def clone(self, name: str, new_name: str) -> LoRAResult:
        """A second name for `name`'s current weights, sharing their host memory (AdapterStore.clone); each
        name then lives on its own."""
        try:
            check_adapter_name(new_name)
        except InvalidAdapterNameError as e:
            return LoRAResult(LoRAStatus.LOAD_INVALID_NAME, str(e))
        return self.store.clone(name, new_name)

    # ---- queries ---------------------------------------------------------------------------------
    def is_lora(self, name: str) -> bool:
        return self.store.current(name) is not None

    def is_active_lora(self, name: str) -> bool:
        ref = self.store.current(name)
        return ref is not None and self.cache.slot_of(ref) is not None

    @property
    def loras(self) -> list[str]:
        """The loaded adapters' names (combinations, derived from them, are not listed)."""
        return [name for name in self.store.names if not is_combination(name)]

    @property
    def active_loras(self) -> dict[str, int]:
        """name -> device slot of the adapters whose current identity holds one."""
        current = self._names_by_identity()
        return {current[ref]: slot for ref, slot in self.cache.active.items() if ref in current}

    @property
    def resident(self) -> dict[str, list[str]]:
        """Tier ("host", "device") -> the names whose current identity is there now."""
        current = self._names_by_identity()
        return {"host": sorted(current[ref] for ref in self.cache.host if ref in current),
                "device": sorted(current[ref] for ref in self.cache.active if ref in current)}

    def _names_by_identity(self) -> dict[AdapterRef, str]:
        """The current identity of each loaded name -> the name (retiring identities have none)."""
        return {self.store.current(name): name for name in self.store.names}

    @property
    def paths(self) -> dict[str, str | None]:
        """Every loaded adapter's directory (None for adapters added from tensors)."""
        sources = {name: self.store.source(self.store.current(name)) for name in self.store.names}
        return {name: source.path if source else None for name, source in sources.items()}

    @property
    def kept_revisions(self) -> dict[str, list[str]]:
        """name -> its earlier revisions still addressable (name@rev, oldest first), for the names that have any."""
        kept = {name: [ref.revision for ref in self.store.revisions(name)] for name in self.store.names}
        return {name: revisions for name, revisions in kept.items() if revisions}

    @property
    def pinned(self) -> list[str]:
        return [name for name in self.store.names if self.cache.is_pinned(self.store.current(name))]

    @property
    def stats(self) -> dict[str, int]:
        """Counters for metrics: disk reads, host and slot evictions."""
        return self.store.stats

    @property
    def slot_bytes(self) -> int:
        return self.slots.slot_bytes

    @property
    def host_bytes(self) -> int:
        return self.cache.host_bytes


def _push_problem(tensors, peft_config) -> str:
    """What is wrong with the shapes of a push's arguments ("" if nothing): the tensors' values are checked as a
    file's are, when the adapter is built."""
    if not isinstance(peft_config, Mapping):
        return f"the PEFT config must be a dict (adapter_config.json's contents), got {type(peft_config).__name__}"
    if not isinstance(tensors, Mapping) or not tensors:
        return "the tensors must be a non-empty dict of PEFT tensor names to tensors"
    odd = [repr(k) for k, t in tensors.items()
           if not isinstance(k, str) or not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_meta]
    if odd:
        return f"{', '.join(odd[:3])}{' ...' if len(odd) > 3 else ''}: not a dense tensor with values under a string name"
    return ""


def _as_saved(peft_config) -> dict | None:
    """The config as adapter_config.json holds it, through JSON as PEFT writes it (its to_dict() has enums and
    sets: a str enum becomes its value, a set a sorted list), so that a push and its files mean one thing;
    None if it has values JSON cannot hold."""
    def plain(value):
        if isinstance(value, (set, frozenset)):
            return sorted(value, key=str)
        raise TypeError(type(value).__name__)

    try:
        return json.loads(json.dumps(dict(peft_config), default=plain))
    except (TypeError, ValueError):
        return None
