"""LoRA off (EngineConfig.lora None): the adapter system of an engine that serves the base model only.

Null objects answering what LoRAManager, AdapterSlots, AdapterCache and the engine's AdapterLoader answer, the
way an engine without adapters must: no names, no slots, nothing to read, every load refused with one message.
The engine, its scheduler, its model runner and the engine process hold these where they would hold the real
ones, so none of them asks whether LoRA is on.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import Any

from loramux.adapters.cache import Readiness
from loramux.adapters.status import LoRAResult, LoRAStatus

OFF = "this engine was built with lora=None; adapters are off"


def refused(*_args: Any, **_kwargs: Any) -> LoRAResult:
    return LoRAResult(LoRAStatus.LOAD_ERROR, OFF)


class NoSlots:
    """No LoRA layers: no op, no slot writes, every forward the base model's."""

    add_lora = None
    wants_grouped_tokens = False
    needs_eager = False

    class copies:  # noqa: N801 (SlotCopies' answers: every slot ready, nothing to wait for)
        @staticmethod
        def ready(slot: int) -> bool:
            return True

        @staticmethod
        def wait(slot: int) -> None:
            return None

    @staticmethod
    def mapping(mapping, head: bool = False) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def head_mapping(row_slots) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class NoCache:
    """The scheduler's view: no slots, no pins."""

    max_loras = 0
    pinned: frozenset[str] = frozenset()

    @staticmethod
    def want(keys) -> None:
        return None


class NoLoader:
    """Nothing is ever read: every identity is ready (there are none), and a runtime load is refused."""

    busy = False

    @staticmethod
    def readiness(ref, first: bool = False) -> Readiness:
        return Readiness.READY

    @staticmethod
    def install_ready() -> list:
        return []

    @staticmethod
    def wait(timeout_s: float) -> None:
        return None

    @staticmethod
    def read_ahead(*_args: Any) -> None:
        return None

    @staticmethod
    def load(*_args: Any, **_kwargs: Any) -> Future:
        result: Future = Future()
        result.set_result(refused())
        return result


class NoAdapters:
    """LoRAManager's answers with no adapters: a name is unknown, every change refused."""

    slots, cache, loader = NoSlots(), NoCache(), NoLoader()
    loras: list[str] = []
    pinned: list[str] = []
    resident: dict[str, list[str]] = {}
    kept_revisions: dict[str, list[str]] = {}
    stats: dict[str, int] = {}
    slot_bytes = host_bytes = 0
    load_adapter = add_adapter = unload_adapter = pin_adapter = unpin_adapter = deactivate_adapter = staticmethod(refused)

    @staticmethod
    def identity_for(model: str):
        raise LookupError(f"The model `{model}` does not exist (this engine serves the base model only).")

    @staticmethod
    def lookup(model: str) -> None:
        return None

    @staticmethod
    def current(name: str) -> None:
        return None

    @staticmethod
    def activation(ref, prompt) -> int:
        return 0

    @staticmethod
    def is_lora(name: str) -> bool:
        return False

    is_active_lora = is_lora

    def __contains__(self, ref) -> bool:
        return False

    @staticmethod
    def retire() -> None:
        return None

    @staticmethod
    def activate(ref) -> int:
        raise RuntimeError(OFF)

    activate_adapter = activate
