"""Faults against a running `loramux serve`: the engine killed, frozen or orphaned, the server told to stop,
clients that go away, and more work than the server admits. Each ends in a clear error for the requests
it touches and a server that serves again."""
import contextlib
import glob
import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from support.serving import (engine_pid, frontend_pid, make_files, metric, openai_client, paused_while_running,
                     server_log, start_server, stop, wait_until)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory)


# For the tests that freeze the engine (SIGSTOP) while they probe the server: the frozen-engine watchdog (30 s by
# default) must not kill it meanwhile, however slow the machine (the test waits for states, not for a time).
FROZEN_FOR_AS_LONG_AS_IT_TAKES = ("--engine-kill-timeout", "600")


def health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def complete(url: str, model: str, prompt: str = "abc", **kwargs) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, **kwargs}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_a_killed_engine_fails_its_requests_and_comes_back_with_every_adapter(files):
    proc, url = start_server(files)
    try:
        load = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "pinned": True,
                                                              "lora_path": f"{files['allowed']}/new"})
        assert load.status_code == 200, load.text
        reload = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "load_inplace": True,
                                                                "lora_path": f"{files['allowed']}/new"})
        assert reload.status_code == 200, reload.text  # in place: it keeps its pin, in the engine and after a restart
        before = {m: complete(url, m) for m in ("tiny", "s0", "late")}
        client, http = openai_client(url), httpx.Client(base_url=url, timeout=60)
        stream, first = paused_while_running(client, http, "s1", prompt="x", max_tokens=60)  # frozen mid-request
        adapters = metric(url, "loramux:num_loaded_adapters")
        unload = []  # an unload the engine never answers (s1's request holds it): the name must stay usable
        asking = threading.Thread(target=lambda: unload.append(
            httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "s1"}, timeout=60)))
        asking.start()
        wait_until(lambda: metric(url, "loramux:num_loaded_adapters") == adapters - 1, 60,
                   "the engine dropped the name: the unload is in it, waiting for s1's request")
        pid = engine_pid(proc.pid)
        os.kill(pid, signal.SIGKILL)
        chunks = []
        with pytest.raises(openai.APIError, match="engine"):
            for chunk in stream:
                chunks.append(chunk)
        assert chunks[-1].choices[0].finish_reason == "error"  # the stream says it ended badly
        killed = time.monotonic()
        wait_until(lambda: health(url) == 200, 60, "the engine restarted")
        print(f"\nkill -9 of the engine: healthy again after {time.monotonic() - killed:.1f} s")
        assert engine_pid(proc.pid) != pid
        assert http.get("/is_paused").json() == {"is_paused": True}  # the operator's pause outlives the engine
        assert http.post("/resume").status_code == 200
        assert {m: complete(url, m) for m in before} == before  # the runtime-loaded adapter is back too
        assert metric(url, "loramux:num_pinned_adapters") == 1.0  # and still pinned
        asking.join(60)
        assert unload[0].status_code == 503, unload[0].text
        assert "s1" in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] and complete(url, "s1")
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "s1"}).status_code == 200
        assert metric(url, "loramux:engine_restarts") == 1.0
        assert "the engine process exited (code -9)" in server_log(proc)
        _a_paused_engine_comes_back_paused(url, proc)
    finally:
        stop(proc)


def _a_paused_engine_comes_back_paused(url, proc):
    """The pause is the operator's: the engine that replaces a killed paused one is paused too, and a request
    sent meanwhile runs after /resume."""
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}).status_code == 200
    pid = engine_pid(proc.pid)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: health(url) == 200 and engine_pid(proc.pid) != pid, 60, "the engine restarted")
    assert httpx.get(f"{url}/is_paused").json() == {"is_paused": True}
    answer = []
    asking = threading.Thread(target=lambda: answer.append(complete(url, "s0")))
    asking.start()
    wait_until(lambda: metric(url, "loramux:pending_requests") == 1, 60, "the request is held")
    assert not answer  # held while paused
    assert httpx.post(f"{url}/resume").status_code == 200
    asking.join(60)
    assert answer and answer[0] == complete(url, "s0")


def test_a_frozen_engine_makes_health_fail_and_is_killed_after_the_kill_timeout(files):
    proc, url = start_server(files, "--engine-unresponsive-timeout", "1", "--engine-kill-timeout", "6")
    try:
        pid = engine_pid(proc.pid)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_until(lambda: health(url) == 503, 60, "/health reports the frozen engine")
        print(f"\nSIGSTOP of the engine: /health 503 after {time.monotonic() - stopped:.1f} s", end="")
        assert "not responded" in httpx.get(f"{url}/health").json()["error"]["message"]
        os.kill(pid, signal.SIGCONT)  # a pause shorter than the kill timeout: the same engine carries on
        wait_until(lambda: health(url) == 200, 60, "/health recovers")
        assert engine_pid(proc.pid) == pid
        os.kill(pid, signal.SIGSTOP)  # frozen for good: killed and replaced, and its request fails
        started = time.monotonic()
        response = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=120)
        assert response.status_code == 503 and "engine" in response.json()["error"]["message"]
        assert 5 < time.monotonic() - started < 120  # not before the kill timeout (6 s); at most a generous bound
        print(f"; frozen for good: its request got 503 after {time.monotonic() - started:.1f} s", end="")
        wait_until(lambda: health(url) == 200, 60, "a new engine serves")
        print(f", a new engine served {time.monotonic() - started:.1f} s after the freeze")
        assert engine_pid(proc.pid) != pid and complete(url, "s2")
    finally:
        stop(proc)


def test_the_engine_goes_away_with_a_killed_server_and_cleans_up(files, tmp_path):
    proc, url = start_server(files, env={"TMPDIR": str(tmp_path)})  # its IPC directory apart from other servers'
    pid = engine_pid(proc.pid)
    ipc_dirs = set(glob.glob(f"{tmp_path}/loramux-ipc-*"))
    assert len(ipc_dirs) == 1
    proc.kill()
    proc.wait(10)
    wait_until(lambda: not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), 10, "the orphaned engine exited")
    wait_until(lambda: not os.path.exists(ipc_dirs.pop() if len(ipc_dirs) == 1 else "/nonexistent"), 10,
               "its IPC directory is gone")


def test_a_killed_front_end_is_replaced_and_serves_the_same_adapters(files):
    """The HTTP front end dies (kill -9): `loramux serve` starts a new one on the same socket, with a new engine
    and every adapter the old one had (a runtime load and its pin too); meanwhile /health says why it is 503."""
    proc, url = start_server(files)
    try:
        load = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "pinned": True,
                                                              "lora_path": f"{files['allowed']}/new"})
        assert load.status_code == 200, load.text
        before = {m: complete(url, m) for m in ("tiny", "s0", "late")}
        old_frontend, old_engine = frontend_pid(proc.pid), engine_pid(proc.pid)
        os.kill(old_frontend, signal.SIGKILL)
        killed = time.monotonic()
        starting = wait_until(lambda: _health_while_starting(url), 60, "a 503 saying the engine is starting",
                              interval=0.02)
        assert "starting" in starting
        wait_until(lambda: health(url) == 200, 120, "the new front end's engine is up")
        print(f"\nkill -9 of the front end: healthy again after {time.monotonic() - killed:.1f} s")
        assert frontend_pid(proc.pid) != old_frontend
        wait_until(lambda: not os.path.exists(f"/proc/{old_engine}") or _is_zombie(old_engine), 10,
                   "the old engine went with its front end")
        assert {m: complete(url, m) for m in before} == before  # the runtime-loaded adapter is back too
        assert metric(url, "loramux:num_pinned_adapters") == 1.0 and metric(url, "loramux:frontend_restarts") == 1.0
        assert "the HTTP front end exited (code -9)" in server_log(proc)
    finally:
        stop(proc)
    assert proc.returncode == 0  # Ctrl-C after a restart: still a clean stop


def _health_while_starting(url: str) -> str | None:
    try:
        response = httpx.get(f"{url}/health", timeout=2)
    except httpx.HTTPError:  # the new front end is not listening yet: the connection waits, or times out
        return None
    return response.json()["error"]["message"] if response.status_code == 503 else None


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_sigterm_refuses_new_work_ends_what_outlives_the_grace_period_and_exits_zero(files):
    proc, url = start_server(files, "--shutdown-timeout", "2")
    client, http = openai_client(url), httpx.Client(base_url=url, timeout=60)
    # paused (mode keep) mid-request: it is running when the signal comes and cannot finish within the grace period
    stream, first = paused_while_running(client, http, "s0", prompt="x", max_tokens=60)
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    chunks = []
    with pytest.raises(openai.APIError, match="shut down"):
        for chunk in stream:
            chunks.append(chunk)
    assert chunks[-1].choices[0].finish_reason == "abort" and 1.5 < time.monotonic() - started < 60
    ended = time.monotonic() - started
    assert proc.wait(20) == 0
    print(f"\nSIGTERM with a 2 s grace: the stuck stream ended (abort) after {ended:.1f} s, "
          f"exit code 0 after {time.monotonic() - started:.1f} s")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)


def test_sigterm_lets_a_running_request_finish_within_the_grace_period(files):
    # the engine is frozen before the request comes, so it is in flight, unfinished, when the signal comes, however
    # fast the engine; it stays frozen until the test has seen the server refuse new work: the grace period may not
    # run out meanwhile either, however slow the machine
    proc, url = start_server(files, "--shutdown-timeout", "300", *FROZEN_FOR_AS_LONG_AS_IT_TAKES)
    client = openai_client(url)
    pid = engine_pid(proc.pid)
    os.kill(pid, signal.SIGSTOP)
    chunks, errors = [], []

    def ask():
        try:
            chunks.extend(client.completions.create(model="s1", prompt="x", max_tokens=30, temperature=0, stream=True,
                                                    extra_body={"ignore_eos": True}))
        except Exception as e:
            errors.append(e)

    asking = threading.Thread(target=ask)
    asking.start()
    try:
        wait_until(lambda: metric(url, "loramux:pending_requests") == 1, 10, "the request in flight")
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: health(url) != 200, 10, "the server stops taking work")
        with pytest.raises(httpx.HTTPError):  # a new request is not served (connection refused, or 503 on a kept one)
            response = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
            response.raise_for_status()
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pytest.fail(f"the frozen engine (pid {pid}) was gone before SIGCONT; its log:\n{server_log(proc)[-6000:]}")
        asking.join(60)
        assert not asking.is_alive() and not errors, errors
        assert chunks[-1].choices[0].finish_reason == "length"
        text = "".join(c.choices[0].text for c in chunks)
        assert text == complete_offline(files, "s1", "x", 30)  # every token, as if no signal had come
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:  # (a failure above: the frozen engine must not outlive the test)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            proc.kill()


def complete_offline(files, adapter: str, prompt: str, max_tokens: int) -> str:
    from loramux import LoRAConfig, SamplingParams
    from loramux.llm import LLM

    llm = LLM(model=files["model"], lora=LoRAConfig(max_loras=1, max_lora_rank=32), dtype="float32",
              kv_cache_memory=2**22)
    assert llm.load_adapter(adapter, files["served"][adapter])
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return llm.generate(prompt, params, adapters=adapter, use_tqdm=False)[0].text


def test_past_the_admission_limits_requests_get_429_with_retry_after(files):
    proc, url = start_server(files, "--max-pending-requests", "2", "--max-pending-per-client", "0",
                             *FROZEN_FOR_AS_LONG_AS_IT_TAKES)
    try:
        pid = engine_pid(proc.pid)
        os.kill(pid, signal.SIGSTOP)  # nothing finishes: two requests fill the queue
        results = []

        def ask():
            results.append(httpx.post(f"{url}/v1/completions", timeout=30,
                                      json={"model": "tiny", "prompt": "abc", "max_tokens": 4, "temperature": 0}))

        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: metric(url, "loramux:pending_requests") == 2, 10, "two requests in flight")
        refused = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert "2 requests are in flight (limit 2)" in refused.json()["error"]["message"]
        os.kill(pid, signal.SIGCONT)
        for t in threads:
            t.join(30)
        assert [r.status_code for r in results] == [200, 200]
        assert complete(url, "tiny")  # room again
    finally:
        stop(proc)


def test_the_token_and_per_client_limits_get_429_naming_the_limit(files):
    proc, url = start_server(files, "--max-pending-tokens", "40", "--max-pending-per-client", "1",
                             *FROZEN_FOR_AS_LONG_AS_IT_TAKES)
    try:
        pid = engine_pid(proc.pid)
        os.kill(pid, signal.SIGSTOP)  # nothing finishes while the limits are probed
        results = []

        def ask(client: str, max_tokens: int):
            results.append(httpx.post(f"{url}/v1/completions", timeout=30, headers={"Authorization": client},
                                      json={"model": "tiny", "prompt": "abc", "max_tokens": max_tokens,
                                            "temperature": 0}))

        first = threading.Thread(target=ask, args=("a", 8))
        first.start()
        wait_until(lambda: metric(url, "loramux:pending_requests") == 1, 10, "client a's request in flight")
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 8}
        again = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "a"}, timeout=10)
        assert again.status_code == 429 and int(again.headers["retry-after"]) >= 1
        assert "this client has 1 requests in flight (limit 1)" in again.json()["error"]["message"]
        pending = metric(url, "loramux:pending_tokens")  # client a's prompt + max_tokens
        too_long = httpx.post(f"{url}/v1/completions", headers={"Authorization": "b"}, timeout=10,
                              json={**body, "max_tokens": int(41 - pending)})
        assert too_long.status_code == 429
        assert f"{pending:.0f} tokens are in flight (limit 40)" in too_long.json()["error"]["message"]
        second = threading.Thread(target=ask, args=("b", 4))  # another client, within the token budget
        second.start()
        wait_until(lambda: metric(url, "loramux:pending_requests") == 2, 10, "client b's request in flight")
        os.kill(pid, signal.SIGCONT)
        first.join(30)
        second.join(30)
        assert [r.status_code for r in results] == [200, 200]
        assert metric(url, "loramux:pending_tokens") == 0
    finally:
        stop(proc)


def test_clients_that_go_away_free_their_requests(files):
    proc, url = start_server(files, *FROZEN_FOR_AS_LONG_AS_IT_TAKES)
    try:
        pid = engine_pid(proc.pid)
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
            httpx.post(f"{url}/v1/completions", timeout=1,
                       json={"model": "s0", "prompt": "abc", "max_tokens": 50, "ignore_eos": True})
        wait_until(lambda: metric(url, "loramux:pending_requests") == 0, 5, "the front end let the request go")
        os.kill(pid, signal.SIGCONT)
        reason = 'loramux:engine_finished_requests_total{reason="abort"}'
        wait_until(lambda: metric(url, reason) == 1, 10, "the engine aborted it")
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30,  # a streaming client that leaves
                          json={"model": "s1", "prompt": "abc", "max_tokens": 50, "ignore_eos": True,
                                "stream": True}) as response:
            next(response.iter_lines())
        wait_until(lambda: metric(url, reason) == 2, 10, "the engine aborted the stream's request")
        wait_until(lambda: metric(url, "loramux:num_requests_running") == 0
                   and metric(url, "loramux:kv_cache_usage_perc") == 0, 10, "its sequence and KV blocks are free")
        assert metric(url, 'loramux:engine_finished_requests_total{reason="length"}') == 0
    finally:
        stop(proc)


def test_a_process_on_its_way_out_is_seen_as_such_before_it_is_reaped():
    """/health reads the engine's state off the process (prctl.exiting): a killed process is reported before
    waitpid says so (it may spend a while freeing its memory first), and a zombie or a gone pid is dead."""
    import subprocess

    from loramux.server.engine import prctl

    child = subprocess.Popen(["sleep", "600"])
    assert not prctl.exiting(child.pid) and not prctl.exiting(os.getpid())
    os.kill(child.pid, signal.SIGKILL)
    wait_until(lambda: prctl.exiting(child.pid), 60, "the killed process shows as exiting")  # not reaped yet
    child.wait()
    assert prctl.exiting(child.pid)  # gone


def test_the_engine_and_the_front_end_keep_their_start_up_heap_out_of_the_garbage_collector(files):
    # otherwise every full collection walks the model's and the libraries' objects again (~170 ms with the default
    # model on 2 cores), a pause inside a step that every running stream sees as a late token
    proc, url = start_server(files, "--log-level", "debug")
    try:
        assert complete(url, "s0")
        frozen = {who: int(n) for who, n in
                  re.findall(r"(engine|front end): start-up done, (\d+) objects kept out", server_log(proc))}
        assert frozen.keys() == {"engine", "front end"} and min(frozen.values()) > 10_000, frozen
    finally:
        stop(proc)
