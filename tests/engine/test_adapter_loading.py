"""Adapter files are read on the loader thread, never on the step loop: an adapter evicted from host memory is
read back while the running streams keep stepping, and its requests wait in the queue until it is in."""
import threading
import time

import pytest

from loramux import LoRAConfig, SamplingParams
from loramux.adapters.store import AdapterStore
from test_llm import checkpoints, make_llm, prompts  # noqa: F401  (the module fixture)

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture()
def reads(monkeypatch):
    """The thread of every adapter read: AdapterStore.read (files -> checked host tensors) and read_back (an
    evicted identity: its files, or the spill file's copy)."""
    threads, real_read, real_back = [], AdapterStore.read, AdapterStore.read_back

    def read(self, name, source, *known):
        threads.append(threading.current_thread().name)
        return real_read(self, name, source, *known)

    def read_back(self, ref):
        threads.append(threading.current_thread().name)
        return real_back(self, ref)

    monkeypatch.setattr(AdapterStore, "read", read)
    monkeypatch.setattr(AdapterStore, "read_back", read_back)
    return threads


def test_no_adapter_is_read_on_the_step_loop(checkpoints, reads):  # noqa: F811
    _, path, adapters = checkpoints["llama"]
    names = {f"{kind}-{i}": adapters[kind] for i in range(2) for kind in adapters}  # 8 adapters, 3 in host memory
    llm = make_llm(path, names, lora=LoRAConfig(max_loras=2, max_cpu_loras=3, max_lora_rank=64))
    alone = make_llm(path, names, lora=LoRAConfig(max_loras=8, max_cpu_loras=8, max_lora_rank=64))
    reads.clear()  # the loads above read on the caller's thread, before any step
    rows = [list(names)[i % len(names)] for i in range(12)]
    batch = prompts(12, seed=5)
    got = llm.generate(batch, PARAMS, adapters=rows)
    assert reads and all(t.startswith("loramux-adapter-loader") for t in reads), set(reads)
    assert llm.engine.adapters.stats["loads"] >= len(names) + 5  # evicted adapters came back, from the loader
    assert [o.token_ids for o in got] == [o.token_ids for o in alone.generate(batch, PARAMS, adapters=rows)]


def test_running_streams_keep_stepping_while_an_adapter_is_read(checkpoints, monkeypatch):  # noqa: F811
    """The read of "hot" is held open (a slow store) until "other" has streamed 5 tokens: the step loop never
    waits for it, whatever the machine's speed."""
    _, path, adapters = checkpoints["llama"]
    llm = make_llm(path, {"hot": adapters["r4"], "cold": adapters["r8_rslora"], "other": adapters["r16_patterns"]},
                   lora=LoRAConfig(max_loras=1, max_cpu_loras=2, max_lora_rank=64))
    engine, real, streamed = llm.engine, AdapterStore.read_back, threading.Event()

    def slow_read(self, ref):
        assert streamed.wait(60), "the step loop did not stream while the adapter was read"
        return real(self, ref)

    monkeypatch.setattr(AdapterStore, "read_back", slow_read)
    assert not engine.adapters.cache.in_host(engine.adapters.identity_for("hot"))  # evicted by the later loads
    other = engine.add_request([5, 6, 7], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), "other")
    engine.step()
    cold = engine.add_request([5, 6, 7], PARAMS, "hot")
    tokens = 1
    while engine.core.sequence(cold).adapter_ref is None:
        tokens = max([tokens] + [len(o.token_ids) for o in engine.step() if o.request_id == other])
        if tokens >= 5:
            streamed.set()  # only now may the read finish
    assert streamed.is_set()  # "other" streamed 5 tokens while "hot" was being read
