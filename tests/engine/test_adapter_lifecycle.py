"""The adapter lifecycle as a model-based test: hypothesis drives a real engine (tiny random model, fp32,
max_loras=2, max_cpu_loras=3, a KV cache small enough to preempt) through random interleavings of load,
load in place, unload, pin, unpin, adding requests (an adapter or the base), aborts and steps, against a
plain reference of what should be loaded, pinned and routable. After every rule the invariants hold, and
every finished request's greedy tokens are those of the adapter version it was admitted on, run alone
(HF + PEFT). `make test` runs a few hundred examples; `pytest --hypothesis-profile=slow
tests/engine/test_adapter_lifecycle.py` runs thousands.

Sequences it found once are kept below as plain tests (the six-step reload/unload/load one first).
"""
from __future__ import annotations

import concurrent.futures
import functools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from conftest import hf_greedy, save_checkpoint, save_peft_adapter, tiny_llama
from loramux import LoRAConfig, LoRAStatus, SamplingParams
from loramux.llm import LLM

NAMES = ("x", "y", "z")
PROMPTS = ((5, 6, 7), (9, 3, 11, 4, 8), (20, 21))
MAX_TOKENS = 3
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
MAX_LORAS, MAX_CPU_LORAS = 2, 3
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, 4 positions, 2 KV heads of 16, fp32

settings.register_profile("slow", max_examples=3000, stateful_step_count=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])


class World:
    """What every example shares: one engine (each example leaves it empty), four adapters, the oracle."""

    def __init__(self, root):
        self.base = tiny_llama()
        self.paths = [save_peft_adapter(self.base, root / f"a{i}", seed=40 + i, r=(4, 8)[i % 2]) for i in range(4)]
        self.llm = LLM(model=save_checkpoint(self.base, root / "model"), dtype="float32", max_num_seqs=4,
                       lora=LoRAConfig(max_loras=MAX_LORAS, max_cpu_loras=MAX_CPU_LORAS, max_lora_rank=8),
                       kv_cache_memory=6 * BLOCK_BYTES, block_size=4, max_model_len=12)  # 4 requests overflow it

    @functools.lru_cache(maxsize=None)
    def alone(self, path_index: int | None, prompt: tuple[int, ...]) -> list[int]:
        path = None if path_index is None else self.paths[path_index]
        return hf_greedy(self.base, path, list(prompt), MAX_TOKENS)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return World(tmp_path_factory.mktemp("lifecycle"))


class Lifecycle(RuleBasedStateMachine):
    def __init__(self, world: World):
        super().__init__()
        self.world = world
        self.engine = world.llm.engine
        self.adapters = self.engine.adapters
        self.engine.reset_prefix_cache()  # each example starts from the same state: no base blocks cached before
        self.loaded: dict[str, int] = {}  # name -> path index, in first-load order (as `loras` lists them)
        self.pinned: set[str] = set()
        self.current = {}  # name -> the identity it points to now
        self.path_of = {}  # identity -> path index
        self.seen = set()  # every identity ever handed out: none is reused
        self.requests: dict[str, tuple[str | None, tuple[int, ...]]] = {}  # live request -> (adapter, prompt)
        self.admitted = {}  # request -> the identity it was admitted on
        self.aborted: set[str] = set()
        self.unloaded_while_waiting: set[str] = set()  # requests whose adapter went before they started

    # ---- adapter control ---------------------------------------------------------------------------
    @rule(name=st.sampled_from(NAMES), path=st.integers(0, 3), pinned=st.booleans())
    def load(self, name, path, pinned):
        before = self._snapshot()
        result = self.world.llm.load_adapter(name, self.world.paths[path], pinned=pinned)
        if name in self.loaded and self.loaded[name] != path:
            assert result == LoRAStatus.LOAD_NAME_EXISTS and self._snapshot() == before
        elif name in self.loaded:  # the same path again: a success that reads nothing new
            assert result == LoRAStatus.SUCCESS or (pinned and result.status in (LoRAStatus.PIN_ERROR,
                                                                                 LoRAStatus.LOAD_BUSY)), result
            assert self.adapters.identity_for(name) == self.current[name]
            if pinned and result:
                self.pinned.add(name)
        else:
            self._loaded(name, path, pinned, result, before)

    @rule(name=st.sampled_from(NAMES), path=st.integers(0, 3))
    def load_in_place(self, name, path):
        before = self._snapshot()
        result = self.world.llm.load_adapter(name, self.world.paths[path], replace=True)
        self._loaded(name, path, False, result, before)

    def _loaded(self, name, path, pinned, result, before):
        if not result:  # refused: a full host tier or no slot to pin; nothing changed
            assert result.status in (LoRAStatus.LOAD_ERROR, LoRAStatus.PIN_ERROR, LoRAStatus.LOAD_BUSY) and \
                "max_" in result.message, result
            assert self._snapshot() == before
            return
        ref = self.adapters.identity_for(name)
        assert ref not in self.seen, "an identity was handed out twice"
        self.seen.add(ref)
        if name in self.loaded and name in self.pinned:
            pinned = True  # a reload in place keeps the pin
        self.loaded[name], self.current[name], self.path_of[ref] = path, ref, path
        if pinned:
            self.pinned.add(name)

    @rule(name=st.sampled_from(NAMES))
    def unload(self, name):
        result = self.world.llm.unload_adapter(name)
        if name not in self.loaded:
            assert result == LoRAStatus.UNLOAD_NAME_NONEXISTENT
            return
        assert result == LoRAStatus.SUCCESS
        del self.loaded[name], self.current[name]
        self.pinned.discard(name)
        for rid, (adapter, _) in self.requests.items():
            if adapter == name and rid not in self.admitted:
                self.unloaded_while_waiting.add(rid)

    @rule(name=st.sampled_from(NAMES), pin=st.booleans())
    def pin_or_unpin(self, name, pin):
        result = self.world.llm.pin_adapter(name) if pin else self.world.llm.unpin_adapter(name)
        if name not in self.loaded:
            assert result == LoRAStatus.PIN_NAME_NONEXISTENT
        elif not pin:
            assert result == LoRAStatus.SUCCESS
            self.pinned.discard(name)
        elif result:
            self.pinned.add(name)
        else:  # every slot is pinned (PIN_ERROR) or runs requests of other adapters (LOAD_BUSY: retry later)
            assert result.status in (LoRAStatus.PIN_ERROR, LoRAStatus.LOAD_BUSY) and "max_" in result.message, result

    # ---- requests --------------------------------------------------------------------------------
    @rule(asks=st.lists(st.tuples(st.sampled_from((None, *NAMES)), st.sampled_from(PROMPTS)), min_size=1, max_size=4))
    def add_requests(self, asks):
        for name, prompt in asks:
            self.add_request(name, prompt)

    def add_request(self, name, prompt):
        if name is not None and name not in self.loaded:
            with pytest.raises(ValueError, match="unknown adapter"):
                self.engine.add_request(list(prompt), PARAMS, name)
            return
        rid = self.engine.add_request(list(prompt), PARAMS, name)
        self.requests[rid] = (name, prompt)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        self.engine.abort_request(rid)
        self._ended(rid)
        self.aborted.add(rid)

    @rule(steps=st.integers(1, 4))
    def run(self, steps):
        for _ in range(steps):
            self.step()

    def step(self):
        self._settle_reads()
        current = dict(self.current)  # what names resolve to in this step (control happens between steps)
        for out in self.engine.step():
            self._check_finished(out)
        for rid, (name, _) in self.requests.items():
            seq = self.engine.core.sequence(rid)
            if name is not None and seq is not None and seq.adapter_ref is not None and rid not in self.admitted:
                assert seq.adapter_ref == current[name], "admitted on another identity than its name's current one"
                self.admitted[rid] = seq.adapter_ref

    def _settle_reads(self):
        """Every adapter read the engine started, and the spill file's writes, have finished before the next step.
        Both run on the loader thread; which step installs a read, or whether a read-back finds the spilled copy
        written, must not depend on timing, or an example would not run the same way twice (hypothesis replays
        examples' prefixes and expects the same draws)."""
        loader = self.engine.core.loader
        if loader is not None:
            concurrent.futures.wait([*loader.pending, *loader.writing])

    def _check_finished(self, out):
        if not out.finished:
            return
        name, prompt = self.requests[out.request_id]
        if out.finish_reason == "error":  # its adapter was unloaded before it started
            assert out.request_id in self.unloaded_while_waiting and "unloaded" in out.error, out.error
        else:
            assert out.finish_reason == "length", (out.finish_reason, out.error)
            path = None if name is None else self.path_of[self.admitted[out.request_id]]
            assert out.token_ids == self.world.alone(path, prompt), (out.request_id, name, path)
        self._ended(out.request_id)

    def _ended(self, rid):
        self.requests.pop(rid)
        self.admitted.pop(rid, None)

    # ---- invariants --------------------------------------------------------------------------------
    def _snapshot(self):
        cache = self.adapters.cache
        return self.adapters.loras, self.adapters.pinned, {n: self.adapters.identity_for(n) for n in self.adapters.loras}, \
            len(cache)

    @invariant()
    def names_are_what_was_loaded(self):
        assert self.adapters.loras == list(self.loaded)
        assert all(self.engine.is_lora(n) == (n in self.loaded) for n in NAMES)
        assert {n: self.adapters.identity_for(n) for n in self.loaded} == self.current

    @invariant()
    def pinned_adapters_hold_their_slots(self):
        cache = self.adapters.cache
        assert self.adapters.pinned == [n for n in self.loaded if n in self.pinned]
        for name in self.pinned:
            ref = self.current[name]
            assert cache.slot_of(ref) is not None and cache.in_host(ref)

    @invariant()
    def tiers_stay_within_their_limits(self):
        cache = self.adapters.cache
        assert len(cache.active) <= MAX_LORAS and len(cache.host) <= MAX_CPU_LORAS
        assert set(cache.active) <= set(cache.host)
        named = set(self.current.values())
        for ref in self.adapters.store.retiring:  # what no name points to lives only while requests use it
            assert ref not in named and cache.in_use(ref)
        assert set(cache.host) | set(cache.active) <= named | self.adapters.store.retiring

    def teardown(self):
        """Every request ends (once nothing is pinned: requests for an adapter that cannot get a slot beside the
        pinned ones wait for an unpin); unloading every name then leaves nothing behind (the next example
        starts here)."""
        for name in list(self.pinned):
            self.pin_or_unpin(name, False)
        for _ in range(200):
            if not self.engine.has_unfinished_requests():
                break
            self.step()
        assert not self.requests and not self.engine.has_unfinished_requests()
        for name in list(self.loaded):
            assert self.world.llm.unload_adapter(name)
        cache, blocks = self.adapters.cache, self.engine.core.block_manager
        assert len(cache) == 0 and not self.adapters.store.retiring and cache.host_bytes == 0
        assert blocks.num_free_blocks == blocks.num_blocks


def test_the_adapter_lifecycle_against_a_reference(world):
    chosen = settings.default  # `--hypothesis-profile=slow`: thousands of examples; by default a few hundred
    if chosen.max_examples < 1000:
        chosen = settings(chosen, max_examples=300, stateful_step_count=40)
    # database=None: examples share one engine, so a failure is kept as a plain test below, not replayed
    run_state_machine_as_test(lambda: Lifecycle(world), settings=settings(
        chosen, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))


# ---- sequences found once, kept as plain tests -----------------------------------------------------
def test_reload_unload_load_while_the_first_version_runs(world):
    """The six steps: R1 runs on x (a0); x is reloaded in place (a1), unloaded, and loaded again (a2); R2 on
    x gets a2's tokens; when R1 ends (on a0), x is still there."""
    llm, (a0, a1, a2, _) = world.llm, world.paths
    engine = llm.engine
    long = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert llm.load_adapter("x", a0)
    r1 = engine.add_request([5, 6, 7], long, "x")
    engine.step()  # R1 is running on a0
    assert llm.load_adapter("x", a1, replace=True)
    assert llm.unload_adapter("x") == LoRAStatus.SUCCESS
    assert llm.load_adapter("x", a2)
    r2 = engine.add_request([9, 3, 11, 4, 8], PARAMS, "x")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs[r2].token_ids == world.alone(2, (9, 3, 11, 4, 8))
    assert outs[r1].token_ids == hf_greedy(world.base, a0, [5, 6, 7], 8)
    assert llm.is_lora("x") and llm.generate([9, 3, 11, 4, 8], PARAMS, adapters="x")[0].token_ids == outs[r2].token_ids
    assert llm.unload_adapter("x") and len(engine.adapters.cache) == 0


def test_a_request_that_waited_through_a_reload_reads_no_block_of_the_old_identity(world):
    """Found by the state machine: a request looked at for admission under one identity (its block hashes
    computed with that identity's salt) and admitted after a reload in place must not read the blocks the
    old identity cached for the same prompt."""
    llm, (a0, a1, a2, a3) = world.llm, world.paths
    engine, prompt = llm.engine, (9, 3, 11, 4, 8)  # one full block of 4 tokens
    for name, path in (("x", a0), ("y", a2), ("z", a3)):
        assert llm.load_adapter(name, path)
    assert llm.generate(list(prompt), PARAMS, adapters="x")[0].token_ids == world.alone(0, prompt)  # cached now
    assert llm.pin_adapter("y") and llm.pin_adapter("z")  # both slots: x's next request must wait
    waiting = engine.add_request(list(prompt), PARAMS, "x")
    engine.step()
    assert engine.core.sequence(waiting).adapter_ref is None  # looked at, not admitted
    assert llm.load_adapter("x", a1, replace=True) and llm.unpin_adapter("y")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs[waiting].token_ids == world.alone(1, prompt)
    for name in ("x", "y", "z"):
        assert llm.unload_adapter(name)
