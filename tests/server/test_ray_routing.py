"""The replicas' request router (server/ray/routing.py): what it counts as held, and the order it tries replicas in.
The deployment itself is tested in test_scaleout.py (new adapters asked one after another spread evenly)."""
import pytest

pytest.importorskip("ray.serve")

from loramux.server.ray.routing import SentAdapters, ranked  # noqa: E402


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_send_counts_as_held_until_the_report_lists_it_or_the_horizon_passes():
    clock = Clock()
    sent = SentAdapters(horizon_s=10, clock=clock)
    sent.add("a", "r1")
    assert sent.held({"r1": set(), "r2": set()}) == {"r1": {"a"}, "r2": set()}
    assert sent.held({"r1": {"a"}, "r2": set()}) == {"r1": {"a"}, "r2": set()}  # reported: the report is the truth
    assert sent.held({"r1": set(), "r2": set()}) == {"r1": set(), "r2": set()}  # then evicted there: gone
    sent.add("b", "r2")
    clock.now = 10.5
    assert sent.held({"r1": set(), "r2": set()}) == {"r1": set(), "r2": set()}  # past the horizon
    sent.add("c", "gone")  # a replica that has left
    assert sent.held({"r1": set()}) == {"r1": set()}


def test_holders_first_then_the_fewest_held():
    held = {"r1": {"a", "b"}, "r2": {"c"}, "r3": set(), "r4": set()}
    assert ranked(held, "a") == [["r1"], ["r3", "r4"], ["r2"]]
    assert ranked(held, "new") == [["r3", "r4"], ["r2"], ["r1"]]


def test_new_adapters_one_after_another_alternate():
    sent, reported = SentAdapters(), {"r1": set(), "r2": set()}
    for i in range(6):
        first = ranked(sent.held(reported), f"a{i}")[0]
        sent.add(f"a{i}", first[0])
    held = sent.held(reported)
    assert sorted(len(adapters) for adapters in held.values()) == [3, 3], held
