"""Adapters loaded on their first request (server/http/on_demand.py), with a stand-in install: many requests for
one cold name make one resolution and one load, unknown names get 404 naming the resolvers, an adapter that
does not load gets its refusal (remembered a short while), and nothing invalid reaches a resolver."""
import asyncio
import json
import os
import sys
import threading
import types

import pytest

from loramux.config import ServerConfig
from loramux.server.http import on_demand
from loramux.server.http.errors import HTTPError


def adapter_dir(path) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 4}, f)
    return str(path)


class Counting:
    """A plugin resolver that counts its calls and may be slow or fail."""

    def __init__(self, answers: dict, delay_s: float = 0.0, fail: bool = False):
        self.answers, self.delay_s, self.fail = answers, delay_s, fail
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def resolve(self, base_model, name):
        with self.lock:
            self.calls.append(name)
        if self.fail:
            raise RuntimeError("the adapter store is down")
        threading.Event().wait(self.delay_s)
        return self.answers.get(name)


@pytest.fixture
def plugin(monkeypatch):
    module = types.ModuleType("test_on_demand_plugins")
    monkeypatch.setitem(sys.modules, "test_on_demand_plugins", module)

    def install(resolver):
        module.resolver = resolver
        return ServerConfig(lora_resolvers=("test_on_demand_plugins:resolver",), lora_resolver_plugins=False)

    return install


class Installs:
    def __init__(self, refuse: set = frozenset()):
        self.done: list[tuple[str, str]] = []
        self.tried: list[str] = []
        self.refuse = refuse

    async def __call__(self, name, found):
        self.tried.append(name)
        await asyncio.sleep(0.05)
        if name in self.refuse:
            raise HTTPError(400, "lora_B has the wrong shape", code="invalid_adapter")
        self.done.append((name, found.path))


def test_concurrent_first_requests_resolve_and_load_once(tmp_path, plugin):
    resolver = Counting({"cold": adapter_dir(tmp_path / "cold")}, delay_s=0.2)
    installs = Installs()

    async def main():
        demand = on_demand.OnDemand(plugin(resolver), installs)
        await asyncio.gather(*(demand.load("cold", "base") for _ in range(16)))

    asyncio.run(main())
    assert resolver.calls == ["cold"] and installs.done == [("cold", os.path.realpath(tmp_path / "cold"))]


def test_unknown_and_invalid_names_are_404_and_invalid_ones_never_reach_a_resolver(tmp_path, plugin):
    resolver = Counting({})

    async def main():
        demand = on_demand.OnDemand(plugin(resolver), Installs())
        with pytest.raises(HTTPError) as unknown:
            await demand.load("ghost", "base")
        for bad in ("../etc", "a" * 300, "sp ace", "", "x=/etc", "/abs"):
            with pytest.raises(HTTPError) as invalid:
                await demand.load(bad, "base")
            assert invalid.value.status_code == 404
        return unknown.value

    unknown = asyncio.run(main())
    assert unknown.status_code == 404 and unknown.code == "model_not_found"
    assert "no adapter resolver has it" in unknown.message and "Counting" in unknown.message
    assert resolver.calls == ["ghost"]


def test_without_resolvers_an_unknown_name_is_a_plain_404():
    async def main():
        with pytest.raises(HTTPError) as e:
            await on_demand.OnDemand(ServerConfig(lora_resolver_plugins=False), Installs()).load("x", "base")
        return e.value

    e = asyncio.run(main())
    assert (e.status_code, e.message) == (404, "The model `x` does not exist.")


def test_a_refused_adapter_is_400_and_remembered_a_short_while(tmp_path, plugin, monkeypatch):
    resolver = Counting({"broken": adapter_dir(tmp_path / "broken"), "fine": adapter_dir(tmp_path / "fine")})
    installs = Installs(refuse={"broken"})

    async def attempt(demand, name):
        try:
            await demand.load(name, "base")
        except HTTPError as e:
            return e
        return None

    async def main():
        demand = on_demand.OnDemand(plugin(resolver), installs)
        first = await attempt(demand, "broken")
        again = await attempt(demand, "broken")  # answered from memory
        fine = await attempt(demand, "fine")  # the others are not affected
        demand.failed.ttl_s = 0.0
        later = await attempt(demand, "broken")  # tried afresh once the memory expires
        return first, again, fine, later

    first, again, fine, later = asyncio.run(main())
    assert first.status_code == 400 and "wrong shape" in first.message and "resolved to" in first.message
    assert again.message == first.message and fine is None and later.status_code == 400
    assert resolver.calls == ["broken", "fine", "broken"] and installs.done == [("fine", installs.done[0][1])]


def test_another_name_for_the_files_of_a_refused_adapter_is_not_read_again(tmp_path, plugin):
    """The refusal is remembered by the directory a name resolved to too (here a resolver with two names for
    one directory); the memory is bounded and drops expired entries."""
    broken = adapter_dir(tmp_path / "broken")
    installs = Installs(refuse={"broken", "alias"})

    async def main():
        demand = on_demand.OnDemand(plugin(Counting({"broken": broken, "alias": broken})), installs)
        errors = []
        for name in ("broken", "alias", "alias"):
            with pytest.raises(HTTPError) as e:
                await demand.load(name, "base")
            errors.append(e.value)
        return demand, errors

    demand, errors = asyncio.run(main())
    assert [e.status_code for e in errors] == [400] * 3 and "'alias'" in errors[1].message
    assert "wrong shape" in errors[1].message and installs.tried == ["broken"]  # one read for both names
    memory = on_demand._Failures(ttl_s=60, limit=3)
    for i in range(10):
        memory.add((f"n{i}",), "no")
    assert len(memory) == 3 and memory.get("n9") == "no" and memory.get("n0") is None
    memory.ttl_s = 0.0
    memory.add(("fresh",), "no")
    assert len(memory) == 0  # every entry had expired, the new one too


def test_a_failing_resolver_is_a_server_error_not_a_crash(tmp_path, plugin):
    async def main():
        demand = on_demand.OnDemand(plugin(Counting({}, fail=True)), Installs())
        with pytest.raises(HTTPError) as e:
            await demand.load("x", "base")
        return e.value

    e = asyncio.run(main())
    assert e.status_code == 502 and "the adapter store is down" in e.message


def test_a_waiter_that_goes_away_does_not_cancel_the_load(tmp_path, plugin):
    resolver = Gated({"cold": adapter_dir(tmp_path / "cold")})
    installs = Installs()

    async def main():
        demand = on_demand.OnDemand(plugin(resolver), installs)
        first = asyncio.ensure_future(demand.load("cold", "base"))
        second = asyncio.ensure_future(demand.load("cold", "base"))
        for _ in range(12000):  # a state, not a time: the resolve under way (10 ms polls, 120 s bound)
            if resolver.calls:
                break
            await asyncio.sleep(0.01)
        assert resolver.calls, "the resolve never started"
        first.cancel()  # its client disconnected while the resolver works
        await asyncio.sleep(0)
        resolver.gate.set()
        await second
        return first.cancelled()

    assert asyncio.run(main()) and len(installs.done) == 1 and installs.done[0][0] == "cold"


class Gated(Counting):
    """A resolver that holds every call until `gate` is set."""

    def __init__(self, answers: dict):
        super().__init__(answers)
        self.gate = threading.Event()

    def resolve(self, base_model, name):
        with self.lock:
            self.calls.append(name)
        self.gate.wait(120)
        return self.answers.get(name)


def test_one_client_has_only_so_many_cold_names_resolving_and_the_rest_wait_their_turn(tmp_path, plugin):
    """The resolver threads are everyone's: past --max-resolves-per-client a client's cold names wait (never
    fail) while another client's cold name goes ahead; joining a name already resolving costs nothing."""
    import dataclasses

    resolver = Gated({n: adapter_dir(tmp_path / n) for n in ("n1", "n2", "n3", "b1")})
    installs = Installs()

    async def main():
        demand = on_demand.OnDemand(dataclasses.replace(plugin(resolver), max_resolves_per_client=2), installs)
        loads = [asyncio.ensure_future(demand.load(n, "base", "client-a")) for n in ("n1", "n2", "n3")]
        loads.append(asyncio.ensure_future(demand.load("n1", "base", "client-a")))  # joins n1's
        loads.append(asyncio.ensure_future(demand.load("b1", "base", "client-b")))
        for _ in range(12000):  # a state, not a time: three resolver calls under way (10 ms polls, 120 s bound)
            if len(resolver.calls) >= 3:
                break
            await asyncio.sleep(0.01)
        under_way = sorted(resolver.calls)  # n3 waits for one of client-a's two to finish
        resolver.gate.set()
        await asyncio.gather(*loads)
        return under_way, demand

    under_way, demand = asyncio.run(main())
    assert under_way == ["b1", "n1", "n2"] and sorted(resolver.calls) == ["b1", "n1", "n2", "n3"]
    assert sorted(name for name, _ in installs.done) == ["b1", "n1", "n2", "n3"] and not demand._gates


def test_an_unknown_name_is_answered_404_again_without_asking_the_resolvers_a_short_while(plugin):
    resolver = Counting({})

    async def main():
        demand = on_demand.OnDemand(plugin(resolver), Installs())
        errors = []
        for expire in (False, False, True):
            if expire:
                demand.missing.ttl_s = 0.0
            with pytest.raises(HTTPError) as e:
                await demand.load("ghost", "base")
            errors.append(e.value)
        return errors

    errors = asyncio.run(main())
    assert [e.status_code for e in errors] == [404] * 3 and errors[1].message == errors[0].message
    assert resolver.calls == ["ghost", "ghost"]  # the second answer came from memory; the third asked again
