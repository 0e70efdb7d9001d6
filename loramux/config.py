"""Frozen configuration objects. Stdlib only: the scheduler and the server read these too."""
from __future__ import annotations

from dataclasses import dataclass

# The seven Llama-family projections PEFT users target most; names as in HF transformers.
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """How many adapters live where, and how large they may be."""

    max_loras: int = 4
    """Device slots: the most distinct adapters one forward pass (one engine step) can use."""
    max_cpu_loras: int = 16
    """Host tier: adapters kept in host memory (LRU). Evicted ones are reloaded from disk on use."""
    max_lora_rank: int = 64
    """Slot buffers are padded to this rank; adapters of higher rank are refused at load."""
    target_modules: tuple[str, ...] | None = None
    """Module-name suffixes to wrap with LoRA layers; None = DEFAULT_TARGET_MODULES."""
    allow_pickle: bool = False
    """Read `adapter_model.bin` (with torch.load(weights_only=True)); off by default."""

    def __post_init__(self) -> None:
        _check_positive("max_loras", self.max_loras)
        _check_positive("max_cpu_loras", self.max_cpu_loras)
        _check_positive("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                "every adapter in a device slot is also kept in host memory"
            )
        if self.target_modules is not None:
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
            if not self.target_modules:
                raise ValueError("target_modules must name at least one module, or be None")

    @property
    def targets(self) -> tuple[str, ...]:
        return self.target_modules or DEFAULT_TARGET_MODULES
