"""StepCost: the step-time model that bounds how many prompt tokens a step that decodes may carry."""
import random

import pytest

from loramux.config import EngineConfig
from loramux.engine import step_cost
from loramux.engine.block_manager import BlockManager
from loramux.engine.scheduler import Scheduler
from loramux.engine.sequence import Sequence
from loramux.engine.step_cost import KEEP_UP, MIN_CHUNK, StepCost
from loramux.sampling_params import SamplingParams

MS = 1e-3


def true_step(rows: int, tokens: int) -> float:
    """A made-up engine: 20 ms a step, 1 ms a row (decode row or prompt token), 5 ms for carrying prompt chunks."""
    return (20 + rows + tokens + (5 if tokens else 0)) * MS


def test_no_bound_until_both_kinds_of_step_ran_and_told_a_rows_cost():
    cost = StepCost(slowdown=2.0)
    assert cost.prompt_allowance(8) is None
    cost.observe(decode_rows=8, prompt_tokens=0, seconds=true_step(8, 0))
    assert cost.prompt_allowance(8) is None  # a prompt chunk's cost is not known yet
    cost.observe(decode_rows=8, prompt_tokens=32, seconds=true_step(8, 32))
    assert cost.prompt_allowance(8) is None  # two steps fit three costs exactly: nothing is told yet
    cost.observe(decode_rows=4, prompt_tokens=0, seconds=true_step(4, 0))
    cost.observe(decode_rows=4, prompt_tokens=64, seconds=true_step(4, 64))
    assert cost.prompt_allowance(8) is not None
    assert StepCost(slowdown=None).prompt_allowance(8) is None


def test_the_fit_recovers_fixed_per_row_and_per_chunk_costs_from_mixed_steps():
    cost, rng = StepCost(slowdown=2.0), random.Random(0)
    for rows in (1, 2, 3, 4):  # decode-only steps: few, and long ago
        cost.observe(rows, 0, true_step(rows, 0))
    for _ in range(200):  # then only steps with prompt chunks, at varying batch sizes
        rows, tokens = rng.randint(4, 24), rng.choice([16, 17, 40])
        cost.observe(rows, tokens, true_step(rows, tokens))
    fixed, per_row, per_chunk = cost.costs()
    assert (fixed, per_row, per_chunk) == pytest.approx((20 * MS, 1 * MS, 5 * MS), rel=1e-3)
    assert cost.decode_time(32) == pytest.approx(52 * MS)


def test_the_allowance_keeps_a_step_within_the_slowdown_of_the_batch_about_to_decode():
    cost = StepCost(slowdown=2.0)
    for rows, tokens in [(1, 0), (4, 0), (8, 0), (8, 16), (4, 64), (12, 32)]:
        cost.observe(rows, tokens, true_step(rows, tokens))
    # against its own 8 rows: 20 + 8 + 5 + T <= 2 x 28 -> T <= 23
    assert cost.prompt_allowance(8) == 23
    assert true_step(8, 23) <= 2 * true_step(8, 0) < true_step(8, 24)
    # 32 rows about to decode (short prompts waiting): 20 + 8 + 5 + T <= 2 x 52 -> T <= 71
    assert cost.prompt_allowance(8, 32) == 71
    assert cost.prompt_allowance(8, 4) == 23  # never below the rows decoding now


def test_where_a_chunk_alone_costs_more_than_the_slowdown_allows_a_step_carries_the_minimum():
    cost = StepCost(slowdown=2.0)
    for rows, tokens in [(1, 0), (2, 0), (1, 16), (1, 200), (2, 64)]:  # a tiny model: 1 ms steps, 2 ms per chunk
        cost.observe(rows, tokens, (1 + 0.01 * (rows + tokens) + (2 if tokens else 0)) * MS)
    assert cost.prompt_allowance(1) == MIN_CHUNK


def varied_steps(cost: StepCost, rng: random.Random, step=true_step, count: int = 50) -> None:
    """Steps of many shapes (a server's first minutes), each timed within 5%."""
    for _ in range(count):
        rows, tokens = rng.randint(1, 32), rng.choice([0, 0, 16, 64, 256])
        cost.observe(rows, tokens, step(rows, tokens) * rng.uniform(0.95, 1.05))


def test_steps_all_alike_do_not_lift_the_bound():
    """A flood of long prompts while nothing else decodes: every step carries MIN_CHUNK tokens, so the steps say
    nothing about a token's cost; a step slowed by another process (the front end taking a core) once fitted it
    as free and lifted the bound to the whole token budget (a step 8x as long). The last fit that told holds."""
    cost, rng = StepCost(slowdown=2.0), random.Random(0)
    for _ in range(50):  # one client alone first (one row decoding), then the flood's first, full steps
        cost.observe(1, 0, true_step(1, 0) * rng.uniform(0.95, 1.05))
        tokens = rng.choice([5, 64, 256])
        cost.observe(rng.choice([0, 1]), tokens, true_step(1, tokens) * rng.uniform(0.95, 1.05))
    for i in range(2000):
        rows = rng.choice([0, 1])
        cost.observe(rows, MIN_CHUNK, true_step(rows, MIN_CHUNK) * (2 if i % 97 == 0 else rng.uniform(0.95, 1.05)))
        assert cost.prompt_allowance(rows) <= 2 * MIN_CHUNK


def test_steps_all_alike_at_a_large_allowance_keep_it():
    """Cheap tokens (a fast device): the allowance is large; a backlog of long prompts then runs steps all alike at
    it, which tell nothing new, and the allowance stays (it does not fall to the floor and stay there)."""
    def cheap(rows: int, tokens: int) -> float:
        return (15 + 0.01 * (rows + tokens) + (1 if tokens else 0)) * MS

    cost, rng = StepCost(slowdown=2.0), random.Random(1)
    varied_steps(cost, rng, cheap, count=200)
    allowance = cost.prompt_allowance(8)
    assert allowance > 1000
    for _ in range(500):
        cost.observe(8, allowance, cheap(8, allowance) * rng.uniform(0.97, 1.03))
        assert cost.prompt_allowance(8) > 1000


def test_recent_steps_weigh_more():
    cost = StepCost(slowdown=2.0, smoothing=0.5)
    for rows in (1, 2, 3, 4) * 10:
        cost.observe(rows, 0, true_step(rows, 0))
    for rows in (1, 2, 3, 4) * 10:  # the engine got twice as slow (another process took a core)
        cost.observe(rows, 0, 2 * true_step(rows, 0))
    assert cost.decode_time(4) == pytest.approx(2 * true_step(4, 0), rel=1e-3)


def test_a_bound_must_allow_a_slowdown():
    with pytest.raises(ValueError, match="> 1"):
        StepCost(slowdown=1.0)


def test_a_step_may_carry_twice_the_prompt_work_arriving_lately_whatever_the_slowdown_leaves():
    cost = StepCost(slowdown=2.0)
    for rows, tokens in [(1, 0), (4, 0), (8, 0), (8, 16), (4, 64), (12, 32)]:
        cost.observe(rows, tokens, true_step(rows, tokens))
    assert cost.prompt_allowance(8) == 23  # nothing has arrived
    for _ in range(200):
        cost.admitted(64)  # a sustained load: 64 prompt tokens a step
    assert cost.prompt_allowance(8) == KEEP_UP * 64 > 23
    for _ in range(200):
        cost.admitted(0)  # the load stopped: the slowdown bound again
    assert cost.prompt_allowance(8) == 23


def closed_loop(steps: int, in_flight: int = 32, prompt_len: int = 128, new_tokens: int = 64,
                long_prompt_at: int | None = None):
    """The scheduler and its step bound on true_step's engine, as `loramux serve` steps them (a slowdown cap of 2), under a
    closed loop: a finished request is replaced at once. Per step: (decode rows, prompt tokens, seconds)."""
    config = EngineConfig(max_num_seqs=in_flight + 1, enable_chunked_prefill=True, enable_prefix_caching=False,
                          max_num_batched_tokens=256, block_size=16, prefill_slowdown_cap=2.0)
    sched, rng, log = Scheduler(config, BlockManager(4096, 16)), random.Random(0), []

    def add(length: int) -> None:
        tokens = [rng.randrange(1000) for _ in range(length)]
        sched.add(Sequence(prompt_token_ids=tokens, params=SamplingParams(max_tokens=new_tokens)))

    for _ in range(in_flight):
        add(prompt_len)
    for i in range(steps):
        if i == long_prompt_at:
            add(2048)
        batch = sched.schedule()  # its prompt tokens within the bound the scheduler learned
        decode_rows = sum(not s.is_prefilling for s in batch.seqs)
        prompt_tokens = sum(end - start for s, (start, end) in zip(batch.seqs, batch.spans) if s.is_prefilling)
        seconds = true_step(decode_rows, prompt_tokens)
        sched.observe(batch.seqs, batch.spans, seconds)
        log.append((decode_rows, prompt_tokens, seconds))
        for seq, (_, end) in zip(batch.seqs, batch.spans):
            seq.num_computed_tokens = end
            if end == len(seq):
                seq.append_token(7)
                if seq.num_output_tokens >= new_tokens:
                    sched.finish(seq, "length")
                    add(prompt_len)
    return log


def test_a_sustained_load_keeps_every_request_decoding_under_the_slowdown_cap(monkeypatch):
    """128-token prompts for 64 new tokens: two prompt tokens a decoding row, more than a cap of 2 leaves at 32
    rows. Capped alone, the engine settles with requests parked in prefill; keeping pace with what arrives
    keeps ~all of them decoding."""
    def decoding(log):
        steady = log[200:]
        return sum(rows for rows, _, _ in steady) / len(steady), sum(rows for rows, _, _ in steady) / sum(
            seconds for _, _, seconds in steady)

    rows, throughput = decoding(closed_loop(1200))
    monkeypatch.setattr(step_cost, "KEEP_UP", 0)
    capped_rows, capped_throughput = decoding(closed_loop(1200))
    assert rows > 29.5 and capped_rows < 27
    assert throughput > 1.03 * capped_throughput  # this made-up engine has no GEMM that grows faster


def test_a_long_prompt_arriving_alone_is_still_spread_over_many_steps():
    log = closed_loop(400, in_flight=8, prompt_len=16, new_tokens=256, long_prompt_at=300)
    decode_step = max(seconds for rows, tokens, seconds in log[200:300] if not tokens)
    after = log[300:]
    assert sum(tokens for _, tokens, _ in after) >= 2048  # it was prefilled
    assert max(seconds for _, _, seconds in after) < 3 * decode_step  # 256 tokens a step would be ~7x
    assert sum(1 for _, tokens, _ in after if tokens) >= 10
