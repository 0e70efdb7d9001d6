"""loramux: one base LLM, many LoRA adapters, one batch."""
from loramux.adapters.manager import LoRAManager, LoRAResult, LoRAStatus
from loramux.config import LoRAConfig

__all__ = ["LoRAConfig", "LoRAManager", "LoRAResult", "LoRAStatus"]
