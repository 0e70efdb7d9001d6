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
from loramux.adapters.checkpoint import ModuleLoRA
from loramux.adapters.manager import LoRAManager
from loramux.adapters.names import AdapterRef
from loramux.adapters.status import LoRAResult
from loramux.config import LoRAConfig
from loramux.ops import RowSlots, UniformSlot


class LoRAModel:
    def __init__(self, model: nn.Module, config: LoRAConfig | None = None, backend: str = "auto"):
        self.model = model
        self.manager = LoRAManager(model, config, backend)
        self._selected: AdapterRef | None = None  # the identity switch() selected; held until reset()
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
        refs = {name: manager.resolve(name) for name in distinct}
        with manager.using(list(refs.values())):
            slots = {name: manager.activate(ref) for name, ref in refs.items()}
            for slot in slots.values():  # (on a GPU: the forward waits for the slot writes, on the device)
                manager.slots.copies.wait(slot)
            rows = RowSlots([slots[a] if a is not None else -1 for a in adapters], manager.slots.device)
            with manager.slots.mapping(rows, head=True):
                yield

    def switch(self, name: str | None) -> None:
        """Single-adapter mode: every row uses `name` until reset(). O(1) when it already has a slot."""
        if name is None:
            return self.reset()
        manager = self.manager
        ref = manager.resolve(name)
        if ref != self._selected:
            manager.cache.acquire(ref)  # held while selected, so its slot is never reused under it
            self.reset()
            self._selected = ref
        try:
            slot = manager.activate(ref)
        except Exception:
            self.reset()
            raise
        manager.slots.copies.wait(slot)
        manager.slots.set_mapping(self._uniform.setdefault(slot, UniformSlot(slot, manager.slots.device)))

    def reset(self) -> None:
        """Back to the base model for every row."""
        if self._selected is not None:
            self.manager.cache.release(self._selected)
            self._selected = None
            self.manager.retire()  # an unloaded or replaced adapter's memory goes once it is deselected
        self.manager.slots.set_mapping(None)

    def unload_adapter(self, name: str) -> LoRAResult:
        """As LoRAManager.unload_adapter; the adapter switch() selected is deselected first (the model is
        back on the base model). Inside a batch() block its rows keep it until the block ends."""
        if self._selected is not None and self._selected.name == name:
            self.reset()
        return self.manager.unload_adapter(name)

    @property
    def active_adapter_name(self) -> str | None:
        """The name of the adapter switch() selected (TensorRT Edge-LLM's getActiveAdapterName), or None."""
        return None if self._selected is None else self._selected.name

    def get_active_weight(self, binding: str) -> ModuleLoRA | None:
        """TensorRT Edge-LLM's getActiveWeight: the selected adapter's weights for module `binding` (a PEFT module
        name, e.g. "model.layers.0.self_attn.q_proj"), as ModuleLoRA(a [r, in], b [out, r] with the scaling
        folded in: the update is b @ a), the host copies the slots are written from; None when switch() selected
        no adapter or the selected one has no weights for `binding`."""
        if self._selected is None:
            return None
        return self.manager.store.weights_of(self._selected).modules.get(binding)

    def has_weight_for(self, binding: str) -> bool:
        """Whether the adapter switch() selected has weights for `binding` (a PEFT module name). No side
        effects: it reads what was recorded when the adapter was loaded."""
        if self._selected is None:
            return False
        return binding in self.manager.store.modules_of(self._selected)
