"""EngineCore and ModelRunner driven directly, as the engine process and the offline engine drive them: token
ids in, token-id deltas out (EngineCore), and one forward step over sequences the block manager placed
(ModelRunner), each against HF + PEFT greedy decoding."""
import contextlib

import pytest

from conftest import hf_greedy, save_checkpoint, save_peft_adapter, tiny_llama
from loramux import EngineConfig, LoRAConfig, SamplingParams
from loramux.engine.engine_core import EngineCore
from loramux.engine.sequence import Sequence

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
PROMPTS = {"base": [5, 9, 14, 3], "tuned": [7, 7, 21, 40, 2]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("core")
    base = tiny_llama()
    adapter = save_peft_adapter(base, root / "adapter", seed=3, r=8)
    config = EngineConfig(model=save_checkpoint(base, root / "model"), dtype="float32", kv_cache_memory=2**22,
                          lora=LoRAConfig(max_loras=2, max_lora_rank=8), max_model_len=64)
    core = EngineCore(config)
    assert core.adapters.load_adapter("tuned", adapter)
    return base, adapter, core


def test_the_core_steps_token_ids_to_deltas_that_add_up_to_hf_greedy(setup):
    base, adapter, core = setup
    for request_id, prompt in PROMPTS.items():
        core.add_request(request_id, prompt, GREEDY, None if request_id == "base" else "tuned")
    tokens, reasons, steps = {r: [] for r in PROMPTS}, {}, 0
    while core.has_unfinished_requests():
        steps += 1
        for out in core.step():
            assert len(out.new_token_ids) <= 1 and out.request_id not in reasons  # deltas, never totals
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
    assert reasons == {"base": "length", "tuned": "length"} and steps == GREEDY.max_tokens
    assert tokens["base"] == hf_greedy(base, None, PROMPTS["base"], 5)
    assert tokens["tuned"] == hf_greedy(base, adapter, PROMPTS["tuned"], 5)
    assert core.num_finished["length"] >= 2 and core.sequence("base") is None  # finished: forgotten


def test_the_cores_stats_are_the_engine_processes_metrics_in_one_read(setup):
    import msgspec

    from loramux.server.engine.wire import EngineStats

    _, _, core = setup
    core.add_request("counted", PROMPTS["tuned"], GREEDY, "tuned")
    stats = core.stats()
    assert (stats["num_waiting"], stats["waiting_adapters"], stats["num_adapters"]) == (1, ["tuned"], 1)
    assert stats["kv_blocks_free"] <= stats["kv_blocks_total"] and stats["spec_decode"] is None
    fields = set(EngineStats.__struct_fields__) - {"control_id", "paused"}
    assert set(stats) == fields  # every field the metrics read, and nothing they do not
    while core.has_unfinished_requests():
        core.step()
    assert core.stats()["finished"].get("length", 0) >= 1 and core.stats()["num_waiting"] == 0
    msgspec.msgpack.decode(msgspec.msgpack.encode(EngineStats(0, **core.stats())), type=EngineStats)


def test_the_core_refuses_what_cannot_run_and_aborts_anywhere(setup):
    _, _, core = setup
    with pytest.raises(LookupError, match="ghost"):
        core.add_request("x", [1, 2], GREEDY, "ghost")
    core.add_request("waiting", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        core.add_request("waiting", [4], GREEDY)
    assert core.abort_request("waiting") and not core.abort_request("waiting")
    core.add_request("running", [1, 2, 3], GREEDY)
    core.step()  # prefilled: it is running now
    assert core.abort_request("running") and not core.has_unfinished_requests()
    assert core.sequence("running") is None


def test_the_model_runner_runs_one_prefill_and_one_decode_step_over_placed_sequences(setup):
    """ModelRunner.run: rows in any order with their slots (-1: the base model), prefill then decode, each row's
    next token the one HF + PEFT picks."""
    base, adapter, core = setup
    runner, blocks = core.runner, core.block_manager
    slot = core.adapters.activate_adapter("tuned")
    seqs = [Sequence(list(PROMPTS["tuned"]), GREEDY, "tuned", "t"), Sequence(list(PROMPTS["base"]), GREEDY, None, "b")]
    for seq in seqs:
        blocks.allocate(seq)
    expected = [hf_greedy(base, adapter, PROMPTS["tuned"], 2), hf_greedy(base, None, PROMPTS["base"], 2)]
    try:
        first = runner.run(seqs, [slot, -1], is_prefill=True)
        assert [s.token for s in first] == [e[0] for e in expected]
        for seq, sampled in zip(seqs, first):
            seq.num_computed_tokens = len(seq)
            seq.append_token(sampled.token)
            blocks.may_append(seq)
        second = runner.run(seqs, [slot, -1], is_prefill=False)
        assert [s.token for s in second] == [e[1] for e in expected]
    finally:
        for seq in seqs:
            blocks.deallocate(seq)
            runner.release(seq)
    # the blocks the block manager hands out, and one whose rows padded decode rows write to
    assert runner.kv_cache.shape[2] == (runner.num_blocks + 1) * runner.block_size


class _SlowCopies:
    """A GPU's SlotCopies as the core sees them: each slot written is pending for `steps` ready() checks."""

    def __init__(self, steps: int):
        self.steps, self.checks, self.waited = steps, {}, []

    @contextlib.contextmanager
    def writing(self, slot: int):
        yield
        self.checks[slot] = 0  # a new write: pending again

    def ready(self, slot: int) -> bool:
        self.checks[slot] = self.checks.get(slot, 0) + 1
        return self.checks[slot] > self.steps

    def wait(self, slot: int) -> None:
        self.waited.append(slot)
        self.checks[slot] = self.steps  # done from now on, as after the device waited


def _run_beside_a_copy(core, monkeypatch, copies, prompts):
    monkeypatch.setattr(core.adapters.slots, "copies", copies)
    core.adapters.deactivate_adapter("tuned")  # its next activation writes its slot
    for request_id, (prompt, adapter) in prompts.items():
        core.add_request(request_id, prompt, GREEDY, adapter)
    tokens, first_step = {r: [] for r in prompts}, {}
    step = 0
    while core.has_unfinished_requests():
        step += 1
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            first_step.setdefault(out.request_id, step)
    return tokens, first_step


def test_a_slot_being_written_holds_back_only_its_own_requests(setup, monkeypatch):
    """As on a GPU whose slot write is still running on its side stream: the base request steps beside it, the
    adapter's request joins once the copy is done (nobody waits on the device), and both keep HF's tokens."""
    base, adapter, core = setup
    copies = _SlowCopies(steps=2)
    prompts = {"base": (PROMPTS["base"], None), "tuned": (PROMPTS["tuned"], "tuned")}
    tokens, first_step = _run_beside_a_copy(core, monkeypatch, copies, prompts)
    assert first_step == {"base": 1, "tuned": 3} and copies.waited == [], (first_step, copies.checks, copies.waited)
    assert tokens["base"] == hf_greedy(base, None, PROMPTS["base"], 5)
    assert tokens["tuned"] == hf_greedy(base, adapter, PROMPTS["tuned"], 5)


def test_a_step_with_nothing_else_to_run_waits_for_the_copy_on_the_device(setup, monkeypatch):
    base, adapter, core = setup
    copies = _SlowCopies(steps=5)
    tokens, first_step = _run_beside_a_copy(core, monkeypatch, copies, {"tuned": (PROMPTS["tuned"], "tuned")})
    assert first_step == {"tuned": 1} and copies.waited == [core.adapters.cache.slot_of(core.adapters.current("tuned"))]
    assert tokens["tuned"] == hf_greedy(base, adapter, PROMPTS["tuned"], 5)


def test_lora_off_is_a_null_adapter_system_that_refuses_every_change(setup, tmp_path):
    """EngineConfig(lora=None): the engine holds the null adapter system (adapters/off.py), not None: names are
    unknown, loads of every kind are refused with one message, its stats are empty, and base requests run."""
    from loramux.adapters.off import OFF, NoAdapters

    base, adapter, _ = setup
    core = EngineCore(EngineConfig(model=save_checkpoint(base, tmp_path / "model"), dtype="float32",
                                   kv_cache_memory=2**22, lora=None, max_model_len=64))
    assert isinstance(core.adapters, NoAdapters) and core.scheduler.max_loras == 0
    with pytest.raises(LookupError, match="base model only"):
        core.add_request("x", [1, 2], GREEDY, "tuned")
    for result in (core.adapters.load_adapter("tuned", adapter), core.adapters.add_adapter("t", {}, {}),
                   core.load_adapter_async("tuned", adapter).result(timeout=1), core.adapters.unload_adapter("tuned"),
                   core.adapters.pin_adapter("tuned"), core.adapters.unpin_adapter("tuned")):
        assert not result and result.message == OFF
    assert (core.adapters.loras, core.adapters.pinned, core.adapters.stats, core.adapters.resident) == ([], [], {}, {})
    core.add_request("base", PROMPTS["base"], GREEDY)
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for out in core.step() for t in out.new_token_ids]
    assert tokens == hf_greedy(base, None, PROMPTS["base"], 5)
