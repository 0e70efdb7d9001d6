"""The messages between the HTTP front end and the engine process: typed msgspec structs, sent as
MessagePack over ZMQ. No torch, and no pickle (a message is data, never code).

front end -> engine: AddRequest, Abort; control: LoadAdapter, UnloadAdapter, PinAdapter, GetStats,
ResetPrefixCache, Pause, Resume
engine -> front end: Ready, StartupFailed, Outputs; control answers: AdapterResult, EngineStats,
PrefixCacheReset, PauseState, ControlFailed

The engine sends each request's new tokens per step (CoreOutput deltas), never cumulative state; the
front end, which tokenized the prompt, keeps the totals. Control requests are handled between engine steps,
as vLLM's engine core and MAX's process_lora_requests do; each carries a control_id that its answer repeats.
"""
from __future__ import annotations

from typing import Literal, Union

import msgspec

from loramux.adapters.status import LoRAStatus
from loramux.engine.output import CoreOutput
from loramux.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    tenant: str | None = None  # engine.fair_queue.Origin's fields: its tenant's own prefix cache ...
    share: str | None = None  # ... and whose fair share of admissions it takes (a tenant, or a client's digest)
    weight: float = 1.0


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class LoadAdapter(msgspec.Struct, tag="load_adapter"):
    """Runtime loads read safetensors only; the name is never parsed as "name=path"."""

    control_id: int
    name: str
    path: str
    allowed_dirs: tuple[str, ...] = ()  # every file read, now and on a reload from disk, resolves inside one
    pinned: bool = False
    replace: bool = False  # vLLM's load_inplace
    read_ahead: bool = True  # its files start being read as it arrives (False: the front end expects no read)


class UnloadAdapter(msgspec.Struct, tag="unload_adapter"):
    """Answered once the adapter's memory is free: after the requests that started on it finish."""

    control_id: int
    name: str


class PinAdapter(msgspec.Struct, tag="pin_adapter"):
    control_id: int
    name: str
    pinned: bool  # False: unpin


class GetStats(msgspec.Struct, tag="get_stats"):
    control_id: int


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache"):
    control_id: int


class PrefixCacheReset(msgspec.Struct, tag="prefix_cache_reset"):
    control_id: int
    num_blocks: int  # cached blocks forgotten


PauseMode = Literal["abort", "wait", "keep"]


class Pause(msgspec.Struct, tag="pause"):
    """vLLM's /pause: the engine stops stepping. What happens to the requests in flight: "abort", they end now
    (finish_reason "abort", with what they had generated); "wait", they run to their end first (the answer
    comes then); "keep", they stay where they are, their K/V and adapters held, and go on at Resume.
    Requests that arrive while the engine is paused or pausing are held until Resume; adapter admin goes on.
    clear_cache: once paused, forget the cached prefix blocks (as ResetPrefixCache; running requests keep theirs)."""

    control_id: int
    mode: PauseMode = "abort"
    clear_cache: bool = True


class Resume(msgspec.Struct, tag="resume"):
    control_id: int


class PauseState(msgspec.Struct, tag="pause_state"):
    """The answer to Pause and Resume: whether the engine is paused now (False for a Pause(wait) that a
    Resume overtook)."""

    control_id: int
    paused: bool


class AdapterRecord(msgspec.Struct, array_like=True):
    """One registered adapter, the one record of it everywhere: what the engine loads at start (after a restart,
    every adapter the front end had registered), the front end's registry, and the Ray Serve registry that the
    ingress and the replicas follow."""

    name: str
    path: str
    allowed_dirs: tuple[str, ...] | None = ()
    """Where its files must resolve: () anywhere (--lora-modules); the directories a runtime load or a resolver
    read it under (a reload reads under them again); None, on Ray, --allowed-adapter-dir (an admin load)."""
    pinned: bool = False
    resolved: bool = False  # loaded on its first request (server/http/on_demand.py): after a restart, on the next one
    uri: str = ""  # fetched from a store (adapters/remote.py) into `path`, the local cache's copy
    version: int = 0  # on Ray: grows with every registration of the name (a reload in place), which replicas follow


class Ready(msgspec.Struct, tag="ready"):
    model_name: str
    tokenizer_dir: str  # the engine's tokenizer, saved for the front end (loramux.tokenizer.Tokenizer.from_dir)
    max_model_len: int
    vocab_size: int
    adapters: list[AdapterRecord]  # the start-up adapters that loaded
    failed_adapters: dict[str, str] = {}  # name -> why it did not load (a restart after its file went away)
    eos_token_ids: list[int] = []  # the model's end tokens (the front end's grammar checks compile with them)
    priority_scheduling: bool = False  # EngineLimits.priority_scheduling
    load_seconds: dict[str, float] = {}  # how long each start-up adapter that loaded took (loramux:lora_load_seconds)


class StartupFailed(msgspec.Struct, tag="startup_failed"):
    message: str


class Outputs(msgspec.Struct, tag="outputs"):
    outputs: list[CoreOutput]


class AdapterResult(msgspec.Struct, tag="adapter_result"):
    """The answer to LoadAdapter / UnloadAdapter / PinAdapter: the adapter API's LoRAResult, and whether the
    adapter is pinned now (a reload in place keeps the pin of the adapter it replaces)."""

    control_id: int
    status: LoRAStatus
    message: str = ""
    pinned: bool = False
    revision: str = ""  # a load's name@rev (LoRAResult.revision)


class SpecDecodeStats(msgspec.Struct):
    """Speculative decoding's counters (engine/speculative.py SpecStats), as vLLM's spec_decode metrics."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]
    by_adapter: dict[str, list[int]]  # adapter name ("" for the base model) -> [draft tokens, accepted]


class EngineStats(msgspec.Struct, tag="engine_stats"):
    """The engine's state for /metrics."""

    control_id: int
    num_running: int
    num_waiting: int
    running_adapters: list[str]  # names, as vLLM's lora_requests_info lists them
    waiting_adapters: list[str]
    max_loras: int
    num_adapters: int
    pinned: list[str]
    lora_loads: int  # adapter reads from disk (first loads and reloads after host eviction)
    lora_host_evictions: int
    lora_slot_evictions: int
    kv_blocks_total: int
    kv_blocks_free: int
    weight_bytes: int
    lora_slot_bytes: int
    lora_host_bytes: int
    finished: dict[str, int]  # finish reason -> requests
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # and found there
    paused: bool = False  # Pause: no step runs until Resume
    resident: dict[str, list[str]] = {}  # tier ("host", "device") -> adapter names there (LoRAManager.resident)
    revisions: dict[str, list[str]] = {}  # name -> its earlier revisions still addressable, name@rev, oldest first
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counters (None: off)


class ControlFailed(msgspec.Struct, tag="control_failed"):
    """A control request raised in the engine (a bug, reported rather than fatal)."""

    control_id: int
    message: str


Control = Union[LoadAdapter, UnloadAdapter, PinAdapter, GetStats, ResetPrefixCache, Pause, Resume]
ControlAnswer = Union[AdapterResult, EngineStats, PrefixCacheReset, PauseState, ControlFailed]
ToEngine = Union[AddRequest, Abort, Control]
FromEngine = Union[Ready, StartupFailed, Outputs, ControlAnswer]

encode = msgspec.msgpack.Encoder().encode
decode_to_engine = msgspec.msgpack.Decoder(ToEngine).decode
decode_from_engine = msgspec.msgpack.Decoder(FromEngine).decode
