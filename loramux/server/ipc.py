"""Messages between the HTTP process and the engine process (pickled over ZMQ). No torch.

HTTP -> engine: Generate, Abort, Control.   Engine -> HTTP: Ready, StartupFailed, Outputs,
RequestFailed, ControlResult. Control requests (load, unload, pin, list, stats) are handled between
engine steps, as vLLM's engine core and MAX's process_lora_requests do.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from loramux.sampling_params import SamplingParams


@dataclass(frozen=True)
class Generate:
    request_id: str
    adapter: str | None
    params: SamplingParams
    max_tokens_given: bool  # False: generate up to the model length (chat without max_tokens)
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None  # chat: the engine applies the model's chat template


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Control:
    control_id: int
    op: str  # "load" | "unload" | "pin" | "list" | "stats"
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Ready:
    model_name: str
    max_model_len: int
    adapters: dict  # name -> path of the adapters loaded at start-up


@dataclass(frozen=True)
class StartupFailed:
    message: str


@dataclass(frozen=True)
class Outputs:
    outputs: list[dict]  # RequestOutput fields


@dataclass(frozen=True)
class RequestFailed:
    request_id: str
    message: str
    status_code: int  # the HTTP status the front end answers with


@dataclass(frozen=True)
class ControlResult:
    control_id: int
    result: dict
