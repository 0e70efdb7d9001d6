"""LoRAModel: a plain HF transformers model with many LoRA adapters, outside the engine.

The engine drives its own model with one LoRAMapping per step; a plain HF model's forward takes only
input_ids, so here the mapping is set around the call: `batch` (row i uses adapter i) or `switch` (every
row one adapter until `reset`: TensorRT Edge-LLM's switch mode, adapters/tensorrt_edge_names.py). RowSlots /
UniformSlot expand a per-row choice to tokens once the forward pass knows the token count. Adapter management
(load, unload, pin, tiers) is the LoRAManager's; this object forwards it (`lora_model.load_adapter(...)`,
`.loras`, ...), and `.manager` is the manager itself.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch import nn

from loramux.adapters.cache import CacheFullError
from loramux.adapters.manager import LoRAManager
from loramux.adapters.names import AdapterRef
from loramux.adapters.status import LoRAResult
from loramux.adapters.tensorrt_edge_names import SwitchMode
from loramux.config import LoRAConfig
from loramux.ops import RowSlots, UniformSlot


class LoRAModel(SwitchMode):
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
        refs = {name: manager.identity_for(name) for name in distinct}
        with manager.using(list(refs.values())):
            slots = {name: manager.activate(ref) for name, ref in refs.items()}
            for slot in slots.values():  # (on a GPU: the forward waits for the slot writes, on the device)
                manager.slots.copies.wait(slot)
            rows = RowSlots([slots[a] if a is not None else -1 for a in adapters], manager.slots.device)
            with manager.slots.mapping(rows, head=True):
                yield

    def unload_adapter(self, name: str) -> LoRAResult:
        """As LoRAManager.unload_adapter; the adapter switch() selected is deselected first (the model is
        back on the base model). Inside a batch() block its rows keep it until the block ends."""
        if self._selected is not None and self._selected.name == name:
            self.reset()
        return self.manager.unload_adapter(name)
