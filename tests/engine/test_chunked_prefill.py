"""Chunked prefill (EngineConfig.enable_chunked_prefill): mixed steps of decode rows and prompt chunks give
every row the tokens of HF + PEFT running its adapter alone, and the same logprobs as unchunked steps."""
import itertools

import pytest
import torch

from conftest import hf_greedy
from loramux import LoRAConfig
from loramux.config import EngineConfig
from loramux.engine.block_manager import BlockManager
from loramux.engine.scheduler import Scheduler
from loramux.engine.sequence import Sequence
from loramux.sampling_params import SamplingParams, StructuredOutputsParams
from test_llm import checkpoints, make_llm, prompts, record_preemptions  # noqa: F401  (the module fixture)

ROWS = ["r4", None, "r8_rslora", "r16_patterns", "r64_qv", None, "r4", "r64_qv"]


def long_prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (int(torch.randint(5, 40, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


# how a step's prompt rows attend: "rows" as rows of the paged decode op (the engine on a CPU with the C++
# kernel), "sdpa" one SDPA call per chunk, "padded" the chunks that start their prompts in one padded call (a GPU)
@pytest.mark.parametrize("budget, mode", [(3, "rows"), (7, "rows"), (16, "rows"), (48, "rows"), (3, "sdpa"),
                                          (16, "sdpa"), (48, "sdpa"), (48, "padded")])
def test_chunked_steps_equal_hf_peft_for_every_row(checkpoints, budget, mode, monkeypatch):  # noqa: F811
    from loramux.layers.attention import Attention

    base, path, adapters = checkpoints["llama"]
    llm = make_llm(path, adapters, enable_chunked_prefill=True, max_num_batched_tokens=budget, max_model_len=64)
    llm.engine.runner.rows_attention = mode == "rows"
    llm.engine.runner.pad_fresh_chunks = mode == "padded"
    calls, padded_op, sdpa_op = [], Attention._padded, Attention._sdpa
    monkeypatch.setattr(Attention, "_padded", lambda *a: calls.append("padded") or padded_op(*a))
    monkeypatch.setattr(Attention, "_sdpa", lambda *a: calls.append("sdpa") or sdpa_op(*a))
    batch = long_prompts(len(ROWS), seed=budget)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    mixed, padded = [], []
    original = llm.engine.scheduler.schedule

    def spy(*args):  # record that steps really mixed decode rows with prompt chunks
        scheduled = original(*args)
        if scheduled.spans:
            kinds = {end - start == 1 for start, end in scheduled.spans}
            mixed.append(kinds == {True, False})
            padded.append(sum(start == 0 and end > 1 for start, end in scheduled.spans) >= 2)  # one padded call
        return scheduled

    llm.engine.scheduler.schedule = spy
    outs = llm.generate(batch, params, adapters=ROWS)
    for prompt, adapter, out in zip(batch, ROWS, outs):
        assert out.token_ids == hf_greedy(base, adapters.get(adapter), prompt, 8), adapter
    assert any(mixed)
    assert any(padded) or budget < 48  # a large budget starts several prompts in one step
    assert ("padded" in calls) == (mode == "padded") and bool(calls) == (mode != "rows")


def test_chunked_with_preemption_and_logprobs_equals_unchunked(checkpoints):  # noqa: F811
    _, path, adapters = checkpoints["llama"]
    kv = dict(kv_cache_memory=6 * 2 * 2 * 16 * 2 * 16 * 4, max_model_len=64, block_size=16,
              lora=LoRAConfig(max_loras=2, max_cpu_loras=4, max_lora_rank=64))
    batch = long_prompts(6, seed=4)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    plain = make_llm(path, adapters, **kv).generate(batch, params, adapters=ROWS[:6])
    chunked_llm = make_llm(path, adapters, enable_chunked_prefill=True, max_num_batched_tokens=10, **kv)
    preempted = record_preemptions(chunked_llm.engine.scheduler)
    chunked = chunked_llm.generate(batch, params, adapters=ROWS[:6])
    assert preempted, "the tiny KV cache should have forced a preemption"
    for a, b in zip(plain, chunked):
        assert a.token_ids == b.token_ids and a.logprobs.top_ids == b.logprobs.top_ids
        torch.testing.assert_close(torch.tensor(a.logprobs.logprobs), torch.tensor(b.logprobs.logprobs))
        assert a.prompt_logprobs.token_ids == b.prompt_logprobs.token_ids
        torch.testing.assert_close(torch.tensor(a.prompt_logprobs.logprobs), torch.tensor(b.prompt_logprobs.logprobs))


def test_structured_and_sampled_requests_in_chunked_steps(checkpoints):  # noqa: F811
    _, path, adapters = checkpoints["llama"]
    batch = long_prompts(4, seed=8)
    choice = StructuredOutputsParams(choice=("yes", "no"))
    params = [SamplingParams(max_tokens=8, temperature=0, structured_outputs=choice),
              SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True)] * 2
    want = make_llm(path, adapters, max_model_len=64).generate(batch, params, adapters=ROWS[:4])
    got = make_llm(path, adapters, max_model_len=64, enable_chunked_prefill=True,
                   max_num_batched_tokens=5).generate(batch, params, adapters=ROWS[:4])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[0].text in ("yes", "no")


def chunked_scheduler(budget: int, max_wait_steps: int = 64) -> Scheduler:
    config = EngineConfig(model="x", lora=None, enable_chunked_prefill=True, max_num_batched_tokens=budget,
                          max_model_len=64, max_wait_steps=max_wait_steps)
    return Scheduler(config, BlockManager(64, 4))


class FixedBound:
    """A step bound that allows `tokens` prompt tokens a step (the scheduler's StepCost, learned from step times)."""

    bounding = True

    def __init__(self, tokens: int):
        self.tokens = tokens

    def prompt_allowance(self, rows: int, about_to_decode: int) -> int:
        return self.tokens

    def admitted(self, work: int) -> None:
        pass


def run_step(sched):
    batch = sched.schedule()
    for seq, (_, end) in zip(batch.seqs, batch.spans):
        seq.num_computed_tokens = end
        sched.block_manager.cache_computed(seq)
        if end == len(seq):
            seq.append_token(7)
    return [(s, span) for s, span in zip(batch.seqs, batch.spans)]


_PROMPTS = itertools.count(1)


def add(sched, *lengths):
    """Prompts of these lengths, no two alike (alike ones would share their prefix's blocks)."""
    seqs = [Sequence([1000 * next(_PROMPTS) + j for j in range(n)], SamplingParams(max_tokens=4)) for n in lengths]
    for seq in seqs:
        sched.add(seq)
    return seqs


def test_the_chunked_scheduler_decodes_first_then_shortest_prompts_first():
    sched = chunked_scheduler(budget=6)
    a, b, c = add(sched, 10, 3, 2)
    assert run_step(sched) == [(a, (0, 6))]  # the first chunk takes the whole budget
    assert run_step(sched) == [(c, (0, 2)), (b, (0, 3)), (a, (6, 7))]  # short prompts are not held behind a
    assert run_step(sched) == [(b, (3, 4)), (c, (2, 3)), (a, (7, 10))]  # decodes first, then a's rest
    assert run_step(sched) == [(a, (10, 11)), (b, (4, 5)), (c, (3, 4))]  # all decode


def test_the_step_bounds_allowance_bounds_the_prompt_tokens_of_a_step():
    sched = chunked_scheduler(budget=100)
    assert not sched.step_cost.bounding  # offline (no slowdown cap): the token budget alone
    a, b = add(sched, 30, 40)
    assert run_step(sched) == [(a, (0, 30)), (b, (0, 40))]
    c = add(sched, 50)[0]
    sched.step_cost = FixedBound(16)
    assert run_step(sched) == [(a, (30, 31)), (b, (40, 41)), (c, (0, 16))]


def test_a_long_prompt_passed_over_max_wait_steps_times_goes_first():
    sched = chunked_scheduler(budget=4, max_wait_steps=2)
    long = add(sched, 20)[0]
    run_step(sched)  # long: (0, 4)
    spans = []
    for _ in range(4):  # a short prompt arrives every step and would take the budget first
        add(sched, 4)
        spans.append(dict((id(s), span) for s, span in run_step(sched)).get(id(long)))
    assert spans[:2] == [None, None] and spans[2] is not None  # passed over twice, then first


def test_batch_invariant_and_chunked_prefill_are_exclusive():
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        EngineConfig(model="x", batch_invariant=True, enable_chunked_prefill=True)
