"""Fair shares of admission: start-time fair queueing (Goyal et al., SFQ) over the clients that send requests.
No torch.

Each waiting request gets a start tag when it arrives: S = max(V, F[share]), and its share's finish tag moves
to F[share] = S + cost / weight (cost: its prompt tokens + max_tokens, the work it may ask for). The scheduler
admits waiting requests in tag order; V is the largest tag admitted so far. A share that has sent nothing for a
while starts at V, so one tenant's queue of a thousand requests puts at most about one admission round in front
of another tenant's next request, whatever their arrival order; over time each busy share gets admissions in
proportion to its weight. Requests of one share keep their arrival order (or, under the priority policy, the
order of their priorities: scheduler.Scheduler._enqueue).

Admission order alone does not help a share whose request finds the batch full of another's (max_num_seqs
running, or no KV blocks left): the scheduler then takes a place back (Scheduler._fair_preempt) from the share
furthest over its weighted part of max_num_seqs, as long as the one waiting is under its own part.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_SHARES = 4096  # finish tags kept; past it those no later than V (which would start at V anyway) are dropped


@dataclass(frozen=True)
class Origin:
    """Who a request comes from, as far as the engine needs to know."""

    tenant: str | None = None
    """Its tenant (server/http/tenants.py): its prefix cache is its own. None: no tenants (or the operator)."""
    share: str | None = None
    """Whose fair share of admissions it takes: its tenant, else its client (a digest). None: the one share of
    every request without an origin (the offline API: first come, first served)."""
    weight: float = 1.0


class FairQueue:
    def __init__(self):
        self.virtual = 0.0
        self._finish: dict[str | None, float] = {}

    def tag(self, origin: Origin, cost: int) -> float:
        """The start tag of a request arriving now from `origin` that may cost `cost` tokens of work."""
        start = max(self.virtual, self._finish.get(origin.share, 0.0))
        self._finish[origin.share] = start + max(1, cost) / origin.weight
        return start

    def admitted(self, tag: float) -> None:
        self.virtual = max(self.virtual, tag)
        if len(self._finish) > MAX_SHARES:
            self._finish = {share: f for share, f in self._finish.items() if f > self.virtual}
