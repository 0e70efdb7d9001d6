"""ServeReplica (server/ray/replica.py) outside a cluster: its registry and its server are stand-ins, so the order in
which a starting replica reads its tenants file and follows the registry can be driven step by step. The deployment
itself is tested in test_scaleout.py."""
import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from loramux.server.ray import replica as replica_module  # noqa: E402


class Remote:
    """A Serve handle's method: `.remote(...)` is awaitable."""

    def __init__(self, fn):
        self.fn = fn

    async def remote(self, *args):
        return self.fn(*args)


class Registry:
    """The AdapterRegistry's calls a replica makes; reload_tenants() is SIGHUP reaching the registry."""

    def __init__(self):
        self.generation, self.reported = 0, asyncio.Event()
        self.tenants = Remote(lambda: self.generation)
        self.snapshot = Remote(lambda: (0, {}, self.generation))
        self.report = Remote(lambda rid, state: self.reported.set())

    def reload_tenants(self):
        self.generation += 1


class Server:
    """The loramux front end as the replica uses it: it read the tenants file when it was built."""

    def __init__(self):
        self.tenants_reads = 1
        self.registry = {}
        self.client = SimpleNamespace(engine=None)
        self.admission = SimpleNamespace(requests=0)
        self.metrics = SimpleNamespace(tenant_counts=dict)

    async def start(self):
        pass

    def reload_tenants(self):
        self.tenants_reads += 1

    def health(self):
        return "stopped"  # (so the report asks the engine nothing)


class Replica(replica_module.ServeReplica):
    def __del__(self):  # (Serve awaits the async one at shutdown; here there is nothing to shut down)
        pass


def app_builder(after_build):
    """build_app's stand-in: the server is built (the tenants file read), then `after_build` runs."""
    def build_app(engine_config, server_config):
        server = Server()
        after_build()
        return SimpleNamespace(state=SimpleNamespace(server=server))
    return build_app


async def started_replica(registry) -> Replica:
    replica = Replica.__new__(Replica)
    await replica.__init__(None, None, registry)  # (Serve awaits an async constructor so)
    await asyncio.wait_for(registry.reported.wait(), 60)  # the follower's first round (a round that fails retries)
    replica._follower.cancel()
    return replica


def test_a_replica_starts_when_the_registry_does_not_say_the_tenants_generation(monkeypatch):
    """The registry restarting as the replica starts: it starts anyway, and its first round reads the file again
    (a SIGHUP it could not know of may have come)."""
    registry = Registry()

    def failing():
        raise RuntimeError("the registry's actor died")

    registry.tenants = Remote(failing)
    monkeypatch.setattr(replica_module, "build_app", app_builder(lambda: None))
    monkeypatch.setattr(replica_module.serve, "get_replica_context", lambda: SimpleNamespace(replica_tag="r1"))
    replica = asyncio.run(started_replica(registry))
    assert replica.server.tenants_reads == 2


@pytest.mark.parametrize("sighup_after_the_file_is_read", [False, True])
def test_a_sighup_while_a_replica_starts_is_followed(monkeypatch, sighup_after_the_file_is_read):
    """The tenants file is read when the replica's server is built; the follower starts once its engine has. A SIGHUP
    between the two (the registry's generation moves) makes the first round read the file again: the replica would
    otherwise serve the file as it was before the SIGHUP. Without one, the file is not read twice."""
    registry = Registry()
    after_build = registry.reload_tenants if sighup_after_the_file_is_read else (lambda: None)
    monkeypatch.setattr(replica_module, "build_app", app_builder(after_build))
    monkeypatch.setattr(replica_module.serve, "get_replica_context", lambda: SimpleNamespace(replica_tag="r1"))
    replica = asyncio.run(started_replica(registry))
    assert replica.server.tenants_reads == (2 if sighup_after_the_file_is_read else 1)
