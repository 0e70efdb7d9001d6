"""The prefix cache in the engine: greedy tokens (fp32) are those of the engine without it, and of HF + PEFT,
for mixed adapters, full and partial hits, a hit that ends mid-block, chunked prefill, preemption, n copies;
K/V are never shared across adapters, the base model, or two loads of one adapter; cached blocks are evicted
under memory pressure; prompt logprobs requests read nothing from it."""
import pytest
import torch

from conftest import hf_greedy
from loramux import LoRAConfig, SamplingParams
from test_llm import checkpoints, make_llm, record_preemptions  # noqa: F401  (the module fixture)

SHARED = [7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79]  # 20 tokens: 5 blocks of 4
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def requests(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that share SHARED (4 full blocks and a bit) and end apart (some mid-block)."""
    gen = torch.Generator().manual_seed(seed)
    return [SHARED[:18] + torch.randint(3, 128, (1 + i % 5,), generator=gen).tolist() for i in range(n)]


def engine(path, adapters, caching: bool, **kw):
    return make_llm(path, adapters, enable_prefix_caching=caching, block_size=4, **{"max_model_len": 64, **kw})


@pytest.mark.parametrize("chunked", [True, False])
def test_cached_prefixes_give_the_tokens_of_the_engine_without_a_cache(checkpoints, chunked):  # noqa: F811
    base, path, adapters = checkpoints["llama"]
    rows = ["r4", None, "r8_rslora", "r4", None, "r16_patterns", "r8_rslora", "r4"]
    batch = requests(len(rows))
    plain = engine(path, adapters, False, enable_chunked_prefill=chunked)
    cached = engine(path, adapters, True, enable_chunked_prefill=chunked, max_num_batched_tokens=24)
    first = cached.generate(batch[:3], GREEDY, adapters=rows[:3])  # fills the cache for r4, base and r8_rslora
    assert cached.engine.core.block_manager.hits == 0
    want = plain.generate(batch, GREEDY, adapters=rows)
    got = cached.generate(batch, GREEDY, adapters=rows)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.token_ids for o in first] == [o.token_ids for o in want[:3]]
    assert cached.engine.core.block_manager.hits >= 4 * 4 * 3  # at least the 4 shared blocks, for three rows
    for i in (0, 1, 5):
        assert got[i].token_ids == hf_greedy(base, adapters.get(rows[i]), batch[i], GREEDY.max_tokens)


def test_a_cache_salt_shares_blocks_only_with_its_own_salt_and_keeps_the_tokens(checkpoints):  # noqa: F811
    """vLLM's cache_salt, offline: SamplingParams(cache_salt=...) splits the cache (adapter and base alike)."""
    from dataclasses import replace

    _, path, adapters = checkpoints["llama"]
    llm = engine(path, {"a": adapters["r4"]}, True)
    prompt = SHARED[:18]

    def run(adapter, salt):
        out = llm.generate([prompt], replace(GREEDY, cache_salt=salt), adapters=adapter, use_tqdm=False)[0]
        return out.num_cached_tokens, out.token_ids

    for adapter in ("a", None):
        (cold, want), (warm, again) = run(adapter, "s1"), run(adapter, "s1")
        assert cold == 0 and warm == 16 and again == want
        assert run(adapter, "s2")[0] == 0 and run(adapter, None)[0] == 0  # nothing of s1's
        assert run(adapter, None) == (16, want) and run(adapter, "s2") == (16, want)


def test_no_block_is_shared_across_adapters_the_base_or_two_loads_of_one(checkpoints):  # noqa: F811
    _, path, adapters = checkpoints["llama"]
    llm = engine(path, {"a": adapters["r4"], "b": adapters["r8_rslora"]}, True)
    core, prompt = llm.engine.core, SHARED
    seen = {}

    def blocks_of(adapter):
        ids = llm.engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), adapter)
        llm.engine.step()
        table = list(core.sequence(ids).block_table)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        return set(table)

    for who in ("a", "b", None):
        seen[who] = blocks_of(who)
    assert not (seen["a"] & seen["b"]) and not (seen["a"] & seen[None]) and not (seen["b"] & seen[None])
    assert blocks_of("a") & seen["a"]  # the same adapter and load does share
    assert llm.load_adapter("a", adapters["r16_patterns"], replace=True)  # a new load under the same name
    assert not blocks_of("a") & seen["a"]


def test_n_copies_of_a_prompt_compute_it_once(checkpoints):  # noqa: F811
    base, path, adapters = checkpoints["llama"]
    llm = engine(path, adapters, True)
    params = [SamplingParams(max_tokens=4, temperature=0.9, seed=i) for i in range(6)]
    outs = llm.generate([SHARED] * 6, params, adapters="r4")
    bm = llm.engine.core.block_manager
    assert bm.hits == 5 * 4 * 4  # copies 2-6 read the 4 full blocks before the last token's
    want = engine(path, adapters, False).generate([SHARED] * 6, params, adapters="r4")
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]


def test_preempted_requests_resume_from_their_cached_blocks(checkpoints):  # noqa: F811
    _, path, adapters = checkpoints["llama"]
    kv = dict(kv_cache_memory=14 * 2 * 2 * 4 * 2 * 16 * 4, max_model_len=48)  # 14 blocks of 4: 4 requests overflow
    batch = requests(4, seed=3)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    cached = engine(path, adapters, True, **kv)
    preempted = record_preemptions(cached.engine.scheduler)
    got = cached.generate(batch, params, adapters=["r4", "r8_rslora", "r4", None])
    assert preempted and cached.engine.core.block_manager.hits > 0
    want = engine(path, adapters, False, **kv).generate(batch, params, adapters=["r4", "r8_rslora", "r4", None])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_cached_blocks_are_evicted_when_an_allocation_needs_them(checkpoints):  # noqa: F811
    _, path, adapters = checkpoints["llama"]
    llm = engine(path, adapters, True, kv_cache_memory=16 * 2 * 2 * 4 * 2 * 16 * 4)  # 16 blocks
    bm = llm.engine.core.block_manager
    llm.generate([SHARED], GREEDY, adapters="r4")
    assert bm.num_cached_blocks == 6 and bm.num_free_blocks == 16  # cached blocks count as free
    llm.generate([[100] * 58], GREEDY)  # 58 + 6 positions: every block, r4's cached prefix evicted for it
    before = bm.hits
    llm.generate([SHARED], GREEDY, adapters="r4")
    assert bm.hits == before  # nothing left to hit


def test_prompt_logprobs_are_computed_whole_and_usage_counts_cached_tokens(checkpoints):  # noqa: F811
    _, path, adapters = checkpoints["llama"]
    llm = engine(path, adapters, True)
    llm.generate([SHARED], GREEDY, adapters="r4")
    bm = llm.engine.core.block_manager
    hits = bm.hits
    scored = llm.generate([SHARED], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2), adapters="r4")[0]
    assert bm.hits == hits and len(scored.prompt_logprobs) == len(SHARED) - 1
    plain = engine(path, adapters, False).generate([SHARED], SamplingParams(max_tokens=2, temperature=0,
                                                                            prompt_logprobs=2), adapters="r4")[0]
    assert scored.prompt_logprobs.token_ids == plain.prompt_logprobs.token_ids
    torch.testing.assert_close(torch.tensor(scored.prompt_logprobs.logprobs), torch.tensor(plain.prompt_logprobs.logprobs))


def test_reset_forgets_the_cache_and_batch_invariant_mode_has_none(checkpoints):  # noqa: F811
    _, path, adapters = checkpoints["llama"]
    llm = engine(path, adapters, True)
    llm.generate([SHARED], GREEDY, adapters="r4")
    assert llm.reset_prefix_cache() == 6 and llm.engine.core.block_manager.num_cached_blocks == 0  # 24 of 26 computed
    invariant = make_llm(path, adapters, batch_invariant=True, block_size=4, max_model_len=64)
    assert not invariant.engine.config.enable_prefix_caching
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        make_llm(path, adapters, batch_invariant=True, enable_prefix_caching=True)
