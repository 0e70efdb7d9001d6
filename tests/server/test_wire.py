"""The wire format between the front end and the engine: every message type round-trips, and nothing but
the declared types decodes."""
import msgspec
import pytest

from loramux.adapters.status import LoRAStatus
from loramux.engine.output import CoreOutput
from loramux.sampling_params import SamplingParams
from loramux.server.engine.wire import (Abort, AddRequest, AdapterResult, AdapterRecord, ControlFailed, EngineStats, GetStats,
                                 LoadAdapter, Outputs, PinAdapter, Ready, StartupFailed, UnloadAdapter,
                                 decode_from_engine, decode_to_engine, encode)

TO_ENGINE = [
    AddRequest("r-1", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.3, seed=-2**63, stop=("x", "yz"),
                                                  stop_token_ids=(7,), top_k=4, presence_penalty=-1.5), "pirate"),
    AddRequest("r-2", [9], SamplingParams(), None),
    Abort(["r-1", "r-2"]),
    LoadAdapter(3, "a", "/p", ("/d",), pinned=True, replace=True),
    UnloadAdapter(4, "a"),
    PinAdapter(5, "a", False),
    GetStats(6),
]
FROM_ENGINE = [
    Ready("/models/m", "/tmp/tok", 4096, 49152, [AdapterRecord("a", "/p", ("/d",), True)], {"b": "gone"}),
    StartupFailed("ValueError: no"),
    Outputs([CoreOutput("r-1", [5, 6]), CoreOutput("r-2", [], "error", "the adapter is gone", 404),
             CoreOutput("r-3", [2], "stop")]),
    AdapterResult(3, LoRAStatus.LOAD_NAME_EXISTS, "already loaded from /q", pinned=True),
    EngineStats(6, 1, 2, ["a"], ["b"], 4, 2, ["a"], 3, 1, 0, 100, 50, 10**9, 10**6, 10**5, {"length": 3}),
    ControlFailed(7, "RuntimeError: boom"),
]


@pytest.mark.parametrize("message", TO_ENGINE, ids=lambda m: type(m).__name__)
def test_to_engine_round_trips(message):
    assert decode_to_engine(encode(message)) == message


@pytest.mark.parametrize("message", FROM_ENGINE, ids=lambda m: type(m).__name__)
def test_from_engine_round_trips(message):
    assert decode_from_engine(encode(message)) == message


def test_a_message_of_the_other_direction_or_a_bad_value_does_not_decode():
    with pytest.raises(msgspec.ValidationError):
        decode_to_engine(encode(FROM_ENGINE[2]))
    bad = msgspec.msgpack.encode({"type": "add", "request_id": "r", "prompt_token_ids": [1],
                                  "params": {"max_tokens": 0}})
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):
        decode_to_engine(bad)
    status = msgspec.msgpack.encode({"type": "adapter_result", "control_id": 1, "status": "SUCCESS"})
    with pytest.raises(msgspec.ValidationError, match="status"):  # statuses are the enum's values, not free text
        decode_from_engine(status)


def test_a_step_of_32_decodes_is_small():
    """Per request and step: its id and one token, a few bytes of framing (the pickled cumulative outputs
    this replaces grew with every token: O(n^2) bytes per request)."""
    ids = [f"req-{'0' * 32}-0-{i}" for i in range(32)]
    step = Outputs([CoreOutput(rid, [40000 + i]) for i, rid in enumerate(ids)])
    assert len(encode(step)) <= sum(len(rid) + 16 for rid in ids) + 24  # 10 fields, the last 7 nil or 0
