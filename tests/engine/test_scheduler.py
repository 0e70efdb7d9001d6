"""Scheduler policy: admission, the adapter-slot rule, the age bound, preemption. No torch here.

`step()` plays the model runner: every scheduled sequence gets one new token (prefill and decode alike,
as in nano-vllm) and finishes with "length" at max_tokens.
"""
import random
from collections import Counter

import pytest

from loramux.adapters.cache import AdapterCache
from loramux.config import EngineConfig, LoRAConfig
from loramux.engine.block_manager import BlockManager
from loramux.engine.scheduler import ScheduledBatch, Scheduler
from loramux.engine.sequence import Sequence, SequenceStatus
from loramux.sampling_params import SamplingParams


def make(max_loras=2, adapters="abc", pinned="", num_blocks=64, block_size=4, lora=True, **engine):
    """A scheduler over a fresh block manager and AdapterCache holding one adapter per letter. Each letter is
    its own identity here; an adapter removed from the cache no longer resolves (an unload)."""
    engine.setdefault("max_wait_steps", 4)
    engine.setdefault("enable_chunked_prefill", False)  # the unchunked policy (chunked steps: test_chunked_prefill)
    config = EngineConfig(lora=LoRAConfig(max_loras=max_loras, max_cpu_loras=8) if lora else None,
                          block_size=block_size, **engine)
    cache = AdapterCache(max_loras, 8) if lora else None
    for name in adapters if lora else "":
        cache.add(name)
    for name in pinned:
        cache.pin(name)
    if not lora:
        return Scheduler(config, BlockManager(num_blocks, block_size)), cache
    return Scheduler(config, BlockManager(num_blocks, block_size), cache, lambda n: n if n in cache else None), cache


def req(adapter=None, prompt_len=4, max_tokens=4, request_id=None) -> Sequence:
    return Sequence(prompt_token_ids=[1] * prompt_len, params=SamplingParams(max_tokens=max_tokens),
                    adapter=adapter, request_id=request_id)


def add_all(sched, adapters, **kw) -> list[Sequence]:
    """One request per entry of `adapters` ("-" = base model), added in order."""
    seqs = [req(None if a == "-" else a, **kw) for a in adapters]
    for seq in seqs:
        sched.add(seq)
    return seqs


def step(sched) -> ScheduledBatch:
    """What the engine does with a batch: K/V computed for each span, a token where the span ends the sequence."""
    batch = sched.schedule()
    for i, seq in enumerate(batch.seqs):
        seq.num_computed_tokens = batch.spans[i][1] if batch.spans is not None else len(seq)
        sched.block_manager.cache_computed(seq)  # as the engine does after a step: computed blocks can be shared
        if seq.num_computed_tokens < len(seq):
            continue  # a prompt chunk
        seq.append_token(7)
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, "length")
    return batch


def names(seqs) -> str:
    return "".join(s.adapter or "-" for s in seqs)


# ---- admission -----------------------------------------------------------------------------
def test_fifo_admission_then_decode_of_all_running():
    sched, _ = make()
    seqs = add_all(sched, "-a-b")
    prefill = sched.schedule()
    assert prefill.is_prefill and prefill.seqs == seqs
    assert all(s.status is SequenceStatus.RUNNING and s.block_table for s in seqs)
    decode = sched.schedule()
    assert not decode.is_prefill and decode.seqs == seqs
    assert decode.preempted == [] and decode.failed == []


def test_nothing_to_do_is_an_empty_decode():
    sched, _ = make()
    assert sched.schedule() == ScheduledBatch(seqs=[], is_prefill=False, preempted=[], failed=[])
    assert not sched.has_unfinished


def test_max_num_seqs_then_admits_when_one_finishes():
    sched, _ = make(max_num_seqs=2)
    s1, s2, s3 = add_all(sched, "---")
    assert step(sched).seqs == [s1, s2]
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    assert not step(sched).is_prefill  # full: decode
    sched.finish(s1, "stop")
    batch = step(sched)
    assert batch.is_prefill and batch.seqs == [s3]


@pytest.mark.parametrize(
    "budget, max_model_len, prompt_lens, admitted_per_step",
    [
        (10, None, [4, 4, 4], [2, 1]),
        (12, None, [4, 4, 4], [3]),
        (8, None, [8, 1, 1], [1, 2]),
        (8, None, [1, 8, 1], [1, 1, 1]),  # the 8 stops the scan: the last 1 does not jump ahead
        (8, 16, [16, 1], [1, 1]),  # max_model_len raises the budget so a full-length prompt fits
    ],
)
def test_token_budget_per_prefill(budget, max_model_len, prompt_lens, admitted_per_step):
    sched, _ = make(max_num_batched_tokens=budget, max_model_len=max_model_len)
    for n in prompt_lens:
        sched.add(req(prompt_len=n, max_tokens=1))
    counts = []
    while sched.num_waiting:
        batch = sched.schedule()
        assert batch.is_prefill and sum(len(s) for s in batch.seqs) <= max(budget, max_model_len or 0)
        counts.append(len(batch.seqs))
    assert counts == admitted_per_step


@pytest.mark.parametrize(
    "usage, device, memory_gib, name, expected",
    [
        ("offline", "cpu", 0, "", 256),
        ("server", "cpu", 0, "", 256),
        ("offline", "cuda", 80, "NVIDIA H100 80GB HBM3", 16384),  # vLLM's LLM class on a large GPU
        ("server", "cuda", 80, "NVIDIA H100 80GB HBM3", 8192),
        ("offline", "cuda", 80, "NVIDIA A100-SXM4-80GB", 8192),  # A100s keep the smaller defaults
        ("server", "cuda", 24, "NVIDIA L4", 2048),
    ],
)
def test_default_step_budget_follows_device_and_usage(usage, device, memory_gib, name, expected):
    config = EngineConfig(usage=usage)
    assert config.step_token_budget(device, memory_gib * 2**30, name) == expected
    assert EngineConfig(usage=usage, enable_chunked_prefill=False).step_token_budget(device) == 4096
    assert EngineConfig(usage=usage, max_num_batched_tokens=96).step_token_budget(device, 2**40, name) == 96
    with pytest.raises(ValueError, match="usage must be one of offline, server"):
        EngineConfig(usage="batch")


def test_no_free_blocks_stops_the_scan():
    sched, _ = make(num_blocks=4, block_size=4)
    big, small = req(prompt_len=12, max_tokens=1), req(prompt_len=8, max_tokens=1)
    late = req(prompt_len=4, max_tokens=1)
    for seq in (big, small, late):
        sched.add(seq)
    assert sched.schedule().seqs == [big]  # 3 of 4 blocks; small needs 2, late (1) must not overtake
    assert sched.block_manager.num_free_blocks == 1
    assert sched.num_waiting == 2


# ---- the adapter rule -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "max_loras, pinned, requests, admitted, left",
    [
        (2, "", "abc", "ab", "c"),
        (2, "", "abcab-", "abab-", "c"),  # c waits; later a/b/base requests still run
        (2, "", "aaaa", "aaaa", ""),
        (3, "", "abcd-", "abc-", "d"),
        (2, "p", "abp-", "ap-", "b"),  # a pinned adapter holds a slot even with no request using it
        (2, "pq", "apq-", "pq-", "a"),
        (1, "", "-ab-", "-a-", "b"),
    ],
)
def test_slot_limit(max_loras, pinned, requests, admitted, left):
    sched, _ = make(max_loras=max_loras, adapters="abcdpq", pinned=pinned)
    add_all(sched, requests)
    assert names(sched.schedule().seqs) == admitted
    assert names(sched.waiting) == left
    assert len(sched.running_adapters() | set(pinned)) <= max_loras


def test_adapter_sets_for_metrics():
    sched, _ = make(max_loras=1)
    add_all(sched, "a-bb")
    sched.schedule()
    assert sched.running_adapters() == {"a"}
    assert sched.waiting_adapters() == {"b"}


def test_waiting_adapter_is_admitted_once_its_slot_frees():
    sched, _ = make(max_loras=1)
    a, b = add_all(sched, "ab", max_tokens=2)
    assert step(sched).seqs == [a]
    assert step(sched).seqs == [a] and a.is_finished  # decode; a reaches max_tokens
    assert step(sched).seqs == [b]


def test_refs_follow_admission_finish_and_abort():
    sched, cache = make()
    a1, a2, b1 = add_all(sched, "aab", request_id=None)
    assert cache.refs("a") == 0
    sched.schedule()
    assert (cache.refs("a"), cache.refs("b")) == (2, 1)
    assert (cache.holds("a"), cache.holds("b")) == (2, 1)
    sched.finish(a1, "stop")
    assert cache.refs("a") == cache.holds("a") == 1
    assert sched.abort(a2.request_id) is a2
    assert a2.finish_reason == "abort" and a2.status is SequenceStatus.FINISHED and not a2.block_table
    assert (cache.refs("a"), cache.refs("b"), cache.holds("a")) == (0, 1, 0)
    sched.finish(b1, "length")
    assert cache.refs("b") == cache.holds("b") == 0
    assert sched.block_manager.num_free_blocks == 64 and not sched.has_unfinished


def test_abort_a_waiting_request():
    sched, cache = make(max_loras=1)
    a, b = add_all(sched, "ab")
    sched.schedule()
    assert sched.abort(b.request_id) is b
    assert b.finish_reason == "abort" and sched.num_waiting == 0 and cache.refs("b") == 0
    assert sched.abort(b.request_id) is None
    assert sched.abort("no-such-request") is None


def test_unloaded_adapter_fails_the_waiting_request():
    sched, cache = make(max_loras=1)
    a, b, base = add_all(sched, "ab-")
    sched.schedule()  # a and base run; b waits for a slot
    cache.remove("b")
    batch = sched.schedule()
    assert batch.failed == [b]
    assert b.status is SequenceStatus.FINISHED and b.finish_reason == "error"
    assert not batch.is_prefill and batch.seqs == [a, base]
    assert sched.num_waiting == 0 and sched.schedule().failed == []


def test_unloaded_adapter_does_not_hold_back_others():
    sched, cache = make()
    c, base = add_all(sched, "c-")
    cache.remove("c")
    batch = sched.schedule()
    assert batch.failed == [c] and batch.seqs == [base] and batch.is_prefill


# ---- the age bound --------------------------------------------------------------------------
def test_starving_request_goes_first_after_max_wait_steps():
    """max_loras=1: b waits while a-requests keep arriving; after 2 skips, b is head-of-line."""
    sched, cache = make(max_loras=1, max_wait_steps=2)
    a1, b = add_all(sched, "ab", max_tokens=3)
    assert step(sched).seqs == [a1] and b.waited_steps == 1
    a2 = add_all(sched, "a", max_tokens=3)[0]
    assert step(sched).seqs == [a2] and b.waited_steps == 2
    late = add_all(sched, "a-", max_tokens=3)  # would fit now, but b goes first
    batches = [step(sched) for _ in range(2)]
    assert all(not batch.is_prefill for batch in batches)  # a1 and a2 drain; nothing is admitted
    assert a1.is_finished and a2.is_finished and cache.refs("a") == 0
    batch = step(sched)
    assert batch.seqs[0] is b and late[1] in batch.seqs  # the base request may join b
    assert late[0].status is SequenceStatus.WAITING  # a still has no slot while b runs


def test_starving_requests_go_in_arrival_order():
    sched, _ = make(max_loras=1, adapters="abc", max_wait_steps=1)
    a, b, c = add_all(sched, "abc", max_tokens=1)
    assert step(sched).seqs == [a] and (b.waited_steps, c.waited_steps) == (1, 1)
    base = add_all(sched, "-")[0]
    assert step(sched).seqs == [b]  # c is starving too, so the base request waits behind it
    assert step(sched).seqs == [c, base]


def test_waited_steps_count_only_steps_that_admit_others():
    sched, _ = make(max_loras=1)
    a, b = add_all(sched, "ab")
    sched.schedule()
    assert b.waited_steps == 1
    for _ in range(3):
        assert not sched.schedule().is_prefill
    assert b.waited_steps == 1


def test_adapter_blocked_by_pins_is_not_head_of_line():
    """All slots pinned: a request for another adapter cannot run until an unpin, so it may not block."""
    sched, cache = make(max_loras=1, adapters="ap", pinned="p", max_wait_steps=1)
    a = add_all(sched, "a")[0]
    for _ in range(3):
        add_all(sched, "p-")
        assert step(sched).is_prefill
    assert a.waited_steps == 3 and a.status is SequenceStatus.WAITING


# ---- preemption ---------------------------------------------------------------------------
def test_preempts_the_most_recent_and_readmits_it_first():
    sched, cache = make(num_blocks=4, block_size=4)
    s1, s2, s3 = add_all(sched, "abb", max_tokens=6)  # 1 block each, 1 free
    step(sched)  # prefill; each now has 5 tokens and needs a second block to decode
    batch = step(sched)
    assert not batch.is_prefill and batch.seqs == [s1, s2] and batch.preempted == [s3]
    newer = add_all(sched, "-", prompt_len=1)[0]
    assert s3.status is SequenceStatus.WAITING and s3.num_preemptions == 1 and not s3.block_table
    assert list(sched.waiting) == [s3, newer]
    assert cache.refs("b") == 1
    sched.finish(s1, "stop")
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs[0] is s3 and len(s3) == 5  # re-prefills its output too


def test_a_sequence_preempts_itself_when_it_is_the_newest():
    sched, cache = make(num_blocks=3, block_size=4)
    s1, s2 = add_all(sched, "ab", max_tokens=5)
    step(sched)  # 2 blocks used, 1 free; both need one more
    batch = sched.schedule()
    assert batch.seqs == [s1] and batch.preempted == [s2]
    assert cache.refs("b") == 0 and sched.block_manager.num_free_blocks == 1  # s2's block, returned


def test_each_step_reports_the_short_prompts_work_it_admitted():
    """What engine/step_cost.py keeps pace with: the prompt tokens past their cached prefix of the requests a step
    admits, those whose prompt fits in one step's budget."""
    sched, _ = make(lora=False, num_blocks=16, max_num_batched_tokens=12, enable_prefix_caching=True,
                    enable_chunked_prefill=True)
    first = Sequence(prompt_token_ids=list(range(10)), params=SamplingParams(max_tokens=2))
    sched.add(first)
    sched.add(gone := req(prompt_len=7))
    sched.abort(gone.request_id)  # never admitted
    assert step(sched).new_prompt_work == 10
    assert step(sched).new_prompt_work == 0  # a decode step: nothing admitted
    again = Sequence(prompt_token_ids=list(range(10)), params=SamplingParams(max_tokens=2))  # 8 of them cached
    sched.add(again)
    sched.add(req(prompt_len=20))  # longer than a step's budget (12): what the step bound spreads out
    assert step(sched).new_prompt_work == 10 - again.num_cached_tokens == 2


def test_a_preempted_request_is_counted_again_when_it_is_admitted_again():
    sched, _ = make(num_blocks=3, block_size=4, enable_chunked_prefill=True)
    sched.block_manager.caching = False  # no block of its own prompt found again: all of it recomputed
    s1, s2 = add_all(sched, "ab", max_tokens=5)
    assert step(sched).new_prompt_work == 8
    batch = step(sched)
    assert batch.preempted == [s2] and batch.new_prompt_work == 0
    sched.finish(s1, "stop")
    assert sched.schedule().new_prompt_work == len(s2) == 5  # its K/V are computed again


def test_decode_appends_blocks_for_every_running_sequence():
    sched, _ = make(num_blocks=8, block_size=2)
    seqs = add_all(sched, "ab-", prompt_len=2, max_tokens=3)
    step(sched)
    batch = sched.schedule()
    assert batch.seqs == seqs
    assert all(len(s.block_table) == 2 for s in seqs)


# ---- errors ---------------------------------------------------------------------------------
def test_engine_without_lora_refuses_adapters():
    sched, _ = make(lora=False)
    with pytest.raises(ValueError, match="'a'.*base model only"):
        sched.add(req("a"))
    sched.add(req(None))
    assert sched.schedule().is_prefill


@pytest.mark.parametrize(
    "seq, words",
    [
        (req(prompt_len=60, max_tokens=8), "needs room for 67 tokens"),
        (req(prompt_len=8, max_tokens=300), "KV-cache"),
    ],
)
def test_add_refuses_requests_that_could_never_run(seq, words):
    sched, _ = make(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match=words):
        sched.add(seq)


@pytest.mark.parametrize("max_model_len, accepted", [(200, True), (None, False)])
def test_max_model_len_caps_the_room_a_request_needs(max_model_len, accepted):
    """The engine stops a request at max_model_len, so a large max_tokens alone is not refused."""
    sched, _ = make(num_blocks=64, block_size=4, max_num_batched_tokens=1024, max_model_len=max_model_len)
    seq = req(prompt_len=150, max_tokens=1000)  # 64 blocks hold 256 positions
    if accepted:
        sched.add(seq)
    else:
        with pytest.raises(ValueError, match="KV-cache"):
            sched.add(seq)


def test_add_refuses_a_running_sequence():
    sched, _ = make()
    seq = add_all(sched, "a")[0]
    sched.schedule()
    with pytest.raises(ValueError, match="running"):
        sched.add(seq)


def test_finish_errors():
    sched, _ = make()
    seq = add_all(sched, "a")[0]
    with pytest.raises(ValueError, match="'done'"):
        sched.finish(seq, "done")
    sched.finish(seq, "stop")
    with pytest.raises(RuntimeError, match="already finished"):
        sched.finish(seq, "stop")
    with pytest.raises(ValueError, match="never added"):
        sched.finish(req(), "stop")


def test_a_started_request_keeps_its_identity_through_preemption():
    """Admission fixes the identity and holds it: a preempted request resumes on it even once the name
    points elsewhere (a reload in place), and its identity stays in host memory while it waits."""
    sched, cache = make(max_loras=2, adapters="a", num_blocks=3, block_size=4)
    first, second = add_all(sched, "aa", prompt_len=4, max_tokens=6)
    step(sched)
    assert first.adapter_ref == second.adapter_ref == "a" and cache.holds("a") == 2
    cache.add("a2")
    sched.current = lambda n: "a2" if n == "a" else None  # the name now resolves to a new identity
    batch = step(sched)  # no block for both to grow: the newest is preempted
    assert batch.preempted == [second] and second.adapter_ref == "a" and cache.refs("a") == 1 and cache.holds("a") == 2
    late = add_all(sched, "a")[0]
    while sched.has_unfinished:
        step(sched)
    assert second.adapter_ref == "a" and late.adapter_ref == "a2" and cache.holds("a") == cache.refs("a") == 0


# ---- invariants under a random workload ------------------------------------------------------
def check_invariants(sched, cache, max_loras):
    running = Counter(s.adapter_ref for s in sched.running if s.adapter)
    held = Counter(s.adapter_ref for s in (*sched.running, *sched.waiting) if s.adapter_ref)
    assert len(set(running) | cache.pinned) <= max_loras
    assert all(cache.refs(name) == running[name] and cache.holds(name) == held[name] for name in "abcde")
    used = {b for s in sched.running for b in s.block_table}  # a cached prefix's blocks are shared
    assert len(used) + sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert all(not s.block_table for s in sched.waiting)


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_invariants_and_finishes_everyone(seed):
    rng = random.Random(seed)
    sched, cache = make(max_loras=2, adapters="abcde", pinned="a" if seed % 2 else "", num_blocks=24,
                        block_size=4, max_num_seqs=6, max_num_batched_tokens=32, max_wait_steps=3)
    seqs = []
    for t in range(600):  # (requests with one prompt share its blocks: each waits a step for the first)
        if t < 150 and rng.random() < 0.5:
            seqs += add_all(sched, rng.choice("abcde-"), prompt_len=rng.randint(1, 12),
                            max_tokens=rng.randint(1, 20))
        step(sched)
        check_invariants(sched, cache, 2)
    assert all(s.is_finished and s.finish_reason == "length" for s in seqs)
    assert max(s.waited_steps for s in seqs) <= 3  # the age bound held


def prioritized(adapter=None, priority=0, prompt_len=4, max_tokens=4) -> Sequence:
    return Sequence(prompt_token_ids=[1] * prompt_len, params=SamplingParams(max_tokens=max_tokens, priority=priority),
                    adapter=adapter)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_priority_policy_admits_lower_values_first_and_fcfs_by_arrival(policy):
    sched, _ = make(lora=False, max_num_seqs=1, scheduling_policy=policy)
    values = [5, 0, 3, 0, 5]
    seqs = [prioritized(priority=v if policy == "priority" else 0) for v in values]
    for seq in seqs:
        sched.add(seq)
    order = []
    while sched.has_unfinished:
        batch = step(sched)
        order += [seqs.index(s) for s in batch.seqs if s.num_output_tokens == 1]
    assert order == ([1, 3, 2, 0, 4] if policy == "priority" else [0, 1, 2, 3, 4])


def test_the_priority_policy_preempts_the_highest_value_first_and_requeues_it_by_priority():
    """Two running requests outgrow a 4-block KV cache: fcfs would preempt the newer one; priority preempts
    the less urgent one, admitted first, and it comes back after the more urgent waiting ones."""
    sched, _ = make(lora=False, num_blocks=4, scheduling_policy="priority")
    low = prioritized(priority=9, max_tokens=8)
    sched.add(low)
    step(sched)
    high = prioritized(priority=0, max_tokens=8)
    sched.add(high)
    while not (low.num_preemptions or high.num_preemptions):
        step(sched)
    assert low.num_preemptions == 1 and high.num_preemptions == 0
    late = prioritized(priority=1)
    sched.add(late)
    assert list(sched.waiting) == [late, low]  # by priority, not at the front
    while sched.has_unfinished:
        step(sched)
    assert low.finish_reason == high.finish_reason == late.finish_reason == "length"


def test_a_priority_other_than_0_needs_the_priority_policy():
    from loramux.engine.input_processor import EngineLimits, InputProcessor

    params = SamplingParams(priority=2)
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        InputProcessor(None, EngineLimits(64, 100)).check_params(params)
    InputProcessor(None, EngineLimits(64, 100, priority_scheduling=True)).check_params(params)
    InputProcessor(None, EngineLimits(64, 100)).check_params(SamplingParams(priority=0))
