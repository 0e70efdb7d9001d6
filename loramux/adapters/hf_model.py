"""LoRAModel: a plain HF transformers model with many LoRA adapters, outside the engine.

The engine drives its own model with one LoRAMapping per step; a plain HF model's forward takes only
input_ids, so here the mapping is set around the call: `batch` (row i uses adapter i) or `switch` (every
row one adapter until `reset`). RowSlots / UniformSlot expand a per-row choice to tokens once the forward
pass knows the token count. Adapter management (load, unload, pin, tiers) is the LoRAManager's; this
object forwards it (`lora_model.load_adapter(...)`, `.loras`, ...), and `.manager` is the manager itself.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch import nn

from loramux.adapters.cache import CacheFullError
from loramux.adapters.manager import LoRAManager
from loramux.adapters.status import LoRAResult, LoRAStatus
from loramux.config import LoRAConfig
from loramux.ops import RowSlots, UniformSlot


class LoRAModel:
    def __init__(self, model: nn.Module, config: LoRAConfig | None = None, backend: str = "auto"):
        self.model = model
        self.manager = LoRAManager(model, config, backend)
        self.active_adapter_name: str | None = None  # the adapter version switch() selected (a cache key)
        self._uniform: dict[int, UniformSlot] = {}

    def __getattr__(self, name: str):
        """The LoRAManager's adapter API (load_adapter, pin_adapter, loras, cache, ...)."""
        if name == "manager":  # not set yet: __init__ failed half-way
            raise AttributeError(name)
        return getattr(self.manager, name)

    @contextlib.contextmanager
    def batch(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """Within the block, row i of the model's input uses adapters[i] (None = base model)."""
        manager = self.manager
        distinct = [a for a in dict.fromkeys(adapters) if a is not None]
        if len(distinct) > manager.config.max_loras:
            raise CacheFullError(f"a batch names {len(distinct)} adapters, above max_loras={manager.config.max_loras}")
        keys = {name: manager.key_of(name) for name in distinct}
        with manager.using(list(keys.values())):
            slots = {name: manager.activate_key(key) for name, key in keys.items()}
            rows = RowSlots([slots[a] if a is not None else -1 for a in adapters], manager._device)
            with manager.mapping(rows, head=True):
                yield

    def switch(self, name: str | None) -> None:
        """Single-adapter mode: every row uses `name` until reset(). O(1) when it already has a slot."""
        if name is None:
            return self.reset()
        manager = self.manager
        key = manager.key_of(name)
        if key != self.active_adapter_name:
            manager.cache.acquire(key)  # held while selected, so its slot is never reused under it
            self.reset()
            self.active_adapter_name = key
        try:
            slot = manager.activate_key(key)
        except Exception:
            self.reset()
            raise
        manager.context.mapping = manager.head_context.mapping = self._uniform.setdefault(slot, UniformSlot(slot, manager._device))

    def reset(self) -> None:
        """Back to the base model for every row."""
        if self.active_adapter_name is not None:
            self.manager.cache.release(self.active_adapter_name)
            self.active_adapter_name = None
        self.manager.context.mapping = self.manager.head_context.mapping = None

    def unload_adapter(self, name: str) -> LoRAResult:
        """As LoRAManager.unload_adapter; the adapter switch() selected is deselected first (only when
        nothing else uses it: a refused unload changes nothing)."""
        key = self.manager.cache.current(name)
        if key is not None and key == self.active_adapter_name:
            others = self.manager.cache.refs(key) - 1
            if others:
                return LoRAResult(LoRAStatus.UNLOAD_IN_USE, f"adapter {name!r} is used by {others} running request(s)")
            self.reset()
        return self.manager.unload_adapter(name)

    def has_weight_for(self, binding: str) -> bool:
        """Whether the adapter selected with switch() has weights for `binding` (a PEFT module name)."""
        if self.active_adapter_name is None:
            return False
        return binding in self.manager.modules_of(self.active_adapter_name)
