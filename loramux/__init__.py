"""loramux: one base LLM, many LoRA adapters, one batch.

Public names are imported on first use, so `import loramux.adapters.cache` (or the HTTP server) does
not pull in torch.
"""
from __future__ import annotations

import importlib

_PUBLIC = {
    "LLM": "loramux.llm",
    "SamplingParams": "loramux.sampling_params",
    "EngineConfig": "loramux.config",
    "LoRAConfig": "loramux.config",
    "LoRAManager": "loramux.adapters.manager",
    "LoRAModel": "loramux.adapters.hf_model",
    "StructuredOutputsParams": "loramux.sampling_params",
    "LoRAResult": "loramux.adapters.status",
    "LoRAStatus": "loramux.adapters.status",
    "RequestOutput": "loramux.engine.output",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'loramux' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value
