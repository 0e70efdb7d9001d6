"""Tenants: who may use and change which adapter, and how much of the server they may use. No torch.

`loramux serve --tenants FILE` reads a TOML file (docs/server.md, "Tenants"):

    [tenants.acme]
    keys = ["sha256:<hex>"]               # SHA-256 of each API key (`loramux tenant-key acme` makes one)
    models = ["acme/*"]                   # glob patterns of the names it may use (the base model only if listed)
    admin = true                          # may load, reload, unload and pin names matching `models` ...
    adapter_dir = "/srv/adapters/acme"    # ... from files under this directory only
    max_parallel_requests = 16            # LiteLLM's names and meanings
    rpm_limit = 600
    tpm_limit = 200000                    # prompt + generated tokens a minute
    priority = 0                          # its requests' default (vLLM's field: lower runs first)
    weight = 1.0                          # its fair share of admissions against the other tenants

A request is authenticated once, at the boundary (app.Auth), and carries its tenant to the end: None is the
operator (`--api-key`, or anyone where neither a key nor tenants are set), allowed everything. A name outside
a tenant's patterns is answered exactly as a name that does not exist.
"""
from __future__ import annotations

import collections
import fnmatch
import hashlib
import hmac
import math
import os
import secrets
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field

from loramux.server.http.errors import HTTPError

KEY_PREFIX = "sha256:"
WINDOW_S = 60.0  # rpm_limit and tpm_limit count the last minute
_FIELDS = {"keys", "models", "admin", "adapter_dir", "max_parallel_requests", "rpm_limit", "tpm_limit", "priority",
           "weight"}


def key_hash(key: str) -> str:
    """What a tenants file holds for an API key: its SHA-256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key(name: str) -> tuple[str, str]:
    """`loramux tenant-key NAME`: a new random API key, and the line that gives it to the tenant."""
    key = f"lmx-{secrets.token_urlsafe(32)}"
    table = name if name.replace("-", "").replace("_", "").isalnum() and name.isascii() else f'"{name}"'
    return key, f'[tenants.{table}]\nkeys = ["{KEY_PREFIX}{key_hash(key)}"]'


@dataclass(frozen=True)
class Tenant:
    name: str
    keys: tuple[str, ...]  # SHA-256 hex of its API keys
    models: tuple[str, ...] = ()
    admin: bool = False
    adapter_dir: str | None = None
    max_parallel_requests: int | None = None
    rpm_limit: int | None = None
    tpm_limit: int | None = None
    priority: int = 0
    weight: float = 1.0

    def may_use(self, model: str) -> bool:
        """Whether `model` (an adapter name, or the base model's) matches one of its patterns (fnmatch, case
        sensitive: `*` matches `/` too)."""
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


@dataclass(frozen=True)
class Tenants:
    """A tenants file, read. Empty (no file): every request is the operator's, as without tenants."""

    tenants: tuple[Tenant, ...] = ()
    path: str | None = None

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def find(self, key: str) -> Tenant | None:
        """The tenant an API key belongs to, None if none: the key's hash is compared with every tenant's every
        hash in constant time, and all of them are compared (no early exit), so the time says nothing."""
        sent, found = key_hash(key).encode(), None
        for tenant in self.tenants:
            for known in tenant.keys:
                if hmac.compare_digest(sent, known.encode()) and found is None:
                    found = tenant
        return found


def load_tenants(path: str) -> Tenants:
    """Read and check a tenants file; ValueError naming the file, the tenant and the field at fault."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"--tenants {path}: cannot be read ({e.strerror or e})") from e
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--tenants {path}: not valid TOML ({e})") from e
    unknown = set(data) - {"tenants"}
    if unknown:
        raise ValueError(f"--tenants {path}: unknown table(s) {', '.join(sorted(unknown))}; expected [tenants.<name>]")
    tables = data.get("tenants", {})
    if not isinstance(tables, dict):
        raise ValueError(f"--tenants {path}: `tenants` must be a table of [tenants.<name>] tables")
    tenants = tuple(_tenant(path, name, table) for name, table in tables.items())
    seen: dict[str, str] = {}
    for tenant in tenants:
        for key in tenant.keys:
            if key in seen:
                raise ValueError(f"--tenants {path}: tenants {seen[key]!r} and {tenant.name!r} share a key")
            seen[key] = tenant.name
    return Tenants(tenants, os.path.abspath(path))


def _tenant(path: str, name: str, table) -> Tenant:
    where = f"--tenants {path}: [tenants.{name}]"
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table")
    unknown = set(table) - _FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(_FIELDS))}")
    keys = _strings(where, table, "keys")
    bad = [k for k in keys if not (k.startswith(KEY_PREFIX) and _is_sha256(k[len(KEY_PREFIX):]))]
    if bad or not keys:
        raise ValueError(f"{where}: keys must be a non-empty list of \"{KEY_PREFIX}<64 hex digits>\" (the SHA-256 of "
                         f"each API key, never the key itself: `loramux tenant-key {name}` makes one)")
    adapter_dir = table.get("adapter_dir")
    if adapter_dir is not None and not (isinstance(adapter_dir, str) and os.path.isdir(adapter_dir)):
        raise ValueError(f"{where}: adapter_dir {adapter_dir!r} is not a directory")
    limits = {k: _limit(where, table, k) for k in ("max_parallel_requests", "rpm_limit", "tpm_limit")}
    priority, weight, admin = table.get("priority", 0), table.get("weight", 1.0), table.get("admin", False)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"{where}: priority must be an integer, got {priority!r}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
        raise ValueError(f"{where}: weight must be a number > 0, got {weight!r}")
    if not isinstance(admin, bool):
        raise ValueError(f"{where}: admin must be true or false, got {admin!r}")
    return Tenant(name, tuple(k[len(KEY_PREFIX):].lower() for k in keys), tuple(_strings(where, table, "models")),
                  admin, os.path.realpath(adapter_dir) if adapter_dir else None, priority=priority,
                  weight=float(weight), **limits)


def _strings(where: str, table: dict, name: str) -> list[str]:
    value = table.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: {name} must be a list of strings, got {value!r}")
    return value


def _limit(where: str, table: dict, name: str) -> int | None:
    value = table.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    return value


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)


@dataclass
class _Usage:
    in_flight: int = 0
    requests: collections.deque = field(default_factory=collections.deque)  # times of the last minute's requests
    tokens: collections.deque = field(default_factory=collections.deque)  # (time, tokens) of the last minute


class Quotas:
    """Per tenant: HTTP requests in flight (max_parallel_requests), requests a minute (rpm_limit) and prompt +
    generated tokens a minute (tpm_limit, counted as a request finishes), as LiteLLM's virtual keys count them.
    Over one: HTTPError 429 naming the limit, Retry-After when room opens (from the window)."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._usage: dict[str, _Usage] = collections.defaultdict(_Usage)

    def admit(self, tenant: Tenant) -> None:
        now, usage = self.clock(), self._usage[tenant.name]
        _expire(usage, now)
        if tenant.max_parallel_requests is not None and usage.in_flight >= tenant.max_parallel_requests:
            raise _over(tenant, "max_parallel_requests", f"{usage.in_flight} requests in flight", 1)
        if tenant.rpm_limit is not None and len(usage.requests) >= tenant.rpm_limit:
            wait = usage.requests[len(usage.requests) - tenant.rpm_limit] + WINDOW_S - now
            raise _over(tenant, "rpm_limit", f"{len(usage.requests)} requests in the last minute", wait)
        if tenant.tpm_limit is not None:
            used = sum(n for _, n in usage.tokens)
            if used >= tenant.tpm_limit:
                wait = _tokens_wait(usage, used - tenant.tpm_limit, now)
                raise _over(tenant, "tpm_limit", f"{used} tokens in the last minute", wait)
        usage.in_flight += 1
        usage.requests.append(now)

    def finished(self, tenant: Tenant, tokens: int) -> None:
        """One of its requests ended, having used `tokens` (prompt + generated, every choice)."""
        self._usage[tenant.name].in_flight -= 1
        self.spent(tenant.name, tokens)

    def spent(self, name: str, tokens: float) -> None:
        """Tenant `name` used `tokens` now (counted apart from its requests where another process counts them:
        the Ray ingress learns them from its replicas' reports)."""
        if tokens:
            self._usage[name].tokens.append((self.clock(), tokens))


def _expire(usage: _Usage, now: float) -> None:
    while usage.requests and usage.requests[0] <= now - WINDOW_S:
        usage.requests.popleft()
    while usage.tokens and usage.tokens[0][0] <= now - WINDOW_S:
        usage.tokens.popleft()


def _tokens_wait(usage: _Usage, excess: int, now: float) -> float:
    """Seconds until the tokens of the last minute fall below the limit: until more than `excess` have left."""
    for at, tokens in usage.tokens:
        excess -= tokens
        if excess < 0:
            return at + WINDOW_S - now
    return WINDOW_S


def _over(tenant: Tenant, limit: str, used: str, wait_s: float) -> HTTPError:
    value = getattr(tenant, limit)
    retry = max(1, math.ceil(wait_s))
    return HTTPError(429, f"tenant {tenant.name!r} is over its {limit} of {value}: {used}; retry in {retry} s",
                     "rate_limit_exceeded", limit, {"Retry-After": str(retry)})


# ---- the rules, as the routes apply them (tenant None: the operator, allowed everything) ----------------------
def allows(tenant: Tenant | None) -> Callable[[str], bool]:
    """Whether a name is the tenant's to use (and to see in /v1/models); the operator's: every name."""
    return (lambda name: True) if tenant is None else tenant.may_use


def check_use(tenant: Tenant | None, model: str) -> None:
    """A name outside the tenant's patterns gets the 404 of a name that does not exist (no existence oracle)."""
    if not allows(tenant)(model):
        from loramux.server.http.errors import model_not_found

        raise model_not_found(model)


def check_admin(tenant: Tenant | None, name: str | None = None) -> None:
    """Admin routes: 403 for a tenant without `admin`, or for a name outside its patterns (None: an
    operator-only route, which no tenant may call)."""
    if tenant is None:
        return
    if name is None:
        raise HTTPError(403, "this route is the operator's (the --api-key): tenants cannot call it", "permission_error")
    if not tenant.admin:
        raise HTTPError(403, f"tenant {tenant.name!r} may not load, unload or pin adapters (its admin is off)",
                        "permission_error")
    if not tenant.may_use(name):
        raise HTTPError(403, f"tenant {tenant.name!r} may not change {name!r}: the name is outside its models "
                             f"patterns", "permission_error")


def load_dirs(tenant: Tenant | None, operator_dirs: tuple[str, ...]) -> tuple[str, ...]:
    """The directories a runtime load's files must lie under: the tenant's adapter_dir (403 if it has none),
    else the operator's --allowed-adapter-dir."""
    if tenant is None:
        return operator_dirs
    if tenant.adapter_dir is None:
        raise HTTPError(403, f"tenant {tenant.name!r} has no adapter_dir to load adapters from", "permission_error")
    return (tenant.adapter_dir,)
