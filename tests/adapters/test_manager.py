"""LoRAModel (a LoRAManager on plain HF models), against HF transformers + PEFT running each adapter alone."""
import copy
import gc
import os
import shutil

import pytest
import torch

from conftest import ADAPTER_KINDS, MODEL_FACTORIES, peft_logits, save_peft_adapter
from loramux import LoRAConfig, LoRAModel, LoRAStatus

ATOL = 2e-5


def manager_for(base, **config):
    model = copy.deepcopy(base)
    return model, LoRAModel(model, LoRAConfig(**{"max_loras": 8, "max_lora_rank": 64, **config}))


@pytest.mark.parametrize("model_kind", list(MODEL_FACTORIES))
def test_mixed_batch_equals_peft_alone_row_by_row(model_kind, adapter_dirs):
    base = MODEL_FACTORIES[model_kind]()
    model, manager = manager_for(base)
    for kind in ADAPTER_KINDS:
        assert manager.load_adapter(f"{kind}={adapter_dirs[model_kind, kind]}") == LoRAStatus.SUCCESS
    rows = [None, *ADAPTER_KINDS, "r4", None, "r64_qv"]
    torch.manual_seed(1)
    input_ids = torch.randint(0, 128, (len(rows), 9))
    with torch.no_grad(), manager.batch(rows):
        ours = model(input_ids).logits
    for kind in dict.fromkeys(rows):
        expected = peft_logits(base, adapter_dirs[model_kind, kind] if kind else None, input_ids)
        for i, row_kind in enumerate(rows):
            if row_kind == kind:
                torch.testing.assert_close(ours[i], expected[i], atol=ATOL, rtol=1e-4, msg=f"row {i} ({kind})")
    base_logits = peft_logits(base, None, input_ids)
    assert all((ours[i] - base_logits[i]).abs().max() > 1e-3 for i, k in enumerate(rows) if k)


def test_switch_equals_mixed_path_and_reset_gives_base(adapter_dirs):
    base = MODEL_FACTORIES["llama"]()
    model, manager = manager_for(base)
    for kind in ("r4", "r16_patterns"):
        manager.load_adapter(f"{kind}={adapter_dirs['llama', kind]}")
    input_ids = torch.randint(0, 128, (2, 6))
    with torch.no_grad():
        with manager.batch(["r16_patterns", "r16_patterns"]):
            mixed = model(input_ids).logits
        manager.switch("r16_patterns")
        assert manager.active_adapter_name == "r16_patterns"
        torch.testing.assert_close(model(input_ids).logits, mixed)
        slot = manager.active_loras["r16_patterns"]
        manager.switch("r4")
        manager.switch("r16_patterns")
        assert manager.active_loras["r16_patterns"] == slot  # no copy: it kept its slot
        torch.testing.assert_close(model(input_ids).logits, mixed)
        manager.reset()
        torch.testing.assert_close(model(input_ids).logits, peft_logits(base, None, input_ids))


def test_rows_of_different_lengths_with_padding(adapter_dirs):
    base = MODEL_FACTORIES["llama"]()
    model, manager = manager_for(base)
    manager.load_adapter(f"a={adapter_dirs['llama', 'r8_rslora']}")
    long, short = torch.randint(0, 128, (1, 8)), torch.randint(0, 128, (1, 5))
    padded = torch.cat([long, torch.cat([short, torch.zeros(1, 3, dtype=torch.long)], 1)])
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    with torch.no_grad(), manager.batch(["a", None]):
        out = model(padded, attention_mask=mask).logits
    torch.testing.assert_close(out[0], peft_logits(base, adapter_dirs["llama", "r8_rslora"], long)[0], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(out[1, :5], peft_logits(base, None, short)[0], atol=ATOL, rtol=1e-4)


def test_has_weight_for_is_a_predicate(adapter_dirs, monkeypatch):
    model, manager = manager_for(MODEL_FACTORIES["llama"](), max_loras=1, max_cpu_loras=1)
    manager.load_adapter(f"qv={adapter_dirs['llama', 'r64_qv']}")
    assert not manager.has_weight_for("model.layers.0.self_attn.q_proj")  # nothing selected yet
    manager.switch("qv")
    host, active = manager.cache.host, manager.cache.active

    def no_reads(*_):
        raise AssertionError("has_weight_for read an adapter")

    monkeypatch.setattr(manager.store, "read", no_reads)
    assert manager.has_weight_for("model.layers.0.self_attn.q_proj")
    assert not manager.has_weight_for("model.layers.0.self_attn.k_proj")
    assert (manager.cache.host, manager.cache.active) == (host, active)  # nothing moved between tiers


def test_api_names_and_statuses(adapter_dirs, tmp_path):
    model, manager = manager_for(MODEL_FACTORIES["llama"](), max_loras=2, max_cpu_loras=2)
    path = adapter_dirs["llama", "r4"]
    assert manager.load_adapter(f"a={path}") == LoRAStatus.SUCCESS
    again = manager.load_adapter(f"a={path}")  # as MAX: the same path again is a success, and nothing is read
    assert again == LoRAStatus.SUCCESS and "already loaded from that path" in again.message
    result = manager.load_adapter(f"a={adapter_dirs['llama', 'r8_rslora']}")
    assert result == LoRAStatus.LOAD_NAME_EXISTS and "'a'" in result.message and path in result.message
    assert manager.load_adapter(path) == LoRAStatus.SUCCESS and manager.is_lora(path)  # bare path names itself
    assert manager.loras == ["a", path] and not manager.is_active_lora("a")
    assert manager.activate_adapter("a") == 0 and manager.is_active_lora("a")
    with pytest.raises(LookupError, match="ghost"):
        manager.activate_adapter("ghost")
    pinned = manager.pin_adapter("ghost")
    assert pinned == LoRAStatus.PIN_NAME_NONEXISTENT and "ghost" in pinned.message
    assert manager.unload_adapter("ghost") == LoRAStatus.UNLOAD_NAME_NONEXISTENT
    bad = manager.load_adapter(f"b={tmp_path}/missing")
    assert bad == LoRAStatus.LOAD_INVALID_PATH and "missing" in bad.message and not manager.is_lora("b")
    big = manager.load_adapter(f"big={adapter_dirs['llama', 'r64_qv']}")
    assert big == LoRAStatus.SUCCESS  # max_cpu_loras=2: the LRU without a slot leaves host memory
    in_host = manager.cache.in_host
    assert manager.is_lora(path) and not in_host(manager.identity_for(path)) and in_host(manager.identity_for("a"))
    assert manager.unload_adapter("a") == LoRAStatus.SUCCESS and not manager.is_lora("a")


def test_refused_adapters_report_why_and_change_nothing(adapter_dirs, tmp_path):
    base = MODEL_FACTORIES["llama"]()
    model, manager = manager_for(base, max_lora_rank=16)
    manager.load_adapter(f"ok={adapter_dirs['llama', 'r4']}")
    input_ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad(), manager.batch(["ok"]):
        before = model(input_ids).logits
    result = manager.load_adapter(f"big={adapter_dirs['llama', 'r64_qv']}")
    assert result == LoRAStatus.LOAD_INVALID_ADAPTER and "rank 64" in result.message and "max_lora_rank=16" in result.message
    biased = save_peft_adapter(base, tmp_path / "biased", bias="lora_only")
    result = manager.load_adapter(f"biased={biased}")
    assert result == LoRAStatus.LOAD_INVALID_ADAPTER and "trained biases" in result.message
    assert manager.loras == ["ok"]
    with torch.no_grad(), manager.batch(["ok"]):
        torch.testing.assert_close(model(input_ids).logits, before)


def test_evicted_adapter_reloads_from_disk_with_same_results(adapter_dirs):
    base = MODEL_FACTORIES["llama"]()
    model, manager = manager_for(base, max_loras=1, max_cpu_loras=1)
    manager.load_adapter(f"a={adapter_dirs['llama', 'r4']}")
    manager.load_adapter(f"b={adapter_dirs['llama', 'r8_rslora']}")
    assert not manager.cache.in_host("a")
    input_ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad(), manager.batch(["a"]):
        out = model(input_ids).logits
    torch.testing.assert_close(out, peft_logits(base, adapter_dirs["llama", "r4"], input_ids), atol=ATOL, rtol=1e-4)


def test_host_tier_in_bytes_keeps_many_small_adapters_and_evicts_for_a_big_one(adapter_dirs):
    base = MODEL_FACTORIES["llama"]()
    _, sizer = manager_for(base)
    for kind in ("r4", "r16_patterns"):
        sizer.load_adapter(f"{kind}={adapter_dirs['llama', kind]}")
    small, big = (sizer.cache._sizes[sizer.identity_for(kind)] for kind in ("r4", "r16_patterns"))
    assert big > 3 * small
    model, manager = manager_for(base, max_loras=1, max_cpu_loras=8, max_cpu_lora_bytes=big + small)
    for name in ("a", "b", "c"):  # three small ones fit where one big one would not leave room
        assert manager.load_adapter(f"{name}={adapter_dirs['llama', 'r4']}") == LoRAStatus.SUCCESS
    assert manager.load_adapter(f"big={adapter_dirs['llama', 'r16_patterns']}") == LoRAStatus.SUCCESS
    in_host = lambda name: manager.cache.in_host(manager.identity_for(name))  # noqa: E731
    assert [n for n in "abc" if in_host(n)] == ["c"] and manager.cache.host_bytes == big + small
    input_ids = torch.randint(0, 128, (2, 6))
    with torch.no_grad(), manager.batch(["a", "a"]):  # evicted "a" comes back from disk; "c" (the LRU) leaves
        out = model(input_ids).logits
    assert [n for n in ("a", "b", "c", "big") if in_host(n)] == ["a", "big"]
    torch.testing.assert_close(out, peft_logits(base, adapter_dirs["llama", "r4"], input_ids), atol=ATOL, rtol=1e-4)


def test_an_adapter_in_use_is_never_evicted_and_an_unload_frees_it_when_the_use_ends(adapter_dirs):
    model, manager = manager_for(MODEL_FACTORIES["llama"](), max_loras=1, max_cpu_loras=2)
    manager.load_adapter(f"a={adapter_dirs['llama', 'r4']}")
    manager.load_adapter(f"b={adapter_dirs['llama', 'r8_rslora']}")
    ref = manager.identity_for("a")
    with manager.batch(["a"]):
        assert manager.unload_adapter("a") == LoRAStatus.SUCCESS and not manager.is_lora("a")  # the name goes now
        assert ref in manager.store and manager.cache.slot_of(ref) == 0  # the weights stay under the batch
        with pytest.raises(RuntimeError, match="max_loras=1"):
            manager.activate_adapter("b")
    assert ref not in manager.store and manager.activate_adapter("b") == 0


def test_add_adapter_from_tensors(adapter_dirs):
    from loramux.adapters.files import read_adapter_dir

    base = MODEL_FACTORIES["qwen2"]()
    model, manager = manager_for(base)
    config, tensors = read_adapter_dir(adapter_dirs["qwen2", "r8_layers"])
    assert manager.add_adapter("mem", tensors, config) == LoRAStatus.SUCCESS
    input_ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad(), manager.batch(["mem"]):
        out = model(input_ids).logits
    torch.testing.assert_close(out, peft_logits(base, adapter_dirs["qwen2", "r8_layers"], input_ids), atol=ATOL, rtol=1e-4)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_unload_then_load_200_adapters_keeps_host_memory_flat(tmp_path):
    # Big enough (~2 MB each) that a leak of 200 copies (~400 MB) cannot hide in allocator noise.
    base = MODEL_FACTORIES["llama"](hidden_size=256, intermediate_size=512)
    path = save_peft_adapter(base, tmp_path / "a", r=64)
    model, manager = manager_for(base, max_loras=2, max_cpu_loras=4)

    def cycle(i):
        assert manager.load_adapter(f"a{i}={path}") == LoRAStatus.SUCCESS
        manager.activate_adapter(f"a{i}")
        assert manager.unload_adapter(f"a{i}") == LoRAStatus.SUCCESS

    for i in range(20):  # warm up allocator pools
        cycle(i)
    gc.collect()
    start = _rss_bytes()
    for i in range(20, 220):
        cycle(i)
    gc.collect()
    assert manager.loras == [] and manager.store._weights == {} and len(manager.cache) == 0
    assert _rss_bytes() - start < 40 * 2**20


def set_config(path, **changes):
    import json

    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({**config, **changes}, f)


def test_a_per_call_allow_pickle_holds_for_reloads_from_disk(adapter_dirs, tmp_path):
    from safetensors.torch import load_file

    base = MODEL_FACTORIES["llama"]()
    pickled = shutil.copytree(adapter_dirs["llama", "r4"], tmp_path / "pickled")
    torch.save(load_file(pickled / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    os.remove(pickled / "adapter_model.safetensors")
    model, manager = manager_for(base, max_loras=1, max_cpu_loras=1)
    assert manager.load_adapter("p", str(pickled), allow_pickle=True) == LoRAStatus.SUCCESS
    assert manager.load_adapter(f"q={adapter_dirs['llama', 'r8_rslora']}") == LoRAStatus.SUCCESS
    assert not manager.cache.in_host("p")  # evicted from host memory: the next use reads the .bin again
    input_ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad(), manager.batch(["p"]):
        out = model(input_ids).logits
    torch.testing.assert_close(out, peft_logits(base, adapter_dirs["llama", "r4"], input_ids), atol=ATOL, rtol=1e-4)


def test_unloading_the_selected_adapter_deselects_it(adapter_dirs):
    base = MODEL_FACTORIES["llama"]()
    model, manager = manager_for(base, max_loras=2)
    manager.load_adapter(f"a={adapter_dirs['llama', 'r4']}")
    manager.switch("a")
    ref = manager.identity_for("a")
    with manager.using([ref]):  # a running use holds it too: its weights outlive the name
        assert manager.unload_adapter("a") == LoRAStatus.SUCCESS
        assert manager.active_adapter_name is None and manager.slots.context.mapping is None  # back on the base
        assert ref in manager.store
    assert ref not in manager.store and manager.loras == []
    input_ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, peft_logits(base, None, input_ids))


def test_active_adapter_name_is_the_name_after_a_reload_in_place(adapter_dirs):
    model, manager = manager_for(MODEL_FACTORIES["llama"](), max_loras=2)
    manager.load_adapter(f"a={adapter_dirs['llama', 'r4']}")
    assert manager.load_adapter("a", adapter_dirs["llama", "r8_rslora"], replace=True) == LoRAStatus.SUCCESS
    manager.switch("a")
    assert manager.active_adapter_name == "a"


def test_a_pinned_adapter_is_not_deactivated_silently(adapter_dirs):
    from loramux.adapters.cache import AdapterPinnedError

    model, manager = manager_for(MODEL_FACTORIES["llama"](), max_loras=2)
    manager.load_adapter(f"a={adapter_dirs['llama', 'r4']}")
    assert manager.pin_adapter("a") == LoRAStatus.SUCCESS
    with pytest.raises(AdapterPinnedError, match="unpin"):
        manager.deactivate_adapter("a")
    assert manager.pinned == ["a"] and manager.is_active_lora("a")


@pytest.mark.parametrize("name", ["x=/elsewhere/e", "a,b", "../up", "tab\t"])
def test_names_are_never_parsed_as_paths(adapter_dirs, name):
    model, manager = manager_for(MODEL_FACTORIES["llama"]())
    result = manager.load_adapter(name, adapter_dirs["llama", "r4"])
    assert result == LoRAStatus.LOAD_INVALID_NAME and "adapter name" in result.message and manager.loras == []
    assert manager.add_adapter(name, {}, {}) == LoRAStatus.LOAD_INVALID_NAME


def test_all_linear_adapter_with_weights_for_an_unwrapped_module_is_refused(tmp_path):
    base = MODEL_FACTORIES["llama"]()
    path = save_peft_adapter(base, tmp_path / "every", target_modules="all-linear")
    set_config(path, target_modules="all-linear")  # PEFT saves the expanded list; older configs hold the word
    model, manager = manager_for(base, target_modules=("q_proj", "v_proj"))
    result = manager.load_adapter("every", path)
    assert result == LoRAStatus.LOAD_INVALID_ADAPTER and "does not wrap" in result.message
    model, manager = manager_for(base)  # all seven wrapped: served, and equal to PEFT
    assert manager.load_adapter("every", path) == LoRAStatus.SUCCESS
    input_ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad(), manager.batch(["every"]):
        out = model(input_ids).logits
    torch.testing.assert_close(out, peft_logits(base, path, input_ids), atol=ATOL, rtol=1e-4)


def test_reload_in_place_keeps_the_pin_and_a_failed_pin_changes_nothing(adapter_dirs):
    base = MODEL_FACTORIES["llama"]()
    model, manager = manager_for(base, max_loras=1, max_cpu_loras=4)
    old, new = adapter_dirs["llama", "r4"], adapter_dirs["llama", "r8_rslora"]
    assert manager.load_adapter("a", old, pinned=True) == LoRAStatus.SUCCESS
    result = manager.load_adapter("b", new, pinned=True)  # the one slot is pinned by "a"
    assert result == LoRAStatus.PIN_ERROR and "was not loaded" in result.message and manager.loras == ["a"]
    input_ids = torch.randint(0, 128, (1, 6))
    first = manager.identity_for("a")
    assert manager.load_adapter("a", new, replace=True) == LoRAStatus.SUCCESS
    second = manager.identity_for("a")
    assert manager.cache.is_pinned(second) and first not in manager.cache  # pinned again; the old identity is gone
    with torch.no_grad(), manager.batch(["a"]):
        out = model(input_ids).logits
    torch.testing.assert_close(out, peft_logits(base, new, input_ids), atol=ATOL, rtol=1e-4)
    assert manager.load_adapter("a", old) == LoRAStatus.LOAD_NAME_EXISTS  # without replace: refused as before


def test_embedding_and_head_lora_on_a_plain_hf_model_per_row(tmp_path):
    """LoRAModel with embed_tokens / lm_head targeted: rows of [batch, seq] ids take their own adapter's
    embedding LoRA and head (the layers read the row mapping per token, as the linear ones do)."""
    from conftest import save_distinct_adapter, tiny_llama

    from loramux.config import DEFAULT_TARGET_MODULES

    base = tiny_llama()
    emb = save_distinct_adapter(base, tmp_path / "emb", 3, r=4, target_modules=["embed_tokens", "lm_head", "q_proj"])
    plain = save_peft_adapter(base, tmp_path / "plain", seed=4, r=8)
    save = save_distinct_adapter(base, tmp_path / "save", 5, r=4, target_modules=["v_proj"], modules_to_save=["lm_head"])
    model, manager = manager_for(base, target_modules=(*DEFAULT_TARGET_MODULES, "embed_tokens", "lm_head"),
                                 max_module_copies_bytes=2 * 128 * 64 * 4)
    paths = {"emb": emb, "plain": plain, "save": save}
    for name, path in paths.items():
        assert manager.load_adapter(f"{name}={path}") == LoRAStatus.SUCCESS
    rows = ["emb", None, "plain", "emb", "save"]
    input_ids = torch.randint(0, 128, (len(rows), 7), generator=torch.Generator().manual_seed(2))
    for mode in ("batch", "switch"):
        with torch.no_grad():
            if mode == "batch":
                with manager.batch(rows):
                    ours = model(input_ids).logits
            else:
                manager.switch("emb")
                ours = model(input_ids).logits
                manager.reset()
        for i, kind in enumerate(rows if mode == "batch" else ["emb"] * len(rows)):
            expected = peft_logits(base, paths.get(kind), input_ids)[i]
            torch.testing.assert_close(ours[i], expected, atol=ATOL, rtol=1e-4, msg=f"{mode} row {i} ({kind})")


def test_vllms_manager_names(adapter_dirs):
    """vLLM's LoRAModelManager API (manager.vllm, keyed by name): len, capacity, slots, list / get, activate and
    deactivate answering whether they changed anything, remove, remove all, and its LRU manager's
    remove_oldest_adapter (host memory only here: the name stays, read back on next use)."""
    _, model = manager_for(MODEL_FACTORIES["llama"](), max_loras=2, max_cpu_loras=3)
    manager, vllm = model.manager, model.manager.vllm
    assert (len(vllm), vllm.capacity, vllm.lora_slots, vllm.adapter_slots) == (0, 3, 2, 2)
    assert vllm.remove_oldest_adapter() is False  # nothing in host memory
    for name, kind in (("a", "r4"), ("b", "r8_rslora"), ("c", "r16_patterns")):
        assert manager.load_adapter(f"{name}={adapter_dirs['llama', kind]}")
    assert len(vllm) == 3 and list(vllm.list_adapters()) == ["a", "b", "c"]
    assert vllm.get_adapter("b") == manager.current("b") and vllm.get_adapter("ghost") is None
    assert vllm.activate_adapter("c") is True and vllm.activate_adapter("c") is False
    assert vllm.deactivate_adapter("c") is True and vllm.deactivate_adapter("c") is False
    assert vllm.pin_adapter("a") is True
    assert vllm.remove_oldest_adapter() is True  # "a" is pinned: "b", the next least recently used, goes
    assert not manager.cache.in_host(manager.current("b")) and manager.cache.in_host(manager.current("a"))
    assert manager.is_lora("b") and manager.activate_adapter("b") >= 0  # read back on use
    assert vllm.remove_adapter("c") is True and vllm.remove_adapter("c") is False
    vllm.remove_all_adapters()
    assert len(vllm) == 0 and vllm.list_adapters() == {}


def test_clone_is_a_second_name_for_the_same_host_tensors_and_lives_on_its_own(adapter_dirs):
    """vLLM's clone(name, new_name): the clone gives the original's logits, shares its host tensors (no copy),
    reads back from the same disk copy, and outlives a replacement or an unload of the original."""
    base = MODEL_FACTORIES["llama"]()
    model, lora_model = manager_for(base, max_loras=2, max_cpu_loras=3)
    manager = lora_model.manager
    assert manager.load_adapter(f"a={adapter_dirs['llama', 'r4']}")
    assert manager.clone("a", "twin") == LoRAStatus.SUCCESS and manager.loras == ["a", "twin"]
    a, twin = manager.current("a"), manager.current("twin")
    assert a != twin and manager.store.weights_of(a) is manager.store.weights_of(twin)  # the same host tensors
    assert manager.paths["twin"] == manager.paths["a"]
    input_ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad(), lora_model.batch(["twin", "a"]):
        logits = model(input_ids).logits
    torch.testing.assert_close(logits, peft_logits(base, adapter_dirs["llama", "r4"], input_ids), atol=ATOL, rtol=1e-4)
    assert manager.load_adapter("a", adapter_dirs["llama", "r16_patterns"], replace=True)
    assert manager.unload_adapter("a")
    with torch.no_grad(), lora_model.batch(["twin"]):
        torch.testing.assert_close(model(input_ids[:1]).logits,
                                   peft_logits(base, adapter_dirs["llama", "r4"], input_ids[:1]), atol=ATOL, rtol=1e-4)
    assert manager.clone("ghost", "x") == LoRAStatus.LOAD_ERROR and "not loaded" in manager.clone("ghost", "x").message
    assert manager.clone("twin", "twin") == LoRAStatus.LOAD_NAME_EXISTS
    assert manager.clone("twin", "a=b") == LoRAStatus.LOAD_INVALID_NAME
    assert manager.loras == ["twin"]
