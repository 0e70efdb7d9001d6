"""Adapters uploaded in the body of /v1/load_lora_adapter (multipart: lora_name, load_inplace, pinned, and the
adapter_config.json and adapter_model.safetensors parts), as a trainer on another host pushes them: they answer as
the same adapter loaded from files; load_inplace replaces the weights; a broken upload is refused as the same
files are and leaves nothing behind; uploads are bounded (and off unless the operator sets a size:
tests/server/test_adapters_on_demand.py); an engine restart loads the uploaded adapter again; unloading removes
its files. Every answer names the adapter load that produced it (system_fingerprint), and with
--lora-keep-revisions an earlier revision stays addressable as name@rev, and a weighted alias splits a name's
requests between revisions."""
import json
import os
import re
import signal

import httpx
import pytest

from loramux import SamplingParams
from support.hostile_adapters import CONFIG, ST
from support.serving import NO_KEEPALIVE, engine_pid, make_files, metric, offline_llm, start_server, stop, wait_until

pytestmark = pytest.mark.slow
PROMPT = "tell me about kites"
LIMIT = 1 << 20


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory)


@pytest.fixture(scope="module")
def oracle(files):
    """Each runtime adapter's greedy text, loaded from files in the offline engine."""
    llm = offline_llm(files, files["runtime"])
    names = list(files["runtime"])
    outs = llm.generate([PROMPT] * len(names), SamplingParams(max_tokens=8, temperature=0), adapters=names)
    return {name: out.text for name, out in zip(names, outs)}


@pytest.fixture(scope="module")
def server(files):
    proc, url = start_server(files, "--max-adapter-upload-bytes", str(LIMIT), "--lora-keep-revisions", "2")
    yield proc, url
    stop(proc)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[1], timeout=120, limits=NO_KEEPALIVE) as c:
        yield c


def upload(http, name: str, path: str, **fields):
    with open(os.path.join(path, CONFIG), "rb") as config, open(os.path.join(path, ST), "rb") as weights:
        return http.post("/v1/load_lora_adapter", data={"lora_name": name, **fields},
                         files={CONFIG: (CONFIG, config), ST: (ST, weights)})


def text(http, model: str) -> str:
    r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_an_upload_answers_as_the_same_files_and_load_inplace_replaces_it(files, http, oracle):
    runtime = files["runtime"]
    r = upload(http, "pushed", runtime["new"])
    assert r.status_code == 200 and "added" in r.text
    assert text(http, "pushed") == oracle["new"]
    again = upload(http, "pushed", runtime["v2"])
    assert again.status_code == 400 and again.json()["error"]["code"] == "adapter_exists"
    assert upload(http, "pushed", runtime["v2"], load_inplace="true").status_code == 200
    assert text(http, "pushed") == oracle["v2"]


def root_of(http, name: str) -> str:
    return http.get(f"/v1/models/{name}").json()["root"]


def test_a_broken_upload_is_refused_as_its_files_are_and_leaves_nothing(files, http, tmp_path):
    assert upload(http, "probe", files["runtime"]["new"]).status_code == 200
    uploads = os.path.dirname(root_of(http, "probe"))  # the server's directory of uploads
    before = sorted(os.listdir(uploads))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / CONFIG).write_bytes(open(os.path.join(files["runtime"]["new"], CONFIG), "rb").read())
    (broken / ST).write_bytes(open(os.path.join(files["runtime"]["new"], ST), "rb").read()[:300])  # torn
    r = upload(http, "torn", str(broken))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter"
    assert "adapter_model.safetensors" in r.json()["error"]["message"]  # the engine's words for a torn file
    assert "torn" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert sorted(os.listdir(uploads)) == before


def test_a_body_refused_part_way_leaves_no_files(files, http):
    """Refused as it arrives (its weights were being written into place): a chunked body past the limit is a 413,
    a malformed one a 400, and neither leaves its directory behind."""
    assert upload(http, "partway", files["runtime"]["new"]).status_code == 200
    uploads = os.path.dirname(root_of(http, "partway"))
    before = sorted(os.listdir(uploads))
    request = httpx.Request("POST", "http://x/", data={"lora_name": "big"},
                            files={CONFIG: (CONFIG, b"{}"), ST: (ST, bytes(LIMIT + 200_000))})
    body = request.read()

    def chunked():  # no Content-Length: counted as it comes
        for at in range(0, len(body), 65536):
            yield body[at:at + 65536]

    big = http.post("/v1/load_lora_adapter", content=chunked(), headers={"content-type": request.headers["content-type"]})
    assert big.status_code == 413
    torn = http.post("/v1/load_lora_adapter", content=body[:LIMIT // 2],
                     headers={"content-type": request.headers["content-type"]})
    assert torn.status_code == 400 and "closing boundary" in torn.json()["error"]["message"]
    assert sorted(os.listdir(uploads)) == before
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "partway"}).status_code == 200


def test_uploads_are_bounded_and_checked(files, http):
    big = http.post("/v1/load_lora_adapter", data={"lora_name": "big"},
                    files={CONFIG: (CONFIG, b"{}"), ST: (ST, b"\0" * (LIMIT + 1))})
    assert big.status_code == 413
    missing = http.post("/v1/load_lora_adapter", data={"lora_name": "x"}, files={CONFIG: (CONFIG, b"{}")})
    assert missing.status_code == 400 and ST in missing.json()["error"]["message"]
    odd = http.post("/v1/load_lora_adapter", data={"lora_name": "x", "lora_path": "/etc"},
                    files={CONFIG: (CONFIG, b"{}"), ST: (ST, b"")})
    assert odd.status_code == 400 and "lora_path" in odd.json()["error"]["message"]
    bad_name = upload(http, "../up", files["runtime"]["new"])
    assert bad_name.status_code == 400 and bad_name.json()["error"]["code"] == "invalid_adapter_name"
    json_load = http.post("/v1/load_lora_adapter", json={"lora_name": "byjson"})  # vLLM's JSON body: still checked
    assert json_load.status_code == 400 and "lora_path" in json_load.json()["error"]["message"]


def test_an_uploaded_adapter_comes_back_after_an_engine_restart_and_its_files_go_with_unload(files, server, http,
                                                                                              oracle):
    proc, url = server
    assert upload(http, "kept", files["runtime"]["other"], pinned="true").status_code == 200
    restarts = metric(url, "loramux:engine_restarts")
    os.kill(engine_pid(proc.pid), signal.SIGKILL)
    wait_until(lambda: metric(url, "loramux:engine_restarts") > restarts and http.get("/health").status_code == 200,
               120, "the engine back")
    assert "kept" in [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert text(http, "kept") == oracle["other"]
    path = root_of(http, "kept")
    assert os.path.isfile(os.path.join(path, ST))
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "kept"}).status_code == 200
    assert not os.path.exists(path)


def test_each_answer_names_the_adapter_load_that_produced_it(files, http):
    """system_fingerprint (and the x-adapter-revision header), in whole answers and in every streamed event:
    name@rev of the load that ran the request; a reload in place is a new revision; the base model has none."""
    assert upload(http, "rev", files["runtime"]["new"]).status_code == 200
    body = {"model": "rev", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    first = http.post("/v1/completions", json=body)
    fingerprint = first.json()["system_fingerprint"]
    assert re.fullmatch(r"rev@[0-9a-f]{8}", fingerprint) and first.headers["x-adapter-revision"] == fingerprint
    chat = {"model": "rev", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=chat) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert r.headers["x-adapter-revision"] == fingerprint
    assert len(events) > 2 and {e["system_fingerprint"] for e in events} == {fingerprint}
    assert upload(http, "rev", files["runtime"]["v2"], load_inplace="true").status_code == 200
    again = http.post("/v1/completions", json=body).json()["system_fingerprint"]
    assert again.startswith("rev@") and again != fingerprint
    base = http.post("/v1/completions", json={**body, "model": "tiny"})
    assert base.json()["system_fingerprint"] is None and "x-adapter-revision" not in base.headers


def test_an_earlier_revision_is_addressable_while_kept(files, http, oracle):
    """--lora-keep-revisions 2: the bare name serves the newest load, name@rev the one before it (its card in
    /v1/models has the name as parent); a third load drops the first; an unload takes every revision."""
    runtime = files["runtime"]
    first = upload(http, "canary", runtime["new"]).headers["x-adapter-revision"]
    second = upload(http, "canary", runtime["v2"], load_inplace="true").headers["x-adapter-revision"]
    assert first != second and first.startswith("canary@")
    old = http.post("/v1/completions", json={"model": first, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert old.json()["choices"][0]["text"] == oracle["new"] and old.json()["system_fingerprint"] == first
    assert text(http, "canary") == text(http, second) == oracle["v2"]
    cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert cards[first]["parent"] == "canary" and second not in cards  # the current one is the name's own card
    assert http.get(f"/v1/models/{first}").json()["id"] == first
    third = http.post("/v1/load_lora_adapter", json={"lora_name": "canary", "lora_path": runtime["other"],
                                                     "load_inplace": True})
    assert third.status_code == 200 and third.headers["x-adapter-revision"] not in (first, second)
    gone = http.post("/v1/completions", json={"model": first, "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404 and http.get(f"/v1/models/{first}").status_code == 404
    assert text(http, second) == oracle["v2"] and text(http, "canary") == oracle["other"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "canary"}).status_code == 200
    assert http.post("/v1/completions", json={"model": second, "prompt": PROMPT, "max_tokens": 2}).status_code == 404


def test_a_weighted_alias_splits_requests_between_revisions_stably_per_user(files, server, http):
    """A canary: 70% of `split`'s requests on its earlier revision, 30% on the newest; the same user always on the
    same one; the shares in the metrics; refusals for bad aliases; removing it gives the name back."""
    runtime = files["runtime"]
    old = upload(http, "split", runtime["new"]).headers["x-adapter-revision"]
    new = upload(http, "split", runtime["v2"], load_inplace="true").headers["x-adapter-revision"]
    made = http.post("/v1/lora_aliases", json={"name": "split", "targets": {old: 7, new: 3}})
    assert made.status_code == 200 and made.json()["targets"] == {old: 0.7, new: 0.3}
    assert {"name": "split", "targets": {old: 0.7, new: 0.3}} in http.get("/v1/lora_aliases").json()["data"]

    def served(user: str) -> str:
        body = {"model": "split", "prompt": PROMPT, "max_tokens": 1, "user": user}
        return http.post("/v1/completions", json=body).json()["system_fingerprint"]

    picks = [served(f"user-{i}") for i in range(100)]
    assert set(picks) == {old, new} and 15 <= picks.count(new) <= 45  # 30 expected; binomial sd 4.6
    assert [served("user-7") for _ in range(3)] == [picks[7]] * 3  # stable per user
    counted = {t: metric(server[1], f'loramux:lora_alias_requests_total{{alias="split",target="{t}"}}')
               for t in (old, new)}
    assert counted == {old: picks.count(old) + 3 * (picks[7] == old), new: picks.count(new) + 3 * (picks[7] == new)}
    for targets, why in (({"nope": 1}, "no adapter is loaded"), ({old: 0}, "must not all be 0"),
                         ({old: -1}, "finite number >= 0"), ({}, "1 to 16 targets")):
        bad = http.post("/v1/lora_aliases", json={"name": "split", "targets": targets})
        assert bad.status_code == 400 and why in bad.json()["error"]["message"], bad.text
    assert http.delete("/v1/lora_aliases/split").json() == {"name": "split", "deleted": True}
    assert {served(f"user-{i}") for i in range(10)} == {new}
    assert http.delete("/v1/lora_aliases/split").status_code == 404
