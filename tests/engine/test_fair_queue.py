"""The engine's fair queue (engine/fair_queue.py, Scheduler._enqueue): start-time fair queueing over the shares
requests come from (tenants, or clients), first come first served where every request has one origin, and the
priority policy's order within a share only."""
from loramux.config import EngineConfig
from loramux.engine.block_manager import BlockManager
from loramux.engine.fair_queue import FairQueue, Origin
from loramux.engine.scheduler import Scheduler
from loramux.engine.sequence import Sequence
from loramux.sampling_params import SamplingParams


def scheduler(max_num_seqs: int = 4, policy: str = "fcfs") -> Scheduler:
    config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=64, max_num_batched_tokens=4096,
                          enable_chunked_prefill=False, scheduling_policy=policy)
    return Scheduler(config, BlockManager(num_blocks=1024, block_size=16))


def request(share: str | None, weight: float = 1.0, priority: int = 0) -> Sequence:
    return Sequence([1] * 8, SamplingParams(max_tokens=8, priority=priority), origin=Origin(share, share, weight))


def chunked_scheduler() -> Scheduler:
    """Chunked prefill, 64 tokens a step."""
    config = EngineConfig(max_num_seqs=8, max_model_len=512, max_num_batched_tokens=64, enable_chunked_prefill=True)
    return Scheduler(config, BlockManager(num_blocks=1024, block_size=16))


def admit_round(s: Scheduler) -> list[Sequence]:
    batch = s.schedule()
    for seq in batch.seqs:
        s.finish(seq, "stop")
    return batch.seqs


def test_one_tenants_flood_puts_one_round_at_most_before_another_tenants_request():
    s = scheduler()
    flood = [request("A") for _ in range(1000)]
    for seq in flood:
        s.add(seq)
    admit_round(s)  # A's first four
    late = request("B")
    s.add(late)
    assert late in admit_round(s)  # in the very next round, though 996 of A's arrived before it


def test_backlogged_shares_are_admitted_in_proportion_to_their_weights():
    s = scheduler()
    for _ in range(200):
        s.add(request("A", weight=3.0))
        s.add(request("B", weight=1.0))
    admitted = [seq.origin.share for _ in range(20) for seq in admit_round(s)]
    assert admitted.count("A") == 60 and admitted.count("B") == 20


def test_without_origins_the_queue_is_first_come_first_served_and_priority_orders_within_a_share():
    s = scheduler(max_num_seqs=1)
    seqs = [request(None) for _ in range(5)]
    for seq in seqs:
        s.add(seq)
    assert [admit_round(s)[0] for _ in range(5)] == seqs
    s = scheduler(max_num_seqs=1, policy="priority")
    a_late, a_urgent, b = request("A", priority=5), request("A", priority=-5), request("B", priority=0)
    for seq in (a_late, b, a_urgent):
        s.add(seq)
    # A's urgent request takes A's earliest tag; it cannot take B's place, whatever its priority
    assert [admit_round(s)[0] for _ in range(3)] == [a_urgent, b, a_late]


def test_fair_queue_tags_start_at_virtual_time_for_an_idle_share():
    fair = FairQueue()
    tags = [fair.tag(Origin(share="A"), 100) for _ in range(3)]
    assert tags == [0.0, 100.0, 200.0]
    fair.admitted(100.0)
    assert fair.tag(Origin(share="B", weight=2.0), 100) == 100.0 and fair.tag(Origin(share="B", weight=2.0), 100) == 150.0


def test_a_share_under_its_part_of_the_batch_takes_places_from_the_share_furthest_over_and_no_more():
    s = scheduler(max_num_seqs=4)
    flood = [request("A") for _ in range(6)]
    for seq in flood:
        s.add(seq)
    assert s.schedule().seqs == flood[:4]  # A fills the batch; two of its requests wait
    b = [request("B", weight=3.0) for _ in range(4)]  # B's part of the 4 places: 3
    s.add(b[0])
    batch = s.schedule()
    assert batch.preempted == [flood[3]] and batch.seqs == [b[0]]  # A's newest gives its place back
    assert flood[3].num_preemptions == 1 and list(s.waiting)[-1] is flood[3]  # queued again behind A's others
    s.add(b[1])
    assert s.schedule().preempted == [flood[2]]
    s.add(b[2])
    assert s.schedule().preempted == [flood[1]]
    s.add(b[3])
    batch = s.schedule()
    assert batch.preempted == [] and b[3] in s.waiting  # at its part: it waits for a place like anyone
    assert sorted(q.origin.share for q in s.running) == ["A", "B", "B", "B"]


def test_one_origin_never_preempts_for_fairness():
    s = scheduler(max_num_seqs=2)
    seqs = [request(None) for _ in range(3)]
    for seq in seqs:
        s.add(seq)
    s.schedule()
    assert s.schedule().preempted == [] and seqs[2] in s.waiting


def test_shares_take_turns_at_a_steps_prompt_budget_so_one_shares_starving_prompts_never_hold_anothers():
    s = chunked_scheduler()
    long = [Sequence([1] * 300, SamplingParams(max_tokens=8), origin=Origin("A", "A")) for _ in range(3)]
    for seq in long:
        s.add(seq)
    s.schedule()
    for seq in long:
        seq.waited_steps = s.max_wait_steps  # passed over for long: within A they go first
    longer = Sequence([1] * 100, SamplingParams(max_tokens=8), origin=Origin("B", "B"))  # more than a step's budget
    s.add(longer)
    batch = s.schedule()
    assert batch.seqs == [longer] and batch.spans == [(0, 64)]  # B's turn first (shortest): A's starving ones wait


def test_a_prompt_that_ends_this_step_for_a_share_with_nothing_decoding_goes_without_other_shares_chunks():
    """An interactive client's next request: the step that gives its first token carries no chunk of another
    share's long prompt (which would hold that token back by its cost); never two steps in a row."""
    s = chunked_scheduler()
    long = [Sequence([1] * 300, SamplingParams(max_tokens=8), origin=Origin("A", "A")) for _ in range(2)]
    for seq in long:
        s.add(seq)
    s.schedule()
    first, second = (Sequence([i + 2] * 8, SamplingParams(max_tokens=8), origin=Origin(share, share))
                     for i, share in enumerate("BC"))
    s.add(first)
    batch = s.schedule()
    assert batch.seqs == [first] and batch.spans == [(0, 8)]  # A's chunks wait this step
    for seq, (start, end) in zip(batch.seqs, batch.spans):
        seq.num_computed_tokens = end
    s.add(second)  # another share's request right behind: A's turn comes first
    batch = s.schedule()
    assert any(seq in long for seq in batch.seqs)
    prompts = [seq for seq in batch.seqs if seq.is_prefilling]
    assert second in prompts and len(prompts) > 1


def test_the_first_tokens_step_holds_back_the_same_shares_long_prompt_too():
    s = chunked_scheduler()
    other = Sequence([1] * 300, SamplingParams(max_tokens=8), origin=Origin("A", "A"))
    own = Sequence([3] * 300, SamplingParams(max_tokens=8), origin=Origin("B", "B"))
    for seq in (other, own):
        s.add(seq)
    while s.waiting:  # both long prompts under way
        batch = s.schedule()
        for seq, (_, end) in zip(batch.seqs, batch.spans):
            seq.num_computed_tokens = end
    short = Sequence([2] * 8, SamplingParams(max_tokens=8), origin=Origin("B", "B"))
    s.add(short)
    batch = s.schedule()
    assert batch.seqs == [short] and batch.spans == [(0, 8)]


def test_one_share_never_holds_its_own_prompts_back_for_its_first_token():
    s = chunked_scheduler()
    long = Sequence([1] * 300, SamplingParams(max_tokens=8))
    s.add(long)
    s.schedule()
    short = Sequence([2] * 8, SamplingParams(max_tokens=8))
    s.add(short)
    batch = s.schedule()
    assert batch.seqs == [short, long] and batch.spans[0] == (0, 8)  # shortest first, the rest to the long one


def test_one_share_keeps_its_own_chunk_order():
    s = chunked_scheduler()
    long = [Sequence([1] * 300, SamplingParams(max_tokens=8)) for _ in range(2)]
    for seq in long:
        s.add(seq)
    assert s.schedule().seqs == [long[0]]  # the budget reaches one prompt
    long[0].waited_steps = s.max_wait_steps
    short = Sequence([1] * 8, SamplingParams(max_tokens=8))
    s.add(short)
    assert s.schedule().seqs[0] is long[0]  # the starving one first, as ever, though the short one is shorter
