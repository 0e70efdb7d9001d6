"""LoRAManager: the public adapter API over one model.

It wraps the model's target Linear modules in LoRALinear layers, keeps adapters' host copies, asks the
AdapterCache where each adapter should live and carries out its answers (copying weights into device
slots, clearing slots, dropping host copies). Every load/unload/pin reports a LoRAResult whose status
is a LoRAStatus and whose message says why, for users (the HTTP server shows it as is).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from loramux.adapters.cache import AdapterCache, CacheFullError, Changes
from loramux.adapters.checkpoint import AdapterPathError, AdapterWeights, build_adapter, read_adapter_dir
from loramux.adapters.names import InvalidAdapterNameError, check_adapter_name, parse_adapter_arg
from loramux.adapters.peft_config import InvalidAdapterError
from loramux.adapters.status import LoRAResult, LoRAStatus
from loramux.config import LoRAConfig
from loramux.layers.lora import LoRAContext, LoRALinear, PackedLoRALinear
from loramux.ops import RowSlots, UniformSlot, select_backend, wants_grouped_tokens

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Source:
    """Where an adapter's weights come from, and the rules they were read under: a reload from disk (after
    host eviction) reads them again under the same rules."""

    path: str
    allow_pickle: bool
    allowed_dirs: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Binding:
    """Where one adapter module (e.g. model.layers.0.self_attn.q_proj) lands: a layer and its slice."""

    layer: LoRALinear
    slice_index: int


_OUTPUT_HEADS = ("lm_head", "embed_out", "output")  # PEFT's "all-linear" leaves the output layer out


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig | None = None, backend: str = "auto",
                 cache: AdapterCache | None = None):
        """cache: the AdapterCache that decides where adapters live (an engine shares it with its scheduler);
        None = a new one sized by `config`."""
        self.model = model
        self.config = config or LoRAConfig()
        self.context = LoRAContext()
        self.cache = cache or AdapterCache(self.config.max_loras, self.config.max_cpu_loras)
        if (self.cache.max_loras, self.cache.max_cpu_loras) != (self.config.max_loras, self.config.max_cpu_loras):
            raise ValueError(f"the AdapterCache holds {self.cache.max_loras} slots / {self.cache.max_cpu_loras} host "
                             f"adapters but the LoRAConfig says {self.config.max_loras} / {self.config.max_cpu_loras}")
        self._add_lora = select_backend(backend, next(model.parameters()).device)
        self.wants_grouped_tokens = wants_grouped_tokens(self._add_lora)  # see ModelRunner.run
        self._layers: dict[str, tuple[LoRALinear, tuple[str, ...]]] = {}  # layer name -> (layer, module names)
        self._bindings: dict[str, _Binding] = {}
        self._wrap_targets()
        self._weights: dict[str, AdapterWeights] = {}  # host tier
        self._sources: dict[str, _Source] = {}  # disk tier: name -> where to read it again
        self._uniform: dict[int, UniformSlot] = {}
        self.active_adapter_name: str | None = None
        # Counters for metrics: disk reads (first loads and reloads), and adapters pushed out of a tier.
        self.stats = {"loads": 0, "host_evictions": 0, "slot_evictions": 0}

    # ---- wrapping --------------------------------------------------------------------------------
    def _wrap_targets(self) -> None:
        packed = getattr(self.model, "packed_modules_mapping", {})
        targets = set(self.config.targets)
        found = []
        linear = set()  # what PEFT's "all-linear" stands for here: every Linear but the output head
        for name, module in self.model.named_modules():
            attr = name.rsplit(".", 1)[-1]
            if isinstance(module, (nn.Linear, LoRALinear)) and attr not in _OUTPUT_HEADS:
                linear.update(packed.get(attr, (attr,)))
            if not isinstance(module, nn.Linear):
                continue  # a LoRALinear is no nn.Linear, so nothing is wrapped twice
            if attr in targets or targets & set(packed.get(attr, ())):
                found.append((name, module, packed.get(attr)))
        if not found:
            raise ValueError(f"no Linear module of the model matches target_modules {sorted(targets)}")
        for name, module, sub_names in found:
            self._wrap(name, module, sub_names)
        self.all_linear = tuple(sorted(linear))

    def _wrap(self, name: str, base: nn.Linear, sub_names: Sequence[str] | None) -> None:
        prefix, _, attr = name.rpartition(".")
        kw = dict(max_loras=self.config.max_loras, max_rank=self.config.max_lora_rank, context=self.context,
                  add_lora=self._add_lora)
        if sub_names:
            sizes = getattr(base, "output_sizes", None)
            if sizes is None or len(sizes) != len(sub_names):
                raise ValueError(f"packed module {name!r} needs output_sizes for {list(sub_names)}")
            layer = PackedLoRALinear(base, output_slices=sizes, **kw)
            modules = tuple(f"{prefix}.{s}" if prefix else s for s in sub_names)
        else:
            layer = LoRALinear(base, **kw)
            modules = (name,)
        parent = self.model.get_submodule(prefix) if prefix else self.model
        parent.register_module(attr, layer)
        self._layers[name] = (layer, modules)
        for i, module in enumerate(modules):
            self._bindings[module] = _Binding(layer, i)

    def _module_shapes(self) -> dict[str, tuple[int, int]]:
        return {m: (b.layer.in_features, b.layer.output_slices[b.slice_index]) for m, b in self._bindings.items()}

    def _max_weight_bytes(self) -> int:
        """The most bytes a weights file of a servable adapter can need: every wrapped module at max rank in
        fp32, with room for a header and for weights of modules PEFT would ignore (x2)."""
        rank = self.config.max_lora_rank
        return 2 * sum(4 * rank * (i + o) for i, o in self._module_shapes().values()) + (1 << 20)

    # ---- loading ---------------------------------------------------------------------------------
    def load_adapter(self, spec: str, path: str | None = None, allow_pickle: bool | None = None,
                     allowed_dirs: Sequence[str] = ()) -> LoRAResult:
        """Load a PEFT adapter directory: `load_adapter("name=path")`, a bare path (named after itself), or
        `load_adapter(name, path)` (the name is never parsed). allowed_dirs: every file read, now and on a
        reload from disk, must resolve inside one of them. allow_pickle: None = LoRAConfig.allow_pickle."""
        try:
            name, path = (check_adapter_name(spec), path) if path is not None else parse_adapter_arg(spec)
        except InvalidAdapterNameError as e:
            return LoRAResult(LoRAStatus.LOAD_INVALID_NAME, str(e))
        except ValueError as e:
            return LoRAResult(LoRAStatus.LOAD_INVALID_PATH, str(e))
        if name in self.cache:
            return LoRAResult(LoRAStatus.LOAD_NAME_EXISTS, f"an adapter named {name!r} is already loaded")
        allow = self.config.allow_pickle if allow_pickle is None else allow_pickle
        source = _Source(path, allow, tuple(allowed_dirs))
        return self._guarded_load(name, lambda: self._read(name, source), source)

    def add_adapter(self, name: str, tensors: dict[str, torch.Tensor], peft_config: dict) -> LoRAResult:
        """Register an adapter from in-memory PEFT tensors and config (no I/O; it has no disk copy)."""
        try:
            check_adapter_name(name)
        except InvalidAdapterNameError as e:
            return LoRAResult(LoRAStatus.LOAD_INVALID_NAME, str(e))
        if name in self.cache:
            return LoRAResult(LoRAStatus.LOAD_NAME_EXISTS, f"an adapter named {name!r} is already loaded")
        return self._guarded_load(name, lambda: self._build(name, peft_config, tensors, None), None)

    def _guarded_load(self, name: str, read, source: _Source | None) -> LoRAResult:
        try:
            weights = read()
            self._apply(self.cache.add(name, on_disk=source is not None))
        except AdapterPathError as e:
            return LoRAResult(LoRAStatus.LOAD_INVALID_PATH, str(e))
        except InvalidAdapterError as e:
            return LoRAResult(LoRAStatus.LOAD_INVALID_ADAPTER, str(e))
        except CacheFullError as e:
            return LoRAResult(LoRAStatus.LOAD_ERROR, str(e))
        except Exception as e:  # a broken adapter must never take the caller down
            logger.exception("loading adapter %r failed", name)
            return LoRAResult(LoRAStatus.LOAD_ERROR, f"loading adapter {name!r} failed: {type(e).__name__}: {e}")
        self._weights[name] = weights
        self.stats["loads"] += 1
        if source is not None:
            self._sources[name] = source
        return LoRAResult(LoRAStatus.SUCCESS, f"adapter {name!r} loaded")

    def _read(self, name: str, source: _Source) -> AdapterWeights:
        config, tensors = read_adapter_dir(source.path, source.allow_pickle, source.allowed_dirs,
                                           self._max_weight_bytes())
        return self._build(name, config, tensors, source.path)

    def _build(self, name, config, tensors, path) -> AdapterWeights:
        layer = next(iter(self._layers.values()))[0]
        return build_adapter(name, config, tensors, self._module_shapes(), self.config.max_lora_rank,
                             dtype=layer.lora_a.dtype, path=path, all_linear=self.all_linear)

    def unload_adapter(self, name: str) -> LoRAResult:
        """Forget the adapter: frees its host copy and its slot. Refused while requests use it."""
        if name not in self.cache:
            return LoRAResult(LoRAStatus.UNLOAD_NAME_NONEXISTENT, f"no adapter named {name!r} is loaded")
        held_by_switch = name == self.active_adapter_name
        if self.cache.refs(name) > held_by_switch:  # before any change: a refused unload changes nothing
            return LoRAResult(LoRAStatus.UNLOAD_IN_USE,
                              f"adapter {name!r} is used by {self.cache.refs(name) - held_by_switch} running request(s)")
        if held_by_switch:
            self.reset()
        self._apply(self.cache.remove(name))
        self._weights.pop(name, None)
        self._sources.pop(name, None)
        return LoRAResult(LoRAStatus.SUCCESS, f"adapter {name!r} unloaded")

    # ---- tiers -----------------------------------------------------------------------------------
    def activate_adapter(self, name: str) -> int:
        """Put the adapter in a device slot (reloading it from disk if it left host memory); its slot."""
        self._ensure_in_host(name)
        slot, changes = self.cache.activate(name)
        self._apply(changes)
        return slot

    def deactivate_adapter(self, name: str) -> None:
        self._apply(self.cache.deactivate(name))

    def pin_adapter(self, name: str) -> LoRAResult:
        """Keep the adapter in host memory and in a device slot until it is unloaded."""
        if name not in self.cache:
            return LoRAResult(LoRAStatus.PIN_NAME_NONEXISTENT, f"cannot pin adapter {name!r}: it is not loaded")
        try:
            self._ensure_in_host(name)
            self._apply(self.cache.pin(name))
        except (CacheFullError, InvalidAdapterError, AdapterPathError) as e:
            return LoRAResult(LoRAStatus.PIN_ERROR, str(e))
        return LoRAResult(LoRAStatus.SUCCESS, f"adapter {name!r} pinned")

    def unpin_adapter(self, name: str) -> LoRAResult:
        """Let the adapter be evicted again (it stays loaded, and in its slot until the LRU needs it)."""
        if name not in self.cache:
            return LoRAResult(LoRAStatus.PIN_NAME_NONEXISTENT, f"cannot unpin adapter {name!r}: it is not loaded")
        self.cache.unpin(name)
        return LoRAResult(LoRAStatus.SUCCESS, f"adapter {name!r} unpinned")

    def _ensure_in_host(self, name: str) -> None:
        if name not in self.cache:
            raise KeyError(f"adapter {name!r} is not loaded")
        if not self.cache.in_host(name):
            weights = self._read(name, self._sources[name])  # the disk tier, under the rules it was loaded with
            self._apply(self.cache.add(name))
            self._weights[name] = weights
            self.stats["loads"] += 1

    def _apply(self, changes: Changes) -> None:
        refilled = {u.slot for u in changes.slots if u.adapter is not None}
        self.stats["slot_evictions"] += sum(u.adapter is None and u.slot in refilled for u in changes.slots)
        self.stats["host_evictions"] += len(changes.dropped)
        for name in changes.dropped:
            del self._weights[name]
        for update in changes.slots:
            if update.adapter is None:
                for layer, _ in self._layers.values():
                    layer.clear_slot(update.slot)
            else:
                self._write_slot(update.slot, self._weights[update.adapter])

    def _write_slot(self, slot: int, weights: AdapterWeights) -> None:
        for layer, modules in self._layers.values():
            parts = [weights.modules.get(m) for m in modules]
            layer.write_slot(slot, [None if p is None else (p.a, p.b) for p in parts])

    # ---- queries ---------------------------------------------------------------------------------
    def is_lora(self, name: str) -> bool:
        return name in self.cache

    def is_active_lora(self, name: str) -> bool:
        return self.cache.slot_of(name) is not None

    @property
    def loras(self) -> list[str]:
        return self.cache.names

    @property
    def active_loras(self) -> dict[str, int]:
        return self.cache.active

    @property
    def paths(self) -> dict[str, str | None]:
        """Every loaded adapter's directory (None for adapters added from tensors)."""
        return {name: self._sources[name].path if name in self._sources else None for name in self.cache.names}

    def binding_names(self) -> list[str]:
        """The module names an adapter can carry weights for (PEFT naming, sub-modules of packed layers)."""
        return list(self._bindings)

    def has_weight_for(self, binding: str) -> bool:
        """Whether the adapter selected with switch() has weights for `binding`."""
        if self.active_adapter_name is None:
            return False
        self._ensure_in_host(self.active_adapter_name)
        return binding in self._weights[self.active_adapter_name].modules

    # ---- forward-pass mappings ---------------------------------------------------------------------
    @contextlib.contextmanager
    def batch(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """Within the block, row i of the model's input uses adapters[i] (None = base model)."""
        distinct = [a for a in dict.fromkeys(adapters) if a is not None]
        if len(distinct) > self.config.max_loras:
            raise CacheFullError(f"a batch names {len(distinct)} adapters, above max_loras={self.config.max_loras}")
        with self.using(distinct):
            slots = {name: self.activate_adapter(name) for name in distinct}
            with self.mapping(RowSlots([slots[a] if a is not None else -1 for a in adapters], self._device)):
                yield

    @contextlib.contextmanager
    def using(self, names: Sequence[str]) -> Iterator[None]:
        """Hold in-flight references: none of `names` is evicted or unloaded inside the block."""
        held = []
        try:
            for name in names:
                self.cache.acquire(name)
                held.append(name)
            yield
        finally:
            for name in held:
                self.cache.release(name)

    @contextlib.contextmanager
    def mapping(self, mapping) -> Iterator[None]:
        """Set the LoRA mapping every layer reads (an ops.LoRAMapping, RowSlots or UniformSlot)."""
        previous, self.context.mapping = self.context.mapping, mapping
        try:
            yield
        finally:
            self.context.mapping = previous

    def switch(self, name: str | None) -> None:
        """Single-adapter mode: every row uses `name` until reset(). O(1) when it already has a slot."""
        if name is None:
            return self.reset()
        if name != self.active_adapter_name:
            self.cache.acquire(name)  # held while selected, so its slot is never reused under it
            self.reset()
            self.active_adapter_name = name
        try:
            slot = self.activate_adapter(name)
        except Exception:
            self.reset()
            raise
        self.context.mapping = self._uniform.setdefault(slot, UniformSlot(slot, self._device))

    def reset(self) -> None:
        """Back to the base model for every row."""
        if self.active_adapter_name is not None:
            self.cache.release(self.active_adapter_name)
            self.active_adapter_name = None
        self.context.mapping = None

    @property
    def _device(self) -> torch.device:
        return next(iter(self._layers.values()))[0].lora_a.device
