"""TensorRT Edge-LLM's switch-mode names for LoRAModel: one adapter for every row until reset (its switchWeights /
resetWeights), the selected adapter's name (getActiveAdapterName) and weights per module (getActiveWeight,
hasWeightFor). A mixin of LoRAModel (adapters/hf_model.py), whose manager, selected identity and uniform mappings
it uses; the core (LoRAManager) speaks its own vocabulary, and this module only translates.
"""
from __future__ import annotations

from loramux.adapters.checkpoint import ModuleLoRA
from loramux.ops import UniformSlot


class SwitchMode:
    """Needs: self.manager (a LoRAManager), self._selected (the AdapterRef switch() selected, or None) and
    self._uniform (slot -> UniformSlot), as LoRAModel sets them."""

    def switch(self, name: str | None) -> None:
        """Single-adapter mode: every row uses `name` until reset(). O(1) when it already has a slot."""
        if name is None:
            return self.reset()
        manager = self.manager
        ref = manager.identity_for(name)
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
