"""Serve's request router for the replicas: model multiplexing that counts what it has just sent.

Serve's own router learns which adapters each replica holds from the replicas' reports, which reach it a few tenths
of a second after a load. Until then a replica that has just taken a new adapter still looks empty, so new adapters
asked for one right after another all went to the same replica. This router (Serve's request-router plug-in, in
the ingress's process: the one place every request passes) also counts each adapter it sent to a replica as held
there until a report lists it or SENT_HORIZON_S passes. The order is Serve's: the replicas holding the adapter,
then the others from the fewest adapters held up, each rank by the power of two choices (the shorter queue of two
at random); a replica at its request limit refuses and the next rank is tried.
"""
from __future__ import annotations

import itertools
import random
import time
from collections.abc import Hashable, Iterable

from ray.serve.request_router import MultiplexMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

SENT_HORIZON_S = 10.0  # far past a report's lag (0.1 s each replica, then the controller's round)


class SentAdapters:
    """(adapter, replica) -> when this router last sent the adapter there. Pure: no Ray."""

    def __init__(self, horizon_s: float = SENT_HORIZON_S, clock=time.monotonic):
        self.horizon_s, self.clock = horizon_s, clock
        self._sent: dict[tuple[str, Hashable], float] = {}

    def add(self, adapter: str, replica: Hashable) -> None:
        self._sent[adapter, replica] = self.clock()

    def held(self, reported: dict[Hashable, set[str]]) -> dict[Hashable, set[str]]:
        """replica -> adapters it holds: its report, plus what was sent there since. A send the report lists, or
        older than the horizon, is forgotten (the report is the truth from then on: a replica may have evicted it)."""
        held = {replica: set(adapters) for replica, adapters in reported.items()}
        now = self.clock()
        for (adapter, replica), sent in list(self._sent.items()):
            if now - sent > self.horizon_s or adapter in held.get(replica, {adapter}):
                del self._sent[adapter, replica]
            else:
                held[replica].add(adapter)
        return held


def ranked(held: dict[Hashable, set[str]], adapter: str) -> list[list[Hashable]]:
    """Replicas in the order to try for `adapter`: its holders, then the rest grouped by how many they hold."""
    holders = [replica for replica, adapters in held.items() if adapter in adapters]
    rest = sorted((replica for replica in held if replica not in holders), key=lambda r: len(held[r]))
    groups = [list(group) for _, group in itertools.groupby(rest, key=lambda r: len(held[r]))]
    return [rank for rank in [holders, *groups] if rank]


def two_of(replicas: Iterable) -> list:
    """The power of two choices' candidates: two at random (Serve then takes the shorter queue)."""
    replicas = list(replicas)
    return random.sample(replicas, min(2, len(replicas)))


class AdapterRouter(MultiplexMixin, RequestRouter):
    """Set on the replicas' deployment (`request_router_config`); Serve builds one per handle's router."""

    def initialize_state(self, **kwargs) -> None:
        self.sent = SentAdapters(**kwargs)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [two_of(candidate_replicas)]
        pending_request.routing_context.should_backoff = True  # every rank refused: back off before the next round
        adapter = pending_request.metadata.multiplexed_model_id
        if not adapter:  # the base model: any replica
            return [two_of(candidate_replicas)]
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        held = self.sent.held({rid: set(replica.multiplexed_model_ids) for rid, replica in by_id.items()})
        return [[by_id[rid] for rid in two_of(rank)] for rank in ranked(held, adapter)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        adapter = pending_request.metadata.multiplexed_model_id
        if adapter:
            self.sent.add(adapter, replica_id)
