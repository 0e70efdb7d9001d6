"""LoRAStatus / LoRAResult: how an adapter operation ended, and why. Stdlib only, so the HTTP front end
compares statuses as enums, not strings."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class LoRAStatus(enum.Enum):
    SUCCESS = "success"
    LOAD_NAME_EXISTS = "load_name_exists"
    LOAD_INVALID_NAME = "load_invalid_name"
    LOAD_INVALID_PATH = "load_invalid_path"
    LOAD_INVALID_ADAPTER = "load_invalid_adapter"
    LOAD_ERROR = "load_error"
    LOAD_BUSY = "load_busy"  # no room now (requests in use hold it); the same load or pin succeeds once they finish
    UNLOAD_NAME_NONEXISTENT = "unload_name_nonexistent"
    PIN_NAME_NONEXISTENT = "pin_name_nonexistent"
    PIN_ERROR = "pin_error"


@dataclass(frozen=True)
class LoRAResult:
    """A LoRAStatus with its human reason. Compares equal to its status: `result == LoRAStatus.SUCCESS`."""

    status: LoRAStatus
    message: str = ""
    revision: str = ""
    """A successful load's identity as users see it, name@rev (AdapterRef.revision): the revision requests for
    the name run on from now, addressable as such while it is kept."""

    def __eq__(self, other) -> bool:
        if isinstance(other, LoRAStatus):
            return self.status is other
        return isinstance(other, LoRAResult) and (self.status, self.message) == (other.status, other.message)

    def __hash__(self) -> int:
        return hash(self.status)

    def __bool__(self) -> bool:
        return self.status is LoRAStatus.SUCCESS

    def __str__(self) -> str:
        return f"{self.status.name}: {self.message}" if self.message else self.status.name
