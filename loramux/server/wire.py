"""The messages between the HTTP front end and the engine process: typed msgspec structs, sent as
MessagePack over ZMQ. No torch, and no pickle (a message is data, never code).

front end -> engine: AddRequest, Abort, Control
engine -> front end: Ready, StartupFailed, Outputs, ControlResult

The engine sends each request's new tokens per step (CoreOutput deltas), never cumulative state; the
front end, which tokenized the prompt, keeps the totals. Control requests (load, unload, pin, unpin, list,
stats) are handled between engine steps, as vLLM's engine core and MAX's process_lora_requests do.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

from loramux.engine.output import CoreOutput
from loramux.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Control(msgspec.Struct, tag="control"):
    control_id: int
    op: str  # "load" | "unload" | "pin" | "unpin" | "list" | "stats"
    args: dict[str, Any] = {}


class AdapterSource(msgspec.Struct, array_like=True):
    """An adapter the engine loads at start: after a restart, every adapter the front end had registered."""

    name: str
    path: str
    allowed_dirs: tuple[str, ...] = ()  # runtime loads were read under these; a reload reads under them again
    pinned: bool = False


class Ready(msgspec.Struct, tag="ready"):
    model_name: str
    tokenizer_dir: str  # the engine's tokenizer, saved for the front end (loramux.tokenizer.Tokenizer.from_dir)
    max_model_len: int
    vocab_size: int
    adapters: list[AdapterSource]  # the start-up adapters that loaded
    failed_adapters: dict[str, str] = {}  # name -> why it did not load (a restart after its file went away)


class StartupFailed(msgspec.Struct, tag="startup_failed"):
    message: str


class Outputs(msgspec.Struct, tag="outputs"):
    outputs: list[CoreOutput]


class ControlResult(msgspec.Struct, tag="control_result"):
    control_id: int
    result: dict[str, Any]


ToEngine = Union[AddRequest, Abort, Control]
FromEngine = Union[Ready, StartupFailed, Outputs, ControlResult]

encode = msgspec.msgpack.Encoder().encode
decode_to_engine = msgspec.msgpack.Decoder(ToEngine).decode
decode_from_engine = msgspec.msgpack.Decoder(FromEngine).decode
