"""vLLM's LoRA model manager names (LoRAModelManager and its LRU subclass) over a LoRAManager, for code written
against vLLM's manager: `manager.vllm.remove_adapter(name)`. Keyed by adapter name where vLLM keys by its int
id, and answering as vLLM's do (bools where vLLM returns bools). The core (LoRAManager) speaks one vocabulary:
the one its engine uses (load_adapter / unload_adapter / pin_adapter / activate_adapter by name, LoRAResult
answers); this module only translates.
"""
from __future__ import annotations

from loramux.adapters.names import AdapterRef


class VLLMNames:
    def __init__(self, manager):
        """manager: the LoRAManager it translates for (which makes it: LoRAManager.vllm)."""
        self.manager = manager

    def add_adapter(self, name: str, tensors: dict, peft_config: dict) -> bool:
        """An adapter from in-memory PEFT tensors and config (LoRAManager.add_adapter); whether it was added."""
        return bool(self.manager.add_adapter(name, tensors, peft_config))

    def activate_adapter(self, name: str) -> bool:
        """Into a device slot; False if it already held one (vLLM: whether it was newly activated)."""
        was_active = self.manager.is_active_lora(name)
        self.manager.activate_adapter(name)
        return not was_active

    def deactivate_adapter(self, name: str) -> bool:
        """Out of its slot (it stays loaded); whether it held one."""
        was_active = self.manager.is_active_lora(name)
        self.manager.deactivate_adapter(name)
        return was_active

    def pin_adapter(self, name: str) -> bool:
        return bool(self.manager.pin_adapter(name))

    def remove_adapter(self, name: str) -> bool:
        """Unload it; True if it was loaded."""
        return bool(self.manager.unload_adapter(name))

    def remove_all_adapters(self) -> None:
        """Unload every adapter (each goes after the requests running on it)."""
        for name in self.manager.loras:
            self.manager.unload_adapter(name)

    def remove_oldest_adapter(self) -> bool:
        """The LRU manager's: the least recently used adapter that may leave host memory (not pinned, not in use,
        with a disk copy) leaves it and its slot; its name stays and it is read back on next use. False if none
        could go."""
        return self.manager.store.evict_oldest()

    def list_adapters(self) -> dict[str, AdapterRef]:
        """name -> the identity (load) requests for it start on now."""
        return {name: self.manager.current(name) for name in self.manager.loras}

    def get_adapter(self, name: str) -> AdapterRef | None:
        return self.manager.current(name)

    def __len__(self) -> int:
        """How many adapters are loaded (named), in host memory or not."""
        return len(self.manager.loras)

    @property
    def capacity(self) -> int:
        """Adapters host memory holds at most (max_cpu_loras; max_cpu_lora_bytes may hold fewer)."""
        return self.manager.config.max_cpu_loras

    @property
    def lora_slots(self) -> int:
        """Device slots (max_loras)."""
        return self.manager.config.max_loras

    adapter_slots = lora_slots
