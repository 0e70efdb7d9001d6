"""The engine process's loop, driven step by step in this process (no ZMQ, no HTTP), and its Inbox thread."""
import threading
import time

import pytest

from conftest import save_checkpoint, save_peft_adapter, tiny_llama
from loramux import LoRAConfig, SamplingParams
from loramux.config import EngineConfig
from loramux.engine.engine_core import EngineCore
from loramux.server.engine.engine_process import EngineCoreProc
from loramux.adapters.status import LoRAStatus
from loramux.server.engine.wire import (Abort, AdapterResult, AddRequest, AdapterRecord, EngineStats, GetStats, LoadAdapter,
                                 Outputs, Pause, PauseState, PinAdapter, Resume, UnloadAdapter, decode_from_engine,
                                 decode_to_engine, encode)


class Outbox:
    """Stands in for the PUSH socket: keeps what was sent, decoded as the front end would decode it."""

    def __init__(self):
        self.sent = []

    def send(self, data: bytes):
        self.sent.append(decode_from_engine(data))

    def outputs(self):
        return [o for m in self.sent if isinstance(m, Outputs) for o in m.outputs]

    def results(self):
        return [m for m in self.sent if isinstance(m, (AdapterResult, EngineStats))]


@pytest.fixture()
def loop(tmp_path):
    base = tiny_llama()
    core = EngineCore(EngineConfig(model=save_checkpoint(base, tmp_path / "m"), dtype="float32",
                                   lora=LoRAConfig(max_loras=2, max_lora_rank=8), kv_cache_memory=2**22,
                                   max_model_len=64))
    loop = EngineCoreProc(core, Outbox())
    ready = loop.ready([AdapterRecord("a", save_peft_adapter(base, tmp_path / "a", r=8)),
                        AdapterRecord("gone", str(tmp_path / "missing"))], str(tmp_path / "tok"))
    assert [a.name for a in ready.adapters] == ["a"] and "does not exist" in ready.failed_adapters["gone"]
    assert (tmp_path / "tok" / "tokenizer.json").is_file() and ready.max_model_len == 64
    return loop


def add(request_id, adapter="a", max_tokens=12, prompt=(5, 6, 7)):
    # through the wire format, as the front end sends it
    msg = AddRequest(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                     adapter)
    return decode_to_engine(encode(msg))


def control(loop, msg):
    loop.handle(decode_to_engine(encode(msg)))  # through the wire format


def test_unload_waits_for_running_requests_and_fails_waiting_ones(loop):
    loop.handle(add("running"))
    loop.step()  # prefill: "running" holds the adapter now
    loop.handle(add("not-started"))
    control(loop, UnloadAdapter(1, "a"))
    assert not loop.outbox.results()  # still waiting
    loop.handle(add("late"))  # the name is gone at once: new requests for it are refused
    loop.step()
    failed = {o.request_id: o.status for o in loop.outbox.outputs() if o.finish_reason == "error"}
    assert failed == {"not-started": 404, "late": 404}
    finished_at = None
    for _ in range(20):
        loop.step()
        for i, m in enumerate(loop.outbox.sent):
            if isinstance(m, Outputs) and any(o.request_id == "running" and o.finished for o in m.outputs):
                finished_at = finished_at if finished_at is not None else i
    results = [i for i, m in enumerate(loop.outbox.sent) if isinstance(m, AdapterResult)]
    assert finished_at is not None and results and results[0] > finished_at  # answered after the finish
    assert loop.outbox.sent[results[0]].status is LoRAStatus.SUCCESS
    assert not loop.core.adapters.is_lora("a") and len(loop.core.adapters.cache) == 0


def test_a_name_unloaded_while_its_requests_run_can_be_loaded_again_at_once(loop, tmp_path):
    """The unload waits for the running request, but the name is free: a new load of it is a new identity,
    and the waiting unload is answered for the identity it unloaded, not the new one."""
    path = loop.core.adapters.paths["a"]
    loop.handle(add("running", max_tokens=30))
    loop.step()
    control(loop, UnloadAdapter(1, "a"))
    control(loop, LoadAdapter(2, "a", path))  # read on the loader thread while "running" keeps stepping
    while not any(m.control_id == 2 for m in loop.outbox.results()):
        loop.step()
    loop.handle(add("new"))
    for _ in range(40):
        loop.step()
    answers = {m.control_id: m.status for m in loop.outbox.results()}
    assert answers == {1: LoRAStatus.SUCCESS, 2: LoRAStatus.SUCCESS} and loop.core.adapters.loras == ["a"]
    finished = {o.request_id for o in loop.outbox.outputs() if o.finish_reason == "length"}
    assert finished == {"running", "new"}


def test_a_runtime_load_is_answered_as_it_goes_in_before_the_step_after_it_runs(loop, tmp_path, monkeypatch):
    """Installed between steps and answered there: the trainer that pushed it hears back a step sooner (its next
    request then starts on it), not after the step that follows the install."""
    loop.handle(add("running", max_tokens=30))
    loop.step()
    path = save_peft_adapter(tiny_llama(), tmp_path / "b", seed=5, r=8)
    control(loop, LoadAdapter(7, "b", path))
    for read in loop.core.loader.pending:
        read.result(timeout=60)
    run = loop.core.runner.run

    def forward(*args, **kwargs):  # marks, among what is sent, when the step's forward ran
        loop.outbox.sent.append("forward")
        return run(*args, **kwargs)

    monkeypatch.setattr(loop.core.runner, "run", forward)
    before = len(loop.outbox.sent)
    loop.step()
    sent = loop.outbox.sent[before:]
    kinds = [m if isinstance(m, str) else type(m).__name__ for m in sent]
    assert kinds == ["AdapterResult", "forward", "Outputs"], kinds  # answered, then the step runs
    assert sent[0].control_id == 7 and sent[0].status is LoRAStatus.SUCCESS


def test_bad_requests_fail_alone_and_outputs_are_deltas(loop):
    loop.handle(add("ok", adapter=None, max_tokens=5))
    loop.handle(add("ghost", adapter="ghost"))
    loop.handle(add("dup", adapter=None))
    loop.handle(add("dup", adapter=None))
    while loop.busy:
        loop.step()
    outputs = loop.outbox.outputs()
    assert {o.request_id: o.status for o in outputs if o.finish_reason == "error"} == {"ghost": 404, "dup": 400}
    ok = [o for o in outputs if o.request_id == "ok"]
    assert all(len(o.new_token_ids) == 1 for o in ok) and len(ok) == 5 and ok[-1].finish_reason == "length"


def test_pin_and_unpin_through_control_messages(loop):
    control(loop, PinAdapter(1, "a", True))
    control(loop, GetStats(2))
    control(loop, PinAdapter(3, "a", False))
    control(loop, PinAdapter(4, "ghost", False))
    results = {m.control_id: m for m in loop.outbox.results()}
    assert results[1].status is LoRAStatus.SUCCESS and results[1].pinned and results[2].pinned == ["a"]
    assert results[3].status is LoRAStatus.SUCCESS and not results[3].pinned and loop.core.adapters.pinned == []
    assert results[4].status is LoRAStatus.PIN_NAME_NONEXISTENT


def test_a_reload_in_place_answers_that_the_pin_carried_over(loop):
    path = loop.core.adapters.paths["a"]
    control(loop, PinAdapter(1, "a", True))
    control(loop, LoadAdapter(2, "a", path, replace=True))
    control(loop, LoadAdapter(3, "a", path))  # the same path again: a success that reads nothing, answered at once
    assert [m.control_id for m in loop.outbox.results()] == [1, 3]  # the reload is read off the step loop
    while len(loop.outbox.results()) < 3:
        loop.step()
    results = {m.control_id: m for m in loop.outbox.results()}
    assert results[2].status is LoRAStatus.SUCCESS and results[2].pinned
    assert results[3].status is LoRAStatus.SUCCESS and "already loaded" in results[3].message


def tokens_of(loop, request_id):
    return [t for o in loop.outbox.outputs() if o.request_id == request_id for t in o.new_token_ids]


def pause_answers(loop):
    return [m for m in loop.outbox.sent if isinstance(m, PauseState)]


def run_until_idle(loop, limit=100):
    for _ in range(limit):
        if not loop.busy:
            return
        loop.step()
    raise AssertionError("the loop is still busy")


def test_pause_keep_freezes_requests_in_place_and_holds_new_ones_until_resume(loop, tmp_path):
    """keep: no step runs while paused, whatever arrives; adapter admin goes on; Resume continues the kept
    request on the identity it started on and adds the held one, which starts on the name's identity then."""
    alone = EngineCoreProc(loop.core, Outbox())  # the same request, never paused: the tokens to match
    alone.handle(add("ref"))
    run_until_idle(alone)
    loop.handle(add("kept"))
    loop.step()
    before = tokens_of(loop, "kept")
    control(loop, Pause(1, "keep", clear_cache=False))
    assert pause_answers(loop) == [PauseState(1, True)] and loop.paused and not loop.busy
    loop.handle(add("held"))
    control(loop, LoadAdapter(2, "a", save_peft_adapter(tiny_llama(), tmp_path / "a2", r=8, seed=3), replace=True))
    while not any(isinstance(m, AdapterResult) for m in loop.outbox.sent):  # read on the loader thread
        loop.step()
        loop.core.loader.wait(0.05)
    assert [m.status for m in loop.outbox.results()] == [LoRAStatus.SUCCESS]  # installed while paused
    assert tokens_of(loop, "kept") == before and loop.core.scheduler.num_running == 1
    assert loop.core.sequence("held") is None  # held in the loop, not queued in the core
    control(loop, GetStats(3))
    stats = loop.outbox.results()[-1]
    assert stats.paused and stats.num_running == 1 and stats.num_waiting == 1  # "held" counts as waiting
    control(loop, Resume(4))
    assert pause_answers(loop)[-1] == PauseState(4, False) and not loop.paused
    run_until_idle(loop)
    assert tokens_of(loop, "kept") == tokens_of(alone, "ref")  # the first load's weights, start to finish
    assert len(tokens_of(loop, "held")) == 12 and tokens_of(loop, "held") != tokens_of(alone, "ref")


def test_pause_abort_ends_every_request_and_wait_answers_once_they_have_finished(loop):
    loop.handle(add("running"))
    loop.step()
    loop.handle(add("queued", max_tokens=4))
    control(loop, Pause(1, "abort"))
    loop.handle(add("held"))
    loop.step()
    ended = {o.request_id: o.finish_reason for o in loop.outbox.outputs() if o.finished}
    assert ended == {"running": "abort", "queued": "abort"} and not loop.core.has_unfinished_requests()
    control(loop, Resume(2))
    loop.handle(add("late", max_tokens=3))
    control(loop, Pause(3, "wait"))  # "held" and "late" are in flight: answered once both have finished
    loop.handle(add("after-the-pause"))
    assert pause_answers(loop)[-1] == PauseState(2, False)
    run_until_idle(loop)
    assert pause_answers(loop)[-1] == PauseState(3, True)
    assert len(tokens_of(loop, "held")) == 12 and len(tokens_of(loop, "late")) == 3
    assert tokens_of(loop, "after-the-pause") == []  # held until Resume
    control(loop, Pause(4, "abort"))  # already paused: the held request ends too
    loop.step()
    assert [o.finish_reason for o in loop.outbox.outputs() if o.request_id == "after-the-pause"] == ["abort"]


def test_a_held_request_can_be_aborted_and_a_resume_overtakes_a_pause_that_waits(loop):
    loop.handle(add("running"))
    loop.step()
    control(loop, Pause(1, "wait"))
    loop.handle(add("held"))
    loop.handle(decode_to_engine(encode(Abort(["held"]))))
    control(loop, Resume(2))
    assert pause_answers(loop) == [PauseState(1, False), PauseState(2, False)]
    run_until_idle(loop)
    assert len(tokens_of(loop, "running")) == 12 and tokens_of(loop, "held") == []
    assert loop.core.sequence("held") is None


def test_a_loads_files_are_read_as_it_arrives_and_that_read_is_the_one_installed(loop, tmp_path, monkeypatch):
    """The Inbox thread starts the read while a step runs (read_ahead); the loop's load takes that read instead of
    starting another. The same files again need no read: the one started ahead is not used."""
    loop.handle(add("running", max_tokens=30))
    loop.step()
    store, reads = loop.core.loader.store, []
    read = store.read
    monkeypatch.setattr(store, "read", lambda *args, **kwargs: reads.append(args[0]) or read(*args, **kwargs))
    msg = decode_to_engine(encode(LoadAdapter(9, "b", save_peft_adapter(tiny_llama(), tmp_path / "b", seed=5, r=8))))
    loop.read_ahead(msg)
    loop._ahead[9].result(timeout=60)
    assert reads == ["b"]  # read before the loop has taken the message
    loop.handle(msg)
    for pending in loop.core.loader.pending:
        pending.result(timeout=60)
    loop.step()
    answer = [m for m in loop.outbox.results() if m.control_id == 9]
    assert answer and answer[0].status is LoRAStatus.SUCCESS and reads == ["b"] and not loop._ahead
    loop.handle(add("on-b", adapter="b", max_tokens=2))
    while loop.core.has_unfinished_requests():
        loop.step()
    assert [o.finish_reason for o in loop.outbox.outputs() if o.request_id == "on-b"][-1] == "length"
    revision = answer[0].revision
    for control_id, ahead in ((10, False), (11, True)):  # the same files again: the front end says no read, or not
        again = decode_to_engine(encode(LoadAdapter(control_id, "b", msg.path, read_ahead=ahead)))
        loop.read_ahead(again)
        if ahead:
            loop._ahead[control_id].result(timeout=60)
        loop.handle(again)  # answered at once: nothing to install
        answer = [m for m in loop.outbox.results() if m.control_id == control_id]
        assert answer and answer[0].status is LoRAStatus.SUCCESS and answer[0].revision == revision
    assert reads == ["b", "b"] and not loop._ahead  # the read started ahead was not used


def test_the_inbox_hands_messages_over_in_order_and_starts_a_loads_read_before(tmp_path):
    zmq = pytest.importorskip("zmq")
    from loramux.server.engine.engine_process import Inbox

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://inbox")
    push.connect("inproc://inbox")
    ahead, started = [], threading.Event()

    def read_ahead(msg):
        ahead.append((msg.control_id, inbox._queue.qsize()))
        started.set()

    inbox = Inbox(pull, read_ahead)
    sent = [add("r1"), LoadAdapter(3, "b", "/x/b"), Abort(["r1"]), add("r2")]
    for msg in sent:
        push.send(encode(msg))
    assert started.wait(120)  # (nothing taken before: what is queued then is all the inbox has put)
    taken = []
    for _ in range(120):  # a state, not a time: all four handed over (1 s waits, 120 s bound)
        taken += inbox.take(1000)
        if len(taken) == len(sent):
            break
    assert [type(m).__name__ for m in taken] == ["AddRequest", "LoadAdapter", "Abort", "AddRequest"]
    assert ahead == [(3, 1)] and inbox.take(0) == []  # its read started with only r1 queued: before it was
    push.send(encode(add("r3")))
    push.send(b"not a message")
    for _ in range(120):  # r3 first, on its own; the bad message at the take after
        if inbox._queue.qsize() == 2:
            break
        time.sleep(0.5)
    assert [m.request_id for m in inbox.take(1000)] == ["r3"]
    with pytest.raises(Exception):
        inbox.take(1000)
    push.close(linger=0)


def test_a_read_ahead_that_fails_to_start_still_hands_the_load_over():
    zmq = pytest.importorskip("zmq")
    from loramux.server.engine.engine_process import Inbox

    def broken(msg):
        raise RuntimeError("the loader is shut down")

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://inbox-broken")
    push.connect("inproc://inbox-broken")
    inbox = Inbox(pull, broken)
    push.send(encode(LoadAdapter(4, "b", "/x/b")))
    taken = []
    for _ in range(120):
        taken = taken or inbox.take(1000)
    assert isinstance(taken[0], LoadAdapter) and taken[0].control_id == 4
    push.close(linger=0)
