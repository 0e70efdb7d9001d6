"""AdapterCache semantics as tables: steps in, the tiers' contents out. No torch here. (The cache keys on
adapter identities; any hashable stands in for one here.)"""
import pytest

from loramux.adapters.cache import AdapterCache, AdapterInUseError, CacheBusyError, CacheFullError, SlotUpdate


def run(cache: AdapterCache, steps: str):
    """Steps like "add a, activate b, pin c"; returns the last step's result."""
    result = None
    for step in filter(None, (s.strip() for s in steps.split(","))):
        verb, name = step.split()
        result = getattr(cache, verb)(name)
    return result


def host(cache):
    return cache.host


@pytest.mark.parametrize(
    "max_loras, max_cpu, steps, active, in_host",
    [
        # slot tier: LRU eviction of the least recently used unpinned slot
        (2, 4, "add a, add b, add c, activate a, activate b, activate c", {"b", "c"}, "abc"),
        (2, 4, "add a, add b, add c, activate a, activate b, activate a, activate c", {"a", "c"}, "abc"),
        (2, 4, "add a, add b, add c, pin a, activate b, activate c", {"a", "c"}, "abc"),
        (2, 4, "add a, add b, add c, acquire a, activate a, activate b, activate c", {"a", "c"}, "abc"),
        (2, 4, "add a, add b, activate a, deactivate a", set(), "ab"),
        # host tier: LRU; adding a known adapter touches it
        (1, 2, "add a, add b, add c", set(), "bc"),
        (1, 2, "add a, add b, add a, add c", set(), "ac"),
        (1, 2, "add a, add b, pin a, add c", {"a"}, "ac"),
        (1, 2, "add a, add b, acquire a, add c", set(), "ac"),
        # host eviction is plain LRU (activation touches); leaving host memory takes the slot: slot ⊆ host
        (1, 2, "add a, add b, activate a, add c", {"a"}, "ac"),
        (2, 2, "add a, add b, activate a, activate b, add c", {"b"}, "bc"),
        (2, 2, "add a, add b, activate b, add a, add c", set(), "ac"),
        # a held identity (a started request's) stays in host memory; its slot may go
        (1, 2, "add a, add b, hold a, add c", set(), "ac"),
        (1, 2, "add a, activate a, hold a, add b, activate b", {"b"}, "ab"),
        # the disk tier: a dropped adapter stays known and can come back
        (1, 2, "add a, add b, add c, add a", set(), "ca"),
        (2, 4, "add a, add b, remove a", set(), "b"),
    ],
)
def test_tiers(max_loras, max_cpu, steps, active, in_host):
    cache = AdapterCache(max_loras, max_cpu)
    run(cache, steps)
    assert set(cache.active) == active
    assert sorted(host(cache)) == sorted(in_host)
    assert set(cache.active) <= set(host(cache))


@pytest.mark.parametrize(
    "max_loras, max_cpu, steps, error, words",
    [
        (2, 4, "add a, add b, add c, pin a, pin b, activate c", CacheFullError, ["'c'", "max_loras=2", "pinned"]),
        (1, 4, "add a, add b, acquire a, activate a, activate b", CacheBusyError, ["'b'", "in-use"]),
        (2, 4, "pin ghost", KeyError, ["ghost", "not loaded"]),
        (2, 4, "activate ghost", KeyError, ["ghost"]),
        (1, 1, "add a, pin a, add b", CacheFullError, ["'b'", "max_cpu_loras=1", "(a) are pinned"]),
        (2, 4, "add a, acquire a, remove a", AdapterInUseError, ["'a'", "1 request"]),
        (2, 4, "add a, hold a, remove a", AdapterInUseError, ["'a'", "1 request"]),
        (1, 1, "add a, hold a, add b", CacheBusyError, ["'b'", "waits for room", "requests are using a"]),
        (2, 2, "add a, pin a, add b, acquire b, add c", CacheBusyError, ["'c'", "requests are using b"]),
        (2, 4, "add a, unhold a", RuntimeError, ["'a'", "unheld"]),
        (2, 4, "add a, acquire a, deactivate a", AdapterInUseError, ["'a'"]),
        (1, 2, "add a, add b, add c, activate a", KeyError, ["'a'", "not in host memory"]),
        (1, 4, "add a, add b, pin a, pin b", CacheFullError, ["'b'", "pinned"]),
        (2, 4, "add a, release a", RuntimeError, ["'a'", "released"]),
    ],
)
def test_refusals_name_their_cause(max_loras, max_cpu, steps, error, words):
    cache = AdapterCache(max_loras, max_cpu)
    with pytest.raises(error) as err:
        run(cache, steps)
    assert type(err.value) is error  # waiting helps for CacheBusyError only
    for word in words:
        assert word in str(err.value)


def test_activation_returns_slot_updates():
    cache = AdapterCache(1, 2)
    run(cache, "add a, add b")
    slot, changes = cache.activate("a")
    assert (slot, changes.slots) == (0, [SlotUpdate(0, "a")])
    assert cache.activate("a")[1].slots == []  # already resident: a touch, no copy
    slot, changes = cache.activate("b")
    assert changes.slots == [SlotUpdate(0, None), SlotUpdate(0, "b")]


def test_dropped_adapters_are_reported_and_memory_only_ones_are_kept():
    cache = AdapterCache(1, 2)
    cache.add("mem", on_disk=False)
    cache.add("a")
    changes = cache.add("b")
    assert changes.dropped == ["a"] and "a" in cache and not cache.in_host("a")
    cache.pin("b")
    with pytest.raises(CacheFullError, match="no disk copy"):
        cache.add("c")


def test_unload_of_a_slotted_adapter_clears_its_slot():
    cache = AdapterCache(2, 2)
    run(cache, "add a, activate a")
    changes = cache.remove("a")
    assert changes.slots == [SlotUpdate(0, None)] and "a" not in cache and cache.active == {}


def test_the_host_tier_in_bytes_evicts_least_recently_used_until_the_new_one_fits():
    cache = AdapterCache(max_loras=2, max_cpu_loras=10, max_cpu_bytes=100)
    assert cache.add("small", nbytes=10).dropped == []
    assert cache.add("mid", nbytes=40).dropped == []
    cache.add("small")  # touched: "mid" is now the least recently used
    assert cache.add("big", nbytes=60).dropped == ["mid"] and cache.host_bytes == 70
    cache.pin("small")
    cache.acquire("big")
    with pytest.raises(CacheFullError, match="max_cpu_lora_bytes=100"):  # nothing left to evict
        cache.add("other", nbytes=40)
    cache.release("big")
    assert cache.add("other", nbytes=40).dropped == ["big"] and cache.host_bytes == 50
    with pytest.raises(CacheFullError, match="takes 101 bytes, more than max_cpu_lora_bytes=100"):
        cache.add("huge", nbytes=101)
    assert cache.remove("other").dropped == ["other"] and cache.host_bytes == 10
    assert cache.add("mid").dropped == [] and cache.host_bytes == 50  # a reload from disk: its size is known


def test_without_a_byte_budget_sizes_are_only_counted():
    cache = AdapterCache(max_loras=1, max_cpu_loras=2)
    cache.add("a", nbytes=10**12)
    cache.add("b", nbytes=10**12)
    assert cache.add("c", nbytes=1).dropped == ["a"]


def test_an_add_that_cannot_fit_evicts_nothing():
    cache = AdapterCache(max_loras=2, max_cpu_loras=8, max_cpu_bytes=10)
    cache.add("a", nbytes=4)
    cache.activate("a")
    cache.add("b", nbytes=5)
    cache.pin("b")
    with pytest.raises(CacheFullError, match=r"'c'.*9 bytes held, 7 more needed.*\(b\).*pinned"):
        cache.add("c", nbytes=7)  # dropping a (4) would not make room: a stays, with its slot
    assert host(cache) == ["a", "b"] and cache.active == {"a": 0, "b": 1} and cache.host_bytes == 9


def test_identities_of_one_name_are_separate_entries():
    """Two loads under one name are two keys: one's slot or host copy is never the other's."""
    from loramux.adapters.names import AdapterRef

    first, second = AdapterRef("x"), AdapterRef("x")
    assert first != second and str(first) == str(second) == "x"
    cache = AdapterCache(max_loras=2, max_cpu_loras=4)
    cache.add(first)
    cache.add(second)
    assert cache.activate(first)[0] != cache.activate(second)[0]
    cache.hold(first)
    cache.remove(second)
    assert first in cache and second not in cache and cache.active == {first: 0}


def test_room_is_made_from_what_the_next_waiting_requests_do_not_want_first():
    cache = AdapterCache(1, 2)
    run(cache, "add a, add b")
    cache.want(frozenset({"a"}))
    run(cache, "add c")  # a is the least recently used, but wanted: b goes
    assert host(cache) == ["a", "c"]
    cache.want(frozenset({"a", "c"}))
    run(cache, "add d")  # every candidate is wanted: plain LRU
    assert host(cache) == ["c", "d"]


def test_a_slot_goes_to_what_is_not_wanted_first():
    cache = AdapterCache(2, 4)
    run(cache, "add a, add b, add c, activate a, activate b")
    cache.want(frozenset({"a"}))
    run(cache, "activate c")
    assert set(cache.active) == {"a", "c"}


def test_a_read_ahead_finds_room_only_outside_what_is_wanted():
    """Reading an adapter back ahead of its request must not take the room of one the next requests want (it
    would be read again, unused); the head of the queue's read may (AdapterLoader asks room_ahead only for
    reads ahead)."""
    cache = AdapterCache(1, 2)
    run(cache, "add a, add b, acquire a")
    cache.register("c", 0)
    cache.want(frozenset({"b", "c"}))
    assert not cache.room_ahead("c")  # only b could make room, and b is wanted
    cache.want(frozenset({"c"}))
    assert cache.room_ahead("c") and cache.room_ahead("a")  # b may go; a is in host memory already
    run(cache, "release a")
    cache.want(frozenset({"b", "c"}))
    assert cache.room_ahead("c")  # a is idle and not wanted
