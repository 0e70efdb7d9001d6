"""Running `loramux serve` in tests: a tiny checkpoint with adapters, a server subprocess on a free port."""
import itertools
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from conftest import save_checkpoint, save_peft_adapter, tiny_llama

CHAT_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}>"
MAX_MODEL_LEN = 64


def _port_range() -> range:
    """This test process's ports: below the kernel's ephemeral range (its bind(0) picks never land here) and
    apart from every other pytest-xdist worker's, so two workers never probe the same port and one server's
    /health can never be another's."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    return range(20000 + 1000 * index, 21000 + 1000 * index)


_PORTS = _port_range()
_next_port = itertools.count(random.randrange(len(_PORTS)))  # random start: suite runs side by side differ too


def free_port() -> int:
    for _ in range(len(_PORTS)):
        port = _PORTS[next(_next_port) % len(_PORTS)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS}")


def make_files(tmp_path_factory, **model_overrides):
    """A tiny checkpoint with a chat template, adapters served at start-up, and a runtime-load dir."""
    root = tmp_path_factory.mktemp("srv")
    base = tiny_llama(**model_overrides)
    model = save_checkpoint(base, root / "model")
    with open(os.path.join(model, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    served = {f"s{i}": save_peft_adapter(base, root / f"s{i}", seed=300 + i, r=4 * (i + 1)) for i in range(5)}
    allowed = root / "allowed"
    runtime = {name: save_peft_adapter(base, allowed / name, seed=400 + i, r=8)
               for i, name in enumerate(["new", "other", "v2"])}
    save_peft_adapter(base, allowed / "huge", r=64)
    resolvable = root / "resolvable"  # for --lora-resolver-dir: adapters nobody registers
    on_demand = {name: save_peft_adapter(base, resolvable / name, seed=500 + i, r=8)
                 for i, name in enumerate(["cold", "acme/legal"])}
    return {"root": root, "model": model, "served": served, "allowed": str(allowed), "runtime": runtime,
            "resolvable": str(resolvable), "on_demand": on_demand}


def offline_llm(files, adapters: dict[str, str], max_model_len: int = MAX_MODEL_LEN):
    """The engine start_server serves (the same checkpoint, slots and rank), offline, with `adapters` loaded."""
    from loramux import LoRAConfig
    from loramux.llm import LLM

    llm = LLM(model=files["model"], lora=LoRAConfig(max_loras=4, max_lora_rank=32), dtype="float32",
              kv_cache_memory=2**23, max_model_len=max_model_len)
    for name, path in adapters.items():
        assert llm.load_adapter(name, path)
    return llm


def start_server(files, *extra, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    modules = [f"{name}={path}" for name, path in files["served"].items()]
    cmd = [sys.executable, "-m", "loramux", "serve", "--model", files["model"], "--port", str(port),
           "--dtype", "float32", "--max-loras", "4", "--max-lora-rank", "32", "--max-model-len", str(MAX_MODEL_LEN),
           "--served-model-name", "tiny", "--allowed-adapter-dir", files["allowed"], "--log-level", "warning",
           "--lora-modules", *modules, *extra]
    log = open(os.path.join(files["root"], f"server-{port}.log"), "w+")  # a file: a full pipe would block the server
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True,
                            env=None if env is None else {**os.environ, **env})
    proc.log = log
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {server_log(proc)[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError("server did not become healthy")


def server_log(proc: subprocess.Popen) -> str:
    proc.log.flush()
    proc.log.seek(0)
    return proc.log.read()


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """predicate()'s first truthy value, polled until `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"not within {timeout} s: {what}")


def metric(url: str, name: str, headers: dict | None = None) -> float:
    """The value of one sample in /metrics (name with its labels, as written there), 0 when absent."""
    for line in httpx.get(f"{url}/metrics", headers=headers or {}, timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def paused_while_running(client, http: httpx.Client, model: str, prompt: str = "w", max_tokens: int = 56,
                         check=None):
    """A streamed greedy request on `model`, admitted and then frozen where it is by POST /pause (mode keep):
    while paused it stays running and nothing steps, whatever the machine's speed. If it ended before the pause
    took effect, check(text) must hold for it and a new one is tried. Returns its stream and its text so far.
    (The engine must run nothing else.)"""
    for _ in range(10):
        stream = iter(client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        first = next(stream).choices[0].text  # admitted, on the adapter's identity now
        paused = http.post("/pause", params={"mode": "keep", "clear_cache": False})
        assert paused.status_code == 200 and paused.json() == {"status": "paused"}, paused.text
        assert http.get("/is_paused").json() == {"is_paused": True}
        if metric(str(http.base_url).rstrip("/"), "loramux:num_requests_running", dict(http.headers)) == 1:
            return stream, first
        assert http.post("/resume").status_code == 200
        text = first + "".join(chunk.choices[0].text for chunk in stream)
        assert check is None or check(text), text
    raise AssertionError("the request ended before the pause every time")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


def child_pid(parent_pid: int, name: str) -> int:
    """The child of `parent_pid` the server named `name` (loramux-http, loramux-engine, loramux-grammar)."""
    with open(f"/proc/{parent_pid}/task/{parent_pid}/children") as f:
        for pid in f.read().split():
            try:
                with open(f"/proc/{pid}/comm") as c:
                    if c.read().strip() == name:
                        return int(pid)
            except FileNotFoundError:  # it just exited
                continue
    raise LookupError(f"no {name} process under {parent_pid}")


def frontend_pid(server_pid: int) -> int:
    """`loramux serve` runs the HTTP front end as a child (server/supervisor.py)."""
    return child_pid(server_pid, "loramux-http")


def engine_pid(server_pid: int) -> int:
    return child_pid(frontend_pid(server_pid), "loramux-engine")




NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)
"""Test clients open a connection per request: a pooled connection the server closes after its keep-alive
timeout can be picked for the next request in the instant it closes (a client-side race, seen once as a
connection error), and the tests use no retries."""


def openai_client(url: str, api_key: str = "none"):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0,
                         http_client=httpx.Client(limits=NO_KEEPALIVE, timeout=120))
