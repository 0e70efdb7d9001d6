"""The adapter tiers under pressure and under change: a load into a host tier full of adapters in use waits
instead of failing, the head of the queue always gets its adapter in, and files that changed on disk are a
new version of the adapter (fresh weights, a cold prefix cache), never the old identity with new weights."""
import shutil

import pytest

from loramux import LoRAConfig, SamplingParams
from loramux.adapters.cache import AdapterCache, Readiness
from loramux.adapters.status import LoRAStatus
from loramux.engine.adapter_loader import AdapterLoader
from test_llm import checkpoints, make_llm, prompts  # noqa: F401  (the module fixture)

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


def alone(path, adapter_dir, prompt, params=PARAMS):
    """The tokens of `prompt` on a fresh engine with only this adapter: the oracle."""
    llm = make_llm(path, {"x": adapter_dir})
    return llm.generate([prompt], params, adapters=["x"], use_tqdm=False)[0].token_ids


def copy_over(src, dst):
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(f"{src}/{name}", f"{dst}/{name}")


def run_until_done(engine, request_ids, max_steps=2000):
    """Step until every request in `request_ids` has finished; their outputs by id."""
    done = {}
    for _ in range(max_steps):
        for out in engine.step():
            if out.request_id in request_ids and out.finished:
                done[out.request_id] = out
        if set(done) == set(request_ids):
            return done
        engine.core.loader.wait(0.01) if engine.core.loading else None
    raise AssertionError(f"not finished after {max_steps} steps: {set(request_ids) - set(done)}")


def test_files_changed_on_disk_are_a_new_version_with_a_cold_prefix_cache(checkpoints, tmp_path):  # noqa: F811
    _, path, adapters = checkpoints["llama"]
    upd = shutil.copytree(adapters["r4"], tmp_path / "upd")
    llm = make_llm(path, {"upd": upd, "other": adapters["r8_rslora"]},
                   lora=LoRAConfig(max_loras=1, max_cpu_loras=1, max_lora_rank=64))
    store, blocks = llm.engine.adapters.store, llm.engine.core.block_manager
    prompt = prompts(1, seed=3)[0] * 5  # several full blocks: a second request reads them from the prefix cache
    first = llm.generate([prompt], PARAMS, adapters=["upd"], use_tqdm=False)[0].token_ids
    hits = blocks.hits
    assert llm.generate([prompt], PARAMS, adapters=["upd"], use_tqdm=False)[0].token_ids == first
    assert blocks.hits > hits  # the prefix cache holds upd's blocks
    old = store.current("upd")
    copy_over(adapters["r16_patterns"], upd)
    llm.generate([prompt], PARAMS, adapters=["other"], use_tqdm=False)  # pushes upd out of host memory
    assert not store.cache.in_host(old)
    hits = blocks.hits
    got = llm.generate([prompt], PARAMS, adapters=["upd"], use_tqdm=False)[0].token_ids
    assert got == alone(path, adapters["r16_patterns"], prompt) != first  # the files as they are now
    assert blocks.hits == hits  # and none of the old version's cached blocks
    assert store.current("upd") != old and old not in store  # a new version; the old one is gone


def test_changed_files_that_no_longer_load_fail_their_requests_with_the_reason(checkpoints, tmp_path):  # noqa: F811
    _, path, adapters = checkpoints["llama"]
    upd = shutil.copytree(adapters["r4"], tmp_path / "upd")
    llm = make_llm(path, {"upd": upd, "other": adapters["r8_rslora"]},
                   lora=LoRAConfig(max_loras=1, max_cpu_loras=1, max_lora_rank=64))
    (upd / "adapter_model.safetensors").write_bytes(b"not safetensors")  # upd is not in host memory now
    out = llm.generate([[5, 6, 7]], PARAMS, adapters=["upd"], use_tqdm=False)[0]
    assert out.finish_reason == "error" and "not a safetensors file" in out.error


def test_a_load_into_a_host_tier_full_of_adapters_in_use_waits_instead_of_failing(checkpoints, monkeypatch):  # noqa: F811
    """max_cpu_loras=1 and "a" running: a runtime load of "c" used to be refused (400); now it is registered at
    once and read into host memory when "a"'s request is done, and "c"'s request gets c's tokens. The copy
    built at the load waits in the spill file: the files are not read and built a second time."""
    _, path, adapters = checkpoints["llama"]
    llm = make_llm(path, {"a": adapters["r4"]}, lora=LoRAConfig(max_loras=1, max_cpu_loras=1, max_lora_rank=64))
    engine = llm.engine
    running = engine.add_request([5, 6, 7], LONG, "a")
    engine.step()
    loaded = engine.core.load_adapter_async("c", adapters["r16_patterns"])
    while not loaded.done():
        engine.step()
        engine.core.loader.wait(0.01)
    assert loaded.result().status is LoRAStatus.SUCCESS, loaded.result()
    assert "requests in use hold the room" in loaded.result().message
    taken = _read_back_digests(monkeypatch)
    c = engine.add_request([9, 8, 7], PARAMS, "c")
    done = run_until_done(engine, {running, c})
    assert taken == []  # c's read-back took the parked copy
    assert done[c].finish_reason == "length" and done[c].token_ids == alone(path, adapters["r16_patterns"], [9, 8, 7])
    assert done[running].token_ids == alone(path, adapters["r4"], [5, 6, 7], LONG)


def test_a_pinned_load_waits_for_room_and_a_tier_of_pins_is_a_clear_error(checkpoints):  # noqa: F811
    _, path, adapters = checkpoints["llama"]
    llm = make_llm(path, {"a": adapters["r4"]}, lora=LoRAConfig(max_loras=1, max_cpu_loras=1, max_lora_rank=64))
    engine = llm.engine
    running = engine.add_request([5, 6, 7], LONG, "a")
    engine.step()
    pinned = engine.core.load_adapter_async("p", adapters["r8_rslora"], pinned=True)
    finished = set()
    for _ in range(2000):
        finished |= {o.request_id for o in engine.step() if o.finished}
        if pinned.done():
            break
        engine.core.loader.wait(0.01)
    assert pinned.result().status is LoRAStatus.SUCCESS and engine.adapters.pinned == ["p"]
    assert running in finished  # it waited for "a"'s request to end
    blocked = engine.core.load_adapter_async("q", adapters["r16_patterns"], pinned=True)
    while not blocked.done():
        engine.step()
        engine.core.loader.wait(0.01)
    result = blocked.result()  # at once: waiting for requests would not help
    assert result.status is LoRAStatus.LOAD_ERROR and "'q'" in result.message and "(p) are pinned" in result.message


def test_the_head_of_the_queue_gets_its_adapter_in_while_others_keep_arriving(checkpoints):  # noqa: F811
    """Host memory holds 2 adapters, both kept in use by a steady stream of requests; a request for a third
    adapter reaches the head of the queue and gets it in (new work for the others waits meanwhile)."""
    _, path, adapters = checkpoints["llama"]
    names = {"a": adapters["r4"], "b": adapters["r8_rslora"], "c": adapters["r16_patterns"]}
    llm = make_llm(path, names, lora=LoRAConfig(max_loras=2, max_cpu_loras=2, max_lora_rank=64), max_wait_steps=4)
    engine = llm.engine
    assert not engine.adapters.cache.in_host(engine.adapters.identity_for("a"))  # "c" and "b" are in: "a" must come back
    busy = [engine.add_request([5, 6, 7], LONG, name) for name in ("b", "c")]
    engine.step()
    cold = engine.add_request([4, 4, 4], PARAMS, "a")
    for step in range(3000):
        for out in engine.step():
            if out.request_id == cold and out.finished:
                assert out.token_ids == alone(path, adapters["r4"], [4, 4, 4])
                return
        if step % 2 == 0:  # keep "b" and "c" in use: a new request for each, every other step
            busy += [engine.add_request([5, 6, 7], LONG, name) for name in ("b", "c")]
        engine.core.loader.wait(0.001) if engine.core.loading else None
    pytest.fail("the request for the adapter that was not in host memory never ran")


def test_a_read_ahead_waits_for_room_the_next_requests_do_not_want_and_the_heads_read_does_not():
    """Reads ahead of their requests (S-LoRA's prefetch) that could only take the room of adapters the next
    waiting requests want would be evicted again before they run, and read once more: they wait. With a host
    tier no larger than the slots, half the reads of a 64-adapter run were such (benchmarks/multitenant.py)."""

    class Store:  # what the loader uses of an AdapterStore: its cache, and reads back (recorded)
        def __init__(self):
            self.cache, self.read = AdapterCache(1, 2), []

        def read_back(self, ref):
            self.read.append(ref)
            return ref

    store = Store()
    cache = store.cache
    cache.add("a"), cache.add("b"), cache.acquire("a"), cache.register("c", 0), cache.register("d", 0)
    loader = AdapterLoader(store, max_prefetch=4)
    cache.want(frozenset({"b", "c", "d"}))
    assert loader.readiness("c") is Readiness.READING and not loader.pending  # b's room is wanted: no read
    assert loader.readiness("d", first=True) is Readiness.READING  # the head of the queue's read goes ahead
    loader.pending[0].result(timeout=60)
    cache.want(frozenset({"c"}))  # b is no longer wanted: c's read ahead may take its room
    assert loader.readiness("c") is Readiness.READING and len(loader.pending) == 2
    loader.pending[1].result(timeout=60)
    assert store.read == ["d", "c"]
    loader.close()


def test_loading_the_same_files_again_reads_them_only_if_they_changed(checkpoints, tmp_path, monkeypatch):  # noqa: F811
    """A load of a loaded name from its own path is "already loaded" and reads nothing while the files are as
    they were; after they changed, it is a new version of the adapter (the old one finishes its requests)."""
    from loramux.adapters.store import AdapterStore

    _, path, adapters = checkpoints["llama"]
    upd = shutil.copytree(adapters["r4"], tmp_path / "upd")
    llm = make_llm(path, {"upd": upd})
    reads, real = [], AdapterStore.read
    def read(self, name, source, *known):
        reads.extend([name] if name == "upd" else [])
        return real(self, name, source, *known)

    monkeypatch.setattr(AdapterStore, "read", read)
    old = llm.engine.adapters.current("upd")
    again = llm.load_adapter("upd", str(upd))
    assert again and "already loaded" in again.message and reads == []
    copy_over(adapters["r16_patterns"], upd)
    changed = llm.load_adapter("upd", str(upd))
    assert changed and reads == ["upd"] and llm.engine.adapters.current("upd") != old
    prompt = [5, 6, 7]
    assert llm.generate([prompt], PARAMS, adapters=["upd"], use_tqdm=False)[0].token_ids == \
        alone(path, adapters["r16_patterns"], prompt)
    (upd / "adapter_config.json").touch()  # a new look, the same bytes: read, found equal, nothing changes
    assert "already loaded" in llm.load_adapter("upd", str(upd)).message and reads == ["upd", "upd"]
    assert "already loaded" in llm.load_adapter("upd", str(upd)).message and reads == ["upd", "upd"]


def _flip_tensor_bytes(file):
    """Change an adapter's weights in place, its size, mtime and inode as they were (as `cp -p` over it would)."""
    import os
    info = os.stat(file)
    with open(file, "r+b") as f:
        f.seek(-64, os.SEEK_END)
        tail = f.read(64)
        f.seek(-64, os.SEEK_END)
        f.write(bytes(b ^ 0x80 if i % 4 == 3 else b for i, b in enumerate(tail)))  # sign bits of fp32 values
    os.utime(file, ns=(info.st_atime_ns, info.st_mtime_ns))
    after = os.stat(file)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (info.st_size, info.st_mtime_ns, info.st_ino)


def _read_back_digests(monkeypatch):
    """Whether each read of adapter files took a digest (True) or trusted an unchanged look (False)."""
    from loramux.adapters import store as store_module

    taken, real = [], store_module.read_adapter
    def read_adapter(*args, digest=True, **kwargs):
        taken.append(digest)
        return real(*args, digest=digest, **kwargs)

    monkeypatch.setattr(store_module, "read_adapter", read_adapter)
    return taken


def _digests_alone(monkeypatch):
    """Each hash of adapter files that builds nothing (a read-back checking the spill file's copy)."""
    from loramux.adapters import store as store_module

    taken, real = [], store_module.digest_adapter
    monkeypatch.setattr(store_module, "digest_adapter", lambda *a, **k: taken.append(True) or real(*a, **k))
    return taken


@pytest.mark.parametrize("spill", [0, 1 << 30], ids=["files", "spill"])
def test_a_read_back_of_files_that_look_unchanged_is_not_hashed_again(checkpoints, tmp_path, monkeypatch, spill):  # noqa: F811
    """With the spill file on, not even parsed and built: the copy built at the load comes back from there,
    once its files are hashed while their look cannot be trusted yet, and with no hash after that."""
    from loramux.adapters import files

    _, path, adapters = checkpoints["llama"]
    upd = shutil.copytree(adapters["r4"], tmp_path / "upd")
    llm = make_llm(path, {"upd": upd, "other": adapters["r8_rslora"]},
                   lora=LoRAConfig(max_loras=1, max_cpu_loras=1, max_lora_rank=64, max_spill_bytes=spill))
    store, prompt = llm.engine.adapters.store, [5, 6, 7]
    taken, hashed = _read_back_digests(monkeypatch), _digests_alone(monkeypatch)
    first = store.current("upd")
    llm.generate([prompt], PARAMS, adapters=["upd"], use_tqdm=False)
    # written a moment ago: a change within the same clock tick could hide, so hashed
    assert (taken, hashed) == (([], [True]) if spill else ([True], []))
    monkeypatch.setattr(files, "RACY_NS", -10**18)  # as if every file were long untouched
    llm.generate([prompt], PARAMS, adapters=["other"], use_tqdm=False)
    del taken[:], hashed[:]
    got = llm.generate([prompt], PARAMS, adapters=["upd"], use_tqdm=False)[0].token_ids
    assert (taken, hashed) == (([], []) if spill else ([False], [])) and store.current("upd") == first
    assert got == alone(path, adapters["r4"], prompt)
    assert (store.spill.read(store.current("other")) is not None) == bool(spill)  # it has left host memory now


def test_a_rewrite_that_keeps_size_mtime_and_inode_is_still_a_new_version(checkpoints, tmp_path, monkeypatch):  # noqa: F811
    """ctime tells: nothing sets it back. (With the look trusted, a signature without it would serve the new
    bytes under the old identity.)"""
    from loramux.adapters import files

    _, path, adapters = checkpoints["llama"]
    upd = shutil.copytree(adapters["r4"], tmp_path / "upd")
    llm = make_llm(path, {"upd": upd, "other": adapters["r8_rslora"]},
                   lora=LoRAConfig(max_loras=1, max_cpu_loras=1, max_lora_rank=64))
    monkeypatch.setattr(files, "RACY_NS", -10**18)
    store, prompt = llm.engine.adapters.store, [5, 6, 7]
    old = store.current("upd")
    before = llm.generate([prompt], PARAMS, adapters=["upd"], use_tqdm=False)[0].token_ids
    llm.generate([prompt], PARAMS, adapters=["other"], use_tqdm=False)  # upd leaves host memory
    _flip_tensor_bytes(upd / "adapter_model.safetensors")
    taken = _read_back_digests(monkeypatch)
    got = llm.generate([prompt], PARAMS, adapters=["upd"], use_tqdm=False)[0].token_ids
    assert True in taken and store.current("upd") != old
    assert got == alone(path, str(upd), prompt) != before


def test_a_signature_is_trusted_only_when_its_files_were_untouched_well_before_it():
    from loramux.adapters.files import RACY_NS, Signature, unchanged

    stat = (10, 5_000, 5_000, 7, 1)  # size, mtime_ns, ctime_ns, inode, device
    old = Signature((stat, None, None), 5_000 + RACY_NS + 1)
    assert unchanged(Signature((stat, None, None), 10**19), old)
    assert not unchanged(Signature((stat, None, None), 10**19), old._replace(taken_ns=5_000 + RACY_NS))  # racy
    assert not unchanged(Signature(((10, 5_000, 6_000, 7, 1), None, None), 10**19), old)  # ctime moved
    assert not unchanged(Signature((None, None, None), 10**19), Signature((None, None, None), 10**19))
    assert not unchanged(Signature((stat, None, None), 10**19), None)
