"""Adapters from stores: /v1/load_lora_adapter's lora_path and --lora-resolver-uri take s3:// (a real S3 API:
moto's server), http:// (a local web server) and hf:// (a local Hub cache, offline) URIs under
--allowed-adapter-uri. They answer as the same files loaded from disk; a changed object is fetched again (a new
revision), an unchanged one is not; a URI outside the prefixes, an object too large or not what the store said
is a 400; a failing or stalled store a 502 (a fetch past its timeout ends), while running streams go on."""
import hashlib
import http.server
import json
import os
import shutil
import socket
import threading

import httpx
import pytest

from loramux import SamplingParams
from support.hostile_adapters import CONFIG, ST
from support.serving import free_port, make_files, offline_llm, start_server, stop

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")
pytestmark = pytest.mark.slow
PROMPT = "tell me about kites"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory)


@pytest.fixture(scope="module")
def oracle(files):
    runtime = files["runtime"]
    llm = offline_llm(files, runtime)
    outs = llm.generate([PROMPT] * len(runtime), SamplingParams(max_tokens=8, temperature=0), adapters=list(runtime))
    return {name: out.text for name, out in zip(runtime, outs)}


@pytest.fixture(scope="module")
def s3(files):
    """moto's S3 server, a bucket, and a function that puts an adapter directory's files under a key prefix."""
    import boto3

    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="test",
                          aws_secret_access_key="test", region_name="us-east-1")
    client.create_bucket(Bucket="adapters")

    def put(prefix: str, path: str) -> None:
        for name in (CONFIG, ST):
            with open(os.path.join(path, name), "rb") as f:
                client.put_object(Bucket="adapters", Key=f"{prefix}/{name}", Body=f.read())

    yield put, client, env
    server.stop()


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Files under the served directory, with an ETag as nginx gives one; /broken/ fails, /stall/ answers
    nothing until `release` is set (then fails), /lying/ gives an MD5 ETag of other bytes."""

    release = threading.Event()

    def end_headers(self):
        path = self.translate_path(self.path)
        if os.path.isfile(path):
            tag = hashlib.md5(b"other bytes").hexdigest() if "/lying/" in self.path else \
                f"{os.stat(path).st_mtime_ns:x}-{os.path.getsize(path):x}"
            self.send_header("ETag", f'"{tag}"')
        super().end_headers()

    def do_HEAD(self):
        if self._special():
            super().do_HEAD()

    def do_GET(self):
        if self._special():
            super().do_GET()

    def _special(self) -> bool:
        if "/broken/" in self.path:
            self.send_error(500, "the disk is on fire")
            return False
        if "/stall/" in self.path:
            self.release.wait()
            self.send_error(503)
            return False
        return True

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def web(files, tmp_path_factory):
    root = tmp_path_factory.mktemp("web")
    for where in ("ok/b", "ok/lying", "ok/broken", "ok/stall", "other/b"):
        shutil.copytree(files["runtime"]["other"], root / where)
    handler = lambda *a, **k: _Handler(*a, directory=str(root), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    _Handler.release.set()
    server.shutdown()


@pytest.fixture(scope="module")
def hub(files, tmp_path_factory):
    """A local Hugging Face cache holding acme/legal as a download leaves it (LFS files named by their SHA-256)."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--acme--legal"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    (repo / "snapshots" / commit).mkdir(parents=True)
    for name in (CONFIG, ST):
        data = open(os.path.join(files["runtime"]["v2"], name), "rb").read()
        blob = hashlib.sha256(data).hexdigest() if name == ST else hashlib.sha1(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", repo / "snapshots" / commit / name)
    return str(cache)


@pytest.fixture(scope="module")
def server(files, s3, web, hub):
    put, _, env = s3
    put("team/a", files["runtime"]["new"])
    put("ondemand/cold-s3", files["runtime"]["v2"])
    proc, url = start_server(files, "--allowed-adapter-uri", "s3://adapters/team", "--allowed-adapter-uri",
                             f"{web}/ok", "--allowed-adapter-uri", "hf://acme", "--lora-resolver-uri",
                             "s3://adapters/ondemand", "--max-adapter-download-bytes", str(1 << 20),
                             env={**env, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": hub})
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def http_client(server):
    with httpx.Client(base_url=server, timeout=120) as c:
        yield c


def load(http, name: str, uri: str, **fields):
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": uri, **fields})


def text(http, model: str) -> str:
    r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_an_s3_adapter_answers_as_its_files_and_a_changed_object_is_fetched_again(files, s3, http_client, oracle):
    put = s3[0]
    first = load(http_client, "s3a", "s3://adapters/team/a")
    assert first.status_code == 200, first.text
    assert text(http_client, "s3a") == oracle["new"]
    assert http_client.get("/v1/models/s3a").json()["root"] == "s3://adapters/team/a"
    again = load(http_client, "s3a", "s3://adapters/team/a")  # unchanged: nothing fetched, the same revision
    assert again.status_code == 200 and "already loaded" in again.text
    assert again.headers["x-adapter-revision"] == first.headers["x-adapter-revision"]
    put("team/a", files["runtime"]["v2"])  # the trainer's new weights, under the same key
    changed = load(http_client, "s3a", "s3://adapters/team/a")
    assert changed.status_code == 200 and changed.headers["x-adapter-revision"] != first.headers["x-adapter-revision"]
    assert text(http_client, "s3a") == oracle["v2"]


def test_http_and_hub_adapters_answer_as_their_files(web, http_client, oracle):
    assert load(http_client, "web", f"{web}/ok/b").status_code == 200
    assert text(http_client, "web") == oracle["other"]
    assert load(http_client, "hub", "hf://acme/legal").status_code == 200
    assert text(http_client, "hub") == oracle["v2"]


def test_an_adapter_nobody_registered_is_fetched_from_the_resolver_store(http_client, oracle):
    assert text(http_client, "cold-s3") == oracle["v2"]
    assert http_client.get("/v1/models/cold-s3").json()["root"] == "s3://adapters/ondemand/cold-s3"
    missing = http_client.post("/v1/completions", json={"model": "nowhere", "prompt": PROMPT, "max_tokens": 2})
    assert missing.status_code == 404 and "store s3://adapters/ondemand" in missing.json()["error"]["message"]


def test_uris_outside_the_prefixes_too_large_or_not_as_the_store_said_are_refused(files, s3, web, http_client):
    put, client, _ = s3
    for uri in (f"{web}/other/b", f"{web}/ok/../other/b", "s3://adapters/teams/a", "s3://elsewhere/team/a",
                "ftp://adapters/team/a", f"{web}/ok/b?x=1"):
        r = load(http_client, "refused", uri)
        assert r.status_code == 400, (uri, r.text)
    assert "not under an allowed" in load(http_client, "refused", f"{web}/other/b").json()["error"]["message"]
    client.put_object(Bucket="adapters", Key="team/big/adapter_config.json", Body=b"{}")
    client.put_object(Bucket="adapters", Key="team/big/adapter_model.safetensors", Body=b"\0" * (1 << 20))
    big = load(http_client, "big", "s3://adapters/team/big")
    assert big.status_code == 400 and "over the 1048576" in big.json()["error"]["message"]
    lying = load(http_client, "lying", f"{web}/ok/lying")
    assert lying.status_code == 400 and "the store said" in lying.json()["error"]["message"]
    absent = load(http_client, "absent", "s3://adapters/team/absent")
    assert absent.status_code == 400 and "has no adapter_config.json" in absent.json()["error"]["message"]
    models = [m["id"] for m in http_client.get("/v1/models").json()["data"]]
    assert not {"refused", "big", "lying", "absent"} & set(models)


def test_a_failing_store_is_a_502_and_streams_go_on_while_a_fetch_stalls(web, http_client):
    broken = load(http_client, "broken", f"{web}/ok/broken")
    assert broken.status_code == 502 and "the store failed" in broken.json()["error"]["message"]
    answers = []
    stalled = threading.Thread(target=lambda: answers.append(load(http_client, "stalled", f"{web}/ok/stall")))
    stalled.start()
    body = {"model": "s1", "prompt": "x", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with http_client.stream("POST", "/v1/completions", json=body) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 40 and not answers  # every token while the fetch hangs
    _Handler.release.set()
    stalled.join(60)
    assert answers[0].status_code == 502 and "503" in answers[0].json()["error"]["message"]


def test_a_fetch_from_a_store_that_never_answers_ends_at_its_timeout(tmp_path):
    """A socket that listens and never answers (the kernel accepts the connection; nobody reads it)."""
    from loramux.adapters.remote import RemoteCache, RemoteStoreError

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", free_port()))
        silent.listen(8)
        cache = RemoteCache(str(tmp_path), 1 << 20, timeout_s=1.0)
        with pytest.raises(RemoteStoreError, match="the store failed"):
            cache.fetch(f"http://127.0.0.1:{silent.getsockname()[1]}/a")
        assert os.listdir(tmp_path) == []  # nothing half-written


def test_a_uris_older_versions_leave_the_cache_unless_in_use(files, s3, tmp_path, monkeypatch):
    from loramux.adapters.remote import RemoteCache

    put, _, env = s3
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cache, uri, dirs = RemoteCache(str(tmp_path), 1 << 20, 60), "s3://adapters/team/pruned", []
    for name in ("new", "other", "v2"):  # three versions of one object
        put("team/pruned", files["runtime"][name])
        dirs.append(cache.fetch(uri))
        cache.prune(uri, keep=2, in_use={dirs[0]})
    assert len(set(dirs)) == 3 and all(os.path.isdir(d) for d in dirs)  # the first is in use
    assert cache.fetch(uri) == dirs[2]  # unchanged: the same directory, nothing fetched
    cache.prune(uri, keep=2, in_use=set())
    assert [os.path.isdir(d) for d in dirs] == [False, True, True]
