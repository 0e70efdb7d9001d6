"""RequestOutput: what a request has produced so far (cumulative), and what is new in this step."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    adapter: str | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while running
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # why an aborted request was aborted

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
