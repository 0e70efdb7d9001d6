"""The engine process's loop, driven step by step in this process (no ZMQ, no HTTP)."""
import pytest

from conftest import save_checkpoint, save_peft_adapter, tiny_llama
from loramux import LoRAConfig, SamplingParams
from loramux.config import EngineConfig
from loramux.engine.llm_engine import LLMEngine
from loramux.server.engine_process import EngineLoop
from loramux.server.ipc import Control, ControlResult, Generate, Outputs, RequestFailed


class Outbox:
    def __init__(self):
        self.sent = []

    def send_pyobj(self, message):
        self.sent.append(message)


@pytest.fixture()
def loop(tmp_path):
    base = tiny_llama()
    engine = LLMEngine(EngineConfig(model=save_checkpoint(base, tmp_path / "m"), dtype="float32",
                                    lora=LoRAConfig(max_loras=2, max_lora_rank=8), kv_cache_memory=2**22,
                                    max_model_len=64))
    assert engine.load_adapter(f"a={save_peft_adapter(base, tmp_path / 'a', r=8)}")
    return EngineLoop(engine, Outbox())


def generate(request_id, adapter="a", max_tokens=12):
    return Generate(request_id, adapter, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                    True, prompt=[5, 6, 7])


def test_unload_waits_for_running_requests_and_fails_waiting_ones(loop):
    loop.handle(generate("running"))
    loop.step()  # prefill: "running" holds the adapter now
    loop.handle(generate("not-started"))
    loop.handle(Control(1, "unload", {"name": "a"}))
    assert not [m for m in loop.outbox.sent if isinstance(m, ControlResult)]  # still waiting
    failed = [m for m in loop.outbox.sent if isinstance(m, RequestFailed)]
    assert [(m.request_id, m.status_code) for m in failed] == [("not-started", 404)]
    loop.handle(generate("late"))  # new requests for an adapter being unloaded are refused
    assert loop.outbox.sent[-1].request_id == "late" and loop.outbox.sent[-1].status_code == 404
    finished_at = None
    for _ in range(20):
        loop.step()
        for i, m in enumerate(loop.outbox.sent):
            if isinstance(m, Outputs) and any(o["finish_reason"] for o in m.outputs) and finished_at is None:
                finished_at = i
    results = [i for i, m in enumerate(loop.outbox.sent) if isinstance(m, ControlResult)]
    assert finished_at is not None and results and results[0] > finished_at  # answered after the finish
    assert loop.outbox.sent[results[0]].result["status"] == "SUCCESS"
    assert not loop.engine.manager.is_lora("a")


def test_bad_requests_fail_alone(loop):
    loop.handle(generate("ok", adapter=None))
    loop.handle(Generate("long", None, SamplingParams(max_tokens=100), True, prompt=[5, 6, 7]))
    loop.handle(Generate("ghost", "ghost", SamplingParams(max_tokens=2), True, prompt=[5]))
    loop.handle(Generate("bad-id", None, SamplingParams(max_tokens=2), True, prompt=[999]))
    codes = {m.request_id: m.status_code for m in loop.outbox.sent if isinstance(m, RequestFailed)}
    assert codes == {"long": 400, "ghost": 404, "bad-id": 400}
    while loop.busy:
        loop.step()
    outputs = [o for m in loop.outbox.sent if isinstance(m, Outputs) for o in m.outputs]
    assert outputs[-1]["request_id"] == "ok" and outputs[-1]["finish_reason"] == "length"
