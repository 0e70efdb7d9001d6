"""Speculative decoding's policy: what each decoding request proposes, and whether proposing pays. No torch.

A request proposes up to k next tokens (NgramProposer: prompt lookup; or a draft model, engine/draft_model.py,
passed in as the proposer); the model runner verifies them in one
forward pass over its k + 1 positions with its own adapter and keeps the longest run the model agrees with,
plus the model's own next token (engine/model_runner.py: _verify). A proposal is a single token per position
(a one-hot draft distribution), so drawing each position from the model's own distribution and stopping at the
first draw that differs from the draft is exact rejection sampling: greedy rows get the tokens they would get
without speculation, sampled rows the same distribution.

Whether it pays, per request and step (Speculator.plan): the i-th proposed token is accepted with probability
about a^i, where a is the request's own acceptance so far (Acceptance); verifying one more token costs `per_row`
seconds, and an accepted token is worth what one token of a step costs that row, step / rows. So a request
proposes k tokens where a^k >= per_row * rows / step, from the step times the engine measured (StepCost; the
time a draft model took to propose counts as part of its step); with free proposals (lookup), a step whose
expected gain is below the fixed cost of a verification pass proposes nothing. A request whose
acceptance fell to nothing proposes one token after PROBE_EVERY steps, to notice when its text turns
repetitive again (a draft model's: twice as long after each probe that fails, up to MAX_PROBE_EVERY).
"""
from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

from loramux.config import SpeculativeConfig
from loramux.engine.step_cost import StepCost

DEFAULT_THRESHOLD = 0.25  # until the step times are known: propose the i-th token while a^i >= this
KNOWN_AFTER = 16  # steps of each kind (decode-only, verifying) before the learned costs are trusted
DECAY = 0.8  # a request's acceptance: the weight of its earlier verifications against the newest
PRIOR = (3.0, 0.5)  # (accepted, rejected) a request starts with: a ~ 0.8, so a new request proposes
PROBE_EVERY = 8  # steps between one-token probes of a request whose acceptance pays for nothing, at first:
MAX_PROBE_EVERY = 128  # each probe that fails doubles the wait, up to this; one that succeeds resets it
MAX_DISABLE_BY_BATCH = {"cpu": 8, "cuda": 32}  # SpeculativeConfig.disable_by_batch_size's default by device


class NgramProposer:
    """Prompt lookup (vLLM's "ngram"): the tokens that followed the latest earlier occurrence of the sequence's
    last n tokens, for the longest n in [min_n, max_n] that occurs."""

    free = True  # its proposals cost nothing to make (none where nothing matches): a step whose expected gain
    # is too low drops them, and a request whose probes fail keeps probing at the same pace

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose_all(self, seqs: list, ks: list[int]) -> list[list[int]]:
        return [self.propose(seq.token_ids, k) for seq, k in zip(seqs, ks)]

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) <= self.min_n:
            return []
        data = array("q", tokens).tobytes()  # one bytes search per n, aligned to whole tokens below
        width = 8
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = data[-n * width:]
            end = len(data) - width  # an occurrence must end before the last token: something follows it
            while (start := data.rfind(suffix, 0, end)) >= 0:
                if start % width == 0:
                    after = start // width + n
                    return tokens[after:after + k]
                end = start + len(suffix) - 1
        return []


@dataclass
class Acceptance:
    """One request's speculation so far: decayed counts of accepted and rejected proposed tokens, and the steps
    since it last proposed."""

    accepted: float = PRIOR[0]
    rejected: float = PRIOR[1]
    idle: int = 0
    patience: int = PROBE_EVERY  # idle steps before the next probe

    @property
    def rate(self) -> float:
        """The chance that a proposed token is accepted, given the one before it was."""
        return self.accepted / (self.accepted + self.rejected)

    def update(self, proposed: int, accepted: int, back_off: bool = True) -> None:
        """A proposal of `proposed` tokens kept `accepted`; back_off: a failure doubles the wait for the next probe
        (where proposing costs something)."""
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (accepted < proposed)
        self.idle = 0
        if accepted or back_off:
            self.patience = PROBE_EVERY if accepted else min(2 * self.patience, MAX_PROBE_EVERY)

    def worth(self, threshold: float, most: int) -> int:
        """How many tokens to propose: the i-th while rate^i >= threshold (a probe of one after `patience`
        steps of none)."""
        k, p = 0, self.rate
        while k < most and p >= threshold:
            k, p = k + 1, p * self.rate
        if k == 0:
            self.idle += 1
            if self.idle >= self.patience:
                self.idle, k = 0, min(1, most)
        return k


@dataclass
class SpecStats:
    """Counters, as vLLM's spec_decode metrics, and per adapter (None: the base model)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    by_adapter: dict[str | None, list[int]] = field(default_factory=dict)  # name -> [draft tokens, accepted]

    def add(self, adapter: str | None, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        counts = self.by_adapter.setdefault(adapter, [0, 0])
        counts[0] += proposed
        counts[1] += accepted


class Speculator:
    def __init__(self, config: SpeculativeConfig, device_type: str = "cpu", proposer=None):
        """proposer: a draft model's (engine/draft_model.py; method "draft_model"); None: n-gram lookup."""
        self.k = config.num_speculative_tokens
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.max_batch = config.disable_by_batch_size or MAX_DISABLE_BY_BATCH.get(device_type, 32)
        self.cost = StepCost(None)  # steps that decode: fixed + per_row x tokens + per_chunk x [it verifies]
        self._proposing = 0.0  # seconds the proposer took for the step about to run (a draft model's passes)
        self.stats = SpecStats()

    def plan(self, seqs: list, limits: list[int]) -> list[int]:
        """How many tokens each decoding sequence may propose in the next step (limits: the most each may:
        max_tokens, max_model_len, the step's budget): 0 past disable_by_batch_size, for a structured or pooling
        request, or where it does not pay."""
        if not seqs or len(seqs) > self.max_batch:
            return [0] * len(seqs)
        threshold = self._economics(len(seqs))[0]
        out = []
        for seq, limit in zip(seqs, limits):
            if seq.grammar is not None or seq.params.pooling is not None or limit <= 0:
                out.append(0)
                continue
            seq.acceptance = seq.acceptance or Acceptance()
            out.append(seq.acceptance.worth(threshold, min(self.k, limit)))
        return out

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        """Each sequence's proposal of at most ks[i] tokens (empty where nothing repeats, or, for proposals that
        cost nothing to make, where the step's expected gain is below a verification pass's fixed cost)."""
        started = time.perf_counter()
        drafts = self.proposer.propose_all(seqs, ks) if any(ks) else [[] for _ in seqs]
        self._proposing = time.perf_counter() - started
        if self.proposer.free and any(drafts):
            _, gain_per_token, fixed = self._economics(len(seqs))
            gain = sum(s.acceptance.rate ** (i + 1) for s, d in zip(seqs, drafts) for i in range(len(d)))
            if gain * gain_per_token < fixed:
                return [[] for _ in seqs]
        return drafts

    def drafts(self, seqs: list, limits: list[int]) -> list[list[int]]:
        """plan, then propose: each decoding sequence's proposal for the next step."""
        return self.propose(seqs, self.plan(seqs, limits))

    def _economics(self, rows: int) -> tuple[float, float, float]:
        """(the threshold on a^i, an accepted token's worth in seconds, a verification pass's fixed cost) for a
        step of `rows` decoding rows; the defaults until the step times are known."""
        fixed, per_row, per_chunk = self.cost.costs()
        step = fixed + per_row * rows
        if not self.cost.seen(KNOWN_AFTER) or not per_row or not step:
            return DEFAULT_THRESHOLD, 1.0, 0.0
        worth = step / rows
        return per_row / worth, worth, per_chunk

    def observe(self, rows: int, draft_tokens: int, seconds: float) -> None:
        """A step that only decoded ran: `rows` rows with `draft_tokens` proposed tokens among them, in
        `seconds` (to which the time its proposals took to make is added: a draft model's passes are what
        speculating costs too)."""
        self.cost.observe(rows, draft_tokens, seconds + self._proposing)
        self._proposing = 0.0

    def verified(self, seq, proposed: int, accepted: int) -> None:
        """`seq`'s proposal of `proposed` tokens was verified: the first `accepted` were kept."""
        if seq.acceptance is not None:
            seq.acceptance.update(proposed, accepted, back_off=not self.proposer.free)
        self.stats.add(seq.adapter, proposed, accepted)
