"""Churn: 2,000 load/unload cycles over 50 adapters, with max_cpu_loras below 50 (host eviction and reloads
from disk), while requests run. Memory comes back, and the cache, the manager and the layers' slot buffers
agree at the end. (A slow end-to-end test: ~30 s on 2 cores.)"""
import ctypes
import gc
import os
import random

import pytest
import torch
from safetensors.torch import save_file

from conftest import TINY, save_checkpoint, tiny_llama
from loramux import LoRAConfig, LoRAStatus, SamplingParams
from loramux.llm import LLM

pytestmark = pytest.mark.slow
PROJ = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(path, seed: int, rank: int) -> str:
    """A PEFT-format adapter on all 7 projections of the tiny llama (written directly: PEFT is slow x50)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, kv = TINY["hidden_size"], TINY["intermediate_size"], 2 * 16
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    tensors = {}
    for layer in range(TINY["num_hidden_layers"]):
        for block, names in PROJ.items():
            for name in names:
                n_in, n_out = shapes[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.1
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.1
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write(f'{{"peft_type": "LORA", "r": {rank}, "lora_alpha": {2 * rank}, '
                f'"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}}')
    return str(path)


def rss() -> int:
    """Resident memory, after glibc hands its free heap pages back (what is left is what the process holds)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_2000_load_unload_cycles_over_50_adapters_while_requests_run(tmp_path):
    base = tiny_llama()
    paths = [write_adapter(tmp_path / f"a{i}", seed=i, rank=(4, 8, 16)[i % 3]) for i in range(50)]
    llm = LLM(model=save_checkpoint(base, tmp_path / "model"), dtype="float32", kv_cache_memory=2**23, max_model_len=64,
              lora=LoRAConfig(max_loras=4, max_cpu_loras=16, max_lora_rank=16))
    engine, rng = llm.engine, random.Random(0)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    loaded: dict[str, int] = {}  # name -> adapter index
    counts = {"cycles": 0, "in_use": 0, "finished": 0}

    def cycle():
        name = f"n{counts['cycles'] % 120}"
        if name in loaded:
            counts["in_use"] += engine.adapters.cache.in_use(engine.adapters.identity_for(name))
            assert llm.unload_adapter(name) == LoRAStatus.SUCCESS  # its running requests finish on it
            del loaded[name]
        else:
            index = rng.randrange(50)
            assert llm.load_adapter(name, paths[index]) == LoRAStatus.SUCCESS
            loaded[name] = index
        counts["cycles"] += 1
        if loaded and rng.random() < 0.5:  # requests keep running on the adapters that come and go
            engine.add_request([5, 6, 7, rng.randrange(3, 100)], params, rng.choice(sorted(loaded)))
        counts["finished"] += sum(o.finished for o in engine.step())

    for _ in range(200):  # warm-up: allocator pools, every code path once
        cycle()
    gc.collect()
    start = rss()
    while counts["cycles"] < 2200:
        cycle()
    while engine.has_unfinished_requests():
        counts["finished"] += sum(o.finished for o in engine.step())
    gc.collect()
    growth = (rss() - start) / start
    print(f"\nchurn: {counts['cycles'] - 200} cycles after warm-up, RSS {start / 2**20:.0f} -> {rss() / 2**20:.0f} MiB "
          f"({growth:+.1%}); {engine.adapters.stats['host_evictions']} host evictions, {engine.adapters.stats['loads']} "
          f"disk reads, {counts['finished']} requests finished, {counts['in_use']} unloads while requests ran on them")
    assert growth < 0.05, f"RSS grew {growth:.1%} over 2,000 cycles"
    assert counts["finished"] > 500 and counts["in_use"] > 0 and engine.adapters.stats["host_evictions"] > 100
    check_consistent(llm, loaded, paths)


def check_consistent(llm, loaded, paths):
    """active_loras, the cache and the layers' buffers say the same thing."""
    manager = llm.engine.adapters
    assert sorted(manager.loras) == sorted(loaded) and manager.store.retiring == set() and len(manager.cache) == len(loaded)
    occupied = {}
    for ref, slot in manager.cache.active.items():
        occupied[slot] = ref
        assert manager.active_loras.get(ref.name) == slot and manager.identity_for(ref.name) == ref
    for layer, modules in manager.slots._layers.values():
        for slot in range(manager.config.max_loras):
            if slot not in occupied:
                assert layer.slot_ranks[slot] == 0 and not layer.lora_a[slot].any() and not layer.lora_b[slot].any()
                continue
            weights = manager.store._weights[occupied[slot]]
            part = weights.modules[modules[0]]
            assert layer.slot_ranks[slot] == part.rank
            torch.testing.assert_close(layer.lora_a[slot, : part.rank], part.a)
