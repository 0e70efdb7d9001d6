"""LoRAManager: the public adapter API over one model.

It wraps the model's target Linear modules in LoRALinear layers, keeps adapters' host copies, asks the
AdapterCache where each adapter should live and carries out its answers (copying weights into device
slots, clearing slots, dropping host copies). Every load/unload/pin reports a LoRAResult whose status
is a LoRAStatus and whose message says why, for users (the HTTP server shows it as is).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from loramux.adapters.cache import AdapterCache, CacheFullError, Changes, name_of
from loramux.adapters.checkpoint import AdapterPathError, AdapterWeights, build_adapter, read_adapter_dir
from loramux.adapters.names import InvalidAdapterNameError, check_adapter_name, parse_adapter_arg
from loramux.adapters.peft_config import InvalidAdapterError
from loramux.adapters.status import LoRAResult, LoRAStatus
from loramux.config import LoRAConfig
from loramux.layers import DirectCall
from loramux.layers.lora import LoRAContext, LoRAEmbedding, LoRAExperts, LoRAHead, LoRALinear, PackedLoRALinear
from loramux.layers.quantized import QuantizedEmbedding, QuantizedLinear
from loramux.models.moe import FusedExperts
from loramux.ops import LoRAMapping, select_backend, wants_grouped_tokens

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


def _plain_weight(module: nn.Module) -> torch.Tensor:
    """An embedding's or head's weight as plain values ([vocab, hidden]; a quantized one decoded)."""
    if isinstance(module, (QuantizedEmbedding, QuantizedLinear)):
        from loramux.ops.quant_torch import dequantize

        weights = [module.qweight] if isinstance(module, QuantizedEmbedding) else module.weights
        return torch.cat([dequantize(w) for w in weights])
    return module.weight


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig | None = None, backend: str = "auto",
                 cache: AdapterCache | None = None):
        """cache: the AdapterCache that decides where adapters live (an engine shares it with its scheduler);
        None = a new one sized by `config`."""
        self.model = model
        self.config = config or LoRAConfig()
        self.context = LoRAContext()  # the forward pass's tokens
        self.head_context = LoRAContext()  # the rows whose logits are computed (the output head's LoRA)
        self._base_weights: dict[str, torch.Tensor] = {}  # wrapped embedding / head -> its plain weight
        sizes = (self.config.max_loras, self.config.max_cpu_loras, self.config.max_cpu_lora_bytes)
        self.cache = cache or AdapterCache(*sizes)
        if (self.cache.max_loras, self.cache.max_cpu_loras, self.cache.max_cpu_bytes) != sizes:
            raise ValueError(f"the AdapterCache holds {self.cache.max_loras} slots / {self.cache.max_cpu_loras} host "
                             f"adapters / {self.cache.max_cpu_bytes} host bytes but the LoRAConfig says "
                             f"{' / '.join(map(str, sizes))}")
        self._add_lora = select_backend(backend, next(model.parameters()).device)
        self.wants_grouped_tokens = wants_grouped_tokens(self._add_lora)  # see ModelRunner.run
        self._layers: dict[str, tuple[LoRALinear, tuple[str, ...]]] = {}  # layer name -> (layer, module names)
        self._bindings: dict[str, _Binding] = {}
        self._wrap_targets()
        self._weights: dict[str, AdapterWeights] = {}  # host tier
        self._sources: dict[str, _Source] = {}  # disk tier: name -> where to read it again
        self._copies_bytes: dict[str, int] = {}  # adapter key -> bytes of its whole-module copies, any tier
        self.waiting_keys: Callable[[], set[str]] = set  # see retire()
        # Counters for metrics: disk reads (first loads and reloads), and adapters pushed out of a tier.
        self.stats = {"loads": 0, "host_evictions": 0, "slot_evictions": 0}

    # ---- wrapping --------------------------------------------------------------------------------
    def _wrap_targets(self) -> None:
        packed = getattr(self.model, "packed_modules_mapping", {})
        targets = set(self.config.targets)
        found = []
        linear = set()  # what PEFT's "all-linear" stands for here: every Linear but the output head
        self.unwrapped_experts: dict[str, tuple[int, int, int]] = {}  # MoE blocks left without expert LoRA
        for name, module in self.model.named_modules():
            attr = name.rsplit(".", 1)[-1]
            if isinstance(module, FusedExperts) and "experts" not in targets:
                self.unwrapped_experts[name] = (module.num_experts, module.hidden_size, module.intermediate_size)
            if isinstance(module, (nn.Linear, QuantizedLinear, LoRALinear)) and attr not in _OUTPUT_HEADS:
                linear.update(packed.get(attr, (attr,)))
            if not isinstance(module, (nn.Linear, QuantizedLinear, nn.Embedding, QuantizedEmbedding, FusedExperts)):
                continue  # a LoRA layer is none of these, so nothing is wrapped twice
            if attr in targets or targets & set(packed.get(attr, ())):
                found.append((name, module, packed.get(attr)))
        if not found:
            raise ValueError(f"no Linear module of the model matches target_modules {sorted(targets)}")
        for name, module, sub_names in found:
            self._wrap(name, module, sub_names)
        self.all_linear = tuple(sorted(linear))
        self.wraps_head = any(isinstance(layer, LoRAHead) for layer, _ in self._layers.values())

    def _wrap(self, name: str, base: nn.Module, sub_names: Sequence[str] | None) -> None:
        prefix, _, attr = name.rpartition(".")
        lora_dtype = None if self.config.lora_dtype == "auto" else getattr(torch, self.config.lora_dtype)
        kw = dict(max_loras=self.config.max_loras, max_rank=self.config.max_lora_rank, context=self.context,
                  add_lora=self._add_lora, dtype=lora_dtype)
        if isinstance(base, (nn.Embedding, QuantizedEmbedding)) or attr in _OUTPUT_HEADS:
            self._base_weights[name] = _plain_weight(base)  # (before prepacking) for adapters' copies of it
        if isinstance(base, FusedExperts):  # an MoE block's experts: one layer, both 3D weights
            layer = LoRAExperts(base, self.config.max_loras, self.config.max_lora_rank, self.context)
            modules = (f"{name}.gate_up_proj", f"{name}.down_proj")
        elif isinstance(base, (nn.Embedding, QuantizedEmbedding)):
            layer, modules = LoRAEmbedding(base, self.config.max_loras, self.config.max_lora_rank, self.context), (name,)
        elif attr in _OUTPUT_HEADS:  # its rows are the ones whose logits are computed: a context of its own
            layer, modules = LoRAHead(base, **{**kw, "context": self.head_context}), (name,)
        elif sub_names:
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
        if isinstance(layer, LoRALinear):  # called by the engine's own modules: no hook dispatch either
            layer.direct_call = isinstance(parent, DirectCall)
        self._layers[name] = (layer, modules)
        for i, module in enumerate(modules):
            self._bindings[module] = _Binding(layer, i)

    @property
    def slot_bytes(self) -> int:
        """Bytes of the LoRA layers' slot buffers, allocated for max_loras x max_lora_rank at start."""
        return sum(buffer.nbytes for layer, _ in self._layers.values() for buffer in layer.buffers())

    def _module_shapes(self) -> dict[str, tuple[int, int]]:
        return {m: (b.layer.in_features, b.layer.output_slices[b.slice_index]) for m, b in self._bindings.items()
                if not isinstance(b.layer, LoRAExperts)}

    def _expert_shapes(self) -> dict[str, tuple[int, int, int]]:
        """MoE blocks with expert LoRA: block name -> (experts, hidden, one expert's intermediate size)."""
        return {name: layer.shape for name, (layer, _) in self._layers.items() if isinstance(layer, LoRAExperts)}

    def _max_weight_bytes(self) -> int:
        """The most bytes a weights file of a servable adapter can need: every wrapped module at max rank in
        fp32, and whole copies of a wrapped embedding / head (PEFT's save_embedding_layers and modules_to_save:
        two each), with room for a header and for weights of modules PEFT would ignore (x2)."""
        rank = self.config.max_lora_rank
        lora = sum(4 * rank * (i + o) for i, o in self._module_shapes().values())
        experts = [*self._expert_shapes().values(), *self.unwrapped_experts.values()]  # (refused by what they hold)
        lora += sum(4 * rank * e * (4 * h + 3 * i) for e, h, i in experts)
        whole = sum(2 * 4 * w.numel() for w in self._base_weights.values())
        return 2 * (lora + whole) + (1 << 20)

    # ---- loading ---------------------------------------------------------------------------------
    def load_adapter(self, spec: str, path: str | None = None, allow_pickle: bool | None = None,
                     allowed_dirs: Sequence[str] = (), replace: bool = False, pinned: bool = False) -> LoRAResult:
        """Load a PEFT adapter directory: `load_adapter("name=path")`, a bare path (named after itself), or
        `load_adapter(name, path)` (the name is never parsed). allowed_dirs: every file read, now and on a
        reload from disk, must resolve inside one of them. allow_pickle: None = LoRAConfig.allow_pickle.
        replace: an adapter of that name is reloaded in place (vLLM's load_inplace): new requests get the
        new weights at once, running ones finish on the old (see AdapterCache, versions); a pinned adapter
        stays pinned. pinned: pin it too (pin_adapter); if that fails, nothing is loaded or replaced."""
        try:
            name, path = (check_adapter_name(spec), path) if path is not None else parse_adapter_arg(spec)
        except InvalidAdapterNameError as e:
            return LoRAResult(LoRAStatus.LOAD_INVALID_NAME, str(e))
        except ValueError as e:
            return LoRAResult(LoRAStatus.LOAD_INVALID_PATH, str(e))
        exists = self.cache.current(name) is not None
        if exists and not replace:
            return LoRAResult(LoRAStatus.LOAD_NAME_EXISTS, f"an adapter named {name!r} is already loaded")
        allow = self.config.allow_pickle if allow_pickle is None else allow_pickle
        source = _Source(path, allow, tuple(allowed_dirs))
        key = self.cache.new_version(name) if exists else name
        result = self._guarded_load(key, lambda: self._read(key, source), source)
        old = self.cache.current(name) if exists else None
        if result and (pinned or (old is not None and self.cache.is_pinned(old))):
            result = self._pin_or_drop(key, old)
        if result and exists:
            self.cache.publish(key)
            self.retire()  # the old version goes now if nothing uses it
            return LoRAResult(LoRAStatus.SUCCESS, f"adapter {name!r} reloaded in place")
        return result

    def _pin_or_drop(self, key: str, old: str | None) -> LoRAResult:
        """Pin a just-loaded version (taking over the pin of the version it replaces), or remove it again
        and leave everything as it was."""
        old_pinned = old is not None and self.cache.is_pinned(old)
        if old_pinned:
            self.cache.unpin(old)  # its slot may go to the new version (unless running requests hold it)
        try:
            self._apply(self.cache.pin(key))
        except CacheFullError:
            self._apply(self.cache.remove(key))
            self._forget(key)
            if old_pinned:
                self._apply(self.cache.pin(old))  # still in its slot: nothing moves
            return LoRAResult(LoRAStatus.PIN_ERROR, f"cannot pin adapter {name_of(key)!r}: all max_loras="
                              f"{self.config.max_loras} device slots hold pinned or in-use adapters; it was not loaded")
        return LoRAResult(LoRAStatus.SUCCESS, f"adapter {name_of(key)!r} loaded and pinned")

    def add_adapter(self, name: str, tensors: dict[str, torch.Tensor], peft_config: dict) -> LoRAResult:
        """Register an adapter from in-memory PEFT tensors and config (no I/O; it has no disk copy)."""
        try:
            check_adapter_name(name)
        except InvalidAdapterNameError as e:
            return LoRAResult(LoRAStatus.LOAD_INVALID_NAME, str(e))
        if self.cache.current(name) is not None:
            return LoRAResult(LoRAStatus.LOAD_NAME_EXISTS, f"an adapter named {name!r} is already loaded")
        return self._guarded_load(name, lambda: self._build(name, peft_config, tensors, None), None)

    def _guarded_load(self, key: str, read, source: _Source | None) -> LoRAResult:
        """Read and register one adapter version under `key`; every failure becomes a LoRAResult."""
        name = name_of(key)
        try:
            weights = read()
            self._check_copies_budget(name, weights)
            self._apply(self.cache.add(key, on_disk=source is not None, nbytes=weights.nbytes))
        except AdapterPathError as e:
            return LoRAResult(LoRAStatus.LOAD_INVALID_PATH, str(e))
        except InvalidAdapterError as e:
            return LoRAResult(LoRAStatus.LOAD_INVALID_ADAPTER, str(e))
        except CacheFullError as e:
            return LoRAResult(LoRAStatus.LOAD_ERROR, str(e))
        except Exception as e:  # a broken adapter must never take the caller down
            logger.exception("loading adapter %r failed", name)
            return LoRAResult(LoRAStatus.LOAD_ERROR, f"loading adapter {name!r} failed: {type(e).__name__}: {e}")
        self._weights[key] = weights
        self._copies_bytes[key] = weights.copies_nbytes
        self.stats["loads"] += 1
        if source is not None:
            self._sources[key] = source
        return LoRAResult(LoRAStatus.SUCCESS, f"adapter {name!r} loaded")

    def _read(self, key: str, source: _Source) -> AdapterWeights:
        config, tensors = read_adapter_dir(source.path, source.allow_pickle, source.allowed_dirs,
                                           self._max_weight_bytes())
        return self._build(name_of(key), config, tensors, source.path)

    def _build(self, name, config, tensors, path) -> AdapterWeights:
        # the activations' dtype: whole copies and expert LoRA stay in it; bf16 slots (lora_dtype) round on copy
        layer = next(iter(self._layers.values()))[0]
        dtype = getattr(layer, "activation_dtype", self._slot_buffer.dtype)
        copies = self.config.max_module_copies_bytes > 0  # (base copies of save_embedding_layers are checked anyway)
        weights = build_adapter(name, config, tensors, self._module_shapes(), self.config.max_lora_rank,
                                dtype=dtype, path=path, all_linear=self.all_linear,
                                base_weight=self._base_weights.get, whole_copies=copies, experts=self._expert_shapes(),
                                unwrapped_experts=frozenset(self.unwrapped_experts))
        return weights.pinned() if self._device.type == "cuda" else weights

    def _check_copies_budget(self, name: str, weights: AdapterWeights) -> None:
        """Every loaded adapter's whole-module copies, in host memory or evicted to disk, fit the budget together
        (checked when an adapter is loaded, not when an evicted one comes back)."""
        held = sum(nbytes for key, nbytes in self._copies_bytes.items() if name_of(key) != name)
        if weights.copies and held + weights.copies_nbytes > self.config.max_module_copies_bytes:
            raise InvalidAdapterError(
                f"adapter {name!r} saves whole modules ({', '.join(weights.copies)}: {weights.copies_nbytes} bytes); "
                f"with the {held} bytes other adapters' copies take, that is over max_module_copies_bytes="
                f"{self.config.max_module_copies_bytes}")

    def unload_adapter(self, name: str) -> LoRAResult:
        """Forget the adapter: frees its host copy and its slot. Refused while requests use it. (Replaced
        versions still in use go when their requests finish: `retire`.)"""
        key = self.cache.current(name)
        if key is None:
            return LoRAResult(LoRAStatus.UNLOAD_NAME_NONEXISTENT, f"no adapter named {name!r} is loaded")
        if self.cache.refs(key):  # before any change: a refused unload changes nothing
            return LoRAResult(LoRAStatus.UNLOAD_IN_USE, f"adapter {name!r} is used by {self.cache.refs(key)} running "
                                                        "request(s)")
        self._apply(self.cache.remove(key))
        self._forget(key)
        return LoRAResult(LoRAStatus.SUCCESS, f"adapter {name!r} unloaded")

    def retire(self) -> None:
        """Remove replaced adapter versions nothing uses any more: no reference, and not among
        `waiting_keys()` (an engine sets that hook: versions its preempted requests will resume on)."""
        if self.cache.retiring:
            changes = self.cache.retire(self.waiting_keys())
            for key in changes.dropped:
                self._forget(key)
            self._apply(changes)

    def _forget(self, key: str) -> None:
        """`key` left the cache for good: its disk path and its copies' share of the budget go too."""
        self._sources.pop(key, None)
        self._copies_bytes.pop(key, None)

    # ---- tiers -----------------------------------------------------------------------------------
    def key_of(self, name: str) -> str:
        """The key of the version of `name` new requests get (KeyError if no adapter has that name)."""
        key = self.cache.current(name)
        if key is None:
            raise KeyError(f"adapter {name!r} is not loaded")
        return key

    def activate_adapter(self, name: str) -> int:
        """Put the adapter in a device slot (reloading it from disk if it left host memory); its slot."""
        return self.activate_key(self.key_of(name))

    def activate_key(self, key: str) -> int:
        """activate_adapter for one version (the engine activates what its requests resolved to)."""
        self._ensure_in_host(key)
        slot, changes = self.cache.activate(key)
        self._apply(changes)
        return slot

    def deactivate_adapter(self, name: str) -> None:
        self._apply(self.cache.deactivate(self.key_of(name)))

    def pin_adapter(self, name: str) -> LoRAResult:
        """Keep the adapter in host memory and in a device slot until it is unpinned or unloaded."""
        key = self.cache.current(name)
        if key is None:
            return LoRAResult(LoRAStatus.PIN_NAME_NONEXISTENT, f"cannot pin adapter {name!r}: it is not loaded")
        try:
            self._ensure_in_host(key)
            self._apply(self.cache.pin(key))
        except (CacheFullError, InvalidAdapterError, AdapterPathError) as e:
            return LoRAResult(LoRAStatus.PIN_ERROR, str(e))
        return LoRAResult(LoRAStatus.SUCCESS, f"adapter {name!r} pinned")

    def unpin_adapter(self, name: str) -> LoRAResult:
        """Let the adapter be evicted again (it stays loaded, and in its slot until the LRU needs it)."""
        key = self.cache.current(name)
        if key is None:
            return LoRAResult(LoRAStatus.PIN_NAME_NONEXISTENT, f"cannot unpin adapter {name!r}: it is not loaded")
        self.cache.unpin(key)
        return LoRAResult(LoRAStatus.SUCCESS, f"adapter {name!r} unpinned")

    def _ensure_in_host(self, key: str) -> None:
        if key not in self.cache:
            raise KeyError(f"adapter {name_of(key)!r} is not loaded")
        if not self.cache.in_host(key):
            weights = self._read(key, self._sources[key])  # the disk tier, under the rules it was loaded with
            self._apply(self.cache.add(key))
            self._weights[key] = weights
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
            if isinstance(layer, (LoRAHead, LoRAEmbedding)):
                layer.set_copy(slot, weights.copies.get(modules[0]))

    # ---- queries ---------------------------------------------------------------------------------
    def is_lora(self, name: str) -> bool:
        return self.cache.current(name) is not None

    def is_active_lora(self, name: str) -> bool:
        key = self.cache.current(name)
        return key is not None and self.cache.slot_of(key) is not None

    @property
    def loras(self) -> list[str]:
        return self.cache.names

    @property
    def active_loras(self) -> dict[str, int]:
        """name -> device slot of the adapters whose current version holds one."""
        return {name_of(key): slot for key, slot in self.cache.active.items() if self.cache.current(name_of(key)) == key}

    @property
    def paths(self) -> dict[str, str | None]:
        """Every loaded adapter's directory (None for adapters added from tensors)."""
        sources = {name: self._sources.get(self.cache.current(name)) for name in self.cache.names}
        return {name: source.path if source else None for name, source in sources.items()}

    def binding_names(self) -> list[str]:
        """The module names an adapter can carry weights for (PEFT naming, sub-modules of packed layers)."""
        return list(self._bindings)

    def modules_of(self, key: str) -> set[str]:
        """The module names adapter version `key` has weights for (read back into host memory if evicted)."""
        self._ensure_in_host(key)
        return set(self._weights[key].modules)

    # ---- forward-pass mappings ---------------------------------------------------------------------
    @contextlib.contextmanager
    def using(self, keys: Sequence[str]) -> Iterator[None]:
        """Hold in-flight references: none of these adapter versions is evicted or unloaded in the block."""
        held = []
        try:
            for key in keys:
                self.cache.acquire(key)
                held.append(key)
            yield
        finally:
            for key in held:
                self.cache.release(key)

    @contextlib.contextmanager
    def mapping(self, mapping, head: bool = False) -> Iterator[None]:
        """Set the LoRA mapping every layer reads (an ops.LoRAMapping; LoRAModel's RowSlots or UniformSlot);
        head: the output head's too (an HF model computes the logits of every token it is given; the engine
        sets the head's rows itself, head_mapping)."""
        contexts = [self.context] + ([self.head_context] if head else [])
        previous = [c.mapping for c in contexts]
        for c in contexts:
            c.mapping = mapping
        try:
            yield
        finally:
            for c, p in zip(contexts, previous):
                c.mapping = p

    @contextlib.contextmanager
    def head_mapping(self, row_slots: Sequence[int]) -> Iterator[None]:
        """The slot of each row whose logits are computed next, for a LoRA output head (when it is wrapped)."""
        if not self.wraps_head or all(s < 0 for s in row_slots):
            yield
            return
        previous, self.head_context.mapping = self.head_context.mapping, LoRAMapping.from_slots(row_slots, self._device)
        try:
            yield
        finally:
            self.head_context.mapping = previous

    @property
    def _slot_buffer(self) -> torch.Tensor:
        """A LoRA layer's slot buffer: every layer's share its dtype and device."""
        return next(next(iter(self._layers.values()))[0].buffers())

    @property
    def _device(self) -> torch.device:
        return self._slot_buffer.device
