"""Admission and adapter files under pressure, as a model-based test: hypothesis drives real engines (tiny
random model, fp32) whose host tier is as small as their device slots or a little larger, by count or by
bytes, with 8 adapter names, 2-4x the host slots, through loads (pinned or not, off the step loop as the
server's), unloads, pins, bursts of requests (n copies of one), aborts, steps, and adapter files rewritten
on disk between steps. Invariant: every request for a loaded adapter completes (none fails for want of
room), with the greedy tokens HF + PEFT give for exactly one version of its adapter's files: one the
directory held since the name was loaded, computed fresh (no cached block of another version). At the end,
with pins lifted, nothing is left waiting.
"""
from __future__ import annotations

import concurrent.futures
import functools
import shutil

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from conftest import hf_greedy, save_checkpoint, save_peft_adapter, tiny_llama
from loramux import LoRAConfig, LoRAStatus, SamplingParams
from loramux.adapters.files import read_adapter
from loramux.llm import LLM

NAMES = tuple(f"a{i}" for i in range(8))
PROMPTS = ((5, 6, 7), (9, 3, 11, 4, 8, 2, 2, 6, 1), (20, 21))
MAX_TOKENS = 3
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, 4 positions, 2 KV heads of 16, fp32
FILES = ("adapter_config.json", "adapter_model.safetensors")


class World:
    """Shared by every example: the base model, 4 versions of adapter files, a directory per name (rewritten
    from the versions), one engine per host-tier configuration, and the oracle."""

    def __init__(self, root):
        self.base = tiny_llama()
        self.versions = [save_peft_adapter(self.base, root / f"v{i}", seed=70 + i, r=(4, 8)[i % 2]) for i in range(4)]
        self.digests = {read_adapter(v).digest: i for i, v in enumerate(self.versions)}
        self.dirs = {name: root / "served" / name for name in NAMES}
        for path in self.dirs.values():
            path.mkdir(parents=True)
        model = save_checkpoint(self.base, root / "model")
        probe = LLM(model=model, dtype="float32", lora=LoRAConfig(max_loras=1, max_lora_rank=8), kv_cache_memory=2**20)
        assert probe.load_adapter("v1", self.versions[1])
        size = probe.engine.adapters.host_bytes  # a rank-8 version's bytes in host memory (rank 4: half)
        configs = [(2, 2, None), (2, 3, None), (2, 4, None), (2, 4, int(2.5 * size))]
        self.engines = {config: LLM(model=model, dtype="float32", max_num_seqs=4, block_size=4, max_model_len=16,
                                    prefill_slowdown_cap=None,  # steps that do not depend on measured times
                                    kv_cache_memory=10 * BLOCK_BYTES,  # a burst of 4 overflows it: preemption
                                    lora=LoRAConfig(max_loras=config[0], max_cpu_loras=config[1],
                                                    max_cpu_lora_bytes=config[2], max_lora_rank=8))
                        for config in configs}

    def write(self, name: str, version: int) -> None:
        for file in FILES:
            shutil.copy(f"{self.versions[version]}/{file}", self.dirs[name] / file)

    @functools.lru_cache(maxsize=None)
    def alone(self, version: int | None, prompt: tuple[int, ...]) -> list[int]:
        return hf_greedy(self.base, None if version is None else self.versions[version], list(prompt), MAX_TOKENS)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return World(tmp_path_factory.mktemp("pressure"))


class Pressure(RuleBasedStateMachine):
    def __init__(self, world: World):
        super().__init__()
        self.world = world
        self.on_disk = {name: 0 for name in NAMES}  # name -> the version its directory holds now
        self.history: dict[str, set[int]] = {}  # loaded name -> every version its directory held since
        self.loads: dict[str, concurrent.futures.Future] = {}  # name -> its runtime load, not answered yet
        self.pinned: set[str] = set()
        self.requests: dict[str, tuple[str | None, tuple[int, ...]]] = {}  # live request -> (adapter, prompt)
        self.version_of: dict[str, int] = {}  # admitted request -> the version of the identity it runs on
        self.unloaded_while_waiting: set[str] = set()

    @initialize(config=st.sampled_from(range(4)), versions=st.lists(st.integers(0, 3), min_size=8, max_size=8))
    def start(self, config, versions):
        self.llm = list(self.world.engines.values())[config]
        self.engine = self.llm.engine
        self.adapters = self.engine.adapters
        self._clean()  # (a no-op after an example that passed: its teardown left the engine so)
        self.engine.reset_prefix_cache()
        for name, version in zip(NAMES, versions):
            self.rewrite_files(name, version)

    # ---- adapters ------------------------------------------------------------------------------------
    @rule(name=st.sampled_from(NAMES), pinned=st.booleans())
    def load(self, name, pinned):
        if name in self.loads:
            return
        self._settle_reads()
        future = self.engine.core.load_adapter_async(name, str(self.world.dirs[name]), pinned=pinned)
        if name not in self.adapters.loras:
            self.history[name] = {self.on_disk[name]}
        self.loads[name] = future
        self._answered()

    @rule(name=st.sampled_from(NAMES))
    def unload(self, name):
        if name in self.loads:
            return
        result = self.llm.unload_adapter(name)
        if name not in self.history:
            assert result == LoRAStatus.UNLOAD_NAME_NONEXISTENT
            return
        assert result == LoRAStatus.SUCCESS
        del self.history[name]
        self.pinned.discard(name)
        for rid, (adapter, _) in self.requests.items():
            if adapter == name and rid not in self.version_of:
                self.unloaded_while_waiting.add(rid)

    @rule(name=st.sampled_from(NAMES), pin=st.booleans())
    def pin_or_unpin(self, name, pin):
        if name in self.loads or name not in self.history:
            return
        result = self.llm.pin_adapter(name) if pin else self.llm.unpin_adapter(name)
        if result and pin:
            self.pinned.add(name)
        elif not pin:
            self.pinned.discard(name)
        else:  # the slots or the host tier are full of pinned adapters, or requests use the room now
            assert result.status in (LoRAStatus.PIN_ERROR, LoRAStatus.LOAD_BUSY), result

    @rule(name=st.sampled_from(NAMES), version=st.integers(0, 3))
    def rewrite_files(self, name, version):
        """The files change on disk between steps (never in the middle of a read)."""
        self._settle_reads()
        self.world.write(name, version)
        self.on_disk[name] = version
        if name in self.history:
            self.history[name].add(version)

    # ---- requests ------------------------------------------------------------------------------------
    @rule(name=st.sampled_from((None, *NAMES)), prompt=st.sampled_from(PROMPTS), n=st.integers(1, 4))
    def burst(self, name, prompt, n):
        """n copies of one request (a request with n > 1 is n engine requests)."""
        if name is not None and (name not in self.history or name in self.loads):
            return
        for _ in range(n):
            self.requests[self.engine.add_request(list(prompt), PARAMS, name)] = (name, prompt)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        self.engine.abort_request(rid)
        self._ended(rid)

    @rule(steps=st.integers(1, 6))
    def run(self, steps):
        for _ in range(steps):
            self.step()

    def step(self):
        self._settle_reads()
        for out in self.engine.step():
            self._check_finished(out)
        self._answered()
        for rid in self.requests:
            seq = self.engine.core.sequence(rid)
            if seq is not None and seq.adapter_ref is not None and rid not in self.version_of:
                digest = self.adapters.store.digest(seq.adapter_ref)
                self.version_of[rid] = self.world.digests[digest]  # a known version, not a mix
                assert self.version_of[rid] in self.history[self.requests[rid][0]]

    def _settle_reads(self):
        """Every read the loader started, and the spill file's writes, have finished before the next rule (as in
        test_adapter_lifecycle): no step may depend on their timing, for hypothesis to replay an example."""
        loader = self.engine.core.loader
        concurrent.futures.wait([*loader.pending, *loader.writing])

    def _answered(self):
        for name, future in list(self.loads.items()):
            if not future.done():
                continue
            del self.loads[name]
            result = future.result()
            assert result or result.status in (LoRAStatus.PIN_ERROR, LoRAStatus.LOAD_ERROR), result
            if not result:  # a pin the slots or host tier (full of pinned adapters) cannot hold: nothing loaded
                assert "pinned" in result.message, result
                if name not in self.adapters.loras:
                    del self.history[name]
            elif name in self.adapters.pinned:
                self.pinned.add(name)

    def _check_finished(self, out):
        if not out.finished:
            return
        name, prompt = self.requests[out.request_id]
        if out.finish_reason == "error":
            assert out.request_id in self.unloaded_while_waiting and "unloaded" in out.error, out.error
        else:
            assert out.finish_reason == "length", (out.finish_reason, out.error)
            version = None if name is None else self.version_of[out.request_id]
            assert out.token_ids == self.world.alone(version, prompt), (out.request_id, name, version)
        self._ended(out.request_id)

    def _ended(self, rid):
        self.requests.pop(rid)
        self.version_of.pop(rid, None)

    # ---- invariants ----------------------------------------------------------------------------------
    @invariant()
    def tiers_stay_within_their_budgets(self):
        cache, config = self.adapters.cache, self.adapters.config
        assert len(cache.active) <= config.max_loras and len(cache.host) <= config.max_cpu_loras
        assert config.max_cpu_lora_bytes is None or cache.host_bytes <= config.max_cpu_lora_bytes
        assert set(cache.active) <= set(cache.host)

    def _clean(self):
        """Nothing running, loading, pinned or loaded."""
        for rid in self.engine.core.abort_all():
            self.engine.abort_request(rid)
        while self.engine.core.loader.busy:
            self._settle_reads()
            self.engine.step()
        for name in self.adapters.pinned:
            self.llm.unpin_adapter(name)
        for name in self.adapters.loras:
            self.llm.unload_adapter(name)

    def teardown(self):
        """With pins lifted, every request ends and every load is answered: nothing waits forever. Unloading
        every name leaves nothing behind (the next example starts here)."""
        for _ in range(400):
            for name in self.adapters.pinned:  # (pinned loads still waiting pin as they finish)
                self.llm.unpin_adapter(name)
            self.pinned.clear()
            if not self.engine.has_unfinished_requests() and not self.loads:
                break
            self.step()
        assert not self.requests and not self.loads and not self.engine.has_unfinished_requests()
        for name in self.adapters.loras:
            assert self.llm.unload_adapter(name)
        cache, blocks = self.adapters.cache, self.engine.core.block_manager
        assert len(cache) == 0 and cache.host_bytes == 0 and blocks.num_free_blocks == blocks.num_blocks


def test_admission_and_files_under_pressure_against_a_reference(world):
    chosen = settings.default  # `--hypothesis-profile=slow` (test_adapter_lifecycle.py): thousands of examples
    if chosen.max_examples < 1000:
        chosen = settings(chosen, max_examples=120, stateful_step_count=40)
    run_state_machine_as_test(lambda: Pressure(world), settings=settings(
        chosen, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
