"""Admission: bounded work in flight. No torch.

Every engine request the front end has sent and not seen finish counts against three limits: requests,
tokens (prompt + max_tokens, the most it can cost; a prompt scored for its logprobs counts twice: see
frontend.work_tokens) and, optionally, requests per client. A request with n choices is n engine requests. An HTTP request
that would pass one is refused whole with 429 and a Retry-After estimate (the tokens ahead of it over the
recent output rate), so that one client's burst cannot queue hours of work in front of everyone.
"""
from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass


class TooBusy(Exception):
    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class Ticket:
    client: str
    num_requests: int
    num_tokens: int
    tenant: object = None  # server.tenants.Tenant, whose quotas the requests count against (None: no tenant)


class Admission:
    RATE_WINDOW_S = 10.0

    def __init__(self, max_requests: int, max_tokens: int, max_per_client: int = 0):
        """max_per_client: 0 = no per-client limit."""
        self.max_requests, self.max_tokens, self.max_per_client = max_requests, max_tokens, max_per_client
        self.requests = 0
        self.tokens = 0
        self.per_client: collections.Counter[str] = collections.Counter()
        self._generated: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens)

    def admit(self, client: str, num_requests: int, num_tokens: int, tenant=None) -> Ticket:
        """Count the work in, or raise TooBusy naming the limit it would pass."""
        problem = self._over_limit(client, num_requests, num_tokens)
        if problem:
            raise TooBusy(f"the server is busy: {problem}; retry later", self.retry_after())
        self.requests += num_requests
        self.tokens += num_tokens
        self.per_client[client] += num_requests
        return Ticket(client, num_requests, num_tokens, tenant)

    def _over_limit(self, client: str, num_requests: int, num_tokens: int) -> str | None:
        if self.requests + num_requests > self.max_requests:
            return f"{self.requests} requests are in flight (limit {self.max_requests})"
        if self.tokens + num_tokens > self.max_tokens:
            return f"{self.tokens} tokens are in flight (limit {self.max_tokens})"
        if self.max_per_client and self.per_client[client] + num_requests > self.max_per_client:
            return f"this client has {self.per_client[client]} requests in flight (limit {self.max_per_client})"
        return None

    def release(self, ticket: Ticket) -> None:
        self.requests -= ticket.num_requests
        self.tokens -= ticket.num_tokens
        self.per_client[ticket.client] -= ticket.num_requests
        if self.per_client[ticket.client] <= 0:
            del self.per_client[ticket.client]

    def generated(self, num_tokens: int) -> None:
        """Output tokens seen: the rate that Retry-After estimates are made from."""
        self._generated.append((time.monotonic(), num_tokens))

    def retry_after(self) -> int:
        """Seconds until the work in flight is likely done, from the recent output rate (1 to 60)."""
        now = time.monotonic()
        while self._generated and self._generated[0][0] < now - self.RATE_WINDOW_S:
            self._generated.popleft()
        rate = sum(n for _, n in self._generated) / self.RATE_WINDOW_S
        if rate <= 0:
            return 5
        return max(1, min(60, math.ceil(self.tokens / rate / 4)))  # a quarter of the backlog: room opens earlier
