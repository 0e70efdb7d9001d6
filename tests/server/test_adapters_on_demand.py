"""`loramux serve --lora-resolver-dir DIR`: a `model` nobody registered is loaded from DIR/<model> on its
first request. It answers as the same adapter registered at start; many first requests at once make one
load; unknown names get 404, a broken adapter 400, and neither touches the others; nothing outside DIR is
read; after an engine restart, a resolved adapter is resolved again on its next request (a pinned one comes back
with the engine)."""
import concurrent.futures
import os
import shutil
import signal

import httpx
import pytest

from loramux import SamplingParams
from support.serving import NO_KEEPALIVE, engine_pid, make_files, metric, offline_llm, server_log, start_server, stop, wait_until

pytestmark = pytest.mark.slow
PROMPTS = [f"tell me about {w}" for w in ("cats", "ships", "rain", "maps", "tea", "bells", "owls", "kites")]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    files = make_files(tmp_path_factory)
    root = files["resolvable"]
    shutil.copytree(files["on_demand"]["cold"], os.path.join(root, "broken"))
    with open(os.path.join(root, "broken", "adapter_model.safetensors"), "r+b") as f:
        f.truncate(200)  # a torn file
    os.makedirs(os.path.join(root, "sneaky"))  # its weights are a symlink out of the resolver's directory
    shutil.copy(os.path.join(files["served"]["s0"], "adapter_config.json"), os.path.join(root, "sneaky"))
    os.symlink(os.path.join(files["served"]["s0"], "adapter_model.safetensors"),
               os.path.join(root, "sneaky", "adapter_model.safetensors"))
    os.symlink(files["served"]["s1"], os.path.join(root, "outside"))  # a whole adapter out of it
    return files


@pytest.fixture(scope="module")
def oracle(files):
    """Greedy text of each on-demand adapter (and s0) registered up front in the offline engine."""
    llm = offline_llm(files, {**files["on_demand"], "s0": files["served"]["s0"]})
    rows = [(p, a) for p in PROMPTS for a in ("cold", "acme/legal", "s0")]
    outs = llm.generate([p for p, _ in rows], SamplingParams(max_tokens=8, temperature=0), adapters=[a for _, a in rows])
    return {row: out.text for row, out in zip(rows, outs)}


@pytest.fixture(scope="module")
def server(files, oracle):
    proc, url = start_server(files, "--lora-resolver-dir", files["resolvable"], "--log-level", "info")
    yield proc, url
    stop(proc)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[1], timeout=120, limits=NO_KEEPALIVE) as c:
        yield c


def complete(http, model, prompt="hello", max_tokens=8):
    return http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                              "temperature": 0})


def models(http) -> list[str]:
    return [m["id"] for m in http.get("/v1/models").json()["data"]]


def test_first_requests_at_once_load_the_adapter_once_and_answer_as_if_registered(server, http, oracle):
    proc, _ = server
    assert "cold" not in models(http)
    rows = [(p, a) for p in PROMPTS for a in ("cold", "s0")]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda row: complete(http, row[1], row[0]), rows))
    for row, r in zip(rows, answers):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == oracle[row], row
    assert server_log(proc).count("adapter 'cold' resolved to") == 1
    assert "cold" in models(http)


def test_a_name_with_a_slash_is_a_subdirectory(http, oracle):
    r = complete(http, "acme/legal", PROMPTS[0])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == oracle[PROMPTS[0], "acme/legal"]


def test_an_unknown_name_is_404_naming_the_resolvers(files, http):
    r = complete(http, "ghost")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert f"directory {os.path.realpath(files['resolvable'])}" in r.json()["error"]["message"]


def test_nothing_outside_the_directory_is_read(http):
    for name in ("outside", "../allowed/new", "acme/../../allowed/new"):
        assert complete(http, name).status_code == 404, name
    sneaky = complete(http, "sneaky")  # its weights resolve outside the directory: refused file by file
    assert sneaky.status_code == 400, sneaky.text
    assert "sneaky" not in models(http)


def test_a_broken_adapter_is_400_and_the_others_are_untouched(server, http, oracle):
    proc, _ = server
    running = concurrent.futures.ThreadPoolExecutor(1).submit(complete, http, "cold", PROMPTS[1])
    broken = complete(http, "broken")
    assert broken.status_code == 400 and "broken" in broken.json()["error"]["message"], broken.text
    assert complete(http, "broken").status_code == 400  # answered again from memory, not read again
    assert server_log(proc).count("adapter 'broken' resolved to") == 1
    assert running.result().json()["choices"][0]["text"] == oracle[PROMPTS[1], "cold"]
    assert "broken" not in models(http)
    assert http.get("/health").status_code == 200


def test_an_unloaded_resolved_adapter_is_resolved_again(server, http, oracle):
    proc, _ = server
    assert complete(http, "cold").status_code == 200
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "cold"}).status_code == 200
    assert "cold" not in models(http)
    r = complete(http, "cold", PROMPTS[2])
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == oracle[PROMPTS[2], "cold"]
    assert server_log(proc).count("adapter 'cold' resolved to") == 2


def test_after_an_engine_restart_a_resolved_adapter_is_resolved_on_its_next_request(server, http, oracle):
    proc, url = server
    assert complete(http, "acme/legal").status_code == 200
    before = server_log(proc).count("adapter 'acme/legal' resolved to")
    restarts = metric(url, "loramux:engine_restarts")
    os.kill(engine_pid(proc.pid), signal.SIGKILL)
    wait_until(lambda: metric(url, "loramux:engine_restarts") > restarts and http.get("/health").status_code == 200,
               120, "the engine back")
    assert "acme/legal" not in models(http)  # not loaded again with the registered ones
    r = complete(http, "acme/legal", PROMPTS[3])
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == oracle[PROMPTS[3], "acme/legal"]
    assert server_log(proc).count("adapter 'acme/legal' resolved to") == before + 1


def test_a_pinned_resolved_adapter_comes_back_pinned_after_a_restart_and_stays_on_demand(server, http, oracle):
    """A pin keeps an adapter loaded across engine restarts; the adapter is still one resolved on demand: once
    unpinned, the next restart leaves it to be resolved on its next request again."""
    proc, url = server

    def restart():
        restarts = metric(url, "loramux:engine_restarts")
        os.kill(engine_pid(proc.pid), signal.SIGKILL)
        wait_until(lambda: metric(url, "loramux:engine_restarts") > restarts and http.get("/health").status_code == 200,
                   120, "the engine back")

    assert complete(http, "cold").status_code == 200
    assert http.post("/v1/pin_lora_adapter", json={"lora_name": "cold"}).status_code == 200
    resolved = server_log(proc).count("adapter 'cold' resolved to")
    restart()
    assert "cold" in models(http) and metric(url, "loramux:num_pinned_adapters") >= 1  # loaded with the engine
    r = complete(http, "cold", PROMPTS[4])
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == oracle[PROMPTS[4], "cold"]
    assert server_log(proc).count("adapter 'cold' resolved to") == resolved  # not resolved again
    assert http.post("/v1/unpin_lora_adapter", json={"lora_name": "cold"}).status_code == 200
    restart()
    assert "cold" not in models(http)
    assert complete(http, "cold", PROMPTS[5]).json()["choices"][0]["text"] == oracle[PROMPTS[5], "cold"]
    assert server_log(proc).count("adapter 'cold' resolved to") == resolved + 1


def test_adapter_uploads_are_off_unless_the_operator_sets_a_size(files, http):
    path = files["on_demand"]["cold"]
    with open(os.path.join(path, "adapter_config.json"), "rb") as config, \
            open(os.path.join(path, "adapter_model.safetensors"), "rb") as weights:
        r = http.post("/v1/load_lora_adapter", data={"lora_name": "up"},
                      files={"adapter_config.json": config, "adapter_model.safetensors": weights})
    assert r.status_code == 400 and "--max-adapter-upload-bytes" in r.json()["error"]["message"]
