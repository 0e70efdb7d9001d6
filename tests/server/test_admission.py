"""Admission (no torch): each of the three limits refuses by name, a refusal counts nothing in, and a release
gives back exactly what its ticket took."""
import pytest

from loramux.server.http.admission import Admission, TooBusy


def test_each_limit_refuses_naming_itself_and_counts_nothing_in():
    admission = Admission(max_requests=4, max_tokens=100, max_per_client=2)
    first = admission.admit("a", 2, 60)
    with pytest.raises(TooBusy, match=r"this client has 2 requests in flight \(limit 2\)"):
        admission.admit("a", 1, 1)
    with pytest.raises(TooBusy, match=r"60 tokens are in flight \(limit 100\)"):
        admission.admit("b", 1, 41)
    with pytest.raises(TooBusy, match=r"2 requests are in flight \(limit 4\)"):
        admission.admit("b", 3, 1)
    assert (admission.requests, admission.tokens, dict(admission.per_client)) == (2, 60, {"a": 2})
    second = admission.admit("b", 2, 40)  # exactly at every limit: admitted
    assert (admission.requests, admission.tokens) == (4, 100)
    admission.release(first)
    assert (admission.requests, admission.tokens, dict(admission.per_client)) == (2, 40, {"b": 2})
    admission.admit("a", 2, 60)
    admission.release(second)
    assert dict(admission.per_client) == {"a": 2}


def test_no_per_client_limit_when_zero():
    admission = Admission(max_requests=10, max_tokens=1000, max_per_client=0)
    for _ in range(10):
        admission.admit("same", 1, 10)
    with pytest.raises(TooBusy, match="requests are in flight"):
        admission.admit("same", 1, 10)


def test_retry_after_follows_the_output_rate_within_bounds():
    admission = Admission(max_requests=10, max_tokens=10_000)
    admission.admit("a", 1, 4000)
    assert admission.retry_after() == 5  # no output seen yet: a fixed guess
    admission.generated(1000)  # 100 tokens/s over the 10 s window: 4000 tokens ahead -> 40 s, a quarter of it
    assert admission.retry_after() == 10
    admission.generated(10**7)
    assert admission.retry_after() == 1
    with pytest.raises(TooBusy) as refused:
        admission.admit("a", 1, 7000)
    assert refused.value.retry_after == 1
