"""Hostile structured outputs against `loramux serve`: each is a valid 200 or a short 400 (within the check's
time limit), the error body never echoes the input, the server stays healthy, and a bystander's plain requests
are not held up by a grammar check. This server's rule limit is raised past what the grammar engine survives, so that a grammar
that crashes it reaches the worker process that checks it (the default limit refuses it first)."""
import concurrent.futures
import contextlib
import json
import os
import signal
import time

import httpx
import pytest

from support.serving import NO_KEEPALIVE, frontend_pid, make_files, metric, start_server, stop


def chain_lark(rules: int) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: r{i + 1} | "q{i}"' for i in range(rules)) + f'\nr{rules}: "end"'


def chain_gbnf(rules: int) -> str:
    return "root ::= r0\n" + "\n".join(f'r{i} ::= r{i + 1} | "q"' for i in range(rules)) + f'\nr{rules} ::= "e"'


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory)


@pytest.fixture(scope="module")
def served(files):
    proc, url = start_server(files, "--max-grammar-rules", "100000", "--max-body-bytes", str(2 << 20))
    yield proc, url
    stop(proc)


@pytest.fixture(scope="module")
def server(served):
    return served[1]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60, limits=NO_KEEPALIVE) as client:
        yield client


def complete(http, **fields):
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 8, "temperature": 0, **fields}
    return http.post("/v1/completions", json=body)


CASES = [  # (fields, the 400's words)
    ({"guided_grammar": chain_lark(3000)}, "crashed the checker"),
    # GBNF: its conversion alone takes ~10 s here, so the worker dies of the crash or of the check timeout
    ({"guided_grammar": chain_gbnf(5000)}, "could not be checked: its check"),
    ({"guided_grammar": "start: " + " | ".join(f'"a{i}"' for i in range(30000))}, "30000 alternatives"),
    ({"guided_regex": "a" * 900_000}, "at most 524288 (--max-grammar-bytes)"),
    ({"guided_choice": [f"c{i}" for i in range(20_000)]}, "at most 10000 (--max-grammar-choices)"),
    ({"guided_json": {"$ref": "#"}}, "allows no output at all"),
    ({"guided_json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
     "allows no output at all"),
    ({"guided_grammar": 'start: a\na: a "x"'}, "allows no output at all"),
]


@pytest.mark.parametrize("fields, words", CASES, ids=range(len(CASES)))
def test_each_hostile_structured_output_is_a_short_400_and_the_server_stays_up(http, fields, words):
    started = time.monotonic()
    response = complete(http, **fields)
    assert response.status_code == 400 and words in response.json()["error"]["message"], response.text[:500]
    assert len(response.content) < 1024 and time.monotonic() - started < 60  # the check's limit is 10 s
    assert http.get("/health").status_code == 200 and complete(http).status_code == 200


def test_a_catalogue_of_2500_choices_is_served_streamed_and_not(http):
    choices = [f"item {i}" for i in range(2500)]
    plain = complete(http, guided_choice=choices)
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] in choices
    streamed = http.post("/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 8, "temperature": 0,
                                                  "guided_choice": choices, "stream": True})
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert streamed.status_code == 200 and events[-1] == "[DONE]" and not any('"error"' in e for e in events)
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == plain.json()["choices"][0]["text"]


def test_bad_words_that_forbid_all_a_grammar_allows_leave_the_grammar_its_way(http):
    response = complete(http, guided_choice=["yes"], bad_words=["yes"])
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "yes"


def test_grammar_checks_never_hold_up_a_bystander(http, served):
    """Checks run in worker processes, never on the thread every request goes through: with every worker frozen
    mid-check (SIGSTOP), plain requests are served while the structured one waits for its check (whose time
    limit, 10 s, is far above what five plain requests take even on a loaded machine)."""
    proc, _ = served
    workers = _grammar_workers(frontend_pid(proc.pid))
    assert workers
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        try:
            fresh = ["yes", "no", f"never checked before {time.time_ns()}"]  # verdicts are cached by spec
            structured = pool.submit(complete, http, guided_choice=fresh)
            plain = [complete(http, max_tokens=4).status_code for _ in range(5)]
            assert plain == [200] * 5 and not structured.done()
        finally:
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        assert structured.result(timeout=120).status_code == 200
    assert metric(served[1], "loramux:pending_requests") == 0


def _grammar_workers(parent: int) -> list[int]:
    with open(f"/proc/{parent}/task/{parent}/children") as f:
        pids = [int(pid) for pid in f.read().split()]
    named = []
    for pid in pids:
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/comm") as comm:
            if comm.read().strip() == "loramux-grammar":
                named.append(pid)
    return named
