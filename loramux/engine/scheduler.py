"""Scheduler: continuous batching that keeps every step within the device's adapter slots. No torch.

Each step is all-prefill or all-decode, as in nano-vllm: admit waiting requests if any fit, else decode
every running one. With chunked prefill (EngineConfig.enable_chunked_prefill, as vLLM's; the default) a step
is mixed instead: every decoding request, then chunks of the prompts being prefilled and of newly admitted
ones, shortest remaining prompt first, up to max_num_batched_tokens (and the engine's bound on the prompt
tokens of a step that decodes); each sequence's `span` says which of its tokens run. A step that gives the first
token of a share with nothing decoding (an interactive client's request) carries only the prompts that end in it
when another share's would come too (_first_tokens_alone). On top of that, the adapter rule: the adapters of running requests plus the pinned
ones never exceed max_loras, because a decode step runs all running requests in one forward pass and
each adapter there needs its own device slot. A request whose adapter has no slot, or is not in host memory
yet, is skipped, not blocking, until it has been passed over max_wait_steps times; then it goes first (age
bound): the step admits nothing else until it has a slot; while its adapter is read, the slot it will take is
kept for it; and while its adapter waits for room in host memory that requests in use hold, nothing else that
would take more of that room is admitted (only requests that already hold their identity, and base-model
ones) — so the room comes as running requests finish, and the head of the queue always moves.

Adapters: a request names one; when it is admitted the name is resolved to the adapter's current identity
(an AdapterRef, one per load) and the request runs on that identity to the end, through preemptions. While
it runs it holds an in-flight reference (its identity is never evicted); from admission to its end it
holds the identity (never removed, kept in host memory), so a reload in place or an unload of the name
never changes the weights of a request that has started. A request whose name is unloaded before it
starts ends with an error.
"""
from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from loramux.adapters.cache import AdapterCache, Readiness
from loramux.adapters.off import NoCache
from loramux.config import EngineConfig
from loramux.engine.block_manager import BlockManager
from loramux.engine.fair_queue import FairQueue
from loramux.engine.sequence import Sequence, SequenceStatus
from loramux.engine.speculative import Speculator
from loramux.engine.step_cost import StepCost

FINISH_REASONS = ("stop", "length", "abort", "error")  # abort: cancelled or adapter gone; error: failed in a step


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work. Plain Python data: the model runner builds the tensors."""

    seqs: list[Sequence]
    """To run this step, in any order (the runner groups them by adapter itself)."""
    is_prefill: bool
    preempted: list[Sequence]
    """Moved back to the waiting queue during this schedule() call; their K/V is recomputed later."""
    failed: list[Sequence]
    """Finished with finish_reason "error": their adapter was unloaded before they started."""
    spans: list[tuple[int, int]] | None = None
    """Chunked prefill: per sequence, the token positions [start, end) this step computes (a decode row:
    (len - 1, len)); it samples a token only where end == len(seq). None: whole prefills or decodes."""
    new_prompt_work: int = 0
    """The prompt tokens (past their cached prefixes) of the requests admitted this step whose prompt fits in one
    step's budget, in budget units: the short prompts the load sends, which engine/step_cost.py keeps pace
    with (a longer prompt is what the step bound spreads out)."""


class _Verdict(enum.Enum):
    ADMITTED = "admitted"
    NO_ROOM = "no room"  # max_num_seqs, token budget or KV blocks: stop scanning (FIFO for memory)
    NO_SLOT = "no slot"  # only the adapter rule: skip, later requests may fit
    IN_FLIGHT = "in flight"  # another request is computing its prefix's blocks: it waits to share them
    NOT_READY = "not ready"  # its adapter is being read back into host memory (off the step loop)
    NO_HOST_ROOM = "no host room"  # its adapter is read, and waits for room in host memory


@dataclass
class _Pass:
    """What one admission pass has committed to so far."""

    needed: set[Hashable]  # adapter identities that must hold a slot: running (incl. admitted this pass), pinned
    num_tokens: int = 0
    budget: int | None = None  # chunked prefill: the step's tokens left when the pass began
    admitted: list[Sequence] = field(default_factory=list)
    skipped: list[Sequence] = field(default_factory=list)


class Scheduler:
    """Decides which sequences run each step; owns the waiting queue and the running list.

    Invariants: a RUNNING sequence holds its KV blocks and an in-flight reference on its adapter identity
    (taken at admission, dropped at finish, abort or preemption); a WAITING one holds neither. A sequence
    with an adapter_ref holds that identity until it finishes. `running` is in admission order, so its last
    element is the preemption victim.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, adapters: AdapterCache | NoCache = NoCache(),
                 current: Callable[[str], Hashable | None] = lambda model: None,
                 ready: Callable[[Hashable, bool], Readiness] = lambda ref, first: Readiness.READY,
                 activation: Callable[[Hashable, list[int]], int] = lambda ref, prompt: 0,
                 speculator: Speculator | None = None):
        """adapters: the engine's AdapterCache (NoCache: base model only); current(model): the identity requests
        for `model` (a name, or name@rev) start on now, None once it is gone (the adapter store's lookup); ready(identity, first): where
        it stands — if not in host memory, its read starts, off the step loop (first: for the head of the
        queue, past any prefetch limit; the engine's AdapterLoader.readiness; by default always ready);
        activation(identity, prompt): the first prompt position it acts on (aLoRA; LoRAManager.activation);
        speculator: what decoding requests propose each step (speculative decoding; None: off)."""
        self.block_manager = block_manager
        self.adapters, self.current, self.ready, self.activation = adapters, current, ready, activation
        self.speculator = speculator
        self.max_num_seqs = config.max_num_seqs
        self.chunked = config.enable_chunked_prefill
        # Unchunked, a prompt of max_model_len tokens must fit one prefill step, or it could never run.
        budget = config.step_token_budget()  # the engine resolved it for its device
        self.max_num_batched_tokens = budget if self.chunked else max(budget, config.max_model_len or 0)
        self.max_model_len = config.max_model_len
        self.max_loras = adapters.max_loras
        self.max_wait_steps = config.max_wait_steps
        self.by_priority = config.scheduling_policy == "priority"
        # by fair-queue tag (engine/fair_queue.py: FIFO where every request has the same origin), preempted ones
        # at the front; by_priority, each share's requests take its tags in order of (priority, arrival) (_key)
        self.fair = FairQueue()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # the bound on a chunked step's prompt tokens, from the steps' times (observe)
        self.step_cost = StepCost(config.prefill_slowdown_cap if self.chunked else None)
        self._held_back = False  # the last chunked step held other shares' prompts back (_first_tokens_alone)

    # ---- queries -------------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def rows_about_to_decode(self) -> int:
        """Rows decoding now, and the held requests whose (rest of a) prompt fits in one step's token budget:
        the batch the engine decodes within a step or two (up to max_num_seqs)."""
        held = itertools.chain(self.running, self.waiting)
        soon = (s for s in held if len(s) - s.num_computed_tokens <= self.max_num_batched_tokens)
        return sum(1 for _ in itertools.islice(soon, self.max_num_seqs))  # (a long queue is not walked to its end)

    @property
    def num_decoding(self) -> int:
        """Running requests past their prompt: each takes a decode row in the next step."""
        return sum(not s.is_prefilling for s in self.running)

    def waiting_adapters(self) -> set[str]:
        """Adapter names waiting requests ask for."""
        return {s.adapter for s in self.waiting if s.adapter is not None}

    def running_adapters(self) -> set[Hashable]:
        """Adapter identities of the running requests: each needs a device slot in a decode step."""
        return {s.adapter_ref for s in self.running if s.adapter_ref is not None}

    # ---- requests in and out -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new request. Refuses one that could never run, rather than letting it wait forever."""
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(f"request {seq.request_id!r} is {seq.status.value}; only new requests can be added")
        if seq.adapter is not None and not self.max_loras:
            raise ValueError(f"request {seq.request_id!r} asks for adapter {seq.adapter!r} but this engine "
                             "serves the base model only (EngineConfig.lora is None)")
        self._check_fits(seq)
        self._enqueue(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish the request with "abort" wherever it is; None if it is not here (already finished)."""
        seq = next((s for s in (*self.waiting, *self.running) if s.request_id == request_id), None)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq`: free its blocks and adapter reference, and drop it from the queues."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {', '.join(FINISH_REASONS)}, got {reason!r}")
        if seq.is_finished:
            raise RuntimeError(f"request {seq.request_id!r} already finished ({seq.finish_reason})")
        queue = self.running if seq.status is SequenceStatus.RUNNING else self.waiting
        if seq not in queue:
            raise ValueError(f"request {seq.request_id!r} ({seq.status.value}) was never added to this scheduler")
        queue.remove(seq)
        if seq.status is SequenceStatus.RUNNING:
            self._free(seq)
        if seq.adapter_ref is not None:
            self.adapters.unhold(seq.adapter_ref)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """The next step: a prefill of newly admitted requests if any fit, else a decode of all running.
        Chunked: one mixed step, its prompt tokens within the step bound (StepCost, fed by observe)."""
        failed = self._fail_unloaded()
        self._prefetch()
        fair = self._fair_preempt()
        if self.chunked:
            batch = self._schedule_chunked(failed, self._prompt_allowance(), fair)
            self.step_cost.admitted(batch.new_prompt_work)
            return batch
        admitted = self._admit()
        if admitted:  # spans: where cached prefixes let prefills start later
            spans = [(s.num_computed_tokens, len(s)) for s in admitted]
            spans = spans if any(start for start, _ in spans) else None
            return ScheduledBatch(seqs=admitted, is_prefill=True, preempted=fair, failed=failed, spans=spans)
        seqs, preempted = self._schedule_running()
        self._speculate(seqs, self.max_num_batched_tokens - len(seqs))
        spans = [(s.num_computed_tokens, len(s) + len(s.draft_ids)) for s in seqs]
        spans = spans if any(s.draft_ids for s in seqs) else None
        return ScheduledBatch(seqs=seqs, is_prefill=False, preempted=fair + preempted, failed=failed, spans=spans)

    def _prompt_allowance(self) -> int | None:
        """The step bound's prompt tokens for the next step; the batch about to decode is counted only where
        there is a bound (offline, thousands of requests may wait)."""
        if not self.step_cost.bounding:
            return None
        return self.step_cost.prompt_allowance(self.num_decoding, self.rows_about_to_decode)

    def observe(self, seqs: list[Sequence], spans: list[tuple[int, int]] | None, seconds: float) -> None:
        """A chunked step of `seqs` over `spans` (as schedule() gave them, before they advance) ran in `seconds`:
        what the step bound (and speculative decoding's costs) learn from."""
        if spans is None:
            if self.speculator is not None and seqs and not any(s.is_prefilling for s in seqs):
                self.speculator.observe(len(seqs), 0, seconds)  # an unchunked decode step
            return
        decode_rows = sum(not s.is_prefilling for s in seqs)
        prompt_tokens = sum((end - start) * s.prompt_token_cost for s, (start, end) in zip(seqs, spans)
                            if s.is_prefilling)
        drafts = sum(end - start - 1 for s, (start, end) in zip(seqs, spans) if not s.is_prefilling)
        if self.speculator is not None and not prompt_tokens:
            self.speculator.observe(decode_rows, drafts, seconds)
        self.step_cost.observe(decode_rows, prompt_tokens + drafts, seconds)  # (verified tokens cost as prompt ones)

    def _schedule_chunked(self, failed: list[Sequence], allowance: int | None,
                          fair: list[Sequence]) -> ScheduledBatch:
        """Every decoding request one token; then prompt work within the step's budget (max_num_batched_tokens
        less the decode rows, and at most `allowance` prompt tokens: the engine's bound on a step's time):
        running prefills and new admissions, shortest remaining prompt first, so a short request is not held
        behind a long prompt; a prefill passed over max_wait_steps times goes first."""
        running, preempted = self._schedule_running()
        decodes = [s for s in running if not s.is_prefilling]
        budget = self.max_num_batched_tokens - len(decodes)
        budget -= self._speculate(decodes, budget)
        if allowance is not None:
            budget = min(budget, allowance)
        admitted = self._admit(budget=budget)
        prefills = self._first_tokens_alone([s for s in running if s.is_prefilling] + admitted, decodes, budget)
        chunks = self._chunks(prefills, budget)
        seqs = decodes + [seq for seq, _ in chunks]
        spans = [(s.num_computed_tokens, len(s) + len(s.draft_ids)) for s in decodes] + [span for _, span in chunks]
        work = [s.prompt_work_left for s in admitted]
        return ScheduledBatch(seqs=seqs, is_prefill=False, preempted=fair + preempted, failed=failed, spans=spans,
                              new_prompt_work=sum(w for w in work if w <= self.max_num_batched_tokens))

    def _first_tokens_alone(self, prefills: list[Sequence], decodes: list[Sequence], budget: int) -> list[Sequence]:
        """The prefills this step may carry. Where a share with nothing decoding has a prompt that ends within
        this step's budget (an interactive client's next request: this step gives its first token), the step
        carries only such prompts when another share's would come with them: those would hold the first token
        back by their whole cost (a chunk deep in a long prompt costs several short steps: it reads every
        earlier position's K/V), and wait a step instead. Never two steps in a row, so the others keep at least
        every other step however many such requests arrive; one share alone keeps its own order."""
        decoding = {s.origin.share for s in decodes}
        ending = [s for s in prefills if s.origin.share not in decoding and s.prompt_work_left <= budget]
        firsts = {id(s) for s in ending}
        held = [s for s in prefills if id(s) not in firsts]
        shares = {s.origin.share for s in ending}
        if not ending or self._held_back or all(s.origin.share in shares for s in held):
            self._held_back = False
            return prefills
        self._held_back = True
        for seq in held:
            seq.waited_steps += 1
        return ending

    def _chunks(self, prefills: list[Sequence], budget: int) -> list[tuple[Sequence, tuple[int, int]]]:
        """Each prefill's chunk this step, in the order they get the budget (those it does not reach wait): the
        shares take turns (each share's first, shortest of them first; then each share's second, ...), a share's
        own by (passed over max_wait_steps first, then shortest remaining prompt). Where every request has one
        origin, that is the share's own order: one share's starving prompts never hold another's short one."""
        def remaining(seq: Sequence) -> int:
            return len(seq) - seq.num_computed_tokens

        own = sorted(prefills, key=lambda s: (s.waited_steps < self.max_wait_steps, remaining(s)))
        order = _take_turns(own, remaining)
        chunks = []
        for seq in order:  # a prompt token scored for its logprobs takes two of the budget
            cost = seq.prompt_token_cost
            take = min(remaining(seq), max(0, budget) // cost)
            if take:
                chunks.append((seq, (seq.num_computed_tokens, seq.num_computed_tokens + take)))
                seq.waited_steps, budget = 0, budget - take * cost
            else:
                seq.waited_steps += 1
        return chunks

    def _admit(self, budget: int | None = None) -> list[Sequence]:
        """Scan the waiting queue in FIFO order; starving requests, if any, must go first. budget (chunked
        prefill): tokens left in this step; an admitted request needs one of them, not its whole prompt."""
        step = _Pass(needed=self.running_adapters() | self._pinned())
        step.budget = budget
        started_only = False
        while (head := self._head_of_line()) is not None:
            verdict = self._try_admit(head, step, first=True)
            if verdict in (_Verdict.NOT_READY, _Verdict.NO_HOST_ROOM):
                step.needed.add(self._ref(head))  # its slot is kept for it: the others go on in the rest
            if verdict in (_Verdict.IN_FLIGHT, _Verdict.NOT_READY):
                break  # it waits for its prefix or its adapter a step or two: the others go on meanwhile
            if verdict is _Verdict.NO_HOST_ROOM:
                started_only = True  # the room it waits for comes as running requests finish
                break
            if verdict is not _Verdict.ADMITTED:
                # Hold everything else back so running requests drain and free a slot for its adapter.
                return step.admitted
        for seq in list(self.waiting):
            if started_only and seq.adapter is not None and seq.adapter_ref is None:
                continue
            verdict = self._try_admit(seq, step)
            if verdict is _Verdict.NO_ROOM:
                break
            if verdict in (_Verdict.NO_SLOT, _Verdict.NOT_READY, _Verdict.NO_HOST_ROOM):
                step.skipped.append(seq)
        if step.admitted:
            for seq in step.skipped:
                seq.waited_steps += 1
        return step.admitted

    def _try_admit(self, seq: Sequence, step: _Pass, first: bool = False) -> _Verdict:
        ref = self._ref(seq)
        shared = b""  # K/V are shared within a tenant's requests with the same cache_salt (vLLM's), ...
        if seq.origin.tenant is not None:
            shared += b"\0tenant\0" + seq.origin.tenant.encode()
        if seq.params.cache_salt is not None:
            shared += b"\0" + seq.params.cache_salt.encode()
        salt = b"base" + shared if ref is None else repr(ref).encode() + shared  # ... and one adapter identity
        if salt != seq.cache_salt:  # first looked at, or its name moved to another identity since
            # (its activation, aLoRA's, depends on nothing else: worked out here, not at every look)
            activation = 0 if ref is None else self.activation(ref, seq.token_ids[:seq.num_prompt_tokens])
            seq.cache_salt, seq.base_salt, seq.activation, seq.block_hashes = salt, b"base" + shared, activation, []
        # Room first: a request short of both room and a slot stops the scan (rule: FIFO for memory).
        if not self._has_room(seq, step):
            return _Verdict.NO_ROOM
        if ref is not None and not self._slot_fits(ref, step.needed):
            return _Verdict.NO_SLOT
        readiness = Readiness.READY if ref is None else self.ready(ref, first)
        if readiness is not Readiness.READY:
            return _Verdict.NO_HOST_ROOM if readiness is Readiness.NO_ROOM else _Verdict.NOT_READY
        if self.block_manager.in_flight(seq):
            return _Verdict.IN_FLIGHT
        self.waiting.remove(seq)
        self.fair.admitted(seq.fair_tag)
        seq.num_computed_tokens = self.block_manager.allocate(seq)  # its cached prefix: the prefill starts after
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed_tokens
        seq.waited_steps = 0  # from now on it counts the steps its prefill is passed over
        if ref is not None:
            if seq.adapter_ref is None:  # from now on, through any preemption, it runs on this identity
                seq.adapter_ref = ref
                self.adapters.hold(ref)
            self.adapters.acquire(ref)
            step.needed.add(ref)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        left = len(seq) - seq.num_computed_tokens
        step.num_tokens += left if step.budget is None else min(left, step.budget - step.num_tokens)
        step.admitted.append(seq)
        return _Verdict.ADMITTED

    def _has_room(self, seq: Sequence, step: _Pass) -> bool:
        if step.budget is not None:  # chunked: any token left starts its prompt
            tokens_fit = step.num_tokens < step.budget
        else:
            tokens_fit = step.num_tokens + len(seq) <= self.max_num_batched_tokens
        return len(self.running) < self.max_num_seqs and tokens_fit and self.block_manager.can_allocate(seq)

    def _slot_fits(self, adapter: Hashable, needed: set[Hashable]) -> bool:
        return adapter in needed or len(needed) + 1 <= self.max_loras

    def _head_of_line(self) -> Sequence | None:
        """The oldest request that has waited max_wait_steps, if its adapter could get a slot at all.

        One whose adapter cannot fit even beside the pinned ones alone would block everyone forever;
        it waits for an unpin instead."""
        pinned = self._pinned()
        return next((s for s in self.waiting
                     if s.waited_steps >= self.max_wait_steps
                     and (s.adapter is None or self._slot_fits(self._ref(s), pinned))), None)

    def _schedule_running(self) -> tuple[list[Sequence], list[Sequence]]:
        """Every running request, in admission order; a decoding one gets a block for its next token, and
        when memory runs out the newest give up theirs. (A prefilling one, chunked, holds its blocks.)"""
        scheduled: list[Sequence] = []
        preempted: list[Sequence] = []
        # admission order, oldest first (by_priority: most urgent first), so victims come off the back
        queue = deque(sorted(self.running, key=_key) if self.by_priority else self.running)
        while queue:
            seq = queue.popleft()
            if seq.is_prefilling:
                scheduled.append(seq)
                continue
            while not self.block_manager.can_append(seq):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        return scheduled, preempted

    def _speculate(self, decodes: list[Sequence], budget: int) -> int:
        """Speculative decoding: each decoding sequence's proposed tokens for this step (Sequence.draft_ids),
        within what max_tokens and max_model_len leave, `budget` tokens in all and the KV blocks free (a proposal
        never preempts anyone); returns the tokens proposed."""
        if self.speculator is None:
            return 0
        for seq in self.running:  # last step's proposals are spent (a sequence left out of it trims here too)
            if seq.draft_ids:
                seq.draft_ids = []
                self.block_manager.trim(seq)
        if not decodes:
            return 0
        limits = [min(s.params.max_tokens - s.num_output_tokens - 1,
                      (self.max_model_len or len(s) + budget) - len(s) - 1) for s in decodes]
        ks, total = self.speculator.plan(decodes, limits), 0
        for i, seq in enumerate(decodes):  # blocks first: a draft model writes its K/V at the proposed positions
            ks[i] = min(ks[i], max(0, budget - total))
            if ks[i] and self.block_manager.can_append(seq, ks[i]):
                self.block_manager.may_append(seq, ks[i])
                total += ks[i]
            else:
                ks[i] = 0
        for seq, draft in zip(decodes, self.speculator.propose(decodes, ks)):
            seq.draft_ids = draft
            self.block_manager.trim(seq, len(draft))
        return sum(len(s.draft_ids) for s in decodes)

    def _preempt(self, seq: Sequence, front: bool = True) -> None:
        """Recompute preemption: drop the K/V and re-prefill later, ahead of newer arrivals (front), or (a fair
        share's victim) queued again as a new arrival of its share."""
        self.running.remove(seq)
        self._free(seq)
        seq.draft_ids, seq.draft_computed = [], 0
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.waited_steps = 0  # a new wait starts; it is at the front of the queue anyway (of its priority)
        self._enqueue(seq, front=front)

    def _fair_preempt(self) -> list[Sequence]:
        """The first waiting request cannot start for want of a place in the batch or KV blocks, and its share
        runs fewer requests than its fair part of max_num_seqs (by weight, among the shares running or first in
        line) while another share runs more: the newest request of the share furthest over its part gives its
        place back (a recompute preemption; it queues again behind its share's tag). One a step: a share over
        its part loses places only to a share under its own, and never goes below its part."""
        head = self.waiting[0] if self.waiting and self.running else None
        if head is None or not self._only_room_missing(head):
            return []
        running, part = self._shares(head)
        mine = head.origin.share
        if len(running.get(mine, ())) + 1 > part[mine]:
            return []
        over = max((share for share in running if share != mine), key=lambda s: len(running[s]) - part[s], default=None)
        if over is None or len(running[over]) - 1 < part[over]:
            return []
        victim = running[over][-1]
        self._preempt(victim, front=False)
        return [victim]

    def _only_room_missing(self, seq: Sequence) -> bool:
        """Whether a place in the batch and KV blocks are all `seq` lacks to start now (its adapter has a slot
        and is in host memory)."""
        if len(self.running) < self.max_num_seqs and self.block_manager.can_allocate(seq):
            return False
        ref = self._ref(seq)
        if ref is None:
            return True
        ready = self.ready(ref, False) is Readiness.READY
        return ready and self._slot_fits(ref, self.running_adapters() | self._pinned())

    def _shares(self, head: Sequence) -> tuple[dict[Hashable, list[Sequence]], dict[Hashable, float]]:
        """The running requests of each share (in admission order), and each share's weighted part of
        max_num_seqs among those running and `head`'s."""
        running: dict[Hashable, list[Sequence]] = {}
        for seq in self.running:
            running.setdefault(seq.origin.share, []).append(seq)
        weights = {s.origin.share: s.origin.weight for s in (*self.running, head)}
        total = sum(weights.values())
        return running, {share: self.max_num_seqs * w / total for share, w in weights.items()}

    def _prefetch(self) -> None:
        """Start reading the adapters of the next waiting requests back into host memory (S-LoRA's prefetch):
        by the time they reach the head of the queue they are ready."""
        refs = [ref for seq in itertools.islice(self.waiting, self.max_num_seqs) if (ref := self._ref(seq)) is not None]
        self.adapters.want(frozenset(refs))
        for ref in refs:
            self.ready(ref, False)

    def fail_waiting_on(self, ref: Hashable) -> list[Sequence]:
        """Finish (with "error") the waiting requests that would run on `ref`: it cannot be read any more."""
        failed = [s for s in self.waiting if s.adapter is not None and self._ref(s) == ref]
        for seq in failed:
            self.finish(seq, "error")
        return failed

    def _fail_unloaded(self) -> list[Sequence]:
        """Finish waiting requests whose adapter was unloaded before they started (started ones hold theirs)."""
        failed = [s for s in self.waiting if s.adapter is not None and self._ref(s) is None]
        for seq in failed:
            self.finish(seq, "error")
        return failed

    # ---- helpers -------------------------------------------------------------------------
    def _enqueue(self, seq: Sequence, front: bool = False) -> None:
        """Into the waiting queue in fair-queue order (engine/fair_queue.py; arrival order where every request has
        one origin). front: a preempted one, which keeps its tag and goes first (by_priority: first of its
        priority). by_priority: a share's waiting requests take its tags in order of _key."""
        if not front:
            seq.fair_tag = self.fair.tag(seq.origin, seq.num_prompt_tokens + seq.params.max_tokens)
        if self.by_priority:
            self._order_share(seq)
            self.waiting = deque(sorted(self.waiting, key=_fair_key))
        elif front:
            self.waiting.appendleft(seq)
        elif not self.waiting or _fair_key(self.waiting[-1]) <= _fair_key(seq):
            self.waiting.append(seq)
        else:
            self.waiting.insert(next(i for i, s in enumerate(self.waiting) if _fair_key(s) > _fair_key(seq)), seq)

    def _order_share(self, seq: Sequence) -> None:
        """Add `seq` to the waiting queue; its share's waiting requests swap tags so that the most urgent (_key)
        holds the earliest."""
        self.waiting.append(seq)
        mine = [s for s in self.waiting if s.origin.share == seq.origin.share]
        for s, tag in zip(sorted(mine, key=_key), sorted(s.fair_tag for s in mine)):
            s.fair_tag = tag

    def _free(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        if seq.adapter_ref is not None:
            self.adapters.release(seq.adapter_ref)

    def _ref(self, seq: Sequence) -> Hashable | None:
        """The adapter identity `seq` runs on: fixed once admitted, else the one its name resolves to now."""
        if seq.adapter is None:
            return None
        return seq.adapter_ref or self.current(seq.adapter)

    def _pinned(self) -> set[str]:
        return self.adapters.pinned

    def _check_fits(self, seq: Sequence) -> None:
        """A request's longest prefill (a preempted one re-prefills its output too) and its K/V must fit
        an otherwise empty engine, or it would wait forever."""
        # The engine ends a request at max_model_len tokens, and the last generated token is never fed
        # back, so the longest sequence a step sees is one short of the final length.
        final_len = seq.num_prompt_tokens + seq.params.max_tokens
        max_len = min(final_len, self.max_model_len or final_len) - 1
        max_blocks = -(-max_len // self.block_manager.block_size)
        too_long = max_len > self.max_num_batched_tokens and not self.chunked  # chunks fit any step
        if too_long or max_blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"request {seq.request_id!r} needs room for {max_len} tokens ({len(seq)} prompt + max_tokens "
                f"{seq.params.max_tokens} - 1); limits: {self.max_num_batched_tokens} tokens per prefill, "
                f"{self.block_manager.num_blocks * self.block_manager.block_size} KV-cache token positions"
            )


def _key(seq: Sequence) -> tuple[int, int]:
    """The priority policy's order: lower priority value first, then earlier arrival (vLLM's)."""
    return seq.params.priority, seq.seq_id


def _take_turns(seqs: list[Sequence], remaining: Callable[[Sequence], int]) -> list[Sequence]:
    """`seqs` (in each share's own order) with the shares taking turns: every share's first, shortest first, then
    every share's second, ...; unchanged where they all share one origin."""
    turn, seen = {}, {}
    for seq in seqs:
        turn[id(seq)] = seen.get(seq.origin.share, 0)
        seen[seq.origin.share] = turn[id(seq)] + 1
    if len(seen) < 2:
        return seqs
    return sorted(seqs, key=lambda s: (turn[id(s)], remaining(s)))


def _fair_key(seq: Sequence) -> tuple[float, int, int]:
    """The waiting queue's order: fair-queue tag, then (the priority policy's order) priority, then arrival."""
    return seq.fair_tag, seq.params.priority, seq.seq_id
