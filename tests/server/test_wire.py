"""The wire format between the front end and the engine: every message type round-trips, and nothing but
the declared types decodes."""
import msgspec
import pytest

from loramux.engine.output import CoreOutput
from loramux.sampling_params import SamplingParams
from loramux.server.wire import (Abort, AddRequest, AdapterSource, Control, ControlResult, Outputs, Ready,
                                 StartupFailed, decode_from_engine, decode_to_engine, encode)

TO_ENGINE = [
    AddRequest("r-1", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.3, seed=-2**63, stop=("x", "yz"),
                                                  stop_token_ids=(7,), top_k=4, presence_penalty=-1.5), "pirate"),
    AddRequest("r-2", [9], SamplingParams(), None),
    Abort(["r-1", "r-2"]),
    Control(3, "load", {"name": "a", "path": "/p", "allowed_dirs": ["/d"], "pinned": True}),
    Control(4, "stats"),
]
FROM_ENGINE = [
    Ready("/models/m", "/tmp/tok", 4096, 49152, [AdapterSource("a", "/p", ("/d",), True)], {"b": "gone"}),
    StartupFailed("ValueError: no"),
    Outputs([CoreOutput("r-1", [5, 6]), CoreOutput("r-2", [], "error", "the adapter is gone", 404),
             CoreOutput("r-3", [2], "stop")]),
    ControlResult(3, {"status": "SUCCESS", "message": "ok", "adapters": {"a": None}}),
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


def test_a_step_of_32_decodes_is_small():
    """Per request and step: its id and one token, a few bytes of framing (the pickled cumulative outputs
    this replaces grew with every token: O(n^2) bytes per request)."""
    ids = [f"req-{'0' * 32}-0-{i}" for i in range(32)]
    step = Outputs([CoreOutput(rid, [40000 + i]) for i, rid in enumerate(ids)])
    assert len(encode(step)) <= sum(len(rid) + 13 for rid in ids) + 24  # 7 fields, the last 4 nil or 0
