"""`loramux serve --replicas 2` (Ray Serve, a local cluster in the server's process tree): one endpoint, two
engine replicas. Every greedy answer equals the single-engine LLM's; after warm-up each adapter stays on one
replica (Serve's model multiplexing) and both replicas serve; load / unload through the ingress reach the
replicas; a replica's engine killed mid-request gives 503s, then the replica serves again."""
import collections
import concurrent.futures
import os
import re
import signal

import httpx
import pytest

pytest.importorskip("ray.serve")

from loramux import SamplingParams  # noqa: E402
from loramux.server.http.tenants import key_hash  # noqa: E402
from support.serving import NO_KEEPALIVE, make_files, offline_llm, start_server, stop, wait_until  # noqa: E402

pytestmark = pytest.mark.slow
KEY = "scale-key"
ADAPTERS = ["s0", "s1", "s2", "s3", "s4", "new"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory)


@pytest.fixture(scope="module")
def oracle(files):
    """The single-engine LLM on the same checkpoint and adapters: prompt, adapter -> greedy text."""
    llm = offline_llm(files, {**files["served"], **files["runtime"]})
    prompts = [f"prompt {i} about {w}" for i, w in enumerate(["cats", "ships", "rain", "maps", "tea", "bells"] * 10)]
    rows = [(p, ADAPTERS[i % 6]) for i, p in enumerate(prompts)]
    outs = llm.generate([p for p, _ in rows], SamplingParams(max_tokens=8, temperature=0), adapters=[a for _, a in rows])
    return {row: out.text for row, out in zip(rows, outs)}


TENANT_KEY = "acme-key"


@pytest.fixture(scope="module")
def deployment(files, oracle):
    tenants = files["root"] / "tenants.toml"
    tenants.write_text(f'[tenants.acme]\nkeys = ["sha256:{key_hash(TENANT_KEY)}"]\nmodels = ["s0", "cold"]\n'
                       f'[tenants.capped]\nkeys = ["sha256:{key_hash("capped-key")}"]\nmodels = ["tiny"]\n'
                       f'rpm_limit = 4\n'
                       f'[tenants.metered]\nkeys = ["sha256:{key_hash("metered-key")}"]\nmodels = ["tiny"]\n'
                       f'tpm_limit = 30\n')
    proc, url = start_server(files, "--replicas", "2", "--max-adapters-per-replica", "8", "--api-key", KEY,
                             "--lora-resolver-dir", files["resolvable"], "--tenants", str(tenants))
    yield proc, url
    stop(proc)


@pytest.fixture(scope="module")
def server(deployment):
    return deployment[1]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=120, limits=NO_KEEPALIVE) as c:
        yield c


def complete(http, prompt, model, max_tokens=8):
    r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    return r.status_code, r.headers.get("x-loramux-replica"), r.json()


def replicas(http) -> dict[str, dict]:
    """replica -> {"pid", "engine_pid"} from /metrics."""
    found = re.findall(r'loramux:replica_info\{engine_pid="(\d+)",pid="(\d+)",replica="([^"]+)"\}', http.get("/metrics").text)
    return {rid: {"pid": int(pid), "engine_pid": int(engine)} for engine, pid, rid in found}


def pending(http, replica: str) -> int:
    """Engine requests in flight in the replica's front end, from its latest report."""
    found = re.search(rf'loramux:pending_requests\{{replica="{re.escape(replica)}"\}} (\S+)', http.get("/metrics").text)
    return int(float(found.group(1))) if found else 0


def reported(http, replica: str) -> dict:
    """The replica's pids once its report is fresh (every 0.5 s; a busy 2-core box can delay one past 5 s)."""
    return wait_until(lambda: replicas(http).get(replica), 30, f"a report from replica {replica}", interval=0.2)


def test_answers_equal_one_engine_and_each_adapter_stays_on_one_replica(http, files, oracle):
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": files["runtime"]["new"]}).status_code == 200
    ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert ids == ["tiny", "s0", "s1", "s2", "s3", "s4", "new"]  # the base model and every adapter, once
    seen: set[str] = set()  # /health is up with one replica: wait until the ingress routes to both
    wait_until(lambda: seen.add(complete(http, "up?", "tiny", 1)[1]) or len(seen) == 2, 120, "both replicas serving",
               interval=0.05)
    placed: dict[str, str] = {}
    for adapter in ADAPTERS:  # one after another: each new adapter goes to the replica holding the fewest
        status, placed[adapter], _ = complete(http, "warm", adapter)
        assert status == 200
    counts = collections.Counter(placed.values())
    assert sorted(counts.values()) == [3, 3], placed  # before any replica's report can have said so
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda row: (row, complete(http, *row)), oracle))
    served_by: dict[str, set] = {}
    for (prompt, adapter), (status, replica, body) in results:
        assert status == 200, body
        assert body["choices"][0]["text"] == oracle[prompt, adapter], (prompt, adapter)
        served_by.setdefault(adapter, set()).add(replica)
    assert all(len(r) == 1 for r in served_by.values()), served_by  # affinity
    assert len(set().union(*served_by.values())) == 2, served_by  # both replicas serve
    metrics = http.get("/metrics").text
    assert metrics.count("loramux:lora_requests_info{") == 2 and len(replicas(http)) == 2
    for adapter, (replica,) in served_by.items():  # each adapter resident in host memory where it was served
        assert f'lora_adapter_resident{{adapter="{adapter}",pinned="false",replica="{replica}",tier="host"}}' in \
            metrics, adapter


def test_streaming_through_the_ingress_equals_the_single_engine(http, oracle):
    (prompt, adapter), expected = next(iter(oracle.items()))
    body = {"model": adapter, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-loramux-replica"]
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    import json
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected


def test_the_api_key_and_the_health_route_as_on_one_server(server, http):
    assert httpx.get(f"{server}/health").status_code == 200  # no key needed
    refused = httpx.post(f"{server}/v1/completions", json={"model": "s0", "prompt": "x", "max_tokens": 2})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/v1/models").status_code == 401


def test_the_ingress_scopes_a_tenant_as_one_server_does(server):
    """The same tenants file: names outside its patterns are 404 (never resolved), /v1/models lists its own,
    admin and operator routes are 403."""
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {TENANT_KEY}"}, timeout=120,
                      limits=NO_KEEPALIVE) as acme:
        assert complete(acme, "hello", "s0")[0] == 200
        outside, absent = complete(acme, "hello", "s1"), complete(acme, "hello", "acme/legal")  # (a resolvable name)
        assert outside[0] == absent[0] == 404
        assert [m["id"] for m in acme.get("/v1/models").json()["data"]] == ["s0"]
        assert acme.post("/v1/unload_lora_adapter", json={"lora_name": "s1"}).status_code == 403
        assert acme.get("/metrics").status_code == 403
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as operator:
        # the replicas' per-tenant counters, labelled by replica (each counts its own): acme's admitted request
        wait_until(lambda: re.search(r'loramux:tenant_requests_total\{replica="[^"]+",tenant="acme"\} [1-9]',
                                     operator.get("/metrics").text), 30, "acme's request in the ingress's metrics")


def test_load_and_unload_reach_every_replica(http, files, oracle):
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "other", "lora_path": files["runtime"]["other"]}).status_code == 200
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "other", "lora_path": files["runtime"]["other"]})
    assert again.status_code == 200 and "already loaded" in again.text  # the same path: idempotent, as one server
    elsewhere = http.post("/v1/load_lora_adapter", json={"lora_name": "other", "lora_path": files["runtime"]["v2"]})
    assert elsewhere.status_code == 400 and elsewhere.json()["error"]["code"] == "adapter_exists"
    with_id = http.post("/v1/unload_lora_adapter", json={"lora_name": "other", "lora_int_id": 3})
    assert with_id.status_code == 400 and "lora_int_id" in with_id.json()["error"]["message"]
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": files["allowed"] + "/nowhere"})
    assert bad.status_code == 400 and "bad" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
    upload = http.post("/v1/load_lora_adapter", data={"lora_name": "pushed"},
                       files={"adapter_config.json": b"{}", "adapter_model.safetensors": b""})
    assert upload.status_code == 400 and "uploads are not taken by the Ray Serve ingress" in upload.text
    for _ in range(4):  # whichever replicas it reaches
        assert complete(http, "hello", "other")[0] == 200
    assert http.post("/v1/pin_lora_adapter", json={"lora_name": "other"}).status_code == 200  # applied everywhere
    assert http.post("/v1/unpin_lora_adapter", json={"lora_name": "other"}).status_code == 200
    assert http.post("/v1/pin_lora_adapter", json={"lora_name": "ghost"}).status_code == 404
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "other"}).status_code == 200
    status, _, body = complete(http, "hello", "other")  # gone everywhere at once
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert "other" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "other"}).status_code == 404


def test_a_killed_replica_engine_gives_503_then_the_replica_serves_again(http, oracle):
    (prompt, adapter), expected = next(iter(oracle.items()))
    status, replica, _ = complete(http, prompt, adapter)
    assert status == 200
    engine_pid = reported(http, replica)["engine_pid"]
    wait_until(lambda: pending(http, replica) == 0, 30, "a report after the request ended", interval=0.1)
    os.kill(engine_pid, signal.SIGSTOP)  # frozen: the next request is surely in flight when it dies
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(complete, http, "a long one", adapter, 48)
        wait_until(lambda: pending(http, replica) >= 1, 60, "the request in flight at the replica", interval=0.1)
        os.kill(engine_pid, signal.SIGKILL)
        status, _, body = running.result()
    assert status == 503 or body["choices"][0]["finish_reason"] == "error", body
    refused = wait_until(lambda: complete(http, prompt, adapter)[0] == 503, 10, "a 503 while the engine restarts",
                         interval=0.02)
    assert refused
    wait_until(lambda: complete(http, prompt, adapter)[0] == 200, 120, "the replica serving again", interval=0.5)
    status, again, body = complete(http, prompt, adapter)
    assert (status, again, body["choices"][0]["text"]) == (200, replica, expected)
    wait_until(lambda: reported(http, replica)["engine_pid"] != engine_pid, 30, "the new engine's pid reported")


def test_a_killed_replica_gives_503_and_serve_starts_another(http, oracle):
    (prompt, adapter), expected = list(oracle.items())[1]
    status, replica, _ = complete(http, prompt, adapter)
    assert status == 200
    pids = reported(http, replica)
    wait_until(lambda: pending(http, replica) == 0, 30, "a report after the request ended", interval=0.1)
    os.kill(pids["engine_pid"], signal.SIGSTOP)  # the request below is in flight when its replica dies
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(complete, http, "a long one", adapter, 48)
        wait_until(lambda: pending(http, replica) >= 1, 60, "the request in flight at the replica", interval=0.1)
        os.kill(pids["pid"], signal.SIGKILL)
        os.kill(pids["engine_pid"], signal.SIGKILL)
        status, _, body = running.result(timeout=60)  # the ingress answers, it does not hang
    assert status == 503 and "replica" in body["error"]["message"], body
    wait_until(lambda: complete(http, prompt, adapter)[0] == 200, 120, "the adapter served again", interval=0.5)
    assert complete(http, prompt, adapter)[2]["choices"][0]["text"] == expected
    wait_until(lambda: len(now := replicas(http)) == 2 and replica not in now, 120,  # one look at /metrics
               "a new replica in its place", interval=0.5)


def test_an_adapter_nobody_registered_is_resolved_by_the_ingress_and_served(http, files):
    prompts = ["cold 1", "cold 2", "cold 3"]
    llm = offline_llm(files, {"acme/legal": files["on_demand"]["acme/legal"]})
    expected = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0),
                                             adapters=["acme/legal"] * 3)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda p: complete(http, p, "acme/legal"), prompts))
    assert [a[2].get("choices", [{}])[0].get("text") for a in answers] == expected, answers
    assert "acme/legal" in [m["id"] for m in http.get("/v1/models").json()["data"]]
    status, _, body = complete(http, "x", "nobody")
    assert status == 404 and "no adapter resolver has it" in body["error"]["message"], body


def test_a_weighted_combination_through_the_ingress_equals_one_engine(http, files):
    """`adapters` beside the base model's name: the replica the request lands on loads every part first, and the
    answer is the single engine's; a part nobody has is a 400, as on one server."""
    combo = {"s2": 0.5, "s0": 1.0}
    llm = offline_llm(files, {name: files["served"][name] for name in combo})
    expected = llm.generate("mix", SamplingParams(max_tokens=8, temperature=0), adapters=combo, use_tqdm=False)[0].text
    for _ in range(2):
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "mix", "max_tokens": 8, "temperature": 0,
                                               "adapters": combo})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "mix", "max_tokens": 2, "adapters": {"ghost": 1}})
    assert r.status_code == 400 and "ghost" in r.text


def test_a_tenants_limits_hold_for_the_whole_deployment(server):
    """rpm_limit 4 over two replicas: 4 requests answered, then 429s from the ingress (no replica answered them),
    with Retry-After, wherever Serve would have sent them (base-model requests land on either replica; counted per
    replica, up to 8 got through). tpm_limit: tokens one replica counted refuse the next request at the ingress."""
    with httpx.Client(base_url=server, headers={"Authorization": "Bearer capped-key"}, timeout=120,
                      limits=NO_KEEPALIVE) as capped:
        answers = [capped.post("/v1/completions", json={"model": "tiny", "prompt": f"hi {i}", "max_tokens": 2})
                   for i in range(8)]
    assert [r.status_code for r in answers] == [200] * 4 + [429] * 4
    assert all("x-loramux-replica" not in r.headers and int(r.headers["retry-after"]) >= 1 for r in answers[4:])
    assert "rpm_limit" in answers[4].json()["error"]["message"]
    assert 'loramux:tenant_rejected_total{limit="rpm_limit",replica="ingress",tenant="capped"} 4.0' in \
        httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    with httpx.Client(base_url=server, headers={"Authorization": "Bearer metered-key"}, timeout=120,
                      limits=NO_KEEPALIVE) as metered:
        body = {"model": "tiny", "prompt": "a long enough prompt", "max_tokens": 24, "ignore_eos": True}
        assert metered.post("/v1/completions", json=body).status_code == 200  # ~45 tokens: past 30

        def refused_here():
            r = metered.post("/v1/completions", json={**body, "max_tokens": 1})
            return r.status_code == 429 and "x-loramux-replica" not in r.headers and "tpm_limit" in r.text

        wait_until(refused_here, 30, "the ingress refusing once a replica's report counts the tokens", interval=0.3)


def test_sighup_reloads_the_tenants_file_on_the_ingress_and_every_replica(deployment, files, http):
    """A tenant added to the file: its key is refused, then, after SIGHUP to the deployment's process, accepted
    by the ingress and by both replicas (base-model requests land on either)."""
    proc, url = deployment
    tenants = files["root"] / "tenants.toml"
    tenants.write_text(tenants.read_text() + f'[tenants.beta]\nkeys = ["sha256:{key_hash("beta-key")}"]\n'
                                              'models = ["tiny"]\n')
    with httpx.Client(base_url=url, headers={"Authorization": "Bearer beta-key"}, timeout=120,
                      limits=NO_KEEPALIVE) as beta:
        assert complete(beta, "hi", "tiny", 2)[0] == 401
        proc.send_signal(signal.SIGHUP)

        last: list = []

        def everywhere():
            last[:] = [complete(beta, f"hi {i}", "tiny", 2) for i in range(6)]
            return all(status == 200 for status, _, _ in last) and len({replica for _, replica, _ in last}) == 2

        try:
            wait_until(everywhere, 60, "the new tenant's key accepted by the ingress and both replicas", interval=0.5)
        except AssertionError as e:  # what was refused where names the cause
            seen = [(status, replica, body.get("error")) for status, replica, body in last]
            raise AssertionError(f"{e}; the last answers: {seen}; replicas reporting: {sorted(replicas(http))}") from e


def registry_pid(http) -> int | None:
    try:
        found = re.search(r'loramux:adapter_registry_info\{pid="(\d+)"\}', http.get("/metrics").text)
    except httpx.HTTPError:
        return None
    return int(found[1]) if found else None


def test_runtime_loads_and_pins_survive_a_restart_of_the_registry(http, files):
    """The adapter registry keeps its state in the cluster's key-value store: its process killed, Serve starts
    another, and a runtime load and its pin are still registered, listed and served."""
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "kept", "lora_path": files["runtime"]["other"]}) \
        .status_code == 200
    assert http.post("/v1/pin_lora_adapter", json={"lora_name": "kept"}).status_code == 200
    pid = registry_pid(http)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: registry_pid(http) not in (None, pid), 120, "a new adapter registry process", interval=1.0)
    listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert "kept" in listed and complete(http, "kept?", "kept")[0] == 200
    assert http.post("/v1/unpin_lora_adapter", json={"lora_name": "kept"}).status_code == 200
